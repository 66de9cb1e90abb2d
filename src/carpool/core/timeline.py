"""When a queued job will start: durations learned from history and a forward simulation.

The simulation keeps, per node, which grants are held over which time span ("occupancies"):
running jobs until their expected end, and reservations made for queued jobs in queue order.
A job's estimated start is the earliest time some node can hold it for its whole expected
duration next to every occupancy overlapping that span. Because each queued job reserves its
slot before the next one is looked at, a later job can only take a slot that leaves every
earlier reservation in place (conservative backfilling): backfill never delays the estimated
start of a higher-ranked job.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from carpool.core.derived import DerivedState
from carpool.core.placement import NodeState, node_rejection
from carpool.core.resources import GpuGrant, GpuRequest

if TYPE_CHECKING:
    from carpool.core.jobs import Job

# Places a request on a node as it is: (score in [0, 1], higher is better; the grants), or
# None if it does not fit. The single seam where the extender's GPU choice and scoring
# (`queueing.extender_placer`) plug into admission.
NodePlacer = Callable[[NodeState, GpuRequest], tuple[float, tuple[GpuGrant, ...]] | None]


# ---------------------------------------------------------------- occupancy timeline


@dataclass(frozen=True)
class Occupancy:
    """Grants held on one node over [start, end)."""

    job_key: str
    start: float
    end: float
    grants: tuple[GpuGrant, ...]


@dataclass
class _BestNow:
    """One request's nodes ranked by how well they hold it from now on, over the nodes whose
    occupancies all started by now: there the fit does not depend on the span's end. Entries
    are (-score, host index, push order, the node's state at now, grants); an entry is live
    while its state is the one last fitted for its node (`fitted`), and a stale one is
    dropped when it comes to the top. Kept from cycle to cycle by a `TimelineMemo`: a new
    cycle fits again only the nodes whose state at now is another object than the one fitted
    (those where jobs started or ended), not every node for every request shape."""

    hosts: tuple[str, ...]  # the nodes that could ever hold the request, in name order
    fitted: list[NodeState | None]  # per host: its state at now when last fitted
    fits: list[tuple[float, tuple[GpuGrant, ...]] | None]  # per host: that fit (`earliest`)
    heap: list[tuple[float, int, int, NodeState, tuple[GpuGrant, ...]]]
    seen: int = 0  # how much of the current timeline's change log is folded in
    pushed: int = 0  # entries pushed so far (orders equal keys; never compared further)


# a slot being compared: (start, victims, -score, node, grants, victims' keys)
_Candidate = tuple[float, int, float, str, tuple[GpuGrant, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Slot:
    """Where and when a job can run; `displaces`: running jobs it preempts to get there."""

    start: float
    node: str
    grants: tuple[GpuGrant, ...]
    displaces: tuple[str, ...] = ()


class TimelineMemo:
    """Node states and fit results kept from one cycle to the next, for callers that run many
    cycles over the same nodes (a replay: each event changes one node, the rest repeat); also
    each request's ranking of nodes (`_BestNow`) and what a cycle derives from each running
    job (`holders`), which most of the next cycle's nodes and jobs leave as they were.

    Keyed by the identity of the node's base state (kept alive here, so an id is never
    reused while its entry exists) and the grants held, so a changed inventory never meets
    a stale entry. Past `limit` entries, a cycle starts with only what the cycle before it
    used (most nodes are as they were; dropping everything made the next cycle place every
    request on every node again).
    """

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.placer: NodePlacer | None = None
        self._states: dict[tuple[int, tuple[int, ...]],
                           tuple[NodeState, tuple[tuple[GpuGrant, ...], ...], NodeState]] = {}
        self._fits: dict[tuple[int, GpuRequest], tuple[NodeState, tuple[float, tuple[
            GpuGrant, ...]] | None]] = {}
        self._hosts: dict[tuple[int, GpuRequest], tuple[tuple[NodeState, ...], tuple[str, ...],
                                                          dict[str, int]]] = {}
        self._bases: tuple[NodeState, ...] | None = None  # the last `same_bases`
        self._derived: dict[int, tuple[NodeState, DerivedState]] = {}
        self.rankings: dict[GpuRequest, _BestNow] = {}  # `Timeline.best_now`'s, per request
        # job key -> what the cycle derives from a running job and its node alone, kept
        # while both are the same objects (`queueing._build_cycle`; the last cycle's holders)
        self.holders: dict[str, tuple[Job, NodeState | None, int, float, int]] = {}
        self.ranked: set[GpuRequest] = set()  # the requests ranked since the last `bind`
        # the keys of each table looked up since the last `bind`
        self._used: tuple[set[Any], set[Any], set[Any], set[Any]] = (set(), set(), set(), set())

    def bind(self, placer: NodePlacer) -> None:
        if self.placer is not placer:
            self.placer = placer
            self._fits.clear()
            self.rankings.clear()
        if len(self._states) + len(self._fits) > self.limit:
            tables: tuple[dict[Any, Any], ...] = (self._states, self._fits, self._hosts,
                                                  self._derived)
            for table, used in zip(tables, self._used, strict=True):
                kept = {key: table[key] for key in used if key in table}
                table.clear()
                table.update(kept)
            self.rankings = {r: self.rankings[r] for r in self.ranked if r in self.rankings}
        for used in self._used:
            used.clear()
        self.ranked.clear()

    def derived(self, base: NodeState) -> DerivedState:
        """The `DerivedState` of `base`, the same one every cycle while `base` is passed in."""
        entry = self._derived.get(id(base))
        if entry is None or entry[0] is not base:
            entry = self._derived[id(base)] = (base, DerivedState.of(base))
        self._used[3].add(id(base))
        return entry[1]

    def state(self, base: NodeState, held: tuple[tuple[GpuGrant, ...], ...]) -> NodeState:
        """`base` with the grant tuples `held` added; keyed by the tuples' identities (cheap
        to hash, and each occupancy keeps its job's grants tuple), checked on a hit. Made
        from the state without the last tuple where that is kept (the node before its newest
        job: a `DerivedState` then works out its free GPUs from that one's)."""
        ids = tuple(id(g) for g in held)
        entry = self._states.get((id(base), ids))
        if entry is None or entry[0] is not base or any(
                a is not b for a, b in zip(entry[1], held, strict=True)):
            before = self._states.get((id(base), ids[:-1])) if held else None
            if before is not None and before[0] is base and all(
                    a is b for a, b in zip(before[1], held[:-1], strict=True)):
                state = before[2].with_grants(held[-1]) if held[-1] else before[2]
            else:
                grants = tuple(g for gs in held for g in gs)
                state = base.with_grants(grants) if grants else base
            entry = self._states[(id(base), ids)] = (base, held, state)
        self._used[0].add((id(base), ids))
        return entry[2]

    def fit(self, state: NodeState, request: GpuRequest, placer: NodePlacer
            ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        key = (id(state), request)
        entry = self._fits.get(key)
        if entry is None or entry[0] is not state:
            entry = self._fits[key] = (state, placer(state, request))
        self._used[1].add(key)
        return entry[1]

    def same_bases(self, bases: tuple[NodeState, ...]) -> tuple[NodeState, ...]:
        """`bases`, or the tuple of the very same states that the cycle before passed: one
        identity per set of base states, which `hosts` is keyed by (checked once a cycle,
        not once per request)."""
        last = self._bases
        if last is not None and len(last) == len(bases) and all(
                a is b for a, b in zip(last, bases, strict=True)):
            return last
        self._bases = bases
        return bases

    def hosts(self, bases: tuple[NodeState, ...], names: tuple[str, ...],
              request: GpuRequest) -> tuple[tuple[str, ...], dict[str, int]]:
        """The nodes of `bases` (from `same_bases`) that could ever hold the request, and
        each one's place among them."""
        key = (id(bases), request)
        entry = self._hosts.get(key)
        if entry is None or entry[0] is not bases:
            hosts = tuple(n for n, b in zip(names, bases, strict=True)
                          if node_rejection(b, request) is None)
            entry = self._hosts[key] = (bases, hosts, {n: i for i, n in enumerate(hosts)})
        self._used[2].add(key)
        return entry[1], entry[2]


class Timeline:
    """Per-node occupancy over time for one cycle's what-ifs (local state, never shared).

    Fit checks are memoised by (node, the exact set of occupancies that overlap the span,
    request): the node's state is a function of that set alone, and occupancies are only
    appended or shortened, so a cycle with thousands of jobs of a few shapes asks the
    placement core only once per distinct situation.
    """

    def __init__(self, nodes: Mapping[str, NodeState], now: float, placer: NodePlacer,
                 memo: TimelineMemo | None = None, bind: bool = True) -> None:
        """`bind`: start a cycle of `memo` (its placer, what it keeps); False for another
        timeline of a cycle already bound (start scenarios share its fits)."""
        self.now = now
        self.placer = placer
        self.memo = memo
        if memo is not None and bind:
            memo.bind(placer)
        # inventory + grants of things that are not jobs; what-if states are asked the same
        # questions again and again, so they keep their answers (DerivedState)
        self._base: dict[str, NodeState] = {
            name: memo.derived(state) if memo is not None else DerivedState.of(state)
            for name, state in nodes.items()}
        self._names = sorted(nodes)
        self._bases = tuple(self._base[n] for n in self._names)
        if memo is not None:
            self._bases = memo.same_bases(self._bases)
        self._occupancies: dict[str, list[Occupancy]] = {name: [] for name in nodes}
        self._starts: dict[str, list[float]] = {name: [] for name in nodes}  # sorted
        self._versions: dict[str, int] = dict.fromkeys(nodes, 0)
        self._now_ids: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self._request_ids: dict[GpuRequest, int] = {}
        self._hosts: dict[int, tuple[str, ...]] = {}  # request id -> nodes that could ever fit
        self._fits: dict[tuple[str, tuple[int, ...], int],
                         tuple[float, tuple[GpuGrant, ...]] | None] = {}
        self._states: dict[tuple[str, tuple[int, ...]], NodeState] = {}
        self._changed: list[str] = []  # nodes, each time their occupancies changed
        self._future: set[str] = set()  # nodes with an occupancy that starts after now
        self._host_index: dict[int, dict[str, int]] = {}  # request id -> node -> host order
        self._best: dict[int, _BestNow] = {}  # request id -> its ranking (see best_now)
        # every node's state at now when the first ranking was folded in this cycle, and how
        # much of the change log that was (`_carried`)
        self._at_now: tuple[int, dict[str, NodeState]] | None = None
        # node -> (its version, the distinct ends of its occupancies in order): `earliest`
        # asks for them on every host for every job it reserves
        self._ends: dict[str, tuple[int, list[float]]] = {}

    def _request_id(self, request: GpuRequest) -> int:
        """A small int per distinct request, so the hot loops hash ints, not dataclasses."""
        rid = self._request_ids.get(request)
        if rid is None:
            rid = self._request_ids[request] = len(self._request_ids)
            if self.memo is not None:
                self._hosts[rid], self._host_index[rid] = self.memo.hosts(
                    self._bases, tuple(self._names), request)
            else:
                hosts = self._hosts[rid] = tuple(
                    n for n in self._names if node_rejection(self._base[n], request) is None)
                self._host_index[rid] = {n: i for i, n in enumerate(hosts)}
        return rid

    @property
    def node_names(self) -> list[str]:
        return list(self._names)

    def occupancies(self, node: str) -> list[Occupancy]:
        return list(self._occupancies.get(node, ()))

    def add(self, node: str, occupancy: Occupancy) -> None:
        if node not in self._base:
            raise KeyError(f"unknown node {node!r}")
        self._occupancies[node].append(occupancy)
        bisect.insort(self._starts[node], occupancy.start)
        self._versions[node] += 1
        self._changed.append(node)
        if occupancy.start > self.now:
            self._future.add(node)

    def end_at(self, job_key: str, end: float) -> None:
        """Shorten a job's occupancy (a preempted job leaves after its grace period)."""
        for node, occs in self._occupancies.items():
            for i, o in enumerate(occs):
                if o.job_key == job_key and o.end > end:
                    occs[i] = Occupancy(o.job_key, o.start, end, o.grants)
                    self._versions[node] += 1
                    self._changed.append(node)

    def _overlapping(self, node: str, start: float, end: float,
                     without: frozenset[str]) -> tuple[int, ...]:
        return tuple(i for i, o in enumerate(self._occupancies[node])
                     if o.start < end and o.end > start and o.job_key not in without)

    def _state(self, node: str, ids: tuple[int, ...]) -> NodeState:
        # one NodeState per situation, shared by every request shape that meets it: a state
        # memoises what placement and scoring derive from it (free GPUs, profiles)
        state = self._states.get((node, ids))
        if state is None:
            base = self._base[node]
            occs = self._occupancies[node]
            if self.memo is not None:
                state = self._states[(node, ids)] = self.memo.state(
                    base, tuple(occs[i].grants for i in ids))
            else:
                held = tuple(g for i in ids for g in occs[i].grants)
                state = self._states[(node, ids)] = base.with_grants(held) if held else base
        return state

    def state_during(self, node: str, start: float, end: float,
                     without: frozenset[str] = frozenset()) -> NodeState:
        """The node as every occupancy overlapping [start, end) leaves it, `without` jobs
        (a gang's placement, `core.gangs`, adds its own workers' grants to these)."""
        ids = (self._ids_from_now(node, end) if start == self.now and not without
               else self._overlapping(node, start, end, without))
        return self._state(node, ids)

    def end_times(self) -> list[float]:
        """Every distinct time an occupancy ends, in order (when a waiting gang might fit)."""
        return sorted({o.end for occs in self._occupancies.values() for o in occs})

    def fit_during(self, node: str, request: GpuRequest, start: float, end: float,
                   without: frozenset[str] = frozenset()
                   ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        """(placer's score, grants) if `request` fits the node over [start, end), else None."""
        return self._fit(node, request, self._request_id(request), start, end, without)

    def _ids_from_now(self, node: str, end: float) -> tuple[int, ...]:
        """Occupancies overlapping [now, end): memoised by how many start before `end`, which
        with the node's version pins the set down (occupancies only grow or shorten)."""
        starting = bisect.bisect_left(self._starts[node], end)
        key = (node, self._versions[node], starting)
        ids = self._now_ids.get(key)
        if ids is None:
            ids = self._now_ids[key] = self._overlapping(node, self.now, end, frozenset())
        return ids

    def _fit(self, node: str, request: GpuRequest, rid: int, start: float, end: float,
             without: frozenset[str] = frozenset()
             ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        if start == self.now and not without:
            ids = self._ids_from_now(node, end)
        else:
            ids = self._overlapping(node, start, end, without)
        key = (node, ids, rid)
        if key not in self._fits and self.memo is not None:
            self._fits[key] = self.memo.fit(self._state(node, ids), request, self.placer)
        elif key not in self._fits:
            self._fits[key] = self.placer(self._state(node, ids), request)
        return self._fits[key]

    def never_fits(self, node: str, request: GpuRequest) -> bool:
        """True if the node cannot hold the request even with no job on it."""
        return node not in self._hosts[self._request_id(request)]

    def fits_anywhere_ever(self, request: GpuRequest) -> bool:
        return bool(self._hosts[self._request_id(request)])

    def best_now(self, request: GpuRequest, duration_s: float,
                 respect_reservations: bool = True,
                 without: frozenset[str] = frozenset()) -> Slot | None:
        """The best node that can hold the request from now for `duration_s`.

        With `respect_reservations` the slot must leave every reservation overlapping the span
        in place; without, only what is held now counts (a raw capacity check). `without`
        jobs are treated as gone.
        """
        # The raw check spans the instant `now` alone: the next float, since `now + 1e-9`
        # rounds back to `now` for epoch times (~1.7e9) and would overlap nothing.
        end = (self.now + duration_s if respect_reservations
               else math.nextafter(self.now, math.inf))
        rid = self._request_id(request)
        if without or end <= self.now:
            return self._best_by_scan(request, rid, end, without)
        # Equal to scanning every host (best score, ties to the first in name order), but a
        # cycle asks this for thousands of jobs over hundreds of nodes while each admission
        # changes one node: nodes whose occupancies all started by now hold the request the
        # same way whatever `end` is, so their ranking is kept per request and updated from
        # the change log; only nodes with a reservation starting later are looked at per call.
        index = self._host_index[rid]
        candidates = []
        top = self._best_current(request, rid)
        if top is not None:
            candidates.append(top)
        for name in self._future:
            i = index.get(name)
            if i is None:
                continue
            fit = self._fit(name, request, rid, self.now, end, without)
            if fit is not None:
                candidates.append((-fit[0], i, name, self._versions[name], fit[1]))
        if not candidates:
            return None
        best = min(candidates)
        return Slot(self.now, best[2], best[4])

    def _best_by_scan(self, request: GpuRequest, rid: int, end: float,
                      without: frozenset[str]) -> Slot | None:
        best: tuple[float, str, tuple[GpuGrant, ...]] | None = None
        for name in self._hosts[rid]:
            fit = self._fit(name, request, rid, self.now, end, without)
            if fit is None:
                continue
            score, grants = fit
            if best is None or score > best[0]:
                best = (score, name, grants)
        return Slot(self.now, best[1], best[2]) if best else None

    def _best_current(self, request: GpuRequest, rid: int
                      ) -> tuple[float, int, str, int, tuple[GpuGrant, ...]] | None:
        """The best entry of the request's ranking over nodes without later reservations."""
        ranking = self._best.get(rid)
        stale: Iterable[str]
        if ranking is None:
            ranking, stale = self._carried(request, rid)
            self._best[rid] = ranking
        else:
            stale = dict.fromkeys(self._changed[ranking.seen:])
        ranking.seen = len(self._changed)
        index = self._host_index[rid]
        fitted, heap = ranking.fitted, ranking.heap
        # any end past now: these nodes' occupancies all overlap it or have ended by now
        end = math.nextafter(self.now, math.inf)
        for name in stale:
            i = index.get(name)
            if i is None or name in self._future:
                continue
            ids = self._ids_from_now(name, end)
            state = self._state(name, ids)
            if state is fitted[i]:
                continue
            fitted[i] = state
            fit = ranking.fits[i] = self._fit(name, request, rid, self.now, end)
            if fit is not None:
                ranking.pushed += 1
                heapq.heappush(heap, (-fit[0], i, ranking.pushed, state, fit[1]))
        hosts = ranking.hosts
        while heap:
            entry = heap[0]
            i = entry[1]
            name = hosts[i]
            if entry[3] is fitted[i]:
                if name not in self._future:
                    return (entry[0], i, name, self._versions[name], entry[4])
                fitted[i] = None  # fitted again once the node has no later reservation
            heapq.heappop(heap)
        return None

    def _carried(self, request: GpuRequest, rid: int) -> tuple[_BestNow, Iterable[str]]:
        """The request's ranking as the last cycle left it (the memo's) and the nodes to fit
        again: those whose state at now is not the one fitted. Without one, a new ranking
        and every host."""
        hosts = self._hosts[rid]
        kept = None
        if self.memo is not None:
            self.memo.ranked.add(request)
            kept = self.memo.rankings.get(request)
        if kept is None or kept.hosts is not hosts:
            ranking = _BestNow(hosts, [None] * len(hosts), [None] * len(hosts), [])
            if self.memo is not None:
                self.memo.rankings[request] = ranking
            return ranking, hosts
        if self._at_now is None:
            end = math.nextafter(self.now, math.inf)
            self._at_now = (len(self._changed), {
                name: self._state(name, self._ids_from_now(name, end)) for name in self._names})
        seen, at_now = self._at_now
        stale = dict.fromkeys(name for name, state in zip(hosts, kept.fitted, strict=True)
                              if at_now[name] is not state)
        stale.update(dict.fromkeys(self._changed[seen:]))
        if len(kept.heap) > 2 * len(hosts) + 64:  # drop the stale entries kept so far
            kept.heap = [e for e in kept.heap if e[3] is kept.fitted[e[1]]]
            heapq.heapify(kept.heap)
        return kept, stale

    def earliest(self, request: GpuRequest, duration_s: float, not_before: float,
                 yielding: Mapping[str, float] | None = None,
                 protected: Mapping[str, float] | None = None,
                 max_victims: int | None = None) -> Slot | None:
        """The earliest slot at or after `not_before` for the whole duration; None if no node
        could ever hold the request. Ties go to the better-ranked node, then the name.

        `yielding`: running jobs the waiting job may preempt once it is allowed to start, in
        the order victims are taken, each with how long it keeps its GPUs once told to stop.
        The admission cycle preempts as soon as the job fits with its victims gone, so a
        slot that needs them starts that long after, not when they would have ended.
        `protected`: when those not yet past their minimum runtime may first be preempted;
        before then they are no victims. `max_victims`: the most one slot may displace
        (`preemption.largest_plan`).
        """
        best: _Candidate | None = None
        rid = self._request_id(request)
        order = {key: i for i, key in enumerate(yielding)} if yielding else {}
        since = protected if yielding and protected else {}
        # from now, a node without later reservations holds the job as it holds it at now:
        # best_now's ranking knows that fit already (folded up to date here)
        known = None
        if not_before == self.now:
            self._best_current(request, rid)
            known = self._best[rid].fits
        for i, name in enumerate(self._hosts[rid]):
            # the times after `not_before` when the node may first hold the job: its ends,
            # and when a victim's protection ends (the cycle may preempt it from then on)
            later = (sorted(set(self._ends_after(name, not_before)) | {
                since[o.job_key] for o in self._occupancies[name]
                if o.job_key in since and not_before < since[o.job_key] < o.end})
                if since else self._ends_sorted(name))
            at = 0 if since else -1  # -1: the first end after `not_before` not looked up yet
            t = not_before
            while best is None or t <= best[0]:
                fit = (known[i] if known is not None and t == not_before
                       and name not in self._future
                       else self._fit(name, request, rid, t, t + duration_s))
                if fit is not None:
                    candidate = (t, 0, -fit[0], name, fit[1], ())
                    if best is None or candidate[:4] < best[:4]:
                        best = candidate
                    break
                if yielding:  # keeps looking: a fit without preempting may come first
                    found = self._displacing(name, request, rid, t, duration_s, yielding, order,
                                             since)
                    if found is not None and max_victims is not None and found[1] > max_victims:
                        found = None
                    if found is not None and (best is None or found[:4] < best[:4]):
                        best = found
                if at < 0:
                    at = bisect.bisect_right(later, not_before)
                if at >= len(later):
                    break
                t = later[at]
                at += 1
        return Slot(best[0], best[3], best[4], best[5]) if best else None

    def _ends_after(self, node: str, after: float) -> list[float]:
        """The distinct times the node's occupancies end after `after`, in order."""
        ends = self._ends_sorted(node)
        return ends[bisect.bisect_right(ends, after):]

    def _ends_sorted(self, node: str) -> list[float]:
        version = self._versions[node]
        kept = self._ends.get(node)
        if kept is None or kept[0] != version:
            kept = self._ends[node] = (version, sorted({o.end for o in
                                                        self._occupancies[node]}))
        return kept[1]

    def _displacing(self, node: str, request: GpuRequest, rid: int, t: float, duration_s: float,
                    yielding: Mapping[str, float], order: Mapping[str, int],
                    since: Mapping[str, float]) -> _Candidate | None:
        """The slot on `node` if the job preempts at `t`: victims taken in order until it fits
        (as `preemption.plan_preemption` takes them), then those it does not need put back;
        only jobs that may be preempted at `t` (`since`) are victims."""
        running = sorted({o.job_key for o in self._occupancies[node]
                          if o.job_key in order and o.start <= t < o.end
                          and since.get(o.job_key, t) <= t}, key=order.__getitem__)

        def fit(gone: list[str]) -> tuple[float, tuple[float, tuple[GpuGrant, ...]]] | None:
            start = t + max(yielding[k] for k in gone)
            found = self._fit(node, request, rid, t, start + duration_s, frozenset(gone))
            return (start, found) if found is not None else None

        chosen: list[str] = []
        for key in running:
            chosen.append(key)
            if fit(chosen) is not None:
                break
        else:
            return None
        for key in reversed(chosen[:-1]):
            trial = [k for k in chosen if k != key]
            if fit(trial) is not None:
                chosen = trial
        result = fit(chosen)
        assert result is not None
        start, (score, grants) = result
        return (start, len(chosen), -score, node, grants, tuple(chosen))


def fluid_start(base: float, work_ahead_gpu_hours: float, capacity_gpus: float) -> float:
    """A coarse start estimate for jobs deep in the queue: the queue ahead drains at the rate
    of the whole cluster, start = base + work ahead / capacity."""
    if capacity_gpus <= 0:
        return base
    return base + work_ahead_gpu_hours / capacity_gpus * 3600.0
