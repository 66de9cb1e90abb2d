"""The shared fit checks (`carpool.core.placement`): what the extender's filter, the
operator's admission check and the GPU choice rely on."""

from __future__ import annotations

from carpool.core.derived import DerivedState
from carpool.core.gpu_choice import NoFit, choose_gpus, grants_for
from carpool.core.placement import (
    NodeState,
    gpu_rejection,
    grant_for,
    node_rejection,
)
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    MigInstance,
    NodeInventory,
)
from carpool.core.scoring import RequestScorer, Scorer


def gpu(index: int, model: str = "A100", **kwargs: object) -> Gpu:
    return Gpu(index, f"GPU-{index}", model, 40_960, **kwargs)  # type: ignore[arg-type]


def node(*gpus: Gpu, grants: tuple[GpuGrant, ...] = (), ready: bool = True,
         sharing: frozenset[Isolation] | None = None) -> NodeState:
    inventory = NodeInventory("n1", gpus, ready=ready)
    if sharing is not None:
        inventory = NodeInventory("n1", gpus, ready=ready, sharing=sharing)
    return NodeState(inventory, grants)


def test_shared_request_fits_until_memory_or_cores_run_out() -> None:
    state = node(gpu(0), grants=(GpuGrant("GPU-0", 30_720, 50),))
    assert node_rejection(state, GpuRequest(count=1, memory_mib=8192, cores_pct=50)) is None
    reason = node_rejection(state, GpuRequest(count=1, memory_mib=16_384))
    assert reason is not None and "10 GiB free, job needs 16 GiB" in reason
    reason = node_rejection(state, GpuRequest(count=1, memory_mib=1024, cores_pct=60))
    assert reason is not None and "50% cores free" in reason


def test_rejection_reasons_are_readable() -> None:
    hot = node(gpu(0, temperature_c=87.0, slowdown_temp_c=90.0))
    assert "within 5C of its slowdown" in (node_rejection(hot, GpuRequest(1, 1024)) or "")
    assert "cordoned" in (node_rejection(node(gpu(0, cordoned=True)), GpuRequest(1, 1)) or "")
    assert "unhealthy" in (node_rejection(node(gpu(0, healthy=False)), GpuRequest(1, 1)) or "")
    t4 = GpuRequest(1, 1024, models=frozenset({"T4"}))
    assert "is a A100, job allows T4" in (node_rejection(node(gpu(0)), t4) or "")
    assert node_rejection(node(gpu(0), ready=False), GpuRequest(1, 1)) == "node is not ready"
    no_mps = node(gpu(0), sharing=frozenset({Isolation.EXCLUSIVE}))
    assert node_rejection(no_mps, GpuRequest(1, 1)) == "node does not offer mps isolation"
    assert node_rejection(node(), GpuRequest(1, 1)) == "node has no GPUs"


def test_exclusive_needs_untouched_gpus_and_blocks_sharing() -> None:
    exclusive = GpuRequest(count=2, memory_mib=0, isolation=Isolation.EXCLUSIVE)
    state = node(gpu(0), gpu(1), gpu(2), grants=(GpuGrant("GPU-1", 1024, 10),))
    cached = DerivedState.of(state)
    choice = choose_gpus(cached, RequestScorer(exclusive, Scorer()))
    assert not isinstance(choice, NoFit)
    grants = grants_for(cached, exclusive, choice[1])
    assert {g.gpu_uuid for g in grants} == {"GPU-0", "GPU-2"}
    assert all(g.exclusive and g.cores_pct == 100 and g.memory_mib == 40_960 for g in grants)
    taken = state.with_grants(grants)
    reason = node_rejection(taken, GpuRequest(count=1, memory_mib=1024))
    assert reason is None  # GPU-1 is still shared
    reason = node_rejection(taken, GpuRequest(count=2, memory_mib=1024))
    assert reason is not None and "held exclusively" in reason


def test_a_gpu_in_exclusive_process_mode_takes_mps_jobs_only() -> None:
    """EXCLUSIVE_PROCESS (set for MPS) refuses every process but the MPS server's: a
    time-sliced or exclusive job there would fail to start, so placement picks another GPU."""
    state = node(gpu(0, exclusive_process=True), gpu(1))
    for isolation in (Isolation.TIMESLICE, Isolation.EXCLUSIVE):
        request = GpuRequest(count=1, memory_mib=1024, isolation=isolation)
        choice = choose_gpus(DerivedState.of(state), RequestScorer(request, Scorer()))
        assert not isinstance(choice, NoFit) and choice[1] == (1,)
        reason = node_rejection(state, GpuRequest(2, 1024, isolation=isolation))
        assert reason is not None and (
            "GPU 0 runs MPS clients only (compute mode EXCLUSIVE_PROCESS), job wants "
            f"{isolation.value}") in reason
    assert node_rejection(state, GpuRequest(2, 1024)) is None  # MPS on both


def test_mig_instances_are_handed_out_smallest_first() -> None:
    small = MigInstance("MIG-a", "1g.10gb", 1, 10_240)
    big = MigInstance("MIG-b", "3g.20gb", 3, 20_480)
    state = node(gpu(0, mig_instances=(big, small)),
                 sharing=frozenset({Isolation.MIG, Isolation.MPS}))
    request = GpuRequest(count=1, memory_mib=8192, isolation=Isolation.MIG)
    free = state.free()[0]
    assert gpu_rejection(free, request) is None
    assert grant_for(free, request).mig_instance == "MIG-a"
    used = state.with_grants((grant_for(free, request),))
    assert grant_for(used.free()[0], request).mig_instance == "MIG-b"
    two_slices = GpuRequest(count=1, memory_mib=1, isolation=Isolation.MIG, mig_slices=4)
    assert "no free MIG instance" in (gpu_rejection(free, two_slices) or "")
