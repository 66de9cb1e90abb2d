"""The tenant chaos run's checks flag what they exist to flag (else a clean run proves nothing),
and judge a pod by what only Carpool writes: the controller owner reference's UID, never a
label or annotation the tenant can change."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from carpool.core import names
from carpool.kube.errors import ApiError
from carpool_testbed import chaos, tenantchaos
from carpool_testbed.tenantchaos import (
    Checker,
    Report,
    Settings,
    Tally,
    grant_beyond_request,
    holds_gpu,
    is_current_attempt,
    owning_job,
    refusal_reason,
    unexplained_change,
)


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def job(name: str, ns: str = "b", uid: str = "", phase: str = "Running", attempts: int = 1,
        isolation: str = "mps", memory: str = "8Gi", count: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{name}"},
            "spec": {"gpu": {"count": count, "memory": memory, "isolation": isolation},
                     "simulatedDuration": "30s"},
            "status": {"phase": phase, "attempts": attempts}}


def pod(name: str, ns: str = "b", owner: dict[str, Any] | None = None, memory_mib: int = 8192,
        phase: str = "Running", started: float = 1_800_000_000.0, gpu: bool = True,
        labels: dict[str, str] | None = None) -> dict[str, Any]:
    refs = [{"apiVersion": names.API_VERSION, "kind": "GpuJob", "controller": True,
             "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}] if owner else []
    annotations = {names.ANN_ASSIGNMENT: json.dumps({"node": "n0", "gpus": [
        {"uuid": "g0", "index": 0, "memoryMiB": memory_mib, "cores": 20}]})} if gpu else {}
    return {"metadata": {"name": name, "namespace": ns, "uid": f"pod-{ns}-{name}",
                         "ownerReferences": refs, "labels": labels or {},
                         "annotations": annotations},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {
                names.RESOURCE_GPU: "1"}} if gpu else {}}]},
            "status": {"phase": phase, "startTime": stamp(started), "containerStatuses": [
                {"state": {"running": {"startedAt": stamp(started)}}}]}}


def test_a_pod_belongs_to_the_job_its_controller_reference_names_by_uid_in_its_namespace(
        ) -> None:
    mine, theirs = job("j1"), job("v1", ns="a")
    by_uid = {j["metadata"]["uid"]: j for j in (mine, theirs)}
    assert owning_job(pod("j1-1", owner=mine), by_uid) is mine
    # labels and a name saying otherwise are no proof
    forged = pod("v1-1", labels={names.LABEL_JOB: "v1"})
    assert owning_job(forged, by_uid) is None
    # an owner reference across namespaces is no ownership either
    assert owning_job(pod("v1-1", owner=theirs), by_uid) is None
    not_controller = pod("j1-1", owner=mine)
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    assert owning_job(not_controller, by_uid) is None


def test_only_a_live_jobs_current_attempt_may_hold_a_gpu() -> None:
    running = job("j1", attempts=2)
    assert is_current_attempt(pod("j1-2", owner=running), running)
    assert is_current_attempt(pod("j1-3", owner=running), running)  # created, not yet written
    assert not is_current_attempt(pod("j1-1", owner=running), running)
    assert not is_current_attempt(pod("j1-2", owner=running), job("j1", phase="Succeeded",
                                                                  attempts=2))
    deleting = job("j1", attempts=2)
    deleting["metadata"]["deletionTimestamp"] = stamp(1_800_000_000)
    assert not is_current_attempt(pod("j1-2", owner=deleting), deleting)
    assert not is_current_attempt(pod("j1-2"), None)
    assert holds_gpu(pod("x")) and not holds_gpu(pod("x", phase="Succeeded"))
    assert not holds_gpu(pod("x", gpu=False))


def test_a_grant_beyond_the_request_is_named() -> None:
    asked = job("j1", memory="8Gi")
    assert grant_beyond_request(pod("j1-1", owner=asked, memory_mib=8192), asked) == ""
    assert "81920 MiB granted" in grant_beyond_request(pod("j1-1", memory_mib=81920), asked)
    whole = job("j2", isolation="exclusive", memory="20Gi")
    assert grant_beyond_request(pod("j2-1", memory_mib=81920), whole) == ""


def test_only_the_victims_own_run_explains_its_changes() -> None:
    start = 1_800_000_000.0
    record = {"attempt": 1, "start": stamp(start), "end": stamp(start + 30),
              "outcome": "Succeeded"}
    assert unexplained_change({}, {"phase": "Queued"}, 30) == ""
    assert unexplained_change({"phase": "Queued"}, {"phase": "Running", "attempts": 1}, 30) == ""
    assert unexplained_change({"phase": "Running"}, {"phase": "Succeeded", "attempts": 1,
                                                     "history": [record]}, 30) == ""
    assert "Running -> Queued" in unexplained_change(
        {"phase": "Running"}, {"phase": "Queued", "reason": "PodLost"}, 30)
    assert "attempts 2" in unexplained_change({"phase": "Admitted"},
                                              {"phase": "Admitted", "attempts": 2}, 30)
    assert "phase Failed" in unexplained_change({"phase": "Running"}, {"phase": "Failed"}, 30)
    early = dict(record, end=stamp(start + 1))
    assert "after 1 s of its 30 s" in unexplained_change(
        {"phase": "Running"}, {"phase": "Succeeded", "attempts": 1, "history": [early]}, 30)


def test_refusals_are_named_by_policy_rbac_or_field() -> None:
    policy = ApiError(403, "Forbidden", json.dumps({"message": (
        "pods \"x\" is forbidden: ValidatingAdmissionPolicy 'tc-carpool-0a1b2c-tenant-isolation'"
        " with binding 'tc-carpool-0a1b2c-tenant-isolation' denied request: no")}))
    assert refusal_reason(policy) == "403 carpool-tenant-isolation"
    rbac = ApiError(403, "Forbidden", json.dumps({"message": (
        "pods \"x\" is forbidden: User \"system:serviceaccount:b:m\" cannot patch resource")}))
    assert refusal_reason(rbac) == "403 RBAC"
    invalid = ApiError(422, "Unprocessable Entity", json.dumps({"message": (
        "GpuJob.carpool.dev \"odd-1\" is invalid: spec.gpu.count: Invalid value: 16")}))
    assert refusal_reason(invalid) == "422 invalid spec.gpu.count"
    tally = Tally()
    tally.add("a", policy)
    tally.add("a", None)
    assert tally.totals() == (2, 1, 1)


def checker() -> Checker:
    capacity = {"g0": chaos.GpuCapacity("n0", 81920, True)}
    return Checker(api=None, namespaces={"a": "pa", "b": "pb"},  # type: ignore[arg-type]
                   victim_ns="a", memory_totals={"g0": 81920}, capacity=capacity,
                   quotas={"pa": 1.0, "pb": 1.0}, orphan_grace_s=30)


def test_the_checker_flags_an_orphan_after_the_grace_and_a_forged_victim_success() -> None:
    check = checker()
    mine = job("j1", attempts=2)
    check._job_seen(mine)
    check._pod_seen(pod("j1-1", owner=mine))  # attempt 1, replaced by 2: an orphan
    check._pod_seen(pod("j1-2", owner=mine))
    now = time.time()
    check._sample(now)
    check._sample(now + 29)
    assert not check.counts
    check._sample(now + 31)
    assert check.counts == {tenantchaos.ORPHANED: 1}
    assert "j1-1" in check.violations[0] and "not attempt 2" in check.violations[0]
    victim = job("v1", ns="a", phase="Running")
    check._job_seen(victim)
    start = 1_800_000_000.0
    check._job_seen(dict(victim, status={"phase": "Succeeded", "attempts": 1, "history": [
        {"attempt": 1, "start": stamp(start), "end": stamp(start + 1),
         "outcome": "Succeeded"}]}))
    assert check.counts[tenantchaos.UNEXPLAINED] == 1
    assert check.victim_pods_not_their_own(["v1"]) == ["v1: succeeded pod None"]


def test_held_gpu_hours_use_the_jobs_isolation_not_the_pods_annotation() -> None:
    check = checker()
    whole = job("j1", isolation="exclusive", memory="20Gi")
    check._job_seen(whole)
    p = pod("j1-1", owner=whole, memory_mib=20480, started=1_800_000_000.0)
    p["metadata"]["annotations"][names.ANN_ISOLATION] = "mps"  # a tenant's edit changes nothing
    check._pod_seen(p)
    assert abs(check.held_gpu_hours(1_800_003_600.0)["pb"] - 1.0) < 1e-9


def test_the_report_fails_on_any_breach_or_billing_gap() -> None:
    def report(counts: dict[str, int], billed: float, held: float) -> Report:
        return Report(Settings(), "", Tally(), counts, [], 3, {}, {}, {"pb": billed},
                      {"pb": held}, [], 0.0, 10, 10.0)

    assert report({}, 1.0, 1.002).passed()
    assert not report({}, 0.9, 1.0).passed()
    assert report({}, 0.9, 1.0).billing_gaps() == {"pb": -0.1}
    assert not report({tenantchaos.ORPHANED: 1}, 1.0, 1.0).passed()


def test_a_gpu_pod_running_past_the_extender_is_flagged() -> None:
    check = checker()
    mine = job("j1", attempts=1)
    check._job_seen(mine)
    bypass = pod("j1-1", owner=mine)
    bypass["metadata"]["annotations"] = {}  # asks for carpool.dev/gpu, never assigned
    bypass["spec"]["nodeName"] = "n0"
    check._pod_seen(bypass)
    check._sample(time.time())
    assert check.counts == {tenantchaos.UNASSIGNED: 1}
    assert "its job's current attempt" in check.violations[0]


def test_a_victim_change_is_counted_once_per_job_and_kind_even_past_an_odd_phase() -> None:
    check = checker()
    victim = job("v1", ns="a", phase="Running")
    check._job_seen(victim)
    for _ in range(3):
        check._job_seen(dict(victim, status={"phase": "Failed", "attempts": 1}))
    check._job_seen(dict(victim, status={"phase": "Running", "attempts": 2}))
    assert check.counts[tenantchaos.UNEXPLAINED] == 2, check.violations


def test_once_the_job_records_its_pods_uid_only_that_pod_is_its_attempt() -> None:
    running = job("j1", attempts=1)
    running["status"]["podUID"] = "pod-b-j1-1"
    assert is_current_attempt(pod("j1-1", owner=running), running)
    lookalike = pod("j1-1", owner=running)
    lookalike["metadata"]["uid"] = "another"
    assert not is_current_attempt(lookalike, running)
