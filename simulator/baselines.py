"""Baselines: how other autoscalers would have met the same trace.

Each baseline scales by its own rule (the peers' published defaults, see
the peers' documentation), starts from the same fleet (every tier at its warm
floor, ready), keeps the same floor and ceiling (warm_floor, max_replicas),
has no pre-warm, no admission rule and no budget: its calls wait in the line
until a replica takes them or their deadline passes. Scale-in drains as ours
does (no call in flight is lost), so the comparison is about *when* and *how
many*, not about killing work.

- `static`: provisioning for the peak: replicas_for(peak arrival rate) from the start, never changed.
- `hpa`: utilisation target (busy slots / slots) of 70 %, 15 s sync, 10 % tolerance, scale-up at most
  double or +4 per sync, 300 s scale-down stabilisation (the Kubernetes HPA defaults).
- `keda`: ceil(line length / 5), polled every 30 s, HPA's 300 s scale-down stabilisation;
  the tier's pre-warm windows as KEDA cron triggers.
- `ray`: target 2 ongoing requests per replica averaged over 30 s, upscale delay 30 s,
  downscale delay 600 s (Ray Serve's defaults).

The clairvoyant lower bound they are all measured against is in `simulator.bound`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque

from fleet.config import TierConfig
from fleet.policy import TierObservation, active_prewarm, prewarm_lead_s, replicas_for, tier_capacity, waiting
from fleet.replica_model import cold_start_s
from simulator.policies import Action, SimPolicy
from simulator.scenario import Scenario, rate_at


def _clamp(tc: TierConfig, n: int) -> int:
    return max(tc.warm_floor, min(tc.max_replicas, n))


def peak_arrival_rate(sc: Scenario, tier: str) -> float:
    """The highest arrival rate the scenario's curves give a tier, chains' fan-out included."""
    curves: list[tuple[list[tuple[float, float]], float]] = []
    for a in sc.spec.arrivals:
        if (sc.cfg.resolve_model(a.tier) or a.tier) == tier:
            curves.append((sc.rate_points(a), 1.0))
    for c in sc.spec.chains:
        mult = 1
        for st in c.stages:
            mult *= st.fanout
            if (sc.cfg.resolve_model(st.tier) or st.tier) == tier:
                curves.append((sc.rate_points(c), float(mult)))
    knots = sorted({t for pts, _ in curves for t, _ in pts if 0 <= t <= sc.duration_s} | {0.0})
    return max((sum(rate_at(pts, t) * m for pts, m in curves) for t in knots), default=0.0)


class Static(SimPolicy):
    name = "static"

    def __init__(self) -> None:
        self.size: dict[str, int] = {}

    def prepare(self, sc: Scenario) -> None:
        # Provisioned for the peak it was told about: the scenario's curves, as an operator would plan.
        for tier, tc in sc.cfg.tiers.items():
            self.size[tier] = _clamp(tc, replicas_for(peak_arrival_rate(sc, tier), tier_capacity(tc).per_replica_rate))

    def scale(self, obs: TierObservation, tc: TierConfig, *, gpu_room: int | None = None) -> Action:
        n = self.size[obs.tier]
        have = obs.replicas.ready + obs.replicas.starting
        if n > have:
            return Action("scale_out", n - have, f"static: provision for the peak, {n} replicas", "static", n, n)
        return Action("hold", 0, f"static: {n} replicas", "static", n, n)


class _Stabilised(SimPolicy, ABC):
    """Scale up at once, scale down to the highest recommendation of the last `down_window_s`."""

    period_s = 15.0
    down_window_s = 300.0

    def __init__(self) -> None:
        self.recs: dict[str, deque[tuple[float, int]]] = {}
        self.last: dict[str, float] = {}

    @abstractmethod
    def recommend(self, obs: TierObservation, tc: TierConfig, have: int) -> tuple[int, str]:
        """Replicas this baseline wants now, and why (each baseline its own rule)."""

    def scale(self, obs: TierObservation, tc: TierConfig, *, gpu_room: int | None = None) -> Action:
        """At each sync: scale up at once to the recommendation; down only to the highest
        recommendation of the stabilisation window, never while a replica starts."""
        reps = obs.replicas
        have = reps.ready + reps.starting
        last = self.last.get(obs.tier)
        if last is not None and obs.now - last < self.period_s:
            return Action("hold", 0, f"{self.name}: between syncs", "sync")
        self.last[obs.tier] = obs.now
        want, why = self.recommend(obs, tc, have)
        want = _clamp(tc, want)
        recs = self.recs.setdefault(obs.tier, deque())
        recs.append((obs.now, want))
        while recs and recs[0][0] < obs.now - self.down_window_s:
            recs.popleft()
        if want > have:
            return Action("scale_out", want - have, f"{self.name}: {why} -> {want}", "up")
        stable = max(n for _, n in recs)
        if stable < reps.ready and not reps.starting:
            return Action("scale_in", stable - reps.ready, f"{self.name}: {why}, stable {stable} for "
                          f"{self.down_window_s:g} s", "down")
        return Action("hold", 0, f"{self.name}: {why}, hold {have}", "hold")


class Hpa(_Stabilised):
    name = "hpa"
    target = 0.7
    tolerance = 0.1

    def recommend(self, obs: TierObservation, tc: TierConfig, have: int) -> tuple[int, str]:
        ready = obs.replicas.ready
        if not ready:
            return have, "no ready replica to measure"
        # Busy slots over the slots the ready replicas report (what a pod metric would read):
        # a replica whose KV cache holds fewer calls than its slots reports that fewer.
        slots = sum(r.slots for r in obs.replicas.members if r.state == "ready") or ready * tc.slots
        util = obs.in_flight / slots
        if abs(util / self.target - 1) <= self.tolerance:
            return have, f"utilisation {util:.0%} within tolerance"
        want = math.ceil(ready * util / self.target)
        want = min(want, max(2 * have, have + 4))  # the default scale-up policy
        return want, f"utilisation {util:.0%} vs {self.target:.0%}"


class Keda(_Stabilised):
    """ceil(line / 5); with the scenario's pre-warm windows as KEDA cron triggers (KEDA has a
    cron scaler: an operator who schedules a pre-warm for us would give KEDA the same), so
    the comparison is about the line rule, not about who knew the schedule."""

    name = "keda"
    period_s = 30.0

    def recommend(self, obs: TierObservation, tc: TierConfig, have: int) -> tuple[int, str]:
        n = waiting(obs)
        want, why = math.ceil(n / 5), f"ceil(line {n} / 5)"
        if tc.prewarm:
            cron = active_prewarm(tc.prewarm, [], obs.now, prewarm_lead_s(cold_start_s(tc.sim), 1.0),
                                  tc.budget.timezone).floor
            if cron > want:
                want, why = cron, f"{why}, cron {cron}"
        return want, why


class Ray(SimPolicy):
    name = "ray"
    target = 2.0
    look_back_s = 30.0
    upscale_delay_s = 30.0
    downscale_delay_s = 600.0

    def __init__(self) -> None:
        self.hist: dict[str, deque[tuple[float, int]]] = {}
        self.up_since: dict[str, float | None] = {}
        self.down_since: dict[str, float | None] = {}

    def scale(self, obs: TierObservation, tc: TierConfig, *, gpu_room: int | None = None) -> Action:
        """Ray Serve's rule: ongoing requests averaged over the look-back, over the target per
        replica, acted on only after the up- or down-scale delay has held."""
        name, now, reps = obs.tier, obs.now, obs.replicas
        h = self.hist.setdefault(name, deque())
        h.append((now, obs.in_flight + waiting(obs)))
        while h[0][0] < now - self.look_back_s:
            h.popleft()
        ongoing = sum(n for _, n in h) / len(h)
        have = reps.ready + reps.starting
        want = _clamp(tc, math.ceil(ongoing / self.target))
        why = f"ongoing {ongoing:.1f} / {self.target:g} -> {want}"
        if want > have:
            self.down_since[name] = None
            since = self.up_since.get(name) or now
            self.up_since[name] = since
            if now - since >= self.upscale_delay_s:
                self.up_since[name] = None
                return Action("scale_out", want - have, f"ray: {why}", "up")
            return Action("hold", 0, f"ray: {why}, upscale delay", "wait_up")
        self.up_since[name] = None
        if want < have:
            since = self.down_since.get(name) or now
            self.down_since[name] = since
            if now - since >= self.downscale_delay_s and not reps.starting and reps.ready > want:
                self.down_since[name] = None
                return Action("scale_in", want - reps.ready, f"ray: {why}", "down")
            return Action("hold", 0, f"ray: {why}, downscale delay", "wait_down")
        self.down_since[name] = None
        return Action("hold", 0, f"ray: {why}", "hold")


BASELINES: dict[str, type[SimPolicy]] = {"static": Static, "hpa": Hpa, "keda": Keda, "ray": Ray}
