"""Estimated starts when a share of the running jobs report their progress: Carpool's replay
(`carpool simulate queue --progress-share`) at several shares, side by side on the same traces.

Reporting jobs follow `carpool.replay.progress_traces` (start-up, rate changes, evaluation
pauses, checkpoint saves, restarts from a checkpoint), drawn per job from the trace's seed;
the others are estimated from learned run times alone. Per replay: the median relative error
of the estimate given at arrival over jobs that waited at least 60 s, overall and per class,
of the refreshed estimates, how many starts the 80 % range held and how wide it was (median
of its width over the actual wait), and the replay's CPU seconds. Share 0 is the replay
without any report.

    .venv/bin/python bench/progress_waits.py [--shares 0,0.25,0.5,1]
        [--traces load:0:0.85,load:4:0.85,openb:0.004] [--against ../main] [--scenarios N]
    .venv/bin/python bench/progress_waits.py --diagnose --shares 0.5 --traces load:5:0.85

`--diagnose`: where the error at arrival comes from, per replay. At every cycle in which a
job arrives, each running job's remaining time as the admission cycle takes it
(`run_times.remaining`) against what it really had left (its trace run time less the work
done), for jobs whose remaining time came from their progress reports and for the others
(median |ln(predicted / actual)|, its signed median, the share inside the P10-P90); and each
arriving job's estimate by what its forward-simulated start rests on: the expected end of a
running job that reports, of one that does not, or neither (a reservation ahead of it, a
calibrated or aged start), and where its first start fell against its 80 % range, by the
same and by whether it waited over a day. Also the lowest median error any one factor applied
to every estimate would reach (the spread of the misses, not their bias), and per class the
error at arrival split by who started between a job's arrival and its start (jobs ranked
ahead of it then; jobs ranked behind it or submitted after it, which passed it, by their
class against its own; runs started again after a preemption).

Trace specs as in bench/eta_calibration.py: `gen:SEED:INTERARRIVAL`, `load:SEED:LOAD` (5,000
generated jobs on openb's nodes at --scale 0.006), `openb:SCALE`. `--against DIR`: also
replay share 0 with another checkout's carpool (DIR's bench/ and src/ on this checkout's
Python), to compare the replay without reports with that checkout's. `--scenarios N`:
Carpool with `AdmissionConfig.start_scenarios` N (0: each estimate from the one forward
simulation with every run time as expected, no start scenarios).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eta_calibration import load

from carpool.core.queueing import AdmissionConfig, CycleResult, extender_placer
from carpool.core.run_times import learn_durations, remaining, run_time
from carpool.replay import queue_replay

DEFAULT_TRACES = ("gen:0:80,load:0:0.85,load:1:0.85,load:3:0.85,load:4:0.85,load:5:0.85,"
                  "load:6:0.85,load:7:0.85,openb:0.004")
CLASSES = ("interactive", "short", "long", "batch")


def replay(spec: str, share: float, scenarios: int | None = None) -> dict[str, object]:
    trace = load(spec)
    seed = int(spec.split(":")[1]) if not spec.startswith("openb") else 0
    config = AdmissionConfig(node_placer=extender_placer())
    if scenarios is not None:
        config = replace(config, start_scenarios=scenarios)
    started = time.process_time()
    outcome = queue_replay.replay(
        trace.jobs, trace.nodes, queue_replay.open_quotas(trace.jobs),
        queue_replay.carpool_policy(config),
        "carpool", progress_share=share, progress_seed=seed)
    cpu = time.process_time() - started
    scores = queue_replay.score(outcome)
    by_class: dict[str, list[tuple[float, float, queue_replay.Estimate | None]]] = {}
    for key, record in outcome.records.items():
        assert record.first_start is not None
        by_class.setdefault(outcome.trace[key].job_class.label, []).append(
            (record.arrival, record.first_start, record.arrival_estimate))
    class_errors = {c: queue_replay.first_estimate_errors(group)
                    for c, group in sorted(by_class.items())}
    return {"trace": spec, "share": share, "cpu_s": round(cpu, 1),
            **{k: scores[k] for k in (
                "eta_median_abs_rel_error", "eta_median_abs_rel_error_by_class",
                "eta_refreshed_median_abs_rel_error", "eta_interval_coverage",
                "eta_range_median_rel_width", "eta_median_signed_rel_error",
                "jobs_waited_60s_with_estimate")},
            "jobs_by_class": {c: e["jobs_waited_60s_with_estimate"]
                              for c, e in class_errors.items()},
            "eta_interval_coverage_by_class": {c: e["eta_interval_coverage"]
                                               for c, e in class_errors.items()}}


def diagnose(spec: str, share: float) -> dict[str, object]:
    """One replay observed cycle by cycle (see the module docstring, `--diagnose`)."""
    trace = load(spec)
    seed = int(spec.split(":")[1]) if not spec.startswith("openb") else 0
    config = AdmissionConfig(node_placer=extender_placer())
    holders: dict[str, list[tuple[float, float, bool]]] = {"reported": [], "learned": []}
    rests_on: dict[str, str] = {}

    def observe(state: queue_replay.State, decisions: queue_replay.Decisions) -> None:
        now = state.now
        arriving = [k for k in decisions.estimates
                    if state.jobs[k].submitted_at == now and not state.jobs[k].runs]
        if not arriving:
            return
        learned = learn_durations(state.jobs.values(), base=state.learned)
        ends: dict[float, bool] = {}
        for job in state.jobs.values():
            run = job.current_run
            if not job.holds_gpus or job.terminating or run is None:
                continue
            left = remaining(job, now, run_time(job, learned), config.min_remaining_s)
            actual = (trace_by_key[job.key].runtime_s - replayed.done_s.get(job.key, 0.0)
                      - (now - run.start))
            if actual >= queue_replay.MIN_WAIT_S:
                holders["reported" if left.reported else "learned"].append(
                    (math.log(max(left.expected, 1.0) / actual),
                     math.log(max(left.low, 1.0) / actual),
                     left.high >= actual))
            end = now + left.expected
            ends[end] = ends.get(end, False) or left.reported
        for key in arriving:
            estimate = decisions.estimates[key]
            simulated = estimate.simulated if estimate.simulated is not None else estimate.start
            near = [reported for end, reported in ends.items() if abs(end - simulated) < 1e-3]
            rests_on[key] = ("a reporting job's end" if any(near)
                             else "a silent job's end" if near else "neither")

    queued_at_arrival: dict[str, tuple[int, dict[str, int]]] = {}  # position, the queue's
    started: list[tuple[float, str]] = []

    def seen(state: queue_replay.State, result: CycleResult) -> None:
        now = state.now
        started.extend((now, a.job_key) for a in result.admissions)
        positions = {w.job_key: w.position for w in result.waits if w.position}
        for wait in result.waits:
            job = state.jobs[wait.job_key]
            if job.submitted_at == now and not job.runs and wait.position:
                queued_at_arrival[wait.job_key] = (wait.position, positions)

    trace_by_key = {j.key: j for j in trace.jobs}
    replayed = queue_replay.Replay(
        trace.jobs, trace.nodes, queue_replay.open_quotas(trace.jobs),
        queue_replay.carpool_policy(config, seen), "carpool", observe=observe,
        progress_share=share, progress_seed=seed)
    while replayed.step():
        pass
    outcome = replayed.outcome()
    misses: dict[str, list[float]] = {}
    waits: list[tuple[float, float]] = []
    ranges: dict[str, dict[str, int]] = {}
    for key, record in outcome.records.items():
        estimate, start = record.arrival_estimate, record.first_start
        assert start is not None
        wait = start - record.arrival
        if estimate is None or wait < queue_replay.MIN_WAIT_S or key not in rests_on:
            continue
        misses.setdefault(rests_on[key], []).append((start - estimate.start) / wait)
        waits.append((wait, estimate.start - record.arrival))
        if estimate.low is not None and estimate.high is not None:
            where = ("before" if start < estimate.low else "after" if start > estimate.high
                     else "inside")
            span = "waited over a day" if wait > 86400 else "waited under a day"
            for group in (rests_on[key], span):
                counts = ranges.setdefault(group, {"before": 0, "inside": 0, "after": 0})
                counts[where] += 1
    passed = _passed_by(outcome, queued_at_arrival, started)
    best = min((statistics.median(abs(w - c * e) / w for w, e in waits), c)
               for c in (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2)) \
        if waits else None
    return {
        "trace": spec, "share": share,
        "remaining": {source: {
            "samples": len(found),
            "median_abs_log_error": _median([abs(m) for m, _, _ in found]),
            "median_log_error": _median([m for m, _, _ in found]),
            "in_p10_p90": (sum(low <= 0 and inside for _, low, inside in found) / len(found)
                           if found else None)}
            for source, found in holders.items()},
        "arrival_error_by_what_it_rests_on": {
            source: {"jobs": len(found), "median_abs_error": _median([abs(m) for m in found]),
                     "median_signed_error": _median(found)}
            for source, found in sorted(misses.items())},
        "first_start_against_the_range": ranges,
        "by_class_and_who_started_first": passed,
        "best_single_factor": None if best is None else {"factor": best[1],
                                                         "median_abs_error": best[0]}}


PASSERS = ("behind", "later")  # started before the job though ranked behind it at its
# arrival, or submitted after it


def _passed_by(outcome: queue_replay.Outcome,
               queued_at_arrival: dict[str, tuple[int, dict[str, int]]],
               started: list[tuple[float, str]]) -> dict[str, dict[str, object]]:
    """Per class, the error at arrival (median |relative|, signed: + started later than
    estimated) of the jobs that waited at least a minute, split by who started between the
    job's arrival and its own start: jobs ranked ahead of it then, jobs ranked behind it
    then or submitted after it (each by its class against the job's: higher, same, lower),
    runs started again after a preemption. For each kind: how many jobs met it, their error,
    and how many such starts a job met (median); the error of the jobs no job passed; and
    where first starts fell against their 80 % range, all and those passed by their own
    class."""
    by_class: dict[str, dict[str, object]] = {}
    rows: dict[str, list[tuple[float, set[str], dict[str, int]]]] = {}
    ranged: dict[str, dict[str, int]] = collections.defaultdict(dict)
    starts = sorted(started)
    times = [t for t, _ in starts]
    for key, record in outcome.records.items():
        estimate, start = record.arrival_estimate, record.first_start
        if estimate is None or start is None or key not in queued_at_arrival:
            continue
        wait = start - record.arrival
        if wait < queue_replay.MIN_WAIT_S:
            continue
        job = outcome.trace[key]
        place, queue = queued_at_arrival[key]
        kinds: dict[str, int] = {}
        for index in range(bisect.bisect_right(times, record.arrival),
                           bisect.bisect_left(times, start)):
            other = outcome.trace[starts[index][1]]
            if other.key == key:
                continue
            relation = ("higher" if other.job_class < job.job_class else
                        "same" if other.job_class == job.job_class else "lower")
            source = ("later" if other.arrival > record.arrival else
                      "ahead" if queue.get(other.key, place) < place else
                      "behind" if other.key in queue else "restarted")
            kinds[f"{source}, {relation}"] = kinds.get(f"{source}, {relation}", 0) + 1
        passers = {k for k in kinds if k.split(",")[0] in PASSERS}
        where = ("no range" if estimate.low is None or estimate.high is None else
                 "before" if start < estimate.low else "after" if start > estimate.high
                 else "inside")
        own = any(k.endswith(", same") for k in passers)
        ranged[job.job_class.label][where] = ranged[job.job_class.label].get(where, 0) + 1
        if own:
            key_own = f"{where}, passed by its own class"
            ranged[job.job_class.label][key_own] = ranged[job.job_class.label].get(key_own, 0) + 1
        rows.setdefault(job.job_class.label, []).append(
            ((start - estimate.start) / wait, passers, kinds))
    for label, found in sorted(rows.items()):
        summary: dict[str, object] = {
            "jobs": len(found), "median_abs_error": _median([abs(e) for e, _, _ in found]),
            "median_signed_error": _median([e for e, _, _ in found])}
        alone = [e for e, passers, _ in found if not passers]
        summary["nobody passed"] = {"jobs": len(alone),
                                    "median_abs_error": _median([abs(e) for e in alone]),
                                    "median_signed_error": _median(alone)}
        for kind in sorted({k for _, _, kinds in found for k in kinds}):
            met = [(e, kinds[kind]) for e, _, kinds in found if kind in kinds]
            summary[kind] = {"jobs": len(met),
                             "median_abs_error": _median([abs(e) for e, _ in met]),
                             "median_signed_error": _median([e for e, _ in met]),
                             "median_starts": _median([float(n) for _, n in met])}
        summary["first start against the range"] = ranged[label]
        by_class[label] = summary
    return by_class


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def replay_in(checkout: Path, spec: str) -> dict[str, object]:
    """Share 0 with `checkout`'s carpool, in a process of its own: its bench and its src/ on
    this Python (the replay there takes no share: it has none)."""
    checkout = checkout.resolve()
    code = ("import json, sys, time; sys.path.insert(0, 'bench');"
            "from eta_calibration import replay, load;"
            f"r = replay(load({spec!r}), 'defaults', True);"
            "print(json.dumps({'cpu_s': round(r.cpu_s, 1), **r.scores}))")
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    found = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, cwd=checkout, env=env)
    scores = json.loads(found.stdout.splitlines()[-1])
    return {"trace": spec, "share": f"0 ({checkout.name})", **scores}


def pct(value: object) -> str:
    if not isinstance(value, float):
        return "–"
    return f"{100 * value:.1f} %" if value < 0.1 else f"{100 * value:.0f} %"


def row(result: dict[str, object]) -> str:
    by_class = result["eta_median_abs_rel_error_by_class"]
    assert isinstance(by_class, dict)
    share = result["share"]
    shown = f"{100 * share:.0f} %" if isinstance(share, float) else str(share)
    width = result["eta_range_median_rel_width"]
    shown_width = f"{width:.2f}" if isinstance(width, float) else "–"
    jobs = result.get("jobs_by_class", {})
    assert isinstance(jobs, dict)
    interactive = pct(by_class.get("interactive"))
    if interactive != "–" and "interactive" in jobs:
        interactive += f" ({jobs['interactive']})"
    return (f"| {result['trace']} | {shown} | {pct(result['eta_median_abs_rel_error'])} | "
            + " | ".join(interactive if c == "interactive" else pct(by_class.get(c))
                         for c in CLASSES)
            + f" | {pct(result['eta_refreshed_median_abs_rel_error'])} | "
            f"{pct(result['eta_interval_coverage'])} | {shown_width} | "
            f"{result['jobs_waited_60s_with_estimate']} | {result['cpu_s']} |")


def spread(values: list[float]) -> str:
    """Median and min-max over traces."""
    if not values:
        return "–"
    low, high = pct(min(values)), pct(max(values))
    return f"{pct(statistics.median(values))} ({low}–{high})"


def summary(results: list[dict[str, object]]) -> list[str]:
    """Per share, over the generated traces: the median and the spread (min-max) of each
    column, and how many traces met the goals (error at arrival <= 20 %, interactive <= 30 %,
    range holding 75-85 %)."""
    lines = ["| reporting | generated traces | median error at arrival | ≤ 20 % | interactive "
             "| ≤ 30 % | in 80 % range | 75–85 % | range width |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shares = sorted({r["share"] for r in results if isinstance(r["share"], float)})
    for share in shares:
        generated = [r for r in results if r["share"] == share
                     and not str(r["trace"]).startswith("openb")]
        errors = [r["eta_median_abs_rel_error"] for r in generated]
        inter = [by_class.get("interactive") for r in generated
                 if isinstance(by_class := r["eta_median_abs_rel_error_by_class"], dict)]
        cover = [r["eta_interval_coverage"] for r in generated]
        widths = [r["eta_range_median_rel_width"] for r in generated]
        fe = [e for e in errors if isinstance(e, float)]
        fi = [e for e in inter if isinstance(e, float)]
        fc = [e for e in cover if isinstance(e, float)]
        fw = [e for e in widths if isinstance(e, float)]
        width = (f"{statistics.median(fw):.2f} ({min(fw):.2f}–{max(fw):.2f})" if fw else "–")
        lines.append(
            f"| {100 * share:.0f} % | {len(generated)} | {spread(fe)} | "
            f"{sum(e <= 0.2 for e in fe)}/{len(fe)} | {spread(fi)} | "
            f"{sum(e <= 0.3 for e in fi)}/{len(fi)} | {spread(fc)} | "
            f"{sum(0.75 <= c <= 0.85 for c in fc)}/{len(fc)} | {width} |")
    return lines


def _run(task: tuple[str, float | None, Path | None, int | None]) -> dict[str, object]:
    spec, share, against, scenarios = task
    if share is None:
        assert against is not None
        return replay_in(against, spec)
    return replay(spec, share, scenarios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=DEFAULT_TRACES)
    parser.add_argument("--shares", default="0,0.25,0.5,1")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="another checkout: its replay without reports")
    parser.add_argument("--diagnose", action="store_true",
                        help="where the error at arrival comes from (see above)")
    parser.add_argument("--workers", type=int, default=1,
                        help="replays run side by side in this many processes")
    parser.add_argument("--scenarios", type=int, default=None, metavar="N",
                        help="AdmissionConfig.start_scenarios (default: Carpool's); 0: every "
                             "estimate from one simulation with every run time as expected")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    shares = [float(s) for s in args.shares.split(",")]
    if args.diagnose:
        for spec in args.traces.split(","):
            for share in shares:
                print(json.dumps(diagnose(spec, share)), flush=True)
        return 0
    tasks: list[tuple[str, float | None, Path | None, int | None]] = [
        (spec, share, args.against, args.scenarios) for spec in args.traces.split(",")
        for share in [*([None] if args.against else []), *shares]]
    with multiprocessing.Pool(args.workers) as pool:
        results = []
        for result in pool.imap(_run, tasks):
            results.append(result)
            print(json.dumps(result), flush=True)
    print()
    print("| trace | reporting | median error at arrival | interactive (jobs) | short | long "
          "| batch | refreshed | in 80 % range | range width | jobs waited ≥ 60 s "
          "| replay CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        print(row(result))
    print()
    print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
