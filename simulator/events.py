"""The simulator's clock and its one heap of events.

Arrivals come from the pre-drawn trace in time order; everything else that
happens at a known instant is an event here. At the same instant, events are
handled in the order of their kinds: capacity appears and frees up before the
scaler looks.
"""

from __future__ import annotations

import heapq
from typing import Any

READY, DECODED, PREFILLED, ABORT, EXPIRE, TICK, CLIENT = range(7)  # CLIENT: (fn, arg), a caller's SDK


class EventQueue:
    """`t`: seconds into the replay, the simulated now."""

    __slots__ = ("_seq", "heap", "t")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.t = 0.0

    def push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, kind, self._seq, obj))

    def next_at(self) -> float | None:
        return self.heap[0][0] if self.heap else None

    def pop(self) -> tuple[float, int, Any]:
        t, kind, _, obj = heapq.heappop(self.heap)
        return t, kind, obj
