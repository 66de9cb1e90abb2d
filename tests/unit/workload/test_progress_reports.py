"""Progress without bookkeeping: the loop wrapper and the framework callbacks write reports the
node agent accepts, with what tells a steady rate from a pause, and the core reads a rate from
them that pauses do not slow.

The callbacks are driven here by a small loop that calls their hooks with the signatures
PyTorch Lightning (`Callback`) and Hugging Face (`TrainerCallback`) document, on stand-in
trainer and state objects carrying the attributes the hooks read: installing either framework
(and torch) into the test environment is not cheap."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from carpool import workload
from carpool.core import checkpointing as protocol
from carpool.core.jobs import Job, ProgressDetail, RunRecord
from carpool.core.resources import GpuRequest, Isolation, JobClass, Phase
from carpool.core.run_times import reported_remaining

NOW = 1_800_000_000.0


class Clock:
    def __init__(self, at: float = NOW) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def run_in(tmp_path: Path, clock: Clock) -> workload.Run:
    return workload.Run(attempt=1, report_dir=tmp_path, clock=clock)


def last_report(tmp_path: Path, now: float = NOW + 1e6) -> protocol.ProgressReport:
    return protocol.parse_progress((tmp_path / protocol.PROGRESS_FILE).read_bytes(), now)


def test_a_plain_loop_reports_steps_of_its_total(tmp_path: Path) -> None:
    clock = Clock()
    run = run_in(tmp_path, clock)
    for _step in workload.steps(range(400, 1000), run=run, every_s=30.0):
        clock.at += 1.0
    report = last_report(tmp_path)
    assert (report.value, report.step, report.total, report.phase) == (1.0, 1000, 1000, "train")
    # samples every 15 s of training, the latest 16, oldest first, all within the loop
    assert len(report.recent) == protocol.MAX_RECENT
    times = [t for t, _ in report.recent]
    assert times == sorted(times) and times[-1] == NOW + 600.0


def test_an_iterable_without_a_length_needs_a_total(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="total="):
        list(workload.steps(iter([1, 2]), run=run_in(tmp_path, Clock())))
    with pytest.raises(ValueError, match="start must be within"):
        workload.Progress(10, start=11, run=run_in(tmp_path, Clock()))


def test_pauses_are_reported_as_phases_and_do_not_read_as_a_slow_rate(tmp_path: Path) -> None:
    clock = Clock()
    progress = workload.Progress(1000, run=run_in(tmp_path, clock), every_s=20.0)
    for step in range(1, 501):
        clock.at += 0.5  # 2 steps a second
        progress.update(step)
        if step % 100 == 0:
            with progress.pause("eval"):
                assert last_report(tmp_path).phase == "eval"
                clock.at += 60.0
    report = last_report(tmp_path)
    assert report.phase == "train" and report.paused_s == pytest.approx(300.0)
    # the core: a training rate of 2 steps/s, and the pauses' share of the time to come
    started = NOW
    job = Job("lab/train", "lab", JobClass.BATCH, GpuRequest(1, 0, 100, Isolation.EXCLUSIVE),
              NOW - 10, 3600.0, phase=Phase.RUNNING, attempts=1,
              runs=(RunRecord(1, started, None, 1.0),), progress=report.value,
              progress_at=report.time,
              progress_detail=ProgressDetail(report.phase, report.paused_s, report.recent))
    found = reported_remaining(job, report.time)
    assert found is not None and found.reported
    train_left = 500 / 2.0
    pause_share = 300.0 / (report.time - started)
    assert found.expected == pytest.approx(train_left / (1 - pause_share), rel=0.01)
    assert found.low < found.expected < found.high


def test_a_loops_first_report_gives_no_rate_until_a_second_sample(tmp_path: Path) -> None:
    """The first report comes with the loop's first step, after a start-up (data, model,
    CUDA) that is no training: no rate until two samples, then the training rate alone."""
    clock = Clock(NOW + 60.0)  # 60 s of start-up
    progress = workload.Progress(1000, run=run_in(tmp_path, clock), every_s=10.0)
    job = Job("lab/train", "lab", JobClass.BATCH, GpuRequest(1, 0, 100, Isolation.EXCLUSIVE),
              NOW - 10, 3600.0, phase=Phase.RUNNING, attempts=1,
              runs=(RunRecord(1, NOW, None, 1.0),))

    def reported(at: float) -> Job:
        report = last_report(tmp_path)
        return replace(job, progress=report.value, progress_at=report.time,
                       progress_detail=ProgressDetail(report.phase, report.paused_s,
                                                      report.recent))

    clock.at += 0.5
    progress.update(1)
    assert len(last_report(tmp_path).recent) == 1
    assert reported_remaining(reported(clock.at), clock.at) is None
    for step in range(2, 41):
        clock.at += 0.5  # 2 steps a second
        progress.update(step)
    found = reported_remaining(reported(clock.at), clock.at)
    assert found is not None
    assert found.expected == pytest.approx((1000 - 40) / 2.0, rel=0.01)


def test_reports_stay_within_the_protocol(tmp_path: Path) -> None:
    clock = Clock()
    run = run_in(tmp_path, clock)
    assert run.report_progress(0.5, phase="eval", step=5, total=10, paused_s=3.0,
                               recent=((NOW - 20, 0.4), (NOW - 10, 0.45)))
    text = json.loads((tmp_path / protocol.PROGRESS_FILE).read_text())
    assert text["recent"] == [[-20.0, 0.4], [-10.0, 0.45]] and text["phase"] == "eval"
    with pytest.raises(protocol.ReportError, match="'phase'"):
        run.report_progress(0.5, phase="lunch")
    for body, words in [
        ({"recent": [[5.0, 0.1]]}, "<= 0"),
        ({"recent": [[-1.0, 0.2], [-5.0, 0.1]]}, "oldest first"),
        ({"recent": [[-1.0]]}, r"\[seconds, fraction\]"),
        ({"paused": -1}, "'paused'"),
        ({"step": 1.5}, "'step'"),
    ]:
        data = {"progress": 0.5, "time": protocol.format_time(NOW), **body}
        with pytest.raises(protocol.ReportError, match=words):
            protocol.parse_progress(json.dumps(data), NOW)


def test_the_status_keeps_only_the_latest_reports_detail() -> None:
    """Every field is written (a merge patch keeps what is not), so a checkpoint's progress
    never sits next to samples of an older report."""
    report = protocol.ProgressReport(0.5, NOW, "train", 5, 10, 2.0, ((NOW - 5, 0.45),))
    status = protocol.progress_status(report, 1)
    state = protocol.reported_state(status, 1)
    assert state.progress_detail == ProgressDetail("train", 2.0, ((NOW - 5, 0.45),))
    checkpoint = protocol.checkpoint_status(protocol.CheckpointReport(NOW + 9, "/c", 0.6), 1)
    merged = {**status["progress"], **checkpoint["progress"]}
    state = protocol.reported_state({"progress": merged}, 1)
    assert state.progress == 0.6
    assert state.progress_detail == ProgressDetail("checkpoint", 0.0, ())


# ---------------------------------------------------------------- framework callbacks


def drive_lightning(hooks: Any, steps: int, validate_every: int, clock: Clock) -> None:
    """The order Lightning calls a Callback's hooks in during `fit`, with its signatures."""
    trainer = SimpleNamespace(estimated_stepping_batches=steps, global_step=0,
                              sanity_checking=True)
    module = object()
    hooks.on_validation_start(trainer, module)  # the sanity check: no pause
    hooks.on_validation_end(trainer, module)
    trainer.sanity_checking = False
    hooks.on_train_start(trainer, module)
    for batch_idx in range(steps):
        hooks.on_train_batch_start(trainer, module, None, batch_idx)
        clock.at += 1.0
        trainer.global_step += 1
        hooks.on_train_batch_end(trainer, module, {"loss": 0.1}, None, batch_idx)
        if trainer.global_step % validate_every == 0:
            hooks.on_validation_start(trainer, module)
            clock.at += 20.0
            hooks.on_validation_end(trainer, module)
            hooks.on_save_checkpoint(trainer, module, {})
            clock.at += 5.0
    hooks.on_train_end(trainer, module)


def test_the_lightning_hooks_report_steps_and_pauses(tmp_path: Path) -> None:
    clock = Clock()
    hooks = workload._LightningHooks(run=run_in(tmp_path, clock), every_s=10.0)
    drive_lightning(hooks, 200, 50, clock)
    report = last_report(tmp_path)
    assert (report.value, report.step, report.total) == (1.0, 200, 200)
    # four validations of 20 s; the saves after each last until the next batch (5 s, the
    # last one until the end of training)
    assert report.paused_s == pytest.approx(4 * 20.0 + 4 * 5.0)


def test_the_hugging_face_hooks_report_steps_and_pauses(tmp_path: Path) -> None:
    clock = Clock()
    hooks = workload._HuggingFaceHooks(run=run_in(tmp_path, clock), every_s=10.0)
    args = SimpleNamespace()
    state = SimpleNamespace(max_steps=120, global_step=0)
    control = SimpleNamespace(should_evaluate=False, should_save=False)
    hooks.on_train_begin(args, state, control)
    for _ in range(120):
        clock.at += 1.0
        state.global_step += 1
        control.should_evaluate = control.should_save = state.global_step % 40 == 0
        hooks.on_step_end(args, state, control)
        if control.should_evaluate:
            clock.at += 30.0
            hooks.on_evaluate(args, state, control, metrics={"eval_loss": 0.2})
            clock.at += 4.0
            hooks.on_save(args, state, control)
    hooks.on_train_end(args, state, control)
    report = last_report(tmp_path)
    assert (report.value, report.step, report.total) == (1.0, 120, 120)
    assert report.paused_s == pytest.approx(3 * 34.0)


def test_importing_the_module_imports_no_framework() -> None:
    import sys
    assert "lightning" not in sys.modules and "transformers" not in sys.modules
    with pytest.raises(AttributeError):
        workload.NoSuchCallback  # noqa: B018
