"""Agents with a clock: the real `openai` client, a timeout and its default retries, against one saturated replica.

One `routing` replica with 4 slots serves 200-token answers in about 1.5 s each. `--agents`
(24) agents each run chains of 3 committed calls (`X-Chain-Id`), one after another, through
`openai.AsyncOpenAI(timeout=..., max_retries=2)`: what an agent framework does. A chain whose
call fails (the SDK gave up) is dropped and the agent starts a new one.

Runs, each `--seconds` long, on one fleet:
- `capacity`: the same agents with a timeout long enough never to fire (what the replica serves);
- `as-written`: a `--timeout-s` (5 s) timeout, no fleet header but `X-Priority`;
- `deadline`: the same agents also sending `X-Deadline-Ms` equal to their timeout;
- `long`: `--long-agents` (4) agents whose calls take about `--long-call-s` (4 s) behind a
  client timeout of `--long-timeout-s` (2.5 s), with no overload at all.
With `--off`, each run is repeated on a fleet whose client-clock features are off
(`client_clock.enabled: false`), the code before them.

Printed per run: calls answered (and as a share of capacity), attempts and attempts abandoned at
the client's timeout, answered calls that ended 504, chains completed and the share of answered
calls in completed chains, attempts per answered call.

Bounded: every run stops itself after `--seconds` (plus the clients' own timeouts); traffic goes
to 127.0.0.1 only.

    .venv/bin/python bench/retry_storm.py [--seconds 30] [--agents 24] [--off]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import fleet_env, fleetctl, stop  # noqa: E402
from fleet.redis_server import PrivateRedis, free_port  # noqa: E402

STEP_S = 0.0075  # 200 tokens in 1.5 s

FLEET = """
namespace: bench
heartbeat_s: 0.5
rate_window_s: 10.0
gateway: {{max_connections_per_client: 0}}
client_clock: {{enabled: {enabled}}}
tiers:
  routing:
    warm_floor: 1
    max_replicas: 1
    slots: 4
    lease_s: 10
    sim:
      weights_gb: 0
      load_gb_s: 1
      warmup_s: 0
      prefill_tokens_per_s: 1.0e9
      decode_step: {{base_s: {step}, per_seq_s: 0}}
      kv_capacity_tokens: 100000000
      typical_prompt_tokens: 16
      typical_output_tokens: 200
"""


@dataclass
class Tally:
    """What one run's agents saw."""

    until: float = 0.0  # the run's end (monotonic): answers after it are not counted as served
    attempts: int = 0
    responses: collections.Counter[int] = field(default_factory=collections.Counter)
    answered: int = 0
    answered_in_chains: list[int] = field(default_factory=list)  # per chain: calls answered
    chains_done: int = 0
    chains_failed: int = 0

    @property
    def abandoned(self) -> int:
        """Attempts that got no response: the client's timeout fired first."""
        return self.attempts - sum(self.responses.values())


def client(base: str, timeout_s: float, tally: Tally) -> openai.AsyncOpenAI:
    """The SDK as an agent framework makes it, counting every attempt and every response it gets."""

    async def sent(req: httpx.Request) -> None:
        req.extensions["in_window"] = time.monotonic() <= tally.until
        if req.extensions["in_window"]:  # what the window's agents spent, and (below) what it got them
            tally.attempts += 1

    async def got(r: httpx.Response) -> None:
        if r.request.extensions.get("in_window"):
            tally.responses[r.status_code] += 1

    http = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=1000),
                             event_hooks={"request": [sent], "response": [got]})
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout_s, max_retries=2,
                              http_client=http)


async def agent(c: openai.AsyncOpenAI, tally: Tally, until: float, tokens: int, deadline_ms: int | None) -> None:
    """Chains of 3 committed calls, one after another, until `until`."""
    while time.monotonic() < until:
        chain = uuid.uuid4().hex[:12]
        done = in_window = 0
        for _ in range(3):
            headers = {"X-Priority": "committed", "X-Chain-Id": chain}
            if deadline_ms is not None:
                headers["X-Deadline-Ms"] = str(deadline_ms)
            try:
                await c.chat.completions.create(
                    model="routing", messages=[{"role": "user", "content": f"route {chain} step {done}"}],
                    max_tokens=tokens, extra_body={"ignore_eos": True}, extra_headers=headers)
            except openai.OpenAIError:
                break
            done += 1
            if time.monotonic() <= tally.until:
                tally.answered += 1
                in_window += 1
        # A chain is judged once it ended (completed or failed), counting its answers in the window.
        tally.answered_in_chains.append(in_window if done == 3 else -in_window)
        if done == 3:
            tally.chains_done += 1
        else:
            tally.chains_failed += 1


async def run(base: str, *, agents: int, seconds: float, timeout_s: float, tokens: int,
              deadline: bool) -> Tally:
    tally = Tally(until=time.monotonic() + seconds)
    clients = [client(base, timeout_s, tally) for _ in range(agents)]
    until = tally.until
    tasks = [asyncio.create_task(agent(c, tally, until, tokens, int(timeout_s * 1000) if deadline else None))
             for c in clients]
    await asyncio.wait(tasks, timeout=seconds + 3 * timeout_s + 30)
    for t in tasks:
        t.cancel()
    for c in clients:
        with contextlib.suppress(Exception):
            await c.close()
    return tally


def report(name: str, t: Tally, capacity: int | None) -> str:
    share = f"{100 * t.answered / capacity:.0f}%" if capacity else "-"
    in_done = sum(n for n in t.answered_in_chains if n > 0)
    per = t.attempts / t.answered if t.answered else float("inf")
    ended_504 = t.responses.get(504, 0)  # of the window's attempts
    refused = t.responses.get(429, 0)
    return (f"{name:<22} answered {t.answered:>4} ({share:>4} of capacity)  attempts {t.attempts:>5}  "
            f"abandoned {t.abandoned:>4} ({100 * t.abandoned / max(1, t.attempts):.0f}%)  429 {refused:>4}  "
            f"504 {ended_504:>3} ({100 * ended_504 / max(1, t.answered):.0f}% of answered)  "
            f"chains {t.chains_done}/{t.chains_done + t.chains_failed}  "
            f"in done chains {100 * in_done / max(1, t.answered):.0f}%  attempts/answer {per:.2f}")


def fleet_up(enabled: bool, redis_url: str) -> tuple[str, list]:  # type: ignore[type-arg]
    env = fleet_env(FLEET.format(enabled=str(enabled).lower(), step=STEP_S), redis_url)
    port = free_port()
    # The scaler starts the replica (the floor) and calibrates the tier's rate from what it serves,
    # as `fleet up` does: admission then plans with the replica's measured speed, not the profile's.
    procs = [fleetctl("gateway", "--port", str(port), env=env),
             fleetctl("scaler", "--tick", "0.5", "--metrics-port", "0", "--stop-replicas-on-exit", env=env)]
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/v1/fleet/status", timeout=2).json()["tiers"]["routing"]["replicas"]["ready"] >= 1:
                return base, procs
        time.sleep(0.2)
    stop(procs)
    raise SystemExit("the fleet did not become ready within 60 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--agents", type=int, default=24)
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--long-agents", type=int, default=4)
    ap.add_argument("--long-call-s", type=float, default=4.0)
    ap.add_argument("--long-timeout-s", type=float, default=2.5)
    ap.add_argument("--off", action="store_true", help="also run each case with the client-clock features off")
    ap.add_argument("--cases", default="as-written,deadline,long", help="which runs beside capacity (comma list)")
    args = ap.parse_args()
    long_tokens = int(args.long_call_s / STEP_S)
    server = PrivateRedis().start()
    try:
        for enabled in ([True, False] if args.off else [True]):
            base, procs = fleet_up(enabled, server.url)
            label = "on" if enabled else "off"
            try:
                cap = asyncio.run(run(base, agents=args.agents, seconds=args.seconds, timeout_s=120, tokens=200,
                                      deadline=False))
                print(report(f"[{label}] capacity", cap, cap.answered), flush=True)
                cases = args.cases.split(",")
                for name, dl in (("as-written", False), ("deadline", True)):
                    if name in cases:
                        t = asyncio.run(run(base, agents=args.agents, seconds=args.seconds,
                                            timeout_s=args.timeout_s, tokens=200, deadline=dl))
                        print(report(f"[{label}] {name}", t, cap.answered), flush=True)
                if "long" in cases:
                    t = asyncio.run(run(base, agents=args.long_agents, seconds=args.seconds,
                                        timeout_s=args.long_timeout_s, tokens=long_tokens, deadline=False))
                    print(report(f"[{label}] long calls", t, None), flush=True)
            finally:
                stop(procs)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
