"""Which pods may hold Carpool GPUs: only the pods of GpuJobs.

A GpuJob is the only door to a GPU (the queue, quotas, budgets and GPU-hours all hang on it).
Admission refuses pods with carpool.dev/* resources that the operator did not create
(hack/policies/gpujob-only.yaml); the extender and the device plugin check again with this rule,
so a pod that got past admission (a cluster without the policy, a break-glass admin) is still
not placed or served. An owner reference can be written by whoever creates the pod, so this is
defence in depth, not the fence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from carpool.core.names import GROUP

GPUJOB_KIND = "GpuJob"


def gpujob_owner(owner_references: Iterable[Mapping[str, Any]] | None) -> str:
    """The name of the GpuJob that controls a pod (its controller owner reference), or ""."""
    for ref in owner_references or ():
        api_version = str(ref.get("apiVersion") or "")
        if (ref.get("kind") == GPUJOB_KIND and api_version.split("/")[0] == GROUP
                and ref.get("controller") is True and ref.get("name")):
            return str(ref["name"])
    return ""


def unowned_refusal(pod_key: str) -> str:
    """What a pod no GpuJob owns is told (scheduling event, Allocate error)."""
    return (f"pod {pod_key} is not owned by a GpuJob: Carpool gives GPUs only to the pods its "
            f"operator makes for GpuJobs. Submit a GpuJob (apiVersion {GROUP}/v1alpha1) that "
            f"asks for the GPUs in spec.gpu instead")
