"""`carpool simulate queue`: the queue replay (`carpool.replay.queue_replay`) as a command.

It reads the trace and node list the user names, fans the policies out to worker processes
and formats the numbers; the replay, the policies and the scores live in the core. It needs
no cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from carpool.core.durations import format_duration_roughly, parse_duration
from carpool.core.lending import LendingPolicy
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, extender_placer
from carpool.replay import job_traces, queue_replay, sharing_replay, simulation

Scores = dict[str, object]
T = TypeVar("T")

DESCRIPTION = """\
Replay a job trace on a simulated clock through FIFO, Slurm-like (multifactor priority, EASY
backfill on user estimates), Kueue-like (BestEffortFIFO per project, cohort borrowing) and
Carpool queueing (the operator's own admission cycle), all placing through the extender's GPU
choice, and score waits per class, GPU utilization, preemptions, GPU-hours per project and
the error of estimated starts.

The trace is in the openb pod columns: creation_time, scheduled_time and deletion_time give
arrivals and run times; num_gpu, gpu_milli and gpu_spec the GPU shape. The node list is in the
openb node columns. Projects, classes and user estimates come from a seeded generator.
"""


class InputError(Exception):
    """Bad input to show the user as one line, exit status 2."""


@dataclass(frozen=True)
class QueueRun:
    """One policy's replay inputs (file contents, so a worker process needs no files)."""

    nodes_csv: str
    trace_csv: str
    scale: float
    seed: int
    projects: int
    policy: str
    limit: int | None
    quotas: str = "open"
    arrival_window_s: float = 3600.0
    progress_share: float = 0.0
    over_requests: bool = False  # jobs use less than they ask (replay.usage_traces)
    lending: bool = False  # Carpool lends unused grants (core.lending)
    right_sizing: bool = False  # Carpool places preemptible jobs by calibrated size
    idle_timeout_s: float = 0.0  # every project's idleSessions.timeout (0: none)
    lend_whole_gpus: bool = False  # whole-GPU owners lend too (LendingPolicy.whole_gpus)
    # with right_sizing, one-GPU whole-GPU jobs too, as MPS shares (rightSizing.shareWholeGpus)
    share_whole_gpus: bool = False
    idle_yield_after_s: float = 0.0  # every project's idleSessions.yieldAfter (0: none)

    @property
    def idle(self) -> queue_replay.IdleCapacity | None:
        if not (self.over_requests or self.lending or self.right_sizing or self.idle_timeout_s
                or self.idle_yield_after_s):
            return None
        carpool = self.policy == "carpool"
        return queue_replay.IdleCapacity(
            self.seed, LendingPolicy(whole_gpus=self.lend_whole_gpus)
            if self.lending and carpool else None,
            self.right_sizing and carpool, self.idle_timeout_s if carpool else 0.0,
            self.right_sizing and self.share_whole_gpus and carpool,
            self.idle_yield_after_s if carpool else 0.0)


def queue_policy(name: str, arrival_window_s: float = 3600.0,
                 lending: LendingPolicy | None = None) -> queue_replay.Policy:
    placer = extender_placer()
    if name == "carpool":
        return queue_replay.carpool_policy(AdmissionConfig(
            node_placer=placer, arrival_window_s=arrival_window_s, lending=lending))
    if name == "fifo":
        return queue_replay.fifo_policy(placer)
    if name == "slurm":
        return queue_replay.slurm_policy(placer)
    return queue_replay.kueue_policy(placer)


def replay_queue(run: QueueRun) -> tuple[Scores, float]:
    """One policy's scores and the CPU seconds its replay took."""
    rows = job_traces.parse_trace(run.trace_csv).rows
    if run.limit:
        rows = rows[:run.limit]
    jobs = job_traces.annotate(rows, run.seed, run.projects)
    nodes = scaled_nodes(run.nodes_csv, run.scale)
    quotas = (queue_replay.share_quotas(jobs, nodes) if run.quotas == "shares"
              else queue_replay.open_quotas(jobs))
    started = time.process_time()
    idle = run.idle
    policy = queue_policy(run.policy, run.arrival_window_s,
                          idle.lending if idle is not None else None)
    outcome = queue_replay.replay(jobs, nodes, quotas, policy, run.policy,
                                  progress_share=run.progress_share, progress_seed=run.seed,
                                  idle=idle)
    return queue_replay.score(outcome), time.process_time() - started


def scaled_nodes(nodes_csv: str, scale: float) -> dict[str, NodeState]:
    return queue_replay.trace_nodes(((n.name, n.gpus, n.model)
                                     for n in simulation.parse_nodes_csv(nodes_csv)), scale)


def replay_policies(runs: Sequence[QueueRun], jobs: int,
                    finished: Callable[[QueueRun, float], None]) -> list[tuple[Scores, float]]:
    """Every run's scores in input order; `jobs` worker processes (1: in this process).
    `finished` hears of each run as it ends (in the order they end)."""
    if jobs <= 1 or len(runs) <= 1:
        results = []
        for run in runs:
            results.append(replay_queue(run))
            finished(run, results[-1][1])
        return results
    with ProcessPoolExecutor(max_workers=min(jobs, len(runs))) as pool:
        futures: dict[Future[tuple[Scores, float]], QueueRun] = {
            pool.submit(replay_queue, run): run for run in runs}
        try:
            for future in as_completed(futures):
                finished(futures[future], future.result()[1])
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [future.result() for future in futures]


# ---------------------------------------------------------------- command line


def policy_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of policies among `choices`."""

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [p for p in names if p not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown policy {', '.join(unknown) or text!r}; choose from "
                f"{', '.join(choices)}")
        return names

    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _number_where(holds: Callable[[float], bool], requirement: str
                  ) -> Callable[[str], float]:
    """An argparse type for a finite number that `holds`; else "'text' `requirement`"."""

    def parse(text: str) -> float:
        value = _number(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"{text!r} {requirement}")
        return value

    return parse


fraction = _number_where(lambda v: 0 < v <= 1, "must be in (0, 1]")
share = _number_where(lambda v: 0 <= v <= 1, "must be in [0, 1]")
load = _number_where(lambda v: 0 < v <= 4, "must be in (0, 4]")
_positive_seconds = _number_where(lambda v: v > 0, "must be more than 0")
_seconds = _number_where(lambda v: v >= 0, "must be at least 0")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {least}")
    return value


def non_negative(text: str) -> int:
    return positive(text, least=0)


def add_queue_parser(kinds: Any, trace: Path | None = None,
                     nodes: Path | None = None) -> argparse.ArgumentParser:
    """The `queue` sub-command under `kinds` (an argparse sub-parsers object). `trace` and
    `nodes`: default files, else the user must name them."""
    queue: argparse.ArgumentParser = kinds.add_parser(
        "queue", help="replay a job trace through FIFO, Slurm-like, Kueue-like and Carpool "
                      "queueing; waits, utilization and estimated-start errors",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    queue.add_argument("--trace", "--pods", dest="trace", type=Path, required=trace is None,
                       default=trace, metavar="CSV",
                       help="pod trace in the openb columns (name, cpu_milli, memory_mib, "
                            "num_gpu, gpu_milli, gpu_spec, qos, creation_time, deletion_time, "
                            "scheduled_time)" + (f" (default: {trace})" if trace else ""))
    queue.add_argument("--nodes", type=Path, required=nodes is None, default=nodes,
                       metavar="CSV",
                       help="node list in the openb columns (sn, cpu_milli, memory_mib, gpu, "
                            "model)" + (f" (default: {nodes})" if nodes else ""))
    queue.add_argument("--scale", type=fraction, default=0.008,
                       help="keep this share of each GPU model's nodes, so queues form (0.008: "
                            "63 of openb's 6,212 GPUs)")
    queue.add_argument("--generate", type=positive, metavar="JOBS",
                       help="replay a generated trace of JOBS jobs (shapes drawn from --trace) "
                            "instead of --trace itself")
    queue.add_argument("--interarrival", type=_positive_seconds, default=300.0,
                       help="mean seconds between generated arrivals (300)")
    queue.add_argument("--load", type=load, metavar="SHARE",
                       help="space generated arrivals so their work keeps this share of the "
                            "(scaled) cluster's GPUs busy on average, as asked (above 1: more "
                            "than the cluster holds); overrides --interarrival")
    queue.add_argument("--load-by-last-arrival", action="store_true",
                       help="with --load, count only the work that falls before the last "
                            "arrival had every job started on arrival (the window the idle-"
                            "capacity WORK column measures)")
    queue.add_argument("--write-trace", type=Path,
                       help="also write the replayed trace (openb columns) here")
    queue.add_argument("--limit", type=positive, help="replay only the first N jobs")
    queue.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    queue.add_argument("--projects", type=positive, default=4, help="projects (4)")
    queue.add_argument("--quotas", choices=("open", "shares"), default="open",
                       help="open: no guarantees, equal weights (default); shares: each "
                            "project guaranteed its share of the trace's GPU-hours, borrowing "
                            "on (Carpool: only preemptible jobs borrow)")
    queue.add_argument("--policy", type=policy_list(queue_replay.POLICIES),
                       default=list(queue_replay.POLICIES),
                       help=f"comma-separated, from {', '.join(queue_replay.POLICIES)} (all)")
    queue.add_argument("--jobs", type=positive, default=min(2, os.cpu_count() or 1),
                       help="worker processes (2)")
    queue.add_argument("--arrival-window", type=_seconds, default=3600.0, metavar="SECONDS",
                       help="Carpool: higher-class arrivals within this window widen the "
                            "end of lower classes' ranges (3600, the operator's default; "
                            "0: off)")
    queue.add_argument("--progress-share", type=share, default=0.0, metavar="SHARE",
                       help="this share of the jobs (drawn from --seed) report their progress "
                            "as they run, with rate changes, evaluation pauses, checkpoint "
                            "saves and restarts (0: none, the default; 0.5: half)")
    queue.add_argument("--over-requests", action="store_true",
                       help="jobs use less of their GPU share than they ask, some rising late "
                            "(drawn from --seed; see docs/benchmarks.md); adds work done, owner "
                            "waits and lending columns")
    queue.add_argument("--lending", action="store_true",
                       help="Carpool lends running jobs' unused shares to preemptible MPS "
                            "jobs, reclaiming them when the owner's use rises "
                            "(implies --over-requests)")
    queue.add_argument("--right-sizing", action="store_true",
                       help="Carpool places preemptible jobs by the peaks their template's "
                            "finished runs reached (implies --over-requests)")
    queue.add_argument("--lend-whole-gpus", action="store_true",
                       help="with --lending, whole-GPU (exclusive) owners lend too; their "
                            "borrowers share the GPU's time (lending.wholeGpus)")
    queue.add_argument("--share-whole-gpus", action="store_true",
                       help="with --right-sizing, preemptible one-GPU whole-GPU jobs are "
                            "placed as MPS shares of their calibrated size, and may borrow "
                            "(rightSizing.shareWholeGpus)")
    queue.add_argument("--idle-timeout", type=_duration, default=0.0, metavar="DURATION",
                       help="Carpool stops interactive sessions idle this long, every "
                            "project's idleSessions.timeout, e.g. 30m (implies "
                            "--over-requests, which makes sessions go idle; default: never)")
    queue.add_argument("--idle-yield-after", type=_duration, default=0.0, metavar="DURATION",
                       help="Carpool stops interactive sessions idle this long while jobs "
                            "wait that their GPUs could serve, every project's "
                            "idleSessions.yieldAfter, e.g. 5m (implies --over-requests; "
                            "default: only the timeout)")
    queue.add_argument("-o", "--output", choices=("table", "json"), default="table",
                       help="table (default) or one JSON object per policy, one a line")
    queue.set_defaults(run=run_queue, prog=queue.prog)
    return queue


def add_sharing_parser(kinds: Any) -> argparse.ArgumentParser:
    """The `sharing` sub-command: latency objectives against fixed sharing degrees."""
    sharing: argparse.ArgumentParser = kinds.add_parser(
        "sharing", help="replay latency-sensitive services and batch jobs on shared GPUs: "
                        "Carpool's sharing limits (with pairs of templates, and by weight "
                        "only) against fixed degrees 1-6",
        description=sharing_replay.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sharing.add_argument("--generate", type=positive, default=400, metavar="JOBS",
                         help="jobs in the generated trace (400)")
    sharing.add_argument("--gpus", type=positive, default=16, help="GPUs in the cluster (16)")
    sharing.add_argument("--interarrival", type=_positive_seconds, default=120.0,
                         help="mean seconds between arrivals (120)")
    sharing.add_argument("--services", type=share, default=0.5, metavar="SHARE",
                         help="share of the jobs that are latency-sensitive services (0.5)")
    sharing.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    sharing.add_argument("--profile-degrees", type=non_negative, default=0, metavar="N",
                         help="Carpool first profiles each template alone and with copies, "
                              "up to N jobs a GPU, and each pair of templates once (0: it "
                              "learns from the trace alone)")
    sharing.add_argument("--policy", type=policy_list(sharing_replay.POLICIES),
                         default=list(sharing_replay.POLICIES),
                         help=f"comma-separated, from {', '.join(sharing_replay.POLICIES)} (all)")
    sharing.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sharing.set_defaults(run=run_sharing, prog=sharing.prog)
    return sharing


def run_sharing(args: argparse.Namespace) -> int:
    trace = sharing_replay.generate(args.generate, args.seed, args.interarrival, args.services)
    started = time.perf_counter()
    scores = [sharing_replay.replay(trace, args.gpus, p, args.seed, args.profile_degrees)
              for p in args.policy]
    elapsed = time.perf_counter() - started
    if args.output == "json":
        for item in scores:
            print(json.dumps(dataclasses.asdict(item), sort_keys=True))
        return 0
    services = sum(1 for j in trace if j.p99_target_s is not None)
    print(f"{len(trace)} generated jobs ({services} services with P99 targets, "
          f"{len(trace) - services} batch), {args.gpus} GPUs, mean interarrival "
          f"{args.interarrival:g} s, seed {args.seed}, "
          + (f"Carpool profiled at 1-{args.profile_degrees} jobs first, "
             if args.profile_degrees else "") + f"{elapsed:.1f} s")
    print(format_sharing_table(scores))
    return 0


def format_sharing_table(scores: Sequence[sharing_replay.Scores]) -> str:
    """One line per policy: objective violations (and of those, the minutes of services placed
    before their template had a profile, and the others' beside a neighbour no pair was
    measured for), work per hour, waits, GPUs in use, and the pairs of templates learned."""
    width = max(8, *(len(s.policy) for s in scores))
    header = (f"{'POLICY':<{width}} {'VIOLATED':>8} {'BEFORE PROFILE':>14} {'NO PAIR':>7} "
              f"{'WORK/H':>7} {'FINISHED':>8} {'SERVICE WAIT':>12} {'BATCH WAIT':>10} "
              f"{'PEAK GPUS':>9} {'PAIRS':>5}")
    lines = [header]
    for s in scores:
        lines.append(
            f"{s.policy:<{width}} {100 * s.violation_share:>7.1f}% "
            f"{s.violation_minutes_unprofiled:>14} {s.violation_minutes_unpaired:>7} "
            f"{s.work_per_hour:>7.1f} {s.finished:>4}/{s.jobs:<3} "
            f"{_secs(s.mean_wait_service_s):>12} {_secs(s.mean_wait_batch_s):>10} "
            f"{s.peak_gpus_busy:>9} {s.pairs:>5}")
    return "\n".join(lines)


def register(commands: Any) -> None:
    """Add `simulate queue` and `simulate sharing` to a command's sub-commands."""
    simulate = commands.add_parser("simulate", help="offline replays of job traces",
                                   description="Offline replays of job traces; no cluster.")
    kinds = simulate.add_subparsers(dest="kind", required=True)
    add_queue_parser(kinds)
    add_sharing_parser(kinds)


def _read(path: Path) -> str:
    if not path.exists():
        raise InputError(f"no such file: {path}")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}") from None


def _parse(path: Path, parse: Callable[[str], T], text: str) -> T:
    try:
        return parse(text)
    except ValueError as error:
        raise InputError(f"{path}: {error}") from None


def run_queue(args: argparse.Namespace) -> int:
    prog: str = getattr(args, "prog", "carpool simulate queue")
    try:
        nodes_csv = _read(args.nodes)
        trace_csv = _read(args.trace)
        nodes = _parse(args.nodes, lambda t: scaled_nodes(t, args.scale), nodes_csv)
        parsed = _parse(args.trace, job_traces.parse_trace, trace_csv)
        if args.generate:
            busy = args.load * queue_replay.capacity_gpus(nodes) if args.load else None
            try:
                trace_csv = job_traces.generate(
                    parsed.rows, args.generate, args.seed, args.interarrival, busy_gpus=busy,
                    load_by_last_arrival=args.load_by_last_arrival)
            except ValueError as error:
                raise InputError(f"--load {args.load}: {error}") from None
            parsed = job_traces.parse_trace(trace_csv)
        if args.write_trace:
            try:
                args.write_trace.write_text(trace_csv)
            except OSError as error:
                raise InputError(f"cannot write {args.write_trace}: {error}") from None
        runs = [QueueRun(nodes_csv, trace_csv, args.scale, args.seed, args.projects, policy,
                         args.limit, args.quotas, args.arrival_window, args.progress_share,
                         args.over_requests, args.lending, args.right_sizing,
                         args.idle_timeout, args.lend_whole_gpus, args.share_whole_gpus,
                         args.idle_yield_after)
                for policy in args.policy]
        started = time.perf_counter()
        done = 0

        def finished(run: QueueRun, cpu: float) -> None:
            nonlocal done
            done += 1
            print(f"{prog}: {run.policy} replayed ({done} of {len(runs)}, {cpu:.1f} CPU s)",
                  file=sys.stderr, flush=True)

        results = replay_policies(runs, args.jobs, finished)
    except (InputError, ValueError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    scores = [dict(s, cpu_seconds=round(cpu, 2)) for s, cpu in results]
    if args.output == "json":
        for item in scores:
            print(json.dumps(item, sort_keys=True))
        return 0
    source = f"{args.generate} generated jobs" if args.generate else args.trace.name
    reporting = (f", {args.progress_share:.0%} reporting progress" if args.progress_share
                 else "")
    print(f"{source}: {len(parsed.rows)} GPU jobs ({parsed.unscheduled} never scheduled and "
          f"{parsed.cpu_only} CPU-only skipped), scale {args.scale}, seed {args.seed}"
          f"{reporting}, {elapsed:.1f} s")
    print(format_queue_table(scores))
    if any("work_gpu_hours_by_last_arrival" in s for s in scores):
        print(format_idle_table(scores))
    return 0


def _pct(value: object) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, float) else "-"


def _secs(value: object) -> str:
    return format_duration_roughly(value) if isinstance(value, (int, float)) else "-"


def format_queue_table(scores: Sequence[dict[str, Any]]) -> str:
    """One line per policy: ETA errors and coverage, waits per class, utilization."""
    header = (f"{'POLICY':<8} {'ETA ERR':>7} {'P90':>6} {'REFRESH':>7} {'IN 80%':>6} "
              f"{'WAITED':>6} {'INTER P99':>9} {'SHORT P99':>9} {'BATCH P50':>9} "
              f"{'UTIL':>5} {'PREEMPT':>7} {'CPU S':>6}")
    lines = [header]
    for s in scores:
        p50, p99 = s["wait_p50_s"], s["wait_p99_s"]
        lines.append(
            f"{s['policy']:<8} {_pct(s['eta_median_abs_rel_error']):>7} "
            f"{_pct(s['eta_p90_abs_rel_error']):>6} "
            f"{_pct(s['eta_refreshed_median_abs_rel_error']):>7} "
            f"{_pct(s['eta_interval_coverage']):>6} {s['jobs_waited_60s']:>6} "
            f"{_secs(p99.get('interactive')):>9} {_secs(p99.get('short')):>9} "
            f"{_secs(p50.get('batch')):>9} {_pct(s['gpu_utilization']):>5} "
            f"{s['preemptions']:>7} {s['cpu_seconds']:>6.1f}")
    return "\n".join(lines)


def format_idle_table(scores: Sequence[dict[str, Any]]) -> str:
    """One line per policy: work done while the trace arrives, owners' waits, lending, idle
    sessions stopped."""
    header = (f"{'POLICY':<8} {'WORK GPU-H':>10} {'OWNER P50':>9} {'OWNER P99':>9} "
              f"{'LENT GPU-H':>10} {'RECLAIMS':>8} {'RECLAIM P99':>11} {'OUTGROWN':>8} "
              f"{'IDLE STOPPED':>12}")
    lines = [header]
    for s in scores:
        lines.append(
            f"{s['policy']:<8} {s['work_gpu_hours_by_last_arrival']:>10.1f} "
            f"{_secs(s['owner_wait_p50_s']):>9} {_secs(s['owner_wait_p99_s']):>9} "
            f"{s['lent_gpu_hours']:>10.1f} {s['owner_reclaims']:>8} "
            f"{_secs(s['owner_reclaim_p99_s']):>11} {s['right_sized_runs_outgrown']:>8} "
            f"{s['idle_sessions_stopped']:>12}")
    return "\n".join(lines)
