"""`carpool.reporting` directly: the edges the plugin's tables do not show."""

from __future__ import annotations

import json
from typing import Any

import pytest

from carpool import reporting
from carpool.core import names
from carpool.core.durations import format_duration_roughly
from carpool.core.timestamps import format_timestamp as format_time
from carpool.reporting import parse_since, relative

NOW = 1_800_000_000.0


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (59.6, "60s"), (119, "119s"), (120, "2m"), (450, "7m30s"), (599, "9m59s"),
    (600, "10m"), (2550, "42m"), (3 * 3600, "3h"), (3 * 3600 + 1200, "3h20m"),
    (8 * 3600, "8h"), (20 * 3600 + 1700, "20h"), (54 * 3600, "2d6h"), (12 * 86400, "12d"),
])
def test_format_duration_roughly(seconds: float, text: str) -> None:
    assert format_duration_roughly(seconds) == text


def test_relative() -> None:
    assert relative(None, NOW) == "-"
    assert relative(NOW + 0.4, NOW) == "now"
    assert relative(NOW + 300, NOW) == "in 5m"
    assert relative(NOW - 90, NOW) == "90s ago"


def test_parse_since() -> None:
    assert parse_since("12h", NOW) == NOW - 12 * 3600
    assert parse_since("2027-01-15", NOW) == parse_since("2027-01-15T00:00:00Z", NOW)
    with pytest.raises(ValueError, match="got 'yesterday'"):
        parse_since("yesterday", NOW)


def job(history: list[dict[str, Any]], project: str = "p", name: str = "j") -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name}, "spec": {"project": project},
            "status": {"history": history}}


def test_usage_report_clips_runs_to_the_window() -> None:
    runs = [{"fraction": 1.0, "start": format_time(NOW - 7200), "end": format_time(NOW - 3600)},
            {"fraction": 0.5, "start": format_time(NOW - 1800)},  # open: counts up to now
            {"fraction": 1.0, "start": format_time(NOW - 90000), "end": format_time(NOW - 86500)},
            {"fraction": 1.0}]  # never started: ignored
    report = reporting.usage_report([job(runs)], NOW - 5400, NOW)
    (row,) = report.rows
    # first run clipped to its last 30 min (0.5 h), open run 0.5 GPU x 0.5 h, third outside
    assert row.gpu_hours == pytest.approx(0.75)
    assert (row.runs, row.jobs, row.share) == (2, 1, 1.0)


def test_usage_report_counts_a_run_stamped_as_ending_before_it_started() -> None:
    runs = [{"fraction": 1.0, "start": format_time(NOW - 600), "end": format_time(NOW - 601)}]
    (row,) = reporting.usage_report([job(runs)], NOW - 3600, NOW).rows
    assert (row.runs, row.gpu_hours) == (1, 0.0)


def test_usage_report_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="by 'project' or 'job', not 'node'"):
        reporting.usage_report([], NOW - 1, NOW, by="node")
    with pytest.raises(ValueError, match="starts in the future"):
        reporting.usage_report([], NOW + 60, NOW)
    assert reporting.usage_report([], NOW - 60, NOW).rows == ()


def pod(annotation: str, node_name: str = "", phase: str = "Pending",
        scheduler: str = names.SCHEDULER_NAME) -> dict[str, Any]:
    spec = {"schedulerName": scheduler, **({"nodeName": node_name} if node_name else {})}
    return {"metadata": {"namespace": "ns", "name": "p",
                         "annotations": {"carpool.dev/assignment": annotation}},
            "spec": spec, "status": {"phase": phase}}


def test_assignments_skip_bad_stale_and_finished_pods() -> None:
    good = json.dumps({"node": "n1", "gpus": [{"uuid": "G", "index": 0, "memoryMiB": 1024,
                                               "cores": 10}]})
    shares = reporting.assignments_by_gpu([
        pod(good), pod("{not json"), pod(json.dumps({"gpus": []})), pod(good, node_name="n2"),
        pod(good, phase="Failed"), pod(good.replace('"G"', '"other"'), scheduler="mine")])
    assert list(shares) == ["G"]  # (a pod another scheduler placed holds no Carpool GPU)
    (share,) = shares["G"]
    assert (share.memory_mib, share.cores_pct, share.exclusive) == (1024, 10, False)


def test_explain_an_unreadable_spec() -> None:
    bad = {"metadata": {"namespace": "ns", "name": "j"},
           "spec": {"project": "p", "gpu": {"count": 1, "memory": "lots"}},
           "status": {"phase": "Queued", "reason": "Capacity"}}
    explanation = reporting.explain(bad, None, [bad], [], [], NOW)
    assert explanation.waiting
    assert explanation.findings[-1].blocking
    assert ("the spec cannot be read: spec.gpu.memory: not a quantity"
            in explanation.findings[-1].text)


def test_explain_a_job_the_operator_has_not_seen() -> None:
    fresh = {"metadata": {"namespace": "ns", "name": "j"},
             "spec": {"project": "p", "gpu": {"count": 1, "memory": "1Gi"}}}
    explanation = reporting.explain(fresh, None, [fresh], [], [], NOW)
    assert explanation.summary == f"ns/j waits: {reporting.NO_REASON_YET}"
    capacity = [f for f in explanation.findings if f.topic is reporting.Topic.CAPACITY]
    assert capacity[0].text.startswith("no node has room now (0Gi free")


def test_queue_groups_count_reasons() -> None:
    def waiting(name: str, reason: str, position: int) -> dict[str, Any]:
        return {"metadata": {"namespace": "ns", "name": name},
                "spec": {"project": "p", "class": "short", "gpu": {"count": 2}},
                "status": {"phase": "Queued", "reason": reason, "queuePosition": position}}

    entries = reporting.waiting_jobs([waiting("a", "Quota", 3), waiting("b", "Capacity", 1),
                                      waiting("c", "Quota", 2)])
    assert [e.name for e in entries] == ["b", "c", "a"]
    (group,) = reporting.queue_groups(entries)
    assert (group.waiting, group.gpus, group.head_position) == (3, 6, 1)
    assert dict(group.reasons) == {"Quota": 2, "Capacity": 1}


def test_to_jsonable_handles_infinities_and_sets() -> None:
    assert reporting.to_jsonable({"x": float("inf"), "s": frozenset({"b", "a"})}) == {
        "x": None, "s": ["a", "b"]}


def _waiting(preemptible: bool, job_class: str = "batch") -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": "w", "creationTimestamp": format_time(NOW)},
            "spec": {"project": "p", "class": job_class, "preemptible": preemptible,
                     "gpu": {"count": 1, "memory": "80Gi", "isolation": "exclusive"},
                     "estimatedDuration": "10h"},
            "status": {"phase": "Queued", "reason": "Quota"}}


def _project(borrow_limit: float, on_exhausted: str = "Hold", used: float = 0.0,
             running: float = 2.0) -> dict[str, Any]:
    return {"metadata": {"name": "p", "creationTimestamp": format_time(NOW - 3600)},
            "spec": {"namespaces": ["ns"], "concurrent": {"gpus": 2},
                     "borrowing": {"enabled": True, "maxGpus": borrow_limit},
                     "gpuHours": {"budget": 20, "period": "30d", "onExhausted": on_exhausted}},
            "status": {"running": {"gpus": running, "jobs": 2}, "borrowed": {"gpus": 0},
                       "usedGpuHours": used, "remainingGpuHours": 20 - used}}


def _finding(explanation: reporting.Explanation, topic: reporting.Topic) -> reporting.Finding:
    return next(f for f in explanation.findings if f.topic is topic)


@pytest.mark.parametrize(("preemptible", "limit", "blocking", "words"), [
    (True, 1.0, False, "may borrow idle GPUs"),
    (True, 0.5, True, "borrowing would pass the limit of 0.5"),
    (False, 1.0, True, "only preemptible, non-interactive jobs borrow"),
])
def test_why_quota_uses_the_operators_borrowing_rules(preemptible: bool, limit: float,
                                                      blocking: bool, words: str) -> None:
    waiting = _waiting(preemptible)
    quota = _finding(reporting.explain(waiting, _project(limit), [waiting], [], [], NOW),
                     reporting.Topic.QUOTA)
    assert quota.blocking is blocking and words in quota.text, quota


@pytest.mark.parametrize(("policy", "preemptible", "blocking"), [
    ("Hold", True, True), ("PreemptibleOnly", True, False), ("PreemptibleOnly", False, True)])
def test_why_budget_uses_the_operators_budget_rules(policy: str, preemptible: bool,
                                                    blocking: bool) -> None:
    """10 hours of a whole GPU do not fit the 5 GPU-hours left; PreemptibleOnly still lets a
    preemptible job run (as a borrower, within the borrow limit)."""
    waiting = _waiting(preemptible)
    quota = _project(1.0, policy, used=15.0, running=0.0)
    budget = _finding(reporting.explain(waiting, quota, [waiting], [], [], NOW),
                      reporting.Topic.BUDGET)
    assert budget.blocking is blocking, budget
    assert "this job may use 10 (1 GPU x 10h)" in budget.text
    assert ("once spent, only preemptible" in budget.text) is (policy == "PreemptibleOnly")


def test_a_run_shorter_than_a_second_is_still_a_run() -> None:
    """Status times have one-second resolution: a job that printed and exited within one has
    start == end. It held its GPUs for (nearly) no time, but it ran and belongs in the bill."""
    instant = {"fraction": 1.0, "start": format_time(NOW - 60), "end": format_time(NOW - 60)}
    (row,) = reporting.usage_report([job([instant], project="quick")], NOW - 3600, NOW).rows
    assert (row.key, row.runs, row.jobs, row.gpu_hours) == ("quick", 1, 1, 0.0)
    assert reporting.usage_report([job([instant])], NOW - 30, NOW).rows == ()  # before the window
