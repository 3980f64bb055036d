"""A frozen Redis (SIGSTOP: connections open, nothing answers) must not hang the fleet.

Before issue 12 `/readyz` said 200 after 8 s, a call with `X-Deadline-Ms: 1000` answered after
8 s, and requests whose callers had been told 503 were served once Redis woke up.
"""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.chaos import Seen, call, own_fleet, status
from tests.harness import wait_until

TIER = "routing"


def outcomes_metric(base: str) -> dict[str, float]:
    """fleet_requests_total by outcome (all tiers and classes), as the gateway's /metrics says."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "fleet_requests_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
    return out


def test_readyz_and_deadlines_hold_while_redis_is_frozen_and_told_503_is_never_served() -> None:
    with own_fleet() as own:
        f = own.fleet
        k = f.keys(TIER)
        # A call that joins the line (no worker serves this tier) and waits there, deadline far off.
        waiting: list[Seen] = []
        t = threading.Thread(target=lambda: waiting.append(
            call(own.base, stream=False, max_tokens=4, deadline_ms=60_000)))
        t.start()
        wait_until(lambda: f.r.zcard(k.line) == 1, 20, what="the call in the line")
        with own.frozen():
            t0 = time.monotonic()
            assert status(f"{own.base}/readyz", timeout=10) == 503
            assert time.monotonic() - t0 < 2.0, "readyz must tell within about a second"
            s = call(own.base, stream=False, max_tokens=4, deadline_ms=1000, timeout_s=30)
            assert s.outcome == "unavailable", s
            assert s.elapsed_s < 1.0 + 3.0, f"a 1 s deadline answered after {s.elapsed_s:.1f} s"
            t0 = time.monotonic()
            r = httpx.get(f"{own.base}/v1/fleet/status", timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable", r.text
            assert httpx.get(f"{own.base}/metrics", timeout=30).status_code == 200  # gauges stale, not hung
            assert time.monotonic() - t0 < 3.0 + 2.0 + 2.0
            t.join(30)  # the waiting call's read has no answer either: told 503, not left hanging
            assert waiting and waiting[0].outcome == "unavailable", waiting
            assert waiting[0].elapsed_s < 30
        # Redis is back: the call whose caller was told 503 leaves the line instead of being served.
        wait_until(lambda: f.counters(TIER).get("unavailable") == 1, 20, what="the orphan ended in the line")
        assert f.r.zcard(k.line) == 0
        assert f.counters(TIER)["accepted"] == 1 and "completed" not in f.counters(TIER)
        wait_until(lambda: status(f"{own.base}/readyz") == 200, 20, what="ready again, nothing restarted")
        assert own.gateway.poll() is None
        # Every response is counted, the 503s included (one never reached the line).
        assert outcomes_metric(own.base).get("unavailable") == 2


def test_chaos_freeze_under_load() -> None:
    """Redis frozen for a few seconds under mixed load (streams and not): no call hangs past its
    deadline, every answer is typed, the fleet recovers with nothing restarted, and the outcomes
    the callers saw, Prometheus and Redis's counters all agree."""
    with own_fleet() as own:
        f = own.fleet
        worker = f.start_worker(TIER)
        seen: list[Seen] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client(i: int) -> None:
            n = 0
            while not stop.is_set() and n < 60:  # bounded in count and in time
                s = call(own.base, stream=i % 2 == 0, max_tokens=40 if i % 2 else 200, deadline_ms=2000)
                with lock:
                    seen.append(s)
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: sum(s.outcome == "completed" for s in seen) >= 6, 60, what="load flowing")
            with own.frozen():
                frozen_at = len(seen)
                time.sleep(3.0)  # the outage itself: what is measured is how the fleet answers through it
            wait_until(lambda: sum(s.outcome == "completed" for s in seen[frozen_at:]) >= 6, 60,
                       what="calls completing again after the thaw")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        # No hang: every call answered within its deadline and the gateway's grace (plus a loaded box).
        slow = [s for s in seen if s.elapsed_s > s.deadline_ms / 1000 + 4.0]
        assert not slow, slow[:3]
        # Typed answers only: completed, expired (504), unavailable (503 or a stream's error event), shed.
        odd = [s for s in seen if s.outcome not in ("completed", "expired", "unavailable", "shed")]
        assert not odd, odd[:3]
        assert any(s.outcome == "unavailable" for s in seen[frozen_at:]), "the freeze was never noticed"
        # Recovered with nothing restarted.
        assert own.gateway.poll() is None and f.workers[worker].poll() is None
        # Counters reconcile once the orphans are ended in the line.
        told: dict[str, int] = {}
        for s in seen:
            told[s.outcome] = told.get(s.outcome, 0) + 1

        def settled() -> bool:
            c = f.counters(TIER)
            return c.get("accepted", 0) == sum(c.get(o, 0) for o in ("completed", "expired", "cancelled",
                                                                       "failed", "unavailable"))

        wait_until(settled, 30, what="every accepted request ended in the line")
        metric = outcomes_metric(own.base)
        redis_counts = f.counters(TIER)
        print(f"callers saw {told}; Redis counted {redis_counts}")
        for outcome in ("completed", "expired", "shed"):
            assert metric.get(outcome, 0) == told.get(outcome, 0), (outcome, metric, told)
        assert metric.get("unavailable", 0) == told.get("unavailable", 0), (metric, told)
        for outcome in ("completed", "expired", "cancelled", "failed"):
            assert redis_counts.get(outcome, 0) == metric.get(outcome, 0), (outcome, redis_counts, metric)
        # Told 503 before joining the line is in the metric only; after joining, in both.
        assert redis_counts.get("unavailable", 0) <= metric.get("unavailable", 0)

