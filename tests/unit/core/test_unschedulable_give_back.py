"""An admitted job whose pod no node takes is given back to the queue, then failed
(`core.lifecycle.give_back_unschedulable`, and `observe` once its pod is gone)."""

from __future__ import annotations

from carpool.core.lifecycle import (
    MAX_UNSCHEDULABLE_GIVE_BACKS,
    UNSCHEDULABLE,
    PodView,
    give_back_unschedulable,
    observe,
)

NOW = 1_800_000_000.0
SAID = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."


def waiting_pod(since: float | None = NOW - 700, **changes: object) -> PodView:
    fields: dict[str, object] = dict(
        name="train-2", namespace="team", attempt=2, phase="Pending", node="",
        assignment=None, started=None, finished=None, deleting=False, exit_reason="",
        uid="pod-2", gpu_pod=True, unschedulable_since=since, unschedulable_message=SAID)
    fields.update(changes)
    return PodView(**fields)  # type: ignore[arg-type]


def test_a_pod_no_node_took_within_the_timeout_is_not_given_back() -> None:
    assert give_back_unschedulable({}, waiting_pod(NOW - 599), NOW, 600) is None
    assert give_back_unschedulable({}, waiting_pod(None), NOW, 600) is None
    assert give_back_unschedulable({}, waiting_pod(), NOW, 0) is None  # switched off
    # bound meanwhile, or already stopping: not this rule's
    assert give_back_unschedulable({}, waiting_pod(node="n1"), NOW, 600) is None
    assert give_back_unschedulable({}, waiting_pod(deleting=True), NOW, 600) is None


def test_it_is_given_back_with_the_schedulers_reason_then_fails() -> None:
    given = give_back_unschedulable({}, waiting_pod(), NOW, 600)
    assert given is not None
    status, note = given
    assert status["phase"] == "Preempted" and status["preemptingAttempt"] == 2
    assert status["reason"] == UNSCHEDULABLE and status["unschedulableGiveBacks"] == 1
    assert note == status["message"]
    assert note.startswith(f"attempt 2: no node took its pod in 12 min (the scheduler: {SAID})")
    assert f"requeued (1 of at most {MAX_UNSCHEDULABLE_GIVE_BACKS})" in note
    done = {"unschedulableGiveBacks": MAX_UNSCHEDULABLE_GIVE_BACKS}
    given = give_back_unschedulable(done, waiting_pod(), NOW, 600)
    assert given is not None
    status, note = given
    assert (status["phase"], status["reason"]) == ("Failed", UNSCHEDULABLE)
    assert "unschedulableGiveBacks" not in status and status["completionTime"]
    assert "check its nodeSelector, affinity and tolerations" in note


def test_once_its_pod_is_gone_it_is_queued_showing_why() -> None:
    job = {"metadata": {"name": "train", "namespace": "team"},
           "spec": {"gpu": {"isolation": "mps"}},
           "status": {"phase": "Preempted", "attempts": 2, "preemptingAttempt": 2,
                      "reason": UNSCHEDULABLE, "message": "attempt 2: no node took its pod"}}
    # stopping: it still shows Preempted, and the reason stays
    stopping = observe(job, [waiting_pod(deleting=True)], {}, NOW)
    assert stopping.phase.value == "Preempted" and "reason" not in stopping.status
    gone = observe(job, [], {}, NOW)
    assert gone.phase.value == "Queued"
    assert (gone.status["reason"], gone.status["message"]) == (
        UNSCHEDULABLE, "attempt 2: no node took its pod")
    # a preemption's requeue is told as before
    job["status"]["reason"] = "PreemptedHigherClass"
    assert observe(job, [], {}, NOW).status["reason"] == "Preempted"
