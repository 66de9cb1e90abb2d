"""One job's first estimate scored against its first start (the replay's rule, also the
operator's `carpool_eta_*` metrics), and which first starts are scored, with numbers checked
by hand."""

from __future__ import annotations

import pytest

from carpool.core.decoding import first_start
from carpool.core.eta_accuracy import (
    AFTER,
    BEFORE,
    EARLY,
    INSIDE,
    LATE,
    LONG_WAIT,
    ON_TIME,
    SHORT_WAIT,
    FirstStart,
    score_first_estimate,
    score_first_start,
)
from carpool.core.resources import JobClass
from carpool.core.timestamps import format_timestamp

T0 = 1_800_000_000.0


def test_a_long_wait_gets_a_signed_relative_error_and_its_range_result() -> None:
    # submitted at 0, told 300, started 400: 100 s late of a 400 s wait
    late = score_first_estimate(0, 400, 300, 200, 450)
    assert (late.wait_s, late.relative, late.signed) == (400, 0.25, 0.25)
    assert late.direction == LATE and late.range_result == INSIDE
    assert late.range_width == pytest.approx(250 / 400)
    assert late.short_error_s is None
    # told 200 (range 150..180), started 120: 80 s early of a 120 s wait, before its range
    early = score_first_estimate(0, 120, 200, 150, 180)
    assert early.relative == pytest.approx(2 / 3) and early.signed == pytest.approx(-2 / 3)
    assert early.direction == EARLY and early.range_result == BEFORE
    # told 100 (range 80..150), started 600: x5 of its wait, after its range
    after = score_first_estimate(0, 600, 100, 80, 150)
    assert after.relative == pytest.approx(500 / 600) and after.range_result == AFTER
    # the range's ends belong to it
    assert score_first_estimate(0, 150, 100, 150, 200).range_result == INSIDE
    assert score_first_estimate(0, 200, 100, 150, 200).range_result == INSIDE


def test_exactly_a_minute_counts_as_waiting_and_no_range_scores_none() -> None:
    exact = score_first_estimate(10, 70, 70)
    assert (exact.relative, exact.direction, exact.range_result) == (0.0, ON_TIME, None)
    assert exact.range_width is None and exact.short_error_s is None


def test_a_short_wait_gets_only_an_absolute_error_in_seconds() -> None:
    short = score_first_estimate(5, 20, 50, 0, 60)  # waited 15 s, told 45 s
    assert short.short_error_s == 30 and short.wait_s == 15
    assert (short.relative, short.direction, short.range_result) == (None, None, None)
    assert score_first_estimate(0, 59, 30).short_error_s == 29


def _status(**epochs: float) -> dict[str, str]:
    return {k: format_timestamp(T0 + v) for k, v in epochs.items()}


def test_a_first_start_is_scored_only_where_it_had_a_first_estimate() -> None:
    # told 300, started 400 of a 400 s wait: the long wait's score
    assert score_first_start(0, 400, 300, 200, 450) == FirstStart(
        400, LONG_WAIT, score_first_estimate(0, 400, 300, 200, 450))
    # never told: started after 400 s, or 5 s, unscored
    unscored = score_first_start(0, 400, None)
    assert (unscored.wait_s, unscored.wait, unscored.score, unscored.scored) == (
        400, LONG_WAIT, None, False)
    assert score_first_start(10, 15, None) == FirstStart(5, SHORT_WAIT, None)
    # 59 s is short, 60 s long, as for the score itself
    short = score_first_start(0, 59, 30)
    assert short.wait == SHORT_WAIT and short.scored
    assert short.score is not None and short.score.short_error_s == 29
    assert score_first_start(0, 60, 30).wait == LONG_WAIT


def test_decoded_from_a_status_that_records_a_first_start() -> None:
    obj = {"metadata": {"name": "a", "namespace": "t", "creationTimestamp":
                        format_timestamp(T0 - 1000)}, "spec": {"class": "long"}}
    status = _status(submitTime=0, firstEstimatedStart=300, firstEstimatedStartEarliest=200,
                     firstEstimatedStartLatest=450, startTime=400)
    assert first_start(obj, status) == (JobClass.LONG, FirstStart(
        400, LONG_WAIT, score_first_estimate(0, 400, 300, 200, 450)))
    # no submitTime: from the object's creation; no range: none scored
    bare = first_start(obj, _status(firstEstimatedStart=300, startTime=400))
    assert bare is not None and bare[1].wait_s == 1400 and bare[1].score is not None
    assert bare[1].score.range_result is None
    assert bare[1].score.relative == pytest.approx(100 / 1400)
    # started without a first estimate: counted, not scored
    assert first_start(obj, _status(submitTime=0, startTime=400)) == (
        JobClass.LONG, FirstStart(400, LONG_WAIT, None))
    assert first_start(obj, _status(submitTime=0, firstEstimatedStart=300)) is None
    assert first_start({**obj, "spec": {"class": "bogus"}}, status) is None
