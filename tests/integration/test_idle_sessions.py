"""Idle interactive sessions end, as a tenant and the platform team see it.

The platform team sets `spec.idleSessions.timeout: 1m` on a ProjectQuota; alice (`edit` in
the project's namespace, `kubectl --as`) runs two interactive GpuJobs on a simulated node whose
GpuNode says its plugin measures per-process GPU activity (as the device plugin writes it).
One job's pod keeps using its GPU (a fresh `lastActiveTime` every few seconds), the other's
never does: that one is stopped and fails with reason IdleTimeout and an Event saying why; the
busy one keeps running. A job on a node that does not measure activity is never stopped.

With `spec.idleSessions.yieldAfter: 1m` (and a timeout of an hour) a session holding a whole GPU
sits idle past the minute untouched while the only waiting job asks for another model; once a
job waits that could run on its model it is stopped the same way (the message names yieldAfter),
its run billed no further, and that job starts on the GPU it gave back.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool.core.timestamps import epoch_seconds, format_timestamp
from carpool_testbed import tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "idle"  # the tenants' names (the `world` fixture)


def session(name: str, project: str, node: str, isolation: str = "mps") -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": project, "class": "interactive",
                     "gpu": {"count": 1, "memory": "10Gi", "isolation": isolation},
                     "estimatedDuration": "30m", "simulatedDuration": "30m",
                     "template": {"spec": {
                         "nodeSelector": {"kubernetes.io/hostname": node},
                         "containers": [{"name": "main", "image": "notebook"}]}}}}


def test_an_idle_session_is_stopped_and_a_busy_one_runs_on(world: tenants.World) -> None:
    model = world.name("m")
    measured, unmeasured = world.node("a", model), world.node("b", model)
    team = world.namespace("team")
    world.apply_cluster_scoped(user_roles(world))
    project = world.project("team", [team])
    world.admin("patch", "projectquota", project, "--type=merge", "-p", json.dumps(
        {"spec": {"idleSessions": {"timeout": "1m"}}}))
    alice = tenant(world, team, "alice")
    wait_for("the GpuJob roles to aggregate into edit",
             lambda: tenants.can_create_gpujobs(world, alice, team))
    jobs = {"busy": measured, "idle": measured, "elsewhere": unmeasured}
    for name, node in jobs.items():
        alice.kubectl("create", "-n", team, "-f", "-",
                      stdin=yaml.safe_dump(session(name, project, node)))
    running = {name: wait_for(f"{name} running", lambda name=name: (
        s if (s := alice.status(team, name)).get("phase") == "Running" else None),
        timeout=60, interval=0.5) for name in jobs}
    pods = {name: str(status["podName"]) for name, status in running.items()}

    stop = threading.Event()

    def device_plugin_reports() -> None:
        """What the measuring node's plugin publishes: the busy pod active now, the idle one
        never; processActivity on that node only."""
        while not stop.is_set():
            now = format_timestamp(math.ceil(time.time() / 60) * 60)  # as the plugin rounds
            world.patch_status(["gpunode", measured], {
                "processActivity": True,
                "pods": [{"namespace": team, "name": pods["busy"], "gpuUuid": "x",
                          "peakMemoryMiB": 900, "lastActiveTime": now},
                         {"namespace": team, "name": pods["idle"], "gpuUuid": "x",
                          "peakMemoryMiB": 900}]})
            stop.wait(5)

    reporter = threading.Thread(target=device_plugin_reports, daemon=True)
    reporter.start()
    try:
        ended = wait_for("the idle session stopped", lambda: (
            s if (s := alice.status(team, "idle")).get("phase") == "Failed" else None),
            timeout=180, interval=1.0)
        assert ended["reason"] == "IdleTimeout", ended
        assert "its GPUs did no work for" in ended["message"], ended
        assert "spec.idleSessions.timeout" in ended["message"], ended
        assert ended["history"][-1]["outcome"] == "IdleTimeout"
        events = json.loads(world.admin("get", "events", "-n", team, "-o", "json"))["items"]
        assert [e for e in events if e.get("reason") == "IdleTimeout"
                and (e.get("involvedObject") or {}).get("name") == "idle"], events
        busy = alice.status(team, "busy")
        assert busy["phase"] == "Running" and busy.get("lastGpuActivity"), busy
        elsewhere = alice.status(team, "elsewhere")
        assert elsewhere["phase"] == "Running" and "lastGpuActivity" not in elsewhere
    finally:
        stop.set()
        reporter.join(timeout=10)


def test_an_idle_session_yields_only_once_a_job_waits_for_its_gpus_model(
        world: tenants.World) -> None:
    model, other = world.name("m"), world.name("n")
    node, elsewhere = world.node("a", model), world.node("b", other)
    team = world.namespace("team")
    world.apply_cluster_scoped(user_roles(world))
    project = world.project("team", [team])
    world.admin("patch", "projectquota", project, "--type=merge", "-p", json.dumps(
        {"spec": {"idleSessions": {"timeout": "1h", "yieldAfter": "1m"}}}))
    alice = tenant(world, team, "alice")
    wait_for("the GpuJob roles to aggregate into edit",
             lambda: tenants.can_create_gpujobs(world, alice, team))

    def phase_is(name: str, phase: str) -> dict[str, Any] | None:
        return s if (s := alice.status(team, name)).get("phase") == phase else None

    # the other model's only GPU busy, and a job waiting for it: nothing waits for `model`
    alice.submit(team, "busy", project, "batch", other, elsewhere, "2h", "2h")
    wait_for("busy running", lambda: phase_is("busy", "Running"), timeout=60)
    alice.submit(team, "other-model", project, "batch", other, elsewhere, "1h", "1h")
    alice.kubectl("create", "-n", team, "-f", "-",
                  stdin=yaml.safe_dump(session("notebook", project, node, "exclusive")))
    started = wait_for("the notebook running", lambda: phase_is("notebook", "Running"),
                       timeout=60)
    pod = str(started["podName"])
    stop = threading.Event()

    def device_plugin_reports() -> None:
        """The node's plugin measures activity; the notebook's processes never use its GPU."""
        while not stop.is_set():
            world.patch_status(["gpunode", node], {"processActivity": True, "pods": [
                {"namespace": team, "name": pod, "gpuUuid": "x", "peakMemoryMiB": 900}]})
            stop.wait(5)

    reporter = threading.Thread(target=device_plugin_reports, daemon=True)
    reporter.start()
    try:
        idle_since = epoch_seconds(wait_for("the notebook's GPU activity measured", lambda: (
            alice.status(team, "notebook").get("lastGpuActivity")), timeout=60))
        assert idle_since is not None
        # idle past yieldAfter by several of the operator's 2 s cycles, a job still waiting
        time.sleep(max(0.0, idle_since + 60 + 15 - time.time()))
        assert phase_is("other-model", "Queued"), alice.status(team, "other-model")
        kept = alice.status(team, "notebook")
        assert kept["phase"] == "Running", kept

        alice.submit(team, "wants-it", project, "batch", model, node, "1h", "1h")
        asked = time.time()
        ended = wait_for("the notebook stopped", lambda: phase_is("notebook", "Failed"),
                         timeout=90, interval=1.0)
        assert ended["reason"] == "IdleTimeout", ended
        assert "spec.idleSessions.yieldAfter" in ended["message"], ended
        assert "while jobs wait for its GPUs" in ended["message"], ended
        run = ended["history"][-1]
        assert run["outcome"] == "IdleTimeout", ended
        events = json.loads(world.admin("get", "events", "-n", team, "-o", "json"))["items"]
        assert [e for e in events if e.get("reason") == "IdleTimeout"
                and (e.get("involvedObject") or {}).get("name") == "notebook"
                and "yieldAfter" in str(e.get("message"))], events
        # billed up to its pod's end, and no further
        end = epoch_seconds(run.get("end"))
        assert end is not None and int(asked) - 1 <= end <= time.time(), (run, asked)
        begun = epoch_seconds(run.get("start"))
        assert begun is not None, run
        billed = float(ended.get("gpuHours") or 0.0)
        assert billed == pytest.approx((end - begun) * float(run["fraction"]) / 3600,
                                       abs=2e-6), ended
        wait_for("the notebook's pod released (its run on record)", lambda: pod not in [
            p["metadata"]["name"] for p in json.loads(world.admin(
                "get", "pods", "-n", team, "-o", "json"))["items"]], timeout=30)
        time.sleep(6)  # a few cycles later
        assert float(alice.status(team, "notebook").get("gpuHours") or 0.0) == billed

        admitted = wait_for("the waiting job running on the notebook's GPU",
                            lambda: phase_is("wants-it", "Running"), timeout=60)
        assert admitted["node"] == node, admitted
        assert alice.status(team, "other-model").get("phase") != "Running"
    finally:
        stop.set()
        reporter.join(timeout=10)
