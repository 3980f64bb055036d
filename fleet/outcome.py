"""How a call ended: the one vocabulary (`Outcome`) and the one rule that decides it (`infer_outcome`).

Every call ends in exactly one outcome, and the same word is written everywhere it is kept: in
the request's hash and the line's counters (the Lua scripts of `fleet.store`), in
`fleet_requests_total{outcome}` (docs/metrics.md), in a ticket's settle-or-release
(`gateway.tickets`) and in the orphan sweep (`gateway.redis_loss`).

Two kinds of word:

- **The line's** (`LINE_OUTCOMES`): a call that reached the line ends there in one of these, and
  the line counts it (completed, expired, cancelled, failed, unavailable).
- **The gateway's only** (`GATEWAY_ONLY`): a call refused before it reached the line (shed by
  admission's 429, refused for its body or key). The line never records these; a call that did
  reach the line and is then refused by the gateway is recorded there as failed
  (`recorded_in_line`).

`infer_outcome(cause)` is a small pure table from what ended the call (the worker's final
event, the caller leaving, a typed refusal, Redis gone) to its outcome, in the style of the
Gateway API Inference Extension's `inferOutcome(cause, isQueued)`.
"""

from __future__ import annotations

from enum import StrEnum

from redis.exceptions import RedisError

from fleet.store.events import Done, Failed


class Outcome(StrEnum):
    """A call's end. The values are the stored and exported words: never rename one."""

    COMPLETED = "completed"  # the answer went out whole (or its last chunk did)
    EXPIRED = "expired"  # its deadline passed first, in the line or running
    CANCELLED = "cancelled"  # its caller left (or its chain was cancelled)
    FAILED = "failed"  # the fleet failed it (a worker's error, a lost worker, a bad answer)
    UNAVAILABLE = "unavailable"  # the fleet's Redis did not answer: told the typed 503
    SHED = "shed"  # refused at admission with the typed 429 (gateway only)
    REFUSED = "refused"  # refused before the line for what it sent: its body, key or headers (gateway only)

    @property
    def gateway_only(self) -> bool:
        """Counted by the gateway, never recorded in the line."""
        return self in GATEWAY_ONLY


GATEWAY_ONLY: frozenset[Outcome] = frozenset({Outcome.SHED, Outcome.REFUSED})
# The line's words, in the order of its scripts' `OUTCOMES` (fleet.store.line_scripts).
LINE_OUTCOMES: tuple[Outcome, ...] = tuple(o for o in Outcome if o not in GATEWAY_ONLY)


class CallerLeft(Exception):
    """The caller disconnected before its answer was whole (the gateway's `ClientGone` is one)."""


# A worker's (or the line's) failure event, by its error type; any other type is the fleet's failure.
_BY_FAILURE_TYPE: dict[str, Outcome] = {
    "deadline_exceeded": Outcome.EXPIRED,
    "cancelled": Outcome.CANCELLED,
}
# An error told to the caller, by its HTTP status; any other 4xx is `REFUSED` (what it sent, its
# key, its chain), any other 5xx the fleet's failure (a worker's answer of the wrong shape).
_BY_STATUS: dict[int, Outcome] = {
    429: Outcome.SHED,
    499: Outcome.CANCELLED,
    503: Outcome.UNAVAILABLE,
}
# An exception without a status, by its type (checked in order: the first that matches).
_BY_EXCEPTION: tuple[tuple[type[BaseException], Outcome], ...] = (
    (CallerLeft, Outcome.CANCELLED),
    (RedisError, Outcome.UNAVAILABLE),
    (TimeoutError, Outcome.UNAVAILABLE),
)


def of_failure_type(failure_type: str) -> Outcome:
    """The outcome of a failure event (`fleet.store.events.Failed`) by its error type."""
    return _BY_FAILURE_TYPE.get(failure_type, Outcome.FAILED)


def of_status(status: int) -> Outcome:
    """The outcome of a call its caller was told HTTP `status` (an error: 4xx or 5xx)."""
    return _BY_STATUS.get(status, Outcome.FAILED if status >= 500 else Outcome.REFUSED)


def infer_outcome(cause: Done | Failed | BaseException | type[BaseException] | int | None) -> Outcome:
    """What ended a call, as its outcome:

    - a final event: `Done` is completed; `Failed` by its error type (`of_failure_type`);
    - an HTTP status the caller was told (a typed refusal, or an exception carrying `status`
      such as the gateway's `APIError`): `of_status`;
    - an exception (or its type) without one: the caller leaving is cancelled, Redis gone or
      silent is unavailable, anything else the fleet's failure;
    - None: the call was left without an answer told (a path that forgot its end): failed.
    """
    if cause is None:
        return Outcome.FAILED
    if isinstance(cause, Done):
        return Outcome.COMPLETED
    if isinstance(cause, Failed):
        return of_failure_type(cause.type)
    if isinstance(cause, int):
        return of_status(cause)
    status = getattr(cause, "status", None) if isinstance(cause, BaseException) else None
    if isinstance(status, int):
        return of_status(status)
    kind = cause if isinstance(cause, type) else type(cause)
    for base, outcome in _BY_EXCEPTION:
        if issubclass(kind, base):
            return outcome
    return Outcome.FAILED


_KEPT_IN_LINE = frozenset({Outcome.CANCELLED, Outcome.EXPIRED, Outcome.UNAVAILABLE})


def recorded_in_line(told: Outcome) -> Outcome:
    """The outcome the line records for a call the gateway ends there itself (or the orphan sweep
    does), its caller told `told`: a caller gone, a deadline passed, Redis away stand as told; any
    other end the gateway decides (a refusal after the line, a bad answer) is the fleet's failure,
    and completed is only ever the worker's word (the line saw its answer)."""
    return told if told in _KEPT_IN_LINE else Outcome.FAILED
