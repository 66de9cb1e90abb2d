"""How much GPU memory a kind of job really needs: the peaks its finished runs reached
(the device plugin measures each pod's peak per GPU) against what they asked for.

Users ask for far more GPU memory than they use; what they asked for is what the GPUs hold
back from everyone else. Per project and job template (`jobs.job_template`: its image, or its
name without a trailing number), once a few runs have finished, the advice is the runs' 90th
percentile peak with a fifth more as headroom, in whole GiB, shown where it is below what the
runs usually ask for.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

from carpool.core.resources import GpuRequest, Isolation

MIN_SAMPLES = 3  # finished runs of a template before its peaks say anything
PEAK_QUANTILE = 0.9
HEADROOM = 1.2
MIB_PER_GIB = 1024


@dataclass(frozen=True)
class SizeAdvice:
    """What the finished runs of one project's template asked for and used, per GPU."""

    project: str
    template: str
    runs: int
    requested_mib: int  # the median request
    peak_mib: int  # the PEAK_QUANTILE peak
    recommended_mib: int

    @property
    def spare_mib(self) -> int:
        """GPU memory a run of it holds back and does not use, per GPU."""
        return self.requested_mib - self.recommended_mib


def high_peak(peaks: Iterable[int]) -> int | None:
    """The PEAK_QUANTILE peak (nearest rank); None with fewer than MIN_SAMPLES."""
    ordered = sorted(peaks)
    if len(ordered) < MIN_SAMPLES:
        return None
    return ordered[min(len(ordered) - 1, math.ceil(PEAK_QUANTILE * len(ordered)) - 1)]


def recommended(peaks: Iterable[int], step: int) -> int | None:
    """The request the peaks call for, in whole `step`s (None: fewer than MIN_SAMPLES)."""
    peak = high_peak(peaks)
    return None if peak is None else max(1, math.ceil(peak * HEADROOM / step)) * step


def recommended_mib(peaks: Iterable[int]) -> int | None:
    """The memory request the peaks (MiB) call for, in whole GiB."""
    return recommended(peaks, MIB_PER_GIB)


def calibrated(request: GpuRequest, memory_mib: int | None, cores_pct: int | None
               ) -> GpuRequest:
    """`request` placed by its calibrated size: memory and cores lowered to the
    recommendations where they are below what it asks (never raised). The watchdog fences a
    job that then outgrows it; it runs again as asked."""
    if request.isolation is not Isolation.MPS:
        return request  # whole GPUs and MIG instances come in fixed sizes
    memory = request.memory_mib if memory_mib is None else min(request.memory_mib, memory_mib)
    cores = request.cores_pct if cores_pct is None or request.cores_pct == 0 else min(
        request.cores_pct, cores_pct)
    if (memory, cores) == (request.memory_mib, request.cores_pct):
        return request
    return replace(request, memory_mib=memory, cores_pct=cores)


def size_advice(runs: Iterable[tuple[str, str, int, int]]) -> list[SizeAdvice]:
    """Advice per (project, template) from finished runs as (project, template, requested
    MiB, peak MiB) per GPU, where it is below the usual request; most spare memory first."""
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for project, template, asked, used in runs:
        groups.setdefault((project, template), []).append((asked, used))
    out = []
    for (project, template), samples in groups.items():
        high = high_peak(p for _, p in samples)
        recommended = recommended_mib(p for _, p in samples)
        requested = int(statistics.median(r for r, _ in samples))
        if high is None or recommended is None or recommended >= requested:
            continue
        out.append(SizeAdvice(project, template, len(samples), requested, high, recommended))
    return sorted(out, key=lambda a: (-a.spare_mib, a.project, a.template))
