"""Where the GPU capacity goes in the idle-capacity replay (`bench/idle_capacity.py`): for one
setting (everything on by default), each trace's GPU-hours up to its last arrival (the window
work is measured in) split by what held them, and the work that waited meanwhile.

Per GPU and instant, after each cycle's decisions: the part running jobs use (owners,
preemptible jobs in ordinary room, borrowers in lent room); what idle interactive sessions
hold; what jobs were granted and do not use, by cause (not lent yet: the owner has not run
`LendingPolicy.observed_s` and its template has no calibrated size; the headroom an owner
keeps above its peak; the rest of a borrower's own grant); lent and not borrowed; free while
jobs wait (too small for the smallest waiting job, or not) and free while nothing waits; and
stopping jobs' graces. Use is the replay's drawn use (`usage_traces`) of the request's share.

    .venv/bin/python bench/idle_breakdown.py [--seeds 7,8,9,11] [--jobs-per-trace 500]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from carpool.cli.simulator import QueueRun, queue_policy, scaled_nodes
from carpool.core.durations import parse_duration
from carpool.core.fairshare import nominal_fraction
from carpool.core.resources import Isolation, Phase
from carpool.replay import job_traces, queue_replay

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces/openb/openb_pod_list_default.csv"
NODES = ROOT / "traces/openb/openb_node_list_gpu_node.csv"
Tally = defaultdict[str, float]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs-per-trace", type=int, default=500)
    parser.add_argument("--load", type=float, default=2.0)
    parser.add_argument("--seeds", default="7,8,9,11")
    parser.add_argument("--scale", type=float, default=0.006)
    parser.add_argument("--idle-timeout", type=parse_duration, default="30m")
    parser.add_argument("--idle-yield-after", type=parse_duration, default="0s",
                        help="idleSessions.yieldAfter (default: none)")
    args = parser.parse_args()
    nodes_csv, shapes = NODES.read_text(), job_traces.parse_trace(TRACE.read_text()).rows
    capacity = queue_replay.capacity_gpus(scaled_nodes(nodes_csv, args.scale))
    for seed in (int(s) for s in args.seeds.split(",")):
        trace = job_traces.generate(shapes, args.jobs_per_trace, seed, 300.0,
                                    busy_gpus=args.load * capacity, load_by_last_arrival=True)
        run = QueueRun(nodes_csv, trace, args.scale, seed, 4, "carpool", None,
                       over_requests=True, lending=True, right_sizing=True,
                       lend_whole_gpus=True, idle_timeout_s=args.idle_timeout,
                       idle_yield_after_s=args.idle_yield_after)
        held, waited, window = breakdown(run)
        total = sum(held.values())
        print(f"seed {seed}: {window / 3600:.2f} h to the last arrival, {capacity} GPUs, "
              f"{total / 3600:.1f} GPU-h")
        print("| where | GPU-h | share |\n|---|---:|---:|")
        for name, seconds in sorted(held.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {seconds / 3600:.1f} | {seconds / total:.0%} |")
        print("waiting meanwhile (GPU-h, by the requests' shares): " + ", ".join(
            f"{name} {seconds / 3600:.1f}"
            for name, seconds in sorted(waited.items(), key=lambda kv: -kv[1])))
    return 0


def breakdown(run: QueueRun) -> tuple[Tally, Tally, float]:
    """GPU-seconds by what held them, and waiting demand by kind, up to the last arrival."""
    jobs = job_traces.annotate(job_traces.parse_trace(run.trace_csv).rows, run.seed,
                               run.projects)
    nodes = scaled_nodes(run.nodes_csv, run.scale)
    idle = run.idle
    assert idle is not None and idle.lending is not None
    replay = queue_replay.Replay(jobs, nodes, queue_replay.open_quotas(jobs),
                                 queue_policy("carpool", run.arrival_window_s, idle.lending),
                                 "carpool", idle=idle)
    first, horizon = min(j.arrival for j in jobs), max(j.arrival for j in jobs)
    held: Tally = defaultdict(float)
    waited: Tally = defaultdict(float)
    while replay.step():
        now = replay.state.now
        until = min(replay.events[0][0] if replay.events else now, horizon)
        if until > now:
            _tally(replay, until - now, idle.lending.observed_s, held, waited)
        if now >= horizon:
            break
    return held, waited, horizon - first


def _tally(replay: queue_replay.Replay, dt: float, observed_s: float, held: Tally,
           waited: Tally) -> None:
    state = replay.state
    per_gpu: dict[str, Tally] = {}
    smallest = 101
    for key, job in state.jobs.items():
        asked = replay.trace[key].request
        if job.waiting:
            kind = ("preemptible " if job.preemptible else "owner ") + (
                "whole GPU" if asked.isolation is Isolation.EXCLUSIVE else "MPS")
            waited[kind] += dt * nominal_fraction(asked, replay.reference)
            smallest = min(smallest, 100 if job.request.isolation is Isolation.EXCLUSIVE
                           else job.request.cores_pct)
            continue
        run = job.current_run
        if not job.grants or run is None:
            continue
        use = replay.usage[key]
        work = replay.done_s.get(key, 0.0) + state.now - run.start
        active = work < use.active_s(replay.trace[key].runtime_s)
        share = use.used(work, replay.trace[key].runtime_s)
        asked_pct = 100 if asked.isolation is Isolation.EXCLUSIVE else asked.cores_pct
        who = "owner" if not job.preemptible else "preemptible"
        for grant in job.grants:
            size = 100 if grant.exclusive else grant.cores_pct
            used = min(size, share * asked_pct) if active else 0.0
            gpu = per_gpu.setdefault(grant.gpu_uuid, defaultdict(float))
            if job.phase is Phase.PREEMPTED:
                gpu["stopping (grace)"] += size
            elif any(g.borrowed for g in job.grants):
                gpu["borrowed"] += size
                gpu["used: borrowers in lent room"] += used
                gpu["unused: a borrower's own grant"] += size - used
            elif not active:  # an idle session lends like any owner; the rest sits idle
                lent = float(min(job.lendable_cores_pct, size))
                gpu["granted"] += size
                gpu["lent"] += lent
                gpu["idle interactive sessions"] += size - lent
            else:
                gpu["granted"] += size
                lent = min(job.lendable_cores_pct, size - used)
                gpu["lent"] += lent
                gpu[f"used: {who}s"] += used
                cause = ("unused: not lent yet (observing)" if not job.lendable_cores_pct
                         and state.now - run.start < observed_s else
                         "unused: kept above the peak" if job.lendable_cores_pct else
                         "unused: other")
                gpu[cause] += size - used - lent
    waiting = smallest <= 100
    for node in replay.nodes.values():
        for g in node.inventory.gpus:
            gpu = per_gpu.get(g.uuid) or defaultdict(float)
            lent_pct, borrowed = gpu.pop("lent", 0.0), gpu.pop("borrowed", 0.0)
            granted = gpu.pop("granted", 0.0)
            for name, pct in gpu.items():
                held[name] += pct * dt / 100
            unfilled = max(0.0, lent_pct - borrowed)
            if unfilled:
                held["lent, not borrowed: " + ("fits a waiting job" if unfilled >= smallest
                                               else "too small")] += unfilled * dt / 100
            free = 100 - granted - gpu["stopping (grace)"] - max(0.0, borrowed - lent_pct)
            if free > 0:
                held["free, jobs waiting: " + ("fits one" if free >= smallest else "too small")
                     if waiting else "free, nothing waiting"] += free * dt / 100


if __name__ == "__main__":
    sys.exit(main())
