"""Estimated starts from start scenarios: a waiting job waits for the first of several running
jobs to end, so its estimate is the median start over forward simulations in which each
running job's end is drawn from its own distribution (`queueing._scenario_starts`,
`run_times.remaining_quantiles`)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.core.jobs import ClusterSnapshot, DurationEstimate, ProjectQuota, RunRecord
from carpool.core.queueing import AdmissionConfig, admission_cycle
from carpool.core.resources import GpuGrant, Phase
from carpool.core.run_times import (
    Z80,
    learned_remaining,
    remaining,
    remaining_quantiles,
    run_time,
    scenario_quantiles,
    split_quantile,
)
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer

# a kind whose runs took 1,000 s, P10-P90 e^-+0.5 of that
HISTORY = DurationEstimate(1000.0, 1.0, 10, math.log(1000.0), 0.0, 0.1, 0.2, -0.5 * Z80,
                           0.5 * Z80)


def test_each_job_draws_one_quantile_per_stratum_in_an_order_its_key_fixes() -> None:
    drawn = scenario_quantiles("a/train-1", 9)
    assert sorted(drawn) == pytest.approx([(i + 0.5) / 9 for i in range(9)])
    assert scenario_quantiles("a/train-1", 9) == drawn
    others = {scenario_quantiles(f"a/train-{i}", 9) for i in range(20)}
    assert len(others) > 10  # jobs are not all early in the same scenarios


def test_a_split_quantile_meets_p10_median_and_p90() -> None:
    assert split_quantile(500.0, 1000.0, 4000.0, 0.5) == pytest.approx(1000.0)
    assert split_quantile(500.0, 1000.0, 4000.0, 0.1) == pytest.approx(500.0, rel=1e-3)
    assert split_quantile(500.0, 1000.0, 4000.0, 0.9) == pytest.approx(4000.0, rel=1e-3)
    assert split_quantile(1000.0, 1000.0, 1000.0, 0.1) == 1000.0  # no spread: the middle


def _running(key: str, started: float, **fields: object) -> object:
    return gpu_job(key, estimate=HOUR, phase=Phase.RUNNING, node="n1", attempts=1,
                   runs=(RunRecord(1, started, None, 1.0),), template="train", **fields)


def test_a_silent_job_ends_by_its_run_time_given_how_long_it_has_run() -> None:
    job = _running("a/run", 0.0)
    times = run_time(job, {("a", "train"): HISTORY})
    for ran in (0.0, 400.0, 1500.0):
        draws = list(remaining_quantiles(job, ran, times, 60.0, (0.1, 0.5, 0.9)))
        assert draws == sorted(draws) and draws[0] > 0
        # P(T > ran + draw at q | T > ran) = 1 - q, T log-normal as `learned_remaining` takes it
        z = [(math.log(ran + d) - math.log(1000.0)) / 0.5 for d in draws]
        survival = [0.5 * math.erfc(x / math.sqrt(2.0)) for x in z]
        outlived = 0.5 * math.erfc((math.log(ran) - math.log(1000.0)) / 0.5 / math.sqrt(2.0)) \
            if ran > 0 else 1.0
        assert [s / outlived for s in survival] == pytest.approx([0.9, 0.5, 0.1], abs=1e-6)
    # past its expectation the scenarios' median is `learned_remaining`'s
    assert remaining_quantiles(job, 1500.0, times, 60.0, (0.5,))[0] == pytest.approx(
        learned_remaining(times, 1500.0).expected)


def test_without_a_spread_every_scenario_is_the_point_remaining_time() -> None:
    job = _running("a/run", 0.0)
    times = (1000.0, 1000.0, 1000.0)
    point = remaining(job, 300.0, times, 60.0).expected
    assert set(remaining_quantiles(job, 300.0, times, 60.0, (0.1, 0.5, 0.9))) == {point}


@given(st.floats(0.01, 0.99), st.floats(0.0, 20_000.0))
def test_a_draw_never_outlasts_the_jobs_limit(q: float, now: float) -> None:
    job = _running("a/run", 0.0, max_duration_s=2000.0)
    times = run_time(job, {("a", "train"): HISTORY})
    (drawn,) = remaining_quantiles(job, now, times, 60.0, (q,))
    assert drawn <= max(2000.0 - now, 60.0)
    assert drawn > 0


def _two_gpu_scene(config: AdmissionConfig, count: int = 4) -> tuple[float, float | None]:
    """`count` silent running jobs started together, one GPU each (all four of the node's),
    and a job waiting for one GPU: (the earliest of the running jobs' expected ends, its
    estimated start)."""
    grants = [(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True),) for i in range(count)]
    running = [_running(f"a/run-{i}", 0.0, grants=grants[i]) for i in range(count)]
    waiting = gpu_job("b/next", "b", submitted=400.0, estimate=600.0)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "ab"}
    snapshot = ClusterSnapshot(400.0, (*running, waiting), quotas, {"n1": gpu_node(gpus=count)},
                               learned={("a", "train"): HISTORY})
    result = admission_cycle(snapshot, config)
    wait = result.wait_for("b/next")
    assert wait is not None
    times = run_time(running[0], snapshot.learned)
    return 400.0 + learned_remaining(times, 400.0).expected, wait.estimated_start


def test_a_job_waiting_for_the_first_of_several_ends_is_told_the_first_ones_median() -> None:
    """Four silent jobs of one kind, started together, hold the node's four GPUs: planned at
    their expectation all four end at 1,000 s. The first of four to end comes earlier: with
    each run time log-normal (sigma 0.5) given it passed 400 s, the first of four ends near
    its conditional 16th percentile; the scenarios' median lands there, not at 1,000 s."""
    base = AdmissionConfig(node_placer=packing_placer, class_calibration=False, start_scenarios=9)
    point_end, point = _two_gpu_scene(AdmissionConfig(
        node_placer=packing_placer, class_calibration=False, start_scenarios=0))
    assert point == pytest.approx(point_end)
    _, estimate = _two_gpu_scene(base)
    assert estimate is not None and estimate < point_end
    # the median of the first of four: its survival is 0.5, so each one's is 0.5 ** (1/4)
    outlived = 0.5 * math.erfc((math.log(400.0) - math.log(1000.0)) / 0.5 / math.sqrt(2.0))
    survival = 0.5 ** 0.25 * outlived
    z = statistics.NormalDist().inv_cdf(1.0 - survival)
    first_median = 1000.0 * math.exp(0.5 * z)
    assert estimate == pytest.approx(first_median, rel=0.15)
    # deterministic: the same snapshot gives the same estimate
    assert _two_gpu_scene(base)[1] == estimate


def test_scenarios_leave_the_cycles_decisions_alone() -> None:
    """Only the estimates come from the scenarios: admissions, preemptions and positions are
    the cycle's own simulation's."""
    grants = [(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True),) for i in range(2)]
    running = [_running(f"a/run-{i}", 0.0, grants=grants[i]) for i in range(2)]
    queued = [gpu_job(f"b/q{i}", "b", submitted=400.0 + i, estimate=600.0, count=1 + i % 2)
              for i in range(6)]
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "ab"}
    snapshot = ClusterSnapshot(400.0, (*running, *queued), quotas,
                               {"n1": gpu_node(gpus=2), "n2": gpu_node("n2", gpus=1)},
                               learned={("a", "train"): HISTORY})
    results = [admission_cycle(snapshot, AdmissionConfig(
        node_placer=packing_placer, start_scenarios=k)) for k in (0, 9)]
    assert results[0].admissions == results[1].admissions
    assert results[0].preemptions == results[1].preemptions
    assert [(w.job_key, w.reason, w.position) for w in results[0].waits] == [
        (w.job_key, w.reason, w.position) for w in results[1].waits]
    assert [w.estimated_start for w in results[0].waits] != [
        w.estimated_start for w in results[1].waits]


def test_a_negative_scenario_count_is_refused() -> None:
    with pytest.raises(ValueError, match="start_scenarios"):
        AdmissionConfig(start_scenarios=-1)
