"""Retries as the fleet judges them: who an attempt is, and whether the retry budget admits it. Pure.

A retry that joins the call its client left (`fleet.store.retries`) costs nothing. One that joins
nothing runs the call again, so retries are admitted up to a share of first attempts over a
window, with a floor (Finagle's and Envoy's retry budgets): a storm of retries cannot take the
tier's capacity from first attempts. The Lua in `fleet.store.retries.RETRY_GATE` applies the same
rule, held to this one by tests/store/test_retries.py.
"""

from __future__ import annotations

import hashlib


def retry_allowed(firsts: int, retries: int, *, ratio: float, window_s: float, min_per_s: float) -> bool:
    """One more retry fits the budget: `retries` so far in the window, plus this one, are at most
    `ratio` of the first attempts in it, or `min_per_s` a second, whichever is more."""
    return retries + 1 <= max(ratio * firsts, min_per_s * window_s)


def call_identity(key: str, body: bytes, idempotency_key: str | None = None) -> tuple[str, str]:
    """(identity, body digest) of an attempt: its `Idempotency-Key`, else its body, within its API
    key. An SDK re-sends the same body bytes on a retry, so the same key sending the same body is
    the same call."""
    digest = hashlib.sha256(body).hexdigest()[:32]
    basis = f"{key}\0idem\0{idempotency_key}" if idempotency_key else f"{key}\0body\0{digest}"
    return hashlib.sha256(basis.encode()).hexdigest()[:32], digest
