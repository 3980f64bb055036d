"""The fair line's pure parts: the policy's start tags and costs, a call's flow, the simulator's
line, and the config's typed errors (`fleet.policy.fairness`, `gateway.call_spec`, `simulator.line`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.config import ConfigError, load_config
from fleet.policy.fairness import FlowTag, call_cost, class_clock, fair_line, flow_start, jain_index
from gateway.call_spec import call_flow, fair_place
from simulator.arrivals import Call
from simulator.line import ClassLine
from tests.paths import TESTS


def test_a_call_costs_its_weighted_tokens_over_its_keys_weight() -> None:
    assert call_cost(100, 50, output_weight=2.0) == 200
    assert call_cost(100, 50, output_weight=2.0, weight=2.0) == 100
    assert call_cost(0, 0, output_weight=2.0) == 1  # never free: a flow's calls keep their order


def test_start_tags() -> None:
    assert flow_start(500, None, backlogged=False, now_ms=0, half_life_s=60) == 500  # new: level, not 0
    rec = FlowTag(tag=1500, at_ms=0)
    assert flow_start(500, rec, backlogged=True, now_ms=60_000, half_life_s=60) == 1500  # after its own
    assert flow_start(500, rec, backlogged=False, now_ms=0, half_life_s=60) == 1500  # just served: it owes
    assert flow_start(500, rec, backlogged=False, now_ms=60_000, half_life_s=60) == 1000  # half forgiven
    assert flow_start(2000, rec, backlogged=False, now_ms=0, half_life_s=60) == 2000  # behind the clock
    assert class_clock(10, None) == 10 and class_clock(10, 40) == 41 and class_clock(90, 40) == 90


def test_admission_sees_only_its_class_ahead_under_fair() -> None:
    from fleet.config import Priority

    assert fair_line((1, 40, 3, 0), Priority.interactive, 2) == (1, 2, 3, 0)
    assert fair_line((1, 40, 3, 0), Priority.interactive, None) == (1, 40, 3, 0)


def test_jain() -> None:
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([9, 0, 0]) == pytest.approx(1 / 3)


def test_a_calls_flow_is_its_chain_then_session_then_key_then_client() -> None:
    h = {"x-session-id": "s-1"}
    assert call_flow("c1", h, ["x-session-id"], "agent", "1.2.3.4") == "chain:c1"
    assert call_flow("", h, ["x-session-id"], "agent", "1.2.3.4") == "session:s-1"
    assert call_flow("", {}, ["x-session-id"], "agent", "1.2.3.4") == "key:agent"
    assert call_flow("", {}, ["x-session-id"], None, "1.2.3.4") == "client:1.2.3.4"
    odd = call_flow("", {"x-session-id": "a b{c}" * 40}, ["x-session-id"], None, None)
    assert odd.startswith("session:#") and len(odd) < 64  # named by its digest, bounded


def test_a_fifo_tier_places_nothing() -> None:
    cfg = load_config(TESTS / "fleet-fair.yaml")
    assert fair_place(cfg, "fifo", "key:a", prompt_tokens=10, output_tokens=10, weight=1.0) is None
    p = fair_place(cfg, "fair", "key:a", prompt_tokens=10, output_tokens=10, weight=1.0)
    assert p is not None and p.cost == 30 and p.flow == "key:a"


class _Req:
    def __init__(self, flow: str) -> None:
        self.call = Call("t", 1, 10, 10, flow)
        self.score, self.lseq = 0.0, 0


def test_the_simulators_line_orders_as_the_redis_line() -> None:
    line = ClassLine()
    flood = [_Req("key:flood") for _ in range(20)]
    quiet = [_Req("key:quiet") for _ in range(2)]
    for i, r in enumerate(flood + quiet):
        line.place(r, i + 1, 30, 0, 60.0)  # type: ignore[arg-type]
    assert line.ahead("key:other", 0, 60.0) == 1  # just after the head
    order = [line.popleft() for _ in range(4)]
    assert quiet[0] in order[:3]
    line.put_back(order[0])  # preempted: back at the head, its own place
    assert line[0] is order[0]


@pytest.mark.parametrize(("text", "field"), [
    ("fair_line: {session_headers: ['x session']}", "fair_line.session_headers"),
    ("fair_line: {half_life_s: 0}", "fair_line.half_life_s"),
])
def test_a_bad_fair_line_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    p = tmp_path / "f.yaml"
    p.write_text((TESTS / "fleet-fair.yaml").read_text() + "\n" + text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert field in str(e.value)


def test_an_unknown_fairness_names_the_tier(tmp_path: Path) -> None:
    p = tmp_path / "f.yaml"
    p.write_text((TESTS / "fleet-fair.yaml").read_text().replace("fairness: fifo", "fairness: lottery"))
    with pytest.raises(ConfigError, match=r"tiers\.fifo\.fairness"):
        load_config(p)
