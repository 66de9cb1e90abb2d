"""Tenant isolation rules that need no cluster: who owns a pod, the MPS fence on the control
daemon, placement under a node's MPS ceiling, the SM share an uncapped grant is held to and
billed for, and the extender refusing pods no GpuJob owns (over its real HTTP layer)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from carpool.core import names
from carpool.core.accounting import grants_fraction
from carpool.core.assignment import parse_assignment
from carpool.core.derived import DerivedState
from carpool.core.fairshare import nominal_fraction
from carpool.core.gpu_choice import NoFit, choose_gpus
from carpool.core.gpuhours import gpu_fraction, sm_share_pct
from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.lifecycle import assignment_fraction
from carpool.core.ownership import Owner, gpujob_owner, unowned_refusal
from carpool.core.placement import NodeState, gpu_rejection
from carpool.core.resources import GpuGrant, GpuRequest, Isolation
from carpool.core.scoring import RequestScorer, Scorer
from carpool.deviceplugin.mps import (
    ceiling_commands,
    ceiling_mib,
    parse_memory_limit,
    parse_percentage,
)
from carpool.extender.cache import ClusterCache
from carpool.extender.fake import FakeCluster, gpunode_object, node_object, pod_object
from carpool.extender.service import Extender, Settings
from carpool.extender.wire import BindingArgs, ExtenderArgs

H200_MIB = 143771
OWNER = {"apiVersion": names.API_VERSION, "kind": "GpuJob", "name": "train", "uid": "u",
         "controller": True}


@pytest.mark.parametrize(("refs", "owner"), [
    ([OWNER], Owner("train", "u")),
    ([], None),
    (None, None),
    ([{**OWNER, "controller": False}], None),           # an owner, not the controller
    ([{**OWNER, "kind": "Job"}], None),
    ([{**OWNER, "apiVersion": "evil.dev/v1alpha1"}], None),
    ([{"kind": "ReplicaSet", "name": "x", "controller": True}, OWNER], Owner("train", "u")),
])
def test_only_a_controlling_gpujob_owns_a_pod(refs: list[dict[str, Any]] | None,
                                              owner: Owner | None) -> None:
    assert gpujob_owner(refs) == owner


def test_the_fence_names_gpus_by_uuid_and_reads_back() -> None:
    assert ceiling_commands(50, [("GPU-a", H200_MIB), ("GPU-b", 81920)]) == [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit GPU-a 70G",
        "set_default_device_pinned_mem_limit GPU-b 40G"]
    assert ceiling_mib(H200_MIB, 50) == 70 * 1024  # whole GiB, as the daemon keeps it
    with pytest.raises(ValueError, match=r"1\.\.100"):
        ceiling_commands(0, [])
    # the daemon's answers as seen on an H200 (driver 580)
    assert parse_percentage("50.0") == 50.0
    assert parse_memory_limit("70G") == 70 * 1024
    assert parse_memory_limit("71885M") == 71885
    assert parse_memory_limit("") == 0


def h200_node(ceiling: int | None) -> NodeState:
    status: dict[str, Any] = {"sharingMode": "mps", "gpus": [
        {"index": 0, "uuid": "GPU-0", "model": "H200", "memoryTotalMiB": H200_MIB}]}
    if ceiling is not None:
        status["mpsCeilingPercent"] = ceiling
    return NodeState(inventory_from_gpunode("n", status, {}))


def test_placement_grants_no_mps_client_more_than_the_ceiling() -> None:
    fenced, open_ = h200_node(50), h200_node(None)
    big = GpuRequest(count=1, memory_mib=80 * 1024, isolation=Isolation.MPS)
    reason = gpu_rejection(fenced.free()[0], big)
    assert reason is not None and "holds one MPS client to 70 GiB and 50% cores" in reason
    assert "exclusive" in reason
    assert gpu_rejection(open_.free()[0], big) is None  # nodes without a ceiling: as before
    at_ceiling = dataclasses.replace(big, memory_mib=70 * 1024)
    assert not isinstance(choose_gpus(DerivedState.of(fenced),
                                      RequestScorer(at_ceiling, Scorer())), NoFit)
    assert gpu_rejection(fenced.free()[0], GpuRequest(1, 8192, 60, Isolation.MPS)) is not None
    # the ceiling is the MPS daemon's: other isolations on the node are not held to it
    assert gpu_rejection(fenced.free()[0], dataclasses.replace(
        big, isolation=Isolation.EXCLUSIVE)) is None
    with pytest.raises(ValueError, match="mpsCeilingPercent"):
        inventory_from_gpunode("n", {"sharingMode": "mps", "gpus": [],
                                     "mpsCeilingPercent": 0}, {})


def test_an_uncapped_grant_is_held_to_and_billed_for_its_memory_share() -> None:
    assert sm_share_pct(25, 8192, H200_MIB) == 25
    assert sm_share_pct(0, 8192, H200_MIB) == 6  # 5.7 % rounded up to the thread limit's unit
    assert sm_share_pct(0, 1, H200_MIB) == 1
    assert sm_share_pct(0, H200_MIB, H200_MIB) == 100
    assert sm_share_pct(0, 8192, 0) == 100  # unknown GPU: no cap can be computed
    billed = gpu_fraction(GpuGrant("GPU-0", 8192, 0), H200_MIB)
    assert billed == pytest.approx(8192 / H200_MIB)
    assert abs(billed - sm_share_pct(0, 8192, H200_MIB) / 100) < 0.01
    assert gpu_fraction(GpuGrant("GPU-0", 8192, 50), H200_MIB) == 0.5


def test_a_time_sliced_grant_is_billed_and_counted_as_the_gpu_it_can_take() -> None:
    """Nothing caps a time-sliced job's SMs: GPU-hours, quota and the operator's records all
    count it as whole GPUs, whatever memory it holds."""
    grant = GpuGrant("GPU-0", 8192, 0)
    assert gpu_fraction(grant, H200_MIB, isolation=Isolation.TIMESLICE) == 1.0
    assert gpu_fraction(grant, H200_MIB, isolation=Isolation.MPS) == pytest.approx(
        8192 / H200_MIB)
    request = GpuRequest(count=2, memory_mib=8192, isolation=Isolation.TIMESLICE)
    assert nominal_fraction(request, H200_MIB) == 2.0
    assert nominal_fraction(dataclasses.replace(request, isolation=Isolation.MPS),
                            H200_MIB) == pytest.approx(2 * 8192 / H200_MIB)
    node = h200_node(None)
    assert grants_fraction((grant,), node.inventory, Isolation.TIMESLICE) == 1.0
    assignment = parse_assignment(json.dumps({"node": "n", "gpus": [
        {"uuid": "GPU-0", "index": 0, "memoryMiB": 8192, "cores": 0}]}))
    assert assignment_fraction(assignment, {"GPU-0": H200_MIB},
                               isolation=Isolation.TIMESLICE) == 1.0


def extender(serve_unowned: bool) -> tuple[Extender, FakeCluster]:
    cache = ClusterCache()
    for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
        cache.mark_synced(kind)
    cluster = FakeCluster(on_change=lambda event, pod: cache.apply_pod(event, pod, 0.0))
    cache.apply_node("ADDED", node_object("n1"))
    cache.apply_gpunode("ADDED", gpunode_object("n1", [{"uuid": "g0", "model": "A100"}]))
    settings = Settings(serve_unowned=serve_unowned)
    return Extender(cache, cluster, settings, clock=lambda: 0.0), cluster


def gpujob(name: str, *, uid: str = "u", count: int = 1, memory: str = "10Gi",
           isolation: str = "mps") -> dict[str, Any]:
    """A GpuJob as the extender's watch shows it (only what it keeps)."""
    return {"metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"gpu": {"count": count, "memory": memory, "isolation": isolation}}}


def test_the_extender_filters_and_never_binds_a_pod_no_gpujob_owns() -> None:
    strict, cluster = extender(serve_unowned=False)
    bare = pod_object("bare", memory_gib=10)
    cluster.add_pod(bare)
    result = strict.filter(ExtenderArgs(bare, ("n1",), None))
    assert result["NodeNames"] == []
    assert result["FailedAndUnresolvableNodes"] == {
        "n1": f"carpool: {unowned_refusal('default/bare')}"}
    bound = strict.bind(BindingArgs("bare", "default", "uid-bare", "n1"))
    assert "is not owned by a GpuJob" in bound["Error"]
    assert cluster.bindings == []
    owned = pod_object("owned", memory_gib=10)
    owned["metadata"]["ownerReferences"] = [OWNER]
    cluster.add_pod(owned)
    strict.cache.apply_gpujob("ADDED", gpujob("train", memory="10Gi"))
    assert strict.filter(ExtenderArgs(owned, ("n1",), None))["NodeNames"] == ["n1"]
    assert strict.bind(BindingArgs("owned", "default", "uid-owned", "n1")) == {"Error": ""}
    plain = {"metadata": {"name": "web", "namespace": "default"},
             "spec": {"containers": [{"name": "c"}]}}  # no GPUs: none of Carpool's business
    assert strict.filter(ExtenderArgs(plain, ("n1",), None))["NodeNames"] == ["n1"]
    permissive, cluster = extender(serve_unowned=True)  # benchmarks, test beds
    cluster.add_pod(bare)
    assert permissive.filter(ExtenderArgs(bare, ("n1",), None))["NodeNames"] == ["n1"]


def test_a_jobs_pod_is_placed_as_its_gpujob_asks_not_as_its_annotations_say() -> None:
    """The isolation annotation is a hint: a quarter GPU under MPS stays one when the pod
    says exclusive; a pod whose limits or annotation disagree with its job is not placed."""
    strict, cluster = extender(serve_unowned=False)
    strict.cache.apply_gpujob("ADDED", gpujob("train", memory="10Gi", isolation="mps"))

    def owned(name: str, isolation: str, memory_gib: int = 10,
              owner: dict[str, Any] = OWNER) -> dict[str, Any]:
        pod = pod_object(name, memory_gib=memory_gib,
                         annotations={names.ANN_ISOLATION: isolation})
        pod["metadata"]["ownerReferences"] = [owner]
        cluster.add_pod(pod)
        return pod

    changed = owned("changed", "exclusive")
    result = strict.filter(ExtenderArgs(changed, ("n1",), None))
    reason = result["FailedAndUnresolvableNodes"]["n1"]
    assert result["NodeNames"] == [] and "spec.gpu.isolation is mps" in reason
    assert "exclusive" in strict.bind(BindingArgs("changed", "default", "uid-changed",
                                                  "n1"))["Error"]
    bigger = owned("bigger", "mps", memory_gib=80)
    reason = strict.filter(ExtenderArgs(bigger, ("n1",), None))["FailedAndUnresolvableNodes"]
    assert "carpool.dev/gpu-memory to 80, but its GpuJob's spec.gpu asks for 10" in reason["n1"]
    stranger = owned("stranger", "mps", owner={**OWNER, "uid": "another-job"})
    result = strict.filter(ExtenderArgs(stranger, ("n1",), None))
    assert "is not known to the extender" in result["FailedNodes"]["n1"]  # retried, not final
    assert cluster.bindings == []
    honest = owned("honest", "mps")
    assert strict.filter(ExtenderArgs(honest, ("n1",), None))["NodeNames"] == ["n1"]
    assert strict.bind(BindingArgs("honest", "default", "uid-honest", "n1")) == {"Error": ""}
    bound = cluster.pod("default", "honest")
    recorded = parse_assignment(bound["metadata"]["annotations"][names.ANN_ASSIGNMENT])
    assert recorded.isolation is Isolation.MPS and recorded.gpus[0].memory_mib == 10 * 1024
    # the annotation changed after the bind does not make the GPU whole in the cache
    bound["metadata"]["annotations"][names.ANN_ISOLATION] = "exclusive"
    cluster.update_pod(bound)
    hold = strict.cache.hold_of("default/honest")
    assert hold is not None and not hold.grants[0].exclusive
