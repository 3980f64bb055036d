"""Degrade before shedding on a live fleet (sim engine, tests/fleet-degrade.yaml; docs/degrade.md).

The planner's budget is spent ($0 a day): its speculative and background calls are answered by
`analysis`, which names itself in the answer and its headers and bills them (its ledger, the
key's budget at its price); committed calls are untouched; `X-Fleet-Degrade: never`, a key that
forbids it, a pinned alias, and a target that would refuse too all get the planner's refusal,
unchanged."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis.asyncio import Redis

from fleet.store.key_budget import KeyBudget
from tests.harness import ROOT, Fleet, serving, wait_until

CONFIG = Path(__file__).resolve().parent.parent / "fleet-degrade.yaml"
MESSAGES = [{"role": "user", "content": "draft a speculative branch"}]
OPS = {"Authorization": "Bearer sk-ops"}


@pytest.fixture(scope="module")
def fleet(redis_url: str) -> Iterator[Fleet]:
    with serving(redis_url, ("analysis", "planner"), config_path=CONFIG) as f:
        budget = f.keys("planner").budget
        wait_until(lambda: f.r.hget(budget, "exhausted") == b"1", 15, what="the governor's judgement: planner spent")
        yield f


def client(f: Fleet, key: str = "sk-desk") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key=key, max_retries=0)


def ledger_ct(f: Fleet, tier: str, key: str, cls: str) -> int:
    return int(f.r.hget(f.keys(tier).ledger_total, f"k|{key}|{cls}|ct") or 0)


def post(f: Fleet, priority: str, *, key: str = "sk-desk", model: str = "planner", **headers: str) -> httpx.Response:
    return httpx.post(f"{f.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}", "X-Priority": priority, **headers},
                      json={"model": model, "messages": MESSAGES, "max_tokens": 6})


def degraded_total(f: Fleet) -> float:
    """Every call degraded so far, by the gateway's metric."""
    text = httpx.get(f"{f.base_url}/metrics", headers=OPS).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("fleet_degraded_total{"))


def assert_planner_refusal(r: httpx.Response) -> None:
    """The planner's own refusal, as before degrade existed: typed, with its Retry-After."""
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["code"], err["tier"]) == ("budget_exhausted", "planner")
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-should-retry"] == "false"
    assert "x-fleet-degraded-from" not in r.headers


def test_a_speculative_planner_call_is_answered_and_billed_by_analysis(fleet: Fleet) -> None:
    f = fleet
    before_a, before_p = ledger_ct(f, "analysis", "desk", "speculative"), ledger_ct(f, "planner", "desk", "speculative")
    raw = client(f).chat.completions.with_raw_response.create(
        model="planner", messages=MESSAGES, max_tokens=6,  # type: ignore[arg-type]
        tools=[{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}],
        extra_headers={"X-Priority": "speculative"})
    answer = raw.parse()
    assert answer.model == "analysis"  # the tier that served it
    assert raw.headers["x-fleet-tier"] == "analysis" and raw.headers["x-fleet-degraded-from"] == "planner"
    assert raw.headers["x-fleet-degrade-reason"] == "budget_exhausted"
    tokens = answer.usage.completion_tokens if answer.usage else 0
    assert tokens > 0
    # Billed by the tier that served it: its ledger, under the key and class; the planner's not at all.
    wait_until(lambda: ledger_ct(f, "analysis", "desk", "speculative") == before_a + tokens, 10,
               what="analysis's ledger bills the degraded call")
    assert ledger_ct(f, "planner", "desk", "speculative") == before_p
    # Seen: the metric and both tiers' status.
    metrics = httpx.get(f"{f.base_url}/metrics", headers=OPS).text
    assert ('fleet_degraded_total{class="speculative",from="planner",reason="budget_exhausted",to="analysis"}'
            in metrics)
    tiers = httpx.get(f"{f.base_url}/v1/fleet/status", headers=OPS).json()["tiers"]
    wait_until(lambda: httpx.get(f"{f.base_url}/v1/fleet/status", headers=OPS).json()["tiers"]["analysis"]
               ["degraded"]["in"] >= 1, 5, what="status counts the call degraded in")
    assert tiers["planner"]["degraded"]["to"] == "analysis" and tiers["planner"]["degraded"]["out"] >= 1


def test_the_key_pays_the_serving_tiers_price(fleet: Fleet) -> None:
    f = fleet

    async def spent() -> float:
        r = Redis.from_url(f.redis_url)
        try:
            return float((await KeyBudget(r, f.namespace).state(f.cfg.keys[0].sha256))["spent"])
        finally:
            await r.aclose()

    before = asyncio.run(spent())
    r = post(f, "background")
    assert r.status_code == 200 and r.headers["x-fleet-tier"] == "analysis", r.text
    total = r.json()["usage"]["total_tokens"]
    after = asyncio.run(spent())
    # analysis's price ($100 per million), not the planner's ($1000).
    assert after - before == pytest.approx(total * 100 / 1e6, rel=1e-6)


def test_a_stream_says_it_was_degraded_before_its_first_chunk(fleet: Fleet) -> None:
    with client(fleet).chat.completions.with_streaming_response.create(
            model="planner", messages=MESSAGES, max_tokens=6, stream=True,  # type: ignore[arg-type]
            extra_headers={"X-Priority": "speculative"}) as raw:
        assert raw.headers["x-fleet-tier"] == "analysis" and raw.headers["x-fleet-degraded-from"] == "planner"
        models = {chunk.model for chunk in raw.parse()}  # type: ignore[union-attr]
    assert models == {"analysis"}


def test_a_responses_api_call_names_the_serving_tier(fleet: Fleet) -> None:
    raw = client(fleet).responses.with_raw_response.create(model="planner", input="summarise the desk",
                                                           max_output_tokens=16,
                                                           extra_headers={"X-Priority": "background"})
    assert raw.parse().model == "analysis"
    assert raw.headers["x-fleet-degraded-from"] == "planner" and raw.headers["x-fleet-tier"] == "analysis"


def test_committed_is_untouched_and_interactive_is_refused_as_before(fleet: Fleet) -> None:
    r = post(fleet, "committed")
    assert r.status_code == 200 and r.json()["model"] == "planner" and r.headers["x-fleet-tier"] == "planner"
    assert "x-fleet-degraded-from" not in r.headers
    assert_planner_refusal(post(fleet, "interactive"))  # not in the rule's classes


@pytest.mark.parametrize(("key", "model", "headers"), [
    ("sk-desk", "planner", {"X-Fleet-Degrade": "never"}),  # the caller says never
    ("sk-strict", "planner", {"X-Fleet-Degrade": "allow"}),  # its key forbids it, whatever the header
    ("sk-desk", "large", {}),  # a pinned alias
    ("sk-desk", "planner", {"X-Deadline-Ms": "20"}),  # analysis at its own limit (the deadline) refuses too
])
def test_refused_with_the_first_refusal_unchanged(fleet: Fleet, key: str, model: str,
                                                   headers: dict[str, str]) -> None:
    before, degraded = ledger_ct(fleet, "analysis", key.removeprefix("sk-"), "speculative"), degraded_total(fleet)
    assert_planner_refusal(post(fleet, "speculative", key=key, model=model, **headers))
    assert ledger_ct(fleet, "analysis", key.removeprefix("sk-"), "speculative") == before
    assert degraded_total(fleet) == degraded


def test_a_key_at_its_budget_is_not_served_by_the_cheaper_tier(fleet: Fleet) -> None:
    """LiteLLM #41344's shape: a key at its budget limit must not spend through a fallback."""
    r = post(fleet, "speculative", key="sk-broke")
    assert r.status_code == 429 and r.json()["error"]["code"] == "key_budget_exhausted", r.text
    assert ledger_ct(fleet, "analysis", "broke", "speculative") == 0


def test_a_bad_degrade_header_is_a_typed_400(fleet: Fleet) -> None:
    r = post(fleet, "speculative", **{"X-Fleet-Degrade": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_degrade"


def test_a_stored_keys_degrade_default_and_forbid(fleet: Fleet) -> None:
    """`fleet keys add --degrade`: `allow` degrades its interactive calls too (the class list is
    lifted; committed never), `forbid` keeps them refused whatever the header."""
    def add(name: str, degrade: str) -> str:
        got = subprocess.run([sys.executable, "-m", "fleetctl", "keys", "add", name, "--degrade", degrade],
                             env=fleet.env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        return got.stdout.strip()

    eager, never = add("eager", "allow"), add("never-ever", "forbid")
    wait_until(lambda: post(fleet, "interactive", key=eager).status_code != 401, 10, what="the stored key known")
    r = post(fleet, "interactive", key=eager)
    assert r.status_code == 200 and r.headers["x-fleet-degraded-from"] == "planner", r.text
    assert post(fleet, "committed", key=eager).headers["x-fleet-tier"] == "planner"  # committed never degrades
    wait_until(lambda: post(fleet, "speculative", key=never).status_code != 401, 10, what="the stored key known")
    assert_planner_refusal(post(fleet, "speculative", key=never, **{"X-Fleet-Degrade": "allow"}))


def test_a_messages_api_call_names_the_serving_tier(fleet: Fleet) -> None:
    r = httpx.post(f"{fleet.base_url}/v1/messages", timeout=30,
                   headers={"x-api-key": "sk-desk", "anthropic-version": "2023-06-01", "X-Priority": "background"},
                   json={"model": "planner", "max_tokens": 8, "messages": [{"role": "user", "content": "sum up"}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "analysis" and r.headers["x-fleet-degraded-from"] == "planner"


def test_a_degraded_call_longer_than_its_clients_timeout_is_answered_by_its_retry(fleet: Fleet) -> None:
    """The SDK's retry asks the planner again; the call its first attempt left runs in analysis's
    line. The retry takes that call over (its record is kept under the planner, where the retry
    asks) and gets the whole answer, named as analysis's; the engine ran it once."""
    f = fleet
    done = f.counters("analysis").get("completed", 0)
    seen: list[int] = []

    def sent(_: httpx.Request) -> None:
        seen.append(0)

    def got(r: httpx.Response) -> None:
        seen[-1] = r.status_code

    # About 1.6 s of decoding (10 ms a token) behind a 1 s timeout, with the SDK's default retries.
    http = httpx.Client(timeout=1.0, event_hooks={"request": [sent], "response": [got]})
    c = openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="sk-desk", timeout=1.0, http_client=http)
    raw = c.chat.completions.with_raw_response.create(
        model="planner", messages=[{"role": "user", "content": "a long speculative branch"}],  # type: ignore[arg-type]
        max_tokens=160, extra_body={"ignore_eos": True}, extra_headers={"X-Priority": "speculative"})
    answer = raw.parse()
    assert seen[-1] == 200 and seen.count(0) == len(seen) - 1 and len(seen) >= 2, seen  # a retry answered it
    assert answer.usage is not None and answer.usage.completion_tokens == 160
    assert answer.model == "analysis"
    assert raw.headers["x-fleet-tier"] == "analysis" and raw.headers["x-fleet-degraded-from"] == "planner"
    assert raw.headers["x-fleet-degrade-reason"] == "budget_exhausted"
    # Run once, not once an attempt: its owner ends it, counted completed in analysis's line.
    wait_until(lambda: f.counters("analysis").get("completed", 0) >= done + 1, 10, what="the call completed")
    assert f.counters("analysis").get("completed", 0) == done + 1
