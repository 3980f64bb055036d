"""What the policy assumes one replica of a tier does: its start-up, its service times, its rate.

Built from the tier's `capacity:` profile (whose missing fields come from its
`sim:` profile) and the calibration the scaler measured and published
(`fleet.policy.calibration`). Admission and scaling read it alike, live and in
the simulator. Pure; no I/O.

Per class, a replica has only the slots the claim lets that class take: the slots its tier's
`reserved_slots` keep for the classes above it are none of its capacity (`claim_caps`, the rule
the claim itself applies, decision 0080). A replica of 12 slots keeping one for committed runs at
most 11 calls of the classes below; committed may use all 12. Admission plans a call with its
class's slots, and scaling and calibration plan a line with its lowest class's
(`planning_rank`): that class drains with only the slots left to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.config import Priority, TierConfig
from fleet.policy.capacity import decode_step_s, startup_seconds
from fleet.policy.preemption import CLASS_COUNT, claim_caps

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
    # Per class rank, the slots a replica keeps for that class and those above it (the tier's
    # `preemption.reserved_slots`); () when it keeps none.
    reserved: tuple[int, ...] = ()
    # Worked out once (the simulator asks for every call): see `__post_init__`.
    batch: int = field(init=False)  # the batch a busy replica runs: its slots, as many as its KV cache holds
    per_replica_rate: float = field(init=False)  # requests per second one full replica serves, typical shape
    # Per class rank: the calls of that class a replica runs at once (its batch less the slots kept
    # for the classes above it), and the requests per second it serves of them.
    class_batch: tuple[int, ...] = field(init=False)
    class_rate: tuple[float, ...] = field(init=False)
    _step_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the derived figures are set once, here
        batch = replica_concurrency(self.slots, self.kv_capacity_tokens,
                                    self.typical_prompt_tokens + self.typical_output_tokens)
        set_(self, "batch", batch)
        set_(self, "_step_s", decode_step_s(self.decode_base_s, self.decode_per_seq_s, batch))
        set_(self, "per_replica_rate", batch / self.service_s(self.typical_prompt_tokens, self.typical_output_tokens))
        # The claim's own caps on an idle replica, over the calls it runs at once (the live worker
        # claims with that concurrency, `workers.preempting`): what each class may take of it.
        caps = claim_caps(batch, (), dict(enumerate(self.reserved))) if any(self.reserved) else (batch,) * CLASS_COUNT
        set_(self, "class_batch", caps)
        set_(self, "class_rate", tuple(
            n / self.service_s(self.typical_prompt_tokens, self.typical_output_tokens, n) if n > 0 else 0.0
            for n in caps))

    def batch_of(self, rank: int) -> int:
        """The calls of class `rank` one replica runs at once: the slots kept for the classes above
        it are not its to take."""
        return self.class_batch[rank]

    def rate_of(self, rank: int) -> float:
        """Requests per second of class `rank` one busy replica serves (typical shape), on the
        slots that class may take."""
        return self.class_rate[rank]

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


def planning_rank(line: Sequence[int]) -> int:
    """The class a tier's line is planned with (`line`: waiting per class rank, highest first): the
    lowest class waiting, which drains on the slots the classes above leave it; with nothing
    waiting, the lowest class, as the arrivals may be of any."""
    return next((r for r in range(len(line) - 1, -1, -1) if line[r] > 0), CLASS_COUNT - 1)


def reserved_by_rank(tc: TierConfig) -> tuple[int, ...]:
    """The tier's `reserved_slots` per class rank (() when it keeps none)."""
    kept = tc.preemption.reserved_slots
    return tuple(kept.get(p.name, 0) for p in Priority) if kept else ()


def claim_concurrency(tc: TierConfig, kv_capacity_tokens: int | None) -> int:
    """The calls one replica of `tc` claims at once, its engine's KV cache holding
    `kv_capacity_tokens` (None: unknown, its slots alone bound it): its slots, but no more than
    fit at the tier's typical shape. What the live worker claims with (`workers.worker`) and the
    replay takes with (`simulator.taking`), so both hold only what the engine holds."""
    cap = tier_capacity(tc)  # the typical shape the tier plans with, as the worker reads it
    return replica_concurrency(tc.slots, kv_capacity_tokens, cap.typical_prompt_tokens + cap.typical_output_tokens)


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
        max_tokens_default=default_max_tokens(tc), rate_factor=rate_factor, reserved=reserved_by_rank(tc))
