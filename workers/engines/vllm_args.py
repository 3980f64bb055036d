"""A tier's `vllm:` settings as `vllm serve` flags, and those flags through vLLM's own parser.

Apart from the engine (`workers.engines.vllm_engine`), so a config can be checked against the
installed vLLM without starting one: the worker and `tests/engines/test_gpu_box_config.py` call
the same `parse_serve_args`. vLLM is imported inside it, so importing this module never needs it.
"""

from __future__ import annotations

from typing import Any

from fleet.config import VllmSettings
from workers.engines.base import EngineError


def serve_argv(s: VllmSettings) -> list[str]:
    """The tier's settings as `vllm serve` flags. Each request's priority is its class: when a slot
    frees, or KV runs short, vLLM serves committed work first (`--scheduling-policy priority`); it
    never evicts a running request for a waiting one on its own, the worker preempts through
    `abort` (docs/preemption.md)."""
    argv = ["--model", s.model, "--max-num-seqs", str(s.max_num_seqs), "--max-model-len", str(s.max_model_len),
            "--gpu-memory-utilization", str(s.gpu_memory_utilization),
            "--tensor-parallel-size", str(s.tensor_parallel_size), "--dtype", s.dtype,
            "--scheduling-policy", "priority", "--disable-log-stats"]
    for flag, value in (("--tokenizer", s.tokenizer), ("--served-model-name", s.served_model_name),
                        ("--tool-call-parser", s.tool_call_parser), ("--reasoning-parser", s.reasoning_parser),
                        ("--chat-template", s.chat_template)):
        if value:
            argv += [flag, value]
    if s.kv_cache_memory_bytes:
        argv += ["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    if s.tool_call_parser and s.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    return argv + list(s.serve_args)


def parse_serve_args(s: VllmSettings) -> Any:
    """The tier's flags (`serve_argv`) through vLLM's own `vllm serve` parser and checks: vLLM's
    defaults, and an `EngineError` (`engine_config_error`) naming the flag vLLM refuses, before
    any weights load. The parser names are looked up in vLLM's registries here too, where vLLM
    itself would find a wrong one only after loading the weights. Needs vLLM, loads no model;
    `tests/engines/test_gpu_box_config.py` runs the shipped GPU config through it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = serve_argv(s)
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    def refuse(message: str) -> None:  # argparse would print and exit: say which flag instead
        raise ValueError(message)

    parser.error = refuse
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        _known_parsers(args)
    except Exception as e:
        raise EngineError(f"the tier's vllm settings are not valid `vllm serve` flags ({' '.join(argv)}): {e}",
                          "engine_config_error", "bad_settings") from None
    return args


def _known_parsers(args: Any) -> None:
    """The tool-call and reasoning parsers are names in vLLM's registries (a plugin may add its own)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for flag, name, manager, plugin in (
            ("--tool-call-parser", args.tool_call_parser, ToolParserManager, args.tool_parser_plugin),
            ("--reasoning-parser", args.reasoning_parser, ReasoningParserManager, args.reasoning_parser_plugin)):
        if name and not plugin and name not in manager.list_registered():
            raise ValueError(f"{flag} {name!r} is not one of vLLM's: {', '.join(manager.list_registered())}")
