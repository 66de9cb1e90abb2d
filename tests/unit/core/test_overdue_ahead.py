"""An estimated start that reaches past the time older jobs now ranked behind the job become
overdue (fairshare: overdue jobs go first, oldest first) waits for their work as well
(`queueing._overdue_ahead`)."""

from __future__ import annotations

import pytest

from carpool.core.jobs import ClusterSnapshot, ProjectQuota, RunRecord
from carpool.core.queueing import AdmissionConfig, admission_cycle
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
