"""The replay's unused capacity (`queue_replay.IdleCapacity`): an owner's unused share lent to
a preemptible job and reclaimed when the owner's use rises; right-sized runs that outgrow
their size ended by the watchdog and run again as asked."""

from __future__ import annotations

from types import SimpleNamespace

from carpool.core.jobs import Job, RunRecord
from carpool.core.lending import LendingPolicy
from carpool.core.queueing import AdmissionConfig
from carpool.core.resources import GpuRequest, Isolation, JobClass
from carpool.replay import job_traces as traces
from carpool.replay import queue_replay as qr
from carpool.replay.usage_traces import RISE_FROM, Usage, usage
from carpool_testbed.builders import packing_placer

LENDING = LendingPolicy(observed_s=600)
NODES = qr.trace_nodes([("n1", 1, "T4")], 1.0)


def mps(name: str, arrival: float, run_s: float, cores: int, cls: JobClass,
        preemptible: bool, template: str = "") -> traces.TraceJob:
    request = GpuRequest(1, 0, cores, Isolation.MPS)
    return traces.TraceJob(f"p/{name}", "p", cls, request, arrival, run_s, run_s,
                           template or name, preemptible)


def run(jobs: list[traces.TraceJob], uses: dict[str, Usage], idle: qr.IdleCapacity
        ) -> qr.Outcome:
    policy = qr.carpool_policy(AdmissionConfig(node_placer=packing_placer,
                                               lending=idle.lending))
    replay = qr.Replay(jobs, NODES, qr.open_quotas(jobs), policy, "carpool", idle=idle)
    replay.usage = {f"p/{k}": u for k, u in uses.items()}
    while replay.step():
        pass
    return replay.outcome()


OWNER = mps("owner", 0, 7200, 80, JobClass.LONG, False)
SWEEP = mps("sweep", 100, 3000, 40, JobClass.BATCH, True)


def test_a_preemptible_job_runs_in_an_owners_unused_share_once_its_peak_is_known() -> None:
    uses = {"owner": Usage(0.4), "sweep": Usage(1.0)}
    off = run([OWNER, SWEEP], uses, qr.IdleCapacity())
    on = run([OWNER, SWEEP], uses, qr.IdleCapacity(lending=LENDING))
    assert off.records["p/sweep"].first_start == 7200  # 20 % left free: it waits
    assert on.records["p/sweep"].first_start == 600  # 80 - ceil(32 x 1.2) = 41 % lent
    scores = qr.score(on)
    assert scores["owner_reclaims"] == 0
    assert isinstance(lent := scores["lent_gpu_hours"], float) and lent > 0
    assert scores["owner_wait_p99_s"] == 0


def test_an_owner_of_a_calibrated_template_lends_from_its_start() -> None:
    history = [mps(f"o{i}", i * 10, 100, 80, JobClass.LONG, False, "o") for i in range(3)]
    owner = mps("o9", 1000, 7200, 80, JobClass.LONG, False, "o")
    sweep = mps("sweep", 1100, 3000, 40, JobClass.BATCH, True)
    uses = {f"o{i}": Usage(0.4) for i in range(3)} | {"o9": Usage(0.4), "sweep": Usage(1.0)}
    outcome = run([*history, owner, sweep], uses, qr.IdleCapacity(lending=LENDING))
    # three runs peaked at 32 %: 39 % kept with headroom, 41 % lent before 600 s of its own
    assert outcome.records["p/sweep"].first_start == 1100
    assert qr.score(outcome)["owner_reclaims"] == 0


def test_an_owner_whose_use_rises_gets_its_share_back_within_the_grace() -> None:
    uses = {"owner": Usage(0.9, rise_at=0.25), "sweep": Usage(1.0)}  # rises at 1800 s
    outcome = run([OWNER, SWEEP], uses, qr.IdleCapacity(lending=LENDING))
    assert outcome.records["p/sweep"].first_start == 600  # lent 80 - ceil(0.9 x 0.6 x 96)
    scores = qr.score(outcome)
    assert scores["owner_reclaims"] == 1
    assert scores["owner_reclaim_p99_s"] == 30.0  # its checkpoint grace
    assert RISE_FROM < 1


def test_a_reclaim_is_timed_from_a_rise_after_the_borrower_started_else_from_its_decision(
        ) -> None:
    borrower = Job("p/sweep", "p", JobClass.BATCH, GpuRequest(1, 0, 40, Isolation.MPS), 0.0,
                   3000.0, node="n1", runs=(RunRecord(1, 2000.0, None, 0.4, "n1"),))
    replay = SimpleNamespace(rose_at={"n1": 2300.0})
    assert qr.Replay._reclaim_cause_at(replay, borrower, 2330.0) == 2300.0
    # a rise before it started was in the lending it was placed by: the need came now (an
    # owner's calibrated size grew), and nothing waited before this cycle
    replay.rose_at = {"n1": 760.0}
    assert qr.Replay._reclaim_cause_at(replay, borrower, 2330.0) == 2330.0
    replay.rose_at = {}
    assert qr.Replay._reclaim_cause_at(replay, borrower, 2330.0) == 2330.0


def test_a_right_sized_run_that_outgrows_its_size_runs_again_as_asked() -> None:
    history = [mps(f"t{i}", i * 10, 300, 50, JobClass.BATCH, True, "t") for i in range(3)]
    late = mps("t9", 5000, 600, 50, JobClass.BATCH, True, "t")
    jobs = [*history, late]
    uses = {f"t{i}": Usage(0.2) for i in range(3)} | {"t9": Usage(0.9)}
    outcome = run(jobs, uses, qr.IdleCapacity(right_sizing=True))
    assert qr.score(outcome)["right_sized_runs_outgrown"] == 1  # placed at 12 %, peaked at 45
    assert outcome.records["p/t9"].first_start == 5000
    assert outcome.gpu_hours_by_project["p"] > 0


def test_usage_is_drawn_per_template_and_run() -> None:
    a, b = usage("s:p:train", "s:p/train-1"), usage("s:p:train", "s:p/train-2")
    assert 0.05 <= a.peak <= 1 and abs(a.peak / b.peak - 1) < 0.6
    assert usage("s:p:train", "s:p/train-1") == a


def test_a_rise_counts_at_its_own_instant_whatever_the_float_rounding() -> None:
    use = Usage(0.9, rise_at=0.5560223749155836)  # (4374 + 1653.05...) - 4374 < 1653.05...
    start, run_s = 4374.0, 2973.0
    at = start + use.rise_after(0.0, run_s)  # type: ignore[operator]
    assert use.used(at - start, run_s) == 0.9


def _notebook_and_sweep() -> tuple[traces.TraceJob, traces.TraceJob, dict[str, Usage]]:
    """A notebook session (active its first 2000 s, then idle) and a sweep arriving at 100 s
    for its one GPU."""
    session = traces.TraceJob("p/notebook", "p", JobClass.INTERACTIVE,
                              GpuRequest(1, 0, 100, Isolation.EXCLUSIVE), 0, 20_000, 7200,
                              "notebook", False)
    batch = mps("sweep", 100, 3000, 60, JobClass.BATCH, True)
    return session, batch, {"notebook": Usage(0.5, idle_from=0.1), "sweep": Usage(1.0)}


def test_an_idle_session_is_stopped_by_the_operators_rule_and_its_gpu_goes_to_work() -> None:
    session, batch, uses = _notebook_and_sweep()
    kept = run([session, batch], uses, qr.IdleCapacity())
    stopped = run([session, batch], uses, qr.IdleCapacity(idle_timeout_s=1800))
    assert kept.records["p/sweep"].first_start == 20_000
    assert stopped.records["p/sweep"].first_start == 2000 + 1800 + 30  # timeout, then grace
    assert qr.score(stopped)["idle_sessions_stopped"] == 1
    assert qr.score(kept)["idle_sessions_stopped"] == 0
    # an idle session does no work: 2000 s of the notebook's, then the sweep's
    assert qr.score(stopped)["work_gpu_hours_by_last_arrival"] == 100 / 3600  # last arrival
    assert kept.idle is not None and stopped.idle is not None
    assert [(s, e) for s, e, _ in kept.idle.work_runs] == [(0, 2000), (20_000, 23_000)]
    assert [(s, e) for s, e, _ in stopped.idle.work_runs] == [(0, 2000), (3830, 6830)]


def test_an_idle_session_yields_sooner_while_a_job_waits_for_its_gpu() -> None:
    session, batch, uses = _notebook_and_sweep()
    both = qr.IdleCapacity(idle_timeout_s=1800, idle_yield_after_s=600)
    assert run([session, batch], uses, both).records["p/sweep"].first_start == 2000 + 600 + 30
    # alone, nothing waits for its GPU: the session sits until the timeout
    alone = run([session], uses, both)
    assert qr.score(alone)["idle_sessions_stopped"] == 1
    assert alone.span_s == 2000 + 1800 + 30


def test_a_whole_gpu_owner_lends_its_unused_share_where_whole_gpus_lend() -> None:
    owner = traces.TraceJob("p/train", "p", JobClass.LONG,
                            GpuRequest(1, 0, 100, Isolation.EXCLUSIVE), 0, 7200, 7200,
                            "train", False)
    uses = {"train": Usage(0.4), "sweep": Usage(1.0)}
    shared = run([owner, SWEEP], uses, qr.IdleCapacity(lending=LENDING))
    whole = run([owner, SWEEP], uses,
                qr.IdleCapacity(lending=LendingPolicy(observed_s=600, whole_gpus=True)))
    assert shared.records["p/sweep"].first_start == 7200
    assert whole.records["p/sweep"].first_start == 600  # 100 - ceil(40 x 1.2) = 52 % lent


def test_only_interactive_sessions_go_idle() -> None:
    session = usage("s:p:nb", "s:p/nb-1", interactive=True)
    assert session.idle_from is not None and 0.1 <= session.idle_from <= 0.5
    assert session.active_s(1000) == session.idle_from * 1000
    assert usage("s:p:nb", "s:p/nb-1").idle_from is None


def whole(name: str, arrival: float, run_s: float, template: str) -> traces.TraceJob:
    return traces.TraceJob(f"p/{name}", "p", JobClass.BATCH,
                           GpuRequest(1, 0, 100, Isolation.EXCLUSIVE), arrival, run_s, run_s,
                           template, True)


def test_whole_gpu_runs_of_a_calibrated_template_share_a_gpu_where_whole_gpus_are_shared(
        ) -> None:
    history = [whole(f"w{i}", i * 100, 50, "w") for i in range(3)]
    late = [whole("w8", 1000, 3000, "w"), whole("w9", 1000, 3000, "w")]
    uses = {f"w{i}": Usage(0.3) for i in (0, 1, 2, 8, 9)}
    sized = run([*history, *late], uses, qr.IdleCapacity(right_sizing=True))
    shared = run([*history, *late], uses,
                 qr.IdleCapacity(right_sizing=True, share_whole_gpus=True))
    assert sized.records["p/w9"].first_start == 4000  # one at a time on the one GPU
    # placed at ceil(30 x 1.2) = 36 % of the GPU each: both at once
    assert shared.records["p/w9"].first_start == 1000
    assert qr.score(shared)["right_sized_runs_outgrown"] == 0
