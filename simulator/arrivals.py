"""The trace: every arrival of a scenario, drawn once for a seed.

Every policy replays the very same trace (same arrivals, same prompt and output
lengths), so a comparison measures the policy and not the dice; the
clairvoyant bound reads the same trace. Each arrival process has its own
random stream seeded from (seed, process index), so adding a process does not
reshuffle the others.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from fleet.config import Priority
from simulator.client_spec import ClientSpec
from simulator.scenario import Length, Scenario, _Process, rate_at
from simulator.tracefile import TraceArrival


@dataclass(slots=True)
class Call:
    """One call to a tier: the unit the line, admission and replicas see."""

    tier: str
    cls: int  # Priority value: 0 committed .. 3 background
    prompt: int
    output: int
    flow: str = ""  # its flow in a fair line: "key:<key>" of its arrival process, or its chain's


@dataclass(slots=True)
class ChainArrival:
    """An agent chain: stage k's calls are issued when their parent call completes."""

    t: float
    name: str
    cls: int
    deadline_s: float
    stages: list[list[Call]]  # stages[k] holds every call of level k, parents' children contiguous
    fanouts: list[int]
    conversation: bool = False  # every call re-sends one conversation: they share one prefix (the chain)
    client: ClientSpec | None = None  # its agent's SDK (`simulator.clients`); None: it waits, never retries


@dataclass(slots=True)
class Arrival:
    t: float
    call: Call
    deadline_s: float
    # The scenario states its deadline (its own, or its class's); else it is the fleet's default,
    # and its objective is its class's wait limit (`simulator.objectives`).
    stated: bool = True
    client: ClientSpec | None = None  # its caller's SDK (`simulator.clients`); None: it waits, never retries
    header_ms: float | None = None  # with a client: the X-Deadline-Ms it sends (its stream's own deadline_ms)


@dataclass
class Trace:
    arrivals: list[Arrival]
    chains: list[ChainArrival]

    def events(self) -> list[tuple[float, int, Arrival | ChainArrival]]:
        """Everything that arrives, in time order (ties broken by a stable sequence)."""
        out: list[tuple[float, int, Arrival | ChainArrival]] = [(a.t, 0, a) for a in self.arrivals]
        out += [(c.t, 0, c) for c in self.chains]
        out.sort(key=lambda e: e[0])
        return [(t, i, x) for i, (t, _, x) in enumerate(out)]


def sampler(d: Length) -> Callable[[random.Random], int]:
    """A function drawing one length from the distribution (parameters worked out once)."""
    lo, hi = d.min, d.max
    if d.dist == "fixed":
        v = int(min(hi, max(lo, round(d.mean))))
        return lambda rng: v
    if d.dist == "uniform":
        half = d.sd if d.sd else d.mean / 2
        a, b = d.mean - half, d.mean + half
        return lambda rng: int(min(hi, max(lo, round(rng.uniform(a, b)))))
    if d.dist == "normal":
        mean, sd = d.mean, d.sd
        return lambda rng: int(min(hi, max(lo, round(rng.gauss(mean, sd)))))
    # lognormal with the given mean and sd of the length itself
    sd = d.sd or d.mean / 4
    s2 = math.log(1 + (sd / d.mean) ** 2)
    mu, sigma = math.log(d.mean) - s2 / 2, math.sqrt(s2)
    return lambda rng: int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def sample_length(rng: random.Random, d: Length) -> int:
    return sampler(d)(rng)


def arrival_times(pts: list[tuple[float, float]], end: float, process: str, rng: random.Random) -> list[float]:
    """Arrival instants in [0, end) of a process whose rate is linear between points.

    Poisson: thinning inside each linear segment against the segment's larger
    end (exact for a non-homogeneous Poisson process). Deterministic: an
    arrival each time the integrated rate crosses a whole number.
    """
    knots = [(t, r) for t, r in pts if t < end]
    if not knots or knots[0][0] > 0:
        knots.insert(0, (0.0, rate_at(pts, 0.0)))
    knots.append((end, rate_at(pts, end)))
    out: list[float] = []
    acc = 0.0  # deterministic: arrivals still owed, carried across segments
    for (t0, r0), (t1, r1) in itertools.pairwise(knots):
        if t1 <= t0 or t1 <= 0:
            continue
        t0 = max(t0, 0.0)
        r0 = rate_at(pts, t0)
        if process == "poisson":
            lam = max(r0, r1)
            if lam <= 0:
                continue
            t = t0
            flat = r0 == r1
            slope = (r1 - r0) / (t1 - t0)
            while True:
                t += rng.expovariate(lam)
                if t >= t1:
                    break
                if flat or rng.random() * lam <= r0 + slope * (t - t0):
                    out.append(t)
        else:
            k = (r1 - r0) / (t1 - t0)
            seg_total = (r0 + r1) / 2 * (t1 - t0)
            need = 1.0 - acc
            done = 0.0
            while done + need <= seg_total + 1e-12:
                target = done + need
                tau = target / r0 if abs(k) < 1e-12 else (-r0 + math.sqrt(max(0.0, r0 * r0 + 2 * k * target))) / k
                out.append(t0 + tau)
                done = target
                need = 1.0
            acc = (acc + seg_total) % 1.0 if seg_total > 0 else acc
    return out


def _times(sc: Scenario, p: _Process, rng: random.Random) -> list[float]:
    return arrival_times(sc.rate_points(p), sc.duration_s, p.process, rng)


def build_trace(sc: Scenario, seed: int | None = None) -> Trace:
    import gc

    was = gc.isenabled()
    gc.disable()  # many small objects, no cycles: see Simulator.run
    try:
        return _build_trace(sc, sc.spec.seed if seed is None else seed)
    finally:
        if was:
            gc.enable()


def _states_deadline(sc: Scenario, cls: str, given: float | None) -> bool:
    """Whether a call of `cls` carries a deadline of its own (or its class's in the scenario's
    `deadlines_ms`), rather than the fleet's `default_deadline_ms`."""
    return given is not None or cls in sc.spec.deadlines_ms


def _traced(sc: Scenario, a: TraceArrival, tier: str, rng: random.Random) -> list[Arrival]:
    """A trace arrival's calls, each in its class (drawn by the fractions when split)."""
    shares = [(int(Priority[name]), cum, sc.deadline_ms(name, a.deadline_ms) / 1000,
               _states_deadline(sc, name, a.deadline_ms)) for name, cum in a.fractions()]
    out = []
    client = sc.spec.client
    for t, prompt, output in sc.trace_calls(a, rng):
        if len(shares) == 1:
            cls, _, dl, stated = shares[0]
        else:
            u = rng.random()
            cls, _, dl, stated = next((x for x in shares if u < x[1]), shares[-1])
        out.append(Arrival(t, Call(tier, cls, prompt, output, "anonymous"), dl, stated,  # a trace names no caller
                           client, a.deadline_ms))
    return out


def _build_trace(sc: Scenario, seed: int) -> Trace:
    """Draw every arrival and every chain, each process from its own seeded random stream."""
    arrivals: list[Arrival] = []
    for i, a in enumerate(sc.spec.arrivals):
        rng = random.Random(f"{seed}/arrivals/{i}")
        tier = sc.cfg.resolve_model(a.tier) or a.tier
        if isinstance(a, TraceArrival):
            arrivals += _traced(sc, a, tier, rng)
            continue
        cls = int(Priority[a.cls])
        deadline_s = sc.deadline_ms(a.cls, a.deadline_ms) / 1000
        stated = _states_deadline(sc, a.cls, a.deadline_ms)
        prompt, output = sampler(a.prompt_tokens), sampler(a.output_tokens)
        # Without a key, one anonymous caller (as one client without a key is live): its calls
        # keep arrival order among themselves; chains and named keys are flows of their own.
        flow = f"key:{a.key}" if a.key else "anonymous"
        client = a.client or sc.spec.client
        for t in _times(sc, a, rng):
            arrivals.append(Arrival(t, Call(tier, cls, prompt(rng), output(rng), flow), deadline_s, stated,
                                    client, a.deadline_ms))
    chains: list[ChainArrival] = []
    for i, c in enumerate(sc.spec.chains):
        rng = random.Random(f"{seed}/chains/{i}")
        cls = int(Priority[c.cls])
        fanouts = [st.fanout for st in c.stages]
        shapes = [(sc.cfg.resolve_model(st.tier) or st.tier, sampler(st.prompt_tokens), sampler(st.output_tokens))
                  for st in c.stages]
        for j, t in enumerate(_times(sc, c, rng)):
            stages: list[list[Call]] = []
            n = 1
            flow = f"chain:{c.name}#{j}"  # each chain its own flow, as X-Chain-Id names it live
            for st, (tier, prompt, output) in zip(c.stages, shapes, strict=True):
                n *= st.fanout
                stages.append([Call(tier, cls, prompt(rng), output(rng), flow) for _ in range(n)])
            chains.append(ChainArrival(t, c.name, cls, c.deadline_ms / 1000, stages, fanouts, c.conversation,
                                       c.client or sc.spec.client))
    arrivals.sort(key=lambda a: a.t)
    return Trace(arrivals, chains)
