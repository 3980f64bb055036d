"""The discrete-event simulator: the fleet in simulated time.

What happens is what the live fleet does, in the same order:

- a call arrives; the policy's admission decision admits or sheds it (typed
  reason), on the same `TierObservation` a gateway builds for its calls;
- an admitted call joins its tier's line and is served as a worker and its sim
  engine serve it (`simulator.serving`, on `fleet.replica_model`);
- the scaler ticks every `tick_s` (1 s, as live): per tier, the budget
  governor judges the spend (`simulator.spend`), the policy observes the tier
  and decides, and the decision is executed: new replicas pay their cold
  start before serving; the ones chosen to leave drain;
- agent chains issue each stage's calls when their parent call completes,
  under one deadline for the whole chain.

Replicas are modelled step by step (decode re-timed as the batch changes), yet
events are only the changes of a batch, so two simulated hours of a busy fleet
replay in a minute or less.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from heapq import heappop

from fleet.config import CLASSES, Priority
from fleet.policy import TierObservation, arrival_rate, drain_s, rate
from simulator.arrivals import Arrival, Call, ChainArrival, Trace
from simulator.clients import Clients, summary
from simulator.degrade import Degrader
from simulator.events import ABORT, CLIENT, DECODED, EXPIRE, PREFILLED, READY, TICK, EventQueue
from simulator.gpus import SimGpus
from simulator.line import FlowShares
from simulator.policies import SimPolicy
from simulator.results import Sample, SimResult, TimelineEntry
from simulator.scenario import Scenario
from simulator.serving import Serving
from simulator.spend import budget_report, govern
from simulator.state import ChainRun, Req, TierSim

_PRIORITIES = tuple(Priority)


class Simulator:
    def __init__(self, scenario: Scenario, trace: Trace, policy: SimPolicy, fairness: str | None = None,
                 progress: Callable[[float], None] | None = None, seed: int | None = None) -> None:
        self.sc = scenario
        self.progress = progress  # told the simulated time at every tick (`simulator.progress`)
        self.cfg = scenario.cfg
        self.trace = trace
        self.policy = policy
        self.tick_s = scenario.spec.tick_s
        # `fairness`: every tier's order within a class, whatever the config says (`--compare`).
        self.fairness = fairness
        self.events = EventQueue()
        shares = FlowShares(self.events)
        self.tiers = {name: TierSim(name, tc, self.cfg.rate_window_s, scenario.start_epoch,
                                    self.cfg.fair_line if (fairness or tc.fairness) == "fair" else None, shares)
                      for name, tc in self.cfg.tiers.items()}
        self.chain_times: list[float] = []  # arrival to last call's end, of each chain completed
        self.serving = Serving(self.events, self, SimGpus(self.cfg.gpus), shares)
        # A call its tier refuses may be served by a smaller one (`simulator.degrade`), where the policy sheds.
        self.degrader = Degrader(self.tiers, lambda obs, tier, prio, prompt, dl:
                                 policy.admit(obs, tier.tc, prio, prompt, dl) if policy.sheds else None)
        # Callers with an SDK client (`simulator.clients`): timeouts, retries, and what the gateway does with them.
        self.clients = Clients(self, self.serving, policy, scenario.spec.seed if seed is None else seed,
                               self.cfg.default_deadline_ms, self.cfg.client_clock)
        self.runs: list[ChainRun] = []  # every chain started, for the work spent on those that failed
        self.decisions: list[TimelineEntry] = []
        self.samples: dict[str, list[Sample]] = {n: [] for n in self.tiers}
        self.chains: dict[str, dict[str, int]] = {}
        self.chains_by_class: dict[str, dict[str, int]] = {}
        self._last_reason: dict[str, str] = {}
        self._next_window = 0.0  # when the next fairness window closes (`simulator.line.FlowShares`)
        policy.prepare(scenario)

    @property
    def t(self) -> float:
        return self.events.t

    @t.setter
    def t(self, value: float) -> None:
        self.events.t = value

    def start_replica(self, tier: TierSim, ready: bool = False) -> None:
        self.serving.start_replica(tier, ready)

    # --- calls ----------------------------------------------------------------

    def arrive(self, call: Call, deadline_s: float, chain: ChainRun | None = None, stage: int = 0,
               idx: int = 0, stated: bool = True) -> None:
        """A call arrives: admitted or shed by the policy; `stated`: it carries a deadline (its
        objective), else its objective is its class's wait limit."""
        tier = self.tiers[call.tier]
        out = tier.outcomes[call.cls]
        out.arrived += 1
        if not stated:
            out.wait_objective += 1
        tier.offered += 1
        if self.policy.sheds:
            obs = tier.observation(self.t, fresh=False, call=call)  # a fair tier: what goes before it
            reason = self.policy.admit(obs, tier.tc, _PRIORITIES[call.cls], call.prompt, deadline_s)
            moved = None if reason is None else self.degrader.target(self.t, call, reason, deadline_s)
            if reason is not None and moved is None:
                out.shed[reason] = out.shed.get(reason, 0) + 1
                if chain is not None:
                    self.chain_end(chain, "shed", reason)
                return
            if moved is not None:  # served by a smaller tier: accepted, waiting and billed there
                call, tier = moved
                out = tier.outcomes[call.cls]
        out.accepted += 1
        self.serving.enqueue(tier, Req(call, tier, self.t, self.t + deadline_s, chain, stage, idx,
                                       None if stated else tier.wait_goal[call.cls]))

    # --- chains (CallEnds) ------------------------------------------------------

    def start_chain(self, ca: ChainArrival) -> None:
        ch = ChainRun(ca)
        self.runs.append(ch)
        for key, book in ((ca.name, self.chains), (CLASSES[ca.cls], self.chains_by_class)):
            c = book.setdefault(key, {"started": 0, "completed": 0, "timed_out": 0, "shed": 0})
            c["started"] += 1
        ch.pending = 1
        self.chain_call(ca.stages[0][0], ch, 0, 0)

    def chain_call(self, call: Call, ch: ChainRun, stage: int, idx: int) -> None:
        """A chain's call: through its agent's SDK (`simulator.clients`), or straight to admission."""
        if ch.arrival.client is not None:
            self.clients.start(call, ch.arrival.client, None, ch, stage, idx)
        else:
            self.arrive(call, ch.deadline - self.t, ch, stage, idx)

    def completed(self, req: Req) -> None:
        """A call completed: its caller's SDK hears of it, or (no client) its chain goes on."""
        if req.sdk is not None or not req.heard:
            self.clients.ended(req, completed=True)
        else:
            self.call_answered(req.chain, req.stage, req.idx)

    def call_answered(self, ch: ChainRun | None, stage: int, idx: int) -> None:
        """A chain's call was answered: its chain issues the next stage's calls, or completes."""
        if ch is None or ch.outcome is not None:
            return
        ch.pending -= 1
        nxt = stage + 1
        stages = ch.arrival.stages
        if nxt < len(stages):
            f = ch.arrival.fanouts[nxt]
            children = stages[nxt][idx * f:(idx + 1) * f]
            ch.pending += len(children)
            for i, call in enumerate(children):
                if ch.outcome is not None:
                    break
                self.chain_call(call, ch, nxt, idx * f + i)
        if ch.pending == 0 and ch.outcome is None:
            self.chain_end(ch, "completed")

    def timed_out(self, req: Req) -> None:
        """Its deadline passed (in the line, or running): nobody got its answer."""
        if req.sdk is not None or not req.heard:
            self.clients.ended(req, completed=False)
            return
        self.clients.nobody(req)
        if req.chain is not None:
            self.chain_end(req.chain, "timed_out")

    def chain_end(self, ch: ChainRun, outcome: str, reason: str = "") -> None:
        if ch.outcome is not None:
            return
        ch.outcome = outcome
        ch.shed_reason = reason
        ch.done_at = self.t
        if outcome == "completed":
            self.chain_times.append(self.t - ch.arrival.t)
        self.chains[ch.arrival.name][outcome] += 1
        self.chains_by_class[CLASSES[ch.arrival.cls]][outcome] += 1

    # --- the scaler's tick ------------------------------------------------------

    def observe(self, tier: TierSim) -> TierObservation:
        """What the live scaler reads for one tier at this instant (a `TierObservation`)."""
        return tier.observation(self.t, fresh=True)

    def tick(self) -> None:
        """The scaler's tick, per tier: account the bill, judge the budget, let the policy decide
        on an observation, execute, and record the timeline and a sample."""
        for tier in self.tiers.values():
            tier.account(self.t)
            tier.spend_marks.append(tier.spend_usd)
            tier.token_marks.append(tier.token_usd)
            tier.trim(self.t)
            govern(self.sc, tier, self.t, self.tick_s, tier.cold_start)
            obs = self.observe(tier)
            act = self.policy.scale(obs, tier.tc, gpu_room=self.serving.gpus.room(tier.tc))
            if act.delta > 0:
                for _ in range(act.delta):
                    self.serving.start_replica(tier)
            elif act.delta < 0:
                self.serving.drain_replicas(tier, -act.delta)
            # The timeline keeps every action, and each change of reason while holding.
            key = f"{act.action}:{act.reason_kind}"
            if act.delta != 0 or self._last_reason.get(tier.name) != key:
                self.decisions.append(TimelineEntry(self.t, tier.name, act.action, act.delta, act.reason,
                                                    act.floor, act.ceiling))
            self._last_reason[tier.name] = key
            tier.offered_hist.append((self.t, tier.offered))
            while tier.offered_hist[0][0] < self.t - tier.window_s:
                tier.offered_hist.popleft()
            offered = rate(tier.offered - tier.offered_hist[0][1], tier.window_s)  # admitted or not
            self.samples[tier.name].append(Sample(
                self.t, offered, arrival_rate(obs), tier.waiting, drain_s(obs),
                tier.n_starting, tier.n_ready, tier.n_draining, tier.spend_usd))
        if self.progress is not None:
            self.progress(self.t)
        shares = self.serving.shares
        if self.t + 1e-9 >= self._next_window:
            self._next_window = self.t + shares.window_s
            shares.close_window(self.t)
        # Past the end no call arrives, but the scaler keeps ticking while accepted calls
        # are still in line or running: they end on time or late, never "unfinished".
        if self.t + self.tick_s <= self.sc.duration_s or self.busy():
            self.events.push(self.t + self.tick_s, TICK, None)

    def busy(self) -> bool:
        """Whether any accepted call is still in a line or on a replica, or a caller's SDK call or
        a call parked for its retry is not over."""
        if self.clients.pending or self.clients.parked:
            return True
        return any(t.waiting or t.in_flight for t in self.tiers.values())

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
        """The event loop: the next event or the next arrival, whichever comes first."""
        wall0 = time.perf_counter()
        self._start_fleet()
        self.events.push(0.0, TICK, None)
        arrivals = self.trace.events()
        ai, n_arr = 0, len(arrivals)
        heap = self.events.heap
        serving = self.serving
        end = self.sc.duration_s
        events = 0
        # The next arrival's instant changes only when one is taken: not looked up at every event.
        next_arr = arrivals[0][0] if n_arr and arrivals[0][0] <= end else math.inf
        while True:
            if heap and heap[0][0] <= next_arr:
                if heap[0][0] > end and not self.busy():
                    break  # the replay has ended and every accepted call with it
                t, kind, _, obj = heappop(heap)
                self.events.t = t
                events += 1
                if kind == DECODED:
                    serving.on_decoded(*obj)
                elif kind == PREFILLED:
                    serving.on_prefilled(obj)
                elif kind == EXPIRE:
                    serving.on_expire(obj)
                elif kind == TICK:
                    self.tick()
                elif kind == ABORT:
                    serving.on_abort(obj)
                elif kind == READY:
                    serving.on_ready(*obj)
                elif kind == CLIENT:
                    obj[0](obj[1])
            elif next_arr < math.inf:
                t, _, x = arrivals[ai]
                ai += 1
                next_arr = arrivals[ai][0] if ai < n_arr and arrivals[ai][0] <= end else math.inf
                self.events.t = t
                events += 1
                self._arrival(x)
            else:
                break
        return self._result(end, time.perf_counter() - wall0, events)

    def _arrival(self, x: Arrival | ChainArrival) -> None:
        """A call or a chain from the trace, now; a call through its caller's SDK where it has one."""
        if isinstance(x, ChainArrival):
            self.start_chain(x)
        elif x.client is not None:
            self.clients.start(x.call, x.client, x.header_ms)
        else:
            self.arrive(x.call, x.deadline_s, stated=x.stated)

    def _start_fleet(self) -> None:
        """Each tier's replicas at the start, ready (the policy says how many)."""
        for tier in self.tiers.values():
            for _ in range(self.policy.initial_replicas(tier.tc)):
                self.serving.start_replica(tier, ready=True)
            tier.initial_usd_per_s = tier.alive() * tier.tc.hourly_usd / 3600

    def _result(self, end: float, wall_s: float, events: int) -> SimResult:
        # The bill runs until the last accepted call has ended (at least to the replay's end).
        self.events.t = last = max(end, self.events.t)
        for tier in self.tiers.values():
            tier.account(last)
        return SimResult(self.policy.name, self.sc, self.tiers, self.decisions, self.samples, self.chains,
                         self.chains_by_class, budget_report(self.sc, self.tiers, self.tick_s),
                         wall_s=wall_s, events=events, ended_s=last,
                         chain_times=self.chain_times, key_waits=self.serving.key_waits, jain=self.serving.shares.index,
                         fairness=self.fairness,
                         callers=summary(self.clients.stats, self.tiers, self.chains, self.runs))
