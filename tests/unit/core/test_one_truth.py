"""One truth: the operator, decoding GpuJobs as the API server holds them, and the replay,
keeping its history run by run, give the same estimated starts for the same state."""

from __future__ import annotations

import json
from typing import Any

import pytest

from carpool.core.accounting import retire_deleted
from carpool.core.decoding import job_from_object, retired_from_status, retired_to_status
from carpool.core.estimate_ranges import kept_history
from carpool.core.jobs import ClusterSnapshot, Job, RetiredUsage, job_template
from carpool.core.queueing import AdmissionConfig, CycleResult, admission_cycle
from carpool.core.resources import GpuRequest, Isolation, JobClass, Phase
from carpool.core.timestamps import format_timestamp
from carpool.replay import queue_replay as qr
from carpool.replay.job_traces import TraceJob
from carpool_testbed.builders import packing_placer

T0 = 1_800_000_000
IMAGE = "lab/train:1"
CONFIG = AdmissionConfig(node_placer=packing_placer)
NODES = qr.trace_nodes([("n1", 2, "T4")], 1.0)


def trace() -> list[TraceJob]:
    """Jobs of one kind that take 100-140 s while their users say 1 h, then a burst."""
    request = GpuRequest(1, 0, 100, Isolation.EXCLUSIVE)
    template = job_template("train", IMAGE)
    jobs = [TraceJob(f"vision/train-{i}", "vision", JobClass.SHORT, request, T0 + 200 * i,
                     100 + 10 * (i % 5), 3600, template, False) for i in range(6)]
    jobs += [TraceJob(f"vision/train-{i}", "vision", JobClass.SHORT, request, T0 + 1300 + i,
                      120, 3600, template, False) for i in range(6, 12)]
    return jobs


def gpujob(job: Job, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The GpuJob object the API server would hold for `job`."""
    return {"metadata": {"namespace": job.namespace, "name": job.name,
                         "creationTimestamp": format_timestamp(job.submitted_at)},
            "spec": {"project": job.project, "class": job.job_class.label,
                     "estimatedDuration": f"{job.estimated_duration_s:.0f}s",
                     "gpu": {"count": 1, "isolation": "exclusive"},
                     "template": {"spec": {"containers": [{"name": "m", "image": IMAGE}]}}},
            "status": {"submitTime": format_timestamp(job.submitted_at),
                       "history": history,
                       **({"firstEstimatedStart": format_timestamp(job.first_estimated_start)}
                          if job.first_estimated_start is not None else {}),
                       **({"firstSimulatedStart": format_timestamp(job.first_simulated_start)}
                          if job.first_simulated_start is not None else {})}}


def history_of(job: Job) -> list[dict[str, Any]]:
    return [{"attempt": r.attempt, "start": format_timestamp(r.start),
             **({"end": format_timestamp(r.end)} if r.end is not None else {}),
             "fraction": r.fraction, "node": r.node} for r in job.runs]


def replayed() -> tuple[ClusterSnapshot, qr.Decisions, list[Job], list[Job]]:
    """The replay's state once three jobs wait, its decisions, and the operator's view of the
    same state: the live jobs and the finished ones (which the replay keeps only as history),
    decoded from GpuJobs as the API server would hold them."""
    jobs = trace()
    seen: list[tuple[ClusterSnapshot, qr.Decisions]] = []

    def observe(state: qr.State, decisions: qr.Decisions) -> None:
        if len(decisions.estimates) >= 3 and not seen:
            seen.append((state.snapshot(), decisions))

    outcome = qr.replay(jobs, NODES, qr.open_quotas(jobs), qr.carpool_policy(CONFIG),
                        "carpool", observe=observe)
    state, decisions = seen[0]
    live_keys = {j.key for j in state.jobs}
    finished = []
    for t in jobs:
        record = outcome.records[t.key]
        start = record.first_start
        if start is not None and start + t.runtime_s <= state.now and t.key not in live_keys:
            estimate = record.arrival_estimate
            job = Job(t.key, t.project, t.job_class, t.request, t.arrival, t.user_estimate_s,
                      template=t.template, phase=Phase.SUCCEEDED,
                      first_estimated_start=estimate.start if estimate else None)
            runs = [{"attempt": 1, "start": format_timestamp(start),
                     "end": format_timestamp(start + t.runtime_s), "fraction": 1.0,
                     "node": "n1"}]
            finished.append(job_from_object(gpujob(job, runs), Phase.SUCCEEDED, 1, (), "",
                                            runs))
    assert len(finished) >= 5
    decoded = [job_from_object(gpujob(j, history_of(j)), j.phase, j.attempts, j.grants,
                               j.node, history_of(j)) for j in state.jobs]
    return state, decisions, decoded, finished


def assert_same_estimates(result: CycleResult, decisions: qr.Decisions) -> None:
    estimates = {w.job_key: (w.estimated_start, w.estimated_start_low, w.estimated_start_high)
                 for w in result.waits}
    assert estimates.keys() == decisions.estimates.keys()
    for key, estimate in decisions.estimates.items():
        assert estimates[key] == pytest.approx((estimate.start, estimate.low, estimate.high),
                                               abs=1e-6)


def test_operator_and_replay_estimate_the_same_starts() -> None:
    state, decisions, live, finished = replayed()
    operator = admission_cycle(ClusterSnapshot(state.now, tuple(live + finished), state.quotas,
                                               NODES), CONFIG)
    assert_same_estimates(operator, decisions)
    # and the learned run time, not the users' hour, is what both used
    assert max(e.start for e in decisions.estimates.values()) < state.now + 600


def test_deleting_the_finished_jobs_changes_no_estimate() -> None:
    """The operator after the finished jobs were deleted: what each taught is folded into its
    project's retired usage (in the order they were deleted: as they ended), written into the
    ProjectQuota's status and read back, and passed to the cycle as the snapshot's history.
    Its estimates are the replay's, and the same as with the finished jobs still there."""
    state, decisions, live, finished = replayed()
    retired: dict[str, RetiredUsage] = {}
    for job in sorted(finished, key=lambda j: (j.runs[-1].end or 0.0, j.key)):
        retired[job.project] = retire_deleted(retired.get(job.project), job,
                                              state.quotas[job.project], state.now, 1e12)
    statuses = {p: json.loads(json.dumps({"retired": retired_to_status(r)}))
                for p, r in retired.items()}
    read_back = {p: r for p, status in statuses.items()
                 if (r := retired_from_status(p, status)[0]) is not None}
    assert {p: (r.learned, r.start_misses) for p, r in read_back.items()} == {
        p: (r.learned, r.start_misses) for p, r in retired.items()}
    learned, misses = kept_history(read_back.values())
    assert set(learned) == {("vision", JobClass.SHORT),
                            ("vision", job_template("train", IMAGE))}
    assert sorted(misses, key=repr) == sorted(state.start_misses, key=repr)
    operator = admission_cycle(ClusterSnapshot(state.now, tuple(live), state.quotas, NODES,
                                               read_back, learned, misses), CONFIG)
    assert_same_estimates(operator, decisions)
    forgetting = admission_cycle(ClusterSnapshot(state.now, tuple(live), state.quotas, NODES,
                                                 read_back), CONFIG)
    assert {w.job_key: w.estimated_start for w in forgetting.waits} != {
        w.job_key: w.estimated_start for w in operator.waits}, "the test cannot tell"
