"""The result side of a tier's line: reading callers' result streams, as `Line`'s methods.

Kept apart from `fleet.store.line` so that module stays small; `Line` inherits these, and the
layout they read is in its module doc (`res:<id>` streams, `fleet.store.events`).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from fleet.store.connection import MAX_BLOCK_S
from fleet.store.events import Event, decode
from fleet.store.keys import TierKeys


class LineResults:
    """Result-stream reading for a `Line` (its `redis`, `blocking`, `keys` and `result_ttl_s`)."""

    redis: Redis
    blocking: Redis
    keys: TierKeys
    result_ttl_s: int

    async def read_results(self, keys: list[bytes], after: list[bytes],
                           block_ms: int, count: int = 256) -> list[tuple[bytes, bytes, list[Event]]]:
        """One XREAD over many result streams (`keys`, each after its entry id in `after`, "0-0":
        from the start), on the blocking client, waiting up to `block_ms` for any entry. Returns
        (key, last entry id, events) for each stream with news. The gateway's result reader is the
        one reader (`gateway.result_reader`); a key that is no request's (its wake stream) reads alike."""
        block = max(1, min(block_ms, int(MAX_BLOCK_S * 1000)))
        # Built by hand, not through `xread(dict)`: with thousands of streams the dict and
        # redis-py's argument handling cost more than the read itself.
        resp = await self.blocking.execute_command("XREAD", "BLOCK", block, "COUNT", count, "STREAMS", *keys, *after)
        return [(key, entries[-1][0], [ev for _, f in entries if (ev := decode(f)) is not None])
                for key, entries in resp or () if entries]

    async def read_events(self, rid: str, after: str, block_ms: int) -> list[tuple[str, Event]]:
        """One request's result events after entry `after` ("0-0": from the start), each with its
        entry id, waiting up to `block_ms` (blocking client). For a single reader (tests, benches
        driving the line directly); the gateway reads every call through `read_results`."""
        block = max(1, min(block_ms, int(MAX_BLOCK_S * 1000)))
        resp = await self.blocking.xread({self.keys.result(rid): after}, block=block, count=256)
        return [(_s(entry), ev) for entry, fields in resp[0][1] if (ev := decode(fields)) is not None] if resp else []

    def reader_wake_key(self, reader_id: str) -> bytes:
        """A result reader's own stream in this tier (same slot as the results): `ring_reader`
        adds to it, and the reader names it in every `read_results`."""
        return self.keys.result(f"~gw-{reader_id}").encode()

    async def ring_reader(self, wake_key: bytes) -> None:
        """End a blocked `read_results` that names `wake_key` (one entry kept, with the result TTL)."""
        async with self.redis.pipeline(transaction=False) as p:
            p.xadd(wake_key, {"w": "1"}, maxlen=1, approximate=False)
            p.expire(wake_key, self.result_ttl_s)
            await p.execute()

    async def drop_events(self, *rids: str) -> None:
        """These result streams have been read: drop them now rather than at their TTL."""
        if rids:
            await self.redis.unlink(*(self.keys.result(rid) for rid in rids))


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
