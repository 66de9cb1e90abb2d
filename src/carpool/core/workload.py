"""What placement compares: one pod's demand, and the workload a cluster expects to receive.

Fragmentation only means something against a target workload (FGD, Weng et al., ATC'23): idle
GPU capacity is fragmented when the pods that usually arrive cannot use it. The target workload
is the set of most frequent demand shapes with their probabilities.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from carpool.core.resources import MIG_SLICES_PER_GPU, GpuRequest, Isolation

MILLI_PER_GPU = 1000
DEFAULT_COVERAGE = 0.95


@dataclass(frozen=True)
class Demand:
    """One pod's demand in placement units: CPU milli, host MiB, and per-GPU milli and MiB.

    `gpu_milli` is the compute share of each of `gpu_count` GPUs (1000 = a whole GPU); a GPU can
    take it when its idle compute is at least that and its free memory at least `gpu_memory_mib`.
    `gpu_count` 0 is a CPU-only pod (the benchmark's traces have them; the extender never sees
    one).
    """

    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_count: int = 0
    gpu_milli: int = 0
    gpu_memory_mib: int = 0
    models: frozenset[str] = frozenset()  # empty: any model

    def __post_init__(self) -> None:
        if min(self.cpu_milli, self.memory_mib, self.gpu_count, self.gpu_memory_mib) < 0:
            raise ValueError(f"demand must not be negative: {self}")
        if not 0 <= self.gpu_milli <= MILLI_PER_GPU:
            raise ValueError(f"gpu_milli must be within 0..{MILLI_PER_GPU}, got {self.gpu_milli}")

    @property
    def gpu_total_milli(self) -> int:
        """The GPU capacity this demand takes in all (the benchmark's allocation unit)."""
        return self.gpu_count * self.gpu_milli

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    @classmethod
    def from_request(cls, request: GpuRequest, *, cpu_milli: int = 0,
                     memory_mib: int = 0) -> Demand:
        """The demand of a core GpuRequest; exclusive use takes the whole GPU (1000 milli).

        MIG requests map to their compute slices (k/7 of a GPU); the filter still checks the
        actual instances, this is only what scoring compares.
        """
        if request.isolation is Isolation.EXCLUSIVE:
            milli = MILLI_PER_GPU
        elif request.isolation is Isolation.MIG:
            milli = MILLI_PER_GPU * max(request.mig_slices, 1) // MIG_SLICES_PER_GPU
        else:
            milli = request.cores_pct * MILLI_PER_GPU // 100
        return cls(cpu_milli=cpu_milli, memory_mib=memory_mib, gpu_count=request.count,
                   gpu_milli=milli, gpu_memory_mib=request.memory_mib, models=request.models)


@dataclass(frozen=True)
class TargetWorkload:
    """Demand shapes and their probabilities (summing to 1); empty means nothing is expected.

    Only GPU demands count: a CPU-only shape leaves every GPU idle whatever the node looks like,
    so it would add the same amount to every node's fragmentation.
    """

    shapes: tuple[tuple[Demand, float], ...] = ()

    def __post_init__(self) -> None:
        if any(p < 0 for _, p in self.shapes):
            raise ValueError("shape probabilities must not be negative")
        total = sum(p for _, p in self.shapes)
        if self.shapes and abs(total - 1.0) > 1e-6:
            raise ValueError(f"shape probabilities must sum to 1, got {total:.6f}")

    @property
    def cpu_per_gpu_milli(self) -> float:
        """CPU milli the expected GPU pods bring per milli-GPU: sum p cpu / sum p gpu (0 if none).
        """
        gpu = sum(p * d.gpu_total_milli for d, p in self.shapes)
        return sum(p * d.cpu_milli for d, p in self.shapes) / gpu if gpu > 0 else 0.0

    @classmethod
    def from_demands(cls, demands: Iterable[Demand],
                     coverage: float = DEFAULT_COVERAGE) -> TargetWorkload:
        """The most frequent GPU shapes that together cover `coverage` of the GPU demands.

        Frequencies are renormalised over the kept shapes; ties in frequency keep the shape
        that sorts first, so the result does not depend on input order.
        """
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        counts = Counter(d for d in demands if d.gpu_count > 0)
        total = sum(counts.values())
        if total == 0:
            return cls()
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], _shape_key(kv[0])))
        kept: list[tuple[Demand, int]] = []
        covered = 0
        for demand, count in ranked:
            if covered >= coverage * total:
                break
            kept.append((demand, count))
            covered += count
        return cls(tuple((d, c / covered) for d, c in kept))


def _shape_key(demand: Demand) -> tuple[int, int, int, int, int, tuple[str, ...]]:
    return (demand.cpu_milli, demand.memory_mib, demand.gpu_count, demand.gpu_milli,
            demand.gpu_memory_mib, tuple(sorted(demand.models)))
