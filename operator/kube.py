"""The operator's access to the API server: list, create, patch, delete, events.

A thin port over the kubernetes client that speaks plain dicts (raw JSON, no model
deserialization: listing thousands of GpuJobs stays fast). Every call is synchronous; the
async shell runs them in a worker thread.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from carpool.core import names

log = logging.getLogger(__name__)
Obj = dict[str, Any]
# (connect, read) seconds for every call: an API server that accepts a request and never
# answers must not stall admission; the call fails and the next pass retries it.
REQUEST_TIMEOUT = (5.0, 120.0)
# Every call: raw JSON back (no model deserialization), with the timeout.
RAW: dict[str, Any] = {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT}


class Kube:
    def __init__(self, api: client.ApiClient, component: str = "carpool-operator"):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.events = client.EventsV1Api(api)
        self.component = component
        self._event_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="events")

    @staticmethod
    def _items(response: Any) -> list[Obj]:
        return list(json.loads(response.data)["items"])

    def list_gpujobs(self) -> list[Obj]:
        return self._items(self.custom.list_cluster_custom_object(
            names.GROUP, names.VERSION, names.GPUJOB_PLURAL, **RAW))

    def list_quotas(self) -> list[Obj]:
        return self._items(self.custom.list_cluster_custom_object(
            names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, **RAW))

    def list_gpunodes(self) -> list[Obj]:
        return self._items(self.custom.list_cluster_custom_object(
            names.GROUP, names.VERSION, names.GPUNODE_PLURAL, **RAW))

    def list_nodes(self) -> list[Obj]:
        return self._items(self.core.list_node(**RAW))

    def list_managed_pods(self) -> list[Obj]:
        return self._items(self.core.list_pod_for_all_namespaces(
            label_selector=f"{names.LABEL_MANAGED}=true", **RAW))

    def list_namespaces(self) -> list[Obj]:
        return self._items(self.core.list_namespace(**RAW))

    def ensure_priority_class(self) -> None:
        """The PriorityClass every job pod uses: it makes kube-scheduler's own preemption
        (`preemptionPolicy: Never`) stay out of Carpool's way, which the API server's priority
        admission allows only when the pod's class says so too."""
        body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": names.PRIORITY_CLASS}, "value": 0,
                "preemptionPolicy": "Never", "globalDefault": False,
                "description": "Carpool GpuJob pods; Carpool itself decides preemption."}
        try:
            client.SchedulingV1Api(self.api).create_priority_class(body, **RAW)
        except ApiException as err:
            if err.status == 403:  # installed by the Helm chart; the operator may not create it
                log.info("may not create PriorityClass %s; expecting it to exist",
                         names.PRIORITY_CLASS)
            elif err.status != 409:
                raise

    def create_pod(self, pod: Obj) -> bool:
        """Create the pod; False if it already exists (an earlier pass created it)."""
        try:
            self.core.create_namespaced_pod(pod["metadata"]["namespace"], pod,
                                            **RAW)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        return True

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=grace_seconds)
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body, **RAW)
        except ApiException as err:
            if err.status != 404:
                raise

    def patch_job_status(self, namespace: str, name: str, status: Obj) -> str | None:
        """Merge `status` in; the job's new resourceVersion (None if it is gone)."""
        try:
            response = self.custom.patch_namespaced_custom_object_status(
                names.GROUP, names.VERSION, namespace, names.GPUJOB_PLURAL, name,
                {"status": status}, **RAW)
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing to record
                raise
            return None
        try:
            return str(json.loads(response.data)["metadata"]["resourceVersion"])
        except (ValueError, KeyError, TypeError):
            return None

    def set_job_finalizers(self, namespace: str, name: str, finalizers: list[str],
                           resource_version: str) -> bool:
        """Replace the job's finalizers, only if it is unchanged since read (False if it
        changed or is gone: the next pass reads it again)."""
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}}
        try:
            self.custom.patch_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.GPUJOB_PLURAL, name, body,
                **RAW)
        except ApiException as err:
            if err.status in (404, 409):
                return False
            raise
        return True

    def patch_quota_status(self, name: str, status: Obj) -> None:
        try:
            self.custom.patch_cluster_custom_object_status(
                names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, name,
                {"status": status}, **RAW)
        except ApiException as err:
            if err.status != 404:
                raise

    def event(self, regarding: Obj, reason: str, note: str, type_: str = "Normal",
              action: str = "Reconcile") -> None:
        """Record a Kubernetes Event on `regarding` in the background (events are best effort
        and must not slow a pass down); failures are logged, never raised."""
        self._event_pool.submit(self._post_event, regarding, reason, note, type_, action)

    def drain_events(self) -> None:
        """Wait until every Event submitted so far is posted (tests, clean shutdown)."""
        self._event_pool.shutdown(wait=True)
        self._event_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="events")

    def _post_event(self, regarding: Obj, reason: str, note: str, type_: str,
                    action: str) -> None:
        meta = regarding.get("metadata", {})
        now = dt.datetime.now(dt.UTC)
        namespace = meta.get("namespace") or "default"
        body: Obj = {
            "metadata": {"name": f"{meta.get('name', 'carpool')[:200]}.{uuid.uuid4().hex[:16]}",
                         "namespace": namespace},
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": f"{names.GROUP}/{self.component}",
            "reportingInstance": self.component,
            "action": action,
            "reason": reason,
            "note": note[:1024],
            "type": type_,
            "regarding": {
                "apiVersion": regarding.get("apiVersion"),
                "kind": regarding.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
        }
        try:
            self.events.create_namespaced_event(namespace, body,
                                                **RAW)
        except Exception as err:
            log.warning("event %s on %s not recorded: %s", reason, meta.get("name"), err)
