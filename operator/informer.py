"""Watch caches: one list+watch per kind, feeding a local store the reconcile pass reads.

A pass used to list every GpuJob, pod and node (thousands of objects, most unchanged) and
kopf ran its per-event machinery for each watch event; here each kind has one thread that
lists once, then follows a watch and keeps the newest object per key. The pass still
re-derives everything from a complete view each time (level-triggered), only the view is
kept current by the watch instead of re-read.

Read-your-writes: a pass must see what the previous pass wrote (a pod it created, a status
it patched), or it would decide on a stale view (e.g. take a created pod for a lost one).
`Kube` records the resourceVersion of every write per kind; `Informers.caught_up` waits
until each store has seen at least that version. An expired watch (410 Gone), an ERROR event
or a broken stream leads to a fresh list, which replaces the store.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client.rest import ApiException

from carpool.core import names
from carpool.operator.following import DISRUPTION_TARGET
from carpool.operator.kube import GPUJOBS, JOBS_PATH, PODS, QUOTAS, Kube, Obj

log = logging.getLogger(__name__)
WATCH_SECONDS = 240  # server-side timeout of one watch request; it is then resumed
ARRIVALS_KEPT = 1024  # newest objects first seen by the watch, for `Informers.arrived_since`


@dataclass(frozen=True)
class Kind:
    name: str
    path: str
    namespaced: bool
    selector: str = ""
    arrivals: bool = False  # keep the newest first-seen objects (`Informers.arrived_since`)


KINDS = (
    Kind(GPUJOBS, f"{JOBS_PATH}/{GPUJOBS}", True, arrivals=True),
    Kind(PODS, "/api/v1/pods", True, f"{names.LABEL_MANAGED}=true"),
    Kind(QUOTAS, f"{JOBS_PATH}/{QUOTAS}", False),
    Kind(names.GPUNODE_PLURAL, f"{JOBS_PATH}/{names.GPUNODE_PLURAL}", False),
    Kind("nodes", "/api/v1/nodes", False),
)


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


# What a pass reads of a pod (`following.view_pod` and the job it belongs to): a store of
# thousands of pods keeps only these, not their conditions (but DisruptionTarget), IPs,
# images and other labels.
POD_METADATA = ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp")
POD_ANNOTATIONS = (names.ANN_JOB, names.ANN_ASSIGNMENT)
POD_STATUS = ("phase", "reason", "startTime")


def trimmed(obj: Obj, pod: bool = False) -> Obj:
    """What the store keeps of an object: no managedFields or last-applied copy (often half
    an object), and of a pod only what the operator reads (see POD_METADATA and below)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
        annotations = meta.get("annotations")
        if isinstance(annotations, dict):
            annotations.pop(LAST_APPLIED, None)
    if not pod:
        return obj
    meta = meta if isinstance(meta, dict) else {}
    annotations = meta.get("annotations") or {}
    status = obj.get("status") or {}
    node = (obj.get("spec") or {}).get("nodeName")
    kept_meta = {k: meta[k] for k in POD_METADATA if k in meta}
    kept_meta["annotations"] = {k: annotations[k] for k in POD_ANNOTATIONS if k in annotations}
    kept_status = {k: status[k] for k in POD_STATUS if k in status}
    if containers := status.get("containerStatuses"):
        kept_status["containerStatuses"] = [{"state": c.get("state") or {}} for c in containers]
    if disruption := [c for c in status.get("conditions") or []
                      if c.get("type") == DISRUPTION_TARGET]:
        kept_status["conditions"] = disruption
    return {"metadata": kept_meta, "spec": {"nodeName": node} if node else {},
            "status": kept_status}


def object_key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))


def _version(obj: Obj) -> int:
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else 0


class Informer:
    """The newest object of each key of one kind, kept by list + watch on a thread."""

    def __init__(self, kube: Kube, kind: Kind, changed: Callable[[], None]):
        self.kube = kube
        self.kind = kind
        self.changed = changed
        self.items: dict[str, Obj] = {}
        self.version = 0  # the newest resourceVersion this store reflects
        self.synced = False
        self.relists = 0
        self.arrived = 0  # objects first seen by a watch event (a list counts none; only
        # for kinds that keep arrivals)
        self.arrivals: deque[Obj] = deque(maxlen=ARRIVALS_KEPT)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._relist = threading.Event()
        self._response: Any = None  # the watch being read, so a relist can interrupt it
        self._thread = threading.Thread(target=self._run, name=f"watch-{kind.name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> list[Obj]:
        """The current objects (the dict's values are replaced, never changed in place)."""
        with self._cond:
            return list(self.items.values())

    def wait_for(self, version: int, timeout: float) -> bool:
        """True once the store reflects `version` (and has listed at all)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.synced and self.version >= version):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def relist(self) -> None:
        """Ask for a fresh list (a caller found the store behind); interrupts the watch."""
        self._relist.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()
            except Exception as err:  # already closed
                log.debug("interrupting the %s watch: %s", self.kind.name, err)

    def _query(self) -> dict[str, Any]:
        return {"labelSelector": self.kind.selector} if self.kind.selector else {}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list()
                while not self._stop.is_set() and not self._relist.is_set():
                    if not self._watch():
                        break  # expired or broken beyond resuming: list again
            except Exception as err:  # API down, RBAC, bad answer: list again shortly
                log.warning("watch of %s: %s; listing again", self.kind.name, err)
                self._stop.wait(1.0)

    def _list(self) -> None:
        self._relist.clear()
        items, version = self.kube.list_all(self.kind.path, self._query())
        pod = self.kind.name == PODS
        fresh = {object_key(obj): trimmed(obj, pod) for obj in items}
        with self._cond:
            self.items = fresh
            self.version = max(self.version, int(version) if version.isdigit() else 0)
            self.synced = True
            self.relists += 1
            self._cond.notify_all()
        self.changed()

    def _watch(self) -> bool:
        """Follow one watch request; False when a fresh list is needed."""
        query = {**self._query(), "watch": "1", "allowWatchBookmarks": "true",
                 "resourceVersion": str(self.version), "timeoutSeconds": WATCH_SECONDS}
        try:
            response = self.kube.rest.stream(self.kind.path, query, WATCH_SECONDS + 30)
        except ApiException as err:
            if err.status == 410:
                return False
            raise
        self._response = response
        try:
            buffer = b""
            for chunk in response.stream(65536):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip() and not self._apply(json.loads(line)):
                        return False
                if self._stop.is_set() or self._relist.is_set():
                    return False
        finally:
            self._response = None
            response.release_conn()
        return True  # the server ended the watch: resume from the last version

    def _apply(self, event: Mapping[str, Any]) -> bool:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # 410 Gone (compacted) and others: only a list recovers
            log.info("watch of %s ended: %s", self.kind.name, obj.get("message"))
            return False
        version = _version(obj)
        with self._cond:
            if kind in ("ADDED", "MODIFIED"):
                key, kept = object_key(obj), trimmed(obj, self.kind.name == PODS)
                if self.kind.arrivals and kind == "ADDED" and key not in self.items:
                    self.arrived += 1
                    self.arrivals.append(kept)
                self.items[key] = kept
            elif kind == "DELETED":
                self.items.pop(object_key(obj), None)
            self.version = max(self.version, version)
            self._cond.notify_all()
        if kind != "BOOKMARK":
            self.changed()
        return True


class Informers:
    """The operator's watch caches, and the read-your-writes fence over them."""

    def __init__(self, kube: Kube, changed: Callable[[], None] = lambda: None):
        self.kube = kube
        self.by_kind = {kind.name: Informer(kube, kind, changed) for kind in KINDS}

    def start(self) -> None:
        for informer in self.by_kind.values():
            informer.start()

    def stop(self) -> None:
        for informer in self.by_kind.values():
            informer.stop()

    def objects(self, kind: str) -> list[Obj]:
        return self.by_kind[kind].snapshot()

    def get(self, kind: str, key: str) -> Obj | None:
        """The newest object of `key` (`namespace/name`, or `name`) the watch has shown."""
        return self.by_kind[kind].items.get(key)

    def arrived(self, kind: str) -> int:
        """How many objects of `kind` the watch has shown for the first time so far."""
        return self.by_kind[kind].arrived

    def arrived_since(self, kind: str, count: int) -> list[Obj] | None:
        """The objects of `kind` first shown after `arrived(kind)` returned `count`; None
        if more arrived than the store remembers."""
        informer = self.by_kind[kind]
        with informer._cond:
            new = informer.arrived - count
            if new > len(informer.arrivals):
                return None
            return list(informer.arrivals)[len(informer.arrivals) - new:] if new > 0 else []

    def caught_up(self, timeout: float) -> bool:
        """Wait until every store has listed and seen this operator's latest write of its
        kind; a store still behind after `timeout` is told to list again (False)."""
        with self.kube._lock:
            written = dict(self.kube.written)
        deadline = time.monotonic() + timeout
        ok = True
        for name, informer in self.by_kind.items():
            left = max(0.0, deadline - time.monotonic())
            if not informer.wait_for(written.get(name, 0), left):
                log.warning("the %s cache has not caught up with our writes (at %d, wrote %d);"
                            " listing again", name, informer.version, written.get(name, 0))
                informer.relist()
                ok = False
        return ok
