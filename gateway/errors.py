"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code", ...}}."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response


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


async def api_error_handler(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


def from_event(ev: dict[str, Any]) -> APIError:
    """A worker's or the line's error event, as the caller should see it."""
    return APIError(int(ev.get("status", 502)), str(ev.get("msg", "request failed")), str(ev.get("type", "error")),
                    code=ev.get("code") or ev.get("type"))
