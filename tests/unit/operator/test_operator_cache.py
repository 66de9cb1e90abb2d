"""The operator's watch caches and one reconcile pass over them, against a recording fake
of the API port (no cluster): what a pass writes, and that it waits for its own writes."""

from __future__ import annotations

import copy
import gc
import time
import weakref
from typing import Any

import pytest

from carpool.core import names
from carpool.kube.watching import Store, WatchEnded
from carpool.operator.informer import Informers
from carpool.operator.kube import GPUJOBS, PODS, QUOTAS, Obj
from carpool.operator.pod_view import view_pod
from carpool.operator.reconciler import CacheBehind, Reconciler, ReconcilerConfig

MODEL = "H100"


class FakeRest:
    writes = 0


class FakeKube:
    """Records writes; answers with increasing resourceVersions like the API server."""

    def __init__(self) -> None:
        self.api = FakeRest()
        self.written: dict[str, int] = {}
        self._lock = __import__("threading").Lock()
        self.version = 100
        self.pods: list[Obj] = []
        self.statuses: list[tuple[str, Obj]] = []
        self.finalized: list[str] = []
        self.released: list[str] = []  # pods whose finalizer was removed
        self.events: list[str] = []
        self.quota_statuses: list[tuple[str, Obj]] = []
        self.deleted: list[str] = []
        self.deleted_uids: list[str] = []  # each deletion's uid precondition ("" for none)

    def _next(self, kind: str) -> str:
        with self._lock:
            self.version += 1
            self.written[kind] = self.version
            self.api.writes += 1
            return str(self.version)

    def written_versions(self) -> dict[str, int]:
        with self._lock:
            return dict(self.written)

    def ensure_priority_class(self) -> None:
        pass

    def create_pod(self, pod: Obj) -> tuple[bool, Obj | None]:
        version = self._next(PODS)
        created = {**pod, "metadata": {**pod["metadata"], "resourceVersion": version,
                                       "uid": f"pod-{version}"}}
        self.pods.append(created)
        return True, created

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None,
                   uid: str = "") -> None:
        self._next(PODS)
        self.deleted.append(f"{namespace}/{name}")
        self.deleted_uids.append(uid)

    def patch_job_status(self, namespace: str, name: str, status: Obj) -> str | None:
        self.statuses.append((f"{namespace}/{name}", status))
        return self._next(GPUJOBS)

    def set_job_finalizers(self, namespace: str, name: str, finalizers: list[str],
                           resource_version: str) -> bool:
        self._next(GPUJOBS)
        self.finalized.append(f"{namespace}/{name}")
        return True

    def patch_quota_status(self, name: str, status: Obj) -> None:
        self.quota_statuses.append((name, status))
        self._next(QUOTAS)

    def release_pod(self, namespace: str, name: str, uid: str, finalizers: list[str]) -> bool:
        self._next(PODS)
        self.released.append(f"{namespace}/{name}")
        return True

    def event(self, regarding: Obj, reason: str, note: str, type_: str = "Normal",
              action: str = "Reconcile") -> None:
        self.events.append(reason)


def _watch_event(store: Store, event: Obj) -> bool:
    """One watch event through the store's reflector; False when it asks for a fresh list."""
    try:
        store.reflector._event(event)
    except WatchEnded:
        return False
    return True


def _job(name: str, version: str = "1", status: Obj | None = None) -> Obj:
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": name, "namespace": "team", "uid": f"u-{name}",
                         "resourceVersion": version,
                         "creationTimestamp": "2026-11-29T10:00:00Z"},
            "spec": {"project": "vision", "class": "short",
                     "gpu": {"count": 1, "memory": "20Gi", "cores": 50, "isolation": "mps"},
                     "estimatedDuration": "10m",
                     "template": {"spec": {"containers": [{"name": "main", "image": "img"}]}}},
            "status": status or {}}


def _controller(job: str) -> Obj:
    """The controller ownerReference the operator gives a pod of GpuJob `job` (see _job)."""
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "name": job, "uid": f"u-{job}",
            "controller": True}


def _cluster(gpus: int) -> dict[str, list[Obj]]:
    return {
        "nodes": [{"metadata": {"name": "n1", "resourceVersion": "2", "labels": {}}}],
        # a GpuNode of another GPU count is another version of it, as the API server says
        names.GPUNODE_PLURAL: [{"metadata": {"name": "n1", "resourceVersion": f"3{gpus}"},
                                "status": {"sharingMode": "mps", "gpus": [
                                    {"index": i, "uuid": f"GPU-{i}", "model": MODEL,
                                     "memoryTotalMiB": 81920} for i in range(gpus)]}}],
        QUOTAS: [{"metadata": {"name": "vision", "resourceVersion": "4",
                               "creationTimestamp": "2026-11-29T00:00:00Z"},
                  "spec": {"namespaces": ["team"], "concurrent": {"gpus": 8}}}],
        PODS: [],
        GPUJOBS: [],
    }


def _informers(kube: FakeKube, objects: dict[str, list[Obj]], version: int) -> Informers:
    informers = Informers(kube)  # type: ignore[arg-type]
    for kind, informer in informers.by_kind.items():
        informer.items = {f"{o['metadata'].get('namespace', '')}/{o['metadata']['name']}"
                          .lstrip("/"): o for o in objects[kind]}
        informer.synced = True
        informer.version = version
    return informers


def _reconciler(kube: FakeKube, informers: Informers) -> Reconciler:
    return Reconciler(kube, ReconcilerConfig(write_workers=4), informers)  # type: ignore[arg-type]


def test_watch_events_keep_the_newest_object_and_a_410_asks_for_a_list() -> None:
    changes: list[int] = []
    informer = Informers(FakeKube(), lambda: changes.append(1)).by_kind[GPUJOBS]  # type: ignore[arg-type]
    assert _watch_event(informer, {"type": "ADDED", "object": _job("a", "5")})
    assert _watch_event(informer,
                        {"type": "MODIFIED", "object": _job("a", "7", {"phase": "Queued"})})
    assert _watch_event(informer, {"type": "ADDED", "object": _job("b", "8")})
    assert _watch_event(informer, {"type": "DELETED", "object": _job("b", "9")})
    assert [o["status"] for o in informer.snapshot()] == [{"phase": "Queued"}]
    assert informer.version == 9 and len(changes) == 4
    assert _watch_event(informer,
                        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}})
    assert informer.version == 12 and len(changes) == 4  # a bookmark changes no object
    assert not _watch_event(informer, {"type": "ERROR", "object": {"code": 410, "message": "gone"}})


def test_the_store_remembers_when_the_watch_saw_an_object_deleted() -> None:
    informer = Informers(FakeKube()).by_kind[PODS]  # type: ignore[arg-type]
    pod = {"metadata": {"name": "a-1", "namespace": "team", "uid": "pod-a-1",
                        "resourceVersion": "5"}, "status": {"phase": "Running"}}
    assert _watch_event(informer, {"type": "ADDED", "object": pod})
    assert informer.gone_at("pod-a-1") is None
    before = time.time()
    assert _watch_event(informer, {"type": "DELETED", "object": pod})
    seen = informer.gone_at("pod-a-1")
    assert seen is not None and before <= seen[0] <= time.time()
    assert seen[1]["status"] == {"phase": "Running"}  # its last state, trimmed as stored


def test_a_fresh_list_that_lacks_an_object_keeps_its_last_state_as_gone() -> None:
    """A pod deleted while the watch was down (an API outage) or relisting shows no DELETED
    event: the list that first lacks it records it gone, with the last state held."""
    informer = Informers(FakeKube()).by_kind[PODS]  # type: ignore[arg-type]
    pod = {"metadata": {"name": "a-1", "namespace": "team", "uid": "pod-a-1",
                        "resourceVersion": "5"}, "status": {"phase": "Succeeded"}}
    informer._replace([pod], "5")
    assert informer.gone_at("pod-a-1") is None
    before = time.time()
    informer._replace([], "9")
    seen = informer.gone_at("pod-a-1")
    assert seen is not None and before <= seen[0] <= time.time()
    assert seen[1]["status"] == {"phase": "Succeeded"}


def test_a_cache_behind_our_own_write_is_waited_for_then_relisted() -> None:
    kube = FakeKube()
    informers = _informers(kube, _cluster(1), version=50)
    kube.written[PODS] = 60
    assert not informers.caught_up(0.05)
    assert informers.by_kind[PODS].reflector._relist.is_set()  # the watch is told to list again
    informers.by_kind[PODS].version = 60
    assert informers.caught_up(0.05)
    informers.by_kind[GPUJOBS].synced = False  # not listed yet: never a pass on nothing
    assert not informers.caught_up(0.05)
    # ... and its first list, still coming, is not asked to start over (thousands of objects
    # take longer than one wait)
    assert not informers.by_kind[GPUJOBS].reflector._relist.is_set()


def test_a_pass_on_a_stale_cache_is_refused() -> None:
    kube = FakeKube()
    informers = _informers(kube, _cluster(1), version=50)
    kube.written[GPUJOBS] = 70
    try:
        _reconciler(kube, informers).run_pass(0.0, catch_up_s=0.05)
    except CacheBehind:
        assert gc.isenabled()  # on again after the refused read
        return
    raise AssertionError("a pass ran on a cache behind its own writes")


class _Cyclic:
    """An object in a reference cycle: freed by the cycle collector only."""

    def __init__(self) -> None:
        self.me = self


def test_a_pass_decides_with_the_collector_off_and_frees_the_cycles_it_made() -> None:
    """The cycle collector is off while a pass reads and decides, on again after it (as it
    was), and cyclic garbage made meanwhile is freed then, not frozen with what lives on."""
    seen: dict[str, Any] = {}

    def one_pass() -> None:
        kube = FakeKube()
        cluster = _cluster(1)
        cluster[GPUJOBS] = [_job("a")]
        reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
        decide = reconciler.decide

        def deciding(state: Any) -> Any:
            seen["collecting"] = gc.isenabled()
            seen["garbage"] = weakref.ref(_Cyclic())
            return decide(state)

        reconciler.decide = deciding  # type: ignore[method-assign]
        reconciler.run_pass(1_800_000_000.0)
        reconciler.wait_for_writes()

    assert gc.isenabled()
    try:
        one_pass()
        assert seen["collecting"] is False and gc.isenabled()
        assert seen["garbage"]() is None
        gc.disable()  # a process that keeps the collector off has it off after a pass
        one_pass()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_new_job_admitted_at_once_costs_one_pod_and_one_status_write() -> None:
    kube = FakeKube()
    cluster = _cluster(2)
    cluster[GPUJOBS] = [_job("a"), _job("b")]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    result = reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()  # statuses land in the background
    assert sorted(a.job_key for a in result.admissions) == ["team/a", "team/b"]
    assert sorted(p["metadata"]["name"] for p in kube.pods) == ["a-1", "b-1"]
    # one status write per job: its submit time rides along with the admission
    assert sorted(key for key, _ in kube.statuses) == ["team/a", "team/b"]
    for _, status in kube.statuses:
        assert status["phase"] == "Admitted"
        assert status["submitTime"] == "2026-11-29T10:00:00Z"
    # no write of its own for the accounting finalizer: it is in each pod's create body
    assert kube.finalized == []
    assert all(p["metadata"]["finalizers"] == [names.FINALIZER] for p in kube.pods)


def test_a_pass_that_sees_its_own_writes_writes_nothing_more() -> None:
    kube = FakeKube()
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a")]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()  # statuses land in the background
    ((_, status),) = kube.statuses
    # what the watch then shows: the pod (pending, placed by the extender) and the status
    pod = copy.deepcopy(kube.pods[0])
    pod["metadata"]["resourceVersion"] = str(kube.version)
    job = _job("a", str(kube.version), {k: v for k, v in status.items() if v is not None})
    cluster[PODS], cluster[GPUJOBS] = [pod], [job]
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    statuses, pods = len(kube.statuses), len(kube.pods)
    result = reconciler.run_pass(1_800_000_001.0)
    reconciler.wait_for_writes()  # statuses land in the background
    assert not result.admissions
    # the derived status equals the shown one (a pending pod's empty history included)
    assert (len(kube.statuses), len(kube.pods)) == (statuses, pods)
    assert reconciler.observer.decoded["team/a"].pods == (pod["metadata"]["resourceVersion"],)
    # the pod runs: a new pod version, so the job is derived again and shows Running
    running = copy.deepcopy(pod)
    running["metadata"]["resourceVersion"] = str(kube.version + 1)
    running["spec"] = {"nodeName": "n1"}
    running["status"] = {"phase": "Running", "startTime": "2027-01-15T08:00:05Z"}
    cluster[PODS] = [running]
    reconciler.informers = _informers(kube, cluster, version=kube.version + 1)
    reconciler.run_pass(1_800_000_010.0)
    reconciler.wait_for_writes()  # statuses land in the background
    assert kube.statuses[-1][1]["phase"] == "Running"


def test_a_waiting_job_gets_its_reason_and_submit_time_in_one_write_and_is_reused() -> None:
    kube = FakeKube()
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a"), _job("b", status={}), _job("c")]
    # 1 GPU of 80 GiB, MPS at 50 % cores: two of the three fit
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    result = reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()  # statuses land in the background
    waiting = [w.job_key for w in result.waits]
    assert len(result.admissions) == 2 and len(waiting) == 1
    (write,) = [s for k, s in kube.statuses if k == waiting[0]]
    assert write["phase"] == "Queued" and write["submitTime"] and write["reason"]
    decoded: Any = reconciler.observer.decoded[waiting[0]].job
    for informer in reconciler.informers.by_kind.values():
        informer.version = kube.version  # caught up (the objects left as they were)
    reconciler.run_pass(1_800_000_001.0, catch_up_s=0.05)
    reconciler.wait_for_writes()  # statuses land in the background
    # the queued job's object is the same: its decoding is reused
    assert reconciler.observer.decoded[waiting[0]].job is decoded


def test_a_pass_tells_only_its_first_admissions_by_an_event_and_every_one_by_its_status(
) -> None:
    def admitted_events(per_pass: int) -> tuple[int, set[str]]:
        kube = FakeKube()
        cluster = _cluster(1)
        cluster[GPUJOBS] = [_job("a"), _job("b"), _job("c")]  # two fit, one waits
        reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
        reconciler.config.admitted_events_per_pass = per_pass
        reconciler.run_pass(1_800_000_000.0, catch_up_s=0.05)
        reconciler.wait_for_writes()
        admitted = {k for k, s in kube.statuses if s.get("phase") == "Admitted"}
        return kube.events.count("Admitted"), admitted

    assert admitted_events(100) == (2, {"team/a", "team/b"})
    assert admitted_events(1) == (1, {"team/a", "team/b"})
    assert admitted_events(0) == (0, {"team/a", "team/b"})


def test_a_burst_writes_a_first_wait_once_nothing_is_left_for_later_or_a_refresh_on(
) -> None:
    def passes(max_admissions: int, count: int, waited_s: float = 0.0
               ) -> tuple[FakeKube, list[str]]:
        kube = FakeKube()
        cluster = _cluster(1)
        cluster[GPUJOBS] = [_job("a"), _job("b"), _job("c")]
        # 1 GPU of 80 GiB, MPS at 50 % cores: two of the three fit, one waits
        reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
        reconciler.config.max_admissions_per_pass = max_admissions
        waiting = []
        for _ in range(count):
            for informer in reconciler.informers.by_kind.values():
                informer.version = max(informer.version, kube.version)  # caught up
            reconciler._waiting_since = {k: t - waited_s
                                         for k, t in reconciler._waiting_since.items()}
            (wait,) = reconciler.run_pass(1_800_000_000.0, catch_up_s=0.05).waits
            reconciler.wait_for_writes()
            waiting.append(wait.job_key)
        return kube, waiting

    # every admission carried out: the waiting job's first wait is written at once
    kube, (waiting,) = passes(0, 1)
    assert [s["reason"] for k, s in kube.statuses if k == waiting] == ["Capacity"]
    # one of two admissions left for later each pass: the next pass ranks the queue anew,
    # so the waiting job's first wait (and its Event) is held, pass after pass...
    kube, (first, second) = passes(1, 2)
    assert first == second and first not in {k for k, _ in kube.statuses}
    assert "Capacity" not in kube.events
    # ... for at most the refresh period (a minute for a short queue) of its wait
    kube, (first, second) = passes(1, 2, waited_s=61.0)
    assert [s["reason"] for k, s in kube.statuses if k == first] == ["Capacity"]
    assert kube.events.count("Capacity") == 1


def test_the_store_keeps_what_a_pass_reads_and_drops_bookkeeping() -> None:
    informer = Informers(FakeKube()).by_kind[PODS]  # type: ignore[arg-type]
    pod = {"metadata": {"name": "a-1", "namespace": "team", "resourceVersion": "3",
                        "uid": "pod-a-1", "managedFields": [{"manager": "kwok"}],
                        "labels": {names.LABEL_JOB: "a"},
                        "ownerReferences": [_controller("a"), {
                            "apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "y"}],
                        "annotations": {names.ANN_JOB: "team/a",
                                        "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
           "spec": {"nodeName": "n1", "containers": [
               {"name": "main", "image": "img", "resources": {"limits": {
                   "cpu": "1", names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: "20"}}},
               {"name": "side", "image": "img"}]},
           "status": {"phase": "Running", "podIP": "10.0.0.1", "startTime": "2026-11-29T10:00:00Z",
                      "conditions": [{"type": "Ready", "status": "True"}],
                      "containerStatuses": [{"name": "main", "image": "img", "ready": True,
                                             "state": {"running": {
                                                 "startedAt": "2026-11-29T10:00:01Z"}}}]}}
    before = view_pod(copy.deepcopy(pod))
    assert _watch_event(informer, {"type": "ADDED", "object": pod})
    (kept,) = informer.snapshot()
    assert kept["spec"] == {"nodeName": "n1", "containers": [{"name": "main", "resources": {
        "limits": {names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: "20"}}}]}
    assert kept["metadata"]["ownerReferences"] == [_controller("a")]
    assert "labels" not in kept["metadata"]  # hints: the pass does not read them
    assert kept["status"] == {"phase": "Running", "startTime": "2026-11-29T10:00:00Z",
                              "containerStatuses": [{"state": {"running": {
                                  "startedAt": "2026-11-29T10:00:01Z"}}}]}
    assert "managedFields" not in kept["metadata"]
    assert kept["metadata"]["annotations"] == {}
    assert view_pod(kept) == before  # everything the operator reads of a pod is kept
    disrupted = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
    pod = copy.deepcopy(pod)
    pod["metadata"]["resourceVersion"] = "4"
    pod["status"].update(phase="Failed", conditions=[{"type": "Ready", "status": "False"},
                                                     disrupted])
    before = view_pod(copy.deepcopy(pod))
    assert before.disruption == "TerminationByKubelet"
    assert _watch_event(informer, {"type": "MODIFIED", "object": pod})
    (kept,) = informer.snapshot()
    assert kept["status"]["conditions"] == [disrupted]  # a condition a pass reads
    assert view_pod(kept) == before
    # and the scheduler's finding no node for it (lifecycle.give_back_unschedulable)
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "lastTransitionTime": "2026-11-29T10:00:00Z", "message": "0/1 nodes"}
    pod = copy.deepcopy(pod)
    pod["metadata"]["resourceVersion"] = "5"
    pod["status"] = {"phase": "Pending", "conditions": [unschedulable]}
    before = view_pod(copy.deepcopy(pod))
    assert before.unschedulable_since is not None and before.unschedulable_message
    assert _watch_event(informer, {"type": "MODIFIED", "object": pod})
    (kept,) = informer.snapshot()
    assert view_pod(kept) == before


def test_a_shown_estimate_adds_the_recent_admission_to_start_delay() -> None:
    from carpool.core.queueing import Wait, WaitReason
    from carpool.operator.observe import PassState

    kube = FakeKube()
    reconciler = _reconciler(kube, _informers(kube, _cluster(1), version=10))
    wait = Wait("team/a", WaitReason.CAPACITY, "no node has room now", 1, 0,
                1_800_000_000.0)
    for delay, shown in ((0.0, "2027-01-15T08:00:00Z"), (33.0, "2027-01-15T08:00:30Z")):
        state = PassState(objects={"team/a": _job("a", status={"phase": "Queued"})})
        state.start_delay_s = delay
        reconciler._wait_written.clear()
        reconciler._record_wait(state, wait, 1_800_000_000.0 - 3600)  # an hour ahead: 10 s
        assert state.patches["team/a"]["estimatedStart"] == shown
    assert "+30s from admission to a running pod" in state.patches["team/a"]["message"]
    # 30 s ahead, the estimate is written to the second
    state = PassState(objects={"team/a": _job("a", status={"phase": "Queued"})})
    reconciler._wait_written.clear()
    near = Wait("team/a", WaitReason.CAPACITY, "no node has room now", 1, 0, 1_800_000_003.4)
    reconciler._record_wait(state, near, 1_800_000_003.4 - 30)
    assert state.patches["team/a"]["estimatedStart"] == "2027-01-15T08:00:03Z"


def test_a_job_has_at_most_one_status_write_in_flight() -> None:
    import threading
    import time

    kube = FakeKube()
    in_flight: dict[str, int] = {}
    most = [0]
    lock = threading.Lock()
    patch = kube.patch_job_status

    def slow_patch(namespace: str, name: str, status: Obj) -> str | None:
        key = f"{namespace}/{name}"
        with lock:
            in_flight[key] = in_flight.get(key, 0) + 1
            most[0] = max(most[0], in_flight[key])
        if name == "c":  # the waiting job's write is slow; admissions go at once
            time.sleep(0.3)
        with lock:
            in_flight[key] -= 1
        return patch(namespace, name, status)

    kube.patch_job_status = slow_patch  # type: ignore[method-assign]
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a"), _job("b"), _job("c")]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    reconciler.run_pass(1_800_000_000.0)  # c waits: its status goes out in the background
    for informer in reconciler.informers.by_kind.values():
        informer.version = 10_000  # the next pass does not wait for the watch
    reconciler._wait_written.clear()  # and would write c's wait again at once
    reconciler.run_pass(1_800_000_100.0, catch_up_s=0.05)
    reconciler.wait_for_writes()
    assert most[0] == 1


def test_admissions_left_for_later_passes_push_estimates_back_by_their_time() -> None:
    from carpool.core.queueing import Wait, WaitReason
    from carpool.operator.observe import PassState

    kube = FakeKube()
    reconciler = _reconciler(kube, _informers(kube, _cluster(1), version=10))
    reconciler._note_backlog(acted=200, deferred=0, seconds=10.0)
    assert (reconciler._admit_rate, reconciler._backlog_s) == (20.0, 0.0)
    reconciler._note_backlog(acted=400, deferred=1200, seconds=10.0)  # 40/s, smoothed 30/s
    assert (reconciler._admit_rate, reconciler._backlog_s) == (30.0, 40.0)
    state = PassState(objects={"team/a": _job("a", status={"phase": "Queued"})})
    reconciler._record_wait(state, Wait("team/a", WaitReason.CAPACITY, "no room", 1, 0,
                                        1_800_000_000.0), 1_800_000_000.0 - 3600)
    assert state.patches["team/a"]["estimatedStart"] == "2027-01-15T08:00:40Z"
    assert "+40s to carry out the admissions decided before it" in \
        state.patches["team/a"]["message"]


def test_an_admission_takes_over_its_jobs_queued_background_write() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    kube = FakeKube()
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a"), _job("b"), _job("c")]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    release = threading.Event()
    busy = ThreadPoolExecutor(max_workers=1)
    busy.submit(release.wait)  # the background lane is stuck behind a slow write
    reconciler.writer.statuses.pool = busy
    first = reconciler.run_pass(1_800_000_000.0)  # c waits: its write is queued, not sent
    (waiting,) = [w.job_key for w in first.waits]
    assert waiting not in {k for k, _ in kube.statuses}
    more = _cluster(2)
    more[GPUJOBS] = cluster[GPUJOBS]
    reconciler.informers = _informers(kube, more, version=10_000)
    passed = threading.Thread(target=reconciler.run_pass, args=(1_800_000_100.0,))
    passed.start()
    passed.join(10)
    assert not passed.is_alive(), "the admission waited behind the background lane"
    release.set()
    reconciler.wait_for_writes()
    writes = [s for k, s in kube.statuses if k == waiting]
    assert len(writes) == 1  # the queued wait status went out with the admission, not after
    assert writes[0]["phase"] == "Admitted" and writes[0]["submitTime"]


def test_a_long_queue_refreshes_positions_less_often() -> None:
    import time

    from carpool.core.queueing import CycleResult, Wait, WaitReason
    from carpool.operator.observe import PassState

    kube = FakeKube()
    reconciler = _reconciler(kube, _informers(kube, _cluster(1), version=10))
    shown = {"phase": "Queued", "reason": "Capacity", "queuePosition": 7,
             "message": "no node has room now"}
    for queue, written in ((10, True), (1000, False)):
        waits = tuple(Wait(f"team/w{i}", WaitReason.CAPACITY, "no node has room now", i + 1, 0,
                           None) for i in range(queue))
        state = PassState(objects={w.job_key: _job(w.job_key.split("/")[1], status=shown)
                                   for w in waits})
        reconciler._wait_written = {w.job_key: time.monotonic() - 61 for w in waits}
        reconciler._apply(state, CycleResult(0.0, (), (), waits, (), ()), 0.0)
        # only positions moved (the shown one is 7), a minute ago: 10 waiting are rewritten,
        # 1,000 (200 s at 5 refreshes/s) are not yet
        assert ("team/w0" in state.patches) is written


class SlowKube(FakeKube):
    """Pod creates take `delay` seconds; `on_pod` runs after each (a job arriving meanwhile)."""

    def __init__(self, delay: float, on_pod: Any = None) -> None:
        super().__init__()
        self.delay, self.on_pod = delay, on_pod

    def create_pod(self, pod: Obj) -> tuple[bool, Obj | None]:
        __import__("time").sleep(self.delay)
        created = super().create_pod(pod)
        if self.on_pod is not None:
            self.on_pod(len(self.pods))
        return created


def _burst(arrival_class: str | None, max_s: float = 30.0) -> int:
    """Pods one pass creates for 8 admissions of 0.05 s each with a 0.1 s budget, when a job
    of `arrival_class` arrives after the first pod (None: nobody arrives)."""
    informers: dict[str, Informers] = {}

    def arrive(pods: int) -> None:
        if arrival_class is not None and pods == 1:
            late = _job("late", "900")
            late["spec"]["class"] = arrival_class
            assert _watch_event(informers["it"].by_kind[GPUJOBS], {"type": "ADDED", "object": late})

    kube = SlowKube(0.05, arrive)
    cluster = _cluster(8)
    cluster[GPUJOBS] = [_job(f"j{i}") for i in range(8)]
    informers["it"] = _informers(kube, cluster, version=10)
    reconciler = Reconciler(kube, ReconcilerConfig(  # type: ignore[arg-type]
        write_workers=1, admission_budget_s=0.1, admission_budget_max_s=max_s),
        informers["it"])
    result = reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()
    assert len(result.admissions) == 8
    return len(kube.pods)


def test_a_burst_is_carried_out_in_one_pass_while_no_job_that_may_rank_first_arrives() -> None:
    assert _burst(None) == 8
    assert _burst("batch") == 8  # a lower class ranks after every admission left


def test_a_pass_stops_admitting_for_a_new_job_of_the_same_or_a_higher_class() -> None:
    assert 2 <= _burst("short") < 8  # past the 0.1 s budget, the next pass ranks it first
    assert 2 <= _burst("interactive") < 8


def test_a_pass_stops_admitting_at_the_longest_budget_whoever_arrives() -> None:
    assert 2 <= _burst(None, max_s=0.2) < 8


def test_arrivals_are_counted_from_watch_events_only() -> None:
    kube = FakeKube()
    informers = _informers(kube, _cluster(1), version=10)
    start = informers.arrived(GPUJOBS)
    jobs = informers.by_kind[GPUJOBS]
    assert _watch_event(jobs, {"type": "ADDED", "object": _job("a", "11")})
    assert _watch_event(jobs, {"type": "MODIFIED", "object": _job("a", "12")})
    # seen before: no arrival
    assert _watch_event(jobs, {"type": "ADDED", "object": _job("a", "13")})
    assert [o["metadata"]["name"] for o in informers.arrived_since(GPUJOBS, start) or []] == ["a"]
    assert informers.arrived_since(GPUJOBS, start + 1) == []
    assert informers.arrived_since(GPUJOBS, start - 5000) is None  # more than it remembers
    pod = {"metadata": {"name": "a-1", "namespace": "team", "resourceVersion": "14"}}
    assert _watch_event(informers.by_kind[PODS], {"type": "ADDED", "object": pod})
    assert informers.arrived(PODS) == 0  # only GpuJobs keep arrivals (a pass asks for those)


def test_a_pass_stops_admitting_when_it_loses_its_lease() -> None:
    leading = [True]
    kube = SlowKube(0.05, lambda pods: leading.__setitem__(0, pods < 2))
    cluster = _cluster(8)
    cluster[GPUJOBS] = [_job(f"j{i}") for i in range(8)]
    reconciler = Reconciler(kube, ReconcilerConfig(  # type: ignore[arg-type]
        write_workers=1, admission_budget_s=30.0), _informers(kube, cluster, version=10))
    reconciler.run_pass(1_800_000_000.0, still_leader=lambda: leading[0])
    reconciler.wait_for_writes()
    assert len(kube.pods) == 2  # well inside its budget, yet no admission after the lease


class TellingKube(FakeKube):
    """Records each Event as (job, reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, str]] = []

    def event(self, regarding: Obj, reason: str, note: str, type_: str = "Normal",
              action: str = "Reconcile") -> None:
        self.told.append((regarding["metadata"]["name"], reason))


def test_a_change_is_announced_once_while_its_status_write_is_on_its_way() -> None:
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    kube = TellingKube()
    cluster = _cluster(1)
    started = _job("a", "20", status={"phase": "Admitted", "attempts": 1, "node": "n1",
                                      "podName": "a-1", "podUID": "pod-a-1",
                                      "submitTime": "2026-11-29T10:00:00Z"})
    big = _job("b", "21")
    lost = _job("c", "22", status={"phase": "Running", "attempts": 1, "node": "n1",
                                   "submitTime": "2026-11-29T10:00:00Z"})
    for job in (big, lost):
        job["spec"]["gpu"]["count"] = 2  # more GPUs than the node has: it waits
    cluster[GPUJOBS] = [started, big, lost]
    cluster[PODS] = [{  # a's pod runs; c's is gone
        "metadata": {"name": "a-1", "namespace": "team", "resourceVersion": "23",
                     "uid": "pod-a-1", "ownerReferences": [_controller("a")],
                     "annotations": {names.ANN_JOB: "team/a", names.ANN_ASSIGNMENT: json.dumps(
                         {"node": "n1", "gpus": [{"uuid": "GPU-0", "index": 0,
                                                  "memoryMiB": 20480, "cores": 50}]})}},
        "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": {
            names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: "20",
            names.RESOURCE_GPU_CORES: "50"}}}]},
        "status": {"phase": "Running", "startTime": "2026-11-29T10:01:00Z",
                   "containerStatuses": [{"state": {"running": {
                       "startedAt": "2026-11-29T10:01:00Z"}}}]}}]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    release = threading.Event()
    busy = ThreadPoolExecutor(max_workers=1)
    busy.submit(release.wait)  # the status lane is stuck: the watch keeps showing the old status
    reconciler.writer.statuses.pool = busy
    try:
        for second in range(3):
            for informer in reconciler.informers.by_kind.values():
                informer.version = kube.version  # caught up, the objects left as they were
            reconciler.run_pass(1_800_000_000.0 + second, catch_up_s=0.05)
    finally:
        release.set()
    reconciler.wait_for_writes()
    told = sorted(kube.told)
    assert ("a", "Started") in told and ("c", "Requeued") in told
    assert {job for job, _ in told} == {"a", "b", "c"}  # b and c: their wait reasons
    assert len(told) == len(set(told)) == 4, told  # each once, though derived three times


def test_a_deleted_jobs_run_time_is_kept_in_its_quota_and_used_by_later_passes(
        caplog: Any) -> None:
    """Deleting a finished job folds its run into the quota's status; a later pass, with the
    job gone, estimates its template's next run from that; a malformed entry in that status
    is left out and logged once, not raised."""
    kube = FakeKube()
    cluster = _cluster(1)
    done = _job("train-1", status={
        "phase": "Succeeded", "attempts": 1, "submitTime": "2026-11-29T10:00:00Z",
        "history": [{"attempt": 1, "start": "2026-11-29T10:00:00Z",
                     "end": "2026-11-29T10:00:30Z", "fraction": 1.0, "node": "n1"}]})
    done["metadata"].update(deletionTimestamp="2026-11-29T11:00:00Z",
                            finalizers=[names.FINALIZER])
    cluster[GPUJOBS] = [done]
    # a job retired before and gone since: its key is no longer needed
    cluster[QUOTAS][0]["status"] = {"retired": {"jobs": ["team/old@u-old"]}}
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()
    assert kube.finalized == ["team/train-1"]
    ((project, status),) = [(p, s) for p, s in kube.quota_statuses if "retired" in s]
    assert status["retired"]["jobs"] == ["team/train-1@u-train-1"]
    (learned,) = [e for e in status["retired"]["learned"] if e.get("template") == "train@img"]
    assert project == "vision" and learned["samples"] == 1 and learned["seconds"] == 30.0

    # the job is gone; two jobs of its template come, each wanting the whole GPU
    quota = cluster[QUOTAS][0]
    quota["metadata"]["resourceVersion"] = str(kube.version)
    status["retired"]["learned"].append({"template": "hand-edited", "samples": "many"})
    quota["status"] = status
    jobs = [_job("train-2"), _job("train-3")]
    for job in jobs:
        job["spec"]["gpu"]["cores"] = 100
    cluster[GPUJOBS] = jobs
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    now = 1_800_000_100.0
    with caplog.at_level("WARNING", logger="carpool.operator.reconciler"):
        result = reconciler.run_pass(now)
        for informer in reconciler.informers.by_kind.values():
            informer.version = kube.version
        reconciler.run_pass(now + 1, catch_up_s=0.05)
    reconciler.wait_for_writes()
    (wait,) = [w for w in result.waits if w.job_key == "team/train-3"]
    # behind train-2, expected to take the learned 30 s, not its estimated 10 minutes
    assert wait.estimated_start is not None and wait.estimated_start - now < 60
    problems = [r.getMessage() for r in caplog.records if "hand-edited" in r.getMessage()
                or "learned[" in r.getMessage()]
    assert problems == ["ProjectQuota vision: status.retired.learned[2]: samples 'many' is "
                        "not a number; entry ignored"], problems


# -- which pods are a job's: by uid and what its status records (core.ownership) ----------

T0 = 1_800_000_000.0
ASSIGNED = ('{"node": "n1", "gpus": [{"uuid": "GPU-0", "index": 0, "memoryMiB": 20480, '
            '"cores": 50}]}')


def _running_job() -> Obj:
    return _job("a", "20", status={
        "phase": "Running", "attempts": 1, "node": "n1", "podName": "a-1", "podUID": "pod-a-1",
        "submitTime": "2027-01-15T07:00:00Z", "startTime": "2027-01-15T07:00:00Z",
        "history": [{"attempt": 1, "node": "n1", "fraction": 0.5,
                     "start": "2027-01-15T07:00:00Z"}],
        "gpus": [{"index": 0, "uuid": "GPU-0", "memoryMiB": 20480, "cores": 50}]})


def _gpu_pod(name: str, uid: str, namespace: str = "team", phase: str = "Running",
             owner: Obj | None = None, annotations: Obj | None = None) -> Obj:
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid,
                         "resourceVersion": "30",
                         "ownerReferences": [owner] if owner else [],
                         "annotations": {names.ANN_ASSIGNMENT: ASSIGNED, **(annotations or {})}},
            "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {
                "limits": {names.RESOURCE_GPU: "1"}}}]},
            "status": {"phase": phase, "startTime": "2027-01-15T07:00:00Z",
                       "containerStatuses": [{"state": {"running": {
                           "startedAt": "2027-01-15T07:00:00Z"}}}]}}


def _pass(pods: list[Obj], jobs: list[Obj], now: float = T0) -> tuple[TellingKube, Reconciler]:
    kube = TellingKube()
    cluster = _cluster(2)
    cluster[GPUJOBS], cluster[PODS] = jobs, pods
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    reconciler.run_pass(now)
    reconciler.wait_for_writes()
    return kube, reconciler


def _phase_writes(kube: FakeKube) -> list[tuple[str, Obj]]:
    return [(key, {k: v for k, v in status.items() if k in ("phase", "attempts", "history")})
            for key, status in kube.statuses if {"phase", "attempts", "history"} & set(status)]


def test_a_look_alike_pod_in_another_namespace_changes_nothing_of_the_job() -> None:
    job = _running_job()
    real = _gpu_pod("a-1", "pod-a-1", owner=_controller("a"))
    # a CPU-only pod in another namespace named like the attempt, saying it is the job's and
    # finished; and one in the job's namespace named like the next attempt
    forged = _gpu_pod("a-1", "forged-1", namespace="evil", phase="Succeeded",
                      owner=_controller("a"), annotations={names.ANN_JOB: "team/a"})
    forged["spec"]["containers"] = [{"name": "main"}]
    del forged["metadata"]["annotations"][names.ANN_ASSIGNMENT]
    next_one = copy.deepcopy(forged)
    next_one["metadata"].update(namespace="team", name="a-2", uid="forged-2")
    kube, _ = _pass([real, forged, next_one], [job])
    assert _phase_writes(kube) == []
    assert kube.deleted == [] and kube.pods == []


def test_labels_and_annotations_changed_on_the_attempt_change_nothing() -> None:
    pod = _gpu_pod("a-1", "pod-a-1", owner=_controller("a"),
                   annotations={names.ANN_JOB: "team/other", names.ANN_ISOLATION: "exclusive"})
    pod["metadata"]["labels"] = {names.LABEL_JOB: "other"}
    kube, _ = _pass([pod], [_running_job()])
    assert _phase_writes(kube) == [] and kube.deleted == [] and kube.pods == []
    assert not [e for e in kube.told if e[1] in ("Requeued", "Started")]


def test_the_attempt_whose_owner_reference_changed_is_stopped_and_stays_billed() -> None:
    pod = _gpu_pod("a-1", "pod-a-1")  # its ownerReference removed
    kube, _ = _pass([pod], [_running_job()])
    assert kube.deleted == ["team/a-1"] and kube.pods == []  # no second pod meanwhile
    assert ("a-1", "AttemptTampered") in kube.told and ("a", "AttemptTampered") in kube.told
    assert _phase_writes(kube) == []  # its run stays open: billed until the pod is gone
    # while it stops, the job shows it stopping; once it is gone, its run ends then and the
    # job goes back to the queue (here straight to its next attempt)
    pod["metadata"]["deletionTimestamp"] = "2027-01-15T08:00:05Z"
    kube, _ = _pass([pod], [_running_job()], T0 + 5)
    assert kube.deleted == [] and kube.pods == []
    assert [s["phase"] for _, s in _phase_writes(kube)] == ["Preempted"]
    kube, _ = _pass([], [_running_job()], T0 + 15)
    ((_, written),) = _phase_writes(kube)
    assert written["history"][0]["end"] == "2027-01-15T08:00:15Z"
    assert written["attempts"] == 2 and [p["metadata"]["name"] for p in kube.pods] == ["a-2"]


def test_a_gpu_pod_of_no_live_job_is_stopped_and_billed_to_its_project() -> None:
    # its job was deleted (and its ownerReference removed before, so the garbage collector
    # leaves it); and a forged pod naming a job that does not record it
    gone = _gpu_pod("old-1", "pod-old-1")
    forged = _gpu_pod("a-7", "forged-7", owner=_controller("a"))
    real = _gpu_pod("a-1", "pod-a-1", owner=_controller("a"))
    kube = TellingKube()
    cluster = _cluster(2)
    cluster[GPUJOBS], cluster[PODS] = [_running_job()], [real, gone, forged]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))

    def next_pass(now: float) -> Obj | None:
        """One pass on what the cluster holds now; the retired usage it wrote, if any."""
        kube.quota_statuses.clear()
        reconciler.informers = _informers(kube, cluster, version=kube.version)
        reconciler.run_pass(now)
        reconciler.wait_for_writes()
        written = [s for _, s in kube.quota_statuses if "retired" in s]
        if written:  # what the quota's status holds from now on
            quota = cluster[QUOTAS][0]
            quota["status"] = {**(quota.get("status") or {}), **written[-1]}
            quota["metadata"]["resourceVersion"] = str(kube.version)
            return dict(written[-1]["retired"])
        return None

    retired = next_pass(T0)
    assert sorted(kube.deleted) == ["team/a-7", "team/old-1"]
    assert ("old-1", "OrphanStopped") in kube.told and ("a", "OrphanStopped") in kube.told
    assert _phase_writes(kube) == []
    # each held half a GPU for an hour until first seen: billed that at once
    assert retired is not None and retired["gpuHours"] == pytest.approx(2 * 0.5, abs=1e-4)
    assert set(retired["jobs"]) == {"pod:team/old-1@pod-old-1", "pod:team/a-7@forged-7"}
    # the next pass sees them stopping: not stopped twice, nothing more billed yet
    for pod in (gone, forged):  # (each change a new version, as the API server writes it)
        pod["metadata"].update(deletionTimestamp="2027-01-15T08:00:10Z", resourceVersion="31")
    kube.deleted.clear()
    assert next_pass(T0 + 5) is None and kube.deleted == []
    # one ended 4 s after it was first seen, the other is gone when the pass runs: each is
    # billed up to its end, once
    gone["metadata"]["resourceVersion"] = "32"
    gone["status"] = {**gone["status"], "phase": "Failed", "containerStatuses": [{"state": {
        "terminated": {"startedAt": "2027-01-15T07:00:00Z",
                       "finishedAt": "2027-01-15T08:00:04Z"}}}]}
    cluster[PODS] = [real, gone]
    retired = next_pass(T0 + 7.5)
    assert retired is not None
    assert retired["gpuHours"] == pytest.approx(0.5 * (3604 + 3607.5) / 3600, abs=1e-4)
    assert next_pass(T0 + 9) is None


def test_the_attempt_whose_assignment_changed_after_its_bind_is_stopped() -> None:
    job = _running_job()
    job["status"]["podAssignment"] = (
        '{"node":"n1","gpus":[{"uuid":"GPU-0","index":0,"memoryMiB":20480,"cores":50}]}')
    pod = _gpu_pod("a-1", "pod-a-1", owner=_controller("a"))
    kube, _ = _pass([copy.deepcopy(pod)], [copy.deepcopy(job)])
    assert kube.deleted == []  # as recorded: nothing to do
    pod["metadata"]["annotations"][names.ANN_ASSIGNMENT] = ASSIGNED.replace("GPU-0", "GPU-1")
    kube, _ = _pass([pod], [job])
    assert kube.deleted == ["team/a-1"] and ("a-1", "AttemptTampered") in kube.told
    assert kube.pods == [] and _phase_writes(kube) == []


def _expired_job(status: Obj | None = None) -> Obj:
    """A job running for an hour past a 10-minute maxDuration."""
    job = _running_job()
    job["spec"]["maxDuration"] = "10m"
    job["status"].update(status or {})
    return job


def test_a_job_past_its_max_duration_stops_only_the_pod_of_its_attempt() -> None:
    pod = _gpu_pod("a-1", "pod-a-1", owner=_controller("a"))
    kube, _ = _pass([pod], [_expired_job()])
    assert kube.deleted == ["team/a-1"] and kube.deleted_uids == ["pod-a-1"]
    assert [s["phase"] for _, s in _phase_writes(kube)] == ["Failed"]


def test_a_preempted_attempt_is_deleted_by_its_uid() -> None:
    from carpool.core.preemption import PreemptionCause
    from carpool.core.queueing import Preemption
    from carpool.operator.observe import PassState

    cluster = _cluster(2)
    cluster[GPUJOBS] = [_running_job()]
    cluster[PODS] = [_gpu_pod("a-1", "pod-a-1", owner=_controller("a"))]

    def preempt(state: PassState | None = None) -> FakeKube:
        kube = TellingKube()
        reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
        seen = reconciler.read(T0)
        jobs = {job.key: job for job in seen.jobs}
        reconciler._preempt(state or seen, jobs, Preemption(
            "team/a", "team/a", "n1", PreemptionCause.HIGHER_CLASS, 5.0, 0.0, "test"))
        return kube

    kube = preempt()
    assert kube.deleted == ["team/a-1"] and kube.deleted_uids == ["pod-a-1"]
    # the pod gone from the pass's view: the uid its job's status records, never the name alone
    kube = preempt(PassState(objects={"team/a": cluster[GPUJOBS][0]}))
    assert kube.deleted == ["team/a-1"] and kube.deleted_uids == ["pod-a-1"]
    del cluster[GPUJOBS][0]["status"]["podUID"]
    kube = preempt(PassState(objects={"team/a": cluster[GPUJOBS][0]}))
    assert kube.deleted == []  # no uid known: nothing is deleted by name


def _unschedulable(since: str) -> tuple[Obj, Obj]:
    """An admitted job (attempt 1) and its pod, which the scheduler has found no node for
    since `since`."""
    job = _job("a", "20", status={
        "phase": "Admitted", "attempts": 1, "podName": "a-1", "podUID": "pod-a-1",
        "node": "n1", "submitTime": "2027-01-15T07:00:00Z",
        "gpus": [{"index": 0, "uuid": "GPU-0", "memoryMiB": 20480, "cores": 50}]})
    pod = _gpu_pod("a-1", "pod-a-1", phase="Pending", owner=_controller("a"))
    del pod["metadata"]["annotations"][names.ANN_ASSIGNMENT]
    pod["spec"].pop("nodeName")
    pod["status"] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "lastTransitionTime": since,
        "message": "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity"}]}
    return job, pod


def test_an_admitted_job_whose_pod_no_node_takes_is_given_back() -> None:
    job, pod = _unschedulable("2027-01-15T07:55:00Z")  # 5 min before T0
    kube = TellingKube()
    cluster = _cluster(2)
    cluster[GPUJOBS], cluster[PODS] = [job], [pod]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    reconciler.run_pass(T0)
    reconciler.wait_for_writes()
    assert kube.deleted == [] and ("a", "Unschedulable") not in kube.told
    # what the watch then shows: the job with what the pass wrote
    for _, status in kube.statuses:
        job["status"].update(status)
    job["metadata"].update(resourceVersion=str(kube.version))
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    reconciler.run_pass(T0 + 1)
    reconciler.wait_for_writes()
    assert reconciler.observer.decoded["team/a"].version == job["metadata"]["resourceVersion"]
    assert kube.deleted == [] and not [s for _, s in kube.statuses if "phase" in s][1:]
    # ten minutes after it became unschedulable, nothing else having changed (the pass
    # reuses the job's decoding): its quota is given back, its pod stopped by uid
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    reconciler.run_pass(T0 + 300)
    reconciler.wait_for_writes()
    assert kube.deleted == ["team/a-1"] and kube.deleted_uids == ["pod-a-1"]
    assert ("a", "Unschedulable") in kube.told
    (written,) = [s for _, s in kube.statuses if s.get("reason") == "Unschedulable"]
    assert written["phase"] == "Preempted" and written["unschedulableGiveBacks"] == 1
    assert "didn't match Pod's node affinity" in written["message"]


def test_an_unchanged_cluster_keeps_the_last_decision_for_a_while() -> None:
    kube = FakeKube()
    cluster = _cluster(1)
    too_large = _job("a")
    too_large["spec"]["gpu"] = {"count": 2, "memory": "20Gi"}
    cluster[GPUJOBS] = [too_large]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    first = reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()
    assert [w.reason.value for w in first.waits] == ["TooLargeForAnyNode"]
    for informer in reconciler.informers.by_kind.values():
        informer.version = kube.version  # caught up (the objects left as they were)
    # the same snapshot at the same time: the decision stands
    assert reconciler.run_pass(1_800_000_000.0, catch_up_s=0.05) is first
    reconciler.wait_for_writes()
    for informer in reconciler.informers.by_kind.values():
        informer.version = kube.version
    # time alone moved by far more than deciding took (3x): decided again
    assert reconciler.run_pass(1_800_000_060.0, catch_up_s=0.05) is not first


def test_a_decision_that_admitted_or_whose_cluster_changed_is_made_again() -> None:
    kube = FakeKube()
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a")]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    admitted = reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()
    assert admitted.admissions
    for informer in reconciler.informers.by_kind.values():
        informer.version = kube.version  # (the admission's pod not in the cache)
    assert reconciler.run_pass(1_800_000_000.0, catch_up_s=0.05) is not admitted
    # a waiting job's spec changed: decided again
    too_large = _job("b")
    too_large["spec"]["gpu"] = {"count": 2, "memory": "20Gi"}
    cluster[GPUJOBS] = [too_large]
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    waiting = reconciler.run_pass(1_800_000_000.0, catch_up_s=0.05)
    reconciler.wait_for_writes()
    larger = _job("b", "2")
    larger["spec"]["gpu"] = {"count": 4, "memory": "20Gi"}
    cluster[GPUJOBS] = [larger]
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    again = reconciler.run_pass(1_800_000_000.0, catch_up_s=0.05)
    assert again is not waiting and [w.job_key for w in again.waits] == ["team/b"]


def test_a_job_read_again_with_the_same_grants_keeps_the_same_grants_tuple() -> None:
    # (the placement memo knows a node's state by its holders' grants tuples: a status write
    # must not make every running job's node look new)
    kube = FakeKube()
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a")]
    reconciler = _reconciler(kube, _informers(kube, cluster, version=10))
    reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()
    ((_, status),) = kube.statuses
    shown = {k: v for k, v in status.items() if v is not None}
    pod = copy.deepcopy(kube.pods[0])
    pod["metadata"]["resourceVersion"] = str(kube.version)
    cluster[PODS], cluster[GPUJOBS] = [pod], [_job("a", str(kube.version), shown)]
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    (before,) = reconciler.read(1_800_000_001.0).jobs
    assert before.grants
    cluster[GPUJOBS] = [_job("a", str(kube.version + 1), {**shown, "message": "written"})]
    reconciler.informers = _informers(kube, cluster, version=kube.version + 1)
    (after,) = reconciler.read(1_800_000_002.0).jobs
    assert after is not before and after.grants is before.grants


def test_a_pod_that_succeeded_then_went_before_its_status_was_written_ends_its_job() -> None:
    """An API outage or an operator restart loses the Succeeded status write, then the pod
    is deleted (pod garbage collection): the watch's last state of it ends the job, never
    a second attempt."""
    kube = FakeKube()
    cluster = _cluster(1)
    cluster[GPUJOBS] = [_job("a")]
    informers = _informers(kube, cluster, version=10)
    reconciler = _reconciler(kube, informers)
    reconciler.run_pass(1_800_000_000.0)
    reconciler.wait_for_writes()
    ((_, admitted),) = kube.statuses
    job = _job("a", str(kube.version + 1), {**{k: v for k, v in admitted.items()
                                               if v is not None}, "phase": "Running"})
    pod = copy.deepcopy(kube.pods[0])
    pod["metadata"]["resourceVersion"] = str(kube.version + 2)
    pod["spec"] = {**pod["spec"], "nodeName": "n1"}
    pod["status"] = {"phase": "Succeeded", "startTime": "2027-01-15T08:00:05Z"}
    assert _watch_event(informers.by_kind[GPUJOBS], {"type": "MODIFIED", "object": job})
    assert _watch_event(informers.by_kind[PODS], {"type": "ADDED", "object": pod})
    gone = copy.deepcopy(pod)
    gone["metadata"]["resourceVersion"] = str(kube.version + 3)
    assert _watch_event(informers.by_kind[PODS], {"type": "DELETED", "object": gone})
    for store in informers.by_kind.values():  # the watches show the first pass's writes
        store.version = max(store.version, kube.version)
    pods, statuses = len(kube.pods), len(kube.statuses)
    result = reconciler.run_pass(1_800_000_100.0, catch_up_s=0.05)
    reconciler.wait_for_writes()
    assert not result.admissions and len(kube.pods) == pods
    ((key, status),) = kube.statuses[statuses:]
    assert key == "team/a" and status["phase"] == "Succeeded"
    assert "Requeued" not in kube.events


# -- Carpool's finalizer on job pods (core.finalizing) -----------------------------------


def _final(pod: Obj, finished: str | None = None) -> Obj:
    """`pod` as the API server keeps it once its deletion is final (grace 0), held by
    Carpool's finalizer; `finished`: its containers' end, if they ended."""
    pod = copy.deepcopy(pod)
    pod["metadata"].update(finalizers=[names.FINALIZER], deletionGracePeriodSeconds=0,
                           deletionTimestamp="2027-01-15T07:30:00Z")
    if finished:
        pod["status"].update(phase="Succeeded", containerStatuses=[{"state": {"terminated": {
            "startedAt": "2027-01-15T07:00:00Z", "finishedAt": finished,
            "reason": "Completed"}}}])
    return pod


def test_a_pod_that_finished_and_went_while_no_operator_watched_ends_its_job_then_goes(
) -> None:
    """The pod's finalizer kept it: a fresh operator reads its outcome (Succeeded, not lost),
    writes it, and releases the pod only once the job's status shows it."""
    pod = _final(_gpu_pod("a-1", "pod-a-1", owner=_controller("a")),
                 finished="2027-01-15T07:20:00Z")
    kube, reconciler = _pass([pod], [_running_job()])
    ((_, status),) = _phase_writes(kube)
    assert status["phase"] == "Succeeded"
    assert status["history"][0]["end"] == "2027-01-15T07:20:00Z"
    assert "Requeued" not in [reason for _, reason in kube.told]
    assert kube.released == []  # not before the job's status says so
    job = _running_job()
    job["status"].update({k: v for k, v in kube.statuses[-1][1].items() if v is not None})
    job["metadata"]["resourceVersion"] = str(kube.version)
    cluster = _cluster(2)
    cluster[GPUJOBS], cluster[PODS] = [job], [pod]
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    reconciler.run_pass(T0 + 5)
    assert kube.released == ["team/a-1"]


def test_a_running_jobs_pod_deleted_by_someone_is_requeued_and_released_after() -> None:
    pod = _final(_gpu_pod("a-1", "pod-a-1", owner=_controller("a")))
    kube, _ = _pass([pod], [_running_job()])
    ((_, status),) = _phase_writes(kube)
    # lost, as if the pod were gone (its record closed when its deletion became final), and
    # admitted again at once: its GPU is free
    assert status["history"][0]["end"] == "2027-01-15T07:30:00Z"
    assert status["history"][0]["outcome"] == "PodLost" and status["attempts"] == 2
    assert ("a", "Requeued") in kube.told
    assert [p["metadata"]["name"] for p in kube.pods] == ["a-2"]
    assert kube.released == []  # the status the caches show does not say so yet


def test_a_deleted_running_job_is_billed_from_its_last_state_then_its_pod_released() -> None:
    """The job went at once (a background deletion: nothing holds a GpuJob); its pod, held by
    the finalizer, ends; the job's runs are retired into its quota from the last state the
    watch showed, closed at the pod's end, and only then is the pod released."""
    kube = TellingKube()
    cluster = _cluster(2)
    job = _running_job()
    cluster[GPUJOBS], cluster[PODS] = [], [_final(_gpu_pod("a-1", "pod-a-1",
                                                           owner=_controller("a")))]
    informers = _informers(kube, cluster, version=10)
    informers.by_kind[GPUJOBS]._forget("u-a", T0 - 1000, job)  # the watch saw it deleted
    reconciler = _reconciler(kube, informers)
    reconciler.run_pass(T0)
    ((project, status),) = [(p, s) for p, s in kube.quota_statuses if "retired" in s]
    assert project == "vision" and status["retired"]["jobs"] == ["team/a@u-a"]
    assert status["retired"]["gpuHours"] == 0.25  # 0.5 GPU for 30 min, to the pod's end
    assert kube.released == ["team/a-1"]
    # the next pass: already retired, nothing billed twice
    writes = len(kube.quota_statuses)
    cluster[PODS] = []
    cluster[QUOTAS][0]["status"] = status  # as the watch then shows the quota
    cluster[QUOTAS][0]["metadata"]["resourceVersion"] = str(kube.version)
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    reconciler.informers.by_kind[GPUJOBS]._forget("u-a", T0 - 1000, job)
    reconciler.run_pass(T0 + 5)
    assert [s for _, s in kube.quota_statuses[writes:] if "retired" in s] == []


def test_a_deleted_jobs_running_pod_is_stopped_with_its_grace_and_billed_once_it_ends(
) -> None:
    """While the pod runs, the job is not retired (its run has no end yet) and nothing is
    billed at once; the pod is deleted with its own grace (the job's checkpoint grace), told
    as JobDeleted, not as an orphan."""
    kube = TellingKube()
    cluster = _cluster(2)
    cluster[PODS] = [_gpu_pod("a-1", "pod-a-1", owner=_controller("a"))]
    cluster[PODS][0]["metadata"]["finalizers"] = [names.FINALIZER]
    informers = _informers(kube, cluster, version=10)
    informers.by_kind[GPUJOBS]._forget("u-a", T0 - 1000, _running_job())
    reconciler = _reconciler(kube, informers)
    reconciler.run_pass(T0)
    assert kube.deleted == ["team/a-1"] and kube.deleted_uids == ["pod-a-1"]
    assert ("a-1", "JobDeleted") in kube.told and ("a-1", "OrphanStopped") not in kube.told
    assert [s for _, s in kube.quota_statuses if "retired" in s] == []
    assert kube.released == []


def test_a_job_deleted_orphaning_its_running_pod_bills_the_pod_as_its_own_once() -> None:
    """Deleted with propagationPolicy Orphan, the job goes and the garbage collector takes
    the pod's ownerReference off first: the job's status still records the pod (podUID), so
    the pod is stopped as the job's, the job waits for it to end, and its run is billed once,
    under the job, not a second time as a pod of no job."""
    kube = TellingKube()
    cluster = _cluster(2)
    cluster[PODS] = [_gpu_pod("a-1", "pod-a-1")]
    cluster[PODS][0]["metadata"]["finalizers"] = [names.FINALIZER]
    informers = _informers(kube, cluster, version=10)
    informers.by_kind[GPUJOBS]._forget("u-a", T0 - 1000, _running_job())
    reconciler = _reconciler(kube, informers)
    reconciler.run_pass(T0)
    reconciler.wait_for_writes()
    assert kube.deleted_uids == ["pod-a-1"] and ("a-1", "JobDeleted") in kube.told
    assert [s for _, s in kube.quota_statuses if "retired" in s] == []  # it still runs
    cluster[PODS] = [_final(_gpu_pod("a-1", "pod-a-1"))]
    cluster[PODS][0]["metadata"]["resourceVersion"] = str(kube.version)
    reconciler.informers = _informers(kube, cluster, version=kube.version)
    reconciler.informers.by_kind[GPUJOBS]._forget("u-a", T0 - 1000, _running_job())
    reconciler.run_pass(T0 + 5)
    ((_, status),) = [(p, s) for p, s in kube.quota_statuses if "retired" in s]
    assert status["retired"]["jobs"] == ["team/a@u-a"]
    assert status["retired"]["gpuHours"] == 0.25  # 0.5 GPU for 30 min, to the pod's end
    assert kube.released == ["team/a-1"]


def test_an_earlier_attempt_without_its_owner_reference_is_released_on_its_jobs_record(
) -> None:
    """A tenant took the ownerReference off her running pod; the job requeued and runs its
    next attempt. The old pod names the job it was created for (`names.ANN_JOB_UID`, the
    operator's own annotation), so its run stays on the job's record: released, not billed
    a second time as a pod of no job."""
    job = _running_job()
    job["status"].update(attempts=2, podName="a-2", podUID="pod-a-2", history=[
        {"attempt": 1, "node": "n1", "fraction": 0.5, "start": "2027-01-15T07:00:00Z",
         "end": "2027-01-15T07:30:00Z", "outcome": "PodLost"},
        {"attempt": 2, "node": "n1", "fraction": 0.5, "start": "2027-01-15T07:31:00Z"}])
    earlier = _final(_gpu_pod("a-1", "pod-a-1", annotations={names.ANN_JOB_UID: "u-a"}))
    current = _gpu_pod("a-2", "pod-a-2", owner=_controller("a"))
    kube, _ = _pass([earlier, current], [job])
    assert kube.released == ["team/a-1"]
    assert [s for _, s in kube.quota_statuses if "retired" in s] == []


def test_a_retired_jobs_key_stays_while_another_job_of_its_project_is_retired() -> None:
    """Job a went earlier and is retired; job b is being deleted while still listed (a
    foreground or Orphan deletion). Writing b's retirement keeps a's key, so a is not
    billed a second time."""
    kube = TellingKube()
    cluster = _cluster(2)
    deleting = _job("b", "21", status={
        "phase": "Succeeded", "attempts": 1, "history": [
            {"attempt": 1, "node": "n1", "fraction": 0.5, "start": "2027-01-15T07:00:00Z",
             "end": "2027-01-15T07:30:00Z", "outcome": "Succeeded"}]})
    deleting["metadata"]["deletionTimestamp"] = "2027-01-15T07:40:00Z"
    deleting["metadata"]["finalizers"] = ["orphan"]
    cluster[GPUJOBS] = [deleting]
    cluster[QUOTAS][0]["status"] = {"retired": {
        "periodStart": "2026-12-29T00:00:00Z", "gpuHours": 0.25, "decayedGpuHours": 0.25,
        "decayedAsOf": "2027-01-15T07:30:00Z", "jobs": ["team/a@u-a"]}}
    informers = _informers(kube, cluster, version=10)
    informers.by_kind[GPUJOBS]._forget("u-a", T0 - 1000, _running_job())
    reconciler = _reconciler(kube, informers)
    reconciler.run_pass(T0)
    written = [s["retired"] for _, s in kube.quota_statuses if "retired" in s]
    assert written and sorted(written[-1]["jobs"]) == ["team/a@u-a", "team/b@u-b"]
    assert written[-1]["gpuHours"] == 0.5  # a's 0.25 once, and b's 0.25


def test_a_pod_of_a_job_deleted_while_no_operator_watched_is_billed_on_its_own() -> None:
    kube, _ = _pass([_final(_gpu_pod("a-1", "pod-a-1", owner=_controller("a")))], [])
    ((_, status),) = [(p, s) for p, s in kube.quota_statuses if "retired" in s]
    assert status["retired"]["jobs"] == ["pod:team/a-1@pod-a-1"]
    assert status["retired"]["gpuHours"] == 0.25
    assert kube.released == ["team/a-1"]


def test_a_job_being_deleted_in_the_foreground_is_retired_and_its_pod_released() -> None:
    """A foreground deletion keeps the job until its pods are gone: its pods must be released,
    or the job would wait forever; the job itself carries no finalizer to take off."""
    job = _running_job()
    job["metadata"]["deletionTimestamp"] = "2027-01-15T07:29:00Z"
    pod = _final(_gpu_pod("a-1", "pod-a-1", owner=_controller("a")))
    kube, _ = _pass([pod], [job])
    ((_, status),) = [(p, s) for p, s in kube.quota_statuses if "retired" in s]
    assert status["retired"]["jobs"] == ["team/a@u-a"]
    assert kube.released == ["team/a-1"] and kube.finalized == []
