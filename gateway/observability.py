"""What the gateway tells Prometheus.

Two kinds of metric live here:

- Gauges of the fleet's state (line by class, oldest wait, seconds-to-drain,
  arrival and service rates, replicas by state, the configured bounds). Redis
  is the truth for these and every gateway replica sees the same line, so
  they are refreshed from Redis at scrape time, with the policy's own
  builders over the same observation the scaler reads, rather than kept up to
  date on the hot path. Spend and budget gauges show the budget governor's
  published judgement; the gateway does not judge again.
- Histograms of what callers experienced (end-to-end latency and queue wait
  by class, TTFT and TPOT as the worker measured them), observed once per
  request when its final event passes through the gateway.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from fleet import metrics as m
from fleet.config import CLASSES, FleetConfig
from fleet.governor import set_budget_gauges
from fleet.observe import read_tier
from fleet.outcome import Outcome
from fleet.policy import arrival_rate, drain_s, replicas_by_version, service_rate
from fleet.policy.cold_start import model_error, modelled_startup
from fleet.store.chains import read_chains
from fleet.store.events import Done
from fleet.store.line import Line
from fleet.store.model_registry import read_record

router = APIRouter()
SCRAPE_REFRESH_S = 2.0  # the gauges' refresh from Redis may take this long per scrape


async def refresh_tier(cfg: FleetConfig, line: Line) -> None:
    """Set one tier's state gauges (and, as the governor judged them, its budget gauges) from Redis now."""
    tier = line.tier
    tc = cfg.tiers[tier]
    live = await read_tier(line.redis, line, heartbeat_s=cfg.heartbeat_s, window_s=cfg.rate_window_s)
    obs = live.obs
    for cls, n in zip(CLASSES, obs.line, strict=True):
        m.LINE_LENGTH.labels(tier, cls).set(n)
    m.OLDEST_WAIT.labels(tier).set(obs.oldest_wait_s)
    _count_preemptions(tier, live.snap.counters)
    # This process's enqueues that no replica acknowledged within replication.ack_timeout_ms.
    m.ENQUEUE_UNREPLICATED.labels(tier).inc(line.replicas.short - _unreplicated_seen.get(tier, 0))
    _unreplicated_seen[tier] = line.replicas.short
    m.DRAIN.labels(tier).set(drain_s(obs))  # +Inf when nothing serves a non-empty line
    m.ARRIVAL_RATE.labels(tier).set(arrival_rate(obs))
    m.SERVICE_RATE.labels(tier).set(service_rate(obs))
    m.IN_FLIGHT.labels(tier).set(obs.in_flight)
    rec = await read_record(line.redis, line.keys)  # None before anything seeded the registry
    m.set_replicas(tier, replicas_by_version(obs.replicas.members, rec.live if rec else tc.version))
    m.WARM_FLOOR.labels(tier).set(tc.warm_floor)
    m.MAX_REPLICAS.labels(tier).set(tc.max_replicas)
    m.DRAIN_THRESHOLD.labels(tier).set(tc.drain_threshold_s)
    # The start-up model's error by term, over the live replicas that told their phases.
    for e in model_error([b.cold_start_phases for b in live.beats if b.cold_start_phases], modelled_startup(tc)):
        if e.error_s is not None:
            m.COLD_START_MODEL_ERROR.labels(tier, e.term).set(e.error_s)
    # Spend, budget and cost as the budget governor last judged them (whoever ticks it: the
    # scaler, or this gateway while no scaler runs). Not judged yet: the gauges wait.
    if live.budget is not None:
        set_budget_gauges(tier, live.budget, [w.name for w in tc.budget.windows])


_preempted_seen: dict[tuple[str, str], int] = {}
_unreplicated_seen: dict[str, int] = {}


def _count_preemptions(tier: str, counters: dict[str, int]) -> None:
    """Advance fleet_preemptions_total by what the line counted since the last scrape (Redis holds the total)."""
    for cls in CLASSES:
        n = counters.get(f"preempted:{cls}", 0)
        last = _preempted_seen.get((tier, cls))
        if last is None or n > last:
            m.PREEMPTIONS.labels(tier, cls).inc(n - (last or 0))
        _preempted_seen[(tier, cls)] = n  # below the last: the counters were reset; count from there


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    gw = request.app.state.gw
    # A Redis blip must not cost the scrape the histograms: the gauges then
    # keep their last values and the failure shows as a missing refresh.
    lines = list(gw.lines.values())
    # A frozen Redis (no reset, only silence) is cut short too: the scrape answers within its bound.
    await asyncio.gather(*(asyncio.wait_for(refresh_tier(gw.cfg, line), SCRAPE_REFRESH_S) for line in lines),
                         asyncio.wait_for(refresh_chains(gw), SCRAPE_REFRESH_S), return_exceptions=True)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def refresh_chains(gw: Any) -> None:
    """The chains' gauges from their records (`fleet.store.chains`)."""
    c = await read_chains(gw.redis, gw.cfg.namespace)
    for outcome, by in ((Outcome.COMPLETED, c.completed), ("refused_or_late", c.refused_or_late)):
        for (tier, cls), n in by.items():
            m.CHAINS.labels(tier, cls, outcome).set(n)
    for q, v in (("0.5", c.p50_s), ("0.99", c.p99_s)):
        if v is not None:
            m.CHAIN_SECONDS.labels(q).set(v)


class RequestRecorder:
    """Observes one request's histograms when its final event arrives. Safe to
    call more than once: only the first final event counts."""

    __slots__ = ("_done", "priority", "t0", "tier")

    def __init__(self, tier: str, priority: str) -> None:
        self.tier = tier
        self.priority = priority
        self.t0 = time.monotonic()
        self._done = False

    def done(self, ev: Done) -> None:
        """The worker's done event: its TTFT, TPOT and wait (seconds) and its token counts."""
        if self._done:
            return
        self._done = True
        m.LATENCY.labels(self.tier, self.priority).observe(time.monotonic() - self.t0)
        m.QUEUE_WAIT.labels(self.tier, self.priority).observe(ev.wait_s)
        m.TTFT.labels(self.tier).observe(ev.ttft_s)
        if ev.completion_tokens > 1:  # one token has no time per output token
            m.TPOT.labels(self.tier).observe(ev.tpot_s)
        m.TOKENS.labels(self.tier, "prompt").inc(ev.prompt_tokens)
        m.TOKENS.labels(self.tier, "completion").inc(ev.completion_tokens)
