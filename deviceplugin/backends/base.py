"""The port through which the device plugin sees GPUs.

Everything above this module (telemetry, health, Allocate) is written against `GpuBackend`, so
the same code runs on a real node (NVML) and on a simulated one or in a test (fake).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class MigFacts:
    """One existing MIG instance, as the driver reports it."""

    uuid: str
    profile: str  # e.g. "1g.18gb"
    slices: int  # compute slices, the "1g" part
    memory_mib: int
    # The capability device nodes that open this instance (/dev/nvidia-caps/nvidia-cap<N>, its
    # GPU instance's and compute instance's), which a container needs beside its GPU's node.
    cap_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuFacts:
    """One physical GPU at one moment: identity, capacity, load and health."""

    index: int
    uuid: str
    model: str
    memory_total_mib: int
    memory_used_mib: int
    temperature_c: float
    slowdown_temperature_c: float
    power_w: float
    utilization_pct: float
    healthy: bool = True
    mig_enabled: bool = False
    mig_instances: tuple[MigFacts, ...] = ()
    minor_number: int | None = None  # the driver's minor (/dev/nvidia<N>); None: the index
    # Compute mode EXCLUSIVE_PROCESS (the chart's MPS daemon sets it): only the MPS server may
    # hold a context, so no process outside MPS can run here.
    exclusive_process: bool = False
    numa_node: int | None = None  # the NUMA node it is attached to; None: unknown
    nvlink_peers: tuple[int, ...] = ()  # indices of the GPUs it reaches over NVLink

    @property
    def minor(self) -> int:
        return self.index if self.minor_number is None else self.minor_number


@dataclass(frozen=True)
class ProcessMemory:
    """GPU memory one host process holds on one GPU (for the timeslice watchdog)."""

    pid: int
    gpu_uuid: str
    used_mib: int


@dataclass(frozen=True)
class ProcessActivity:
    """A compute process that used one GPU's SMs since the previous reading."""

    pid: int
    gpu_uuid: str
    sm_pct: int  # its largest SM utilization sample in that time


class HealthEventKind(enum.Enum):
    XID = "xid"  # a driver-reported Xid error
    ECC = "ecc"  # an uncorrectable (double-bit) memory error


@dataclass(frozen=True)
class HealthEvent:
    """Something the driver reported about one GPU's health."""

    gpu_uuid: str
    kind: HealthEventKind
    code: int  # the Xid number; for ECC the count seen
    message: str = ""


class GpuBackend(Protocol):
    """What the device plugin needs from the GPU driver."""

    def inventory(self) -> list[GpuFacts]:
        """All GPUs on the node, ordered by index, with current readings."""
        ...

    def driver_version(self) -> str: ...

    def cuda_version(self) -> str:
        """The highest CUDA version the driver supports, e.g. "13.0"."""
        ...

    def process_memory(self) -> list[ProcessMemory]:
        """GPU memory held by each compute process, across all GPUs."""
        ...

    def process_activity(self) -> list[ProcessActivity] | None:
        """The processes that used their GPU's SMs since the last call; None where the
        driver cannot say (then no pod on the node counts as idle)."""
        ...

    def health_events(self, timeout_s: float) -> list[HealthEvent]:
        """Health events since the last call; may block up to `timeout_s` waiting for one."""
        ...

    def probe(self, gpu_uuid: str) -> bool:
        """A fresh health check of one GPU: True when it answers and shows no new fatal errors."""
        ...

    def close(self) -> None: ...
