"""The `vllm` engine: vLLM in the worker process, answering through vLLM's own OpenAI serving layer.

So a call is served exactly as `vllm serve` serves it for the same model and flags: the
same chat template, tool-call parser (`tool_choice` auto, required, named, none), reasoning
parser, structured outputs (`response_format`, guided decoding) and logprobs, by the same
code. The tier's `vllm:` settings become `vllm serve` flags, parsed by vLLM's own argument
parser (`workers.engines.vllm_args`), so its defaults are vLLM's; `serve_args` passes any other flag.

vLLM is imported inside `start()`, so importing this module never needs it (the gateway
and the sim-only tests run without it).

Notes for whoever runs it:
- vLLM starts its engine core with the `spawn` start method on CPU (and on GPU once CUDA
  is initialised), which re-imports the main module: the process's entry point must be
  guarded by `if __name__ == "__main__":` (console scripts and `python -m pkg` with a
  guarded `__main__` are fine).
- `start()` sets offline, loopback-only defaults for the environment variables listed in
  `ENV_DEFAULTS` when they are unset. A GPU box that should download weights must set
  HF_HUB_OFFLINE=0 itself.
- On CPU the KV-cache budget must be given: `kv_cache_memory_bytes` in the tier's vllm
  settings, or VLLM_CPU_KVCACHE_SPACE (GiB), which wins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any, Self

import orjson

from fleet.config import TierConfig, VllmSettings
from fleet.engine_config import ANTHROPIC_BODY
from fleet.policy.cold_start import ColdStartPhases
from fleet.prompt_size import estimate_prompt_tokens
from workers.engines.base import Delta, Engine, EngineError, EngineRequest
from workers.engines.chunks import ChunkReader, whole
from workers.engines.vllm_args import parse_serve_args, serve_argv  # noqa: F401  serve_argv: re-exported
from workers.engines.vllm_messages import EventReader, http_request, request_of, whole_answer
from workers.engines.vllm_startup import capture, phases

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
_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}  # how vLLM's serving layer names its requests


def apply_env_defaults() -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # An empty VLLM_CPU_KVCACHE_SPACE crashes vLLM's CPU platform; unset it.
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE", None) == "":
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]


class VllmEngine(Engine):
    """Engine contract over vLLM's `AsyncLLM` and its OpenAI serving layer.

    Attributes, valid after `start()`:
        cold_start_s: seconds from `start()` to ready, import, engine build and warm-up included.
        cold_start_phases: load and init as vLLM timed them itself (`workers.engines.vllm_startup`),
            first_token as this engine timed its warm-up call; None when vLLM's logging is the operator's.
        max_model_len: the context length the engine enforces.
        kv_capacity_tokens: tokens the KV cache holds, when vLLM reports it.
        model_name: the name answers carry (`served_model_name`, else the model).

    Semantics beyond the protocol:
        - A request is vLLM's chat or completion request as the caller sent it, with the
          fleet's request id, its class as vLLM priority, and the tier's output bound
          when the caller gave none. What vLLM refuses is an `invalid_request_error`
          with vLLM's own message (a prompt too long for the context, a part a text
          model cannot take, a bad schema).
        - After `abort(request_id)` (or when the consumer closes the iterator), `generate`
          ends without a final delta: no finish_reason.
        - `engine_error` otherwise (code `engine_dead` when vLLM's engine core died; the
          worker then stops and is replaced).
    """

    # Capabilities (`Engine`) as class attributes: what `start` sets then replaces the protocol's defaults.
    cold_start_s: float = 0.0
    cold_start_phases: ColdStartPhases | None = None
    kv_capacity_tokens: int | None = None
    model_name: str = ""

    @classmethod
    def for_tier(cls, tier: TierConfig, *, time_scale: float = 1.0) -> Self:
        return cls(tier.vllm)  # vLLM keeps its own time

    def __init__(self, settings: VllmSettings) -> None:
        self.settings = settings
        self.max_model_len: int = settings.max_model_len
        self.model_name = settings.served_model_name or settings.model
        self._engine: AsyncLLM | None = None
        self._serving: dict[str, Any] = {}  # "chat" and "completion": vLLM's serving objects
        self._vllm: dict[str, Any] = {}
        self._inflight: dict[str, str] = {}  # our request id -> vLLM's
        self._aborted: set[str] = set()
        self._multimodal = False
        self._counting: _Counting | None = None
        self._made: dict[str, int] = {}  # our request id -> tokens made, for `made` once it ended

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        if self._engine is not None:
            return
        if not self.settings.model:
            raise EngineError("vllm.model is not set for this tier", "engine_config_error", "missing_model")
        t0 = time.monotonic()
        apply_env_defaults()
        args = self._serve_args()
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.v1.engine.async_llm import AsyncLLM

        # Building blocks for 12-25 s (weights, engine-core process, KV cache): on a thread,
        # so the worker's loop keeps its heartbeats going.
        loop = asyncio.get_running_loop()
        with capture() as vllm_timings:  # vLLM's own start-up timings, from its engine core's log records
            fut = loop.run_in_executor(None, AsyncLLM.from_engine_args, AsyncEngineArgs.from_cli_args(args))
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                fut.add_done_callback(_shutdown_when_built)
                raise
            except Exception as e:
                raise EngineError(f"vLLM engine failed to start: {e}", "engine_start_failed") from e
            timings = vllm_timings()
        # Hold the engine on self only: a stray reference (this frame can outlive the call)
        # would run AsyncLLM.__del__ at interpreter exit.
        self._engine = fut.result()
        del fut
        try:
            state = State()
            kind = self._vllm["RequestOutputKind"]
            self._counting = _Counting(self._engine, kind.FINAL_ONLY, kind.CUMULATIVE)
            await init_app_state(self._counting, state, args, await self._engine.get_supported_tasks())
            self._serving = {"chat": state.openai_serving_chat, "completion": state.openai_serving_completion,
                             "messages": state.anthropic_serving_messages}  # as `vllm serve` answers /v1/messages
            # It holds the engine too, and this frame outlives the call: a frame of vLLM's first imports
            # (made in `_serve_args`) stays referenced, and with it each caller's, this one's included.
            del state
            self._read_limits(self._engine)
            t_warm = time.monotonic()  # vLLM does not time a first call: the fleet times its warm-up call
            await self._warmup()
            first_token_s = time.monotonic() - t_warm
        except BaseException:
            await self.stop()
            raise
        self.cold_start_s = time.monotonic() - t0
        self.cold_start_phases = phases(timings, first_token_s, self.cold_start_s)
        log.info("vllm engine ready: model=%s cold_start=%.1fs phases=%s", self.model_name, self.cold_start_s,
                 self.cold_start_phases)

    def _serve_args(self) -> Any:
        """The tier's flags through vLLM's own `vllm serve` parser: vLLM's defaults, vLLM's checks."""
        try:
            from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest
            from vllm.entrypoints.serve.engine.protocol import ErrorResponse
            from vllm.exceptions import VLLMValidationError
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError as e:
            raise EngineError(f"vLLM is not installed: {e}", "engine_start_failed", "vllm_missing") from e
        self._vllm = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "ErrorResponse": ErrorResponse,
                      "messages": AnthropicMessagesRequest,
                      "EngineDeadError": EngineDeadError, "RequestOutputKind": RequestOutputKind,
                      "refused": (VLLMValidationError, ValueError, TypeError, KeyError)}
        return parse_serve_args(self.settings)

    def _read_limits(self, engine: AsyncLLM) -> None:
        self.max_model_len = engine.model_config.max_model_len
        self._multimodal = bool(getattr(engine.model_config, "is_multimodal_model", False))
        cache = engine.vllm_config.cache_config
        if cache.num_gpu_blocks:
            self.kv_capacity_tokens = cache.num_gpu_blocks * cache.block_size

    async def _warmup(self) -> None:
        n = self.settings.warmup_tokens
        if n <= 0:
            return
        req = EngineRequest.build(_WARMUP_ID, "completion", "Warm up.", max_tokens=n, temperature=0.0, ignore_eos=True)
        async for _ in self.generate(req):
            pass

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._inflight:
            try:
                await engine.abort(list(self._inflight.values()))
            except Exception:  # the engine may already be dead
                log.debug("abort on stop failed", exc_info=True)
        # vLLM's serving objects and the counting client hold the engine too: let them go, so that it
        # is freed now, its own __del__ (a second shutdown) run while the interpreter is whole. Left
        # to interpreter exit, that __del__ met modules already torn down and printed a TypeError.
        self._serving, self._counting = {}, None
        engine.shutdown()

    # -- requests ---------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        inner = self._inflight.get(request_id)
        if inner is None:
            return
        self._aborted.add(request_id)  # also covers a request still being rendered, not yet in vLLM
        if self._engine is not None:
            await self._engine.abort(inner)

    def made(self, request_id: str) -> int:
        """Tokens made for a request that ended (asked once, by the worker, to charge them)."""
        return self._made.pop(request_id, 0)

    def _messages(self, req: EngineRequest) -> bool:
        """A Messages call (the gateway put the caller's Anthropic body in it): vLLM's Anthropic layer answers."""
        return req.kind == "chat" and ANTHROPIC_BODY in req.body and self._serving.get("messages") is not None

    def _request(self, req: EngineRequest, messages: bool) -> Any:
        """The caller's body as vLLM's request model, with the fleet's id, priority and bound."""
        if messages:
            return request_of(self._vllm["messages"], req, self.model_name, self.max_model_len)
        body = {**req.body, "model": self.model_name, "stream": req.stream, "request_id": req.request_id,
                "priority": req.priority}
        if req.stream:  # usage on every chunk: each delta's token counts are exact, not an estimate
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True,
                                      "continuous_usage_stats": True}
        else:
            body.pop("stream_options", None)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # vLLM's names for it
            body["max_completion_tokens" if req.kind == "chat" else "max_tokens"] = req.max_tokens
        if req.kind == "chat" and not self._multimodal:
            _text_only(body.get("messages") or [])
        try:
            return self._vllm[req.kind].model_validate(body)
        except ValueError as e:  # pydantic's ValidationError: name the field
            raise EngineError(f"vLLM refused the request: {e}", "invalid_request_error", "invalid_value") from None

    async def generate(self, req: EngineRequest) -> AsyncGenerator[Delta, None]:
        """vLLM's answer through its serving layer: streamed, each SSE chunk as deltas
        (`workers.engines.chunks`); not streamed, its response whole."""
        if self._engine is None:
            raise EngineError("engine is not started", "engine_error", "not_started")
        if req.request_id in self._inflight:
            raise EngineError(f"request {req.request_id!r} is already running", "invalid_request_error", "duplicate_id")
        messages = self._messages(req)
        request = self._request(req, messages)
        inner = _PREFIX[req.kind] + req.request_id + ("-0" if req.kind == "completion" else "")
        self._inflight[req.request_id] = inner
        answer: Any = None
        finished = False
        try:
            answer = await self._create(req, request, messages)
            if isinstance(answer, self._vllm["ErrorResponse"]):
                err = answer.error
                type_ = "invalid_request_error" if 400 <= err.code < 500 else "engine_error"
                raise EngineError(err.message, type_, f"http_{err.code}", err.param)
            if not req.stream:
                finished = True
                yield whole_answer(answer) if messages else whole(answer.model_dump(), req.kind == "chat")
                return
            chunks = ChunkReader(req.kind == "chat", lambda: estimate_prompt_tokens(req.kind, req.body))
            feed = EventReader(chunks).feed if messages else partial(_chat_deltas, chunks)
            async for sse in answer:
                if req.request_id in self._aborted:
                    return
                for delta in feed(sse):
                    yield delta
            finished = True
            if req.request_id not in self._aborted:
                yield chunks.end()
        finally:
            await self._end(req.request_id, inner, answer, finished)

    async def _end(self, request_id: str, inner: str, answer: Any, finished: bool) -> None:
        """However `generate` ended: abort vLLM's request if it was cut short, close its
        stream, keep what it made for the worker's charge, forget it."""
        # Closed early (the caller left, the deadline passed, a preemption): vLLM's stream is
        # suspended at a yield, so closing it does not reach the engine; abort there at once.
        if not finished and self._engine is not None:
            await self._engine.abort(inner)
        if answer is not None and hasattr(answer, "aclose"):
            await answer.aclose()
        if self._counting is not None and len(self._made) < 10_000:  # bounded: a worker that never asks
            self._made[request_id] = self._counting.made.pop(inner, 0)
        self._inflight.pop(request_id, None)
        self._aborted.discard(request_id)

    async def _create(self, req: EngineRequest, request: Any, messages: bool) -> Any:
        """Hand the request to vLLM's serving layer; its exceptions typed."""
        try:
            if messages:
                return await self._serving["messages"].create_messages(request, http_request(req.request_id,
                                                                                             req.priority))
            serving = self._serving[req.kind]
            create = serving.create_chat_completion if req.kind == "chat" else serving.create_completion
            return await create(request, None)
        except self._vllm["EngineDeadError"] as e:
            raise EngineError(f"vLLM engine died: {e}", "engine_error", "engine_dead") from e
        except self._vllm["refused"] as e:  # what vllm serve answers 400 for
            raise EngineError(str(e), "invalid_request_error", "invalid_value", getattr(e, "parameter", None)) from e
        except Exception as e:
            if self._engine is not None and self._engine.errored:
                raise EngineError(f"vLLM engine died: {e!r}", "engine_error", "engine_dead") from e
            raise EngineError(f"vLLM generation failed: {e!r}", "engine_error") from e


class _Counting:
    """vLLM's engine client as its serving layer sees it, but for a whole answer (not streamed)
    counting the tokens as they are made, so a call cut short (its deadline, its caller gone) is
    charged what it cost: asked for the final output only, vLLM would say nothing until the end.
    It asks for cumulative outputs instead, whose last one is that same final output."""

    def __init__(self, engine: Any, final_only: Any, cumulative: Any) -> None:
        self._engine = engine
        self._final_only, self._cumulative = final_only, cumulative
        self.made: dict[str, int] = {}  # vLLM's request id -> tokens made so far

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        if getattr(params, "output_kind", None) == self._final_only:
            params.output_kind = self._cumulative
        async for out in self._engine.generate(prompt, params, request_id, *args, **kw):
            self.made[request_id] = len(out.outputs[0].token_ids) if out.outputs else 0
            yield out


def _text_only(messages: list[Any]) -> None:
    """A text-only model cannot take an image, audio or file part: a typed 400 naming it."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "refusal"):
                raise EngineError(f"this model takes text only; messages[{i}].content[{j}] is a {kind!r} part",
                                  "invalid_request_error", "unsupported_content", f"messages[{i}].content[{j}]")


def _chat_deltas(chunks: ChunkReader, sse: str) -> list[Delta]:
    """The deltas of one piece of vLLM's chat or completion stream."""
    return [d for chunk in _events(sse) for d in chunks.feed(chunk)]


def _events(sse: str) -> list[dict[str, Any]]:
    """The chunks of one piece of vLLM's SSE stream (`data: {...}\\n\\n`, possibly several)."""
    out = []
    for line in sse.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            continue
        event = orjson.loads(data)
        if isinstance(event, dict) and "error" in event:
            err = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            raise EngineError(str(err.get("message")), "engine_error", "stream_error")
        out.append(event)
    return out


def _shutdown_when_built(fut: asyncio.Future[Any]) -> None:
    # start() was cancelled while the engine was being built: don't leak it.
    if not fut.cancelled() and fut.exception() is None:
        try:
            fut.result().shutdown()
        except Exception:
            log.debug("shutdown of an abandoned engine failed", exc_info=True)
