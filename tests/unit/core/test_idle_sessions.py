"""Idle interactive sessions (`core.queueing.idle_expiry`, ProjectQuota spec.idleSessions):
an interactive job whose GPUs did no work for its project's timeout is stopped, or for its
yieldAfter while a waiting job could use its GPUs; nothing else."""

from __future__ import annotations

from dataclasses import replace

from carpool.core.decoding import quota_from_object
from carpool.core.job_status import expired, hardware_facts
from carpool.core.jobs import JobClass, Phase, RunRecord
from carpool.core.queueing import IDLE_TIMEOUT, idle_expiry, idle_gpus_wanted
from carpool.core.timestamps import epoch_seconds
from carpool_testbed.builders import gpu_job, project_quota

NOW = 1_800_000_000.0
QUOTA = project_quota("a", idle_session_timeout_s=1800)


def session(started: float = NOW - 7200, active: float | None = NOW - 3600, **fields: object):
    job = gpu_job("a/nb", "a", JobClass.INTERACTIVE, phase=Phase.RUNNING, attempts=1,
                  runs=(RunRecord(1, started, None, 1.0, "n1"),), last_gpu_activity=active)
    return replace(job, **fields)  # type: ignore[arg-type]


def test_a_session_idle_past_its_projects_timeout_is_stopped_saying_why() -> None:
    stop = idle_expiry(session(), QUOTA, NOW)
    assert stop is not None and stop.reason == IDLE_TIMEOUT and stop.grace_s == 30.0
    assert stop.message.startswith("its GPUs did no work for 1h; project a stops interactive "
                                   "sessions idle for 30m (spec.idleSessions.timeout)")
    patch, event = expired([{"attempt": 1, "start": "2027-01-15T06:00:00Z"}], stop, NOW)
    assert (patch["phase"], patch["reason"]) == ("Failed", IDLE_TIMEOUT)
    assert patch["history"][0]["outcome"] == IDLE_TIMEOUT
    assert (event.reason, event.type) == (IDLE_TIMEOUT, "Warning")


def test_what_is_not_stopped() -> None:
    assert idle_expiry(session(active=NOW - 600), QUOTA, NOW) is None  # worked lately
    assert idle_expiry(session(active=None), QUOTA, NOW) is None  # its node does not measure
    assert idle_expiry(session(), project_quota("a"), NOW) is None  # no timeout set
    assert idle_expiry(session(), None, NOW) is None
    assert idle_expiry(session(job_class=JobClass.SHORT), QUOTA, NOW) is None
    assert idle_expiry(session(phase=Phase.ADMITTED), QUOTA, NOW) is None
    # a new attempt's silence counts from its start, not from an older attempt's work
    assert idle_expiry(session(started=NOW - 900, active=NOW - 7000), QUOTA, NOW) is None


def test_the_operator_writes_the_last_activity_to_the_next_minute_as_it_moves_on() -> None:
    first = hardware_facts({}, None, None, NOW + 5)
    assert epoch_seconds(first["lastGpuActivity"]) == NOW + 60
    same_minute = hardware_facts({"lastGpuActivity": first["lastGpuActivity"]}, None, None,
                                 NOW + 50)
    assert "lastGpuActivity" not in same_minute
    assert hardware_facts({}, None, None, None) == {}  # not measured: nothing written


YIELDING = project_quota("a", idle_session_timeout_s=1800, idle_session_yield_after_s=600)


def test_a_session_idle_past_yield_after_is_stopped_only_while_its_gpus_are_wanted() -> None:
    quiet = session(active=NOW - 900)  # idle 15 min: past yieldAfter, short of the timeout
    assert idle_expiry(quiet, YIELDING, NOW) is None  # nothing waits: it may sit
    stop = idle_expiry(quiet, YIELDING, NOW, wanted=True)
    assert stop is not None and stop.reason == IDLE_TIMEOUT
    assert stop.message.startswith("its GPUs did no work for 15m; project a stops interactive "
                                   "sessions idle for 10m while jobs wait for its GPUs "
                                   "(spec.idleSessions.yieldAfter)")
    assert idle_expiry(session(active=NOW - 300), YIELDING, NOW, wanted=True) is None
    # the timeout still stops it whether or not anything waits; yieldAfter alone works too
    assert idle_expiry(session(), YIELDING, NOW) is not None
    alone = project_quota("a", idle_session_yield_after_s=600)
    assert idle_expiry(quiet, alone, NOW) is None
    assert idle_expiry(quiet, alone, NOW, wanted=True) is not None
    assert idle_expiry(replace(quiet, job_class=JobClass.SHORT), YIELDING, NOW, True) is None


def test_a_session_s_gpus_are_wanted_by_a_waiting_job_that_may_run_on_their_model() -> None:
    any_model, a100_only = gpu_job("b/x", "b"), gpu_job("b/y", "b", models=frozenset({"A100"}))
    assert idle_gpus_wanted(["H100"], [any_model])
    assert not idle_gpus_wanted(["H100"], [a100_only])
    assert idle_gpus_wanted(["H100", "A100"], [a100_only])
    assert not idle_gpus_wanted(["H100"], [])


def test_the_projects_yield_after_is_read_from_its_spec() -> None:
    quota = quota_from_object({"metadata": {"name": "a", "namespace": "a"}, "spec": {
        "namespaces": ["a"], "idleSessions": {"timeout": "2h", "yieldAfter": "10m"}}})
    assert (quota.idle_session_timeout_s, quota.idle_session_yield_after_s) == (7200, 600)
