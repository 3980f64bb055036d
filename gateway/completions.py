"""The completion routes: `POST /v1/chat/completions` and `POST /v1/completions`.

A call is read (`gateway.call_spec.parse_call`, a pure function, and the fleet's headers),
then lives in one `gateway.call.Call` from admission to its end, and is answered whole or
streamed (`gateway.answers`). A call refused before it gets that far (its key, its body, its
headers) is counted here, the only place besides its `Call` that counts an outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from redis.exceptions import RedisError

from fleet.config import FleetConfig
from fleet.policy.client_clock import CallClock, call_clock
from fleet.store.payloads import Kind
from gateway.answers import stream, whole
from gateway.auth import Caller, authenticate
from gateway.call import Call, CallHeaders, count_refused
from gateway.call_spec import CallSpec, call_flow, parse_call
from gateway.client_watch import ClientGone, ClientWatch
from gateway.errors import APIError
from gateway.request import (
    MAX_DEADLINE_MS,
    parse_chain_deadline,
    parse_chain_id,
    parse_deadline,
    parse_degrade,
    parse_idempotency_key,
    read_json,
    sdk_clock,
)

router = APIRouter()
HOT_PATHS = ("/v1/chat/completions", "/v1/completions")
# Reads another API's body as the call it runs (the Responses API: gateway.responses.read_turn).
Parse = Callable[[Caller, bytes, Any], Awaitable[CallSpec]]


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await complete(request, "chat")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await complete(request, "completion")


async def complete(request: Request, kind: Kind) -> Response:
    """Read the call, then serve it in its `Call`: whole or streamed, the answer ending it."""
    gw = request.app.state.gw
    caller, spec, headers = await read_call(request, kind, gw.cfg)
    try:
        async with Call(gw, spec, caller, headers, ClientWatch(request.receive)) as call:
            first = await call.first()
            return stream(call, first) if spec.stream else await whole(call, first)
    except ClientGone:  # ended as cancelled; nobody reads this
        return Response(status_code=499)


async def read_call(request: Request, kind: Kind, cfg: FleetConfig,
                    parse: Parse | None = None) -> tuple[Caller, CallSpec, CallHeaders]:
    """The caller (401 before the body is even read), the call (`parse_call`, or `parse` for a body
    of another API) and the fleet's headers; a typed 4xx for what is wrong with them, counted as
    refused (503 if Redis fails a lookup)."""
    tier: str | None = None
    priority: str | None = None
    try:
        caller = authenticate(request)
        raw, data = await read_json(request, cfg.max_body_bytes)
        spec = parse_call(kind, raw, data, cfg) if parse is None else await parse(caller, raw, data)
        tier = spec.tier
        caller.check_tier(tier)
        prio = caller.priority(request.headers.get("x-priority"), cfg.default_priority)
        priority = prio.name
        chain = parse_chain_id(request)
        flow = call_flow(chain, request.headers, cfg.fair_line.session_headers, caller.key.name if caller.key else None,
                         request.client.host if request.client else None)
        headers = CallHeaders(prio, call_clock_of(request, cfg, spec.stream), chain, flow,
                              parse_idempotency_key(request), parse_chain_deadline(request) if chain else None,
                              parse_degrade(request))
    except (APIError, RedisError) as e:
        count_refused(tier, priority, e)
        raise
    return caller, spec, headers


def call_clock_of(request: Request, cfg: FleetConfig, stream: bool) -> CallClock:
    """The call's deadline: `X-Deadline-Ms`, else its SDK's timeout and the retries it will still
    make (`client_clock`, docs/client-clock.md), else the default."""
    header_ms = parse_deadline(request)
    clock = cfg.client_clock
    timeout_s, retry_count = sdk_clock(request.headers) if clock.enabled else (None, None)
    return call_clock(header_ms=header_ms, timeout_s=timeout_s, retry_count=retry_count, stream=stream,
                      default_ms=cfg.default_deadline_ms, max_ms=MAX_DEADLINE_MS, sdk_retries=clock.sdk_retries,
                      joined=clock.retry_grace_s > 0)
