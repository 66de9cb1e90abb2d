"""For the code a GpuJob runs: learn of preemption, report checkpoints and progress, resume.

Standard library only (no Kubernetes client, no credentials): everything comes from the
environment and files Carpool gives each attempt's pod (the protocol is in
`carpool.core.checkpointing`; docs/concepts.md, "Checkpoints", describes it).

    from carpool import workload

    run = workload.current()            # this attempt, from the environment
    run.install()                       # SIGTERM now sets run.stopping and run.deadline
    state = load(run.resume_from) if run.resume_from else fresh()
    for step in range(state.step, total):
        train_one_step()
        if run.stopping or step % 1000 == 0:
            path = save(run.checkpoint_dir, step)
            run.report_checkpoint(path, progress=step / total)   # waits for the record
            if run.stopping:
                sys.exit(0)

Outside Carpool (no environment) the same code runs: attempt 1, nothing to resume from, and
reports are dropped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from carpool.core import checkpointing as protocol

DEFAULT_GRACE_S = 30.0
ACK_POLL_S = 0.1
MAX_ACK_WAIT_S = 30.0
ACK_TOLERANCE_S = 0.002  # times travel as RFC 3339 text, to the microsecond


@dataclass
class Run:
    """One attempt of a job, as its environment describes it."""

    job: str = ""  # "<namespace>/<name>", "" outside Carpool
    attempt: int = 1
    grace_period_s: float = DEFAULT_GRACE_S
    checkpoint_dir: Path | None = None  # the job's checkpoint volume, the same every attempt
    resume_from: str | None = None  # the checkpoint the last attempt reported, if any
    report_dir: Path | None = None  # where the node agent reads reports
    clock: Callable[[], float] = time.time
    stopping: bool = False  # SIGTERM arrived (preemption, maxDuration, deletion)
    deadline: float | None = None  # epoch seconds when SIGKILL follows
    _callbacks: list[Callable[[float], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_environment(cls, env: Mapping[str, str],
                         clock: Callable[[], float] = time.time) -> Run:
        def path(name: str) -> Path | None:
            value = env.get(name, "")
            return Path(value) if value else None

        try:
            attempt = int(env.get(protocol.ENV_ATTEMPT, "1"))
            grace = float(env.get(protocol.ENV_GRACE_PERIOD, str(DEFAULT_GRACE_S)))
        except ValueError as err:
            raise ValueError(f"malformed Carpool environment: {err}") from None
        return cls(job=env.get(protocol.ENV_JOB, ""), attempt=attempt, grace_period_s=grace,
                   checkpoint_dir=path(protocol.ENV_CHECKPOINT_DIR),
                   resume_from=env.get(protocol.ENV_RESUME_FROM) or None,
                   report_dir=path(protocol.ENV_REPORT_DIR), clock=clock)

    @property
    def resuming(self) -> bool:
        """A checkpoint of an earlier attempt is there to resume from."""
        return self.resume_from is not None

    def seconds_left(self) -> float | None:
        """Until SIGKILL, once a stop was requested; None before."""
        return None if self.deadline is None else max(0.0, self.deadline - self.clock())

    # -- being told to stop ------------------------------------------------------------------

    def on_preemption(self, callback: Callable[[float], None]) -> None:
        """Call `callback(deadline)` when SIGTERM arrives (from the signal handler, in the main
        thread between two Python statements; keep it short, or just let the loop look at
        `stopping`). Installs the handler if `install` was not called."""
        self._callbacks.append(callback)
        self.install()

    def install(self) -> None:
        """Handle SIGTERM: set `stopping` and `deadline` (now + the grace period)."""
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop()

    def request_stop(self) -> None:
        """What SIGTERM does (also for tests and for code that learns of a stop otherwise)."""
        with self._lock:
            if self.stopping:
                return
            self.stopping = True
            self.deadline = self.clock() + self.grace_period_s
            deadline = self.deadline
        for callback in list(self._callbacks):
            callback(deadline)

    # -- reporting ---------------------------------------------------------------------------

    def report_checkpoint(self, path: str | os.PathLike[str], progress: float | None = None,
                          wait_s: float | None = None) -> bool:
        """Tell Carpool a checkpoint was saved at `path` (the next attempt gets it as
        `resume_from`), with the fraction of the job done if known. Returns whether the node
        agent recorded it within `wait_s` seconds; by default it waits only once stopping
        (until a second before the deadline), so the record lands before the process exits.
        """
        report = protocol.CheckpointReport(time=self.clock(), path=os.fspath(path),
                                           progress=progress)
        # the same checks the agent makes, so a mistake shows here, not only in its log
        protocol.parse_checkpoint(protocol.encode_checkpoint(report), report.time)
        if not self._write(protocol.CHECKPOINT_FILE, protocol.encode_checkpoint(report)):
            return False
        if wait_s is None:
            left = self.seconds_left()
            wait_s = 0.0 if left is None else min(MAX_ACK_WAIT_S, max(0.0, left - 1.0))
        return self._acked(report.time, wait_s)

    def report_progress(self, value: float) -> bool:
        """Tell Carpool the fraction of the whole job done (0..1); it sharpens the job's
        expected end. Returns False when there is nowhere to report to."""
        report = protocol.ProgressReport(value=value, time=self.clock())
        text = protocol.encode_progress(report)
        protocol.parse_progress(text, report.time)
        return self._write(protocol.PROGRESS_FILE, text)

    def _write(self, name: str, text: str) -> bool:
        """Replace `name` in the report directory at once (write aside, then rename), so the
        agent never reads half a report."""
        if self.report_dir is None or not self.report_dir.is_dir():
            return False
        fd, tmp = tempfile.mkstemp(dir=self.report_dir, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.report_dir / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True

    def _acked(self, saved_at: float, wait_s: float) -> bool:
        """Whether the agent acknowledged the report saved at `saved_at` (it writes back the
        time it recorded; compared as a time, not as text)."""
        assert self.report_dir is not None
        ack = self.report_dir / protocol.ACK_FILE
        end = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(OSError, ValueError):
                if abs(protocol.parse_time(ack.read_text().strip()) - saved_at) < ACK_TOLERANCE_S:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(ACK_POLL_S)


_current: Run | None = None


def current() -> Run:
    """This process's run, read from the environment once."""
    global _current
    if _current is None:
        _current = Run.from_environment(os.environ)
    return _current


def main() -> None:
    """`python -m carpool.workload`: print what this attempt knows (for a job's shell)."""
    run = current()
    print(f"job={run.job or '-'} attempt={run.attempt} grace={run.grace_period_s:g}s "
          f"checkpoints={run.checkpoint_dir or '-'} resume_from={run.resume_from or '-'} "
          f"reports={run.report_dir or '-'}", file=sys.stdout)


if __name__ == "__main__":
    main()
