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
the operator's learning (`run_times.fold_finished`, `run_times.expected_duration`) predicts from
the runs that ended before it, against the user's estimate and against hindsight (its template's
median run time over the whole trace, which no predictor can know): median |ln(actual /
predicted)|.

For every variant, each job given an estimate when it arrived is also followed in a fork of
the replay in which nothing arrives after it ("no later arrivals"): its start there, against
the same estimate, is the error the estimate makes about the queue as it stood; the gap
between that start and the real one is what later arrivals did.

With `--futures N`, sampled jobs are followed in N forks with resampled run times and later
arrivals (`run_futures`): the forks' median wait, and their likeliest wait (the point most
forks come within 20 % of: the best point for a median of relative errors), against the real
wait, with the share of jobs each gets within 20 % (a median error <= 20 % needs half). With
`--progress-share`, the jobs that report keep their own run times in every fork (their
reports tell what is left to a median 11 %); only the silent ones are resampled.

    .venv/bin/python bench/eta_oracles.py [--generate 5000 --interarrival 80 --seed 0
        --scale 0.006 | --generate 0 --scale 0.004 (openb itself)] [--fork-every 1]
        [--progress-share 0.5]
        [--variants as-is,exact,no-preemption,exact+no-preemption]
        [--futures 8 --runtimes distribution|learned|trace --futures-from trace|last-day
        --dump forks.jsonl]
    .venv/bin/python bench/eta_oracles.py --summarize forks.jsonl
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
from dataclasses import asdict, dataclass, replace

from carpool.core.jobs import DurationEstimate, Job
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, extender_placer
from carpool.core.resources import Phase
from carpool.core.run_times import LearnKey, expected_duration, expected_remaining, fold_finished
from carpool.replay import job_traces, queue_replay, simulation
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
                fork_every: int, progress_share: float = 0.0, progress_seed: int = 0
                ) -> tuple[list[Row], int, float]:
    if "exact" in variant:
        jobs = [replace(j, user_estimate_s=j.runtime_s) for j in jobs]
    config = AdmissionConfig(node_placer=extender_placer(),
                             max_preemptions_per_cycle=0 if "no-preemption" in variant else 16)
    quotas = queue_replay.open_quotas(jobs)
    run = queue_replay.Replay(jobs, nodes, quotas,
                              queue_replay.carpool_policy(config), variant,
                              progress_share=progress_share, progress_seed=progress_seed)
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


RUNTIMES = ("trace", "distribution", "learned")
FUTURES_FROM = ("trace", "last-day")


@dataclass(frozen=True)
class Spread:
    """One template's run time in hindsight: the median and spread of ln(run time) over the
    whole trace (no predictor can know these; they stand for the run-time distribution)."""

    log_median: float
    sigma: float


def hindsight_spreads(jobs: Sequence[job_traces.TraceJob]) -> dict[str, Spread]:
    logs: dict[str, list[float]] = {}
    for t in jobs:
        logs.setdefault(t.template, []).append(math.log(t.runtime_s))
    return {k: Spread(statistics.median(v), statistics.pstdev(v) if len(v) > 1 else 0.5)
            for k, v in logs.items()}


def _draw_total(rng: random.Random, log_median: float, sigma: float, ran_s: float) -> float:
    """A run time drawn from lognormal(log_median, sigma), given that it exceeds `ran_s`."""
    if sigma <= 0:
        return max(ran_s + 1.0, math.exp(log_median))
    normal = statistics.NormalDist()
    below = normal.cdf((math.log(ran_s) - log_median) / sigma) if ran_s > 0 else 0.0
    u = min(1.0 - 1e-12, max(1e-12, below + (1.0 - below) * rng.random()))
    return max(ran_s + 1.0, math.exp(log_median + sigma * normal.inv_cdf(u)))


def _give_run_times(fork: queue_replay.Replay, runtimes: str, rng: random.Random,
                    spreads: Mapping[str, Spread]) -> None:
    """Replace the run times of the jobs in `fork` (the trace's, which no estimate knows):
    `learned`, as long as the operator expects (running jobs end when expected); or
    `distribution`, drawn from their template's distribution in hindsight, given how long
    they have run. Jobs that report progress (`Replay.curves`) keep theirs: their reports
    tell it, to a median 11 % of what is left."""
    if runtimes == "trace":
        return
    state = fork.state
    now = state.now
    trace = dict(fork.trace)
    ends = []
    for job in state.jobs.values():
        if job.key in fork.curves:
            continue
        done = fork.done_s.get(job.key, 0.0)
        running = job.phase is Phase.RUNNING
        started = job.started_at if running and job.started_at is not None else now
        ran = done + (now - started)
        if runtimes == "learned":
            expected = expected_duration(job, state.learned)
            left = (expected_remaining(job, now, expected, 60.0) if running
                    else max(1.0, expected - done))
        else:
            spread = spreads[job.template]
            left = _draw_total(rng, spread.log_median, spread.sigma, ran) - ran
        trace[job.key] = replace(trace[job.key], runtime_s=ran + max(1.0, left))
        if running:
            ends.append((now + max(1.0, left), queue_replay.END, job.key, job.attempts))
    running_keys = {e[2] for e in ends}
    fork.events = [e for e in fork.events
                   if not (e[1] == queue_replay.END and e[2] in running_keys)]
    fork.events.extend(ends)
    heapq.heapify(fork.events)
    fork.trace = trace


@dataclass(frozen=True)
class Forecast:
    job_class: str
    wait: float  # real
    fork_waits: tuple[float, ...]  # the job's wait in each fork
    error: float  # (real wait - median of the forks' waits) / real wait
    likeliest_error: float  # (real wait - `likeliest_wait` of the forks) / real wait
    estimate_error: float  # (real start - the estimate the job was given) / real wait
    in_range: bool  # the real start within the forks' P10-P90


NEAR = 0.2  # an estimate within 20 % of the real wait: the goal for the median error


def likeliest_wait(waits: Sequence[float]) -> float:
    """The wait that the most forks come within `NEAR` of (|estimate - w| / w <= NEAR):
    the point that maximises the chance of a small relative error, the right point for a
    median of relative errors (the forks' median sits between two modes of a bimodal wait,
    near neither). Of the points the most forks agree on, the one nearest their median."""
    median = statistics.median(waits)
    middle = math.log(max(1.0, median))
    candidates = [median, *(w * f for w in waits for f in (1.0 - NEAR, 1.0, 1.0 + NEAR))]
    def near(e: float) -> int:
        return sum(abs(e - w) <= NEAR * w * (1 + 1e-9) for w in waits)
    return max(candidates,
               key=lambda e: (near(e), -abs(math.log(max(1.0, e)) - middle)))


def run_futures(jobs: list[job_traces.TraceJob], nodes: Mapping[str, NodeState], futures: int,
                fork_every: int, horizon_s: float, seed: int, runtimes: str,
                futures_from: str, progress_share: float = 0.0) -> list[Forecast]:
    """For each (sampled) job given an estimate at arrival, the median of its starts over
    `futures` forks of the replay in which what arrives after it is another `horizon_s`
    stretch of the same trace, shifted to follow it (`futures_from` `trace`: from anywhere
    in it, which knows the arrival process; `last-day`: from the day before only, as a
    forecaster could), and the jobs already there run as long as `runtimes` says (`trace`:
    as they will, which nothing knows; `distribution`: drawn per fork from their template's
    distribution in hindsight; `learned`: as the operator expects). With `distribution`
    and `trace` futures the median is close to the best any estimate made at arrival could
    do: it knows every distribution, not the draws."""
    rng = random.Random(seed)
    spreads = hindsight_spreads(jobs)
    config = AdmissionConfig(node_placer=extender_placer())
    quotas = queue_replay.open_quotas(jobs)
    run = queue_replay.Replay(jobs, nodes, quotas,
                              queue_replay.carpool_policy(config), "futures",
                              progress_share=progress_share, progress_seed=seed)
    first, last = jobs[0].arrival, jobs[-1].arrival
    starts_by_job: dict[str, list[float]] = {}
    seen = 0
    while run.step():
        now = run.state.now
        for key, record in list(run.records.items()):
            if not (record.arrival == now and record.first_start is None
                    and record.arrival_estimate is not None and key not in starts_by_job):
                continue
            seen += 1
            if seen % fork_every or (futures_from == "last-day"
                                     and now - first < 2 * horizon_s):
                continue
            starts = starts_by_job[key] = []
            for k in range(futures):
                fork = run.fork(arrivals=False)
                _give_run_times(fork, runtimes, rng, spreads)
                if futures_from == "last-day":
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
    out = []
    for key, starts in starts_by_job.items():
        record = run.records[key]
        assert record.first_start is not None and record.arrival_estimate is not None
        wait = record.first_start - record.arrival
        if not starts or wait <= 0:
            continue
        ordered = sorted(starts)
        low = ordered[max(0, math.ceil(0.1 * len(ordered)) - 1)]
        high = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
        waits = tuple(s - record.arrival for s in ordered)
        out.append(Forecast(run.trace[key].job_class.label, wait, waits,
                            (wait - statistics.median(waits)) / wait,
                            (wait - likeliest_wait(waits)) / wait,
                            (record.first_start - record.arrival_estimate.start) / wait,
                            low <= record.first_start <= high))
    return out


def share(flags: Sequence[bool]) -> float | None:
    """The share of true flags to 3 places; None (null) where no job qualified."""
    return round(sum(flags) / len(flags), 3) if flags else None


def futures_summary(forecasts: Sequence[Forecast]) -> dict[str, object]:
    """Per class and for all jobs that waited >= 60 s: the error of the forks' median, of
    their likeliest wait and of Carpool's estimate, the share each gets within `NEAR`, and
    how the likeliest point chosen from fewer forks does on the fork left out
    (`held_out_within`)."""
    waited = [f for f in forecasts if f.wait >= queue_replay.MIN_WAIT_S]
    by_class: dict[str, object] = {}
    for c in [*sorted({f.job_class for f in waited}), "all"]:
        mine = [f for f in waited if c in ("all", f.job_class)]
        by_class[c] = {"jobs": len(mine),
                       "median_abs_error": med([abs(f.error) for f in mine]),
                       "median_signed_error": med([f.error for f in mine]),
                       "likeliest_median_abs_error": med([abs(f.likeliest_error)
                                                          for f in mine]),
                       "estimate_median_abs_error": med([abs(f.estimate_error) for f in mine]),
                       **{f"{name}_within_{NEAR:.0%}": share(
                           [abs(getattr(f, field)) <= NEAR for f in mine])
                          for name, field in (("median", "error"),
                                              ("likeliest", "likeliest_error"),
                                              ("estimate", "estimate_error"))},
                       "in_forks_p10_p90": share([f.in_range for f in mine]),
                       f"held_out_within_{NEAR:.0%}": held_out_within(mine)}
    return by_class


def held_out_within(forecasts: Sequence[Forecast], seed: int = 0) -> dict[int, float | None]:
    """Whether more forks would lift the oracle's share within `NEAR`: each fork in turn taken
    as the real wait, the likeliest wait of m of the others (drawn at random), for every m
    the forks allow; the share of held-out forks within `NEAR` of it. Flat in m: more forks
    would not help; growing: the oracle's own figure is pessimistic."""
    rng = random.Random(seed)
    counts = {len(f.fork_waits) for f in forecasts}
    if not counts:
        return {}
    out: dict[int, float | None] = {}
    for m in range(1, min(counts)):
        hits = []
        for f in forecasts:
            for i, held in enumerate(f.fork_waits):
                others = [w for j, w in enumerate(f.fork_waits) if j != i]
                hits.append(abs(likeliest_wait(rng.sample(others, m)) - held) <= NEAR * held)
        out[m] = share(hits)
    return out


def med(values: Sequence[float]) -> float | None:
    """The median to 3 places; None (null) where no job qualified."""
    return round(statistics.median(values), 3) if values else None


def runtime_prediction(jobs: Sequence[job_traces.TraceJob], alpha: float) -> dict[str, object]:
    """Median |ln(actual / predicted)| of each run-time predictor over the trace's jobs:
    learned (from the runs that ended before), the user's estimate, and two that no predictor
    can know, in hindsight over the whole trace: the template's median run time, and the
    user's estimate times the template's median ratio of run time to estimate."""
    by_template: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for t in jobs:
        by_template.setdefault(t.template, []).append(t.runtime_s)
        ratios.setdefault(t.template, []).append(t.runtime_s / t.user_estimate_s)
    hindsight = {k: statistics.median(v) for k, v in by_template.items()}
    hindsight_ratio = {k: statistics.median(v) for k, v in ratios.items()}
    learned: dict[LearnKey, DurationEstimate] = {}
    errors: dict[str, list[float]] = {"learned": [], "user estimate": [], "hindsight": [],
                                      "hindsight ratio": []}
    for t in sorted(jobs, key=lambda j: (j.arrival + j.runtime_s, j.key)):
        job = Job(t.key, t.project, t.job_class, t.request, t.arrival, t.user_estimate_s,
                  template=t.template)
        for name, predicted in (("learned", expected_duration(job, learned)),
                                ("user estimate", t.user_estimate_s),
                                ("hindsight", hindsight[t.template]),
                                ("hindsight ratio",
                                 t.user_estimate_s * hindsight_ratio[t.template])):
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
    parser.add_argument("--generate", type=int, default=5000,
                        help="jobs to generate; 0: replay openb's pod list itself")
    parser.add_argument("--interarrival", type=float, default=80.0)
    parser.add_argument("--load", type=float, help="offered load instead of --interarrival")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=0.006)
    parser.add_argument("--fork-every", type=int, default=1,
                        help="follow every Nth job given an estimate in a fork (1: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--progress-share", type=float, default=0.0,
                        help="this share of the jobs report progress as they run (drawn "
                             "from --seed, as `carpool simulate queue --progress-share`)")
    parser.add_argument("--futures", type=int, default=0,
                        help="also: the median start over this many resampled futures per "
                             "job (with --fork-every, e.g. 4)")
    parser.add_argument("--runtimes", choices=RUNTIMES, default="distribution",
                        help="run times of the jobs already there in those futures")
    parser.add_argument("--futures-from", choices=FUTURES_FROM, default="trace",
                        help="where the arrivals after the job come from")
    parser.add_argument("--dump", help="write each followed job's real and forked waits "
                                       "to this file, a JSON object a line")
    parser.add_argument("--summarize", metavar="DUMP",
                        help="only summarise the followed jobs of an earlier --dump")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as dump:
            forecasts = [Forecast(**{**row, "fork_waits": tuple(row["fork_waits"])})
                         for row in map(json.loads, dump)]
        print(json.dumps(futures_summary(forecasts)), flush=True)
        return 0
    root = traces_dir()
    shapes = job_traces.parse_trace((root / DEFAULT_PODS).read_text()).rows
    nodes = queue_replay.trace_nodes(
        ((n.name, n.gpus, n.model)
         for n in simulation.parse_nodes_csv((root / NODE_LIST).read_text())), args.scale)
    if args.generate:
        busy = args.load * queue_replay.capacity_gpus(nodes) if args.load else None
        text = job_traces.generate(shapes, args.generate, args.seed, args.interarrival,
                                   busy_gpus=busy)
        jobs = job_traces.annotate(job_traces.parse_trace(text).rows, args.seed)
    else:
        jobs = job_traces.annotate(shapes, args.seed)
    print(json.dumps({"run-time prediction": runtime_prediction(
        jobs, AdmissionConfig().duration_learning_rate)}), flush=True)
    for variant in [v for v in args.variants.split(",") if v]:
        rows, preemptions, cpu = run_variant(jobs, nodes, variant, args.fork_every,
                                             args.progress_share, args.seed)
        classes = sorted({r.job_class for r in rows})
        out = {"variant": variant, "seed": args.seed,
               "progress_share": args.progress_share, "preemptions": preemptions,
               "cpu_s": round(cpu, 1), "all": summary(rows),
               **{c: summary([r for r in rows if r.job_class == c]) for c in classes}}
        print(json.dumps(out), flush=True)
    if args.futures:
        forecasts = run_futures(jobs, nodes, args.futures, args.fork_every, 4 * 3600.0,
                                args.seed, args.runtimes, args.futures_from,
                                args.progress_share)
        if args.dump:
            with open(args.dump, "w") as out_file:
                for f in forecasts:
                    out_file.write(json.dumps(asdict(f)) + "\n")
        print(json.dumps({"variant": f"median of {args.futures} resampled futures",
                          "runtimes": args.runtimes, "futures_from": args.futures_from,
                          "progress_share": args.progress_share,
                          "seed": args.seed, **futures_summary(forecasts)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
