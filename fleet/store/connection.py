"""The one place every part gets its Redis clients: timeouts by role, retries, health checks.

Every part (gateway, workers, scaler, the command) asks here; nothing else calls
`Redis.from_url`. A client is built for a *role*, because one set of timeouts
cannot fit every call:

- `calls`: ordinary commands and Lua scripts. A short read timeout turns a
  frozen Redis into a typed error (a 503 at the gateway) instead of a hang.
  Five seconds, not one: on a loaded 2-core box a process can stall for a
  second or two, and a false timeout costs a caller a 503.
- `blocking`: BLPOP and XREAD BLOCK. Its read timeout exceeds the longest block
  any part asks for (`MAX_BLOCK_S`), so a block that simply ran its course is
  never mistaken for a dead server.
- `pubsub`: subscriptions wait for messages indefinitely, so no read timeout;
  a health check (PING) every few seconds of silence finds a dead link instead.

Retries: a connection error (refused, reset) is retried three times with a
short exponential backoff with jitter, so a Redis that restarts is ridden
through. A *timeout* is not retried: the command may have run (an enqueue, a
token charge), and running it twice would count it twice.

Where deployment kinds plug in: `parse_url` reads the scheme, and `BUILDERS`
maps each scheme to a function that builds the client. `redis+cluster://HOST:PORT`
(any node; several seeds as `HOST:PORT,HOST:PORT`) builds a Redis Cluster client
(`fleet.store.cluster`): it finds the other nodes itself, follows MOVED/ASK, and
after a failover re-reads the slot map, so parts ride through a promoted replica
without a restart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import redis as sync_redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry as SyncRetry

from fleet.store.cluster import AnyNodePubSub, cluster_client, cluster_client_sync
from fleet.store.packing import fast
from fleet.store.sending import cancel_safe

Role = Literal["calls", "blocking", "pubsub"]

MAX_BLOCK_S = 5.0  # the longest BLPOP / XREAD BLOCK any part issues; readers clamp their blocks to it
RETRIES = 3
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    read_s: float | None  # None: wait for a reply as long as it takes (subscriptions)
    health_check_s: int  # PING a connection idle this long before using it


ROLE_TIMEOUTS: dict[Role, Timeouts] = {
    "calls": Timeouts(connect_s=2.0, read_s=5.0, health_check_s=30),
    "blocking": Timeouts(connect_s=2.0, read_s=MAX_BLOCK_S + 5.0, health_check_s=30),
    "pubsub": Timeouts(connect_s=2.0, read_s=None, health_check_s=10),
}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where a URL points and which kind of deployment it names."""

    url: str
    scheme: str  # "redis", "rediss", "unix", "redis+cluster"


SUPPORTED = ("redis", "rediss", "unix")
CLUSTER = "redis+cluster"


def parse_url(url: str) -> RedisTarget:
    """The target of a REDIS_URL; ValueError naming the supported schemes otherwise."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in BUILDERS:
        raise ValueError(f"REDIS_URL {url!r}: unsupported scheme {scheme or '(none)'!r}; "
                         f"use one of {', '.join(s + '://' for s in BUILDERS)}")
    return RedisTarget(url, scheme)


def _options(role: Role, connect_timeout_s: float | None) -> dict[str, Any]:
    t = ROLE_TIMEOUTS[role]
    return {"socket_connect_timeout": connect_timeout_s if connect_timeout_s is not None else t.connect_s,
            "socket_timeout": t.read_s, "socket_keepalive": True, "health_check_interval": t.health_check_s,
            "retry_on_error": [RedisConnectionError]}


def _single(target: RedisTarget, options: dict[str, Any]) -> Redis:
    retry = Retry(ExponentialWithJitterBackoff(base=BACKOFF_BASE_S, cap=BACKOFF_CAP_S), RETRIES,
                  supported_errors=(RedisConnectionError,))
    wait_s = options.pop("wait_for_connection_s", None)
    if wait_s is None:
        client = Redis.from_url(target.url, retry=retry, **options)
    else:
        # A bounded pool that makes a caller wait for a free connection instead of failing
        # with "Too many connections": the connection count stays fixed under any load.
        pool = BlockingConnectionPool.from_url(target.url, retry=retry, timeout=wait_s, **options)
        client = Redis(connection_pool=pool)
        client.auto_close_connection_pool = True
    # Commands packed in C (fleet.store.packing) and written so that a cancel is never lost
    # (fleet.store.sending); the pool makes its connections from this class.
    pool = client.connection_pool
    # The ignore: mypy reads a class's __hash__ unbound, so no class passes for the Hashable a cache
    # takes, and `fast` is cached by class.
    pool.connection_class = fast(cancel_safe(pool.connection_class))  # type: ignore[arg-type]
    return client


def _single_sync(target: RedisTarget, options: dict[str, Any]) -> sync_redis.Redis:
    retries = options.pop("retries", RETRIES)
    retry = SyncRetry(ExponentialWithJitterBackoff(base=BACKOFF_BASE_S, cap=BACKOFF_CAP_S), retries,
                      supported_errors=(RedisConnectionError,))
    return sync_redis.Redis.from_url(target.url, retry=retry, **options)


# scheme -> how to build a client for it. One entry per deployment kind.
BUILDERS: dict[str, Callable[[RedisTarget, dict[str, Any]], Redis]] = {
    **dict.fromkeys(SUPPORTED, _single), CLUSTER: cluster_client}
SYNC_BUILDERS: dict[str, Callable[[RedisTarget, dict[str, Any]], sync_redis.Redis]] = {
    **dict.fromkeys(SUPPORTED, _single_sync), CLUSTER: cluster_client_sync}


def connect(url: str, role: Role = "calls", *, max_connections: int | None = None, name: str | None = None,
            connect_timeout_s: float | None = None, wait_for_connection_s: float | None = None) -> Redis:
    """An asyncio client for `role`. `name` shows in CLIENT LIST (which part holds the connection).
    `wait_for_connection_s` (with `max_connections`): past the limit, wait that long for a free
    connection rather than fail at once."""
    target = parse_url(url)
    options = _options(role, connect_timeout_s)
    if max_connections is not None:
        options["max_connections"] = max_connections
        if wait_for_connection_s is not None:
            options["wait_for_connection_s"] = wait_for_connection_s
    if name:
        options["client_name"] = name
    return BUILDERS[target.scheme](target, options)


def connect_sync(url: str, role: Role = "calls", *, connect_timeout_s: float | None = None,
                 read_timeout_s: float | None = None, retries: int = RETRIES) -> sync_redis.Redis:
    """A blocking client, for the command line (`fleet keys`) and start-up probes (which
    pass `retries=0`: a probe asks once whether something answers)."""
    target = parse_url(url)
    options = _options(role, connect_timeout_s)
    options["retries"] = retries
    if read_timeout_s is not None:
        options["socket_timeout"] = read_timeout_s
    return SYNC_BUILDERS[target.scheme](target, options)


def pubsub_source(client: Redis) -> Redis:
    """What to call `.pubsub()` on for `client`: itself, or on a cluster (whose client
    has no pub/sub) a source that subscribes on any live node."""
    if isinstance(client, RedisCluster):
        return AnyNodePubSub(client, _options("pubsub", None))
    return client


@dataclass
class Clients:
    """A part's Redis clients, one per role it uses; closed together."""

    calls: Redis
    blocking: Redis
    _pubsub: Redis | None = None
    _url: str = ""

    @classmethod
    def open(cls, url: str, *, name: str, max_connections: int | None = None,
             max_blocking: int | None = None, wait_for_connection_s: float | None = None) -> Clients:
        return cls(connect(url, "calls", max_connections=max_connections, name=name,
                           wait_for_connection_s=wait_for_connection_s),
                   connect(url, "blocking", max_connections=max_blocking, name=f"{name}:blocking",
                           wait_for_connection_s=wait_for_connection_s), None, url)

    @property
    def pubsub_client(self) -> Redis:
        """The subscriptions' client, made on first use (most parts never subscribe).
        On a cluster, a client of whichever node answers when a subscription starts
        (PUBLISH reaches every node), see `fleet.store.cluster.AnyNodePubSub`."""
        if self._pubsub is None:
            if parse_url(self._url).scheme == CLUSTER:
                self._pubsub = pubsub_source(self.calls)
            else:
                self._pubsub = connect(self._url, "pubsub", name=None)
        return self._pubsub

    async def aclose(self) -> None:
        for c in (self.calls, self.blocking, self._pubsub):
            if c is not None:
                await c.aclose()
