"""GPU room: which GPUs a replica of a tier fits on, and how many more fit. Pure; no I/O.

A tier declares `gpus_per_replica` and `gpu_memory_gb` (memory needed on EACH of
those GPUs). The live scaler's placement (`scaler.placement`) books replicas on
the box's inventory with these functions, and the simulator books its replicas
on the scenario's `gpus:` with the same ones, so both see the same room.
"""

from __future__ import annotations

from collections.abc import Mapping


def best_fit(free_gb: Mapping[int, float], gpus: int, gb: float) -> tuple[int, ...] | None:
    """The GPUs (by index) a replica needing `gb` on each of `gpus` GPUs goes on; None when
    it fits nowhere. Best fit: the fullest GPUs that still hold it, so large holes stay
    free for large replicas (a planner needs two GPUs with 70 GB each)."""
    fits = sorted((f, i) for i, f in free_gb.items() if f + 1e-9 >= gb)
    if len(fits) < gpus:
        return None
    return tuple(sorted(i for _, i in fits[:gpus]))


def room_for(free_gb: Mapping[int, float], gpus: int, gb: float, limit: int = 1000) -> int:
    """How many more such replicas fit in `free_gb`, placed one after another by `best_fit`."""
    free, n = dict(free_gb), 0
    while n < limit and (chosen := best_fit(free, gpus, gb)) is not None:
        for i in chosen:
            free[i] -= gb
        n += 1
    return n
