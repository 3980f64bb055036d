"""Every way a call ends, through a real gateway app: counted once, its ticket closed.

The gateway runs in this process (its app and lifespan, spoken to in ASGI by a scripted client
that can leave at any moment) on a private Redis; the worker is this test taking the call off
the line with the store's own claim API (`Line.claim`, `emit`, `finish`), as a worker does.
Each call is made with an API key that has a dollar budget, so its ticket is seen closing: the
key holds no reservation once the call ended, and was charged only what the end says
(`gateway.tickets.Ticket.close`). Each test asserts the one outcome counted in
`fleet_requests_total` (`fleet.outcome.Outcome`), and for a call that reached the line, the
same word in the line's counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from redis.asyncio import Redis

from fleet import metrics
from fleet.config import load_config
from fleet.outcome import Outcome
from fleet.redis_server import PrivateRedis
from fleet.store.events import Done, Failed
from fleet.store.key_budget import KeyBudget
from fleet.store.line import Claimed, Line
from gateway.app import create_app
from tests.harness import TEST_CONFIG

TIER = "routing"
SECRET = "sk-call-ends"
BROKE = "sk-call-ends-broke"  # a key with no budget left: shed at admission
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()
CHAT = {"model": TIER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2}
CHUNK = b'"delta":{"content":"hi"},"logprobs":null'


@dataclass(frozen=True)
class Route:
    """One of the answer's routes: its path, a body for it, the worker's chunk and whole choice for
    its kind, and what its stream's last bytes say when it completed."""

    path: str
    body: dict[str, Any]
    chunk: bytes = CHUNK
    choice: dict[str, Any] = field(default_factory=lambda: {"message": {"role": "assistant", "content": "hi"}})
    streamed_end: bytes = b"data: [DONE]"  # in its last event


MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES = {
    "chat": Route("/v1/chat/completions", CHAT),
    "completions": Route("/v1/completions", {"model": TIER, "prompt": "hi", "max_tokens": 4},
                         b'"text":"hi","logprobs":null', {"text": "hi"}),
    "responses": Route("/v1/responses", {"model": TIER, "input": "hi", "max_output_tokens": 16},
                       streamed_end=b"response.completed"),
    "messages": Route("/v1/messages", {"model": TIER, "messages": MESSAGES, "max_tokens": 4},
                      streamed_end=b"message_stop"),
}


# --- the scripted client ----------------------------------------------------------------------

@dataclass
class Client:
    """One HTTP call spoken in ASGI: its body, then silence until `leave()` (then `http.disconnect`,
    as a server says once the connection is closed). `leave_at`: leave as the response's head
    goes out ("head", before the first byte of its body) or after its first body bytes ("chunk")."""

    body: bytes
    headers: dict[str, str]
    path: str = "/v1/chat/completions"
    leave_at: str | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    sent: list[dict[str, Any]] = field(default_factory=list)
    _asked: bool = False

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: dict[str, Any]) -> None:
        if self.gone.is_set():
            raise OSError("the client closed the connection")  # what a server's send does then
        self.sent.append(msg)
        if (self.leave_at == "head" and msg["type"] == "http.response.start") or (
                self.leave_at == "chunk" and msg.get("body")):
            self.leave()
        await asyncio.sleep(0)  # a real send yields: the client's leaving is heard here

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    @property
    def text(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


# --- the fleet: a gateway app, a worker's view of the line, a key's budget --------------------

@dataclass
class Fleet:
    app: Any
    redis: Redis
    line: Line
    budget: KeyBudget

    async def call(self, client: Client) -> Client:
        """Run `client`'s call to the end of the gateway's answer (or of the client)."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": client.path, "raw_path": client.path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("test", 80),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in
                             {"content-type": "application/json", "authorization": f"Bearer {SECRET}",
                              **client.headers}.items()]}
        with contextlib.suppress(OSError):  # the client left while the answer went: the server drops it
            await self.app(scope, client.receive, client.send)
        return client

    async def claim(self, timeout_s: float = 10.0) -> Claimed:
        """Take the call off the line as a worker does (waiting for it to join)."""
        async with asyncio.timeout(timeout_s):
            while True:
                got = await self.line.claim("replica-t", 1, lease_s=30)
                if got:
                    return got[0]
                await asyncio.sleep(0.02)

    async def counters(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.line.keys.counters)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def ticket_closed(self) -> dict[str, float]:
        """The key's budget once no reservation is held for a call (its ticket closed)."""

        async def none_held() -> bool:
            state = await self.budget.state(DIGEST)
            return not (state["open"] or state["reserved"])

        await until(none_held, "the call's reservation ended (its ticket closed)")
        return await self.budget.state(DIGEST)

    async def in_line(self) -> bool:
        return bool(await self.redis.zcard(self.line.keys.line))


async def until(pred: Callable[[], Awaitable[bool]], what: str, within_s: float = 10.0) -> None:
    """Wait on a condition (never a fixed sleep); fail naming it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not await pred():
        if loop.time() > end:
            raise AssertionError(f"not within {within_s} s: {what}")
        await asyncio.sleep(0.02)


def _config(tmp: Path, namespace: str) -> Path:
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["namespace"] = namespace
    cfg["tiers"][TIER].update(usd_per_million_tokens=1000.0,
                              wait_limit_s={"committed": 30.0, "interactive": 30.0, "speculative": 30.0,
                                            "background": 30.0})
    cfg["keys"] = [{"name": "ends", "sha256": DIGEST, "budget_usd": 100.0},
                   {"name": "broke", "sha256": hashlib.sha256(BROKE.encode()).hexdigest(), "budget_usd": 0.0}]
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@asynccontextmanager
async def fleet_on(url: str, tmp: Path) -> AsyncIterator[Fleet]:
    ns = f"calls{uuid.uuid4().hex[:8]}"
    app = create_app(load_config(_config(tmp, ns)), url)
    redis = Redis.from_url(url)
    try:
        async with app.router.lifespan_context(app):
            yield Fleet(app, redis, Line(redis, ns, TIER), KeyBudget(redis, ns))
    finally:
        await redis.aclose()


@pytest.fixture
async def fleet(redis_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with fleet_on(redis_url, tmp_path) as f:
        yield f


def requests_counted() -> dict[tuple[str, ...], float]:
    """fleet_requests_total in this process, by (tier, priority, outcome)."""
    return {tuple(s.labels.values()): s.value for m in metrics.REQUESTS.collect() for s in m.samples
            if s.name == "fleet_requests_total"}


@contextmanager
def counted_once(outcome: Outcome, tier: str = TIER) -> Iterator[None]:
    """The block's call is counted exactly once, as `outcome`."""
    before = requests_counted()
    yield
    after = requests_counted()
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert list(moved.values()) == [1.0], moved
    (labels,) = moved
    assert labels[0] == tier and labels[2] == outcome.value, moved


def chat(*, stream: bool = False, headers: dict[str, str] | None = None) -> Client:
    return Client(orjson.dumps({**CHAT, "stream": stream}), headers or {})


def last_event(client: Client) -> bytes:
    return [e for e in client.text.split(b"\n\n") if e.strip()][-1]


def on(route: Route, *, stream: bool = False) -> Client:
    return Client(orjson.dumps({**route.body, "stream": stream}), {}, route.path)


# --- one test per end ---------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
async def test_completed_whole(fleet: Fleet, route: Route) -> None:
    client = on(route)
    with counted_once(Outcome.COMPLETED):
        task = asyncio.ensure_future(fleet.call(client))
        c = await fleet.claim()
        await fleet.line.finish(c.rid, Outcome.COMPLETED, Done(c.attempt, "stop", USAGE, choice=route.choice),
                                owner=c.owner, prompt_tokens=3, completion_tokens=2)
        await task
    assert client.status == 200 and b'"hi"' in client.text, client.text
    assert (await fleet.ticket_closed())["spent"] > 0  # settled with its usage
    assert (await fleet.counters()).get("completed") == 1


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
async def test_completed_streamed(fleet: Fleet, route: Route) -> None:
    client = on(route, stream=True)
    with counted_once(Outcome.COMPLETED):
        task = asyncio.ensure_future(fleet.call(client))
        c = await fleet.claim()
        await fleet.line.emit([(c.rid, c.owner, route.chunk, True, "")])
        await fleet.line.finish(c.rid, Outcome.COMPLETED, Done(c.attempt, "stop", USAGE), owner=c.owner,
                                prompt_tokens=3, completion_tokens=2)
        await task
    assert client.status == 200 and b'"hi"' in client.text, client.text
    assert route.streamed_end in last_event(client), client.text
    assert (await fleet.ticket_closed())["spent"] > 0
    assert (await fleet.counters()).get("completed") == 1


async def test_client_gone_while_in_the_line(fleet: Fleet) -> None:
    """It left before any event: nobody took it, so nothing is charged, and it leaves the line."""
    client = chat(stream=True)
    with counted_once(Outcome.CANCELLED):
        task = asyncio.ensure_future(fleet.call(client))
        await until(fleet.in_line, "the call in the line")
        client.leave()
        await task
    assert client.sent == []  # its 499 went to nobody
    assert (await fleet.ticket_closed())["spent"] == 0  # released: no engine ever took it
    assert (await fleet.counters()).get("cancelled") == 1 and not await fleet.redis.zcard(fleet.line.keys.line)


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
async def test_client_gone_before_the_first_byte(fleet: Fleet, route: Route) -> None:
    """The first chunk came and the stream's head went out; the client left before a byte of its body."""
    client = on(route, stream=True)
    client.leave_at = "head"
    with counted_once(Outcome.CANCELLED):
        task = asyncio.ensure_future(fleet.call(client))
        c = await fleet.claim()
        await fleet.line.emit([(c.rid, c.owner, route.chunk, True, "")])
        await task
    assert client.status == 200 and client.text == b""  # not one byte of the answer went
    assert (await fleet.ticket_closed())["spent"] > 0  # an engine took it: charged what was reserved
    assert (await fleet.counters()).get("cancelled") == 1


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
async def test_client_gone_mid_stream(fleet: Fleet, route: Route) -> None:
    client = on(route, stream=True)
    client.leave_at = "chunk"
    with counted_once(Outcome.CANCELLED):
        task = asyncio.ensure_future(fleet.call(client))
        c = await fleet.claim()
        await fleet.line.emit([(c.rid, c.owner, route.chunk, True, "")])
        await task
        # The worker's answer that comes after is not the call's: it already ended in the line.
        assert await fleet.line.finish(c.rid, Outcome.COMPLETED, Done(c.attempt, "stop", USAGE),
                                       owner=c.owner) is None
    assert route.streamed_end not in client.text
    assert (await fleet.ticket_closed())["spent"] > 0
    assert (await fleet.counters()).get("cancelled") == 1 and "completed" not in await fleet.counters()


@pytest.mark.parametrize("stream", [False, True])
async def test_worker_failure(fleet: Fleet, stream: bool) -> None:
    client = chat(stream=stream)
    with counted_once(Outcome.FAILED):
        task = asyncio.ensure_future(fleet.call(client))
        c = await fleet.claim()
        if stream:
            await fleet.line.emit([(c.rid, c.owner, CHUNK, True, "")])
        await fleet.line.finish(c.rid, Outcome.FAILED, Failed(500, "engine_error", "the engine failed"),
                                owner=c.owner)
        await task
    if stream:  # the documented end: a final error event, then [DONE]
        assert client.status == 200 and b"engine_error" in client.text and client.text.endswith(b"[DONE]\n\n")
    else:
        assert client.status == 500 and orjson.loads(client.text)["error"]["type"] == "engine_error"
    assert (await fleet.ticket_closed())["spent"] == 0  # the fleet's failure is not charged
    assert (await fleet.counters()).get("failed") == 1


async def test_expired_in_the_line(fleet: Fleet) -> None:
    client = chat(headers={"x-deadline-ms": "400"})
    with counted_once(Outcome.EXPIRED):
        await fleet.call(client)
    assert client.status == 504 and orjson.loads(client.text)["error"]["type"] == "deadline_exceeded"
    assert (await fleet.ticket_closed())["spent"] == 0
    assert (await fleet.counters()).get("expired") == 1


async def test_shed_at_admission(fleet: Fleet) -> None:
    client = chat(headers={"authorization": f"Bearer {BROKE}"})
    with counted_once(Outcome.SHED):
        await fleet.call(client)
    assert client.status == 429 and orjson.loads(client.text)["error"]["code"] == "key_budget_exhausted"
    assert (await fleet.budget.state(hashlib.sha256(BROKE.encode()).hexdigest()))["open"] == 0
    assert "accepted" not in await fleet.counters()  # it never joined the line


async def test_refused_before_the_line(fleet: Fleet) -> None:
    client = chat(headers={"x-priority": "urgent"})  # no such class: its tier is known, its class is not
    with counted_once(Outcome.REFUSED):
        await fleet.call(client)
    assert client.status == 400 and orjson.loads(client.text)["error"]["param"] == "X-Priority"
    assert (await fleet.budget.state(DIGEST))["open"] == 0 and "accepted" not in await fleet.counters()


async def test_redis_lost(tmp_path: Path) -> None:
    """Its Redis froze while the call waited in the line: told the typed 503 by its deadline, counted
    unavailable; once Redis answers again the orphan sweep ends it in the line and closes its ticket."""
    server = PrivateRedis().start()
    try:
        async with fleet_on(server.url, tmp_path) as fleet:
            client = chat(headers={"x-deadline-ms": "1000"})
            with counted_once(Outcome.UNAVAILABLE):
                task = asyncio.ensure_future(fleet.call(client))
                await until(fleet.in_line, "the call in the line")
                assert server.proc is not None
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    async with asyncio.timeout(20):
                        await task
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
            assert client.status == 503 and orjson.loads(client.text)["error"]["code"] == "redis_unavailable"
            assert (await fleet.ticket_closed())["spent"] == 0

            async def ended_there() -> bool:
                return (await fleet.counters()).get("unavailable") == 1

            await until(ended_there, "the orphan ended in the line", 20)
            assert "completed" not in await fleet.counters()
    finally:
        server.stop()
