"""What one call costs in Redis, counted on a private server, so a regression in round trips is caught.

A call at concurrency 1 (gateway -> line -> sim worker and back), watched with MONITOR, costs:

- the gateway: the admission view (one script), the enqueue (one script), one XREAD of its result
  stream, and a share of one UNLINK (read streams are dropped in batches); no ring of its result
  reader (nothing else is open) and no second XREAD of a stream whose final event was read;
- the worker: the bell's BLPOP with the CLAIM script pipelined behind it (one round trip), the
  FINISH script, and the token charge with the version outcome pipelined (one round trip); no claim
  of an empty line after the request's own claim emptied it.

Periodic work (heartbeats, reaper, refreshes) runs every `heartbeat_s`, set long here so that only
the calls are counted. Also: the pieces the hot path relies on (a wait that claims, a ring that ends
it, the claim's `more`, a token charge pipelined with another write), one by one.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from fleet.config import Priority, load_config
from fleet.redis_server import PrivateRedis
from fleet.store.connection import connect
from fleet.store.keys import TierKeys
from fleet.store.ledger import Ledger
from fleet.store.line import Line
from fleet.store.version_outcomes import queue_outcome, read_outcomes
from gateway.answers import SSEResponse
from gateway.client_watch import ClientWatch
from tests.harness import TEST_CONFIG, Fleet, blocked_in, wait_until

CONFIG = """
namespace: hot
heartbeat_s: 30
tiers:
  fast:
    warm_floor: 1
    max_replicas: 1
    slots: 8
    lease_s: 60
    hourly_usd: 1.0
    sim:
      weights_gb: 0
      load_gb_s: 1
      warmup_s: 0
      prefill_tokens_per_s: 1.0e12
      decode_step: {base_s: 0, per_seq_s: 0}
      kv_capacity_tokens: 10000000
"""
CALLS = 20


@pytest.fixture(scope="module")
def private_url() -> Iterator[str]:
    """A Redis of this module's own: MONITOR sees only what these tests send."""
    server = PrivateRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


_made = [0]  # calls made in this module so far


def _charged(r: redis.Redis) -> int:
    """Calls the worker has charged (each charge carries its version's outcome, one entry a call)."""
    return sum(r.xlen(k) for k in r.scan_iter(match="*:models:outcomes", count=1000))


def _call(c: httpx.Client, base: str, stream: bool) -> None:
    _made[0] += 1
    body = {"model": "fast", "messages": [{"role": "user", "content": "count me"}], "max_tokens": 4,
            "stream": stream, "ignore_eos": True}  # 4 tokens each: the commands counted are per such call
    r = c.post(f"{base}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")


def _commands_per_call(r: redis.Redis, base: str, stream: bool) -> dict[str, collections.Counter[str]]:
    """MONITOR while CALLS sequential calls run: the top-level commands (not those inside scripts),
    by the client name of the connection that sent them ("gateway", "worker:fast", ...)."""
    start, mark = f"hot-start-{uuid.uuid4().hex}", f"hot-{uuid.uuid4().hex}"
    seen: list[dict[str, object]] = []
    on = threading.Event()

    def watch() -> None:
        with r.monitor() as m:
            for cmd in m.listen():
                if start in str(cmd["command"]):
                    on.set()  # MONITOR sees what comes after this: count from here
                    continue
                if on.is_set():
                    seen.append(cmd)
                if mark in str(cmd["command"]):
                    return

    # A worker charges the calls that end within one stream window together (workers.charging):
    # the earlier calls' charges are sent before counting starts, these calls' before it ends.
    wait_until(lambda: _charged(r) >= _made[0], 10, what="the earlier calls charged")
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    wait_until(lambda: r.echo(start) and on.wait(0.1), 10, what="MONITOR seeing commands")
    with httpx.Client() as c:
        for _ in range(CALLS):
            _call(c, base, stream)
    # The read result streams are unlinked in batches (gathered for 0.1 s): wait for the last
    # batch, so the count holds every command these calls cost.
    wait_until(lambda: not list(r.scan_iter(match="*:res:[0-9a-f]*", count=1000)), 10,
               what="the result streams unlinked")
    wait_until(lambda: _charged(r) >= _made[0], 10, what="these calls charged")
    r.echo(mark)
    t.join(10)
    names = {c["addr"]: c["name"] for c in r.client_list()}
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for cmd in seen:
        if cmd.get("client_type") == "lua":
            continue
        name = names.get(f"{cmd['client_address']}:{cmd['client_port']}", "")
        if name.startswith(("gateway", "worker")):
            out[name.split(":")[0]][str(cmd["command"]).split()[0].upper()] += 1
    return out


@pytest.fixture(scope="module")
def fleet(private_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cfg = tmp_path_factory.mktemp("hot") / "fleet.yaml"
    cfg.write_text(CONFIG)
    f = Fleet(private_url, config_path=Path(cfg))
    try:
        f.start_worker("fast")  # ready before the gateway starts: its first view counts the replica
        f.start_gateway()
        with httpx.Client() as c:
            for stream in (False, True, False, True):
                _call(c, f.base_url, stream)
        yield f
    finally:
        f.stop()


def _measured(fleet: Fleet, stream: bool) -> tuple[collections.Counter[str], collections.Counter[str],
                                                 dict[str, dict[str, float]]]:
    """The gateway's and the worker's commands over CALLS calls, and per call (for the messages)."""
    r = redis.Redis.from_url(fleet.redis_url)
    try:
        got = _commands_per_call(r, fleet.base_url, stream=stream)
    finally:
        r.close()
    per = {k: {c: n / CALLS for c, n in v.items()} for k, v in got.items()}
    return got["gateway"], got["worker"], per


def test_a_call_costs_few_round_trips(fleet: Fleet) -> None:
    gw, wk, per = _measured(fleet, stream=False)
    # The gateway: admission view + enqueue, one read of the result stream, no ring, dropped in batches.
    assert gw["EVALSHA"] == 2 * CALLS, per
    assert gw["XREAD"] == CALLS, per
    assert gw["XADD"] == 0 and gw["EXPIRE"] == 0, per  # its result reader was never rung
    assert gw["UNLINK"] <= CALLS / 2, per
    assert sum(gw.values()) <= 3.5 * CALLS, per
    # The worker: BLPOP + CLAIM in one round trip, FINISH, token charge + outcome in one round trip.
    # (+1: a wait that timed out while MONITOR started claims once more.)
    assert wk["BLPOP"] <= CALLS + 1, per
    assert wk["EVALSHA"] <= 3 * CALLS + 1, per  # claim, finish, token charge: no claim of an empty line
    assert wk["XADD"] == CALLS, per  # the version outcome
    assert sum(wk.values()) <= 5 * CALLS + 2, per


def test_a_streamed_call_costs_few_round_trips(fleet: Fleet) -> None:
    gw, wk, per = _measured(fleet, stream=True)
    assert gw["EVALSHA"] == 2 * CALLS, per
    assert gw["XADD"] == 0, per  # no ring: each call's read starts afresh
    assert gw["XREAD"] <= 4 * CALLS, per  # a read per batch of tokens, none after the final event
    assert wk["BLPOP"] <= CALLS + 1, per


# --- the pieces, one by one ---------------------------------------------------------------


@pytest.fixture
async def line(private_url: str):  # type: ignore[no-untyped-def]
    name = f"line-{uuid.uuid4().hex[:8]}"  # its connections' name: a test finds its blocked wait by it
    r = connect(private_url, name=name)
    yield Line(r, name, "fast", result_ttl_s=30, rate_window_s=5)
    await r.aclose()


async def test_claim_says_whether_more_is_claimable(line: Line) -> None:
    for _ in range(3):
        await line.enqueue(uuid.uuid4().hex, Priority.interactive, b"{}", 60_000)
    first = await line.claim("w", 2, 5)
    assert len(first) == 2 and first.more  # stopped at n: there may be more
    rest = await line.claim("w", 5, 5)
    assert len(rest) == 1 and not rest.more  # emptied the line
    assert not (await line.claim("w", 5, 5)).more and await line.claim("w", 5, 5) == []


async def test_wait_and_claim_claims_when_the_bell_rings(line: Line) -> None:
    wait = asyncio.ensure_future(line.wait_and_claim("w", 4, 5, timeout_s=5.0))
    await blocked_in(line.redis, line.keys.namespace, "blpop")  # blocked on the bell
    assert not wait.done()
    rid = uuid.uuid4().hex
    t0 = time.monotonic()
    await line.enqueue(rid, Priority.interactive, b'{"x": 1}', 60_000)
    got = await asyncio.wait_for(wait, 3)
    assert [c.rid for c in got] == [rid] and got[0].payload == b'{"x": 1}' and not got.more
    assert time.monotonic() - t0 < 2.0  # claimed on the ring, not at the 5 s timeout
    assert await line.redis.zscore(line.keys.inflight, rid) is not None  # leased like any claim


async def test_a_ring_ends_the_wait_at_once(line: Line) -> None:
    wake = line.keys.wake("w")
    wait = asyncio.ensure_future(line.wait_and_claim("w", 4, 5, timeout_s=5.0, wake=wake))
    await blocked_in(line.redis, line.keys.namespace, "blpop")
    t0 = time.monotonic()
    await line.ring(wake)
    got = await asyncio.wait_for(wait, 3)
    assert got == [] and time.monotonic() - t0 < 2.0


async def test_a_charge_pipelined_with_another_write_is_exact_even_without_its_script(private_url: str) -> None:
    r = connect(private_url)
    try:
        cfg = load_config(TEST_CONFIG)
        tier = next(iter(cfg.tiers))
        ns = f"t{uuid.uuid4().hex[:8]}"
        lg, keys = Ledger(r, ns, tier, cfg.tiers[tier]), TierKeys(ns, tier)
        await lg.record_tokens("k", "interactive", 10, 5, useful=True,
                               also=lambda p: queue_outcome(p, keys, "v1", True, 0.1))
        await r.script_flush()  # Redis lost its scripts (a restart): the charge must still land, once
        await lg.record_tokens("k", "interactive", 10, 5, useful=True,
                               also=lambda p: queue_outcome(p, keys, "v1", True, 0.1))
        await lg.record_tokens("k", "interactive", 0, 0, useful=False,  # nothing to charge: the write still goes
                               also=lambda p: queue_outcome(p, keys, "v1", False, 0.0))
        total = await lg.totals()
        assert total.tokens == 30 and total.completion_tokens == 10 and total.useful_tokens == 10
        assert (await lg.tokens_by_key())[("k", "interactive")] == {"pt": 20, "ct": 10, "ut": 10}
        outcomes, _ = await read_outcomes(r, keys, since_s=0)
        assert [o.ok for o in outcomes] == [True, True, False]
    finally:
        await r.aclose()


# --- a stream's first bytes on the call's own task -------------------------------------------


async def _respond(gen_blocks: bool, leave_after_first: bool, first_out: asyncio.Event | None = None
                   ) -> tuple[list[dict[str, object]], list[str]]:
    """Run an SSEResponse over a generator of two chunks (or one, then a wait for ever); the client
    leaves after the first chunk if asked. Returns what was sent and what the generator saw;
    `first_out` is set once the first chunk has gone out."""
    seen: list[str] = []
    first_out = first_out or asyncio.Event()
    leave = asyncio.Event()

    async def gen():  # type: ignore[no-untyped-def]
        try:
            yield b"data: 1\n\n"
            first_out.set()
            if gen_blocks:
                await asyncio.Event().wait()
            yield b"data: 2\n\n"
        finally:
            seen.append("clean-up")

    sent: list[dict[str, object]] = []

    async def send(m: dict[str, object]) -> None:
        sent.append(m)

    async def receive() -> dict[str, str]:
        if leave_after_first:
            await first_out.wait()
        else:
            await leave.wait()  # never: the response ends first
        return {"type": "http.disconnect"}

    client = ClientWatch(receive)  # the call's one watcher of its client, as the gateway hands it over
    call = _Call(client)
    try:
        await SSEResponse(gen(), call)({"type": "http"}, receive, send)  # type: ignore[arg-type]
    finally:
        client.stop()
    assert len(call.told) == 1, call.told  # the response ended its call once, however it stopped
    return sent, seen


class _Call:
    """What of a `Call` the response reads (its headers, its client's watcher) and ends."""

    def __init__(self, client: ClientWatch) -> None:
        self.headers: dict[str, str] = {}
        self.client = client
        self.told: list[str] = []

    async def end(self, told: str, *_: object, **__: object) -> None:
        self.told.append(told)


async def test_a_stream_whose_client_leaves_ends_with_its_clean_up() -> None:
    sent, seen = await _respond(gen_blocks=True, leave_after_first=True)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n" and seen == ["clean-up"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the client's leaving is no cancel


async def test_a_stream_runs_to_its_end_and_a_cancel_from_outside_still_cancels() -> None:
    sent, seen = await _respond(gen_blocks=False, leave_after_first=False)
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b"data: 2\n\n", b""] and seen == ["clean-up"]
    first = asyncio.Event()
    task = asyncio.ensure_future(_respond(gen_blocks=True, leave_after_first=False, first_out=first))
    await asyncio.wait_for(first.wait(), 5)  # streaming, the generator waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
