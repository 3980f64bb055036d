"""What a call asks an engine to do: the `payload` of its request hash (`req:<id>`).

Writer: the gateway, once, at enqueue (`CallPayload.encode`). Reader: the worker that claims
it (`CallPayload.decode`). The payload is the caller's OpenAI request as it was sent, with
the few things the fleet decided about it beside it (not inside it): the caller's body is
spliced in as the bytes that arrived, so tool schemas, `strict`, `additionalProperties` and
any engine extension (`guided_json`, `chat_template_kwargs`, ...) reach the engine byte
for byte, and the gateway pays no encode for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

Kind = Literal["chat", "completion"]


class BadPayload(ValueError):
    """A payload that is not a call's (a foreign or corrupted entry in the line)."""


@dataclass(frozen=True, slots=True)
class CallPayload:
    kind: Kind
    body: dict[str, Any]  # the caller's request, as sent
    max_tokens: int  # the output bound admission planned with: the caller's, else the tier's default
    key: str  # the caller's key name: the ledger counts tokens by key
    stream: bool

    @staticmethod
    def encode(kind: Kind, raw_body: bytes, *, max_tokens: int, key: str, stream: bool) -> bytes:
        """The payload, with `raw_body` (a JSON object, already parsed once by the caller) spliced in."""
        head = orjson.dumps({"kind": kind, "max_tokens": max_tokens, "key": key, "stream": stream})
        return b"".join((head[:-1], b',"body":', raw_body, b"}"))

    @classmethod
    def decode(cls, raw: bytes | str) -> CallPayload:
        try:
            d = orjson.loads(raw)
            body = d["body"]
            if d["kind"] not in ("chat", "completion") or not isinstance(body, dict):
                raise BadPayload(f"not a call's payload: kind {d['kind']!r}")
            return cls(kind=d["kind"], body=body, max_tokens=int(d["max_tokens"]), key=str(d.get("key") or ""),
                       stream=bool(d.get("stream")))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, BadPayload):
                raise
            raise BadPayload(f"not a call's payload: {type(e).__name__}: {e}") from None
