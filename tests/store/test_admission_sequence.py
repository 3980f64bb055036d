"""The gateway's admission sequence on a real Redis, without HTTP: concurrent admissions see each
other, and every reservation is released when a later step refuses or the request does not complete."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import pytest
from redis.asyncio import Redis

from fleet.config import FleetConfig, Priority, load_config
from fleet.policy import ObservedReplica, Replicas, tier_capacity
from fleet.policy.client_clock import CallClock
from fleet.store.keys import ApiKeyKeys
from fleet.store.line import Line
from gateway.admission import Admission, AdmissionRequest, TierView, Usage, refusal
from gateway.auth import Caller
from gateway.errors import APIError
from tests.paths import TESTS

CONFIG = TESTS / "fleet-admission.yaml"


@dataclass
class Env:
    cfg: FleetConfig
    redis: Redis
    lines: dict[str, Line]
    adm: Admission
    released: list[str] = field(default_factory=list)


@pytest.fixture
async def env(redis_url: str):
    cfg = load_config(CONFIG, namespace=f"t{uuid.uuid4().hex[:8]}")
    r = Redis.from_url(redis_url, max_connections=256)
    lines = {t: Line(r, cfg.namespace, t, result_ttl_s=30, rate_window_s=cfg.rate_window_s) for t in cfg.tiers}
    adm = Admission(cfg, r, lines)
    # One ready replica of `slow` (about 9 requests/s); no worker runs, so nothing drains.
    adm.views["slow"] = TierView(tier_capacity(cfg.tiers["slow"], startup_s=0.2),
                                 Replicas.of([ObservedReplica("slow-1", "ready", 4, 0, 0.0)]))
    yield Env(cfg, r, lines, adm)
    await r.aclose()


def _req(env: Env, priority: Priority, *, tier: str = "slow", key: str = "agent",
         deadline_ms: int = 30_000) -> AdmissionRequest:
    k = next(k for k in env.cfg.keys if k.name == key)
    return AdmissionRequest(rid=uuid.uuid4().hex, caller=Caller(k), tier=tier, priority=priority,
                            deadline_ms=deadline_ms, clock=CallClock(deadline_ms, "header", deadline_ms),
                            prompt_tokens=8, max_tokens=10, expected_output_tokens=10)


async def _try(env: Env, req: AdmissionRequest) -> APIError | None:
    try:
        t = await env.adm.admit(req)
    except APIError as e:
        return e
    await t.enqueue(env.lines[req.tier], b"{}")
    return None


async def test_a_concurrent_burst_is_judged_as_if_in_turn(env: Env) -> None:
    # Background on `slow`: the replica's 2 free slots start 2 at once, then a 1.5 s limit on the
    # wait in line at ~9.1/s -> 14 more fit (0..13 ahead of them). Forty at once must not all read
    # the same empty line.
    got = await asyncio.gather(*(_try(env, _req(env, Priority.background)) for _ in range(40)))
    admitted = sum(e is None for e in got)
    assert 14 <= admitted <= 17, admitted
    snap = await env.lines["slow"].observe()
    assert snap.by_class[Priority.background] == admitted
    refused = [e for e in got if e is not None]
    assert all(e.status == 429 and e.code == "drain_exceeded" and e.type == "at_capacity" for e in refused)
    assert all(int(e.headers["Retry-After"]) == e.extra["retry_after_s"] >= 1 for e in refused)
    # The "being admitted" marks are gone: only the line counts now.
    assert await env.redis.zcard(env.adm.keys["slow"].admitting) == 0
    # A committed call has none of that ahead of it.
    assert await _try(env, _req(env, Priority.committed)) is None


async def test_refusal_by_the_tier_releases_the_rate_window(env: Env) -> None:
    window = ApiKeyKeys(env.cfg.namespace, "limited").window
    for _ in range(20):  # fill the line so the next background call is refused by the tier
        await _try(env, _req(env, Priority.background))
    e = await _try(env, _req(env, Priority.background, key="limited"))
    assert e is not None and e.code == "drain_exceeded"
    counts = [int(v) for k, v in (await env.redis.hgetall(window)).items() if k.startswith(b"r:")]
    assert sum(counts) == 0  # taken by the rate-limit step, given back when the tier refused


async def test_a_refusing_step_releases_what_earlier_steps_took(env: Env) -> None:
    # The shape the per-key dollar budget step (issue 4) will have: it runs after the rate limit.
    @dataclass
    class Held:
        log: list[str]
        name: str

        async def settle(self, usage: Usage) -> None:
            self.log.append(f"settle {self.name} {usage.total}")

        async def release(self) -> None:
            self.log.append(f"release {self.name}")

    log: list[str] = []

    class Hold:
        name = "hold"

        async def reserve(self, req: AdmissionRequest) -> Held:
            return Held(log, "hold")

    class Refuse:
        name = "refuse"

        async def reserve(self, req: AdmissionRequest) -> None:
            raise refusal("key_budget_exhausted", "the key's budget is spent", req, 30)

    env.adm.steps = [*env.adm.steps, Hold(), Refuse()]
    e = await _try(env, _req(env, Priority.interactive, key="limited"))
    assert e is not None and e.code == "key_budget_exhausted" and e.headers["Retry-After"] == "30"
    assert log == ["release hold"]
    window = ApiKeyKeys(env.cfg.namespace, "limited").window
    assert sum(int(v) for k, v in (await env.redis.hgetall(window)).items() if k.startswith(b"r:")) == 0

    env.adm.steps = env.adm.steps[:-1]
    t = await env.adm.admit(_req(env, Priority.interactive, key="limited"))
    await t.close("completed", Usage(5, 7))
    await t.close("cancelled")  # a second end does nothing
    t = await env.adm.admit(_req(env, Priority.interactive, key="limited"))
    await t.close("expired")
    assert log == ["release hold", "settle hold 12", "release hold"]


async def test_budget_state_refuses_below_committed(env: Env) -> None:
    now, _ = await env.redis.time()
    await env.redis.hset(env.adm.keys["fast"].budget, mapping={"exhausted": "1", "retry_at": now + 20})
    env.adm.views["fast"] = TierView(tier_capacity(env.cfg.tiers["fast"], startup_s=0.2),
                                    Replicas.of([ObservedReplica("fast-1", "ready", 4, 0, 0.0)]))
    e = await _try(env, _req(env, Priority.speculative, tier="fast"))
    assert e is not None and e.code == "budget_exhausted" and 19 <= e.extra["retry_after_s"] <= 21
    assert await _try(env, _req(env, Priority.committed, tier="fast")) is None
