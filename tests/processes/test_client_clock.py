"""The agent's own clock, live: deadlines read from the SDK, refusals it understands, retries joined
to the call still running, the grace, the retry budget (docs/client-clock.md).

One `slow` tier (tests/fleet-clock.yaml): 10 ms a token at any batch, 4 slots, a 3 s grace.
The real `openai` client where the SDK's behaviour is what is tested; raw HTTP with the SDK's
headers where a test must leave at a chosen moment (after some chunks, before the answer).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import orjson
import pytest

from tests.harness import Fleet, wait_until

TIER = "slow"


@pytest.fixture(scope="module")
def fleet(clock_fleet: Fleet) -> Fleet:
    return clock_fleet


def body(tokens: int, text: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": TIER, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "ignore_eos": True, "stream": stream}


def sdk_headers(timeout_s: float, retry: int) -> dict[str, str]:
    """What the openai client sends on an attempt."""
    return {"x-stainless-read-timeout": str(timeout_s), "x-stainless-retry-count": str(retry)}


def counting_client(f: Fleet, timeout_s: float, seen: list[int]) -> openai.OpenAI:
    """The SDK as an agent makes it (default retries), each attempt's status (0: timed out) in `seen`."""

    def sent(_: httpx.Request) -> None:
        seen.append(0)

    def got(r: httpx.Response) -> None:
        seen[-1] = r.status_code

    http = httpx.Client(timeout=timeout_s, event_hooks={"request": [sent], "response": [got]})
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", timeout=timeout_s, http_client=http)


def metric(f: Fleet, name: str, **labels: str) -> float:
    text = httpx.get(f"{f.base_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_call_longer_than_its_clients_timeout_is_answered_by_its_retry(fleet: Fleet) -> None:
    # About 1.6 s of decoding behind a 1 s timeout: the first attempt times out, its retry joins
    # the call still running and gets the whole answer; the engine ran it once.
    before = fleet.counters(TIER).get("completed", 0)
    told = metric(fleet, "fleet_requests_total", tier=TIER, outcome="completed")
    seen: list[int] = []
    c = counting_client(fleet, 1.0, seen)
    r = c.chat.completions.create(model=TIER, messages=[{"role": "user", "content": "long one"}], max_tokens=160,
                                  extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 160
    assert seen[-1] == 200 and seen.count(0) == len(seen) - 1 and len(seen) <= 3, seen
    assert fleet.counters(TIER).get("completed", 0) == before + 1  # run once, not once an attempt
    assert metric(fleet, "fleet_retries_total", tier=TIER, result="joined") >= 1
    # Its owner ends it once, as what the line says: one response counted, completed.
    wait_until(lambda: metric(fleet, "fleet_requests_total", tier=TIER, outcome="completed") == told + 1, 10,
               what="the call counted completed once")


def test_a_streamed_retry_gets_the_stream_from_its_first_chunk(fleet: Fleet) -> None:
    # The first attempt reads 3 chunks and leaves; the retry, sent as the SDK would, reads the
    # call from its first chunk to [DONE], and nothing runs twice.
    b = body(80, "stream me", stream=True)
    before = fleet.counters(TIER).get("completed", 0)
    with httpx.Client(base_url=fleet.base_url, timeout=30) as h:
        with h.stream("POST", "/v1/chat/completions", json=b, headers=sdk_headers(600, 0)) as r:
            assert r.status_code == 200
            first_rid = r.headers["x-request-id"]
            got = 0
            for ln in r.iter_lines():
                got += ln.startswith("data: ")
                if got == 3:
                    break
        wait_until(lambda: metric(fleet, "fleet_retries_total", tier=TIER, result="parked") >= 1, 10,
                   what="the call parked for its retry")
        with h.stream("POST", "/v1/chat/completions", json=b, headers=sdk_headers(600, 1)) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == first_rid
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join((ch["choices"][0]["delta"].get("content") or "") for ch in chunks if ch["choices"])
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"  # from its very first chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(text.split()) >= 70
    wait_until(lambda: fleet.counters(TIER).get("completed", 0) == before + 1, 10, what="the call completed once")


def test_a_parked_call_nobody_takes_is_cancelled_after_the_grace(fleet: Fleet) -> None:
    # A client with retries left leaves and never comes back: the call runs on for the grace
    # (3 s), then is cancelled and its engine work stops.
    before = fleet.counters(TIER).get("cancelled", 0)
    left_at = asyncio.run(_leave_after(fleet, body(1000, "nobody returns"), sdk_headers(600, 0), 0.3))
    wait_until(lambda: fleet.counters(TIER).get("cancelled", 0) == before + 1, 10, what="the call cancelled")
    took = time.monotonic() - left_at
    assert 2.5 <= took <= 8.0, took  # the grace (3 s), give or take a heartbeat and a loaded box
    wait_until(lambda: fleet.r.zcard(fleet.keys(TIER).inflight) == 0, 10, what="the engine's work stopped")


def test_a_last_attempt_that_leaves_is_cancelled_at_once(fleet: Fleet) -> None:
    # Its SDK said this is its last attempt (retry count 2 of 2): no retry will come to take it over.
    before = fleet.counters(TIER).get("cancelled", 0)
    asyncio.run(_leave_after(fleet, body(1000, "last try"), sdk_headers(600, 2), 0.3))
    wait_until(lambda: fleet.counters(TIER).get("cancelled", 0) == before + 1, 2.0,
               what="the call cancelled well within what a grace would have kept it")


def test_what_the_client_would_abandon_is_refused_at_once_and_not_retried(fleet: Fleet) -> None:
    # 3 s of decoding behind a 0.5 s timeout with 2 retries: 1.5 s of patience at most. The SDK is
    # told 429 deadline_unmeetable with x-should-retry false, so it makes one attempt, not three.
    seen: list[int] = []
    c = counting_client(fleet, 0.5, seen)
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=TIER, messages=[{"role": "user", "content": "too long"}], max_tokens=300,
                                  extra_body={"ignore_eos": True})
    assert seen == [429] and time.monotonic() - t0 < 1.0
    err = e.value.response
    assert err.json()["error"]["code"] == "deadline_unmeetable"
    assert err.headers["x-should-retry"] == "false" and int(err.headers["retry-after-ms"]) >= 1000
    assert metric(fleet, "fleet_deadline_source_total", tier=TIER, source="client") >= 1


def test_concurrent_calls_each_with_a_free_slot_are_admitted(fleet: Fleet) -> None:
    # Invariant 8, live: four calls at once on an idle replica of four slots, each with a deadline
    # its own service fits (1 s of decoding, 1.6 s deadline). None waits for another: all served.
    async def call(h: httpx.AsyncClient, i: int) -> int:
        r = await h.post("/v1/chat/completions", json=body(100, f"free slot {i}"),
                         headers={"X-Deadline-Ms": "1600"})
        return r.status_code

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=30) as h:
            return await asyncio.gather(*(call(h, i) for i in range(4)))

    wait_until(lambda: fleet.r.zcard(fleet.keys(TIER).inflight) == 0, 15, what="an idle replica")
    assert asyncio.run(main()) == [200, 200, 200, 200]


def test_an_idempotency_key_with_another_body_is_refused(fleet: Fleet) -> None:
    headers = {"Idempotency-Key": "order-77", **sdk_headers(600, 0)}
    asyncio.run(_leave_after(fleet, body(1000, "first body"), headers, 0.3))
    wait_until(lambda: metric(fleet, "fleet_retries_total", tier=TIER, result="parked") >= 2, 10,
               what="the call parked")
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=body(5, "another body"),
                   headers={**headers, "x-stainless-retry-count": "1"}, timeout=10)
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"


def test_retries_that_join_nothing_are_held_to_the_retry_budget(fleet: Fleet) -> None:
    # min_per_s 0.3 over 10 s: 3 retries fit in the window (an earlier test's may have spent some
    # of them), with few first attempts beside them; the next is refused, typed, and the SDK is
    # told not to retry it.
    codes = []
    for i in range(20):
        r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=body(2, f"retry {i} {time.time()}"),
                       headers=sdk_headers(600, 1), timeout=10)
        codes.append(r.status_code)
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "retry_budget_exhausted" and r.headers["x-should-retry"] == "false"
            break
    assert codes[-1] == 429 and codes.count(200) <= 3, codes
    assert metric(fleet, "fleet_retries_total", tier=TIER, result="budget_refused") >= 1


def test_the_request_record_says_where_its_deadline_came_from(fleet: Fleet) -> None:
    # An SDK's call with no X-Deadline-Ms runs on its client's clock: its record in the line says so.
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=body(2, f"record {time.time()}"),
                   headers=sdk_headers(600, 0), timeout=10)
    assert r.status_code == 200
    src = fleet.r.hget(fleet.keys(TIER).request(r.headers["x-request-id"]), "deadline_source")
    assert src in (b"client", "client"), src
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=body(2, f"record {time.time()}"),
                   headers={"X-Deadline-Ms": "20000"}, timeout=10)
    src = fleet.r.hget(fleet.keys(TIER).request(r.headers["x-request-id"]), "deadline_source")
    assert r.status_code == 200 and src in (b"header", "header"), src


def _oldest_wait_s(f: Fleet) -> float:
    """How long the tier's line has held its oldest waiting call, on the Redis clock."""
    r, k = f.r, f.keys(TIER)
    now_s, now_us = r.time()
    enq = [float(r.hget(k.request(rid.decode() if isinstance(rid, bytes) else rid), "enq") or 0)
           for rid in r.zrange(k.line, 0, -1)]
    return (now_s + now_us / 1e6) - min(enq) / 1000 if enq else 0.0


def _refused_probe(f: Fleet) -> list[str]:
    """The real openai client (0.3 s timeout, its default 2 retries) asks for one token behind a full
    replica and a waiting call: refused, as what its client would abandon. Each attempt's
    `x-should-retry`, as the SDK read it."""
    told: list[str] = []

    def got(r: httpx.Response) -> None:
        told.append(r.headers.get("x-should-retry", "") if r.status_code == 429 else str(r.status_code))

    http = httpx.Client(timeout=0.3, event_hooks={"response": [got]})
    c = openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", timeout=0.3, http_client=http)
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(model=TIER, messages=[{"role": "user", "content": f"probe {time.time()}"}],
                                  max_tokens=1)
    return told


@pytest.mark.parametrize("sustained", [False, True], ids=["short-burst", "sustained-overload"])
def test_under_a_sustained_overload_the_sdk_is_told_not_to_retry(fleet: Fleet, sustained: bool) -> None:
    # Four 8 s calls fill the replica's four slots and a fifth waits. A short burst (the line just
    # filled): the refusal says x-should-retry true, and the SDK retries. A sustained overload (the
    # line has held its call for the whole rate window, 5 s, at least the Retry-After times the
    # caller's retries left): a retry would be refused again, so x-should-retry false, and the SDK
    # makes one attempt. The server counts the refusals.
    k = fleet.keys(TIER)
    wait_until(lambda: fleet.r.zcard(k.inflight) == 0 and fleet.r.zcard(k.line) == 0, 30,
               what="an idle replica and an empty line")

    def refusals() -> float:
        return metric(fleet, "fleet_shed_total", tier=TIER, priority="interactive", reason="deadline_unmeetable")

    async def fill(h: httpx.AsyncClient, i: int) -> None:
        await h.post("/v1/chat/completions", json=body(800, f"fill {i} {time.time()}"), timeout=20)

    async def main() -> tuple[list[str], int]:
        async with httpx.AsyncClient(base_url=fleet.base_url) as h:
            tasks = [asyncio.create_task(fill(h, i)) for i in range(5)]
            try:
                await asyncio.to_thread(wait_until, lambda: fleet.r.zcard(k.inflight) == 4
                                        and fleet.r.zcard(k.line) == 1, 10, what="the line full")
                if sustained:
                    await asyncio.to_thread(wait_until, lambda: _oldest_wait_s(fleet) >= 5.2, 8,
                                            what="the line busy the whole rate window")
                before = refusals()
                told = await asyncio.to_thread(_refused_probe, fleet)
                return told, int(refusals() - before)
            finally:
                for t in tasks:  # hang up: the fill calls are cancelled
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    told, refused = asyncio.run(main())
    assert refused == len(told), (told, refused)  # every attempt reached the server, refused
    if sustained:
        assert told == ["false"]  # one attempt: the SDK obeyed
    else:
        # Told to retry, and it did; once the line has stayed full as long as its patience left
        # (1 s of Retry-After for its last retry), the retry is told false.
        assert told[0] == "true" and len(told) >= 2, told


async def _leave_after(f: Fleet, b: dict[str, object], headers: dict[str, str], after_s: float) -> float:
    """Send a call and hang up after `after_s` (once it runs), as a client whose timeout fired; when it left."""
    async with httpx.AsyncClient(base_url=f.base_url) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.post("/v1/chat/completions", json=b, headers=headers, timeout=after_s)
    return time.monotonic()
