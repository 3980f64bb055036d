"""Redis Cluster clients for `redis+cluster://HOST:PORT[,HOST:PORT...]` (built by
`fleet.store.connection`, the one factory; nothing else calls this module).

Any node is a seed: the client reads the slot map from it, sends each command to
the master of its key's slot, follows MOVED/ASK, and re-reads the map after a
connection error, so a master that dies and a replica that is promoted in its
place are ridden through without restarting a part. The store's keys carry
hash tags (`fleet.store.keys`), so every Lua script runs on one node.

Subscriptions: classic PUBLISH reaches every node of a cluster, so a subscriber
may listen on any one; `AnyNodePubSub` opens each subscription on a node chosen
afresh, so a subscriber whose node died resubscribes on a live one.
"""

from __future__ import annotations

import random
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import redis as sync_redis
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, RedisClusterException
from redis.retry import Retry as SyncRetry

from fleet.store.sending import cancel_safe


class RedisTarget(Protocol):
    """What `fleet.store.connection` passes (its RedisTarget; not imported: it imports this module)."""

    @property
    def url(self) -> str: ...  # read-only: that RedisTarget is frozen


# How often a command is re-sent after a connection error, each time after the
# slot map is read again. A failover (node timeout + election) takes seconds;
# the parts' own loops (a worker's claim, a caller's retry of a 503) outlast it.
CLUSTER_RETRIES = 3


def seeds(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(host, port) seeds, username and password of a `redis+cluster://` URL."""
    parts = urlsplit(url)
    netloc = parts.netloc
    user = password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        user, password = unquote(user) or None, unquote(password) or None
    out: list[tuple[str, int]] = []
    for hp in netloc.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"REDIS_URL {url!r}: a cluster seed must be HOST:PORT, got {hp!r}")
        out.append((host, int(port)))
    return out, user, password


def _cluster_options(options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    opts.pop("retries", None)
    # redis-py's cluster has no waiting pool: a per-node cap would fail callers past it
    # ("Too many connections") instead of making them wait, so a cap meant to wait is dropped.
    if opts.pop("wait_for_connection_s", None) is not None:
        opts.pop("max_connections", None)
    return opts


class FleetCluster(RedisCluster):
    """redis-py's asyncio cluster client with two fixes for the store's use.

    - XREAD's key is found here (after STREAMS), not by asking a node COMMAND
      GETKEYS before every read, as redis-py does for commands whose keys move:
      that was one extra round trip per result read, and during a failover it
      raced the node's connections being closed.
    - During a failover redis-py can fail a command with an AttributeError (a
      connection closed under it), a RuntimeError from the event loop's transport
      ("... the handler is closed": the same race, one layer down, seen under uvloop)
      or a RedisClusterException (a slot not yet covered by any master): all become
      a ConnectionError, which every part already treats as "Redis is away for now"
      (a typed 503, a retry). Other RuntimeErrors are bugs and pass through.
    - A transaction pipeline that meets a connection error during a failover makes
      redis-py 6.4 store that ConnectionError as the slot map's pending MOVED
      redirect; every later command then fails reading its host, for good (a CI
      rehearsal's gateway stayed "reconfiguring" for a minute after the promotion).
      Such an entry is dropped before each command and pipeline (`heal_slot_map`):
      the command then meets the dead node itself and redis-py re-reads the map.
    """

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        heal_slot_map(self)
        return super().pipeline(transaction, shard_hint)

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() in ("XREAD", "XREADGROUP"):
            words = [a.upper() if isinstance(a, (str, bytes)) else a for a in args]
            marker = next((m for m in ("STREAMS", b"STREAMS") if m in words), None)
            if marker is not None:
                at = words.index(marker) + 1
                keys = args[at:at + (len(args) - at) // 2]
                slots = {self.keyslot(k) for k in keys}
                if len(slots) == 1:
                    return slots.pop()
        return await super()._determine_slot(command, *args)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        heal_slot_map(self)
        try:
            return await super().execute_command(*args, **kwargs)
        except (AttributeError, RedisClusterException) as e:
            raise RedisConnectionError(f"Redis Cluster reconfiguring: {type(e).__name__}: {e}") from e
        except RuntimeError as e:
            if "closed" not in str(e):
                raise
            raise RedisConnectionError(f"Redis Cluster reconfiguring: a connection closed under a command: {e}") from e


def heal_slot_map(client: Any) -> bool:
    """Drop a pending "MOVED" redirect that is no MovedError (see `FleetCluster`); True if one was."""
    nodes = getattr(client, "nodes_manager", None)
    pending = getattr(nodes, "_moved_exception", None)
    if pending is None or isinstance(pending, MovedError):
        return False
    nodes._moved_exception = None  # type: ignore[union-attr]
    return True


def cluster_client(target: RedisTarget, options: dict[str, Any]) -> Redis:
    """An asyncio Redis Cluster client (typed as `Redis`: the commands the store uses
    are the same; pub/sub goes through `AnyNodePubSub`)."""
    nodes, user, password = seeds(target.url)
    opts = _cluster_options(options)
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), CLUSTER_RETRIES)
    client = FleetCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], username=user, password=password,
                          retry=retry, **opts)
    # Each node's connections write as the single client's do, a cancel never lost (fleet.store.sending):
    # the nodes found later are made from these keyword arguments, the seeds were made already.
    safe = cancel_safe(client.connection_kwargs["connection_class"])
    client.connection_kwargs["connection_class"] = safe
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = safe
    return client


class FleetClusterSync(SyncRedisCluster):
    """The blocking cluster client, with the same slot-map repair as `FleetCluster`."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        heal_slot_map(self)
        return super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        heal_slot_map(self)
        return super().pipeline(transaction, shard_hint)


def cluster_client_sync(target: RedisTarget, options: dict[str, Any]) -> sync_redis.Redis:
    """A blocking Redis Cluster client, for the command line and probes."""
    nodes, user, password = seeds(target.url)
    opts = _cluster_options(options)
    retries = int(options.get("retries", CLUSTER_RETRIES))
    opts.pop("retry_on_error", None)
    retry = SyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries)
    client = FleetClusterSync(startup_nodes=[SyncClusterNode(h, p) for h, p in nodes], username=user,
                              password=password, retry=retry, **opts)
    return client


class AnyNodePubSub:
    """Stands in for a client's `.pubsub()` on a cluster: each subscription opens on a
    node of the current slot map, picked at random (a dead one fails the subscribe,
    and the subscriber's own retry picks again)."""

    def __init__(self, cluster: Redis, options: dict[str, Any]) -> None:
        self.cluster = cluster
        self.options = {k: v for k, v in options.items() if k not in ("retries", "client_name")}
        self.clients: dict[str, Redis] = {}

    def pubsub(self, **kwargs: Any) -> PubSub:
        nodes = self.cluster.get_nodes()
        node = random.choice(nodes)
        client = self.clients.get(node.name)
        if client is None:
            client = self.clients[node.name] = Redis(host=node.host, port=node.port, **self.options)
        return client.pubsub(**kwargs)

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()
        self.clients.clear()
