"""The operator's behaviours end to end: real API server, kube-scheduler, extender, KWOK nodes.

Each test makes its own namespaces, projects and nodes (unique names). Its nodes carry a GPU
model no other test uses and its jobs ask for that model and pin the pod to the nodes by
nodeSelector, so the operator's placement view and the scheduler agree that these jobs can only
go there, whatever else runs on the shared cluster. Durations are simulated
(`spec.simulatedDuration`: KWOK completes the pod that long after it starts).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from carpool import workload
from carpool.core import checkpointing, lifecycle, names
from carpool.core.gpuhours import gpu_hours
from carpool.core.timestamps import epoch_seconds
from carpool.deviceplugin import reports
from carpool.deviceplugin.kube import KubernetesCluster, load_config
from carpool_testbed import devcluster, simnodes, stack
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
Obj = dict[str, Any]
GIB = 1024


def _parse(text: str | None) -> float:
    assert text, "expected a timestamp"
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _rfc3339(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Scenario:
    """One test's world: namespaces, projects, nodes of a private GPU model, and jobs."""

    def __init__(self, cluster: devcluster.Cluster, prefix: str):
        self.cluster = cluster
        self.api = cluster.api()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.suffix = uuid.uuid4().hex[:6]
        self.prefix = prefix
        self.model = f"m{prefix}-{self.suffix}"
        self.namespaces: list[str] = []
        self.projects: list[str] = []
        self.nodes: list[str] = []

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}-{self.suffix}"

    def node(self, gpus: int, memory_gib: int = 80) -> str:
        name = self.name(f"node{len(self.nodes)}")
        spec = simnodes.parse_nodes({"nodes": [{
            "name": name, "zone": "zone-a", "sharing": "mps",
            "gpus": [{"model": self.model, "count": gpus,
                      "memoryTotalMiB": memory_gib * GIB}]}]})
        simnodes.apply_nodes(self.api, spec)
        self.nodes.append(name)
        return name

    def namespace(self, what: str) -> str:
        name = self.name(what)
        self.core.create_namespace({"metadata": {"name": name}})
        self.namespaces.append(name)
        return name

    def project(self, what: str, namespaces: list[str], **spec: Any) -> str:
        name = self.name(what)
        self.custom.create_cluster_custom_object(names.GROUP, names.VERSION,
                                                 names.PROJECTQUOTA_PLURAL, {
            "apiVersion": names.API_VERSION, "kind": "ProjectQuota",
            "metadata": {"name": name}, "spec": {"namespaces": namespaces, **spec}})
        self.projects.append(name)
        return name

    def submit(self, namespace: str, name: str, project: str, *, cls: str = "batch",
               node: str, memory_gib: int = 10, cores: int | None = None,
               isolation: str = "exclusive", count: int = 1, **spec: Any) -> None:
        gpu: Obj = {"count": count, "memory": f"{memory_gib}Gi", "isolation": isolation,
                    "models": [self.model]}
        if cores is not None:
            gpu["cores"] = cores
        body = {"apiVersion": names.API_VERSION, "kind": "GpuJob",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"project": project, "class": cls, "gpu": gpu, **spec,
                         "template": {"spec": {
                             "nodeSelector": {"kubernetes.io/hostname": node},
                             "containers": [{"name": "main", "image": "trainer"}]}}}}
        self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace,
                                                    names.GPUJOB_PLURAL, body)

    def job(self, namespace: str, name: str) -> Obj:
        return dict(self.custom.get_namespaced_custom_object(
            names.GROUP, names.VERSION, namespace, names.GPUJOB_PLURAL, name))

    def status(self, namespace: str, name: str) -> Obj:
        return dict(self.job(namespace, name).get("status") or {})

    def quota_status(self, project: str) -> Obj:
        return dict(self.custom.get_cluster_custom_object(
            names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, project).get("status") or {})

    def wait_phase(self, namespace: str, name: str, phases: set[str],
                   timeout: float = 60.0) -> Obj:
        def probe() -> Obj | None:
            status = self.status(namespace, name)
            return status if status.get("phase") in phases else None
        return dict(wait_for(f"{namespace}/{name} in {sorted(phases)}", probe, timeout))

    def events(self, namespace: str, name: str) -> list[Obj]:
        raw = self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}", _preload_content=False)
        return list(json.loads(raw.data)["items"])

    def pod(self, namespace: str, name: str) -> Obj:
        raw = self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        return dict(json.loads(raw.data))

    def cleanup(self) -> None:
        for namespace in self.namespaces:
            self.cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for project in self.projects:
            self.cluster.kubectl("delete", "projectquota", project, check=False)
        simnodes.delete_nodes(self.api, self.nodes)


@pytest.fixture
def scenario(cluster: devcluster.Cluster, carpool_stack: dict[str, Any],
             request: pytest.FixtureRequest) -> Iterator[Scenario]:
    prefix = "op" + str(abs(hash(request.node.name)) % 1000)
    world = Scenario(cluster, prefix)
    try:
        yield world
    finally:
        world.cleanup()


def _history(status: Obj) -> list[Obj]:
    return sorted(status.get("history") or [], key=lambda r: r["attempt"])


def _gone(scenario: Scenario, namespace: str, what: str, name: str) -> bool:
    try:
        if what == "pod":
            scenario.pod(namespace, name)
        else:
            scenario.job(namespace, name)
    except client.ApiException as err:
        return bool(err.status == 404)
    return False


def test_short_job_preempts_another_projects_borrowed_batch_job(scenario: Scenario) -> None:
    node = scenario.node(gpus=1)
    ns_a, ns_b = scenario.namespace("a"), scenario.namespace("b")
    owner = scenario.project("own", [ns_a], concurrent={"gpus": 1})
    borrower = scenario.project("bor", [ns_b], concurrent={"gpus": 0},
                                borrowing={"enabled": True})
    scenario.submit(ns_b, "batch", borrower, node=node, preemptible=True,
                    estimatedDuration="1m", simulatedDuration="6s",
                    checkpoint={"gracePeriod": "1s"})
    running = scenario.wait_phase(ns_b, "batch", {"Running"})
    assert running["borrowed"] is True
    submitted = running["submitTime"]

    scenario.submit(ns_a, "short", owner, cls="short", node=node,
                    estimatedDuration="30s", simulatedDuration="4s")
    def preempted() -> Obj | None:
        status = scenario.status(ns_b, "batch")
        outcomes = [r.get("outcome") for r in status.get("history") or []]
        return status if "Preempted" in outcomes else None

    requeued = wait_for("the batch job preempted and requeued", preempted, timeout=30)
    assert requeued["submitTime"] == submitted and requeued["attempts"] >= 1
    short = scenario.wait_phase(ns_a, "short", {"Running", "Succeeded"}, timeout=30)
    assert short["attempts"] == 1

    done = scenario.wait_phase(ns_b, "batch", {"Succeeded", "Failed"}, timeout=45)
    assert done["phase"] == "Succeeded", done
    assert done["attempts"] == 2 and done["submitTime"] == submitted
    first, second = _history(done)
    assert first["outcome"] == "Preempted" and second["outcome"] == "Succeeded"
    assert _parse(second["start"]) >= _parse(first["end"])
    # it started before it was ever estimated: the estimates of its second wait are not a
    # first estimate (one would be scored against a start that came before it)
    assert "firstEstimatedStart" not in done and "firstSimulatedStart" not in done
    short_done = scenario.wait_phase(ns_a, "short", {"Succeeded"}, timeout=20)
    assert _parse(second["start"]) >= _parse(short_done["startTime"])
    wait_for("Preempted and Requeued events", lambda: {"Preempted", "Requeued"} <= {
        e["reason"] for e in scenario.events(ns_b, "batch")}, timeout=15)


def test_borrowed_job_is_reclaimed_when_the_owner_needs_its_guarantee(
        scenario: Scenario) -> None:
    node = scenario.node(gpus=2)
    ns_own, ns_bor = scenario.namespace("own"), scenario.namespace("bor")
    owner = scenario.project("own", [ns_own], concurrent={"gpus": 2})
    borrower = scenario.project("bor", [ns_bor], concurrent={"gpus": 0},
                                borrowing={"enabled": True})
    for i in range(2):
        scenario.submit(ns_bor, f"b{i}", borrower, node=node, preemptible=True,
                        estimatedDuration="10m", checkpoint={"gracePeriod": "1s"})
    for i in range(2):
        scenario.wait_phase(ns_bor, f"b{i}", {"Running"})
    status = wait_for("the borrower's quota status", lambda: (
        s if (s := scenario.quota_status(borrower)).get("borrowed", {}).get("gpus") == 2
        else None), timeout=20)
    assert status["running"]["gpus"] == 2 and status["running"]["jobs"] == 2

    # Same class as the borrowers: only the guarantee lets the owner in.
    scenario.submit(ns_own, "owner", owner, node=node, estimatedDuration="10m",
                    simulatedDuration="3s")
    done = scenario.wait_phase(ns_own, "owner", {"Succeeded"}, timeout=45)
    assert done.get("borrowed") is False  # it ran within its own guarantee
    phases = {i: scenario.status(ns_bor, f"b{i}") for i in range(2)}
    reclaimed = [s for s in phases.values() if s.get("attempts", 0) >= 2
                 or s.get("reason") == "PreemptedReclaimBorrowed"
                 or any(r.get("outcome") == "Preempted" for r in s.get("history") or [])]
    assert len(reclaimed) == 1, phases  # one GPU was needed, so one borrower went
    events = [e for i in range(2) for e in scenario.events(ns_bor, f"b{i}")
              if e["reason"] == "Preempted"]
    assert len(events) == 1 and "reclaims capacity borrowed by" in events[0]["message"]


def test_budget_runs_out_mid_period_and_the_refill_releases_held_jobs(
        scenario: Scenario) -> None:
    node = scenario.node(gpus=1)
    ns = scenario.namespace("bud")
    refill = time.time() + 40  # the next period starts then
    project = scenario.project("bud", [ns], concurrent={"gpus": 1}, gpuHours={
        "budget": 0.003, "period": "1m", "periodAnchor": _rfc3339(refill - 60)})
    # The first job's 10 s limit claims 0.0028 GPU-h of the 0.003; its 9 s run uses 0.0025,
    # so what is left (under 2 GPU-seconds) holds any job with a limit until the refill.
    scenario.submit(ns, "first", project, node=node, estimatedDuration="10s",
                    maxDuration="10s", simulatedDuration="9s")
    first = scenario.wait_phase(ns, "first", {"Succeeded"}, timeout=30)
    assert time.time() < refill - 5, "the machine is too slow for this period's timing"
    scenario.submit(ns, "second", project, node=node, estimatedDuration="10s",
                    maxDuration="10s", simulatedDuration="3s")
    held = wait_for("the second job held for budget", lambda: (
        s if (s := scenario.status(ns, "second")).get("reason") == "Budget" else None),
        timeout=15)
    assert held["phase"] == "Queued" and "refills in" in held["message"]
    quota = scenario.quota_status(project)
    assert quota["usedGpuHours"] == pytest.approx(first["gpuHours"], abs=1e-3)
    assert quota["remainingGpuHours"] == pytest.approx(0.003 - quota["usedGpuHours"], abs=1e-6)
    assert quota["remainingGpuHours"] < 2 / 3600
    assert quota["pending"] == 1
    assert _parse(held["estimatedStart"]) == pytest.approx(refill, abs=10)
    wait_for("the Budget event", lambda: "Budget" in {
        e["reason"] for e in scenario.events(ns, "second")}, timeout=15)

    started = scenario.wait_phase(ns, "second", {"Running", "Succeeded"}, timeout=60)
    admitted_at = _parse(started["admitTime"])
    # a claim straddling the refill may start once its part before it fits: 2 s at most
    assert admitted_at >= refill - 3, (started["admitTime"], _rfc3339(refill))
    assert admitted_at - refill < 15


def test_job_in_an_unbound_namespace_is_refused_with_reason_and_event(
        scenario: Scenario) -> None:
    node = scenario.node(gpus=1)
    bound, stray = scenario.namespace("bound"), scenario.namespace("stray")
    project = scenario.project("p", [bound], concurrent={"gpus": 1})
    scenario.submit(stray, "lost", project, node=node, estimatedDuration="1m")
    status = wait_for("the refusal", lambda: (
        s if (s := scenario.status(stray, "lost")).get("reason") == "UnboundNamespace"
        else None), timeout=20)
    assert status["phase"] == "Queued" and "estimatedStart" not in status
    assert f"namespace {stray!r} is not bound to project {project!r}" in status["message"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Admitted"]["status"] == "False"
    assert conditions["Admitted"]["reason"] == "UnboundNamespace"
    events = wait_for("the event", lambda: [
        e for e in scenario.events(stray, "lost") if e["reason"] == "UnboundNamespace"],
        timeout=10)
    assert events[0]["type"] == "Warning"
    assert scenario.core.list_namespaced_pod(stray).items == []


def test_estimated_start_is_shown_then_met_and_gpu_hours_follow_the_definition(
        scenario: Scenario) -> None:
    node = scenario.node(gpus=1, memory_gib=80)
    ns = scenario.namespace("eta")
    project = scenario.project("eta", [ns], concurrent={"gpus": 2})
    # 60 % of the cores each: the two cannot share the GPU; fraction = max(20/80, 0.6)
    scenario.submit(ns, "first", project, node=node, isolation="mps", memory_gib=20,
                    cores=60, estimatedDuration="15s", simulatedDuration="15s")
    scenario.wait_phase(ns, "first", {"Running"})
    scenario.submit(ns, "second", project, node=node, isolation="mps", memory_gib=20,
                    cores=60, estimatedDuration="5s", simulatedDuration="5s")
    queued = wait_for("an estimated start", lambda: (
        s if (s := scenario.status(ns, "second")).get("estimatedStart") else None), timeout=15)
    assert queued["phase"] == "Queued" and queued["queuePosition"] == 1
    estimate = _parse(queued["estimatedStart"])

    first = scenario.wait_phase(ns, "first", {"Succeeded"}, timeout=40)
    second = scenario.wait_phase(ns, "second", {"Running", "Succeeded"}, timeout=40)
    actual = _parse(second["startTime"])
    assert abs(actual - estimate) <= 15, (queued["estimatedStart"], second["startTime"])
    assert estimate == pytest.approx(_parse(first["startTime"]) + 15, abs=10)

    # GPU-hours of the finished job: fraction x wall hours of its pod, nothing else
    pod = scenario.pod(ns, first["podName"])
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    wall = (_parse(term["startedAt"]), _parse(term["finishedAt"]))
    assert first["gpuHours"] == pytest.approx(gpu_hours(0.6, *wall), rel=1e-3, abs=1e-6)
    assert first["hardware"]["gpuModel"] == scenario.model
    assert first["hardware"]["driverVersion"] and first["hardware"]["cudaVersion"]
    conditions = {c["type"]: (c["status"], c["reason"]) for c in first["conditions"]}
    assert conditions == {"Admitted": ("True", "Admitted"), "Running": ("False", "Finished"),
                          "Finished": ("True", "Succeeded")}


def test_max_duration_is_enforced(scenario: Scenario) -> None:
    node = scenario.node(gpus=1)
    ns = scenario.namespace("max")
    project = scenario.project("max", [ns], concurrent={"gpus": 1})
    scenario.submit(ns, "endless", project, node=node, estimatedDuration="3s",
                    maxDuration="5s", checkpoint={"gracePeriod": "1s"})  # never completes
    running = scenario.wait_phase(ns, "endless", {"Running"})
    failed = scenario.wait_phase(ns, "endless", {"Failed"}, timeout=30)
    assert failed["reason"] == "MaxDurationExceeded", failed
    ran = _parse(failed["completionTime"]) - _parse(running["startTime"])
    assert 5 <= ran <= 15, ran
    (record,) = _history(failed)
    assert record["outcome"] == "MaxDurationExceeded"
    wait_for("the MaxDurationExceeded event", lambda: "MaxDurationExceeded" in {
        e["reason"] for e in scenario.events(ns, "endless")}, timeout=15)  # posted in background
    wait_for("the pod gone", lambda: not scenario.core.list_namespaced_pod(ns).items,
             timeout=20)


@pytest.mark.parametrize("how", ["refused", "evicted"])
def test_a_pod_that_fails_through_no_fault_of_the_job_sends_it_back_to_the_queue(
        scenario: Scenario, how: str) -> None:
    """The kubelet refuses a pod when its device plugin cannot allocate
    (UnexpectedAdmissionError), or evicts a running one and marks it DisruptionTarget: the
    job's code is not at fault, so a new attempt follows."""
    node = scenario.node(gpus=1)
    ns = scenario.namespace(how)
    project = scenario.project(how, [ns], concurrent={"gpus": 1})
    # Runs for an hour once started: KWOK's stages then leave the failed pod alone (they
    # only complete Running pods, after that long), as a real kubelet would.
    scenario.submit(ns, how, project, node=node, estimatedDuration="1h", maxDuration="2h",
                    simulatedDuration="1h")

    def pod_running(name: str) -> bool:
        try:
            return bool(scenario.pod(ns, name)["status"].get("phase") == "Running")
        except client.ApiException as err:
            if err.status == 404:
                return False
            raise

    wait_for("attempt 1's pod running", lambda: pod_running(f"{how}-1"), timeout=30)
    # what a kubelet writes on a pod it refused before starting any container, or evicted
    ops: list[Obj]
    if how == "refused":
        reason, outcome = "UnexpectedAdmissionError", "UnexpectedAdmissionError"
        ops = [{"op": "add", "path": "/status/containerStatuses", "value": []}]
    else:
        reason, outcome = "Evicted", "Disrupted"
        conditions = scenario.pod(ns, f"{how}-1")["status"].get("conditions") or []
        ops = [{"op": "add", "path": "/status/conditions", "value": [*conditions, {
            "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
            "lastTransitionTime": _rfc3339(time.time())}]}]
    failed_at = time.time()
    scenario.core.patch_namespaced_pod_status(f"{how}-1", ns, [
        {"op": "replace", "path": "/status/phase", "value": "Failed"},
        {"op": "add", "path": "/status/reason", "value": reason},
        {"op": "add", "path": "/status/message", "value": f"Pod was {how} (test)"}, *ops])

    wait_for("attempt 2's pod running", lambda: pod_running(f"{how}-2"), timeout=30)
    # Not at once: the requeue backoff (10 s after a first failure; the record's end and
    # creationTimestamp are whole seconds).
    created = scenario.pod(ns, f"{how}-2")["metadata"]["creationTimestamp"]
    assert (epoch_seconds(created) or 0) >= failed_at - 2 + lifecycle.REQUEUE_BACKOFF_S, created
    status = scenario.wait_phase(ns, how, {"Running"}, timeout=15)
    assert status["attempts"] == 2, status
    (first, second) = _history(status)
    assert first["outcome"] == outcome, first
    assert "outcome" not in second, second
    assert scenario.pod(ns, f"{how}-1")["status"]["phase"] == "Failed"  # kept: it says why
    wait_for("the Requeued event", lambda: any(
        e["reason"] == "Requeued" for e in scenario.events(ns, how)), timeout=15)


def test_deleting_a_finished_job_never_refunds_its_gpu_hours(scenario: Scenario) -> None:
    node = scenario.node(gpus=1)
    ns = scenario.namespace("del")
    project = scenario.project("del", [ns], concurrent={"gpus": 1},
                               gpuHours={"budget": 10, "period": "1h"})
    scenario.submit(ns, "spent", project, node=node, estimatedDuration="5s",
                    simulatedDuration="3s")
    done = scenario.wait_phase(ns, "spent", {"Succeeded"}, timeout=40)
    # Carpool's finalizer is on the job's pod (from its creation), never on the job
    assert names.FINALIZER not in (scenario.job(ns, "spent")["metadata"].get("finalizers")
                                   or [])
    assert names.FINALIZER in scenario.pod(ns, "spent-1")["metadata"]["finalizers"]
    used = wait_for("usage in the quota", lambda: (
        s["usedGpuHours"] if (s := scenario.quota_status(project)).get("usedGpuHours") else None),
        timeout=15)
    assert used == pytest.approx(done["gpuHours"], abs=1e-4)

    scenario.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, ns,
                                                    names.GPUJOB_PLURAL, "spent")

    wait_for("the job to be deleted", lambda: _gone(scenario, ns, "job", "spent"), timeout=20)
    # the job goes at once; the operator retires its usage from the last state it saw
    status = wait_for("its usage retired", lambda: (
        q if (q := scenario.quota_status(project)).get("retired", {}).get("jobs") else None),
        timeout=20)
    assert status["retired"]["gpuHours"] == pytest.approx(done["gpuHours"], abs=1e-5)
    time.sleep(3)  # a pass after the deletion
    assert scenario.quota_status(project)["usedGpuHours"] == pytest.approx(used, abs=1e-4)


def test_a_deleted_running_job_is_billed_and_its_pod_kept_until_then(
        scenario: Scenario) -> None:
    """Deleting a running job (the default, background: the job goes at once, its pod after
    it) bills the job's GPU time up to its pod's end: Carpool's finalizer keeps the pod until
    the operator has retired the job's usage into its project."""
    node = scenario.node(gpus=1)
    ns = scenario.namespace("delrun")
    project = scenario.project("delrun", [ns], concurrent={"gpus": 1})
    scenario.submit(ns, "running", project, node=node, estimatedDuration="10m",
                    simulatedDuration="600s")
    (run,) = _history(scenario.wait_phase(ns, "running", {"Running"}, timeout=40))
    assert names.FINALIZER not in (scenario.job(ns, "running")["metadata"].get("finalizers")
                                   or [])
    assert names.FINALIZER in scenario.pod(ns, "running-1")["metadata"]["finalizers"]
    time.sleep(4)  # a few seconds of GPU time
    deleted_at = time.time()
    scenario.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, ns,
                                                    names.GPUJOB_PLURAL, "running")
    wait_for("the job to be gone", lambda: _gone(scenario, ns, "job", "running"), timeout=20)
    wait_for("its pod to be released and gone",
             lambda: _gone(scenario, ns, "pod", "running-1"), timeout=60)
    retired = scenario.quota_status(project)["retired"]
    billed_s = retired["gpuHours"] * 3600  # one exclusive GPU
    assert deleted_at - _parse(run["start"]) - 2 <= billed_s <= time.time() - _parse(
        run["start"]) + 2, retired


def test_a_pod_that_finished_and_was_deleted_while_the_operator_was_down_ends_its_job(
        scenario: Scenario, carpool_stack: dict[str, Any], carpool_logs: Path,
        carpool_operator_env: dict[str, str]) -> None:
    """The job's pod succeeds and is deleted (as pod garbage collection would) while no
    operator runs: Carpool's finalizer keeps the pod, so the operator back reads its outcome
    (Succeeded, once), not a lost pod to run again, and only then lets the pod go."""
    node = scenario.node(gpus=1)
    ns = scenario.namespace("down")
    project = scenario.project("down", [ns], concurrent={"gpus": 1})
    scenario.submit(ns, "quick", project, node=node, estimatedDuration="1m",
                    simulatedDuration="5s")
    scenario.wait_phase(ns, "quick", {"Running"}, timeout=40)
    devcluster.stop_process(carpool_stack["operator"])
    try:
        wait_for("the pod to succeed", lambda: scenario.pod(ns, "quick-1")["status"].get(
            "phase") == "Succeeded", timeout=30)
        scenario.core.delete_namespaced_pod("quick-1", ns)
        held = scenario.pod(ns, "quick-1")["metadata"]
        assert held.get("deletionTimestamp") and held["finalizers"] == [names.FINALIZER]
        assert scenario.status(ns, "quick")["phase"] == "Running"  # no operator saw it end
    finally:
        carpool_stack["operator"] = stack.start_operator(
            scenario.cluster.kubeconfig, carpool_logs / "operator.log", carpool_operator_env)
    status = scenario.wait_phase(ns, "quick", {"Succeeded", "Queued", "Admitted"},
                                 timeout=60)
    assert status["phase"] == "Succeeded" and status["attempts"] == 1, status
    (run,) = _history(status)
    assert run["outcome"] == "Succeeded"
    wait_for("the pod to be released and gone", lambda: _gone(scenario, ns, "pod", "quick-1"),
             timeout=30)
    reasons = {e.get("reason") for e in scenario.events(ns, "quick")}
    assert "Requeued" not in reasons, reasons


def test_a_job_an_earlier_release_put_its_finalizer_on_is_still_let_go(
        scenario: Scenario) -> None:
    """An upgrade: GpuJobs admitted by an earlier release carry Carpool's finalizer; deleting
    one retires its usage and takes the finalizer off. This release never puts it on a job."""
    node = scenario.node(gpus=1)
    ns = scenario.namespace("upgr")
    project = scenario.project("upgr", [ns], concurrent={"gpus": 1})
    scenario.submit(ns, "old", project, node=node, estimatedDuration="5s",
                    simulatedDuration="3s")
    done = scenario.wait_phase(ns, "old", {"Succeeded"}, timeout=40)
    assert not scenario.job(ns, "old")["metadata"].get("finalizers")
    scenario.cluster.kubectl("patch", "gpujob", "old", "-n", ns, "--type=merge", "-p",
                             json.dumps({"metadata": {"finalizers": [names.FINALIZER]}}))
    scenario.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, ns,
                                                    names.GPUJOB_PLURAL, "old")
    wait_for("the job to be let go", lambda: _gone(scenario, ns, "job", "old"), timeout=30)
    retired = scenario.quota_status(project)["retired"]
    assert retired["gpuHours"] == pytest.approx(done["gpuHours"], abs=1e-5)


def test_a_deleted_jobs_run_time_outlives_it_and_an_operator_restart(
        scenario: Scenario, carpool_stack: dict[str, Any], carpool_logs: Path,
        carpool_operator_env: dict[str, str]) -> None:
    """A finished job's run time is learned; deleting the job keeps it in its ProjectQuota's
    status, and the next job of its template is expected to take that long rather than the
    10 minutes its user says, even by an operator started after the deletion (which knows
    only what the API server holds)."""
    node = scenario.node(gpus=1)
    ns = scenario.namespace("learn")
    project = scenario.project("learn", [ns], concurrent={"gpus": 1})
    scenario.submit(ns, "learn-1", project, node=node, estimatedDuration="10m",
                    simulatedDuration="3s")
    (run,) = _history(scenario.wait_phase(ns, "learn-1", {"Succeeded"}, timeout=40))
    ran = _parse(run["end"]) - _parse(run["start"])
    scenario.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, ns,
                                                    names.GPUJOB_PLURAL, "learn-1")

    wait_for("the job to be deleted", lambda: _gone(scenario, ns, "job", "learn-1"), timeout=20)
    retired = wait_for("its usage retired", lambda: (
        r if (r := scenario.quota_status(project).get("retired", {})).get("learned") else None),
        timeout=20)
    (learned,) = [e for e in retired["learned"] if e.get("template") == "learn@trainer"]
    assert learned["samples"] == 1 and learned["seconds"] == pytest.approx(ran), learned
    (by_class,) = [e for e in retired["learned"] if e.get("class") == "batch"]
    assert by_class["ratio"] == pytest.approx(ran / 600), by_class

    devcluster.stop_process(carpool_stack["operator"])
    carpool_stack["operator"] = stack.start_operator(
        scenario.cluster.kubeconfig, carpool_logs / "operator.log", carpool_operator_env)
    # the GPU busy for a while, then two jobs waiting for it: the second waits for the first
    scenario.submit(ns, "blocker", project, cls="long", node=node, estimatedDuration="40s",
                    simulatedDuration="40s")
    scenario.wait_phase(ns, "blocker", {"Running"}, timeout=60)
    for name in ("learn-2", "next"):
        scenario.submit(ns, name, project, node=node, estimatedDuration="10m",
                        simulatedDuration="3s")

    def estimates() -> tuple[float, float] | None:
        first, second = scenario.status(ns, "learn-2"), scenario.status(ns, "next")
        if not (first.get("estimatedStart") and second.get("estimatedStart")):
            return None
        assert (first["queuePosition"], second["queuePosition"]) == (1, 2), (first, second)
        return _parse(first["estimatedStart"]), _parse(second["estimatedStart"])

    learn_2, after = wait_for("estimated starts", estimates, timeout=30)
    # `next` starts when learn-2 is expected to end: learned 3 s (estimates are shown to
    # 10 s), where the user's estimate would say 10 minutes
    assert 0 <= after - learn_2 <= 20, (learn_2, after)


def test_mps_borrowers_holding_every_gpu_are_preempted_for_an_in_quota_job(
        scenario: Scenario) -> None:
    """The live demo's case: shared (MPS) borrowed jobs on every GPU, an in-quota MPS job
    waiting. It must preempt, not wait with BehindHigherRanked ("GPUs are free but reserved
    for 0 higher-ranked ...") as it would if held GPUs looked free at epoch times."""
    node = scenario.node(gpus=1)
    ns_own, ns_bor = scenario.namespace("own"), scenario.namespace("bor")
    owner = scenario.project("own", [ns_own], concurrent={"gpus": 1})
    borrower = scenario.project("bor", [ns_bor], concurrent={"gpus": 0},
                                borrowing={"enabled": True})
    for i in range(2):
        scenario.submit(ns_bor, f"b{i}", borrower, node=node, isolation="mps", memory_gib=20,
                        cores=50, preemptible=True, estimatedDuration="10m",
                        checkpoint={"gracePeriod": "1s"})
    for i in range(2):
        assert scenario.wait_phase(ns_bor, f"b{i}", {"Running"})["borrowed"] is True
    scenario.submit(ns_own, "owner", owner, cls="short", node=node, isolation="mps",
                    memory_gib=20, cores=50, estimatedDuration="1m", simulatedDuration="3s")
    done = scenario.wait_phase(ns_own, "owner", {"Succeeded"}, timeout=45)
    assert done["attempts"] == 1
    preempted = [i for i in range(2) if any(
        r.get("outcome") == "Preempted" for r in scenario.status(ns_bor, f"b{i}").get("history")
        or [])]
    assert len(preempted) == 1  # half a GPU was needed: one borrower went, not both


def test_the_victim_is_the_job_that_loses_least_since_its_reported_checkpoint(
        scenario: Scenario, tmp_path: Path) -> None:
    """Two preemptible jobs of one project hold a node's two GPUs; `older` has run longer but
    reports a checkpoint (through the node agent's reader, against this API server), `newer`
    never does, so it would lose everything since its start. A short job of another project
    needs one GPU: `older` goes, although by time since start it would lose more. Its next
    attempt learns that it resumes and from where; each attempt is billed on its own."""
    node = scenario.node(gpus=2)
    ns_lo, ns_hi = scenario.namespace("lo"), scenario.namespace("hi")
    lo = scenario.project("lo", [ns_lo], concurrent={"gpus": 2})
    hi = scenario.project("hi", [ns_hi], concurrent={"gpus": 1})
    for name in ("older", "newer"):
        scenario.submit(ns_lo, name, lo, node=node, preemptible=True, estimatedDuration="10m",
                        checkpoint={"gracePeriod": "1s"})
        scenario.wait_phase(ns_lo, name, {"Running"})
        time.sleep(4)  # older has run at least 4 s longer than newer

    pod = scenario.pod(ns_lo, "older-1")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert (env["CARPOOL_ATTEMPT"], env["CARPOOL_GRACE_PERIOD"]) == ("1", "1")
    assert "CARPOOL_RESUME_FROM" not in env
    root = tmp_path / "reports"
    directory = reports.prepare(root, pod["metadata"]["uid"])
    run = workload.Run.from_environment({**env, "CARPOOL_REPORT_DIR": str(directory)})
    run.report_checkpoint("/checkpoint/step-7", progress=0.3, wait_s=0)
    agent_cluster = KubernetesCluster(load_config(str(scenario.cluster.kubeconfig)), node)
    agent = reports.ReportReader(node, root, lambda: agent_cluster.pods_on_node(node),
                                 agent_cluster)
    assert asyncio.run(agent.step()) == [
        f"{ns_lo}/older-1: recorded checkpoint '/checkpoint/step-7' at "
        f"{checkpointing.format_time(_checkpoint_time(directory))}"]
    recorded = scenario.status(ns_lo, "older")
    assert (directory / checkpointing.ACK_FILE).read_text() == recorded["lastCheckpointTime"]
    assert recorded["lastCheckpoint"] == {"time": recorded["lastCheckpointTime"],
                                          "path": "/checkpoint/step-7", "progress": 0.3,
                                          "attempt": 1}

    scenario.submit(ns_hi, "urgent", hi, cls="short", node=node, estimatedDuration="1m",
                    simulatedDuration="3s")

    def preempted() -> Obj | None:
        status = scenario.status(ns_lo, "older")
        return status if any(r.get("outcome") == "Preempted" for r in _history(status)) \
            else None

    wait_for("older preempted", preempted, timeout=45)
    newer = scenario.status(ns_lo, "newer")
    assert newer["phase"] == "Running" and newer["attempts"] == 1, newer
    event = next(e for e in scenario.events(ns_lo, "older") if e["reason"] == "Preempted")
    assert "urgent" in event["message"], event

    second = wait_for("older's second attempt", lambda: (
        s if (s := scenario.status(ns_lo, "older")).get("attempts") == 2
        and s.get("phase") == "Running" else None), timeout=45)
    assert second["resumedProgress"] == 0.3
    pod2 = scenario.pod(ns_lo, "older-2")
    env2 = {e["name"]: e["value"] for e in pod2["spec"]["containers"][0]["env"]}
    assert env2["CARPOOL_ATTEMPT"] == "2"
    assert env2["CARPOOL_RESUME_FROM"] == "/checkpoint/step-7"
    first, current = _history(second)
    assert first["outcome"] == "Preempted" and "end" not in current
    assert second["gpuHours"] == pytest.approx(
        gpu_hours(1.0, _parse(first["start"]), _parse(first["end"])), abs=1e-4)


def _checkpoint_time(directory: Path) -> float:
    report = json.loads((directory / checkpointing.CHECKPOINT_FILE).read_text())
    return checkpointing.parse_time(report["time"])


def test_a_loop_reporting_progress_pulls_in_the_estimate_of_the_job_behind_it(
        scenario: Scenario, tmp_path: Path) -> None:
    """A job holds the node's one GPU; its user says an hour. Its code runs a real loop under
    `workload.Progress` (its reports carried into the status by the node agent's reader,
    against this API server), at a rate that ends it in about a minute, with an evaluation
    pause on the way. The job waiting behind it was told about an hour; once the reports
    land, its estimate follows the loop: within the loop's end, give or take the rounding
    and the pause."""
    node = scenario.node(gpus=1)
    ns = scenario.namespace("prog")
    project = scenario.project("prog", [ns], concurrent={"gpus": 2})
    scenario.submit(ns, "train", project, node=node, estimatedDuration="1h")
    scenario.wait_phase(ns, "train", {"Running"})
    scenario.submit(ns, "next", project, node=node, estimatedDuration="10m",
                    simulatedDuration="3s")

    def estimate() -> float | None:
        text = scenario.status(ns, "next").get("estimatedStart")
        return _parse(text) if text else None

    told = wait_for("next's first estimate", estimate, timeout=30)
    assert told - time.time() > 50 * 60, scenario.status(ns, "next")  # the user's hour

    pod = scenario.pod(ns, "train-1")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    directory = reports.prepare(tmp_path / "reports", pod["metadata"]["uid"])
    run = workload.Run.from_environment({**env, "CARPOOL_REPORT_DIR": str(directory)})
    agent_cluster = KubernetesCluster(load_config(str(scenario.cluster.kubeconfig)), node)
    agent = reports.ReportReader(node, tmp_path / "reports",
                                 lambda: agent_cluster.pods_on_node(node), agent_cluster)
    steps, step_s = 600, 0.1  # a minute of training, a third of it run here
    progress = workload.Progress(steps, run=run, every_s=2.0)
    began = time.time()
    for step in range(1, steps // 3 + 1):
        time.sleep(step_s)
        progress.update(step)
        if step == 100:
            with progress.pause("eval"):
                time.sleep(2.0)
        if step % 20 == 0:
            asyncio.run(agent.step())
    progress.report()  # where it stands now, not where the last timed report left it
    asyncio.run(agent.step())
    recorded = scenario.status(ns, "train")["progress"]
    assert recorded["step"] == steps // 3 and recorded["total"] == steps
    assert recorded["paused"] >= 2.0 and len(recorded["recent"]) >= 8, recorded
    # the rest: 400 steps of 0.1 s at the rate the samples show (the pause not counted as
    # training), a little more for pauses to come in the share they took so far
    rate_end = time.time() + (steps - steps // 3) * step_s
    tightened = wait_for("next's estimate to follow the reports", lambda: (
        e if (e := estimate()) is not None and e - time.time() < 10 * 60 else None),
        timeout=30)
    assert rate_end - 15 <= tightened <= rate_end + 30, (
        tightened - began, rate_end - began, recorded)
