"""The model registry: `TierKeys.models` (one record per tier) and `TierKeys.models_history`.

What is deployed where, read by the scaler (which version new replicas
start at, and whether a rollout is under way), the workers (how to build
the engine of the version they were started at), the gateway's status and
admin API and `fleet models`. The config seeds the record on first start
(`ensure_seeded`); afterwards the record is the truth and the config only
adds versions it does not know.

Writers: `promote`, `rollback` (operators through the admin API or
`fleet promote|rollback`, and the scaler's automatic un-promotion),
`finish_rollout` (the acting scaler). Each change is one optimistic
transaction (WATCH the record, MULTI: the new record and its history entry),
so two writers can never both act on one record generation: the second
finds the record changed and re-reads it. Reader: `read_record`,
`read_history`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import WatchError

from fleet.config import EngineName, FleetConfig, SimProfile, TierConfig
from fleet.model_config import merged
from fleet.store.keys import TierKeys

HISTORY_MAXLEN = 10_000  # entries kept per tier (approximately): years of promotions


class RegistryError(Exception):
    """A change the registry refuses; `code` is stable, `status` the HTTP status to answer with."""

    def __init__(self, message: str, code: str, status: int = 409) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """How to run one version: its engine, weights, engine arguments and sim profile (all resolved)."""

    engine: str
    weights: str = ""
    engine_args: dict[str, Any] = field(default_factory=dict)
    sim: dict[str, Any] = field(default_factory=dict)
    added_at: float = 0.0
    added_by: str = ""


@dataclass(frozen=True, slots=True)
class Rollout:
    """The replacement under way after a promotion or rollback (None once every replica runs `to_version`)."""

    id: int  # the record generation that started it: one rollout, acted on once
    kind: str  # promote | rollback | auto_rollback
    from_version: str
    to_version: str
    started: float
    by: str
    canary: int | None = None  # replicas kept on the new version until it is judged; None: all of them
    judged: bool = False  # the judging window passed without a rollback (or there is nothing to judge)
    done_at: float | None = None  # when every active replica first ran `to_version`

    @property
    def rolling(self) -> bool:
        """Replicas are still being replaced (or a canary still waits for its verdict)."""
        return self.done_at is None


@dataclass(frozen=True, slots=True)
class ModelRecord:
    tier: str
    live: str
    versions: dict[str, VersionSpec]
    previous: str | None = None  # the previous known-good version: where `rollback` goes by default
    generation: int = 0
    updated: float = 0.0
    rollout: Rollout | None = None

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str) -> ModelRecord:
        d: dict[str, Any] = orjson.loads(raw)
        ro = d.get("rollout")
        return cls(tier=d["tier"], live=d["live"], previous=d.get("previous"), generation=int(d["generation"]),
                   updated=float(d.get("updated", 0)),
                   versions={n: VersionSpec(**v) for n, v in d["versions"].items()},
                   rollout=Rollout(**ro) if ro else None)

    def public(self) -> dict[str, Any]:
        """The record as the admin API and `fleet models show` print it."""
        return {"tier": self.tier, "live": self.live, "previous": self.previous, "generation": self.generation,
                "updated": self.updated, "rollout": asdict(self.rollout) if self.rollout else None,
                "versions": {n: asdict(v) for n, v in self.versions.items()}}


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    id: str  # the stream entry id
    action: str  # seed | register | promote | rollback | auto_rollback | judged | rollout_done
    by: str
    at: float
    why: str
    version: str  # the live version after the change
    previous: str  # the live version before it
    generation: int


# --- versions from the config --------------------------------------------------------------


def config_versions(tc: TierConfig, now: float, by: str = "config") -> dict[str, VersionSpec]:
    """The versions the tier's config names: its own model as `tc.version`, then `tc.versions`,
    each laid over the tier's own engine settings and sim profile."""
    own_weights = _weights(tc, tc.engine)
    out = {tc.version: VersionSpec(engine=tc.engine, weights=own_weights, sim=tc.sim.model_dump(),
                                   added_at=now, added_by=by)}
    for name, v in tc.versions.items():
        engine = v.engine or tc.engine
        weights = v.weights if v.weights is not None else _weights(tc, engine)
        out.setdefault(name, VersionSpec(engine=engine, weights=weights, engine_args=dict(v.engine_args),
                                         sim=merged(tc.sim.model_dump(), v.sim), added_at=now, added_by=by))
    return out


def _weights(tc: TierConfig, engine: EngineName) -> str:
    """The tier's own weights for `engine`: vLLM's model, the upstream's model; the sim has none."""
    return {EngineName.VLLM: tc.vllm.model, EngineName.OPENAI: tc.openai.model}.get(engine, "")


def tier_at_version(tc: TierConfig, spec: VersionSpec) -> TierConfig:
    """The tier's config as a replica of `spec` runs it: that engine, weights, arguments, sim profile."""
    update: dict[str, Any] = {"engine": spec.engine, "sim": SimProfile.model_validate(spec.sim or tc.sim.model_dump())}
    if spec.engine == EngineName.VLLM:
        fields = set(type(tc.vllm).model_fields)
        args = {k: v for k, v in spec.engine_args.items() if k in fields}
        update["vllm"] = type(tc.vllm).model_validate({**tc.vllm.model_dump(), **args,
                                                       **({"model": spec.weights} if spec.weights else {})})
    elif spec.engine == EngineName.OPENAI:
        fields = set(type(tc.openai).model_fields)
        args = {k: v for k, v in spec.engine_args.items() if k in fields}
        update["openai"] = type(tc.openai).model_validate({**tc.openai.model_dump(), **args,
                                                           **({"model": spec.weights} if spec.weights else {})})
    return tc.model_copy(update=update)


async def config_at_version(redis: Redis, cfg: FleetConfig, tier: str, version: str | None
                            ) -> tuple[FleetConfig, str]:
    """The config with `tier` as `version` runs it (default: the live one), for a replica about to
    start its engine; the config seeds the registry if nothing has yet. LookupError: unknown version."""
    rec = await ensure_seeded(redis, TierKeys(cfg.namespace, tier), cfg.tiers[tier])
    name = version or rec.live
    spec = rec.versions.get(name)
    if spec is None:
        raise LookupError(f"unknown model version {name!r}; the registry knows {', '.join(sorted(rec.versions))}")
    return cfg.model_copy(update={"tiers": {**cfg.tiers, tier: tier_at_version(cfg.tiers[tier], spec)}}), name


# --- reading ----------------------------------------------------------------------------------


async def read_record(redis: Redis, keys: TierKeys) -> ModelRecord | None:
    """The tier's record; None before the registry was seeded (or if the record is unreadable)."""
    raw = await redis.get(keys.models)
    if raw is None:
        return None
    try:
        return ModelRecord.loads(raw)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def read_history(redis: Redis, keys: TierKeys, count: int = 50) -> list[HistoryEntry]:
    """The newest `count` changes, oldest first."""
    out = []
    for eid, f in reversed(await redis.xrevrange(keys.models_history, count=count)):
        d = {_s(k): _s(v) for k, v in f.items()}
        out.append(HistoryEntry(id=_s(eid), action=d.get("action", ""), by=d.get("by", ""),
                                at=float(d.get("at", 0)), why=d.get("why", ""), version=d.get("version", ""),
                                previous=d.get("previous", ""), generation=int(d.get("generation", 0))))
    return out


# --- writing ----------------------------------------------------------------------------------

Change = Callable[[ModelRecord | None], "tuple[ModelRecord, str, str] | None"]


async def _change(redis: Redis, keys: TierKeys, change: Change, by: str, why: str) -> ModelRecord | None:
    """Apply `change` to the current record in one optimistic transaction and append its
    history entry. `change` returns (new record, action, the live version before) or None
    for no change (then None is returned)."""
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(keys.models)
                raw = await pipe.get(keys.models)
                cur = ModelRecord.loads(raw) if raw is not None else None
                out = change(cur)
                if out is None:
                    await pipe.unwatch()
                    return None
                new, action, before = out
                pipe.multi()
                pipe.set(keys.models, new.dumps())
                pipe.xadd(keys.models_history, {"action": action, "by": by, "at": new.updated, "why": why,
                                                "version": new.live, "previous": before,
                                                "generation": new.generation},
                          maxlen=HISTORY_MAXLEN, approximate=True)
                await pipe.execute()
                return new
            except WatchError:
                continue  # someone changed it meanwhile: judge again on what is there now


async def ensure_seeded(redis: Redis, keys: TierKeys, tc: TierConfig, by: str = "config") -> ModelRecord:
    """Seed the record from the config on first start; later, only add the config's versions the
    registry does not know (the live version is never the config's to change). Idempotent."""
    now = time.time()
    want = config_versions(tc, now, by)

    def change(cur: ModelRecord | None) -> tuple[ModelRecord, str, str] | None:
        if cur is None:
            return ModelRecord(tier=keys.tier, live=tc.version, versions=want, generation=1, updated=now), "seed", ""
        new = {n: v for n, v in want.items() if n not in cur.versions}
        if not new:
            return None
        return (replace(cur, versions={**cur.versions, **new}, generation=cur.generation + 1, updated=now),
                "register", cur.live)

    got = await _change(redis, keys, change, by, "from the config")
    if got is not None:
        return got
    rec = await read_record(redis, keys)
    assert rec is not None
    return rec



async def read_or_seed(redis: Redis, keys: TierKeys, tc: TierConfig) -> ModelRecord:
    """The tier's record; the config seeds it first if nothing has yet (an admin call made before
    any scaler started). A record already there is read, not rewritten."""
    return await read_record(redis, keys) or await ensure_seeded(redis, keys, tc)

def _known(cur: ModelRecord | None, version: str) -> ModelRecord:
    if cur is None:
        raise RegistryError("the registry has no record of this tier yet",
                            "registry_not_seeded", 409)
    if version not in cur.versions:
        raise RegistryError(f"unknown version {version!r}; known: {', '.join(sorted(cur.versions))}",
                            "version_not_found", 404)
    return cur


async def promote(redis: Redis, keys: TierKeys, version: str, *, by: str, why: str = "",
                  canary: int | None = None) -> ModelRecord:
    """Make `version` live and start a rollout to it. The live one becomes the previous known-good,
    unless it is itself a promotion still on trial (not judged): then the known-good stays."""
    now = time.time()

    def change(cur: ModelRecord | None) -> tuple[ModelRecord, str, str]:
        cur = _known(cur, version)
        if cur.live == version:
            raise RegistryError(f"{version!r} is already live", "already_live", 409)
        gen = cur.generation + 1
        ro = Rollout(id=gen, kind="promote", from_version=cur.live, to_version=version, started=now, by=by,
                     canary=canary)
        on_trial = cur.rollout is not None and cur.rollout.kind == "promote" and not cur.rollout.judged
        good = cur.previous if on_trial and cur.previous != version else cur.live
        new = replace(cur, live=version, previous=good, generation=gen, updated=now, rollout=ro)
        return new, "promote", cur.live

    got = await _change(redis, keys, change, by, why or f"promote to {version}")
    assert got is not None
    return got


async def rollback(redis: Redis, keys: TierKeys, *, by: str, why: str = "", to: str | None = None,
                   automatic: bool = False, of_rollout: int | None = None) -> ModelRecord | None:
    """Make `to` (default: the previous known-good version) live again, and roll out to it.
    `of_rollout`: only if that rollout is still the one in the record (the scaler's automatic
    un-promotion: returns None when it was already judged, rolled back or replaced)."""
    now = time.time()
    action = "auto_rollback" if automatic else "rollback"

    def change(cur: ModelRecord | None) -> tuple[ModelRecord, str, str] | None:
        if of_rollout is not None and (cur is None or cur.rollout is None or cur.rollout.id != of_rollout
                                       or cur.rollout.judged):
            return None
        target = to or (cur.previous if cur is not None else None)
        if target is None:
            raise RegistryError("no previous known-good version to roll back to; name one with --to",
                                "no_previous_version", 409)
        cur = _known(cur, target)
        if cur.live == target:
            raise RegistryError(f"{target!r} is already live", "already_live", 409)
        gen = cur.generation + 1
        ro = Rollout(id=gen, kind=action, from_version=cur.live, to_version=target, started=now, by=by,
                     judged=True)  # a way back is not judged: there is nothing older to compare it with
        previous = cur.previous if cur.previous not in (target, cur.live) else None
        return replace(cur, live=target, previous=previous, generation=gen, updated=now, rollout=ro), action, cur.live

    return await _change(redis, keys, change, by, why or f"roll back to {to or 'the previous version'}")


async def finish_rollout(redis: Redis, keys: TierKeys, rollout_id: int, *, judged: bool = False, done: bool = False,
                         by: str, why: str) -> bool:
    """Mark the rollout `rollout_id` judged (kept) or done (every replica at its version), once:
    False when it is no longer the record's rollout, or already so marked."""
    now = time.time()

    def change(cur: ModelRecord | None) -> tuple[ModelRecord, str, str] | None:
        if cur is None or cur.rollout is None or cur.rollout.id != rollout_id:
            return None
        if done:
            if cur.rollout.done_at is not None:
                return None
            ro = replace(cur.rollout, done_at=now)
            return replace(cur, rollout=ro, generation=cur.generation + 1, updated=now), "rollout_done", cur.live
        if cur.rollout.judged:
            return None
        ro = replace(cur.rollout, judged=True, canary=None)
        return replace(cur, rollout=ro, generation=cur.generation + 1, updated=now), "judged", cur.live

    return await _change(redis, keys, change, by, why) is not None
