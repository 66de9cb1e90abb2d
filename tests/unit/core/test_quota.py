"""Quotas: namespace binding, guarantees, borrowing and GPU-hour budgets."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from carpool.core.jobs import BudgetPolicy, ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, CycleResult, WaitReason, admission_cycle
from carpool.core.quota import ProjectLedger, Standing, binding_refusal, budget_claims, judge
from carpool.core.resources import (
    GpuGrant,
    JobClass,
    Phase,
)
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer, project_quota

CONFIG = AdmissionConfig(node_placer=packing_placer)

node = partial(gpu_node, gpus=4)
job = gpu_job
quota = project_quota


def running(j: Job, node_name: str, gpu_indices: list[int], started: float,
            borrowed: bool = False) -> Job:
    grants = tuple(GpuGrant(f"{node_name}-g{i}", 80 * GIB, 100, exclusive=True)
                   for i in gpu_indices)
    return replace(j, phase=Phase.RUNNING, node=node_name, grants=grants, attempts=1,
                   borrowed=borrowed, runs=(RunRecord(1, started, None, float(len(grants))),))


def cycle(jobs: list[Job], quotas: list[ProjectQuota], now: float = 0.0,
          nodes: list[NodeState] | None = None) -> CycleResult:
    nodes = nodes if nodes is not None else [node()]
    snap = ClusterSnapshot(now, tuple(jobs), {q.name: q for q in quotas},
                           {n.name: n for n in nodes})
    return admission_cycle(snap, CONFIG)


def reason(result: CycleResult, key: str) -> WaitReason | None:
    wait = result.wait_for(key)
    return wait.reason if wait is not None else None


# ---------------------------------------------------------------- binding


def test_namespace_must_be_bound_to_the_named_project() -> None:
    quotas = {"a": quota("a"), "b": quota("b")}
    refusal = binding_refusal(job("b/j", "a"), quotas)
    assert refusal is not None and not refusal.unknown_project
    assert "not bound to project 'a'" in refusal.message and "bills to b" in refusal.message
    unknown = binding_refusal(job("a/j", "zzz"), quotas)
    assert unknown is not None and unknown.unknown_project
    assert binding_refusal(job("a/j", "a"), quotas) is None


def test_unbound_namespace_is_refused_in_the_cycle() -> None:
    result = cycle([job("other/j", "a")], [quota("a")])
    wait = result.wait_for("other/j")
    assert wait is not None and wait.reason is WaitReason.UNBOUND_NAMESPACE
    assert wait.reason.refused and wait.estimated_start is None
    assert not result.admissions


# ---------------------------------------------------------------- guarantee and borrowing


def test_guarantee_caps_a_project_without_borrowing() -> None:
    jobs = [job(f"a/j{i}", submitted=i) for i in range(3)]
    result = cycle(jobs, [quota("a", guaranteed_gpus=2)])
    assert [a.job_key for a in result.admissions] == ["a/j0", "a/j1"]
    wait = result.wait_for("a/j2")
    assert wait is not None and wait.reason is WaitReason.QUOTA
    assert "runs 2 of 2 guaranteed GPUs" in wait.message and "borrowing is off" in wait.message
    assert wait.estimated_start == pytest.approx(HOUR)  # when a/j0 ends


def test_memory_guarantee_also_caps() -> None:
    jobs = [job(f"a/j{i}", exclusive=False, submitted=i) for i in range(3)]  # 10 GiB each
    result = cycle(jobs, [quota("a", guaranteed_memory_mib=25 * GIB)])
    assert len(result.admissions) == 2
    assert result.waits[0].reason is WaitReason.QUOTA
    assert "GiB guaranteed GPU memory" in result.waits[0].message


def test_preemptible_jobs_borrow_idle_capacity_and_are_marked() -> None:
    jobs = [job("a/j0"), job("a/j1", submitted=1, preemptible=True),
            job("a/j2", submitted=2, preemptible=False)]
    result = cycle(jobs, [quota("a", guaranteed_gpus=1, borrowing=True)])
    admitted = {a.job_key: a for a in result.admissions}
    assert not admitted["a/j0"].borrowed
    assert admitted["a/j1"].borrowed
    wait = result.wait_for("a/j2")
    assert wait is not None and "only preemptible jobs may borrow" in wait.message
    status = result.projects[0]
    assert status.running_gpus == 2 and status.borrowed_gpus == 1


def test_interactive_jobs_never_borrow() -> None:
    jobs = [running(job("a/j0"), "n1", [0], started=0.0),
            job("a/j1", cls=JobClass.INTERACTIVE, preemptible=True, submitted=1)]
    result = cycle(jobs, [quota("a", guaranteed_gpus=1, borrowing=True)])
    wait = result.wait_for("a/j1")
    assert wait is not None and "interactive jobs may not borrow" in wait.message


def test_borrow_limit_holds() -> None:
    jobs = [job(f"a/j{i}", submitted=i, preemptible=True) for i in range(4)]
    result = cycle(jobs, [quota("a", guaranteed_gpus=1, borrowing=True, borrow_limit_gpus=2)])
    assert len(result.admissions) == 3
    wait = result.waits[0]
    assert wait.reason is WaitReason.QUOTA and "borrow limit is 2 GPUs" in wait.message


def test_judge_directly() -> None:
    ledger = ProjectLedger(quota("a", guaranteed_gpus=2, borrowing=True), in_quota_gpus=1.5)
    assert judge(job("a/x"), ledger, 0.5, 0, {}).standing is Standing.IN_QUOTA
    assert judge(job("a/x"), ledger, 1.0, 0, {}).standing is Standing.OVER_QUOTA
    verdict = judge(job("a/x", preemptible=True), ledger, 1.0, 0, {})
    assert verdict.standing is Standing.BORROWING and verdict.borrowed


# ---------------------------------------------------------------- budgets


def test_budget_claims_are_the_worst_case_split_over_periods() -> None:
    q = quota("a", period_s=10 * HOUR)
    assert budget_claims(q, 2.0, 0, None, 3 * HOUR) == {0.0: pytest.approx(6.0)}
    assert budget_claims(q, 2.0, 9 * HOUR, None, 3 * HOUR) == {
        0.0: pytest.approx(2.0), 10 * HOUR: pytest.approx(4.0)}
    assert budget_claims(q, 1.0, 2 * HOUR, 0.0, 3 * HOUR) == {0.0: pytest.approx(1.0)}
    assert budget_claims(q, 1.0, 5 * HOUR, 0.0, 3 * HOUR) == {}


def test_a_job_may_not_overspend_the_next_period() -> None:
    q = quota("a", budget_gpu_hours=3.0, period_s=10 * HOUR)
    late = job("a/late", count=2, max_duration_s=4 * HOUR, submitted=9 * HOUR)
    result = cycle([late], [q], now=9 * HOUR)  # claims 2 now and 6 > 3 after the refill
    wait = result.wait_for("a/late")
    assert wait is not None and wait.reason is WaitReason.BUDGET
    assert "next budget period" in wait.message


def test_budget_holds_jobs_whose_reservation_does_not_fit() -> None:
    q = quota("a", budget_gpu_hours=3.0, period_s=24 * HOUR)
    jobs = [job("a/j0", max_duration_s=2 * HOUR),
            job("a/j1", submitted=1, max_duration_s=2 * HOUR)]
    result = cycle(jobs, [q])
    assert [a.job_key for a in result.admissions] == ["a/j0"]
    wait = result.wait_for("a/j1")
    assert wait is not None and wait.reason is WaitReason.BUDGET
    assert "may need 2 GPU-hours" in wait.message and "refills in 1d" in wait.message
    assert wait.estimated_start == pytest.approx(24 * HOUR)


def test_budget_counts_running_jobs_remaining_reservation() -> None:
    q = quota("a", budget_gpu_hours=4.0, period_s=24 * HOUR)
    first = running(job("a/j0", max_duration_s=3 * HOUR), "n1", [0], started=0.0)
    # at 1h: used 1, j0 may use 2 more, a new 2h job needs 2 → 5 > 4
    result = cycle([first, job("a/j1", submitted=1, max_duration_s=2 * HOUR)], [q], now=HOUR)
    assert reason(result, "a/j1") is WaitReason.BUDGET
    status = result.projects[0]
    assert status.used_gpu_hours == pytest.approx(1.0)
    assert status.reserved_gpu_hours == pytest.approx(2.0)
    assert status.remaining_gpu_hours == pytest.approx(3.0)


def test_refill_releases_held_jobs() -> None:
    q = quota("a", budget_gpu_hours=2.0, period_s=10 * HOUR)
    spent = job("a/old", phase=Phase.SUCCEEDED, runs=(RunRecord(1, 0, 2 * HOUR, 1.0),))
    held = job("a/new", submitted=3 * HOUR)
    before = cycle([spent, held], [q], now=5 * HOUR)
    assert reason(before, "a/new") is WaitReason.BUDGET
    after = cycle([spent, held], [q], now=10 * HOUR)
    assert [a.job_key for a in after.admissions] == ["a/new"]


def test_preemptible_only_policy_runs_preemptible_jobs_as_borrowers() -> None:
    q = quota("a", budget_gpu_hours=0.5, on_budget_exhausted=BudgetPolicy.PREEMPTIBLE_ONLY)
    jobs = [job("a/p", preemptible=True), job("a/n", submitted=1),
            job("a/i", cls=JobClass.INTERACTIVE, preemptible=True, submitted=2)]
    result = cycle(jobs, [q])
    assert [(a.job_key, a.borrowed) for a in result.admissions] == [("a/p", True)]
    for key in ("a/n", "a/i"):
        wait = result.wait_for(key)
        assert wait is not None and wait.reason is WaitReason.BUDGET
        assert "only preemptible, non-interactive jobs run" in wait.message


def test_other_projects_are_not_held_by_one_projects_budget() -> None:
    quotas = [quota("a", budget_gpu_hours=0.0), quota("b")]
    result = cycle([job("a/j"), job("b/j", "b", submitted=5)], quotas)
    assert [a.job_key for a in result.admissions] == ["b/j"]


def test_bad_quota_values_are_refused() -> None:
    with pytest.raises(ValueError, match="weight must be positive"):
        quota("a", weight=0)
    with pytest.raises(ValueError, match="budget must not be negative"):
        quota("a", budget_gpu_hours=-1)
    with pytest.raises(ValueError, match="unknown budget policy"):
        BudgetPolicy.parse("Sometimes")
    assert BudgetPolicy.parse("PreemptibleOnly") is BudgetPolicy.PREEMPTIBLE_ONLY


def test_period_boundaries_follow_the_anchor() -> None:
    q = quota("a", period_s=100.0, period_anchor=30.0)
    assert q.period_start(30.0) == 30.0
    assert q.period_start(129.0) == 30.0
    assert q.period_start(130.0) == 130.0
    assert q.period_start(0.0) == -70.0
    assert q.period_end(50.0) == 130.0
