"""A usage record keeps the time the operator saw its pod gone to the millisecond: cut to the
second, every run of a pod deleted between passes would be billed half a second short on
average (`core.timestamps.format_run_time`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from carpool.core.lifecycle import history_gpu_hours, observe
from carpool.core.timestamps import epoch_seconds, format_run_time

STARTED = 1_800_000_000.0  # a pod's own times are whole seconds


def test_whole_seconds_stay_as_kubernetes_writes_them() -> None:
    assert format_run_time(STARTED) == "2027-01-15T08:00:00Z"


def test_the_operators_clock_is_kept_to_the_millisecond() -> None:
    assert format_run_time(STARTED + 0.4567) == "2027-01-15T08:00:00.457Z"
    assert format_run_time(STARTED + 0.9996) == "2027-01-15T08:00:01.000Z"
    assert epoch_seconds(format_run_time(STARTED + 12.25)) == STARTED + 12.25


def test_a_pod_seen_gone_bills_its_run_up_to_that_moment() -> None:
    seen_gone = STARTED + 30.8
    job = {"metadata": {"name": "train", "namespace": "team"},
           "spec": {"gpu": {"isolation": "mps"}},
           "status": {"phase": "Running", "attempts": 1, "history": [
               {"attempt": 1, "node": "n1", "fraction": 0.5,
                "start": format_run_time(STARTED)}]}}
    lost = observe(job, [], {}, seen_gone)
    record = lost.status["history"][0]
    assert record["outcome"] == "PodLost"
    assert epoch_seconds(record["end"]) == seen_gone
    assert abs(history_gpu_hours(lost.status["history"], seen_gone) * 3600 - 0.5 * 30.8) < 1e-6


def test_a_pod_seen_deleted_before_the_pass_ends_its_run_when_it_went() -> None:
    job = {"metadata": {"name": "train", "namespace": "team"},
           "spec": {"gpu": {"isolation": "mps"}},
           "status": {"phase": "Running", "attempts": 1, "history": [
               {"attempt": 1, "node": "n1", "fraction": 0.5,
                "start": format_run_time(STARTED)}]}}
    lost = observe(job, [], {}, STARTED + 31.0, pod_gone_at=STARTED + 30.2)
    assert epoch_seconds(lost.status["history"][0]["end"]) == STARTED + 30.2
    # a deletion time before the record's start (another pod's) never makes it negative
    early = observe(job, [], {}, STARTED + 31.0, pod_gone_at=STARTED - 5)
    assert epoch_seconds(early.status["history"][0]["end"]) == STARTED


def test_a_job_that_runs_or_ends_shows_no_wait() -> None:
    from carpool.core.lifecycle import NOT_WAITING, PodView

    waited = {"queuePosition": 3, "estimatedStart": "2027-01-15T08:10:00Z",
              "estimatedStartEarliest": "2027-01-15T08:05:00Z",
              "estimatedStartLatest": "2027-01-15T08:20:00Z"}
    job: dict[str, Any] = {"metadata": {"name": "train", "namespace": "team"},
                           "spec": {"gpu": {"isolation": "mps"}},
                           "status": {"phase": "Admitted", "attempts": 1, **waited}}
    pod = PodView(name="train-1", namespace="team", attempt=1, phase="Running", node="n1",
                  assignment=None, started=STARTED, finished=None, deleting=False,
                  exit_reason="", uid="p1", gpu_pod=True)
    running = observe(job, [pod], {}, STARTED + 1)
    assert running.status["phase"] == "Running"
    assert {k: running.status[k] for k in NOT_WAITING} == NOT_WAITING
    done = observe({**job, "status": {**job["status"], "phase": "Running"}},
                   [replace(pod, phase="Succeeded", finished=STARTED + 60)], {}, STARTED + 61)
    assert done.status["phase"] == "Succeeded"
    assert {k: done.status[k] for k in NOT_WAITING} == NOT_WAITING
