"""The extender's cache: assume, confirm, forget; relists; what a watch event means."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any, cast

from carpool.core import names
from carpool.core.assignment import AssignedGpu, Assignment, encode_assignment
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant
from carpool.extender.cache import ASSUMED_TTL_S, ClusterCache, InFlightClash, Refused
from carpool.extender.fake import gpunode_object, node_object, pod_object
from carpool.extender.kube import PODS_THAT_HOLD, start_informers
from carpool.kube.client import Api
from carpool.kube.errors import NotFound
from carpool.kube.resources import NODES, PODS

NOW = 1_800_000_000.0
GIB = 1024


def cache_with_node(name: str = "n", gpus: int = 1, memory_gib: int = 40) -> ClusterCache:
    cache = ClusterCache()
    cache.apply_node("ADDED", node_object(name))
    cache.apply_gpunode("ADDED", gpunode_object(name, [
        {"uuid": f"{name}-g{i}", "model": "A100", "memoryTotalMiB": memory_gib * GIB}
        for i in range(gpus)]))
    return cache


def take(memory_gib: int, gpu: str = "n-g0") -> Any:
    """A chooser that takes `memory_gib` on one GPU if it is free enough."""

    def choose(state: NodeState) -> tuple[Assignment, tuple[GpuGrant, ...]] | Refused:
        free = {f.gpu.uuid: f for f in state.free()}[gpu]
        if free.memory_mib < memory_gib * GIB:
            return Refused("full")
        grant = GpuGrant(gpu, memory_gib * GIB, 0)
        return (Assignment(state.name, (AssignedGpu(gpu, 0, memory_gib * GIB, 0),)), (grant,))

    return choose


def bound_pod(name: str, node: str, memory_gib: int, gpu: str = "n-g0", phase: str = "Pending",
              **extra_annotations: str) -> dict[str, Any]:
    pod = pod_object(name, memory_gib=memory_gib)
    assignment = Assignment(node, (AssignedGpu(gpu, 0, memory_gib * GIB, 0, "", "c0"),))
    pod["metadata"]["annotations"] = {names.ANN_ASSIGNMENT: encode_assignment(assignment),
                                      names.ANN_ASSIGNED_AT: "2027-01-15T08:00:00Z",
                                      **extra_annotations}
    pod["spec"]["nodeName"] = node
    pod["status"]["phase"] = phase
    return pod


def used_mib(cache: ClusterCache, node: str = "n") -> int:
    state = cache.snapshot([node], "", NOW).states[node]
    return sum(g.memory_mib for g in state.grants)


def test_an_assumption_holds_capacity_until_the_watch_confirms_it() -> None:
    cache = cache_with_node()
    assert isinstance(cache.reserve("default/a", "uid-a", "n", frozenset({1}), NOW,
                                        take(30)), Assignment)
    assert used_mib(cache) == 30 * GIB
    assert cache.reserve("default/b", "uid-b", "n", frozenset({2}), NOW,
                         take(30)) == Refused("full")
    cache.apply_pod("MODIFIED", bound_pod("a", "n", 30), NOW)  # confirmed by the watch
    assert cache.counts()["assumed"] == 0 and cache.counts()["holds"] == 1
    assert used_mib(cache) == 30 * GIB


def test_forget_gives_the_capacity_back() -> None:
    cache = cache_with_node()
    cache.reserve("default/a", "uid-a", "n", frozenset({1}), NOW, take(30))
    cache.forget("default/a", "uid-other")  # another pod of that name: not ours to drop
    assert used_mib(cache) == 30 * GIB
    cache.forget("default/a", "uid-a")
    assert used_mib(cache) == 0


def test_a_relist_keeps_unconfirmed_assumptions_and_drops_vanished_pods() -> None:
    cache = cache_with_node(gpus=2)
    cache.apply_pod("ADDED", bound_pod("old", "n", 10, gpu="n-g1", phase="Running"), NOW)
    assert used_mib(cache) == 10 * GIB
    assert isinstance(cache.reserve("default/new", "uid-new", "n", frozenset({1}), NOW,
                                        take(20)), Assignment)
    cache.replace_pods([], NOW)  # "old" is gone; "new" is not visible yet
    assert used_mib(cache) == 20 * GIB


def test_deleted_and_finished_pods_hold_nothing() -> None:
    cache = cache_with_node()
    cache.apply_pod("ADDED", bound_pod("a", "n", 10, phase="Running"), NOW)
    cache.apply_pod("ADDED", bound_pod("b", "n", 10, phase="Running"), NOW)
    assert used_mib(cache) == 20 * GIB
    cache.apply_pod("MODIFIED", bound_pod("a", "n", 10, phase="Succeeded"), NOW)
    cache.apply_pod("DELETED", bound_pod("b", "n", 10, phase="Running"), NOW)
    assert used_mib(cache) == 0


def test_a_pod_whose_deletion_is_final_holds_nothing_though_a_finalizer_keeps_it() -> None:
    """Deleted with grace 0 (its containers done, or forced), a pod stays only while Carpool's
    finalizer waits for the operator to record its run: its GPUs are free already; one still
    in its grace period holds them."""
    cache = cache_with_node()
    pod = bound_pod("a", "n", 10, phase="Running")
    pod["metadata"].update(finalizers=["carpool.dev/accounting"],
                           deletionTimestamp="2027-01-15T08:00:00Z", deletionGracePeriodSeconds=30)
    cache.apply_pod("MODIFIED", pod, NOW)
    assert used_mib(cache) == 10 * GIB
    pod["metadata"]["deletionGracePeriodSeconds"] = 0
    cache.apply_pod("MODIFIED", pod, NOW)
    assert used_mib(cache) == 0


def test_a_stale_annotation_on_a_pod_bound_elsewhere_is_ignored() -> None:
    cache = cache_with_node()
    pod = bound_pod("a", "n", 10)
    pod["spec"]["nodeName"] = "m"
    cache.apply_pod("ADDED", pod, NOW)
    assert used_mib(cache) == 0


def test_in_flight_ends_with_the_device_plugins_mark_or_running() -> None:
    cache = cache_with_node(gpus=2)
    cache.apply_pod("ADDED", bound_pod("a", "n", 10), NOW)
    clash = cache.reserve("default/b", "uid-b", "n", frozenset({1}), NOW, take(10, "n-g1"))
    assert isinstance(clash, InFlightClash) and "default/a" in clash.reason
    cache.apply_pod("MODIFIED", bound_pod("a", "n", 10, **{names.ANN_ALLOCATED: "x::0"}), NOW)
    assert isinstance(cache.reserve("default/b", "uid-b", "n", frozenset({1}), NOW,
                                        take(10, "n-g1")), Assignment)


def test_a_pods_own_hold_does_not_block_it() -> None:
    cache = cache_with_node()
    cache.apply_pod("ADDED", bound_pod("a", "n", 30), NOW)
    snapshot = cache.snapshot(["n"], "default/a", NOW)
    assert snapshot.states["n"].grants == () and snapshot.in_flight == {}
    assert "n" in cache.snapshot(["n"], "default/b", NOW).in_flight


def test_unconfirmed_assumptions_expire_only_while_the_watch_is_healthy() -> None:
    cache = cache_with_node()
    cache.reserve("default/a", "uid-a", "n", frozenset({1}), NOW, take(30))
    later = NOW + ASSUMED_TTL_S + 1
    assert cache.expire_assumed(later) == []  # the watch is down: keep being careful
    cache.pods_watch_healthy = True
    assert cache.expire_assumed(later) == ["default/a"]
    assert used_mib(cache) == 0


def test_unknown_unready_and_unreadable_nodes_explain_themselves() -> None:
    cache = ClusterCache()
    cache.apply_node("ADDED", node_object("down", ready=False))
    cache.apply_gpunode("ADDED", gpunode_object("down", [{"uuid": "g", "model": "A100"}]))
    cache.apply_node("ADDED", node_object("bad"))
    cache.apply_gpunode("ADDED", {"metadata": {"name": "bad"}, "status": {"gpus": "many"}})
    snapshot = cache.snapshot(["down", "bad", "ghost"], "", NOW)
    assert not snapshot.states["down"].inventory.ready
    assert "GpuNode status unreadable" in snapshot.missing["bad"]
    assert "unknown" in snapshot.missing["ghost"]
    cache.apply_node("DELETED", node_object("down"))
    assert "down" in cache.snapshot(["down"], "", NOW).missing


class FakeResponse:
    """A watch stream: its events, one JSON line each; then waits for `hold` if given."""

    def __init__(self, lines: list[dict[str, Any]], hold: threading.Event | None = None
                 ) -> None:
        self._lines = [json.dumps(line).encode() + b"\n" for line in lines]
        self._hold = hold

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        yield from self._lines
        if self._hold is not None:
            self._hold.wait(10)

    def shutdown(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class FakeApi:
    """`carpool.kube.Api`'s list and watch, answering from scripted lists and watches of one
    path (404 for others); once the script is spent, a watch waits until `spent` is set."""

    def __init__(self, path: str, lists: list[list[Any]],
                 watches: list[list[dict[str, Any]]]) -> None:
        self.path, self.lists, self.watches = path, lists, watches
        self.calls: list[str] = []
        self.spent = threading.Event()

    def list_all(self, path: str, query: dict[str, Any]) -> tuple[list[Any], str]:
        if path != self.path:
            raise NotFound(404)
        self.calls.append(f"list?{query.get('fieldSelector', '')}")
        return self.lists.pop(0), str(len(self.calls))

    def stream(self, path: str, query: dict[str, Any], read_timeout: float) -> FakeResponse:
        if self.spent.is_set():
            return FakeResponse([], self.spent)
        self.calls.append(f"watch@{query['resourceVersion']}")
        if self.watches:
            return FakeResponse(self.watches.pop(0))
        self.spent.set()
        return FakeResponse([])

    def run(self, cache: ClusterCache) -> None:
        """The extender's watches until the script is spent."""
        reflectors = start_informers(cast(Api, self), cache)
        assert self.spent.wait(10)
        for reflector in reflectors:
            reflector.stop()
        for reflector in reflectors:
            reflector.join(10)


def test_the_informer_relists_after_a_410_and_forgets_what_vanished_meanwhile() -> None:
    cache = ClusterCache()
    api = FakeApi(NODES.path(), [[node_object("a"), node_object("b")],
                                 [node_object("a"), node_object("c")]],
                  [[{"type": "ADDED", "object": node_object("d")},
                    {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                 "reason": "Expired",
                                                 "message": "too old resource version"}}]])
    api.run(cache)
    assert api.calls == ["list?", "watch@1", "list?", "watch@3"]
    assert cache.synced(["nodes"])
    assert set(cache.snapshot(["a", "b", "c", "d"], "", NOW).states) == {"a", "c"}


def test_a_heartbeat_that_changes_nothing_keeps_the_nodes_state() -> None:
    cache = cache_with_node()
    before = cache.snapshot(["n"], "", NOW).states["n"]
    beat = gpunode_object("n", [{"uuid": "n-g0", "model": "A100", "memoryTotalMiB": 40 * GIB}])
    beat["status"]["heartbeat"] = "2027-01-15T08:00:10Z"
    cache.apply_gpunode("MODIFIED", beat)
    assert cache.snapshot(["n"], "", NOW).states["n"] is before
    beat["status"]["gpus"][0]["temperatureC"] = 80.0
    cache.apply_gpunode("MODIFIED", beat)
    after = cache.snapshot(["n"], "", NOW).states["n"]
    assert after is not before and after.inventory.gpus[0].temperature_c == 80.0


def test_the_pod_informer_lists_and_watches_only_pods_that_can_hold_resources() -> None:
    """Pending and finished pods are not sent (see kube.PODS_THAT_HOLD); a pod that
    finishes leaves the selection as a DELETED event, which frees what it held."""
    cache = ClusterCache()
    cache.apply_node("ADDED", node_object("n"))
    cache.apply_gpunode("ADDED", gpunode_object(
        "n", [{"uuid": "n-g0", "model": "A100", "memoryTotalMiB": 40 * GIB}]))
    bound = pod_object("a", memory_gib=10)
    bound["spec"]["nodeName"] = "n"
    bound["metadata"]["annotations"][names.ANN_ASSIGNMENT] = json.dumps(
        {"node": "n", "gpus": [{"uuid": "n-g0", "index": 0, "memoryMiB": 10 * GIB,
                                "cores": 0}]})
    finished = {**bound, "status": {"phase": "Succeeded"}}
    api = FakeApi(PODS.path(), [[bound]], [[{"type": "DELETED", "object": finished}]])
    held: list[int] = []
    replace_pods = cache.replace_pods

    def relisted(pods: list[Any], now: float) -> None:
        replace_pods(pods, NOW)
        held.append(used_mib(cache))

    cache.replace_pods = relisted  # type: ignore[method-assign]
    api.run(cache)
    assert api.calls == [f"list?{PODS_THAT_HOLD}", "watch@1", "watch@1"]
    assert held == [10 * GIB]
    assert "spec.nodeName!=" in PODS_THAT_HOLD and "status.phase!=Succeeded" in PODS_THAT_HOLD
    assert used_mib(cache) == 0 and cache.hold_of("default/a") is None



def test_a_gang_attempt_counts_as_created_once_its_job_says_so() -> None:
    """The extender binds no worker of a gang before its GpuJob's status.gangCreated reaches
    the worker's attempt (the operator writes it once every worker's pod exists)."""
    from carpool.core.ownership import Owner
    cache = ClusterCache()
    job: dict[str, Any] = {"metadata": {"name": "train", "namespace": "lab", "uid": "u1"},
                           "spec": {"project": "lab", "gpu": {"count": 1, "memory": "8Gi"},
                                    "workers": [{"name": "w", "replicas": 3}]},
                           "status": {}}
    cache.apply_gpujob("ADDED", job)
    assert cache.gang_created("lab", Owner("train", "u1")) == 0
    cache.apply_gpujob("MODIFIED", {**job, "status": {"gangCreated": 2}})
    assert cache.gang_created("lab", Owner("train", "u1")) == 2
    assert cache.gang_created("lab", Owner("train", "other-uid")) == 0
    cache.apply_gpujob("DELETED", job)
    assert cache.gang_created("lab", Owner("train", "u1")) == 0


def test_a_gang_workers_gpus_stay_reserved_for_it_until_its_pod_is_bound() -> None:
    """The GPUs an admitted gang's admission chose for each worker (status.workers, written
    by the operator) are held for that worker while its pod is not bound: another pod bound
    meanwhile cannot take them and leave the gang short of a worker."""
    cache = cache_with_node(gpus=2)
    job: dict[str, Any] = {
        "metadata": {"name": "train", "namespace": "lab", "uid": "u1"},
        "spec": {"project": "lab", "gpu": {"count": 1, "memory": "40Gi",
                                           "isolation": "exclusive"},
                 "workers": [{"name": "w", "replicas": 2}]},
        "status": {"phase": "Admitted", "attempts": 1, "workers": [
            {"rank": r, "pod": f"train-1-w{r}" if r else "train-1", "node": "n",
             "gpus": [{"uuid": f"n-g{r}", "index": r, "memoryMiB": 40 * GIB, "cores": 100}]}
            for r in range(2)]}}
    cache.apply_gpujob("ADDED", job)
    # anyone else sees both GPUs taken; each worker sees only the other's reservation
    assert used_mib(cache) == 80 * GIB
    own = cache.snapshot(["n"], "lab/train-1", NOW).states["n"]
    assert [g.gpu_uuid for g in own.grants] == ["n-g1"]
    assert cache.reserve("default/other", "uid-o", "n", frozenset({1}), NOW,
                         take(10, "n-g1")) == Refused("full")
    # rank 0 binds: its own pod's assignment holds its GPU from then on
    assert isinstance(cache.reserve("lab/train-1", "uid-0", "n", frozenset({1}), NOW,
                                    take(40, "n-g0")), Assignment)
    cache.apply_pod("MODIFIED", _named(bound_pod("train-1", "n", 40, "n-g0"), "lab"), NOW)
    cache.apply_gpujob("MODIFIED", {**job, "status": {**job["status"], "phase": "Running"}})
    assert used_mib(cache) == 80 * GIB  # rank 1's GPU is still kept for it
    # the gang ends: only what bound pods hold is left
    cache.apply_gpujob("MODIFIED", {**job, "status": {"phase": "Succeeded"}})
    assert used_mib(cache) == 40 * GIB
    cache.apply_gpujob("DELETED", job)
    assert used_mib(cache) == 40 * GIB
    # a status the operator would not write reserves nothing (and breaks nothing)
    odd = {**job, "status": {"phase": "Admitted", "workers": [{"rank": "first", "node": "n"}]}}
    cache.apply_gpujob("ADDED", odd)
    assert used_mib(cache) == 40 * GIB
    # a relist that no longer shows an admitted gang drops its reservations
    cache.replace_gpujobs([job])
    assert used_mib(cache) == 80 * GIB
    cache.replace_gpujobs([])
    assert used_mib(cache) == 40 * GIB


def _named(pod: dict[str, Any], namespace: str) -> dict[str, Any]:
    pod["metadata"]["namespace"] = namespace
    return pod
