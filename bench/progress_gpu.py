"""A real training loop on the GPU reports its progress; the estimated start of the job waiting
behind it, against when that job actually starts.

Two jobs share one GPU, each asking for all of it, so the second waits for the first. Each job
is a host process running a PyTorch training loop (bf16 MLP on random data; `--device cpu`:
float32, smaller) that reports through `carpool.workload`: job A with `Progress` (an evaluation
and a checkpoint save every quarter, reported as pauses; from halfway its batches are 1.5x
larger, so its rate drops, as a curriculum or a longer sequence length would make it), job B
with the `steps()` one-liner. The operator's part runs in this process, by the same rules as
the operator's, without Kubernetes: every `--cycle` seconds it reads A's report file as the
node agent does (`checkpointing.parse_progress`, `progress_status`), decodes the job's status
as the operator does (`checkpointing.reported_state`) and runs one admission cycle
(`queueing.admission_cycle`) on a one-node snapshot. The cycle admits A at once, gives B an
estimated start while A runs, and admits B once A's process has exited; that admission is B's
actual start, and B's process is started then.

Printed per sample: A's reported progress and phase, B's estimated start (seconds from its
submission) by the cycle, the 80 % range of A's end (`run_times.remaining`) that B's start
rests on, and what B would have been told without reports (A's estimated duration, the
user's guess, `--estimate`); at the end each sample's error against B's actual start.
Everything measured goes to `--out`/progress-gpu.json, the jobs' output beside it; their
report files and checkpoints live in a temporary directory, removed at the end.

    python3 bench/progress_gpu.py [--device cuda|cpu] [--seconds 90] [--out DIR]

Needs only PyTorch and the standard library (the repo's `src/` is put on the path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from carpool import workload  # noqa: E402
from carpool.core import checkpointing as protocol  # noqa: E402
from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord  # noqa: E402
from carpool.core.placement import NodeState  # noqa: E402
from carpool.core.queueing import AdmissionConfig, admission_cycle, extender_placer  # noqa: E402
from carpool.core.resources import (  # noqa: E402
    Gpu,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
    Phase,
)
from carpool.core.run_times import remaining, run_time  # noqa: E402

NODE = "gpu-node"
GIB = 1024


# ---------------------------------------------------------------- the training jobs (workers)


def train(name: str, device: str, seconds: float, every_s: float, checkpoint_dir: Path) -> int:
    """One job's training loop: the steps it takes are sized from a warm-up so that the loop
    trains about `seconds` at its first rate (job A then slows down from halfway)."""
    import torch

    torch.manual_seed(0)
    cuda = device == "cuda"
    width, batch = (4096, 8192) if cuda else (512, 256)
    layers = [torch.nn.Linear(width, width) for _ in range(8)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())])
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = torch.bfloat16 if cuda else torch.float32

    def step(rows: int) -> None:
        x = torch.randn(rows, width, device=device)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=dtype, enabled=cuda):
            loss = model(x).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        step(batch)  # warm-up: kernels chosen, memory pooled
    sync()
    began = time.perf_counter()
    probes = 5
    for _ in range(probes):
        step(batch)
    sync()
    per_step = (time.perf_counter() - began) / probes
    total = max(20, int(seconds / per_step))

    if name == "a":
        progress = workload.Progress(total, every_s=every_s)
        quarter = max(1, total // 4)
        for i in range(1, total + 1):
            step(batch if i <= total // 2 else batch * 3 // 2)
            if i % 8 == 0 or i == total:
                sync()
                progress.update(i)
            if i % quarter == 0 and i < total:
                sync()
                progress.update(i)
                with progress.pause("eval"), torch.no_grad():
                    for _ in range(max(1, quarter // 10)):
                        model(torch.randn(batch, width, device=device))
                    sync()
                with progress.pause("checkpoint"):
                    path = checkpoint_dir / "checkpoint.pt"  # the latest only
                    torch.save(model.state_dict(), path)
                    progress.run.report_checkpoint(path, progress=i / total)
    else:
        for _ in workload.steps(range(total), every_s=every_s):
            step(batch)
        sync()
    print(json.dumps({"job": name, "device": device, "steps": total,
                      "first_rate_step_s": per_step}), flush=True)
    return 0


# ---------------------------------------------------------------- the operator's part


@dataclass
class Sample:
    at: float  # seconds since B was submitted
    progress: float | None
    phase: str | None
    estimate: float | None  # B's estimated start, seconds since its submission
    a_end_low: float | None  # the 80 % range of A's end, seconds since B's submission
    a_end_high: float | None
    reported: bool
    without_reports: float | None  # B's estimated start had A not reported


@dataclass
class Scene:
    device: str
    gpu_model: str
    memory_mib: int
    estimate_s: float
    out: Path
    work: Path  # report directories and checkpoints (removed at the end)
    jobs: dict[str, Job] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def node(self) -> dict[str, NodeState]:
        gpu = Gpu(0, "gpu-0", self.gpu_model, self.memory_mib)
        return {NODE: NodeState(NodeInventory(NODE, (gpu,)))}

    def job(self, name: str, now: float) -> Job:
        request = GpuRequest(1, self.memory_mib, 100, Isolation.EXCLUSIVE)
        return Job(f"lab/train-{name}", "lab", JobClass.BATCH, request, now, self.estimate_s,
                   template=f"train-{name}@bench")

    def report_dir(self, name: str) -> Path:
        return self.work / f"reports-{name}"

    def cycle(self, now: float, jobs: dict[str, Job]) -> Any:
        snapshot = ClusterSnapshot(now, tuple(jobs.values()),
                                   {"lab": ProjectQuota("lab", frozenset({"lab"}))},
                                   self.node())
        return admission_cycle(snapshot, AdmissionConfig(node_placer=extender_placer()))

    def start(self, name: str, admission: Any, now: float, args: argparse.Namespace) -> None:
        job = self.jobs[name]
        self.jobs[name] = replace(job, phase=Phase.RUNNING, attempts=admission.attempt,
                                  node=admission.node, grants=admission.grants,
                                  runs=(RunRecord(admission.attempt, now, None,
                                                  admission.gpu_fraction, admission.node),))
        reports = self.report_dir(name)
        reports.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, protocol.ENV_JOB: job.key, protocol.ENV_ATTEMPT: "1",
               protocol.ENV_REPORT_DIR: str(reports),
               protocol.ENV_CHECKPOINT_DIR: str(reports),
               "PYTHONPATH": os.pathsep.join(
                   p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)}
        seconds = args.seconds if name == "a" else args.seconds_b
        log = (self.out / f"train-{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--device",
             self.device, "--seconds", str(seconds), "--report-every", str(args.report_every)],
            env=env, stdout=log, stderr=subprocess.STDOUT)

    def read_reports(self, name: str) -> None:
        """What the node agent records of the job's progress file, decoded as the operator
        decodes the status."""
        path = self.report_dir(name) / protocol.PROGRESS_FILE
        job = self.jobs[name]
        try:
            text = path.read_text()
        except FileNotFoundError:
            return
        try:
            report = protocol.parse_progress(text, time.time())
        except protocol.ReportError as err:
            print(f"ignored a malformed report of {job.key}: {err}", file=sys.stderr)
            return
        state = protocol.reported_state(protocol.progress_status(report, job.attempts),
                                        job.attempts)
        self.jobs[name] = replace(job, progress=state.progress, progress_at=state.progress_at,
                                  progress_detail=state.progress_detail)

    def finish(self, name: str, now: float) -> None:
        job = self.jobs[name]
        runs = tuple(replace(r, end=now) for r in job.runs)
        self.jobs[name] = replace(job, phase=Phase.SUCCEEDED, grants=(), node="", runs=runs)


def orchestrate(args: argparse.Namespace) -> int:
    device = args.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible (use --device cpu)")
        props = torch.cuda.get_device_properties(0)
        model, memory = props.name, props.total_memory // (1024 * 1024)
    else:
        model, memory = "cpu", 80 * GIB
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="carpool-progress-") as work:
        scene = Scene(device, model, memory, args.estimate, out, Path(work))
        try:
            return run_scene(scene, args)
        finally:
            for proc in scene.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def run_scene(scene: Scene, args: argparse.Namespace) -> int:
    out, device, model = scene.out, scene.device, scene.gpu_model

    t0 = time.time()
    scene.jobs["a"] = scene.job("a", t0)
    result = scene.cycle(t0, {"a": scene.jobs["a"]})
    if not result.admissions:
        raise SystemExit(f"job A was not admitted: {result.waits}")
    scene.start("a", result.admissions[0], t0, args)
    time.sleep(args.b_after)
    submitted = time.time()
    scene.jobs["b"] = scene.job("b", submitted)
    samples: list[Sample] = []
    b_start: float | None = None
    a_end: float | None = None
    print(f"device {device} ({model}); A started, B submitted {submitted - t0:.1f} s later; "
          f"both estimated at {args.estimate:.0f} s by their user", flush=True)
    print(f"{'t (s)':>6} {'A progress':>10} {'phase':>10} {'B est. start':>12} "
          f"{'A end P10-P90':>15} {'w/o reports':>11}", flush=True)
    while True:
        now = time.time()
        if a_end is None and scene.procs["a"].poll() is not None:
            if scene.procs["a"].returncode != 0:
                raise SystemExit(f"job A failed (exit {scene.procs['a'].returncode}); "
                                 f"see {out / 'train-a.log'}")
            a_end = now
            scene.finish("a", now)
        if a_end is None:
            scene.read_reports("a")
        result = scene.cycle(now, scene.jobs)
        admitted = [a for a in result.admissions if a.job_key == scene.jobs["b"].key]
        if admitted:
            b_start = now
            scene.start("b", admitted[0], now, args)
            break
        wait = result.wait_for(scene.jobs["b"].key)
        a = scene.jobs["a"]
        left = remaining(a, now, run_time(a, {}), AdmissionConfig().min_remaining_s)
        silent = scene.cycle(now, {**scene.jobs, "a": replace(
            a, progress=None, progress_at=None, progress_detail=None)})
        silent_wait = silent.wait_for(scene.jobs["b"].key)
        detail = a.progress_detail
        sample = Sample(
            now - submitted, a.progress, detail.phase if detail else None,
            None if wait is None or wait.estimated_start is None
            else wait.estimated_start - submitted,
            now + left.low - submitted, now + left.high - submitted, left.reported,
            None if silent_wait is None or silent_wait.estimated_start is None
            else silent_wait.estimated_start - submitted)
        samples.append(sample)
        if len(samples) == 1 or len(samples) % args.print_every == 0:
            print(row(sample), flush=True)
        if now - t0 > args.timeout:
            raise SystemExit(f"B not started within {args.timeout:.0f} s")
        time.sleep(args.cycle)
    assert b_start is not None and a_end is not None
    if scene.procs["b"].wait() != 0:
        raise SystemExit(f"job B failed; see {out / 'train-b.log'}")
    actual = b_start - submitted
    print(f"A ended {a_end - submitted:.1f} s after B's submission; B admitted at "
          f"{actual:.1f} s (the next cycle); B ran {time.time() - b_start:.1f} s", flush=True)
    summary = summarize(samples, actual, a_end - submitted)
    print(table(summary), flush=True)
    workers = {n: last_json(out / f"train-{n}.log") for n in ("a", "b")}
    (out / "progress-gpu.json").write_text(json.dumps({
        "device": device, "gpu_model": model, "user_estimate_s": args.estimate,
        "b_submitted_after_a_s": submitted - t0, "a_end_s": a_end - submitted,
        "b_actual_start_s": actual, "workers": workers, "summary": summary,
        "samples": [s.__dict__ for s in samples]}, indent=1))
    print(f"written: {out / 'progress-gpu.json'}")
    return 0


def row(s: Sample) -> str:
    def num(v: float | None) -> str:
        return "–" if v is None else f"{v:.1f}"

    span = f"{num(s.a_end_low)}-{num(s.a_end_high)}" if s.reported else "–"
    progress = "–" if s.progress is None else f"{100 * s.progress:.1f} %"
    return (f"{s.at:6.1f} {progress:>10} {s.phase or '–':>10} {num(s.estimate):>12} "
            f"{span:>15} {num(s.without_reports):>11}")


def summarize(samples: list[Sample], actual: float, a_end: float
              ) -> list[dict[str, object]]:
    """B's estimate at its submission and when A had done about 10, 25, 50, 75 and 90 % of
    its work, each against B's actual start (error relative to B's whole wait), and whether
    A's end fell in the range given then (all times from B's submission)."""
    picked: list[tuple[str, Sample]] = [("submitted", samples[0])]
    for mark in (0.1, 0.25, 0.5, 0.75, 0.9):
        found = next((s for s in samples if s.progress is not None and s.progress >= mark), None)
        if found is not None:
            picked.append((f"A at {100 * mark:.0f} %", found))
    rows = []
    for label, s in picked:
        rows.append({
            "when": label, "at_s": round(s.at, 1),
            "progress": None if s.progress is None else round(s.progress, 3),
            "estimate_s": None if s.estimate is None else round(s.estimate, 1),
            "error_pct": None if s.estimate is None
            else round(100 * (s.estimate - actual) / actual, 1),
            "a_end_range_s": [round(s.a_end_low, 1), round(s.a_end_high, 1)]
            if s.reported and s.a_end_low is not None and s.a_end_high is not None else None,
            "a_end_in_range": s.a_end_low <= a_end <= s.a_end_high
            if s.reported and s.a_end_low is not None and s.a_end_high is not None else None,
            "without_reports_s": None if s.without_reports is None
            else round(s.without_reports, 1),
            "actual_s": round(actual, 1)})
    return rows


def table(summary: list[dict[str, object]]) -> str:
    lines = ["| when | t (s) | A's progress | B's estimated start (s) | error | "
             "A's end, 80 % range (s) | without reports (s) | B's actual start (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        progress = r["progress"]
        shown = "–" if not isinstance(progress, float) else f"{100 * progress:.1f} %"
        span = r["a_end_range_s"]
        span_text = f"{span[0]}–{span[1]}" if isinstance(span, list) else "–"
        error = r["error_pct"]
        lines.append(f"| {r['when']} | {r['at_s']} | {shown} | {r['estimate_s']} | "
                     f"{'–' if error is None else f'{error:+.1f} %'} | {span_text} | "
                     f"{r['without_reports_s']} | {r['actual_s']} |")
    return "\n".join(lines)


def last_json(path: Path) -> object:
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seconds", type=float, default=90.0,
                        help="job A's training at its first rate (default %(default)s)")
    parser.add_argument("--seconds-b", type=float, default=10.0, help="job B's training")
    parser.add_argument("--estimate", type=float, default=300.0,
                        help="both jobs' estimated duration, as their user wrote it")
    parser.add_argument("--b-after", type=float, default=5.0,
                        help="B is submitted this long after A starts")
    parser.add_argument("--cycle", type=float, default=1.0, help="seconds between cycles")
    parser.add_argument("--report-every", type=float, default=5.0,
                        help="seconds between progress reports, at most")
    parser.add_argument("--print-every", type=int, default=5, help="print every Nth cycle")
    parser.add_argument("--timeout", type=float, default=220.0)
    parser.add_argument("--out", type=Path, default=REPO / ".out" / "progress-gpu")
    parser.add_argument("--worker", choices=("a", "b"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run = workload.current()
        assert run.checkpoint_dir is not None
        return train(args.worker, args.device, args.seconds, args.report_every,
                     run.checkpoint_dir)
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
