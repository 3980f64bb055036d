"""An instant OpenAI-compatible server: the zero-latency engine the gateway is
measured against (the same thing LiteLLM's proxy was measured in front of), and
the upstream the `openai` engine forwards to in `bench/gateway_overhead.py`.

Answers `GET /v1/models` and `POST /v1/chat/completions` / `/v1/completions`,
streaming (one SSE chunk per token, then a usage chunk and `[DONE]`) or not.

    python bench/mock_upstream.py PORT
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


async def models(_: Request) -> Response:
    return Response(orjson.dumps({"object": "list", "data": [{"id": "mock", "object": "model"}]}),
                    media_type="application/json")


async def _complete(request: Request, chat: bool) -> Response:
    body = orjson.loads(await request.body())
    n = int(body.get("max_tokens") or 16)
    model = body.get("model", "mock")
    usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": n + 4}
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    if not body.get("stream"):
        text = " ".join(["token"] * n)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        return Response(orjson.dumps({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}), media_type="application/json")

    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str, finish: str | None) -> bytes:
        c = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
             else {"index": 0, "text": text, "finish_reason": finish})
        return b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                         "choices": [c]}) + b"\n\n"

    async def sse() -> AsyncIterator[bytes]:
        for i in range(n):
            yield chunk("token" if i == 0 else " token", "length" if i == n - 1 else None)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                            "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


async def chat(request: Request) -> Response:
    return await _complete(request, True)


async def completions(request: Request) -> Response:
    return await _complete(request, False)


app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/v1/completions", completions, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning",
                access_log=False)
