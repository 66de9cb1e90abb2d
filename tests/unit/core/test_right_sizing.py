"""Right-sizing advice (`core.right_sizing`): the 90th-percentile peak with a fifth more, in
whole GiB, per project and template, once enough runs finished, where it is below the ask."""

from __future__ import annotations

from carpool.core.right_sizing import MIN_SAMPLES, recommended_mib, size_advice

GIB = 1024


def test_too_few_runs_say_nothing() -> None:
    assert recommended_mib([3 * GIB] * (MIN_SAMPLES - 1)) is None
    assert size_advice([("p", "train", 40 * GIB, 3 * GIB)] * (MIN_SAMPLES - 1)) == []


def test_the_high_peak_with_headroom_in_whole_gib() -> None:
    peaks = [2 * GIB, 3 * GIB, 3 * GIB, 4 * GIB, 10 * GIB]  # p90 (nearest rank): 10 GiB
    assert recommended_mib(peaks) == 12 * GIB  # 10 x 1.2
    assert recommended_mib([100, 200, 300]) == GIB  # never below 1 GiB


def test_advice_only_where_it_is_below_the_ask_most_spare_first() -> None:
    runs = ([("vision", "resnet", 40 * GIB, 5 * GIB)] * 4
            + [("vision", "bert", 16 * GIB, 6 * GIB)] * 3
            + [("nlp", "llama", 80 * GIB, 78 * GIB)] * 5)  # uses what it asks: no advice
    advice = size_advice(runs)
    assert [(a.project, a.template, a.runs, a.recommended_mib // GIB, a.spare_mib // GIB)
            for a in advice] == [("vision", "resnet", 4, 6, 34), ("vision", "bert", 3, 8, 8)]
