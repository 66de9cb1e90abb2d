"""The live extender feeds the scorer what the placement benchmark's replays use: the pod's
CPU and memory requests, the CPU already requested on each node, and GPUs per model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from carpool.core.scoring import ScoringPolicy
from carpool.extender.cache import ClusterCache
from carpool.extender.fake import FakeCluster, gpunode_object, node_object, pod_object
from carpool.extender.inventory import inventory_from_objects, node_allocatable
from carpool.extender.service import Extender, Settings
from carpool.extender.wire import (
    BindingArgs,
    ExtenderArgs,
    WireError,
    decode_pod,
    pod_requests,
)

NOW = 1_800_000_000.0
GIB = 1024


def with_requests(pod: dict[str, Any], cpu: str, memory: str = "") -> dict[str, Any]:
    requests = {"cpu": cpu, **({"memory": memory} if memory else {})}
    for container in pod["spec"]["containers"]:
        container["resources"]["requests"] = dict(requests)
    return pod


def node_with(name: str, cpu: str, memory: str = "512Gi") -> dict[str, Any]:
    node = node_object(name)
    node["status"]["allocatable"] = {"cpu": cpu, "memory": memory}
    return node


def plain_pod(name: str, node: str, cpu: str, phase: str = "Running") -> dict[str, Any]:
    """A pod without GPUs, bound to `node`."""
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"nodeName": node, "containers": [
                {"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}]},
            "status": {"phase": phase}}


def test_pod_requests_count_as_kube_scheduler_counts_them() -> None:
    spec: dict[str, Any] = {
        "containers": [{"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
                       {"resources": {"requests": {"cpu": "1.5"}}}],
        "initContainers": [{"resources": {"requests": {"cpu": "4", "memory": "256Mi"}}}],
        "overhead": {"cpu": "100m"},
    }
    assert pod_requests(spec) == (4100, 1024)  # init CPU is larger; memory from containers
    assert pod_requests({"containers": [{"resources": {"requests": {"cpu": "lots"}}}]}) == (0, 0)
    pod = with_requests(pod_object("p", memory_gib=10), "8", "32Gi")
    demand = decode_pod(pod)
    assert (demand.cpu_milli, demand.memory_mib) == (8000, 32 * GIB)


def test_node_allocatable_becomes_the_inventorys_cpu_and_memory() -> None:
    node = node_with("n", "64", "256Gi")
    inventory = inventory_from_objects(node, gpunode_object("n", [{"uuid": "g", "model": "A100"}]))
    assert (inventory.cpu_milli, inventory.memory_mib) == (64_000, 256 * GIB)
    assert node_allocatable(node_object("bare")) == (0, 0)  # unknown: unconstrained


def test_cpu_requested_on_a_node_follows_its_pods_gpu_or_not() -> None:
    cache = ClusterCache()
    cache.apply_node("ADDED", node_with("n", "32"))
    cache.apply_gpunode("ADDED", gpunode_object("n", [{"uuid": "g", "model": "A100"}]))
    cache.apply_pod("ADDED", plain_pod("web", "n", "2"), NOW)
    cache.apply_pod("ADDED", plain_pod("other", "elsewhere", "3"), NOW)
    state = cache.state_of("n")
    assert state is not None and (state.cpu_used_milli, state.memory_used_mib) == (2000, GIB)
    cache.apply_pod("MODIFIED", plain_pod("web", "n", "2", phase="Succeeded"), NOW)
    assert cache.usage_of("n") == (0, 0)
    cache.apply_pod("ADDED", plain_pod("batch", "n", "6"), NOW)
    cache.replace_pods([], NOW)  # a relist without it: gone
    assert cache.usage_of("n") == (0, 0)


def test_a_bind_counts_the_pods_cpu_until_the_watch_shows_it() -> None:
    cache = ClusterCache()
    cache.apply_node("ADDED", node_with("n", "32"))
    cache.apply_gpunode("ADDED", gpunode_object("n", [{"uuid": "g", "model": "A100"}]))
    world = FakeCluster(on_change=lambda event, pod: cache.apply_pod(event, pod, NOW))
    for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
        cache.mark_synced(kind)
    extender = Extender(cache, world, Settings(bind_wait_s=0.0), clock=lambda: NOW)
    pod = with_requests(pod_object("p", memory_gib=10), "4")
    world.add_pod(pod)
    assert extender.filter(ExtenderArgs(pod, ("n",), None))["NodeNames"] == ["n"]
    assert cache.usage_of("n") == (0, 0)
    assert extender.bind(BindingArgs("p", "default", "uid-p", "n")) == {"Error": ""}
    assert cache.usage_of("n") == (4000, 0)  # from the watch now, the same amount
    cache.apply_pod("DELETED", world.get_pod("default", "p"), NOW)
    assert cache.usage_of("n") == (0, 0)


def test_the_cache_counts_gpus_per_model_as_nodes_come_and_go() -> None:
    cache = ClusterCache()
    for name, model, count in (("a", "T4", 2), ("b", "V100", 4)):
        cache.apply_node("ADDED", node_object(name))
        cache.apply_gpunode("ADDED", gpunode_object(
            name, [{"uuid": f"{name}{i}", "model": model} for i in range(count)]))
    assert cache.supply() == {"T4": 2, "V100": 4}
    cache.apply_node("DELETED", node_object("b"))
    assert cache.supply() == {"T4": 2}


class World:
    def __init__(self, settings: Settings | None = None) -> None:
        self.cache = ClusterCache()
        for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
            self.cache.mark_synced(kind)
        self.cluster = FakeCluster(
            on_change=lambda event, pod: self.cache.apply_pod(event, pod, NOW))
        self.extender = Extender(self.cache, self.cluster, settings or Settings(bind_wait_s=0.0),
                                 clock=lambda: NOW)
        self.nodes: list[str] = []
        self.pods = 0

    def add_node(self, name: str, cpu: str, model: str = "A100", gpus: int = 8) -> None:
        self.cache.apply_node("ADDED", node_with(name, cpu))
        self.cache.apply_gpunode("ADDED", gpunode_object(
            name, [{"uuid": f"{name}-g{i}", "model": model} for i in range(gpus)]))
        self.nodes.append(name)

    def pod(self, cpu: str = "", models: str = "") -> dict[str, Any]:
        self.pods += 1
        annotations = {"carpool.dev/models": models} if models else {}
        pod = pod_object(f"p{self.pods}", memory_gib=16, cores=100, annotations=annotations)
        return with_requests(pod, cpu) if cpu else pod

    def learn(self, pods: int, **kw: str) -> None:
        """Let the extender see `pods` pods like this (it learns its target workload)."""
        for _ in range(pods):
            self.extender.filter(ExtenderArgs(self.pod(**kw), tuple(self.nodes), None))

    def scores(self, pod: Mapping[str, Any]) -> dict[str, int]:
        result = self.extender.prioritize(ExtenderArgs(pod, tuple(self.nodes), None))
        return {entry["Host"]: entry["Score"] for entry in result}


def test_cpu_heavy_pods_go_where_cpu_is_plentiful_for_the_idle_gpus() -> None:
    world = World()
    world.add_node("cpu-poor", "24")
    world.add_node("cpu-rich", "128")
    world.learn(200, cpu="12")  # the workload brings 12 cores per GPU
    assert world.extender.ranker.workload.cpu_per_gpu_milli > 0
    # (equal raw scores would come back as 10 and 9: prioritize names one favourite)
    assert world.scores(world.pod(cpu="20")) == {"cpu-rich": 10, "cpu-poor": 0}
    # light pods use up the CPU-poor node's GPUs
    assert world.scores(world.pod(cpu="1")) == {"cpu-rich": 0, "cpu-poor": 10}


def test_flexible_pods_leave_the_model_that_constrained_pods_need() -> None:
    # the scarcity term alone (fragmentation would also see it): it needs GPUs per model
    scarcity_only = ScoringPolicy(fragmentation=0, balance=0, scarcity=1, temperature=0,
                                  locality=0)
    world = World(Settings(scoring=scarcity_only, bind_wait_s=0.0))
    world.add_node("t4", "128", model="T4")
    world.add_node("v100", "128", model="V100")
    world.learn(150)
    world.learn(60, models="T4")  # some pods can only run on T4s
    assert world.extender.ranker.workload.shapes
    flexible = world.scores(world.pod())
    # (equal raw scores would come back as 10 and 9: prioritize names one favourite)
    assert flexible == {"v100": 10, "t4": 0}


@pytest.mark.parametrize(("gpus", "why"), [
    ("x", "'x' is not a quantity"), ("1.5", "'1.5' must be a non-negative whole number"),
    ("-1", "'-1' must be a non-negative whole number"),
    ("2G", "'2G' is implausibly large"), (" 2T ", "' 2T ' is implausibly large")])
def test_a_pods_gpu_quantity_is_checked_on_every_read(gpus: str, why: str) -> None:
    """Each text is parsed once (`wire._whole_number`); a bad one is refused every time."""
    pod = pod_object("p")
    pod["spec"]["containers"][0]["resources"]["limits"]["carpool.dev/gpu"] = gpus
    for _ in range(2):
        with pytest.raises(WireError, match=f"carpool.dev/gpu: {why}"):
            decode_pod(pod)


def test_a_pods_gpu_quantity_reads_the_same_each_time() -> None:
    pod = pod_object("p", gpus=2, memory_gib=10)
    pod["spec"]["containers"][0]["resources"]["limits"]["carpool.dev/gpu-cores"] = "50"
    first, again = decode_pod(pod), decode_pod(pod)
    assert first == again
    (container,) = first.containers
    assert (container.request.count, container.request.memory_mib,
            container.request.cores_pct) == (2, 10 * 1024, 50)
