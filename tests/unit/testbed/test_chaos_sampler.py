"""The load run's sampler judges budgets at the instant its watch-fed view is known to be
current, so a watch running behind cannot make a budget look overspent (load run 12)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from carpool.core import names
from carpool_testbed import chaos


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def running_pod(name: str, started: float) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "creationTimestamp": stamp(started - 5),
                         "labels": {names.LABEL_PROJECT: "p"},
                         "annotations": {names.ANN_ASSIGNMENT: json.dumps(
                             {"node": "n0", "gpus": [{"uuid": "g0", "index": 0, "memoryMiB": 1000,
                                                      "cores": 100}]})}},
            "status": {"phase": "Running", "startTime": stamp(started),
                       "containerStatuses": [{"state": {"running": {
                           "startedAt": stamp(started)}}}]}}


def test_latest_time_is_the_newest_stamp_a_pod_carries() -> None:
    pod = running_pod("a", 1_800_000_000.0)
    pod["status"]["conditions"] = [{"type": "Ready", "lastTransitionTime": stamp(1_800_000_042)}]
    assert chaos.latest_time(pod) == 1_800_000_042.0
    assert chaos.latest_time({"metadata": {}}) == 0.0


def test_a_lagging_view_does_not_overspend_a_budget_but_a_current_one_does() -> None:
    now = time.time()
    period_start = now - 100  # a 300 s period began 100 s ago
    budget = chaos.Budget(gpu_hours=30 / 3600, period_s=300, anchor=period_start)
    capacity = {g: chaos.GpuCapacity("n0", 1000, True) for g in ("g0", "g1")}
    sampler = chaos.Sampler(None, capacity, {}, budgets={"p": budget})
    sampler._record(running_pod("a", period_start + 10))  # one whole GPU since then
    # The newest thing the view has seen is 10 s into the period: the run used 0 GPU-s by then
    # (it may have finished since; the watch has not said), not the 90 GPU-s of wall time.
    assert sampler.check() == []
    other = running_pod("b", now - 1)  # a write from a second ago: the view is current
    other["metadata"]["labels"][names.LABEL_PROJECT] = "q"
    other["metadata"]["annotations"][names.ANN_ASSIGNMENT] = json.dumps(
        {"node": "n0", "gpus": [{"uuid": "g1", "index": 1, "memoryMiB": 1000, "cores": 100}]})
    sampler._record(other)
    [problem] = sampler.check()
    assert problem.startswith("p over its budget"), problem
