"""The operator's write lanes (`operator/writes.py`): admissions in parallel within the pass's
budget, statuses written only where they change, background lanes drained on demand."""

from __future__ import annotations

import threading
from typing import Any

from carpool.operator.writes import Lane, Writer


class Statuses:
    """The API port's status writes, recorded."""

    def __init__(self) -> None:
        self.written: list[tuple[str, dict[str, Any]]] = []

    def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> str:
        self.written.append((f"{namespace}/{name}", status))
        return str(100 + len(self.written))


def _writer(kube: Statuses, workers: int = 2) -> Writer:
    return Writer(kube, lambda key: None, workers)  # type: ignore[arg-type]


def test_admissions_stop_where_the_pass_says_and_all_started_are_done() -> None:
    done: list[int] = []
    lock = threading.Lock()

    def admit(n: int) -> None:
        with lock:
            done.append(n)

    started = _writer(Statuses()).admit_in_parallel(list(range(10)), admit, lambda n: n < 6)
    assert started == [0, 1, 2, 3, 4, 5]
    assert sorted(done) == started  # each finished before the call returned


def test_a_status_is_written_only_where_it_changes_and_the_job_shows_the_write() -> None:
    kube = Statuses()
    obj = {"metadata": {"name": "job", "namespace": "team", "uid": "u", "resourceVersion": "7"},
           "status": {"phase": "Queued", "reason": "Capacity"}}
    written = _writer(kube).status_now("team/job", obj, {"phase": "Queued",
                                                         "reason": "Quota"})
    ((key, patch),) = kube.written
    assert key == "team/job" and "phase" not in patch and patch["reason"] == "Quota"
    assert patch["conditions"]  # they follow the reason
    assert written is not None and written["status"]["reason"] == "Quota"
    assert written["metadata"]["resourceVersion"] == "101"
    assert obj["status"]["reason"] == "Capacity"  # the cached object is left alone
    assert _writer(kube).status_now("team/job", written, {"reason": "Quota",
                                                          "conditions": patch["conditions"]
                                                          }) is None


def test_draining_a_lane_waits_for_what_was_submitted() -> None:
    lane = Lane("test", 1)
    release, ran = threading.Event(), threading.Event()

    def slow() -> None:
        release.wait()

    lane.submit(slow)
    lane.submit(ran.set)
    release.set()
    lane.drain()
    assert ran.is_set()
    lane.submit(lambda: None).result(5)  # a drained lane takes work again


def test_a_queued_status_write_goes_out_with_the_newest_patch_a_pass_derived() -> None:
    kube = Statuses()
    writer = _writer(kube)
    release = threading.Event()
    for _ in range(writer.statuses.workers):  # the lane's threads busy with slow writes
        writer.statuses.pool.submit(release.wait)
    writer.statuses_later({"team/job": {"reason": "Capacity", "estimatedStart": "08:00"}})
    writer.statuses_later({"team/job": {"estimatedStart": "09:00", "queuePosition": 3}})
    release.set()
    writer.drain()
    ((key, patch),) = kube.written
    assert key == "team/job"
    assert patch["estimatedStart"] == "09:00" and patch["queuePosition"] == 3
    assert patch["reason"] == "Capacity"  # what only the older patch said goes out too


def test_a_status_write_that_has_left_keeps_its_patch_and_the_next_pass_writes_again() -> None:
    kube = Statuses()
    writer = _writer(kube)
    inside, release = threading.Event(), threading.Event()
    real = kube.patch_job_status

    def slow(namespace: str, name: str, status: dict[str, Any]) -> str:
        inside.set()
        release.wait(5)
        return real(namespace, name, status)

    kube.patch_job_status = slow  # type: ignore[method-assign]
    writer.statuses_later({"team/job": {"estimatedStart": "08:00"}})
    assert inside.wait(5)
    writer.statuses_later({"team/job": {"estimatedStart": "09:00"}})  # left to a later pass
    release.set()
    writer.drain()
    assert [p["estimatedStart"] for _, p in kube.written] == ["08:00"]
