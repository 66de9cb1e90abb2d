"""A pass tells only its first admissions by an `Admitted` Event, every one by its status.

The operator here runs with CARPOOL_ADMITTED_EVENTS_PER_PASS = 1 (100 by default: a burst of
thousands of admissions would otherwise write thousands of Events). Jobs asking for a GPU
model no node has wait; the node that has it then appears, and one pass admits them all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import tenants
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "admev"  # the tenants' names (the `world` fixture)
EVENTS_PER_PASS = 1
JOBS = 3  # more than EVENTS_PER_PASS, all fitting at once
# the operator's line for each pass (`Reconciler.run_pass`): how many it admitted
PASS_LINE = re.compile(r"reconcile pass: \d+ jobs, (\d+) admitted")


@pytest.fixture(scope="module")
def carpool_settings() -> dict[str, str]:
    """An operator that tells EVENTS_PER_PASS admissions of a pass by an Event."""
    return {"CARPOOL_ADMITTED_EVENTS_PER_PASS": str(EVENTS_PER_PASS)}


def _jobs(world: tenants.World, namespace: str) -> dict[str, Any]:
    """The namespace's GpuJobs by name."""
    listed = json.loads(world.admin("get", "gpujobs", "-n", namespace, "-o", "json"))
    return {job["metadata"]["name"]: job for job in listed["items"]}


def _events(world: tenants.World, namespace: str, uids: set[str]) -> list[str]:
    """The reasons of the Events about these jobs (by involvedObject), one per Event."""
    listed = json.loads(world.admin("get", "events", "-n", namespace, "--field-selector",
                                    "involvedObject.kind=GpuJob", "-o", "json"))
    return [event["reason"] for event in listed["items"]
            if (event.get("involvedObject") or {}).get("uid") in uids]


def test_one_pass_tells_its_first_admissions_by_an_event_and_every_one_by_its_status(
        world: tenants.World, carpool_logs: Path) -> None:
    model = world.name("m")
    team = world.namespace("team")
    project = world.project("team", [team])
    world.admin("create", "-n", team, "-f", "-", stdin=yaml.safe_dump_all([{
        "apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": f"j{i}"},
        "spec": {"project": project, "class": "batch",
                 "gpu": {"count": 1, "memory": "20Gi", "isolation": "mps", "models": [model]},
                 "estimatedDuration": "5m", "simulatedDuration": "120s",
                 "template": {"spec": {"containers": [{"name": "main", "image": "trainer"}]}}}}
        for i in range(JOBS)]))
    # every job seen and waiting before any can be admitted: the next pass finds them all
    wait_for(f"{JOBS} jobs waiting for their GPU model", lambda: len([
        job for job in _jobs(world, team).values()
        if (job.get("status") or {}).get("reason") == "NoMatchingGpuModel"]) == JOBS,
        timeout=60, interval=0.3)
    log = carpool_logs / "operator.log"
    seen = log.stat().st_size
    node = world.node("n", model, gpus=JOBS)

    def all_admitted() -> dict[str, Any] | None:
        jobs = _jobs(world, team)
        return jobs if all((job.get("status") or {}).get("podName")
                           for job in jobs.values()) else None

    admitted = wait_for(f"{JOBS} jobs admitted", all_admitted, timeout=30, interval=0.3)
    gpunode = json.loads(world.admin("get", "gpunodes", node, "-o", "json"))
    node_gpus = {gpu["uuid"] for gpu in gpunode["status"]["gpus"]}
    for name, job in admitted.items():
        status = job["status"]
        assert status["phase"] in {"Admitted", "Running"}, (name, status)
        assert status["node"] == node and status["admitTime"], (name, status)
        (gpu,) = status["gpus"]
        assert gpu["uuid"] in node_gpus and gpu["memoryMiB"] == 20 * 1024, (name, status)
        assert gpu["model"] == model, (name, status)
        condition = {c["type"]: c for c in status["conditions"]}["Admitted"]
        assert condition["status"] == "True" and condition["reason"] == "Admitted", status
    # ... all by one pass: a pass per admission would tell each by an Event
    with log.open("rb") as lines:
        lines.seek(seen)
        passes = [int(n) for n in PASS_LINE.findall(lines.read().decode(errors="replace"))]
    assert [n for n in passes if n] == [JOBS], passes

    uids = {job["metadata"]["uid"] for job in admitted.values()}
    # the operator posts Events one at a time, in the order it recorded them (one thread,
    # `carpool.operator.kube`): once every job's Started Event (a later pass's) is in, every
    # Admitted Event it was going to post is

    def all_started() -> list[str] | None:
        told = _events(world, team, uids)
        return told if told.count("Started") == JOBS else None

    reasons = wait_for("a Started Event on every job", all_started, timeout=30, interval=0.3)
    assert reasons.count("Admitted") == EVENTS_PER_PASS, reasons
    # bound and running, each job's GPU still names its model
    for name, job in _jobs(world, team).items():
        assert [gpu.get("model") for gpu in job["status"]["gpus"]] == [model], (name, job)
