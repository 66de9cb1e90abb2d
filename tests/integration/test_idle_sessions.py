"""Idle interactive sessions end, as a tenant and the platform team see it.

The platform team sets `spec.idleSessions.timeout: 1m` on a ProjectQuota; alice (`edit` in
the project's namespace, `kubectl --as`) runs two interactive GpuJobs on a simulated node whose
GpuNode says its plugin measures per-process GPU activity (as the device plugin writes it).
One job's pod keeps using its GPU (a fresh `lastActiveTime` every few seconds), the other's
never does: that one is stopped and fails with reason IdleTimeout and an Event saying why; the
busy one keeps running. A job on a node that does not measure activity is never stopped.
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
from carpool.core.timestamps import format_timestamp
from carpool_testbed import tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "idle"  # the tenants' names (the `world` fixture)


def session(name: str, project: str, node: str) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": project, "class": "interactive",
                     "gpu": {"count": 1, "memory": "10Gi", "isolation": "mps"},
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
