"""Replay a job trace through a queueing policy on a simulated clock, and score its waits.

A discrete-event simulation: events are arrivals, ends of runs and preempted jobs leaving
their GPUs. At every instant with an event, the policy decides from the state as it is then
(one admission cycle); admitted jobs start at once and hold their GPUs for their real run
time (the trace's), a preempted job resumes where it stopped (it checkpoints in its grace
period). The estimates a policy gives waiting jobs are recorded and compared with the starts
that happened.

Policies, all placing through the same placer (`queueing.extender_placer`, the extender's
GPU choice and score) so that only queueing differs:

- `carpool`: the operator's own `queueing.admission_cycle` on a `ClusterSnapshot` built from
  the replay's state: fair share, classes and aging, quotas and borrowing, preemption,
  conservative backfill on learned run times, and its estimated starts and ranges.
- `fifo`: one queue in arrival order; the head starts when it fits, nothing passes it.
- `slurm`: Slurm-like multifactor priority (age, fair share, class as QOS) with EASY
  backfill on the users' estimates (time limits), and `squeue --start`-style estimates: the
  backfill plan of the waiting jobs in priority order on those same estimates.
- `kueue`: Kueue-like, one ClusterQueue per project with the project's guarantee as nominal
  quota in one cohort (borrowing idle quota), BestEffortFIFO (a head that does not fit does
  not block the others); no estimates.

Pure: jobs and nodes in, numbers out.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from carpool.core import lending, right_sizing
from carpool.core.accounting import grants_fraction, project_usage, retire_job
from carpool.core.estimate_ranges import arrival_work, recent_misses, start_miss
from carpool.core.eta_accuracy import INSIDE, score_first_estimate
from carpool.core.eta_accuracy import MIN_WAIT_S as MIN_WAIT_S  # the replay's: one rule
from carpool.core.fairshare import nominal_fraction
from carpool.core.jobs import (
    ClusterSnapshot,
    DurationEstimate,
    Job,
    ProjectQuota,
    RetiredUsage,
    RunRecord,
    StartMiss,
)
from carpool.core.placement import NodeState
from carpool.core.preemption import PreemptionCause
from carpool.core.queueing import AdmissionConfig, CycleResult, admission_cycle
from carpool.core.resources import Gpu, GpuGrant, JobClass, NodeInventory, Phase
from carpool.core.run_times import DURATION_LEARNING_RATE, LearnKey, fold_finished
from carpool.core.timeline import NodePlacer, Occupancy, Timeline, TimelineMemo
from carpool.core.timestamps import as_written
from carpool.replay.job_traces import TraceJob
from carpool.replay.progress_traces import Curve, curve
from carpool.replay.usage_traces import Usage, peak_of, usage

POLICIES = ("fifo", "slurm", "kueue", "carpool")
REFRESH_SAMPLE_S = 600.0  # a waiting job's refreshed estimate is sampled at most this often
GPU_MEMORY_GIB = {"P100": 16, "T4": 16, "V100M16": 16, "V100M32": 32, "A10": 24, "G2": 32,
                  "G3": 32}
HALF_LIFE_S = 7 * 86400.0
ARRIVALS_KEPT_S = 86400.0  # finished jobs' arrivals kept for the arrival-rate window


# ---------------------------------------------------------------- cluster


def trace_nodes(nodes: Iterable[tuple[str, int, str]], scale: float) -> dict[str, NodeState]:
    """(name, GPUs, model) rows as NodeStates, keeping `scale` of each model's nodes (at
    least one), so a smaller cluster keeps the trace's mix of models."""
    if not 0 < scale <= 1:
        raise ValueError("--scale must be in (0, 1]")
    by_model: dict[str, list[tuple[str, int, str]]] = {}
    for row in nodes:
        if row[1] > 0:
            by_model.setdefault(row[2], []).append(row)
    out: dict[str, NodeState] = {}
    for model in sorted(by_model):
        rows = by_model[model]
        keep = max(1, round(len(rows) * scale))
        step = len(rows) / keep
        for i in range(keep):
            name, gpus, _ = rows[int(i * step)]
            memory = GPU_MEMORY_GIB.get(model, 16) * 1024
            out[name] = NodeState(NodeInventory(name, tuple(
                Gpu(g, f"{name}-gpu{g}", model, memory) for g in range(gpus))))
    if not out:
        raise ValueError("no GPU nodes")
    return out


def capacity_gpus(nodes: Mapping[str, NodeState]) -> int:
    return sum(len(n.inventory.gpus) for n in nodes.values())


def open_quotas(jobs: Sequence[TraceJob]) -> dict[str, ProjectQuota]:
    """No guarantees (any project may use any idle GPU), equal fair-share weights."""
    return {p: ProjectQuota(p, frozenset({p})) for p in sorted({j.project for j in jobs})}


def share_quotas(jobs: Sequence[TraceJob], nodes: Mapping[str, NodeState]
                 ) -> dict[str, ProjectQuota]:
    """Each project guaranteed its share of the trace's GPU-hours of the cluster's GPUs (at
    least its largest job, which could never start otherwise: beyond its guarantee a project
    runs only preemptible work), borrowing allowed, no budget; fair-share weight equal to
    that share."""
    reference = max((g.memory_total_mib for n in nodes.values() for g in n.inventory.gpus),
                    default=1)
    work: dict[str, float] = {}
    largest: dict[str, float] = {}
    for job in jobs:
        fraction = nominal_fraction(job.request, reference)
        work[job.project] = work.get(job.project, 0.0) + fraction * job.runtime_s
        largest[job.project] = max(largest.get(job.project, 0.0), fraction)
    total = sum(work.values()) or 1.0
    capacity = capacity_gpus(nodes)
    return {p: ProjectQuota(p, frozenset({p}),
                            guaranteed_gpus=max(capacity * w / total, largest[p]),
                            borrowing=True, weight=max(w / total, 1e-3))
            for p, w in sorted(work.items())}


# ---------------------------------------------------------------- state


@dataclass
class State:
    """What a policy decides from: the replay's live jobs and history at `now`."""

    now: float
    nodes: Mapping[str, NodeState]
    quotas: Mapping[str, ProjectQuota]
    trace: Mapping[str, TraceJob]
    jobs: dict[str, Job] = field(default_factory=dict)  # queued, running, leaving
    retired: dict[str, RetiredUsage] = field(default_factory=dict)
    learned: dict[LearnKey, DurationEstimate] = field(default_factory=dict)
    start_misses: tuple[StartMiss, ...] = ()  # of finished jobs (estimate_ranges.recent_misses)
    arrivals: deque[tuple[float, int, float, str]] = field(default_factory=deque)

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(self.now, tuple(self.jobs.values()), self.quotas, self.nodes,
                               self.retired, self.learned, self.start_misses,
                               tuple(self.arrivals))


@dataclass(frozen=True)
class Start:
    job_key: str
    node: str
    grants: tuple[GpuGrant, ...]
    borrowed: bool = False


@dataclass(frozen=True)
class Stop:
    job_key: str
    grace_s: float
    owner_reclaim: bool = False  # it ran in lent capacity its owner needs back
    for_waiting: bool = False  # a waiting owner needs it (timed from the decision)
    ends: bool = False  # the job is done once off its GPUs (an expiry: idle session, maxDuration)


@dataclass(frozen=True)
class Estimate:
    start: float
    low: float | None = None
    high: float | None = None
    simulated: float | None = None  # the forward simulation's start before calibration


@dataclass(frozen=True)
class Decisions:
    starts: tuple[Start, ...] = ()
    stops: tuple[Stop, ...] = ()
    estimates: Mapping[str, Estimate] = field(default_factory=dict)


Policy = Callable[[State], Decisions]


def carpool_policy(config: AdmissionConfig | None = None,
                   seen: Callable[[State, CycleResult], None] | None = None) -> Policy:
    """The operator's admission cycle, unchanged (node states memoised across cycles);
    `seen` is shown each cycle's whole result (queue positions, reasons), for diagnoses."""
    config = config if config is not None else AdmissionConfig()
    if config.timeline_memo is None:
        config = replace(config, timeline_memo=TimelineMemo())

    def decide(state: State) -> Decisions:
        result = admission_cycle(state.snapshot(), config)
        if seen is not None:
            seen(state, result)
        return Decisions(
            tuple(Start(a.job_key, a.node, a.grants, a.borrowed) for a in result.admissions),
            (*(Stop(p.victim_key, p.grace_s, p.cause is PreemptionCause.OWNER_RECLAIM,
                    (preemptor := state.jobs.get(p.preemptor_key)) is not None
                    and preemptor.waiting)
               for p in result.preemptions),
             *(Stop(e.job_key, e.grace_s, ends=True) for e in result.expiries)),
            {w.job_key: Estimate(w.estimated_start, w.estimated_start_low,
                                 w.estimated_start_high, w.simulated_start)
             for w in result.waits if w.estimated_start is not None})

    return decide


def _timeline(state: State, placer: NodePlacer, planned_end: Callable[[Job], float],
              memo: TimelineMemo) -> Timeline:
    timeline = Timeline(state.nodes, state.now, placer, memo)
    for job in state.jobs.values():
        if job.holds_gpus and job.grants:
            end = max(planned_end(job), math.nextafter(state.now, math.inf))
            timeline.add(job.node, Occupancy(job.key, state.now, end, job.grants))
    return timeline


def _waiting(state: State) -> list[Job]:
    return [j for j in state.jobs.values() if j.waiting]


def fifo_policy(placer: NodePlacer) -> Policy:
    memo = TimelineMemo()

    def decide(state: State) -> Decisions:
        timeline = _timeline(state, placer, lambda j: math.inf, memo)
        starts: list[Start] = []
        for job in sorted(_waiting(state), key=lambda j: (j.submitted_at, j.key)):
            slot = timeline.best_now(job.request, 1.0, respect_reservations=False)
            if slot is None:
                break
            timeline.add(slot.node, Occupancy(job.key, state.now, math.inf, slot.grants))
            starts.append(Start(job.key, slot.node, slot.grants))
        return Decisions(tuple(starts))

    return decide


def _decayed_usage(state: State) -> dict[str, float]:
    by_project: dict[str, list[Job]] = {}
    for job in state.jobs.values():
        by_project.setdefault(job.project, []).append(job)
    return {name: project_usage(q, by_project.get(name, ()), state.now, HALF_LIFE_S,
                                state.retired.get(name)).decayed_gpu_hours
            for name, q in state.quotas.items()}


def slurm_priority(job: Job, now: float, usage_share: float, shares: float) -> float:
    """Slurm's multifactor priority with weights age 1000 (full at 7 days), fair share 10000
    (2^(-usage/shares), the classic factor) and class as QOS 10000 (interactive 1 .. batch 0)."""
    age = min(1.0, max(0.0, now - job.submitted_at) / (7 * 86400.0))
    fairshare = math.pow(2.0, -usage_share / shares) if shares > 0 else 0.0
    qos = (int(JobClass.BATCH) - int(job.job_class)) / int(JobClass.BATCH)
    return 1000.0 * age + 10000.0 * fairshare + 10000.0 * qos


def slurm_policy(placer: NodePlacer, estimate_depth: int = 64, min_remaining_s: float = 60.0
                 ) -> Policy:
    """EASY backfill on user estimates: the top waiting job that cannot start reserves its
    earliest slot; later jobs start only where they leave that reservation in place. Then
    the backfill plan: each waiting job in priority order reserves its earliest slot on the
    users' estimates, which is its `--start` estimate."""
    memo = TimelineMemo()

    def decide(state: State) -> Decisions:
        now = state.now
        usage = _decayed_usage(state)
        total_usage = sum(usage.values()) or 1.0
        total_weight = sum(q.weight for q in state.quotas.values()) or 1.0
        ordered = sorted(_waiting(state), key=lambda j: (
            -slurm_priority(j, now, usage.get(j.project, 0.0) / total_usage,
                            state.quotas[j.project].weight / total_weight
                            if j.project in state.quotas else 0.0),
            j.submitted_at, j.key))

        def planned_end(job: Job) -> float:
            started = job.started_at if job.started_at is not None else now
            return max(started + job.estimated_duration_s, now + min_remaining_s)

        timeline = _timeline(state, placer, planned_end, memo)
        starts: list[Start] = []
        blocked: list[Job] = []
        reserved = False
        for job in ordered:
            duration = job.estimated_duration_s
            slot = timeline.best_now(job.request, duration)
            if slot is not None:
                timeline.add(slot.node, Occupancy(job.key, now, now + duration, slot.grants))
                starts.append(Start(job.key, slot.node, slot.grants))
                continue
            blocked.append(job)
            if not reserved:
                found = timeline.earliest(job.request, duration, now)
                if found is not None:
                    timeline.add(found.node, Occupancy(job.key, found.start,
                                                       found.start + duration, found.grants))
                    reserved = True
        estimates: dict[str, Estimate] = {}
        plan = _timeline(state, placer, planned_end, memo)
        for start in starts:
            plan.add(start.node, Occupancy(start.job_key, now,
                                           now + state.jobs[start.job_key].estimated_duration_s,
                                           start.grants))
        for job in blocked[:estimate_depth]:
            found = plan.earliest(job.request, job.estimated_duration_s, now)
            if found is None:
                continue
            plan.add(found.node, Occupancy(job.key, found.start,
                                           found.start + job.estimated_duration_s, found.grants))
            estimates[job.key] = Estimate(found.start)
        return Decisions(tuple(starts), (), estimates)

    return decide


def kueue_policy(placer: NodePlacer) -> Policy:
    """Per project a ClusterQueue with its guarantee as nominal quota, all in one cohort:
    workloads within quota first, then those that borrow the cohort's unused quota; within
    each, by class then creation time; one that does not fit is skipped (BestEffortFIFO)."""
    memo = TimelineMemo()

    def decide(state: State) -> Decisions:
        now = state.now
        reference = max((g.memory_total_mib for n in state.nodes.values()
                         for g in n.inventory.gpus), default=1)
        used: dict[str, float] = {}
        for job in state.jobs.values():
            if job.holds_gpus:
                used[job.project] = used.get(job.project, 0.0) + nominal_fraction(
                    job.request, reference)
        nominal = {p: (q.guaranteed_gpus if q.guaranteed_gpus is not None else math.inf)
                   for p, q in state.quotas.items()}
        timeline = _timeline(state, placer, lambda j: math.inf, memo)
        ordered = sorted(_waiting(state), key=lambda j: (j.job_class, j.submitted_at, j.key))
        starts: list[Start] = []
        for borrowing in (False, True):
            for job in ordered:
                if any(s.job_key == job.key for s in starts):
                    continue
                need = nominal_fraction(job.request, reference)
                mine = used.get(job.project, 0.0)
                cap = nominal.get(job.project, 0.0)
                if mine + need > cap + 1e-9:
                    if not borrowing:
                        continue
                    unused = sum(max(0.0, nominal[p] - used.get(p, 0.0)) for p in nominal
                                 if p != job.project)
                    if mine + need > cap + unused + 1e-9:
                        continue
                slot = timeline.best_now(job.request, 1.0, respect_reservations=False)
                if slot is None:
                    continue
                timeline.add(slot.node, Occupancy(job.key, now, math.inf, slot.grants))
                used[job.project] = mine + need
                starts.append(Start(job.key, slot.node, slot.grants, mine + need > cap + 1e-9))
        return Decisions(tuple(starts))

    return decide


# ---------------------------------------------------------------- the replay


@dataclass
class _Record:
    arrival: float
    first_start: float | None = None
    arrival_estimate: Estimate | None = None
    refreshed: list[tuple[float, float]] = field(default_factory=list)  # (made at, start)
    last_sample: float = -math.inf


@dataclass(frozen=True)
class Outcome:
    """What one replay measured (see `score` for the numbers)."""

    policy: str
    records: Mapping[str, _Record]
    trace: Mapping[str, TraceJob]
    gpu_seconds: float  # GPU equivalents held x seconds
    capacity_gpus: int
    span_s: float  # from the first arrival to the last end
    preemptions: int
    gpu_hours_by_project: Mapping[str, float]
    cycles: int
    idle: IdleStats | None = None
    horizon: float = 0.0  # the last arrival


ARRIVE, LEAVE, END = 0, 1, 2  # at one instant: leaving GPUs before ends, then arrivals
# a job's use rises (usage_traces); the watchdog ends an outgrown job; a job has run long
# enough for its peak to be trusted (lending); a session has sat idle for its project's
# timeout; a stopped job is off its GPUs for good
RISE, KILL, OBSERVED, IDLE_DUE, EXPIRE = 3, 4, 5, 6, 7
OUTGROW_S = 60.0  # a job placed below its peak reaches it this long after it starts


@dataclass(frozen=True)
class IdleCapacity:
    """What the replay does about capacity jobs hold and do not use: each job's use drawn
    from `seed` (`usage_traces`); `lending` lends it within GPUs (`core.lending`, the
    carpool policy's `AdmissionConfig.lending` must match); `right_sizing` places
    preemptible jobs by the peaks their template's finished runs reached
    (`core.right_sizing`), running them as asked once they outgrow that, and with
    `share_whole_gpus` one-GPU whole-GPU ones too, as MPS shares; `idle_timeout_s`
    is every project's `idleSessions.timeout` (0: none) and `idle_yield_after_s` its
    `idleSessions.yieldAfter`, applied by the operator's rule (`queueing.idle_expiry`) to
    the GPU activity the device plugin would have seen."""

    seed: int = 0
    lending: lending.LendingPolicy | None = None
    right_sizing: bool = False
    idle_timeout_s: float = 0.0
    share_whole_gpus: bool = False
    idle_yield_after_s: float = 0.0  # every project's idleSessions.yieldAfter (0: none)


@dataclass
class IdleStats:
    """What was measured about unused capacity (see `score`)."""

    work_runs: list[tuple[float, float, float]] = field(default_factory=list)  # start, end, GPUs
    lent_gpu_seconds: float = 0.0  # held by borrowers in lent capacity
    reclaims: int = 0
    reclaim_latencies: list[float] = field(default_factory=list)  # rise to borrower gone
    borrower_stops: dict[str, int] = field(default_factory=dict)  # preemptions per borrower
    outgrown: int = 0  # right-sized runs the watchdog ended
    sessions_stopped: int = 0  # interactive jobs stopped as idle


class Replay:
    """One replay in progress: the trace's events, the state a policy decides from, what was
    recorded. `step` runs one instant (one cycle); `fork` copies the replay as it stands, so
    a what-if (no more arrivals, say) can run on from here without touching this one."""

    def __init__(self, jobs: Sequence[TraceJob], nodes: Mapping[str, NodeState],
                 quotas: Mapping[str, ProjectQuota], policy: Policy, name: str,
                 learning_rate: float = DURATION_LEARNING_RATE,
                 observe: Callable[[State, Decisions], None] | None = None,
                 progress_share: float = 0.0, progress_seed: int = 0,
                 idle: IdleCapacity | None = None) -> None:
        if not 0 <= progress_share <= 1:
            raise ValueError(f"the share of jobs reporting progress must be in [0, 1], got "
                             f"{progress_share}")
        trace = {j.key: j for j in jobs}
        if len(trace) != len(jobs):
            raise ValueError("trace job keys repeat")
        self.jobs = jobs
        self.nodes = nodes
        self.quotas = quotas
        self.policy = policy
        self.name = name
        self.learning_rate = learning_rate
        self.observe = observe
        self.trace = trace
        if idle is not None and (idle.idle_timeout_s > 0 or idle.right_sizing
                                 or idle.idle_yield_after_s > 0):
            quotas = {name: replace(q, idle_session_timeout_s=idle.idle_timeout_s,
                                    idle_session_yield_after_s=idle.idle_yield_after_s,
                                    place_calibrated=idle.right_sizing,
                                    share_whole_gpus=idle.share_whole_gpus)
                      for name, q in quotas.items()}
            self.quotas = quotas
        self.state = State(jobs[0].arrival if jobs else 0.0, nodes, quotas, trace)
        self.events: list[tuple[float, int, str, int]] = [
            (j.arrival, ARRIVE, j.key, 0) for j in jobs]
        heapq.heapify(self.events)
        self.records: dict[str, _Record] = {}
        self.done_s: dict[str, float] = {}  # seconds of work done by earlier runs
        self.gpu_seconds = 0.0
        self.preemptions = self.cycles = 0
        self.hours: dict[str, float] = {}
        self.last_end = self.state.now
        self.reference = max((g.memory_total_mib for n in nodes.values()
                              for g in n.inventory.gpus), default=1)
        # jobs that report progress (`progress_traces`): drawn per job from the seed
        self.curves: dict[str, Curve] = {
            j.key: curve(j.runtime_s, f"{progress_seed}:{j.key}") for j in jobs
            if progress_share > 0
            and random.Random(f"{progress_seed}:{j.key}:reports").random() < progress_share}
        self.reporting: set[str] = set()  # running jobs with a curve
        self.ticks: dict[str, tuple[int, int]] = {}  # (attempt, report) each last reported
        self.idle = idle
        self.usage: dict[str, Usage] = (
            {j.key: usage(f"{idle.seed}:{j.project}:{j.template}", f"{idle.seed}:{j.key}",
                          j.job_class is JobClass.INTERACTIVE)
             for j in jobs} if idle is not None else {})
        self.idle_stats = IdleStats() if idle is not None else None
        self.peaks: dict[tuple[str, str], list[int]] = {}  # finished runs' peak cores
        self.calibrations: dict[tuple[str, str], int | None] = {}  # recommended cores
        self.rose_at: dict[str, float] = {}  # node -> when an owner's use there last rose

    def fork(self, arrivals: bool = True) -> Replay:
        """A copy that runs on independently; without `arrivals`, no job arrives any more."""
        other = copy.copy(self)
        state = self.state
        other.state = replace(state, jobs=dict(state.jobs), retired=dict(state.retired),
                              learned=dict(state.learned),
                              arrivals=deque(state.arrivals))
        other.events = [e for e in self.events if arrivals or e[1] != ARRIVE]
        heapq.heapify(other.events)
        other.records = {k: replace(r, refreshed=list(r.refreshed))
                         for k, r in self.records.items()}
        other.done_s = dict(self.done_s)
        other.hours = dict(self.hours)
        other.reporting = set(self.reporting)
        other.ticks = dict(self.ticks)
        other.peaks = {k: list(v) for k, v in self.peaks.items()}
        other.calibrations = dict(self.calibrations)
        if self.idle_stats is not None:
            other.idle_stats = copy.deepcopy(self.idle_stats)
        return other

    def _close_run(self, job: Job, now: float, lost: bool = False) -> Job:
        run = job.current_run
        if run is None:
            return job
        held = run.fraction * (now - run.start)
        self.gpu_seconds += held
        self.hours[job.project] = self.hours.get(job.project, 0.0) + held / 3600
        stats = self.idle_stats
        if stats is not None:
            if any(g.borrowed for g in job.grants):
                stats.lent_gpu_seconds += held
            if not lost:  # work is done only while the job is active (an idle session is not)
                active_s = self.usage[job.key].active_s(self.trace[job.key].runtime_s)
                active_end = run.start + max(0.0, active_s - self.done_s.get(job.key, 0.0))
                stats.work_runs.append((run.start, min(now, active_end), nominal_fraction(
                    self.trace[job.key].request, self.reference)))
        if not lost:
            self.done_s[job.key] = self.done_s.get(job.key, 0.0) + (now - run.start)
        runs = tuple(replace(r, end=now) if r.attempt == run.attempt else r for r in job.runs)
        return replace(job, runs=runs)

    def _event(self, now: float, kind: int, key: str, attempt: int) -> None:
        state, trace = self.state, self.trace
        if kind == ARRIVE:
            t = trace[key]
            state.jobs[key] = Job(key, t.project, t.job_class, t.request, t.arrival,
                                  t.user_estimate_s, preemptible=t.preemptible,
                                  checkpoint_grace_s=30.0, template=t.template)
            self.records[key] = _Record(t.arrival)
        elif kind == END:
            job = state.jobs.get(key)
            if job is None or job.attempts != attempt or job.phase is not Phase.RUNNING:
                return  # a run that was preempted meanwhile
            job = replace(self._close_run(job, now), phase=Phase.SUCCEEDED, grants=(), node="")
            del state.jobs[key]
            self.last_end = max(self.last_end, now)
            quota = self.quotas.get(job.project)
            if quota is not None:
                state.retired[job.project] = retire_job(
                    state.retired.get(job.project), job, quota, now, HALF_LIFE_S)
            fold_finished(state.learned, job, trace[key].runtime_s, self.learning_rate)
            if key in self.usage:
                self.peaks.setdefault((job.project, job.template), []).append(
                    peak_of(trace[key].request.cores_pct, self.usage[key].peak))
                self.calibrations.pop((job.project, job.template), None)
            record = start_miss(job)
            if record is not None:
                state.start_misses = recent_misses((*state.start_misses, record))
            state.arrivals.append((job.submitted_at, int(job.job_class), arrival_work(
                job, nominal_fraction(job.request, self.reference), state.learned),
                job.project))
            while state.arrivals and state.arrivals[0][0] < now - ARRIVALS_KEPT_S:
                state.arrivals.popleft()
        elif kind == RISE:
            job = state.jobs.get(key)
            if job is not None and job.attempts == attempt and job.phase is Phase.RUNNING:
                self.rose_at[job.node] = now  # the cycle's measurement sees the new peak
        elif kind in (OBSERVED, IDLE_DUE):
            pass  # the cycle's measurement lends what the job's peak leaves / sees it idle
        elif kind == EXPIRE:  # a stopped job is off its GPUs and done
            job = state.jobs.get(key)
            if job is None or job.attempts != attempt or not job.terminating:
                return
            self._close_run(job, now)
            del state.jobs[key]
            self.last_end = max(self.last_end, now)
        elif kind == KILL:  # the watchdog ends a right-sized run that outgrew its grant
            job = state.jobs.get(key)
            if job is None or job.attempts != attempt or job.phase is not Phase.RUNNING:
                return
            assert self.idle_stats is not None
            self.idle_stats.outgrown += 1
            state.jobs[key] = replace(self._close_run(job, now, lost=True), grants=(), node="",
                                      phase=Phase.QUEUED, request=trace[key].request,
                                      calibration_outgrown=True, placement_floor=None,
                                      lendable_mib=0, lendable_cores_pct=0)
        else:  # LEAVE: a preempted job is off its GPUs and queued again
            job = state.jobs.get(key)
            if job is None or job.attempts != attempt or not job.terminating:
                return
            state.jobs[key] = replace(self._close_run(job, now), grants=(), node="",
                                      lendable_mib=0, lendable_cores_pct=0)

    def step(self) -> bool:
        """Run the next instant with an event (one cycle); False when none is left."""
        events, state = self.events, self.state
        if not events:
            return False
        now = events[0][0]
        state.now = now
        while events and events[0][0] == now:
            _, kind, key, attempt = heapq.heappop(events)
            self._event(now, kind, key, attempt)
        self._report_progress()
        if self.idle is not None:
            self._measure_use()
        decisions = self.policy(state)
        if self.observe is not None:
            self.observe(state, decisions)
        self.cycles += 1
        for stop in decisions.stops:
            job = state.jobs[stop.job_key]
            stats = self.idle_stats
            if stop.ends:
                if stats is not None:
                    stats.sessions_stopped += job.job_class is JobClass.INTERACTIVE
                state.jobs[job.key] = replace(job, phase=Phase.PREEMPTED)
                heapq.heappush(events, (now + max(stop.grace_s, 1.0), EXPIRE, job.key,
                                        job.attempts))
                continue
            self.preemptions += 1
            if stats is not None and any(g.borrowed for g in job.grants):
                stats.borrower_stops[job.key] = stats.borrower_stops.get(job.key, 0) + 1
                if stop.owner_reclaim:
                    stats.reclaims += 1
                    stats.reclaim_latencies.append(
                        now + max(stop.grace_s, 1.0)
                        - (now if stop.for_waiting else self._reclaim_cause_at(job, now)))
            state.jobs[job.key] = replace(job, phase=Phase.PREEMPTED)
            heapq.heappush(events, (now + max(stop.grace_s, 1.0), LEAVE, job.key, job.attempts))
        for start in decisions.starts:
            job = state.jobs[start.job_key]
            inventory = self.nodes[start.node].inventory
            fraction = (grants_fraction(start.grants, inventory) if start.grants
                        else nominal_fraction(job.request, self.reference))
            attempt = job.attempts + 1
            done = self.done_s.get(job.key, 0.0)
            reports = self.curves.get(job.key)
            state.jobs[job.key] = replace(
                job, phase=Phase.RUNNING, attempts=attempt, node=start.node,
                grants=start.grants, borrowed=start.borrowed,
                runs=(*job.runs, RunRecord(attempt, now, None, fraction, start.node)),
                progress=None, progress_at=None, progress_detail=None,
                resumed_progress=reports.at(done)[0] if reports is not None else 0.0)
            if reports is not None:
                self.reporting.add(job.key)
            record = self.records[job.key]
            if record.first_start is None:
                record.first_start = now
            remaining = max(1.0, self.trace[job.key].runtime_s - self.done_s.get(job.key, 0.0))
            heapq.heappush(events, (now + remaining, END, job.key, attempt))
            if job.key in self.usage:
                self._watch_use(state.jobs[job.key], done, remaining)
        for key, estimate in decisions.estimates.items():
            record = self.records[key]
            if record.first_start is not None:
                continue  # started before (a preempted job waits again): not its first wait
            if record.arrival_estimate is None and now == record.arrival:
                record.arrival_estimate = estimate
                record.last_sample = now
                state.jobs[key] = replace(
                    state.jobs[key], first_estimated_start=as_written(estimate.start),
                    first_simulated_start=(None if estimate.simulated is None
                                           else as_written(estimate.simulated)))
            elif now - record.last_sample >= REFRESH_SAMPLE_S:
                record.refreshed.append((now, estimate.start))
                record.last_sample = now
        return True

    def _watch_use(self, job: Job, done: float, remaining: float) -> None:
        """Events of a started run's use: its rise, and the watchdog's end of a run placed
        below the peak it will reach."""
        now, run_s = self.state.now, self.trace[job.key].runtime_s
        use = self.usage[job.key]
        policy = self.idle.lending if self.idle is not None else None
        if policy is not None and policy.observed_s < remaining:
            heapq.heappush(self.events, (now + policy.observed_s, OBSERVED, job.key,
                                         job.attempts))
        rise = use.rise_after(done, run_s)
        if rise is not None and rise < remaining:
            heapq.heappush(self.events, (now + rise, RISE, job.key, job.attempts))
        idle = self.idle
        for limit in ((idle.idle_timeout_s, idle.idle_yield_after_s) if idle is not None
                      else ()):
            idle_due = max(0.0, use.active_s(run_s) - done) + limit
            if limit > 0 and use.idle_from is not None and idle_due < remaining:
                heapq.heappush(self.events, (now + idle_due, IDLE_DUE, job.key, job.attempts))
        asked = self.trace[job.key].request.cores_pct
        # what MPS fences it at: its grant (a piece at its placement floor may be smaller
        # than its calibrated request)
        fence = min((g.cores_pct for g in job.grants), default=job.request.cores_pct)
        if fence < asked:  # placed by its calibrated size
            if peak_of(asked, use.used(done, run_s)) > fence:
                at = min(OUTGROW_S, remaining)
            elif rise is not None and peak_of(asked, use.peak) > fence:
                at = rise
            else:
                return
            if at < remaining:
                heapq.heappush(self.events, (now + at, KILL, job.key, job.attempts))

    def _measure_use(self) -> None:
        """What the device plugin would have measured by now, as the operator passes it on:
        each running owner's lendable part (`lending.lendable`, from its peak so far), and
        waiting preemptible jobs' calibrated sizes (`right_sizing.calibrated`)."""
        idle, state = self.idle, self.state
        assert idle is not None
        for key, job in list(state.jobs.items()):
            trace = self.trace[key]
            if job.phase is Phase.RUNNING and self.usage[key].idle_from is not None:
                run = job.current_run
                assert run is not None
                active_end = run.start + max(0.0, self.usage[key].active_s(trace.runtime_s)
                                             - self.done_s.get(key, 0.0))
                seen = min(state.now, active_end)  # the last GPU activity the plugin saw
                if seen != job.last_gpu_activity:
                    job = state.jobs[key] = replace(job, last_gpu_activity=seen)
            if idle.lending is not None and job.phase is Phase.RUNNING and job.grants:
                run = job.current_run
                assert run is not None
                done = self.done_s.get(key, 0.0)
                share = self.usage[key].used(done + state.now - run.start, trace.runtime_s)
                memory_peak = (peak_of(trace.request.memory_mib, share)
                               if trace.request.memory_mib else None)
                cores_peak = peak_of(trace.request.cores_pct, share)
                calibrated = self._calibration((job.project, job.template))
                lent = [lending.lendable(g, memory_peak, cores_peak, state.now - run.start,
                                         idle.lending, None, calibrated) for g in job.grants]
                memory = min(m for m, _ in lent)
                cores = min(c for _, c in lent)
                if (memory, cores) != (job.lendable_mib, job.lendable_cores_pct):
                    state.jobs[key] = replace(job, lendable_mib=memory, lendable_cores_pct=cores)
            elif idle.right_sizing and job.waiting:
                request = right_sizing.placement_request(
                    replace(job, request=trace.request), self.quotas.get(job.project), None,
                    self._calibration((job.project, job.template)))
                if request != job.request:
                    state.jobs[key] = replace(job, request=request, placement_floor=(
                        right_sizing.placement_floor(request, trace.request)))

    def _calibration(self, learn: tuple[str, str]) -> int | None:
        """The recommended cores of a (project, template) from its finished runs' peaks."""
        if learn not in self.calibrations:
            self.calibrations[learn] = right_sizing.recommended(self.peaks.get(learn, ()), 1)
        return self.calibrations[learn]

    def _reclaim_cause_at(self, borrower: Job, now: float) -> float:
        """When the need that stops `borrower` arose: the latest rise of an owner's use on its
        node if that came after the borrower started (a rise before it was already in the
        lending it was placed by), else now (the lent part shrank for another reason, such as
        an owner's calibrated size growing, and nothing waited before this cycle)."""
        rose = self.rose_at.get(borrower.node)
        started = borrower.runs[-1].start if borrower.runs else now
        return rose if rose is not None and rose >= started else now

    def _report_progress(self) -> None:
        """The latest progress report of every running job that reports, as the node agent
        would have recorded it by now."""
        state = self.state
        for key in sorted(self.reporting):
            job = state.jobs.get(key)
            run = job.current_run if job is not None else None
            if job is None or run is None or job.phase is not Phase.RUNNING:
                self.reporting.discard(key)
                continue
            done = self.done_s.get(key, 0.0)
            reports = self.curves[key]
            work = done + state.now - run.start
            tick = (run.attempt, math.floor(min(work, reports.run_s) / reports.every))
            if self.ticks.get(key) == tick:
                continue  # no report since the last cycle
            self.ticks[key] = tick
            report = reports.report(done, work, run.start)
            if report is not None and report[1] != job.progress_at:
                state.jobs[key] = replace(job, progress=report[0], progress_at=report[1],
                                          progress_detail=report[2])

    def outcome(self) -> Outcome:
        unfinished = [k for k, r in self.records.items() if r.first_start is None]
        if unfinished:
            raise ValueError(f"{len(unfinished)} job(s) never started under {self.name}, e.g. "
                             f"{unfinished[0]} (a request no node can hold?)")
        first = self.jobs[0].arrival if self.jobs else 0.0
        span = max(0.0, self.last_end - first)
        return Outcome(self.name, self.records, self.trace, self.gpu_seconds,
                       capacity_gpus(self.nodes), span, self.preemptions, self.hours,
                       self.cycles, self.idle_stats,
                       max((j.arrival for j in self.jobs), default=first))


def replay(jobs: Sequence[TraceJob], nodes: Mapping[str, NodeState],
           quotas: Mapping[str, ProjectQuota], policy: Policy, name: str,
           learning_rate: float = DURATION_LEARNING_RATE,
           observe: Callable[[State, Decisions], None] | None = None,
           progress_share: float = 0.0, progress_seed: int = 0,
           idle: IdleCapacity | None = None) -> Outcome:
    """Run the trace through `policy`; every instant with an event is one cycle. `observe`
    sees each cycle's state and decisions before they are carried out. `progress_share` of
    the jobs, drawn from `progress_seed`, report progress as they run (`progress_traces`)."""
    run = Replay(jobs, nodes, quotas, policy, name, learning_rate, observe, progress_share,
                 progress_seed, idle)
    while run.step():
        pass
    return run.outcome()


# ---------------------------------------------------------------- scores


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def first_estimate_errors(jobs: Iterable[tuple[float, float, Estimate | None]],
                          min_wait_s: float = MIN_WAIT_S) -> dict[str, float | int | None]:
    """How far the first estimated starts missed, for (arrival, actual first start, first
    estimate or None) per job, each scored by `eta_accuracy.score_first_estimate` (the rule
    the operator's `carpool_eta_*` metrics and bench/admission.py's in-cluster measure use).

    |estimated start - actual start| / actual wait over jobs that waited at least
    `min_wait_s` and were given an estimate; the signed median (> 0: jobs started later than
    said); coverage: the share of those estimates carrying a range whose range held the start,
    and how wide those ranges were (median of (end - beginning) / actual wait); jobs that
    started sooner get the absolute error in seconds.
    """
    relative: list[float] = []
    signed: list[float] = []
    widths: list[float] = []
    short_abs: list[float] = []
    covered = ranged = waited = 0
    for arrival, start, estimate in jobs:
        if start - arrival >= min_wait_s:
            waited += 1
        if estimate is None:
            continue
        scored = score_first_estimate(arrival, start, estimate.start, estimate.low,
                                      estimate.high, min_wait_s)
        if scored.short_error_s is not None:
            short_abs.append(scored.short_error_s)
            continue
        assert scored.relative is not None and scored.signed is not None
        relative.append(scored.relative)
        signed.append(scored.signed)
        if scored.range_width is not None:
            ranged += 1
            covered += scored.range_result == INSIDE
            widths.append(scored.range_width)
    return {
        "jobs_waited_60s": waited,
        "jobs_waited_60s_with_estimate": len(relative),
        "eta_median_abs_rel_error": _median(relative),
        "eta_p90_abs_rel_error": _quantile(relative, 0.9),
        "eta_median_signed_rel_error": _median(signed),
        "eta_ranged_jobs": ranged,
        "eta_interval_coverage": covered / ranged if ranged else None,
        "eta_range_median_rel_width": _median(widths),
        "eta_short_wait_jobs": len(short_abs),
        "eta_short_wait_median_abs_error_s": _median(short_abs),
    }


def score(outcome: Outcome, min_wait_s: float = MIN_WAIT_S) -> dict[str, object]:
    """The numbers of one replay, as `carpool simulate queue -o json` prints them.

    ETA error at arrival (`first_estimate_errors`) on the estimate given when the job
    arrived, over all jobs and per class. Refreshed: the same relative error for estimates
    given later while the job waited, relative to the wait left then.
    """
    refreshed: list[float] = []
    waits: dict[str, list[float]] = {c.label: [] for c in JobClass}
    samples: dict[str, list[tuple[float, float, Estimate | None]]] = {}
    for key, record in outcome.records.items():
        assert record.first_start is not None
        label = outcome.trace[key].job_class.label
        waits[label].append(record.first_start - record.arrival)
        samples.setdefault(label, []).append(
            (record.arrival, record.first_start, record.arrival_estimate))
        if record.first_start - record.arrival >= min_wait_s:
            for made, start in record.refreshed:
                left = record.first_start - made
                if left >= min_wait_s:
                    refreshed.append(abs(start - record.first_start) / left)
    errors = first_estimate_errors((s for group in samples.values() for s in group), min_wait_s)
    by_class = {c: first_estimate_errors(group, min_wait_s)["eta_median_abs_rel_error"]
                for c, group in sorted(samples.items())}
    capacity_s = outcome.capacity_gpus * outcome.span_s
    return {
        "policy": outcome.policy,
        "jobs": len(outcome.records),
        "jobs_waited_60s": errors["jobs_waited_60s"],
        "jobs_waited_60s_with_estimate": errors["jobs_waited_60s_with_estimate"],
        "eta_median_abs_rel_error": errors["eta_median_abs_rel_error"],
        "eta_p90_abs_rel_error": errors["eta_p90_abs_rel_error"],
        "eta_median_abs_rel_error_by_class": {c: m for c, m in by_class.items()
                                              if m is not None},
        "eta_median_signed_rel_error": errors["eta_median_signed_rel_error"],
        "eta_refreshed_median_abs_rel_error": _median(refreshed),
        "eta_refreshed_samples": len(refreshed),
        "eta_interval_coverage": errors["eta_interval_coverage"],
        "eta_range_median_rel_width": errors["eta_range_median_rel_width"],
        "eta_short_wait_median_abs_error_s": errors["eta_short_wait_median_abs_error_s"],
        "wait_p50_s": {c: _quantile(w, 0.5) for c, w in waits.items() if w},
        "wait_p99_s": {c: _quantile(w, 0.99) for c, w in waits.items() if w},
        "gpu_utilization": outcome.gpu_seconds / capacity_s if capacity_s else None,
        "preemptions": outcome.preemptions,
        "gpu_hours_by_project": {p: round(h, 3)
                                 for p, h in sorted(outcome.gpu_hours_by_project.items())},
        "makespan_s": outcome.span_s,
        "cycles": outcome.cycles,
        **(idle_scores(outcome) if outcome.idle is not None else {}),
    }


def idle_scores(outcome: Outcome) -> dict[str, object]:
    """Work done while the trace arrives (GPU-hours of progress, by the requests' shares, in
    runs the watchdog did not end, up to the last arrival); the waits of jobs that cannot
    borrow (the owners); lent capacity's use and its reclaims."""
    stats = outcome.idle
    assert stats is not None
    first = min((r.arrival for r in outcome.records.values()), default=0.0)
    work = sum(gpus * max(0.0, min(end, outcome.horizon) - max(start, first))
               for start, end, gpus in stats.work_runs)
    owners = [r.first_start - r.arrival for k, r in outcome.records.items()
              if r.first_start is not None and not outcome.trace[k].preemptible]
    stops = list(stats.borrower_stops.values())
    return {
        "work_gpu_hours_by_last_arrival": work / 3600,
        "owner_wait_p50_s": _quantile(owners, 0.5),
        "owner_wait_p99_s": _quantile(owners, 0.99),
        "lent_gpu_hours": stats.lent_gpu_seconds / 3600,
        "owner_reclaims": stats.reclaims,
        "owner_reclaim_p99_s": _quantile(stats.reclaim_latencies, 0.99),
        "borrower_stops_max_per_job": max(stops, default=0),
        "right_sized_runs_outgrown": stats.outgrown,
        "idle_sessions_stopped": stats.sessions_stopped,
    }


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
