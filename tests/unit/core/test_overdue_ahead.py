"""An estimated start that reaches past the time older jobs now ranked behind the job become
overdue (fairshare: overdue jobs go first, oldest first) waits for their work as well
(`queueing._overdue_ahead`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.core.jobs import ClusterSnapshot, ProjectQuota, RunRecord
from carpool.core.queueing import AdmissionConfig, Queued, admission_cycle, overdue_pushed
from carpool.core.resources import GpuGrant, JobClass, Phase
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer

NOW = 10 * HOUR


def _start(running_for: float, batch_submitted: float) -> float | None:
    """c/int's estimated start: n1's two GPUs are held by a/run (interactive, expected 3 h,
    run for `running_for` s); b/batch, asking the two GPUs for an hour, ranks behind c/int."""
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", cls=JobClass.INTERACTIVE, count=2, estimate=3 * HOUR,
                      phase=Phase.RUNNING, node="n1", grants=grants, attempts=1,
                      runs=(RunRecord(1, NOW - running_for, None, 2.0),))
    interactive = gpu_job("c/int", "c", JobClass.INTERACTIVE, count=2, submitted=NOW)
    batch = gpu_job("b/batch", "b", JobClass.BATCH, count=2, submitted=batch_submitted,
                    estimate=HOUR)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "abc"}
    snapshot = ClusterSnapshot(NOW, (running, interactive, batch), quotas, {"n1": gpu_node()})
    result = admission_cycle(snapshot, AdmissionConfig(node_placer=packing_placer))
    return result.wait_for("c/int").estimated_start


def test_older_jobs_overdue_before_the_start_go_first() -> None:
    # a/run ends in 2 h; b/batch (submitted 2.5 h ago, level 1 now) is overdue in 1.5 h,
    # before then, and from then on ranks ahead of c/int: c/int starts after its hour
    assert _start(HOUR, NOW - 2.5 * HOUR) == pytest.approx(NOW + 3 * HOUR)
    # a/run ends in 1 h: c/int starts before b/batch is overdue, as the queue stands
    assert _start(2 * HOUR, NOW - 2.5 * HOUR) == pytest.approx(NOW + HOUR)
    # submitted 0.5 h ago, b/batch is overdue only in 3.5 h: after c/int's start
    assert _start(HOUR, NOW - 0.5 * HOUR) == pytest.approx(NOW + 2 * HOUR)


def _coarse_start(batch_submitted: float) -> tuple[float | None, bool]:
    """c/int's estimated start beyond a reservation depth of one: a/run holds n1's two GPUs
    for 2 h more, c/first (ranked ahead of c/int) reserves them then for an hour, and
    b/batch, asking the two GPUs for an hour, ranks behind c/int."""
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", cls=JobClass.INTERACTIVE, count=2, estimate=3 * HOUR,
                      phase=Phase.RUNNING, node="n1", grants=grants, attempts=1,
                      runs=(RunRecord(1, NOW - HOUR, None, 2.0),))
    first = gpu_job("c/first", "c", JobClass.INTERACTIVE, count=2, submitted=NOW - 60)
    interactive = gpu_job("c/int", "c", JobClass.INTERACTIVE, count=2, submitted=NOW)
    batch = gpu_job("b/batch", "b", JobClass.BATCH, count=2, submitted=batch_submitted,
                    estimate=HOUR)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "abc"}
    snapshot = ClusterSnapshot(NOW, (running, first, interactive, batch), quotas,
                               {"n1": gpu_node()})
    config = AdmissionConfig(node_placer=packing_placer, reservation_depth=1)
    wait = admission_cycle(snapshot, config).wait_for("c/int")
    assert wait is not None
    return wait.estimated_start, wait.coarse_estimate


def test_beyond_the_reservation_depth_too() -> None:
    # coarse, c/int starts when c/first does (2 h); b/batch is overdue in 1.5 h, before
    # then: its two GPU-hours drain at the cluster's two GPUs first
    assert _coarse_start(NOW - 2.5 * HOUR) == (pytest.approx(NOW + 3 * HOUR), True)
    # overdue only in 3.5 h, b/batch stays behind
    assert _coarse_start(NOW - 0.5 * HOUR) == (pytest.approx(NOW + 2 * HOUR), True)


def _scanned(queue: list[Queued], asked: dict[int, float], now: float,
             capacity: float) -> dict[int, float]:
    """`overdue_pushed` by its definition: each start scans the queue in overdue order."""
    by_overdue = sorted((job.overdue_at, place) for place, job in enumerate(queue)
                        if job.overdue_at >= now)
    found = {}
    for place, start in asked.items():
        pushed = start
        for overdue_at, behind in by_overdue:
            if overdue_at >= pushed:
                break
            if behind > place and queue[behind].submitted < queue[place].submitted:
                pushed += queue[behind].gpu_hours / capacity * 3600.0
        if pushed > start:
            found[place] = pushed
    return found


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4), st.integers(0, 8)),
                min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 39), st.integers(0, 60)), max_size=20),
       st.integers(0, 30))
def test_the_sweep_gives_the_scan(jobs: list[tuple[int, int, int]],
                                  asks: list[tuple[int, int]], now: int) -> None:
    step = 600.0
    queue = [Queued(s * 300.0, k, s * 300.0 + k * step, w / 4) for s, k, w in jobs]
    asked = {place: start * 300.0 for place, start in asks if place < len(queue)}
    swept = overdue_pushed(queue, asked, now * 300.0, 2.0)
    scanned = _scanned(queue, asked, now * 300.0, 2.0)
    assert swept.keys() == scanned.keys()
    for place, pushed in scanned.items():
        assert swept[place] == pytest.approx(pushed)


def test_an_older_job_started_in_the_same_cycle_pushes_nothing() -> None:
    # a/run holds n1 for 2 h more; b/batch, older and overdue in 1.5 h, asks one GPU and is
    # backfilled now on n2, where c/int's two do not fit: its hour runs there, not ahead of
    # c/int, which starts when a/run ends
    grants = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, exclusive=True) for i in (0, 1))
    running = gpu_job("a/run", cls=JobClass.INTERACTIVE, count=2, estimate=3 * HOUR,
                      phase=Phase.RUNNING, node="n1", grants=grants, attempts=1,
                      runs=(RunRecord(1, NOW - HOUR, None, 2.0),))
    interactive = gpu_job("c/int", "c", JobClass.INTERACTIVE, count=2, submitted=NOW)
    batch = gpu_job("b/batch", "b", JobClass.BATCH, submitted=NOW - 2.5 * HOUR,
                    estimate=HOUR)
    quotas = {p: ProjectQuota(p, frozenset({p})) for p in "abc"}
    snapshot = ClusterSnapshot(NOW, (running, interactive, batch), quotas,
                               {"n1": gpu_node(), "n2": gpu_node("n2", gpus=1)})
    result = admission_cycle(snapshot, AdmissionConfig(node_placer=packing_placer))
    assert [a.job_key for a in result.admissions] == ["b/batch"]
    assert result.wait_for("c/int").estimated_start == pytest.approx(NOW + 2 * HOUR)
