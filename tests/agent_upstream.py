"""A scripted upstream that answers as OpenAI does, for the `openai` engine's agent tests.

It is not the fleet's code: it answers by a fixed script and checks what it is sent as
OpenAI would, so a test through the fleet can compare what the agent gets with what the
upstream said, field for field, and what the upstream got with what the agent sent.

- tools (and the last turn is not a tool's result, and `tool_choice` is not "none"): tool
  calls, the named function, or with `parallel_tool_calls` (OpenAI's default: true) every
  tool; arguments are a fixed example of each parameter's type; finish reason `tool_calls`.
- a tool's result: it must answer an earlier assistant turn's tool call by its id, or the
  call is refused with OpenAI's 400 ("messages with role 'tool' must be a response to a
  preceding message with 'tool_calls'"); the answer quotes the result.
- `response_format` json_schema / json_object: JSON of it.
- `logprobs`: a logprob per token, with `top_logprobs` alternatives.
- streamed: OpenAI's chunks (the role, content or tool-call fragments by index, the finish
  reason, the usage chunk when asked); not streamed, one body.
Every request body it gets is kept in `seen`, as bytes and parsed.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from fleet.redis_server import free_port
from tests.harness import TEST_CONFIG, Fleet

MODEL = "scripted-model-2026"
FINGERPRINT = "fp_scripted"


class Upstream:
    """The server's state: the requests it saw (raw bytes, parsed)."""

    def __init__(self, token_delay_s: float = 0.0) -> None:
        self.seen: list[tuple[bytes, dict[str, Any]]] = []
        self.port = 0
        # Between streamed tokens: 0 streams as fast as it can; more leaves a test time to
        # abort a call mid-stream, as a model's decode steps would.
        self.token_delay_s = token_delay_s

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def models(self, _: Request) -> Response:
        return _json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        body = orjson.loads(raw)
        self.seen.append((raw, body))
        refusal = _check_turns(body.get("messages") or [])
        if refusal:
            return _json({"error": {"message": refusal, "type": "invalid_request_error", "param": "messages",
                                    "code": None}}, 400)
        message, finish = answer(body)
        tokens = _tokens(message)
        logprobs = {"content": [_logprob(t) for t in tokens], "refusal": None} if body.get("logprobs") else None
        usage = {"prompt_tokens": 11, "completion_tokens": len(tokens), "total_tokens": 11 + len(tokens),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        rid = "chatcmpl-up" + hashlib.sha1(raw).hexdigest()[:12]
        if not body.get("stream"):
            return _json({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": MODEL,
                          "system_fingerprint": FINGERPRINT,
                          "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
                          "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(rid, message, finish, logprobs, usage if include_usage else None,
                                         self.token_delay_s), media_type="text/event-stream")


def answer(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The assistant message and finish reason this script gives `body`."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    tools = [t["function"] for t in body.get("tools") or [] if t.get("type") == "function"]
    choice = body.get("tool_choice")
    if tools and choice != "none" and (choice == "required" or isinstance(choice, dict) or last.get("role") != "tool"):
        if isinstance(choice, dict):
            tools = [t for t in tools if t["name"] == choice["function"]["name"]]
        elif body.get("parallel_tool_calls") is False:
            tools = tools[:1]
        calls = [{"id": f"call_{i}_{t['name']}", "type": "function",
                  "function": {"name": t["name"], "arguments": orjson.dumps(example(t.get("parameters"))).decode()}}
                 for i, t in enumerate(tools)]
        return {"role": "assistant", "content": None, "tool_calls": calls, "refusal": None}, "tool_calls"
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        text = orjson.dumps(example(fmt["json_schema"].get("schema"))).decode()
    elif fmt.get("type") == "json_object":
        text = '{"ok": true}'
    elif last.get("role") == "tool":
        text = f"Done. The tool answered: {last.get('content')}"
    else:
        text = "Hello from the scripted upstream."
    return {"role": "assistant", "content": text, "refusal": None}, "stop"


def example(schema: Any) -> Any:
    """A fixed example of a JSON schema's type (enough for the tests' schemas)."""
    if not isinstance(schema, dict):
        return "x"
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema.get("type", "object")
    if kind == "object":
        return {k: example(v) for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [example(schema.get("items"))]
    return {"integer": 7, "number": 2.5, "boolean": False, "string": "Oslo"}.get(kind)


def _check_turns(messages: list[dict[str, Any]]) -> str | None:
    ids: set[str] = set()
    for m in messages:
        for call in m.get("tool_calls") or []:
            ids.add(call.get("id"))
        if m.get("role") == "tool" and m.get("tool_call_id") not in ids:
            return ("Invalid parameter: messages with role 'tool' must be a response to a preceding message with "
                    "'tool_calls'.")
    return None


def _tokens(message: dict[str, Any]) -> list[str]:
    text = message.get("content") or "".join(c["function"]["arguments"] for c in message.get("tool_calls") or [])
    return [text[i:i + 3] for i in range(0, len(text), 3)] or [""]


def _logprob(token: str) -> dict[str, Any]:
    b = list(token.encode())
    return {"token": token, "logprob": -0.25, "bytes": b,
            "top_logprobs": [{"token": token, "logprob": -0.25, "bytes": b}, {"token": "?", "logprob": -2.5,
                                                                             "bytes": [63]}]}


async def _stream(rid: str, message: dict[str, Any], finish: str, logprobs: dict[str, Any] | None,
                  usage: dict[str, Any] | None, token_delay_s: float = 0.0) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], lp: Any = None, fin: str | None = None, **extra: Any) -> bytes:
        c = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "system_fingerprint": FINGERPRINT, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                                              "finish_reason": fin}], **extra}
        return b"data: " + orjson.dumps(c) + b"\n\n"

    yield chunk({"role": "assistant", "content": "", "refusal": None})
    if message.get("tool_calls"):
        for i, call in enumerate(message["tool_calls"]):
            yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                         "function": {"name": call["function"]["name"], "arguments": ""}}]})
            args = call["function"]["arguments"]
            for j in range(0, len(args), 5):  # arguments in fragments, as OpenAI streams them
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j:j + 5]}}]})
                await asyncio.sleep(token_delay_s)
    else:
        for k, tok in enumerate(_tokens(message)):
            lp = {"content": [logprobs["content"][k]], "refusal": None} if logprobs else None
            yield chunk({"content": tok}, lp)
            await asyncio.sleep(token_delay_s)
    yield chunk({}, None, finish)
    if usage is not None:
        yield b"data: " + orjson.dumps({"id": rid, "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                                        "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def agent_config(out: Path, upstream: Upstream) -> Path:
    """The test fleet with `analysis` on the `openai` engine in front of `upstream`; `routing` stays `sim`."""
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tiers"]["analysis"].update(engine="openai", openai={"base_url": upstream.base_url})
    path = out / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextmanager
def agent_fleet(redis_url: str, out: Path) -> Iterator[tuple[Fleet, Upstream]]:
    """A gateway and one replica of each tier (`routing` sim, `analysis` openai), and the upstream."""
    with running() as up:
        f = Fleet(redis_url, config_path=agent_config(out, up))
        try:
            f.start_gateway()
            f.start_worker("routing")
            f.start_worker("analysis")
            yield f, up
        finally:
            f.stop()


@contextmanager
def served(app: Starlette, port: int) -> Iterator[None]:
    """A scripted upstream's app served on a loopback port, in a thread of this process, until the block ends."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > end:
            raise RuntimeError("the scripted upstream did not start")
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(5)


@contextmanager
def running(token_delay_s: float = 0.0) -> Iterator[Upstream]:
    """The scripted upstream on a free loopback port, in a thread of this process."""
    up = Upstream(token_delay_s)
    up.port = free_port()
    with served(up.app(), up.port):
        yield up
