"""An in-memory `ClusterPort` for tests and benchmarks: pods, annotations and bindings.

Behaves like the API server where bind relies on it: a second Binding for a bound pod is a
409 Conflict, a missing pod a 404. Every change can be fed to a cache (as a watch would),
and a delay can be added to each call to widen race windows.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from carpool.extender.service import ClusterError

PodListener = Callable[[str, dict[str, Any]], None]


class FakeCluster:
    def __init__(self, delay_s: float = 0.0, on_change: PodListener | None = None) -> None:
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.delay_s = delay_s
        self.on_change = on_change
        self.bindings: list[tuple[str, str]] = []  # (pod key, node), in order
        self.fail_bind: set[str] = set()  # pod keys whose Binding fails with a 500, unwritten
        self.refuse_bind: set[str] = set()  # ... is refused (403)
        self.fail_after_bind: set[str] = set()  # ... is written, yet answered with a 500
        self._version = 0
        self.calls: list[str] = []  # "get", "annotate", "bind", in order

    def _touch(self, pod: dict[str, Any]) -> None:
        self._version += 1
        pod["metadata"]["resourceVersion"] = str(self._version)

    def add_pod(self, pod: Mapping[str, Any]) -> None:
        """Create a pod (its resourceVersion is set on the caller's object too)."""
        meta = pod["metadata"]
        stored = copy.deepcopy(dict(pod))
        with self._lock:
            self._touch(stored)
            self._pods[f"{meta.get('namespace', 'default')}/{meta['name']}"] = stored
            if isinstance(meta, dict):
                meta["resourceVersion"] = stored["metadata"]["resourceVersion"]
        self._notify("ADDED", stored)

    def update_pod(self, pod: Mapping[str, Any]) -> None:
        """Replace a pod as another client would (status, annotations, ...)."""
        meta = pod["metadata"]
        stored = copy.deepcopy(dict(pod))
        with self._lock:
            self._touch(stored)
            self._pods[f"{meta.get('namespace', 'default')}/{meta['name']}"] = stored
        self._notify("MODIFIED", stored)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._pods[f"{namespace}/{name}"])

    def _notify(self, event: str, pod: Mapping[str, Any]) -> None:
        if self.on_change is not None:
            self.on_change(event, copy.deepcopy(dict(pod)))

    def _wait(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.calls.append("get")
        self._wait()
        with self._lock:
            pod = self._pods.get(f"{namespace}/{name}")
            if pod is None:
                raise ClusterError(404, f'pods "{name}" not found')
            return copy.deepcopy(pod)

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None],
                     resource_version: str = "") -> None:
        """What another component (the device plugin) writes; bind never annotates."""
        self.calls.append("annotate")
        self._wait()
        with self._lock:
            pod = self._pods.get(f"{namespace}/{name}")
            if pod is None:
                raise ClusterError(404, f'pods "{name}" not found')
            if resource_version and resource_version != pod["metadata"]["resourceVersion"]:
                raise ClusterError(409, "the object has been modified; please apply your "
                                        "changes to the latest version and try again")
            self._touch(pod)
            current = pod["metadata"].setdefault("annotations", {})
            for key, value in annotations.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
            snapshot = copy.deepcopy(pod)
        self._notify("MODIFIED", snapshot)

    def bind_pod(self, namespace: str, name: str, uid: str, node: str,
                 annotations: Mapping[str, str], resource_version: str = "") -> None:
        self.calls.append("bind")
        self._wait()
        self._bind_now(namespace, name, uid, node, annotations, resource_version)

    def _bind_now(self, namespace: str, name: str, uid: str, node: str,
                  annotations: Mapping[str, str], resource_version: str) -> None:
        key = f"{namespace}/{name}"
        with self._lock:
            pod = self._pods.get(key)
            if pod is None:
                raise ClusterError(404, f'pods "{name}" not found')
            if uid and pod["metadata"].get("uid") != uid:
                raise ClusterError(409, "Precondition failed: UID mismatch")
            if resource_version and resource_version != pod["metadata"]["resourceVersion"]:
                raise ClusterError(409, "Precondition failed: resourceVersion mismatch")
            if key in self.fail_bind:
                raise ClusterError(500, "injected bind failure")
            if key in self.refuse_bind:
                raise ClusterError(403, "injected refusal")
            if pod["spec"].get("nodeName"):
                raise ClusterError(409, f"pod {name} is already assigned to node "
                                        f"{pod['spec']['nodeName']}")
            pod["spec"]["nodeName"] = node
            pod["metadata"].setdefault("annotations", {}).update(annotations)
            self._touch(pod)
            self.bindings.append((key, node))
            snapshot = copy.deepcopy(pod)
        self._notify("MODIFIED", snapshot)
        if key in self.fail_after_bind:
            raise ClusterError(500, "etcdserver: request timed out")

    def delete_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            pod = self._pods.pop(f"{namespace}/{name}")
        self._notify("DELETED", pod)


class LoopFakeCluster(FakeCluster):
    """`FakeCluster` that binds on the caller's event loop, as `kube.KubeCluster` does (its
    delay is an `asyncio.sleep`, not a thread's): what the latency benchmark needs, so that
    its server spends no thread, and no contention for the interpreter, per bind."""

    async def bind_pod_async(self, namespace: str, name: str, uid: str, node: str,
                             annotations: Mapping[str, str], resource_version: str = ""
                             ) -> None:
        self.calls.append("bind")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self._bind_now(namespace, name, uid, node, annotations, resource_version)


# --- object builders (tests, benchmarks, demos) ----------------------------------------------


def pod_object(name: str, *, gpus: int = 1, memory_gib: int = 0, cores: int = 0,
               namespace: str = "default", uid: str | None = None,
               annotations: Mapping[str, str] | None = None, containers: int = 1,
               scheduler: str = "carpool-scheduler") -> dict[str, Any]:
    """A pending pod asking for Carpool GPUs (same request in each of `containers`)."""
    limits = {"carpool.dev/gpu": str(gpus)}
    if memory_gib:
        limits["carpool.dev/gpu-memory"] = str(memory_gib)
    if cores:
        limits["carpool.dev/gpu-cores"] = str(cores)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}",
                     "annotations": dict(annotations or {})},
        "spec": {"schedulerName": scheduler,
                 "containers": [{"name": f"c{i}", "image": "busybox",
                                 "resources": {"limits": dict(limits)}}
                                for i in range(containers)]},
        "status": {"phase": "Pending"},
    }


def node_object(name: str, labels: Mapping[str, str] | None = None,
                ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def gpunode_object(name: str, gpus: list[Mapping[str, Any]], *, sharing: str = "mps",
                   datasets: list[str] | None = None) -> dict[str, Any]:
    """A GpuNode as the device plugin writes it; each GPU needs at least uuid and model."""
    status_gpus = []
    for i, gpu in enumerate(gpus):
        entry = {"index": i, "memoryTotalMiB": 80 * 1024, "temperatureC": 40.0,
                 "health": "Healthy"}
        entry.update(gpu)
        status_gpus.append(entry)
    return {
        "apiVersion": "carpool.dev/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": name},
        "status": {"sharingMode": sharing, "gpus": status_gpus, "datasets": datasets or []},
    }
