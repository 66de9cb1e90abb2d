"""Score terms: bounds, monotonicity, and FGD's fragmentation on hand-computed nodes."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from carpool.core.placement import NodeState, node_rejection
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, Isolation, NodeInventory
from carpool.core.scoring import (
    BEST_FIT,
    CARPOOL,
    FGD,
    Dataset,
    GpuSlot,
    NodeProfile,
    RequestScorer,
    Scorer,
    ScoringPolicy,
    Strategy,
    alignment_term,
    balance_term,
    combine,
    fits,
    fragmentation,
    fragmentation_term,
    locality_term,
    model_pressure,
    packing_term,
    profile_of,
    scarcity_term,
    stranded_gpu,
    temperature_term,
    zone_hops,
)
from carpool.core.workload import Demand, TargetWorkload


def profile(*idle: int, cpu: int = 64_000, memory: int = 1 << 20, model: str = "A100",
            cpu_total: int = 64_000) -> NodeProfile:
    return NodeProfile(cpu, memory, cpu_total,
                       tuple(sorted(GpuSlot(model, i, 0) for i in idle)))


SHARED_300 = Demand(cpu_milli=4_000, gpu_count=1, gpu_milli=300)
WHOLE_12C = Demand(cpu_milli=12_000, gpu_count=1, gpu_milli=1000)
HALVES = TargetWorkload(((SHARED_300, 0.5), (WHOLE_12C, 0.5)))


# --- fragmentation (FGD's definition) -------------------------------------------------------


def test_fragmentation_hand_computed() -> None:
    # idle 1000, 500, 200; 10 cores free.
    # shared-300 fits: only the 200 GPU is unusable to it -> 200.
    # whole-GPU needs 12 cores > 10 free -> cannot fit -> all idle, 1700.
    node = profile(1000, 500, 200, cpu=10_000)
    assert fragmentation(node, HALVES) == pytest.approx(0.5 * 200 + 0.5 * 1700)


def test_fragmentation_with_enough_cpu_counts_only_unusable_gpus() -> None:
    # whole-GPU now fits: GPUs with idle < 1000 (500 and 200) are fragments for it -> 700.
    node = profile(1000, 500, 200, cpu=20_000)
    assert fragmentation(node, HALVES) == pytest.approx(0.5 * 200 + 0.5 * 700)


def test_fragmentation_model_and_multi_gpu_shapes() -> None:
    two_whole = Demand(gpu_count=2, gpu_milli=1000)
    t4_only = Demand(gpu_count=1, gpu_milli=100, models=frozenset({"T4"}))
    workload = TargetWorkload(((two_whole, 0.25), (t4_only, 0.75)))
    node = profile(1000, 400)  # only one whole GPU; an A100, not a T4
    assert fragmentation(node, workload) == pytest.approx(1400)
    node = profile(1000, 1000, 400)  # two whole GPUs now: only the 400 one is a fragment
    assert fragmentation(node, workload) == pytest.approx(0.25 * 400 + 0.75 * 2400)


def test_fragmentation_counts_host_memory_when_shapes_ask_for_it() -> None:
    needs_memory = Demand(cpu_milli=1000, memory_mib=4096, gpu_count=1, gpu_milli=300)
    workload = TargetWorkload(((needs_memory, 0.5), (SHARED_300, 0.5)))
    assert fragmentation(profile(1000, 200, memory=2048), workload) == pytest.approx(
        0.5 * 1200 + 0.5 * 200)
    assert fragmentation(profile(1000, 200, memory=8192), workload) == pytest.approx(200)


def test_fragmentation_zero_without_idle_or_workload() -> None:
    assert fragmentation(profile(0, 0), HALVES) == 0
    assert fragmentation(profile(1000, 300), TargetWorkload()) == 0


def test_fragmentation_equal_states_compare_equal() -> None:
    """Exact arithmetic: the same fragmentation reached two ways is the same float."""
    node = profile(1000, 530, 470, cpu=30_000)
    other = NodeProfile(30_000, 1 << 20, 64_000, tuple(sorted((GpuSlot("A100", 470, 0),
                                                                GpuSlot("A100", 1000, 0),
                                                                GpuSlot("A100", 530, 0)))))
    assert fragmentation(node, HALVES) - fragmentation(other, HALVES) == 0.0


# --- bounds and monotonicity ----------------------------------------------------------------

deltas = st.floats(min_value=-1e7, max_value=1e7, allow_nan=False)


@given(deltas, deltas)
def test_fragmentation_and_balance_terms_bounded_and_decreasing(a: float, b: float) -> None:
    for term in (fragmentation_term, balance_term):
        assert 0.0 <= term(a) <= 1.0
        low, high = sorted((a, b))
        assert term(low) >= term(high)
    assert fragmentation_term(0) == 0.5


@given(st.floats(min_value=-50, max_value=150), st.floats(min_value=-50, max_value=150),
       st.floats(min_value=31, max_value=120))
def test_temperature_term_prefers_cooler(t1: float, t2: float, slowdown: float) -> None:
    cool, hot = sorted((t1, t2))
    assert 0.0 <= temperature_term(hot, slowdown) <= temperature_term(cool, slowdown) <= 1.0
    assert temperature_term(slowdown, slowdown) == 0.0
    assert temperature_term(20, slowdown) == 1.0


@given(st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e6),
       st.integers(min_value=0, max_value=3))
def test_locality_term_cached_best_then_cheaper_fetch(size: float, bigger: float,
                                                     hops: int) -> None:
    small, large = sorted((size, bigger))
    assert locality_term(True, large, 3) == 1.0
    assert 0.0 < locality_term(False, large, hops) <= locality_term(False, small, hops) <= 1.0
    assert locality_term(False, large, min(hops + 1, 3)) <= locality_term(False, large, hops)


def test_zone_hops() -> None:
    assert zone_hops("eu-west-1a", ["eu-west-1a"]) == 1
    assert zone_hops("eu-west-a", ["eu-west-b"]) == 2
    assert zone_hops("eu-west-a", ["us-east-b"]) == 3
    assert zone_hops("", ["us-east-b"]) == 3


slot_idle = st.lists(st.integers(min_value=0, max_value=1000), min_size=0, max_size=8)


@given(slot_idle, st.integers(min_value=0, max_value=256_000), slot_idle)
def test_packing_and_alignment_bounded(idle: list[int], cpu: int, more: list[int]) -> None:
    node = profile(*idle, cpu=cpu, cpu_total=256_000)
    assert 0.0 <= packing_term(node, 128_000, 8000) <= 1.0
    assert 0.0 <= alignment_term(node, WHOLE_12C) <= 1.0
    emptier = profile(*idle, *more, cpu=cpu, cpu_total=256_000)
    assert packing_term(emptier, 128_000, 8000) <= packing_term(node, 128_000, 8000)


@given(slot_idle, st.integers(min_value=0, max_value=128_000), st.integers(0, 64_000))
def test_stranded_gpu_grows_as_cpu_shrinks(idle: list[int], cpu: int, used: int) -> None:
    rho = 12.0  # 12 cores per GPU
    roomy = profile(*idle, cpu=cpu)
    tight = profile(*idle, cpu=max(0, cpu - used))
    assert 0.0 <= stranded_gpu(roomy, rho) <= stranded_gpu(tight, rho) <= sum(idle)


def test_stranded_gpu_hand_computed() -> None:
    # 3 idle GPUs, 24 cores free, 12 cores per GPU expected -> one GPU cannot be fed.
    assert stranded_gpu(profile(1000, 1000, 1000, cpu=24_000), 12.0) == pytest.approx(1000)
    assert stranded_gpu(profile(1000, cpu=24_000, cpu_total=0), 12.0) == 0.0


def test_model_pressure_and_scarcity() -> None:
    t4_only = Demand(gpu_count=1, gpu_milli=1000, models=frozenset({"T4"}))
    either = Demand(gpu_count=1, gpu_milli=1000, models=frozenset({"T4", "V100"}))
    anywhere = Demand(gpu_count=1, gpu_milli=1000)
    workload = TargetWorkload(((t4_only, 0.2), (either, 0.2), (anywhere, 0.6)))
    pressure = model_pressure(workload, {"T4": 10, "V100": 30, "A100": 60})
    # T4: 0.2*1000/10 + 0.2*1000/40 = 25; V100: 0.2*1000/40 = 5; normalised by 25.
    assert pressure == pytest.approx({"T4": 1.0, "V100": 0.2})
    assert scarcity_term(["A100"], pressure) == 1.0
    assert scarcity_term(["T4"], pressure) == 0.0
    assert scarcity_term(["V100", "T4"], pressure) == pytest.approx(0.4)
    assert scarcity_term([], pressure) == 1.0


@given(st.lists(st.tuples(st.one_of(st.just(0.0), st.floats(1e-6, 100)), st.floats(0, 1)),
                max_size=6))
def test_combine_is_a_weighted_mean(pairs: list[tuple[float, float]]) -> None:
    value = combine(pairs)
    terms = [t for w, t in pairs if w > 0]
    if terms:
        assert min(terms) - 1e-9 <= value <= max(terms) + 1e-9
    else:
        assert value == 0.0


def test_policy_rejects_bad_weights() -> None:
    with pytest.raises(ValueError):
        ScoringPolicy(fragmentation=-1)
    with pytest.raises(ValueError):
        ScoringPolicy(fragmentation=0, balance=0, scarcity=0, temperature=0, locality=0)
    with pytest.raises(ValueError):
        ScoringPolicy(fragmentation=math.nan)
    assert Strategy.parse("Spread") is Strategy.SPREAD
    with pytest.raises(ValueError, match="binpack or spread"):
        Strategy.parse("pack")


# --- plans: GPU choice inside a node by the same objective -----------------------------------


def test_fgd_plan_keeps_whole_gpu_free() -> None:
    """A 300-milli pod goes on the 400 GPU, not the idle one a whole-GPU pod needs."""
    workload = TargetWorkload(((Demand(gpu_count=1, gpu_milli=1000), 1.0),))
    plan = Scorer(FGD, workload).plan(profile(1000, 400), Demand(gpu_count=1, gpu_milli=300))
    assert plan is not None
    assert plan.slots == (GpuSlot("A100", 400, 0),)
    assert plan.fragmentation_delta == pytest.approx(100 - 400)  # the fragment shrinks
    assert plan.after == profile(1000, 100)


def test_best_fit_takes_tightest_gpu_and_fuller_node() -> None:
    scorer = Scorer(BEST_FIT)
    demand = Demand(cpu_milli=1000, gpu_count=1, gpu_milli=200)
    plan = scorer.plan(profile(1000, 700, 300), demand)
    assert plan is not None and plan.slots == (GpuSlot("A100", 300, 0),)
    fuller = scorer.plan(profile(300, cpu=8_000), demand)
    emptier = scorer.plan(profile(1000, 1000, cpu=60_000), demand)
    assert fuller is not None and emptier is not None and fuller.score > emptier.score
    spread = Scorer(ScoringPolicy(fragmentation=0, balance=0, packing=1, temperature=0,
                                  locality=0, strategy=Strategy.SPREAD))
    fuller = spread.plan(profile(300, cpu=8_000), demand)
    emptier = spread.plan(profile(1000, 1000, cpu=60_000), demand)
    assert fuller is not None and emptier is not None and fuller.score < emptier.score


def test_plan_none_when_it_cannot_fit() -> None:
    scorer = Scorer(CARPOOL, HALVES)
    assert scorer.plan(profile(1000, cpu=1000), WHOLE_12C) is None  # CPU
    assert scorer.plan(profile(900), WHOLE_12C) is None  # no whole GPU
    assert scorer.plan(profile(1000), Demand(gpu_count=1, gpu_milli=1,
                                            models=frozenset({"T4"}))) is None
    assert scorer.plan(profile(1000, 1000), Demand(gpu_count=3, gpu_milli=1000)) is None


def test_balance_sends_cpu_heavy_pods_where_cpu_is_plentiful() -> None:
    workload = TargetWorkload(((WHOLE_12C, 1.0),))  # 12 cores per GPU
    scorer = Scorer(ScoringPolicy(temperature=0, locality=0), workload)
    cpu_only = Demand(cpu_milli=16_000)
    tight = scorer.plan(profile(1000, 1000, cpu=30_000), cpu_only)  # 24 cores needed, 30 free
    roomy = scorer.plan(profile(1000, 1000, cpu=100_000, cpu_total=104_000), cpu_only)
    assert tight is not None and roomy is not None and roomy.score > tight.score


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8),
       st.integers(1, 4), st.integers(0, 1000), st.integers(0, 64_000))
def test_plan_scores_bounded_and_after_consistent(idle: list[int], count: int, milli: int,
                                                  cpu: int) -> None:
    demand = Demand(cpu_milli=cpu, gpu_count=count, gpu_milli=milli)
    node = profile(*idle)
    plan = Scorer(CARPOOL, HALVES).plan(node, demand)
    assert (plan is not None) == fits(node, demand)
    if plan is not None:
        assert 0.0 <= plan.score <= 1.0
        assert len(plan.slots) == count
        assert plan.after.idle_milli == node.idle_milli - count * milli
        assert plan.after.cpu_free_milli == node.cpu_free_milli - cpu


# --- the extender's entry point on NodeState ------------------------------------------------


def gpu(index: int, temperature: float = 40.0, model: str = "A100") -> Gpu:
    return Gpu(index, f"GPU-{index}", model, 81_920, temperature_c=temperature)


def node_state(name: str, *gpus: Gpu, grants: tuple[GpuGrant, ...] = (),
               datasets: frozenset[str] = frozenset(), zone: str = "") -> NodeState:
    return NodeState(NodeInventory(name, gpus, cpu_milli=64_000, memory_mib=256_000,
                                   zone=zone, datasets=datasets), grants)


def score_node(node: NodeState, request: GpuRequest, dataset: Dataset | None = None
               ) -> tuple[float, tuple[int, ...]] | None:
    """The node's score and GPU indices under the default scorer."""
    return RequestScorer(request, Scorer(), dataset=dataset).score(node)


def test_score_node_prefers_cooler_node_and_cooler_gpu() -> None:
    request = GpuRequest(count=1, memory_mib=8192, cores_pct=25)
    cool = score_node(node_state("a", gpu(0, 70), gpu(1, 35)), request)
    hot = score_node(node_state("b", gpu(0, 70), gpu(1, 75)), request)
    assert cool is not None and hot is not None
    assert cool[1] == (1,)
    assert cool[0] > hot[0]
    assert 0.0 <= hot[0] <= 1.0


def test_score_node_prefers_cached_dataset() -> None:
    request = GpuRequest(count=1, memory_mib=8192, cores_pct=25)
    dataset = Dataset("imagenet", 150.0, frozenset({"zone-b"}))
    cached = score_node(node_state("a", gpu(0), datasets=frozenset({"imagenet"}), zone="x"),
                        request, dataset=dataset)
    near = score_node(node_state("b", gpu(0), zone="zone-b"), request, dataset=dataset)
    far = score_node(node_state("c", gpu(0), zone="other"), request, dataset=dataset)
    assert cached is not None and near is not None and far is not None
    assert cached[0] > near[0] > far[0]


def test_score_node_skips_full_gpus_and_maps_distinct_indices() -> None:
    held = GpuGrant("GPU-0", 81_920, 100, exclusive=True)
    state = node_state("a", gpu(0), gpu(1), gpu(2), grants=(held,))
    scored = score_node(state, GpuRequest(count=2, memory_mib=0, isolation=Isolation.EXCLUSIVE))
    assert scored is not None
    assert sorted(scored[1]) == [1, 2]
    assert score_node(state, GpuRequest(count=3, memory_mib=0,
                                        isolation=Isolation.EXCLUSIVE)) is None


@given(st.lists(st.tuples(st.integers(0, 81_920), st.integers(0, 100)), min_size=1,
                max_size=4),
       st.integers(1, 3), st.integers(0, 81_920), st.integers(0, 100))
def test_profile_fit_agrees_with_the_filter(used: list[tuple[int, int]], count: int,
                                            memory: int, cores: int) -> None:
    """Scoring's fit (on profiles) and the extender's filter agree for MPS requests.

    One known exception: a GPU holding anything offers at most 999 milli to scoring, so a
    100 %-cores request only scores on untouched GPUs (the filter lets memory-only grants
    share); the extender then falls back to its tightest-fit choice.
    """
    gpus = tuple(gpu(i) for i in range(len(used)))
    grants = tuple(GpuGrant(f"GPU-{i}", m, c) for i, (m, c) in enumerate(used) if m or c)
    assume(cores < 100 or not grants)
    state = node_state("n", *gpus, grants=grants)
    request = GpuRequest(count=count, memory_mib=memory, cores_pct=cores)
    demand = Demand.from_request(request)
    assert fits(profile_of(state), demand) == (node_rejection(state, request) is None)
