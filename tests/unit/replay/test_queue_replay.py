"""The queue replay: traces read and annotated, four policies on small traces checked by hand,
and the scores (the command, `carpool simulate queue`: tests/unit/cli/test_simulate_cli.py)."""

from __future__ import annotations

import random

import pytest

from carpool.core.queueing import AdmissionConfig
from carpool.core.resources import GpuRequest, Isolation, JobClass
from carpool.replay import job_traces as traces
from carpool.replay import queue_replay as qr
from carpool_testbed.builders import packing_placer

NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,2,T4\n"


def job(name: str, arrival: float, run_s: float, estimate_s: float, gpus: int = 1,
        cls: JobClass = JobClass.BATCH, project: str = "a", preemptible: bool = False
        ) -> traces.TraceJob:
    request = GpuRequest(gpus, 0, 100, Isolation.EXCLUSIVE)
    return traces.TraceJob(f"{project}/{name}", project, cls, request, arrival, run_s,
                           estimate_s, name, preemptible)


def policies() -> dict[str, qr.Policy]:
    return {"fifo": qr.fifo_policy(packing_placer), "slurm": qr.slurm_policy(packing_placer),
            "kueue": qr.kueue_policy(packing_placer),
            "carpool": qr.carpool_policy(AdmissionConfig(node_placer=packing_placer))}


def starts(outcome: qr.Outcome) -> dict[str, float | None]:
    return {k.split("/")[1]: r.first_start for k, r in outcome.records.items()}


def test_parse_trace_reads_openb_columns_and_skips_what_never_ran() -> None:
    text = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
            "creation_time,deletion_time,scheduled_time\n"
            "p-1,1000,1024,1,500,T4|P100,LS,Running,10,110,40\n"
            "p-2,1000,1024,0,0,,BE,Running,20,50,20\n"  # CPU only
            "p-3,1000,1024,1,1000,,BE,Pending,30,,\n"  # never scheduled
            "p-4,1000,1024,2,1000,,BE,Succeeded,5,1005,5\n")
    parsed = traces.parse_trace(text)
    assert (parsed.unscheduled, parsed.cpu_only) == (1, 1)
    first, second = parsed.rows  # sorted by arrival
    assert (first.name, first.arrival, first.runtime_s) == ("p-4", 5, 1000)
    assert first.request == GpuRequest(2, 0, 100, Isolation.EXCLUSIVE)
    assert (second.arrival, second.runtime_s) == (10, 70)  # deletion - scheduled
    assert second.request == GpuRequest(1, 0, 50, Isolation.MPS, frozenset({"T4", "P100"}))
    # every name is "p-N": names say nothing, so the shape stands for the job's template
    assert first.template == "BE-2x1000-any-c1000-m1024"
    assert second.template == "LS-1x500-P100|T4-c1000-m1024"
    renamed = traces.parse_trace(text.replace("p-1,", "train-7,").replace("p-4,", "eval-12,"))
    assert [r.template for r in renamed.rows] == ["eval", "train"]


@pytest.mark.parametrize(("text", "message"), [
    ("name,num_gpu\nx,1\n", "lacks column"),
    ("name,num_gpu,gpu_milli,creation_time,deletion_time,scheduled_time\nx,1,500,0,5,9\n",
     "line 2: deletion_time 5 is before scheduled_time 9"),
    ("name,num_gpu,gpu_milli,creation_time,deletion_time,scheduled_time\nx,2,500,0,9,0\n",
     "line 2: a 2-GPU pod must ask for whole GPUs"),
    ("name,num_gpu,gpu_milli,creation_time,deletion_time,scheduled_time\nx,1,abc,0,9,0\n",
     "line 2: gpu_milli='abc' is not a number"),
])
def test_parse_trace_errors_name_the_line_and_column(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        traces.parse_trace(text)


def test_user_estimates_are_round_mostly_over_and_seeded() -> None:
    rng = random.Random(1)
    ratios = [traces.user_estimate(1000.0, rng) / 1000.0 for _ in range(4000)]
    assert all(r * 1000.0 in traces.ROUND_ESTIMATES_S for r in ratios)
    under = sum(r < 1 for r in ratios) / len(ratios)
    assert 0.05 < under < 0.15  # UNDER_P = 10 %, some rounded up past the run time
    assert sorted(ratios)[len(ratios) // 2] >= 2.0  # the median user over-estimates 2x+
    rows = traces.parse_trace(traces.generate(
        [traces.TraceRow("s", 0, 60, 1, 500, frozenset(), "BE", 0, 0)], 50, 3, 60.0)).rows
    assert traces.annotate(rows, 7) == traces.annotate(rows, 7)
    assert traces.annotate(rows, 7) != traces.annotate(rows, 8)


def test_hand_checked_trace_under_each_policy() -> None:
    """One node, 2 GPUs. A (1 GPU, 0-100) runs; B (2 GPUs) must wait for A; C (1 GPU, 50 s)
    fits before A ends and ends before B could start; D (1 GPU, 200 s) would delay B."""
    nodes = qr.trace_nodes([("n1", 2, "T4")], 1.0)
    trace = [job("A", 0, 100, 100), job("B", 1, 100, 100, gpus=2), job("C", 2, 50, 50),
             job("D", 3, 200, 200)]
    quotas = qr.open_quotas(trace)
    got = {name: qr.replay(trace, nodes, quotas, policy, name)
           for name, policy in policies().items()}
    # FIFO: nothing passes B
    assert starts(got["fifo"]) == {"A": 0, "B": 100, "C": 200, "D": 200}
    # EASY backfill and Carpool's conservative backfill: C fills the hole, D does not
    assert starts(got["slurm"]) == {"A": 0, "B": 100, "C": 2, "D": 200}
    assert starts(got["carpool"]) == {"A": 0, "B": 100, "C": 2, "D": 200}
    # BestEffortFIFO: the 2-GPU head is skipped whenever one GPU is free, so D passes it
    assert starts(got["kueue"]) == {"A": 0, "B": 252, "C": 2, "D": 52}
    for name in ("slurm", "carpool"):  # exact run times = estimates: exact estimates
        b = got[name].records["a/B"]
        assert b.arrival_estimate is not None and b.arrival_estimate.start == 100
        scores = qr.score(got[name])
        assert scores["eta_median_abs_rel_error"] == 0.0
        assert scores["jobs_waited_60s"] == 2  # B (99 s) and D (197 s)
    assert got["fifo"].records["a/B"].arrival_estimate is None
    # 550 GPU-seconds of work; FIFO ends at 400 on 2 GPUs, Kueue-like at 352
    assert qr.score(got["fifo"])["gpu_utilization"] == pytest.approx(550 / 800)
    assert qr.score(got["kueue"])["gpu_utilization"] == pytest.approx(550 / 704)


def test_user_estimates_mislead_slurm_not_carpool_once_it_has_learned() -> None:
    """Jobs of one template take 100 s but their users say 1 h. Once one has finished,
    Carpool expects 100 s; Slurm plans with the hour."""
    nodes = qr.trace_nodes([("n1", 1, "T4")], 1.0)
    trace = [job("warm", 0, 100, 3600), job("x-1", 200, 100, 3600),
             job("x-2", 201, 100, 3600)]
    trace = [traces.TraceJob(t.key, t.project, t.job_class, t.request, t.arrival,
                             t.runtime_s, t.user_estimate_s, "x", False) for t in trace]
    quotas = qr.open_quotas(trace)
    carpool = qr.replay(trace, nodes, quotas, policies()["carpool"], "carpool")
    slurm = qr.replay(trace, nodes, quotas, policies()["slurm"], "slurm")
    assert carpool.records["a/x-2"].first_start == 300
    estimate = carpool.records["a/x-2"].arrival_estimate
    assert estimate is not None and estimate.start == pytest.approx(300)
    slurm_estimate = slurm.records["a/x-2"].arrival_estimate
    assert slurm_estimate is not None and slurm_estimate.start == 200 + 3600


def test_preempted_batch_job_resumes_where_it_stopped() -> None:
    """An interactive job preempts a borrowed... no: a lower-class preemptible job; the
    victim leaves after its 30 s grace and finishes its remaining run time later."""
    nodes = qr.trace_nodes([("n1", 1, "T4")], 1.0)
    trace = [job("batch", 0, 1000, 1000, preemptible=True),
             job("notebook", 100, 50, 50, cls=JobClass.INTERACTIVE)]
    outcome = qr.replay(trace, nodes, qr.open_quotas(trace), policies()["carpool"],
                        "carpool")
    assert outcome.preemptions == 1
    assert starts(outcome) == {"batch": 0, "notebook": 130}  # after the victim's grace
    # the batch job ran 0-130, then its remaining 870 s after the notebook (130-180)
    assert outcome.span_s == 180 + 870
    assert outcome.gpu_seconds == pytest.approx(130 + 50 + 870)


def test_fork_runs_on_without_later_arrivals_and_leaves_the_replay_alone() -> None:
    """One GPU. A runs 0-100; B (batch) arrives at 10 and waits for A; C (interactive,
    20 s) arrives at 50 and is served first: B starts at 120. In a fork made when B arrived
    with no arrivals after it, B starts at 100."""
    nodes = qr.trace_nodes([("n1", 1, "T4")], 1.0)
    trace = [job("A", 0, 100, 100), job("B", 10, 100, 100),
             job("C", 50, 20, 20, cls=JobClass.INTERACTIVE)]
    run = qr.Replay(trace, nodes, qr.open_quotas(trace), policies()["carpool"], "carpool")
    while run.state.now < 10:
        assert run.step()
    fork = run.fork(arrivals=False)
    while fork.step():
        pass
    while run.step():
        pass
    assert starts(fork.outcome()) == {"A": 0, "B": 100}
    assert starts(run.outcome()) == {"A": 0, "B": 120, "C": 100}
    assert run.records["a/B"].arrival_estimate == fork.records["a/B"].arrival_estimate


def test_score_definitions() -> None:
    """Relative error over jobs that waited >= 60 s, absolute below; refreshed separately;
    coverage of the ranges shown at arrival."""
    trace = {j.key: j for j in (job("a", 0, 10, 10), job("b", 0, 10, 10),
                                job("c", 0, 10, 10))}
    records = {
        "a/a": qr._Record(0, 100, qr.Estimate(150, 90, 160), [(20, 110), (95, 100)]),
        "a/b": qr._Record(0, 200, qr.Estimate(100, 50, 150)),
        "a/c": qr._Record(0, 30, qr.Estimate(40)),
    }
    outcome = qr.Outcome("x", records, trace, 10.0, 1, 100.0, 0, {}, 3)
    scores = qr.score(outcome)
    assert scores["eta_median_abs_rel_error"] == pytest.approx((0.5 + 0.5) / 2)
    assert scores["eta_interval_coverage"] == 0.5  # a's 100 in [90, 160]; b's 200 not
    assert scores["eta_short_wait_median_abs_error_s"] == 10  # c waited 30 s: |40 - 30|
    assert scores["eta_refreshed_samples"] == 1  # the one made 95 s ahead is too close
    assert scores["eta_refreshed_median_abs_rel_error"] == pytest.approx(10 / 80)
    assert scores["wait_p50_s"] == {"batch": 100}
    assert scores["eta_median_abs_rel_error_by_class"] == {"batch": pytest.approx(0.5)}


def test_first_estimate_errors_by_hand() -> None:
    """The in-cluster bench's measures, the same rule as the replay's: a job that waited
    exactly 60 s counts as waiting; signed > 0 means later than said; a first estimate
    without a range is not counted for coverage; no estimate, no error."""
    errors = qr.first_estimate_errors([
        (0, 60, qr.Estimate(90, 30, 120)),  # waited 60 s, said 90: -30/60, in range
        (10, 210, qr.Estimate(110)),  # waited 200 s, said 100 s: +100/200, no range
        (0, 300, qr.Estimate(200, 210, 280)),  # +100/300, outside its range
        (0, 100, None),  # waited, never shown an estimate
        (5, 20, qr.Estimate(50, 0, 60)),  # a short wait: |50 - 20| s
        (0, 10, None),
    ])
    assert errors["jobs_waited_60s"] == 4
    assert errors["jobs_waited_60s_with_estimate"] == 3
    assert errors["eta_median_abs_rel_error"] == pytest.approx(0.5)
    assert errors["eta_p90_abs_rel_error"] == pytest.approx(0.5)
    assert errors["eta_median_signed_rel_error"] == pytest.approx(1 / 3)
    assert errors["eta_ranged_jobs"] == 2
    assert errors["eta_interval_coverage"] == 0.5
    assert errors["eta_range_median_rel_width"] == pytest.approx((90 / 60 + 70 / 300) / 2)
    assert errors["eta_short_wait_jobs"] == 1
    assert errors["eta_short_wait_median_abs_error_s"] == 30
    empty = qr.first_estimate_errors([])
    assert empty["eta_median_abs_rel_error"] is None and empty["eta_interval_coverage"] is None
    assert empty["eta_range_median_rel_width"] is None


def test_every_job_must_start() -> None:
    nodes = qr.trace_nodes([("n1", 1, "T4")], 1.0)
    trace = [job("huge", 0, 10, 10, gpus=4)]
    with pytest.raises(ValueError, match="never started under fifo"):
        qr.replay(trace, nodes, qr.open_quotas(trace), policies()["fifo"], "fifo")


def test_generated_arrivals_can_be_spaced_to_an_offered_load() -> None:
    shapes = [traces.TraceRow("s", 0, 60, 1, 500, frozenset(), "BE", 0, 0),
              traces.TraceRow("w", 0, 60, 2, 1000, frozenset(), "LS", 0, 0)]
    for seed in (0, 1):
        rows = traces.parse_trace(traces.generate(shapes, 400, seed, 60.0, busy_gpus=8)).rows
        work = sum(r.num_gpu * r.gpu_milli / 1000 * r.runtime_s for r in rows)
        assert work / (rows[-1].arrival - rows[0].arrival) == pytest.approx(8, rel=0.02)
    with pytest.raises(ValueError, match="offered load"):
        traces.generate(shapes, 10, 0, 60.0, busy_gpus=0)


def test_offered_load_can_count_only_the_work_before_the_last_arrival() -> None:
    """Long runs hold much of a trace's work past its last arrival; counted only up to it,
    the load is what the cluster is offered while jobs arrive, so arrivals come closer."""
    shapes = [traces.TraceRow("s", 0, 60, 1, 1000, frozenset(), "BE", 0, 0)]
    for seed in (0, 1):
        text = traces.generate(shapes, 300, seed, 60.0, busy_gpus=8)
        windowed = traces.generate(shapes, 300, seed, 60.0, busy_gpus=8,
                                   load_by_last_arrival=True)
        rows = traces.parse_trace(windowed).rows
        jobs = [(r.arrival, r.num_gpu * r.gpu_milli / 1000, r.runtime_s) for r in rows]
        assert traces.offered_by_last_arrival(jobs) == pytest.approx(8, rel=0.02)
        spans = [(r[-1].arrival - r[0].arrival)
                 for r in (traces.parse_trace(t).rows for t in (text, windowed))]
        assert spans[1] < spans[0]
    assert traces.offered_by_last_arrival([(0, 1, 100), (10, 2, 5), (20, 1, 50)]) == \
        pytest.approx((20 + 10 + 0) / 20)
    with pytest.raises(ValueError, match="cannot keep 1000 GPUs busy"):
        traces.generate(shapes, 10, 0, 60.0, busy_gpus=1000, load_by_last_arrival=True)
