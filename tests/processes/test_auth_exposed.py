"""Closed by default beyond loopback (issue 24): a gateway listening on 0.0.0.0 with no API keys
refuses calls (unless `gateway.open: true`), admin endpoints and fleet state with a typed 401; an
admin key, made on first start or added at run time, opens them. On loopback nothing changes:
`make up` needs no key. The gateways here bind 0.0.0.0; every request goes to 127.0.0.1."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from fleet.store.api_keys import list_stored_keys
from fleet.store.keys import stored_api_keys
from fleetctl.admin_key import SHOWN, ensure_admin_key
from tests.harness import ROOT, Fleet, wait_until
from tests.processes.test_hardening_edge import typed

ADMIN = [("POST", "/v1/fleet/prewarm", {"tier": "routing", "floor": 2, "duration_s": 60}),
         ("POST", "/v1/fleet/models/routing/rollback", {"why": "a stranger"}),
         ("POST", "/v1/fleet/models/routing/promote", {"version": "v1"}),
         ("GET", "/v1/fleet/models", None)]
CALL = {"model": "routing", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
        "ignore_eos": True}  # exactly 3 tokens, as a served call is checked


def _ask(f: Fleet, method: str, path: str, body: object = None, key: str | None = None) -> httpx.Response:
    return httpx.request(method, f"{f.base_url}{path}", json=body, timeout=10,
                         headers={"authorization": f"Bearer {key}"} if key else {})


@pytest.fixture
def exposed(redis_url: str) -> Iterator[Fleet]:
    """A fleet whose gateway listens on 0.0.0.0, with no key in its config; a worker serves routing."""
    f = Fleet(redis_url)
    try:
        f.start_worker("routing")
        yield f
    finally:
        f.stop()


def test_beyond_loopback_with_no_keys_admin_endpoints_calls_and_state_get_a_typed_401(exposed: Fleet) -> None:
    f = exposed.start_gateway("--host", "0.0.0.0")
    for method, path, body in ADMIN:
        r = _ask(f, method, path, body)
        assert r.status_code == 401 and typed(r.content)["code"] == "invalid_api_key", (path, r.text)
        assert "beyond loopback" in typed(r.content)["message"]
    assert f.r.hlen(f.keys("routing").prewarm) == 0  # the pre-warm was not ordered
    r = _ask(f, "POST", "/v1/chat/completions", CALL)
    assert r.status_code == 401 and "gateway.open" in typed(r.content)["message"], r.text
    for path in ("/v1/fleet/status", "/metrics"):
        assert _ask(f, "GET", path).status_code == 401, path
    assert _ask(f, "GET", "/readyz").status_code == 200  # a load balancer's probe needs no key
    assert f.counters("routing").get("accepted", 0) == 0


def test_gateway_open_serves_calls_beyond_loopback_but_never_admin_endpoints(exposed: Fleet) -> None:
    exposed.env_overrides["FLEET_GATEWAY__OPEN"] = "true"
    f = exposed.start_gateway("--host", "0.0.0.0")
    r = _ask(f, "POST", "/v1/chat/completions", CALL)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    for method, path, body in ADMIN:
        assert _ask(f, method, path, body).status_code == 401, path


def test_an_admin_key_added_at_run_time_opens_the_admin_endpoints_beyond_loopback(exposed: Fleet) -> None:
    f = exposed.start_gateway("--host", "0.0.0.0")
    add = subprocess.run([sys.executable, "-m", "fleetctl", "keys", "add", "ops", "--admin"], env=f.env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert add.returncode == 0, add.stderr
    secret = add.stdout.strip()
    wait_until(lambda: _ask(f, "POST", *ADMIN[0][1:], key=secret).status_code == 200, 15,
               what="the stored admin key accepted within a heartbeat")
    assert _ask(f, "POST", *ADMIN[1][1:]).status_code == 401  # and still nothing without it
    assert _ask(f, "POST", "/v1/chat/completions", CALL, key=secret).status_code == 200


def test_on_loopback_a_gateway_with_no_keys_stays_open(exposed: Fleet) -> None:
    f = exposed.start_gateway()  # 127.0.0.1, as `make up`
    assert _ask(f, "POST", *ADMIN[0][1:]).status_code == 200
    assert _ask(f, "POST", "/v1/chat/completions", CALL).status_code == 200


def test_the_first_admin_key_is_made_once_printed_once_and_stored_as_its_digest(
        redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    f = Fleet(redis_url)
    cfg = f.cfg
    monkeypatch.delenv("FLEET_ADMIN_KEY", raising=False)
    ensure_admin_key(cfg, redis_url)
    out = capsys.readouterr().out
    assert SHOWN in out and "Authorization: Bearer" in out
    secret = out.split(SHOWN)[1].split()[0]
    (key,) = list_stored_keys(f.r, cfg.namespace).keys
    assert key.admin and key.sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.encode() not in b"".join(f.r.hgetall(stored_api_keys(cfg.namespace)).values())
    ensure_admin_key(cfg, redis_url)  # a later start: the key exists, nothing is made or shown
    assert capsys.readouterr().out == "" and len(list_stored_keys(f.r, cfg.namespace).keys) == 1

    chosen = Fleet(redis_url)  # another fleet, whose operator chose the secret
    monkeypatch.setenv("FLEET_ADMIN_KEY", "fk-chosen-by-the-operator")
    ensure_admin_key(chosen.cfg, redis_url)
    assert "fk-chosen" not in capsys.readouterr().out
    (key,) = list_stored_keys(chosen.r, chosen.cfg.namespace).keys
    assert key.sha256 == hashlib.sha256(b"fk-chosen-by-the-operator").hexdigest()
