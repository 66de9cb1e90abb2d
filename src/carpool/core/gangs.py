"""Gang placement: every worker of a gang placed at once, or none of them.

The invariant: a gang holds GPUs only as a whole. `place_gang` answers for all workers in one
decision from one set of node states; the admission cycle (the single decider) admits the
gang only with such an answer, so no worker ever holds GPUs while another cannot be placed,
and two gangs can never each hold part of what both need.

Everything here is pure. Where each worker goes:

1. Domains are tried smallest level first (`topology.TopologyNeed.levels`): one host, an
   NVLink island, a rack, a block, a zone, the cluster. The first level with a domain that
   holds the whole gang wins, so the gang lands in the smallest domain that can hold it now.
2. Within a level, domains with the fewest idle GPUs go first (best fit: large domains stay
   whole for large gangs); ties by name.
3. Within a domain, the largest workers are placed first, each on the node the node placer
   (the extender's own GPU choice and score, `queueing.extender_placer`) scores best, nodes
   already holding a worker of the gang ahead of the rest (fewer hops between ranks). Where
   that leaves a worker without a node, the domain is tried once more best-fit: each worker
   on the node it leaves with the fewest idle GPUs (a packing the score's order can miss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, GpuRequest
from carpool.core.topology import ANYWHERE, Domain, TopologyLevel, TopologyNeed, domain_index

# the most workers a gang may have, and GPUs in all (the GpuJob CRD says the same)
MAX_WORKERS = 16
MAX_GANG_GPUS = 128

NodePlacer = Callable[[NodeState, GpuRequest], tuple[float, tuple[GpuGrant, ...]] | None]


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker (one pod) of a gang runs: its node and the GPUs it holds there."""

    node: str
    grants: tuple[GpuGrant, ...]


@dataclass(frozen=True)
class GangPlacement:
    """Every worker's place, in rank order, and the domain that holds them all."""

    workers: tuple[WorkerPlacement, ...]
    level: TopologyLevel
    domain: str

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes, in rank order of first use."""
        return tuple(dict.fromkeys(w.node for w in self.workers))

    def by_node(self) -> dict[str, tuple[GpuGrant, ...]]:
        """All grants of the gang on each node."""
        out: dict[str, list[GpuGrant]] = {}
        for worker in self.workers:
            out.setdefault(worker.node, []).extend(worker.grants)
        return {node: tuple(grants) for node, grants in out.items()}


Fit = Callable[[str, GpuRequest], tuple[float, tuple[GpuGrant, ...]] | None]


def place_gang(workers: Sequence[GpuRequest], states: Mapping[str, NodeState],
               placer: NodePlacer, need: TopologyNeed | None = None, fit: Fit | None = None,
               index: Mapping[TopologyLevel, tuple[Domain, ...]] | None = None
               ) -> GangPlacement | None:
    """All `workers` placed within the smallest domain `need` allows, or None if no domain
    of those levels holds them all now (see the module docstring for the order).

    `fit(node, request)` answers for a node as `states` has it (default: the placer on that
    state; the admission cycle passes its timeline's memoised fit), `index` the domains
    (default: from the states' inventories); the placer itself is asked only about nodes
    that already hold a worker of this gang."""
    if not workers:
        raise ValueError("a gang needs at least one worker")
    wanted = sum(r.count for r in workers)
    largest = max(workers, key=lambda r: (r.count, r.memory_mib))
    ask: Fit = fit if fit is not None else (lambda name, r: placer(states[name], r))
    index = index if index is not None else domain_index(s.inventory for s in states.values())
    hosts: dict[str, bool] = {}  # node -> the largest worker fits there alone

    def hosts_largest(name: str) -> bool:
        if name not in hosts:
            hosts[name] = ask(name, largest) is not None
        return hosts[name]

    for level in (need or ANYWHERE).levels():
        candidates = sorted(
            ((_idle_gpus(states, d.nodes), d.name, d) for d in index.get(level, ())
             if d.gpus >= wanted and any(hosts_largest(n) for n in d.nodes)),
            key=lambda c: (c[0], c[1]))
        for _, _, domain in candidates:
            found = _place_in(workers, domain.nodes, states, placer, ask, tight=False)
            if isinstance(found, int) and found > 0:  # (none placed: no order helps)
                found = _place_in(workers, domain.nodes, states, placer, ask, tight=True)
            if not isinstance(found, int):
                return GangPlacement(found, level, domain.name)
    return None


def _idle_gpus(states: Mapping[str, NodeState], names: Sequence[str]) -> int:
    return sum(1 for n in names for f in states[n].free() if f.grants == 0 and f.gpu.healthy)


def _place_in(workers: Sequence[GpuRequest], names: Sequence[str],
              states: Mapping[str, NodeState], placer: NodePlacer, ask: Fit, tight: bool
              ) -> tuple[WorkerPlacement, ...] | int:
    """Every worker on these nodes, largest first, or how many were placed before one found
    no node; `tight`: best-fit (the node left with the fewest idle GPUs) before the placer's
    score."""
    order = sorted(range(len(workers)),
                   key=lambda i: (-workers[i].count, -workers[i].memory_mib, i))
    held: dict[str, list[GpuGrant]] = {}
    placed: dict[int, WorkerPlacement] = {}
    for i in order:
        best: tuple[tuple[bool, int, float], str, tuple[GpuGrant, ...]] | None = None
        for name in names:
            fit = (placer(states[name].with_grants(held[name]), workers[i]) if name in held
                   else ask(name, workers[i]))
            if fit is None:
                continue
            # a node already used by the gang first, then the placer's score (or, `tight`,
            # the fewest idle GPUs left); ties: the first by name (names come in order, and
            # only a better key replaces it)
            key = ((name in held, -_idle_left(states[name], held.get(name, []), fit[1]),
                    fit[0]) if tight else (name in held, 0, fit[0]))
            if best is None or key > best[0]:
                best = (key, name, fit[1])
        if best is None:
            return len(placed)
        held.setdefault(best[1], []).extend(best[2])
        placed[i] = WorkerPlacement(best[1], best[2])
    return tuple(placed[i] for i in range(len(workers)))


def _idle_left(state: NodeState, held: Sequence[GpuGrant], grants: Sequence[GpuGrant]) -> int:
    """GPUs of the node with no grant once `held` and `grants` are added."""
    taken = {g.gpu_uuid for g in (*held, *grants)}
    return sum(1 for f in state.free() if f.grants == 0 and f.gpu.uuid not in taken)
