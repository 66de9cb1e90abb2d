"""A GpuJob's lifecycle: its state derived from its pods, every pass (level-triggered,
restart-safe). Pure: the operator decodes pods into `PodView`s (`operator.pod_view`), calls
`observe`, and writes the status and events it returns.

The pods are the truth about what runs: a job holds GPUs exactly while it has a live pod, and
it is finished exactly when its current attempt's pod finished. The job's status keeps what
pods cannot: how many attempts were made, which attempt is being preempted, and one usage
record per attempt (start, end, GPU fraction) from which GPU-hours are recomputed, never added
up incrementally, so a replayed pass cannot count twice.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from carpool.core.assignment import (
    Assignment,
    AssignmentError,
    encode_assignment,
    gpu_entry,
    parse_gpus,
)
from carpool.core.gpuhours import gpu_fraction, gpu_hours
from carpool.core.ownership import GpuLimits, Owner, PodIdentity
from carpool.core.quantities import gib_ceil, quantity_mib
from carpool.core.resources import GpuGrant, Isolation, Phase
from carpool.core.timestamps import epoch_seconds, format_run_time, format_timestamp

Obj = dict[str, Any]


@dataclass(frozen=True)
class PodView:
    """The facts of one job pod the operator acts on."""

    name: str
    namespace: str
    attempt: int
    phase: str  # Pending | Running | Succeeded | Failed
    node: str
    assignment: Assignment | None  # None: none, or not readable
    started: float | None
    finished: float | None
    deleting: bool
    exit_reason: str
    # why Kubernetes stopped the pod, from its DisruptionTarget condition (a kubelet's
    # eviction or node shutdown, a taint, the eviction API), not the job's code; "" if not
    disruption: str = ""
    uid: str = ""
    owner: Owner | None = None  # the GpuJob controlling it (core.ownership)
    # the uid of the GpuJob the operator created it for (`names.ANN_JOB_UID`, which only the
    # operator sets, at create): finds its job for billing once the ownerReference is gone
    job_uid: str = ""
    # asks for Carpool GPUs (carpool.dev/* limits: immutable, only the operator's pods may
    # have them) or was assigned some (the extender's annotation)
    gpu_pod: bool = False
    limits: tuple[GpuLimits, ...] = ()  # its containers' carpool.dev/* limits
    # since when the scheduler has found no node for it (its PodScheduled condition False,
    # reason Unschedulable), and the scheduler's message; None while it is not so
    unschedulable_since: float | None = None
    unschedulable_message: str = ""
    # carries Carpool's finalizer (core.finalizing); whether its deletion is final (grace
    # 0: only finalizers hold the object), and when it was deleted (deletionTimestamp)
    finalized: bool = False
    deletion_final: bool = False
    deleted_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def holds_gpus(self) -> bool:
        """Holds or is about to hold a Carpool GPU: a GPU pod that has not finished and whose
        deletion is not final."""
        return self.gpu_pod and not self.terminal and not self.deletion_final

    @property
    def identity(self) -> PodIdentity:
        return PodIdentity(self.namespace, self.name, self.uid, self.owner)


# A pod can fail through no fault of the job's code. The kubelet may refuse it before
# starting any container: its device plugin could not allocate (UnexpectedAdmissionError),
# its topology manager could not align, or it was out of a resource the scheduler thought it
# had (OutOf<resource>). Or Kubernetes may stop it and mark it with the DisruptionTarget
# condition (a kubelet's eviction or node shutdown, a taint, the eviction API). Such a job
# goes back to the queue instead of failing, at most MAX_REQUEUES_AFTER_FAILURE times.
NODE_REJECTIONS = frozenset({"UnexpectedAdmissionError", "TopologyAffinityError"})
DISRUPTED = "Disrupted"  # the outcome recorded for a disrupted attempt
# a run placed by its calibrated size (core.right_sizing) failed: requeued as asked
OUTGREW_CALIBRATION = "OutgrewCalibration"
MAX_REQUEUES_AFTER_FAILURE = 3


# A job requeued that way waits before its next attempt, 10 s after its first such failure,
# doubling after each (as Kubernetes' Job controller backs off failed pods). A node whose device
# plugin is being replaced (a rolling update) refuses pods for seconds: without the pause every
# retry lands in that window and the job fails within a second.
REQUEUE_BACKOFF_S = 10.0


def is_node_rejection(reason: str) -> bool:
    return reason in NODE_REJECTIONS or reason.startswith("OutOf")


def _not_by_the_job(outcome: str) -> bool:
    """A recorded outcome that requeues the job (its code was not at fault)."""
    return outcome == DISRUPTED or is_node_rejection(outcome)


def requeue_not_before(history: Iterable[Mapping[str, Any]]) -> float:
    """When a job whose latest attempt failed through no fault of its own may be admitted
    again: that attempt's end plus REQUEUE_BACKOFF_S, doubled for each earlier such failure.
    0.0 when its latest attempt did not end that way."""
    records = sorted(history, key=lambda r: int(r.get("attempt") or 0))
    if not records or not _not_by_the_job(str(records[-1].get("outcome") or "")):
        return 0.0
    end = epoch_seconds(records[-1].get("end"))
    if end is None:
        return 0.0
    failures = sum(1 for r in records if _not_by_the_job(str(r.get("outcome") or "")))
    return end + REQUEUE_BACKOFF_S * 2.0 ** (failures - 1)


def failed_not_by_the_job(pod: PodView) -> str:
    """The outcome to record if `pod` failed through no fault of the job's code, else ""."""
    if pod.phase != "Failed":
        return ""
    if is_node_rejection(pod.exit_reason):
        return pod.exit_reason
    return DISRUPTED if pod.disruption else ""


# An admitted job whose pod no node takes (its nodeSelector, affinity or tolerations match no
# node with room, a node went away) holds its quota while it waits. Like Kueue's
# waitForPodsReady, the operator gives such a job back after a while (the operator's
# CARPOOL_UNSCHEDULABLE_TIMEOUT_S): its pod is stopped and it goes back to the queue, keeping
# its place; after MAX_UNSCHEDULABLE_GIVE_BACKS give-backs it fails instead, since no node has
# taken it in all that time and nothing tells the operator that one ever will.
UNSCHEDULABLE = "Unschedulable"
MAX_UNSCHEDULABLE_GIVE_BACKS = 3


def give_back_unschedulable(status: Mapping[str, Any], pod: PodView, now: float,
                            timeout_s: float) -> tuple[Obj, str] | None:
    """The status to write for an admitted job whose current attempt `pod` the scheduler has
    found no node for during `timeout_s` (0: never), with the note for its Event; None while
    it is not so. The job shows Preempted until its pod is gone (`observe` then requeues it
    with this reason), or Failed once it was given back MAX_UNSCHEDULABLE_GIVE_BACKS times."""
    since = pod.unschedulable_since
    if (timeout_s <= 0 or since is None or now - since < timeout_s or pod.node
            or pod.phase != "Pending" or pod.deleting):
        return None
    given_back = int(status.get("unschedulableGiveBacks") or 0) + 1
    waited = f"{(now - since) / 60:.0f} min" if now - since >= 60 else f"{now - since:.0f}s"
    said = f": {pod.unschedulable_message}" if pod.unschedulable_message else ""
    note = f"attempt {pod.attempt}: no node took its pod in {waited} (the scheduler{said})"
    if given_back > MAX_UNSCHEDULABLE_GIVE_BACKS:
        note += (f"; given back {MAX_UNSCHEDULABLE_GIVE_BACKS} times already, it fails (check "
                 f"its nodeSelector, affinity and tolerations against the GPU nodes)")
        return {"phase": Phase.FAILED.value, "reason": UNSCHEDULABLE, "message": note,
                "completionTime": format_timestamp(now)}, note
    note += f"; its quota is given back and it is requeued ({given_back} of at most " \
            f"{MAX_UNSCHEDULABLE_GIVE_BACKS})"
    return {"phase": Phase.PREEMPTED.value, "preemptingAttempt": pod.attempt,
            "reason": UNSCHEDULABLE, "message": note,
            "unschedulableGiveBacks": given_back}, note


@dataclass(frozen=True)
class Observation:
    """What the pods say: the job's phase now and the status fields to write."""

    phase: Phase
    attempts: int
    status: Obj
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, note)
    live_pod: PodView | None = None


def grants_from_assignment(assignment: Assignment | None,
                           exclusive: bool = False) -> tuple[GpuGrant, ...]:
    """The grants of an extender assignment (see `Assignment.grants`): `exclusive` (the job's
    isolation) marks every grant as holding its whole GPU, so placement sees the GPU taken and
    GPU-hours count 1 per GPU."""
    return assignment.grants(exclusive) if assignment is not None else ()


def grants_from_status(gpus: object, exclusive: bool = False) -> tuple[GpuGrant, ...]:
    """The grants a job's `status.gpus` records (the assignment's GPUs, written by `observe`);
    none when there are none or they cannot be read. GPUs all marked `exclusive: false` are
    a whole-GPU job's MPS share (`job_status.shared_whole_gpu_status`), held as such."""
    try:
        shared = bool(gpus) and isinstance(gpus, list) and all(
            isinstance(g, Mapping) and g.get("exclusive") is False for g in gpus)
        return Assignment("", parse_gpus(gpus, "status.gpus"),
                          Isolation.MPS if shared else None).grants(exclusive)
    except AssignmentError:
        return ()


def assignment_fraction(assignment: Assignment | None,
                        memory_totals: Mapping[str, int], exclusive: bool = False,
                        mig_slices: Mapping[str, int] | None = None,
                        isolation: Isolation | None = None) -> float:
    """GPUs held by an assignment of a job with `isolation`, by the one GPU-hour definition
    (core.gpuhours); `mig_slices` maps MIG instance UUIDs to their compute slices (from the
    GpuNodes)."""
    total = 0.0
    for grant in grants_from_assignment(assignment, exclusive):
        slices = (mig_slices or {}).get(grant.mig_instance, 0)
        total += gpu_fraction(grant, memory_totals.get(grant.gpu_uuid, 0), slices, isolation)
    return total


def history_gpu_hours(history: Iterable[Mapping[str, Any]], now: float,
                      since: float = 0.0) -> float:
    """GPU-hours of a job's usage records, the open one counted up to `now`, from `since`."""
    total = 0.0
    for record in history:
        start = epoch_seconds(record.get("start"))
        if start is None:
            continue
        end = epoch_seconds(record.get("end")) or now
        total += gpu_hours(float(record.get("fraction", 0.0)), max(start, since), end)
    return total


def _record(history: list[Obj], pod: PodView, fraction: float, now: float,
            outcome: str | None) -> list[Obj]:
    """History with the record of `pod`'s attempt opened, updated or closed."""
    out = [dict(r) for r in history]
    rec = next((r for r in out if r.get("attempt") == pod.attempt), None)
    if rec is None:
        if pod.started is None:
            return out
        rec = {"attempt": pod.attempt, "node": pod.node, "fraction": round(fraction, 6),
               "start": format_timestamp(pod.started)}
        out.append(rec)
    if outcome and not rec.get("end"):
        rec["end"] = format_run_time(pod.finished or now)
        rec["outcome"] = outcome
    return out


# A waiting job's fields, cleared once it runs or ends (whatever write of a wait was still
# on its way when it was admitted)
NOT_WAITING: dict[str, None] = dict.fromkeys(
    ("queuePosition", "estimatedStart", "estimatedStartEarliest", "estimatedStartLatest"))


def observe(job: Obj, pods: Iterable[PodView], memory_totals: Mapping[str, int],
            now: float, mig_slices: Mapping[str, int] | None = None,
            pod_gone_at: float | None = None, gang_fraction: float | None = None,
            gone_pod: PodView | None = None,
            gpu_models: Mapping[str, str] | None = None) -> Observation:
    """Derive `job`'s phase and status from its pods (see the module docstring).

    `pod_gone_at`: when its current attempt's pod was seen deleted, if it is gone (its run
    ends then, not at `now`, which may be a pass later); `gone_pod`: that pod's last state as
    the watch showed it. A pod that finished and was deleted before its job's status said so
    (a status write lost to an API outage or an operator restart, then pod garbage
    collection) ends the job as it finished: requeueing it would run a finished job again.
    A gang's attempt is followed by its rank 0 pod and billed for every worker's GPUs
    (`gang_fraction`). `gpu_models` (uuid -> model, from the nodes' inventories) names each
    GPU's model in `status.gpus`, as admission wrote it."""
    status: Obj = job.get("status") or {}
    isolation_text = str(((job.get("spec") or {}).get("gpu") or {}).get("isolation", ""))
    exclusive = isolation_text == "exclusive"
    timeslice = Isolation.TIMESLICE if isolation_text == Isolation.TIMESLICE.value else None
    phase = Phase(status.get("phase", Phase.QUEUED.value))
    pods = sorted(pods, key=lambda p: p.attempt)
    attempts = max([int(status.get("attempts", 0))] + [p.attempt for p in pods])
    history: list[Obj] = list(status.get("history") or [])
    preempting = status.get("preemptingAttempt")
    events: list[tuple[str, str, str]] = []
    patch: Obj = {}

    if phase.finished:
        return Observation(phase, attempts, {})

    current = next((p for p in pods if p.attempt == attempts), None)
    gone = False
    if (current is None and gone_pod is not None and gone_pod.terminal and attempts
            and phase is not Phase.QUEUED and preempting != attempts):
        current, gone = dataclasses.replace(gone_pod, attempt=attempts), True
    if current is None:
        if attempts == 0 or phase is Phase.QUEUED:
            unchanged = attempts == int(status.get("attempts", 0))
            return Observation(Phase.QUEUED, attempts, {} if unchanged else {"attempts": attempts})
        # The pod of the current attempt is gone: preempted (we deleted it) or lost.
        reason = "Preempted" if preempting == attempts else "PodLost"
        message = f"attempt {attempts} ended ({reason}); requeued"
        if reason == "Preempted" and status.get("reason") == UNSCHEDULABLE:
            # given back (give_back_unschedulable): the scheduler's reason stays shown
            reason, message = UNSCHEDULABLE, str(status.get("message") or message)
        ended = min(now, pod_gone_at) if pod_gone_at is not None else now
        history = [dict(r, end=r.get("end") or format_run_time(
                            max(ended, epoch_seconds(r.get("start")) or ended)),
                        outcome=r.get("outcome") or reason) for r in history]
        patch = {"phase": Phase.QUEUED.value, "attempts": attempts, "history": history,
                 "gpuHours": round(history_gpu_hours(history, now), 6),
                 "preemptingAttempt": None, "node": None, "gpus": None, "workers": None,
                 "borrowed": None,
                 "podAssignment": None, "reason": reason, "message": message}
        events.append(("Normal" if reason == "Preempted" else "Warning", "Requeued",
                       f"attempt {attempts} ended ({reason}); back in the queue"))
        return Observation(Phase.QUEUED, attempts, patch, tuple(events))

    fraction = gang_fraction if gang_fraction is not None else assignment_fraction(
        current.assignment, memory_totals, exclusive, mig_slices, timeslice)
    # the assignment's GPUs as its annotation writes them, less the container, with the
    # model where the node's inventory knows the GPU
    gpus = [{k: v for k, v in gpu_entry(g).items() if k != "container"}
            | ({"model": model} if (model := (gpu_models or {}).get(g.uuid)) else {})
            for g in (current.assignment.gpus if current.assignment is not None else ())]
    if preempting != attempts and (not_its_fault := failed_not_by_the_job(current)):
        requeued = _requeue_failed(phase, history, current, not_its_fault, fraction,
                                   attempts, now)
        if requeued is not None:
            return requeued
    if (current.phase == "Failed" and preempting != attempts
            and (sizes := placed_below_spec(job, current)) is not None):
        if phase is Phase.QUEUED:  # requeued for it already; its failed pod stays
            return Observation(Phase.QUEUED, attempts, {})
        history = _record(history, current, fraction, now, OUTGREW_CALIBRATION)
        asked = f"the {sizes[1]} GiB it asks for" if sizes[1] else "the whole GPU it asks for"
        message = (f"attempt {attempts} failed placed at {sizes[0]} GiB per GPU, its "
                   f"template's calibrated size, below {asked}; requeued as asked")
        patch = {"phase": Phase.QUEUED.value, "attempts": attempts, "history": history,
                 "gpuHours": round(history_gpu_hours(history, now), 6),
                 "preemptingAttempt": None, "node": None, "gpus": None, "borrowed": None,
                 "podAssignment": None, "calibrationOutgrown": True,
                 "reason": OUTGREW_CALIBRATION, "message": message}
        return Observation(Phase.QUEUED, attempts, patch, (("Warning", "Requeued", message),))
    if current.terminal and preempting != attempts:
        outcome = current.phase
        new_phase = Phase.SUCCEEDED if outcome == "Succeeded" else Phase.FAILED
        reason = outcome if outcome == "Succeeded" else (current.exit_reason or "Failed")
        if reason == "DeadlineExceeded":  # the kubelet enforced activeDeadlineSeconds first
            reason = "MaxDurationExceeded"
        history = _record(history, current, fraction, now,
                          outcome if outcome == "Succeeded" else reason)
        patch = {"phase": new_phase.value, "attempts": attempts, "history": history,
                 "gpuHours": round(history_gpu_hours(history, now), 6), **NOT_WAITING,
                 "completionTime": format_timestamp(current.finished or now),
                 "reason": reason,
                 "message": f"attempt {attempts} {outcome.lower()} on {current.node}"}
        if current.node:
            patch["node"] = current.node
        patch.update(_recorded_pod(status, current))
        if not status.get("startTime") and current.started:  # it ran between two passes
            patch["startTime"] = format_timestamp(current.started)
        events.append(("Normal" if new_phase is Phase.SUCCEEDED else "Warning",
                       new_phase.value, f"attempt {attempts} {outcome.lower()} on {current.node}"))
        return Observation(new_phase, attempts, patch, tuple(events), None if gone else current)

    if current.deleting or preempting == attempts:
        new_phase = Phase.PREEMPTED
    elif current.phase == "Running":
        new_phase = Phase.RUNNING
    else:
        new_phase = Phase.ADMITTED
    history = _record(history, current, fraction, now, None)
    patch = {"phase": new_phase.value, "attempts": attempts, "history": history,
             **_recorded_pod(status, current)}
    if current.assignment is not None and not status.get("podAssignment"):
        # the assignment as first seen bound: a later change is not the extender's
        # (ownership.assignment_tampered)
        patch["podAssignment"] = encode_assignment(current.assignment)
    if current.node:
        patch["node"] = current.node
    if gpus:
        patch["gpus"] = gpus
    if new_phase is Phase.RUNNING and not status.get("startTime") and current.started:
        patch["startTime"] = format_timestamp(current.started)
    if new_phase is Phase.RUNNING and phase is not Phase.RUNNING:
        patch.update(reason="Running", message=f"running on {current.node}", **{
            k: None for k in NOT_WAITING if status.get(k) is not None})
        events.append(("Normal", "Started", f"attempt {attempts} running on {current.node} "
                       f"GPUs {','.join(str(g.get('index')) for g in gpus) or '-'}"))
    return Observation(new_phase, attempts, patch, tuple(events), current)


def _recorded_pod(status: Mapping[str, Any], current: PodView) -> Obj:
    """`podName` and `podUID` of the current attempt's pod where the status records another
    (an adopted pod: the operator stopped before writing them). Once the job leaves the phase
    it is adopted from, these are what links the pod to it (`core.ownership.attempt_link`);
    without them the next pass would find the attempt's pod gone and run the job again."""
    if not current.uid or status.get("podUID") == current.uid:
        return {}
    return {"podName": current.name, "podUID": current.uid}


def placed_below_spec(job: Obj, pod: PodView) -> tuple[int, int] | None:
    """(GiB per GPU the pod was placed with, GiB its job's spec.gpu asks; 0: a whole GPU)
    where its limits are below the spec: the operator placed it by its calibrated size
    (`core.right_sizing`), a whole-GPU job as an MPS share; None otherwise. Its MPS limit
    fenced it there, so a failure is taken to be outgrowing it."""
    gpu = (job.get("spec") or {}).get("gpu") or {}
    isolation = str(gpu.get("isolation", Isolation.MPS.value))
    if isolation not in (Isolation.MPS.value, Isolation.EXCLUSIVE.value) or not pod.limits:
        return None
    try:
        asked = gib_ceil(quantity_mib(gpu.get("memory", 0)))
    except ValueError:
        return None
    placed = pod.limits[0].memory_gib
    if isolation == Isolation.EXCLUSIVE.value:  # placed as an MPS client: a share of it
        shared = pod.assignment is not None and pod.assignment.isolation is Isolation.MPS
        return (placed, 0) if shared and placed > 0 else None
    return (placed, asked) if 0 < placed < asked else None


def _requeue_failed(phase: Phase, history: list[Obj], pod: PodView, outcome: str,
                    fraction: float, attempts: int, now: float) -> Observation | None:
    """The job back in the queue after its pod failed through no fault of its code (see
    NODE_REJECTIONS), or None once that has happened more than MAX_REQUEUES_AFTER_FAILURE
    times (then it fails like any failed pod).

    The failed pod stays (it says why in `kubectl describe`); later passes find the job
    already queued for it and change nothing, until an admission makes the next attempt."""
    if pod.started is None:  # the record needs a start; the attempt held GPUs for no time
        pod = dataclasses.replace(pod, started=pod.finished or now)
    history = _record(history, pod, fraction, now, outcome)
    failures = sum(1 for r in history if _not_by_the_job(str(r.get("outcome") or "")))
    if failures > MAX_REQUEUES_AFTER_FAILURE:
        return None
    if phase is Phase.QUEUED:
        return Observation(Phase.QUEUED, attempts, {})
    node = pod.node or "?"
    what = (f"was stopped on node {node} ({pod.disruption}"
            if outcome == DISRUPTED else f"was refused by node {node} ({outcome}")
    message = (f"attempt {attempts} {what}, {failures} of at most "
               f"{MAX_REQUEUES_AFTER_FAILURE}); requeued")
    patch = {"phase": Phase.QUEUED.value, "attempts": attempts, "history": history,
             "gpuHours": round(history_gpu_hours(history, now), 6),
             "preemptingAttempt": None, "node": None, "gpus": None, "borrowed": None,
                 "podAssignment": None,
             "reason": DISRUPTED if outcome == DISRUPTED else "NodeRejected",
             "message": message}
    return Observation(Phase.QUEUED, attempts, patch, (("Warning", "Requeued", message),))


def admission_to_start_s(statuses: Iterable[Mapping[str, Any]], recent: int = 50) -> float:
    """Median seconds from admission to a running pod over the `recent` latest first runs.

    The queue estimates when a job is admitted; a user waits for it to run, which takes the
    scheduler, the node and the image that much longer (seconds when idle, minutes behind a
    burst). Only first attempts count: a job's startTime is that of its first run."""
    pairs: list[tuple[float, float]] = []
    for status in statuses:
        if status.get("attempts") != 1 or not status.get("startTime"):
            continue
        admitted = epoch_seconds(status.get("admitTime"))
        started = epoch_seconds(status["startTime"])
        if admitted is not None and started is not None and started >= admitted:
            pairs.append((started, started - admitted))
    latest = heapq.nlargest(recent, pairs)
    return float(statistics.median(d for _, d in latest)) if latest else 0.0


# (type, status, reason) of the standard conditions for each phase; reason None: the status's
_CONDITION_TABLE: dict[Phase, tuple[tuple[str, str, str | None], ...]] = {
    Phase.QUEUED: (("Admitted", "False", None), ("Running", "False", "NotAdmitted"),
                   ("Finished", "False", "Queued")),
    Phase.ADMITTED: (("Admitted", "True", "Admitted"), ("Running", "False", "PodStarting"),
                     ("Finished", "False", "Admitted")),
    Phase.RUNNING: (("Admitted", "True", "Admitted"), ("Running", "True", "Running"),
                    ("Finished", "False", "Running")),
    Phase.PREEMPTED: (("Admitted", "False", "Preempted"), ("Running", "False", "Preempted"),
                      ("Finished", "False", "Preempted")),
    Phase.SUCCEEDED: (("Admitted", "True", "Admitted"), ("Running", "False", "Finished"),
                      ("Finished", "True", None)),
    Phase.FAILED: (("Admitted", "True", "Admitted"), ("Running", "False", "Finished"),
                   ("Finished", "True", None)),
}


def job_conditions(status: Mapping[str, Any], now: float) -> list[Obj] | None:
    """The standard `conditions` (Admitted, Running, Finished) for a job's status after a
    pass, or None when the current ones already say the same (no write). A condition keeps
    its lastTransitionTime while its status stays; the reason and message follow the job's."""
    phase = Phase(status.get("phase") or Phase.QUEUED.value)
    reason = str(status.get("reason") or phase.value)
    message = str(status.get("message") or "")
    current = {c.get("type"): c for c in status.get("conditions") or []}
    out: list[Obj] = []
    for type_, state, fixed_reason in _CONDITION_TABLE[phase]:
        cond_reason = fixed_reason or reason
        if phase is Phase.FAILED and type_ == "Admitted" and not status.get("attempts"):
            state, cond_reason = "False", reason  # refused before it ever ran
        before = current.get(type_) or {}
        since = (before.get("lastTransitionTime") if before.get("status") == state
                 else None) or format_timestamp(now)
        out.append({"type": type_, "status": state, "reason": cond_reason,
                    "message": message[:32768], "lastTransitionTime": since})
    unchanged = all(
        (current.get(c["type"]) or {}).get(k) == c[k]
        for c in out for k in ("status", "reason", "message", "lastTransitionTime"))
    return None if unchanged and len(current) == len(out) else out
