"""Tenant chaos: two projects' GpuJobs under load while a tenant of one of them keeps attacking.

The tenant is a ServiceAccount with the built-in `edit` role in its own project's namespace
(`carpool_testbed.tenants`); every request it makes goes through the real API server with
impersonation (`Impersonate-User`, as `kubectl --as` does), under the chart's admission
policies, to the real operator, the strict extender and kube-scheduler, on simulated (KWOK)
GPU nodes. For the whole run it picks attacks at random from `ATTACKS`: it relabels,
re-annotates and re-owns its own pods (Carpool's `carpool.dev/*` keys and the GpuJob owner
references: added, changed to the other project's jobs or its own other jobs, removed), creates
CPU-only pods named like other jobs' attempts (`<job>-<attempt>`) with look-alike labels,
annotations and owner references, deletes and recreates its pods and GpuJobs, writes template
fields a workload does not need, and knocks on the other GPU doors. Every answer is counted by
attack and by reason (`refusal_reason`).

Meanwhile `Checker` keeps a watch-fed copy of every pod and GpuJob of both namespaces and
checks, every second and at the end, from what only Carpool writes (a pod belongs to a job
through a controller owner reference with the job's UID; its project is its namespace's; its
isolation is its job's spec, never the pod's annotation):

- the other project's jobs change only as their own run explains (`unexplained_change`):
  Queued, Admitted, Running, Succeeded, one attempt, one usage record as long as the run;
- no pod holds a GPU (asks for `carpool.dev/*` or carries an assignment, not terminal) more
  than `orphan_grace_s` after it stopped being the current attempt of a live GpuJob;
- no GPU is over-committed and no project holds more than its concurrent quota (borrowing is
  off, so the quota is a ceiling), and no grant is larger than its job asked for;
- at the end, the GPU-hours each project is billed (ProjectQuota `status.usedGpuHours`, which
  counts deleted jobs too) equal the GPU-hours its pods held, integrated from the pod
  lifetimes the watch saw with carpool.core.gpuhours' one definition.

`run` does all of it on a cluster and returns a `Report`; e2e/test_tenant_chaos.py (10
minutes), tests/integration/test_tenant_chaos.py (about a minute) and
`carpool-testbed tenant-chaos --minutes N` call it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml

from carpool.core import names
from carpool.core.assignment import Assignment, AssignmentError, parse_assignment
from carpool.core.finalizing import deletion_final
from carpool.core.gpuhours import gpu_fraction, gpu_hours
from carpool.core.quantities import quantity_mib
from carpool.core.resources import Isolation
from carpool.core.timestamps import epoch_of
from carpool.kube.client import Api
from carpool.kube.errors import ApiError
from carpool_testbed import chaos, crds, devcluster, simnodes, stack, tenants

Obj = dict[str, Any]
TERMINAL = frozenset({"Succeeded", "Failed"})
CHART = devcluster.repo_root() / "helm" / "carpool"
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
GPUJOBS_PATH = f"/apis/{names.API_VERSION}/namespaces/{{ns}}/gpujobs"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
# The victim's jobs move only forward through these phases (no preemption: it never borrows
# and its jobs are not preemptible; no faults: nothing else stops their pods).
VICTIM_PHASES = ("", "Queued", "Admitted", "Running", "Succeeded")
# What the platform team allows every job of both projects (ProjectQuota spec.classLimits)
CLASS_LIMITS: Obj = {"maxGpus": 4, "maxDuration": "4h", "minGpuMemory": "1Gi"}
UNEXPLAINED = "the other project's jobs: changes their run does not explain"
ORPHANED = "GPU held 30 s after not being a live job's current attempt"
UNASSIGNED = "GPU pod running without the extender's assignment"


@dataclass(frozen=True)
class Settings:
    duration_s: float = 600.0  # how long the tenant attacks
    nodes: int = 4
    gpus_per_node: int = 4
    gpu_memory_gib: int = 80
    victim_live: int = 10  # the other project's jobs kept unfinished at once
    tenant_live: int = 6  # the tenant's own jobs kept unfinished at once
    victim_gpus: int = 8  # concurrent quotas (borrowing off: a ceiling)
    tenant_gpus: int = 6
    run_s: tuple[int, int] = (20, 60)  # simulated run time of a job, uniform
    attack_pause_s: float = 0.25  # between two attacks
    orphan_grace_s: float = 30.0
    progress_s: float = 15.0
    settle_s: float = 180.0  # at the end: how long to wait for every GPU pod to finish
    seed: int = 20261203
    # chart policies left out (hack/policies names, e.g. carpool-pod-metadata), to try the
    # components behind them: what they must ignore when admission lets it through
    without_policies: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# What only Carpool writes: ownership, holding, grants (pure)


def controller_uid(pod: Mapping[str, Any]) -> str:
    """The UID of the GpuJob a pod's controller owner reference names ("" when none)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "GpuJob" \
                and str(ref.get("apiVersion", "")).startswith(f"{names.GROUP}/"):
            return str(ref.get("uid") or "")
    return ""


def owning_job(pod: Mapping[str, Any], jobs_by_uid: Mapping[str, Obj]) -> Obj | None:
    """The GpuJob that controls the pod: named by UID in a controller owner reference and in
    the pod's own namespace (labels and annotations are never proof)."""
    job = jobs_by_uid.get(controller_uid(pod))
    if job is None:
        return None
    same_ns = job["metadata"].get("namespace") == (pod.get("metadata") or {}).get("namespace")
    return job if same_ns else None


def attempt_pod_name(job_name: str, attempt: int) -> str:
    """The operator's pod name for an attempt (operator/pods.py `pod_name`, which the test bed
    cannot import: the components are not its library)."""
    import hashlib

    suffix = f"-{attempt}"
    if len(job_name) + len(suffix) <= 63:
        return job_name + suffix
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    return f"{job_name[: 63 - len(suffix) - 9]}-{digest}{suffix}"


def is_current_attempt(pod: Mapping[str, Any], job: Mapping[str, Any] | None) -> bool:
    """Whether the pod is the current attempt of a live GpuJob: the job is not being deleted
    and not finished, and the pod carries its current attempt's name."""
    if job is None:
        return False
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return False
    attempts = int(status.get("attempts") or 0)
    pod_meta = pod.get("metadata") or {}
    name = pod_meta.get("name")
    # the operator creates attempt n+1's pod just before it writes attempts = n+1 (and the
    # pod's uid, `podUID`, once it has one: then only that pod is the attempt)
    if name == attempt_pod_name(str(meta.get("name")), attempts + 1):
        return True
    if status.get("podUID"):
        return bool(pod_meta.get("uid") == status["podUID"])
    return bool(name == attempt_pod_name(str(meta.get("name")), attempts))


def asks_for_gpus(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            if any(str(k).startswith(f"{names.GROUP}/") for k in resources.get(kind) or {}):
                return True
    return False


def assignment_of(pod: Mapping[str, Any]) -> Assignment | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANN_ASSIGNMENT)
    if not raw:
        return None
    try:
        return parse_assignment(str(raw))
    except AssignmentError:
        return None


def holds_gpu(pod: Mapping[str, Any]) -> bool:
    """Asks for Carpool's GPU resources or carries an assignment, and has not terminated."""
    if (pod.get("status") or {}).get("phase") in TERMINAL:
        return False
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return asks_for_gpus(pod) or bool(annotations.get(names.ANN_ASSIGNMENT))


def job_isolation(job: Mapping[str, Any] | None) -> str:
    return str((((job or {}).get("spec") or {}).get("gpu") or {}).get("isolation") or "mps")


def pod_holdings(pod: Mapping[str, Any], job: Mapping[str, Any] | None, project: str
                 ) -> list[chaos.Holding]:
    """What a pod holds by its extender assignment, exclusive as its job's spec says (a pod
    with no job: as its assignment says, shared); none once it terminated."""
    assignment = assignment_of(pod)
    if assignment is None or (pod.get("status") or {}).get("phase") in TERMINAL:
        return []
    meta = pod.get("metadata") or {}
    exclusive = job_isolation(job) == "exclusive"
    at = str((meta.get("annotations") or {}).get(names.ANN_ASSIGNED_AT) or "")
    return [chaos.Holding(f"{meta.get('namespace')}/{meta.get('name')}", project, g.uuid,
                          g.memory_mib, g.cores_pct, exclusive, at) for g in assignment.gpus]


def pod_fraction(assignment: Assignment, job: Mapping[str, Any] | None,
                 memory_totals: Mapping[str, int]) -> float:
    """GPUs held, by carpool.core.gpuhours, with the job's isolation (the operator's rule)."""
    isolation = job_isolation(job)
    exclusive = isolation == "exclusive"
    timeslice = Isolation.TIMESLICE if isolation == Isolation.TIMESLICE.value else None
    return sum(gpu_fraction(g, memory_totals.get(g.gpu_uuid, 0), 0, timeslice)
               for g in assignment.grants(exclusive))


def grant_beyond_request(pod: Mapping[str, Any], job: Mapping[str, Any] | None) -> str:
    """What a job's pod was granted beyond what the job asked for ("" when nothing): more GPUs,
    or, shared, more memory per GPU than asked (rounded up to whole GiB) or more cores."""
    assignment = assignment_of(pod)
    if assignment is None or job is None:
        return ""
    gpu = (job.get("spec") or {}).get("gpu") or {}
    key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
    if len(assignment.gpus) > int(gpu.get("count") or 1):
        return f"{key}: {len(assignment.gpus)} GPUs granted, {gpu.get('count')} asked"
    if job_isolation(job) == "exclusive":
        return ""
    asked_mib = math.ceil(quantity_mib(str(gpu.get("memory") or "0")) / 1024) * 1024
    for g in assignment.gpus:
        if asked_mib and g.memory_mib > asked_mib:
            return f"{key}: {g.memory_mib} MiB granted on {g.uuid}, {asked_mib} asked"
        if gpu.get("cores") and g.cores_pct > int(gpu["cores"]):
            return f"{key}: {g.cores_pct}% cores granted on {g.uuid}, {gpu['cores']} asked"
    return ""


def unexplained_change(before: Mapping[str, Any], after: Mapping[str, Any],
                       simulated_s: float) -> str:
    """Why a change of a victim job's status is not one its own run explains ("" if it is).

    Its run: Queued, Admitted, Running, Succeeded (phases may be skipped between two looks),
    one attempt, at most one usage record, and when it succeeds that record is closed as
    Succeeded and lasted its simulated run (a pod that ended it early was not its pod)."""
    old_phase, new_phase = str(before.get("phase") or ""), str(after.get("phase") or "")
    if new_phase not in VICTIM_PHASES:
        return f"phase {new_phase} ({after.get('reason')}: {after.get('message')})"
    if old_phase in VICTIM_PHASES \
            and VICTIM_PHASES.index(new_phase) < VICTIM_PHASES.index(old_phase):
        return f"phase {old_phase} -> {new_phase} ({after.get('reason')})"
    if int(after.get("attempts") or 0) > 1:
        return f"attempts {after.get('attempts')} ({after.get('reason')})"
    history = after.get("history") or []
    if len(history) > 1:
        return f"{len(history)} usage records"
    if after.get("reason") in ("PodLost", "Preempted", "Disrupted", "NodeRejected"):
        return f"reason {after.get('reason')}"
    if new_phase == "Succeeded" and old_phase != "Succeeded":
        record = history[0] if history else {}
        start, end = epoch_of(record.get("start")), epoch_of(record.get("end"))
        if record.get("outcome") != "Succeeded":
            return f"succeeded with usage record {record}"
        if start is None or end is None or end - start < simulated_s - 2:
            return (f"succeeded after {(end or 0) - (start or 0):.0f} s of its "
                    f"{simulated_s:.0f} s run")
    return ""


def refusal_reason(err: ApiError) -> str:
    """A short, stable name for why the API server refused a request: the admission policy
    that did (without the release's prefix), RBAC, or the status and its first words."""
    message = err.message or ""
    policy = re.search(r"ValidatingAdmissionPolicy '([^']+)'", message)
    if policy:
        name = re.sub(r"^tc-carpool-[0-9a-f]+-", "carpool-", policy.group(1))
        return f"{err.status} {name}"
    if err.status == 403 and "cannot" in message:
        return "403 RBAC"
    if err.status == 422:
        field_name = re.search(r"(spec\.[\w.\[\]]+|metadata\.[\w.\[\]]+)", message)
        return f"422 invalid {field_name.group(1) if field_name else ''}".rstrip()
    return f"{err.status} {err.reason}".strip()


# --------------------------------------------------------------------------------------------
# The watch-fed view of both namespaces, and the invariants


@dataclass
class PodRun:
    """One GPU-holding pod's run: its assignment, held from `start` to `end` (None: still),
    and the job that controlled it when it started (its isolation sets the fraction)."""

    project: str
    assignment: Assignment
    job_uid: str
    start: float
    end: float | None = None
    pod: str = ""  # namespace/name


@dataclass
class Checker:
    """Pods and GpuJobs of both namespaces from watches; the invariants every second."""

    api: Api
    namespaces: dict[str, str]  # namespace -> project
    victim_ns: str
    memory_totals: dict[str, int]  # GPU uuid -> MiB
    capacity: dict[str, chaos.GpuCapacity]
    quotas: dict[str, float]
    orphan_grace_s: float = 30.0
    pods: dict[str, Obj] = field(default_factory=dict)
    jobs: dict[str, Obj] = field(default_factory=dict)  # ns/name -> job
    jobs_by_uid: dict[str, Obj] = field(default_factory=dict)  # every job ever seen
    runs: dict[str, PodRun] = field(default_factory=dict)  # pod uid -> its run
    not_current_since: dict[str, float] = field(default_factory=dict)  # pod key -> when
    orphan_holds: dict[str, float] = field(default_factory=dict)  # pod key -> seconds held
    # seconds from a GPU pod's last being an attempt (as sampled) to its deletion
    orphans_stopped: list[float] = field(default_factory=list)
    job_gone_at: dict[str, float] = field(default_factory=dict)  # job uid -> when deleted
    guarded_uids: set[str] = field(default_factory=set)  # jobs whose pods had the finalizer
    victim_changes: list[str] = field(default_factory=list)
    victim_seen: set[str] = field(default_factory=set)
    victim_succeeded_pods: dict[str, str] = field(default_factory=dict)  # job -> pod seen done
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # invariant -> breaches
    samples: int = 0
    _reported: set[str] = field(default_factory=set)  # pods whose breach was counted
    _reported_grants: set[str] = field(default_factory=set)
    _victim_told: set[tuple[str, str]] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reflectors: list[Any] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        from carpool.kube.resources import GPUJOBS, PODS
        from carpool.kube.retry import Backoff
        from carpool.kube.watching import Reflector

        for namespace in self.namespaces:
            watched: list[tuple[Any, Callable[[str, list[Obj]], None],
                                Callable[[str, Obj], None]]] = [
                (PODS, self._pods_listed, self._pod_event),
                (GPUJOBS, self._jobs_listed, self._job_event)]
            for resource, listed, event in watched:
                reflector = Reflector(
                    self.api, resource, on_list=_listing(listed, namespace), on_event=event,
                    field_selector=f"metadata.namespace={namespace}",
                    watch_seconds=60, backoff=Backoff(first=1.0, most=1.0),
                    name=f"tenant-chaos-{resource.plural}-{namespace}")
                reflector.start()
                self._reflectors.append(reflector)
        thread = threading.Thread(target=self._sample_loop, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for reflector in self._reflectors:
            reflector.stop()
        for thread in self._threads:
            thread.join(15)

    # -- the view --------------------------------------------------------------------------

    def _pods_listed(self, namespace: str, items: list[Obj]) -> None:
        with self._lock:
            keys = {f"{namespace}/{p['metadata']['name']}" for p in items}
            for key in [k for k in self.pods if k.startswith(f"{namespace}/") and k not in keys]:
                self._pod_gone(self.pods.pop(key))
            for pod in items:
                self._pod_seen(pod)

    def _pod_event(self, kind: str, pod: Obj) -> None:
        with self._lock:
            self._pod_seen(pod)
            if kind == "DELETED":
                key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                if key in self.not_current_since:
                    self.orphans_stopped.append(time.time() - self.not_current_since[key])
                self.pods.pop(key, None)
                self._pod_gone(pod)

    def _pod_seen(self, pod: Obj) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        self.pods[key] = pod
        uid = str(meta.get("uid"))
        assignment = assignment_of(pod)
        status = pod.get("status") or {}
        if assignment is not None and status.get("phase") not in (None, "Pending"):
            run = self.runs.get(uid)
            if run is None:
                start = _started(pod)
                if start is not None:
                    run = self.runs[uid] = PodRun(self.namespaces.get(meta["namespace"], ""),
                                                  assignment, controller_uid(pod), start,
                                                  pod=key)
            if run is not None and run.end is None and status.get("phase") in TERMINAL:
                run.end = _finished(pod) or time.time()
            elif run is not None and run.end is None and deletion_final(meta):
                # only Carpool's finalizer holds it: its containers are done
                run.end = _finished(pod) or epoch_of(meta.get("deletionTimestamp")) \
                    or time.time()
        if names.FINALIZER in (meta.get("finalizers") or ()):
            self.guarded_uids.add(controller_uid(pod))
        if meta["namespace"] == self.victim_ns and status.get("phase") == "Succeeded":
            job = owning_job(pod, self.jobs_by_uid)
            if job is not None:
                self.victim_succeeded_pods[job["metadata"]["name"]] = meta["name"]

    def _pod_gone(self, pod: Obj) -> None:
        run = self.runs.get(str(pod["metadata"].get("uid")))
        if run is not None and run.end is None:
            run.end = _finished(pod) or time.time()

    def _jobs_listed(self, namespace: str, items: list[Obj]) -> None:
        with self._lock:
            keys = {f"{namespace}/{j['metadata']['name']}" for j in items}
            for key in [k for k in self.jobs if k.startswith(f"{namespace}/") and k not in keys]:
                self._job_gone(self.jobs.pop(key))
            for job in items:
                self._job_seen(job)

    def _job_event(self, kind: str, job: Obj) -> None:
        with self._lock:
            if kind == "DELETED":
                self.jobs.pop(f"{job['metadata']['namespace']}/{job['metadata']['name']}", None)
                self._job_gone(job)
            else:
                self._job_seen(job)

    def _job_seen(self, job: Obj) -> None:
        meta = job["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        before = self.jobs.get(key)
        self.jobs[key] = job
        self.jobs_by_uid[str(meta.get("uid"))] = job
        if meta["namespace"] != self.victim_ns:
            return
        self.victim_seen.add(key)
        simulated = epoch_seconds_of_duration((job.get("spec") or {}).get("simulatedDuration"))
        problem = unexplained_change((before or {}).get("status") or {},
                                     job.get("status") or {}, simulated)
        # each kind of change counted once per job (a job's later statuses repeat it)
        if problem and (key, problem.split()[0]) not in self._victim_told:
            self._victim_told.add((key, problem.split()[0]))
            self.breach(UNEXPLAINED, f"{key}: {problem}")

    def _job_gone(self, job: Obj) -> None:
        self.job_gone_at.setdefault(str(job["metadata"].get("uid")), time.time())
        if job["metadata"]["namespace"] == self.victim_ns and not self._stop.is_set():
            self.breach(UNEXPLAINED,
                         f"{job['metadata']['name']}: deleted")

    def breach(self, invariant: str, detail: str) -> None:
        self.counts[invariant] = self.counts.get(invariant, 0) + 1
        stamp = datetime.now(UTC).strftime("%H:%M:%S")
        self.violations.append(f"{stamp} {invariant}: {detail}")

    # -- every second ----------------------------------------------------------------------

    def _sample_loop(self) -> None:
        previous: set[str] = set()
        while not self._stop.wait(1.0):
            with self._lock:
                now_breached = self._sample(time.time())
            # a capacity breach seen twice in a row is real, not a watch event still in flight
            for invariant, detail in now_breached:
                if chaos.breach_key(detail) in previous:
                    with self._lock:
                        self.breach(invariant, detail)
            previous = {chaos.breach_key(d) for _, d in now_breached}
            self.samples += 1

    def _sample(self, now: float) -> list[tuple[str, str]]:
        held: list[chaos.Holding] = []
        for key, pod in self.pods.items():
            namespace = pod["metadata"]["namespace"]
            job = owning_job(pod, self.jobs_by_uid)
            held += pod_holdings(pod, job, self.namespaces.get(namespace, ""))
            if holds_gpu(pod) and not is_current_attempt(pod, job):
                since = self.not_current_since.setdefault(key, now)
                self.orphan_holds[key] = now - since
                if now - since > self.orphan_grace_s and key not in self._reported:
                    self._reported.add(key)
                    self.breach(ORPHANED,
                                 f"{key} ({_why_not_current(pod, job)}) holds "
                                 f"{now - since:.0f} s")
            else:
                self.not_current_since.pop(key, None)
            if asks_for_gpus(pod) and assignment_of(pod) is None \
                    and (pod.get("status") or {}).get("phase") == "Running" \
                    and key not in self._reported_grants:
                self._reported_grants.add(key)
                why = "its job's current attempt" if is_current_attempt(pod, job) \
                    else _why_not_current(pod, job)
                self.breach(UNASSIGNED, f"{key} on {pod['spec'].get('nodeName')} ({why})")
            # (a pod re-owned to another job is that job's stray, judged above, not its grant)
            if is_current_attempt(pod, job) and (beyond := grant_beyond_request(pod, job)) \
                    and key not in self._reported_grants:
                self._reported_grants.add(key)
                self.breach("grant beyond the job's request", beyond)
        for key in [k for k in self.not_current_since if k not in self.pods]:
            self.not_current_since.pop(key)
        return ([("GPU over-committed", p) for p in chaos.overcommitted_gpus(held, self.capacity)]
                + [("project over its concurrent quota", p)
                   for p in chaos.projects_over_quota(held, self.capacity, self.quotas)])

    # -- summaries -------------------------------------------------------------------------

    def held_gpu_hours(self, now: float) -> dict[str, float]:
        """GPU-hours each project's pods held, open runs counted up to `now`."""
        with self._lock:
            out = dict.fromkeys(self.namespaces.values(), 0.0)
            for run in self.runs.values():
                end = run.end if run.end is not None else now
                fraction = pod_fraction(run.assignment, self.jobs_by_uid.get(run.job_uid),
                                        self.memory_totals)
                out[run.project] = out.get(run.project, 0.0) + gpu_hours(fraction, run.start,
                                                                          end)
        return out

    def billing_differences(self, now: float, most: int = 8) -> list[str]:
        """The pods whose held GPU-seconds differ most from their attempt's usage record in
        the last status seen of their job (a record a deleted job left open counts until its
        pod ended), to say where a gap between billed and held comes from."""
        from carpool.core.checkpointing import attempt_of_pod

        rows: list[tuple[float, str]] = []
        totals: dict[str, float] = {}
        with self._lock:
            for run in self.runs.values():
                job = self.jobs_by_uid.get(run.job_uid)
                fraction = pod_fraction(run.assignment, job, self.memory_totals)
                held = fraction * ((run.end if run.end is not None else now) - run.start)
                attempt = attempt_of_pod(run.pod.rsplit("/", 1)[-1])
                records = [r for r in ((job or {}).get("status") or {}).get("history") or []
                           if r.get("attempt") == attempt]
                billed = 0.0
                # a deleted job's last record stays open in what the watch saw (the operator
                # closes it as it bills the job, without writing it): its pod's end closes it
                open_until = run.end if run.end is not None else self.job_gone_at.get(
                    run.job_uid, now)
                for r in records:
                    start, end = epoch_of(r.get("start")), epoch_of(r.get("end")) or open_until
                    billed += float(r.get("fraction") or 0.0) * (end - (start or end))
                gone = (" (no job)" if job is None else " (job deleted)"
                        if run.job_uid in self.job_gone_at else "")
                if job is not None and run.job_uid in self.job_gone_at \
                        and run.job_uid not in self.guarded_uids:
                    gone += " (its pods never seen with the accounting finalizer)"
                if not records:
                    gone += " (no usage record)"
                kind = gone.strip() or "live job"
                totals[kind] = totals.get(kind, 0.0) + held - billed
                rows.append((held - billed, f"{run.pod}{gone}: held {held:.1f} GPU-s, "
                                            f"its record {billed:.1f}"))
        rows.sort(key=lambda r: -abs(r[0]))
        summary = "held minus recorded, GPU-s: " + ", ".join(
            f"{kind} {delta:+.1f}" for kind, delta in sorted(totals.items()))
        return [summary, *(text for delta, text in rows[:most] if abs(delta) >= 1.0)]

    def jobs_in(self, namespace: str) -> list[Obj]:
        with self._lock:
            return [j for k, j in self.jobs.items() if k.startswith(f"{namespace}/")]

    def pods_in(self, namespace: str) -> list[Obj]:
        with self._lock:
            return [p for k, p in self.pods.items() if k.startswith(f"{namespace}/")]

    def victim_pods_not_their_own(self, names_succeeded: Iterable[str]) -> list[str]:
        """Succeeded victim jobs whose succeeded pod was not their own first attempt's."""
        with self._lock:
            return [f"{job}: succeeded pod {self.victim_succeeded_pods.get(job)}"
                    for job in names_succeeded
                    if self.victim_succeeded_pods.get(job) != attempt_pod_name(job, 1)]

    def gpu_pods(self) -> list[str]:
        with self._lock:
            return sorted(k for k, p in self.pods.items() if holds_gpu(p))

    def phases(self, namespace: str) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for key, job in self.jobs.items():
                if key.startswith(f"{namespace}/"):
                    phase = str((job.get("status") or {}).get("phase") or "New")
                    out[phase] = out.get(phase, 0) + 1
            return dict(sorted(out.items()))


def _listing(listed: Callable[[str, list[Obj]], None], namespace: str
             ) -> Callable[[list[Obj], str], None]:
    """A Reflector's `on_list` for one namespace's items."""
    return lambda items, _version: listed(namespace, items)


def _started(pod: Mapping[str, Any]) -> float | None:
    status = pod.get("status") or {}
    start = epoch_of(status.get("startTime"))
    for container in status.get("containerStatuses") or []:
        for key in ("running", "terminated"):
            started = epoch_of(((container.get("state") or {}).get(key) or {}).get("startedAt"))
            if started:
                start = started
    return start


def _finished(pod: Mapping[str, Any]) -> float | None:
    ends = [epoch_of(((c.get("state") or {}).get("terminated") or {}).get("finishedAt"))
            for c in (pod.get("status") or {}).get("containerStatuses") or []]
    return max((e for e in ends if e), default=None)


def _why_not_current(pod: Mapping[str, Any], job: Mapping[str, Any] | None) -> str:
    if job is None:
        return "no GpuJob controls it" if not controller_uid(pod) else "its GpuJob is gone"
    status = job.get("status") or {}
    if job["metadata"].get("deletionTimestamp"):
        return "its GpuJob is being deleted"
    if status.get("phase") in TERMINAL:
        return f"its GpuJob {status.get('phase')}"
    return f"not attempt {status.get('attempts')} of its GpuJob"


def epoch_seconds_of_duration(text: object) -> float:
    from carpool.core.durations import parse_duration

    try:
        return float(parse_duration(str(text))) if text else 0.0
    except ValueError:
        return 0.0


# --------------------------------------------------------------------------------------------
# The tenant


class ImpersonatingApi(Api):
    """The admin's connection, every request sent as `user` (Impersonate-User): the API
    server authorizes and admits it as that user, exactly as `kubectl --as=user`."""

    def __init__(self, configuration: Any, user: str) -> None:
        super().__init__(configuration, pool_size=4, user_agent="carpool-tenant-chaos")
        self.user = user

    def headers(self, content_type: str | None = None) -> dict[str, str]:
        return {**super().headers(content_type), "Impersonate-User": self.user}


@dataclass
class Tally:
    """Answers per attack: accepted, or refused by reason (with one message each)."""

    tried: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)
    messages: dict[tuple[str, str], str] = field(default_factory=dict)
    # what became of the GpuJobs an attack got stored: "<phase> <reason>" -> count
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, attack: str, error: ApiError | None) -> None:
        with self._lock:
            self.tried[attack] = self.tried.get(attack, 0) + 1
            if error is None:
                self.accepted[attack] = self.accepted.get(attack, 0) + 1
                return
            reason = refusal_reason(error)
            by = self.refused.setdefault(attack, {})
            by[reason] = by.get(reason, 0) + 1
            self.messages.setdefault((attack, reason), error.message[:400])

    def totals(self) -> tuple[int, int, int]:
        with self._lock:
            tried = sum(self.tried.values())
            accepted = sum(self.accepted.values())
        return tried, accepted, tried - accepted


class Tenant:
    """The attacker: a user with `edit` in `own_ns` only, knowing the victim's job names and
    UIDs (the worst case: a tenant may learn them)."""

    def __init__(self, api: ImpersonatingApi, own_ns: str, own_project: str, victim_ns: str,
                 victim_project: str, checker: Checker, nodes: list[str], model: str,
                 rng: random.Random, tally: Tally) -> None:
        self.api = api
        self.ns = own_ns
        self.project = own_project
        self.victim_ns = victim_ns
        self.victim_project = victim_project
        self.checker = checker
        self.nodes = nodes
        self.model = model
        self.rng = rng
        self.tally = tally
        self.made: list[tuple[float, str]] = []  # (when, name) of the CPU pods it made
        self.jobs_made: dict[str, str] = {}  # GpuJobs an attack got stored -> the attack
        self.serial = 0

    # -- what it sees ----------------------------------------------------------------------

    def _jobs(self, namespace: str) -> list[Obj]:
        return self.checker.jobs_in(namespace)

    def _own_pods(self) -> list[Obj]:
        """Its pods that ask for GPUs (the operator's, for its own jobs)."""
        return [p for p in self.checker.pods_in(self.ns) if asks_for_gpus(p)]

    def _pick(self, items: list[Obj]) -> Obj | None:
        return self.rng.choice(items) if items else None

    # -- requests --------------------------------------------------------------------------

    def _call(self, attack: str, method: str, path: str, body: Any = None,
              content_type: str = "application/merge-patch+json",
              query: dict[str, str] | None = None) -> bool:
        try:
            if method == "POST":
                self.api.create(path, body)
            elif method == "PATCH":
                self.api.patch(path, body, content_type)
            else:
                self.api.request(method, path, query=query)
        except ApiError as err:
            self.tally.add(attack, err)
            return False
        self.tally.add(attack, None)
        return True

    def _patch_pod(self, attack: str, pod: Obj, metadata: Obj) -> None:
        """Merge-patch an own pod's metadata; a patch that would change nothing is not sent
        (the API server takes it whatever the policies say)."""
        meta = pod["metadata"]
        if all((meta.get(part) or {}).get(k) == v for part in ("labels", "annotations")
               for k, v in (metadata.get(part) or {}).items()) \
                and (metadata.get("ownerReferences", meta.get("ownerReferences")) or []) \
                == (meta.get("ownerReferences") or []) \
                and set(metadata) <= {"labels", "annotations", "ownerReferences"}:
            return
        self._call(attack, "PATCH", f"{PODS_PATH.format(ns=self.ns)}/{pod['metadata']['name']}",
                   {"metadata": metadata})

    def _cpu_pod(self, name: str, labels: Obj, annotations: Obj, owners: list[Obj],
                 **spec: Any) -> Obj:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": labels, "annotations": annotations,
                             **({"ownerReferences": owners} if owners else {})},
                "spec": {"containers": [{"name": "main", "image": "worker"}],
                         "nodeSelector": {"kubernetes.io/hostname": self.rng.choice(self.nodes)},
                         "terminationGracePeriodSeconds": 0, **spec}}

    def _create_cpu_pod(self, attack: str, pod: Obj) -> None:
        if self._call(attack, "POST", PODS_PATH.format(ns=self.ns), pod):
            self.made.append((time.time(), pod["metadata"]["name"]))

    def _name(self, stem: str) -> str:
        self.serial += 1
        return f"{stem}-{self.serial}"

    # -- attacks ---------------------------------------------------------------------------

    def relabel_own_pod(self) -> None:
        pod = self._pick(self._own_pods())
        victim = self._pick(self._jobs(self.victim_ns))
        if pod is None or victim is None:
            return
        other = self._pick(self._jobs(self.ns))
        choice = self.rng.choice([
            {names.LABEL_JOB: victim["metadata"]["name"]},
            {names.LABEL_PROJECT: self.victim_project},
            {names.LABEL_JOB: (other or victim)["metadata"]["name"]},
            {names.LABEL_MANAGED: None},
            {names.LABEL_JOB: None, names.LABEL_PROJECT: None},
        ])
        if self.rng.random() < 0.25:  # the status subresource takes metadata changes too
            self._call("change carpool.dev/* labels through an own pod's status", "PATCH",
                       f"{PODS_PATH.format(ns=self.ns)}/{pod['metadata']['name']}/status",
                       {"metadata": {"labels": choice}})
            return
        self._patch_pod("change or remove carpool.dev/* labels on an own pod", pod,
                        {"labels": choice})

    def reannotate_own_pod(self) -> None:
        pod = self._pick(self._own_pods())
        victim = self._pick(self._jobs(self.victim_ns))
        if pod is None or victim is None:
            return
        other = self._pick(self._jobs(self.ns)) or victim
        choice = self.rng.choice([
            {names.ANN_JOB: f"{self.victim_ns}/{victim['metadata']['name']}"},
            {names.ANN_JOB: f"{self.ns}/{other['metadata']['name']}"},
            {names.ANN_JOB: None},
            {names.ANN_MODELS: "H200,A100,any"},
            {names.ANN_POLICY: "spread"},
        ])
        self._patch_pod("change or remove carpool.dev/job and other annotations on an own pod",
                        pod, {"annotations": choice})

    def flip_isolation(self) -> None:
        pod = self._pick(self._own_pods())
        if pod is None:
            return
        current = ((pod["metadata"].get("annotations") or {}).get(names.ANN_ISOLATION) or "")
        wanted = self.rng.choice([v for v in ("exclusive", "mps", "timeslice", None)
                                  if v != current])
        self._patch_pod("change carpool.dev/isolation on an own pod", pod,
                        {"annotations": {names.ANN_ISOLATION: wanted}})

    def forge_assignment(self) -> None:
        pod = self._pick(self._own_pods())
        if pod is None:
            return
        node = pod["spec"].get("nodeName") or self.nodes[0]
        forged = json.dumps({"node": node, "gpus": [{"uuid": "GPU-forged", "index": 0,
                                                     "memoryMiB": 81920, "cores": 100}]})
        self._patch_pod("write carpool.dev/assignment on an own pod", pod,
                        {"annotations": {names.ANN_ASSIGNMENT: forged}})

    def reown_own_pod(self) -> None:
        pod = self._pick(self._own_pods())
        victim = self._pick(self._jobs(self.victim_ns))
        if pod is None or victim is None:
            return
        other = self._pick(self._jobs(self.ns)) or victim
        current = pod["metadata"].get("ownerReferences") or []

        def ref(job: Obj, controller: bool = True) -> Obj:
            return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
                    "name": job["metadata"]["name"], "uid": job["metadata"]["uid"],
                    "controller": controller, "blockOwnerDeletion": True}

        choice, attack = self.rng.choice([
            ([ref(victim)], "point an own pod's ownerReference at the other project's job"),
            ([ref(other)], "point an own pod's ownerReference at an own other job"),
            ([], "remove an own pod's ownerReferences"),
            ([*current, ref(other, controller=False)], "add a second ownerReference"),
        ])
        self._patch_pod(attack, pod, {"ownerReferences": choice})

    def lookalike_of_victim(self) -> None:
        victim = self._pick(self._jobs(self.victim_ns))
        if victim is None:
            return
        meta, status = victim["metadata"], victim.get("status") or {}
        attempt = max(1, int(status.get("attempts") or 0))
        labels = {names.LABEL_MANAGED: "true", names.LABEL_JOB: meta["name"],
                  names.LABEL_PROJECT: self.victim_project}
        annotations = {names.ANN_JOB: f"{self.victim_ns}/{meta['name']}",
                       names.ANN_ISOLATION: job_isolation(victim),
                       names.ANN_SIM_DURATION: "1"}
        owners = self.rng.choice([[], [{"apiVersion": names.API_VERSION, "kind": "GpuJob",
                                        "name": meta["name"], "uid": meta["uid"],
                                        "controller": True}]])
        self._create_cpu_pod("create a CPU pod named and labelled like the other project's "
                             "attempt", self._cpu_pod(attempt_pod_name(meta["name"], attempt),
                                                      labels, annotations, owners))

    def lookalike_of_own(self) -> None:
        job = self._pick(self._jobs(self.ns))
        if job is None:
            return
        meta, status = job["metadata"], job.get("status") or {}
        attempt = int(status.get("attempts") or 0) + self.rng.choice([0, 1, 1])
        labels = {names.LABEL_MANAGED: "true", names.LABEL_JOB: meta["name"],
                  names.LABEL_PROJECT: self.project}
        annotations = {names.ANN_JOB: f"{self.ns}/{meta['name']}",
                       names.ANN_ISOLATION: job_isolation(job),
                       names.ANN_SIM_DURATION: str(self.rng.choice([1, 300]))}
        owners = [{"apiVersion": names.API_VERSION, "kind": "GpuJob", "name": meta["name"],
                   "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]
        name = attempt_pod_name(meta["name"], max(1, attempt))
        if attempt == int(status.get("attempts") or 0) and self.rng.random() < 0.5:
            self._call("delete an own job's pod", "DELETE",
                       f"{PODS_PATH.format(ns=self.ns)}/{name}")
        self._create_cpu_pod("create a CPU pod named and owned like an own job's attempt",
                             self._cpu_pod(name, labels, annotations,
                                           owners if self.rng.random() < 0.7 else []))

    def delete_own_pod(self) -> None:
        pod = self._pick(self._own_pods())
        if pod is not None:
            self._call("delete an own job's pod", "DELETE",
                       f"{PODS_PATH.format(ns=self.ns)}/{pod['metadata']['name']}")

    def delete_recreate_job(self) -> None:
        job = self._pick(self._jobs(self.ns))
        if job is None:
            return
        name = job["metadata"]["name"]
        if self.rng.random() < 0.3:  # its pods left behind, without their owner reference
            self._call("delete an own GpuJob, orphaning its pods (propagationPolicy Orphan)",
                       "DELETE", f"{GPUJOBS_PATH.format(ns=self.ns)}/{name}",
                       query={"propagationPolicy": "Orphan"})
        else:
            self._call("delete an own GpuJob", "DELETE",
                       f"{GPUJOBS_PATH.format(ns=self.ns)}/{name}")
        if self.rng.random() < 0.6:
            time.sleep(self.rng.uniform(0.0, 2.0))
            body = {"apiVersion": names.API_VERSION, "kind": "GpuJob",
                    "metadata": {"name": name}, "spec": job["spec"]}
            self._call("recreate an own GpuJob of the same name", "POST",
                       GPUJOBS_PATH.format(ns=self.ns), body)

    def tidy_cpu_pods(self) -> None:
        """Delete its CPU pods older than 20 s (they would pile up)."""
        now = time.time()
        old = [name for at, name in self.made if now - at > 20]
        self.made = [(at, name) for at, name in self.made if now - at <= 20]
        for name in old[:5]:
            with contextlib.suppress(ApiError):
                self.api.request("DELETE", f"{PODS_PATH.format(ns=self.ns)}/{name}",
                                 query={"gracePeriodSeconds": 0})

    def other_doors(self) -> None:
        kind = self.rng.choice(["nvidia", "carpool", "claim", "critical", "scheduler"])
        name = self._name("door")
        if kind == "claim":
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": name},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                         "deviceClassName": "gpu.nvidia.com"}}]}}}
            self._call("create a ResourceClaim", "POST",
                       f"/apis/resource.k8s.io/v1/namespaces/{self.ns}/resourceclaims", claim)
            return
        pod = self._cpu_pod(name, {}, {}, [])
        attack = {"nvidia": "ask a pod for nvidia.com/gpu",
                  "carpool": "ask a plain pod for carpool.dev/gpu",
                  "critical": "run a plain pod at system-cluster-critical priority",
                  "scheduler": "send a plain pod to carpool-scheduler"}[kind]
        if kind == "nvidia":
            pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        elif kind == "carpool":
            pod["spec"]["containers"][0]["resources"] = {"limits": {names.RESOURCE_GPU: "1"}}
        elif kind == "critical":
            # the whole CPU of a node where the other project runs: only preempting its pods
            # would make room (every job's pod asks for one CPU)
            pod["spec"]["priorityClassName"] = self.rng.choice(
                ["system-cluster-critical", "system-node-critical"])
            busy = [p["spec"].get("nodeName") for p in self.checker.pods_in(self.victim_ns)
                    if p["spec"].get("nodeName") and holds_gpu(p)]
            if busy:
                pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.rng.choice(busy)}
            pod["spec"]["containers"][0]["resources"] = {"requests": {
                "cpu": f"{simnodes.DEFAULT_CPU_MILLI}m"}}
        else:
            pod["spec"]["schedulerName"] = names.SCHEDULER_NAME
        self._create_cpu_pod(attack, pod)

    def odd_template(self) -> None:
        """A GpuJob whose template or limits ask for what a workload does not need."""
        container: Obj = {"name": "main", "image": "trainer"}
        spec: Obj = {}
        gpu: Obj = {"count": 1, "memory": "8Gi", "isolation": "mps", "models": [self.model]}
        extra: Obj = {}
        meta: Obj = {}
        choice = self.rng.choice(sorted(ODD_FIELDS))
        attack = f"GpuJob: {ODD_FIELDS[choice]}"
        if choice == "schedulingGates":
            spec["schedulingGates"] = [{"name": "example.com/hold"}]
        elif choice == "grace":
            spec["terminationGracePeriodSeconds"] = 31_536_000
        elif choice == "preStop":
            container["lifecycle"] = {"preStop": {"sleep": {"seconds": 31_536_000}}}
        elif choice in ("sys_admin", "all", "SYS_MODULE", "DAC_READ_SEARCH", "BPF"):
            container["securityContext"] = {"capabilities": {"add": [choice]}}
        elif choice == "hostNetwork":
            spec["hostNetwork"] = True
        elif choice == "procMount":
            container["securityContext"] = {"procMount": "Unmasked"}
        elif choice == "seccomp":
            spec["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
        elif choice == "apparmor":
            spec["securityContext"] = {"appArmorProfile": {"type": "Unconfined"}}
        elif choice == "nodeName":
            spec["nodeName"] = self.rng.choice(self.nodes)
        elif choice == "schedulerName":
            spec["schedulerName"] = "default-scheduler"
        elif choice == "priorityClassName":
            spec["priorityClassName"] = "system-cluster-critical"
        elif choice == "runtimeClassName":
            spec["runtimeClassName"] = "unconfined"
        elif choice == "interactive16":
            gpu["count"] = 16
            extra = {"class": "interactive", "estimatedDuration": "1s",
                     "maxDuration": "87600h"}
        elif choice == "tinyMemory":
            gpu["memory"] = "1Ki"
        else:
            victim = self._pick(self._jobs(self.victim_ns))
            target = f"{self.victim_ns}/{victim['metadata']['name']}" if victim else "x/y"
            meta = {"labels": {names.LABEL_PROJECT: self.victim_project},
                    "annotations": {names.ANN_JOB: target, names.ANN_ISOLATION: "exclusive"}}
        name = self._name("odd")
        body: Obj = {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
                "spec": {"project": self.project, "class": "short", "gpu": gpu,
                         "estimatedDuration": "30s", "simulatedDuration": "10s",
                         "maxDuration": "1h",
                         "template": {"metadata": meta,
                                      "spec": {"containers": [container], **spec}},
                         **extra}}
        if self._call(attack, "POST", GPUJOBS_PATH.format(ns=self.ns), body):
            self.jobs_made[name] = attack

    def outcomes(self) -> None:
        """What became of the GpuJobs the attacks got stored, into the tally."""
        for name, attack in self.jobs_made.items():
            job = next((j for j in self._jobs(self.ns) if j["metadata"]["name"] == name), None)
            status = (job or {}).get("status") or {}
            phase, reason = str(status.get("phase") or "New"), str(status.get("reason") or "")
            what = ("deleted" if job is None
                    else phase if reason in ("", phase) else f"{phase} {reason}")
            by = self.tally.outcomes.setdefault(attack, {})
            by[what] = by.get(what, 0) + 1

    def cross_namespace(self) -> None:
        victim = self._pick(self._jobs(self.victim_ns))
        if victim is None:
            return
        name = victim["metadata"]["name"]
        choice = self.rng.choice(["job", "pod", "status", "create"])
        if choice == "job":
            self._call("patch the other project's GpuJob", "PATCH",
                       f"{GPUJOBS_PATH.format(ns=self.victim_ns)}/{name}",
                       {"metadata": {"labels": {"x": "y"}}})
        elif choice == "pod":
            self._call("patch the other project's pod", "PATCH",
                       f"{PODS_PATH.format(ns=self.victim_ns)}/{attempt_pod_name(name, 1)}",
                       {"metadata": {"annotations": {names.ANN_JOB: None}}})
        elif choice == "status":
            own = self._pick(self._jobs(self.ns))
            if own is not None:
                self._call("write an own GpuJob's status", "PATCH",
                           f"{GPUJOBS_PATH.format(ns=self.ns)}/{own['metadata']['name']}/status",
                           {"status": {"phase": "Succeeded", "gpuHours": 0}})
        else:
            attack = "bill the other project from the own namespace"
            body = job_manifest(self._name("freeride"), self.victim_project, self.model,
                                self.rng, (10, 20))
            if self._call(attack, "POST", GPUJOBS_PATH.format(ns=self.ns), body):
                self.jobs_made[body["metadata"]["name"]] = attack


# The GpuJobs `Tenant.odd_template` tries, by what they ask for.
ODD_FIELDS = {
    "schedulingGates": "template schedulingGates",
    "grace": "template terminationGracePeriodSeconds of a year",
    "preStop": "template preStop sleep of a year",
    "sys_admin": "template capability sys_admin (lower case)",
    "all": "template capability all (lower case)",
    "SYS_MODULE": "template capability SYS_MODULE",
    "DAC_READ_SEARCH": "template capability DAC_READ_SEARCH",
    "BPF": "template capability BPF",
    "hostNetwork": "template hostNetwork",
    "procMount": "template procMount Unmasked",
    "seccomp": "template seccomp Unconfined",
    "apparmor": "template AppArmor Unconfined",
    "nodeName": "template nodeName",
    "schedulerName": "template schedulerName default-scheduler",
    "priorityClassName": "template priorityClassName system-cluster-critical",
    "runtimeClassName": "template runtimeClassName",
    "interactive16": "interactive, 16 GPUs, 1 s estimate, maxDuration ten years",
    "tinyMemory": "gpu.memory 1Ki",
    "carpoolMetadata": "template carpool.dev/* labels and annotations naming the other project",
}

# Each attack and how often it is picked.
ATTACKS: tuple[tuple[Callable[[Tenant], None], int], ...] = (
    (Tenant.relabel_own_pod, 4), (Tenant.reannotate_own_pod, 4), (Tenant.flip_isolation, 3),
    (Tenant.reown_own_pod, 4), (Tenant.forge_assignment, 1), (Tenant.lookalike_of_victim, 4),
    (Tenant.lookalike_of_own, 3), (Tenant.delete_own_pod, 2), (Tenant.delete_recreate_job, 2),
    (Tenant.other_doors, 2), (Tenant.odd_template, 3), (Tenant.cross_namespace, 1),
)


def job_manifest(name: str, project: str, model: str, rng: random.Random,
                 run_s: tuple[int, int], cls: str | None = None) -> Obj:
    """A job of the mix: 6 in 10 an MPS slice, 2 in 10 two slices, 2 in 10 a whole GPU."""
    shape = rng.random()
    if shape < 0.2:
        gpu: Obj = {"count": 1, "memory": "20Gi", "isolation": "exclusive"}
    elif shape < 0.4:
        gpu = {"count": 2, "memory": f"{rng.choice((8, 16))}Gi", "isolation": "mps",
               "cores": rng.choice((20, 25))}
    else:
        gpu = {"count": 1, "memory": f"{rng.choice((8, 16, 24, 40))}Gi", "isolation": "mps",
               "cores": rng.choice((10, 20, 25, 50))}
    gpu["models"] = [model]
    seconds = rng.randint(*run_s)
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": project,
                     "class": cls or rng.choice(["interactive", "short", "long", "batch"]),
                     "gpu": gpu, "preemptible": False, "maxDuration": "1h",
                     "estimatedDuration": f"{seconds}s", "simulatedDuration": f"{seconds}s",
                     "template": {"spec": {"containers": [{
                         "name": "main", "image": "trainer",
                         "resources": {"requests": {"cpu": "1"}}}]}}}}


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Report:
    settings: Settings
    started_utc: str
    tally: Tally
    checker_counts: dict[str, int]
    violations: list[str]
    victim_jobs: int
    victim_phases: dict[str, int]
    tenant_phases: dict[str, int]
    billed: dict[str, float]
    held: dict[str, float]
    gpu_pods_left: list[str]
    longest_orphan_s: float
    samples: int
    seconds: float
    billing_differences: list[str] = field(default_factory=list)  # pods that differ most
    orphans_stopped: list[float] = field(default_factory=list)  # see Checker

    def billing_gaps(self) -> dict[str, float]:
        """|billed - held| GPU-hours per project beyond the tolerance (none: all equal).

        Tolerance: 0.5 % of what was held, at least 0.002 GPU-h (7 GPU-seconds: the quota's
        status is rounded to 0.0001 GPU-h and a deleted pod's end is seen a moment apart by
        the operator and this run)."""
        gaps = {}
        for project, held in self.held.items():
            billed = self.billed.get(project, 0.0)
            if abs(billed - held) > max(0.002, 0.005 * held):
                gaps[project] = round(billed - held, 5)
        return gaps

    def rows(self) -> list[tuple[str, str, str]]:
        """The invariants table: (invariant, breaches, detail)."""
        counts = self.checker_counts
        rows = [
            (UNEXPLAINED, str(counts.get(UNEXPLAINED, 0)),
             f"{self.victim_jobs} jobs watched; {self.victim_phases}"),
            (ORPHANED, str(counts.get(ORPHANED, 0)),
             f"{len(self.orphans_stopped)} seen stray and then deleted, after "
             f"{max(self.orphans_stopped, default=0.0):.1f} s at most; longest hold seen: "
             f"{self.longest_orphan_s:.0f} s; GPU pods left at the "
             f"end: {len(self.gpu_pods_left)}"),
        ]
        for project in sorted(self.held):
            gap = self.billing_gaps().get(project)
            rows.append((f"GPU-hours billed = held ({project})",
                         "0" if gap is None else "1",
                         f"billed {self.billed.get(project, 0.0):.4f}, held "
                         f"{self.held[project]:.4f}"))
        for name in ("project over its concurrent quota", "GPU over-committed",
                     "grant beyond the job's request", UNASSIGNED):
            rows.append((name, str(counts.get(name, 0)), f"{self.samples} samples"))
        return rows

    def passed(self) -> bool:
        return all(r[1] == "0" for r in self.rows())

    def table(self) -> str:
        lines = ["invariant | breaches | detail", "---|---|---"]
        lines += [" | ".join(r) for r in self.rows()]
        if self.billing_gaps() and self.billing_differences:
            lines += ["", "pods whose GPU time differs most from their job's usage record:",
                      *(f"  {d}" for d in self.billing_differences)]
        tried, accepted, refused = self.tally.totals()
        lines += ["", f"attacks: {tried} requests, {accepted} accepted, {refused} refused",
                  "attack | tried | accepted | refused by", "---|---|---|---"]
        for attack in sorted(self.tally.tried):
            refusals = ", ".join(f"{reason} x{n}" for reason, n in
                                 sorted(self.tally.refused.get(attack, {}).items()))
            stored = ", ".join(f"{what} x{n}" for what, n in
                               sorted(self.tally.outcomes.get(attack, {}).items()))
            lines.append(f"{attack} | {self.tally.tried[attack]} | "
                         f"{self.tally.accepted.get(attack, 0)}"
                         f"{f' (then {stored})' if stored else ''} | {refusals or '-'}")
        return "\n".join(lines)

    def as_json(self) -> Obj:
        return {"started_utc": self.started_utc, "seconds": round(self.seconds),
                "duration_s": self.settings.duration_s, "rows": self.rows(),
                "violations": self.violations[:100], "billed": self.billed, "held": self.held,
                "gpu_pods_left": self.gpu_pods_left,
                "billing_differences": self.billing_differences,
                "attacks": {a: {"tried": n, "accepted": self.tally.accepted.get(a, 0),
                                "refused": self.tally.refused.get(a, {}),
                                "stored_jobs_became": self.tally.outcomes.get(a, {})}
                            for a, n in sorted(self.tally.tried.items())},
                "messages": {f"{a} / {r}": m for (a, r), m in sorted(self.tally.messages.items())}}


def chart_policies(cluster: devcluster.Cluster, release: str, namespace: str) -> list[Obj]:
    """The chart's admission policies and bindings, rendered for `release`."""
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", release, str(CHART), "--namespace",
         namespace], capture_output=True, text=True, timeout=120, check=True).stdout
    return [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in POLICY_KINDS]


def run(cluster: devcluster.Cluster, settings: Settings, log_dir: Path,
        out: TextIO = sys.stderr) -> Report:
    """The whole run on `cluster` (see the module docstring); the cluster is left as found."""
    def say(message: str) -> None:
        print(f"[tenant-chaos {datetime.now(UTC).strftime('%H:%M:%S')}] {message}", file=out,
              flush=True)

    say("setting up: the chart's policies, two projects, the tenant, nodes, Carpool")
    rng = random.Random(settings.seed)
    world = tenants.World(cluster, log_dir, "tc")
    crds.apply_crds(cluster.api())
    release = world.name("carpool")
    rendered = chart_policies(cluster, release, world.name("sys"))
    known = {o["metadata"]["name"].replace(release, "carpool", 1) for o in rendered}
    if unknown := sorted(set(settings.without_policies) - known):
        raise ValueError(f"without_policies: {', '.join(unknown)} is not one of the chart's "
                         f"policies ({', '.join(sorted(known))})")
    policies = [o for o in rendered if o["metadata"]["name"].replace(release, "carpool", 1)
                not in settings.without_policies]
    world.apply_cluster_scoped([*policies, *tenants.user_roles(world)])
    victim_ns, tenant_ns = world.namespace("victim"), world.namespace("tenant")
    victim_project = world.project("victim", [victim_ns])
    tenant_project = world.project("tenant", [tenant_ns])
    started = datetime.now(UTC).replace(microsecond=0)
    anchor = started.strftime("%Y-%m-%dT%H:%M:%SZ")
    for project, gpus in ((victim_project, settings.victim_gpus),
                          (tenant_project, settings.tenant_gpus)):
        world.admin("patch", "projectquota", project, "--type=merge", "-p", json.dumps({
            "spec": {"concurrent": {"gpus": gpus}, "borrowing": {"enabled": False},
                     "classLimits": dict.fromkeys(("interactive", "short", "long", "batch"),
                                                  CLASS_LIMITS),
                     "gpuHours": {"budget": 100000, "period": "24h", "periodAnchor": anchor}}}))
    model = f"TC{world.suffix}"
    nodes = simnodes.parse_nodes({"nodes": [{
        "name": world.name("n"), "replicas": settings.nodes, "sharing": "mps",
        "zone": "zone-a", "gpus": [{"model": model, "count": settings.gpus_per_node,
                                    "memoryTotalMiB": settings.gpu_memory_gib * 1024}]}]})
    simnodes.apply_nodes(cluster.api(), nodes)
    world.nodes += [n.name for n in nodes]
    who = tenants.tenant(world, tenant_ns, "mallory")
    from carpool_testbed.waiting import wait_for

    wait_for("the GpuJob roles to aggregate into edit",
             lambda: tenants.can_create_gpujobs(world, who, tenant_ns), timeout=60)
    admin = Api.of(cluster.api())
    memory_totals = {g.uuid: g.memory_total_mib for n in nodes for g in n.backend().inventory()}
    capacity = {uuid: chaos.GpuCapacity(n.name, mib, True) for n in nodes
                for uuid, mib in ((g.uuid, g.memory_total_mib) for g in n.backend().inventory())}
    checker = Checker(admin, {victim_ns: victim_project, tenant_ns: tenant_project}, victim_ns,
                      memory_totals, capacity,
                      {victim_project: float(settings.victim_gpus),
                       tenant_project: float(settings.tenant_gpus)},
                      settings.orphan_grace_s)
    tally = Tally()
    tenant_api = ImpersonatingApi(admin.configuration, who.account)
    attacker = Tenant(tenant_api, tenant_ns, tenant_project, victim_ns, victim_project, checker,
                      [n.name for n in nodes], model, rng, tally)
    stop = threading.Event()
    submitted = {"victim": 0, "tenant": 0}
    say(f"cluster {cluster.name}; projects {victim_project} (victim, {settings.victim_gpus} "
        f"GPUs) and {tenant_project} (tenant {who.account}, {settings.tenant_gpus} GPUs); "
        f"{settings.nodes} nodes x {settings.gpus_per_node} GPUs; attacking "
        f"{settings.duration_s:.0f} s; policies left out: "
        f"{', '.join(settings.without_policies) or 'none'}; logs in {log_dir}")

    def unfinished(namespace: str, prefix: str = "") -> int:
        """Jobs not finished (of the load's own, named `prefix`...: an attack's odd job may
        never start, and must not take a place of the load)."""
        return sum(1 for j in checker.jobs_in(namespace)
                   if j["metadata"]["name"].startswith(prefix)
                   and (j.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))

    def submit_loop() -> None:
        load_rng = random.Random(settings.seed + 1)
        while not stop.wait(1.0):
            for namespace, project, key, live, api in (
                    (victim_ns, victim_project, "victim", settings.victim_live, admin),
                    (tenant_ns, tenant_project, "tenant", settings.tenant_live, tenant_api)):
                for _ in range(max(0, live - unfinished(namespace, key[0]))):
                    submitted[key] += 1
                    body = job_manifest(f"{key[0]}{submitted[key]:04d}", project, model,
                                        load_rng, settings.run_s)
                    with contextlib.suppress(ApiError):
                        api.create(GPUJOBS_PATH.format(ns=namespace), body)

    def attack_loop() -> None:
        # Without carpool-pod-metadata nothing keeps a tenant from forging the extender's
        # assignment, which the device plugin believes by design (its integrity is that
        # policy's): that run tries what the components must ignore, not the forgery.
        actions = [a for a, weight in ATTACKS for _ in range(weight)
                   if not (a is Tenant.forge_assignment
                           and "carpool-pod-metadata" in settings.without_policies)]
        while not stop.wait(settings.attack_pause_s):
            try:
                rng.choice(actions)(attacker)
                attacker.tidy_cpu_pods()
            except Exception as err:  # an attack's own bug must not end the run silently
                say(f"attack raised {type(err).__name__}: {err}")

    began = time.monotonic()
    with stack.running_stack(cluster, log_dir, {"CARPOOL_RESYNC_SECONDS": "2"},
                             strict=True) as processes:
        checker.start()
        threads = [threading.Thread(target=submit_loop, daemon=True),
                   threading.Thread(target=attack_loop, daemon=True)]
        try:
            wait_for("the tenant-isolation policy to be enforced",
                     lambda: _enforced(tenant_api, tenant_ns), timeout=60)
            stack.check_alive(processes, log_dir)
            for thread in threads:
                thread.start()
            shown = 0
            while time.monotonic() - began < settings.duration_s:
                time.sleep(min(settings.progress_s,
                               max(0.1, settings.duration_s - (time.monotonic() - began))))
                stack.check_alive(processes, log_dir)
                tried, accepted, refused = tally.totals()
                say(f"{time.monotonic() - began:4.0f}/{settings.duration_s:.0f} s; victim "
                    f"{checker.phases(victim_ns)}; tenant {checker.phases(tenant_ns)}; attacks "
                    f"{tried} ({refused} refused, {accepted} accepted); GPU pods "
                    f"{len(checker.gpu_pods())}; violations {len(checker.violations)}")
                for violation in checker.violations[shown:shown + 10]:
                    say(f"VIOLATION {violation}")
                shown = len(checker.violations)
            stop.set()
            for thread in threads:
                thread.join(30)
            say("attacks stopped; waiting for the other project's jobs to finish")
            settle_end = time.monotonic() + settings.settle_s
            while time.monotonic() < settle_end and unfinished(victim_ns):
                time.sleep(2)
            attacker.outcomes()
            # the books closed: the tenant's jobs deleted, as it did its own all along
            world.admin("delete", "gpujobs", "--all", "-n", tenant_ns, "--wait=false")
            say("the tenant's jobs deleted; waiting for every GPU pod to go")
            while time.monotonic() < settle_end + 60 and checker.gpu_pods():
                time.sleep(2)
            time.sleep(6)  # the operator's next passes write the last statuses
            succeeded = [j["metadata"]["name"] for j in checker.jobs_in(victim_ns)
                         if (j.get("status") or {}).get("phase") == "Succeeded"]
            for problem in checker.victim_pods_not_their_own(succeeded):
                checker.breach(UNEXPLAINED, problem)
            held = checker.held_gpu_hours(time.time())
            differences = checker.billing_differences(time.time())
            billed = _billed(admin, [victim_project, tenant_project])
        finally:
            stop.set()
            checker.stop()
            tenant_api.close()
            world.cleanup()  # while the operator runs: it releases the jobs' pods
    longest = max(checker.orphan_holds.values(), default=0.0)
    report = Report(settings, started.strftime("%Y-%m-%d %H:%M:%SZ"), tally,
                    dict(checker.counts), list(checker.violations), len(checker.victim_seen),
                    checker.phases(victim_ns), checker.phases(tenant_ns), billed, held,
                    checker.gpu_pods(), longest, checker.samples, time.monotonic() - began,
                    differences, list(checker.orphans_stopped))
    for violation in checker.violations[shown:]:
        say(f"VIOLATION {violation}")
    say("result\n" + report.table())
    return report


def _enforced(api: Api, namespace: str) -> bool:
    """The chart's policies are in force (they take effect a moment after they are created)."""
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
             "spec": {"hostPID": True, "containers": [{"name": "c", "image": "x"}]}}
    try:
        api.request("POST", PODS_PATH.format(ns=namespace), probe, query={"dryRun": "All"})
    except ApiError as err:
        return "ValidatingAdmissionPolicy" in err.message
    return False


def _billed(api: Api, projects: Iterable[str]) -> dict[str, float]:
    from carpool.kube.resources import PROJECTQUOTAS

    out = {}
    for project in projects:
        quota = api.get(PROJECTQUOTAS.path(None, project)) or {}
        out[project] = float((quota.get("status") or {}).get("usedGpuHours") or 0.0)
    return out


# --------------------------------------------------------------------------------------------
# `carpool-testbed tenant-chaos`


def register(commands: Any) -> None:
    """Add the `tenant-chaos` command to the `carpool-testbed` parser's sub-commands."""
    parser = commands.add_parser(
        "tenant-chaos", help="a tenant attacking Carpool while two projects' jobs run",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long it attacks")
    parser.add_argument("--cluster", default=devcluster.cluster_name(),
                        help="the local cluster to run on (started if not running)")
    parser.add_argument("--report", type=Path, help="write the report as JSON here too")
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--without-policy", action="append", default=[], metavar="NAME",
                        help="leave this chart policy out (e.g. carpool-pod-metadata), to try "
                             "the components behind it; repeatable")
    parser.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    import tempfile

    if args.minutes <= 0:
        print("--minutes must be more than 0", file=sys.stderr)
        return 2
    settings = Settings(duration_s=args.minutes * 60, seed=args.seed,
                        without_policies=tuple(args.without_policy))
    with devcluster.shared_session(args.cluster, progress=devcluster.Progress(sys.stderr)
                                   ) as cluster:
        report = run(cluster, settings, Path(tempfile.mkdtemp(prefix="carpool-tenant-chaos-")))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report.as_json(), indent=2))
    print(report.table())
    return 0 if report.passed() else 1

