"""`fleet models list|show TIER|history TIER`, `fleet promote TIER VERSION`, `fleet rollback TIER`.

They read and change the model registry in Redis directly (as `fleet keys`
does), so they work with no gateway running; the acting scaler carries a
change out at its next tick. The same is served over HTTP under
/v1/fleet/models (`gateway.models_api`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import getpass
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import click
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet.config import ConfigError, FleetConfig, load_config
from fleet.store.keys import TierKeys
from fleet.store.model_registry import ModelRecord, RegistryError, promote, read_history, read_or_seed, rollback

T = TypeVar("T")


def _fail(msg: str, code: int = 2) -> NoReturn:
    click.echo(f"fleet: {msg}", err=True)
    sys.exit(code)


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _run(config_path: str | None, tier: str | None, act: Callable[[FleetConfig, Redis, str | None], Awaitable[T]]
         ) -> T:
    """Load the config, resolve the tier, open Redis, run `act`; every failure is one line on stderr."""
    from fleet.redis_server import NoRedis, resolve_redis
    from fleet.store.connection import connect

    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        _fail(str(e))
    t = None
    if tier is not None and (t := cfg.resolve_model(tier)) is None:
        _fail(f"unknown tier {tier!r}; tiers are {', '.join(cfg.tiers)}")
    url = os.environ.get("REDIS_URL")
    if not url:
        try:
            url, private = resolve_redis()
        except NoRedis as e:
            _fail(str(e))
        if private is not None:
            private.stop()
            _fail("no Redis found; set REDIS_URL")

    async def go() -> T:
        r = connect(url, "calls", name="fleetctl")
        try:
            return await act(cfg, r, t)
        finally:
            await r.aclose()

    try:
        return asyncio.run(go())
    except RegistryError as e:
        _fail(str(e), 1)
    except (RedisError, OSError) as e:
        _fail(f"cannot reach Redis: {e}", 1)


async def _record(cfg: FleetConfig, r: Redis, tier: str) -> ModelRecord:
    return await read_or_seed(r, TierKeys(cfg.namespace, tier), cfg.tiers[tier])


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _rollout_line(rec: ModelRecord) -> str:
    ro = rec.rollout
    if ro is None:
        return "none"
    state = "done " + _when(ro.done_at) if ro.done_at else "rolling"
    canary = f", canary {ro.canary}" if ro.canary and not ro.judged else ""
    return f"{ro.kind} {ro.from_version} -> {ro.to_version} by {ro.by} at {_when(ro.started)} ({state}{canary})"


@click.group()
def models() -> None:
    """The model registry: what version each tier runs, the versions known, the history."""


CONFIG = click.option("--config", "config_path", default=None, envvar="FLEET_CONFIG",
                      help="Fleet config YAML (default configs/fleet.yaml).")
JSON = click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")


@models.command("list")
@CONFIG
@JSON
def models_list(config_path: str | None, as_json: bool) -> None:
    """Each tier's live version, the previous known-good one, and a rollout under way."""
    async def act(cfg: FleetConfig, r: Redis, _: str | None) -> list[ModelRecord]:
        return [await _record(cfg, r, t) for t in cfg.tiers]

    recs = _run(config_path, None, act)
    if as_json:
        click.echo(orjson.dumps([x.public() for x in recs], option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(f"{'TIER':<16}{'LIVE':<14}{'PREVIOUS':<14}{'VERSIONS':<24}ROLLOUT")
    for x in recs:
        click.echo(f"{x.tier:<16}{x.live:<14}{x.previous or '-':<14}{','.join(sorted(x.versions)):<24}"
                   f"{_rollout_line(x)}")


@models.command("show")
@click.argument("tier")
@CONFIG
@JSON
def models_show(tier: str, config_path: str | None, as_json: bool) -> None:
    """One tier's record: every version known, with its engine, weights, arguments."""
    rec = _run(config_path, tier, lambda cfg, r, t: _record(cfg, r, t or ""))
    if as_json:
        click.echo(orjson.dumps(rec.public(), option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(f"tier {rec.tier}: live {rec.live}, previous {rec.previous or '-'}, generation {rec.generation}")
    click.echo(f"rollout: {_rollout_line(rec)}")
    for name, v in sorted(rec.versions.items()):
        mark = "*" if name == rec.live else " "
        args = f" args={orjson.dumps(v.engine_args).decode()}" if v.engine_args else ""
        click.echo(f" {mark} {name:<12} engine={v.engine} weights={v.weights or '-'}{args} "
                   f"(added {_when(v.added_at)} by {v.added_by})")


@models.command("history")
@click.argument("tier")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1000))
@CONFIG
@JSON
def models_history(tier: str, limit: int, config_path: str | None, as_json: bool) -> None:
    """Every change to a tier's record, oldest first: who, when, why."""
    async def act(cfg: FleetConfig, r: Redis, t: str | None) -> list[Any]:
        await _record(cfg, r, t or "")
        return await read_history(r, TierKeys(cfg.namespace, t or ""), limit)

    entries = _run(config_path, tier, act)
    if as_json:
        from dataclasses import asdict

        click.echo(orjson.dumps([asdict(e) for e in entries], option=orjson.OPT_INDENT_2).decode())
        return
    for e in entries:
        move = f"{e.previous} -> {e.version}" if e.previous and e.previous != e.version else e.version
        click.echo(f"{_when(e.at)}  {e.action:<14}{move:<18}by {e.by}: {e.why}")


@click.command("promote")
@click.argument("tier")
@click.argument("version")
@click.option("--canary", type=click.IntRange(1), default=None,
              help="Keep N replicas on the new version until it is judged, then roll out the rest.")
@click.option("--why", default="", help="Why, for the history.")
@CONFIG
def promote_cmd(tier: str, version: str, canary: int | None, why: str, config_path: str | None) -> None:
    """Make VERSION live on TIER: the scaler replaces its replicas one at a time."""
    rec = _run(config_path, tier, lambda cfg, r, t: _promote(cfg, r, t or "", version, canary, why))
    click.echo(f"{rec.tier}: {version} is live (was {rec.previous}); rollout {rec.generation} under way"
               + (f", canary {canary}" if canary else ""))


async def _promote(cfg: FleetConfig, r: Redis, tier: str, version: str, canary: int | None, why: str) -> ModelRecord:
    await _record(cfg, r, tier)
    return await promote(r, TierKeys(cfg.namespace, tier), version, by=_who(), why=why, canary=canary)


@click.command("rollback")
@click.argument("tier")
@click.option("--to", "to", default=None, help="The version to go back to (default: the previous known-good).")
@click.option("--why", default="", help="Why, for the history.")
@CONFIG
def rollback_cmd(tier: str, to: str | None, why: str, config_path: str | None) -> None:
    """Make the previous known-good version (or --to VERSION) live again on TIER."""
    async def act(cfg: FleetConfig, r: Redis, t: str | None) -> ModelRecord | None:
        await _record(cfg, r, t or "")
        return await rollback(r, TierKeys(cfg.namespace, t or ""), by=_who(), why=why, to=to)

    rec = _run(config_path, tier, act)
    assert rec is not None and rec.rollout is not None
    click.echo(f"{rec.tier}: {rec.live} is live again (was {rec.rollout.from_version})")
