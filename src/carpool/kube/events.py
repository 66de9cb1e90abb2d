"""Kubernetes Events as every Carpool component posts them: events.k8s.io/v1, built here only.

`kubectl describe` and `kubectl get events` show them as any Event (the core/v1 view of the same
objects names `regarding` as `involvedObject`).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from carpool.core import names
from carpool.kube.resources import EVENTS

NOTE_LIMIT = 1024  # the API server's limit on an Event's note


def reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What an Event names of the object it is about."""
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")}


def event_body(regarding: Mapping[str, Any], reason: str, note: str, type_: str, action: str,
               component: str, instance: str, now: dt.datetime) -> dict[str, Any]:
    """An Event about `regarding` (a `reference`), from Carpool's `component`."""
    namespace = str(regarding.get("namespace") or "default")
    name = str(regarding.get("name") or "carpool")
    return {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": f"{name[:200]}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": f"{names.GROUP}/{component}",
        "reportingInstance": instance,
        "action": action,
        "reason": reason,
        "note": note[:NOTE_LIMIT],
        "type": type_,
        "regarding": dict(regarding),
    }


def events_path(namespace: str) -> str:
    return EVENTS.path(namespace)
