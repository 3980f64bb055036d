"""Commands packed in C: hiredis's `pack_command` for the asyncio clients.

redis-py's blocking client packs a command with hiredis when hiredis is installed; its asyncio
client packs in Python, argument by argument (an encode, a length, three joins each). On the
token path that is most of what a command costs the process: the gateway's one XREAD names
every open call's result stream twice (key and last id: 2,000 arguments at 1,000 open calls,
several times a second), and a worker's EMIT names five a stream a write. py-spy put redis-py's
`pack_command` at 9 to 11% of the gateway's samples at 1,000 open calls (docs/token-relay-profile.md).

`fast(cls)` is `cls` (a redis-py asyncio connection class) with `pack_command` done by hiredis,
whose output is the same RESP bytes. What redis-py's encoder refuses (None, a bool, a dict), hiredis
refuses too, as the same `DataError`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError


class HiredisPack:
    """A mixin over a redis-py asyncio connection: its commands packed by hiredis."""

    def pack_command(self, *args: Any) -> list[bytes]:
        # As redis-py: a command name of several words ("CLIENT SETNAME") goes as separate arguments.
        first = args[0]
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        if bool in map(type, args):  # hiredis would send True as 1; redis-py refuses it
            raise DataError("Invalid input of type: 'bool'. Convert to a bytes, string, int or float first.")
        try:
            return [hiredis.pack_command(args)]
        except TypeError as e:
            raise DataError(f"Invalid input: {e}") from None


@cache
def fast(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """`cls` with hiredis packing its commands (one class per connection class)."""
    if issubclass(cls, HiredisPack):
        return cls
    return type(f"Hiredis{cls.__name__}", (HiredisPack, cls), {})
