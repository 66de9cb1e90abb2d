"""Watch caches: one list+watch per kind (`carpool.kube.watching.Store`), feeding the local
view the reconcile pass reads.

Each kind has a thread that lists once, then follows a watch and keeps the newest object per
key (of a pod, only what the pass reads: see `trimmed`). The pass re-derives everything from
this complete view each time (level-triggered), so a missed event or a restart changes
nothing; the watch only keeps the view current without reading thousands of unchanged
objects again. Why these are not kopf's watches: docs/architecture.md.

Read-your-writes: a pass must see what the previous pass wrote (a pod it created, a status
it patched), or it would decide on a stale view (e.g. take a created pod for a lost one).
`Kube` records the resourceVersion of every write per kind; `Informers.caught_up` waits
until each store has seen at least that version, and tells a store still behind to list
again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from carpool.core import names
from carpool.core.ownership import GPUJOB_KIND
from carpool.kube.resources import GPUJOBS as GPUJOB_RESOURCE
from carpool.kube.resources import GPUNODES, NODES, PROJECTQUOTAS, Resource
from carpool.kube.resources import PODS as POD_RESOURCE
from carpool.kube.retry import Backoff
from carpool.kube.watching import Store
from carpool.operator.kube import GPUJOBS, PODS, QUOTAS, Kube, Obj
from carpool.operator.pod_view import DISRUPTION_TARGET

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kind:
    name: str
    resource: Resource
    selector: str = ""
    fields: str = ""  # a field selector
    arrivals: bool = False  # keep the newest first-seen objects (`Informers.arrived_since`)


KINDS = (
    Kind(GPUJOBS, GPUJOB_RESOURCE, arrivals=True),
    # every pod Carpool's scheduler places, whatever its labels say: the scheduler name is
    # immutable, and only a pod placed by it can be assigned a Carpool GPU (the device plugin
    # serves no other), so a pod whose labels a tenant changed or removed stays in view
    Kind(PODS, POD_RESOURCE, fields=f"spec.schedulerName={names.SCHEDULER_NAME}"),
    Kind(QUOTAS, PROJECTQUOTAS),
    Kind(names.GPUNODE_PLURAL, GPUNODES),
    Kind("nodes", NODES),
)


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


# What a pass reads of a pod (`pod_view.view_pod` and the job it belongs to): a store of
# thousands of pods keeps only these, not their conditions (but DisruptionTarget, and
# PodScheduled while it says Unschedulable), IPs,
# images and labels; of its owner references only GpuJobs', of its containers only their
# carpool.dev/* limits (what it holds).
POD_METADATA = ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp",
                "deletionGracePeriodSeconds", "finalizers")
POD_ANNOTATIONS = (names.ANN_ASSIGNMENT,)
POD_STATUS = ("phase", "reason", "startTime")
OWNER_FIELDS = ("apiVersion", "kind", "name", "uid", "controller")


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
    owners = [{k: r[k] for k in OWNER_FIELDS if k in r}
              for r in meta.get("ownerReferences") or () if isinstance(r, dict)
              and r.get("kind") == GPUJOB_KIND]
    if owners:
        kept_meta["ownerReferences"] = owners
    kept_status = {k: status[k] for k in POD_STATUS if k in status}
    if containers := status.get("containerStatuses"):
        kept_status["containerStatuses"] = [{"state": c.get("state") or {}} for c in containers]
    if read := [c for c in status.get("conditions") or [] if isinstance(c, dict) and (
            c.get("type") == DISRUPTION_TARGET or (
                c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"))]:
        kept_status["conditions"] = read
    spec: Obj = {"nodeName": node} if node else {}
    if limits := _carpool_limits(obj.get("spec") or {}):
        spec["containers"] = limits
    return {"metadata": kept_meta, "spec": spec, "status": kept_status}


def _carpool_limits(spec: Obj) -> list[Obj]:
    """The containers that ask for Carpool resources, with only those limits."""
    out = []
    for container in spec.get("containers") or ():
        limits = ((container.get("resources") or {}).get("limits") or {}) \
            if isinstance(container, dict) else {}
        ours = {k: v for k, v in limits.items() if str(k).startswith(f"{names.GROUP}/")}
        if ours:
            out.append({"name": container.get("name"), "resources": {"limits": ours}})
    return out


def _trim_pod(obj: Obj) -> Obj:
    return trimmed(obj, pod=True)


class Informers:
    """The operator's watch caches, and the read-your-writes fence over them."""

    def __init__(self, kube: Kube, changed: Callable[[], None] = lambda: None):
        self.kube = kube
        self.by_kind = {
            kind.name: Store(kube.api, kind.resource, label_selector=kind.selector,
                             field_selector=kind.fields,
                             keep=_trim_pod if kind.name == PODS else trimmed,
                             changed=changed, arrivals=kind.arrivals, name=kind.name,
                             backoff=Backoff(first=0.2, most=1.0))
            for kind in KINDS}

    def start(self) -> None:
        for store in self.by_kind.values():
            store.start()

    def stop(self) -> None:
        for store in self.by_kind.values():
            store.stop()

    def objects(self, kind: str) -> list[Obj]:
        return self.by_kind[kind].snapshot()

    def gone_at(self, kind: str, uid: str) -> tuple[float, Obj] | None:
        """When the watch of `kind` showed the object of `uid` deleted, with its last state."""
        return self.by_kind[kind].gone_at(uid) if uid else None

    def gone(self, kind: str) -> list[tuple[float, Obj]]:
        """The objects of `kind` the watch remembers as deleted (the newest few thousand),
        each with when it went and its last state."""
        return self.by_kind[kind].gone()

    def get(self, kind: str, key: str) -> Obj | None:
        """The newest object of `key` (`namespace/name`, or `name`) the watch has shown."""
        return self.by_kind[kind].get(key)

    def arrived(self, kind: str) -> int:
        """How many objects of `kind` the watch has shown for the first time so far."""
        return self.by_kind[kind].arrived

    def arrived_since(self, kind: str, count: int) -> list[Obj] | None:
        """The objects of `kind` first shown after `arrived(kind)` returned `count`; None
        if more arrived than the store remembers."""
        return self.by_kind[kind].arrived_since(count)

    def caught_up(self, timeout: float) -> bool:
        """Wait until every store has listed and seen this operator's latest write of its
        kind; a store that has listed but is still behind after `timeout` is told to list
        again (False)."""
        written = self.kube.written_versions()
        deadline = time.monotonic() + timeout
        ok = True
        for name, store in self.by_kind.items():
            left = max(0.0, deadline - time.monotonic())
            if not store.wait_for(written.get(name, 0), left):
                if store.synced:  # listed, yet behind what we wrote: list again
                    log.warning("the %s cache has not caught up with our writes (at %d, wrote "
                                "%d); listing again", name, store.version, written.get(name, 0))
                    store.relist()
                else:  # its first list is still coming (thousands of objects): asking for
                    # another would only start a second one once this one ends
                    log.info("the %s cache is still listing", name)
                ok = False
        return ok
