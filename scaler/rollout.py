"""The scaler's side of the model registry: which version a new replica starts at, and rollouts.

Each tick the acting scaler reads the tier's registry record. Every replica
it starts runs the live version; a scale-in drains a replica at an older
version first (`fleet.policy.drain_first`); and while its own decision
holds, the rollout takes one step (`fleet.policy.rollout_step`): start one
replica at the live version, or, once one is ready, drain one old one. The
step is derived from the replicas observed (their heartbeats carry their
version), so a new leader resumes a rollout where the last left it, and
marking it done is a compare-and-set on the rollout's id: two scalers never
act on one promotion twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from fleet import metrics
from fleet.config import FleetConfig
from fleet.policy import (
    Outcome,
    ScaleDecision,
    TierObservation,
    drain_first,
    judge_rollout,
    rollout_step,
    version_stats,
)
from fleet.store import scaler_state
from fleet.store.keys import TierKeys
from fleet.store.model_registry import ModelRecord, Rollout, ensure_seeded, finish_rollout, read_record, rollback
from fleet.store.version_outcomes import read_outcomes
from scaler.supervisor import Supervisor

log = logging.getLogger("fleet.scaler.rollout")


class Rollouts:
    def __init__(self, cfg: FleetConfig, redis: Redis, supervisor: Supervisor, scaler_id: str) -> None:
        self.cfg = cfg
        self.redis = redis
        self.supervisor = supervisor
        self.scaler_id = scaler_id
        self.records: dict[str, ModelRecord] = {}
        # Per tier, the calls read so far for the promotion being judged: (rollout id, read on after, calls).
        self.outcomes: dict[str, tuple[int, str | None, list[Outcome]]] = {}

    def keys(self, tier: str) -> TierKeys:
        return TierKeys(self.cfg.namespace, tier)

    async def seed(self) -> None:
        """On taking the lease: the config seeds each tier's record if none exists (or adds the
        versions the registry does not know); the registry's live version is never changed here."""
        for tier, tc in self.cfg.tiers.items():
            self.records[tier] = await ensure_seeded(self.redis, self.keys(tier), tc, by=f"config ({self.scaler_id})")

    async def live(self, tier: str) -> str:
        """The tier's live version, read fresh each tick (an operator may have promoted since),
        after judging a promotion still on trial (which may undo it)."""
        rec = await read_record(self.redis, self.keys(tier))
        if rec is None:  # flushed or never seeded: the config seeds it again
            rec = await ensure_seeded(self.redis, self.keys(tier), self.cfg.tiers[tier], by=self.scaler_id)
        if rec.rollout is not None and rec.rollout.kind == "promote" and not rec.rollout.judged:
            rec = await self._judge(tier, rec, rec.rollout)
        self.records[tier] = rec
        return rec.live

    async def _judge(self, tier: str, rec: ModelRecord, ro: Rollout) -> ModelRecord:
        """Compare the promoted version, since the promotion, with the one it replaced, over the
        window before and since (`fleet.policy.judge_rollout`): undo it if worse, saying why in
        the decision stream, a metric and the log; mark it judged when the window passes."""
        k, rc, now = self.keys(tier), self.cfg.tiers[tier].rollout, time.time()
        since = ro.started - rc.judge_window_s  # the old version: the window before the promotion, and since
        of, after, calls = self.outcomes.get(tier) or (ro.id, None, [])
        if of != ro.id:
            after, calls = None, []
        got, last = await read_outcomes(self.redis, k, since_s=since, after=after)  # only what is new
        calls.extend(got)
        self.outcomes[tier] = (ro.id, last or after, calls)
        v = judge_rollout(version_stats(calls, ro.to_version, ro.started), version_stats(calls, ro.from_version, since),
                          rc, now - ro.started)
        if v.verdict == "wait":
            return rec
        self.outcomes.pop(tier, None)
        if v.verdict == "rollback" and rc.auto_rollback:
            back = await rollback(self.redis, k, by=self.scaler_id, to=ro.from_version, automatic=True,
                                  of_rollout=ro.id, why=f"automatic: {ro.to_version} is worse: {v.reason}")
            if back is None:  # judged or replaced meanwhile (an operator, another scaler): not ours to undo
                return await read_record(self.redis, k) or rec
            metrics.MODEL_ROLLBACKS.labels(tier, v.code).inc()
            log.warning("%s: rolled %s back to %s: %s", tier, ro.to_version, ro.from_version, v.reason)
            await scaler_state.append_event(self.redis, k, event="auto_rollback", replica="", at=now,
                                            reason=f"{ro.to_version} -> {ro.from_version}: {v.reason}",
                                            scaler=self.scaler_id)
            return back
        why = v.reason if v.verdict == "keep" else f"worse ({v.reason}), kept: rollout.auto_rollback is off"
        if await finish_rollout(self.redis, k, ro.id, judged=True, by=self.scaler_id, why=why):
            log.info("%s: %s judged: %s", tier, ro.to_version, why)
            await scaler_state.append_event(self.redis, k, event="judged", replica="",
                                            reason=f"{ro.to_version}: {why}", at=now, scaler=self.scaler_id)
        return await read_record(self.redis, k) or rec

    def scale_in_eligible(self, tier: str, obs: TierObservation, eligible: set[str]) -> set[str]:
        rec = self.records.get(tier)
        return drain_first(obs.replicas.members, rec.live, eligible) if rec else eligible

    async def retire(self, tier: str, rid: str) -> str:
        """Take a replica out of service (a rollout's step or a scale-in): "park" it when it runs the
        version a promotion replaced and the tier keeps that warm for a fast way back, else "drain"
        it; "" when neither applied."""
        rec, sup = self.records.get(tier), next((r for r in self.supervisor.of_tier(tier) if r.id == rid), None)
        ro = rec.rollout if rec else None
        keep_warm = (ro is not None and ro.kind == "promote" and sup is not None and sup.version == ro.from_version
                     and self.cfg.tiers[tier].rollout.warm_grace_s > 0)
        if keep_warm and await self.supervisor.park(rid):  # only a ready one parks
            return "park"
        return "drain" if await self.supervisor.drain(rid) else ""

    async def step(self, tier: str, d: ScaleDecision, obs: TierObservation,
                   lease_ok: Callable[[], Awaitable[bool]]) -> str:
        """One rollout step while the scaler's decision holds (or is capped); returns a note for
        the published reason ("" when no rollout is under way)."""
        rec = self.records.get(tier)
        ro = rec.rollout if rec else None
        if rec is None or ro is None or not ro.rolling or ro.to_version != rec.live:
            return ""
        k = self.keys(tier)
        ours = {r.id for r in self.supervisor.of_tier(tier) if r.state in ("starting", "ready")}
        target = min(max(d.desired, d.floor), d.ceiling)
        step = rollout_step(obs.replicas.members, rec.live, floor=d.floor, target=target,
                            canary=None if ro.judged else ro.canary, eligible=ours)
        now = time.time()
        if step.action == "done":
            if await finish_rollout(self.redis, k, ro.id, done=True, by=self.scaler_id, why=step.reason):
                log.info("%s: rollout %d to %s done: %s", tier, ro.id, rec.live, step.reason)
                await scaler_state.append_event(self.redis, k, event="rollout_done", replica="",
                                                reason=f"{ro.kind} to {rec.live}: {step.reason}", at=now,
                                                scaler=self.scaler_id)
            return ""
        if step.action == "wait":
            return f"; {step.reason}"
        if not await lease_ok():
            return "; lease lost"
        if step.action == "start":
            warm = [r for r in self.supervisor.of_tier(tier) if r.state == "parked" and r.version == rec.live]
            if warm and await self.supervisor.unpark(warm[0].id):  # kept warm: back with no cold start
                await scaler_state.append_event(self.redis, k, event="rollout_resume", replica=warm[0].id,
                                                reason=f"{step.reason}: resumed warm", at=now, scaler=self.scaler_id)
                return f"; {step.reason}: resumed {warm[0].id} warm"
            started = await self.supervisor.start(tier, version=rec.live)
            if started is None:
                return f"; {step.reason}: no GPU room"
            await scaler_state.append_event(self.redis, k, event="rollout_start", replica=started.id,
                                            reason=step.reason, at=now, scaler=self.scaler_id)
        elif step.replica is not None and (how := await self.retire(tier, step.replica)):
            await scaler_state.append_event(self.redis, k, event=f"rollout_{how}", replica=step.replica,
                                            reason=step.reason, at=now, scaler=self.scaler_id)
        log.info("%s: %s", tier, step.reason)
        return f"; {step.reason}"
