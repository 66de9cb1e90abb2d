"""Filter, prioritize and bind: the extender's decisions, independent of HTTP.

Handlers decode the wire format, read node views from the cache, ask the placement seam
(`ranking`) and return wire results. Bind is the only verb that writes; it talks to the API
server through the `ClusterPort` protocol, so tests use a fake and production the Kubernetes
client (`kube.KubeCluster`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from carpool.core import names
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant
from carpool.core.scoring import CARPOOL, ScoringPolicy
from carpool.extender.cache import ClusterCache, InFlightClash, in_flight_clash
from carpool.extender.ranking import Placement, Ranker, scale_scores
from carpool.extender.wire import (
    AssignedGpu,
    Assignment,
    BindingArgs,
    ExtenderArgs,
    PodDemand,
    Policy,
    WireError,
    decode_assignment,
    decode_pod,
    encode_assignment,
    encode_filter_result,
    encode_priorities,
)

log = logging.getLogger(__name__)

CACHE_KINDS = ("nodes", "gpunodes", "pods")
BIND_POLL_S = 0.02
NOT_SYNCED = "the Carpool extender is still loading its cache; retry shortly"


class ClusterError(Exception):
    """An API call failed; `status` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClusterPort(Protocol):
    """The three API calls bind makes."""

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]: ...

    def annotate_pod(self, namespace: str, name: str,
                     annotations: Mapping[str, str | None]) -> None: ...

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None: ...


@dataclass(frozen=True)
class Settings:
    """The default policy (a job may override it) and the score weights."""

    policy: str = Policy.BINPACK
    scoring: ScoringPolicy = CARPOOL
    learn_workload: bool = True  # fragmentation against the shapes seen so far
    # How long bind waits for another pod's hand-over on its node (the handshake rule)
    # before failing; keep it under the scheduler's httpTimeout (default 5 s).
    bind_wait_s: float = 3.0

    def __post_init__(self) -> None:
        if self.policy not in Policy.ALL:
            raise ValueError(f"policy must be one of {', '.join(Policy.ALL)}")


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def assignment_of(node: NodeState, demand: PodDemand, placement: Placement) -> Assignment:
    """The annotation's content for a placement (GPU indexes from the inventory)."""
    index = {g.uuid: g.index for g in node.inventory.gpus}
    gpus = []
    for container, grants in zip(demand.containers, placement.per_container, strict=True):
        for grant in grants:
            gpus.append(AssignedGpu(grant.gpu_uuid, index[grant.gpu_uuid], grant.memory_mib,
                                    grant.cores_pct, grant.mig_instance, container.container))
    return Assignment(node.name, tuple(gpus))


def fits_exactly(node: NodeState, grants: tuple[GpuGrant, ...]) -> bool:
    """True if recorded grants still fit: known healthy GPUs, nothing over-committed."""
    gpus = {g.uuid: g for g in node.inventory.gpus}
    if any(g.gpu_uuid not in gpus or not gpus[g.gpu_uuid].healthy for g in grants):
        return False
    combined = node.with_grants(grants)
    for free in combined.free():
        if free.memory_mib < 0 or free.cores_pct < 0:
            return False
        if free.exclusive_taken and free.grants > 1:
            return False
    mig = [g.mig_instance for g in combined.grants if g.mig_instance]
    return len(mig) == len(set(mig))


class Extender:
    """The extender's verbs over a cache and a cluster port."""

    def __init__(self, cache: ClusterCache, cluster: ClusterPort, settings: Settings,
                 clock: Callable[[], float] = time.time) -> None:
        self.cache = cache
        self.cluster = cluster
        self.settings = settings
        self.clock = clock
        self.ranker = Ranker(settings.scoring, settings.learn_workload)

    def _policy(self, demand: PodDemand) -> str:
        return demand.policy or self.settings.policy

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        """ExtenderFilterResult: nodes where every GPU container fits, reasons for the rest."""
        if not self.cache.synced(CACHE_KINDS):
            return encode_filter_result(args, [], {}, {}, NOT_SYNCED)
        try:
            demand = decode_pod(args.pod)
        except WireError as exc:
            return encode_filter_result(args, [], {}, {}, f"pod not understood: {exc}")
        if not demand.containers:  # not a Carpool GPU pod: nothing for us to restrict
            return encode_filter_result(args, list(args.node_names), {}, {})
        policy = self._policy(demand)
        self.ranker.observe(demand)
        snapshot = self.cache.snapshot(args.node_names, demand.key, self.clock())
        evaluations = self.ranker.evaluate_all(snapshot.states, demand, policy)
        counts = demand.gpu_counts
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable = {name: f"carpool: {reason}" for name, reason in snapshot.missing.items()}
        for name, evaluation in evaluations.items():
            if evaluation.placement is None:
                inventory = snapshot.states[name].inventory
                if self.ranker.fits_when_empty(inventory, demand, policy):
                    failed[name] = f"carpool: {evaluation.reason}"
                else:
                    unresolvable[name] = f"carpool: {evaluation.reason}"
                continue
            flying = snapshot.in_flight.get(name)
            clash = in_flight_clash(flying, counts) if flying else None
            if clash is not None:
                failed[name] = f"carpool: {clash}"
            else:
                passed.append(name)
        return encode_filter_result(args, passed, failed, unresolvable)

    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        """HostPriorityList, 0..10; nodes where the pod does not fit score 0."""
        if not self.cache.synced(CACHE_KINDS):
            raise WireError(NOT_SYNCED)
        demand = decode_pod(args.pod)
        if not demand.containers:
            return encode_priorities({n: 0 for n in args.node_names})
        policy = self._policy(demand)
        snapshot = self.cache.snapshot(args.node_names, demand.key, self.clock())
        evaluations = self.ranker.evaluate_all(snapshot.states, demand, policy)
        raw = {name: e.placement.score for name, e in evaluations.items() if e.placement}
        return encode_priorities(scale_scores(raw, args.node_names))

    # --- bind ----------------------------------------------------------------------------

    def bind(self, args: BindingArgs) -> dict[str, str]:
        """ExtenderBindingResult: choose and record the GPUs, then create the Binding."""
        try:
            return {"Error": self._bind(args)}
        except ClusterError as exc:
            return {"Error": f"API server: {exc}"}

    def _bind(self, args: BindingArgs) -> str:
        now = self.clock()
        self.cache.expire_assumed(now)
        try:
            pod = self.cluster.get_pod(args.pod_namespace, args.pod_name)
        except ClusterError as exc:
            if exc.status == 404:
                return f"pod {args.key} no longer exists"
            raise
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if args.pod_uid and uid != args.pod_uid:
            return f"pod {args.key} was replaced (uid {uid}, expected {args.pod_uid})"
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to == args.node:
            return ""  # a retry after a bind that succeeded
        if bound_to:
            return f"pod {args.key} is already bound to {bound_to}"
        try:
            demand = decode_pod(pod)
        except WireError as exc:
            return f"pod {args.key} not understood: {exc}"
        if not demand.containers:
            self.cluster.bind_pod(args.pod_namespace, args.pod_name, uid, args.node)
            return ""
        previous = self._previous_assignment(pod, args.node)
        policy = self._policy(demand)
        exclusive = any(c.request.isolation.value == "exclusive" for c in demand.containers)

        def choose(state: NodeState) -> tuple[Assignment, tuple[GpuGrant, ...]] | str:
            if previous is not None:
                totals = {g.uuid: g.memory_total_mib for g in state.inventory.gpus}
                grants = previous.grants(exclusive, totals)
                if fits_exactly(state, grants):
                    return previous, grants
            evaluation = self.ranker.evaluate(state, demand, policy)
            if evaluation.placement is None:
                return evaluation.reason
            return (assignment_of(state, demand, evaluation.placement),
                    evaluation.placement.grants)

        reserved = self.cache.reserve(demand.key, uid, args.node, demand.gpu_counts, now,
                                      choose)
        # The scheduler picked this node before an earlier pod's bind to it was seen: rather
        # than fail (and have the pod backed off for seconds), wait for that hand-over.
        deadline = time.monotonic() + self.settings.bind_wait_s
        while isinstance(reserved, InFlightClash) and time.monotonic() < deadline:
            time.sleep(BIND_POLL_S)
            now = self.clock()
            reserved = self.cache.reserve(demand.key, uid, args.node, demand.gpu_counts, now,
                                          choose)
        if isinstance(reserved, str):
            return f"cannot place {args.key} on {args.node}: {reserved}"
        try:
            self.cluster.annotate_pod(args.pod_namespace, args.pod_name, {
                names.ANN_ASSIGNMENT: encode_assignment(reserved),
                names.ANN_ASSIGNED_AT: rfc3339(now),
            })
        except ClusterError as exc:
            self.cache.forget(demand.key, uid)
            return f"recording the GPU assignment failed: {exc}"
        try:
            self.cluster.bind_pod(args.pod_namespace, args.pod_name, uid, args.node)
        except ClusterError as exc:
            if exc.status == 409 and self._bound_to(args) == args.node:
                return ""
            self.cache.forget(demand.key, uid)
            self._clear_assignment(args)
            return f"creating the Binding failed: {exc}"
        return ""

    @staticmethod
    def _previous_assignment(pod: Mapping[str, Any], node: str) -> Assignment | None:
        """An assignment an earlier attempt recorded for this node (reused on retry)."""
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANN_ASSIGNMENT)
        if not text:
            return None
        try:
            assignment = decode_assignment(str(text))
        except WireError:
            return None
        return assignment if assignment.node == node else None

    def _bound_to(self, args: BindingArgs) -> str | None:
        try:
            pod = self.cluster.get_pod(args.pod_namespace, args.pod_name)
        except ClusterError:
            return None
        return (pod.get("spec") or {}).get("nodeName")

    def _clear_assignment(self, args: BindingArgs) -> None:
        """Best effort: an unbound pod should not keep GPUs recorded (the cache counts them)."""
        try:
            self.cluster.annotate_pod(args.pod_namespace, args.pod_name,
                                      {names.ANN_ASSIGNMENT: None, names.ANN_ASSIGNED_AT: None})
        except ClusterError as exc:
            log.warning("could not clear the assignment of %s: %s", args.key, exc)
