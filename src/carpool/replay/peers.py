"""The GPU-sharing schedulers' placement policies, for the placement replay beside Carpool's.

HAMi, gpushare and Volcano cannot run beside Carpool here (their modules are not served by
the Go module proxy), so their documented node and GPU choices are written again, in our
own terms, from their code (read at the commits named below), and replayed on the same
openb traces under the same protocol (`carpool.replay.simulation`). What each one is based on:

*HAMi* (Project-HAMi/HAMi @ 4707fb0, Aug 2026). Its scheduler extender answers filter with one
node, so it alone picks the node of a GPU pod.
- Node: `pkg/scheduler/policy/node_policy.go`, `NodeScore.ComputeDefaultScore`: the node's
  device usage *before* the pod, Weight x (pods / slots + used cores / total cores + used
  memory / total memory) over all its GPUs; `NodeScoreList.Less` sorts ascending and
  `pkg/scheduler/scheduler.go` takes the last: *binpack* the busiest node, *spread* the
  idlest (the chart's default is `nodeSchedulerPolicy: binpack`).
- GPU: `pkg/scheduler/policy/gpu_policy.go`, `DeviceListsScore.ComputeScore` (slot, core and
  memory use after the request, default weights 1/1/1) and `DeviceUsageList.Less`;
  `pkg/device/nvidia/device.go`, `NvidiaGPUDevices.Fit` walks the sorted list from its end
  and takes the first GPUs that fit: *binpack* the busiest GPU first, *spread* the idlest
  (the chart's default is `gpuSchedulerPolicy: spread`). A GPU takes at most
  `deviceSplitCount` pods (10 by default, `charts/hami/values.yaml`); a 100 % cores request
  needs a GPU nobody uses.
- Pods without GPUs never reach HAMi: kube-scheduler's defaults place them.

*gpushare* (AliyunContainerService/gpushare-scheduler-extender @ c0b6141, Mar 2023). The
extender filters and binds; it has no prioritize verb, so kube-scheduler's default scores
(`kube_default_score`) pick the node. GPU: `pkg/cache/nodeinfo.go`,
`NodeInfo.allocateGPUID`: among the GPUs with enough free GPU memory, the one with the least
(binpack), ties to the lowest index. A pod gets one GPU; whole GPUs come from the NVIDIA
device plugin, which this replay lets take any fully idle GPUs (the real extender does not
count them, so the replay is kinder to it than a cluster would be).

*Volcano* (volcano-sh/volcano @ ed72c7c, Aug 2026), the GPU-share predicate.
`pkg/scheduler/api/devices/nvidia/gpushare/share.go`: `checkNodeGPUSharingPredicate` keeps a
node if one GPU has enough idle GPU memory; `GPUDevices.Allocate`
(`device_info.go`) takes the lowest-indexed such GPU (first fit); whole GPUs
(`predicateGPUbyNumber`) are GPUs without pods. `ScoreNode` returns 0, so the node is picked
by the default scheduler configuration's score plugins
(`installer/helm/chart/volcano/config/volcano-scheduler.conf`: nodeorder and binpack):
`plugins/nodeorder/nodeorder.go` (least-requested 1, balanced-resource 1) plus
`plugins/binpack/binpack.go`, `BinPackingScore` (CPU and memory, weight 1, on the resources
the pod requests). With equal weights least-requested and binpack cancel on CPU and memory,
so in practice Volcano's node choice is kube-scheduler's balanced allocation.

Common to all: a sharing pod's GPU memory follows its compute share (the traces carry no GPU
memory; each peer needs a memory request to share a GPU), `gpu_spec` restricts models (a
node selector or HAMi's type annotation), and ties go to the lowest-numbered node and GPU
(the peers break them by sort order or at random). Kube-scheduler's scores are its own
integer formulas (`noderesources` least_allocated.go and balanced_allocation.go, v1.35).

A peer's node profile keeps its GPUs in index order (first fit and its ties depend on the
index), and HAMi's keeps in each slot's memory field the pods the GPU may still take (its
split count); the traces use neither field otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.core.scoring import GpuSlot, NodeProfile, Plan
from carpool.core.workload import MILLI_PER_GPU, Demand

HAMI_SPLIT_COUNT = 10  # deviceSplitCount: pods one GPU may take
MAX_NODE_SCORE = 100  # kube-scheduler's and Volcano's per-plugin maximum


@dataclass(frozen=True)
class PeerPolicy:
    """Which peer, and for HAMi its node and GPU policies."""

    peer: str  # "hami", "gpushare" or "volcano"
    node_binpack: bool = True
    gpu_binpack: bool = False


POLICIES: dict[str, PeerPolicy] = {
    "hami-binpack-spread": PeerPolicy("hami", node_binpack=True, gpu_binpack=False),
    "hami-binpack-binpack": PeerPolicy("hami", node_binpack=True, gpu_binpack=True),
    "hami-spread-binpack": PeerPolicy("hami", node_binpack=False, gpu_binpack=True),
    "hami-spread-spread": PeerPolicy("hami", node_binpack=False, gpu_binpack=False),
    "gpushare": PeerPolicy("gpushare"),
    "volcano": PeerPolicy("volcano"),
}


def _requested(profile: NodeProfile, demand: Demand) -> tuple[int, int, int, int]:
    """CPU and memory requested on the node with the pod, and their capacities."""
    cpu_cap, memory_cap = profile.cpu_total_milli, profile.memory_total_mib
    return (cpu_cap - profile.cpu_free_milli + demand.cpu_milli,
            memory_cap - profile.memory_free_mib + demand.memory_mib, cpu_cap, memory_cap)


def least_allocated(profile: NodeProfile, demand: Demand) -> int:
    """kube-scheduler's NodeResourcesFit LeastAllocated on CPU and memory (weights 1):
    mean over resources of (capacity - requested) x 100 // capacity, integer division."""
    cpu, memory, cpu_cap, memory_cap = _requested(profile, demand)
    total = weights = 0
    for requested, capacity in ((cpu, cpu_cap), (memory, memory_cap)):
        if capacity <= 0:
            continue
        total += 0 if requested > capacity else (capacity - requested) * MAX_NODE_SCORE // capacity
        weights += 1
    return total // weights if weights else 0


def balanced_allocation(profile: NodeProfile, demand: Demand) -> int:
    """kube-scheduler's NodeResourcesBalancedAllocation on CPU and memory:
    int((1 - |f_cpu - f_memory| / 2) x 100), f = requested / capacity capped at 1."""
    cpu, memory, cpu_cap, memory_cap = _requested(profile, demand)
    fractions = [min(1.0, requested / capacity)
                 for requested, capacity in ((cpu, cpu_cap), (memory, memory_cap))
                 if capacity > 0]
    std = abs(fractions[0] - fractions[1]) / 2 if len(fractions) == 2 else 0.0
    return int((1 - std) * MAX_NODE_SCORE)


def kube_default_score(profile: NodeProfile, demand: Demand) -> float:
    """kube-scheduler's default resource scores, LeastAllocated + BalancedAllocation, in
    [0, 1] (the other default plugins score every node of the replay alike)."""
    return (least_allocated(profile, demand) + balanced_allocation(profile, demand)) / 200


def volcano_binpack(profile: NodeProfile, demand: Demand) -> float:
    """Volcano's binpack plugin: mean over the resources the pod requests (CPU, memory) of
    (used + request) / capacity, x 100."""
    cpu, memory, cpu_cap, memory_cap = _requested(profile, demand)
    parts = [requested / capacity
             for requested, capacity, asked in ((cpu, cpu_cap, demand.cpu_milli),
                                                (memory, memory_cap, demand.memory_mib))
             if asked > 0 and capacity > 0]
    return MAX_NODE_SCORE * sum(parts) / len(parts) if parts else 0.0


def volcano_score(profile: NodeProfile, demand: Demand) -> float:
    """nodeorder (least-requested + balanced-resource) + binpack, in [0, 1]."""
    return (least_allocated(profile, demand) + balanced_allocation(profile, demand)
            + volcano_binpack(profile, demand)) / 300


def hami_usage(profile: NodeProfile) -> float:
    """HAMi's node score before the pod, in [0, 1]: (pods / slots + 2 x used / capacity) / 3
    over the node's GPUs (memory use follows compute use, see the module docstring)."""
    gpus = len(profile.gpus)
    if gpus == 0:
        return 0.0
    pods = HAMI_SPLIT_COUNT * gpus - sum(slot.memory_free_mib for slot in profile.gpus)
    used = MILLI_PER_GPU * gpus - profile.idle_milli
    # one exact rational (100 pods + 2 used) / (1000 gpus): equal usage compares equal
    return (100 * pods + 2 * used) / (3 * MILLI_PER_GPU * gpus)


def _hami_gpu_usage(slot: GpuSlot) -> int:
    """A GPU's slot, core and memory use on one integer scale (the request adds the same to
    every GPU, so it does not change the order)."""
    return 100 * (HAMI_SPLIT_COUNT - slot.memory_free_mib) + 2 * (MILLI_PER_GPU - slot.idle_milli)


class PeerPlanner:
    """A peer's choice of node score and GPUs, with the simulator's planner interface."""

    def __init__(self, name: str) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown peer policy {name!r}; choose from {', '.join(POLICIES)}")
        self.name = name
        self.policy = POLICIES[name]

    def initial_profile(self, cpu_milli: int, memory_mib: int, gpus: int,
                        model: str) -> NodeProfile:
        """An empty node: GPUs in index order; HAMi's slots count the pods they may take."""
        pods = HAMI_SPLIT_COUNT if self.policy.peer == "hami" else 0
        slots = tuple(GpuSlot(model, MILLI_PER_GPU, pods) for _ in range(gpus))
        return NodeProfile(cpu_milli, memory_mib, cpu_milli, slots, memory_mib)

    def plan_uncached(self, profile: NodeProfile, demand: Demand) -> Plan | None:
        """The node's score in [0, 1] (higher is chosen) and the GPUs the peer would take."""
        if (profile.cpu_free_milli < demand.cpu_milli
                or profile.memory_free_mib < demand.memory_mib):
            return None
        indices = self._gpus(profile, demand)
        if indices is None:
            return None
        return Plan(self._node_score(profile, demand),
                    tuple(profile.gpus[i] for i in indices), self._after(profile, demand, indices),
                    0.0)

    def _node_score(self, profile: NodeProfile, demand: Demand) -> float:
        peer = self.policy.peer
        if peer == "volcano":
            return volcano_score(profile, demand)
        if peer == "hami" and demand.gpu_count > 0:
            usage = hami_usage(profile)
            return usage if self.policy.node_binpack else 1.0 - usage
        return kube_default_score(profile, demand)

    def _eligible(self, slot: GpuSlot, demand: Demand) -> bool:
        if not demand.allows_model(slot.model) or slot.idle_milli < demand.gpu_milli:
            return False
        # HAMi: the split count must not be used up
        return self.policy.peer != "hami" or slot.memory_free_mib > 0

    def _gpus(self, profile: NodeProfile, demand: Demand) -> tuple[int, ...] | None:
        """Indices of the GPUs taken, in the peer's order; None if too few fit."""
        if demand.gpu_count == 0:
            return ()
        whole = demand.gpu_count > 1 or demand.gpu_milli >= MILLI_PER_GPU
        candidates = [i for i, slot in enumerate(profile.gpus)
                      if (slot.idle_milli == MILLI_PER_GPU and demand.allows_model(slot.model)
                          if whole else self._eligible(slot, demand))]
        if len(candidates) < demand.gpu_count:
            return None
        peer = self.policy.peer
        if not whole and peer == "gpushare":  # least free memory that fits, then lowest index
            candidates.sort(key=lambda i: profile.gpus[i].idle_milli)
        elif not whole and peer == "hami":  # busiest (binpack) or idlest (spread) first
            sign = -1 if self.policy.gpu_binpack else 1
            candidates.sort(key=lambda i: sign * _hami_gpu_usage(profile.gpus[i]))
        return tuple(candidates[:demand.gpu_count])  # Volcano, whole GPUs: lowest index

    def _after(self, profile: NodeProfile, demand: Demand,
               indices: tuple[int, ...]) -> NodeProfile:
        slots = list(profile.gpus)
        pods = 1 if self.policy.peer == "hami" else 0
        for i in indices:
            slot = slots[i]
            slots[i] = GpuSlot(slot.model, slot.idle_milli - demand.gpu_milli,
                               slot.memory_free_mib - pods)
        return NodeProfile(profile.cpu_free_milli - demand.cpu_milli,
                           profile.memory_free_mib - demand.memory_mib,
                           profile.cpu_total_milli, tuple(slots), profile.memory_total_mib)
