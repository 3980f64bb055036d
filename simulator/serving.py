"""Calls on replicas, in simulated time: what the workers and their sim engines do live.

- a ready replica with a free slot and room in its KV cache takes what the claim
  rule says (`fleet.policy.choose_take`, the live claim's rule: strict class order,
  the slots kept for higher classes, the affinity hold), least busy replica first;
- the call reserves its KV room, pays its prefill beside the batch, then joins
  the replica's decode batch, whose step is re-timed at every change of the
  batch (`fleet.replica_model.ReplicaModel`, the sim engine's own model);
- a call whose deadline passes while it runs is aborted at the deadline; one
  whose deadline passes in the line expires there and never reaches a replica;
- with `preemption.enabled`, a call that finds no free slot takes one from a running
  call of a lower class (`fleet.policy.choose_victim`, once per waiting call), which
  goes back to the head of its class; the sim knows no replica has a free slot for
  it, so `min_wait_ms` does not apply;
- replicas pay their cold start before serving; a replica chosen to leave
  (`fleet.policy.scale_in_victims`) drains: it takes nothing new and stops when
  its last call has ended, so nothing in flight is lost.

Between two changes of a replica's batch nothing needs an event: the next
finish is scheduled when the batch changes, and superseded by the next change.
"""

from __future__ import annotations

import math
from typing import Protocol

from fleet.policy import ObservedReplica, RunningRequest, WaitingRequest, choose_victim, scale_in_victims
from fleet.replica_model import ReplicaModel, prefill_s
from simulator.events import ABORT, CLIENT, DECODED, EXPIRE, PREFILLED, READY, EventQueue
from simulator.gpus import SimGpus
from simulator.line import FlowShares
from simulator.state import FINISHED, QUEUED, RUNNING, Req, SimReplica, TierSim
from simulator.taking import free_replicas, hold_rules, prefix_of, ranks_of, remember, take_for, victim_candidates


class CallEnds(Protocol):
    """Who hears how each call ended (the simulator: its chains)."""

    def completed(self, req: Req) -> None: ...

    def timed_out(self, req: Req) -> None: ...


class Serving:
    def __init__(self, events: EventQueue, ends: CallEnds, gpus: SimGpus | None = None,
                 shares: FlowShares | None = None) -> None:
        self.events = events
        self.ends = ends
        self.gpus = gpus or SimGpus(())  # where the replicas are booked (none: no GPU limit)
        # replica id -> the calls it runs (preemption's candidates), in the order they started: a
        # dict, not a set, so a tie among candidates goes the same way in every run (a set of
        # calls iterates in memory-address order, which changed the replay from run to run).
        self.calls_on: dict[str, dict[Req, None]] = {}
        self.shares = shares or FlowShares(events)  # Jain's index over backlogged flows (`fleet simulate --compare`)
        self.key_waits: dict[str, list[float]] = {}  # "key:<name>" flow -> waits in line of its completed calls

    # --- replicas ---------------------------------------------------------------

    def start_replica(self, tier: TierSim, ready: bool = False) -> SimReplica | None:
        """Start a replica (None when its GPUs fit nowhere: live, the supervisor starts none)."""
        t = self.events.t
        rid = f"{tier.name}-{tier.seq + 1}"
        if not self.gpus.place(rid, tier.tc):
            return None
        tier.account(t)
        tier.seq += 1
        r = SimReplica(rid, ReplicaModel(tier.profile), t, t + (0.0 if ready else tier.cold_start), ready)
        tier.replicas.append(r)
        if ready:
            tier.n_ready += 1
            tier.ready_list.append(r)
        else:
            tier.n_starting += 1
            self.events.push(r.ready_at, READY, (tier, r))
        tier.peak_replicas = max(tier.peak_replicas, tier.alive())
        tier.lifecycle_changed()
        return r

    def on_ready(self, tier: TierSim, r: SimReplica) -> None:
        if r.state != "starting":
            return
        tier.account(self.events.t)
        tier.n_starting -= 1
        tier.n_ready += 1
        r.state = "ready"
        r.last_t = self.events.t
        tier.ready_list.append(r)
        tier.lifecycle_changed()
        self.dispatch(tier)

    def drain_replicas(self, tier: TierSim, n: int) -> int:
        """Drain the `n` replicas the policy names (`fleet.policy.scale_in_victims`)."""
        tier.account(self.events.t)
        slots, t0 = tier.concurrency, tier.start_epoch
        seen = [ObservedReplica(r.id, r.state, slots, r.running, t0 + r.started, cached=len(r.model.prefixes))
                for r in tier.replicas]
        leaving = {v.id for v in scale_in_victims(seen, n)}
        removed = 0
        for r in [r for r in tier.replicas if r.id in leaving]:
            tier.n_ready -= 1
            tier.ready_list.remove(r)
            r.state = "draining"
            tier.n_draining += 1
            removed += 1
            if r.running == 0:
                self.stop_replica(tier, r)
        tier.lifecycle_changed()
        return removed

    def stop_replica(self, tier: TierSim, r: SimReplica) -> None:
        tier.account(self.events.t)
        tier.n_draining -= 1
        r.state = "stopped"
        r.stopped = self.events.t
        tier.replicas.remove(r)
        self.gpus.release(r.id)
        tier.lifecycle_changed()

    # --- calls ------------------------------------------------------------------

    def enqueue(self, tier: TierSim, req: Req) -> None:
        """An admitted call joins its tier's line (and is taken at once if a replica has room)."""
        tier.enq_times.append(self.events.t)
        tier.lseq += 1
        now_ms = int((tier.start_epoch + self.events.t) * 1000)
        tier.line[req.call.cls].place(req, tier.lseq, tier.cost(req.call), now_ms,
                                      tier.fair.half_life_s if tier.fair else 60.0)
        tier.by_class[req.call.cls] += 1
        tier.waiting += 1
        self.dispatch(tier)
        if req.state == QUEUED:
            self.events.push(req.deadline, EXPIRE, req)

    def dispatch(self, tier: TierSim) -> None:
        """The replicas with a free slot claim, least busy first, one slot at a time, each taking
        what the claim rule says (`fleet.policy.choose_take`, via `simulator.taking`): class
        order, the caps of the reserved slots, the affinity hold. When none takes anything, the
        head of the best class may preempt; calls left for their holders are looked at again
        when the first of them is due."""
        if not tier.waiting or not tier.n_ready:
            return
        slots, t, hold = tier.concurrency, self.events.t, hold_rules(tier)
        while tier.waiting:
            took, held, retry = False, False, 0.0
            for r in free_replicas(tier, slots):
                take, req = take_for(tier, r, ranks_of(r, self.calls_on), hold, t)
                if take.retry_ms > 0 and (retry == 0 or take.retry_ms < retry):
                    retry = take.retry_ms
                if req is None:
                    held = held or take.reason == "held"
                    continue
                if take.drop:  # its deadline passed in the line: it leaves, untaken
                    if req.state == QUEUED:
                        self.on_expire(req)
                    else:
                        self._unline(tier, req)
                elif not r.model.fits(req.kv):
                    continue  # no KV room here for it: the next replica looks
                else:
                    self._unline(tier, req)
                    remember(tier, req, r, t)
                    self.begin(tier, req, r)
                took = True
                break
            if took:
                continue
            if retry > 0:
                self._wake_at(tier, t + retry / 1000)
            cls = next(c for c, n in enumerate(tier.by_class) if n)
            if (not held and cls < len(tier.by_class) - 1 and tier.tc.preemption.enabled
                    and self._preempt_for(tier, tier.line[cls][0])):
                continue  # a slot is free for it now
            return  # a lower class never overtakes a higher one

    def _wake_at(self, tier: TierSim, at: float) -> None:
        """Dispatch again at `at`, when a call left for its holder is due (live: the claim's retry)."""
        at += 1e-6  # past the instant, so the call counts as due then
        if self.events.t < tier.hold_wake <= at:
            return  # one is due sooner already
        tier.hold_wake = at
        self.events.push(at, CLIENT, (self._woken, tier))

    def _woken(self, tier: TierSim) -> None:
        if tier.hold_wake <= self.events.t:
            tier.hold_wake = math.inf
        self.dispatch(tier)

    def begin(self, tier: TierSim, req: Req, r: SimReplica) -> None:
        t = self.events.t
        req.state = RUNNING
        req.start = t
        req.replica = r
        served = self.shares.served
        served[req.call.flow] = served.get(req.call.flow, 0.0) + req.call.prompt + 2 * req.call.output
        r.running += 1
        r.model.reserve(req.kv)
        tier.in_flight += 1
        self.calls_on.setdefault(r.id, {})[req] = None
        r.ranks = None
        if req.preempted < tier.tc.preemption.max_preemptions:
            tier.preemptible[req.call.cls] += 1
        # Its prefill computes what the replica has not cached of its prompt (`fleet.replica_model.PrefixCache`).
        key = prefix_of(req)
        computed = r.model.prefixes.uncached_tokens(key, req.call.prompt)
        r.model.prefixes.store(key, req.call.prompt + req.call.output)
        tier.prompt_tokens += req.call.prompt
        tier.prefill_tokens += computed
        prefill = prefill_s(tier.profile, computed)
        req.first_token = t + prefill  # until it joins the batch: tells this attempt's PREFILLED from a preempted one's
        self.events.push(t + prefill, PREFILLED, req)
        # The slowest it can be: a full batch for every step. A deadline beyond that is never hit.
        if req.deadline < t + prefill + req.call.output * tier.slowest_step_s + 1e-6:
            self.events.push(req.deadline, ABORT, req)

    def _advance(self, r: SimReplica) -> list[Req]:
        """Bring the replica's batch to now; the calls that finished on the way."""
        t = self.events.t
        done = r.model.advance(t - r.last_t)
        r.last_t = t
        return done  # type: ignore[return-value]

    def _reschedule(self, r: SimReplica) -> None:
        r.version += 1
        left = r.model.time_to_next_finish()
        if left is not None:
            self.events.push(self.events.t + left, DECODED, (r, r.version))

    def on_prefilled(self, req: Req) -> None:
        if req.state != RUNNING or req.seq is not None or self.events.t + 1e-9 < req.first_token:
            return  # aborted during its prefill, or the prefill of an attempt that was preempted
        r = req.replica
        assert r is not None
        for done in self._advance(r):
            self._completed(done)
        req.seq = r.model.join(req, req.call.output)
        req.first_token = self.events.t + r.model.step_s()
        self._reschedule(r)

    def on_decoded(self, r: SimReplica, version: int) -> None:
        if version != r.version:
            return  # the batch changed since: a later finish was scheduled
        for done in self._advance(r):
            self._completed(done)
        self._reschedule(r)

    def _completed(self, req: Req) -> None:
        tier = req.tier
        t = self.events.t
        out = tier.outcomes[req.call.cls]
        out.completed += 1
        tier.served.append(req.call)
        tier.done_times.append(t)
        wait = req.start - req.t_arr
        # Completed is on time (a call past its deadline is aborted); one with no deadline stated
        # is judged on its class's wait limit.
        if req.wait_goal is None or wait <= req.wait_goal + 1e-9:
            out.within_objective += 1
        out.waits.append(wait)
        if req.call.flow.startswith("key:"):
            self.key_waits.setdefault(req.call.flow, []).append(wait)
        out.ttfts.append(req.first_token - req.t_arr)
        if req.call.output > 1:
            # TPOT as vLLM's bench defines it: (latency - TTFT) / (output tokens - 1).
            out.tpots.append((t - req.first_token) / (req.call.output - 1))
        out.useful_tokens += req.call.output
        tier.token_usd += (req.call.prompt + req.call.output) * tier.usd_per_token
        self._release(tier, req)
        self.ends.completed(req)

    def on_abort(self, req: Req) -> None:
        """Its deadline passed while it ran: out of the batch, the tokens it made are paid for,
        its slot and KV room are freed, and its chain has timed out."""
        if req.state == RUNNING and self._stop(req):
            req.tier.outcomes[req.call.cls].expired_running += 1
            self.ends.timed_out(req)

    def cancel(self, req: Req) -> None:
        """Its caller left and no retry took it over (`simulator.clients`): out of the line, or
        aborted in its engine (the tokens it made paid for)."""
        if req.state == QUEUED:
            self._unline(req.tier, req)
            req.state = FINISHED
        elif req.state != RUNNING or not self._stop(req):
            return  # ended already, or completed this very instant
        req.tier.outcomes[req.call.cls].cancelled += 1

    def _stop(self, req: Req) -> bool:
        """A running call leaves its replica before its end; False when it completed at this instant."""
        tier = req.tier
        r = req.replica
        assert r is not None
        made = 0.0
        if req.seq is not None:
            for done in self._advance(r):
                self._completed(done)
            if req.state != RUNNING:
                return False  # its last token came at this very instant
            made = r.model.tokens_of(req.seq)
            r.model.leave(req)
            self._reschedule(r)
        tier.done_times.append(self.events.t)  # the slot is freed: for the meters it was served (badly)
        if tier.usd_per_token:  # the tokens processed before it stopped were paid for
            tier.token_usd += (req.call.prompt + made) * tier.usd_per_token
        self._release(tier, req)
        return True

    def on_expire(self, req: Req) -> None:
        if req.state != QUEUED:
            return
        self._unline(req.tier, req)
        req.state = FINISHED
        req.tier.outcomes[req.call.cls].expired_waiting += 1
        self.ends.timed_out(req)

    def _unline(self, tier: TierSim, req: Req) -> None:
        """A waiting call leaves the line: to a replica, or expired or cancelled (the caller ends it)."""
        tier.line[req.call.cls].remove(req)
        tier.by_class[req.call.cls] -= 1
        tier.waiting -= 1

    def _preempt_for(self, tier: TierSim, req: Req) -> bool:
        """No replica has room for `req`: preempt the call the policy names, on any ready replica,
        once for this waiting call. True when a slot was freed."""
        cls = req.call.cls
        if req.pmarked or not any(tier.preemptible[cls + 1:]):
            return False  # nothing of a lower class runs that may still be preempted: no victim
        pre = tier.tc.preemption
        most = pre.max_preemptions
        calls = victim_candidates(tier, self.calls_on, cls, most)
        if not calls:
            return False  # `choose_victim` would find none
        t = self.events.t
        running = [RunningRequest(k, c.call.cls, int(c.replica.model.tokens_of(c.seq)) if c.seq and c.replica else 0,
                                  False, c.preempted, c.start) for k, c in calls.items()]
        victim = choose_victim(running, WaitingRequest(cls, t - req.t_arr), free_for_waiter=0,
                               max_preemptions=most, min_wait_s=0.0)
        if victim is None:
            return False
        req.pmarked = True
        self._requeue(tier, calls[victim.rid])
        return True

    def _requeue(self, tier: TierSim, v: Req) -> None:
        """The victim leaves its replica (its tokens are not charged: it runs again) and goes back
        to the head of its class, in arrival order."""
        r = v.replica
        assert r is not None
        if v.seq is not None:
            for done in self._advance(r):  # the batch up to now, before it changes
                self._completed(done)
            if v.state != RUNNING:
                return  # it finished this very instant: its slot is free anyway
            r.model.leave(v)
            self._reschedule(r)
        tier.outcomes[v.call.cls].preempted += 1
        self._off(tier, v)
        v.seq = v.replica = None
        v.state = QUEUED
        v.preempted += 1
        tier.line[v.call.cls].put_back(v)  # with its own score: its place, as the line's PREEMPT
        tier.by_class[v.call.cls] += 1
        tier.waiting += 1
        self.events.push(v.deadline, EXPIRE, v)

    def _release(self, tier: TierSim, req: Req) -> None:
        r = req.replica
        assert r is not None
        self._off(tier, req)
        req.state = FINISHED
        req.seq = None  # the sequence names the call: no cycle left behind (the replay runs without the collector)
        if r.state == "draining" and r.running == 0:
            self.stop_replica(tier, r)
        else:
            self.dispatch(tier)

    def _off(self, tier: TierSim, req: Req) -> None:
        """The call leaves its replica's slot and KV room (finished, aborted or preempted)."""
        r = req.replica
        assert r is not None
        held = self.events.t - req.start
        req.engine_s += held
        tier.engine_s += held
        if req.chain is not None:
            req.chain.engine_s += held
        self.calls_on.get(r.id, {}).pop(req, None)
        r.ranks = None
        r.running -= 1
        r.model.free(req.kv)
        tier.in_flight -= 1
        if req.preempted < tier.tc.preemption.max_preemptions:
            tier.preemptible[req.call.cls] -= 1
