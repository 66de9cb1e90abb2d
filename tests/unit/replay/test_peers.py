"""The GPU-sharing schedulers' policies (carpool.replay.peers): each choice checked by hand on
small nodes, kube-scheduler's integer scores, and a replay through the simulator against a
brute-force search."""

from __future__ import annotations

import random

import pytest

from carpool.core.scoring import GpuSlot, NodeProfile
from carpool.core.workload import Demand
from carpool.replay import peers, simulation
from carpool.replay.peers import PeerPlanner
from carpool.replay.simulation import TraceNode, TracePod

QUARTER = Demand(cpu_milli=1000, memory_mib=1024, gpu_count=1, gpu_milli=250)


def node(planner: PeerPlanner, idle: list[int], cpu: int = 32_000,
         memory: int = 131_072) -> NodeProfile:
    """A node whose GPU i has `idle[i]` milli free (HAMi: one pod per used GPU)."""
    empty = planner.initial_profile(cpu, memory, len(idle), "T4")
    pods = [slot.memory_free_mib - (1 if planner.policy.peer == "hami" and i < 1000 else 0)
            for slot, i in zip(empty.gpus, idle, strict=True)]
    slots = tuple(GpuSlot("T4", i, p) for i, p in zip(idle, pods, strict=True))
    return empty._replace(gpus=slots)


def chosen(planner: PeerPlanner, profile: NodeProfile, demand: Demand) -> list[int]:
    """Indices of the GPUs the plan took (the slots that changed)."""
    plan = planner.plan_uncached(profile, demand)
    assert plan is not None
    return [i for i, (a, b) in enumerate(zip(profile.gpus, plan.after.gpus, strict=True))
            if a != b]


def test_gpushare_takes_the_gpu_with_least_room_that_fits() -> None:
    planner = PeerPlanner("gpushare")
    profile = node(planner, [1000, 300, 200, 300])
    assert chosen(planner, profile, QUARTER) == [1]  # 200 is too little; 300 twice: lowest
    assert chosen(planner, profile, Demand(gpu_count=1, gpu_milli=400)) == [0]


def test_volcano_takes_the_first_gpu_that_fits() -> None:
    planner = PeerPlanner("volcano")
    profile = node(planner, [200, 1000, 300])
    assert chosen(planner, profile, QUARTER) == [1]
    assert chosen(planner, node(planner, [200, 300, 1000]), QUARTER) == [1]
    whole = Demand(gpu_count=2, gpu_milli=1000)
    assert chosen(planner, node(planner, [1000, 500, 1000, 1000]), whole) == [0, 2]


@pytest.mark.parametrize(("name", "expected"), [("hami-binpack-binpack", [2]),
                                                ("hami-binpack-spread", [0])])
def test_hami_gpu_binpack_takes_the_busiest_gpu_spread_the_idlest(name: str,
                                                                   expected: list[int]) -> None:
    planner = PeerPlanner(name)
    assert chosen(planner, node(planner, [1000, 700, 400]), QUARTER) == expected


def test_hami_split_count_caps_pods_per_gpu() -> None:
    planner = PeerPlanner("hami-binpack-binpack")
    profile = planner.initial_profile(32_000, 131_072, 1, "T4")
    tiny = Demand(gpu_count=1, gpu_milli=50)
    for _ in range(peers.HAMI_SPLIT_COUNT):
        plan = planner.plan_uncached(profile, tiny)
        assert plan is not None
        profile = plan.after
    assert profile.gpus[0].idle_milli == 500  # room left, but no pod slot
    assert planner.plan_uncached(profile, tiny) is None


def test_hami_node_binpack_prefers_the_busier_node_spread_the_emptier() -> None:
    binpack, spread = PeerPlanner("hami-binpack-spread"), PeerPlanner("hami-spread-spread")
    for planner, busy_wins in ((binpack, True), (spread, False)):
        busy = planner.plan_uncached(node(planner, [500, 1000]), QUARTER)
        empty = planner.plan_uncached(node(planner, [1000, 1000]), QUARTER)
        assert busy is not None and empty is not None
        assert (busy.score > empty.score) is busy_wins
    # a node's usage: (pods / slots + 2 used / capacity) / 3 = (1/20 + 2 x 500/2000) / 3
    assert peers.hami_usage(node(binpack, [500, 1000])) == pytest.approx((0.05 + 0.5) / 3)


def test_kube_scheduler_scores_match_its_integer_formulas() -> None:
    profile = NodeProfile(cpu_free_milli=6000, memory_free_mib=4096, cpu_total_milli=10_000,
                          gpus=(), memory_total_mib=8192)
    pod = Demand(cpu_milli=1000, memory_mib=1024)
    # requested with the pod: CPU 5000 / 10000, memory 5120 / 8192
    assert peers.least_allocated(profile, pod) == (50 + 3072 * 100 // 8192) // 2 == 43
    assert peers.balanced_allocation(profile, pod) == int((1 - abs(0.5 - 0.625) / 2) * 100)
    assert peers.volcano_binpack(profile, pod) == pytest.approx(100 * (0.5 + 0.625) / 2)


def test_cpu_only_pods_and_models() -> None:
    planner = PeerPlanner("hami-binpack-spread")
    profile = node(planner, [1000])
    plan = planner.plan_uncached(profile, Demand(cpu_milli=2000))
    assert plan is not None and plan.slots == ()
    assert plan.after.cpu_free_milli == profile.cpu_free_milli - 2000
    assert planner.plan_uncached(profile, Demand(gpu_count=1, gpu_milli=100,
                                                 models=frozenset({"A100"}))) is None
    assert planner.plan_uncached(profile, Demand(cpu_milli=64_000)) is None
    with pytest.raises(ValueError, match="unknown peer policy"):
        PeerPlanner("kai")


def brute_force(nodes: list[TraceNode], sequence: list[TracePod],
                planner: PeerPlanner) -> int:
    """Every node scored for every pod, ties to the lowest index; returns pods placed."""
    profiles = [planner.initial_profile(n.cpu_milli, n.memory_mib, n.gpus, n.model)
                for n in nodes]
    placed = 0
    for pod in sequence:
        best = None
        for index, profile in enumerate(profiles):
            plan = planner.plan_uncached(profile, pod.demand)
            if plan is not None and (best is None or plan.score > best[0]):
                best = (plan.score, index, plan)
        if best is not None:
            profiles[best[1]] = best[2].after
            placed += 1
    return placed


@pytest.mark.parametrize("name", list(peers.POLICIES))
def test_replay_matches_brute_force(name: str) -> None:
    rng = random.Random(11)
    nodes = [TraceNode(f"n{i}", rng.choice([16_000, 32_000, 96_000]),
                       rng.choice([65_536, 262_144]), rng.choice([1, 2, 4, 8]),
                       rng.choice(["T4", "G2"])) for i in range(25)]
    shapes = [Demand(cpu_milli=c, memory_mib=m, gpu_count=g, gpu_milli=s, models=ms)
              for c, m, g, s, ms in [(4000, 8192, 1, 250, frozenset()),
                                     (8000, 16_384, 1, 1000, frozenset()),
                                     (2000, 4096, 0, 0, frozenset()),
                                     (16_000, 32_768, 2, 1000, frozenset()),
                                     (6000, 8192, 1, 500, frozenset({"T4"}))]]
    sequence = [TracePod(f"p{i}", rng.choice(shapes)) for i in range(200)]
    planner = PeerPlanner(name)
    result = simulation.replay(nodes, sequence, planner)
    assert result.placed == brute_force(nodes, sequence, planner)
    assert 0 < result.placed < len(sequence)
