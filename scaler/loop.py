"""The control loop (`fleet scaler`): observe each tier in Redis, ask the policy, act.

Each tick (at least once a second) the leader ticks the budget governor once
for the fleet (`fleet.governor.govern`: the judgement everyone else reads),
then ticks each tier (`Scaler.tick_tier`): observe, plan with
`fleet.policy.plan_tier` (the function the simulator calls), act through the
supervisor, publish. The loop is an adapter: it fills the plan's input from
Redis and the supervisor, keeps each tier's `PlanState`, and carries out the plan.

Only the holder of the lease acts; others stand by and take over when it
stops renewing. A stopped scaler leaves its replicas serving for the next
leader to adopt, unless told to drain them (`fleet up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
import uuid
from pathlib import Path

from redis.asyncio import Redis

from fleet import metrics
from fleet.config import FleetConfig
from fleet.governor import govern
from fleet.observe import observation_of, observed
from fleet.policy import (
    ObservedReplica,
    PlanInput,
    PlanState,
    ScaleDecision,
    TierObservation,
    TierPlan,
    modelled_startup_s,
    plan_tier,
    replicas_by_version,
    scale_in_victims,
    startup_estimate,
    with_start_timeout,
    with_startup,
)
from fleet.store import scaler_state
from fleet.store.affinity import cached_prefixes
from fleet.store.capacity import publish_calibration
from fleet.store.connection import connect
from fleet.store.heartbeats import Heartbeat, read_heartbeats
from fleet.store.keys import TierKeys, scaler_leader_key
from fleet.store.leader import Lease
from fleet.store.line import Line
from fleet.store.prewarm_orders import read_orders
from fleet.store.scaler_state import ScalerState, read_scaler_state, write_scaler_state
from fleet.store.tier_budget import read_budget_state
from scaler.rollout import Rollouts
from scaler.supervisor import ReplicaEvent, Supervisor

log = logging.getLogger("fleet.scaler")


class Scaler:
    def __init__(self, cfg: FleetConfig, redis: Redis, supervisor: Supervisor, *, scaler_id: str | None = None,
                 tick_s: float = 1.0, lease_s: float = 3.0) -> None:
        self.cfg = cfg
        self.redis = redis
        self.supervisor = supervisor
        self.id = scaler_id or f"scaler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.tick_s = tick_s
        self.lease = Lease(redis, scaler_leader_key(cfg.namespace), self.id, lease_s)
        self.lines = {t: Line(redis, cfg.namespace, t, result_ttl_s=cfg.result_ttl_s,
                              rate_window_s=cfg.rate_window_s) for t in cfg.tiers}
        self.leader = False
        # Each tier's calibration, calm and measured start-ups, carried from tick to tick.
        # Start-ups that timed out ran at least so long: until one is measured, the expected
        # start-up is no shorter (the sim profile's may be far off a real engine's).
        self.plans: dict[str, PlanState] = {t: PlanState() for t in cfg.tiers}
        self.last_written: dict[str, tuple[str, str]] = {}
        self.rollouts = Rollouts(cfg, redis, supervisor, self.id)  # the model registry's versions

    # --- the loop -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, stop_replicas_on_exit: bool = False,
                  exit_grace_s: float = 30.0) -> None:
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    await self.step()
                except Exception:  # a Redis blip must not end the loop; the next tick retries
                    log.exception("scaler tick failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, self.tick_s - (time.monotonic() - t0)))
        finally:
            if self.leader:
                if stop_replicas_on_exit:
                    log.info("stopping: draining %d replicas", len(self.supervisor.records))
                    await self.supervisor.stop_all(exit_grace_s)
                with contextlib.suppress(Exception):
                    await self.lease.release()  # a standby takes over now, not after the lease runs out

    async def step(self) -> None:
        """One tick: hold or take the lease (a new leader adopts the running replicas); as the
        leader, tick the budget governor once for the fleet, then each tier."""
        held = await self.lease.hold()
        if held and not self.leader:
            self.leader = True
            log.info("%s is the acting scaler", self.id)
            await self._take_over()
        elif not held and self.leader:
            self.leader = False
            log.warning("%s lost the lease; standing by", self.id)
            self.supervisor.forget()
        if not self.leader:
            return
        try:  # the budget governor first, so each tier's ceiling is fresh
            await govern(self.redis, self.cfg)
        except Exception:  # the last published judgement (or none) stands; scaling goes on
            log.exception("budget governor tick failed")
        for tier in self.cfg.tiers:
            if not self.leader:  # lost the lease mid-tick (checked before each start and drain)
                return
            try:  # one tier's failure (a launch error, a bad record) must not stop the tiers after it
                await self.tick_tier(tier)
            except Exception as e:
                log.exception("scaler tick failed for %s", tier)
                with contextlib.suppress(Exception):
                    await self._event(ReplicaEvent(tier, "", "tick_failed", f"{type(e).__name__}: {e}"))

    async def _take_over(self) -> None:
        await self.rollouts.seed()
        for tier in self.cfg.tiers:
            # Resume the hold and the measured start-up where the last leader left them.
            last = await read_scaler_state(self.redis, TierKeys(self.cfg.namespace, tier), stale_after_s=None)
            plan = dataclasses.replace(self.plans[tier], calm_since=last.calm_since if last else None,
                                       calm_keep=last.calm_keep if last else 0)
            if last is not None and last.startup_s is not None and not plan.startups:
                plan = with_startup(plan, last.startup_s)
            self.plans[tier] = plan
        for ev in await self.supervisor.restore():
            await self._event(ev)

    # --- one tier ---------------------------------------------------------------------

    def _startup(self, tier: str, heartbeats: list[Heartbeat]) -> float:
        """Launch to ready as measured here; else the engines' own cold starts; else the model
        (never below a start that timed out)."""
        plan = self.plans[tier]
        return startup_estimate(plan.startups, [r.cold_start_s for r in heartbeats if r.cold_start_s is not None],
                                modelled_startup_s(self.cfg.tiers[tier]), plan.startup_at_least_s)

    def _replicas(self, tier: str, heartbeats: list[Heartbeat], cached: dict[str, int]) -> list[ObservedReplica]:
        """The tier's replicas: what the heartbeats say, corrected by what this supervisor knows
        (a replica sent SIGTERM is draining whatever its last beat said; one launched that has
        not beaten yet is starting), so a need is never ordered twice; `cached`: the prefixes each holds."""
        tc = self.cfg.tiers[tier]
        out = {b.id: observed(b, cached=cached.get(b.id, 0)) for b in heartbeats}
        for rec in self.supervisor.of_tier(tier):
            if rec.state in ("draining", "stopping", "parked"):
                state = "draining"  # SIGTERM sent; its heartbeat may not say so yet
            elif rec.id in out:
                continue
            else:
                state = "starting" if rec.state == "starting" else "ready"
            beat = out.get(rec.id)
            out[rec.id] = (ObservedReplica(rec.id, state, tc.slots, 0, rec.launched, version=rec.version)
                           if beat is None else dataclasses.replace(beat, state=state))
        return list(out.values())

    async def tick_tier(self, tier: str) -> ScaleDecision:
        """One tick of one tier: observe, plan, act, publish.

        1. Observe (`_plan_input`): the line, the heartbeats, and the supervisor's
           own replicas (whose events, such as a death or a start timeout, are
           reported and counted first), the budget judgement, operator pre-warms,
           GPU room.
        2. Plan with `fleet.policy.plan_tier`, the function the simulator calls
           (calibrate, pre-warm floor, ceilings, decide); publish its calibration
           for the gateways.
        3. Act through the supervisor (start replicas; drain the one
           `fleet.policy.scale_in_victims` names), renewing the lease before each act.
        4. Publish the decision (`fleet.store.scaler_state`) and the metrics.
        """
        k = TierKeys(self.cfg.namespace, tier)
        inp, events = await self._plan_input(tier, k)
        plan = plan_tier(inp, self.plans[tier])
        self.plans[tier] = plan.state
        obs, d = inp.obs, plan.decision
        now = obs.now
        await publish_calibration(self.redis, k, plan.calibration, now)
        live = await self.rollouts.live(tier)  # new replicas start at the live version
        note = await self._execute(tier, d, obs, live)
        if d.action in ("hold", "capped"):  # a rollout steps only while the scaler's own decision holds
            note += await self.rollouts.step(tier, d, obs, self._lease_ok)
        replaced = [e.replica for e in events if e.event in ("died", "start_timeout")]
        if d.action == "scale_out" and replaced:
            note += f"; replaces {', '.join(replaced)}"

        reps = obs.replicas
        metrics.SCALE_DECISIONS.labels(tier, d.action, d.code).inc()
        metrics.set_replicas(tier, replicas_by_version(reps.members, live))
        metrics.REPLICA_FLOOR.labels(tier).set(d.floor)
        metrics.REPLICA_CEILING.labels(tier).set(d.ceiling)
        await self._publish(k, tier, d, note, now, plan, reps.by_state)
        return d

    async def _plan_input(self, tier: str, k: TierKeys) -> tuple[PlanInput, list[ReplicaEvent]]:
        """What `plan_tier` needs of one tier now, read from Redis and the supervisor (whose
        events are reported first, and returned: a scale-out says which replicas it replaces)."""
        tc = self.cfg.tiers[tier]
        snap = await self.lines[tier].observe()
        heartbeats = await read_heartbeats(self.redis, k, self.cfg.heartbeat_s)
        events = await self.supervisor.poll({r.id for r in heartbeats if r.state == "ready"},
                                            self._startup(tier, heartbeats), tier,
                                            beating_ids={r.id for r in heartbeats})
        gone = {e.replica for e in events if e.event in ("died", "drained")}
        heartbeats = [r for r in heartbeats if r.id not in gone]
        for ev in events:
            await self._event(ev)

        now = time.time()
        budget = await read_budget_state(self.redis, k)
        cached = await cached_prefixes(self.redis, k)  # the scale-in victim: the coldest cache first
        obs = observation_of(tier, snap, self._replicas(tier, heartbeats, cached), budget,
                             window_s=self.cfg.rate_window_s, now=now, startups_measured=self.plans[tier].startups)
        orders = await read_orders(self.redis, k, now, prune=True)
        # Room left beside every replica holding GPUs; draining ones are booked too, and
        # the policy subtracts them from the ceiling itself, so they count in it.
        room = self.supervisor.placement.room(tc.gpus_per_replica, tc.gpu_memory_gb)
        return PlanInput(obs, tc, self.tick_s, orders, room), events

    async def _lease_ok(self) -> bool:
        """Renew the lease before acting: a launch can block for seconds, and a scaler that
        lost the lease meanwhile must not start or drain what the new leader manages."""
        if await self.lease.hold():
            return True
        self.leader = False
        log.warning("%s lost the lease mid-tick; standing by", self.id)
        self.supervisor.forget()
        return False

    async def _execute(self, tier: str, d: ScaleDecision, obs: TierObservation, live: str = "") -> str:
        """Carry out a decision through the supervisor, renewing the lease before each act;
        returns a note for the published reason (what could not be done, and why)."""
        if d.action == "scale_out":
            started = 0
            for _ in range(d.delta):
                if not await self._lease_ok():
                    return f" (started {started}; lease lost)"
                try:
                    rec = await self.supervisor.start(tier, version=live)
                except Exception as e:  # the backend could not launch: say so, try again next tick
                    log.exception("%s: launch failed", tier)
                    await self._event(ReplicaEvent(tier, "", "launch_failed", f"{type(e).__name__}: {e}"))
                    return f" (started {started}; launch failed: {type(e).__name__})"
                if rec is None:
                    break
                started += 1
                await self._event(ReplicaEvent(tier, rec.id, "started", d.reason))
            return "" if started == d.delta else f" (started {started}; capped: gpu_memory)"
        if d.action == "scale_in":
            ours = {r.id for r in self.supervisor.of_tier(tier) if r.state in ("starting", "ready")}
            # The policy names them; each finishes what it holds before leaving.
            victims = scale_in_victims(obs.replicas.members, -d.delta,
                                       eligible=self.rollouts.scale_in_eligible(tier, obs, ours))
            if not victims:
                return " (no replica this supervisor can drain)"
            done = []
            for victim in victims:
                if not await self._lease_ok():
                    return f" ({', '.join(done)}; lease lost)" if done else " (lease lost)"
                how = await self.rollouts.retire(tier, victim.id)  # an old version's may park, warm
                done.append(f"{'parking' if how == 'park' else 'draining'} {victim.id}, {victim.in_use} in flight")
            return f" ({'; '.join(done)})"
        return ""

    async def _publish(self, k: TierKeys, tier: str, d: ScaleDecision, note: str, now: float, plan: TierPlan,
                       count: dict[str, int]) -> None:
        acted, pw, cold = d.action != "hold", plan.prewarm, plan.ready_cold
        await write_scaler_state(self.redis, k, ScalerState(
            floor=d.floor, ceiling=d.ceiling, ceiling_by=d.ceiling_by, desired=d.desired, action=d.action,
            delta=d.delta, reason=d.reason + note, code=d.code, at=now, ts=now, scaler=self.id,
            ready=count["ready"], starting=count["starting"], draining=count["draining"], prewarm_floor=pw.floor,
            prewarm_until=pw.until, prewarm_source=pw.source or "", calm_since=d.calm_since, calm_keep=d.calm_keep,
            startup_s=round(plan.capacity.startup_s, 3), tick_s=self.tick_s, ready_cold_s=round(cold.seconds, 3),
            ready_cold_measured=cold.measured, ready_cold_source=cold.source, last_action=d.action if acted else "",
            last_reason=d.reason + note if acted else "", last_at=now if acted else None))
        key = (d.action, d.code)
        if d.action in ("scale_out", "scale_in") or self.last_written.get(tier) != key:
            self.last_written[tier] = key
            await scaler_state.append_decision(self.redis, k, action=d.action, delta=d.delta, reason=d.reason + note,
                                               code=d.code, floor=d.floor, ceiling=d.ceiling, at=now,
                                               scaler=self.id)
            if acted:
                log.info("%s: %s%s", tier, d.reason, note)

    async def _event(self, ev: ReplicaEvent) -> None:
        k = TierKeys(self.cfg.namespace, ev.tier)
        metrics.REPLICA_EVENTS.labels(ev.tier, ev.event).inc()
        if ev.startup_s is not None:
            self.plans[ev.tier] = with_startup(self.plans.get(ev.tier, PlanState()), ev.startup_s)
        if ev.at_least_s is not None:
            self.plans[ev.tier] = with_start_timeout(self.plans.get(ev.tier, PlanState()), ev.at_least_s)
        if ev.event in ("launch_failed", "tick_failed"):
            await scaler_state.count(self.redis, k, "launch_failures" if ev.event == "launch_failed"
                                     else "tick_failures")
        if ev.event in ("died", "start_timeout", "lost"):
            await scaler_state.count(self.redis, k, "deaths" if ev.event != "start_timeout" else "start_timeouts")
            log.warning("%s: replica %s %s: %s", ev.tier, ev.replica, ev.event, ev.detail)
        if ev.event != "started":  # a start is already in the stream as its decision
            await scaler_state.append_event(self.redis, k, event=ev.event, replica=ev.replica, reason=ev.detail,
                                            at=time.time(), scaler=self.id)


def worker_env(redis_url: str, config_path: str | None) -> dict[str, str]:
    """What a replica inherits: this environment, the Redis and the config the scaler uses."""
    env = {**os.environ, "REDIS_URL": redis_url}
    if config_path:
        env["FLEET_CONFIG"] = str(Path(config_path).absolute())
    return env


async def run_scaler(cfg: FleetConfig, redis_url: str, *, backend: str = "local", engine: str | None = None,
                     image: str = "fleet-gateway:latest", network: str | None = None, tick_s: float = 1.0,
                     lease_s: float = 3.0, drain_grace_s: float = 300.0, stop_replicas_on_exit: bool = False,
                     metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                     config_path: str | None = None, scaler_id: str | None = None,
                     volumes: list[str] | None = None, ray_address: str | None = None,
                     worker_metrics_port: int | None = None) -> None:
    """`fleet scaler`: metrics, GPU inventory, the backend (local processes, Docker, or a Ray
    cluster), the supervisor and the loop, until SIGTERM or SIGINT."""
    from scaler.backends import Backend, DockerBackend, LocalBackend
    from scaler.placement import Placement, discover

    if metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, addr=metrics_host)
        except OSError as e:  # metrics are worth a warning, not a dead scaler
            log.warning("cannot serve metrics on %s:%d: %s", metrics_host, metrics_port, e)
    gpus, source = discover(cfg.gpus)
    log.info("GPU inventory from %s: %s", source,
             ", ".join(f"{g.index}:{g.memory_gb:.0f}GB" for g in gpus) or "none (replicas run without GPUs)")
    env = worker_env(redis_url, config_path)
    be: Backend
    if backend == "ray":  # Ray places replicas on its nodes' GPUs: no local inventory applies
        from scaler.ray_backend import RayBackend

        be, gpus = RayBackend(cfg.namespace, ray_address or "auto",
                              {k: v for k, v in env.items() if k.startswith(("FLEET_", "REDIS_"))},
                              {t: tc.gpus_per_replica for t, tc in cfg.tiers.items()}, engine=engine), []
    elif backend == "docker":
        be = DockerBackend(cfg.namespace, image, {k: v for k, v in env.items() if k.startswith(("FLEET_", "REDIS_"))},
                           network=network, engine=engine, volumes=volumes, metrics_port=worker_metrics_port)
    else:
        be = LocalBackend(env, engine=engine)
    redis = connect(redis_url, "calls", name="scaler")
    supervisor = Supervisor(cfg, redis, be, Placement(gpus), drain_grace_s=drain_grace_s)
    scaler = Scaler(cfg, redis, supervisor, scaler_id=scaler_id, tick_s=tick_s, lease_s=lease_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    log.info("%s standing by for the lease (tick %.2f s, lease %.1f s)", scaler.id, tick_s, lease_s)
    try:
        await scaler.run(stop, stop_replicas_on_exit=stop_replicas_on_exit, exit_grace_s=min(drain_grace_s, 60))
    finally:
        await redis.aclose()

