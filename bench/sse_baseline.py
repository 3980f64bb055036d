"""A trivial SSE server: the baseline `bench/token_relay.py` measures the fleet against.

It writes chat chunks as the gateway writes them (the role chunk with the first token, then
`chunk_tokens` tokens a chunk at `step_s` a token, then the last chunk, the usage chunk and
[DONE]), on the gateway's own stack (Starlette on uvicorn, uvloop, httptools), and does nothing
else: no line, no Redis, no engine. The request names its shape: `max_tokens`, `chunk_tokens`,
`step_s`. Tokens are words after a space, as the sim engine's are.

    python bench/sse_baseline.py PORT
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

WORDS = ("line", "drain", "floor", "ceiling", "shed", "budget", "lease", "tier")


async def chat(request: Request) -> StreamingResponse:
    body = orjson.loads(await request.body())
    n, k, step_s = int(body["max_tokens"]), max(1, int(body["chunk_tokens"])), float(body["step_s"])
    base = {"id": "chatcmpl-baseline", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body["model"]}

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

    async def sse() -> AsyncIterator[bytes]:
        await asyncio.sleep(step_s)
        yield chunk({"role": "assistant", "content": ""}) + chunk({"content": WORDS[0]})
        sent = 1
        while sent < n:
            m = min(k, n - sent)
            await asyncio.sleep(step_s * m)
            yield chunk({"content": "".join(" " + WORDS[(sent + j) % len(WORDS)] for j in range(m))})
            sent += m
        usage = {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": n + 2}
        yield (chunk({}, "length") + b"data: " + orjson.dumps({**base, "choices": [], "usage": usage})
               + b"\n\ndata: [DONE]\n\n")

    return StreamingResponse(sse(), media_type="text/event-stream")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning",
                access_log=False, backlog=4096)
