"""The gateway's HTTP server: uvicorn (httptools, uvloop) with the edge bounded.

uvicorn's httptools protocol buffers a request head of any size and waits
forever for a head or a body that never completes. The protocol here adds,
from the config's `gateway:` section:

- `max_header_bytes`: a request head (request line and headers) larger than
  this is refused with a typed 431 while it arrives, before it is buffered
  whole (uvicorn's `h11_max_incomplete_event_size` bounds only the slower h11
  protocol, and answers a plain-text 400);
- `header_timeout_s` / `body_timeout_s`: a head, then a body, that does not
  arrive in time gets a typed 408 and the connection is closed (an idle
  connection that sent nothing is just closed);
- `max_connections_per_client`: connections past this many from one client
  address get a typed 429 (`too_many_connections`) and are closed. Behind a
  reverse proxy every caller shares its address: set 0 there and limit at
  the proxy (nginx `limit_conn`).

Every refusal is a whole typed response (`gateway.errors.raw_response`) with
`connection: close`, written before a graceful close: the server stops
writing, reads and drops what the client still sends for a moment, then
closes, so the client reads the answer instead of a connection reset.

`--metrics-port` adds a second listening socket to the same server that
serves only /metrics, without a key: it is meant for a private network and
Prometheus (the API port's /metrics follows `gateway.status_auth`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fleet import gc_tuning
from fleet.config import FleetConfig, GatewayEdge
from gateway.auth import METRICS_PORT_SCOPE, Exposure, beyond_loopback
from gateway.errors import APIError, raw_response, retry_headers

log = logging.getLogger("fleet.gateway.server")

LINGER_S = 2.0  # after a refusal, how long to drop what the client still sends before closing


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections_per_client: int

    @classmethod
    def of(cls, edge: GatewayEdge) -> EdgeLimits:
        return cls(edge.max_header_bytes, edge.header_timeout_s, edge.body_timeout_s,
                   edge.max_connections_per_client)


class Refusal(Exception):
    """Raised inside a parser callback to answer the request with a typed error and close."""

    def __init__(self, status: int, code: str, message: str, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.type = status, code, message, type_
        self.headers, self.extra = headers or {}, extra

    def bytes(self) -> bytes:
        return raw_response(self.status, self.code, self.message, self.type, self.headers, **self.extra)


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above. One per connection; `limits` and
    `clients` (open connections by address) are set per server by `protocol_for`."""

    limits: ClassVar[EdgeLimits]
    clients: ClassVar[Counter[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = "idle"  # idle (between requests) -> head -> body -> idle
        self._head_bytes = 0
        self._refused = False
        self._addr: str | None = None
        self._over_limit = False

    # --- connection ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client:
            self._addr = self.client[0]
            self.clients[self._addr] += 1
            limit = self.limits.max_connections_per_client
            self._over_limit = limit > 0 and self.clients[self._addr] > limit
        self._arm(self.limits.header_timeout_s)  # a connection that never sends a request is bounded too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._addr is not None:
            self.clients[self._addr] -= 1
            if self.clients[self._addr] <= 0:
                del self.clients[self._addr]
            self._addr = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, plus: drop data after a refusal, time the head, count its bytes, typed errors."""
        if self._refused:
            return
        self._unset_keepalive_if_required()
        if self._timer is None:
            self._arm(self.limits.header_timeout_s)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, Refusal):
                self._refuse(e.__context__)
                return
            log.exception("HTTP parser callback failed")
            self._refuse(Refusal(400, "invalid_http", "the request could not be parsed as HTTP/1.1"))
            return
        except httptools.HttpParserError as e:
            self._refuse(Refusal(400, "invalid_http", f"not a valid HTTP/1.1 request: {e}"))
            return
        if self._phase == "head":
            # Still in the head after this chunk: all of it was head (a body starts only after).
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(Refusal(431, "request_header_fields_too_large",
                                     f"request headers exceed the limit of {self.limits.max_header_bytes} bytes"))

    # --- parser callbacks ---

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "head"
        self._head_bytes = 0
        if self._timer is None:
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.limits.max_header_bytes:  # the whole head came in one chunk
            raise Refusal(431, "request_header_fields_too_large",
                          f"request headers of {size} bytes exceed the limit of {self.limits.max_header_bytes}")
        if self._over_limit:
            limit = self.limits.max_connections_per_client
            raise Refusal(429, "too_many_connections",
                          f"this client address already has {limit} connections open (the limit); "
                          "reuse them, or close some", "at_capacity", retry_headers(1), retry_after_s=1)
        self._phase = "body"
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = "idle"
        self._disarm()

    # --- timers and refusals ---

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._refused or self.transport.is_closing():
            return
        if self._phase == "idle":
            self.transport.close()  # nothing of a request arrived: close, as keep-alive would
            return
        what, limit = (("head", self.limits.header_timeout_s) if self._phase == "head"
                       else ("body", self.limits.body_timeout_s))
        if self.pipeline or (self._phase == "head" and self.cycle is not None and not self.cycle.response_complete):
            # A pipelined request behind a response still being written (uvicorn stops reading
            # meanwhile): its time starts when that response ends, and that one must not be cut.
            self._arm(limit)
            return
        self._refuse(Refusal(408, "request_timeout",
                             f"the request {what} did not arrive within {limit:g} s; the connection is closed"))

    def _refuse(self, refusal: Refusal) -> None:
        """Answer with `refusal` (unless a response is already under way), then close gracefully."""
        self._refused = True
        self._disarm()
        cycle = self.cycle  # in the head phase, the previous request's; in the body phase, this one's
        if cycle is not None and (cycle.response_started if self._phase == "body" else not cycle.response_complete):
            # A response is under way or done for this request (the app answered before reading
            # its body), or a previous one is still being written: no second answer fits.
            self.transport.close()
            return
        if self._phase == "body" and cycle is not None:
            # The app is still reading the body: from now on it hears "client gone" and its sends are dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(refusal.bytes())
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)


def protocol_for(limits: EdgeLimits) -> type[EdgeProtocol]:
    """An EdgeProtocol class for one server: its limits, and its own count of connections by address."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits, "clients": Counter()})


class MetricsPortGate:
    """On the metrics port, serve GET /metrics only (marked so the status guard lets it through)."""

    def __init__(self, app: Any, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope.get("server") or ("", None))[1] == self.port:
            if scope["path"] != "/metrics":
                err = APIError(404, "only GET /metrics is served on the metrics port", code="not_found")
                await err.response()(scope, receive, send)
                return
            scope = {**scope, METRICS_PORT_SCOPE: True}
        await self.app(scope, receive, send)


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound listening TCP socket (IPv6 if the host is an IPv6 address). `reuse_port`:
    SO_REUSEPORT, so several processes' sockets share the port (`gateway.processes`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=reuse_port)
    sock.set_inheritable(True)
    return sock


def expose(app: Any, cfg: FleetConfig, host: str) -> None:
    """Tell the app where it listens (`gateway.auth.Exposure`): beyond loopback, no keys means
    closed, not open. Said at start-up, since keys stored in Redis are only known later."""
    where = Exposure(beyond_loopback=beyond_loopback(host), open=cfg.gateway.open)
    app.state.exposure = where
    if not where.beyond_loopback or cfg.keys:
        return
    if where.open:
        log.warning("gateway.open: true and no API keys in the config: anyone who reaches %s may call "
                    "completions; admin endpoints and fleet state still need a key", host)
    else:
        log.warning("listening on %s, beyond loopback, with no API keys in the config: until a key exists "
                    "(`fleet keys add`), calls, admin endpoints and fleet state are refused with 401 "
                    "(gateway.open: true serves calls without keys)", host)


def serve(app: Any, cfg: FleetConfig, *, host: str, port: int, metrics_port: int | None = None,
          metrics_host: str = "127.0.0.1", sockets: list[socket.socket] | None = None) -> None:
    """Run `app` on host:port (and /metrics alone on metrics_host:metrics_port) until SIGINT/SIGTERM.
    `sockets`: already bound (the API's first, then the metrics port's), as `gateway.processes` passes."""
    if sockets is None:
        sockets = [listen(host, port)]
        if metrics_port:
            sockets.append(listen(metrics_host, metrics_port))
    expose(app, cfg, host)
    gc_tuning.tune()
    app.state.freeze_gc = True  # the lifespan freezes what start-up built (fleet.gc_tuning)
    if metrics_port:
        app = MetricsPortGate(app, metrics_port)
    config = uvicorn.Config(app, loop="uvloop", http=protocol_for(EdgeLimits.of(cfg.gateway)), ws="none",
                            log_level="warning", access_log=False, timeout_graceful_shutdown=30)
    uvicorn.Server(config).run(sockets=sockets)
