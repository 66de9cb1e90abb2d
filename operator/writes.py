"""The write stage of a pass: the lanes that carry a pass's decisions to the API server.

A pass decides, then hands its writes here. Each lane owns its threads and its lock:

- `admissions`: pod creates (and their status writes) in parallel; the pass waits for them;
- `statuses`: the remaining status writes, in the background, at most one per job at a time
  so a job's writes land in order; a write the pass needs now (`status_now`: an admission, a
  preemption) takes a queued one of the same job over, or waits for it if it already left;
- Events on jobs, recorded once per change (`job_status.RecordedEvents`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures as cf
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from carpool.core import job_status
from carpool.core.decoding import first_start
from carpool.core.job_status import JobEvent, RecordedEvents
from carpool.kube.client import REQUEST_TIMEOUT
from carpool.operator import metrics
from carpool.operator.kube import Kube, Obj

log = logging.getLogger(__name__)
A = TypeVar("A")
STATUS_WORKERS = 8  # background status writes (waits, started and finished runs)


class Lane:
    """A background thread pool that can be drained: everything submitted so far lands."""

    def __init__(self, name: str, workers: int):
        self.name, self.workers = name, workers
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def submit(self, task: Callable[[], None]) -> cf.Future[None]:
        return self.pool.submit(task)

    def drain(self) -> None:
        """Wait for what was submitted so far; later submissions go to a fresh pool."""
        old, self.pool = self.pool, ThreadPoolExecutor(max_workers=self.workers,
                                                       thread_name_prefix=self.name)
        old.shutdown(wait=True)


@dataclass
class _QueuedStatus:
    """A background status write: its patch, its task in the lane, whether it has left (its
    patch read, under the writer's lock), set once it has landed."""

    patch: Obj
    landed: threading.Event = field(default_factory=threading.Event)
    task: cf.Future[None] | None = None
    left: bool = False


class Writer:
    """Carries out a pass's writes (see the module's docstring); shared by every pass."""

    def __init__(self, kube: Kube, latest: Callable[[str], Obj | None], write_workers: int):
        self.kube = kube
        self._latest = latest  # job key -> the newest GpuJob the watch has shown
        self._admission_workers = max(1, write_workers)
        self.admissions = ThreadPoolExecutor(max_workers=self._admission_workers,
                                             thread_name_prefix="writes")
        self.statuses = Lane("statuses", STATUS_WORKERS)
        self._queued: dict[str, _QueuedStatus] = {}  # job key -> its background write
        self._queued_lock = threading.Lock()
        self._recorded: dict[str, RecordedEvents] = {}  # job uid -> Events recorded on it
        self._recorded_lock = threading.Lock()

    def admit_in_parallel(self, admissions: Sequence[A], admit: Callable[[A], None],
                          go_on: Callable[[A], bool]) -> list[A]:
        """Run `admit` for each admission in order, as many at once as the lane has threads,
        until `go_on` says the rest wait for the next pass; the admissions started, once all
        of them are done. Each is submitted only as a thread frees up, so `go_on` judges it
        when it would start (the pass's time budget holds)."""
        slots = threading.BoundedSemaphore(self._admission_workers)
        started: list[A] = []
        pending = []
        for admission in admissions:
            slots.acquire()
            if not go_on(admission):
                slots.release()
                break
            started.append(admission)
            future = self.admissions.submit(admit, admission)
            future.add_done_callback(lambda _: slots.release())
            pending.append(future)
        cf.wait(pending)
        return started

    def drain(self) -> None:
        """Wait until every background write submitted so far has landed (tests, shutdown)."""
        self.statuses.drain()

    # -- Events ----------------------------------------------------------------------------

    def event(self, obj: Obj, event: JobEvent) -> None:
        """Record an Event on a job, once per change: a job's status write can still be on
        its way when the next pass reads the job, and that pass derives the same change
        again (`job_status.RecordedEvents`)."""
        uid = str(obj["metadata"].get("uid", ""))
        with self._recorded_lock:
            if not self._recorded.setdefault(uid, RecordedEvents()).admit(event):
                return
        self.kube.event(obj, event.reason, event.note, event.type, event.action)

    def forget_jobs_except(self, uids: Iterable[str]) -> None:
        """Forget the Events recorded on jobs no longer in the cache."""
        keep = set(uids)
        with self._recorded_lock:
            self._recorded = {u: r for u, r in self._recorded.items() if u in keep}

    # -- statuses --------------------------------------------------------------------------

    def status_now(self, key: str, obj: Obj | None, patch: Obj, background: bool = False
                   ) -> Obj | None:
        """Write `patch` to the status of job `key` (as `obj` shows it) now, only what it
        changes; the job as it is after the write (None if nothing was written). A queued
        background write of the job that has not started yet goes out with it; one that has
        lands first."""
        landing = None
        if not background:
            with self._queued_lock:
                queued = self._queued.get(key)
                if queued is not None and queued.task is not None and queued.task.cancel():
                    # not started yet: this write carries it (an admission or a preemption
                    # must not wait behind a backlog of wait statuses in the background lane)
                    del self._queued[key]
                    queued.landed.set()
                    patch = {**queued.patch, **patch}
                elif queued is not None:
                    landing = queued.landed
        if landing is not None:  # a background write of this job first, so they land in order
            landing.wait(REQUEST_TIMEOUT[1])
        current = (obj or {}).get("status") or {}
        # only what changes: most running jobs' derived status equals what they show
        patch = job_status.status_write(current, patch, time.time())
        if not patch:
            return None
        namespace, name = key.split("/", 1)
        version = self.kube.patch_job_status(namespace, name, patch)
        if obj is None:
            return None
        if patch.get("startTime") and not current.get("startTime"):
            self._score_first_start(obj, {**current, **patch})
        # a new object (the cached one is shared with the watch's store), so that a second
        # write in this pass sees what the first wrote
        meta = dict(obj["metadata"], resourceVersion=version or
                    obj["metadata"].get("resourceVersion"))
        return {**obj, "metadata": meta, "status": {
            k: v for k, v in {**current, **patch}.items() if v is not None}}

    def statuses_later(self, patches: dict[str, Obj]) -> None:
        """Write these statuses in the background: the next pass reads and decides meanwhile.
        At most one write per job is in flight, so a job's writes land in order: a job whose
        write is still queued has the newer patch folded into it (a backlog must not send a
        pass's old estimate after a newer pass derived another), and a job whose write has
        left is left to a later pass (which derives its patch again from the pods). A queued
        write holds only its patch and compares it with the newest status the watch shows
        when it goes out (a backlog of thousands must not keep as many old copies of jobs
        alive)."""
        for key, patch in patches.items():
            queued = _QueuedStatus(patch)

            def write(key: str = key, queued: _QueuedStatus = queued) -> None:
                try:
                    with self._queued_lock:
                        queued.left = True
                        latest_patch = queued.patch
                    self.status_now(key, self._latest(key), latest_patch, background=True)
                except Exception:
                    log.exception("writing the status of %s failed; next pass retries", key)
                finally:
                    with self._queued_lock:
                        if self._queued.get(key) is queued:
                            del self._queued[key]
                    queued.landed.set()

            with self._queued_lock:
                waiting = self._queued.get(key)
                if waiting is not None:
                    if not waiting.left:
                        waiting.patch = {**waiting.patch, **patch}
                    continue
                self._queued[key] = queued
                queued.task = self.statuses.submit(write)

    def _score_first_start(self, obj: Obj, status: Obj) -> None:
        """The `carpool_eta_*` metrics of a job whose first start was just written: the start
        counted, and scored where it had a first estimate. That write happens once per job
        (a later pass, a restarted or new leader reads the startTime back and derives none; a
        requeued job keeps it), except when a pass reads the job before its own write shows
        and derives it again: the job's uid counts once."""
        with self._recorded_lock:
            recorded = self._recorded.setdefault(str(obj["metadata"].get("uid", "")),
                                                 RecordedEvents())
            if recorded.first_start_counted:
                return
            recorded.first_start_counted = True
        first = first_start(obj, status)
        if first is not None:
            metrics.observe_first_start(first[0].label, first[1])
