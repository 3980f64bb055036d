"""Engines a worker can drive: `sim` (latency model), `vllm`, `openai` (upstream)."""

from __future__ import annotations

from fleet.config import TierConfig
from workers.engines.base import Engine


def build_engine(name: str, tier: TierConfig, *, time_scale: float = 1.0) -> Engine:
    if name == "sim":
        from workers.engines.sim import SimEngine

        return SimEngine(tier.sim, time_scale=time_scale)
    if name == "vllm":
        from workers.engines.vllm_engine import VllmEngine

        return VllmEngine(tier.vllm)
    if name == "openai":
        from workers.engines.openai_engine import OpenAIEngine

        return OpenAIEngine(tier.openai)
    raise ValueError(f"unknown engine {name!r}; engines are sim, vllm, openai")
