"""What a caller sends, read strictly: the body (bounded in size, validated by a
strict model) and the fleet's headers (`X-Deadline-Ms`, `X-Chain-Id`).

Anything that reaches Redis is bounded here or in `gateway.schemas`, so no
caller can make the store that holds the lines and the ledger grow by more
than a request's worth. Lenient parsing (Python's `int` takes `5_000`,
`+5000` and ` 5000 `) is refused: a header either is what the contract says,
or the caller gets a typed 400 naming it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from gateway.errors import APIError, quoted

# A day: longer than any call should wait, short enough that what a request holds
# in Redis (its hash, its reservations) expires in a day at the latest.
MAX_DEADLINE_MS = 86_400_000
DEADLINE_PATTERN = r"^[1-9][0-9]{0,7}$"  # whole milliseconds, plain decimal digits only
_DEADLINE = re.compile(DEADLINE_PATTERN)

# The chain id is stored with the request in Redis and shown to operators: short, and
# characters that need no quoting in a log line, a metric label or a shell.
MAX_CHAIN_ID = 128
CHAIN_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
_CHAIN_ID = re.compile(CHAIN_ID_PATTERN)


class ClientLeft(Exception):
    """The caller hung up (or the server gave up on it) before its body arrived."""


async def read_body(request: Request, limit: int) -> Any:
    """The JSON body, or a typed 413 (over `limit` bytes) / 400 (not JSON)."""
    return (await read_json(request, limit))[1]


async def read_json(request: Request, limit: int) -> tuple[bytes, Any]:
    """The body as it arrived and as JSON, or a typed 413 (over `limit` bytes) / 400 (not JSON)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large")
    chunks = bytearray()
    try:
        async for chunk in request.stream():
            chunks += chunk
            if len(chunks) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    except ClientDisconnect:
        raise ClientLeft from None
    try:
        return bytes(chunks), orjson.loads(chunks)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


def validate(model: type[BaseModel], raw: Any) -> Any:
    """`raw` as `model` (strict: no "10" for a number, no "yes" for a boolean), or a typed 422 naming the field."""
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise invalid_value(e) from None


# Where a field is a union (`stop`: a string or a list), pydantic names the member it tried in the
# error's path ("str", "list[constrained-str]", "TextPart"): not a field a caller sent.
_UNION_TAG = re.compile(r"[A-Z].*|.*[\[\-].*|str|int|float|bool|none|dict|list")


def invalid_value(e: ValidationError) -> APIError:
    """A pydantic error as the typed 422: the offending field by its dotted path, as the caller named it.

    Of a union's errors, the one that is not "wrong type" is the one about what the caller meant
    (a list of 5 stop sequences is too long, not "not a string")."""
    errs = e.errors()
    err = next((x for x in errs if not x["type"].endswith("_type")), errs[0])
    # A path part may be a caller's dict key: cut short, the message must not echo a megabyte back.
    param = ".".join(str(p)[:64] for p in err["loc"] if not (isinstance(p, str) and _UNION_TAG.fullmatch(p)))
    param = param or "body"
    return APIError(422, f"{param}: {err['msg']}", param=param, code="invalid_value")


def parse_deadline(request: Request, default_ms: int) -> int:
    """`X-Deadline-Ms`: whole milliseconds 1..MAX_DEADLINE_MS in plain digits, else a typed 400."""
    raw = request.headers.get("x-deadline-ms")
    if raw is None:
        return default_ms
    if not _DEADLINE.fullmatch(raw) or int(raw) > MAX_DEADLINE_MS:
        raise APIError(400, f"X-Deadline-Ms must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS} "
                       f"in plain digits, got {quoted(raw)}", param="X-Deadline-Ms", code="invalid_deadline")
    return int(raw)


def parse_chain_id(request: Request) -> str:
    """`X-Chain-Id`: 1-128 of A-Z a-z 0-9 . _ : - (absent: ""), else a typed 400."""
    raw = request.headers.get("x-chain-id")
    if raw is None:
        return ""
    if not _CHAIN_ID.fullmatch(raw):
        raise APIError(400, f"X-Chain-Id must be 1 to {MAX_CHAIN_ID} characters of A-Z a-z 0-9 . _ : -, "
                       f"got {quoted(raw)}", param="X-Chain-Id", code="invalid_chain_id")
    return raw


class HeaderLimit:
    """The app's own bound on the request head (typed 431), under any ASGI server.

    `gateway.server` refuses a bigger head before it is even buffered; this is the
    check for what gets through (another server, a proxy's larger limit), so no
    header, however it arrived, is stored or parsed past the config's bound.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (err := head_too_large(scope, self.limit)) is not None:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def head_too_large(scope: Any, limit: int) -> APIError | None:
    """The typed 431 for a request head over `limit` bytes, else None."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])  # "k: v\r\n"
    if size <= limit:
        return None
    return APIError(431, f"request headers of {size} bytes exceed the limit of {limit}",
                    code="request_header_fields_too_large", headers={"connection": "close"})
