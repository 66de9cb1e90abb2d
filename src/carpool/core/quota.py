"""Project quotas: namespace binding, concurrent guarantees, borrowing and GPU-hour budgets.

Rules (the admission cycle applies them to every job before it may start):

- Binding: a job's namespace must be listed by exactly the ProjectQuota its spec names.
- Class limits: a job asks for no more GPUs, no longer limit or grace and no smaller grant
  than its project's spec.classLimits allow its class; otherwise it is refused, not queued.
- Concurrent use is counted in GPU equivalents (the `gpuhours` fraction of the grants) and in
  granted GPU memory. A job starts *in quota* while the project's in-quota use plus the job
  stays within the guarantee. Beyond it a job may *borrow* idle capacity only if the project
  allows borrowing, the job is preemptible and not interactive (borrowed jobs are reclaimed
  first, and interactive or non-preemptible jobs are never preempted), and the borrow limit
  holds. Without borrowing the guarantee is also the cap on the project's total use.
- Budget: hard GPU-hours per period. Admission claims the job's worst case: fraction x the
  time until its limit (maxDuration, enforced by the operator, or else the estimate), split
  over the periods that time touches. A job starts only if, in every such period, the
  GPU-hours already used (current period), plus what the project's GPU-holding jobs may still
  use there (their claims), plus its own claim fit in the budget. So with maxDuration
  enforced, a Hold project's use in any period never exceeds its budget, refills included.
  Running jobs are charged continuously from their run records.
- Spent budget: policy Hold holds new jobs until the period refills; PreemptibleOnly still
  starts preemptible, non-interactive jobs, as borrowers on capacity nobody else wants now.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from carpool.core.durations import format_duration
from carpool.core.jobs import BudgetPolicy, Job, ProjectQuota
from carpool.core.resources import JobClass


class Standing(enum.Enum):
    """How a job would start, as far as its project's limits go."""

    IN_QUOTA = "InQuota"  # within the guarantee and the budget
    BORROWING = "Borrowing"  # beyond the guarantee, on idle capacity, reclaimable
    OVER_QUOTA = "OverQuota"  # beyond what the project may use concurrently
    OVER_BUDGET = "OverBudget"  # the period's GPU-hours would run out

    @property
    def may_start(self) -> bool:
        return self in (Standing.IN_QUOTA, Standing.BORROWING)


@dataclass(frozen=True)
class Binding:
    """Why a job cannot be billed to a project, or None in `binding_refusal`."""

    unknown_project: bool
    message: str


def binding_refusal(job: Job, quotas: Mapping[str, ProjectQuota]) -> Binding | None:
    """Refuse jobs naming a project that does not exist or does not bind their namespace."""
    quota = quotas.get(job.project)
    if quota is None:
        return Binding(True, f"project {job.project!r} has no ProjectQuota")
    if job.namespace not in quota.namespaces:
        bound = sorted(q.name for q in quotas.values() if job.namespace in q.namespaces)
        hint = (f"; namespace {job.namespace!r} bills to {', '.join(bound)}" if bound
                else f"; namespace {job.namespace!r} is bound to no project")
        return Binding(False, f"namespace {job.namespace!r} is not bound to project "
                              f"{job.project!r}{hint}")
    return None


def class_limit_refusal(job: Job, quota: ProjectQuota) -> str | None:
    """Why a job asks for more than its project lets its class have, or for less than the
    smallest grant (ProjectQuota spec.classLimits), naming the job's field and the limit; None
    when it stays within them. The chart's cluster-wide limits refuse at admission already
    (hack/policies/class-limits.yaml); these are per project, which admission cannot read."""
    limit = next((c for c in quota.class_limits if c.job_class is job.job_class), None)
    if limit is None:
        return None
    name = job.job_class.name.lower()
    where = f"ProjectQuota {quota.name} spec.classLimits.{name}"
    request = job.request
    if limit.max_gpus is not None and job.gpu_count > limit.max_gpus:
        asked = (f"the gang's {job.gpu_count} GPUs over spec.workers" if job.workers
                 else f"spec.gpu.count {request.count}")
        return f"{asked} is more than {where}.maxGpus {limit.max_gpus}"
    if limit.max_duration_s is not None and not job.max_duration_s:
        return (f"spec.maxDuration must be set for class {name}: {where}.maxDuration is "
                f"{format_duration(limit.max_duration_s)}")
    if limit.max_duration_s is not None and job.max_duration_s > limit.max_duration_s:
        return (f"spec.maxDuration {format_duration(job.max_duration_s)} is longer than "
                f"{where}.maxDuration {format_duration(limit.max_duration_s)}")
    if limit.max_grace_s is not None and job.checkpoint_grace_s > limit.max_grace_s:
        return (f"spec.checkpoint.gracePeriod {format_duration(job.checkpoint_grace_s)} is "
                f"longer than {where}.maxGracePeriod {format_duration(limit.max_grace_s)}")
    if limit.min_gpu_memory_mib is not None and request.memory_mib < limit.min_gpu_memory_mib:
        return (f"spec.gpu.memory {request.memory_mib}Mi is less than {where}.minGpuMemory "
                f"{limit.min_gpu_memory_mib}Mi")
    if (limit.min_gpu_cores_pct is not None and request.cores_pct
            and request.cores_pct < limit.min_gpu_cores_pct):
        return (f"spec.gpu.cores {request.cores_pct} is less than {where}.minGpuCores "
                f"{limit.min_gpu_cores_pct}")
    return None


@dataclass
class ProjectLedger:
    """A project's concurrent use and budget commitment while a cycle adds jobs (local state)."""

    quota: ProjectQuota
    in_quota_gpus: float = 0.0
    in_quota_memory_mib: int = 0
    borrowed_gpus: float = 0.0
    borrowed_memory_mib: int = 0
    used_gpu_hours: float = 0.0  # this period, from records
    now: float = 0.0
    claims: dict[float, float] = field(default_factory=dict)  # period start -> GPU-hours

    @property
    def total_gpus(self) -> float:
        return self.in_quota_gpus + self.borrowed_gpus

    @property
    def total_memory_mib(self) -> int:
        return self.in_quota_memory_mib + self.borrowed_memory_mib

    @property
    def current_period(self) -> float:
        return self.quota.period_start(self.now)

    @property
    def reserved_gpu_hours(self) -> float:
        """What the project's GPU-holding jobs may still use in the current period."""
        return self.claims.get(self.current_period, 0.0)

    def committed_gpu_hours(self, period_start: float) -> float:
        """Used (current period only) plus claimed GPU-hours of one period."""
        used = self.used_gpu_hours if period_start == self.current_period else 0.0
        return used + self.claims.get(period_start, 0.0)

    def add(self, gpus: float, memory_mib: int, borrowed: bool,
            claims: Mapping[float, float]) -> None:
        if borrowed:
            self.borrowed_gpus += gpus
            self.borrowed_memory_mib += memory_mib
        else:
            self.in_quota_gpus += gpus
            self.in_quota_memory_mib += memory_mib
        for period, hours in claims.items():
            self.claims[period] = self.claims.get(period, 0.0) + hours


MAX_CLAIMED_PERIODS = 64


def budget_claims(quota: ProjectQuota, fraction: float, now: float, started_at: float | None,
                  limit_s: float) -> dict[float, float]:
    """GPU-hours a job may still use in each budget period if it runs to its limit.

    Keyed by period start; a run crossing a refill claims from both periods, so a job started
    late in a period cannot overspend the next one. (Claims stop after MAX_CLAIMED_PERIODS
    periods: a limit that long against a period that short is a misconfiguration.)
    """
    start = started_at if started_at is not None else now
    end = start + limit_s
    claims: dict[float, float] = {}
    t = now
    while t < end and len(claims) < MAX_CLAIMED_PERIODS:
        period = quota.period_start(t)
        segment_end = min(end, period + quota.period_s)
        claims[period] = fraction * (segment_end - t) / 3600.0
        t = segment_end
    return claims


def may_borrow(job: Job, quota: ProjectQuota) -> bool:
    return quota.borrowing and job.preemptible and job.job_class is not JobClass.INTERACTIVE


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if math.isfinite(x) else "unlimited"


@dataclass(frozen=True)
class Verdict:
    standing: Standing
    message: str
    budget_exhausted: bool = False  # started (if at all) only because of PreemptibleOnly
    budget_period: float | None = None  # start of the period whose budget does not suffice

    @property
    def borrowed(self) -> bool:
        return self.standing is Standing.BORROWING


def _budget_shortfall(ledger: ProjectLedger, claims: Mapping[float, float]) -> float | None:
    """The first period whose budget cannot take `claims`, or None."""
    budget = ledger.quota.budget_gpu_hours
    if budget is None:
        return None
    for period in sorted(claims):
        if ledger.committed_gpu_hours(period) + claims[period] > budget + 1e-9:
            return period
    return None


def judge(job: Job, ledger: ProjectLedger, gpus: float, memory_mib: int,
          claims: Mapping[float, float]) -> Verdict:
    """Whether `job`, holding `gpus` GPU equivalents and `memory_mib`, may start now;
    `claims` are its `budget_claims`."""
    quota = ledger.quota
    g_gpus = quota.guaranteed_gpus if quota.guaranteed_gpus is not None else math.inf
    g_mem = quota.guaranteed_memory_mib if quota.guaranteed_memory_mib is not None else math.inf
    borrows_ok = may_borrow(job, quota)
    if quota.borrowing:
        limit = quota.borrow_limit_gpus if quota.borrow_limit_gpus is not None else math.inf
        cap_gpus, cap_mem = g_gpus + limit, math.inf
    else:
        cap_gpus, cap_mem = g_gpus, g_mem
    eps = 1e-9
    within_cap = (ledger.total_gpus + gpus <= cap_gpus + eps
                  and ledger.total_memory_mib + memory_mib <= cap_mem)
    within_guarantee = (within_cap and ledger.in_quota_gpus + gpus <= g_gpus + eps
                        and ledger.in_quota_memory_mib + memory_mib <= g_mem)

    short = _budget_shortfall(ledger, claims)
    if short is not None:
        idle_ok = (quota.on_budget_exhausted is BudgetPolicy.PREEMPTIBLE_ONLY and job.preemptible
                   and job.job_class is not JobClass.INTERACTIVE and within_cap)
        budget = quota.budget_gpu_hours or 0.0
        if short == ledger.current_period:
            message = (f"project {quota.name} has used {_fmt(ledger.used_gpu_hours)} of "
                       f"{_fmt(budget)} GPU-hours this period and its running jobs may use "
                       f"{_fmt(ledger.reserved_gpu_hours)} more; this job may need "
                       f"{_fmt(claims[short])} GPU-hours")
        else:
            message = (f"this job would run into project {quota.name}'s next budget period, "
                       f"where running jobs may already use "
                       f"{_fmt(ledger.committed_gpu_hours(short))} of {_fmt(budget)} GPU-hours "
                       f"and it may need {_fmt(claims[short])}")
        if idle_ok:
            return Verdict(Standing.BORROWING, message + "; runs preemptible on idle GPUs", True,
                           short)
        if quota.on_budget_exhausted is BudgetPolicy.PREEMPTIBLE_ONLY:
            message += "; only preemptible, non-interactive jobs run once the budget is spent"
        return Verdict(Standing.OVER_BUDGET, message, budget_period=short)

    if within_guarantee:
        return Verdict(Standing.IN_QUOTA, f"within project {quota.name}'s guarantee")
    usage = f"project {quota.name} runs {_fmt(ledger.in_quota_gpus)} of {_fmt(g_gpus)} " \
            "guaranteed GPUs"
    if math.isfinite(g_mem):
        usage += (f" and {_fmt(ledger.in_quota_memory_mib / 1024)} of {_fmt(g_mem / 1024)} GiB "
                  "guaranteed GPU memory")
    if ledger.borrowed_gpus > 0:
        usage += f" (+{_fmt(ledger.borrowed_gpus)} borrowed)"
    usage += f"; this job needs {_fmt(gpus)} GPUs"
    if math.isfinite(g_mem):
        usage += f" and {_fmt(memory_mib / 1024)} GiB"
    if borrows_ok and within_cap:
        return Verdict(Standing.BORROWING, usage + "; borrows idle capacity (preemptible)")
    if not quota.borrowing:
        why = "borrowing is off for the project"
    elif not job.preemptible:
        why = "only preemptible jobs may borrow"
    elif job.job_class is JobClass.INTERACTIVE:
        why = "interactive jobs may not borrow"
    else:
        why = f"the borrow limit is {_fmt(cap_gpus - g_gpus)} GPUs"
    return Verdict(Standing.OVER_QUOTA, f"{usage}; {why}")
