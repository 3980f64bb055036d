"""No accepted call lost in silence, and orphans that survive their gateway (issue 24).

- A call whose request vanished from Redis (here a flush; a failover is in test_cluster_line.py)
  is told at once with a typed 503 `request_lost`, not left to wait for its deadline.
- Calls told 503 while Redis was away are recorded in Redis with the gateway process that
  answers for them: a gateway killed during the outage and started again still ends them
  (`unavailable`) once Redis is back, and no worker serves them for nobody.

Each test runs on a Redis of its own (to flush, or to stop and start again on its data)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from fleet.redis_server import PrivateRedis
from fleet.store.callers import GRACE_MS, LEASE_MS
from tests.harness import Fleet, wait_until

DEADLINE_MS = 60_000  # far longer than any wait here: a caller left to its deadline would show


class Calls:
    """Calls to the routing tier from threads; what each caller got, and when."""

    def __init__(self, f: Fleet) -> None:
        self.f = f
        self.got: list[tuple[int, dict, float]] = []  # (status, error or {}, seconds)
        self.threads: list[threading.Thread] = []

    def start(self, n: int, *, stream: bool = False) -> None:
        for _ in range(n):
            t = threading.Thread(target=self._one, args=(stream,))
            t.start()
            self.threads.append(t)

    def _one(self, stream: bool) -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{self.f.base_url}/v1/chat/completions", timeout=DEADLINE_MS / 1000 + 10,
                       headers={"x-deadline-ms": str(DEADLINE_MS)},
                       json={"model": "routing", "max_tokens": 4, "stream": stream,
                             "messages": [{"role": "user", "content": "hold on"}]})
        err = orjson.loads(r.content).get("error", {}) if r.status_code != 200 else {}
        self.got.append((r.status_code, err, time.monotonic() - t0))

    def join(self) -> None:
        for t in self.threads:
            t.join(DEADLINE_MS / 1000 + 20)
        assert not any(t.is_alive() for t in self.threads), "a caller hung"


@pytest.fixture
def own_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis(persist=True).start()
    yield server
    server.stop()


def test_a_call_whose_request_vanished_is_told_at_once_with_a_typed_503(own_redis: PrivateRedis) -> None:
    f = Fleet(own_redis.url)
    try:
        f.start_gateway()  # no worker: the calls wait in the line
        calls = Calls(f)
        calls.start(2)
        calls.start(1, stream=True)
        wait_until(lambda: f.r.zcard(f.keys("routing").line) == 3, 20, what="three calls in the line")
        f.r.flushall()  # as a failover that lost the old master's last writes would, for these three
        t0 = time.monotonic()
        calls.join()
        told_within = time.monotonic() - t0
    finally:
        f.stop()
    assert [(s, e.get("code"), e.get("type")) for s, e, _ in calls.got] == [
        (503, "request_lost", "service_unavailable")] * 3, calls.got
    assert told_within < 5, f"the callers waited {told_within:.1f} s after their requests vanished"


def test_calls_told_503_are_ended_by_a_gateway_restarted_during_the_outage(own_redis: PrivateRedis) -> None:
    f = Fleet(own_redis.url)
    try:
        first = f.start_gateway().procs[-1]
        calls = Calls(f)
        calls.start(3)
        k = f.keys("routing")
        wait_until(lambda: f.r.zcard(k.line) == 3, 20, what="three calls in the line (no worker yet)")
        rids = [r.decode() for r in f.r.zrange(k.line, 0, -1)]
        own_redis.stop(keep_data=True)  # the outage: every write so far is on disk
        calls.join()
        assert [(s, e.get("code")) for s, e, _ in calls.got] == [(503, "redis_unavailable")] * 3, calls.got
        first.send_signal(signal.SIGKILL)  # the gateway that told them 503 dies, its memory with it
        first.wait(10)
        f._r = None  # the test's own client reconnects to the restarted server
        own_redis.start()  # Redis back, on its data: the three requests queued again
        assert sorted(r.decode() for r in f.r.zrange(k.line, 0, -1)) == sorted(rids)
        f.start_gateway()  # the gateway restarted: a new process
        wait_until(lambda: all(f.r.hget(k.request(r), "outcome") == b"unavailable" for r in rids),
                   (LEASE_MS + GRACE_MS) / 1000 + 15, what="the orphans ended by the restarted gateway",
                   why=lambda: {r: f.r.hget(k.request(r), "state") for r in rids})
        assert f.r.zcard(k.line) == 0 and f.r.zcard(k.inflight) == 0
        # The dead gateway's record went with its last call: only the living one is left.
        assert len(f.r.hkeys(k.callers)) == 1, f.r.hgetall(k.callers)
        f.start_worker("routing")  # ready: it found nothing to serve for nobody
        assert f.r.zcard(k.line) == 0
        counters = f.counters("routing")
        assert counters.get("completed", 0) == 0 and counters["unavailable"] == 3, counters
    finally:
        f.stop()
