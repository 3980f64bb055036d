"""Preemption, the pure choice (`fleet.policy.preemption`) and the line's side of it
(PEEK, PREEMPT, claim caps) on a real Redis."""

from __future__ import annotations

import asyncio

import pytest

from fleet.config import ConfigError, Priority, load_config
from fleet.policy import RunningRequest, WaitingRequest, choose_victim, claim_caps
from fleet.store.events import Done, Failed
from fleet.store.line import Line
from tests.harness import TEST_CONFIG
from tests.harness import enqueue_many as _put

BG, SPEC, INT, COM = int(Priority.background), int(Priority.speculative), int(Priority.interactive), 0


def _run(rid: str, rank: int, progress: int = 0, sent: bool = False, pre: int = 0,
         started: float = 0) -> RunningRequest:
    return RunningRequest(rid, rank, progress, sent, pre, started)


def _choose(running: list[RunningRequest], rank: int = COM, waited: float = 1.0, free: int = 0,
            max_pre: int = 1) -> str | None:
    v = choose_victim(running, WaitingRequest(rank, waited), free_for_waiter=free, max_preemptions=max_pre,
                      min_wait_s=0.01)
    return v.rid if v else None


def test_victim_is_the_lowest_class_with_the_least_progress() -> None:
    running = [_run("int", INT), _run("bg-far", BG, 300), _run("bg-near", BG, 20), _run("spec", SPEC, 0)]
    assert _choose(running) == "bg-near"
    # Among equals, the latest started: the least work thrown away.
    assert _choose([_run("a", BG, 5, started=1), _run("b", BG, 5, started=2)]) == "b"


def test_no_victim_that_sent_tokens_was_preempted_enough_or_is_not_lower() -> None:
    assert _choose([_run("s", BG, 3, sent=True)]) is None  # a stream that has sent: never
    assert _choose([_run("p", BG, 0, pre=1)]) is None  # max_preemptions reached: runs to the end
    assert _choose([_run("p", BG, 0, pre=1)], max_pre=2) == "p"
    assert _choose([_run("c", COM)]) is None  # same class: no
    assert _choose([_run("i", INT)], rank=INT) is None
    assert _choose([_run("b", BG)], rank=SPEC) == "b"  # any higher class may preempt a lower one


def test_no_preemption_while_a_slot_is_free_or_the_waiter_just_arrived() -> None:
    assert _choose([_run("b", BG)], free=1) is None
    assert _choose([_run("b", BG)], waited=0.001) is None


def test_claim_caps_keep_reserved_slots_for_higher_classes() -> None:
    assert claim_caps(4, [BG, BG], {}) == (2, 2, 2, 2)
    assert claim_caps(4, [BG, BG], {COM: 1}) == (2, 1, 1, 1)
    assert claim_caps(4, [COM, BG], {COM: 1}) == (2, 2, 2, 2)  # the committed slot is in use by committed
    assert claim_caps(4, [INT, INT, INT], {COM: 2}) == (1, 0, 0, 0)  # interactive does not fill committed's
    assert claim_caps(4, [], {COM: 1, INT: 1}) == (4, 3, 2, 2)
    caps = claim_caps(8, [BG, INT, SPEC], {COM: 2, SPEC: 1})
    assert list(caps) == sorted(caps, reverse=True)


def test_reserved_slots_name_a_known_class(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text(TEST_CONFIG.read_text().replace("    slots: 4\n    lease_s: 1.0\n    scale_in_hold_s: 1\n",
                                                   "    slots: 4\n    lease_s: 1.0\n    scale_in_hold_s: 1\n"
                                                   "    preemption: {reserved_slots: {urgent: 1}}\n", 1))
    with pytest.raises(ConfigError, match=r"preemption\.reserved_slots"):
        load_config(bad)
    assert load_config(TEST_CONFIG).tiers["routing"].preemption.enabled is True  # on by default



async def test_victim_goes_back_to_the_head_of_its_class_in_arrival_order(line: Line) -> None:
    bg = await _put(line, Priority.background, 4)
    running = await line.claim("w1", 2, 5)  # bg[0], bg[1] run; bg[2], bg[3] wait
    (com,) = await _put(line, Priority.committed)
    w = await line.peek_waiter()
    assert w is not None and w.rid == com and w.rank == 0
    assert await line.preempt(com, bg[1], running[1].owner, max_preemptions=1)
    # The old attempt's lease is gone: it can neither finish the request nor stream into it.
    assert not await line.finish(bg[1], "completed", Done(1, "stop", {}), owner=running[1].owner)
    assert await line.emit([(bg[1], running[1].owner, b'"text":"a","logprobs":null', True, "")]) == [0]
    assert await line.peek_waiter() is not None  # bg[1] waits again, unmarked
    order = await line.claim("w1", 10, 5)
    assert [c.rid for c in order] == [com, bg[1], bg[2], bg[3]]  # ahead of what arrived after it
    assert order[1].preempted == 1 and order[1].attempt == 2
    snap = await line.observe()
    assert snap.counters["preempted"] == 1 and snap.counters["preempted:background"] == 1


async def test_one_preemption_per_waiting_call_across_replicas(line: Line) -> None:
    bg = await _put(line, Priority.background, 2)
    a = (await line.claim("A", 1, 5))[0]
    b = (await line.claim("B", 1, 5))[0]
    (com,) = await _put(line, Priority.committed)
    results = await asyncio.gather(line.preempt(com, a.rid, a.owner, max_preemptions=1),
                                   line.preempt(com, b.rid, b.owner, max_preemptions=1))
    assert sorted(results) == [False, True]  # exactly one replica gave up a slot
    w = await line.peek_waiter()
    assert w is not None and w.rid in bg  # the committed call is marked; the next waiter is the victim
    # Whichever replica claims first gets the committed call, once.
    got = await asyncio.gather(line.claim("A", 1, 5), line.claim("B", 1, 5))
    rids = [c.rid for g in got for c in g]
    assert rids.count(com) == 1 and len(rids) == len(set(rids))


async def test_peek_sees_only_classes_that_could_preempt_and_a_stale_mark_expires(line: Line) -> None:
    await _put(line, Priority.background, 2)
    a, _ = await line.claim("A", 2, 5)
    await _put(line, Priority.background)
    assert await line.peek_waiter(BG) is None  # nothing above background waits: nothing to look at
    (com,) = await _put(line, Priority.committed)
    assert (await line.peek_waiter(BG)).rid == com  # type: ignore[union-attr]
    assert await line.preempt(com, a.rid, a.owner, max_preemptions=1, stale_s=0.2)
    assert await line.peek_waiter(BG, stale_s=0.2) is None  # marked: no second preemption for it
    # Its replica died before claiming it: once the mark is older than a lease, another may make room.
    await asyncio.sleep(0.3)  # the mark's age is the point
    assert (await line.peek_waiter(BG, stale_s=0.2)).rid == com  # type: ignore[union-attr]


async def test_preempt_refuses_a_streamed_victim_a_lower_waiter_and_past_max(line: Line) -> None:
    await _put(line, Priority.interactive)
    await _put(line, Priority.background, 2)
    inter, bg0, bg1 = await line.claim("w", 3, 5)
    (spec,) = await _put(line, Priority.speculative)
    assert not await line.preempt(spec, inter.rid, inter.owner, max_preemptions=3)  # not lower
    await line.emit([(bg0.rid, bg0.owner, b'"text":"a","logprobs":null', True, "")])
    (com,) = await _put(line, Priority.committed)
    assert not await line.preempt(com, bg0.rid, bg0.owner, max_preemptions=3)  # it streamed
    assert not await line.preempt(com, bg1.rid, bg1.owner, max_preemptions=0)  # past max
    assert await line.preempt(com, bg1.rid, bg1.owner, max_preemptions=1)
    assert not await line.preempt(com, inter.rid, inter.owner, max_preemptions=1)  # com is marked


async def test_cancel_and_deadline_still_end_a_preempted_request_in_the_line(line: Line) -> None:
    await _put(line, Priority.background)
    await _put(line, Priority.background, deadline_ms=400)
    a, b = await line.claim("w", 2, 5)
    c1, c2 = await _put(line, Priority.committed, 2)
    assert await line.preempt(c1, a.rid, a.owner, max_preemptions=1)
    assert await line.preempt(c2, b.rid, b.owner, max_preemptions=1)
    await line.claim("w", 2, 5)  # the committed calls take the slots
    assert await line.finish(a.rid, "cancelled") == "queued"  # back in the line: no engine to abort
    await asyncio.sleep(0.5)  # let b's 400 ms deadline pass while it waits in the line (that is the point)
    assert await line.claim("w", 5, 5) == []  # b expired on the way, a was cancelled
    snap = await line.observe()
    assert snap.counters["cancelled"] == 1 and snap.counters["expired"] == 1 and snap.waiting == 0
    events = await line.read_events(b.rid, "0-0", 100)
    assert isinstance(events[-1][1], Failed) and events[-1][1].type == "deadline_exceeded"


async def test_claim_caps_leave_reserved_slots_for_higher_classes(line: Line) -> None:
    bg = await _put(line, Priority.background, 3)
    got = await line.claim("w", 4, 5, caps=claim_caps(4, [], {COM: 2}))
    assert [c.rid for c in got] == bg[:2]  # two slots stay free for committed
    assert (await line.observe()).by_class == (0, 0, 0, 1)  # the third went back, in its place
    (com,) = await _put(line, Priority.committed)
    got = await line.claim("w", 2, 5, caps=claim_caps(4, [BG, BG], {COM: 2}))
    assert [c.rid for c in got] == [com]


# --- The simulator models preemption through the same policy function ------------------------

def _saturated(preempt: bool) -> dict:  # type: ignore[type-arg]
    tier = {"warm_floor": 2, "max_replicas": 2, "slots": 4, "hourly_usd": 1.0, "drain_threshold_s": 1000.0,
            # Nothing shed by the line: every class may wait as long as background (limits shed from the bottom).
            "wait_limit_s": {c: 3000.0 for c in ("committed", "interactive", "speculative", "background")},
            "preemption": {"enabled": preempt, "max_preemptions": 1},
            "sim": {"weights_gb": 1, "load_gb_s": 10, "warmup_s": 0, "kv_capacity_tokens": 200000,
                    "decode_step": {"base_s": 0.02, "per_seq_s": 0.001}}}
    return {"start": "2026-11-30T09:00:00", "duration": "4m", "seed": 3, "fleet_config": "configs/fleet.yaml",
            "fleet": {"tiers": {"planner": tier}},
            "arrivals": [{"tier": "planner", "class": "background", "rate": 1.0, "prompt_tokens": 200,
                          "output_tokens": 512, "deadline_ms": 3_000_000},
                         {"tier": "planner", "class": "committed", "rate": 0.2, "prompt_tokens": 200,
                          "output_tokens": 20, "deadline_ms": 300_000}]}


def test_the_simulator_preempts_through_the_policy_and_reports_it() -> None:
    from simulator.report import render_summary, summarize
    from simulator.run import simulate
    from simulator.scenario import Scenario, parse_scenario

    def bare(preempt: bool) -> Scenario:
        sc = parse_scenario(_saturated(preempt))
        # No slot kept for committed (the shipped config keeps one, and the replay honours it since
        # the claim rule is shared, decision 0080): preemption alone makes room here.
        sc.cfg.tiers["planner"].preemption.reserved_slots = {}
        return sc

    runs = {p: simulate(bare(p), "fleet") for p in (False, True)}
    with_, without = runs[True].tiers["planner"].outcomes, runs[False].tiers["planner"].outcomes
    assert without[3].preempted == 0 and with_[3].preempted > 0
    assert with_[0].preempted == 0  # nothing preempts committed work
    # Committed calls no longer wait for a 512-token generation to end.
    p50 = sorted(with_[0].waits)[len(with_[0].waits) // 2]
    assert p50 < 0.5 < sorted(without[0].waits)[len(without[0].waits) // 2]
    assert with_[0].completed == without[0].completed > 0
    doc = summarize(runs[True])
    assert doc["tiers"]["planner"]["classes"]["background"]["preempted"] == with_[3].preempted
    assert f"planner/background {with_[3].preempted}" in render_summary(doc)
    assert "preempted (" not in render_summary(summarize(runs[False]))
