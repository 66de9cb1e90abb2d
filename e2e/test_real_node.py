"""A real kubelet runs Carpool GPU pods: scheduler + extender → kubelet → device plugin → container.

The node is real (kubelet v1.35.4, containerd 1.7 with CDI, runc, a CNI bridge); its GPUs come
from the device plugin's fake backend (2 × H200, 4 shares each), whose CDI spec backs each GPU's
device node with /dev/null. Each test checks what the container itself sees (its environment
and the device nodes the runtime gave it) against what the extender decided at bind
(`carpool.dev/assignment`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool.core.shares import ShareId
from carpool_testbed import realnode, stack


def _annotation(pod: dict[str, Any], key: str) -> dict[str, Any]:
    text = (pod["metadata"].get("annotations") or {}).get(key)
    assert text, f"pod {pod['metadata']['name']} has no {key} annotation"
    return dict(json.loads(text))


CONTROL_NODES = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}


def _device_nodes(env: dict[str, str]) -> set[str]:
    return {n for n in env.get("DEVICE_NODES", "").split(",") if n}


def _assert_env_matches_assignment(env: dict[str, str], assignment: dict[str, Any],
                                   isolation: str) -> None:
    uuids = [g["uuid"] for g in assignment["gpus"]]
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    # the GPUs come from the runtime through CDI: exactly the assigned GPUs' device nodes (and
    # the control nodes), and nothing for a runtime that would read the variable
    assert _device_nodes(env) == {f"nvidia{g['index']}" for g in assignment["gpus"]
                                  } | CONTROL_NODES, env
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CARPOOL_ISOLATION"] == isolation
    if isolation != "mps":
        assert not any(key.startswith("CUDA_MPS_") for key in env), env
        return
    limits = ",".join(f"{n}={g['memoryMiB'] // 1024}G" for n, g in enumerate(assignment["gpus"]))
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == limits
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(max(g["cores"]
                                                               for g in assignment["gpus"]))
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/carpool/mps"
    assert env.get("MPS_PIPE_MOUNTED") == "yes", "the plugin's MPS pipe mount is missing"


@pytest.mark.parametrize(
    ("isolation", "gpus", "memory_gib", "cores"),
    [("mps", 1, 16, 25), ("mps", 2, 8, 50), ("exclusive", 1, 0, 0)],
    ids=["mps-1gpu", "mps-2gpus", "exclusive-1gpu"],
)
def test_container_sees_exactly_the_gpus_the_extender_assigned(
        pods: Any, real_node: realnode.RealNode, isolation: str, gpus: int, memory_gib: int,
        cores: int) -> None:
    name = pods.create(pods.manifest(f"env-{isolation}-{gpus}", gpus, memory_gib, cores,
                                     isolation))
    env = pods.wait_printed(name)
    pod = pods.get(name)
    assert pod["spec"]["nodeName"] == real_node.name
    assignment = _annotation(pod, names.ANN_ASSIGNMENT)
    assert assignment["node"] == real_node.name
    assert len(assignment["gpus"]) == gpus
    if memory_gib:
        assert all(g["memoryMiB"] == memory_gib * 1024 for g in assignment["gpus"])
    _assert_env_matches_assignment(env, assignment, isolation)
    assert f"/pod{pod['metadata']['uid']}/" in env["POD_CGROUP"], "not in the pod's cgroup"
    allocated = _annotation(pod, names.ANN_ALLOCATED)["containers"]["main"]
    assert allocated["gpus"] == [g["uuid"] for g in assignment["gpus"]]
    assert sorted(ShareId.parse(d).gpu_uuid for d in allocated["deviceIDs"]) == sorted(
        allocated["gpus"])


def test_gpujob_runs_on_the_real_node(pods: Any, real_node: realnode.RealNode,
                                      carpool_stack: Path) -> None:
    """The operator's pod for a GpuJob: admitted, placed, started, env printed, Succeeded."""
    suffix = uuid.uuid4().hex[:6]
    namespace = project = f"e2e-{suffix}"
    spec = pods.manifest("unused", 1)["spec"]
    template = {"spec": {k: v for k, v in spec.items()
                         if k in ("nodeSelector", "tolerations", "dnsPolicy",
                                  "terminationGracePeriodSeconds")}}
    template["spec"]["restartPolicy"] = "Never"
    main = dict(spec["containers"][0])
    main.pop("resources")
    main["command"] = ["/bin/sh", "-c", "env | grep -E '^(CUDA|NVIDIA|CARPOOL)_' | sort; "
                       + realnode.PRINT_DEVICE_NODES + "echo DONE"]
    template["spec"]["containers"] = [main]
    manifests = [
        {"apiVersion": names.API_VERSION, "kind": "ProjectQuota", "metadata": {"name": project},
         "spec": {"namespaces": [namespace], "concurrent": {"gpus": 2}}},
        {"apiVersion": names.API_VERSION, "kind": "GpuJob",
         "metadata": {"name": "print-env", "namespace": namespace},
         "spec": {"project": project, "class": "short",
                  "gpu": {"count": 1, "memory": "12Gi", "cores": 50, "isolation": "mps",
                          "models": ["H200"]},
                  "estimatedDuration": "5m", "template": template}},
    ]
    real_node.kubectl("create", "namespace", namespace)
    try:
        real_node.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests))

        seen: list[dict[str, Any]] = [{}]

        def finished() -> dict[str, Any] | None:
            seen[0] = json.loads(real_node.kubectl("get", "gpujob", "print-env", "-n",
                                                   namespace, "-o", "json").stdout)
            phase = (seen[0].get("status") or {}).get("phase")
            return seen[0] if phase in ("Succeeded", "Failed") else None

        try:
            job = pods.wait_for("the GpuJob to finish", finished, timeout=60)
        except AssertionError as error:
            events = real_node.kubectl("get", "events", "-n", namespace, check=False).stdout
            operator_log = stack.log_tail(carpool_stack / "operator.log", 15)
            raise AssertionError(f"{error}\njob status: {seen[0].get('status')}\n{events}"
                                 f"\noperator log:\n{operator_log}") from None
        status = job["status"]
        assert status["phase"] == "Succeeded", status
        assert status["node"] == real_node.name
        env = pods.wait_printed(status["podName"], namespace)
        pod = pods.get(status["podName"], namespace)
        assignment = _annotation(pod, names.ANN_ASSIGNMENT)
        assert [g["uuid"] for g in status["gpus"]] == [g["uuid"] for g in assignment["gpus"]]
        assert assignment["gpus"][0]["memoryMiB"] == 12 * 1024
        _assert_env_matches_assignment({**env, "MPS_PIPE_MOUNTED": "yes"}, assignment, "mps")
    finally:
        real_node.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        real_node.kubectl("delete", "projectquota", project, check=False)


def test_an_image_asking_for_every_gpu_gets_none_without_a_grant_and_only_its_own_with_one(
        pods: Any, real_node: realnode.RealNode) -> None:
    """CUDA images set NVIDIA_VISIBLE_DEVICES=all. Without a Carpool grant such a pod gets no
    GPU device node, nor does one that names a CDI device in its annotations; with a grant it
    gets exactly its GPU, and Carpool's answer overrides the image's variable."""
    gpunode = json.loads(real_node.kubectl("get", "gpunode", real_node.name, "-o",
                                           "json").stdout)
    gpu = gpunode["status"]["gpus"][0]["uuid"]
    bare = pods.manifest("image-all-gpus", 0, image=realnode.ALL_GPUS_IMAGE)
    bare["metadata"]["annotations"]["cdi.k8s.io/carpool"] = f"carpool.dev/gpu={gpu}"
    env = pods.wait_printed(pods.create(bare))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"  # the image's own, as the runtime saw it
    assert _device_nodes(env) == set(), env
    granted = pods.create(pods.manifest("image-all-gpus-granted", 1, 8, 25,
                                        image=realnode.ALL_GPUS_IMAGE))
    env = pods.wait_printed(granted)
    _assert_env_matches_assignment({**env, "MPS_PIPE_MOUNTED": "yes"},
                                   _annotation(pods.get(granted), names.ANN_ASSIGNMENT), "mps")


def test_pod_resources_api_reports_the_assigned_shares(
        pods: Any, pod_resources: Any, real_node: realnode.RealNode) -> None:
    """Two pods share the node; the kubelet's own record matches the plugin's and the
    extender's, and each pod holds a different share."""
    allocatable = pod_resources.allocatable()
    assert len(allocatable[names.RESOURCE_GPU]) == real_node.expected_shares()
    first = pods.create(pods.manifest("shares-a", 1, 16, 25))
    second = pods.create(pods.manifest("shares-b", 1, 16, 25))
    held: dict[str, list[str]] = {}
    for name in (first, second):
        pods.wait_printed(name)
        pod = pods.get(name)
        assignment = _annotation(pod, names.ANN_ASSIGNMENT)
        allocated = _annotation(pod, names.ANN_ALLOCATED)["containers"]["main"]
        devices = pod_resources.devices()[("default", name, "main")]
        held[name] = devices[names.RESOURCE_GPU]
        assert held[name] == allocated["deviceIDs"]
        assert [ShareId.parse(d).gpu_uuid for d in held[name]] == [
            g["uuid"] for g in assignment["gpus"]]
        assert set(held[name]) <= set(allocatable[names.RESOURCE_GPU])
    assert not set(held[first]) & set(held[second]), held


def test_the_plugin_refuses_a_pod_no_gpujob_owns(pods: Any,
                                                 real_node: realnode.RealNode) -> None:
    """Defence in depth at the kubelet: with the plugin as the chart runs it (no
    --allow-unowned-pods), a bare GPU pod that got a GPU assignment (here from the test bed's
    permissive extender) is refused at Allocate, and the kubelet puts the reason on the pod."""
    bed = real_node.settings
    try:
        real_node.restart_plugin(dataclasses.replace(bed, serve_unowned=False))
        name = pods.create(pods.manifest("unowned", 1, 8, 25))
        status = pods.wait_for("the kubelet to refuse the pod", lambda: (
            s := pods.get(name).get("status") or {}).get("phase") == "Failed" and s,
            timeout=90, interval=0.5)
        assert status["reason"] == "UnexpectedAdmissionError", status
        assert "PermissionDenied" in status["message"], status
        assert f"pod default/{name} is not owned by a GpuJob" in status["message"], status
        assert names.ANN_ALLOCATED not in (pods.get(name)["metadata"].get("annotations") or {})
    finally:
        real_node.restart_plugin(bed)


def test_plugin_reregisters_after_kubelet_restart_and_new_pods_start(
        pods: Any, pod_resources: Any, real_node: realnode.RealNode) -> None:
    before = pods.create(pods.manifest("before-restart", 1, 16, 25))
    pods.wait_printed(before)
    registrations = real_node.registrations()
    assert registrations >= 1

    start = time.monotonic()
    assert real_node.stop_kubelet()
    real_node.start_kubelet()
    pods.wait_for("the plugin to register with the new kubelet",
                  lambda: real_node.registrations() > registrations, timeout=60, interval=0.2)
    pods.timings.stages.append(("kubelet restart → plugin registered again",
                                time.monotonic() - start))
    real_node.wait_ready(timeout=60)
    real_node.wait_shares(timeout=60)
    pods.timings.stages.append(("kubelet restart → node Ready with all shares",
                                time.monotonic() - start))

    # The running container survived the restart, and the kubelet still knows its share
    # (it can report the node Ready before it has listed its running pods' devices again).
    assert pods.get(before)["status"]["phase"] == "Running"
    pods.wait_for("the restarted kubelet to list the running pod's share",
                  lambda: (pod_resources.devices().get(("default", before, "main")) or {})
                  .get(names.RESOURCE_GPU), timeout=60, interval=0.2)

    after = pods.create(pods.manifest("after-restart", 1, 16, 25))
    env = pods.wait_printed(after)
    _assert_env_matches_assignment(env, _annotation(pods.get(after), names.ANN_ASSIGNMENT),
                                   "mps")


def test_pod_asking_for_more_gpus_than_the_node_has_stays_pending_with_a_reason(
        pods: Any, real_node: realnode.RealNode) -> None:
    name = pods.create(pods.manifest("too-many", 3, 8, 0))

    def refused() -> str | None:
        for event in pods.events(name):
            if event["reason"] == "FailedScheduling":
                return str(event["message"])
        return None

    message = pods.wait_for("a FailedScheduling event", refused, timeout=60)
    # The scheduler folds the extender's per-node reason into its summary: it must say that
    # Carpool refused the node and why (e.g. "1 carpool: 2 of 3 GPUs fit").
    assert "0/1 nodes are available" in message, message
    assert "carpool" in message and "GPU" in message and "3" in message, message
    pod = pods.get(name)
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    assert names.ANN_ASSIGNMENT not in (pod["metadata"].get("annotations") or {})
    condition = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable"
