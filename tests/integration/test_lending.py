"""Lending within a GPU on the real API server, scheduler and extender, as tenants act.

alice's long MPS job holds 60 GiB of an 80 GiB GPU and, the device plugin reports, peaks at
10 GiB. bob's preemptible batch job asks for 40 GiB: only 20 GiB are free, so without
lending it would wait for alice's job to end. With lending on (operator and extender), once
alice's job ran the observation time its unused 48 GiB are lent: bob's job is placed there,
bound by the extender to the GPU the operator chose, and runs with `borrowed` GPUs. Then
alice's job's peak rises to 50 GiB: bob's job is stopped within its checkpoint grace
(an Event names the owner) and queued again, and alice's job runs on, never refused.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "lend"  # the tenants' names (the `world` fixture)
GIB = 1024


@pytest.fixture(scope="module")
def carpool_settings() -> dict[str, str]:
    """An operator that lends what a job leaves above its peak once it ran 5 s; borrowers'
    checkpoint grace at most 30 s."""
    return {"CARPOOL_LENDING": "true", "CARPOOL_LENDING_OBSERVED_S": "5",
            "CARPOOL_LENDING_RECLAIM_WITHIN_S": "30"}


@pytest.fixture(scope="module")
def carpool_extender_args() -> tuple[str, ...]:
    """An extender that places borrowers in lent memory."""
    return ("--lending",)


def job(name: str, project: str, node: str, cls: str, memory: str, preemptible: bool
        ) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": project, "class": cls, "preemptible": preemptible,
                     "gpu": {"count": 1, "memory": memory, "isolation": "mps"},
                     "checkpoint": {"gracePeriod": "10s"},
                     "estimatedDuration": "1h", "simulatedDuration": "1h",
                     "template": {"spec": {
                         "nodeSelector": {"kubernetes.io/hostname": node},
                         "containers": [{"name": "main", "image": "train"}]}}}}


def metric(port: int, name: str, label: str = "") -> float:
    """The sum of a metric's samples on the operator's /metrics whose line has `label`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


def test_a_borrower_runs_in_lent_memory_and_leaves_when_the_owner_needs_it(
        world: tenants.World, carpool_metrics_port: int) -> None:
    node = world.node("gpu", world.name("m"))
    owners, borrowers = world.namespace("owners"), world.namespace("sweeps")
    world.apply_cluster_scoped(user_roles(world))
    owner_project = world.project("owners", [owners])
    borrower_project = world.project("sweeps", [borrowers])
    alice, bob = tenant(world, owners, "alice"), tenant(world, borrowers, "bob")
    for user, namespace in ((alice, owners), (bob, borrowers)):
        wait_for("the GpuJob roles to aggregate into edit",
                 lambda user=user, namespace=namespace: tenants.can_create_gpujobs(
                     world, user, namespace))
    alice.kubectl("create", "-n", owners, "-f", "-", stdin=yaml.safe_dump(
        job("train", owner_project, node, "long", "60Gi", False)))
    owner = wait_for("alice's job running", lambda: (
        s if (s := alice.status(owners, "train")).get("phase") == "Running" else None),
        timeout=60, interval=0.5)
    peak = {"MiB": 10 * GIB}
    stop = threading.Event()

    def device_plugin_reports() -> None:
        """The node's plugin: alice's pod's peak on its GPU, as it measures it."""
        while not stop.is_set():
            world.patch_status(["gpunode", node], {"pods": [
                {"namespace": owners, "name": owner["podName"],
                 "gpuUuid": owner["gpus"][0]["uuid"], "peakMemoryMiB": peak["MiB"]}]})
            stop.wait(2)

    reporter = threading.Thread(target=device_plugin_reports, daemon=True)
    reporter.start()
    try:
        bob.kubectl("create", "-n", borrowers, "-f", "-", stdin=yaml.safe_dump(
            job("sweep", borrower_project, node, "batch", "40Gi", True)))
        running = wait_for("bob's job running in lent memory", lambda: (
            s if (s := bob.status(borrowers, "sweep")).get("phase") == "Running" else None),
            timeout=90, interval=0.5)
        assert running["gpus"][0]["borrowed"] is True, running
        assert running["gpus"][0]["uuid"] == owner["gpus"][0]["uuid"]
        pod = json.loads(bob.kubectl("get", "pod", "-n", borrowers, running["podName"],
                                     "-o", "json"))
        assigned = json.loads(pod["metadata"]["annotations"][names.ANN_ASSIGNMENT])
        assert assigned["gpus"][0]["borrowed"] is True, assigned

        peak["MiB"] = 50 * GIB  # alice's job grows into its grant
        seen: list[dict[str, Any]] = []

        def requeued_status() -> dict[str, Any] | None:
            seen[:] = [status := bob.status(borrowers, "sweep")]
            return status if status.get("phase") == "Queued" and any(
                r.get("outcome") == "Preempted" for r in status.get("history") or []) else None

        try:
            requeued = wait_for("bob's job off the GPU and queued again", requeued_status,
                                timeout=60, interval=0.5)
        except AssertionError as failed:
            raise AssertionError(f"{failed}; its status: {seen}") from None
        assert requeued["attempts"] == 1, requeued  # not placed again: nothing is lent now
        events = json.loads(world.admin("get", "events", "-n", borrowers, "-o", "json"))["items"]
        told = [e["message"] for e in events if e.get("reason") == "Preempted"]
        assert told and f"lent by {owners}/train" in told[0], told
        lent = f'project="{borrower_project}"'
        assert metric(carpool_metrics_port, "carpool_lent_gpu_hours_total", lent) > 0
        assert metric(carpool_metrics_port, "carpool_preemptions_total",
                      f'cause="OwnerReclaim",{lent}') == 1
        wait_for("the reclaim timed", lambda: metric(
            carpool_metrics_port, "carpool_owner_reclaim_seconds_count") >= 1, timeout=20)
        assert alice.status(owners, "train")["phase"] == "Running"
    finally:
        stop.set()
        reporter.join(timeout=10)
