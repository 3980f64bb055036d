from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from fleet.redis_server import PrivateRedis
from tests.cluster_harness import PrivateCluster
from tests.harness import Fleet


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private redis-server for the whole session; tests isolate by namespace."""
    server = PrivateRedis().start()
    os.environ.pop("REDIS_URL", None)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A private Redis Cluster (3 masters + 3 replicas) for the session, started on first use."""
    cluster = PrivateCluster().start()
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def store_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """The Redis a test runs on: the single server, or the cluster where a test is
    parametrized with `@pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)`."""
    if getattr(request, "param", "redis") == "cluster":
        return str(request.getfixturevalue("redis_cluster_url"))
    return redis_url


@pytest.fixture
def fleet(store_url: str) -> Iterator[Fleet]:
    f = Fleet(store_url)
    try:
        yield f
    finally:
        f.stop()
