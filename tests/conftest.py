from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

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


# The session's Redis Cluster, started in the background once collection shows a test will use it.
_cluster: Future[PrivateCluster] | None = None


def _on_cluster(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return ("redis_cluster_url" in getattr(item, "fixturenames", ())
            or (callspec is not None and callspec.params.get("store_url") == "cluster"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the Redis Cluster as soon as the run is known to need it: its ~2 s of joining (mostly
    waits) overlap the tests that run before the first one on it, instead of delaying that one."""
    global _cluster
    if _cluster is None and any(_on_cluster(item) for item in session.items):
        pool = ThreadPoolExecutor(1, thread_name_prefix="cluster-start")
        _cluster = pool.submit(PrivateCluster().start)
        pool.shutdown(wait=False)  # the thread ends with the start


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A cluster started for tests that never ran (deselected, -x) is stopped all the same."""
    if _cluster is not None and _cluster.exception() is None:  # waits for a start under way
        _cluster.result().stop()  # after the fixture's own stop, a second finds nothing alive


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A private Redis Cluster (3 masters + 3 replicas) for the session: the one started in the
    background after collection, else (a test collected otherwise) one started now."""
    cluster = _cluster.result() if _cluster is not None else PrivateCluster().start()
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
