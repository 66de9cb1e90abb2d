"""What jobs ask for and what GPUs offer: the vocabulary shared by every component.

Plain frozen dataclasses and enums; no I/O. Memory is in MiB and compute in percent of a GPU's
SMs throughout the core; user-facing units (GiB, quantities) are converted at the edges.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from fractions import Fraction


class JobClass(enum.IntEnum):
    """Queue classes; a lower value is served first."""

    INTERACTIVE = 0
    SHORT = 1
    LONG = 2
    BATCH = 3

    @classmethod
    def parse(cls, text: str) -> JobClass:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(
                f"unknown class {text!r}; expected one of {', '.join(c.label for c in cls)}"
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


class Isolation(enum.Enum):
    """How a job shares a GPU."""

    MPS = "mps"  # hard memory cap and SM percentage through CUDA MPS
    MIG = "mig"  # a hardware partition (MIG instance)
    TIMESLICE = "timeslice"  # no hard limit; a watchdog enforces memory
    EXCLUSIVE = "exclusive"  # the whole GPU

    @classmethod
    def parse(cls, text: str) -> Isolation:
        try:
            return cls(text.lower())
        except ValueError:
            raise ValueError(
                f"unknown isolation {text!r}; expected one of {', '.join(i.value for i in cls)}"
            ) from None


class Phase(enum.Enum):
    """A GpuJob's lifecycle."""

    QUEUED = "Queued"
    ADMITTED = "Admitted"
    RUNNING = "Running"
    PREEMPTED = "Preempted"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)

    @property
    def holds_gpus(self) -> bool:
        return self in (Phase.ADMITTED, Phase.RUNNING)


MIG_SLICES_PER_GPU = 7
# A sharer's weight (thousandths) when it is as heavy as any: the weight of a job whose template
# has no interference profile, and the most any job weighs (`core.interference`).
WHOLE_SHARER = 1000
# Pairs learned for one job: (template, copies of a job of that template this job counts as
# beside it); see `Sharer.felt_by`.
FeltBy = tuple[tuple[str, float], ...]
MAX_DEGREE = 16  # the largest sharing degree a limit is worked out for (`core.interference`)
MAX_PAIRS = 32  # pairs a job carries per GPU model (`core.interference`): the heaviest


@dataclass(frozen=True)
class Sharer:
    """A job on a GPU as the sharing rule sees it (`placement.sharing_rejection`): its limit
    (the most jobs its GPU may carry, counted in copies of itself; 0: none), its weight (how
    heavy a sharer it is, thousandths), its template, and what pairs taught about it: for
    each template measured beside it, the copies of a job of that template it counts as to
    that job (`core.interference`). A pair not learned counts by weight."""

    limit: float = 0
    weight: int = WHOLE_SHARER
    template: str = ""
    felt_by: FeltBy = ()

    def pair_count(self, other: Sharer) -> float | None:
        """The copies of `other` this job counts as where the pair was measured, else None."""
        if other.template:
            for template, felt in self.felt_by:
                if template == other.template:
                    return felt
        return None

    def counted_by(self, other: Sharer) -> Fraction:
        """What this job counts as to `other`, in copies of `other`, exactly: the pair's
        measured count (to the hundredth, up) where there is one, else this job's weight over
        `other`'s."""
        felt = self.pair_count(other)
        if felt is not None:
            return Fraction(math.ceil(felt * 100 - 1e-9), 100)
        return Fraction(self.weight, max(1, other.weight))


def mps_ceiling_mib(memory_total_mib: int, ceiling_pct: int) -> int:
    """The pinned memory one MPS client may hold on a GPU fenced at `ceiling_pct` %: whole GiB,
    as the MPS control daemon keeps it (it reports 71,885 MiB back as "70G")."""
    return memory_total_mib * ceiling_pct // 100 // 1024 * 1024


@dataclass(frozen=True)
class Objectives:
    """What a serving job must keep while it shares a GPU (spec.objectives): placement shares
    a GPU no further than its learned interference profile says keeps them
    (`core.interference`)."""

    p99_latency_s: float | None = None  # its requests' 99th-percentile latency, at most
    max_slowdown: float | None = None  # its throughput alone / shared, at most

    def __post_init__(self) -> None:
        if self.p99_latency_s is not None and not self.p99_latency_s > 0:
            raise ValueError("spec.objectives.p99Latency must be positive")
        if self.max_slowdown is not None and not self.max_slowdown >= 1:
            raise ValueError("spec.objectives.maxSlowdown must be at least 1")


@dataclass(frozen=True)
class GpuRequest:
    """Per-job GPU demand: `count` GPUs, each with this memory and compute."""

    count: int
    memory_mib: int
    cores_pct: int = 0  # 0: no compute cap asked for
    isolation: Isolation = Isolation.MPS
    models: frozenset[str] = frozenset()  # empty: any model
    mig_slices: int = 0  # for MIG: compute slices of the instance wanted (1..7); 0: from memory
    # the pod template's nodeSelector: only nodes with every one of these labels can take it
    node_selector: frozenset[tuple[str, str]] = frozenset()
    objectives: Objectives | None = None  # None: no latency or slowdown promise
    # the most jobs a GPU of each model may carry with this one on it (itself included, each
    # counted by weight: `placement.counted_sharers`), from its template's interference profile
    # (`core.interference`), to the hundredth; a model not listed: no limit
    sharing_limits: tuple[tuple[str, float], ...] = ()
    # how heavy a sharer it is on a GPU of each model, in thousandths of the heaviest
    # (`core.interference`); a model not listed: WHOLE_SHARER
    sharing_weights: tuple[tuple[str, int], ...] = ()
    # its template, and per model the pairs learned about it (`Sharer.felt_by`)
    sharing_template: str = ""
    sharing_felt_by: tuple[tuple[str, FeltBy], ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("gpu.count must be at least 1")
        if self.memory_mib < 0:
            raise ValueError("gpu.memory must not be negative")
        if not 0 <= self.cores_pct <= 100:
            raise ValueError("gpu.cores must be between 0 and 100")

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def sharing_limit(self, model: str) -> float:
        """The most jobs a GPU of `model` may carry with this one on it; 0: no limit."""
        for name, limit in self.sharing_limits:
            if name == model:
                return limit
        return 0

    def sharing_weight(self, model: str) -> int:
        """How heavy a sharer of a GPU of `model` this job is (WHOLE_SHARER: as heavy as any)."""
        for name, weight in self.sharing_weights:
            if name == model:
                return weight
        return WHOLE_SHARER

    def sharer(self, model: str) -> Sharer:
        """This job as a sharer of a GPU of `model`."""
        felt_by = next((felt for name, felt in self.sharing_felt_by if name == model), ())
        return Sharer(self.sharing_limit(model), self.sharing_weight(model),
                      self.sharing_template, felt_by)


@dataclass(frozen=True)
class MigInstance:
    """An existing MIG instance on a GPU (Carpool hands these out; it never repartitions)."""

    uuid: str
    profile: str  # e.g. "1g.18gb"
    slices: int  # compute slices (the "1g" part)
    memory_mib: int


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as its node's device plugin reports it."""

    index: int
    uuid: str
    model: str
    memory_total_mib: int
    temperature_c: float = 40.0
    slowdown_temp_c: float = 90.0
    healthy: bool = True
    cordoned: bool = False
    mig_instances: tuple[MigInstance, ...] = ()
    # The most one MPS client may hold of this GPU (memory and SMs, %): its node's MPS daemon
    # fences every client there (GpuNode status.mpsCeilingPercent).
    mps_ceiling_pct: int = 100
    # The GPU's compute mode is EXCLUSIVE_PROCESS (set for MPS: only the MPS server may hold a
    # context), so a process outside MPS, a time-sliced or exclusive job's, cannot run on it.
    exclusive_process: bool = False
    # Where it sits on its node, as the device plugin reads it from NVML: its NUMA node (-1:
    # unknown) and the indices of the GPUs it reaches over NVLink (empty: none, or unknown).
    # A multi-GPU request gets GPUs close to each other (`scoring.gpus_for`).
    numa_node: int = -1
    nvlink_peers: frozenset[int] = frozenset()

    @property
    def mps_ceiling_mib(self) -> int:
        return mps_ceiling_mib(self.memory_total_mib, self.mps_ceiling_pct)


@dataclass(frozen=True)
class GpuGrant:
    """What one job holds on one GPU."""

    gpu_uuid: str
    memory_mib: int
    cores_pct: int  # compute actually reserved (100 for exclusive)
    exclusive: bool = False
    mig_instance: str = ""  # MIG instance UUID when isolation is MIG
    sharing_limit: float = 0  # the most jobs the holder lets its GPU carry (0: no limit)
    sharing_weight: int = WHOLE_SHARER  # how heavy a sharer it is (`GpuRequest.sharing_weights`)
    sharing_template: str = ""  # the holder's template, and the pairs learned about it
    sharing_felt_by: FeltBy = ()  # on this GPU's model (`Sharer.felt_by`)
    # lending (core.lending): `lent` marks the part of an owner's grant it has left unused,
    # which borrowers may use; `borrowed` marks a borrower's grant sitting in such a part
    lent: bool = False
    borrowed: bool = False

    @property
    def sharer(self) -> Sharer:
        """The holder as a sharer of its GPU."""
        return Sharer(self.sharing_limit, self.sharing_weight, self.sharing_template,
                      self.sharing_felt_by)


@dataclass(frozen=True)
class NodeInventory:
    """A GPU node: its GPUs and the facts placement needs about it."""

    name: str
    gpus: tuple[Gpu, ...]
    cpu_milli: int = 0  # 0: not constrained
    memory_mib: int = 0  # host memory; 0: not constrained
    zone: str = ""
    datasets: frozenset[str] = frozenset()  # datasets cached on the node
    sharing: frozenset[Isolation] = field(
        default_factory=lambda: frozenset({Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE})
    )
    ready: bool = True
    labels: frozenset[tuple[str, str]] = frozenset()  # the Node's labels

    def gpu(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)
