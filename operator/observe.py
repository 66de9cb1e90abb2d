"""Stage 1 of a pass: observe. The watch caches decoded into the pass's snapshot.

Reads only: every GpuJob's state is derived again from its pods (`core.lifecycle.observe`),
with what is to be written (status patches, Events) kept as data in the `PassState` for the
later stages. A job's decoding is reused while neither it nor its pods changed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from carpool.core import job_status, names
from carpool.core.accounting import grants_fraction
from carpool.core.decoding import (
    job_from_object,
    placements_from_status,
    quota_from_object,
    retired_from_status,
    worker_names_from_spec,
)
from carpool.core.finalizing import pod_retired_key, stopped_at
from carpool.core.gangs import WorkerPlacement
from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.jobs import Job, ProjectQuota, RetiredUsage
from carpool.core.lifecycle import (
    admission_to_start_s,
    give_back_unschedulable,
    grants_from_assignment,
    grants_from_status,
    observe,
)
from carpool.core.ownership import (
    JobIdentity,
    Link,
    assignment_tampered,
    attempt_link,
    controls,
    is_orphan,
)
from carpool.core.resources import GpuGrant, Isolation, JobClass, NodeInventory, Phase
from carpool.core.timestamps import epoch_of
from carpool.operator.informer import Informers
from carpool.operator.kube import GPUJOBS, PODS, QUOTAS, Obj
from carpool.operator.pod_view import PodView, view_pod
from carpool.operator.pods import pod_name, worker_pod_name

log = logging.getLogger(__name__)
# seconds after a gang's admission within which a worker pod not seen yet is still taken to
# be on its way rather than missing
GANG_CREATE_GRACE_S = 30.0


@dataclass(frozen=True)
class _Decoded:
    """A job's decoding, valid while its resourceVersion and its pods' stay the same (any
    pods for a finished job: they cannot change what it shows)."""

    version: str
    pods: tuple[str, ...] | None
    job: Job
    live_pod: PodView | None


def _job_key(obj: Obj) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def job_identity(obj: Obj) -> JobIdentity:
    """What `core.ownership` reads of a GpuJob object."""
    meta, status = obj["metadata"], obj.get("status") or {}
    attempts = int(status.get("attempts") or 0)
    return JobIdentity(
        namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")), attempts=attempts,
        pod_uid=str(status.get("podUID") or ""), pod_name=str(status.get("podName") or ""),
        next_pod_name=pod_name(str(meta.get("name", "")), attempts + 1),
        admittable=status.get("phase") in (None, "", Phase.QUEUED.value))


def _attempt_pods(job: JobIdentity, by_uid: Mapping[str, tuple[PodView, str]],
                  by_name: Mapping[str, str]) -> list[tuple[PodView, Link]]:
    """The job's pods that `core.ownership.attempt_link` takes for its attempts: looked up by
    the uid and the names its status records (never by a label or annotation)."""
    candidates = {job.pod_uid} if job.pod_uid else set()
    for name in (job.pod_name, job.next_pod_name):
        if name and (uid := by_name.get(f"{job.namespace}/{name}")):
            candidates.add(uid)
    out = []
    for uid in sorted(candidates):
        pod = by_uid.get(uid)
        link = attempt_link(job, pod[0].identity) if pod is not None else None
        if pod is not None and link is not None:
            out.append((pod[0], link))
    return out


@dataclass
class PassState:
    """What one pass observed and derived (the snapshot the core decides on), then what it
    decided to write."""

    now: float = 0.0
    objects: dict[str, Obj] = field(default_factory=dict)
    jobs: list[Job] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    patches: dict[str, Obj] = field(default_factory=dict)
    inventories: dict[str, NodeInventory] = field(default_factory=dict)
    node_software: dict[str, tuple[str, str]] = field(default_factory=dict)  # driver, CUDA
    pod_peaks: dict[tuple[str, str], int] = field(default_factory=dict)  # (ns, pod) -> MiB
    # nodes whose device plugin measures per-process GPU activity, and when each pod's
    # processes last did work on a GPU there: (ns, pod) -> epoch seconds
    activity_nodes: set[str] = field(default_factory=set)
    pod_active: dict[tuple[str, str], float] = field(default_factory=dict)
    # jobs being deleted (their deletionTimestamp set): the job and its live pod, if any
    deleting: dict[str, tuple[Job, PodView | None]] = field(default_factory=dict)
    arrived: int = 0  # `Informers.arrived(GPUJOBS)` when the pass read, then as checked
    best_arrival: JobClass | None = None  # the highest class among the arrivals checked
    admitted: list[str] = field(default_factory=list)  # admissions carried out this pass
    # numbers this pass's admissions as they create their pods, from 0 (the admitting threads
    # share it: one `next` is atomic), for `ReconcilerConfig.admitted_events_per_pass`
    admitted_events: Iterator[int] = field(default_factory=itertools.count)
    initial: dict[str, Obj] = field(default_factory=dict)  # unwritten submitTime / phase
    # GPU pods that are no live job's attempt, and (job key, pod) of a job's recorded attempt
    # the job no longer controls: both are stopped (`_stop_strays`)
    orphans: list[PodView] = field(default_factory=list)
    pods: dict[str, PodView] = field(default_factory=dict)  # uid -> every pod in view
    # uid -> pods whose deletion is final (only finalizers hold them): gone for everything
    # but their record (`core.finalizing`); not in `pods`
    lingering: dict[str, PodView] = field(default_factory=dict)
    # uids of deleted jobs whose usage is on record this pass (retired now or before, or
    # nothing to retire): their pods may be released; the retired keys of deleted jobs the
    # watch remembers (kept in the quotas' retired usage while it does)
    on_record: set[str] = field(default_factory=set)
    gone_job_keys: set[str] = field(default_factory=set)
    tampered: list[tuple[str, PodView, str]] = field(default_factory=list)  # + why
    # job key -> the pod of its current attempt as the pass saw it (what a stop deletes)
    attempt_pods: dict[str, PodView] = field(default_factory=dict)
    # admitted jobs whose pod no node took in time: (job key, status to write, Event note)
    unschedulable: list[tuple[str, Obj, str]] = field(default_factory=list)
    # a gang's workers other than rank 0, as this pass saw them (stopped with rank 0)
    gang_pods: dict[str, list[PodView]] = field(default_factory=dict)
    # gangs running in part (a worker gone or failed): (job key, why); stopped whole
    broken_gangs: list[tuple[str, str]] = field(default_factory=list)
    # workers still alive after their gang's rank 0 ended: stopped
    gang_leftovers: list[PodView] = field(default_factory=list)
    # Events the read derived from the jobs' pods and specs, recorded before deciding
    events: list[tuple[Obj, job_status.JobEvent]] = field(default_factory=list)
    quotas: dict[str, ProjectQuota] = field(default_factory=dict)
    quota_objects: dict[str, Obj] = field(default_factory=dict)
    retired: dict[str, RetiredUsage] = field(default_factory=dict)  # by project
    start_delay_s: float = 0.0  # recent median seconds from admission to a running pod

    @property
    def orphan_keys(self) -> list[str]:
        return [orphan_key(pod) for pod in self.orphans]


class Observer:
    """Reads the watch caches into a `PassState`; keeps what makes the next read cheaper
    (each job's decoding, each quota's retired usage) and nothing a later stage writes."""

    def __init__(self, informers: Informers, unschedulable_timeout_s: float):
        self.informers = informers
        self.unschedulable_timeout_s = unschedulable_timeout_s
        self.decoded: dict[str, _Decoded] = {}  # job key -> its decoding (see read)
        # quota name -> (resourceVersion, its retired usage as decoded then); see retired
        self._retired_decoded: dict[str, tuple[str, RetiredUsage | None]] = {}
        self._status_problems: set[str] = set()  # malformed quota statuses logged already
        # what the read derives from an object while its resourceVersion stays the same:
        # node name -> (GpuNode version, Node labels, inventory); pod uid -> (version, view)
        self._inventories: dict[str, tuple[str, Mapping[str, str], NodeInventory]] = {}
        self._pod_views: dict[str, tuple[str, PodView]] = {}
        self._lingering: dict[str, PodView] = {}  # as the last read saw them (gone_pod)
        # job key -> the grants it held at the last read: a job decoded again (its status
        # written) whose grants are the same keeps the same tuple, which the placement memo
        # knows its node's state by (`timeline.TimelineMemo`)
        self._grants: dict[str, tuple[GpuGrant, ...]] = {}

    def _read_nodes(self, state: PassState) -> None:
        """Inventories, driver/CUDA versions and per-pod peak memory from the GpuNodes."""
        labels = {n["metadata"]["name"]: n["metadata"].get("labels") or {}
                  for n in self.informers.objects("nodes")}
        inventories: dict[str, tuple[str, Mapping[str, str], NodeInventory]] = {}
        for gn in self.informers.objects(names.GPUNODE_PLURAL):
            name = gn["metadata"]["name"]
            if name not in labels:
                continue  # the Node is gone; its GpuNode is stale
            status = gn.get("status") or {}
            version = str(gn["metadata"].get("resourceVersion", ""))
            cached = self._inventories.get(name)
            if version and cached is not None and cached[0] == version \
                    and cached[1] == labels[name]:
                inventories[name] = cached
                state.inventories[name] = cached[2]
            else:
                try:
                    state.inventories[name] = inventory_from_gpunode(name, status, labels[name])
                except ValueError as err:
                    log.warning("ignoring GpuNode %s: %s", name, err)
                    continue
                if version:
                    inventories[name] = (version, labels[name], state.inventories[name])
            state.node_software[name] = (str(status.get("driverVersion") or ""),
                                         str(status.get("cudaVersion") or ""))
            if status.get("processActivity") is True:
                state.activity_nodes.add(name)
            for pod in status.get("pods") or []:
                try:
                    key = (str(pod["namespace"]), str(pod["name"]))
                    peak = int(pod.get("peakMemoryMiB") or 0)
                except (KeyError, TypeError, ValueError):
                    continue
                state.pod_peaks[key] = max(peak, state.pod_peaks.get(key, 0))
                if (active := epoch_of(pod.get("lastActiveTime"))) is not None:
                    state.pod_active[key] = max(active, state.pod_active.get(key, active))
        self._inventories = inventories  # nodes gone are forgotten

    def read(self, now: float) -> PassState:
        """The jobs, pods and nodes in the watch caches, decoded; derives, writes nothing."""
        state = PassState(now=now)
        self._read_nodes(state)
        totals, mig_slices, models = _gpu_facts(state.inventories)
        by_uid: dict[str, tuple[PodView, str]] = {}  # uid -> (pod, resourceVersion)
        by_name: dict[str, str] = {}  # namespace/name -> uid
        views: dict[str, tuple[str, PodView]] = {}
        for pod in self.informers.objects(PODS):
            version = str(pod["metadata"].get("resourceVersion", ""))
            seen = self._pod_views.get(str(pod["metadata"].get("uid", "")))
            view = seen[1] if version and seen is not None and seen[0] == version \
                else view_pod(pod)
            if version:
                views[view.uid] = (version, view)
            if view.deletion_final:  # gone but for its record: as if the watch saw it go
                state.lingering[view.uid] = view
                continue
            by_uid[view.uid] = (view, version)
            by_name[f"{view.namespace}/{view.name}"] = view.uid
        self._pod_views = views  # pods gone are forgotten
        self._lingering = state.lingering
        linked: set[str] = set()  # uids of pods that are some job's attempt
        decoded: dict[str, _Decoded] = {}
        for obj in self.informers.objects(GPUJOBS):
            key = _job_key(obj)
            state.objects[key] = obj
            meta = obj["metadata"]
            version = str(meta.get("resourceVersion", ""))
            identity = job_identity(obj)
            links = _attempt_pods(identity, by_uid, by_name)
            status_now = obj.get("status") or {}
            for linked_pod, link in links:
                linked.add(linked_pod.uid)
                if meta.get("deletionTimestamp") or linked_pod.terminal:
                    continue
                why = ("its ownerReference no longer names that job" if link.tampered else
                       assignment_tampered(linked_pod.assignment, linked_pod.limits, str(
                           status_now.get("podAssignment") or "")
                           if link.attempt == int(status_now.get("attempts") or 0) else ""))
                if why:
                    state.tampered.append((key, linked_pod, why))
            job_pods = [p if p.attempt == link.attempt else replace(p, attempt=link.attempt)
                        for p, link in links]
            workers = _gang_followers(obj, identity, by_uid, by_name)
            linked.update(p.uid for p in workers.values())
            signature = tuple(sorted(by_uid[p.uid][1] for p in [*job_pods, *workers.values()]))
            cached = self.decoded.get(key)
            if cached is not None and cached.version == version \
                    and cached.pods in (None, signature):
                # neither the job nor its pods changed since a pass derived nothing to write
                # for it: the same decoding (thousands of jobs wait or run through many passes)
                decoded[key] = cached
                self._reuse(state, obj, cached, now)
                continue
            exclusive = str(((obj.get("spec") or {}).get("gpu") or {}).get("isolation", "")) \
                == "exclusive"
            placements = placements_from_status(status_now, exclusive)
            gone = self.gone_pod(str(status_now.get("podUID") or ""))
            gone_at, gone_pod = gone if gone is not None else (None, None)
            obs = observe(obj, job_pods, totals, now, mig_slices, gone_at,
                          _gang_fraction(obj, placements, state.inventories), gone_pod, models)
            status = obj.get("status") or {}
            # only what differs: a running job's derived status mostly equals what it shows
            patch = job_status.changes(status, obs.status)
            settled = not patch and not obs.events  # nothing to write but hardware facts
            if obs.live_pod is not None:
                state.attempt_pods[key] = obs.live_pod
                self._observe_hardware(state, obs.live_pod, status, patch)
                if obs.phase is Phase.ADMITTED and not meta.get("deletionTimestamp"):
                    self._check_unschedulable(state, key, {**status, **patch},
                                              obs.live_pod, now)
            state.events.extend((obj, job_status.JobEvent(reason, note, type_, derived=True))
                                for type_, reason, note in obs.events)
            merged = {**status, **patch}
            if obs.live_pod is not None and obs.live_pod.assignment:
                grants = grants_from_assignment(obs.live_pod.assignment, exclusive)
                node = obs.live_pod.node or obs.live_pod.assignment.node
            elif obs.phase.holds_gpus or (obs.phase is Phase.PREEMPTED and obs.live_pod):
                grants = grants_from_status(merged.get("gpus"), exclusive)
                node = str(merged.get("node") or "")
            else:
                grants, node = (), ""
            kept = self._grants.get(key)
            if kept is not None and kept == grants:
                grants = kept
            try:
                job = job_from_object(obj, obs.phase, obs.attempts, grants, node,
                                      merged.get("history") or [])
            except ValueError as err:
                if not obs.phase.finished:
                    failed, event = job_status.invalid_spec(obj, str(err))
                    patch.update(failed)
                    state.events.append((obj, event))
                state.patches[key] = patch
                continue
            if merged.get("calibrationOutgrown") and not job.calibration_outgrown:
                # requeued this pass for outgrowing its calibrated size: placed as asked now
                job = replace(job, calibration_outgrown=True)
            if job.workers:
                job = self._observe_gang(state, job, obs.live_pod, workers, placements,
                                         {**status, **patch}, patch)
            if settled and not meta.get("deletionTimestamp") and not job.workers:
                decoded[key] = _Decoded(version, None if obs.phase.finished else signature,
                                        job, obs.live_pod)
            if job.holds_gpus and node not in state.inventories:
                job = _detached(job)  # its node is gone: it holds nothing we can see
            if meta.get("deletionTimestamp"):
                live = obs.live_pod if obs.live_pod and not obs.live_pod.terminal else None
                state.deleting[key] = (job, live)
                if live is None:
                    continue  # gone for the queue; its usage is retired (see _retire)
            state.jobs.append(job)
            state.phases[key] = obs.phase
            if patch:
                # a job written anyway gets its submit time and phase with it
                state.patches[key] = {**job_status.initial_status(obj), **patch}
            elif not obs.phase.finished:
                state.initial[key] = job_status.initial_status(obj)
        self.decoded = decoded  # jobs gone from the cache are forgotten
        self._grants = {job.key: job.grants for job in state.jobs if job.grants}
        billed = {str(ns) for quota in self.informers.objects(QUOTAS)
                  for ns in (quota.get("spec") or {}).get("namespaces") or ()}
        state.pods = {uid: pod for uid, (pod, _) in by_uid.items()}
        state.orphans = [pod for pod, _ in by_uid.values() if is_orphan(
            pod.identity, pod.holds_gpus, pod.uid in linked, pod.namespace in billed)]
        state.start_delay_s = admission_to_start_s(
            obj.get("status") or {} for obj in state.objects.values())
        return state

    def gone_pod(self, uid: str) -> tuple[float, PodView] | None:
        """If the pod of `uid` is gone (its deletion final, as the last read saw it, or the
        watch saw it deleted): when it stopped holding its GPUs (its containers' end as its
        last state shows it, else when its deletion became final or was seen), and that last
        state."""
        lingering = self._lingering.get(uid) if uid else None
        if lingering is not None:
            return stopped_at(lingering) or lingering.deleted_at or time.time(), lingering
        seen = self.informers.gone_at(PODS, uid)
        if seen is None:
            return None
        at, last = seen
        pod = view_pod(last)
        return (min(at, pod.finished) if pod.finished else at), pod

    def last_state(self, obj: Obj, state: PassState) -> Job | None:
        """A deleted job as its last state and its pods' end show it (for its retirement):
        decoded as `read` decodes a job whose pods are gone; None if it cannot be."""
        status = obj.get("status") or {}
        exclusive = str(((obj.get("spec") or {}).get("gpu") or {}).get("isolation", "")) \
            == "exclusive"
        totals, mig_slices, models = _gpu_facts(state.inventories)
        uid = str(status.get("podUID") or "")
        gone = self.gone_pod(uid)
        if gone is None and (pod := state.pods.get(uid)) is not None \
                and (end := stopped_at(pod)) is not None:
            gone = end, pod  # finished, not deleted yet: as good as gone for its record
        gone_at, gone_pod = gone if gone is not None else (None, None)
        obs = observe(obj, [], totals, state.now, mig_slices, gone_at,
                      _gang_fraction(obj, placements_from_status(status, exclusive),
                                     state.inventories), gone_pod, models)
        try:
            return job_from_object(obj, obs.phase, obs.attempts, (), "",
                                   {**status, **obs.status}.get("history") or [])
        except ValueError:
            return None

    def pod_gone_at(self, uid: str) -> float | None:
        """When the pod of `uid` stopped holding its GPUs, if the watch saw it deleted."""
        gone = self.gone_pod(uid)
        return gone[0] if gone is not None else None

    def _observe_gang(self, state: PassState, job: Job, lead: PodView | None,
                      workers: Mapping[int, PodView],
                      placements: tuple[WorkerPlacement, ...], status: Obj, patch: Obj
                      ) -> Job:
        """A gang as a whole: the job holds every worker's GPUs while it holds any; a worker
        gone, failed or being deleted while rank 0 runs breaks the gang (`broken_gangs`: the
        whole attempt is stopped and requeued, never left running in part), and one no node
        takes gives the whole gang back as rank 0's would (`unschedulable`); workers still
        alive once rank 0 has ended are stopped (`gang_leftovers`). Once every worker's pod
        exists, `status.gangCreated` says so (the extender binds no worker before)."""
        state.gang_pods[job.key] = [p for p in workers.values() if not p.terminal]
        if (lead is not None and len(workers) == len(job.workers) - 1
                and int(status.get("gangCreated") or 0) < job.attempts):
            patch["gangCreated"] = job.attempts
        alive = lead is not None and not lead.terminal and not lead.deleting
        if not alive:
            state.gang_leftovers.extend(p for p in workers.values()
                                        if not p.terminal and not p.deleting)
        elif job.phase in (Phase.ADMITTED, Phase.RUNNING):
            # a worker not seen yet is missing once all were seen, or once the admission is
            # old enough that it is not on its way (the writes of one pass run in parallel)
            admitted = epoch_of(status.get("admitTime"))
            settled = (int(status.get("gangCreated") or 0) >= job.attempts
                       or (admitted is not None and state.now - admitted > GANG_CREATE_GRACE_S))
            for rank in range(1, len(job.workers)):
                pod = workers.get(rank)
                if pod is None and not settled:
                    continue
                why = "is gone" if pod is None else (
                    "is being deleted" if pod.deleting
                    else f"failed ({pod.exit_reason or 'Failed'})" if pod.phase == "Failed"
                    else "")
                if why or pod is None:
                    state.broken_gangs.append((job.key, f"worker {rank} of {len(job.workers)} "
                                               f"{why}"))
                    break
                given_back = give_back_unschedulable(status, pod, state.now,
                                                     self.unschedulable_timeout_s)
                if given_back is not None and all(k != job.key for k, _, _ in
                                                  state.unschedulable):
                    state.unschedulable.append((job.key, *given_back))
                    break
        if placements and job.grants:
            job = replace(job, placements=placements, node=placements[0].node,
                          grants=tuple(g for p in placements for g in p.grants))
        return job

    def _check_unschedulable(self, state: PassState, key: str, status: Obj, pod: PodView,
                             now: float) -> None:
        given_back = give_back_unschedulable(status, pod, now,
                                             self.unschedulable_timeout_s)
        if given_back is not None:
            state.unschedulable.append((key, *given_back))

    def _reuse(self, state: PassState, obj: Obj, cached: _Decoded, now: float) -> None:
        """A job decoded as before; only its node's presence and hardware facts (from the
        GpuNodes, which change on their own) are looked at again."""
        key = cached.job.key
        job = cached.job
        if job.holds_gpus and job.node not in state.inventories:
            job = _detached(job)
        state.jobs.append(job)
        state.phases[key] = job.phase
        patch: Obj = {}
        if cached.live_pod is not None:
            state.attempt_pods[key] = cached.live_pod
            self._observe_hardware(state, cached.live_pod, obj.get("status") or {}, patch)
            if job.phase is Phase.ADMITTED:  # (a pod waiting for a node changes nothing)
                self._check_unschedulable(state, key, obj.get("status") or {},
                                          cached.live_pod, now)
        if patch:
            state.patches[key] = {**job_status.initial_status(obj), **patch}
        elif not job.phase.finished:
            state.initial[key] = job_status.initial_status(obj)

    @staticmethod
    def _observe_hardware(state: PassState, pod: PodView, status: Obj, patch: Obj) -> None:
        """Hardware fingerprint once the pod is on a node; peak memory as it grows."""
        uuids = [g.uuid for g in pod.assignment.gpus] if pod.assignment else []
        hardware = job_status.hardware_fingerprint(
            state.inventories.get(pod.node), state.node_software.get(pod.node, ("", "")),
            uuids) if pod.node and uuids else None
        activity = None
        if pod.node in state.activity_nodes and pod.started is not None:
            activity = max(pod.started,
                           state.pod_active.get((pod.namespace, pod.name), pod.started))
        patch.update(job_status.hardware_facts(
            status, hardware, state.pod_peaks.get((pod.namespace, pod.name)), activity))

    def quotas(self) -> tuple[dict[str, ProjectQuota], dict[str, Obj]]:
        quotas: dict[str, ProjectQuota] = {}
        objects: dict[str, Obj] = {}
        for obj in self.informers.objects(QUOTAS):
            try:
                quota = quota_from_object(obj)
            except ValueError as err:
                log.warning("ignoring ProjectQuota %s: %s", obj["metadata"]["name"], err)
                continue
            quotas[quota.name] = quota
            objects[quota.name] = obj
        return quotas, objects

    def retired(self, quota_objects: Mapping[str, Obj]) -> dict[str, RetiredUsage]:
        """Each quota's retired usage from its status, decoded once per version of the quota;
        a malformed part (a hand-edited status) is left out and logged once."""
        decoded: dict[str, tuple[str, RetiredUsage | None]] = {}
        for name, obj in quota_objects.items():
            version = str(obj["metadata"].get("resourceVersion", ""))
            cached = self._retired_decoded.get(name)
            if cached is None or cached[0] != version:
                usage, problems = retired_from_status(name, obj.get("status"))
                for problem in problems:
                    if (said := f"ProjectQuota {name}: {problem}") not in self._status_problems:
                        self._status_problems.add(said)
                        log.warning("%s", said)
                cached = (version, usage)
            decoded[name] = cached
        self._retired_decoded = decoded
        return {name: usage for name, (_, usage) in decoded.items() if usage is not None}


def _gang_followers(obj: Obj, job: JobIdentity, by_uid: Mapping[str, tuple[PodView, str]],
                    by_name: Mapping[str, str]) -> dict[int, PodView]:
    """A gang's workers of rank 1 and up of its current attempt, by rank: found by the names
    the operator gives them and kept only if the job controls them (`core.ownership`)."""
    spec = obj.get("spec") or {}
    if not spec.get("workers"):
        return {}  # one pod (most jobs: asked of every job every pass)
    count = len(worker_names_from_spec(spec))
    out: dict[int, PodView] = {}
    for rank in range(1, count):
        uid = by_name.get(f"{job.namespace}/{worker_pod_name(job.name, job.attempts, rank)}")
        pod = by_uid.get(uid or "")
        if pod is not None and controls(job, pod[0].identity):
            out[rank] = pod[0]
    return out


def _gpu_facts(inventories: Mapping[str, NodeInventory]
               ) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """By GPU (or MIG instance) uuid, from the nodes' inventories: memory in MiB, MIG
    slices, model; what `lifecycle.observe` bills and records a job's GPUs by."""
    gpus = [g for inv in inventories.values() for g in inv.gpus]
    return ({g.uuid: g.memory_total_mib for g in gpus},
            {m.uuid: m.slices for g in gpus for m in g.mig_instances},
            {g.uuid: g.model for g in gpus})


def _gang_fraction(obj: Obj, placements: tuple[WorkerPlacement, ...],
                   inventories: Mapping[str, NodeInventory]) -> float | None:
    """GPU equivalents a gang's workers hold together (what its runs are billed at); None for
    a one-pod job or when a worker's node is gone (its rank 0's assignment is used then)."""
    if not placements:
        return None
    isolation = Isolation.parse(str(((obj.get("spec") or {}).get("gpu") or {}).get(
        "isolation", "mps")))
    try:
        return sum(grants_fraction(p.grants, inventories[p.node], isolation)
                   for p in placements)
    except (KeyError, ValueError):
        return None


def orphan_key(pod: PodView) -> str:
    """An orphan's key in its project's retired usage (once per pod object)."""
    return pod_retired_key(pod)


def _detached(job: Job) -> Job:
    return replace(job, grants=(), node="")
