"""Which changes of a waiting job's status are written at once and which wait for its next
refresh (`wait_change_is_urgent`): what a user plans by goes out at once."""

from __future__ import annotations

from typing import Any

from carpool.core.timestamps import format_timestamp
from carpool.operator.reconciler import wait_change_is_urgent

NOW = 1_800_000_000.0
JUMP = 60.0


def wait(estimate_in: float | None, latest_in: float | None = None,
         reason: str = "Queued", position: int = 3) -> dict[str, Any]:
    """A wait as written: estimate and range end `*_in` seconds from NOW."""
    return {"reason": reason, "queuePosition": position,
            "estimatedStart": None if estimate_in is None
            else format_timestamp(NOW + estimate_in),
            "estimatedStartLatest": None if latest_in is None
            else format_timestamp(NOW + latest_in)}


def urgent(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return wait_change_is_urgent(before, after, NOW, JUMP)


def test_position_and_small_estimate_moves_wait_for_the_refresh() -> None:
    assert not urgent(wait(600, 1200), wait(600, 1200, position=2))
    assert not urgent(wait(600, 1200), wait(650, 1200))


def test_reason_and_estimate_changes_are_urgent() -> None:
    assert urgent(wait(600), wait(600, reason="QuotaExceeded"))
    assert urgent(wait(600), wait(661))
    assert urgent(wait(None), wait(600))
    assert urgent(wait(600), wait(None))


def test_a_range_that_appears_or_goes_is_urgent() -> None:
    assert urgent(wait(600), wait(600, 1200))
    assert urgent(wait(600, 1200), wait(600))


def test_the_range_end_is_urgent_past_a_quarter_of_the_time_until_it() -> None:
    # 1200 s away: a quarter is 300 s
    assert not urgent(wait(600, 1200), wait(600, 1490))
    assert urgent(wait(600, 1200), wait(600, 1510))
    assert urgent(wait(600, 1200), wait(600, 890))
    # near ends: at least the estimate's own jump
    assert not urgent(wait(20, 100), wait(20, 150))
    assert urgent(wait(20, 100), wait(20, 170))
