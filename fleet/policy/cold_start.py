"""A replica's cold start by phase, and the start-up model's error against it.

A replica's cold start has three phases (`PHASES`), each answering to its own knob
(docs/operations.md, "Cold starts by phase"):

- `load`: the weights in memory or on the device (weight format and storage);
- `init`: the engine up: KV cache allocated, graphs captured or compiled
  (`enforce_eager`, the compile cache);
- `first_token`: a warm-up call answered (the warm-up).

The model the fleet budgets with, `startup_seconds(weights, load speed, warm-up)`,
has two terms: the weights over the load speed (`load`) and a warm-up, which covers
`init` and `first_token` together. `model_error` sets the measured phases against
those terms, so a wrong profile shows as the error of the term it got wrong.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fleet.config import TierConfig
from fleet.policy.capacity import startup_seconds

Phase = Literal["load", "init", "first_token"]
PHASES: tuple[Phase, ...] = ("load", "init", "first_token")
# The model's terms: `load` is the weights over the load speed; `warmup` is init + first_token.
Term = Literal["load", "warmup", "total"]
TERMS: tuple[Term, ...] = ("load", "warmup", "total")


@dataclass(frozen=True, slots=True)
class ColdStartPhases:
    """One replica's cold start, phase by phase, in seconds, as its engine measured it.

    `compile_s`: the part of `init` its engine says went to compiling, when it says (vLLM's
    `compilation_time`); `total_s`: the whole start as the engine timed it, which may hold
    more than the phases (a process to spawn, imports): `unaccounted_s` is that rest."""

    load_s: float
    init_s: float
    first_token_s: float
    total_s: float
    compile_s: float | None = None

    def seconds(self, phase: Phase) -> float:
        return {"load": self.load_s, "init": self.init_s, "first_token": self.first_token_s}[phase]

    @property
    def phases_s(self) -> float:
        return self.load_s + self.init_s + self.first_token_s

    @property
    def unaccounted_s(self) -> float:
        return max(0.0, self.total_s - self.phases_s)

    def term(self, term: Term) -> float:
        """The measured figure for one of the model's terms."""
        if term == "load":
            return self.load_s
        if term == "warmup":
            return self.init_s + self.first_token_s
        return self.total_s

    def as_dict(self) -> dict[str, float | None]:
        return {
            "load_s": round(self.load_s, 6),
            "init_s": round(self.init_s, 6),
            "first_token_s": round(self.first_token_s, 6),
            "total_s": round(self.total_s, 6),
            "compile_s": None if self.compile_s is None else round(self.compile_s, 6),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ColdStartPhases:
        compile_s = d.get("compile_s")
        return cls(
            load_s=float(d["load_s"]),
            init_s=float(d["init_s"]),
            first_token_s=float(d["first_token_s"]),
            total_s=float(d["total_s"]),
            compile_s=None if compile_s is None else float(compile_s),
        )


@dataclass(frozen=True, slots=True)
class ModelledStartup:
    """What the config assumes of a cold start: the weights' load and the warm-up, or only the
    total when the tier gives `capacity.startup_s` outright (then `load_s`, `warmup_s` are None)."""

    total_s: float
    load_s: float | None = None
    warmup_s: float | None = None

    def term(self, term: Term) -> float | None:
        return self.total_s if term == "total" else self.load_s if term == "load" else self.warmup_s


def modelled_startup(tc: TierConfig) -> ModelledStartup:
    """The tier's modelled cold start by term, as `tier_capacity.modelled_startup_s` takes it:
    `capacity.startup_s` when given (a total only), else the sim profile's weights / load speed
    + warm-up."""
    if tc.capacity.startup_s is not None:
        return ModelledStartup(total_s=tc.capacity.startup_s)
    p = tc.sim
    load = startup_seconds(p.weights_gb * 1e9, p.load_gb_s * 1e9, 0.0)
    return ModelledStartup(total_s=load + p.warmup_s, load_s=load, warmup_s=p.warmup_s)


@dataclass(frozen=True, slots=True)
class TermError:
    """One term: the median measured, the model's, and measured - modelled (positive: slower than
    modelled) and measured / modelled (None where the model has no figure or it is 0)."""

    term: Term
    measured_s: float
    modelled_s: float | None
    error_s: float | None
    ratio: float | None


def median_phases(measured: Iterable[ColdStartPhases]) -> dict[str, float] | None:
    """The median of each phase, of the total and of what no phase holds (`unaccounted_s`: a vLLM
    replica's process spawn and imports) over the replicas that reported; None: none did."""
    ms = list(measured)
    if not ms:
        return None
    out = {f"{p}_s": statistics.median(m.seconds(p) for m in ms) for p in PHASES}
    out["total_s"] = statistics.median(m.total_s for m in ms)
    out["unaccounted_s"] = statistics.median(m.unaccounted_s for m in ms)  # the start no phase holds
    return out


def model_error(measured: Sequence[ColdStartPhases], modelled: ModelledStartup) -> list[TermError]:
    """Each of the model's terms against the median of what the replicas measured; [] when no
    replica has reported its phases yet."""
    if not measured:
        return []
    out = []
    for term in TERMS:
        got = statistics.median(m.term(term) for m in measured)
        want = modelled.term(term)
        err = None if want is None else got - want
        ratio = None if want is None or want <= 0 else got / want
        out.append(TermError(term, got, want, err, ratio))
    return out
