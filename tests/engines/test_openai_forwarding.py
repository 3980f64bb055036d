"""The `openai` engine's hot path against a real HTTP server (uvicorn): calls reuse one kept-alive
connection, streamed or not, and a non-streamed call is forwarded non-streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from fleet.config import OpenAIUpstream
from fleet.engine_config import ANTHROPIC_BODY
from fleet.redis_server import free_port
from workers.engines.base import EngineRequest
from workers.engines.openai_engine import OpenAIEngine

SEEN: dict[str, list[object]] = {"ports": [], "stream": [], "keys": []}


async def models(_: Request) -> Response:
    return Response(orjson.dumps({"data": [{"id": "m"}]}), media_type="application/json")


async def chat(request: Request) -> Response:
    body = orjson.loads(await request.body())
    SEEN["ports"].append(request.client.port if request.client else None)
    SEEN["stream"].append(body.get("stream"))
    SEEN["keys"].append(sorted(body))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if not body.get("stream"):
        return Response(orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "a b"},
                                                   "finish_reason": "length"}], "usage": usage}),
                        media_type="application/json")

    async def sse() -> AsyncIterator[bytes]:
        for text, fin in (("a", None), (" b", "length")):
            yield b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                                         "finish_reason": fin}]}) + b"\n\n"
        yield b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    port = free_port()
    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    for seen in SEEN.values():
        seen.clear()
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    await asyncio.wait_for(task, 10)


def request(i: int, stream: bool) -> EngineRequest:
    return EngineRequest.build(f"r{i}", "chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                               stream=stream)


async def test_calls_reuse_one_connection_and_non_streamed_calls_go_non_streamed(upstream: str) -> None:
    eng = OpenAIEngine(OpenAIUpstream(base_url=upstream, model="m"), start_timeout_s=10)
    await eng.start()
    try:
        for i in range(6):
            stream = i % 2 == 0
            deltas = [d async for d in eng.generate(request(i, stream))]
            # Streamed, the text as it came; whole, the upstream's message as it came.
            text = "".join(d.text for d in deltas) if stream else deltas[0].choice["message"]["content"]  # type: ignore[index]
            assert text == "a b"
            assert deltas[-1].finish_reason == "length"
            assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (3, 2)  # the upstream's usage
            if not stream:
                assert len(deltas) == 1  # one answer, parsed once
            await asyncio.sleep(0)  # a streamed call's connection goes back once its body is read to the end
            for _ in range(100):
                if not eng._draining:
                    break
                await asyncio.sleep(0.01)
        assert SEEN["stream"] == [True, False, True, False, True, False]
        assert len(set(SEEN["ports"])) == 1, SEEN["ports"]  # six calls, one kept-alive connection
    finally:
        await eng.stop()


async def test_a_degraded_messages_call_reaches_a_chat_upstream_without_its_anthropic_body(upstream: str) -> None:
    """A Messages call carries the caller's Anthropic body for an engine that speaks Messages; degraded to a
    tier whose upstream speaks chat only, it is sent as chat, without that body (OpenAI's API refuses
    unknown fields)."""
    eng = OpenAIEngine(OpenAIUpstream(base_url=upstream, model="m"), start_timeout_s=10)
    await eng.start()
    try:
        req = EngineRequest.build("d1", "chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  **{ANTHROPIC_BODY: {"model": "planner", "max_tokens": 9, "messages": []}})
        deltas = [d async for d in eng.generate(req)]
        assert deltas[-1].finish_reason == "length"
        assert SEEN["keys"] == [["max_tokens", "messages", "model", "stream", "stream_options"]]
    finally:
        await eng.stop()
