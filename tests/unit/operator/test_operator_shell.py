"""The operator's pure shell helpers: pod manifests, decoding, state derived from pods."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from carpool.core import names
from carpool.core.assignment import AssignedGpu, Assignment
from carpool.core.decoding import gpu_request_from_spec, job_from_object, quota_from_object
from carpool.core.jobs import ClusterSnapshot, ProjectQuota
from carpool.core.lifecycle import (
    admission_to_start_s,
    assignment_fraction,
    grants_from_assignment,
    history_gpu_hours,
    job_conditions,
    observe,
    requeue_not_before,
)
from carpool.core.queueing import CycleResult, WaitReason, admission_cycle
from carpool.core.resources import Gpu, GpuGrant, Isolation, JobClass, NodeInventory, Phase
from carpool.core.right_sizing import pod_request
from carpool.core.timestamps import epoch_seconds
from carpool.operator.observe import Observer, PassState, _attempt_pods, job_identity
from carpool.operator.pod_view import view_pod
from carpool.operator.pods import build_pod, pod_name
from carpool_testbed.builders import gpu_node

UUID = "GPU-aaaa"


def _job(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    base = {
        "project": "vision", "class": "short",
        "gpu": {"count": 1, "memory": "20Gi", "cores": 50, "isolation": "mps"},
        "estimatedDuration": "10m", "maxDuration": "1h", "simulatedDuration": "30s",
        "checkpoint": {"gracePeriod": "45s"},
        "dataset": {"name": "imagenet", "size": "150Gi"},
        "template": {"metadata": {"labels": {"app": "x"}},
                     "spec": {"containers": [{"name": "main", "image": "img"}]}},
    }
    base.update(spec)
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": "train", "namespace": "team", "uid": "u-1",
                         "creationTimestamp": "2026-11-29T10:00:00Z"},
            "spec": base, "status": status or {}}


def _pod(attempt: int, phase: str, *, started: str | None = None, finished: str | None = None,
         node: str = "n1", deleting: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if phase == "Running":
        state = {"running": {"startedAt": started}}
    elif phase in ("Succeeded", "Failed"):
        state = {"terminated": {"startedAt": started, "finishedAt": finished,
                                "reason": "Completed" if phase == "Succeeded" else "Error"}}
    meta: dict[str, Any] = {
        "name": f"train-{attempt}", "namespace": "team",
        "annotations": {names.ANN_ASSIGNMENT: json.dumps(
            {"node": node, "gpus": [{"uuid": UUID, "index": 0, "memoryMiB": 20480,
                                     "cores": 50}]})}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T11:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node},
            "status": {"phase": phase, "startTime": started,
                       "containerStatuses": [{"state": state}] if state else []}}


def test_pod_carries_resources_annotations_and_owner() -> None:
    job = _job()
    pod = build_pod(job, gpu_request_from_spec(job["spec"]), attempt=2)
    assert pod["metadata"]["name"] == "train-2"
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: "20",
                      names.RESOURCE_GPU_CORES: "50"}
    assert pod["spec"]["schedulerName"] == names.SCHEDULER_NAME
    assert pod["spec"]["priorityClassName"] == names.PRIORITY_CLASS
    assert pod["spec"]["terminationGracePeriodSeconds"] == 45
    assert pod["spec"]["activeDeadlineSeconds"] == 3600
    assert pod["metadata"]["annotations"][names.ANN_SIM_DURATION] == "30"
    assert pod["metadata"]["annotations"][names.ANN_DATASET_SIZE] == "150"
    assert pod["metadata"]["annotations"][names.ANN_JOB_UID] == "u-1"
    assert pod["metadata"]["finalizers"] == [names.FINALIZER]
    assert pod["metadata"]["labels"]["app"] == "x"
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "GpuJob" and owner["uid"] == "u-1" and owner["controller"]


def test_long_job_names_stay_valid_and_distinct() -> None:
    a, b = pod_name("x" * 70, 1), pod_name("x" * 69 + "y", 1)
    assert len(a) <= 63 and len(b) <= 63 and a != b and a.endswith("-1")


def test_decoding_reports_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec.gpu.memory"):
        gpu_request_from_spec({"gpu": {"count": 1, "memory": "lots"}})
    request = gpu_request_from_spec({"gpu": {"count": 2, "memory": "16Gi", "isolation": "mig",
                                             "migProfile": "2g.35gb", "models": ["H200"]}})
    assert (request.count, request.memory_mib, request.isolation, request.mig_slices) == (
        2, 16384, Isolation.MIG, 2)


def test_job_and_quota_decoding() -> None:
    job = job_from_object(_job(), Phase.QUEUED, 0, (), "", [])
    assert job.key == "team/train" and job.job_class is JobClass.SHORT
    assert job.estimated_duration_s == 600 and job.checkpoint_grace_s == 45
    quota = quota_from_object({"metadata": {"name": "vision",
                                            "creationTimestamp": "2026-11-01T00:00:00Z"},
                               "spec": {"namespaces": ["team"], "concurrent": {"gpus": 4},
                                        "gpuHours": {"budget": 100, "period": "7d"}}})
    assert quota.guaranteed_gpus == 4 and quota.budget_gpu_hours == 100
    assert quota.period_s == 7 * 86400


def test_phases_follow_the_pod() -> None:
    job = _job({"phase": "Admitted", "attempts": 1})
    running = observe(job, [view_pod(_pod(1, "Running", started="2026-11-29T10:00:00Z"))],
                      {UUID: 143771}, now=0)
    assert running.phase is Phase.RUNNING
    assert running.status["startTime"] == "2026-11-29T10:00:00Z"
    assert running.status["history"][0]["fraction"] == pytest.approx(0.5)
    done = observe(_job({"phase": "Running", "attempts": 1, "history": running.status["history"]}),
                   [view_pod(_pod(1, "Succeeded", started="2026-11-29T10:00:00Z",
                                  finished="2026-11-29T12:00:00Z"))], {UUID: 143771}, now=0)
    assert done.phase is Phase.SUCCEEDED
    # 2 hours at half a GPU (cores 50% > memory 20/140 GiB).
    assert history_gpu_hours(done.status["history"], now=0) == pytest.approx(1.0)
    again = observe(_job({"phase": "Succeeded", "attempts": 1, "history": done.status["history"]}),
                    [], {}, now=0)
    assert again.status == {}  # finished jobs are never touched again


def test_a_bound_jobs_gpus_keep_the_model_its_admission_named() -> None:
    job = _job({"phase": "Admitted", "attempts": 1,
                "gpus": [{"uuid": UUID, "index": 0, "model": "H200", "memoryMiB": 20480}]})
    pods = [view_pod(_pod(1, "Running", started="2026-11-29T10:00:00Z"))]
    running = observe(job, pods, {UUID: 143771}, now=0, gpu_models={UUID: "H200"})
    assert running.status["gpus"] == [{"uuid": UUID, "index": 0, "model": "H200",
                                       "memoryMiB": 20480, "cores": 50}]
    # a GPU no node lists any more: the assignment as it is, without a model
    gone = observe(job, pods, {UUID: 143771}, now=0, gpu_models={})
    assert "model" not in gone.status["gpus"][0]


def test_preempted_pod_gone_requeues_with_attempts_kept() -> None:
    job = _job({"phase": "Preempted", "attempts": 1, "preemptingAttempt": 1,
                "history": [{"attempt": 1, "start": "2026-11-29T10:00:00Z", "fraction": 1}]})
    obs = observe(job, [], {}, now=1_800_000_000)
    assert obs.phase is Phase.QUEUED
    assert obs.status["attempts"] == 1
    assert obs.status["history"][0]["outcome"] == "Preempted"
    assert obs.status["history"][0]["end"]


def test_a_pod_created_before_a_crash_is_adopted() -> None:
    """The operator died between creating attempt 1's pod and writing attempts=1."""
    job = _job({"phase": "Queued", "attempts": 0})
    obs = observe(job, [view_pod(_pod(1, "Pending"))], {}, now=0)
    assert obs.phase is Phase.ADMITTED and obs.attempts == 1


def test_an_adopted_pod_stays_the_attempt_once_the_job_left_the_queue() -> None:
    """The operator died between creating attempt 1's pod and writing its status; the next
    one adopts the pod by name and writes Running. That status must still link the pod, or
    the pass after takes the attempt as lost and runs a job that finished a second time."""
    job = _job({"phase": "Queued", "attempts": 0})

    def linked(pod: dict[str, Any]) -> list[Any]:
        pod["metadata"].update(uid="p-1", ownerReferences=[{
            "apiVersion": names.API_VERSION, "kind": "GpuJob", "name": "train", "uid": "u-1",
            "controller": True}])
        view = view_pod(pod)
        return [replace(view, attempt=link.attempt) for view, link in _attempt_pods(
            job_identity(job), {view.uid: (view, "1")}, {f"team/{view.name}": view.uid})]

    running = observe(job, linked(_pod(1, "Running", started="2026-11-29T10:00:00Z")),
                      {UUID: 143771}, now=1_800_000_000)
    assert running.phase is Phase.RUNNING
    job["status"].update(running.status)
    pods = linked(_pod(1, "Succeeded", started="2026-11-29T10:00:00Z",
                       finished="2026-11-29T10:01:00Z"))
    done = observe(job, pods, {UUID: 143771}, now=1_800_000_000)
    assert done.phase is Phase.SUCCEEDED and done.attempts == 1, done.status.get("reason")
    assert job["status"]["podUID"] == "p-1" and job["status"]["podName"] == "train-1"
    assert "podUID" not in done.status  # recorded already


def test_exclusive_assignments_hold_whole_gpus() -> None:
    """The extender's assignment has no exclusive flag; the job's isolation supplies it."""
    assignment = Assignment("n1", (AssignedGpu(UUID, 0, 10240, 0),))
    (shared,) = grants_from_assignment(assignment)
    (whole,) = grants_from_assignment(assignment, exclusive=True)
    assert not shared.exclusive and whole.exclusive and whole.cores_pct == 100
    assert assignment_fraction(assignment, {UUID: 81920}) == pytest.approx(0.125)
    assert assignment_fraction(assignment, {UUID: 81920}, exclusive=True) == 1.0
    mig = Assignment("n1", (AssignedGpu(UUID, 0, 18000, 0, mig_instance="MIG-1"),))
    assert assignment_fraction(mig, {UUID: 143771}, mig_slices={"MIG-1": 2}) \
        == pytest.approx(2 / 7)


def test_a_whole_gpu_job_placed_as_a_share_is_an_mps_pod_billed_by_its_share() -> None:
    """rightSizing.shareWholeGpus: the admission granted a whole-GPU job 10 GiB of a GPU."""
    job = _job(gpu={"count": 1, "isolation": "exclusive"})
    spec = gpu_request_from_spec(job["spec"])
    request = pod_request(spec, (GpuGrant(UUID, 10240, 0),))
    pod = build_pod(job, request, attempt=1)
    assert pod["metadata"]["annotations"][names.ANN_ISOLATION] == "mps"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {
        names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: "10"}
    # the extender records MPS in the assignment: that wins over the whole-GPU spec
    shared = Assignment("n1", (AssignedGpu(UUID, 0, 10240, 0),), Isolation.MPS)
    (grant,) = grants_from_assignment(shared, exclusive=True)
    assert not grant.exclusive and grant.memory_mib == 10240
    assert assignment_fraction(shared, {UUID: 81920}, exclusive=True) == pytest.approx(0.125)


def test_finished_job_gets_gpu_hours_and_a_start_even_if_never_seen_running() -> None:
    job = _job({"phase": "Admitted", "attempts": 1})
    done = observe(job, [view_pod(_pod(1, "Succeeded", started="2026-11-29T10:00:00Z",
                                       finished="2026-11-29T11:00:00Z"))], {UUID: 143771}, now=0)
    assert done.status["startTime"] == "2026-11-29T10:00:00Z"
    assert done.status["gpuHours"] == pytest.approx(0.5)


def test_a_container_stamped_as_finished_before_it_started_ran_no_time() -> None:
    job = _job({"phase": "Admitted", "attempts": 1})
    pod = view_pod(_pod(1, "Succeeded", started="2026-11-29T10:00:01Z",
                        finished="2026-11-29T10:00:00Z"))
    assert pod.finished == pod.started
    done = observe(job, [pod], {UUID: 143771}, now=0)
    (run,) = done.status["history"]
    assert run["start"] == run["end"] == "2026-11-29T10:00:01Z"
    assert done.status["gpuHours"] == 0


def test_kubelet_deadline_reads_as_max_duration_exceeded() -> None:
    pod = _pod(1, "Failed", started="2026-11-29T10:00:00Z", finished="2026-11-29T11:00:00Z")
    pod["status"]["containerStatuses"] = []
    pod["status"]["reason"] = "DeadlineExceeded"
    obs = observe(_job({"phase": "Running", "attempts": 1}), [view_pod(pod)], {}, now=0)
    assert obs.phase is Phase.FAILED and obs.status["reason"] == "MaxDurationExceeded"


def _refused(attempt: int, reason: str = "UnexpectedAdmissionError") -> dict[str, Any]:
    """A pod the kubelet refused before starting it: Failed, no container statuses."""
    pod = _pod(attempt, "Failed", started="2026-11-29T10:00:00Z")
    pod["status"].update(containerStatuses=[], reason=reason,
                         message="Pod was rejected: Allocate failed")
    return pod


def test_a_pod_the_node_refused_requeues_the_job_once_per_refusal() -> None:
    job = _job({"phase": "Admitted", "attempts": 1})
    obs = observe(job, [view_pod(_refused(1))], {UUID: 143771}, now=1_800_000_000)
    assert obs.phase is Phase.QUEUED and obs.attempts == 1
    assert obs.status["reason"] == "NodeRejected"
    assert "refused by node n1 (UnexpectedAdmissionError, 1 of at most 3)" in \
        obs.status["message"]
    assert obs.status["node"] is None and obs.status["gpus"] is None
    assert obs.status["history"][0]["outcome"] == "UnexpectedAdmissionError"
    assert obs.status["gpuHours"] == 0  # it never ran
    assert [e[1] for e in obs.events] == ["Requeued"]
    # the next pass finds the job queued for that refusal: nothing to write, no new event
    again = observe(_job({**obs.status, "phase": "Queued"}), [view_pod(_refused(1))],
                    {UUID: 143771}, now=1_800_000_100)
    assert again.phase is Phase.QUEUED and again.status == {} and again.events == ()


def test_a_requeued_job_waits_10_s_doubling_before_its_next_attempt() -> None:
    """A node whose device plugin is being replaced refuses pods for seconds: a job requeued
    at once would spend its three retries inside that window (they all failed within 2 s
    during `helm upgrade`). It is admitted again only 10 s after a refusal, 20 s after the
    second, and says why it waits meanwhile."""
    refused_at = 1_800_000_000.0
    obs = observe(_job({"phase": "Admitted", "attempts": 1}), [view_pod(_refused(1))],
                  {UUID: 143771}, now=refused_at)
    history = obs.status["history"]
    end = epoch_seconds(history[0]["end"])
    assert end is not None and requeue_not_before(history) == end + 10

    def decision(now: float, records: list[dict[str, Any]]) -> CycleResult:
        job = job_from_object(_job({"phase": "Queued", "attempts": len(records),
                                    "history": records}), Phase.QUEUED, len(records), (), "",
                              records)
        quota = ProjectQuota("vision", frozenset({"team"}))
        return admission_cycle(ClusterSnapshot(now, (job,), {"vision": quota},
                                               {"n1": gpu_node("n1")}))

    soon = decision(end + 9, history)
    assert soon.admissions == ()
    wait = soon.wait_for("team/train")
    assert wait is not None and wait.reason is WaitReason.REQUEUE_BACKOFF
    assert wait.estimated_start == end + 10 and "next attempt in 1s" in wait.message
    assert [a.attempt for a in decision(end + 10, history).admissions] == [2]
    second = [*history, {**history[0], "attempt": 2}]
    assert requeue_not_before(second) == end + 20
    assert decision(end + 19, second).admissions == ()
    assert [a.attempt for a in decision(end + 20, second).admissions] == [3]
    # a run that ended any other way (or one still running) waits for nothing
    assert requeue_not_before([{**history[0], "outcome": "Succeeded"}]) == 0.0
    assert requeue_not_before([{**history[0], "end": None, "outcome": None}]) == 0.0


def test_a_job_refused_more_than_three_times_fails() -> None:
    history = [{"attempt": a, "node": "n1", "fraction": 0.5, "start": "2026-11-29T10:00:00Z",
                "end": "2026-11-29T10:00:00Z", "outcome": "OutOfcarpool.dev/gpu"}
               for a in (1, 2, 3)]
    job = _job({"phase": "Admitted", "attempts": 4, "history": history})
    obs = observe(job, [view_pod(_refused(a, "OutOfcarpool.dev/gpu")) for a in (1, 2, 3)]
                  + [view_pod(_refused(4))], {UUID: 143771}, now=1_800_000_000)
    assert obs.phase is Phase.FAILED and obs.status["reason"] == "UnexpectedAdmissionError"


def test_a_pod_the_cluster_disrupted_requeues_the_job_and_counts_its_run() -> None:
    """A kubelet's eviction (or node shutdown, a taint, the eviction API) marks the pod with
    the DisruptionTarget condition: not the job's fault, so it goes back to the queue."""
    pod = _pod(1, "Failed", started="2026-11-29T10:00:00Z", finished="2026-11-29T11:00:00Z")
    pod["status"].update(reason="Evicted", conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}])
    obs = observe(_job({"phase": "Running", "attempts": 1}), [view_pod(pod)],
                  {UUID: 143771}, now=1_800_000_000)
    assert obs.phase is Phase.QUEUED and obs.status["reason"] == "Disrupted"
    assert obs.status["message"] == \
        "attempt 1 was stopped on node n1 (TerminationByKubelet, 1 of at most 3); requeued"
    (record,) = obs.status["history"]
    assert record["outcome"] == "Disrupted"
    assert obs.status["gpuHours"] == pytest.approx(0.5)  # it ran an hour on half a GPU


def test_a_pod_whose_container_failed_still_fails_the_job() -> None:
    pod = _pod(1, "Failed", started="2026-11-29T10:00:00Z", finished="2026-11-29T10:05:00Z")
    obs = observe(_job({"phase": "Running", "attempts": 1}), [view_pod(pod)], {}, now=0)
    assert obs.phase is Phase.FAILED and obs.status["reason"] == "Error"


def test_conditions_follow_the_phase_and_keep_transition_times() -> None:
    queued = job_conditions({"phase": "Queued", "reason": "Budget", "message": "spent"}, 100)
    assert queued is not None
    by_type = {c["type"]: c for c in queued}
    assert by_type["Admitted"]["status"] == "False" and by_type["Admitted"]["reason"] == "Budget"
    assert job_conditions({"phase": "Queued", "reason": "Budget", "message": "spent",
                           "conditions": queued}, 200) is None  # nothing to write
    running = job_conditions({"phase": "Running", "reason": "Running", "message": "on n1",
                              "attempts": 1, "conditions": queued}, 300)
    assert running is not None
    by_type = {c["type"]: c for c in running}
    assert by_type["Running"]["status"] == "True"
    assert by_type["Finished"]["lastTransitionTime"] == queued[2]["lastTransitionTime"]
    assert by_type["Admitted"]["lastTransitionTime"] != queued[0]["lastTransitionTime"]


def test_hardware_fingerprint_and_peak_memory_come_from_the_gpunode() -> None:
    state = PassState()
    state.inventories["n1"] = NodeInventory("n1", (Gpu(0, UUID, "H200", 143771),))
    state.node_software["n1"] = ("580.1", "13.0")
    state.pod_peaks[("team", "train-1")] = 9000
    pod = view_pod(_pod(1, "Running", started="2026-11-29T10:00:00Z"))
    patch: dict[str, Any] = {}
    Observer._observe_hardware(state, pod, {"peakMemoryMiB": 4000}, patch)
    assert patch == {"hardware": {"gpuModel": "H200", "driverVersion": "580.1",
                                  "cudaVersion": "13.0"}, "peakMemoryMiB": 9000}
    unchanged: dict[str, Any] = {}
    Observer._observe_hardware(state, pod, {**patch, "peakMemoryMiB": 9500}, unchanged)
    assert unchanged == {}


def test_admission_to_start_is_the_median_of_recent_first_runs() -> None:
    def status(admit: int, start: int | None, attempts: int = 1) -> dict[str, Any]:
        out: dict[str, Any] = {"attempts": attempts, "admitTime": f"2026-11-29T10:00:{admit:02d}Z"}
        if start is not None:
            out["startTime"] = f"2026-11-29T10:01:{start:02d}Z"
        return out

    assert admission_to_start_s([]) == 0.0
    statuses = [status(0, 0), status(0, 10), status(0, 30), status(0, None),  # not started
                status(0, 59, attempts=2)]  # a requeued job's startTime is its first run's
    assert admission_to_start_s(statuses) == 70.0  # 60, 70, 90
    assert admission_to_start_s(statuses, recent=2) == 80.0  # the two latest starts: 70, 90
