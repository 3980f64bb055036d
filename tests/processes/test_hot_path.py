"""What one call costs in Redis, counted on a private server, so a regression in round trips is caught.

A call at concurrency 1 (gateway -> line -> sim worker and back), watched with MONITOR, costs:

- the gateway: the admission view (one script), the enqueue (one script), one XREAD of its result
  stream, and a share of one UNLINK (read streams are dropped in batches); no ring of its result
  reader (nothing else is open) and no second XREAD of a stream whose final event was read;
- the worker: the bell's BLPOP with the CLAIM script pipelined behind it (one round trip), the
  FINISH script, and the token charge with the version outcome pipelined (one round trip); no claim
  of an empty line after the request's own claim emptied it.

Periodic work (heartbeats, reaper, refreshes) runs every `heartbeat_s`, set long here so that only
the calls are counted. The pieces the hot path relies on (a wait that claims, a ring that ends it,
the claim's `more`, a token charge pipelined with another write) are tested one by one on a Redis
alone (tests/store/test_hot_path_pieces.py), a stream's first bytes with no Redis
(tests/pure/test_stream_first_bytes.py).
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from fleet.redis_server import PrivateRedis
from tests.harness import Fleet, wait_until

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
