"""The `sim` engine's GPU latency model: pure math, shared by the worker's
`sim` engine (in real time) and the simulator (in simulated time)."""

from __future__ import annotations

from fleet.config import SimProfile
from fleet.policy import startup_seconds


def cold_start_s(p: SimProfile) -> float:
    """Weights load plus warm-up, the cold-start tax of one replica."""
    return startup_seconds(p.weights_gb * 1e9, p.load_gb_s * 1e9, p.warmup_s)


def prefill_s(p: SimProfile, prompt_tokens: int) -> float:
    return prompt_tokens / p.prefill_tokens_per_s


def decode_step_s(p: SimProfile, batch: int) -> float:
    """One decode step for a batch: a fixed cost plus a per-sequence cost,
    so time per output token grows with the batch (the throughput-latency trade)."""
    return p.decode_step.base_s + p.decode_step.per_seq_s * max(1, batch)


def service_s(p: SimProfile, prompt_tokens: int, output_tokens: int, batch: int) -> float:
    """Time to serve one request inside a batch of `batch` sequences."""
    return prefill_s(p, prompt_tokens) + output_tokens * decode_step_s(p, batch)


def per_replica_rate(p: SimProfile, slots: int) -> float:
    """Requests per second one full replica serves at the typical request shape."""
    batch = max(1, min(slots, p.kv_capacity_tokens // (p.typical_prompt_tokens + p.typical_output_tokens)))
    return batch / service_s(p, p.typical_prompt_tokens, p.typical_output_tokens, batch)


def kv_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """KV-cache space a request may need at its longest."""
    return prompt_tokens + max_tokens
