"""Namespaces, projects, simulated nodes and tenants for integration tests that act as users.

A tenant is a ServiceAccount bound to its namespace's `edit` role (and to the chart's
cluster-view role, as its user roles advise): it acts with `kubectl --as` and runs
`kubectl carpool` with a kubeconfig of its own token. What only the platform team may do
(namespaces, ProjectQuotas, nodes, status writes) goes through the admin kubeconfig.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from carpool.core import names
from carpool_testbed import devcluster, simnodes
from carpool_testbed.waiting import wait_for

Obj = dict[str, Any]
PLUGIN = Path(sys.executable).parent / "kubectl-carpool"
USER_ROLES = devcluster.repo_root() / "hack" / "policies" / "user-roles.yaml"


@dataclass
class World:
    """One test's namespaces, projects, tenants and nodes (unique names under `prefix`), torn
    down by `cleanup` (or at the end of a `with` block)."""

    cluster: devcluster.Cluster
    tmp: Path
    prefix: str
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    namespaces: list[str] = field(default_factory=list)
    projects: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    cluster_objects: list[Obj] = field(default_factory=list)

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}-{self.suffix}"

    def admin(self, *args: str, stdin: str | None = None) -> str:
        return self.cluster.kubectl(*args, stdin=stdin).stdout

    def apply_cluster_scoped(self, objects: list[Obj]) -> None:
        self.admin("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
        self.cluster_objects.extend(objects)

    def namespace(self, what: str) -> str:
        name = self.name(what)
        self.admin("create", "namespace", name)
        self.namespaces.append(name)
        return name

    def project(self, what: str, namespaces: list[str]) -> str:
        name = self.name(what)
        self.apply_cluster_scoped([{"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
                                    "metadata": {"name": name},
                                    "spec": {"namespaces": namespaces}}])
        self.projects.append(name)
        return name

    def node(self, what: str, model: str, gpus: int = 1) -> str:
        """A simulated node with `gpus` 80 GiB GPUs of `model`."""
        name = self.name(what)
        simnodes.apply_nodes(self.cluster.api(), simnodes.parse_nodes({"nodes": [{
            "name": name, "zone": "zone-a", "sharing": "mps",
            "gpus": [{"model": model, "count": gpus, "memoryTotalMiB": 80 * 1024}]}]}))
        self.nodes.append(name)
        return name

    def patch_status(self, kind_path: list[str], status: Obj) -> None:
        """Admin: merge `status` into an object's status subresource."""
        self.admin("patch", *kind_path, "--subresource=status", "--type=merge",
                   "-p", json.dumps({"status": status}))

    def __enter__(self) -> World:
        return self

    def __exit__(self, *_: object) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        """Everything deleted; the namespaces waited for while the operator still runs (it
        releases the jobs' pods once their runs are recorded), so none of these jobs is left
        for later tests' operators to count."""
        for namespace in self.namespaces:
            self.cluster.kubectl("delete", "gpujobs", "--all", "-n", namespace, "--wait=false",
                                 check=False)
        for namespace in self.namespaces:
            self.cluster.kubectl("wait", "--for=delete", "gpujobs", "--all", "-n", namespace,
                                 "--timeout=30s", check=False)
            self.cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        self.cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                             stdin=yaml.safe_dump_all(self.cluster_objects), check=False)
        simnodes.delete_nodes(self.cluster.api(), self.nodes)


@dataclass
class Tenant:
    """A namespace user: a ServiceAccount with the namespace's `edit` role."""

    world: World
    account: str  # system:serviceaccount:NS:NAME
    kubeconfig: Path

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return self.world.cluster.kubectl(*args, f"--as={self.account}", stdin=stdin).stdout

    def submit(self, namespace: str, name: str, project: str, cls: str, model: str,
               node: str, estimated: str, simulated: str) -> None:
        """A one-GPU exclusive job on `node`, expected to run `estimated`, whose simulated pod
        ends after `simulated`."""
        self.kubectl("create", "-n", namespace, "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": name},
            "spec": {"project": project, "class": cls,
                     "gpu": {"count": 1, "memory": "10Gi", "isolation": "exclusive",
                             "models": [model]},
                     "estimatedDuration": estimated, "simulatedDuration": simulated,
                     "template": {"spec": {
                         "nodeSelector": {"kubernetes.io/hostname": node},
                         "containers": [{"name": "main", "image": "trainer"}]}}}}))

    def status(self, namespace: str, name: str) -> Obj:
        job = json.loads(self.kubectl("get", "gpujob", name, "-n", namespace, "-o", "json"))
        return dict(job.get("status") or {})

    def columns(self, namespace: str, name: str) -> dict[str, str]:
        """The job's row of `kubectl get gpujobs`, by column header."""
        header, *rows = self.kubectl("get", "gpujobs", "-n", namespace).splitlines()
        starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
        spans = list(zip(starts, [*starts[1:], None], strict=True))
        titles = [header[a:b].strip() for a, b in spans]
        for row in rows:
            cells = dict(zip(titles, (row[a:b].strip() for a, b in spans), strict=True))
            if cells["NAME"] == name:
                return cells
        raise AssertionError(f"{name} not listed by kubectl get gpujobs -n {namespace}")

    def carpool_run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`kubectl carpool ARGS` with the tenant's own kubeconfig."""
        env = dict(os.environ, PATH=f"{PLUGIN.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                   KUBECONFIG=str(self.kubeconfig))
        return subprocess.run([str(self.world.cluster.bin_dir / "kubectl"), "carpool", *args],
                              capture_output=True, text=True, timeout=60, env=env, check=False)

    def carpool(self, *args: str) -> str:
        done = self.carpool_run(*args)
        assert done.returncode == 0, f"kubectl carpool {' '.join(args)}: {done.stderr}"
        return done.stdout


def tenant(world: World, namespace: str, user: str, *edit_in: str) -> Tenant:
    """A ServiceAccount in `namespace` with `edit` in it and `edit_in`, a kubeconfig of its
    own token, and read access to quotas and nodes (the cluster-view role of `user_roles`,
    which must be applied)."""
    world.admin("create", "serviceaccount", user, "-n", namespace)
    account = f"system:serviceaccount:{namespace}:{user}"
    for ns in (namespace, *edit_in):
        world.admin("create", "rolebinding", f"{user}-edit", "--clusterrole=edit",
                    f"--serviceaccount={namespace}:{user}", "-n", ns)
    world.apply_cluster_scoped([{
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": world.name(f"{user}-view")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": world.name("cluster-view")},
        "subjects": [{"kind": "ServiceAccount", "name": user, "namespace": namespace}]}])
    token = world.admin("create", "token", user, "-n", namespace, "--duration=1h").strip()
    admin = yaml.safe_load(world.cluster.kubeconfig.read_text())
    cluster_entry = admin["clusters"][0]
    path = world.tmp / f"{user}.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster_entry["cluster"]}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "c", "user": user,
                                                  "namespace": namespace}}],
        "current-context": user}))
    return Tenant(world, account, path)


def user_roles(world: World) -> list[Obj]:
    """The chart's roles for people (hack/policies/user-roles.yaml), renamed for this world."""
    out = []
    for obj in yaml.safe_load_all(USER_ROLES.read_text()):
        if obj and obj["kind"] == "ClusterRole":
            obj["metadata"]["name"] = world.name(obj["metadata"]["name"].removeprefix("carpool-"))
            out.append(obj)
    return out


def can_create_gpujobs(world: World, who: Tenant, namespace: str) -> bool:
    """Whether `who` may create GpuJobs in `namespace` yet (the GpuJob roles aggregate into
    `edit` a moment after they are created)."""
    return world.cluster.kubectl(
        "auth", "can-i", "create", "gpujobs.carpool.dev", f"--as={who.account}", "-n",
        namespace, check=False).stdout.strip() == "yes"


@contextlib.contextmanager
def peaks_reported(world: World, namespace: str, node: str, peak_mib: int) -> Iterator[None]:
    """While the block runs, `node`'s device plugin as the operator reads it (its GpuNode
    status, written every second): every pod of `namespace` on the node peaked at
    `peak_mib`."""
    stop = threading.Event()

    def report() -> None:
        while not stop.is_set():
            pods = json.loads(world.admin("get", "pods", "-n", namespace, "-o", "json"))["items"]
            world.patch_status(["gpunode", node], {"pods": [
                {"namespace": namespace, "name": p["metadata"]["name"], "gpuUuid": "x",
                 "peakMemoryMiB": peak_mib}
                for p in pods if p["spec"].get("nodeName") == node]})
            stop.wait(1)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        stop.set()
        reporter.join(timeout=10)


def finish_runs(who: Tenant, namespace: str, jobs: list[Obj], peak_mib: int) -> None:
    """`who` creates `jobs`, and each finishes with `peak_mib` recorded: the history its
    template's calibrated size is learned from."""
    for job in jobs:
        who.kubectl("create", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(job))
    def finished(name: str) -> Obj | None:
        status = who.status(namespace, name)
        done = status.get("phase") == "Succeeded" and status.get("peakMemoryMiB")
        return status if done else None

    for job in jobs:
        name = job["metadata"]["name"]
        status = wait_for(f"{name} finished with its peak", functools.partial(finished, name),
                          timeout=90, interval=0.5)
        assert status["peakMemoryMiB"] == peak_mib, status
