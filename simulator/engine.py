"""The discrete-event simulator: the fleet in simulated time.

One heap of events (replica ready, request done or aborted, request expired
in line, scaler tick); arrivals come from the pre-drawn trace in time order.
What happens is what the live fleet does, in the same order:

- a call arrives; the policy's admission decision admits or sheds it (typed reason);
- an admitted call joins its tier's line: strict class order, first come first
  served inside a class; it expires in line when its deadline passes and never
  reaches a replica;
- a ready replica with a free slot and room in its KV cache takes the head of
  the line; the call pays prefill, then decodes at the step time of the batch it
  joined (`fleet.latency`, the `sim` engine's model); a call whose deadline
  passes while it runs is aborted at the deadline;
- the scaler ticks every `tick_s` (1 s, as live): per tier it observes the line,
  the windowed rates, the replicas by state and the spend, lets the policy's
  budget governor and tier decision speak, and executes the decision: new
  replicas pay the cold start of their profile (weights / load speed +
  warm-up) before serving; a replica chosen to leave drains (takes nothing new)
  and stops when its last call is done.

The replica model is one approximation of the `sim` engine, made for speed: a
call's decode step time is fixed by the batch size at the moment it starts
(rather than re-timed at every step as the batch changes). That keeps one event
per call, so two simulated hours of a busy fleet replay in seconds.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleet.config import CLASSES, TierConfig
from fleet.latency import cold_start_s, decode_step_s, kv_tokens, per_replica_rate, prefill_s
from fleet.policy import rate, seconds_to_drain
from fleet.policy.tier_budget import BudgetObservation, BudgetView, budget_lead_s, judge
from simulator.arrivals import Arrival, Call, ChainArrival, Trace

if TYPE_CHECKING:
    from simulator.policies import SimPolicy
    from simulator.scenario import Scenario

# Event kinds, in the order they are handled at the same instant: capacity
# appears and frees up before the scaler looks.
READY, DONE, ABORT, EXPIRE, TICK = 0, 1, 2, 3, 4

# Call states.
QUEUED, RUNNING, FINISHED = 0, 1, 2


class Req:
    __slots__ = ("call", "chain", "deadline", "idx", "kv", "replica", "stage", "start", "state", "step", "t_arr",
                 "tier")

    def __init__(self, call: Call, tier: TierSim, t_arr: float, deadline: float,
                 chain: ChainRun | None = None, stage: int = 0, idx: int = 0) -> None:
        self.call = call
        self.tier = tier
        self.t_arr = t_arr
        self.deadline = deadline
        self.chain = chain
        self.stage = stage
        self.idx = idx
        self.state = QUEUED
        self.start = 0.0
        self.step = 0.0  # decode step time, fixed by the batch the call joined
        self.kv = kv_tokens(call.prompt, call.output)  # KV-cache room it takes at its longest
        self.replica: Replica | None = None


class ChainRun:
    __slots__ = ("arrival", "deadline", "done_at", "outcome", "pending", "shed_reason")

    def __init__(self, arrival: ChainArrival) -> None:
        self.arrival = arrival
        self.deadline = arrival.t + arrival.deadline_s
        self.pending = 0
        self.outcome: str | None = None  # completed | timed_out | shed
        self.shed_reason = ""
        self.done_at = 0.0


class Replica:
    __slots__ = ("id", "kv_used", "ready_at", "running", "started", "state", "stopped")

    def __init__(self, rid: str, started: float, ready_at: float, ready: bool = False) -> None:
        self.id = rid
        self.started = started
        self.ready_at = ready_at
        self.state = "ready" if ready else "starting"
        self.running = 0
        self.kv_used = 0
        self.stopped: float | None = None


@dataclass(slots=True)
class Observation:
    """What the live scaler reads from Redis for one tier at one instant."""

    tier: str
    t: float  # seconds into the replay
    now: float  # epoch seconds (the policy's `now`)
    by_class: tuple[int, int, int, int]
    waiting: int
    oldest_wait_s: float
    in_flight: int
    arrival_rate: float
    service_rate: float
    seconds_to_drain: float
    starting: int
    ready: int
    draining: int
    slots_in_use: int
    spend_usd: float  # since the replay began
    burn_usd_per_h: float  # what the replicas now alive cost per hour


@dataclass(slots=True)
class Outcome:
    accepted: int = 0
    completed: int = 0
    expired_waiting: int = 0
    expired_running: int = 0
    shed: dict[str, int] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    useful_tokens: int = 0
    arrived: int = 0


class TierSim:
    """One tier: its line, its replicas, its meters and its bill."""

    def __init__(self, name: str, tc: TierConfig, window_s: float) -> None:
        self.name = name
        self.tc = tc
        self.profile = tc.sim
        self.cold_start = cold_start_s(tc.sim)
        self.per_replica_rate = per_replica_rate(tc.sim, tc.slots)
        self.line: list[deque[Req]] = [deque() for _ in CLASSES]
        self.by_class = [0, 0, 0, 0]
        self.waiting = 0
        self.replicas: list[Replica] = []
        self.ready_list: list[Replica] = []  # the replicas that take work now
        self.n_starting = 0
        self.n_ready = 0
        self.n_draining = 0
        self.in_flight = 0
        self.outcomes = [Outcome() for _ in CLASSES]
        self.window_s = window_s
        # Enqueue and completion instants, as the line's sorted sets keep them; `*_head`
        # marks the first one still inside the rate window.
        self.enq_times: list[float] = []
        self.enq_head = 0
        self.done_times: list[float] = []
        self.done_head = 0
        self.arr_count = 0
        self.done_count = 0
        self.offered = 0  # calls that arrived, admitted or shed
        self.offered_hist: deque[tuple[float, int]] = deque()
        self.service_rate = 0.0
        self.arrival_rate = 0.0
        self.replica_s = {"starting": 0.0, "ready": 0.0, "draining": 0.0}
        # Tiers with a per-token price also pay for every token processed.
        self.usd_per_token = (tc.usd_per_million_tokens or 0.0) / 1e6
        self.token_usd = 0.0
        self.token_marks: list[float] = []  # token spend at each tick
        self.token_burn = 0.0
        self.last_acct = 0.0
        self.seq = 0
        self.budget_view: BudgetView | None = None  # the budget governor's judgement at the last tick
        self.windows_seen: dict[tuple[str, float], tuple[float, float]] = {}  # (name, start) -> (end, usd)
        self.window_starts: dict[str, float] = {}  # the budget windows in force at the last tick
        self.spend_marks: list[float] = []  # spend at each tick, for "spent since the window began"
        self.initial_usd_per_s = 0.0
        self.peak_replicas = 0

    def completions_since(self, t0: float) -> int:
        """Completions at or after `t0` (no earlier than the last trim)."""
        times = self.done_times
        return len(times) - bisect.bisect_left(times, t0, self.done_head)

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

    def oldest_wait(self, t: float) -> float:
        oldest = math.inf
        for q in self.line:
            while q and q[0].state != QUEUED:
                q.popleft()
            if q and q[0].t_arr < oldest:
                oldest = q[0].t_arr
        return 0.0 if oldest == math.inf else t - oldest


@dataclass
class Decision:
    """One tier decision as recorded in the timeline."""

    t: float
    tier: str
    action: str
    delta: int
    reason: str
    floor: int | None = None
    ceiling: int | None = None


@dataclass
class Sample:
    t: float
    offered: float  # calls arriving per second (admitted or not), over the rate window
    arrivals: float  # calls admitted per second, over the rate window
    waiting: int
    drain_s: float
    starting: int
    ready: int
    draining: int
    spend_usd: float


@dataclass
class SimResult:
    policy: str
    scenario: Scenario
    tiers: dict[str, TierSim]
    decisions: list[Decision]
    samples: dict[str, list[Sample]]
    chains: dict[str, dict[str, int]]
    chains_by_class: dict[str, dict[str, int]]
    budget: dict[str, dict[str, Any]]
    wall_s: float = 0.0
    events: int = 0
    seed: int = 0


class Simulator:
    def __init__(self, scenario: Scenario, trace: Trace, policy: SimPolicy) -> None:
        self.sc = scenario
        self.cfg = scenario.cfg
        self.trace = trace
        self.policy = policy
        self.tick_s = scenario.spec.tick_s
        self.tiers = {name: TierSim(name, tc, self.cfg.rate_window_s) for name, tc in self.cfg.tiers.items()}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.t = 0.0
        self.decisions: list[Decision] = []
        self.samples: dict[str, list[Sample]] = {n: [] for n in self.tiers}
        self.chains: dict[str, dict[str, int]] = {}
        self.chains_by_class: dict[str, dict[str, int]] = {}
        self._last_reason: dict[str, str] = {}
        self.events = 0

    # --- event plumbing -------------------------------------------------------

    def push(self, t: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, obj))

    # --- replicas -------------------------------------------------------------

    def start_replica(self, tier: TierSim, ready: bool = False) -> Replica:
        tier.account(self.t)
        tier.seq += 1
        r = Replica(f"{tier.name}-{tier.seq}", self.t, self.t + (0.0 if ready else tier.cold_start), ready)
        tier.replicas.append(r)
        if ready:
            tier.n_ready += 1
            tier.ready_list.append(r)
        else:
            tier.n_starting += 1
            self.push(r.ready_at, READY, (tier, r))
        tier.peak_replicas = max(tier.peak_replicas, tier.alive())
        return r

    def on_ready(self, tier: TierSim, r: Replica) -> None:
        if r.state != "starting":
            return
        tier.account(self.t)
        tier.n_starting -= 1
        tier.n_ready += 1
        r.state = "ready"
        tier.ready_list.append(r)
        self.dispatch(tier)

    def remove_replicas(self, tier: TierSim, n: int) -> int:
        """Drain `n` replicas: never one that is starting; those with the fewest calls in flight first.

        A draining replica takes nothing new and stops when its last call ends,
        so nothing in flight is lost.
        """
        tier.account(self.t)
        ready = sorted((r for r in tier.replicas if r.state == "ready"), key=lambda r: r.running)
        removed = 0
        for r in ready[:n]:
            tier.n_ready -= 1
            tier.ready_list.remove(r)
            r.state = "draining"
            tier.n_draining += 1
            removed += 1
            if r.running == 0:
                self.stop_replica(tier, r)
        return removed

    def stop_replica(self, tier: TierSim, r: Replica) -> None:
        tier.account(self.t)
        tier.n_draining -= 1
        r.state = "stopped"
        r.stopped = self.t
        tier.replicas.remove(r)

    # --- calls ----------------------------------------------------------------

    def arrive(self, call: Call, deadline_s: float, chain: ChainRun | None = None, stage: int = 0,
               idx: int = 0) -> None:
        tier = self.tiers[call.tier]
        out = tier.outcomes[call.cls]
        out.arrived += 1
        tier.offered += 1
        reason = self.policy.admit(self, tier, call, deadline_s)
        if reason is not None:
            out.shed[reason] = out.shed.get(reason, 0) + 1
            if chain is not None:
                self.chain_end(chain, "shed", reason)
            return
        out.accepted += 1
        tier.arr_count += 1
        tier.enq_times.append(self.t)
        req = Req(call, tier, self.t, self.t + deadline_s, chain, stage, idx)
        tier.line[call.cls].append(req)
        tier.by_class[call.cls] += 1
        tier.waiting += 1
        self.dispatch(tier)
        if req.state == QUEUED:
            self.push(req.deadline, EXPIRE, req)

    def dispatch(self, tier: TierSim) -> None:
        """Hand the head of the line to the least busy ready replica with a free slot and KV room."""
        if not tier.waiting or not tier.n_ready:
            return
        slots = tier.tc.slots
        kv_cap = tier.profile.kv_capacity_tokens
        by_class = tier.by_class
        ready = tier.ready_list
        for cls in range(len(by_class)):
            q = tier.line[cls]
            while by_class[cls]:
                req = q[0]
                if req.state != QUEUED:
                    q.popleft()
                    continue
                need = req.kv
                best: Replica | None = None
                least = slots
                for r in ready:
                    if r.running < least and r.kv_used + need <= kv_cap:
                        best = r
                        least = r.running
                if best is None:
                    return  # a lower class never overtakes a higher one
                q.popleft()
                by_class[cls] -= 1
                tier.waiting -= 1
                self.begin(tier, req, best, need)

    def begin(self, tier: TierSim, req: Req, r: Replica, kv: int) -> None:
        req.state = RUNNING
        req.start = self.t
        req.replica = r
        r.running += 1
        r.kv_used += kv
        tier.in_flight += 1
        req.step = decode_step_s(tier.profile, r.running)
        end = self.t + prefill_s(tier.profile, req.call.prompt) + req.call.output * req.step
        if end <= req.deadline:
            self.push(end, DONE, req)
        else:
            self.push(req.deadline, ABORT, req)

    def release(self, tier: TierSim, req: Req) -> None:
        r = req.replica
        assert r is not None
        r.running -= 1
        r.kv_used -= req.kv
        tier.in_flight -= 1
        req.state = FINISHED
        if r.state == "draining" and r.running == 0:
            self.stop_replica(tier, r)
        else:
            self.dispatch(tier)

    def on_done(self, req: Req) -> None:
        tier = req.tier
        out = tier.outcomes[req.call.cls]
        out.completed += 1
        tier.done_count += 1
        tier.done_times.append(self.t)
        wait = req.start - req.t_arr
        step = req.step
        out.waits.append(wait)
        out.ttfts.append(wait + prefill_s(tier.profile, req.call.prompt) + step)
        if req.call.output > 1:
            # TPOT as vLLM's bench defines it: (latency - TTFT) / (output tokens - 1).
            out.tpots.append(step)
        out.useful_tokens += req.call.output
        tier.token_usd += (req.call.prompt + req.call.output) * tier.usd_per_token
        self.release(tier, req)
        if req.chain is not None:
            self.chain_step(req)

    def on_abort(self, req: Req) -> None:
        tier = req.tier
        tier.outcomes[req.call.cls].expired_running += 1
        tier.done_count += 1  # the slot is freed: for the meters it was served (badly)
        tier.done_times.append(self.t)
        if tier.usd_per_token:  # the tokens processed before the abort were paid for
            made = max(0.0, (self.t - req.start - prefill_s(tier.profile, req.call.prompt)) / max(req.step, 1e-9))
            tier.token_usd += (req.call.prompt + min(made, req.call.output)) * tier.usd_per_token
        self.release(tier, req)
        if req.chain is not None:
            self.chain_end(req.chain, "timed_out")

    def on_expire(self, req: Req) -> None:
        if req.state != QUEUED:
            return
        tier = req.tier
        req.state = FINISHED
        tier.by_class[req.call.cls] -= 1
        tier.waiting -= 1
        tier.outcomes[req.call.cls].expired_waiting += 1
        if req.chain is not None:
            self.chain_end(req.chain, "timed_out")

    # --- chains ---------------------------------------------------------------

    def start_chain(self, ca: ChainArrival) -> None:
        ch = ChainRun(ca)
        for key, book in ((ca.name, self.chains), (CLASSES[ca.cls], self.chains_by_class)):
            c = book.setdefault(key, {"started": 0, "completed": 0, "timed_out": 0, "shed": 0})
            c["started"] += 1
        ch.pending = 1
        self.arrive(ca.stages[0][0], ch.deadline - self.t, ch, 0, 0)

    def chain_step(self, req: Req) -> None:
        ch = req.chain
        assert ch is not None
        if ch.outcome is not None:
            return
        ch.pending -= 1
        nxt = req.stage + 1
        stages = ch.arrival.stages
        if nxt < len(stages):
            f = ch.arrival.fanouts[nxt]
            children = stages[nxt][req.idx * f:(req.idx + 1) * f]
            ch.pending += len(children)
            for i, call in enumerate(children):
                if ch.outcome is not None:
                    break
                self.arrive(call, ch.deadline - self.t, ch, nxt, req.idx * f + i)
        if ch.pending == 0 and ch.outcome is None:
            self.chain_end(ch, "completed")

    def chain_end(self, ch: ChainRun, outcome: str, reason: str = "") -> None:
        if ch.outcome is not None:
            return
        ch.outcome = outcome
        ch.shed_reason = reason
        ch.done_at = self.t
        self.chains[ch.arrival.name][outcome] += 1
        self.chains_by_class[CLASSES[ch.arrival.cls]][outcome] += 1

    # --- the scaler's tick ------------------------------------------------------

    def observe(self, tier: TierSim) -> Observation:
        t = self.t
        return Observation(
            tier=tier.name, t=t, now=self.sc.epoch(t), by_class=tuple(tier.by_class),  # type: ignore[arg-type]
            waiting=tier.waiting, oldest_wait_s=tier.oldest_wait(t), in_flight=tier.in_flight,
            arrival_rate=tier.arrival_rate, service_rate=tier.service_rate,
            seconds_to_drain=seconds_to_drain(tier.waiting, tier.service_rate),
            starting=tier.n_starting, ready=tier.n_ready, draining=tier.n_draining,
            slots_in_use=tier.in_flight, spend_usd=tier.spend_usd,
            burn_usd_per_h=tier.alive() * tier.tc.hourly_usd + tier.token_burn * 3600,
        )

    def _meters(self, tier: TierSim) -> None:
        """Windowed arrival and service rates, as the live meters compute them."""
        tier.trim(self.t)
        w = tier.window_s
        # As the live meters: events in the window over the window (`fleet.policy.rate`).
        tier.arrival_rate = rate(len(tier.enq_times) - tier.enq_head, w)
        tier.service_rate = rate(len(tier.done_times) - tier.done_head, w)

    def governor(self, tier: TierSim) -> None:
        """The budget governor, every tick, for every policy (baselines ignore what it says,
        but their spend is judged against the same windows), as `fleet.governor.assess` does."""
        now = self.sc.epoch(self.t)
        burn = 0.0
        if tier.usd_per_token:
            # As the ledger's token burn: per-token spend over the last full minute and this one.
            start = (now // 60 - 1) * 60
            burn = (tier.token_usd - tier.token_usd_at(start - self.sc.start_epoch, self.tick_s)) / max(
                1.0, now - start)
        tier.token_burn = burn

        def judged(starts: dict[str, float]) -> BudgetView:
            spent = {name: tier.spend_usd - tier.spend_at(s0 - self.sc.start_epoch, self.tick_s)
                     for name, s0 in starts.items()}
            return judge(tier.tc, BudgetObservation(now=now, replicas=tier.alive(), spent_usd=spent,
                                                    token_burn_usd_per_s=burn),
                         lead_s=budget_lead_s(tier.tc, tier.cold_start))

        # The windows in force rarely change between ticks: judge with last tick's, and
        # again only when the judgement shows a window has opened or closed.
        view = judged(tier.window_starts)
        starts = {w.name: w.start for w in view.windows}
        if starts != tier.window_starts:
            tier.window_starts = starts
            view = judged(starts)
        for w in view.windows:
            tier.windows_seen[(w.name, w.start)] = (w.end, w.budget_usd)
        tier.budget_view = view

    def tick(self) -> None:
        for tier in self.tiers.values():
            tier.account(self.t)
            tier.spend_marks.append(tier.spend_usd)
            tier.token_marks.append(tier.token_usd)
            self._meters(tier)
            self.governor(tier)
            obs = self.observe(tier)
            act = self.policy.scale(self, tier, obs)
            if act.delta > 0:
                for _ in range(act.delta):
                    self.start_replica(tier)
            elif act.delta < 0:
                self.remove_replicas(tier, -act.delta)
            # The timeline keeps every action, and each change of reason while holding.
            key = f"{act.action}:{act.reason_kind}"
            if act.delta != 0 or self._last_reason.get(tier.name) != key:
                self.decisions.append(Decision(self.t, tier.name, act.action, act.delta, act.reason,
                                               act.floor, act.ceiling))
            self._last_reason[tier.name] = key
            tier.offered_hist.append((self.t, tier.offered))
            while tier.offered_hist[0][0] < self.t - tier.window_s:
                tier.offered_hist.popleft()
            offered = (tier.offered - tier.offered_hist[0][1]) / tier.window_s
            self.samples[tier.name].append(Sample(
                self.t, offered, tier.arrival_rate, tier.waiting, obs.seconds_to_drain,
                tier.n_starting, tier.n_ready, tier.n_draining, tier.spend_usd))
        if self.t + self.tick_s <= self.sc.duration_s:
            self.push(self.t + self.tick_s, TICK, None)

    # --- the run ----------------------------------------------------------------

    def run(self) -> SimResult:
        import gc

        # Hundreds of thousands of small objects and no reference cycles among them: the
        # cyclic collector would only rescan them over and over.
        was = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if was:
                gc.enable()

    def _run(self) -> SimResult:
        import time as _time

        wall0 = _time.perf_counter()
        for tier in self.tiers.values():
            for _ in range(self.policy.initial_replicas(self, tier)):
                self.start_replica(tier, ready=True)
            tier.initial_usd_per_s = tier.alive() * tier.tc.hourly_usd / 3600
        self.push(0.0, TICK, None)
        arrivals = self.trace.events()
        ai = 0
        n_arr = len(arrivals)
        heap = self.heap
        end = self.sc.duration_s
        events = 0
        while True:
            next_arr = arrivals[ai][0] if ai < n_arr else math.inf
            if heap and heap[0][0] <= next_arr:
                t, kind, _, obj = heapq.heappop(heap)
                if t > end:
                    break
                self.t = t
                events += 1
                if kind == DONE:
                    self.on_done(obj)
                elif kind == EXPIRE:
                    self.on_expire(obj)
                elif kind == TICK:
                    self.tick()
                elif kind == ABORT:
                    self.on_abort(obj)
                else:
                    self.on_ready(*obj)
            elif next_arr <= end:
                t, _, x = arrivals[ai]
                ai += 1
                self.t = t
                events += 1
                if isinstance(x, Arrival):
                    self.arrive(x.call, x.deadline_s)
                else:
                    self.start_chain(x)
            else:
                break
        self.t = end
        for tier in self.tiers.values():
            tier.account(end)
        return SimResult(self.policy.name, self.sc, self.tiers, self.decisions, self.samples, self.chains,
                         self.chains_by_class, self.budget_report(),
                         wall_s=_time.perf_counter() - wall0, events=events)

    def budget_report(self) -> dict[str, dict[str, Any]]:
        """Per tier, each budget window the replay touched: its budget and what was spent in it."""
        out: dict[str, dict[str, Any]] = {}
        end = self.sc.duration_s
        for tier in self.tiers.values():
            rows: dict[str, Any] = {}
            for (name, start), (w_end, usd) in sorted(tier.windows_seen.items(), key=lambda kv: kv[0][1]):
                s0 = start - self.sc.start_epoch
                s1 = min(w_end - self.sc.start_epoch, end)
                spent = (tier.spend_usd if s1 >= end else tier.spend_at(s1, self.tick_s)) - tier.spend_at(
                    s0, self.tick_s)
                key = name if name not in rows else f"{name}@{self.sc.clock(s0)}"
                rows[key] = {"budget_usd": usd, "spent_usd": spent, "start": self.sc.clock(max(s0, 0.0)),
                             "from_before_replay": s0 < 0, "ended": s1 < end, "within": spent <= usd + 1e-9}
            out[tier.name] = rows
        return out
