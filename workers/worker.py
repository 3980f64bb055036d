"""A worker replica: claims from its tier's line only as many requests as it
has free slots (the line in Redis stays the truth), runs them on its engine,
streams tokens back, measures TTFT and TPOT, and heartbeats.

Leases are renewed every heartbeat while a request runs; a request whose
lease this worker lost is aborted here, because someone else now owns it.
SIGTERM drains: stop claiming, finish what is in flight, exit. SIGUSR1 parks
(stop claiming, finish what is in flight, stay up and warm: the previous
version after a promotion); SIGUSR2 resumes a parked replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet import metrics
from fleet.config import FleetConfig
from fleet.outcome import Outcome
from fleet.policy.cold_start import ColdStartPhases
from fleet.policy.tier_capacity import claim_concurrency
from fleet.store.affinity import tier_line
from fleet.store.events import Done, Failed
from fleet.store.heartbeats import Heartbeat, ReplicaState, remove_heartbeat, write_heartbeat
from fleet.store.ledger import Ledger, TokenCharge
from fleet.store.line import Claimed
from fleet.store.payloads import BadPayload, CallPayload
from fleet.store.version_outcomes import queue_outcome
from fleet.tasks import cancel_and_wait
from workers.charging import Charges
from workers.engines.base import Engine, EngineError, EngineRequest
from workers.engines.registry import engine_name as registered_name
from workers.preempting import Attempt, Preemptor, attempt_rank
from workers.serving import Progress, run_engine
from workers.streaming import LeaseLost, StreamWriter
from workers.waiting import WAIT_S, first_of, wait_and_claim

log = logging.getLogger("fleet.worker")


class Worker:
    def __init__(self, cfg: FleetConfig, tier: str, engine: Engine, redis: Redis, *,
                 replica_id: str | None = None, engine_name: str | None = None, blocking: Redis | None = None,
                 pubsub: Redis | None = None, version: str = "", started: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.tier = tier
        self.tc = cfg.tiers[tier]
        self.engine = engine
        self.engine_name = engine_name or registered_name(engine)  # what its heartbeats say it runs
        self.version = version  # the model version it runs, in every heartbeat
        self._started = started  # called once the engine is up (a replica's process freezes the gc then)
        self.redis = redis
        self.pubsub_redis = pubsub or redis  # subscriptions wait without a read timeout
        self.replica_id = replica_id or f"{tier}-{uuid.uuid4().hex[:8]}"
        self.line = tier_line(redis, cfg, tier, blocking)  # affine where the tier says so
        self.ledger = Ledger(redis, cfg.namespace, tier, self.tc)
        self.state: ReplicaState = "starting"
        self.active: dict[str, asyncio.Task[None]] = {}
        self.owners: dict[str, str] = {}  # rid -> the lease this replica holds on it
        # The tokens of all streamed requests, written together.
        self.streams = StreamWriter(self.line, cfg.stream_window_ms / 1000)
        self.charges = Charges(self.ledger, cfg.stream_window_ms / 1000)  # ended calls' tokens, charged together
        self.concurrency = self.tc.slots  # bounded by the KV cache once the engine has started
        self.completed = 0
        self.failed: str | None = None  # why the replica gave up, if it did
        self.cold_start_s: float | None = None
        self.cold_start_phases: ColdStartPhases | None = None  # its engine's phases, when it tells them apart
        self.model_name: str | None = None
        self.started_at = time.time()
        self._slot_freed = asyncio.Event()
        self._draining = asyncio.Event()
        self._holding = asyncio.Event()  # drained or parked: claim nothing more
        self._resumed = asyncio.Event()
        self.parked = False
        self.preemptor = Preemptor(self.line, self.tc, self.replica_id)
        self._wake = self.line.keys.wake(self.replica_id)  # rung to end a wait on the bell early

    # --- lifecycle ------------------------------------------------------------

    async def run(self) -> None:
        """The replica's life: beat as starting, start the engine (its measured cold start),
        beat as ready, claim and serve until drained, then finish what runs, charge the last
        seconds, leave the heartbeats and stop the engine."""
        await self._heartbeat_once()
        hb = asyncio.create_task(self._heartbeat_loop())
        try:
            t0 = time.monotonic()
            try:
                await self.engine.start()
            except EngineError:
                raise
            except Exception as e:  # any engine's bad model path, bad settings, missing GPU
                raise EngineError(f"{type(e).__name__}: {e}", "engine_start_failed") from e
            self.cold_start_s = self.engine.cold_start_s or time.monotonic() - t0
            self.cold_start_phases = self.engine.cold_start_phases
            metrics.observe_cold_start(self.tier, self.cold_start_phases)
            self.model_name = self.engine.model_name  # the engine's name, in every answer
            self.concurrency = self._concurrency()
            if self._started is not None:
                self._started()
            if not self._draining.is_set():
                self.state = "ready"
            await self._heartbeat_once()
            log.info("replica %s ready after %.2fs cold start", self.replica_id, self.cold_start_s)
            cancels = asyncio.create_task(self._cancel_listener())
            try:
                await self._claim_loop()
                if self.active:
                    await asyncio.gather(*self.active.values(), return_exceptions=True)
            finally:
                await cancel_and_wait(cancels)  # not a lone cancel(): one lost in a Redis call hangs the exit
        finally:
            await cancel_and_wait(hb)
            await self.charges.stop()
            with contextlib.suppress(Exception):  # the last seconds cost too; then nothing more for this id
                await self.ledger.accrue(self.replica_id, self.state, self.started_at, final=True)
            await self.streams.stop()
            await remove_heartbeat(self.redis, self.line.keys, self.replica_id)
            try:
                await self.engine.stop()
            except Exception:  # an engine that never started may not stop cleanly either
                log.exception("engine stop failed")

    def drain(self) -> None:
        self.state = "draining"
        self._draining.set()
        self._holding.set()
        self._slot_freed.set()

    def park(self) -> None:
        """Stop claiming but stay up, engine warm: it says draining, and a rollback can resume it."""
        if self._draining.is_set() or self.parked:
            return
        self.parked, self.state = True, "draining"
        self._resumed.clear()
        self._holding.set()
        self._slot_freed.set()

    def resume(self) -> None:
        """Claim again after `park` (a rollback to this version: no cold start); it says so at once,
        not a beat later, so the scaler counts it ready before it starts another."""
        if self.parked and not self._draining.is_set():
            self.parked, self.state = False, "ready" if self.cold_start_s is not None else "starting"
            self._holding.clear()
            self._resumed.set()
            self._beat_now = asyncio.get_running_loop().create_task(self._heartbeat_once())

    # --- claiming -------------------------------------------------------------

    def _concurrency(self) -> int:
        """Requests this replica runs at once: its slots, but no more than its KV cache holds at the
        tier's typical request shape. What it cannot batch stays in the line, where the gateway's
        admission and the scaler see it, instead of queueing unseen inside the engine."""
        return claim_concurrency(self.tc, self.engine.kv_capacity_tokens)  # the replay takes by the same

    async def _claim_loop(self) -> None:
        """Claim from the line only what the free slots allow, until the replica drains.

        Full: wait for a slot to free. Free slots: one CLAIM for as many as are
        free; each claimed request runs in its own task (`_serve`). Nothing
        claimed, or the claim emptied the line (claiming again would find
        nothing): the next claim first waits on the line's bell (an enqueue
        rings it) for up to a second, in the same round trip (`workers.waiting`).
        A Redis error waits a little and retries; what already runs keeps running.
        """
        waiting = False  # the next claim waits for the bell first
        retry_s = WAIT_S  # how long that wait lasts at most
        while not self._draining.is_set():
            if self.parked:
                await first_of(self._resumed.wait(), self._draining.wait())
                continue
            free = self.concurrency - len(self.active)
            if free <= 0:
                self._slot_freed.clear()
                if not self.preemptor.enabled or not self.preemptor.could_preempt(self.active):
                    # Nothing here may be preempted (each call has streamed, or used its
                    # preemptions), and that holds until a slot frees: no poll finds a victim.
                    await self._slot_freed.wait()
                    continue
                # Full: look for a higher class waiting each poll (docs/preemption.md).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), self.preemptor.poll_s)
                if not self._slot_freed.is_set() and not self._draining.is_set():
                    try:
                        await self.preemptor.check(self.concurrency, self.active)
                    except Exception:  # Redis away: what runs keeps running
                        log.exception("preemption check failed")
                        await asyncio.sleep(min(5.0, self.cfg.heartbeat_s * 2))
                continue
            try:
                caps = self.preemptor.caps(self.concurrency)
                claimed = await (wait_and_claim(self.line, self._holding, self._wake, self.replica_id, free,
                                                self.tc.lease_s, caps, timeout_s=retry_s) if waiting
                                 else self.line.claim(self.replica_id, free, self.tc.lease_s, caps))
            except Exception:  # Redis away: keep what runs, try again shortly
                log.exception("claim failed; retrying")
                waiting = False
                await asyncio.sleep(min(5.0, self.cfg.heartbeat_s * 2))
                continue
            for c in claimed:
                self._start(c)
            waiting = not claimed.more
            # Calls left waiting for the replica that caches them: back when they are anyone's.
            retry_s = claimed.retry_s or WAIT_S
            if claimed and waiting:
                await asyncio.sleep(0)  # the claimed requests reach their engine before the next wait goes out

    # --- serving --------------------------------------------------------------

    def _start(self, c: Claimed) -> None:
        """Serve a claimed request in a task of its own, tracked now, not when its task first runs:
        the next claim's caps count it. Its slot comes back when that task ends, by the task's done
        callback (`_release`), not a `finally` in it: a task cancelled before its first step (the
        gateway's cancel or the lease renewal arriving in the loop turn of the claim, as when a
        flood's callers all hang up at once) never runs its coroutine, so a `finally` there never
        ran, and the slot stayed taken for good: a replica that lost all its slots so claimed
        nothing more while its line waited."""
        if c.rid in self.active:
            # This replica stalled past its lease and got the request back: the
            # old attempt is void (its lease is gone), the new one starts clean.
            self._cancel(c.rid)
        self.owners[c.rid] = c.owner
        attempt, progress = self.preemptor.track(c), Progress()
        task = asyncio.create_task(self._serve(c, attempt, progress))
        self.active[c.rid] = task
        task.add_done_callback(lambda t: self._release(c, attempt, progress, t))

    async def _serve(self, c: Claimed, attempt: Attempt, progress: Progress) -> None:
        """Run one claimed request on the engine and end it with exactly one outcome (`_run`);
        its slot and tokens are settled when the task ends (`_start`)."""
        try:
            call = CallPayload.decode(c.payload)
        except BadPayload as e:
            log.error("request %s: %s", c.rid, e)
            progress.ended = False
            await self._finish(c, Outcome.FAILED, Failed(502, "engine_error", str(e), "bad_payload"))
            return
        progress.key = call.key
        req = EngineRequest(request_id=f"{c.rid}-{c.attempt}", kind=call.kind, body=call.body,
                            max_tokens=call.max_tokens, stream=call.stream, priority=attempt_rank(c.priority))
        await self._run(c, req, attempt, progress)

    async def _run(self, c: Claimed, req: EngineRequest, attempt: Attempt, progress: Progress) -> None:
        """Within the time left to its deadline, run the call on the engine (`run_engine`), then
        finish it completed with its usage, TTFT and TPOT, only while this attempt still holds the
        lease. Past the deadline: abort it in the engine, finish it expired (504). Lease lost
        (reaped while it ran) or cancelled: abort it in the engine, and leave the outcome to
        whoever took it over. An engine error: finish it failed (400 when the engine refused the
        request itself, else 502); a dead engine also drains the replica."""
        if req.stream:
            self.streams.open(c.lease, c.rid, c.owner, c.attempt, chat=req.kind == "chat", model=self.model_name or "")
        try:
            async with asyncio.timeout(max(0.0, c.remaining_ms / 1000)):
                await run_engine(self.engine, self.streams, c, req, attempt, progress)
            await self._complete(c, req, progress)
        except TimeoutError:
            progress.ended = False
            await self.engine.abort(req.request_id)
            await self._finish(c, Outcome.EXPIRED, Failed(504, "deadline_exceeded",
                                                    "deadline passed while the request was running"))
        except LeaseLost:
            # Reaped while it ran (the replica stalled): another attempt owns it now.
            log.warning("lease on %s attempt %d was lost; aborting it here", c.rid, c.attempt)
            await self.engine.abort(req.request_id)
        except asyncio.CancelledError:
            # Cancelled by the caller or the gateway (which already recorded
            # the outcome), or the lease was lost: stop the engine's work.
            await self.engine.abort(req.request_id)
            raise
        except EngineError as e:
            await self._engine_failed(c, e, progress)
        except Exception as e:  # an engine bug must not take the replica down with it
            progress.ended = False
            log.exception("request %s failed in the engine", c.rid)
            await self.engine.abort(req.request_id)
            await self._finish(c, Outcome.FAILED, Failed(502, "engine_error", f"{type(e).__name__}: {e}"))

    async def _complete(self, c: Claimed, req: EngineRequest, progress: Progress) -> None:
        # A streamed call's last text rides in its finish: one round trip ends it (StreamWriter.rest).
        last, model = await self.streams.rest(c.lease) if req.stream else (b"", "")
        done = progress.done(c, req, self.replica_id, self.model_name)
        if await self._finish(c, Outcome.COMPLETED, done, prompt_tokens=done.prompt_tokens,
                              completion_tokens=done.completion_tokens, last_chunk=last, last_model=model):
            progress.useful = progress.ended = True
            self.completed += 1
            metrics.TTFT.labels(self.tier).observe(done.ttft_s)
            if done.completion_tokens > 1:  # one token has no time per output token
                metrics.TPOT.labels(self.tier).observe(done.tpot_s)

    async def _engine_failed(self, c: Claimed, e: EngineError, progress: Progress) -> None:
        """The engine refusing the request itself (too long for the context, a part it cannot take)
        is the caller's fault: a 400 it must not retry. Anything else is the fleet's: 502."""
        status = 400 if e.type == "invalid_request_error" else 502
        progress.ended = None if status == 400 else False
        if e.code == "engine_dead" and self.failed is None:
            # Nothing more will run here: stop claiming and exit non-zero, so the
            # supervisor replaces the replica instead of it failing every request.
            log.error("the engine died (%s): draining replica %s", e, self.replica_id)
            self.failed = str(e)
            self.drain()
        await self._finish(c, Outcome.FAILED, Failed(status, e.type, str(e), e.code or e.type, e.param))

    def _release(self, c: Claimed, attempt: Attempt, progress: Progress, task: asyncio.Task[None]) -> None:
        """The attempt's task ended, however (`_start`): free the slot, and charge every token
        generated, useful or not (late, failed, cancelled), except a preempted attempt's: it runs
        again, and only the attempt that ends it counts. The version's outcome goes in the charge's
        round trip, with the other calls that end within the window (`workers.charging`)."""
        self.streams.discard(c.lease)
        # An engine that answers whole counts what it made meanwhile (the others say 0).
        progress.completion_tokens = max(progress.completion_tokens, self.engine.made(f"{c.rid}-{c.attempt}"))
        if self.active.get(c.rid) is task:  # not a newer attempt's
            self.active.pop(c.rid, None)
            self.owners.pop(c.rid, None)
        self._slot_freed.set()
        if self.preemptor.untrack(c.rid, attempt):
            return
        ended = progress.ended
        self.charges.add(TokenCharge(
            progress.key, c.priority, progress.prompt_tokens, progress.completion_tokens, progress.useful,
            None if ended is None else lambda pipe: queue_outcome(
                pipe, self.line.keys, self.version, bool(ended), progress.t_first - progress.t0)))

    async def _finish(self, c: Claimed, outcome: Outcome, event: Done | Failed, **kw: Any) -> str | None:
        """End an attempt, retried while Redis is away or frozen: the engine's work is kept, not
        thrown away, and the lease check (`owner`) keeps a late retry from ending a newer attempt.
        Given up once the caller's result could no longer be read (its TTL)."""
        give_up = time.monotonic() + max(c.remaining_ms / 1000, 0) + self.cfg.result_ttl_s
        delay = 0.1
        while True:
            try:
                return await self.line.finish(c.rid, outcome, event, owner=c.owner, **kw)
            except RedisError:
                if time.monotonic() > give_up:
                    raise
                log.warning("finishing %s as %s: Redis unavailable; retrying in %.1f s", c.rid, outcome, delay)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    def _cancel(self, rid: str) -> None:
        task = self.active.get(rid)
        if task:
            task.cancel()

    async def _cancel_listener(self) -> None:
        # Cancels arrive by pub/sub, which drops messages while disconnected; the
        # lease renewal in each heartbeat is the backstop (a cancelled request's
        # lease is gone), so a lost connection delays an abort by a beat at most.
        while True:
            pubsub = self.pubsub_redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.line.keys.cancel_channel)
                async for msg in pubsub.listen():
                    rid = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
                    self._cancel(rid)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cancel listener lost its connection; resubscribing")
                await asyncio.sleep(min(5.0, self.cfg.heartbeat_s * 2))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # --- heartbeat ------------------------------------------------------------

    async def _heartbeat_once(self) -> None:
        metrics.WORKER_ACTIVE.labels(self.tier, self.replica_id).set(len(self.active))
        metrics.WORKER_SLOTS.labels(self.tier, self.replica_id).set(self.concurrency)
        await write_heartbeat(self.redis, self.line.keys, Heartbeat(
            id=self.replica_id, state=self.state, slots=self.concurrency, in_use=len(self.active),
            completed=self.completed, cold_start_s=self.cold_start_s, ts=time.time(), started=self.started_at,
            pid=os.getpid(), engine=self.engine_name, version=self.version, cold_start_phases=self.cold_start_phases))
        # Replica-seconds by state into the spend ledger (idempotent: see fleet.ledger).
        await self.ledger.accrue(self.replica_id, self.state, self.started_at)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                held = [(rid, self.owners[rid]) for rid in list(self.active) if rid in self.owners]
                for rid in await self.line.renew(held, self.tc.lease_s):
                    self._cancel(rid)
                await self.line.reap()
                await self._heartbeat_once()
            except Exception:  # Redis blips must not kill the replica; the next beat retries
                log.exception("heartbeat failed")

