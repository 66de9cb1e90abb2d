"""The Kubernetes side of the plugin: pods on this node, the allocated mark, GpuNode status and
Events, through `carpool.kube` (synchronous requests, so calls run in worker threads)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Mapping
from typing import Any

from carpool.core.names import ANN_ALLOCATED, RESOURCE_GPU
from carpool.core.ownership import gpujob_owner
from carpool.deviceplugin.handshake import ServedPod
from carpool.deviceplugin.reports import Refused
from carpool.kube.client import Api
from carpool.kube.errors import Forbidden, Invalid, NotFound
from carpool.kube.events import event_body, events_path
from carpool.kube.resources import GPUJOBS, GPUNODES, PODS

COMPONENT = "carpool-device-plugin"


def load_config(kubeconfig: str | None) -> Api:
    return Api.load(kubeconfig, user_agent=COMPONENT)


def _gpu_count(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    for table in (resources.get("limits"), resources.get("requests")):
        if table and RESOURCE_GPU in table:
            return int(str(table[RESOURCE_GPU]))
    return 0


def pod_view(pod: Mapping[str, Any]) -> ServedPod:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    return ServedPod(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta.get("uid") or "",
        phase=status.get("phase") or "",
        deleting=meta.get("deletionTimestamp") is not None,
        annotations=dict(meta.get("annotations") or {}),
        gpu_containers=tuple(
            (c["name"], n) for c in (spec.get("containers") or []) if (n := _gpu_count(c)) > 0
        ),
        owner=gpujob_owner(meta.get("ownerReferences")),
        scheduler=str(spec.get("schedulerName") or ""),
        run_as=_run_as(spec.get("securityContext")),
        containers_run_as=tuple(
            (str(c.get("name") or ""), *_run_as(c.get("securityContext")))
            for kind in ("initContainers", "containers") for c in spec.get(kind) or []),
    )


def _run_as(context: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    """A securityContext's runAsUser and runAsGroup (None: unset)."""
    context = context or {}
    user, group = context.get("runAsUser"), context.get("runAsGroup")
    return (int(user) if user is not None else None, int(group) if group is not None else None)


class KubernetesCluster:
    """`PodSource` and `ClusterWriter` over the API server (`api`: a `carpool.kube` `Api`, or a
    kubernetes `ApiClient`)."""

    def __init__(self, api: Api | Any, node: str) -> None:
        self.api = Api.of(api)
        self.node = node

    async def pods_on_node(self, node: str) -> list[ServedPod]:
        listed, _ = await asyncio.to_thread(
            self.api.list_all, PODS.path(), {"fieldSelector": f"spec.nodeName={node}"})
        return [pod_view(p) for p in listed]

    async def mark_allocated(self, pod: ServedPod, value: str) -> None:
        body = {"metadata": {"annotations": {ANN_ALLOCATED: value}}}
        await asyncio.to_thread(self.api.patch, PODS.path(pod.namespace, pod.name), body)

    async def publish_status(self, node: str, status: Mapping[str, Any]) -> None:
        body = {"status": dict(status)}
        path = GPUNODES.path(None, node, "status")
        try:
            await asyncio.to_thread(self.api.patch, path, body)
        except NotFound:
            gpunode = {"apiVersion": GPUNODES.api_version, "kind": "GpuNode",
                       "metadata": {"name": node}}
            await asyncio.to_thread(self.api.create, GPUNODES.path(), gpunode)
            await asyncio.to_thread(self.api.patch, path, body)

    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> None:
        """Merge what a job reported into its GpuJob's status (reports.py); `Refused` when
        the API server says no for good (the admission policy, a job gone)."""
        try:
            await asyncio.to_thread(self.api.patch, GPUJOBS.path(namespace, name, "status"),
                                    {"status": dict(status)})
        except (Forbidden, NotFound, Invalid) as err:
            raise Refused(str(err)) from None

    async def pod_event(self, pod: ServedPod, reason: str, message: str, warning: bool) -> None:
        regarding = {"apiVersion": "v1", "kind": "Pod", "name": pod.name,
                     "namespace": pod.namespace, "uid": pod.uid}
        event = event_body(regarding, reason, message, "Warning" if warning else "Normal",
                           "Watch", "device-plugin", f"{COMPONENT}-{self.node}",
                           dt.datetime.now(dt.UTC))
        await asyncio.to_thread(self.api.create, events_path(pod.namespace), event)
