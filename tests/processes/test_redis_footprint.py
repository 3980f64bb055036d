"""What a call leaves in Redis: while it runs, its request (payload included); once it ended, only
what the exactly-once and late-finish rules read, whatever the size of its prompt. Agents send
their whole context every turn, so a finished call that kept its payload for `result_ttl_s`
held gigabytes of dead prompts at a few hundred calls a second."""

from __future__ import annotations

import httpx

from tests.harness import Fleet, redis_bytes, wait_until

PROMPT_BYTES = 8192
CALLS = 20
LEFT_AT_MOST = 1024  # bytes a finished call may leave behind (issue 24)


def _call(f: Fleet, content: str) -> str:
    r = httpx.post(f"{f.base_url}/v1/chat/completions", timeout=30, json={
        "model": "routing", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


def _settled(f: Fleet, rids: list[str]) -> bool:
    """Every call's result stream read and dropped (the gateway drops them in batches)."""
    k = f.keys("routing")
    return not any(f.r.exists(k.result(rid)) for rid in rids)


def test_a_finished_call_with_an_8_kb_prompt_leaves_at_most_1_kb_in_redis(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("routing")
    warm = [_call(fleet, "warm up") for _ in range(3)]  # the tier's shared keys exist from here on
    wait_until(lambda: _settled(fleet, warm), 10, what="the warm-up's result streams dropped")
    before = redis_bytes(fleet.r, f"{fleet.namespace}:*")

    rids = [_call(fleet, f"{i:04d}" + "x" * (PROMPT_BYTES - 4)) for i in range(CALLS)]
    wait_until(lambda: _settled(fleet, rids), 10, what="the result streams dropped")
    per_call = (redis_bytes(fleet.r, f"{fleet.namespace}:*") - before) / CALLS

    k = fleet.keys("routing")
    for rid in rids:
        h = fleet.r.hgetall(k.request(rid))
        assert h[b"state"] == b"done" and h[b"outcome"] == b"completed", h
        assert b"payload" not in h, f"the finished request {rid} still holds its payload"
    assert per_call <= LEFT_AT_MOST, f"{per_call:.0f} bytes left in Redis per finished call of {PROMPT_BYTES} B"
