"""Locust users that behave like an agent fleet, streaming through the OpenAI-compatible API.

- `PlannerChain`: a committed planner call that fans out to analysis calls, each
  of which makes routing calls, all within one chain deadline (`X-Chain-Id`,
  `X-Deadline-Ms` set to what is left of the chain's budget at each hop).
- `SpeculativeAgent`: cheap, short-deadline speculative calls that the fleet
  may refuse first.
- `BackgroundSummariser`: long, patient background summaries.

What Locust records (request_type / name):

- `SSE` / `<tier> <class>`: one streamed call, response time = end to end,
  length = completion tokens. Failures are only what the gateway got wrong:
  a 5xx other than 504, a `worker_lost` stream, a broken stream, a refused
  connection.
- `METRIC` / `ttft` and `tpot`: time to first token and time per output token
  (vLLM's `bench serve` definitions), in milliseconds.
- `SHED` / `<reason>`: a typed 429 (`drain_exceeded`, `budget_exhausted`, ...):
  the fleet saying no as designed, so never a failure; counted by reason.
- `EXPIRED` / `<tier>`: a 504 `deadline_exceeded`, the deadline honoured.
- `CHAIN` / `planner chain <outcome>`: a whole chain, end to end.

Run with the market-open shape: `make loadtest`, or
`locust -f loadtests/locustfile.py,loadtests/market_open.py --headless --host http://127.0.0.1:8000`.
Without the shape file, `-u/-r/-t` drive it as usual.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections import Counter
from typing import Any

import gevent
import requests
from locust import HttpUser, between, events, task
from locust.env import Environment

CHAIN_DEADLINE_S = float(os.environ.get("LOADTEST_CHAIN_DEADLINE_S", "30"))
FANOUT = int(os.environ.get("LOADTEST_FANOUT", "3"))            # analysis calls per planner call
ROUTES_PER_ANALYSIS = int(os.environ.get("LOADTEST_ROUTES", "2"))  # routing calls per analysis call
TOKENS = float(os.environ.get("LOADTEST_TOKENS", "1.0"))         # scales every call's max_tokens
API_KEY = os.environ.get("LOADTEST_API_KEY", "")

SHEDS: Counter[str] = Counter()     # 429s by reason, for the summary at the end
OUTCOMES: Counter[str] = Counter()  # every call by outcome


class GatewayError(Exception):
    """Something the gateway got wrong (as opposed to a typed refusal or an honoured deadline)."""


def _tokens(n: int) -> int:
    return max(1, round(n * TOKENS))


class Outcome:
    """What one call came to."""

    __slots__ = ("completion_tokens", "kind", "reason")

    def __init__(self, kind: str, reason: str = "", completion_tokens: int = 0) -> None:
        self.kind = kind  # completed | shed | expired | failed
        self.reason = reason
        self.completion_tokens = completion_tokens


def stream_call(env: Environment, http: requests.Session, host: str, tier: str, priority: str, prompt: str,
                max_tokens: int, deadline_ms: int, chain: str = "") -> Outcome:
    """One streamed chat completion; fires its Locust events and returns its outcome."""
    headers = {"X-Priority": priority, "X-Deadline-Ms": str(max(1, deadline_ms))}
    if chain:
        headers["X-Chain-Id"] = chain
    if API_KEY:
        headers["Authorization"] = f"Bearer {API_KEY}"
    # ignore_eos (vLLM's request field, which the sim engine honours too): each call writes exactly its
    # max_tokens, so the shape's load is the same on any engine and its figures stay comparable.
    body = {"model": tier, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    timer = _Timer(env, tier, priority)
    try:
        with http.post(f"{host}/v1/chat/completions", json=body, headers=headers, stream=True,
                       timeout=(5, deadline_ms / 1000 + 30)) as resp:
            refused = _refused(timer, resp)
            if refused is not None:
                return _count(refused)
            read = _read_stream(timer, resp)
    except (requests.RequestException, ValueError) as e:
        timer.fire(GatewayError(f"{type(e).__name__}: {e}"))
        return _count(Outcome("failed", type(e).__name__))
    if read.ended is not None:
        return _count(read.ended)

    latency = time.perf_counter() - timer.t0
    tokens = int(read.usage.get("completion_tokens") or read.chunks)
    if read.ttft is not None:
        env.events.request.fire(request_type="METRIC", name="ttft", response_time=read.ttft * 1000,
                                response_length=0, exception=None, context={"tier": tier})
        if tokens > 1:
            env.events.request.fire(request_type="METRIC", name="tpot",
                                    response_time=(latency - read.ttft) / (tokens - 1) * 1000, response_length=0,
                                    exception=None, context={"tier": tier})
    timer.fire(None, tokens)
    return _count(Outcome("completed", completion_tokens=tokens))


class _Timer:
    """One call's clock and its Locust events."""

    def __init__(self, env: Environment, tier: str, priority: str) -> None:
        self.env, self.tier, self.priority = env, tier, priority
        self.name = f"{tier} {priority}"
        self.t0 = time.perf_counter()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000

    def fire(self, exc: Exception | None, tokens: int = 0) -> None:
        self.env.events.request.fire(request_type="SSE", name=self.name, response_time=self.elapsed_ms(),
                                     response_length=tokens, exception=exc,
                                     context={"tier": self.tier, "priority": self.priority})

    def mark(self, request_type: str, name: str, context: dict[str, str]) -> None:
        self.env.events.request.fire(request_type=request_type, name=name, response_time=self.elapsed_ms(),
                                     response_length=0, exception=None, context=context)


def _refused(timer: _Timer, resp: requests.Response) -> Outcome | None:
    """The outcome of a call answered without a stream (shed, expired, failed); None for a 200."""
    context = {"tier": timer.tier, "priority": timer.priority}
    if resp.status_code == 429:
        reason = str(_error(resp).get("code") or "unknown")
        SHEDS[reason] += 1
        timer.mark("SHED", reason, context)
        return Outcome("shed", reason)
    if resp.status_code == 504:
        timer.mark("EXPIRED", timer.tier, context)
        return Outcome("expired", "deadline_exceeded")
    if resp.status_code != 200:
        err = _error(resp)
        timer.fire(GatewayError(f"HTTP {resp.status_code} {err.get('type')}: {err.get('message')}"))
        return Outcome("failed", f"http_{resp.status_code}")
    return None


class _Read:
    """What a stream said: its usage, content chunks and first token, or how it ended early."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] = {}
        self.chunks = 0
        self.ttft: float | None = None
        self.ended: Outcome | None = None  # expired or failed mid-stream; None: it completed


def _read_stream(timer: _Timer, resp: requests.Response) -> _Read:
    read = _Read()
    for raw in resp.iter_lines():
        if not raw or not raw.startswith(b"data: "):
            continue
        data = raw[6:]
        if data == b"[DONE]":
            return read
        ev = json.loads(data)
        if "error" in ev:
            read.ended = _stream_error(timer, ev["error"])
            return read
        if ev.get("usage"):
            read.usage = ev["usage"]
        for ch in ev.get("choices", []):
            if (ch.get("delta") or {}).get("content"):
                read.chunks += 1
                if read.ttft is None:
                    read.ttft = time.perf_counter() - timer.t0
    timer.fire(GatewayError("stream ended without data: [DONE]"))
    read.ended = Outcome("failed", "truncated")
    return read


def _stream_error(timer: _Timer, e: dict[str, Any]) -> Outcome:
    if e.get("type") == "deadline_exceeded":  # the deadline passed mid-stream: honoured
        timer.mark("EXPIRED", timer.tier, {})
        return Outcome("expired", "deadline_exceeded")
    timer.fire(GatewayError(f"stream error {e.get('type')}: {e.get('message')}"))
    return Outcome("failed", str(e.get("type")))


def _error(resp: requests.Response) -> dict[str, Any]:
    try:
        return dict(resp.json().get("error") or {})
    except ValueError:
        return {"message": resp.text[:200]}


def _count(o: Outcome) -> Outcome:
    OUTCOMES[o.kind] += 1
    return o


class AgentUser(HttpUser):
    """Streams with its own requests session, so Locust's stats hold end-to-end
    stream times (Locust's HttpSession would time only the response headers)."""

    abstract = True

    def on_start(self) -> None:
        self.http = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=32)
        self.http.mount("http://", adapter)
        self.http.mount("https://", adapter)

    def on_stop(self) -> None:
        self.http.close()

    def call(self, tier: str, priority: str, prompt: str, max_tokens: int, deadline_ms: int,
             chain: str = "") -> Outcome:
        return stream_call(self.environment, self.http, self.host.rstrip("/"), tier, priority, prompt,
                           max_tokens, deadline_ms, chain)


class PlannerChain(AgentUser):
    """planner (committed) -> FANOUT x analysis -> ROUTES_PER_ANALYSIS x routing, one chain deadline.

    Every hop carries the chain's class and what is left of its deadline, so the
    fleet can refuse a hop that cannot finish in time instead of serving it late."""

    weight = 1
    wait_time = between(2, 5)

    @task
    def chain(self) -> None:
        chain = f"chain-{uuid.uuid4().hex[:12]}"
        t0 = time.perf_counter()
        end = t0 + CHAIN_DEADLINE_S

        def left_ms() -> int:
            return int((end - time.perf_counter()) * 1000)

        outcomes: list[Outcome] = []

        def routing(asset: str) -> None:
            if left_ms() > 0:
                outcomes.append(self.call("routing", "committed", f"route the {asset} signal", _tokens(8),
                                          left_ms(), chain))

        def analysis(asset: str) -> None:
            if left_ms() <= 0:
                return
            o = self.call("analysis", "committed", f"analyse {asset} into the thesis", _tokens(48), left_ms(), chain)
            outcomes.append(o)
            if o.kind == "completed":
                gevent.joinall([gevent.spawn(routing, asset) for _ in range(ROUTES_PER_ANALYSIS)])

        plan = self.call("planner", "committed", "compose today's thesis from the overnight tape", _tokens(64),
                         left_ms(), chain)
        outcomes.append(plan)
        if plan.kind == "completed":
            assets = random.sample(["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOG", "META", "JPM"], FANOUT)
            gevent.joinall([gevent.spawn(analysis, a) for a in assets])
        kinds = {o.kind for o in outcomes}
        result = next((k for k in ("failed", "shed", "expired") if k in kinds), "completed")
        if result == "completed" and time.perf_counter() > end:
            result = "late"
        self.environment.events.request.fire(request_type="CHAIN", name=f"planner chain {result}",
                                             response_time=(time.perf_counter() - t0) * 1000,
                                             response_length=len(outcomes), exception=None, context={})


class SpeculativeAgent(AgentUser):
    """Guesses ahead: many cheap calls, short deadlines, first to be refused."""

    weight = 2
    wait_time = between(0.5, 2)

    @task(3)
    def route(self) -> None:
        self.call("routing", "speculative", "is this headline market-moving?", _tokens(8), 3000)

    @task(1)
    def peek(self) -> None:
        self.call("analysis", "speculative", "sketch a reaction to the print", _tokens(24), 5000)


class BackgroundSummariser(AgentUser):
    """Summarises the tape; happy to wait, never urgent."""

    weight = 1
    wait_time = between(3, 8)

    @task
    def summarise(self) -> None:
        self.call("analysis", "background", "summarise the last hour of filings: " + "lorem " * 200, _tokens(96),
                  60000)


@events.test_stop.add_listener
def _summary(environment: Environment, **_: Any) -> None:
    shed = ", ".join(f"{k}={v}" for k, v in SHEDS.most_common()) or "none"
    print(f"fleet loadtest: calls by outcome {dict(OUTCOMES)}; 429s by reason: {shed}", flush=True)
