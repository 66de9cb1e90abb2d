"""The operator's Prometheus metrics (`carpool_*`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_LENGTH = Gauge("carpool_queue_length", "Waiting GpuJobs", ["project", "job_class"])
WAIT_SECONDS = Histogram(
    "carpool_wait_seconds", "Time from submission to admission", ["project", "job_class"],
    buckets=(1, 5, 15, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 86400))
ADMISSIONS = Counter("carpool_admissions_total", "GpuJobs admitted", ["project", "job_class"])
PREEMPTIONS = Counter("carpool_preemptions_total", "GpuJobs preempted", ["project", "cause"])
GPU_HOURS = Gauge("carpool_project_gpu_hours", "GPU-hours used this budget period", ["project"])
BUDGET_REMAINING = Gauge("carpool_project_budget_remaining_gpu_hours",
                         "GPU-hours left this period (absent: no budget)", ["project"])
RUNNING_GPUS = Gauge("carpool_project_running_gpus", "GPU equivalents held", ["project"])
PASS_SECONDS = Histogram("carpool_reconcile_pass_seconds", "Duration of one reconcile pass",
                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
