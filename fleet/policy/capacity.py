"""Capacity math: the autoscaling exercise and the meters. Pure; no I/O.

The base functions keep the exact names and meanings of the autoscaling
exercise (written out in docs/architecture.md, "What the policy keeps from its
sources"); the tier decision, admission and budget governor
build on them.
"""

from __future__ import annotations

import math

# --- The autoscaling exercise (docs/architecture.md) ---------------------------


def startup_seconds(weight_bytes: float, load_bytes_per_s: float, warmup_s: float) -> float:
    """Seconds before a new replica serves: weights load plus warm-up."""
    return weight_bytes / load_bytes_per_s + warmup_s


def backlog_during_startup(arrival_rate: float, capacity: float, startup_s: float) -> float:
    """Requests that pile up while new capacity starts."""
    return max(0.0, arrival_rate - capacity) * startup_s


def replicas_for(arrival_rate: float, per_replica_rate: float, headroom: float = 0.0) -> int:
    """Replicas to serve an arrival rate; at least one."""
    return max(1, math.ceil(arrival_rate * (1 + headroom) / per_replica_rate))


def decide(
    queue_len: int,
    ready: int,
    starting: int,
    arrival_rate: float,
    per_replica_rate: float,
    min_replicas: int = 1,
    max_replicas: int = 10,
) -> int:
    """Replicas to add (> 0), remove (< 0) or 0.

    Counts replicas already starting so a need is never ordered twice; removes
    one at a time, only with an empty line and nothing starting.
    """
    needed = replicas_for(arrival_rate, per_replica_rate)
    have = ready + starting
    if needed > have:
        return max(0, min(needed, max_replicas) - have)
    if needed < ready and queue_len == 0 and starting == 0 and ready > min_replicas:
        return -1
    return 0


def cost_per_million_tokens(hourly_cost: float, useful_tokens_per_s: float) -> float:
    """C = 1e6 * H / (3600 * r): dollars per million useful tokens."""
    if useful_tokens_per_s <= 0:
        return math.inf
    return 1e6 * hourly_cost / (3600 * useful_tokens_per_s)


def littles_law(arrival_rate: float, time_in_system_s: float) -> float:
    """L = lambda * W: steady concurrency of a stable system."""
    return arrival_rate * time_in_system_s


def decode_step_s(base_s: float, per_seq_s: float, batch: int) -> float:
    """One decode step for a batch: a fixed cost plus a per-sequence cost, so time per
    output token grows with the batch (the throughput-latency trade)."""
    return base_s + per_seq_s * max(1, batch)


# --- Meters -------------------------------------------------------------------


def rate(events_in_window: int, window_s: float, observed_for_s: float | None = None) -> float:
    """Events per second over a sliding window.

    A part that has been watching for less than the window divides by what it
    saw, so a tier that just started does not read as four times too slow.
    """
    span = window_s if observed_for_s is None else max(1.0, min(window_s, observed_for_s))
    return events_in_window / span


def seconds_to_drain(waiting: int, service_rate: float) -> float:
    """The scaling signal: requests in line / served requests per second."""
    if waiting <= 0:
        return 0.0
    if service_rate <= 0:
        return math.inf
    return waiting / service_rate
