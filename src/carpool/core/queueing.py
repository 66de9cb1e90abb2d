"""The admission cycle: from one cluster snapshot to admit, preempt and wait decisions.

`admission_cycle(snapshot, config)` is the operator's one call per cycle. It is pure: the same
snapshot and config always give the same result, whatever the order of `snapshot.jobs`.

What it does, in queue order (see `fairshare` for the order and the aging bound):

1. Refuse jobs whose namespace is not bound to their project; park jobs no GPU in the cluster
   could ever hold (no matching model, too large for every node).
2. Judge the project's limits (`quota`): guarantee, borrowing, GPU-hour budget.
3. Admit a job only if some node can hold it now (the shared placement core) for its whole
   expected run without touching a reservation of a higher-ranked job; it is then recorded on
   the node, so nothing later in the cycle takes the same GPUs. A job still in its requeue
   backoff is judged and estimated as any other but neither admitted nor preempting yet.
4. Otherwise it waits and, within the first `reservation_depth` waiting jobs, reserves the
   earliest slot the forward simulation (`timeline`) finds: that is its estimated start, and no
   lower-ranked job may take it (backfill only fills holes). Deeper jobs get a coarse
   estimate from the cluster's drain rate.
5. A job that is allowed to start but finds no room may preempt (`preemption`): victims are
   told to stop with their checkpoint grace, and the job keeps a reservation where they were.

Jobs that would borrow (beyond their guarantee, or on a spent PreemptibleOnly budget) are
considered after all others, so borrowing only ever takes capacity nobody within their limits
wants this cycle.

Contract with the operator: pass every GpuJob it knows (finished ones too: their run records
are the accounting); give nodes their inventory without the jobs' grants (the core adds each
GPU-holding job's `grants` itself); clear a job's grants once its pod is gone. Carry out
`admissions`, `preemptions` and `expiries`; write each `Wait` into the job's status; write
`projects` into the ProjectQuotas' status.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from carpool.core import lending
from carpool.core.accounting import grants_fraction, held_fraction, memory_efficiency, project_usage
from carpool.core.derived import DerivedState
from carpool.core.durations import format_duration
from carpool.core.estimate_ranges import (
    MIN_RANGE_SAMPLES,
    RATE_ARRIVALS,
    Arrival,
    arrival_work,
    calibrated_start,
    class_misses,
    overtaking_load,
    recent_arrivals,
    start_range,
    started_misses,
    wait_misses,
    wait_stretch,
)
from carpool.core.fairshare import (
    DEFAULT_REFERENCE_MEMORY_MIB,
    NOT_DUE,
    OVERDUE_LEVEL,
    RankKey,
    due_level,
    effective_level,
    job_nominal_fraction,
    next_aging,
    nominal_fraction,
    promised_start,
    promised_start_due,
    rank_queue,
)
from carpool.core.gangs import GangPlacement, WorkerPlacement, place_gang
from carpool.core.gpu_choice import NoFit, choose_gpus, grants_for
from carpool.core.jobs import ClusterSnapshot, DurationEstimate, Job, ProjectQuota, ProjectUsage
from carpool.core.lending import LendingPolicy
from carpool.core.placement import (
    SHARING_WOULD_BREAK,
    GpuFree,
    NodeState,
    gpu_verdicts,
    rejection_by_conditions,
)
from carpool.core.preemption import (
    MIN_LEAVING_S,
    Candidate,
    PreemptionCause,
    cause_between,
    largest_plan,
    leaving_s,
    lost_gpu_hours,
    may_be_victim,
    plan_preemption,
    preemptible_from,
    quota_victims,
    victim_cause,
    victim_preference,
    worth_preempting,
)
from carpool.core.quota import (
    ProjectLedger,
    Standing,
    Verdict,
    binding_refusal,
    budget_claims,
    class_limit_refusal,
    judge,
)
from carpool.core.resources import GpuGrant, GpuRequest, Isolation, JobClass, Phase
from carpool.core.run_times import (
    DURATION_LEARNING_RATE,
    LearnKey,
    expected_duration,
    learn_durations,
    remaining,
    remaining_quantiles,
    run_time,
    scenario_quantiles,
    split_quantile,
)
from carpool.core.scoring import MAX_MEMO_ENTRIES, RequestScorer, Scorer
from carpool.core.timeline import NodePlacer, Occupancy, Slot, Timeline, TimelineMemo, fluid_start
from carpool.core.topology import (
    Domain,
    TopologyLevel,
    TopologyMode,
    TopologyNeed,
    domain_index,
)


def extender_placer(scorer: Scorer | None = None) -> NodePlacer:
    """Place with the extender's own GPU choice and score (`gpu_choice.choose_gpus`), so the
    GPUs the operator reserves for a job are the ones the extender would pin, on the node it
    would pick. Nodes the scorer's CPU and memory view rejects score 0 but stay usable."""
    shared = scorer if scorer is not None else Scorer()
    # a timeline asks about the same few requests on every node: their per-request scorers
    # are kept here, with the placer (cleared past MAX_MEMO_ENTRIES, as the scorer's memo is)
    scorers: dict[GpuRequest, RequestScorer] = {}

    def place(node: NodeState, request: GpuRequest
              ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        state = DerivedState.of(node)  # the timeline's states keep what they derive
        request_scorer = scorers.get(request)
        if request_scorer is None:
            if len(scorers) > MAX_MEMO_ENTRIES:
                scorers.clear()
            request_scorer = scorers[request] = RequestScorer(request, shared)
        choice = choose_gpus(state, request_scorer)
        if isinstance(choice, NoFit):
            return None
        score, indices = choice
        return score, grants_for(state, request, indices)

    return place


@dataclass(frozen=True)
class AdmissionConfig:
    """Knobs of the admission cycle."""

    fair_share_half_life_s: float = 7 * 86400.0  # usage counts half after this long
    aging_step_s: float = 3600.0  # waiting this long raises a job one class (see fairshare)
    reservation_depth: int = 64  # waiting jobs that get an exact slot; deeper: coarse ETA
    max_preemptions_per_cycle: int = 16  # victims chosen per cycle, at most
    max_preemption_attempts_per_cycle: int = 32  # victim searches per cycle, at most
    preempt_after_wait_s: float = 0.0  # preempt only if the job would otherwise wait longer
    min_remaining_s: float = 60.0  # a job past its expected end is given this much more
    # arrivals within this window that may pass a job widen the end of its range (estimate_
    # ranges.overtaking_load, wait_stretch); 0: off
    arrival_window_s: float = 3600.0
    # scale simulated starts by how their class's recent ones missed, up to the next aging
    # step (estimate_ranges.calibrated_start); off: the forward simulation's start as it is
    class_calibration: bool = True
    # a job queued past its first promised start ranks ahead of work that would overtake it
    # (fairshare: due jobs); off: classes and aging alone order the queue
    keep_promises: bool = True
    # weight of the newest finished run in learned durations, once a group has 1/rate runs
    # (before that, runs are averaged: run_times.update_duration_estimate)
    duration_learning_rate: float = DURATION_LEARNING_RATE
    node_placer: NodePlacer = field(default_factory=extender_placer)
    # node states and fits kept across cycles (a replay); None: each cycle starts afresh
    timeline_memo: TimelineMemo | None = field(default=None, compare=False)
    # lend running jobs' unused grants to preemptible MPS jobs (core.lending); None: off
    lending: LendingPolicy | None = None
    # forward simulations with drawn run times whose median start is a reserved job's
    # estimate (`_scenario_starts`); 0: the cycle's own simulation, every time as expected.
    # Off by default: nine cost a cycle about 2.6x its CPU time for a few points of accuracy
    # (docs/benchmarks.md, "Start scenarios").
    start_scenarios: int = 0

    def __post_init__(self) -> None:
        if self.fair_share_half_life_s <= 0:
            raise ValueError("fair-share half-life must be positive")
        if self.aging_step_s < 0 or self.reservation_depth < 0:
            raise ValueError("aging step and reservation depth must not be negative")
        if self.max_preemptions_per_cycle < 0 or self.min_remaining_s <= 0:
            raise ValueError("preemption cap must not be negative; min remaining must be > 0")
        if self.start_scenarios < 0:
            raise ValueError("start_scenarios must not be negative")


class WaitReason(enum.Enum):
    """Why a queued job is not admitted this cycle (the GpuJob status reason)."""

    UNKNOWN_PROJECT = "UnknownProject"
    UNBOUND_NAMESPACE = "UnboundNamespace"
    CLASS_LIMIT = "ClassLimitExceeded"  # the project's spec.classLimits refuse it
    NO_MATCHING_GPU_MODEL = "NoMatchingGpuModel"
    NO_MATCHING_NODE = "NoMatchingNode"  # no GPU node has its template's nodeSelector labels
    TOO_LARGE = "TooLargeForAnyNode"
    BUDGET = "Budget"
    QUOTA = "Quota"
    CAPACITY = "Capacity"
    BEHIND_HIGHER_RANKED = "BehindHigherRanked"
    PREEMPTING = "Preempting"  # victims were told to stop; waiting for them to leave
    REQUEUE_BACKOFF = "RequeueBackoff"  # its last pod failed through no fault of its own
    # GPUs have room, but one more job on them would break its objective or one of the jobs
    # there (core.interference)
    SHARING_OBJECTIVE = "SharingWouldBreakObjective"
    # a gang whose spec.topology is required: no domain of its level holds all its workers
    TOPOLOGY = "TopologyUnavailable"

    @property
    def refused(self) -> bool:
        """The spec or the quotas must change before the job can ever run."""
        return self in (WaitReason.UNKNOWN_PROJECT, WaitReason.UNBOUND_NAMESPACE,
                        WaitReason.CLASS_LIMIT)

    @property
    def competes_for_capacity(self) -> bool:
        return self in (WaitReason.CAPACITY, WaitReason.BEHIND_HIGHER_RANKED,
                        WaitReason.PREEMPTING, WaitReason.REQUEUE_BACKOFF,
                        WaitReason.SHARING_OBJECTIVE, WaitReason.TOPOLOGY)


@dataclass(frozen=True)
class Admission:
    """Start this job: create its pod for `node`; `grants` are the GPUs the core picked."""

    job_key: str
    node: str
    grants: tuple[GpuGrant, ...]
    borrowed: bool  # beyond the project's guarantee or budget: preemptible, reclaimed first
    gpu_fraction: float  # GPU equivalents held (for the run record)
    attempt: int  # the job's attempts after this admission
    position: int  # its place in the queue when admitted (1 = head)
    message: str
    # a gang: every worker's node and GPUs, in rank order (`node` and `grants` are then rank
    # 0's node and all the grants); empty for a one-pod job
    workers: tuple[WorkerPlacement, ...] = ()


@dataclass(frozen=True)
class Preemption:
    """Stop this job: delete its pod with `grace_s` (SIGTERM first); it goes back to the queue
    keeping its submit time."""

    victim_key: str
    preemptor_key: str
    node: str
    cause: PreemptionCause
    grace_s: float
    lost_gpu_hours: float  # work since its last checkpoint
    message: str


@dataclass(frozen=True)
class Wait:
    """Keep this job queued; show why, where it stands and when it should start."""

    job_key: str
    reason: WaitReason
    message: str
    position: int  # among jobs still queued after this cycle, 1 = head; 0 for refused jobs
    ahead: int  # higher-ranked jobs also waiting for GPUs
    estimated_start: float | None  # None: cannot be estimated (refused, never fits)
    coarse_estimate: bool = False  # beyond the reservation depth: drain-rate estimate
    estimated_start_low: float | None = None  # the P10-P90 range around `estimated_start`
    estimated_start_high: float | None = None
    # the forward simulation's start before calibration (estimate_ranges.calibrated_start);
    # None when the estimate is not the simulation's (the job's own victims leaving)
    simulated_start: float | None = None


MAX_DURATION_EXCEEDED = "MaxDurationExceeded"
# the most start times a waiting gang's reservation tries (each is a whole placement)
MAX_GANG_STARTS = 16
# the most running jobs a gang's victim search looks through, best victims first
MAX_GANG_VICTIM_SEARCH = 32
IDLE_TIMEOUT = "IdleTimeout"


@dataclass(frozen=True)
class Expiry:
    """This running job must stop (with its grace period, to checkpoint): past its
    maxDuration, or an interactive session whose GPUs sat idle past its project's limit.
    `reason` ends it (the status reason, its Event's, its run's outcome); `note` says why."""

    job_key: str
    ran_s: float
    max_duration_s: float
    grace_s: float
    reason: str = MAX_DURATION_EXCEEDED
    note: str = ""

    @property
    def message(self) -> str:
        return self.note or (f"ran {self.ran_s:.0f}s, over its maxDuration of "
                             f"{self.max_duration_s:.0f}s; stopped")


def idle_expiry(job: Job, quota: ProjectQuota | None, now: float,
                wanted: bool = False) -> Expiry | None:
    """An interactive job whose GPUs its project's `idleSessions.timeout` has seen do no
    work, stopped with its grace to checkpoint (billing ends with its pod); and, where the
    project sets `idleSessions.yieldAfter`, one idle that long while its GPUs are `wanted`
    (a job waits that could use them: `idle_gpus_wanted`). A session left open costs
    nobody anything while nothing waits; while others queue, the GPUs it holds idle are
    what they wait for. Only where its node's device plugin measures per-process GPU
    activity (`Job.last_gpu_activity`): a job is never stopped for a silence nobody
    measured."""
    if (quota is None or job.job_class is not JobClass.INTERACTIVE
            or job.phase is not Phase.RUNNING or (started := job.started_at) is None
            or (idle_s := _idle_for(job, now)) is None):
        return None
    timeout, yield_after = quota.idle_session_timeout_s, quota.idle_session_yield_after_s
    if timeout > 0 and idle_s >= timeout:
        limit, field_name, why = timeout, "timeout", ""
    elif wanted and 0 < yield_after <= idle_s:
        limit, field_name, why = yield_after, "yieldAfter", " while jobs wait for its GPUs"
    else:
        return None
    note = (f"its GPUs did no work for {format_duration(idle_s)}; project {quota.name} "
            f"stops interactive sessions idle for {format_duration(limit)}{why}"
            f" (spec.idleSessions.{field_name}); stopped with {job.checkpoint_grace_s:.0f}s to "
            f"checkpoint, its GPU time billed until its pod is gone")
    return Expiry(job.key, now - started, job.max_duration_s, job.checkpoint_grace_s,
                  IDLE_TIMEOUT, note)


def _idle_for(job: Job, now: float) -> float | None:
    """How long a running job's GPUs have done no work, measured (None: never measured)."""
    if job.last_gpu_activity is None or (started := job.started_at) is None:
        return None
    return now - max(started, job.last_gpu_activity)


def idle_gpus_wanted(models: Iterable[str], waiting: Iterable[Job]) -> bool:
    """Whether a waiting job may run on a GPU of one of `models` (a session's GPUs), so
    that stopping an idle session there could serve it (`idle_expiry`'s yieldAfter)."""
    held = set(models)
    return any(any(job.request.allows_model(m) for m in held) for job in waiting)


def _idle_wanted(job: Job, snapshot: ClusterSnapshot, waiting: Sequence[Job],
                 now: float) -> bool:
    """`idle_gpus_wanted` for a running session idle past its project's yieldAfter (else
    False, unasked: the queue is looked through only for a session that could yield)."""
    quota = snapshot.quotas.get(job.project)
    node = snapshot.nodes.get(job.node)
    if (quota is None or quota.idle_session_yield_after_s <= 0 or node is None
            or job.job_class is not JobClass.INTERACTIVE or not waiting
            or (idle_s := _idle_for(job, now)) is None
            or idle_s < quota.idle_session_yield_after_s):
        return False
    held = {g.gpu_uuid for g in job.grants}
    return idle_gpus_wanted((g.model for g in node.inventory.gpus if g.uuid in held), waiting)


@dataclass(frozen=True)
class ProjectStatus:
    """A ProjectQuota's status after this cycle's decisions."""

    project: str
    period_start: float
    period_end: float
    budget_gpu_hours: float | None
    used_gpu_hours: float  # this period, running jobs up to now
    remaining_gpu_hours: float | None  # budget - used (None: no budget)
    reserved_gpu_hours: float  # what running jobs may still use this period
    fair_share_usage: float  # decayed GPU-hours
    running_gpus: float  # GPU equivalents held, borrowed included
    borrowed_gpus: float
    running_jobs: int
    pending_jobs: int
    memory_efficiency: float | None  # peak / requested GPU memory over jobs with a peak


@dataclass(frozen=True)
class CycleResult:
    now: float
    admissions: tuple[Admission, ...]
    preemptions: tuple[Preemption, ...]
    waits: tuple[Wait, ...]
    expiries: tuple[Expiry, ...]
    projects: tuple[ProjectStatus, ...]

    def wait_for(self, job_key: str) -> Wait | None:
        return next((w for w in self.waits if w.job_key == job_key), None)


# ---------------------------------------------------------------- helpers


def _widened(grant: GpuGrant, free: GpuFree, request: GpuRequest) -> GpuGrant:
    """A grant at a job's placement floor grown into the rest of its GPU's free piece, up
    to the job's calibrated `request` (memory in whole GiB): the more of its measured peak's
    headroom it gets, the less likely the watchdog ends it."""
    memory, cores = grant.memory_mib, grant.cores_pct
    if 0 < memory < request.memory_mib:
        gib = lending.MIB_PER_GIB
        memory = max(memory, min(request.memory_mib, free.memory_mib // gib * gib))
    if 0 < cores < request.cores_pct:
        cores = max(cores, min(request.cores_pct, free.cores_pct))
    return replace(grant, memory_mib=memory, cores_pct=cores)


def _memory_of(request: GpuRequest, grants: tuple[GpuGrant, ...], reference_mib: int) -> int:
    if grants:
        return sum(g.memory_mib for g in grants)
    per_gpu = reference_mib if request.isolation is Isolation.EXCLUSIVE else request.memory_mib
    return request.count * per_gpu


def _job_memory(job: Job, reference_mib: int) -> int:
    """GPU memory the job holds (its grants) or will hold, over every pod of a gang."""
    if job.grants:
        return sum(g.memory_mib for g in job.grants)
    return sum(_memory_of(r, (), reference_mib) for r in job.requests)


@dataclass
class _Holder:
    job: Job
    fraction: float
    memory_mib: int
    end: float
    # GPU-hours per budget period its project's budget holds for it (`quota.budget_claims`)
    claims: Mapping[float, float] = field(default_factory=dict)


@dataclass
class _Cycle:
    """Working state of one cycle (never escapes `admission_cycle`)."""

    snapshot: ClusterSnapshot
    config: AdmissionConfig
    learned: dict[LearnKey, DurationEstimate]
    usage: dict[str, ProjectUsage]
    reference_mib: int
    timeline: Timeline
    ledgers: dict[str, ProjectLedger]
    holders: list[_Holder]
    models: frozenset[str]
    capacity_gpus: float
    leaving: set[str] = field(default_factory=set)
    running_spans: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)
    now_fail: dict[GpuRequest, float] = field(default_factory=dict)
    raw_fail: set[GpuRequest] = field(default_factory=set)
    # request -> (node, why) where only a passing condition keeps it out (`_never_fits`)
    held_back: dict[GpuRequest, list[tuple[str, str]]] = field(default_factory=dict)
    # request -> why sharing limits alone keep it off every node now (None: they do not)
    sharing_blocked: dict[GpuRequest, str | None] = field(default_factory=dict)
    # every node's held grants, and whether any carries a sharing limit (`_sharing_blocked`)
    held_by_node: dict[str, list[GpuGrant]] | None = None
    held_limits: bool = False
    # the holders `preemption.victim_cause` can ever name (preemptible, not interactive, not
    # terminating), in `holders` order: the victim scans look at these only
    victims: list[_Holder] = field(default_factory=list)
    # those `preemption.may_be_victim` allows now, each with its effective level now and
    # the GPU-hours it would lose (`_victim_candidates`; gathered on first use)
    victims_now: list[tuple[_Holder, int, float]] | None = None
    preemptions: list[Preemption] = field(default_factory=list)
    preempt_attempts: int = 0
    preempt_fail: set[tuple[GpuRequest, int, bool, str, bool]] = field(default_factory=set)
    quota_preempt_fail: set[tuple[GpuRequest, int, bool, str, bool]] = field(default_factory=set)
    holders_by_project: dict[str, list[_Holder]] = field(default_factory=dict)
    # how much earlier and later than planned an occupancy may end (its P10, P90): every
    # running job's, and reservations behind one (`_Spread`)
    spreads: dict[str, _Spread] = field(default_factory=dict)
    borrow_fail: set[GpuRequest] = field(default_factory=set)  # found no lent room this cycle


class _Spread(NamedTuple):
    """Seconds an occupancy may end earlier (`early`) or later (`late`) than planned, 80 %
    of the time. A running job that does not report has no `late`: its run time's spread
    is that of its kind's past runs, which the misses of started jobs already hold (with
    the arrivals that make most late starts), while one that ends early opens a slot
    before the range those misses give begins."""

    early: float
    late: float


def _sharing_blocked(cycle: _Cycle, request: GpuRequest) -> str | None:
    """Why a request finds no node now only because one more job would take a GPU past a
    sharing limit (its own or a holder's, `placement.sharing_rejection`); None when that is
    not what keeps it out, or no limit is in play (the usual case, answered at once)."""
    if request in cycle.sharing_blocked:
        return cycle.sharing_blocked[request]
    if cycle.held_by_node is None:  # the same for every request: gathered once a cycle
        cycle.held_by_node = {}
        for holder in cycle.holders:
            if holder.job.node in cycle.snapshot.nodes:
                cycle.held_by_node.setdefault(holder.job.node, []).extend(holder.job.grants)
        cycle.held_limits = any(g.sharing_limit for gs in cycle.held_by_node.values()
                                for g in gs)
    held = cycle.held_by_node
    why = None
    if request.sharing_limits or cycle.held_limits:
        for name in sorted(cycle.snapshot.nodes):
            state = cycle.snapshot.nodes[name].with_grants(held.get(name, ()))
            verdicts = gpu_verdicts(state, request)
            if isinstance(verdicts, str):
                continue
            fit = verdicts.count(None)
            sharing = [v for v in verdicts if v is not None and SHARING_WOULD_BREAK in v]
            if fit < request.count <= fit + len(sharing):
                why = (f"no GPU can take it without breaking an objective ({name}: "
                       f"{sharing[0]})")
                break
    cycle.sharing_blocked[request] = why
    return why


def _build_cycle(snapshot: ClusterSnapshot, config: AdmissionConfig) -> _Cycle:
    now = snapshot.now
    nodes = snapshot.nodes
    jobs = sorted(snapshot.jobs, key=lambda j: j.key)  # float sums in one order, always
    learned = learn_durations(jobs, config.duration_learning_rate, snapshot.learned)
    by_project: dict[str, list[Job]] = {}
    for job in jobs:
        by_project.setdefault(job.project, []).append(job)
    usage = {
        name: project_usage(quota, by_project.get(name, ()), now, config.fair_share_half_life_s,
                            snapshot.retired.get(name))
        for name, quota in snapshot.quotas.items()}
    memories = [g.memory_total_mib for n in nodes.values() for g in n.inventory.gpus]
    reference_mib = max(memories, default=DEFAULT_REFERENCE_MEMORY_MIB)
    timeline = Timeline(nodes, now, config.node_placer, config.timeline_memo)
    ledgers = {name: ProjectLedger(q, used_gpu_hours=usage[name].gpu_hours_used, now=now)
               for name, q in snapshot.quotas.items()}
    holders: list[_Holder] = []
    spans: dict[str, list[tuple[float, float, int]]] = {}
    spreads: dict[str, _Spread] = {}
    memo = config.timeline_memo
    kept = memo.holders if memo is not None else {}
    facts: dict[str, tuple[Job, NodeState | None, int, float, int]] = {}
    for job in (j for j in jobs if j.holds_gpus):
        # its GPU equivalents and memory: the same while the job, its node and the
        # reference are (most running jobs, from one cycle to the next)
        node = nodes.get(job.node)
        fact = kept.get(job.key)
        if (fact is None or fact[0] is not job or fact[1] is not node
                or fact[2] != reference_mib or job.placements):
            nominal = job_nominal_fraction(job, reference_mib)
            fact = (job, node, reference_mib, held_fraction(job, nodes, nominal),
                    _job_memory(job, reference_mib))
        facts[job.key] = fact
        fraction, memory = fact[3], fact[4]
        left = remaining(job, now, run_time(job, learned), config.min_remaining_s)
        remaining_s = left.expected
        if job.terminating:
            remaining_s = min(remaining_s, leaving_s(job))
        else:
            spreads[job.key] = _Spread(left.expected - left.low,
                                       left.high - left.expected if left.reported else 0.0)
        # a holder occupies at least the instant `now`, even at epoch times where a tiny
        # remainder added to `now` rounds back to `now`
        end = max(now + remaining_s, math.nextafter(now, math.inf))
        holder = _Holder(job, fraction, memory, end)
        holders.append(holder)
        if job.placements:  # a gang: each worker's GPUs on its own node
            for worker in job.placements:
                if worker.node in nodes:
                    timeline.add(worker.node, Occupancy(job.key, now, end, worker.grants))
        elif job.grants and job.node in nodes:
            grants = (lending.split(job.grants, job.lendable_mib, job.lendable_cores_pct)
                      if config.lending is not None else job.grants)
            timeline.add(job.node, Occupancy(job.key, now, end, grants))
        ledger = ledgers.get(job.project)
        if ledger is not None:
            claims = holder.claims = budget_claims(ledger.quota, fraction, now, job.started_at,
                                                   job.limit_s)
            ledger.add(fraction, memory, job.borrowed, claims)
            spans.setdefault(job.project, []).append((end, fraction, memory))
    if memo is not None:
        memo.holders = facts
    models = frozenset(g.model for n in nodes.values() for g in n.inventory.gpus)
    capacity = float(sum(1 for n in nodes.values() if n.inventory.ready
                         for g in n.inventory.gpus if g.healthy))
    leaving = {h.job.key for h in holders if h.job.terminating}
    by_project_holders: dict[str, list[_Holder]] = {}
    for holder in holders:
        by_project_holders.setdefault(holder.job.project, []).append(holder)
    victims = [h for h in holders if h.job.preemptible and not h.job.terminating
               and h.job.job_class is not JobClass.INTERACTIVE]
    return _Cycle(snapshot, config, learned, usage, reference_mib, timeline, ledgers, holders,
                  models, capacity, leaving=leaving, running_spans=spans,
                  holders_by_project=by_project_holders, spreads=spreads, victims=victims)


def _quota_free_at(cycle: _Cycle, quota: ProjectQuota, gpus: float, memory_mib: int
                   ) -> float | None:
    """Earliest time the project's own running jobs leave room for this much more use."""
    cap_g = quota.guaranteed_gpus if quota.guaranteed_gpus is not None else math.inf
    cap_m = quota.guaranteed_memory_mib if quota.guaranteed_memory_mib is not None else math.inf
    if gpus > cap_g + 1e-9 or memory_mib > cap_m:
        return None
    spans = sorted(cycle.running_spans.get(quota.name, []))
    times = [cycle.snapshot.now] + [end for end, _, _ in spans]
    for t in times:
        held_g = sum(f for end, f, _ in spans if end > t)
        held_m = sum(m for end, _, m in spans if end > t)
        if held_g + gpus <= cap_g + 1e-9 and held_m + memory_mib <= cap_m:
            return t
    return times[-1]


def _worth_preempting(cycle: _Cycle, job: Job, duration: float) -> bool:
    """`preemption.worth_preempting` with this cycle's counts, caps and the job's wait."""
    config = cycle.config
    now = cycle.snapshot.now

    def wait_s() -> float | None:
        eta = cycle.timeline.earliest(job.request, duration, now)
        return None if eta is None else eta.start - now

    return worth_preempting(len(cycle.preemptions), cycle.preempt_attempts,
                            config.max_preemptions_per_cycle,
                            config.max_preemption_attempts_per_cycle,
                            config.preempt_after_wait_s, wait_s)


def _preemption(cycle: _Cycle, job: Job, chosen: Candidate, node: str) -> Preemption:
    """Record one victim as leaving after its grace period and describe the decision."""
    victim = chosen.job
    now = cycle.snapshot.now
    cycle.leaving.add(victim.key)
    cycle.timeline.end_at(victim.key, now + leaving_s(victim))
    what = ("reclaims capacity borrowed by" if chosen.cause is PreemptionCause.RECLAIM
            else "needs the lent capacity held by" if chosen.cause is PreemptionCause.OWNER_RECLAIM
            else f"({job.job_class.label}) outranks")
    return Preemption(
        victim.key, job.key, victim.node or node, chosen.cause, victim.checkpoint_grace_s,
        chosen.lost_gpu_hours,
        f"{job.key} {what} {victim.key} ({victim.job_class.label}, project {victim.project}) "
        f"on {victim.node or node}; {chosen.lost_gpu_hours:.2f} GPU-hours since its last "
        f"checkpoint")


def _reclaim_lent(cycle: _Cycle) -> None:
    """Stop the borrowers of GPUs whose owners need their lent parts back (`lending`)."""
    by_node: dict[str, dict[str, tuple[float, tuple[GpuGrant, ...]]]] = {}
    for holder in cycle.holders:
        job = holder.job
        if any(g.borrowed for g in job.grants) and job.node in cycle.snapshot.nodes:
            by_node.setdefault(job.node, {})[job.key] = (job.started_at or 0.0, job.grants)
    now = cycle.snapshot.now
    holders = {h.job.key: h for h in cycle.holders}
    for node in sorted(by_node):
        state = cycle.timeline.state_during(node, now, math.nextafter(now, math.inf))
        for key in lending.reclaims(state, by_node[node], cycle.leaving):
            victim = holders[key].job
            gpus = {g.gpu_uuid for g in victim.grants}
            owner = max((h.job for h in cycle.holders if h.job.node == node
                         and h.job.key not in by_node[node]
                         and any(g.gpu_uuid in gpus for g in h.job.grants)),
                        key=lambda j: (sum(g.memory_mib for g in j.grants), j.key), default=None)
            lost = lost_gpu_hours(victim, holders[key].fraction, now)
            cycle.leaving.add(key)
            cycle.timeline.end_at(key, now + leaving_s(victim))
            lender = owner.key if owner is not None else "another job"
            cycle.preemptions.append(Preemption(
                key, owner.key if owner is not None else "", node,
                PreemptionCause.OWNER_RECLAIM, victim.checkpoint_grace_s, lost,
                f"{key} ran in GPU memory lent by {lender} on {node}, which now needs it "
                f"back; {lost:.2f} GPU-hours since its last checkpoint"))


def _own_leaving(cycle: _Cycle, project: str) -> list[_Holder]:
    """The project's in-quota jobs that were told to stop and still hold their GPUs."""
    return [h for h in cycle.holders_by_project.get(project, ())
            if not h.job.borrowed and h.job.key in cycle.leaving]


def _excess(ledger: ProjectLedger, fraction: float, memory: int, leaving: list[_Holder]
            ) -> tuple[float, float]:
    """How far (GPU equivalents, MiB) the job would put its project over its guarantee once
    `leaving` jobs are gone; (0, 0) if it fits."""
    quota = ledger.quota
    g_gpus = quota.guaranteed_gpus if quota.guaranteed_gpus is not None else math.inf
    g_mem = quota.guaranteed_memory_mib if quota.guaranteed_memory_mib is not None else math.inf
    gpus = ledger.in_quota_gpus - sum(h.fraction for h in leaving) + fraction - g_gpus
    mem = ledger.in_quota_memory_mib - sum(h.memory_mib for h in leaving) + memory - g_mem
    return (max(0.0, gpus) if gpus > 1e-9 else 0.0, max(0.0, mem))


def _victim_candidates(cycle: _Cycle, job: Job, in_quota: bool, gone: Set[str]
                       ) -> list[Candidate]:
    """The cycle's victims not in `gone` that `preemption.victim_cause` lets `job` preempt
    now, in `holders` order, with their cause and loss. What is each victim's alone (may it
    be preempted now, its level, its loss) is computed once a cycle, not once per search."""
    now = cycle.snapshot.now
    step = cycle.config.aging_step_s
    if cycle.victims_now is None:
        cycle.victims_now = [(h, effective_level(h.job, now, step),
                              lost_gpu_hours(h.job, h.fraction, now))
                             for h in cycle.victims if may_be_victim(h.job, now)]
    own = effective_level(job, now, step)
    return [Candidate(h.job, cause, lost) for h, level, lost in cycle.victims_now
            if h.job.key not in gone and h.job.key != job.key
            and (cause := cause_between(job.project, in_quota, own, h.job, level,
                                        job.preemptible)) is not None]


def _try_preempt(cycle: _Cycle, job: Job, in_quota: bool, duration: float) -> list[Preemption]:
    config = cycle.config
    now = cycle.snapshot.now
    budget = largest_plan(config.max_preemptions_per_cycle, len(cycle.preemptions))
    if budget <= 0:
        return []
    candidates = _victim_candidates(cycle, job, in_quota, cycle.leaving)
    plan = plan_preemption(job.request, duration, candidates, cycle.timeline,
                           frozenset(cycle.leaving))
    if plan is None or len(plan.victims) > budget:
        return []
    out = [_preemption(cycle, job, chosen, plan.node) for chosen in plan.victims]
    start = now + max(leaving_s(v.job) for v in plan.victims)
    cycle.timeline.add(plan.node, Occupancy(job.key, start, start + duration, plan.grants))
    return out


# ---------------------------------------------------------------- the cycle


def admission_cycle(snapshot: ClusterSnapshot, config: AdmissionConfig | None = None
                    ) -> CycleResult:
    """Decide, from one immutable snapshot, which jobs start, which stop and why others wait.

    Jobs that would start within their project's limits are decided first, in queue order;
    jobs that would borrow (beyond their guarantee, or on a spent PreemptibleOnly budget) come
    after them, in queue order, and take only what the first pass left idle. So a borrower
    never grabs the GPUs an owner just reclaimed from it.
    """
    config = config if config is not None else AdmissionConfig()
    cycle = _build_cycle(snapshot, config)
    now = snapshot.now
    _reclaim_lent(cycle)

    expiries = tuple(
        Expiry(h.job.key, now - started, h.job.max_duration_s, h.job.checkpoint_grace_s)
        for h in cycle.holders
        if h.job.phase is Phase.RUNNING and h.job.max_duration_s > 0
        and (started := h.job.started_at) is not None and now - started >= h.job.max_duration_s)
    past_max = {e.job_key for e in expiries}
    waiting = [j for j in snapshot.jobs if j.waiting]
    expiries += tuple(
        idle for h in cycle.holders if h.job.key not in past_max
        and (idle := idle_expiry(h.job, snapshot.quotas.get(h.job.project), now,
                                 _idle_wanted(h.job, snapshot, waiting, now))) is not None)

    durations = {j.key: expected_duration(j, cycle.learned) for j in waiting}
    expected_gpu_hours = {
        j.key: job_nominal_fraction(j, cycle.reference_mib) * durations[j.key] / 3600.0
        for j in waiting}
    weights = {name: q.weight for name, q in snapshot.quotas.items()}
    decayed = {name: u.decayed_gpu_hours for name, u in cycle.usage.items()}
    ranked = rank_queue(waiting, decayed, weights, now, config.aging_step_s, expected_gpu_hours,
                        config.keep_promises)

    walk = _QueueDecisions(cycle, durations, expected_gpu_hours)
    borrowers: list[tuple[int, Job]] = []
    position = 0
    for _, job in ranked:
        refusal = binding_refusal(job, snapshot.quotas)
        if refusal is not None:
            refused = (WaitReason.UNKNOWN_PROJECT if refusal.unknown_project
                       else WaitReason.UNBOUND_NAMESPACE)
            walk.waits.append(Wait(job.key, refused, refusal.message, 0, 0, None))
            continue
        beyond = class_limit_refusal(job, snapshot.quotas[job.project])
        if beyond is not None:
            walk.waits.append(Wait(job.key, WaitReason.CLASS_LIMIT, beyond, 0, 0, None))
            continue
        position += 1
        if not walk.decide_job(job, position, borrowers_allowed=False):
            borrowers.append((position, job))
    for position, job in borrowers:
        walk.decide_job(job, position, borrowers_allowed=True)

    recent = started_misses(snapshot.jobs, snapshot.start_misses)
    misses = wait_misses(recent)
    stretches = _RangeStretches(
        now, cycle.capacity_gpus, config,
        recent_arrivals(now, config.arrival_window_s,
                        _counted_arrivals(cycle, config.arrival_window_s))
        if len(misses) >= MIN_RANGE_SAMPLES else [],  # no ranges to widen yet
        {key.key: key.share for key, _ in ranked},
        {name: decayed.get(name, 0.0) / weights.get(name, 1.0) for name in snapshot.quotas})
    by_class = class_misses(recent, waiting, now) if config.class_calibration else {}
    by_key = {j.key: j for j in waiting}
    scenarios = _scenario_starts(cycle, walk)
    scenarios = _overdue_ahead(scenarios, walk.waits, ranked, expected_gpu_hours, now,
                               cycle.capacity_gpus, config.aging_step_s)
    simulated = (replace(w, estimated_start=scenarios[w.job_key],
                         simulated_start=scenarios[w.job_key])
                 if w.job_key in scenarios and w.simulated_start is not None else w
                 for w in walk.waits)
    ordered = sorted((_due_told(_told(_with_range(
        _calibrated(w, by_key, now, by_class, config), now, misses,
        stretches.of(by_key[w.job_key]),
        walk.start_spreads.get(w.job_key)), now,
        walk.told_after.get(w.job_key)), by_key, now, config)
        for w in simulated), key=lambda w: (w.position, w.job_key))
    # positions among the jobs still queued after this cycle (refused jobs have none)
    queued = iter(range(1, len(ordered) + 1))
    waits = tuple(w if w.reason.refused else replace(w, position=next(queued))
                  for w in ordered)
    projects = _project_statuses(cycle, walk.admitted_by_project, waits)
    return CycleResult(now, tuple(walk.admissions), tuple(cycle.preemptions), waits, expiries,
                       projects)


def _overdue_ahead(starts: Mapping[str, float], waits: list[Wait],
                   ranked: list[tuple[RankKey, Job]], gpu_hours: Mapping[str, float],
                   now: float, capacity_gpus: float, aging_step_s: float) -> dict[str, float]:
    """The simulated starts of the waiting jobs (`starts` where scenarios gave one, else their
    wait's), each pushed back by the work of the older jobs now ranked behind it that will
    be overdue before it starts, drained at the cluster's rate (`overdue_pushed`).

    The forward simulation keeps today's queue order, but jobs age as they wait: an older
    job that becomes overdue ranks ahead of every job submitted after it (fairshare), so a
    wait that reaches past that is a wait behind its work too. On a replayed trace at 85 %
    load, interactive jobs told about an hour during a surge waited 4 to 5 hours while 120
    to 140 older long and batch jobs, overdue by then, started first; in such a surge the
    interactive jobs rank behind the overdue ones and so fall beyond the reservation depth,
    where their coarse estimates move too. A job's start moves only past the overdue time of
    such a job, so short waits keep the simulation's start."""
    if aging_step_s <= 0 or capacity_gpus <= 0:
        return dict(starts)
    # the jobs still waiting: one admitted this cycle runs now, its work already simulated
    still = {wait.job_key for wait in waits}
    ranked = [(key, job) for key, job in ranked if job.key in still]
    places = {job.key: place for place, (_, job) in enumerate(ranked)}
    asked: dict[int, float] = {}
    for wait in waits:
        place = places.get(wait.job_key)
        if wait.simulated_start is None or wait.estimated_start is None or place is None:
            continue
        asked[place] = starts.get(wait.job_key, wait.estimated_start)
    queue = [Queued(job.submitted_at, int(job.job_class) - OVERDUE_LEVEL,
                    job.submitted_at + (int(job.job_class) - OVERDUE_LEVEL) * aging_step_s,
                    gpu_hours.get(job.key, 0.0)) for _, job in ranked]
    found = dict(starts)
    for place, pushed in overdue_pushed(queue, asked, now, capacity_gpus).items():
        found[ranked[place][1].key] = pushed
    return found


class Queued(NamedTuple):
    """A queued job as `overdue_pushed` sees it: when it was submitted, its aging steps to
    overdue (one group per count: their overdue times keep their submit order), when it is
    overdue, and its expected GPU-hours."""

    submitted: float
    steps: int
    overdue_at: float
    gpu_hours: float


# fixed-point rounds of one start: each round adds the work of the jobs overdue before the
# start it pushed to; real queues settle in two or three, this only bounds pathological ones
MAX_OVERDUE_ROUNDS = 64


def overdue_pushed(queue: list[Queued], asked: Mapping[int, float], now: float,
                   capacity_gpus: float) -> dict[int, float]:
    """For each place in `asked` (an index into `queue`, in rank order) with start S, the
    earliest T >= S with T = S + W(T) / capacity, W(T) the GPU-hours of the jobs ranked
    behind it, submitted before it and overdue after `now` but before T; only the starts
    that move are returned.

    One sweep from the back of the queue: each group of jobs with the same aging steps keeps
    a Fenwick tree of work over its submit order, in which both "submitted before the job"
    and "overdue before T" are prefixes, so a start costs a few log-time lookups per round
    rather than a scan of the queue: the whole queue is estimated in O(n log n)."""
    if not asked or capacity_gpus <= 0:
        return {}
    groups: dict[int, tuple[list[float], list[float], list[float]]] = {}
    slot: list[int] = [0] * len(queue)
    by_steps: dict[int, list[tuple[float, int]]] = {}
    for place, job in enumerate(queue):
        if job.overdue_at >= now:
            by_steps.setdefault(job.steps, []).append((job.submitted, place))
    for steps, members in by_steps.items():
        members.sort()
        for index, (_, place) in enumerate(members):
            slot[place] = index + 1
        groups[steps] = ([queue[p].submitted for _, p in members],
                         [queue[p].overdue_at for _, p in members],
                         [0.0] * (len(members) + 1))
    drain = 3600.0 / capacity_gpus
    earliest_overdue = math.inf
    found: dict[int, float] = {}
    for place in range(len(queue) - 1, -1, -1):
        start = asked.get(place)
        if start is not None and start > earliest_overdue:
            submitted = queue[place].submitted
            pushed = start
            for _ in range(MAX_OVERDUE_ROUNDS):
                work = 0.0
                for subs, overdue, tree in groups.values():
                    index = min(bisect.bisect_left(subs, submitted),
                                bisect.bisect_left(overdue, pushed))
                    while index > 0:
                        work += tree[index]
                        index -= index & -index
                    # (a Fenwick prefix sum: the work of the first `index` in submit order)
                if start + work * drain <= pushed:
                    break
                pushed = start + work * drain
            if pushed > start:
                found[place] = pushed
        job = queue[place]
        if job.overdue_at >= now:
            tree = groups[job.steps][2]
            index = slot[place]
            while index < len(tree):
                tree[index] += job.gpu_hours
                index += index & -index
            earliest_overdue = min(earliest_overdue, job.overdue_at)
    return found


def _counted_arrivals(cycle: _Cycle, window_s: float) -> list[Arrival]:
    """What `estimate_ranges.overtaking_load` may count: the snapshot's arrivals of jobs gone,
    and of the jobs present within the window the latest `RATE_ARRIVALS` of each class and
    project (no job counts more of those, above its class or of its class from lighter
    projects), so the work they bring is computed for those only."""
    snapshot = cycle.snapshot
    by_group: dict[tuple[int, str], list[Job]] = {}
    for job in snapshot.jobs:
        if snapshot.now - job.submitted_at <= window_s:
            by_group.setdefault((int(job.job_class), job.project), []).append(job)
    latest = (job for jobs in by_group.values()
              for job in heapq.nlargest(RATE_ARRIVALS, jobs,
                                        key=lambda j: (j.submitted_at, j.key)))
    return [*(Arrival(*arrival) for arrival in snapshot.recent_arrivals), *(
        Arrival(job.submitted_at, int(job.job_class),
                arrival_work(job, job_nominal_fraction(job, cycle.reference_mib), cycle.learned),
                job.project)
        for job in latest)]


def _calibrated(wait: Wait, jobs: Mapping[str, Job], now: float,
                misses: Mapping[int, list[float]], config: AdmissionConfig) -> Wait:
    """The wait with its simulated start calibrated by its class's misses (eta.
    calibrated_start), and no later than the start the job was promised: from then on it
    is due and ranks ahead of the work that would delay it (fairshare)."""
    job = jobs.get(wait.job_key)
    simulated = wait.estimated_start
    if simulated is None or wait.simulated_start is None or job is None:
        return wait
    start = calibrated_start(now, simulated, misses.get(int(job.job_class), ()),
                             next_aging(job, now, config.aging_step_s))
    promised = promised_start(job) if config.keep_promises else None
    if promised is not None and promised > now:
        start = min(start, promised)
    return replace(wait, estimated_start=start, simulated_start=simulated)


def _told(wait: Wait, now: float, after: str | None) -> Wait:
    """The wait whose estimate the forward simulation made (`after` not None), its message
    ending in that estimate as finally given (calibrated), then `after`: the message is
    written once the estimate is final, so the two always agree."""
    if after is None:
        return wait
    told = wait.message
    if wait.estimated_start is not None:
        told += f"; estimated start in {format_duration(wait.estimated_start - now)}"
    return replace(wait, message=told + after)


# how a due job's wait message ends (`_due_told`); the operator writes its appearance at once
DUE_NOTE = "past its first estimated start, it ranks ahead of all but interactive work"


def _due_told(wait: Wait, jobs: Mapping[str, Job], now: float, config: AdmissionConfig
              ) -> Wait:
    """The wait of a due job (fairshare) saying so: why it now ranks ahead of work of higher
    classes that arrived after it."""
    job = jobs.get(wait.job_key)
    if (not config.keep_promises or job is None
            or promised_start_due(job, now, config.aging_step_s) == NOT_DUE):
        return wait
    return replace(wait, message=f"{wait.message}; {DUE_NOTE}")


class _RangeStretches:
    """How much each waiting job's wait stretches if the work that may pass it keeps arriving
    (`estimate_ranges.wait_stretch`): until its promised start, the classes above it and its
    own class's jobs of projects lighter than its place in the queue (`overtaking_load`);
    with promises kept, after it only the classes above the level it is then due at
    (`fairshare.due_level`; no job of its class passes a due job). Memoised by class and
    set of lighter projects: a cycle has few of each."""

    def __init__(self, now: float, capacity_gpus: float, config: AdmissionConfig,
                 recent: list[Arrival], shares: Mapping[str, float],
                 project_shares: Mapping[str, float]) -> None:
        self.now, self.capacity_gpus, self.config = now, capacity_gpus, config
        self.recent, self.shares = recent, shares
        self.by_share = sorted((used, name) for name, used in project_shares.items())
        self.loads: dict[tuple[int, frozenset[str]], float] = {}
        self.lighter: dict[tuple[int, str], frozenset[str]] = {}

    def load(self, level: int, lighter: frozenset[str]) -> float:
        found = self.loads.get((level, lighter))
        if found is None:
            found = overtaking_load(self.now, self.capacity_gpus, self.recent, level,
                                    lighter) or 0.0
            self.loads[(level, lighter)] = found
        return found

    def of(self, job: Job) -> float:
        if not self.recent:
            return 1.0
        level = int(job.job_class)
        # the projects used less than the job's place in the queue: a prefix by usage
        prefix = bisect.bisect_left(self.by_share, (self.shares.get(job.key, 0.0), ""))
        lighter = self.lighter.get((prefix, job.project))
        if lighter is None:
            lighter = frozenset(name for _, name in self.by_share[:prefix]
                                if name != job.project)
            self.lighter[(prefix, job.project)] = lighter
        when_due = due_level(level) if self.config.keep_promises else level
        passing = (self.load(when_due, frozenset()) if self.config.keep_promises
                   else self.load(level, lighter))
        return wait_stretch(self.load(level, lighter), passing)


def _with_range(wait: Wait, now: float, misses: list[float], stretch: float,
                spread: _Spread | None = None) -> Wait:
    """The wait with its 80 % range (`estimate_ranges.start_range`), whose end reaches at least the
    estimated wait stretched by `stretch` (`_RangeStretches`): the estimate is the
    queue as it stands, the range's end what it becomes if higher classes keep arriving as
    they lately have (a surge the misses of started jobs show only a wait later). A job
    whose start is the end of a running job, or of a reservation behind one (`spread`,
    `_QueueDecisions._spread_behind`), gets at least that end's own range: how the misses of
    started jobs spread says little of how far this one job's progress or run time leaves
    it (on openb at half reporting, jobs that waited over a day started mostly before a
    range made from those misses alone began)."""
    if wait.estimated_start is None:
        return wait
    found = start_range(now, wait.estimated_start, misses)
    if found is None:
        return wait
    stretched = now + max(0.0, wait.estimated_start - now) * stretch
    low, high = found[0], max(found[1], stretched)
    if spread is not None:
        low = min(low, max(now, wait.estimated_start - spread.early))
        high = max(high, wait.estimated_start + spread.late)
    return replace(wait, estimated_start_low=low, estimated_start_high=high)


class _Reserved(NamedTuple):
    """A slot `_reserve` found, as `Timeline.earliest` was asked for it."""

    job: Job
    duration: float
    not_before: float
    yielding: dict[str, float]
    protected: dict[str, float]
    max_victims: int | None


def _scenario_starts(cycle: _Cycle, walk: _QueueDecisions) -> dict[str, float]:
    """The estimated start of each job `_reserve` gave a slot: the median of its start over
    `AdmissionConfig.start_scenarios` forward simulations, in each of which every running
    job ends at a draw of its remaining time (`run_times.remaining_quantiles`) and every job
    started or reserved runs a draw of its run time, the reservations made again in queue
    order. Decisions stay with the cycle's own simulation (every time as expected); only
    the estimates come from the scenarios.

    A waiting job waits for the first of several running jobs to end. One simulation with
    every end at its expectation puts that first end wherever the expectations happen to
    fall: right on median over many jobs and scattered job by job. The scenarios' median
    is that of the first end. Empty when no time has a spread (every scenario would be the
    cycle's own simulation)."""
    count = cycle.config.start_scenarios
    if count <= 0 or not walk.reserved:
        return {}
    now = cycle.snapshot.now
    config = cycle.config
    fixed = {p.victim_key for p in cycle.preemptions} | cycle.leaving
    ends: dict[str, list[float]] = {}  # per running job with a spread: its end per scenario
    floor = math.nextafter(now, math.inf)
    for holder in cycle.holders:
        job = holder.job
        if job.key in fixed:
            continue
        times = run_time(job, cycle.learned)
        if job.progress is None and not times[0] < times[2]:
            continue  # no spread: its end as the cycle planned it (`holder.end`)
        ends[job.key] = [max(now + left, floor) for left in remaining_quantiles(
            job, now, times, config.min_remaining_s, scenario_quantiles(job.key, count))]
    jobs = {j.key: j for j in cycle.snapshot.jobs}
    runs: dict[str, list[float]] = {}  # per job started or reserved: its run time per scenario
    for key in [a.job_key for a in walk.admissions] + [r.job.key for r in walk.reserved]:
        low, expected, high = run_time(jobs[key], cycle.learned)
        duration = walk.durations[key]
        runs[key] = [duration * split_quantile(low, expected, high, q) / expected
                     for q in scenario_quantiles(key, count)]
    if all(len(set(v)) == 1 for v in (*ends.values(), *runs.values())):
        return {}
    planned = {h.job.key: h.end for h in cycle.holders if h.job.key not in fixed}
    memo = config.timeline_memo
    if memo is None:  # the scenarios share what they ask of the placer
        memo = TimelineMemo()
        memo.bind(config.node_placer)
    again = {r.job.key for r in walk.reserved}
    admitted = {a.job_key for a in walk.admissions}
    main = cycle.timeline
    starts: dict[str, list[float]] = {}
    for k in range(count):
        timeline = Timeline(cycle.snapshot.nodes, now, config.node_placer, memo, bind=False)
        for node in main.node_names:
            for o in main.occupancies(node):
                if o.job_key in again:
                    continue
                key = o.job_key
                end = (ends[key][k] if key in ends else planned[key] if key in planned
                       else now + runs[key][k] if key in admitted else o.end)
                timeline.add(node, Occupancy(o.job_key, o.start, end, o.grants))
        for r in walk.reserved:
            found = timeline.earliest(r.job.request, r.duration, r.not_before, r.yielding,
                                      r.protected, r.max_victims)
            if found is None:
                continue
            for victim in found.displaces:
                timeline.end_at(victim, found.start)
            timeline.add(found.node, Occupancy(r.job.key, found.start,
                                               found.start + runs[r.job.key][k], found.grants))
            starts.setdefault(r.job.key, []).append(found.start)
    return {key: statistics.median(found) for key, found in starts.items()}


class _Parked(NamedTuple):
    """Why a job waits, from when it could start at the earliest, whether a start can be
    estimated at all, and how it may preempt once allowed to start: as a job within its
    project's guarantee (`in_quota` True), as a borrower (False), or not at all (None)."""

    reason: WaitReason
    message: str
    not_before: float
    estimable: bool = True
    in_quota: bool | None = None


class _QueueDecisions:
    """The per-job decisions of one cycle, in the order jobs are considered."""

    def __init__(self, cycle: _Cycle, durations: Mapping[str, float],
                 expected_gpu_hours: Mapping[str, float]) -> None:
        self.cycle = cycle
        self.durations = durations
        self.expected_gpu_hours = expected_gpu_hours
        self.admissions: list[Admission] = []
        self.waits: list[Wait] = []
        self.admitted_by_project: dict[str, list[tuple[float, bool, float]]] = {}
        self.reservations = 0  # of jobs waiting for GPUs
        self.limit_reservations = 0  # of jobs waiting for their quota or budget
        self.latest_reserved = cycle.snapshot.now
        self.start_spreads: dict[str, _Spread] = {}  # waiting jobs behind a known spread
        self.reserved: list[_Reserved] = []  # `_reserve`'s slots, in order (`_scenario_starts`)
        self.work_beyond_depth = 0.0
        self.ahead = 0  # jobs decided so far that wait for GPUs
        # per job whose estimate the forward simulation made: what its message says after
        # the estimated start, which is added once final (`_told`)
        self.told_after: dict[str, str] = {}
        # `_yielding`'s candidates in order: (job, when it may first be preempted, its
        # effective level then, how long it keeps its GPUs once told to stop)
        self._victims: list[tuple[Job, float, int, float]] | None = None
        self._victim_times: list[float] = []  # their distinct times, in order
        self._victim_keys: set[str] = set()
        # `_yielding`'s answers, by what they depend on (see there); never changed once given
        self._yielded: dict[tuple[str, bool, bool, int, tuple[int, ...]],
                            tuple[dict[str, float], dict[str, float]]] = {}
        self._domains: dict[TopologyLevel, tuple[Domain, ...]] | None = None  # (gangs)
        self._gang_never: dict[tuple[tuple[GpuRequest, ...], TopologyNeed | None],
                               str | None] = {}

    def _wait(self, job: Job, reason: WaitReason, message: str, position: int,
              estimate: float | None = None, coarse: bool = False,
              simulated: bool = False, after_estimate: str = "",
              held_by: WaitReason | None = None) -> None:
        """Record a wait; a `simulated` estimate is still to be calibrated, and its message
        gets the estimated start and `after_estimate` once it is final (`_told`). `held_by`:
        what holds the job beyond `reason` (a backoff's), which decides whether it counts
        among the jobs waiting for GPUs."""
        self.waits.append(Wait(job.key, reason, message, position, self.ahead, estimate, coarse,
                               simulated_start=estimate if simulated else None))
        if simulated:
            self.told_after[job.key] = after_estimate
        if (held_by or reason).competes_for_capacity:
            self.ahead += 1

    def decide_job(self, job: Job, position: int, borrowers_allowed: bool) -> bool:
        """Admit, preempt for, or park one job; False if it would borrow and borrowers are not
        considered yet (the caller comes back to it).

        A job still in its requeue backoff is judged as any other, so its estimate follows its
        project's quota and budget and counts on the jobs it may preempt, but it is neither
        admitted nor does it preempt before the backoff is over (`_park` says why it waits)."""
        if job.workers:
            return self._decide_gang(job, position, borrowers_allowed)
        if self._never_fits(job, position):
            return True
        cycle = self.cycle
        now = cycle.snapshot.now
        duration = self.durations[job.key]
        slot, fraction, memory = self._slot_now(job, duration)
        ledger = cycle.ledgers[job.project]
        claims = budget_claims(ledger.quota, fraction, now, None, job.limit_s)
        verdict = judge(job, ledger, fraction, memory, claims)
        if verdict.borrowed and not borrowers_allowed:
            return False
        ready = job.not_before <= now  # not in a requeue backoff
        if ready and verdict.standing.may_start and slot is not None:
            self._admit(job, position, slot, duration, fraction, memory, verdict, claims)
            return True
        parked: _Parked | None
        if verdict.standing is Standing.OVER_BUDGET:
            parked = self._over_budget(job, verdict, fraction)
        elif verdict.standing is Standing.OVER_QUOTA:
            parked = self._over_quota(job, position, verdict, fraction, memory, duration, ready)
        else:
            parked = self._no_room(job, position, verdict, fraction, memory, duration, claims,
                                   ready)
        if parked is not None:
            self._park(job, position, duration, parked)
        return True

    # -- gangs: all or nothing (core.gangs) ----------------------------------------------

    def _decide_gang(self, job: Job, position: int, borrowers_allowed: bool) -> bool:
        """`decide_job` for a gang: admitted whole, every worker placed by one `place_gang`
        decision, or not at all; judged by its project's limits as one job (the sum of its
        workers). Without room it may preempt (`_preempt_for_gang`); else it waits, reserving
        the earliest time the forward simulation holds it whole (`_reserve_gang`), so jobs
        behind it only backfill around that."""
        cycle = self.cycle
        now = cycle.snapshot.now
        too_large = self._gang_never_fits(job)
        if too_large is not None:
            self._wait(job, WaitReason.TOO_LARGE, too_large, position)
            return True
        duration = self.durations[job.key]
        placement = self._place_gang_at(job, now, now + duration)
        if placement is not None:
            fraction = self._gang_fraction(job, placement)
            memory = sum(g.memory_mib for w in placement.workers for g in w.grants)
        else:
            fraction = job_nominal_fraction(job, cycle.reference_mib)
            memory = _job_memory(job, cycle.reference_mib)
        ledger = cycle.ledgers[job.project]
        claims = budget_claims(ledger.quota, fraction, now, None, job.limit_s)
        verdict = judge(job, ledger, fraction, memory, claims)
        if verdict.borrowed and not borrowers_allowed:
            return False
        if job.not_before <= now and verdict.standing.may_start and placement is not None:
            self._admit_gang(job, position, placement, duration, fraction, memory, verdict,
                             claims)
            return True
        if verdict.standing is Standing.OVER_BUDGET:
            parked: _Parked | None = self._over_budget(job, verdict, fraction)
        elif verdict.standing is Standing.OVER_QUOTA:
            parked = self._over_quota(job, position, verdict, fraction, memory, duration,
                                      may_preempt=False)
        else:
            reason, message = self._gang_capacity_reason(job, duration)
            in_quota = verdict.standing is Standing.IN_QUOTA
            if (reason is WaitReason.CAPACITY and job.not_before <= now
                    and not verdict.budget_exhausted):
                preempted = self._preempt_for_gang(job, in_quota, duration)
                if preempted:
                    ledger.add(fraction, memory, verdict.borrowed, claims)
                    self._wait_for_victims(job, position, preempted, "")
                    return True
            if verdict.budget_exhausted:
                message = f"{verdict.message}; {message}"
            parked = _Parked(reason, message, now, in_quota=(
                None if verdict.budget_exhausted else in_quota))
        if parked is not None:
            self._park_gang(job, position, duration, parked)
        return True

    def _preempt_for_gang(self, job: Job, in_quota: bool, duration: float
                          ) -> list[Preemption]:
        """The fewest running jobs the gang may preempt (`preemption.victim_cause`) whose
        leaving lets it be placed whole: taken in the order victims are preferred until it
        fits, then any not needed dropped; the gang keeps a reservation where they were.
        Within this cycle's caps; none if it would not fit even so."""
        cycle = self.cycle
        config = cycle.config
        now = cycle.snapshot.now
        budget = largest_plan(config.max_preemptions_per_cycle, len(cycle.preemptions))
        if budget <= 0 or cycle.preempt_attempts >= config.max_preemption_attempts_per_cycle:
            return []
        cycle.preempt_attempts += 1
        candidates = sorted(_victim_candidates(cycle, job, in_quota, cycle.leaving),
                            key=lambda c: c.preference)[:MAX_GANG_VICTIM_SEARCH]
        leaving = frozenset(cycle.leaving)

        def fits(chosen: list[Candidate]) -> GangPlacement | None:
            gone = leaving | {c.job.key for c in chosen}
            return self._place_gang_at(job, now, now + duration, without=gone)

        chosen: list[Candidate] = []
        for candidate in candidates:
            chosen.append(candidate)
            if fits(chosen) is not None:
                break
        else:
            return []
        for candidate in reversed(chosen[:-1]):
            trial = [c for c in chosen if c is not candidate]
            if fits(trial) is not None:
                chosen = trial
        placement = fits(chosen)
        if placement is None or len(chosen) > budget:
            return []
        out = [_preemption(cycle, job, c, placement.workers[0].node) for c in chosen]
        start = now + max(leaving_s(c.job) for c in chosen)
        for worker in placement.workers:
            cycle.timeline.add(worker.node, Occupancy(job.key, start, start + duration,
                                                      worker.grants))
        cycle.preemptions.extend(out)
        return out

    def _gang_never_fits(self, job: Job) -> str | None:
        """Why no placement could ever hold the gang, even on an empty cluster; None if one
        could (asked once per cycle for each gang shape and topology)."""
        key = (job.workers, job.topology)
        if key not in self._gang_never:
            self._gang_never[key] = self._gang_never_fits_now(job)
        return self._gang_never[key]

    def _gang_never_fits_now(self, job: Job) -> str | None:
        cycle = self.cycle
        for request in dict.fromkeys(job.workers):
            if not cycle.timeline.fits_anywhere_ever(request):
                return (f"no node could hold a worker of {request.count} GPU(s) of "
                        f"{request.memory_mib // 1024} GiB ({request.isolation.value}) even if "
                        f"it were empty")
        empty = {name: NodeState(node.inventory) for name, node in cycle.snapshot.nodes.items()}
        if place_gang(job.workers, empty, cycle.config.node_placer, job.topology,
                      index=self._domain_index()) is not None:
            return None
        if job.topology is not None and job.topology.mode is TopologyMode.REQUIRED:
            return (f"no {job.topology.level.label} domain could hold all {len(job.workers)} "
                    f"workers ({job.gpu_count} GPUs) even if it were empty "
                    f"(spec.topology.mode is required)")
        return (f"the cluster could not hold all {len(job.workers)} workers "
                f"({job.gpu_count} GPUs) at once even if it were empty")

    def _place_gang_at(self, job: Job, start: float, end: float, topology: bool = True,
                       without: frozenset[str] = frozenset()) -> GangPlacement | None:
        """The gang placed over [start, end) around everything the timeline holds then
        (running jobs and the reservations of higher-ranked ones), within its topology (or,
        without `topology`, anywhere). Fits come from the timeline's memo, shared with every
        other question of the cycle."""
        timeline = self.cycle.timeline
        states = {name: timeline.state_during(name, start, end, without)
                  for name in timeline.node_names}
        return place_gang(job.workers, states, self.cycle.config.node_placer,
                          job.topology if topology else None,
                          lambda name, request: timeline.fit_during(name, request, start, end,
                                                                    without),
                          self._domain_index())

    def _domain_index(self) -> dict[TopologyLevel, tuple[Domain, ...]]:
        if self._domains is None:
            self._domains = domain_index(n.inventory
                                         for n in self.cycle.snapshot.nodes.values())
        return self._domains

    def _gang_fraction(self, job: Job, placement: GangPlacement) -> float:
        nodes = self.cycle.snapshot.nodes
        return sum(grants_fraction(w.grants, nodes[w.node].inventory, job.request.isolation)
                   for w in placement.workers)

    def _admit_gang(self, job: Job, position: int, placement: GangPlacement, duration: float,
                    fraction: float, memory: int, verdict: Verdict,
                    claims: Mapping[float, float]) -> None:
        """Start every worker of the gang: charge its project once, hold each worker's GPUs."""
        cycle = self.cycle
        now = cycle.snapshot.now
        ledger = cycle.ledgers[job.project]
        reserve = claims.get(ledger.current_period, 0.0)
        ledger.add(fraction, memory, verdict.borrowed, claims)
        for worker in placement.workers:
            cycle.timeline.add(worker.node, Occupancy(job.key, now, now + duration,
                                                      worker.grants))
        cycle.running_spans.setdefault(job.project, []).append((now + duration, fraction, memory))
        self.admitted_by_project.setdefault(job.project, []).append(
            (fraction, verdict.borrowed, reserve))
        nodes = placement.nodes
        shown = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
        where = ("" if placement.level.name == "CLUSTER"
                 else f" within {placement.level.label} {placement.domain}")
        self.admissions.append(Admission(
            job.key, placement.workers[0].node,
            tuple(g for w in placement.workers for g in w.grants), verdict.borrowed, fraction,
            job.attempts + 1, position,
            f"admitted as a gang of {len(placement.workers)} workers on {shown}{where}: "
            f"{verdict.message}", workers=placement.workers))

    def _gang_capacity_reason(self, job: Job, duration: float) -> tuple[WaitReason, str]:
        """Why a gang the project's limits allow finds no placement now."""
        now = self.cycle.snapshot.now
        size = f"all {len(job.workers)} workers ({job.gpu_count} GPUs)"
        need = job.topology
        if (need is not None and need.mode is TopologyMode.REQUIRED
                and self._place_gang_at(job, now, now + duration, topology=False) is not None):
            return (WaitReason.TOPOLOGY,
                    f"no {need.level.label} domain has room for {size} now; the cluster has, "
                    f"spread wider, but spec.topology.mode is required")
        if self._place_gang_at(job, now, math.nextafter(now, math.inf)) is not None:
            return (WaitReason.BEHIND_HIGHER_RANKED,
                    f"GPUs for {size} are free but reserved for {self.ahead} higher-ranked "
                    f"waiting job(s) this gang would delay")
        return (WaitReason.CAPACITY,
                f"no set of nodes has room for {size} now, and a gang starts whole or not at "
                f"all; {self.ahead} higher-ranked job(s) wait for GPUs")

    def _park_gang(self, job: Job, position: int, duration: float, parked: _Parked) -> None:
        """`_park` for a gang: its wait, with the start `_reserve_gang` finds."""
        now = self.cycle.snapshot.now
        limits = parked.reason in (WaitReason.QUOTA, WaitReason.BUDGET)
        estimate, coarse = (self._reserve_gang(job, duration,
                                               max(parked.not_before, job.not_before), limits)
                            if parked.estimable else (None, False))
        reason, message = parked.reason, parked.message
        if job.not_before > now:
            reason = WaitReason.REQUEUE_BACKOFF
            message = (f"its last attempt failed through no fault of its own; next attempt in "
                       f"{format_duration(job.not_before - now)}; {parked.message}")
        self._wait(job, reason, message, position, estimate, coarse, simulated=True,
                   held_by=parked.reason)

    def _reserve_gang(self, job: Job, duration: float, not_before: float, limits: bool
                      ) -> tuple[float | None, bool]:
        """Reserve the gang's earliest whole placement (within the reservation depth): tried
        at `not_before` and at each of the next `MAX_GANG_STARTS` times an occupancy ends;
        a coarse drain-rate estimate beyond the depth or that horizon."""
        cycle = self.cycle
        used = self.limit_reservations if limits else self.reservations
        if used < cycle.config.reservation_depth:
            times = [not_before, *(t for t in cycle.timeline.end_times() if t > not_before)]
            for start in times[:MAX_GANG_STARTS]:
                placement = self._place_gang_at(job, start, start + duration)
                if placement is None:
                    continue
                for worker in placement.workers:
                    cycle.timeline.add(worker.node, Occupancy(job.key, start, start + duration,
                                                              worker.grants))
                if limits:
                    self.limit_reservations += 1
                else:
                    self.reservations += 1
                    self.latest_reserved = max(self.latest_reserved, start)
                return start, False
        estimate = max(not_before, fluid_start(self.latest_reserved, self.work_beyond_depth,
                                               cycle.capacity_gpus))
        self.work_beyond_depth += self.expected_gpu_hours[job.key]
        return estimate, True

    def _never_fits(self, job: Job, position: int) -> bool:
        """Park a job no GPU in the cluster could ever hold (model, size); True if it was."""
        cycle = self.cycle
        request = job.request
        if request.models and not request.models & cycle.models:
            self._wait(job, WaitReason.NO_MATCHING_GPU_MODEL,
                       f"no node has a GPU of model {', '.join(sorted(request.models))}; "
                       f"the cluster has {', '.join(sorted(cycle.models)) or 'no GPUs'}",
                       position)
            return True
        if request.node_selector and not any(
                request.node_selector <= n.inventory.labels for n in cycle.snapshot.nodes.values()):
            self._wait(job, WaitReason.NO_MATCHING_NODE,
                       "no GPU node has the labels of its spec.template.spec.nodeSelector ("
                       + ", ".join(f"{k}={v}" for k, v in sorted(request.node_selector)) + ")",
                       position)
            return True
        if not cycle.timeline.fits_anywhere_ever(request):
            passing = cycle.held_back.get(request)
            if passing is None:
                passing = cycle.held_back[request] = sorted(
                    (name, why) for name, node in cycle.snapshot.nodes.items()
                    if (why := rejection_by_conditions(node.inventory, request)))
            if passing:  # a node could hold it but for a hot, sick or cordoned GPU
                shown = "; ".join(f"{name}: {why}" for name, why in passing[:3])
                self._wait(job, WaitReason.CAPACITY,
                           f"no node can take {request.count} GPU(s) of "
                           f"{request.memory_mib // 1024} GiB ({request.isolation.value}) while "
                           f"its GPUs are as they are now ({shown})", position)
                return True
            self._wait(job, WaitReason.TOO_LARGE,
                       f"no node could hold {request.count} GPU(s) of "
                       f"{request.memory_mib // 1024} GiB ({request.isolation.value}) even if "
                       f"it were empty", position)
            return True
        return False

    def _slot_now(self, job: Job, duration: float) -> tuple[Slot | None, float, int]:
        """The best slot from now for the job's expected run (None: none), and the GPU
        equivalents and memory it would hold there (nominal ones without a slot)."""
        cycle = self.cycle
        request = job.request
        slot = None
        if duration < cycle.now_fail.get(request, math.inf):
            slot = cycle.timeline.best_now(request, duration)
            if slot is None:
                cycle.now_fail[request] = duration
        if slot is None and job.not_before <= cycle.snapshot.now:
            slot = self._lent_slot(job, request)
        if slot is None and job.placement_floor is not None:
            slot = self._piece_slot(job, job.placement_floor, duration)
        if slot is not None:
            fraction = grants_fraction(slot.grants, cycle.snapshot.nodes[slot.node].inventory,
                                       request.isolation)
            return slot, fraction, _memory_of(request, slot.grants, cycle.reference_mib)
        return (None, nominal_fraction(request, cycle.reference_mib),
                _memory_of(request, (), cycle.reference_mib))

    def _piece_slot(self, job: Job, floor: GpuRequest, duration: float) -> Slot | None:
        """Where no GPU holds a job placed by its calibrated size: the best piece, free or
        lent, that holds its `Job.placement_floor`, granted that piece up to its calibrated
        size (`_widened`). The tightest fitting GPU is the node placer's; a piece smaller than
        every waiting job's calibrated size is otherwise left idle until a neighbour ends."""
        cycle = self.cycle
        now = cycle.snapshot.now
        slot = None
        if duration < cycle.now_fail.get(floor, math.inf):
            slot = cycle.timeline.best_now(floor, duration)
            if slot is None:
                cycle.now_fail[floor] = duration
        if slot is not None:
            state = cycle.timeline.state_during(slot.node, now, now + duration)
        elif job.not_before <= now and (slot := self._lent_slot(job, floor)) is not None:
            state = lending.borrower_view(
                cycle.timeline.state_during(slot.node, now, math.nextafter(now, math.inf)))
        else:
            return None
        free = {f.gpu.uuid: f for f in state.free()}
        return replace(slot, grants=tuple(_widened(g, free[g.gpu_uuid], job.request)
                                          for g in slot.grants))

    def _lent_slot(self, job: Job, request: GpuRequest) -> Slot | None:
        """The best node whose lent capacity holds `request` (the job's, or its placement
        floor), if the job may borrow (`lending`)."""
        cycle = self.cycle
        policy = cycle.config.lending
        if policy is None or request in cycle.borrow_fail or not lending.may_borrow(
                request, job.preemptible, job.checkpoint_grace_s, policy):
            return None
        now = cycle.snapshot.now
        best: tuple[float, str, tuple[GpuGrant, ...]] | None = None
        for node in sorted(cycle.snapshot.nodes):
            state = cycle.timeline.state_during(node, now, math.nextafter(now, math.inf))
            if not lending.lends_anything(state):
                continue
            fit = cycle.config.node_placer(lending.borrower_view(state), request)
            if fit is not None and (best is None or fit[0] > best[0]):
                best = (fit[0], node, fit[1])
        if best is None:
            cycle.borrow_fail.add(request)
            return None
        return Slot(cycle.snapshot.now, best[1], lending.as_borrowed(best[2]))

    def _admit(self, job: Job, position: int, slot: Slot, duration: float, fraction: float,
               memory: int, verdict: Verdict, claims: Mapping[float, float]) -> None:
        """Start the job on `slot`: charge its project and hold the GPUs for its run."""
        cycle = self.cycle
        now = cycle.snapshot.now
        ledger = cycle.ledgers[job.project]
        reserve = claims.get(ledger.current_period, 0.0)
        ledger.add(fraction, memory, verdict.borrowed, claims)
        cycle.timeline.add(slot.node, Occupancy(job.key, now, now + duration, slot.grants))
        cycle.running_spans.setdefault(job.project, []).append((now + duration, fraction, memory))
        self.admitted_by_project.setdefault(job.project, []).append(
            (fraction, verdict.borrowed, reserve))
        self.admissions.append(Admission(
            job.key, slot.node, slot.grants, verdict.borrowed, fraction, job.attempts + 1,
            position, f"admitted to {slot.node}: {verdict.message}"))

    def _over_budget(self, job: Job, verdict: Verdict, fraction: float) -> _Parked:
        """Wait for the budget period that has room: its refill."""
        now = self.cycle.snapshot.now
        quota = self.cycle.ledgers[job.project].quota
        budget = quota.budget_gpu_hours or 0.0
        full_period = fraction * min(job.limit_s, quota.period_s) / 3600.0
        short = verdict.budget_period if verdict.budget_period is not None else now
        not_before = short + quota.period_s
        if full_period > budget:
            return _Parked(WaitReason.BUDGET,
                           verdict.message + "; more than a whole period's budget",
                           not_before, estimable=False)
        return _Parked(WaitReason.BUDGET,
                       f"{verdict.message}; the budget refills in "
                       f"{format_duration(not_before - now)}",
                       not_before)

    def _over_quota(self, job: Job, position: int, verdict: Verdict, fraction: float,
                    memory: int, duration: float, may_preempt: bool) -> _Parked | None:
        """Wait for room in the project's own limits, preempting its lower-class jobs when
        that is what it takes (and `may_preempt`); None when a preemption was started (and
        its wait recorded)."""
        cycle = self.cycle
        now = cycle.snapshot.now
        ledger = cycle.ledgers[job.project]
        message = verdict.message
        free_at = _quota_free_at(cycle, ledger.quota, fraction, memory)
        own_leaving = _own_leaving(cycle, job.project)
        over_guarantee = _excess(ledger, fraction, memory, []) != (0.0, 0.0)
        if free_at is None:
            return _Parked(WaitReason.QUOTA, message + "; the job alone exceeds the guarantee",
                           now, estimable=False)
        if not over_guarantee:  # over the cap: only time helps
            return _Parked(WaitReason.QUOTA, message, free_at, in_quota=True)
        if own_leaving and _excess(ledger, fraction, memory, own_leaving) == (0.0, 0.0):
            return _Parked(WaitReason.PREEMPTING,
                           f"waiting for {len(own_leaving)} preempted job(s) of project "
                           f"{job.project} to leave", max(h.end for h in own_leaving),
                           in_quota=True)
        preempted = (self._preempt_for_quota(job, fraction, memory, duration) if may_preempt
                     else [])
        if not preempted:
            return _Parked(WaitReason.QUOTA, message, free_at, in_quota=True)
        self._wait_for_victims(job, position, preempted,
                               f"to make room in project {job.project}'s guarantee")
        return None

    def _no_room(self, job: Job, position: int, verdict: Verdict, fraction: float,
                 memory: int, duration: float, claims: Mapping[float, float],
                 may_preempt: bool) -> _Parked | None:
        """Wait for GPUs the project's limits allow but no node has now (or a backoff's end),
        preempting when that is allowed and `may_preempt`; None when a preemption was started
        (and its wait recorded)."""
        reason, message = self._capacity_reason(job, duration)
        if may_preempt and reason is WaitReason.CAPACITY and not verdict.budget_exhausted:
            preempted = self._preempt(job, verdict.standing is Standing.IN_QUOTA, duration)
            if preempted:
                self.cycle.ledgers[job.project].add(fraction, memory, verdict.borrowed, claims)
                self._wait_for_victims(job, position, preempted, "")
                return None
        if verdict.budget_exhausted:
            message = f"{verdict.message}; {message}"
        return _Parked(reason, message, self.cycle.snapshot.now, in_quota=(
            None if verdict.budget_exhausted else verdict.standing is Standing.IN_QUOTA))

    def _wait_for_victims(self, job: Job, position: int, preempted: list[Preemption],
                          why: str) -> None:
        """Record the job's wait for the victims it preempts: it starts when they leave."""
        now = self.cycle.snapshot.now
        start = now + max(max(p.grace_s, MIN_LEAVING_S) for p in preempted)
        victims = ", ".join(p.victim_key for p in preempted)
        self._wait(job, WaitReason.PREEMPTING,
                   f"preempting {victims}{' ' + why if why else ''}; starts when they leave "
                   f"in about {format_duration(start - now)}", position, start)
        self.reservations += 1
        self.latest_reserved = max(self.latest_reserved, start)

    def _park(self, job: Job, position: int, duration: float, parked: _Parked) -> None:
        """Record the wait, with the job's reserved or estimated start when it has one.

        A job in its requeue backoff starts no earlier than the backoff's end; it waits
        with REQUEUE_BACKOFF, its message naming the project limit that holds it too."""
        now = self.cycle.snapshot.now
        limits = parked.reason in (WaitReason.QUOTA, WaitReason.BUDGET)
        estimate, coarse, victims = (self._reserve(job, duration,
                                                   max(parked.not_before, job.not_before),
                                                   limits, parked.in_quota)
                                     if parked.estimable else (None, False, ()))
        after = ""
        if victims:
            more = f" and {len(victims) - 3} more" if len(victims) > 3 else ""
            after = f", preempting {', '.join(victims[:3])}{more}"
        reason, message = parked.reason, parked.message
        if job.not_before > now:
            reason = WaitReason.REQUEUE_BACKOFF
            message = (f"its last attempt failed through no fault of its own (a node refused "
                       f"or disrupted its pod); next attempt in "
                       f"{format_duration(job.not_before - now)}"
                       + (f"; {parked.message}" if limits else ""))
        self._wait(job, reason, message, position, estimate, coarse, simulated=True,
                   after_estimate=after, held_by=parked.reason)

    def _capacity_reason(self, job: Job, duration: float) -> tuple[WaitReason, str]:
        """Why a job the project limits allow finds no slot now."""
        cycle = self.cycle
        request = job.request
        if request not in cycle.raw_fail:
            if cycle.timeline.best_now(request, duration, False) is not None:
                return (WaitReason.BEHIND_HIGHER_RANKED,
                        f"GPUs are free but reserved for {self.ahead} higher-ranked waiting "
                        f"job(s) this job would delay")
            cycle.raw_fail.add(request)
        leaving = frozenset(cycle.leaving)
        if leaving and cycle.timeline.best_now(request, duration, without=leaving) is not None:
            return (WaitReason.PREEMPTING,
                    f"waiting for {len(leaving)} preempted job(s) to leave")
        blocked = _sharing_blocked(cycle, request)
        if blocked is not None:
            return WaitReason.SHARING_OBJECTIVE, blocked
        return (WaitReason.CAPACITY,
                f"no node has room now; {self.ahead} higher-ranked job(s) wait for GPUs")

    def _preempt(self, job: Job, in_quota: bool, duration: float) -> list[Preemption]:
        cycle = self.cycle
        if not _worth_preempting(cycle, job, duration):
            return []
        attempt = (job.request, effective_level(job, cycle.snapshot.now,
                                                cycle.config.aging_step_s), in_quota, job.project,
                   job.preemptible)
        if attempt in cycle.preempt_fail:
            return []
        cycle.preempt_attempts += 1
        preempted = _try_preempt(cycle, job, in_quota, duration)
        if preempted:
            cycle.preemptions.extend(preempted)
        else:
            cycle.preempt_fail.add(attempt)
        return preempted

    def _preempt_for_quota(self, job: Job, fraction: float, memory: int, duration: float
                           ) -> list[Preemption]:
        """Make room in the job's own guarantee by preempting its project's lower-class jobs,
        and on a node if it also needs that."""
        cycle = self.cycle
        if not _worth_preempting(cycle, job, duration):
            return []
        now = cycle.snapshot.now
        step = cycle.config.aging_step_s
        ledger = cycle.ledgers[job.project]
        excess_gpus, excess_memory = _excess(ledger, fraction, memory, [])
        attempt = (job.request, effective_level(job, now, step), True, job.project,
                   job.preemptible)
        if attempt in cycle.quota_preempt_fail:
            return []
        own = [(Candidate(h.job, cause, lost_gpu_hours(h.job, h.fraction, now)), h.fraction,
                h.memory_mib)
               for h in cycle.holders_by_project.get(job.project, ())
               if not h.job.borrowed and h.job.key not in cycle.leaving
               and (cause := victim_cause(job, True, h.job, now, step)) is not None]
        chosen = quota_victims(own, excess_gpus, excess_memory) if own else None
        if own:
            cycle.preempt_attempts += 1
        if chosen is None:
            cycle.quota_preempt_fail.add(attempt)
            return []
        gone = frozenset(cycle.leaving | {c.job.key for c in chosen})
        slot = cycle.timeline.best_now(job.request, duration, without=gone)
        extra: tuple[Candidate, ...] = ()
        if slot is not None:
            node, grants = slot.node, slot.grants
        else:
            others = _victim_candidates(cycle, job, True, gone)
            plan = plan_preemption(job.request, duration, others, cycle.timeline, gone)
            if plan is None:
                return []
            node, grants, extra = plan.node, plan.grants, plan.victims
        victims = [*chosen, *extra]
        if len(victims) > largest_plan(cycle.config.max_preemptions_per_cycle,
                                       len(cycle.preemptions)):
            return []
        out = [_preemption(cycle, job, v, node) for v in victims]
        start = now + max(leaving_s(v.job) for v in victims)
        cycle.timeline.add(node, Occupancy(job.key, start, start + duration, grants))
        cycle.preemptions.extend(out)
        return out

    def _yielding(self, job: Job, in_quota: bool | None
                  ) -> tuple[dict[str, float], dict[str, float]]:
        """Running jobs `job` may preempt once it is allowed to start (`in_quota`: how; None:
        it will not), in the order victims are taken, with how long each would keep its GPUs;
        and when those still within their minimum runtime may first be preempted.

        An estimate that waits for them to end when the cycle will preempt them is far too
        late: a job waiting for its guarantee reclaims borrowed GPUs as soon as it has room.
        A victim leaves after its grace, or after `preempt_after_wait_s` if that is longer
        (the job waits that long before it preempts)."""
        cycle = self.cycle
        config = cycle.config
        if in_quota is None or config.max_preemptions_per_cycle == 0:
            return {}, {}
        now = cycle.snapshot.now
        step = config.aging_step_s
        if self._victims is None:
            # each possible victim once per cycle: when it may first be preempted, whether it
            # may be at all (`preemption.may_be_victim`), its level then and how long it
            # would keep its GPUs; only what depends on `job` is left for each call
            patience = config.preempt_after_wait_s
            self._victims = []
            for h in sorted((h for h in cycle.holders
                             if h.job.preemptible and not h.job.terminating),
                            key=lambda h: victim_preference(
                                h.job, lost_gpu_hours(h.job, h.fraction, now))):
                at = max(now, preemptible_from(h.job, now))
                if may_be_victim(h.job, at):
                    self._victims.append((h.job, at, effective_level(h.job, at, step),
                                          max(leaving_s(h.job), patience)))
            self._victim_times = sorted({at for _, at, _, _ in self._victims})
            self._victim_keys = {victim.key for victim, _, _, _ in self._victims}
        # the answer depends on the job only through its project, how it preempts and its
        # level at each victim's time (and on the victims already leaving, which only grow):
        # jobs that share those share it
        shared = None
        if job.key not in self._victim_keys:
            shared = (job.project, in_quota, job.preemptible, len(cycle.leaving),
                      tuple(effective_level(job, at, step) for at in self._victim_times))
            found = self._yielded.get(shared)
            if found is not None:
                return found
        yielding: dict[str, float] = {}
        protected: dict[str, float] = {}
        levels: dict[float, int] = {}  # `job`'s effective level at each victim's time
        for victim, at, level, keeps_s in self._victims:
            if victim.key in cycle.leaving or victim.key == job.key:
                continue
            own = levels.get(at)
            if own is None:
                own = levels[at] = effective_level(job, at, step)
            if cause_between(job.project, in_quota, own, victim, level,
                             job.preemptible) is not None:
                yielding[victim.key] = keeps_s
                if at > now:
                    protected[victim.key] = at
        if shared is not None:
            self._yielded[shared] = (yielding, protected)
        return yielding, protected

    def _reserve(self, job: Job, duration: float, not_before: float, limits: bool,
                 in_quota: bool | None) -> tuple[float | None, bool, tuple[str, ...]]:
        """Reserve the job's earliest slot (within the reservation depth) or estimate coarsely.

        Jobs held by their project's limits count against their own depth, so a long line of
        them cannot leave the head of the capacity queue with only coarse estimates. The slot
        may take the GPUs of running jobs the job will preempt once it may start (`_yielding`);
        those are then expected to leave when it starts (and are returned)."""
        cycle = self.cycle
        used = self.limit_reservations if limits else self.reservations
        if used < cycle.config.reservation_depth:
            yielding, protected = self._yielding(job, in_quota)
            most = largest_plan(cycle.config.max_preemptions_per_cycle)
            found = cycle.timeline.earliest(job.request, duration, not_before, yielding,
                                            protected, most)
            if found is None:
                return None, False, ()
            self.reserved.append(_Reserved(job, duration, not_before, yielding, protected, most))
            self._spread_behind(job, found, duration)
            for victim in found.displaces:
                cycle.timeline.end_at(victim, found.start)
            cycle.timeline.add(found.node, Occupancy(job.key, found.start,
                                                     found.start + duration, found.grants))
            if limits:  # far-off refills must not push the coarse estimates of others
                self.limit_reservations += 1
            else:
                self.reservations += 1
                self.latest_reserved = max(self.latest_reserved, found.start)
            return found.start, False, found.displaces
        estimate = max(not_before, fluid_start(self.latest_reserved, self.work_beyond_depth,
                                               cycle.capacity_gpus))
        self.work_beyond_depth += self.expected_gpu_hours[job.key]
        return estimate, True, ()


    def _spread_behind(self, job: Job, found: Slot, duration: float) -> None:
        """How much earlier or later the job may start than `found` says, when that start is
        the end of an occupancy whose spread is known (`_Cycle.spreads`: a running job, or
        a reservation behind one); then its own reservation's end spreads by
        that and its run time's P10-P90 (`run_times.run_time`), as independent errors."""
        cycle = self.cycle
        if found.displaces:
            return  # it starts when its victims leave, whatever their progress
        ending = [cycle.spreads[o.job_key] for o in cycle.timeline.occupancies(found.node)
                  if o.end == found.start and o.job_key in cycle.spreads]
        if not ending:
            return
        early = max(s.early for s in ending)
        late = max(s.late for s in ending)
        self.start_spreads[job.key] = _Spread(early, late)
        low, expected, high = run_time(job, cycle.learned)
        scale = duration / expected if expected > 0 else 1.0
        cycle.spreads[job.key] = _Spread(math.hypot(early, (expected - low) * scale),
                                         math.hypot(late, (high - expected) * scale))


def _project_statuses(cycle: _Cycle, admitted: Mapping[str, list[tuple[float, bool, float]]],
                      waits: tuple[Wait, ...]) -> tuple[ProjectStatus, ...]:
    snapshot = cycle.snapshot
    now = snapshot.now
    pending: dict[str, int] = {}
    job_project = {j.key: j.project for j in snapshot.jobs}
    by_project: dict[str, list[Job]] = {}  # in snapshot order, as the sums always were
    for job in snapshot.jobs:
        by_project.setdefault(job.project, []).append(job)
    for wait in waits:
        if wait.reason.refused:
            continue
        project = job_project[wait.job_key]
        pending[project] = pending.get(project, 0) + 1
    out = []
    for name in sorted(snapshot.quotas):
        quota = snapshot.quotas[name]
        usage = cycle.usage[name]
        mine = cycle.holders_by_project.get(name, [])
        new = admitted.get(name, [])
        running = sum(h.fraction for h in mine) + sum(f for f, _, _ in new)
        borrowed = (sum(h.fraction for h in mine if h.job.borrowed)
                    + sum(f for f, b, _ in new if b))
        current = quota.period_start(now)
        reserved = sum((h.claims.get(current, 0.0) for h in mine), 0.0)
        reserved += sum(r for _, _, r in new)
        efficiency = memory_efficiency(by_project.get(name, ())).ratio
        budget = quota.budget_gpu_hours
        out.append(ProjectStatus(
            name, usage.period_start, usage.period_start + quota.period_s, budget,
            usage.gpu_hours_used,
            None if budget is None else budget - usage.gpu_hours_used,
            reserved, usage.decayed_gpu_hours, running, borrowed, len(mine) + len(new),
            pending.get(name, 0), efficiency))
    return tuple(out)
