"""Replay latency-sensitive services and batch jobs on shared GPUs: Carpool's sharing limits
(interference profiles and objectives) against fixed sharing degrees.

A generated trace (seeded) of jobs of a few templates arrives over simulated hours on a
cluster of identical GPUs. How a template behaves when its GPU is shared is the replay's
ground truth (`Truth`): one job's throughput falls as `1 / (1 + slowdown x (d - 1))` at degree
d, its P99 rises as that and a tail term `1 + tail x (d - 1)` more, with seeded noise in each
report. Jobs never see the truth: each minute every running job reports its measured
throughput and P99 at its GPU's degree, as `carpool.workload.Service` does, and Carpool learns
its profiles from those reports alone (`core.interference.learn`), as the operator does from
the GpuJobs' status.

Placement, each minute, in arrival order (waiting jobs first): first fit over the GPUs by the
placement core's rule (`placement.gpu_rejection`), GPU memory included. A fixed degree d gives
every job a sharing limit of d; Carpool gives each job the limit its template's learned
profile allows (its objective; the knee of the throughput curve for a job without one; no
limit while the template has no profile). Services serve for their duration; a batch job ends
when it has done its work, at the rate its degree allows.

Scores: service-minutes whose P99 broke the service's target (violations), work done per hour
(throughput, in each template's alone-rate units: 1.0 = one job running alone), GPUs in use at
the peak, and the mean wait of services and of batch jobs. Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.core.interference import Profiles, Sample, learn
from carpool.core.placement import NodeState, gpu_rejection, grant_for
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, NodeInventory, Objectives

GIB = 1024
STEP_S = 60.0  # one placement pass and one report per running job each simulated minute
GPU_MEMORY_MIB = 80 * GIB
MODEL = "H100"
NOISE = 0.05  # a report's throughput and P99 are off by this much (log-normal sigma)
RECENT_REPORTS = 200  # reports kept per template and degree
RELEARN_STEPS = 10  # profiles learned again every 10 simulated minutes (and on a new degree)


@dataclass(frozen=True)
class Truth:
    """How one template behaves on a shared GPU (hidden from the policies)."""

    template: str
    service: bool  # latency-sensitive: serves for its duration, has a P99 target
    memory_mib: int
    alone_p99_s: float
    slowdown: float  # per extra job on the GPU
    tail: float  # the P99's extra growth per extra job

    def throughput(self, degree: int) -> float:
        """One job's rate at `degree`, as a share of its rate alone."""
        return 1.0 / (1.0 + self.slowdown * (degree - 1))

    def p99_s(self, degree: int) -> float:
        return self.alone_p99_s / self.throughput(degree) * (1.0 + self.tail * (degree - 1))


TEMPLATES = (
    Truth("chat-encoder", True, 8 * GIB, 0.012, 0.30, 0.35),
    Truth("vision-resnet", True, 6 * GIB, 0.007, 0.45, 0.25),
    Truth("ranker", True, 4 * GIB, 0.004, 0.20, 0.15),
    Truth("finetune", False, 24 * GIB, 0.5, 0.35, 0.0),
    Truth("embed-batch", False, 12 * GIB, 0.2, 0.15, 0.0),
    Truth("etl-augment", False, 10 * GIB, 0.3, 0.70, 0.0),
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

    @property
    def violation_share(self) -> float:
        return self.violation_minutes / self.service_minutes if self.service_minutes else 0.0


@dataclass
class _Replay:
    trace: Sequence[TraceJob]
    gpus: int
    fixed: int | None  # None: Carpool's limits
    seed: int
    # the latest reports per (template, degree), as the GpuJobs' statuses keep the latest
    recent: dict[tuple[str, int], deque[Sample]] = field(default_factory=dict)
    profiles: Profiles = field(default_factory=lambda: learn(()))
    stale: bool = False

    def report(self, sample: Sample) -> None:
        key = (sample.template, sample.degree)
        if key not in self.recent:
            self.recent[key] = deque(maxlen=RECENT_REPORTS)
            self.stale = True
        self.recent[key].append(sample)

    def relearn(self) -> None:
        self.profiles = learn(s for kept in self.recent.values() for s in kept)
        self.stale = False

    def limits(self, job: TraceJob) -> tuple[tuple[str, float], ...]:
        if self.fixed is not None:
            return ((MODEL, self.fixed),)
        objectives = (Objectives(p99_latency_s=job.p99_target_s)
                      if job.p99_target_s is not None else None)
        return self.profiles.limits(job.truth.template, objectives)

    def run(self, name: str) -> Scores:
        rng = random.Random(self.seed)
        inventory = NodeInventory("sim", tuple(Gpu(i, f"gpu-{i}", MODEL, GPU_MEMORY_MIB)
                                               for i in range(self.gpus)))
        pending = sorted(self.trace, key=lambda j: j.arrival_s)
        queue: list[TraceJob] = []
        running: list[_Running] = []
        waits: dict[bool, list[float]] = {True: [], False: []}
        service_minutes = violation_minutes = blind = 0
        work = 0.0
        peak = finished = 0
        now = 0.0
        end_s = max(j.arrival_s for j in self.trace) + 12 * 3600
        step = 0
        while (pending or queue or running) and now < end_s:
            if self.fixed is None and (self.stale or step % RELEARN_STEPS == 0):
                self.relearn()
            step += 1
            while pending and pending[0].arrival_s <= now:
                queue.append(pending.pop(0))
            state = NodeState(inventory, tuple(r.grant for r in running))
            placed = []
            frees = state.free()
            for job in queue:  # arrival order; a job that fits nowhere does not block others
                request = GpuRequest(1, job.truth.memory_mib, 0,
                                     sharing_limits=self.limits(job))
                for free in frees:
                    if gpu_rejection(free, request) is None:
                        grant = grant_for(free, request)
                        # on a GPU where neither it nor a job there had a limit to keep
                        blind_now = not request.sharing_limits and not free.sharing_limit
                        running.append(_Running(job, free.gpu.index, grant, now,
                                                blind=blind_now))
                        state = state.with_grants([grant])
                        frees = state.free()
                        waits[job.truth.service].append(now - job.arrival_s)
                        placed.append(job)
                        break
            queue = [j for j in queue if j not in placed]
            degree: dict[int, int] = {}
            for r in running:
                degree[r.gpu] = degree.get(r.gpu, 0) + 1
            peak = max(peak, len(degree))
            still = []
            for r in running:
                d = degree[r.gpu]
                rate = r.job.truth.throughput(d) * math.exp(rng.gauss(0.0, NOISE))
                p99 = r.job.truth.p99_s(d) * math.exp(rng.gauss(0.0, NOISE))
                self.report(Sample(MODEL, r.job.truth.template, d, rate, p99))
                work += rate * STEP_S / 3600.0
                if r.job.p99_target_s is not None:
                    service_minutes += 1
                    broken = p99 > r.job.p99_target_s
                    violation_minutes += broken
                    blind += broken and r.blind
                    r.done += STEP_S
                else:
                    r.done += rate * STEP_S
                if r.done >= r.job.duration_s:
                    finished += 1
                else:
                    still.append(r)
            running = still
            now += STEP_S
        hours = now / 3600.0
        return Scores(name, self.gpus, len(self.trace), finished, service_minutes,
                      violation_minutes, work / hours if hours else 0.0, peak,
                      statistics.fmean(waits[True]) if waits[True] else 0.0,
                      statistics.fmean(waits[False]) if waits[False] else 0.0,
                      len(self.profiles.by_key), blind)


POLICIES = ("fixed-1", "fixed-2", "fixed-3", "fixed-4", "fixed-5", "fixed-6", "carpool")


def replay(trace: Sequence[TraceJob], gpus: int, policy: str, seed: int = 0) -> Scores:
    """One policy's replay of `trace` on `gpus` GPUs (`POLICIES`)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    fixed = None if policy == "carpool" else int(policy.split("-")[1])
    return _Replay(trace, gpus, fixed, seed).run(policy)
