"""The NVML backend (nvidia-ml-py): real GPUs.

Readings that a GPU does not support (power on some parts, ECC on consumer cards, events in some
virtual machines) degrade to neutral values instead of failing the whole inventory: one missing
counter must not take a node's GPUs away from the scheduler.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from carpool.deviceplugin.backends.base import (
    GpuFacts,
    HealthEvent,
    HealthEventKind,
    MigFacts,
    ProcessActivity,
    ProcessMemory,
)
from carpool.deviceplugin.cdi import MIG_MINORS, mig_cap_nodes

T = TypeVar("T")
MIB = 1024 * 1024
_PROFILE = re.compile(r"(\d+)g\.(\d+)gb")


def model_name(nvml_name: str, memory_total_mib: int) -> str:
    """A short model name matching Carpool's table: "NVIDIA H200" -> "H200",
    "Tesla V100-SXM2-32GB" -> "V100M32", "NVIDIA A100-SXM4-80GB" -> "A100"."""
    name = nvml_name.removeprefix("NVIDIA ").removeprefix("Tesla ").strip()
    base = re.split(r"[ -]", name, maxsplit=1)[0]
    if base == "V100":
        return "V100M32" if memory_total_mib > 20 * 1024 else "V100M16"
    return base


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _or(default: T, read: Callable[[], T]) -> T:
    try:
        return read()
    except pynvml.NVMLError:
        return default


def _or_call(default: T, read: Callable[..., T], *args: Any) -> T:
    """`read(*args)`, or `default` where NVML cannot answer."""
    try:
        return read(*args)
    except pynvml.NVMLError:
        return default


def _bus_id(read: Callable[..., Any], *args: Any) -> str:
    """The PCI bus id of what `read(*args)` (an NVML PCI-info call) describes."""
    return _text(read(*args).busId)


def _numa_node(bus_id: str) -> int | None:
    """The NUMA node of the PCI device `bus_id` (NVML's form, e.g. 00000000:3b:00.0) as
    sysfs tells it; None when it does not (-1 there, or no such file)."""
    if not bus_id:
        return None
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id[-12:]}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class NvmlBackend:
    """`GpuBackend` over NVML. Thread-safe: NVML calls are serialised behind one lock."""

    def __init__(self) -> None:
        pynvml.nvmlInit()
        self._lock = threading.Lock()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                         for i in range(pynvml.nvmlDeviceGetCount())]
        self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._by_uuid = dict(zip(self._uuids, self._handles, strict=True))
        self._activity_seen: dict[str, int] = {}  # GPU uuid -> newest sample time read (us)
        self._topology = self._read_topology()  # fixed while the node runs
        self._ecc_baseline = {u: self._uncorrected_ecc(h) for u, h in self._by_uuid.items()}
        self._events: Any = None
        self._event_gpus: list[str] = []
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for uuid, handle in self._by_uuid.items():
                try:
                    pynvml.nvmlDeviceRegisterEvents(
                        handle,
                        pynvml.nvmlEventTypeXidCriticalError
                        | pynvml.nvmlEventTypeDoubleBitEccError,
                        self._events,
                    )
                    self._event_gpus.append(uuid)
                except pynvml.NVMLError:
                    pass  # not supported here (e.g. some VMs): probing still covers health
        except pynvml.NVMLError:
            self._events = None

    @property
    def event_gpus(self) -> list[str]:
        """GPUs whose Xid/ECC events NVML delivers (the rest rely on probes)."""
        return list(self._event_gpus)

    def _uncorrected_ecc(self, handle: Any) -> int:
        return int(_or(0, lambda: pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)))

    def _mig(self, handle: Any, minor: int) -> tuple[bool, tuple[MigFacts, ...]]:
        current, _pending = _or((0, 0), lambda: pynvml.nvmlDeviceGetMigMode(handle))
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return False, ()
        try:
            minors = Path(MIG_MINORS).read_text()
        except OSError:
            minors = ""  # no capability table: MIG devices get only their GPU's node
        out = []
        for i in range(_or(0, lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except pynvml.NVMLError:
                continue  # an empty slot
            name = _text(pynvml.nvmlDeviceGetName(mig))
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(mig).total) // MIB
            found = _PROFILE.search(name)
            try:
                slices = int(pynvml.nvmlDeviceGetAttributes(mig).gpuInstanceSliceCount)
            except pynvml.NVMLError:
                slices = 0
            profile = found.group(0) if found else f"{slices}g.{round(memory / 1024)}gb"
            try:
                ids = (pynvml.nvmlDeviceGetGpuInstanceId(mig),
                       pynvml.nvmlDeviceGetComputeInstanceId(mig))
            except pynvml.NVMLError:
                ids = (-1, -1)
            caps = mig_cap_nodes(minors, minor, int(ids[0]), int(ids[1]))
            out.append(MigFacts(_text(pynvml.nvmlDeviceGetUUID(mig)), profile,
                                slices or (int(found.group(1)) if found else 0), memory, caps))
        return True, tuple(out)

    def _read_topology(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """Each GPU's NUMA node (from its PCI device in sysfs) and NVLink peers: the GPUs at
        the far end of its active links, or, behind an NVSwitch (a far end that is no GPU
        here), every other GPU behind one. Whatever NVML or sysfs cannot tell is left out."""
        bus = {i: _or_call("", _bus_id, pynvml.nvmlDeviceGetPciInfo, h).lower()
               for i, h in enumerate(self._handles)}
        by_bus = {b[-12:]: i for i, b in bus.items() if b}
        direct: dict[int, set[int]] = {}
        switched: set[int] = set()
        for i, handle in enumerate(self._handles):
            direct[i] = set()
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                active = _or_call(0, pynvml.nvmlDeviceGetNvLinkState, handle, link)
                if active != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _or_call("", _bus_id, pynvml.nvmlDeviceGetNvLinkRemotePciInfo,
                                  handle, link).lower()
                peer = by_bus.get(remote[-12:]) if remote else None
                if peer is None:
                    switched.add(i)
                elif peer != i:
                    direct[i].add(peer)
        out: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        for i in direct:
            peers = direct[i] | (switched - {i} if i in switched else set())
            out[i] = (_numa_node(bus[i]), tuple(sorted(peers)))
        return out

    def _facts(self, index: int, handle: Any) -> GpuFacts:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        total = int(memory.total) // MIB
        minor = int(_or(index, lambda: pynvml.nvmlDeviceGetMinorNumber(handle)))
        mig_enabled, migs = self._mig(handle, minor)
        return GpuFacts(
            index=index,
            uuid=self._uuids[index],
            model=model_name(_text(pynvml.nvmlDeviceGetName(handle)), total),
            memory_total_mib=total,
            memory_used_mib=int(memory.used) // MIB,
            temperature_c=float(_or(0, lambda: pynvml.nvmlDeviceGetTemperature(
                handle, pynvml.NVML_TEMPERATURE_GPU))),
            slowdown_temperature_c=float(_or(90, lambda: pynvml.nvmlDeviceGetTemperatureThreshold(
                handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))),
            power_w=_or(0.0, lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            utilization_pct=float(_or(0, lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
            healthy=True,
            mig_enabled=mig_enabled,
            mig_instances=migs,
            minor_number=minor,
            exclusive_process=_or(0, lambda: pynvml.nvmlDeviceGetComputeMode(handle))
            == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
            numa_node=self._topology.get(index, (None, ()))[0],
            nvlink_peers=self._topology.get(index, (None, ()))[1],
        )

    def inventory(self) -> list[GpuFacts]:
        with self._lock:
            out = []
            for i, h in enumerate(self._handles):
                try:
                    out.append(self._facts(i, h))
                except pynvml.NVMLError as err:  # the GPU stopped answering: report it sick
                    out.append(GpuFacts(i, self._uuids[i], "unknown", 0, 0, 0.0, 90.0, 0.0, 0.0,
                                        healthy=False))
                    del err
            return out

    def driver_version(self) -> str:
        with self._lock:
            return _text(pynvml.nvmlSystemGetDriverVersion())

    def cuda_version(self) -> str:
        with self._lock:
            version = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
        return f"{version // 1000}.{version % 1000 // 10}"

    def process_memory(self) -> list[ProcessMemory]:
        with self._lock:
            out = []
            for uuid, handle in self._by_uuid.items():
                try:
                    processes: list[Any] = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except pynvml.NVMLError:
                    processes = []
                for p in processes:
                    used = p.usedGpuMemory
                    out.append(ProcessMemory(int(p.pid), uuid, int(used) // MIB if used else 0))
            return out

    def process_activity(self) -> list[ProcessActivity] | None:
        """NVML's per-process utilization samples since the previous call, per GPU (the
        driver keeps a short buffer of them); None when no GPU answers the query."""
        with self._lock:
            out: list[ProcessActivity] = []
            measured = False
            for uuid, handle in self._by_uuid.items():
                since = self._activity_seen.get(uuid, 0)
                try:
                    samples: list[Any] = pynvml.nvmlDeviceGetProcessUtilization(handle, since)
                except pynvml.NVMLError_NotFound:  # no sample since: nothing ran
                    measured = True
                    continue
                except pynvml.NVMLError:
                    continue
                measured = True
                busiest: dict[int, int] = {}
                for sample in samples:
                    since = max(since, int(sample.timeStamp))
                    if int(sample.smUtil) > 0:
                        pid = int(sample.pid)
                        busiest[pid] = max(busiest.get(pid, 0), int(sample.smUtil))
                self._activity_seen[uuid] = since
                out += [ProcessActivity(pid, uuid, pct) for pid, pct in sorted(busiest.items())]
            return out if measured else None

    def health_events(self, timeout_s: float) -> list[HealthEvent]:
        if self._events is None:
            return []
        try:
            data = pynvml.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except pynvml.NVMLError:
            return []  # a timeout, or events unavailable
        with self._lock:
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
        if data.eventType & pynvml.nvmlEventTypeDoubleBitEccError:
            return [HealthEvent(uuid, HealthEventKind.ECC, int(data.eventData),
                                "double-bit ECC error")]
        return [HealthEvent(uuid, HealthEventKind.XID, int(data.eventData))]

    def probe(self, gpu_uuid: str) -> bool:
        with self._lock:
            handle = self._by_uuid.get(gpu_uuid)
            if handle is None:
                return False
            try:
                pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError:
                return False
            ecc = self._uncorrected_ecc(handle)
            if ecc > self._ecc_baseline.get(gpu_uuid, 0):
                self._ecc_baseline[gpu_uuid] = ecc  # recover once no new errors appear
                return False
            return True

    def close(self) -> None:
        with self._lock:
            if self._events is not None:
                _or(None, lambda: pynvml.nvmlEventSetFree(self._events))
                self._events = None
            _or(None, pynvml.nvmlShutdown)
