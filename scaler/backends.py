"""Where replicas run: local processes (the default) or Docker containers on a GPU box.

A backend only starts, signals and checks replicas; the supervisor decides
when. Both drain with SIGTERM (the worker stops claiming, finishes what it
holds, exits) and kill only when told to after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from fleet import __version__
from scaler.placement import cuda_visible_devices

LABEL = "fleet.replica"  # label prefix: .namespace, .tier, .id, .version (model), .software, .image, .gpus


@dataclass
class Supervised:
    """A replica the supervisor started, as stored in `TierKeys.supervised`."""

    id: str
    tier: str
    backend: str
    launched: float  # epoch seconds
    gpus: tuple[int, ...] = ()
    gpu_gb: float = 0.0
    pid: int | None = None
    container: str | None = None
    host: str = ""
    state: str = "starting"  # starting | ready | parked | draining | stopping (killed; gone at the next poll)
    ready_at: float | None = None
    drain_at: float | None = None
    parked_at: float | None = None  # parked (SIGUSR1: up and warm, claiming nothing) since
    exit_code: int | None = field(default=None, compare=False)
    version: str = ""  # the model version it was started at ("" : the registry's live one then)

    def dumps(self) -> bytes:
        d = asdict(self)
        d.pop("exit_code")
        return orjson.dumps(d)

    @classmethod
    def loads(cls, raw: bytes | str) -> Supervised:
        d: dict[str, Any] = orjson.loads(raw)
        d["gpus"] = tuple(d.get("gpus") or ())
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class Backend(Protocol):
    name: str

    def launch(self, rec: Supervised) -> None:
        """Start the replica; fills in rec.pid or rec.container and rec.host."""

    def alive(self, rec: Supervised) -> bool: ...

    def terminate(self, rec: Supervised) -> None:
        """SIGTERM: drain."""

    def kill(self, rec: Supervised) -> None: ...

    def signal(self, rec: Supervised, sig: int) -> None:
        """Send `sig` to the replica: SIGUSR1 parks it, SIGUSR2 resumes it."""

    def cleanup(self, rec: Supervised) -> None:
        """After it exited: reap the process or remove the container; sets rec.exit_code."""

    def adopt(self, rec: Supervised) -> bool:
        """A record left by an earlier leader: True if this backend can still reach it running."""

    def discover(self, namespace: str) -> list[Supervised]:
        """Replicas of this namespace found running that no record names (Docker labels)."""


class LocalBackend:
    """Worker replicas as child processes: `python -m fleetctl worker --tier T --replica-id ID`."""

    name = "local"

    def __init__(self, env: dict[str, str], *, engine: str | None = None, cwd: str | None = None) -> None:
        self.env = env
        self.engine = engine
        self.cwd = cwd
        self.host = socket.gethostname()
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def command(self, rec: Supervised) -> list[str]:
        return [sys.executable, "-m", "fleetctl", "worker", "--tier", rec.tier, "--replica-id", rec.id,
                *(["--engine", self.engine] if self.engine else []),
                *(["--model-version", rec.version] if rec.version else [])]

    def launch(self, rec: Supervised) -> None:
        env = dict(self.env)
        if rec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(rec.gpus)
        p = subprocess.Popen(self.command(rec), env=env, cwd=self.cwd)
        self.children[rec.id] = p
        rec.pid, rec.host = p.pid, self.host

    def alive(self, rec: Supervised) -> bool:
        p = self.children.get(rec.id)
        if p is not None:
            return p.poll() is None
        return rec.pid is not None and _pid_runs(rec.pid, rec.id)

    def _signal(self, rec: Supervised, sig: int) -> None:
        p = self.children.get(rec.id)
        with contextlib.suppress(ProcessLookupError):
            if p is not None:
                if p.poll() is None:
                    p.send_signal(sig)
            elif rec.pid is not None and _pid_runs(rec.pid, rec.id):
                os.kill(rec.pid, sig)

    def terminate(self, rec: Supervised) -> None:
        self._signal(rec, signal.SIGTERM)

    def kill(self, rec: Supervised) -> None:
        self._signal(rec, signal.SIGKILL)

    def signal(self, rec: Supervised, sig: int) -> None:
        self._signal(rec, sig)

    def cleanup(self, rec: Supervised) -> None:
        p = self.children.pop(rec.id, None)
        if p is not None:
            rec.exit_code = p.wait()

    def adopt(self, rec: Supervised) -> bool:
        # A pid means something only on the host that started it.
        return rec.host == self.host and self.alive(rec)

    def discover(self, namespace: str) -> list[Supervised]:
        return []


def _pid_runs(pid: int, replica_id: str) -> bool:
    """The process is alive and is that replica (pids get reused)."""
    if Path("/proc/self").exists():
        try:
            return replica_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()  # a zombie's is empty
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def container_spec(namespace: str, image: str, rec: Supervised, env: dict[str, str], *,
                   network: str | None = None, engine: str | None = None,
                   volumes: list[str] | None = None, metrics_port: int | None = None) -> dict[str, Any]:
    """The arguments of `docker.containers.run` for one replica (pure, so it is testable without a daemon).

    The GPUs go in as a device request: the container sees only those, so
    CUDA_VISIBLE_DEVICES inside is left to the NVIDIA runtime. The labels let
    a restarted scaler find its containers again. `volumes` are Docker's
    "HOST:CONTAINER[:ro]" binds: the weights and the operator's config must
    reach the replica, not only the scaler. With `metrics_port` the replica serves its Prometheus
    metrics there, named in the label `fleet.replica.metrics_port` for Docker service discovery
    (configs/prometheus.yml).
    """
    spec: dict[str, Any] = {
        "image": image,
        "command": ["fleet", "worker", "--tier", rec.tier, "--replica-id", rec.id,
                    *(["--engine", engine] if engine else []),
                    *(["--model-version", rec.version] if rec.version else []),
                    *(["--metrics-port", str(metrics_port), "--metrics-host", "0.0.0.0"] if metrics_port else [])],
        "name": f"{namespace}-{rec.id}",
        "detach": True,
        "environment": env,
        "labels": {f"{LABEL}.namespace": namespace, f"{LABEL}.tier": rec.tier, f"{LABEL}.id": rec.id,
                   f"{LABEL}.version": rec.version, f"{LABEL}.software": __version__, f"{LABEL}.image": image,
                   f"{LABEL}.gpus": cuda_visible_devices(rec.gpus), f"{LABEL}.gpu_gb": str(rec.gpu_gb)},
        # Drain takes as long as the longest stream; the supervisor kills after its own grace.
        "stop_signal": "SIGTERM",
        # vLLM's engine talks to its core through shared memory (more than Docker's 64 MiB /dev/shm),
        # and tensor parallelism needs it across processes: the host's IPC, as compose's static worker.
        "ipc_mode": "host",
    }
    if metrics_port:
        spec["labels"][f"{LABEL}.metrics_port"] = str(metrics_port)
    if rec.gpus:
        from docker.types import DeviceRequest

        spec["device_requests"] = [DeviceRequest(device_ids=[str(i) for i in rec.gpus], capabilities=[["gpu"]])]
    if network:
        spec["network"] = network
    if volumes:
        spec["volumes"] = list(volumes)
    return spec


class DockerBackend:
    """Worker replicas as containers of the worker image, through the Docker SDK."""

    name = "docker"

    def __init__(self, namespace: str, image: str, env: dict[str, str], *, network: str | None = None,
                 engine: str | None = None, volumes: list[str] | None = None, client: Any = None,
                 metrics_port: int | None = None) -> None:
        if client is None:
            import docker

            client = docker.from_env()
        self.client = client
        self.namespace = namespace
        self.image = image
        self.env = env
        self.network = network
        self.engine = engine
        self.volumes = volumes or []
        self.metrics_port = metrics_port
        self.host = socket.gethostname()

    def _get(self, rec: Supervised) -> Any:
        from docker.errors import NotFound

        try:
            c = self.client.containers.get(rec.container or f"{self.namespace}-{rec.id}")
        except NotFound:
            return None
        return c

    def _metrics_port(self) -> int | None:
        """On its own network every replica serves metrics on the same port; on the host's network
        each needs one of its own (the scaler shares that network, so a port free here is free there)."""
        if not self.metrics_port or self.network != "host":
            return self.metrics_port
        from fleet.redis_server import free_port

        return free_port()

    def launch(self, rec: Supervised) -> None:
        c = self.client.containers.run(**container_spec(self.namespace, self.image, rec, self.env,
                                                        network=self.network, engine=self.engine,
                                                        volumes=self.volumes, metrics_port=self._metrics_port()))
        rec.container, rec.host = c.id, self.host

    def alive(self, rec: Supervised) -> bool:
        c = self._get(rec)
        return c is not None and c.status in ("created", "running", "restarting")

    def terminate(self, rec: Supervised) -> None:
        if (c := self._get(rec)) is None:
            return
        if c.status == "running":
            c.kill(signal="SIGTERM")
        elif c.status != "exited":  # never got to run (created) or is looping: nothing to drain
            c.remove(force=True)

    def signal(self, rec: Supervised, sig: int) -> None:
        if (c := self._get(rec)) is not None and c.status == "running":
            c.kill(signal=signal.Signals(sig).name)

    def kill(self, rec: Supervised) -> None:
        if (c := self._get(rec)) is None:
            return
        if c.status == "running":
            c.kill()
        elif c.status != "exited":
            # created, restarting, paused: kill does not apply (or does not stick) and the
            # container would count as alive for ever. Remove it; `alive` then says gone.
            c.remove(force=True)

    def cleanup(self, rec: Supervised) -> None:
        if (c := self._get(rec)) is not None:
            rec.exit_code = c.attrs.get("State", {}).get("ExitCode")
            c.remove(force=True)

    def adopt(self, rec: Supervised) -> bool:
        return self.alive(rec)

    def discover(self, namespace: str) -> list[Supervised]:
        found = []
        for c in self.client.containers.list(filters={"label": f"{LABEL}.namespace={namespace}"}):
            lab = c.labels
            gpus = tuple(int(g) for g in lab.get(f"{LABEL}.gpus", "").split(",") if g)
            found.append(Supervised(id=lab[f"{LABEL}.id"], tier=lab[f"{LABEL}.tier"], backend=self.name,
                                    launched=0.0, gpus=gpus, gpu_gb=float(lab.get(f"{LABEL}.gpu_gb", 0) or 0),
                                    container=c.id, host=self.host, state="ready",
                                    version=lab.get(f"{LABEL}.version", "")))
        return found
