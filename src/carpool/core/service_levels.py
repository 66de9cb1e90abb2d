"""The three measures of a service sharing a GPU: throughput, P99 latency and failure rate.

A serving job's code reports them through `carpool.workload.Service`: over the last window
(`WINDOW_S` by default) how many requests finished, how many of those failed, and their
latencies as counts in fixed buckets. The buckets grow by `BUCKET_GROWTH` from `BUCKET_BASE_S`,
the same for every job, so reports add up: a project's, a class's or a node's P99 is read from
the sum of its jobs' histograms, never from an average of P99s (which means nothing).

The report travels like progress does (`core.checkpointing`): the job writes `service.json`
into its report directory; the device plugin's node agent checks it here, adds what only it
knows (the GPU's model and how many jobs share it) and records it as the GpuJob's
`status.service`. `aggregate` groups recorded measures per job, project, class and node for
`kubectl carpool services` and the Prometheus exports; `core.interference` learns from them.

Everything here is pure; a report is a tenant's file, so parsing is strict and bounded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from carpool.core.checkpointing import (
    MAX_REPORT_BYTES,
    STATUS_SERVICE,
    ReportError,
    format_time,
    parse_time,
)

SERVICE_FILE: Final = "service.json"
WINDOW_S: Final = 30.0  # what a report covers by default
BUCKET_BASE_S: Final = 0.0001  # upper bound of the first latency bucket (0.1 ms)
BUCKET_GROWTH: Final = 1.08  # each bucket's bound is this much above the last (8 % resolution)
BUCKETS: Final = 160  # the last bound is about 22 s; slower requests count in the last bucket
MAX_COUNT: Final = 10**12


def bucket_bound(index: int) -> float:
    """The upper bound (seconds) of latency bucket `index`."""
    return BUCKET_BASE_S * BUCKET_GROWTH ** index


def bucket_of(latency_s: float) -> int:
    """The bucket a latency counts in: the first whose bound is at least it."""
    if latency_s <= BUCKET_BASE_S:
        return 0
    index = math.ceil(math.log(latency_s / BUCKET_BASE_S) / math.log(BUCKET_GROWTH) - 1e-9)
    return min(BUCKETS - 1, index)


@dataclass(frozen=True)
class Histogram:
    """Latency counts per bucket, sparse: (bucket index, count) in index order."""

    counts: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, latencies: Iterable[float]) -> Histogram:
        tally: dict[int, int] = {}
        for latency in latencies:
            index = bucket_of(latency)
            tally[index] = tally.get(index, 0) + 1
        return cls(tuple(sorted(tally.items())))

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)

    def __add__(self, other: Histogram) -> Histogram:
        tally = dict(self.counts)
        for index, n in other.counts:
            tally[index] = tally.get(index, 0) + n
        return Histogram(tuple(sorted(tally.items())))

    def quantile(self, q: float) -> float | None:
        """The latency under which a fraction `q` of the requests finished, interpolated
        inside its bucket (so within `BUCKET_GROWTH` of the true value); None when empty."""
        total = self.total
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for index, n in self.counts:
            if seen + n >= rank:
                low = bucket_bound(index - 1) if index > 0 else 0.0
                return low + (bucket_bound(index) - low) * max(0.0, rank - seen) / n
            seen += n
        return bucket_bound(self.counts[-1][0])


@dataclass(frozen=True)
class ServiceReport:
    """What a job's code reports about the requests it served over `window_s` before `time`."""

    time: float
    window_s: float
    requests: int  # finished, failed ones included
    failures: int
    latency: Histogram

    @property
    def throughput(self) -> float:
        """Requests per second that succeeded."""
        return (self.requests - self.failures) / self.window_s if self.window_s > 0 else 0.0

    @property
    def failure_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    @property
    def p99_s(self) -> float | None:
        return self.latency.quantile(0.99)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ReportError(f"{what} must be an integer from 0 to {MAX_COUNT}, got {value!r:.40}")
    return value


def _histogram(raw: Any, what: str) -> Histogram:
    if not isinstance(raw, list) or len(raw) > BUCKETS:
        raise ReportError(f"{what} must be a list of at most {BUCKETS} [bucket, count] pairs")
    out: list[tuple[int, int]] = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            raise ReportError(f"{what}: each entry must be [bucket, count], got {item!r:.40}")
        index, n = _count(item[0], f"{what}: a bucket"), _count(item[1], f"{what}: a count")
        if index >= BUCKETS or (out and index <= out[-1][0]):
            raise ReportError(f"{what}: buckets must be distinct, in order, below {BUCKETS}")
        out.append((index, n))
    return Histogram(tuple(out))


def parse_service(text: str | bytes, now: float) -> ServiceReport:
    """A service report: `{"time": RFC 3339, "window": seconds > 0, "requests": n,
    "failures": n <= requests, "latency": [[bucket, count], ...]}` (buckets of successful
    and failed requests alike, in index order)."""
    what = SERVICE_FILE
    if len(text) > MAX_REPORT_BYTES:
        raise ReportError(f"{what} is {len(text)} bytes; at most {MAX_REPORT_BYTES}")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as err:
        raise ReportError(f"{what} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{what} must be a JSON object, got {type(data).__name__}")
    raw_time = data.get("time")
    if not isinstance(raw_time, str):
        raise ReportError(f"{what}: 'time' must be an RFC 3339 string, got {raw_time!r:.40}")
    window = data.get("window")
    if isinstance(window, bool) or not isinstance(window, int | float) \
            or not math.isfinite(window) or not 0 < window <= 86400:
        raise ReportError(f"{what}: 'window' must be seconds in (0, 86400], got {window!r:.40}")
    requests = _count(data.get("requests"), f"{what}: 'requests'")
    failures = _count(data.get("failures", 0), f"{what}: 'failures'")
    if failures > requests:
        raise ReportError(f"{what}: 'failures' ({failures}) must not exceed 'requests' "
                          f"({requests})")
    latency = _histogram(data.get("latency", []), f"{what}: 'latency'")
    return ServiceReport(min(parse_time(raw_time), now), float(window), requests, failures,
                         latency)


def encode_service(report: ServiceReport) -> str:
    return json.dumps({"time": format_time(report.time), "window": round(report.window_s, 3),
                       "requests": report.requests, "failures": report.failures,
                       "latency": [list(c) for c in report.latency.counts]})


# ---------------------------------------------------------------- recorded in the GpuJob


@dataclass(frozen=True)
class ServiceMeasure:
    """A job's latest report as its GpuJob records it, with where it ran: the GPU model and
    how many jobs shared that GPU (itself included) when the node agent recorded it, also
    counted by weight (each neighbour as the copies of this job its sharing weight makes,
    `placement.counted_sharers`; None where not recorded), and the neighbours' templates as
    their assignments name them ("" for one that names none; empty when alone or not
    recorded), from which pairs are learned (`core.interference`)."""

    report: ServiceReport
    attempt: int
    gpu_model: str = ""
    sharing: int = 1
    sharing_by_weight: float | None = None
    neighbours: tuple[str, ...] = ()


def service_status(measure: ServiceMeasure) -> dict[str, Any]:
    """The `status.service` field recording `measure` (every key, so a merge patch keeps
    nothing of the last one)."""
    report = measure.report
    p99 = report.p99_s
    return {STATUS_SERVICE: {
        "time": format_time(report.time), "window": round(report.window_s, 3),
        "attempt": measure.attempt, "requests": report.requests, "failures": report.failures,
        "throughput": round(report.throughput, 3),
        "p99Ms": None if p99 is None else round(p99 * 1000, 3),
        "failureRate": round(report.failure_rate, 6),
        "latency": [list(c) for c in report.latency.counts],
        "gpuModel": measure.gpu_model, "sharing": measure.sharing,
        "sharingByWeight": measure.sharing_by_weight,
        "sharingNeighbours": list(measure.neighbours)}}


def measure_from_status(status: Mapping[str, Any]) -> ServiceMeasure | None:
    """The recorded measure of a GpuJob status; None when there is none or it is malformed
    (only the node agent writes it)."""
    raw = status.get(STATUS_SERVICE)
    if not isinstance(raw, Mapping):
        return None
    try:
        report = parse_service(json.dumps({k: raw.get(k) for k in
                                           ("time", "window", "requests", "failures",
                                            "latency")}), math.inf)
        attempt = _count(raw.get("attempt", 0), "attempt")
        sharing = _count(raw.get("sharing", 1), "sharing")
    except (ReportError, TypeError):
        return None
    by_weight = raw.get("sharingByWeight")
    if not isinstance(by_weight, int | float) or isinstance(by_weight, bool) \
            or not math.isfinite(by_weight) or by_weight < 1:
        by_weight = None
    neighbours = raw.get("sharingNeighbours")
    if not isinstance(neighbours, list) or len(neighbours) >= max(1, sharing) \
            or not all(isinstance(n, str) for n in neighbours):
        neighbours = []  # not recorded, or not as the node agent records it
    return ServiceMeasure(report, attempt, str(raw.get("gpuModel") or ""), max(1, sharing),
                          None if by_weight is None else float(by_weight), tuple(neighbours))


# ---------------------------------------------------------------- aggregation


class Scope:
    """What measures are grouped by (the label of the group's key)."""

    JOB: Final = "job"
    PROJECT: Final = "project"
    CLASS: Final = "class"
    NODE: Final = "node"
    ALL: Final = (JOB, PROJECT, CLASS, NODE)


@dataclass(frozen=True)
class Measured:
    """One job's latest measure and what it is grouped by."""

    job: str  # namespace/name
    project: str
    job_class: str
    node: str
    measure: ServiceMeasure


@dataclass(frozen=True)
class Summary:
    """The three measures of a group of jobs: throughput adds up, P99 comes from the summed
    histograms, the failure rate is failures over all requests."""

    scope: str
    key: str
    jobs: int
    throughput: float  # successful requests per second, all jobs together
    requests: int
    failures: int
    latency: Histogram

    @property
    def p99_s(self) -> float | None:
        return self.latency.quantile(0.99)

    @property
    def failure_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def measured_of(gpujob: Mapping[str, Any]) -> Measured | None:
    """A running GpuJob's latest measure with what it is grouped by; None when it does not
    run or reports none. The one reading the operator's metrics and the reports share."""
    status = gpujob.get("status") or {}
    if status.get("phase") != "Running":
        return None
    measure = measure_from_status(status)
    if measure is None:
        return None
    meta, spec = gpujob.get("metadata") or {}, gpujob.get("spec") or {}
    return Measured(f"{meta.get('namespace', '')}/{meta.get('name', '')}",
                    str(spec.get("project", "")), str(spec.get("class", "batch")),
                    str(status.get("node", "")), measure)


def aggregate(measured: Sequence[Measured], scope: str) -> list[Summary]:
    """Summaries per `scope` key (`Scope.ALL`), in key order."""
    if scope not in Scope.ALL:
        raise ValueError(f"unknown scope {scope!r}; expected one of {', '.join(Scope.ALL)}")
    groups: dict[str, list[ServiceReport]] = {}
    for m in measured:
        key = {Scope.JOB: m.job, Scope.PROJECT: m.project, Scope.CLASS: m.job_class,
               Scope.NODE: m.node}[scope]
        groups.setdefault(key, []).append(m.measure.report)
    out = []
    for key in sorted(groups):
        reports = groups[key]
        latency = Histogram()
        for r in reports:
            latency = latency + r.latency
        out.append(Summary(scope, key, len(reports), sum(r.throughput for r in reports),
                           sum(r.requests for r in reports), sum(r.failures for r in reports),
                           latency))
    return out
