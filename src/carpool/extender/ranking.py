"""Where a pod's GPUs go on one node, and how good that node is: the extender's one seam to
the placement core.

Filter, prioritize and bind all go through `place`, so the GPUs bind records are the ones
prioritize scored. Fit is `placement.node_rejection` (its reasons are what users read);
the score and the GPU choice are `scoring.score_node` — the same code the placement
benchmark replays — with fragmentation measured against the workload this extender has
actually seen (`WorkloadTracker`).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from carpool.core.placement import GpuFree, NodeState, gpu_rejection, grant_for, node_rejection
from carpool.core.resources import GpuGrant, GpuRequest, NodeInventory
from carpool.core.scoring import CARPOOL, Dataset, Scorer, ScoringPolicy, Strategy, score_node
from carpool.core.workload import Demand, TargetWorkload
from carpool.extender.wire import PodDemand, Policy

MAX_SCORE = 10  # the extender API's MaxExtenderPriority
MAX_MEMO_ENTRIES = 100_000  # then start afresh (entries hold replaced node states alive)
WORKLOAD_WINDOW = 5_000  # pods remembered for the target workload
WORKLOAD_FIRST = 200  # pods seen before the first target workload is built
WORKLOAD_REFRESH = 2_000  # further pods between checks whether it has drifted
WORKLOAD_TOLERANCE = 0.1  # a shape's share must move this much to rebuild (costly: see Ranker)


@dataclass(frozen=True)
class Placement:
    """GPUs chosen on one node, per container (in container order), and the node's score."""

    node: str
    per_container: tuple[tuple[GpuGrant, ...], ...]
    score: float  # in [0, 1]; mean over containers

    @property
    def grants(self) -> tuple[GpuGrant, ...]:
        return tuple(g for grants in self.per_container for g in grants)


def _fallback_choice(frees: Sequence[GpuFree], request: GpuRequest
                     ) -> tuple[GpuGrant, ...] | None:
    """Tightest-fitting GPUs by index, for requests scoring cannot plan (MIG instances)."""
    usable = [f for f in frees if gpu_rejection(f, request) is None]
    if len(usable) < request.count:
        return None
    usable.sort(key=lambda f: (f.memory_mib - request.memory_mib, f.cores_pct, f.gpu.index))
    return tuple(grant_for(f, request) for f in usable[: request.count])


def _scored_choice(state: NodeState, request: GpuRequest, scorer: Scorer,
                   dataset: Dataset | None) -> tuple[tuple[GpuGrant, ...], float] | None:
    """The scorer's GPUs for one container, checked against the filter's own GPU rules."""
    try:
        scored = score_node(state, request, scorer, dataset=dataset)
    except AssertionError:  # the scorer's plan could not be mapped onto distinct GPUs
        return None
    if scored is None or len(set(scored.gpu_indices)) != request.count:
        return None
    frees = {f.gpu.index: f for f in state.free()}
    grants = []
    for index in scored.gpu_indices:
        free = frees.get(index)
        if free is None or gpu_rejection(free, request) is not None:
            return None
        grants.append(grant_for(free, request))
    return tuple(grants), scored.score


def place(state: NodeState, demand: PodDemand, scorer: Scorer) -> Placement | str:
    """GPUs for every container of `demand` on this node, or the reason it does not fit."""
    dataset = (Dataset(demand.dataset, demand.dataset_size_gib) if demand.dataset else None)
    chosen: list[tuple[GpuGrant, ...]] = []
    total = 0.0
    for container in demand.containers:
        request = container.request
        reason = node_rejection(state, request)
        if reason is not None:
            return reason
        scored = _scored_choice(state, request, scorer, dataset)
        if scored is None:
            grants = _fallback_choice(state.free(), request)
            if grants is None:  # node_rejection said it fits; kept for safety
                return "no GPUs fit"
            score = 0.0
        else:
            grants, score = scored
        chosen.append(grants)
        total += score
        state = state.with_grants(grants)
    return Placement(state.name, tuple(chosen), total / max(1, len(chosen)))


def scale_scores(raw: Mapping[str, float], nodes: Sequence[str]) -> dict[str, int]:
    """Raw scores → 0..10 by min–max over the candidates, so the best node always gets 10.

    The extender's scores are added to kube-scheduler's own (CPU/memory) scores; stretching
    them over the full range keeps our ordering decisive. Equal raw scores give equal ints.
    """
    values = [raw[n] for n in nodes if n in raw]
    if not values:
        return {n: 0 for n in nodes}
    low, high = min(values), max(values)
    out = {}
    for n in nodes:
        if n not in raw:
            out[n] = 0
        elif high - low < 1e-12:
            out[n] = MAX_SCORE
        else:
            out[n] = round(MAX_SCORE * (raw[n] - low) / (high - low))
    return out


class WorkloadTracker:
    """The demand shapes recently seen, as FGD's target workload (most frequent 95 %)."""

    def __init__(self, window: int = WORKLOAD_WINDOW, first: int = WORKLOAD_FIRST,
                 refresh: int = WORKLOAD_REFRESH) -> None:
        self._recent: deque[Demand] = deque(maxlen=window)
        self._seen: deque[str] = deque(maxlen=window)
        self._seen_set: set[str] = set()
        self._since_refresh = 0
        self._first = first
        self._refresh = refresh
        self._built = False
        self._lock = threading.Lock()

    def observe(self, uid: str, demands: Sequence[Demand]) -> bool:
        """Record a pod's demands once; True when the target workload should be rebuilt."""
        with self._lock:
            if uid in self._seen_set:
                return False
            if len(self._seen) == self._seen.maxlen:
                self._seen_set.discard(self._seen[0])
            self._seen.append(uid)
            self._seen_set.add(uid)
            self._recent.extend(demands)
            self._since_refresh += 1
            due = self._since_refresh >= (self._refresh if self._built else self._first)
            if due:
                self._since_refresh = 0
                self._built = True
            return due

    def workload(self) -> TargetWorkload:
        with self._lock:
            return TargetWorkload.from_demands(Counter(self._recent).elements())


def materially_different(old: TargetWorkload, new: TargetWorkload,
                         tolerance: float = WORKLOAD_TOLERANCE) -> bool:
    """True if the shapes differ or a probability moved by more than `tolerance`.

    Rebuilding the scorers throws away every memoised evaluation, so small drifts wait.
    """
    old_p, new_p = dict(old.shapes), dict(new.shapes)
    if old_p.keys() != new_p.keys():
        return True
    return any(abs(old_p[d] - new_p[d]) > tolerance for d in old_p)


@dataclass(frozen=True)
class Evaluation:
    """One node judged for one pod."""

    placement: Placement | None
    reason: str = ""  # why it does not fit, when placement is None


DemandShape = tuple[object, ...]


class Ranker:
    """`place`, memoised per (scorer generation, demand shape, policy, node state).

    The cache hands out the same NodeState object for a node until something on it changes,
    so the scheduler's filter and prioritize for one pod, and every later pod of the same
    shape, reuse each unchanged node's evaluation: a scheduling cycle costs real work only
    for the nodes that changed since. Safe to share between threads (a lost race recomputes).
    """

    def __init__(self, policy: ScoringPolicy = CARPOOL, learn_workload: bool = True) -> None:
        self.policy = policy
        self._workload = TargetWorkload()
        self._scorers = self._make_scorers()
        self._generation = 0
        self._tracker = WorkloadTracker() if learn_workload else None
        self._memo: dict[DemandShape, dict[int, tuple[NodeState, Evaluation]]] = {}
        self._empty: dict[DemandShape, dict[int, tuple[NodeInventory, bool]]] = {}
        self._entries = 0
        self.hits = 0
        self.misses = 0
        self.workload_rebuilds = 0

    def _make_scorers(self) -> dict[str, Scorer]:
        return {p: Scorer(replace(self.policy, strategy=Strategy(p)), self._workload)
                for p in Policy.ALL}

    def observe(self, demand: PodDemand) -> None:
        """Learn the workload from the pods the scheduler asks about."""
        if self._tracker is None:
            return
        demands = [Demand.from_request(c.request) for c in demand.containers]
        if self._tracker.observe(demand.uid or demand.key, demands):
            workload = self._tracker.workload()
            if materially_different(self._workload, workload):
                self._workload = workload
                self._scorers = self._make_scorers()
                self._generation += 1
                self._memo.clear()
                self.workload_rebuilds += 1

    def _shape(self, demand: PodDemand, policy: str) -> DemandShape:
        return (self._generation, demand.containers, demand.dataset, demand.dataset_size_gib,
                policy)

    def _room(self) -> None:
        self._entries += 1
        if self._entries > MAX_MEMO_ENTRIES:
            self._memo.clear()
            self._empty.clear()
            self._entries = 0

    def place(self, state: NodeState, demand: PodDemand, policy: str) -> Placement | str:
        return place(state, demand, self._scorers[policy])

    def evaluate_all(self, states: Mapping[str, NodeState], demand: PodDemand,
                     policy: str) -> dict[str, Evaluation]:
        shape = self._shape(demand, policy)
        scorer = self._scorers[policy]
        memo = self._memo.setdefault(shape, {})
        out = {}
        hits = 0
        for name, state in states.items():
            entry = memo.get(id(state))
            if entry is not None and entry[0] is state:
                out[name] = entry[1]
                hits += 1
                continue
            placement = place(state, demand, scorer)
            evaluation = out[name] = (Evaluation(None, placement) if isinstance(placement, str)
                                      else Evaluation(placement))
            self._room()
            memo[id(state)] = (state, evaluation)
        self.hits += hits
        self.misses += len(states) - hits
        return out

    def evaluate(self, state: NodeState, demand: PodDemand, policy: str) -> Evaluation:
        return self.evaluate_all({state.name: state}, demand, policy)[state.name]

    def fits_when_empty(self, inventory: NodeInventory, demand: PodDemand, policy: str) -> bool:
        """Whether the pod fits the node with nothing else on it (else preemption is futile)."""
        memo = self._empty.setdefault(self._shape(demand, policy), {})
        entry = memo.get(id(inventory))
        if entry is not None and entry[0] is inventory:
            return entry[1]
        fits = all(node_rejection(NodeState(inventory), c.request) is None
                   for c in demand.containers)
        self._room()
        memo[id(inventory)] = (inventory, fits)
        return fits
