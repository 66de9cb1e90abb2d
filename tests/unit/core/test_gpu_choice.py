"""The one GPU choice (`carpool.core.gpu_choice`): its fast path equals its definition, it
agrees with the filter's rules, and the operator's timeline gets the GPUs the extender pins."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.derived import DerivedState
from carpool.core.gpu_choice import (
    NoFit,
    choose_gpus,
    choose_gpus_plainly,
    grants_for,
)
from carpool.core.placement import NodeState, gpu_rejection, node_rejection
from carpool.core.queueing import extender_placer
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    MigInstance,
    NodeInventory,
)
from carpool.core.scoring import (
    BEST_FIT,
    CARPOOL,
    RequestScorer,
    Scorer,
    ScoringPolicy,
    doubtful_gpus,
    gpus_by_slot,
    profile_of,
    slot_fits,
)
from carpool.core.workload import Demand, TargetWorkload
from carpool.extender.ranking import Misfit, ShapePlacer
from carpool.extender.wire import ContainerDemand, PodDemand

GIB = 1024
MODELS = ("A100", "V100")
WORKLOAD = TargetWorkload(((Demand(cpu_milli=4_000, gpu_count=1, gpu_milli=300), 0.6),
                           (Demand(cpu_milli=12_000, gpu_count=2, gpu_milli=1000), 0.4)))
POLICIES = (CARPOOL, BEST_FIT, ScoringPolicy(temperature=1.0, locality=1.0))
MOSTLY = (True,) * 9 + (False,)
ISOLATIONS = (Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE, Isolation.MIG)


@st.composite
def cases(draw: st.DrawFn) -> tuple[NodeState, GpuRequest]:
    """A request and a node it mostly fits, where the scorer's view and the filter's rules
    can disagree: MIG instances, MPS ceilings, over-booked GPUs, a shared grant of no cores on
    an otherwise idle GPU, and CPU short of the pod's."""
    request = GpuRequest(
        count=draw(st.sampled_from([1, 1, 2, 3])),
        memory_mib=draw(st.integers(0, 30)) * GIB,
        cores_pct=draw(st.sampled_from([0, 10, 30, 50, 100])),
        isolation=draw(st.sampled_from(ISOLATIONS)),
        models=draw(st.sampled_from([frozenset(), frozenset(), frozenset({"A100"})])),
        mig_slices=draw(st.sampled_from([0, 1, 3])))
    gpus = []
    for i in range(draw(st.integers(1, 6))):
        mig = tuple(MigInstance(f"MIG-{i}-{k}", f"{s}g", s, s * 5 * GIB)
                    for k, s in enumerate(draw(st.lists(st.sampled_from([1, 2, 3, 7]),
                                                        max_size=3))))
        gpus.append(Gpu(i, f"g{i}", draw(st.sampled_from(MODELS)), 40 * GIB,
                        temperature_c=draw(st.sampled_from([30.0, 50.0, 70.0] * 3 + [88.0])),
                        healthy=draw(st.sampled_from(MOSTLY)),
                        cordoned=not draw(st.sampled_from(MOSTLY)), mig_instances=mig,
                        mps_ceiling_pct=draw(st.sampled_from([100, 50])),
                        exclusive_process=draw(st.sampled_from([False, False, True]))))
    others = draw(st.sets(st.sampled_from(ISOLATIONS)))
    inventory = NodeInventory(
        "n", tuple(gpus), cpu_milli=draw(st.sampled_from([0, 16_000, 64_000])),
        sharing=frozenset(others | {request.isolation} if draw(st.sampled_from(MOSTLY))
                          else others | {Isolation.MPS}),
        ready=draw(st.sampled_from(MOSTLY)))
    grants = []
    for gpu in gpus:
        for _ in range(draw(st.integers(0, 2))):
            kind = draw(st.sampled_from(["exclusive", "shared", "shared", "mig", "zero"]))
            if kind == "exclusive":
                grants.append(GpuGrant(gpu.uuid, 40 * GIB, 100, exclusive=True))
                break
            if kind == "mig" and gpu.mig_instances:
                instance = draw(st.sampled_from(gpu.mig_instances))
                grants.append(GpuGrant(gpu.uuid, instance.memory_mib, 0,
                                       mig_instance=instance.uuid))
            elif kind == "zero":  # no cores: the scorer sees 999 of 1000 idle
                grants.append(GpuGrant(gpu.uuid, draw(st.integers(0, 4)) * GIB, 0))
            else:  # up to 70 % twice: over-booking happens
                grants.append(GpuGrant(gpu.uuid, draw(st.integers(1, 30)) * GIB,
                                       draw(st.integers(0, 70))))
    node = NodeState(inventory, tuple(grants), cpu_used_milli=draw(st.integers(0, 16_000)))
    return node, request


def scorer_for(request: GpuRequest, policy: ScoringPolicy, cpu_milli: int) -> RequestScorer:
    return RequestScorer(request, Scorer(policy, WORKLOAD, {"A100": 8, "V100": 8}),
                         cpu_milli=cpu_milli)


@settings(max_examples=500, deadline=None)
@given(cases(), st.sampled_from(POLICIES), st.integers(0, 32_000))
def test_the_fast_path_is_the_plain_definition(case: tuple[NodeState, GpuRequest],
                                               policy: ScoringPolicy, cpu_milli: int) -> None:
    node, request = case
    fast = choose_gpus(DerivedState.of(node), scorer_for(request, policy, cpu_milli))
    plain = choose_gpus_plainly(DerivedState.of(node), scorer_for(request, policy, cpu_milli))
    assert fast == plain  # the score too, exactly: ties between nodes are decided on it
    assert type(fast) is type(plain)  # NoFit or a plain (score, indices)


@settings(max_examples=300, deadline=None)
@given(cases(), st.data())
def test_a_state_made_from_another_derives_what_it_would_alone(
        case: tuple[NodeState, GpuRequest], data: st.DataObject) -> None:
    """`DerivedState.with_grants` works out its free GPUs from the state it was made from,
    where that one has them (`placement.free_after`): over several steps, with lent and
    borrowed grants and grants of no GPU of the node, everything it derives is what the
    same state worked out afresh derives."""
    node, _ = case
    kinds = st.sampled_from(["own", "own", "own", "lent", "borrowed", "elsewhere"])
    grants = []
    for grant in node.grants:
        kind = data.draw(kinds)
        grants.append(grant if kind == "own" else dataclasses.replace(grant, lent=True)
                      if kind == "lent" else dataclasses.replace(grant, borrowed=True)
                      if kind == "borrowed" else dataclasses.replace(grant, gpu_uuid="other"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(grants)), min_size=1, max_size=4)))
    state = DerivedState(node.inventory, tuple(grants[:cuts[0]]), node.cpu_used_milli)
    for start, end in zip(cuts, [*cuts[1:], len(grants)], strict=True):
        if data.draw(st.booleans()):
            assert state.frees == tuple(NodeState.free(state))  # the step's start derived
        state = state.with_grants(grants[start:end])
    plain = NodeState(node.inventory, tuple(grants), node.cpu_used_milli)
    assert type(state) is DerivedState and NodeState(
        state.inventory, state.grants, state.cpu_used_milli, state.memory_used_mib) == plain
    assert list(state.frees) == plain.free()
    assert state.profile == profile_of(plain)
    for exclusive in (False, True):
        assert state.gpus_by_slot(exclusive) == gpus_by_slot(plain, exclusive)
    for isolation in ISOLATIONS:
        assert state.doubtful_gpus(isolation) == doubtful_gpus(plain, isolation)


@settings(max_examples=500, deadline=None)
@given(cases(), st.integers(0, 32_000))
def test_a_fitting_slot_is_an_accepted_gpu_but_on_doubtful_gpus(
        case: tuple[NodeState, GpuRequest], cpu_milli: int) -> None:
    """What lets the fast path check only `doubtful_gpus`: a GPU the scorer may plan on (its
    slot fits the demand) is one the fit rules accept, unless it is doubtful."""
    node, request = case
    demand = Demand.from_request(request, cpu_milli=cpu_milli)
    frees = {f.gpu.index: f for f in node.free()}
    doubtful = doubtful_gpus(node, request.isolation)
    assert DerivedState.of(node).doubtful_gpus(request.isolation) == doubtful
    for slot, gpus in gpus_by_slot(node, request.isolation is Isolation.EXCLUSIVE).items():
        for gpu in gpus:
            if slot_fits(slot, demand) and gpu.gpu_index not in doubtful:
                assert gpu_rejection(frees[gpu.gpu_index], request) is None


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from(POLICIES), st.integers(0, 32_000))
def test_the_choice_obeys_the_filter(case: tuple[NodeState, GpuRequest], policy: ScoringPolicy,
                                     cpu_milli: int) -> None:
    """A choice exactly where the filter lets the node fit, of distinct accepted GPUs."""
    node, request = case
    state = DerivedState.of(node)
    choice = choose_gpus(state, scorer_for(request, policy, cpu_milli))
    reason = node_rejection(node, request)
    if reason is not None:
        assert isinstance(choice, NoFit) and choice.reason == reason
        return
    assert not isinstance(choice, NoFit)
    score, indices = choice
    assert 0.0 <= score <= 1.0
    assert len(indices) == len(set(indices)) == request.count
    frees = {f.gpu.index: f for f in node.free()}
    assert all(gpu_rejection(frees[i], request) is None for i in indices)
    grants = grants_for(state, request, indices)
    mig = [g.mig_instance for g in grants if g.mig_instance]
    assert len(mig) == len(set(mig)) == (request.count if request.isolation is Isolation.MIG
                                         else 0)


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from(POLICIES))
def test_the_operator_reserves_the_gpus_the_extender_pins(case: tuple[NodeState, GpuRequest],
                                                          policy: ScoringPolicy) -> None:
    node, request = case
    scorer = Scorer(policy, WORKLOAD, {"A100": 8})
    placed = ShapePlacer(PodDemand("ns", "p", "u", (ContainerDemand("main", request),)),
                         scorer).place(node)
    reserved = extender_placer(scorer)(DerivedState.of(node), request)
    if isinstance(placed, Misfit):
        assert reserved is None
    else:
        assert reserved == (placed.score, placed.grants)


def test_among_equals_the_tightest_gpu_wins() -> None:
    """With no workload to tell GPUs apart, the least idle compute, then the least free
    memory, takes the request."""
    inventory = NodeInventory("n", (Gpu(0, "GPU-0", "A100", 40 * GIB),
                                    Gpu(1, "GPU-1", "A100", 40 * GIB)))
    state = DerivedState(inventory, (GpuGrant("GPU-1", 30 * GIB, 20),))
    request = GpuRequest(count=1, memory_mib=8 * GIB, cores_pct=10)
    choice = choose_gpus(state, RequestScorer(request, Scorer()))
    assert not isinstance(choice, NoFit) and choice[1] == (1,)
    assert grants_for(state, request, choice[1]) == (GpuGrant("GPU-1", 8 * GIB, 10),)
    too_big = choose_gpus(state, RequestScorer(GpuRequest(1, 50 * GIB), Scorer()))
    assert isinstance(too_big, NoFit) and too_big.reason == (
        "0 of 1 GPUs fit; GPU 0 has 40 GiB free, job needs 50 GiB; "
        "GPU 1 has 10 GiB free, job needs 50 GiB")


def test_a_gpu_the_filter_refuses_is_not_chosen_though_the_scorer_prefers_it() -> None:
    """The scorer does not see MPS ceilings: on a node where the tighter GPU is fenced below
    the request, the choice is the other GPU, at the score of that plan."""
    fenced = Gpu(0, "GPU-0", "A100", 40 * GIB, mps_ceiling_pct=50)
    inventory = NodeInventory("n", (fenced, Gpu(1, "GPU-1", "A100", 40 * GIB)))
    state = DerivedState(inventory, (GpuGrant("GPU-0", 2 * GIB, 10),))
    request = GpuRequest(count=1, memory_mib=24 * GIB, cores_pct=40)
    scorer = RequestScorer(request, Scorer())
    plan = scorer.scorer.plan(state.profile, scorer.demand)
    assert plan is not None and plan.slots[0].idle_milli == 900  # the scorer's pick: GPU-0
    assert state.doubtful_gpus(Isolation.MPS) == {0}
    choice = choose_gpus(state, scorer)
    assert not isinstance(choice, NoFit) and choice[1] == (1,) and choice[0] > 0


def test_a_node_short_of_the_pods_cpu_stays_usable_ranked_last() -> None:
    inventory = NodeInventory("n", (Gpu(0, "GPU-0", "A100", 40 * GIB),), cpu_milli=8_000)
    state = DerivedState(inventory, cpu_used_milli=6_000)
    request = GpuRequest(1, 8 * GIB)
    assert choose_gpus(state, RequestScorer(request, Scorer(), cpu_milli=4_000)) == (0.0, (0,))
    roomy = choose_gpus(dataclasses.replace(state, cpu_used_milli=0),
                        RequestScorer(request, Scorer(), cpu_milli=4_000))
    assert not isinstance(roomy, NoFit) and roomy[0] > 0


def test_a_gpu_partitioned_into_mig_instances_takes_only_mig_jobs() -> None:
    mig = (MigInstance("MIG-0-0", "3g.40gb", 3, 40 * GIB),)
    inventory = NodeInventory("n", (Gpu(0, "g0", "A100", 80 * GIB, mig_instances=mig),
                                    Gpu(1, "g1", "A100", 80 * GIB)),
                              sharing=frozenset(Isolation))
    node = NodeState(inventory, ())
    for isolation in (Isolation.EXCLUSIVE, Isolation.MPS, Isolation.TIMESLICE):
        request = GpuRequest(count=1, memory_mib=10 * GIB, cores_pct=30, isolation=isolation)
        (free_mig, whole) = node.free()
        assert gpu_rejection(free_mig, request) == (
            f"GPU 0 is partitioned into MIG instances, job wants {isolation.value}")
        assert gpu_rejection(whole, request) is None
        assert node_rejection(dataclasses.replace(node), dataclasses.replace(
            request, count=2)) is not None
        chosen = choose_gpus(DerivedState.of(node), scorer_for(request, CARPOOL, 0))
        assert not isinstance(chosen, NoFit)
        _, indices = chosen
        assert [g.gpu_uuid for g in grants_for(DerivedState.of(node), request,
                                               indices)] == ["g1"]
    request = GpuRequest(count=1, memory_mib=10 * GIB, isolation=Isolation.MIG, mig_slices=1)
    assert gpu_rejection(node.free()[0], request) is None
