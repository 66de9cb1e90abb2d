"""How much GPU memory a kind of job really needs: the peaks its finished runs reached
(the device plugin measures each pod's peak per GPU) against what they asked for.

Users ask for far more GPU memory than they use; what they asked for is what the GPUs hold
back from everyone else. Per project and job template (`jobs.job_template`: its image, or its
name without a trailing number), once a few runs have finished, the advice is the runs' 90th
percentile peak with a fifth more as headroom, in whole GiB, shown where it is below what the
runs usually ask for.

Where a ProjectQuota sets `spec.rightSizing.placePreemptible`, its waiting preemptible
one-pod MPS jobs are placed by that size (`placement_request`): the pod is created with the
calibrated limits and the operator's planned assignment, which the extender accepts below the
spec (`ownership.placed_below_spec`). MPS fences the run at that size; a run so placed that
fails is taken to have outgrown it (`lifecycle.observe`) and runs again as asked, never
calibrated again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from carpool.core.jobs import Job, ProjectQuota
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, Isolation, Phase

MIN_SAMPLES = 3  # finished runs of a template before its peaks say anything
PEAK_QUANTILE = 0.9
HEADROOM = 1.2
MIB_PER_GIB = 1024
# a whole-GPU job is placed as a share only where its calibrated size leaves at least a
# quarter of the GPU to others: nearer a whole GPU, it would give up the GPU for nothing
SHARED_AT_MOST = 0.75


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


def calibrated(request: GpuRequest, memory_mib: int | None, cores_pct: int | None,
               whole_gpus: bool = False, gpu_memory_mib: int = 0) -> GpuRequest:
    """`request` placed by its calibrated size: memory and cores lowered to the
    recommendations where they are below what it asks (never raised). The watchdog fences a
    job that then outgrows it; it runs again as asked.

    With `whole_gpus`, a one-GPU exclusive request becomes an MPS share of its calibrated
    size (`shared_whole_gpu`); other whole GPUs and MIG instances come in fixed sizes."""
    if whole_gpus and (shared := shared_whole_gpu(request, memory_mib, cores_pct,
                                                  gpu_memory_mib)):
        return shared
    if request.isolation is not Isolation.MPS:
        return request
    memory = request.memory_mib if memory_mib is None else min(request.memory_mib, memory_mib)
    cores = request.cores_pct if cores_pct is None or request.cores_pct == 0 else min(
        request.cores_pct, cores_pct)
    if (memory, cores) == (request.memory_mib, request.cores_pct):
        return request
    return replace(request, memory_mib=memory, cores_pct=cores)


def shared_whole_gpu(request: GpuRequest, memory_mib: int | None, cores_pct: int | None,
                     gpu_memory_mib: int = 0) -> GpuRequest | None:
    """A one-GPU exclusive request as an MPS client of its calibrated size: memory (whole
    GiB; 0 where only cores were measured) and cores (0: no compute cap) from the
    recommendations, each where it is at most SHARED_AT_MOST of the GPU (memory: of
    `gpu_memory_mib`, the smallest GPU it may get, and below the GPU memory the request
    names, if it names any); None where neither is. It then shares the GPU's SMs with other
    clients, fenced by MPS at that memory and by the watchdog, and may borrow lent
    capacity."""
    if request.isolation is not Isolation.EXCLUSIVE or request.count != 1:
        return None
    cores = cores_pct if cores_pct is not None and 0 < cores_pct <= 100 * SHARED_AT_MOST else 0
    memory = memory_mib if memory_mib is not None and memory_mib > 0 else 0
    if memory > SHARED_AT_MOST * gpu_memory_mib or (request.memory_mib
                                                    and memory >= request.memory_mib):
        memory = 0
    if not memory and not cores:
        return None
    return replace(request, isolation=Isolation.MPS, memory_mib=memory, cores_pct=cores)


def placement_request(job: Job, quota: ProjectQuota | None, memory_mib: int | None,
                      cores_pct: int | None, gpu_memory_mib: int = 0) -> GpuRequest:
    """What a job is placed by: its calibrated size (`calibrated`, from the recommendations
    given) where its project places preemptible jobs so, it is a waiting preemptible one-pod
    job and no run of it outgrew that size; else what it asks. A one-GPU whole-GPU job is
    placed as an MPS share of that size only where its project also shares whole GPUs
    (`ProjectQuota.share_whole_gpus`; `gpu_memory_mib`: the smallest GPU it may get)."""
    if (quota is None or not quota.place_calibrated or not job.preemptible or job.workers
            or not job.waiting or job.calibration_outgrown):
        return job.request
    return calibrated(job.request, memory_mib, cores_pct, quota.share_whole_gpus,
                      gpu_memory_mib)


def placement_floor(placed: GpuRequest, asked: GpuRequest) -> GpuRequest | None:
    """The least a job placed by its calibrated size (`placed`, from `placement_request`)
    may be granted where no piece of a GPU holds that size: each lowered amount at the peak
    its recommendation was made from, without the fifth of headroom (rounded up: memory in
    whole GiB, cores in whole per cent); None where it is placed as asked. The headroom
    covers runs that peak above their template's 90th percentile; a run given less is fenced
    by the watchdog as any calibrated run is, and runs again as asked."""
    if placed == asked or placed.isolation is not Isolation.MPS:
        return None
    memory, cores = placed.memory_mib, placed.cores_pct
    if memory > 0 and (asked.isolation is not Isolation.MPS or memory < asked.memory_mib):
        memory = _without_headroom(memory, MIB_PER_GIB)
    if cores > 0 and (asked.isolation is not Isolation.MPS or cores < asked.cores_pct):
        cores = _without_headroom(cores, 1)
    floor = replace(placed, memory_mib=memory, cores_pct=cores)
    return None if floor == placed else floor


def _without_headroom(size: int, step: int) -> int:
    """The peak a recommended `size` was made from (`recommended`), in whole `step`s, up."""
    return max(step, math.ceil(size / HEADROOM / step) * step)


def pod_request(request: GpuRequest, grants: Sequence[GpuGrant]) -> GpuRequest:
    """What a one-pod job's pod asks for, from the grants its admission chose: its spec's
    request, or that request at the grants' lower memory where the admission placed it by
    its calibrated size (`placement_request`); a whole-GPU job granted a share of its GPU
    (`shared_whole_gpu`) as the MPS client of that share."""
    if (request.isolation is Isolation.EXCLUSIVE and request.count == 1 and len(grants) == 1
            and not grants[0].exclusive and not grants[0].mig_instance
            and grants[0].memory_mib > 0):
        return replace(request, isolation=Isolation.MPS, memory_mib=grants[0].memory_mib,
                       cores_pct=grants[0].cores_pct)
    if request.isolation is not Isolation.MPS or not grants:
        return request
    memory = max(g.memory_mib for g in grants)
    return replace(request, memory_mib=memory) if 0 < memory < request.memory_mib else request


def calibrated_sizes(jobs: Iterable[Job]) -> dict[tuple[str, str], int]:
    """The recommended memory per (project, template), from the peak GPU memory of the
    finished runs listed (Succeeded jobs; the device plugin's measure), where enough ran."""
    peaks: dict[tuple[str, str], list[int]] = {}
    for job in jobs:
        if job.phase is Phase.SUCCEEDED and job.peak_memory_mib and job.template:
            peaks.setdefault((job.project, job.template), []).append(job.peak_memory_mib)
    return {key: size for key, samples in peaks.items()
            if (size := recommended_mib(samples)) is not None}


def smallest_gpus(gpus: Iterable[Gpu]) -> dict[str, int]:
    """The smallest GPU memory (MiB) of each model among `gpus`."""
    out: dict[str, int] = {}
    for gpu in gpus:
        out[gpu.model] = min(out.get(gpu.model, gpu.memory_total_mib), gpu.memory_total_mib)
    return out


def smallest_for(request: GpuRequest, smallest: Mapping[str, int]) -> int:
    """The smallest GPU memory a job may get, from `smallest_gpus` (0: no GPU it may get)."""
    return min((m for model, m in smallest.items() if request.allows_model(model)), default=0)


def with_calibrated(jobs: Sequence[Job], quotas: Mapping[str, ProjectQuota],
                    sizes: Mapping[tuple[str, str], int] | None = None,
                    smallest: Mapping[str, int] | None = None) -> list[Job]:
    """The jobs, each waiting one with its request as `placement_request` places it, from
    `sizes` (`calibrated_sizes` of the jobs when not given) and the cluster's smallest GPU
    of each model (`smallest_gpus`; none: no whole-GPU job is shared)."""
    if not any(q.place_calibrated for q in quotas.values()):
        return list(jobs)
    sizes = calibrated_sizes(jobs) if sizes is None else sizes
    out = []
    for job in jobs:
        size = sizes.get((job.project, job.template))
        if job.waiting and size is not None:
            request = placement_request(job, quotas.get(job.project), size, None,
                                        smallest_for(job.request, smallest or {}))
            if request != job.request:
                job = replace(job, request=request,
                              placement_floor=placement_floor(request, job.request))
        out.append(job)
    return out


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
