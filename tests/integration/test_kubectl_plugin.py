"""`kubectl carpool` against the real API server, run the way users run it: the installed
`kubectl-carpool` found by kubectl's plugin lookup on PATH.

`kubectl` itself runs the plugin in the lookup and error tests; the other checks call the
plugin's `main` in-process (same code, same API server) to save an interpreter start per call.
The test writes GpuJobs, a ProjectQuota and a GpuNode with statuses (through the status
subresource, as the operator and device plugin do) and a pod Carpool's scheduler places
carrying an assignment (and a look-alike with Carpool's label that another scheduler places),
then checks the commands' output. A Carpool operator may be running on the shared cluster and
would rewrite the statuses it owns; each check therefore writes the statuses, runs the
command, and retries if any of the test's objects changed meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from carpool.cli import kubectl_plugin
from carpool.core import names
from carpool.core.timestamps import format_timestamp as format_time
from carpool_testbed import crds, devcluster
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
Obj = dict[str, Any]
PLUGIN = Path(sys.executable).parent / "kubectl-carpool"


@dataclass
class Scene:
    namespace: str
    holders: str  # the namespace of the pod holding a GPU share
    project: str
    node: str
    custom: Any
    now: float

    def job_status(self, name: str) -> Obj:
        return STATUSES[name](self.now)


def job_body(name: str, project: str, job_class: str, count: int, memory: str) -> Obj:
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": project, "class": job_class,
                     "gpu": {"count": count, "memory": memory, "isolation": "mps"},
                     "maxDuration": "2h",
                     "template": {"spec": {"restartPolicy": "Never", "containers": [
                         {"name": "main", "image": "busybox"}]}}}}


STATUSES: dict[str, Callable[[float], Obj]] = {
    "train": lambda now: {"phase": "Queued", "queuePosition": 7, "reason": "Quota",
                          "message": "over the project's guarantee",
                          "estimatedStart": format_time(now + 1200)},
    "done": lambda now: {"phase": "Succeeded", "gpuHours": 1.5, "history": [
        {"attempt": 1, "node": "n", "fraction": 0.5, "start": format_time(now - 4 * 3600),
         "end": format_time(now - 3600)}]},
    "serving": lambda now: {"phase": "Running", "node": "n", "history": [
        {"attempt": 1, "node": "n", "fraction": 0.25, "start": format_time(now - 2 * 3600)}]},
}


@pytest.fixture(scope="module")
def scene(cluster: devcluster.Cluster) -> Iterator[Scene]:
    api = cluster.api()
    crds.apply_crds(api)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    suffix = uuid.uuid4().hex[:6]
    namespace = project = f"plugin-{suffix}"
    node = f"plugin-gpu-{suffix}"
    holders = f"plugin-holders-{suffix}"
    core.create_namespace({"metadata": {"name": namespace}})
    custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, {
        "apiVersion": names.API_VERSION, "kind": "ProjectQuota", "metadata": {"name": project},
        "spec": {"namespaces": [namespace], "gpuHours": {"budget": 50, "period": "7d"},
                 "concurrent": {"gpus": 1}}})
    for name, job_class, count, memory in (("train", "long", 2, "40Gi"),
                                           ("done", "short", 1, "16Gi"),
                                           ("serving", "interactive", 1, "16Gi")):
        custom.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace,
                                               names.GPUJOB_PLURAL,
                                               job_body(name, project, job_class, count, memory))
    custom.create_cluster_custom_object(names.GROUP, names.VERSION, names.GPUNODE_PLURAL, {
        "apiVersion": names.API_VERSION, "kind": "GpuNode", "metadata": {"name": node}})
    assignment = json.dumps({"node": node, "gpus": [{"uuid": f"GPU-{suffix}-0", "index": 0,
                                                     "memoryMiB": 30 * 1024, "cores": 40}]})
    # The pod holding a share, in a namespace of no project (an operator running on the shared
    # cluster meanwhile stops a GPU pod of a project namespace that is no job's attempt):
    # placed by Carpool's scheduler like a job's pod, without Carpool's labels; a node
    # selector no node matches keeps it Pending, holding its assignment.
    core.create_namespace({"metadata": {"name": holders}})
    core.create_namespaced_pod(holders, {"metadata": {
        "name": "holder", "annotations": {names.ANN_ASSIGNMENT: assignment}},
        "spec": {"schedulerName": names.SCHEDULER_NAME,
                 "nodeSelector": {"carpool.dev/plugin-test": "no-such-node"},
                 "containers": [{"name": "main", "image": "busybox"}]}})
    # a look-alike with Carpool's label and an assignment on the same GPU, placed by another
    # scheduler: it holds no Carpool GPU and is not shown
    core.create_namespaced_pod(holders, {"metadata": {
        "name": "look-alike", "labels": {names.LABEL_MANAGED: "true"},
        "annotations": {names.ANN_ASSIGNMENT: assignment}},
        "spec": {"schedulerName": "carpool-plugin-test-nobody",
                 "containers": [{"name": "main", "image": "busybox"}]}})
    scene = Scene(namespace, holders, project, node, custom, time.time())
    try:
        yield scene
    finally:
        for delete in (
            lambda: custom.delete_cluster_custom_object(
                names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, project),
            lambda: custom.delete_cluster_custom_object(
                names.GROUP, names.VERSION, names.GPUNODE_PLURAL, node),
            lambda: core.delete_namespace(namespace),
            lambda: core.delete_namespace(holders),
        ):
            with contextlib.suppress(client.ApiException):
                delete()
        api.close()


def write_statuses(scene: Scene) -> dict[str, str]:
    """(Re)write every status the test relies on; returns the objects' resourceVersions."""
    versions = {}
    c, g, v = scene.custom, names.GROUP, names.VERSION
    for name in STATUSES:
        obj = c.patch_namespaced_custom_object_status(
            g, v, scene.namespace, names.GPUJOB_PLURAL, name,
            {"status": scene.job_status(name)})
        versions[name] = obj["metadata"]["resourceVersion"]
    quota = c.patch_cluster_custom_object_status(g, v, names.PROJECTQUOTA_PLURAL, scene.project, {
        "status": {"usedGpuHours": 49, "remainingGpuHours": 1.0,
                   "periodStart": format_time(scene.now - 86400),
                   "running": {"gpus": 0.75, "jobs": 1}, "borrowed": {"gpus": 0},
                   "pending": 1, "memoryEfficiency": 0.5}})
    versions["quota"] = quota["metadata"]["resourceVersion"]
    gpunode = c.patch_cluster_custom_object_status(g, v, names.GPUNODE_PLURAL, scene.node, {
        "status": {"sharingMode": "mps", "heartbeat": format_time(time.time()),
                   "driverVersion": "580.95", "cudaVersion": "13.0",
                   "gpus": [{"index": 0, "uuid": f"GPU-{scene.node.split('-')[-1]}-0",
                             "model": "H200", "memoryTotalMiB": 143771,
                             "memoryUsedMiB": 10240, "temperatureC": 52,
                             "slowdownTemperatureC": 90, "utilizationPct": 30,
                             "health": "Healthy"}]}})
    versions["gpunode"] = gpunode["metadata"]["resourceVersion"]
    return versions


def current_versions(scene: Scene) -> dict[str, str]:
    c, g, v = scene.custom, names.GROUP, names.VERSION
    out = {name: c.get_namespaced_custom_object(g, v, scene.namespace, names.GPUJOB_PLURAL,
                                                name)["metadata"]["resourceVersion"]
           for name in STATUSES}
    out["quota"] = c.get_cluster_custom_object(g, v, names.PROJECTQUOTA_PLURAL, scene.project
                                               )["metadata"]["resourceVersion"]
    out["gpunode"] = c.get_cluster_custom_object(g, v, names.GPUNODE_PLURAL, scene.node
                                                 )["metadata"]["resourceVersion"]
    return out


def kubectl_carpool(cluster: devcluster.Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl carpool ARGS` with the venv's kubectl-carpool first on PATH."""
    env = dict(os.environ, PATH=f"{PLUGIN.parent}{os.pathsep}{os.environ.get('PATH', '')}",
               KUBECONFIG=str(cluster.kubeconfig))
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "carpool", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def run_in_process(cluster: devcluster.Cluster, *args: str) -> str:
    """The plugin's `main` in this process (same reader, no interpreter start-up per call)."""
    out = io.StringIO()
    code = kubectl_plugin.main([*args, "--kubeconfig", str(cluster.kubeconfig)], out=out)
    assert code == 0
    return out.getvalue()


def settled(cluster: devcluster.Cluster, scene: Scene, *args: str) -> str:
    """Output of `kubectl carpool ARGS` computed from exactly the statuses the test wrote."""
    for _ in range(8):
        before = write_statuses(scene)
        output = run_in_process(cluster, *args)
        if current_versions(scene) == before:
            return output
        time.sleep(0.5)
    raise AssertionError("the test's objects kept changing under it")


def test_plugin_is_found_by_kubectl(cluster: devcluster.Cluster) -> None:
    result = kubectl_carpool(cluster, "--help")
    assert result.returncode == 0, result.stderr
    for command in ("queue", "why", "quota", "nodes", "report"):
        assert command in result.stdout


def test_queue(cluster: devcluster.Cluster, scene: Scene) -> None:
    data = json.loads(settled(cluster, scene, "queue", "-n", scene.namespace, "-o", "json"))
    assert [(j["name"], j["position"], j["reason"]) for j in data["jobs"]] == [
        ("train", 7, "Quota")]
    (group,) = data["groups"]
    assert (group["project"], group["job_class"], group["waiting"], group["gpus"]) == (
        scene.project, "long", 1, 2)
    text = settled(cluster, scene, "queue", "--project", scene.project)
    (row,) = [line for line in text.splitlines() if f"{scene.namespace}/train" in line]
    assert row.split()[:6] == ["7", f"{scene.namespace}/train", scene.project, "long", "2",
                               "40Gi"]
    assert "Quota" in row and "in 20m" in row


def test_why(cluster: devcluster.Cluster, scene: Scene) -> None:
    text = settled(cluster, scene, "why", "train", "-n", scene.namespace)
    assert text.startswith(f"{scene.namespace}/train waits: Quota - over the project's")
    findings = {line.split()[0]: line for line in text.splitlines()[3:] if line.strip()}
    assert "BLOCKING" in findings["quota"]
    # 2 x 40Gi on a 143771 MiB H200 is 0.57 GPU equivalents; 0.75 + 0.57 > 1 guaranteed
    assert (f"project {scene.project} runs 0.75 GPU(s) (0 borrowed) of 1 guaranteed; this job "
            f"needs 0.57 more; over the guarantee and borrowing is off") in findings["quota"]
    assert "BLOCKING" in findings["budget"]
    assert ("budget 50 GPU-hours per 7d: 49 used, 1 remaining; this job may use 1.14 "
            "(0.57 GPU x 2h)") in findings["budget"]
    assert "queue position 7" in findings["queue"]
    data = json.loads(settled(cluster, scene, "why", f"{scene.namespace}/train", "-o", "json"))
    assert {f["topic"] for f in data["findings"]} >= {"status", "queue", "quota", "budget",
                                                       "capacity", "constraints"}


def test_why_missing_job(cluster: devcluster.Cluster, scene: Scene) -> None:
    result = kubectl_carpool(cluster, "why", "no-such-job", "-n", scene.namespace)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: GpuJob 'no-such-job' not found in namespace "
                                     f"'{scene.namespace}' (kubectl get gpujobs -n "
                                     f"{scene.namespace})")


def test_quota(cluster: devcluster.Cluster, scene: Scene) -> None:
    text = settled(cluster, scene, "quota", "-n", scene.namespace)
    header, row = text.splitlines()
    assert header.split()[:6] == ["PROJECT", "BUDGET", "PERIOD", "USED", "REMAINING", "USED%"]
    assert row.split()[:6] == [scene.project, "50", "7d", "49", "1", "98%"]
    (view,) = json.loads(settled(cluster, scene, "quota", "-n", scene.namespace, "-o", "json"))
    assert view["memory_efficiency"] == 0.5 and view["pending"] == 1


def test_nodes(cluster: devcluster.Cluster, scene: Scene) -> None:
    data = json.loads(settled(cluster, scene, "nodes", "-o", "json"))
    (node,) = [n for n in data if n["name"] == scene.node]
    (gpu,) = node["gpus"]
    assert (gpu["model"], gpu["memory_used_mib"], gpu["memory_assigned_mib"]) == (
        "H200", 10240, 30 * 1024)
    assert [(s["namespace"], s["pod"]) for s in gpu["shares"]] == [(scene.holders, "holder")]
    text = settled(cluster, scene, "nodes")
    (row,) = [line for line in text.splitlines() if line.startswith(scene.node)]
    assert "52/90C" in row and f"{scene.holders}/holder(30.0Gi,40%)" in row
    assert "look-alike" not in text


def test_report(cluster: devcluster.Cluster, scene: Scene) -> None:
    text = settled(cluster, scene, "report", "--since", "1d", "-n", scene.namespace, "-o",
                   "csv")
    header, row = text.splitlines()
    assert header == "project,jobs,runs,gpu_hours,share"
    project, jobs, runs, hours, share = row.split(",")
    # done: 0.5 GPU x 3h = 1.5; serving: 0.25 GPU x ~2h (still running) = ~0.5
    assert (project, jobs, runs, share) == (scene.project, "2", "2", "1.0000")
    assert 1.99 < float(hours) < 2.05


def test_no_cluster(cluster: devcluster.Cluster, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    result = subprocess.run([str(PLUGIN), "queue", "--kubeconfig", str(kubeconfig)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot reach the cluster:")


def test_quota_shows_where_finished_jobs_asked_for_far_more_memory_than_they_used(
        cluster: devcluster.Cluster) -> None:
    """Three finished runs of one template asked for 40 GiB a GPU and peaked near 5 GiB:
    `kubectl carpool quota` advises 6 GiB (their 90th-percentile peak + 20 %), and `why` says
    so of a fourth run that waits."""
    api = cluster.api()
    crds.apply_crds(api)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    namespace = project = f"plugin-sizes-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        custom.create_cluster_custom_object(
            names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL,
            {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
             "metadata": {"name": project}, "spec": {"namespaces": [namespace]}})
        for i, peak in enumerate((4800, 5000, 5100), start=1):
            body = job_body(f"resnet-{i}", project, "batch", 1, "40Gi")
            body["spec"]["template"]["spec"]["containers"][0]["image"] = "lab/resnet:3"
            custom.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace,
                                                   names.GPUJOB_PLURAL, body)
            custom.patch_namespaced_custom_object_status(
                names.GROUP, names.VERSION, namespace, names.GPUJOB_PLURAL, f"resnet-{i}",
                {"status": {"phase": "Succeeded", "peakMemoryMiB": peak}})
        result = kubectl_carpool(cluster, "quota", "-n", namespace)
        assert result.returncode == 0, result.stderr
        assert "Right-sizing: finished jobs of these templates used far less GPU memory" \
            in result.stdout, result.stdout
        rows = [line.split() for line in result.stdout.splitlines()
                if line.startswith(project)]
        assert [project, "resnet@lab/resnet:3", "3", "40.0", "5.0", "6.0"] in rows, result.stdout
        # a fourth run waits: `why` says what its template's runs used
        body = job_body("resnet-4", project, "batch", 1, "40Gi")
        body["spec"]["template"]["spec"]["containers"][0]["image"] = "lab/resnet:3"
        custom.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace,
                                               names.GPUJOB_PLURAL, body)
        custom.patch_namespaced_custom_object_status(
            names.GROUP, names.VERSION, namespace, names.GPUJOB_PLURAL, "resnet-4",
            {"status": {"phase": "Queued", "reason": "Capacity"}})
        why = wait_for("why answers (a CRD just applied may still initialize its storage)",
                       lambda: w if (w := kubectl_carpool(cluster, "why", "resnet-4", "-n",
                                                          namespace)).returncode == 0 else None,
                       timeout=30, interval=1.0)
        assert ("3 finished runs of resnet@lab/resnet:3 peaked at 5.0 GiB (90th percentile); "
                "asking for 6 GiB instead of 40 GiB") in " ".join(why.stdout.split()), why.stdout
    finally:
        with contextlib.suppress(client.ApiException):
            custom.delete_cluster_custom_object(names.GROUP, names.VERSION,
                                                names.PROJECTQUOTA_PLURAL, project)
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(namespace)
        api.close()
