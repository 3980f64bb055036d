"""Which engines there are, and how the worker asks them what they can do.

The names are declared once (`fleet.engine_config.EngineName`): the config validates `engine:`
against them, the command offers them, and `workers.engines.registry.ENGINES` maps each to its
class. What the worker reads of an engine besides its calls (cold start, model name, KV size,
tokens made) are members of the `Engine` protocol with defaults, read directly: never by
`getattr`/`hasattr`, and never by comparing the engine's name (a scan of the worker's source).
"""

from __future__ import annotations

import ast
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from fleet.config import EngineName, OpenAIUpstream, SimProfile, TierConfig, VllmSettings
from fleet.model_config import ModelVersionConfig
from tests.paths import ROOT
from workers.engines.base import Delta, Engine, EngineRequest
from workers.engines.registry import ENGINES, build_engine, engine_name

# What the worker reads of an engine besides start, generate, abort and stop.
CAPABILITIES = ("cold_start_s", "model_name", "kv_capacity_tokens", "made")
NAMES = {e.value for e in EngineName}


class Bare(Engine):
    """An engine with the calls alone: every capability is the protocol's default."""

    async def start(self) -> None: ...

    async def generate(self, req: EngineRequest) -> AsyncGenerator[Delta, None]:
        yield Delta("hi", 1, 1, "stop")

    async def abort(self, request_id: str) -> None: ...

    async def stop(self) -> None: ...


def test_every_engine_name_has_exactly_one_registered_class() -> None:
    assert set(ENGINES) == set(EngineName)
    assert len(set(ENGINES.values())) == len(ENGINES)  # no class runs two names
    for name, cls in ENGINES.items():
        assert Engine in cls.__mro__, f"{name}: subclasses Engine, so it has every capability"
        assert cls.for_tier.__func__ is not Engine.for_tier.__func__, f"{name}: builds itself for a tier"


def test_each_name_builds_its_engine_with_the_tier_settings() -> None:
    tc = TierConfig(sim=SimProfile(kv_capacity_tokens=1234), vllm=VllmSettings(model="m", max_model_len=777),
                    openai=OpenAIUpstream(base_url="http://upstream:9/v1", model="u"))
    for name in EngineName:
        engine = build_engine(name.value, tc, time_scale=0.5)  # a plain str, as the command passes it
        assert type(engine) is ENGINES[name]
        assert engine_name(engine) == name.value
    sim = build_engine("sim", tc, time_scale=0.5)
    assert (sim.kv_capacity_tokens, sim.time_scale) == (1234, 0.5)
    assert build_engine("vllm", tc).settings.max_model_len == 777
    assert build_engine("openai", tc).model_name == "u"


def test_an_unknown_engine_is_refused_naming_the_engines_there_are() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi'") as e:
        build_engine("tgi", TierConfig())
    assert all(n in str(e.value) for n in NAMES)
    assert engine_name(Bare()) == "Bare"  # an engine not registered (a test's) is named by its class


def test_the_config_and_the_command_offer_exactly_the_registered_engines() -> None:
    from fleetctl.cli import main

    for name in NAMES:
        assert TierConfig(engine=name).engine == name
        assert ModelVersionConfig(engine=name).engine == name
    for bad in (lambda: TierConfig(engine="tgi"), lambda: ModelVersionConfig(engine="tgi")):
        with pytest.raises(ValidationError) as e:
            bad()
        assert all(repr(n) in str(e.value) for n in NAMES)  # the error lists what would do
    for command in ("worker", "up", "scaler"):
        engine = next(p for p in main.commands[command].params if p.name == "engine_name")
        assert set(engine.type.choices) == NAMES, command


def test_an_engine_without_a_capability_gets_the_protocols_default() -> None:
    bare = Bare()
    assert (bare.cold_start_s, bare.model_name, bare.kv_capacity_tokens, bare.made("r-1")) == (0.0, None, None, 0)
    for member in CAPABILITIES:
        assert member in vars(Engine), member
    with pytest.raises(NotImplementedError):
        Bare.for_tier(TierConfig())  # not registered: not built by name


# --- the worker reads capabilities, not names or attributes that may be missing -----------


def attribute_reads(source: str) -> Iterator[str]:
    """Where `source` asks an engine for a member with getattr/hasattr: on something named an engine,
    or for a name the `Engine` protocol declares."""
    members = {n for n in vars(Engine) if not n.startswith("_")}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            member = node.args[1] if len(node.args) > 1 else None
            if "engine" in target.lower() or (isinstance(member, ast.Constant) and member.value in members):
                yield f"line {node.lineno}: {ast.unparse(node)}"


def name_comparisons(source: str) -> Iterator[str]:
    """Where `source` compares something with an engine's name: a capability in disguise."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
                isinstance(o, ast.Constant) and o.value in NAMES for o in (node.left, *node.comparators)):
            yield f"line {node.lineno}: {ast.unparse(node)}"


def test_the_scan_finds_what_the_worker_once_did() -> None:
    before = """
kv = getattr(self.engine, "kv_capacity_tokens", None)
if kv is None and self.engine_name == "sim":
    pass
made = getattr(e, "made", None)
ok = hasattr(engine, "anything")
"""
    assert len(list(attribute_reads(before))) == 3
    assert len(list(name_comparisons(before))) == 1
    innocent = 'x = getattr(settings, "model", None)\nif kind == "chat": pass\n'
    assert not list(attribute_reads(innocent)) and not list(name_comparisons(innocent))


def test_the_worker_reads_engine_capabilities_directly_and_never_compares_engine_names() -> None:
    found = {}
    for path in sorted((ROOT / "workers").rglob("*.py")):
        source, rel = path.read_text(), path.relative_to(ROOT)
        hits = list(name_comparisons(source))
        if rel.parent == Path("workers"):  # the engines may ask vLLM's own objects what they have
            hits += attribute_reads(source)
        if hits:
            found[str(rel)] = hits
    assert not found, f"read these as Engine members (workers/engines/base.py): {found}"
