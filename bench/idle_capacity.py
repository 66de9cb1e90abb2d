"""Unused GPU capacity put to work, in the queue replay: lending, right-sizing and the
idle-session stop on and off, side by side on the same traces.

Jobs use less than they ask and interactive sessions go idle (`carpool.replay.usage_traces`:
peaks drawn per template from a Beta fitted to a published over-request figure, some rising
late; sessions active for the first part of their run). Arrivals are spaced so that `--load`
is the offered load up to the last arrival (`job_traces.generate`'s `load_by_last_arrival`),
the window work is measured in. For each trace, Carpool replays it
up to six ways in one batch (settings alternated across traces, so drift on a shared machine
falls on all of them; `--settings` picks some): as asked (`--over-requests`: measured,
nothing acts on it); lending from shared grants and right-sizing (`--lending
--right-sizing`); the same with whole-GPU owners lending too (`--lend-whole-gpus`); all of
that with idle sessions stopped (`--idle-timeout`); all of that with preemptible
whole-GPU jobs placed as MPS shares of their calibrated size (`--share-whole-gpus`); and
all but that with idle sessions also stopped sooner while jobs wait that their GPUs could
serve (`--idle-yield-after`, every project's `idleSessions.yieldAfter`).
Printed per trace and setting: work done while the trace arrives
(GPU-hours of progress by the requests' shares, up to the last arrival; an idle session does
none), the owners' (non-preemptible jobs') P50 and P99 waits, GPU-hours run in lent capacity,
owner reclaims and the P99 time from an owner's rise to its borrower gone, right-sized runs
the watchdog ended, sessions stopped as idle; and each setting's work against "as asked".

    .venv/bin/python bench/idle_capacity.py [--jobs-per-trace 500] [--load 2.0] [--seeds 7,8]
        [--idle-timeout 30m] [--idle-yield-after 5m] [--settings "+ idle sessions yield"]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from carpool.cli.simulator import QueueRun, replay_policies, scaled_nodes
from carpool.core.durations import parse_duration
from carpool.replay import job_traces, queue_replay

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces/openb/openb_pod_list_default.csv"
NODES = ROOT / "traces/openb/openb_node_list_gpu_node.csv"
# (lending, right-sizing, whole GPUs lend, idle sessions stopped, whole-GPU jobs shared,
#  idle sessions yield while jobs wait)
SETTINGS = {"as asked": (False, False, False, False, False, False),
            "lend shared + right-size": (True, True, False, False, False, False),
            "+ whole GPUs lend": (True, True, True, False, False, False),
            "+ idle sessions stopped": (True, True, True, True, False, False),
            "+ whole-GPU jobs shared": (True, True, True, True, True, False),
            "+ idle sessions yield": (True, True, True, True, False, True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs-per-trace", type=int, default=500)
    parser.add_argument("--load", type=float, default=2.0,
                        help="offered load as asked up to the last arrival, in shares of the "
                             "scaled cluster (2.0)")
    parser.add_argument("--seeds", default="7,8", help="generated traces' seeds (7,8)")
    parser.add_argument("--scale", type=float, default=0.006)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--idle-timeout", type=parse_duration, default="30m",
                        help="the idle-session timeout of the last settings (30m)")
    parser.add_argument("--idle-yield-after", type=parse_duration, default="5m",
                        help="the idleSessions.yieldAfter of the last setting (5m)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="the settings replayed, comma-separated names (all; \"as "
                             "asked\" always)")
    args = parser.parse_args()
    nodes_csv, shapes = NODES.read_text(), job_traces.parse_trace(TRACE.read_text()).rows
    capacity = queue_replay.capacity_gpus(scaled_nodes(nodes_csv, args.scale))
    runs: list[tuple[int, str, QueueRun]] = []
    for turn, seed in enumerate(int(s) for s in args.seeds.split(",")):
        trace = job_traces.generate(shapes, args.jobs_per_trace, seed, 300.0,
                                    busy_gpus=args.load * capacity, load_by_last_arrival=True)
        names = [n for n in SETTINGS if n == "as asked" or n in args.settings.split(",")]
        names = names[turn % len(names):] + names[:turn % len(names)]  # alternate the order
        for name in names:
            lending, right, whole, stop, share, yields = SETTINGS[name]
            runs.append((seed, name, QueueRun(
                nodes_csv, trace, args.scale, seed, 4, "carpool", None, over_requests=True,
                lending=lending, right_sizing=right, lend_whole_gpus=whole,
                idle_timeout_s=args.idle_timeout if stop else 0.0, share_whole_gpus=share,
                idle_yield_after_s=args.idle_yield_after if yields else 0.0)))
    started = time.perf_counter()
    done = 0

    def finished(run: QueueRun, cpu: float) -> None:
        nonlocal done
        done += 1
        print(f"  replayed {done} of {len(runs)} ({cpu:.0f} CPU s, "
              f"{time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    results = replay_policies([r for _, _, r in runs], args.workers, finished)
    by_trace: dict[int, dict[str, dict[str, object]]] = {}
    for (seed, name, _), (scores, _) in zip(runs, results, strict=True):
        by_trace.setdefault(seed, {})[name] = scores
    print(f"{args.jobs_per_trace} generated jobs per trace, load {args.load} as asked, "
          f"{capacity} GPUs (--scale {args.scale})")
    print("| trace | setting | work GPU-h | vs as asked | owner P50 wait | owner P99 wait | "
          "lent GPU-h | reclaims | reclaim P99 | outgrown | idle stopped |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gains: dict[str, list[float]] = {}
    for seed, settings in sorted(by_trace.items()):
        base = float(settings["as asked"]["work_gpu_hours_by_last_arrival"])  # type: ignore[arg-type]
        for name in (n for n in SETTINGS if n in settings):
            s = settings[name]
            work = float(s["work_gpu_hours_by_last_arrival"])  # type: ignore[arg-type]
            gains.setdefault(name, []).append(work / base)
            print(f"| seed {seed} | {name} | {work:.1f} | {work / base:.2f}x | "
                  f"{_secs(s['owner_wait_p50_s'])} | {_secs(s['owner_wait_p99_s'])} | "
                  f"{float(s['lent_gpu_hours']):.1f} | {s['owner_reclaims']} | "  # type: ignore[arg-type]
                  f"{_secs(s['owner_reclaim_p99_s'])} | {s['right_sized_runs_outgrown']} | "
                  f"{s['idle_sessions_stopped']} |")
    for name, ratios in gains.items():
        print(f"{name}: work vs as asked, median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
    return 0


def _secs(value: object) -> str:
    return f"{float(value):.0f} s" if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    sys.exit(main())
