"""py-spy for the benches: sample a running part, then its top costs by function.

`record` starts `py-spy record --format raw --nonblocking` on a process for a while (raw: one
stack and its sample count a line; non-blocking: the part is not paused to be read, so it runs
at its own speed). `print_top` reads such a file back and prints, per function (its lines
merged), the share of samples with it on top of the stack and anywhere in it. py-spy leaves out
a thread waiting in epoll, so the shares are of the time the process was running Python.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The venv's own (pip install py-spy), else one on PATH (installed elsewhere: `pip install --target`).
PY_SPY = Path(sys.executable).parent / "py-spy"
if not PY_SPY.exists() and shutil.which("py-spy"):
    PY_SPY = Path(shutil.which("py-spy") or "")


def record(pid: int, out: Path, duration_s: float) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `duration_s` (whole seconds) into `out`."""
    return subprocess.Popen([str(PY_SPY), "record", "--pid", str(pid), "--duration", str(max(1, int(duration_s))),
                             "--format", "raw", "--nonblocking", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_costs(raw: Path, top: int = 12) -> list[tuple[str, float, float]]:
    """(function, share of samples on top of the stack, share anywhere in it), the costliest first."""
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    total = 0
    for row in raw.read_text().splitlines():
        stack, _, count = row.rpartition(" ")
        if not stack:
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        total += int(count)
        own[frames[-1]] += int(count)
        for f in set(frames):
            anywhere[f] += int(count)
    return [(f, c / total, anywhere[f] / total) for f, c in own.most_common(top)] if total else []


def print_top(raw: Path, title: str) -> None:
    print(f"\npy-spy, {title} (share of its samples: on top of the stack / anywhere in it)")
    for f, own, anywhere in top_costs(raw):
        print(f"  {own:6.1%} {anywhere:6.1%}  {f}")
