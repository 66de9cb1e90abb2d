"""Estimated starts with one of their corrections off and on, side by side on the same
traces: Carpool's replay (`carpool simulate queue`'s Carpool policy) with the setting off and
on, alternating, one trace after another. `--setting calibration` (the default): the class
calibration (`AdmissionConfig.class_calibration`, estimate_ranges.calibrated_start); `--setting
arrivals`: higher-class arrivals widening the ranges' end (`AdmissionConfig.
arrival_window_s` 0 against its default, estimate_ranges.wait_stretch); `--setting promises`: jobs
queued past their first promised start ranking ahead of work that would overtake them
(`AdmissionConfig.keep_promises`, fairshare). `--against DIR`: no setting; Carpool's replay
with its defaults in another checkout of this repository (DIR, set up with `make dev`) against
this one, for a change that no setting switches: each replay runs in a process of its own,
this bench's code on DIR's Python (and so DIR's carpool), then on this checkout's.

Per replay: the median and P90 relative error of the estimate given at arrival over jobs
that waited at least 60 s, per class, the signed median, how many starts the 80 % range
held and how wide it was, and the replay's CPU seconds (the setting's cost in the admission
cycle). Then per setting the median over traces and their spread (min-max).

    .venv/bin/python bench/eta_calibration.py [--setting calibration|arrivals|promises]
        [--traces gen:0:80,load:0:0.85,openb:0.004]
    .venv/bin/python bench/eta_calibration.py --against ../other-checkout [--traces ...]

Trace specs: `gen:SEED:INTERARRIVAL` and `load:SEED:LOAD` (5,000 generated jobs on openb's
nodes at --scale 0.006), `openb:SCALE` (openb's default pod list itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, extender_placer
from carpool.replay import job_traces, queue_replay, simulation
from carpool_testbed.traces import DEFAULT_PODS, NODE_LIST, traces_dir

DEFAULT_TRACES = "gen:0:80,load:0:0.85,load:1:0.85,load:3:0.85"


@dataclass(frozen=True)
class Trace:
    spec: str
    jobs: list[job_traces.TraceJob]
    nodes: dict[str, NodeState]


def load(spec: str) -> Trace:
    root = traces_dir()
    pods = job_traces.parse_trace((root / DEFAULT_PODS).read_text())
    rows = simulation.parse_nodes_csv((root / NODE_LIST).read_text())
    kind, *params = spec.split(":")
    scale = float(params[0]) if kind == "openb" else 0.006
    nodes = queue_replay.trace_nodes(((n.name, n.gpus, n.model) for n in rows), scale)
    if kind == "openb":
        return Trace(spec, job_traces.annotate(pods.rows, 0), nodes)
    seed = int(params[0])
    if kind == "gen":
        text = job_traces.generate(pods.rows, 5000, seed, float(params[1]))
    elif kind == "load":
        busy = float(params[1]) * queue_replay.capacity_gpus(nodes)
        text = job_traces.generate(pods.rows, 5000, seed, 80.0, busy_gpus=busy)
    else:
        raise SystemExit(f"unknown trace spec {spec!r}")
    return Trace(spec, job_traces.annotate(job_traces.parse_trace(text).rows, seed), nodes)


@dataclass(frozen=True)
class Result:
    trace: str
    on: bool
    cpu_s: float
    error: float | None  # median relative error of the estimate at arrival
    scores: dict[str, object]


def config_for(setting: str, on: bool) -> AdmissionConfig:
    config = AdmissionConfig(node_placer=extender_placer())
    if setting == "defaults":
        return config
    if setting == "calibration":
        return replace(config, class_calibration=on)
    if setting == "promises":
        return replace(config, keep_promises=on)
    return config if on else replace(config, arrival_window_s=0.0)


def replay(trace: Trace, setting: str, on: bool) -> Result:
    config = config_for(setting, on)
    started = time.process_time()
    outcome = queue_replay.replay(trace.jobs, trace.nodes, queue_replay.open_quotas(trace.jobs),
                                  queue_replay.carpool_policy(config), "carpool")
    cpu = time.process_time() - started
    scores = queue_replay.score(outcome)
    keys = ("eta_median_abs_rel_error", "eta_p90_abs_rel_error", "eta_median_signed_rel_error",
            "eta_refreshed_median_abs_rel_error", "eta_interval_coverage",
            "eta_range_median_rel_width",
            "eta_median_abs_rel_error_by_class",
            "jobs_waited_60s_with_estimate", "preemptions", "wait_p50_s", "wait_p99_s",
            "gpu_utilization")
    error = scores["eta_median_abs_rel_error"]
    return Result(trace.spec, on, cpu, error if isinstance(error, float) else None,
                  {k: scores[k] for k in keys})


def replay_in(checkout: Path, spec: str, on: bool) -> Result:
    """One replay with the defaults, by `checkout`'s Python (its carpool) in its own process."""
    found = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), str(Path(__file__).resolve()),
         "--one", spec], check=True, capture_output=True, text=True, cwd=checkout)
    return replace(Result(**json.loads(found.stdout.splitlines()[-1])), on=on)


def commit_of(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          check=True, capture_output=True, text=True).stdout.strip()


def spread(values: Sequence[float]) -> str:
    return (f"median {statistics.median(values):.3f} (min {min(values):.3f}, "
            f"max {max(values):.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=("calibration", "arrivals", "promises"),
                        default="calibration")
    parser.add_argument("--traces", default=DEFAULT_TRACES)
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="another checkout (with its .venv): its defaults, then this one's")
    parser.add_argument("--one", metavar="TRACE", help=argparse.SUPPRESS)  # for --against
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asdict(replay(load(args.one), "defaults", True))))
        return 0
    here = Path(__file__).resolve().parent.parent
    names = {False: "off", True: "on "}
    if args.against:  # "on": this checkout
        names = {False: commit_of(args.against), True: commit_of(here)}
        args.setting = "commit"
    results: list[Result] = []
    for spec in args.traces.split(","):
        trace = None if args.against else load(spec)
        for on in (False, True):
            if args.against:
                result = replay_in(here if on else args.against, spec, on)
            else:
                assert trace is not None
                result = replay(trace, args.setting, on)
            results.append(result)
            label = names[on] if args.against else result.on
            print(json.dumps({"trace": result.trace, args.setting: label,
                              "cpu_s": round(result.cpu_s, 1), **result.scores}), flush=True)
    for on in (False, True):
        errors = [r.error for r in results if r.on is on and r.error is not None]
        if errors:
            print(f"{args.setting} {names[on]}: median error over traces "
                  f"{spread(errors)}")
    for on in (False, True):
        held = [c for r in results if r.on is on
                and isinstance(c := r.scores["eta_interval_coverage"], float)]
        if held:
            print(f"{args.setting} {names[on]}: in 80 % range {spread(held)}")
    off = {r.trace: r.cpu_s for r in results if not r.on}
    ratios = [r.cpu_s / off[r.trace] for r in results if r.on and off.get(r.trace)]
    if ratios:
        print(f"replay CPU time, {names[True].strip()} / {names[False]}: {spread(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
