"""How good a node (and which GPUs on it) is for a pod: pure score terms and their combination.

Every term is a pure function with values in [0, 1] (1 = best) and its formula in its docstring.
The extender's prioritize and bind, the operator's admission hints and the placement benchmark
all go through `Scorer.plan`, so the replayed numbers are the extender's.

A node is reduced to a `NodeProfile` (hashable: free CPU and memory, and per usable GPU its
model, idle compute in milli and free memory). Identical nodes share a profile, so a scorer
memoises fragmentation and plans per profile, and the replay scores each distinct profile
once per demand shape instead of every node for every pod (a few seconds per 10,800-pod
replay over 1,213 nodes, pure Python).
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from carpool.core.placement import TEMPERATURE_MARGIN_C, NodeState
from carpool.core.resources import Gpu, GpuRequest, Isolation
from carpool.core.workload import MILLI_PER_GPU, Demand, TargetWorkload

UNLIMITED = 1 << 62  # free CPU or memory on a node that does not report a limit
FRAGMENTATION_SCALE_MILLI = 1000.0  # a change of one whole GPU moves the term by sigmoid(1)
COOL_TEMPERATURE_C = 30.0  # at or below this a GPU counts as fully cool
LOCALITY_SCALE_GIB_HOPS = 100.0  # moving 100 GiB one hop costs half the locality term
MAX_MEMO_ENTRIES = 500_000  # a long-running extender clears its memo past this


class GpuSlot(NamedTuple):
    """One usable GPU as placement sees it."""

    model: str
    idle_milli: int  # compute left, in thousandths of the GPU
    memory_free_mib: int


class NodeProfile(NamedTuple):
    """What scoring needs about a node; equal for nodes that are interchangeable."""

    cpu_free_milli: int
    memory_free_mib: int
    cpu_total_milli: int  # 0: not constrained
    gpus: tuple[GpuSlot, ...]  # usable GPUs, sorted
    memory_total_mib: int = 0  # 0: not known (only the peers' policies read it)

    @property
    def idle_milli(self) -> int:
        total = 0
        for slot in self.gpus:
            total += slot.idle_milli
        return total


class Strategy(enum.Enum):
    """Binpack fills nodes that are already in use; spread prefers the emptiest nodes."""

    BINPACK = "binpack"
    SPREAD = "spread"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        try:
            return cls(text.lower())
        except ValueError:
            raise ValueError(f"unknown strategy {text!r}; expected binpack or spread") from None


@dataclass(frozen=True)
class ScoringPolicy:
    """Weights of the score terms (any non-negative numbers; the score divides by their sum).

    The defaults are Carpool's policy, chosen on the openb replays (docs/benchmarks.md):
    FGD's fragmentation and the CPU balance weigh the same, a little model scarcity keeps
    flexible pods off the GPU models constrained pods need, packing is off (as a tie-break it
    lost to first-fit by node order), and temperature and locality only decide between nodes
    that are otherwise close. `strategy` SPREAD inverts the packing term.
    `cpu_scale_milli` and `gpu_scale_milli` normalise leftovers in the packing term: the
    largest node's CPU and GPU capacity (the openb cluster's are 128 cores and 8 GPUs).
    """

    fragmentation: float = 1.0
    balance: float = 1.0
    scarcity: float = 0.05
    packing: float = 0.0
    alignment: float = 0.0
    temperature: float = 0.02
    locality: float = 0.2
    strategy: Strategy = Strategy.BINPACK
    cpu_scale_milli: int = 128_000
    gpu_scale_milli: int = 8 * MILLI_PER_GPU

    def __post_init__(self) -> None:
        weights = (self.fragmentation, self.balance, self.scarcity, self.packing,
                   self.alignment, self.temperature, self.locality)
        if any(w < 0 or math.isnan(w) for w in weights) or sum(weights) <= 0:
            raise ValueError("score weights must be non-negative with a positive sum")
        if self.cpu_scale_milli <= 0 or self.gpu_scale_milli <= 0:
            raise ValueError("packing scales must be positive")

    @property
    def profile_weight(self) -> float:
        """Total weight of the terms that depend on the node profile alone."""
        return (self.fragmentation + self.balance + self.scarcity + self.packing
                + self.alignment)


# Presets: the published baselines, reimplemented on the same terms, and Carpool's default.
BEST_FIT = ScoringPolicy(fragmentation=0.0, balance=0.0, scarcity=0.0, packing=1.0,
                         temperature=0.0, locality=0.0)
DOT_PRODUCT = ScoringPolicy(fragmentation=0.0, balance=0.0, scarcity=0.0, alignment=1.0,
                            temperature=0.0, locality=0.0)
FGD = ScoringPolicy(fragmentation=1.0, balance=0.0, scarcity=0.0, temperature=0.0,
                    locality=0.0)
CARPOOL = ScoringPolicy()
PRESETS = {"best-fit": BEST_FIT, "dot-product": DOT_PRODUCT, "fgd": FGD, "carpool": CARPOOL}


@dataclass(frozen=True)
class Dataset:
    """A dataset a job reads: its size and the zones that hold a copy."""

    name: str
    size_gib: float
    zones: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.size_gib < 0:
            raise ValueError("dataset size must not be negative")


@dataclass(frozen=True)
class Plan:
    """The best way to put one demand on one node: its score, GPU slots and the node after."""

    score: float  # in [0, 1]
    slots: tuple[GpuSlot, ...]  # the GPU slots taken (one per GPU of the demand)
    after: NodeProfile
    fragmentation_delta: float  # F(after) - F(before), milli-GPU


# --- profiles -------------------------------------------------------------------------------


def gpu_slot(gpu: Gpu, memory_free_mib: int, cores_free_pct: int, grants: int = 0) -> GpuSlot:
    """A GPU's slot: idle = 10 x free cores % (at most 999 once anything is granted on it, so
    only an untouched GPU can be taken whole, as the filter demands), and its free memory."""
    idle = max(0, min(cores_free_pct * MILLI_PER_GPU // 100, MILLI_PER_GPU))
    if grants and idle == MILLI_PER_GPU:
        idle -= 1
    return GpuSlot(gpu.model, idle, max(memory_free_mib, 0))


def usable(gpu: Gpu) -> bool:
    """Whether placement may use this GPU at all (healthy, not cordoned, not near slowdown)."""
    return (gpu.healthy and not gpu.cordoned
            and gpu.temperature_c < gpu.slowdown_temp_c - TEMPERATURE_MARGIN_C)


def doubtful_gpus(node: NodeState, isolation: Isolation) -> frozenset[int]:
    """GPUs (indices) where a slot that fits a request of this isolation does not imply the
    fit rules (`placement.gpu_rejection`) accept it: every GPU for MIG (instances are not
    in the slot), over-booked GPUs (negative free memory or cores, which a slot clamps to
    0), GPUs partitioned into MIG instances, for MPS the GPUs whose MPS ceiling is below
    100 %, for the others the GPUs that run MPS clients only, and GPUs whose jobs limit how
    far they are shared (`core.interference`). Elsewhere a fitting slot is accepted
    (tests/unit/core/test_gpu_choice.py)."""
    if isolation is Isolation.MIG:
        return frozenset(g.index for g in node.inventory.gpus)
    mps = isolation is Isolation.MPS
    return frozenset(f.gpu.index for f in node.free()
                     if f.memory_mib < 0 or f.cores_pct < 0 or f.gpu.mig_instances
                     or f.sharing_limit
                     or (mps and f.gpu.mps_ceiling_pct < 100)
                     or (not mps and f.gpu.exclusive_process))


def profile_of(node: NodeState) -> NodeProfile:
    """The node's profile: its usable GPUs that are not held exclusively."""
    inv = node.inventory
    slots = []
    for free in node.free():
        if usable(free.gpu) and not free.exclusive_taken:
            slots.append(gpu_slot(free.gpu, free.memory_mib, free.cores_pct, free.grants))
    cpu_free = inv.cpu_milli - node.cpu_used_milli if inv.cpu_milli > 0 else UNLIMITED
    memory_free = inv.memory_mib - node.memory_used_mib if inv.memory_mib > 0 else UNLIMITED
    return NodeProfile(cpu_free, memory_free, inv.cpu_milli, tuple(sorted(slots)))


def slot_fits(slot: GpuSlot, demand: Demand) -> bool:
    return (slot.idle_milli >= demand.gpu_milli and slot.memory_free_mib >= demand.gpu_memory_mib
            and demand.allows_model(slot.model))


def fits(profile: NodeProfile, demand: Demand) -> bool:
    """CPU and memory are hard limits; `gpu_count` GPUs must each fit one GPU's share."""
    if (profile.cpu_free_milli < demand.cpu_milli
            or profile.memory_free_mib < demand.memory_mib):
        return False
    needed = demand.gpu_count
    if needed == 0:
        return True
    need, need_memory, models = demand.gpu_milli, demand.gpu_memory_mib, demand.models
    for model, idle, memory in profile.gpus:
        if idle >= need and memory >= need_memory and (not models or model in models):
            needed -= 1
            if needed == 0:
                return True
    return False


def take(profile: NodeProfile, demand: Demand, slots: Sequence[GpuSlot]) -> NodeProfile:
    """The profile after `demand` takes `slots` (one per GPU); raises if a slot is missing."""
    remaining = list(profile.gpus)
    for slot in slots:
        remaining.remove(slot)
        remaining.append(GpuSlot(slot.model, slot.idle_milli - demand.gpu_milli,
                                 slot.memory_free_mib - demand.gpu_memory_mib))
    return NodeProfile(profile.cpu_free_milli - demand.cpu_milli,
                       profile.memory_free_mib - demand.memory_mib,
                       profile.cpu_total_milli, tuple(sorted(remaining)),
                       profile.memory_total_mib)


# --- score terms (each pure, in [0, 1], 1 = best) --------------------------------------------


def fragmentation(profile: NodeProfile, workload: TargetWorkload) -> float:
    """F_n(M) = sum_m p_m F_n(m), in milli-GPU (FGD's fragmentation of node n for workload M).

    F_n(m) = the node's whole idle GPU if m cannot fit (CPU, memory, model or not enough GPUs
    that can each take m's share); otherwise sum of idle_g over the GPUs g that cannot take m.
    (A `Scorer` compiles its workload once and memoises per profile; this compiles each call.)
    """
    return _fragmentation(profile, _CompiledWorkload(workload))


def _fragmentation(profile: NodeProfile, compiled: _CompiledWorkload) -> float:
    """`fragmentation` against a compiled workload."""
    slots = profile.gpus
    idle_total = 0
    for s in slots:
        idle_total += s.idle_milli
    if idle_total == 0 or not compiled.gpu_parts:
        return 0.0
    usable = compiled.usable.get(slots)
    if usable is None:
        usable = compiled.usable_idle(slots)
    cpu_free = profile.cpu_free_milli
    memory_free = profile.memory_free_mib
    # Integer arithmetic throughout: equal fragmentation must compare equal, or float noise
    # (not the policy) decides between nodes that tie.
    usable_sum = 0  # sum over fitting shapes of w_m x (idle on GPUs that can take m)
    for usable_idle, hosts, (cpus, prefix) in zip(usable, compiled.hosts, compiled.by_cpu,
                                                  strict=True):
        if not usable_idle:
            continue
        if cpus:  # no host memory in this group's shapes: weights of shapes with cpu <= free
            usable_sum += prefix[bisect.bisect_right(cpus, cpu_free)] * usable_idle
            continue
        for cpu, memory_mib, w in hosts:
            if cpu <= cpu_free and memory_mib <= memory_free:
                usable_sum += w * usable_idle
    weight_total = compiled.weight_total
    return (weight_total * idle_total - usable_sum) / weight_total


WEIGHT_RESOLUTION = 1 << 24  # probabilities become integer weights of this resolution


class _CompiledWorkload:
    """A workload's shapes grouped by GPU part (count, share, memory, models) with integer
    weights, plus a memo of how much idle GPU each group can use on a given set of GPUs."""

    def __init__(self, workload: TargetWorkload) -> None:
        groups: dict[tuple[int, int, int, frozenset[str]], list[tuple[int, int, int]]] = {}
        total = 0
        for demand, p in workload.shapes:
            key = (demand.gpu_count, demand.gpu_milli, demand.gpu_memory_mib, demand.models)
            weight = max(1, round(p * WEIGHT_RESOLUTION))
            total += weight
            groups.setdefault(key, []).append((demand.cpu_milli, demand.memory_mib, weight))
        self.workload = workload
        self.gpu_parts = tuple(groups)
        self.hosts = tuple(tuple(hosts) for hosts in groups.values())
        # Per group, when none of its shapes asks for host memory: CPU demands sorted, and
        # prefix sums of their weights (empty when memory matters and hosts must be scanned).
        self.by_cpu: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = tuple(
            _cpu_index(hosts) for hosts in self.hosts)
        self.weight_total = max(total, 1)
        self.usable: dict[tuple[GpuSlot, ...], tuple[int, ...]] = {}

    def usable_idle(self, slots: tuple[GpuSlot, ...]) -> tuple[int, ...]:
        """Per group: idle on the GPUs that can take its share, or 0 if too few can."""
        distinct = _distinct_slots(slots)
        out = []
        for count, need, need_memory, models in self.gpu_parts:
            usable_count = 0
            usable_idle = 0
            for (model, idle, memory), n in distinct:
                if idle >= need and memory >= need_memory and (not models or model in models):
                    usable_count += n
                    usable_idle += n * idle
            out.append(usable_idle if usable_count >= count else 0)
        if len(self.usable) > MAX_MEMO_ENTRIES:
            self.usable.clear()
        result = self.usable[slots] = tuple(out)
        return result


def _cpu_index(hosts: tuple[tuple[int, int, int], ...]
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if any(memory for _, memory, _ in hosts):
        return (), ()
    ordered = sorted((cpu, w) for cpu, _, w in hosts)
    prefix = [0]
    for _, w in ordered:
        prefix.append(prefix[-1] + w)
    return tuple(cpu for cpu, _ in ordered), tuple(prefix)


def _distinct_slots(slots: tuple[GpuSlot, ...]) -> list[tuple[GpuSlot, int]]:
    """Sorted slots as (slot, multiplicity) runs."""
    runs: list[tuple[GpuSlot, int]] = []
    for slot in slots:
        if runs and runs[-1][0] == slot:
            runs[-1] = (slot, runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def fragmentation_term(delta_milli: float, scale: float = FRAGMENTATION_SCALE_MILLI) -> float:
    """sigmoid(-dF / scale) = 1 / (1 + exp(dF / scale)); dF = F(after) - F(before).

    0.5 when placing leaves fragmentation unchanged; above when it fills fragmented GPUs.
    FGD's own node score is the same sigmoid, rounded to an integer 0..100; unrounded here.
    """
    x = delta_milli / scale
    if x > 700:
        return 0.0
    return 1.0 / (1.0 + math.exp(x))


def stranded_gpu(profile: NodeProfile, cpu_per_gpu_milli: float) -> float:
    """S_n = max(0, idle_gpu - cpu_free / rho), in milli-GPU: idle GPU the node's free CPU
    cannot feed when pods bring rho CPU milli per milli-GPU (the target workload's ratio).

    0 for nodes without a CPU limit, or when rho is 0.
    """
    if profile.cpu_total_milli <= 0 or cpu_per_gpu_milli <= 0:
        return 0.0
    return max(0.0, profile.idle_milli - profile.cpu_free_milli / cpu_per_gpu_milli)


def balance_term(delta_stranded_milli: float,
                 scale: float = FRAGMENTATION_SCALE_MILLI) -> float:
    """sigmoid(-dS / scale), dS = S(after) - S(before) from `stranded_gpu`.

    FGD counts CPU only when it blocks the very next pod; this term sees CPU running out a
    few pods ahead, so CPU-heavy pods go where CPU is plentiful relative to idle GPU.
    """
    return fragmentation_term(delta_stranded_milli, scale)


def model_pressure(workload: TargetWorkload, supply: Mapping[str, int]) -> dict[str, float]:
    """pi_X = sum over shapes m that name models and allow X of p_m g_m / supply(models_m),
    divided by the largest pi (so in [0, 1]); g_m is m's GPU milli, supply counts GPUs.

    How much of model X the model-constrained part of the workload needs, per GPU of X.
    """
    raw: dict[str, float] = {}
    for demand, p in workload.shapes:
        if not demand.models:
            continue
        allowed = sum(supply.get(model, 0) for model in demand.models)
        if allowed <= 0:
            continue
        for model in demand.models:
            if supply.get(model, 0) > 0:
                raw[model] = raw.get(model, 0.0) + p * demand.gpu_total_milli / allowed
    top = max(raw.values(), default=0.0)
    return {model: value / top for model, value in raw.items()} if top > 0 else {}


def scarcity_term(models: Sequence[str], pressure: Mapping[str, float]) -> float:
    """1 - mean over the GPUs taken of pi_model (see `model_pressure`); 1 without GPUs.

    Pods that may run anywhere should leave the models that constrained pods need.
    """
    if not models:
        return 1.0
    return 1.0 - sum(pressure.get(model, 0.0) for model in models) / len(models)


def packing_term(after: NodeProfile, cpu_scale_milli: int, gpu_scale_milli: int) -> float:
    """Best fit: 1 - [0.5 cpu_left / cpu_scale + 0.5 gpu_left / gpu_scale], clamped to [0, 1].

    cpu_left and gpu_left are what the node has free after the placement (gpu in milli).
    A node without a CPU limit contributes no CPU part.
    """
    cpu_left = after.cpu_free_milli if after.cpu_total_milli > 0 else 0
    value = 1.0 - 0.5 * cpu_left / cpu_scale_milli - 0.5 * after.idle_milli / gpu_scale_milli
    return min(1.0, max(0.0, value))


def alignment_term(before: NodeProfile, demand: Demand) -> float:
    """Tetris' dot product, lower is better: 1 - (r_cpu f_cpu + r_gpu f_gpu) / 2.

    r = demand / node capacity and f = free / node capacity, per resource (GPU capacity is
    1000 per usable GPU); both in [0, 1].
    """
    gpu_capacity = MILLI_PER_GPU * len(before.gpus)
    dot = 0.0
    if before.cpu_total_milli > 0:
        dot += (min(demand.cpu_milli, before.cpu_total_milli) / before.cpu_total_milli
                * min(before.cpu_free_milli, before.cpu_total_milli) / before.cpu_total_milli)
    if gpu_capacity > 0:
        dot += (min(demand.gpu_total_milli, gpu_capacity) / gpu_capacity
                * min(before.idle_milli, gpu_capacity) / gpu_capacity)
    return 1.0 - dot / 2.0


def temperature_term(temperature_c: float, slowdown_c: float,
                     cool_c: float = COOL_TEMPERATURE_C) -> float:
    """Prefer cool GPUs (hot ones throttle): (slowdown - t) / (slowdown - cool), clamped.

    1 at or below `cool_c`, 0 at the GPU's slowdown temperature.
    """
    if slowdown_c <= cool_c:
        return 1.0 if temperature_c <= cool_c else 0.0
    return min(1.0, max(0.0, (slowdown_c - temperature_c) / (slowdown_c - cool_c)))


def zone_hops(zone: str, dataset_zones: Iterable[str]) -> int:
    """Distance to the nearest copy: 1 same zone, 2 same region (zone minus its last '-part'),
    3 elsewhere or unknown."""
    best = 3
    region = zone.rsplit("-", 1)[0] if zone else ""
    for other in dataset_zones:
        if zone and other == zone:
            return 1
        if region and other.rsplit("-", 1)[0] == region:
            best = 2
    return best


def locality_term(cached: bool, size_gib: float, hops: int,
                  scale: float = LOCALITY_SCALE_GIB_HOPS) -> float:
    """1 if the dataset is cached on the node, else 1 / (1 + size_gib x hops / scale).

    The cost of fetching grows with the data moved and the distance it travels.
    """
    if cached:
        return 1.0
    return 1.0 / (1.0 + max(size_gib, 0.0) * max(hops, 0) / scale)


def combine(weights_and_terms: Iterable[tuple[float, float]]) -> float:
    """sum w_i t_i / sum w_i over the terms with positive weight (0 if none)."""
    num = 0.0
    den = 0.0
    for weight, term in weights_and_terms:
        if weight > 0:
            num += weight * term
            den += weight
    return num / den if den > 0 else 0.0


# --- planning -------------------------------------------------------------------------------


class Scorer:
    """A policy plus a target workload, with memos keyed by profile (safe to share; pure)."""

    def __init__(self, policy: ScoringPolicy = CARPOOL,
                 workload: TargetWorkload | None = None,
                 supply: Mapping[str, int] | None = None) -> None:
        """`supply`: GPUs per model in the cluster (for the scarcity term)."""
        self.policy = policy
        self.workload = workload if workload is not None else TargetWorkload()
        self._cpu_per_gpu = self.workload.cpu_per_gpu_milli
        self._pressure = model_pressure(self.workload, supply or {})
        self._compiled = _CompiledWorkload(self.workload)
        self._fragmentation: dict[NodeProfile, float] = {}
        self._plans: dict[tuple[NodeProfile, Demand], Plan | None] = {}

    def fragmentation(self, profile: NodeProfile) -> float:
        """Memoised `fragmentation(profile, workload)`."""
        value = self._fragmentation.get(profile)
        if value is None:
            if len(self._fragmentation) > MAX_MEMO_ENTRIES:
                self._fragmentation.clear()
            value = self._fragmentation[profile] = _fragmentation(profile, self._compiled)
        return value

    def profile_score(self, before: NodeProfile, after: NodeProfile, demand: Demand,
                      delta: float, slots: Sequence[GpuSlot] = (),
                      stranded_before: float | None = None) -> float:
        """The policy's profile terms combined: `combine` over fragmentation, balance,
        scarcity, packing and alignment, in [0, 1]. `stranded_before` may be passed in when
        the caller already has it (it is the same for every GPU choice on a node)."""
        policy = self.policy
        num = 0.0
        den = 0.0
        weight = policy.fragmentation
        if weight > 0:
            num += weight * fragmentation_term(delta)
            den += weight
        weight = policy.balance
        if weight > 0:
            rho = self._cpu_per_gpu
            if stranded_before is None:
                stranded_before = stranded_gpu(before, rho)
            num += weight * balance_term(stranded_gpu(after, rho) - stranded_before)
            den += weight
        weight = policy.scarcity
        if weight > 0:
            if self._pressure:
                num += weight * scarcity_term([s.model for s in slots], self._pressure)
            else:
                num += weight  # no model is scarce: the term is 1 everywhere
            den += weight
        weight = policy.packing
        if weight > 0:
            packing = packing_term(after, policy.cpu_scale_milli, policy.gpu_scale_milli)
            num += weight * (1.0 - packing if policy.strategy is Strategy.SPREAD else packing)
            den += weight
        weight = policy.alignment
        if weight > 0:
            num += weight * alignment_term(before, demand)
            den += weight
        return num / den if den > 0 else 0.0

    def plan(self, profile: NodeProfile, demand: Demand) -> Plan | None:
        """Best GPU slots for `demand` on a node with this profile, or None if it cannot fit.

        GPUs are chosen one at a time by the same score as nodes; ties go to the GPU with the
        least idle compute (tightest fit), then the least free memory.
        """
        key = (profile, demand)
        try:
            return self._plans[key]
        except KeyError:
            pass
        if len(self._plans) > MAX_MEMO_ENTRIES:
            self._plans.clear()
        result = self._plans[key] = self.plan_uncached(profile, demand)
        return result

    def plan_uncached(self, profile: NodeProfile, demand: Demand) -> Plan | None:
        """`plan` without its memo, for callers that memoise by their own keys."""
        return self._plan(profile, demand) if fits(profile, demand) else None

    def plan_among(self, profile: NodeProfile, demand: Demand,
                   allowed: Mapping[GpuSlot, int]) -> Plan | None:
        """`plan` with the GPUs limited to `allowed` (slots of `profile`, and how many GPUs of
        each may be taken), without checking CPU and memory; None if fewer than the demand's
        GPUs are allowed. The GPU choice where the filter's rules accept fewer GPUs than the
        scorer's view (`gpu_choice`); not memoised (it is the rare path)."""
        if sum(n for n in allowed.values() if n > 0) < demand.gpu_count:
            return None
        return self._plan(profile, demand, dict(allowed))

    def _plan(self, profile: NodeProfile, demand: Demand,
              allowed: dict[GpuSlot, int] | None = None) -> Plan:
        """The greedy behind `plan` and `plan_among`: `allowed` None = every slot that fits
        the demand (`slot_fits`), as many of each as the profile has."""
        use_fragmentation = self.policy.fragmentation > 0
        before_f = self.fragmentation(profile) if use_fragmentation else 0.0
        if demand.gpu_count == 0:
            after = take(profile, demand, ())
            delta = self.fragmentation(after) - before_f if use_fragmentation else 0.0
            return Plan(self.profile_score(profile, after, demand, delta), (), after, delta)
        chosen: list[GpuSlot] = []
        best: tuple[float, int, int] = (0.0, 0, 0)
        best_after = profile
        best_delta = 0.0
        remaining = list(profile.gpus)
        stranded_before = (stranded_gpu(profile, self._cpu_per_gpu)
                           if self.policy.balance > 0 else 0.0)
        for _ in range(demand.gpu_count):
            if allowed is None:
                candidates = sorted({s for s in remaining if slot_fits(s, demand)})
            else:
                candidates = sorted(s for s, n in allowed.items() if n > 0)
            best_slot: GpuSlot | None = None
            for slot in candidates:
                after = take(profile, demand, (*chosen, slot))
                delta = self.fragmentation(after) - before_f if use_fragmentation else 0.0
                score = self.profile_score(profile, after, demand, delta, (*chosen, slot),
                                           stranded_before)
                rank = (score, -slot.idle_milli, -slot.memory_free_mib)
                if best_slot is None or rank > best:
                    best, best_slot, best_after, best_delta = rank, slot, after, delta
            if best_slot is None:  # fits() said enough GPUs fit; unreachable
                raise AssertionError("no GPU fits a demand that fits")
            chosen.append(best_slot)
            remaining.remove(best_slot)
            if allowed is not None:
                allowed[best_slot] -= 1
        return Plan(best[0], tuple(chosen), best_after, best_delta)


# --- the extender's entry points ------------------------------------------------------------


class SlotGpu(NamedTuple):
    """A usable GPU behind a slot: its index (also as a 1-tuple, the usual answer, made once
    per node state rather than per score) and its temperature term."""

    gpu_index: int
    alone: tuple[int]
    temperature: float


GpusBySlot = dict[GpuSlot, tuple[SlotGpu, ...]]


def gpus_by_slot(node: NodeState, exclusive: bool) -> GpusBySlot:
    """Usable GPUs per slot, coolest first, then lowest index;
    `exclusive` leaves out GPUs that already carry a grant."""
    candidates: list[tuple[float, int, GpuSlot]] = []
    for free in node.free():
        if not usable(free.gpu) or free.exclusive_taken or (exclusive and free.grants):
            continue
        slot = gpu_slot(free.gpu, free.memory_mib, free.cores_pct, free.grants)
        candidates.append((free.gpu.temperature_c, free.gpu.index, slot))
    candidates.sort(key=lambda c: (c[0], c[1]))
    terms = {g.index: temperature_term(g.temperature_c, g.slowdown_temp_c)
             for g in node.inventory.gpus}
    by_slot: dict[GpuSlot, list[SlotGpu]] = {}
    for _, index, slot in candidates:
        by_slot.setdefault(slot, []).append(SlotGpu(index, (index,), terms[index]))
    return {slot: tuple(gpus) for slot, gpus in by_slot.items()}


class PlanNotOnNode(Exception):
    """A planned slot has no GPU behind it in the node's GPUs by slot: the profile (every
    usable GPU not held exclusively) saw a GPU that the slot map for this request leaves out
    (for an exclusive request, GPUs that carry any grant). `gpu_choice` then plans among
    the GPUs the fit rules accept."""


_NOT_PLANNED = Plan(0.0, (), NodeProfile(0, 0, 0, ()), 0.0)  # a plans-memo miss


class RequestScorer:
    """A node's score in [0, 1] and the GPUs it would use, for one request (with the pod's CPU,
    memory and dataset) under one scorer: combine(profile terms from `Scorer.plan`,
    temperature of the chosen GPUs, data locality) with the scorer's policy weights.

    The extender scores every candidate node for each new demand shape, so what does not
    depend on the node (the scorer's demand, the weights, the dataset) is worked out here
    once, and `score` does only the per-node part: the profile's plan (memoised per
    profile: identical nodes share it), the plan's GPUs on this node, and the temperature
    and locality terms. `score_with` takes the node's profile and GPUs by slot from a caller
    that keeps them per node state (the extender).
    """

    __slots__ = ("_den", "_plans", "_w_locality", "_w_profile", "_w_temperature", "dataset",
                 "demand", "exclusive", "request", "scorer")

    def __init__(self, request: GpuRequest, scorer: Scorer, *, cpu_milli: int = 0,
                 memory_mib: int = 0, dataset: Dataset | None = None) -> None:
        self.scorer = scorer
        self.request = request
        self.demand = Demand.from_request(request, cpu_milli=cpu_milli, memory_mib=memory_mib)
        self.dataset = dataset
        self.exclusive = request.isolation is Isolation.EXCLUSIVE  # which `gpus_by_slot`
        policy = scorer.policy
        self._w_profile = policy.profile_weight
        self._w_temperature = policy.temperature
        self._w_locality = policy.locality
        self._den = self._w_profile + self._w_temperature + self._w_locality
        self._plans: dict[NodeProfile, Plan | None] = {}

    def score(self, node: NodeState) -> tuple[float, tuple[int, ...]] | None:
        """The node's score in [0, 1] and the GPU indices, or None if the demand cannot fit.

        Raises `PlanNotOnNode` where a planned slot has no GPU behind it on the node."""
        return self.score_with(node, profile_of(node), gpus_by_slot(node, self.exclusive))

    def score_with(self, node: NodeState, profile: NodeProfile, by_slot: GpusBySlot
                   ) -> tuple[float, tuple[int, ...]] | None:
        """`score`, given the node's `profile_of` and its `gpus_by_slot` for this request."""
        plan = self.plan_of(profile)
        if plan is None:
            return None
        slots = plan.slots
        indices: tuple[int, ...]
        if len(slots) == 1:  # the common case, without the bookkeeping of repeated slots
            gpus = by_slot.get(slots[0])
            if not gpus:
                raise PlanNotOnNode(f"plan slot {slots[0]} has no GPU on node {node.name}")
            _, indices, temperature = gpus[0]
        else:
            indices, temperature = gpus_for(node, by_slot, slots)
        return self.combine(node, plan.score, temperature), indices

    def plan_of(self, profile: NodeProfile) -> Plan | None:
        """`Scorer.plan` of this request's demand on a node with this profile (memoised)."""
        plans = self._plans
        plan = plans.get(profile, _NOT_PLANNED)
        if plan is _NOT_PLANNED:
            if len(plans) > MAX_MEMO_ENTRIES:
                plans.clear()
            plan = plans[profile] = self.scorer.plan(profile, self.demand)
        return plan

    def ceiling(self, plan_score: float, temperature: float) -> float:
        """`combine` with the locality term at its best (1): no node whose plan scores
        `plan_score` and whose GPUs' temperature terms are at most `temperature` scores more
        (the same operations on terms as large or larger, so the rounding agrees)."""
        num = self._w_profile * plan_score + self._w_temperature * temperature
        num += self._w_locality
        return num / self._den if self._den > 0 else 0.0

    def combine(self, node: NodeState, plan_score: float, temperature: float) -> float:
        """The node's score from its plan's score and its GPUs' mean temperature term:
        `combine` over (profile terms, temperature, locality), written out: a term of weight 0
        adds exactly 0.0, so the sum is the same float as `combine`'s."""
        num = self._w_profile * plan_score + self._w_temperature * temperature
        if self.dataset is None:
            num += self._w_locality  # the locality term is 1 without a dataset
        else:
            dataset = self.dataset
            num += self._w_locality * locality_term(
                dataset.name in node.inventory.datasets, dataset.size_gib,
                zone_hops(node.inventory.zone, dataset.zones))
        return num / self._den if self._den > 0 else 0.0


def gpus_for(node: NodeState, by_slot: Mapping[GpuSlot, tuple[SlotGpu, ...]],
              slots: Sequence[GpuSlot]) -> tuple[tuple[int, ...], float]:
    """Concrete GPU indices for the plan's slots (among equal slots the coolest, then the
    lowest index) and their mean temperature term (1 without GPUs). Where the node knows its
    GPUs' NVLink peers or NUMA nodes, several GPUs are the closest set (`closest_gpus`)."""
    if len(slots) > 1 and any(g.nvlink_peers or g.numa_node >= 0 for g in node.inventory.gpus):
        return closest_gpus(node, by_slot, slots)
    chosen: list[int] = []
    terms: list[float] = []
    taken: dict[GpuSlot, int] = {}
    for slot in slots:
        gpus = by_slot.get(slot, ())
        k = taken.get(slot, 0)
        if k >= len(gpus):
            raise PlanNotOnNode(f"plan slot {slot} has no GPU on node {node.name}")
        gpu = gpus[k]
        chosen.append(gpu.gpu_index)
        terms.append(gpu.temperature)
        taken[slot] = k + 1
    return tuple(chosen), (sum(terms) / len(terms) if terms else 1.0)


def closeness(gpus: Sequence[Gpu]) -> tuple[int, int]:
    """How close a set of GPUs sits: (pairs joined by NVLink, pairs on one NUMA node); more is
    closer (collectives between them cross fewer hops)."""
    nvlink = sum(1 for i, a in enumerate(gpus) for b in gpus[i + 1:]
                 if b.index in a.nvlink_peers or a.index in b.nvlink_peers)
    numa = sum(1 for i, a in enumerate(gpus) for b in gpus[i + 1:]
               if a.numa_node >= 0 and a.numa_node == b.numa_node)
    return nvlink, numa


def closest_gpus(node: NodeState, by_slot: Mapping[GpuSlot, tuple[SlotGpu, ...]],
                 slots: Sequence[GpuSlot]) -> tuple[tuple[int, ...], float]:
    """`gpus_for` on a node that knows its topology: the plan's slots filled from each GPU
    the plan could start with, each next GPU the one of its slot closest to those chosen so
    far (NVLink peers first, then the same NUMA node, then the coolest); of these sets the
    closest (`closeness`), ties to the one `gpus_for`'s plain order starts with."""
    by_index = {g.index: g for g in node.inventory.gpus}
    starts = list(dict.fromkeys(g.gpu_index for slot in dict.fromkeys(slots)
                                for g in by_slot.get(slot, ())))
    best: tuple[tuple[int, int], tuple[int, ...], float] | None = None
    for start in starts:
        chosen: list[SlotGpu] = []
        for n, slot in enumerate(slots):
            left = [g for g in by_slot.get(slot, ()) if g not in chosen]
            if not left:
                raise PlanNotOnNode(f"plan slot {slot} has no GPU on node {node.name}")
            if n == 0:
                first = next((g for g in left if g.gpu_index == start), None)
                if first is None:
                    break  # the plan's first slot cannot start from this GPU
                chosen.append(first)
                continue
            near = [by_index[c.gpu_index] for c in chosen]
            chosen.append(max(left, key=lambda g, near=near: (  # type: ignore[misc]
                sum(1 for c in near if g.gpu_index in c.nvlink_peers),
                sum(1 for c in near if c.numa_node >= 0
                    and c.numa_node == by_index[g.gpu_index].numa_node),
                -left.index(g))))
        else:
            found = closeness([by_index[c.gpu_index] for c in chosen])
            if best is None or found > best[0]:
                best = (found, tuple(c.gpu_index for c in chosen),
                        sum(c.temperature for c in chosen) / len(chosen))
    if best is None:
        raise PlanNotOnNode(f"no GPUs for the plan on node {node.name}")
    return best[1], best[2]
