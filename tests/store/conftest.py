"""Fixtures the store tests share: a tier's line on a private Redis (or the Redis Cluster).

`line` is one line in a namespace of its own. A module says which line its tests get by
overriding `line_spec` (the class and its options: an `AffineLine`, a counting one) and, for a
Redis of its own, `line_url`; a module parametrized over `store_url` ("redis", "cluster") runs
its line tests on both."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from fleet.store.connection import connect
from fleet.store.line import Line


@dataclass(frozen=True)
class LineSpec:
    """Which line a module's tests get: its class, its tier and its options."""

    kind: type[Line] = Line
    tier: str = "routing"
    options: dict[str, Any] = field(default_factory=lambda: {"result_ttl_s": 30, "rate_window_s": 5})


@pytest.fixture
def line_spec() -> LineSpec:
    """The plain line; a module whose tests need another overrides this fixture."""
    return LineSpec()


@pytest.fixture
def line_url(store_url: str) -> str:
    """The Redis the line lives on: the session's server, or its cluster where the module is
    parametrized so (`store_url`); a module with a Redis of its own overrides this fixture."""
    return store_url


@pytest.fixture
async def line(line_url: str, line_spec: LineSpec) -> AsyncIterator[Line]:
    """A line in a namespace of its own. Its connections carry the namespace as their client
    name: a test finds its own blocked wait in CLIENT LIST by it (`tests.harness.blocked_in`)."""
    namespace = f"t{uuid.uuid4().hex[:8]}"
    r = connect(line_url, name=namespace)
    try:
        yield line_spec.kind(r, namespace, line_spec.tier, **line_spec.options)
    finally:
        await r.aclose()
