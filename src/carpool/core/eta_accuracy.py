"""How far one job's first estimated start missed its actual first start: the one rule for the
replay's scores (`queue_replay.first_estimate_errors`), bench/admission.py and the operator's
`carpool_eta_*` metrics, so that a cluster's numbers and a replay's mean the same thing; and
which first starts that rule scores at all (`score_first_start`).

Pure: times in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_WAIT_S = 60.0  # relative ETA error only over jobs that waited at least this long

# where the actual start fell against the 80 % range shown with the first estimate
INSIDE, BEFORE, AFTER = "inside", "before", "after"
# which way the first estimate missed: the job started later or earlier than it said
LATE, EARLY, ON_TIME = "late", "early", "on_time"
# how long a job waited for its first start: under MIN_WAIT_S, or at least that
SHORT_WAIT, LONG_WAIT = "short", "long"


@dataclass(frozen=True)
class FirstEstimateScore:
    """One started job's first estimate against its first start.

    `relative` (|estimated - actual| / actual wait), `direction` and `range_result` only for
    a job that waited at least `MIN_WAIT_S` (`range_result` only where its first estimate
    came with a range); `short_error_s` (|estimated - actual| in seconds) only for one that
    waited less: a few seconds off a short wait is a large ratio that says little."""

    wait_s: float
    relative: float | None = None
    signed: float | None = None  # (actual - estimated) / wait: > 0 started later than said
    direction: str | None = None  # LATE, EARLY or ON_TIME
    range_result: str | None = None  # INSIDE, BEFORE or AFTER
    range_width: float | None = None  # (range end - range start) / wait
    short_error_s: float | None = None


def score_first_estimate(arrival: float, start: float, estimate: float,
                         low: float | None = None, high: float | None = None,
                         min_wait_s: float = MIN_WAIT_S) -> FirstEstimateScore:
    """The score of a job submitted at `arrival` whose first run started at `start`, first
    told `estimate` with the 80 % range `low`..`high` (None: no range was shown)."""
    wait = start - arrival
    if _wait_kind(wait, min_wait_s) == SHORT_WAIT:
        return FirstEstimateScore(wait, short_error_s=abs(estimate - start))
    signed = (start - estimate) / wait
    direction = LATE if start > estimate else EARLY if start < estimate else ON_TIME
    range_result = width = None
    if low is not None and high is not None:
        range_result = BEFORE if start < low else AFTER if start > high else INSIDE
        width = (high - low) / wait
    return FirstEstimateScore(wait, relative=abs(signed), signed=signed, direction=direction,
                              range_result=range_result, range_width=width)


@dataclass(frozen=True)
class FirstStart:
    """One job's first start: how long it waited (`wait`: SHORT_WAIT or LONG_WAIT) and its
    first estimate's score; `score` None: it started without ever being shown an estimate
    (admitted in its first pass, never estimated, its estimate's write lost), so nothing
    scored it."""

    wait_s: float
    wait: str
    score: FirstEstimateScore | None

    @property
    def scored(self) -> bool:
        return self.score is not None


def score_first_start(arrival: float, start: float, estimate: float | None,
                      low: float | None = None, high: float | None = None,
                      min_wait_s: float = MIN_WAIT_S) -> FirstStart:
    """A first start, scored by `score_first_estimate` where it had a first estimate
    (`estimate` None: it had none)."""
    wait = start - arrival
    score = (None if estimate is None
             else score_first_estimate(arrival, start, estimate, low, high, min_wait_s))
    return FirstStart(wait, _wait_kind(wait, min_wait_s), score)


def _wait_kind(wait_s: float, min_wait_s: float) -> str:
    return SHORT_WAIT if wait_s < min_wait_s else LONG_WAIT
