"""One truth: the operator, decoding GpuJobs as the API server holds them, and the replay,
keeping its history run by run, give the same estimated starts for the same state."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.core import queue_replay as qr
from carpool.core.decoding import job_from_object
from carpool.core.job_traces import TraceJob
from carpool.core.jobs import ClusterSnapshot, Job, job_template
from carpool.core.queueing import AdmissionConfig, admission_cycle
from carpool.core.resources import GpuRequest, Isolation, JobClass, Phase
from carpool.core.timestamps import format_timestamp
from carpool_testbed.builders import packing_placer

T0 = 1_800_000_000
IMAGE = "lab/train:1"
CONFIG = AdmissionConfig(node_placer=packing_placer)


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
                          if job.first_estimated_start is not None else {})}}


def history_of(job: Job) -> list[dict[str, Any]]:
    return [{"attempt": r.attempt, "start": format_timestamp(r.start),
             **({"end": format_timestamp(r.end)} if r.end is not None else {}),
             "fraction": r.fraction, "node": r.node} for r in job.runs]


def test_operator_and_replay_estimate_the_same_starts() -> None:
    jobs = trace()
    nodes = qr.trace_nodes([("n1", 2, "T4")], 1.0)
    quotas = qr.open_quotas(jobs)
    seen: list[tuple[ClusterSnapshot, qr.Decisions]] = []

    def observe(state: qr.State, decisions: qr.Decisions) -> None:
        if len(decisions.estimates) >= 3 and not seen:
            seen.append((state.snapshot(), decisions))

    outcome = qr.replay(jobs, nodes, quotas, qr.carpool_policy(CONFIG), "carpool",
                        observe=observe)
    state, decisions = seen[0]
    live = list(state.jobs)
    live_keys = {j.key for j in live}
    # the finished jobs, as the operator still sees them (the replay keeps only history)
    finished = []
    for t in jobs:
        record = outcome.records[t.key]
        start = record.first_start
        if start is not None and start + t.runtime_s <= state.now and t.key not in live_keys:
            job = Job(t.key, t.project, t.job_class, t.request, t.arrival, t.user_estimate_s,
                      template=t.template, phase=Phase.SUCCEEDED)
            runs = [{"attempt": 1, "start": format_timestamp(start),
                     "end": format_timestamp(start + t.runtime_s), "fraction": 1.0,
                     "node": "n1"}]
            finished.append(job_from_object(gpujob(job, runs), Phase.SUCCEEDED, 1, (), "",
                                            runs))
    assert len(finished) >= 5
    decoded = [job_from_object(gpujob(j, history_of(j)), j.phase, j.attempts, j.grants,
                               j.node, history_of(j)) for j in live]
    operator = admission_cycle(ClusterSnapshot(state.now, tuple(decoded + finished), quotas,
                                               nodes), CONFIG)
    estimates = {w.job_key: (w.estimated_start, w.estimated_start_low, w.estimated_start_high)
                 for w in operator.waits}
    assert estimates.keys() == decisions.estimates.keys()
    for key, estimate in decisions.estimates.items():
        assert estimates[key] == pytest.approx((estimate.start, estimate.low, estimate.high),
                                               abs=1e-6)
    # and the learned run time, not the users' hour, is what both used
    assert max(e.start for e in decisions.estimates.values()) < state.now + 600
