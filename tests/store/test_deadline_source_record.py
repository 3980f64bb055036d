"""Where a call's deadline came from (header, client, default) is in its record in the line, while
it waits and after it ends (issue 37: the metrics have it, and so does the request's record)."""

from __future__ import annotations

import pytest

from fleet.config import Priority
from fleet.store.events import Done
from fleet.store.line import Line

pytestmark = pytest.mark.parametrize("store_url", ["redis"], indirect=True)


async def _field(line: Line, rid: str, name: str) -> str | None:
    raw = await line.redis.hget(line.keys.request(rid), name)
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


async def test_the_record_holds_the_deadline_source_while_waiting_and_after_the_end(line: Line) -> None:
    await line.enqueue("r-client", Priority.interactive, b"{}", 30_000, deadline_source="client")
    await line.enqueue("r-header", Priority.interactive, b"{}", 5_000, deadline_source="header")
    await line.enqueue("r-none", Priority.interactive, b"{}", 5_000)
    assert await _field(line, "r-client", "deadline_source") == "client"
    assert await _field(line, "r-header", "deadline_source") == "header"
    assert await _field(line, "r-none", "deadline_source") is None  # not given: not written
    claimed = {c.rid: c for c in await line.claim("w", 3, 5)}
    assert await line.finish("r-client", "completed", Done(1, "stop", {}), owner=claimed["r-client"].owner)
    # The payload is gone from the ended record; its outcome and its deadline's source are kept.
    assert await _field(line, "r-client", "payload") is None
    assert await _field(line, "r-client", "outcome") == "completed"
    assert await _field(line, "r-client", "deadline_source") == "client"
