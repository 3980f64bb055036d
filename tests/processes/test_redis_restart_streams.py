"""Chaos: Redis restarted under streaming load. Every open stream ends the documented way, a final
`error` event (`service_unavailable`) and then `data: [DONE]`, with no unhandled error in the
gateway; the fleet then serves again with nothing restarted but Redis.

Before issue 12 every in-flight stream was cut ("peer closed connection without sending complete
message body") and the gateway logged an unhandled ConnectionError in the ASGI app.
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson

from fleet.redis_server import PrivateRedis
from tests.chaos import call, own_fleet, status
from tests.harness import wait_until

BODY = {"model": "routing", "messages": [{"role": "user", "content": "AAPL beats"}], "max_tokens": 4000,
        "stream": True, "ignore_eos": True}  # all 4000: still streaming when Redis goes
STREAMS = 4


def test_chaos_redis_restart_under_streaming_load() -> None:
    with own_fleet() as own:
        f = own.fleet
        worker = f.start_worker("routing")
        chunks = [0] * STREAMS
        ends: list[list[bytes]] = [[] for _ in range(STREAMS)]
        errors: list[str] = []

        def stream(i: int) -> None:
            try:
                with httpx.stream("POST", f"{own.base}/v1/chat/completions", json=BODY, timeout=60,
                                  headers={"x-deadline-ms": "60000"}) as r:
                    assert r.status_code == 200
                    for ln in r.iter_lines():
                        if ln.startswith("data: "):
                            chunks[i] += 1
                            ends[i] = [*ends[i][-1:], ln[6:].encode()]
            except Exception as e:  # a cut stream: what this test exists to catch
                errors.append(repr(e))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        wait_until(lambda: all(c >= 3 for c in chunks), 60, what="every stream flowing")
        own.redis.stop()  # Redis gone under the open streams
        try:
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "a stream hung after Redis went away"
            assert not errors, errors
            for i in range(STREAMS):
                assert ends[i][-1] == b"[DONE]", ends[i]
                err = orjson.loads(ends[i][-2])["error"]
                assert err["type"] == "service_unavailable" and err["code"] == "redis_unavailable", err
        finally:
            back = PrivateRedis(port=own.redis.port).start()  # the same address, empty (nothing persisted)
            own.redis = back
        t0 = time.monotonic()
        wait_until(lambda: status(f"{own.base}/readyz") == 200, 30, what="gateway ready again")
        wait_until(lambda: call(own.base, stream=True, max_tokens=8, deadline_ms=10_000).outcome == "completed",
                   60, what="a stream served again")
        assert own.gateway.poll() is None and f.workers[worker].poll() is None  # nothing else restarted
        print(f"served again {time.monotonic() - t0:.1f} s after Redis came back")
        log = own.gateway_log()
        # The loops that tick in the background log their failed ticks; no request errs unhandled.
        assert "Exception in ASGI application" not in log
        assert "Task exception was never retrieved" not in log
