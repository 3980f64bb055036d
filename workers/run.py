"""A replica's process: open the Redis clients, build the engine of the version it runs,
wire the signals (drain, park, resume) and run the worker until it drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import Any

from fleet import gc_tuning
from fleet.config import FleetConfig
from fleet.store.connection import Clients
from fleet.store.model_registry import config_at_version
from workers.engines.base import EngineError
from workers.worker import Worker

log = logging.getLogger("fleet.worker")


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run a replica's main coroutine on uvloop where it is installed (it comes with uvicorn[standard], as
    the gateway runs), else on asyncio's own loop. A replica's event loop is on every request's path (wake
    on the bell, claim, call the engine, finish): uvloop's costs a fraction of the pure-Python selector's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it on Linux and macOS
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def run_worker(cfg: FleetConfig, tier: str, engine_name: str | None, redis_url: str, *,
                     replica_id: str | None = None, time_scale: float = 1.0, metrics_port: int | None = None,
                     metrics_host: str = "127.0.0.1", version: str | None = None) -> int:
    """Run one replica until it drains; the exit code says whether it gave up.

    It runs `version` of the tier's model (default: the registry's live one), as the
    registry describes it; `engine_name`, when given, overrides that version's engine."""
    from workers.engines.registry import build_engine

    if metrics_port is not None:  # Prometheus scrapes each replica here (a thread; the loop never serves it)
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_host)

    clients = Clients.open(redis_url, name=f"worker:{tier}")
    try:
        cfg, version = await config_at_version(clients.calls, cfg, tier, version)
    except LookupError as e:
        log.error("replica of %s: %s", tier, e)
        await clients.aclose()
        return 2
    gc_tuning.tune()
    engine_name = engine_name or cfg.tiers[tier].engine
    engine = build_engine(engine_name, cfg.tiers[tier], time_scale=time_scale)
    worker = Worker(cfg, tier, engine, clients.calls, replica_id=replica_id, engine_name=engine_name,
                    blocking=clients.blocking, pubsub=clients.pubsub_client, version=version,
                    started=gc_tuning.freeze)
    loop = asyncio.get_running_loop()
    for sig, act in ((signal.SIGTERM, worker.drain), (signal.SIGINT, worker.drain),
                     (signal.SIGUSR1, worker.park), (signal.SIGUSR2, worker.resume)):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, act)
    try:
        await worker.run()
    except EngineError as e:  # the engine could not start: say why, no traceback
        log.error("replica %s: the %s engine failed to start: %s", worker.replica_id, engine_name, e)
        return 1
    finally:
        await clients.aclose()
    return 1 if worker.failed else 0
