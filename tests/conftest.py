from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from fleet.redis_server import PrivateRedis
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


@pytest.fixture
def fleet(redis_url: str) -> Iterator[Fleet]:
    f = Fleet(redis_url)
    try:
        yield f
    finally:
        f.stop()
