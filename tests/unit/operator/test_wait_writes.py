"""Which changes of a waiting job's status are written at once and which wait for its next
refresh (`wait_change_is_urgent`): what a user plans by goes out at once; and that a job's
first estimate, once written, stays."""

from __future__ import annotations

from typing import Any

from carpool.core.queueing import DUE_NOTE, Wait, WaitReason
from carpool.core.timestamps import format_timestamp
from carpool.operator.reconciler import (
    PassState,
    Reconciler,
    ReconcilerConfig,
    wait_change_is_urgent,
)

NOW = 1_800_000_000.0
JUMP = 60.0


def wait(estimate_in: float | None, latest_in: float | None = None,
         reason: str = "Queued", position: int = 3, message: str = "no node has room now"
         ) -> dict[str, Any]:
    """A wait as written: estimate and range end `*_in` seconds from NOW."""
    return {"reason": reason, "queuePosition": position, "message": message,
            "estimatedStart": None if estimate_in is None
            else format_timestamp(NOW + estimate_in),
            "estimatedStartLatest": None if latest_in is None
            else format_timestamp(NOW + latest_in)}


def urgent(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return wait_change_is_urgent(before, after, NOW, JUMP)


def test_position_and_small_estimate_moves_wait_for_the_refresh() -> None:
    assert not urgent(wait(600, 1200), wait(600, 1200, position=2))
    assert not urgent(wait(600, 1200), wait(650, 1200))


def test_reason_and_estimate_changes_are_urgent() -> None:
    assert urgent(wait(600), wait(600, reason="QuotaExceeded"))
    assert urgent(wait(600), wait(661))
    assert urgent(wait(None), wait(600))
    assert urgent(wait(600), wait(None))


def test_becoming_due_is_urgent_other_message_changes_wait() -> None:
    due = f"no node has room now; {DUE_NOTE}"
    assert urgent(wait(600), wait(600, message=due, position=1))
    assert urgent(wait(600, message=due), wait(600))
    assert not urgent(wait(600), wait(600, message="no node has room now; 3 ahead"))
    assert not urgent(wait(600, message=due), wait(600, message=due, position=2))


def test_a_range_that_appears_or_goes_is_urgent() -> None:
    assert urgent(wait(600), wait(600, 1200))
    assert urgent(wait(600, 1200), wait(600))


def test_the_range_end_is_urgent_past_a_quarter_of_the_time_until_it() -> None:
    # 1200 s away: a quarter is 300 s
    assert not urgent(wait(600, 1200), wait(600, 1490))
    assert urgent(wait(600, 1200), wait(600, 1510))
    assert urgent(wait(600, 1200), wait(600, 890))
    # near ends: at least the estimate's own jump
    assert not urgent(wait(20, 100), wait(20, 150))
    assert urgent(wait(20, 100), wait(20, 170))


class Writes:
    """The API port's status writes, recorded."""

    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []

    def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> str:
        self.statuses.append(status)
        return str(len(self.statuses))


def test_a_first_estimate_is_never_rewritten_by_a_pass_that_read_the_job_before_it() -> None:
    kube = Writes()
    reconciler = Reconciler(kube, ReconcilerConfig(), None)  # type: ignore[arg-type]
    first = {"firstEstimatedStart": format_timestamp(NOW + 300),
             "firstSimulatedStart": format_timestamp(NOW + 250),
             "firstEstimatedStartEarliest": format_timestamp(NOW + 200),
             "firstEstimatedStartLatest": format_timestamp(NOW + 450),
             "submitTime": format_timestamp(NOW - 60)}
    obj = {"metadata": {"name": "job", "namespace": "team", "uid": "u", "resourceVersion": "7"},
           "spec": {"class": "batch"}, "status": {"phase": "Queued", **first}}
    # a pass that read the job before its first estimate showed derives one again, later
    later = {k: format_timestamp(NOW + 900) for k in first}
    patch = {**wait(900, 1200), **later}
    reconciler._flush_one(PassState(objects={"team/job": obj}, patches={"team/job": patch}),
                          "team/job")
    (written,) = kube.statuses
    assert not set(first) & set(written)
    assert written["estimatedStart"] == format_timestamp(NOW + 900)
    # a first estimate written without a range is not given a later estimate's range
    del obj["status"]["firstEstimatedStartEarliest"], obj["status"]["firstEstimatedStartLatest"]
    reconciler._flush_one(PassState(objects={"team/job": obj}, patches={"team/job": patch}),
                          "team/job")
    assert not set(first) & set(kube.statuses[-1])


def test_a_job_that_has_started_is_never_given_a_first_estimate() -> None:
    # preempted before it was ever estimated, it waits again: its estimate is shown, but a
    # first estimate now would be compared with a start that came before it
    kube = Writes()
    reconciler = Reconciler(kube, ReconcilerConfig(), None)  # type: ignore[arg-type]
    status = {"phase": "Preempted", "submitTime": format_timestamp(NOW - 600),
              "startTime": format_timestamp(NOW - 590)}
    obj = {"metadata": {"name": "job", "namespace": "team", "uid": "u", "resourceVersion": "7"},
           "spec": {"class": "batch"}, "status": status}
    first = {"firstEstimatedStart": format_timestamp(NOW + 300),
             "firstSimulatedStart": format_timestamp(NOW + 250)}
    reconciler._flush_one(PassState(objects={"team/job": obj},
                                    patches={"team/job": {**wait(300), **first}}), "team/job")
    (written,) = kube.statuses
    assert written["estimatedStart"] == format_timestamp(NOW + 300)
    assert not set(first) & set(written)
    # never started: the same wait writes its first estimate
    del status["startTime"]
    reconciler._flush_one(PassState(objects={"team/job": obj},
                                    patches={"team/job": {**wait(300), **first}}), "team/job")
    assert set(first) <= set(kube.statuses[-1])


def test_a_started_jobs_wait_is_recorded_without_a_first_estimate() -> None:
    # the wait is written, never with a first estimate, and once written it has nothing more
    # to write (no patch of first-estimate fields alone at every refresh)
    reconciler = Reconciler(Writes(), ReconcilerConfig(wait_refresh_s=0.0),
                            None)  # type: ignore[arg-type]
    status: dict[str, Any] = {"phase": "Queued", "reason": WaitReason.CAPACITY.value,
                              "submitTime": format_timestamp(NOW - 600),
                              "startTime": format_timestamp(NOW - 590)}
    obj = {"metadata": {"name": "job", "namespace": "team", "uid": "u"},
           "spec": {"class": "batch"}, "status": status}
    waiting = Wait("team/job", WaitReason.CAPACITY, "no node has room now", 1, 0, NOW + 300,
                   simulated_start=NOW + 250)
    state = PassState(objects={"team/job": obj})
    reconciler._record_wait(state, waiting, NOW)
    written = state.patches["team/job"]
    assert written["estimatedStart"] and not any(k.startswith("first") for k in written)
    status.update(written)
    again = PassState(objects={"team/job": obj})
    reconciler._record_wait(again, waiting, NOW)
    assert "team/job" not in again.patches
