"""Prefix affinity without Redis: the gateway's prefix key, the replica model's prefix cache,
the scale-in victim and the config."""

from __future__ import annotations

import pytest

from fleet.classes import Affinity
from fleet.config import TierConfig
from fleet.policy import ObservedReplica, scale_in_victims
from fleet.prefix import affinity_key, prefix_key
from fleet.replica_model import PrefixCache
from fleet.store.affinity import AffinityRules

SYSTEM = {"role": "system", "content": "You are a research agent. " * 50}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def chat(*turns: dict, tools: list | None = TOOLS) -> dict:
    return {"model": "mid", "messages": [SYSTEM, *turns], "tools": tools}


def test_every_turn_of_a_conversation_has_its_key_and_another_conversation_another() -> None:
    u1, a1, t1 = {"role": "user", "content": "Price AAPL"}, {"role": "assistant", "content": "calling"}, {
        "role": "tool", "content": "191.2"}
    first = prefix_key("chat", chat(u1))
    assert first.startswith("p:")
    assert prefix_key("chat", chat(u1, a1, t1, {"role": "user", "content": "and MSFT?"})) == first
    assert prefix_key("chat", chat({"role": "user", "content": "Price TSLA"})) != first  # same system and tools
    assert prefix_key("chat", chat(u1, tools=None)) != first  # other tools: another prefix
    assert prefix_key("completion", {"prompt": "x"}) == "" and prefix_key("chat", {"messages": "no"}) == ""
    assert affinity_key("run-7", first) == "c:run-7" and affinity_key("", first) == first


def test_the_prefix_cache_spares_what_it_holds_and_evicts_the_coldest() -> None:
    c = PrefixCache(10_000)
    assert c.uncached_tokens("a", 1500) == 1500  # first turn: nothing cached
    c.store("a", 1600)
    assert c.uncached_tokens("a", 1900) == 300  # the next turn computes only what is new
    c.store("b", 5000)
    c.store("a", 2000)  # "a" used again: "b" is now the coldest
    c.store("c", 5000)  # 12,000 > 10,000: "b" goes
    assert "b" not in c and "a" in c and "c" in c and c.used <= c.capacity
    assert c.uncached_tokens(None, 700) == 700  # a call with no prefix key pays it all
    assert c.hit_rate == pytest.approx(1600 / (1500 + 1900 + 700))
    assert PrefixCache(0).uncached_tokens("a", 10) == 10


def test_scale_in_takes_the_replica_with_the_coldest_cache() -> None:
    members = [ObservedReplica("warm-idle", "ready", 8, 0, 1.0, cached=40),
               ObservedReplica("cold-busy", "ready", 8, 2, 2.0, cached=1),
               ObservedReplica("cold-new", "starting", 8, 0, 3.0, cached=0)]
    assert [r.id for r in scale_in_victims(members, 1)] == ["cold-busy"]  # never the starting one
    assert [r.id for r in scale_in_victims(members, 2)] == ["cold-busy", "warm-idle"]


def test_the_hold_defaults_to_a_small_fraction_of_the_class_wait_limit() -> None:
    tc = TierConfig(wait_limit_s={"committed": 30.0, "interactive": 4.0, "speculative": 2.0, "background": 1.0})
    rules = AffinityRules.of(tc.affinity, tc.wait_limit_s)
    assert rules is not None and rules.wait_ms == (50, 40, 20, 10)  # 1 %, at most 50 ms
    assert AffinityRules.of(Affinity(wait_ms={"committed": 5}), tc.wait_limit_s).wait_ms[0] == 5  # type: ignore[union-attr]
    assert AffinityRules.of(Affinity(enabled=False), tc.wait_limit_s) is None
    with pytest.raises(ValueError, match="urgent"):
        Affinity(wait_ms={"urgent": 5})
