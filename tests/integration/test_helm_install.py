"""The Helm chart against the real API server: `helm install` into a fresh namespace, every
object accepted and stored, the installed RBAC enforced as intended (asked of the API
server's own authorizer with `kubectl auth can-i --as`), the components actually working
under their ServiceAccounts' tokens (so the least privilege is also enough), then
`helm uninstall` removes it all.

Images cannot be pulled here (no registry), so the pods stay Pending: the point is that the
API server takes every object the chart makes, with its admission and validation. Helm
installs a chart's crds/ only when a CRD is missing and never touches existing ones, so when
another test already applied the CRDs the install shares them; the CRD files themselves are
checked by a server-side dry-run apply, which validates them as a create or an update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import crds, devcluster, simnodes, stack

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "helm" / "carpool"


def helm(cluster: devcluster.Cluster, *args: str, check: bool = True
         ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(cluster.bin_dir / "helm"), "--kubeconfig",
                             str(cluster.kubeconfig), *args],
                            capture_output=True, text=True, timeout=180)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def existing_crds(cluster: devcluster.Cluster) -> set[str]:
    out = cluster.kubectl("get", "crd", "-o", "name").stdout.split()
    return {line.removeprefix("customresourcedefinition.apiextensions.k8s.io/") for line in out}


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    objects: list[dict[str, Any]]
    crds_preexisting: bool


@pytest.fixture(scope="module")
def release(cluster: devcluster.Cluster) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:6]
    name, namespace = f"carpool-it-{suffix}", f"carpool-helm-{suffix}"
    preexisting = set(crds.CRD_NAMES) <= existing_crds(cluster)
    helm(cluster, "install", name, str(CHART), "--namespace", namespace, "--create-namespace",
         "--wait=false", "--set", "operator.resyncSeconds=2")
    try:
        manifest = helm(cluster, "get", "manifest", name, "--namespace", namespace).stdout
        objects = [o for o in yaml.safe_load_all(manifest) if o]
        yield Release(name, namespace, objects, preexisting)
    finally:
        helm(cluster, "uninstall", name, "--namespace", namespace, check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_every_object_is_stored(cluster: devcluster.Cluster, release: Release) -> None:
    assert len(release.objects) >= 30
    manifest = yaml.safe_dump_all(release.objects)
    stored = json.loads(cluster.kubectl("get", "-f", "-", "-o", "json", stdin=manifest).stdout)
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in stored["items"])
    assert kinds == sorted((o["kind"], o["metadata"]["name"]) for o in release.objects)
    for obj in stored["items"]:
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert obj["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name


def test_workloads_made_pods_the_api_server_admitted(cluster: devcluster.Cluster,
                                                     release: Release) -> None:
    """Deployments got their pods created (pod admission passed), with the chart's specs."""
    selector = f"app.kubernetes.io/instance={release.name}"
    deadline_pods: list[dict[str, Any]] = []
    for _ in range(60):
        pods = json.loads(cluster.kubectl("get", "pods", "-n", release.namespace, "-l",
                                          selector, "-o", "json").stdout)["items"]
        deadline_pods = pods
        components = sorted(p["metadata"]["labels"]["app.kubernetes.io/component"]
                            for p in pods)
        if components == ["extender", "operator", "operator", "scheduler"]:
            break
        subprocess.run(["sleep", "0.5"], check=True)
    components = sorted(p["metadata"]["labels"]["app.kubernetes.io/component"]
                        for p in deadline_pods)
    assert components == ["extender", "operator", "operator", "scheduler"]
    operator = next(p for p in deadline_pods
                    if p["metadata"]["labels"]["app.kubernetes.io/component"] == "operator")
    assert operator["spec"]["serviceAccountName"] == f"{release.name}-operator"


def test_scheduler_configuration_is_stored(cluster: devcluster.Cluster,
                                           release: Release) -> None:
    config_map = json.loads(cluster.kubectl(
        "get", "configmap", f"{release.name}-scheduler-config", "-n", release.namespace,
        "-o", "json").stdout)
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["profiles"][0]["schedulerName"] == names.SCHEDULER_NAME
    assert config["extenders"][0]["urlPrefix"] == (
        f"http://{release.name}-extender.{release.namespace}.svc:18080/")


def can_i(cluster: devcluster.Cluster, release: Release, account: str, verb: str,
          resource: str, namespace: str | None = None) -> bool:
    """Ask the API server's authorizer; `resource` may be `TYPE/SUBRESOURCE` or `TYPE:NAME`."""
    kind, _, subresource = resource.partition("/")
    kind = kind.replace(":", "/")  # kubectl's TYPE/NAME form
    args = ["auth", "can-i", verb, kind,
            f"--as=system:serviceaccount:{release.namespace}:{release.name}-{account}"]
    args += [f"--subresource={subresource}"] if subresource else []
    args += ["-n", namespace] if namespace else []
    result = cluster.kubectl(*args, check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stderr
    return result.stdout.strip() == "yes"


@pytest.mark.parametrize(("account", "verb", "resource", "allowed"), [
    ("operator", "list", "gpujobs.carpool.dev", True),
    ("operator", "patch", "gpujobs.carpool.dev/status", True),
    ("operator", "patch", "projectquotas.carpool.dev/status", True),
    ("operator", "create", "pods", True),
    ("operator", "delete", "pods", True),
    ("operator", "patch", "pods", True),  # its finalizer off, once a pod's run is on record
    ("operator", "create", "events.events.k8s.io", True),
    ("operator", "get", "secrets", False),
    ("operator", "list", "secrets", False),
    ("operator", "get", "configmaps", False),
    ("operator", "patch", "gpujobs.carpool.dev", True),  # an earlier release's finalizer off
    ("operator", "delete", "gpujobs.carpool.dev", False),
    ("operator", "update", "projectquotas.carpool.dev", False),
    ("extender", "create", "pods/binding", True),
    ("extender", "patch", "pods", True),
    ("extender", "watch", "gpunodes.carpool.dev", True),
    ("extender", "delete", "pods", False),
    ("extender", "get", "secrets", False),
    ("device-plugin", "patch", "pods", True),
    ("device-plugin", "patch", "gpunodes.carpool.dev/status", True),
    ("device-plugin", "create", "gpunodes.carpool.dev", True),
    ("device-plugin", "patch", "gpunodes.carpool.dev", False),
    ("device-plugin", "delete", "pods", False),
    ("device-plugin", "list", "gpujobs.carpool.dev", False),
    ("device-plugin", "get", "secrets", False),
    ("scheduler", "create", "pods/binding", True),
])
def test_rbac_as_enforced(cluster: devcluster.Cluster, release: Release, account: str,
                          verb: str, resource: str, allowed: bool) -> None:
    assert can_i(cluster, release, account, verb, resource, "default") is allowed


def test_leases_only_in_the_release_namespace(cluster: devcluster.Cluster,
                                              release: Release) -> None:
    assert can_i(cluster, release, "operator", "create", "leases.coordination.k8s.io",
                 release.namespace)
    assert not can_i(cluster, release, "operator", "create", "leases.coordination.k8s.io",
                     "default")
    # system:kube-scheduler lets any scheduler create Leases, but renew only its own name
    assert can_i(cluster, release, "scheduler", "update",
                 "leases.coordination.k8s.io:carpool-scheduler", release.namespace)
    assert can_i(cluster, release, "operator", "update",
                 "leases.coordination.k8s.io:carpool-operator", release.namespace)
    assert not can_i(cluster, release, "operator", "update",
                     "leases.coordination.k8s.io:kube-scheduler", release.namespace)


def test_chart_crds_are_accepted(cluster: devcluster.Cluster, release: Release) -> None:
    """The chart's CRD files pass the API server's validation (a dry-run create, or update
    of the CRDs in place), and after the install every Carpool CRD is served."""
    rendered = helm(cluster, "template", "x", str(CHART), "--include-crds").stdout
    chart_crds = [o for o in yaml.safe_load_all(rendered)
                  if o and o["kind"] == "CustomResourceDefinition"]
    assert sorted(c["metadata"]["name"] for c in chart_crds) == sorted(crds.CRD_NAMES)
    result = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                             "--field-manager=carpool-chart-check", "-f", "-",
                             stdin=yaml.safe_dump_all(chart_crds))
    assert result.stdout.count("(server dry run)") == 3
    for name in crds.CRD_NAMES:
        crd = json.loads(cluster.kubectl("get", "crd", name, "-o", "json").stdout)
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions["Established"] == "True"


def test_installed_policies_confine_the_device_plugin_to_its_node(
        cluster: devcluster.Cluster, release: Release, tmp_path: Path) -> None:
    """The chart's ValidatingAdmissionPolicy, as `helm install` put it: the release's
    device-plugin account with a token bound to node A (the claim its DaemonSet pod's token
    carries) writes GpuNode A's status, and is refused GpuNode B's, which stays unchanged."""
    policies = sorted(o["metadata"]["name"] for o in release.objects
                      if o["kind"].startswith("ValidatingAdmissionPolicy"))
    assert policies == sorted(f"{release.name}-{p}" for p in (
        "gpunode-own-node", "gpujob-reports-own-node", "pod-metadata",
        "operator-finalizer-only", "gpujob-only", "tenant-isolation", "tenant-priority",
        "tenant-devices") for _ in "ab")
    suffix = uuid.uuid4().hex[:6]
    nodes = simnodes.parse_nodes({"nodes": [
        {"name": f"helm-vap-{x}-{suffix}", "gpus": [{"model": "H200", "count": 1}]}
        for x in "ab"]})
    api = cluster.api()
    simnodes.apply_nodes(api, nodes)
    node_a, node_b = (n.name for n in nodes)
    try:
        token = cluster.kubectl("create", "token", f"{release.name}-device-plugin", "-n",
                                release.namespace, "--bound-object-kind=Node",
                                f"--bound-object-name={node_a}", "--duration=10m").stdout.strip()
        kubeconfig = token_kubeconfig(cluster, release, "device-plugin", tmp_path, token)

        def as_plugin(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig",
                                   str(kubeconfig), *args], capture_output=True, text=True,
                                  timeout=60, check=False)

        def heartbeat(node: str) -> str:
            return cluster.kubectl("get", "gpunode", node, "-o",
                                   "jsonpath={.status.heartbeat}").stdout

        patch = json.dumps({"status": {"heartbeat": "2030-01-01T00:00:00Z"}})
        own = as_plugin("patch", "gpunode", node_a, "--subresource=status", "--type=merge",
                        "-p", patch)
        assert own.returncode == 0, own.stderr
        assert heartbeat(node_a) == "2030-01-01T00:00:00Z"
        before = heartbeat(node_b)
        other = as_plugin("patch", "gpunode", node_b, "--subresource=status", "--type=merge",
                          "-p", patch)
        assert other.returncode != 0
        assert f"{release.name}-gpunode-own-node" in other.stderr, other.stderr
        assert f"may write only GpuNode {node_a}" in other.stderr, other.stderr
        assert heartbeat(node_b) == before
    finally:
        simnodes.delete_nodes(api, [n.name for n in nodes])
        api.close()


def test_uninstall_removes_everything_but_the_crds(cluster: devcluster.Cluster) -> None:
    suffix = uuid.uuid4().hex[:6]
    name, namespace = f"carpool-rm-{suffix}", f"carpool-helm-rm-{suffix}"
    helm(cluster, "install", name, str(CHART), "--namespace", namespace, "--create-namespace",
         "--wait=false")
    try:
        helm(cluster, "uninstall", name, "--namespace", namespace, "--wait")
        roles = cluster.kubectl("get", "clusterroles,validatingadmissionpolicies,"
                                "validatingadmissionpolicybindings", "-l",
                                f"app.kubernetes.io/instance={name}", "-o", "name").stdout
        assert roles.strip() == ""
        left = cluster.kubectl("get", "deployments,daemonsets,services,configmaps,"
                               "serviceaccounts", "-n", namespace, "-l",
                               f"app.kubernetes.io/instance={name}", "-o", "name").stdout
        assert left.strip() == ""
        assert set(crds.CRD_NAMES) <= existing_crds(cluster)  # helm keeps CRDs (and data)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# --- the components under their own ServiceAccounts --------------------------------------

FORBIDDEN_MARKERS = ("Forbidden", "forbidden", "403", "Traceback")


def token_kubeconfig(cluster: devcluster.Cluster, release: Release, account: str,
                     directory: Path, token: str | None = None) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount `account` (a bound token,
    or `token`), for the same API server as the cluster's own kubeconfig."""
    token = token or cluster.kubectl("create", "token", f"{release.name}-{account}", "-n",
                                     release.namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])
    server = next(c for c in admin["clusters"] if c["name"] == context["context"]["cluster"])
    config = {"apiVersion": "v1", "kind": "Config", "current-context": account,
              "clusters": [{"name": "c", "cluster": server["cluster"]}],
              "users": [{"name": account, "user": {"token": token}}],
              "contexts": [{"name": account, "context": {"cluster": "c", "user": account}}]}
    path = directory / f"{account}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path



def spawn(args: list[str], log: Path, env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **(env or {})))


def wait_for(check: Any, timeout: float, what: str, log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:.0f}s; log:\n{log.read_text()[-3000:]}")


def assert_no_denials(log: Path) -> None:
    text = log.read_text()
    denied = [line for line in text.splitlines() if any(m in line for m in FORBIDDEN_MARKERS)]
    assert not denied, "\n".join(denied[:10])


def test_extender_works_with_its_account(cluster: devcluster.Cluster, release: Release,
                                         tmp_path: Path) -> None:
    """Its watches list and watch nodes, pods and GpuNodes: /healthz turns 200 only then."""
    kubeconfig = token_kubeconfig(cluster, release, "extender", tmp_path)
    port, log = stack.free_port(), tmp_path / "extender.log"
    process = spawn(["-m", "carpool.extender", "--host", "127.0.0.1", "--port", str(port),
                     "--kubeconfig", str(kubeconfig)], log)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_for(healthy, 60, "the extender's cache did not sync", log)
        time.sleep(2)  # the watches run after the lists
        assert process.poll() is None
        assert_no_denials(log)
    finally:
        devcluster.stop_process(process)


def test_device_plugin_publishes_its_gpunode_with_its_account(
        cluster: devcluster.Cluster, release: Release, tmp_path: Path) -> None:
    """Creating its GpuNode and writing its status, reading its node's pods: all allowed."""
    kubeconfig = token_kubeconfig(cluster, release, "device-plugin", tmp_path)
    node = f"rbac-check-{uuid.uuid4().hex[:6]}"
    spec = tmp_path / "node.yaml"
    spec.write_text(yaml.safe_dump({"node": node, "gpus": [{"model": "H200", "count": 2}]}))
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    log = tmp_path / "device-plugin.log"
    process = spawn(["-m", "carpool.deviceplugin", "--node-name", node, "--backend", "fake",
                     "--fake-spec", str(spec), "--plugin-dir", str(plugin_dir),
                     "--metrics-port", "0", "--publish-interval", "1",
                     "--kubeconfig", str(kubeconfig)], log)

    def published() -> dict[str, Any] | None:
        result = cluster.kubectl("get", "gpunode", node, "-o", "json", check=False)
        if result.returncode != 0:
            return None
        status: dict[str, Any] | None = json.loads(result.stdout).get("status")
        return status if status and status.get("gpus") else None

    try:
        status = wait_for(published, 60, "the plugin did not publish its GpuNode", log)
        assert [g["model"] for g in status["gpus"]] == ["H200", "H200"]
        assert process.poll() is None
        assert_no_denials(log)
    finally:
        devcluster.stop_process(process)
        cluster.kubectl("delete", "gpunode", node, "--ignore-not-found", check=False)


def test_operator_leads_and_reconciles_with_its_account(
        cluster: devcluster.Cluster, release: Release, tmp_path: Path) -> None:
    """kopf's watches, the Lease in the release namespace and whole reconcile passes (lists,
    status writes) succeed with the operator's role, which cannot read Secrets."""
    kubeconfig = token_kubeconfig(cluster, release, "operator", tmp_path)
    identity = f"rbac-check-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "operator.log"
    process = spawn(["-m", "kopf", "run", "--standalone", "--all-namespaces",
                     "--log-format=plain", "-m", "carpool.operator.handlers"], log,
                    {"KUBECONFIG": str(kubeconfig), "CARPOOL_KUBECONFIG": str(kubeconfig),
                     "CARPOOL_NAMESPACE": release.namespace, "CARPOOL_IDENTITY": identity,
                     "CARPOOL_RESYNC_SECONDS": "1"})

    def holder() -> bool:
        result = cluster.kubectl("get", "lease", "carpool-operator", "-n", release.namespace,
                                 "-o", "jsonpath={.spec.holderIdentity}", check=False)
        return result.returncode == 0 and result.stdout.strip() == identity

    try:
        wait_for(holder, 60, "the operator did not take its Lease", log)
        time.sleep(4)  # several reconcile passes as the leader
        assert process.poll() is None
        assert_no_denials(log)
        assert "reconcile pass failed" not in log.read_text()
    finally:
        devcluster.stop_process(process, grace=10)


def test_scheduler_runs_the_chart_configuration_with_its_account(
        cluster: devcluster.Cluster, release: Release, tmp_path: Path) -> None:
    """The real kube-scheduler loads the chart's KubeSchedulerConfiguration (extender and all)
    and runs with its account: informers, its Lease, delegated authentication. The profile is
    renamed here so this extra scheduler never takes a pod from the cluster's own."""
    kubeconfig = token_kubeconfig(cluster, release, "scheduler", tmp_path)
    config_map = json.loads(cluster.kubectl(
        "get", "configmap", f"{release.name}-scheduler-config", "-n", release.namespace,
        "-o", "json").stdout)
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    config["profiles"] = [{"schedulerName": f"config-check-{uuid.uuid4().hex[:6]}"}]
    config["clientConnection"] = {"kubeconfig": str(kubeconfig)}
    path = tmp_path / "scheduler.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "scheduler.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(cluster.bin_dir / "kube-scheduler"), f"--config={path}",
             "--bind-address=127.0.0.1", f"--secure-port={stack.free_port()}", "--v=2"],
            stdout=out, stderr=subprocess.STDOUT)

    def holder() -> str:
        if process.poll() is not None:
            raise AssertionError(f"kube-scheduler exited:\n{log.read_text()[-3000:]}")
        result = cluster.kubectl("get", "lease", "carpool-scheduler", "-n", release.namespace,
                                 "-o", "jsonpath={.spec.holderIdentity}", check=False)
        return result.stdout.strip() if result.returncode == 0 else ""

    try:
        wait_for(holder, 60, "kube-scheduler did not take its Lease", log)
        time.sleep(3)
        assert process.poll() is None
        denied = [line for line in log.read_text().splitlines() if "forbidden" in line.lower()]
        assert not denied, "\n".join(denied[:10])
    finally:
        process.terminate()
        process.wait(10)
