"""GPU-hours per job and per project, derived only from recorded run start/end times.

Every figure here is recomputed from the run records (`Job.runs`) and the retired usage of
deleted jobs; nothing is incremented in place, so recomputing after an operator restart, a
replayed event or a repeated reconcile gives the same totals and never counts a run twice.
GPU-hours follow the one definition in `carpool.core.gpuhours`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from carpool.core.estimate_ranges import retire_history
from carpool.core.fairshare import decay_factor, decayed_gpu_hours
from carpool.core.gpuhours import gpu_fraction, gpu_hours
from carpool.core.jobs import Job, ProjectQuota, ProjectUsage, RetiredUsage, RunRecord
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, Isolation, NodeInventory
from carpool.core.run_times import DURATION_LEARNING_RATE


def grants_fraction(grants: Iterable[GpuGrant], inventory: NodeInventory,
                    isolation: Isolation | None = None) -> float:
    """GPU equivalents held by `grants` of a job with `isolation` on this node (sum of
    `gpuhours.gpu_fraction`)."""
    total = 0.0
    for grant in grants:
        gpu = inventory.gpu(grant.gpu_uuid)
        if gpu is None:
            raise ValueError(f"grant names GPU {grant.gpu_uuid} that node {inventory.name} lacks")
        slices = next((m.slices for m in gpu.mig_instances if m.uuid == grant.mig_instance), 0)
        total += gpu_fraction(grant, gpu.memory_total_mib, slices, isolation)
    return total


def held_fraction(job: Job, nodes: Mapping[str, NodeState], fallback: float) -> float:
    """GPU equivalents a GPU-holding job holds: from its grants when its node is known, else
    from its open run record, else `fallback` (its nominal fraction). A gang's is the sum
    over its workers."""
    if job.placements:
        try:
            return sum(grants_fraction(p.grants, nodes[p.node].inventory, job.request.isolation)
                       for p in job.placements)
        except (KeyError, ValueError):
            pass  # a node gone or changed under a worker; use what was recorded
    node = nodes.get(job.node)
    if job.grants and node is not None:
        try:
            return grants_fraction(job.grants, node.inventory, job.request.isolation)
        except ValueError:
            pass  # the node's inventory changed under the job; use what was recorded
    run = job.current_run
    return run.fraction if run is not None else fallback


def run_gpu_hours(run: RunRecord, now: float) -> float:
    """GPU-hours of one run up to `now` (an open run, or a record from a clock ahead of ours)."""
    return gpu_hours(run.fraction, run.start, min(run.end if run.end is not None else now, now))


def run_gpu_hours_between(run: RunRecord, window_start: float, window_end: float,
                          now: float) -> float:
    """GPU-hours of the part of a run inside [window_start, window_end] (and before `now`)."""
    end = min(run.end if run.end is not None else now, window_end, now)
    return gpu_hours(run.fraction, max(run.start, window_start), end)


def job_gpu_hours(job: Job, now: float) -> float:
    """All GPU-hours a job has used, over all its attempts."""
    return sum(run_gpu_hours(r, now) for r in job.runs)


def _decayed_retired(retired: RetiredUsage, now: float, half_life_s: float) -> float:
    return retired.decayed_gpu_hours * decay_factor(now - retired.decayed_as_of, half_life_s)


def project_usage(quota: ProjectQuota, jobs: Iterable[Job], now: float, half_life_s: float,
                  retired: RetiredUsage | None = None) -> ProjectUsage:
    """This period's GPU-hours and the decayed fair-share usage of one project.

    Counts the runs of `jobs` that belong to the project plus retired usage (deleted jobs'
    runs whose keys are in `retired.job_keys` are skipped if they reappear).
    """
    period_start = quota.period_start(now)
    period_end = period_start + quota.period_s
    retired = retired or RetiredUsage()
    used = retired.gpu_hours if retired.period_start == period_start else 0.0
    decayed = _decayed_retired(retired, now, half_life_s)
    for job in jobs:
        if job.project != quota.name or job.key in retired.job_keys:
            continue
        for run in job.runs:
            used += run_gpu_hours_between(run, period_start, period_end, now)
            end = run.end if run.end is not None else now
            decayed += decayed_gpu_hours(run.fraction, run.start, end, now, half_life_s)
    return ProjectUsage(quota.name, period_start, used, decayed)


def retire_job(retired: RetiredUsage | None, job: Job, quota: ProjectQuota, now: float,
               half_life_s: float) -> RetiredUsage:
    """Fold a job that is being deleted into its project's retired usage (idempotent).

    A period that has ended is dropped (its budget no longer matters); the keys of the jobs
    retired in it stay, so that a job retired just before the period rolled over and retired
    again after it (its finalizer not yet removed) is not counted twice. `forget_gone` keeps
    the keys few.
    """
    return retire_runs(retired, job.key, job.runs, quota, now, half_life_s)


def retire_runs(retired: RetiredUsage | None, key: str, runs: Iterable[RunRecord],
                quota: ProjectQuota, now: float, half_life_s: float) -> RetiredUsage:
    """Fold `runs` into a project's retired usage under `key`, once (see `retire_job`): the
    runs of a deleted job, or those of a pod no job accounts for that held a GPU (an
    orphan, billed to its namespace's project until it is stopped)."""
    retired = retired or RetiredUsage()
    if key in retired.job_keys:
        return retired
    runs = tuple(runs)
    period_start = quota.period_start(now)
    if retired.period_start != period_start:
        retired = replace(retired, period_start=period_start, gpu_hours=0.0)
    in_period = sum(run_gpu_hours_between(r, period_start, period_start + quota.period_s,
                                          max(now, r.end or now)) for r in runs)
    decayed_runs = sum(
        decayed_gpu_hours(r.fraction, r.start, r.end if r.end is not None else now,
                          max(now, r.end or now), half_life_s)
        for r in runs)
    return replace(
        retired,
        gpu_hours=retired.gpu_hours + in_period,
        decayed_gpu_hours=_decayed_retired(retired, now, half_life_s) + decayed_runs,
        decayed_as_of=now,
        job_keys=retired.job_keys | {key},
    )


def retire_deleted(retired: RetiredUsage | None, job: Job, quota: ProjectQuota, now: float,
                   half_life_s: float, alpha: float = DURATION_LEARNING_RATE) -> RetiredUsage:
    """Fold a job that is being deleted into its project's retired usage: its GPU-hours
    (`retire_job`) and what it taught the estimates (`estimate_ranges.retire_history`).
    Idempotent by `job.key` (the operator makes it unique per object: key@uid); returns
    `retired` itself when the job was folded in already."""
    if retired is not None and job.key in retired.job_keys:
        return retired
    return retire_history(retire_job(retired, job, quota, now, half_life_s), job, alpha)


def forget_gone(retired: RetiredUsage, present: AbstractSet[str]) -> RetiredUsage:
    """`retired` keeping only the keys of jobs still `present` (being deleted, their
    finalizer not yet removed). A key only guards against folding a job in twice while it
    still exists; one key per deleted job kept for a whole budget period would outgrow the
    object's size limit on a cluster that cleans up finished jobs."""
    kept = retired.job_keys & present
    return retired if kept == retired.job_keys else replace(retired, job_keys=kept)


@dataclass(frozen=True)
class MemoryEfficiency:
    """Requested vs peak GPU memory over the jobs that reported a peak."""

    requested_mib: int  # per GPU, summed over jobs
    peak_mib: int
    jobs: int

    @property
    def ratio(self) -> float | None:
        """peak / requested, in [0, 1] when jobs stay within their request; None: no data."""
        return self.peak_mib / self.requested_mib if self.requested_mib > 0 else None


def memory_efficiency(jobs: Iterable[Job]) -> MemoryEfficiency:
    """How much of the GPU memory jobs asked for they actually used at their peak."""
    requested = peak = count = 0
    for job in jobs:
        if job.peak_memory_mib is None or job.request.memory_mib <= 0:
            continue
        requested += job.request.memory_mib
        peak += job.peak_memory_mib
        count += 1
    return MemoryEfficiency(requested, peak, count)
