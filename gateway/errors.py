"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code", ...}}.

Every error a caller can get is in this shape, including the ones the
framework makes (an unknown path, a wrong method, a parameter it validated)
and the ones the HTTP server makes before the app sees the request
(`gateway.server`: headers too large, a client too slow, too many
connections, bytes that are not HTTP).
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleet.store.events import Failed

log = logging.getLogger("fleet.gateway")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def retry_headers(retry_after_s: float, should_retry: bool = True) -> dict[str, str]:
    """What tells an SDK when (and whether) to retry: `Retry-After` in whole seconds, the
    `retry-after-ms` the openai and anthropic clients read first, and `x-should-retry`, which
    they obey over their own rules."""
    secs = max(1, math.ceil(retry_after_s - 1e-9))
    return {"Retry-After": str(secs), "retry-after-ms": str(secs * 1000),
            "x-should-retry": "true" if should_retry else "false"}


def quoted(raw: str, limit: int = 40) -> str:
    """A caller's value quoted in an error message, cut short: a message must not echo a megabyte back."""
    return repr(raw) if len(raw) <= limit else f"{raw[:limit]!r}... ({len(raw)} characters)"


async def api_error_handler(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


# Codes for the errors the framework raises by status; anything else is named by its status phrase.
_FRAMEWORK_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _framework_error(request: Request, exc: Exception) -> Response:
    """Starlette's HTTPException (unknown path, wrong method, ...) in the typed shape; its headers (Allow) kept."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        message = f"no such endpoint: {request.method} {quoted(request.url.path, 80)}"
    elif status == 405:
        message = f"{request.method} is not allowed on {quoted(request.url.path, 80)}"
        if exc.headers and exc.headers.get("Allow"):
            message += f"; allowed: {exc.headers['Allow']}"
    else:
        message = str(exc.detail)
    code = _FRAMEWORK_CODES.get(status) or _phrase(status)
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, message, type_, code=code, headers=dict(exc.headers or {})).response()


async def _framework_validation(_: Request, exc: Exception) -> Response:
    """FastAPI's own validation of a parameter, as the typed 422 naming it."""
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    err = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "header", "path")) or None
    return APIError(422, f"{param or 'request'}: {err.get('msg')}", param=param, code="invalid_value").response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback, answered typed (never a bare text 500)."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal error in the gateway; it has been logged", "server_error",
                    code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can answer typed, the framework's included."""
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _framework_error)
    app.add_exception_handler(RequestValidationError, _framework_validation)
    app.add_exception_handler(Exception, _unexpected)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "http_error"


def raw_response(status: int, code: str, message: str, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, **extra: Any) -> bytes:
    """A whole HTTP/1.1 response with a typed body and `connection: close`, for the server to write
    itself where no app is running (the request never got that far)."""
    body = orjson.dumps(APIError(status, message, type_, code=code, **extra).body())
    phrase = HTTPStatus(status).phrase
    head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def from_event(ev: Failed) -> APIError:
    """A worker's or the line's end of a call that failed, as the caller should see it (a 503 with
    Retry-After: the fleet's fault, and a retry may well be served)."""
    return APIError(ev.status, ev.message, ev.type, code=ev.code or ev.type, param=ev.param,
                    headers=retry_headers(1) if ev.status == 503 else None)
