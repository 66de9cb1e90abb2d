"""GPU-hours: the one definition used by accounting, reports and simulation.

GPU-hours = wall hours x the fraction of a GPU held, summed over the job's GPUs, where the
fraction is 1 for an exclusive GPU, slices/7 for a MIG instance, and for a shared GPU
max(memory / total memory, cores / 100).

A shared grant is billed for what it can use. Under MPS a grant that names no `cores` is held
to its memory share of the SMs (`sm_share_pct`, which the device plugin hands MPS clients as
their active-thread limit), so its memory share is what it can use. A time-sliced grant has no
SM limit at all (nothing can cap it): it can take the whole GPU, and is billed and counted as
one. See docs/concepts.md (Billing).
"""

from __future__ import annotations

import math

from carpool.core.resources import MIG_SLICES_PER_GPU, GpuGrant, Isolation


def sm_share_pct(cores_pct: int, memory_mib: int, memory_total_mib: int) -> int:
    """The SM percentage a shared grant is held to: `cores` when the job set it, otherwise its
    memory share rounded up to a whole percent (at least 1, at most 100)."""
    if cores_pct > 0:
        return min(100, cores_pct)
    if memory_total_mib <= 0:
        return 100
    return max(1, min(100, math.ceil(memory_mib * 100 / memory_total_mib)))


def gpu_fraction(grant: GpuGrant, memory_total_mib: int, mig_slices: int = 0,
                 isolation: Isolation | None = None) -> float:
    """The share of one GPU a grant holds, in [0, 1]; `isolation` is the job's (None: MPS)."""
    if grant.exclusive or isolation is Isolation.TIMESLICE:
        return 1.0
    if grant.mig_instance:
        return min(1.0, mig_slices / MIG_SLICES_PER_GPU)
    memory_share = grant.memory_mib / memory_total_mib if memory_total_mib > 0 else 0.0
    return min(1.0, max(memory_share, grant.cores_pct / 100))


def gpu_hours(fraction_sum: float, start: float, end: float) -> float:
    """GPU-hours for holding `fraction_sum` GPUs from `start` to `end` (epoch seconds)."""
    return max(0.0, end - start) / 3600.0 * fraction_sum
