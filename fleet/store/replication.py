"""Writes a replica has acknowledged: `WAIT` after the write, on the write's own connection.

Redis replicates asynchronously: a master that acknowledged an enqueue and died before its
replica had it takes the call with it, and the replica promoted in its place has never heard of
it. `WAIT n timeout` blocks the client until n replicas acknowledged every write it sent before,
so the line sends the enqueue and the WAIT in one pipeline (one connection, one round trip; on a
cluster both go to the master of the tier's slot) and the gateway answers only after. It is done
only where the node has replicas (`INFO replication`, looked up at most every `REFRESH_S`, and
again soon after an acknowledgement fell short: a replica gone), and never waits past its
timeout: a call a replica did not acknowledge in time is still served, and counted
(`Replicas.short`, which the gateway exports as `fleet_enqueue_unreplicated_total`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

REFRESH_S = 10.0  # how stale the replica count may be
SHORT_REFRESH_S = 1.0  # after an acknowledgement fell short: look again this soon


@dataclass(frozen=True, slots=True)
class Ack:
    """What an enqueue waits for: `replicas` acknowledgements, at most `timeout_ms`."""

    replicas: int
    timeout_ms: int


class Replicas:
    """The replicas of the node that holds `key` (the master of its slot on a cluster)."""

    def __init__(self, redis: Redis, key: str) -> None:
        self.redis = redis
        self.key = key
        self.count = 0
        self.checked = float("-inf")
        self.max_age = REFRESH_S
        self.short = 0  # acknowledgements that timed out short of the replicas asked for

    async def known(self) -> int:
        """The replica count, looked up again when stale."""
        now = time.monotonic()
        if now - self.checked >= self.max_age:
            if isinstance(self.redis, RedisCluster):
                await self.redis.initialize()  # the slot map, read on first use
                info = await self.redis.info("replication", target_nodes=self.redis.get_node_from_key(self.key))
            else:
                info = await self.redis.info("replication")
            self.count = int(info.get("connected_slaves", 0))
            self.checked, self.max_age = now, REFRESH_S
        return self.count

    def fell_short(self) -> None:
        """An acknowledgement came from fewer replicas than asked: a replica may be gone."""
        self.short += 1
        self.max_age = min(self.max_age, SHORT_REFRESH_S)


async def acked(redis: Redis, replicas: Replicas, ack: Ack, script: Any, keys: list[str],
                args: list[Any]) -> tuple[Any, int]:
    """Run `script` (a registered script) on `keys`, `args`, then WAIT on the same connection.

    Returns (the script's result, replicas that acknowledged it). A Redis that lost the script
    (a restart) has it loaded, and the call runs again."""
    for attempt in (0, 1):
        async with redis.pipeline(transaction=False) as p:
            p.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            if isinstance(redis, RedisCluster):  # the WAIT on the master of the slot, in the same batch
                p.execute_command("WAIT", ack.replicas, ack.timeout_ms,
                                  target_nodes=redis.get_node_from_key(replicas.key))
            else:
                p.execute_command("WAIT", ack.replicas, ack.timeout_ms)
            got, n = await p.execute(raise_on_error=False)
        if isinstance(got, NoScriptError) and attempt == 0:
            await redis.script_load(script.script)
            continue
        if isinstance(got, Exception):
            raise got
        if isinstance(n, Exception):
            raise n
        if int(n) < ack.replicas:
            replicas.fell_short()
        return got, int(n)
    raise AssertionError("unreachable")  # the loop returns or raises
