"""Snapshots of GpuJobs and ProjectQuotas as the admission core sees them.

The operator decodes its custom resources into these frozen dataclasses once per admission
cycle; the core never sees a Kubernetes object. Times are epoch seconds, durations seconds,
GPU memory MiB, GPU usage "GPU equivalents" (the fraction of a GPU held, as in `gpuhours`).
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from carpool.core.gangs import WorkerPlacement
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, GpuRequest, JobClass, Phase
from carpool.core.topology import TopologyNeed


class BudgetPolicy(enum.Enum):
    """What a project's jobs may do once its GPU-hour budget for the period is spent."""

    HOLD = "Hold"  # nothing new starts until the budget refills
    PREEMPTIBLE_ONLY = "PreemptibleOnly"  # preemptible jobs may still run, as borrowers

    @classmethod
    def parse(cls, text: str) -> BudgetPolicy:
        try:
            return cls(text)
        except ValueError:
            raise ValueError(
                f"unknown budget policy {text!r}; expected one of {', '.join(p.value for p in cls)}"
            ) from None


@dataclass(frozen=True)
class RunRecord:
    """One attempt's time on GPUs, as recorded in the job's status.

    `fraction` is the GPU equivalents held (sum of `gpuhours.gpu_fraction` over the grants),
    fixed when the run starts. `end` is None while the run goes on. Records are keyed by
    `attempt`, so re-reading the same status never counts a run twice.
    """

    attempt: int
    start: float
    end: float | None
    fraction: float
    node: str = ""

    def __post_init__(self) -> None:
        if self.end is not None and self.end < self.start:
            raise ValueError(
                f"run {self.attempt} ends ({self.end}) before it starts ({self.start})")
        if self.fraction < 0:
            raise ValueError(f"run {self.attempt} has a negative GPU fraction {self.fraction}")


@dataclass(frozen=True)
class ProgressDetail:
    """What a job's latest progress report says beyond the fraction done
    (`checkpointing.ProgressReport`): the phase it was in, the seconds its attempt spent
    paused (evaluating, saving) and its latest training samples (epoch seconds, fraction
    done), oldest first."""

    phase: str = "train"
    paused_s: float = 0.0
    recent: tuple[tuple[float, float], ...] = ()


_TRAILING_NUMBER = re.compile(r"[-_.]?[0-9]+$")


def name_stem(name: str) -> str:
    """A job's name without a trailing number: `train-resnet-7` and `train-resnet-8` are runs
    of one kind of job."""
    return _TRAILING_NUMBER.sub("", name) or name


def job_template(name: str, image: str = "") -> str:
    """What run-time learning groups a job by: its name's stem and its image."""
    stem = name_stem(name)
    return f"{stem}@{image}" if image else stem


@dataclass(frozen=True)
class DurationEstimate:
    """Exponentially weighted history of finished runs of one group of jobs (see `run_times`)."""

    seconds: float  # weighted mean actual run time
    ratio: float  # weighted mean of actual / estimated run time
    samples: int
    log_seconds: float = 0.0  # weighted mean of ln(actual run time)
    log_ratio: float = 0.0  # weighted mean of ln(actual / estimated)
    error_seconds: float = 0.0  # weighted mean |ln(actual / exp(log_seconds before it))|
    error_ratio: float = 0.0  # the same for the ratio predictor
    low: float = 0.0  # running P10 of ln(actual / predicted)
    high: float = 0.0  # running P90 of ln(actual / predicted)

    @property
    def uses_seconds(self) -> bool:
        """Predict from the typical run time (not the ratio) when it has erred no more."""
        return self.error_seconds <= self.error_ratio

    def predict(self, estimated_s: float) -> float:
        if self.uses_seconds:
            return math.exp(self.log_seconds)
        return estimated_s * math.exp(self.log_ratio)


@dataclass(frozen=True)
class Job:
    """A GpuJob: what it asks for and where it stands.

    `grants`/`node` are what the job holds (or was admitted with, until its pod is bound); the
    operator clears them once the job's pod is gone. A job in phase Preempted that still has
    grants is terminating (its checkpoint grace runs); without grants it is queued again.
    """

    key: str  # "namespace/name"
    project: str
    job_class: JobClass
    request: GpuRequest
    submitted_at: float
    estimated_duration_s: float
    max_duration_s: float = 0.0  # 0: no limit beyond the estimate (the estimate is used)
    preemptible: bool = False
    checkpoint_grace_s: float = 30.0
    min_runtime_s: float = 0.0  # never preempted before running this long
    last_checkpoint_at: float | None = None  # reported by the job (core.checkpointing)
    progress: float | None = None  # fraction done, as the current attempt last reported it
    progress_at: float | None = None  # when it reported it
    resumed_progress: float = 0.0  # the fraction done the current attempt started from
    progress_detail: ProgressDetail | None = None  # of that report: phase, pauses, samples
    phase: Phase = Phase.QUEUED
    attempts: int = 0  # admissions so far
    node: str = ""
    grants: tuple[GpuGrant, ...] = ()
    borrowed: bool = False
    runs: tuple[RunRecord, ...] = ()
    peak_memory_mib: int | None = None  # per GPU, as the device plugin saw it
    # when the device plugin last saw its pod's processes use its GPUs (its start if never);
    # None where its node's plugin does not measure that (core.queueing.idle_expiry)
    last_gpu_activity: float | None = None
    template: str = ""  # what it runs (image, or name without a trailing number): learning key
    # a run placed by its calibrated size failed: it is placed as asked from now on
    # (core.right_sizing.placement_request; status.calibrationOutgrown)
    calibration_outgrown: bool = False
    # placed by its calibrated size: the least it may be granted where no piece holds that
    # size, its template's measured peak without the headroom (core.right_sizing.
    # placement_floor; core.queueing places it into such a piece, granted the piece)
    placement_floor: GpuRequest | None = None
    # per GPU, the part of its grant it may lend (core.lending.lendable, from what was measured)
    lendable_mib: int = 0
    lendable_cores_pct: int = 0
    first_estimated_start: float | None = None  # the first estimate it was shown
    # that estimate as the forward simulation made it, before calibration
    # (estimate_ranges.calibrated_start)
    first_simulated_start: float | None = None
    # requeued after a failure not by its code: not admitted before this (lifecycle.
    # requeue_not_before); 0.0: no wait
    not_before: float = 0.0
    # a gang (spec.workers): one request per worker, in rank order, admitted all or nothing
    # (core.gangs); `request` is then rank 0's. Empty: one pod asking for `request`.
    workers: tuple[GpuRequest, ...] = ()
    topology: TopologyNeed | None = None  # where a gang's workers must or should go together
    # what each worker of a gang holds, in rank order (`node` and `grants` are then rank 0's
    # node and every worker's grants together)
    placements: tuple[WorkerPlacement, ...] = ()

    def __post_init__(self) -> None:
        if self.key.count("/") != 1 or not all(self.key.split("/")):
            raise ValueError(f"job key must be 'namespace/name', got {self.key!r}")
        if not (self.estimated_duration_s > 0 and math.isfinite(self.estimated_duration_s)):
            raise ValueError(f"{self.key}: estimated duration must be positive")
        if self.max_duration_s < 0:
            raise ValueError(f"{self.key}: max duration must not be negative")
        attempts = [r.attempt for r in self.runs]
        if len(set(attempts)) != len(attempts):
            raise ValueError(f"{self.key}: run records repeat an attempt: {sorted(attempts)}")

    @property
    def namespace(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def requests(self) -> tuple[GpuRequest, ...]:
        """One request per pod: a gang's workers, else the job's one request."""
        return self.workers or (self.request,)

    @property
    def gpu_count(self) -> int:
        """GPUs the job holds in all, over every pod."""
        return sum(r.count for r in self.requests)

    @property
    def name(self) -> str:
        return self.key.split("/", 1)[1]

    @property
    def limit_s(self) -> float:
        """The longest this job may run: maxDuration, or the estimate when none is set."""
        return self.max_duration_s if self.max_duration_s > 0 else self.estimated_duration_s

    @property
    def holds_gpus(self) -> bool:
        """Admitted, running, or preempted but still terminating."""
        if self.phase.holds_gpus:
            return True
        return self.phase is Phase.PREEMPTED and bool(self.grants)

    @property
    def terminating(self) -> bool:
        return self.phase is Phase.PREEMPTED and bool(self.grants)

    @property
    def waiting(self) -> bool:
        """In the queue: new, or preempted and gone from its GPUs."""
        return self.phase is Phase.QUEUED or (self.phase is Phase.PREEMPTED and not self.grants)

    @functools.cached_property
    def current_run(self) -> RunRecord | None:
        """The open run of the latest attempt (kept: a cycle asks for it of every holder
        many times)."""
        open_runs = [r for r in self.runs if r.end is None]
        return max(open_runs, key=lambda r: r.attempt) if open_runs else None

    @property
    def started_at(self) -> float | None:
        run = self.current_run
        return run.start if run else None


@dataclass(frozen=True)
class ClassLimit:
    """What the platform team lets one class of a project's jobs ask for (ProjectQuota
    spec.classLimits.<class>); None: not limited. The minimum grant keeps a job from being
    billed as nothing (a fraction of a MiB of GPU memory)."""

    job_class: JobClass
    max_gpus: int | None = None
    max_duration_s: float | None = None  # spec.maxDuration must be set and at most this
    max_grace_s: float | None = None  # spec.checkpoint.gracePeriod at most this
    min_gpu_memory_mib: int | None = None  # spec.gpu.memory per GPU at least this
    min_gpu_cores_pct: int | None = None  # spec.gpu.cores (when set) at least this


@dataclass(frozen=True)
class ProjectQuota:
    """A ProjectQuota: who bills to the project and what it may use.

    `guaranteed_gpus` (GPU equivalents) and `guaranteed_memory_mib` are the concurrent
    guarantee; None means that dimension is not limited. Beyond the guarantee a project runs
    only preemptible jobs, and only when `borrowing` is on (up to `borrow_limit_gpus` more GPU
    equivalents; None: no limit but idle capacity). `budget_gpu_hours` (None: no budget) refills
    every `period_s` seconds; periods start at `period_anchor + k * period_s`.
    """

    name: str
    namespaces: frozenset[str]
    guaranteed_gpus: float | None = None
    guaranteed_memory_mib: int | None = None
    borrowing: bool = False
    borrow_limit_gpus: float | None = None
    budget_gpu_hours: float | None = None
    period_s: float = 30 * 86400.0
    period_anchor: float = 0.0
    on_budget_exhausted: BudgetPolicy = BudgetPolicy.HOLD
    weight: float = 1.0
    class_limits: tuple[ClassLimit, ...] = ()
    # an interactive job whose GPUs see no work this long is stopped (0: never)
    idle_session_timeout_s: float = 0.0
    # ... and this long while a job waits that its GPUs could serve (0: only the timeout;
    # core.queueing.idle_expiry; spec.idleSessions.yieldAfter)
    idle_session_yield_after_s: float = 0.0
    # its waiting preemptible jobs are placed by their template's calibrated size
    # (core.right_sizing.placement_request; spec.rightSizing.placePreemptible)
    place_calibrated: bool = False
    # with place_calibrated, its one-GPU whole-GPU preemptible jobs too, as MPS shares
    # (core.right_sizing.shared_whole_gpu; spec.rightSizing.shareWholeGpus)
    share_whole_gpus: bool = False

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"project {self.name}: weight must be positive")
        if not self.period_s > 0:
            raise ValueError(f"project {self.name}: budget period must be positive")
        for label, value in (("guaranteed GPUs", self.guaranteed_gpus),
                             ("guaranteed memory", self.guaranteed_memory_mib),
                             ("borrow limit", self.borrow_limit_gpus),
                             ("budget", self.budget_gpu_hours)):
            if value is not None and value < 0:
                raise ValueError(f"project {self.name}: {label} must not be negative")

    def period_start(self, now: float) -> float:
        """Start of the budget period that contains `now`."""
        periods = math.floor((now - self.period_anchor) / self.period_s)
        return self.period_anchor + periods * self.period_s

    def period_end(self, now: float) -> float:
        return self.period_start(now) + self.period_s


@dataclass(frozen=True)
class StartMiss:
    """How the estimates of one started job missed its first start, each as ln(actual wait /
    estimated wait): the first estimate it was shown (`shown`; the estimate ranges follow
    these) and the forward simulation's first start before calibration (`simulated`; the
    class calibration follows these). None where there was none, or it promised under a
    minute (estimate_ranges.wait_miss, estimate_ranges.simulated_miss)."""

    start: float  # first started at
    job_class: JobClass
    shown: float | None
    simulated: float | None


@dataclass(frozen=True)
class RetiredUsage:
    """What jobs deleted from the cluster leave behind in their project: their GPU use, so
    deleting a job never refunds budget, and what they taught the estimates (run times and
    how their estimates missed), so deleting finished jobs forgets nothing the ETA learned.

    The operator folds a job in (`accounting.retire_deleted`) from its deletion finalizer and
    stores this in the ProjectQuota's status. `job_keys` makes retiring idempotent.
    """

    period_start: float = 0.0
    gpu_hours: float = 0.0  # in the period starting at `period_start`
    decayed_gpu_hours: float = 0.0  # fair-share usage, valid at `decayed_as_of`
    decayed_as_of: float = 0.0
    job_keys: frozenset[str] = frozenset()
    # learned run times of this project's keys (run_times.LearnKey), least recently updated first;
    # at most estimate_ranges.MAX_RETIRED_TEMPLATES templates (estimate_ranges.retire_history)
    learned: Mapping[tuple[str, JobClass | str], DurationEstimate] = field(
        default_factory=dict)
    # how the estimates of deleted jobs missed, by start time; only those that can still
    # count (estimate_ranges.recent_misses)
    start_misses: tuple[StartMiss, ...] = ()


@dataclass(frozen=True)
class ProjectUsage:
    """A project's use, derived from run records (see `accounting.project_usage`)."""

    project: str
    period_start: float
    gpu_hours_used: float  # this period, running jobs counted up to now
    decayed_gpu_hours: float  # all time, halved every half-life: the fair-share usage


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything one admission cycle decides from.

    `jobs` holds every GpuJob the operator knows, finished ones included (their run records
    are the accounting). `nodes` carry the GPU inventory and any grants held by something that
    is NOT a job in `jobs`; the core adds each GPU-holding job's own grants itself, so the
    operator must not add them again. `retired` is per project (see RetiredUsage).
    """

    now: float
    jobs: tuple[Job, ...]
    quotas: Mapping[str, ProjectQuota]
    nodes: Mapping[str, NodeState]
    retired: Mapping[str, RetiredUsage] = field(default_factory=dict)
    # run-time history of finished jobs no longer in `jobs` (a replay keeps it run by run);
    # the cycle adds what the finished jobs in `jobs` teach
    learned: Mapping[tuple[str, JobClass | str], DurationEstimate] = field(default_factory=dict)
    # how the estimates of started jobs no longer in `jobs` missed (estimate_ranges.recent_misses)
    start_misses: tuple[StartMiss, ...] = ()
    # (submitted at, class level, GPU-seconds, project) of recent arrivals no longer in `jobs`
    recent_arrivals: tuple[tuple[float, int, float, str], ...] = ()

    def __post_init__(self) -> None:
        keys = [j.key for j in self.jobs]
        if len(set(keys)) != len(keys):
            dupes = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"snapshot lists jobs more than once: {', '.join(dupes)}")
        for name, quota in self.quotas.items():
            if name != quota.name:
                raise ValueError(f"quota keyed {name!r} is named {quota.name!r}")
