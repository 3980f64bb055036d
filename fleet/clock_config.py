"""What the fleet reads of a caller's own clock, and how much it lets retries cost: `client_clock:`.

The official `openai` and `anthropic` Python clients (and every agent framework on them) send,
on every attempt, their timeout (`x-stainless-read-timeout`, or `x-stainless-timeout`) and
which attempt this is (`x-stainless-retry-count`: 0, then 1, 2). By default they make up to
3 attempts, 0.5 s x 2^n apart (at most 8 s, with jitter). docs/client-clock.md.
"""

from __future__ import annotations

from pydantic import Field

from fleet.engine_config import _Strict


class RetryBudget(_Strict):
    """Retries that join no call are admitted up to a share of first attempts (Finagle, Envoy)."""

    ratio: float = Field(0.2, ge=0, le=10)  # retries per first attempt over the window
    window_s: float = Field(10.0, gt=0, le=3600)
    min_per_s: float = Field(3.0, ge=0)  # always allowed, so a quiet tier's few retries pass


class ClientClock(_Strict):
    """The caller's clock, as its SDK states it, and the retries it will make."""

    # Read the SDK's timeout and retry count; off, a call without X-Deadline-Ms gets
    # `default_deadline_ms` and every attempt is a new call (the fleet before this).
    enabled: bool = True
    # Attempts an SDK makes after its first, when it says nothing of them (the openai and
    # anthropic clients' default is 2).
    sdk_retries: int = Field(2, ge=0, le=10)
    # How long a call whose client left keeps its place (or keeps running) for a retry of it
    # to take over: about the SDK's longest backoff (8 s, with its jitter). 0: never kept.
    retry_grace_s: float = Field(10.0, ge=0, le=300)
    retry_budget: RetryBudget = Field(default_factory=RetryBudget)
