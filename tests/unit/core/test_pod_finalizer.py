"""Carpool's finalizer on job pods (`core.finalizing`): a pod is released only once its run
is on record — in its live job's status, or in its project's retired usage when its job is
deleted — and a pod whose deletion is final counts as gone for everything else."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from carpool.core.finalizing import (
    Release,
    attempt_over,
    deletion_final,
    job_retired_key,
    pod_retired_key,
    release,
    stopped_at,
)
from carpool.core.lifecycle import PodView
from carpool.core.ownership import JobIdentity, Owner

T = 1_800_000_000.0
OWNER = Owner(name="train", uid="j1")
POD = PodView(name="train-1", namespace="team", attempt=1, phase="Running", node="n1",
              assignment=None, started=T, finished=None, deleting=True, exit_reason="",
              uid="p1", owner=OWNER, gpu_pod=True, finalized=True, deletion_final=True,
              deleted_at=T + 60)


def _job(**status: Any) -> tuple[JobIdentity, dict[str, Any]]:
    status = {"phase": "Running", "attempts": 1, "podUID": "p1", "podName": "train-1",
              **status}
    identity = JobIdentity(namespace="team", name="train", uid="j1",
                           attempts=int(status["attempts"]), pod_uid=str(status["podUID"]),
                           pod_name=str(status["podName"]),
                           next_pod_name=f"train-{int(status['attempts']) + 1}",
                           admittable=status["phase"] == "Queued")
    return identity, status


def test_a_pod_deleted_with_grace_0_is_final_and_stopped_then() -> None:
    assert deletion_final({"deletionTimestamp": "2027-01-15T08:00:00Z",
                           "deletionGracePeriodSeconds": 0})
    assert not deletion_final({"deletionTimestamp": "2027-01-15T08:00:00Z",
                               "deletionGracePeriodSeconds": 30})  # may still run
    assert not deletion_final({"deletionGracePeriodSeconds": 0})
    assert stopped_at(POD) == T + 60  # no container end known: when it became final
    assert stopped_at(replace(POD, finished=T + 50)) == T + 50
    assert stopped_at(replace(POD, deletion_final=False)) is None
    assert stopped_at(replace(POD, deletion_final=False, phase="Succeeded",
                              finished=T + 40)) == T + 40
    assert not POD.holds_gpus and replace(POD, deletion_final=False).holds_gpus


def test_a_live_jobs_attempt_is_released_once_its_status_closed_that_attempt() -> None:
    job, status = _job()
    assert release(POD, job, status, False, set()) is Release.WAIT  # Running: not yet
    assert release(POD, job, {**status, "phase": "Preempted"}, False, set()) is Release.WAIT
    for phase in ("Queued", "Succeeded", "Failed"):
        assert release(POD, job, {**status, "phase": phase}, False, set()) is Release.NOW
    assert attempt_over({"attempts": 2, "phase": "Running"}, 1)
    assert not attempt_over({"attempts": 1, "phase": "Admitted"}, 1)


def test_a_pod_that_is_no_current_attempt_of_its_live_job_is_released() -> None:
    job, status = _job(attempts=2, podUID="p2", podName="train-2")
    assert release(POD, job, status, False, set()) is Release.NOW  # an earlier attempt
    worker = replace(POD, name="train-1-w1", uid="w1")  # billed through rank 0's record
    job, status = _job()
    assert release(worker, job, status, False, set()) is Release.NOW


def test_an_attempt_its_job_never_recorded_is_billed_on_its_own() -> None:
    """The operator stopped between creating the pod and writing the job's status, and the
    pod's deletion became final before a pass adopted it."""
    job, status = _job(phase="Queued", attempts=0, podUID="", podName="")
    assert release(POD, job, status, False, set()) is Release.BILL_POD


def test_a_deleted_jobs_pod_waits_for_the_jobs_retirement_a_forgotten_ones_is_billed() -> None:
    job, status = _job()
    assert release(POD, job, status, True, set()) is Release.RETIRE_JOB
    retired = {job_retired_key("team", "train", "j1")}
    assert release(POD, job, status, True, retired) is Release.NOW
    assert release(POD, None, {}, True, set()) is Release.BILL_POD
    assert release(POD, None, {}, True, {pod_retired_key(POD)}) is Release.NOW
    # a job of the same name is another object: its key does not release this pod
    assert release(POD, None, {}, True, {job_retired_key("team", "train", "j2")}) \
        is Release.BILL_POD


def test_a_pod_whose_owner_reference_went_is_released_by_the_job_that_recorded_it() -> None:
    """Deleted with propagationPolicy Orphan, the job's pod loses its ownerReference before
    the job goes: the job found by the pod its status records counts, so its retirement
    releases the pod and the pod is not billed again on its own."""
    orphaned = replace(POD, owner=None)
    job, status = _job()
    retired = {job_retired_key("team", "train", "j1")}
    assert release(orphaned, job, status, True, set()) is Release.RETIRE_JOB
    assert release(orphaned, job, status, True, retired) is Release.NOW
