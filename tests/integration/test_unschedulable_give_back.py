"""An admitted job whose pod no node takes is given back, then failed, as a tenant sees it.

alice holds `edit` in her project's namespace (`carpool_testbed.tenants`) and submits, with
`kubectl --as`, a GpuJob whose template's node affinity matches no node. Carpool admits it (the
node it places it on has room), kube-scheduler finds no node for its pod. The operator here
gives such a job back after CARPOOL_UNSCHEDULABLE_TIMEOUT_S = 4 s (600 s by default): the job
goes back to the queue with reason `Unschedulable` and the scheduler's message, its quota
free, and after three give-backs it fails with that reason (docs/concepts.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool.core.lifecycle import MAX_UNSCHEDULABLE_GIVE_BACKS
from carpool_testbed import tenants
from carpool_testbed.tenants import tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "unsched"  # the tenants' names (the `world` fixture)
TIMEOUT_S = 4


@pytest.fixture(scope="module")
def carpool_settings() -> dict[str, str]:
    """An operator that gives unschedulable jobs back after TIMEOUT_S."""
    return {"CARPOOL_UNSCHEDULABLE_TIMEOUT_S": str(TIMEOUT_S)}


@dataclass
class Scene:
    """One simulated node with a GPU of a model of its own, a project and its namespace, and
    alice with `edit` there."""

    model: str
    node: str
    team: str
    project: str
    alice: Any

    @classmethod
    def make(cls, world: tenants.World) -> Scene:
        model = world.name("m")
        node = world.node("n", model)
        team = world.namespace("team")
        world.apply_cluster_scoped(user_roles(world))
        project = world.project("team", [team])
        alice = tenant(world, team, "alice")
        wait_for("the GpuJob roles to aggregate into edit",
                 lambda: tenants.can_create_gpujobs(world, alice, team))
        return cls(model, node, team, project, alice)

    def submit(self, name: str, pod_spec: dict[str, Any]) -> None:
        """alice's batch GpuJob `name` of one 20 GiB MPS share of the node's model, its pod
        as `pod_spec` says besides its container."""
        self.alice.kubectl("create", "-n", self.team, "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": self.project, "class": "batch",
                     "gpu": {"count": 1, "memory": "20Gi", "isolation": "mps",
                             "models": [self.model]},
                     "estimatedDuration": "5m", "simulatedDuration": "60s",
                     "template": {"spec": {
                         **pod_spec, "containers": [{"name": "main", "image": "trainer"}]}}}}))


def test_a_job_no_node_takes_is_given_back_then_fails(world: tenants.World) -> None:
    scene = Scene.make(world)
    alice, team, node = scene.alice, scene.team, scene.node
    scene.submit("nowhere", {
        "nodeSelector": {"kubernetes.io/hostname": node},
        # the operator places by nodeSelector, not by affinity: it admits the job
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "carpool.dev/test-rack", "operator": "In",
                "values": ["no-such-rack"]}]}]}}}})
    admitted = wait_for("the job admitted", lambda: (
        s if (s := alice.status(team, "nowhere")).get("phase") == "Admitted" else None),
        timeout=30, interval=0.3)
    assert admitted["node"] == node
    # given back: back in the queue (Preempted while its pod stops), saying why
    given_back = wait_for("the job given back", lambda: (
        s if (s := alice.status(team, "nowhere")).get("reason") == "Unschedulable"
        else None), timeout=30, interval=0.3)
    # (on a loaded machine the poll may first see it after its last give-back: Failed)
    assert given_back["phase"] in ("Preempted", "Queued", "Admitted", "Failed"), given_back
    assert "no node took its pod" in given_back["message"]
    assert "didn't match Pod's node affinity/selector" in given_back["message"], given_back
    events = json.loads(world.admin("get", "events", "-n", team, "-o", "json"))["items"]
    assert [e for e in events if e.get("reason") == "Unschedulable"
            and (e.get("involvedObject") or {}).get("name") == "nowhere"], events
    # requeued and admitted again a few times, then failed: no pod of it is left pending
    failed = wait_for("the job failed", lambda: (
        s if (s := alice.status(team, "nowhere")).get("phase") == "Failed" else None),
        timeout=40 * (MAX_UNSCHEDULABLE_GIVE_BACKS + 1), interval=0.5)
    assert failed["reason"] == "Unschedulable", failed
    assert failed["unschedulableGiveBacks"] == MAX_UNSCHEDULABLE_GIVE_BACKS
    assert "check its nodeSelector, affinity and tolerations" in failed["message"]
    assert failed["attempts"] == MAX_UNSCHEDULABLE_GIVE_BACKS + 1
    wait_for("its last pod gone", lambda: not json.loads(
        world.admin("get", "pods", "-n", team, "-o", "json"))["items"] or None,
        timeout=20, interval=0.5)


def test_a_job_whose_node_selector_no_node_has_waits_saying_so(world: tenants.World) -> None:
    """Placement keeps a job to nodes with its nodeSelector's labels: with none, it is never
    admitted (no pod, no quota held) and waits with reason NoMatchingNode."""
    scene = Scene.make(world)
    alice, team = scene.alice, scene.team
    scene.submit("rackless", {"nodeSelector": {"carpool.dev/test-rack": "no-such-rack"}})
    waiting = wait_for("the job waiting for a matching node", lambda: (
        s if (s := alice.status(team, "rackless")).get("reason") == "NoMatchingNode" else None),
        timeout=30, interval=0.3)
    assert waiting["phase"] == "Queued" and not waiting.get("attempts"), waiting
    assert "carpool.dev/test-rack=no-such-rack" in waiting["message"], waiting
