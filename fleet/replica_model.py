"""How one replica of the `sim` engine behaves: its KV cache, its prefills and its decode batch.

One model, two drivers. The worker's sim engine (`workers.engines.sim`) runs it
in real time, one decode step after another; the simulator (`simulator`) runs
it in simulated time, jumping from one change of the batch to the next. Both
follow the same rules, from the tier's `sim:` profile:

- a request reserves KV-cache room for its longest possible life (prompt +
  max_tokens, at most the whole cache) before it starts, and waits while it
  does not fit;
- it then pays its prefill (prompt tokens / prefill rate), beside the batch:
  prefills do not slow the decode steps;
- it joins the decode batch: every step gives each sequence in the batch one
  token, and a step lasts base + per_seq * (sequences in the batch), re-timed
  at every step as sequences join and leave (the throughput-latency trade);
- it leaves the batch with its last token, and frees its KV room.

A replica also keeps a prefix cache (`PrefixCache`, `prefix_cache_tokens` of the profile, by
default its whole KV cache, as vLLM's automatic prefix caching reuses free KV blocks): the
tokens of the prefixes it served last, least recently used evicted first. A call whose prefix
it holds pays the prefill of the rest of its prompt only (`uncached_tokens`).

Progress is kept as one counter per replica, `progress`: the tokens each
sequence of the batch has received since the replica started. A sequence that
joins at progress P with n tokens to make finishes at P + n. The engine adds one
per step (`step`); the simulator adds elapsed time / step time (`advance`),
which is the same steps counted in fractions between batch changes.

Pure: no I/O, no clock of its own. The capacity the policy *assumes* is a
separate thing (`fleet.policy.tier_capacity`); by default it is taken from this
same profile.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass

from fleet.config import SimProfile
from fleet.policy.capacity import decode_step_s, startup_seconds

_EPS = 1e-9


def cold_start_s(p: SimProfile) -> float:
    """Weights load plus warm-up: the cold-start tax of one replica."""
    return startup_seconds(p.weights_gb * 1e9, p.load_gb_s * 1e9, p.warmup_s)


def prefill_s(p: SimProfile, prompt_tokens: int) -> float:
    return prompt_tokens / p.prefill_tokens_per_s


def step_s(p: SimProfile, batch: int) -> float:
    """One decode step of a batch of `batch` sequences."""
    return decode_step_s(p.decode_step.base_s, p.decode_step.per_seq_s, batch)


def service_s(p: SimProfile, prompt_tokens: int, output_tokens: int, batch: int) -> float:
    """A request served inside a steady batch of `batch` sequences: its prefill, then its tokens."""
    return prefill_s(p, prompt_tokens) + output_tokens * step_s(p, batch)


def kv_need(p: SimProfile, prompt_tokens: int, max_tokens: int) -> int:
    """KV-cache room a request reserves: its longest possible life, at most the whole cache."""
    return min(prompt_tokens + max_tokens, p.kv_capacity_tokens)


class PrefixCache:
    """A replica's cached prefixes: key -> tokens held, at most `capacity` tokens in all, the least
    recently used evicted first. Pure: counts what it saved (`hit_tokens` of `prompt_tokens`)."""

    __slots__ = ("_held", "capacity", "hit_tokens", "prompt_tokens", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._held: dict[Hashable, int] = {}  # insertion order is recency: the first is the coldest
        self.used = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def uncached_tokens(self, key: Hashable | None, prompt_tokens: int) -> int:
        """The tokens of a prompt its prefill must compute: those past the cached prefix of `key`."""
        hit = min(self._held.get(key, 0), prompt_tokens) if key is not None else 0
        self.hit_tokens += hit
        self.prompt_tokens += prompt_tokens
        return prompt_tokens - hit

    def store(self, key: Hashable | None, tokens: int) -> None:
        """`key`'s prefix is now `tokens` long here (its prompt and answer), the most recent."""
        if key is None or self.capacity <= 0:
            return
        self.used -= self._held.pop(key, 0)
        tokens = min(tokens, self.capacity)
        while self._held and self.used + tokens > self.capacity:
            self.used -= self._held.pop(next(iter(self._held)))
        self._held[key] = tokens
        self.used += tokens

    @property
    def hit_rate(self) -> float:
        """Of the prompt tokens seen, the share the cache spared the prefill."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class Sequence:
    key: Hashable
    joined: float  # the replica's progress when it joined the batch
    target: float  # the progress at which it has all its tokens
    active: bool = True


class ReplicaModel:
    """One replica's KV cache and decode batch (see the module doc)."""

    __slots__ = ("_heap", "_joins", "base_s", "decoding", "kv_capacity", "kv_used", "per_seq_s", "prefixes",
                 "profile", "progress")

    def __init__(self, profile: SimProfile) -> None:
        self.profile = profile
        self.kv_capacity = profile.kv_capacity_tokens
        self.base_s = profile.decode_step.base_s
        self.per_seq_s = profile.decode_step.per_seq_s
        self.kv_used = 0
        self.progress = 0.0
        self.decoding: dict[Hashable, Sequence] = {}
        self._heap: list[tuple[float, int, Sequence]] = []  # (target, join order, sequence); lazily cleaned
        self._joins = 0
        cached = profile.prefix_cache_tokens
        self.prefixes = PrefixCache(profile.kv_capacity_tokens if cached is None else cached)

    # --- the KV cache ---

    def kv_need(self, prompt_tokens: int, max_tokens: int) -> int:
        return min(prompt_tokens + max_tokens, self.kv_capacity)

    def fits(self, need: int) -> bool:
        return self.kv_used + need <= self.kv_capacity

    def reserve(self, need: int) -> None:
        self.kv_used += need

    def free(self, need: int) -> None:
        self.kv_used -= need

    # --- the decode batch ---

    def step_s(self) -> float:
        """How long the next decode step takes, for the batch decoding now."""
        return self.base_s + self.per_seq_s * max(1, len(self.decoding))

    def join(self, key: Hashable, tokens: int) -> Sequence:
        """A sequence whose prefill is done joins the batch, with `tokens` to make."""
        seq = Sequence(key, self.progress, self.progress + max(0, tokens))
        self.decoding[key] = seq
        self._joins += 1  # ties finish in the order they joined: deterministic
        heapq.heappush(self._heap, (seq.target, self._joins, seq))
        return seq

    def leave(self, key: Hashable) -> Sequence | None:
        """A sequence leaves the batch before its end (aborted, cancelled)."""
        seq = self.decoding.pop(key, None)
        if seq is not None:
            seq.active = False
        return seq

    def tokens_of(self, seq: Sequence) -> float:
        """Tokens the sequence has received so far."""
        return min(self.progress, seq.target) - seq.joined

    def step(self) -> list[Hashable]:
        """One decode step (the engine): every sequence gets a token; those done leave. Returns their keys."""
        self.progress += 1
        return self._finished()

    def advance(self, dt: float) -> list[Hashable]:
        """`dt` seconds of decoding at the current batch (the simulator, between batch changes):
        the steps that fit, in fractions. Returns the keys of the sequences that finished."""
        if self.decoding and dt > 0:
            self.progress += dt / self.step_s()
        return self._finished()

    def time_to_next_finish(self) -> float | None:
        """Seconds until the next sequence finishes at the current batch; None when none decodes."""
        head = self._head()
        if head is None:
            return None
        return max(0.0, head.target - self.progress) * self.step_s()

    def _head(self) -> Sequence | None:
        heap = self._heap
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _finished(self) -> list[Hashable]:
        done = []
        while (head := self._head()) is not None and head.target <= self.progress + _EPS:
            heapq.heappop(self._heap)
            head.active = False
            del self.decoding[head.key]
            done.append(head.key)
        return done
