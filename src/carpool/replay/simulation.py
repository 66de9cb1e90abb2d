"""Replay a GPU-sharing trace under the FGD paper's protocol (Weng et al., USENIX ATC'23).

Protocol: shuffle the trace's pods with a seed, then append pods drawn uniformly with
replacement until the next one would push the total GPU request past 1.3 x the cluster's GPU
capacity. Pods arrive one by one, never leave, are never retried; a pod that fits nowhere is
dropped. CPU and memory are hard limits, `gpu_spec` restricts GPU models, a shared pod needs one
GPU with idle >= gpu_milli, a whole-GPU pod `num_gpu` fully idle GPUs. The metric is allocated
GPU milli / total GPU milli, read when the arrived request reaches 100 % of capacity and at the
end.

Every placement decision goes through `scoring.Scorer.plan`, the extender's own code (or, for
the GPU-sharing schedulers' policies, `peers.PeerPlanner`). Nodes
with equal profiles are grouped, so each pod is scored once per distinct node state, not once
per node. Pure: CSV text in, numbers out (the caller reads files and measures time).
"""

from __future__ import annotations

import csv
import heapq
import io
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from carpool.core.scoring import GpuSlot, NodeProfile, Plan, Scorer, fits, slot_fits, take
from carpool.core.workload import MILLI_PER_GPU, Demand, TargetWorkload
from carpool.replay.peers import PeerPlanner

INFLATION = 1.3  # requests arrive until 130 % of GPU capacity
RANDOM_POLICY = "random"
Planner = Scorer | PeerPlanner  # Carpool's and the published baselines' scorer, or a peer's


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str

    def profile(self) -> NodeProfile:
        slots = tuple(GpuSlot(self.model, MILLI_PER_GPU, 0) for _ in range(self.gpus))
        return NodeProfile(self.cpu_milli, self.memory_mib, self.cpu_milli, slots, self.memory_mib)


@dataclass(frozen=True)
class TracePod:
    name: str
    demand: Demand


@dataclass(frozen=True)
class ReplayResult:
    """One replay: allocation shares (0..1) at 100 % arrival and at the end, and counts."""

    allocated_at_full: float
    allocated_at_end: float
    placed: int
    dropped: int
    arrived: int


def _int_field(row: dict[str, str], key: str, line: int) -> int:
    value = row.get(key)
    if value is None:
        raise ValueError(f"line {line}: missing column {key!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"line {line}: {key}={value!r} is not an integer") from None


def parse_nodes_csv(text: str) -> list[TraceNode]:
    """openb node list: `sn,cpu_milli,memory_mib,gpu,model`."""
    nodes = []
    for line, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        nodes.append(TraceNode(row.get("sn") or f"node-{line}",
                               _int_field(row, "cpu_milli", line),
                               _int_field(row, "memory_mib", line),
                               _int_field(row, "gpu", line), (row.get("model") or "").strip()))
    if not nodes:
        raise ValueError("node list is empty")
    return nodes


def parse_pods_csv(text: str) -> list[TracePod]:
    """openb pod list: `name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`.

    `gpu_milli` is per GPU: the share of one GPU for a sharing pod, 1000 for whole GPUs.
    """
    pods = []
    for line, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        num_gpu = _int_field(row, "num_gpu", line)
        gpu_milli = _int_field(row, "gpu_milli", line) if num_gpu > 0 else 0
        if num_gpu > 1 and gpu_milli != MILLI_PER_GPU:
            raise ValueError(f"line {line}: a {num_gpu}-GPU pod must ask for whole GPUs")
        spec = (row.get("gpu_spec") or "").strip()
        models = frozenset(m for m in spec.split("|") if m)
        demand = Demand(cpu_milli=_int_field(row, "cpu_milli", line),
                        memory_mib=_int_field(row, "memory_mib", line), gpu_count=num_gpu,
                        gpu_milli=gpu_milli, models=models)
        pods.append(TracePod(row.get("name") or f"pod-{line}", demand))
    if not pods:
        raise ValueError("pod list is empty")
    return pods


def capacity_milli(nodes: Iterable[TraceNode]) -> int:
    return MILLI_PER_GPU * sum(n.gpus for n in nodes)


def gpu_supply(nodes: Iterable[TraceNode]) -> dict[str, int]:
    """GPUs per model."""
    supply: dict[str, int] = {}
    for node in nodes:
        supply[node.model] = supply.get(node.model, 0) + node.gpus
    return supply


def arrivals(pods: Sequence[TracePod], seed: int, capacity: int,
             inflation: float = INFLATION) -> list[TracePod]:
    """The trace shuffled with `seed`, then resampled uniformly with replacement, stopping
    before the pod that would push the total GPU request past `inflation` x capacity."""
    rng = random.Random(seed)
    shuffled = list(pods)
    rng.shuffle(shuffled)
    limit = inflation * capacity
    out: list[TracePod] = []
    total = 0
    for pod in shuffled:
        if total + pod.demand.gpu_total_milli > limit:
            return out
        out.append(pod)
        total += pod.demand.gpu_total_milli
    if total == 0 and not any(p.demand.gpu_total_milli for p in pods):
        return out  # a trace without GPU pods would never reach the limit
    while True:
        pod = pods[rng.randrange(len(pods))]
        if total + pod.demand.gpu_total_milli > limit:
            return out
        out.append(pod)
        total += pod.demand.gpu_total_milli


def target_workload(pods: Iterable[TracePod]) -> TargetWorkload:
    """FGD's target workload: the shapes (cpu, gpu_milli, num_gpu, gpu_spec) covering 95 %
    of the trace's GPU pods; host memory is not part of a shape."""
    return TargetWorkload.from_demands(replace(p.demand, memory_mib=0) for p in pods)


class _Cluster:
    """Nodes grouped by profile (interned as ints); each group yields its lowest node first.

    `log` lists profile ids in the order their group became non-empty, so a per-demand view
    only has to look at groups that appeared since its last visit.
    """

    def __init__(self, nodes: Sequence[TraceNode], planner: Planner | None) -> None:
        self.ids: dict[NodeProfile, int] = {}
        self.profiles: list[NodeProfile] = []
        self.room: list[tuple[int, int, int]] = []  # per profile id: idle milli, CPU, memory
        self.members: list[list[int]] = []  # per profile id: a heap of node indices
        self.log: list[int] = []
        self.profile_id_of_node: list[int] = []
        for index, node in enumerate(nodes):
            pid = self._intern(
                planner.initial_profile(node.cpu_milli, node.memory_mib, node.gpus, node.model)
                if isinstance(planner, PeerPlanner) else node.profile())
            self.profile_id_of_node.append(pid)
            if not self.members[pid]:
                self.log.append(pid)
            self.members[pid].append(index)  # ascending, so already a heap

    def _intern(self, profile: NodeProfile) -> int:
        pid = self.ids.get(profile)
        if pid is None:
            pid = self.ids[profile] = len(self.profiles)
            self.profiles.append(profile)
            self.room.append((profile.idle_milli, profile.cpu_free_milli,
                              profile.memory_free_mib))
            self.members.append([])
        return pid

    def move(self, node: int, after: NodeProfile) -> None:
        members = self.members[self.profile_id_of_node[node]]
        if members[0] == node:
            heapq.heappop(members)
        else:
            members.remove(node)
            heapq.heapify(members)
        pid = self._intern(after)
        self.profile_id_of_node[node] = pid
        if not self.members[pid]:
            self.log.append(pid)
        heapq.heappush(self.members[pid], node)


class _DemandView:
    """One demand's ranking of node groups: a heap of (-score, first node, profile id)."""

    def __init__(self, demand: Demand) -> None:
        self.demand = demand
        self.seen = 0  # how much of the cluster's log has been scored
        self.heap: list[tuple[float, int, int]] = []
        self.plans: dict[int, Plan | None] = {}


def _best_plan(cluster: _Cluster, scorer: Planner, view: _DemandView
               ) -> tuple[int, Plan] | None:
    """The highest-scoring node; ties go to the lowest-numbered node.

    Stale heap entries (group emptied, or its lowest node changed) are dropped or refreshed
    when they reach the top.
    """
    members = cluster.members
    heap = view.heap
    plans = view.plans
    log = cluster.log
    room = cluster.room
    demand = view.demand
    need_gpu, need_cpu, need_memory = (demand.gpu_total_milli, demand.cpu_milli,
                                       demand.memory_mib)
    for pid in log[view.seen:]:
        group = members[pid]
        if not group:
            continue
        idle, cpu, memory = room[pid]
        if idle < need_gpu or cpu < need_cpu or memory < need_memory:
            continue  # cannot fit: a quick check before the scorer's exact one
        if pid in plans:
            plan = plans[pid]
        else:
            plan = plans[pid] = scorer.plan_uncached(cluster.profiles[pid], view.demand)
        if plan is not None:
            heapq.heappush(heap, (-plan.score, group[0], pid))
    view.seen = len(log)
    while heap:
        neg_score, first, pid = heap[0]
        group = members[pid]
        if not group:
            heapq.heappop(heap)
        elif group[0] != first:
            heapq.heapreplace(heap, (neg_score, group[0], pid))
        else:
            plan = plans[pid]
            assert plan is not None
            return first, plan
    return None


def _random_plan(cluster: _Cluster, view: _DemandView,
                 rng: random.Random) -> tuple[int, Plan] | None:
    """A uniformly random node that fits (rejection sampling, then a scan); random GPUs."""
    demand = view.demand
    fitting = view.plans  # profile id -> a placeholder plan, or None when it does not fit
    nodes = cluster.profile_id_of_node

    def fits_node(node: int) -> bool:
        pid = nodes[node]
        if pid not in fitting:
            ok = fits(cluster.profiles[pid], demand)
            fitting[pid] = Plan(0.0, (), cluster.profiles[pid], 0.0) if ok else None
        return fitting[pid] is not None

    node = -1
    for _ in range(64):
        candidate = rng.randrange(len(nodes))
        if fits_node(candidate):
            node = candidate
            break
    else:
        feasible = [i for i in range(len(nodes)) if fits_node(i)]
        if not feasible:
            return None
        node = rng.choice(feasible)
    profile = cluster.profiles[nodes[node]]
    slots: list[GpuSlot] = []
    remaining = list(profile.gpus)
    for _ in range(demand.gpu_count):
        slot = rng.choice([s for s in remaining if slot_fits(s, demand)])
        slots.append(slot)
        remaining.remove(slot)
    return node, Plan(0.0, tuple(slots), take(profile, demand, slots), 0.0)


def replay(nodes: Sequence[TraceNode], sequence: Sequence[TracePod], scorer: Planner | None,
           seed: int = 0) -> ReplayResult:
    """Place `sequence` in order; `scorer` None places at random (seeded by `seed`)."""
    cluster = _Cluster(nodes, scorer)
    capacity = capacity_milli(nodes)
    rng = random.Random(seed)
    views: dict[Demand, _DemandView] = {}
    arrived_milli = 0
    allocated_milli = 0
    at_full: float | None = None
    placed = dropped = 0
    for pod in sequence:
        demand = pod.demand
        arrived_milli += demand.gpu_total_milli
        view = views.get(demand)
        if view is None:
            view = views[demand] = _DemandView(demand)
        choice = (_best_plan(cluster, scorer, view) if scorer is not None
                  else _random_plan(cluster, view, rng))
        if choice is None:
            dropped += 1
        else:
            node, plan = choice
            cluster.move(node, plan.after)
            allocated_milli += demand.gpu_total_milli
            placed += 1
        if at_full is None and arrived_milli >= capacity:
            at_full = allocated_milli / capacity
    end = allocated_milli / capacity
    return ReplayResult(at_full if at_full is not None else end, end, placed, dropped,
                        len(sequence))


@dataclass(frozen=True)
class Summary:
    """Medians over seeds."""

    policy: str
    median_at_full: float
    median_at_end: float
    runs: tuple[ReplayResult, ...]


def summarize(policy: str, runs: Sequence[ReplayResult]) -> Summary:
    if not runs:
        raise ValueError("no runs to summarize")
    return Summary(policy, statistics.median(r.allocated_at_full for r in runs),
                   statistics.median(r.allocated_at_end for r in runs), tuple(runs))
