"""The `carpool_eta_*` metrics count a job once, at the status write that records its first
start (scored where it had a first estimate, counted as unscored where it had none), even
when a pass that read the job before that write showed writes it again (a recording fake of
the API port; the real /metrics is checked in tests/integration/test_estimate_ranges.py)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from carpool.core.timestamps import format_timestamp
from carpool.operator.observe import PassState
from carpool.operator.reconciler import Reconciler, ReconcilerConfig

T0 = 1_800_000_000.0
Obj = dict[str, Any]


class Writes:
    def __init__(self) -> None:
        self.statuses: list[Obj] = []

    def patch_job_status(self, namespace: str, name: str, status: Obj) -> str | None:
        self.statuses.append(status)
        return str(len(self.statuses))


def _job(uid: str, cls: str, **status: Any) -> Obj:
    return {"metadata": {"name": uid, "namespace": "team", "uid": uid,
                         "resourceVersion": "1"},
            "spec": {"class": cls}, "status": status}


def _at(seconds: float) -> str:
    return format_timestamp(T0 + seconds)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _flush(reconciler: Reconciler, obj: Obj, patch: Obj) -> None:
    key = f"team/{obj['metadata']['name']}"
    reconciler._write_status_now(PassState(objects={key: obj}, patches={key: dict(patch)}), key)


@pytest.mark.parametrize("cls", ["short", "long"])
def test_the_first_start_write_counts_once(cls: str) -> None:
    kube = Writes()
    reconciler = Reconciler(kube, ReconcilerConfig(), None)  # type: ignore[arg-type]
    uid = f"u-{cls}"
    # waited 400 s, told 300 with the range 200..450: 0.25 late, inside
    waiting = _job(uid, cls, phase="Admitted", submitTime=_at(0),
                   firstEstimatedStart=_at(300), firstEstimatedStartEarliest=_at(200),
                   firstEstimatedStartLatest=_at(450))
    started = {"phase": "Running", "startTime": _at(400)}
    count = ("carpool_eta_first_estimate_relative_error_count", {"job_class": cls})
    total = ("carpool_eta_first_estimate_relative_error_sum", {"job_class": cls})
    late = ("carpool_eta_first_estimate_misses_total", {"job_class": cls, "direction": "late"})
    inside = ("carpool_eta_first_range_total", {"job_class": cls, "result": "inside"})
    short = ("carpool_eta_first_estimate_short_wait_error_seconds_count", {"job_class": cls})
    starts = ("carpool_eta_first_starts_total",
              {"job_class": cls, "scored": "true", "wait": "long"})
    before = {n: _sample(n, **labels)
              for n, labels in (count, total, late, inside, short, starts)}

    _flush(reconciler, waiting, {"phase": "Admitted"})  # no first start: nothing scored
    assert _sample(count[0], **count[1]) == before[count[0]]
    _flush(reconciler, waiting, started)
    # a pass that read the job before its write showed derives and writes it again
    _flush(reconciler, waiting, started)
    assert len(kube.statuses) == 3
    assert _sample(count[0], **count[1]) == before[count[0]] + 1
    assert _sample(total[0], **total[1]) == pytest.approx(before[total[0]] + 0.25)
    assert _sample(late[0], **late[1]) == before[late[0]] + 1
    assert _sample(inside[0], **inside[1]) == before[inside[0]] + 1
    assert _sample(short[0], **short[1]) == before[short[0]]
    assert _sample(starts[0], **starts[1]) == before[starts[0]] + 1
    # once the start shows, a write (a requeued job's next run) scores nothing more
    shown = _job(uid, cls, **{**waiting["status"], **started})
    _flush(reconciler, shown, {"phase": "Running", "startTime": _at(900)})
    assert _sample(count[0], **count[1]) == before[count[0]] + 1
    assert _sample(starts[0], **starts[1]) == before[starts[0]] + 1


def test_a_short_wait_is_scored_in_seconds_only() -> None:
    kube = Writes()
    reconciler = Reconciler(kube, ReconcilerConfig(), None)  # type: ignore[arg-type]
    obj = _job("u-short-wait", "interactive", submitTime=_at(0), firstEstimatedStart=_at(20))
    labels = {"job_class": "interactive"}
    name = "carpool_eta_first_estimate_short_wait_error_seconds"
    before = {le: _sample(f"{name}_bucket", le=le, **labels) for le in ("15.0", "30.0", "60.0")}
    short_sum = _sample(f"{name}_sum", **labels)
    relative = _sample("carpool_eta_first_estimate_relative_error_count", **labels)
    starts = {"scored": "true", "wait": "short", **labels}
    counted = _sample("carpool_eta_first_starts_total", **starts)
    _flush(reconciler, obj, {"phase": "Running", "startTime": _at(50)})  # 30 s late of 50
    assert _sample(f"{name}_sum", **labels) == short_sum + 30
    # 30 s falls in the buckets from le=30 up
    assert {le: _sample(f"{name}_bucket", le=le, **labels) - before[le] for le in before} == {
        "15.0": 0, "30.0": 1, "60.0": 1}
    assert _sample("carpool_eta_first_estimate_relative_error_count", **labels) == relative
    assert _sample("carpool_eta_first_starts_total", **starts) == counted + 1


@pytest.mark.parametrize(("started", "wait"), [(5, "short"), (400, "long")])
def test_a_start_without_a_first_estimate_is_counted_unscored(started: float, wait: str
                                                              ) -> None:
    kube = Writes()
    reconciler = Reconciler(kube, ReconcilerConfig(), None)  # type: ignore[arg-type]
    obj = _job(f"u-unscored-{wait}", "batch", submitTime=_at(0))  # admitted, never estimated
    labels = {"job_class": "batch"}
    unscored = {"scored": "false", "wait": wait, **labels}
    scores = ("carpool_eta_first_estimate_relative_error_count",
              "carpool_eta_first_estimate_short_wait_error_seconds_count")
    before = {n: _sample(n, **labels) for n in scores}
    counted = _sample("carpool_eta_first_starts_total", **unscored)
    scored = sum(_sample("carpool_eta_first_starts_total", scored="true", wait=w, **labels)
                 for w in ("short", "long"))
    started_status = {"phase": "Running", "startTime": _at(started)}
    _flush(reconciler, obj, started_status)
    _flush(reconciler, obj, started_status)  # derived again from a stale read: once
    assert _sample("carpool_eta_first_starts_total", **unscored) == counted + 1
    assert sum(_sample("carpool_eta_first_starts_total", scored="true", wait=w, **labels)
               for w in ("short", "long")) == scored
    assert {n: _sample(n, **labels) for n in scores} == before
