"""A job whose pod finished and was deleted before the job's status said so (its status write
lost to an API outage or an operator restart, the pod then garbage-collected) ends as its pod
did, by the last state the watch showed: requeued as lost, it would run to success twice."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from carpool.core.lifecycle import PodView, observe
from carpool.core.resources import Phase
from carpool.core.timestamps import format_run_time

STARTED = 1_800_000_000.0


def _job(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "train", "namespace": "team"},
            "spec": {"gpu": {"isolation": "mps"}},
            "status": {"phase": "Running", "attempts": 1, "podUID": "p1", "history": [
                {"attempt": 1, "node": "n1", "fraction": 0.5,
                 "start": format_run_time(STARTED)}], **status}}


LAST = PodView(name="train-1", namespace="team", attempt=0, phase="Succeeded", node="n1",
               assignment=None, started=STARTED, finished=STARTED + 60, deleting=False,
               exit_reason="", uid="p1", gpu_pod=True)


def test_a_succeeded_pod_deleted_before_its_status_was_written_ends_the_job() -> None:
    seen = observe(_job(), [], {}, STARTED + 90, pod_gone_at=STARTED + 80, gone_pod=LAST)
    assert seen.phase is Phase.SUCCEEDED and seen.attempts == 1
    assert seen.status["reason"] == "Succeeded"
    assert seen.status["history"][0]["outcome"] == "Succeeded"
    assert [e[1] for e in seen.events] == ["Succeeded"]
    assert seen.live_pod is None  # nothing left to act on


def test_a_failed_pod_deleted_before_its_status_was_written_fails_the_job() -> None:
    failed = replace(LAST, phase="Failed", exit_reason="Error")
    seen = observe(_job(), [], {}, STARTED + 90, pod_gone_at=STARTED + 80, gone_pod=failed)
    assert seen.phase is Phase.FAILED and seen.status["reason"] == "Error"


def test_a_pod_gone_while_it_ran_or_being_preempted_is_still_requeued() -> None:
    running = replace(LAST, phase="Running", finished=None)
    lost = observe(_job(), [], {}, STARTED + 90, pod_gone_at=STARTED + 80, gone_pod=running)
    assert lost.phase is Phase.QUEUED and lost.status["reason"] == "PodLost"
    preempted = observe(_job(preemptingAttempt=1), [], {}, STARTED + 90,
                        pod_gone_at=STARTED + 80, gone_pod=LAST)
    assert preempted.phase is Phase.QUEUED and preempted.status["reason"] == "Preempted"
