"""How much of its GPU share a replayed job really uses: seeded over-requests and late rises.

Traces record what pods asked for, not what they used. Jobs ask for far more than they
use: on NERSC's Perlmutter, 55 % of the jobs that requested 80 GB GPUs peaked at half of
the GPU's memory or less (Cankur et al., "Characterizing Production GPU Workloads using
System-wide Telemetry Data", 2025). Here each job's peak, as a share of what it asked for,
is drawn from Beta(2, 2.25), which puts 55 % of jobs at or below one half (median 0.47),
floored at 5 %; the replay applies it to the trace's GPU share (openb's `gpu_milli`, memory
and SMs together).

Runs of one template (the same code and model) peak alike: the peak is drawn per template,
and each run's varies around it by a factor e^N(0, `RUN_SIGMA`) (capped at the request).

A job's use is not flat: with probability `RISE_P` it runs at `RISE_FROM` of its peak until
a point drawn uniformly in 20-80 % of its run (a larger evaluation batch, a second model
loaded), then at its peak. Lending that trusted the early peak must then give the lent
part back: these rises are what reclaims are made of.

Interactive sessions are left open: notebook sessions hold their GPUs for most of their
lifetimes without using them (Carver et al., "NotebookOS", ASPLOS 2026, on production notebook
traces; the paper gives no share per session that could be fitted here). So each
interactive job does its work in the first `SESSION_WORK` share of its trace's run time,
drawn uniformly per job (an assumption, not a fit), and then sits open with its memory held
and no GPU activity until the trace's end, unless its project's idle-session timeout stops it.

Pure: a seed and a job key in, a usage profile out.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PEAK_BETA = (2.0, 2.25)
PEAK_FLOOR = 0.05
RUN_SIGMA = 0.1
RISE_P = 0.2
RISE_FROM = 0.6
RISE_AT = (0.2, 0.8)
SESSION_WORK = (0.1, 0.5)  # the share of an interactive session's run with GPU activity
# the replay's clock adds and subtracts epoch-sized floats: a rise event's own instant can
# come out a hair before the rise, so it counts from this much earlier
RISE_SLACK_S = 1e-3


@dataclass(frozen=True)
class Usage:
    """One job's use of its share: `peak` of it at most; before `rise_at` (a fraction of
    its run time; None: no rise) only `RISE_FROM` of that; no GPU activity after `idle_from`
    (a fraction of its run time; None: active to its end), its memory still held."""

    peak: float
    rise_at: float | None = None
    idle_from: float | None = None

    def active_s(self, run_s: float) -> float:
        """Seconds of its run with GPU activity (the work it does)."""
        return run_s if self.idle_from is None else self.idle_from * run_s

    def used(self, work_s: float, run_s: float) -> float:
        """The share of its request the job has peaked at after `work_s` of its run."""
        if self.rise_at is not None and work_s < self.rise_at * run_s - RISE_SLACK_S:
            return self.peak * RISE_FROM
        return self.peak

    def rise_after(self, work_s: float, run_s: float) -> float | None:
        """Seconds of work from `work_s` until the rise, or None if none is ahead."""
        if self.rise_at is None or work_s >= self.rise_at * run_s - RISE_SLACK_S:
            return None
        return self.rise_at * run_s - work_s


def usage(template_seed: str, job_seed: str, interactive: bool = False) -> Usage:
    """The usage of a job of a template (the same seeds, the same usage); an interactive
    one goes idle part way through its run."""
    template_peak = random.Random(template_seed).betavariate(*PEAK_BETA)
    rng = random.Random(job_seed)
    peak = min(1.0, max(PEAK_FLOOR, template_peak * rng.lognormvariate(0.0, RUN_SIGMA)))
    rises = rng.random() < RISE_P
    rise_at = rng.uniform(*RISE_AT)
    idle_from = (random.Random(f"{job_seed}:session").uniform(*SESSION_WORK) if interactive
                 else None)
    return Usage(peak, rise_at if rises else None, idle_from)


def peak_of(request_units: int, share: float) -> int:
    """A peak in whole units (per cent of SMs, MiB) of a request, never below one."""
    return max(1, math.ceil(request_units * share))
