"""GpuJob and ProjectQuota objects (dicts from the API) into the core's dataclasses.

Everything the API server's schema already guarantees is trusted; what it cannot check
(quantities that parse, MIG profile names) raises ValueError with the field's path, which
the operator shows as the job's Failed reason. The operator and the reports
(`carpool.reporting`, `kubectl carpool`) read the objects through these same functions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeGuard

from carpool.core.checkpointing import reported_state
from carpool.core.durations import parse_duration
from carpool.core.estimate_ranges import recent_misses
from carpool.core.eta_accuracy import FirstStart, score_first_start
from carpool.core.gangs import MAX_GANG_GPUS, MAX_WORKERS, WorkerPlacement
from carpool.core.jobs import (
    BudgetPolicy,
    ClassLimit,
    DurationEstimate,
    Job,
    ProjectQuota,
    RetiredUsage,
    RunRecord,
    StartMiss,
    job_template,
)
from carpool.core.lifecycle import grants_from_status, requeue_not_before
from carpool.core.quantities import quantity_mib
from carpool.core.resources import GpuGrant, GpuRequest, Isolation, JobClass, Objectives, Phase
from carpool.core.timestamps import epoch_of, epoch_seconds, format_timestamp
from carpool.core.topology import TopologyLevel, TopologyMode, TopologyNeed

_MIG_PROFILE = re.compile(r"^([1-7])g\.([0-9]+)gb$")


def gpu_request_from_spec(spec: Mapping[str, Any]) -> GpuRequest:
    """The GpuRequest of a GpuJob spec."""
    gpu = spec.get("gpu") or {}
    isolation = Isolation.parse(str(gpu.get("isolation", "mps")))
    try:
        memory_mib = quantity_mib(gpu.get("memory", 0))
    except ValueError as err:
        raise ValueError(f"spec.gpu.memory: {err}") from None
    mig_slices = 0
    if isolation is Isolation.MIG and gpu.get("migProfile"):
        match = _MIG_PROFILE.match(str(gpu["migProfile"]))
        if not match:
            raise ValueError(f"spec.gpu.migProfile: want e.g. '1g.18gb', got {gpu['migProfile']!r}")
        mig_slices = int(match.group(1))  # memory is matched by spec.gpu.memory, not the name
    return GpuRequest(
        count=int(gpu.get("count", 1)),
        memory_mib=memory_mib,
        cores_pct=int(gpu.get("cores", 0) or 0),
        isolation=isolation,
        models=frozenset(str(m) for m in gpu.get("models") or ()),
        mig_slices=mig_slices,
        node_selector=frozenset(
            (str(k), str(v)) for k, v in
            ((((spec.get("template") or {}).get("spec") or {}).get("nodeSelector")) or {}).items()),
        objectives=objectives_from_spec(spec),
    )


def objectives_from_spec(spec: Mapping[str, Any]) -> Objectives | None:
    """spec.objectives, or None when the job makes no promise."""
    raw = spec.get("objectives")
    if not isinstance(raw, Mapping) or not raw:
        return None
    p99: float | None = None
    if raw.get("p99Latency") is not None:
        try:
            p99 = parse_duration(str(raw["p99Latency"]))
        except ValueError as err:
            raise ValueError(f"spec.objectives.p99Latency: {err}") from None
    slowdown = raw.get("maxSlowdown")
    if slowdown is not None and (isinstance(slowdown, bool)
                                 or not isinstance(slowdown, int | float)):
        raise ValueError(f"spec.objectives.maxSlowdown must be a number, got {slowdown!r}")
    return Objectives(p99, None if slowdown is None else float(slowdown))


def worker_requests_from_spec(spec: Mapping[str, Any]) -> tuple[GpuRequest, ...]:
    """One GpuRequest per worker of a gang (spec.workers), in rank order: each group's
    replicas in the order listed, each with spec.gpu's shape but the count, memory and cores
    its group names. Empty for a one-pod job. ValueError naming the field past the limits
    (`gangs.MAX_WORKERS`, `gangs.MAX_GANG_GPUS`), which the CRD enforces too."""
    groups = spec.get("workers") or ()
    if not groups:
        return ()
    base = gpu_request_from_spec(spec)
    out: list[GpuRequest] = []
    for n, group in enumerate(groups):
        where = f"spec.workers[{n}]"
        gpu = group.get("gpu") or {}
        try:
            memory_mib = quantity_mib(gpu["memory"]) if gpu.get("memory") else base.memory_mib
        except ValueError as err:
            raise ValueError(f"{where}.gpu.memory: {err}") from None
        request = replace(base, count=int(gpu.get("count", base.count)), memory_mib=memory_mib,
                          cores_pct=int(gpu.get("cores", base.cores_pct) or 0))
        replicas = int(group.get("replicas", 1))
        if replicas < 1:
            raise ValueError(f"{where}.replicas must be at least 1, got {replicas}")
        out.extend([request] * replicas)
    if len(out) > MAX_WORKERS:
        raise ValueError(f"spec.workers: a gang has at most {MAX_WORKERS} workers, got {len(out)}")
    if (gpus := sum(r.count for r in out)) > MAX_GANG_GPUS:
        raise ValueError(f"spec.workers: a gang asks for at most {MAX_GANG_GPUS} GPUs, "
                         f"got {gpus}")
    return tuple(out)


def worker_names_from_spec(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """Each worker's group name, in rank order (parallel to `worker_requests_from_spec`)."""
    return tuple(str(group.get("name", "")) for group in spec.get("workers") or ()
                 for _ in range(int(group.get("replicas", 1))))


def placements_from_status(status: Mapping[str, Any], exclusive: bool = False
                           ) -> tuple[WorkerPlacement, ...]:
    """A gang's workers as `status.workers` records them (rank order); empty when it
    records none."""
    raw = status.get("workers") or ()
    out = []
    for entry in sorted((e for e in raw if isinstance(e, Mapping)),
                        key=lambda e: int(e.get("rank", 0))):
        out.append(WorkerPlacement(str(entry.get("node") or ""),
                                   grants_from_status(entry.get("gpus"), exclusive)))
    return tuple(out)


def topology_from_spec(spec: Mapping[str, Any]) -> TopologyNeed | None:
    """spec.topology, or None when the job names none."""
    raw = spec.get("topology")
    if not raw:
        return None
    try:
        return TopologyNeed(TopologyLevel.parse(str(raw.get("level", ""))),
                            TopologyMode.parse(str(raw.get("mode", "preferred"))))
    except ValueError as err:
        raise ValueError(f"spec.topology: {err}") from None


DEFAULT_ESTIMATE_S = {
    JobClass.INTERACTIVE: 3600.0, JobClass.SHORT: 3600.0,
    JobClass.LONG: 12 * 3600.0, JobClass.BATCH: 4 * 3600.0,
}


def _seconds(spec: Mapping[str, Any], path: str, default: float = 0.0) -> float:
    node: Any = spec
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if not node:
        return default
    try:
        return parse_duration(str(node))
    except ValueError as err:
        raise ValueError(f"spec.{path}: {err}") from None


def runs_from_history(history: Sequence[Mapping[str, Any]]) -> tuple[RunRecord, ...]:
    runs = []
    for record in history:
        start = epoch_seconds(record.get("start"))
        if start is None:
            continue
        end = epoch_seconds(record.get("end"))
        runs.append(RunRecord(attempt=int(record.get("attempt", 0)), start=start,
                              end=max(end, start) if end is not None else None,
                              fraction=float(record.get("fraction", 0.0)),
                              node=str(record.get("node", ""))))
    return tuple(runs)


def job_from_object(obj: Mapping[str, Any], phase: Phase, attempts: int,
                    grants: tuple[GpuGrant, ...], node: str,
                    history: Sequence[Mapping[str, Any]]) -> Job:
    """A core Job from a GpuJob object and the state its pods show (see core.lifecycle)."""
    meta = obj["metadata"]
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    job_class = JobClass.parse(str(spec.get("class", "batch")))
    submitted = (epoch_seconds(status.get("submitTime"))
                 or epoch_seconds(meta.get("creationTimestamp")))
    reported = reported_state(status, attempts)
    return Job(
        key=f"{meta['namespace']}/{meta['name']}",
        project=str(spec.get("project", "")),
        job_class=job_class,
        request=gpu_request_from_spec(spec),
        submitted_at=submitted or 0.0,
        estimated_duration_s=_seconds(spec, "estimatedDuration",
                                      DEFAULT_ESTIMATE_S[job_class]) or 1.0,
        max_duration_s=_seconds(spec, "maxDuration"),
        preemptible=bool(spec.get("preemptible", False)),
        checkpoint_grace_s=_seconds(spec, "checkpoint.gracePeriod", 30.0),
        min_runtime_s=_seconds(spec, "checkpoint.minRuntime"),
        last_checkpoint_at=reported.last_checkpoint_at,
        progress=reported.progress,
        progress_at=reported.progress_at,
        resumed_progress=reported.resumed_progress,
        progress_detail=reported.progress_detail,
        phase=phase,
        attempts=attempts,
        node=node,
        grants=grants,
        borrowed=bool(status.get("borrowed", False)),
        runs=runs_from_history(history),
        peak_memory_mib=status.get("peakMemoryMiB"),
        last_gpu_activity=epoch_of(status.get("lastGpuActivity")),
        calibration_outgrown=bool(status.get("calibrationOutgrown", False)),
        template=job_template(str(meta["name"]), first_image(spec)),
        first_estimated_start=epoch_of(status.get("firstEstimatedStart")),
        first_simulated_start=epoch_of(status.get("firstSimulatedStart")),
        not_before=requeue_not_before(history),
        workers=worker_requests_from_spec(spec),
        topology=topology_from_spec(spec),
    )


def first_start(obj: Mapping[str, Any], status: Mapping[str, Any]
                ) -> tuple[JobClass, FirstStart] | None:
    """The job's class and its first start as `status` records it (`startTime`), from its
    `submitTime` (the object's creation if absent), scored against its first estimate
    (`firstEstimatedStart`, with the range `firstEstimatedStartEarliest`..
    `firstEstimatedStartLatest` where one was shown) where it had one; None without a first
    start, or with a class that does not parse (such a job never runs)."""
    start = epoch_of(status.get("startTime"))
    submitted = (epoch_of(status.get("submitTime"))
                 or epoch_of(obj["metadata"].get("creationTimestamp")))
    if start is None or submitted is None:
        return None
    try:
        job_class = JobClass.parse(str((obj.get("spec") or {}).get("class", "batch")))
    except ValueError:
        return None
    return job_class, score_first_start(
        submitted, start, epoch_of(status.get("firstEstimatedStart")),
        epoch_of(status.get("firstEstimatedStartEarliest")),
        epoch_of(status.get("firstEstimatedStartLatest")))


def first_image(spec: Mapping[str, Any]) -> str:
    """The first container's image (what the job runs), or ""."""
    pod = (spec.get("template") or {}).get("spec") or {}
    containers = pod.get("containers") or []
    return str((containers[0] or {}).get("image") or "") if containers else ""


def quota_from_object(obj: Mapping[str, Any]) -> ProjectQuota:
    """A core ProjectQuota from a ProjectQuota object."""
    meta = obj["metadata"]
    spec = obj.get("spec") or {}
    hours = spec.get("gpuHours") or {}
    concurrent = spec.get("concurrent") or {}
    borrowing = spec.get("borrowing") or {}
    memory = concurrent.get("memory")
    return ProjectQuota(
        name=meta["name"],
        namespaces=frozenset(spec.get("namespaces") or ()),
        guaranteed_gpus=float(concurrent["gpus"]) if "gpus" in concurrent else None,
        guaranteed_memory_mib=quantity_mib(memory) if memory is not None else None,
        borrowing=bool(borrowing.get("enabled", False)),
        borrow_limit_gpus=float(borrowing["maxGpus"]) if "maxGpus" in borrowing else None,
        budget_gpu_hours=float(hours["budget"]) if "budget" in hours else None,
        period_s=_seconds(spec, "gpuHours.period", 30 * 86400.0),
        period_anchor=epoch_seconds(hours.get("periodAnchor"))
        or epoch_seconds(meta.get("creationTimestamp")) or 0.0,
        on_budget_exhausted=BudgetPolicy.parse(str(hours.get("onExhausted", "Hold"))),
        weight=float(spec.get("weight", 1.0)),
        class_limits=class_limits_from_spec(spec),
        idle_session_timeout_s=_seconds(spec, "idleSessions.timeout", 0.0),
        idle_session_yield_after_s=_seconds(spec, "idleSessions.yieldAfter", 0.0),
        place_calibrated=bool((spec.get("rightSizing") or {}).get("placePreemptible", False)),
        share_whole_gpus=bool((spec.get("rightSizing") or {}).get("shareWholeGpus", False)),
    )


def class_limits_from_spec(spec: Mapping[str, Any]) -> tuple[ClassLimit, ...]:
    """A ProjectQuota's spec.classLimits, one ClassLimit per class named."""
    limits = []
    for name, given in sorted((spec.get("classLimits") or {}).items()):
        at = f"classLimits.{name}"
        memory = given.get("minGpuMemory")
        limits.append(ClassLimit(
            job_class=JobClass.parse(name),
            max_gpus=int(given["maxGpus"]) if "maxGpus" in given else None,
            max_duration_s=_seconds(spec, f"{at}.maxDuration") or None,
            max_grace_s=_seconds(spec, f"{at}.maxGracePeriod") or None,
            min_gpu_memory_mib=quantity_mib(memory) if memory is not None else None,
            min_gpu_cores_pct=int(given["minGpuCores"]) if "minGpuCores" in given else None))
    return tuple(limits)


_ESTIMATE_FIELDS = (  # DurationEstimate field <-> status name, in status order
    ("samples", "samples"), ("seconds", "seconds"), ("ratio", "ratio"),
    ("log_seconds", "logSeconds"), ("log_ratio", "logRatio"),
    ("error_seconds", "errorSeconds"), ("error_ratio", "errorRatio"),
    ("low", "low"), ("high", "high"))


def retired_from_status(project: str, status: Mapping[str, Any] | None
                        ) -> tuple[RetiredUsage | None, list[str]]:
    """The retired usage a ProjectQuota's status keeps (deleted jobs' GPU-hours, learned run
    times and how their estimates missed), and what in it was malformed.

    The status is the operator's own, but an admin can edit it: a bad field or entry is left
    out (a number counts as 0) and named in the problems, never raised, so a hand-edited
    quota cannot stop every reconcile pass."""
    raw = (status or {}).get("retired")
    if raw is None:
        return None, []
    if not isinstance(raw, Mapping):
        return None, ["status.retired: not an object; ignored"]
    problems: list[str] = []

    def number(name: str) -> float:
        value = raw.get(name, 0.0)
        if _finite(value) and value >= 0:
            return float(value)
        problems.append(f"status.retired.{name}: {value!r} is not a non-negative number; "
                        "counted as 0")
        return 0.0

    def stamp(name: str) -> float:
        value = epoch_of(raw.get(name))
        if value is None and raw.get(name) is not None:
            problems.append(f"status.retired.{name}: {raw.get(name)!r} is not an RFC 3339 "
                            "time; ignored")
        return value or 0.0

    jobs = raw.get("jobs") or []
    if not isinstance(jobs, list):
        problems.append("status.retired.jobs: not a list; ignored")
        jobs = []
    retired = RetiredUsage(
        period_start=stamp("periodStart"),
        gpu_hours=number("gpuHours"),
        decayed_gpu_hours=number("decayedGpuHours"),
        decayed_as_of=stamp("decayedAsOf"),
        job_keys=frozenset(str(k) for k in jobs),
        learned=_learned_from_status(project, raw.get("learned"), problems),
        start_misses=_misses_from_status(raw.get("startMisses"), problems),
    )
    return retired, problems


def _finite(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def _learned_from_status(project: str, raw: object, problems: list[str]
                         ) -> dict[tuple[str, JobClass | str], DurationEstimate]:
    learned: dict[tuple[str, JobClass | str], DurationEstimate] = {}
    if raw is None:
        return learned
    if not isinstance(raw, list):
        problems.append("status.retired.learned: not a list; ignored")
        return learned
    for i, entry in enumerate(raw):
        where = f"status.retired.learned[{i}]"
        try:
            key, estimate = _learned_entry(project, entry)
        except ValueError as err:
            problems.append(f"{where}: {err}; entry ignored")
            continue
        learned.pop(key, None)  # a key listed twice: the later entry is the newer one
        learned[key] = estimate
    return learned


def _learned_entry(project: str, entry: object
                   ) -> tuple[tuple[str, JobClass | str], DurationEstimate]:
    if not isinstance(entry, Mapping):
        raise ValueError("not an object")
    cls, template = entry.get("class"), entry.get("template")
    if (cls is None) == (template is None):
        raise ValueError("needs exactly one of class and template")
    if template is not None and not (isinstance(template, str) and template):
        raise ValueError(f"template {template!r} is not a non-empty string")
    key: tuple[str, JobClass | str] = (
        (project, JobClass.parse(str(cls))) if cls is not None else (project, str(template)))
    values: dict[str, float] = {}
    for field_name, status_name in _ESTIMATE_FIELDS:
        value = entry.get(status_name)
        if not _finite(value):
            raise ValueError(f"{status_name} {value!r} is not a number")
        values[field_name] = float(value)
    if values["samples"] < 1 or values["samples"] != int(values["samples"]):
        raise ValueError(f"samples {entry.get('samples')!r} is not a positive integer")
    if values["seconds"] <= 0 or values["ratio"] <= 0:
        raise ValueError("seconds and ratio must be positive")
    samples = int(values.pop("samples"))
    return key, DurationEstimate(samples=samples, **values)


def _misses_from_status(raw: object, problems: list[str]) -> tuple[StartMiss, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.append("status.retired.startMisses: not a list; ignored")
        return ()
    misses = []
    for i, entry in enumerate(raw):
        fields = entry if isinstance(entry, Mapping) else {}
        try:
            job_class: JobClass | None = JobClass.parse(str(fields.get("class")))
        except ValueError:
            job_class = None
        start = epoch_of(fields.get("start"))
        shown, simulated = fields.get("shown"), fields.get("simulated")
        if (job_class is None or start is None or not (_finite(shown) or _finite(simulated))
                or not all(v is None or _finite(v) for v in (shown, simulated))):
            problems.append(f"status.retired.startMisses[{i}]: want {{start: RFC 3339 time, "
                            f"class: one of {', '.join(c.label for c in JobClass)}, shown "
                            f"and/or simulated: number}}, got {entry!r}; entry ignored")
            continue
        misses.append(StartMiss(start, job_class, None if shown is None else float(shown),
                                None if simulated is None else float(simulated)))
    return recent_misses(misses)


def retired_to_status(retired: RetiredUsage) -> dict[str, Any]:
    """The ProjectQuota status field `retired` (read back by `retired_from_status`). Learned
    run times keep full precision: rounded, a restarted operator would estimate other starts
    than the one before it for the same history."""
    learned = []
    for (_, key), estimate in retired.learned.items():
        entry: dict[str, Any] = ({"class": key.label} if isinstance(key, JobClass)
                                 else {"template": key})
        for field_name, status_name in _ESTIMATE_FIELDS:
            entry[status_name] = getattr(estimate, field_name)
        learned.append(entry)
    return {"periodStart": format_timestamp(retired.period_start),
            "gpuHours": round(retired.gpu_hours, 6),
            "decayedGpuHours": round(retired.decayed_gpu_hours, 6),
            "decayedAsOf": format_timestamp(retired.decayed_as_of),
            "jobs": sorted(retired.job_keys),
            "learned": learned,
            "startMisses": [_miss_to_status(m) for m in retired.start_misses]}


def _miss_to_status(miss: StartMiss) -> dict[str, Any]:
    entry: dict[str, Any] = {"start": format_timestamp(miss.start), "class": miss.job_class.label}
    if miss.shown is not None:
        entry["shown"] = miss.shown
    if miss.simulated is not None:
        entry["simulated"] = miss.simulated
    return entry
