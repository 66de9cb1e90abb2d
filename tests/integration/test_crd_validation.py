"""The CRDs against the real API server: bad specs are refused with messages that name the
field, good ones are accepted with their defaults, and `kubectl get` shows useful columns.

Bad objects are sent with dryRun=All: the API server runs the full schema and CEL validation
but stores nothing, so each case is independent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core.names import GPUJOB_PLURAL, GPUNODE_PLURAL, GROUP, PROJECTQUOTA_PLURAL, VERSION
from carpool_testbed import crds

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def api(cluster: Any) -> Iterator[client.ApiClient]:
    api_client = cluster.api()
    crds.apply_crds(api_client)
    yield api_client
    api_client.close()


@pytest.fixture(scope="module")
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"crd-validation-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def good_job(name: str = "job") -> Obj:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuJob",
        "metadata": {"name": name},
        "spec": {
            "project": "vision",
            "gpu": {"count": 1, "memory": "8Gi"},
            "estimatedDuration": "30m",
            "maxDuration": "2h",
            "template": {"spec": {"containers": [{"name": "main", "image": "busybox"}]}},
        },
    }


def good_quota(name: str = "quota") -> Obj:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ProjectQuota",
        "metadata": {"name": name},
        "spec": {
            "namespaces": ["vision"],
            "gpuHours": {"budget": 100, "period": "30d"},
            "concurrent": {"gpus": 4, "memory": "160Gi"},
        },
    }


def create_job(api: client.ApiClient, namespace: str, body: Obj, dry_run: bool = True) -> Obj:
    created: Obj = client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, GPUJOB_PLURAL, body, dry_run="All" if dry_run else None
    )
    return created


def create_quota(api: client.ApiClient, body: Obj, dry_run: bool = True) -> Obj:
    created: Obj = client.CustomObjectsApi(api).create_cluster_custom_object(
        GROUP, VERSION, PROJECTQUOTA_PLURAL, body, dry_run="All" if dry_run else None
    )
    return created


def refusal(call: Callable[[], object]) -> tuple[str, list[str]]:
    """The API server's message and the fields its causes name, for a refused request."""
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status == 422, info.value.body
    status = json.loads(info.value.body)
    causes = (status.get("details") or {}).get("causes") or []
    return status["message"], [c.get("field", "") for c in causes]


def setter(path: str, value: object) -> Callable[[Obj], None]:
    """A mutation that sets (or, with value None, removes) a dotted path under the object."""

    def mutate(obj: Obj) -> None:
        *parents, leaf = path.split(".")
        node = obj
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value

    return mutate


def both(*mutations: Callable[[Obj], None]) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        for m in mutations:
            m(obj)

    return mutate


# (field the message must name, mutation of a good GpuJob, words the message must contain)
BAD_JOBS: dict[str, tuple[str, Callable[[Obj], None], str]] = {
    "zero-memory": ("spec.gpu.memory", setter("spec.gpu.memory", "0"), "positive quantity"),
    "negative-memory": ("spec.gpu.memory", setter("spec.gpu.memory", "-4Gi"), "positive"),
    "unparseable-memory": ("spec.gpu.memory", setter("spec.gpu.memory", "lots"), "quantity"),
    "missing-memory": ("spec.gpu.memory", setter("spec.gpu.memory", None), "Required"),
    "cores-over-100": ("spec.gpu.cores", setter("spec.gpu.cores", 101), "100"),
    "cores-zero": ("spec.gpu.cores", setter("spec.gpu.cores", 0), "1"),
    "unknown-class": ("spec.class", setter("spec.class", "urgent"), "interactive"),
    "unknown-isolation": ("spec.gpu.isolation", setter("spec.gpu.isolation", "vgpu"), "mps"),
    "count-zero": ("spec.gpu.count", setter("spec.gpu.count", 0), "1"),
    "count-over-16": ("spec.gpu.count", setter("spec.gpu.count", 17), "16"),
    "mig-with-cores": (
        "spec.gpu.cores",
        both(setter("spec.gpu.isolation", "mig"), setter("spec.gpu.cores", 50)),
        "isolation mig",
    ),
    "exclusive-partial-cores": (
        "spec.gpu.cores",
        both(setter("spec.gpu.isolation", "exclusive"), setter("spec.gpu.cores", 50)),
        "isolation exclusive",
    ),
    "mig-profile-without-mig": (
        "spec.gpu.migProfile", setter("spec.gpu.migProfile", "1g.18gb"), "isolation mig"
    ),
    "bad-mig-profile": (
        "spec.gpu.migProfile",
        both(setter("spec.gpu.isolation", "mig"), setter("spec.gpu.migProfile", "huge")),
        "should match",
    ),
    "duplicate-models": ("spec.gpu.models[1]", setter("spec.gpu.models", ["A100", "A100"]),
                         "Duplicate"),
    "missing-project": ("spec.project", setter("spec.project", None), "Required"),
    "bad-project-name": ("spec.project", setter("spec.project", "Vision Team"), "should match"),
    "missing-template": ("spec.template", setter("spec.template", None), "Required"),
    "template-without-containers": (
        "spec.template.spec.containers", setter("spec.template.spec", {}), "Required"
    ),
    "template-empty-containers": (
        "spec.template.spec.containers", setter("spec.template.spec.containers", []), "at least 1"
    ),
    "container-without-image": (
        "spec.template.spec.containers[0].image",
        setter("spec.template.spec.containers", [{"name": "main"}]),
        "Required",
    ),
    "template-with-node-name": (
        "spec.template.spec.nodeName", setter("spec.template.spec.nodeName", "gpu-1"), "scheduler"
    ),
    "template-restart-always": (
        "spec.template.spec.restartPolicy",
        setter("spec.template.spec.restartPolicy", "Always"),
        "Never or OnFailure",
    ),
    "unparseable-max-duration": (
        "spec.maxDuration", setter("spec.maxDuration", "forever"), "should match"
    ),
    "unitless-estimated-duration": (
        "spec.estimatedDuration", setter("spec.estimatedDuration", "1h30"), "should match"
    ),
    "zero-max-duration": ("spec.maxDuration", setter("spec.maxDuration", "0s"), "at least 1s"),
    "estimate-over-max": (
        "spec.estimatedDuration", setter("spec.estimatedDuration", "3h"), "must not exceed"
    ),
    "estimate-in-days-over-max": (
        "spec.estimatedDuration",
        both(setter("spec.estimatedDuration", "2d"), setter("spec.maxDuration", "1d12h")),
        "must not exceed",
    ),
    "unparseable-grace-period": (
        "spec.checkpoint.gracePeriod", setter("spec.checkpoint.gracePeriod", "soon"),
        "should match",
    ),
    "interactive-preemptible": (
        "spec.preemptible",
        both(setter("spec.class", "interactive"), setter("spec.preemptible", True)),
        "interactive",
    ),
    "negative-dataset-size": (
        "spec.dataset.size",
        setter("spec.dataset", {"name": "imagenet", "size": "-1Gi"}),
        "non-negative",
    ),
    "unknown-placement-policy": (
        "spec.placementPolicy", setter("spec.placementPolicy", "random"), "binpack"
    ),
    "p99-zero": ("spec.objectives.p99Latency", setter("spec.objectives.p99Latency", "0ms"),
                 "positive duration"),
    "p99-minutes": ("spec.objectives.p99Latency", setter("spec.objectives.p99Latency", "1m"),
                    "should match"),
    "slowdown-below-one": ("spec.objectives.maxSlowdown",
                           setter("spec.objectives.maxSlowdown", 0.5), "greater than or equal"),
    "gang-over-16-workers": (
        "spec.workers",
        setter("spec.workers", [{"name": "a", "replicas": 9}, {"name": "b", "replicas": 8}]),
        "at most 16 workers",
    ),
    "gang-over-128-gpus": (
        "spec.workers",
        setter("spec.workers", [{"name": "a", "replicas": 9, "gpu": {"count": 16}}]),
        "at most 128 GPUs",
    ),
    "gang-duplicate-group": (
        "spec.workers[1]",
        setter("spec.workers", [{"name": "a", "replicas": 1}, {"name": "a", "replicas": 1}]),
        "Duplicate value",
    ),
    "topology-without-workers": (
        "spec.topology", setter("spec.topology", {"level": "rack"}), "gangs only"
    ),
    "unknown-topology-level": (
        "spec.topology.level",
        both(setter("spec.workers", [{"name": "a", "replicas": 2}]),
             setter("spec.topology", {"level": "pod"})),
        "nvlink-island",
    ),
}

BAD_QUOTAS: dict[str, tuple[str, Callable[[Obj], None], str]] = {
    "negative-budget": ("spec.gpuHours.budget", setter("spec.gpuHours.budget", -5), "0"),
    "no-namespaces": ("spec.namespaces", setter("spec.namespaces", []), "at least 1"),
    "missing-namespaces": ("spec.namespaces", setter("spec.namespaces", None), "Required"),
    "bad-namespace-name": ("spec.namespaces[0]", setter("spec.namespaces", ["Bad_NS"]),
                           "should match"),
    "unparseable-period": ("spec.gpuHours.period", setter("spec.gpuHours.period", "monthly"),
                           "should match"),
    "too-short-period": ("spec.gpuHours.period", setter("spec.gpuHours.period", "30s"),
                         "at least 1m"),
    "budget-without-period": ("spec.gpuHours.period", setter("spec.gpuHours.period", None),
                              "Required"),
    "weight-zero": ("spec.weight", setter("spec.weight", 0), "greater than 0"),
    "unknown-on-exhausted": (
        "spec.gpuHours.onExhausted", setter("spec.gpuHours.onExhausted", "Panic"), "Hold"
    ),
    "negative-concurrent-gpus": ("spec.concurrent.gpus", setter("spec.concurrent.gpus", -1), "0"),
    "unparseable-concurrent-memory": (
        "spec.concurrent.memory", setter("spec.concurrent.memory", "plenty"), "quantity"
    ),
    "borrow-limit-without-borrowing": (
        "spec.borrowing.maxGpus", setter("spec.borrowing", {"maxGpus": 2}), "enabled"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_bad_gpujob_is_refused_naming_the_field(
    api: client.ApiClient, namespace: str, case: str
) -> None:
    field, mutate, words = BAD_JOBS[case]
    body = good_job(f"bad-{case}")
    mutate(body)
    message, fields = refusal(lambda: create_job(api, namespace, body))
    assert field in message, message
    assert field in fields, (fields, message)
    assert words in message, message


@pytest.mark.parametrize("case", sorted(BAD_QUOTAS))
def test_bad_projectquota_is_refused_naming_the_field(api: client.ApiClient, case: str) -> None:
    field, mutate, words = BAD_QUOTAS[case]
    body = good_quota(f"bad-{case}")
    mutate(body)
    message, fields = refusal(lambda: create_quota(api, body))
    assert field in message, message
    assert field in fields, (fields, message)
    assert words in message, message


def test_good_gpujob_gets_defaults(api: client.ApiClient, namespace: str) -> None:
    created = create_job(api, namespace, good_job("defaults"), dry_run=False)
    spec = created["spec"]
    assert spec["class"] == "batch"
    assert spec["gpu"]["isolation"] == "mps"
    assert spec["preemptible"] is False
    # the pod template keeps fields the schema does not list (preserve-unknown-fields)
    assert spec["template"]["spec"]["containers"] == [{"name": "main", "image": "busybox"}]


@pytest.mark.parametrize(
    "gpu",
    [
        {"count": 2, "memory": "40Gi", "isolation": "exclusive"},
        {"count": 1, "memory": "40Gi", "isolation": "exclusive", "cores": 100},
        {"count": 1, "memory": "18Gi", "isolation": "mig", "migProfile": "1g.18gb"},
        {"count": 1, "memory": "1536Mi", "cores": 25, "models": ["A100", "H200"]},
        {"count": 16, "memory": "0.5Gi", "isolation": "timeslice", "cores": 100},
    ],
    ids=["exclusive", "exclusive-100", "mig-profile", "mps-fraction", "timeslice-16"],
)
def test_good_gpu_requests_are_accepted(
    api: client.ApiClient, namespace: str, gpu: Obj
) -> None:
    body = good_job("good")
    body["spec"]["gpu"] = gpu
    assert create_job(api, namespace, body)["spec"]["gpu"]["count"] == gpu["count"]


def test_objectives_are_accepted(api: client.ApiClient, namespace: str) -> None:
    body = good_job("serving")
    body["spec"]["objectives"] = {"p99Latency": "60ms", "maxSlowdown": 1.5}
    assert create_job(api, namespace, body)["spec"]["objectives"]["maxSlowdown"] == 1.5


@pytest.mark.parametrize(
    ("estimated", "maximum"),
    [("2h", "2h"), ("1d", "1d1s"), ("36h", "1d12h"), ("1.5h", "90m1ms"), ("500ms", "1s")],
)
def test_durations_compare_across_units(
    api: client.ApiClient, namespace: str, estimated: str, maximum: str
) -> None:
    body = good_job("durations")
    body["spec"].update(estimatedDuration=estimated, maxDuration=maximum)
    assert create_job(api, namespace, body)["spec"]["maxDuration"] == maximum


def test_gpujob_spec_is_immutable_but_status_is_writable(
    api: client.ApiClient, namespace: str
) -> None:
    custom = client.CustomObjectsApi(api)
    create_job(api, namespace, good_job("immutable"), dry_run=False)
    message, fields = refusal(
        lambda: custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, GPUJOB_PLURAL, "immutable",
            {"spec": {"gpu": {"memory": "16Gi"}}},
            _content_type="application/merge-patch+json",
        )
    )
    assert "spec" in fields and "immutable" in message, message

    status = {
        "phase": "Queued", "queuePosition": 3, "estimatedStart": "2026-11-29T20:00:00Z",
        "estimatedStartEarliest": "2026-11-29T19:40:00Z",
        "estimatedStartLatest": "2026-11-29T20:30:00Z",
        "firstEstimatedStart": "2026-11-29T19:50:00Z", "reason": "InsufficientCapacity",
        "attempts": 0, "submitTime": "2026-11-29T19:00:00Z",
        "conditions": [{"type": "Admitted", "status": "False", "reason": "Queued",
                        "message": "behind 2 jobs", "lastTransitionTime": "2026-11-29T19:00:00Z"}],
    }
    patched = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, GPUJOB_PLURAL, "immutable", {"status": status},
        _content_type="application/merge-patch+json",
    )
    assert patched["status"]["queuePosition"] == 3
    assert patched["status"]["estimatedStartLatest"] == "2026-11-29T20:30:00Z"
    message, fields = refusal(
        lambda: custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, GPUJOB_PLURAL, "immutable", {"status": {"phase": "Done"}},
            _content_type="application/merge-patch+json",
        )
    )
    assert "status.phase" in message, message


def test_good_projectquota_gets_defaults(api: client.ApiClient) -> None:
    body = good_quota(f"defaults-{uuid.uuid4().hex[:6]}")
    body["spec"]["borrowing"] = {"maxGpus": 2, "enabled": True}
    created = create_quota(api, body)
    spec = created["spec"]
    assert spec["weight"] == 1
    assert spec["gpuHours"]["onExhausted"] == "Hold"
    assert spec["borrowing"] == {"enabled": True, "maxGpus": 2}


def test_gpunode_refuses_bad_cordon_index(api: client.ApiClient) -> None:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuNode",
        "metadata": {"name": "cordon-check"}, "spec": {"cordonedGpus": [0, -1]},
    }
    message, _ = refusal(
        lambda: client.CustomObjectsApi(api).create_cluster_custom_object(
            GROUP, VERSION, GPUNODE_PLURAL, body, dry_run="All"
        )
    )
    assert "spec.cordonedGpus[1]" in message, message


def table_columns(api: client.ApiClient, plural: str, namespace: str | None = None) -> list[str]:
    """Column names of the API server's Table view of a resource (what kubectl prints)."""
    custom = client.CustomObjectsApi(api)
    table_view = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}
    if namespace:
        response = custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, _headers=table_view, _preload_content=False)
    else:
        response = custom.list_cluster_custom_object(
            GROUP, VERSION, plural, _headers=table_view, _preload_content=False)
    table = json.loads(response.data)
    assert table["kind"] == "Table", table
    return [c["name"] for c in table["columnDefinitions"]]


def test_printer_columns(api: client.ApiClient, namespace: str) -> None:
    jobs = table_columns(api, GPUJOB_PLURAL, namespace)
    for column in ["Name", "Project", "Class", "Phase", "GPUs", "Memory", "Node", "Est-Start",
                   "Est-P10", "Est-P90", "Age"]:
        assert column in jobs
    quotas = table_columns(api, PROJECTQUOTA_PLURAL)
    for column in ["Budget", "Used", "Remaining", "Running-GPUs", "Borrowed-GPUs", "Pending"]:
        assert column in quotas
    nodes = table_columns(api, GPUNODE_PLURAL)
    for column in ["Model", "Sharing", "Zone", "Driver", "CUDA", "Heartbeat"]:
        assert column in nodes


def test_kubectl_get_gpujobs_wide(
    api: client.ApiClient, namespace: str, cluster: Any
) -> None:
    create_job(api, namespace, good_job("shown"), dry_run=False)
    out = cluster.kubectl("get", "gpujobs", "-n", namespace, "-o", "wide").stdout
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "PROJECT", "CLASS", "PHASE", "GPUS", "MEMORY", "ISOLATION",
                              "NODE", "EST-START", "EST-P10", "EST-P90", "QUEUE", "REASON",
                              "GPU-HOURS", "PROGRESS", "CHECKPOINT", "AGE"]
    shown = next(r for r in rows if r.startswith("shown "))
    assert shown.split()[1:6] == ["vision", "batch", "1", "8Gi", "mps"]


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("file", ["gpujobs.yaml", "projectquotas.yaml", "gang.yaml"])
def test_examples_are_valid(api: client.ApiClient, namespace: str, file: str) -> None:
    documents = [d for d in yaml.safe_load_all((EXAMPLES / file).read_text()) if d]
    assert documents
    for body in documents:
        if body["kind"] == "GpuJob":
            body["metadata"]["namespace"] = namespace
            assert create_job(api, namespace, body)["spec"]["template"]
        else:
            assert create_quota(api, body)["spec"]["weight"] > 0
