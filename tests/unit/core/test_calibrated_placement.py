"""Preemptible jobs placed by their template's calibrated size where their project says so
(`core.right_sizing.placement_request`), the extender's check of a pod placed below its spec
(`core.ownership.calibrated_mismatch`), and the fence: a run so placed that fails runs again
as asked (`core.lifecycle.observe`)."""

from __future__ import annotations

from dataclasses import replace

from carpool.core.assignment import AssignedGpu, Assignment
from carpool.core.lifecycle import OUTGREW_CALIBRATION, PodView, observe
from carpool.core.ownership import GpuLimits, calibrated_mismatch, grant_mismatch
from carpool.core.resources import GpuGrant, GpuRequest, Isolation, JobClass, Phase
from carpool.core.right_sizing import placement_request, pod_request, with_calibrated
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
