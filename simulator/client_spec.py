"""A caller's client in a scenario file: the SDK's timeout, retries and backoff (`client:`).

    client: {timeout_s: 30, retries: 2, backoff: {initial_s: 0.5, max_s: 8, jitter: 0.25},
             honour_retry_after: true}

Given per arrival stream or chain, or once at the top of the scenario for every stream that
gives none. Without one, a caller waits for its answer however long it takes and never retries
(the replay before clients were modelled). What the replay does with it: `simulator.clients`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.policy.sdk_client import SDK_INITIAL_BACKOFF_S, SDK_JITTER, SDK_MAX_BACKOFF_S


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Backoff(_Strict):
    """The SDK's own wait between attempts: `initial_s * 2^n`, at most `max_s`, less up to `jitter` of it."""

    initial_s: float = Field(SDK_INITIAL_BACKOFF_S, gt=0, le=600)
    max_s: float = Field(SDK_MAX_BACKOFF_S, gt=0, le=3600)
    jitter: float = Field(SDK_JITTER, ge=0, le=1)


class ClientSpec(_Strict):
    """An agent's SDK client (the `openai` client's defaults but the timeout, which agents set)."""

    timeout_s: float = Field(gt=0, le=3600)  # each attempt's: an answer not complete by then is abandoned
    retries: int = Field(2, ge=0, le=10)  # attempts after the first
    backoff: Backoff = Field(default_factory=Backoff)
    honour_retry_after: bool = True  # wait what a refusal's Retry-After says (when at most a minute)


def has_clients(spec: Any) -> bool:
    """Whether any caller of a scenario file (`ScenarioFile`) has an SDK client."""
    return (spec.client is not None or any(getattr(a, "client", None) is not None for a in spec.arrivals)
            or any(c.client is not None for c in spec.chains))
