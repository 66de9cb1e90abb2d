"""The operator copies only the PodSpec fields a workload needs from a GpuJob's template
(operator.pods.COPIED_POD_FIELDS) and sets Carpool's own: a template field nobody listed, or
one Carpool decides, never reaches the pod."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.core import checkpointing, names
from carpool.core.decoding import gpu_request_from_spec
from carpool.operator.pods import COPIED_POD_FIELDS, DEFAULT_GRACE_S, build_pod


def job(template_spec: dict[str, Any], metadata: dict[str, Any] | None = None,
        **spec: Any) -> dict[str, Any]:
    body = {"project": "vision", "class": "short",
            "gpu": {"count": 1, "memory": "20Gi", "isolation": "mps"},
            "template": {"metadata": metadata or {},
                         "spec": {"containers": [{"name": "main", "image": "img"}],
                                  **template_spec}},
            **spec}
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": "train", "namespace": "team", "uid": "u-1"}, "spec": body}


def pod_spec(template_spec: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = job(template_spec, **spec)
    return dict(build_pod(obj, gpu_request_from_spec(obj["spec"]), attempt=1)["spec"])


@pytest.mark.parametrize(("field", "value"), [
    ("schedulingGates", [{"name": "hold"}]),
    ("nodeName", "gpu-1"),
    ("hostNetwork", True),
    ("hostPID", True),
    ("hostIPC", True),
    ("priority", 2_000_000_000),
    ("preemptionPolicy", "PreemptLowerPriority"),
    ("overhead", {"cpu": "100"}),
    ("readinessGates", [{"conditionType": "x"}]),
    ("activeDeadlineSeconds", 10**9),
    ("aFieldKubernetesAddsLater", {"anything": True}),  # unlisted: not passed through
])
def test_fields_outside_the_allowlist_are_not_copied(field: str, value: Any) -> None:
    assert field not in COPIED_POD_FIELDS
    assert field not in pod_spec({field: value})


def test_carpool_sets_scheduler_priority_and_deadline() -> None:
    spec = pod_spec({"schedulerName": "default-scheduler",
                     "priorityClassName": "system-node-critical",
                     "activeDeadlineSeconds": 10**9}, maxDuration="2h")
    assert spec["schedulerName"] == names.SCHEDULER_NAME
    assert spec["priorityClassName"] == names.PRIORITY_CLASS
    assert spec["activeDeadlineSeconds"] == 7200


@pytest.mark.parametrize(("template_grace", "checkpoint", "expected"), [
    (None, None, DEFAULT_GRACE_S),
    (31_536_000, None, DEFAULT_GRACE_S),          # a year: capped at the default grace
    (31_536_000, {"gracePeriod": "2m"}, 120),     # capped at the job's checkpoint grace
    (10, {"gracePeriod": "2m"}, 10),              # sooner is the workload's choice
    (None, {"gracePeriod": "90s"}, 90),
])
def test_the_grace_period_is_the_checkpoint_grace_at_most(
        template_grace: int | None, checkpoint: dict[str, str] | None, expected: int) -> None:
    template = {} if template_grace is None else {"terminationGracePeriodSeconds": template_grace}
    extra = {} if checkpoint is None else {"checkpoint": checkpoint}
    spec = pod_spec(template, **extra)
    assert spec["terminationGracePeriodSeconds"] == expected
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env[checkpointing.ENV_GRACE_PERIOD] == str(expected)


def test_workload_fields_are_copied_as_given() -> None:
    given = {"nodeSelector": {"zone": "a"}, "tolerations": [{"operator": "Exists"}],
             "serviceAccountName": "trainer", "securityContext": {"runAsUser": 1000},
             "volumes": [{"name": "data", "emptyDir": {}}], "runtimeClassName": "gvisor",
             "dnsPolicy": "None", "dnsConfig": {"nameservers": ["10.0.0.1"]}}
    spec = pod_spec(given)
    for field, value in given.items():
        assert spec[field] == value, field


def test_carpool_keys_in_template_metadata_are_dropped() -> None:
    obj = job({}, metadata={
        "labels": {"app": "x", names.LABEL_JOB: "someone-elses", names.LABEL_PROJECT: "other"},
        "annotations": {"note": "mine", names.ANN_ASSIGNMENT: "{}", names.ANN_ISOLATION: "x"}})
    meta = build_pod(obj, gpu_request_from_spec(obj["spec"]), attempt=1)["metadata"]
    assert meta["labels"] == {"app": "x", names.LABEL_MANAGED: "true",
                              names.LABEL_JOB: "train", names.LABEL_PROJECT: "vision"}
    assert meta["annotations"]["note"] == "mine"
    assert names.ANN_ASSIGNMENT not in meta["annotations"]
    assert meta["annotations"][names.ANN_ISOLATION] == "mps"
