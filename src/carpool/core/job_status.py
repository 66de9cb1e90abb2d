"""What a GpuJob's and a ProjectQuota's status show, and when a change must be written now.

The operator's status policy, as data: each function takes a job's current status (and the
core's decision, `now`, what the pass measured) and returns the fields to write, the Event to
record and whether the write is urgent. The operator only carries them out, so every rule
here is tested without an API server, threads or a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.core.checkpointing import resume_point
from carpool.core.lifecycle import history_gpu_hours, job_conditions
from carpool.core.queueing import (
    DUE_NOTE,
    Admission,
    Expiry,
    Preemption,
    ProjectStatus,
    Wait,
    WaitReason,
)
from carpool.core.resources import (
    WHOLE_SHARER,
    GpuGrant,
    GpuRequest,
    Isolation,
    NodeInventory,
    Phase,
)
from carpool.core.timestamps import epoch_seconds, format_run_time, format_timestamp

Obj = dict[str, Any]

ESTIMATE_ROUNDING_S = 10.0  # the admission backlog and pod start delay are counted rounded
# estimated starts are written rounded to one of these steps (`estimate_step`)
ESTIMATE_STEPS_S = (1.0, 2.0, 5.0, 10.0)
ESTIMATE_PRECISION = 0.05  # the coarsest step within this share of the time until the start
# an estimated start moving by more than this share of the time until it is written at once
# (the estimates of a long queue drift with every start and every overdue job; a start hours
# away moving by a minute is no news to plan by)
ESTIMATE_JUMP = 0.25
# a range's end moving by more than this share of the time until it is written at once (a
# surge of higher-class arrivals widens every waiting job's range a little at each arrival)
RANGE_JUMP = 0.25
# reasons that say the same to the user (no slot for the job now; it waits for GPUs): GPUs
# free now but reserved for jobs ranked ahead, or none free. Which one a job gets turns with
# each finish and each backfilled start, so a change between them waits for the refresh
NO_SLOT_NOW = frozenset({WaitReason.CAPACITY.value, WaitReason.BEHIND_HIGHER_RANKED.value})

# written once, each group whole once its first field is there: when the job was submitted,
# and its first estimate with what came with it (a pass that read the job before that write
# showed would derive them again, from a later estimate that may come with a range)
FIRST_ESTIMATE = frozenset({"firstEstimatedStart", "firstSimulatedStart",
                            "firstEstimatedStartEarliest", "firstEstimatedStartLatest"})
WRITE_ONCE = {"submitTime": frozenset({"submitTime"}), "firstEstimatedStart": FIRST_ESTIMATE}


@dataclass(frozen=True)
class JobEvent:
    """An Event to record on a job. `derived`: a change read from its pods (recorded once per
    reason and note); `wait`: a wait reason (once until the job's next other Event); neither:
    a decision carried out (each time)."""

    reason: str
    note: str
    type: str = "Normal"
    action: str = "Reconcile"
    derived: bool = False
    wait: bool = False


@dataclass
class RecordedEvents:
    """The Events recorded on one job that a stale read could derive again (a job's status
    write can still be on its way when the next pass reads the job)."""

    derived: set[tuple[str, str]] = field(default_factory=set)  # (reason, note)
    waiting: str | None = None  # the wait reason recorded since the job's last other Event
    first_start_counted: bool = False  # its first start scored in the carpool_eta_* metrics

    def admit(self, event: JobEvent) -> bool:
        """Whether `event` is to be recorded now (and remember that it was)."""
        if (event.derived and (event.reason, event.note) in self.derived) or (
                event.wait and self.waiting == event.reason):
            return False
        if event.derived:
            self.derived.add((event.reason, event.note))
        self.waiting = event.reason if event.wait else None
        return True


def estimate_step(ahead_s: float) -> float:
    """How an estimated start `ahead_s` from now is rounded when written: to the coarsest of
    `ESTIMATE_STEPS_S` within `ESTIMATE_PRECISION` of that time (a second up to 40 s ahead,
    10 s from 200 s on), so status churns less for far-off starts while rounding never costs
    a short wait more than 2.5 % of it."""
    fitting = [step for step in ESTIMATE_STEPS_S if step <= ESTIMATE_PRECISION * ahead_s]
    return fitting[-1] if fitting else ESTIMATE_STEPS_S[0]


def changes(current: Mapping[str, Any], patch: Mapping[str, Any]) -> Obj:
    """The fields of `patch` that change `current` (an absent field equals null and, for
    the history of a pod not started yet, an empty list), but for `WRITE_ONCE` groups
    `current` already has, and for a first estimate once the job has started: it is the
    estimate shown before the first start, what the ranges, the class calibration and the
    `carpool_eta_*` scores compare that start with. A job requeued after its first run
    (preempted before it was ever estimated) is shown estimates, never a first one."""
    written = frozenset().union(*(group for first, group in WRITE_ONCE.items()
                                  if current.get(first)))
    if current.get("startTime"):
        written |= FIRST_ESTIMATE
    return {k: v for k, v in patch.items()
            if current.get(k) != v and not (v == [] and current.get(k) is None)
            and k not in written}


def status_write(current: Mapping[str, Any], patch: Mapping[str, Any], now: float) -> Obj:
    """What a status write sends: the fields of `patch` that change `current`, with the
    job's conditions where they change too; empty when there is nothing to write."""
    out = changes(current, patch)
    conditions = job_conditions({**current, **out}, now)
    if conditions is not None:
        out["conditions"] = conditions
    return out


def initial_status(obj: Mapping[str, Any]) -> Obj:
    """The submit time and Queued phase a new job shows; written with the job's first other
    write (its wait reason or its admission), not on its own: a job admitted in the pass that
    first sees it costs one status write, not two."""
    status = obj.get("status") or {}
    out: Obj = {}
    if not status.get("submitTime"):
        out["submitTime"] = obj["metadata"].get("creationTimestamp")
    if not status.get("phase"):
        out["phase"] = Phase.QUEUED.value
    return out


def invalid_spec(obj: Mapping[str, Any], error: str) -> tuple[Obj, JobEvent]:
    """A job whose spec cannot be decoded fails, saying why."""
    patch = {**initial_status(obj), "phase": Phase.FAILED.value, "reason": "InvalidSpec",
             "message": error}
    return patch, JobEvent("InvalidSpec", error, "Warning", derived=True)


def grants_to_status(grants: tuple[GpuGrant, ...], inventory: NodeInventory | None) -> list[Obj]:
    """A job's GPUs as its status lists them (index and model where the node is known)."""
    out = []
    for grant in grants:
        gpu = inventory.gpu(grant.gpu_uuid) if inventory else None
        entry: Obj = {"uuid": grant.gpu_uuid, "memoryMiB": grant.memory_mib,
                      "cores": grant.cores_pct}
        if gpu is not None:
            entry.update(index=gpu.index, model=gpu.model)
        if grant.sharing_limit:
            entry["sharingLimit"] = grant.sharing_limit
        if grant.sharing_weight != WHOLE_SHARER:
            entry["sharingWeight"] = grant.sharing_weight
        if grant.borrowed:
            entry["borrowed"] = True
        if grant.sharing_template:
            entry["sharingTemplate"] = grant.sharing_template
        if grant.sharing_felt_by:
            entry["sharingPairs"] = dict(grant.sharing_felt_by)
        out.append(entry)
    return out


def shared_whole_gpu_status(gpus: list[Obj], spec: GpuRequest, pod: GpuRequest) -> list[Obj]:
    """A job's status.gpus, each marked `exclusive: false` where its spec asks for a whole
    GPU and its pod is an MPS client of a share (`right_sizing.shared_whole_gpu`): until its
    pod's assignment is seen, the share is what it holds (`lifecycle.grants_from_status`)."""
    if spec.isolation is not Isolation.EXCLUSIVE or pod.isolation is not Isolation.MPS:
        return gpus
    return [{**entry, "exclusive": False} for entry in gpus]


def hardware_fingerprint(inventory: NodeInventory | None, software: tuple[str, str],
                         gpu_uuids: list[str]) -> Obj | None:
    """The fingerprint a job ran on: GPU model(s) of its GPUs, the node's driver and CUDA."""
    if inventory is None:
        return None
    models = sorted({g.model for u in gpu_uuids if (g := inventory.gpu(u)) is not None})
    if not models:
        return None
    driver, cuda = software
    return {"gpuModel": ",".join(models), "driverVersion": driver, "cudaVersion": cuda}


ACTIVITY_STEP_S = 60  # lastGpuActivity moves in whole minutes: one write a minute at most


def hardware_facts(status: Mapping[str, Any], hardware: Obj | None, peak_mib: int | None,
                   last_active: float | None = None) -> Obj:
    """The hardware fingerprint once it is known and differs, the pod's peak GPU memory as it
    grows, and when its processes last used its GPUs (None: not measured on its node), to
    the next minute, as it moves on."""
    out: Obj = {}
    if hardware is not None and status.get("hardware") != hardware:
        out["hardware"] = hardware
    if peak_mib is not None and peak_mib > int(status.get("peakMemoryMiB") or 0):
        out["peakMemoryMiB"] = peak_mib
    if last_active is not None:
        # up to the next minute: a session is stopped late by under a minute, never early
        minute = math.ceil(last_active / ACTIVITY_STEP_S) * ACTIVITY_STEP_S
        if minute > (epoch_seconds(status.get("lastGpuActivity")) or 0.0):
            out["lastGpuActivity"] = format_timestamp(minute)
    return out


def admitted(status: Mapping[str, Any], admission: Admission, gpus: list[Obj], pod_name: str,
             pod_uid: str, now: float) -> Obj:
    """What an admitted job shows once its pod exists: its attempt, node, GPUs and pod, its
    wait fields cleared, and the progress its newest checkpoint resumes from."""
    resume = resume_point(status)
    return {"phase": Phase.ADMITTED.value, "attempts": admission.attempt,
            "node": admission.node, "gpus": gpus, "borrowed": admission.borrowed,
            "admitTime": format_timestamp(now), "podName": pod_name, "podUID": pod_uid,
            "reason": "Admitted", "message": admission.message, "queuePosition": None,
            "estimatedStart": None, "estimatedStartEarliest": None,
            "estimatedStartLatest": None, "preemptingAttempt": None,
            "resumedProgress": (resume or ("", 0.0))[1]}


def gang_workers(admission: Admission, inventories: Mapping[str, NodeInventory],
                 groups: Sequence[str], pods: Sequence[str]) -> list[Obj]:
    """A gang's `status.workers`: each worker's rank, group, pod, node and GPUs, as admitted
    (`decoding.placements_from_status` reads them back)."""
    return [{"rank": rank, "group": group, "pod": pod, "node": worker.node,
             "gpus": grants_to_status(worker.grants, inventories.get(worker.node))}
            for rank, (worker, group, pod) in enumerate(zip(admission.workers, groups, pods,
                                                             strict=True))]


def pod_rejected(attempt: int, why: str, now: float) -> tuple[Obj, JobEvent]:
    """A job whose pod the API server refused (an invalid template, a denied policy) fails."""
    message = f"the pod for attempt {attempt} was refused: {why}"
    patch = {"phase": Phase.FAILED.value, "reason": "PodRejected", "message": message,
             "completionTime": format_timestamp(now)}
    return patch, JobEvent("PodRejected", message, "Warning", "Admit")


def pod_name_taken(pod_name: str, attempt: int) -> JobEvent:
    """The pod name of a job's next attempt belongs to a pod the job does not control."""
    note = (f"cannot create pod {pod_name} for attempt {attempt}: a pod of that name exists "
            f"that this GpuJob does not control; delete it to let the job start")
    return JobEvent("PodNameTaken", note, "Warning", "Admit", derived=True)


def preempted(attempts: int, preemption: Preemption) -> tuple[Obj, JobEvent, JobEvent]:
    """What a preempted job shows (which attempt is being stopped, and why), with the Events
    on it and on the job it makes room for."""
    patch = {"phase": Phase.PREEMPTED.value, "preemptingAttempt": attempts,
             "reason": f"Preempted{preemption.cause.value}", "message": preemption.message}
    return (patch, JobEvent("Preempted", preemption.message, "Warning", "Preempt"),
            JobEvent("Preempting", f"preempting {preemption.victim_key} on {preemption.node}",
                     "Normal", "Preempt"))


def expired(history: list[Mapping[str, Any]], expiry: Expiry, now: float
            ) -> tuple[Obj, JobEvent]:
    """A job stopped by `expiry` (past its maxDuration, or an idle interactive session)
    fails with its reason; its open run ends now with that outcome, and its GPU-hours are
    those of the runs so closed."""
    note = expiry.message
    closed = [dict(r, end=r.get("end") or format_run_time(now),
                   outcome=r.get("outcome") or expiry.reason) for r in history]
    patch: Obj = {"phase": Phase.FAILED.value, "reason": expiry.reason,
                  "message": note, "completionTime": format_timestamp(now), "history": closed,
                  "gpuHours": round(history_gpu_hours(closed, now), 6)}
    return patch, JobEvent(expiry.reason, note, "Warning", "Stop")


@dataclass(frozen=True)
class WaitUpdate:
    """A waiting job's wait fields that change, whether they must be written now rather than
    at the job's next refresh, the Event its new reason gets (None if the same), and whether
    it is the first wait the job shows (its status says nothing yet of why it waits)."""

    patch: Obj
    urgent: bool
    event: JobEvent | None
    first: bool = False


def wait_fields(status: Mapping[str, Any], wait: Wait, now: float, backlog_s: float,
                start_delay_s: float) -> Obj:
    """The wait fields a queued job shows: reason, message, position and estimated start
    (with its range), the first estimate while it has none. The queue estimates an admission
    as if every admission it decided happened now; the admissions left for later passes
    (`backlog_s`) take their time, then the pod its own to run (`start_delay_s`); both are
    counted rounded, and the estimates rounded by `estimate_step`."""
    backlog = round(backlog_s / ESTIMATE_ROUNDING_S) * ESTIMATE_ROUNDING_S
    delay = round(start_delay_s / ESTIMATE_ROUNDING_S) * ESTIMATE_ROUNDING_S

    def shown(epoch: float | None) -> str | None:
        if epoch is None:
            return None
        step = estimate_step(epoch + backlog + delay - now)
        return format_timestamp(round((epoch + backlog + delay) / step) * step)

    estimate = shown(wait.estimated_start)
    message = wait.message
    if estimate is not None and backlog > 0:
        message += f" (+{backlog:.0f}s to carry out the admissions decided before it)"
    if estimate is not None and delay > 0:
        message += f" (+{delay:.0f}s from admission to a running pod, recent median)"
    fields: Obj = {"reason": wait.reason.value, "message": message,
                   "queuePosition": wait.position or None, "estimatedStart": estimate,
                   "estimatedStartEarliest": shown(wait.estimated_start_low),
                   "estimatedStartLatest": shown(wait.estimated_start_high)}
    if estimate is not None and not status.get("firstEstimatedStart"):
        fields["firstEstimatedStart"] = estimate  # what the estimate ranges learn from
        if fields["estimatedStartEarliest"] and fields["estimatedStartLatest"]:
            # the range shown with it, to score (carpool_eta_first_range_total)
            fields["firstEstimatedStartEarliest"] = fields["estimatedStartEarliest"]
            fields["firstEstimatedStartLatest"] = fields["estimatedStartLatest"]
        # what the class calibration learns from (estimate_ranges.calibrated_start)
        fields["firstSimulatedStart"] = shown(wait.simulated_start)
    return fields


def wait_update(status: Mapping[str, Any], wait: Wait, now: float, backlog_s: float,
                start_delay_s: float, jump_s: float) -> WaitUpdate | None:
    """What a pass's `wait` changes in a queued job's status (None: nothing), as
    `wait_fields` shows it and `wait_change_is_urgent` judges it."""
    fields = wait_fields(status, wait, now, backlog_s, start_delay_s)
    changed = changes(status, fields)  # (no first estimate once the job has started)
    if not changed:
        return None
    event = None
    if status.get("reason") != wait.reason.value:
        event = JobEvent(wait.reason.value, wait.message,
                         "Warning" if wait.reason.refused else "Normal", "Queue", wait=True)
    return WaitUpdate(changed, wait_change_is_urgent(status, fields, now, jump_s), event,
                      first=not status.get("reason"))


def write_wait_now(update: WaitUpdate, other_write: bool, since_written_s: float,
                   refresh_s: float, unsettled: bool = False) -> bool:
    """Whether a wait update goes out in this pass: when urgent, when the job is written
    anyway (`other_write`), or once `refresh_s` passed since its last wait write; a position,
    message or small estimate shift alone waits for that. A job's first wait is held while
    it is `unsettled` (`wait_unsettled`): the next pass decides it again."""
    if other_write:
        return True
    if update.first and unsettled:
        return False
    return update.urgent or since_written_s >= refresh_s


def wait_unsettled(left_for_later: bool, left_waiting_s: float, refresh_s: float) -> bool:
    """Whether a job's wait this pass may well be overturned by the next: the pass left
    admissions it decided for later (a burst longer than a pass's time to act). The next
    pass, with those admissions carried out, ranks the queue anew (the projects' usage and
    borrowing moved) and in a burst admits many of the jobs the one before left waiting;
    a first wait written meanwhile is a status write (and an Event) that says Queued a pass
    before the one that says Admitted, and an estimate that becomes a promise to keep. Held
    at most `refresh_s` from the pass that first left the job waiting (`left_waiting_s`), as
    long as any other wait change may wait (`wait_refresh_s`)."""
    return left_for_later and left_waiting_s < refresh_s


def wait_refresh_s(waiting: int, refresh_s: float, refreshes_per_s: float) -> float:
    """How often a waiting job's wait is rewritten when nothing urgent changed: every
    `refresh_s`, or less often for a long queue so that all of them together stay under
    `refreshes_per_s` writes per second."""
    return max(refresh_s, waiting / max(1e-9, refreshes_per_s))


def wait_change_is_urgent(status: Mapping[str, Any], fields: Mapping[str, Any], now: float,
                          jump_s: float) -> bool:
    """Whether a waiting job's new wait `fields` must be written now rather than at its next
    refresh: its reason changed (but between the `NO_SLOT_NOW` reasons), it became due or
    stopped being due (`queueing.DUE_NOTE`: it now ranks ahead of work that passed it), its
    estimate came, went or moved by more than `jump_s` and `ESTIMATE_JUMP` of the time until
    it, its range came or went, or the range's end moved by more than `jump_s` and
    `RANGE_JUMP` of the time until it (what the user plans by; a position, message or a move
    small next to the wait left can wait)."""
    estimate, latest = fields.get("estimatedStart"), fields.get("estimatedStartLatest")
    before, latest_before = status.get("estimatedStart"), status.get("estimatedStartLatest")
    reason, reason_before = fields.get("reason"), status.get("reason")
    return ((reason_before != reason and not {reason_before, reason} <= NO_SLOT_NOW)
            or (DUE_NOTE in (status.get("message") or ""))
            != (DUE_NOTE in (fields.get("message") or ""))
            or (before is None) != (estimate is None)
            or _moved(_not_past(before, now), estimate,
                      max(jump_s, ESTIMATE_JUMP * _until(before, now)))
            or (latest_before is None) != (latest is None)
            or _moved(latest_before, latest,
                      max(jump_s, RANGE_JUMP * _until(latest_before, now))))


def _until(when: str | None, now: float) -> float:
    """Seconds from now until a written time (0 if absent or past)."""
    epoch = epoch_seconds(when) if when else None
    return max(0.0, epoch - now) if epoch is not None else 0.0


def _not_past(when: str | None, now: float) -> str | None:
    """A written time, or now if it has passed: an estimate that came and went said "now"."""
    epoch = epoch_seconds(when) if when else None
    return format_timestamp(now) if epoch is not None and epoch < now else when


def _moved(before: str | None, after: str | None, jump_s: float) -> bool:
    """True if an estimated start moved by more than `jump_s` seconds."""
    if before is None or after is None:
        return False
    old, new = epoch_seconds(before), epoch_seconds(after)
    return old is not None and new is not None and abs(new - old) > jump_s


def quota_status(project: ProjectStatus) -> Obj:
    """A ProjectQuota's status after a cycle (its retired usage is written apart)."""
    return {
        "usedGpuHours": round(project.used_gpu_hours, 4),
        "remainingGpuHours": (round(project.remaining_gpu_hours, 4)
                              if project.remaining_gpu_hours is not None else None),
        "periodStart": format_timestamp(project.period_start),
        "running": {"gpus": round(project.running_gpus, 4), "jobs": project.running_jobs},
        "borrowed": {"gpus": round(project.borrowed_gpus, 4)},
        "pending": project.pending_jobs,
        "memoryEfficiency": (round(project.memory_efficiency, 4)
                             if project.memory_efficiency is not None else None),
    }


def quota_status_changes(current: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether a ProjectQuota's computed status differs from what it shows."""
    return any(current.get(k) != v for k, v in status.items())
