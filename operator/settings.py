"""Every operator setting in one place: read once from the environment at start.

The chart sets each variable from its values (helm/carpool/templates/operator.yaml); run by
hand, the variable itself is the setting. Nothing else is read: no flags, no file, so there is
one rule of precedence, the environment over the default below. A value that does not parse
stops the operator with the variable's name and what it wants, rather than being guessed at.
docs/reference/settings.md lists them (tests/unit/packaging/test_reference_docs.py keeps it
true).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def setting(env: str, default: Any, doc: str, choices: tuple[str, ...] = ()) -> Any:
    """A field of `OperatorSettings`: the variable it is read from, what it means, and for
    text the values it may take (any, when none are named; compared in upper case)."""
    return dataclasses.field(default=default,
                             metadata={"env": env, "doc": doc, "choices": choices})


@dataclass(frozen=True)
class OperatorSettings:
    """The operator's settings, typed; `from_environment` reads and checks them."""

    kubeconfig: str = setting(
        "CARPOOL_KUBECONFIG", "",
        "kubeconfig to use (else KUBECONFIG, else the pod's service account)")
    namespace: str = setting(
        "CARPOOL_NAMESPACE", "default", "namespace of the leader-election Lease")
    identity: str = setting(
        "CARPOOL_IDENTITY", "", "this replica's name in the Lease (default: the host name)")
    log_level: str = setting(
        "CARPOOL_LOG_LEVEL", "INFO", "level of Carpool's own log: DEBUG, INFO, WARNING or ERROR",
        choices=LOG_LEVELS)
    resync_s: float = setting(
        "CARPOOL_RESYNC_SECONDS", 5.0, "seconds between passes when no watch event comes")
    metrics_port: int = setting(
        "CARPOOL_METRICS_PORT", 0, "port of the Prometheus /metrics endpoint (0: none)")
    fair_share_half_life_s: float = setting(
        "CARPOOL_FAIR_SHARE_HALF_LIFE_S", 7 * 86400.0,
        "half-life of past GPU-hours in fair-share usage")
    aging_step_s: float = setting(
        "CARPOOL_AGING_STEP_S", 3600.0,
        "a waiting job gains one class level per this much waiting (0: no aging)")
    arrival_window_s: float = setting(
        "CARPOOL_ARRIVAL_WINDOW_S", 3600.0,
        "how far back arrivals are counted to foresee the next ones in estimates")
    keep_promises: bool = setting(
        "CARPOOL_KEEP_PROMISES", True,
        "a job past its first estimated start ranks as due (true or false)")
    start_scenarios: int = setting(
        "CARPOOL_START_SCENARIOS", 0,
        "forward simulations with drawn run times behind each reserved job's estimate "
        "(0: one, every run time as expected)")
    write_workers: int = setting(
        "CARPOOL_WRITE_WORKERS", 16, "threads writing pods and statuses at once")
    wait_refresh_s: float = setting(
        "CARPOOL_WAIT_REFRESH_S", 60.0,
        "least seconds between rewrites of a waiting job's estimate when nothing urgent changed")
    max_admissions_per_pass: int = setting(
        "CARPOOL_MAX_ADMISSIONS_PER_PASS", 0, "admissions carried out per pass (0: no cap)")
    admitted_events_per_pass: int = setting(
        "CARPOOL_ADMITTED_EVENTS_PER_PASS", 100,
        "admissions per pass told by an Admitted Event on the job (the rest by their "
        "Admitted condition only)")
    admission_budget_s: float = setting(
        "CARPOOL_ADMISSION_BUDGET_S", 10.0,
        "seconds a pass may spend carrying out admissions before leaving the rest to the next")
    admission_budget_max_s: float = setting(
        "CARPOOL_ADMISSION_BUDGET_MAX_S", 60.0, "upper bound of that budget as it adapts")
    unschedulable_timeout_s: float = setting(
        "CARPOOL_UNSCHEDULABLE_TIMEOUT_S", 600.0,
        "an admitted job whose pod no node takes this long is given back (0: never)")
    job_runtime_class: str = setting(
        "CARPOOL_JOB_RUNTIME_CLASS", "",
        "RuntimeClass given to every job pod (devicePlugin.runtimeClassName; empty: none)")
    lending: bool = setting(
        "CARPOOL_LENDING", False,
        "lend running jobs' unused GPU memory to preemptible MPS jobs (lending.enabled; true "
        "or false); the extender must be told the same")
    lending_observed_s: float = setting(
        "CARPOOL_LENDING_OBSERVED_S", 600.0,
        "seconds a job runs before the part of its grant above its peak is lent")
    lending_reclaim_within_s: float = setting(
        "CARPOOL_LENDING_RECLAIM_WITHIN_S", 30.0,
        "longest checkpoint grace of a job that may borrow: how long an owner waits for its "
        "lent memory")
    lending_whole_gpus: bool = setting(
        "CARPOOL_LENDING_WHOLE_GPUS", False,
        "whole-GPU (exclusive) owners lend their unused memory too; their borrowers share the "
        "GPU's SM time (lending.wholeGpus; true or false); the extender must be told the same")
    mps_client_uid: int | None = setting(
        "CARPOOL_MPS_CLIENT_UID", None,
        "user every MPS job's containers run as (mpsDaemon.clientUid; above 0; empty: the "
        "template's)")
    mps_client_gid: int | None = setting(
        "CARPOOL_MPS_CLIENT_GID", None,
        "group every MPS job's containers run as (mpsDaemon.clientGid; above 0)")

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> OperatorSettings:
        """The settings `env` gives (unset or empty: the default); ValueError naming the
        variable for a value that does not parse."""
        types = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = f.metadata["env"]
            text = env.get(name, "").strip()
            if text:
                values[f.name] = _parse(name, text, types[f.name], f.metadata["choices"])
        if not values.get("kubeconfig") and env.get("KUBECONFIG"):
            values["kubeconfig"] = env["KUBECONFIG"]
        return cls(**values)

    @classmethod
    def documented(cls) -> list[tuple[str, str, str]]:
        """(variable, default as text, meaning) of every setting, in order."""
        return [(f.metadata["env"], "" if f.default is None else str(f.default),
                 f.metadata["doc"]) for f in dataclasses.fields(cls)]


def _parse(name: str, text: str, kind: Any, choices: tuple[str, ...]) -> Any:
    if kind is bool:
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ValueError(f"{name} must be true or false, not {text!r}")
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, not {text!r}") from None
        if not value >= 0 or math.isinf(value):
            raise ValueError(f"{name} must be 0 or more seconds, not {text!r}")
        return value
    if kind is int:
        if not text.isdigit():
            raise ValueError(f"{name} must be a whole number, 0 or more, not {text!r}")
        return int(text)
    if kind == int | None:
        if not text.isdigit() or int(text) == 0:
            raise ValueError(f"{name} must be a user or group ID above 0, got {text!r}")
        return int(text)
    if choices:
        if text.upper() not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, not {text!r}")
        return text.upper()
    return text
