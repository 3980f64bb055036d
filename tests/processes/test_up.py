"""`fleet up`: the whole fleet from one command, serving every tier, stopping cleanly on Ctrl-C
(SIGINT to its whole process group, as a terminal sends it) or SIGTERM, and stopping, named, when
a part dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from fleet.redis_server import PrivateRedis, free_port
from tests.cluster_harness import PrivateCluster
from tests.harness import ROOT, TEST_CONFIG, Fleet, wait_until

SLOW_PLANNER = {"FLEET_TIERS__PLANNER__SIM__WARMUP_S": "6"}  # a cold start long enough to fault Redis in


def descendants(pid: int) -> dict[int, str]:
    """Every process under `pid`, with its command line (read from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:  # the command's name may hold spaces and parentheses: the fields follow the last ")"
                parent[int(d.name)] = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # it exited meanwhile
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        above = todo.pop()
        for child in [c for c, pp in parent.items() if pp == above]:
            try:
                out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return out


class Up:
    """`fleet up` as a subprocess in a session of its own (its own process group, as a shell runs a
    command in a terminal), its output (stdout and stderr) read line by line as it comes."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "fleetctl", "up", "--port", str(self.port), "--config",
                                      str(TEST_CONFIG)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def until(self, words: str, timeout: float) -> None:
        """Read output until a line holds `words` (or `fleet up` exits: then fail, showing what it said)."""
        def seen() -> bool:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            self.lines.append(line)
            return words in line or self.proc.poll() is not None

        wait_until(seen, timeout, interval=0, what=repr(words), why=lambda: "".join(self.lines[-20:]))
        assert self.proc.poll() is None, "fleet up exited:\n" + "".join(self.lines)

    def serves_every_tier(self) -> None:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=30)
        for tier in ("routing", "analysis", "planner"):
            def served(t: str = tier) -> bool:
                try:
                    r = c.chat.completions.create(model=t, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
                    return r.usage.completion_tokens == 3  # type: ignore[union-attr]
                except openai.APIError:  # 503 while a part reconnects
                    return False
            wait_until(served, 60, interval=0.5, what=f"{tier} served after the fault")

    def stop(self, *, group_sigint: bool = False, timeout: float = 90) -> tuple[int, str]:
        """Ctrl-C as a terminal sends it (SIGINT to the whole group), else SIGTERM to `fleet up` alone;
        its exit status and all it said from then on, once it and every part it started have ended
        (they share its output: its end means theirs)."""
        if self.proc.stdout is None or self.proc.stdout.closed:  # finished already
            return self.proc.wait(), ""
        if self.proc.poll() is None:
            if group_sigint:
                os.killpg(self.proc.pid, signal.SIGINT)
            else:
                self.proc.send_signal(signal.SIGTERM)
        return self.finish(timeout)

    def finish(self, timeout: float = 90) -> tuple[int, str]:
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rest, _ = self.proc.communicate()
            raise AssertionError("fleet up did not stop:\n" + "".join(self.lines[-20:]) + rest) from None
        return self.proc.returncode, rest


def stopped_cleanly(code: int, said: str, how: str, *, quiet: bool = True) -> None:
    """What a user sees of a clean stop: it says it drains, then that it stopped, exit 0, and no part
    blamed. `quiet`: nothing at all warned of meanwhile (a part's warning, error or traceback)."""
    assert code == 0, said
    assert f"fleet: {how}: stopping the fleet, draining" in said, said
    assert said.rstrip().splitlines()[-1].startswith("fleet: stopped ("), said
    assert not re.search(r"fleet: the \w+ exited|a part exited|did not stop", said), said
    if quiet:
        noisy = [ln for ln in said.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) |Traceback|still runs", ln)]
        assert not noisy, said


def test_fleet_up_serves_each_tier_and_stops_cleanly_on_ctrl_c(fleet: Fleet) -> None:
    up = Up(fleet.env)
    try:
        up.until("is up at", 120)
        assert any("starting" in ln for ln in up.lines), "no progress shown during cold start"
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="x", max_retries=0)
        for tier in ("routing", "analysis", "planner"):
            chunks = list(c.chat.completions.create(model=tier, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).split()
        # A terminal's Ctrl-C reaches its whole foreground group: the parts are outside it, so that
        # none can exit on it before `fleet up` has taken it as the user's stop.
        parts = descendants(up.proc.pid)
        assert sum("fleetctl worker" in cmd for cmd in parts.values()) == 3, parts
        assert all(os.getpgid(pid) != up.proc.pid for pid in parts), parts
    finally:
        code, said = up.stop(group_sigint=True)
    stopped_cleanly(code, said, "Ctrl-C")
    # Every worker drained and left: no replica heartbeats remain.
    for tier in ("routing", "analysis", "planner"):
        assert fleet.r.hlen(fleet.keys(tier).replicas) == 0


def test_a_part_that_dies_stops_the_fleet_named_with_its_exit_status(fleet: Fleet) -> None:
    up = Up(fleet.env)
    try:
        up.until("is up at", 120)
        gateway = next(pid for pid, cmd in descendants(up.proc.pid).items() if "fleetctl gateway" in cmd)
        os.kill(gateway, signal.SIGKILL)
        code, said = up.finish()
    finally:
        up.stop()
    assert code == 1, said
    assert "fleet: the gateway exited (killed by SIGKILL); see its output above; stopping the fleet" in said, said
    assert "stopping the fleet, draining" not in said  # not read as the user's stop
    for tier in ("routing", "analysis", "planner"):  # the others drained all the same
        assert fleet.r.hlen(fleet.keys(tier).replicas) == 0


# --- a Redis fault while `fleet up` shows its start-up -------------------------------------------


def test_a_redis_restart_during_start_up_does_not_take_the_fleet_down() -> None:
    server = PrivateRedis().start()
    up = Up({**Fleet(server.url).env, **SLOW_PLANNER})
    try:
        up.until("starting", 60)  # replicas paying their cold start
        server.stop()
        up.until("Redis does not answer", 30)
        server = PrivateRedis(port=server.port).start()  # the same address, empty
        up.until("is up at", 120)
        assert up.proc.poll() is None
        up.serves_every_tier()
        assert any("Redis answers again" in ln for ln in up.lines), "".join(up.lines)
    finally:
        code, said = up.stop(group_sigint=True)
        server.stop()
    stopped_cleanly(code, said, "Ctrl-C", quiet=False)  # the fault's warnings may still be unread


@pytest.mark.timeout(240)
def test_a_cluster_master_killed_during_start_up_does_not_take_the_fleet_down() -> None:
    cluster = PrivateCluster().start()
    f = Fleet(cluster.url)
    up = Up({**f.env, **SLOW_PLANNER})
    try:
        up.until("routing 1/1 ready", 60)  # one tier answers, the planner still starts
        cluster.kill(cluster.master_of(f.keys("routing").line))
        wait_until(cluster.healthy, 30, interval=0.1, what="a replica promoted")
        up.until("is up at", 120)
        up.serves_every_tier()
    finally:
        code, said = up.stop()
        cluster.stop()
    stopped_cleanly(code, said, "SIGTERM", quiet=False)
