"""configs/gpu-box.yaml, what `docker compose up` runs on a GPU box, checked here instead of there.

- The fleet's own check: `load_config`, the loader `fleet up` and every part use.
- vLLM's own checks on each tier's settings, through the function the worker calls before it loads
  any weights (`workers.engines.vllm_args.parse_serve_args`: `vllm serve`'s parser, its checks and
  the parser registries), then vLLM's engine arguments (`AsyncEngineArgs.from_cli_args`, as the
  worker builds its engine). vLLM's CPU build is the same release as the worker image's; the tests
  that need it are skipped without it (`make vllm`). Nothing is downloaded, no weights load: the
  model paths exist only on the GPU box.
- Its `sim:` profiles agree with its vLLM settings, and `fleet simulate` on it is a real model's.
- Compose runs it on the GPU path, the sim fleet on the CPU path, and the docs fetch its weights
  where it looks for them.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.config import ConfigError, FleetConfig, load_config
from simulator.run import simulate
from simulator.scenario import parse_scenario
from tests.paths import ROOT

GPU_BOX = ROOT / "configs" / "gpu-box.yaml"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (make vllm)")
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

# Each model's KV cache shape, from its config.json: layers, KV heads, head dim (bf16: 2 bytes).
ARCH = {"Qwen3-1.7B": (28, 8, 128), "Qwen3-8B": (36, 8, 128), "Qwen3-32B": (64, 8, 128)}
GPU_GB = 85.0  # what NVML reports (GB of 1e9 bytes) for the 80 GB GPUs the file is sized for
RUNTIME_GB = 3.0  # at least this beside weights and KV: activations, CUDA graphs, CUDA context


@pytest.fixture(scope="module")
def cfg() -> FleetConfig:
    return load_config(GPU_BOX)


def _mutated(tmp_path: Path, old: str, new: str) -> Path:
    text = GPU_BOX.read_text()
    assert old in text, old
    path = tmp_path / "gpu-box.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def _vllm_settings_of(path: Path, tier: str) -> Any:
    """A config file's tier through both checks, as a replica of it would meet them: the fleet's
    loader, then vLLM's parser (vLLM's namespace of `vllm serve` flags)."""
    from workers.engines.vllm_args import parse_serve_args

    return parse_serve_args(load_config(path).tiers[tier].vllm)


# --- the fleet's own check ---------------------------------------------------------------------


def test_every_tier_serves_a_real_model_of_its_size_from_local_weights(cfg: FleetConfig) -> None:
    assert list(cfg.tiers) == ["routing", "analysis", "planner"]
    assert [cfg.resolve_model(a) for a in ("small", "mid", "large")] == ["routing", "analysis", "planner"]
    for name, tc in cfg.tiers.items():
        v = tc.vllm
        assert tc.engine == "vllm", name
        assert v.model.startswith("/models/") and Path(v.model).name in ARCH, (name, v.model)  # no hub id
        assert v.served_model_name == f"Qwen/{Path(v.model).name}"
        assert v.tool_call_parser and v.enable_auto_tool_choice and v.reasoning_parser, name
        assert "--enable-prefix-caching" in v.serve_args, name
        assert tc.gpus_per_replica == v.tensor_parallel_size >= 1 and tc.gpu_memory_gb > 0, name
        assert v.max_num_seqs >= tc.slots, name  # vLLM batches every call the worker claims
        assert tc.hourly_usd > 0 and tc.budget.daily_usd and tc.budget.daily_usd > 0, name
    sizes = [tc.sim.weights_gb for tc in cfg.tiers.values()]
    assert sizes == sorted(sizes) and sizes[0] < 8 < sizes[1] < 32 < sizes[2]
    assert cfg.tiers["planner"].vllm.tensor_parallel_size >= 2


def test_sim_profiles_agree_with_the_vllm_settings(cfg: FleetConfig) -> None:
    """What admission, scaling and `fleet simulate` assume of a replica is what vLLM will be given."""
    for name, tc in cfg.tiers.items():
        v, tp = tc.vllm, tc.vllm.tensor_parallel_size
        layers, kv_heads, head_dim = ARCH[Path(v.model).name]
        per_token = 2 * layers * (kv_heads // tp) * head_dim * 2  # K and V, on each GPU
        assert v.kv_cache_memory_bytes, name  # a fixed KV cache: the same on any GPU it is placed on
        assert tc.sim.kv_capacity_tokens == v.kv_cache_memory_bytes // (per_token * 16) * 16, name  # whole blocks
        assert tc.sim.weights_gb / tp + v.kv_cache_memory_bytes / 1e9 + RUNTIME_GB <= tc.gpu_memory_gb, name
        # vLLM starts only if this share of the GPU is free; the scaler guarantees gpu_memory_gb.
        assert v.gpu_memory_utilization * GPU_GB <= tc.gpu_memory_gb, name
        assert v.max_model_len >= tc.sim.typical_prompt_tokens + tc.max_tokens_limit, name


def test_fleet_simulate_on_it_is_a_real_models_burst() -> None:
    """A burst on every tier, on eight 80 GB GPUs: every committed call served, each tier growing past
    its floor, at a real model's cold start (tens of seconds, not the sim fleet's few)."""
    gpus = [{"index": i, "memory_gb": GPU_GB} for i in range(8)]

    def arrival(tier: str, cls: str, base: float, peak: float, prompt: int, output: int) -> dict[str, Any]:
        return {"tier": tier, "class": cls, "rate": [["09:00", base], ["09:02", peak], ["09:08", base]],
                "prompt_tokens": {"dist": "lognormal", "mean": prompt, "sd": prompt / 3, "min": 10, "max": 8000},
                "output_tokens": {"dist": "lognormal", "mean": output, "sd": output / 3, "min": 2, "max": 4000}}

    sc = parse_scenario({
        "name": "gpu-box-burst", "start": "2026-11-30T09:00:00", "timezone": "UTC", "duration": "12m",
        "seed": 3, "fleet_config": str(GPU_BOX), "fleet": {"gpus": gpus},
        "deadlines_ms": {"committed": 180000, "interactive": 60000},
        "arrivals": [arrival("routing", "interactive", 2, 40, 150, 60),
                     arrival("analysis", "interactive", 0.5, 6, 600, 400),
                     arrival("planner", "committed", 0.05, 0.4, 1500, 1200)]})
    result = simulate(sc)  # about 4 s
    for name, tier in result.tiers.items():
        assert 30 <= tier.cold_start <= 120, (name, tier.cold_start)
        peak = max(s.starting + s.ready + s.draining for s in result.samples[name])
        assert peak > tier.tc.warm_floor, name
    planner = result.tiers["planner"].outcomes[0]  # committed
    assert planner.arrived > 100 and planner.completed == planner.arrived and not planner.shed
    for name in ("routing", "analysis"):
        # Most served; while replicas start, what cannot wait is refused at once (429), never lost.
        served = result.tiers[name].outcomes[1]  # interactive
        assert served.completed >= 0.9 * served.arrived and set(served.shed) <= {"drain_exceeded"}, (name, served)
        assert served.expired_waiting == served.expired_running == 0, name


# --- vLLM's own checks --------------------------------------------------------------------------


@needs_vllm
def test_each_tier_passes_vllms_own_parser_and_engine_arguments(cfg: FleetConfig,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from workers.engines.vllm_args import parse_serve_args

    # Offline, vLLM resolves a model that is not on disk (the GPU box's /models here) as a hub snapshot,
    # and fails. huggingface_hub reads HF_HUB_OFFLINE once, at import: after an in-process engine of an
    # earlier test set it (`vllm_engine.ENV_DEFAULTS`), it stays on, so this test passed or failed by
    # the order the suite ran in. The GPU box has its weights on disk; here nothing is resolved.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name, tc in cfg.tiers.items():
        v = tc.vllm
        args = parse_serve_args(v)
        engine = AsyncEngineArgs.from_cli_args(args)  # as the worker builds its engine
        assert (engine.model, engine.served_model_name) == (v.model, [v.served_model_name]), name
        assert engine.tensor_parallel_size == tc.gpus_per_replica, name
        assert (engine.max_num_seqs, engine.max_model_len) == (v.max_num_seqs, v.max_model_len), name
        assert engine.kv_cache_memory_bytes == v.kv_cache_memory_bytes, name
        assert engine.gpu_memory_utilization == v.gpu_memory_utilization, name
        assert engine.enable_prefix_caching is True, name
        assert engine.reasoning_parser == v.reasoning_parser, name
        assert args.tool_call_parser == v.tool_call_parser and args.enable_auto_tool_choice, name
        # The parser classes import (no tokenizer needed): what the serving layer looks up at start.
        assert ToolParserManager.get_tool_parser(v.tool_call_parser).__name__, name
        assert ReasoningParserManager.get_reasoning_parser(v.reasoning_parser).__name__, name
    routing = parse_serve_args(cfg.tiers["routing"].vllm)
    assert routing.default_chat_template_kwargs == {"enable_thinking": False}


@needs_vllm
@pytest.mark.parametrize(("tier", "old", "new", "named"), [  # each edit's first match is in that tier
    ("analysis", '"--enable-prefix-caching"]', '"--enable-prefix-cacheing"]', "--enable-prefix-cacheing"),
    ("analysis", '"--enable-prefix-caching"]', '"--num-scheduler-steps", "8"]', "--num-scheduler-steps"),
    ("routing", "reasoning_parser: qwen3", "reasoning_parser: qwen_3", "--reasoning-parser 'qwen_3'"),
    ("routing", "tool_call_parser: hermes", "tool_call_parser: hermess", "--tool-call-parser 'hermess'"),
], ids=["misspelled-flag", "flag-gone-since-v1", "reasoning-parser", "tool-call-parser"])
def test_a_setting_vllm_refuses_is_named_before_any_weights_load(tmp_path: Path, tier: str, old: str, new: str,
                                                                 named: str) -> None:
    from workers.engines.base import EngineError

    path = _mutated(tmp_path, old, new)
    with pytest.raises(EngineError) as e:
        _vllm_settings_of(path, tier)
    assert e.value.type == "engine_config_error" and named in str(e.value), str(e.value)


def test_a_misspelled_vllm_field_is_named_by_the_fleets_check(tmp_path: Path) -> None:
    path = _mutated(tmp_path, "tensor_parallel_size: 2", "tensor_paralel_size: 2")
    with pytest.raises(ConfigError, match=r"tiers\.planner\.vllm\.tensor_paralel_size"):
        load_config(path)


# --- compose and the docs ------------------------------------------------------------------------


def _env(service: dict[str, Any]) -> dict[str, str]:
    return dict(service.get("environment") or {})


def test_compose_runs_it_on_a_gpu_box_and_the_sim_fleet_on_a_cpu_box() -> None:
    gpu = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    cpu = yaml.safe_load((ROOT / "docker-compose.cpu.yml").read_text())["services"]
    for part in ("gateway", "scaler", "worker"):
        assert _env(gpu[part])["FLEET_CONFIG"] == "/app/configs/gpu-box.yaml", part
    for part in ("gateway", "scaler"):  # the override's environment lies over the base's, key by key
        assert {**_env(gpu[part]), **_env(cpu[part])}["FLEET_CONFIG"] == "/app/configs/fleet.yaml", part
    assert "/srv/models:/models:ro" in gpu["scaler"]["command"]  # where each worker finds /models


def test_the_docs_fetch_each_tiers_weights_where_it_looks(cfg: FleetConfig) -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    fetched = dict(re.findall(r"^hf download (\S+) --local-dir /srv/models/(\S+)$", doc, re.M))
    for name, tc in cfg.tiers.items():
        folder = Path(tc.vllm.model).name
        assert fetched.get(tc.vllm.served_model_name) == folder, (name, fetched)
