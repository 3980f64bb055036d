"""Chains governed as chains, live: a chain's deadline bounds its later calls, and a chain cancelled
whole ends its calls waiting and running and refuses its new ones (docs/client-clock.md)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.harness import Fleet, wait_until

TIER = "slow"


@pytest.fixture(scope="module")
def fleet(clock_fleet: Fleet) -> Fleet:
    return clock_fleet


def body(tokens: int, text: str) -> dict[str, object]:
    return {"model": TIER, "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "ignore_eos": True}


def test_a_later_call_is_judged_on_what_is_left_of_its_chains_deadline(fleet: Fleet) -> None:
    url = f"{fleet.base_url}/v1/chat/completions"
    first = httpx.post(url, json=body(5, "plan"), timeout=10,
                       headers={"X-Chain-Id": "desk-1", "X-Chain-Deadline-Ms": "1500"})
    assert first.status_code == 200
    # 2 s of decoding cannot finish in what is left of 1.5 s, whatever its own deadline says.
    late = httpx.post(url, json=body(200, "analyse"), timeout=10,
                      headers={"X-Chain-Id": "desk-1", "X-Deadline-Ms": "60000"})
    assert late.status_code == 429 and late.json()["error"]["code"] == "deadline_unmeetable"
    assert late.headers["x-should-retry"] == "false"
    # A later X-Chain-Deadline-Ms does not move it: the first setting wins.
    again = httpx.post(url, json=body(200, "analyse again"), timeout=10,
                       headers={"X-Chain-Id": "desk-1", "X-Chain-Deadline-Ms": "60000"})
    assert again.status_code == 429


def test_a_chain_cancelled_whole_ends_its_calls_and_refuses_new_ones(fleet: Fleet) -> None:
    url = f"{fleet.base_url}/v1/chat/completions"

    async def call(h: httpx.AsyncClient, i: int) -> httpx.Response:
        return await h.post(url, json=body(2000, f"branch {i}"), headers={"X-Chain-Id": "tree-9"})

    async def main() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as h:
            calls = [asyncio.ensure_future(call(h, i)) for i in range(2)]
            for _ in range(200):  # both running in the engine
                if fleet.r.zcard(fleet.keys(TIER).inflight) >= 2:
                    break
                await asyncio.sleep(0.05)
            cancel = await h.delete(f"{fleet.base_url}/v1/fleet/chains/tree-9")
            return list(await asyncio.gather(*calls)), cancel

    answers, cancel = asyncio.run(main())
    assert cancel.status_code == 200 and cancel.json()["calls_ended"] == 2
    for r in answers:
        assert r.status_code == 409 and r.json()["error"]["code"] == "chain_cancelled"
    wait_until(lambda: fleet.r.zcard(fleet.keys(TIER).inflight) == 0, 10, what="the engine's work stopped")
    new = httpx.post(url, json=body(5, "one more"), headers={"X-Chain-Id": "tree-9"}, timeout=10)
    assert new.status_code == 409 and new.json()["error"]["code"] == "chain_cancelled"
    assert httpx.delete(f"{fleet.base_url}/v1/fleet/chains/never-seen", timeout=10).status_code == 404
