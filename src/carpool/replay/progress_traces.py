"""How jobs that report progress progress, for the queue replay: seeded, noisy, as loops go.

A replayed job that reports follows a progress curve over its work time (the seconds it has
run, all attempts together; the replay resumes a preempted job where it stopped), ending at
1 exactly when its trace run time is spent. The noise is what makes a rate from a few
reports wrong:

- **Start-up**: loading data and model before the first step, 1-5 % of the run (at most
  ten minutes), no progress.
- **Rate changes**: the run is cut at 0-4 random points into stretches whose rates differ
  by a factor e^N(0, 0.3) (other data, a neighbour on the GPU, a learning-rate schedule).
- **Pauses**: an evaluation every 5-20 % of the training, each 1-4 % of the run, reported
  as phase `eval`; a checkpoint save after each, 0.2-1 % of the run, phase `checkpoint`.
- **Restarts**: with probability `RESTART_P`, once, the process dies and restarts from
  its last checkpoint: the progress since that checkpoint is done again after a new start-up.

Reports come as the workload helper sends them (`carpool.workload.Progress`): every 30 s of
work, with the fraction done, the phase, the seconds this attempt paused, and the last 16
training samples (one every 15 s of training, and one at each pause's start and end).

Pure: a seed and a run time in, curves and reports out.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass

from carpool.core.jobs import ProgressDetail

RESTART_P = 0.15
RATE_SIGMA = 0.3
# as `carpool.workload.Progress` reports by default: a report every 30 s, a training sample
# every 15 s, the latest 16 samples in each report
REPORT_EVERY_S = 30.0
SAMPLE_EVERY_S = 15.0
SAMPLES = 16


def report_every(run_s: float) -> float:
    """Seconds of work between two reports (the same for every run)."""
    return REPORT_EVERY_S


@dataclass(frozen=True)
class Piece:
    """[start, end) of work time in one phase, progress going from `p0` to `p1`."""

    start: float
    end: float
    p0: float
    p1: float
    phase: str  # "start" (start-up), "train", "eval", "checkpoint"


@dataclass(frozen=True)
class Curve:
    """One job's progress over its work time (see the module docstring)."""

    pieces: tuple[Piece, ...]
    run_s: float
    starts: tuple[float, ...] = ()  # the pieces' starts, for bisect

    @property
    def every(self) -> float:
        """Seconds of work between two reports."""
        return report_every(self.run_s)

    def _piece(self, w: float) -> Piece:
        i = max(0, bisect.bisect_right(self.starts, w) - 1)
        return self.pieces[i]

    def at(self, w: float) -> tuple[float, str]:
        """(fraction done, phase) after `w` seconds of work."""
        w = min(max(w, 0.0), self.run_s)
        piece = self._piece(w)
        span = piece.end - piece.start
        share = (w - piece.start) / span if span > 0 else 1.0
        return piece.p0 + (piece.p1 - piece.p0) * min(1.0, share), piece.phase

    def paused(self, w0: float, w1: float) -> float:
        """Seconds of work within [w0, w1) spent evaluating or saving."""
        return sum(max(0.0, min(w1, p.end) - max(w0, p.start)) for p in self.pieces
                   if p.phase in ("eval", "checkpoint"))

    def report(self, since: float, w: float, run_start: float
               ) -> tuple[float, float, ProgressDetail] | None:
        """The latest report of an attempt that began at work time `since` (at epoch
        `run_start`) once it has worked until `w`: (fraction, epoch time, detail); None
        before its first report.

        As `carpool.workload.Progress` makes it: training samples at the report ticks and
        at each pause's start and end, the last `SAMPLES` of them; samples and paused
        seconds only since the process last started (a restart from a checkpoint is a new
        process: it keeps none)."""
        every = report_every(self.run_s)
        first = math.floor(since / every) + 1
        last = math.floor(min(w, self.run_s) / every)
        if last < first:
            return None
        at = last * every
        process = since  # where the current process started (after a restart)
        for piece in self.pieces:
            if piece.start >= at:
                break
            if piece.phase == "start" and piece.end > since:
                process = max(process, min(piece.end, at))
        points: list[float] = []
        tick = math.floor(at / SAMPLE_EVERY_S)
        while len(points) < SAMPLES and tick * SAMPLE_EVERY_S >= max(process, since):
            if self.at(tick * SAMPLE_EVERY_S)[1] == "train":
                points.append(tick * SAMPLE_EVERY_S)
            tick -= 1
        window = points[-1] if points else at
        for piece in self.pieces:
            if piece.start >= at:
                break
            if piece.phase in ("eval", "checkpoint") and piece.end >= window:
                points.extend(t for t in (piece.start, piece.end) if window <= t <= at)
        samples = [(run_start + t - since, self.at(t)[0]) for t in sorted(set(points))
                   ][-SAMPLES:]
        value, phase = self.at(at)
        shown = phase if phase in ("eval", "checkpoint") else "train"
        return value, run_start + at - since, ProgressDetail(
            shown, self.paused(process, at), tuple(samples))


def curve(run_s: float, seed: str) -> Curve:
    """The progress curve of a job that runs `run_s` seconds of work, drawn from `seed`."""
    rng = random.Random(seed)
    startup = min(600.0, rng.uniform(0.01, 0.05) * run_s)
    # the training in nominal units: stretches of rates, cut by evaluations and saves
    cuts = sorted(rng.random() for _ in range(rng.randint(0, 4)))
    bounds = [0.0, *cuts, 1.0]
    rates = [math.exp(rng.gauss(0.0, RATE_SIGMA)) for _ in range(len(bounds) - 1)]
    eval_every = rng.uniform(0.05, 0.2)
    eval_len = rng.uniform(0.01, 0.04) * run_s
    save_len = rng.uniform(0.002, 0.01) * run_s
    restart_at = rng.random() if rng.random() < RESTART_P else None
    # (progress from, progress to, phase, nominal seconds or None for training)
    raw: list[tuple[float, float, str, float]] = [(0.0, 0.0, "start", startup)]
    checkpoints = [0.0]
    p = 0.0

    def train(to: float) -> None:
        nonlocal p
        while p < to - 1e-12:
            k = min(bisect.bisect_right(bounds, p) - 1, len(rates) - 1)
            end = min(to, bounds[k + 1])
            raw.append((p, end, "train", (end - p) / rates[k]))
            p = end

    marks = sorted({min(1.0, eval_every * i) for i in range(1, int(1 / eval_every) + 1)})
    restarted = False
    for mark in [*marks, 1.0]:
        if restart_at is not None and not restarted and restart_at < mark:
            train(restart_at)
            restarted = True
            back = max(c for c in checkpoints if c <= restart_at)
            raw.append((back, back, "start", startup))
            p = back
        train(mark)
        if mark < 1.0:
            raw.append((p, p, "eval", eval_len))
            raw.append((p, p, "checkpoint", save_len))
            checkpoints.append(p)
    # training takes what the fixed phases leave of the run (at least a tenth of it)
    fixed = sum(s for _, _, ph, s in raw if ph != "train")
    trained = sum(s for _, _, ph, s in raw if ph == "train")
    scale_fixed = min(1.0, 0.9 * run_s / fixed) if fixed > 0 else 1.0
    scale_train = (run_s - fixed * scale_fixed) / trained if trained > 0 else 0.0
    pieces: list[Piece] = []
    t = 0.0
    for p0, p1, phase, seconds in raw:
        length = seconds * (scale_train if phase == "train" else scale_fixed)
        pieces.append(Piece(t, t + length, p0, p1, phase))
        t += length
    last = pieces[-1]
    pieces[-1] = Piece(last.start, run_s, last.p0, last.p1, last.phase)
    return Curve(tuple(pieces), run_s, tuple(p.start for p in pieces))
