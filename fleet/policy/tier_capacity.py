"""What the policy assumes one replica of a tier does: its start-up, its service times, its rate.

Built from the tier's `capacity:` profile (whose missing fields come from its
`sim:` profile) and the calibration the scaler measured and published
(`fleet.policy.calibration`). Admission and scaling read it alike, live and in
the simulator. Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.config import TierConfig
from fleet.policy.capacity import decode_step_s, startup_seconds

# A call that sends no max_tokens may generate this many at most (or the tier's limit, if lower).
DEFAULT_MAX_TOKENS = 256


def replica_concurrency(slots: int, kv_capacity_tokens: int | None, tokens_per_request: int) -> int:
    """Requests one replica runs at once: its slots, but no more than its KV cache holds
    at the typical request shape (a replica that accepts more only queues them inside,
    where the line cannot see them). Always at least one."""
    if kv_capacity_tokens is None or tokens_per_request <= 0:
        return max(1, slots)
    return max(1, min(slots, kv_capacity_tokens // tokens_per_request))


@dataclass(frozen=True, slots=True)
class TierCapacity:
    """One replica of the tier, as the policy plans with it."""

    slots: int
    startup_s: float  # launch to serving (calibrated: measured when replicas have been started)
    prefill_tokens_per_s: float
    decode_base_s: float
    decode_per_seq_s: float
    kv_capacity_tokens: int
    typical_prompt_tokens: int
    typical_output_tokens: int
    max_tokens_default: int  # what a call that names no max_tokens may generate
    rate_factor: float = 1.0  # measured / modelled throughput (calibration); 1 until measured
    # Worked out once (the simulator asks for every call): see `__post_init__`.
    batch: int = field(init=False)  # the batch a busy replica runs: its slots, as many as its KV cache holds
    per_replica_rate: float = field(init=False)  # requests per second one full replica serves, typical shape
    _step_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the derived figures are set once, here
        batch = replica_concurrency(self.slots, self.kv_capacity_tokens,
                                    self.typical_prompt_tokens + self.typical_output_tokens)
        set_(self, "batch", batch)
        set_(self, "_step_s", decode_step_s(self.decode_base_s, self.decode_per_seq_s, batch))
        set_(self, "per_replica_rate", batch / self.service_s(self.typical_prompt_tokens, self.typical_output_tokens))

    def service_s(self, prompt_tokens: int, output_tokens: int, batch: int | None = None) -> float:
        """A request's own service time on a busy replica (a full batch, its own tokens)."""
        step = self._step_s if batch is None else decode_step_s(self.decode_base_s, self.decode_per_seq_s, batch)
        return (prompt_tokens / self.prefill_tokens_per_s + output_tokens * step) / self.rate_factor

    @property
    def tokens_per_s(self) -> float:
        """Tokens (prompt and completion) per second one full replica serves at the typical shape."""
        return self.per_replica_rate * (self.typical_prompt_tokens + self.typical_output_tokens)

    def output_estimate(self, max_tokens: int | None) -> int:
        """The output length admission assumes for a call: what it asked for at most (`max_tokens`,
        None when it named none), or the typical answer when that is shorter."""
        if max_tokens is not None:
            return max_tokens
        return min(self.max_tokens_default, self.typical_output_tokens)


def default_max_tokens(tc: TierConfig) -> int:
    """The most a call that names no max_tokens may generate on this tier."""
    return min(DEFAULT_MAX_TOKENS, tc.max_tokens_limit)


def modelled_startup_s(tc: TierConfig) -> float:
    """The start-up the config assumes, before any is measured: `capacity.startup_s`, else the
    sim profile's weights / load speed + warm-up."""
    if tc.capacity.startup_s is not None:
        return tc.capacity.startup_s
    p = tc.sim
    return startup_seconds(p.weights_gb * 1e9, p.load_gb_s * 1e9, p.warmup_s)


def tier_capacity(tc: TierConfig, startup_s: float | None = None, rate_factor: float = 1.0) -> TierCapacity:
    """The tier's capacity: its `capacity:` profile, each missing field from `sim:`, with what the
    calibration measured (`startup_s`, `rate_factor`) on top."""
    c, p = tc.capacity, tc.sim
    step = c.decode_step or p.decode_step
    return TierCapacity(
        slots=tc.slots, startup_s=modelled_startup_s(tc) if startup_s is None else max(0.0, startup_s),
        prefill_tokens_per_s=c.prefill_tokens_per_s or p.prefill_tokens_per_s,
        decode_base_s=step.base_s, decode_per_seq_s=step.per_seq_s,
        kv_capacity_tokens=c.kv_capacity_tokens or p.kv_capacity_tokens,
        typical_prompt_tokens=c.typical_prompt_tokens or p.typical_prompt_tokens,
        typical_output_tokens=c.typical_output_tokens or p.typical_output_tokens,
        max_tokens_default=default_max_tokens(tc), rate_factor=rate_factor)
