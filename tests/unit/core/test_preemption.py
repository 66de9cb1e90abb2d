"""Preemption: who may be preempted, victims losing the least work, what-if fit checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import pytest

from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.preemption import (
    Candidate,
    PreemptionCause,
    lost_gpu_hours,
    plan_preemption,
    quota_victims,
    victim_cause,
    worth_preempting,
)
from carpool.core.queueing import AdmissionConfig, CycleResult, WaitReason, admission_cycle
from carpool.core.resources import (
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    Phase,
)
from carpool.core.timeline import Occupancy, Timeline
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer

CONFIG = AdmissionConfig(node_placer=packing_placer)

node = gpu_node
job = partial(gpu_job, preemptible=True, estimate=10 * HOUR)


def run_on(j: Job, gpu_indices: list[int], started: float, node_name: str = "n1",
           borrowed: bool = False, checkpoint: float | None = None,
           submitted: float | None = None) -> Job:
    """`j` running on `gpu_indices` since `started`, submitted a minute before unless told."""
    grants = tuple(GpuGrant(f"{node_name}-g{i}", 80 * GIB, 100, exclusive=True)
                   for i in gpu_indices)
    return replace(j, phase=Phase.RUNNING, node=node_name, grants=grants, attempts=1,
                   borrowed=borrowed, last_checkpoint_at=checkpoint,
                   submitted_at=started - 60 if submitted is None else submitted,
                   runs=(RunRecord(1, started, None, float(len(grants))),))


def quotas(*names: str, **kw: object) -> dict[str, ProjectQuota]:
    return {n: ProjectQuota(n, frozenset({n}), **kw) for n in names}  # type: ignore[arg-type]


def cycle(jobs: list[Job], quota_map: dict[str, ProjectQuota], now: float,
          nodes: list[NodeState] | None = None, config: AdmissionConfig = CONFIG
          ) -> CycleResult:
    nodes = nodes if nodes is not None else [node()]
    return admission_cycle(ClusterSnapshot(now, tuple(jobs), quota_map,
                                           {n.name: n for n in nodes}), config)


def admitted_keys(result: CycleResult) -> list[str]:
    return [a.job_key for a in result.admissions]


# ---------------------------------------------------------------- eligibility


def test_never_interactive_nonpreemptible_too_young_or_terminating() -> None:
    short = job("a/s", "a", JobClass.SHORT)
    now = 10 * HOUR
    assert victim_cause(short, True, run_on(job("b/b", "b", JobClass.BATCH), [0], 0), now) \
        is PreemptionCause.HIGHER_CLASS
    inter = run_on(job("b/i", "b", JobClass.INTERACTIVE), [0], 0)
    assert victim_cause(job("a/x", "a", JobClass.INTERACTIVE), True, inter, now) is None
    pinned = run_on(job("b/p", "b", JobClass.BATCH, preemptible=False), [0], 0)
    assert victim_cause(short, True, pinned, now) is None
    young = run_on(job("b/y", "b", JobClass.BATCH, min_runtime_s=HOUR), [0], now - 60)
    assert victim_cause(short, True, young, now) is None
    assert victim_cause(short, True, replace(young, min_runtime_s=30), now) is not None
    leaving = replace(run_on(job("b/t", "b", JobClass.BATCH), [0], 0), phase=Phase.PREEMPTED)
    assert victim_cause(short, True, leaving, now) is None


def test_same_or_higher_class_is_safe_unless_borrowed_from_another_project() -> None:
    now = 10 * HOUR
    batch = job("a/b", "a", JobClass.BATCH)
    peer = run_on(job("b/b", "b", JobClass.BATCH), [0], 0)
    assert victim_cause(batch, True, peer, now) is None
    borrower = replace(peer, borrowed=True)
    assert victim_cause(batch, True, borrower, now) is PreemptionCause.RECLAIM
    assert victim_cause(batch, False, borrower, now) is None  # borrowers don't evict borrowers
    own_borrower = replace(borrower, key="a/b2", project="a")
    assert victim_cause(batch, True, own_borrower, now) is None


def test_borrowing_preemptor_takes_only_lower_class_borrowers() -> None:
    now = 10 * HOUR
    short = job("a/s", "a", JobClass.SHORT)
    owner_batch = run_on(job("b/b", "b", JobClass.BATCH), [0], 0)
    assert victim_cause(short, False, owner_batch, now) is None
    assert victim_cause(short, False, replace(owner_batch, borrowed=True), now) \
        is PreemptionCause.HIGHER_CLASS


def test_lost_work_counts_from_the_last_checkpoint() -> None:
    victim = run_on(job("b/b", "b", JobClass.BATCH, count=2), [0, 1], started=0,
                    checkpoint=3 * HOUR)
    assert lost_gpu_hours(victim, 2.0, 4 * HOUR) == pytest.approx(2.0)
    assert lost_gpu_hours(replace(victim, last_checkpoint_at=None), 2.0, 4 * HOUR) \
        == pytest.approx(8.0)
    assert lost_gpu_hours(job("b/q", "b", JobClass.BATCH), 1.0, 4 * HOUR) == 0.0


# ---------------------------------------------------------------- choosing victims


def _timeline(jobs: list[Job], nodes: list[NodeState], now: float) -> Timeline:
    timeline = Timeline({n.name: n for n in nodes}, now, packing_placer)
    for j in jobs:
        timeline.add(j.node, Occupancy(j.key, now, now + HOUR, j.grants))
    return timeline


def test_victims_lose_the_least_work_and_only_as_many_as_needed() -> None:
    now = 10 * HOUR
    old = run_on(job("b/old", "b", JobClass.BATCH), [0], 0, checkpoint=2 * HOUR)  # 8h lost
    fresh = run_on(job("b/new", "b", JobClass.BATCH), [1], 9 * HOUR)  # 1h lost
    timeline = _timeline([old, fresh], [node()], now)
    cands = [Candidate(v, PreemptionCause.HIGHER_CLASS, lost_gpu_hours(v, 1.0, now))
             for v in (old, fresh)]
    request = GpuRequest(1, 10 * GIB, isolation=Isolation.EXCLUSIVE)
    plan = plan_preemption(request, HOUR, cands, timeline, frozenset())
    assert plan is not None and [v.job.key for v in plan.victims] == ["b/new"]
    assert plan.grants[0].gpu_uuid == "n1-g1"
    both = GpuRequest(2, 10 * GIB, isolation=Isolation.EXCLUSIVE)
    plan2 = plan_preemption(both, HOUR, cands, timeline, frozenset())
    assert plan2 is not None and {v.job.key for v in plan2.victims} == {"b/old", "b/new"}


def test_borrowed_victims_go_first() -> None:
    now = 10 * HOUR
    borrowed = run_on(job("c/x", "c", JobClass.SHORT), [0], 0, borrowed=True)  # 10h lost
    owned = run_on(job("b/y", "b", JobClass.BATCH), [1], 9.5 * HOUR)  # 0.5h lost
    timeline = _timeline([borrowed, owned], [node()], now)
    cands = [Candidate(borrowed, PreemptionCause.RECLAIM, 10.0),
             Candidate(owned, PreemptionCause.HIGHER_CLASS, 0.5)]
    plan = plan_preemption(GpuRequest(1, 0, isolation=Isolation.EXCLUSIVE), HOUR, cands,
                           timeline, frozenset())
    assert plan is not None and [v.job.key for v in plan.victims] == ["c/x"]


def test_no_preemption_when_the_freed_capacity_is_not_enough() -> None:
    now = 10 * HOUR
    victim = run_on(job("b/v", "b", JobClass.BATCH), [0], 0)
    pinned = run_on(job("b/p", "b", JobClass.BATCH, preemptible=False), [1], 0)
    timeline = _timeline([victim, pinned], [node()], now)
    cands = [Candidate(victim, PreemptionCause.HIGHER_CLASS, 1.0)]
    two = GpuRequest(2, 0, isolation=Isolation.EXCLUSIVE)
    assert plan_preemption(two, HOUR, cands, timeline, frozenset()) is None


# ---------------------------------------------------------------- in the admission cycle


def test_short_job_preempts_another_projects_batch_job() -> None:
    now = 5 * HOUR
    batch0 = run_on(job("b/b0", "b", JobClass.BATCH, checkpoint_grace_s=45), [0], 0)
    batch1 = run_on(job("b/b1", "b", JobClass.BATCH), [1], 4 * HOUR)
    short = job("a/s", "a", JobClass.SHORT, submitted=now - 10)
    result = cycle([batch0, batch1, short], quotas("a", "b"), now)
    assert not result.admissions
    assert [(p.victim_key, p.preemptor_key, p.cause) for p in result.preemptions] == [
        ("b/b1", "a/s", PreemptionCause.HIGHER_CLASS)]
    assert result.preemptions[0].grace_s == 30.0
    wait = result.wait_for("a/s")
    assert wait is not None and wait.reason is WaitReason.PREEMPTING
    assert wait.estimated_start == pytest.approx(now + 30)


def test_next_cycle_waits_for_the_victim_instead_of_preempting_more() -> None:
    now = 5 * HOUR
    leaving = replace(run_on(job("b/b1", "b", JobClass.BATCH), [1], 4 * HOUR),
                      phase=Phase.PREEMPTED)
    other = run_on(job("b/b0", "b", JobClass.BATCH), [0], 0)
    short = job("a/s", "a", JobClass.SHORT, submitted=now - 10)
    result = cycle([other, leaving, short], quotas("a", "b"), now + 5)
    assert not result.preemptions
    wait = result.wait_for("a/s")
    assert wait is not None and wait.reason is WaitReason.PREEMPTING
    # once the victim is gone (operator cleared its grants) the short job starts
    gone = replace(leaving, grants=(), node="", runs=(RunRecord(1, 4 * HOUR, now + 20, 1.0),))
    result = cycle([other, gone, short], quotas("a", "b"), now + 30)
    assert [a.job_key for a in result.admissions] == ["a/s"]


def test_in_quota_job_reclaims_borrowed_capacity() -> None:
    now = HOUR
    borrower = run_on(job("b/x", "b", JobClass.SHORT), [0, 1], 0, borrowed=True)
    owner = job("a/o", "a", JobClass.BATCH, submitted=now - 1)
    qs = {"a": ProjectQuota("a", frozenset({"a"}), guaranteed_gpus=1),
          "b": ProjectQuota("b", frozenset({"b"}), guaranteed_gpus=0, borrowing=True)}
    result = cycle([borrower, owner], qs, now)
    assert [(p.victim_key, p.cause) for p in result.preemptions] == [
        ("b/x", PreemptionCause.RECLAIM)]
    assert "reclaims capacity borrowed by b/x" in result.preemptions[0].message


def test_a_job_that_waited_long_is_not_thrown_back_by_a_newer_higher_class_job() -> None:
    now = 5 * HOUR
    step = AdmissionConfig(node_placer=packing_placer).aging_step_s
    waited = run_on(job("b/old", "b", JobClass.BATCH), [0, 1], now - 60, submitted=0)
    short = job("a/s", "a", JobClass.SHORT, submitted=now)
    assert victim_cause(short, True, waited, now, step) is None
    assert victim_cause(short, True, waited, now, 0.0) is PreemptionCause.HIGHER_CLASS
    result = cycle([waited, short], quotas("a", "b"), now)
    assert not result.preemptions


def test_interactive_and_nonpreemptible_jobs_are_never_victims() -> None:
    now = 5 * HOUR
    inter = run_on(job("b/i", "b", JobClass.INTERACTIVE), [0], 0)
    pinned = run_on(job("b/p", "b", JobClass.BATCH, preemptible=False), [1], 0)
    short = job("a/s", "a", JobClass.INTERACTIVE, submitted=now)
    result = cycle([inter, pinned, short], quotas("a", "b"), now)
    assert not result.preemptions
    assert result.wait_for("a/s") is not None
    assert result.wait_for("a/s").reason is WaitReason.CAPACITY  # type: ignore[union-attr]


def test_preemption_waits_out_a_short_remaining_time_when_asked() -> None:
    now = 5 * HOUR
    victim = run_on(replace(job("b/b", "b", JobClass.BATCH), estimated_duration_s=HOUR + 60),
                    [0, 1], now - HOUR)
    short = job("a/s", "a", JobClass.SHORT, submitted=now)
    patient = AdmissionConfig(node_placer=packing_placer, preempt_after_wait_s=600)
    assert not cycle([victim, short], quotas("a", "b"), now, config=patient).preemptions
    assert cycle([victim, short], quotas("a", "b"), now).preemptions


def test_preemptions_per_cycle_are_capped() -> None:
    now = 5 * HOUR
    victims = [run_on(job(f"b/b{i}", "b", JobClass.BATCH), [i], now - 600) for i in range(2)]
    shorts = [job(f"a/s{i}", "a", JobClass.SHORT, submitted=now + i) for i in range(2)]
    capped = AdmissionConfig(node_placer=packing_placer, max_preemptions_per_cycle=1)
    assert len(cycle(victims + shorts, quotas("a", "b"), now, config=capped).preemptions) == 1
    assert len(cycle(victims + shorts, quotas("a", "b"), now).preemptions) == 2


# ---------------------------------------------------------------- within one project's guarantee


def test_a_projects_short_job_preempts_its_own_batch_job_to_fit_the_guarantee() -> None:
    now = 5 * HOUR
    own_batch = run_on(job("a/b", "a", JobClass.BATCH), [0], now - 600)
    other = job("b/idle", "b", JobClass.BATCH, submitted=now)  # another project, not blocking
    short = job("a/s", "a", JobClass.SHORT, submitted=now)
    qs = {"a": ProjectQuota("a", frozenset({"a"}), guaranteed_gpus=1),
          "b": ProjectQuota("b", frozenset({"b"}))}
    result = cycle([own_batch, other, short], qs, now)
    assert [(p.victim_key, p.preemptor_key) for p in result.preemptions] == [("a/b", "a/s")]
    wait = result.wait_for("a/s")
    assert wait is not None and wait.reason is WaitReason.PREEMPTING
    assert "guarantee" in wait.message
    assert admitted_keys(result) == ["b/idle"]  # the other GPU was free for project b
    # next cycle: the victim is leaving; the short job waits for it instead of preempting more
    leaving = replace(own_batch, phase=Phase.PREEMPTED)
    running_b = run_on(other, [1], now)
    again = cycle([leaving, running_b, short], qs, now + 5)
    assert not again.preemptions
    assert again.wait_for("a/s") is not None
    assert again.wait_for("a/s").reason is WaitReason.PREEMPTING  # type: ignore[union-attr]


def test_own_project_preemption_respects_the_same_rules() -> None:
    now = 5 * HOUR
    pinned = run_on(job("a/b", "a", JobClass.BATCH, preemptible=False), [0], now - 600)
    short = job("a/s", "a", JobClass.SHORT, submitted=now)
    qs = {"a": ProjectQuota("a", frozenset({"a"}), guaranteed_gpus=1)}
    result = cycle([pinned, short], qs, now)
    assert not result.preemptions
    assert result.wait_for("a/s").reason is WaitReason.QUOTA  # type: ignore[union-attr]


def test_quota_victims_cover_the_excess_with_the_least_loss() -> None:
    a = Candidate(job("a/1", "a", JobClass.BATCH), PreemptionCause.HIGHER_CLASS, 5.0)
    b = Candidate(job("a/2", "a", JobClass.BATCH), PreemptionCause.HIGHER_CLASS, 1.0)
    c = Candidate(job("a/3", "a", JobClass.BATCH), PreemptionCause.HIGHER_CLASS, 2.0)
    cands = [(a, 2.0, 0), (b, 0.5, 0), (c, 1.0, 0)]
    assert quota_victims(cands, 1.0, 0) == [c]  # b alone is not enough; b+c, then b dropped
    assert quota_victims(cands, 1.4, 0) == [b, c]
    assert quota_victims(cands, 2.0, 0) == [a]
    assert quota_victims(cands, 9.0, 0) is None


def test_when_to_preempt_caps_then_the_wait() -> None:
    asked: list[bool] = []

    def wait(seconds: float | None) -> Callable[[], float | None]:
        def ask() -> float | None:
            asked.append(True)
            return seconds
        return ask

    assert not worth_preempting(2, 0, 2, 10, 0.0, wait(None))  # preemptions cap reached
    assert not worth_preempting(0, 10, 2, 10, 0.0, wait(None))  # attempts cap reached
    assert worth_preempting(0, 0, 2, 10, 0.0, wait(5.0)) and not asked  # no wait threshold
    assert not worth_preempting(0, 0, 2, 10, 60.0, wait(30.0))  # starts soon enough anyway
    assert worth_preempting(0, 0, 2, 10, 60.0, wait(90.0))
    assert worth_preempting(0, 0, 2, 10, 60.0, wait(None))  # would never start otherwise


# ---------------------------------------------------------------- estimates counting on preemption


def _demo_queue(shards_preemptible: bool = True) -> tuple[list[Job], dict[str, ProjectQuota]]:
    """`make demo`'s a100-b at 22 s: vision's notebook (interactive, until 53 s) and a sweep
    (until 33 s) hold two GPUs, two borrowed nlp shards (5 s grace) the other two until 150 s;
    vision's 4-GPU long job waits for its guarantee (2 of 5 used, it needs 4)."""
    shard = partial(gpu_job, project="nlp", estimate=150, preemptible=shards_preemptible,
                    checkpoint_grace_s=5)
    jobs = [
        run_on(shard("nlp/shard-2"), [2], 0, borrowed=True),
        run_on(shard("nlp/shard-3"), [3], 0, borrowed=True),
        run_on(gpu_job("vision/notebook", "vision", JobClass.INTERACTIVE, estimate=40), [0], 13),
        run_on(gpu_job("vision/sweep", "vision", estimate=20), [1], 13),
        gpu_job("vision/detector", "vision", JobClass.LONG, count=4, estimate=60, submitted=13),
    ]
    qs = {"vision": ProjectQuota("vision", frozenset({"vision"}), guaranteed_gpus=5,
                                 borrowing=True),
          "nlp": ProjectQuota("nlp", frozenset({"nlp"}), guaranteed_gpus=0, borrowing=True)}
    return jobs, qs


def test_a_job_waiting_for_its_guarantee_is_estimated_to_reclaim_borrowed_gpus() -> None:
    """The estimate is when the job really starts: once its guarantee has room (33 s) and the
    notebook it cannot preempt is gone (53 s), it reclaims the borrowed GPUs, which leave
    after their 5 s grace (58 s), not when the borrowers would have ended (150 s)."""
    jobs, qs = _demo_queue()
    wait = cycle(jobs, qs, 22, [node(gpus=4)]).wait_for("vision/detector")
    assert wait is not None and wait.reason is WaitReason.QUOTA
    assert wait.estimated_start == pytest.approx(58)
    assert wait.message.endswith("estimated start in 36s, preempting nlp/shard-2, nlp/shard-3")
    # what the operator then does: at 53 s it preempts both shards, and starts at 58 s
    done = [replace(j, phase=Phase.SUCCEEDED, grants=(), node="",
                    runs=(RunRecord(1, 13, 13 + j.estimated_duration_s, 1.0),))
            if j.project == "vision" and j.holds_gpus else j for j in jobs]
    result = cycle(done, qs, 53, [node(gpus=4)])
    assert {p.victim_key for p in result.preemptions} == {"nlp/shard-2", "nlp/shard-3"}
    later = result.wait_for("vision/detector")
    assert later is not None and later.estimated_start == pytest.approx(58)


def test_a_slot_displaces_only_the_victims_it_needs_in_their_order() -> None:
    now = 10 * HOUR
    a, b = (run_on(job(f"b/{k}", "b"), [i], 0) for i, k in enumerate("ab"))
    timeline = _timeline([a, b], [node()], now)  # both hold their GPU for an hour
    request = GpuRequest(1, 10 * GIB)
    slot = timeline.earliest(request, 60, now + 20)
    assert slot is not None and (slot.start, slot.displaces) == (now + HOUR, ())
    slot = timeline.earliest(request, 60, now + 20, {"b/b": 30, "b/a": 5})
    assert slot is not None and (slot.start, slot.displaces) == (now + 50, ("b/b",))
    # a victim ending on its own before its grace would be over wins without preempting
    short = _timeline([a, b], [node()], now)
    short.end_at("b/a", now + 40)
    slot = short.earliest(request, 60, now + 20, {"b/b": 30})
    assert slot is not None and (slot.start, slot.displaces) == (now + 40, ())


def test_an_estimate_counts_only_on_jobs_the_waiting_job_may_preempt() -> None:
    jobs, qs = _demo_queue(shards_preemptible=False)
    wait = cycle(jobs, qs, 22, [node(gpus=4)]).wait_for("vision/detector")
    assert wait is not None and wait.estimated_start == pytest.approx(150)


def test_an_estimate_preempts_a_protected_job_once_its_minimum_runtime_is_over() -> None:
    """b/b (10 h, 30 s grace) has run 600 s of its 1,200 s minimum runtime: the cycle may
    preempt it at +600 s, so the short job starts at +630 s (not at +600 s, not in 9h50m)."""
    now = 5 * HOUR
    victim = run_on(job("b/b", "b", JobClass.BATCH, min_runtime_s=1200), [0], now - 600)
    short = job("a/s", "a", JobClass.SHORT, submitted=now)
    first = cycle([victim, short], quotas("a", "b"), now, [node(gpus=1)])
    wait = first.wait_for("a/s")
    assert not first.preemptions and wait is not None
    assert wait.estimated_start == pytest.approx(now + 630)
    assert wait.message.endswith("preempting b/b")
    later = cycle([victim, short], quotas("a", "b"), now + 600, [node(gpus=1)])
    assert [p.victim_key for p in later.preemptions] == ["b/b"]
    assert later.wait_for("a/s").estimated_start == pytest.approx(now + 630)  # type: ignore[union-attr]


def test_a_slot_takes_a_victim_only_once_it_may_be_preempted() -> None:
    now = 10 * HOUR
    a, b = (run_on(job(f"b/{k}", "b"), [i], 0) for i, k in enumerate("ab"))
    request = GpuRequest(1, 10 * GIB)
    # b/a comes first but is protected for 100 s more: b/b, free to go now, is taken at once
    slot = _timeline([a, b], [node()], now).earliest(
        request, 60, now, {"b/a": 5, "b/b": 30}, protected={"b/a": now + 100})
    assert slot is not None and (slot.start, slot.displaces) == (now + 30, ("b/b",))
    # with b/b's grace longer than b/a's protection, b/a is taken once it may be
    slot = _timeline([a, b], [node()], now).earliest(
        request, 60, now, {"b/a": 5, "b/b": 300}, protected={"b/a": now + 100})
    assert slot is not None and (slot.start, slot.displaces) == (now + 105, ("b/a",))


def test_an_estimate_never_counts_on_more_victims_than_a_cycle_may_preempt() -> None:
    """A 2-GPU short job needs both batch jobs gone; a cycle preempts a plan whole or not at
    all, so with at most one preemption per cycle it waits for them to end (10 h after they
    started, 600 s ago), and with two it starts once their 30 s grace is over."""
    now = 5 * HOUR
    victims = [run_on(job(f"b/b{i}", "b", JobClass.BATCH), [i], now - 600) for i in range(2)]
    wide = job("a/s", "a", JobClass.SHORT, count=2, submitted=now)
    capped = AdmissionConfig(node_placer=packing_placer, max_preemptions_per_cycle=1)
    result = cycle([*victims, wide], quotas("a", "b"), now, config=capped)
    wait = result.wait_for("a/s")
    assert not result.preemptions and wait is not None
    assert wait.estimated_start == pytest.approx(now - 600 + 10 * HOUR)
    assert "preempting" not in wait.message
    result = cycle([*victims, wide], quotas("a", "b"), now)
    assert len(result.preemptions) == 2
    assert result.wait_for("a/s").estimated_start == pytest.approx(now + 30)  # type: ignore[union-attr]
