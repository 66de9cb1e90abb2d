"""carpool_testbed.stored: admissions counted and timed as the API server stores them."""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from carpool_testbed import stored


@dataclass
class FakeServer:
    """A LIST endpoint paging `objects` by `limit`/`continue`; `expire_once` answers the
    second page 410 the first time, as a compaction under a long LIST does; `remaining`
    False leaves remainingItemCount out, as a server may."""

    objects: list[dict[str, Any]]
    expire_once: bool = False
    remaining: bool = True
    calls: list[tuple[str, dict[str, str], str]] = field(default_factory=list)

    def request(self, method: str, url: str, headers: dict[str, str], retries: bool
                ) -> SimpleNamespace:
        path, _, query = url.partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        self.calls.append((path, params, headers["Accept"]))
        start = int(params.get("continue") or 0)
        if start and self.expire_once:
            self.expire_once = False
            return SimpleNamespace(status=410, data=b"{}")
        end = start + int(params["limit"])
        meta: dict[str, Any] = {}
        if end < len(self.objects):
            meta["continue"] = str(end)
            if self.remaining:
                meta["remainingItemCount"] = len(self.objects) - end
        body = {"items": self.objects[start:end], "metadata": meta}
        return SimpleNamespace(status=200, data=json.dumps(body).encode())


def _api(server: FakeServer) -> Any:
    return SimpleNamespace(configuration=SimpleNamespace(host="https://api"),
                           rest_client=SimpleNamespace(pool_manager=server))


def _pod(namespace: str, job: str | None, created: str) -> dict[str, Any]:
    labels = {"carpool.dev/job-name": job} if job else {}
    return {"metadata": {"namespace": namespace, "labels": labels,
                         "creationTimestamp": created}}


def test_a_list_pages_through_everything_and_starts_again_after_a_compaction() -> None:
    server = FakeServer([{"i": i} for i in range(7)], expire_once=True)
    items = list(stored.list_items(_api(server), "/api/v1/pods", page=3))
    assert [x["i"] for x in items] == list(range(7))  # nothing twice, nothing missing
    assert [c[1].get("continue") for c in server.calls] == [None, "3", None, "3", "6"]


def test_a_list_that_keeps_expiring_fails_instead_of_returning_part() -> None:
    server = FakeServer([{"i": i} for i in range(7)])

    def always_expired(*args: Any, **kwargs: Any) -> SimpleNamespace:
        server.expire_once = True
        return FakeServer.request(server, *args, **kwargs)

    server.request = always_expired  # type: ignore[method-assign]
    with pytest.raises(stored.Expired):
        list(stored.list_items(_api(server), "/api/v1/pods", page=3, tries=2))


def test_a_count_is_one_metadata_item_and_the_servers_remaining_count() -> None:
    server = FakeServer([{"i": i} for i in range(1200)])
    assert stored.count(_api(server), "/api/v1/namespaces/p/pods") == 1200
    assert len(server.calls) == 1 and server.calls[0][2] == stored.METADATA_ONLY
    assert stored.count(_api(FakeServer([])), "/api/v1/namespaces/p/pods") == 0


def test_without_a_remaining_count_the_count_pages_through_metadata() -> None:
    server = FakeServer([{"i": i} for i in range(12)], remaining=False)
    assert stored.count(_api(server), "/x") == 12
    assert all(accept == stored.METADATA_ONLY for _, _, accept in server.calls)


def test_pods_in_sums_the_namespaces() -> None:
    server = FakeServer([{"i": i} for i in range(5)])
    assert stored.pods_in(_api(server), ["a", "b"]) == 10
    assert [c[0] for c in server.calls] == ["https://api/api/v1/namespaces/a/pods",
                                            "https://api/api/v1/namespaces/b/pods"]


def test_a_job_is_admitted_when_its_last_pod_was_created() -> None:
    pods = [_pod("p", "j1", "2026-01-01T00:00:10Z"),
            _pod("p", "j2", "2026-01-01T00:00:12Z"),  # a gang's workers: the last counts
            _pod("p", "j2", "2026-01-01T00:00:14Z"),
            _pod("p", "j2", "2026-01-01T00:00:13Z"),
            _pod("q", "j1", "2026-01-01T00:00:20Z"),
            _pod("p", None, "2026-01-01T00:00:11Z")]  # not a job's pod
    base = 1767225600.0  # 2026-01-01T00:00:00Z
    assert stored.pods_created(pods, "carpool.dev/job-name") == {
        "p/j1": base + 10, "p/j2": base + 14, "q/j1": base + 20}


def _workload(owner: str, conditions: list[dict[str, str]]) -> dict[str, Any]:
    return {"metadata": {"namespace": "p", "name": f"job-{owner}-abc",
                         "ownerReferences": [{"kind": "Job", "name": owner}]},
            "status": {"conditions": conditions}}


def test_a_workload_is_admitted_when_its_admitted_condition_turned_true() -> None:
    workloads = [
        _workload("j1", [{"type": "QuotaReserved", "status": "True",
                          "lastTransitionTime": "2026-01-01T00:00:05Z"},
                         {"type": "Admitted", "status": "True",
                          "lastTransitionTime": "2026-01-01T00:00:06Z"}]),
        _workload("j2", [{"type": "Admitted", "status": "False",
                          "lastTransitionTime": "2026-01-01T00:00:07Z"}]),
        _workload("j3", []),
        {"metadata": {"namespace": "p", "name": "orphan"},
         "status": {"conditions": [{"type": "Admitted", "status": "True",
                                    "lastTransitionTime": "2026-01-01T00:00:08Z"}]}}]
    assert stored.workloads_admitted(workloads) == {"p/j1": 1767225606.0}


def test_only_the_rounds_jobs_admitted_by_its_end_count() -> None:
    times = {"p/j1": 100.0, "p/j2": 105.0, "p/j3": 106.0, "old/j1": 101.0}
    assert stored.admitted_by(times, 105.0) == {"p/j1": 100.0, "p/j2": 105.0,
                                                "old/j1": 101.0}
    assert stored.admitted_by(times, 200.0, ["p/j1", "p/j3"]) == {"p/j1": 100.0,
                                                                  "p/j3": 106.0}


def test_a_round_waits_for_the_first_pod_then_ends_when_the_count_stops_growing() -> None:
    stop = stored.IdleStop(target=100, idle_s=20, now=0.0)
    assert not stop.done(0, 500.0)  # a controller still listing its caches: no end
    assert not stop.done(10, 510.0)
    assert not stop.done(10, 530.0)  # 20 s, not more
    assert not stop.done(11, 535.0)  # growth restarts the clock
    assert not stop.done(11, 555.0)
    assert stop.done(11, 555.5)
    assert stored.IdleStop(target=100, idle_s=20, now=0.0).done(100, 1.0)  # all admitted


def test_the_idle_stop_grows_with_the_queue() -> None:
    assert stored.default_idle_stop(3000) == 20.0
    assert stored.default_idle_stop(10000) == 20.0
    assert stored.default_idle_stop(50000) == 100.0
