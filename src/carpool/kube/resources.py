"""The API paths Carpool uses, built in one place: `GPUJOBS.path("ns", "name", "status")`."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from carpool.core import names


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str = "", subresource: str = "") -> str:
        """The collection (all namespaces when `namespace` is None), one object, or one of
        its subresources."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name, safe='')}"
            if subresource:
                base += f"/{subresource}"
        return base


PODS = Resource("", "v1", "pods", True)
PERSISTENTVOLUMECLAIMS = Resource("", "v1", "persistentvolumeclaims", True)
SERVICES = Resource("", "v1", "services", True)
NODES = Resource("", "v1", "nodes", False)
NAMESPACES = Resource("", "v1", "namespaces", False)
CORE_EVENTS = Resource("", "v1", "events", True)
EVENTS = Resource("events.k8s.io", "v1", "events", True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", True)
PRIORITY_CLASSES = Resource("scheduling.k8s.io", "v1", "priorityclasses", False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", False)
GPUJOBS = Resource(names.GROUP, names.VERSION, names.GPUJOB_PLURAL, True)
PROJECTQUOTAS = Resource(names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, False)
GPUNODES = Resource(names.GROUP, names.VERSION, names.GPUNODE_PLURAL, False)
