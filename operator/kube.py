"""The operator's access to the API server: create, patch, delete, events, and lists.

A thin port that speaks plain dicts over the kubernetes client's own connection pool
(urllib3, with its TLS and credentials) but not its generated API classes: those validate and
serialize every argument in Python, which made each call cost ~10 ms of CPU (measured: 110
pod creates/s with 32 threads through `CoreV1Api`, 530/s through the same pool directly).
Every call is synchronous; the reconciler runs them on a thread pool.

Each write records the resourceVersion the API server answered with, per kind, so the watch
caches (informer.py) can be asked to have caught up with this operator's own writes before
the next pass reads them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote, urlencode

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from carpool.core import names

log = logging.getLogger(__name__)
Obj = dict[str, Any]
# (connect, read) seconds for every call: an API server that accepts a request and never
# answers must not stall admission; the call fails and the next pass retries it.
REQUEST_TIMEOUT = (5.0, 120.0)
MERGE_PATCH = "application/merge-patch+json"
JOBS_PATH = f"/apis/{names.GROUP}/{names.VERSION}"
PODS = "pods"
GPUJOBS = names.GPUJOB_PLURAL
QUOTAS = names.PROJECTQUOTA_PLURAL


class Rest:
    """JSON requests through the ApiClient's urllib3 pool, with its credentials."""

    def __init__(self, api: client.ApiClient):
        self.configuration = api.configuration
        self.pool = api.rest_client.pool_manager
        self.host = str(self.configuration.host).rstrip("/")
        self.writes = 0  # requests other than GET so far (logged per pass)
        self._count = threading.Lock()

    def headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "carpool-operator"}
        if content_type:
            headers["Content-Type"] = content_type
        # refreshes an expiring token (in-cluster service account, exec plugins)
        token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token
        return headers

    def url(self, path: str, query: dict[str, Any] | None = None) -> str:
        return self.host + path + (f"?{urlencode(query)}" if query else "")

    def call(self, method: str, path: str, body: Any = None, *,
             content_type: str = "application/json", query: dict[str, Any] | None = None,
             timeout: tuple[float, float] = REQUEST_TIMEOUT) -> Obj:
        """The decoded answer; ApiException (with `status` and `body`) for 4xx/5xx."""
        payload = None if body is None else json.dumps(body).encode()
        if method != "GET":
            with self._count:
                self.writes += 1
        response = self.pool.request(
            method, self.url(path, query), body=payload,
            headers=self.headers(content_type if payload is not None else None),
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]), retries=False,
            preload_content=True)
        if response.status >= 400:
            raise ApiException(status=response.status, reason=response.reason,
                               body=response.data.decode("utf-8", "replace"))
        return dict(json.loads(response.data)) if response.data else {}

    def stream(self, path: str, query: dict[str, Any], read_timeout: float) -> Any:
        """An unread streaming response (watches); the caller reads and releases it."""
        response = self.pool.request(
            "GET", self.url(path, query), headers=self.headers(),
            timeout=urllib3.Timeout(connect=REQUEST_TIMEOUT[0], read=read_timeout),
            retries=False, preload_content=False)
        if response.status >= 400:
            body = response.data.decode("utf-8", "replace")
            response.release_conn()
            raise ApiException(status=response.status, reason=response.reason, body=body)
        return response


def job_path(namespace: str, name: str = "") -> str:
    base = f"{JOBS_PATH}/namespaces/{quote(namespace)}/{GPUJOBS}"
    return f"{base}/{quote(name)}" if name else base


def pod_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{quote(namespace)}/pods"
    return f"{base}/{quote(name)}" if name else base


class Kube:
    def __init__(self, api: client.ApiClient, component: str = "carpool-operator"):
        self.api = api
        self.rest = Rest(api)
        self.component = component
        # one thread: Events are best effort and must not take the API server's time from
        # admissions in a burst (they queue, and are posted in order as it allows)
        self._event_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
        self._lock = threading.Lock()
        self.written: dict[str, int] = {}  # kind -> highest resourceVersion we wrote

    def _wrote(self, kind: str, obj: Obj) -> str | None:
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if not version or not str(version).isdigit():
            return None
        with self._lock:
            self.written[kind] = max(self.written.get(kind, 0), int(version))
        return str(version)

    def list_all(self, path: str, query: dict[str, Any] | None = None) -> tuple[list[Obj], str]:
        """Every item (in pages) and the list's resourceVersion."""
        items: list[Obj] = []
        params = dict(query or {}, limit=500)
        while True:
            page = self.rest.call("GET", path, query=params)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion", ""))
            params["continue"] = meta["continue"]

    def ensure_priority_class(self) -> None:
        """The PriorityClass every job pod uses: it makes kube-scheduler's own preemption
        (`preemptionPolicy: Never`) stay out of Carpool's way, which the API server's priority
        admission allows only when the pod's class says so too."""
        body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": names.PRIORITY_CLASS}, "value": 0,
                "preemptionPolicy": "Never", "globalDefault": False,
                "description": "Carpool GpuJob pods; Carpool itself decides preemption."}
        try:
            self.rest.call("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body)
        except ApiException as err:
            if err.status == 403:  # installed by the Helm chart; the operator may not create it
                log.info("may not create PriorityClass %s; expecting it to exist",
                         names.PRIORITY_CLASS)
            elif err.status != 409:
                raise

    def create_pod(self, pod: Obj) -> bool:
        """Create the pod; False if it already exists (an earlier pass created it)."""
        try:
            created = self.rest.call("POST", pod_path(pod["metadata"]["namespace"]), pod)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        self._wrote(PODS, created)
        return True

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        query = {"gracePeriodSeconds": grace_seconds} if grace_seconds is not None else None
        try:
            answer = self.rest.call("DELETE", pod_path(namespace, name), query=query)
        except ApiException as err:
            if err.status != 404:
                raise
            return
        if answer.get("kind") == "Pod":
            self._wrote(PODS, answer)

    def patch_job_status(self, namespace: str, name: str, status: Obj) -> str | None:
        """Merge `status` in; the job's new resourceVersion (None if it is gone)."""
        try:
            answer = self.rest.call("PATCH", job_path(namespace, name) + "/status",
                                    {"status": status}, content_type=MERGE_PATCH)
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing to record
                raise
            return None
        return self._wrote(GPUJOBS, answer)

    def set_job_finalizers(self, namespace: str, name: str, finalizers: list[str],
                           resource_version: str) -> bool:
        """Replace the job's finalizers, only if it is unchanged since read (False if it
        changed or is gone: the next pass reads it again)."""
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}}
        try:
            answer = self.rest.call("PATCH", job_path(namespace, name), body,
                                    content_type=MERGE_PATCH)
        except ApiException as err:
            if err.status in (404, 409):
                return False
            raise
        self._wrote(GPUJOBS, answer)
        return True

    def patch_quota_status(self, name: str, status: Obj) -> None:
        try:
            answer = self.rest.call("PATCH", f"{JOBS_PATH}/{QUOTAS}/{quote(name)}/status",
                                    {"status": status}, content_type=MERGE_PATCH)
        except ApiException as err:
            if err.status != 404:
                raise
            return
        self._wrote(QUOTAS, answer)

    def event(self, regarding: Obj, reason: str, note: str, type_: str = "Normal",
              action: str = "Reconcile") -> None:
        """Record a Kubernetes Event on `regarding` in the background (events are best effort
        and must not slow a pass down); failures are logged, never raised. Only a reference
        to the object waits in the queue, not the object (a burst queues thousands)."""
        meta = regarding.get("metadata", {})
        reference = {"apiVersion": regarding.get("apiVersion"), "kind": regarding.get("kind"),
                     "name": meta.get("name"), "namespace": meta.get("namespace"),
                     "uid": meta.get("uid")}
        self._event_pool.submit(self._post_event, reference, reason, note, type_, action)

    def _post_event(self, regarding: Obj, reason: str, note: str, type_: str,
                    action: str) -> None:
        now = dt.datetime.now(dt.UTC)
        namespace = regarding.get("namespace") or "default"
        name = str(regarding.get("name") or "carpool")
        body: Obj = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": f"{name[:200]}.{uuid.uuid4().hex[:16]}",
                         "namespace": namespace},
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": f"{names.GROUP}/{self.component}",
            "reportingInstance": self.component,
            "action": action,
            "reason": reason,
            "note": note[:1024],
            "type": type_,
            "regarding": regarding,
        }
        try:
            self.rest.call("POST", f"/apis/events.k8s.io/v1/namespaces/{quote(namespace)}/events",
                           body)
        except Exception as err:
            log.warning("event %s on %s not recorded: %s", reason, name, err)
