"""A node's GPU inventory from its Node and GpuNode objects (Kubernetes JSON dicts).

The GpuNode status is parsed by the shared `carpool.core.gpunode` parser (the device plugin
owns that schema); this adds what only the Node knows: readiness and labels. Heartbeat
staleness is not applied here, because the cache rebuilds an inventory only when an object
changes, and simulated (KWOK) nodes have no plugin to beat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.quantities import quantity_mib, quantity_milli
from carpool.core.resources import NodeInventory


class InventoryError(ValueError):
    """A GpuNode status the extender cannot read; the message becomes the filter reason."""


def node_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def inventory_from_objects(node: Mapping[str, Any],
                           gpunode: Mapping[str, Any] | None) -> NodeInventory:
    """The placement view of one node; a node without a GpuNode has no GPUs."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name", ""))
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    status = (gpunode or {}).get("status") or {}
    if not isinstance(status, Mapping):
        raise InventoryError(f"GpuNode {name}: status must be an object")
    try:
        inventory = inventory_from_gpunode(name, status, labels)
    except (ValueError, TypeError) as exc:
        raise InventoryError(f"GpuNode status unreadable: {exc}") from None
    cpu_milli, memory_mib = node_allocatable(node)
    return replace(inventory, ready=inventory.ready and node_ready(node), cpu_milli=cpu_milli,
                   memory_mib=memory_mib)


def node_allocatable(node: Mapping[str, Any]) -> tuple[int, int]:
    """The Node's allocatable CPU (milli) and memory (MiB); 0 (unconstrained) where missing
    or unreadable: they feed the CPU-balance score, while kube-scheduler enforces them."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    out = []
    for resource, parse in (("cpu", quantity_milli), ("memory", quantity_mib)):
        value = allocatable.get(resource) if isinstance(allocatable, Mapping) else None
        try:
            out.append(max(0, parse(str(value))) if value is not None else 0)
        except (ValueError, ArithmeticError):
            out.append(0)
    return out[0], out[1]
