"""The components trust only what Carpool wrote: attacks on the pod-to-job linkage, as tenants.

alice and mallory each hold `edit` in their own project namespace (`carpool_testbed.tenants`)
and act with `kubectl --as`. Each test tries one attack that got through before and shows what
Carpool does:

- a look-alike of another project's running pod (name, labels, `carpool.dev/job`, an
  ownerReference naming that job) in the tenant's own namespace changes nothing of that job;
- a job's own pod with Carpool's labels and annotations changed is still its attempt (no
  second pod, its run stays open); with its ownerReference removed it is stopped, with an
  Event, and the job starts again only once it is gone;
- a GPU pod that is no live job's current attempt (its job deleted with its dependents
  orphaned; a pod made to look like a job's) is stopped within 30 s, with an Event;
- a pod's `carpool.dev/isolation` changed after admission changes no placement: the extender
  places a job's pod as its GpuJob's spec says and refuses one that says otherwise (asked
  directly, as kube-scheduler asks it).

The admission policies of the chart refuse these writes to tenants (hack/policies); they are
not installed here, so what is shown is the defence behind them. Where a policy is installed
on the shared cluster meanwhile and refuses the tenant, the same write is made as the admin
(exempt), so the test shows the components' side either way.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import yaml

from carpool.core import names
from carpool.core.finalizing import deletion_final
from carpool.core.timestamps import epoch_seconds
from carpool_testbed import tenants
from carpool_testbed.tenants import Obj, Tenant, tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "trust"  # the tenants' names (the `world` fixture)
SETTLE_S = 8  # several operator passes (every 2 s here) and their writes
STRAY_DEADLINE_S = 30  # a stray GPU pod is gone within this long (the bound)


class Lab:
    """Two projects, a tenant in each, one simulated node with one 80 GiB GPU."""

    def __init__(self, world: tenants.World) -> None:
        self.world = world
        self.model = world.name("m")
        self.node = world.node("n", self.model)
        self.team, self.evil = world.namespace("team"), world.namespace("evil")
        world.apply_cluster_scoped(user_roles(world))
        self.project = world.project("team", [self.team])
        self.other = world.project("evil", [self.evil])
        self.alice = tenant(world, self.team, "alice")
        self.mallory = tenant(world, self.evil, "mallory")
        wait_for("the GpuJob roles to aggregate into edit", lambda: (
            tenants.can_create_gpujobs(world, self.alice, self.team)
            and tenants.can_create_gpujobs(world, self.mallory, self.evil)))

    def submit(self, who: Tenant, namespace: str, name: str, project: str, *,
               memory: str = "20Gi", isolation: str = "mps", runs: str = "300s") -> None:
        """A one-GPU job on the node whose simulated pod ends after `runs`."""
        who.kubectl("create", "-n", namespace, "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": project, "class": "batch",
                     "gpu": {"count": 1, "memory": memory, "isolation": isolation,
                             "models": [self.model]},
                     "estimatedDuration": "5m", "simulatedDuration": runs,
                     "template": {"spec": {
                         "nodeSelector": {"kubernetes.io/hostname": self.node},
                         "containers": [{"name": "main", "image": "trainer"}]}}}}))

    def job(self, namespace: str, name: str) -> Obj:
        return dict(json.loads(self.world.admin("get", "gpujob", name, "-n", namespace,
                                                "-o", "json")))

    def running(self, who: Tenant, namespace: str, name: str) -> Obj:
        """The job once Running (its status)."""
        return dict(wait_for(f"{namespace}/{name} running", lambda: (
            status if (status := who.status(namespace, name)).get("phase") == "Running"
            else None), timeout=30, interval=0.3))

    def pods(self, namespace: str) -> list[Obj]:
        return list(json.loads(self.world.admin("get", "pods", "-n", namespace, "-o",
                                                "json"))["items"])

    def events(self, namespace: str, name: str) -> list[str]:
        """`reason: message` of the Events about object `name` in `namespace`."""
        out = json.loads(self.world.admin("get", "events.events.k8s.io", "-n", namespace,
                                          "-o", "json"))["items"]
        return [f"{e.get('reason')}: {e.get('note') or ''}" for e in out
                if (e.get("regarding") or {}).get("name") == name] + [
            f"{e.get('reason')}: {e.get('message') or ''}" for e in json.loads(
                self.world.admin("get", "events", "-n", namespace, "-o", "json"))["items"]
            if (e.get("involvedObject") or {}).get("name") == name]

    def as_tenant_else_admin(self, who: Tenant, *args: str, stdin: str | None = None) -> str:
        """Run a kubectl write as the tenant; if an admission policy refuses it, as the admin
        (the write a cluster without the policy lets through). Returns its output."""
        done = self.world.cluster.kubectl(*args, f"--as={who.account}", stdin=stdin,
                                          check=False)
        if done.returncode == 0:
            return done.stdout
        assert "ValidatingAdmissionPolicy" in done.stderr, done.stderr  # never RBAC
        return self.world.admin(*args, stdin=stdin)


def _unchanged(before: Obj, after: Obj) -> None:
    for key in ("phase", "attempts", "podName", "podUID", "startTime", "history"):
        assert after.get(key) == before.get(key), (key, before, after)


def _gpu_pod(lab: Lab, name: str, job: Obj, isolation: str, memory_gib: int = 20) -> Obj:
    """A pod shaped like the operator's for `job`: its GPU limits, Carpool's labels and
    annotations, a controller ownerReference with the job's uid."""
    meta = job["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": meta["namespace"],
        "labels": {names.LABEL_MANAGED: "true", names.LABEL_JOB: meta["name"],
                   names.LABEL_PROJECT: job["spec"]["project"]},
        "annotations": {names.ANN_JOB: f"{meta['namespace']}/{meta['name']}",
                        names.ANN_ISOLATION: isolation, names.ANN_SIM_DURATION: "300"},
        "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": "GpuJob",
                             "name": meta["name"], "uid": meta["uid"], "controller": True}]},
        "spec": {"schedulerName": names.SCHEDULER_NAME,
                 "nodeSelector": {"kubernetes.io/hostname": lab.node},
                 "containers": [{"name": "main", "image": "trainer", "resources": {"limits": {
                     names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: str(memory_gib)}}}]}}


def _gone_within(lab: Lab, namespace: str, name: str, uid: str, seconds: float) -> float:
    """Seconds until pod `name` (of `uid`) is gone or stopping; fails after `seconds`."""
    started = time.monotonic()

    def stopped() -> bool:
        pods = {p["metadata"]["name"]: p for p in lab.pods(namespace)}
        pod = pods.get(name)
        return pod is None or pod["metadata"]["uid"] != uid or bool(
            pod["metadata"].get("deletionTimestamp"))

    wait_for(f"{namespace}/{name} stopped", stopped, timeout=seconds, interval=0.5)
    return time.monotonic() - started


def test_a_look_alike_pod_changes_nothing_of_another_projects_job(
        world: tenants.World) -> None:
    """mallory's CPU-only pods, named and labelled like alice's job's attempts and naming it
    as their owner, finish in mallory's namespace; alice's job keeps running, its attempts
    and history as they were."""
    lab = Lab(world)
    lab.submit(lab.alice, lab.team, "a", lab.project)
    before = lab.running(lab.alice, lab.team, "a")
    job = lab.job(lab.team, "a")
    for attempt in (before["attempts"], before["attempts"] + 1):
        forged = _gpu_pod(lab, f"a-{attempt}", job, "mps")
        forged["metadata"]["namespace"] = lab.evil
        forged["metadata"]["annotations"][names.ANN_SIM_DURATION] = "1"  # ends at once
        forged["spec"]["containers"][0].pop("resources")  # no GPU at all
        lab.as_tenant_else_admin(lab.mallory, "create", "-n", lab.evil, "-f", "-",
                                 stdin=yaml.safe_dump(forged))
    wait_for("the look-alikes to finish", lambda: all(
        p["status"].get("phase") == "Succeeded" for p in lab.pods(lab.evil)), timeout=30)
    time.sleep(SETTLE_S)
    after = lab.alice.status(lab.team, "a")
    _unchanged(before, after)
    assert after["phase"] == "Running" and not after["history"][-1].get("end")
    assert [p["metadata"]["name"] for p in lab.pods(lab.team)] == [before["podName"]]


def test_changed_labels_keep_the_attempt_and_a_removed_owner_stops_it(
        world: tenants.World) -> None:
    """alice rewrites Carpool's labels and annotations on her running pod: nothing changes
    (no second pod, her run still counted). She removes its ownerReference: the pod is
    stopped with an Event, and the job's next attempt starts only after it has stopped, its
    run closed then."""
    lab = Lab(world)
    lab.submit(lab.alice, lab.team, "b", lab.project)
    before = lab.running(lab.alice, lab.team, "b")
    pod = before["podName"]
    patch = {"metadata": {
        "labels": {names.LABEL_MANAGED: None, names.LABEL_JOB: "other",
                   names.LABEL_PROJECT: lab.other},
        "annotations": {names.ANN_JOB: f"{lab.evil}/x", names.ANN_ISOLATION: "exclusive"}}}
    lab.as_tenant_else_admin(lab.alice, "patch", "pod", pod, "-n", lab.team, "--type=merge",
                             "-p", json.dumps(patch))
    time.sleep(SETTLE_S)
    _unchanged(before, lab.alice.status(lab.team, "b"))
    assert [p["metadata"]["name"] for p in lab.pods(lab.team)] == [pod]

    uid = before["podUID"]
    lab.as_tenant_else_admin(lab.alice, "patch", "pod", pod, "-n", lab.team, "--type=json",
                             "-p", json.dumps([{"op": "remove",
                                                "path": "/metadata/ownerReferences"}]))
    removed = time.time()
    took = _gone_within(lab, lab.team, pod, uid, STRAY_DEADLINE_S)
    assert any(e.startswith("AttemptTampered") for e in lab.events(lab.team, pod)), (
        lab.events(lab.team, pod))

    def gone_or_alone() -> bool:
        """Never two pods of the job that may run at once (a pod whose deletion is final has
        stopped; Carpool's finalizer keeps it until its run is on record), and the tampered
        one released in the end."""
        pods = lab.pods(lab.team)
        running = [p for p in pods if not deletion_final(p["metadata"])]
        assert len(running) <= 1 or all(p["metadata"]["uid"] != uid for p in running), pods
        return all(p["metadata"]["uid"] != uid for p in pods)

    wait_for("the tampered pod gone", gone_or_alone, timeout=30, interval=0.2)
    again = wait_for("the next attempt", lambda: (
        s if (s := lab.alice.status(lab.team, "b")).get("attempts") == 2 else None),
        timeout=30)
    first = again["history"][0]
    end = epoch_seconds(first.get("end"))
    assert end is not None and first["outcome"] == "PodLost", again
    # (written to the second)
    assert end >= int(removed), f"the run must stay billed until the pod is gone: {first}, {took}"


def test_a_gpu_pod_of_no_live_job_is_stopped_within_30_s_with_an_event(
        world: tenants.World) -> None:
    """Two strays: a GPU pod alice makes to look like her job's (not the one the job
    records), and her job's pod after she deleted the job leaving its dependents orphaned.
    Each is gone within 30 s, with an Event saying why, and no pod of hers holds a GPU."""
    lab = Lab(world)
    lab.submit(lab.alice, lab.team, "c", lab.project, memory="10Gi")
    running = lab.running(lab.alice, lab.team, "c")
    job = lab.job(lab.team, "c")
    extra = _gpu_pod(lab, "c-9", job, "mps", memory_gib=10)
    extra_uid = json.loads(lab.as_tenant_else_admin(
        lab.alice, "create", "-n", lab.team, "-o", "json", "-f", "-",
        stdin=yaml.safe_dump(extra)))["metadata"]["uid"]
    _gone_within(lab, lab.team, "c-9", extra_uid, STRAY_DEADLINE_S)
    assert any(e.startswith("OrphanStopped") for e in lab.events(lab.team, "c-9"))
    assert any(e.startswith("OrphanStopped") for e in lab.events(lab.team, "c"))
    _unchanged(running, lab.alice.status(lab.team, "c"))

    pod, uid = running["podName"], running["podUID"]
    lab.alice.kubectl("delete", "gpujob", "c", "-n", lab.team, "--cascade=orphan",
                      "--wait=false")
    _gone_within(lab, lab.team, pod, uid, STRAY_DEADLINE_S)
    # (the garbage collector removes the pod's ownerReference as the job goes: whichever the
    # operator sees first, the job deleted or the reference gone, it says so)
    assert any(e.startswith(("JobDeleted", "OrphanStopped", "AttemptTampered"))
               for e in lab.events(lab.team, pod)), lab.events(lab.team, pod)
    wait_for("no pod of alice's holding a GPU", lambda: not [
        p for p in lab.pods(lab.team) if not p["metadata"].get("deletionTimestamp")
        and p["status"].get("phase") not in ("Succeeded", "Failed")], timeout=30)


def test_a_changed_isolation_annotation_changes_no_placement(world: tenants.World) -> None:
    """alice's quarter GPU under MPS stays a quarter when she says `exclusive` on its pod:
    mallory's quarter still goes onto the same GPU. A pod of alice's job asking for the
    job's GPU as `exclusive` is refused by the extender, which says why."""
    lab = Lab(world)
    lab.submit(lab.alice, lab.team, "d", lab.project)
    mine = lab.running(lab.alice, lab.team, "d")
    lab.as_tenant_else_admin(lab.alice, "annotate", "pod", mine["podName"], "-n", lab.team,
                             "--overwrite", f"{names.ANN_ISOLATION}=exclusive")
    time.sleep(2)  # the extender's watch shows the change
    lab.submit(lab.mallory, lab.evil, "e", lab.other)
    theirs = lab.running(lab.mallory, lab.evil, "e")
    assert theirs["gpus"][0]["uuid"] == mine["gpus"][0]["uuid"], (mine, theirs)

    # a pod of alice's job asking for the job's GPU as exclusive: the operator stops it as a
    # stray within seconds, maybe before the scheduler tries it, so the extender is asked
    # here directly, with the pod as the API server stored it, as the scheduler would
    job = lab.job(lab.team, "d")
    whole = json.loads(lab.as_tenant_else_admin(
        lab.alice, "create", "-n", lab.team, "-o", "json", "-f", "-",
        stdin=yaml.safe_dump(_gpu_pod(lab, "d-7", job, "exclusive"))))
    request = urllib.request.Request(
        f"http://127.0.0.1:{world.cluster.extender_port}/filter", method="POST",
        data=json.dumps({"Pod": whole, "NodeNames": [lab.node]}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        result = json.load(answer)
    assert not result["NodeNames"], result
    said = result["FailedAndUnresolvableNodes"][lab.node]
    assert "spec.gpu.isolation is mps" in said, said
    assert not (json.loads(world.admin("get", "pod", "d-7", "-n", lab.team, "-o", "json",
                                       "--ignore-not-found") or "{}").get("spec") or {}
                ).get("nodeName")
