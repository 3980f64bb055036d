"""A scripted upstream that speaks Anthropic's Messages API (`POST /v1/messages`), for the `openai`
engine with `upstream_api: messages`. It is not the fleet's code: it answers by a fixed script, as
Anthropic does (whole, or its events: message_start, content blocks with text_delta /
input_json_delta, message_delta with stop_reason and usage, message_stop), and keeps every
request it gets with its path, so a test can tell `/v1/messages` from `/v1/chat/completions`.

- tools, and the last turn carries no tool_result: a tool_use block calling the first tool with
  TOOL_INPUT; stop_reason `tool_use`.
- a tool_result last: text quoting it; otherwise GREETING; stop_reason `end_turn`.
- `stop_sequences` one of which is in the text: the text cut before it; stop_reason `stop_sequence`
  and the sequence named, as Anthropic names it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from fleet.redis_server import free_port
from tests.agent_upstream import served
from tests.harness import TEST_CONFIG

MODEL = "scripted-claude"
GREETING = "Hello from the Messages upstream."
TOOL_INPUT = {"city": "Paris", "days": 3}


class MessagesUpstream:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], dict[str, str]]] = []  # path, body, headers
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models),
                                 Route("/v1/messages", self.messages, methods=["POST"]),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def models(self, _: Request) -> Response:
        return _json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(self, request: Request) -> Response:
        self.seen.append(("/v1/chat/completions", orjson.loads(await request.body()), dict(request.headers)))
        return _json({"error": {"message": "this upstream speaks Messages only", "type": "invalid_request_error"}},
                     404)

    async def messages(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.seen.append(("/v1/messages", body, dict(request.headers)))
        blocks, stop = answer(body)
        blocks, stop, seq = _cut(blocks, stop, body.get("stop_sequences") or [])
        usage = {"input_tokens": 21, "output_tokens": 7}
        if not body.get("stream"):
            return _json({"id": "msg_up1", "type": "message", "role": "assistant", "model": MODEL,
                          "content": blocks, "stop_reason": stop, "stop_sequence": seq, "usage": usage})
        return StreamingResponse(_events(blocks, stop, usage, seq), media_type="text/event-stream")


def _cut(blocks: list[dict[str, Any]], stop: str, sequences: list[str]
         ) -> tuple[list[dict[str, Any]], str, str | None]:
    """The text cut before the first stop sequence it holds, as a model stops on one."""
    for seq in sequences:
        for b in blocks:
            if b["type"] == "text" and seq in b["text"]:
                b["text"] = b["text"][: b["text"].index(seq)]
                return blocks, "stop_sequence", seq
    return blocks, stop, None


def answer(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    last = (body.get("messages") or [{}])[-1].get("content")
    results = [b for b in last if b.get("type") == "tool_result"] if isinstance(last, list) else []
    if body.get("tools") and not results:
        return [{"type": "tool_use", "id": "toolu_up1", "name": body["tools"][0]["name"], "input": TOOL_INPUT}], \
            "tool_use"
    if results:
        content = results[0].get("content")
        text = content if isinstance(content, str) else "".join(b.get("text", "") for b in content or [])
        return [{"type": "text", "text": f"The tool said: {text}"}], "end_turn"
    return [{"type": "text", "text": GREETING}], "end_turn"


async def _events(blocks: list[dict[str, Any]], stop: str, usage: dict[str, Any],
                  seq: str | None = None) -> AsyncIterator[bytes]:
    def event(kind: str, data: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"

    yield event("message_start", {"message": {"id": "msg_up1", "type": "message", "role": "assistant",
                                              "model": MODEL, "content": [], "stop_reason": None,
                                              "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 1}}})
    yield event("ping", {})
    for i, b in enumerate(blocks):
        if b["type"] == "text":
            yield event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
            for word in b["text"].split(" "):
                yield event("content_block_delta", {"index": i, "delta": {"type": "text_delta", "text": word + " "}})
        else:
            yield event("content_block_start", {"index": i, "content_block": {**b, "input": {}}})
            raw = orjson.dumps(b["input"]).decode()
            for part in (raw[: len(raw) // 2], raw[len(raw) // 2:]):
                yield event("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                          "partial_json": part}})
        yield event("content_block_stop", {"index": i})
    yield event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
                                  "usage": {"output_tokens": usage["output_tokens"]}})
    yield event("message_stop", {})


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def messages_config(out: Path, upstream: MessagesUpstream) -> Path:
    """The test fleet with `analysis` on the `openai` engine before `upstream`, which speaks Messages."""
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tiers"]["analysis"].update(engine="openai", openai={"base_url": upstream.base_url,
                                                             "upstream_api": "messages"})
    path = out / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextmanager
def running() -> Iterator[MessagesUpstream]:
    """The scripted upstream on a free loopback port, in a thread of this process."""
    up = MessagesUpstream()
    up.port = free_port()
    with served(up.app(), up.port):
        yield up
