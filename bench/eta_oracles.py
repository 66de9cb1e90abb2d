"""Where the error of Carpool's estimated start comes from: oracle replays of one trace.

Each variant replays the trace through the operator's admission cycle (`carpool simulate
queue`'s Carpool policy) and scores the estimate given at arrival against the actual start,
per class, over jobs that waited at least 60 s:

- `as is`: the replay as `simulate queue` runs it;
- `exact run times`: every user estimate is the job's real run time (learning then predicts
  run times exactly), so what is left is queue dynamics;
- `no preemption`: the admission cycle preempts nothing;
- both.

First, run-time prediction on its own: for every job, in the order the jobs end, the run time
the operator's learning (`eta.fold_finished`, `eta.expected_duration`) predicts from the runs
that ended before it, against the user's estimate and against hindsight (its template's median
run time over the whole trace, which no predictor can know): median |ln(actual / predicted)|.

For every variant, each job given an estimate when it arrived is also followed in a fork of
the replay in which nothing arrives after it ("no later arrivals"): its start there, against
the same estimate, is the error the estimate makes about the queue as it stood; the gap
between that start and the real one is what later arrivals did.

    .venv/bin/python bench/eta_oracles.py [--generate 5000 --interarrival 80 --seed 0
        --scale 0.006] [--fork-every 1] [--variants as-is,exact,no-preemption,exact+no-preemption]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from carpool.core import job_traces, queue_replay, simulation
from carpool.core.eta import LearnKey, expected_duration, expected_remaining, fold_finished
from carpool.core.jobs import DurationEstimate, Job
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, extender_placer
from carpool.core.resources import Phase
from carpool_testbed.traces import DEFAULT_PODS, NODE_LIST, traces_dir

VARIANTS = ("as-is", "exact", "no-preemption", "exact+no-preemption")


@dataclass(frozen=True)
class Row:
    job_class: str
    wait: float  # real
    estimate_wait: float  # estimate - arrival
    error: float  # (real start - estimate) / real wait, signed
    alone_error: float | None  # (start without later arrivals - estimate) / real wait
    arrivals_effect: float | None  # (real start - start without later arrivals) / real wait


def run_variant(jobs: list[job_traces.TraceJob], nodes: Mapping[str, NodeState], variant: str,
                fork_every: int) -> tuple[list[Row], int, float]:
    if "exact" in variant:
        jobs = [replace(j, user_estimate_s=j.runtime_s) for j in jobs]
    config = AdmissionConfig(node_placer=extender_placer(),
                             max_preemptions_per_cycle=0 if "no-preemption" in variant else 16)
    quotas = queue_replay.open_quotas(jobs)
    run = queue_replay.Replay(jobs, nodes, quotas,
                              queue_replay.carpool_policy(config), variant)
    alone: dict[str, float] = {}
    seen = 0
    started = time.process_time()
    while run.step():
        now = run.state.now
        for key, record in run.records.items():
            if (record.arrival == now and record.first_start is None
                    and record.arrival_estimate is not None and key not in alone):
                seen += 1
                if seen % fork_every:
                    continue
                fork = run.fork(arrivals=False)
                while fork.records[key].first_start is None and fork.step():
                    pass
                start = fork.records[key].first_start
                if start is not None:
                    alone[key] = start
    rows = []
    for key, record in run.records.items():
        estimate = record.arrival_estimate
        assert record.first_start is not None
        wait = record.first_start - record.arrival
        if estimate is None or wait < queue_replay.MIN_WAIT_S:
            continue
        solo = alone.get(key)
        rows.append(Row(run.trace[key].job_class.label, wait, estimate.start - record.arrival,
                        (record.first_start - estimate.start) / wait,
                        None if solo is None else (solo - estimate.start) / wait,
                        None if solo is None else (record.first_start - solo) / wait))
    return rows, run.preemptions, time.process_time() - started


def _as_predicted(fork: queue_replay.Replay) -> None:
    """Give the jobs in `fork` the run times the operator expects of them (learned), not
    the trace's: running jobs end when expected, waiting ones run as long as expected."""
    state = fork.state
    now = state.now
    trace = dict(fork.trace)
    ends = []
    for job in state.jobs.values():
        expected = expected_duration(job, state.learned)
        done = fork.done_s.get(job.key, 0.0)
        if job.phase is Phase.RUNNING:
            left = expected_remaining(job, now, expected, 60.0)
            started = job.started_at if job.started_at is not None else now
            trace[job.key] = replace(trace[job.key], runtime_s=done + (now - started) + left)
            ends.append((now + max(1.0, left), queue_replay.END, job.key, job.attempts))
        else:
            trace[job.key] = replace(trace[job.key], runtime_s=max(done + 1.0, expected))
    running = {e[2] for e in ends}
    fork.events = [e for e in fork.events if not (e[1] == queue_replay.END and e[2] in running)]
    fork.events.extend(ends)
    heapq.heapify(fork.events)
    fork.trace = trace


def run_futures(jobs: list[job_traces.TraceJob], nodes: Mapping[str, NodeState], futures: int,
                fork_every: int, horizon_s: float, seed: int, realistic: bool = False
                ) -> list[tuple[str, float, float]]:
    """For each (sampled) job given an estimate at arrival: (class, real wait, the median
    start over `futures` forks in which the arrivals after it are another stretch of the
    same trace, shifted to follow it). That median is about the best any estimate made at
    arrival could say (it knows the arrival process exactly, not the draw). `realistic`:
    what a forecaster could do — stretches from the past only (the last day), and the jobs
    already there run as long as learned, not as long as the trace says."""
    rng = random.Random(seed)
    config = AdmissionConfig(node_placer=extender_placer())
    quotas = queue_replay.open_quotas(jobs)
    run = queue_replay.Replay(jobs, nodes, quotas,
                              queue_replay.carpool_policy(config), "futures")
    first, last = jobs[0].arrival, jobs[-1].arrival
    forecasts: dict[str, float] = {}
    seen = 0
    while run.step():
        now = run.state.now
        for key, record in list(run.records.items()):
            if not (record.arrival == now and record.first_start is None
                    and record.arrival_estimate is not None and key not in forecasts):
                continue
            seen += 1
            if seen % fork_every or (realistic and now - first < 2 * horizon_s):
                continue
            starts = []
            for k in range(futures):
                fork = run.fork(arrivals=False)
                if realistic:
                    _as_predicted(fork)
                    offset = rng.uniform(max(first, now - 86400.0), now - horizon_s)
                else:
                    offset = rng.uniform(first, max(first, last - horizon_s))
                extra = [replace(j, key=f"{j.key}~{k}", arrival=now + j.arrival - offset + 1e-3)
                         for j in jobs if offset <= j.arrival < offset + horizon_s]
                fork.trace = {**fork.trace, **{j.key: j for j in extra}}
                for j in extra:
                    heapq.heappush(fork.events, (j.arrival, queue_replay.ARRIVE, j.key, 0))
                while fork.records[key].first_start is None and fork.step():
                    pass
                start = fork.records[key].first_start
                if start is not None:
                    starts.append(start)
            if starts:
                forecasts[key] = statistics.median(starts)
    out = []
    for key, forecast in forecasts.items():
        record = run.records[key]
        assert record.first_start is not None
        out.append((run.trace[key].job_class.label, record.first_start - record.arrival,
                    (record.first_start - forecast)))
    return out


def med(values: Sequence[float]) -> float | None:
    """The median to 3 places; None (null) where no job qualified."""
    return round(statistics.median(values), 3) if values else None


def runtime_prediction(jobs: Sequence[job_traces.TraceJob], alpha: float) -> dict[str, object]:
    """Median |ln(actual / predicted)| of each run-time predictor over the trace's jobs."""
    by_template: dict[str, list[float]] = {}
    for t in jobs:
        by_template.setdefault(t.template, []).append(t.runtime_s)
    hindsight = {k: statistics.median(v) for k, v in by_template.items()}
    learned: dict[LearnKey, DurationEstimate] = {}
    errors: dict[str, list[float]] = {"learned": [], "user estimate": [], "hindsight": []}
    for t in sorted(jobs, key=lambda j: (j.arrival + j.runtime_s, j.key)):
        job = Job(t.key, t.project, t.job_class, t.request, t.arrival, t.user_estimate_s,
                  template=t.template)
        for name, predicted in (("learned", expected_duration(job, learned)),
                                ("user estimate", t.user_estimate_s),
                                ("hindsight", hindsight[t.template])):
            errors[name].append(abs(math.log(t.runtime_s / predicted)))
        fold_finished(learned, job, t.runtime_s, alpha)
    return {"jobs": len(jobs), "learning_rate": alpha,
            **{f"{name}_median_abs_log_error": round(statistics.median(v), 3)
               for name, v in errors.items()}}


def summary(rows: Sequence[Row]) -> dict[str, object]:
    forked = [r for r in rows if r.alone_error is not None]
    return {
        "jobs": len(rows),
        "median_abs_error": med([abs(r.error) for r in rows]),
        "median_signed_error": med([r.error for r in rows]),
        "forked": len(forked),
        "forked_median_abs_error": med([abs(r.error) for r in forked]),
        "no_later_arrivals_median_abs_error": med([abs(r.alone_error or 0.0) for r in forked]),
        "no_later_arrivals_median_signed_error": med([r.alone_error or 0.0 for r in forked]),
        "later_arrivals_median_abs_effect": med([abs(r.arrivals_effect or 0.0)
                                                 for r in forked]),
        "later_arrivals_median_signed_effect": med([r.arrivals_effect or 0.0 for r in forked]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate", type=int, default=5000)
    parser.add_argument("--interarrival", type=float, default=80.0)
    parser.add_argument("--load", type=float, help="offered load instead of --interarrival")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=0.006)
    parser.add_argument("--fork-every", type=int, default=1,
                        help="follow every Nth job given an estimate in a fork (1: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--realistic", action="store_true",
                        help="resampled futures from the last day only, and learned run "
                             "times for the jobs already there")
    parser.add_argument("--futures", type=int, default=0,
                        help="also: the median start over this many resampled futures per "
                             "job (with --fork-every, e.g. 4), the floor of any estimate")
    args = parser.parse_args()
    root = traces_dir()
    shapes = job_traces.parse_trace((root / DEFAULT_PODS).read_text()).rows
    nodes = queue_replay.trace_nodes(
        ((n.name, n.gpus, n.model)
         for n in simulation.parse_nodes_csv((root / NODE_LIST).read_text())), args.scale)
    busy = args.load * queue_replay.capacity_gpus(nodes) if args.load else None
    text = job_traces.generate(shapes, args.generate, args.seed, args.interarrival,
                               busy_gpus=busy)
    jobs = job_traces.annotate(job_traces.parse_trace(text).rows, args.seed)
    print(json.dumps({"run-time prediction": runtime_prediction(
        jobs, AdmissionConfig().duration_learning_rate)}), flush=True)
    for variant in [v for v in args.variants.split(",") if v]:
        rows, preemptions, cpu = run_variant(jobs, nodes, variant, args.fork_every)
        classes = sorted({r.job_class for r in rows})
        out = {"variant": variant, "seed": args.seed, "preemptions": preemptions,
               "cpu_s": round(cpu, 1), "all": summary(rows),
               **{c: summary([r for r in rows if r.job_class == c]) for c in classes}}
        print(json.dumps(out), flush=True)
    if args.futures:
        rows_f = run_futures(jobs, nodes, args.futures, args.fork_every, 4 * 3600.0, args.seed,
                             args.realistic)
        waited = [r for r in rows_f if r[1] >= queue_replay.MIN_WAIT_S]
        by_class: dict[str, object] = {}
        for c in [*sorted({r[0] for r in waited}), "all"]:
            mine = [r for r in waited if c in ("all", r[0])]
            by_class[c] = {"jobs": len(mine),
                           "median_abs_error": med([abs(r[2]) / r[1] for r in mine]),
                           "median_signed_error": med([r[2] / r[1] for r in mine])}
        print(json.dumps({"variant": f"median of {args.futures} resampled futures"
                                     + (", realistic" if args.realistic else ""),
                          "seed": args.seed, **by_class}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
