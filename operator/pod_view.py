"""What a GpuJob's pods say about it: phase, node, GPUs, start and end times.

Pure functions over Pod dicts. The operator derives a job's state from its pods on every
pass rather than remembering events, so a restart (or a missed event) changes nothing.
"""

from __future__ import annotations

from typing import Any

from carpool.core import names
from carpool.core.assignment import AssignmentError, parse_assignment
from carpool.core.checkpointing import attempt_of_pod
from carpool.core.finalizing import deletion_final
from carpool.core.lifecycle import PodView
from carpool.core.ownership import GpuLimits, gpujob_owner
from carpool.core.timestamps import epoch_seconds as parse_time
from carpool.core.timestamps import format_timestamp as format_time

Obj = dict[str, Any]
DISRUPTION_TARGET = "DisruptionTarget"  # the pod condition Kubernetes sets on disrupted pods
__all__ = ["DISRUPTION_TARGET", "PodView", "attempt_of", "format_time", "parse_time",
           "view_pod"]


def attempt_of(pod_name: str) -> int:
    return attempt_of_pod(pod_name)


def view_pod(pod: Obj) -> PodView:
    meta = pod.get("metadata", {})
    status = pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    assignment = None
    if raw := annotations.get(names.ANN_ASSIGNMENT):
        try:
            assignment = parse_assignment(str(raw))
        except AssignmentError:
            assignment = None  # user-writable: a bad value holds nothing
    started = parse_time(status.get("startTime"))
    finished = None
    exit_reason = ""
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if running := state.get("running"):
            started = parse_time(running.get("startedAt")) or started
        if term := state.get("terminated"):
            started = parse_time(term.get("startedAt")) or started
            end = parse_time(term.get("finishedAt"))
            if end is not None:
                finished = max(finished or end, end)
            exit_reason = term.get("reason") or exit_reason
    phase = status.get("phase") or "Pending"
    limits = gpu_limits(pod)
    gpu_pod = bool(annotations.get(names.ANN_ASSIGNMENT)) or bool(limits)
    unschedulable = next((c for c in status.get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "False"
                          and c.get("reason") == "Unschedulable"), None)
    if phase in ("Succeeded", "Failed") and finished is None:
        finished = parse_time(meta.get("deletionTimestamp")) or started
    if finished is not None and started is not None and finished < started:
        # a container that exits at once can be recorded as finished before it started (the
        # runtime stamps its start after the process may already have ended): a run of 0 s
        finished = started
    return PodView(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        attempt=attempt_of(meta.get("name", "")),
        phase=phase,
        node=(pod.get("spec") or {}).get("nodeName") or "",
        assignment=assignment,
        started=started if phase != "Pending" else None,
        finished=finished,
        deleting=bool(meta.get("deletionTimestamp")),
        exit_reason=exit_reason or status.get("reason") or "",
        disruption=next((str(c.get("reason") or DISRUPTION_TARGET)
                         for c in status.get("conditions") or []
                         if c.get("type") == DISRUPTION_TARGET and c.get("status") == "True"),
                        ""),
        uid=str(meta.get("uid") or ""),
        owner=gpujob_owner(meta.get("ownerReferences")),
        job_uid=str((meta.get("annotations") or {}).get(names.ANN_JOB_UID) or ""),
        gpu_pod=gpu_pod,
        limits=limits,
        unschedulable_since=(parse_time(unschedulable.get("lastTransitionTime"))
                             if unschedulable else None),
        unschedulable_message=str((unschedulable or {}).get("message") or ""),
        finalized=names.FINALIZER in (meta.get("finalizers") or ()),
        deletion_final=deletion_final(meta),
        deleted_at=parse_time(meta.get("deletionTimestamp")),
    )



def gpu_limits(pod: Obj) -> tuple[GpuLimits, ...]:
    """The carpool.dev/* limits of the pod's containers that ask for GPUs (unreadable
    numbers count as 0: the API server validated them)."""
    out = []
    for container in (pod.get("spec") or {}).get("containers") or ():
        if not isinstance(container, dict):
            continue
        limits = (container.get("resources") or {}).get("limits") or {}
        count = _whole(limits.get(names.RESOURCE_GPU))
        if count > 0:
            out.append(GpuLimits(str(container.get("name") or ""), count,
                                 _whole(limits.get(names.RESOURCE_GPU_MEMORY)),
                                 _whole(limits.get(names.RESOURCE_GPU_CORES))))
    return tuple(out)


def _whole(value: object) -> int:
    try:
        return max(0, int(str(value))) if value is not None else 0
    except ValueError:
        return 0
