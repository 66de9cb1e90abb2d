"""Which pods are a GpuJob's: the one rule every component applies.

A GpuJob is the only door to a GPU (the queue, quotas, budgets and GPU-hours all hang on it).
A pod is the attempt of a job only when two things hold:

- the job controls it: its controller ownerReference names a `carpool.dev` GpuJob whose uid
  is the job's, and it sits in the job's namespace (an ownerReference cannot point into
  another namespace; a name can be reused by a new job, a uid cannot);
- Carpool's operator created it: the operator records the pod's uid in the job's status
  (`status.podUID`, with `podName` and `attempts`) right after creating it, and only Carpool
  can write a GpuJob's status. A pod of the job created before that write landed (an operator
  stopped between the two) is adopted by name, `<job>-<attempts + 1>`, while the job still
  shows the phase it is admitted from; the first status written for it then records its uid
  (`lifecycle.observe`), which is what links it once the job shows another phase.

Labels (`carpool.dev/job-name`, `managed`, `project`), the `carpool.dev/job` annotation and the
name of a pod are hints: a tenant writes them on its own pods. Admission keeps tenants from
writing Carpool's ownerReferences, labels and annotations (hack/policies); this rule keeps a
cluster without that policy correct as well: a look-alike pod in another namespace, or one
the job does not control by uid, changes nothing of the job.

A pod recorded as the job's attempt that the job no longer controls (its ownerReference was
changed or removed) is still the pod holding the job's GPUs: it keeps the job's accounting
open until it is gone, and the operator stops it (`Link.tampered`).

Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.core.assignment import Assignment, encode_assignment
from carpool.core.names import ANN_ISOLATION as ISOLATION_ANNOTATION
from carpool.core.names import GROUP
from carpool.core.resources import GpuRequest, Isolation

MIB_PER_GIB = 1024

GPUJOB_KIND = "GpuJob"


@dataclass(frozen=True)
class Owner:
    """The GpuJob a controller ownerReference names."""

    name: str
    uid: str


def gpujob_owner(owner_references: Iterable[Mapping[str, Any]] | None) -> Owner | None:
    """The GpuJob that controls a pod (its controller owner reference), or None."""
    for ref in owner_references or ():
        if not isinstance(ref, Mapping):
            continue
        api_version = str(ref.get("apiVersion") or "")
        if (ref.get("kind") == GPUJOB_KIND and api_version.split("/")[0] == GROUP
                and ref.get("controller") is True and ref.get("name")):
            return Owner(str(ref["name"]), str(ref.get("uid") or ""))
    return None


@dataclass(frozen=True)
class PodIdentity:
    """What the rule reads of a pod: where it is, what it is, who controls it."""

    namespace: str
    name: str
    uid: str
    owner: Owner | None


@dataclass(frozen=True)
class JobIdentity:
    """What the rule reads of a GpuJob: its identity and what its status (Carpool's own
    writing) records of its current attempt."""

    namespace: str
    name: str
    uid: str
    attempts: int  # status.attempts
    pod_uid: str  # status.podUID: the pod the operator created for that attempt
    pod_name: str  # status.podName
    next_pod_name: str  # the name the operator gives attempt `attempts + 1`
    admittable: bool  # the status shows a phase the operator admits from (none or Queued)


@dataclass(frozen=True)
class Link:
    """A pod as one of a job's attempts: which attempt, and whether the job still controls
    it (False: the pod the operator recorded, its ownerReference since changed)."""

    attempt: int
    controlled: bool = True

    @property
    def tampered(self) -> bool:
        return not self.controlled


def controls(job: JobIdentity, pod: PodIdentity) -> bool:
    """Whether `job` is `pod`'s controller: same namespace, ownerReference with its uid."""
    return (pod.namespace == job.namespace and pod.owner is not None
            and pod.owner.uid == job.uid and bool(job.uid) and pod.owner.name == job.name)


def attempt_link(job: JobIdentity, pod: PodIdentity) -> Link | None:
    """`pod` as `job`'s current attempt (see the module docstring), or None when it is not.

    1. the pod the job's status records (`podUID`, same namespace): the current attempt,
       controlled or not;
    2. a pod the job controls, named as its status records, where the status has no podUID
       (written before the operator recorded pod uids): the current attempt, adopted;
    3. a pod the job controls named as its next attempt while the job shows a phase it is
       admitted from (the operator stopped between creating the pod and writing the status):
       the next attempt, adopted.
    """
    if pod.namespace != job.namespace or not pod.uid:
        return None
    if job.pod_uid:
        if pod.uid == job.pod_uid:
            return Link(job.attempts, controls(job, pod))
    elif job.attempts and pod.name == job.pod_name and controls(job, pod):
        return Link(job.attempts)
    if job.admittable and pod.name == job.next_pod_name and controls(job, pod):
        return Link(job.attempts + 1)
    return None


def is_orphan(pod: PodIdentity, holds_gpus: bool, an_attempt: bool,
              in_project_namespace: bool) -> bool:
    """Whether the operator stops a pod as an orphan: it holds (or is assigned) a Carpool
    GPU, it is no job's current attempt (`attempt_link`), and it claims a GpuJob or sits in a
    namespace that bills to a project. A GPU pod elsewhere that claims no GpuJob is never
    served (the extender and the device plugin refuse pods no GpuJob owns, unless told to
    serve such pods, as benchmarks and test beds do) and is left alone."""
    return holds_gpus and not an_attempt and (pod.owner is not None or in_project_namespace)


def grant_mismatch(job: GpuRequest, pod: Sequence[tuple[str, GpuRequest]]) -> str:
    """Why a job's pod does not ask for what its GpuJob's spec.gpu does ("" when it does).

    `pod` is each GPU container's request as its carpool.dev/* limits say (immutable once the
    pod exists; memory in whole GiB, as the operator writes it) with the isolation its
    annotation names. The extender and the device plugin place and serve a job's pod by its
    job's spec (immutable, only Carpool acts on it), so a pod that says otherwise, in its
    limits or in an annotation changed after admission, is refused rather than believed."""
    if len(pod) != 1:
        return (f"asks for GPUs in {len(pod)} containers; the operator gives a job's pod its "
                f"GPUs in one")
    container, asked = pod[0]
    memory_gib = -(-job.memory_mib // MIB_PER_GIB)
    wanted = (("carpool.dev/gpu", job.count, asked.count),
              ("carpool.dev/gpu-memory", memory_gib, asked.memory_mib // MIB_PER_GIB),
              ("carpool.dev/gpu-cores", job.cores_pct, asked.cores_pct))
    for what, spec, limit in wanted:
        if spec != limit:
            return (f"container {container!r} limits {what} to {limit}, but its GpuJob's "
                    f"spec.gpu asks for {spec}")
    if asked.isolation is not job.isolation:
        return (f"its annotation {ISOLATION_ANNOTATION} says {asked.isolation.value}, but its "
                f"GpuJob's spec.gpu.isolation is {job.isolation.value}")
    return ""


def calibrated_mismatch(job: GpuRequest, pod: Sequence[tuple[str, GpuRequest]],
                        planned: Assignment | None) -> str:
    """Why a pod that asks for less than its GpuJob's spec.gpu is not one the operator placed
    by its template's calibrated size ("" when it is; `core.right_sizing`): one container,
    an MPS job's count and isolation, GPU memory at most the spec's and exactly what the
    operator's planned assignment grants on each GPU, the spec's cores. The limits are the
    operator's (immutable once the pod exists); below the spec they only ever shrink the
    pod's own fence.

    A one-GPU whole-GPU job may be placed as an MPS client of its calibrated size
    (`right_sizing.shared_whole_gpu`): one GPU, MPS, a GPU memory limit, the cores its
    planned assignment grants, and the planned assignment an MPS one."""
    if planned is None:
        return "no planned assignment of the operator's places it below its spec"
    shared = job.isolation is Isolation.EXCLUSIVE and job.count == 1
    if (job.isolation is not Isolation.MPS and not shared) or len(pod) != 1:
        return "only a one-container MPS or one-GPU whole-GPU job is placed by its calibrated size"
    container, asked = pod[0]
    memory_gib = asked.memory_mib // MIB_PER_GIB
    if shared:
        if (asked.count != 1 or asked.isolation is not Isolation.MPS or len(planned.gpus) != 1
                or planned.isolation is not Isolation.MPS or memory_gib <= 0
                or (job.memory_mib and memory_gib >= -(-job.memory_mib // MIB_PER_GIB))):
            return (f"container {container!r} limits are not one GPU's MPS share of its "
                    f"whole-GPU spec.gpu")
    elif (asked.count != job.count or asked.isolation is not job.isolation
            or asked.cores_pct != job.cores_pct or len(planned.gpus) != job.count
            or not 0 < memory_gib < -(-job.memory_mib // MIB_PER_GIB)):
        return (f"container {container!r} limits are not its spec.gpu's at a lower GPU memory")
    if any(-(-g.memory_mib // MIB_PER_GIB) != memory_gib or g.cores_pct != asked.cores_pct
           for g in planned.gpus):
        return (f"container {container!r} limits carpool.dev/gpu-memory to {memory_gib}, "
                f"which its planned assignment does not grant")
    return ""


@dataclass(frozen=True)
class GpuLimits:
    """One container's carpool.dev/* limits (immutable once the pod exists)."""

    container: str
    count: int
    memory_gib: int = 0
    cores_pct: int = 0


def assignment_tampered(assignment: Assignment | None, limits: Sequence[GpuLimits],
                        recorded: str) -> str:
    """Why a job's pod's `carpool.dev/assignment` is not one the extender wrote for it ("" when
    it may be): it differs from the one the operator recorded when it first saw the pod bound
    (`recorded`, the job's `status.podAssignment`), or it gives a container other GPUs than its
    limits ask for (count; memory or cores per GPU above them, MIG instances and exclusive
    GPUs aside, whose memory is the instance's or the card's). Checked on the job's current
    attempt: the assignment is the one pod annotation every component acts on."""
    if assignment is None:
        return "its carpool.dev/assignment was removed" if recorded else ""
    if recorded and encode_assignment(assignment) != recorded:
        return "its carpool.dev/assignment differs from the one it was bound with"
    named = {g.container for g in assignment.gpus}
    for limit in limits:
        gpus = [g for g in assignment.gpus
                if g.container == limit.container or (named == {""} and len(limits) == 1)]
        if len(gpus) != limit.count:
            return (f"its carpool.dev/assignment gives container {limit.container!r} "
                    f"{len(gpus)} GPUs, its carpool.dev/gpu limit is {limit.count}")
        if assignment.isolation is Isolation.EXCLUSIVE:
            continue
        for gpu in gpus:
            if not gpu.mig_instance and limit.memory_gib and \
                    gpu.memory_mib > limit.memory_gib * MIB_PER_GIB:
                return (f"its carpool.dev/assignment gives container {limit.container!r} "
                        f"{gpu.memory_mib} MiB on GPU {gpu.uuid}, over its carpool.dev/"
                        f"gpu-memory limit of {limit.memory_gib} GiB")
            if limit.cores_pct and gpu.cores_pct > limit.cores_pct:
                return (f"its carpool.dev/assignment gives container {limit.container!r} "
                        f"{gpu.cores_pct} % of GPU {gpu.uuid}, over its carpool.dev/gpu-cores "
                        f"limit of {limit.cores_pct}")
    if len(assignment.gpus) != sum(limit.count for limit in limits):
        return "its carpool.dev/assignment names GPUs for containers that ask for none"
    return ""


def unowned_refusal(pod_key: str) -> str:
    """What a pod no GpuJob owns is told (scheduling event, Allocate error)."""
    return (f"pod {pod_key} is not owned by a GpuJob: Carpool gives GPUs only to the pods its "
            f"operator makes for GpuJobs. Submit a GpuJob (apiVersion {GROUP}/v1alpha1) that "
            f"asks for the GPUs in spec.gpu instead")
