"""How far a GPU may be shared: interference profiles learned from what running jobs report.

Sharing a GPU raises total throughput only up to a point, and every job added slows the
others and stretches their latency tails. Carpool learns, per GPU model and job template
(`jobs.job_template`), how one job's throughput and P99 latency change with the number of
jobs on its GPU (the sharing degree, itself included), from the service measures the node
agent records (`core.service_levels`: each carries the GPU model and the degree it ran at).
From a profile it takes each job's sharing limit, the most jobs its GPU may carry:

- a job with objectives (`spec.objectives`): the largest degree at which the profile keeps
  its P99 under `p99Latency` (with `P99_HEADROOM`) and its slowdown against running alone
  under `maxSlowdown`, every smaller degree included, and on towards the next degree, to the
  hundredth, as far as the curves between the two keep them (1 when even running alone
  breaks them: sharing only makes it worse);
- a job without: the knee of the measured throughput curve, the first degree from which one
  more job adds less than `KNEE_GAIN` to the GPU's total throughput (none while the curve
  still climbs at the highest degree measured, so Carpool goes on to measure the next).

A template with measures at fewer than two degrees has no profile, and its jobs no limit:
placement is then what it is without this module.

A limit is measured in the company of copies of the job's own template; lighter company
presses on the GPU less, heavier company more. So each job also gets a sharing weight: the
share of its GPU's throughput it takes running alone (its throughput alone against the most
its template's jobs together got from one GPU, in thousandths, at least MIN_WEIGHT), 1000
(`WHOLE_SHARER`) for a template with no profile. A GPU takes one more job only while that
job's limit and the limit of every job already there allow it, each job counting every
neighbour as the copies of itself the neighbour's weight makes (`placement.sharing_rejection`).
A report counts at its GPU's degree so counted (`report_degree`): what a light service
measured beside heavy ones extends its profile to the load it really shared.

Weights say how much load a neighbour adds, not how much a job suffers from it: a light
service beside one heavy job's long kernels can wait as if beside many copies of itself. So
where reports name their neighbours' templates (the node agent records them from the
assignments), a template's curve is learned from its reports among copies, and each report
beside other templates teaches pairs instead: the copies of itself its company made (where
its P99 reaches on the curve), first from companies of one other template, then from the
rest, where templates so measured count as measured and what is left is shared among the
others by weight, the worse company kept (`learn`); and where a company of templates all
measured so reached further than their counts add up to (a crowd of neighbours each cheap
alone), what lies beyond raises their counts, shared by weight. A job then counts a
neighbour as the pair measured, else by weight (`resources.Sharer`), each job carrying, per
GPU model, how every template measured beside it counted it (`Profiles.felt_by`).

Everything here is pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import pairwise
from typing import Any

from carpool.core import service_levels
from carpool.core.decoding import first_image
from carpool.core.jobs import Job, job_template
from carpool.core.resources import (
    MAX_DEGREE,
    MAX_PAIRS,
    WHOLE_SHARER,
    FeltBy,
    GpuRequest,
    Objectives,
)

KNEE_GAIN = 0.10  # one more job must add at least a tenth to the GPU's total throughput
MIN_DEGREES = 2  # measured degrees before a template has a profile
EXTRAPOLATE = 1  # degrees beyond the highest measured that an objective may be judged at
# A degree's P99 is a high quantile of the companies reported there (`_tails`): the jobs
# reported it in whatever company shared their GPUs, and an objective must hold in the worse
# company, not the typical.
TAIL_QUANTILE = 0.9
# Reports are noisy: a degree keeps a P99 objective only with its P99 this far under the target.
P99_HEADROOM = 0.9
MIN_WEIGHT = 50  # a sharing weight's floor (thousandths): no job is free company
MIN_PAIR_COUNT = 0.05  # the least a neighbour counts as, in copies: no job is free company


@dataclass(frozen=True)
class Sample:
    """One job's measure: its template on a GPU model, shared by `degree` jobs."""

    model: str
    template: str
    degree: int
    throughput: float  # the job's own successful requests per second
    p99_s: float | None
    # the GPU and minute the report was made in: reports with the same one saw one company
    # and count once for a degree's tail (`learn`); empty: a company of its own
    company: str = ""
    # the templates of the other jobs on its GPU, where the report names them (empty: not
    # named, or alone); a report beside other templates teaches pairs (`learn`)
    neighbours: tuple[str, ...] = ()

    @property
    def among_copies(self) -> bool:
        """Made alone, beside copies of its own template, or in a company it does not name:
        a point of its template's own curve (`learn`)."""
        return all(n == self.template for n in self.neighbours)


@dataclass(frozen=True)
class Point:
    """A profile at one degree: the median throughput of the jobs' measures there and the
    TAIL_QUANTILE of their P99s, read from the non-decreasing curve nearest those tails
    (`_non_decreasing`)."""

    degree: int
    throughput: float  # per job
    p99_s: float | None
    samples: int

    @property
    def total(self) -> float:
        """The GPU's throughput when every one of the `degree` jobs runs this template."""
        return self.degree * self.throughput


@dataclass(frozen=True)
class Profile:
    """How one template behaves on one GPU model as its GPU is shared more."""

    model: str
    template: str
    points: tuple[Point, ...]  # by degree, at least MIN_DEGREES of them
    # per neighbour template measured beside it: the copies of this template one such
    # neighbour counts as (`learn`; `resources.Sharer`), template order
    pairs: tuple[tuple[str, float], ...] = ()

    def point(self, degree: int) -> Point | None:
        return next((p for p in self.points if p.degree == degree), None)

    def throughput_at(self, degree: int) -> float:
        """Per-job throughput at `degree`: measured, else linear between the measured
        degrees around it, else along the nearest two (never below 0)."""
        return max(0.0, _along([(p.degree, p.throughput) for p in self.points], degree))

    def p99_at(self, degree: int) -> float | None:
        """P99 at `degree`, read like `throughput_at` (never below the lowest measured)."""
        known = [(p.degree, p.p99_s) for p in self.points if p.p99_s is not None]
        if not known:
            return None
        if len(known) == 1:
            return known[0][1] if degree <= known[0][0] else None
        return max(min(v for _, v in known), _along(known, degree))

    def alone(self) -> float:
        """Throughput running alone (degree 1, measured or read along the curve)."""
        return self.throughput_at(1)

    def weight(self) -> int:
        """How heavy a sharer a job of this template is, in thousandths: its throughput alone
        against the most the measured degrees' jobs got together (at least MIN_WEIGHT)."""
        most = max(max(p.total for p in self.points), self.alone())
        if most <= 0:
            return WHOLE_SHARER
        return max(MIN_WEIGHT, min(WHOLE_SHARER, round(WHOLE_SHARER * self.alone() / most)))

    def knee(self) -> int | None:
        """The first measured degree after which one more job adds less than KNEE_GAIN of
        the GPU's total throughput; None while the measured curve still climbs."""
        measured = [p.degree for p in self.points]
        for degree in range(1, max(measured)):
            now = degree * self.throughput_at(degree)
            more = (degree + 1) * self.throughput_at(degree + 1)
            if now > 0 and more < now * (1 + KNEE_GAIN):
                return degree
        return None

    def keeps(self, objectives: Objectives, degree: int) -> bool | None:
        """Whether a job of this template keeps `objectives` at `degree`; None when the
        profile cannot say (too far beyond what was measured)."""
        if degree > max(p.degree for p in self.points) + EXTRAPOLATE:
            return None
        if objectives.p99_latency_s is not None:
            p99 = self.p99_at(degree)
            if p99 is None:
                return None
            if p99 > objectives.p99_latency_s * P99_HEADROOM:
                return False
        if objectives.max_slowdown is not None:
            shared = self.throughput_at(degree)
            if shared <= 0 or self.alone() / shared > objectives.max_slowdown:
                return False
        return True

    def limit(self, objectives: Objectives | None) -> float | None:
        """The most jobs a GPU may carry with a job of this template on it, counted as
        `placement.counted_sharers` counts them; None: no limit from this profile.

        With objectives, the limit lies where the profile's curves cross them, to the
        hundredth (`_crossing`): neighbours lighter than the job count as less than one copy,
        so a job whose objective breaks at two copies may still take a light neighbour."""
        if objectives is None:
            return self.knee()
        best = 0
        for degree in range(1, MAX_DEGREE + 1):
            kept = self.keeps(objectives, degree)
            if kept is None:
                break
            if not kept:
                return self._crossing(objectives, best) if best else 1
            best = degree
        return max(1, best)

    def degree_of_p99(self, p99_s: float) -> float | None:
        """The degree, counted in copies, at which this profile's P99 reaches `p99_s`:
        along its curve, on past the last measured degree as the last two go (MAX_DEGREE
        where they stop rising); None without a P99 curve."""
        known = [(p.degree, p.p99_s) for p in self.points if p.p99_s is not None]
        if len(known) < 2:
            return None
        if p99_s <= known[0][1]:
            return float(known[0][0])
        for (d0, v0), (d1, v1) in pairwise(known):
            if v0 < p99_s <= v1:
                return d0 + (d1 - d0) * (p99_s - v0) / (v1 - v0)
        (d0, v0), (d1, v1) = known[-2], known[-1]
        if v1 <= v0:
            return float(MAX_DEGREE)
        return min(float(MAX_DEGREE), d1 + (d1 - d0) * (p99_s - v1) / (v1 - v0))

    def _crossing(self, objectives: Objectives, kept: int) -> float:
        """Where, between degree `kept` (kept) and the next (broken), the curves cross the
        objectives: both are straight there (`_along`), rounded down to the hundredth."""
        reach = 1.0
        if objectives.p99_latency_s is not None:
            low, high = self.p99_at(kept), self.p99_at(kept + 1)
            goal = objectives.p99_latency_s * P99_HEADROOM
            if low is not None and high is not None and high > goal:
                reach = min(reach, (goal - low) / (high - low))
        if objectives.max_slowdown is not None:
            low, high = self.throughput_at(kept), self.throughput_at(kept + 1)
            goal = self.alone() / objectives.max_slowdown
            if high < goal <= low:
                reach = min(reach, (low - goal) / (low - high))
        return kept + math.floor(max(0.0, min(reach, 0.99)) * 100) / 100


def _along(points: list[tuple[int, float]], degree: int) -> float:
    """The value at `degree` on the line through the measured points (sorted by degree):
    linear between neighbours, extended along the first or last two beyond the ends."""
    if len(points) == 1:
        return points[0][1]
    if degree <= points[0][0]:
        (d0, v0), (d1, v1) = points[0], points[1]
    elif degree >= points[-1][0]:
        (d0, v0), (d1, v1) = points[-2], points[-1]
    else:
        (d0, v0), (d1, v1) = next((a, b) for a, b in pairwise(points)
                                  if a[0] <= degree <= b[0])
    return v0 + (v1 - v0) * (degree - d0) / (d1 - d0)


@dataclass(frozen=True)
class Profiles:
    """Every learned profile, by (GPU model, template)."""

    by_key: Mapping[tuple[str, str], Profile]

    def get(self, model: str, template: str) -> Profile | None:
        return self.by_key.get((model, template))

    def limits(self, template: str, objectives: Objectives | None
               ) -> tuple[tuple[str, float], ...]:
        """A job's sharing limit per GPU model its template has a profile on, model order
        (`GpuRequest.sharing_limits`); empty: no limit anywhere."""
        out = []
        for model, profile in self._by_template.get(template, ()):
            limit = profile.limit(objectives)
            if limit is not None:
                out.append((model, limit))
        return tuple(out)

    def weights(self, template: str) -> tuple[tuple[str, int], ...]:
        """A job's sharing weight per GPU model its template has a profile on, model order
        (`GpuRequest.sharing_weights`); a model not listed: WHOLE_SHARER."""
        return tuple((model, profile.weight())
                     for model, profile in self._by_template.get(template, ()))

    @cached_property
    def _by_template(self) -> dict[str, tuple[tuple[str, Profile], ...]]:
        """Each template's profiles, model order, found once (a pass asks for every job's)."""
        found: dict[str, list[tuple[str, Profile]]] = {}
        for (model, template), profile in sorted(self.by_key.items()):
            found.setdefault(template, []).append((model, profile))
        return {template: tuple(profiles) for template, profiles in found.items()}

    def felt_by(self, template: str) -> tuple[tuple[str, FeltBy], ...]:
        """Per GPU model, the pairs learned about a job of `template`: each template whose
        profile measured one beside it, and the copies of itself it counted the job as
        (`GpuRequest.sharing_felt_by`), model and template order; at most MAX_PAIRS a model,
        the heaviest kept."""
        return self._felt_by_template.get(template, ())

    @cached_property
    def _felt_by_template(self) -> dict[str, tuple[tuple[str, FeltBy], ...]]:
        """`felt_by` of every template measured beside another, worked out once (a pass asks
        for every job's)."""
        found: dict[str, dict[str, list[tuple[str, float]]]] = {}
        for (model, victim), profile in sorted(self.by_key.items()):
            for neighbour, felt in profile.pairs:
                found.setdefault(neighbour, {}).setdefault(model, []).append((victim, felt))
        return {template: tuple(
            (model, tuple(sorted(sorted(pairs, key=lambda p: -p[1])[:MAX_PAIRS])))
            for model, pairs in sorted(by_model.items()))
            for template, by_model in found.items()}


NO_PROFILES = Profiles({})


def _high(values: list[float]) -> float | None:
    """The TAIL_QUANTILE of `values`, interpolated between the two reports around it; None
    when there are none. Interpolated rather than nearest rank: with fewer than ten reports
    the nearest rank is the largest, and one outlier would then set a degree's P99 alone."""
    if not values:
        return None
    ordered = sorted(values)
    position = TAIL_QUANTILE * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _non_decreasing(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence nearest `values` (least squares, each value counting as
    often as its weight): wherever a value is under the one before it, the two and their
    neighbours as far as needed are replaced by their weighted mean (pool adjacent violators).

    A job's latency tail does not shrink as more jobs share its GPU; a degree measured lower
    than the one before it was a quiet moment or the one before a loud one. Read as measured,
    one noisy degree would cap a limit that the next degree's own reports allow."""
    blocks: list[tuple[float, int, int]] = []  # (weighted mean, total weight, values pooled)
    for value, weight in zip(values, weights, strict=True):
        blocks.append((value, weight, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            value2, weight2, count2 = blocks.pop()
            value1, weight1, count1 = blocks.pop()
            total = weight1 + weight2
            blocks.append(((value1 * weight1 + value2 * weight2) / total, total,
                           count1 + count2))
    return [value for value, _, count in blocks for _ in range(count)]


def _tails(samples: list[Sample]) -> list[float]:
    """The P99s a degree's tail is read from: one per company the reports were made in (the
    median of that company's), each report without one on its own. Copies sharing a GPU
    report one company several times over; counted once each, a degree measured with copies
    does not outvote the few reports made beside heavier jobs at the same degree."""
    by_company: dict[str, list[float]] = {}
    alone: list[float] = []
    for s in samples:
        if s.p99_s is None:
            continue
        if s.company:
            by_company.setdefault(s.company, []).append(s.p99_s)
        else:
            alone.append(s.p99_s)
    return [*alone, *(statistics.median(v) for v in by_company.values())]


def learn(samples: Iterable[Sample]) -> Profiles:
    """Profiles from job measures: per (model, template) a curve and the pairs.

    The curve: per degree the median throughput and the TAIL_QUANTILE P99 (interpolated) of
    its companies' P99s (`_tails`), the tails made non-decreasing over the degrees (each
    degree weighed by its companies), from the reports made among copies (`among_copies`);
    a (model, template) measured so at fewer than MIN_DEGREES degrees reads its curve from
    all its reports, each at its recorded degree, and learns no pairs.

    The pairs: a report made beside other templates counts its company as the copies its
    P99 reaches on the curve (`Profile.degree_of_p99`); what lies beyond itself and its own
    copies goes to the other neighbours (`_pairs`), and a pair's count is the TAIL_QUANTILE
    over its companies (the worse company, as for a degree's P99). Samples without a model
    or template, or with no throughput, say nothing."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        if not s.model or not s.template or s.degree < 1 or not math.isfinite(s.throughput) \
                or s.throughput <= 0:
            continue
        groups.setdefault((s.model, s.template), []).append(s)
    profiles: dict[tuple[str, str], Profile] = {}
    paired: dict[tuple[str, str], list[Sample]] = {}
    for key, group in groups.items():
        own = [s for s in group if s.among_copies]
        if len({s.degree for s in own}) >= MIN_DEGREES:
            profiles[key] = _curve(key, own)
            paired[key] = [s for s in group if not s.among_copies]
        elif len({s.degree for s in group}) >= MIN_DEGREES:
            profiles[key] = _curve(key, group)
    weights = {key: profile.weight() for key, profile in profiles.items()}
    for key, reports in paired.items():
        pairs = _pairs(profiles[key], reports, weights)
        if pairs:
            profiles[key] = replace(profiles[key], pairs=pairs)
    return Profiles(profiles)


def _curve(key: tuple[str, str], samples: list[Sample]) -> Profile:
    """One template's curve on one model from `samples`, each at its degree (`learn`)."""
    by_degree: dict[int, list[Sample]] = {}
    for s in samples:
        by_degree.setdefault(s.degree, []).append(s)
    degrees = sorted(by_degree)
    reported = {d: _tails(by_degree[d]) for d in degrees}
    measured = [d for d in degrees if reported[d]]
    smooth = dict(zip(measured, _non_decreasing(
        [_high(reported[d]) or 0.0 for d in measured],
        [len(reported[d]) for d in measured]), strict=True))
    return Profile(key[0], key[1], tuple(
        Point(d, statistics.median(s.throughput for s in by_degree[d]), smooth.get(d),
              len(by_degree[d])) for d in degrees))


def _pairs(profile: Profile, reports: list[Sample], weights: Mapping[tuple[str, str], int]
           ) -> tuple[tuple[str, float], ...]:
    """What each neighbour template counted as beside `profile`'s template (`learn`): first
    from the companies of one other template, then from the rest, where the templates
    already measured so count as measured and what is left goes to the others by weight (a
    light neighbour that sat beside a heavy one does not take the heavy one's blame)."""
    reached = []
    for n, s in enumerate(reports):
        degree = None if s.p99_s is None else profile.degree_of_p99(s.p99_s)
        if degree is not None:
            reached.append((s.company or f"#{n}", s, degree))

    def beyond(s: Sample, degree: float, known: Mapping[str, float]) -> float:
        """The copies a report's company made beyond the job itself, its own template's
        copies and the neighbours `known` already counts."""
        others = [t for t in s.neighbours if t != s.template]
        return (degree - 1 - (len(s.neighbours) - len(others))
                - sum(known[t] for t in others if t in known))

    def shares(model: str, among: list[str]) -> dict[str, float]:
        """What each neighbour of `among` (one entry per job) takes of what they made
        together, by weight."""
        total = sum(weights.get((model, t), WHOLE_SHARER) for t in among)
        return {t: weights.get((model, t), WHOLE_SHARER) / total for t in among}

    def worst(by_company: Mapping[str, dict[str, list[float]]]) -> dict[str, float]:
        """Each template's count: the median within a company, the worse companies kept."""
        return {template: round(_high([statistics.median(v) for v in companies.values()])
                                or 0.0, 2)
                for template, companies in by_company.items()}

    def counted(known: Mapping[str, float], alike: bool) -> dict[str, float]:
        by_pair: dict[str, dict[str, list[float]]] = {}  # neighbour -> company -> counts
        for company, s, degree in reached:
            others = [t for t in s.neighbours if t != s.template]
            unknown = [t for t in others if t not in known]
            if alike != (len(set(others)) == 1) or not unknown:
                continue
            left, share = max(0.0, beyond(s, degree, known)), shares(s.model, unknown)
            for template in set(unknown) - {""}:  # a neighbour its assignment does not name
                by_pair.setdefault(template, {}).setdefault(company, []).append(
                    max(MIN_PAIR_COUNT, left * share[template]))
        return worst(by_pair)

    def crowded(known: Mapping[str, float]) -> dict[str, float]:
        """`known` raised where a company of several templates, all known, reached further
        than their counts add up to: what lies beyond is shared among them by weight, on top
        of what each counts. A pair measured alone can say a neighbour costs nearly nothing
        where a crowd of such neighbours fills the GPU and the job breaks."""
        raised: dict[str, dict[str, list[float]]] = {}
        for company, s, degree in reached:
            others = [t for t in s.neighbours if t != s.template]
            left = beyond(s, degree, known)
            if len(set(others)) < 2 or any(t not in known for t in others) or left <= 0:
                continue
            share = shares(s.model, others)
            for template in set(others) - {""}:
                raised.setdefault(template, {}).setdefault(company, []).append(
                    known[template] + left * share[template])
        return {template: max(known[template], count)
                for template, count in worst(raised).items()}

    alone = counted({}, alike=True)
    known = {**counted(alone, alike=False), **alone}
    return tuple(sorted({**known, **crowded(known)}.items()))


def sample_of(gpujob: Mapping[str, Any]) -> Sample | None:
    """The sample a GpuJob's recorded service measure gives (any phase: a finished job's
    last measure still says how its template ran); None without one."""
    measure = service_levels.measure_from_status(gpujob.get("status") or {})
    if measure is None:
        return None
    meta, spec = gpujob.get("metadata") or {}, gpujob.get("spec") or {}
    report = measure.report
    gpus = (gpujob.get("status") or {}).get("gpus")
    first = gpus[0] if isinstance(gpus, list) and gpus and isinstance(gpus[0], Mapping) else {}
    uuid = first.get("uuid")
    return Sample(measure.gpu_model, job_template(str(meta.get("name", "")), first_image(spec)),
                  report_degree(measure.sharing, measure.sharing_by_weight),
                  report.throughput, report.p99_s,
                  f"{uuid}@{int(report.time // 60)}" if isinstance(uuid, str) and uuid else "",
                  measure.neighbours)


def report_degree(sharing: int, by_weight: float | None) -> int:
    """The degree a report counts at in its template's profile: the jobs on its GPU counted
    by weight (`placement.counted_sharers`), to the nearest whole job, where recorded; else
    the jobs. A profile's degrees are copies of the template, so a report made beside heavier
    jobs counts at the higher degree their load makes, and one beside lighter jobs lower."""
    if by_weight is None:
        return max(1, sharing)
    return max(1, round(by_weight))


def learn_from_gpujobs(gpujobs: Iterable[Mapping[str, Any]]) -> Profiles:
    """`learn` over what the GpuJobs' statuses record (the operator and the extender both)."""
    return learn(s for s in map(sample_of, gpujobs) if s is not None)


def limited(request: GpuRequest, template: str, profiles: Profiles) -> GpuRequest:
    """`request` with its template, and its sharing limits, weights and pairs from
    `profiles` (none where its template has no profile: placement is then exactly what it is
    without profiles).

    The template goes with every request whose template has a profile, limit or not: its
    neighbours' reports name it (the node agent reads it from the assignments), so pairs are
    learned about a job that keeps no limit of its own (a batch job whose curve still
    climbs), and a job beside it then counts it as measured. A template without a profile
    stays unnamed: its requests stay those of their shape, which the placement memos share
    across every template."""
    if not profiles.by_key:
        limits: tuple[tuple[str, float], ...] = ()
        weights: tuple[tuple[str, int], ...] = ()
        felt_by: tuple[tuple[str, FeltBy], ...] = ()
    else:
        limits = profiles.limits(template, request.objectives)
        weights = profiles.weights(template)
        felt_by = profiles.felt_by(template)
    named = template if limits or weights or felt_by else ""
    if (limits, weights, felt_by, named) == (request.sharing_limits, request.sharing_weights,
                                             request.sharing_felt_by,
                                             request.sharing_template):
        return request
    return replace(request, sharing_limits=limits, sharing_weights=weights,
                   sharing_felt_by=felt_by, sharing_template=named)


def with_limits(jobs: Iterable[Job], profiles: Profiles) -> list[Job]:
    """Jobs whose requests carry their sharing limits (`limited`); the operator's snapshot."""
    out = []
    for job in jobs:
        request = limited(job.request, job.template, profiles)
        out.append(job if request is job.request else replace(job, request=request))
    return out
