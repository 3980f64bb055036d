"""The model registry on a real Redis, no processes: seeded once from the config, then the truth;
promote, roll back, the history; refusals typed; one change per record generation however many
writers race; outcomes by version read on from where the reader stopped; the admin API (the
gateway's app in this process). The command (`fleet models|promote|rollback`):
tests/processes/test_model_registry.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from redis.asyncio import Redis

from fleet.config import FleetConfig, load_config
from fleet.store.keys import TierKeys
from fleet.store.model_registry import (
    RegistryError,
    ensure_seeded,
    finish_rollout,
    promote,
    read_history,
    read_record,
    rollback,
    tier_at_version,
)
from tests.paths import TESTS

CONFIG = TESTS / "fleet-rollout.yaml"


TIER = "routing"


def _cfg() -> FleetConfig:
    return load_config(CONFIG, namespace=f"t{uuid.uuid4().hex[:10]}")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_the_config_seeds_the_registry_once_and_afterwards_the_registry_is_the_truth(redis_url: str) -> None:
    cfg = _cfg()
    k = TierKeys(cfg.namespace, TIER)

    async def go() -> None:
        r = Redis.from_url(redis_url)
        rec = await ensure_seeded(r, k, cfg.tiers[TIER])
        assert rec.live == "v1" and rec.previous is None and set(rec.versions) == {"v1", "v2", "v3"}
        # Each version's sim profile is the tier's, with its own differences laid over it.
        assert rec.versions["v1"].sim["decode_step"] == {"base_s": 0.05, "per_seq_s": 0.0}
        assert rec.versions["v2"].sim["decode_step"] == {"base_s": 0.03, "per_seq_s": 0.0}
        assert rec.versions["v2"].sim["warmup_s"] == 0.3 and rec.versions["v2"].sim["weights_gb"] == 1.0
        assert tier_at_version(cfg.tiers[TIER], rec.versions["v3"]).sim.prefill_tokens_per_s == 4

        await promote(r, k, "v2", by="ops", why="faster decode")
        # A restart with the same config (or one naming another version as its own) changes nothing live.
        again = await ensure_seeded(r, k, cfg.tiers[TIER])
        assert again.live == "v2" and again.previous == "v1"
        moved = cfg.tiers[TIER].model_copy(update={"version": "v9"})
        grown = await ensure_seeded(r, k, moved)
        assert grown.live == "v2" and "v9" in grown.versions  # a version it did not know is added, not made live
        actions = [e.action for e in await read_history(r, k)]
        assert actions == ["seed", "promote", "register"]
        await r.aclose()

    run(go())


def test_promote_and_rollback_keep_the_known_good_and_the_history_says_who_when_why(redis_url: str) -> None:
    cfg = _cfg()
    k = TierKeys(cfg.namespace, TIER)

    async def go() -> None:
        r = Redis.from_url(redis_url)
        await ensure_seeded(r, k, cfg.tiers[TIER])
        with pytest.raises(RegistryError) as e:
            await rollback(r, k, by="ops")
        assert e.value.code == "no_previous_version"
        with pytest.raises(RegistryError) as e:
            await promote(r, k, "v7", by="ops")
        assert e.value.code == "version_not_found" and e.value.status == 404 and "v1, v2, v3" in str(e.value)
        with pytest.raises(RegistryError) as e:
            await promote(r, k, "v1", by="ops")
        assert e.value.code == "already_live"

        rec = await promote(r, k, "v2", by="alice", why="new weights", canary=1)
        assert rec.live == "v2" and rec.previous == "v1"
        assert rec.rollout is not None and rec.rollout.rolling and rec.rollout.canary == 1
        assert (rec.rollout.from_version, rec.rollout.to_version) == ("v1", "v2")
        back = await rollback(r, k, by="bob", why="bad answers")
        assert back is not None and back.live == "v1" and back.previous is None
        assert back.rollout is not None and back.rollout.kind == "rollback" and back.rollout.to_version == "v1"
        on_trial = await promote(r, k, "v3", by="alice")
        assert on_trial.previous == "v1"
        # v3 still on trial (not judged): promoting over it keeps v1 as the known-good.
        over = await promote(r, k, "v2", by="carol")
        assert over.live == "v2" and over.previous == "v1"
        to = await rollback(r, k, by="bob", to="v3")
        assert to is not None and to.live == "v3" and to.previous == "v1"  # v1 is still known good

        hist = await read_history(r, k)
        assert [(h.action, h.previous, h.version, h.by) for h in hist] == [
            ("seed", "", "v1", "config"), ("promote", "v1", "v2", "alice"), ("rollback", "v2", "v1", "bob"),
            ("promote", "v1", "v3", "alice"), ("promote", "v3", "v2", "carol"), ("rollback", "v2", "v3", "bob")]
        assert hist[1].why == "new weights" and hist[2].why == "bad answers"
        assert [h.generation for h in hist] == sorted({h.generation for h in hist})  # one generation each
        await r.aclose()

    run(go())


def test_racing_writers_change_the_record_once_per_generation(redis_url: str) -> None:
    """Ten writers finishing one rollout at once: exactly one does it; an automatic rollback of
    a rollout that was already replaced does nothing."""
    cfg = _cfg()
    k = TierKeys(cfg.namespace, TIER)

    async def go() -> None:
        rs = [Redis.from_url(redis_url) for _ in range(10)]
        await ensure_seeded(rs[0], k, cfg.tiers[TIER])
        rec = await promote(rs[0], k, "v2", by="ops")
        assert rec.rollout is not None
        rid = rec.rollout.id
        won = await asyncio.gather(*(finish_rollout(r, k, rid, done=True, by=f"s{i}", why="all at v2")
                                     for i, r in enumerate(rs)))
        assert sum(won) == 1
        judged = await asyncio.gather(*(finish_rollout(r, k, rid, judged=True, by=f"s{i}", why="kept")
                                        for i, r in enumerate(rs)))
        assert sum(judged) == 1
        # Judged: an automatic un-promotion of that rollout is no longer due.
        assert await rollback(rs[0], k, by="scaler", automatic=True, of_rollout=rid) is None
        after = await read_record(rs[0], k)
        assert after is not None and after.live == "v2"
        assert [e.action for e in await read_history(rs[0], k)] == ["seed", "promote", "rollout_done", "judged"]
        for r in rs:
            await r.aclose()

    run(go())


ADMIN = {"authorization": "Bearer sk-admin"}


@pytest.fixture
def api(redis_url: str) -> Iterator[tuple[TestClient, FleetConfig]]:
    from gateway.app import create_app

    cfg = _cfg()
    with TestClient(create_app(cfg, redis_url)) as client:
        yield client, cfg


def test_the_admin_api_reads_and_changes_the_registry_behind_the_admin_key(api: tuple[TestClient, FleetConfig]
                                                                             ) -> None:
    client, _ = api
    assert client.get("/v1/fleet/models").status_code == 401
    r = client.get("/v1/fleet/models", headers={"authorization": "Bearer sk-agent"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    r = client.post(f"/v1/fleet/models/{TIER}/promote", json={"version": "v2"},
                    headers={"authorization": "Bearer sk-agent"})
    assert r.status_code == 403

    r = client.get("/v1/fleet/models", headers=ADMIN)
    assert r.status_code == 200 and [d["live"] for d in r.json()["data"]] == ["v1"]
    r = client.post(f"/v1/fleet/models/{TIER}/promote", json={"version": "v2", "why": "faster"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["live"] == "v2" and r.json()["rollout"]["by"] == "admin"
    r = client.get(f"/v1/fleet/models/{TIER}", headers=ADMIN)
    assert r.json()["live"] == "v2" and r.json()["previous"] == "v1" and r.json()["rollout"]["done_at"] is None

    bad = [
        ("promote", {"version": "v9"}, 404, "version_not_found"),
        ("promote", {"version": "v2"}, 409, "already_live"),
        ("promote", {"version": 2}, 422, None),
        ("promote", {"version": "v3", "canary": 0}, 422, None),
        ("promote", {"version": "v3", "extra": 1}, 422, None),
        ("rollback", {"to": "v9"}, 404, "version_not_found"),
    ]
    for verb, body, status, code in bad:
        r = client.post(f"/v1/fleet/models/{TIER}/{verb}", json=body, headers=ADMIN)
        assert r.status_code == status, (body, r.text)
        assert "error" in r.json() and (code is None or r.json()["error"]["code"] == code), r.text
    r = client.post("/v1/fleet/models/nope/promote", json={"version": "v2"}, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post(f"/v1/fleet/models/{TIER}/promote", content=b"{not json", headers=ADMIN)
    assert r.status_code == 400

    r = client.post(f"/v1/fleet/models/{TIER}/rollback", json={}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["live"] == "v1"
    r = client.get(f"/v1/fleet/models/{TIER}/history?limit=10", headers=ADMIN)
    assert [e["action"] for e in r.json()["data"]] == ["seed", "promote", "rollback"]
    assert r.json()["data"][1]["why"] == "faster"
    r = client.get(f"/v1/fleet/models/{TIER}/history?limit=0", headers=ADMIN)
    assert r.status_code == 422 and "error" in r.json()


def test_outcomes_by_version_are_read_on_from_where_the_reader_stopped(redis_url: str) -> None:
    from fleet.store.version_outcomes import read_outcomes, record_outcome

    cfg = _cfg()
    k = TierKeys(cfg.namespace, TIER)

    async def go() -> None:
        r = Redis.from_url(redis_url)
        t0 = (await r.time())[0] - 1  # the Redis clock stamps the entries
        await record_outcome(r, k, "v1", True, 0.25)
        await record_outcome(r, k, "v2", False, 9.0)
        first, after = await read_outcomes(r, k, since_s=t0)
        assert [(o.version, o.ok, o.ttft_s) for o in first] == [("v1", True, 0.25), ("v2", False, None)]
        assert all(t0 <= o.at <= t0 + 30 for o in first)
        await record_outcome(r, k, "v2", True, 0.5)
        more, after2 = await read_outcomes(r, k, since_s=t0, after=after)
        assert [(o.version, o.ttft_s) for o in more] == [("v2", 0.5)] and after2 != after
        assert await read_outcomes(r, k, since_s=t0, after=after2) == ([], None)
        assert await read_outcomes(r, k, since_s=t0 + 3600) == ([], None)  # nothing that recent
        await r.aclose()

    run(go())
