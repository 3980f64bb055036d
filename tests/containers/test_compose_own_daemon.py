"""`make compose-up` and `make compose-down` against a Docker daemon the user already runs.

The daemon is started here with a plain `dockerd ...` command (vfs, no bridge, no iptables: what
this machine allows), before `make compose-up`, and named to it with DOCKER_HOST, as a user's own
would be; scripts/dockerhost.py only finds it. FLEET_DOCKER_ROOT points at a folder that does not
exist, as on a fresh machine where the private daemon never ran.

Its data root is kept between runs (FLEET_OWN_DOCKER_ROOT, default /var/lib/fleet-own-docker), as
the private daemon's is: a cold build of the images on vfs costs minutes here, so only a machine's
first run makes the base image in this daemon; later runs rebuild only what changed. That first
run imports the base image's root filesystem the private daemon's tests kept (FLEET_BASE_CACHE)
rather than running debootstrap again; debootstrap's scratch folder in a data root that does not
exist yet (the path that once failed with FileNotFoundError) is tests/pure/test_dockerhost.py's.
The test stops the daemon by its pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import docker
import openai
import pytest

from fleet.redis_server import free_port
from tests.docker_stack import LABEL, ROOT, dockerhost
from tests.harness import wait_until

pytestmark = pytest.mark.timeout(900)  # a machine's first run builds both images in this daemon (about 5 min)
OWN_ROOT = Path(os.environ.get("FLEET_OWN_DOCKER_ROOT", "/var/lib/fleet-own-docker"))
TIERS = {"routing": "fleet-small", "analysis": "fleet-mid", "planner": "fleet-large"}  # configs/fleet.yaml
MAKE_TIMEOUT_S = 780
API_VERSION = "1.41"  # Docker Engine 20.10's (Debian bookworm's docker.io); later engines still serve it


@contextlib.contextmanager
def data_root_lock() -> Iterator[None]:
    """One daemon at a time on the kept data root (another checkout's test may hold it)."""
    OWN_ROOT.mkdir(parents=True, exist_ok=True)
    with open(OWN_ROOT / "lock", "w") as f:
        wait_until(lambda: _try_lock(f), 600, interval=1.0, what=f"the lock on {OWN_ROOT}")
        yield


def _try_lock(f: IO[str]) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def pinged(client: docker.DockerClient) -> bool:
    try:
        return bool(client.ping())
    except Exception:  # not listening yet, or gone
        return False


def clean(client: docker.DockerClient) -> None:
    """Everything a run left in the kept data root but the images: containers (their restart policy
    would start them with the next daemon), volumes, networks, and images a rebuild replaced."""
    for c in client.containers.list(all=True):
        c.remove(force=True)
    client.volumes.prune()
    client.networks.prune()
    client.images.prune(filters={"dangling": True})


@pytest.fixture
def own_daemon() -> Iterator[str]:
    """A dockerd started the way a user starts theirs; stopped by its pid at the end."""
    dockerhost.ensure_installed()  # Debian's docker.io, docker-compose, debootstrap when missing
    with data_root_lock():
        run_dir = Path(tempfile.mkdtemp(prefix="fleet-own-"))  # short: containerd's sockets live under it
        try:
            with open(run_dir / "dockerd.log", "ab") as log:
                yield from _run_dockerd(run_dir, log)
        finally:
            # dockerd leaves its network namespace mounted in its exec root after it exits
            subprocess.run(["umount", str(run_dir / "exec" / "netns" / "default")], capture_output=True)
            shutil.rmtree(run_dir, ignore_errors=True)


def _run_dockerd(run_dir: Path, log: IO[bytes]) -> Iterator[str]:
    host = f"unix://{run_dir / 'docker.sock'}"
    proc = subprocess.Popen(
        ["dockerd", "--data-root", str(OWN_ROOT / "data"), "--exec-root", str(run_dir / "exec"),
         "-H", host, "--pidfile", str(run_dir / "dockerd.pid"), "--iptables=false", "--ip6tables=false",
         "--bridge=none", "--storage-driver=vfs"], stdout=log, stderr=log, start_new_session=True)
    # The API version named: the client then connects on first use, not before the daemon listens.
    client = docker.DockerClient(base_url=host, version=API_VERSION, timeout=120)
    try:
        wait_until(lambda: proc.poll() is not None or pinged(client), 60, interval=0.2, what="dockerd to answer")
        assert proc.poll() is None, (run_dir / "dockerd.log").read_text()[-3000:]
        clean(client)  # what a run killed before its end left
        yield host
    finally:
        with contextlib.suppress(Exception):
            clean(client)
        client.close()
        proc.send_signal(signal.SIGTERM)  # by its pid: the daemon this test started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def make(target: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`make TARGET` in the checkout; on timeout its whole process group is killed (make's python too)."""
    p = subprocess.Popen(["make", "--no-print-directory", target], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=MAKE_TIMEOUT_S)
    except BaseException as e:  # its own timeout, or the test's (pytest-timeout): none of make's outlives it
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def answer(c: openai.OpenAI, model: str) -> openai.types.chat.ChatCompletion | None:
    """One chat call; None while the tier's first worker container still starts."""
    try:
        return c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hello {model}"}],
                                         max_tokens=8)
    except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError, openai.RateLimitError):
        return None


def test_compose_up_serves_every_tier_on_the_users_daemon_and_down_leaves_it_running(own_daemon: str,
                                                                                    tmp_path: Path) -> None:
    host = own_daemon
    ns = f"own{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DOCKER_HOST": host, "FLEET_DOCKER_ROOT": str(tmp_path / "fresh-data-root"),
           "QUIET": "1", "FLEET_NAMESPACE": ns, "FLEET_REDIS_PORT": str(free_port()),
           "FLEET_GATEWAY_PORT": str(free_port()), "FLEET_GATEWAY_METRICS_PORT": str(free_port()),
           "FLEET_SCALER_METRICS_PORT": str(free_port())}
    t0 = time.monotonic()
    up = make("compose-up", env)
    print(f"\nmake compose-up on the user's daemon: {time.monotonic() - t0:.1f} s")
    assert up.returncode == 0, f"{up.stdout[-3000:]}\n{up.stderr[-5000:]}"
    assert f"DOCKER_HOST={host}" in up.stdout and "private dockerd" not in up.stderr, up.stderr[-3000:]
    key = re.search(r"admin key \(made on.*\n\s+(fk-[A-Za-z0-9_-]+)", up.stdout)
    assert key, up.stdout[-3000:]

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{env['FLEET_GATEWAY_PORT']}/v1", api_key=key.group(1),
                      timeout=60, max_retries=0)
    client = docker.DockerClient(base_url=host, version=API_VERSION, timeout=60)
    for tier, model in TIERS.items():
        r = wait_until(lambda m=model: answer(c, m), 240, interval=1.0, what=f"an answer from {model}")
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1, r
        served = client.containers.list(filters={"label": [f"{LABEL}.namespace={ns}", f"{LABEL}.tier={tier}"]})
        assert served, f"no worker container of {tier} on the user's daemon"

    t0 = time.monotonic()
    down = make("compose-down", env)
    print(f"make compose-down: {time.monotonic() - t0:.1f} s")
    assert down.returncode == 0, f"{down.stdout[-3000:]}\n{down.stderr[-3000:]}"
    assert "no worker container left: True" in down.stdout and "left running" in down.stdout, down.stdout
    assert pinged(client), "make compose-down stopped the user's daemon"
    assert client.containers.list(all=True) == []  # the stack and its workers, gone; the daemon stays
    client.close()
