"""The `sim` engine: a calibrated GPU latency model that emits real token streams.

What it says is `workers.engines.sim_answers`: text, or a tool call whose arguments fit
the tool's schema, or JSON of the call's `response_format`, so an agent runs its whole
tool loop against it. How long it takes is the latency model. Not a fixed
sleep: a request pays prefill for its prompt, then all running sequences
advance one token per decode step, and the step gets slower as the batch grows.
Requests that would overflow the KV cache wait for space, as they would on a GPU.
The model lives in `fleet.replica_model`, which the simulator runs too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Hashable
from typing import Self

from fleet.config import SimProfile, TierConfig
from fleet.policy.capacity import startup_seconds
from fleet.policy.cold_start import ColdStartPhases
from fleet.prefix import prefix_key
from fleet.prompt_size import estimate_prompt_tokens
from fleet.replica_model import ReplicaModel, prefill_s, step_s
from workers.engines.base import Delta, Engine, EngineError, EngineRequest
from workers.engines.sim_answers import answer, logprobs_of

WARMUP_PROMPT_TOKENS = 8  # the sim's warm-up call: a short prompt and one token, as the vllm engine's


def cold_start_phases_s(p: SimProfile) -> tuple[float, float, float]:
    """The profile's cold start as its phases (`fleet.policy.cold_start`): load (weights / load
    speed), init and first_token, which share the warm-up: the warm-up call is a short prefill and
    one decode step, and the engine's init is the rest of `warmup_s` (none when the call alone is
    longer). They sum to `fleet.replica_model.cold_start_s`, the model the fleet budgets with."""
    load = startup_seconds(p.weights_gb * 1e9, p.load_gb_s * 1e9, 0.0)
    first = min(p.warmup_s, prefill_s(p, WARMUP_PROMPT_TOKENS) + step_s(p, 1))
    return load, p.warmup_s - first, first


class SimEngine(Engine):
    """The sim engine in real time: `fleet.replica_model.ReplicaModel` stepped by a clock.

    Each decode step sleeps the model's step time for the batch decoding now,
    then gives every sequence in the batch its token; a sequence joins after its
    prefill (paid beside the batch) and waits for KV room before that, as on a GPU.
    """

    cold_start_s: float = 0.0  # measured by `start`, at the scaled clock
    cold_start_phases: ColdStartPhases | None = None  # each phase measured by `start`, at the scaled clock

    def __init__(self, profile: SimProfile, *, time_scale: float = 1.0) -> None:
        # time_scale < 1 runs the model faster than life (tests of cold start).
        self.profile = profile
        self.time_scale = time_scale
        self.model = ReplicaModel(profile)
        self._tokens: dict[Hashable, asyncio.Queue[int | None]] = {}  # per sequence in the batch: a tick per token
        self._kv_free = asyncio.Condition()
        self._stepper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._running: set[str] = set()  # request ids in generate, from the KV wait to the end

    @classmethod
    def for_tier(cls, tier: TierConfig, *, time_scale: float = 1.0) -> Self:
        return cls(tier.sim, time_scale=time_scale)

    @property
    def kv_capacity_tokens(self) -> int:
        """The profile's KV cache, which `generate` waits for room in, as a GPU's."""
        return self.profile.kv_capacity_tokens

    async def start(self) -> None:
        """The profile's cold start, phase by phase (`fleet.replica_model.cold_start_phases_s`), each
        timed by the clock as it passes, so what the replica reports is measured, as a real engine's."""
        t0 = time.monotonic()
        took = []
        for s in cold_start_phases_s(self.profile):
            t = time.monotonic()
            await asyncio.sleep(s * self.time_scale)
            took.append(time.monotonic() - t)
        self.cold_start_s = time.monotonic() - t0
        self.cold_start_phases = ColdStartPhases(load_s=took[0], init_s=took[1], first_token_s=took[2],
                                                 total_s=self.cold_start_s)
        self._stepper = asyncio.create_task(self._step_loop())

    async def stop(self) -> None:
        if self._stepper:
            self._stepper.cancel()
            await asyncio.gather(self._stepper, return_exceptions=True)

    async def abort(self, request_id: str) -> None:
        if self.model.leave(request_id) is not None:
            q = self._tokens.pop(request_id, None)
            if q is not None:
                q.put_nowait(None)

    async def _step_loop(self) -> None:
        while True:
            if not self.model.decoding:
                self._wake.clear()
                await self._wake.wait()
            step = self.model.step_s() * self.time_scale  # re-timed each step: the batch may have changed
            await asyncio.sleep(step if step > 0 else 0)
            for key in self.model.decoding:
                q = self._tokens.get(key)
                if q is not None:
                    q.put_nowait(1)
            for key in self.model.step():
                self._tokens.pop(key, None)

    async def generate(self, req: EngineRequest) -> AsyncGenerator[Delta, None]:
        """Wait for KV room, pay the prefill, join the batch, then yield a piece of the answer per
        decode step until it ends (or an abort); the KV room is freed however it ends."""
        # As the other engines: typed, not a hang (no stepper would ever tick) or a mixed-up answer.
        if self._stepper is None:
            raise EngineError("engine is not started", "engine_error", "not_started")
        if req.request_id in self._running:
            raise EngineError(f"request {req.request_id!r} is already running", "invalid_request_error", "duplicate_id")
        plan = answer(req, self.profile)  # a typed 400 for what it cannot take, before any time is spent
        prompt_tokens = estimate_prompt_tokens(req.kind, req.body)
        steps = len(plan.pieces)
        need = self.model.kv_need(prompt_tokens, steps)
        self._running.add(req.request_id)
        try:
            async with self._kv_free:
                await self._kv_free.wait_for(lambda: self.model.fits(need))
                self.model.reserve(need)
            try:
                # The prefix this replica served last for the same conversation is cached: only the rest is computed.
                prefix = prefix_key(req.kind, req.body) or None
                await asyncio.sleep(prefill_s(self.profile, self.model.prefixes.uncached_tokens(prefix, prompt_tokens))
                                    * self.time_scale)
                self.model.prefixes.store(prefix, prompt_tokens + steps)
                ticks: asyncio.Queue[int | None] = asyncio.Queue()
                self._tokens[req.request_id] = ticks
                self.model.join(req.request_id, steps)
                self._wake.set()
                offset = 0
                for done, piece in enumerate(plan.pieces, 1):
                    if await ticks.get() is None:
                        return
                    yield Delta(piece.text, prompt_tokens, done, plan.finish_reason if done == steps else None,
                                fields=piece.fields, logprobs=logprobs_of(piece, req.body, req.kind == "chat", offset))
                    offset += len(piece.text)
            finally:
                self.model.leave(req.request_id)
                self._tokens.pop(req.request_id, None)
                async with self._kv_free:
                    self.model.free(need)
                    self._kv_free.notify_all()
        finally:
            self._running.discard(req.request_id)
