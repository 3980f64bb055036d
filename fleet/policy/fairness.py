"""The fair line's order within a class: least attained service per flow. Pure; no I/O.

A call belongs to a flow (its chain, session, API key or client: `gateway.call_spec`). Within
a class the line serves the flow that has been served least: each call's place is its flow's
*start tag*, the service the flow will have had when the call starts, in tokens (input plus
`output_weight` x output) divided by its key's weight. The line's Lua computes it at enqueue
(`fleet.store.flows`), the simulator here, with the same rule:

- a flow with calls still waiting continues after its last one: its calls keep their order;
- otherwise it starts at the class's clock `v` (the least-served waiting flow: just after the
  head of the class, never lower than any clock before), plus what it was served beyond that
  clock, halved every `half_life_s` since its last call: a flow that just took a lot waits
  its turn, and is forgiven with time; a flow never seen starts level, not at zero;
- its next call's start is this one's plus the call's cost (at least 1).

Classes are untouched: the tag is added to `rank * CLASS_SPAN` as the arrival sequence was,
so a class never overtakes a higher one, and requeued or preempted calls keep their score.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fleet.config import Priority


@dataclass(frozen=True, slots=True)
class FlowTag:
    """What the line remembers of one flow in one class: where its last call started plus that
    call's cost (`tag`), when (`at_ms`, Redis clock) and which call it was (`last`)."""

    tag: float
    at_ms: int
    last: str = ""


def call_cost(prompt_tokens: int, output_tokens: int, *, output_weight: float, weight: float = 1.0) -> int:
    """The service a call is charged in its flow: weighted tokens over the key's weight, >= 1."""
    tokens = max(0, prompt_tokens) + output_weight * max(0, output_tokens)
    return max(1, math.ceil(tokens / max(weight, 1e-9)))


def class_clock(stored: float, head: float | None) -> float:
    """The class's clock: just after the head of the class waiting (the least-served waiting
    flow: a newcomer goes after it, never level, so a requeued or preempted call at the head keeps
    its place), never lower than the stored clock (such a call has an old, lower score)."""
    return stored if head is None else max(stored, head + 1)


def flow_start(v: float, flow: FlowTag | None, *, backlogged: bool, now_ms: int, half_life_s: float) -> float:
    """Where a flow's next call starts in its class (see the module doc); whole units, as the
    Lua rounds them."""
    if flow is None:
        return math.floor(v)
    if backlogged:
        return math.floor(max(flow.tag, v))
    if flow.tag <= v:
        return math.floor(v)
    decay = 2.0 ** (-max(0, now_ms - flow.at_ms) / (half_life_s * 1000))
    return math.floor(v + (flow.tag - v) * decay)


def fair_line(line: tuple[int, int, int, int], priority: Priority,
              ahead_in_class: int | None) -> tuple[int, int, int, int]:
    """The line as one call of `priority` sees it under the fair order: of its own class only
    those placed before it (`ahead_in_class`, plus those being admitted); None: the whole class
    (fifo, or nothing known)."""
    if ahead_in_class is None:
        return line
    out = list(line)
    out[priority] = max(0, ahead_in_class)
    return (out[0], out[1], out[2], out[3])


def jain_index(service: Sequence[float]) -> float:
    """Jain's fairness index of the service the flows got: 1 when equal, 1/n when one got it all."""
    xs = [max(0.0, x) for x in service]
    if not xs or not any(xs):
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))
