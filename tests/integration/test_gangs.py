"""Gangs on the real API server, kube-scheduler and extender, as a tenant submits them.

alice holds `edit` in her project's namespace and submits GpuJobs with `spec.workers` through
`kubectl --as`. Four simulated nodes of 2 exclusive GPUs each, of a model of their own, sit in
two racks (`topology.carpool.dev/rack`). Every poll also checks the invariant: a gang has
either none or all of its current attempt's worker pods.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool.core.topology import TOPOLOGY_LABELS, TopologyLevel
from carpool_testbed import simnodes, tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "gang"  # the tenants' names (the `world` fixture)
RACK = TOPOLOGY_LABELS[TopologyLevel.RACK]


@pytest.fixture(scope="module")
def carpool_settings() -> dict[str, str]:
    return {"CARPOOL_UNSCHEDULABLE_TIMEOUT_S": "4"}


@dataclass
class Scene:
    """Racks r1 (nodes a, b) and r2 (c, d), 2 exclusive GPUs of `model` each; a project and
    its namespace; alice with `edit` there."""

    world: tenants.World
    model: str
    nodes: dict[str, str]  # short name -> node name
    team: str
    project: str
    alice: Any

    @classmethod
    def make(cls, world: tenants.World) -> Scene:
        model = world.name("m")
        nodes = {short: world.name(short) for short in "abcd"}
        simnodes.apply_nodes(world.cluster.api(), simnodes.parse_nodes({"nodes": [{
            "name": name, "zone": "zone-a", "sharing": "exclusive",
            "labels": {RACK: "r1" if short in "ab" else "r2"},
            "gpus": [{"model": model, "count": 2, "memoryTotalMiB": 80 * 1024}]}
            for short, name in nodes.items()]}))
        world.nodes.extend(nodes.values())
        team = world.namespace("team")
        world.apply_cluster_scoped(user_roles(world))
        project = world.project("team", [team])
        alice = tenant(world, team, "alice")
        wait_for("the GpuJob roles to aggregate into edit",
                 lambda: tenants.can_create_gpujobs(world, alice, team))
        return cls(world, model, nodes, team, project, alice)

    def submit(self, name: str, *, workers: int = 0, count: int = 2, cls: str = "batch",
               simulated: str = "20s", preemptible: bool = False,
               topology: dict[str, str] | None = None, node: str = "",
               affinity_node: str = "") -> None:
        """A GpuJob of `count` exclusive GPUs per pod: a gang of `workers` pods, or one pod
        (on `node` when named); `affinity_node`: its pods' node affinity names that node
        alone (the operator places by nodeSelector, not by affinity)."""
        spec: dict[str, Any] = {
            "project": self.project, "class": cls, "preemptible": preemptible,
            "gpu": {"count": count, "memory": "10Gi", "isolation": "exclusive",
                    "models": [self.model]},
            "estimatedDuration": simulated, "simulatedDuration": simulated,
            "checkpoint": {"gracePeriod": "2s"},
            "template": {"spec": {"containers": [{"name": "main", "image": "trainer"}]}}}
        if workers:
            spec["workers"] = [{"name": "worker", "replicas": workers}]
        if topology:
            spec["topology"] = topology
        if node:
            spec["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        if affinity_node:
            spec["template"]["spec"]["affinity"] = {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                    "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                          "values": [affinity_node]}]}]}}}
        self.alice.kubectl("create", "-n", self.team, "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": spec}))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.alice.status(self.team, name))

    def pods(self, job: str) -> list[dict[str, Any]]:
        """The job's live pods of its current attempt (not terminal, not being deleted)."""
        attempts = int(self.status(job).get("attempts") or 0)
        items = json.loads(self.world.admin(
            "get", "pods", "-n", self.team, "-l", f"{names.LABEL_JOB}={job}",
            "-o", "json"))["items"]
        prefix = f"{job}-{attempts}"
        return [p for p in items if (p["metadata"]["name"] == prefix
                                     or p["metadata"]["name"].startswith(prefix + "-w"))
                and not p["metadata"].get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]

    def whole_or_none(self, job: str, workers: int) -> int:
        """The job's live worker pods, asserting there are none or all of them. The operator
        creates a gang's pods one after another within one pass, so a reading caught between
        two creates is read again a second later."""
        live = self.pods(job)
        if len(live) not in (0, workers):
            time.sleep(1.0)
            live = self.pods(job)
        assert len(live) in (0, workers), (job, [p["metadata"]["name"] for p in live])
        return len(live)


@pytest.fixture
def scene(world: tenants.World) -> Scene:
    return Scene.make(world)


def test_two_gangs_that_fit_alone_but_not_together_never_deadlock(scene: Scene) -> None:
    """Two gangs of three 2-GPU workers on 8 GPUs: one starts whole on three nodes, the other
    starts no pod and waits saying why, then starts whole when the first ends."""
    scene.submit("first", workers=3, simulated="15s")
    scene.submit("second", workers=3, simulated="15s")

    def one_runs() -> tuple[str, str] | None:
        counts = {job: scene.whole_or_none(job, 3) for job in ("first", "second")}
        running = [j for j, n in counts.items() if n == 3
                   and scene.status(j).get("phase") == "Running"]
        if not running:
            return None
        (winner,) = running
        return winner, "second" if winner == "first" else "first"

    winner, loser = wait_for("one gang running whole", one_runs, timeout=60, interval=0.3)
    waiting = scene.status(loser)
    assert waiting.get("phase") in ("Queued", None), waiting
    assert waiting["reason"] in ("Capacity", "BehindHigherRanked"), waiting
    assert "gang starts whole or not at all" in waiting["message"] or \
        "higher-ranked" in waiting["message"], waiting
    assert scene.whole_or_none(loser, 3) == 0
    status = scene.status(winner)
    assert [w["rank"] for w in status["workers"]] == [0, 1, 2]
    assert len({w["node"] for w in status["workers"]}) == 3
    pods = {p["metadata"]["name"]: p for p in scene.pods(winner)}
    for worker in status["workers"]:
        pod = pods[worker["pod"]]
        assert pod["spec"]["nodeName"] == worker["node"]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["RANK"] == str(worker["rank"]) and env["WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == f"w0.{winner}"
    service = json.loads(scene.world.admin("get", "service", winner, "-n", scene.team,
                                           "-o", "json"))
    assert service["spec"]["clusterIP"] == "None"

    def loser_runs() -> bool | None:
        scene.whole_or_none(winner, 3)
        return (scene.whole_or_none(loser, 3) == 3
                and scene.status(loser).get("phase") == "Running") or None

    wait_for("the other gang running whole", loser_runs, timeout=90, interval=0.3)
    listed = scene.alice.carpool("queue", "-n", scene.team)
    assert "No GpuJobs are waiting" in listed or "gang of 3" in listed


def test_required_topology_waits_where_preferred_spreads(scene: Scene) -> None:
    """One GPU pair is taken in each rack (nodes a and c): a gang of two 2-GPU workers fits
    only across racks. Required (rack) starts no pod and says why; preferred starts across."""
    scene.submit("hold-a", node=scene.nodes["a"], simulated="300s")
    scene.submit("hold-c", node=scene.nodes["c"], simulated="300s")
    for job in ("hold-a", "hold-c"):
        wait_for(f"{job} running", lambda held=job: (  # type: ignore[misc]
            scene.status(held).get("phase") == "Running") or None, timeout=60, interval=0.3)
    scene.submit("together", workers=2, topology={"level": "rack", "mode": "required"})
    waiting = wait_for("the required gang waiting for a rack", lambda: (
        s if (s := scene.status("together")).get("reason") == "TopologyUnavailable" else None),
        timeout=30, interval=0.3)
    assert "no rack domain has room" in waiting["message"], waiting
    assert scene.whole_or_none("together", 2) == 0
    why = scene.alice.carpool("why", "together", "-n", scene.team)
    assert "gang of 2 workers" in why, why
    scene.submit("anywhere", workers=2, topology={"level": "rack", "mode": "preferred"})
    wait_for("the preferred gang running across racks", lambda: (
        scene.whole_or_none("anywhere", 2) == 2
        and scene.status("anywhere").get("phase") == "Running") or None,
        timeout=60, interval=0.3)
    nodes = {w["node"] for w in scene.status("anywhere")["workers"]}
    assert nodes == {scene.nodes["b"], scene.nodes["d"]}
    assert scene.whole_or_none("together", 2) == 0


def test_a_gang_is_preempted_and_resumed_whole(scene: Scene) -> None:
    """A preemptible batch gang fills the cluster (four 2-GPU workers); a short job of 2 GPUs
    preempts it: every worker stops, the gang goes back to the queue whole and runs again,
    whole, once the short job is done."""
    scene.submit("big", workers=4, preemptible=True, simulated="300s")
    wait_for("the gang running", lambda: (
        scene.whole_or_none("big", 4) == 4
        and scene.status("big").get("phase") == "Running") or None, timeout=60, interval=0.3)
    scene.submit("urgent", cls="short", simulated="10s")
    # (while the gang stops, its pods are deleted one by one: no invariant to poll then)
    wait_for("the short job running", lambda: (
        scene.status("urgent").get("phase") == "Running") or None, timeout=60, interval=0.3)
    requeued = scene.status("big")
    assert requeued["phase"] in ("Queued", "Preempted"), requeued
    assert scene.whole_or_none("big", 4) == 0
    resumed = wait_for("the gang running again, whole", lambda: (
        s if scene.whole_or_none("big", 4) == 4
        and (s := scene.status("big")).get("phase") == "Running"
        and s.get("attempts") == 2 else None), timeout=90, interval=0.3)
    history = resumed["history"]
    assert history[0]["outcome"] == "Preempted", history
    assert history[0]["fraction"] == pytest.approx(8.0), history  # billed for all 4 workers


def test_a_gang_whose_worker_no_node_takes_is_given_back_whole(scene: Scene) -> None:
    """The pods' affinity allows node a alone; the gang is placed on a and b (one rack), so
    rank 0 runs on a and rank 1 finds no node. After the give-back timeout the whole gang is
    stopped and requeued (reason Unschedulable): rank 0 is not left running alone."""
    scene.submit("split", workers=2, simulated="300s", affinity_node=scene.nodes["a"])
    given_back = wait_for("the gang given back", lambda: (
        s if (s := scene.status("split")).get("reason") == "Unschedulable" else None),
        timeout=60, interval=0.3)
    assert "no node took its pod" in given_back["message"], given_back
    wait_for("no worker of that attempt left", lambda: not [
        p for p in json.loads(scene.world.admin(
            "get", "pods", "-n", scene.team, "-l", f"{names.LABEL_JOB}=split",
            "-o", "json"))["items"]
        if p["metadata"]["name"].startswith(f"split-{given_back.get('attempts', 1)}")
        and not p["metadata"].get("deletionTimestamp")] or None, timeout=30, interval=0.3)


def test_a_higher_class_gang_preempts_a_lower_one_and_starts_whole(scene: Scene) -> None:
    """A preemptible batch gang fills the cluster; a short gang of two 2-GPU workers preempts
    it (whole: every worker stops) and starts whole in its place."""
    scene.submit("low", workers=4, preemptible=True, simulated="300s")
    wait_for("the batch gang running", lambda: (
        scene.whole_or_none("low", 4) == 4
        and scene.status("low").get("phase") == "Running") or None, timeout=60, interval=0.3)
    scene.submit("high", workers=2, cls="short", simulated="300s")
    wait_for("the short gang running whole", lambda: (
        scene.whole_or_none("high", 2) == 2
        and scene.status("high").get("phase") == "Running") or None, timeout=90, interval=0.3)
    low = scene.status("low")
    assert low["phase"] in ("Queued", "Preempted"), low
    assert scene.whole_or_none("low", 4) == 0
