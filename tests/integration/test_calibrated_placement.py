"""Preemptible jobs placed by their calibrated size on the real API server, scheduler and
extender, as a tenant acts.

The platform team sets `spec.rightSizing` on bob's ProjectQuota. bob (`edit` in his namespace,
`kubectl --as`) runs three preemptible sweeps on a simulated node; its device plugin reports
each pod's peak at 8 GiB, and they finish. His fourth sweep is placed by the template's
calibrated size, 10 GiB (8 GiB plus a fifth, in whole GiB): its pod's limit and its GPUs say
so, and the extender bound it below its spec because the operator's planned assignment grants
exactly that. Then its run fails (as an MPS client over its memory limit does): it is queued
again with reason OutgrewCalibration and runs as asked.

- `placePreemptible`, sweeps asking for an MPS share of 40 GiB: the fourth runs at 10 GiB,
  then at 40 again.
- with `shareWholeGpus` too, sweeps asking for a whole GPU: the fourth runs as an MPS client
  of 10 GiB (at most three quarters of the node's 80 GiB GPU), then on the whole GPU.
- with a job of bob's holding all but 9 GiB of the GPU, the fourth sweep takes that piece:
  it holds the template's measured peak (8 GiB), though not its calibrated 10 GiB.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "size"  # the tenants' names (the `world` fixture)

GIB = 1024
MPS_40 = {"count": 1, "memory": "40Gi", "isolation": "mps"}


def sweep(name: str, project: str, node: str, gpu: dict[str, Any], seconds: int | None
          ) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "project": project, "class": "batch", "preemptible": True, "gpu": gpu,
        "checkpoint": {"gracePeriod": "5s"}, "estimatedDuration": "10m",
        "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                              "containers": [{"name": "main", "image": "lab/sweep:1"}]}}}
    if seconds is not None:
        spec["simulatedDuration"] = f"{seconds}s"
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": spec}


Obj = dict[str, Any]


def bobs_sweeps(world: tenants.World, right_sizing: dict[str, bool]
                ) -> tuple[tenants.Tenant, str, str, str, str]:
    """bob, with `edit` in his namespace of a project with `right_sizing`, and a node of
    one GPU: bob, his namespace, the project, the node, its GPU model."""
    model = world.name("m")
    node = world.node("gpu", model)
    team = world.namespace("sweeps")
    world.apply_cluster_scoped(user_roles(world))
    project = world.project("sweeps", [team])
    world.admin("patch", "projectquota", project, "--type=merge", "-p", json.dumps(
        {"spec": {"rightSizing": right_sizing}}))
    bob = tenant(world, team, "bob")
    wait_for("the GpuJob roles to aggregate into edit",
             lambda: tenants.can_create_gpujobs(world, bob, team))
    return bob, team, project, node, model


def calibrated_then_failed(world: tenants.World, right_sizing: dict[str, bool],
                           gpu: Callable[[str], Obj]
                           ) -> tuple[tenants.Tenant, str, Obj, Obj, Obj]:
    """bob's fourth sweep placed at its calibrated 10 GiB, then failed and running again:
    bob, his namespace, the pod of the calibrated run, the status then, the status after."""
    bob, team, project, node, model = bobs_sweeps(world, right_sizing)
    ask = gpu(model)
    with tenants.peaks_reported(world, team, node, 8 * GIB):
        tenants.finish_runs(bob, team, [sweep(f"sweep-{i}", project, node, ask, 8)
                                        for i in range(1, 4)], 8 * GIB)
        bob.kubectl("create", "-n", team, "-f", "-",
                    stdin=yaml.safe_dump(sweep("sweep-4", project, node, ask, None)))
        running = wait_for("sweep-4 running", lambda: (
            s if (s := bob.status(team, "sweep-4")).get("phase") == "Running" else None),
            timeout=60, interval=0.5)
        assert running["gpus"][0]["memoryMiB"] == 10 * GIB, running
        pod = json.loads(bob.kubectl("get", "pod", "-n", team, running["podName"], "-o",
                                     "json"))
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[names.RESOURCE_GPU_MEMORY] == "10", limits
        assert names.ANN_PLANNED in pod["metadata"]["annotations"]

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
    assert again["history"][0]["outcome"] == "OutgrewCalibration", again
    return bob, team, pod, running, again


def requeued_messages(world: tenants.World, team: str) -> list[str]:
    events = json.loads(world.admin("get", "events", "-n", team, "-o", "json"))["items"]
    return [e["message"] for e in events if e.get("reason") == "Requeued"]


def test_a_preemptible_job_runs_at_its_calibrated_size_and_again_as_asked_if_it_fails(
        world: tenants.World) -> None:
    _, team, _, _, again = calibrated_then_failed(
        world, {"placePreemptible": True}, lambda model: MPS_40)
    assert again["gpus"][0]["memoryMiB"] == 40 * GIB, again
    told = requeued_messages(world, team)
    assert any("its template's calibrated size" in m for m in told), told


def test_a_whole_gpu_job_runs_as_an_mps_share_of_its_calibrated_size_and_again_whole(
        world: tenants.World) -> None:
    # its GPU model named: a share is measured against the smallest GPU it may get
    bob, team, pod, _, again = calibrated_then_failed(
        world, {"placePreemptible": True, "shareWholeGpus": True},
        lambda model: {"count": 1, "memory": "80Gi", "isolation": "exclusive",
                       "models": [model]})
    assert pod["metadata"]["annotations"][names.ANN_ISOLATION] == "mps"
    assert again["gpus"][0]["memoryMiB"] > 10 * GIB, again  # the whole GPU
    pod = json.loads(bob.kubectl("get", "pod", "-n", team, again["podName"], "-o", "json"))
    assert pod["metadata"]["annotations"][names.ANN_ISOLATION] == "exclusive"
    told = requeued_messages(world, team)
    assert any("below the whole GPU it asks for" in m for m in told), told


def test_a_preemptible_job_takes_a_smaller_piece_that_holds_its_measured_peak(
        world: tenants.World) -> None:
    bob, team, project, node, _ = bobs_sweeps(world, {"placePreemptible": True})
    with tenants.peaks_reported(world, team, node, 8 * GIB):
        tenants.finish_runs(bob, team, [sweep(f"sweep-{i}", project, node, MPS_40, 8)
                                        for i in range(1, 4)], 8 * GIB)
        # a long run of bob's holds 71 GiB of the 80: 9 GiB are left, under the calibrated 10
        holder = sweep("holder", project, node, {"count": 1, "memory": "71Gi",
                                                 "isolation": "mps"}, None)
        holder["spec"].update({"preemptible": False, "class": "long"})
        holder["spec"]["template"]["spec"]["containers"][0]["image"] = "lab/holder:1"
        bob.kubectl("create", "-n", team, "-f", "-", stdin=yaml.safe_dump(holder))
        wait_for("the holder running", lambda: (
            bob.status(team, "holder").get("phase") == "Running" or None),
            timeout=60, interval=0.5)
        bob.kubectl("create", "-n", team, "-f", "-",
                    stdin=yaml.safe_dump(sweep("sweep-4", project, node, MPS_40, None)))
        running = wait_for("sweep-4 running in the piece", lambda: (
            s if (s := bob.status(team, "sweep-4")).get("phase") == "Running" else None),
            timeout=60, interval=0.5)
    assert running["gpus"][0]["memoryMiB"] == 9 * GIB, running
    pod = json.loads(bob.kubectl("get", "pod", "-n", team, running["podName"], "-o", "json"))
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits[names.RESOURCE_GPU_MEMORY] == "9", limits
