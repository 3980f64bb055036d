"""Which class runs each engine the config can name: one table, `ENGINES`.

The names are `fleet.engine_config.EngineName` (the config and the command read them there,
as `fleet` imports nothing of the workers); each engine builds itself for a tier
(`Engine.for_tier`). A new engine is a name there, a class, and a row here;
tests/pure/test_engine_registry.py fails until all three agree.
"""

from __future__ import annotations

from fleet.config import EngineName, TierConfig
from workers.engines.base import Engine
from workers.engines.openai_engine import OpenAIEngine
from workers.engines.sim import SimEngine
from workers.engines.vllm_engine import VllmEngine

# Importing these imports no engine's runtime: vLLM loads in `VllmEngine.start`, an upstream is
# reached in `OpenAIEngine.start`.
ENGINES: dict[EngineName, type[Engine]] = {
    EngineName.SIM: SimEngine,
    EngineName.VLLM: VllmEngine,
    EngineName.OPENAI: OpenAIEngine,
}


def build_engine(name: str, tier: TierConfig, *, time_scale: float = 1.0) -> Engine:
    """The engine `name` (the tier's `engine:`, or the command's `--engine`) for a replica of `tier`,
    not started. ValueError: a name no engine has."""
    try:
        cls = ENGINES[EngineName(name)]
    except ValueError:
        raise ValueError(f"unknown engine {name!r}; engines are {', '.join(ENGINES)}") from None
    return cls.for_tier(tier, time_scale=time_scale)


def engine_name(engine: Engine) -> str:
    """The name `engine` is registered under; its class's name for one that is not (a test's)."""
    return next((str(n) for n, cls in ENGINES.items() if type(engine) is cls), type(engine).__name__)
