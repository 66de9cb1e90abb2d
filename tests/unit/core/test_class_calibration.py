"""Estimated starts calibrated by how their class's simulated starts missed (eta.
calibrated_start), capped at the job's next aging step."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from carpool.core.decoding import job_from_object
from carpool.core.durations import format_duration
from carpool.core.estimate_ranges import (
    CLASS_MISSES,
    MIN_CLASS_MISSES,
    MIN_HIGHER_ARRIVALS,
    MIN_RANGE_SAMPLES,
    calibrated_start,
    class_misses,
    overdue_miss,
    simulated_miss,
    started_misses,
)
from carpool.core.fairshare import next_aging
from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord, StartMiss
from carpool.core.queueing import AdmissionConfig, Wait, admission_cycle
from carpool.core.resources import GpuGrant, JobClass, Phase
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer

LN2 = math.log(2)


def started(key: str, cls: JobClass, submitted: float, simulated: float | None,
            began: float) -> Job:
    return gpu_job(key, cls=cls, submitted=submitted, first_simulated_start=simulated,
                   phase=Phase.RUNNING, runs=(RunRecord(1, began, None, 1.0),))


def test_a_class_keeps_the_misses_of_its_latest_simulated_starts() -> None:
    assert simulated_miss(started("a/x", JobClass.LONG, 0, 100, 200)) == pytest.approx(LN2)
    assert simulated_miss(started("a/x", JobClass.LONG, 0, 30, 200)) is None  # under a minute
    assert simulated_miss(started("a/x", JobClass.LONG, 0, None, 200)) is None
    jobs = [started(f"a/l{i}", JobClass.LONG, 0, 100, 300 - i) for i in range(CLASS_MISSES + 5)]
    jobs.append(started("a/b", JobClass.BATCH, 0, 100, 50))
    # a batch job no longer in the snapshot: it started after a/b
    misses = class_misses(started_misses(jobs, [StartMiss(60.0, JobClass.BATCH, None, 0.0)]))
    # by start time: the 50 long jobs that started last (at 251..300), not those at 246..250
    assert len(misses[JobClass.LONG]) == CLASS_MISSES
    assert misses[JobClass.LONG][0] == pytest.approx(math.log(251 / 100))
    assert misses[JobClass.LONG][-1] == pytest.approx(math.log(300 / 100))
    assert misses[JobClass.BATCH] == [pytest.approx(math.log(50 / 100)), 0.0]


def test_jobs_still_waiting_past_their_simulated_start_count_as_late_as_they_are() -> None:
    # at 1000: a/w1 was simulated to wait 100 s and has waited 400 s: a miss of at least
    # ln 4; a/w2 is not yet due, a/w3 was promised under a minute, a/w4 never simulated
    waiting = [gpu_job("a/w1", cls=JobClass.LONG, submitted=600, first_simulated_start=700),
               gpu_job("a/w2", cls=JobClass.LONG, submitted=900, first_simulated_start=1200),
               gpu_job("a/w3", cls=JobClass.LONG, submitted=900, first_simulated_start=950),
               gpu_job("a/w4", cls=JobClass.LONG, submitted=100)]
    assert overdue_miss(waiting[0], 1000) == pytest.approx(math.log(4))
    assert [overdue_miss(job, 1000) for job in waiting[1:]] == [None, None, None]
    assert overdue_miss(started("a/s", JobClass.LONG, 0, 100, 900), 1000) is None
    on_time = [StartMiss(float(i), JobClass.LONG, None, 0.0) for i in range(CLASS_MISSES)]
    misses = class_misses(on_time, waiting, 1000)
    # the overdue job counts as the newest, the oldest start drops out
    assert misses[JobClass.LONG] == [0.0] * (CLASS_MISSES - 1) + [pytest.approx(math.log(4))]
    # with as many jobs overdue as half the sample, the median is late too
    late = [gpu_job(f"a/o{i}", cls=JobClass.LONG, submitted=600 + i,
                    first_simulated_start=700 + i) for i in range(CLASS_MISSES // 2)]
    assert statistics.median(class_misses(on_time, late, 1000)[JobClass.LONG]) > 0


def test_the_simulated_wait_is_scaled_by_the_median_miss_up_to_the_next_aging_step() -> None:
    twice = [LN2] * MIN_CLASS_MISSES
    # waits 300 s by the simulation; its class started twice as late: 600 s
    assert calibrated_start(1000, 1300, twice, None) == pytest.approx(1600)
    # ... but it ages a level at 1500: then it passes later arrivals and may preempt
    assert calibrated_start(1000, 1300, twice, 1500) == pytest.approx(1500)
    # a simulated start past the aging step is left as it is
    assert calibrated_start(1000, 1300, twice, 1200) == 1300
    # never earlier than the queue as it stands; no say with too few misses
    assert calibrated_start(1000, 1300, [-LN2] * MIN_CLASS_MISSES, None) == 1300
    assert calibrated_start(1000, 1300, twice[1:], None) == 1300


def test_next_aging_is_the_next_step_boundary_until_overdue() -> None:
    long_job = gpu_job("a/l", cls=JobClass.LONG, submitted=100)
    assert next_aging(long_job, 200, HOUR) == 100 + HOUR
    assert next_aging(long_job, 100 + HOUR, HOUR) == 100 + 2 * HOUR
    interactive = gpu_job("a/i", cls=JobClass.INTERACTIVE, submitted=100)
    assert next_aging(interactive, 200, HOUR) == 100 + HOUR
    assert next_aging(interactive, 100 + HOUR, HOUR) is None  # overdue: ages no more
    assert next_aging(long_job, 200, 0.0) is None  # no aging


def test_the_cycle_calibrates_waits_of_a_class_that_started_late() -> None:
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", count=2, estimate=HOUR, phase=Phase.RUNNING, node="n1",
                      grants=grants, attempts=1, runs=(RunRecord(1, 0.0, None, 2.0),))
    long_job = gpu_job("b/long", "b", JobClass.LONG, submitted=1000)
    batch = gpu_job("c/batch", "c", JobClass.BATCH, submitted=1000)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "abc"}

    def waits(misses: tuple[StartMiss, ...]) -> dict[str, tuple[float | str | None, ...]]:
        snapshot = ClusterSnapshot(1800.0, (running, long_job, batch), quotas,
                                   {"n1": gpu_node()}, start_misses=misses)
        result = admission_cycle(snapshot, AdmissionConfig(node_placer=packing_placer))
        return {w.job_key: (w.estimated_start, w.simulated_start, w.message)
                for w in result.waits}

    plain = waits(())
    assert plain["b/long"][:2] == (HOUR, HOUR)  # when a/run is expected to end
    # long jobs started twice as late as simulated: 1800 + 2 x 1800 = 5400, capped at the
    # long job's first aging step, 1000 + 3600 = 4600; batch jobs' estimates unchanged
    calibrated = waits((StartMiss(0.0, JobClass.LONG, None, LN2),) * MIN_CLASS_MISSES)
    start, simulated, message = calibrated["b/long"]
    assert (start, simulated) == (4600, HOUR)
    assert f"estimated start in {format_duration(4600 - 1800)}" in str(message)
    assert calibrated["c/batch"][:2] == plain["c/batch"][:2]


def test_the_operator_decodes_the_first_simulated_start() -> None:
    obj = {"metadata": {"namespace": "vision", "name": "finetune-7",
                        "creationTimestamp": "2026-12-01T10:00:00Z"},
           "spec": {"project": "vision", "class": "long", "estimatedDuration": "30m",
                    "gpu": {"count": 1, "memory": "10Gi", "isolation": "mps"}},
           "status": {"firstEstimatedStart": "2026-12-01T10:10:00Z",
                      "firstSimulatedStart": "2026-12-01T10:05:00Z"}}
    job = job_from_object(obj, Phase.QUEUED, 0, (), "", [])
    assert job.first_simulated_start == job.submitted_at + 300


def _batch_wait(window_s: float, *present: Job,
                arrivals: tuple[tuple[float, int, float, str], ...] = (),
                keep_promises: bool = True) -> Wait:
    """c/batch's wait behind a/run, which holds both GPUs of n1 until 3600; 20 batch jobs
    that started on time make its range the estimate itself."""
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", count=2, estimate=HOUR, phase=Phase.RUNNING, node="n1",
                      grants=grants, attempts=1, runs=(RunRecord(1, 0.0, None, 2.0),))
    batch = gpu_job("c/batch", "c", JobClass.BATCH, submitted=1000)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "acd"}
    on_time = tuple(StartMiss(float(i), JobClass.BATCH, 0.0, None)
                    for i in range(MIN_RANGE_SAMPLES))
    snapshot = ClusterSnapshot(1800.0, (running, batch, *present), quotas, {"n1": gpu_node()},
                               start_misses=on_time, recent_arrivals=arrivals)
    config = AdmissionConfig(node_placer=packing_placer, arrival_window_s=window_s,
                             keep_promises=keep_promises)
    found = admission_cycle(snapshot, config).wait_for("c/batch")
    assert found is not None
    return found


def test_higher_class_arrivals_widen_the_range_not_the_estimate() -> None:
    # ten interactive jobs just arrived with work far beyond the 2 GPUs: if such arrivals go
    # on, the batch job's 1800 s wait stretches by 1 / (1 - 0.8) = 5; the estimate and its
    # message stay the queue's, the range ends at the stretched start
    surge = tuple((1200.0 + i, int(JobClass.INTERACTIVE), 10 * HOUR, "d")
                  for i in range(MIN_HIGHER_ARRIVALS))
    # (interactive work may pass a due job too, so promises change nothing here)
    widened, off = _batch_wait(600.0, arrivals=surge), _batch_wait(0.0, arrivals=surge)
    assert widened.estimated_start == off.estimated_start == HOUR
    assert widened.message == off.message
    assert widened.message.endswith(f"; estimated start in {format_duration(1800)}")
    assert (off.estimated_start_low, off.estimated_start_high) == (HOUR, HOUR)
    assert widened.estimated_start_low == HOUR
    assert widened.estimated_start_high == pytest.approx(1800 + 5 * 1800)


def test_arrivals_of_jobs_still_present_count_too() -> None:
    # ten short jobs of another project, submitted 600-591 s ago, ran 300 s on one GPU
    # each: 3000 GPU-s over 600 s on 2 GPUs, rho = 2.5, capped at 0.8. They may overtake the
    # batch job until its promised start, not once it is due (only interactive work may):
    # its 1800 s wait stretches by 1 + 0.8 / (1 - 0), the work that overtook it; without
    # promises they pass it throughout, 1 / (1 - 0.8). Batch jobs arriving count for no class.
    done = tuple(gpu_job(f"d/s{i}", "d", JobClass.SHORT, submitted=1200.0 + i,
                         phase=Phase.SUCCEEDED, attempts=1,
                         runs=(RunRecord(1, 1200.0 + i, 1500.0 + i, 1.0),))
                 for i in range(MIN_HIGHER_ARRIVALS))
    assert _batch_wait(600.0, *done).estimated_start_high == pytest.approx(1800 + 1.8 * 1800)
    assert _batch_wait(600.0, *done, keep_promises=False).estimated_start_high == (
        pytest.approx(1800 + 5 * 1800))
    assert _batch_wait(600.0, *done[1:]).estimated_start_high == HOUR  # too few
    batch_done = tuple(replace(job, job_class=JobClass.BATCH) for job in done)
    assert _batch_wait(600.0, *batch_done).estimated_start_high == HOUR
    # an hour later the same ten are outside the window
    assert _batch_wait(500.0, *done).estimated_start_high == HOUR


def _interactive_wait(project: str, arrivals: tuple[tuple[float, int, float, str], ...]
                      ) -> Wait:
    """An interactive job of `project` waiting behind a/run, which holds both GPUs of n1
    until 3600 (project a has used them since 0; c and d have used nothing)."""
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", count=2, estimate=HOUR, phase=Phase.RUNNING, node="n1",
                      grants=grants, attempts=1, runs=(RunRecord(1, 0.0, None, 2.0),))
    waiting = gpu_job(f"{project}/notebook", project, JobClass.INTERACTIVE, count=2,
                      submitted=1000)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "acd"}
    on_time = tuple(StartMiss(float(i), JobClass.INTERACTIVE, 0.0, None)
                    for i in range(MIN_RANGE_SAMPLES))
    snapshot = ClusterSnapshot(1800.0, (running, waiting), quotas, {"n1": gpu_node()},
                               start_misses=on_time, recent_arrivals=arrivals)
    config = AdmissionConfig(node_placer=packing_placer)
    found = admission_cycle(snapshot, config).wait_for(waiting.key)
    assert found is not None and found.estimated_start == HOUR
    return found


def test_same_class_arrivals_of_lighter_projects_widen_the_range() -> None:
    # ten interactive jobs of project d (which has used nothing) came and went in the last
    # ten minutes with work far beyond the 2 GPUs: fair share ranks d's next ones ahead of an
    # interactive job of project a (which holds the GPUs), until a's job is promised its
    # start; a due interactive job no interactive arrival passes, so its 1800 s wait stretches
    # by 1 + 0.8 / (1 - 0)
    surge = tuple((1200.0 + i, int(JobClass.INTERACTIVE), 10 * HOUR, "d")
                  for i in range(MIN_HIGHER_ARRIVALS))
    assert _interactive_wait("a", surge).estimated_start_high == pytest.approx(
        1800 + 1.8 * 1800)
    # a's own arrivals rank behind its job, and d's pass no job of c, which has used as
    # little: no interactive range stretches (nothing arrives above interactive)
    own = tuple((*arrival[:3], "a") for arrival in surge)
    assert _interactive_wait("a", own).estimated_start_high == HOUR
    assert _interactive_wait("c", surge).estimated_start_high == HOUR
    assert _interactive_wait("c", surge[1:]).estimated_start_high == HOUR  # too few anyway
    assert _interactive_wait("a", surge[1:]).estimated_start_high == HOUR
