"""The `sim` engine: a calibrated GPU latency model that emits real token streams.

Not a fixed sleep: a request pays prefill for its prompt, then all running
sequences advance one token per decode step, and the step gets slower as the
batch grows. Requests that would overflow the KV cache wait for space, as
they would on a GPU. The math lives in `fleet.latency`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fleet.config import SimProfile
from fleet.latency import cold_start_s, decode_step_s, kv_tokens, prefill_s
from workers.engines.base import Delta, EngineRequest

_WORDS = ("line", "drain", "floor", "ceiling", "shed", "budget", "lease", "tier", "replica", "token",
          "queue", "warm", "burst", "open", "chain", "plan", "route", "asset", "thesis", "signal")


def count_tokens(text: str) -> int:
    """A tokenizer-free estimate (about four characters a token), at least one."""
    return max(1, (len(text) + 3) // 4)


def prompt_text(req: EngineRequest) -> str:
    if req.messages is not None:
        return "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in req.messages)
    return req.prompt or ""


@dataclass
class _Seq:
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    remaining: int = 0


class SimEngine:
    def __init__(self, profile: SimProfile, *, time_scale: float = 1.0) -> None:
        # time_scale < 1 runs the model faster than life (tests of cold start).
        self.profile = profile
        self.time_scale = time_scale
        self.cold_start_s = 0.0
        self._running: dict[str, _Seq] = {}
        self._kv_used = 0
        self._kv_free = asyncio.Condition()
        self._stepper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        t0 = time.monotonic()
        await asyncio.sleep(cold_start_s(self.profile) * self.time_scale)
        self.cold_start_s = time.monotonic() - t0
        self._stepper = asyncio.create_task(self._step_loop())

    async def stop(self) -> None:
        if self._stepper:
            self._stepper.cancel()
            await asyncio.gather(self._stepper, return_exceptions=True)

    async def abort(self, request_id: str) -> None:
        seq = self._running.pop(request_id, None)
        if seq:
            seq.queue.put_nowait(None)

    async def _step_loop(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            batch = len(self._running)
            step = decode_step_s(self.profile, batch) * self.time_scale
            if step > 0:
                await asyncio.sleep(step)
            else:
                await asyncio.sleep(0)
            for rid, seq in list(self._running.items()):
                seq.remaining -= 1
                seq.queue.put_nowait(1)
                if seq.remaining <= 0:
                    self._running.pop(rid, None)

    async def generate(self, req: EngineRequest) -> AsyncIterator[Delta]:
        prompt_tokens = count_tokens(prompt_text(req))
        need = min(kv_tokens(prompt_tokens, req.max_tokens), self.profile.kv_capacity_tokens)
        async with self._kv_free:
            await self._kv_free.wait_for(lambda: self._kv_used + need <= self.profile.kv_capacity_tokens)
            self._kv_used += need
        words = itertools.cycle(_WORDS[(hash(req.request_id) % len(_WORDS)):] + _WORDS)
        try:
            await asyncio.sleep(prefill_s(self.profile, prompt_tokens) * self.time_scale)
            seq = _Seq(remaining=req.max_tokens)
            self._running[req.request_id] = seq
            self._wake.set()
            done = 0
            while done < req.max_tokens:
                tick = await seq.queue.get()
                if tick is None:
                    return
                done += 1
                last = done == req.max_tokens
                yield Delta(text=(" " if done > 1 else "") + next(words), prompt_tokens=prompt_tokens,
                            completion_tokens=done, finish_reason="length" if last else None)
        finally:
            self._running.pop(req.request_id, None)
            async with self._kv_free:
                self._kv_used -= need
                self._kv_free.notify_all()
