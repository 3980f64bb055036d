"""Config of a tier's model versions and of how a new version rolls out (`fleet.config.TierConfig`).

The config names the version it describes (`version:`, default `v1`) and may
list more (`versions:`), each differing from the tier's own model in its
engine, weights, engine arguments or sim profile. These seed the model
registry (`fleet.store.model_registry`) on first start; afterwards the
registry is the truth, and the config only adds versions it does not know.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_config import EngineName

VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def valid_version(name: str) -> str:
    """A version name: letters, digits, `.`, `_`, `-`, at most 64; a ValueError says so."""
    if not VERSION_NAME.match(name):
        raise ValueError(f"version name {name!r}: letters, digits, '.', '_' or '-' (at most 64), "
                         "starting with a letter or digit")
    return name


class ModelVersionConfig(BaseModel):
    """One more known version of a tier's model; what is left out is the tier's own."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineName | None = None
    weights: str | None = None  # vllm: the model path or hub id (with revision); openai: the upstream model
    engine_args: dict[str, Any] = Field(default_factory=dict)  # over the tier's vllm:/openai: settings
    sim: dict[str, Any] = Field(default_factory=dict)  # over the tier's sim: profile (nested keys merge)


class RolloutConfig(BaseModel):
    """How a promotion rolls out and is judged (`fleet.policy.rollout`)."""

    model_config = ConfigDict(extra="forbid")

    # The previous version's replicas stay up (not claiming) this long after a promotion:
    # a rollback within it flips them back without a cold start. 0: stop them at once.
    warm_grace_s: float = Field(120.0, ge=0)
    judge_window_s: float = Field(60.0, gt=0)  # how long after a promotion the new version is judged
    min_calls: int = Field(20, ge=1)  # calls the new version must finish in the window before a verdict
    max_error_ratio: float = Field(2.0, gt=1)  # new error rate above this times the old one (or the floor): worse
    error_rate_floor: float = Field(0.01, ge=0, le=1)  # error rates below this are never judged worse
    max_ttft_p99_ratio: float = Field(1.5, gt=1)  # new TTFT p99 above this times the old one: worse
    auto_rollback: bool = True


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, nested mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
