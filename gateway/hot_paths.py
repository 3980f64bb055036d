"""The calls every agent makes, dispatched as plain ASGI: no framework layer between uvicorn and the call.

Every request to a FastAPI app passes Starlette's error middleware, the app's own middleware,
the exception middleware, FastAPI's exit stack, the router's matching and the request-response
wrapper before its handler runs, and every chunk of a streamed answer passes two of those
layers' `send` wrappers on its way out. py-spy put those layers at about a tenth of the
gateway's CPU at 10 open calls (docs/token-relay-profile.md, third step), spent on the calls
that are the gateway's whole load.

So `POST` on the completion routes and on `/v1/responses` goes straight to its handler (the
same function FastAPI's route calls), with what those layers did for it done here, in the same
order and with the same answers: the head's size bound first (`gateway.request.HeaderLimit`),
then the handler, then an exception the handler raised answered by the handler the app installed
for that exception class (the typed 4xx, the 503 for a Redis error, the logged typed 500). An
exception while the answer is being sent goes to the server, as it did through the framework.

Everything else (other paths, other methods, a trailing slash) goes through FastAPI as before,
and the routes stay registered there, so `/openapi.json` still documents them. A middleware
added to the app does not see these requests: what it must do for them belongs in `dispatch`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.request import IndexedHeaders, head_too_large

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


async def dispatch(app: Any, endpoint: Endpoint, limit: int, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Serve one hot request as FastAPI would have, without its layers (see the module doc)."""
    scope["app"] = app  # what `request.app` reads, as Starlette sets it
    too_large = head_too_large(scope, limit)
    if too_large is not None:
        await too_large.response()(scope, receive, send)
        return
    request = Request(scope, receive)
    request._headers = IndexedHeaders(scope=scope)  # what `request.headers` returns: read by name in O(1)
    try:
        response = await endpoint(request)
    except Exception as exc:
        handler = handler_for(app.exception_handlers, exc)
        if handler is None:
            raise
        response = await handler(request, exc)
    await response(scope, receive, send)


def handler_for(handlers: Mapping[Any, Handler], exc: Exception) -> Handler | None:
    """The app's handler for `exc`: the nearest class in its MRO that has one, as Starlette looks it up."""
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
