"""The operator's writes to the API server: pods (and their finalizer), statuses, Events.

A thin port over `carpool.kube.client.Api` (plain dicts, typed errors). Every call is
synchronous; the reconciler runs them on a thread pool.

Each write records the resourceVersion the API server answered with, per kind, so the watch
caches (informer.py) can be asked to have caught up with this operator's own writes before
the next pass reads them.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from carpool.core import names
from carpool.kube.client import JSON_PATCH, MERGE_PATCH, Api
from carpool.kube.errors import Conflict, Forbidden, Invalid, NotFound
from carpool.kube.events import event_body, events_path, reference
from carpool.kube.resources import GPUJOBS as GPUJOB_RESOURCE
from carpool.kube.resources import (
    PERSISTENTVOLUMECLAIMS,
    PRIORITY_CLASSES,
    PROJECTQUOTAS,
    SERVICES,
)
from carpool.kube.resources import PODS as POD_RESOURCE

log = logging.getLogger(__name__)
Obj = dict[str, Any]
PODS = "pods"
GPUJOBS = names.GPUJOB_PLURAL
QUOTAS = names.PROJECTQUOTA_PLURAL


class Kube:
    def __init__(self, api: Api, component: str = "carpool-operator"):
        self.api = api
        self.component = component
        # one thread: Events are best effort and must not take the API server's time from
        # admissions in a burst (they queue, and are posted in order as it allows)
        self._event_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
        self._lock = threading.Lock()
        self._written: dict[str, int] = {}  # kind -> highest resourceVersion we wrote

    def written_versions(self) -> dict[str, int]:
        """Kind -> the highest resourceVersion this client has written so far (a copy): what
        a watch cache must have seen before a pass may trust it (`Informers.caught_up`)."""
        with self._lock:
            return dict(self._written)

    def _wrote(self, kind: str, obj: Obj) -> str | None:
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if not version or not str(version).isdigit():
            return None
        with self._lock:
            self._written[kind] = max(self._written.get(kind, 0), int(version))
        return str(version)

    def ensure_priority_class(self) -> None:
        """The PriorityClass every job pod uses: it makes kube-scheduler's own preemption
        (`preemptionPolicy: Never`) stay out of Carpool's way, which the API server's priority
        admission allows only when the pod's class says so too."""
        body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": names.PRIORITY_CLASS}, "value": 0,
                "preemptionPolicy": "Never", "globalDefault": False,
                "description": "Carpool GpuJob pods; Carpool itself decides preemption."}
        try:
            self.api.create(PRIORITY_CLASSES.path(), body)
        except Forbidden:  # installed by the Helm chart; the operator may not create it
            log.info("may not create PriorityClass %s; expecting it to exist",
                     names.PRIORITY_CLASS)
        except Conflict:
            pass

    def create_pod(self, pod: Obj) -> tuple[bool, Obj | None]:
        """Create the pod: (True, the pod created), or (False, the pod of that name already
        there: an earlier pass created it, or someone else did; None if it went meanwhile)."""
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        try:
            created = self.api.create(POD_RESOURCE.path(namespace), pod)
        except Conflict:
            try:
                return False, self.api.get(POD_RESOURCE.path(namespace, name))
            except NotFound:
                return False, None
        self._wrote(PODS, created)
        return True, created

    def ensure_claim(self, claim: Obj) -> bool:
        """Create the PersistentVolumeClaim unless it exists; True if this call created it."""
        try:
            self.api.create(PERSISTENTVOLUMECLAIMS.path(claim["metadata"]["namespace"]), claim)
        except Conflict:
            return False
        return True

    def ensure_service(self, service: Obj) -> bool:
        """Create the Service unless it exists; True if this call created it."""
        try:
            self.api.create(SERVICES.path(service["metadata"]["namespace"]), service)
        except Conflict:
            return False
        return True

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None,
                   uid: str = "") -> None:
        """Delete the pod (only the one with `uid`, when given: a pod of the same name
        created since is not touched)."""
        query = {"gracePeriodSeconds": grace_seconds} if grace_seconds is not None else None
        path = POD_RESOURCE.path(namespace, name)
        if uid:
            body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions",
                         "preconditions": {"uid": uid}}
            if grace_seconds is not None:
                body["gracePeriodSeconds"] = grace_seconds
            try:
                answer: Obj | None = self.api.request("DELETE", path, body)
            except (NotFound, Conflict):  # gone, or another pod by that name now
                return
        else:
            answer = self.api.delete(path, query)
        if answer is not None and answer.get("kind") == "Pod":
            self._wrote(PODS, answer)

    def patch_job_status(self, namespace: str, name: str, status: Obj) -> str | None:
        """Merge `status` in; the job's new resourceVersion (None if it is gone)."""
        try:
            answer = self.api.patch(GPUJOB_RESOURCE.path(namespace, name, "status"),
                                    {"status": status})
        except NotFound:  # deleted meanwhile: nothing to record
            return None
        return self._wrote(GPUJOBS, answer)

    def release_pod(self, namespace: str, name: str, uid: str, finalizers: list[str]) -> bool:
        """Remove Carpool's finalizer from the pod of `uid`, only while its finalizers are
        still `finalizers` (as read): a JSON patch that tests both, so the kubelet's status
        writes do not make it conflict. False if the pod changed or is gone (the next pass
        reads it again)."""
        body = [{"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
                {"op": "replace", "path": "/metadata/finalizers",
                 "value": [f for f in finalizers if f != names.FINALIZER]}]
        try:
            answer = self.api.request("PATCH", POD_RESOURCE.path(namespace, name), body,
                                      content_type=JSON_PATCH)
        except (NotFound, Conflict, Invalid):
            return False
        self._wrote(PODS, answer)
        return True

    def set_job_finalizers(self, namespace: str, name: str, finalizers: list[str],
                           resource_version: str) -> bool:
        """Replace the job's finalizers, only if it is unchanged since read (False if it
        changed or is gone: the next pass reads it again). Only to remove the finalizer
        that earlier releases put on GpuJobs (`Reconciler._retire`)."""
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}}
        try:
            answer = self.api.patch(GPUJOB_RESOURCE.path(namespace, name), body, MERGE_PATCH)
        except (NotFound, Conflict):
            return False
        self._wrote(GPUJOBS, answer)
        return True

    def patch_quota_status(self, name: str, status: Obj) -> None:
        try:
            answer = self.api.patch(PROJECTQUOTAS.path(None, name, "status"),
                                    {"status": status})
        except NotFound:
            return
        self._wrote(QUOTAS, answer)

    def event(self, regarding: Obj, reason: str, note: str, type_: str = "Normal",
              action: str = "Reconcile") -> None:
        """Record a Kubernetes Event on `regarding` in the background (events are best effort
        and must not slow a pass down); failures are logged, never raised. Only a reference
        to the object waits in the queue, not the object (a burst queues thousands). Not
        kopf's Event queue: it is reachable only from handlers of objects kopf watches
        (docs/architecture.md)."""
        self._event_pool.submit(self._post_event, reference(regarding), reason, note, type_,
                                action)

    def _post_event(self, regarding: Obj, reason: str, note: str, type_: str,
                    action: str) -> None:
        body = event_body(regarding, reason, note, type_, action, self.component, self.component,
                          dt.datetime.now(dt.UTC))
        namespace = body["metadata"]["namespace"]
        name = str(regarding.get("name") or "carpool")
        try:
            self.api.create(events_path(namespace), body)
        except Exception as err:
            log.warning("event %s on %s not recorded: %s", reason, name, err)
