"""Prometheus metrics after real traffic: the gateway's /metrics and a worker's metrics port."""

from __future__ import annotations

import threading
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.config import CLASSES
from fleet.redis_server import free_port
from tests.harness import Fleet, wait_until

TIERS = ("routing", "analysis", "planner")
# Every label the fleet's metrics may carry; each has a config- or code-bounded set of values.
BOUNDED_LABELS = {"tier", "priority", "state", "outcome", "reason", "kind", "window", "action", "event", "replica",
                  "le", "version", "class", "source", "result",  # versions: those the model registry knows
                  "phase", "term"}  # phase: load, init, first_token; term: load, warmup, total


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] for every sample whose name starts with fleet_."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name.startswith("fleet_"):
                out[s.name].append((s.labels, s.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    hits = [v for lab, v in samples.get(name, []) if all(lab.get(k) == want for k, want in labels.items())]
    assert hits, f"no sample {name}{labels}; have {samples.get(name)}"
    return sum(hits)


def chat(f: Fleet, tier: str, priority: str, max_tokens: int, *, stream: bool, deadline_ms: int = 20000) -> int:
    r = httpx.post(f"{f.base_url}/v1/chat/completions", timeout=30,
                   headers={"x-priority": priority, "x-deadline-ms": str(deadline_ms)},
                   json={"model": tier, "messages": [{"role": "user", "content": "AAPL beats"}],
                         "max_tokens": max_tokens, "stream": stream, "ignore_eos": True})  # tokens are counted
    return r.status_code


@pytest.fixture
def served(fleet: Fleet) -> tuple[Fleet, int]:
    """A gateway, a routing worker with a metrics port, and no planner worker at all."""
    fleet.start_gateway()
    port = free_port()
    fleet.start_worker("routing", "routing-m1", metrics_port=str(port))
    fleet.start_worker("analysis")
    return fleet, port


def test_gateway_metrics_after_traffic(served: tuple[Fleet, int]) -> None:
    f, _ = served
    sent = {"committed": 3, "background": 2}
    for priority, n in sent.items():
        for i in range(n):
            assert chat(f, "routing", priority, 5, stream=bool(i % 2)) == 200
    assert chat(f, "analysis", "interactive", 4, stream=True) == 200

    # Two calls to a tier with no replica wait in its line while we scrape.
    waiting = [threading.Thread(target=chat, args=(f, "planner", "background", 3),
                                kwargs={"stream": False, "deadline_ms": 6000}) for _ in range(2)]
    for t in waiting:
        t.start()
    try:
        wait_until(lambda: value(scrape(f"{f.base_url}/metrics"), "fleet_line_length", tier="planner",
                                 priority="background") == 2, 10, what="planner line of 2 in /metrics")
        m = scrape(f"{f.base_url}/metrics")
    finally:
        for t in waiting:
            t.join(30)

    # The caller's view, by class: end-to-end latency and queue wait per request served.
    for priority, n in sent.items():
        assert value(m, "fleet_request_latency_seconds_count", tier="routing", priority=priority) == n
        assert value(m, "fleet_queue_wait_seconds_count", tier="routing", priority=priority) == n
    assert value(m, "fleet_request_latency_seconds_count", tier="analysis", priority="interactive") == 1
    assert value(m, "fleet_request_latency_seconds_sum", tier="routing", priority="committed") > 0
    # TTFT and TPOT as the worker measured them, carried by its done event.
    assert value(m, "fleet_ttft_seconds_count", tier="routing") == 5
    assert value(m, "fleet_tpot_seconds_count", tier="routing") == 5
    assert value(m, "fleet_ttft_seconds_bucket", tier="routing", le="60.0") == 5
    buckets = {lab["le"] for lab, _ in m["fleet_ttft_seconds_bucket"] if lab["tier"] == "routing"}
    assert {"0.005", "60.0", "+Inf"} <= buckets  # resolves a p99 from 5 ms to 60 s
    assert value(m, "fleet_tokens_total", tier="routing", kind="completion") == 25
    assert value(m, "fleet_tokens_total", tier="routing", kind="prompt") > 0

    # The fleet's state, refreshed from Redis at scrape time: every tier and class present.
    for tier in TIERS:
        for cls in CLASSES:
            value(m, "fleet_line_length", tier=tier, priority=cls)
        for state in ("starting", "ready", "draining"):
            value(m, "fleet_replicas", tier=tier, state=state)
        for name in ("fleet_seconds_to_drain", "fleet_oldest_wait_seconds", "fleet_arrival_rate",
                     "fleet_service_rate", "fleet_warm_floor", "fleet_max_replicas", "fleet_drain_threshold_seconds",
                     "fleet_spend_usd_total"):
            value(m, name, tier=tier)
    assert value(m, "fleet_replicas", tier="routing", state="ready") == 1
    assert value(m, "fleet_replicas", tier="routing", version="v1", state="ready") == 1  # the registry's live one
    assert value(m, "fleet_replicas", tier="planner", state="ready") == 0
    assert value(m, "fleet_line_length", tier="routing", priority="committed") == 0
    assert value(m, "fleet_seconds_to_drain", tier="planner") == float("inf")  # a line nothing serves
    assert value(m, "fleet_oldest_wait_seconds", tier="planner") > 0
    assert value(m, "fleet_arrival_rate", tier="routing") > 0
    assert value(m, "fleet_service_rate", tier="routing") > 0
    assert value(m, "fleet_drain_threshold_seconds", tier="routing") == 2.0
    assert value(m, "fleet_max_replicas", tier="planner") == 2

    # Bounded label sets: known label names, tiers from the config only.
    for name, samples in m.items():
        for labels, _ in samples:
            assert set(labels) <= BOUNDED_LABELS, (name, labels)
            assert labels.get("tier", "routing") in TIERS, (name, labels)
            assert labels.get("priority", "committed") in CLASSES, (name, labels)
            assert labels.get("class", "committed") in CLASSES, (name, labels)  # fleet_preemptions_total


def test_worker_metrics_port(served: tuple[Fleet, int]) -> None:
    f, port = served
    for i in range(3):
        assert chat(f, "routing", "interactive", 6, stream=bool(i % 2)) == 200
    url = f"http://127.0.0.1:{port}/metrics"
    m = scrape(url)
    assert value(m, "fleet_ttft_seconds_count", tier="routing") == 3
    assert value(m, "fleet_tpot_seconds_count", tier="routing") == 3
    assert value(m, "fleet_tpot_seconds_sum", tier="routing") > 0
    # Slots come from the config; the heartbeat refreshes them.
    wait_until(lambda: ("fleet_worker_slots" in scrape(url)), 5, what="worker slots gauge")
    assert value(scrape(url), "fleet_worker_slots", tier="routing", replica="routing-m1") == 4
