"""Where a pod's GPUs go on one node, and how good that node is: the extender's one seam to
the placement objective.

Filter, prioritize and bind all go through `place` and `node_score`, so the GPU bind picks is
the one prioritize scored. The terms below are a simple deterministic objective; the full
fragmentation-aware scoring lives in `carpool.core.scoring` (placement engineer) and replaces
the body of `node_score` without touching the handlers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from carpool.core.placement import GpuFree, NodeState, gpu_rejection, grant_for, node_rejection
from carpool.core.resources import GpuGrant, GpuRequest
from carpool.extender.wire import PodDemand, Policy

MAX_SCORE = 10  # the extender API's MaxExtenderPriority


@dataclass(frozen=True)
class Weights:
    """Relative weights of the score terms (any non-negative numbers; normalised)."""

    packing: float = 1.0
    temperature: float = 0.5
    locality: float = 0.5

    def __post_init__(self) -> None:
        if min(self.packing, self.temperature, self.locality) < 0:
            raise ValueError("score weights must not be negative")
        if self.packing + self.temperature + self.locality <= 0:
            raise ValueError("at least one score weight must be positive")


@dataclass(frozen=True)
class Placement:
    """GPUs chosen on one node, per container, in container order."""

    node: str
    per_container: tuple[tuple[GpuGrant, ...], ...]

    @property
    def grants(self) -> tuple[GpuGrant, ...]:
        return tuple(g for grants in self.per_container for g in grants)


def _choose(state: NodeState, request: GpuRequest, policy: str) -> tuple[GpuGrant, ...] | None:
    """`request.count` distinct GPUs: tightest fit for binpack, loosest for spread.

    Ties break on GPU index, so the same state always gives the same choice.
    """
    usable = [f for f in state.free() if gpu_rejection(f, request) is None]
    if len(usable) < request.count:
        return None

    def tightness(f: GpuFree) -> tuple[int, int, int]:
        return (f.memory_mib - request.memory_mib, f.cores_pct, f.gpu.index)

    if policy == Policy.SPREAD:
        usable.sort(key=lambda f: (-f.memory_mib, -f.cores_pct, f.gpu.index))
    else:
        usable.sort(key=tightness)
    return tuple(grant_for(f, request) for f in usable[: request.count])


def place(state: NodeState, demand: PodDemand, policy: str) -> Placement | str:
    """GPUs for every container of `demand` on this node, or the reason it does not fit."""
    chosen: list[tuple[GpuGrant, ...]] = []
    for container in demand.containers:
        reason = node_rejection(state, container.request)
        if reason is not None:
            return reason
        grants = _choose(state, container.request, policy)
        if grants is None:  # node_rejection and the chooser agree; kept for safety
            return "no GPUs fit"
        chosen.append(grants)
        state = state.with_grants(grants)
    return Placement(state.name, tuple(chosen))


def packing_term(state: NodeState, placement: Placement) -> float:
    """Share of the node's GPU memory in use once the pod is placed: used / total, in [0, 1].

    Binpack prefers high values (fill partly used nodes, keep whole nodes free); spread uses
    1 − this.
    """
    total = sum(g.memory_total_mib for g in state.inventory.gpus)
    if total <= 0:
        return 0.0
    used = sum(g.memory_mib for g in state.grants) + sum(g.memory_mib for g in placement.grants)
    return min(1.0, max(0.0, used / total))


def temperature_term(state: NodeState, placement: Placement) -> float:
    """Thermal headroom of the hottest chosen GPU: 1 − temperature / slowdown, in [0, 1]."""
    chosen = {g.gpu_uuid for g in placement.grants}
    gpus = [g for g in state.inventory.gpus if g.uuid in chosen]
    if not gpus:
        return 1.0
    return min(max(0.0, 1.0 - g.temperature_c / g.slowdown_temp_c) if g.slowdown_temp_c > 0
               else 0.0 for g in gpus)


def locality_term(state: NodeState, demand: PodDemand) -> float:
    """1 if the job's dataset is cached on the node (or it names none), else 0."""
    return 1.0 if not demand.dataset or demand.dataset in state.inventory.datasets else 0.0


def node_score(state: NodeState, demand: PodDemand, placement: Placement, policy: str,
               weights: Weights) -> float:
    """Weighted mean of the terms, in [0, 1]; higher is better."""
    packing = packing_term(state, placement)
    if policy == Policy.SPREAD:
        packing = 1.0 - packing
    total = weights.packing + weights.temperature + weights.locality
    return (weights.packing * packing
            + weights.temperature * temperature_term(state, placement)
            + weights.locality * locality_term(state, demand)) / total


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
