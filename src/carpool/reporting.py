"""Reports over Carpool's objects: the queue, why a job waits, quotas, nodes, GPU-hours.

Pure functions from the API's plain dicts (GpuJobs, ProjectQuotas, GpuNodes, Pods) and `now`
to frozen dataclasses, so `kubectl carpool`, the demo and tests share one reading of the
cluster. Nothing here talks to a cluster; `to_jsonable` turns any result into JSON data.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from carpool.core import interference, names, right_sizing, service_levels
from carpool.core.assignment import AssignmentError, parse_assignment
from carpool.core.decoding import (
    first_image,
    gpu_request_from_spec,
    job_from_object,
    quota_from_object,
    worker_requests_from_spec,
)
from carpool.core.durations import format_duration_roughly, parse_duration
from carpool.core.fairshare import nominal_fraction
from carpool.core.gpuhours import gpu_hours
from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB, inventory_from_gpunode
from carpool.core.jobs import BudgetPolicy, job_template
from carpool.core.placement import NodeState, node_rejection
from carpool.core.queueing import WaitReason
from carpool.core.quota import (
    ProjectLedger,
    Standing,
    binding_refusal,
    budget_claims,
    judge,
    may_borrow,
)
from carpool.core.resources import GpuGrant, GpuRequest, Isolation, JobClass, NodeInventory, Phase
from carpool.core.right_sizing import SizeAdvice
from carpool.core.timestamps import epoch_of, format_timestamp

Obj = Mapping[str, Any]
WAITING_PHASES = frozenset({"", "Queued", "Preempted"})
# A job without a reason: the operator writes a job's first wait in the pass that first sees
# it, or, in a burst of admissions carried out over several passes, once the burst is carried
# out (`job_status.wait_unsettled`)
NO_REASON_YET = "no reason written yet (new, or the operator is carrying out a burst)"
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
TERMINAL_POD_PHASES = frozenset({"Succeeded", "Failed"})
_MIB_PER_GIB = 1024


# --- small readers ------------------------------------------------------------------------


def relative(epoch: float | None, now: float) -> str:
    """'in 12m', '3h ago', 'now'; '-' when unknown."""
    if epoch is None:
        return "-"
    delta = epoch - now
    if abs(delta) < 1:
        return "now"
    text = format_duration_roughly(delta)
    return f"in {text}" if delta > 0 else f"{text} ago"


def parse_since(text: str, now: float) -> float:
    """`--since`: a duration back from now ('7d', '12h') or a date/time ('2026-11-01')."""
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since wants a duration such as 7d or 12h, or a date such as "
                         f"2026-11-01 or 2026-11-01T08:00:00Z; got {text!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _spec(obj: Obj) -> Obj:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _status(obj: Obj) -> Obj:
    status = obj.get("status")
    return status if isinstance(status, Mapping) else {}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def fmt_number(x: float | None, digits: int = 2) -> str:
    """A number without trailing zeros: 2.50 -> '2.5', None -> '-'."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "unlimited"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") or "0"


def job_key(obj: Obj) -> str:
    meta = _meta(obj)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def class_rank(name: str) -> int:
    """Queue order of a class name (unknown names last)."""
    try:
        return int(JobClass.parse(name))
    except ValueError:
        return len(JobClass)


def _gib(mib: float) -> str:
    return fmt_number(mib / _MIB_PER_GIB, 1) + "Gi"


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and mappings as JSON data (for `-o json`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        items = sorted(value) if isinstance(value, frozenset | set) else value
        return [to_jsonable(v) for v in items]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value: Any) -> str:
    return json.dumps(to_jsonable(value), indent=2, sort_keys=False)


# --- queue --------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuedJob:
    """One waiting GpuJob as the operator last described it."""

    namespace: str
    name: str
    project: str
    job_class: str
    phase: str
    position: int | None  # 1 = next to be considered; None: not yet ranked or refused
    estimated_start: str | None  # RFC 3339
    estimated_range: tuple[str, str] | None  # RFC 3339 P10 and P90 around it
    reason: str
    message: str
    gpus: int
    memory: str
    isolation: str
    submitted: str | None
    workers: int = 1  # pods: a gang's workers (spec.workers), admitted together


@dataclass(frozen=True)
class QueueGroup:
    """The waiting jobs of one project and class."""

    project: str
    job_class: str
    waiting: int
    gpus: int
    head_position: int | None
    earliest_start: str | None
    reasons: Mapping[str, int]


def _range(status: Mapping[str, Any]) -> tuple[str, str] | None:
    low, high = status.get("estimatedStartEarliest"), status.get("estimatedStartLatest")
    return (str(low), str(high)) if low and high else None


def relative_range(estimated_range: tuple[str, str] | None, now: float) -> str:
    """'2m-9m' (from now) for an estimate's 80 % range, '' without one."""
    if estimated_range is None:
        return ""
    low, high = (epoch_of(t) for t in estimated_range)
    if low is None or high is None:
        return ""
    return (f"{relative(low, now).removeprefix('in ')}-"
            f"{relative(high, now).removeprefix('in ')}")


def waiting_jobs(jobs: Iterable[Obj]) -> list[QueuedJob]:
    """Jobs still in the queue, in queue order (unranked ones last, oldest first)."""
    out = []
    for obj in jobs:
        status, spec, meta = _status(obj), _spec(obj), _meta(obj)
        phase = str(status.get("phase") or "")
        if phase not in WAITING_PHASES:
            continue
        gpu = spec.get("gpu") if isinstance(spec.get("gpu"), Mapping) else {}
        assert isinstance(gpu, Mapping)
        position = status.get("queuePosition")
        try:
            workers = worker_requests_from_spec(spec)
        except ValueError:
            workers = ()
        out.append(QueuedJob(
            namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")),
            project=str(spec.get("project", "")), job_class=str(spec.get("class", "batch")),
            phase=phase or "Queued",
            position=position if isinstance(position, int) and position > 0 else None,
            estimated_start=status.get("estimatedStart") or None,
            estimated_range=_range(status),
            reason=str(status.get("reason") or ("Pending" if not phase else "")),
            message=str(status.get("message") or ""),
            gpus=sum(w.count for w in workers) if workers else int(gpu.get("count", 1)),
            memory=str(gpu.get("memory", "")),
            isolation=str(gpu.get("isolation", "mps")),
            submitted=status.get("submitTime") or meta.get("creationTimestamp"),
            workers=len(workers) or 1,
        ))
    out.sort(key=lambda j: (j.position is None, j.position or 0, class_rank(j.job_class),
                            j.submitted or "", j.namespace, j.name))
    return out


def queue_groups(entries: Sequence[QueuedJob]) -> list[QueueGroup]:
    """Per project and class: how many wait, their GPUs, the best position and start."""
    grouped: dict[tuple[str, str], list[QueuedJob]] = {}
    for entry in entries:
        grouped.setdefault((entry.project, entry.job_class), []).append(entry)
    groups = []
    for (project, job_class), members in grouped.items():
        positions = [m.position for m in members if m.position is not None]
        starts = [m.estimated_start for m in members if m.estimated_start]
        reasons: dict[str, int] = {}
        for m in members:
            reasons[m.reason or "-"] = reasons.get(m.reason or "-", 0) + 1
        groups.append(QueueGroup(
            project, job_class, len(members), sum(m.gpus for m in members),
            min(positions) if positions else None,
            min(starts, key=lambda s: epoch_of(s) or 0.0) if starts else None,
            dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))))
    groups.sort(key=lambda g: (g.project, class_rank(g.job_class)))
    return groups


# --- nodes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """One pod's grant on one GPU (from its `carpool.dev/assignment` annotation)."""

    namespace: str
    pod: str
    memory_mib: int
    cores_pct: int
    mig_instance: str
    exclusive: bool


@dataclass(frozen=True)
class GpuView:
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    memory_used_mib: int | None  # measured by the device plugin
    memory_assigned_mib: int  # granted by Carpool to running or bound pods
    cores_assigned_pct: int
    temperature_c: float | None
    slowdown_temperature_c: float | None
    utilization_pct: float | None
    health: str
    health_reason: str
    cordoned: bool
    mig_instances: int
    shares: tuple[Share, ...]

    @property
    def memory_free_mib(self) -> int:
        """Memory Carpool can still grant on this GPU."""
        if any(s.exclusive for s in self.shares):
            return 0
        return max(0, self.memory_total_mib - self.memory_assigned_mib)


@dataclass(frozen=True)
class NodeView:
    name: str
    sharing_mode: str
    zone: str
    driver_version: str
    cuda_version: str
    heartbeat: str | None
    heartbeat_age_s: float | None
    gpus: tuple[GpuView, ...]


def assignments_by_gpu(pods: Iterable[Obj]) -> dict[str, list[Share]]:
    """GPU uuid -> the shares pods hold on it, from live pods' assignment annotations.

    Only a pod placed by Carpool's scheduler (`spec.schedulerName`, immutable) can hold a
    Carpool GPU: an assignment annotation on any other pod holds nothing, whatever its labels
    say. Finished pods hold nothing; a pod bound to another node than its annotation names
    holds nothing either (the annotation is stale). Malformed annotations are skipped: a
    report must not fail on one bad pod.
    """
    out: dict[str, list[Share]] = {}
    for pod in pods:
        meta, status, spec = _meta(pod), _status(pod), _spec(pod)
        annotations = meta.get("annotations") or {}
        text = annotations.get(names.ANN_ASSIGNMENT)
        if not text or status.get("phase") in TERMINAL_POD_PHASES \
                or spec.get("schedulerName") != names.SCHEDULER_NAME:
            continue
        try:
            assignment = parse_assignment(str(text))
        except AssignmentError:
            continue
        if spec.get("nodeName") and spec.get("nodeName") != assignment.node:
            continue
        # the isolation the extender recorded; only an assignment made before it was
        # recorded falls back to the pod's annotation
        exclusive = assignment.isolation is Isolation.EXCLUSIVE or (
            assignment.isolation is None
            and str(annotations.get(names.ANN_ISOLATION, "")).lower() == "exclusive")
        for g in assignment.gpus:
            out.setdefault(g.uuid, []).append(Share(
                namespace=str(meta.get("namespace", "")), pod=str(meta.get("name", "")),
                memory_mib=g.memory_mib, cores_pct=g.cores_pct, mig_instance=g.mig_instance,
                exclusive=exclusive))
    return out


def node_views(gpunodes: Iterable[Obj], pods: Iterable[Obj], now: float) -> list[NodeView]:
    """Every GpuNode with its GPUs' telemetry and who holds what on each GPU."""
    shares = assignments_by_gpu(pods)
    views = []
    for obj in gpunodes:
        status, spec = _status(obj), _spec(obj)
        cordoned = set(spec.get("cordonedGpus") or ())
        gpus = []
        for g in sorted(status.get("gpus") or (), key=lambda g: int(g.get("index", 0))):
            held = tuple(sorted(shares.get(str(g.get("uuid")), ()),
                                key=lambda s: (s.namespace, s.pod)))
            index = int(g.get("index", 0))
            gpus.append(GpuView(
                index=index, uuid=str(g.get("uuid", "")), model=str(g.get("model", "")),
                memory_total_mib=int(g.get("memoryTotalMiB", 0)),
                memory_used_mib=g.get("memoryUsedMiB"),
                memory_assigned_mib=sum(s.memory_mib for s in held),
                cores_assigned_pct=sum(s.cores_pct for s in held),
                temperature_c=_number(g.get("temperatureC")),
                slowdown_temperature_c=_number(g.get("slowdownTemperatureC")),
                utilization_pct=_number(g.get("utilizationPct")),
                health=str(g.get("health", "Healthy")),
                health_reason=str(g.get("healthReason", "")),
                cordoned=index in cordoned,
                mig_instances=len(g.get("migInstances") or ()),
                shares=held))
        heartbeat = status.get("heartbeat")
        beat = epoch_of(heartbeat)
        views.append(NodeView(
            name=str(_meta(obj).get("name", "")), sharing_mode=str(status.get("sharingMode", "")),
            zone=str(status.get("zone", "")), driver_version=str(status.get("driverVersion", "")),
            cuda_version=str(status.get("cudaVersion", "")),
            heartbeat=heartbeat if isinstance(heartbeat, str) else None,
            heartbeat_age_s=None if beat is None else max(0.0, now - beat),
            gpus=tuple(gpus)))
    views.sort(key=lambda v: v.name)
    return views


# --- quotas -------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuotaView:
    project: str
    namespaces: tuple[str, ...]
    budget_gpu_hours: float | None
    period: str
    on_exhausted: str
    used_gpu_hours: float | None
    remaining_gpu_hours: float | None
    period_start: str | None
    period_end: str | None
    guaranteed_gpus: float | None
    guaranteed_memory: str | None
    borrowing: bool
    borrow_limit_gpus: float | None
    running_gpus: float
    running_jobs: int
    borrowed_gpus: float
    pending: int
    memory_efficiency: float | None
    weight: float


def size_advice(gpujobs: Iterable[Obj]) -> list[SizeAdvice]:
    """Right-sizing advice (`core.right_sizing`) from the finished GpuJobs whose peak GPU
    memory the device plugin recorded."""
    runs = []
    for obj in gpujobs:
        spec, status = obj.get("spec") or {}, _status(obj)
        peak = status.get("peakMemoryMiB")
        if status.get("phase") != "Succeeded" or not isinstance(peak, int) or peak <= 0:
            continue
        try:
            requested = gpu_request_from_spec(spec).memory_mib
        except ValueError:
            continue
        template = job_template(str(_meta(obj).get("name", "")), first_image(spec))
        runs.append((str(spec.get("project") or ""), template, requested, peak))
    return right_sizing.size_advice(runs)


def quota_views(quotas: Iterable[Obj]) -> list[QuotaView]:
    views = []
    for obj in quotas:
        spec, status = _spec(obj), _status(obj)
        hours = spec.get("gpuHours") or {}
        concurrent = spec.get("concurrent") or {}
        borrowing = spec.get("borrowing") or {}
        running = status.get("running") or {}
        borrowed = status.get("borrowed") or {}
        period = str(hours.get("period", ""))
        start = epoch_of(status.get("periodStart"))
        end = None
        if start is not None and period:
            try:
                end = format_timestamp(start + parse_duration(period))
            except ValueError:
                end = None
        views.append(QuotaView(
            project=str(_meta(obj).get("name", "")),
            namespaces=tuple(str(n) for n in spec.get("namespaces") or ()),
            budget_gpu_hours=_number(hours.get("budget")), period=period,
            on_exhausted=str(hours.get("onExhausted", "Hold")) if hours else "",
            used_gpu_hours=_number(status.get("usedGpuHours")),
            remaining_gpu_hours=_number(status.get("remainingGpuHours")),
            period_start=status.get("periodStart"), period_end=end,
            guaranteed_gpus=_number(concurrent.get("gpus")),
            guaranteed_memory=concurrent.get("memory"),
            borrowing=bool(borrowing.get("enabled", False)),
            borrow_limit_gpus=_number(borrowing.get("maxGpus")),
            running_gpus=_number(running.get("gpus")) or 0.0,
            running_jobs=int(running.get("jobs", 0) or 0),
            borrowed_gpus=_number(borrowed.get("gpus")) or 0.0,
            pending=int(status.get("pending", 0) or 0),
            memory_efficiency=_number(status.get("memoryEfficiency")),
            weight=_number(spec.get("weight")) or 1.0))
    views.sort(key=lambda v: v.project)
    return views


# --- GPU-hours report ---------------------------------------------------------------------


@dataclass(frozen=True)
class UsageRow:
    """GPU-hours one project (or job) used inside the report window."""

    key: str
    project: str
    jobs: int
    runs: int
    gpu_hours: float
    share: float  # of all GPU-hours in the window, 0..1


@dataclass(frozen=True)
class UsageReport:
    since: str
    until: str
    by: str
    rows: tuple[UsageRow, ...]
    total_gpu_hours: float


def usage_report(jobs: Iterable[Obj], since: float, now: float, by: str = "project"
                 ) -> UsageReport:
    """GPU-hours by project (or by job) from the jobs' `status.history` runs in [since, now].

    A run still open (no end) counts up to `now`; each run is clipped to the window and
    priced with `carpool.core.gpuhours.gpu_hours`, the definition accounting uses.
    """
    if by not in ("project", "job"):
        raise ValueError(f"report rows are by 'project' or 'job', not {by!r}")
    if since > now:
        raise ValueError(f"the report window starts in the future ({format_timestamp(since)})")
    hours: dict[str, float] = {}
    runs: dict[str, int] = {}
    jobs_in: dict[str, set[str]] = {}
    projects: dict[str, str] = {}
    for obj in jobs:
        project = str(_spec(obj).get("project", ""))
        key = project if by == "project" else job_key(obj)
        for record in _status(obj).get("history") or ():
            start = epoch_of(record.get("start"))
            if start is None:
                continue
            end = epoch_of(record.get("end"))
            end = now if end is None else end
            # outside the window; a run shorter than the timestamps' one second still counts
            # as a run, and so does one whose end is stamped before its start (a runtime may
            # do that for a container that exits at once): gpu_hours gives it no time
            if end < since or start > now:
                continue
            clipped_start, clipped_end = max(start, since), min(end, now)
            fraction = _number(record.get("fraction")) or 0.0
            hours[key] = hours.get(key, 0.0) + gpu_hours(fraction, clipped_start, clipped_end)
            runs[key] = runs.get(key, 0) + 1
            jobs_in.setdefault(key, set()).add(job_key(obj))
            projects[key] = project
    total = sum(hours.values())
    rows = tuple(sorted(
        (UsageRow(key, projects[key], len(jobs_in[key]), runs[key], hours[key],
                  hours[key] / total if total > 0 else 0.0) for key in hours),
        key=lambda r: (-r.gpu_hours, r.key)))
    return UsageReport(format_timestamp(since), format_timestamp(now), by, rows, total)


# --- services -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceRow:
    """The three measures of one job, project, class or node (`core.service_levels`), and,
    per job, its objective and how many jobs shared its GPU."""

    key: str
    jobs: int
    throughput: float  # successful requests per second
    p99_ms: float | None
    failure_rate: float
    requests: int
    p99_objective_ms: float | None = None  # per job: spec.objectives.p99Latency
    sharing: int | None = None  # per job: jobs on its GPU when it reported
    gpu_model: str = ""

    @property
    def objective_met(self) -> bool | None:
        if self.p99_objective_ms is None or self.p99_ms is None:
            return None
        return self.p99_ms <= self.p99_objective_ms


def service_rows(jobs: Iterable[Obj], by: str = "job") -> list[ServiceRow]:
    """The latest service measures of running jobs, per `by` (job, project, class, node)."""
    measured: list[service_levels.Measured] = []
    details: dict[str, tuple[float | None, int, str]] = {}
    for obj in jobs:
        found = service_levels.measured_of(obj)
        if found is None:
            continue
        measured.append(found)
        try:
            objectives = gpu_request_from_spec(_spec(obj)).objectives
        except ValueError:
            objectives = None
        target = objectives.p99_latency_s if objectives is not None else None
        details[found.job] = (None if target is None else target * 1000,
                              found.measure.sharing, found.measure.gpu_model)
    rows = []
    for summary in service_levels.aggregate(measured, by):
        p99 = summary.p99_s
        target, sharing, model = details.get(summary.key, (None, 0, "")) \
            if by == service_levels.Scope.JOB else (None, 0, "")
        rows.append(ServiceRow(summary.key, summary.jobs, summary.throughput,
                               None if p99 is None else p99 * 1000, summary.failure_rate,
                               summary.requests, target, sharing or None, model))
    return rows


# --- why ----------------------------------------------------------------------------------


class Topic(enum.Enum):
    STATUS = "status"
    QUEUE = "queue"
    PROJECT = "project"
    QUOTA = "quota"
    BUDGET = "budget"
    CAPACITY = "capacity"
    SHARING = "sharing"
    CONSTRAINTS = "constraints"
    SIZE = "size"


@dataclass(frozen=True)
class Finding:
    topic: Topic
    blocking: bool  # this, on its own, keeps the job from starting now
    text: str


@dataclass(frozen=True)
class Explanation:
    job: str
    phase: str
    waiting: bool
    summary: str
    findings: tuple[Finding, ...]


def _inventories(gpunodes: Iterable[Obj], now: float
                 ) -> tuple[list[NodeInventory], list[str], list[str]]:
    """Placement inventories of the GpuNodes as the operator and the extender read them, the
    names of those whose heartbeat is stale (their plugin silent for over two minutes: the
    deciders still place there, on the last numbers it sent), and a note for each GpuNode
    that cannot be read."""
    inventories, stale, problems = [], [], []
    stamp = dt.datetime.fromtimestamp(now, dt.UTC)
    for obj in gpunodes:
        name = str(_meta(obj).get("name", ""))
        try:
            inventory = inventory_from_gpunode(name, _status(obj), {})
            if inventory.ready and not inventory_from_gpunode(name, _status(obj), {},
                                                              now=stamp).ready:
                stale.append(name)
            inventories.append(inventory)
        except ValueError as err:
            problems.append(str(err))
    return inventories, stale, problems


def _grants_on(inventory: NodeInventory, shares: Mapping[str, list[Share]]) -> tuple[GpuGrant, ...]:
    return tuple(
        GpuGrant(gpu.uuid, gpu.memory_total_mib if s.exclusive else s.memory_mib,
                 100 if s.exclusive else s.cores_pct, exclusive=s.exclusive,
                 mig_instance=s.mig_instance)
        for gpu in inventory.gpus for s in shares.get(gpu.uuid, ()))


def _sharing_findings(job: Obj, request: GpuRequest, reason: str, jobs: Iterable[Obj] | None
                      ) -> list[Finding]:
    """The job's objectives and how far its template's interference profiles let a GPU be
    shared with it (`core.interference`), blocking when sharing is what keeps it waiting."""
    blocking = reason == WaitReason.SHARING_OBJECTIVE.value
    objectives = request.objectives
    if objectives is None and not blocking:
        return []
    promised = []
    if objectives is not None and objectives.p99_latency_s is not None:
        promised.append(f"P99 latency under {objectives.p99_latency_s * 1000:g} ms")
    if objectives is not None and objectives.max_slowdown is not None:
        promised.append(f"at most {objectives.max_slowdown:g}x slower than alone")
    text = (f"objectives: {', '.join(promised)}" if promised else "no objectives of its own")
    if jobs is not None:
        template = job_template(str(_meta(job).get("name", "")), first_image(_spec(job)))
        profiles = interference.learn_from_gpujobs(jobs)
        limits = profiles.limits(template, objectives)
        weights = dict(profiles.weights(template))
        text += ("; its template's profiles allow "
                 + ", ".join(f"{n:g} job(s) per {model} (weighing {weights[model] / 1000:.2f} "
                             f"as a sharer)" for model, n in limits) if limits
                 else "; its template has no interference profile yet (no limit from it)")
    if blocking:
        text += ("; every GPU with room already runs as many jobs as its objective, or the "
                 "objective of a job there, allows")
    return [Finding(Topic.SHARING, blocking, text)]


def _constraint_findings(request: GpuRequest, inventories: Sequence[NodeInventory]
                         ) -> list[Finding]:
    """What in the spec no node could ever satisfy, even empty (with what the cluster has)."""
    findings = []
    gpus = [g for inv in inventories for g in inv.gpus]
    models: dict[str, int] = {}
    for g in gpus:
        models[g.model] = models.get(g.model, 0) + 1
    have = ", ".join(f"{m}x{n}" for m, n in sorted(models.items())) or "no GPUs"
    allowed = [g for g in gpus if request.allows_model(g.model)]
    if request.models:
        findings.append(Finding(
            Topic.CONSTRAINTS, not allowed,
            f"allowed models {', '.join(sorted(request.models))}: {len(allowed)} such GPU(s); "
            f"the cluster has {have}"))
    offering = [inv for inv in inventories if request.isolation in inv.sharing]
    findings.append(Finding(
        Topic.CONSTRAINTS, not offering,
        f"isolation {request.isolation.value}: offered by {len(offering)} of "
        f"{len(inventories)} GPU node(s)"))
    per_node = max((sum(1 for g in inv.gpus if request.allows_model(g.model))
                    for inv in offering), default=0)
    findings.append(Finding(
        Topic.CONSTRAINTS, per_node < request.count,
        f"needs {request.count} GPU(s) on one node; the largest suitable node has {per_node}"))
    if request.isolation is not Isolation.EXCLUSIVE:
        largest = max((max((m.memory_mib for m in g.mig_instances), default=0)
                       if request.isolation is Isolation.MIG else g.memory_total_mib
                       for g in allowed), default=0)
        findings.append(Finding(
            Topic.CONSTRAINTS, largest < request.memory_mib,
            f"needs {_gib(request.memory_mib)} per GPU; the largest suitable "
            f"{'MIG instance' if request.isolation is Isolation.MIG else 'GPU'} has "
            f"{_gib(largest)}"))
    return findings


def _capacity_finding(request: GpuRequest, states: Sequence[NodeState]) -> Finding:
    fitting = sorted(s.name for s in states if node_rejection(s, request) is None)
    if fitting:
        shown = ", ".join(fitting[:5]) + (f" and {len(fitting) - 5} more" if len(fitting) > 5
                                          else "")
        return Finding(Topic.CAPACITY, False,
                       f"fits now on {len(fitting)} node(s): {shown}")
    free_memory = sum(f.memory_mib for s in states if s.inventory.ready for f in s.free()
                      if f.gpu.healthy and not f.exclusive_taken
                      and request.allows_model(f.gpu.model))
    rejections = sorted((s.name, node_rejection(s, request) or "") for s in states)
    sample = "; ".join(f"{n}: {r}" for n, r in rejections[:3])
    more = f" (+{len(rejections) - 3} more nodes)" if len(rejections) > 3 else ""
    return Finding(Topic.CAPACITY, True,
                   f"no node has room now ({_gib(free_memory)} free GPU memory on suitable "
                   f"models in total); {sample or 'no GPU nodes'}{more}")


def _quota_findings(job: Obj, quota: Obj | None, fraction: float, now: float
                    ) -> list[Finding]:
    """The project's binding, guarantee and budget as they bear on `job`, judged by the
    operator's own rules (`core.quota`) on the quota's last published usage."""
    spec, meta = _spec(job), _meta(job)
    project = str(spec.get("project", ""))
    namespace = str(meta.get("namespace", ""))
    if quota is None:
        return [Finding(Topic.PROJECT, True,
                        f"there is no ProjectQuota named {project!r}; ask the platform team "
                        f"to create one (kubectl get projectquotas)")]
    view = quota_views([quota])[0]
    try:
        rules = quota_from_object(quota)
        subject = job_from_object(job, Phase.QUEUED, 0, (), "", ())
    except (ValueError, KeyError, TypeError) as err:
        return [Finding(Topic.PROJECT, True, f"ProjectQuota {project} cannot be read: {err}")]
    findings = []
    if binding_refusal(subject, {rules.name: rules}) is not None:
        findings.append(Finding(
            Topic.PROJECT, True,
            f"namespace {namespace} does not bill to project {project} (its namespaces: "
            f"{', '.join(view.namespaces)})"))
    if view.guaranteed_gpus is not None:
        ledger = ProjectLedger(rules, in_quota_gpus=max(0.0, view.running_gpus
                                                        - view.borrowed_gpus),
                               borrowed_gpus=view.borrowed_gpus, now=now)
        standing = judge(subject, ledger, fraction, 0, {}).standing
        text = (f"project {project} runs {fmt_number(view.running_gpus)} GPU(s) "
                f"({fmt_number(view.borrowed_gpus)} borrowed) of "
                f"{fmt_number(view.guaranteed_gpus)} "
                f"guaranteed; this job needs {fmt_number(fraction)} more")
        if standing is not Standing.IN_QUOTA:
            if not rules.borrowing:
                text += "; over the guarantee and borrowing is off"
            elif not may_borrow(subject, rules):
                text += "; over the guarantee and only preemptible, non-interactive jobs borrow"
            elif standing is Standing.OVER_QUOTA:
                text += (f"; borrowing would pass the limit of "
                         f"{fmt_number(view.borrow_limit_gpus or 0.0)} GPU(s)")
            else:
                text += "; may borrow idle GPUs (preemptible)"
        findings.append(Finding(Topic.QUOTA, standing is Standing.OVER_QUOTA, text))
    else:
        findings.append(Finding(Topic.QUOTA, False,
                                f"project {project} has no concurrent GPU limit"))
    if view.budget_gpu_hours is not None:
        limit_text = spec.get("maxDuration") or spec.get("estimatedDuration")
        claims = budget_claims(rules, fraction, now, None, subject.limit_s)
        ledger = ProjectLedger(rules, used_gpu_hours=view.used_gpu_hours or 0.0, now=now)
        verdict = judge(subject, ledger, fraction, 0, claims)
        remaining = view.remaining_gpu_hours
        text = (f"budget {fmt_number(view.budget_gpu_hours)} GPU-hours per {view.period}: "
                f"{fmt_number(view.used_gpu_hours)} used, {fmt_number(remaining)} remaining")
        if limit_text:
            text += (f"; this job may use {fmt_number(sum(claims.values()))} "
                     f"({fmt_number(fraction)} GPU x {limit_text})")
        if view.period_end:
            text += f"; refills {relative(epoch_of(view.period_end), now)}"
        spent = verdict.standing is Standing.OVER_BUDGET or verdict.budget_exhausted
        if spent and rules.on_budget_exhausted is BudgetPolicy.PREEMPTIBLE_ONLY:
            text += "; once spent, only preemptible non-interactive jobs run"
        findings.append(Finding(Topic.BUDGET, verdict.standing is Standing.OVER_BUDGET, text))
    else:
        findings.append(Finding(Topic.BUDGET, False, f"project {project} has no GPU-hour budget"))
    return findings


UNSEEN_NAMESPACES = ("which nodes have room now and the jobs ahead are not shown: they need "
                     "every namespace's GpuJobs and pods, which you may not list (the "
                     "operator's reason, position and estimate above count them)")


def _size_findings(job: Obj, request: GpuRequest, jobs: Iterable[Obj]) -> list[Finding]:
    """What the job's template's finished runs peaked at, where a smaller request would do
    (`core.right_sizing`); nothing without such runs."""
    spec = _spec(job)
    template = job_template(str(_meta(job).get("name", "")), first_image(spec))
    project = str(spec.get("project") or "")
    seen = {job_key(j): j for j in jobs}  # (the same job may come twice)
    for advice in size_advice(seen.values()):
        if (advice.project, advice.template) == (project, template) and \
                advice.recommended_mib < request.memory_mib:
            return [Finding(Topic.SIZE, False, (
                f"{advice.runs} finished runs of {template} peaked at "
                f"{advice.peak_mib / 1024:.1f} GiB (90th percentile); asking for "
                f"{advice.recommended_mib // 1024} GiB instead of "
                f"{request.memory_mib // 1024} GiB would fit more GPUs"))]
    return []


def explain(job: Obj, quota: Obj | None, jobs: Iterable[Obj] | None, gpunodes: Iterable[Obj],
            pods: Iterable[Obj] | None, now: float, history: Iterable[Obj] = ()
            ) -> Explanation:
    """Why `job` waits: the operator's own reason, then quota, budget, capacity and
    constraints recomputed from the objects, each with its numbers. `jobs` and `pods` are
    every namespace's, or None where the reader may not list them all (a namespace's user):
    then the jobs ahead and which nodes have room are not shown, rather than counted from
    one namespace and wrong. `history`: GpuJobs whose finished runs say what the job's
    template really uses (right-sizing), beside `jobs`."""
    status, spec = _status(job), _spec(job)
    key = job_key(job)
    phase = str(status.get("phase") or "")
    findings: list[Finding] = []
    if phase and phase not in WAITING_PHASES:
        text = f"{key} is {phase}"
        if status.get("node"):
            text += f" on {status['node']}"
        since = epoch_of(status.get("startTime") or status.get("admitTime"))
        if since is not None and phase not in FINISHED_PHASES:
            text += f" since {relative(since, now)}"
        if status.get("gpuHours") is not None:
            text += f"; {fmt_number(_number(status.get('gpuHours')), 3)} GPU-hours so far"
        if status.get("message"):
            text += f" ({status['message']})"
        return Explanation(key, phase, False, text + "; it is not waiting",
                           (Finding(Topic.STATUS, False, text),))

    reason = str(status.get("reason") or "")
    summary = f"{key} waits: {reason or NO_REASON_YET}"
    if status.get("message"):
        summary += f" - {status['message']}"
    findings.append(Finding(Topic.STATUS, bool(reason), summary))
    position = status.get("queuePosition")
    estimate = epoch_of(status.get("estimatedStart"))
    if isinstance(position, int) and position > 0:
        ahead_text = ""
        if jobs is not None:
            ahead = [w for w in waiting_jobs(jobs)
                     if w.position is not None and w.position < position]
            ahead_text = (f"{len(ahead)} job(s) ahead asking for "
                          f"{sum(w.gpus for w in ahead)} GPU(s); ")
        findings.append(Finding(
            Topic.QUEUE, False,
            f"queue position {position}; {ahead_text}estimated start {relative(estimate, now)}"
            + (f" ({status['estimatedStart']})" if estimate is not None else "")
            + (f", 80 % range {low_high}" if (low_high := relative_range(_range(status), now))
               else "")))
    try:
        # (GpuNodes carry no Node labels: the nodeSelector is the operator's to check, and its
        # NoMatchingNode reason above says when no node has them)
        request = replace(gpu_request_from_spec(spec), node_selector=frozenset())
        workers = worker_requests_from_spec(spec)
    except ValueError as err:
        findings.append(Finding(Topic.CONSTRAINTS, True, f"the spec cannot be read: {err}"))
        return Explanation(key, phase or "Queued", True, summary, tuple(findings))

    inventories, stale, problems = _inventories(gpunodes, now)
    reference = max((g.memory_total_mib for inv in inventories for g in inv.gpus),
                    default=max(GPU_MODEL_MEMORY_MIB.values()))
    fraction = nominal_fraction(request, reference)
    if workers:  # a gang: each worker must fit a node; the project pays for all of them
        request = replace(max(workers, key=lambda r: (r.count, r.memory_mib)),
                          node_selector=frozenset())
        fraction = sum(nominal_fraction(w, reference) for w in workers)
        findings.append(Finding(
            Topic.CONSTRAINTS, False,
            f"a gang of {len(workers)} workers, {sum(w.count for w in workers)} GPUs in all, "
            f"started all or nothing; each worker needs its GPUs on one node"))
    findings.extend(_quota_findings(job, quota, fraction, now))
    if pods is None:
        findings.append(Finding(Topic.CAPACITY, False, UNSEEN_NAMESPACES))
    else:
        shares = assignments_by_gpu(pods)
        states = [NodeState(inv, _grants_on(inv, shares)) for inv in inventories]
        findings.append(_capacity_finding(request, states))
    findings.extend(_sharing_findings(job, request, reason, jobs))
    findings.extend(_constraint_findings(request, inventories))
    findings.extend(_size_findings(job, request, [*(jobs or ()), *history]))
    if stale:
        findings.append(Finding(Topic.CAPACITY, False,
                                f"{len(stale)} GPU node(s) have a stale heartbeat (no report "
                                f"from their device plugin for over 2 min; placement still "
                                f"uses their last one): {', '.join(sorted(stale)[:5])}"))
    findings.extend(Finding(Topic.CAPACITY, False, f"unreadable GpuNode: {p}") for p in problems)
    return Explanation(key, phase or "Queued", True, summary, tuple(findings))
