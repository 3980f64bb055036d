"""The compose stack on a real Docker Engine, for the container tests.

The daemon is found or started by scripts/dockerhost.py (as `make compose-up` does: DOCKER_HOST,
/var/run/docker.sock, else a private dockerd installed with apt), the images are built when
missing (cached by content), and the stack runs docker-compose.yml with docker-compose.cpu.yml
on free ports, in a namespace and compose project of its own, with tests/fleet-containers.yaml.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import orjson
import redis

from fleet.redis_server import free_port
from fleet.store.keys import TierKeys

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import compose  # noqa: E402
import dockerhost  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "fleet-containers.yaml"
LABEL = "fleet.replica"


@dataclass
class Stack:
    host: str
    env: dict[str, str]
    project: str
    up_s: float = 0.0
    admin_key: str | None = None  # the one the gateway made on its first start (from its log)
    client: Any = field(init=False)
    r: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.client = docker.DockerClient(base_url=self.host, timeout=120)
        self.r = redis.Redis.from_url(self.redis_url, socket_timeout=10)

    @property
    def namespace(self) -> str:
        return self.env["FLEET_NAMESPACE"]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.env['FLEET_REDIS_PORT']}/0"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.env['FLEET_GATEWAY_PORT']}"

    def keys(self, tier: str) -> TierKeys:
        return TierKeys(self.namespace, tier)

    def workers(self, tier: str | None = None, *, all_states: bool = False) -> dict[str, dict[str, Any]]:
        """Worker containers of this namespace (running ones unless all_states), by replica id: the
        daemon's list entries (Id, Labels, State), read in one call (a container can go at any time)."""
        labels = [f"{LABEL}.namespace={self.namespace}"] + ([f"{LABEL}.tier={tier}"] if tier else [])
        return {c["Labels"][f"{LABEL}.id"]: c
                for c in self.client.api.containers(all=all_states, filters={"label": labels})}

    def heartbeats(self, tier: str) -> dict[str, dict[str, Any]]:
        now = time.time()
        beats = {k.decode(): orjson.loads(v) for k, v in self.r.hgetall(self.keys(tier).replicas).items()}
        return {k: b for k, b in beats.items() if now - b["ts"] < 5.0}

    def ready(self, tier: str) -> set[str]:
        return {k for k, b in self.heartbeats(tier).items() if b["state"] == "ready"}

    def counters(self, tier: str) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys(tier).counters).items()}

    def decisions(self, tier: str, since: float = 0.0) -> list[dict[str, str]]:
        out = []
        for _, fields in self.r.xrange(self.keys(tier).decisions):
            e = {k.decode(): v.decode() for k, v in fields.items()}
            if float(e["at"]) >= since:
                out.append(e)
        return out

    def compose(self, *args: str, timeout: float = 300) -> str:
        return compose.compose(self.env, self.project, *args, timeout=timeout).stdout

    def service(self, name: str) -> Any:
        (c,) = self.client.containers.list(all=True, filters={"label": [f"com.docker.compose.project={self.project}",
                                                                        f"com.docker.compose.service={name}"]})
        return c

    def down(self) -> None:
        compose.down(self.env, self.project, volumes=True)


def start_stack(tmp: Path, config: Path = CONFIG) -> Stack:
    """Daemon, images, config folder (`config` as its fleet.yaml), `up` and /readyz (raises if any
    of them fails)."""
    host = dockerhost.resolve()
    t0 = time.monotonic()
    dockerhost.images(host)
    print(f"\nimages ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    cfg_dir = tmp / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, cfg_dir / "fleet.yaml")
    cfg_dir.chmod(0o755)
    (cfg_dir / "fleet.yaml").chmod(0o644)
    ns = f"c{uuid.uuid4().hex[:8]}"
    env = compose.stack_env(host, {
        "FLEET_REDIS_PORT": str(free_port()), "FLEET_GATEWAY_PORT": str(free_port()),
        "FLEET_GATEWAY_METRICS_PORT": str(free_port()), "FLEET_SCALER_METRICS_PORT": str(free_port()),
        "FLEET_NAMESPACE": ns, "FLEET_CONFIG_DIR": str(cfg_dir)})
    s = Stack(host, env, project=f"fleet{ns}")
    try:
        s.up_s = compose.up(env, s.project)
    except Exception:
        s.down()
        raise
    s.admin_key = compose.admin_key(env, s.project)
    print(f"compose up to /readyz: {s.up_s:.1f} s", file=sys.stderr)
    return s
