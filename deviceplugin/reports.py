"""What jobs on this node report (checkpoints, progress, service measures), carried into their
GpuJobs' status.

Tenants' pods hold no credentials and tenants may not write GpuJob status, so a job reports by
writing files (core.checkpointing) into a directory this agent made for its pod and handed to
its GPU container in Allocate (`<reports root>/<pod uid>` on the host, CARPOOL_REPORT_DIR in
the container). The agent reads them every second and patches the job's status with its
node-bound identity; the `carpool-gpujob-reports` admission policy lets such an identity write
only the reported fields, and only of a job whose status places it on the identity's node.

The files are the tenant's: they are opened without following links, read only if regular
and small, and parsed strictly. The acknowledgement is written aside and renamed over, so a
link planted under its name is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from carpool.core import checkpointing as protocol
from carpool.core import service_levels
from carpool.core.assignment import AssignedGpu, AssignmentError, parse_assignment
from carpool.core.names import ANN_ASSIGNMENT, ANN_JOB
from carpool.core.placement import counted_sharers
from carpool.deviceplugin.handshake import ServedPod

log = logging.getLogger(__name__)

DEFAULT_REPORTS_ROOT = Path("/var/lib/carpool/reports")
REPORT_INTERVAL_S = 1.0  # how often the reports are read
FORGET_AFTER_S = 60.0  # a pod's directory outlives the pod this long (its last report lands)


class StatusWriter(Protocol):
    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> None:
        """Merge `status` into the GpuJob's status."""
        ...


class Refused(Exception):
    """The API server refused a report for good (policy, job gone); do not retry it."""


def pod_dir(root: Path, pod_uid: str) -> Path:
    if not pod_uid or "/" in pod_uid or pod_uid in (".", ".."):
        raise ValueError(f"not a pod UID: {pod_uid!r}")
    return root / pod_uid


def prepare(root: Path, pod_uid: str) -> Path:
    """The pod's report directory, created writable for any user in the container (only this
    pod's containers get it mounted)."""
    path = pod_dir(root, pod_uid)
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir()
    if path.is_symlink() or not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    os.chmod(path, 0o1777)
    return path


def read_report(directory: Path, name: str) -> tuple[bytes, tuple[int, int, int]] | None:
    """The file's bytes and (inode, size, mtime ns) to tell a new version from the last, or
    None if absent; never follows a link, never reads more than the protocol allows."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        data = os.read(fd, protocol.MAX_REPORT_BYTES + 1)
    finally:
        os.close(fd)
    return data, (info.st_ino, info.st_size, info.st_mtime_ns)


def write_ack(directory: Path, text: str) -> None:
    """Replace the acknowledgement file: written under a fresh name, then renamed over."""
    tmp = directory / f".ack-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, directory / protocol.ACK_FILE)


@dataclass
class ReportReader:
    """Reads every job pod's reports on this node and records new ones in its GpuJob."""

    node: str
    root: Path
    pods: Callable[[], Any]  # async () -> list[ServedPod]: the pods bound to this node
    writer: StatusWriter
    clock: Callable[[], float] = time.time
    seen: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)
    gpu_models: Callable[[], Mapping[str, str]] = dict  # GPU uuid -> model on this node
    # the latest service measure recorded per pod key, with its job (for the metrics)
    measures: dict[str, tuple[tuple[str, str], service_levels.ServiceMeasure]] = field(
        default_factory=dict)
    on_measures: Callable[[Mapping[str, tuple[tuple[str, str], service_levels.ServiceMeasure]]],
                          None] | None = None  # after each round (the metrics)

    async def step(self) -> list[str]:
        """One round; returns what it recorded or refused, one line each."""
        if not self.root.is_dir():
            return []
        pods: list[ServedPod] = await self.pods()
        by_uid = {p.uid: p for p in pods if p.uid}
        done: list[str] = []
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            pod = by_uid.get(entry.name)
            if pod is None:
                self._forget(entry)
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            for name in (protocol.CHECKPOINT_FILE, protocol.PROGRESS_FILE,
                         service_levels.SERVICE_FILE):
                line = await self._carry(pod, Path(entry.path), name, pods)
                if line:
                    done.append(line)
        self.forget_measures({p.key for p in pods})
        if self.on_measures is not None:
            self.on_measures(self.measures)
        return done

    async def _carry(self, pod: ServedPod, directory: Path, name: str,
                     pods: list[ServedPod]) -> str:
        read = read_report(directory, name)
        key = (pod.uid, name)
        if read is None or self.seen.get(key) == read[1]:
            return ""
        data, version = read
        job = _job_of(pod)
        attempt = protocol.attempt_of_pod(pod.name)
        if job is None or attempt < 1:
            self.seen[key] = version
            return ""
        now = self.clock()
        try:
            measure: service_levels.ServiceMeasure | None = None
            if name == protocol.CHECKPOINT_FILE:
                report = protocol.parse_checkpoint(data, now)
                status = protocol.checkpoint_status(report, attempt)
                what = f"checkpoint {report.path!r} at {protocol.format_time(report.time)}"
            elif name == service_levels.SERVICE_FILE:
                served = service_levels.parse_service(data, now)
                model, sharing, by_weight, neighbours = self._where(pod, pods)
                measure = service_levels.ServiceMeasure(served, attempt, model, sharing,
                                                        by_weight, neighbours)
                status = service_levels.service_status(measure)
                what = (f"service {served.requests} requests, {served.throughput:.1f}/s, "
                        f"shared by {sharing} ({by_weight:.2f} by weight)")
            else:
                progress = protocol.parse_progress(data, now)
                status = protocol.progress_status(progress, attempt)
                what = f"progress {progress.value:.3f}"
        except protocol.ReportError as err:
            self.seen[key] = version
            log.warning("pod %s: ignoring %s: %s", pod.key, name, err)
            return f"{pod.key}: ignored {name}: {err}"
        try:
            await self.writer.patch_job_status(job[0], job[1], status)
        except Refused as err:
            self.seen[key] = version
            log.warning("pod %s: could not record %s in GpuJob %s/%s: %s", pod.key, what,
                        *job, err)
            return f"{pod.key}: refused {what}: {err}"
        self.seen[key] = version
        if measure is not None:
            self.measures[pod.key] = (job, measure)
        if name == protocol.CHECKPOINT_FILE:
            write_ack(directory, status[protocol.STATUS_LAST_CHECKPOINT_TIME])
        log.info("pod %s: recorded %s in GpuJob %s/%s", pod.key, what, *job)
        return f"{pod.key}: recorded {what}"

    def _where(self, pod: ServedPod, pods: list[ServedPod]
               ) -> tuple[str, int, float, tuple[str, ...]]:
        """The model of the pod's (first) GPU, how many of this node's pods share it (the
        pod included), that count with each neighbour counted by its sharing weight over the
        pod's (`placement.counted_sharers`), and the neighbours' templates, from the
        assignments the extender wrote."""
        mine = _gpus_of(pod)
        if not mine:
            return "", 1, 1.0, ()
        first = mine[0]
        others = [gpu for other in pods
                  if other.key != pod.key and other.phase not in ("Succeeded", "Failed")
                  for gpu in _gpus_of(other) if gpu.uuid == first.uuid]
        return (self.gpu_models().get(first.uuid, ""), 1 + len(others),
                round(counted_sharers(first.sharing_weight,
                                      [gpu.sharing_weight for gpu in others]), 3),
                tuple(sorted(gpu.sharing_template for gpu in others)))

    def _forget(self, entry: os.DirEntry[str]) -> None:
        """Remove the directory of a pod gone from this node, once it has been quiet a while."""
        try:
            quiet = self.clock() - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return
        if quiet < FORGET_AFTER_S:
            return
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        self.seen = {k: v for k, v in self.seen.items() if k[0] != entry.name}

    def forget_measures(self, present: set[str]) -> None:
        """Drop the measures of pods no longer on this node (their series leave the metrics)."""
        self.measures = {k: v for k, v in self.measures.items() if k in present}


def _job_of(pod: ServedPod) -> tuple[str, str] | None:
    """The pod's GpuJob (namespace, name); only a job in the pod's own namespace."""
    ref = pod.annotations.get(ANN_JOB, "")
    namespace, _, name = ref.partition("/")
    if namespace != pod.namespace or not name:
        return None
    return namespace, name


def _gpus_of(pod: ServedPod) -> tuple[AssignedGpu, ...]:
    """The GPUs the extender assigned to the pod (none if it has no readable assignment)."""
    text = pod.annotations.get(ANN_ASSIGNMENT, "")
    if not text:
        return ()
    try:
        return parse_assignment(text).gpus
    except AssignmentError:
        return ()
