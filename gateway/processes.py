"""Several gateway processes on one port (`fleet gateway --workers N`).

One process runs one event loop on one core; past that, more processes. Each
gets its own listening socket on the same host:port with SO_REUSEPORT, and the
kernel spreads new connections across them (by a hash of the connection's
addresses). They share nothing but Redis: keys' rate limits, budgets and the
lines' admission are Lua scripts there, so they stay exact across processes,
as they do across gateways on several boxes.

Each process is a whole gateway (`gateway.server.serve`, with its bounded
edge), forked from this one before any event loop or Redis client exists, and
bound here first, so a taken port is one clear error before anything starts.
The parent only waits: SIGTERM/SIGINT reach every child, which drains its
connections; a child that dies on its own stops the others and the parent
exits non-zero, for whatever supervises it (systemd, compose) to restart the
whole. With `--metrics-port P`, process i serves /metrics on P + i (each
process counts only what it served; Prometheus sums them).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import wait
from types import FrameType
from typing import Any

from fleet.config import FleetConfig
from gateway.server import listen, serve

log = logging.getLogger("fleet.gateway.processes")

STOP_GRACE_S = 40.0  # the server's graceful shutdown (30 s) and a margin


def _child(build_app: Callable[[], Any], cfg: FleetConfig, host: str, port: int, sockets: list[socket.socket],
           others: list[socket.socket], metrics_port: int | None, metrics_host: str) -> None:
    for s in others:  # a sibling's socket held open here would keep taking its share of connections
        s.close()
    serve(build_app(), cfg, host=host, port=port, metrics_port=metrics_port, metrics_host=metrics_host,
          sockets=sockets)


def _listen_all(host: str, port: int, processes: int, metrics_port: int | None,
                metrics_host: str) -> list[list[socket.socket]]:
    """Each process's sockets, bound here before the fork: the shared port (SO_REUSEPORT) and
    its own metrics port. One that cannot be bound closes those already bound."""
    groups: list[list[socket.socket]] = []
    try:
        for i in range(processes):
            socks = [listen(host, port, reuse_port=True)]
            if metrics_port:
                socks.append(listen(metrics_host, metrics_port + i))
            groups.append(socks)
    except OSError:
        for s in (s for g in groups for s in g):
            s.close()
        raise
    return groups


def serve_processes(build_app: Callable[[], Any], cfg: FleetConfig, *, host: str, port: int, processes: int,
                    metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> int:
    """Run `processes` gateways on host:port until SIGTERM/SIGINT; the exit status.
    `build_app` runs in each child (each makes its own Redis clients)."""
    groups = _listen_all(host, port, processes, metrics_port, metrics_host)
    ctx = multiprocessing.get_context("fork")
    procs = []
    for i, socks in enumerate(groups):
        others = [s for j, g in enumerate(groups) if j != i for s in g]
        p = ctx.Process(target=_child, name=f"fleet-gateway-{i}",
                        args=(build_app, cfg, host, port, socks, others,
                              metrics_port + i if metrics_port else None, metrics_host))
        p.start()
        procs.append(p)
    for s in (s for g in groups for s in g):
        s.close()
    stopping = False

    def stop(signum: int, _: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive():
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    wait([p.sentinel for p in procs])
    failed = not stopping
    if failed:
        dead = next(p for p in procs if not p.is_alive())
        log.error("gateway process %s exited (code %s); stopping the others", dead.name, dead.exitcode)
        stop(signal.SIGTERM, None)
    for p in procs:
        p.join(STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    return 1 if failed else 0
