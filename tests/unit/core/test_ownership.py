"""The one rule of which pod is a GpuJob's attempt (core.ownership): by the job's uid and what
its status records, never by a label, an annotation or a name alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from carpool.core.ownership import (
    JobIdentity,
    Link,
    Owner,
    PodIdentity,
    attempt_link,
    controls,
    is_orphan,
)

JOB = JobIdentity(namespace="team", name="train", uid="job-uid", attempts=2,
                  pod_uid="pod-2", pod_name="train-2", next_pod_name="train-3",
                  admittable=False)
OURS = Owner("train", "job-uid")
POD = PodIdentity("team", "train-2", "pod-2", OURS)


def test_the_recorded_pod_is_the_current_attempt() -> None:
    assert attempt_link(JOB, POD) == Link(2)
    assert controls(JOB, POD)


@pytest.mark.parametrize("pod", [
    replace(POD, namespace="other"),                    # a look-alike in another namespace
    replace(POD, uid="forged"),                         # same name, not the pod recorded
    replace(POD, uid="forged", owner=Owner("train", "old-uid")),  # a job of that name, before
    replace(POD, name="train-3", uid="forged"),         # the next name, the job not admittable
    replace(POD, name="train-9", uid="forged"),         # an attempt number from a name
    replace(POD, uid=""),
])
def test_a_look_alike_is_no_attempt(pod: PodIdentity) -> None:
    assert attempt_link(JOB, pod) is None


def test_the_recorded_pod_whose_owner_changed_is_the_attempt_but_tampered() -> None:
    for owner in (None, Owner("train", "other"), Owner("other", "job-uid")):
        link = attempt_link(JOB, replace(POD, owner=owner))
        assert link == Link(2, controlled=False) and link.tampered


def test_a_pod_created_before_its_status_write_is_adopted_only_if_the_job_controls_it() -> None:
    queued = replace(JOB, admittable=True)
    pod = PodIdentity("team", "train-3", "pod-3", OURS)
    assert attempt_link(queued, pod) == Link(3)
    assert attempt_link(queued, replace(pod, owner=None)) is None
    assert attempt_link(queued, replace(pod, owner=Owner("train", "x"))) is None
    assert attempt_link(queued, replace(pod, namespace="other")) is None
    assert attempt_link(JOB, pod) is None  # the job is not in a phase it is admitted from


def test_a_status_without_pod_uid_adopts_the_named_pod_the_job_controls() -> None:
    legacy = replace(JOB, pod_uid="")
    assert attempt_link(legacy, POD) == Link(2)
    assert attempt_link(legacy, replace(POD, owner=None)) is None
    assert attempt_link(replace(legacy, attempts=0, pod_name=""), POD) is None


def test_an_orphan_holds_a_gpu_is_no_attempt_and_claims_a_job_or_bills_to_a_project() -> None:
    bare = replace(POD, owner=None)
    assert is_orphan(POD, holds_gpus=True, an_attempt=False, in_project_namespace=False)
    assert is_orphan(bare, holds_gpus=True, an_attempt=False, in_project_namespace=True)
    assert not is_orphan(POD, holds_gpus=True, an_attempt=True, in_project_namespace=True)
    assert not is_orphan(POD, holds_gpus=False, an_attempt=False, in_project_namespace=True)
    # a bare GPU pod outside project namespaces: never served in production, left alone
    assert not is_orphan(bare, holds_gpus=True, an_attempt=False, in_project_namespace=False)


def test_an_assignment_is_the_extenders_while_it_matches_the_limits_and_the_first_seen() -> None:
    from carpool.core.assignment import AssignedGpu, Assignment, encode_assignment
    from carpool.core.ownership import GpuLimits, assignment_tampered
    from carpool.core.resources import Isolation

    quarter = Assignment("n1", (AssignedGpu("GPU-0", 0, 20 * 1024, 25, container="main"),),
                         Isolation.MPS)
    limits = (GpuLimits("main", 1, 20, 25),)
    recorded = encode_assignment(quarter)
    assert assignment_tampered(quarter, limits, "") == ""
    assert assignment_tampered(quarter, limits, recorded) == ""
    moved = Assignment("n1", (AssignedGpu("GPU-1", 1, 20 * 1024, 25, container="main"),),
                       Isolation.MPS)
    assert "differs from the one it was bound with" in assignment_tampered(moved, limits,
                                                                           recorded)
    assert "was removed" in assignment_tampered(None, limits, recorded)
    bigger = Assignment("n1", (AssignedGpu("GPU-0", 0, 80 * 1024, 25, container="main"),),
                        Isolation.MPS)
    assert "over its carpool.dev/gpu-memory limit of 20 GiB" in assignment_tampered(
        bigger, limits, "")
    more = Assignment("n1", (*quarter.gpus, AssignedGpu("GPU-1", 1, 20 * 1024, 25,
                                                         container="main")), Isolation.MPS)
    assert "2 GPUs, its carpool.dev/gpu limit is 1" in assignment_tampered(more, limits, "")
    whole = Assignment("n1", (AssignedGpu("GPU-0", 0, 80 * 1024, 100, container="main"),),
                       Isolation.EXCLUSIVE)
    assert assignment_tampered(whole, limits, "") == ""  # the card's memory, by isolation
