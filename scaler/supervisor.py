"""The supervisor: starts, drains and stops worker replicas, and watches them.

It keeps a record of every replica it started in Redis (`TierKeys.supervised`)
so that the next leader can re-find them after a scaler restart or takeover.
Each poll reports what happened to them: ready (with the measured start-up),
died (replaced by the next decision, and counted), start_timeout (not ready
within the timeout derived from the expected start-up: stopped and reported,
never waited on forever), drained, killed_after_grace.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from fleet.config import FleetConfig
from fleet.policy import start_timeout_s, wedged
from fleet.store.heartbeats import remove_heartbeat
from fleet.store.keys import TierKeys
from scaler.backends import Backend, Supervised
from scaler.placement import Placement

log = logging.getLogger("fleet.scaler.supervisor")


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    tier: str
    replica: str
    event: str  # started | ready | drained | died | start_timeout | killed_after_grace | lost | launch_failed
    detail: str
    startup_s: float | None = None  # for `ready`: launch to ready, as measured here
    at_least_s: float | None = None  # for `start_timeout`: the start-up is longer than this (a lower bound)


class Supervisor:
    def __init__(self, cfg: FleetConfig, redis: Redis, backend: Backend, placement: Placement, *,
                 drain_grace_s: float = 300.0) -> None:
        self.cfg = cfg
        self.redis = redis
        self.backend = backend
        self.placement = placement
        self.drain_grace_s = drain_grace_s
        self.records: dict[str, Supervised] = {}
        self.start_timeouts: dict[str, int] = {}  # tier -> consecutive start timeouts (each doubles the limit)
        self.last_beat: dict[str, float] = {}  # replica -> when a live heartbeat was last seen
        self.watched: dict[str | None, float] = {}  # tier (None: all) -> when it was last polled

    def keys(self, tier: str) -> TierKeys:
        return TierKeys(self.cfg.namespace, tier)

    def of_tier(self, tier: str) -> list[Supervised]:
        return [r for r in self.records.values() if r.tier == tier]

    async def _save(self, rec: Supervised) -> None:
        await self.redis.hset(self.keys(rec.tier).supervised, rec.id, rec.dumps())

    # --- leadership ---------------------------------------------------------------

    async def restore(self) -> list[ReplicaEvent]:
        """Take over the replicas an earlier leader started, from its records and
        (Docker) the labels; records of replicas that are gone are dropped."""
        events = []
        for tier in self.cfg.tiers:
            k = self.keys(tier)
            for rid, raw in (await self.redis.hgetall(k.supervised)).items():
                name = rid.decode() if isinstance(rid, bytes) else rid
                if name in self.records:
                    continue
                try:
                    rec = Supervised.loads(raw)
                except (ValueError, TypeError):
                    await self.redis.hdel(k.supervised, name)
                    continue
                if rec.backend == self.backend.name and self.backend.adopt(rec):
                    self.records[rec.id] = rec
                    self.placement.book(rec.id, rec.gpus, rec.gpu_gb)
                elif rec.backend == self.backend.name:
                    await self.redis.hdel(k.supervised, name)
                    events.append(ReplicaEvent(tier, name, "lost", "gone while no scaler was watching"))
        for rec in self.backend.discover(self.cfg.namespace):
            if rec.id not in self.records and rec.tier in self.cfg.tiers:
                self.records[rec.id] = rec
                self.placement.book(rec.id, rec.gpus, rec.gpu_gb)
                await self._save(rec)
        return events

    def forget(self) -> None:
        """Lost the lease: stop managing, without touching a replica (the new leader adopts them)."""
        self.records.clear()
        self.placement.booked.clear()
        self.last_beat.clear()

    # --- actions --------------------------------------------------------------------

    async def start(self, tier: str, version: str = "") -> Supervised | None:
        """Start one replica of the tier (at `version` of its model); None when no GPU has room for it."""
        tc = self.cfg.tiers[tier]
        rid = f"{tier}-{uuid.uuid4().hex[:8]}"
        gpus = self.placement.place(rid, tc.gpus_per_replica, tc.gpu_memory_gb)
        if gpus is None:
            return None
        rec = Supervised(id=rid, tier=tier, backend=self.backend.name, launched=time.time(), gpus=gpus,
                         gpu_gb=tc.gpu_memory_gb if gpus else 0.0, version=version)
        try:  # a launch can block for seconds (pulling, creating a container): off the event loop
            await asyncio.to_thread(self.backend.launch, rec)
        except Exception:
            self.placement.release(rid)
            raise
        self.records[rid] = rec
        await self._save(rec)
        log.info("started %s%s", rid, f" on GPUs {','.join(map(str, gpus))}" if gpus else "")
        return rec

    async def drain(self, rid: str) -> bool:
        """SIGTERM: the replica stops claiming, finishes what it holds, exits."""
        rec = self.records.get(rid)
        if rec is None or rec.state in ("draining", "stopping"):
            return False
        await asyncio.to_thread(self.backend.terminate, rec)
        rec.state, rec.drain_at = "draining", time.time()
        await self._save(rec)
        log.info("draining %s", rid)
        return True

    async def park(self, rid: str) -> bool:
        """SIGUSR1: the replica stops claiming and finishes what it holds, but stays up and warm
        (its heartbeat says draining) until `unpark`, or a drain after the tier's warm grace."""
        rec = self.records.get(rid)
        if rec is None or rec.state != "ready":
            return False
        await asyncio.to_thread(self.backend.signal, rec, signal.SIGUSR1)
        rec.state, rec.parked_at = "parked", time.time()
        await self._save(rec)
        log.info("parked %s (warm)", rid)
        return True

    async def unpark(self, rid: str) -> bool:
        """SIGUSR2: a parked replica claims again, with no cold start."""
        rec = self.records.get(rid)
        if rec is None or rec.state != "parked":
            return False
        await asyncio.to_thread(self.backend.signal, rec, signal.SIGUSR2)
        rec.state, rec.parked_at = "ready", None
        await self._save(rec)
        log.info("resumed %s", rid)
        return True

    # --- watching -------------------------------------------------------------------

    async def poll(self, ready_ids: set[str], startup_s: float = 0.0, tier: str | None = None, *,
                   beating_ids: set[str] | None = None) -> list[ReplicaEvent]:
        """Check the replicas (of one tier, or all) once. `ready_ids`: replicas whose
        heartbeat says ready; `startup_s`: the expected start-up (for the start timeout);
        `beating_ids`: replicas with a live heartbeat in any state (None: not observed,
        so neither a wedged replica nor a loading one can be told apart)."""
        now = time.time()
        events: list[ReplicaEvent] = []
        # Not polled for a while: this scaler's own ticks failed (Redis away or frozen), and the
        # replicas' silence since is the store's, not theirs. Each gets a full wedged window again
        # rather than being killed with its running work on the first tick after the outage.
        blind = now - self.watched.get(tier, now) > 3 * self.cfg.heartbeat_s + 1
        self.watched[tier] = now
        for rec in list(self.records.values()):
            if tier is not None and rec.tier != tier:
                continue
            if blind or (beating_ids is not None and (rec.id in beating_ids or rec.id in ready_ids)):
                self.last_beat[rec.id] = now
            self.last_beat.setdefault(rec.id, now)  # first seen (started, adopted): its beats are still due
            if not self.backend.alive(rec):
                gone = await self._left(rec)
                if gone is not None:
                    events.append(gone)
                continue
            if rec.state == "parked" and now - (rec.parked_at or now) > self.cfg.tiers[rec.tier].rollout.warm_grace_s:
                await self.drain(rec.id)  # the warm grace is over: a rollback now starts afresh
                events.append(ReplicaEvent(rec.tier, rec.id, "warm_grace_over", "parked past the warm grace; "
                                           "draining"))
            elif rec.state == "draining" and rec.drain_at and now - rec.drain_at > self.drain_grace_s:
                self.backend.kill(rec)
                rec.state = "stopping"
                await self._save(rec)
                events.append(ReplicaEvent(rec.tier, rec.id, "killed_after_grace",
                                           f"still draining after {self.drain_grace_s:g} s; killed (its leases "
                                           "expire and the line requeues what it held)"))
            elif rec.state == "starting":
                started = await self._check_start(rec, now, rec.id in ready_ids, startup_s,
                                                  loading=beating_ids is not None and rec.id in beating_ids)
                if started is not None:
                    events.append(started)
            elif (rec.state == "ready" and beating_ids is not None and rec.id not in beating_ids
                  and wedged(self.last_beat[rec.id], now, self.cfg.heartbeat_s)):
                # Alive to the backend but silent: wedged. It must not count as ready for
                # ever; killed, it is reported died and replaced as a dead replica is.
                self.backend.kill(rec)
                rec.state = "stopping"
                await self._save(rec)
                events.append(ReplicaEvent(rec.tier, rec.id, "died", f"no heartbeat for "
                                           f"{now - self.last_beat[rec.id]:.0f} s while ready; killed"))
        return events

    async def _left(self, rec: Supervised) -> ReplicaEvent | None:
        """A replica the backend says is gone: forget it; `drained` or `died` (None for one
        that was stopped: it was reported then)."""
        self.backend.cleanup(rec)
        await self._remove(rec)
        code = f"exit {rec.exit_code}" if rec.exit_code is not None else "exited"
        if rec.state in ("draining", "parked"):
            return ReplicaEvent(rec.tier, rec.id, "drained", f"drained and left ({code})")
        if rec.state != "stopping":
            return ReplicaEvent(rec.tier, rec.id, "died", f"died while {rec.state} ({code})")
        return None

    async def _check_start(self, rec: Supervised, now: float, ready: bool, startup_s: float, *,
                           loading: bool) -> ReplicaEvent | None:
        """A starting replica: `ready` once its heartbeat says so (with its measured start-up),
        `start_timeout` (stopped) once it took longer than `start_timeout_s` allows."""
        took = now - rec.launched
        if ready:
            rec.state, rec.ready_at = "ready", now
            await self._save(rec)
            self.start_timeouts[rec.tier] = 0
            return ReplicaEvent(rec.tier, rec.id, "ready", f"ready after {took:.1f} s", took)
        limit = start_timeout_s(startup_s, self.start_timeouts.get(rec.tier, 0), beating=loading)
        if took <= limit:
            return None
        self.backend.kill(rec)
        rec.state = "stopping"
        await self._save(rec)
        # The next start of this tier gets twice as long: the expected
        # start-up may be the sim model's, not this engine's.
        self.start_timeouts[rec.tier] = self.start_timeouts.get(rec.tier, 0) + 1
        return ReplicaEvent(rec.tier, rec.id, "start_timeout", f"not ready after {limit:.0f} s; stopped",
                            at_least_s=took)

    async def _remove(self, rec: Supervised) -> None:
        self.records.pop(rec.id, None)
        self.last_beat.pop(rec.id, None)
        self.placement.release(rec.id)
        k = self.keys(rec.tier)
        # A killed worker cannot remove its own heartbeat; without this it would
        # count as alive for a few more beats.
        await self.redis.hdel(k.supervised, rec.id)
        await remove_heartbeat(self.redis, k, rec.id)

    async def stop_all(self, grace_s: float) -> None:
        """Drain every replica, wait up to `grace_s` for them to leave, kill the rest."""
        for rid in list(self.records):
            await self.drain(rid)
        end = time.monotonic() + grace_s
        while self.records and time.monotonic() < end:
            await self.poll(set())
            await asyncio.sleep(0.1)
        for rec in list(self.records.values()):
            self.backend.kill(rec)
        end = time.monotonic() + 5
        while self.records and time.monotonic() < end:
            await self.poll(set())
            await asyncio.sleep(0.05)
