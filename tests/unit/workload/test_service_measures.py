"""The three measures of a serving job end to end within one process: `workload.Service`
times requests and writes `service.json`, the node agent's reader checks it, adds the GPU
model and how many jobs share the GPU, records it in the GpuJob status (a fake writer) and
the metrics; the core adds measures up per job, project, class and node."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from carpool import workload
from carpool.core import service_levels as levels
from carpool.core.checkpointing import ReportError
from carpool.core.interference import sample_of
from carpool.deviceplugin.handshake import ServedPod
from carpool.deviceplugin.metrics import GpuMetrics
from carpool.deviceplugin.reports import ReportReader, prepare

NOW = 1_800_000_000.0


def test_buckets_hold_latencies_within_their_growth() -> None:
    for latency in (0.00005, 0.0012, 0.0071, 0.06, 0.6, 5.0):
        index = levels.bucket_of(latency)
        assert levels.bucket_bound(index) >= latency
        assert index == 0 or levels.bucket_bound(index - 1) < latency
    assert levels.bucket_of(1e6) == levels.BUCKETS - 1


def test_p99_of_a_histogram_is_within_one_bucket_of_the_true_one() -> None:
    latencies = [0.010] * 980 + [0.080] * 20  # P99 is 80 ms
    p99 = levels.Histogram.of(latencies).quantile(0.99)
    assert p99 is not None and 0.080 / levels.BUCKET_GROWTH <= p99 <= 0.080 * levels.BUCKET_GROWTH
    assert levels.Histogram().quantile(0.99) is None


def test_histograms_add_up_so_a_group_p99_is_read_from_the_sum() -> None:
    fast = levels.ServiceReport(NOW, 10.0, 1000, 0, levels.Histogram.of([0.005] * 1000))
    slow = levels.ServiceReport(NOW, 10.0, 100, 10, levels.Histogram.of([0.2] * 100))

    def measured(job: str, project: str, report: levels.ServiceReport) -> levels.Measured:
        return levels.Measured(job, project, "short", "node-a",
                               levels.ServiceMeasure(report, 1, "H200", 2))

    group = [measured("a/fast", "vision", fast), measured("a/slow", "vision", slow)]
    [project] = levels.aggregate(group, levels.Scope.PROJECT)
    assert project.jobs == 2 and project.throughput == pytest.approx(100 + 9)
    assert project.failure_rate == pytest.approx(10 / 1100)
    # 100 of 1100 requests are slow: more than 1 %, so the group's P99 is a slow one
    assert project.p99_s is not None and project.p99_s > 0.15
    by_job = levels.aggregate(group, levels.Scope.JOB)
    assert [s.key for s in by_job] == ["a/fast", "a/slow"]
    assert by_job[0].p99_s is not None and by_job[0].p99_s < 0.006
    assert [s.key for s in levels.aggregate(group, levels.Scope.NODE)] == ["node-a"]
    with pytest.raises(ValueError, match="scope"):
        levels.aggregate(group, "zone")


@pytest.mark.parametrize(("text", "words"), [
    (b"[]", "JSON object"),
    (b'{"time": "2027-01-15T08:00:00Z", "window": 0, "requests": 1}', "'window'"),
    (b'{"time": "2027-01-15T08:00:00Z", "window": 10, "requests": -1}', "'requests'"),
    (b'{"time": "2027-01-15T08:00:00Z", "window": 10, "requests": 1, "failures": 2}',
     "must not exceed"),
    (b'{"time": "2027-01-15T08:00:00Z", "window": 10, "requests": 2, '
     b'"latency": [[5, 1], [3, 1]]}', "in order"),
    (b'{"time": "2027-01-15T08:00:00Z", "window": 10, "requests": 2, '
     b'"latency": [[999, 1]]}', "below"),
])
def test_service_reports_are_checked_strictly(text: bytes, words: str) -> None:
    with pytest.raises(ReportError, match=words):
        levels.parse_service(text, NOW)


def pod(name: str, uid: str, gpus: list[str], weight: int | None = None,
        template: str = "") -> ServedPod:
    weighed = {} if weight is None else {"sharingWeight": weight}
    if template:
        weighed["sharingTemplate"] = template
    assignment = json.dumps({"node": "node-a", "gpus": [
        {"uuid": u, "index": i, "memoryMiB": 1024, "cores": 25, **weighed}
        for i, u in enumerate(gpus)]})
    return ServedPod("lab", name, uid, "Running", False,
                     {"carpool.dev/job": f"lab/{name.rsplit('-', 1)[0]}",
                      "carpool.dev/assignment": assignment}, (("main", 1),))


class Statuses:
    def __init__(self) -> None:
        self.status: dict[tuple[str, str], dict[str, Any]] = {}

    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> None:
        self.status.setdefault((namespace, name), {}).update(status)


def test_a_service_report_goes_from_the_job_through_the_agent_into_status_and_metrics(
        tmp_path: Path) -> None:
    clock = [NOW - 10.0]
    directory = prepare(tmp_path, "uid-1")
    run = workload.Run.from_environment({"CARPOOL_ATTEMPT": "1",
                                         "CARPOOL_REPORT_DIR": str(directory)},
                                        clock=lambda: clock[0])
    ticks = iter(float(t) for t in range(10**6))
    service = workload.Service(run, every_s=10.0, timer=lambda: next(ticks) * 0.004)
    for _ in range(199):
        with service.request():  # each request takes one timer tick: 4 ms
            pass
    with pytest.raises(RuntimeError), service.request():
        raise RuntimeError("model failed")
    clock[0] = NOW
    assert service.report()

    statuses = Statuses()
    metrics = GpuMetrics("node-a")
    # the service weighs 250 (thousandths); its neighbour on GPU-a 750: three copies of it
    pods = [pod("web-1", "uid-1", ["GPU-a"], 250, "web"),
            pod("other-1", "uid-2", ["GPU-a"], 750, "other"),
            pod("apart-1", "uid-3", ["GPU-b"], template="apart")]

    async def listed() -> list[ServedPod]:
        return pods
    agent = ReportReader("node-a", tmp_path, listed, statuses, clock=lambda: NOW,
                         gpu_models=lambda: {"GPU-a": "H200", "GPU-b": "H200"},
                         on_measures=metrics.observe_services)
    [line] = asyncio.run(agent.step())
    assert "200 requests" in line and "shared by 2 (4.00 by weight)" in line
    recorded = statuses.status[("lab", "web")]["service"]
    assert recorded["requests"] == 200 and recorded["failures"] == 1
    assert recorded["throughput"] == pytest.approx(19.9)
    assert recorded["failureRate"] == pytest.approx(0.005)
    assert 4.0 / levels.BUCKET_GROWTH <= recorded["p99Ms"] <= 4.0 * levels.BUCKET_GROWTH
    assert (recorded["gpuModel"], recorded["sharing"], recorded["sharingByWeight"]) == \
        ("H200", 2, 4.0)
    measure = levels.measure_from_status(statuses.status[("lab", "web")])
    assert measure is not None and measure.sharing == 2 and measure.report.requests == 200
    assert measure.sharing_by_weight == 4.0
    # the neighbour's template, as its assignment names it (for learning the pair)
    assert recorded["sharingNeighbours"] == ["other"] and measure.neighbours == ("other",)
    # its template's profile counts the report at the degree the company weighs
    sample = sample_of({"metadata": {"name": "web"}, "spec": {},
                        "status": statuses.status[("lab", "web")]})
    assert sample is not None and sample.degree == 4
    assert sample.neighbours == ("other",) and not sample.among_copies
    labels = {"node": "node-a", "namespace": "lab", "job": "web", "model": "H200"}
    registry = metrics.registry
    assert registry.get_sample_value("carpool_service_throughput", labels) == \
        pytest.approx(19.9)
    assert registry.get_sample_value("carpool_service_sharing", labels) == 2
    pods.pop(0)  # the pod left: its series go
    asyncio.run(agent.step())
    assert registry.get_sample_value("carpool_service_throughput", labels) is None


def test_outside_carpool_service_reports_are_dropped() -> None:
    clock = [NOW]
    service = workload.Service(workload.Run(clock=lambda: clock[0]))
    service.record(0.01)
    clock[0] += 20.0
    assert not service.report()  # nowhere to write to: dropped, no error


def test_the_operator_exports_the_measures_per_job_project_class_and_node() -> None:
    from prometheus_client import REGISTRY

    from carpool.operator import metrics

    def gpujob(name: str, project: str, phase: str) -> dict[str, Any]:
        report = levels.ServiceReport(NOW, 10.0, 100, 1, levels.Histogram.of([0.01] * 100))
        return {"metadata": {"namespace": "serve", "name": name},
                "spec": {"project": project, "class": "short"},
                "status": {"phase": phase, "node": "h200-a", **levels.service_status(
                    levels.ServiceMeasure(report, 1, "H200", 2))}}

    metrics.observe_services([gpujob("a", "vision", "Running"), gpujob("b", "nlp", "Running"),
                              gpujob("gone", "nlp", "Succeeded")])

    def value(name: str, scope: str, key: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"scope": scope, "key": key})
    assert value("carpool_service_scope_throughput", "job", "serve/a") == pytest.approx(9.9)
    assert value("carpool_service_scope_throughput", "node", "h200-a") == pytest.approx(19.8)
    assert value("carpool_service_scope_throughput", "class", "short") == pytest.approx(19.8)
    assert value("carpool_service_scope_failure_ratio", "project", "nlp") == pytest.approx(0.01)
    assert value("carpool_service_scope_throughput", "job", "serve/gone") is None
    p99 = value("carpool_service_scope_p99_latency_seconds", "project", "vision")
    assert p99 is not None and 0.009 < p99 < 0.011
