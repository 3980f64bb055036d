"""API keys: hashed, constant-time compared, tiers and classes per key, the admin guard."""

from __future__ import annotations

import hashlib
import logging

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from fleet.config import ApiKey, ConfigError, Priority, load_config
from gateway.auth import Caller, KeyRing, require_admin
from gateway.errors import APIError, api_error_handler


def _key(secret: str, **kw) -> ApiKey:  # type: ignore[no-untyped-def]
    return ApiKey(name=secret, sha256=hashlib.sha256(secret.encode()).hexdigest(), **kw)


RING = KeyRing([_key("sk-a"), _key("sk-spec", tiers=["routing"], default_priority="speculative",
                                   max_priority="speculative"), _key("sk-root", admin=True)])


def _status(fn, *a) -> tuple[int, str | None]:  # type: ignore[no-untyped-def]
    try:
        fn(*a)
    except APIError as e:
        return e.status, e.code
    return 200, None


def test_bearer_key_is_found_by_its_hash() -> None:
    assert RING.authenticate("Bearer sk-a").name == "sk-a"
    assert RING.authenticate("bearer   sk-root").admin
    for header in (None, "", "Bearer", "Bearer sk-nope", "Basic sk-a", "sk-a"):
        assert _status(RING.authenticate, header) == (401, "invalid_api_key"), header


def test_key_classes_and_tiers() -> None:
    spec = RING.authenticate("Bearer sk-spec")
    assert spec.priority(None, "interactive") == Priority.speculative  # the key's default class
    assert spec.priority("background", "interactive") == Priority.background  # lower is fine
    assert _status(spec.priority, "committed", "interactive") == (403, "priority_not_allowed")
    assert _status(spec.priority, "urgent", "interactive") == (400, "invalid_priority")
    spec.check_tier("routing")
    assert _status(spec.check_tier, "planner") == (403, "tier_not_allowed")
    anyone = RING.authenticate("Bearer sk-a")
    anyone.check_tier("planner")
    assert anyone.priority("committed", "interactive") == Priority.committed and not anyone.admin


def test_open_gateway_lets_everyone_through_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(None)
    with caplog.at_level(logging.WARNING, logger="fleet.gateway.auth"):
        ring = KeyRing.from_config(cfg.model_copy(update={"keys": []}))
    assert ring.open and "OPEN" in caplog.text
    c = ring.authenticate(None)
    assert c == Caller(None) and c.admin and c.priority(None, "background") == Priority.background


def test_a_clear_text_key_in_the_config_is_refused_by_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "f.yaml"
    p.write_text("tiers: {routing: {}}\nkeys: [{name: a, sha256: sk-my-secret}]\n")
    with pytest.raises(ConfigError, match=r"keys\.0\.sha256"):
        load_config(p)


def test_require_admin_guards_fleet_control() -> None:
    app = FastAPI()
    app.add_exception_handler(APIError, api_error_handler)
    app.state.keyring = RING

    @app.post("/v1/fleet/prewarm")
    def prewarm(caller: Caller = Depends(require_admin)) -> dict[str, str]:  # noqa: B008
        return {"by": caller.name}

    c = TestClient(app)
    assert c.post("/v1/fleet/prewarm", headers={"authorization": "Bearer sk-root"}).json() == {"by": "sk-root"}
    r = c.post("/v1/fleet/prewarm", headers={"authorization": "Bearer sk-a"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    r = c.post("/v1/fleet/prewarm")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    app.state.keyring = KeyRing([])
    assert c.post("/v1/fleet/prewarm").json() == {"by": "open"}
