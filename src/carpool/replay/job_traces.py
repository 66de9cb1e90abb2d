"""Job traces for the queue replay: reading the openb columns and filling in what they lack.

openb (Alibaba's GPU-sharing trace, Weng et al., USENIX ATC'23) gives each pod its shape and
`creation_time`, `scheduled_time`, `deletion_time` (seconds). A pod that was scheduled becomes
a job arriving at `creation_time` and running `deletion_time - scheduled_time` seconds; pods
never scheduled (no `scheduled_time`) and pods without GPUs are skipped and counted.

What openb lacks — projects, classes, user estimates — a seeded generator adds
(`annotate`). Its distributions, and the published facts they follow:

- **Projects.** openb has no user or team column. Pods with the same shape (CPU, memory, GPU
  count and share, allowed models, QoS) are taken to come from one deployment template (a
  "job name"); each template belongs to one project, drawn with Zipf weights 1/k over
  `projects` projects, so a few projects submit most of the work, as in lab clusters.
- **Classes.** From openb's QoS and the user's estimate: LS (latency-sensitive) estimated at
  <= 2 h is interactive, LS longer is long; Guaranteed and Burstable are short when estimated
  at <= 4 h, else long; BE (best effort) is batch, and batch jobs are preemptible.
- **User estimates.** Users mostly over-estimate, often by several times, and some
  under-estimate: Mu'alem & Feitelson (IEEE TPDS 12(6), 2001) found user estimates on the
  IBM SP2 logs far above actual run times for most jobs, and modelled an estimate as the run
  time times a factor drawn uniformly from [1, f] (their "f model"); Tsafrir, Etsion &
  Feitelson ("Modeling user runtime estimates", JSSPP 2005) found estimates to be modal: a few
  round values (minutes, an hour, a few hours, a day, the queue limit) cover most jobs; Lee
  et al. (JSSPP 2004) found that removing the kill-at-limit threat and rewarding accuracy did
  not make estimates substantially more accurate. Here: with probability `UNDER_P` (10 %) the
  estimate is the run time times U(0.3, 1); otherwise times a factor log-uniform in [1, 10]
  (the f model with f = 10, drawn on a log scale so that 2x is as likely as 5x to 10x); then
  rounded up to the next of the round values in `ROUND_ESTIMATES_S`.
- **Generated traces** (`generate`): Poisson arrivals (spaced to a given offered load if
  asked); 200 templates, picked with a Pareto(1.2) index so a few recur most; per template a
  log-normal run time (median drawn log-uniform from 2 min to 8 h, sigma 0.5); shapes and QoS
  drawn from the openb pods given. Written in the openb columns, so the same reader replays
  them.

Pure: text in, jobs out.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from carpool.core.jobs import name_stem
from carpool.core.resources import GpuRequest, Isolation, JobClass

MILLI_PER_GPU = 1000
UNDER_P = 0.10  # share of jobs whose user under-estimates
UNDER_RANGE = (0.3, 1.0)  # their estimate / run time
OVER_MAX = 10.0  # the f model's f: estimate / run time up to this, log-uniform
ROUND_ESTIMATES_S = (60.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 2 * 3600.0, 4 * 3600.0,
                     8 * 3600.0, 12 * 3600.0, 86400.0, 2 * 86400.0, 3 * 86400.0, 7 * 86400.0,
                     14 * 86400.0, 30 * 86400.0, 90 * 86400.0, 180 * 86400.0)
OPENB_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos",
                 "pod_phase", "creation_time", "deletion_time", "scheduled_time")


@dataclass(frozen=True)
class TraceRow:
    """One scheduled GPU pod of an openb-style trace."""

    name: str
    arrival: float
    runtime_s: float
    num_gpu: int
    gpu_milli: int  # per GPU; 1000 = whole GPUs
    models: frozenset[str]
    qos: str
    cpu_milli: int
    memory_mib: int
    template: str = ""  # the job name or image run-time learning groups by

    @property
    def shape(self) -> str:
        """The deployment a pod is taken to come from when names say nothing: its shape."""
        spec = "|".join(sorted(self.models))
        return (f"{self.qos or 'none'}-{self.num_gpu}x{self.gpu_milli}-{spec or 'any'}-"
                f"c{self.cpu_milli}-m{self.memory_mib}")

    @property
    def request(self) -> GpuRequest:
        """A GPU share is an MPS request for that share of the SMs; whole GPUs are exclusive."""
        if self.gpu_milli >= MILLI_PER_GPU:
            return GpuRequest(self.num_gpu, 0, 100, Isolation.EXCLUSIVE, self.models)
        return GpuRequest(1, 0, max(1, math.ceil(self.gpu_milli / 10)), Isolation.MPS,
                          self.models)


@dataclass(frozen=True)
class ParsedTrace:
    rows: tuple[TraceRow, ...]
    unscheduled: int  # pods never scheduled (no run time)
    cpu_only: int  # pods without GPUs


def _number(row: dict[str, str], key: str, line: int) -> float | None:
    text = (row.get(key) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"line {line}: {key}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"line {line}: {key}={text!r} must be a finite number >= 0")
    return value


def parse_trace(text: str) -> ParsedTrace:
    """Rows of a trace in the openb pod columns; the time columns are required."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in ("num_gpu", "gpu_milli", "creation_time", "deletion_time",
                           "scheduled_time") if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"trace lacks column(s) {', '.join(missing)} (openb pod columns: "
                         f"{','.join(OPENB_COLUMNS)})")
    rows: list[TraceRow] = []
    unscheduled = cpu_only = 0
    for line, row in enumerate(reader, start=2):
        num_gpu = int(_number(row, "num_gpu", line) or 0)
        if num_gpu <= 0:
            cpu_only += 1
            continue
        created = _number(row, "creation_time", line)
        scheduled = _number(row, "scheduled_time", line)
        deleted = _number(row, "deletion_time", line)
        if created is None:
            raise ValueError(f"line {line}: creation_time is empty")
        if scheduled is None or deleted is None:
            unscheduled += 1
            continue
        if deleted < scheduled:
            raise ValueError(f"line {line}: deletion_time {deleted:.0f} is before "
                             f"scheduled_time {scheduled:.0f}")
        milli = int(_number(row, "gpu_milli", line) or MILLI_PER_GPU)
        if num_gpu > 1 and milli != MILLI_PER_GPU:
            raise ValueError(f"line {line}: a {num_gpu}-GPU pod must ask for whole GPUs")
        if not 0 < milli <= MILLI_PER_GPU:
            raise ValueError(f"line {line}: gpu_milli={milli} must be in 1..1000")
        spec = (row.get("gpu_spec") or "").strip()
        rows.append(TraceRow(
            (row.get("name") or f"pod-{line}").strip(), created, max(1.0, deleted - scheduled),
            num_gpu, milli, frozenset(m for m in spec.split("|") if m),
            (row.get("qos") or "").strip(), int(_number(row, "cpu_milli", line) or 0),
            int(_number(row, "memory_mib", line) or 0)))
    if not rows:
        raise ValueError("the trace has no scheduled GPU pod")
    # a name without its trailing number is the job's name; when every pod shares it (openb:
    # "openb-pod-0001"), the pod's shape stands in
    stems = [name_stem(r.name) for r in rows]
    use_stems = len(set(stems)) > 1
    rows = [replace(r, template=stem if use_stems else r.shape)
            for r, stem in zip(rows, stems, strict=True)]
    rows.sort(key=lambda r: (r.arrival, r.name))
    return ParsedTrace(tuple(rows), unscheduled, cpu_only)


@dataclass(frozen=True)
class TraceJob:
    """One job to replay: what the trace says plus what the generator added."""

    key: str  # "project/name"
    project: str
    job_class: JobClass
    request: GpuRequest
    arrival: float
    runtime_s: float  # what it really takes (the trace)
    user_estimate_s: float  # what its user says (estimatedDuration)
    template: str  # what run-time learning groups by (job name or image)
    preemptible: bool


def user_estimate(runtime_s: float, rng: random.Random) -> float:
    """A user's estimate of `runtime_s` (see the module docstring for the distribution)."""
    if rng.random() < UNDER_P:
        raw = runtime_s * rng.uniform(*UNDER_RANGE)
    else:
        raw = runtime_s * math.exp(rng.uniform(0.0, math.log(OVER_MAX)))
    for value in ROUND_ESTIMATES_S:
        if value >= raw:
            return value
    return ROUND_ESTIMATES_S[-1]


def job_class(qos: str, estimate_s: float) -> JobClass:
    if qos == "LS":
        return JobClass.INTERACTIVE if estimate_s <= 2 * 3600 else JobClass.LONG
    if qos in ("Guaranteed", "Burstable"):
        return JobClass.SHORT if estimate_s <= 4 * 3600 else JobClass.LONG
    return JobClass.BATCH


def project_names(count: int) -> tuple[str, ...]:
    return tuple(f"p{i}" for i in range(count))


def annotate(rows: Sequence[TraceRow], seed: int, projects: int = 4) -> list[TraceJob]:
    """Projects, classes and user estimates for `rows`, the same for the same seed."""
    if projects < 1:
        raise ValueError("at least one project")
    rng = random.Random(seed)
    names = project_names(projects)
    weights = [1.0 / (k + 1) for k in range(projects)]
    owner: dict[str, str] = {}
    for template in sorted({r.template for r in rows}):
        owner[template] = rng.choices(names, weights)[0]
    out = []
    for row in rows:
        estimate = user_estimate(row.runtime_s, rng)
        cls = job_class(row.qos, estimate)
        project = owner[row.template]
        out.append(TraceJob(f"{project}/{row.name}", project, cls, row.request, row.arrival,
                            row.runtime_s, estimate, row.template, cls is JobClass.BATCH))
    return out


def generate(shapes: Sequence[TraceRow], jobs: int, seed: int, mean_interarrival_s: float,
             templates: int = 200, busy_gpus: float | None = None,
             load_by_last_arrival: bool = False) -> str:
    """A synthetic trace in the openb pod columns (see the module docstring). With
    `busy_gpus`, arrivals are spaced so that the trace's work keeps that many GPUs busy on
    average over its arrivals (the offered load), whatever run times the seed drew;
    `mean_interarrival_s` is then ignored. With `load_by_last_arrival`, only the work that
    would fall before the last arrival, had every job started on arrival, counts
    (`offered_by_last_arrival`): run times are heavy-tailed, and a few long jobs can hold
    most of a trace's work past its arrivals, where a measure taken while jobs arrive never
    sees it."""
    if not shapes or jobs < 1 or templates < 1 or mean_interarrival_s <= 0:
        raise ValueError("need shapes, jobs >= 1, templates >= 1, interarrival > 0")
    if busy_gpus is not None and busy_gpus <= 0:
        raise ValueError("the offered load must be positive")
    rng = random.Random(seed)
    kinds = []
    for _ in range(templates):
        shape = rng.choice(shapes)
        median = math.exp(rng.uniform(math.log(120.0), math.log(8 * 3600.0)))
        kinds.append((shape, median))
    drawn = []
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_interarrival_s)
        kind = int(rng.paretovariate(1.2)) % templates
        shape, median = kinds[kind]
        drawn.append((i, kind, shape, t, max(10.0, rng.lognormvariate(math.log(median), 0.5))))
    scale = 1.0
    if busy_gpus is not None and t > 0:
        work = sum(s.num_gpu * s.gpu_milli / MILLI_PER_GPU * run for _, _, s, _, run in drawn)
        scale = work / busy_gpus / t
        if load_by_last_arrival:
            scale = _scale_by_last_arrival(
                [(a, s.num_gpu * s.gpu_milli / MILLI_PER_GPU, run) for _, _, s, a, run in drawn],
                busy_gpus, scale)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(OPENB_COLUMNS)
    for i, kind, shape, arrival, runtime in drawn:
        at = round(arrival * scale)
        writer.writerow((f"gen-t{kind:03d}-{i:05d}", shape.cpu_milli, shape.memory_mib,
                         shape.num_gpu, shape.gpu_milli, "|".join(sorted(shape.models)), shape.qos,
                         "Succeeded", at, at + round(runtime), at))
    return out.getvalue()


def offered_by_last_arrival(jobs: Sequence[tuple[float, float, float]]) -> float:
    """GPUs kept busy on average from the first arrival to the last by (arrival, GPUs, run
    seconds) jobs, each started on arrival and counted only up to the last arrival."""
    first = min(a for a, _, _ in jobs)
    last = max(a for a, _, _ in jobs)
    if last <= first:
        return math.inf
    return sum(gpus * min(run, last - a) for a, gpus, run in jobs) / (last - first)


def _scale_by_last_arrival(jobs: Sequence[tuple[float, float, float]], busy_gpus: float,
                           start: float) -> float:
    """The factor on arrival times at which `offered_by_last_arrival` is `busy_gpus`. It
    only falls as arrivals spread out (each job's counted part shrinks against a longer
    window), so bisection finds it; `start` (the factor counting all of the work) is an upper
    bound, since less of the work is counted."""
    def offered(scale: float) -> float:
        return offered_by_last_arrival([(a * scale, g, r) for a, g, r in jobs])

    first = min(a for a, _, _ in jobs)
    last = max(a for a, _, _ in jobs)
    most = sum(g * (last - a) for a, g, _ in jobs) / (last - first) if last > first else 0.0
    if most <= busy_gpus:  # arrivals packed ever closer never offer more than this
        raise ValueError(f"{len(jobs)} jobs cannot keep {busy_gpus:g} GPUs busy up to their "
                         f"last arrival (at most {most:.1f}): generate more jobs")
    low, high = start, start
    while offered(low) < busy_gpus:
        low /= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if offered(mid) > busy_gpus else (low, mid)
    return low
