"""Extender verbs over a real cache and a fake API server (no cluster)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import zlib
from collections.abc import Mapping
from typing import Any

from carpool.core import names
from carpool.core.assignment import parse_assignment
from carpool.core.scoring import ScoringPolicy
from carpool.extender.cache import IN_FLIGHT_STALE_S, ClusterCache
from carpool.extender.fake import FakeCluster, gpunode_object, node_object, pod_object
from carpool.extender.service import Extender, Settings, best_nodes
from carpool.extender.wire import BindingArgs, ExtenderArgs, Policy

NOW = 1_800_000_000.0
PACKING_ONLY = ScoringPolicy(fragmentation=0, packing=1, temperature=0, locality=0)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def gpu(uuid: str, model: str = "A100", memory_gib: int = 80, temp: float = 40.0,
        **extra: Any) -> dict[str, Any]:
    return {"uuid": uuid, "model": model, "memoryTotalMiB": memory_gib * 1024,
            "temperatureC": temp, **extra}


class World:
    """A cache fed by a fake API server's changes, as the watch would feed it."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.clock = Clock()
        self.cache = ClusterCache()
        for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
            self.cache.mark_synced(kind)
        self.cluster = FakeCluster(
            on_change=lambda event, pod: self.cache.apply_pod(event, pod, self.clock.now))
        self.extender = Extender(self.cache, self.cluster,
                                 settings or Settings(bind_wait_s=0.0), clock=self.clock)

    def add_node(self, name: str, gpus: list[dict[str, Any]], labels: Mapping[str, str] = {},
                 **kw: Any) -> None:
        self.cache.apply_node("ADDED", node_object(name, labels))
        self.cache.apply_gpunode("ADDED", gpunode_object(name, gpus, **kw))

    def add_pod(self, name: str, **kw: Any) -> dict[str, Any]:
        pod = pod_object(name, **kw)
        self.cluster.add_pod(pod)
        return pod

    def filter(self, pod: Mapping[str, Any], nodes: list[str]) -> dict[str, Any]:
        return self.extender.filter(ExtenderArgs(pod, tuple(nodes), None))

    def scores(self, pod: Mapping[str, Any], nodes: list[str]) -> dict[str, int]:
        result = self.extender.prioritize(ExtenderArgs(pod, tuple(nodes), None))
        return {r["Host"]: r["Score"] for r in result}

    def bind(self, name: str, node: str) -> str:
        pod = self.cluster.pod("default", name)
        return self.extender.bind(BindingArgs(name, "default", pod["metadata"]["uid"], node))[
            "Error"]

    def assignment(self, name: str) -> Any:
        pod = self.cluster.pod("default", name)
        return parse_assignment(pod["metadata"]["annotations"][names.ANN_ASSIGNMENT])

    def run(self, name: str) -> None:
        """The pod starts (KWOK marks it Running): its allocation is no longer in flight."""
        pod = self.cluster.pod("default", name)
        pod["status"]["phase"] = "Running"
        self.cache.apply_pod("MODIFIED", pod, self.clock.now)


def test_filter_keeps_fitting_nodes_and_explains_the_rest() -> None:
    w = World()
    w.add_node("a100", [gpu("a-0"), gpu("a-1")])
    w.add_node("t4", [gpu("t-0", model="T4", memory_gib=16)])
    w.add_node("hot", [gpu("h-0", temp=88.0, slowdownTemperatureC=90.0)])
    w.add_node("sick", [gpu("s-0", health="Unhealthy")])
    pod = w.add_pod("p", memory_gib=20)
    result = w.filter(pod, ["a100", "t4", "hot", "sick", "ghost"])
    assert result["NodeNames"] == ["a100"]
    assert result["Error"] == ""
    everything = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert set(everything) == {"t4", "hot", "sick", "ghost"}
    assert "16 GiB free, job needs 20 GiB" in everything["t4"]
    assert "slowdown" in everything["hot"]
    assert "unhealthy" in everything["sick"]
    assert "unknown" in everything["ghost"]
    assert all(reason.startswith("carpool: ") for reason in everything.values())
    # too small even when empty: preemption cannot help
    assert "t4" in result["FailedAndUnresolvableNodes"]


def test_filter_honours_the_model_constraint() -> None:
    w = World()
    w.add_node("a100", [gpu("a-0")])
    w.add_node("h200", [gpu("h-0", model="H200", memory_gib=140)])
    pod = w.add_pod("p", memory_gib=10, annotations={names.ANN_MODELS: "H200"})
    result = w.filter(pod, ["a100", "h200"])
    assert result["NodeNames"] == ["h200"]
    assert "job allows H200" in result["FailedAndUnresolvableNodes"]["a100"]


def test_busy_node_is_resolvable_and_full_gpu_counts_assignments() -> None:
    w = World()
    w.add_node("n", [gpu("g0", memory_gib=40)])
    w.add_pod("first", memory_gib=30)
    assert w.bind("first", "n") == ""
    w.run("first")
    second = w.add_pod("second", memory_gib=20)
    result = w.filter(second, ["n"])
    assert result["NodeNames"] == []
    assert "10 GiB free, job needs 20 GiB" in result["FailedNodes"]["n"]


def test_a_non_gpu_pod_passes_every_node() -> None:
    w = World()
    pod = pod_object("plain")
    pod["spec"]["containers"][0]["resources"] = {}
    assert w.filter(pod, ["x", "y"])["NodeNames"] == ["x", "y"]


def test_a_pod_with_bad_annotations_gets_an_error_not_a_crash() -> None:
    w = World()
    w.add_node("n", [gpu("g0")])
    pod = w.add_pod("p", memory_gib=1, annotations={names.ANN_ISOLATION: "teleport"})
    result = w.filter(pod, ["n"])
    assert "unknown isolation 'teleport'" in result["Error"]


def test_unsynced_cache_refuses_to_decide() -> None:
    cache = ClusterCache()
    extender = Extender(cache, FakeCluster(), Settings())
    result = extender.filter(ExtenderArgs(pod_object("p"), ("n",), None))
    assert "still loading" in result["Error"]
    assert result["NodeNames"] == []


def test_prioritize_prefers_the_cooler_of_two_equal_nodes() -> None:
    w = World()
    w.add_node("cool", [gpu("c0", temp=35.0)])
    w.add_node("warm", [gpu("w0", temp=75.0)])
    scores = w.scores(w.add_pod("p", memory_gib=10), ["warm", "cool"])
    assert scores == {"cool": 10, "warm": 0}


def test_prioritize_prefers_the_node_with_the_dataset() -> None:
    w = World()
    w.add_node("far", [gpu("f0")])
    w.add_node("near", [gpu("n0")], datasets=["imagenet"])
    pod = w.add_pod("p", memory_gib=10, annotations={names.ANN_DATASET: "imagenet",
                                                     names.ANN_DATASET_SIZE: "150"})
    scores = w.scores(pod, ["far", "near"])
    assert scores["near"] > scores["far"]


def test_binpack_fills_the_used_node_and_spread_the_empty_one() -> None:
    for policy, expected in ((Policy.BINPACK, "used"), (Policy.SPREAD, "empty")):
        w = World(Settings(policy, PACKING_ONLY, bind_wait_s=0.0))
        w.add_node("used", [gpu("u0")])
        w.add_node("empty", [gpu("e0")])
        w.add_pod("resident", memory_gib=40)
        assert w.bind("resident", "used") == ""
        w.run("resident")
        scores = w.scores(w.add_pod("p", memory_gib=10), ["used", "empty"])
        assert max(scores, key=lambda n: scores[n]) == expected, policy


def test_the_pod_annotation_overrides_the_policy() -> None:
    w = World(Settings(Policy.BINPACK, PACKING_ONLY, bind_wait_s=0.0))
    w.add_node("used", [gpu("u0")])
    w.add_node("empty", [gpu("e0")])
    w.add_pod("resident", memory_gib=40)
    assert w.bind("resident", "used") == ""
    pod = w.add_pod("p", memory_gib=10, annotations={names.ANN_POLICY: "spread"})
    scores = w.scores(pod, ["used", "empty"])
    assert scores["empty"] > scores["used"]


def test_bind_records_the_assignment_then_binds() -> None:
    w = World()
    w.add_node("n", [gpu("g0", memory_gib=40), gpu("g1", memory_gib=80)])
    w.add_pod("p", memory_gib=30, cores=25)
    assert w.bind("p", "n") == ""
    assert w.cluster.bindings == [("default/p", "n")]
    assignment = w.assignment("p")
    assert assignment.node == "n"
    [assigned] = assignment.gpus
    assert (assigned.uuid, assigned.index, assigned.memory_mib, assigned.cores_pct) == (
        "g0", 0, 30 * 1024, 25)  # binpack: the tighter GPU
    pod = w.cluster.pod("default", "p")
    assert pod["metadata"]["annotations"][names.ANN_ASSIGNED_AT].endswith("Z")
    raw = json.loads(pod["metadata"]["annotations"][names.ANN_ASSIGNMENT])
    assert set(raw["gpus"][0]) >= {"uuid", "index", "memoryMiB", "cores"}


def test_bind_is_idempotent_on_retry() -> None:
    w = World()
    w.add_node("n", [gpu("g0")])
    w.add_pod("p", memory_gib=10)
    assert w.bind("p", "n") == ""
    first = w.assignment("p")
    assert w.bind("p", "n") == ""  # the scheduler retried after a lost response
    assert w.assignment("p") == first
    assert w.cluster.bindings == [("default/p", "n")]


def test_a_refused_bind_gives_the_gpus_back_and_writes_nothing() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1")])
    w.add_pod("p", memory_gib=10)
    w.cluster.refuse_bind.add("default/p")
    assert "injected refusal" in w.bind("p", "n")
    assert names.ANN_ASSIGNMENT not in w.cluster.pod("default", "p")["metadata"]["annotations"]
    assert w.cache.hold_of("default/p") is None
    w.cluster.refuse_bind.clear()
    assert w.bind("p", "n") == ""
    assert w.cache.hold_of("default/p") is not None


def test_a_bind_that_may_have_been_written_keeps_its_gpus_until_the_retry() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1")])
    w.add_pod("p", memory_gib=10)
    w.cluster.fail_bind.add("default/p")  # a 500: the write may or may not have happened
    assert "injected bind failure" in w.bind("p", "n")
    held = w.cache.hold_of("default/p")
    assert held is not None and held.assumed
    w.cluster.fail_bind.clear()
    assert w.bind("p", "n") == ""  # the scheduler's retry replaces the pod's own hold
    assert w.cluster.bindings == [("default/p", "n")]


def test_an_unconfirmed_bind_frees_its_gpus_once_the_pod_is_gone() -> None:
    """The Binding's outcome is unknown (a 500) and the pod is deleted before it is bound.
    The pod watch selects bound pods only, so it never says so: the extender reads the pod."""
    w = World(Settings(bind_wait_s=0.0, ambiguous_recheck_s=0.01))
    w.cluster.on_change = lambda event, pod: (  # as the field-selected watch: bound pods
        w.cache.apply_pod(event, pod, w.clock.now) if pod["spec"].get("nodeName") else None)
    w.add_node("n", [gpu("g0")])
    w.add_pod("p", memory_gib=10)
    w.cluster.fail_bind.add("default/p")
    uid = w.cluster.pod("default", "p")["metadata"]["uid"]

    async def inline(fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def scenario() -> None:
        result = await w.extender.bind_async(BindingArgs("p", "default", uid, "n"), inline)
        assert "injected bind failure" in result["Error"]
        await asyncio.sleep(0.05)
        held = w.cache.hold_of("default/p")
        assert held is not None and held.assumed  # the pod is still there: still held
        w.cluster.delete_pod("default", "p")
        for _ in range(200):
            await asyncio.sleep(0.01)
            if w.cache.hold_of("default/p") is None:
                return
        raise AssertionError("the deleted pod's GPUs were never given back")

    asyncio.run(scenario())


def test_a_bind_written_despite_its_error_is_never_double_booked() -> None:
    """etcd applied the Binding but the API server answered 500, and the watch lags: the next
    same-count pod must not be given the same GPU (it was, before: 150 % of its SMs)."""
    w = World()
    lagging: list[tuple[str, dict[str, Any]]] = []
    w.cluster.on_change = lambda event, pod: lagging.append((event, pod))
    w.add_node("n", [gpu("g0", memory_gib=80), gpu("g1", memory_gib=80)])
    w.add_pod("a", memory_gib=60, cores=60)
    w.add_pod("b", memory_gib=60, cores=60)
    for event, pod in lagging:
        w.cache.apply_pod(event, pod, w.clock.now)
    lagging.clear()
    w.cluster.fail_after_bind.add("default/a")
    assert "timed out" in w.bind("a", "n")
    w.clock.now += IN_FLIGHT_STALE_S + 1  # past the hand-over window: b does not wait for a
    assert w.bind("b", "n") == ""
    for event, pod in lagging:  # the watch catches up: both are bound to n
        w.cache.apply_pod(event, pod, w.clock.now)
    assert {w.assignment("a").gpus[0].uuid, w.assignment("b").gpus[0].uuid} == {"g0", "g1"}


def test_bind_reuses_an_assignment_recorded_for_the_node() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1")])
    recorded = '{"node":"n","gpus":[{"uuid":"g1","index":1,"memoryMiB":10240,"cores":0}]}'
    w.add_pod("p", memory_gib=10, annotations={names.ANN_ASSIGNMENT: recorded})
    assert w.bind("p", "n") == ""
    assert [g.uuid for g in w.assignment("p").gpus] == ["g1"]  # binpack alone would say g0


def test_bind_after_filter_needs_no_read_of_the_pod() -> None:
    w = World()
    w.add_node("n", [gpu("g0")])
    pod = w.add_pod("p", memory_gib=10)
    assert w.filter(pod, ["n"])["NodeNames"] == ["n"]
    w.cluster.calls.clear()
    assert w.bind("p", "n") == ""
    assert w.cluster.calls == ["bind"]  # one write: the Binding carries the assignment


def test_bind_reads_the_pod_again_when_the_schedulers_copy_is_stale() -> None:
    w = World()
    w.add_node("n", [gpu("g0")])
    pod = w.add_pod("p", memory_gib=10)
    assert w.filter(pod, ["n"])["NodeNames"] == ["n"]
    changed = w.cluster.pod("default", "p")
    changed["metadata"]["labels"] = {"touched": "yes"}
    w.cluster.update_pod(changed)  # someone else wrote the pod after the scheduler's copy
    w.cluster.calls.clear()
    assert w.bind("p", "n") == ""
    assert w.cluster.calls == ["bind", "get", "get", "bind"]  # conflict, check, re-read, bind
    assert w.assignment("p").node == "n"
    assert w.cache.hold_of("default/p") is not None


def test_bind_refuses_a_replaced_pod_and_a_pod_bound_elsewhere() -> None:
    w = World()
    w.add_node("n", [gpu("g0")])
    w.add_pod("p", memory_gib=10)
    error = w.extender.bind(BindingArgs("p", "default", "other-uid", "n"))["Error"]
    assert "was replaced" in error
    assert w.bind("p", "n") == ""
    error = w.extender.bind(BindingArgs("p", "default", "uid-p", "m"))["Error"]
    assert "already bound to n" in error
    error = w.extender.bind(BindingArgs("gone", "default", "uid-gone", "n"))["Error"]
    assert "no longer exists" in error


def test_in_flight_pods_steer_same_count_pods_to_other_nodes_until_running() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1"), gpu("g2")])
    w.add_node("m", [gpu("m0")])
    w.add_pod("one", memory_gib=10)
    assert w.bind("one", "n") == ""
    same = w.add_pod("same", memory_gib=10)
    other = w.add_pod("pair", gpus=2, memory_gib=10)
    result = w.filter(same, ["n", "m"])
    assert result["NodeNames"] == ["m"]
    assert "allocation in flight on this node" in result["FailedNodes"]["n"]
    assert w.filter(other, ["n"])["NodeNames"] == ["n"]  # a different count is unambiguous
    assert "allocation in flight" in w.bind("same", "n")  # bind enforces it, under the lock
    w.run("one")
    assert w.filter(same, ["n", "m"])["NodeNames"] == ["n", "m"]


def test_when_every_node_has_a_hand_over_in_flight_filter_keeps_them_for_bind_to_wait() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1")])
    w.add_pod("one", memory_gib=10)
    assert w.bind("one", "n") == ""
    result = w.filter(w.add_pod("same", memory_gib=10), ["n"])
    assert result["NodeNames"] == ["n"]
    assert result["FailedNodes"] == {}


def test_bind_waits_for_the_hand_over_instead_of_failing() -> None:
    w = World(Settings(bind_wait_s=5.0))
    w.add_node("n", [gpu("g0"), gpu("g1")])
    w.add_pod("one", memory_gib=10)
    assert w.bind("one", "n") == ""
    w.add_pod("same", memory_gib=10)
    result: list[str] = []
    binding = threading.Thread(target=lambda: result.append(w.bind("same", "n")))
    binding.start()
    binding.join(0.3)
    assert binding.is_alive() and w.cluster.bindings == [("default/one", "n")]
    w.run("one")  # the scheduler picked n before it saw "one" in flight: the wait pays off
    binding.join(5)
    assert result == [""]
    assert [key for key, _ in w.cluster.bindings] == ["default/one", "default/same"]


def test_in_flight_goes_stale_after_the_timeout() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1")])
    w.add_pod("one", memory_gib=10)
    assert w.bind("one", "n") == ""
    w.add_node("m", [gpu("m0")])
    same = w.add_pod("same", memory_gib=10)
    assert w.filter(same, ["n", "m"])["NodeNames"] == ["m"]
    w.clock.now += IN_FLIGHT_STALE_S + 1
    assert w.filter(same, ["n", "m"])["NodeNames"] == ["n", "m"]


def test_the_device_plugins_allocated_mark_ends_in_flight() -> None:
    w = World()
    w.add_node("n", [gpu("g0"), gpu("g1")])
    w.add_pod("one", memory_gib=10)
    assert w.bind("one", "n") == ""
    w.add_node("m", [gpu("m0")])
    same = w.add_pod("same", memory_gib=10)
    assert w.filter(same, ["n", "m"])["NodeNames"] == ["m"]
    w.cluster.annotate_pod("default", "one", {names.ANN_ALLOCATED: "g0::0"})
    assert w.filter(same, ["n", "m"])["NodeNames"] == ["n", "m"]


def test_concurrent_binds_never_over_commit_a_gpu() -> None:
    w = World()
    w.cluster.delay_s = 0.002  # widen the window between choosing and writing
    w.add_node("n", [gpu("g0", memory_gib=40)])
    pods = [f"p{i}" for i in range(12)]
    for name in pods:
        w.add_pod(name, memory_gib=15)
    errors: dict[str, str] = {}
    barrier = threading.Barrier(len(pods))

    def bind(name: str) -> None:
        barrier.wait()
        errors[name] = w.bind(name, "n")
        if not errors[name]:
            w.run(name)  # let the next same-count pod through the handshake rule

    threads = [threading.Thread(target=bind, args=(n,)) for n in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bound = [n for n in pods if not errors[n]]
    assert 1 <= len(bound) <= 2  # 40 GiB holds two 15 GiB pods, never three
    used = sum(g.memory_mib for n in bound for g in w.assignment(n).gpus)
    assert used <= 40 * 1024
    assert len(w.cluster.bindings) == len(bound)


def test_concurrent_binds_of_different_counts_share_the_node_safely() -> None:
    w = World()
    w.cluster.delay_s = 0.001
    w.add_node("n", [gpu(f"g{i}", memory_gib=40) for i in range(4)])
    shapes = {f"p{i}": (1 + i % 4, 15) for i in range(16)}
    for name, (count, mem) in shapes.items():
        w.add_pod(name, gpus=count, memory_gib=mem)
    barrier = threading.Barrier(len(shapes))
    results: dict[str, str] = {}

    def bind(name: str) -> None:
        barrier.wait()
        results[name] = w.bind(name, "n")

    threads = [threading.Thread(target=bind, args=(n,)) for n in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    per_gpu: dict[str, int] = {}
    for name, error in results.items():
        if not error:
            for g in w.assignment(name).gpus:
                per_gpu[g.uuid] = per_gpu.get(g.uuid, 0) + g.memory_mib
    assert per_gpu and max(per_gpu.values()) <= 40 * 1024


def test_exclusive_pods_take_the_whole_gpu() -> None:
    w = World()
    w.add_node("n", [gpu("g0")])
    w.add_pod("solo", annotations={names.ANN_ISOLATION: "exclusive"})
    assert w.bind("solo", "n") == ""
    w.run("solo")
    result = w.filter(w.add_pod("small", memory_gib=1), ["n"])
    assert "held exclusively" in result["FailedNodes"]["n"]


def test_multi_container_pods_get_gpus_per_container() -> None:
    w = World()
    w.add_node("n", [gpu("g0", memory_gib=40), gpu("g1", memory_gib=40)])
    w.add_pod("p", memory_gib=30, containers=2)
    assert w.bind("p", "n") == ""
    gpus = w.assignment("p").gpus
    assert {g.container for g in gpus} == {"c0", "c1"}
    assert {g.uuid for g in gpus} == {"g0", "g1"}  # 30 + 30 GiB cannot share a 40 GiB GPU


def test_prioritize_nominates_its_favourite_and_filter_steers_the_next_pod_away() -> None:
    w = World()
    w.add_node("n1", [gpu("a0"), gpu("a1")])
    w.add_node("n2", [gpu("b0"), gpu("b1")])
    first = w.add_pod("first", memory_gib=10)
    scores = w.scores(first, ["n1", "n2"])
    assert sorted(scores.values()) == [9, 10]  # equal nodes, still one clear favourite
    favourite = max(scores, key=lambda n: scores[n])
    other = "n2" if favourite == "n1" else "n1"
    second = w.add_pod("second", memory_gib=10)
    result = w.filter(second, ["n1", "n2"])
    assert result["NodeNames"] == [other]
    assert "being bound there" in result["FailedNodes"][favourite]
    assert w.filter(w.add_pod("pair", gpus=2, memory_gib=10), ["n1", "n2"])["NodeNames"] == [
        "n1", "n2"]  # another count is not ambiguous
    assert w.bind("first", favourite) == ""
    w.run("first")
    assert w.filter(second, ["n1", "n2"])["NodeNames"] == ["n1", "n2"]


BEST_ONE = Settings(bind_wait_s=0.0, filter_best=1)


def test_filter_best_passes_only_carpools_first_choice_and_nominates_it() -> None:
    w = World(BEST_ONE)
    w.add_node("warm", [gpu("w0", temp=75.0)])
    w.add_node("cool", [gpu("c0", temp=35.0)])
    w.add_node("t4", [gpu("t0", model="T4", memory_gib=16)])
    pod = w.add_pod("p", memory_gib=10)
    # the node prioritize would score 10, alone: the scheduler then binds it without scoring
    assert w.scores(pod, ["warm", "cool"]) == {"cool": 10, "warm": 0}
    result = w.filter(pod, ["warm", "cool", "t4"])
    assert result["NodeNames"] == ["cool"]
    assert result["FailedNodes"] == {} and result["FailedAndUnresolvableNodes"] == {}
    # nominated, as prioritize would have: the next same-count pod is steered to the other
    assert w.filter(w.add_pod("next", memory_gib=10), ["warm", "cool"])["NodeNames"] == [
        "warm"]
    assert w.bind("p", "cool") == ""


def test_filter_best_keeps_the_best_few_in_order_and_explains_when_none_fits() -> None:
    w = World(Settings(bind_wait_s=0.0, filter_best=2))
    for name, temp in (("n30", 30.0), ("n50", 50.0), ("n70", 70.0), ("n40", 40.0)):
        w.add_node(name, [gpu(f"{name}-g", temp=temp)])
    assert w.filter(w.add_pod("p", memory_gib=10), ["n70", "n50", "n40", "n30"])[
        "NodeNames"] == ["n30", "n40"]
    too_big = w.filter(w.add_pod("big", memory_gib=100), ["n70", "n30"])
    assert too_big["NodeNames"] == []
    assert set(too_big["FailedAndUnresolvableNodes"]) == {"n70", "n30"}


def test_filter_best_breaks_ties_per_pod_so_equal_nodes_share_the_load() -> None:
    w = World(BEST_ONE)
    nodes = [f"n{i}" for i in range(8)]
    for name in nodes:
        w.add_node(name, [gpu(f"{name}-g")])
    chosen = {w.filter(w.add_pod(f"p{i}", memory_gib=10), nodes)["NodeNames"][0]
              for i in range(8)}
    assert len(chosen) > 1
    pod = w.add_pod("same", memory_gib=10)
    w.extender.nominations.clear("default/same")
    assert w.filter(pod, nodes)["NodeNames"] == w.filter(pod, nodes)["NodeNames"]


def test_best_nodes_picks_the_top_score_then_the_pods_hash_of_the_node() -> None:
    """The rule `best_nodes` implements, written plainly: highest (score, crc32 of the node
    salted by the pod), the first of equals; for one node and for several."""
    rng = random.Random(7)
    for trial in range(300):
        names = [f"node-{rng.randrange(10**rng.randrange(1, 5))}-{i}" for i in
                 range(rng.randrange(1, 40))]
        if trial % 3 == 0:
            names += names[:3]  # repeated names: the first of equals still wins
        scores = {n: rng.choice((0.25, 0.5, 0.5, 0.75, 0.75)) for n in names}
        pod = f"ns/p{trial}"
        salt = zlib.crc32(f"{pod}@".encode())
        ranked = sorted(dict.fromkeys(names), key=lambda n: (-scores[n],
                                                              -zlib.crc32(n.encode(), salt)))
        assert best_nodes(names, scores, pod, 1) == [max(
            names, key=lambda n: (scores[n], zlib.crc32(n.encode(), salt)))]
        assert best_nodes(names, scores, pod, 1) == ranked[:1]
        keep = rng.randrange(1, 5)
        assert best_nodes(list(scores), scores, pod, keep) == ranked[:keep]
