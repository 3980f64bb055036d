"""The `vllm` engine: one in-process vLLM V1 `AsyncLLM` per worker process.

vLLM is imported inside `start()`, so importing this module never needs it
(the gateway and the sim-only tests run without it).

Notes for whoever runs it:
- vLLM starts its engine core with the `spawn` start method on CPU (and on
  GPU once CUDA is initialised), which re-imports the main module: the
  process's entry point must be guarded by `if __name__ == "__main__":`
  (console scripts and `python -m pkg` with a guarded `__main__` are fine).
- `start()` sets offline, loopback-only defaults for the environment variables
  listed in `ENV_DEFAULTS` when they are unset. A GPU box that should download
  weights must set HF_HUB_OFFLINE=0 itself.
- On CPU the KV-cache budget must be given: `kv_cache_memory_bytes` in the
  tier's vllm settings, or VLLM_CPU_KVCACHE_SPACE (GiB), which wins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fleet.config import VllmSettings
from workers.engines.base import Delta, EngineError, EngineRequest

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

# Offline and loopback-only unless the operator says otherwise.
ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",  # the engine's internal messaging stays on loopback
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",  # no phoning home
    "VLLM_DO_NOT_TRACK": "1",
}

_WARMUP_ID = "fleet-warmup"


def apply_env_defaults() -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # An empty VLLM_CPU_KVCACHE_SPACE crashes vLLM's CPU platform; unset it.
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE", None) == "":
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]


class VllmEngine:
    """Engine contract over vLLM's `AsyncLLM`.

    Attributes, valid after `start()`:
        cold_start_s: seconds from `start()` to ready, import, engine build and
            warm-up included.
        max_model_len: the context length the engine enforces.
        kv_capacity_tokens: tokens the KV cache holds, when vLLM reports it.

    Semantics beyond the protocol:
        - `max_tokens` is clamped to the room left in the context; a prompt
          that fills the context is an `invalid_request_error`
          (code `context_length_exceeded`).
        - After `abort(request_id)` (or when the consumer closes the
          iterator), `generate` ends without a final delta: no finish_reason.
        - Errors are `EngineError`s: `invalid_request_error` for bad input,
          `engine_error` otherwise (code `engine_dead` when vLLM's engine core
          died; the worker should then stop and restart).
    """

    def __init__(self, settings: VllmSettings) -> None:
        self.settings = settings
        self.cold_start_s: float = 0.0
        self.max_model_len: int = settings.max_model_len
        self.kv_capacity_tokens: int | None = None
        self._engine: AsyncLLM | None = None
        self._vllm: dict[str, Any] = {}
        self._inflight: set[str] = set()
        self._aborted: set[str] = set()

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        if self._engine is not None:
            return
        s = self.settings
        if not s.model:
            raise EngineError("vllm.model is not set for this tier", "engine_config_error", "missing_model")
        t0 = time.monotonic()
        apply_env_defaults()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.exceptions import VLLMValidationError
            from vllm.renderers.inputs.preprocess import parse_model_prompt
            from vllm.renderers.params import ChatParams, TokenizeParams
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError as e:
            raise EngineError(f"vLLM is not installed: {e}", "engine_start_failed", "vllm_missing") from e
        self._vllm = {
            "VLLMValidationError": VLLMValidationError,
            "EngineDeadError": EngineDeadError,
            "parse_model_prompt": parse_model_prompt,
            "ChatParams": ChatParams,
            "TokenizeParams": TokenizeParams,
            "RequestOutputKind": RequestOutputKind,
            "SamplingParams": SamplingParams,
        }
        args = AsyncEngineArgs(
            model=s.model,
            tokenizer=s.tokenizer or None,
            max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes,
            gpu_memory_utilization=s.gpu_memory_utilization,
            tensor_parallel_size=s.tensor_parallel_size,
            dtype=s.dtype,
            enforce_eager=s.enforce_eager,
            disable_log_stats=True,
            enable_log_requests=False,
            # Each request's priority is its class (EngineRequest.priority): when a slot frees, or
            # KV runs short, vLLM serves committed work first. It never evicts a running request
            # for a waiting one on its own; the worker preempts through `abort` (docs/preemption.md).
            scheduling_policy="priority",
        )
        # Building blocks for 12-25 s (weights, engine-core process, KV cache):
        # do it on a thread so the worker's loop keeps its heartbeats going.
        # AsyncLLM starts its output tasks lazily when built outside the loop.
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, AsyncLLM.from_engine_args, args)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_shutdown_when_built)
            raise
        except Exception as e:
            raise EngineError(f"vLLM engine failed to start: {e}", "engine_start_failed") from e
        # Hold the engine on self only: a stray reference (this frame can
        # outlive the call) would run AsyncLLM.__del__ at interpreter exit.
        self._engine = fut.result()
        del fut
        self.max_model_len = self._engine.model_config.max_model_len
        cache = self._engine.vllm_config.cache_config
        if cache.num_gpu_blocks:
            self.kv_capacity_tokens = cache.num_gpu_blocks * cache.block_size
        try:
            await self._warmup()
        except BaseException:
            await self.stop()
            raise
        self.cold_start_s = time.monotonic() - t0
        log.info("vllm engine ready: model=%s cold_start=%.1fs", s.model, self.cold_start_s)

    async def _warmup(self) -> None:
        n = self.settings.warmup_tokens
        if n <= 0:
            return
        req = EngineRequest(
            request_id=_WARMUP_ID,
            kind="completion",
            prompt="Warm up.",
            max_tokens=n,
            temperature=0.0,
            ignore_eos=True,
        )
        async for _ in self.generate(req):
            pass

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._inflight:
            try:
                await engine.abort(list(self._inflight))
            except Exception:  # the engine may already be dead
                log.debug("abort on stop failed", exc_info=True)
        engine.shutdown()

    # -- requests ---------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        if request_id not in self._inflight:
            return
        # Also covers a request still being rendered, not yet in vLLM.
        self._aborted.add(request_id)
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def generate(self, req: EngineRequest) -> AsyncIterator[Delta]:
        engine = self._engine
        if engine is None:
            raise EngineError("engine is not started", "engine_error", "not_started")
        if req.request_id in self._inflight:
            raise EngineError(f"request {req.request_id!r} is already running", "invalid_request_error", "duplicate_id")
        v = self._vllm
        self._inflight.add(req.request_id)
        stream = None
        try:
            try:
                engine_input = await self._render(engine, req)
                prompt_tokens = len(engine_input["prompt_token_ids"])
                room = self.max_model_len - prompt_tokens
                if room <= 0:
                    raise EngineError(
                        f"the prompt has {prompt_tokens} tokens; this model's context is {self.max_model_len}",
                        "invalid_request_error",
                        "context_length_exceeded",
                    )
                params = v["SamplingParams"](
                    n=1,
                    max_tokens=max(1, min(req.max_tokens, room)),
                    temperature=req.temperature,
                    top_p=req.top_p,
                    stop=list(req.stop) or None,
                    seed=req.seed,
                    ignore_eos=req.ignore_eos,
                    output_kind=v["RequestOutputKind"].DELTA,
                )
            except EngineError:
                raise
            except (v["VLLMValidationError"], ValueError, TypeError, KeyError) as e:
                raise EngineError(str(e), "invalid_request_error") from e
            if req.request_id in self._aborted:
                return
            stream = engine.generate(engine_input, params, req.request_id, priority=req.priority)
            completion_tokens = 0
            async for out in stream:
                o = out.outputs[0]
                completion_tokens += len(o.token_ids)
                if out.prompt_token_ids is not None:
                    prompt_tokens = len(out.prompt_token_ids)
                reason = o.finish_reason
                if reason == "abort" or req.request_id in self._aborted:
                    return
                if out.finished:
                    yield Delta(o.text, prompt_tokens, completion_tokens, "length" if reason == "length" else "stop")
                    return
                # Byte-level tokenizers hold back partial UTF-8: skip empty
                # deltas, the counts catch up on the next one.
                if o.text:
                    yield Delta(o.text, prompt_tokens, completion_tokens)
        except EngineError:
            raise
        except v["EngineDeadError"] as e:
            raise EngineError(f"vLLM engine died: {e}", "engine_error", "engine_dead") from e
        except v["VLLMValidationError"] as e:
            raise EngineError(str(e), "invalid_request_error") from e
        except Exception as e:
            if engine.errored:
                raise EngineError(f"vLLM engine died: {e!r}", "engine_error", "engine_dead") from e
            raise EngineError(f"vLLM generation failed: {e!r}", "engine_error") from e
        finally:
            if stream is not None:
                # Closing vLLM's generator early aborts the request inside vLLM.
                await stream.aclose()
            self._inflight.discard(req.request_id)
            self._aborted.discard(req.request_id)

    async def _render(self, engine: AsyncLLM, req: EngineRequest) -> dict[str, Any]:
        v = self._vllm
        # The length check happens here; max_tokens is clamped by the caller.
        if req.kind == "chat":
            if not req.messages:
                raise EngineError("a chat request needs messages", "invalid_request_error")
            tok_params = v["TokenizeParams"](max_total_tokens=self.max_model_len, add_special_tokens=False)
            chat_params = v["ChatParams"](chat_template_kwargs={"add_generation_prompt": True})
            _, (engine_input,) = await engine.renderer.render_chat_async([req.messages], chat_params, tok_params)
        else:
            tok_params = v["TokenizeParams"](max_total_tokens=self.max_model_len, add_special_tokens=True)
            parsed = v["parse_model_prompt"](engine.model_config, req.prompt or "")
            (engine_input,) = await engine.renderer.render_cmpl_async([parsed], tok_params)
        if not engine_input.get("prompt_token_ids"):
            raise EngineError("the prompt is empty", "invalid_request_error")
        return engine_input


def _shutdown_when_built(fut: asyncio.Future[Any]) -> None:
    # start() was cancelled while the engine was being built: don't leak it.
    if not fut.cancelled() and fut.exception() is None:
        try:
            fut.result().shutdown()
        except Exception:
            log.debug("shutdown of an abandoned engine failed", exc_info=True)
