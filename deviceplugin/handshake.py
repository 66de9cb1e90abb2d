"""Which pod an Allocate call is for: the extender <-> device plugin handshake.

The kubelet calls Allocate with device IDs but no pod identity. The extender never keeps two pods
"in flight" on one node whose GPU containers ask for the same `carpool.dev/gpu` count (in flight:
assigned by the extender, not yet marked `carpool.dev/allocated`, not running, not finished,
assigned less than `HAND_OVER_STALE_S` (10 min) ago). So among this node's in-flight pods
exactly one container matches the request's count; its assignment annotation says which GPUs
(and MIG instance, memory, cores and the isolation its job asked for) it holds; nothing is
read from the pod's own `carpool.dev/isolation` annotation. Everything here is pure: pods in,
a decision or a `HandshakeError` out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from carpool.core.annotations import load_annotation_json
from carpool.core.assignment import (
    HAND_OVER_STALE_S,
    AssignedGpu,
    Assignment,
    AssignmentError,
    parse_assignment,
)
from carpool.core.names import ANN_ALLOCATED, ANN_ASSIGNED_AT, ANN_ASSIGNMENT
from carpool.core.ownership import Owner
from carpool.core.resources import Isolation
from carpool.core.shares import ShareId
from carpool.core.timestamps import epoch_of, format_timestamp

IN_FLIGHT_STALE_S = HAND_OVER_STALE_S  # the extender's rule uses the same value


class HandshakeError(Exception):
    """An Allocate request that cannot be served; `code` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        # "INVALID_ARGUMENT" | "NOT_FOUND" | "FAILED_PRECONDITION" | "PERMISSION_DENIED"
        self.code = code


@dataclass(frozen=True)
class ServedPod:
    """A pod on this node as the device plugin serves it: what the kubelet handshake, the
    watchdog and the report reader need (the operator's view of a job's pod is
    `core.lifecycle.PodView`, what a job's state is derived from)."""

    namespace: str
    name: str
    uid: str
    phase: str
    deleting: bool
    annotations: Mapping[str, str]
    gpu_containers: tuple[tuple[str, int], ...]  # (container name, carpool.dev/gpu count)
    owner: Owner | None = None  # the GpuJob controlling the pod (core.ownership)
    scheduler: str = ""  # spec.schedulerName (immutable)
    # the pod's securityContext runAsUser and runAsGroup (None: unset), then each container's
    # (init containers included) by name: immutable once the pod exists
    run_as: tuple[int | None, int | None] = (None, None)
    containers_run_as: tuple[tuple[str, int | None, int | None], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Match:
    """The container an Allocate call is for, and the GPUs it was assigned."""

    pod: ServedPod
    container: str
    gpus: tuple[AssignedGpu, ...]
    isolation: Isolation | None  # None: the extender did not record it; the node's mode


def allocated_containers(pod: ServedPod) -> set[str]:
    """Containers the plugin already handed devices to (from `carpool.dev/allocated`)."""
    text = pod.annotations.get(ANN_ALLOCATED)
    if not text:
        return set()
    try:
        data = load_annotation_json(text, ANN_ALLOCATED)
    except ValueError:
        return {name for name, _ in pod.gpu_containers}  # set by someone else: treat as done
    containers = data.get("containers") if isinstance(data, dict) else None
    if not isinstance(containers, dict):
        return {name for name, _ in pod.gpu_containers}
    return set(containers)


def allocated_annotation(pod: ServedPod, container: str, device_ids: Sequence[str],
                         gpus: Sequence[str], now: datetime) -> str:
    """The new `carpool.dev/allocated` value after handing `device_ids` to `container`."""
    text = pod.annotations.get(ANN_ALLOCATED)
    containers: dict[str, object] = {}
    if text:
        try:
            old = load_annotation_json(text, ANN_ALLOCATED)
            if isinstance(old, dict) and isinstance(old.get("containers"), dict):
                containers = dict(old["containers"])
        except ValueError:
            pass
    containers[container] = {"deviceIDs": list(device_ids), "gpus": list(gpus)}
    return json.dumps({"containers": containers,
                       "at": format_timestamp(now.timestamp())},
                      separators=(",", ":"), sort_keys=True)


def _assigned_at(pod: ServedPod) -> float:
    at = epoch_of(pod.annotations.get(ANN_ASSIGNED_AT))
    return 0.0 if at is None else at  # unknown bind time: oldest first, and counted as stale


def _container_gpus(gpus: tuple[AssignedGpu, ...], container: str,
                    gpu_containers: tuple[tuple[str, int], ...]) -> tuple[AssignedGpu, ...]:
    named = tuple(g for g in gpus if g.container == container)
    if named:
        return named
    if len(gpu_containers) == 1:
        return tuple(g for g in gpus if not g.container)
    # Several GPU containers and an assignment without container names: hand them out in order.
    start = 0
    for name, count in gpu_containers:
        if name == container:
            return gpus[start:start + count]
        start += count
    return ()


Candidate = tuple[ServedPod, str, tuple[AssignedGpu, ...]]


def assignment_on(pod: ServedPod, node: str) -> Assignment | None:
    """The pod's assignment when it names `node`; None when it has none, names another node,
    or cannot be read (a user-writable annotation: skipped, never fatal)."""
    text = pod.annotations.get(ANN_ASSIGNMENT)
    if not text:
        return None
    try:
        assignment = parse_assignment(text)
    except AssignmentError:
        return None
    return assignment if assignment.node == node else None


def in_flight(pods: Iterable[ServedPod], node: str) -> list[Candidate]:
    """(pod, container, its GPUs) still waiting for an Allocate on `node`; bad annotations skip."""
    out = []
    for pod in pods:
        if pod.deleting or pod.phase not in ("Pending", ""):
            continue
        assignment = assignment_on(pod, node)
        if assignment is None:
            continue
        gpus = assignment.gpus
        done = allocated_containers(pod)
        for container, _count in pod.gpu_containers:
            if container not in done:
                mine = _container_gpus(gpus, container, pod.gpu_containers)
                if mine:
                    out.append((pod, container, mine))
    return out


def expected_container(
    pods: Iterable[ServedPod],
    node: str,
    count: int,
    now: float,
    handed_over: frozenset[tuple[str, str]] = frozenset(),
    share_gpus: frozenset[str] = frozenset(),
) -> Match | None:
    """The in-flight container a request for `count` GPUs is for, or None.

    Candidates are in-flight containers with `count` assigned GPUs that this plugin has not
    already served (`handed_over`: (pod uid, container)). Ranked by: assigned GPUs equal to
    `share_gpus` (what GetPreferredAllocation steered the kubelet to), then fresh before stale,
    then bind time, then name, so a tie is broken the same way every time.
    """
    candidates = [
        (pod, container, gpus)
        for pod, container, gpus in in_flight(pods, node)
        if len(gpus) == count and (pod.uid, container) not in handed_over
    ]
    if not candidates:
        return None

    def rank(c: Candidate) -> tuple[bool, bool, float, str, str]:
        pod, container, gpus = c
        at = _assigned_at(pod)
        stale = now - at > IN_FLIGHT_STALE_S
        return ({g.uuid for g in gpus} != share_gpus, stale, at, pod.key, container)

    pod, container, gpus = min(candidates, key=rank)
    # the isolation the extender recorded at bind (from the job's spec), never the pod's
    # own isolation annotation: a tenant could change that after admission
    assignment = assignment_on(pod, node)
    return Match(pod, container, gpus, assignment.isolation if assignment else None)


def match_request(
    pods: Iterable[ServedPod],
    node: str,
    shares: Sequence[ShareId],
    now: float,
    handed_over: frozenset[tuple[str, str]] = frozenset(),
) -> Match:
    """The one in-flight container this Allocate(`shares`) is for (see `expected_container`);
    `HandshakeError` FAILED_PRECONDITION when there is none."""
    match = expected_container(pods, node, len(shares), now, handed_over,
                               frozenset(s.gpu_uuid for s in shares))
    if match is None:
        raise HandshakeError(
            "FAILED_PRECONDITION",
            f"no pod in flight on node {node} has a container assigned {len(shares)} "
            f"carpool.dev/gpu (the extender records the assignment at bind; was the pod "
            f"scheduled by the Carpool scheduler?)",
        )
    return match


def preferred_shares(
    available: Sequence[ShareId],
    must_include: Sequence[ShareId],
    size: int,
    preferred_gpus: Sequence[str],
) -> list[ShareId]:
    """`size` shares from `available`: the required ones, then one on each preferred GPU (the
    in-flight pod's assignment, in order), then the rest on GPUs not yet used, lowest first.

    Each share in an answer sits on a distinct GPU, because one `carpool.dev/gpu` is one GPU.
    """
    chosen: list[ShareId] = []
    used: set[str] = set()

    def take(share: ShareId) -> None:
        if len(chosen) < size and share not in chosen and share.gpu_uuid not in used:
            chosen.append(share)
            used.add(share.gpu_uuid)

    for share in must_include:
        take(share)
    ordered = sorted(available)
    for gpu in preferred_gpus:
        for share in ordered:
            if share.gpu_uuid == gpu:
                take(share)
                break
    for share in ordered:
        take(share)
    for share in ordered:  # not enough distinct GPUs: fill up rather than answer short
        if len(chosen) < size and share not in chosen:
            chosen.append(share)
    return chosen


def mps_client_refusal(pod: ServedPod, client_uid: int | None, client_gid: int | None) -> str:
    """Why `pod` may not be an MPS client on this node ("" when it may): one of its containers
    runs as another user or group than the one every MPS client runs as (the chart's
    mpsDaemon.clientUid/clientGid; None: not configured, anyone).

    The operator sets that user on every MPS job's pod (operator/pods.py,
    apply_platform_settings); this is the same rule checked where the MPS share is handed
    out. The device plugin is the one place that knows the pod gets an MPS share (the
    isolation the extender recorded, on a node in MPS mode) and it acts on every pod,
    whoever created it, with or without the admission policies: an admission rule would
    have to guess the node's sharing mode from a pod annotation before the pod is placed.
    A client of another user would make the control daemon hold every other user's clients
    until its server exits (docs/concepts.md, MPS)."""
    pod_user, pod_group = pod.run_as
    for container, user, group in pod.containers_run_as:
        for what, value, wanted, field_name, value_name in (
                ("user", user if user is not None else pod_user, client_uid, "runAsUser",
                 "clientUid"),
                ("group", group if group is not None else pod_group, client_gid,
                 "runAsGroup", "clientGid")):
            if wanted is not None and value != wanted:
                shown = "the image's" if value is None else str(value)
                return (f"pod {pod.key}: container {container!r} runs as {what} {shown} "
                        f"(securityContext.{field_name}), but MPS clients on this node run "
                        f"as {what} {wanted} (mpsDaemon.{value_name})")
    return ""
