"""How far estimated starts can be trusted: how recent first estimates missed, per class,
the 80 % range shown with an estimate, how arrivals of higher classes stretch a wait, and
what deleted jobs taught the estimates (kept in their project's retired usage)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from carpool.core.jobs import DurationEstimate, Job, RetiredUsage, StartMiss
from carpool.core.resources import JobClass
from carpool.core.run_times import (
    DURATION_LEARNING_RATE,
    LearnKey,
    expected_duration,
    finished_run,
    fold_finished,
    learn_key_template,
)

# ---------------------------------------------------------------- arrivals to come

MAX_HIGHER_LOAD = 0.8  # the higher classes' share of capacity never counts for more
MIN_HIGHER_ARRIVALS = 10  # fewer arrivals above a class in the window say nothing of a rate
RATE_ARRIVALS = 20  # the rate above a class is that of its latest this many arrivals


def arrival_work(job: Job, fraction: float, learned: Mapping[LearnKey, DurationEstimate]
                 ) -> float:
    """GPU-seconds a job brings: what its runs took once finished, else what it is expected
    to take."""
    if job.phase.finished and job.runs:
        return fraction * sum((r.end if r.end is not None else r.start) - r.start
                              for r in job.runs)
    return fraction * expected_duration(job, learned)


def higher_class_load(now: float, window_s: float, capacity_gpus: float,
                      arrivals: Iterable[Arrival]) -> dict[int, float]:
    """Per class level c: rho_c, the share of capacity that jobs of the classes above c take
    if they keep arriving at their recent rate (`wait_stretch` turns it into how much longer
    a class-c wait becomes).

    `arrivals` are (submitted at, class level, GPU-seconds, project). The latest
    `RATE_ARRIVALS` arrivals of classes above c within `window_s` bring W GPU-seconds since
    the earliest of them, T seconds ago: rho_c = W / (T x capacity), capped at
    `MAX_HIGHER_LOAD`; no entry while fewer than `MIN_HIGHER_ARRIVALS` arrived above c.
    Measured over a number of arrivals rather than a fixed span, the rate follows a surge
    within seconds and fades as time passes without arrivals.
    """
    recent = recent_arrivals(now, window_s, arrivals)
    load: dict[int, float] = {}
    for level in range(int(JobClass.SHORT), len(JobClass)):
        found = overtaking_load(now, capacity_gpus, recent, level, frozenset())
        if found is not None:
            load[level] = found
    return load


class Arrival(NamedTuple):
    """A job's arrival as the arrival rates count it."""

    submitted: float
    level: int  # its class
    work: float  # GPU-seconds (`arrival_work`)
    project: str = ""


def recent_arrivals(now: float, window_s: float, arrivals: Iterable[Arrival]
                    ) -> list[Arrival]:
    """The arrivals within `window_s` before `now`, latest first (what `overtaking_load`
    counts)."""
    if window_s <= 0:
        return []
    return sorted((a for a in (Arrival(*arrival) for arrival in arrivals)
                   if now - window_s <= a.submitted <= now),
                  reverse=True)


def overtaking_load(now: float, capacity_gpus: float, recent: Sequence[Arrival], level: int,
                    lighter: frozenset[str]) -> float | None:
    """rho, the share of capacity that the jobs which may overtake a waiting job of class
    `level` take if they keep arriving at their recent rate: those of the classes above it,
    and those of its own class from the projects in `lighter` (projects whose weighted usage
    is below the job's, so fair share ranks their new jobs ahead of it; fairshare). Counted
    as `higher_class_load` counts (the latest `RATE_ARRIVALS` of them in `recent`, latest
    first; None while fewer than `MIN_HIGHER_ARRIVALS`).

    Same-class arrivals count because they pass too: on a replayed trace at 85 % load, 34 of
    the 48 interactive jobs that started after their range had been passed by other
    interactive jobs (against 125 of the 294 inside it), and no class is above theirs to
    stretch their ranges."""
    if capacity_gpus <= 0:
        return None
    above = [a for a in recent
             if a.level < level or (a.level == level and a.project in lighter)][:RATE_ARRIVALS]
    if len(above) < MIN_HIGHER_ARRIVALS:
        return None
    span = max(now - above[-1].submitted, 1.0)
    return min(MAX_HIGHER_LOAD, sum(a.work for a in above) / (span * capacity_gpus))


def wait_stretch(overtaking: float, passing_when_due: float) -> float:
    """How much longer a wait becomes if higher classes keep arriving as they lately have:
    1 + rho_o / (1 - rho_d).

    Until its promised start, the work of the classes allowed to overtake the job (their load
    rho_o, `higher_class_load`) goes first: over a wait w it takes rho_o x w of the capacity
    the job was counting on. Once the promise has passed the job is due (fairshare) and
    waits only for that work, during which just the classes that may still pass a due job
    (rho_d) go first, stretching it by 1 / (1 - rho_d). Without promises the same classes
    pass throughout (rho_d = rho_o) and the stretch is 1 / (1 - rho), the factor by which
    higher-priority load stretches a lower class's wait in a priority queue.
    """
    return 1.0 + overtaking / (1.0 - passing_when_due)


# ---------------------------------------------------------------- estimate ranges

MIN_RANGE_SAMPLES = 20  # started jobs with a first estimate before ranges are shown
RANGE_MIN_WAIT_S = 60.0  # first estimates closer than this say little about the error
RANGE_QUANTILES = (0.1, 0.9)


def wait_miss(job: Job) -> float | None:
    """ln(actual wait / estimated wait) of a started job's first estimate, or None."""
    return _miss(job, job.first_estimated_start)


def _miss(job: Job, estimate: float | None, started: float | None = None) -> float | None:
    """ln(wait until `started` (default: the job's first start) / the wait `estimate`
    promised), or None without either or when it promised under `RANGE_MIN_WAIT_S`."""
    if started is None and job.runs:
        started = min(r.start for r in job.runs)
    if estimate is None or started is None:
        return None
    promised = estimate - job.submitted_at
    if promised < RANGE_MIN_WAIT_S:
        return None
    return math.log(max(started - job.submitted_at, 1.0) / promised)


RECENT_MISSES = 100  # the ranges follow how the latest first estimates missed


def start_miss(job: Job) -> StartMiss | None:
    """How a started job's estimates missed (`wait_miss`, `simulated_miss`), or None."""
    shown, simulated = wait_miss(job), simulated_miss(job)
    if shown is None and simulated is None:
        return None
    return StartMiss(min(r.start for r in job.runs), job.job_class, shown, simulated)


def recent_misses(records: Iterable[StartMiss]) -> tuple[StartMiss, ...]:
    """`records` by start time, only those that can still count: among the last
    `RECENT_MISSES` with a shown miss (`wait_misses`), or among the last `CLASS_MISSES` of
    their class with a simulated one (`class_misses`)."""
    kept: list[StartMiss] = []
    shown = 0
    simulated: dict[JobClass, int] = {}
    for record in sorted(records, key=lambda r: (r.start, r.job_class), reverse=True):
        counts = record.shown is not None and shown < RECENT_MISSES
        shown += record.shown is not None
        if record.simulated is not None:
            seen = simulated.get(record.job_class, 0)
            simulated[record.job_class] = seen + 1
            counts = counts or seen < CLASS_MISSES
        if counts:
            kept.append(record)
    kept.reverse()
    return tuple(kept)


def started_misses(jobs: Iterable[Job], base: Iterable[StartMiss] = ()
                   ) -> tuple[StartMiss, ...]:
    """The `recent_misses` of `jobs` together with `base` (records of started jobs no longer
    in the snapshot)."""
    return recent_misses([*base, *(record for job in jobs
                                   if (record := start_miss(job)) is not None)])


def wait_misses(records: Sequence[StartMiss]) -> list[float]:
    """The shown misses of the last `RECENT_MISSES` jobs to start (`records` by start time),
    sorted.

    Recent ones only: how estimates miss changes as run times are learned and the load
    shifts (a cluster's first estimates rest on users' over-estimates and come out too
    late, later ones too early), and ranges built from every job ever started kept saying
    what no longer held."""
    shown = [r.shown for r in records if r.shown is not None]
    return sorted(shown[-RECENT_MISSES:])



# ---------------------------------------------------------------- history of deleted jobs

MAX_RETIRED_TEMPLATES = 100  # templates per project whose learned run times are kept


def retire_history(retired: RetiredUsage, job: Job, alpha: float = DURATION_LEARNING_RATE
                   ) -> RetiredUsage:
    """`retired` with what a job being deleted taught the estimates: its finished run folded
    into its project's learned run times (`fold_finished`; the keys it updated move last) and
    its misses (`start_miss`) into the project's recent misses.

    Bounded, as it is kept in the ProjectQuota's status: how many templates a project has is
    up to its users, so only the `MAX_RETIRED_TEMPLATES` most recently updated templates are
    kept (its classes, four at most, always); misses only while they can count
    (`recent_misses`). Not idempotent on its own: the caller folds each job once
    (`accounting.retire_deleted` checks `job_keys`)."""
    learned = dict(retired.learned)
    run = finished_run(job)
    if run is not None:
        fold_finished(learned, job, run[1], alpha)
        for key in ((job.project, job.job_class), learn_key_template(job)):
            if key is not None:
                learned[key] = learned.pop(key)  # most recently updated last
        templates = [k for k in learned if isinstance(k[1], str)]
        for key in templates[:max(0, len(templates) - MAX_RETIRED_TEMPLATES)]:
            del learned[key]
    misses = retired.start_misses
    record = start_miss(job)
    if record is not None:
        misses = recent_misses((*misses, record))
    return replace(retired, learned=learned, start_misses=misses)


def kept_history(retired: Iterable[RetiredUsage]
                 ) -> tuple[dict[LearnKey, DurationEstimate], tuple[StartMiss, ...]]:
    """What deleted jobs left in their projects, as a `ClusterSnapshot` takes it: every
    project's learned run times (`learned`; the keys name their project, so none collide) and
    all projects' misses, those that can still count (`start_misses`)."""
    learned: dict[LearnKey, DurationEstimate] = {}
    misses: list[StartMiss] = []
    for project in retired:
        learned.update(project.learned)
        misses.extend(project.start_misses)
    return learned, recent_misses(misses)



def start_range(now: float, estimate: float, misses: Sequence[float]
                ) -> tuple[float, float] | None:
    """The 80 % range (P10-P90) around an estimated start: the wait it promises scaled by the
    10th and 90th percentiles of how far the first estimates of started jobs missed
    (ln(actual / estimated wait)); None until `MIN_RANGE_SAMPLES` jobs have started."""
    if len(misses) < MIN_RANGE_SAMPLES:
        return None
    wait = max(0.0, estimate - now)
    low_q, high_q = (_sorted_quantile(misses, q) for q in RANGE_QUANTILES)
    return now + wait * min(1.0, math.exp(low_q)), now + wait * max(1.0, math.exp(high_q))


def _sorted_quantile(values: Sequence[float], q: float) -> float:
    position = q * (len(values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(values) - 1)
    return values[lower] + (values[upper] - values[lower]) * (position - lower)


# ---------------------------------------------------------------- class calibration

CLASS_MISSES = 50  # per class: how many of the latest simulated first starts it follows
MIN_CLASS_MISSES = 10  # fewer started jobs of a class say nothing of how it misses


def simulated_miss(job: Job) -> float | None:
    """ln(actual wait / simulated wait) of a started job's first forward-simulated start
    (before calibration), or None."""
    return _miss(job, job.first_simulated_start)


def overdue_miss(job: Job, now: float) -> float | None:
    """For a job still waiting past its first simulated start: ln(wait so far / simulated
    wait), what its miss will at least be; None for any other job."""
    if job.runs or job.first_simulated_start is None or job.first_simulated_start > now:
        return None
    return _miss(job, job.first_simulated_start, now)


def class_misses(records: Sequence[StartMiss], waiting: Iterable[Job] = (),
                 now: float = 0.0) -> dict[int, list[float]]:
    """Per class level, the simulated misses of its last `CLASS_MISSES` jobs to start
    (`records` by start time), oldest first, followed by what the misses of its jobs
    still `waiting` past their simulated start will at least be (`overdue_miss`; the
    latest arrivals last), the latest `CLASS_MISSES` of all these.

    Without the overdue jobs the sample would be biased early: jobs that start soon after
    they arrive fill the latest starts, while those held back for long are not among them
    until they start (on a replayed trace at 85 % load, long jobs simulated to wait under 15
    minutes waited a median 3x that, while the latest starts said 1.2x)."""
    by_level: dict[int, list[float]] = {}
    for record in records:
        if record.simulated is not None:
            by_level.setdefault(int(record.job_class), []).append(record.simulated)
    for job in sorted(waiting, key=lambda j: (j.submitted_at, j.key)):
        miss = overdue_miss(job, now)
        if miss is not None:
            by_level.setdefault(int(job.job_class), []).append(miss)
    return {level: misses[-CLASS_MISSES:] for level, misses in by_level.items()}


def calibrated_start(now: float, simulated: float, misses: Sequence[float],
                     next_aging: float | None) -> float:
    """The estimated start of a queued job whose forward-simulated start is `simulated`.

    The simulation sees the queue as it stands and run times as expected. A job it puts
    before its next aging step (`next_aging`; None: it ages no more) starts later than that,
    by a factor that differs by class and load (higher-ranked work keeps arriving, runs and
    backfilled jobs overrun; replayed traces: long jobs a median 1.3-3x later, batch
    1.1-3x): such a wait is scaled by the median miss of the class's latest simulated first
    starts (`misses`, `class_misses`: ln(actual / simulated wait); never scaled down), but
    not past the aging step. Aged, the job passes the work that arrived after it and may
    preempt what backfilled past it, so it starts about then (long jobs' waits bunch at the
    step), and a start simulated beyond the step is left as it is (on replayed traces those
    came out right on median, 0.9-1.1x).
    """
    wait = simulated - now
    if len(misses) < MIN_CLASS_MISSES or wait <= 0:
        return simulated
    if next_aging is not None and simulated >= next_aging:
        return simulated
    start = now + wait * math.exp(max(0.0, statistics.median(misses)))
    return min(start, next_aging) if next_aging is not None else start
