"""One reconcile pass, in stages: observe, account for departures, decide, act.

The pass is the imperative shell around `carpool.core.queueing.admission_cycle`. It observes
the watch caches (`operator/observe.py`: a `PassState`, with the Events the pods imply as
data), bills what left (deleted jobs, stray pods) and gives back pods no node took, asks the
core, then carries the decisions out through the writer (`operator/writes.py`), every status
field and Event worded by `carpool.core.job_status`. Everything is re-derived each pass, so a
killed operator resumes exactly where the cluster is: a pod's deterministic name
(`<job>-<attempt>`) makes a repeated admission fail with 409 instead of running twice.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

from carpool.core import interference, job_status, lending, names, right_sizing
from carpool.core.accounting import forget_gone, retire_deleted, retire_runs
from carpool.core.assignment import AssignedGpu, Assignment, encode_assignment
from carpool.core.decoding import (
    retired_to_status,
    worker_names_from_spec,
)
from carpool.core.estimate_ranges import kept_history
from carpool.core.finalizing import (
    Release,
    job_retired_key,
    pod_retired_key,
    release,
    stopped_at,
)
from carpool.core.gangs import WorkerPlacement
from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RetiredUsage, RunRecord
from carpool.core.lifecycle import (
    UNSCHEDULABLE,
    assignment_fraction,
)
from carpool.core.ownership import (
    PodIdentity,
    controls,
    gpujob_owner,
)
from carpool.core.placement import NodeState
from carpool.core.preemption import PreemptionCause
from carpool.core.queueing import (
    Admission,
    AdmissionConfig,
    CycleResult,
    Expiry,
    Preemption,
    Wait,
    admission_cycle,
)
from carpool.core.resources import JobClass
from carpool.core.timeline import TimelineMemo
from carpool.kube.errors import ApiError, BadRequest, Forbidden, Invalid
from carpool.operator import metrics
from carpool.operator.informer import Informers
from carpool.operator.kube import GPUJOBS, PODS, Kube, Obj
from carpool.operator.observe import Observer, PassState, job_identity, orphan_key
from carpool.operator.pod_view import PodView
from carpool.operator.pods import (
    PlatformPodSettings,
    apply_platform_settings,
    build_checkpoint_claim,
    build_gang_service,
    build_pod,
    build_worker_pods,
    pod_name,
)
from carpool.operator.settings import OperatorSettings
from carpool.operator.writes import Writer

log = logging.getLogger(__name__)
# seconds a stray GPU pod (no live job's current attempt) is given to stop: a pass runs at
# least every resync period (5 s), so such a pod is gone within 30 s of becoming one
ORPHAN_GRACE_S = 10
# the placement memo kept between passes holds up to this many entries per node before it
# starts afresh (a node's states, and the fit of each request shape in each)
MEMO_ENTRIES_PER_NODE = 100
# The watch caches, the placement memo and a pass's snapshot are millions of long-lived
# objects at 50,000 jobs; the cycle collector rescanned them whenever a pass had allocated
# enough (a quarter of a pass's CPU time at 10,000 jobs). The collector is off while a pass
# reads and decides (what they build stays alive until the pass ends, so its full
# collections there found nothing to free: a quarter of deciding at 50,000 jobs); then one
# young collection frees their cyclic garbage and what is alive is frozen (still freed by
# reference counting; they hold no cycles that matter), so the collector looks at new
# objects only; everything is unfrozen and collected this often, so what cycles there are
# among them are freed in time.
FULL_COLLECTION_S = 600.0


@dataclass
class ReconcilerConfig:
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # API writes (pods, statuses) in flight at once: each waits tens of ms on the API server,
    # so throughput grows with concurrency up to the server's own limit (measured with
    # direct pool requests on an idle 2-core machine: 8 threads 570 pod creates/s, 32: 530/s)
    write_workers: int = 16
    # A queued job whose reason stays the same gets its position, estimate and message
    # rewritten at most this often (they move every pass; thousands of writes otherwise),
    # unless its estimate or its range's end moved by more than `estimate_jump_s` and a share
    # of the time until it, or its range appeared or went
    # (`job_status.wait_change_is_urgent`).
    wait_refresh_s: float = 60.0
    estimate_jump_s: float = 60.0
    # ... and those refreshes together stay under this many writes per second: every queued
    # job's position moves whenever a job ahead starts, so a queue of N would rewrite N
    # statuses a minute (921 waiting jobs: up to 15 writes/s, next to ~30 GpuJob status
    # writes/s in all in a 5,000-job burst); a longer queue is refreshed less often
    # (N / this many s)
    wait_refresh_per_s: float = 5.0
    # 0: act on every admission a pass decides (a pass reads watch caches, so it is cheap;
    # deferring admissions only leaves capacity idle until the next pass)
    max_admissions_per_pass: int = 0
    # The first this many admissions of a pass are also told by an Admitted Event on the job;
    # the rest by the job's Admitted condition only (which says the same: node, GPUs, time).
    # A lab's passes admit a few jobs and every one gets its Event; a burst of thousands
    # would otherwise add an Event write to every admission (a fifth of its writes), for a
    # stream nobody reads job by job. Events are best effort in Kubernetes too.
    admitted_events_per_pass: int = 100
    # A pass starts no new admission after this many seconds of acting, or three times what
    # reading and deciding took if that is longer (so they stay a quarter of a pass), once a
    # job of the same or a higher class than the next admission has arrived since the pass
    # read (the next pass may rank it first); the rest go to the next pass. 0: no budget.
    admission_budget_s: float = 10.0
    # ... and, while no such job arrives, after this many seconds at the latest: a burst of
    # thousands of admissions is carried out without stopping to decide again (each stop
    # leaves the API server idle for the next pass's read and decide, a fifth of a burst),
    # and what finished meanwhile is seen within this long.
    admission_budget_max_s: float = 60.0
    # the runtime class and MPS client user the platform sets on every job pod
    platform: PlatformPodSettings = field(default_factory=PlatformPodSettings)
    # an admitted job whose pod no node takes for this long is given back to the queue
    # (`lifecycle.give_back_unschedulable`); 0: never
    unschedulable_timeout_s: float = 600.0
    # A pass whose snapshot equals the last decided one but for its time, when that decision
    # started, stopped and expired nothing, keeps that decision instead of deciding again,
    # for up to this many times as long as deciding took: at 50,000 jobs a decision is
    # seconds of CPU and a resync every few seconds changes nothing, so an unchanged cluster
    # costs a quarter of the deciding; what time alone changes (an aging step, a maxDuration
    # reached, the estimates' drift) comes that much later, at most. 0: decide every pass.
    reuse_unchanged: float = 3.0

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> ReconcilerConfig:
        """The reconciler's part of the operator's settings (`operator.settings`)."""
        return cls.from_settings(OperatorSettings.from_environment(env))

    @classmethod
    def from_settings(cls, settings: OperatorSettings) -> ReconcilerConfig:
        return cls(AdmissionConfig(
            fair_share_half_life_s=settings.fair_share_half_life_s,
            aging_step_s=settings.aging_step_s,
            arrival_window_s=settings.arrival_window_s,
            keep_promises=settings.keep_promises,
            start_scenarios=settings.start_scenarios,
            lending=(lending.LendingPolicy(settings.lending_observed_s,
                                           reclaim_within_s=settings.lending_reclaim_within_s,
                                           whole_gpus=settings.lending_whole_gpus)
                     if settings.lending else None),
        ), write_workers=settings.write_workers,
            wait_refresh_s=settings.wait_refresh_s,
            max_admissions_per_pass=settings.max_admissions_per_pass,
            admitted_events_per_pass=settings.admitted_events_per_pass,
            admission_budget_s=settings.admission_budget_s,
            admission_budget_max_s=settings.admission_budget_max_s,
            platform=PlatformPodSettings(settings.job_runtime_class, settings.mps_client_uid,
                                         settings.mps_client_gid),
            unschedulable_timeout_s=settings.unschedulable_timeout_s)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cycle collector off for the block (as it was after it; `FULL_COLLECTION_S`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class _Stray:
    """A pod being stopped as an orphan: as last seen, and the time it is billed up to
    (None: it had not started when first seen)."""

    pod: PodView
    billed_until: float | None


class CacheBehind(RuntimeError):
    """The watch caches have not caught up with our own writes: no pass on a stale view."""


class Reconciler:
    def __init__(self, kube: Kube, config: ReconcilerConfig, informers: Informers):
        self.kube = kube
        self.config = config
        # the observe stage, which holds the watch caches the pass reads
        self.observer = Observer(informers, config.unschedulable_timeout_s)
        self.last_result: CycleResult | None = None
        self._priority_class_ready = False
        # the write stage; it reads the newest job from whichever caches the pass reads
        self.writer = Writer(kube, lambda key: self.informers.get(GPUJOBS, key),
                             config.write_workers)
        self._wait_written: dict[str, float] = {}  # job key -> monotonic time of last write
        # job key -> monotonic time since when the passes have left it waiting
        self._waiting_since: dict[str, float] = {}
        self._last_pass: float | None = None  # when the last pass's metrics were recorded
        self._reclaiming: dict[str, tuple[int, float]] = {}  # borrower -> (attempt, decided)
        self._refresh_s = config.wait_refresh_s  # see ReconcilerConfig.wait_refresh_per_s
        self._admit_rate = 0.0  # admissions carried out per second of acting, smoothed
        self._backlog_s = 0.0  # time to carry out the admissions this pass left for later
        self._strays: dict[str, _Stray] = {}  # pod uid -> a stray being stopped (_stop_strays)
        # uids of deleted jobs the watch remembers that had nothing to retire (_retire_gone)
        self._nothing_to_retire: set[str] = set()
        # node states and fits kept from pass to pass, as the replay keeps them: most nodes
        # and holders are as the last pass saw them (the read reuses their inventories and
        # decodings), so most placement questions were answered then
        self._node_states: dict[str, NodeState] = {}
        self._collected_at = time.monotonic()  # the last full collection (FULL_COLLECTION_S)
        # the last decision, what it was made from and how many seconds it took to make
        # (ReconcilerConfig.reuse_unchanged)
        self._decided: tuple[ClusterSnapshot, CycleResult, float] | None = None
        if config.admission.timeline_memo is None:
            config.admission = replace(config.admission, timeline_memo=TimelineMemo())

    @property
    def informers(self) -> Informers:
        return self.observer.informers

    @informers.setter
    def informers(self, informers: Informers) -> None:
        self.observer.informers = informers

    def read(self, now: float) -> PassState:
        """The watch caches decoded (`Observer.read`); writes nothing."""
        return self.observer.read(now)

    def _pod_gone_at(self, uid: str) -> float | None:
        return self.observer.pod_gone_at(uid)

    # -- one pass --------------------------------------------------------------------------

    def run_pass(self, now: float, still_leader: Callable[[], bool] = lambda: True,
                 catch_up_s: float = 15.0) -> CycleResult:
        """One pass, in stages: observe the caches, account for what left (deleted jobs' usage,
        stray pods, pods no node took), decide, then act on the decisions."""
        started = time.monotonic()
        with _collector_paused():
            state = self.observe(now, catch_up_s)
            self.account_departures(state, still_leader)
            read_s = time.monotonic() - started
            result = self.decide(state)
            self._freeze_long_lived()
        decide_s = time.monotonic() - started - read_s
        if not still_leader():
            log.info("lost leadership during the pass; not acting on it")
            return result
        writes_before = self.kube.api.writes
        self.act(state, result, budget=max(self.config.admission_budget_s,
                                           3 * (read_s + decide_s)), still_leader=still_leader)
        self.last_result = result
        writes = self.kube.api.writes - writes_before
        spent = time.monotonic() - started
        metrics.PASS_SECONDS.observe(spent)
        log.info("reconcile pass: %d jobs, %d admitted, %d preempted, %d waiting, %d writes; "
                 "read %.2fs decide %.2fs act %.2fs", len(state.jobs), len(state.admitted),
                 len(result.preemptions), len(result.waits), writes, read_s, decide_s,
                 spent - read_s - decide_s)
        return result

    def observe(self, now: float, catch_up_s: float = 15.0) -> PassState:
        """Stage 1: the watch caches, once they show this operator's own writes, decoded into
        the pass's snapshot (jobs, pods, nodes, quotas and their retired usage), with the
        Events derived from them as data."""
        if not self.informers.caught_up(catch_up_s):
            raise CacheBehind("a watch cache is behind this operator's own writes")
        now = max(now, time.time())  # the wait above may have taken a while
        arrived = self.informers.arrived(GPUJOBS)  # jobs after this are new to the pass
        state = self.observer.read(now)
        state.arrived = arrived
        state.quotas, state.quota_objects = self.observer.quotas()
        state.retired = self.observer.retired(state.quota_objects)
        # the Events recorded on jobs gone from the caches are forgotten
        self.writer.forget_jobs_except(str(obj["metadata"].get("uid", ""))
                                       for obj in state.objects.values())
        return state

    def _freeze_long_lived(self) -> None:
        """Keep the cycle collector off what the pass has read and decided
        (`FULL_COLLECTION_S`)."""
        clock = time.monotonic()
        if clock - self._collected_at >= FULL_COLLECTION_S:
            gc.unfreeze()
            gc.collect()
            self._collected_at = clock
        else:
            gc.collect(1)  # young cyclic garbage first, so it is not frozen with the rest
        gc.freeze()

    def account_departures(self, state: PassState, still_leader: Callable[[], bool]) -> None:
        """Before deciding, what the decision counts on: the Events the read derived, deleted
        jobs' and stray pods' GPU time billed (in `state.retired`), and admitted jobs whose
        pod no node took given back."""
        for obj, event in state.events:
            self._record_event(obj, event)
        # the keys of the deleted jobs the watch remembers, before any retired usage is
        # written: `_present` keeps them, or a write would drop a retired job's key and
        # `_retire_gone` would bill it again
        for _, obj in self.informers.gone(GPUJOBS):
            meta = obj.get("metadata") or {}
            state.gone_job_keys.add(job_retired_key(str(meta.get("namespace", "")),
                                                    str(meta.get("name", "")),
                                                    str(meta.get("uid", ""))))
        if state.deleting and still_leader():
            self._retire(state, state.quotas, state.quota_objects, state.retired, state.now)
        if still_leader():
            self._retire_gone(state)
        if (state.orphans or state.tampered or self._strays) and still_leader():
            self._stop_strays(state, state.quotas, state.quota_objects, state.retired,
                              state.now)
        if state.lingering and still_leader():
            self._release_pods(state)
        if state.unschedulable and still_leader():
            self._give_back_unschedulable(state)
        if (state.broken_gangs or state.gang_leftovers) and still_leader():
            self._stop_broken_gangs(state)

    def decide(self, state: PassState) -> CycleResult:
        """Stage 2: the core's admission cycle on the snapshot (pure)."""
        nodes = {}
        for name, inventory in state.inventories.items():
            kept = self._node_states.get(name)
            nodes[name] = kept if kept is not None and kept.inventory is inventory \
                else NodeState(inventory)
        self._node_states = nodes
        memo = self.config.admission.timeline_memo
        if memo is not None:  # room for every node's states and fits of a few shapes
            memo.limit = max(memo.limit, MEMO_ENTRIES_PER_NODE * len(nodes))
        # what deleted jobs taught the estimates, as the replay keeps it run by run
        learned, misses = kept_history(state.retired.values())
        # each job's sharing limits from what the jobs' service measures teach
        profiles = interference.learn_from_gpujobs(state.objects.values())
        jobs = interference.with_limits(state.jobs, profiles)
        policy = self.config.admission.lending
        sizes = right_sizing.calibrated_sizes(jobs)
        if policy is not None:  # what each running job may lend, from its measured peak
            jobs = lending.with_lendable(jobs, policy, state.now, sizes)
        # waiting preemptible jobs placed by their calibrated size, where their project says
        jobs = right_sizing.with_calibrated(jobs, state.quotas, sizes, right_sizing.smallest_gpus(
            g for n in nodes.values() for g in n.inventory.gpus))
        snapshot = ClusterSnapshot(now=state.now, jobs=tuple(jobs), quotas=state.quotas,
                                   nodes=nodes, retired=state.retired, learned=learned,
                                   start_misses=misses)
        if self._decided is not None:
            last, result, took_s = self._decided
            if _reusable(last, result, snapshot, self.config.reuse_unchanged * took_s):
                return result
        started = time.monotonic()
        result = admission_cycle(snapshot, self.config.admission)
        self._decided = (snapshot, result, time.monotonic() - started)
        return result

    def act(self, state: PassState, result: CycleResult, budget: float,
            still_leader: Callable[[], bool]) -> None:
        """Stage 3: carry the decisions out through the writer: admissions (within the
        budget), preemptions, expiries and waits as `job_status` words them, the quotas'
        status, then the rest of the statuses in the background."""
        if not self._priority_class_ready:
            self.kube.ensure_priority_class()
            self._priority_class_ready = True
        self._apply(state, result, state.now, budget=budget, still_leader=still_leader)
        self._write_quota_status(result, state.quota_objects)
        self.writer.statuses_later(state.patches)
        state.patches = {}
        self._record_metrics(state, result)

    # -- accounting of deleted jobs ---------------------------------------------------------

    def wait_for_writes(self) -> None:
        """Wait until every background write submitted so far has landed (tests, shutdown)."""
        self.writer.drain()

    def _retire(self, state: PassState, quotas: Mapping[str, ProjectQuota],
                quota_objects: Mapping[str, Obj], retired: dict[str, RetiredUsage],
                now: float) -> None:
        """Jobs being deleted that the caches still show (a foreground deletion waits for
        their pods, which Carpool's finalizer holds; a job of an earlier release carries that
        finalizer itself): stop a live pod first (its run must end before it is counted), then
        fold the job's runs into its project's retired usage and write that; only then are its
        pods released (`_release_pods`) and an earlier release's finalizer taken off the job
        (never put on one now). Deleting a job therefore never refunds budget, and what it
        taught the estimates (its run time, its first estimate's miss) stays."""
        releasable: list[Obj] = []
        changed: set[str] = set()
        for key, (job, live) in sorted(state.deleting.items()):
            obj = state.objects[key]
            if live is not None:
                if not live.deleting:
                    self.kube.delete_pod(live.namespace, live.name,
                                         max(0, math.ceil(job.checkpoint_grace_s)),
                                         uid=live.uid)
                    self.kube.event(_pod_ref(live), "JobDeleted",
                                    f"GpuJob {key} was deleted; its attempt {live.attempt} "
                                    f"is stopped and its GPU time billed to project "
                                    f"{job.project}", "Normal", "Stop")
                continue
            self._retire_job(obj, job, quotas, retired, changed, now)
            state.on_record.add(str(obj["metadata"].get("uid", "")))
            if names.FINALIZER in (obj["metadata"].get("finalizers") or ()):
                releasable.append(obj)
        self._write_retired(state, changed, quota_objects, retired)
        for obj in releasable:
            meta = obj["metadata"]
            keep = [f for f in meta.get("finalizers") or [] if f != names.FINALIZER]
            self.kube.set_job_finalizers(meta["namespace"], meta["name"], keep,
                                         str(meta.get("resourceVersion", "")))

    def _retire_job(self, obj: Obj, job: Job, quotas: Mapping[str, ProjectQuota],
                    retired: dict[str, RetiredUsage], changed: set[str], now: float) -> None:
        """Fold a deleted job's runs and what it taught the estimates into its project's
        retired usage, once per job object (`accounting.retire_deleted`)."""
        quota = quotas.get(job.project)
        if quota is None or not job.runs:
            return
        before = retired.get(job.project)
        meta = obj["metadata"]
        # keyed by uid: a new job of the same name must not be taken for this one
        uid = str(meta.get("uid", ""))
        key = job_retired_key(str(meta.get("namespace", "")), str(meta.get("name", "")), uid)
        after = retire_deleted(before, replace(job, key=key), quota, now,
                               self.config.admission.fair_share_half_life_s,
                               self.config.admission.duration_learning_rate)
        if after is not before:
            retired[job.project] = after
            changed.add(job.project)
            log.info("billed deleted GpuJob %s (uid %s) to project %s: %s", job.key, uid,
                     job.project, _runs_text(job.runs, now))

    def _retire_gone(self, state: PassState) -> None:
        """Jobs the watch saw deleted (gone at once: nothing holds a GpuJob), from their last
        state: retired as `_retire` does once none of their pods holds GPUs any more (an
        orphan is stopped meanwhile; Carpool's finalizer keeps each of their pods until then).
        A job deleted while no operator watched is not known here; its pods' own runs are
        billed when they are released (`_release_pods`)."""
        changed: set[str] = set()
        holding = {uid for p in state.pods.values() if p.holds_gpus
                   for uid in (p.owner.uid if p.owner else "", p.job_uid) if uid}
        holding_pods = {p.uid for p in state.pods.values() if p.holds_gpus}
        remembered: set[str] = set()
        for _, obj in self.informers.gone(GPUJOBS):
            meta = obj.get("metadata") or {}
            uid = str(meta.get("uid", ""))
            if str((obj.get("status") or {}).get("podUID") or "") in holding_pods:
                holding.add(uid)  # its recorded pod, its ownerReference taken off (Orphan)
            remembered.add(uid)
            project = str((obj.get("spec") or {}).get("project", ""))
            key = job_retired_key(str(meta.get("namespace", "")), str(meta.get("name", "")),
                                  uid)
            usage = state.retired.get(project)
            if uid in self._nothing_to_retire or (usage is not None and key in usage.job_keys):
                state.on_record.add(uid)
                continue
            if uid in holding:
                continue  # its pod is being stopped; its run ends first
            job = self.observer.last_state(obj, state)
            if job is None or not job.runs or project not in state.quotas:
                self._nothing_to_retire.add(uid)
            else:
                self._retire_job(obj, job, state.quotas, state.retired, changed, state.now)
            state.on_record.add(uid)
        self._nothing_to_retire &= remembered
        self._write_retired(state, changed, state.quota_objects, state.retired)

    def _release_pods(self, state: PassState) -> None:
        """Release the pods whose deletion is final once their runs are on record
        (`core.finalizing.release`): a pod no job will record is billed to its namespace's
        project first (its retired usage written), a deleted job's pods wait for `_retire`."""
        billed: set[str] = set()
        ready: list[PodView] = []
        gone_jobs = [o for _, o in self.informers.gone(GPUJOBS)]
        gone, gone_by_pod = _by_uid(gone_jobs), _by_pod_uid(gone_jobs)
        live, live_by_pod = _by_uid(state.objects.values()), _by_pod_uid(state.objects.values())
        for pod in state.lingering.values():
            if not pod.finalized:
                continue
            obj = _job_of(pod, live, live_by_pod)
            deleted = obj is None or bool(obj["metadata"].get("deletionTimestamp"))
            if obj is None:
                obj = _job_of(pod, gone, gone_by_pod)
            quota = quota_of_namespace(state.quotas, pod.namespace)
            if obj is not None:
                quota = state.quotas.get(str((obj.get("spec") or {}).get("project", ""))) \
                    or quota
            usage = state.retired.get(quota.name) if quota is not None else None
            decision = release(pod, job_identity(obj) if obj is not None else None,
                               (obj or {}).get("status") or {}, deleted,
                               usage.job_keys if usage is not None else frozenset())
            if decision is Release.RETIRE_JOB and obj is not None \
                    and str(obj["metadata"].get("uid", "")) in state.on_record:
                decision = Release.NOW  # retired this pass, or it had nothing to retire
            if decision is Release.BILL_POD:
                if quota is not None and quota.name in state.quota_objects:
                    self._bill_stray(state, pod, quota, pod_retired_key(pod), None,
                                     stopped_at(pod) or state.now, state.retired, billed)
                decision = Release.NOW
            if decision is Release.NOW:
                ready.append(pod)
        self._write_retired(state, billed, state.quota_objects, state.retired)
        for pod in ready:
            stored = self.informers.get(PODS, f"{pod.namespace}/{pod.name}")
            finalizers = list(((stored or {}).get("metadata") or {}).get("finalizers") or [])
            if names.FINALIZER in finalizers and self.kube.release_pod(
                    pod.namespace, pod.name, pod.uid, finalizers):
                log.debug("released pod %s/%s (uid %s)", pod.namespace, pod.name, pod.uid)

    # -- pods no job accounts for -------------------------------------------------------

    def _stop_strays(self, state: PassState, quotas: Mapping[str, ProjectQuota],
                     quota_objects: Mapping[str, Obj], retired: dict[str, RetiredUsage],
                     now: float) -> None:
        """Stop the GPU pods that are no live job's current attempt (`state.orphans`: a job
        deleted, a pod made to look like one, an attempt superseded) and the recorded
        attempts their job no longer controls (`state.tampered`), each with an Event on the
        pod and on the job it names. An orphan's GPU time is billed to its namespace's
        project until its pod is gone or has ended (a tampered attempt stays on its job's
        bill): up to when it is first seen stray at once (in the quota's status, so a new
        leader does not bill it again), the rest when it ends (`_bill_stray`). An orphan of a
        deleted job that carries Carpool's finalizer is billed once, when it is released
        (with its job's usage, or on its own: `_release_pods`); one of a job the watch saw
        deleted is stopped as that job's (`_stop_deleted_jobs_pod`)."""
        changed: set[str] = set()
        live = {str(o["metadata"].get("uid", "")) for o in state.objects.values()
                if not o["metadata"].get("deletionTimestamp")}
        gone_jobs = [o for _, o in self.informers.gone(GPUJOBS)]
        deleted, deleted_by_pod = _by_uid(gone_jobs), _by_pod_uid(gone_jobs)
        for pod in state.orphans:
            quota = quota_of_namespace(quotas, pod.namespace)
            stray = self._strays.get(pod.uid)
            job = _job_of(pod, deleted, deleted_by_pod) if pod.finalized else None
            if job is not None:
                self._stop_deleted_jobs_pod(pod, job, quotas)
                continue
            of_live_job = (pod.owner is not None and pod.owner.uid in live) \
                or pod.job_uid in live
            if pod.finalized and not of_live_job:
                pass  # billed when released
            elif stray is None or stray.billed_until is None:
                billed_until = self._bill_stray(state, pod, quota, orphan_key(pod), None, now,
                                                retired, changed)
                stray = _Stray(pod, billed_until)
                self._strays[pod.uid] = replace(stray, pod=pod)
            else:
                self._strays[pod.uid] = replace(stray, pod=pod)
            why = (f"pod {pod.namespace}/{pod.name} holds or was assigned a Carpool GPU but is "
                   f"not the current attempt of a live GpuJob in {pod.namespace}"
                   + (f" (it names GpuJob {pod.owner.name}, which does not record it)"
                      if pod.owner else "") + "; stopped, its GPU time billed to "
                   + (f"project {quota.name}" if quota else "no project (namespace unbound)"))
            self._stop(state, pod, "OrphanStopped", why,
                       f"{pod.namespace}/{pod.owner.name}" if pod.owner else "")
        stray_uids = {pod.uid for pod in state.orphans}
        for uid, stray in list(self._strays.items()):
            if uid in stray_uids:
                continue
            del self._strays[uid]
            last = state.pods.get(uid)
            if last is not None and not last.terminal:
                continue  # a job's attempt after all: its job bills it
            ended = (last.finished if last is not None and last.finished else
                     self._pod_gone_at(uid) or now)
            self._bill_stray(state, stray.pod, quota_of_namespace(quotas, stray.pod.namespace),
                             f"{orphan_key(stray.pod)}/end", stray.billed_until, ended,
                             retired, changed)
        for key, pod, what in state.tampered:
            why = (f"pod {pod.namespace}/{pod.name} is the recorded attempt of GpuJob {key} "
                   f"but {what}; stopped (Carpool's ownerReferences, labels and annotations "
                   f"are not to be changed)")
            self._stop(state, pod, "AttemptTampered", why, key)
        self._write_retired(state, changed, quota_objects, retired)

    def _stop_deleted_jobs_pod(self, pod: PodView, job: Obj,
                               quotas: Mapping[str, ProjectQuota]) -> None:
        """A pod of a job the watch saw deleted: stopped with its own grace (the job's
        checkpoint grace, as the garbage collector deletes it too); its run is billed with
        the job's when it has ended (`_retire_gone`)."""
        if pod.deleting:
            return
        project = str((job.get("spec") or {}).get("project", ""))
        self.kube.delete_pod(pod.namespace, pod.name, None, uid=pod.uid)
        self.kube.event(_pod_ref(pod), "JobDeleted",
                        f"GpuJob {pod.namespace}/{pod.owner.name if pod.owner else '?'} was "
                        f"deleted; its attempt {pod.attempt} is stopped and its GPU time billed "
                        f"to project " + (project if project in quotas else "(none)"),
                        "Normal", "Stop")

    def _write_retired(self, state: PassState, changed: set[str],
                       quota_objects: Mapping[str, Obj], retired: dict[str, RetiredUsage]
                       ) -> None:
        """Write the retired usage of the `changed` projects, keeping only the keys of what
        still exists (`accounting.forget_gone`)."""
        present = _present(state)
        for project in sorted(changed):
            if project in quota_objects:
                retired[project] = forget_gone(retired[project], present)
                self.kube.patch_quota_status(project,
                                             {"retired": retired_to_status(retired[project])})

    def _bill_stray(self, state: PassState, pod: PodView, quota: ProjectQuota | None,
                    key: str, since: float | None, until: float,
                    retired: dict[str, RetiredUsage], changed: set[str]) -> float | None:
        """Fold `pod`'s GPU time from `since` (its start when None) to `until` into its
        project's retired usage under `key`, once; the time billed up to (None when the pod
        has not started: nothing to bill yet)."""
        start = pod.started if since is None else since
        if start is None:
            return None
        totals = {g.uuid: g.memory_total_mib for inv in state.inventories.values()
                  for g in inv.gpus}
        slices = {m.uuid: m.slices for inv in state.inventories.values()
                  for g in inv.gpus for m in g.mig_instances}
        # (the isolation the extender recorded in the assignment, from the job's spec)
        fraction = assignment_fraction(
            pod.assignment, totals, mig_slices=slices,
            isolation=pod.assignment.isolation if pod.assignment else None)
        if quota is not None and fraction > 0 and until > start:
            before = retired.get(quota.name)
            run = RunRecord(1, start, until, fraction, pod.node)
            after = retire_runs(before, key, (run,), quota, until,
                                self.config.admission.fair_share_half_life_s)
            if after is not before:
                retired[quota.name] = after
                changed.add(quota.name)
                log.info("billed stray pod %s/%s (uid %s) to project %s: %s", pod.namespace,
                         pod.name, pod.uid, quota.name, _runs_text((run,), until))
        return max(start, until)

    def _give_back_unschedulable(self, state: PassState) -> None:
        """Admitted jobs whose pod no node took in time (`lifecycle.give_back_unschedulable`):
        their status first (the job shows Preempted, or Failed), then their pod stopped.
        They stay counted as holding their grant in this pass; the next one sees them
        stopping."""
        for key, status, note in state.unschedulable:
            obj = state.objects[key]
            state.patches.setdefault(key, {}).update(status)
            self._record_event(obj, job_status.JobEvent(UNSCHEDULABLE, note, "Warning", "Requeue"))
            self._write_status_now(state, key)
            job = next((j for j in state.jobs if j.key == key), None)
            if job is not None:
                self._stop_attempt(state, job, 0)

    def _stop_broken_gangs(self, state: PassState) -> None:
        """A gang never runs in part: one whose worker is gone or failed is stopped whole
        (its rank 0 gone, the next pass requeues it: `lifecycle.observe`, PodLost), and
        workers left after their rank 0 ended are stopped."""
        jobs = {j.key: j for j in state.jobs}
        for key, why in state.broken_gangs:
            job = jobs.get(key)
            if job is None:
                continue
            note = (f"{why}; the gang is stopped whole and requeued (a gang never runs "
                    f"in part)")
            log.warning("%s: %s", key, note)
            self._record_event(state.objects[key], job_status.JobEvent(
                "GangBroken", note, "Warning", "Stop"))
            self._stop_attempt(state, job, job.checkpoint_grace_s)
        for pod in state.gang_leftovers:
            self.kube.delete_pod(pod.namespace, pod.name, ORPHAN_GRACE_S, uid=pod.uid)

    def _stop(self, state: PassState, pod: PodView, reason: str, why: str, job_key: str) -> None:
        if pod.deleting:
            return
        log.warning("%s", why)
        self.kube.delete_pod(pod.namespace, pod.name, ORPHAN_GRACE_S, uid=pod.uid)
        self.kube.event(_pod_ref(pod), reason, why, "Warning", "Stop")
        job = state.objects.get(job_key)
        if job is not None:
            self.kube.event(job, reason, why, "Warning", "Stop")
        metrics.STRAYS_STOPPED.labels(reason).inc()

    # -- acting ----------------------------------------------------------------------------

    def _apply(self, state: PassState, result: CycleResult, now: float,
               budget: float = 0.0, still_leader: Callable[[], bool] = lambda: True) -> None:
        jobs = {j.key: j for j in state.jobs}

        def admit(admission: Admission) -> None:
            try:
                self._admit(state, jobs[admission.job_key], admission, now)
                self._write_status_now(state, admission.job_key)  # Admitted as soon as its pod is
            except Exception:  # one job's failure must not stop the others' decisions
                log.exception("admitting %s failed; retrying next pass", admission.job_key)

        # Admissions beyond the cap or the time budget are left for the next pass (in queue
        # order, so the highest-ranked go first): a pass stays short even when the API server
        # is slow, and leaving an admission out only leaves capacity the core counted as taken.
        admissions = sorted(result.admissions, key=lambda a: a.position)
        cap = self.config.max_admissions_per_pass
        budget = budget if self.config.admission_budget_s > 0 else 0.0
        acting = time.monotonic()
        deadline = acting + budget
        latest = acting + max(budget, self.config.admission_budget_max_s)

        def go_on(admission: Admission) -> bool:
            at = time.monotonic()
            spent = budget > 0 and at > deadline and (
                at > latest or self._outranked(state, jobs[admission.job_key]))
            return not spent and still_leader()  # a long pass must not outlive its lease

        started = self.writer.admit_in_parallel(
            admissions[:cap] if cap > 0 else admissions, admit, go_on)
        state.admitted.extend(a.job_key for a in started)
        self._note_backlog(len(state.admitted), len(admissions) - len(state.admitted),
                           time.monotonic() - acting)
        for preemption in result.preemptions:
            try:
                self._preempt(state, jobs, preemption)
            except Exception:
                log.exception("preempting %s failed; retrying next pass", preemption.victim_key)
        for expiry in result.expiries:
            try:
                self._expire(state, jobs[expiry.job_key], expiry, now)
            except Exception:
                log.exception("stopping %s failed; retrying next pass", expiry.job_key)
        waiting = {w.job_key for w in result.waits}
        for key in [k for k in self._wait_written if k not in waiting]:
            del self._wait_written[key]
        self._refresh_s = job_status.wait_refresh_s(len(waiting), self.config.wait_refresh_s,
                                                    self.config.wait_refresh_per_s)
        left_for_later = len(state.admitted) < len(admissions)
        clock = time.monotonic()
        self._waiting_since = {k: self._waiting_since.get(k, clock) for k in waiting}
        for wait in result.waits:
            self._record_wait(state, wait, now, job_status.wait_unsettled(
                left_for_later, clock - self._waiting_since[wait.job_key], self._refresh_s))

    def _outranked(self, state: PassState, job: Job) -> bool:
        """Has a job arrived since the pass read that the next pass might rank before `job`
        (its class is the same or higher)? Each arrival is looked at once per pass."""
        arrivals = self.informers.arrived_since(GPUJOBS, state.arrived)
        if arrivals is None:
            return True
        state.arrived += len(arrivals)
        for obj in arrivals:
            try:
                cls = JobClass.parse(str((obj.get("spec") or {}).get("class", "batch")))
            except ValueError:
                continue  # refused as InvalidSpec by the next pass; it ranks nowhere
            if state.best_arrival is None or cls < state.best_arrival:
                state.best_arrival = cls
        return state.best_arrival is not None and state.best_arrival <= job.job_class

    def _note_backlog(self, acted: int, deferred: int, seconds: float) -> None:
        """How long the admissions decided but left for later passes will take at the rate
        this operator carries them out: the queue's estimates assume every admission it
        decides happens now, so a waiting job's estimate shifts by that much."""
        if acted and seconds > 0:
            rate = acted / seconds
            self._admit_rate = rate if not self._admit_rate else \
                0.5 * rate + 0.5 * self._admit_rate
        self._backlog_s = deferred / self._admit_rate if deferred and self._admit_rate else 0.0

    def _preempt(self, state: PassState, jobs: Mapping[str, Job], preemption: Preemption) -> None:
        victim = jobs[preemption.victim_key]
        obj = state.objects[victim.key]
        patch, on_victim, on_preemptor = job_status.preempted(victim.attempts, preemption)
        state.patches.setdefault(victim.key, {}).update(patch)
        self._record_event(obj, on_victim)
        preemptor = state.objects.get(preemption.preemptor_key)
        if preemptor is not None:
            self._record_event(preemptor, on_preemptor)
        metrics.PREEMPTIONS.labels(victim.project, preemption.cause.value).inc()
        if preemption.cause is PreemptionCause.OWNER_RECLAIM:
            self._reclaiming[victim.key] = (victim.attempts, state.now)
        self._write_status_now(state, victim.key)  # record intent before the pod goes
        self._stop_attempt(state, victim, preemption.grace_s)

    def _expire(self, state: PassState, job: Job, expiry: Expiry, now: float) -> None:
        obj = state.objects[job.key]
        patch, event = job_status.expired(state.patches.get(job.key, {}).get("history")
                                          or (obj.get("status") or {}).get("history") or [],
                                          expiry, now)
        state.patches.setdefault(job.key, {}).update(patch)
        self._record_event(obj, event)
        metrics.JOBS_STOPPED.labels(job.project, expiry.reason).inc()
        self._write_status_now(state, job.key)
        self._stop_attempt(state, job, expiry.grace_s)

    def _stop_attempt(self, state: PassState, job: Job, grace_s: float) -> None:
        """Delete the pod of `job`'s current attempt, only that pod object: by the uid of the
        pod the pass linked to the job, or else the one its status records (`podUID`). A pod
        recreated under the attempt's name since (by anyone) is not it and is left alone; with
        neither uid known there is no pod to stop."""
        grace = max(0, math.ceil(grace_s))
        for worker in state.gang_pods.get(job.key, ()):  # a gang stops whole
            if not worker.deleting:
                self.kube.delete_pod(worker.namespace, worker.name, grace, uid=worker.uid)
        pod = state.attempt_pods.get(job.key)
        if pod is not None and pod.uid:
            self.kube.delete_pod(pod.namespace, pod.name, grace, uid=pod.uid)
            return
        status = state.objects[job.key].get("status") or {}
        uid = str(status.get("podUID") or "")
        if uid:
            name = str(status.get("podName") or _pod_name_of(job))
            self.kube.delete_pod(job.namespace, name, grace, uid=uid)
        else:
            log.info("%s: no pod of attempt %d to stop", job.key, job.attempts)

    def _record_wait(self, state: PassState, wait: Wait, now: float,
                     unsettled: bool = False) -> None:
        """Carry out `job_status.wait_update`: the wait written now if urgent, with another
        write of the job, or once its refresh period passed; a first wait not while
        `unsettled` (`job_status.wait_unsettled`)."""
        obj = state.objects[wait.job_key]
        update = job_status.wait_update(obj.get("status") or {}, wait, now, self._backlog_s,
                                        state.start_delay_s, self.config.estimate_jump_s)
        if update is None:
            return
        clock = time.monotonic()
        since = clock - self._wait_written.get(wait.job_key, -math.inf)
        if not job_status.write_wait_now(update, bool(state.patches.get(wait.job_key)), since,
                                         self._refresh_s, unsettled):
            return  # only the position, message or a small estimate shift: later
        self._wait_written[wait.job_key] = clock
        state.patches.setdefault(wait.job_key, {}).update(
            state.initial.pop(wait.job_key, {}), **update.patch)
        if update.event is not None:
            self._record_event(obj, update.event)

    def _admit(self, state: PassState, job: Job, admission: Admission, now: float) -> None:
        obj = state.objects[job.key]
        try:
            if admission.workers:
                pods = [apply_platform_settings(p, job.request.isolation, self.config.platform)
                        for p in build_worker_pods(obj, job.workers, admission.attempt,
                                                   _planned(admission, obj, job, state))]
                self.kube.ensure_service(build_gang_service(obj))
            else:
                request = right_sizing.pod_request(job.request, admission.grants)
                pod = build_pod(obj, request, admission.attempt)
                if request != job.request or any(g.borrowed for g in admission.grants):
                    # placed by its calibrated size, or in lent capacity: these GPUs
                    pod["metadata"]["annotations"][names.ANN_PLANNED] = encode_assignment(
                        _planned(admission, obj, job, state)[0])
                pods = [apply_platform_settings(pod, request.isolation,
                                                self.config.platform)]
            pod = pods[0]
            claim = build_checkpoint_claim(obj)
            if claim is not None:
                self.kube.ensure_claim(claim)
            created, stored = self.kube.create_pod(pod)
        except (ValueError, BadRequest, Forbidden, Invalid) as err:
            # (other API errors are transient: API down, throttled; the next pass tries again)
            rejected, event = job_status.pod_rejected(
                admission.attempt, err.message if isinstance(err, ApiError) else str(err), now)
            state.patches.setdefault(job.key, {}).update(state.initial.pop(job.key, {}),
                                                          **rejected)
            self._record_event(obj, event)
            return
        stored_meta = (stored or {}).get("metadata") or {}
        identity = PodIdentity(str(stored_meta.get("namespace", "")),
                               str(stored_meta.get("name", "")), str(stored_meta.get("uid", "")),
                               gpujob_owner(stored_meta.get("ownerReferences")))
        if not created and not controls(job_identity(obj), identity):
            # the name is taken by a pod this job does not control: never take it for ours
            self._record_event(obj, job_status.pod_name_taken(pod["metadata"]["name"],
                                                          admission.attempt))
            return
        # rank 0 is the attempt's pod; a gang's other workers start with it. The extender
        # binds none of them before status.gangCreated says all exist (a worker that cannot
        # be created stops the whole gang next pass: `Observer`, broken gangs).
        missing = 0
        for worker in pods[1:]:
            try:
                self.kube.create_pod(worker)
            except ApiError as err:
                missing += 1
                log.warning("%s: creating worker pod %s failed: %s", job.key,
                            worker["metadata"]["name"], err)
        gpus = job_status.grants_to_status(
            admission.workers[0].grants if admission.workers else admission.grants,
            state.inventories.get(admission.node))
        if not admission.workers:  # a whole-GPU job granted a share holds only that share
            gpus = job_status.shared_whole_gpu_status(
                gpus, job.request, right_sizing.pod_request(job.request, admission.grants))
        # admitted when its pod exists, not when the pass began deciding (minutes apart when
        # a pass over a large queue writes thousands of admissions)
        admitted_at = max(now, time.time())
        patch = state.patches.setdefault(job.key, {})
        patch.update(state.initial.pop(job.key, {}))
        patch.update(job_status.admitted(obj.get("status") or {}, admission, gpus,
                                         pod["metadata"]["name"], identity.uid, admitted_at))
        if admission.workers:
            patch["workers"] = job_status.gang_workers(
                admission, state.inventories, worker_names_from_spec(obj.get("spec") or {}),
                [p["metadata"]["name"] for p in pods])
            if not missing:
                patch["gangCreated"] = admission.attempt
        if created:
            if next(state.admitted_events) < self.config.admitted_events_per_pass:
                self._record_event(obj, job_status.JobEvent("Admitted", admission.message,
                                                        "Normal", "Admit"))
            cls = job.job_class.label
            metrics.ADMISSIONS.labels(job.project, cls).inc()
            metrics.WAIT_SECONDS.labels(job.project, cls).observe(
                max(0.0, admitted_at - job.submitted_at))

    def _record_event(self, obj: Obj, event: job_status.JobEvent) -> None:
        self.writer.event(obj, event)

    def _write_status_now(self, state: PassState, key: str) -> None:
        """Write job `key`'s patch of this pass now; the pass sees the job as written."""
        patch = state.patches.pop(key, None)
        if not patch:
            return
        written = self.writer.status_now(key, state.objects.get(key), patch)
        if written is not None:
            state.objects[key] = written

    def _write_quota_status(self, result: CycleResult, objects: Mapping[str, Obj]) -> None:
        for project in result.projects:
            obj = objects.get(project.project)
            if obj is None:
                continue
            status = job_status.quota_status(project)
            if job_status.quota_status_changes(obj.get("status") or {}, status):
                self.kube.patch_quota_status(project.project, status)

    def _record_lending(self, state: PassState, jobs: Mapping[str, Job]) -> None:
        """Borrowers' GPU time since the last pass, and reclaims whose borrower has gone."""
        last, self._last_pass = self._last_pass, state.now
        for job in jobs.values():
            run = job.current_run
            if run is not None and any(g.borrowed for g in job.grants) and last is not None:
                held = state.now - max(last, run.start)
                if held > 0:
                    metrics.LENT_GPU_HOURS.labels(job.project).inc(run.fraction * held / 3600)
        for key, (attempt, decided) in list(self._reclaiming.items()):
            borrower = jobs.get(key)
            if borrower is None or borrower.attempts != attempt or not borrower.holds_gpus:
                metrics.OWNER_RECLAIM_SECONDS.observe(max(0.0, state.now - decided))
                del self._reclaiming[key]

    def _record_metrics(self, state: PassState, result: CycleResult) -> None:
        lengths: dict[tuple[str, str], int] = {}
        jobs = {j.key: j for j in state.jobs}
        self._record_lending(state, jobs)
        for wait in result.waits:
            job = jobs[wait.job_key]
            key = (job.project, job.job_class.label)
            lengths[key] = lengths.get(key, 0) + 1
        metrics.observe_services(state.objects.values())
        metrics.known_label_values(p.project for p in result.projects)
        metrics.QUEUE_LENGTH.clear()
        for (project_name, cls), count in lengths.items():
            metrics.QUEUE_LENGTH.labels(project_name, cls).set(count)
        for project in result.projects:
            metrics.GPU_HOURS.labels(project.project).set(project.used_gpu_hours)
            metrics.RUNNING_GPUS.labels(project.project).set(project.running_gpus)
            if project.remaining_gpu_hours is not None:
                metrics.BUDGET_REMAINING.labels(project.project).set(project.remaining_gpu_hours)


def quota_of_namespace(quotas: Mapping[str, ProjectQuota], namespace: str
                       ) -> ProjectQuota | None:
    """The project a namespace bills to (the first by name, if several list it)."""
    return next((quotas[n] for n in sorted(quotas) if namespace in quotas[n].namespaces), None)


def _reusable(snapshot: ClusterSnapshot, result: CycleResult, now: ClusterSnapshot,
              within_s: float) -> bool:
    """Whether `result`, decided from `snapshot`, stands for `now`: nothing but the time
    changed, by at most `within_s`, and the result only keeps jobs waiting (an admission,
    preemption or expiry carried out changes the cluster; one that failed is decided anew)."""
    return (not (result.admissions or result.preemptions or result.expiries)
            and 0 <= now.now - snapshot.now <= within_s
            and all(getattr(snapshot, f.name) == getattr(now, f.name)
                    for f in fields(ClusterSnapshot) if f.name != "now"))


def _job_of(pod: PodView, by_uid: Mapping[str, Obj], by_pod_uid: Mapping[str, Obj]
            ) -> Obj | None:
    """The GpuJob that controls `pod` (of `by_uid`, by uid), or else the one it was created
    for (`PodView.job_uid`), or else the one whose status records it (`by_pod_uid`, by
    `status.podUID`: a pod created before the operator wrote that annotation); same
    namespace. The ownerReference alone is not enough: a job deleted with propagationPolicy
    Orphan has the garbage collector take it off first, and a tenant may remove it."""
    obj = by_uid.get(pod.owner.uid) if pod.owner else None
    if obj is None and pod.job_uid:
        obj = by_uid.get(pod.job_uid)
    if obj is None:
        obj = by_pod_uid.get(pod.uid)
    if obj is None or (obj.get("metadata") or {}).get("namespace") != pod.namespace:
        return None
    return obj


def _by_pod_uid(objs: Iterable[Obj]) -> dict[str, Obj]:
    """GpuJobs by the pod uid their status records (`status.podUID`)."""
    return {uid: o for o in objs if (uid := str((o.get("status") or {}).get("podUID") or ""))}


def _by_uid(objs: Iterable[Obj]) -> dict[str, Obj]:
    return {str((o.get("metadata") or {}).get("uid", "")): o for o in objs}


def _pod_ref(pod: PodView) -> Obj:
    """A pod as `Kube.event` names what an Event is about."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid}}


def _runs_text(runs: Iterable[RunRecord], now: float) -> str:
    """Runs as billed, for the operator's log (an audit trail of what each deletion cost)."""
    parts = [f"attempt {r.attempt} {r.fraction:g} GPU x "
             f"{(r.end if r.end is not None else now) - r.start:.1f} s"
             + ("" if r.end is not None else " (open, to now)") for r in runs]
    return ", ".join(parts) or "no runs"


def _present(state: PassState) -> set[str]:
    """The retired-usage keys of what still exists or is remembered: jobs (key@uid), deleted
    jobs the watch remembers, the jobs that pods in view belong to, and the pods themselves
    (a deleted job's key stays until its pods are released, so they see it retired)."""
    pods = [*state.pods.values(), *state.lingering.values()]
    return ({f"{key}@{obj['metadata'].get('uid', '')}" for key, obj in state.objects.items()}
            | state.gone_job_keys | {pod_retired_key(pod) for pod in pods}
            | {job_retired_key(p.namespace, p.owner.name, p.owner.uid) for p in pods if p.owner}
            | set(state.orphan_keys))


def _planned(admission: Admission, obj: Obj, job: Job, state: PassState
             ) -> list[Assignment]:
    """Each worker's node and GPUs as the admission chose them (a one-pod job's: its own),
    in the assignment codec's shape (GPU indexes from the inventory, the GPU container's
    name, the pod's isolation: a whole-GPU job granted a share is an MPS client), for the
    extender."""
    containers = ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get(
        "containers") or [{}]
    isolation = (job.request.isolation if admission.workers
                 else right_sizing.pod_request(job.request, admission.grants).isolation)
    container = str(containers[0].get("name") or "")
    out = []
    for worker in admission.workers or (WorkerPlacement(admission.node, admission.grants),):
        inventory = state.inventories.get(worker.node)
        index = {g.uuid: g.index for g in inventory.gpus} if inventory else {}
        out.append(Assignment(worker.node, tuple(
            AssignedGpu.of(g, index.get(g.gpu_uuid, 0), container) for g in worker.grants),
            isolation))
    return out


def _pod_name_of(job: Job) -> str:
    return pod_name(job.name, job.attempts)
