"""When a queued job will start: durations learned from history and a forward simulation.

The simulation keeps, per node, which grants are held over which time span ("occupancies"):
running jobs until their expected end, and reservations made for queued jobs in queue order.
A job's estimated start is the earliest time some node can hold it for its whole expected
duration next to every occupancy overlapping that span. Because each queued job reserves its
slot before the next one is looked at, a later job can only take a slot that leaves every
earlier reservation in place (conservative backfilling): backfill never delays the estimated
start of a higher-ranked job.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from carpool.core.derived import DerivedState
from carpool.core.jobs import DurationEstimate, Job, RetiredUsage, StartMiss
from carpool.core.placement import NodeState, node_rejection
from carpool.core.resources import GpuGrant, GpuRequest, JobClass, Phase

# Places a request on a node as it is: (score in [0, 1], higher is better; the grants), or
# None if it does not fit. The single seam where the extender's GPU choice and scoring
# (`queueing.extender_placer`) plug into admission.
NodePlacer = Callable[[NodeState, GpuRequest], tuple[float, tuple[GpuGrant, ...]] | None]


# ---------------------------------------------------------------- learned durations

# Learned run times are kept per (project, class) and per (project, template): a template is
# what a job is run from (its image, or its name without a trailing number), so jobs of the
# same kind learn from each other. Keys: (project, JobClass) and (project, template str).
LearnKey = tuple[str, "JobClass | str"]
MIN_TEMPLATE_SAMPLES = 1  # finished runs of a template before its own history is used
DURATION_LEARNING_RATE = 0.1  # newest run's weight once a group has 1/rate runs


def update_duration_estimate(previous: DurationEstimate | None, actual_s: float,
                             estimated_s: float, alpha: float) -> DurationEstimate:
    """Fold one finished run in: new = w * observation + (1 - w) * old, w = max(alpha,
    1 / runs so far). The first 1/alpha runs thus weigh equally (a plain mean): with a fixed
    weight the estimate of a template that never changes stays as noisy as its last few runs.
    After that the newest run weighs alpha, so the estimate follows a template that drifts.

    Two predictors are learned side by side, in log space (run times are skewed): the
    template's typical run time (`log_seconds`), and its typical actual/estimated ratio
    (`log_ratio`), each with the mean absolute log error it made on the runs folded in after
    it (`error_seconds`, `error_ratio`) and the spread of its signed errors (`low`, `high`:
    running 10th and 90th percentiles of ln(actual / predicted)).
    """
    if not 0 < alpha <= 1:
        raise ValueError("duration learning rate alpha must be in (0, 1]")
    actual_s = max(actual_s, 1.0)
    ratio = actual_s / estimated_s if estimated_s > 0 else 1.0
    log_actual, log_ratio = math.log(actual_s), math.log(max(ratio, 1e-9))
    if previous is None:
        return DurationEstimate(actual_s, ratio, 1, log_actual, log_ratio)
    alpha = max(alpha, 1.0 / (previous.samples + 1))
    miss_seconds = log_actual - previous.log_seconds
    miss_ratio = log_ratio - previous.log_ratio
    first_error = previous.samples == 1
    if previous.error_seconds + previous.error_ratio == 0 and first_error:
        err_s, err_r = abs(miss_seconds), abs(miss_ratio)
    else:
        err_s = alpha * abs(miss_seconds) + (1 - alpha) * previous.error_seconds
        err_r = alpha * abs(miss_ratio) + (1 - alpha) * previous.error_ratio
    miss = miss_seconds if previous.uses_seconds else miss_ratio
    return DurationEstimate(alpha * actual_s + (1 - alpha) * previous.seconds,
                            alpha * ratio + (1 - alpha) * previous.ratio,
                            previous.samples + 1,
                            alpha * log_actual + (1 - alpha) * previous.log_seconds,
                            alpha * log_ratio + (1 - alpha) * previous.log_ratio,
                            err_s, err_r,
                            _quantile_step(previous.low, miss, 0.1, first_error),
                            _quantile_step(previous.high, miss, 0.9, first_error))


def _quantile_step(current: float, observation: float, q: float, first: bool) -> float:
    """A running estimate of the q-quantile of `observation` (stochastic approximation: move
    up by q * step when below the observation, down by (1 - q) * step otherwise)."""
    if first:
        return observation
    step = 0.25
    return current + (q * step if observation > current else -(1 - q) * step)


def learn_key_template(job: Job) -> LearnKey | None:
    return (job.project, job.template) if job.template else None


def fold_finished(learned: dict[LearnKey, DurationEstimate], job: Job, actual_s: float,
                  alpha: float) -> None:
    """Fold one finished run of `job` into `learned` (its class's and its template's)."""
    keys: list[LearnKey] = [(job.project, job.job_class)]
    template = learn_key_template(job)
    if template is not None:
        keys.append(template)
    for key in keys:
        learned[key] = update_duration_estimate(learned.get(key), actual_s,
                                                job.estimated_duration_s, alpha)


def finished_run(job: Job) -> tuple[float, float] | None:
    """(end, seconds) of the run a finished job teaches: the last run of a job that
    succeeded; None for any other job (one that failed or was cancelled says nothing of how
    long its kind takes)."""
    if job.phase is not Phase.SUCCEEDED or not job.runs:
        return None
    last = max(job.runs, key=lambda r: r.attempt)
    return (last.end, last.end - last.start) if last.end is not None else None


def learn_durations(jobs: Iterable[Job], alpha: float = DURATION_LEARNING_RATE,
                    base: Mapping[LearnKey, DurationEstimate] | None = None
                    ) -> dict[LearnKey, DurationEstimate]:
    """Per (project, class) and (project, template) estimates from succeeded jobs' last runs,
    folded in end-time order (ties by key), so the result does not depend on the order of
    `jobs`; a snapshot's own `learned` (kept up to date run by run) is added to first."""
    finished: list[tuple[float, str, Job, float]] = []
    for job in jobs:
        run = finished_run(job)
        if run is not None:
            finished.append((run[0], job.key, job, run[1]))
    finished.sort(key=lambda item: (item[0], item[1]))
    learned: dict[LearnKey, DurationEstimate] = dict(base or {})
    for _, _, job, actual in finished:
        fold_finished(learned, job, actual, alpha)
    return learned


def _template_history(job: Job, learned: Mapping[LearnKey, DurationEstimate]
                      ) -> DurationEstimate | None:
    key = learn_key_template(job)
    history = learned.get(key) if key is not None else None
    return history if history is not None and history.samples >= MIN_TEMPLATE_SAMPLES else None


def expected_duration(job: Job, learned: Mapping[LearnKey, DurationEstimate]) -> float:
    """How long a run of `job` is expected to take, from history: its template's typical run
    time or its estimate times the template's typical ratio, whichever predicted that
    template's recent runs better; without template history, its estimate scaled by how its
    project's jobs of this class compared with theirs. Never beyond maxDuration."""
    history = _template_history(job, learned)
    if history is not None:
        duration = history.predict(job.estimated_duration_s)
    else:
        by_class = learned.get((job.project, job.job_class))
        duration = job.estimated_duration_s * (by_class.ratio if by_class else 1.0)
    if job.max_duration_s > 0:
        duration = min(duration, job.max_duration_s)
    return max(1.0, duration)


def duration_range(job: Job, learned: Mapping[LearnKey, DurationEstimate]
                   ) -> tuple[float, float]:
    """(P10, P90) of the job's run time (`run_time`)."""
    low, _, high = run_time(job, learned)
    return low, high


def run_time(job: Job, learned: Mapping[LearnKey, DurationEstimate]
             ) -> tuple[float, float, float]:
    """(P10, expected, P90) of the job's run time: its expected duration
    (`expected_duration`) scaled by the 10th and 90th percentiles of its template's past
    prediction errors (the expected duration three times when there is no template
    history)."""
    expected = expected_duration(job, learned)
    history = _template_history(job, learned)
    if history is None or history.samples < 3:
        return expected, expected, expected
    low, high = expected * math.exp(history.low), expected * math.exp(history.high)
    if job.max_duration_s > 0:
        high = min(high, job.max_duration_s)
    return max(1.0, min(low, expected)), expected, max(expected, high)


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
                      arrivals: Iterable[tuple[float, int, float]]) -> dict[int, float]:
    """Per class level c: rho_c, the share of capacity that jobs of the classes above c take
    if they keep arriving at their recent rate (`wait_stretch` turns it into how much longer
    a class-c wait becomes).

    `arrivals` are (submitted at, class level, GPU-seconds). The latest `RATE_ARRIVALS`
    arrivals of classes above c within `window_s` bring W GPU-seconds since the earliest of
    them, T seconds ago: rho_c = W / (T x capacity), capped at `MAX_HIGHER_LOAD`; no entry
    while fewer than `MIN_HIGHER_ARRIVALS` arrived above c. Measured over a number of
    arrivals rather than a fixed span, the rate follows a surge within seconds and fades as
    time passes without arrivals.
    """
    if window_s <= 0 or capacity_gpus <= 0:
        return {}
    recent = sorted(((submitted, level, work) for submitted, level, work in arrivals
                     if now - window_s <= submitted <= now), reverse=True)
    load: dict[int, float] = {}
    for level in range(int(JobClass.SHORT), len(JobClass)):
        above = [(submitted, work) for submitted, lvl, work in recent
                 if lvl < level][:RATE_ARRIVALS]
        if len(above) < MIN_HIGHER_ARRIVALS:
            continue
        span = max(now - above[-1][0], 1.0)
        load[level] = min(MAX_HIGHER_LOAD,
                          sum(work for _, work in above) / (span * capacity_gpus))
    return load


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


OVERRUN_FRACTION = 0.5  # a job past its expectation is expected to run this x its age more
# How far a reported job's rate may still change before it ends: the spread (log space) of
# its remaining time on top of what the spread of its recent rates says (rate changes,
# pauses, restarts from a checkpoint; near the end one pause is much of what is left).
PROGRESS_DRIFT = 0.2
UNSEEN_PAUSES = 0.3  # the range's end, for a job that reported no pause yet: this much more
MAX_PAUSE_SHARE = 0.9  # a job paused more than this share of its time says little of its rate
Z80 = 1.2816  # the 90th percentile of the standard normal: an 80 % range is +-Z80 sigma


@dataclass(frozen=True)
class Remaining:
    """Seconds until a running job lets go of its GPUs: what is expected, and the 80 % range
    (P10, P90) around it; `reported`: from the job's own progress reports."""

    expected: float
    low: float
    high: float
    reported: bool = False


def progress_remaining(job: Job, now: float) -> float | None:
    """Seconds a running job still needs by its own progress reports, or None without a rate
    (`reported_remaining`'s expectation)."""
    found = reported_remaining(job, now)
    return None if found is None else found.expected


def reported_remaining(job: Job, now: float) -> Remaining | None:
    """What a running job still needs by its own progress reports, or None without a rate.

    With training samples (`ProgressDetail.recent`): its training rate is the median rate
    between its latest samples (one odd interval, a pause the job did not report, a burst,
    moves it little; samples before a fall in progress, a restart from a checkpoint, are
    dropped), and its pauses (evaluations, checkpoint saves) take the share of its time they
    took so far this attempt: the rest, 1 - progress, takes (1 - progress) / rate / (1 -
    pause share), from the report on, less the time since it while the job was training.
    Without samples, the average rate of the attempt: from `resumed_progress` (where it
    started) to `progress` in `progress_at - started` seconds.

    The range: the spread of the recent rates (log space) and `PROGRESS_DRIFT`, for what may
    still change, combined as independent errors; its end `UNSEEN_PAUSES` later for a job
    that reported no pause yet.
    """
    started, progress, at = job.started_at, job.progress, job.progress_at
    if started is None or progress is None or at is None:
        return None
    detail = job.progress_detail
    rates = _recent_rates(detail.recent, started) if detail is not None else []
    spread = 0.0
    if detail is not None and rates:
        rate = statistics.median(rates)
        trained = max(0.0, progress - job.resumed_progress) / rate
        pause_share = min(MAX_PAUSE_SHARE, detail.paused_s / max(detail.paused_s + trained, 1.0))
        needed = (1.0 - progress) / rate / (1.0 - pause_share)
        since = max(0.0, now - at) if detail.phase == "train" else 0.0
        if len(rates) >= 2:
            logs = [math.log(r) for r in rates]
            mean = sum(logs) / len(logs)
            spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    else:
        done, ran = progress - job.resumed_progress, at - started
        if done <= 0 or ran <= 0:
            return None
        needed = (1.0 - progress) * ran / done
        since = max(0.0, now - at)
    sigma = math.hypot(spread, PROGRESS_DRIFT)
    # a job that has not paused yet may still: its first evaluation is often a while in
    unseen = 1.0 + UNSEEN_PAUSES if detail is not None and detail.paused_s == 0 else 1.0
    expected = needed - since
    return Remaining(expected, needed * math.exp(-Z80 * sigma) - since,
                     needed * unseen * math.exp(Z80 * sigma) - since, reported=True)


def _recent_rates(samples: Sequence[tuple[float, float]], started: float) -> list[float]:
    """Fractions per second between consecutive training samples of the current attempt,
    after the last fall in progress; positive ones only."""
    kept: list[tuple[float, float]] = []
    for at, value in samples:
        if at < started:
            continue
        if kept and value < kept[-1][1]:
            kept = []  # restarted from a checkpoint: what came before says nothing now
        kept.append((at, value))
    return [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(kept)
            if b[0] > a[0] and b[1] > a[1]]


def expected_remaining(job: Job, now: float, duration_s: float, min_remaining_s: float) -> float:
    """Expected seconds until a GPU-holding job lets go of its GPUs (`remaining`'s
    expectation, without a range for the run time)."""
    return remaining(job, now, (duration_s, duration_s, duration_s), min_remaining_s).expected


def remaining(job: Job, now: float, run_time: tuple[float, float, float],
              min_remaining_s: float) -> Remaining:
    """Seconds until a GPU-holding job lets go of its GPUs, with its 80 % range: one rule
    for jobs that report progress and jobs that do not.

    What the job's reported progress leaves (`reported_remaining`), else what its run time
    (`run_time`: P10, expected, P90, as `expected_duration` and `duration_range` learn them)
    leaves. A job past its expectation is given `OVERRUN_FRACTION` of the time it has run so
    far (at least `min_remaining_s`): run times are heavy-tailed, so the longer a job has
    overrun the longer it is likely to go on; "any minute now" at every cycle made every
    estimate behind it too early. Never more than what its limit (maxDuration, enforced)
    leaves; a job past its limit is given `min_remaining_s` (it is being stopped). A job still
    within its expectation is not floored at `min_remaining_s`: that would push every
    estimate behind a job about to end up to `min_remaining_s` too late.
    """
    started = job.started_at
    elapsed = max(0.0, now - started) if started is not None else 0.0
    limit_left = job.max_duration_s - elapsed if job.max_duration_s > 0 else math.inf
    if limit_left <= 0:
        return Remaining(min_remaining_s, min_remaining_s, min_remaining_s)
    found = reported_remaining(job, now)
    if found is None:
        low_s, duration_s, high_s = run_time
        found = Remaining(duration_s - elapsed, low_s - elapsed, high_s - elapsed)
    expected = found.expected
    if expected <= 0:
        expected = max(min_remaining_s, OVERRUN_FRACTION * elapsed)
    expected = min(expected, limit_left)
    low = min(expected, max(0.0, found.low))
    high = min(limit_left, max(expected, found.high))
    return Remaining(expected, low, high, found.reported)


# ---------------------------------------------------------------- occupancy timeline


@dataclass(frozen=True)
class Occupancy:
    """Grants held on one node over [start, end)."""

    job_key: str
    start: float
    end: float
    grants: tuple[GpuGrant, ...]


@dataclass
class _BestNow:
    """One request's nodes ranked by how well they hold it from now on, over the nodes whose
    occupancies all started by now: there the fit does not depend on the span's end. Entries
    are (-score, host index, node, node version, grants); an entry whose node changed since is
    stale and dropped when it comes to the top."""

    seen: int  # how much of the timeline's change log is folded in
    heap: list[tuple[float, int, str, int, tuple[GpuGrant, ...]]]


# a slot being compared: (start, victims, -score, node, grants, victims' keys)
_Candidate = tuple[float, int, float, str, tuple[GpuGrant, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Slot:
    """Where and when a job can run; `displaces`: running jobs it preempts to get there."""

    start: float
    node: str
    grants: tuple[GpuGrant, ...]
    displaces: tuple[str, ...] = ()


class TimelineMemo:
    """Node states and fit results kept from one cycle to the next, for callers that run many
    cycles over the same nodes (a replay: each event changes one node, the rest repeat).

    Keyed by the identity of the node's base state (kept alive here, so an id is never
    reused while its entry exists) and the grants held, so a changed inventory never meets
    a stale entry. Cleared when it grows past `limit` entries.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.placer: NodePlacer | None = None
        self._states: dict[tuple[int, tuple[int, ...]],
                           tuple[NodeState, tuple[tuple[GpuGrant, ...], ...], NodeState]] = {}
        self._fits: dict[tuple[int, GpuRequest], tuple[NodeState, tuple[float, tuple[
            GpuGrant, ...]] | None]] = {}
        self._hosts: dict[tuple[tuple[int, ...], GpuRequest],
                          tuple[tuple[NodeState, ...], tuple[str, ...]]] = {}
        self._derived: dict[int, tuple[NodeState, DerivedState]] = {}

    def bind(self, placer: NodePlacer) -> None:
        if self.placer is not placer:
            self.placer = placer
            self._fits.clear()
        if len(self._states) + len(self._fits) > self.limit:
            self._states.clear()
            self._fits.clear()
            self._hosts.clear()
            self._derived.clear()

    def derived(self, base: NodeState) -> DerivedState:
        """The `DerivedState` of `base`, the same one every cycle while `base` is passed in."""
        entry = self._derived.get(id(base))
        if entry is None or entry[0] is not base:
            entry = self._derived[id(base)] = (base, DerivedState.of(base))
        return entry[1]

    def state(self, base: NodeState, held: tuple[tuple[GpuGrant, ...], ...]) -> NodeState:
        """`base` with the grant tuples `held` added; keyed by the tuples' identities (cheap
        to hash, and each occupancy keeps its job's grants tuple), checked on a hit."""
        key = (id(base), tuple(id(g) for g in held))
        entry = self._states.get(key)
        if entry is None or entry[0] is not base or any(
                a is not b for a, b in zip(entry[1], held, strict=True)):
            grants = tuple(g for gs in held for g in gs)
            entry = self._states[key] = (base, held, base.with_grants(grants) if grants else base)
        return entry[2]

    def fit(self, state: NodeState, request: GpuRequest, placer: NodePlacer
            ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        key = (id(state), request)
        entry = self._fits.get(key)
        if entry is None or entry[0] is not state:
            entry = self._fits[key] = (state, placer(state, request))
        return entry[1]

    def hosts(self, bases: tuple[NodeState, ...], names: tuple[str, ...],
              request: GpuRequest) -> tuple[str, ...]:
        key = (tuple(id(b) for b in bases), request)
        entry = self._hosts.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], bases, strict=True)):
            hosts = tuple(n for n, b in zip(names, bases, strict=True)
                          if node_rejection(b, request) is None)
            entry = self._hosts[key] = (bases, hosts)
        return entry[1]


class Timeline:
    """Per-node occupancy over time for one cycle's what-ifs (local state, never shared).

    Fit checks are memoised by (node, the exact set of occupancies that overlap the span,
    request): the node's state is a function of that set alone, and occupancies are only
    appended or shortened, so a cycle with thousands of jobs of a few shapes asks the
    placement core only once per distinct situation.
    """

    def __init__(self, nodes: Mapping[str, NodeState], now: float, placer: NodePlacer,
                 memo: TimelineMemo | None = None) -> None:
        self.now = now
        self.placer = placer
        self.memo = memo
        if memo is not None:
            memo.bind(placer)
        # inventory + grants of things that are not jobs; what-if states are asked the same
        # questions again and again, so they keep their answers (DerivedState)
        self._base: dict[str, NodeState] = {
            name: memo.derived(state) if memo is not None else DerivedState.of(state)
            for name, state in nodes.items()}
        self._names = sorted(nodes)
        self._bases = tuple(self._base[n] for n in self._names)
        self._occupancies: dict[str, list[Occupancy]] = {name: [] for name in nodes}
        self._starts: dict[str, list[float]] = {name: [] for name in nodes}  # sorted
        self._versions: dict[str, int] = dict.fromkeys(nodes, 0)
        self._now_ids: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self._request_ids: dict[GpuRequest, int] = {}
        self._hosts: dict[int, tuple[str, ...]] = {}  # request id -> nodes that could ever fit
        self._fits: dict[tuple[str, tuple[int, ...], int],
                         tuple[float, tuple[GpuGrant, ...]] | None] = {}
        self._states: dict[tuple[str, tuple[int, ...]], NodeState] = {}
        self._changed: list[str] = []  # nodes, each time their occupancies changed
        self._future: set[str] = set()  # nodes with an occupancy that starts after now
        self._host_index: dict[int, dict[str, int]] = {}  # request id -> node -> host order
        self._best: dict[int, _BestNow] = {}  # request id -> its ranking (see best_now)

    def _request_id(self, request: GpuRequest) -> int:
        """A small int per distinct request, so the hot loops hash ints, not dataclasses."""
        rid = self._request_ids.get(request)
        if rid is None:
            rid = self._request_ids[request] = len(self._request_ids)
            if self.memo is not None:
                self._hosts[rid] = self.memo.hosts(self._bases, tuple(self._names), request)
            else:
                self._hosts[rid] = tuple(n for n in self._names
                                         if node_rejection(self._base[n], request) is None)
            self._host_index[rid] = {n: i for i, n in enumerate(self._hosts[rid])}
        return rid

    @property
    def node_names(self) -> list[str]:
        return list(self._names)

    def occupancies(self, node: str) -> list[Occupancy]:
        return list(self._occupancies.get(node, ()))

    def add(self, node: str, occupancy: Occupancy) -> None:
        if node not in self._base:
            raise KeyError(f"unknown node {node!r}")
        self._occupancies[node].append(occupancy)
        bisect.insort(self._starts[node], occupancy.start)
        self._versions[node] += 1
        self._changed.append(node)
        if occupancy.start > self.now:
            self._future.add(node)

    def end_at(self, job_key: str, end: float) -> None:
        """Shorten a job's occupancy (a preempted job leaves after its grace period)."""
        for node, occs in self._occupancies.items():
            for i, o in enumerate(occs):
                if o.job_key == job_key and o.end > end:
                    occs[i] = Occupancy(o.job_key, o.start, end, o.grants)
                    self._versions[node] += 1
                    self._changed.append(node)

    def _overlapping(self, node: str, start: float, end: float,
                     without: frozenset[str]) -> tuple[int, ...]:
        return tuple(i for i, o in enumerate(self._occupancies[node])
                     if o.start < end and o.end > start and o.job_key not in without)

    def _state(self, node: str, ids: tuple[int, ...]) -> NodeState:
        # one NodeState per situation, shared by every request shape that meets it: a state
        # memoises what placement and scoring derive from it (free GPUs, profiles)
        state = self._states.get((node, ids))
        if state is None:
            base = self._base[node]
            occs = self._occupancies[node]
            if self.memo is not None:
                state = self._states[(node, ids)] = self.memo.state(
                    base, tuple(occs[i].grants for i in ids))
            else:
                held = tuple(g for i in ids for g in occs[i].grants)
                state = self._states[(node, ids)] = base.with_grants(held) if held else base
        return state

    def fit_during(self, node: str, request: GpuRequest, start: float, end: float,
                   without: frozenset[str] = frozenset()
                   ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        """(placer's score, grants) if `request` fits the node over [start, end), else None."""
        return self._fit(node, request, self._request_id(request), start, end, without)

    def _ids_from_now(self, node: str, end: float) -> tuple[int, ...]:
        """Occupancies overlapping [now, end): memoised by how many start before `end`, which
        with the node's version pins the set down (occupancies only grow or shorten)."""
        starting = bisect.bisect_left(self._starts[node], end)
        key = (node, self._versions[node], starting)
        ids = self._now_ids.get(key)
        if ids is None:
            ids = self._now_ids[key] = self._overlapping(node, self.now, end, frozenset())
        return ids

    def _fit(self, node: str, request: GpuRequest, rid: int, start: float, end: float,
             without: frozenset[str] = frozenset()
             ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        if start == self.now and not without:
            ids = self._ids_from_now(node, end)
        else:
            ids = self._overlapping(node, start, end, without)
        key = (node, ids, rid)
        if key not in self._fits and self.memo is not None:
            self._fits[key] = self.memo.fit(self._state(node, ids), request, self.placer)
        elif key not in self._fits:
            self._fits[key] = self.placer(self._state(node, ids), request)
        return self._fits[key]

    def never_fits(self, node: str, request: GpuRequest) -> bool:
        """True if the node cannot hold the request even with no job on it."""
        return node not in self._hosts[self._request_id(request)]

    def fits_anywhere_ever(self, request: GpuRequest) -> bool:
        return bool(self._hosts[self._request_id(request)])

    def best_now(self, request: GpuRequest, duration_s: float,
                 respect_reservations: bool = True,
                 without: frozenset[str] = frozenset()) -> Slot | None:
        """The best node that can hold the request from now for `duration_s`.

        With `respect_reservations` the slot must leave every reservation overlapping the span
        in place; without, only what is held now counts (a raw capacity check). `without`
        jobs are treated as gone.
        """
        # The raw check spans the instant `now` alone: the next float, since `now + 1e-9`
        # rounds back to `now` for epoch times (~1.7e9) and would overlap nothing.
        end = (self.now + duration_s if respect_reservations
               else math.nextafter(self.now, math.inf))
        rid = self._request_id(request)
        if without or end <= self.now:
            return self._best_by_scan(request, rid, end, without)
        # Equal to scanning every host (best score, ties to the first in name order), but a
        # cycle asks this for thousands of jobs over hundreds of nodes while each admission
        # changes one node: nodes whose occupancies all started by now hold the request the
        # same way whatever `end` is, so their ranking is kept per request and updated from
        # the change log; only nodes with a reservation starting later are looked at per call.
        index = self._host_index[rid]
        candidates = []
        top = self._best_current(request, rid)
        if top is not None:
            candidates.append(top)
        for name in self._future:
            i = index.get(name)
            if i is None:
                continue
            fit = self._fit(name, request, rid, self.now, end, without)
            if fit is not None:
                candidates.append((-fit[0], i, name, self._versions[name], fit[1]))
        if not candidates:
            return None
        best = min(candidates)
        return Slot(self.now, best[2], best[4])

    def _best_by_scan(self, request: GpuRequest, rid: int, end: float,
                      without: frozenset[str]) -> Slot | None:
        best: tuple[float, str, tuple[GpuGrant, ...]] | None = None
        for name in self._hosts[rid]:
            fit = self._fit(name, request, rid, self.now, end, without)
            if fit is None:
                continue
            score, grants = fit
            if best is None or score > best[0]:
                best = (score, name, grants)
        return Slot(self.now, best[1], best[2]) if best else None

    def _best_current(self, request: GpuRequest, rid: int
                      ) -> tuple[float, int, str, int, tuple[GpuGrant, ...]] | None:
        """The best entry of the request's ranking over nodes without later reservations."""
        ranking = self._best.get(rid)
        if ranking is None:
            ranking = self._best[rid] = _BestNow(len(self._changed), [])
            stale: Iterable[str] = self._hosts[rid]
        else:
            stale = dict.fromkeys(self._changed[ranking.seen:])
            ranking.seen = len(self._changed)
        index = self._host_index[rid]
        # any end past now: these nodes' occupancies all overlap it or have ended by now
        end = math.nextafter(self.now, math.inf)
        for name in stale:
            i = index.get(name)
            if i is None or name in self._future:
                continue
            fit = self._fit(name, request, rid, self.now, end)
            if fit is not None:
                heapq.heappush(ranking.heap, (-fit[0], i, name, self._versions[name], fit[1]))
        heap = ranking.heap
        while heap:
            entry = heap[0]
            if entry[2] not in self._future and entry[3] == self._versions[entry[2]]:
                return entry
            heapq.heappop(heap)
        return None

    def earliest(self, request: GpuRequest, duration_s: float, not_before: float,
                 yielding: Mapping[str, float] | None = None,
                 protected: Mapping[str, float] | None = None,
                 max_victims: int | None = None) -> Slot | None:
        """The earliest slot at or after `not_before` for the whole duration; None if no node
        could ever hold the request. Ties go to the better-ranked node, then the name.

        `yielding`: running jobs the waiting job may preempt once it is allowed to start, in
        the order victims are taken, each with how long it keeps its GPUs once told to stop.
        The admission cycle preempts as soon as the job fits with its victims gone, so a
        slot that needs them starts that long after, not when they would have ended.
        `protected`: when those not yet past their minimum runtime may first be preempted;
        before then they are no victims. `max_victims`: the most one slot may displace
        (`preemption.largest_plan`).
        """
        best: _Candidate | None = None
        rid = self._request_id(request)
        order = {key: i for i, key in enumerate(yielding)} if yielding else {}
        since = protected if yielding and protected else {}
        for name in self._hosts[rid]:
            occupancies = self._occupancies[name]
            ends = {not_before} | {o.end for o in occupancies if o.end > not_before}
            if since:  # a victim's protection ends: the cycle may preempt it from then on
                ends |= {since[o.job_key] for o in occupancies
                         if o.job_key in since and not_before < since[o.job_key] < o.end}
            times = sorted(ends)
            for t in times:
                if best is not None and t > best[0]:
                    break
                fit = self._fit(name, request, rid, t, t + duration_s)
                if fit is not None:
                    candidate = (t, 0, -fit[0], name, fit[1], ())
                    if best is None or candidate[:4] < best[:4]:
                        best = candidate
                    break
                if yielding:  # keeps looking: a fit without preempting may come first
                    found = self._displacing(name, request, rid, t, duration_s, yielding, order,
                                             since)
                    if found is not None and max_victims is not None and found[1] > max_victims:
                        found = None
                    if found is not None and (best is None or found[:4] < best[:4]):
                        best = found
        return Slot(best[0], best[3], best[4], best[5]) if best else None

    def _displacing(self, node: str, request: GpuRequest, rid: int, t: float, duration_s: float,
                    yielding: Mapping[str, float], order: Mapping[str, int],
                    since: Mapping[str, float]) -> _Candidate | None:
        """The slot on `node` if the job preempts at `t`: victims taken in order until it fits
        (as `preemption.plan_preemption` takes them), then those it does not need put back;
        only jobs that may be preempted at `t` (`since`) are victims."""
        running = sorted({o.job_key for o in self._occupancies[node]
                          if o.job_key in order and o.start <= t < o.end
                          and since.get(o.job_key, t) <= t}, key=order.__getitem__)

        def fit(gone: list[str]) -> tuple[float, tuple[float, tuple[GpuGrant, ...]]] | None:
            start = t + max(yielding[k] for k in gone)
            found = self._fit(node, request, rid, t, start + duration_s, frozenset(gone))
            return (start, found) if found is not None else None

        chosen: list[str] = []
        for key in running:
            chosen.append(key)
            if fit(chosen) is not None:
                break
        else:
            return None
        for key in reversed(chosen[:-1]):
            trial = [k for k in chosen if k != key]
            if fit(trial) is not None:
                chosen = trial
        result = fit(chosen)
        assert result is not None
        start, (score, grants) = result
        return (start, len(chosen), -score, node, grants, tuple(chosen))


def fluid_start(base: float, work_ahead_gpu_hours: float, capacity_gpus: float) -> float:
    """A coarse start estimate for jobs deep in the queue: the queue ahead drains at the rate
    of the whole cluster, start = base + work ahead / capacity."""
    if capacity_gpus <= 0:
        return base
    return base + work_ahead_gpu_hours / capacity_gpus * 3600.0
