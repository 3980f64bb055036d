"""The sim engine's replica model, shared by the worker's sim engine (step by step, in real time)
and the simulator (batch change to batch change, in simulated time): both drivers give the same
times, the KV cache is reserved the same way, and the engine streams what the model says."""

from __future__ import annotations

import asyncio

import pytest

from fleet.config import DecodeStep, SimProfile
from fleet.replica_model import ReplicaModel, kv_need, prefill_s, service_s, step_s
from workers.engines.base import EngineRequest
from workers.engines.sim import SimEngine

P = SimProfile(weights_gb=0.0, load_gb_s=1.0, warmup_s=0.0, prefill_tokens_per_s=1000.0,
               decode_step=DecodeStep(base_s=0.01, per_seq_s=0.005), kv_capacity_tokens=1000)


def test_decode_is_re_timed_as_the_batch_changes_alike_for_both_drivers() -> None:
    """A joins with 10 tokens; after its 4th, B joins with 3. Step by step (the engine): each
    step lasts the step time of the batch decoding at its start."""
    s1, s2 = step_s(P, 1), step_s(P, 2)
    engine = ReplicaModel(P)
    engine.join("a", 10)
    t, finished = 0.0, {}
    for n in range(1, 11):
        if n == 5:
            engine.join("b", 3)
        t += engine.step_s()
        for key in engine.step():
            finished[key] = t
    assert finished == pytest.approx({"b": 4 * s1 + 3 * s2, "a": 4 * s1 + 3 * s2 + 3 * s1})

    # Change to change (the simulator): the same finishes, with no event in between.
    sim = ReplicaModel(P)
    sim.join("a", 10)
    t = 4 * s1
    assert sim.advance(t) == [] and sim.tokens_of(sim.decoding["a"]) == pytest.approx(4)
    sim.join("b", 3)
    t += sim.time_to_next_finish()  # type: ignore[operator]
    assert sim.advance(sim.time_to_next_finish()) == ["b"] and t == pytest.approx(finished["b"])  # type: ignore[arg-type]
    t += sim.time_to_next_finish()  # type: ignore[operator]
    assert sim.advance(sim.time_to_next_finish()) == ["a"] and t == pytest.approx(finished["a"])  # type: ignore[arg-type]
    assert sim.time_to_next_finish() is None
    # Alone in the batch, a request takes its prefill and its tokens at batch 1.
    assert service_s(P, 200, 10, 1) == pytest.approx(prefill_s(P, 200) + 10 * s1)


def test_kv_is_reserved_for_the_longest_life_at_most_the_cache() -> None:
    m = ReplicaModel(P)
    assert kv_need(P, 100, 300) == m.kv_need(100, 300) == 400
    assert m.kv_need(900, 900) == 1000  # never more than the whole cache, so it can always run alone
    m.reserve(400)
    assert m.fits(600) and not m.fits(601)
    m.free(400)
    assert m.fits(1000)


async def test_the_sim_engine_streams_what_the_model_says_and_waits_for_kv() -> None:
    """Two requests that cannot share the cache: the second starts only once the first has freed it."""
    e = SimEngine(P.model_copy(update={"kv_capacity_tokens": 60}), time_scale=0.2)
    await e.start()
    order: list[str] = []

    async def run(rid: str) -> int:
        n = 0
        async for d in e.generate(EngineRequest.build(rid, "completion", prompt="x" * 40, max_tokens=25,
                                                     ignore_eos=True)):
            n = d.completion_tokens
            order.append(rid)
        return n

    try:
        counts = await asyncio.wait_for(asyncio.gather(run("one"), run("two")), 30)
    finally:
        await e.stop()
    assert counts == [25, 25]
    assert order == ["one"] * 25 + ["two"] * 25  # 35 KV tokens each in a cache of 60: one at a time
    assert e.model.kv_used == 0 and not e.model.decoding
