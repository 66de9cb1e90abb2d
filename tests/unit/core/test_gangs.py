"""Gangs: admitted, placed and preempted whole, into the smallest topology domain."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from carpool.core.decoding import (
    topology_from_spec,
    worker_names_from_spec,
    worker_requests_from_spec,
)
from carpool.core.gangs import WorkerPlacement, place_gang
from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import (
    AdmissionConfig,
    CycleResult,
    WaitReason,
    admission_cycle,
    extender_placer,
)
from carpool.core.resources import GpuGrant, JobClass, Phase
from carpool.core.topology import (
    TOPOLOGY_LABELS,
    TopologyLevel,
    TopologyMode,
    TopologyNeed,
)
from carpool_testbed.builders import GIB, gpu_job, gpu_node, packing_placer

CONFIG = AdmissionConfig(node_placer=packing_placer)
RACK = TOPOLOGY_LABELS[TopologyLevel.RACK]


def node(name: str, gpus: int = 4, rack: str = "") -> NodeState:
    state = gpu_node(name, gpus)
    labels = frozenset({(RACK, rack)}) if rack else frozenset()
    return NodeState(replace(state.inventory, labels=labels))


def gang(key: str, workers: int, count: int, project: str = "a", **fields: object) -> Job:
    one = gpu_job(key, project, count=count, **fields)  # type: ignore[arg-type]
    return replace(one, workers=(one.request,) * workers)


def cycle(jobs: list[Job], nodes: list[NodeState], now: float = 0.0,
          quotas: dict[str, ProjectQuota] | None = None) -> CycleResult:
    quotas = quotas or {n: ProjectQuota(n, frozenset({n})) for n in ("a", "b")}
    return admission_cycle(ClusterSnapshot(now, tuple(jobs), quotas,
                                           {n.name: n for n in nodes}), CONFIG)


def running(job: Job, placements: tuple[WorkerPlacement, ...], started: float = 0.0) -> Job:
    grants = tuple(g for p in placements for g in p.grants)
    return replace(job, phase=Phase.RUNNING, attempts=1, node=placements[0].node, grants=grants,
                   placements=placements,
                   runs=(RunRecord(1, started, None, float(len(grants))),))


def test_a_gang_that_cannot_fully_fit_starts_no_worker() -> None:
    nodes = [node("n1"), node("n2")]
    blocker = running(gpu_job("b/big", "b", count=3),
                      (WorkerPlacement("n2", tuple(GpuGrant(f"n2-g{i}", 80 * GIB, 100, True)
                                                   for i in range(3))),))
    result = cycle([blocker, gang("a/g", 2, 4)], nodes)
    assert result.admissions == ()
    wait = result.wait_for("a/g")
    assert wait is not None and wait.reason is WaitReason.CAPACITY
    assert "all 2 workers (8 GPUs)" in wait.message and "whole or not at all" in wait.message


def test_a_gang_is_admitted_whole_with_every_worker_placed() -> None:
    result = cycle([gang("a/g", 3, 2)], [node("n1"), node("n2")])
    (adm,) = result.admissions
    assert len(adm.workers) == 3 and len(adm.grants) == 6
    assert adm.gpu_fraction == 6.0
    used = [g.gpu_uuid for w in adm.workers for g in w.grants]
    assert len(set(used)) == 6  # no GPU given twice


def test_two_gangs_that_fit_alone_but_not_together_never_deadlock() -> None:
    """One cycle decides both: the first is admitted whole, the second waits whole with a
    reason and a reserved start when the first ends."""
    nodes = [node("n1"), node("n2")]
    result = cycle([gang("a/first", 2, 3, submitted=0), gang("b/second", 2, 3, "b",
                                                             submitted=1)], nodes, now=2)
    assert [a.job_key for a in result.admissions] == ["a/first"]
    wait = result.wait_for("b/second")
    assert wait is not None and wait.reason is WaitReason.CAPACITY
    assert wait.estimated_start is not None and not wait.coarse_estimate


def test_a_gang_goes_into_the_smallest_domain_that_holds_it() -> None:
    """Two workers of 4 GPUs: one rack of two 4-GPU nodes holds them; the other rack's
    nodes are partly used; the gang lands in the empty rack, not across racks."""
    nodes = [node("a1", rack="r-a"), node("a2", rack="r-a"), node("b1", rack="r-b"),
             node("b2", rack="r-b")]
    placed = place_gang((gang("a/g", 2, 4).request,) * 2, {n.name: n for n in nodes},
                        packing_placer)
    assert placed is not None and placed.level is TopologyLevel.RACK
    assert set(placed.nodes) in ({"a1", "a2"}, {"b1", "b2"})
    one_host = place_gang((gang("a/g", 2, 2).request,) * 2, {n.name: n for n in nodes},
                          packing_placer)
    assert one_host is not None and one_host.level is TopologyLevel.HOST


def test_required_topology_waits_and_says_why_where_preferred_spreads() -> None:
    """Each rack has 4 free GPUs of its 8; a gang of two 4-GPU workers fits only across
    racks: required waits (TopologyUnavailable), preferred starts across them."""
    nodes = [node("a1", rack="r-a"), node("a2", rack="r-a"), node("b1", rack="r-b"),
             node("b2", rack="r-b")]

    def hold(name: str) -> WorkerPlacement:
        return WorkerPlacement(name, tuple(GpuGrant(f"{name}-g{i}", 80 * GIB, 100, True)
                                           for i in range(4)))

    blockers = [running(gpu_job("b/x", "b", count=4), (hold("a1"),)),
                running(gpu_job("b/y", "b", count=4), (hold("b1"),))]
    required = TopologyNeed(TopologyLevel.RACK, TopologyMode.REQUIRED)
    preferred = TopologyNeed(TopologyLevel.RACK, TopologyMode.PREFERRED)
    waits = cycle([*blockers, gang("a/g", 2, 4, topology=required)], nodes)
    assert waits.admissions == ()
    wait = waits.wait_for("a/g")
    assert wait is not None and wait.reason is WaitReason.TOPOLOGY
    assert "no rack domain has room" in wait.message and "required" in wait.message
    starts = cycle([*blockers, gang("a/g", 2, 4, topology=preferred)], nodes)
    (adm,) = starts.admissions
    assert {w.node for w in adm.workers} == {"a2", "b2"}


def test_required_topology_no_domain_could_ever_hold_is_too_large() -> None:
    nodes = [node("a1", rack="r-a"), node("b1", rack="r-b")]
    need = TopologyNeed(TopologyLevel.RACK, TopologyMode.REQUIRED)
    wait = cycle([gang("a/g", 2, 4, topology=need)], nodes).wait_for("a/g")
    assert wait is not None and wait.reason is WaitReason.TOO_LARGE
    assert "no rack domain could hold all 2 workers" in wait.message


def test_a_gang_counts_against_its_project_as_one_job() -> None:
    quotas = {"a": ProjectQuota("a", frozenset({"a"}), guaranteed_gpus=6.0)}
    result = cycle([gang("a/g", 2, 4)], [node("n1"), node("n2")], quotas=quotas)
    assert result.admissions == ()
    wait = result.wait_for("a/g")
    assert wait is not None and wait.reason is WaitReason.QUOTA


def test_a_running_gang_is_preempted_whole_for_a_higher_class_job() -> None:
    """The interactive job needs GPUs on the gang's second node: the gang is the victim,
    once, and all its GPUs (on both nodes) count as leaving."""
    nodes = [node("n1"), node("n2")]

    def hold(name: str) -> WorkerPlacement:
        return WorkerPlacement(name, tuple(GpuGrant(f"{name}-g{i}", 80 * GIB, 100, True)
                                           for i in range(4)))

    victim = running(gang("a/g", 2, 4, preemptible=True), (hold("n1"), hold("n2")))
    urgent = gpu_job("b/now", "b", JobClass.SHORT, count=4)
    result = cycle([victim, urgent], nodes, now=10)
    assert [p.victim_key for p in result.preemptions] == ["a/g"]
    assert result.wait_for("b/now") is not None


def test_a_gang_holds_every_worker_s_gpus_against_other_jobs() -> None:
    nodes = [node("n1"), node("n2")]

    def hold(name: str) -> WorkerPlacement:
        return WorkerPlacement(name, tuple(GpuGrant(f"{name}-g{i}", 80 * GIB, 100, True)
                                           for i in range(4)))

    holder = running(gang("a/g", 2, 4), (hold("n1"), hold("n2")))
    result = cycle([holder, gpu_job("b/one", "b", count=1)], nodes)
    assert result.admissions == ()
    projects = {p.project: p for p in result.projects}
    assert projects["a"].running_gpus == 8.0 and projects["a"].running_jobs == 1


def _spec(**fields: object) -> dict[str, object]:
    return {"project": "a", "gpu": {"count": 2, "memory": "40Gi", "isolation": "exclusive"},
            "template": {"spec": {"containers": [{"name": "main", "image": "x"}]}}, **fields}


def test_workers_decode_in_rank_order_with_each_group_s_shape() -> None:
    spec = _spec(workers=[{"name": "lead", "replicas": 1, "gpu": {"count": 4}},
                          {"name": "rest", "replicas": 2}],
                 topology={"level": "nvlink-island", "mode": "required"})
    workers = worker_requests_from_spec(spec)
    assert [w.count for w in workers] == [4, 2, 2]
    assert {w.memory_mib for w in workers} == {40 * GIB}
    assert worker_names_from_spec(spec) == ("lead", "rest", "rest")
    assert topology_from_spec(spec) == TopologyNeed(TopologyLevel.NVLINK_ISLAND,
                                                    TopologyMode.REQUIRED)
    assert worker_requests_from_spec(_spec()) == () and topology_from_spec(_spec()) is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"workers": [{"name": "w", "replicas": 17}]}, "spec.workers: a gang has at most 16"),
    ({"workers": [{"name": "w", "replicas": 9, "gpu": {"count": 16}}]},
     "spec.workers: a gang asks for at most 128 GPUs"),
    ({"workers": [{"name": "w", "replicas": 1, "gpu": {"memory": "lots"}}]},
     "spec.workers[0].gpu.memory"),
    ({"workers": [{"name": "w", "replicas": 2}], "topology": {"level": "pod"}},
     "spec.topology: unknown topology level 'pod'"),
])
def test_bad_gang_specs_are_refused_naming_the_field(fields: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        worker_requests_from_spec(_spec(**fields))
        topology_from_spec(_spec(**fields))


def _nvlink_node() -> NodeState:
    """8 GPUs in two NVLink islands (0-3 and 4-7, NUMA nodes 0 and 1); GPUs 0-2 taken."""
    islands = (frozenset(range(4)), frozenset(range(4, 8)))
    gpus = tuple(replace(g, nvlink_peers=islands[g.index // 4] - {g.index},
                         numa_node=g.index // 4)
                 for g in gpu_node("n1", 8).inventory.gpus)
    held = tuple(GpuGrant(f"n1-g{i}", 80 * GIB, 100, True) for i in range(3))
    return NodeState(replace(gpu_node("n1", 8).inventory, gpus=gpus), held)


@pytest.mark.parametrize(("count", "expected"), [(2, {4, 5}), (4, {4, 5, 6, 7})])
def test_several_gpus_of_a_node_are_chosen_within_one_nvlink_island(
        count: int, expected: set[int]) -> None:
    """Without topology the lowest free GPUs would be taken (3 and up, across islands)."""
    request = gpu_job("a/j", count=count).request
    fit = extender_placer()(_nvlink_node(), request)
    assert fit is not None
    assert {int(g.gpu_uuid.rsplit("g", 1)[1]) for g in fit[1]} == expected
    plain = NodeState(gpu_node("n1", 8).inventory, _nvlink_node().grants)
    fit = extender_placer()(plain, request)
    assert fit is not None and min(int(g.gpu_uuid.rsplit("g", 1)[1]) for g in fit[1]) == 3


def test_a_higher_class_gang_preempts_what_keeps_it_from_starting_whole() -> None:
    """Two 4-GPU workers on two 4-GPU nodes; a preemptible batch job holds 2 GPUs of n2 and
    a non-preemptible one nothing: the short gang preempts just the batch job and waits for
    it (Preempting), its GPUs reserved; without a preemptible victim it only waits."""
    nodes = [node("n1"), node("n2")]
    held = (WorkerPlacement("n2", tuple(GpuGrant(f"n2-g{i}", 80 * GIB, 100, True)
                                        for i in range(2))),)
    victim = running(gpu_job("b/batch", "b", count=2, preemptible=True), held)
    urgent = gang("a/g", 2, 4, cls=JobClass.SHORT)
    result = cycle([victim, urgent], nodes, now=10)
    assert [p.victim_key for p in result.preemptions] == ["b/batch"]
    wait = result.wait_for("a/g")
    assert wait is not None and wait.reason is WaitReason.PREEMPTING
    kept = running(gpu_job("b/batch", "b", count=2), held)
    result = cycle([kept, urgent], nodes, now=10)
    assert result.preemptions == ()
    wait = result.wait_for("a/g")
    assert wait is not None and wait.reason is WaitReason.CAPACITY
