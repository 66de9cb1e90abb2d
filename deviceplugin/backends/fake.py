"""A fake GPU backend: simulated nodes, unit tests and dry runs without a GPU.

Built from a small spec (a dict or YAML file) or from one row of the openb node list. UUIDs are
derived from the node name and GPU index, so every run (and the extender's view of a KWOK node)
agrees on them. Tests change temperatures, memory, processes and health through the setters.

A test that runs the backend in another process (the device plugin of the real node) drives
the GPU memory of its processes through a *usage file* instead: a JSON file the host's test
writes (`{"processes": [{"pid", "gpu": index or UUID, "usedMiB"}]}`), read at each reading, as
NVML would be asked. It stands in for the driver, so it belongs on the host, never in a path a
pod can write; the nvml backend has no such input.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB, GPU_MODEL_SLOWDOWN_C
from carpool.deviceplugin.backends.base import (
    GpuFacts,
    HealthEvent,
    HealthEventKind,
    MigFacts,
    ProcessActivity,
    ProcessMemory,
)

_UUID_NAMESPACE = uuid.UUID("6f1c2a53-7d0e-4b8a-9a51-0c3e2f7b9d10")

DEFAULT_DRIVER = "580.159.03"
DEFAULT_CUDA = "13.0"


def fake_gpu_uuid(node: str, index: int) -> str:
    """The GPU UUID a fake node reports: stable across runs, unique per node and index."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


def fake_mig_uuid(node: str, index: int, instance: int) -> str:
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}/mig/{instance}')}"


def _model_memory(model: str, override: object) -> int:
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
            raise ValueError(f"memoryTotalMiB must be a positive integer, got {override!r}")
        return override
    if model not in GPU_MODEL_MEMORY_MIB:
        raise ValueError(
            f"unknown GPU model {model!r}: give memoryTotalMiB or use one of "
            f"{', '.join(sorted(GPU_MODEL_MEMORY_MIB))}"
        )
    return GPU_MODEL_MEMORY_MIB[model]


def _with_topology(gpus: list[GpuFacts], islands: object, numa: object) -> list[GpuFacts]:
    """The GPUs with NVLink peers from `islands` (lists of GPU indices) and NUMA nodes from
    `numa` (one per GPU, in index order); ValueError naming the key when malformed."""
    count = len(gpus)
    if not isinstance(islands, list) or not all(
            isinstance(i, list) and all(isinstance(g, int) and 0 <= g < count for g in i)
            for i in islands):
        raise ValueError(f"fake backend spec: nvlinkIslands must be lists of GPU indices "
                         f"below {count}: {islands!r}")
    if not isinstance(numa, list) or (numa and len(numa) != count) or not all(
            isinstance(n, int) and n >= 0 for n in numa):
        raise ValueError(f"fake backend spec: numaNodes must give each of the {count} GPUs a "
                         f"NUMA node: {numa!r}")
    peers = {g.index: sorted({p for i in islands if g.index in i for p in i} - {g.index})
             for g in gpus}
    return [replace(g, nvlink_peers=tuple(peers[g.index]),
                    numa_node=numa[g.index] if numa else None) for g in gpus]


class FakeBackend:
    """An in-memory `GpuBackend` whose readings tests can set."""

    def __init__(
        self,
        node: str,
        gpus: list[GpuFacts],
        driver_version: str = DEFAULT_DRIVER,
        cuda_version: str = DEFAULT_CUDA,
    ) -> None:
        self.node = node
        self._gpus = {g.index: g for g in gpus}
        self._driver = driver_version
        self._cuda = cuda_version
        self._processes: list[ProcessMemory] = []
        self._activity: list[ProcessActivity] | None = None  # None: not measured
        self._events: list[HealthEvent] = []
        self._failing: set[str] = set()
        self._cond = threading.Condition()
        self.usage_file: Path | None = None  # set: process memory comes from this file

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> FakeBackend:
        """From {"node", "driverVersion"?, "cudaVersion"?, "gpus": [{"model", "count"?,
        "memoryTotalMiB"?, "temperatureC"?, "slowdownTemperatureC"?, "powerW"?,
        "exclusiveProcess"?,
        "migInstances"?: [{"profile", "slices", "memoryMiB"}]}],
        "nvlinkIslands"?: [[GPU index, ...], ...], "numaNodes"?: [NUMA node per GPU]}.

        Each `gpus` entry describes `count` identical GPUs, indexed in order. GPUs of one
        NVLink island reach each other over NVLink.
        """
        node = spec.get("node")
        if not isinstance(node, str) or not node:
            raise ValueError("fake backend spec: 'node' must be a non-empty string")
        entries = spec.get("gpus", [])
        if not isinstance(entries, list):
            raise ValueError("fake backend spec: 'gpus' must be a list")
        gpus: list[GpuFacts] = []
        for entry in entries:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("model"), str):
                raise ValueError(f"fake backend spec: each gpus entry needs a model: {entry!r}")
            model = entry["model"]
            count = entry.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"fake backend spec: count must be a positive integer: {entry!r}")
            memory = _model_memory(model, entry.get("memoryTotalMiB"))
            for _ in range(count):
                index = len(gpus)
                migs = tuple(
                    MigFacts(
                        uuid=fake_mig_uuid(node, index, n),
                        profile=str(m["profile"]),
                        slices=int(m["slices"]),
                        memory_mib=int(m["memoryMiB"]),
                    )
                    for n, m in enumerate(entry.get("migInstances", []))
                )
                gpus.append(
                    GpuFacts(
                        index=index,
                        uuid=fake_gpu_uuid(node, index),
                        model=model,
                        memory_total_mib=memory,
                        memory_used_mib=0,
                        temperature_c=float(entry.get("temperatureC", 40.0)),
                        slowdown_temperature_c=float(
                            entry.get("slowdownTemperatureC", GPU_MODEL_SLOWDOWN_C.get(model, 90.0))
                        ),
                        power_w=float(entry.get("powerW", 60.0)),
                        utilization_pct=0.0,
                        mig_enabled=bool(migs),
                        mig_instances=migs,
                        exclusive_process=bool(entry.get("exclusiveProcess", False)),
                    )
                )
        gpus = _with_topology(gpus, spec.get("nvlinkIslands", []), spec.get("numaNodes", []))
        return cls(
            node,
            gpus,
            driver_version=str(spec.get("driverVersion", DEFAULT_DRIVER)),
            cuda_version=str(spec.get("cudaVersion", DEFAULT_CUDA)),
        )

    @classmethod
    def from_yaml(cls, path: Path, node: str = "") -> FakeBackend:
        """`node` names the node when the spec does not (one spec shared by a DaemonSet)."""
        spec = yaml.safe_load(path.read_text())
        if not isinstance(spec, Mapping):
            raise ValueError(f"{path}: a fake backend spec must be a YAML mapping")
        return cls.from_spec({"node": node, **spec} if spec.get("node") is None else spec)

    @classmethod
    def from_openb_row(cls, row: Mapping[str, str]) -> FakeBackend:
        """From one row of openb_node_list_gpu_node.csv (`sn,cpu_milli,memory_mib,gpu,model`)."""
        try:
            count = int(row["gpu"])
            node, model = row["sn"], row["model"]
        except (KeyError, ValueError) as err:
            raise ValueError(f"not an openb node row: {dict(row)!r} ({err})") from None
        gpus = [{"model": model, "count": count}] if count > 0 else []
        return cls.from_spec({"node": node, "gpus": gpus})

    # --- GpuBackend ---------------------------------------------------------------------

    def inventory(self) -> list[GpuFacts]:
        with self._cond:
            gpus = [self._gpus[i] for i in sorted(self._gpus)]
        if self.usage_file is None:
            return gpus
        used: dict[str, int] = {}
        for p in self._read_usage_file(self.usage_file):
            used[p.gpu_uuid] = used.get(p.gpu_uuid, 0) + p.used_mib
        return [replace(g, memory_used_mib=used.get(g.uuid, 0)) for g in gpus]

    def driver_version(self) -> str:
        return self._driver

    def cuda_version(self) -> str:
        return self._cuda

    def process_memory(self) -> list[ProcessMemory]:
        if self.usage_file is not None:
            return self._read_usage_file(self.usage_file)
        with self._cond:
            return list(self._processes)

    def process_activity(self) -> list[ProcessActivity] | None:
        with self._cond:
            return None if self._activity is None else list(self._activity)

    def health_events(self, timeout_s: float) -> list[HealthEvent]:
        with self._cond:
            if not self._events:
                self._cond.wait(timeout_s)
            events, self._events = self._events, []
            return events

    def probe(self, gpu_uuid: str) -> bool:
        with self._cond:
            return gpu_uuid not in self._failing

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- test controls ------------------------------------------------------------------

    def _update(self, index: int, **changes: Any) -> None:
        with self._cond:
            if index not in self._gpus:
                raise KeyError(f"no GPU with index {index} on fake node {self.node}")
            self._gpus[index] = replace(self._gpus[index], **changes)

    def set_temperature(self, index: int, celsius: float) -> None:
        self._update(index, temperature_c=celsius)

    def set_memory_used(self, index: int, mib: int) -> None:
        self._update(index, memory_used_mib=mib)

    def set_processes(self, processes: list[ProcessMemory]) -> None:
        with self._cond:
            self._processes = list(processes)

    def set_activity(self, activity: list[ProcessActivity] | None) -> None:
        """What `process_activity` reports from now on (None, the start: not measured)."""
        with self._cond:
            self._activity = None if activity is None else list(activity)

    def _read_usage_file(self, path: Path) -> list[ProcessMemory]:
        """The processes the usage file lists (none while it does not exist); ValueError
        naming the entry and field when it is malformed."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"fake usage file {path}: {err}") from None
        entries = data.get("processes") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"fake usage file {path}: 'processes' must be a list")
        with self._cond:
            by_index = {g.index: g.uuid for g in self._gpus.values()}
        known = set(by_index.values())
        out = []
        for n, entry in enumerate(entries):
            where = f"fake usage file {path}: processes[{n}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{where} must be a mapping")
            pid, gpu, used = entry.get("pid"), entry.get("gpu"), entry.get("usedMiB")
            if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                raise ValueError(f"{where}.pid must be a positive integer, got {pid!r}")
            if isinstance(used, bool) or not isinstance(used, int) or used < 0:
                raise ValueError(f"{where}.usedMiB must be an integer >= 0, got {used!r}")
            if isinstance(gpu, int) and not isinstance(gpu, bool) and gpu in by_index:
                gpu = by_index[gpu]
            if not isinstance(gpu, str) or gpu not in known:
                raise ValueError(f"{where}.gpu must be the index or UUID of a GPU of node "
                                 f"{self.node}, got {gpu!r}")
            out.append(ProcessMemory(pid, gpu, used))
        return out

    def inject_xid(self, index: int, xid: int, persistent: bool = True) -> None:
        """Report an Xid error; with `persistent`, probes fail until `clear_fault`."""
        with self._cond:
            gpu = self._gpus[index]
            if persistent:
                self._failing.add(gpu.uuid)
            self._events.append(HealthEvent(gpu.uuid, HealthEventKind.XID, xid, f"Xid {xid}"))
            self._cond.notify_all()

    def clear_fault(self, index: int) -> None:
        with self._cond:
            self._failing.discard(self._gpus[index].uuid)
