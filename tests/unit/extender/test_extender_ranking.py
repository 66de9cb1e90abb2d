"""The extender's seam to the placement core: placement per container, score scaling, memo."""

from __future__ import annotations

from carpool.core.placement import NodeState
from carpool.core.resources import Gpu, GpuRequest, NodeInventory
from carpool.core.workload import Demand, TargetWorkload
from carpool.extender.ranking import (
    MAX_SCORE,
    WORKLOAD_FIRST,
    Misfit,
    Placement,
    Ranker,
    WorkloadTracker,
    materially_different,
    place,
    scale_scores,
    supply_differs,
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
    assert isinstance(placed, Placement)
    assert [g.gpu_uuid for g in placed.grants] == sorted({g.gpu_uuid for g in placed.grants})
    assert len(placed.per_container) == 2 and 0 <= placed.score <= 1


def test_a_pod_that_does_not_fit_gets_the_placement_cores_reason() -> None:
    reason = Ranker().place(node(gpus=1), demand((2, 10)), Policy.BINPACK)
    assert isinstance(reason, Misfit) and reason.reason.startswith("1 of 2 GPUs fit")


def test_multi_gpu_requests_still_get_distinct_gpus() -> None:
    placed = place(node(gpus=4), demand((3, 10)), Ranker()._scorers[Policy.BINPACK])
    assert isinstance(placed, Placement)
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


class Source:
    """The warmer's view of the nodes (the cache, in the extender)."""

    def __init__(self, states: dict[str, NodeState]) -> None:
        self.states = states
        self.changed: set[str] = set()

    def node_names(self) -> list[str]:
        return sorted(self.states)

    def state_of(self, name: str) -> NodeState | None:
        return self.states.get(name)

    def drain_changed(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed


def warm_all(ranker: Ranker, source: Source) -> None:
    for _ in range(100):
        if not ranker.warm(source, deadline=float("inf")):
            return
    raise AssertionError("the warmer never finished")


def test_the_warmer_re_evaluates_recent_shapes_on_nodes_that_changed() -> None:
    ranker = Ranker(learn_workload=False)
    ranker.background_warming = True
    source = Source({"a": node("a"), "b": node("b")})
    small, large = demand((1, 10)), demand((1, 30))
    for pod in (small, large):
        ranker.evaluate_all(source.states, pod, Policy.BINPACK)
    placed = ranker.evaluate(source.states["a"], small, Policy.BINPACK).placement
    assert placed is not None
    source.states["a"] = source.states["a"].with_grants(placed.grants)
    source.changed.add("a")
    warm_all(ranker, source)
    assert ranker.warmed == 2  # both shapes on the changed node, nothing else
    misses = ranker.misses
    for pod in (small, large):
        ranker.evaluate_all(source.states, pod, Policy.BINPACK)
    assert ranker.misses == misses


def test_a_new_workload_takes_over_only_once_the_warmer_has_evaluated_it() -> None:
    ranker = Ranker(learn_workload=True)
    ranker.background_warming = True
    source = Source({"a": node("a"), "b": node("b", gpus=4)})
    first = ranker._scorers
    pods = [demand((1, 10), uid=f"u{i}") for i in range(WORKLOAD_FIRST)]
    for pod in pods:
        ranker.observe(pod)
        ranker.evaluate_all(source.states, pod, Policy.BINPACK)
    assert ranker.workload_rebuilds == 1
    assert ranker._scorers is first and not ranker.workload.shapes  # still the old one
    warm_all(ranker, source)
    assert ranker._scorers is not first and ranker.workload.shapes
    misses = ranker.misses
    ranker.evaluate_all(source.states, pods[0], Policy.BINPACK)
    assert ranker.misses == misses  # the new scorers' evaluations were made by the warmer


def test_without_a_warmer_a_new_workload_takes_over_at_once() -> None:
    ranker = Ranker(learn_workload=True)
    first = ranker._scorers
    for i in range(WORKLOAD_FIRST):
        ranker.observe(demand((1, 10), uid=f"u{i}"))
    assert ranker._scorers is not first and ranker.workload.shapes


def test_gpu_supply_rebuilds_the_scorers_only_when_it_moves_materially() -> None:
    assert supply_differs({}, {"A100": 8})
    assert supply_differs({"A100": 8}, {"A100": 8, "T4": 1})  # a new model
    assert not supply_differs({"A100": 1000}, {"A100": 1008})
    assert supply_differs({"A100": 1000}, {"A100": 800})
    ranker = Ranker(learn_workload=False)
    first = ranker._scorers
    ranker.set_supply({"A100": 1000})
    second = ranker._scorers
    assert second is not first
    ranker.set_supply({"A100": 1008})
    assert ranker._scorers is second


def test_placements_build_their_grants_on_the_gpus_the_scorer_chose() -> None:
    state = node(gpus=4)
    hot = NodeState(NodeInventory("n", tuple(
        Gpu(i, f"n-g{i}", "A100", 40 * GIB, temperature_c=70.0 - 10 * i) for i in range(4))))
    for st in (state, hot):
        placed = place(st, demand((2, 10)), Ranker()._scorers[Policy.BINPACK])
        assert isinstance(placed, Placement)
        assert len(placed.grants) == 2 and all(g.memory_mib == 10 * GIB for g in placed.grants)
    assert [g.gpu_uuid for g in placed.grants] == ["n-g3", "n-g2"]  # the coolest first
