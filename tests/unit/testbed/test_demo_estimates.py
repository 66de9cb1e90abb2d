"""The demo's progress line and its estimate-vs-actual lines, from GpuJob objects."""

from __future__ import annotations

from typing import Any

from carpool.core.timestamps import format_timestamp
from carpool_testbed.demo import EstimateLog, progress_line

T0 = 1_800_000_000.0


def gpujob(name: str, phase: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "vision", "name": name},
            "status": {"phase": phase, **status}}


def test_estimates_shown_are_set_beside_the_actual_start() -> None:
    log = EstimateLog()
    log.observe([gpujob("a", "Queued", estimatedStart=format_timestamp(T0 + 100)),
                 gpujob("b", "Running", startTime=format_timestamp(T0))], T0)
    log.observe([gpujob("a", "Queued", estimatedStart=format_timestamp(T0 + 100))], T0 + 5)
    log.observe([gpujob("a", "Queued", estimatedStart=format_timestamp(T0 + 130))], T0 + 50)
    log.observe([gpujob("a", "Running", startTime=format_timestamp(T0 + 120),
                        estimatedStart=format_timestamp(T0 + 130))], T0 + 125)
    # shown at T0 for T0+100, started T0+120: 20 s late, 17 % of a 2-minute wait
    assert log.lines() == ["    vision/a: estimated 08:01:40, started 08:02:00 — late by 20s, "
                           "17% of the 2m wait; 1 later estimate(s), last 08:02:10"]
    log.observe([gpujob("c", "Queued", estimatedStart=format_timestamp(T0 + 300))], T0 + 130)
    assert log.lines()[1] == "    vision/c: shown 08:05:00; has not started"


def test_a_preempted_job_is_measured_by_the_run_after_its_wait() -> None:
    """Ran from T0 - 60 (borrowed), preempted, shown T0 + 100 at T0, ran again at T0 + 90:
    its startTime stays at its first run, the history has both."""
    first = {"attempt": 1, "start": format_timestamp(T0 - 60), "end": format_timestamp(T0 - 5)}
    log = EstimateLog()
    log.observe([gpujob("a", "Preempted", startTime=format_timestamp(T0 - 60), history=[first],
                        estimatedStart=format_timestamp(T0 + 100))], T0)
    log.observe([gpujob("a", "Running", startTime=format_timestamp(T0 - 60), history=[
        first, {"attempt": 2, "start": format_timestamp(T0 + 90)}])], T0 + 95)
    assert log.lines() == ["    vision/a: estimated 08:01:40, started 08:01:30 — early by 10s, "
                           "11% of the 1m30s wait"]


def test_progress_line_counts_phases_and_names_the_next_start() -> None:
    jobs = [gpujob("a", "Running"), gpujob("b", "Queued", estimatedStart=format_timestamp(T0 + 90)),
            gpujob("c", "Queued", estimatedStart=format_timestamp(T0 + 30)),
            gpujob("d", "Succeeded")]
    assert progress_line(jobs, T0) == ("2 queued, 1 running, 1 succeeded; next: vision/c "
                                       "estimated in 30s")
    assert progress_line([gpujob("d", "Succeeded")], T0) == "1 succeeded"
