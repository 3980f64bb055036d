"""The gateway: OpenAI-compatible calls in, the tier's line in Redis, tokens out.

The app and what its handlers share (`Gateway`: config, Redis, one Line per tier, admission,
the result reader, the orphans); the completion routes are `gateway.completions`, and the
life of one call is `gateway.call.Call`. The gateway and the workers never import each
other; they meet only in Redis. The hot path is two Redis round trips (join the line, read
the result stream) plus JSON, all on the event loop without blocking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from redis.exceptions import RedisError

from fleet import gc_tuning
from fleet.config import FleetConfig
from fleet.store.connection import Clients
from fleet.tasks import cancel_and_wait, stop_spawned
from gateway.auth import KeyRing, require_status_reader
from gateway.completions import HOT_PATHS, chat, completions
from gateway.completions import router as completions_router
from gateway.dashboard import router as dashboard_router
from gateway.errors import APIError, install_error_handlers, retry_headers
from gateway.fleet_api import router as fleet_router
from gateway.hot_paths import Endpoint, dispatch
from gateway.messages import create as create_message
from gateway.messages import router as messages_router
from gateway.models_api import router as models_router
from gateway.observability import router as metrics_router
from gateway.openapi import install_openapi
from gateway.redis_loss import READY_PING_S, unavailable_error
from gateway.request import ClientLeft, HeaderLimit
from gateway.responses import create as create_response
from gateway.responses import router as responses_router
from gateway.state import Gateway
from gateway.status import fleet_status

log = logging.getLogger("fleet.gateway")
JSON = "application/json"
GATEWAY_POOL = 24  # ordinary Redis calls in flight at once; more wait for a connection
# ... this long at most, then a 503. A queue under load, not a dead Redis: that fails the calls in flight.
POOL_WAIT_S = 30.0
STATUS_BOUND_S = 3.0  # GET /v1/fleet/status reads every tier: a few round trips each


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type=JSON, headers=headers)


class GatewayApp(FastAPI):
    """FastAPI, with the calls agents make (`POST` on `hot`) dispatched before its layers
    (`gateway.hot_paths`); every other request goes through FastAPI as usual."""

    def __init__(self, header_limit: int, **kw: Any) -> None:
        super().__init__(docs_url=None, redoc_url=None, **kw)  # no docs pages: /openapi.json is the contract
        self.header_limit = header_limit  # the head's bound, checked on the hot paths too
        self.hot: dict[str, Endpoint] = {"/v1/chat/completions": chat, "/v1/completions": completions,
                                         "/v1/responses": create_response, "/v1/messages": create_message}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and (endpoint := self.hot.get(scope["path"])):
            await dispatch(self, endpoint, self.header_limit, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(cfg: FleetConfig, redis_url: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Connections stay bounded whatever the open-call count: the result reader holds one
        # blocking connection per tier, and the ordinary calls queue for a pool of GATEWAY_POOL.
        clients = Clients.open(redis_url, name="gateway", max_connections=GATEWAY_POOL,
                               max_blocking=len(cfg.tiers) + 1, wait_for_connection_s=POOL_WAIT_S)
        redis = clients.calls
        gw = Gateway(cfg, redis, app.state.keyring, blocking=clients.blocking)
        app.state.gw = gw
        await gw.keyring.refresh(redis, cfg.namespace)  # keys added at run time count from the first call
        with contextlib.suppress(RedisError):  # a judgement to read from the first call (when no scaler runs)
            await gw.govern_unless_a_scaler_does()
        await gw.admission.start()
        reaper = asyncio.create_task(gw.reap_forever())
        if getattr(app.state, "freeze_gc", False):  # a served process, not a test's app
            gc_tuning.freeze()
        try:
            yield
        finally:
            await gw.admission.stop()
            await gw.results.stop()
            await cancel_and_wait(reaper)  # a lone cancel() can be lost in a Redis call (fleet/tasks.py)
            await stop_spawned()
            await clients.aclose()

    app = GatewayApp(cfg.gateway.max_header_bytes, title="Fleet Gateway", lifespan=lifespan)
    install_error_handlers(app)  # every error typed, the framework's 404/405/422 included
    app.add_exception_handler(RedisError, _redis_unavailable)
    app.add_exception_handler(ClientLeft, _client_left)
    app.add_middleware(HeaderLimit, limit=cfg.gateway.max_header_bytes)
    app.state.keyring = KeyRing.from_config(cfg)  # says at start-up when the gateway runs open
    app.state.status_auth = cfg.gateway.status_auth
    # Fleet state (replica ids, spend, decisions) is for operators: see require_status_reader.
    for calls in (completions_router, responses_router, messages_router):  # chat completions, Responses, Messages
        app.include_router(calls)
    app.include_router(metrics_router, dependencies=[Depends(require_status_reader)])
    app.include_router(dashboard_router)  # the page is public; the status it reads is not
    app.include_router(fleet_router)  # POST /v1/fleet/prewarm
    app.include_router(models_router)  # /v1/fleet/models: the model registry (admin)
    install_openapi(app)  # the real request models, headers and errors in /openapi.json

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        gw: Gateway = request.app.state.gw
        try:  # its own short bound: a frozen Redis must show here within a second, not a read timeout
            async with asyncio.timeout(READY_PING_S):
                await gw.redis.ping()
        except Exception as e:
            return APIError(503, f"the fleet's Redis does not answer ({type(e).__name__})", "service_unavailable",
                            code="redis_unavailable", headers=retry_headers(1)).response()
        return _json({"status": "ready", "tiers": list(gw.cfg.tiers)})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gw: Gateway = request.app.state.gw
        data = []
        for tier, tc in gw.cfg.tiers.items():
            for name in (tier, *tc.aliases):
                data.append({"id": name, "object": "model", "created": int(gw.started), "owned_by": "fleet",
                             "tier": tier})
        return _json({"object": "list", "data": data})

    @app.get("/v1/fleet/status", dependencies=[Depends(require_status_reader)])
    async def status(request: Request) -> Response:
        gw: Gateway = request.app.state.gw
        try:  # a frozen Redis: a typed 503 within a couple of seconds, not after every read's timeout
            async with asyncio.timeout(STATUS_BOUND_S):
                return _json(await fleet_status(gw.cfg, gw.redis, gw.lines, gw.admission.views))
        except TimeoutError:
            raise unavailable_error(None) from None

    # Every request is matched against the routes in order (a regex each): the two every client
    # calls go first, the rest keep their order (a path matches one route whatever the order).
    app.router.routes.sort(key=lambda r: getattr(r, "path", "") not in HOT_PATHS)
    return app


async def _client_left(_: Request, __: Exception) -> Response:
    # Nobody reads this (the caller hung up, or the server closed on a body too slow to arrive).
    return APIError(499, "the client closed the request before its body arrived",
                    code="client_closed_request").response()


async def _redis_unavailable(_: Request, exc: Exception) -> Response:
    # The line lives in Redis: without it nothing can be admitted. That is the fleet's
    # trouble, not the caller's, and it passes; say so in a shape clients retry on.
    log.error("Redis unavailable: %s", exc)
    return APIError(503, f"the fleet's Redis is unavailable ({type(exc).__name__}); retry shortly",
                    "service_unavailable", code="redis_unavailable", headers=retry_headers(1)).response()
