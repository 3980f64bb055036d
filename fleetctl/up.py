"""`fleet up`: the whole fleet on one machine, as child processes.

The scaler and its supervisor start each tier at its warm floor and then size
it on its line. Shows progress while replicas pay their cold start, then
prints a first call. Ctrl-C, SIGTERM or SIGHUP stops it: it says it is
draining (the gateway finishes its calls, workers finish what they hold),
then that it has stopped, and exits 0; a second one stops the parts at once.
Nothing else stops it but a part exiting on its own, which is named with its
exit status (exit 1): a Redis that fails meanwhile is said and waited for, as
every part does. How it stops: `fleetctl.up_stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet.config import FleetConfig
from fleet.redis_server import NoRedis, resolve_redis
from fleet.store.connection import connect
from fleet.store.heartbeats import count_by_state, read_heartbeats
from fleet.store.keys import TierKeys
from fleet.tasks import cancel_and_wait
from fleetctl.up_stop import GRACE_S, Ending, Stops, exit_status, exited, say, signal_name, stop_parts


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A process group of its own: a terminal's Ctrl-C reaches `fleet up` alone, which stops the
    # parts in order (fleetctl.up_stop); the scaler's replicas join the scaler's group.
    return subprocess.Popen([sys.executable, "-m", "fleetctl", *args], env=env, process_group=0)


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
        say(f"[{time.monotonic() - self.t0:5.1f}s] {what}", err=err)

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


async def _until(woken: asyncio.Event, s: float) -> None:
    """Wait `s` seconds, less if `woken` is set (a stop signal); clears it."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(s):
            await woken.wait()
    woken.clear()


async def _poll(shown: Progress, redis: Redis, woken: asyncio.Event) -> bool | None:
    """One look at the tiers (`Progress.poll`), given up if a stop signal comes first (None): a look
    while Redis is away can take seconds of timeouts and retries, and a Ctrl-C must not wait them out."""
    look = asyncio.ensure_future(shown.poll(redis))
    ring = asyncio.ensure_future(woken.wait())
    try:
        await asyncio.wait({look, ring}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(ring)
    if not look.done():
        await cancel_and_wait(look)
        return None
    return look.result()


async def _watch(cfg: FleetConfig, url: str, want: dict[str, int], parts: dict[str, subprocess.Popen[bytes]],
                 stops: Stops, base: str, limit_s: float = 600) -> Ending:
    """Show each tier's ready replicas against its floor until all are up (or `limit_s` has passed:
    the fleet serves what it has, as it would if Redis or a cold start is slow), print the first
    call, then serve until a stop signal or a part exiting; returns which."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    stops.wake = lambda: loop.call_soon_threadsafe(woken.set)
    redis = connect(url, "calls", name="fleet-up")
    shown, up = Progress(cfg, want), False
    try:
        while True:
            if stops.got:
                return Ending(signum=stops.got[0], up=up)
            if (gone := exited(parts)) is not None:
                # A signal sent to every process at once (a process manager's stop) may reach a part
                # first: a part that stopped on it is not a part dying.
                await _until(woken, GRACE_S)
                return Ending(signum=stops.got[0], up=up) if stops.got else Ending(None, *gone, up=up)
            if not up:
                ready = await _poll(shown, redis, woken)
                if ready is None:
                    continue  # a stop signal: said at the top
                late = not ready and time.monotonic() - shown.t0 > limit_s
                if late:
                    shown.say(f"fleet: not every tier reached its floor within {limit_s:.0f} s; serving meanwhile "
                              "(`fleet status` shows each tier)", err=True)
                if ready or late:
                    up = True
                    say(f"\nFleet Gateway is up at {base}/v1  (status: fleet status, Ctrl-C to stop)\n"
                        f"  curl {base}/v1/chat/completions -H 'content-type: application/json' "
                        f"-d '{{\"model\":\"routing\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'")
            await _until(woken, 0.5)
    finally:
        stops.wake = None
        with contextlib.suppress(RedisError, OSError):
            await redis.aclose()


def _ended(ending: Ending) -> None:
    """Say why the fleet stops, before it drains."""
    if ending.signum is not None:
        again = "; Ctrl-C again stops at once" if ending.signum == signal.SIGINT else ""
        say(f"\nfleet: {signal_name(ending.signum)}: stopping the fleet, draining "
            f"(the gateway finishes its calls, workers finish what they hold{again})...")
    else:
        when = "" if ending.up else " during start-up"
        say(f"fleet: the {ending.part} exited{when} ({exit_status(ending.code or 0)}); see its output above; "
            "stopping the fleet", err=True)


def run_up(cfg: FleetConfig, *, host: str, port: int, engine: str | None, config_path: str | None) -> int:
    """Find or start a Redis, start the gateway and the scaler, show the cold starts, then serve
    until Ctrl-C, SIGTERM or SIGHUP, which drains every replica (exit 0), or a part exits on its own
    (exit 1). Returns the exit status."""
    stops = Stops().install()  # from the start: a Ctrl-C while Redis is found is a stop too
    try:
        url, private = resolve_redis(own_group=True)  # a private one must outlive the drain
    except NoRedis as e:
        say(f"fleet: {e}", err=True)
        return 2
    say(f"fleet: Redis at {url}" + (" (private, started for this fleet)" if private else ""))
    env = {**os.environ, "REDIS_URL": url}
    if config_path:
        env["FLEET_CONFIG"] = config_path
    parts: dict[str, subprocess.Popen[bytes]] = {}
    ending, clean, t0 = Ending(signum=stops.got[0]) if stops.got else Ending(), True, time.monotonic()
    try:
        if ending.signum is None:
            parts["gateway"] = _spawn(["gateway", "--host", host, "--port", str(port)], env)
            # The scaler starts each tier at its floor, and drains its replicas when it stops.
            parts["scaler"] = _spawn(["scaler", "--stop-replicas-on-exit",
                                      *(["--engine", engine] if engine else [])], env)
            want = {t: tc.warm_floor for t, tc in cfg.tiers.items()}
            say("fleet: starting the gateway and the scaler; warm floors "
                + ", ".join(f"{t}={n}" for t, n in want.items()))
            ending = asyncio.run(_watch(cfg, url, want, parts, stops, f"http://{host}:{port}"))
        _ended(ending)
        t0 = time.monotonic()
        clean = stop_parts(parts, stops)
    finally:
        if any(p.poll() is None for p in parts.values()):  # an error of `fleet up` itself: they stop all the same
            stop_parts(parts, stops)
        if private:
            private.stop()
    say(f"fleet: stopped ({time.monotonic() - t0:.1f} s)" if clean else "fleet: stopped, not cleanly", err=not clean)
    return 0 if clean and ending.signum is not None else 1
