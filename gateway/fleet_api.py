"""Fleet control over HTTP: POST /v1/fleet/prewarm (admin keys only).

An operator raises a tier's floor now, until a time, ahead of a burst the
schedule does not know about. The order goes to Redis; the scaler applies it
at its next tick (see `fleet.prewarm`).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.keys import TierKeys
from fleet.prewarm import add_order
from gateway.auth import Caller, require_admin
from gateway.errors import APIError

router = APIRouter()

MAX_PREWARM_S = 7 * 86400  # a week: longer is a warm floor, and belongs in the config
MAX_BODY = 4096


class PrewarmBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: str
    floor: int = Field(ge=0)
    duration_s: float | None = Field(None, gt=0)
    until: float | str | None = None  # epoch seconds or ISO 8601 with a zone


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
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"request body exceeds the limit of {MAX_BODY} bytes", code="body_too_large")
    try:
        body = PrewarmBody.model_validate(orjson.loads(raw))
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(422, f"{param}: {err['msg']}", param=param, code="invalid_value") from None
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
    if until - now > MAX_PREWARM_S:
        raise APIError(422, f"a pre-warm may last at most {MAX_PREWARM_S // 86400} days; raise warm_floor "
                       "in the config instead", param="duration_s", code="invalid_value")
    order = await add_order(gw.redis, TierKeys(gw.cfg.namespace, tier), body.floor, until, now)
    return Response(orjson.dumps({"object": "fleet.prewarm", "id": order.id, "tier": tier, "floor": order.floor,
                                  "until": order.until, "by": caller.name}), media_type="application/json")
