"""Redis gone: the gateway answers a typed 503 with Retry-After, never a 500, and comes back with it."""

from __future__ import annotations

import subprocess
import sys

import httpx

from fleet.redis_server import PrivateRedis, free_port
from tests.harness import ROOT, Fleet, wait_until

BODY = {"model": "routing", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def test_gateway_says_503_while_redis_is_down(redis_url: str) -> None:
    own = PrivateRedis().start()  # a Redis of this test's own, to stop under the gateway
    f = Fleet(own.url)
    port = free_port()
    gw = subprocess.Popen([sys.executable, "-m", "fleetctl", "gateway", "--port", str(port)], env=f.env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ok(f"{base}/readyz"), 30, what="gateway ready")
        own.stop()
        r = httpx.post(f"{base}/v1/chat/completions", json=BODY, timeout=30)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "redis_unavailable"
        assert r.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 503
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200  # the process itself is fine
        back = PrivateRedis(port=own.port).start()  # Redis returns on the same address
        try:
            wait_until(lambda: _ok(f"{base}/readyz"), 30, what="gateway ready again")
            r = httpx.post(f"{base}/v1/chat/completions", json={**BODY}, timeout=30,
                           headers={"x-deadline-ms": "300"})
            assert r.status_code == 504  # admitted and queued again (no worker here), not a 503
        finally:
            back.stop()
    finally:
        gw.terminate()
        gw.wait(15)
        own.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
