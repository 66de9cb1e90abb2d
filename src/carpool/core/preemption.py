"""When to preempt, and which running jobs to preempt so a waiting job can start, losing the
least work.

When: only a job its project's limits allow to start (or that is held back by its own
project's guarantee) and that finds no room; at most so many preemptions and attempts per
cycle (`worth_preempting`), and only if waiting instead would take longer than the configured
wait. A victim keeps its GPUs for its checkpoint grace period, at least `MIN_LEAVING_S`.

Who may be preempted, and by whom:
- Never an interactive job, never a non-preemptible one, never a job that has run less than
  its minimum runtime, never one already terminating.
- A job within its project's guarantee (in quota) reclaims capacity borrowed by other
  projects, and may preempt preemptible jobs of a strictly lower class (after aging: the
  level each would have in the queue now).
- A job that would itself be borrowing may preempt only borrowed jobs of a strictly lower
  class (so borrowers never evict an owner, and preemption cannot ping-pong: the victim
  ranks lower than its preemptor, or is a borrower that the admission cycle considers only
  after every job within its limits).
- A job running in lent GPU capacity makes way for a non-preemptible job of at least its
  class that needs that room (`lending.yields_to_owner`), as it does for its owner's rise.

A job held back only by its own project's guarantee may also preempt that project's own
preemptible jobs of a strictly lower class (`quota_victims`), plus what it needs on a node.

Choosing victims: on each node, candidates are taken in order (borrowed first, then least
work lost since the last checkpoint, then the lowest class, then the key) until the waiting
job fits on a what-if copy of the node with them (and jobs already terminating) gone; then
every victim the fit does not need is put back. The node whose victim set evicts the fewest
non-borrowed jobs, then loses the least work, then the fewest jobs, then sorts first by name
wins. Nothing is preempted if no node would fit the job afterwards.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from carpool.core import lending
from carpool.core.fairshare import effective_level
from carpool.core.gpuhours import gpu_hours
from carpool.core.jobs import Job
from carpool.core.resources import GpuGrant, GpuRequest, JobClass
from carpool.core.timeline import Timeline

MIN_LEAVING_S = 1.0  # a victim's GPUs are not free before the operator has seen its pod gone


def worth_preempting(preempted: int, attempts: int, max_preemptions: int, max_attempts: int,
                     preempt_after_wait_s: float, wait_s: Callable[[], float | None]) -> bool:
    """Whether a job that finds no room may preempt now: while this cycle has made fewer than
    `max_preemptions` preemptions and `max_attempts` attempts, and only if its wait
    (`wait_s()`, asked only then; None: it would never start) exceeds
    `preempt_after_wait_s` (0: preempt at once)."""
    if preempted >= max_preemptions or attempts >= max_attempts:
        return False
    if preempt_after_wait_s <= 0:
        return True
    wait = wait_s()
    return wait is None or wait > preempt_after_wait_s


def largest_plan(max_preemptions: int, preempted: int = 0) -> int:
    """The most victims one plan may take in a cycle that has preempted `preempted` so far:
    a plan is carried out whole in one cycle or not at all, so one needing more than
    `max_preemptions` never is. (Forecasts count on later cycles for the rest: the caps on a
    cycle's total preemptions and attempts only delay a preemption to the next cycle.)"""
    return max_preemptions - preempted


def leaving_s(victim: Job) -> float:
    """How long a job told to stop is assumed to keep its GPUs: its grace period, but never
    less than MIN_LEAVING_S."""
    return max(victim.checkpoint_grace_s, MIN_LEAVING_S)


class PreemptionCause(enum.Enum):
    RECLAIM = "ReclaimBorrowed"  # the victim borrowed capacity an in-quota job needs
    HIGHER_CLASS = "HigherClass"  # the preemptor's class outranks the victim's
    OWNER_RECLAIM = "OwnerReclaim"  # the victim ran in lent capacity its owner needs back


def victim_cause(preemptor: Job, preemptor_in_quota: bool, victim: Job, now: float,
                 aging_step_s: float = 0.0) -> PreemptionCause | None:
    """Why `victim` may make way for `preemptor`, or None if it may not.

    Classes are compared after aging, as if both jobs were queued now (`fairshare`): a victim
    that would rank as high as its preemptor once requeued is left alone, so an old job that
    waited long for its GPUs is not thrown back, and aging cannot make two jobs take turns
    evicting each other.
    """
    if victim.key == preemptor.key or not may_be_victim(victim, now):
        return None
    return cause_between(preemptor.project, preemptor_in_quota,
                         effective_level(preemptor, now, aging_step_s), victim,
                         effective_level(victim, now, aging_step_s), preemptor.preemptible)


def may_be_victim(victim: Job, now: float) -> bool:
    """The part of `victim_cause` that is the victim's alone: it holds GPUs and is not
    stopping, is preemptible and not interactive, and has run its minimum runtime by `now`."""
    return (victim.holds_gpus and not victim.terminating
            and victim.job_class is not JobClass.INTERACTIVE and victim.preemptible
            and now >= preemptible_from(victim, now))


def cause_between(preemptor_project: str, preemptor_in_quota: bool, preemptor_level: int,
                  victim: Job, victim_level: int, preemptor_preemptible: bool
                  ) -> PreemptionCause | None:
    """The rest of `victim_cause`, for a victim `may_be_victim` allows, from both jobs'
    effective levels at that time (a search over many victims computes each once). A
    borrower in lent capacity makes way for an owner (`lending.yields_to_owner`)."""
    if lending.yields_to_owner(victim, victim_level, preemptor_preemptible, preemptor_level):
        return PreemptionCause.OWNER_RECLAIM
    if victim.borrowed and preemptor_in_quota and victim.project != preemptor_project:
        return PreemptionCause.RECLAIM
    if victim_level > preemptor_level and (preemptor_in_quota or victim.borrowed):
        return PreemptionCause.HIGHER_CLASS
    return None


def preemptible_from(victim: Job, now: float) -> float:
    """When `victim` will have run its minimum runtime (a job not started yet counts from
    `now`): it is never preempted before."""
    started = victim.started_at
    return (started if started is not None else now) + victim.min_runtime_s


def lost_gpu_hours(victim: Job, fraction: float, now: float) -> float:
    """GPU-hours of work since the victim's last checkpoint (or its start): what it loses."""
    started = victim.started_at
    if started is None:
        return 0.0
    since = max(started, victim.last_checkpoint_at or started)
    return gpu_hours(fraction, since, now)


@dataclass(frozen=True)
class Candidate:
    job: Job
    cause: PreemptionCause
    lost_gpu_hours: float

    @property
    def preference(self) -> tuple[int, float, int, str]:
        return victim_preference(self.job, self.lost_gpu_hours)


def victim_preference(victim: Job, lost: float) -> tuple[int, float, int, str]:
    """The order victims are taken in: borrowed first, then least work lost, then the lowest
    class, then the key."""
    return (0 if victim.borrowed else 1, lost, -int(victim.job_class), victim.key)


@dataclass(frozen=True)
class PreemptionPlan:
    node: str
    victims: tuple[Candidate, ...]
    grants: tuple[GpuGrant, ...]  # what the preemptor gets once the victims are gone
    start: float  # when the last victim's grace period is over

    @property
    def cost(self) -> tuple[int, float, int, str]:
        return (sum(1 for v in self.victims if not v.job.borrowed),
                sum(v.lost_gpu_hours for v in self.victims), len(self.victims), self.node)


def plan_preemption(request: GpuRequest, duration_s: float, candidates: Iterable[Candidate],
                    timeline: Timeline, leaving: frozenset[str]) -> PreemptionPlan | None:
    """The cheapest set of victims that lets `request` fit, or None.

    `leaving` are jobs already terminating; the what-if runs on copies of the node states in
    `timeline` (which also carries the reservations of higher-ranked jobs), never on them.
    """
    now = timeline.now
    by_node: dict[str, list[Candidate]] = {}
    for cand in candidates:
        # a gang is a candidate on every node it holds GPUs on, and leaves from all of them
        for node in dict.fromkeys(p.node for p in cand.job.placements) or (
                [cand.job.node] if cand.job.node else []):
            by_node.setdefault(node, []).append(cand)
    best: PreemptionPlan | None = None
    for node in sorted(by_node):
        if node not in timeline.node_names or timeline.never_fits(node, request):
            continue

        def fits(victims: list[Candidate], node: str = node) -> tuple[GpuGrant, ...] | None:
            gone = leaving | {v.job.key for v in victims}
            fit = timeline.fit_during(node, request, now, now + duration_s, gone)
            return fit[1] if fit is not None else None

        ordered = sorted(by_node[node], key=lambda c: c.preference)
        chosen: list[Candidate] = []
        for cand in ordered:
            chosen.append(cand)
            if fits(chosen) is not None:
                break
        else:
            continue
        for cand in reversed(chosen[:-1]):
            trial = [c for c in chosen if c is not cand]
            if fits(trial) is not None:
                chosen = trial
        grants = fits(chosen)
        assert grants is not None
        start = now + max(v.job.checkpoint_grace_s for v in chosen)
        plan = PreemptionPlan(node, tuple(chosen), grants, start)
        if best is None or plan.cost < best.cost:
            best = plan
    return best


def quota_victims(candidates: Iterable[tuple[Candidate, float, int]], excess_gpus: float,
                  excess_memory_mib: float) -> list[Candidate] | None:
    """Own-project victims whose in-quota use covers what the waiting job lacks, or None.

    `candidates` carry each job's GPU equivalents and memory. Taken in the same order as on a
    node (least work lost first), then every victim the cover does not need is put back.
    """
    ordered = sorted(candidates, key=lambda c: c[0].preference)

    def covers(chosen: list[tuple[Candidate, float, int]]) -> bool:
        return (sum(g for _, g, _ in chosen) >= excess_gpus - 1e-9
                and sum(m for _, _, m in chosen) >= excess_memory_mib)

    chosen: list[tuple[Candidate, float, int]] = []
    for cand in ordered:
        if covers(chosen):
            break
        chosen.append(cand)
    if not covers(chosen):
        return None
    for cand in reversed(chosen[:-1]):
        trial = [c for c in chosen if c is not cand]
        if covers(trial):
            chosen = trial
    return [c for c, _, _ in chosen]
