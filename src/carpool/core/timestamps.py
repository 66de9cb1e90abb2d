"""RFC 3339 timestamps as the API server and Carpool write them: read and written here only.

Every stamp Carpool reads (pod and container times, heartbeats, status records, the extender's
bind time) carries a UTC offset, usually `Z`; a stamp without one is refused rather than
guessed at in the machine's local zone.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime


def parse_timestamp(text: str) -> datetime:
    """An RFC 3339 time ("2026-11-29T19:00:00Z", fractions and offsets allowed) as an aware
    datetime; ValueError naming the text when it is not one or has no UTC offset."""
    try:
        stamp = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"not an RFC 3339 time: {text!r}") from None
    if stamp.tzinfo is None:
        raise ValueError(f"RFC 3339 time {text!r} has no UTC offset (want e.g. a trailing Z)")
    return stamp


def epoch_seconds(text: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 time; None when absent (None or ""), ValueError when bad."""
    if not text:
        return None
    return parse_timestamp(text).timestamp()


def epoch_of(text: object) -> float | None:
    """Epoch seconds of an RFC 3339 time; None if absent, not a string or malformed (a
    watch-fed cache or a report skips a bad value instead of failing on it)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return parse_timestamp(text).timestamp()
    except ValueError:
        return None


def as_written(epoch: float) -> float:
    """`epoch` as a status holds it once written with `format_timestamp` (to the second):
    what a replay keeps of the times the operator writes, so both decide from the same."""
    return float(math.floor(epoch))


def format_timestamp(epoch: float) -> str:
    """RFC 3339 in UTC to the second, as Kubernetes writes its own times."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_run_time(epoch: float) -> str:
    """A usage record's start or end: to the second when `epoch` is whole (a pod's own times),
    else to the millisecond (the operator's clock, when it saw a pod gone). Cutting that to
    the second would take half a second off each such run on average: a bias, not noise, on
    the bill of a project whose pods are often deleted."""
    if epoch == math.floor(epoch):
        return format_timestamp(epoch)
    stamp = datetime.fromtimestamp(round(epoch, 3), UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def format_timestamp_micro(epoch: float) -> str:
    """RFC 3339 in UTC to the microsecond (the extender's bind time orders binds that
    happen within one second)."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
