"""The extender's Kubernetes adapters: the bind calls and the watches that feed the cache.

Everything is handled as plain JSON dicts (`_preload_content=False`, `deserialize=False`):
the cache wants dicts, it is faster, and it sidesteps the Python client's known failure to
deserialize the Binding create response.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from carpool.core import names
from carpool.extender.cache import ClusterCache
from carpool.extender.service import ClusterError
from carpool.extender.wire import dump_json

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 240  # the server ends each watch after this; we then resume from the last RV
MAX_BACKOFF_S = 10.0
BIND_CONNECTIONS = 64  # concurrent Binding requests to the API server
# The pods the cache needs: only a bound, unfinished pod holds GPUs, CPU or memory. Pending
# pods (every pod's first event, and the scheduler's status writes while it waits) are not
# sent at all, and a pod that finishes leaves the selection (a DELETED event). What this
# gives up: the deletion of a pod that never got bound. That matters only for a pod whose
# bind failed ambiguously (its GPUs stay assumed, see `Extender._bind_failed`) and that is
# then deleted before it is bound again: `Extender._follow_ambiguous` reads such a pod every
# few seconds and gives its GPUs back once it is gone.
PODS_THAT_HOLD = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


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
        self._configuration: Any = api.configuration
        self._session: aiohttp.ClientSession | None = None

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
        binding = self._binding(name, namespace, uid, node, annotations, resource_version)
        try:
            self.core.create_namespaced_pod_binding(name, namespace, binding,
                                                    _preload_content=False,
                                                    _request_timeout=self.timeout_s)
        except ApiException as exc:
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
        """`bind_pod` on the caller's event loop (aiohttp, same credentials).

        The Python client's blocking calls need a thread each; with a hundred binds a second
        those threads contended for the interpreter with filter and prioritize, and each
        call cost more CPU than the request itself.
        """
        cfg = self._configuration
        url = (f"{cfg.host.rstrip('/')}/api/v1/namespaces/{quote(namespace, safe='')}"
               f"/pods/{quote(name, safe='')}/binding")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        token = cfg.get_api_key_with_prefix("authorization")
        if token:
            headers["Authorization"] = token
        body = dump_json(self._binding(name, namespace, uid, node, annotations,
                                       resource_version))
        try:
            async with self._http().post(url, data=body, headers=headers) as resp:
                if resp.status < 300:
                    return
                text = await resp.text()
                status, reason = resp.status, resp.reason or "error"
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ClusterError(0, f"API server not reached: {exc}") from None
        try:
            message = json.loads(text).get("message") or reason
        except (ValueError, AttributeError):
            message = reason
        raise ClusterError(status, str(message))

    def _http(self) -> aiohttp.ClientSession:
        """One session per extender, made on first use (inside the running loop)."""
        if self._session is None or self._session.closed:
            cfg = self._configuration
            tls: ssl.SSLContext | bool = False
            if str(cfg.host).startswith("https"):
                tls = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
                if not cfg.verify_ssl:
                    tls.check_hostname = False
                    tls.verify_mode = ssl.CERT_NONE
                if cfg.cert_file:
                    tls.load_cert_chain(cfg.cert_file, cfg.key_file)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=tls, limit=BIND_CONNECTIONS),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class Informer(threading.Thread):
    """List, then watch from the list's resourceVersion; relist on 410 or any error.

    The watch stream is read and decoded here (orjson), not by the client's `watch.Watch`
    (the standard library's parser, and a copy of its buffer per line): this thread shares
    the interpreter with the event loop that answers the scheduler, so its time per event
    is time those requests may wait.
    """

    def __init__(self, kind: str, list_fn: Callable[..., Any], args: tuple[Any, ...],
                 replace: Callable[[list[Mapping[str, Any]]], None],
                 apply: Callable[[str, Mapping[str, Any]], None], cache: ClusterCache,
                 on_health: Callable[[bool], None] = lambda healthy: None,
                 field_selector: str = "") -> None:
        super().__init__(name=f"informer-{kind}", daemon=True)
        self.kind = kind
        self._list_fn = list_fn
        self._args = args
        self._selector = {"field_selector": field_selector} if field_selector else {}
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
            resp = self._list_fn(*self._args, _preload_content=False, _request_timeout=60,
                                 **self._selector)
        except ApiException as exc:
            if exc.status == 404:  # the GpuNode CRD is not installed (yet): no GPU inventory
                self._replace([])
                self._cache.mark_synced(self.kind)
                log.warning("%s: the API server does not serve this resource yet", self.kind)
            raise
        data = orjson.loads(resp.data)
        self._replace(list(data.get("items") or []))
        self.relists += 1
        self._cache.mark_synced(self.kind)
        return str(data["metadata"]["resourceVersion"])

    def _watch(self, resource_version: str) -> str:
        """One watch request until the server ends it; the last resourceVersion seen.

        An ERROR event (410 Gone: our version is too old) raises, and `run` lists again.
        """
        resp = self._list_fn(*self._args, watch=True, resource_version=resource_version,
                             timeout_seconds=WATCH_TIMEOUT_S, allow_watch_bookmarks=True,
                             _preload_content=False, _request_timeout=WATCH_TIMEOUT_S + 30,
                             **self._selector)
        try:
            if not 200 <= int(resp.status) < 300:
                raise ApiException(status=resp.status, reason="the watch was refused")
            pending = b""
            for chunk in resp.stream(amt=None, decode_content=False):
                if b"\n" not in chunk:  # one event may span many chunks
                    pending += chunk
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    resource_version = self._event(line, resource_version)
                    if self._stopping.is_set():
                        return resource_version
        finally:
            resp.close()
            resp.release_conn()
        return resource_version

    def _event(self, line: bytes, resource_version: str) -> str:
        if not line.strip():
            return resource_version
        event = orjson.loads(line)
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise ApiException(status=int(obj.get("code") or 500),
                               reason=str(obj.get("message") or "watch error"))
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._apply(str(kind), obj)
        return str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)

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
                 on_health=pods_health, field_selector=PODS_THAT_HOLD),
    ]
    for informer in informers:
        informer.start()
    return informers
