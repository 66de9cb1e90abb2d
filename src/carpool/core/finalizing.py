"""Carpool's finalizer on job pods (`names.FINALIZER`): a pod carrying it stays an object
until the operator has put its run on record where the run outlives the pod.

The invariant: the operator releases a pod (removes the finalizer) only once the pod's run is
on record — in its job's status (the job shows that attempt over), or, when its job is deleted,
in its project's retired usage (under the job's key, or the pod's own where the job's last state
is unknown). So a running job's GPU time is billed whatever is deleted first, and a pod that
finished while no operator watched is read, not taken for lost. The operator writes it in the
pod's create body (no write at admission) and removes it with one write once the pod's deletion
is final; a pod that finishes and is never deleted keeps it (nothing waits on it).

A pod's deletion is final when only finalizers hold it: its grace period is 0 (the kubelet has
stopped its containers and deletes it so, a pod that is finished or never bound is deleted so at
once, and a forced deletion says so). Until then it may still run; from then on it is gone for
everything but its record. Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from carpool.core.lifecycle import PodView
from carpool.core.ownership import JobIdentity, attempt_link
from carpool.core.resources import Phase

# the phases in which a job's status has closed the record of its current attempt: requeued
# (the run ended: preempted, lost, refused by a node) or finished
_ATTEMPT_OVER = frozenset({Phase.QUEUED.value, Phase.SUCCEEDED.value, Phase.FAILED.value})


class Release(Enum):
    """What the operator does about a pod of Carpool's whose deletion is final."""

    NOW = "now"  # its run is on record: remove the finalizer
    WAIT = "wait"  # its live job has not recorded its end yet (the next pass writes it)
    RETIRE_JOB = "retire-job"  # its job is deleted: retire the job's usage first
    BILL_POD = "bill-pod"  # no job will record it: bill its own run to its project first


def deletion_final(meta: Mapping[str, Any]) -> bool:
    """Whether a pod (its metadata) is deleted with grace 0: only finalizers hold it."""
    return bool(meta.get("deletionTimestamp")) and meta.get("deletionGracePeriodSeconds") == 0


def stopped_at(pod: PodView) -> float | None:
    """When a pod stopped holding its GPUs: its containers' end, or else when its deletion
    became final; None while it may still run."""
    if pod.terminal:
        return pod.finished
    if pod.deletion_final:
        return pod.finished if pod.finished is not None else pod.deleted_at
    return None


def attempt_over(status: Mapping[str, Any], attempt: int) -> bool:
    """Whether a job's status has closed the record of `attempt`: a later attempt began, or
    the job shows it requeued or finished after it."""
    attempts = int(status.get("attempts") or 0)
    return attempts > attempt or (attempts == attempt and status.get("phase") in _ATTEMPT_OVER)


def job_retired_key(namespace: str, name: str, uid: str) -> str:
    """A deleted job's key in its project's retired usage (per object: a new job of the same
    name is another)."""
    return f"{namespace}/{name}@{uid}"


def pod_retired_key(pod: PodView) -> str:
    """A pod's own key in its project's retired usage (a pod no job accounts for)."""
    return f"pod:{pod.namespace}/{pod.name}@{pod.uid}"


def release(pod: PodView, job: JobIdentity | None, job_status: Mapping[str, Any],
            job_deleted: bool, retired_keys: frozenset[str] | set[str]) -> Release:
    """What to do about `pod` (its deletion final, carrying the finalizer): `job` is the
    GpuJob that controls it or whose status records it, as the caches show it or as the watch
    last saw it deleted (None when neither knows it), `job_status` its status,
    `job_deleted` whether it is being deleted, `retired_keys` its project's retired keys.

    1. Its run folded into retired usage (its job's key or its own): release.
    2. Its job lives: the pod is no current attempt of it (an earlier attempt, whose record
       the job closed when it requeued; a gang's worker, billed through rank 0's record):
       release; its current (or adopted) attempt: release once the status closed that
       attempt's record, wait until then; named as an attempt the job never recorded (the
       operator stopped between creating it and writing the job's status): bill it.
    3. Its job is deleted: retire the job; no job (gone and forgotten): bill the pod."""
    named = (job.name, job.uid) if job is not None else (
        (pod.owner.name, pod.owner.uid) if pod.owner is not None else None)
    if pod_retired_key(pod) in retired_keys or (
            named is not None and job_retired_key(pod.namespace, *named) in retired_keys):
        return Release.NOW
    if job is None:
        return Release.BILL_POD
    if job_deleted:
        return Release.RETIRE_JOB
    link = attempt_link(job, pod.identity)
    if link is None:
        return Release.NOW
    if link.attempt > int(job_status.get("attempts") or 0):
        return Release.BILL_POD
    return Release.NOW if attempt_over(job_status, link.attempt) else Release.WAIT
