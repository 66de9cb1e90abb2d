"""How long a job runs: run times learned from finished jobs (per template, user and class),
kept for deleted jobs, and what a running job's own progress reports say is left."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from carpool.core.jobs import DurationEstimate, Job
from carpool.core.resources import JobClass, Phase

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



OVERRUN_FRACTION = 0.5  # a job past its expectation is expected to run this x its age more
# How far a reported job's rate may still change before it ends: the spread (log space) of
# its remaining time on top of what the spread of its recent rates says (rate changes,
# pauses, restarts from a checkpoint; near the end one pause is much of what is left).
PROGRESS_DRIFT = 0.2
UNSEEN_PAUSES = 0.3  # the range's end, for a job that reported no pause yet: this much more
JUST_BEGUN = 0.01  # done this attempt, below which a loop's first report gives no rate
MAX_PAUSE_SHARE = 0.9  # a job paused more than this share of its time says little of its rate
Z80 = 1.2816  # the 90th percentile of the standard normal: an 80 % range is +-Z80 sigma
_NORMAL = statistics.NormalDist()


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
    started) to `progress` in `progress_at - started` seconds; but None for a loop that has
    just begun (samples, no rate between them yet, under `JUST_BEGUN` done this attempt): that
    average would count its start-up (loading data and model, starting CUDA) as training, and
    a loop 0.1 % done when it first reports, 9 s after its process started, is not 2.5 hours
    long.

    The range: the spread of the recent rates (log space) and `PROGRESS_DRIFT`, for what may
    still change, combined as independent errors; its end `UNSEEN_PAUSES` later for a job
    that reported no pause yet.
    """
    started, progress, at = job.started_at, job.progress, job.progress_at
    if started is None or progress is None or at is None:
        return None
    detail = job.progress_detail
    rates = _recent_rates(detail.recent, started) if detail is not None else []
    if (detail is not None and detail.recent and not rates
            and progress - job.resumed_progress < JUST_BEGUN):
        return None  # the loop has just begun: its average would count its start-up
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


def learned_remaining(run_time: tuple[float, float, float], ran_s: float) -> Remaining:
    """What a job that does not report still needs by its run time (P10, expected, P90) and
    how long it has run.

    Within its expected run time: the expected less the time run. Each job is thus taken to
    end when a typical run of its kind would, and the running jobs' ends keep the spread
    their starts give them; the median of each one's run time given how long it has run
    would put none of them near its end, and the first of many to end, which a waiting job
    waits for, much later than it comes.

    Past it, with a spread known (P10 < P90): survival-style, the median and P10/P90 of the
    run time given that it is longer than `ran_s`, the run time taken as log-normal around
    the expected with the spreads its P10 and P90 give below and above (a split normal in
    log space, exact at all three). A job that overran goes on as the longer runs of its
    kind did. Past any run time that makes likely, or without a spread, the expected less
    the time run (negative: `remaining` gives it a share of the time it has run).
    """
    low_s, duration_s, high_s = run_time
    if low_s < high_s and ran_s >= duration_s > 0:
        mu = math.log(duration_s)
        above = max(math.log(high_s) - mu, 1e-6) / Z80
        outlived = _survival((math.log(ran_s) - mu) / above)  # P(run time > ran_s)
        if outlived > 1e-12:
            def after(q: float) -> float:  # the q-quantile of the run time, given ran_s
                z = -_NORMAL.inv_cdf(outlived * (1.0 - q))
                return math.exp(mu + z * above) - ran_s
            return Remaining(after(0.5), after(0.1), after(0.9))
    return Remaining(duration_s - ran_s, low_s - ran_s, high_s - ran_s)


def _survival(z: float) -> float:
    """P(Z > z) for a standard normal Z, accurate far in the tail."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


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
    leaves given how long it has run (`learned_remaining`). A job past its expectation with
    nothing better known (no spread of its template's run times, or far past them) is given
    `OVERRUN_FRACTION` of the time it has run so far (at least `min_remaining_s`): run times
    are heavy-tailed, so the longer a job has overrun the longer it is likely to go on; "any
    minute now" at every cycle made every estimate behind it too early. Never more than what
    its limit (maxDuration, enforced) leaves; a job past its limit is given `min_remaining_s`
    (it is being stopped). A job still within its expectation is not floored at
    `min_remaining_s`: that would push every estimate behind a job about to end up to
    `min_remaining_s` too late.
    """
    started = job.started_at
    elapsed = max(0.0, now - started) if started is not None else 0.0
    limit_left = job.max_duration_s - elapsed if job.max_duration_s > 0 else math.inf
    if limit_left <= 0:
        return Remaining(min_remaining_s, min_remaining_s, min_remaining_s)
    found = reported_remaining(job, now)
    if found is None:
        found = learned_remaining(run_time, elapsed)
    expected = found.expected
    if expected <= 0:
        expected = max(min_remaining_s, OVERRUN_FRACTION * elapsed)
    expected = min(expected, limit_left)
    low = min(expected, max(0.0, found.low))
    high = min(limit_left, max(expected, found.high))
    return Remaining(expected, low, high, found.reported)


# ---------------------------------------------------------------- start scenarios

def scenario_quantiles(key: str, count: int) -> tuple[float, ...]:
    """The quantiles a job's time is drawn at in `count` start scenarios: one in each of
    `count` equal strata, (i + 0.5) / count, in an order fixed by the job's key (a hash, so
    every cycle, process and run draws the same). Stratified, so each job's draws cover its
    whole distribution with few scenarios; ordered by the key, so jobs that end early in one
    scenario are not all the same jobs that end early in the next."""
    return _scenario_quantiles(key, count)


@functools.lru_cache(maxsize=65536)
def _scenario_quantiles(key: str, count: int) -> tuple[float, ...]:
    order = sorted(range(count), key=lambda i: hashlib.blake2b(
        f"{key}/{i}".encode(), digest_size=8).digest())
    return tuple((i + 0.5) / count for i in order)


def split_quantile(low: float, middle: float, high: float, q: float) -> float:
    """The q-quantile of a positive quantity log-normal around `middle` with the spreads
    its P10 (`low`) and P90 (`high`) give below and above (a split normal in log space,
    exact at all three)."""
    if not low < high or middle <= 0:
        return middle
    z = _NORMAL.inv_cdf(q)
    other = high if z >= 0 else max(low, 1e-9)
    return middle * math.exp(z * abs(math.log(other / middle)) / Z80)


def remaining_quantiles(job: Job, now: float, run_time: tuple[float, float, float],
                        min_remaining_s: float, quantiles: Sequence[float]
                        ) -> tuple[float, ...]:
    """The `quantiles` of what a GPU-holding job still needs (`remaining`, whose P10 and P90
    they meet for a job that reports): the job's ends in start scenarios.

    A job that does not report, with a spread known: quantiles of its run time given that
    it is longer than it has run (`learned_remaining`'s conditional log-normal, from its
    start on), less the time run. A waiting job waits for the first of several running jobs
    to end: planning each at its own expected end puts that first end wherever the
    expectations happen to fall, while scenarios in which each end is drawn give the
    distribution of the first one. Without a spread (or far past any run time its spread
    makes likely) the point `remaining` gives, at every quantile."""
    left = remaining(job, now, run_time, min_remaining_s)
    started = job.started_at
    elapsed = max(0.0, now - started) if started is not None else 0.0
    limit_left = job.max_duration_s - elapsed if job.max_duration_s > 0 else math.inf
    low_s, duration_s, high_s = run_time
    if limit_left <= 0 or (not left.reported and not (low_s < high_s and duration_s > 0)):
        return (left.expected,) * len(quantiles)
    if left.reported:
        return tuple(min(split_quantile(max(left.low, 1.0), max(left.expected, 1.0),
                                        max(left.high, 1.0), q), limit_left)
                     for q in quantiles)
    mu = math.log(duration_s)
    below = max(mu - math.log(low_s), 1e-6) / Z80
    above = max(math.log(high_s) - mu, 1e-6) / Z80
    if elapsed > 0:
        x = math.log(elapsed)
        ran = _NORMAL.cdf((x - mu) / (below if x < mu else above))
    else:
        ran = 0.0
    if 1.0 - ran < 1e-12:
        return (left.expected,) * len(quantiles)
    drawn = []
    for q in quantiles:
        z = _NORMAL.inv_cdf(min(ran + q * (1.0 - ran), 1.0 - 1e-12))
        value = math.exp(mu + z * (below if z < 0 else above)) - elapsed
        drawn.append(min(max(value, 1.0), limit_left))
    return tuple(drawn)
