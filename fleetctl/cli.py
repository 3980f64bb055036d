"""`fleet`: one console script that starts each part, or all of them."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import click

from fleet.config import ConfigError, EngineName, FleetConfig, load_config

HOST = click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
CONFIG = click.option("--config", "config_path", default=None, envvar="FLEET_CONFIG",
                      help="Fleet config YAML (default configs/fleet.yaml).")
ENGINES = click.Choice([e.value for e in EngineName])  # the engines there are, as the config names them


def _config(path: str | None) -> FleetConfig:
    try:
        return load_config(path)
    except ConfigError as e:
        click.echo(f"fleet: {e}", err=True)
        sys.exit(2)


# A part whose REDIS_URL does not answer at start waits this long for it (a Redis restarting
# while `fleet up` starts the parts), then exits naming the URL.
PART_REDIS_WAIT_S = 30.0


def _redis_url() -> str:
    from fleet.redis_server import NoRedis, resolve_redis

    try:
        url, private = resolve_redis(wait_s=PART_REDIS_WAIT_S)
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
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535),
              help="Also serve /metrics alone, without a key, on this port (for Prometheus on a private network).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address for --metrics-port.")
@click.option("--workers", "processes", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Gateway processes sharing --port (SO_REUSEPORT); process i serves --metrics-port + i.")
@click.option("--admin-key-on-first-start", "first_admin_key", is_flag=True,
              help="With no admin key in the config or in Redis, make one (FLEET_ADMIN_KEY, else a new secret "
                   "printed once) before serving.")
@click.option("--verbose", is_flag=True)
def gateway(host: str, port: int, config_path: str | None, metrics_port: int | None, metrics_host: str,
            processes: int, first_admin_key: bool, verbose: bool) -> None:
    """Run the gateway alone (REDIS_URL names the Redis)."""
    from gateway.app import create_app
    from gateway.server import serve

    _logging(verbose)
    cfg = _config(config_path)
    if metrics_port is not None and port in range(metrics_port, metrics_port + processes):
        raise click.BadParameter("must differ from --port", param_hint="--metrics-port")
    url = _redis_url()
    if first_admin_key:
        from fleetctl.admin_key import ensure_admin_key

        ensure_admin_key(cfg, url)
    try:
        if processes > 1:
            from gateway.processes import serve_processes

            sys.exit(serve_processes(lambda: create_app(cfg, url), cfg, host=host, port=port, processes=processes,
                                     metrics_port=metrics_port, metrics_host=metrics_host))
        serve(create_app(cfg, url), cfg, host=host, port=port, metrics_port=metrics_port, metrics_host=metrics_host)
    except OSError as e:  # the address is taken, or not ours
        click.echo(f"fleet: cannot listen: {e}", err=True)
        sys.exit(2)


@main.command()
@click.option("--tier", required=True, help="The tier whose line this worker serves.")
@click.option("--engine", "engine_name", default=None, type=ENGINES,
              help="Engine (default: the tier's configured engine).")
@click.option("--replica-id", default=None)
@click.option("--model-version", default=None, help="Model version to run (default: the registry's live one).")
@click.option("--time-scale", default=1.0, type=float, help="Scale the sim engine's clock (tests).")
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535),
              help="Serve this replica's Prometheus metrics (TTFT, TPOT, slots) on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address for --metrics-port.")
@CONFIG
@click.option("--verbose", is_flag=True)
def worker(tier: str, engine_name: str | None, replica_id: str | None, model_version: str | None, time_scale: float,
           metrics_port: int | None, metrics_host: str, config_path: str | None, verbose: bool) -> None:
    """Run one worker replica for a tier."""
    from workers.run import run_loop, run_worker

    _logging(verbose)
    cfg = _config(config_path)
    if tier not in cfg.tiers:
        click.echo(f"fleet: unknown tier {tier!r}; tiers are {', '.join(cfg.tiers)}", err=True)
        sys.exit(2)
    sys.exit(run_loop(run_worker(cfg, tier, engine_name, _redis_url(), replica_id=replica_id,
                                    time_scale=time_scale, metrics_port=metrics_port, metrics_host=metrics_host,
                                    version=model_version)))


@main.command()
@HOST
@click.option("--port", default=8000, show_default=True, type=int)
@CONFIG
@click.option("--engine", "engine_name", default=None, type=ENGINES,
              help="Engine for every tier (default: each tier's configured engine).")
def up(host: str, port: int, config_path: str | None, engine_name: str | None) -> None:
    """Everything on one machine: gateway and workers at each tier's warm floor."""
    from fleetctl.up import run_up

    cfg = _config(config_path)
    sys.exit(run_up(cfg, host=host, port=port, engine=engine_name, config_path=config_path))


@main.command()
@click.option("--url", default=lambda: os.environ.get("FLEET_URL", "http://127.0.0.1:8000"),
              show_default="http://127.0.0.1:8000", help="The gateway.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status document.")
@click.option("--wide", is_flag=True, help="Every column (the table then runs past 80 columns).")
@click.option("--api-key", default=lambda: os.environ.get("FLEET_API_KEY", ""), show_default="$FLEET_API_KEY",
              help="A key with read_status (or admin), where the gateway has keys.")
def status(url: str, as_json: bool, wide: bool, api_key: str) -> None:
    """The fleet's status table: line, drain time, replicas, per tier (80 columns; --wide for all)."""
    import httpx

    from fleetctl.status_table import render

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/fleet/status", headers=headers, timeout=5)
        doc: dict[str, Any] = r.json()
    except (httpx.HTTPError, ValueError) as e:
        click.echo(f"fleet: cannot reach the gateway at {url}: {e}", err=True)
        sys.exit(1)
    if r.status_code != 200:
        click.echo(f"fleet: {(doc.get('error') or {}).get('message') or r.text}", err=True)
        sys.exit(1)
    if as_json:
        import orjson

        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        render(doc, wide=wide)


@main.command()
@CONFIG
@click.option("--tick", "tick_s", default=1.0, show_default=True, type=click.FloatRange(0.05, 1.0),
              help="Seconds between decisions (at most 1).")
@click.option("--lease", "lease_s", default=3.0, show_default=True, type=click.FloatRange(0.5, 60),
              help="Leader lease; a standby takes over this long after the leader stops renewing.")
@click.option("--backend", default="local", show_default=True, type=click.Choice(["local", "docker", "ray"]),
              help="Where replicas run: local processes, Docker containers (GPU box), or Ray actors (a cluster).")
@click.option("--ray-address", default=None, help="The Ray cluster's address (--backend ray; default: auto).")
@click.option("--image", default="fleet-gateway:latest", show_default=True, help="Worker image (--backend docker).")
@click.option("--network", default=None, help="Docker network for the worker containers.")
@click.option("--volume", "volumes", multiple=True, metavar="HOST:CONTAINER[:ro]",
              help="Bind into every worker container (--backend docker): weights, the config. Repeatable.")
@click.option("--engine", "engine_name", default=None, type=ENGINES,
              help="Engine for every replica (default: each tier's configured engine).")
@click.option("--drain-grace", "drain_grace_s", default=300.0, show_default=True, type=float,
              help="Seconds a draining replica may take to finish its requests before it is killed.")
@click.option("--stop-replicas-on-exit", is_flag=True,
              help="Drain this scaler's replicas when it stops (fleet up); by default they keep serving "
                   "for the next leader to adopt.")
@click.option("--metrics-port", default=9101, show_default=True, type=click.IntRange(0, 65535),
              help="Serve the scaler's Prometheus metrics here (0: off).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option("--worker-metrics-port", default=None, type=click.IntRange(1, 65535),
              help="Worker containers serve their metrics here (--backend docker; on --network host, a free "
                   "port each), named in their label fleet.replica.metrics_port for Prometheus.")
@click.option("--verbose", is_flag=True)
def scaler(config_path: str | None, tick_s: float, lease_s: float, backend: str, ray_address: str | None,
           image: str, network: str | None,
           volumes: tuple[str, ...], engine_name: str | None, drain_grace_s: float, stop_replicas_on_exit: bool,
           metrics_port: int, metrics_host: str, worker_metrics_port: int | None, verbose: bool) -> None:
    """Run the scaler and its supervisor: size each tier on its line (one acts; others stand by)."""
    from scaler.loop import run_scaler

    _logging(verbose)
    cfg = _config(config_path)
    asyncio.run(run_scaler(cfg, _redis_url(), backend=backend, engine=engine_name, image=image, network=network,
                           tick_s=tick_s, lease_s=lease_s, drain_grace_s=drain_grace_s,
                           stop_replicas_on_exit=stop_replicas_on_exit, metrics_port=metrics_port or None,
                           metrics_host=metrics_host, config_path=config_path, volumes=list(volumes),
                           worker_metrics_port=worker_metrics_port, ray_address=ray_address))


@main.command()
@click.argument("tier")
@click.option("--floor", required=True, type=click.IntRange(0), help="Replicas to hold at least.")
@click.option("--for", "duration", required=True, help="How long: 45m, 90s, 1h30m.")
@click.option("--url", default=lambda: os.environ.get("FLEET_URL", "http://127.0.0.1:8000"),
              show_default="http://127.0.0.1:8000", help="The gateway.")
@click.option("--api-key", default=lambda: os.environ.get("FLEET_API_KEY", ""), show_default="$FLEET_API_KEY",
              help="An admin key.")
def prewarm(tier: str, floor: int, duration: str, url: str, api_key: str) -> None:
    """Raise a tier's floor now, for a while (pay the cold-start tax before the burst)."""
    import httpx

    from fleet.durations import parse_duration

    try:
        secs = parse_duration(duration)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--for") from None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}/v1/fleet/prewarm", json={"tier": tier, "floor": floor, "duration_s": secs},
                       headers=headers, timeout=10)
    except httpx.HTTPError as e:
        click.echo(f"fleet: cannot reach the gateway at {url}: {e}", err=True)
        sys.exit(1)
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200:
        click.echo(f"fleet: {body.get('error', {}).get('message') or r.text}", err=True)
        sys.exit(1)
    import datetime as dt

    until = dt.datetime.fromtimestamp(body["until"]).astimezone().strftime("%H:%M:%S %Z")
    click.echo(f"{body['tier']}: floor {body['floor']} until {until}")


@main.command()
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.option("--policy", default="fleet", show_default=True,
              help="fleet (ours), or a baseline: static, hpa, keda, ray.")
@click.option("--compare", is_flag=True, help="Also replay every baseline on the same trace; rank them.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole outcome as JSON.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Draw demand, line, drain, replicas and spend per tier to FILE.png.")
@click.option("--seed", default=None, type=int, help="Random seed for the arrivals (default: the scenario's).")
@click.option("--timeline", default=200, show_default=True, type=int, help="Decisions to print (0: none).")
@click.option("--no-affinity", is_flag=True, help="Replay with prefix-affine claims off in every tier.")
@click.option("--no-degrade", is_flag=True, help="Replay without the tiers' degrade rules (docs/degrade.md).")
@click.option("--degrade-from", default=None, type=click.Path(dir_okay=False),
              help="Replay with each tier's degrade rule taken from this fleet config (e.g. configs/fleet.yaml).")
def simulate(scenario: str, policy: str, compare: bool, as_json: bool, plot_path: str | None, seed: int | None,
             timeline: int, no_affinity: bool, no_degrade: bool, degrade_from: str | None) -> None:
    """Replay a scenario through the real policy in simulated time (see configs/scenarios/)."""
    from fleetctl.simulate import run_simulate

    sys.exit(run_simulate(scenario, policy=policy, compare=compare, as_json=as_json, plot_path=plot_path,
                          seed=seed, timeline=timeline, affinity=not no_affinity, degrade=not no_degrade,
                          degrade_from=degrade_from))


@main.group()
def keys() -> None:
    """API keys stored in Redis: every gateway picks them up within a heartbeat."""


def _stored_keys() -> tuple[Any, str]:
    from fleet.store.connection import connect_sync

    cfg = _config(None)
    return connect_sync(_redis_url()), cfg.namespace


def _key_or_exit(cfg: FleetConfig, **fields: Any) -> Any:
    """The key `keys add` would store, validated as the config loader validates its keys."""
    from pydantic import ValidationError

    from fleet.config import ApiKey

    try:
        key = ApiKey(**fields)
    except ValidationError as e:
        click.echo("fleet: " + "; ".join(f"--{'-'.join(map(str, x['loc'])).replace('_', '-') or 'default-priority'}: "
                                         f"{x['msg']}" for x in e.errors()), err=True)
        sys.exit(2)
    if bad := key.unknown_tiers(cfg.tiers):
        click.echo(f"fleet: --tiers: no tier {', '.join(map(repr, bad))}; tiers are {', '.join(cfg.tiers)}",
                   err=True)
        sys.exit(2)
    return key


@keys.command("add")
@click.argument("name")
@click.option("--tiers", default=None, help="Comma-separated tiers this key may use (default: all).")
@click.option("--default-priority", default="interactive", show_default=True)
@click.option("--max-priority", default="committed", show_default=True, help="The highest class it may send.")
@click.option("--rpm", type=int, default=None, help="Requests per minute.")
@click.option("--tpm", type=int, default=None, help="Tokens per minute.")
@click.option("--budget-usd", type=float, default=None, help="Dollar budget for the key's lifetime.")
@click.option("--admin", is_flag=True, help="May call fleet-control endpoints (pre-warm).")
@click.option("--read-status", is_flag=True, help="May read /v1/fleet/status and /metrics.")
@click.option("--degrade", type=click.Choice(["tier", "allow", "never", "forbid"]), default="tier", show_default=True,
              help="Its calls' default without X-Fleet-Degrade; forbid: never, whatever the header (docs/degrade.md).")
def keys_add(name: str, tiers: str | None, default_priority: str, max_priority: str, rpm: int | None,
             tpm: int | None, budget_usd: float | None, admin: bool, read_status: bool, degrade: str) -> None:
    """Create a key; its secret is printed once and only its sha256 is stored."""
    import hashlib

    from fleet.store.api_keys import KeyExists, add_stored_key
    from fleetctl.admin_key import new_secret

    cfg = _config(None)
    secret = new_secret()
    key = _key_or_exit(cfg, name=name, sha256=hashlib.sha256(secret.encode()).hexdigest(),
                       tiers=[t.strip() for t in tiers.split(",")] if tiers is not None else None,
                       default_priority=default_priority, max_priority=max_priority, rpm=rpm, tpm=tpm,
                       budget_usd=budget_usd, admin=admin, read_status=read_status, degrade=degrade)
    r, namespace = _stored_keys()
    try:
        add_stored_key(r, namespace, key, taken=[k.name for k in cfg.keys])
    except KeyExists as e:
        click.echo(f"fleet: {e}", err=True)
        sys.exit(2)
    click.echo(secret)


@keys.command("list")
def keys_list() -> None:
    """The stored keys (names and limits, never secrets)."""
    from fleet.store.api_keys import list_stored_keys

    r, namespace = _stored_keys()
    got = list_stored_keys(r, namespace)
    for k in got.keys:
        click.echo(f"{k.name}\ttiers={','.join(k.tiers) if k.tiers else 'all'}\tdefault={k.default_priority}"
                   f"\tmax={k.max_priority}\trpm={k.rpm}\ttpm={k.tpm}\tbudget_usd={k.budget_usd}"
                   f"\tadmin={k.admin}\tread_status={k.read_status}\tdegrade={k.degrade}")
    for bad in got.invalid:
        click.echo(f"fleet: invalid stored key {bad}", err=True)


@keys.command("revoke")
@click.argument("name")
def keys_revoke(name: str) -> None:
    """Remove a stored key; gateways refuse it within a heartbeat."""
    from fleet.store.api_keys import revoke_stored_key

    r, namespace = _stored_keys()
    if not revoke_stored_key(r, namespace, name):
        click.echo(f"fleet: no stored key named {name!r}", err=True)
        sys.exit(1)
    click.echo(f"revoked {name}")


@main.command("hash-key")
@click.argument("secret")
def hash_key(secret: str) -> None:
    """Print the sha256 of an API key, for the config's `keys` list."""
    import hashlib

    click.echo(hashlib.sha256(secret.encode()).hexdigest())


def _models_commands() -> None:
    from fleetctl.models_cli import models, promote_cmd, rollback_cmd

    for cmd in (models, promote_cmd, rollback_cmd):
        main.add_command(cmd)


_models_commands()

if __name__ == "__main__":
    main()
