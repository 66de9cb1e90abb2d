"""Core behaviours the operator depends on, checked at real epoch times.

The operator passes `time.time()` (about 1.7e9) as `now`; the core's own tests mostly use
small times. A float epsilon added to an epoch time vanishes, so these pin the cases the
live cluster hit.
"""

from __future__ import annotations

import pytest

from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, WaitReason, admission_cycle
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
    Phase,
)
from carpool.core.run_times import expected_remaining
from carpool.core.timeline import Occupancy, Timeline
from carpool_testbed.builders import packing_placer

GIB = 1024
EPOCH = 1_780_000_000.0  # a late-2026 wall-clock time, as the operator passes it


def _node(name: str = "n1", gpus: int = 2) -> NodeState:
    return NodeState(NodeInventory(name, tuple(
        Gpu(i, f"{name}-g{i}", "H200", 141 * GIB) for i in range(gpus))))


def _borrowed_runner(key: str, gpu: int, now: float) -> Job:
    grant = GpuGrant(f"n1-g{gpu}", 40 * GIB, 50)  # an MPS share as the extender assigns it
    return Job(key, "nlp", JobClass.BATCH, GpuRequest(1, 40 * GIB, 50), now - 600, 3600.0,
               preemptible=True, phase=Phase.RUNNING, node="n1", grants=(grant,),
               attempts=1, borrowed=True, runs=(RunRecord(1, now - 300, None, 0.5),))


@pytest.mark.parametrize("now", [1000.0, EPOCH])
def test_raw_capacity_check_sees_what_is_held_at_epoch_times(now: float) -> None:
    timeline = Timeline({"n1": _node(gpus=1)}, now, packing_placer)
    whole = GpuRequest(1, 100 * GIB, isolation=Isolation.EXCLUSIVE)
    timeline.add("n1", Occupancy("a/held", now, now + 600,
                                 (GpuGrant("n1-g0", 141 * GIB, 100, exclusive=True),)))
    assert timeline.best_now(whole, 60, respect_reservations=False) is None
    assert timeline.best_now(whole, 60) is None


@pytest.mark.parametrize("now", [1000.0, EPOCH])
def test_in_quota_job_preempts_borrowed_mps_jobs_when_every_gpu_is_held(now: float) -> None:
    """The demo's symptom: BehindHigherRanked ("GPUs are free but reserved for 0 ...") while
    borrowed preemptible jobs held every GPU, because the raw check saw an empty node."""
    runners = [_borrowed_runner(f"nlp/r{i}-{s}", i, now) for i in range(2) for s in range(2)]
    waiting = Job("vision/w", "vision", JobClass.SHORT,
                  GpuRequest(1, 60 * GIB, 50), now - 60, 600.0)
    quotas = {"nlp": ProjectQuota("nlp", frozenset({"nlp"}), guaranteed_gpus=0.0,
                                  borrowing=True),
              "vision": ProjectQuota("vision", frozenset({"vision"}), guaranteed_gpus=2.0)}
    snapshot = ClusterSnapshot(now, (*runners, waiting), quotas, {"n1": _node()})
    result = admission_cycle(snapshot, AdmissionConfig(node_placer=packing_placer))
    wait = result.wait_for("vision/w")
    assert wait is not None and wait.reason is WaitReason.PREEMPTING, wait
    assert result.preemptions and all(p.victim_key.startswith("nlp/")
                                      for p in result.preemptions)
    assert {p.cause.value for p in result.preemptions} == {"ReclaimBorrowed"}


def test_a_job_about_to_end_is_expected_to_end_then_not_a_minute_later() -> None:
    """ETAs behind a job with seconds left were up to `min_remaining_s` (60 s) too late."""
    runner = _borrowed_runner("nlp/r", 0, EPOCH)  # started 300 s ago
    assert expected_remaining(runner, EPOCH, 310.0, 60.0) == pytest.approx(10.0)
    # overdue after 300 s: half its age more (150 s), at least a minute
    assert expected_remaining(runner, EPOCH, 200.0, 60.0) == 150.0
