"""Accounting: GPU-hours from run records, per project, idempotent; memory efficiency."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.accounting import (
    grants_fraction,
    held_fraction,
    job_gpu_hours,
    memory_efficiency,
    project_usage,
    retire_job,
    run_gpu_hours_between,
)
from carpool.core.jobs import Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    JobClass,
    MigInstance,
    NodeInventory,
    Phase,
)
from carpool_testbed.builders import GIB, HOUR, project_gpu_hours


def job(key: str, project: str = "a", runs: tuple[RunRecord, ...] = (),
        peak: int | None = None, memory_gib: int = 10) -> Job:
    return Job(key, project, JobClass.BATCH, GpuRequest(1, memory_gib * GIB), 0.0, HOUR,
               runs=runs, peak_memory_mib=peak)


def test_grants_fraction_exclusive_shared_and_mig() -> None:
    mig = MigInstance("mig-1", "2g.35gb", 2, 35 * GIB)
    inv = NodeInventory("n", (Gpu(0, "g0", "H200", 140 * GIB),
                              Gpu(1, "g1", "H200", 140 * GIB, mig_instances=(mig,))))
    assert grants_fraction([GpuGrant("g0", 140 * GIB, 100, exclusive=True)], inv) == 1.0
    assert grants_fraction([GpuGrant("g0", 35 * GIB, 10)], inv) == pytest.approx(0.25)
    assert grants_fraction([GpuGrant("g0", 14 * GIB, 50)], inv) == pytest.approx(0.5)
    assert grants_fraction([GpuGrant("g1", 35 * GIB, 0, mig_instance="mig-1")],
                           inv) == pytest.approx(2 / 7)
    with pytest.raises(ValueError, match="lacks"):
        grants_fraction([GpuGrant("nope", 1, 1)], inv)


def test_held_fraction_falls_back_to_the_run_record_then_nominal() -> None:
    inv = NodeInventory("n", (Gpu(0, "g0", "H200", 100 * GIB),))
    nodes = {"n": NodeState(inv)}
    running = Job("a/j", "a", JobClass.BATCH, GpuRequest(1, 50 * GIB), 0, HOUR,
                  phase=Phase.RUNNING, node="n", grants=(GpuGrant("g0", 50 * GIB, 0),),
                  runs=(RunRecord(1, 0, None, 0.7),))
    assert held_fraction(running, nodes, 9.0) == pytest.approx(0.5)
    assert held_fraction(running, {}, 9.0) == 0.7
    assert held_fraction(job("a/k"), {}, 9.0) == 9.0


def test_job_hours_sum_all_attempts_and_count_open_runs_to_now() -> None:
    j = job("a/j", runs=(RunRecord(1, 0, HOUR, 1.0), RunRecord(2, 2 * HOUR, None, 0.5)))
    assert job_gpu_hours(j, 4 * HOUR) == pytest.approx(1.0 + 1.0)


def test_window_clips_runs_to_the_period_and_now() -> None:
    run = RunRecord(1, 0, 10 * HOUR, 2.0)
    assert run_gpu_hours_between(run, 4 * HOUR, 6 * HOUR, 100 * HOUR) == pytest.approx(4.0)
    assert run_gpu_hours_between(run, 0, 100 * HOUR, 3 * HOUR) == pytest.approx(6.0)
    assert run_gpu_hours_between(run, 20 * HOUR, 30 * HOUR, 100 * HOUR) == 0.0


def test_run_records_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="before it starts"):
        RunRecord(1, 10, 5, 1.0)
    with pytest.raises(ValueError, match="repeat an attempt"):
        job("a/j", runs=(RunRecord(1, 0, 1, 1.0), RunRecord(1, 2, 3, 1.0)))


def test_project_usage_counts_this_period_only() -> None:
    quota = ProjectQuota("a", frozenset({"a"}), period_s=10 * HOUR, period_anchor=0)
    jobs = [job("a/1", runs=(RunRecord(1, 8 * HOUR, 12 * HOUR, 1.0),)),
            job("a/2", runs=(RunRecord(1, 11 * HOUR, None, 0.5),)),
            job("b/1", "b", runs=(RunRecord(1, 11 * HOUR, None, 1.0),))]
    usage = project_usage(quota, jobs, 13 * HOUR, 1e12)
    assert usage.period_start == 10 * HOUR
    assert usage.gpu_hours_used == pytest.approx(2.0 + 1.0)
    assert usage.decayed_gpu_hours == pytest.approx(4.0 + 1.0)


def test_retiring_a_deleted_job_keeps_its_usage_and_is_idempotent() -> None:
    quota = ProjectQuota("a", frozenset({"a"}), period_s=100 * HOUR)
    done = job("a/1", runs=(RunRecord(1, 0, 2 * HOUR, 1.0),))
    now = 5 * HOUR
    before = project_usage(quota, [done], now, 1e12)
    retired = retire_job(None, done, quota, now, 1e12)
    assert retire_job(retired, done, quota, now, 1e12) == retired
    after = project_usage(quota, [], now, 1e12, retired)
    assert after.gpu_hours_used == pytest.approx(before.gpu_hours_used)
    assert after.decayed_gpu_hours == pytest.approx(before.decayed_gpu_hours)
    # the job reappearing in a snapshot (a stale cache) is not counted twice
    again = project_usage(quota, [done], now, 1e12, retired)
    assert again.gpu_hours_used == pytest.approx(before.gpu_hours_used)


def test_retired_usage_decays_and_resets_with_the_period() -> None:
    quota = ProjectQuota("a", frozenset({"a"}), period_s=10 * HOUR)
    retired = retire_job(None, job("a/1", runs=(RunRecord(1, 0, HOUR, 1.0),)), quota,
                         2 * HOUR, 1e12)
    next_period = project_usage(quota, [], 12 * HOUR, HOUR, retired)
    assert next_period.gpu_hours_used == 0.0
    assert next_period.decayed_gpu_hours == pytest.approx(1.0 * 2 ** -10, rel=0.05)


def test_memory_efficiency_is_peak_over_requested() -> None:
    jobs = [job("a/1", peak=5 * GIB, memory_gib=10), job("a/2", peak=10 * GIB, memory_gib=10),
            job("a/3", peak=None)]
    eff = memory_efficiency(jobs)
    assert (eff.requested_mib, eff.peak_mib, eff.jobs) == (20 * GIB, 15 * GIB, 2)
    assert eff.ratio == pytest.approx(0.75)
    assert memory_efficiency([job("a/3")]).ratio is None


runs_strategy = st.lists(
    st.tuples(st.floats(0, 50 * HOUR), st.one_of(st.none(), st.floats(0, 20 * HOUR)),
              st.floats(0, 8)),
    max_size=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), runs_strategy), max_size=10),
       st.floats(50 * HOUR, 80 * HOUR))
def test_gpu_hours_are_conserved_and_recomputing_never_double_counts(
        specs: list[tuple[str, list[tuple[float, float | None, float]]]], now: float) -> None:
    jobs = []
    for i, (project, raw) in enumerate(specs):
        runs = tuple(RunRecord(k + 1, start, None if length is None else start + length, frac)
                     for k, (start, length, frac) in enumerate(raw))
        jobs.append(job(f"{project}/j{i}", project, runs))
    totals = project_gpu_hours(jobs, now)
    assert project_gpu_hours(jobs, now) == totals  # recomputing gives the same
    assert project_gpu_hours(list(reversed(jobs)), now) == pytest.approx(totals)
    for project, total in totals.items():
        assert total == pytest.approx(sum(job_gpu_hours(j, now) for j in jobs
                                          if j.project == project))
    quota = ProjectQuota("a", frozenset({"a"}), period_s=1e9)
    assert project_usage(quota, jobs, now, 1e15).gpu_hours_used == pytest.approx(
        totals.get("a", 0.0), rel=1e-6, abs=1e-9)
