"""One call's result stream (`res:<id>`, a Redis STREAM): the typed events its caller reads back.

Writers: the worker holding the call's lease (its chunks, then how it ended), the gateway
(the deadline passed: `Line.finish` with a `Failed`), and the line's own scripts for the ends
they decide (the deadline passed in the line, the worker was lost): their entries are this
module's encodings too, rendered into the Lua once (`lua_literal`). Reader: the gateway's
result reader (`Line.read_results`), one per gateway process; tests read through `decode`.

An entry has one field, named by the event's kind, so a reader tells a chunk from an end
without parsing anything:

    c   a chunk of the answer: the members of one streamed choice as JSON, without the
        braces (`"delta":{"content":"hi"},"logprobs":null` for chat, `"text":"hi",
        "logprobs":null` for a completion). The gateway splices these bytes into its SSE
        chunk: on the token path nothing is decoded and encoded again. A chunk may also
        carry `m`, the engine's model name, on the first chunk of an attempt.
    d   the call completed: JSON of `Done`
    f   the call failed (or ran out of time): JSON of `Failed`
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson

CHUNK, DONE, FAILED, MODEL = b"c", b"d", b"f", b"m"


@dataclass(frozen=True, slots=True)
class Chunk:
    """Streamed members of the call's one choice (see the module doc), as bytes."""

    body: bytes
    model: str | None = None  # the engine's model name, on an attempt's first chunk

    def members(self) -> dict[str, Any]:
        """The chunk's members as a dict, for a reader that maps them (the Responses API)."""
        members: dict[str, Any] = orjson.loads(b"{" + self.body + b"}")
        return members


@dataclass(frozen=True, slots=True)
class Done:
    """The call completed. `usage` is the engine's own usage object (prompt and completion
    tokens, and any details it gives); `choice` is the whole answer when the call was not
    streamed: the engine's choice less its index and finish reason (a chat `message`, or a
    completion's `text`, and `logprobs`)."""

    attempt: int
    finish_reason: str
    usage: dict[str, Any]
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    wait_s: float = 0.0
    replica: str = ""
    choice: dict[str, Any] | None = None
    model: str | None = None  # the engine's own model name (None: the sim engine, which has none)
    extra: dict[str, Any] | None = None  # other top-level members of the engine's answer (system_fingerprint)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)


@dataclass(frozen=True, slots=True)
class Failed:
    """The call ended without an answer: the HTTP status and the typed error its caller gets."""

    status: int
    type: str
    message: str
    code: str | None = None
    param: str | None = None


Event = Chunk | Done | Failed


def chunk_fields(body: bytes, model: str | None = None) -> dict[bytes, bytes]:
    """The entry of a chunk (see the module doc)."""
    return {CHUNK: body} if model is None else {CHUNK: body, MODEL: model.encode()}


def encode(event: Done | Failed) -> tuple[bytes, bytes]:
    """An end's entry: (field, value)."""
    data = {k: v for k, v in asdict(event).items() if v is not None}
    return (DONE if isinstance(event, Done) else FAILED), orjson.dumps(data)


def decode(fields: dict[bytes, bytes]) -> Event | None:
    """The event of one entry; None for an entry that is none of ours (a reader's wake-up)."""
    body = fields.get(CHUNK)
    if body is not None:
        model = fields.get(MODEL)
        return Chunk(body, model.decode() if model is not None else None)
    raw = fields.get(DONE)
    if raw is not None:
        return Done(**orjson.loads(raw))
    raw = fields.get(FAILED)
    if raw is not None:
        return Failed(**orjson.loads(raw))
    return None


def lua_literal(event: Failed) -> str:
    """The entry's value as a Lua long string, for the line's scripts to write as is."""
    _, value = encode(event)
    text = value.decode()
    assert "]==]" not in text
    return f"[==[{text}]==]"


# The ends the line's scripts decide themselves (fleet.store.line_scripts).
EXPIRED_IN_LINE = Failed(504, "deadline_exceeded", "deadline passed while waiting in the line")
WORKER_LOST = Failed(502, "worker_lost", "the worker serving this stream was lost")
SET_ASIDE = Failed(502, "worker_lost", "the request was lost by its workers too many times in a row; it was set aside")
# A worker finished a request whose hash is gone (a failover or a flush lost it); the gateway
# says the same to a caller whose request it no longer finds (gateway.results).
REQUEST_LOST = Failed(503, "service_unavailable", "the request is no longer in the fleet's Redis (a failover or a "
                      "flush lost it) and will not be served: send it again", code="request_lost")
