"""Where a pod's GPUs go on one node, and how good that node is: the extender's one seam to
the placement core.

Filter, prioritize and bind all go through `ShapePlacer` (one per demand shape), so the GPUs
bind records are the ones filter and prioritize scored. The GPU choice and the score are
`gpu_choice.choose_gpus`'s (the operator's timeline uses the same), through the per-request
`scoring.RequestScorer` (the plans are `Scorer.plan`, the code the placement benchmark
replays), with fragmentation measured against the workload this extender has actually seen
(`WorkloadTracker`); where a node does not fit, `placement.node_rejection` says why (its
reasons are what users read).
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from carpool.core.gpu_choice import NoFit, choose_gpus, grants_for
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, GpuRequest, Isolation
from carpool.core.scoring import (
    CARPOOL,
    Dataset,
    GpuSlot,
    NodeProfile,
    RequestScorer,
    Scorer,
    ScoringPolicy,
    Strategy,
)
from carpool.core.workload import Demand, TargetWorkload
from carpool.extender.states import CachedState
from carpool.extender.wire import PodDemand, Policy

MAX_SCORE = 10  # the extender API's MaxExtenderPriority
MAX_MEMO_ENTRIES = 200_000  # evaluations kept (least recently used shapes go first)
WARM_SHAPES = 32  # the warmer keeps this many recent shapes evaluated on every node
SUPPLY_TOLERANCE = 0.05  # a model's GPU count must move this much to rebuild the scorers
WORKLOAD_WINDOW = 5_000  # pods remembered for the target workload
WORKLOAD_FIRST = 200  # pods seen before the first target workload is built
WORKLOAD_REFRESH = 2_000  # further pods between checks whether it has drifted
WORKLOAD_TOLERANCE = 0.1  # a shape's share must move this much to rebuild (costly: see Ranker)


@dataclass(frozen=True)
class Misfit:
    """Why a pod does not fit a node: the reason filter reports for it."""

    reason: str


class Placement:
    """GPUs chosen on one node, per container (in container order), and the node's score.

    Filter and prioritize need only the score, and every new demand shape is placed on every
    candidate node, so the last container's grants are built from the scorer's GPU indices
    only when someone asks (bind, for the one node it binds to).
    """

    __slots__ = ("_done", "_indices", "_request", "_state", "node", "score")

    def __init__(self, node: str, per_container: tuple[tuple[GpuGrant, ...], ...],
                 score: float, state: NodeState | None = None,
                 request: GpuRequest | None = None, indices: tuple[int, ...] = ()) -> None:
        """`state`, `request` and `indices`, when given: the last container's GPUs, as the
        scorer's indices on that state, to be turned into grants when asked for."""
        self.node = node
        self.score = score  # in [0, 1]; mean over containers
        self._done = per_container
        self._state = state
        self._request = request
        self._indices = indices

    @property
    def per_container(self) -> tuple[tuple[GpuGrant, ...], ...]:
        if self._state is not None and self._request is not None:
            grants = grants_for(CachedState.of(self._state), self._request, self._indices)
            self._done = (*self._done, grants)
            self._state = self._request = None
        return self._done

    @property
    def grants(self) -> tuple[GpuGrant, ...]:
        return tuple(g for grants in self.per_container for g in grants)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and (self.node, self.score, self.per_container) == (
            other.node, other.score, other.per_container)

    def __hash__(self) -> int:
        return hash((self.node, self.score))

    def __repr__(self) -> str:
        return f"Placement({self.node!r}, {self.per_container!r}, {self.score!r})"


class ShapePlacer:
    """`place` for one demand shape under one scorer, with the scorers' per-request work done
    once: a new shape is placed on every candidate node, so only the per-node part should be
    paid a thousand times (`evaluate` has a short path for the usual one-container pod)."""

    __slots__ = ("_requests", "_scorers", "_single", "demand")

    def __init__(self, demand: PodDemand, scorer: Scorer) -> None:
        self.demand = demand
        dataset = (Dataset(demand.dataset, demand.dataset_size_gib) if demand.dataset else None)
        # The pod's CPU and memory requests go with its first GPU container (see `place`).
        self._scorers = tuple(
            RequestScorer(c.request, scorer, cpu_milli=demand.cpu_milli if i == 0 else 0,
                          memory_mib=demand.memory_mib if i == 0 else 0, dataset=dataset)
            for i, c in enumerate(demand.containers))
        self._single = demand.containers[0].request if len(demand.containers) == 1 else None
        self._requests = tuple(c.request for c in demand.containers)

    @property
    def single(self) -> RequestScorer | None:
        """The scorer of a one-container demand (None for several containers)."""
        return self._scorers[0] if self._single is not None else None

    def place(self, state: NodeState) -> Placement | Misfit:
        """GPUs for every container on this node, or the reason it does not fit.

        The pod's CPU and memory requests go with its first GPU container (the node gives
        them once per pod), so the scorer's CPU-balance term sees them; kube-scheduler's own
        filter enforces them, so a node short of CPU only loses its score here, not its fit.
        """
        demand = self.demand
        state = CachedState.of(state)
        chosen: list[tuple[GpuGrant, ...]] = []
        total = 0.0
        inventory = state.inventory
        cpu_milli, memory_mib = demand.cpu_milli, demand.memory_mib
        for container, scorer in zip(demand.containers, self._scorers, strict=True):
            request = container.request
            choice = choose_gpus(state, scorer)
            if isinstance(choice, NoFit):
                return Misfit(choice.reason)
            score, indices = choice
            if len(chosen) + 1 == len(demand.containers):  # grants when asked for (Placement)
                return Placement(state.name, tuple(chosen), (total + score) / (len(chosen) + 1),
                                 state, request, indices)
            grants = grants_for(state, request, indices)
            chosen.append(grants)
            total += score
            # the next container sees this one's GPUs
            state = CachedState(inventory, state.grants + grants,
                                state.cpu_used_milli + cpu_milli,
                                state.memory_used_mib + memory_mib)
            cpu_milli = memory_mib = 0
        return Placement(state.name, tuple(chosen), total / max(1, len(chosen)))

    def evaluate(self, state: NodeState) -> Evaluation:
        """`place`'s answer as an Evaluation."""
        request = self._single
        if request is None:
            placement = self.place(state)
            if isinstance(placement, Misfit):
                return Evaluation(state, None, reason=placement.reason, requests=self._requests)
            return Evaluation(state, placement.score, placement=placement)
        # `place` for one container, written out: this runs on every node
        choice = choose_gpus(CachedState.of(state), self._scorers[0])
        if isinstance(choice, NoFit):
            return Evaluation(state, None, reason=choice, requests=self._requests)
        return Evaluation(state, choice[0], request, choice[1])


def place(state: NodeState, demand: PodDemand, scorer: Scorer) -> Placement | Misfit:
    """GPUs for every container of `demand` on this node, or the reason it does not fit
    (see `ShapePlacer.place`)."""
    return ShapePlacer(demand, scorer).place(state)


def scale_scores(raw: Mapping[str, float], nodes: Sequence[str]) -> dict[str, int]:
    """Raw scores → 0..10 by min–max over the candidates, so the best node always gets 10.

    The extender's scores are added to kube-scheduler's own (CPU/memory) scores; stretching
    them over the full range keeps our ordering decisive. Equal raw scores give equal ints.
    """
    out = dict.fromkeys(nodes, 0)  # in the order given; raw's keys update in place
    # (usually every candidate was placed: then raw is already the map wanted)
    known = raw if raw.keys() == out.keys() else {n: raw[n] for n in out if n in raw}
    if not known:
        return out
    low, high = min(known.values()), max(known.values())
    span = high - low
    if span < 1e-12:
        out.update(dict.fromkeys(known, MAX_SCORE))
    else:
        out.update({n: round(MAX_SCORE * (score - low) / span) for n, score in known.items()})
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


class Evaluation:
    """One node judged for one pod, on one state of the node (`state`): its score (None if
    the pod does not fit) and GPUs, or why it does not fit.

    The memo keeps one per node and demand shape, tens of thousands, so this is a single
    object: the fewer objects, the cheaper each collection. Filter and prioritize read only
    the score; the `Placement` is made when someone asks (bind, for the node it binds to).
    """

    __slots__ = ("_indices", "_placement", "_request", "_requests", "_why", "score", "state")

    def __init__(self, state: NodeState, score: float | None,
                 request: GpuRequest | None = None, indices: tuple[int, ...] = (), *,
                 placement: Placement | None = None, reason: str | NoFit = "",
                 requests: tuple[GpuRequest, ...] = ()) -> None:
        """A fit is `score` with either the one container's `request` and GPU `indices`, or
        a whole `placement`; a misfit is score None, the `reason` and the pod's `requests`."""
        self.state = state
        self.score = score
        self._request = request
        self._indices = indices
        self._placement = placement
        self._why = reason  # why it does not fit, when score is None
        self._requests = requests

    @property
    def placement(self) -> Placement | None:
        if self._placement is None and self._request is not None and self.score is not None:
            self._placement = Placement(self.state.name, (), self.score, self.state,
                                        self._request, self._indices)
        return self._placement

    @property
    def reason(self) -> str:
        """Why the pod does not fit, when score is None (worked out when first asked)."""
        why = self._why
        if isinstance(why, NoFit):
            why = self._why = why.reason
        return why

    @property
    def resolvable(self) -> bool:
        """Whether the pod would fit the node with nothing on it (worked out only when
        filter reports reasons: most misfits are never asked)."""
        state = CachedState.of(self.state)
        return all(state.fits_empty(r) for r in self._requests)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Evaluation) and (
            (self.placement, self.reason, self._requests)
            == (other.placement, other.reason, other._requests))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Evaluation({self.state.name!r}, {self.placement!r}, {self.reason!r})"


DemandShape = tuple[object, ...]
NO_PLAN = -1.0  # a group's plan score when the profile cannot hold the demand
EACH_NODE = -2.0  # ... when the fit rules may overrule the plan: every node is scored
# A ceiling and the score it bounds may sum the same terms in another order: nodes whose
# ceiling is this close below the best score are scored too (they may tie with it)
CEILING_SLACK = 1e-9
Order = list[tuple[float, str]]  # (minus a ceiling's temperature term, node name), sorted
GroupReading = tuple[float, Order]  # what `Ranker.search` reads of a group for a shape
NO_NODE: GroupReading = (NO_PLAN, [])  # ... where no node of it fits


class NodeSource(Protocol):
    """Where the warmer reads nodes from (the extender's cache)."""

    def node_names(self) -> list[str]: ...

    def state_of(self, node: str) -> NodeState | None: ...

    def drain_changed(self) -> set[str]: ...


class IndexSource(Protocol):
    """Where the node index reads changed nodes from (the extender's cache)."""

    def changes_since(self, position: int | None
                      ) -> tuple[dict[str, NodeState | None], int, bool]: ...


OrderKey = tuple[GpuSlot | None, int]  # (slot, how many GPUs of it); None: of any slot


def coolest(state: CachedState, key: OrderKey) -> float:
    """The mean temperature term of the node's `m` coolest usable GPUs of `slot` (of any
    slot where None): what `scoring.gpus_for` gives a plan of `m` GPUs of that slot, at
    least what any `m` GPUs of it (or, None, any `m` GPUs) give. 1 (the most) where the
    node has fewer."""
    slot, m = key
    by_slot = state.shared_gpus
    if slot is not None:
        terms = [g.temperature for g in by_slot.get(slot, ())]
    else:
        terms = sorted((g.temperature for gpus in by_slot.values() for g in gpus), reverse=True)
    if len(terms) < m:
        return 1.0
    return sum(terms[:m]) / m


class NodeGroup:
    """Nodes a one-container demand scores alike but for their GPUs' temperatures and
    datasets: one profile (so one `Scorer.plan`), sharing modes and readiness, and whether
    the fit rules may overrule the profile's view (`scoring.doubtful_gpus`, per isolation).
    Its members are kept in orders by `coolest`, made when a search first asks for one."""

    __slots__ = ("doubtful_mps", "doubtful_other", "key", "members", "orders", "profile",
                 "ready", "sharing")

    def __init__(self, key: tuple[object, ...], state: CachedState) -> None:
        self.key = key
        self.profile: NodeProfile = state.profile
        self.sharing = state.inventory.sharing
        self.ready = state.inventory.ready
        self.doubtful_mps = bool(state.doubtful_gpus(Isolation.MPS))
        self.doubtful_other = bool(state.doubtful_gpus(Isolation.TIMESLICE))
        self.members: dict[str, CachedState] = {}
        # per order key: (minus `coolest`, node name), sorted: coolest first
        self.orders: dict[OrderKey, list[tuple[float, str]]] = {}

    def order(self, key: OrderKey) -> list[tuple[float, str]]:
        found = self.orders.get(key)
        if found is None:
            found = self.orders[key] = sorted(
                (-coolest(state, key), name) for name, state in self.members.items())
        return found

    def add(self, name: str, state: CachedState) -> None:
        self.members[name] = state
        for key, order in self.orders.items():
            bisect.insort(order, (-coolest(state, key), name))

    def remove(self, name: str) -> None:
        state = self.members.pop(name)
        for key, order in self.orders.items():
            order.pop(bisect.bisect_left(order, (-coolest(state, key), name)))


def group_key(state: CachedState) -> tuple[object, ...]:
    return (state.profile, state.inventory.sharing, state.inventory.ready,
            bool(state.doubtful_gpus(Isolation.MPS)),
            bool(state.doubtful_gpus(Isolation.TIMESLICE)))


class NodeIndex:
    """Every known node's current state, in groups (`NodeGroup`); kept current from the
    cache's change log, so a request pays for the nodes that changed since the last one,
    not for every node (`Ranker.search`)."""

    def __init__(self) -> None:
        self.states: dict[str, CachedState] = {}
        self.groups: dict[tuple[object, ...], NodeGroup] = {}
        self._group_of: dict[str, NodeGroup] = {}
        self._position: int | None = None
        self.lock = threading.Lock()  # held by `Ranker.search` from sync to answer

    def sync(self, source: IndexSource) -> None:
        states, self._position, complete = source.changes_since(self._position)
        if complete:
            for name in [n for n in self.states if n not in states]:
                self._remove(name)
        for name, state in states.items():
            if state is None:
                self._remove(name)
            elif self.states.get(name) is not state:
                self._remove(name)
                self._add(name, CachedState.of(state))

    def _add(self, name: str, state: CachedState) -> None:
        key = group_key(state)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = NodeGroup(key, state)
        group.add(name, state)
        self.states[name] = state
        self._group_of[name] = group

    def _remove(self, name: str) -> None:
        group = self._group_of.pop(name, None)
        if group is None:
            return
        del self.states[name]
        group.remove(name)
        if not group.members:
            del self.groups[group.key]


class _Generation:
    """Scorers for one target workload and GPU supply, with their memoised evaluations:
    per demand shape (most recently used last), per node name, the state it was made on."""

    def __init__(self, policy: ScoringPolicy, workload: TargetWorkload,
                 supply: Mapping[str, int]) -> None:
        self.workload = workload
        self.supply = dict(supply)
        self.scorers = {p: Scorer(replace(policy, strategy=Strategy(p)), workload, supply)
                        for p in Policy.ALL}
        self.memo: OrderedDict[DemandShape, dict[str, Evaluation]] = (
            OrderedDict())
        self.placers: dict[DemandShape, ShapePlacer] = {}  # per shape in `memo`
        # per shape in `memo`, per node group: the plan's score (`Ranker.search`)
        self.plan_scores: dict[DemandShape, dict[NodeGroup, GroupReading]] = {}

    def placer(self, shape: DemandShape, demand: PodDemand, policy: str) -> ShapePlacer:
        placer = self.placers.get(shape)
        if placer is None:
            placer = self.placers[shape] = ShapePlacer(demand, self.scorers[policy])
        return placer


class Ranker:
    """`place`, memoised per (demand shape, policy, node state), plus a warmer.

    The cache hands out the same NodeState object for a node until something on it changes,
    so the scheduler's filter and prioritize for one pod, and every later pod of the same
    shape, reuse each unchanged node's evaluation. `warm` (run off the request path, in
    small steps) keeps that memo complete: it re-evaluates the recent shapes on nodes that
    changed, and when the target workload or the GPU supply changes it builds the new
    scorers' memo on the side and switches only when it is complete, so no request pays for
    a cold pass over every node. Without a warmer (`background_warming` False) a new
    generation takes over at once. `search` needs no warmer: it scores only the few nodes
    that can be among the best (the extender's filter with `--filter-best`). Safe to share
    between threads (a lost race recomputes).
    """

    def __init__(self, policy: ScoringPolicy = CARPOOL, learn_workload: bool = True,
                 max_entries: int = MAX_MEMO_ENTRIES) -> None:
        self.policy = policy
        self.background_warming = False
        self._current = _Generation(policy, TargetWorkload(), {})
        self._next: _Generation | None = None
        self._tracker = WorkloadTracker() if learn_workload else None
        self._demands: dict[DemandShape, tuple[PodDemand, str]] = {}
        self._max_entries = max_entries
        self._nodes_seen = 0  # nodes in the last full sweep (bounds the shapes warmed)
        self._todo: OrderedDict[tuple[_Generation, DemandShape, str], None] = OrderedDict()
        self._todo_lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.warmed = 0
        self.workload_rebuilds = 0
        self.index = NodeIndex()

    @property
    def _scorers(self) -> dict[str, Scorer]:
        return self._current.scorers

    @property
    def workload(self) -> TargetWorkload:
        return self._current.workload

    def observe(self, demand: PodDemand) -> None:
        """Learn the workload from the pods the scheduler asks about."""
        if self._tracker is None:
            return
        demands = [Demand.from_request(c.request, cpu_milli=demand.cpu_milli if i == 0 else 0,
                                       memory_mib=demand.memory_mib if i == 0 else 0)
                   for i, c in enumerate(demand.containers)]
        if self._tracker.observe(demand.uid or demand.key, demands):
            workload = self._tracker.workload()
            latest = self._next or self._current
            if materially_different(latest.workload, workload):
                self._start(_Generation(self.policy, workload, latest.supply))

    def set_supply(self, supply: Mapping[str, int]) -> None:
        """GPUs per model in the cluster (the scarcity term's denominator)."""
        latest = self._next or self._current
        if supply_differs(latest.supply, supply):
            self._start(_Generation(self.policy, latest.workload, supply))

    def _start(self, generation: _Generation) -> None:
        self.workload_rebuilds += 1
        if not self.background_warming:
            self._current, self._next = generation, None
            return
        self._next = generation
        with self._todo_lock:
            self._todo.clear()  # the old next generation's work, if any
        self._queue(generation, self._current.memo, None)

    def _queue(self, generation: _Generation, shapes: Iterable[DemandShape],
               names: Iterable[str] | None) -> None:
        """Ask the warmer to evaluate `shapes` on `names` (None: on every node)."""
        # no more shapes than the memo holds on every node (else warming one evicts another)
        keep = max(1, min(WARM_SHAPES, self._max_entries // max(1, self._nodes_seen)))
        wanted = [s for s in shapes if s in self._demands][-keep:]
        with self._todo_lock:
            for shape in reversed(wanted):  # the most recently used first
                if names is None:
                    self._todo[(generation, shape, "")] = None
                else:
                    for name in names:
                        self._todo[(generation, shape, name)] = None

    def _shape(self, demand: PodDemand, policy: str) -> DemandShape:
        return (tuple(c.request for c in demand.containers), demand.cpu_milli,
                demand.memory_mib, demand.dataset, demand.dataset_size_gib, policy)

    def _memo_for(self, generation: _Generation, shape: DemandShape, demand: PodDemand,
                  policy: str) -> dict[str, Evaluation]:
        memo = generation.memo.get(shape)
        if memo is None:
            memo = generation.memo[shape] = {}
            self._demands[shape] = (demand, policy)
            total = sum(len(m) for m in generation.memo.values())
            while len(generation.memo) > 1 and total > self._max_entries:
                old, dropped = generation.memo.popitem(last=False)  # least recently used
                generation.placers.pop(old, None)
                generation.plan_scores.pop(old, None)
                total -= len(dropped)
            live = set(self._current.memo) | set(self._next.memo if self._next else ())
            for old in [s for s in self._demands if s not in live and s != shape]:
                del self._demands[old]
        else:
            generation.memo.move_to_end(shape)
        return memo

    def place(self, state: NodeState, demand: PodDemand, policy: str) -> Placement | Misfit:
        return place(state, demand, self._current.scorers[policy])

    def evaluate_all(self, states: Mapping[str, NodeState], demand: PodDemand,
                     policy: str) -> dict[str, Evaluation]:
        generation = self._current
        shape = self._shape(demand, policy)
        memo = self._memo_for(generation, shape, demand, policy)
        evaluate = generation.placer(shape, demand, policy).evaluate
        get = memo.get
        misses: list[str] = []

        def fresh(name: str, state: NodeState) -> Evaluation:
            misses.append(name)
            evaluation = evaluate(state)
            memo[name] = evaluation
            return evaluation

        # (one comprehension: this runs over every candidate node on every request)
        out = {name: entry if (entry := get(name)) is not None and entry.state is state
               else fresh(name, state) for name, state in states.items()}
        self.hits += len(states) - len(misses)
        self.misses += len(misses)
        return out

    def sync_index(self, source: IndexSource) -> None:
        """Bring the node index up to date (`search` does too; the first time every node)."""
        with self.index.lock:
            self.index.sync(source)

    @staticmethod
    def _plan_score(group: NodeGroup, scorer: RequestScorer, each: bool) -> GroupReading:
        """What `search` reads of a group for one demand shape: the plan's score (or
        NO_PLAN, EACH_NODE) and the group's nodes in the order of their ceilings; NO_NODE
        where none of them fits (`placement.gpu_verdicts`). The same while the group
        lives: its profile, sharing and readiness are its key, and it keeps its orders."""
        isolation = scorer.request.isolation
        if not group.ready or isolation not in group.sharing:
            return NO_NODE
        doubtful = group.doubtful_mps if isolation is Isolation.MPS else group.doubtful_other
        plan = None if each or doubtful else scorer.plan_of(group.profile)
        if plan is None:
            return (EACH_NODE if each or doubtful else NO_PLAN), group.order((None, 1))
        slots = set(plan.slots)
        key = (slots.pop() if len(slots) == 1 else None, len(plan.slots))
        return plan.score, group.order(key)

    def search(self, source: IndexSource, demand: PodDemand, policy: str, keep: int,
               allowed: Callable[[str], bool], own: tuple[str, NodeState] | None = None
               ) -> dict[str, float] | None:
        """The scores of enough of the `allowed` nodes that fit that the best `keep` of them
        are the best `keep` of all the allowed nodes (`service.best_nodes` picks them,
        ties included); empty when none fits. None for a demand of several containers.

        `evaluate_all` scores every candidate, so a new demand shape once cost a pass over
        every node. Here nodes are scored in the order of a ceiling on their score (the
        plan's score of their group's profile, their coolest GPU, the best locality:
        `RequestScorer.ceiling`), until `keep` fit and the next ceiling is below the
        `keep`-th best score: nodes alike in all but temperature share one plan, so this
        reads one plan per group and scores a few nodes. Groups where the fit rules may
        overrule the plan (`NodeGroup`) are scored node by node; `own`: the pod's own node,
        in the state without its hold.
        """
        generation = self._current
        shape = self._shape(demand, policy)
        memo = self._memo_for(generation, shape, demand, policy)
        placer = generation.placer(shape, demand, policy)
        scorer = placer.single
        if scorer is None:
            return None
        request = scorer.request
        isolation = request.isolation
        each = isolation is Isolation.MIG or bool(request.sharing_limits)
        index = self.index
        with index.lock:
            index.sync(source)
            groups = index.groups
            plan_scores = generation.plan_scores.setdefault(shape, {})
            if len(plan_scores) > 2 * len(groups) + 64:  # forget groups that are gone
                plan_scores = generation.plan_scores[shape] = {
                    g: v for g, v in plan_scores.items() if g.members}
            ceiling = scorer.ceiling

            def ceiling_of(plan_score: float, coolest: float) -> float:
                if plan_score < 0:  # no plan: the node scores 0 where it fits at all
                    return 0.0 if plan_score == NO_PLAN else math.inf
                return ceiling(plan_score, coolest)

            heap: list[tuple[float, int, float, Order, int]] = []
            for n, group in enumerate(groups.values()):
                known = plan_scores.get(group)
                if known is None:
                    known = plan_scores[group] = self._plan_score(group, scorer, each)
                if known is NO_NODE:
                    continue
                plan_score, order = known
                heap.append((-ceiling_of(plan_score, -order[0][0]), n, plan_score, order, 0))
            heapq.heapify(heap)
            found: dict[str, float] = {}
            best: list[float] = []  # the `keep` best scores found, lowest first
            hits = misses = 0

            def score(name: str, state: NodeState) -> None:
                nonlocal hits, misses
                entry = memo.get(name)
                if entry is None or entry.state is not state:
                    entry = memo[name] = placer.evaluate(state)
                    misses += 1
                else:
                    hits += 1
                if entry.score is not None:
                    found[name] = entry.score
                    if len(best) < keep:
                        heapq.heappush(best, entry.score)
                    elif entry.score > best[0]:
                        heapq.heapreplace(best, entry.score)

            own_name = own[0] if own is not None else None
            if own is not None and allowed(own[0]):
                score(own[0], own[1])
            states = index.states
            while heap:
                top, n, plan_score, order, i = heap[0]
                if len(best) >= keep and -top < best[0] - CEILING_SLACK:
                    break
                name = order[i][1]
                if i + 1 < len(order):
                    heapq.heapreplace(heap, (-ceiling_of(plan_score, -order[i + 1][0]), n,
                                             plan_score, order, i + 1))
                else:
                    heapq.heappop(heap)
                if name != own_name and allowed(name):
                    score(name, states[name])
        self.hits += hits
        self.misses += misses
        return found

    def evaluate(self, state: NodeState, demand: PodDemand, policy: str) -> Evaluation:
        return self.evaluate_all({state.name: state}, demand, policy)[state.name]

    def warm(self, source: NodeSource, deadline: float,
             clock: Callable[[], float] = time.monotonic) -> bool:
        """Fill the memo until `deadline`; True if work is left. See the class docstring."""
        changed = source.drain_changed()
        if changed:
            for generation in (self._current, self._next):
                if generation is not None:
                    self._queue(generation, generation.memo, changed)
        done = 0
        while True:
            with self._todo_lock:
                if not self._todo:
                    break
                (generation, shape, name), _ = self._todo.popitem(last=False)
            if generation is not self._current and generation is not self._next:
                continue
            if not name:  # every node: expand now, so later changes queue behind it
                every = source.node_names()
                self._nodes_seen = len(every)
                self._queue(generation, [shape], every)
                continue
            state = source.state_of(name)
            known = self._demands.get(shape)
            if state is None or known is None:
                continue
            demand, policy = known
            memo = generation.memo.get(shape)
            if memo is None:
                memo = self._memo_for(generation, shape, demand, policy)
            entry = memo.get(name)
            if entry is None or entry.state is not state:
                placer = generation.placer(shape, demand, policy)
                memo[name] = placer.evaluate(state)
                self.warmed += 1
                done += 1
                if done % 16 == 0 and clock() >= deadline:
                    return True
        if self._next is not None:  # its memo is complete: switch
            self._current, self._next = self._next, None
            return True
        return False


def supply_differs(old: Mapping[str, int], new: Mapping[str, int],
                   tolerance: float = SUPPLY_TOLERANCE) -> bool:
    """True if a model appeared or vanished, or its GPU count moved by more than
    `tolerance` (relative): the scarcity term barely moves for a node or two."""
    if {m for m, n in old.items() if n > 0} != {m for m, n in new.items() if n > 0}:
        return True
    return any(abs(new.get(m, 0) - n) > tolerance * n for m, n in old.items() if n > 0)
