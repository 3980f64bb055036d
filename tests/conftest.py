from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from fleet.redis_server import PrivateRedis
from tests.cluster_harness import PrivateCluster
from tests.harness import Fleet
from tests.paths import TESTS

# A test's weight is its folder: pure (no Redis), store (a private Redis, no processes),
# processes (the fleet's parts as processes), engines (vLLM, an upstream), containers (Docker),
# simulation (scenario replays). Each folder is a marker of the same name: `-m "pure or store"`.
WEIGHTS = ("pure", "store", "processes", "engines", "containers", "simulation")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = item.path.relative_to(TESTS) if item.path.is_relative_to(TESTS) else None
        if rel is not None and len(rel.parts) > 1 and rel.parts[0] in WEIGHTS:
            item.add_marker(getattr(pytest.mark, rel.parts[0]))


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
