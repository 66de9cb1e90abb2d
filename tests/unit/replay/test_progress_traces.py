"""Jobs that report progress in the queue replay: their curves, their reports, and that a
waiting job's estimate follows what the job ahead of it reports."""

from __future__ import annotations

import pytest

from carpool.core.jobs import Job, RunRecord
from carpool.core.queueing import AdmissionConfig
from carpool.core.resources import GpuRequest, Isolation, JobClass, Phase
from carpool.core.run_times import reported_remaining
from carpool.replay import job_traces as traces
from carpool.replay import queue_replay as qr
from carpool.replay.progress_traces import curve, report_every
from carpool_testbed.builders import packing_placer

NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,1,T4\n"


@pytest.mark.parametrize("seed", [f"s:{i}" for i in range(40)])
def test_a_curve_ends_at_one_when_its_run_time_is_spent(seed: str) -> None:
    found = curve(7200.0, seed)
    assert found.at(0.0)[0] == 0.0 and found.at(7200.0)[0] == pytest.approx(1.0)
    assert found.pieces[-1].end == 7200.0
    # progress falls only at a restart from a checkpoint
    for before, after in zip(found.pieces, found.pieces[1:], strict=False):
        assert after.start == pytest.approx(before.end)
        assert after.p0 == pytest.approx(before.p1) or after.phase == "start"
    assert curve(7200.0, seed) == found  # the same seed, the same curve


def test_reports_carry_samples_and_pauses_of_the_attempt() -> None:
    found = curve(3600.0, "r:1")
    assert found.report(0.0, report_every(3600.0) / 2, 1000.0) is None  # none yet
    report = found.report(600.0, 2400.0, 5000.0)  # resumed at 600 s of work, ran 1,800 s
    assert report is not None
    value, at, detail = report
    assert value == pytest.approx(found.at(at - 5000.0 + 600.0)[0])
    assert all(5000.0 <= t <= at for t, _ in detail.recent)
    assert 0 < detail.paused_s < 1800.0


def test_remaining_by_reports_follows_the_curve() -> None:
    """Over many curves the remaining time read from reports is right on median, within
    its range about four times in five."""
    misses = []
    inside = 0
    for i in range(200):
        run_s = 1800.0 + 100.0 * i
        found = curve(run_s, f"m:{i}")
        worked = run_s * (0.2 + 0.6 * (i % 7) / 7)
        report = found.report(0.0, worked, 0.0)
        assert report is not None
        job = Job("a/j", "a", JobClass.BATCH, GpuRequest(1, 0, 100, Isolation.EXCLUSIVE),
                  0.0, run_s, phase=Phase.RUNNING, attempts=1,
                  runs=(RunRecord(1, 0.0, None, 1.0),), progress=report[0],
                  progress_at=report[1], progress_detail=report[2])
        left = reported_remaining(job, worked)
        assert left is not None
        actual = run_s - worked
        misses.append(abs(left.expected - actual) / actual)
        inside += left.low <= actual <= left.high
    misses.sort()
    assert misses[len(misses) // 2] < 0.2
    assert 0.65 <= inside / 200 <= 0.95


def test_the_replay_with_reports_is_seeded_and_checks_its_share() -> None:
    rows = traces.parse_trace(traces.generate(
        traces.parse_trace("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
                           "creation_time,deletion_time,scheduled_time\n"
                           "p-1,1000,1024,1,1000,,BE,Running,0,600,0\n").rows,
        60, 1, 200.0)).rows
    jobs = traces.annotate(rows, 1)
    nodes = qr.trace_nodes([("n1", 1, "T4")], 1.0)

    def run(share: float) -> dict[str, object]:
        policy = qr.carpool_policy(AdmissionConfig(node_placer=packing_placer))
        return qr.score(qr.replay(jobs, nodes, qr.open_quotas(jobs), policy, "carpool",
                                  progress_share=share, progress_seed=1))

    assert run(0.5) == run(0.5)
    assert run(0.0) != run(1.0)  # reports move the estimates
    with pytest.raises(ValueError, match="share of jobs reporting"):
        run(1.5)
