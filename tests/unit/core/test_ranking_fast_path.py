"""The extender's per-node hot path agrees with the general code it shortens.

`RequestScorer.score` is the weighted mean of the score terms with the per-request work
hoisted, and `ShapePlacer.evaluate` writes `ShapePlacer.place` out for one container: both
run on every node for every new demand shape, so they are checked here against the general
definitions on random nodes, requests and policies.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.placement import NodeState, node_rejection
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, Isolation, NodeInventory
from carpool.core.scoring import (
    BEST_FIT,
    CARPOOL,
    Dataset,
    RequestScorer,
    Scorer,
    ScoringPolicy,
    combine,
    gpus_by_slot,
    locality_term,
    profile_of,
    temperature_term,
    zone_hops,
)
from carpool.core.workload import Demand, TargetWorkload
from carpool.extender.ranking import Evaluation, Misfit, ShapePlacer
from carpool.extender.states import CachedState
from carpool.extender.wire import ContainerDemand, PodDemand

GIB = 1024
MODELS = ("A100", "V100")
WORKLOAD = TargetWorkload(((Demand(cpu_milli=4_000, gpu_count=1, gpu_milli=300), 0.6),
                           (Demand(cpu_milli=12_000, gpu_count=2, gpu_milli=1000), 0.4)))
MOSTLY = (True, True, True, False)
POLICIES = (CARPOOL, BEST_FIT, ScoringPolicy(temperature=1.0, locality=1.0))


@st.composite
def nodes(draw: st.DrawFn) -> NodeState:
    count = draw(st.integers(1, 8))
    gpus = tuple(
        Gpu(i, f"g{i}", draw(st.sampled_from(MODELS)), 40 * GIB,
            temperature_c=draw(st.floats(20, 95)), healthy=draw(st.sampled_from(MOSTLY)),
            cordoned=not draw(st.sampled_from(MOSTLY)))
        for i in range(count))
    inventory = NodeInventory(
        "n", gpus, cpu_milli=draw(st.sampled_from([0, 32_000, 64_000])),
        zone=draw(st.sampled_from(["", "eu-a", "eu-b", "us-a"])),
        datasets=frozenset(draw(st.sets(st.sampled_from(["imagenet", "laion"])))),
        sharing=frozenset(draw(st.sets(st.sampled_from(
            [Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE]), min_size=1))),
        ready=draw(st.sampled_from(MOSTLY)))
    grants = []
    for gpu in gpus:
        for _ in range(draw(st.integers(0, 2))):
            if draw(st.booleans()):
                grants.append(GpuGrant(gpu.uuid, 40 * GIB, 100, exclusive=True))
                break
            # At most two shared grants of <= 50 % each: placement never over-books a GPU's
            # SMs, and on an over-booked GPU the filter and the scorer need not agree.
            grants.append(GpuGrant(gpu.uuid, draw(st.integers(1, 20)) * GIB,
                                   draw(st.integers(0, 50))))
    return NodeState(inventory, tuple(grants), cpu_used_milli=draw(st.integers(0, 40_000)))


requests = st.builds(
    GpuRequest,
    count=st.integers(1, 4),
    memory_mib=st.integers(0, 40).map(lambda g: g * GIB),
    cores_pct=st.integers(0, 100),
    isolation=st.sampled_from([Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE]),
    models=st.sets(st.sampled_from(MODELS), max_size=1).map(frozenset))
datasets = st.none() | st.builds(Dataset, st.sampled_from(["imagenet", "laion"]),
                                 st.floats(0, 500), st.sets(st.sampled_from(["eu-a", "us-a"]))
                                 .map(frozenset))


def reference_score(node: NodeState, request: GpuRequest, scorer: Scorer, cpu_milli: int,
                    dataset: Dataset | None) -> float | None:
    """The score's definition: combine(profile terms, chosen GPUs' temperature, locality)."""
    plan = scorer.plan(profile_of(node), Demand.from_request(request, cpu_milli=cpu_milli))
    if plan is None:
        return None
    scored = RequestScorer(request, scorer, cpu_milli=cpu_milli, dataset=dataset).score(node)
    assert scored is not None
    gpus = {g.index: g for g in node.inventory.gpus}
    temperature = (sum(temperature_term(gpus[i].temperature_c, gpus[i].slowdown_temp_c)
                       for i in scored[1]) / len(scored[1]))
    locality = 1.0 if dataset is None else locality_term(
        dataset.name in node.inventory.datasets, dataset.size_gib,
        zone_hops(node.inventory.zone, dataset.zones))
    policy = scorer.policy
    return combine([(policy.profile_weight, plan.score), (policy.temperature, temperature),
                    (policy.locality, locality)])


@settings(max_examples=300, deadline=None)
@given(nodes(), requests, st.sampled_from(POLICIES), st.integers(0, 32_000), datasets)
def test_request_scorer_is_score_nodes_weighted_mean(node: NodeState, request: GpuRequest,
                                                     policy: ScoringPolicy, cpu_milli: int,
                                                     dataset: Dataset | None) -> None:
    scorer = Scorer(policy, WORKLOAD, {"A100": 8, "V100": 8})
    expected = reference_score(node, request, scorer, cpu_milli, dataset)
    scored = RequestScorer(request, scorer, cpu_milli=cpu_milli, dataset=dataset).score(node)
    if expected is None:
        assert scored is None
        return
    assert scored is not None
    assert scored[0] == expected  # exactly: ties between nodes are decided on equal floats
    assert len(scored[1]) == len(set(scored[1])) == request.count


@settings(max_examples=300, deadline=None)
@given(nodes(), requests, st.sampled_from(POLICIES), st.integers(0, 32_000), datasets)
def test_one_container_evaluation_is_the_general_placement(
        node: NodeState, request: GpuRequest, policy: ScoringPolicy, cpu_milli: int,
        dataset: Dataset | None) -> None:
    demand = PodDemand("ns", "p", "u", (ContainerDemand("main", request),), cpu_milli=cpu_milli,
                       dataset=dataset.name if dataset else "",
                       dataset_size_gib=dataset.size_gib if dataset else 0.0)
    placer = ShapePlacer(demand, Scorer(policy, WORKLOAD, {"A100": 8}))
    general = placer.place(node)
    evaluation = placer.evaluate(node)
    assert evaluation.state is node
    if isinstance(general, Misfit):
        assert evaluation == Evaluation(node, None, reason=general.reason, requests=(request,))
    else:
        assert evaluation == Evaluation(node, general.score, placement=general)
        assert evaluation.score == general.score
        assert evaluation.placement is not None
        assert evaluation.placement.grants == general.grants


@settings(max_examples=150)
@given(nodes(), requests)
def test_a_cached_state_derives_what_the_core_computes(node: NodeState,
                                                       request: GpuRequest) -> None:
    """The extender keeps per node state what the core recomputes on every call."""
    cached = CachedState.of(node)
    assert cached == CachedState(node.inventory, node.grants, node.cpu_used_milli,
                                 node.memory_used_mib) and CachedState.of(cached) is cached
    assert type(cached.with_grants(())) is CachedState  # what-if states keep their answers too
    for _ in range(2):  # computed once, then kept: the same answers
        assert cached.free() == node.free()
        assert cached.frees_by_index == {f.gpu.index: f for f in node.free()}
        assert cached.profile == profile_of(node)
        for exclusive in (False, True):
            assert cached.gpus_by_slot(exclusive) == gpus_by_slot(node, exclusive)
        assert cached.fits_empty(request) == (
            node_rejection(NodeState(node.inventory), request) is None)
        assert node_rejection(cached, request) == node_rejection(node, request)


@settings(max_examples=150)
@given(nodes(), requests, st.sampled_from(POLICIES), st.integers(0, 32_000))
def test_placing_on_a_cached_state_is_placing_on_the_plain_one(
        node: NodeState, request: GpuRequest, policy: ScoringPolicy, cpu_milli: int) -> None:
    demand = PodDemand("ns", "p", "u", (ContainerDemand("a", request),
                                        ContainerDemand("b", request)), cpu_milli=cpu_milli)
    single = PodDemand("ns", "p", "u", (ContainerDemand("a", request),), cpu_milli=cpu_milli)
    scorer = Scorer(policy, WORKLOAD, {"A100": 8})
    for pod in (demand, single):
        plain = ShapePlacer(pod, scorer).evaluate(node)
        cached = ShapePlacer(pod, scorer).evaluate(CachedState.of(node))
        assert (plain.score, plain.reason, plain.placement, plain.resolvable) == (
            cached.score, cached.reason, cached.placement, cached.resolvable)
