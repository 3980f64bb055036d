"""The model registry over HTTP, under /v1/fleet/models (admin keys only).

GET  /v1/fleet/models                     every tier's record
GET  /v1/fleet/models/{tier}              one tier's record
GET  /v1/fleet/models/{tier}/history      its changes, oldest first (?limit=N, at most 1000)
POST /v1/fleet/models/{tier}/promote      {"version", "canary"?, "why"?}
POST /v1/fleet/models/{tier}/rollback     {"to"?, "why"?}

The record is `fleet.store.model_registry`'s; the scaler carries a change out
at its next tick (a rollout, one replica at a time). A refused change is a
typed error: 404 for an unknown tier or version, 409 for one that cannot be
made now (already live, nothing to roll back to).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from fleet.store.keys import TierKeys
from fleet.store.model_registry import ModelRecord, RegistryError, promote, read_history, read_or_seed, rollback
from gateway.auth import Caller, require_admin
from gateway.errors import APIError
from gateway.request import read_body, validate

router = APIRouter()

B = TypeVar("B", bound=BaseModel)

MAX_BODY = 4096


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: str = Field(min_length=1, max_length=64)
    canary: int | None = Field(None, ge=1, description="Replicas kept on the new version until it is judged.")
    why: str = Field("", max_length=500)


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    to: str | None = Field(None, min_length=1, max_length=64, description="Default: the previous known-good.")
    why: str = Field("", max_length=500)


def _json(doc: Any) -> Response:
    return Response(orjson.dumps(doc), media_type="application/json")


def _doc(rec: ModelRecord) -> Response:
    return _json({"object": "fleet.model_record", **rec.public()})


def _tier(gw: Any, name: str) -> str:
    tier = gw.cfg.resolve_model(name)
    if tier is None:
        raise APIError(404, f"tier {name!r} does not exist; GET /v1/models lists the tiers", param="tier",
                       code="model_not_found")
    return tier


async def _record(gw: Any, tier: str) -> ModelRecord:
    """The tier's record; the config seeds it if nothing has yet (a gateway started before any scaler)."""
    return await read_or_seed(gw.redis, TierKeys(gw.cfg.namespace, tier), gw.cfg.tiers[tier])


async def _seeded(gw: Any, name: str) -> TierKeys:
    """The keys of the tier `name` resolves to (404 if none), its record seeded before it is changed or read."""
    t = _tier(gw, name)
    await _record(gw, t)
    return TierKeys(gw.cfg.namespace, t)


@contextmanager
def _refused(param: str) -> Iterator[None]:
    """A change the registry refuses is a typed error (404/409) naming the field at fault."""
    try:
        yield
    except RegistryError as e:
        raise APIError(e.status, str(e), code=e.code, param=param) from None


@router.get("/v1/fleet/models")
async def list_models(request: Request, caller: Caller = Depends(require_admin)) -> Response:  # noqa: B008
    gw: Any = request.app.state.gw
    return _json({"object": "list", "data": [{"object": "fleet.model_record", **(await _record(gw, t)).public()}
                                             for t in gw.cfg.tiers]})


@router.get("/v1/fleet/models/{tier}")
async def show_model(tier: str, request: Request, caller: Caller = Depends(require_admin)) -> Response:  # noqa: B008
    gw: Any = request.app.state.gw
    return _doc(await _record(gw, _tier(gw, tier)))


@router.get("/v1/fleet/models/{tier}/history")
async def model_history(tier: str, request: Request, limit: int = Query(50, ge=1, le=1000),
                        caller: Caller = Depends(require_admin)) -> Response:  # noqa: B008
    gw: Any = request.app.state.gw
    k = await _seeded(gw, tier)
    entries = await read_history(gw.redis, k, limit)
    return _json({"object": "list", "tier": k.tier, "data": [asdict(e) for e in entries]})


async def _change(request: Request, tier: str, body_type: type[B], param: str,
                  act: Callable[[Redis, TierKeys, B], Awaitable[ModelRecord | None]]) -> Response:
    """A promote or a rollback: the body checked, the tier's record seeded, `act` run on it; a refusal
    is a typed error naming `param`."""
    gw: Any = request.app.state.gw
    body = validate(body_type, await read_body(request, MAX_BODY))
    k = await _seeded(gw, tier)
    with _refused(param):
        rec = await act(gw.redis, k, body)
    assert rec is not None  # only an automatic rollback (of_rollout) can find nothing to do
    return _doc(rec)


@router.post("/v1/fleet/models/{tier}/promote")
async def promote_model(tier: str, request: Request, caller: Caller = Depends(require_admin)) -> Response:  # noqa: B008
    return await _change(request, tier, PromoteBody, "version", lambda r, k, b: promote(
        r, k, b.version, by=caller.name, why=b.why, canary=b.canary))


@router.post("/v1/fleet/models/{tier}/rollback")
async def rollback_model(tier: str, request: Request, caller: Caller = Depends(require_admin)) -> Response:  # noqa: B008
    return await _change(request, tier, RollbackBody, "to", lambda r, k, b: rollback(
        r, k, by=caller.name, why=b.why, to=b.to))
