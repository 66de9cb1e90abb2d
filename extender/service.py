"""Filter, prioritize and bind: the extender's decisions, independent of HTTP.

Handlers decode the wire format, read node views from the cache, ask the placement seam
(`ranking`) and return wire results. Bind is the only verb that writes; it talks to the API
server through the `ClusterPort` protocol, so tests use a fake and production the Kubernetes
client (`kube.KubeCluster`).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, Protocol, TypeVar

from carpool.core import names
from carpool.core.assignment import (
    AssignedGpu,
    Assignment,
    AssignmentError,
    encode_assignment,
    parse_assignment,
)
from carpool.core.ownership import calibrated_mismatch, grant_mismatch, unowned_refusal
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, Isolation
from carpool.core.scoring import CARPOOL, ScoringPolicy
from carpool.core.timestamps import format_timestamp_micro
from carpool.extender.cache import (
    ClusterCache,
    Hold,
    InFlightClash,
    Refused,
    gang_attempt,
    in_flight_clash,
)
from carpool.extender.ranking import MAX_SCORE, Placement, Ranker, scale_scores
from carpool.extender.wire import (
    BindingArgs,
    ContainerDemand,
    ExtenderArgs,
    PodDemand,
    Policy,
    WireError,
    decode_pod,
    encode_filter_result,
    encode_priorities,
)

log = logging.getLogger(__name__)

CACHE_KINDS = ("nodes", "gpunodes", "pods", "gpujobs")
BIND_POLL_S = 0.02
SLOW_COMMIT_S = 0.5
NOMINATION_TTL_S = 2.0
NOT_SYNCED = "the Carpool extender is still loading its cache; retry shortly"


class ClusterError(Exception):
    """An API call failed; `status` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClusterPort(Protocol):
    """The two API calls bind makes."""

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]: ...

    def bind_pod(self, namespace: str, name: str, uid: str, node: str,
                 annotations: Mapping[str, str], resource_version: str = "") -> None:
        """Create the pod's Binding (with these annotations); 409 if the preconditions fail."""


# What the command ships with (`--filter-best`): Carpool's first choice goes straight to bind.
SHIPPED_FILTER_BEST = 1
# The bounded search walks every node in the order of its ceiling, skipping those not asked
# about: below this share of the nodes asked, scoring the candidates themselves costs less.
SEARCH_SHARE = 0.5


@dataclass(frozen=True)
class Settings:
    """The default policy (a job may override it) and the score weights."""

    policy: str = Policy.BINPACK
    scoring: ScoringPolicy = CARPOOL
    learn_workload: bool = True  # fragmentation against the shapes seen so far
    # How long bind waits for another pod's hand-over on its node (the handshake rule)
    # before failing; keep it under the scheduler's httpTimeout (default 5 s).
    bind_wait_s: float = 3.0
    # Filter passes only this many nodes, Carpool's best for the pod (0: every node that
    # fits). With 1 the scheduler binds to Carpool's first choice without scoring or calling
    # prioritize (it skips both when one node is left): one HTTP round trip per pod instead
    # of two, and none of its own scoring. The command ships with 1 (`--filter-best`); see
    # docs/benchmarks.md for the effect on placement.
    filter_best: int = 0
    # With filter_best, find the best nodes by scoring them in the order of a ceiling on
    # their score (`Ranker.search`), not every candidate: the same answer at a cost that
    # does not grow with the nodes. False: score every candidate (the reference the tests
    # and bench/extender.py compare it with).
    bounded_search: bool = True
    # After a Binding whose outcome is unknown (a timeout, a lost connection, a 5xx), how
    # often to read the pod until the watch settles its GPUs (see `_follow_ambiguous`).
    ambiguous_recheck_s: float = 10.0
    # Place pods that no GpuJob owns (benchmarks and test beds that schedule bare pods). The
    # command turns it off unless told `--allow-unowned-pods`: such pods are then filtered
    # out with the reason in their FailedScheduling event, and never bound.
    serve_unowned: bool = True

    def __post_init__(self) -> None:
        if self.policy not in Policy.ALL:
            raise ValueError(f"policy must be one of {', '.join(Policy.ALL)}")
        if self.filter_best < 0:
            raise ValueError("filter_best must be 0 (every node) or more")
        if self.ambiguous_recheck_s <= 0:
            raise ValueError("ambiguous_recheck_s must be positive")


@dataclass(frozen=True)
class Mismatch:
    """Why a job's pod is not placed: `final` (its FailedScheduling says so until it is
    deleted), or not (the scheduler retries: its job is not in the watch yet)."""

    reason: str
    final: bool = True


def assignment_of(node: NodeState, demand: PodDemand, placement: Placement) -> Assignment:
    """The annotation's content for a placement (GPU indexes from the inventory)."""
    index = {g.uuid: g.index for g in node.inventory.gpus}
    gpus = []
    for container, grants in zip(demand.containers, placement.per_container, strict=True):
        for grant in grants:
            gpus.append(AssignedGpu.of(replace(grant, borrowed=False),
                                       index[grant.gpu_uuid], container.container))
    isolation = demand.containers[0].request.isolation if demand.containers else None
    return Assignment(node.name, tuple(gpus), isolation)


def planned_assignment(pod: Mapping[str, Any]) -> Assignment | None:
    """The node and GPUs the operator's admission chose for a gang worker (None: not a gang
    worker, or not readable: placed as any pod)."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    text = annotations.get(names.ANN_PLANNED) if isinstance(annotations, Mapping) else None
    if not text:  # (a pod that is not one at all is refused by the usual decoding)
        return None
    try:
        return parse_assignment(str(text))
    except AssignmentError:
        return None


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


def best_nodes(names: list[str], placed: Mapping[str, float], pod_key: str,
               keep: int) -> list[str]:
    """The `keep` of `names` with the highest scores (`placed`: every placed node's), best
    first.

    Ties break on a hash of pod and node: deterministic, yet pods scheduled back to back do
    not all favour the same node. Only the nodes tied at the cut are hashed (at 1,000 equal
    nodes that is all of them, still well under a millisecond).
    """
    scores = placed if len(names) == len(placed) else {name: placed[name] for name in names}
    if len(scores) <= keep:
        cut = min(scores.values())
    elif keep == 1:
        cut = max(scores.values())
    else:
        cut = heapq.nlargest(keep, scores.values())[-1]
    candidates = [name for name, score in scores.items() if score >= cut]
    salt = zlib.crc32(f"{pod_key}@".encode())
    if keep == 1:
        # every candidate has the top score, so only the hash decides; the first of equal
        # hashes wins, as `max` picks it (this runs over hundreds of tied nodes per filter)
        hashes = list(map(zlib.crc32, map(str.encode, candidates), repeat(salt)))
        return [candidates[hashes.index(max(hashes))]]

    def rank(name: str) -> tuple[float, int]:
        return scores[name], zlib.crc32(name.encode(), salt)

    return heapq.nlargest(keep, candidates, key=rank)


class Nominations:
    """The node prioritize expects each pod to be bound to, until the pod's bind arrives.

    Only steering, never correctness (that is the cache's reserve): kube-scheduler starts the
    next pod's filter while the last pod's bind is still on its way to us, and without this
    the next same-count pod would be sent to the same node, only to wait at bind for the
    first one's hand-over.
    """

    def __init__(self, ttl_s: float = NOMINATION_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._by_pod: dict[str, tuple[str, frozenset[int], float]] = {}
        self._lock = threading.Lock()

    def nominate(self, pod_key: str, node: str, counts: frozenset[int], now: float) -> None:
        with self._lock:
            self._by_pod[pod_key] = (node, counts, now + self._ttl_s)

    def describe(self, pod_key: str) -> str:
        with self._lock:
            entry = self._by_pod.get(pod_key)
        if entry is None:
            return "nowhere"
        return f"{entry[0]}, {time.monotonic() - (entry[2] - self._ttl_s):.2f}s ago"

    def clear(self, pod_key: str) -> None:
        with self._lock:
            self._by_pod.pop(pod_key, None)

    def clashes(self, pod_key: str, counts: frozenset[int], now: float
                ) -> list[tuple[str, str]]:
        """(node, reason) for nodes another same-count pod is about to be bound to."""
        with self._lock:
            for key in [k for k, (_, _, expires) in self._by_pod.items() if expires < now]:
                del self._by_pod[key]
            return [(node, f"allocation in flight on this node ({key} is being bound there)")
                    for key, (node, theirs, _) in sorted(self._by_pod.items())
                    if key != pod_key and theirs & counts]


T = TypeVar("T")
RunBlocking = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class AlreadyBound:
    """The pod is bound to the node asked for: an earlier attempt succeeded."""


@dataclass(frozen=True)
class Bound:
    """The Binding was created (or an earlier attempt's was found in place)."""


@dataclass(frozen=True)
class Stale:
    """The pod changed since the copy the plan was made from: read it again and redo."""


BindOutcome = Bound | Stale | Refused
MAX_REMEMBERED_PODS = 10_000


@dataclass(frozen=True)
class BindPlan:
    """One bind attempt: the pod's demand as of `resource_version`."""

    args: BindingArgs
    demand: PodDemand
    uid: str
    resource_version: str
    previous: Assignment | None  # what an earlier attempt recorded for this node
    policy: str
    fresh: bool  # read from the API server just now (not the scheduler's copy)


class Extender:
    """The extender's verbs over a cache and a cluster port."""

    def __init__(self, cache: ClusterCache, cluster: ClusterPort, settings: Settings,
                 clock: Callable[[], float] = time.time) -> None:
        self.cache = cache
        self.cluster = cluster
        self.settings = settings
        self.clock = clock
        self.ranker = Ranker(settings.scoring, settings.learn_workload)
        self._pods_seen: OrderedDict[str, Mapping[str, Any]] = OrderedDict()
        self._pods_lock = threading.Lock()
        self.nominations = Nominations()
        self._followers: set[asyncio.Task[None]] = set()
        self._last_names: tuple[tuple[str, ...], frozenset[str]] = ((), frozenset())

    @property
    def needs_warming(self) -> bool:
        """Whether requests read the memo of every node (`evaluate_all`): filter without
        `filter_best` or the bounded search, and prioritize after it. The bounded search
        scores the few nodes it needs itself, and a warmer would only compete with it."""
        return not (self.settings.filter_best and self.settings.bounded_search)

    def warm(self, budget_s: float) -> bool:
        """One step of keeping the ranker's memo complete (see `Ranker.warm`), for at most
        about `budget_s`; True if there is more to do. Run between requests."""
        if not self.cache.synced(CACHE_KINDS):
            return False
        if not self.needs_warming:  # the search's node index, off the request path
            self.ranker.sync_index(self.cache)
            return False
        self.ranker.set_supply(self.cache.supply())
        return self.ranker.warm(self.cache, time.monotonic() + budget_s)

    def checked(self, demand: PodDemand) -> PodDemand | Mismatch:
        """The demand of a GpuJob's pod as its job's spec.gpu says (isolation and models
        from the spec; `core.ownership.grant_mismatch` checks the pod's limits and isolation
        annotation against it), or why it is not placed. A pod whose job the watch has not
        shown yet waits for it; one no GpuJob owns is left as it says when such pods are
        served (`Settings.serve_unowned`), as is, then, an owned one of an unknown job."""
        if demand.owner is None or not demand.containers:
            return demand
        known = self.cache.job_request(demand.namespace, demand.owner)
        if known is None:
            if self.settings.serve_unowned:
                return demand
            return Mismatch(f"pod {demand.key}: its GpuJob {demand.namespace}/"
                            f"{demand.owner.name} (uid {demand.owner.uid}) is not known to the "
                            f"extender (yet); its grant and isolation come from that job",
                            final=False)
        if isinstance(known, str):
            return Mismatch(f"pod {demand.key}: {known}")
        asked_for = [(c.container, c.request) for c in demand.containers]
        problem = grant_mismatch(known, asked_for)
        for shape in self.cache.job_shapes(demand.namespace, demand.owner):
            if problem and not grant_mismatch(shape, asked_for):  # a gang worker's shape
                known, problem = shape, ""
        isolation = known.isolation
        if problem and not calibrated_mismatch(known, asked_for, demand.planned):
            problem = ""  # placed by its calibrated size (core.right_sizing)
            isolation = asked_for[0][1].isolation  # MPS, a whole-GPU job's share included
        if problem:
            return Mismatch(f"pod {demand.key} {problem}; not placed (Carpool places a job's "
                            f"pod only as its GpuJob asks)")
        ((container, asked),) = [(c.container, c.request) for c in demand.containers]
        request = replace(asked, isolation=isolation, models=known.models,
                          mig_slices=known.mig_slices, objectives=known.objectives,
                          sharing_limits=known.sharing_limits,
                          sharing_weights=known.sharing_weights,
                          sharing_template=known.sharing_template,
                          sharing_felt_by=known.sharing_felt_by)
        return replace(demand, containers=(ContainerDemand(container, request),))

    def _policy(self, demand: PodDemand) -> str:
        return demand.policy or self.settings.policy

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        """ExtenderFilterResult: nodes where every GPU container fits, reasons for the rest.

        A gang's worker goes only to the node its gang's admission chose for it
        (`names.ANN_PLANNED`): the gang was placed as a whole, so no worker picks another."""
        planned = planned_assignment(args.pod)
        if planned is None:
            return self._filter(args)
        borrowing = any(g.borrowed for g in planned.gpus)
        annotations = (args.pod.get("metadata") or {}).get("annotations") or {}
        what = ("it runs in capacity lent there" if borrowing
                else "a gang worker; its gang was placed with it"
                if names.ANN_GANG in annotations
                else "the operator placed it there by its calibrated size")
        elsewhere = {n: f"carpool: {what} on {planned.node}"
                     for n in args.node_names if n != planned.node}
        if planned.node not in args.node_names:
            return encode_filter_result(args, [], elsewhere, {})
        if borrowing:
            return self._filter_borrower(args, planned, elsewhere)
        result = self._filter(replace(args, node_names=(planned.node,)))
        result["FailedNodes"] = {**elsewhere, **(result.get("FailedNodes") or {})}
        return result

    def _filter_borrower(self, args: ExtenderArgs, planned: Assignment,
                         elsewhere: dict[str, str]) -> dict[str, Any]:
        """A pod the operator placed in lent capacity (`core.lending`) passes its planned node
        only while those GPUs still hold it there (its grants within what is lent)."""
        if not self.cache.synced(CACHE_KINDS):
            return encode_filter_result(args, [], {}, {}, NOT_SYNCED)
        try:
            demand = decode_pod(args.pod)
        except WireError as exc:
            return encode_filter_result(args, [], {}, {}, f"pod not understood: {exc}")
        if isinstance(checked := self.checked(demand), Mismatch):
            reasons = {planned.node: f"carpool: {checked.reason}"}
            return encode_filter_result(args, [], elsewhere, reasons)
        snapshot = self.cache.snapshot((planned.node,), demand.key, self.clock())
        state = snapshot.states.get(planned.node)
        if state is not None and fits_exactly(state, planned.grants()):
            return encode_filter_result(args, [planned.node], elsewhere, {})
        why = snapshot.missing.get(planned.node, "the capacity lent there is no longer free")
        return encode_filter_result(args, [], {**elsewhere, planned.node: f"carpool: {why}"},
                                    {})

    def _filter(self, args: ExtenderArgs) -> dict[str, Any]:
        if not self.cache.synced(CACHE_KINDS):
            return encode_filter_result(args, [], {}, {}, NOT_SYNCED)
        try:
            demand = decode_pod(args.pod)
        except WireError as exc:
            return encode_filter_result(args, [], {}, {}, f"pod not understood: {exc}")
        if not demand.containers:  # not a Carpool GPU pod: nothing for us to restrict
            return encode_filter_result(args, list(args.node_names), {}, {})
        if not demand.owner and not self.settings.serve_unowned:
            refusal = f"carpool: {unowned_refusal(demand.key)}"
            return encode_filter_result(args, [], {}, dict.fromkeys(args.node_names, refusal))
        checked = self.checked(demand)
        if isinstance(checked, Mismatch):
            reasons = dict.fromkeys(args.node_names, f"carpool: {checked.reason}")
            return encode_filter_result(args, [], {} if checked.final else reasons,
                                        reasons if checked.final else {})
        demand = checked
        policy = self._policy(demand)
        self.remember_pod(args.pod)
        self.ranker.set_supply(self.cache.supply())
        self.ranker.observe(demand)
        keep = self.settings.filter_best
        if keep and self.settings.bounded_search:
            best = self._best_bounded(args, demand, policy, keep)
            if best:
                self.nominations.nominate(demand.key, best[0], demand.gpu_counts,
                                          time.monotonic())
                return encode_filter_result(args, best, {}, {})
        snapshot = self.cache.snapshot(args.node_names, demand.key, self.clock())
        evaluations = self.ranker.evaluate_all(snapshot.states, demand, policy)
        counts = demand.gpu_counts
        placed = {name: e.score for name, e in evaluations.items() if e.score is not None}
        fits = list(placed)
        passed: list[str] = fits
        # fit, but a same-count pod is in flight or nominated there
        waiting = {name: f"carpool: {reason}"
                   for name, reason in self._held(snapshot.in_flight, demand).items()
                   if name in placed}
        if waiting:
            passed = [name for name in fits if name not in waiting]
        # The handshake rule is enforced at bind (under the cache lock); here it steers pods
        # to other nodes. When every fitting node has a hand-over in flight, keep them: bind
        # waits briefly for it, where a rejection would park the pod in the scheduler's
        # unschedulable queue for far longer.
        failed: dict[str, str] = {}
        if passed:
            failed.update(waiting)
        else:
            passed = [name for name in evaluations if name in waiting]
        if keep and passed:
            # Only the best few go on (the others fit, and are simply not passed: the
            # scheduler reads reasons only when no node is left, so none are sent). The
            # first is the one prioritize would favour, so it is nominated here, where with
            # one node left the scheduler will not call prioritize at all.
            passed = best_nodes(passed, placed, demand.key, keep)
            self.nominations.nominate(demand.key, passed[0], counts, time.monotonic())
            return encode_filter_result(args, passed, {}, {})
        unresolvable = {name: f"carpool: {reason}" for name, reason in snapshot.missing.items()}
        for name, evaluation in evaluations.items():
            if evaluation.score is None:
                (failed if evaluation.resolvable else unresolvable)[name] = (
                    f"carpool: {evaluation.reason}")
        if not passed and log.isEnabledFor(logging.INFO):
            why = Counter(r.split(";")[0].split("(")[0] for r in (*failed.values(),
                                                                  *unresolvable.values()))
            log.info("no node for %s: %s", demand.key, dict(why.most_common(3)))
        return encode_filter_result(args, passed, failed, unresolvable)

    def _held(self, in_flight: Mapping[str, Iterable[Hold]], demand: PodDemand
              ) -> dict[str, str]:
        """Nodes where another pod of one of `demand`'s GPU counts is being handed over or
        nominated, with why: filter steers the pod elsewhere while any other node fits (the
        handshake rule itself is enforced at bind)."""
        counts = demand.gpu_counts
        held = {}
        for name, holds in in_flight.items():
            clash = in_flight_clash(holds, counts)
            if clash is not None:
                held[name] = clash
        for name, reason in self.nominations.clashes(demand.key, counts, time.monotonic()):
            held.setdefault(name, reason)
        return held

    def _best_bounded(self, args: ExtenderArgs, demand: PodDemand, policy: str, keep: int
                      ) -> list[str] | None:
        """What `_filter` passes with `filter_best` when some node fits (the best of those
        where no other pod of its GPU count is in flight or nominated, else of those where
        one is), found by `Ranker.search`; None when none fits, and for pods of several
        containers: the full pass decides (and says why no node fits)."""
        if len(args.node_names) < SEARCH_SHARE * len(self.ranker.index.states):
            return None  # a sample (percentageOfNodesToScore): scoring it costs less
        view = self.cache.pod_view(demand.key, self.clock())
        excluded = self._held(view.in_flight, demand).keys()
        last, asked = self._last_names
        # (the scheduler often sends the same list again: `wire.ArgsReader` reuses it)
        if args.node_names is not last and args.node_names != last:
            asked = frozenset(args.node_names)
            self._last_names = (args.node_names, asked)
        # (tests per node the search reaches, a few: no set of every node made per request)
        found = self.ranker.search(self.cache, demand, policy, keep,
                                   lambda name: name in asked and name not in excluded,
                                   view.own)
        if not found and excluded:  # every fitting node waits for a hand-over: keep those
            found = self.ranker.search(self.cache, demand, policy, keep,
                                       lambda name: name in asked and name in excluded,
                                       view.own)
        if not found:
            return None
        return best_nodes(list(found), found, demand.key, keep)

    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        """HostPriorityList, 0..10; nodes where the pod does not fit score 0."""
        if not self.cache.synced(CACHE_KINDS):
            raise WireError(NOT_SYNCED)
        demand = decode_pod(args.pod)
        if not demand.containers:
            return encode_priorities({n: 0 for n in args.node_names})
        checked = self.checked(demand)
        if isinstance(checked, Mismatch):  # (filter refused it already)
            return encode_priorities({n: 0 for n in args.node_names})
        demand = checked
        policy = self._policy(demand)
        snapshot = self.cache.snapshot(args.node_names, demand.key, self.clock())
        evaluations = self.ranker.evaluate_all(snapshot.states, demand, policy)
        raw = {name: e.score for name, e in evaluations.items() if e.score is not None}
        scores = scale_scores(raw, args.node_names)
        best = [n for n, score in scores.items() if score == MAX_SCORE]
        if best:
            # One clear favourite, so the scheduler's pick is predictable and can be
            # nominated: filter then steers the next same-count pods elsewhere until this
            # pod's GPUs are reserved. Ties break as in `best_nodes`.
            top = best_nodes(best, raw, demand.key, 1)[0]
            for name in best:
                if name != top:
                    scores[name] = MAX_SCORE - 1
            self.nominations.nominate(demand.key, top, demand.gpu_counts, time.monotonic())
        return encode_priorities(scores)

    # --- bind ----------------------------------------------------------------------------
    #
    # Three steps, so the HTTP layer can run the quick in-memory ones on its event loop, in
    # arrival order with the filter calls, and only the API writes in a thread:
    #   plan     what the pod needs (from the copy the scheduler sent to filter, else a GET)
    #   reserve  choose GPUs and assume them in the cache, atomically (may ask to wait)
    #   commit   create the Binding with the assignment as annotations (conditional on the
    #            pod's resourceVersion); a conflict means our copy was stale: read and redo.

    def remember_pod(self, pod: Mapping[str, Any]) -> None:
        """Keep the pod the scheduler sent to filter, so bind can start without a GET."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if uid:
            with self._pods_lock:
                self._pods_seen[uid] = pod
                self._pods_seen.move_to_end(uid)
                while len(self._pods_seen) > MAX_REMEMBERED_PODS:
                    self._pods_seen.popitem(last=False)

    def recalled_pod(self, args: BindingArgs) -> Mapping[str, Any] | None:
        with self._pods_lock:
            pod = self._pods_seen.pop(args.pod_uid, None) if args.pod_uid else None
        meta = (pod or {}).get("metadata") or {}
        if pod is None or meta.get("name") != args.pod_name or meta.get(
                "namespace", "default") != args.pod_namespace:
            return None
        return pod

    def fetch_pod(self, args: BindingArgs) -> Mapping[str, Any] | Refused:
        """The live pod, or why there is none."""
        try:
            return self.cluster.get_pod(args.pod_namespace, args.pod_name)
        except ClusterError as exc:
            if exc.status == 404:
                return Refused(f"pod {args.key} no longer exists")
            return Refused(f"API server: {exc}")

    def plan_bind(self, args: BindingArgs, pod: Mapping[str, Any], fresh: bool
                  ) -> BindPlan | AlreadyBound | Refused:
        """What binding this pod takes, or that it is done (a retry after a bind that
        succeeded), or why it cannot be."""
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if args.pod_uid and uid != args.pod_uid:
            return Refused(f"pod {args.key} was replaced (uid {uid}, expected {args.pod_uid})")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to == args.node:
            return AlreadyBound()
        if bound_to:
            return Refused(f"pod {args.key} is already bound to {bound_to}")
        try:
            demand = decode_pod(pod)
        except WireError as exc:
            return Refused(f"pod {args.key} not understood: {exc}")
        if demand.containers and not demand.owner and not self.settings.serve_unowned:
            return Refused(unowned_refusal(args.key))
        if demand.containers:
            checked = self.checked(demand)
            if isinstance(checked, Mismatch):
                return Refused(checked.reason)
            demand = checked
        previous = self._previous_assignment(pod, args.node)
        if previous is None:  # a gang worker: the GPUs its gang's admission chose, if free
            planned = planned_assignment(pod)
            previous = planned if planned is not None and planned.node == args.node else None
        return BindPlan(args, demand, uid, str(meta.get("resourceVersion") or ""),
                        previous, self._policy(demand), fresh)

    def reserve(self, plan: BindPlan) -> Assignment | Refused | InFlightClash:
        """Choose the GPUs on the node and assume them; `InFlightClash` means: wait, retry."""
        if not plan.demand.containers:
            return Assignment(plan.args.node, ())
        demand, previous = plan.demand, plan.previous
        exclusive = any(c.request.isolation is Isolation.EXCLUSIVE for c in demand.containers)

        def choose(state: NodeState) -> tuple[Assignment, tuple[GpuGrant, ...]] | Refused:
            if previous is not None:  # a retry: keep what an earlier attempt recorded
                totals = {g.uuid: g.memory_total_mib for g in state.inventory.gpus}
                grants = previous.grants(exclusive, totals)
                if fits_exactly(state, grants):
                    return previous, grants
            evaluation = self.ranker.evaluate(state, demand, plan.policy)
            if evaluation.placement is None:
                return Refused(evaluation.reason)
            return (assignment_of(state, demand, evaluation.placement),
                    evaluation.placement.grants)

        now = self.clock()
        self.cache.expire_assumed(now)
        reserved = self.cache.reserve(demand.key, plan.uid, plan.args.node, demand.gpu_counts,
                                      now, choose, demand.cpu_milli, demand.memory_mib)
        if isinstance(reserved, InFlightClash):
            return reserved  # still nominated: other pods keep away while this one waits
        self.nominations.clear(demand.key)
        if isinstance(reserved, Refused):
            return Refused(f"cannot place {plan.args.key} on {plan.args.node}: {reserved.reason}")
        return reserved

    def commit_bind(self, plan: BindPlan, assignment: Assignment) -> BindOutcome:
        """Create the Binding, carrying the assignment annotations: one atomic write.

        The API server copies a Binding's annotations onto the pod as it sets its node, so the
        pod is never bound without its assignment, nor annotated without being bound. The
        Binding is conditional on the pod's uid and resourceVersion: `Stale` means our copy
        (the scheduler's) was out of date and the caller should read the pod and plan again.
        """
        args = plan.args
        started = time.monotonic()
        try:
            self.cluster.bind_pod(args.pod_namespace, args.pod_name, plan.uid, args.node,
                                  self._annotations(plan, assignment), plan.resource_version)
        except ClusterError as exc:
            refused = self._bind_failed(plan, exc)
            if refused is not None:
                return refused
            return self._after_conflict(plan, exc, self._bound_to(args))
        self._bound(plan, started)
        return Bound()

    async def commit_bind_async(self, plan: BindPlan, assignment: Assignment,
                                run_blocking: RunBlocking) -> BindOutcome:
        """`commit_bind`, on the event loop when the cluster port can bind asynchronously
        (the Kubernetes adapter can), else in `run_blocking`."""
        bind_async = getattr(self.cluster, "bind_pod_async", None)
        if bind_async is None:
            result: BindOutcome = await run_blocking(self.commit_bind, plan, assignment)
            return result
        args = plan.args
        started = time.monotonic()
        try:
            await bind_async(args.pod_namespace, args.pod_name, plan.uid, args.node,
                             self._annotations(plan, assignment), plan.resource_version)
        except ClusterError as exc:
            refused = self._bind_failed(plan, exc)
            if refused is not None:
                return refused
            return self._after_conflict(plan, exc, await run_blocking(self._bound_to, args))
        self._bound(plan, started)
        return Bound()

    def _annotations(self, plan: BindPlan, assignment: Assignment) -> dict[str, str]:
        if not plan.demand.containers:
            return {}
        return {names.ANN_ASSIGNMENT: encode_assignment(assignment),
                names.ANN_ASSIGNED_AT: format_timestamp_micro(self.clock())}

    def _bind_failed(self, plan: BindPlan, exc: ClusterError) -> Refused | None:
        """The error, or None when a conflict needs the pod read first.

        Only a refusal (4xx) proves the Binding was not written, so only then do the GPUs go
        back at once. After a timeout, a lost connection or a 5xx the write may still have
        been applied (etcd can commit a request that timed out): giving the GPUs back then
        let the next pod take the same ones while this pod was in fact bound there (seen
        after an etcd restart under load). So they stay assumed until the watch shows where
        the pod went, its next bind replaces them, or the assumption expires.
        """
        if exc.status == 409:
            return None
        if 400 <= exc.status < 500:
            self.cache.forget(plan.demand.key, plan.uid)
        return Refused(f"creating the Binding failed: {exc}")

    def _after_conflict(self, plan: BindPlan, exc: ClusterError, bound_to: str | None
                        ) -> BindOutcome:
        if bound_to == plan.args.node:
            return Bound()  # an earlier attempt bound it; the watch brings its assignment
        self.cache.forget(plan.demand.key, plan.uid)
        if bound_to is None and not plan.fresh:
            return Stale()
        return Refused(f"creating the Binding failed: {exc}")

    @staticmethod
    def _bound(plan: BindPlan, started: float) -> None:
        took = time.monotonic() - started
        if took > SLOW_COMMIT_S:
            log.info("binding %s to %s took %.2fs", plan.args.key, plan.args.node, took)

    async def bind_async(self, args: BindingArgs, run_blocking: RunBlocking
                         ) -> dict[str, str]:
        """ExtenderBindingResult. The in-memory steps run here, on the caller's event loop;
        the Binding too when the cluster port binds asynchronously, other API calls through
        `run_blocking` (a thread pool in the server)."""
        pod = self.recalled_pod(args)
        fresh = pod is None
        while True:
            if pod is None:
                fetched = await run_blocking(self.fetch_pod, args)
                if isinstance(fetched, Refused):
                    return {"Error": fetched.reason}
                pod, fresh = fetched, True
            plan = self.plan_bind(args, pod, fresh)
            if isinstance(plan, AlreadyBound):
                return {"Error": ""}
            if isinstance(plan, Refused):
                return {"Error": plan.reason}
            waiting = await self._gang_complete(pod, plan.demand)
            if waiting:
                return {"Error": waiting}
            reserved = self.reserve(plan)
            if isinstance(reserved, InFlightClash):
                log.info("bind of %s to %s waits (nominated %s): %s", args.key, args.node,
                         self.nominations.describe(args.key), reserved.reason)
            # The scheduler chose this node before an earlier pod's bind to it showed up as in
            # flight: rather than fail (and have the pod backed off), wait for the hand-over.
            deadline = time.monotonic() + self.settings.bind_wait_s
            while isinstance(reserved, InFlightClash) and time.monotonic() < deadline:
                await asyncio.sleep(BIND_POLL_S)
                reserved = self.reserve(plan)
            if isinstance(reserved, InFlightClash):  # waited long enough
                reserved = Refused(reserved.reason)
            if isinstance(reserved, Refused):
                self.nominations.clear(plan.demand.key)
                return {"Error": reserved.reason}
            result = await self.commit_bind_async(plan, reserved, run_blocking)
            if isinstance(result, Stale):
                pod = None
                continue
            if isinstance(result, Bound):
                return {"Error": ""}
            if self._still_assumed(plan):  # the Binding may have been written
                task = asyncio.get_running_loop().create_task(
                    self._follow_ambiguous(plan, run_blocking))
                self._followers.add(task)
                task.add_done_callback(self._followers.discard)
            return {"Error": result.reason}

    async def _gang_complete(self, pod: Mapping[str, Any], demand: PodDemand) -> str:
        """For a gang's worker: wait (up to the bind wait) until its GpuJob records that
        every worker of its attempt exists (status.gangCreated, written by the operator), so
        that no worker starts while another was never created (the operator creates them one
        after another; an API error can leave one out, and it then stops the gang whole).
        Why it is not bound yet, or "" to go on."""
        attempt = gang_attempt(pod)
        if attempt is None or demand.owner is None:
            return ""
        owner = demand.owner
        deadline = time.monotonic() + self.settings.bind_wait_s
        while (self.cache.gang_created(demand.namespace, owner) < attempt
               and time.monotonic() < deadline):
            await asyncio.sleep(BIND_POLL_S)
        if self.cache.gang_created(demand.namespace, owner) >= attempt:
            return ""
        return (f"gang {demand.namespace}/{owner.name} attempt {attempt}: not every worker "
                f"exists yet (its status.gangCreated); no worker is bound before all do")

    def _still_assumed(self, plan: BindPlan) -> bool:
        hold = self.cache.hold_of(plan.demand.key)
        return hold is not None and hold.assumed and hold.uid == plan.uid

    async def _follow_ambiguous(self, plan: BindPlan, run_blocking: RunBlocking) -> None:
        """Give back the GPUs of a pod whose Binding may or may not have been written, once
        the pod is gone.

        They stay assumed until the watch shows the pod bound, a retry replaces them, or the
        assumption expires (minutes). The watch sees only bound pods, so a pod deleted while
        still unbound would hold them until then: only reading the pod can tell.
        """
        key, uid, args = plan.demand.key, plan.uid, plan.args
        while True:
            await asyncio.sleep(self.settings.ambiguous_recheck_s)
            if not self._still_assumed(plan):
                return  # the watch confirmed it, a retry replaced it, or it expired
            try:
                pod = await run_blocking(self.cluster.get_pod, args.pod_namespace,
                                         args.pod_name)
            except ClusterError as exc:
                if exc.status != 404:
                    continue  # the API server is in trouble: look again later
                pod = None
            if pod is None or str((pod.get("metadata") or {}).get("uid") or "") != uid:
                log.info("%s is gone after an unconfirmed bind; its GPUs on %s are free again",
                         args.key, args.node)
                self.cache.forget(key, uid)
                return

    def bind(self, args: BindingArgs) -> dict[str, str]:
        """`bind_async` for callers without an event loop (tests, tools)."""

        async def inline(fn: Callable[..., T], *fn_args: Any) -> T:
            return fn(*fn_args)

        return asyncio.run(self.bind_async(args, inline))

    @staticmethod
    def _previous_assignment(pod: Mapping[str, Any], node: str) -> Assignment | None:
        """An assignment an earlier attempt recorded for this node (reused on retry)."""
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANN_ASSIGNMENT)
        if not text:
            return None
        try:
            assignment = parse_assignment(str(text))
        except AssignmentError:
            return None
        return assignment if assignment.node == node else None

    def _bound_to(self, args: BindingArgs) -> str | None:
        try:
            pod = self.cluster.get_pod(args.pod_namespace, args.pod_name)
        except ClusterError:
            return None
        return (pod.get("spec") or {}).get("nodeName")
