"""A Messages call on the `vllm` engine, answered by vLLM's own Anthropic serving layer.

`vllm serve` answers `POST /v1/messages` with `vllm.entrypoints.anthropic.serving.AnthropicServingMessages`:
it turns the Anthropic body into a chat request (system blocks, inline `role: system` messages,
tool_use and tool_result blocks, `tool_choice`, `thinking`, `output_config`), runs it through its
chat serving layer, and turns the answer back into a message or Anthropic's events. The engine
builds that same object beside its chat and completion ones (`init_app_state` makes all three), so a
Messages call on a `vllm` tier is converted by vLLM's code, not the gateway's mapping.

The worker and the gateway carry chat answers, so what vLLM answers is read back into them here
(`workers.engines.anthropic_upstream`, shared with the `openai` engine's Messages upstream), and the
gateway writes the caller's message or events from them (`gateway.messages_map`, `messages_stream`).

The fleet's request id and priority reach vLLM as `vllm serve` takes them from HTTP, as the
`X-Request-Id` and `X-Vllm-Priority` headers of the request handed to the serving layer: the
engine can then abort the call by its id, and a committed call is scheduled first.
"""

from __future__ import annotations

from typing import Any

import orjson

from workers.engines.anthropic_upstream import StreamMap, chat_answer, messages_body
from workers.engines.base import Delta, EngineError, EngineRequest
from workers.engines.chunks import ChunkReader, whole


def request_of(model: type[Any], req: EngineRequest, model_name: str, max_model_len: int) -> Any:
    """The caller's Anthropic body as vLLM's `AnthropicMessagesRequest`: its model, how it is read,
    and the fleet's output bound: the tier's `max_tokens_limit` cut what the caller asked, and the
    engine's context cuts it again. `max_tokens` is required in Messages, so clients send a bound,
    not a demand (Claude Code asks 32000 of any model); `vllm serve` refuses one past the context
    (a 400 the chat routes keep, where the caller chose the number), vLLM cuts the rest to the
    room the prompt leaves."""
    body = messages_body(req.body, model_name, req.stream, min(req.max_tokens, max_model_len))
    try:
        return model.model_validate(body)
    except ValueError as e:  # pydantic's ValidationError names the field
        raise EngineError(f"vLLM refused the request: {e}", "invalid_request_error", "invalid_value") from None


def http_request(request_id: str, priority: int) -> Any:
    """The HTTP request the serving layer reads the call's id and priority from, as `vllm serve` does."""
    from starlette.requests import Request

    headers = [(b"x-request-id", request_id.encode()), (b"x-vllm-priority", str(priority).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/messages", "headers": headers})


def whole_answer(message: Any) -> Delta:
    """vLLM's whole message (`AnthropicMessagesResponse`) as the engine contract's one delta."""
    return whole(chat_answer(message.model_dump(exclude_none=True)), True)


class EventReader:
    """vLLM's Anthropic events, a piece of its stream at a time, as chat chunks for a `ChunkReader`."""

    def __init__(self, chunks: ChunkReader) -> None:
        self.chunks = chunks
        self._map = StreamMap()

    def feed(self, sse: str) -> list[Delta]:
        """The deltas of one piece of vLLM's stream (`event: ...\\ndata: {...}\\n\\n`, possibly several)."""
        out: list[Delta] = []
        for line in sse.splitlines():
            if not line.startswith("data:"):
                continue
            event = orjson.loads(line[5:].strip())
            if not isinstance(event, dict):
                continue
            if event.get("type") == "error":  # what vLLM's converter sends when the answer failed midway
                err = event.get("error")
                err = err if isinstance(err, dict) else {}
                raise EngineError(str(err.get("message") or event), "engine_error", "stream_error")
            for chunk in self._map.feed(event):
                out.extend(self.chunks.feed(chunk))
        return out
