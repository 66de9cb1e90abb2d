"""Preemptible whole-GPU jobs placed as MPS shares of their calibrated size on the real API
server, scheduler and extender, as a tenant acts.

The platform team sets `spec.rightSizing.placePreemptible` and `shareWholeGpus` on bob's
ProjectQuota. bob (`edit` in his namespace, `kubectl --as`) runs three preemptible sweeps
asking for a whole GPU on a simulated node; its device plugin reports each pod's peak at
8 GiB, and they finish. His fourth sweep is placed as an MPS client of the template's
calibrated size, 10 GiB (8 GiB plus a fifth, in whole GiB; at most three quarters of the node's
80 GiB GPU): its pod's isolation and limit and
its GPUs say so, and the extender bound it as the operator's planned assignment grants. Then
its run fails (as an MPS client over its memory limit does): it is queued again with reason
OutgrewCalibration and runs as asked, on a whole GPU.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "share"  # the tenants' names (the `world` fixture)

GIB = 1024


def sweep(name: str, project: str, node: str, model: str, seconds: int | None
          ) -> dict[str, Any]:
    # its GPU model named: a share is measured against the smallest GPU it may get
    spec: dict[str, Any] = {
        "project": project, "class": "batch", "preemptible": True,
        "gpu": {"count": 1, "memory": "80Gi", "isolation": "exclusive", "models": [model]},
        "checkpoint": {"gracePeriod": "5s"}, "estimatedDuration": "10m",
        "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                              "containers": [{"name": "main", "image": "lab/sweep:1"}]}}}
    if seconds is not None:
        spec["simulatedDuration"] = f"{seconds}s"
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": spec}


def test_a_whole_gpu_job_runs_as_an_mps_share_of_its_calibrated_size_and_again_whole(
        world: tenants.World) -> None:
    model = world.name("m")
    node = world.node("gpu", model)
    team = world.namespace("sweeps")
    world.apply_cluster_scoped(user_roles(world))
    project = world.project("sweeps", [team])
    world.admin("patch", "projectquota", project, "--type=merge", "-p", json.dumps(
        {"spec": {"rightSizing": {"placePreemptible": True, "shareWholeGpus": True}}}))
    bob = tenant(world, team, "bob")
    wait_for("the GpuJob roles to aggregate into edit",
             lambda: tenants.can_create_gpujobs(world, bob, team))
    with tenants.peaks_reported(world, team, node, 8 * GIB):
        tenants.finish_runs(bob, team, [sweep(f"sweep-{i}", project, node, model, 8)
                                        for i in range(1, 4)], 8 * GIB)
        bob.kubectl("create", "-n", team, "-f", "-",
                    stdin=yaml.safe_dump(sweep("sweep-4", project, node, model, None)))
        running = wait_for("sweep-4 running", lambda: (
            s if (s := bob.status(team, "sweep-4")).get("phase") == "Running" else None),
            timeout=60, interval=0.5)
        assert running["gpus"][0]["memoryMiB"] == 10 * GIB, running
        pod = json.loads(bob.kubectl("get", "pod", "-n", team, running["podName"], "-o",
                                     "json"))
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[names.RESOURCE_GPU_MEMORY] == "10", limits
        annotations = pod["metadata"]["annotations"]
        assert annotations[names.ANN_ISOLATION] == "mps", annotations
        assert names.ANN_PLANNED in annotations

        # its run fails at the fence (an MPS client out of memory at its limit exits)
        world.patch_status(["pod", "-n", team, running["podName"]], {
            "phase": "Failed", "containerStatuses": [{
                "name": "main", "image": "lab/sweep:1", "imageID": "", "ready": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]})
        again = wait_for("sweep-4 running again as asked", lambda: (
            s if (s := bob.status(team, "sweep-4")).get("attempts") == 2
            and s.get("phase") == "Running" else None), timeout=60, interval=0.5)
        assert again["calibrationOutgrown"] is True, again
        assert again["gpus"][0]["memoryMiB"] > 10 * GIB, again  # the whole GPU
        assert again["history"][0]["outcome"] == "OutgrewCalibration", again
        pod = json.loads(bob.kubectl("get", "pod", "-n", team, again["podName"], "-o", "json"))
        assert pod["metadata"]["annotations"][names.ANN_ISOLATION] == "exclusive"
        events = json.loads(world.admin("get", "events", "-n", team, "-o", "json"))["items"]
        told = [e["message"] for e in events if e.get("reason") == "Requeued"]
        assert any("below the whole GPU it asks for" in m for m in told), told
