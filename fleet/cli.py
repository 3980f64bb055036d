"""`fleet`: one console script that starts each part, or all of them."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import click

from fleet.config import ConfigError, FleetConfig, load_config

HOST = click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
CONFIG = click.option("--config", "config_path", default=None, envvar="FLEET_CONFIG",
                      help="Fleet config YAML (default configs/fleet.yaml).")


def _config(path: str | None) -> FleetConfig:
    try:
        return load_config(path)
    except ConfigError as e:
        click.echo(f"fleet: {e}", err=True)
        sys.exit(2)


def _redis_url() -> str:
    from fleet.redis_server import NoRedis, resolve_redis

    try:
        url, private = resolve_redis()
    except NoRedis as e:
        click.echo(f"fleet: {e}", err=True)
        sys.exit(2)
    if private is not None:  # a single part started alone should not own a throwaway Redis
        private.stop()
        click.echo("fleet: no Redis found; set REDIS_URL (or use `fleet up`, which starts one)", err=True)
        sys.exit(2)
    return url


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group()
@click.version_option(package_name="fleet-gateway")
def main() -> None:
    """Fleet Gateway: an OpenAI-compatible gateway and capacity governor for agent fleets."""


@main.command()
@HOST
@click.option("--port", default=8000, show_default=True, type=int)
@CONFIG
@click.option("--verbose", is_flag=True)
def gateway(host: str, port: int, config_path: str | None, verbose: bool) -> None:
    """Run the gateway alone (REDIS_URL names the Redis)."""
    import uvicorn

    from gateway.app import create_app

    _logging(verbose)
    cfg = _config(config_path)
    app = create_app(cfg, _redis_url())
    uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False, timeout_graceful_shutdown=30)


@main.command()
@click.option("--tier", required=True, help="The tier whose line this worker serves.")
@click.option("--engine", "engine_name", default=None, type=click.Choice(["sim", "vllm", "openai"]),
              help="Engine (default: the tier's configured engine).")
@click.option("--replica-id", default=None)
@click.option("--time-scale", default=1.0, type=float, help="Scale the sim engine's clock (tests).")
@CONFIG
@click.option("--verbose", is_flag=True)
def worker(tier: str, engine_name: str | None, replica_id: str | None, time_scale: float,
           config_path: str | None, verbose: bool) -> None:
    """Run one worker replica for a tier."""
    from workers.worker import run_worker

    _logging(verbose)
    cfg = _config(config_path)
    if tier not in cfg.tiers:
        click.echo(f"fleet: unknown tier {tier!r}; tiers are {', '.join(cfg.tiers)}", err=True)
        sys.exit(2)
    asyncio.run(run_worker(cfg, tier, engine_name or cfg.tiers[tier].engine, _redis_url(),
                           replica_id=replica_id, time_scale=time_scale))


@main.command()
@HOST
@click.option("--port", default=8000, show_default=True, type=int)
@CONFIG
@click.option("--engine", "engine_name", default=None, type=click.Choice(["sim", "vllm", "openai"]),
              help="Engine for every tier (default: each tier's configured engine).")
def up(host: str, port: int, config_path: str | None, engine_name: str | None) -> None:
    """Everything on one machine: gateway and workers at each tier's warm floor."""
    from fleet.up import run_up

    cfg = _config(config_path)
    sys.exit(run_up(cfg, host=host, port=port, engine=engine_name, config_path=config_path))


@main.command()
@click.option("--url", default=lambda: os.environ.get("FLEET_URL", "http://127.0.0.1:8000"),
              show_default="http://127.0.0.1:8000", help="The gateway.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status document.")
def status(url: str, as_json: bool) -> None:
    """The fleet's status table: line, drain time, replicas, per tier."""
    import httpx

    from fleet.status_table import render

    try:
        doc: dict[str, Any] = httpx.get(f"{url.rstrip('/')}/v1/fleet/status", timeout=5).json()
    except httpx.HTTPError as e:
        click.echo(f"fleet: cannot reach the gateway at {url}: {e}", err=True)
        sys.exit(1)
    if as_json:
        import orjson

        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        render(doc)


@main.command("hash-key")
@click.argument("secret")
def hash_key(secret: str) -> None:
    """Print the sha256 of an API key, for the config's `keys` list."""
    import hashlib

    click.echo(hashlib.sha256(secret.encode()).hexdigest())


if __name__ == "__main__":
    main()
