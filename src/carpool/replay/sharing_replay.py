"""Replay latency-sensitive services and batch jobs on shared GPUs: Carpool's sharing limits
(interference profiles, pairs of templates and objectives) against fixed sharing degrees.

A generated trace (seeded) of jobs of a few templates arrives over simulated hours on a
cluster of identical GPUs. How a template behaves on a shared GPU is the replay's ground truth
(`Truth`): each template puts a load on a GPU (`load`, its heaviness) and suffers from the
load of others (`slowdown`, its sensitivity); a job counts its neighbours as the copies of
itself their loads make, so a light, sensitive service slows beside one heavy job as beside
many copies of itself, and the heavy job hardly notices it (as measured on an H100:
`docs/benchmarks.md`). Each report carries seeded noise. Jobs never see the truth: each minute
every running job reports its measured throughput and P99 with what the node agent records
beside it (the jobs on its GPU, that count by sharing weight, and the neighbours' templates as
their grants name them), as `carpool.workload.Service` and the node agent do, and Carpool
learns its profiles and pairs from those reports alone (`core.interference.learn`), as the
operator does from the GpuJobs' status.

Placement, each minute, in arrival order (waiting jobs first), by the placement core's rule
(`placement.gpu_rejection`), GPU memory included: first fit for the fixed degrees (as a
sharing-by-count plugin packs), the extender's GPU choice for Carpool (`gpu_choice`), or
first fit for it too (`first_fit`). A fixed degree d gives
every job a sharing limit of d; Carpool gives each job the limit, weight and pairs its
template's learned profiles give (`core.interference.limited`: its objective; the knee of the
throughput curve for a job without one; no limit while the template has no profile). Carpool
by weight only learns from the same kind of reports with their neighbours' templates left out
(every neighbour counted by weight, no pairs). Carpool may first profile each template alone
and with copies of itself (`profile_degrees`), and each pair of templates once, as
`bench/latency_sharing.py` does on a GPU; else it learns from the trace alone. Services
serve for their duration; a batch job ends when it has done its work, at the rate its
company allows.

Scores: service-minutes whose P99 broke the service's target (violations; of those, the
minutes of services placed before their template had a profile, and the others' beside a
neighbour no pair had been measured for, counted by weight), work done per hour (throughput,
in each template's alone-rate units: 1.0 = one job running alone), GPUs in use at the peak,
the mean wait of services and of batch jobs, and the pairs learned. Pure: numbers in, numbers
out.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from carpool.core.derived import DerivedState
from carpool.core.gpu_choice import NoFit, choose_gpus
from carpool.core.interference import Profiles, Sample, learn, limited, report_degree
from carpool.core.placement import counted_sharers, gpu_rejection, grant_for
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, NodeInventory, Objectives
from carpool.core.scoring import RequestScorer, Scorer

GIB = 1024
STEP_S = 60.0  # one placement pass and one report per running job each simulated minute
GPU_MEMORY_MIB = 80 * GIB
MODEL = "H100"
NOISE = 0.05  # a report's throughput and P99 are off by this much (log-normal sigma)
RECENT_REPORTS = 200  # reports kept per template, degree and company
PROFILE_MINUTES = 10  # a profiling run's minutes per template and degree
RELEARN_STEPS = 10  # profiles learned again every 10 simulated minutes (and on a new degree)


@dataclass(frozen=True)
class Truth:
    """How one template behaves on a shared GPU (hidden from the policies).

    A job of this template counts its neighbours as `copies` of itself: the sum of their
    loads over its own. Its time per request grows by `slowdown` per copy so counted, its
    throughput falls by as much, and its P99 grows by that and by `tail` per copy more:
    beside d - 1 copies of itself, throughput `1 / (1 + slowdown (d - 1))`. Beside a job ten
    times its load a light service slows as beside ten copies of itself, while the heavy job
    counts it as a tenth of one (on an H100 a batch-1 ResNet counted a batch-32 job as about
    ten copies of itself, and was counted as 0.07 of one: `docs/benchmarks.md`). A job's own
    curve says nothing of its load: a sharing weight learned from it (`core.interference`)
    counts neighbours by how their own copies share a GPU, not by how they press on others."""

    template: str
    service: bool  # latency-sensitive: serves for its duration, has a P99 target
    memory_mib: int
    alone_p99_s: float
    slowdown: float  # per copy of itself its neighbours make
    tail: float  # the P99's extra growth per copy
    load: float  # how heavily one job presses on its GPU's neighbours (share of the GPU)

    def copies(self, neighbours: Sequence[Truth]) -> float:
        """The copies of itself `neighbours` make: their loads over its own."""
        return sum(n.load for n in neighbours) / self.load

    def throughput(self, neighbours: Sequence[Truth] = ()) -> float:
        """One job's rate beside `neighbours`, as a share of its rate alone."""
        return 1.0 / (1.0 + self.slowdown * self.copies(neighbours))

    def p99_s(self, neighbours: Sequence[Truth] = ()) -> float:
        return self.alone_p99_s / self.throughput(neighbours) * (
            1.0 + self.tail * self.copies(neighbours))


TEMPLATES = (
    Truth("chat-encoder", True, 8 * GIB, 0.012, 0.30, 0.35, 0.15),
    Truth("vision-resnet", True, 6 * GIB, 0.007, 0.45, 0.25, 0.06),
    Truth("ranker", True, 4 * GIB, 0.004, 0.20, 0.15, 0.04),
    Truth("finetune", False, 24 * GIB, 0.5, 0.35, 0.0, 0.60),
    Truth("embed-batch", False, 12 * GIB, 0.2, 0.15, 0.0, 0.35),
    Truth("etl-augment", False, 10 * GIB, 0.3, 0.70, 0.0, 0.30),
)


@dataclass(frozen=True)
class TraceJob:
    name: str
    truth: Truth
    arrival_s: float
    duration_s: float  # a service's serving time; a batch job's work, in seconds alone
    p99_target_s: float | None  # services only


def generate(jobs: int, seed: int, interarrival_s: float = 120.0,
             service_share: float = 0.5) -> list[TraceJob]:
    """`jobs` jobs, Poisson arrivals; services with P99 targets 1.5 to 4 times their P99
    alone, serving 20 min to 3 h; batch jobs of 10 min to 2 h of work alone."""
    rng = random.Random(seed)
    services = [t for t in TEMPLATES if t.service]
    batch = [t for t in TEMPLATES if not t.service]
    out, now = [], 0.0
    for n in range(jobs):
        now += rng.expovariate(1.0 / interarrival_s)
        if rng.random() < service_share:
            truth = rng.choice(services)
            out.append(TraceJob(f"{truth.template}-{n}", truth, now,
                                rng.uniform(20 * 60, 3 * 3600),
                                truth.alone_p99_s * rng.choice((1.5, 2.0, 3.0, 4.0))))
        else:
            truth = rng.choice(batch)
            out.append(TraceJob(f"{truth.template}-{n}", truth, now,
                                rng.uniform(10 * 60, 2 * 3600), None))
    return out


@dataclass
class _Running:
    job: TraceJob
    gpu: int
    grant: GpuGrant
    started_s: float
    done: float = 0.0  # work done (seconds alone) or serving time served
    blind: bool = False  # placed before its template (and those there) had a profile


@dataclass
class Scores:
    policy: str
    gpus: int
    jobs: int
    finished: int
    service_minutes: int
    violation_minutes: int
    work_per_hour: float  # alone-rate units of work done per simulated hour
    peak_gpus_busy: int
    mean_wait_service_s: float
    mean_wait_batch_s: float
    profiles: int = 0
    # violation minutes of services placed where no limit applied yet (no profile learned)
    violation_minutes_unprofiled: int = 0
    # of the others, those beside a neighbour counted by weight (no pair measured for the two
    # when the later of them was placed)
    violation_minutes_unpaired: int = 0
    pairs: int = 0  # pairs of templates learned, over every profile, at the end

    @property
    def violation_share(self) -> float:
        return self.violation_minutes / self.service_minutes if self.service_minutes else 0.0


@dataclass
class _Replay:
    trace: Sequence[TraceJob]
    gpus: int
    fixed: int | None  # None: Carpool's limits
    seed: int
    by_weight_only: bool = False  # Carpool learning as if no report named its neighbours
    profile_degrees: int = 0  # Carpool's profiling run before the trace (0: none)
    first_fit: bool = False  # Carpool placing first fit instead of by the GPU choice
    scorer: Scorer = field(default_factory=Scorer)
    # the latest reports per (template, degree, neighbours), as the GpuJobs' statuses keep
    # the latest: a company seen rarely is not pushed out by a frequent one
    recent: dict[tuple[str, int, tuple[str, ...]], deque[Sample]] = field(default_factory=dict)
    profiles: Profiles = field(default_factory=lambda: learn(()))
    requests: dict[tuple[str, float | None], GpuRequest] = field(default_factory=dict)
    stale: bool = False
    stale_requests: bool = False  # limits changed since the last placement pass

    def report(self, sample: Sample) -> None:
        key = (sample.template, sample.degree, sample.neighbours)
        if key not in self.recent:
            self.recent[key] = deque(maxlen=RECENT_REPORTS)
            # a new degree of a template's own curve: learned at once, as it may give the
            # template its profile (other companies wait for the next relearn)
            self.stale = self.stale or sample.among_copies
        self.recent[key].append(sample)

    def relearn(self) -> None:
        kept = (s for reports in self.recent.values() for s in reports)
        self.profiles = learn(replace(s, neighbours=()) for s in kept) \
            if self.by_weight_only else learn(kept)
        self.requests = {}
        self.stale = False
        self.stale_requests = True

    def request(self, job: TraceJob) -> GpuRequest:
        """The job's one-GPU request: a fixed degree's limit, or what Carpool's profiles give
        its template (`interference.limited`, as the operator and the extender ask)."""
        key = (job.truth.template, job.p99_target_s)
        if key not in self.requests:
            if self.fixed is not None:
                self.requests[key] = GpuRequest(1, job.truth.memory_mib, 0,
                                                sharing_limits=((MODEL, self.fixed),))
            else:
                objectives = (Objectives(p99_latency_s=job.p99_target_s)
                              if job.p99_target_s is not None else None)
                self.requests[key] = limited(GpuRequest(1, job.truth.memory_mib, 0,
                                                        objectives=objectives),
                                             job.truth.template, self.profiles)
        return self.requests[key]

    def profile(self, rng: random.Random) -> None:
        """A profiling run before the trace, as `bench/latency_sharing.py` makes one: each
        template alone and with copies of itself, up to `profile_degrees` jobs or as many
        as a GPU's memory holds, then each pair of templates once, PROFILE_MINUTES minutes
        each, every job reporting (a pair's jobs naming each other)."""
        def noisy(value: float) -> float:
            return value * math.exp(rng.gauss(0.0, NOISE))

        for truth in TEMPLATES:
            most = min(self.profile_degrees, GPU_MEMORY_MIB // truth.memory_mib)
            for degree in range(1, most + 1):
                company = [truth] * (degree - 1)
                for minute in range(PROFILE_MINUTES):
                    for _ in range(degree):
                        self.report(Sample(
                            MODEL, truth.template, degree,
                            noisy(truth.throughput(company)), noisy(truth.p99_s(company)),
                            f"profile {truth.template} x{degree}@{minute}",
                            (truth.template,) * (degree - 1)))
        for n, first in enumerate(TEMPLATES):
            for second in TEMPLATES[n + 1:]:
                if first.memory_mib + second.memory_mib > GPU_MEMORY_MIB:
                    continue
                for minute in range(PROFILE_MINUTES):
                    for truth, other in ((first, second), (second, first)):
                        self.report(Sample(
                            MODEL, truth.template, 2, noisy(truth.throughput([other])),
                            noisy(truth.p99_s([other])),
                            f"profile {first.template}+{second.template}@{minute}",
                            (other.template,)))

    def choose(self, state: DerivedState, request: GpuRequest) -> int | None:
        """The GPU a job gets (None: none takes it): the lowest-numbered that accepts it for
        a fixed degree (as a sharing-by-count plugin packs) and for `first_fit`, else the one
        the extender and the operator choose (`gpu_choice.choose_gpus`: among the GPUs that
        accept it, with sharing limits, those whose company is most like its own copies)."""
        if self.fixed is not None or self.first_fit:
            return next((f.gpu.index for f in state.frees if gpu_rejection(f, request) is None),
                        None)
        choice = choose_gpus(state, RequestScorer(request, self.scorer))
        return None if isinstance(choice, NoFit) else choice[1][0]

    def run(self, name: str) -> Scores:
        rng = random.Random(self.seed)
        if self.fixed is None and self.profile_degrees:
            self.profile(random.Random(f"profile {self.seed}"))
        inventory = NodeInventory("sim", tuple(Gpu(i, f"gpu-{i}", MODEL, GPU_MEMORY_MIB)
                                               for i in range(self.gpus)))
        pending = sorted(self.trace, key=lambda j: j.arrival_s)
        queue: list[TraceJob] = []
        running: list[_Running] = []
        waits: dict[bool, list[float]] = {True: [], False: []}
        service_minutes = violation_minutes = blind = unpaired = 0
        work = 0.0
        peak = finished = 0
        now = 0.0
        end_s = max(j.arrival_s for j in self.trace) + 12 * 3600
        step = 0
        refused: set[GpuRequest] = set()
        while (pending or queue or running) and now < end_s:
            if self.fixed is None and (self.stale or step % RELEARN_STEPS == 0):
                self.relearn()
            step += 1
            while pending and pending[0].arrival_s <= now:
                queue.append(pending.pop(0))
            if self.stale_requests:
                refused.clear()
                self.stale_requests = False
            state = DerivedState(inventory, tuple(r.grant for r in running))
            placed = []
            for job in queue:  # arrival order; a job that fits nowhere does not block others
                request = self.request(job)
                # a request no GPU took still finds none until a job ends or limits change:
                # more jobs on a GPU never make it take what it refused
                if request in refused:
                    continue
                index = self.choose(state, request)
                if index is None:
                    refused.add(request)
                    continue
                free = state.frees_by_index[index]
                grant = grant_for(free, request)
                # on a GPU where neither it nor a job there had a limit to keep
                blind_now = not request.sharing_limits and not free.sharing_limit
                running.append(_Running(job, index, grant, now, blind=blind_now))
                state = DerivedState.of(state.with_grants([grant]))
                waits[job.truth.service].append(now - job.arrival_s)
                placed.append(job)
            queue = [j for j in queue if j not in placed]
            on_gpu: dict[int, list[_Running]] = {}
            for r in running:
                on_gpu.setdefault(r.gpu, []).append(r)
            peak = max(peak, len(on_gpu))
            still = []
            for r in running:
                others = [o for o in on_gpu[r.gpu] if o is not r]
                company = [o.job.truth for o in others]
                rate = r.job.truth.throughput(company) * math.exp(rng.gauss(0.0, NOISE))
                p99 = r.job.truth.p99_s(company) * math.exp(rng.gauss(0.0, NOISE))
                self.report(self.sample(r, others, rate, p99, step))
                work += rate * STEP_S / 3600.0
                if r.job.p99_target_s is not None:
                    service_minutes += 1
                    broken = p99 > r.job.p99_target_s
                    violation_minutes += broken
                    blind += broken and r.blind
                    # beside a neighbour no pair was measured for when either was placed
                    unpaired += broken and not r.blind and self.fixed is None and any(
                        o.grant.sharer.pair_count(r.grant.sharer) is None for o in others)
                    r.done += STEP_S
                else:
                    r.done += rate * STEP_S
                if r.done >= r.job.duration_s:
                    finished += 1
                    refused.clear()
                else:
                    still.append(r)
            running = still
            now += STEP_S
        hours = now / 3600.0
        return Scores(name, self.gpus, len(self.trace), finished, service_minutes,
                      violation_minutes, work / hours if hours else 0.0, peak,
                      statistics.fmean(waits[True]) if waits[True] else 0.0,
                      statistics.fmean(waits[False]) if waits[False] else 0.0,
                      len(self.profiles.by_key), blind, unpaired,
                      sum(len(p.pairs) for p in self.profiles.by_key.values()))

    @staticmethod
    def sample(r: _Running, others: list[_Running], rate: float, p99: float,
               step: int) -> Sample:
        """A running job's report as the node agent records it (`deviceplugin.reports`): its
        GPU's jobs counted by the sharing weights their grants carry, the neighbours'
        templates as their grants name them ("" for one whose grant names none), and the GPU
        and minute as its company (`interference.sample_of`)."""
        counted = counted_sharers(r.grant.sharing_weight, [o.grant.sharing_weight for o in others])
        return Sample(MODEL, r.job.truth.template, report_degree(1 + len(others), counted),
                      rate, p99, f"gpu-{r.gpu}@{step}",
                      tuple(sorted(o.grant.sharing_template for o in others)))


POLICIES = ("fixed-1", "fixed-2", "fixed-3", "fixed-4", "fixed-5", "fixed-6", "carpool",
            "carpool-first-fit", "carpool-by-weight")


def replay(trace: Sequence[TraceJob], gpus: int, policy: str, seed: int = 0,
           profile_degrees: int = 0) -> Scores:
    """One policy's replay of `trace` on `gpus` GPUs (`POLICIES`); Carpool's policies first
    profile each template at 1..`profile_degrees` jobs (0: they learn from the trace alone)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if policy.startswith("carpool"):
        return _Replay(trace, gpus, None, seed, by_weight_only=policy == "carpool-by-weight",
                       profile_degrees=profile_degrees,
                       first_fit=policy == "carpool-first-fit").run(policy)
    return _Replay(trace, gpus, int(policy.split("-")[1]), seed).run(policy)
