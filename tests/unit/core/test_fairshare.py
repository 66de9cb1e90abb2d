"""Fair share: decayed usage, nominal GPU fractions, aging and queue order."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.fairshare import (
    OVERDUE_LEVEL,
    decay_factor,
    decayed_gpu_hours,
    effective_level,
    nominal_fraction,
    rank_queue,
)
from carpool.core.jobs import Job, RunRecord
from carpool.core.resources import GpuRequest, Isolation, JobClass

GIB = 1024
HOUR = 3600.0


def job(key: str, project: str = "a", cls: JobClass = JobClass.BATCH,
        submitted: float = 0.0, promised: float | None = None) -> Job:
    return Job(key, project, cls, GpuRequest(1, 10 * GIB), submitted, HOUR,
               first_estimated_start=promised)


def test_decay_halves_every_half_life() -> None:
    assert decay_factor(0, 100) == 1.0
    assert decay_factor(100, 100) == pytest.approx(0.5)
    assert decay_factor(300, 100) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="half-life"):
        decay_factor(1, 0)


def test_decayed_usage_matches_numeric_integral() -> None:
    fraction, start, end, now, half_life = 2.0, 1000.0, 8200.0, 20000.0, 5000.0
    steps = 20000
    dt = (end - start) / steps
    numeric = sum(fraction * 2 ** (-(now - (start + (i + 0.5) * dt)) / half_life) * dt
                  for i in range(steps)) / HOUR
    assert decayed_gpu_hours(fraction, start, end, now, half_life) == pytest.approx(numeric,
                                                                                   rel=1e-6)


def test_decayed_usage_approaches_plain_gpu_hours_with_long_half_life() -> None:
    assert decayed_gpu_hours(1.5, 0, 2 * HOUR, 2 * HOUR, 1e12) == pytest.approx(3.0)


def test_decayed_usage_counts_only_the_past() -> None:
    assert decayed_gpu_hours(1.0, 100, 50, 200, 10) == 0.0
    assert decayed_gpu_hours(1.0, 0, 10 * HOUR, HOUR, 1e12) == pytest.approx(1.0)


def test_nominal_fraction_follows_the_gpuhours_definition() -> None:
    assert nominal_fraction(GpuRequest(2, 0, isolation=Isolation.EXCLUSIVE), 80 * GIB) == 2.0
    assert nominal_fraction(GpuRequest(1, 20 * GIB), 80 * GIB) == 0.25
    assert nominal_fraction(GpuRequest(1, 8 * GIB, cores_pct=50), 80 * GIB) == 0.5
    assert nominal_fraction(GpuRequest(1, 0, isolation=Isolation.MIG, mig_slices=2),
                            80 * GIB) == pytest.approx(2 / 7)


def test_aging_lowers_the_level_one_class_per_step_down_to_overdue() -> None:
    batch = job("n/b", cls=JobClass.BATCH, submitted=0)
    assert effective_level(batch, 0, 100) == 3
    assert effective_level(batch, 99, 100) == 3
    assert effective_level(batch, 100, 100) == 2
    assert effective_level(batch, 300, 100) == 0  # competes as interactive after 3 steps
    assert effective_level(batch, 400, 100) == OVERDUE_LEVEL
    assert effective_level(batch, 10_000, 100) == OVERDUE_LEVEL
    assert effective_level(batch, 10_000, 0) == 3  # aging off


def test_class_orders_first() -> None:
    jobs = [job("n/batch", cls=JobClass.BATCH, submitted=0),
            job("n/long", cls=JobClass.LONG, submitted=1),
            job("n/inter", cls=JobClass.INTERACTIVE, submitted=3),
            job("n/short", cls=JobClass.SHORT, submitted=2)]
    order = [j.key for _, j in rank_queue(jobs, {}, {}, 10, 3600, {})]
    assert order == ["n/inter", "n/short", "n/long", "n/batch"]


def test_lighter_project_goes_first_then_weight_counts() -> None:
    heavy, light = job("h/1", "heavy", submitted=0), job("l/1", "light", submitted=5)
    usage = {"heavy": 10.0, "light": 2.0}
    order = [j.key for _, j in rank_queue([heavy, light], usage, {}, 10, 3600, {})]
    assert order == ["l/1", "h/1"]
    # heavy's weight 10 makes its share 1.0 < light's 2.0
    order = [j.key for _, j in rank_queue([heavy, light], usage, {"heavy": 10.0}, 10, 3600, {})]
    assert order == ["h/1", "l/1"]


def test_projects_interleave_by_expected_use_of_their_earlier_jobs() -> None:
    a_jobs = [job(f"a/{i}", "a", submitted=i) for i in range(3)]
    b_jobs = [job(f"b/{i}", "b", submitted=10 + i) for i in range(3)]
    expected = {j.key: 1.0 for j in a_jobs + b_jobs}
    order = [j.key for _, j in rank_queue(a_jobs + b_jobs, {}, {}, 20, 3600, expected)]
    assert order == ["a/0", "b/0", "a/1", "b/1", "a/2", "b/2"]
    # with weight 2, project a gets two turns for b's one
    order = [j.key for _, j in rank_queue(a_jobs + b_jobs, {}, {"a": 2.0}, 20, 3600, expected)]
    assert order == ["a/0", "b/0", "a/1", "a/2", "b/1", "b/2"]


def test_overdue_jobs_go_first_by_submit_time_only() -> None:
    old_batch = job("h/old", "heavy", JobClass.BATCH, submitted=0)
    new_inter = job("l/new", "light", JobClass.INTERACTIVE, submitted=390)
    usage = {"heavy": 1e6}
    order = [j.key for _, j in rank_queue([new_inter, old_batch], usage, {}, 400, 100, {})]
    assert order == ["h/old", "l/new"]


def test_a_due_job_ranks_ahead_of_all_but_interactive_work() -> None:
    """Past its promised start (100) a batch job is due: the short job that arrived later and
    would overtake it no longer does, the interactive one still does, and a batch job whose
    promise is still ahead keeps its class."""
    due = job("a/due", cls=JobClass.BATCH, submitted=0, promised=100)
    short = job("b/short", "b", JobClass.SHORT, submitted=50)
    inter = job("b/inter", "b", JobClass.INTERACTIVE, submitted=60)
    later = job("a/later", cls=JobClass.BATCH, submitted=1, promised=500)
    jobs = [later, short, inter, due]
    assert [j.key for _, j in rank_queue(jobs, {}, {}, 99, 3600, {})] == [
        "b/inter", "b/short", "a/due", "a/later"]
    assert [j.key for _, j in rank_queue(jobs, {}, {}, 100, 3600, {})] == [
        "b/inter", "a/due", "b/short", "a/later"]
    assert [j.key for _, j in rank_queue(jobs, {}, {}, 100, 3600, {}, keep_promises=False)] == [
        "b/inter", "b/short", "a/due", "a/later"]


def test_due_jobs_go_by_promise_and_a_started_job_is_never_due() -> None:
    """Earliest promise first, whatever the fair share says; a job that has run (requeued
    after a preemption) was promised its first start only, which it had."""
    early = job("h/early", "heavy", JobClass.LONG, submitted=20, promised=50)
    late = job("l/late", "light", JobClass.BATCH, submitted=10, promised=80)
    usage = {"heavy": 1e6}
    assert [j.key for _, j in rank_queue([late, early], usage, {}, 100, 3600, {})] == [
        "h/early", "l/late"]
    ran = replace(job("l/ran", "light", JobClass.BATCH, submitted=0, promised=10),
                  runs=(RunRecord(1, 10, 40, 1.0),))
    short = job("h/short", "heavy", JobClass.SHORT, submitted=30)
    assert [j.key for _, j in rank_queue([ran, short], usage, {}, 100, 3600, {})] == [
        "h/short", "l/ran"]


def test_of_due_jobs_promised_the_same_start_the_first_submitted_goes_first() -> None:
    """A short job that overtook a waiting batch job was promised the same slot (the end of
    the job both wait for); once both are due, the promise given first is kept, however much
    more the first job's project has used."""
    first = job("h/first", "heavy", JobClass.BATCH, submitted=10, promised=60)
    overtook = job("l/overtook", "light", JobClass.SHORT, submitted=20, promised=60)
    usage = {"heavy": 1e6}
    assert [j.key for _, j in rank_queue([overtook, first], usage, {}, 59, 3600, {})] == [
        "l/overtook", "h/first"]
    assert [j.key for _, j in rank_queue([overtook, first], usage, {}, 60, 3600, {})] == [
        "h/first", "l/overtook"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(list(JobClass)),
                          st.integers(0, 1000), st.none() | st.integers(0, 6000)),
                min_size=1, max_size=12),
       st.integers(0, 5000), st.randoms(use_true_random=False))
def test_no_later_job_overtakes_an_overdue_one(
        specs: list[tuple[str, JobClass, int, int | None]], now_offset: int,
        rnd: random.Random) -> None:
    """The aging bound: once overdue, only jobs submitted earlier are ranked ahead, however
    many jobs are due; and a due job has only interactive, overdue, earlier-promised due jobs
    or due jobs promised the same start and submitted earlier ahead of it."""
    step = 100.0
    jobs = [job(f"{p}/{i}", p, cls, float(sub), None if promise is None else sub + promise)
            for i, (p, cls, sub, promise) in enumerate(specs)]
    now = 1000.0 + now_offset
    usage = {"a": 0.0, "b": 50.0, "c": 1e9}
    ranked = [j for _, j in rank_queue(jobs, usage, {"b": 3.0}, now, step, {})]
    shuffled = list(jobs)
    rnd.shuffle(shuffled)
    assert [j.key for j in ranked] == [
        j.key for _, j in rank_queue(shuffled, usage, {"b": 3.0}, now, step, {})]
    for i, overdue in enumerate(ranked):
        if effective_level(overdue, now, step) != OVERDUE_LEVEL:
            continue
        assert now - overdue.submitted_at >= (int(overdue.job_class) + 1) * step
        for earlier in ranked[:i]:
            assert (earlier.submitted_at, earlier.key) < (overdue.submitted_at, overdue.key)
    for i, due in enumerate(ranked):
        promised = due.first_estimated_start
        if (promised is None or promised > now
                or effective_level(due, now, step) == OVERDUE_LEVEL):
            continue
        for ahead in ranked[:i]:
            level = effective_level(ahead, now, step)
            assert level <= 0 or (ahead.first_estimated_start or math.inf, ahead.submitted_at,
                                  ahead.key) < (promised, due.submitted_at, due.key)


def test_rank_keys_are_finite() -> None:
    keys = [k for k, _ in rank_queue([job("a/1")], {"a": 3.0}, {"a": 0.5}, 0, 100, {})]
    assert keys[0].share == 6.0 and math.isfinite(keys[0].share)
