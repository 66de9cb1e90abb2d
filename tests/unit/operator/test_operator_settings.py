"""The operator's settings (`carpool.operator.settings`): one table, typed, each bad value
named, and every one documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.operator.settings import OperatorSettings

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference" / "settings.md"


def test_unset_and_empty_variables_give_the_defaults() -> None:
    assert OperatorSettings.from_environment({}) == OperatorSettings()
    blank = {env: " " for env, _, _ in OperatorSettings.documented()}
    assert OperatorSettings.from_environment(blank) == OperatorSettings()


def test_each_kind_of_value_is_read_and_checked() -> None:
    settings = OperatorSettings.from_environment({
        "CARPOOL_RESYNC_SECONDS": "2.5", "CARPOOL_WRITE_WORKERS": "4",
        "CARPOOL_KEEP_PROMISES": "false", "CARPOOL_NAMESPACE": "carpool-system",
        "CARPOOL_MPS_CLIENT_UID": "1000", "KUBECONFIG": "/k"})
    assert (settings.resync_s, settings.write_workers, settings.keep_promises,
            settings.namespace, settings.mps_client_uid, settings.kubeconfig) == (
        2.5, 4, False, "carpool-system", 1000, "/k")
    assert OperatorSettings.from_environment(
        {"KUBECONFIG": "/k", "CARPOOL_KUBECONFIG": "/c"}).kubeconfig == "/c"


@pytest.mark.parametrize(("env", "value", "says"), [
    ("CARPOOL_RESYNC_SECONDS", "soon", "must be a number of seconds"),
    ("CARPOOL_AGING_STEP_S", "-1", "must be 0 or more seconds"),
    ("CARPOOL_WAIT_REFRESH_S", "inf", "must be 0 or more seconds"),
    ("CARPOOL_WRITE_WORKERS", "4.5", "must be a whole number"),
    ("CARPOOL_METRICS_PORT", "-9", "must be a whole number"),
    ("CARPOOL_KEEP_PROMISES", "yes", "must be true or false"),
    ("CARPOOL_LOG_LEVEL", "loud", "must be one of DEBUG, INFO, WARNING, ERROR"),
    ("CARPOOL_MPS_CLIENT_GID", "0", "must be a user or group ID above 0"),
])
def test_a_bad_value_stops_the_operator_naming_the_variable(env: str, value: str,
                                                             says: str) -> None:
    with pytest.raises(ValueError, match=f"^{env} {says}"):
        OperatorSettings.from_environment({env: value})


def test_every_setting_is_in_the_reference() -> None:
    text = REFERENCE.read_text()
    missing = [env for env, _, _ in OperatorSettings.documented() if f"`{env}`" not in text]
    assert not missing, f"docs/reference/settings.md does not list {missing}"
