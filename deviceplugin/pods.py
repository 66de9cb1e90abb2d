"""How the plugin finds the pods on its node and marks them allocated: a port and a fake.

The real implementation, backed by the Kubernetes API, is in `kube.py`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from carpool.core.names import ANN_ALLOCATED
from carpool.deviceplugin.handshake import ServedPod


class PodSource(Protocol):
    async def pods_on_node(self, node: str) -> list[ServedPod]:
        """Every pod bound to `node` (spec.nodeName), any phase."""
        ...

    async def mark_allocated(self, pod: ServedPod, value: str) -> None:
        """Set the pod's `carpool.dev/allocated` annotation to `value`."""
        ...


class StaticPodSource:
    """Pods held in memory: unit tests, the GPU benchmark, dry runs."""

    def __init__(self, pods: list[ServedPod] | None = None) -> None:
        self.pods: dict[str, ServedPod] = {p.key: p for p in pods or []}
        self.marked: list[tuple[str, str]] = []

    def add(self, pod: ServedPod) -> None:
        self.pods[pod.key] = pod

    async def pods_on_node(self, node: str) -> list[ServedPod]:
        return list(self.pods.values())

    async def mark_allocated(self, pod: ServedPod, value: str) -> None:
        current = self.pods.get(pod.key)
        if current is None:
            raise LookupError(f"pod {pod.key} is gone")
        self.pods[pod.key] = replace(current, annotations={**current.annotations,
                                                           ANN_ALLOCATED: value})
        self.marked.append((pod.key, value))
