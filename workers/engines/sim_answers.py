"""What the `sim` engine answers, token by token: text, tool calls, or JSON of a schema.

The sim has no model, but an agent must be able to run its whole loop against it: so a
call with tools gets a tool call whose arguments fit the tool's JSON schema, a call whose
last turn is a tool's result gets text that quotes it, and a call with `response_format`
gets JSON of that format. Everything is decided from the request alone (deterministic), and
cut into pieces of about four characters, one per decode step, as a model would emit
tokens; an answer longer than the call's `max_tokens` is cut there (finish reason `length`).

Plain text ends of its own accord (finish `stop`), as a model's does: its length is drawn from
the tier's sim profile (`typical_output_tokens`, `output_tokens_spread`) by a hash of the request
less its bound, so a call re-sent, retried or preempted writes the same length. vLLM's
`ignore_eos: true` makes it write exactly `max_tokens` (finish `length`), as vLLM does: what
benchmarks and tests that need a fixed length send.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import orjson

from fleet.config import SimProfile
from workers.engines.base import EngineError, EngineRequest

WORDS = ("line", "drain", "floor", "ceiling", "shed", "budget", "lease", "tier", "replica", "token",
         "queue", "warm", "burst", "open", "chain", "plan", "route", "asset", "thesis", "signal")
PIECE_CHARS = 4  # about a token
_MAX_DEPTH = 8  # a recursive schema stops here
# What a plain answer's length is not drawn from: its bound and how it is sent. A caller who raises
# max_tokens (or streams) gets the same answer, cut later or not at all.
_NOT_LENGTH = frozenset({"max_tokens", "max_completion_tokens", "ignore_eos", "stream", "stream_options"})
_DEFAULT_PROFILE = SimProfile()


@dataclass(slots=True)
class Piece:
    """One decode step's output: text, or the members of a chat delta (a tool call's fragment)."""

    text: str = ""
    fields: dict[str, Any] | None = None


@dataclass(slots=True)
class Answer:
    pieces: list[Piece] = field(default_factory=list)
    finish_reason: str = "stop"


def answer(req: EngineRequest, profile: SimProfile = _DEFAULT_PROFILE) -> Answer:
    """The sim's answer to `req`, at most `req.max_tokens` pieces; plain text as long as
    `profile` draws it (`natural_length`)."""
    body = req.body
    if req.kind == "chat":
        _check_parts(req.messages or [])
        tools = _function_tools(body.get("tools"))
        called = _tools_to_call(body, tools)
        if called:
            return _cut(_tool_call_pieces(req.request_id, called, body), "tool_calls", req.max_tokens)
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
            return _cut(_split(orjson.dumps(_format_instance(fmt)).decode()), "stop", req.max_tokens)
        result = _last_tool_result(req.messages or [])
        if result is not None:
            return _cut(_split(f"The tool said: {result}"), "stop", req.max_tokens)
    return _words(req, profile)


def logprobs_of(piece: Piece, body: dict[str, Any], chat: bool, offset: int) -> dict[str, Any] | None:
    """The piece's logprobs when the call asks for them: the sim is sure of every token (0.0), and its
    `top_logprobs` alternatives are the token itself."""
    want = body.get("logprobs")
    if not want:
        return None
    token = piece.text or orjson.dumps(piece.fields).decode()
    if chat:
        entry = {"token": token, "logprob": 0.0, "bytes": list(token.encode())}
        top = [entry] * int(body.get("top_logprobs") or 0)
        return {"content": [{**entry, "top_logprobs": top}], "refusal": None}
    return {"tokens": [token], "token_logprobs": [0.0], "top_logprobs": [{token: 0.0}] * (want is not True),
            "text_offset": [offset]}


def natural_length(req: EngineRequest, profile: SimProfile) -> int:
    """The words a plain answer to `req` has before it stops of its own accord: a log-normal draw
    of mean `typical_output_tokens` and sigma `output_tokens_spread`, its quantile a hash of the
    request less its bound (`_NOT_LENGTH`), not random state, so a request gets one length."""
    typical, sigma = profile.typical_output_tokens, profile.output_tokens_spread
    if sigma == 0:
        return typical
    seen = {k: v for k, v in req.body.items() if k not in _NOT_LENGTH}
    try:
        key = orjson.dumps(seen, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # e.g. an integer past 64 bits in an engine extension: still one length
        key = repr(sorted(seen.items(), key=str)).encode()
    digest = hashlib.blake2b(req.kind.encode() + key, digest_size=6)
    u = (int.from_bytes(digest.digest(), "big") + 0.5) / 2**48  # strictly inside (0, 1): 48 bits fit a float
    z = NormalDist().inv_cdf(u)
    return max(1, round(math.exp(math.log(typical) - sigma * sigma / 2 + sigma * z)))


def _words(req: EngineRequest, profile: SimProfile) -> Answer:
    """Plain text: `natural_length` words, finish `stop`; cut at `max_tokens` (finish `length`) when
    that is shorter; exactly `max_tokens` with `ignore_eos`, as vLLM writes past its end."""
    start = int(hashlib.blake2s(req.request_id.encode(), digest_size=2).hexdigest(), 16) % len(WORDS)
    words = itertools.cycle(WORDS[start:] + WORDS)
    natural = None if req.ignore_eos else natural_length(req, profile)
    n, finish = (natural, "stop") if natural is not None and natural <= req.max_tokens else (req.max_tokens, "length")
    return Answer([Piece((" " if i else "") + next(words)) for i in range(n)], finish)


def _cut(pieces: list[Piece], finish: str, max_tokens: int) -> Answer:
    if len(pieces) > max_tokens:
        return Answer(pieces[:max_tokens], "length")
    return Answer(pieces, finish)


def _split(text: str) -> list[Piece]:
    return [Piece(text[i:i + PIECE_CHARS]) for i in range(0, len(text), PIECE_CHARS)] or [Piece("")]


def _check_parts(messages: list[dict[str, Any]]) -> None:
    """Text only: any other part is a typed 400 naming it, never dropped in silence."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise EngineError(f"the sim engine takes text only; messages[{i}].content[{j}] is a {kind!r} "
                                      "part", "invalid_request_error", "unsupported_content",
                                      f"messages[{i}].content[{j}]")


def _function_tools(tools: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


def _tools_to_call(body: dict[str, Any], tools: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The functions this answer calls: the named one, every one (`parallel_tool_calls: true`) or
    the first; none when told `none`, or when the last turn is a tool's result and the choice is
    the model's (`auto`)."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in tools:
            raise EngineError(f"tool_choice names the function {name!r}, which is not in tools",
                              "invalid_request_error", "invalid_value", "tool_choice")
        return [tools[name]]
    if not tools or choice == "none":
        return []
    messages = body.get("messages") or []
    if choice != "required" and messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "tool":
        return []
    fns = list(tools.values())
    return fns if body.get("parallel_tool_calls") is True else fns[:1]


def _tool_call_pieces(request_id: str, fns: list[dict[str, Any]], body: dict[str, Any]) -> list[Piece]:
    """Each call's opening fragment (id, type, name), then its arguments a piece at a time."""
    pieces: list[Piece] = []
    base = hashlib.blake2s(request_id.encode(), digest_size=8).hexdigest()
    for index, fn in enumerate(fns):
        opening = {"index": index, "id": f"call_{base}{index}", "type": "function",
                   "function": {"name": fn["name"], "arguments": ""}}
        pieces.append(Piece(fields={"tool_calls": [opening]}))
        args = orjson.dumps(instance(fn.get("parameters") or {"type": "object"})).decode()
        for p in _split(args):
            pieces.append(Piece(fields={"tool_calls": [{"index": index, "function": {"arguments": p.text}}]}))
    return pieces


def _last_tool_result(messages: list[dict[str, Any]]) -> str | None:
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "tool":
        return None
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content or "")


def _format_instance(fmt: dict[str, Any]) -> Any:
    if fmt.get("type") == "json_object":
        return {"answer": "sim"}
    spec = fmt.get("json_schema") or {}
    return instance(spec.get("schema") or {"type": "object"})


def instance(schema: Any, defs: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value that fits the JSON schema `schema`: its const, default, first enum value, first
    non-null alternative, every property of an object, and strings, numbers and arrays at their
    bounds. Deterministic; a schema it cannot read gives a string."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None if depth > _MAX_DEPTH else "sim"
    defs = {**(defs or {}), **(schema.get("$defs") or {}), **(schema.get("definitions") or {})}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return instance(defs.get(ref.rsplit("/", 1)[-1], {}), defs, depth + 1)
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        options = [o for o in schema.get(key) or () if isinstance(o, dict)]
        if options:
            chosen = next((o for o in options if o.get("type") != "null"), options[0])
            return instance(chosen, defs, depth + 1)
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(part if isinstance(part, dict) else {})
        return instance(merged, defs, depth + 1)
    return _typed(schema, defs, depth)


def _typed(schema: dict[str, Any], defs: dict[str, Any], depth: int) -> Any:
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: instance(v, defs, depth + 1) for k, v in props.items()} if isinstance(props, dict) else {}
    if kind == "array":
        least = schema.get("minItems")
        n = min(least, 8) if isinstance(least, int) and least > 1 else 1
        return [instance(schema.get("items") or {}, defs, depth + 1) for _ in range(n)]
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return _string(schema)


def _number(schema: dict[str, Any], integer: bool) -> int | float:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if isinstance(schema.get("exclusiveMinimum"), int | float):
        lo = schema["exclusiveMinimum"] + (1 if integer else 0.5)
    value: float = lo if isinstance(lo, int | float) else 1
    if isinstance(hi, int | float) and value > hi:
        value = hi
    return int(value) if integer else float(value)


_FORMATS = {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "time": "00:00:00", "email": "sim@example.com",
            "uri": "https://example.com/sim", "uuid": "00000000-0000-4000-8000-000000000000"}


def _string(schema: dict[str, Any]) -> str:
    text = _FORMATS.get(str(schema.get("format")), "sim")
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) and len(text) < lo:
        text = text + "m" * (lo - len(text))
    if isinstance(hi, int) and hi >= 0:
        text = text[:hi]
    return text
