"""The trace replay: parsing, the arrival protocol, grouped search vs brute force, and a smoke
replay on a slice of the real openb trace (not timed)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from carpool.core import scoring
from carpool.core.scoring import Plan, Scorer
from carpool.core.workload import Demand, TargetWorkload
from carpool.replay import simulation
from carpool.replay.simulation import TraceNode, TracePod
from carpool_testbed import simulate as simulate_cli
from carpool_testbed import traces
from carpool_testbed.__main__ import main as carpool_main

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,2,T4
n1,96000,393216,8,G2
n2,16000,65536,1,P100
"""
PODS_CSV = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec
p0,4000,8192,1,500,
p1,8000,16384,1,1000,T4|P100
p2,2000,4096,0,0,
p3,24000,65536,4,1000,
"""


def test_parse_nodes_and_pods() -> None:
    nodes = simulation.parse_nodes_csv(NODES_CSV)
    assert nodes[1] == TraceNode("n1", 96000, 393216, 8, "G2")
    assert simulation.capacity_milli(nodes) == 11_000
    assert simulation.gpu_supply(nodes) == {"T4": 2, "G2": 8, "P100": 1}
    pods = simulation.parse_pods_csv(PODS_CSV)
    assert pods[1].demand == Demand(cpu_milli=8000, memory_mib=16384, gpu_count=1,
                                    gpu_milli=1000, models=frozenset({"T4", "P100"}))
    assert pods[2].demand.gpu_total_milli == 0
    assert pods[3].demand.gpu_total_milli == 4000


@pytest.mark.parametrize(("text", "message"), [
    ("sn,cpu_milli,memory_mib,gpu,model\nn0,lots,1,1,T4\n", "not an integer"),
    ("sn,cpu_milli,gpu,model\nn0,1,1,T4\n", "missing column 'memory_mib'"),
    ("sn,cpu_milli,memory_mib,gpu,model\n", "empty"),
])
def test_bad_node_csv(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulation.parse_nodes_csv(text)


def test_bad_pod_csv() -> None:
    with pytest.raises(ValueError, match="whole GPUs"):
        simulation.parse_pods_csv("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n")
    with pytest.raises(ValueError, match="gpu_milli"):
        simulation.parse_pods_csv("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1500\n")


def test_arrivals_protocol() -> None:
    pods = simulation.parse_pods_csv(PODS_CSV)  # 6500 milli per pass
    sequence = simulation.arrivals(pods, seed=3, capacity=10_000)
    total = sum(p.demand.gpu_total_milli for p in sequence)
    assert total <= 13_000
    assert sorted(p.name for p in sequence[:4]) == ["p0", "p1", "p2", "p3"]  # a shuffle first
    assert sequence == simulation.arrivals(pods, seed=3, capacity=10_000)  # seeded
    # the stopping rule: the pod drawn next would have crossed 130 %
    rng = random.Random(3)
    rng.shuffle(list(pods))
    for _ in sequence[4:]:
        rng.randrange(len(pods))
    assert total + pods[rng.randrange(len(pods))].demand.gpu_total_milli > 13_000


def test_replay_hand_checked() -> None:
    """Two 2-GPU nodes, 8 cores each; FGD-style target of whole GPUs."""
    nodes = [TraceNode("a", 8000, 1 << 20, 2, "T4"), TraceNode("b", 8000, 1 << 20, 2, "T4")]
    whole = Demand(cpu_milli=2000, gpu_count=1, gpu_milli=1000)
    half = Demand(cpu_milli=2000, gpu_count=1, gpu_milli=500)
    cpu_hog = Demand(cpu_milli=8000)
    sequence = [TracePod("h1", half), TracePod("h2", half), TracePod("w1", whole),
                TracePod("hog", cpu_hog), TracePod("w2", whole), TracePod("w3", whole)]
    workload = TargetWorkload(((whole, 1.0),))
    result = simulation.replay(nodes, sequence, Scorer(scoring.FGD, workload))
    # halves share one GPU of node a; w1 takes a's other GPU; the CPU hog can only go to the
    # empty node b (a has 2 cores left); w2 and w3 then find no CPU anywhere.
    assert (result.placed, result.dropped) == (4, 2)
    assert result.allocated_at_end == pytest.approx(2000 / 4000)
    assert result.allocated_at_full == pytest.approx(2000 / 4000)


def brute_force(nodes: list[TraceNode], sequence: list[TracePod], scorer: Scorer) -> list[int]:
    """Reference: score every node for every pod; ties to the lowest index."""
    profiles = [n.profile() for n in nodes]
    chosen = []
    for pod in sequence:
        best: tuple[float, int, Plan] | None = None
        for index, profile in enumerate(profiles):
            plan = scorer.plan(profile, pod.demand)
            if plan is not None and (best is None or plan.score > best[0]):
                best = (plan.score, index, plan)
        if best is None:
            chosen.append(-1)
        else:
            chosen.append(best[1])
            profiles[best[1]] = best[2].after
    return chosen


@pytest.mark.parametrize("policy", ["best-fit", "fgd", "carpool"])
def test_grouped_search_matches_brute_force(policy: str) -> None:
    rng = random.Random(7)
    nodes = [TraceNode(f"n{i}", rng.choice([16000, 32000, 96000]), 1 << 18,
                       rng.choice([1, 2, 4, 8]), rng.choice(["T4", "G2"])) for i in range(30)]
    shapes = [Demand(cpu_milli=c, gpu_count=g, gpu_milli=m, models=ms)
              for c, g, m, ms in [(4000, 1, 250, frozenset()), (8000, 1, 1000, frozenset()),
                                  (2000, 0, 0, frozenset()), (16000, 2, 1000, frozenset()),
                                  (6000, 1, 500, frozenset({"T4"}))]]
    sequence = [TracePod(f"p{i}", rng.choice(shapes)) for i in range(150)]
    workload = simulation.target_workload(sequence)
    scorer = Scorer(scoring.PRESETS[policy], workload, simulation.gpu_supply(nodes))
    expected = brute_force(nodes, sequence, scorer)
    result = simulation.replay(nodes, sequence, scorer)
    assert result.placed == sum(1 for c in expected if c >= 0)
    placed_milli = sum(p.demand.gpu_total_milli for p, c in zip(sequence, expected, strict=True)
                       if c >= 0)
    assert result.allocated_at_end == pytest.approx(placed_milli
                                                    / simulation.capacity_milli(nodes))


def test_summarize_takes_medians() -> None:
    runs = [simulation.ReplayResult(f, e, 1, 0, 1) for f, e in ((0.1, 0.5), (0.3, 0.2),
                                                              (0.2, 0.9))]
    summary = simulation.summarize("x", runs)
    assert (summary.median_at_full, summary.median_at_end) == (0.2, 0.5)
    with pytest.raises(ValueError):
        simulation.summarize("x", [])


TRACES = traces.traces_dir()


def test_smoke_replay_on_a_slice_of_openb(tmp_path: Path) -> None:
    """Every policy runs on 120 nodes and 400 pods of the real trace, via the CLI."""
    node_lines = (TRACES / simulate_cli.NODE_LIST).read_text().splitlines()[:121]
    pod_lines = (TRACES / "openb_pod_list_gpuspec10.csv").read_text().splitlines()[:401]
    (tmp_path / "nodes.csv").write_text("\n".join(node_lines) + "\n")
    (tmp_path / "pods.csv").write_text("\n".join(pod_lines) + "\n")
    runs = [simulate_cli.Run(str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"), p, 0)
            for p in simulate_cli.POLICIES]
    for outcome in simulate_cli.replay_all(runs, jobs=1):
        result = outcome.result
        assert 0.0 < result.allocated_at_full <= result.allocated_at_end <= 1.0
        assert result.placed + result.dropped == result.arrived
    status = carpool_main([
        "simulate", "placement", "--nodes", str(tmp_path / "nodes.csv"),
        "--pods", str(tmp_path / "pods.csv"),
        "--seeds", "1", "--jobs", "1", "--policy", "fgd,carpool"])
    assert status == 0


def test_cli_rejects_missing_files_and_unknown_policies(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert carpool_main(["simulate", "placement", "--nodes", str(tmp_path / "none.csv"),
                         "--pods", str(tmp_path / "none.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        carpool_main(["simulate", "placement", "--policy", "magic"])
    assert "unknown policy 'magic'" in capsys.readouterr().err
