"""Where a GPU request can go: the fit checks on one node, from a snapshot.

Shared by the extender (filter, prioritize, bind), the operator's admission check (admit only
what some GPU can hold now) and the GPU choice (`gpu_choice`), so they agree. Which GPUs a
request gets is `gpu_choice.choose_gpus`; which MIG instance of a chosen GPU, `grant_for`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    NodeInventory,
    Sharer,
)

TEMPERATURE_MARGIN_C = 5.0


@dataclass(frozen=True)
class GpuFree:
    """What is left on one GPU after the grants on it."""

    gpu: Gpu
    memory_mib: int
    cores_pct: int
    exclusive_taken: bool
    grants: int
    free_mig: tuple[str, ...]  # unused MIG instance UUIDs
    sharing_limit: float = 0  # the smallest limit of the jobs on it (0: none has one)
    sharers: tuple[Sharer, ...] = ()  # each job on it, for `sharing_rejection`


@dataclass(frozen=True)
class NodeState:
    """A node's inventory plus what is already granted on it (assumed or confirmed)."""

    inventory: NodeInventory
    grants: tuple[GpuGrant, ...] = ()
    cpu_used_milli: int = 0
    memory_used_mib: int = 0

    @property
    def name(self) -> str:
        return self.inventory.name

    def free(self) -> list[GpuFree]:
        """What is left on each GPU (computed on every call; `core.derived.DerivedState`
        keeps it for callers that ask again and again)."""
        return self._compute_free()

    def _compute_free(self) -> list[GpuFree]:
        by_gpu: dict[str, list[GpuGrant]] = {}
        for grant in self.grants:
            by_gpu.setdefault(grant.gpu_uuid, []).append(grant)
        return [gpu_free(gpu, by_gpu.get(gpu.uuid, [])) for gpu in self.inventory.gpus]

    def with_grants(self, grants: Iterable[GpuGrant]) -> NodeState:
        """This state with `grants` added (a state of the same kind)."""
        return type(self)(self.inventory, self.grants + tuple(grants), self.cpu_used_milli,
                          self.memory_used_mib)


def gpu_free(gpu: Gpu, held: list[GpuGrant]) -> GpuFree:
    """What is left on `gpu` after `held`, the grants on it in the order they were made."""
    used_mig = {g.mig_instance for g in held if g.mig_instance}
    memory, cores = _held(held)
    return GpuFree(
        gpu=gpu,
        memory_mib=gpu.memory_total_mib - memory,
        cores_pct=100 - cores,
        exclusive_taken=any(g.exclusive for g in held),
        grants=sum(1 for g in held if not g.lent),  # jobs on it (core.lending)
        free_mig=tuple(m.uuid for m in gpu.mig_instances if m.uuid not in used_mig),
        sharing_limit=_sharing_limit(held) if held else 0,
        sharers=tuple(g.sharer for g in held if not g.lent),
    )


def free_after(frees: Sequence[GpuFree], grants: tuple[GpuGrant, ...], kept: int
               ) -> list[GpuFree]:
    """`NodeState.free` of a state with `grants`, from `frees`, that of the same node with
    `grants[:kept]`: a GPU's free part depends on its own grants alone, so only the GPUs the
    grants after `kept` are on are worked out again (a what-if state is its node's state
    with one more job's grants)."""
    touched = {g.gpu_uuid for g in grants[kept:]}
    return [gpu_free(f.gpu, [g for g in grants if g.gpu_uuid == f.gpu.uuid])
            if f.gpu.uuid in touched else f for f in frees]


def _sharing_limit(held: list[GpuGrant]) -> float:
    """The smallest sharing limit of the grants on a GPU (0: none has one)."""
    limits = [g.sharing_limit for g in held if g.sharing_limit]
    return min(limits) if limits else 0


def _held(grants: list[GpuGrant]) -> tuple[int, int]:
    """Memory and cores the grants on one GPU keep from new owners: every owner's grant in
    full (the parts it lent included: an owner may grow into its grant at any time), plus
    whatever borrowers hold beyond the lent parts (left over when an owner ended)."""
    memory = cores = lent_memory = lent_cores = borrowed_memory = borrowed_cores = 0
    for g in grants:
        if g.borrowed:
            borrowed_memory += g.memory_mib
            borrowed_cores += g.cores_pct
            continue
        memory += g.memory_mib
        cores += g.cores_pct
        if g.lent:
            lent_memory += g.memory_mib
            lent_cores += g.cores_pct
    return (memory + max(0, borrowed_memory - lent_memory),
            cores + max(0, borrowed_cores - lent_cores))


def gpu_rejection(free: GpuFree, request: GpuRequest) -> str | None:
    """Why this GPU cannot take one GPU's worth of `request`, or None if it can."""
    gpu = free.gpu
    if not gpu.healthy:
        return f"GPU {gpu.index} is unhealthy"
    if gpu.cordoned:
        return f"GPU {gpu.index} is cordoned"
    if not request.allows_model(gpu.model):
        return f"GPU {gpu.index} is a {gpu.model}, job allows {', '.join(sorted(request.models))}"
    if gpu.temperature_c >= gpu.slowdown_temp_c - TEMPERATURE_MARGIN_C:
        return (f"GPU {gpu.index} is at {gpu.temperature_c:.0f}C, within "
                f"{TEMPERATURE_MARGIN_C:.0f}C of its slowdown {gpu.slowdown_temp_c:.0f}C")
    if free.exclusive_taken:
        return f"GPU {gpu.index} is held exclusively"
    if gpu.exclusive_process and request.isolation in (Isolation.TIMESLICE, Isolation.EXCLUSIVE):
        return (f"GPU {gpu.index} runs MPS clients only (compute mode EXCLUSIVE_PROCESS), job "
                f"wants {request.isolation.value}")
    if gpu.mig_instances and request.isolation is not Isolation.MIG:
        # in MIG mode a GPU runs work only inside its instances: CUDA sees no whole GPU
        return (f"GPU {gpu.index} is partitioned into MIG instances, job wants "
                f"{request.isolation.value}")
    if request.isolation is Isolation.EXCLUSIVE:
        if gpu.memory_total_mib < request.memory_mib:
            return (f"GPU {gpu.index} has {gpu.memory_total_mib // 1024} GiB, "
                    f"job needs {request.memory_mib // 1024} GiB")
        return None if free.grants == 0 else f"GPU {gpu.index} is shared, job needs it exclusively"
    if request.isolation is Isolation.MIG:
        fitting = [m for m in gpu.mig_instances
                   if m.uuid in free.free_mig and m.memory_mib >= request.memory_mib
                   and m.slices >= request.mig_slices]
        return None if fitting else f"GPU {gpu.index} has no free MIG instance that fits"
    if (why := sharing_rejection(free, request)) is not None:
        return why
    if request.isolation is Isolation.MPS and gpu.mps_ceiling_pct < 100 and (
            request.memory_mib > gpu.mps_ceiling_mib or request.cores_pct > gpu.mps_ceiling_pct):
        return (f"GPU {gpu.index} holds one MPS client to {gpu.mps_ceiling_mib // 1024} GiB and "
                f"{gpu.mps_ceiling_pct}% cores, job needs {request.memory_mib // 1024} GiB and "
                f"{request.cores_pct}% (ask for less, or for an exclusive GPU)")
    if free.memory_mib < request.memory_mib:
        return (f"GPU {gpu.index} has {free.memory_mib // 1024} GiB free, "
                f"job needs {request.memory_mib // 1024} GiB")
    if free.cores_pct < request.cores_pct:
        return f"GPU {gpu.index} has {free.cores_pct}% cores free, job needs {request.cores_pct}%"
    return None


SHARING_WOULD_BREAK = "sharing it by"  # how every sharing rejection reads (`why` finds it)


def sharing_rejection(free: GpuFree, request: GpuRequest) -> str | None:
    """Why one more job on this GPU would break an objective or pass the knee of the
    throughput curve (`core.interference`): the request's own limit for the GPU's model, or
    the limit of a job already there; None if every limit allows it.

    A limit was measured with copies of the job's own template, so a job counts each
    neighbour as the copies of itself the neighbour makes (`Sharer.counted_by`): as the pair
    was measured where it was (a light service may suffer from one heavy neighbour as from
    several copies of itself), else by weight (a heavy service keeps its measured limit while
    light neighbours fill the GPU)."""
    model = free.gpu.model
    degree = free.grants + 1
    newcomer = request.sharer(model)
    if newcomer.limit and not within_limit(newcomer, free.sharers):
        return (f"GPU {free.gpu.index} runs {free.grants} job(s); {SHARING_WOULD_BREAK} "
                f"{degree} would break this job's objective (its profile on {model} allows "
                f"{newcomer.limit:g}{_as_counted(newcomer, free.sharers)})")
    for n, held in enumerate(free.sharers):
        others = (*free.sharers[:n], *free.sharers[n + 1:], newcomer)
        if held.limit and not within_limit(held, others):
            return (f"GPU {free.gpu.index} runs {free.grants} job(s); {SHARING_WOULD_BREAK} "
                    f"{degree} would break the objective of a job there (its profile allows "
                    f"{held.limit:g}{_as_counted(held, others)})")
    return None


def counted_sharers(weight: int, others: list[int] | tuple[int, ...]) -> float:
    """How many jobs a GPU carries as a job of `weight` counts them by weight: itself, and
    each neighbour as the copies of itself the neighbour's weight makes (the GPU's load in
    units of this job's own). A profile's degree is this count with copies for company."""
    return 1 + sum(others) / max(1, weight)


def counted_company(job: Sharer, neighbours: Iterable[Sharer]) -> float:
    """How many jobs a GPU carries as `job` counts them (`Sharer.counted_by`): itself and
    each neighbour."""
    return float(1 + sum(other.counted_by(job) for other in neighbours))


def within_limit(job: Sharer, neighbours: Iterable[Sharer]) -> bool:
    """`counted_company(job, neighbours) <= job.limit`, in whole numbers (a limit is kept to
    the hundredth, a pair's count too)."""
    counted = sum((other.counted_by(job) for other in neighbours), Fraction(0))
    return counted * 100 <= round(job.limit * 100) - 100


ALIKE = Fraction(1)  # a company that counts as copies of itself (`sharing_cost`)


def sharing_cost(free: GpuFree, request: GpuRequest) -> Fraction:
    """How unlike its own copies the company on this GPU is to one more job, for choosing
    among the GPUs that accept it (`gpu_choice.choose_gpus`): the mean, over the newcomer
    and each job there, both ways, of the copies of one the other counts as
    (`Sharer.counted_by`). `ALIKE` (1) is company like copies of itself, and what an
    untouched GPU costs: a light service joins light company, heavy jobs gather with heavy
    ones, and a job whose only shared choices press on it (or it on them) harder than its
    own copies would takes a GPU of its own while one is left, instead of using up a
    budget that lighter company would have filled."""
    if not free.sharers:
        return ALIKE
    newcomer = request.sharer(free.gpu.model)
    counted = sum((newcomer.counted_by(held) + held.counted_by(newcomer)
                   for held in free.sharers), Fraction(0))
    return counted / (2 * len(free.sharers))


def _as_counted(job: Sharer, neighbours: tuple[Sharer, ...]) -> str:
    """What the count comes to where it is not one per job (else nothing)."""
    counted = counted_company(job, neighbours)
    if abs(counted - (len(neighbours) + 1)) < 1e-9:
        return ""
    paired = any(other.pair_count(job) is not None for other in neighbours)
    return f"; counted by {'measured pairs and ' if paired else ''}weight: {counted:.2f}"


def node_rejection(node: NodeState, request: GpuRequest) -> str | None:
    """Why `node` cannot take `request` now, or None; the reason is shown to users."""
    verdicts = gpu_verdicts(node, request)
    if isinstance(verdicts, str):
        return verdicts
    usable = verdicts.count(None)
    if usable >= request.count:
        return None
    shown = sorted({r for r in verdicts if r is not None})[:3]
    return f"{usable} of {request.count} GPUs fit; " + "; ".join(shown)


def rejection_by_conditions(inventory: NodeInventory, request: GpuRequest) -> str | None:
    """Why the empty node cannot take `request` for a passing condition (not ready, GPUs hot,
    unhealthy or cordoned) where it could with every GPU well; None when it can take it now,
    or could not even then (the request is too large for it)."""
    empty = NodeState(inventory, ())
    reason = node_rejection(empty, request)
    if reason is None:
        return None
    well = replace(inventory, ready=True, gpus=tuple(
        replace(g, healthy=True, cordoned=False, temperature_c=min(g.temperature_c, 0.0))
        for g in inventory.gpus))
    return reason if node_rejection(NodeState(well, ()), request) is None else None


def gpu_verdicts(node: NodeState, request: GpuRequest) -> str | list[str | None]:
    """Why the node as a whole cannot take `request` (not ready, the isolation not offered, no
    GPUs), or else each GPU's `gpu_rejection` (None: it can take one GPU's worth), in
    `node.free()` order."""
    inv = node.inventory
    if not inv.ready:
        return "node is not ready"
    if missing := sorted(request.node_selector - inv.labels):
        return ("node does not match the job's nodeSelector ("
                + ", ".join(f"{k}={v}" for k, v in missing) + ")")
    if request.isolation not in inv.sharing:
        return f"node does not offer {request.isolation.value} isolation"
    frees = node.free()
    if not frees:
        return "node has no GPUs"
    return [gpu_rejection(f, request) for f in frees]


def grant_for(free: GpuFree, request: GpuRequest) -> GpuGrant:
    """The grant one GPU gives to one GPU's worth of `request`."""
    gpu = free.gpu
    if request.isolation is Isolation.EXCLUSIVE:
        return GpuGrant(gpu.uuid, gpu.memory_total_mib, 100, exclusive=True)
    if request.isolation is Isolation.MIG:
        fitting = sorted((m for m in gpu.mig_instances
                          if m.uuid in free.free_mig and m.memory_mib >= request.memory_mib
                          and m.slices >= request.mig_slices),
                         key=lambda m: (m.memory_mib, m.slices, m.uuid))
        chosen = fitting[0]
        return GpuGrant(gpu.uuid, chosen.memory_mib, 0, mig_instance=chosen.uuid)
    sharer = request.sharer(gpu.model)
    return GpuGrant(gpu.uuid, request.memory_mib, request.cores_pct,
                    sharing_limit=sharer.limit, sharing_weight=sharer.weight,
                    sharing_template=sharer.template, sharing_felt_by=sharer.felt_by)
