"""The extender's Kubernetes adapters: the bind calls and the watches that feed the cache,
both through `carpool.kube` (plain JSON dicts: the cache wants dicts, and it is faster)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from carpool.extender.cache import ClusterCache
from carpool.extender.service import ClusterError
from carpool.extender.wire import dump_json
from carpool.kube.aio import AioApi
from carpool.kube.client import Api
from carpool.kube.errors import ApiError, NotFound
from carpool.kube.resources import GPUJOBS, GPUNODES, NODES, PODS
from carpool.kube.watching import Reflector

log = logging.getLogger(__name__)

BIND_CONNECTIONS = 64  # concurrent Binding requests to the API server
# The pods the cache needs: only a bound, unfinished pod holds GPUs, CPU or memory. Pending
# pods (every pod's first event, and the scheduler's status writes while it waits) are not
# sent at all, and a pod that finishes leaves the selection (a DELETED event). What this
# gives up: the deletion of a pod that never got bound. That matters only for a pod whose
# bind failed ambiguously (its GPUs stay assumed, see `Extender._bind_failed`) and that is
# then deleted before it is bound again: `Extender._follow_ambiguous` reads such a pod every
# few seconds and gives its GPUs back once it is gone.
PODS_THAT_HOLD = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


def api_client(kubeconfig: str | None, pool_size: int = 80) -> Api:
    """A client for the given kubeconfig, or the in-cluster service account."""
    return Api.load(kubeconfig, pool_size=pool_size, user_agent="carpool-extender")


def _error(exc: ApiError) -> ClusterError:
    return ClusterError(exc.status, exc.message)


class KubeCluster:
    """`ClusterPort` over the API server."""

    def __init__(self, api: Api, timeout_s: float = 10.0) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self._aio = AioApi(api, connections=BIND_CONNECTIONS, timeout_s=timeout_s)

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            return self.api.request("GET", PODS.path(namespace, name),
                                    timeout=(self.timeout_s, self.timeout_s))
        except ApiError as exc:
            raise _error(exc) from None

    def bind_pod(self, namespace: str, name: str, uid: str, node: str,
                 annotations: Mapping[str, str], resource_version: str = "") -> None:
        """POST pods/NAME/binding; the API server copies its annotations onto the pod."""
        binding = self._binding(name, namespace, uid, node, annotations, resource_version)
        try:
            self.api.request("POST", PODS.path(namespace, name, "binding"), binding,
                             timeout=(self.timeout_s, self.timeout_s))
        except ApiError as exc:
            raise _error(exc) from None

    @staticmethod
    def _binding(name: str, namespace: str, uid: str, node: str,
                 annotations: Mapping[str, str], resource_version: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            metadata["uid"] = uid
        if resource_version:
            metadata["resourceVersion"] = resource_version
        if annotations:
            metadata["annotations"] = dict(annotations)
        return {"apiVersion": "v1", "kind": "Binding", "metadata": metadata,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}

    async def bind_pod_async(self, namespace: str, name: str, uid: str, node: str,
                             annotations: Mapping[str, str], resource_version: str = "") -> None:
        """`bind_pod` on the caller's event loop (see `carpool.kube.aio`)."""
        body = dump_json(self._binding(name, namespace, uid, node, annotations,
                                       resource_version))
        try:
            await self._aio.request("POST", PODS.path(namespace, name, "binding"), body)
        except ApiError as exc:
            raise _error(exc) from None

    async def close(self) -> None:
        await self._aio.close()


def start_informers(api: Api, cache: ClusterCache) -> list[Reflector]:
    """Watch Nodes, GpuNodes and Pods into `cache`; returns the started reflectors."""

    def synced(kind: str, replace: Any) -> Any:
        def on_list(items: list[dict[str, Any]], version: str) -> None:
            replace(items)
            cache.mark_synced(kind)
        return on_list

    def gpunodes_failed(err: Exception) -> None:
        if isinstance(err, NotFound):  # the GpuNode CRD is not installed (yet): no GPUs
            cache.replace_gpunodes([])
            cache.mark_synced("gpunodes")

    def gpujobs_failed(err: Exception) -> None:
        if isinstance(err, NotFound):  # the GpuJob CRD is not installed (yet): no jobs
            cache.replace_gpujobs([])
            cache.mark_synced("gpujobs")

    def pods_listed(pods: list[dict[str, Any]], version: str) -> None:
        cache.replace_pods(pods, time.time())
        cache.mark_synced("pods")
        cache.pods_watch_healthy = True

    def pods_failed(err: Exception) -> None:
        cache.pods_watch_healthy = False

    reflectors = [
        Reflector(api, NODES, on_list=synced("nodes", cache.replace_nodes),
                  on_event=cache.apply_node),
        Reflector(api, GPUNODES, on_list=synced("gpunodes", cache.replace_gpunodes),
                  on_event=cache.apply_gpunode, on_error=gpunodes_failed),
        # (the cache keeps of each only its uid and the GPU request of its spec)
        Reflector(api, GPUJOBS, on_list=synced("gpujobs", cache.replace_gpujobs),
                  on_event=cache.apply_gpujob, on_error=gpujobs_failed),
        Reflector(api, PODS, on_list=pods_listed,
                  on_event=lambda event, pod: cache.apply_pod(event, pod, time.time()),
                  on_error=pods_failed, field_selector=PODS_THAT_HOLD),
    ]
    for reflector in reflectors:
        reflector.start()
    return reflectors
