"""A long replay's progress on a terminal: one line on stderr, rewritten in place.

Shown only when stderr is a terminal, so `--json` output and logs stay clean. The
main replay reports its simulated time at each scaler tick (`Simulator`'s
`progress` hook); the replays run beside it (`simulator.parallel`) report when
each is done. The line is redrawn at most every half second and cleared at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from simulator.scenario import Scenario


class Progress:
    """Call it with the main replay's simulated time; `side` with the other replays' count."""

    def __init__(self, sc: Scenario, label: str, stream: TextIO | None = None, every_s: float = 0.5) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.sc, self.label, self.every_s = sc, label, every_s
        self.t0 = time.monotonic()
        self.shown_at = 0.0
        self.width = 0  # of the line on screen, to clear it
        self.sim_t: float | None = None
        self.side_done, self.side_total = 0, 0
        self.poll: Callable[[], int] | None = None  # how many side replays have ended, asked while drawing

    def __call__(self, t: float) -> None:
        """The main replay is at `t` seconds of simulated time."""
        self.sim_t = t
        self._maybe_show()

    def watch(self, done: Callable[[], int], total: int) -> None:
        """Show, beside the main replay, how many of `total` side replays have ended (`done()`)."""
        self.poll, self.side_total = done, total

    def side(self, done: int, total: int) -> None:
        """`done` of the `total` replays run beside the main one have ended."""
        self.poll = None  # told from now on
        self.side_done, self.side_total = done, total
        self._maybe_show(force=True)

    def _maybe_show(self, force: bool = False) -> None:
        if not self.on:
            return
        now = time.monotonic()
        if not force and now - self.shown_at < self.every_s:
            return
        self.shown_at = now
        if self.poll is not None:
            self.side_done = self.poll()
        parts = [f"{self.sc.name}: replaying"]
        if self.sim_t is not None:
            share = min(1.0, self.sim_t / self.sc.duration_s) if self.sc.duration_s else 1.0
            parts.append(f"{self.label} at {self.sc.clock(self.sim_t)} ({share:.0%})")
        if self.side_total:
            parts.append(f"{self.side_done} of {self.side_total} other replays done")
        self._write(", ".join(parts) + f"  [{now - self.t0:.0f} s]")

    def _write(self, text: str) -> None:
        pad = " " * max(0, self.width - len(text))
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self.width = len(text)

    def close(self) -> None:
        """Clear the line (nothing was written unless stderr is a terminal)."""
        if self.on and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0
