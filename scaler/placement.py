"""CUDA-aware placement: which GPUs a new replica goes on, and how many more fit.

The inventory comes from NVML when the box has NVIDIA GPUs (nvidia-ml-py,
imported lazily: a laptop or CI has no driver), else from the config's `gpus:`
list. Each tier declares `gpus_per_replica` and `gpu_memory_gb` (memory needed
on EACH of those GPUs). The supervisor books memory per replica here and
frees it when the replica is gone, so placement never oversubscribes a GPU
whatever the engines do with their memory at the moment. The fitting itself is
the policy's (`fleet.policy.gpu_room`), which the simulator books with too.

No inventory at all (no NVML, empty `gpus:`) means nothing to place on: the
replicas run without GPUs (the `sim` engine), with no GPU limit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.config import GpuInventory
from fleet.policy.gpu_room import best_fit, room_for

log = logging.getLogger("fleet.scaler.placement")


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    memory_gb: float


def nvml_gpus() -> list[Gpu]:
    """The GPUs NVML sees, with their total memory; [] when NVML or a driver is absent."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPUs here
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            out.append(Gpu(i, mem.total / 1e9))
        return out
    finally:
        pynvml.nvmlShutdown()


def discover(configured: Sequence[GpuInventory]) -> tuple[list[Gpu], str]:
    """The inventory and where it came from: "nvml", "config" or "none"."""
    found = nvml_gpus()
    if found:
        return found, "nvml"
    if configured:
        return [Gpu(g.index, g.memory_gb) for g in configured], "config"
    return [], "none"


@dataclass
class Placement:
    """Memory booked per GPU by the replicas the supervisor placed."""

    gpus: list[Gpu]
    booked: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)  # replica -> (gpus, gb each)

    def constrained(self, gpus_per_replica: int) -> bool:
        return bool(self.gpus) and gpus_per_replica > 0

    def free_gb(self) -> dict[int, float]:
        free = {g.index: g.memory_gb for g in self.gpus}
        for idx, gb in self.booked.values():
            for i in idx:
                if i in free:
                    free[i] -= gb
        return free

    def place(self, replica_id: str, gpus_per_replica: int, gb: float) -> tuple[int, ...] | None:
        """Book GPUs for a replica; () when no GPU is needed or known; None when nothing fits."""
        if not self.constrained(gpus_per_replica):
            return ()
        chosen = best_fit(self.free_gb(), gpus_per_replica, gb)
        if chosen is not None:
            self.booked[replica_id] = (chosen, gb)
        return chosen

    def book(self, replica_id: str, gpus: Sequence[int], gb: float) -> None:
        """Re-book a replica found running (a new leader adopting the old one's replicas)."""
        if gpus:
            self.booked[replica_id] = (tuple(gpus), gb)

    def release(self, replica_id: str) -> None:
        self.booked.pop(replica_id, None)

    def room(self, gpus_per_replica: int, gb: float, limit: int = 1000) -> int | None:
        """How many more replicas of this shape fit now; None when unconstrained."""
        if not self.constrained(gpus_per_replica):
            return None
        return room_for(self.free_gb(), gpus_per_replica, gb, limit)


def cuda_visible_devices(gpus: Sequence[int]) -> str:
    return ",".join(str(i) for i in gpus)
