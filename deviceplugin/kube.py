"""The Kubernetes side of the plugin: pods on this node, the allocated mark, GpuNode status and
Events. The kubernetes client is synchronous, so calls run in worker threads."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core.names import ANN_ALLOCATED, GPUNODE_PLURAL, GROUP, RESOURCE_GPU, VERSION
from carpool.deviceplugin.handshake import PodView

COMPONENT = "carpool-device-plugin"


def load_config(kubeconfig: str | None) -> client.ApiClient:
    kube_config: Any = importlib.import_module("kubernetes.config")  # untyped loaders
    if kubeconfig:
        kube_config.load_kube_config(config_file=kubeconfig)
    else:
        kube_config.load_incluster_config()
    return client.ApiClient()


def _gpu_count(container: Any) -> int:
    resources = container.resources
    if resources is None:
        return 0
    for table in (resources.limits, resources.requests):
        if table and RESOURCE_GPU in table:
            return int(str(table[RESOURCE_GPU]))
    return 0


def pod_view(pod: Any) -> PodView:
    meta, spec, status = pod.metadata, pod.spec, pod.status
    return PodView(
        namespace=meta.namespace,
        name=meta.name,
        uid=meta.uid or "",
        phase=(status.phase if status else "") or "",
        deleting=meta.deletion_timestamp is not None,
        annotations=dict(meta.annotations or {}),
        gpu_containers=tuple(
            (c.name, n) for c in (spec.containers or []) if (n := _gpu_count(c)) > 0
        ),
    )


class KubernetesCluster:
    """`PodSource` and `ClusterWriter` over the API server."""

    def __init__(self, api: client.ApiClient, node: str) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.node = node

    async def pods_on_node(self, node: str) -> list[PodView]:
        listed = await asyncio.to_thread(
            self.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")
        return [pod_view(p) for p in listed.items]

    async def mark_allocated(self, pod: PodView, value: str) -> None:
        body = {"metadata": {"annotations": {ANN_ALLOCATED: value}}}
        await asyncio.to_thread(self.core.patch_namespaced_pod, pod.name, pod.namespace, body)

    async def publish_status(self, node: str, status: Mapping[str, Any]) -> None:
        body = {"status": dict(status)}
        try:
            await asyncio.to_thread(self.custom.patch_cluster_custom_object_status,
                                    GROUP, VERSION, GPUNODE_PLURAL, node, body)
        except ApiException as err:
            if err.status != 404:
                raise
            gpunode = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuNode",
                       "metadata": {"name": node}}
            await asyncio.to_thread(self.custom.create_cluster_custom_object,
                                    GROUP, VERSION, GPUNODE_PLURAL, gpunode)
            await asyncio.to_thread(self.custom.patch_cluster_custom_object_status,
                                    GROUP, VERSION, GPUNODE_PLURAL, node, body)

    async def pod_event(self, pod: PodView, reason: str, message: str, warning: bool) -> None:
        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{pod.name}."),
            involved_object=client.V1ObjectReference(kind="Pod", namespace=pod.namespace,
                                                     name=pod.name, uid=pod.uid),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=COMPONENT, host=self.node),
            first_timestamp=now, last_timestamp=now, count=1,
        )
        await asyncio.to_thread(self.core.create_namespaced_event, pod.namespace, event)
