"""The agent's SDK as it retries: how long it waits before its next attempt, and whether it makes one. Pure.

What the official `openai` Python client does (`_base_client`: `_calculate_retry_timeout`,
`_should_retry`), and so every agent framework on it: up to `max_retries` (2) more attempts after
the first; before each, a server's Retry-After (`retry-after-ms` first) when it is positive and at
most a minute (`openai` 3.x: two), else `0.5 s x 2^n` (n: retries already taken) capped at 8 s, shortened by up to a
quarter at random (jitter). It obeys `x-should-retry` over its own rules; without it, it retries a
timeout, 408, 409, 429 and 5xx. The simulator's callers follow it (`simulator.clients`);
docs/client-clock.md says what the fleet does with it.
"""

from __future__ import annotations

import math

from fleet.policy.client_clock import SDK_LONGEST_RETRY_AFTER_S

SDK_INITIAL_BACKOFF_S = 0.5
SDK_MAX_BACKOFF_S = 8.0
SDK_JITTER = 0.25  # the backoff is shortened by up to this share, at random


def backoff_s(retries_taken: int, u: float, *, initial_s: float = SDK_INITIAL_BACKOFF_S,
              max_s: float = SDK_MAX_BACKOFF_S, jitter: float = SDK_JITTER) -> float:
    """The SDK's own wait before its next attempt, `retries_taken` retries made so far; `u` in
    [0, 1) is its random draw (`1 - jitter * u` of the capped exponential)."""
    sleep = min(initial_s * 2.0 ** min(max(0, retries_taken), 1000), max_s)
    return max(0.0, sleep * (1.0 - jitter * u))


def honours_retry_after(retry_after_s: float | None, longest_s: float = SDK_LONGEST_RETRY_AFTER_S) -> bool:
    """The SDK waits what the server asked: positive and at most `longest_s` (a minute, as the
    fleet assumes; `openai` 3.x's `MAX_RETRY_AFTER_DELAY` is two)."""
    return retry_after_s is not None and math.isfinite(retry_after_s) and 0 < retry_after_s <= longest_s


def retry_wait_s(retries_taken: int, u: float, *, retry_after_s: float | None = None, honour: bool = True,
                 initial_s: float = SDK_INITIAL_BACKOFF_S, max_s: float = SDK_MAX_BACKOFF_S,
                 jitter: float = SDK_JITTER, longest_s: float = SDK_LONGEST_RETRY_AFTER_S) -> float:
    """How long the SDK waits before its next attempt: the server's Retry-After where it honours
    it (`honour`, and `honours_retry_after`), else its own backoff (`backoff_s`)."""
    if honour and honours_retry_after(retry_after_s, longest_s):
        assert retry_after_s is not None
        return retry_after_s
    return backoff_s(retries_taken, u, initial_s=initial_s, max_s=max_s, jitter=jitter)


def retries_refusal(status: int, should_retry: bool | None, retry_after_s: float | None,
                    longest_s: float = SDK_LONGEST_RETRY_AFTER_S) -> bool:
    """Whether the SDK retries an answer of `status` (a refusal or an error), before counting its
    retries left: a Retry-After over `longest_s` is final; else `x-should-retry` (`should_retry`,
    None when absent) wins; else 408, 409, 429 and 5xx are retried."""
    if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s > longest_s:
        return False
    if should_retry is not None:
        return should_retry
    return status in (408, 409, 429) or status >= 500
