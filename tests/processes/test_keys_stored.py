"""API keys added and revoked at run time through Redis (`fleet keys`), without a restart."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.harness import ROOT, Fleet, wait_until

BODY = {"model": "routing", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def _fleet(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetctl", "keys", *args], env=f.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _call(f: Fleet, secret: str | None = None, priority: str | None = None) -> httpx.Response:
    headers = {"x-priority": priority} if priority else {}
    if secret:
        headers["authorization"] = f"Bearer {secret}"
    return httpx.post(f"{f.base_url}/v1/chat/completions", json=BODY, headers=headers, timeout=30)


def test_keys_added_and_revoked_at_run_time(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("routing")
    assert _call(fleet).status_code == 200  # no keys anywhere: open

    add = _fleet(fleet, "add", "scout", "--max-priority", "speculative", "--default-priority", "speculative")
    assert add.returncode == 0, add.stderr
    scout = add.stdout.strip()
    assert scout.startswith("fk-") and len(scout) > 30
    admin = _fleet(fleet, "add", "ops", "--admin").stdout.strip()
    assert scout not in fleet.r.hgetall(f"{fleet.namespace}:apikeys").__repr__()  # only digests are stored

    wait_until(lambda: _call(fleet).status_code == 401, 10, what="the gateway closes once keys exist")
    assert _call(fleet, "fk-wrong").json()["error"]["code"] == "invalid_api_key"
    ok = _call(fleet, scout)  # no X-Priority: the key's default class
    assert ok.status_code == 200 and ok.headers["x-fleet-priority"] == "speculative"
    r = _call(fleet, scout, priority="committed")
    assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"

    listed = _fleet(fleet, "list").stdout
    assert "scout" in listed and "ops" in listed and "fk-" not in listed
    assert _fleet(fleet, "add", "scout").returncode == 2  # names are unique

    assert _fleet(fleet, "revoke", "scout").returncode == 0
    wait_until(lambda: _call(fleet, scout).status_code == 401, 10, what="revoked key refused")
    assert _call(fleet, admin, priority="committed").status_code == 200
    assert _fleet(fleet, "revoke", "nobody").returncode == 1
    # The last key gone (revoked, or Redis lost it): the gateway does not fall open.
    assert _fleet(fleet, "revoke", "ops").returncode == 0
    wait_until(lambda: _call(fleet, admin).status_code == 401, 10, what="revoked admin refused")
    assert _call(fleet).status_code == 401


def test_a_bad_stored_key_is_skipped_not_fatal(fleet: Fleet) -> None:
    fleet.r.hset(f"{fleet.namespace}:apikeys", "00" * 32, b'{"name": "broken"}')
    fleet.start_gateway()
    fleet.start_worker("routing")
    # The broken entry is ignored; with no valid key the gateway still serves (open).
    assert _call(fleet).status_code == 200


def test_keys_add_validates_as_the_config_loader_does(fleet: Fleet) -> None:
    """Before issue 12 these were stored (exit 0), and every call with the key then got a plain 500."""
    for args, field in ((["--max-priority", "urgent"], "--max-priority"), (["--tiers", "nosuchtier"], "--tiers"),
                        (["--default-priority", "soon"], "--default-priority"), (["--rpm", "0"], "--rpm"),
                        (["--max-priority", "background"], "--default-priority")):
        got = _fleet(fleet, "add", "bad", *args)
        assert got.returncode == 2, (args, got.stdout, got.stderr)
        assert field in got.stderr and "Traceback" not in got.stderr, got.stderr
    assert fleet.r.hlen(f"{fleet.namespace}:apikeys") == 0  # nothing was stored


def test_a_stored_record_that_does_not_parse_is_refused_typed(fleet: Fleet) -> None:
    import hashlib

    secret = "fk-stored-by-an-older-fleet"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    # What `keys add --max-priority urgent` stored before issue 12.
    fleet.r.hset(f"{fleet.namespace}:apikeys", digest, b'{"name": "old", "sha256": "' + digest.encode()
                 + b'", "max_priority": "urgent"}')
    assert _fleet(fleet, "add", "ops", "--admin").returncode == 0  # a valid key: the gateway is closed
    fleet.start_gateway()
    fleet.start_worker("routing")
    r = _call(fleet, secret)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "invalid_key_record"
    assert _call(fleet, "fk-never-issued").status_code == 401


def test_keys_add_refuses_a_name_the_config_has(redis_url: str) -> None:
    f = Fleet(redis_url, config_path=ROOT / "tests" / "fleet-admission.yaml")  # has a key named "agent"
    got = _fleet(f, "add", "agent")
    assert got.returncode == 2 and "config has a key named 'agent'" in got.stderr, got.stderr
    assert f.r.hlen(f"{f.namespace}:apikeys") == 0


def test_a_name_added_again_starts_with_fresh_limits(fleet: Fleet) -> None:
    """Limits are kept by the key's digest: a revoked name added again is a new key (issue 12)."""
    fleet.start_gateway()
    fleet.start_worker("routing")
    first = _fleet(fleet, "add", "desk", "--rpm", "1").stdout.strip()
    wait_until(lambda: _call(fleet).status_code == 401, 10, what="the gateway closed: the key is known")
    assert _call(fleet, first).status_code == 200
    r = _call(fleet, first)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert _fleet(fleet, "revoke", "desk").returncode == 0
    second = _fleet(fleet, "add", "desk", "--rpm", "1").stdout.strip()
    wait_until(lambda: _call(fleet, first).status_code == 401, 10, what="the old secret refused")
    r = wait_until(lambda: (got := _call(fleet, second)).status_code != 401 and got, 10, what="the new key known")
    assert r.status_code == 200, r.text  # its own minute, not the old key's
