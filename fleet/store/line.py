"""The line: one Redis priority queue per tier, with leases, in a few atomic Lua scripts
(`fleet.store.line_scripts`). Writers: the gateway (enqueue, finish on cancel or
deadline) and the workers (claim, renew, emit, finish); both reap. Readers: the
observers (`observe`), which the gateway's status, its metrics and the scaler share.

Shape (all keys of a tier share its hash tag, see `fleet.store.keys`):

- `line` ZSET, score = class rank * CLASS_SPAN + arrival sequence (fifo) or the
  call's flow's start tag (fair: `fleet.store.flows`), so ZPOPMIN gives strict
  class order and, within a class, arrival order or least attained service. A
  requeued request keeps its score, so it goes back ahead of everything that
  arrived after it: the head of its class.
- `inflight` ZSET, score = lease expiry on the Redis clock. Workers renew
  leases while they run (streams last minutes; a fixed visibility timeout
  would re-run long jobs); a reaper requeues what expired.
- `req:<id>` HASH, the request and its state. `state` moves queued -> running
  -> done, and only `finish` sets done, once: that is what makes every
  accepted request end in exactly one outcome. Wherever it ends its payload goes
  at once: it keeps state, outcome, owner, attempt, class, chain and timing
  (~250 B) for `result_ttl_s`, what a late finish or a caller still reading needs,
  and `deadline_source` (header, client or default: where its deadline came from,
  `fleet.policy.client_clock`) when the gateway gave one.
- A full replica may preempt a running request of a lower class for one
  waiting above it (PREEMPT): the victim goes back with its own score and its
  lease ends; the waiter gets a `pmark` (when), so no other replica preempts
  for it, unless the mark is older than a lease (its replica died).
- `res:<id>` STREAM of events for the caller (`fleet.store.events`: chunks,
  then done or failed), with a TTL so unread results cannot pile up.

Deadlines are absolute on the Redis clock, set from the relative
X-Deadline-Ms at enqueue, so gateway and worker clocks need not agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from fleet.config import Priority
from fleet.store.callers import GRACE_MS, LEASE_MS, SWEEP, SWEEP_BATCH
from fleet.store.connection import MAX_BLOCK_S
from fleet.store.events import Done, Failed, encode
from fleet.store.flows import Place
from fleet.store.keys import TierKeys
from fleet.store.line_results import LineResults
from fleet.store.line_scripts import (
    CLAIM,
    CLASS_SPAN,
    EMIT,
    ENQUEUE,
    FINISH,
    MISSING,
    OBSERVE,
    OUTCOMES,
    PEEK,
    PREEMPT,
    REAP,
    RENEW,
)
from fleet.store.lua import named
from fleet.store.replication import Ack, Replicas, acked

__all__ = ["CLASS_SPAN", "OUTCOMES", "Claimed", "Claims", "Line", "LineSnapshot", "Reaped", "Waiter"]


@dataclass(slots=True)
class Claimed:
    rid: str
    payload: bytes  # as the gateway wrote it (`fleet.store.payloads.CallPayload` for a call)
    attempt: int
    remaining_ms: int  # time left to the deadline at claim, on the Redis clock
    waited_ms: int
    priority: str
    owner: str  # this attempt's lease on the request: "<replica>:<attempt>"
    preempted: int = 0  # times it was preempted before this attempt (see PREEMPT)
    lease: str = field(default="", init=False)  # names this attempt uniquely within a replica

    def __post_init__(self) -> None:
        self.lease = f"{self.rid}@{self.owner}"  # built once: the stream writer is keyed by it per token


@dataclass(slots=True)
class LineSnapshot:
    """What the line looks like now; the raw counts the policy reads."""

    now_ms: int
    by_class: tuple[int, int, int, int]
    oldest_wait_s: float
    inflight: int
    arrivals_in_window: int
    completions_in_window: int
    counters: dict[str, int]

    @property
    def waiting(self) -> int:
        return sum(self.by_class)

    def ahead_of(self, priority: Priority) -> int:
        """Requests a new arrival of this class would wait behind."""
        return sum(self.by_class[: priority + 1])


class Claims(list[Claimed]):
    """What one claim took; `more`: the line may hold more to claim now; `retry_s`: see `fleet.store.affinity`."""

    def __init__(self, claimed: Iterable[Claimed] = (), *, more: bool = False, retry_s: float = 0.0) -> None:
        super().__init__(claimed)
        self.more, self.retry_s = more, retry_s


class Waiter(NamedTuple):
    """The highest-class request waiting that no replica has preempted for yet."""

    rid: str
    rank: int
    waited_s: float


class Reaped(NamedTuple):
    """What one reaper pass did with the leases that ran out."""

    requeued: int  # back at the head of their class
    lost: int  # failed: tokens already streamed, or too many attempts
    expired: int  # their request hash was gone: counted expired, as CLAIM counts it


class Line(LineResults):
    """One tier's line. Safe to share across tasks; every mutation is one Lua call.

    `redis` runs the scripts; `blocking` (a client whose read timeout exceeds
    the block, see `fleet.store.connection`) waits on the bell. Without it the
    one client does both, as in tests.
    """

    def __init__(self, redis: Redis, namespace: str, tier: str, *, result_ttl_s: int = 300,
                 rate_window_s: float = 10.0, blocking: Redis | None = None) -> None:
        self.redis = redis
        self.blocking = blocking or redis
        self.tier = tier
        self.keys = TierKeys(namespace, tier)
        self.prefix = self.keys.prefix
        self.result_ttl_s = result_ttl_s
        self.window_ms = int(rate_window_s * 1000)
        self._enqueue = named(redis.register_script(ENQUEUE))
        self._claim = named(redis.register_script(CLAIM))
        self._renew = named(redis.register_script(RENEW))
        self._finish = named(redis.register_script(FINISH))
        self._reap = named(redis.register_script(REAP))
        self._observe = named(redis.register_script(OBSERVE))
        self._emit = named(redis.register_script(EMIT))
        self._peek = named(redis.register_script(PEEK))
        self._preempt = named(redis.register_script(PREEMPT))
        self._missing = named(redis.register_script(MISSING))
        self._sweep = named(redis.register_script(SWEEP))
        self.caller = ""  # in a gateway, its process (`gateway.redis_loss.caller_id`): calls are recorded under it
        self.replicas = Replicas(redis, self.keys.line)  # of the node holding this tier's keys

    async def enqueue(self, rid: str, priority: Priority, payload: bytes, deadline_ms: int,
                      chain: str = "", admitting: tuple[str, str] | None = None, *,
                      ack: Ack | None = None, affinity: str = "", place: Place | None = None,
                      wake: bytes | None = None, deadline_source: str = "") -> int:
        """Join the line; returns the absolute deadline on the Redis clock.

        `admitting` (key, member): the admission mark this request held, dropped in the same
        step, so no instant counts it twice or not at all. `ack`: where the node has replicas,
        return once that many have it or its timeout passed (`fleet.store.replication`).
        A gateway's line records the call under its `caller` (`fleet.store.callers`); `affinity`:
        its prefix key, which affine claims prefer on the replica that holds it (`fleet.store.affinity`).
        `place`: its flow in a fair tier (`fleet.store.flows`); None: by arrival within its class (fifo).
        `wake`: a result reader's wake stream (`reader_wake_key`) rung in the same step.
        `deadline_source`: where its deadline came from (header, client, default), kept in its record.
        """
        k, fair = self.keys, place or Place("", 0, 1.0)
        flow_clock, flow = fair.keys(k, int(priority))
        keys, args = self._enqueue.layout(
            line=k.line, seq=k.seq, bell=k.bell, counters=k.counters, arrivals=k.arrivals, req=k.request(rid),
            flow_clock=flow_clock, flow=flow, admitting=admitting[0] if admitting else k.admitting,
            callers=k.callers, reader_wake=wake, prefix=self.prefix, rid=rid, rank=int(priority), payload=payload,
            deadline_ms=deadline_ms, priority=priority.name, chain=chain, ttl_s=self.result_ttl_s,
            window_ms=self.window_ms, admitting_member=admitting[1] if admitting else "", gateway=self.caller,
            lease_ms=LEASE_MS, cost=place.cost if place else "", half_ms=fair.half_ms, affinity=affinity,
            deadline_source=deadline_source)
        if ack is None or ack.replicas <= 0 or not await self.replicas.known():
            deadline, _ = await self._enqueue.registered(keys=keys, args=args)
            return int(deadline)
        (deadline, _), _ = await acked(self.redis, self.replicas, ack, self._enqueue, keys, args)
        return int(deadline)

    async def claim(self, replica: str, n: int, lease_s: float, caps: tuple[int, ...] | None = None) -> Claims:
        """Take up to `n` requests from the head of the line under a lease of `lease_s`.

        Highest class first, first come first served within a class. Requests
        whose deadline passed in the line are ended as expired on the way and
        never returned (see CLAIM in `fleet.store.line_scripts`). `caps`: at
        most so many of each class and below (`fleet.policy.claim_caps`: slots
        reserved for higher classes). `more` on the result: False when the claim
        stopped at an empty line or a cap, so claiming again at once finds nothing.
        """
        if n <= 0:
            return Claims()
        return _claims(*await self._claim(**self._claim_named(replica, n, lease_s, caps)))

    def _claim_named(self, replica: str, n: int, lease_s: float, caps: tuple[int, ...] | None) -> dict[str, Any]:
        """The claim script's keys and arguments by name (an affine line adds its own)."""
        k = self.keys
        return {"line": k.line, "inflight": k.inflight, "counters": k.counters, "n": n, "replica": replica,
                "lease_ms": int(lease_s * 1000), "prefix": self.prefix, "ttl_s": self.result_ttl_s,
                "caps": ",".join(str(c) for c in caps) if caps is not None else ""}

    async def wait_and_claim(self, replica: str, n: int, lease_s: float, caps: tuple[int, ...] | None = None, *,
                             timeout_s: float, wake: str | None = None) -> Claims:
        """A wait on the bell, then `claim`, in ONE round trip: both go out together on the blocking
        client, and Redis runs the claim the moment the bell (or `wake`, see `ring`) wakes the
        wait, or its timeout passes, without waiting for the worker to hear of it and ask.

        The claim is the very script `claim` runs, judged when Redis runs it. `n` and `caps`
        are taken when the wait starts: a replica's free slots only grow while it waits. A
        client closed during the wait (a cancel) leaves the claim unrun (Redis drops what a
        closed client had queued), so cancel only to give up; to end the wait early, `ring`."""
        if n <= 0:
            return Claims()
        keys = [self.keys.bell, *([wake] if wake else [])]
        block = min(timeout_s, MAX_BLOCK_S)
        if isinstance(self.blocking, RedisCluster):  # a cluster pipeline is no ordered stream: two round trips
            await self.blocking.blpop(keys, timeout=block)
            return await self.claim(replica, n, lease_s, caps)
        async with self.blocking.pipeline(transaction=False) as p:
            p.blpop(keys, timeout=block)
            ck, ca = self._claim.layout(**self._claim_named(replica, n, lease_s, caps))
            p.evalsha(self._claim.sha, len(ck), *ck, *ca)
            _, got = await p.execute(raise_on_error=False)
        if isinstance(got, NoScriptError):  # Redis restarted (no scripts): the wait is over, claim as usual
            return await self.claim(replica, n, lease_s, caps)
        if isinstance(got, Exception):
            raise got
        return _claims(*got)

    async def ring(self, wake: str) -> None:
        """End a `wait_and_claim` of this tier that waits on `wake` (a replica's own key, see
        `TierKeys.wake`): it claims at once instead of at its timeout."""
        async with self.redis.pipeline(transaction=False) as p:
            p.lpush(wake, 1).pexpire(wake, int(MAX_BLOCK_S * 2000))
            await p.execute()

    async def peek_waiter(self, below_rank: int = 4, *, stale_s: float = 10.0, scan: int = 64) -> Waiter | None:
        """The highest-class request waiting, of a class above `below_rank`, that no replica has
        preempted for in the last `stale_s` (see PEEK), or None."""
        if below_rank <= 0:
            return None
        row = await self._peek(line=self.keys.line, prefix=self.prefix, scan=scan, below_rank=below_rank,
                               stale_ms=int(stale_s * 1000))
        return Waiter(_s(row[0]), int(row[1]), int(row[2]) / 1000) if row else None

    async def preempt(self, waiter: str, victim: str, victim_owner: str, *, max_preemptions: int,
                      stale_s: float = 10.0) -> bool:
        """Put `victim` back at the head of its class for `waiter`, once per waiting call (see PREEMPT).

        True: the victim's lease is gone and it waits in the line again; the
        caller must abort its attempt in the engine. False: nothing changed
        (a replica preempted for this waiter in the last `stale_s`, the victim
        ended or streamed, or it was preempted `max_preemptions` times already).
        """
        k = self.keys
        ok = await self._preempt(line=k.line, inflight=k.inflight, counters=k.counters, bell=k.bell,
                                 prefix=self.prefix, waiter=waiter, victim=victim, victim_owner=victim_owner,
                                 max_preemptions=max_preemptions, stale_ms=int(stale_s * 1000))
        return bool(int(ok))

    async def renew(self, held: list[tuple[str, str]], lease_s: float) -> list[str]:
        """Extend the leases of running requests, (rid, owner) each; returns the rids no longer held."""
        if not held:
            return []
        rows = [{"req": self.keys.request(rid), "rid": rid, "owner": owner} for rid, owner in held]
        lost = await self._renew(inflight=self.keys.inflight, lease_ms=int(lease_s * 1000), held=rows)
        return [_s(r) for r in lost]

    async def finish(self, rid: str, outcome: str, event: Done | Failed | None = None, *, owner: str = "",
                     prompt_tokens: int = 0, completion_tokens: int = 0, last_chunk: bytes = b"",
                     last_model: str = "") -> str | None:
        """End a request with one outcome. Only the first call for a request wins.

        Returns the state it ended it from ("queued": no engine saw it;
        "running": an engine had it), or None if it was already ended, or
        `owner` no longer holds it.

        `owner` set: only if that attempt still holds the lease (a worker whose
        lease was reaped must not complete a request someone else now runs).
        `owner` empty: the gateway ending it (cancel, deadline); a running
        request is then aborted in its engine through the cancel channel.

        `last_chunk` (with `last_model`, the engine's model name if no chunk gave it yet): a
        streamed call's last text, written as a chunk just before the end and only if this finish
        wins, so a worker ends a streamed call in one round trip instead of an EMIT and a FINISH.
        """
        k = self.keys
        field, value = encode(event) if event is not None else (b"", b"")
        ok = await self._finish(
            line=k.line, inflight=k.inflight, counters=k.counters, completions=k.completions, req=k.request(rid),
            res=k.result(rid), prefix=self.prefix, rid=rid, outcome=outcome, owner=owner, event=value,
            ttl_s=self.result_ttl_s, window_ms=self.window_ms, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, channel=k.cancel_channel, event_field=field, last_chunk=last_chunk,
            last_model=last_model)
        return _s(ok) or None

    async def outcome(self, rid: str) -> str | None:
        """The outcome a request ended with, None while it runs or once its hash is gone."""
        got = await self.redis.hget(self.keys.request(rid), "outcome")
        return _s(got) if got is not None else None

    async def missing(self, rids: list[str]) -> list[str]:
        """Those of `rids` whose request hash is gone (a failover or a flush took it), in one call."""
        gone = await self._missing(reqs=[{"req": self.keys.request(r)} for r in rids]) if rids else []
        return [rids[int(i)] for i in gone]

    async def relabel(self, rid: str, was: str, outcome: str) -> None:
        """Count an ended request under `outcome` instead of `was`: the gateway told its caller
        `outcome` (Redis was away) before it learnt the request had ended `was`. The line's counters
        count what each caller was told, as the gateway's metrics do."""
        k = self.keys
        async with self.redis.pipeline(transaction=True) as p:
            p.hincrby(k.counters, was, -1).hincrby(k.counters, outcome, 1).hset(k.request(rid), "outcome", outcome)
            await p.execute()

    async def reap(self, max_attempts: int = 3) -> Reaped:
        """Requeue requests whose lease expired (see REAP in `fleet.store.line_scripts`); in a
        gateway, also renew its caller lease and end the calls of gateways gone (SWEEP)."""
        k = self.keys
        requeued, lost, expired = await self._reap(inflight=k.inflight, line=k.line, counters=k.counters, bell=k.bell,
                                                   dead=k.dead, prefix=self.prefix, max_attempts=max_attempts,
                                                   ttl_s=self.result_ttl_s)
        if self.caller:
            await self._sweep(callers=k.callers, line=k.line, inflight=k.inflight, counters=k.counters,
                              prefix=self.prefix, me=self.caller, lease_ms=LEASE_MS, grace_ms=GRACE_MS,
                              batch=SWEEP_BATCH, ttl_s=self.result_ttl_s, channel=k.cancel_channel)
        return Reaped(int(requeued), int(lost), int(expired))

    async def observe(self) -> LineSnapshot:
        """The line now: waiting by class, oldest wait, in flight, arrivals and completions in the
        rate window, and the outcome counters; one round trip."""
        k = self.keys
        now, by_class, oldest, inflight, arrivals, completions, counters = await self._observe(
            line=k.line, inflight=k.inflight, counters=k.counters, arrivals=k.arrivals, completions=k.completions,
            window_ms=self.window_ms, prefix=self.prefix)
        flat = [_s(x) for x in counters]
        return LineSnapshot(
            now_ms=int(now), by_class=tuple(int(c) for c in by_class),  # type: ignore[arg-type]
            oldest_wait_s=int(oldest) / 1000, inflight=int(inflight), arrivals_in_window=int(arrivals),
            completions_in_window=int(completions),
            counters={flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)},
        )

    async def emit(self, chunks: list[tuple[str, str, bytes, bool, str]]) -> list[int]:
        """Append chunks to result streams in one round trip: (rid, owner, chunk body, first,
        the engine's model or "") each (`fleet.store.events`). Returns the positions of the
        entries whose owner no longer holds its lease (nothing was written for those).

        A request's first streamed token also marks it `streamed`, in the same
        step: from then on a lost worker means `worker_lost` for the caller,
        never a silent rerun that would send tokens twice.
        """
        if not chunks:
            return []
        k = self.keys
        rows = [{"req": k.request(rid), "res": k.result(rid), "rid": rid, "owner": owner,
                 "first": "1" if first else "0", "body": body, "model": model}
                for rid, owner, body, first, model in chunks]
        return [int(i) for i in await self._emit(inflight=k.inflight, ttl_s=self.result_ttl_s, chunks=rows)]


def _claims(more: Any, rows: list[Any], retry_ms: Any = 0) -> Claims:
    return Claims((Claimed(rid=_s(r[0]), payload=r[1], attempt=int(r[2]), remaining_ms=int(r[3]),
                           waited_ms=int(r[4]), priority=_s(r[5]), owner=_s(r[6]), preempted=int(r[7] or 0))
                   for r in rows), more=bool(int(more)), retry_s=int(retry_ms) / 1000)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
