"""An API key's dollars: what a call costs a key, and the most it may cost. Pure; no I/O.

The accounting itself (reserve at admission, settle at completion, release on
refusal) is atomic in Redis: `fleet.store.key_budget`.
"""

from __future__ import annotations

from fleet.config import TierConfig
from fleet.policy.capacity import cost_per_million_tokens


def key_usd_per_million(tc: TierConfig, replica_tokens_per_s: float) -> float:
    """The price a key pays per million tokens on this tier.

    The tier's per-token price where one is configured; otherwise the
    replica's hourly price spread over what a full replica serves, so keys on
    GPU-hour-priced tiers still have a dollar cost per call.
    """
    if tc.usd_per_million_tokens is not None:
        return tc.usd_per_million_tokens
    if tc.hourly_usd <= 0:
        return 0.0
    return cost_per_million_tokens(tc.hourly_usd, replica_tokens_per_s)


def tokens_usd(tokens: int, usd_per_million: float) -> float:
    return tokens * usd_per_million / 1e6


def worst_case_usd(prompt_tokens: int, max_tokens: int, usd_per_million: float) -> float:
    """The most a request may cost: its prompt estimate and every token it may generate."""
    return (max(0, prompt_tokens) + max(0, max_tokens)) * usd_per_million / 1e6
