"""The operator's Prometheus metrics (`carpool_*`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from carpool.core import eta_accuracy, service_levels
from carpool.core.eta_accuracy import FirstStart
from carpool.core.preemption import PreemptionCause
from carpool.core.resources import JobClass

QUEUE_LENGTH = Gauge("carpool_queue_length", "Waiting GpuJobs", ["project", "job_class"])
WAIT_SECONDS = Histogram(
    "carpool_wait_seconds", "Time from submission to admission", ["project", "job_class"],
    buckets=(1, 5, 15, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 86400))
ADMISSIONS = Counter("carpool_admissions_total", "GpuJobs admitted", ["project", "job_class"])
PREEMPTIONS = Counter("carpool_preemptions_total", "GpuJobs preempted", ["project", "cause"])
JOBS_STOPPED = Counter("carpool_jobs_stopped_total",
                       "running GpuJobs the operator stopped, by reason (MaxDurationExceeded, "
                       "IdleTimeout: an interactive session whose GPUs did no work)",
                       ["project", "reason"])
STRAYS_STOPPED = Counter("carpool_stray_pods_stopped_total",
                         "GPU pods stopped for being no live GpuJob's current attempt",
                         ["reason"])
GPU_HOURS = Gauge("carpool_project_gpu_hours", "GPU-hours used this budget period", ["project"])
BUDGET_REMAINING = Gauge("carpool_project_budget_remaining_gpu_hours",
                         "GPU-hours left this period (absent: no budget)", ["project"])
RUNNING_GPUS = Gauge("carpool_project_running_gpus", "GPU equivalents held", ["project"])
# Serving jobs' measures (carpool.core.service_levels), per scope (job, project, class, node)
# and its key; refreshed each pass from the running jobs' reports.
SERVICE_THROUGHPUT = Gauge("carpool_service_scope_throughput",
                           "Successful requests per second of the running jobs reporting them",
                           ["scope", "key"])
SERVICE_P99 = Gauge("carpool_service_scope_p99_latency_seconds",
                    "99th-percentile request latency, from the jobs' summed histograms",
                    ["scope", "key"])
SERVICE_FAILURE_RATIO = Gauge("carpool_service_scope_failure_ratio",
                              "Failed requests over all finished ones", ["scope", "key"])
# Lending (carpool.core.lending)
LENT_GPU_HOURS = Counter(
    "carpool_lent_gpu_hours_total",
    "GPU-hours jobs ran in GPU memory other jobs lent, by the borrower's project (summed "
    "pass by pass)", ["project"])
OWNER_RECLAIM_SECONDS = Histogram(
    "carpool_owner_reclaim_seconds",
    "From the decision to give an owner its lent memory back to the borrower off the GPU",
    buckets=(1, 2, 5, 10, 15, 30, 45, 60, 120, 300))
PASS_SECONDS = Histogram("carpool_reconcile_pass_seconds", "Duration of one reconcile pass",
                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

# How good the estimated starts are, scored once per job when its first run starts, by the
# replay's rule (carpool.core.eta_accuracy): see docs/operations.md.
ETA_FIRST_STARTS = Counter(
    "carpool_eta_first_starts_total",
    "Jobs whose first run started, by whether their first estimate was scored (false: "
    "started without one) and whether they waited under 60 s (short) or longer (long)",
    ["job_class", "scored", "wait"])
ETA_RELATIVE_ERROR = Histogram(
    "carpool_eta_first_estimate_relative_error",
    "|first estimated start - first start| / wait, jobs that waited at least 60 s",
    ["job_class"], buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5))
ETA_MISSES = Counter(
    "carpool_eta_first_estimate_misses_total",
    "Jobs that waited at least 60 s, by whether they started later or earlier than first said",
    ["job_class", "direction"])
ETA_SHORT_WAIT_ERROR = Histogram(
    "carpool_eta_first_estimate_short_wait_error_seconds",
    "|first estimated start - first start| in seconds, jobs that waited under 60 s",
    ["job_class"], buckets=(1, 2, 5, 10, 15, 30, 60, 120, 300, 600))
ETA_RANGE = Counter(
    "carpool_eta_first_range_total",
    "Jobs that waited at least 60 s with a range shown with their first estimate, by where "
    "the first start fell: inside, before or after it", ["job_class", "result"])


def observe_first_start(job_class: str, first: FirstStart) -> None:
    """One job's first start, and its first estimate against it (call once per job)."""
    ETA_FIRST_STARTS.labels(job_class, "true" if first.scored else "false", first.wait).inc()
    score = first.score
    if score is None:
        return
    if score.short_error_s is not None:
        ETA_SHORT_WAIT_ERROR.labels(job_class).observe(score.short_error_s)
        return
    if score.relative is not None:
        ETA_RELATIVE_ERROR.labels(job_class).observe(score.relative)
    if score.direction is not None:
        ETA_MISSES.labels(job_class, score.direction).inc()
    if score.range_result is not None:
        ETA_RANGE.labels(job_class, score.range_result).inc()


def observe_services(gpujobs: Iterable[Mapping[str, Any]]) -> None:
    """The running jobs' service measures, per job, project, class and node."""
    measured = [m for m in map(service_levels.measured_of, gpujobs) if m is not None]
    for gauge in (SERVICE_THROUGHPUT, SERVICE_P99, SERVICE_FAILURE_RATIO):
        gauge.clear()
    for scope in service_levels.Scope.ALL:
        for summary in service_levels.aggregate(measured, scope):
            SERVICE_THROUGHPUT.labels(scope, summary.key).set(summary.throughput)
            if summary.p99_s is not None:
                SERVICE_P99.labels(scope, summary.key).set(summary.p99_s)
            SERVICE_FAILURE_RATIO.labels(scope, summary.key).set(summary.failure_rate)


def known_label_values(projects: Iterable[str]) -> None:
    """Every series of the counters and histograms for the label values known up front, at
    0, so `rate` and `increase` read 0 until the first event rather than nothing (a series
    is otherwise born only with its first event)."""
    classes = [c.label for c in JobClass]
    for project in projects:
        for cause in PreemptionCause:
            PREEMPTIONS.labels(project, cause.value)
        for cls in classes:
            ADMISSIONS.labels(project, cls)
            WAIT_SECONDS.labels(project, cls)
    for cls in classes:
        for scored in ("true", "false"):
            for wait in (eta_accuracy.SHORT_WAIT, eta_accuracy.LONG_WAIT):
                ETA_FIRST_STARTS.labels(cls, scored, wait)
        ETA_RELATIVE_ERROR.labels(cls)
        ETA_SHORT_WAIT_ERROR.labels(cls)
        for direction in (eta_accuracy.LATE, eta_accuracy.EARLY, eta_accuracy.ON_TIME):
            ETA_MISSES.labels(cls, direction)
        for result in (eta_accuracy.INSIDE, eta_accuracy.BEFORE, eta_accuracy.AFTER):
            ETA_RANGE.labels(cls, result)
