"""`fleet up`: the whole fleet on one machine, as child processes.

The scaler and its supervisor start each tier at its warm floor and then size
it on its line. Shows progress while replicas pay their cold start, then
prints a first call. Ctrl-C or SIGTERM drains everything: workers finish
what they hold, then exit. Nothing else stops it but a part exiting on its
own: a Redis that fails meanwhile is said and waited for, as every part does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import click
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet.config import FleetConfig
from fleet.redis_server import NoRedis, resolve_redis
from fleet.store.connection import connect
from fleet.store.heartbeats import count_by_state, read_heartbeats
from fleet.store.keys import TierKeys


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "fleetctl", *args], env=env)


class Progress:
    """Start-up progress: each tier's ready replicas against its floor, said when it changes.

    A Redis error here is a dependency's fault, not the fleet's: the gateway, the scaler and the
    workers each ride through one, so this display must too. It says so once, keeps asking, and
    says when Redis answers again; it never ends the fleet."""

    def __init__(self, cfg: FleetConfig, want: dict[str, int]) -> None:
        self.cfg, self.want = cfg, want
        self.t0 = time.monotonic()
        self.last = ""
        self.away: str | None = None  # the error Redis last answered with, while it is away

    def say(self, what: str, *, err: bool = False) -> None:
        click.echo(f"[{time.monotonic() - self.t0:5.1f}s] {what}", err=err)

    async def poll(self, redis: Redis) -> bool:
        """One look at every tier; True once each has its floor ready. Redis away: False, said once."""
        try:
            parts, done = [], True
            for tier, n in self.want.items():
                beats = await read_heartbeats(redis, TierKeys(self.cfg.namespace, tier), self.cfg.heartbeat_s)
                states = count_by_state(beats)
                parts.append(f"{tier} {states['ready']}/{n} ready"
                             + (f" ({states['starting']} starting)" if states["starting"] else ""))
                done &= states["ready"] >= n
        except (RedisError, OSError) as e:
            if self.away is None:
                self.say(f"fleet: Redis does not answer ({type(e).__name__}: {e}); the parts ride through it, "
                         "still waiting", err=True)
            self.away = type(e).__name__
            return False
        if self.away is not None:
            self.away = None
            self.say("fleet: Redis answers again")
        msg = ", ".join(parts)
        if msg != self.last:
            self.say(msg)
            self.last = msg
        return done


async def _progress(cfg: FleetConfig, url: str, want: dict[str, int], procs: list[subprocess.Popen[bytes]],
                    limit_s: float = 600) -> bool:
    """Show each tier's ready replicas against its floor until all are up (True), or a part exits
    (False). Past `limit_s` it says so and returns True: the fleet serves what it has, as it would
    if Redis or a cold start is slow, and only Ctrl-C, SIGTERM or a part exiting stops it."""
    redis = connect(url, "calls", name="fleet-up")
    shown = Progress(cfg, want)
    try:
        while True:
            if await shown.poll(redis):
                return True
            if any(p.poll() is not None for p in procs):
                click.echo("fleet: a part exited during start-up; see its output above", err=True)
                return False
            if time.monotonic() - shown.t0 > limit_s:
                shown.say(f"fleet: not every tier reached its floor within {limit_s:.0f} s; serving meanwhile "
                          "(`fleet status` shows each tier)", err=True)
                return True
            await asyncio.sleep(0.5)
    finally:
        with contextlib.suppress(RedisError, OSError):
            await redis.aclose()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_up(cfg: FleetConfig, *, host: str, port: int, engine: str | None, config_path: str | None) -> int:
    """Find or start a Redis, start the gateway and the scaler, show the cold starts, then serve
    until Ctrl-C or SIGTERM, which drains every replica. Returns the exit status."""
    try:
        url, private = resolve_redis()
    except NoRedis as e:
        click.echo(f"fleet: {e}", err=True)
        return 2
    click.echo(f"fleet: Redis at {url}" + (" (private, started for this fleet)" if private else ""))
    # A process manager stops us with SIGTERM: drain the fleet as Ctrl-C would.
    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "REDIS_URL": url}
    if config_path:
        env["FLEET_CONFIG"] = config_path
    procs = [_spawn(["gateway", "--host", host, "--port", str(port)], env),
             # The scaler starts each tier at its floor, and drains its replicas when it stops.
             _spawn(["scaler", "--stop-replicas-on-exit", *(["--engine", engine] if engine else [])], env)]
    want = {t: tc.warm_floor for t, tc in cfg.tiers.items()}
    click.echo(f"fleet: starting the gateway and the scaler; warm floors "
               f"{', '.join(f'{t}={n}' for t, n in want.items())}")
    code = 0
    try:
        if asyncio.run(_progress(cfg, url, want, procs)):
            base = f"http://{host}:{port}"
            click.echo(f"\nFleet Gateway is up at {base}/v1  (status: fleet status, Ctrl-C to stop)\n"
                       f"  curl {base}/v1/chat/completions -H 'content-type: application/json' "
                       f"-d '{{\"model\":\"routing\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'")
            while all(p.poll() is None for p in procs):
                time.sleep(0.5)
            click.echo("fleet: a part exited; stopping the fleet", err=True)
            code = 1
        else:
            code = 1
    except KeyboardInterrupt:
        click.echo("\nfleet: draining (workers finish what they hold)...")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(90)  # the scaler waits for its replicas to drain (up to 60 s)
            except subprocess.TimeoutExpired:
                p.kill()
        if private:
            private.stop()
    return code
