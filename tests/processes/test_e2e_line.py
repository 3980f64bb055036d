"""The line end to end: OpenAI client -> gateway -> Redis -> sim worker -> tokens back."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.harness import Fleet, wait_until

TIERS = ("routing", "analysis", "planner")
# The same path on one Redis and on a Redis Cluster (3 masters + 3 replicas, tests/cluster_harness.py).
ON_CLUSTER_TOO = pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)


@pytest.fixture
def up(fleet: Fleet) -> Fleet:
    return fleet.start_gateway().start_tiers(TIERS)


def client(f: Fleet, **kw) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0, **kw)


@ON_CLUSTER_TOO
@pytest.mark.parametrize("tier", TIERS)
def test_openai_client_each_tier_streaming_and_not(up: Fleet, tier: str) -> None:
    c = client(up)
    exact = {"ignore_eos": True}  # vLLM's extension: the answer runs to max_tokens, as the counts below need
    r = c.chat.completions.create(model=tier, messages=[{"role": "user", "content": "route this"}], max_tokens=7,
                                  extra_body=exact)
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].message.content.split()) == 7
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7

    chunks = list(c.chat.completions.create(model=tier, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            stream=True, stream_options={"include_usage": True}, extra_body=exact))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5

    comp = c.completions.create(model=tier, prompt="once upon", max_tokens=4, extra_body=exact)
    assert len(comp.choices[0].text.split()) == 4 and comp.usage.completion_tokens == 4


def test_aliases_and_models_list(up: Fleet) -> None:
    ids = {m.id for m in client(up).models.list()}
    assert {"routing", "small", "analysis", "mid", "planner", "large"} <= ids
    r = client(up).chat.completions.create(model="large", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_bad_input_gets_typed_errors_never_500(up: Fleet) -> None:
    u = f"{up.base_url}/v1/chat/completions"
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"[1,2]", 400, "invalid_json"),
        (b'{"model":"nope","messages":[{"role":"user","content":"x"}]}', 404, "model_not_found"),
        (b'{"model":"routing"}', 422, "invalid_value"),
        (b'{"model":"routing","messages":[{"role":"user","content":"x"}],"max_tokens":-1}', 422, "invalid_value"),
        (b'{"model":"routing","messages":[{"role":"wizard","content":"x"}]}', 422, "invalid_value"),
        (b'{"model":"routing","messages":[{"role":"user","content":"x"}],"n":3}', 422, "invalid_value"),
    ]
    for body, status, code in cases:
        r = httpx.post(u, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    big = b'{"model":"routing","messages":[{"role":"user","content":"' + b"x" * 1_100_000 + b'"}]}'
    r = httpx.post(u, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    for hdr, code in (({"x-priority": "urgent"}, "invalid_priority"), ({"x-deadline-ms": "soon"}, "invalid_deadline"),
                      ({"x-deadline-ms": "9" * 25}, "invalid_deadline"), ({"x-deadline-ms": "-5"}, "invalid_deadline")):
        r = httpx.post(u, json={"model": "routing", "messages": [{"role": "user", "content": "x"}]}, headers=hdr)
        assert r.status_code == 400 and r.json()["error"]["code"] == code
    with pytest.raises(openai.NotFoundError) as e:
        client(up).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


@ON_CLUSTER_TOO
def test_committed_served_before_fifty_background_through_the_gateway(fleet: Fleet) -> None:
    fleet.start_gateway()

    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as h:
            async def call(prio: str) -> None:
                r = await h.post("/v1/chat/completions", headers={"x-priority": prio},
                                 json={"model": "routing", "messages": [{"role": "user", "content": "x"}],
                                       "max_tokens": 2})
                assert r.status_code == 200, r.text
                order.append(prio)

            bg = [asyncio.create_task(call("background")) for _ in range(50)]
            await asyncio.to_thread(wait_until, lambda: fleet.counters("routing").get("accepted", 0) >= 50, 20)
            committed = asyncio.create_task(call("committed"))
            await asyncio.to_thread(wait_until, lambda: fleet.counters("routing").get("accepted", 0) >= 51, 20)
            await asyncio.to_thread(fleet.start_worker, "routing")  # one worker, 4 slots, starts now
            await asyncio.gather(*bg, committed)
        return order

    order = asyncio.run(run())
    assert "committed" in order[:4], order  # within the first batch the worker claimed


@ON_CLUSTER_TOO
def test_worker_killed_mid_request_is_requeued_and_completed_once(fleet: Fleet) -> None:
    fleet.start_gateway()
    slow = fleet.start_worker("planner", time_scale="20")  # 20x slower: the request is still running when killed
    body = {"model": "planner", "messages": [{"role": "user", "content": "thesis"}], "max_tokens": 40,
            "ignore_eos": True}  # all 40: still running when its worker is killed

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as h:
            call = asyncio.create_task(h.post("/v1/chat/completions", json=body))
            await asyncio.to_thread(wait_until, lambda: fleet.r.zcard(fleet.keys("planner").inflight) == 1, 20)
            await asyncio.to_thread(fleet.kill_worker, slow, signal.SIGKILL)
            await asyncio.to_thread(fleet.start_worker, "planner")
            return await call

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40
    c = fleet.counters("planner")
    assert c["requeued"] == 1 and c["completed"] == 1 and c["accepted"] == 1
    assert c.get("failed", 0) == 0


@ON_CLUSTER_TOO
def test_worker_killed_mid_stream_gives_worker_lost(fleet: Fleet) -> None:
    fleet.start_gateway()
    slow = fleet.start_worker("planner", time_scale="20")
    events: list[str] = []
    with httpx.stream("POST", f"{fleet.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "planner", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                            "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:
                fleet.kill_worker(slow)
    assert events[-1] == "data: [DONE]"
    assert '"worker_lost"' in events[-2]
    c = fleet.counters("planner")
    assert c["failed"] == 1 and c.get("completed", 0) == 0


def test_client_that_leaves_the_line_never_reaches_an_engine(fleet: Fleet) -> None:
    fleet.start_gateway()  # no worker yet: the request waits in the line
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fleet.base_url}/v1/chat/completions", timeout=0.5,
                   json={"model": "routing", "messages": [{"role": "user", "content": "x"}]})
    wait_until(lambda: fleet.counters("routing").get("cancelled") == 1, 10, what="cancel recorded")
    assert fleet.r.zcard(fleet.keys("routing").line) == 0
    rid = fleet.start_worker("routing")
    # A call of the same class sent now is served after anything still in the line: once it is
    # done, the worker has had every chance to run the one that left, had it stayed.
    assert _probe(fleet) == 200
    assert fleet.counters("routing").get("completed", 0) == 1  # the probe, and only the probe
    import orjson

    wait_until(lambda: orjson.loads(fleet.r.hget(fleet.keys("routing").replicas, rid))["completed"] == 1, 5,
               what="the replica's heartbeat counting the probe")


@ON_CLUSTER_TOO
def test_client_that_leaves_mid_stream_aborts_the_engine(fleet: Fleet) -> None:
    fleet.start_gateway()
    rid = fleet.start_worker("analysis", time_scale="10")
    with httpx.stream("POST", f"{fleet.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "analysis", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000,
                            "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    wait_until(lambda: fleet.counters("analysis").get("cancelled") == 1, 10, what="cancel recorded")
    import orjson

    # The replica's slot is free again long before 2000 tokens could have been made.
    wait_until(lambda: orjson.loads(fleet.r.hget(fleet.keys("analysis").replicas, rid))["in_use"] == 0, 5,
               what="slot released")
    assert fleet.counters("analysis").get("completed", 0) == 0
    # The gateway closed the request too (its counters agree with the line's).
    wait_until(lambda: 'fleet_requests_total{outcome="cancelled",priority="interactive",tier="analysis"} 1.0'
               in httpx.get(f"{fleet.base_url}/metrics").text, 5, what="the gateway's cancelled count")


@ON_CLUSTER_TOO
def test_deadline_passed_in_line_is_504_and_never_reaches_engine(fleet: Fleet) -> None:
    fleet.start_gateway()  # no worker: the line cannot move
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client(fleet).chat.completions.create(model="routing", messages=[{"role": "user", "content": "x"}],
                                              extra_headers={"X-Deadline-Ms": "400"})
    assert e.value.status_code == 504
    assert e.value.body["type"] == "deadline_exceeded"
    assert time.monotonic() - t0 < 3
    fleet.start_worker("routing")
    assert _probe(fleet) == 200  # served after anything still in the line (see above)
    c = fleet.counters("routing")
    assert c["expired"] == 1 and c["completed"] == 1  # the probe only: the expired call never reached it


def _probe(f: Fleet) -> int:
    """One interactive call (the default class), sent after whatever is in the line."""
    return httpx.post(f"{f.base_url}/v1/chat/completions", timeout=30,
                      json={"model": "routing", "messages": [{"role": "user", "content": "probe"}],
                            "max_tokens": 2}).status_code
