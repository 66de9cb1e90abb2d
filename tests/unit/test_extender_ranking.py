"""The extender's seam to the placement core: placement per container, score scaling, memo."""

from __future__ import annotations

from carpool.core.placement import NodeState
from carpool.core.resources import Gpu, GpuRequest, NodeInventory
from carpool.core.workload import Demand, TargetWorkload
from carpool.extender.ranking import (
    MAX_SCORE,
    Ranker,
    WorkloadTracker,
    materially_different,
    place,
    scale_scores,
)
from carpool.extender.wire import ContainerDemand, PodDemand, Policy

GIB = 1024


def node(name: str = "n", gpus: int = 2, memory_gib: int = 40) -> NodeState:
    return NodeState(NodeInventory(name, tuple(
        Gpu(i, f"{name}-g{i}", "A100", memory_gib * GIB) for i in range(gpus))))


def demand(*containers: tuple[int, int], uid: str = "u") -> PodDemand:
    return PodDemand("ns", "p", uid, tuple(
        ContainerDemand(f"c{i}", GpuRequest(count, memory * GIB))
        for i, (count, memory) in enumerate(containers)))


def test_each_container_gets_distinct_gpus_and_the_node_state_carries_over() -> None:
    ranker = Ranker()
    placed = ranker.place(node(), demand((1, 30), (1, 30)), Policy.BINPACK)
    assert not isinstance(placed, str)
    assert [g.gpu_uuid for g in placed.grants] == sorted({g.gpu_uuid for g in placed.grants})
    assert len(placed.per_container) == 2 and 0 <= placed.score <= 1


def test_a_pod_that_does_not_fit_gets_the_placement_cores_reason() -> None:
    reason = Ranker().place(node(gpus=1), demand((2, 10)), Policy.BINPACK)
    assert isinstance(reason, str) and reason.startswith("1 of 2 GPUs fit")


def test_multi_gpu_requests_still_get_distinct_gpus() -> None:
    placed = place(node(gpus=4), demand((3, 10)), Ranker()._scorers[Policy.BINPACK])
    assert not isinstance(placed, str)
    assert len({g.gpu_uuid for g in placed.grants}) == 3


def test_scores_stretch_over_the_full_range() -> None:
    assert scale_scores({"a": 0.2, "b": 0.6, "c": 0.4}, ["a", "b", "c", "d"]) == {
        "a": 0, "b": MAX_SCORE, "c": 5, "d": 0}
    assert scale_scores({"a": 0.5, "b": 0.5}, ["a", "b"]) == {"a": MAX_SCORE, "b": MAX_SCORE}
    assert scale_scores({}, ["a"]) == {"a": 0}


def test_evaluations_are_reused_until_the_node_changes() -> None:
    ranker = Ranker(learn_workload=False)
    states = {"a": node("a"), "b": node("b")}
    pod = demand((1, 10))
    first = ranker.evaluate_all(states, pod, Policy.BINPACK)
    assert (ranker.hits, ranker.misses) == (0, 2)
    assert ranker.evaluate_all(states, pod, Policy.BINPACK) == first
    assert (ranker.hits, ranker.misses) == (2, 2)
    placed = first["a"].placement
    assert placed is not None
    states["a"] = states["a"].with_grants(placed.grants)  # something was bound on "a"
    ranker.evaluate_all(states, pod, Policy.BINPACK)
    assert (ranker.hits, ranker.misses) == (3, 3)
    ranker.evaluate_all(states, pod, Policy.SPREAD)  # another policy is another question
    assert ranker.misses == 5


def test_the_workload_is_learned_once_per_pod_and_rebuilt_only_on_drift() -> None:
    tracker = WorkloadTracker(window=100, first=3, refresh=5)
    one = [Demand(gpu_count=1, gpu_milli=500, gpu_memory_mib=10 * GIB)]
    assert not tracker.observe("a", one)
    assert not tracker.observe("a", one)  # the scheduler asks about a pod many times
    assert not tracker.observe("b", one)
    assert tracker.observe("c", one)
    workload = tracker.workload()
    assert [p for _, p in workload.shapes] == [1.0]
    assert not materially_different(workload, tracker.workload())
    assert materially_different(workload, TargetWorkload())
