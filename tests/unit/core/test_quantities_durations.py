import pytest

from carpool.core.durations import format_duration, parse_duration
from carpool.core.quantities import gib_ceil, parse_quantity, quantity_mib, quantity_milli


@pytest.mark.parametrize(
    ("text", "mib"),
    [("16Gi", 16384), ("1Gi", 1024), ("512Mi", 512), ("1G", 954), ("1.5Gi", 1536),
     (1073741824, 1024)],
)
def test_memory_quantities_in_mib(text: str | int, mib: int) -> None:
    assert quantity_mib(text) == mib


def test_cpu_quantities_in_milli() -> None:
    assert quantity_milli("250m") == 250
    assert quantity_milli("2") == 2000


@pytest.mark.parametrize("bad", ["", "Gi", "16GB", "sixteen", "1..5Gi", "--1"])
def test_bad_quantities_name_the_text(bad: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(bad)


def test_gib_rounds_up() -> None:
    assert gib_ceil(1025) == 2
    assert gib_ceil(1024) == 1


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("45m", 2700), ("1h30m", 5400), ("2d", 172800), ("500ms", 0.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "1", "h", "1hour", "-5m", "1h 30m"])
def test_bad_durations(bad: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_format_round_trips() -> None:
    for seconds in (0, 59, 3600, 5400, 90061):
        assert parse_duration(format_duration(seconds)) == seconds
