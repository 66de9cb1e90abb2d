"""The extender's Kubernetes adapters: the bind calls and the watches that feed the cache.

Everything is handled as plain JSON dicts (`_preload_content=False`, `deserialize=False`):
the cache wants dicts, it is faster, and it sidesteps the Python client's known failure to
deserialize the Binding create response.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from carpool.core import names
from carpool.extender.cache import ClusterCache
from carpool.extender.service import ClusterError

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 240  # the server ends each watch after this; we then resume from the last RV
MAX_BACKOFF_S = 10.0


def api_client(kubeconfig: str | None, pool_size: int = 80) -> Any:
    """A client for the given kubeconfig, or the in-cluster service account."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(
            config_file=kubeconfig, client_configuration=configuration)
    else:
        config.load_incluster_config(
            client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def _error(exc: ApiException) -> ClusterError:
    message = exc.reason or "error"
    try:
        body = json.loads(exc.body or "{}")
        message = body.get("message") or message
    except (TypeError, ValueError):
        pass
    return ClusterError(int(exc.status or 0), str(message))


class KubeCluster:
    """`ClusterPort` over the Kubernetes Python client."""

    def __init__(self, api: Any, timeout_s: float = 10.0) -> None:
        self.core: Any = client.CoreV1Api(api)  # returns raw responses: typed as Any
        self.timeout_s = timeout_s

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            resp = self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                 _request_timeout=self.timeout_s)
        except ApiException as exc:
            raise _error(exc) from None
        pod: Mapping[str, Any] = json.loads(resp.data)
        return pod

    def bind_pod(self, namespace: str, name: str, uid: str, node: str,
                 annotations: Mapping[str, str], resource_version: str = "") -> None:
        """POST pods/NAME/binding; the API server copies its annotations onto the pod."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            metadata["uid"] = uid
        if resource_version:
            metadata["resourceVersion"] = resource_version
        if annotations:
            metadata["annotations"] = dict(annotations)
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": metadata,
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        try:
            self.core.create_namespaced_pod_binding(name, namespace, binding,
                                                    _preload_content=False,
                                                    _request_timeout=self.timeout_s)
        except ApiException as exc:
            raise _error(exc) from None


class Informer(threading.Thread):
    """List, then watch from the list's resourceVersion; relist on 410 or any error."""

    def __init__(self, kind: str, list_fn: Callable[..., Any], args: tuple[Any, ...],
                 replace: Callable[[list[Mapping[str, Any]]], None],
                 apply: Callable[[str, Mapping[str, Any]], None], cache: ClusterCache,
                 on_health: Callable[[bool], None] = lambda healthy: None) -> None:
        super().__init__(name=f"informer-{kind}", daemon=True)
        self.kind = kind
        self._list_fn = list_fn
        self._args = args
        self._replace = replace
        self._apply = apply
        self._cache = cache
        self._on_health = on_health
        self._stopping = threading.Event()
        self.relists = 0

    def stop(self) -> None:
        self._stopping.set()

    def _relist(self) -> str:
        try:
            resp = self._list_fn(*self._args, _preload_content=False, _request_timeout=60)
        except ApiException as exc:
            if exc.status == 404:  # the GpuNode CRD is not installed (yet): no GPU inventory
                self._replace([])
                self._cache.mark_synced(self.kind)
                log.warning("%s: the API server does not serve this resource yet", self.kind)
            raise
        data = json.loads(resp.data)
        self._replace(list(data.get("items") or []))
        self.relists += 1
        self._cache.mark_synced(self.kind)
        return str(data["metadata"]["resourceVersion"])

    def _watch(self, resource_version: str) -> str:
        watcher: Any = watch.Watch()
        stream = watcher.stream(
            self._list_fn, *self._args, resource_version=resource_version,
            timeout_seconds=WATCH_TIMEOUT_S, allow_watch_bookmarks=True, deserialize=False,
            _request_timeout=WATCH_TIMEOUT_S + 30)
        for event in stream:
            obj = event.get("object") or {}
            resource_version = (obj.get("metadata") or {}).get("resourceVersion",
                                                               resource_version)
            if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                self._apply(str(event["type"]), obj)
            if self._stopping.is_set():
                break
        return resource_version

    def run(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                resource_version = self._relist()
                self._on_health(True)
                backoff = 0.2
                while not self._stopping.is_set():
                    resource_version = self._watch(resource_version)
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("%s watch failed (%s); relisting", self.kind, exc.status)
            except Exception as exc:  # a watch must outlive any one failure
                log.warning("%s watch failed: %s; relisting", self.kind, exc)
            self._on_health(False)
            self._stopping.wait(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)


def start_informers(api: Any, cache: ClusterCache) -> list[Informer]:
    """Watch Nodes, GpuNodes and Pods into `cache`; returns the started threads."""
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)

    def pods_health(healthy: bool) -> None:
        cache.pods_watch_healthy = healthy

    informers = [
        Informer("nodes", core.list_node, (), cache.replace_nodes, cache.apply_node, cache),
        Informer("gpunodes", custom.list_cluster_custom_object,
                 (names.GROUP, names.VERSION, names.GPUNODE_PLURAL),
                 cache.replace_gpunodes, cache.apply_gpunode, cache),
        Informer("pods", core.list_pod_for_all_namespaces, (),
                 lambda pods: cache.replace_pods(pods, time.time()),
                 lambda event, pod: cache.apply_pod(event, pod, time.time()), cache,
                 on_health=pods_health),
    ]
    for informer in informers:
        informer.start()
    return informers


def stop_informers(informers: Iterable[Informer]) -> None:
    for informer in informers:
        informer.stop()
