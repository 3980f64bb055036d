"""The replay's GPUs: its replicas booked on the scenario's `gpus:` inventory, as the live
supervisor books them on the box's, with the policy's fitting (`fleet.policy.gpu_room`).

No inventory (no `gpus:`, the shipped configs' case) or a tier without GPUs
(`gpus_per_replica: 0`) means no GPU limit, as live without NVML.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.config import GpuInventory, TierConfig
from fleet.policy.gpu_room import best_fit, room_for


class SimGpus:
    def __init__(self, inventory: Sequence[GpuInventory]) -> None:
        self.memory_gb = {g.index: g.memory_gb for g in inventory}
        self.booked: dict[str, tuple[tuple[int, ...], float]] = {}  # replica id -> (gpus, gb on each)

    def constrained(self, tc: TierConfig) -> bool:
        return bool(self.memory_gb) and tc.gpus_per_replica > 0

    def free_gb(self) -> dict[int, float]:
        free = dict(self.memory_gb)
        for gpus, gb in self.booked.values():
            for i in gpus:
                free[i] -= gb
        return free

    def room(self, tc: TierConfig) -> int | None:
        """More replicas of this tier the free GPUs hold; None: no GPU limit."""
        if not self.constrained(tc):
            return None
        return room_for(self.free_gb(), tc.gpus_per_replica, tc.gpu_memory_gb)

    def place(self, replica_id: str, tc: TierConfig) -> bool:
        """Book a new replica's GPUs; False when it fits nowhere (it is not started)."""
        if not self.constrained(tc):
            return True
        chosen = best_fit(self.free_gb(), tc.gpus_per_replica, tc.gpu_memory_gb)
        if chosen is None:
            return False
        self.booked[replica_id] = (chosen, tc.gpu_memory_gb)
        return True

    def release(self, replica_id: str) -> None:
        self.booked.pop(replica_id, None)
