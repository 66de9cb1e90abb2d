"""Estimated-start ranges, higher-class arrivals, and what the operator decodes for them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from carpool.core.decoding import job_from_object
from carpool.core.estimate_ranges import (
    MAX_HIGHER_LOAD,
    MIN_HIGHER_ARRIVALS,
    MIN_RANGE_SAMPLES,
    RATE_ARRIVALS,
    RECENT_MISSES,
    Arrival,
    higher_class_load,
    overtaking_load,
    recent_arrivals,
    start_range,
    started_misses,
    wait_miss,
    wait_misses,
    wait_stretch,
)
from carpool.core.jobs import (
    ClusterSnapshot,
    DurationEstimate,
    Job,
    ProgressDetail,
    ProjectQuota,
    RunRecord,
    StartMiss,
    job_template,
)
from carpool.core.queueing import AdmissionConfig, admission_cycle
from carpool.core.resources import GpuGrant, JobClass, Phase
from carpool.core.run_times import (
    PROGRESS_DRIFT,
    UNSEEN_PAUSES,
    Z80,
    learned_remaining,
    run_time,
)
from carpool.reporting import relative_range
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer


def started(key: str, submitted: float, promised: float | None, began: float) -> Job:
    return gpu_job(key, submitted=submitted, first_estimated_start=promised,
                   phase=Phase.RUNNING, runs=(RunRecord(1, began, None, 1.0),))


def test_a_miss_is_the_log_of_actual_over_promised_wait() -> None:
    assert wait_miss(started("a/x", 0, 100, 200)) == pytest.approx(math.log(2))
    assert wait_miss(started("a/x", 0, 30, 200)) is None  # promised under a minute
    assert wait_miss(started("a/x", 0, None, 200)) is None  # never shown an estimate
    assert wait_miss(gpu_job("a/q", first_estimated_start=100)) is None  # not started


def test_the_range_scales_the_promised_wait_by_p10_and_p90_misses() -> None:
    assert start_range(0, 100, [0.0] * (MIN_RANGE_SAMPLES - 1)) is None
    # misses of ln 0.5 .. ln 2 evenly: P10 and P90 interpolate between them
    misses = wait_misses(started_misses(
        [started(f"a/{i}", 0, 100, 50 + 150 * i / 19) for i in range(20)]))
    assert len(misses) == MIN_RANGE_SAMPLES
    low, high = start_range(1000, 1100, misses) or (0, 0)
    assert 1000 + 100 * 0.5 < low < 1100 < high < 1000 + 100 * 2.0
    # an estimate that says "now" has no range to speak of
    assert start_range(1000, 1000, misses) == (1000, 1000)


def test_ranges_follow_the_latest_misses_only() -> None:
    # a cluster's first estimates came out twice too late (users over-estimate), the latest
    # twice too early: only the latest say what a range shown now should hold
    early = [started(f"a/old{i}", 0, 200, 100 + i * 1e-3) for i in range(RECENT_MISSES)]
    late = [started(f"a/new{i}", 1000, 1100, 1200 + i * 1e-3) for i in range(RECENT_MISSES)]
    misses = wait_misses(started_misses([*late, *early]))  # any order: by start time
    assert misses == pytest.approx([math.log(2)] * RECENT_MISSES, abs=1e-3)
    low, high = start_range(5000, 5100, misses) or (0, 0)
    assert (low, high) == (5100, pytest.approx(5200, abs=0.1))
    # misses of jobs no longer in the snapshot count by start time with those still there
    gone = [StartMiss(float(i), JobClass.BATCH, -1.0, None) for i in range(RECENT_MISSES)]
    assert wait_misses(started_misses(late[:10], gone)).count(-1.0) == RECENT_MISSES - 10


def test_higher_class_arrivals_load_lower_classes_only() -> None:
    # the latest 20 interactive arrivals, 360 GPU-seconds each, came over the last hour on
    # 4 GPUs: rho = 7200 / (3600 x 4) = 0.5
    arrivals = [(3420.0 - 180.0 * i, int(JobClass.INTERACTIVE), 360.0) for i in range(20)]
    load = higher_class_load(3600.0, 7200.0, 4.0, arrivals)
    assert JobClass.INTERACTIVE not in load  # nothing above it
    assert load[JobClass.BATCH] == pytest.approx(0.5)
    assert load[JobClass.SHORT] == pytest.approx(0.5)
    # only the latest RATE_ARRIVALS count: a busier past does not
    older = [(-1000.0 - i, int(JobClass.SHORT), 1e9) for i in range(20)]
    assert higher_class_load(3600.0, 7200.0, 4.0, [*arrivals, *older])[
        JobClass.BATCH] == pytest.approx(0.5)
    assert RATE_ARRIVALS == 20
    # an hour later with nothing new: the same work over twice the time, rho = 0.25
    assert higher_class_load(7200.0, 7200.0, 4.0, arrivals)[
        JobClass.BATCH] == pytest.approx(0.25)
    assert higher_class_load(3600.0, 7200.0, 4.0, arrivals[:MIN_HIGHER_ARRIVALS - 1]) == {}
    assert higher_class_load(3600.0, 0.0, 4.0, arrivals) == {}  # off
    old = [(0.0, int(JobClass.INTERACTIVE), 1e9)] * 20  # outside the window
    assert higher_class_load(7200.0, 3600.0, 4.0, old) == {}
    flood = [(3600.0, int(JobClass.SHORT), 1e9)] * 20
    flooded = higher_class_load(3600.0, 3600.0, 4.0, flood)
    assert JobClass.SHORT not in flooded
    assert flooded[JobClass.LONG] == pytest.approx(MAX_HIGHER_LOAD)  # capped


def test_a_class_is_overtaken_by_its_own_arrivals_from_lighter_projects() -> None:
    # 20 interactive arrivals of project b, 360 GPU-seconds each over the last hour on 4
    # GPUs: rho = 0.5 for an interactive job of a project heavier than b, none for others
    arrivals = [Arrival(3420.0 - 180.0 * i, int(JobClass.INTERACTIVE), 360.0, "b")
                for i in range(20)]
    recent = recent_arrivals(3600.0, 7200.0, arrivals)
    interactive = int(JobClass.INTERACTIVE)
    assert overtaking_load(3600.0, 4.0, recent, interactive,
                           frozenset({"b", "c"})) == pytest.approx(0.5)
    assert overtaking_load(3600.0, 4.0, recent, interactive, frozenset({"c"})) is None
    assert overtaking_load(3600.0, 4.0, recent, interactive, frozenset()) is None
    # a lower class counts them whatever the projects: they are above it
    assert overtaking_load(3600.0, 4.0, recent, int(JobClass.SHORT),
                           frozenset()) == pytest.approx(0.5)
    # the latest RATE_ARRIVALS of those that may overtake: ten batch arrivals of b are not
    # counted for a short job, and push the older interactive ones out for a batch job of a
    # project heavier than b
    batch = [Arrival(3590.0 + i, int(JobClass.BATCH), 0.0, "b") for i in range(10)]
    recent = recent_arrivals(3600.0, 7200.0, [*arrivals, *batch])
    assert overtaking_load(3600.0, 4.0, recent, int(JobClass.SHORT),
                           frozenset({"b"})) == pytest.approx(0.5)
    assert overtaking_load(3600.0, 4.0, recent, int(JobClass.BATCH), frozenset({"b"})) == (
        pytest.approx(10 * 360.0 / ((3600.0 - 1800.0) * 4.0)))
    assert recent_arrivals(3600.0, 0.0, arrivals) == []  # off


def test_a_wait_stretches_by_what_overtakes_it_then_by_what_passes_it_when_due() -> None:
    # half the capacity taken by classes that may overtake the job until its promise, none by
    # those that may pass it once due: the work that overtook it is all it waits for
    assert wait_stretch(0.5, 0.0) == pytest.approx(1.5)
    # the same classes pass throughout (promises off, or an interactive surge): a priority
    # queue's 1 / (1 - rho)
    assert wait_stretch(0.5, 0.5) == pytest.approx(2.0)
    assert wait_stretch(MAX_HIGHER_LOAD, MAX_HIGHER_LOAD) == pytest.approx(5.0)
    assert wait_stretch(MAX_HIGHER_LOAD, 0.25) == pytest.approx(1 + 0.8 / 0.75)
    assert wait_stretch(0.0, 0.0) == 1.0


def test_the_operator_decodes_the_template_and_the_first_estimate() -> None:
    obj = {"metadata": {"namespace": "vision", "name": "finetune-7",
                        "creationTimestamp": "2026-12-01T10:00:00Z"},
           "spec": {"project": "vision", "class": "short", "estimatedDuration": "30m",
                    "gpu": {"count": 1, "memory": "10Gi", "isolation": "mps"},
                    "template": {"spec": {"containers": [{"name": "m", "image": "lab/ft:2"}]}}},
           "status": {"firstEstimatedStart": "2026-12-01T10:05:00Z"}}
    job = job_from_object(obj, Phase.QUEUED, 0, (), "", [])
    assert job.template == job_template("finetune-8", "lab/ft:2") == "finetune@lab/ft:2"
    assert job.first_estimated_start == job.submitted_at + 300


def test_the_range_reads_as_from_now() -> None:
    now = 1_800_000_000.0
    assert relative_range(("2027-01-15T08:02:00Z", "2027-01-15T08:09:00Z"), now) == "2m-9m"
    assert relative_range(None, now) == ""


def test_jobs_behind_a_job_that_reports_progress_get_its_range() -> None:
    """The running job reports a steady rate: 1,000 s left, P10-P90 e^-+0.26 around that
    (its end 30 % later still: it has not paused yet). The job waiting for its GPUs gets that
    range around its start; the one behind that, the same spread through the first one's
    run time (no history: no spread of its own). Without reports, only the misses of
    started jobs (here all right on time) make the ranges: none wider than the estimate."""
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    samples = tuple((600.0 + 100 * i, 0.3 + 0.05 * i) for i in range(5))
    running = gpu_job("a/run", count=2, estimate=HOUR, phase=Phase.RUNNING, node="n1",
                      grants=grants, attempts=1, runs=(RunRecord(1, 0.0, None, 2.0),),
                      progress=0.5, progress_at=1000.0,
                      progress_detail=ProgressDetail("train", 0.0, samples))
    first = gpu_job("b/first", "b", count=2, submitted=1000.0, estimate=600.0)
    second = gpu_job("b/second", "b", count=2, submitted=1000.5, estimate=600.0)
    on_time = tuple(StartMiss(float(i), JobClass.BATCH, 0.0, None)
                    for i in range(MIN_RANGE_SAMPLES))
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "ab"}

    def ranges(job: Job) -> dict[str, tuple[float | None, float | None, float | None]]:
        snapshot = ClusterSnapshot(1000.0, (job, first, second), quotas, {"n1": gpu_node()},
                                   start_misses=on_time)
        result = admission_cycle(snapshot, AdmissionConfig(node_placer=packing_placer,
                                                           class_calibration=False))
        return {w.job_key: (w.estimated_start_low, w.estimated_start, w.estimated_start_high)
                for w in result.waits}

    reported = ranges(running)
    low, start, high = reported["b/first"]
    assert start == pytest.approx(2000.0)
    assert low == pytest.approx(1000.0 + 1000.0 * math.exp(-Z80 * PROGRESS_DRIFT))
    assert high == pytest.approx(1000.0 + 1000.0 * (1 + UNSEEN_PAUSES)
                                 * math.exp(Z80 * PROGRESS_DRIFT))
    low2, start2, high2 = reported["b/second"]
    assert start2 == pytest.approx(2600.0)
    assert (start2 - low2, high2 - start2) == (pytest.approx(start - low),
                                               pytest.approx(high - start))
    # the same job without reports: expected to end at its estimate, no spread of its own
    silent = ranges(replace(running, progress=None, progress_at=None, progress_detail=None))
    assert silent["b/first"] == (HOUR, HOUR, HOUR)


def test_a_job_behind_a_silent_job_may_start_as_early_as_that_job_may_end() -> None:
    """The running job does not report; its kind's runs took 1,000 s, P10-P90 e^-+0.5 of
    that. The job waiting for its GPUs starts when the running one is expected to end
    (`run_times.learned_remaining`), and its range begins where that end's P10 is; the misses
    of started jobs (here all right on time) alone would begin it at the estimate. Its range
    ends where the misses say: a silent job's late side is theirs. (The cycle's own
    simulation, without start scenarios: `test_start_scenarios` has what they add.)"""
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", count=2, estimate=HOUR, phase=Phase.RUNNING, node="n1",
                      grants=grants, attempts=1, runs=(RunRecord(1, 0.0, None, 2.0),),
                      template="train")
    history = DurationEstimate(1000.0, 1.0, 10, math.log(1000.0), 0.0, 0.1, 0.2, -0.5 * Z80,
                               0.5 * Z80)
    waiting = gpu_job("b/next", "b", count=2, submitted=400.0, estimate=600.0)
    on_time = tuple(StartMiss(float(i), JobClass.BATCH, 0.0, None)
                    for i in range(MIN_RANGE_SAMPLES))
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "ab"}
    snapshot = ClusterSnapshot(400.0, (running, waiting), quotas, {"n1": gpu_node()},
                               start_misses=on_time, learned={("a", "train"): history})
    result = admission_cycle(snapshot, AdmissionConfig(node_placer=packing_placer,
                                                       class_calibration=False,
                                                       start_scenarios=0))
    wait = next(w for w in result.waits if w.job_key == "b/next")
    left = learned_remaining(run_time(running, snapshot.learned), 400.0)
    assert wait.estimated_start == pytest.approx(400.0 + left.expected)
    assert wait.estimated_start_low == pytest.approx(400.0 + left.low)
    assert wait.estimated_start_high == pytest.approx(wait.estimated_start)
    assert left.low < left.expected
