"""`carpool-testbed simulate`: offline replays of GPU traces.

`placement` replays a pod trace through the extender's scoring (FGD protocol): every (policy,
seed) replay — in worker processes when `--jobs` > 1 — and the median GPU allocation at 100 %
arrival and at the end. `queue` replays a job trace (arrivals, run times, shapes, with
projects, classes and user estimates from a seeded generator) through queueing policies side
by side — the operator's own admission cycle among them — and scores waits and estimated
starts. The protocols and policies live in `carpool.core` (`simulation`, `scoring`, `peers`,
`job_traces`, `queue_replay`); this module only reads files, fans out work and formats numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.core import job_traces, peers, queue_replay, scoring, simulation
from carpool.core.queueing import AdmissionConfig, extender_placer
from carpool.core.workload import TargetWorkload
from carpool_testbed.traces import DEFAULT_PODS, NODE_LIST, traces_dir

POLICIES = ("random", "best-fit", "dot-product", "fgd", "carpool")
PEER_POLICIES = tuple(peers.POLICIES)  # the GPU-sharing schedulers' (carpool.core.peers)
ALL_POLICIES = POLICIES + PEER_POLICIES


@dataclass(frozen=True)
class Run:
    """One replay's inputs (paths, so worker processes parse and cache them themselves)."""

    nodes_csv: str
    pods_csv: str
    policy: str
    seed: int


@dataclass(frozen=True)
class Outcome:
    run: Run
    result: simulation.ReplayResult
    cpu_seconds: float


_PARSED: dict[str, Any] = {}


def _load(run: Run) -> tuple[list[simulation.TraceNode], list[simulation.TracePod],
                             TargetWorkload]:
    key = f"{run.nodes_csv}\0{run.pods_csv}"
    if key not in _PARSED:
        nodes = simulation.parse_nodes_csv(Path(run.nodes_csv).read_text())
        pods = simulation.parse_pods_csv(Path(run.pods_csv).read_text())
        _PARSED[key] = (nodes, pods, simulation.target_workload(pods))
    loaded: tuple[list[simulation.TraceNode], list[simulation.TracePod],
                  TargetWorkload] = _PARSED[key]
    return loaded


def replay_one(run: Run) -> Outcome:
    """Parse (cached per process), build the seed's arrival sequence, replay, time it."""
    nodes, pods, workload = _load(run)
    started = time.process_time()
    sequence = simulation.arrivals(pods, run.seed, simulation.capacity_milli(nodes))
    scorer: simulation.Planner | None
    if run.policy == simulation.RANDOM_POLICY:
        scorer = None
    elif run.policy in peers.POLICIES:
        scorer = peers.PeerPlanner(run.policy)
    else:
        scorer = scoring.Scorer(scoring.PRESETS[run.policy], workload,
                                simulation.gpu_supply(nodes))
    result = simulation.replay(nodes, sequence, scorer, seed=run.seed)
    return Outcome(run, result, time.process_time() - started)


def replay_all(runs: Sequence[Run], jobs: int) -> list[Outcome]:
    """Every run, in input order; `jobs` worker processes (1: in this process)."""
    if jobs <= 1 or len(runs) <= 1:
        return [replay_one(r) for r in runs]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(replay_one, runs, chunksize=1))


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in ALL_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or text!r}; "
            f"choose from {', '.join(ALL_POLICIES)}")
    return names


def parse_queue_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in queue_replay.POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or text!r}; choose from "
            f"{', '.join(queue_replay.POLICIES)}")
    return names


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def register(commands: Any) -> None:
    """Add `simulate placement` and `simulate queue` to `carpool-testbed`'s sub-commands."""
    simulate = commands.add_parser("simulate", help="offline replays of placement and queueing",
                                   description=__doc__)
    kinds = simulate.add_subparsers(dest="kind", required=True)
    placement = kinds.add_parser(
        "placement", help="replay a pod trace onto a node list (FGD paper's protocol)",
        description="Median GPU allocation over seeds at 100 % arrival and at the end "
                    "(130 % of capacity requested).")
    placement.add_argument("--nodes", type=Path,
                           help=f"node CSV (default: the openb folder's {NODE_LIST})")
    placement.add_argument("--pods", type=Path,
                           help=f"pod CSV (default: the openb folder's {DEFAULT_PODS})")
    placement.add_argument("--seeds", type=_positive, default=10, help="seeds 0..N-1 (10)")
    placement.add_argument("--policy", type=parse_policies, default=list(POLICIES),
                           help=f"comma-separated, from {', '.join(ALL_POLICIES)} "
                                "(default: Carpool's and the published baselines)")
    placement.add_argument("--jobs", type=_positive, default=min(2, os.cpu_count() or 1),
                           help="worker processes (2)")
    placement.set_defaults(run=run_placement)
    queue = kinds.add_parser(
        "queue", help="replay a job trace through FIFO, Slurm-like, Kueue-like and Carpool "
                      "queueing; waits, utilization and estimated-start errors",
        description="Discrete-event replay of a trace in the openb pod columns "
                    "(creation_time, scheduled_time, deletion_time give arrivals and run times); "
                    "projects, classes and user estimates come from a seeded generator "
                    "(carpool.core.job_traces). Carpool's policy is the operator's own admission "
                    "cycle.")
    queue.add_argument("--pods", type=Path,
                       help=f"trace CSV (default: the openb folder's {DEFAULT_PODS})")
    queue.add_argument("--nodes", type=Path,
                       help=f"node CSV (default: the openb folder's {NODE_LIST})")
    queue.add_argument("--scale", type=_fraction, default=0.008,
                       help="keep this share of each GPU model's nodes, so queues form (0.008: "
                            "63 of openb's 6,212 GPUs)")
    queue.add_argument("--generate", type=_positive, metavar="JOBS",
                       help="replay a generated trace of JOBS jobs (shapes drawn from --pods) "
                            "instead of --pods itself")
    queue.add_argument("--interarrival", type=float, default=300.0,
                       help="mean seconds between generated arrivals (300)")
    queue.add_argument("--load", type=_fraction, metavar="SHARE",
                       help="space generated arrivals so their work keeps this share of the "
                            "(scaled) cluster's GPUs busy on average; overrides --interarrival")
    queue.add_argument("--write-trace", type=Path,
                       help="also write the replayed trace (openb columns) here")
    queue.add_argument("--limit", type=_positive, help="replay only the first N jobs")
    queue.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    queue.add_argument("--projects", type=_positive, default=4, help="projects (4)")
    queue.add_argument("--quotas", choices=("open", "shares"), default="open",
                       help="open: no guarantees, equal weights (default); shares: each "
                            "project guaranteed its share of the trace's GPU-hours, borrowing "
                            "on (Carpool: only preemptible jobs borrow)")
    queue.add_argument("--policy", type=parse_queue_policies,
                       default=list(queue_replay.POLICIES),
                       help=f"comma-separated, from {', '.join(queue_replay.POLICIES)} (all)")
    queue.add_argument("--jobs", type=_positive, default=min(2, os.cpu_count() or 1),
                       help="worker processes (2)")
    queue.add_argument("--arrival-window", type=float, default=0.0, metavar="SECONDS",
                       help="Carpool: stretch estimates by higher-class arrivals over this "
                            "window (0: off, the operator's default)")
    queue.add_argument("-o", "--output", choices=("table", "json"), default="table")
    queue.set_defaults(run=run_queue)


def run_placement(args: argparse.Namespace) -> int:
    root = traces_dir()
    nodes_csv: Path = args.nodes or root / NODE_LIST
    pods_csv: Path = args.pods or root / DEFAULT_PODS
    for path in (nodes_csv, pods_csv):
        if not path.is_file():
            print(f"carpool-testbed simulate placement: no such file: {path}", file=sys.stderr)
            return 2
    runs = [Run(str(nodes_csv), str(pods_csv), policy, seed)
            for policy in args.policy for seed in range(args.seeds)]
    started = time.perf_counter()
    try:
        outcomes = replay_all(runs, args.jobs)
    except ValueError as error:
        print(f"carpool-testbed simulate placement: {error}", file=sys.stderr)
        return 2
    print(f"{pods_csv.name} on {nodes_csv.name}, {args.seeds} seeds, "
          f"{time.perf_counter() - started:.1f} s")
    print(f"{'POLICY':<12} {'AT 100%':>8} {'AT END':>8} {'PLACED':>7} {'DROPPED':>8} "
          f"{'CPU S/RUN':>9}")
    for policy in args.policy:
        mine = [o for o in outcomes if o.run.policy == policy]
        summary = simulation.summarize(policy, [o.result for o in mine])
        placed = sorted(o.result.placed for o in mine)[len(mine) // 2]
        dropped = sorted(o.result.dropped for o in mine)[len(mine) // 2]
        cpu = sum(o.cpu_seconds for o in mine) / len(mine)
        print(f"{policy:<12} {100 * summary.median_at_full:>7.2f}% "
              f"{100 * summary.median_at_end:>7.2f}% {placed:>7} {dropped:>8} {cpu:>9.2f}")
    return 0


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
    arrival_window_s: float = 0.0


def queue_policy(name: str, arrival_window_s: float = 0.0) -> queue_replay.Policy:
    placer = extender_placer()
    if name == "carpool":
        return queue_replay.carpool_policy(AdmissionConfig(
            node_placer=placer, arrival_window_s=arrival_window_s))
    if name == "fifo":
        return queue_replay.fifo_policy(placer)
    if name == "slurm":
        return queue_replay.slurm_policy(placer)
    return queue_replay.kueue_policy(placer)


def replay_queue(run: QueueRun) -> tuple[dict[str, object], float]:
    """One policy's scores and the CPU seconds its replay took."""
    rows = job_traces.parse_trace(run.trace_csv).rows
    if run.limit:
        rows = rows[:run.limit]
    jobs = job_traces.annotate(rows, run.seed, run.projects)
    nodes = queue_replay.trace_nodes(((n.name, n.gpus, n.model)
                                      for n in simulation.parse_nodes_csv(run.nodes_csv)),
                                     run.scale)
    quotas = (queue_replay.share_quotas(jobs, nodes) if run.quotas == "shares"
              else queue_replay.open_quotas(jobs))
    started = time.process_time()
    policy = queue_policy(run.policy, run.arrival_window_s)
    outcome = queue_replay.replay(jobs, nodes, quotas, policy, run.policy)
    return queue_replay.score(outcome), time.process_time() - started


def run_queue(args: argparse.Namespace) -> int:
    root = traces_dir()
    nodes_csv: Path = args.nodes or root / NODE_LIST
    pods_csv: Path = args.pods or root / DEFAULT_PODS
    for path in (nodes_csv, pods_csv):
        if not path.is_file():
            print(f"carpool simulate queue: no such file: {path}", file=sys.stderr)
            return 2
    try:
        trace_text = pods_csv.read_text()
        parsed = job_traces.parse_trace(trace_text)
        if args.generate:
            busy = None
            if args.load:
                nodes = queue_replay.trace_nodes(
                    ((n.name, n.gpus, n.model)
                     for n in simulation.parse_nodes_csv(nodes_csv.read_text())), args.scale)
                busy = args.load * queue_replay.capacity_gpus(nodes)
            trace_text = job_traces.generate(parsed.rows, args.generate, args.seed,
                                             args.interarrival, busy_gpus=busy)
            parsed = job_traces.parse_trace(trace_text)
        if args.write_trace:
            args.write_trace.write_text(trace_text)
        runs = [QueueRun(nodes_csv.read_text(), trace_text, args.scale, args.seed,
                         args.projects, policy, args.limit, args.quotas, args.arrival_window)
                for policy in args.policy]
        started = time.perf_counter()
        if args.jobs <= 1 or len(runs) <= 1:
            results = [replay_queue(r) for r in runs]
        else:
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                results = list(pool.map(replay_queue, runs, chunksize=1))
    except ValueError as error:
        print(f"carpool simulate queue: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    scores = [dict(s, cpu_seconds=round(cpu, 2)) for s, cpu in results]
    if args.output == "json":
        for item in scores:
            print(json.dumps(item, sort_keys=True))
        return 0
    source = f"{args.generate} generated jobs" if args.generate else pods_csv.name
    print(f"{source}: {len(parsed.rows)} GPU jobs ({parsed.unscheduled} never scheduled and "
          f"{parsed.cpu_only} CPU-only skipped), scale {args.scale}, seed {args.seed}, "
          f"{elapsed:.1f} s")
    print(format_queue_table(scores))
    return 0


def _pct(value: object) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, float) else "-"


def _secs(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value / 3600:.1f}h" if value >= 3600 else f"{value:.0f}s"


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
