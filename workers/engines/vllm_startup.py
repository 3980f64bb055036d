"""vLLM's cold start by phase, from the timings vLLM measures and logs itself.

vLLM times its own start-up but keeps the figures in its engine-core process, where
they are only logged (vLLM 0.32; the handshake back to `AsyncLLM` carries none of them):

- `Loading weights took %.2f seconds` (model_executor/model_loader/default_loader.py):
  the checkpoint read into the model;
- `Model loading took %s GiB memory and %.6f seconds` (v1/worker/gpu_model_runner.py,
  GPU only): the model built and its weights on the device, which holds the one above;
- `init engine (profile, create kv cache, warmup model) took %.2f s` with, when it
  compiled, `(compilation: %.2f s)` (v1/engine/core.py): memory profiled, KV cache
  allocated, graphs compiled or captured and the model warmed.

So the engine core is given a logging config (`VLLM_LOGGING_CONFIG_PATH`) that is vLLM's
own default plus one handler, `StartupRecords`, which writes exactly those records, with
vLLM's numbers, to a file the worker reads once the engine is up. The console output is
unchanged. An operator who sets VLLM_LOGGING_CONFIG_PATH or VLLM_CONFIGURE_LOGGING=0
(or passes --logging-config) keeps that, and the replica then reports its cold start
whole, without phases, rather than guessed ones.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any

from fleet.policy.cold_start import ColdStartPhases

# vLLM's own messages (the format strings, as logged) -> what the figure is.
MESSAGES: dict[str, str] = {
    "Loading weights took %.2f seconds": "weights",
    "Model loading took %s GiB memory and %.6f seconds": "model_load",
    "init engine (profile, create kv cache, warmup model) took %.2f s": "init",
    "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)": "init",
    "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s — language_model: "
    "%.2f s, encoder: %.2f s)": "init",
}


class StartupRecords(logging.Handler):
    """A logging handler for vLLM's processes: each of vLLM's start-up timings (`MESSAGES`) as a
    line of JSON, `{"record": name, "seconds": [its numbers]}`, appended to `path`."""

    def __init__(self, path: str, level: int | str = logging.INFO) -> None:
        super().__init__(level)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        name = MESSAGES.get(record.msg) if isinstance(record.msg, str) else None
        if name is None:
            return
        args = record.args if isinstance(record.args, tuple) else ()
        seconds = [float(a) for a in args if isinstance(a, int | float)]
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"record": name, "seconds": seconds}) + "\n")
        except OSError:
            self.handleError(record)


def logging_config(records_path: str) -> dict[str, Any]:
    """vLLM's default logging config as vLLM itself would apply it (level, stream, formatter), plus
    `StartupRecords` on the `vllm` logger. The logger lets INFO through for the handler even when
    the console's level is higher; the console handler keeps the operator's level."""
    import vllm.envs as envs
    from vllm.logger import DEFAULT_LOGGING_CONFIG, _use_color

    cfg = deepcopy(DEFAULT_LOGGING_CONFIG)
    level = envs.VLLM_LOGGING_LEVEL
    console = cfg["handlers"]["vllm"]
    console.update(level=level, stream=envs.VLLM_LOGGING_STREAM, formatter="vllm_color" if _use_color() else "vllm")
    for formatter in cfg["formatters"].values():
        formatter["log_level"] = level
    cfg["handlers"]["fleet_startup"] = {"class": f"{__name__}.StartupRecords", "path": records_path, "level": "INFO"}
    logger = cfg["loggers"]["vllm"]
    logger["handlers"] = [*logger["handlers"], "fleet_startup"]
    numeric = logging.getLevelName(level)  # "INFO" -> 20
    logger["level"] = min(numeric, logging.INFO) if isinstance(numeric, int) else logging.INFO
    return cfg


@contextlib.contextmanager
def capture() -> Iterator[Callable[[], dict[str, list[float]]]]:
    """While the engine is built: vLLM's processes log their start-up timings to a private file.
    Yields a reader of what they logged so far (name -> its numbers, the first of each); the
    environment is restored and the files removed on exit. Does nothing (the reader answers
    {}) where the operator configures vLLM's logging."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        yield dict
        return
    fd, records = tempfile.mkstemp(prefix="fleet-vllm-startup-", suffix=".jsonl")
    os.close(fd)
    fd, config = tempfile.mkstemp(prefix="fleet-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(logging_config(records), f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = config
    try:
        yield lambda: read_records(records)
    finally:
        os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        for p in (records, config):
            with contextlib.suppress(OSError):
                os.unlink(p)


def read_records(path: str) -> dict[str, list[float]]:
    """The records `StartupRecords` wrote: name -> its numbers, the first of each name."""
    out: dict[str, list[float]] = {}
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                r = json.loads(line)
                out.setdefault(str(r["record"]), [float(s) for s in r["seconds"]])
    return out


def phases(records: dict[str, list[float]], first_token_s: float, total_s: float) -> ColdStartPhases | None:
    """The phases from vLLM's records: load is `Model loading took` where vLLM logs it (GPU: built
    and on the device), else `Loading weights took`; init is `init engine ... took`, its compilation
    part `compile_s`. `first_token_s` is the worker's own warm-up call, timed around it. None when
    vLLM did not say (its logging configured by the operator): no phase is guessed."""
    load = records.get("model_load") or records.get("weights")
    init = records.get("init")
    if not load or not init:
        return None
    return ColdStartPhases(
        load_s=load[-1],
        init_s=init[0],
        first_token_s=first_token_s,
        total_s=total_s,
        compile_s=init[1] if len(init) > 1 else None,
    )
