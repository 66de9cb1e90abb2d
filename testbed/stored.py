"""Admissions as the API server stores them, for the benches that compare admission rates.

A bench's own watch of tens of thousands of objects falls behind on a loaded machine, and
then both the admission times it stamps and a "nothing new for S seconds" stop rule follow
the watch, not the controller. So:

- a round ends once a count of admissions as stored has stopped growing for a while
  (`IdleStop`): for Carpool the pods in the projects' namespaces (the operator creates an
  admitted job's pods, a waiting job has none; `count` asks the API server cheaply), for
  Kueue its admitted Workloads (its Jobs' pods come from kube-controller-manager, far behind
  the admissions with 50,000 Jobs);
- the admission times are read from the stored objects once the round is over, by a
  paginated LIST (`list_items`): Carpool's from its jobs' pods' creationTimestamp (the
  operator creates a job's pods and then writes Admitted, status.admitTime, from a status
  patch that may wait in the writer's queue), Kueue's from its
  Workloads' Admitted condition (lastTransitionTime, Kueue's clock when it admitted, before
  its rate-limited client writes it: if anything, early in Kueue's favour). Both are to the
  second.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from carpool.core.timestamps import epoch_seconds

PAGE = 500
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


class Expired(RuntimeError):
    """A paginated LIST's continue token outlived the API server's compaction (410)."""


def _get(api: Any, path: str, params: Mapping[str, str | int], metadata_only: bool
         ) -> dict[str, Any]:
    """One GET through the client's connection pool (the generated API classes cost ~10 ms
    of CPU a call and build objects for every item)."""
    url = f"{api.configuration.host}{path}?{urllib.parse.urlencode(params)}"
    accept = METADATA_ONLY if metadata_only else "application/json"
    response = api.rest_client.pool_manager.request("GET", url, headers={"Accept": accept},
                                                    retries=False)
    if response.status == 410:
        raise Expired(path)
    if response.status >= 300:
        raise RuntimeError(f"GET {path}: {response.status} {response.data[:300]!r}")
    return json.loads(response.data)  # type: ignore[no-any-return]


def list_items(api: Any, path: str, metadata_only: bool = False, page: int = PAGE,
               tries: int = 3) -> Iterator[dict[str, Any]]:
    """Every object at `path` (e.g. `/api/v1/pods`), `page` at a time; from the start again
    if the LIST outlives a compaction (a restart repeats no item: the caller gets only the
    last, complete pass)."""
    for attempt in range(tries):
        items: list[dict[str, Any]] = []
        token = ""
        try:
            while True:
                params: dict[str, str | int] = {"limit": page}
                if token:
                    params["continue"] = token
                body = _get(api, path, params, metadata_only)
                items.extend(body.get("items") or [])
                token = (body.get("metadata") or {}).get("continue") or ""
                if not token:
                    yield from items
                    return
        except Expired:
            if attempt == tries - 1:
                raise


def count(api: Any, path: str) -> int:
    """How many objects the API server stores at `path`: one item and the server's
    remainingItemCount (paging through metadata only where it gives none)."""
    body = _get(api, path, {"limit": 1}, metadata_only=True)
    remaining = (body.get("metadata") or {}).get("remainingItemCount")
    if remaining is not None or not (body.get("metadata") or {}).get("continue"):
        return len(body.get("items") or []) + int(remaining or 0)
    return sum(1 for _ in list_items(api, path, metadata_only=True, page=5000))


def pods_in(api: Any, namespaces: Iterable[str]) -> int:
    """The pods stored in these namespaces (the stop rule's count for Carpool's jobs)."""
    return sum(count(api, f"/api/v1/namespaces/{ns}/pods") for ns in namespaces)


def pods_created(pods: Iterable[Mapping[str, Any]], job_label: str) -> dict[str, float]:
    """Per job (`<namespace>/<job>`, from the pod's `job_label`), when its last pod was
    created: a gang is admitted once all its workers' pods exist."""
    out: dict[str, float] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(job_label)
        created = epoch_seconds(meta.get("creationTimestamp"))
        if job is None or created is None:
            continue
        key = f"{meta.get('namespace')}/{job}"
        out[key] = max(created, out.get(key, created))
    return out


def workloads_admitted(workloads: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per Kueue Workload's Job (`<namespace>/<job>`, its owner), when its Admitted
    condition turned True; Workloads not admitted are left out."""
    out: dict[str, float] = {}
    for workload in workloads:
        meta = workload.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        for condition in (workload.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Admitted" and condition.get("status") == "True":
                at = epoch_seconds(condition.get("lastTransitionTime"))
                if at is not None and owners:
                    out[f"{meta.get('namespace')}/{owners[0].get('name')}"] = at
    return out


def admitted_by(times: Mapping[str, float], end: float, keys: Iterable[str] | None = None
                ) -> dict[str, float]:
    """The admissions stamped at or before the round's end (`end`, epoch seconds; the
    controller may still admit while the LIST runs), of these jobs only if `keys` is given
    (an earlier round's namespaces may still be terminating)."""
    wanted = None if keys is None else set(keys)
    return {k: t for k, t in times.items() if t <= end and (wanted is None or k in wanted)}


def default_idle_stop(jobs: int) -> float:
    """Seconds without a new admission that end a round: 20, longer with a long queue (one of the
    controller's passes over 50,000 jobs reads and decides for a minute before it admits)."""
    return max(20.0, jobs / 500)


class IdleStop:
    """Ends a round once the count of admissions (or of admitted jobs' pods) reaches
    `target`, or once it is above 0 and has not grown for `idle_s` seconds (before the
    first, the controller is still starting)."""

    def __init__(self, target: int, idle_s: float, now: float) -> None:
        self.target, self.idle_s = target, idle_s
        self.last, self.since = -1, now

    def done(self, count: int, now: float) -> bool:
        if count != self.last:
            self.last, self.since = count, now
        return count >= self.target or (count > 0 and now - self.since > self.idle_s)
