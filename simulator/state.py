"""What the simulator holds for each tier: its line, its replicas, its meters and its bill.

Mechanism only; what to do with it is the policy's. `TierSim.observation`
puts it in the policy's one shape, `fleet.policy.TierObservation`, the way
the live readers put what Redis holds.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence as Counts
from dataclasses import dataclass, field

from fleet.config import CLASSES, FairLine, Priority, TierConfig
from fleet.policy import (
    BudgetSignal,
    BudgetView,
    ObservedReplica,
    Replicas,
    TierObservation,
    budget_signal,
    calibrated_capacity,
    observe_tier,
)
from fleet.policy.claim import HoldRules, ReplicaView
from fleet.policy.fairness import call_cost, fair_line
from fleet.policy.tier_capacity import claim_concurrency
from fleet.replica_model import ReplicaModel, Sequence, cold_start_s, step_s
from simulator.arrivals import Call, ChainArrival
from simulator.line import ClassLine, FlowShares

_PRIORITIES = tuple(Priority)

# Call states.
QUEUED, RUNNING, FINISHED = 0, 1, 2


class ChainRun:
    __slots__ = ("arrival", "deadline", "done_at", "engine_s", "outcome", "pending", "shed_reason")

    def __init__(self, arrival: ChainArrival) -> None:
        self.arrival = arrival
        self.deadline = arrival.t + arrival.deadline_s
        self.pending = 0
        self.outcome: str | None = None  # completed | timed_out | shed
        self.shed_reason = ""
        self.done_at = 0.0
        self.engine_s = 0.0  # slot-seconds its calls held on replicas (whatever became of them)


class SimReplica:
    """One replica: its lifecycle and its `ReplicaModel` (KV cache and decode batch)."""

    __slots__ = ("claimed", "id", "last_t", "model", "ranks", "ready_at", "running", "started", "state", "stopped",
                 "version")

    def __init__(self, rid: str, model: ReplicaModel, started: float, ready_at: float, ready: bool = False) -> None:
        self.id = rid
        self.model = model
        self.started = started
        self.ready_at = ready_at
        self.state = "ready" if ready else "starting"
        self.running = 0  # calls on it: prefilling or decoding
        self.last_t = started  # the instant its model was last advanced to
        self.version = 0  # bumped at every batch change: a scheduled finish from before is stale
        self.stopped: float | None = None
        self.claimed = started  # when it last ran a claim (`simulator.taking`: a holder is live)
        # The classes of the calls it runs, in the order they started, as the claim rule reads them;
        # None: changed since last made (`Serving.ranks_of`). Made once per change, not per take.
        self.ranks: tuple[int, ...] | None = ()


class Req:
    __slots__ = ("call", "chain", "deadline", "engine_s", "first_token", "heard", "idx", "kv", "lseq", "parked_until",
                 "pmarked", "preempted", "replica", "score", "sdk", "seq", "stage", "start", "state", "t_arr", "tier",
                 "wait_goal")

    def __init__(self, call: Call, tier: TierSim, t_arr: float, deadline: float,
                 chain: ChainRun | None = None, stage: int = 0, idx: int = 0,
                 wait_goal: float | None = None) -> None:
        self.call = call
        self.tier = tier
        self.t_arr = t_arr
        self.deadline = deadline
        self.chain = chain
        self.stage = stage
        self.idx = idx
        self.state = QUEUED
        self.start = 0.0
        self.first_token = 0.0  # when its first token came (it joined the batch, plus one step)
        self.kv = tier.model_kv_need(call)  # KV-cache room it reserves for its longest life
        self.replica: SimReplica | None = None
        self.seq: Sequence | None = None  # in the decode batch, once its prefill is done
        self.preempted = 0  # times it gave its slot to a higher class (fleet.policy.choose_victim)
        self.pmarked = False  # a call was preempted for it already: never twice for one waiting call
        self.score = 0.0  # its place in its class's line (`simulator.line.ClassLine`)
        self.lseq = 0  # its arrival sequence in the tier
        # Its objective (`simulator.objectives`): None, its deadline; else the longest it may wait in line.
        self.wait_goal = wait_goal
        self.engine_s = 0.0  # slot-seconds it held on replicas, every run of it (`Serving._off`)
        # Its caller's SDK (`simulator.clients`): the attempt that will receive its answer (None:
        # nobody now), whether its answer reaches anyone, and until when it is parked for a retry.
        self.sdk: object | None = None
        self.heard = True
        self.parked_until = 0.0


@dataclass(slots=True)
class Outcome:
    accepted: int = 0
    completed: int = 0
    expired_waiting: int = 0
    expired_running: int = 0
    preempted: int = 0  # times a call of this class gave its slot to a higher class and went back in line
    cancelled: int = 0  # its caller left and no retry took it over (`simulator.clients`)
    unheard: int = 0  # completed, its answer received by nobody (its caller left): not in `completed`
    shed: dict[str, int] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    useful_tokens: int = 0
    arrived: int = 0
    within_objective: int = 0  # completed within the call's objective (`simulator.objectives`)
    wait_objective: int = 0  # arrived whose objective is the class's wait limit (no deadline stated)
    # Refused here and served by a smaller tier instead (`simulator.degrade`): by reason, by target;
    # and those this tier served for a larger one (also in its `accepted`).
    degraded: dict[str, int] = field(default_factory=dict)
    degraded_to: dict[str, int] = field(default_factory=dict)
    degraded_in: int = 0


class TierSim:
    """One tier: its line, its replicas, its meters and its bill."""

    def __init__(self, name: str, tc: TierConfig, window_s: float, start_epoch: float,
                 fair: FairLine | None = None, shares: FlowShares | None = None) -> None:
        self.name = name
        self.tc = tc
        self.profile = tc.sim  # how its replicas behave
        self.cold_start = cold_start_s(tc.sim)
        self.slowest_step_s = step_s(tc.sim, tc.slots)  # a decode step of a full batch
        # The calls a replica claims at once: its slots, no more than its KV cache holds at the
        # typical shape, as the live worker claims (`fleet.policy.tier_capacity.claim_concurrency`).
        self.concurrency = claim_concurrency(tc, tc.sim.kv_capacity_tokens)
        self.start_epoch = start_epoch
        self.line = [ClassLine(shares) for _ in CLASSES]
        self.fair = fair  # None: fifo within a class; else the fair line's settings
        self.fair_output = calibrated_capacity(tc, None).output_estimate(None)  # what the gateway charges
        self.lseq = 0
        self.by_class = [0, 0, 0, 0]
        self.waiting = 0
        self.replicas: list[SimReplica] = []
        self.ready_list: list[SimReplica] = []  # the replicas that take work now
        self.n_starting = 0
        self.n_ready = 0
        self.n_draining = 0
        self.in_flight = 0
        # Calls running per class that may still be preempted: none below a waiter's class, and
        # preemption has nothing to look for (`simulator.serving.Serving._preempt_for`).
        self.preemptible = [0] * len(CLASSES)
        self.affine = tc.affinity.enabled  # a call goes where its prefix is cached (`fleet.store.affinity`)
        self.hold_s = [w / 1000 for w in tc.affinity.waits_ms(tc.wait_limit_s)]  # per class rank
        self.hold_rules: HoldRules | None = None  # ...as the claim rule takes them (`simulator.taking.hold_rules`)
        # prefix -> the replica that last took a call of it, and when (the live claim's `aff` records)
        self.holders: dict[object, tuple[SimReplica, float]] = {}
        # classes running on a replica -> the claim rule's view of it and its caps (`simulator.taking`)
        self.views: dict[tuple[int, ...], tuple[ReplicaView, tuple[int, ...] | None]] = {}
        self.hold_wake = math.inf  # when a dispatch is due for calls left for their holders (inf: none)
        # rank -> slots per replica kept for it and the classes above (`fleet.policy.claim_caps`)
        self.reserved = {int(Priority[c]): n for c, n in tc.preemption.reserved_slots.items()}
        self.wait_goal = [tc.wait_limit(p) for p in Priority]  # a call with no deadline stated: its objective
        self.prompt_tokens = 0  # of the calls begun, and of those the tokens their prefills computed
        self.prefill_tokens = 0
        self.outcomes = [Outcome() for _ in CLASSES]
        self.window_s = window_s
        # Enqueue and completion instants, as the line's sorted sets keep them; `*_head`
        # marks the first one still inside the rate window.
        self.enq_times: list[float] = []
        self.enq_head = 0
        self.done_times: list[float] = []
        self.done_head = 0
        self.offered = 0  # calls that arrived, admitted or shed
        self.offered_hist: deque[tuple[float, int]] = deque()
        self.replica_s = {"starting": 0.0, "ready": 0.0, "draining": 0.0}
        # Tiers with a per-token price also pay for every token processed.
        self.usd_per_token = (tc.usd_per_million_tokens or 0.0) / 1e6
        self.token_usd = 0.0
        self.token_marks: list[float] = []  # token spend at each tick
        self.last_acct = 0.0
        self.seq = 0
        self._budget_view: BudgetView | None = None  # the budget governor's judgement at the last tick
        self.budget_seen: BudgetSignal | None = None  # ...as the policy reads it
        self.windows_seen: dict[tuple[str, float], tuple[float, float]] = {}  # (name, start) -> (end, usd)
        self.window_starts: dict[str, float] = {}  # the budget windows in force at the last tick
        self.spend_marks: list[float] = []  # spend at each tick, for "spent since the window began"
        self.initial_usd_per_s = 0.0
        self.peak_replicas = 0
        self.engine_s = 0.0  # slot-seconds calls held on its replicas
        self.nobody_s = 0.0  # ...of calls whose answer nobody received (aborted, cancelled, or its caller gone)
        self.served: list[Call] = []  # the calls completed (on time: a late one is aborted), for the served bound
        self._replicas_seen: Replicas | None = None  # as the last lifecycle change left them

    def cost(self, call: Call) -> int | None:
        """What the call is charged in its flow, as the gateway charges it (None: fifo)."""
        if self.fair is None:
            return None
        return call_cost(call.prompt, self.fair_output, output_weight=self.fair.output_weight)

    def ahead_in_class(self, call: Call, t: float) -> int | None:
        """In a fair tier, the calls of its class the line would put before this one (admission)."""
        if self.fair is None:
            return None
        return self.line[call.cls].ahead(call.flow, int((self.start_epoch + t) * 1000), self.fair.half_life_s)

    def model_kv_need(self, call: Call) -> int:
        # A call generates exactly its output: that is the max_tokens its engine reserves for.
        return min(call.prompt + call.output, self.profile.kv_capacity_tokens)

    # --- meters ---

    def completions_since(self, t0: float) -> int:
        """Completions at or after `t0` (no earlier than the last trim)."""
        times = self.done_times
        return len(times) - bisect.bisect_left(times, t0, self.done_head)

    def arrivals_since(self, t0: float) -> int:
        times = self.enq_times
        return len(times) - bisect.bisect_left(times, t0, self.enq_head)

    def trim(self, t: float) -> None:
        """Forget instants older than the rate window (amortised: compact now and then)."""
        lo = t - self.window_s
        for name in ("enq", "done"):
            times: list[float] = getattr(self, f"{name}_times")
            head = bisect.bisect_left(times, lo, getattr(self, f"{name}_head"))
            if head > 4096 and head > len(times) // 2:
                del times[:head]
                head = 0
            setattr(self, f"{name}_head", head)

    def oldest_wait(self, t: float) -> float:
        oldest = math.inf
        for q in self.line:
            while q and q[0].state != QUEUED:
                q.popleft()
            if q and q[0].t_arr < oldest:
                oldest = q[0].t_arr
        return 0.0 if oldest == math.inf else t - oldest

    # --- the bill ---

    def token_usd_at(self, t: float, tick_s: float) -> float:
        if t <= 0 or not self.token_marks:
            return 0.0
        return self.token_marks[min(int(t / tick_s), len(self.token_marks) - 1)]

    def spend_at(self, t: float, tick_s: float) -> float:
        """Spend from the replay's start to `t`; before the start the fleet is
        assumed to have run at its initial replicas (the overnight floor)."""
        if t <= 0:
            return self.initial_usd_per_s * t
        i = int(t / tick_s)
        return self.spend_marks[min(i, len(self.spend_marks) - 1)] if self.spend_marks else 0.0

    def alive(self) -> int:
        return self.n_starting + self.n_ready + self.n_draining

    def account(self, t: float) -> None:
        dt = t - self.last_acct
        if dt > 0:
            self.replica_s["starting"] += self.n_starting * dt
            self.replica_s["ready"] += self.n_ready * dt
            self.replica_s["draining"] += self.n_draining * dt
            self.last_acct = t

    @property
    def replica_seconds(self) -> float:
        return sum(self.replica_s.values())

    @property
    def spend_usd(self) -> float:
        return self.replica_seconds * self.tc.hourly_usd / 3600 + self.token_usd

    # --- what the policy sees ---

    def lifecycle_changed(self) -> None:
        self._replicas_seen = None

    def _observed(self) -> Replicas:
        slots, t0 = self.concurrency, self.start_epoch  # what a live replica's heartbeat reports
        return Replicas.of(ObservedReplica(r.id, r.state, slots, r.running, t0 + r.started,
                                           self.cold_start if r.state != "starting" else None)
                           for r in self.replicas)

    def replicas_seen(self) -> Replicas:
        """The replicas as of their last change of state (for each arrival's admission: their
        requests in flight are the last lifecycle change's, as a gateway's are the last heartbeat's)."""
        if self._replicas_seen is None:
            self._replicas_seen = self._observed()
        return self._replicas_seen

    def observation(self, t: float, *, fresh: bool, call: Call | None = None) -> TierObservation:
        """The tier at `t` seconds into the replay. `fresh`: the replicas as they are now (a
        scaler tick), else as last seen (an admission). `call`: the call admission judges; in a
        fair tier it sees, of its own class, only what the fair order puts before it (as the gateway)."""
        w = self.window_s
        # Nothing waiting: the lines are empty (they hold exactly the `waiting` calls), no wait to look up.
        oldest = self.oldest_wait(t) if self.waiting else 0.0
        busy = min(oldest, w) if self.waiting else 0.0
        line: Counts[int] = self.by_class
        if call is not None and self.fair is not None:
            line = fair_line(line, _PRIORITIES[call.cls], self.ahead_in_class(call, t))
        return observe_tier(
            self.name, self.start_epoch + t, w, line=line, oldest_wait_s=oldest,
            in_flight=self.in_flight, arrivals_in_window=self.arrivals_since(t - w),
            completions_in_window=self.completions_since(t - w),
            busy_s=busy, completions_while_busy=self.completions_since(t - busy) if busy > 0 else 0,
            replicas=self._observed() if fresh else self.replicas_seen(), budget=self.budget_seen)

    @property
    def budget_view(self) -> BudgetView | None:
        """The budget governor's judgement at the last tick."""
        return self._budget_view

    @budget_view.setter
    def budget_view(self, view: BudgetView | None) -> None:
        # What the policy reads of it, made once a tick rather than at every arrival.
        self._budget_view, self.budget_seen = view, budget_signal(view)
