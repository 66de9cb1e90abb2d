"""The `GpuNode` status the plugin publishes, built from backend readings.

`gpunode_status` is pure (readings and `now` in, dict out) so its schema is tested without a
cluster; `should_publish` decides when a new status is worth a PATCH (rate limiting).

Schema (camelCase, matching the GpuNode CRD's status):
    driverVersion: str, cudaVersion: str, sharingMode: "mps"|"mig"|"timeslice"|"exclusive",
    sharesPerGpu: int (when known), datasets: [str], heartbeat: RFC 3339 str,
    gpus: [{index, uuid, model, memoryTotalMiB, memoryUsedMiB, temperatureC,
            slowdownTemperatureC, powerW, utilizationPct, health: "Healthy"|"Unhealthy",
            migInstances: [{uuid, profile, slices, memoryMiB}]}],
    pods: [{namespace, name, gpuUuid, peakMemoryMiB}]
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from carpool.core.gpunode import HEALTHY, UNHEALTHY
from carpool.core.timestamps import format_timestamp
from carpool.deviceplugin.backends.base import GpuFacts


@dataclass(frozen=True)
class PodPeak:
    """The most GPU memory one pod's processes held at once on one GPU."""

    namespace: str
    name: str
    gpu_uuid: str
    peak_memory_mib: int
    last_active: float | None = None  # when its processes last used the GPU's SMs (epoch s)


def gpu_status(gpu: GpuFacts, healthy: bool, reason: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "memoryTotalMiB": gpu.memory_total_mib,
        "memoryUsedMiB": gpu.memory_used_mib,
        "temperatureC": round(gpu.temperature_c, 1),
        "slowdownTemperatureC": round(gpu.slowdown_temperature_c, 1),
        "powerW": round(gpu.power_w, 1),
        "utilizationPct": round(gpu.utilization_pct, 1),
        "health": HEALTHY if healthy else UNHEALTHY,
        "migInstances": [
            {"uuid": m.uuid, "profile": m.profile, "slices": m.slices, "memoryMiB": m.memory_mib}
            for m in gpu.mig_instances
        ],
    }
    if not healthy:
        out["healthReason"] = reason or "the driver does not answer for this GPU"
    if gpu.exclusive_process:
        out["exclusiveProcess"] = True
    if gpu.numa_node is not None:
        out["numaNode"] = gpu.numa_node
    if gpu.nvlink_peers:
        out["nvlinkPeers"] = list(gpu.nvlink_peers)
    return out


def gpunode_status(
    gpus: Iterable[GpuFacts],
    *,
    driver_version: str,
    cuda_version: str,
    sharing_mode: str,
    now: datetime,
    unhealthy: Collection[str] = frozenset(),
    datasets: Iterable[str] = (),
    pod_peaks: Iterable[PodPeak] = (),
    shares_per_gpu: int | None = None,
    health_reasons: Mapping[str, str] | None = None,
    mps_ceiling_pct: int = 100,
    process_activity: bool = False,
) -> dict[str, Any]:
    """The full status object; `unhealthy` holds GPU UUIDs the health tracker has marked,
    `health_reasons` why (by UUID); `process_activity` that the backend measures each
    process's GPU activity (the pods' `lastActiveTime`)."""
    reasons = health_reasons or {}
    status: dict[str, Any] = {
        "driverVersion": driver_version,
        "cudaVersion": cuda_version,
        "sharingMode": sharing_mode,
        "datasets": sorted(set(datasets)),
        "gpus": [
            gpu_status(g, g.healthy and g.uuid not in unhealthy, reasons.get(g.uuid, ""))
            for g in sorted(gpus, key=lambda g: g.index)
        ],
        "pods": [
            {"namespace": p.namespace, "name": p.name, "gpuUuid": p.gpu_uuid,
             "peakMemoryMiB": p.peak_memory_mib,
             **({"lastActiveTime": format_timestamp(p.last_active)}
                if p.last_active is not None else {})}
            for p in sorted(pod_peaks, key=lambda p: (p.namespace, p.name, p.gpu_uuid))
        ],
        "heartbeat": format_timestamp(now.timestamp()),
    }
    if process_activity:
        status["processActivity"] = True
    if shares_per_gpu is not None:
        status["sharesPerGpu"] = shares_per_gpu
    if mps_ceiling_pct < 100:
        status["mpsCeilingPercent"] = mps_ceiling_pct
    return status


def status_from_backend(
    backend: Any,
    *,
    sharing_mode: str,
    now: datetime,
    unhealthy: Collection[str] = frozenset(),
    datasets: Iterable[str] = (),
    pod_peaks: Iterable[PodPeak] = (),
    shares_per_gpu: int | None = None,
) -> dict[str, Any]:
    """`gpunode_status` over a `GpuBackend`'s current readings."""
    return gpunode_status(
        backend.inventory(),
        driver_version=backend.driver_version(),
        cuda_version=backend.cuda_version(),
        sharing_mode=sharing_mode,
        now=now,
        unhealthy=unhealthy,
        datasets=datasets,
        pod_peaks=pod_peaks,
        shares_per_gpu=shares_per_gpu,
    )


def cached_datasets(cache_dir: Path | None) -> list[str]:
    """Dataset names cached on this node: the sub-directories of the configured cache."""
    if cache_dir is None or not cache_dir.is_dir():
        return []
    return sorted(p.name for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


@dataclass(frozen=True)
class PublishThresholds:
    """When a new status is worth a PATCH: a structural change, a reading moving past its
    threshold, or the heartbeat interval running out."""

    interval_s: float = 30.0
    temperature_c: float = 3.0
    memory_mib: int = 1024
    power_w: float = 25.0
    utilization_pct: float = 10.0


def _moved(old: Mapping[str, Any], new: Mapping[str, Any], t: PublishThresholds) -> bool:
    return bool(
        abs(new["temperatureC"] - old["temperatureC"]) >= t.temperature_c
        or abs(new["memoryUsedMiB"] - old["memoryUsedMiB"]) >= t.memory_mib
        or abs(new["powerW"] - old["powerW"]) >= t.power_w
        or abs(new["utilizationPct"] - old["utilizationPct"]) >= t.utilization_pct
    )


def _structure(status: Mapping[str, Any]) -> object:
    """Everything except the fast-moving readings and the heartbeat."""
    return (
        status["driverVersion"], status["cudaVersion"], status["sharingMode"],
        tuple(status["datasets"]),
        tuple((g["uuid"], g["health"], g["memoryTotalMiB"],
               tuple(m["uuid"] for m in g["migInstances"])) for g in status["gpus"]),
        tuple((p["namespace"], p["name"], p["gpuUuid"], p["peakMemoryMiB"],
               p.get("lastActiveTime")) for p in status["pods"]),  # (to the minute)
        status.get("processActivity"),
    )


def should_publish(
    last: Mapping[str, Any] | None,
    last_at: float,
    new: Mapping[str, Any],
    now: float,
    thresholds: PublishThresholds = PublishThresholds(),
) -> bool:
    """Whether to PATCH `new` given the `last` status published at `last_at` (monotonic s)."""
    if last is None or _structure(last) != _structure(new):
        return True
    if now - last_at >= thresholds.interval_s:
        return True
    return any(_moved(o, n, thresholds) for o, n in zip(last["gpus"], new["gpus"], strict=True))
