"""An instant OpenAI-compatible server: the zero-latency engine the gateway is
measured against (the same thing LiteLLM's proxy was measured in front of)."""

from __future__ import annotations

import sys
import time
import uuid

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


async def chat(request: Request) -> Response:
    body = orjson.loads(await request.body())
    n = int(body.get("max_tokens") or 16)
    text = " ".join(["token"] * n)
    return Response(orjson.dumps({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "mock"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": n + 4},
    }), media_type="application/json")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning",
                access_log=False)
