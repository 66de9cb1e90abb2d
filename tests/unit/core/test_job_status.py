"""The status rules of `core.job_status`: what a job's status shows, which changes of a
waiting job are written at once and which wait for its refresh (what a user plans by goes out
at once), and that write-once fields (submit time, first estimate) stay as first written."""

from __future__ import annotations

import math
from typing import Any

from carpool.core import job_status
from carpool.core.job_status import JobEvent, RecordedEvents, changes, wait_change_is_urgent
from carpool.core.preemption import PreemptionCause
from carpool.core.queueing import DUE_NOTE, Expiry, Preemption, Wait, WaitReason
from carpool.core.timestamps import format_timestamp

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


def test_estimates_are_rounded_finer_the_nearer_they_are() -> None:
    # the coarsest of 1, 2, 5 and 10 s within 5 % of the time until the estimate
    assert [job_status.estimate_step(s) for s in (0, 30, 39.9, 40, 99, 100, 199, 200, 86400)
            ] == [1, 1, 1, 2, 2, 5, 5, 10, 10]


def test_position_and_small_estimate_moves_wait_for_the_refresh() -> None:
    assert not urgent(wait(600, 1200), wait(600, 1200, position=2))
    assert not urgent(wait(600, 1200), wait(650, 1200))


def test_reason_and_estimate_changes_are_urgent() -> None:
    assert urgent(wait(600), wait(600, reason="QuotaExceeded"))
    assert urgent(wait(100), wait(161))
    assert urgent(wait(None), wait(600))
    assert urgent(wait(600), wait(None))


def test_an_estimate_is_urgent_past_a_quarter_of_the_time_until_it() -> None:
    # 600 s away: a quarter is 150 s; the estimate's own jump when nearer
    assert not urgent(wait(600), wait(740))
    assert urgent(wait(600), wait(760))
    assert urgent(wait(600), wait(440))
    assert not urgent(wait(100), wait(150))


def test_an_estimate_that_has_passed_counts_as_now() -> None:
    # it said "now" and says about that still: no news
    assert not urgent(wait(-90), wait(30))
    assert urgent(wait(-90), wait(90))


def test_a_turn_between_the_no_slot_now_reasons_waits_for_the_refresh() -> None:
    capacity, behind = WaitReason.CAPACITY.value, WaitReason.BEHIND_HIGHER_RANKED.value
    assert not urgent(wait(600, reason=capacity), wait(600, reason=behind))
    assert not urgent(wait(600, reason=behind), wait(600, reason=capacity))
    assert urgent(wait(600, reason=capacity), wait(600, reason=WaitReason.QUOTA.value))


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


def test_a_first_estimate_is_never_rewritten_by_a_pass_that_read_the_job_before_it() -> None:
    first = {"firstEstimatedStart": format_timestamp(NOW + 300),
             "firstSimulatedStart": format_timestamp(NOW + 250),
             "firstEstimatedStartEarliest": format_timestamp(NOW + 200),
             "firstEstimatedStartLatest": format_timestamp(NOW + 450),
             "submitTime": format_timestamp(NOW - 60)}
    status = {"phase": "Queued", **first}
    # a pass that read the job before its first estimate showed derives one again, later
    later = {k: format_timestamp(NOW + 900) for k in first}
    patch = {**wait(900, 1200), **later}
    written = job_status.status_write(status, patch, NOW)
    assert not set(first) & set(written)
    assert written["estimatedStart"] == format_timestamp(NOW + 900)
    # a first estimate written without a range is not given a later estimate's range
    del status["firstEstimatedStartEarliest"], status["firstEstimatedStartLatest"]
    assert not set(first) & set(job_status.status_write(status, patch, NOW))


def test_a_job_that_has_started_is_never_given_a_first_estimate() -> None:
    # preempted before it was ever estimated, it waits again: its estimate is shown, but a
    # first estimate now would be compared with a start that came before it
    status = {"phase": "Preempted", "submitTime": format_timestamp(NOW - 600),
              "startTime": format_timestamp(NOW - 590)}
    first = {"firstEstimatedStart": format_timestamp(NOW + 300),
             "firstSimulatedStart": format_timestamp(NOW + 250)}
    written = changes(status, {**wait(300), **first})
    assert written["estimatedStart"] == format_timestamp(NOW + 300)
    assert not set(first) & set(written)
    # never started: the same wait writes its first estimate
    del status["startTime"]
    assert set(first) <= set(changes(status, {**wait(300), **first}))


def test_an_absent_field_equals_null_and_an_empty_history() -> None:
    assert changes({}, {"queuePosition": None, "history": []}) == {}
    assert changes({"history": [{"attempt": 1}]}, {"history": []}) == {"history": []}


def test_a_started_jobs_wait_is_recorded_without_a_first_estimate() -> None:
    # the wait is written, never with a first estimate, and once written it has nothing more
    # to write (no patch of first-estimate fields alone at every refresh)
    status: dict[str, Any] = {"phase": "Queued", "reason": WaitReason.CAPACITY.value,
                              "submitTime": format_timestamp(NOW - 600),
                              "startTime": format_timestamp(NOW - 590)}
    waiting = Wait("team/job", WaitReason.CAPACITY, "no node has room now", 1, 0, NOW + 300,
                   simulated_start=NOW + 250)
    update = job_status.wait_update(status, waiting, NOW, 0.0, 0.0, JUMP)
    assert update is not None and update.event is None  # the same reason: no Event
    assert update.patch["estimatedStart"] and not any(k.startswith("first")
                                                      for k in update.patch)
    status.update(update.patch)
    assert job_status.wait_update(status, waiting, NOW, 0.0, 0.0, JUMP) is None


def test_a_first_wait_gets_its_first_estimate_with_its_range_and_an_event() -> None:
    waiting = Wait("team/job", WaitReason.CLASS_LIMIT, "over its class limit", 0, 0, NOW + 300,
                   estimated_start_low=NOW + 200, estimated_start_high=NOW + 600,
                   simulated_start=NOW + 250)
    update = job_status.wait_update({"phase": "Queued"}, waiting, NOW, 0.0, 0.0, JUMP)
    assert update is not None and update.urgent
    assert "queuePosition" not in update.patch  # refused: no place in the queue
    assert update.patch["firstEstimatedStart"] == update.patch["estimatedStart"]
    assert update.patch["firstEstimatedStartLatest"] == format_timestamp(NOW + 600)
    assert update.patch["firstSimulatedStart"] == format_timestamp(NOW + 250)
    assert update.event == JobEvent("ClassLimitExceeded", "over its class limit", "Warning",
                                    "Queue", wait=True)


def test_the_backlog_and_start_delay_shift_the_estimate_and_say_so() -> None:
    waiting = Wait("team/job", WaitReason.CAPACITY, "no node has room now", 2, 1, NOW + 3600)
    # an hour ahead: rounded to 10 s; the backlog and delay counted in 10 s steps
    fields = job_status.wait_fields({}, waiting, NOW, 34.0, 46.0)
    assert fields["estimatedStart"] == format_timestamp(NOW + 3600 + 30 + 50)
    assert fields["message"] == ("no node has room now (+30s to carry out the admissions "
                                 "decided before it) (+50s from admission to a running pod, "
                                 "recent median)")
    # no estimate, nothing to shift: the message as the queue gave it
    never = Wait("team/job", WaitReason.CAPACITY, "fits no node", 0, 0, None)
    assert job_status.wait_fields({}, never, NOW, 34.0, 46.0)["message"] == "fits no node"


def test_a_wait_goes_out_when_urgent_written_anyway_or_due_for_its_refresh() -> None:
    calm = job_status.WaitUpdate({"queuePosition": 2}, urgent=False, event=None)
    assert not job_status.write_wait_now(calm, False, 59.0, 60.0)
    assert job_status.write_wait_now(calm, True, 59.0, 60.0)
    assert job_status.write_wait_now(calm, False, 60.0, 60.0)
    assert job_status.write_wait_now(
        job_status.WaitUpdate({}, urgent=True, event=None), False, 0.0, 60.0)
    # 921 waiting jobs at 5 writes/s: each one refreshed every 184.2 s, not every minute
    assert job_status.wait_refresh_s(921, 60.0, 5.0) == 184.2
    assert job_status.wait_refresh_s(10, 60.0, 5.0) == 60.0


def test_a_first_wait_is_held_while_the_next_pass_may_overturn_it() -> None:
    waiting = Wait("team/job", WaitReason.CAPACITY, "no node has room now", 3, 0, NOW + 600)
    first = job_status.wait_update({}, waiting, NOW, 0.0, 0.0, JUMP)
    assert first is not None and first.first and first.urgent
    # a pass that left admissions for later, for at most a refresh period of the job's wait
    assert job_status.wait_unsettled(True, left_waiting_s=0.0, refresh_s=60.0)
    assert job_status.wait_unsettled(True, left_waiting_s=59.0, refresh_s=60.0)
    assert not job_status.wait_unsettled(True, left_waiting_s=60.0, refresh_s=60.0)
    assert not job_status.wait_unsettled(False, left_waiting_s=0.0, refresh_s=60.0)
    assert not job_status.write_wait_now(first, False, math.inf, 60.0, unsettled=True)
    assert job_status.write_wait_now(first, False, math.inf, 60.0, unsettled=False)
    # written with another write of the job (its submit time goes with it) all the same
    assert job_status.write_wait_now(first, True, math.inf, 60.0, unsettled=True)
    # a job that shows a wait already: a reason change is written at once, burst or not
    shown = {"phase": "Queued", "reason": "Capacity", "message": "no node has room now"}
    quota = job_status.wait_update(shown, Wait("team/job", WaitReason.QUOTA, "over quota", 3,
                                               0, None), NOW, 0.0, 0.0, JUMP)
    assert quota is not None and not quota.first and quota.urgent
    assert job_status.write_wait_now(quota, False, 0.0, 60.0, unsettled=True)


def test_a_new_job_shows_its_submit_time_and_queued_once() -> None:
    obj: dict[str, Any] = {"metadata": {"creationTimestamp": "2027-01-15T08:00:00Z"}}
    assert job_status.initial_status(obj) == {"submitTime": "2027-01-15T08:00:00Z",
                                              "phase": "Queued"}
    obj["status"] = {"submitTime": "2027-01-15T08:00:00Z", "phase": "Running"}
    assert job_status.initial_status(obj) == {}


def test_derived_events_once_wait_reasons_once_until_another_event() -> None:
    told = RecordedEvents()
    started = JobEvent("Started", "attempt 1 started", derived=True)
    assert told.admit(started) and not told.admit(started)
    queued = JobEvent("Queued", "no room", wait=True)
    assert told.admit(queued) and not told.admit(queued)
    admitted = JobEvent("Admitted", "admitted", action="Admit")
    assert told.admit(admitted) and told.admit(admitted)  # decisions: each time
    assert told.admit(queued)  # waiting again after another Event


def test_an_expired_job_closes_its_open_run_and_fails() -> None:
    history = [{"attempt": 1, "start": format_timestamp(NOW - 7200), "fraction": 0.5}]
    patch, event = job_status.expired(history, Expiry("team/job", 7200.0, 3600.0, 30.0), NOW)
    assert patch["phase"] == "Failed" and patch["reason"] == "MaxDurationExceeded"
    assert patch["history"][0]["end"] == format_timestamp(NOW)
    assert patch["history"][0]["outcome"] == "MaxDurationExceeded"
    assert event.note == "ran 7200s, over its maxDuration of 3600s; stopped"
    assert patch["gpuHours"] == 1.0
    assert "end" not in history[0]  # the status as read is left alone


def test_a_preempted_job_records_the_attempt_being_stopped() -> None:
    preemption = Preemption("team/low", "team/high", "node-1", PreemptionCause.HIGHER_CLASS, 30.0,
                            0.1, "preempted for team/high")
    patch, on_victim, on_preemptor = job_status.preempted(3, preemption)
    assert patch == {"phase": "Preempted", "preemptingAttempt": 3,
                     "reason": f"Preempted{PreemptionCause.HIGHER_CLASS.value}",
                     "message": "preempted for team/high"}
    assert (on_victim.reason, on_victim.type) == ("Preempted", "Warning")
    assert on_preemptor.note == "preempting team/low on node-1"
