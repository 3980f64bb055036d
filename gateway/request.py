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
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from fleet.degrade_config import DegradeWish
from gateway.errors import APIError, quoted

# A day: longer than any call should wait, short enough that what a request holds
# in Redis (its hash, its reservations) expires in a day at the latest.
MAX_DEADLINE_MS = 86_400_000
DEADLINE_PATTERN = r"^[1-9][0-9]{0,7}$"  # whole milliseconds, plain decimal digits only
_DEADLINE = re.compile(DEADLINE_PATTERN)
_SECONDS = re.compile(r"[0-9]{1,8}(\.[0-9]{1,6})?")  # an SDK's timeout: 600, 5.0, 2.5

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


def parse_deadline(request: Request, header: str = "X-Deadline-Ms") -> int | None:
    """`X-Deadline-Ms` (or another header of its kind, `X-Chain-Deadline-Ms`): whole milliseconds
    1..MAX_DEADLINE_MS in plain digits (None: absent), else a typed 400 naming the header."""
    raw = request.headers.get(header.lower())
    if raw is None:
        return None
    if not _DEADLINE.fullmatch(raw) or int(raw) > MAX_DEADLINE_MS:
        raise APIError(400, f"{header} must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS} "
                       f"in plain digits, got {quoted(raw)}", param=header, code="invalid_deadline")
    return int(raw)


def sdk_clock(headers: Mapping[str, str]) -> tuple[float | None, int | None]:
    """What the caller's SDK says of its clock: its timeout in seconds (`x-stainless-read-timeout`,
    else the Anthropic clients' `x-stainless-timeout`) and which attempt this is
    (`x-stainless-retry-count`). Not the fleet's headers: a value that is not a plain number is
    taken as unsaid, never refused (a client the caller does not control must not be broken)."""
    raw_t = headers.get("x-stainless-read-timeout") or headers.get("x-stainless-timeout")
    raw_n = headers.get("x-stainless-retry-count")
    timeout = None
    if raw_t is not None and _SECONDS.fullmatch(raw_t.strip()):
        timeout = float(raw_t)
        if not 0 < timeout <= MAX_DEADLINE_MS / 1000:
            timeout = None
    count = int(raw_n) if raw_n is not None and raw_n.strip().isdigit() and len(raw_n.strip()) < 4 else None
    return timeout, count


MAX_IDEMPOTENCY_KEY = 256


def parse_idempotency_key(request: Request) -> str | None:
    """`Idempotency-Key`: 1-256 printable characters (absent: None), else a typed 400. Only its
    digest is stored (`fleet.policy.retries.call_identity`)."""
    raw = request.headers.get("idempotency-key")
    if raw is None:
        return None
    if not 0 < len(raw) <= MAX_IDEMPOTENCY_KEY or not raw.isprintable():
        raise APIError(400, f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable characters, got "
                       f"{quoted(raw)}", param="Idempotency-Key", code="invalid_idempotency_key")
    return raw


def parse_degrade(request: Request) -> DegradeWish | None:
    """`X-Fleet-Degrade`: `allow` or `never` (absent: None, the key's or the tier's rule), else a
    typed 400 (docs/degrade.md)."""
    raw = request.headers.get("x-fleet-degrade")
    if raw is None:
        return None
    if raw == "allow":
        return "allow"
    if raw == "never":
        return "never"
    raise APIError(400, f"X-Fleet-Degrade must be allow or never, got {quoted(raw)}", param="X-Fleet-Degrade",
                   code="invalid_degrade")


def parse_chain_id(request: Request) -> str:
    """`X-Chain-Id`: 1-128 of A-Z a-z 0-9 . _ : - (absent: ""), else a typed 400."""
    raw = request.headers.get("x-chain-id")
    return "" if raw is None else parse_chain_id_value(raw)


def parse_chain_id_value(raw: str, param: str = "X-Chain-Id") -> str:
    """A chain id as `X-Chain-Id` takes it (also the path of DELETE /v1/fleet/chains/{id}), else a typed 400."""
    if not _CHAIN_ID.fullmatch(raw):
        raise APIError(400, f"{param} must be 1 to {MAX_CHAIN_ID} characters of A-Z a-z 0-9 . _ : -, "
                       f"got {quoted(raw)}", param=param, code="invalid_chain_id")
    return raw


def parse_chain_deadline(request: Request) -> int | None:
    """`X-Chain-Deadline-Ms`: the chain's deadline from receipt, read as `X-Deadline-Ms` is (None: absent)."""
    return parse_deadline(request, "X-Chain-Deadline-Ms")


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


class IndexedHeaders(Headers):
    """Starlette's `Headers`, its lookups by name from a dict made on the first one. Starlette scans
    the raw list on every `get`; a call reads about 15 headers (its class, deadline, chain, the
    SDK's clock, its key), most of them absent, so each read was a whole scan. The first value of
    a repeated header wins, as in Starlette; `getlist` and iteration are Starlette's own."""

    __slots__ = ("_index",)

    def _first(self) -> dict[str, str]:
        index: dict[str, str] | None = getattr(self, "_index", None)
        if index is None:
            index = {}
            for k, v in self.raw:
                index.setdefault(k.decode("latin-1"), v.decode("latin-1"))
            self._index = index
        return index

    def __getitem__(self, key: str) -> str:
        return self._first()[key.lower()]

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower() in self._first()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._first().get(key.lower(), default)
