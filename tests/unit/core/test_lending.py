"""Lending within a GPU (`core.lending`): what an owner lends, who may borrow, that new
owners never see lent capacity as free, and that a rising owner gets its part back."""

from __future__ import annotations

from dataclasses import replace

from carpool.core.jobs import ClusterSnapshot, Job, RunRecord
from carpool.core.lending import (
    LendingPolicy,
    as_borrowed,
    borrower_view,
    lendable,
    may_borrow,
    reclaims,
    split,
    with_lendable,
)
from carpool.core.placement import NodeState, node_rejection
from carpool.core.preemption import PreemptionCause
from carpool.core.queueing import AdmissionConfig, admission_cycle
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
    Phase,
)
from carpool_testbed.builders import gpu_job, project_quota

GIB = 1024
POLICY = LendingPolicy(observed_s=600, headroom=1.2, reclaim_within_s=30)
NODE = NodeInventory("n1", (Gpu(0, "g0", "H100", 80 * GIB),))
NOW = 1_800_000_000.0


def owner_grant(memory_gib: int = 60, cores: int = 60) -> GpuGrant:
    return GpuGrant("g0", memory_gib * GIB, cores)


def test_an_owner_lends_what_lies_above_its_peak_and_headroom_once_observed() -> None:
    grant = owner_grant()
    assert lendable(grant, 20 * GIB, 30, 900, POLICY) == (60 * GIB - 24 * GIB, 60 - 36)
    assert lendable(grant, 20 * GIB, 30, 300, POLICY) == (0, 0)  # not observed long enough
    assert lendable(grant, None, None, 900, POLICY) == (0, 0)  # nothing measured
    assert lendable(grant, 55 * GIB, 55, 900, POLICY) == (0, 0)  # peak + headroom > grant
    exclusive = GpuGrant("g0", 80 * GIB, 100, exclusive=True)
    assert lendable(exclusive, 1 * GIB, 1, 900, POLICY) == (0, 0)


def test_before_its_peak_is_trusted_an_owner_lends_above_its_templates_calibrated_size(
        ) -> None:
    grant = owner_grant()
    # 300 s in: the template's runs call for 30 GiB and 40 %, its own peak so far is lower
    assert lendable(grant, 10 * GIB, 20, 300, POLICY, 30 * GIB, 40) == (30 * GIB, 20)
    # its own peak so far with headroom above the calibration: that is kept
    assert lendable(grant, 30 * GIB, 40, 300, POLICY, 30 * GIB, 40) == (24 * GIB, 12)
    assert lendable(grant, 10 * GIB, 20, 300, POLICY, None, 40) == (0, 20)  # memory unknown
    # once observed, its own measure alone counts
    assert lendable(grant, 10 * GIB, 20, 900, POLICY, 30 * GIB, 40) == (48 * GIB, 36)


def test_with_lendable_uses_the_calibrated_size_of_the_owners_template() -> None:
    owner = gpu_job("a/o", "a", JobClass.LONG, memory_gib=60, exclusive=False,
                    phase=Phase.RUNNING, attempts=1, node="n1", grants=(owner_grant(),),
                    template="t", runs=(RunRecord(1, NOW - 60, None, 0.75, "n1"),),
                    peak_memory_mib=5 * GIB)
    [early] = with_lendable([owner], POLICY, NOW, {("a", "t"): 20 * GIB})
    assert early.lendable_mib == 40 * GIB  # 60 s in: the template's 20 GiB kept
    [unknown] = with_lendable([owner], POLICY, NOW, {("a", "other"): 20 * GIB})
    assert unknown.lendable_mib == 0
    # nothing measured yet: nothing lent (the extender would not see it lent either)
    [unmeasured] = with_lendable([replace(owner, peak_memory_mib=None)], POLICY, NOW,
                                 {("a", "t"): 20 * GIB})
    assert unmeasured.lendable_mib == 0


def test_only_preemptible_mps_jobs_that_leave_within_the_bound_borrow() -> None:
    mps = GpuRequest(1, 10 * GIB, 20, Isolation.MPS)
    assert may_borrow(mps, True, 30, POLICY)
    assert not may_borrow(mps, False, 30, POLICY)
    assert not may_borrow(mps, True, 120, POLICY)  # its checkpoint takes longer than the bound
    assert not may_borrow(replace(mps, isolation=Isolation.TIMESLICE), True, 30, POLICY)


def test_lent_capacity_is_free_to_borrowers_only() -> None:
    owner = split((owner_grant(),), 36 * GIB, 24)
    state = NodeState(NODE, owner)
    request = GpuRequest(1, 30 * GIB, 20, Isolation.MPS)
    assert node_rejection(state, request) is not None  # 20 GiB free to new owners
    assert node_rejection(borrower_view(state), request) is None
    borrowed = as_borrowed((GpuGrant("g0", 30 * GIB, 20),))
    both = state.with_grants(borrowed)
    free = both.free()[0]
    assert (free.memory_mib, free.cores_pct) == (20 * GIB, 40)  # owners see no change
    assert borrower_view(both).free()[0].memory_mib == 80 * GIB - 24 * GIB - 30 * GIB


def test_borrowers_of_an_owner_that_ended_count_as_ordinary_use() -> None:
    borrowed = as_borrowed((GpuGrant("g0", 30 * GIB, 20),))
    free = NodeState(NODE, borrowed).free()[0]
    assert (free.memory_mib, free.cores_pct) == (50 * GIB, 80)


def test_a_rising_owner_gets_its_lent_part_back_newest_borrower_first() -> None:
    first = as_borrowed((GpuGrant("g0", 15 * GIB, 10),))
    second = as_borrowed((GpuGrant("g0", 15 * GIB, 10),))
    borrowers = {"b/old": (NOW - 500, first), "b/new": (NOW - 100, second)}
    lent_then = NodeState(NODE, split((owner_grant(),), 36 * GIB, 24) + first + second)
    assert reclaims(lent_then, borrowers) == []
    # the owner's peak grew: it lends 5 GiB now; borrowers hold 25 GiB beyond that, the
    # 20 GiB free hold 20 of them, the GPU is 5 GiB short
    lent_now = NodeState(NODE, split((owner_grant(),), 5 * GIB, 24) + first + second)
    assert reclaims(lent_now, borrowers) == ["b/new"]
    assert reclaims(lent_now, borrowers, leaving=["b/new"]) == []  # already going


def _owner_and_borrower_jobs(lent_gib: int) -> tuple[Job, Job]:
    owner = gpu_job("a/train", "a", JobClass.LONG, memory_gib=60, exclusive=False,
                    phase=Phase.RUNNING, attempts=1, node="n1",
                    grants=(owner_grant(),), runs=(RunRecord(1, NOW - 3600, None, 0.75, "n1"),),
                    lendable_mib=lent_gib * GIB, lendable_cores_pct=24)
    borrower = gpu_job("b/sweep", "b", JobClass.BATCH, memory_gib=30, exclusive=False,
                       preemptible=True, phase=Phase.RUNNING,
                       attempts=1, node="n1", grants=as_borrowed((GpuGrant("g0", 30 * GIB, 20),)),
                       runs=(RunRecord(1, NOW - 60, None, 0.375, "n1"),))
    return owner, borrower


def test_the_admission_cycle_places_a_borrower_in_lent_capacity_and_reclaims_it() -> None:
    quotas = {p: project_quota(p) for p in ("a", "b")}
    config = AdmissionConfig(lending=POLICY)
    owner, borrower = _owner_and_borrower_jobs(36)
    waiting = gpu_job("b/sweep", "b", JobClass.BATCH, memory_gib=30, exclusive=False,
                      preemptible=True)
    result = admission_cycle(ClusterSnapshot(NOW, (owner, waiting), quotas,
                                             {"n1": NodeState(NODE)}), config)
    (admitted,) = result.admissions
    assert all(g.borrowed for g in admitted.grants)
    # without lending it waits: 20 GiB are free to it
    plain = admission_cycle(ClusterSnapshot(NOW, (owner, waiting), quotas,
                                            {"n1": NodeState(NODE)}), AdmissionConfig())
    assert not plain.admissions
    # the owner's peak rose: it lends 5 GiB, the borrower holds 30 and 20 GiB are free: the
    # GPU is 5 GiB short, the borrower is stopped within the bound
    owner, borrower = _owner_and_borrower_jobs(5)
    result = admission_cycle(ClusterSnapshot(NOW, (owner, borrower), quotas,
                                             {"n1": NodeState(NODE)}), config)
    (stop,) = result.preemptions
    assert (stop.victim_key, stop.cause) == ("b/sweep", PreemptionCause.OWNER_RECLAIM)
    assert stop.grace_s <= POLICY.reclaim_within_s


def test_a_whole_gpu_owner_lends_only_where_the_policy_lets_whole_gpus_lend() -> None:
    exclusive = GpuGrant("g0", 80 * GIB, 100, exclusive=True)
    whole = replace(POLICY, whole_gpus=True)
    assert lendable(exclusive, 20 * GIB, None, 900, POLICY) == (0, 0)
    assert lendable(exclusive, 20 * GIB, None, 900, whole) == (80 * GIB - 24 * GIB, 0)
    mig = GpuGrant("g0", 10 * GIB, 0, mig_instance="MIG-1")
    assert lendable(mig, 1 * GIB, None, 900, whole) == (0, 0)  # a fixed partition


def test_a_lending_whole_gpu_stays_taken_for_new_owners_and_opens_to_borrowers() -> None:
    state = NodeState(NODE, split((GpuGrant("g0", 80 * GIB, 100, exclusive=True),),
                                  56 * GIB, 0))
    request = GpuRequest(1, 30 * GIB, 0, Isolation.MPS)
    assert node_rejection(state, request) == "0 of 1 GPUs fit; GPU 0 is held exclusively"
    assert node_rejection(borrower_view(state), request) is None
    borrowed = state.with_grants(as_borrowed((GpuGrant("g0", 30 * GIB, 0),)))
    assert reclaims(borrowed, {"b/sweep": (NOW, borrowed.grants[-1:])}) == []
    # the owner's peak rises to 60 GiB: it keeps 72, lends 8, and the borrower must go
    risen = NodeState(NODE, split((GpuGrant("g0", 80 * GIB, 100, exclusive=True),),
                                  8 * GIB, 0)).with_grants(borrowed.grants[-1:])
    assert reclaims(risen, {"b/sweep": (NOW, borrowed.grants[-1:])}) == ["b/sweep"]


def test_a_borrower_whose_lender_ended_makes_way_for_a_waiting_owner() -> None:
    quotas = {p: project_quota(p) for p in ("a", "b")}
    config = AdmissionConfig(lending=POLICY)
    _, borrower = _owner_and_borrower_jobs(36)  # its lender is gone: 50 GiB are free
    borrower = replace(borrower, submitted_at=NOW - 60)
    owner = gpu_job("a/eval", "a", JobClass.BATCH, memory_gib=60, exclusive=False,
                    submitted=NOW)
    result = admission_cycle(ClusterSnapshot(NOW, (borrower, owner), quotas,
                                             {"n1": NodeState(NODE)}), config)
    (stop,) = result.preemptions
    assert (stop.victim_key, stop.preemptor_key, stop.cause) == (
        "b/sweep", "a/eval", PreemptionCause.OWNER_RECLAIM)
    assert stop.grace_s <= POLICY.reclaim_within_s
    # a job that may borrow itself, or an owner of a lower class, leaves it be
    for lent, waiting in ((borrower, replace(owner, preemptible=True)),
                          (replace(borrower, job_class=JobClass.LONG), owner)):
        result = admission_cycle(ClusterSnapshot(NOW, (lent, waiting), quotas,
                                                 {"n1": NodeState(NODE)}), config)
        assert not result.preemptions
    # while its lender runs, the lent part stays the lender's: its leaving frees nothing
    lender, _ = _owner_and_borrower_jobs(36)
    small = gpu_job("a/eval", "a", JobClass.BATCH, memory_gib=25, exclusive=False,
                    submitted=NOW)
    result = admission_cycle(ClusterSnapshot(NOW, (lender, borrower, small), quotas,
                                             {"n1": NodeState(NODE)}), config)
    assert not result.preemptions


def test_a_gpu_no_owner_lends_from_is_closed_to_borrowers() -> None:
    two = NodeInventory("n1", (Gpu(0, "g0", "H100", 80 * GIB), Gpu(1, "g1", "H100", 80 * GIB)))
    request = GpuRequest(1, 30 * GIB, 20, Isolation.MPS)
    lending_g0 = NodeState(two, split((owner_grant(),), 36 * GIB, 24))
    view = borrower_view(lending_g0)
    # g1 is free, but ordinary room: it goes by the queue's order and reservations
    assert [f.gpu.uuid for f in view.free() if not f.exclusive_taken] == ["g0"]
    assert node_rejection(view, request) is None  # in g0's lent part
    assert node_rejection(view, GpuRequest(2, 10 * GIB, 10, Isolation.MPS)) is not None
    # an owner that ended leaves its borrower as ordinary use; its GPU lends no more
    left = NodeState(two, as_borrowed((GpuGrant("g0", 30 * GIB, 20),)))
    assert node_rejection(borrower_view(left), request) is not None
