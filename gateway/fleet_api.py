"""Fleet control over HTTP: POST /v1/fleet/prewarm (admin keys only), DELETE /v1/fleet/chains/{id}.

An operator raises a tier's floor now, until a time, ahead of a burst the
schedule does not know about. The order goes to Redis; the scaler applies it
at its next tick (see `fleet.store.prewarm_orders`).

A planner that is about to retry its tree cancels the chain first: every call of it still
waiting or running ends as cancelled (a running one is aborted in its engine), and new calls
of the chain are refused with 409 `chain_cancelled` for `CHAIN_CANCEL_HOLD_S`.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from fleet.outcome import Outcome
from fleet.policy import format_duration
from fleet.store.events import Failed
from fleet.store.keys import TierKeys
from fleet.store.prewarm_orders import add_order
from gateway.auth import Caller, authenticate, require_admin
from gateway.errors import APIError
from gateway.request import parse_chain_id_value, read_body, validate

router = APIRouter()

MAX_BODY = 4096
CHAIN_CANCEL_HOLD_S = 60  # new calls of a cancelled chain are refused this long (its stragglers)
CHAIN_CANCELLED = Failed(409, "cancelled", "the call's chain was cancelled (DELETE /v1/fleet/chains/{id})",
                         "chain_cancelled")


@router.delete("/v1/fleet/chains/{chain}")
async def cancel_chain(chain: str, request: Request) -> Response:
    """End every waiting and running call of a chain as cancelled; its key, or an admin's."""
    gw: Any = request.app.state.gw
    caller = authenticate(request)
    chain = parse_chain_id_value(chain, "chain")
    who = "" if caller.key is not None and caller.key.admin else caller.name
    got = await gw.chains.cancel(chain, CHAIN_CANCEL_HOLD_S * 1000, who)
    if got == 2:
        raise APIError(404, f"no chain {chain!r} is open", param="chain", code="chain_not_found")
    if got == 1:
        raise APIError(403, f"chain {chain!r} was opened by another key; only it or an admin key may cancel it",
                       "permission_error", param="chain", code="chain_not_yours")
    ended = 0
    for member in got:
        tier, _, rid = member.partition("|")
        line = gw.lines.get(tier)
        if line is not None and await line.finish(rid, Outcome.CANCELLED, CHAIN_CANCELLED) is not None:
            ended += 1
    return Response(orjson.dumps({"object": "fleet.chain.cancelled", "id": chain, "calls_ended": ended,
                                  "refused_for_s": CHAIN_CANCEL_HOLD_S}), media_type="application/json")


class PrewarmBody(BaseModel):
    """POST /v1/fleet/prewarm: give exactly one of duration_s or until."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tier: str = Field(min_length=1, max_length=256)
    floor: int = Field(ge=0, description="At most the tier's max_replicas.")
    duration_s: float | None = Field(None, gt=0, description="At most the config's gateway.max_prewarm_s.")
    until: float | Annotated[str, Field(max_length=64)] | None = Field(
        None, description="Epoch seconds, or ISO 8601 with a zone.")


def _until(body: PrewarmBody, now: float) -> float:
    if (body.duration_s is None) == (body.until is None):
        raise APIError(422, "give exactly one of duration_s or until", param="duration_s", code="invalid_value")
    if body.duration_s is not None:
        return now + body.duration_s
    if isinstance(body.until, str):
        try:
            at = datetime.fromisoformat(body.until)
        except ValueError:
            raise APIError(422, f"until: not an ISO 8601 time: {body.until!r}", param="until",
                           code="invalid_value") from None
        if at.tzinfo is None:
            raise APIError(422, "until: give a time zone (e.g. 2026-11-02T08:25:00-05:00)", param="until",
                           code="invalid_value")
        return at.timestamp()
    return float(body.until)  # type: ignore[arg-type]


@router.post("/v1/fleet/prewarm")
async def prewarm(request: Request, caller: Caller = Depends(require_admin)) -> Response:  # noqa: B008
    gw: Any = request.app.state.gw
    body: PrewarmBody = validate(PrewarmBody, await read_body(request, MAX_BODY))
    tier = gw.cfg.resolve_model(body.tier)
    if tier is None:
        raise APIError(404, f"tier {body.tier!r} does not exist; GET /v1/models lists the tiers", param="tier",
                       code="model_not_found")
    tc = gw.cfg.tiers[tier]
    if body.floor > tc.max_replicas:
        raise APIError(422, f"floor {body.floor} exceeds the tier's max_replicas ({tc.max_replicas})",
                       param="floor", code="invalid_value")
    now = time.time()
    until = _until(body, now)
    if until <= now:
        raise APIError(422, "until is in the past", param="until", code="invalid_value")
    longest = gw.cfg.gateway.max_prewarm_s
    if until - now > longest:
        raise APIError(422, f"a pre-warm may last at most {format_duration(longest)} (the config's "
                       "gateway.max_prewarm_s); raise warm_floor in the config for longer",
                       param="duration_s" if body.duration_s is not None else "until", code="invalid_value")
    order = await add_order(gw.redis, TierKeys(gw.cfg.namespace, tier), body.floor, until, now)
    return Response(orjson.dumps({"object": "fleet.prewarm", "id": order.id, "tier": tier, "floor": order.floor,
                                  "until": order.until, "by": caller.name}), media_type="application/json")
