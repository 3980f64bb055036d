"""Who may read fleet state, the private metrics port, the pre-warm cap, and the published schema,
against real gateways on a real Redis (issue 12, items 9 and 10)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from fleet.redis_server import free_port
from tests.harness import ROOT, TEST_CONFIG, Fleet, wait_until
from tests.processes.test_dashboard import CHROMIUM
from tests.processes.test_hardening_edge import typed

SECRETS = {"user": "sk-user", "reader": "sk-reader", "root": "sk-root"}
GUARDED = ("/v1/fleet/status", "/metrics")


def _config_with_keys(path: Path) -> Path:
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    digest = {n: hashlib.sha256(s.encode()).hexdigest() for n, s in SECRETS.items()}
    cfg["keys"] = [{"name": "user", "sha256": digest["user"]},
                   {"name": "reader", "sha256": digest["reader"], "read_status": True},
                   {"name": "root", "sha256": digest["root"], "admin": True}]
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(f: Fleet, *extra: str) -> tuple[str, int | None]:
    """A gateway of `f` with `extra` args; returns its base URL and its metrics port (if any)."""
    port = free_port()
    metrics = free_port() if "--metrics-port" in extra else None
    args = [a if a != "--metrics-port" else f"--metrics-port={metrics}" for a in extra]
    f.spawn("gateway", "--port", str(port), *args)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get(f"{base}/healthz") == 200, 20, what="gateway up")
    f.port = f.port or port
    return base, metrics


def _get(url: str, key: str | None = None) -> int:
    try:
        return httpx.get(url, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=5).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture(scope="module")
def closed(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str, int]]:
    f = Fleet(redis_url, config_path=_config_with_keys(tmp_path_factory.mktemp("keys") / "fleet.yaml"))
    try:
        base, metrics = start(f, "--metrics-port")
        assert metrics is not None
        yield f, base, metrics
    finally:
        f.stop()


def test_with_keys_fleet_state_needs_an_admin_or_read_status_key(closed: tuple[Fleet, str, int]) -> None:
    _, base, _ = closed
    for path in GUARDED:
        r = httpx.get(f"{base}{path}")
        assert r.status_code == 401 and typed(r.content)["code"] == "invalid_api_key", path
        r = httpx.get(f"{base}{path}", headers={"authorization": f"Bearer {SECRETS['user']}"})
        assert r.status_code == 403 and typed(r.content)["code"] == "read_status_required", path
        assert _get(f"{base}{path}", SECRETS["reader"]) == 200, path
        assert _get(f"{base}{path}", SECRETS["root"]) == 200, path
    status = httpx.get(f"{base}/v1/fleet/status", headers={"authorization": f"Bearer {SECRETS['reader']}"}).json()
    assert set(status["tiers"]) == {"routing", "analysis", "planner"}
    # The page is public (it holds no data); what it reads is not.
    page = httpx.get(f"{base}/dashboard")
    assert page.status_code == 200 and 'id="auth"' in page.text


def test_the_metrics_port_serves_metrics_alone_without_a_key(closed: tuple[Fleet, str, int]) -> None:
    _, _, metrics = closed
    r = httpx.get(f"http://127.0.0.1:{metrics}/metrics")
    assert r.status_code == 200 and "fleet_line_length" in r.text
    for path in ("/v1/fleet/status", "/v1/models", "/dashboard", "/openapi.json"):
        r = httpx.get(f"http://127.0.0.1:{metrics}{path}")
        assert r.status_code == 404 and typed(r.content)["code"] == "not_found", path


def test_fleet_status_cli_sends_its_key(closed: tuple[Fleet, str, int]) -> None:
    f, base, _ = closed

    def cli(key: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fleetctl", "status", "--url", base, "--json"],
                              env={**f.env, "FLEET_API_KEY": key}, cwd=ROOT, capture_output=True, text=True,
                              timeout=60)

    ok = cli(SECRETS["reader"])
    assert ok.returncode == 0 and '"routing"' in ok.stdout, ok.stderr
    refused = cli(SECRETS["user"])
    assert refused.returncode == 1 and "read_status" in refused.stderr


def test_status_auth_modes_and_keys_stored_in_redis(redis_url: str) -> None:
    f = Fleet(redis_url)  # a config with no keys: open ...
    try:
        auto, _ = start(f)
        f.env_overrides["FLEET_GATEWAY__STATUS_AUTH"] = "required"  # two more gateways on the same fleet
        required, _ = start(f)
        f.env_overrides["FLEET_GATEWAY__STATUS_AUTH"] = "open"
        opened, _ = start(f)
        assert _get(f"{auto}/v1/fleet/status") == 200  # open gateway, auto: open
        r = httpx.get(f"{required}/metrics")  # required, and no key exists that could read it
        assert r.status_code == 401 and typed(r.content)["code"] == "invalid_api_key"
        # ... until a key is stored at run time: auto now requires one too, within a heartbeat.
        add = subprocess.run([sys.executable, "-m", "fleetctl", "keys", "add", "ops-reader", "--read-status"],
                             env=f.env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert add.returncode == 0, add.stderr
        secret = add.stdout.strip()
        wait_until(lambda: _get(f"{auto}/v1/fleet/status") == 401, 15, what="auto mode closing")
        assert _get(f"{auto}/v1/fleet/status", secret) == 200
        wait_until(lambda: _get(f"{required}/metrics", secret) == 200, 15, what="required mode with a key")
        assert _get(f"{opened}/v1/fleet/status") == 200 and _get(f"{opened}/metrics") == 200
    finally:
        f.stop()


def test_prewarm_is_capped_by_config_in_open_mode(redis_url: str) -> None:
    f = Fleet(redis_url, env_overrides={"FLEET_GATEWAY__MAX_PREWARM_S": "3600"})
    try:
        base, _ = start(f)
        u = f"{base}/v1/fleet/prewarm"
        r = httpx.post(u, json={"tier": "routing", "floor": 2, "duration_s": 3601})
        assert r.status_code == 422, r.text
        err = typed(r.content)
        assert (err["code"], err["param"]) == ("invalid_value", "duration_s") and "60 min" in err["message"]
        r = httpx.post(u, json={"tier": "routing", "floor": 2, "until": "2999-01-01T00:00:00+00:00"})
        assert r.status_code == 422 and typed(r.content)["param"] == "until"
        r = httpx.post(u, json={"tier": "routing", "floor": 5, "duration_s": 60})  # max_replicas is 4
        assert r.status_code == 422 and typed(r.content)["param"] == "floor"
        r = httpx.post(u, json={"tier": "routing", "floor": "2", "duration_s": 60})  # strict, like the calls
        assert r.status_code == 422 and typed(r.content)["param"] == "floor"
        r = httpx.post(u, json={"tier": "routing", "floor": 2, "duration_s": 3600})
        assert r.status_code == 200 and r.json()["floor"] == 2
    finally:
        f.stop()


def test_openapi_publishes_the_request_models_headers_and_errors(redis_url: str) -> None:
    f = Fleet(redis_url)
    try:
        base, _ = start(f)
        doc = httpx.get(f"{base}/openapi.json").json()
    finally:
        f.stop()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatBody"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["messages"]["maxItems"] == 2048
    assert chat["properties"]["stream"]["type"] == "boolean"
    assert {"prompt", "max_tokens", "stop", "user", "metadata"} <= set(schemas["CompletionBody"]["properties"])
    for path, model in (("/v1/chat/completions", "ChatBody"), ("/v1/completions", "CompletionBody")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        headers = {p["name"]: p["schema"] for p in op["parameters"] if p["in"] == "header"}
        assert headers["X-Priority"]["enum"] == ["committed", "interactive", "speculative", "background"]
        assert headers["X-Chain-Id"]["maxLength"] == 128 and "pattern" in headers["X-Deadline-Ms"]
        assert {"bearer": []} in op["security"]
        for status in ("400", "401", "413", "422", "429", "431", "503", "504"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/fleet/prewarm"]["post"]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make chromium)")
def test_the_dashboard_asks_for_a_key_and_works_with_one(closed: tuple[Fleet, str, int]) -> None:
    from playwright.sync_api import sync_playwright

    from tests.processes.test_dashboard import ARGS

    _, base, _ = closed
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = b.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda e: problems.append(str(e)))
            assert page.goto(f"{base}/dashboard").status == 200  # type: ignore[union-attr]
            page.wait_for_selector("#auth:not([hidden])", timeout=15000)
            assert "needs a key" in (page.text_content("#conn") or "")
            page.fill("#key", SECRETS["user"])  # a key without the right: refused, and asked again
            page.click("#auth button")
            page.wait_for_function("() => document.getElementById('conn').textContent.includes('key refused')",
                                   timeout=15000)
            page.fill("#key", SECRETS["reader"])
            page.click("#auth button")
            for tier in ("routing", "analysis", "planner"):
                page.wait_for_selector(f'section.tier[data-tier="{tier}"]', timeout=15000)
            page.wait_for_function("() => Number(document.body.dataset.updates || 0) >= 2", timeout=15000)
            assert page.is_hidden("#auth") and not problems, problems
        finally:
            b.close()


def test_a_taken_metrics_port_stops_start_up_with_a_message(redis_url: str) -> None:
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "fleetctl", "gateway", "--port", str(port), "--metrics-port",
                        str(port)], env={**os.environ, "REDIS_URL": redis_url, "FLEET_CONFIG": str(TEST_CONFIG)},
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--metrics-port" in r.stderr and "must differ from --port" in r.stderr
