"""`make compose-up` / `make compose-down` on a machine without a GPU.

    python scripts/compose.py up      # daemon, images, compose.yml + compose.cpu.yml, /readyz, a first call
    python scripts/compose.py down    # the stack, the scaler's worker containers, then the private daemon (if used)

The daemon comes from scripts/dockerhost.py (DOCKER_HOST, /var/run/docker.sock, else a private one).
The ports and the namespace are the variables docker-compose.cpu.yml names (FLEET_GATEWAY_PORT, ...).
The tests (tests/docker_stack.py) drive the same functions with ports of their own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dockerhost

ROOT = dockerhost.ROOT
FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
LABEL = "fleet.replica.namespace"  # scaler/backends.py labels every worker container with it
ADMIN_KEY_SHOWN = "fleet: admin key made on first start:"  # fleetctl/admin_key.py prints the secret after it
DEFAULTS = {"FLEET_REDIS_PORT": "6380", "FLEET_GATEWAY_PORT": "8000", "FLEET_GATEWAY_METRICS_PORT": "9100",
            "FLEET_SCALER_METRICS_PORT": "9101", "FLEET_NAMESPACE": "fleet"}


def stack_env(host: str, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every docker/docker-compose call: the daemon, its socket for the scaler's
    mount, the ports, and PWD (the worker containers bind this checkout's configs/)."""
    env = {**os.environ, "DOCKER_HOST": host, "PWD": str(ROOT), "COMPOSE_DOCKER_CLI_BUILD": "0",
           "DOCKER_BUILDKIT": "0"}
    for k, v in {**DEFAULTS, "FLEET_CONFIG_DIR": str(ROOT / "configs")}.items():
        env.setdefault(k, v)
    env.update(overrides or {})
    if host.startswith("unix://"):
        env["FLEET_DOCKER_SOCK"] = host[len("unix://"):]
    return env


def merged(env: Mapping[str, str], project: str) -> Path:
    """docker-compose.yml with the CPU override, as one file. Compose v1 cannot drop a key in an override
    and refuses `ports` beside `network_mode: host`, so the host-mode services' ports go here (the host's
    ports are theirs already)."""
    cmd = ["docker-compose", "-p", project]
    for f in FILES:
        cmd += ["-f", str(ROOT / f)]
    out = subprocess.run([*cmd, "config"], env=dict(env), cwd=ROOT, check=True, text=True, capture_output=True,
                         timeout=60).stdout
    spec = yaml.safe_load(out)
    for svc in spec["services"].values():
        if svc.get("network_mode") == "host":
            svc.pop("ports", None)
    path = ROOT / ".docker" / f"compose-{project}.yml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def compose(env: Mapping[str, str], project: str, *args: str, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = ["docker-compose", "-p", project, "--project-directory", str(ROOT), "-f", str(merged(env, project))]
    r = subprocess.run([*cmd, *args], env=dict(env), cwd=ROOT, text=True, capture_output=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"docker-compose {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def get(url: str, timeout: float = 3.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def wait_ready(env: Mapping[str, str], timeout: float = 180.0) -> float:
    """Seconds until the gateway's /readyz answers 200 (raises TimeoutError after `timeout`)."""
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{env['FLEET_GATEWAY_PORT']}/readyz"
    last: object = None
    while time.monotonic() - t0 < timeout:
        try:
            get(url)
            return time.monotonic() - t0
        except Exception as e:  # not up yet: connection refused, 503 while Redis starts
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s: {last}")


def admin_key(env: Mapping[str, str], project: str = "fleet") -> str | None:
    """The admin key the gateway made on its first start, from its log (None: not this start's)."""
    log = compose(env, project, "logs", "--no-color", "gateway", check=False).stdout
    found = re.findall(re.escape(ADMIN_KEY_SHOWN) + r"\s+(fk-[A-Za-z0-9_-]+)", log)
    return found[-1] if found else None


def first_call(env: Mapping[str, str], key: str, model: str = "fleet-small",
               timeout: float = 120.0) -> dict[str, object]:
    """One chat completion through the gateway with `key`; retried while the tier's first worker
    container starts."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello from compose"}],
                       "max_tokens": 8}).encode()
    url = f"http://127.0.0.1:{env['FLEET_GATEWAY_PORT']}/v1/chat/completions"
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def workers(env: Mapping[str, str]) -> list[str]:
    """Ids of the worker containers of this namespace (running or not)."""
    r = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL}={env['FLEET_NAMESPACE']}"],
                       env=dict(env), check=True, text=True, capture_output=True, timeout=60)
    return r.stdout.split()


def up(env: Mapping[str, str], project: str = "fleet") -> float:
    """Start the stack; returns the seconds from `up` to /readyz."""
    t0 = time.monotonic()
    compose(env, project, "up", "-d", "--no-build")
    wait_ready(env)
    return time.monotonic() - t0


def down(env: Mapping[str, str], project: str = "fleet", volumes: bool = False) -> None:
    """The scaler first (so it starts nothing more), then its worker containers (SIGTERM: they drain;
    killed after 30 s), then the rest of the stack."""
    compose(env, project, "stop", "-t", "30", "scaler", check=False)
    if ids := workers(env):
        subprocess.run(["docker", "stop", "-t", "30", *ids], env=dict(env), capture_output=True, timeout=120)
        subprocess.run(["docker", "rm", "-f", *ids], env=dict(env), capture_output=True, timeout=120)
    compose(env, project, "down", "-t", "30", *(["-v"] if volumes else []))
    (ROOT / ".docker" / f"compose-{project}.yml").unlink(missing_ok=True)


def _up() -> None:
    """The daemon, the images, the stack; then /readyz and a first call, printed with how to repeat it."""
    host = dockerhost.resolve()
    print(f"DOCKER_HOST={host}")
    dockerhost.images(host)
    env = stack_env(host)
    took = up(env)
    port = env["FLEET_GATEWAY_PORT"]
    print(f"the gateway answers /readyz at http://127.0.0.1:{port} ({took:.1f} s after up)")
    key = admin_key(env) or os.environ.get("FLEET_API_KEY")
    if key is None:
        print("the admin key was made and shown on the stack's first start (its log then); make another with\n"
              f"  DOCKER_HOST={host} docker-compose -p fleet -f .docker/compose-fleet.yml exec gateway "
              "fleet keys add NAME --admin\nand set FLEET_API_KEY to it to have the first call made here")
        return
    print(f"admin key (made on the stack's first start, shown this once; only its sha256 is stored):\n  {key}\n"
          f"  export FLEET_API_KEY={key}   # fleet status, fleet prewarm; HTTP: -H 'Authorization: Bearer {key}'")
    reply = first_call(env, key)
    body = '{"model": "fleet-small", "messages": [{"role": "user", "content": "hello from compose"}]}'
    print(f"first call: curl http://127.0.0.1:{port}/v1/chat/completions -H \"Authorization: Bearer $FLEET_API_KEY\" "
          f"-H 'Content-Type: application/json' -d '{body}'")
    print(json.dumps(reply, indent=2))
    print(f"worker containers: DOCKER_HOST={host} docker ps --filter label={LABEL}={env['FLEET_NAMESPACE']}")


def _down() -> None:
    """The stack, then the daemon only when it is this checkout's private one: a daemon the user
    runs (DOCKER_HOST, /var/run/docker.sock) serves more than this stack and stays up."""
    host = dockerhost.resolve()
    down(stack_env(host))
    print(f"no worker container left: {not workers(stack_env(host))}")
    if host == dockerhost.PRIVATE_HOST:
        dockerhost.stop_private()
    else:
        print(f"the daemon at {host} is not this checkout's own: left running")


def main(argv: list[str]) -> int:
    return dockerhost.dispatch(argv, {"up": _up, "down": _down}, "up", __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
