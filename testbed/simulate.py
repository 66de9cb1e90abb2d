"""`carpool-testbed simulate`: offline replays of GPU traces on the repo's openb files.

`placement` replays a pod trace through the extender's scoring (FGD protocol): every (policy,
seed) replay — in worker processes when `--jobs` > 1 — and the median GPU allocation at 100 %
arrival and at the end. `queue` is the product's `carpool simulate queue` with the openb
trace and node list as its default files. The protocols and policies live in `carpool.core`
(`simulation`, `scoring`, `peers`); this module only reads files, fans out work and formats
numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.cli import simulator
from carpool.cli.simulator import policy_list, positive
from carpool.core import scoring
from carpool.core.workload import TargetWorkload
from carpool.replay import peers, simulation
from carpool_testbed.traces import DEFAULT_PODS, NODE_LIST, traces_dir

POLICIES = ("random", "best-fit", "dot-product", "fgd", "carpool")
PEER_POLICIES = tuple(peers.POLICIES)  # the GPU-sharing schedulers' (carpool.replay.peers)
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
    placement.add_argument("--seeds", type=positive, default=10, help="seeds 0..N-1 (10)")
    placement.add_argument("--policy", type=policy_list(ALL_POLICIES), default=list(POLICIES),
                           help=f"comma-separated, from {', '.join(ALL_POLICIES)} "
                                "(default: Carpool's and the published baselines)")
    placement.add_argument("--jobs", type=positive, default=min(2, os.cpu_count() or 1),
                           help="worker processes (2)")
    placement.set_defaults(run=run_placement)
    root = traces_dir()
    simulator.add_queue_parser(kinds, trace=root / DEFAULT_PODS, nodes=root / NODE_LIST)


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
