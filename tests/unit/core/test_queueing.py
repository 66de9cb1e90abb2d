"""The admission cycle: order, placement, backfill, waits with reasons and estimates."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import (
    AdmissionConfig,
    CycleResult,
    WaitReason,
    admission_cycle,
    extender_placer,
)
from carpool.core.resources import (
    GpuGrant,
    GpuRequest,
    JobClass,
    Phase,
)
from carpool.core.timeline import TimelineMemo
from carpool_testbed.builders import GIB, HOUR, gpu_job, gpu_node, packing_placer

CONFIG = AdmissionConfig(node_placer=packing_placer)

node = gpu_node
job = gpu_job


def run_on(j: Job, gpu_indices: list[int], started: float, node_name: str = "n1") -> Job:
    grants = tuple(GpuGrant(f"{node_name}-g{i}", 80 * GIB, 100, exclusive=True)
                   for i in gpu_indices)
    return replace(j, phase=Phase.RUNNING, node=node_name, grants=grants, attempts=1,
                   runs=(RunRecord(1, started, None, float(len(grants))),))


def quotas(*names: str, **kw: object) -> dict[str, ProjectQuota]:
    return {n: ProjectQuota(n, frozenset({n}), **kw) for n in names}  # type: ignore[arg-type]


def cycle(jobs: list[Job], now: float = 0.0, nodes: list[NodeState] | None = None,
          quota_map: dict[str, ProjectQuota] | None = None,
          config: AdmissionConfig = CONFIG) -> CycleResult:
    nodes = nodes if nodes is not None else [node()]
    quota_map = quota_map if quota_map is not None else quotas("a", "b", "c")
    return admission_cycle(ClusterSnapshot(now, tuple(jobs), quota_map,
                                           {n.name: n for n in nodes}), config)


def admitted(result: CycleResult) -> list[str]:
    return [a.job_key for a in result.admissions]


def test_admits_what_fits_with_node_grants_and_attempt() -> None:
    result = cycle([job("a/j", count=2)])
    (adm,) = result.admissions
    assert adm.node == "n1" and {g.gpu_uuid for g in adm.grants} == {"n1-g0", "n1-g1"}
    assert (adm.attempt, adm.position, adm.borrowed, adm.gpu_fraction) == (1, 1, False, 2.0)
    assert "within project a's guarantee" in adm.message


def test_higher_class_goes_first_when_only_one_fits() -> None:
    jobs = [job("a/batch", count=2, submitted=0), job("b/short", "b", JobClass.SHORT, count=2,
                                                      submitted=10)]
    result = cycle(jobs, now=20)
    assert admitted(result) == ["b/short"]
    wait = result.wait_for("a/batch")
    assert wait is not None and wait.reason is WaitReason.CAPACITY
    assert wait.position == 1 and wait.estimated_start == pytest.approx(20 + HOUR)


def test_a_job_past_its_promised_start_goes_before_a_later_higher_class_one() -> None:
    """The batch job was promised 100; a short job arrived at 50. Until 100 the short job
    would go first; from then on the batch job does, says why, and a later interactive job
    still passes it. A waiting job's estimate is never later than its promise."""
    promised = job("a/batch", count=2, submitted=0, first_estimated_start=100.0)
    short = job("b/short", "b", JobClass.SHORT, count=2, submitted=50)
    assert admitted(cycle([promised, short], now=99)) == ["b/short"]
    result = cycle([promised, short], now=100)
    assert admitted(result) == ["a/batch"]
    wait = result.wait_for("b/short")
    assert wait is not None and wait.position == 1
    off = replace(CONFIG, keep_promises=False)
    assert admitted(cycle([promised, short], now=100, config=off)) == ["b/short"]
    inter = job("b/inter", "b", JobClass.INTERACTIVE, count=2, submitted=90)
    result = cycle([promised, short, inter], now=100)
    assert admitted(result) == ["b/inter"]
    wait = result.wait_for("a/batch")
    assert wait is not None and wait.position == 1
    assert "past its first estimated start" in wait.message
    assert wait.estimated_start == pytest.approx(100 + HOUR)
    # promised 1000 and placed behind the interactive job: capped at the promise, which
    # replays bear out (bench/eta_calibration.py --setting promises), though here the
    # interactive job it cannot pass holds the GPUs until 100 + HOUR
    later = replace(promised, first_estimated_start=1000.0)
    wait = cycle([later, inter], now=100).wait_for("a/batch")
    assert wait is not None and wait.estimated_start == pytest.approx(1000.0)
    assert "past its first estimated start" not in wait.message
    wait = cycle([later, inter], now=100, config=off).wait_for("a/batch")
    assert wait is not None and wait.estimated_start == pytest.approx(100 + HOUR)
    # overdue (four aging steps for a batch job), it ranks above even interactive work: its
    # wait does not say it is merely due
    overdue = replace(promised, submitted_at=100 - 4 * HOUR, first_estimated_start=50.0)
    result = cycle([overdue, inter], now=100)
    assert admitted(result) == ["a/batch"]
    wait = result.wait_for("b/inter")
    assert wait is not None and "past its first estimated start" not in wait.message
    blocked = run_on(job("c/r", "c", count=2), [0, 1], started=0)
    wait = cycle([blocked, overdue], now=100).wait_for("a/batch")
    assert wait is not None and "past its first estimated start" not in wait.message
    wait = cycle([blocked, promised], now=100).wait_for("a/batch")
    assert wait is not None and "past its first estimated start" in wait.message


def test_a_cycle_never_hands_the_same_gpus_out_twice() -> None:
    jobs = [job(f"a/j{i}", submitted=i) for i in range(5)]
    result = cycle(jobs, now=10)
    assert admitted(result) == ["a/j0", "a/j1"]
    uuids = [g.gpu_uuid for a in result.admissions for g in a.grants]
    assert len(uuids) == len(set(uuids))
    starts = [w.estimated_start for w in result.waits]
    assert starts == [pytest.approx(10 + HOUR)] * 2 + [pytest.approx(10 + 2 * HOUR)]
    assert [w.ahead for w in result.waits] == [0, 1, 2]
    assert [w.position for w in result.waits] == [1, 2, 3]  # among those still queued
    assert [a.position for a in result.admissions] == [1, 2]


def test_shared_gpus_pack_fractional_jobs() -> None:
    jobs = [job(f"a/j{i}", exclusive=False, memory_gib=30, submitted=i) for i in range(6)]
    result = cycle(jobs)
    assert len(result.admissions) == 4  # two 30 GiB slices per 80 GiB GPU
    assert all(a.gpu_fraction == pytest.approx(30 / 80) for a in result.admissions)


def test_lighter_project_goes_first_at_equal_class() -> None:
    history = job("a/old", count=2, phase=Phase.SUCCEEDED,
                  runs=(RunRecord(1, 0, 10 * HOUR, 2.0),))
    jobs = [history, job("a/new", count=2, submitted=11 * HOUR),
            job("b/new", "b", count=2, submitted=11 * HOUR + 5)]
    result = cycle(jobs, now=11 * HOUR + 10)
    assert admitted(result) == ["b/new"]


def test_result_does_not_depend_on_the_order_of_jobs() -> None:
    jobs = [job(f"{p}/j{i}", p, JobClass(i % 4), count=1 + i % 2, submitted=i * 7 % 5,
                exclusive=i % 3 == 0, memory_gib=10 + 5 * (i % 4))
            for i, p in enumerate("abcabcabcabc")]
    jobs[0] = run_on(jobs[0], [0], started=0)
    first = cycle(jobs, now=100, nodes=[node("n1"), node("n2")])
    for seed in range(3):
        shuffled = list(jobs)
        random.Random(seed).shuffle(shuffled)
        assert cycle(shuffled, now=100, nodes=[node("n1"), node("n2")]) == first


def test_backfill_fills_holes_that_delay_nobody() -> None:
    running = run_on(job("a/run", estimate=2 * HOUR), [0], started=0)
    big = job("b/big", "b", count=2, submitted=10)  # waits for a/run to end at 2h
    fits_hole = job("c/small", "c", submitted=20, estimate=HOUR)
    too_long = job("d/long", "d", submitted=30, estimate=3 * HOUR)
    result = cycle([running, big, fits_hole, too_long], now=HOUR - 60,
                   quota_map=quotas("a", "b", "c", "d"))
    assert admitted(result) == ["c/small"]
    blocked = result.wait_for("d/long")
    assert blocked is not None and blocked.reason is WaitReason.CAPACITY  # c/small took it
    big_wait = result.wait_for("b/big")
    assert big_wait is not None and big_wait.reason is WaitReason.CAPACITY
    assert big_wait.estimated_start == pytest.approx(2 * HOUR)


def test_behind_higher_ranked_when_free_gpus_are_reserved() -> None:
    running = run_on(job("a/run", estimate=2 * HOUR), [0], started=0)
    big = job("b/big", "b", count=2, submitted=10)
    too_long = job("d/long", "d", submitted=30, estimate=3 * HOUR)
    result = cycle([running, big, too_long], now=60, quota_map=quotas("a", "b", "d"))
    wait = result.wait_for("d/long")
    assert wait is not None and wait.reason is WaitReason.BEHIND_HIGHER_RANKED
    assert wait.ahead == 1 and "reserved for 1 higher-ranked" in wait.message
    assert wait.estimated_start == pytest.approx(3 * HOUR)  # after b/big's reserved hour


def test_a_job_in_requeue_backoff_starts_when_its_backoff_is_over_and_there_is_room() -> None:
    """b/x (2 GPUs, an hour) may try again at 70 s, but a/run holds a GPU until 1 h: its
    estimate is 1 h, not 70 s; it reserves that slot, so c/late (1 GPU, an hour) may not take
    the free GPU now (it would end after 1 h) and is estimated after b/x's hour, at 2 h."""
    running = run_on(job("a/run"), [0], started=0)
    backoff = job("b/x", "b", count=2, submitted=0, not_before=70.0)
    late = job("c/late", "c", submitted=30)
    result = cycle([running, backoff, late], now=60)
    wait = result.wait_for("b/x")
    assert wait is not None and wait.reason is WaitReason.REQUEUE_BACKOFF
    assert wait.estimated_start == pytest.approx(HOUR)
    assert "next attempt in 10s; estimated start in 59m" in wait.message
    assert admitted(result) == []
    behind = result.wait_for("c/late")
    assert behind is not None and behind.reason is WaitReason.BEHIND_HIGHER_RANKED
    assert behind.ahead == 1 and behind.estimated_start == pytest.approx(2 * HOUR)
    # with room when the backoff is over, that is the estimate
    alone = cycle([backoff], now=60).wait_for("b/x")
    assert alone is not None and alone.estimated_start == pytest.approx(70)


def test_a_job_in_requeue_backoff_at_its_projects_cap_starts_when_its_own_job_ends() -> None:
    """Project a may hold 1 GPU and a/run holds it until 1 h: a/x (short), back from its
    backoff at 70 s, starts at 1 h although the node's other GPU is free, and it holds no
    slot there from 70 s, so c/batch (half an hour), ranked after it, starts on that GPU
    now."""
    quota_map = {**quotas("b", "c"), "a": ProjectQuota("a", frozenset({"a"}),
                                                       guaranteed_gpus=1)}
    running = run_on(job("a/run"), [0], started=0)
    backoff = job("a/x", cls=JobClass.SHORT, submitted=0, not_before=70.0)
    batch = job("c/batch", "c", submitted=30, estimate=HOUR / 2)
    result = cycle([running, backoff, batch], now=60, quota_map=quota_map)
    wait = result.wait_for("a/x")
    assert wait is not None and wait.reason is WaitReason.REQUEUE_BACKOFF
    assert wait.estimated_start == pytest.approx(HOUR)
    assert "next attempt in 10s; project a" in wait.message
    assert wait.message.endswith("estimated start in 59m")
    assert [(a.job_key, a.position) for a in result.admissions] == [("c/batch", 2)]


def test_a_job_in_requeue_backoff_whose_budget_is_spent_waits_for_the_refill() -> None:
    """Project a spent its 2 GPU-hours of a 10 h period by 2 h: at 5 h a/x, back from its
    backoff in 10 s, starts at the refill (10 h); a/wide would need 2 GPUs for 2 h, 4 GPU-hours,
    more than a whole period's budget, so it gets no estimate."""
    quota_map = {**quotas("b"), "a": ProjectQuota("a", frozenset({"a"}), budget_gpu_hours=2.0,
                                                  period_s=10 * HOUR)}
    spent = job("a/old", phase=Phase.SUCCEEDED, runs=(RunRecord(1, 0, 2 * HOUR, 1.0),))
    backoff = job("a/x", submitted=3 * HOUR, not_before=5 * HOUR + 10)
    wide = job("a/wide", count=2, submitted=3 * HOUR, max_duration_s=2 * HOUR,
               not_before=5 * HOUR + 10)
    result = cycle([spent, backoff, wide], now=5 * HOUR, quota_map=quota_map)
    assert admitted(result) == []
    wait = result.wait_for("a/x")
    assert wait is not None and wait.reason is WaitReason.REQUEUE_BACKOFF
    assert wait.estimated_start == pytest.approx(10 * HOUR)
    assert "next attempt in 10s" in wait.message and "refills in 5h" in wait.message
    too_big = result.wait_for("a/wide")
    assert too_big is not None and too_big.reason is WaitReason.REQUEUE_BACKOFF
    assert too_big.estimated_start is None
    assert "more than a whole period's budget" in too_big.message


def test_a_job_in_requeue_backoff_counts_on_the_job_it_may_preempt_after_it() -> None:
    """b/b (batch, preemptible, 30 s grace) holds the only GPU for 10 h. a/s (short) may try
    again in 20 s: no preemption during the backoff, but its estimate is the backoff's end
    plus b/b's grace (+50 s), not b/b's end; once the backoff is over, the cycle preempts
    b/b and the estimate stays."""
    now = 5 * HOUR
    victim = run_on(job("b/b", "b", preemptible=True, estimate=10 * HOUR,
                        submitted=now - 660), [0], started=now - 600)
    short = job("a/s", "a", JobClass.SHORT, submitted=now, not_before=now + 20)
    during = cycle([victim, short], now=now, nodes=[node(gpus=1)])
    assert during.preemptions == () and admitted(during) == []
    wait = during.wait_for("a/s")
    assert wait is not None and wait.reason is WaitReason.REQUEUE_BACKOFF
    assert wait.estimated_start == pytest.approx(now + 50)
    assert wait.message.endswith("next attempt in 20s; estimated start in 50s, preempting b/b")
    after = cycle([victim, short], now=now + 20, nodes=[node(gpus=1)])
    assert [p.victim_key for p in after.preemptions] == ["b/b"]
    assert after.wait_for("a/s").estimated_start == pytest.approx(now + 50)  # type: ignore[union-attr]


def test_no_matching_model_and_too_large() -> None:
    jobs = [job("a/a100", models=frozenset({"A100"})), job("a/huge", count=8)]
    result = cycle(jobs)
    model = result.wait_for("a/a100")
    assert model is not None and model.reason is WaitReason.NO_MATCHING_GPU_MODEL
    assert "cluster has H100" in model.message and model.estimated_start is None
    huge = result.wait_for("a/huge")
    assert huge is not None and huge.reason is WaitReason.TOO_LARGE


def test_a_job_kept_out_only_by_a_hot_gpu_waits_for_capacity_saying_why() -> None:
    """Too large is for a job no node could hold even empty and well; one that a node could
    hold once its hot GPU cools waits for capacity, naming the GPU."""
    warm = node("n1", gpus=4)
    gpus = list(warm.inventory.gpus)
    gpus[2] = replace(gpus[2], temperature_c=gpus[2].slowdown_temp_c)
    hot = NodeState(replace(warm.inventory, gpus=tuple(gpus)))
    result = cycle([job("a/four", count=4), job("a/eight", count=8)], nodes=[hot])
    four = result.wait_for("a/four")
    assert four is not None and four.reason is WaitReason.CAPACITY
    assert "while its GPUs are as they are now (n1: 3 of 4 GPUs fit; GPU 2 is at" in four.message
    eight = result.wait_for("a/eight")
    assert eight is not None and eight.reason is WaitReason.TOO_LARGE


def test_model_constraint_picks_the_matching_node() -> None:
    nodes = [node("h", model="H100"), node("a", model="A100")]
    result = cycle([job("a/j", models=frozenset({"A100"}))], nodes=nodes)
    assert [(a.job_key, a.node) for a in result.admissions] == [("a/j", "a")]


def test_expired_jobs_are_reported() -> None:
    over = run_on(job("a/over", max_duration_s=HOUR, checkpoint_grace_s=15), [0], started=0)
    fine = run_on(job("a/fine", max_duration_s=3 * HOUR), [1], started=0)
    result = cycle([over, fine], now=HOUR + 1)
    assert [(e.job_key, e.grace_s) for e in result.expiries] == [("a/over", 15)]


def test_project_status_summarises_usage_and_queue() -> None:
    q = quotas("a", budget_gpu_hours=10.0, guaranteed_gpus=1, borrowing=True)
    jobs = [run_on(job("a/r", peak_memory_mib=5 * GIB), [0], started=0),
            job("a/p", preemptible=True, submitted=1), job("a/w", submitted=2)]
    result = cycle(jobs, now=HOUR, quota_map=q)
    (status,) = result.projects
    assert status.used_gpu_hours == pytest.approx(1.0)
    assert status.remaining_gpu_hours == pytest.approx(9.0)
    assert (status.running_jobs, status.pending_jobs) == (2, 1)
    assert status.running_gpus == 2.0 and status.borrowed_gpus == 1.0
    assert status.memory_efficiency == pytest.approx(0.5)


def test_deep_queue_gets_coarse_estimates() -> None:
    jobs = [job(f"a/j{i}", submitted=i) for i in range(6)]
    shallow = AdmissionConfig(node_placer=packing_placer, reservation_depth=1)
    result = cycle(jobs, config=shallow)
    coarse = [w.coarse_estimate for w in result.waits]
    assert coarse == [False, True, True, True]
    starts = [w.estimated_start for w in result.waits]
    assert all(s is not None for s in starts)
    assert starts == sorted(starts)  # type: ignore[type-var]


def test_the_extender_placer_scores_in_unit_range() -> None:
    place = extender_placer()
    request = GpuRequest(1, 10 * GIB)
    placed = place(node("n1"), request)
    assert placed is not None
    score, grants = placed
    assert 0.0 <= score <= 1.0 and len(grants) == 1
    result = cycle([job("a/j", exclusive=False)], config=AdmissionConfig())
    assert admitted(result) == ["a/j"]


def test_snapshot_rejects_duplicate_jobs_and_bad_keys() -> None:
    with pytest.raises(ValueError, match="more than once"):
        ClusterSnapshot(0, (job("a/j"), job("a/j")), {}, {})
    with pytest.raises(ValueError, match="namespace/name"):
        job("no-slash")
    with pytest.raises(ValueError, match="estimated duration"):
        job("a/j", estimate=0)


def test_jobs_held_by_limits_do_not_use_up_the_exact_estimates() -> None:
    qs = {"a": ProjectQuota("a", frozenset({"a"}), guaranteed_gpus=1),
          "b": ProjectQuota("b", frozenset({"b"}))}
    jobs = [run_on(job("a/r"), [0], started=0), job("a/q", submitted=0),
            job("b/c", "b", count=2, submitted=5)]
    shallow = AdmissionConfig(node_placer=packing_placer, reservation_depth=1)
    result = cycle(jobs, now=60, quota_map=qs, config=shallow)
    quota_wait, capacity_wait = result.wait_for("a/q"), result.wait_for("b/c")
    assert quota_wait is not None and quota_wait.reason is WaitReason.QUOTA
    assert capacity_wait is not None and capacity_wait.reason is WaitReason.CAPACITY
    assert not quota_wait.coarse_estimate and not capacity_wait.coarse_estimate


def test_the_cycle_stops_an_idle_session_and_keeps_a_busy_one() -> None:
    now = 5 * HOUR
    idle = replace(run_on(job("a/idle", cls=JobClass.INTERACTIVE), [0], started=now - HOUR),
                   last_gpu_activity=now - HOUR)
    busy = replace(run_on(job("a/busy", cls=JobClass.INTERACTIVE), [1], started=now - HOUR),
                   last_gpu_activity=now - 60)
    result = cycle([idle, busy], now=now,
                   quota_map=quotas("a", idle_session_timeout_s=1800.0))
    assert [(e.job_key, e.reason) for e in result.expiries] == [("a/idle", "IdleTimeout")]


def test_the_cycle_stops_a_session_idle_past_yield_after_only_while_a_job_waits() -> None:
    now = 5 * HOUR
    idle = replace(run_on(job("a/idle", cls=JobClass.INTERACTIVE), [0], started=now - HOUR),
                   last_gpu_activity=now - 900)
    yielding = quotas("a", "b", idle_session_timeout_s=1800.0, idle_session_yield_after_s=600.0)
    assert not cycle([idle], now=now, quota_map=yielding).expiries
    waiting = job("b/next", "b")
    result = cycle([idle, waiting], now=now, quota_map=yielding)
    assert [(e.job_key, e.reason) for e in result.expiries] == [("a/idle", "IdleTimeout")]


def test_a_memo_reads_a_running_jobs_share_anew_when_its_node_changes() -> None:
    """What a cycle derives from a running job and its node is kept by the memo while both
    are the same objects: a node whose GPUs changed under the same job is read anew."""
    running = replace(job("a/r", memory_gib=20, exclusive=False), phase=Phase.RUNNING,
                      node="n1", grants=(GpuGrant("n1-g0", 20 * GIB, 0),), attempts=1,
                      runs=(RunRecord(1, 0.0, None, 0.25),))
    small, large, other = node(memory_gib=40), node(memory_gib=80), node("n2", memory_gib=80)
    memo = replace(CONFIG, timeline_memo=TimelineMemo())

    def running_gpus(n: NodeState, config: AdmissionConfig) -> float:
        return cycle([running], now=60.0, nodes=[n, other],
                     config=config).projects[0].running_gpus

    expected = [running_gpus(n, CONFIG) for n in (small, large, small)]
    assert expected[0] != expected[1]
    assert [running_gpus(n, memo) for n in (small, small, large, small)] == [
        expected[0], *expected]
