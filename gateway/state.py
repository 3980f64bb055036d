"""What the gateway's handlers share, one per process: `Gateway`."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from fleet.config import FleetConfig
from fleet.governor import govern
from fleet.store.chains import Chains
from fleet.store.leader import leader_of
from fleet.store.line import Line
from fleet.store.responses import ResponseStore
from fleet.store.retries import Retries
from gateway.admission import Admission
from gateway.auth import KeyRing
from gateway.redis_loss import Orphans
from gateway.result_reader import ResultReader

log = logging.getLogger("fleet.gateway")


class Gateway:
    """State shared by the handlers: config, Redis, one Line per tier, admission, the one result
    reader, the orphans, and the reaper every gateway runs."""

    def __init__(self, cfg: FleetConfig, redis: Redis, keyring: KeyRing | None = None, *,
                 blocking: Redis | None = None) -> None:
        self.cfg = cfg
        self.redis = redis
        self.lines = {t: Line(redis, cfg.namespace, t, result_ttl_s=cfg.result_ttl_s,
                              rate_window_s=cfg.rate_window_s, blocking=blocking) for t in cfg.tiers}
        self.admission = Admission(cfg, redis, self.lines)
        self.results = ResultReader()  # one reader of every open call's result stream
        self.keyring = keyring or KeyRing(cfg.keys)
        self.orphans = Orphans()  # answered 503 while Redis was away; ended in the line when it returns
        self.chains = Chains(redis, cfg.namespace)  # how each X-Chain-Id chain ended (status, metrics)
        self.retries = Retries(redis)  # calls whose client left, kept for their SDK's retry (gateway.retry_join)
        self.responses = ResponseStore(redis, cfg.namespace, cfg.responses.ttl_s)  # the Responses API's state
        self.started = time.time()

    async def govern_unless_a_scaler_does(self) -> None:
        """The budget governor runs once per fleet, under the scaler's leader lease. With no
        scaler holding it (`fleet gateway` + `fleet worker` only), the gateway ticks it, so
        budgets still hold and admission, status and metrics still have a judgement to read."""
        if await leader_of(self.redis, self.cfg.namespace) is None:
            await govern(self.redis, self.cfg)

    async def reap_forever(self) -> None:
        # Workers reap too; the gateway does it as well so that requests of a
        # tier whose workers all died still come back to the line.
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            if self.orphans.pending:
                await self.orphans.sweep()
            for line in self.lines.values():
                try:
                    await line.reap()
                except Exception:
                    log.exception("reaper tick failed for %s", line.tier)
            try:
                await self.govern_unless_a_scaler_does()
                await self.keyring.refresh(self.redis, self.cfg.namespace)
                await self.chains.sweep(self.cfg.fair_line.chain_idle_s)
            except Exception:  # a Redis blip must not end the loop; the next tick retries
                log.exception("governor or key refresh tick failed")
