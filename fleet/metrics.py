"""Every Prometheus metric of the fleet, in one place, so names and label sets
stay consistent across parts and bounded (tiers and classes are config-sized;
reasons and outcomes are fixed sets). Each process exposes the ones it feeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from fleet.outcome import GATEWAY_ONLY, LINE_OUTCOMES, Outcome
from fleet.policy.cold_start import PHASES, ColdStartPhases

# Buckets that resolve a p99 from 5 ms to 60 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)

REQUESTS = Counter("fleet_requests", f"Every response by outcome (fleet.outcome.Outcome): the line's "
                   f"({', '.join(LINE_OUTCOMES)}) and refusals before it ({', '.join(sorted(GATEWAY_ONLY))}, "
                   f"{Outcome.UNAVAILABLE}).", ["tier", "priority", "outcome"])
RETRIES = Counter("fleet_retries", "Calls kept for their SDK's retry and attempts judged as retries, by result: "
                  "parked (its client left; kept for a retry), joined (a retry took over the call still running), "
                  "abandoned (no retry came within the grace), budget_refused (the retry budget was spent).",
                  ["tier", "result"])
DEADLINES = Counter("fleet_deadline_source", "Calls by where their deadline came from: header (X-Deadline-Ms), "
                    "client (the SDK's own timeout and retries), default.", ["tier", "source"])
SHED = Counter("fleet_shed", "Requests refused at admission, by reason.", ["tier", "priority", "reason"])
DEGRADED = Counter("fleet_degraded", "Calls a tier would have refused, served by the tier its degrade rule names "
                   "(docs/degrade.md): from the tier asked, to the tier that served, the first refusal's reason.",
                   ["from", "to", "reason", "class"])
TTFT = Histogram("fleet_ttft_seconds", "Time to first token, measured by the worker.", ["tier"],
                 buckets=LATENCY_BUCKETS)
TPOT = Histogram("fleet_tpot_seconds", "Time per output token after the first, measured by the worker.", ["tier"],
                 buckets=(0.0005, 0.001, 0.0025, *LATENCY_BUCKETS))
LATENCY = Histogram("fleet_request_latency_seconds", "End-to-end latency at the gateway.", ["tier", "priority"],
                    buckets=LATENCY_BUCKETS)
QUEUE_WAIT = Histogram("fleet_queue_wait_seconds", "Time spent in the line before a worker claimed it.",
                       ["tier", "priority"], buckets=LATENCY_BUCKETS)
# Fed by the gateway from the line's counters (exact, fleet-wide), by the victim's class.
PREEMPTIONS = Counter("fleet_preemptions", "Running requests put back in the line for a higher class (preempted).",
                      ["tier", "class"])
ENQUEUE_UNREPLICATED = Counter("fleet_enqueue_unreplicated", "Enqueues that no replica of the Redis acknowledged "
                               "within replication.ack_timeout_ms (the call was served anyway).", ["tier"])
TOKENS = Counter("fleet_tokens", "Tokens served, by kind (prompt, completion).", ["tier", "kind"])

LINE_LENGTH = Gauge("fleet_line_length", "Requests waiting in the line, by class.", ["tier", "priority"])
OLDEST_WAIT = Gauge("fleet_oldest_wait_seconds", "Wait of the oldest request in the line.", ["tier"])
DRAIN = Gauge("fleet_seconds_to_drain", "Requests waiting / served per second (the scaling signal).", ["tier"])
ARRIVAL_RATE = Gauge("fleet_arrival_rate", "Admitted requests per second over the rate window.", ["tier"])
SERVICE_RATE = Gauge("fleet_service_rate", "Completed requests per second over the rate window.", ["tier"])
REPLICAS = Gauge("fleet_replicas", "Replicas by model version and state (starting, ready, draining).",
                 ["tier", "version", "state"])
# The configured bounds, so dashboards can draw the line, replicas and drain time against them.
WARM_FLOOR = Gauge("fleet_warm_floor", "Configured warm floor (replicas kept warm when idle).", ["tier"])
MAX_REPLICAS = Gauge("fleet_max_replicas", "Configured replica ceiling before any budget cap.", ["tier"])
DRAIN_THRESHOLD = Gauge("fleet_drain_threshold_seconds", "Seconds-to-drain above which the tier scales out.",
                        ["tier"])
CHAINS = Gauge("fleet_chains", "Agent chains (X-Chain-Id) ended, by the tier and class of their first call: "
               "completed, and those with a call refused or late (no label per chain).",
               ["tier", "priority", "outcome"])
CHAIN_SECONDS = Gauge("fleet_chain_completion_seconds", "Chain completion time (first call in to last call out) "
                      "of the last 1,000 chains completed, by quantile.", ["quantile"])
IN_FLIGHT = Gauge("fleet_in_flight", "Requests claimed by a worker and running.", ["tier"])
# Worker side: what one replica holds right now (exposed on `fleet worker --metrics-port`).
WORKER_ACTIVE = Gauge("fleet_worker_active_requests", "Requests this replica is running.", ["tier", "replica"])
WORKER_SLOTS = Gauge("fleet_worker_slots", "Requests this replica may run at once.", ["tier", "replica"])
# Each replica observes its own cold start once, phase by phase (docs/operations.md, "Cold starts by phase").
COLD_START_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
COLD_START_PHASE = Histogram("fleet_cold_start_phase_seconds", "A replica's cold start by phase (load: weights in; "
                             "init: KV cache and graphs or compile; first_token: the warm-up call), measured by the "
                             "replica's engine once it started.", ["tier", "phase"], buckets=COLD_START_BUCKETS)
# The gateway's, from the live replicas' heartbeats at scrape time: the model's error by term.
COLD_START_MODEL_ERROR = Gauge("fleet_cold_start_model_error_seconds", "Median measured minus modelled cold start of "
                               "the live replicas, by the model's term (load: weights / load speed; warmup: init + "
                               "first_token; total).", ["tier", "term"])
SCALE_DECISIONS = Counter("fleet_scale_decisions", "Scaler decisions by action and reason.",
                          ["tier", "action", "reason"])
# Scaler side: the bounds in force (floor includes pre-warms, ceiling includes budget and GPUs).
REPLICA_FLOOR = Gauge("fleet_replica_floor", "Floor in force: max(warm floor, active pre-warm).", ["tier"])
REPLICA_CEILING = Gauge("fleet_replica_ceiling", "Ceiling in force: min(max_replicas, budget, GPU room).", ["tier"])
REPLICA_EVENTS = Counter("fleet_replica_events", "Replica lifecycle events seen by the supervisor (started, ready, "
                         "drained, died, start_timeout, killed_after_grace, lost).", ["tier", "event"])

MODEL_ROLLBACKS = Counter("fleet_model_rollbacks", "Automatic un-promotions of a model version, by reason "
                          "(error_rate, ttft_p99).", ["tier", "reason"])
SPEND = Gauge("fleet_spend_usd_total", "Dollars spent by the tier in the current daily budget window.", ["tier"])
BUDGET = Gauge("fleet_budget_usd", "Dollar budget by window.", ["tier", "window"])
PROJECTED_SPEND = Gauge("fleet_projected_spend_usd", "Spent so far plus current burn over the rest of the window.",
                        ["tier", "window"])
COST_PER_MTOK = Gauge("fleet_cost_per_million_tokens_usd", "Dollars per million useful tokens.", ["tier"])

_replica_series: dict[str, set[tuple[str, str]]] = {}


def set_replicas(tier: str, by_version: Mapping[str, Mapping[str, int]]) -> None:
    """fleet_replicas{tier,version,state} from counts per version and state; a version no longer
    running is removed, not left at its last count (versions come and go with promotions)."""
    now = {(v, s) for v, states in by_version.items() for s in states}
    for v, s in _replica_series.get(tier, set()) - now:
        REPLICAS.remove(tier, v, s)
    for v, states in by_version.items():
        for s, n in states.items():
            REPLICAS.labels(tier, v, s).set(n)
    _replica_series[tier] = now


def observe_cold_start(tier: str, phases: ColdStartPhases | None) -> None:
    """A replica's cold start into fleet_cold_start_phase_seconds, once, when its engine told the phases."""
    if phases is None:
        return
    for phase in PHASES:
        COLD_START_PHASE.labels(tier, phase).observe(phases.seconds(phase))


def children_kept(*families: MetricWrapperBase) -> None:
    """`labels(...)` of each family answered from a dict of the children it made. prometheus_client
    checks and joins the label values and takes a lock on every call; a call through the gateway
    labels about eight series (its outcome, deadline source, latency, tokens ...), which cost about
    a twentieth of the gateway's CPU a call. Only for families whose series are never removed (the
    cache would hand back a removed child) and only for positional values, as every caller here
    passes them."""
    for family in families:
        made: dict[tuple[Any, ...], Any] = {}
        plain = family.labels

        def labels(*values: Any, _made: dict[tuple[Any, ...], Any] = made, _plain: Any = plain,
                   **named: Any) -> Any:
            if named:
                return _plain(*values, **named)
            child = _made.get(values)
            if child is None:
                child = _made[values] = _plain(*values)
            return child

        family.labels = labels  # type: ignore[method-assign,assignment]


# The families labelled on every call (gateway and worker): none of their series is ever removed.
children_kept(REQUESTS, RETRIES, DEADLINES, SHED, DEGRADED, TTFT, TPOT, LATENCY, QUEUE_WAIT, TOKENS,
              ENQUEUE_UNREPLICATED, PREEMPTIONS)
