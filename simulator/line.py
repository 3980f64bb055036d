"""A tier's line in simulated time, one `ClassLine` per class: the order the Redis line keeps.

Each call gets a score as ENQUEUE gives it (`fleet.store.line_scripts`): its arrival sequence
in a `fifo` tier, its flow's start tag in a `fair` one, computed by the policy's own functions
(`fleet.policy.fairness`, the rule the line's Lua follows). The head is the lowest score; a
preempted call goes back with its own score, so it keeps its place, as in Redis.

It also keeps what the fair line's measures need: the flows backlogged now (with a call
waiting) and since when, and the service each flow started in the current window, for Jain's
index over the flows backlogged through a window (`FlowShares`).
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

from fleet.policy.fairness import FlowTag, class_clock, flow_start, jain_index


class _Flowing(Protocol):
    flow: str


class Req(Protocol):
    """What the line needs of a call (`simulator.state.Req`; not imported: state imports this)."""

    call: _Flowing
    score: float
    lseq: int


class ClassLine:
    """One class's waiting calls, lowest score first (a sorted list: lines stay short enough)."""

    __slots__ = ("_last_start", "clock", "flows", "keys", "reqs", "shares", "waiting_of")

    def __init__(self, shares: FlowShares | None = None) -> None:
        self.shares = shares  # told when a flow starts and stops waiting
        self.keys: list[tuple[float, int]] = []  # (score, sequence), sorted
        self.reqs: dict[int, Req] = {}  # sequence -> call
        self.flows: dict[str, FlowTag] = {}  # the fair line's memory of each flow (`fleet.store.flows`)
        self.clock = 0.0  # the class clock, as stored
        self.waiting_of: dict[str, int] = {}  # flow -> its calls waiting
        # The last start tag worked out, and what for: admission asks it (`ahead`) and the enqueue
        # that follows at the same instant asks again (`place`). Forgotten at every change of the line.
        self._last_start: tuple[tuple[str, int, float], tuple[float, float]] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __getitem__(self, i: int) -> Req:
        return self.reqs[self.keys[i][1]]

    def _start(self, flow: str, now_ms: int, half_life_s: float) -> tuple[float, float]:
        asked = (flow, now_ms, half_life_s)
        last = self._last_start
        if last is not None and last[0] == asked:
            return last[1]
        head = self.keys[0][0] if self.keys else None
        v = class_clock(self.clock, head)
        rec = self.flows.get(flow)
        backlogged = rec is not None and head is not None and int(rec.last) in self.reqs
        start = flow_start(v, rec, backlogged=backlogged, now_ms=now_ms, half_life_s=half_life_s), v
        self._last_start = (asked, start)
        return start

    def ahead(self, flow: str, now_ms: int, half_life_s: float) -> int:
        """Calls a new call of `flow` would wait behind (admission's view, nothing written)."""
        start, _ = self._start(flow, now_ms, half_life_s)
        return bisect.bisect_left(self.keys, (start, -1))

    def place(self, req: Req, seq: int, cost: int | None, now_ms: int, half_life_s: float) -> None:
        """Put a new call in the line: by `seq` (cost None: fifo), else by its flow's start tag."""
        if cost is None:
            score = float(seq)
        else:
            flow = req.call.flow
            score, v = self._start(flow, now_ms, half_life_s)
            self.clock = max(self.clock, v)
            self.flows[flow] = FlowTag(score + cost, now_ms, str(seq))
            self._last_start = None
        req.score, req.lseq = score, seq
        self._add(req)

    def put_back(self, req: Req) -> None:
        """A preempted call: back with its own score (the head of its class, if it was first)."""
        self._add(req)

    def _add(self, req: Req) -> None:
        self._last_start = None
        bisect.insort(self.keys, (req.score, req.lseq))
        self.reqs[req.lseq] = req
        f = req.call.flow
        self.waiting_of[f] = self.waiting_of.get(f, 0) + 1
        if self.shares is not None:
            self.shares.up(f)

    def popleft(self) -> Req:
        _, seq = self.keys.pop(0)
        return self._gone(seq)

    def remove(self, req: Req) -> None:
        """A call that left the line other than at its head (its deadline passed)."""
        i = bisect.bisect_left(self.keys, (req.score, req.lseq))
        if i < len(self.keys) and self.keys[i][1] == req.lseq:
            del self.keys[i]
            self._gone(req.lseq)

    def _gone(self, seq: int) -> Req:
        self._last_start = None
        req = self.reqs.pop(seq)
        f = req.call.flow
        left = self.waiting_of[f] - 1
        if self.shares is not None:
            self.shares.down(f)
        if left:
            self.waiting_of[f] = left
        else:
            del self.waiting_of[f]
        return req


class FlowShares:
    """Jain's index over the flows backlogged (a call waiting, in any line) through the whole of
    each window of `window_s`, weighted by the service in the window: what a fair order must
    share equally; a flow that waits only now and then asks for less than its share."""

    __slots__ = ("clock", "count", "served", "since", "sum_index", "sum_weight", "window_s")

    def __init__(self, clock: Any, window_s: float = 5.0) -> None:
        self.clock = clock  # anything with `t`, the simulated time (the event queue)
        self.window_s = window_s
        self.count: dict[str, int] = {}  # flow -> its calls waiting
        self.since: dict[str, float] = {}  # flow -> when it last started waiting
        self.served: dict[str, float] = {}  # flow -> service started in this window
        self.sum_index = 0.0
        self.sum_weight = 0.0

    def up(self, flow: str) -> None:
        n = self.count.get(flow, 0)
        if n == 0:
            self.since[flow] = self.clock.t
        self.count[flow] = n + 1

    def down(self, flow: str) -> None:
        n = self.count[flow] - 1
        if n:
            self.count[flow] = n
        else:
            del self.count[flow]
            del self.since[flow]

    def close_window(self, t: float) -> None:
        """At a window's end: judge the flows backlogged since its start, then start the next."""
        start = t - self.window_s
        through = [f for f, s in self.since.items() if s <= start]
        if len(through) >= 2:
            service = [self.served.get(f, 0.0) for f in through]
            total = sum(service)
            if total > 0:
                self.sum_index += jain_index(service) * total
                self.sum_weight += total
        self.served.clear()

    @property
    def index(self) -> float | None:
        """The service-weighted mean index; None when no window had two flows backlogged through it."""
        return self.sum_index / self.sum_weight if self.sum_weight else None
