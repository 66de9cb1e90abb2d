"""The operator's settings from its environment (the chart's `operator.extraEnv`)."""

from __future__ import annotations

import pytest

from carpool.operator.reconciler import ReconcilerConfig


def test_defaults_look_an_hour_back_at_arrivals() -> None:
    config = ReconcilerConfig.from_environment({})
    assert config.admission.arrival_window_s == 3600.0
    assert config.admission.aging_step_s == 3600.0
    assert config.admission.keep_promises


def test_keeping_promises_is_switched_by_true_or_false_only() -> None:
    for value, expected in (("false", False), ("0", False), (" True", True), ("1", True)):
        config = ReconcilerConfig.from_environment({"CARPOOL_KEEP_PROMISES": value})
        assert config.admission.keep_promises is expected
    with pytest.raises(ValueError, match="CARPOOL_KEEP_PROMISES must be true or false, not 'no'"):
        ReconcilerConfig.from_environment({"CARPOOL_KEEP_PROMISES": "no"})


def test_the_environment_sets_the_arrival_window_and_the_aging_step() -> None:
    config = ReconcilerConfig.from_environment({"CARPOOL_ARRIVAL_WINDOW_S": "120",
                                                "CARPOOL_AGING_STEP_S": "1800"})
    assert config.admission.arrival_window_s == 120.0
    assert config.admission.aging_step_s == 1800.0


def test_the_unschedulable_timeout_is_ten_minutes_unless_set() -> None:
    assert ReconcilerConfig.from_environment({}).unschedulable_timeout_s == 600.0
    config = ReconcilerConfig.from_environment({"CARPOOL_UNSCHEDULABLE_TIMEOUT_S": "0"})
    assert config.unschedulable_timeout_s == 0.0
    for bad in ("soon", "-5", "inf", "nan"):
        with pytest.raises(ValueError, match="CARPOOL_UNSCHEDULABLE_TIMEOUT_S must be"):
            ReconcilerConfig.from_environment({"CARPOOL_UNSCHEDULABLE_TIMEOUT_S": bad})
