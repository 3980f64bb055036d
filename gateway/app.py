"""The gateway: OpenAI-compatible calls in, the tier's line in Redis, tokens out.

The gateway and the workers never import each other; they meet only in Redis.
The hot path is two Redis round trips (join the line, read the result
stream) plus JSON, all on the event loop without blocking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet.config import FleetConfig
from fleet.governor import govern
from fleet.store.connection import Clients
from fleet.store.events import Done, Event, Failed
from fleet.store.leader import leader_of
from fleet.store.line import Line
from fleet.store.payloads import Kind
from fleet.tasks import cancel_and_wait
from gateway.admission import Admission, AdmissionRequest, Ticket, outcome_of
from gateway.answers import SSEResponse, final_body, sse, usage_of
from gateway.auth import KeyRing, authenticate, require_status_reader
from gateway.call_spec import parse_call
from gateway.dashboard import router as dashboard_router
from gateway.errors import APIError, from_event, install_error_handlers
from gateway.fleet_api import router as fleet_router
from gateway.models_api import router as models_router
from gateway.observability import RequestRecorder
from gateway.observability import router as metrics_router
from gateway.openapi import install_openapi
from gateway.redis_loss import (
    GRACE_S,
    READY_PING_S,
    UNAVAILABLE,
    Orphans,
    count_response,
    end_in_line,
    spawn,
    unavailable_error,
)
from gateway.request import ClientLeft, HeaderLimit, parse_chain_id, parse_deadline, read_json
from gateway.result_reader import ResultReader, Watch
from gateway.results import ClientGone, close_events, events, first_or_gone
from gateway.status import fleet_status

log = logging.getLogger("fleet.gateway")
JSON = "application/json"
GATEWAY_POOL = 24  # ordinary Redis calls in flight at once; more wait for a connection
# ... this long at most, then a 503. A queue under load, not a dead Redis: that fails the calls in flight.
POOL_WAIT_S = 30.0
STATUS_BOUND_S = 3.0  # GET /v1/fleet/status reads every tier: a few round trips each


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type=JSON, headers=headers)


class Gateway:
    """State shared by the handlers: config, Redis, one Line per tier."""

    def __init__(self, cfg: FleetConfig, redis: Redis, keyring: KeyRing | None = None, *,
                 blocking: Redis | None = None) -> None:
        self.cfg = cfg
        self.redis = redis
        self.lines = {t: Line(redis, cfg.namespace, t, result_ttl_s=cfg.result_ttl_s,
                              rate_window_s=cfg.rate_window_s, blocking=blocking) for t in cfg.tiers}
        self.admission = Admission(cfg, redis, self.lines)
        self.results = ResultReader()  # one reader of every open call's result stream
        self.keyring = keyring or KeyRing(cfg.keys)
        self.orphans = Orphans()  # answered 503 while Redis was away; ended in the line when it returns
        self.started = time.time()

    async def govern_unless_a_scaler_does(self) -> None:
        """The budget governor runs once per fleet, under the scaler's leader lease. With no
        scaler holding it (`fleet gateway` + `fleet worker` only), the gateway ticks it, so
        budgets still hold and admission, status and metrics still have a judgement to read."""
        if await leader_of(self.redis, self.cfg.namespace) is None:
            await govern(self.redis, self.cfg)

    async def reap_forever(self) -> None:
        # Workers reap too; the gateway does it as well so that requests of a
        # tier whose workers all died still come back to the line.
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            if self.orphans.pending:
                await self.orphans.sweep()
            for line in self.lines.values():
                try:
                    await line.reap()
                except Exception:
                    log.exception("reaper tick failed for %s", line.tier)
            try:
                await self.govern_unless_a_scaler_does()
                await self.keyring.refresh(self.redis, self.cfg.namespace)
            except Exception:  # a Redis blip must not end the loop; the next tick retries
                log.exception("governor or key refresh tick failed")


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
        try:
            yield
        finally:
            await gw.admission.stop()
            await gw.results.stop()
            await cancel_and_wait(reaper)  # a lone cancel() can be lost in a Redis call (fleet/tasks.py)
            await clients.aclose()

    app = FastAPI(title="Fleet Gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)  # every error typed, the framework's 404/405/422 included
    app.add_exception_handler(RedisError, _redis_unavailable)
    app.add_exception_handler(ClientLeft, _client_left)
    app.add_middleware(HeaderLimit, limit=cfg.gateway.max_header_bytes)
    app.state.keyring = KeyRing.from_config(cfg)  # says at start-up when the gateway runs open
    app.state.status_auth = cfg.gateway.status_auth
    # Fleet state (replica ids, spend, decisions) is for operators: see require_status_reader.
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
                            code="redis_unavailable", headers={"Retry-After": "1"}).response()
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

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, "completion")

    async def _complete(request: Request, kind: Kind) -> Response:
        # Every response is counted once in fleet_requests_total (docs/metrics.md): a ticket counts
        # the admitted ones, admission its 429s, and this the rest (refused before the line, 503).
        said: dict[str, str | None] = {"tier": None, "priority": None}
        try:
            return await _serve(request, kind, said)
        except APIError as e:
            if e.status != 429 and not said.get("counted"):
                count_response(said["tier"], said["priority"], UNAVAILABLE if e.status == 503 else "refused")
            raise
        except RedisError:
            if not said.get("counted"):
                count_response(said["tier"], said["priority"], UNAVAILABLE)
            raise

    async def _serve(request: Request, kind: Kind, said: dict[str, str | None]) -> Response:
        gw: Gateway = request.app.state.gw
        caller = authenticate(request)  # 401 before the body is even read
        raw, data = await read_json(request, gw.cfg.max_body_bytes)
        call = parse_call(kind, raw, data, gw.cfg)
        body, tier = call.body, call.tier
        said["tier"] = tier
        caller.check_tier(tier)
        priority = caller.priority(request.headers.get("x-priority"), gw.cfg.default_priority)
        said["priority"] = priority.name
        deadline_ms = parse_deadline(request, gw.cfg.default_deadline_ms)
        chain = parse_chain_id(request)  # stored with the request in Redis: bounded and plain
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_ms / 1000
        rec = RequestRecorder(tier, priority.name)
        rid = uuid.uuid4().hex
        line = gw.lines[tier]
        headers = {"x-request-id": rid, "x-fleet-tier": tier, "x-fleet-priority": priority.name}
        ticket: Ticket | None = None
        watch: Watch | None = None
        stream: AsyncIterator[Event] | None = None
        try:
            # Every Redis call until the first event runs under the caller's deadline (plus a
            # grace): a frozen Redis resets nothing, so only a clock can end the wait.
            async with asyncio.timeout_at(deadline_at + GRACE_S):
                # Admission (gateway/admission.py): rate limits, budgets, the tier's drain and the
                # deadline; a typed 429 with Retry-After, or a ticket whose reservations end with it.
                ticket = await gw.admission.admit(AdmissionRequest(
                    rid=rid, caller=caller, tier=tier, priority=priority, deadline_ms=deadline_ms,
                    prompt_tokens=call.prompt_tokens, max_tokens=call.max_tokens,
                    expected_output_tokens=gw.admission.views[tier].capacity.output_estimate(
                        call.explicit_max_tokens)))
                # Watched before it joins the line, so the reader takes the stream in while the enqueue runs.
                watch = gw.results.watch(line, rid)
                await ticket.enqueue(line, call.payload(caller.name), chain)
                stream = events(watch, line, deadline_at)
                first = await first_or_gone(stream, request.receive)
        except (RedisError, TimeoutError) as e:
            # Redis away or silent past the deadline: the caller hears 503 now, and the request,
            # which may have joined the line, is ended there once Redis answers (never served).
            if watch is not None:
                watch.close()
            if stream is not None:
                spawn(close_events(stream))
            if ticket is not None:
                said["counted"] = "1"
                gw.orphans.add(line, rid, UNAVAILABLE, ticket)
            log.error("request %s: Redis unavailable (%s)", rid, type(e).__name__)
            err = unavailable_error(e, deadline_ms=deadline_ms)
            err.headers.update(headers)
            raise err from None
        except ClientGone:
            assert ticket is not None and stream is not None and watch is not None
            watch.close()
            said["counted"] = "1"
            with anyio.CancelScope(shield=True):
                ended = await end_in_line(line, rid, "cancelled")
                if ended is None:
                    gw.orphans.add(line, rid, "cancelled", ticket)
                spawn(close_events(stream))
                if ended is not None:
                    spawn(ticket.close(ended))
            return Response(status_code=499)
        said["counted"] = "1"  # the ticket counts it from here
        try:
            if isinstance(first, Failed):
                spawn(close_events(stream))
                await ticket.close(outcome_of(first))
                err = from_event(first)
                err.headers.update(headers)
                raise err
            created = int(time.time())
            if body.stream:
                return SSEResponse(sse(gw.orphans, line, rid, kind, body, first, stream, created, rec, ticket),
                                   media_type="text/event-stream", headers=headers)
            spawn(close_events(stream))
            if not isinstance(first, Done):  # a chunk for a call that was not streamed: the worker's fault
                raise APIError(502, "the worker streamed an answer that was asked for whole", "engine_error",
                               code="bad_answer")
            rec.done(first)
            await ticket.close("completed", usage_of(first))
            return _json(final_body(kind, rid, body.model, created, first), headers=headers)
        except APIError:
            raise
        except BaseException:
            watch.close()
            with anyio.CancelScope(shield=True):
                # Whatever broke here, the request must not run on with nobody to read it:
                # end it in the line too (no-op if ended), or leave that to the orphan sweep.
                ended = await end_in_line(line, rid, "failed")
                if ended is None:
                    gw.orphans.add(line, rid, "failed", ticket)
                else:
                    with contextlib.suppress(Exception):
                        await ticket.close(ended)
            raise

    # Every request is matched against the routes in order (a regex each): the two every client
    # calls go first, the rest keep their order (a path matches one route whatever the order).
    hot = ("/v1/chat/completions", "/v1/completions")
    app.router.routes.sort(key=lambda r: getattr(r, "path", "") not in hot)
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
                    "service_unavailable", code="redis_unavailable", headers={"Retry-After": "1"}).response()
