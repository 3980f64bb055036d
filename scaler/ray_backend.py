"""Replicas on a Ray cluster (`fleet scaler --backend ray --ray-address ADDR`).

Each replica is a named, detached Ray actor that owns one worker process
(`python -m fleetctl worker ...`). The actor asks Ray for the tier's
`gpus_per_replica` as `num_gpus`, so Ray picks the node and the GPUs and sets
CUDA_VISIBLE_DEVICES, which the worker process inherits. Placement is Ray's:
the scaler's own GPU inventory is not used with this backend (a launch that no
node can take fails after `PLACE_TIMEOUT_S`, reported as launch_failed).

- Drain: the actor sends the worker SIGTERM; the worker finishes what it holds
  and exits; the next poll sees it gone and removes the actor.
- A node that dies takes its actors and their workers with it (the worker is
  started with a parent-death signal, so it cannot outlive its actor). The
  next poll finds the actor dead and reports the replica died; the scaler
  starts a replacement, which Ray places on a node that has room, and the
  line's reaper requeues what the dead worker held when its leases expire.
- Adoption: actors are named by replica id in the Ray namespace
  `fleet-<namespace>` and detached (they outlive the scaler's driver), so a
  restarted scaler finds them by name from its records, and lists the
  namespace for any it has no record of.

Ray itself is an extra (`pip install '.[ray]'`); this module is imported only
with `--backend ray`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any
from urllib.parse import urlsplit

from scaler.backends import Supervised

log = logging.getLogger("fleet.scaler.ray")

PLACE_TIMEOUT_S = 60.0  # how long a launch waits for Ray to place the actor and start its worker
CALL_TIMEOUT_S = 1.0  # a call to a live actor (the supervisor polls on its loop); past this: unknown, not dead


def _loopback(address: str) -> bool:
    host = urlsplit(f"//{address.removeprefix('ray://')}").hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def _pdeathsig() -> None:  # pragma: no cover (runs in the child between fork and exec)
    """The worker dies with the actor that started it (Linux: PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class ReplicaActor:
    """The Ray actor of one replica: starts the worker process and answers for it."""

    def __init__(self, rid: str, tier: str, command: list[str], env: dict[str, str], cwd: str | None) -> None:
        import subprocess

        import ray

        self.rid, self.tier = rid, tier
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        full = {**os.environ, **env}  # Ray's CUDA_VISIBLE_DEVICES for this actor included
        self.proc = subprocess.Popen([sys.executable, *command], env=full, cwd=cwd, preexec_fn=_pdeathsig)

    def describe(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"id": self.rid, "tier": self.tier, "pid": self.proc.pid, "node": ctx.get_node_id(),
                "gpus": self.gpus, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "exit_code": self.proc.poll()}

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


class RayBackend:
    """Replicas as Ray actors on any node of a Ray cluster."""

    name = "ray"

    def __init__(self, namespace: str, address: str, env: dict[str, str], gpus_per_replica: dict[str, int], *,
                 engine: str | None = None, cwd: str | None = None) -> None:
        if _loopback(address):
            # Ray swaps a loopback address for this machine's outward one, where a cluster
            # bound to 127.0.0.1 does not listen; this keeps it on loopback (read at import).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        self.ray = ray
        self.namespace = f"fleet-{namespace}"
        ray.init(address=address, namespace=self.namespace, log_to_driver=False, ignore_reinit_error=True,
                 configure_logging=False)
        self.actor_class = ray.remote(ReplicaActor)
        self.env = env
        self.gpus_per_replica = gpus_per_replica
        self.engine = engine
        self.cwd = cwd
        self.handles: dict[str, Any] = {}

    def _command(self, rec: Supervised) -> list[str]:
        return ["-m", "fleetctl", "worker", "--tier", rec.tier, "--replica-id", rec.id,
                *(["--engine", self.engine] if self.engine else [])]

    def _handle(self, rec: Supervised) -> Any:
        h = self.handles.get(rec.id)
        if h is None:
            try:
                h = self.handles[rec.id] = self.ray.get_actor(rec.id, namespace=self.namespace)
            except ValueError:  # no such actor (any more)
                return None
        return h

    def _call(self, rec: Supervised, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        h = self._handle(rec)
        if h is None:
            raise LookupError(rec.id)
        return self.ray.get(getattr(h, method).remote(*args), timeout=timeout)

    def launch(self, rec: Supervised) -> None:
        """Create the actor (Ray places it), wait until its worker process runs."""
        gpus = self.gpus_per_replica.get(rec.tier, 0)
        h = self.actor_class.options(name=rec.id, namespace=self.namespace, lifetime="detached", num_cpus=0,
                                     num_gpus=gpus, max_restarts=0).remote(
            rec.id, rec.tier, self._command(rec), self.env, self.cwd)
        try:
            info = self.ray.get(h.describe.remote(), timeout=PLACE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(h, no_restart=True)
            raise RuntimeError(f"Ray placed no actor with num_gpus={gpus} within {PLACE_TIMEOUT_S:g} s "
                               "(no node has that many GPUs free)") from None
        self.handles[rec.id] = h
        rec.pid, rec.host = info["pid"], info["node"]
        rec.gpus = tuple(int(g) for g in info["gpus"] if str(g).isdigit())
        log.info("%s placed on Ray node %s (GPUs %s)", rec.id, info["node"][:12], ",".join(info["gpus"]) or "none")

    def alive(self, rec: Supervised) -> bool:
        """The actor answers and its worker runs. An actor that does not answer in time (its
        node slow, or dying but not yet declared dead) counts as alive until Ray says dead."""
        try:
            return self._call(rec, "exit_code") is None
        except self.ray.exceptions.GetTimeoutError:
            return True
        except (LookupError, self.ray.exceptions.RayActorError):
            return False

    def _signal(self, rec: Supervised, sig: int) -> None:
        with contextlib.suppress(LookupError, self.ray.exceptions.RayError):
            self._call(rec, "signal", sig)

    def terminate(self, rec: Supervised) -> None:
        import signal

        self._signal(rec, signal.SIGTERM)

    def kill(self, rec: Supervised) -> None:
        import signal

        self._signal(rec, signal.SIGKILL)

    def cleanup(self, rec: Supervised) -> None:
        """The worker exited (or its node died): read its exit code, end the actor."""
        with contextlib.suppress(LookupError, self.ray.exceptions.RayError):
            rec.exit_code = self._call(rec, "exit_code")
        h = self.handles.pop(rec.id, None) or self._handle(rec)
        self.handles.pop(rec.id, None)
        if h is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(h, no_restart=True)

    def adopt(self, rec: Supervised) -> bool:
        return self.alive(rec)

    def discover(self, namespace: str) -> list[Supervised]:
        """Actors of this namespace that no record names (a record lost, a scaler that died mid-launch)."""
        found = []
        for name in self.ray.util.list_named_actors():
            rec = Supervised(id=name, tier="", backend=self.name, launched=0.0)
            try:
                info = self._call(rec, "describe")
            except (LookupError, self.ray.exceptions.RayError):
                continue
            if info["exit_code"] is None:
                found.append(Supervised(id=name, tier=info["tier"], backend=self.name, launched=0.0,
                                        gpus=tuple(int(g) for g in info["gpus"] if str(g).isdigit()),
                                        pid=info["pid"], host=info["node"], state="ready"))
        return found
