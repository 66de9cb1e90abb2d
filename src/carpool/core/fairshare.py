"""Weighted fair share and aging: the order of the queue.

Queue order is (effective level, promised start, fair-share usage, submit time, job key):

- The level is the job's class (interactive 0 < short 1 < long 2 < batch 3) lowered by one for
  every `aging_step_s` it has waited. At level -1 a job is *overdue*: overdue jobs come before
  all others and are ordered by submit time alone.
- A job still queued past the start it was first promised (`Job.first_estimated_start`) is
  *due*: it ranks at least at `PROMISE_LEVEL` (as a short job), and within its level before
  the jobs not due, earliest promise first, then by submit time. Higher-class work may
  overtake a waiting job until its promised start, not after it, so the estimate shown at
  arrival is one the queue keeps. Equal promises are common: a job that overtakes a waiting
  one is promised the slot the waiting one was (the end of the job both wait for), and the
  promise given first is the one kept.
  Interactive jobs still come first; being due never lets a job preempt (`preemption`
  compares classes after aging only).
- Within a level, projects take turns by weighted usage: a project's usage (GPU-hours decayed
  with a half-life, `decayed_gpu_hours`) divided by its weight, plus the GPU-hours its own
  earlier jobs in that level are expected to use; so a project with twice the weight gets
  about twice the GPU time, and a project that used a lot recently waits behind one that did
  not.

Starvation bound: a job of class c that has waited (c + 1) * aging_step_s is overdue, and from
then on only jobs submitted before it can be ranked ahead of it; no later job can overtake it
however high its class or light its project. (A batch job, c = 3, competes as interactive
after 3 steps and is overdue after 4.) Reservations (see `queueing`) then keep backfilled
jobs from delaying it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from carpool.core.jobs import Job
from carpool.core.resources import MIG_SLICES_PER_GPU, GpuRequest, Isolation

OVERDUE_LEVEL = -1
PROMISE_LEVEL = 1  # a due job ranks at least as a short job: only interactive work still passes it
NOT_DUE = math.inf
DEFAULT_REFERENCE_MEMORY_MIB = 80 * 1024


def decay_factor(elapsed_s: float, half_life_s: float) -> float:
    """2 ** (-elapsed / half_life): how much of a usage `elapsed_s` ago still counts."""
    if half_life_s <= 0:
        raise ValueError("fair-share half-life must be positive")
    return math.pow(2.0, -max(0.0, elapsed_s) / half_life_s)


def decayed_gpu_hours(fraction: float, start: float, end: float, now: float,
                      half_life_s: float) -> float:
    """GPU-hours of holding `fraction` GPUs over [start, end], each instant weighted by its age.

    Integral over t in [start, end] of fraction * 2 ** (-(now - t) / h) dt, in hours:
    fraction * h / ln 2 * (2 ** (-(now - end) / h) - 2 ** (-(now - start) / h)) / 3600.
    With h → ∞ it becomes the plain GPU-hours of the interval.
    """
    end = min(end, now)
    if end <= start:
        return 0.0
    h = half_life_s
    integral = h / math.log(2.0) * (decay_factor(now - end, h) - decay_factor(now - start, h))
    return fraction * integral / 3600.0


def nominal_fraction(request: GpuRequest, reference_memory_mib: int) -> float:
    """GPU equivalents a request will hold before a GPU is chosen for it.

    Exclusive and time-sliced (nothing caps its SMs): count; MIG: count * slices / 7 (one
    slice if unset); MPS: count * max(memory / reference memory, cores / 100), the `gpuhours`
    definition on a GPU with `reference_memory_mib` of memory (the largest GPU in the cluster).
    """
    if request.isolation in (Isolation.EXCLUSIVE, Isolation.TIMESLICE):
        per_gpu = 1.0
    elif request.isolation is Isolation.MIG:
        per_gpu = max(1, request.mig_slices) / MIG_SLICES_PER_GPU
    else:
        memory_share = request.memory_mib / reference_memory_mib if reference_memory_mib else 0.0
        per_gpu = min(1.0, max(memory_share, request.cores_pct / 100))
    return request.count * per_gpu


def job_nominal_fraction(job: Job, reference_memory_mib: int) -> float:
    """`nominal_fraction` of every pod of the job together (a gang counts as one job)."""
    return sum(nominal_fraction(r, reference_memory_mib) for r in job.requests)


def effective_level(job: Job, now: float, aging_step_s: float) -> int:
    """The job's class lowered one level per aging step waited, floored at OVERDUE_LEVEL."""
    if aging_step_s <= 0:
        return int(job.job_class)
    waited_steps = math.floor(max(0.0, now - job.submitted_at) / aging_step_s)
    return max(OVERDUE_LEVEL, int(job.job_class) - waited_steps)


def next_aging(job: Job, now: float, aging_step_s: float) -> float | None:
    """When the job, if still queued, next ages a level; None if it ages no more."""
    if aging_step_s <= 0 or effective_level(job, now, aging_step_s) <= OVERDUE_LEVEL:
        return None
    steps = math.floor(max(0.0, now - job.submitted_at) / aging_step_s) + 1
    return job.submitted_at + steps * aging_step_s


def promised_start(job: Job) -> float | None:
    """The start a job never started yet was first promised (None: none, or it has run)."""
    return None if job.runs else job.first_estimated_start


def due_level(level: int) -> int:
    """The level a job at `level` ranks at once it is due: at least `PROMISE_LEVEL`, so only
    the classes above that may still pass it."""
    return min(level, PROMISE_LEVEL)


def promised_start_due(job: Job, now: float, aging_step_s: float) -> float:
    """The job's promised start if that has passed and it is not overdue (the job is due),
    else NOT_DUE. An overdue job ranks higher still, in its own order."""
    promised = promised_start(job)
    if (promised is None or promised > now
            or effective_level(job, now, aging_step_s) == OVERDUE_LEVEL):
        return NOT_DUE
    return promised


@dataclass(frozen=True, order=True)
class RankKey:
    """A queued job's place in the queue; smaller is served first."""

    level: int
    promised: float  # the passed promised start of a due job (NOT_DUE: not due, or overdue)
    share: float  # weighted usage ahead of this job; 0 for overdue and due jobs
    submitted_at: float
    key: str


def rank_queue(
    waiting: Iterable[Job],
    usage: Mapping[str, float],
    weights: Mapping[str, float],
    now: float,
    aging_step_s: float,
    expected_gpu_hours: Mapping[str, float],
    keep_promises: bool = True,
) -> list[tuple[RankKey, Job]]:
    """Waiting jobs in queue order with their keys.

    `usage` is each project's decayed GPU-hours, `weights` its fair-share weight (missing: 1),
    `expected_gpu_hours` each job's expected use (by key), charged to its project for the jobs
    that follow it in the same level. `keep_promises`: due jobs rank as described above.
    Independent of the order of `waiting`.
    """
    by_level_project: dict[tuple[int, str], list[Job]] = {}
    promised: dict[str, float] = {}
    for job in waiting:
        level = effective_level(job, now, aging_step_s)
        due = promised_start_due(job, now, aging_step_s) if keep_promises else NOT_DUE
        if due != NOT_DUE:
            level = due_level(level)
        promised[job.key] = due
        by_level_project.setdefault((level, job.project), []).append(job)
    ranked: list[tuple[RankKey, Job]] = []
    for (level, project), jobs in by_level_project.items():
        jobs.sort(key=lambda j: (j.submitted_at, j.key))
        weight = weights.get(project, 1.0)
        ahead = usage.get(project, 0.0)
        for job in jobs:
            share = (0.0 if level == OVERDUE_LEVEL or promised[job.key] != NOT_DUE
                     else ahead / weight)
            ranked.append((RankKey(level, promised[job.key], share, job.submitted_at, job.key),
                           job))
            ahead += expected_gpu_hours.get(job.key, 0.0)
    ranked.sort(key=lambda pair: pair[0])
    return ranked
