"""How `fleet up` stops: on a signal the user sent, or when a part exits on its own.

The parts (the gateway, the scaler and the replicas it starts) run in process groups of their
own, so a terminal's Ctrl-C (SIGINT to its whole foreground group) reaches `fleet up` alone, and
`fleet up` stops them in order. When each part took the Ctrl-C itself, the one that exited first
could be seen before `fleet up` had run its own handler, and a user's Ctrl-C read as a part dying
(`a part exited`, exit 1, `make: *** Error 1`). A signal is recorded, never raised: an exception
raised wherever the main thread happens to be can be lost in an event loop, or cut a clean-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import click

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a process manager, a closed terminal
STOP_S = 90.0  # the longest a part may take to stop: the scaler gives its replicas up to 60 s to drain
GRACE_S = 1.0  # a part seen exited: how long a stop signal sent to every process at once may take to reach us


def say(what: str, *, err: bool = False) -> None:
    """One line to the user; a terminal closed meanwhile (SIGHUP, EIO) or a closed pipe is no error:
    the fleet still stops."""
    with contextlib.suppress(OSError):
        click.echo(what, err=err)


class Stops:
    """The stop signals `fleet up` has received, in order. `wake` (set while an event loop waits on
    them) is called on each, so the loop acts at once."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.wake: Callable[[], None] | None = None

    def install(self) -> Stops:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (`nohup`, a background job): left so
                signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, _frame: FrameType | None) -> None:
        self.got.append(signum)
        if self.wake is not None:
            self.wake()


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "Ctrl-C"}.get(signum, signal.Signals(signum).name)  # type: ignore[call-overload]


def exit_status(code: int) -> str:
    """A child's return code as a user reads it: `exit status 2`, `killed by SIGKILL`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass
class Ending:
    """Why the fleet stops: a signal (the user's, or a process manager's), or a part that exited."""

    signum: int | None = None
    part: str | None = None
    code: int | None = None
    up: bool = False  # the fleet had come up (or stopped waiting for its floors)


def exited(parts: dict[str, subprocess.Popen[bytes]]) -> tuple[str, int] | None:
    """The first part found exited, with its return code."""
    for name, p in parts.items():
        if p.poll() is not None:
            return name, p.returncode
    return None


def _kill_groups(parts: dict[str, subprocess.Popen[bytes]], sig: int) -> None:
    """`sig` to each part's process group: the part and whatever it started (the scaler's replicas).
    SIGKILL: then waits for the parts, which cannot outlive it."""
    for p in parts.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
    if sig == signal.SIGKILL:
        for p in parts.values():
            p.wait()


def stop_parts(parts: dict[str, subprocess.Popen[bytes]], stops: Stops, limit_s: float = STOP_S) -> bool:
    """SIGTERM to each part still running (the gateway finishes its calls, the scaler drains its
    replicas), and wait for all. A further signal meanwhile stops them at once (SIGKILL). True when
    each stopped as asked; False, said, when one had to be killed or ended with an error."""
    asked = {n: p for n, p in parts.items() if p.poll() is None}
    for p in asked.values():
        p.send_signal(signal.SIGTERM)
    seen, end = len(stops.got), time.monotonic() + limit_s
    while (running := [n for n, p in parts.items() if p.poll() is None]):
        if len(stops.got) > seen:
            say(f"fleet: {signal_name(stops.got[-1])} again: stopping {', '.join(running)} at once "
                "(calls in flight are cut)", err=True)
            _kill_groups(parts, signal.SIGKILL)
            return False
        if time.monotonic() > end:
            say(f"fleet: {', '.join(running)} did not stop within {limit_s:.0f} s; killed", err=True)
            _kill_groups(parts, signal.SIGKILL)
            return False
        time.sleep(0.1)
    _kill_groups(parts, signal.SIGTERM)  # a replica its scaler left behind (a scaler killed) drains too
    clean = True
    for name, p in asked.items():
        # A part stopped by its signal's default action (before its handler was set) stopped as asked.
        if p.returncode not in (0, -signal.SIGTERM):
            say(f"fleet: the {name} did not stop cleanly ({exit_status(p.returncode)})", err=True)
            clean = False
    return clean
