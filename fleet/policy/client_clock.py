"""The caller's own clock: what deadline a call is given and what its refusal tells the SDK. Pure; no I/O.

An agent's SDK states its clock on every attempt (`x-stainless-read-timeout` or
`x-stainless-timeout`: its timeout in seconds; `x-stainless-retry-count`: 0 on the first
attempt, then 1, 2). A call with no `X-Deadline-Ms` is judged on that clock: a whole answer
must come within what the caller will still wait, a stream's first chunk likewise. When a
retry joins the call its client left (`fleet.policy.retries`), the caller waits across the
attempts it will still make, so the call may take that long; otherwise only this attempt's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

DeadlineSource = Literal["header", "client", "default"]
DEADLINE_SOURCES: tuple[DeadlineSource, ...] = ("header", "client", "default")

# An answer must be on its way back before the caller's timeout fires, not at it: admission
# judges a call on its client's clock this much (or a twentieth) short of the patience.
CLIENT_MARGIN_MS = 100

# What the openai client does not retry past (`_base_client`: a Retry-After over about a minute
# is not honoured): a refusal that asks for longer is as good as final.
SDK_LONGEST_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class CallClock:
    """When the fleet gives a call up, and what admission judges it against."""

    deadline_ms: int  # from receipt: the line expires it, the engine aborts it, after this
    source: DeadlineSource
    judged_ms: int  # what admission judges its predicted finish (or first chunk) against
    # On the client's clock, what the caller will wait across the attempts it will still make
    # (retries join the call): admission judges a call whose own service does not fit one
    # attempt against this instead. None: not on the client's clock.
    patience_ms: int | None = None
    # What `judged_ms` bounds: the whole answer, or (a stream on the client's clock) its first
    # chunk: an SDK's read timeout runs between chunks, not over the whole stream.
    first_token: bool = False
    attempts_left: int | None = None  # retries the caller will still make; None: it did not say
    retry_count: int | None = None  # which attempt this is, as its SDK counts (0: the first)

    def bounded(self, left_ms: int) -> CallClock:
        """This clock within what is left of its chain's deadline (`X-Chain-Deadline-Ms`)."""
        left = max(1, left_ms)
        return replace(self, deadline_ms=min(self.deadline_ms, left), judged_ms=min(self.judged_ms, left),
                       patience_ms=None if self.patience_ms is None else min(self.patience_ms, left))

    @property
    def retry(self) -> bool:
        """Its SDK says it is a retry."""
        return (self.retry_count or 0) > 0


def attempts_left(retry_count: int, sdk_retries: int) -> int:
    """Retries an SDK will still make after this attempt (`retry_count` 0 is its first)."""
    return max(0, sdk_retries - max(0, retry_count))


def patience_s(timeout_s: float, left: int, *, joined: bool) -> float:
    """How long the caller will still wait for this call's answer: this attempt's timeout, and
    each retry's when retries join the call (their backoffs not counted: a lower bound)."""
    return timeout_s * (1 + (left if joined else 0))


def call_clock(*, header_ms: int | None, timeout_s: float | None, retry_count: int | None, stream: bool,
               default_ms: int, max_ms: int, sdk_retries: int, joined: bool) -> CallClock:
    """The clock a call runs on.

    - `X-Deadline-Ms` (`header_ms`) wins: the caller said what it wants.
    - Else the SDK's timeout (`timeout_s`): admission judges a whole answer (a stream: its first
      chunk) against this attempt's timeout, so that what is admitted is answered before the
      client gives up on it; a call whose own service does not fit one attempt is judged on the
      patience left across the retries that will join it (`patience_s`). The call's deadline is
      that patience (a stream's is the default: the SDK's timeout runs between chunks).
    - Else `default_ms`.
    """
    left = None if retry_count is None else attempts_left(retry_count, sdk_retries)
    if header_ms is not None:
        return CallClock(header_ms, "header", header_ms, attempts_left=left, retry_count=retry_count)
    if timeout_s is None or timeout_s <= 0 or not math.isfinite(timeout_s):
        return CallClock(default_ms, "default", default_ms, attempts_left=left, retry_count=retry_count)
    assumed = left if left is not None else sdk_retries
    patience_ms = max(1, min(max_ms, int(patience_s(timeout_s, assumed, joined=joined) * 1000)))
    attempt_ms = max(1, min(max_ms, int(timeout_s * 1000)))
    deadline_ms = max(default_ms, patience_ms) if stream else patience_ms
    return CallClock(deadline_ms, "client", _short(attempt_ms), _short(patience_ms), first_token=stream,
                     attempts_left=left, retry_count=retry_count)


def _short(ms: int) -> int:
    """A bound on the client's clock, judged a little short of it (`CLIENT_MARGIN_MS`)."""
    return max(1, ms - max(CLIENT_MARGIN_MS, ms // 20))


def sustained_overload(*, retry_after_s: float, busy_s: float, attempts_left: int | None,
                       starting: int = 0, sdk_retries: int = 2) -> bool:
    """The tier's line has been overloaded too long for a retry within the caller's patience to be
    served: the forecast behind Retry-After (the line drains at the service rate, nothing new
    arriving) is already contradicted by what was observed.

    The caller's SDK would make its retries `retry_after_s` apart (it honours our Retry-After), the
    last of them `retry_after_s x retries left` from now. The line has held a call for `busy_s`
    (its oldest wait) while it kept refusing: arrivals are refilling it as fast as it drains. A
    spell that has already lasted as long as the caller's whole patience is forecast to outlast it
    (it has lasted at least that long; nothing observed says it ends sooner), so every retry
    would be refused again. Not so while a replica is `starting`: capacity is on its way, and the
    line will drain faster than it has. A short burst (a spell younger than that patience) is
    still told to retry."""
    if starting > 0 or busy_s <= 0:
        return False
    retries = sdk_retries if attempts_left is None else attempts_left
    patience = max(0.0, retry_after_s) * max(1, retries)
    return busy_s >= patience


def should_retry(*, retry_after_s: float, retryable: bool, attempts_left: int | None, busy_s: float = 0.0,
                 starting: int = 0) -> bool:
    """`x-should-retry` on a refusal: a retry can be served (the refusal is not final: a spent
    budget, a key not allowed, a deadline no empty line could meet are) within what the SDK
    honours, the tier's line is not in a sustained overload (`sustained_overload`, from its
    `busy_s` and replicas `starting`), and the caller has a retry left (or did not say).

    The gateway's refusals (`gateway.tickets.refusal`) and the simulator's callers
    (`simulator.clients`) both ask this, with what their admission observed of the tier."""
    if not retryable or retry_after_s > SDK_LONGEST_RETRY_AFTER_S:
        return False
    if attempts_left is not None and attempts_left <= 0:
        return False
    return not sustained_overload(retry_after_s=retry_after_s, busy_s=busy_s, attempts_left=attempts_left,
                                  starting=starting)
