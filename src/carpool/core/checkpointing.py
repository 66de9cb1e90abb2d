"""The workload protocol: how a job's code learns it must stop, reports what it saved, resumes.

One place for the contract that the operator (environment of each attempt's pod), the device
plugin's node agent (per-pod report directory, GpuJob status) and the workload helper
(`carpool.workload`) share. docs/concepts.md ("Checkpoints") describes it for users.

- Stopping: the job's processes get SIGTERM; they have `CARPOOL_GRACE_PERIOD` seconds from then
  until SIGKILL (the pod's terminationGracePeriodSeconds, the job's checkpoint.gracePeriod).
- Reporting: the job writes `checkpoint.json` (a checkpoint is saved) or `progress.json`
  (fraction done, 0..1) into `CARPOOL_REPORT_DIR`, a directory the node agent mounts into the
  pod; the agent copies what it finds into the GpuJob's status (tenants cannot write status)
  and answers a checkpoint with `checkpoint.ack` holding the recorded time.
- Resuming: each attempt's pod carries `CARPOOL_ATTEMPT` (1, 2, ...), `CARPOOL_CHECKPOINT_DIR`
  (the job's checkpoint volume, the same one for every attempt) and, once any attempt reported
  a checkpoint, `CARPOOL_RESUME_FROM` (the path that report named).

Reports are checked here (size, types, ranges), since the agent reads files a tenant wrote.
A report's time in the future counts as now: a job cannot claim work it has not saved. Claiming
a checkpoint it did not make only makes the job a cheaper victim, never a safer one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from carpool.core.jobs import ProgressDetail
from carpool.core.timestamps import format_timestamp_micro, parse_timestamp

# Environment of every container of an attempt's pod (set by the operator).
ENV_JOB: Final = "CARPOOL_JOB"  # "<namespace>/<name>"
ENV_ATTEMPT: Final = "CARPOOL_ATTEMPT"  # 1 for the first run, +1 for each new attempt
ENV_GRACE_PERIOD: Final = "CARPOOL_GRACE_PERIOD"  # seconds from SIGTERM to SIGKILL
ENV_CHECKPOINT_DIR: Final = "CARPOOL_CHECKPOINT_DIR"  # the checkpoint volume's mount path
ENV_RESUME_FROM: Final = "CARPOOL_RESUME_FROM"  # path of the last reported checkpoint
# Environment of the GPU container (set by the device plugin's Allocate, with the mount).
ENV_REPORT_DIR: Final = "CARPOOL_REPORT_DIR"

REPORT_MOUNT: Final = "/var/run/carpool"  # where the report directory appears in the container
DEFAULT_CHECKPOINT_MOUNT: Final = "/checkpoint"
CHECKPOINT_FILE: Final = "checkpoint.json"
PROGRESS_FILE: Final = "progress.json"
ACK_FILE: Final = "checkpoint.ack"
MAX_REPORT_BYTES: Final = 4096
MAX_PATH_CHARS: Final = 1024
# What a job's code is doing as it reports progress: training advances at its rate; an
# evaluation or a checkpoint save is a pause (progress stands still, the time still passes).
PHASES: Final = ("train", "eval", "checkpoint")
MAX_RECENT: Final = 16  # recent training samples a progress report carries, at most

# GpuJob status fields the node agent writes (and nothing else; an admission policy holds it
# to them and to jobs running on its own node).
STATUS_LAST_CHECKPOINT_TIME: Final = "lastCheckpointTime"
STATUS_LAST_CHECKPOINT: Final = "lastCheckpoint"  # {time, path, progress?, attempt}
STATUS_PROGRESS: Final = "progress"  # {value, time, attempt}
STATUS_SERVICE: Final = "service"  # a serving job's measures (core.service_levels)
REPORTED_STATUS_FIELDS: Final = (STATUS_LAST_CHECKPOINT_TIME, STATUS_LAST_CHECKPOINT,
                                 STATUS_PROGRESS, STATUS_SERVICE)
# Written by the operator at admission: the progress the new attempt starts from.
STATUS_RESUMED_PROGRESS: Final = "resumedProgress"


def attempt_of_pod(pod_name: str) -> int:
    """The attempt a job's pod runs: the operator names it `<job>-<attempt>`; 0 if not one."""
    tail = pod_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class ReportError(ValueError):
    """A report file the agent cannot use; the message says what is wrong with it."""


@dataclass(frozen=True)
class CheckpointReport:
    time: float  # epoch seconds the checkpoint was saved
    path: str  # where it is, as the job names it (usually under CARPOOL_CHECKPOINT_DIR)
    progress: float | None = None  # fraction of the job done at that checkpoint


@dataclass(frozen=True)
class ProgressReport:
    """Where a job stands. Beyond the fraction done, what tells a steady rate from a pause:
    the phase it is in, the seconds this attempt spent paused (evaluating, saving), and its
    latest training samples (time, fraction done), oldest first."""

    value: float  # fraction of the whole job done, 0..1 (all attempts together)
    time: float
    phase: str = "train"
    step: int | None = None
    total: int | None = None
    paused_s: float = 0.0
    recent: tuple[tuple[float, float], ...] = ()  # (epoch seconds, fraction), oldest first


def format_time(epoch: float) -> str:
    """Report and status times: RFC 3339 in UTC to the microsecond."""
    return format_timestamp_micro(epoch)


def parse_time(text: str) -> float:
    try:
        return parse_timestamp(text).timestamp()
    except ValueError as err:
        raise ReportError(str(err)) from None


def _fields(text: str | bytes, what: str) -> Mapping[str, Any]:
    if len(text) > MAX_REPORT_BYTES:
        raise ReportError(f"{what} is {len(text)} bytes; at most {MAX_REPORT_BYTES}")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as err:
        raise ReportError(f"{what} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def _fraction(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 <= value <= 1:
        raise ReportError(f"{what} must be a number from 0 to 1, got {value!r}")
    return float(value)


def _time(data: Mapping[str, Any], what: str, now: float) -> float:
    raw = data.get("time")
    if not isinstance(raw, str):
        raise ReportError(f"{what}: 'time' must be an RFC 3339 string, got {raw!r}")
    return min(parse_time(raw), now)


def parse_checkpoint(text: str | bytes, now: float) -> CheckpointReport:
    """A checkpoint report: `{"time": RFC 3339, "path": str, "progress": 0..1 (optional)}`."""
    what = CHECKPOINT_FILE
    data = _fields(text, what)
    path = data.get("path", "")
    if not isinstance(path, str) or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise ReportError(f"{what}: 'path' must be a string of at most {MAX_PATH_CHARS} "
                          f"characters, got {path!r:.80}")
    progress = data.get("progress")
    return CheckpointReport(
        time=_time(data, what, now), path=path,
        progress=None if progress is None else _fraction(progress, f"{what}: 'progress'"))


def parse_progress(text: str | bytes, now: float) -> ProgressReport:
    """A progress report: `{"progress": 0..1, "time": RFC 3339}` and optionally `"phase"`
    (train, eval, checkpoint), `"step"` and `"total"` (counts), `"paused"` (seconds this
    attempt spent in eval or checkpoint) and `"recent"` (up to `MAX_RECENT` training samples
    `[seconds relative to time (<= 0), fraction]`, oldest first)."""
    what = PROGRESS_FILE
    data = _fields(text, what)
    value = _fraction(data.get("progress"), f"{what}: 'progress'")
    at = _time(data, what, now)
    phase = data.get("phase", "train")
    if phase not in PHASES:
        raise ReportError(f"{what}: 'phase' must be one of {', '.join(PHASES)}, got {phase!r:.40}")
    counts = [_count(data.get(k), f"{what}: {k!r}") for k in ("step", "total")]
    paused = data.get("paused", 0.0)
    if isinstance(paused, bool) or not isinstance(paused, int | float) \
            or not math.isfinite(paused) or paused < 0:
        raise ReportError(f"{what}: 'paused' must be a number of seconds >= 0, got {paused!r:.40}")
    return ProgressReport(value, at, phase, counts[0], counts[1], float(paused),
                          _recent(data.get("recent", []), at, f"{what}: 'recent'"))


def _count(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReportError(f"{what} must be an integer >= 0, got {value!r:.40}")
    return value


def _recent(raw: Any, at: float, what: str) -> tuple[tuple[float, float], ...]:
    """Samples `[offset <= 0, fraction]` as (epoch seconds, fraction), in time order."""
    if not isinstance(raw, list) or len(raw) > MAX_RECENT:
        raise ReportError(f"{what} must be a list of at most {MAX_RECENT} [seconds, fraction] "
                          f"pairs")
    out: list[tuple[float, float]] = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            raise ReportError(f"{what}: each sample must be [seconds, fraction], got {item!r:.40}")
        offset, fraction = item
        if isinstance(offset, bool) or not isinstance(offset, int | float) \
                or not math.isfinite(offset) or offset > 0:
            raise ReportError(f"{what}: a sample's seconds must be a number <= 0 (before "
                              f"'time'), got {offset!r:.40}")
        sample = (at + float(offset), _fraction(fraction, f"{what}: a sample's fraction"))
        if out and sample[0] < out[-1][0]:
            raise ReportError(f"{what}: samples must be oldest first")
        out.append(sample)
    return tuple(out)


def encode_checkpoint(report: CheckpointReport) -> str:
    body: dict[str, Any] = {"time": format_time(report.time), "path": report.path}
    if report.progress is not None:
        body["progress"] = report.progress
    return json.dumps(body)


def encode_progress(report: ProgressReport) -> str:
    body: dict[str, Any] = {"progress": report.value, "time": format_time(report.time)}
    body.update(_progress_detail(report))
    return json.dumps(body)


def _progress_detail(report: ProgressReport) -> dict[str, Any]:
    """The optional fields of a progress report, as the report file and the status hold them
    (samples relative to the report's time, to the millisecond)."""
    body: dict[str, Any] = {}
    if report.phase != "train":
        body["phase"] = report.phase
    if report.step is not None:
        body["step"] = report.step
    if report.total is not None:
        body["total"] = report.total
    if report.paused_s:
        body["paused"] = round(report.paused_s, 3)
    if report.recent:
        body["recent"] = [[round(min(0.0, t - report.time), 3), round(v, 6)]
                          for t, v in report.recent]
    return body


def checkpoint_status(report: CheckpointReport, attempt: int) -> dict[str, Any]:
    """The GpuJob status fields recording `report` from `attempt`."""
    last: dict[str, Any] = {"time": format_time(report.time), "path": report.path,
                            "attempt": attempt}
    status: dict[str, Any] = {STATUS_LAST_CHECKPOINT_TIME: format_time(report.time),
                              STATUS_LAST_CHECKPOINT: last}
    if report.progress is not None:
        last["progress"] = report.progress
        # every field, so a merge patch keeps no samples of an earlier progress report
        status[STATUS_PROGRESS] = {"value": report.progress, "time": format_time(report.time),
                                   "attempt": attempt, "phase": "checkpoint", "step": None,
                                   "total": None, "paused": 0.0, "recent": []}
    return status


def progress_status(report: ProgressReport, attempt: int) -> dict[str, Any]:
    """The status field recording `report`; every field is written, so a report without
    samples or phase replaces the last one's (a merge patch would keep them)."""
    detail = _progress_detail(report)
    return {STATUS_PROGRESS: {"value": report.value, "time": format_time(report.time),
                              "attempt": attempt, "phase": report.phase,
                              "step": detail.get("step"), "total": detail.get("total"),
                              "paused": detail.get("paused", 0.0),
                              "recent": detail.get("recent", [])}}


@dataclass(frozen=True)
class ReportedState:
    """What a job's status says its code reported, as the admission core uses it."""

    last_checkpoint_at: float | None = None
    progress: float | None = None  # reported by the current attempt, else None
    progress_at: float | None = None
    resumed_progress: float = 0.0  # where the current attempt started from
    progress_detail: ProgressDetail | None = None  # phase, pauses, samples of that report


def reported_state(status: Mapping[str, Any], attempt: int) -> ReportedState:
    """Decode the reported fields of a GpuJob status; progress counts only from `attempt`
    (a progress of an earlier attempt says nothing about how fast this one goes). Malformed
    fields are ignored: only the operator and the node agent write status."""
    checkpoint_at = None
    if isinstance(raw := status.get(STATUS_LAST_CHECKPOINT_TIME), str):
        try:
            checkpoint_at = parse_time(raw)
        except ReportError:
            checkpoint_at = None
    progress = progress_at = None
    detail: ProgressDetail | None = None
    raw_progress = status.get(STATUS_PROGRESS)
    if isinstance(raw_progress, Mapping) and raw_progress.get("attempt") == attempt:
        try:
            progress = _fraction(raw_progress.get("value"), "progress")
            progress_at = _time(raw_progress, "progress", math.inf)
        except ReportError:
            progress = progress_at = None
        else:
            detail = _detail(raw_progress, progress_at)
    resumed = status.get(STATUS_RESUMED_PROGRESS, 0.0)
    try:
        resumed_value = _fraction(resumed, "resumedProgress")
    except ReportError:
        resumed_value = 0.0
    return ReportedState(checkpoint_at, progress, progress_at, resumed_value, detail)


def _detail(raw: Mapping[str, Any], at: float) -> ProgressDetail | None:
    """The detail of a recorded progress report; None when it has none or it is malformed."""
    phase, paused, recent = raw.get("phase"), raw.get("paused", 0.0), raw.get("recent") or []
    if phase is None and not recent:
        return None
    try:
        if phase not in (None, *PHASES):
            raise ReportError(f"unknown phase {phase!r:.40}")
        if isinstance(paused, bool) or not isinstance(paused, int | float) \
                or not math.isfinite(paused) or paused < 0:
            raise ReportError("malformed paused")
        return ProgressDetail(phase or "train", float(paused), _recent(recent, at, "recent"))
    except ReportError:
        return None


def resume_point(status: Mapping[str, Any]) -> tuple[str, float] | None:
    """(path, progress) of the last reported checkpoint, for the next attempt; None if none."""
    last = status.get(STATUS_LAST_CHECKPOINT)
    if not isinstance(last, Mapping) or not isinstance(last.get("path"), str):
        return None
    progress = last.get("progress", 0.0)
    try:
        value = _fraction(progress, "progress")
    except ReportError:
        value = 0.0
    return str(last["path"]), value
