"""The Pod a GpuJob runs as: the user's template plus Carpool's resources and annotations.

A pure function of the GpuJob object, so a restarted operator builds the same Pod (same name
for the same attempt) and creating it twice is refused by the API server rather than run twice.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from carpool.core import names
from carpool.core.durations import parse_duration
from carpool.core.quantities import gib_ceil, quantity_mib
from carpool.core.resources import GpuRequest

MAX_NAME = 63


def pod_name(job_name: str, attempt: int) -> str:
    """`<job>-<attempt>`, shortened with a hash when the job name is long."""
    suffix = f"-{attempt}"
    if len(job_name) + len(suffix) <= MAX_NAME:
        return job_name + suffix
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    return f"{job_name[: MAX_NAME - len(suffix) - 9]}-{digest}{suffix}"


def build_pod(job: dict[str, Any], request: GpuRequest, attempt: int) -> dict[str, Any]:
    """The Pod manifest for `attempt` of `job` (a GpuJob object as the API returns it)."""
    meta = job["metadata"]
    spec = job["spec"]
    template = copy.deepcopy(spec.get("template") or {})
    tmeta = template.get("metadata") or {}
    pod_spec: dict[str, Any] = template.get("spec") or {}

    labels = dict(tmeta.get("labels") or {})
    labels.update({
        names.LABEL_MANAGED: "true",
        names.LABEL_JOB: meta["name"],
        names.LABEL_PROJECT: spec["project"],
    })
    annotations = dict(tmeta.get("annotations") or {})
    annotations[names.ANN_JOB] = f"{meta['namespace']}/{meta['name']}"
    annotations[names.ANN_ISOLATION] = request.isolation.value
    if request.models:
        annotations[names.ANN_MODELS] = ",".join(sorted(request.models))
    dataset = spec.get("dataset") or {}
    if dataset.get("name"):
        annotations[names.ANN_DATASET] = dataset["name"]
        if dataset.get("size"):
            annotations[names.ANN_DATASET_SIZE] = str(gib_ceil(quantity_mib(dataset["size"])))
    if spec.get("placementPolicy"):
        annotations[names.ANN_POLICY] = spec["placementPolicy"]
    if spec.get("simulatedDuration"):
        annotations[names.ANN_SIM_DURATION] = str(int(parse_duration(spec["simulatedDuration"])))

    pod_spec["schedulerName"] = names.SCHEDULER_NAME
    pod_spec["priorityClassName"] = names.PRIORITY_CLASS  # its preemptionPolicy is Never
    pod_spec.pop("preemptionPolicy", None)
    pod_spec.pop("priority", None)
    pod_spec.setdefault("restartPolicy", "Never")
    grace = (spec.get("checkpoint") or {}).get("gracePeriod")
    if grace:
        pod_spec["terminationGracePeriodSeconds"] = int(parse_duration(grace))
    if spec.get("maxDuration"):
        pod_spec["activeDeadlineSeconds"] = max(1, int(parse_duration(spec["maxDuration"])))

    containers = pod_spec.get("containers") or []
    if not containers:
        raise ValueError("spec.template.spec.containers must hold at least one container")
    limits = containers[0].setdefault("resources", {}).setdefault("limits", {})
    limits[names.RESOURCE_GPU] = str(request.count)
    if request.memory_mib:
        limits[names.RESOURCE_GPU_MEMORY] = str(gib_ceil(request.memory_mib))
    if request.cores_pct:
        limits[names.RESOURCE_GPU_CORES] = str(request.cores_pct)

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(meta["name"], attempt),
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [{
                "apiVersion": names.API_VERSION,
                "kind": "GpuJob",
                "name": meta["name"],
                "uid": meta["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }],
        },
        "spec": pod_spec,
    }
