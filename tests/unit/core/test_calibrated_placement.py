"""Preemptible jobs placed by their template's calibrated size where their project says so
(`core.right_sizing.placement_request`), into a smaller piece down to their template's peak
where no GPU holds that size (`placement_floor`), the extender's check of a pod placed below
its spec (`core.ownership.calibrated_mismatch`), and the fence: a run so placed that fails
runs again as asked (`core.lifecycle.observe`)."""

from __future__ import annotations

from dataclasses import replace

from carpool.core.assignment import AssignedGpu, Assignment
from carpool.core.decoding import quota_from_object
from carpool.core.job_status import shared_whole_gpu_status
from carpool.core.jobs import ClusterSnapshot, RunRecord
from carpool.core.lifecycle import OUTGREW_CALIBRATION, PodView, grants_from_status, observe
from carpool.core.ownership import GpuLimits, calibrated_mismatch, grant_mismatch
from carpool.core.placement import NodeState
from carpool.core.queueing import admission_cycle
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
    Phase,
)
from carpool.core.right_sizing import (
    placement_floor,
    placement_request,
    pod_request,
    smallest_gpus,
    with_calibrated,
)
from carpool_testbed.builders import gpu_job, project_quota

GIB = 1024
NOW = 1_800_000_000.0
PLACES = project_quota("a", place_calibrated=True)


def sweep(key: str = "a/sweep-9", **fields: object) -> object:
    return gpu_job(key, "a", JobClass.BATCH, memory_gib=40, exclusive=False, preemptible=True,
                   template="sweep", **fields)


def finished(i: int, peak_gib: int) -> object:
    return sweep(f"a/sweep-{i}", phase=Phase.SUCCEEDED, peak_memory_mib=peak_gib * GIB)


def test_a_waiting_preemptible_job_is_placed_by_its_calibrated_size_where_its_project_says(
        ) -> None:
    job = sweep()
    calibrated = placement_request(job, PLACES, 12 * GIB, None)  # type: ignore[arg-type]
    assert (calibrated.memory_mib, calibrated.cores_pct) == (12 * GIB, 0)
    assert placement_request(job, project_quota("a"), 12 * GIB, None) == job.request  # type: ignore[arg-type]
    for other in (replace(job, preemptible=False), replace(job, calibration_outgrown=True),  # type: ignore[type-var]
                  replace(job, phase=Phase.RUNNING)):  # type: ignore[type-var]
        assert placement_request(other, PLACES, 12 * GIB, None) == other.request
    assert placement_request(job, PLACES, 60 * GIB, None) == job.request  # type: ignore[arg-type]


def test_the_calibration_comes_from_the_templates_finished_runs() -> None:
    jobs = [finished(1, 8), finished(2, 9), finished(3, 10), sweep()]
    placed = with_calibrated(jobs, {"a": PLACES})  # type: ignore[arg-type]
    assert placed[-1].request.memory_mib == 12 * GIB  # 10 GiB x 1.2, in whole GiB
    assert with_calibrated(jobs, {"a": project_quota("a")}) == jobs  # type: ignore[arg-type]
    assert with_calibrated(jobs[1:], {"a": PLACES})[-1] == jobs[-1]  # two runs say nothing


def test_the_placement_floor_is_the_peak_the_calibration_was_made_from() -> None:
    asked = GpuRequest(1, 40 * GIB, 0, Isolation.MPS)
    placed = replace(asked, memory_mib=12 * GIB)  # a 10 GiB peak with a fifth more
    floor = placement_floor(placed, asked)
    assert floor is not None and (floor.memory_mib, floor.cores_pct) == (10 * GIB, 0)
    assert placement_floor(asked, asked) is None  # placed as asked: no floor
    by_cores = GpuRequest(1, 0, 81, Isolation.MPS)  # the replay's shares: cores
    floor = placement_floor(replace(by_cores, cores_pct=54), by_cores)
    assert floor is not None and floor.cores_pct == 45
    whole = GpuRequest(1, 0, 100, Isolation.EXCLUSIVE)
    floor = placement_floor(GpuRequest(1, 24 * GIB, 0, Isolation.MPS), whole)
    assert floor is not None and floor.memory_mib == 20 * GIB
    assert placement_floor(GpuRequest(1, GIB, 0, Isolation.MPS), asked) is None  # 1 GiB least
    jobs = [finished(1, 8), finished(2, 9), finished(3, 10), sweep()]
    placed_job = with_calibrated(jobs, {"a": PLACES})[-1]  # type: ignore[arg-type]
    assert placed_job.placement_floor is not None
    assert placed_job.placement_floor.memory_mib == 10 * GIB


def _cycle_with_piece(piece_gib: int) -> tuple[GpuGrant, ...]:
    """The grants of the calibrated sweep (12 GiB, floor 10 GiB) admitted beside an owner
    that leaves `piece_gib` of an 80 GiB GPU free; () if it waits."""
    node = NodeInventory("n1", (Gpu(0, "g0", "H100", 80 * GIB),))
    owner = gpu_job("a/train", "a", JobClass.LONG, memory_gib=80 - piece_gib, exclusive=False,
                    phase=Phase.RUNNING, attempts=1, node="n1",
                    grants=(GpuGrant("g0", (80 - piece_gib) * GIB, 0),),
                    runs=(RunRecord(1, NOW - 60, None, 1.0, "n1"),))
    jobs = with_calibrated([finished(1, 8), finished(2, 9), finished(3, 10), owner,  # type: ignore[list-item]
                            sweep(submitted=NOW - 30)], {"a": PLACES})
    result = admission_cycle(ClusterSnapshot(NOW, tuple(jobs), {"a": PLACES},
                                             {"n1": NodeState(node)}))
    return next((a.grants for a in result.admissions if a.job_key == "a/sweep-9"), ())


def test_where_no_gpu_holds_its_calibrated_size_it_takes_a_piece_that_holds_its_peak() -> None:
    assert [g.memory_mib // GIB for g in _cycle_with_piece(20)] == [12]  # its calibrated size
    assert [g.memory_mib // GIB for g in _cycle_with_piece(11)] == [11]  # the whole piece
    assert [g.memory_mib // GIB for g in _cycle_with_piece(10)] == [10]  # its peak
    assert _cycle_with_piece(9) == ()  # below its template's peak: it waits


def test_the_pod_asks_for_what_its_admission_granted_below_the_spec() -> None:
    asked = GpuRequest(1, 40 * GIB, 0, Isolation.MPS)
    assert pod_request(asked, (GpuGrant("g0", 12 * GIB, 0),)).memory_mib == 12 * GIB
    assert pod_request(asked, (GpuGrant("g0", 40 * GIB, 0),)) == asked
    whole = GpuRequest(1, 0, 100, Isolation.EXCLUSIVE)
    assert pod_request(whole, (GpuGrant("g0", 80 * GIB, 100, exclusive=True),)) == whole


def planned(memory_gib: int) -> Assignment:
    return Assignment("n1", (AssignedGpu("g0", 0, memory_gib * GIB, 0, container="main"),),
                      Isolation.MPS)


def test_the_extender_accepts_a_pod_below_its_spec_only_as_the_operator_planned_it() -> None:
    spec = GpuRequest(1, 40 * GIB, 0, Isolation.MPS)
    pod = [("main", GpuRequest(1, 12 * GIB, 0, Isolation.MPS))]
    assert grant_mismatch(spec, pod) != ""  # not what the spec asks
    assert calibrated_mismatch(spec, pod, planned(12)) == ""
    assert "no planned assignment" in calibrated_mismatch(spec, pod, None)
    assert "does not grant" in calibrated_mismatch(spec, pod, planned(16))
    above = [("main", GpuRequest(1, 48 * GIB, 0, Isolation.MPS))]
    assert calibrated_mismatch(spec, above, planned(48)) != ""  # never above the spec
    two = [("main", GpuRequest(2, 12 * GIB, 0, Isolation.MPS))]
    assert calibrated_mismatch(spec, two, planned(12)) != ""
    timeslice = GpuRequest(1, 40 * GIB, 0, Isolation.TIMESLICE)
    sliced = [("main", replace(pod[0][1], isolation=Isolation.TIMESLICE))]
    assert calibrated_mismatch(timeslice, sliced, planned(12)) != ""


def failed_pod(memory_gib: int) -> PodView:
    return PodView(name="sweep-9-1", namespace="a", attempt=1, phase="Failed", node="n1",
                   assignment=planned(memory_gib), started=NOW - 600, finished=NOW - 5,
                   deleting=False, exit_reason="Error", uid="pod-1", gpu_pod=True,
                   limits=(GpuLimits("main", 1, memory_gib, 0),))


def test_a_run_placed_below_its_spec_that_fails_runs_again_as_asked() -> None:
    job = {"metadata": {"name": "sweep-9", "namespace": "a"},
           "spec": {"gpu": {"isolation": "mps", "memory": "40Gi"}},
           "status": {"phase": "Running", "attempts": 1}}
    seen = observe(job, [failed_pod(12)], {"g0": 80 * GIB}, NOW)
    assert seen.phase is Phase.QUEUED
    assert seen.status["calibrationOutgrown"] is True
    assert seen.status["reason"] == OUTGREW_CALIBRATION
    assert "placed at 12 GiB per GPU" in seen.status["message"]
    assert seen.status["history"][-1]["outcome"] == OUTGREW_CALIBRATION
    queued = dict(job, status=dict(job["status"], phase="Queued", calibrationOutgrown=True))
    assert observe(queued, [failed_pod(12)], {"g0": 80 * GIB}, NOW).status == {}
    # a run placed as asked that fails fails
    assert observe(job, [failed_pod(40)], {"g0": 80 * GIB}, NOW).phase is Phase.FAILED


# --- whole-GPU jobs placed as MPS shares (spec.rightSizing.shareWholeGpus) -----------------

SHARES = project_quota("a", place_calibrated=True, share_whole_gpus=True)


def whole_sweep(key: str = "a/whole-9", **fields: object) -> object:
    return gpu_job(key, "a", JobClass.BATCH, memory_gib=40, exclusive=True,
                   preemptible=True, template="whole", **fields)


def test_a_whole_gpu_job_is_an_mps_share_of_its_calibrated_size_where_its_project_says(
        ) -> None:
    job = whole_sweep()
    assert job.request.isolation is Isolation.EXCLUSIVE  # type: ignore[attr-defined]
    shared = placement_request(job, SHARES, 12 * GIB, None, 80 * GIB)  # type: ignore[arg-type]
    assert (shared.isolation, shared.count, shared.memory_mib, shared.cores_pct) == (
        Isolation.MPS, 1, 12 * GIB, 0)
    # the replay measures shares of the GPU (cores) only
    by_cores = placement_request(job, SHARES, None, 40)  # type: ignore[arg-type]
    assert (by_cores.isolation, by_cores.memory_mib, by_cores.cores_pct) == (
        Isolation.MPS, 0, 40)
    # near a whole GPU it would give up the GPU for nothing: it stays whole
    assert placement_request(job, SHARES, None, 75).cores_pct == 75  # type: ignore[arg-type]
    assert placement_request(job, SHARES, None, 76) == job.request  # type: ignore[arg-type]
    assert placement_request(job, SHARES, 24 * GIB, None, 24 * GIB) == job.request  # type: ignore[arg-type]
    assert placement_request(job, SHARES, 12 * GIB, None) == job.request  # type: ignore[arg-type]
    # not below the GPU memory it names: it stays whole
    assert placement_request(job, SHARES, 40 * GIB, None, 80 * GIB) == job.request  # type: ignore[arg-type]
    assert placement_request(job, PLACES, 12 * GIB, None, 80 * GIB) == job.request  # type: ignore[arg-type]
    for other in (replace(job, preemptible=False), replace(job, calibration_outgrown=True),  # type: ignore[type-var]
                  replace(job, request=replace(job.request, count=2))):  # type: ignore[attr-defined]
        assert placement_request(other, SHARES, 12 * GIB, None, 80 * GIB) == other.request


def test_a_whole_gpu_job_is_shared_by_the_smallest_gpu_it_may_get() -> None:
    gpus = [Gpu(0, "g0", "A100", 81920), Gpu(1, "g1", "A100", 40960), Gpu(2, "g2", "T4", 15360)]
    smallest = smallest_gpus(gpus)
    assert smallest == {"A100": 40960, "T4": 15360}
    runs = [whole_sweep(f"a/whole-{i}", phase=Phase.SUCCEEDED, peak_memory_mib=20 * GIB)
            for i in range(3)]
    waiting = whole_sweep()
    placed = with_calibrated([*runs, waiting], {"a": SHARES}, None, smallest)[-1]  # type: ignore[list-item]
    assert placed.request == waiting.request  # 24 GiB is more than 3/4 of a T4
    a100 = replace(waiting, request=replace(waiting.request, models=frozenset({"A100"})))  # type: ignore[type-var, attr-defined]
    placed = with_calibrated([*runs, a100], {"a": SHARES}, None, smallest)[-1]  # type: ignore[list-item]
    assert (placed.request.isolation, placed.request.memory_mib) == (Isolation.MPS, 24 * GIB)


def test_a_shared_whole_gpu_jobs_pod_is_the_mps_client_of_its_grant() -> None:
    whole = GpuRequest(1, 0, 100, Isolation.EXCLUSIVE)
    pod = pod_request(whole, (GpuGrant("g0", 12 * GIB, 0),))
    assert (pod.isolation, pod.memory_mib, pod.cores_pct) == (Isolation.MPS, 12 * GIB, 0)
    assert pod_request(whole, (GpuGrant("g0", 80 * GIB, 100, exclusive=True),)) == whole


def test_the_extender_accepts_a_whole_gpu_jobs_share_only_as_the_operator_planned_it(
        ) -> None:
    spec = GpuRequest(1, 0, 100, Isolation.EXCLUSIVE)
    pod = [("main", GpuRequest(1, 12 * GIB, 0, Isolation.MPS))]
    assert grant_mismatch(spec, pod) != ""
    assert calibrated_mismatch(spec, pod, planned(12)) == ""
    assert "does not grant" in calibrated_mismatch(spec, pod, planned(16))
    assert calibrated_mismatch(spec, pod, replace(planned(12), isolation=Isolation.EXCLUSIVE))
    assert calibrated_mismatch(spec, [("main", replace(pod[0][1], memory_mib=0))], planned(0))
    assert calibrated_mismatch(replace(spec, count=2), pod, planned(12)) != ""


def test_a_shared_whole_gpu_job_holds_its_share_and_fails_back_to_a_whole_gpu() -> None:
    # the assignment the extender recorded (MPS) wins over the whole-GPU spec
    grants = planned(12).grants(exclusive=True)
    assert [(g.memory_mib, g.exclusive) for g in grants] == [(12 * GIB, False)]
    assert Assignment("n1", planned(12).gpus).grants(exclusive=True)[0].exclusive
    job = {"metadata": {"name": "whole-9", "namespace": "a"},
           "spec": {"gpu": {"isolation": "exclusive"}},
           "status": {"phase": "Running", "attempts": 1}}
    seen = observe(job, [failed_pod(12)], {"g0": 80 * GIB}, NOW)
    assert seen.phase is Phase.QUEUED
    assert seen.status["calibrationOutgrown"] is True
    assert "below the whole GPU it asks for" in seen.status["message"]
    # a whole-GPU run (its assignment exclusive) that fails fails
    whole = replace(failed_pod(12), assignment=replace(planned(12),
                                                       isolation=Isolation.EXCLUSIVE))
    assert observe(job, [whole], {"g0": 80 * GIB}, NOW).phase is Phase.FAILED


def test_the_projectquota_settings_decode() -> None:
    quota = quota_from_object({"metadata": {"name": "a"}, "spec": {
        "rightSizing": {"placePreemptible": True, "shareWholeGpus": True}}})
    assert (quota.place_calibrated, quota.share_whole_gpus) == (True, True)
    plain = quota_from_object({"metadata": {"name": "a"}, "spec": {}})
    assert (plain.place_calibrated, plain.share_whole_gpus) == (False, False)


def test_before_its_pod_is_bound_a_shared_whole_gpu_job_holds_its_share() -> None:
    spec = GpuRequest(1, 0, 100, Isolation.EXCLUSIVE)
    share = GpuRequest(1, 12 * GIB, 0, Isolation.MPS)
    gpus = [{"uuid": "g0", "index": 0, "memoryMiB": 12 * GIB, "cores": 0}]
    marked = shared_whole_gpu_status(gpus, spec, share)
    assert marked == [{**gpus[0], "exclusive": False}]
    (grant,) = grants_from_status(marked, exclusive=True)
    assert (grant.memory_mib, grant.exclusive) == (12 * GIB, False)
    assert grants_from_status(gpus, exclusive=True)[0].exclusive  # unmarked: the whole GPU
    assert shared_whole_gpu_status(gpus, spec, spec) == gpus
    assert shared_whole_gpu_status(gpus, share, share) == gpus
