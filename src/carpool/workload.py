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

Progress without bookkeeping: wrap the loop, and the estimates of every job waiting behind
this one follow its real rate (`Progress`; evaluations and checkpoint saves are reported as
pauses, not as a slower rate):

    for step in workload.steps(range(state.step, total)):     # a plain loop
        train_one_step()

    trainer = lightning.Trainer(callbacks=[workload.LightningCallback()])   # PyTorch Lightning
    trainer = transformers.Trainer(..., callbacks=[workload.HuggingFaceCallback()])

The two callbacks import their framework only when used, so this module needs neither.

Serving: time each request, and Carpool sees the job's throughput, P99 latency and failure
rate, and keeps GPU sharing within the job's `spec.objectives` (`Service`):

    service = workload.Service()
    with service.request():
        answer = model(batch)

Outside Carpool (no environment) the same code runs: attempt 1, nothing to resume from, and
reports are dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from carpool.core import checkpointing as protocol
from carpool.core import service_levels

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

    def report_progress(self, value: float, *, phase: str = "train", step: int | None = None,
                        total: int | None = None, paused_s: float = 0.0,
                        recent: tuple[tuple[float, float], ...] = ()) -> bool:
        """Tell Carpool the fraction of the whole job done (0..1); it sharpens the job's
        expected end. `phase`, `paused_s` (seconds this attempt spent in eval or checkpoint)
        and `recent` training samples (epoch seconds, fraction) let it tell a steady rate
        from a pause (`Progress` fills them in). Returns False when there is nowhere to
        report to."""
        report = protocol.ProgressReport(value, self.clock(), phase, step, total, paused_s,
                                         recent[-protocol.MAX_RECENT:])
        text = protocol.encode_progress(report)
        protocol.parse_progress(text, report.time)
        return self._write(protocol.PROGRESS_FILE, text)

    def report_service(self, report: service_levels.ServiceReport) -> bool:
        """Tell Carpool what this job served (`Service` builds the report); False when there
        is nowhere to report to."""
        text = service_levels.encode_service(report)
        service_levels.parse_service(text, report.time)
        return self._write(service_levels.SERVICE_FILE, text)

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


# ---------------------------------------------------------------- progress of a loop

REPORT_EVERY_S = 30.0  # a progress report at most this often (each one patches the GpuJob)
T = TypeVar("T")


class Progress:
    """A loop's progress, reported as it goes: steps done of a known total, the phase it is
    in, and recent training samples, so that Carpool tells a steady rate from an evaluation
    pause or a checkpoint stall (`carpool.core.run_times.reported_remaining`).

    Steps are counted over the whole job (`start`: where this attempt resumed). A sample is
    kept every `every_s` / 2 seconds of training and at each pause's start and end (no
    progress across a pause, so a pause never reads as a slow stretch); a report goes out at
    most every `every_s` seconds, and at once when a pause starts or ends.
    """

    def __init__(self, total: int, start: int = 0, run: Run | None = None,
                 every_s: float = REPORT_EVERY_S, clock: Callable[[], float] | None = None
                 ) -> None:
        if total < 1:
            raise ValueError(f"total must be at least 1 step, got {total}")
        if not 0 <= start <= total:
            raise ValueError(f"start must be within 0..{total}, got {start}")
        self.run = run if run is not None else current()
        self.clock = clock if clock is not None else self.run.clock
        self.total = total
        self.step = start
        self.every_s = every_s
        self.phase = "train"
        self.paused_s = 0.0
        self._pause_began: float | None = None
        self._samples: deque[tuple[float, float]] = deque(maxlen=protocol.MAX_RECENT)
        self._sampled_at = -float("inf")
        self._reported_at = -float("inf")

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.total)

    def update(self, step: int) -> None:
        """The loop is at `step` (of `total`, counted over the whole job)."""
        if self._pause_began is not None:
            self.end_pause()
        self.step = max(0, min(step, self.total))
        now = self.clock()
        if now - self._sampled_at >= self.every_s / 2 or self.step >= self.total:
            self._sample(now)
        if now - self._reported_at >= self.every_s or self.step >= self.total:
            self.report(now)

    def advance(self, steps: int = 1) -> None:
        self.update(self.step + steps)

    def begin_pause(self, phase: str) -> None:
        """An evaluation ("eval") or a checkpoint save ("checkpoint") starts: no progress
        until `end_pause` (or the next `update`)."""
        if phase not in protocol.PHASES or phase == "train":
            raise ValueError(f"a pause is 'eval' or 'checkpoint', got {phase!r}")
        if self._pause_began is not None:
            self.end_pause()
        now = self.clock()
        self._sample(now)
        self.phase, self._pause_began = phase, now
        self.report(now)

    def end_pause(self) -> None:
        if self._pause_began is None:
            return
        now = self.clock()
        self.paused_s += max(0.0, now - self._pause_began)
        self.phase, self._pause_began = "train", None
        self._sample(now)
        self.report(now)

    @contextlib.contextmanager
    def pause(self, phase: str) -> Iterator[None]:
        """`with progress.pause("eval"): evaluate()`."""
        self.begin_pause(phase)
        try:
            yield
        finally:
            self.end_pause()

    def _sample(self, now: float) -> None:
        self._samples.append((now, self.fraction))
        self._sampled_at = now

    def report(self, now: float | None = None) -> bool:
        """Send the report now (whatever the interval)."""
        now = self.clock() if now is None else now
        self._reported_at = now
        paused = self.paused_s + (now - self._pause_began if self._pause_began is not None
                                  else 0.0)
        return self.run.report_progress(self.fraction, phase=self.phase, step=self.step,
                                        total=self.total, paused_s=paused,
                                        recent=tuple(self._samples))


# ---------------------------------------------------------------- serving requests

SERVICE_EVERY_S = 10.0  # a service report at most this often (each one patches the GpuJob)


class Service:
    """A serving job's three measures, reported as it goes: requests finished, failures and
    their latencies (counted in the shared buckets of `carpool.core.service_levels`, so
    Carpool can add jobs up and learn how sharing a GPU changes them).

        service = workload.Service()
        while True:
            batch = next_batch()
            with service.request():          # an exception counts as a failure, then rises
                answer = model(batch)

    Code that times its requests itself calls `record(latency_s, ok)`. Each report covers
    the requests since the last one; one goes out at most every `every_s` seconds.
    """

    def __init__(self, run: Run | None = None, every_s: float = SERVICE_EVERY_S,
                 clock: Callable[[], float] | None = None,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.run = run if run is not None else current()
        self.clock = clock if clock is not None else self.run.clock
        self.timer = timer
        self.every_s = every_s
        self._lock = threading.Lock()
        self._since = self.clock()
        self._requests = 0
        self._failures = 0
        self._buckets: dict[int, int] = {}

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Time one request; it failed if the block raises."""
        began = self.timer()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.record(self.timer() - began, ok)

    def record(self, latency_s: float, ok: bool = True) -> None:
        """One request finished after `latency_s` seconds; `ok` False: it failed."""
        index = service_levels.bucket_of(max(0.0, latency_s))
        with self._lock:
            self._requests += 1
            self._failures += 0 if ok else 1
            self._buckets[index] = self._buckets.get(index, 0) + 1
        if self.clock() - self._since >= self.every_s:
            self.report()

    def report(self) -> bool:
        """Send what was served since the last report now; False: nowhere to report to."""
        now = self.clock()
        with self._lock:
            window = now - self._since
            if window < 0.001:  # reports carry the window to the millisecond
                return False
            report = service_levels.ServiceReport(
                now, window, self._requests, self._failures,
                service_levels.Histogram(tuple(sorted(self._buckets.items()))))
            self._since, self._requests, self._failures = now, 0, 0
            self._buckets = {}
        return self.run.report_service(report)


def steps(items: Iterable[T], total: int | None = None, start: int | None = None,
          run: Run | None = None, every_s: float = REPORT_EVERY_S) -> Iterator[T]:
    """Yield `items`, counting each one done as one step of `total` (`len(items)` when not
    given; for a `range(start, stop)` of step 1, its stop, and `start` its start: resuming
    at step 400 of 1,000 is `steps(range(400, 1000))`). Epochs are steps too:
    `for epoch in steps(range(first, epochs))`."""
    if isinstance(items, range) and items.step == 1:
        total = items.stop if total is None else total
        start = items.start if start is None else start
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError("steps() needs total= for an iterable without a length") from None
    progress = Progress(total, start or 0, run, every_s)
    for item in items:
        yield item
        progress.advance()


epochs = steps  # the same counting, by epoch


# ---------------------------------------------------------------- training frameworks


class _LightningHooks:
    """PyTorch Lightning `Callback` hooks feeding a `Progress`: the total is the trainer's
    `estimated_stepping_batches`, the step its `global_step`; validation is an eval pause,
    saving a checkpoint a checkpoint pause (until the next training batch starts)."""

    def __init__(self, run: Run | None = None, every_s: float = REPORT_EVERY_S) -> None:
        self._run, self._every_s = run, every_s
        self.progress: Progress | None = None

    def _tracker(self, trainer: Any) -> Progress | None:
        if self.progress is None:
            total = int(getattr(trainer, "estimated_stepping_batches", 0) or 0)
            if total < 1 or total == float("inf"):
                return None  # an endless fit has no fraction done
            self.progress = Progress(total, min(int(trainer.global_step), total), self._run,
                                     self._every_s)
        return self.progress

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._tracker(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self.progress is not None:
            self.progress.end_pause()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        progress = self._tracker(trainer)
        if progress is not None:
            progress.update(int(trainer.global_step))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer, "sanity_checking", False):
            return
        progress = self._tracker(trainer)
        if progress is not None:
            progress.begin_pause("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.progress is not None:
            self.progress.end_pause()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        progress = self._tracker(trainer)
        if progress is not None:
            progress.begin_pause("checkpoint")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.progress is not None:
            self.progress.end_pause()
            self.progress.report()


class _HuggingFaceHooks:
    """Hugging Face `TrainerCallback` hooks feeding a `Progress`: the total is the state's
    `max_steps`, the step its `global_step`. A step after which the trainer will evaluate
    or save (`control.should_evaluate`, `should_save`) starts that pause; `on_evaluate` and
    `on_save` end it."""

    def __init__(self, run: Run | None = None, every_s: float = REPORT_EVERY_S) -> None:
        self._run, self._every_s = run, every_s
        self.progress: Progress | None = None

    def _tracker(self, state: Any) -> Progress | None:
        if self.progress is None:
            total = int(getattr(state, "max_steps", 0) or 0)
            if total < 1:
                return None
            self.progress = Progress(total, min(int(state.global_step), total), self._run,
                                     self._every_s)
        return self.progress

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tracker(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        progress = self._tracker(state)
        if progress is None:
            return
        progress.update(int(state.global_step))
        if getattr(control, "should_evaluate", False):
            progress.begin_pause("eval")
        elif getattr(control, "should_save", False):
            progress.begin_pause("checkpoint")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.progress is not None:
            self.progress.end_pause()
            if getattr(control, "should_save", False):
                self.progress.begin_pause("checkpoint")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.progress is not None:
            self.progress.end_pause()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.progress is not None:
            self.progress.end_pause()
            self.progress.report()


def _base_class(modules: tuple[str, ...], name: str, needs: str) -> type:
    """`name` from the first of `modules` that imports (the framework, only now)."""
    for module in modules:
        try:
            base: type = getattr(importlib.import_module(module), name)
        except ImportError:
            continue
        return base
    raise ImportError(needs)


def _lightning_callback() -> type:
    base = _base_class(("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"),
                       "Callback", "workload.LightningCallback needs PyTorch Lightning "
                                   "(pip install lightning)")
    return type("LightningCallback", (_LightningHooks, base),
                {"__doc__": _LightningHooks.__doc__})


def _huggingface_callback() -> type:
    base = _base_class(("transformers",), "TrainerCallback",
                       "workload.HuggingFaceCallback needs Hugging Face transformers "
                       "(pip install transformers)")
    return type("HuggingFaceCallback", (_HuggingFaceHooks, base),
                {"__doc__": _HuggingFaceHooks.__doc__})


_FRAMEWORK_CALLBACKS: dict[str, Callable[[], type]] = {
    "LightningCallback": _lightning_callback, "HuggingFaceCallback": _huggingface_callback}
_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """`LightningCallback` and `HuggingFaceCallback`, built on first use (importing their
    framework then), so importing this module imports no framework."""
    build = _FRAMEWORK_CALLBACKS.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _built:
        _built[name] = build()
    return _built[name]


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
