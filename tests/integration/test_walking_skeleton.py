"""One GpuJob end to end through the real components.

kubectl apply → operator (kopf) admits and creates the pod → the real kube-scheduler asks the
Carpool extender (filter, prioritize, bind) → the pod is bound to a simulated GPU node with its
GPU assignment → KWOK runs and completes it → the job is Succeeded with node and GPU recorded.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import devcluster, simnodes
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster


def _job(cluster: devcluster.Cluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "gpujob", name, "-n", namespace, "-o", "json").stdout
    return dict(json.loads(out))


def test_gpujob_runs_through_operator_scheduler_extender_and_kwok(
        cluster: devcluster.Cluster, carpool_stack: dict[str, Any]) -> None:
    suffix = uuid.uuid4().hex[:6]
    namespace, project, node_name = f"skel-{suffix}", f"skel-{suffix}", f"skel-node-{suffix}"
    api = cluster.api()
    node = simnodes.parse_nodes({"nodes": [{
        "name": node_name, "zone": "zone-a", "sharing": "mps",
        "gpus": [{"model": "H200", "count": 2, "temperatureC": 40}],
    }]})[0]
    simnodes.apply_nodes(api, [node])
    cluster.kubectl("create", "namespace", namespace)
    manifests = [
        {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
         "metadata": {"name": project},
         "spec": {"namespaces": [namespace], "concurrent": {"gpus": 4}}},
        {"apiVersion": names.API_VERSION, "kind": "GpuJob",
         "metadata": {"name": "train", "namespace": namespace},
         "spec": {"project": project, "class": "short",
                  "gpu": {"count": 1, "memory": "20Gi", "cores": 50, "isolation": "mps",
                          "models": ["H200"]},
                  "estimatedDuration": "10m", "simulatedDuration": "4s",
                  "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": node_name},
                                        "containers": [{"name": "main", "image": "trainer"}]}}}},
    ]
    try:
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests))
        phases_seen: list[str] = []

        def finished() -> dict[str, Any] | None:
            job = _job(cluster, namespace, "train")
            phase = (job.get("status") or {}).get("phase")
            if phase and (not phases_seen or phases_seen[-1] != phase):
                phases_seen.append(phase)
            return job if phase in ("Succeeded", "Failed") else None

        job = wait_for("the job to finish", finished, timeout=120, interval=0.2)
        status = job["status"]
        assert status["phase"] == "Succeeded", status
        assert status["node"] == node_name
        assert len(status["gpus"]) == 1 and status["gpus"][0]["uuid"]
        assert status["attempts"] == 1
        assert status["gpuHours"] if "gpuHours" in status else status["history"][0]["end"]
        # Phases are sampled, so fast ones may be missed; the order must hold.
        order = ["Queued", "Admitted", "Running", "Succeeded"]
        assert phases_seen == sorted(phases_seen, key=order.index), phases_seen
        assert phases_seen[-1] == "Succeeded"

        pod = json.loads(cluster.kubectl("get", "pod", status["podName"], "-n", namespace,
                                         "-o", "json").stdout)
        assignment = json.loads(pod["metadata"]["annotations"][names.ANN_ASSIGNMENT])
        assert pod["spec"]["nodeName"] == node_name
        assert pod["spec"]["schedulerName"] == names.SCHEDULER_NAME
        assert assignment["gpus"][0]["uuid"] == status["gpus"][0]["uuid"]
        assert assignment["gpus"][0]["memoryMiB"] == 20 * 1024

        events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
        reasons = {e["reason"] for e in json.loads(events)["items"]}
        assert {"Admitted", "Succeeded"} <= reasons, reasons
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "projectquota", project, check=False)
        simnodes.delete_nodes(api, [node_name])
