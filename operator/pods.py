"""The Pod a GpuJob runs as: the user's template plus Carpool's resources and annotations.

A pure function of the GpuJob object, so a restarted operator builds the same Pod (same name
for the same attempt) and creating it twice is refused by the API server rather than run twice.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.core import checkpointing, names
from carpool.core.assignment import Assignment, encode_assignment
from carpool.core.durations import parse_duration
from carpool.core.quantities import gib_ceil, quantity_mib
from carpool.core.resources import GpuRequest, Isolation

MAX_NAME = 63
CHECKPOINT_VOLUME = "carpool-checkpoint"
DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds when a pod names none

# The PodSpec fields a workload may bring in its GpuJob template, copied as given; every other
# field of the template is dropped. Carpool sets schedulerName, priorityClassName,
# terminationGracePeriodSeconds (the job's checkpoint grace, or less) and activeDeadlineSeconds
# (spec.maxDuration) itself. Left out on purpose: nodeName and schedulingGates (Carpool decides
# where and when a job starts; a gated pod would hold its quota forever), priority and
# preemptionPolicy (the job's class orders it), hostNetwork, hostPID and hostIPC (other
# tenants' traffic, GPU processes and MPS memory), overhead (the RuntimeClass's to set),
# readinessGates (nothing reads a job pod's readiness), and any field Kubernetes adds later,
# until it is judged here. Admission refuses the dangerous ones at `kubectl apply` (the GpuJob
# CRD's rules, hack/policies/); this list is what holds for a job admitted before a rule
# existed. runtimeClassName and resourceClaims are copied: admission allows them only where
# the platform team does (policies.runtimeClasses, policies.otherDevices).
COPIED_POD_FIELDS = frozenset({
    "containers", "initContainers", "volumes", "restartPolicy", "securityContext",
    "serviceAccountName", "automountServiceAccountToken", "imagePullSecrets",
    "nodeSelector", "affinity", "tolerations", "topologySpreadConstraints",
    "dnsPolicy", "dnsConfig", "hostname", "subdomain", "setHostnameAsFQDN", "hostAliases",
    "enableServiceLinks", "shareProcessNamespace", "os", "hostUsers", "runtimeClassName",
    "resourceClaims", "terminationGracePeriodSeconds",
})


def pod_name(job_name: str, attempt: int) -> str:
    """`<job>-<attempt>`, shortened with a hash when the job name is long."""
    return _suffixed(job_name, f"-{attempt}")


def _suffixed(job_name: str, suffix: str) -> str:
    if len(job_name) + len(suffix) <= MAX_NAME:
        return job_name + suffix
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    return f"{job_name[: MAX_NAME - len(suffix) - 9]}-{digest}{suffix}"


def checkpoint_claim_name(job_name: str) -> str:
    """The PersistentVolumeClaim holding a job's checkpoints: `<job>-checkpoint`."""
    return f"{job_name}-checkpoint"


def build_checkpoint_claim(job: dict[str, Any]) -> dict[str, Any] | None:
    """The job's checkpoint claim from `spec.checkpoint.volumeClaimTemplate`, owned by the job
    (deleted with it, kept across attempts), or None when the job names no template."""
    template = (job["spec"].get("checkpoint") or {}).get("volumeClaimTemplate")
    if not template:
        return None
    meta = job["metadata"]
    tmeta = template.get("metadata") or {}
    labels = dict(tmeta.get("labels") or {})
    labels.update({names.LABEL_MANAGED: "true", names.LABEL_JOB: meta["name"]})
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": checkpoint_claim_name(meta["name"]),
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": dict(tmeta.get("annotations") or {}),
            "ownerReferences": [{
                "apiVersion": names.API_VERSION, "kind": "GpuJob", "name": meta["name"],
                "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True,
            }],
        },
        "spec": copy.deepcopy(template["spec"]),
    }


def workload_env(job: dict[str, Any], attempt: int, grace_s: int) -> list[dict[str, str]]:
    """What each container learns of its run (core.checkpointing): the job, the attempt, the
    grace between SIGTERM and SIGKILL, where checkpoints live and which one to resume from."""
    meta = job["metadata"]
    env = [{"name": checkpointing.ENV_JOB, "value": f"{meta['namespace']}/{meta['name']}"},
           {"name": checkpointing.ENV_ATTEMPT, "value": str(attempt)},
           {"name": checkpointing.ENV_GRACE_PERIOD, "value": str(grace_s)}]
    checkpoint = job["spec"].get("checkpoint") or {}
    if checkpoint.get("volumeClaimTemplate"):
        env.append({"name": checkpointing.ENV_CHECKPOINT_DIR,
                    "value": checkpoint.get("mountPath") or checkpointing.DEFAULT_CHECKPOINT_MOUNT})
    resume = checkpointing.resume_point(job.get("status") or {})
    if resume is not None:
        env.append({"name": checkpointing.ENV_RESUME_FROM, "value": resume[0]})
    return env


def checkpoint_grace_s(spec: dict[str, Any]) -> int:
    """The most time between SIGTERM and SIGKILL a job's pod gets: its
    spec.checkpoint.gracePeriod, or Kubernetes' default when it names none."""
    grace = (spec.get("checkpoint") or {}).get("gracePeriod")
    return int(parse_duration(grace)) if grace else DEFAULT_GRACE_S


def users_metadata(values: dict[str, str] | None) -> dict[str, str]:
    """A template's labels or annotations without Carpool's keys (carpool.dev/*), which only
    the operator writes; admission refuses templates carrying them (pod-metadata policy)."""
    return {k: v for k, v in (values or {}).items() if not k.startswith(f"{names.GROUP}/")}


def build_pod(job: dict[str, Any], request: GpuRequest, attempt: int) -> dict[str, Any]:
    """The Pod manifest for `attempt` of `job` (a GpuJob object as the API returns it)."""
    meta = job["metadata"]
    spec = job["spec"]
    template = copy.deepcopy(spec.get("template") or {})
    tmeta = template.get("metadata") or {}
    pod_spec = {k: v for k, v in (template.get("spec") or {}).items() if k in COPIED_POD_FIELDS}

    labels = users_metadata(tmeta.get("labels"))
    labels.update({
        names.LABEL_MANAGED: "true",
        names.LABEL_JOB: meta["name"],
        names.LABEL_PROJECT: spec["project"],
    })
    annotations = users_metadata(tmeta.get("annotations"))
    annotations[names.ANN_JOB] = f"{meta['namespace']}/{meta['name']}"
    if meta.get("uid"):
        annotations[names.ANN_JOB_UID] = str(meta["uid"])
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
    pod_spec.setdefault("restartPolicy", "Never")
    checkpoint = spec.get("checkpoint") or {}
    grace_s = checkpoint_grace_s(spec)
    template_grace = pod_spec.get("terminationGracePeriodSeconds")
    if isinstance(template_grace, int) and 0 <= template_grace < grace_s:
        grace_s = template_grace  # a workload may ask to be killed sooner, never later
    pod_spec["terminationGracePeriodSeconds"] = grace_s
    if spec.get("maxDuration"):
        pod_spec["activeDeadlineSeconds"] = max(1, int(parse_duration(spec["maxDuration"])))

    containers = pod_spec.get("containers") or []
    if not containers:
        raise ValueError("spec.template.spec.containers must hold at least one container")
    env = workload_env(job, attempt, grace_s)
    ours = {e["name"] for e in env}
    claim = build_checkpoint_claim(job)
    if claim is not None:
        volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != CHECKPOINT_VOLUME]
        volumes.append({"name": CHECKPOINT_VOLUME,
                        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}})
        pod_spec["volumes"] = volumes
    for container in containers:
        container["env"] = [e for e in container.get("env") or [] if e.get("name") not in ours]
        container["env"].extend(env)
        if claim is not None:
            mounts = [m for m in container.get("volumeMounts") or []
                      if m.get("name") != CHECKPOINT_VOLUME]
            mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": checkpoint.get("mountPath")
                           or checkpointing.DEFAULT_CHECKPOINT_MOUNT})
            container["volumeMounts"] = mounts
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
            # the pod stays until the operator has recorded its run (core.finalizing); set
            # here, in the create body, it costs no write of its own
            "finalizers": [names.FINALIZER],
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


@dataclass(frozen=True)
class PlatformPodSettings:
    """What the platform, never the tenant, decides on every job pod (chart values)."""

    # The GPU nodes' RuntimeClass (devicePlugin.runtimeClassName): "" leaves the template's.
    runtime_class: str = ""
    # The one user (and group) every MPS client runs as (mpsDaemon.clientUid/clientGid). An MPS
    # control daemon runs one server at a time per user and holds the clients of any other
    # user until that server exits, so clients of two projects with two users would run one
    # after the other; under one user they share the GPU at once (docs/concepts.md, MPS).
    # None: the template's user.
    mps_uid: int | None = None
    mps_gid: int | None = None


def apply_platform_settings(pod: dict[str, Any], isolation: Isolation,
                            settings: PlatformPodSettings) -> dict[str, Any]:
    """`pod` (from `build_pod`) with the platform's runtime class and, for an MPS job, the MPS
    client user and group on the pod and on every container, overriding the template's (a
    container's own setting would win over the pod's)."""
    spec = pod["spec"]
    if settings.runtime_class:
        spec["runtimeClassName"] = settings.runtime_class
    if isolation is not Isolation.MPS:
        return pod
    ids = {key: value for key, value in (("runAsUser", settings.mps_uid),
                                         ("runAsGroup", settings.mps_gid)) if value is not None}
    if not ids:
        return pod
    spec["securityContext"] = {**(spec.get("securityContext") or {}), **ids}
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            if container.get("securityContext"):
                container["securityContext"] = {**container["securityContext"], **ids}
    return pod


# --- gangs (spec.workers) -----------------------------------------------------------------
#
# A gang's attempt is one pod per worker, created together once the admission cycle placed
# them all. Rank 0's pod carries the attempt's usual name (`pod_name`), so everything that
# follows an attempt by its pod follows the gang by its rank 0; the others are
# `<job>-<attempt>-w<rank>`. Each pod gets hostname `w<rank>` under a headless Service named
# for the job, so rank 0 is reachable at `w0.<service>` from the first try, and the
# environment `torchrun` reads (its `PET_*` options) as well as the plain variables a
# one-process-per-pod program reads.

MASTER_PORT = 29500
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def worker_pod_name(job_name: str, attempt: int, rank: int) -> str:
    """Rank 0: the attempt's pod name; rank r > 0: `<job>-<attempt>-w<r>`."""
    return pod_name(job_name, attempt) if rank == 0 else _suffixed(job_name, f"-{attempt}-w{rank}")


def gang_service_name(job_name: str) -> str:
    """The gang's headless Service: the job's name where that is a valid Service name (a DNS
    label starting with a letter), else `gang-<hash>`."""
    if _DNS_LABEL.match(job_name) and len(job_name) <= MAX_NAME:
        return job_name
    return "gang-" + hashlib.sha256(job_name.encode()).hexdigest()[:16]


def gang_env(service: str, rank: int, workers: int, gpus: int) -> list[dict[str, str]]:
    """What distributed training reads: rank 0's stable address and port, the world size in
    workers, this worker's rank and its GPU count; the same as `torchrun` options (`PET_*`),
    so `torchrun train.py` needs no flags."""
    address = f"w0.{service}"
    plain = {"MASTER_ADDR": address, "MASTER_PORT": str(MASTER_PORT),
             "WORLD_SIZE": str(workers), "RANK": str(rank), "NODE_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(gpus),
             "PET_MASTER_ADDR": address, "PET_MASTER_PORT": str(MASTER_PORT),
             "PET_NNODES": str(workers), "PET_NODE_RANK": str(rank),
             "PET_NPROC_PER_NODE": str(gpus)}
    return [{"name": k, "value": v} for k, v in plain.items()]


def build_worker_pods(job: dict[str, Any], requests: Sequence[GpuRequest], attempt: int,
                      planned: Sequence[Assignment]) -> list[dict[str, Any]]:
    """One pod per worker of a gang (rank order), each pinned to the node and GPUs the
    admission cycle chose for it (`names.ANN_PLANNED`, which the extender binds to)."""
    if len(planned) != len(requests):
        raise ValueError(f"{len(requests)} workers but {len(planned)} placements")
    name = job["metadata"]["name"]
    service = gang_service_name(name)
    pods = []
    for rank, (request, assignment) in enumerate(zip(requests, planned, strict=True)):
        pod = build_pod(job, request, attempt)
        pod["metadata"]["name"] = worker_pod_name(name, attempt, rank)
        pod["metadata"]["annotations"][names.ANN_WORKER_RANK] = str(rank)
        pod["metadata"]["annotations"][names.ANN_PLANNED] = encode_assignment(assignment)
        pod["metadata"]["annotations"][names.ANN_GANG] = f"{attempt}/{len(requests)}"
        spec = pod["spec"]
        spec["hostname"] = f"w{rank}"
        spec["subdomain"] = service
        env = gang_env(service, rank, len(requests), request.count)
        ours = {e["name"] for e in env}
        for container in spec["containers"]:
            container["env"] = [e for e in container["env"] if e.get("name") not in ours] + env
        pods.append(pod)
    return pods


def build_gang_service(job: dict[str, Any]) -> dict[str, Any]:
    """The headless Service that gives a gang's workers stable names (`w<rank>.<service>`),
    published before they are ready (rank 0 must be found while the others start), owned by
    the job (deleted with it)."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": gang_service_name(meta["name"]),
            "namespace": meta["namespace"],
            "labels": {names.LABEL_MANAGED: "true", names.LABEL_JOB: meta["name"]},
            "ownerReferences": [{
                "apiVersion": names.API_VERSION, "kind": "GpuJob", "name": meta["name"],
                "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True,
            }],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_MANAGED: "true", names.LABEL_JOB: meta["name"]},
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}],
        },
    }
