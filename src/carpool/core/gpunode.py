"""Reading a `GpuNode` status (written by the device plugin) into a `NodeInventory`.

A plain dict parser, so the extender and the operator can turn the published status into the
placement core's vocabulary without knowing anything about the cluster. Bad input raises
`ValueError` naming the node and the field, because a wrong inventory silently misplaces pods.

Also home to the table of GPU models and their memory that simulated nodes use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Final

from carpool.core.names import LABEL_ZONE
from carpool.core.resources import Gpu, Isolation, MigInstance, NodeInventory
from carpool.core.timestamps import parse_timestamp

GIB: Final = 1024

# Memory per GPU model, MiB. The openb trace names P100, T4, V100M16, V100M32, A10, G2 and G3.
# G2 and G3 are Alibaba's undisclosed models; they sit in 8-GPU nodes like the V100M32, so we
# ASSUME data-center cards of that class: G2 = 32 GiB, G3 = 80 GiB (an A100/H100-class part).
# The H200 figure is what NVML reports on a real H200 (143771 MiB), not the marketing 141 GB.
GPU_MODEL_MEMORY_MIB: Final[Mapping[str, int]] = {
    "P100": 16 * GIB,
    "T4": 16 * GIB,
    "V100M16": 16 * GIB,
    "V100M32": 32 * GIB,
    "A10": 24 * GIB,
    "G2": 32 * GIB,
    "G3": 80 * GIB,
    "A100": 80 * GIB,
    "H100": 80 * GIB,
    "H200": 143771,
}

# Thermal slowdown thresholds by model, degrees C (NVML's SLOWDOWN threshold on such parts).
GPU_MODEL_SLOWDOWN_C: Final[Mapping[str, float]] = {
    "P100": 85.0,
    "T4": 85.0,
    "V100M16": 87.0,
    "V100M32": 87.0,
    "A10": 93.0,
    "G2": 87.0,
    "G3": 87.0,
    "A100": 92.0,
    "H100": 90.0,
    "H200": 90.0,
}

# Which isolations a node's sharing mode offers. A MIG GPU is offered as MIG regardless.
SHARING_MODES: Final[Mapping[str, frozenset[Isolation]]] = {
    "mps": frozenset({Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE}),
    "timeslice": frozenset({Isolation.TIMESLICE, Isolation.EXCLUSIVE}),
    "mig": frozenset({Isolation.MIG, Isolation.EXCLUSIVE}),
    "exclusive": frozenset({Isolation.EXCLUSIVE}),
}

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"


def _field(node: str, where: str, obj: Mapping[str, object], key: str) -> object:
    if key not in obj:
        raise ValueError(f"GpuNode {node}: {where}{key} is missing")
    return obj[key]


def _int(node: str, where: str, obj: Mapping[str, object], key: str) -> int:
    value = _field(node, where, obj, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"GpuNode {node}: {where}{key} must be a non-negative integer, "
                         f"got {value!r}")
    return value


def _float(node: str, where: str, obj: Mapping[str, object], key: str, default: float) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"GpuNode {node}: {where}{key} must be a number, got {value!r}")
    return float(value)


def _str(node: str, where: str, obj: Mapping[str, object], key: str) -> str:
    value = _field(node, where, obj, key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"GpuNode {node}: {where}{key} must be a non-empty string, got {value!r}")
    return value


def _list(node: str, where: str, value: object) -> Sequence[object]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"GpuNode {node}: {where} must be a list, got {type(value).__name__}")
    return value


def _mapping(node: str, where: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"GpuNode {node}: {where} must be an object, got {type(value).__name__}")
    return value


def _mig_instance(node: str, where: str, raw: object) -> MigInstance:
    obj = _mapping(node, where.rstrip("."), raw)
    return MigInstance(
        uuid=_str(node, where, obj, "uuid"),
        profile=_str(node, where, obj, "profile"),
        slices=_int(node, where, obj, "slices"),
        memory_mib=_int(node, where, obj, "memoryMiB"),
    )


def _bool(node: str, where: str, obj: Mapping[str, object], key: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"GpuNode {node}: {where}{key} must be true or false, got {value!r}")
    return value


def _gpu(node: str, position: int, raw: object) -> Gpu:
    where = f"gpus[{position}]."
    obj = _mapping(node, f"gpus[{position}]", raw)
    health = obj.get("health", HEALTHY)
    if health not in (HEALTHY, UNHEALTHY):
        raise ValueError(f"GpuNode {node}: {where}health must be {HEALTHY!r} or {UNHEALTHY!r}, "
                         f"got {health!r}")
    migs = _list(node, f"{where}migInstances", obj.get("migInstances", []))
    model = _str(node, where, obj, "model")
    return Gpu(
        index=_int(node, where, obj, "index"),
        uuid=_str(node, where, obj, "uuid"),
        model=model,
        memory_total_mib=_int(node, where, obj, "memoryTotalMiB"),
        temperature_c=_float(node, where, obj, "temperatureC", 40.0),
        slowdown_temp_c=_float(node, where, obj, "slowdownTemperatureC",
                               GPU_MODEL_SLOWDOWN_C.get(model, 90.0)),
        healthy=health == HEALTHY,
        exclusive_process=_bool(node, where, obj, "exclusiveProcess"),
        numa_node=_int(node, where, obj, "numaNode") if obj.get("numaNode") is not None else -1,
        nvlink_peers=_peers(node, where, obj.get("nvlinkPeers", [])),
        mig_instances=tuple(
            _mig_instance(node, f"{where}migInstances[{i}].", m) for i, m in enumerate(migs)
        ),
    )


def _peers(node: str, where: str, raw: object) -> frozenset[int]:
    """`nvlinkPeers`: the indices of the GPUs this one reaches over NVLink."""
    if not isinstance(raw, list) or any(isinstance(p, bool) or not isinstance(p, int) or p < 0
                                        for p in raw):
        raise ValueError(f"GpuNode {node}: {where}nvlinkPeers must be a list of GPU indices, "
                         f"got {raw!r}")
    return frozenset(raw)


def _dataset_name(node: str, position: int, raw: object) -> str:
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, Mapping) and isinstance(raw.get("name"), str) and raw["name"]:
        return str(raw["name"])
    raise ValueError(f"GpuNode {node}: datasets[{position}] must be a dataset name, got {raw!r}")


def inventory_from_gpunode(
    name: str,
    status: Mapping[str, object],
    labels: Mapping[str, str],
    *,
    now: datetime | None = None,
    stale_after: timedelta = timedelta(minutes=2),
) -> NodeInventory:
    """The placement view of one node from its GpuNode status and Node labels.

    With `now`, a node whose heartbeat is older than `stale_after` (or missing) is not ready:
    its plugin is gone, so its numbers cannot be trusted for new placements.
    """
    mode = status.get("sharingMode", "mps")
    if not isinstance(mode, str) or mode not in SHARING_MODES:
        raise ValueError(f"GpuNode {name}: sharingMode must be one of "
                         f"{', '.join(sorted(SHARING_MODES))}, got {mode!r}")
    ceiling = status.get("mpsCeilingPercent", 100)
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or not 1 <= ceiling <= 100:
        raise ValueError(f"GpuNode {name}: mpsCeilingPercent must be an integer 1..100, "
                         f"got {ceiling!r}")
    gpus = tuple(
        sorted(
            (replace(_gpu(name, i, g), mps_ceiling_pct=ceiling)
             for i, g in enumerate(_list(name, "gpus", status.get("gpus", [])))),
            key=lambda g: g.index,
        )
    )
    if len({g.uuid for g in gpus}) != len(gpus):
        raise ValueError(f"GpuNode {name}: GPU uuids are not unique")
    sharing = set(SHARING_MODES[mode])
    if any(g.mig_instances for g in gpus):
        sharing.add(Isolation.MIG)
    datasets = frozenset(
        _dataset_name(name, i, d)
        for i, d in enumerate(_list(name, "datasets", status.get("datasets", [])))
    )
    ready = True
    if now is not None:
        heartbeat = status.get("heartbeat")
        if not isinstance(heartbeat, str):
            ready = False
        else:
            try:
                ready = now - parse_timestamp(heartbeat) <= stale_after
            except ValueError as err:
                raise ValueError(f"GpuNode {name}: heartbeat: {err}") from None
    return NodeInventory(
        name=name,
        gpus=gpus,
        zone=labels.get(LABEL_ZONE, ""),
        datasets=datasets,
        sharing=frozenset(sharing),
        ready=ready,
        labels=frozenset((str(k), str(v)) for k, v in labels.items()),
    )
