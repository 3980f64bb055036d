"""The clairvoyant lower bound: replica-seconds no schedule can go below, knowing the whole trace.

It is no policy: it reads the trace and computes replica-seconds (and spend)
that no schedule meeting every committed deadline can go below (see
`tier_bound`). `fleet simulate --compare` ranks every policy against it.

Two bounds price the whole trace: "every call" and "every call + floors". A
policy that sheds (a budget running out, a line past its limit) serves fewer
calls than either prices, and can come out below them: they are no bound on
it. The served bound (`served_bound`) prices exactly the calls one policy
served on time, with the floors: no schedule serves those calls, on time,
keeping the floors, in fewer replica-seconds. `bound_ratio` is a policy's
replica-hours over its own served bound, so it is never below 1.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple

from fleet.policy.prewarm import scheduled_spans
from fleet.replica_model import cold_start_s, prefill_s, step_s
from simulator.arrivals import Call, ChainArrival, Trace
from simulator.results import SimResult
from simulator.scenario import Scenario


@dataclass
class TierBound:
    tier: str
    ready_s: float  # ready replica-seconds no schedule can go below
    starting_s: float  # cold-start replica-seconds no schedule can go below
    committed_calls: int
    infeasible_calls: int  # calls no schedule could serve on time even alone
    peak_replicas: int
    hourly_usd: float
    token_usd: float  # the committed calls' tokens at the tier's per-token price

    @property
    def replica_seconds(self) -> float:
        return self.ready_s + self.starting_s

    @property
    def spend_usd(self) -> float:
        return self.replica_seconds * self.hourly_usd / 3600 + self.token_usd


class Window(NamedTuple):
    """One call as the bound sees it: when it may run, and the least work it is."""

    start: float  # earliest start
    end: float  # latest end
    service_s: float  # shortest service: alone on a replica (decode step at batch 1)
    prefill_s: float  # its prefill, which holds a slot beside the decode batch
    output: int  # tokens to decode


def committed_windows(sc: Scenario, trace: Trace, max_class: int = 0,
                      served: set[int] | None = None) -> dict[str, list[Window]]:
    """Per tier, every committed call (with `max_class`, every call of that class or higher)
    as a `Window`; with `served` (the `id`s of the calls a policy served on time), only those.

    A call alone on a replica is served fastest (decode step at batch 1), so
    `service_s` is a floor on the slot time it occupies. Chain calls get
    relaxed windows that hold for any schedule: a call cannot start before its
    ancestors could have finished back to back, and must end early enough for
    its slowest line of descendants to finish by the chain's deadline. With
    `served`, a chain that was not served whole (timed out or shed part way)
    lends its served calls no tail: the descendants that did not run need no room.
    """
    out: dict[str, list[Window]] = {t: [] for t in sc.cfg.tiers}

    def kept(c: Call) -> bool:
        return served is None or id(c) in served

    tcs = sc.cfg.tiers

    # `service_s(sim, prompt, output, 1)` with its batch-of-one step made once per tier, not once
    # per call (the same sum, term for term: the same float).
    step1 = {t: step_s(tc.sim, 1) for t, tc in tcs.items()}

    def shortest(tier: str, prompt: int, output: int) -> float:
        return prefill_s(tcs[tier].sim, prompt) + output * step1[tier]

    def window(tier: str, start: float, end: float, prompt: int, output: int, ln: float | None = None) -> Window:
        ln = shortest(tier, prompt, output) if ln is None else ln
        return Window(start, end, ln, prefill_s(tcs[tier].sim, prompt), output)

    # The arrivals (most of the calls), `window` inlined: its prefill worked out once, not twice
    # (the same terms, summed in the same order: the same floats).
    sims = {t: tc.sim for t, tc in tcs.items()}
    for a in trace.arrivals:
        c = a.call
        if c.cls <= max_class and (served is None or id(c) in served):
            pre = prefill_s(sims[c.tier], c.prompt)
            out[c.tier].append(Window(a.t, a.t + a.deadline_s, pre + c.output * step1[c.tier], pre, c.output))
    for ch in trace.chains:
        if ch.cls > max_class:
            continue
        whole = all(kept(c) for stage in ch.stages for c in stage)
        prompts = uncached_prompts(ch)
        lens = [[shortest(c.tier, prompts[id(c)], c.output) for c in stage] for stage in ch.stages]
        head, tail = _chain_slack(ch, lens)
        deadline = ch.t + ch.deadline_s
        for k, stage in enumerate(ch.stages):
            for i, c in enumerate(stage):
                if kept(c):
                    end = deadline - (tail[k][i] if whole else 0.0)
                    out[c.tier].append(window(c.tier, head[k][i], end, prompts[id(c)], c.output, lens[k][i]))
    return out


def _chain_slack(ch: ChainArrival, lens: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """For each call of a chain (stage k, call i), given each call's shortest service `lens`:
    head[k][i], the earliest it can start (its ancestors back to back from the chain's
    arrival), and tail[k][i], the longest line of shortest services below it."""
    tail: list[list[float]] = [[0.0] * len(s) for s in ch.stages]
    for k in range(len(ch.stages) - 2, -1, -1):
        f = ch.fanouts[k + 1]
        for i in range(len(ch.stages[k])):
            tail[k][i] = max(lens[k + 1][j] + tail[k + 1][j] for j in range(i * f, (i + 1) * f))
    head: list[list[float]] = [[ch.t] * len(s) for s in ch.stages]
    for k in range(1, len(ch.stages)):
        f = ch.fanouts[k]
        for j in range(len(ch.stages[k])):
            parent = j // f
            head[k][j] = head[k - 1][parent] + lens[k - 1][parent]
    return head, tail


def uncached_prompts(ch: ChainArrival) -> dict[int, int]:
    """Per call of a chain (by `id`), the fewest prompt tokens its prefill must compute.

    A conversation's calls re-send one prefix, which a replica may hold cached: a call's
    prefill is at least its prompt past the longest prefix another call of the chain could
    have left there (that call's prompt and answer), the best any schedule can do. Other
    chains' calls compute their whole prompt."""
    calls = [c for stage in ch.stages for c in stage]
    prompts = {id(c): c.prompt for c in calls}
    if ch.conversation and len(calls) > 1:
        longest = sorted((c.prompt + c.output, id(c)) for c in calls)
        for c in calls:
            left = longest[-1][0] if longest[-1][1] != id(c) else longest[-2][0]
            prompts[id(c)] = max(0, c.prompt - left)
    return prompts


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def least_busy_s(prefill_s: float, output: int, slots: int, base_s: float, per_seq_s: float) -> float:
    """Replica-seconds no schedule can serve this much work in: `prefill_s` seconds of prefill
    (each holding a slot) and `output` tokens to decode, on replicas of `slots` slots whose
    decode step takes base + per_seq x batch.

    A replica running a batch of k beside s - k prefills makes k / step(k) tokens and
    s - k prefill-seconds per second. Tokens per second grow with k but less than in
    proportion (the step lengthens), so the cheapest mix runs one k throughout: the k
    where the two needs take equally long, R = prefill_s / (s - k) = output x step(k) / k.
    Found by bisection: the first term grows with k, the second falls.
    """
    if output <= 0:
        return prefill_s / slots
    if prefill_s <= 0:
        return output * (base_s + per_seq_s * slots) / slots

    def gap(k: float) -> float:
        return prefill_s / (slots - k) - output * (base_s + per_seq_s * k) / k

    lo, hi = 1e-9, float(slots) - 1e-9
    for _ in range(60):
        mid = (lo + hi) / 2
        if gap(mid) < 0:
            lo = mid
        else:
            hi = mid
    return prefill_s / (slots - lo)


def floor_steps(sc: Scenario, tier: str) -> list[tuple[float, int]]:
    """The floor the operator holds the tier to over the replay, as (t, floor) breakpoints in replay
    seconds: its warm floor, raised by each scheduled pre-warm window while it is open (the design's
    floor = max(warm floor, active pre-warm), docs/architecture.md). A window's lead is not counted: the start-up before
    it is the policy's way of having the floor resident, not part of the floor."""
    tc = sc.cfg.tiers[tier]
    t0, end = sc.start_epoch, sc.duration_s
    spans = [(max(0.0, a - t0), min(end, b - t0), f)
             for a, b, f in scheduled_spans(tc.prewarm, t0, t0 + end, tc.budget.timezone)]
    cuts = sorted({0.0, *(a for a, _, _ in spans), *(b for _, b, _ in spans)} - {end})
    steps: list[tuple[float, int]] = []
    for t in cuts:
        f = max([tc.warm_floor, *(fl for a, b, fl in spans if a <= t < b)])
        if not steps or steps[-1][1] != f:
            steps.append((t, f))
    return steps


class _StepIntegral:
    """The integral from 0 of a step function given as (t, value) breakpoints from t = 0."""

    def __init__(self, steps: list[tuple[float, int]], end: float) -> None:
        self.t = [t for t, _ in steps]
        self.v = [v for _, v in steps]
        self.end = end
        self.cum = [0.0]
        for i in range(1, len(steps)):
            self.cum.append(self.cum[-1] + self.v[i - 1] * (self.t[i] - self.t[i - 1]))

    def __call__(self, t: float) -> float:
        t = min(max(t, 0.0), self.end)
        i = bisect.bisect_right(self.t, t) - 1
        return self.cum[i] + self.v[i] * (t - self.t[i])


def tier_bound(sc: Scenario, tier: str, windows: list[Window],
               bucket_widths: tuple[float, ...] = (30.0, 60.0, 120.0, 300.0, 900.0, 3600.0),
               keep_floor: bool = False) -> TierBound:
    """Replica-seconds no schedule meeting every committed deadline of `tier` can go below.

    Three facts hold for any schedule: a ready replica runs at most `slots` calls
    at once; a call occupies its slot at least its shortest service time, inside
    its window; and a replica decodes no faster than its batch allows (a full
    batch's step is longer than one sequence's: analysis's is 19.2 ms at 12
    against 12.6 ms alone). So over any stretch of time B the ready
    replica-seconds are at least

    - the least time the calls whose whole window lies in B take, their prefills
      and their tokens together (`least_busy_s`; never below their shortest
      services / slots), and
    - the integral over B of ceil(calls that must be running at t / slots):
      a call with window [a, d] and service L is surely running in [d - L, a + L];

    the larger of the two holds for B, and the sums over the buckets of a
    partition hold for the whole replay (the best of a few partitions is
    kept). On top, a replica beyond those ready at the start must be started,
    and pays its cold start before it serves: at least (peak need - initial
    replicas) cold starts.

    With `keep_floor`, the schedule must also keep the tier's floors at all times,
    as every policy here does: the warm floor, raised by the scheduled pre-warm
    windows while they are open (`floor_steps`); each bucket costs at least the
    integral of that floor over it.
    """
    tc = sc.cfg.tiers[tier]
    slots = tc.slots
    step = tc.sim.decode_step
    end = sc.duration_s
    feasible = [w for w in windows if w.end - w.start >= w.service_s - 1e-9]
    infeasible = len(windows) - len(feasible)
    # Mandatory running intervals, clipped to the replay.
    edges: list[tuple[float, int]] = []
    for a, d, ln, _, _ in feasible:
        lo, hi = max(d - ln, 0.0), min(a + ln, end)
        if hi > lo:
            edges.append((lo, 1))
            edges.append((hi, -1))
    edges.sort()
    # The step function need(t) = ceil(running(t) / slots), as (t, need) breakpoints.
    steps: list[tuple[float, int]] = [(0.0, 0)]
    running = 0
    for t, d in edges:
        running += d
        n = _ceil_div(running, slots)
        if steps[-1][0] == t:
            steps[-1] = (t, n)
        else:
            steps.append((t, n))
    need_integral = _StepIntegral(steps, end)
    floor_integral = _StepIntegral(floor_steps(sc, tier) if keep_floor else [(0.0, 0)], end)
    best = 0.0
    # The windows inside the replay, with their ends clipped as the buckets read them: picked once
    # for every partition below (in the same order, so every bucket's sums are the same floats).
    inside = [(a, min(d, end - 1e-9), ln, pre, out) for a, d, ln, pre, out in feasible if not (d > end or a < 0)]
    starts, lasts = [x[0] for x in inside], [x[1] for x in inside]
    for w in (*bucket_widths, end):
        n_b = max(1, math.ceil(end / w))
        shortest = [0.0] * n_b  # shortest services, summed
        prefill, tokens = [0.0] * n_b, [0] * n_b
        # Each window's bucket in one pass; the sums still run in the windows' order (the same floats).
        for b, last, (_, _, ln, pre, out) in zip([int(a // w) for a in starts], lasts, inside, strict=True):
            if b < n_b and b == int(last // w):
                shortest[b] += ln
                prefill[b] += pre
                tokens[b] += out
        total = 0.0
        for b in range(n_b):
            lo, hi = b * w, min((b + 1) * w, end)
            fluid = max(shortest[b] / slots, least_busy_s(prefill[b], tokens[b], slots, step.base_s, step.per_seq_s))
            total += max(fluid, need_integral(hi) - need_integral(lo), floor_integral(hi) - floor_integral(lo))
        best = max(best, total)
    peak = max((n for _, n in steps), default=0)
    initial = tc.warm_floor
    starting = max(0, peak - initial) * cold_start_s(tc.sim)
    return TierBound(tier, best, starting, len(windows), infeasible, peak, tc.hourly_usd, 0.0)


def clairvoyant_bound(sc: Scenario, trace: Trace, max_class: int = 0, keep_floor: bool = False,
                      served: set[int] | None = None) -> dict[str, TierBound]:
    """Per tier, the replica-seconds (and spend) below which no schedule serves every committed
    call on time. With `max_class` 3, every call of every class: the cost of serving it all;
    with `keep_floor`, while also keeping the floors (warm and scheduled pre-warm); with
    `served` (`id`s of calls), only those calls."""
    import gc

    # A window per call, and no reference cycles among them: with the trace and a replay's calls
    # alive, the cyclic collector would rescan them again and again (as `Simulator.run`).
    was = gc.isenabled()
    gc.disable()
    try:
        return _clairvoyant_bound(sc, trace, max_class, keep_floor, served)
    finally:
        if was:
            gc.enable()


def _clairvoyant_bound(sc: Scenario, trace: Trace, max_class: int, keep_floor: bool,
                       served: set[int] | None) -> dict[str, TierBound]:
    wins = committed_windows(sc, trace, max_class, served)
    out = {t: tier_bound(sc, t, w, keep_floor=keep_floor) for t, w in wins.items()}
    # The committed calls' tokens are paid by any schedule that serves them.
    price = {t: (tc.usd_per_million_tokens or 0.0) / 1e6 for t, tc in sc.cfg.tiers.items()}
    tokens: dict[str, int] = dict.fromkeys(sc.cfg.tiers, 0)
    for a in trace.arrivals:
        if a.call.cls <= max_class and (served is None or id(a.call) in served):
            tokens[a.call.tier] += a.call.prompt + a.call.output
    for ch in trace.chains:
        if ch.cls <= max_class:
            for stage in ch.stages:
                for c in stage:
                    if served is None or id(c) in served:
                        tokens[c.tier] += c.prompt + c.output
    for t, b in out.items():
        b.token_usd = tokens[t] * price[t]
    return out



def served_ids(result: SimResult) -> set[int]:
    """The calls a replay served on time (the trace's own `Call` objects, by identity)."""
    return {id(c) for t in result.tiers.values() for c in t.served}


def served_bound(sc: Scenario, trace: Trace, result: SimResult) -> dict[str, TierBound]:
    """Per tier, the replica-seconds below which no schedule serves the very calls `result`
    served on time while keeping the floors: the bound a policy that sheds is judged by."""
    return clairvoyant_bound(sc, trace, max_class=3, keep_floor=True, served=served_ids(result))


def hours(bound: dict[str, TierBound]) -> float:
    """A bound's replica-hours over every tier."""
    return sum(b.replica_seconds for b in bound.values()) / 3600
