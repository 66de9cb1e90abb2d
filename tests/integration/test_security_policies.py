"""Security on the real API server: least privilege of Carpool's accounts, who may bill and set
quotas, the device plugin confined to its own node's GpuNode, and the extender over TLS.

The chart's RBAC objects (ServiceAccounts, roles, bindings) are rendered with `helm template`
and applied alone, under a release name of this module's own, so nothing else from the chart
runs. tests/integration/test_helm_install.py already asks `auth can-i` for what each account
needs and a first set of denials; this module asks the dangerous rest (minting tokens,
impersonation, RBAC escalation, exec, secrets, node writes, admission policy changes) and
proves the rules that RBAC alone cannot express: the chart's policies (templates/policies.yaml,
whose source is `hack/policies/`: ValidatingAdmissionPolicies and user roles, named after the
release) with real node-bound tokens and impersonation, and the operator refusing a namespace
that bills a project it is not bound to.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from carpool.core import checkpointing, names, service_levels
from carpool_testbed import crds, devcluster, simnodes, stack
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "carpool"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
ACCOUNTS = ("operator", "extender", "device-plugin")
NODE_CLAIM = "authentication.kubernetes.io/node-name"

T = TypeVar("T")


@dataclass(frozen=True)
class Rbac:
    release: str
    namespace: str

    def account(self, component: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.release}-{component}"

    def named(self, policy: str) -> str:
        """A chart object's name in this release: hack/policies' carpool-X is <release>-X."""
        return f"{self.release}-{policy}"


def render(cluster: devcluster.Cluster, rbac_release: str, namespace: str,
           kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", rbac_release, str(CHART), "--namespace",
         namespace], capture_output=True, text=True, timeout=120, check=True).stdout
    return [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in kinds]


def apply_manifests(cluster: devcluster.Cluster, objects: list[dict[str, Any]]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))


def delete_manifests(cluster: devcluster.Cluster, objects: list[dict[str, Any]]) -> None:
    cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                    stdin=yaml.safe_dump_all(objects), check=False)


@pytest.fixture(scope="module")
def rbac(cluster: devcluster.Cluster) -> Iterator[Rbac]:
    """Only the chart's RBAC objects (the user roles included), applied under a fresh release
    name and namespace."""
    suffix = uuid.uuid4().hex[:6]
    # A release name with "carpool" in it is the chart's full name: accounts carpool-relsec-*
    release, namespace = f"carpool-relsec-{suffix}", f"relsec-{suffix}"
    objects = render(cluster, release, namespace, RBAC_KINDS)
    assert {o["kind"] for o in objects} == set(RBAC_KINDS)
    crds.apply_crds(cluster.api())  # kubectl resolves carpool.dev resources by discovery
    cluster.kubectl("create", "namespace", namespace)
    apply_manifests(cluster, objects)
    try:
        yield Rbac(release, namespace)
    finally:
        delete_manifests(cluster, objects)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def policies(cluster: devcluster.Cluster, rbac: Rbac) -> Iterator[None]:
    """The chart's ValidatingAdmissionPolicies for this module's release (cluster-wide; the
    the pod-metadata policy's accounts are the release's), removed afterwards."""
    crds.apply_crds(cluster.api())
    objects = render(cluster, rbac.release, rbac.namespace, POLICY_KINDS)
    assert sorted(o["metadata"]["name"] for o in objects) == sorted(
        rbac.named(p) for p in ("gpunode-own-node", "gpujob-reports-own-node",
                                "pod-metadata", "operator-finalizer-only", "gpujob-only",
                                "tenant-isolation", "tenant-priority", "tenant-devices")
        for _ in range(2))
    apply_manifests(cluster, objects)
    try:
        yield
    finally:
        delete_manifests(cluster, objects)


def can_i(cluster: devcluster.Cluster, user: str, verb: str, resource: str,
          namespace: str | None = None, subresource: str = "") -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={user}"]
    args += [f"--subresource={subresource}"] if subresource else []
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    result = cluster.kubectl(*args, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    if resource.endswith(names.GROUP):  # a missing CRD would make every answer a vacuous "no"
        assert "doesn't have a resource type" not in result.stderr, result.stderr
    return answer == "yes"


# --- least privilege: what no Carpool component may do -------------------------------------

# (verb, resource, subresource) that would let a compromised component take the cluster, read
# what is not its business, or rewrite the rules that confine it.
DANGEROUS: list[tuple[str, str, str]] = [
    ("create", "serviceaccounts", "token"),          # mint tokens (e.g. without a node claim)
    ("impersonate", "users", ""),
    ("impersonate", "serviceaccounts", ""),
    ("impersonate", "userextras", NODE_CLAIM),        # forge a node claim
    ("bind", "clusterroles", ""),
    ("escalate", "clusterroles", ""),
    ("create", "clusterrolebindings", ""),
    ("create", "rolebindings", ""),
    ("create", "pods", "exec"),
    ("create", "pods", "attach"),
    ("create", "pods", "portforward"),
    ("get", "secrets", ""),
    ("list", "secrets", ""),
    ("watch", "secrets", ""),
    ("patch", "nodes", ""),
    ("delete", "nodes", ""),
    ("update", "nodes", "status"),
    ("delete", "namespaces", ""),
    ("patch", "validatingadmissionpolicies.admissionregistration.k8s.io", ""),
    ("delete", "validatingadmissionpolicybindings.admissionregistration.k8s.io", ""),
    ("patch", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("create", "projectquotas.carpool.dev", ""),
    ("patch", "projectquotas.carpool.dev", ""),
    ("delete", "projectquotas.carpool.dev", ""),
    ("update", "gpujobs.carpool.dev", ""),
    ("create", "gpujobs.carpool.dev", ""),
    ("update", "pods", "status"),
    ("create", "deployments.apps", ""),
    ("patch", "daemonsets.apps", ""),
]

# What only some components may do: denied to the others listed.
DENIED_TO: dict[str, list[tuple[str, str, str]]] = {
    "operator": [("patch", "gpunodes.carpool.dev", "status"),
                 ("create", "gpunodes.carpool.dev", ""), ("create", "pods", "binding"),
                 ("update", "leases.coordination.k8s.io", "")],
    "extender": [("create", "pods", ""), ("delete", "pods", ""), ("create", "pods", "eviction"),
                 ("patch", "gpujobs.carpool.dev", "status"),
                 ("patch", "gpunodes.carpool.dev", "status"),
                 ("patch", "projectquotas.carpool.dev", "status")],
    "device-plugin": [("create", "pods", ""), ("delete", "pods", ""),
                      ("create", "pods", "binding"), ("create", "pods", "eviction"),
                      ("delete", "gpunodes.carpool.dev", ""),
                      ("update", "gpunodes.carpool.dev", ""),
                      # its status it may patch: only jobs' reports, see the reports policy
                      ("patch", "gpujobs.carpool.dev", ""), ("list", "nodes", "")],
}


@pytest.mark.parametrize("component", ACCOUNTS)
def test_no_component_can_escalate_or_read_secrets(cluster: devcluster.Cluster, rbac: Rbac,
                                                    component: str) -> None:
    user = rbac.account(component)
    questions = DANGEROUS + DENIED_TO[component]
    with ThreadPoolExecutor(max_workers=8) as pool:  # one kubectl per question
        answers = list(pool.map(lambda q: can_i(cluster, user, q[0], q[1], None, q[2]),
                                questions))
    granted = [f"{verb} {resource}{'/' + sub if sub else ''}"
               for (verb, resource, sub), yes in zip(questions, answers, strict=True) if yes]
    assert granted == [], f"{component} may {granted}"


def test_the_accounts_are_not_inert(cluster: devcluster.Cluster, rbac: Rbac) -> None:
    """The denials above mean something only if these accounts hold their own grants."""
    assert can_i(cluster, rbac.account("operator"), "create", "pods", "default")
    assert can_i(cluster, rbac.account("extender"), "create", "pods", "default", "binding")
    assert can_i(cluster, rbac.account("device-plugin"), "patch", "gpunodes.carpool.dev",
                 None, "status")


# --- people: namespace users vs the platform team -------------------------------------------


@pytest.fixture(scope="module")
def people(cluster: devcluster.Cluster, rbac: Rbac, policies: None) -> Iterator[dict[str, str]]:
    """alice: `edit` in one namespace; pat: the release's platform-team ClusterRole."""
    suffix = rbac.namespace.removeprefix("relsec-")
    team_ns, other_ns = f"relsec-team-{suffix}", f"relsec-other-{suffix}"
    alice, pat = f"alice-{suffix}", f"pat-{suffix}"
    for namespace in (team_ns, other_ns):
        cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit",
                    f"--user={alice}", "-n", team_ns)
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit",
                    f"--user={alice}", "-n", other_ns)
    cluster.kubectl("create", "clusterrolebinding", f"relsec-pat-{suffix}",
                    f"--clusterrole={rbac.named('platform-team')}", f"--user={pat}")
    # The controller manager folds carpool-gpujob-edit into `edit` a moment after it exists.
    wait_for("aggregation into edit", lambda: can_i(cluster, alice, "create",
                                                    "gpujobs.carpool.dev", team_ns))
    try:
        yield {"alice": alice, "pat": pat, "team": team_ns, "other": other_ns}
    finally:
        cluster.kubectl("delete", "clusterrolebinding", f"relsec-pat-{suffix}",
                        "--ignore-not-found", check=False)
        for namespace in (team_ns, other_ns):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_only_the_platform_team_edits_projectquotas(cluster: devcluster.Cluster,
                                                     people: dict[str, str]) -> None:
    alice, pat = people["alice"], people["pat"]
    for verb in ("create", "update", "patch", "delete"):
        assert not can_i(cluster, alice, verb, "projectquotas.carpool.dev")
        assert can_i(cluster, pat, verb, "projectquotas.carpool.dev")
    assert not can_i(cluster, alice, "patch", "gpujobs.carpool.dev", people["team"], "status")
    quota: dict[str, Any] = {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
                             "metadata": {"name": f"relsec-{people['team']}"},
                             "spec": {"namespaces": [people["team"]], "concurrent": {"gpus": 1}}}
    refused = cluster.kubectl("apply", f"--as={alice}", "-f", "-",
                              stdin=yaml.safe_dump(quota), check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    cluster.kubectl("apply", f"--as={pat}", "-f", "-", stdin=yaml.safe_dump(quota))
    try:
        grab = cluster.kubectl("patch", "projectquota", quota["metadata"]["name"], f"--as={alice}",
                               "--type=merge", "-p",
                               json.dumps({"spec": {"namespaces": [people["other"]]}}),
                               check=False)
        assert grab.returncode != 0 and "forbidden" in grab.stderr.lower(), grab.stderr
        stored = json.loads(cluster.kubectl("get", "projectquota", quota["metadata"]["name"],
                                            "-o", "json").stdout)
        assert stored["spec"]["namespaces"] == [people["team"]]
    finally:
        cluster.kubectl("delete", "projectquota", quota["metadata"]["name"], check=False)


def gpujob(namespace: str, name: str, project: str) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"project": project, "class": "short",
                     "gpu": {"count": 1, "memory": "8Gi", "isolation": "mps"},
                     "template": {"spec": {"containers": [{"name": "main", "image": "x"}]}}}}


def test_a_namespace_cannot_bill_a_project_it_is_not_bound_to(
        cluster: devcluster.Cluster, people: dict[str, str], carpool_stack: Any) -> None:
    """alice has `edit` in both namespaces, so the API server takes both jobs; the operator
    refuses the one whose namespace the project does not list, and never makes its pod."""
    alice, pat = people["alice"], people["pat"]
    project = f"relsec-bill-{people['team']}"
    quota = {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
             "metadata": {"name": project},
                             "spec": {"namespaces": [people["team"]], "concurrent": {"gpus": 1}}}
    cluster.kubectl("apply", f"--as={pat}", "-f", "-", stdin=yaml.safe_dump(quota))
    jobs = [gpujob(people["team"], "bound", project), gpujob(people["other"], "unbound", project)]
    cluster.kubectl("apply", f"--as={alice}", "-f", "-", stdin=yaml.safe_dump_all(jobs))

    def status(namespace: str, name: str) -> dict[str, Any]:
        job = json.loads(cluster.kubectl("get", "gpujob", name, "-n", namespace,
                                         "-o", "json").stdout)
        return dict(job.get("status") or {})

    try:
        unbound = wait_for("the operator to refuse the unbound namespace",
                           lambda: (s := status(people["other"], "unbound")).get("reason")
                           and s, timeout=90)
        assert unbound["reason"] == "UnboundNamespace", unbound
        assert people["other"] in unbound.get("message", ""), unbound
        bound = wait_for("the bound job to be handled",
                         lambda: (s := status(people["team"], "bound")).get("phase") and s)
        assert bound.get("reason") != "UnboundNamespace", bound
        time.sleep(3)  # several operator passes: still refused, still no pod
        assert status(people["other"], "unbound")["reason"] == "UnboundNamespace"
        pods = cluster.kubectl("get", "pods", "-n", people["other"], "-o", "name").stdout
        assert pods.strip() == ""
    finally:
        cluster.kubectl("delete", "gpujob", "--all", "-n", people["other"], check=False)
        cluster.kubectl("delete", "gpujob", "--all", "-n", people["team"], check=False)
        cluster.kubectl("delete", "projectquota", project, check=False)


# --- the device plugin writes only its own node's GpuNode ----------------------------------


@pytest.fixture(scope="module")
def two_nodes(cluster: devcluster.Cluster, rbac: Rbac) -> Iterator[tuple[str, str]]:
    suffix = rbac.namespace.removeprefix("relsec-")
    nodes = simnodes.parse_nodes({"nodes": [
        {"name": f"relsec-a-{suffix}", "gpus": [{"model": "H200", "count": 1}]},
        {"name": f"relsec-b-{suffix}", "gpus": [{"model": "H200", "count": 1}]}]})
    api = cluster.api()
    simnodes.apply_nodes(api, nodes)
    try:
        yield nodes[0].name, nodes[1].name
    finally:
        simnodes.delete_nodes(api, [n.name for n in nodes])
        cluster.kubectl("delete", "gpunode", f"relsec-c-{suffix}", "--ignore-not-found",
                        check=False)


def kubectl_with(cluster: devcluster.Cluster, kubeconfig: Path, *args: str,
                 stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig),
                           *args], capture_output=True, text=True, input=stdin, timeout=60,
                          check=False)


def token_kubeconfig(cluster: devcluster.Cluster, token: str, path: Path) -> Path:
    """The cluster's server with only a bearer token (no client certificate to fall back on)."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])
    server = next(c for c in admin["clusters"] if c["name"] == context["context"]["cluster"])
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": server["cluster"]}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}))
    return path


Writer = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(params=["node-bound-token", "impersonation"])
def plugin_on_node_a(request: pytest.FixtureRequest, cluster: devcluster.Cluster, rbac: Rbac,
                     policies: None, two_nodes: tuple[str, str], tmp_path: Path) -> Writer:
    """kubectl as the device plugin's account, bound to node A: a real token bound to the Node
    object (the claim the API server itself puts in), or admin impersonation with the extra."""
    node_a = two_nodes[0]
    if request.param == "node-bound-token":
        token = cluster.kubectl("create", "token", f"{rbac.release}-device-plugin", "-n",
                                rbac.namespace, "--bound-object-kind=Node",
                                f"--bound-object-name={node_a}", "--duration=10m").stdout.strip()
        kubeconfig = token_kubeconfig(cluster, token, tmp_path / "plugin.kubeconfig")
        who = json.loads(kubectl_with(cluster, kubeconfig, "auth", "whoami", "-o",
                                      "json").stdout)
        assert who["status"]["userInfo"]["extra"][NODE_CLAIM] == [node_a]

        def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
            return kubectl_with(cluster, kubeconfig, *args, stdin=stdin)
        return run

    def impersonated(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl(*args, f"--as={rbac.account('device-plugin')}",
                               f"--as-user-extra={NODE_CLAIM}={node_a}", stdin=stdin,
                               check=False)
    return impersonated


def heartbeat_patch() -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"status": {"heartbeat": now}})


def test_device_plugin_writes_its_own_gpunode(plugin_on_node_a: Writer,
                                              two_nodes: tuple[str, str]) -> None:
    node_a, _ = two_nodes
    result = plugin_on_node_a("patch", "gpunode", node_a, "--subresource=status",
                              "--type=merge", "-p", heartbeat_patch())
    assert result.returncode == 0, result.stderr


def test_device_plugin_cannot_write_another_nodes_gpunode(
        plugin_on_node_a: Writer, two_nodes: tuple[str, str], cluster: devcluster.Cluster,
        rbac: Rbac) -> None:
    node_a, node_b = two_nodes
    before = cluster.kubectl("get", "gpunode", node_b, "-o",
                             "jsonpath={.status.heartbeat}").stdout
    result = plugin_on_node_a("patch", "gpunode", node_b, "--subresource=status",
                              "--type=merge", "-p", heartbeat_patch())
    assert result.returncode != 0
    assert rbac.named("gpunode-own-node") in result.stderr, result.stderr
    assert f"may write only GpuNode {node_a}" in result.stderr, result.stderr
    after = cluster.kubectl("get", "gpunode", node_b, "-o", "jsonpath={.status.heartbeat}").stdout
    assert after == before
    other = node_b.replace("relsec-b-", "relsec-c-")
    created = plugin_on_node_a("create", "-f", "-", stdin=yaml.safe_dump({
        "apiVersion": names.API_VERSION, "kind": "GpuNode", "metadata": {"name": other}}))
    assert created.returncode != 0 and f"may write only GpuNode {node_a}" in created.stderr, (
        created.stderr)


def test_node_claims_cannot_be_forged_by_components(cluster: devcluster.Cluster,
                                                   rbac: Rbac) -> None:
    """The claim is trustworthy only if no component can mint tokens or impersonate extras."""
    for component in ACCOUNTS:
        user = rbac.account(component)
        assert not can_i(cluster, user, "create", "serviceaccounts", rbac.namespace, "token")
        assert not can_i(cluster, user, "impersonate", "userextras", None, NODE_CLAIM)


# --- the device plugin records jobs' reports only for its node's jobs -----------------------


@pytest.fixture
def jobs_on_two_nodes(cluster: devcluster.Cluster, rbac: Rbac,
                      two_nodes: tuple[str, str]) -> Iterator[tuple[str, str, str]]:
    """A namespace with GpuJob `on-a` placed on node A and `on-b` on node B (status.node, as
    the operator writes it for a running job)."""
    namespace = f"relrep-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        for job, node in (("on-a", two_nodes[0]), ("on-b", two_nodes[1])):
            body = gpujob(namespace, job, "no-such-project")
            cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(body))
            cluster.kubectl("patch", "gpujob", job, "-n", namespace, "--subresource=status",
                            "--type=merge", "-p", json.dumps({"status": {"node": node}}))
        yield namespace, "on-a", "on-b"
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_device_plugin_records_reports_only_of_its_nodes_jobs(
        plugin_on_node_a: Writer, jobs_on_two_nodes: tuple[str, str, str],
        cluster: devcluster.Cluster, rbac: Rbac) -> None:
    """What deviceplugin/reports.py writes is accepted for a job on its node; the same write
    for a job on another node, or any other status field, is refused with the policy's
    message."""
    namespace, on_a, on_b = jobs_on_two_nodes
    report = checkpointing.checkpoint_status(
        checkpointing.CheckpointReport(time.time(), "/checkpoint/step-9", 0.3), attempt=1)
    served = service_levels.ServiceReport(time.time(), 10.0, 120, 1,
                                          service_levels.Histogram.of([0.01] * 120))
    report.update(service_levels.service_status(
        service_levels.ServiceMeasure(served, 1, "H200", 2)))
    body = json.dumps({"status": report})

    def patch(job: str, text: str) -> subprocess.CompletedProcess[str]:
        return plugin_on_node_a("patch", "gpujob", job, "-n", namespace,
                                "--subresource=status", "--type=merge", "-p", text)

    mine = patch(on_a, body)
    assert mine.returncode == 0, mine.stderr
    recorded = json.loads(cluster.kubectl("get", "gpujob", on_a, "-n", namespace,
                                          "-o", "json").stdout)["status"]
    assert recorded["lastCheckpoint"]["path"] == "/checkpoint/step-9"
    assert recorded["progress"]["value"] == 0.3
    assert (recorded["service"]["requests"], recorded["service"]["sharing"]) == (120, 2)

    theirs = patch(on_b, body)
    assert theirs.returncode != 0
    assert rbac.named("gpujob-reports-own-node") in theirs.stderr, theirs.stderr
    assert "may record reports only of jobs on that node" in theirs.stderr, theirs.stderr
    for forged in ({"phase": "Succeeded"}, {"node": "elsewhere"}, {"gpuHours": 0}):
        refused = patch(on_a, json.dumps({"status": {**report, **forged}}))
        assert refused.returncode != 0, forged
        assert "may change only lastCheckpointTime, lastCheckpoint, progress" in \
            refused.stderr, refused.stderr
    spec = plugin_on_node_a("patch", "gpujob", on_a, "-n", namespace, "--type=merge",
                            "-p", json.dumps({"metadata": {"labels": {"x": "y"}}}))
    assert spec.returncode != 0  # the object itself: not even RBAC allows it


def test_the_operator_running_on_a_node_still_writes_any_jobs_status(
        jobs_on_two_nodes: tuple[str, str, str], cluster: devcluster.Cluster, rbac: Rbac,
        policies: None, two_nodes: tuple[str, str]) -> None:
    """In a pod, the operator's token is node-bound too; the reports policy must not take it
    for a node agent: it writes the status of a job on another node, any field."""
    namespace, _, on_b = jobs_on_two_nodes
    written = cluster.kubectl(
        "patch", "gpujob", on_b, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"reason": "Checked", "gpuHours": 0.5}}),
        f"--as={rbac.account('operator')}", f"--as-user-extra={NODE_CLAIM}={two_nodes[0]}",
        check=False)
    assert written.returncode == 0, written.stderr


# --- the extender over TLS -----------------------------------------------------------------



def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=carpool-extender", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_extender_serves_https_and_refuses_plain_http(cluster: devcluster.Cluster,
                                                      tmp_path: Path) -> None:
    crds.apply_crds(cluster.api())
    cert, key = self_signed(tmp_path)
    port = stack.free_port()
    process = devcluster.start_extender(cluster.kubeconfig, port, tmp_path / "extender.log",
                                        ["--host", "127.0.0.1", "--tls-cert", str(cert),
                                         "--tls-key", str(key)], timeout=60)
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=3,
                                            context=trusted) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_for("the extender to be healthy over HTTPS", healthy)
        body = json.dumps({"Pod": {"metadata": {"name": "p", "namespace": "default"},
                                   "spec": {"containers": [{"name": "c"}]}},
                           "NodeNames": []}).encode()
        request = urllib.request.Request(f"https://127.0.0.1:{port}/filter", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10, context=trusted) as response:
            assert response.status == 200
            assert "NodeNames" in json.loads(response.read())
        with (pytest.raises((urllib.error.URLError, ConnectionError, OSError)) as plain,
              urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r):
            r.read()
        assert not isinstance(plain.value, urllib.error.HTTPError)  # no HTTP answer at all
        untrusted = ssl.create_default_context()
        with pytest.raises(urllib.error.URLError) as unverified:
            urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5,
                                   context=untrusted)
        assert isinstance(unverified.value.reason, ssl.SSLCertVerificationError)
        assert process.poll() is None
    finally:
        devcluster.stop_process(process)


# --- only Carpool writes the hand-over annotations --------------------------------------------


def annotated_pod(name: str, node: str | None, annotations: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "x"}],
                            "tolerations": [{"operator": "Exists"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations}, "spec": spec}


FORGED = json.dumps({"node": "any", "gpus": [{"uuid": "GPU-x", "index": 0,
                                              "memoryMiB": 10**9, "cores": 100}]})


def test_users_cannot_forge_gpu_assignments(cluster: devcluster.Cluster,
                                            people: dict[str, str]) -> None:
    """`edit` lets alice create and patch pods, but not Carpool's hand-over annotations: a forged
    assignment would make the device plugin hand her any GPU with any MPS limit."""
    alice, team = people["alice"], people["team"]
    forged = cluster.kubectl("create", f"--as={alice}", "-n", team, "-f", "-", check=False,
                             stdin=yaml.safe_dump(annotated_pod(
                                 "forged", None, {names.ANN_ASSIGNMENT: FORGED})))
    assert forged.returncode != 0, forged.stdout
    assert "cannot be created with carpool.dev/assignment" in forged.stderr, forged.stderr
    cluster.kubectl("create", f"--as={alice}", "-n", team, "-f", "-",
                    stdin=yaml.safe_dump(annotated_pod("plain", None, {"note": "mine"})))
    patched = cluster.kubectl("annotate", "pod", "plain", "-n", team, f"--as={alice}",
                              f"{names.ANN_ASSIGNMENT}={FORGED}", check=False)
    assert patched.returncode != 0 and (
        f"may not add, change or remove metadata.annotations[{names.ANN_ASSIGNMENT}]"
        in patched.stderr), patched.stderr
    allowed = cluster.kubectl("annotate", "pod", "plain", "-n", team, f"--as={alice}",
                              "note=still-mine", "--overwrite", check=False)
    assert allowed.returncode == 0, allowed.stderr  # other annotations stay hers
    admin = cluster.kubectl("annotate", "pod", "plain", "-n", team,
                            f"{names.ANN_ALLOCATED}={{}}", check=False)  # system:masters
    assert admin.returncode == 0, admin.stderr


def test_device_plugin_marks_only_pods_on_its_node(
        cluster: devcluster.Cluster, rbac: Rbac, people: dict[str, str],
        two_nodes: tuple[str, str]) -> None:
    node_a, node_b = two_nodes
    team = people["team"]
    for name, node in (("on-a", node_a), ("on-b", node_b)):
        cluster.kubectl("create", "-n", team, "-f", "-",
                        stdin=yaml.safe_dump(annotated_pod(name, node, {})))

    def annotate(pod: str, component: str, key: str, extra: str | None
                 ) -> subprocess.CompletedProcess[str]:
        args = ["annotate", "pod", pod, "-n", team, f"--as={rbac.account(component)}",
                f"{key}={{}}", "--overwrite"]
        args += [f"--as-user-extra={NODE_CLAIM}={extra}"] if extra else []
        return cluster.kubectl(*args, check=False)

    mine = annotate("on-a", "device-plugin", names.ANN_ALLOCATED, node_a)
    assert mine.returncode == 0, mine.stderr
    theirs = annotate("on-b", "device-plugin", names.ANN_ALLOCATED, node_a)
    assert theirs.returncode != 0
    assert f"bound to node {node_a} and may mark only pods on that node" in theirs.stderr, (
        theirs.stderr)
    extender = annotate("on-b", "extender", names.ANN_ASSIGNMENT, None)
    assert extender.returncode == 0, extender.stderr
    operator = cluster.kubectl("annotate", "pod", "on-b", "-n", team,
                               f"--as={rbac.account('operator')}",
                               f"{names.ANN_ASSIGNMENT}={FORGED}", "--overwrite", check=False)
    assert operator.returncode != 0  # it may patch pods only to take its finalizer off
    assert "may change a Pod only by removing its carpool.dev/ finalizer" in operator.stderr \
        or "may not add, change or remove" in operator.stderr, operator.stderr


def test_the_operator_only_takes_carpools_finalizer_off_a_gpujob_or_a_pod(
        cluster: devcluster.Cluster, rbac: Rbac, people: dict[str, str]) -> None:
    """RBAC gives the operator `patch` on GpuJobs and pods for Carpool's finalizer; the policy
    lets it only remove that finalizer (from a pod it made, or a GpuJob an earlier release
    put it on): no finalizer added, no other removed, labels and annotations out of reach."""
    team = people["team"]
    job = gpujob(team, "finalized", f"relsec-none-{team}")
    job["metadata"]["finalizers"] = [names.FINALIZER, "example.com/keep"]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job))  # as an earlier release
    pod = annotated_pod("finalized", None, {})
    pod["metadata"]["finalizers"] = [names.FINALIZER, "example.com/keep"]
    cluster.kubectl("create", "-n", team, "-f", "-", stdin=yaml.safe_dump(pod))
    as_operator = f"--as={rbac.account('operator')}"

    def patch(kind: str, body: Any, *extra: str) -> subprocess.CompletedProcess[str]:
        kind_type = ["--type=json"] if isinstance(body, list) else ["--type=merge"]
        return cluster.kubectl("patch", kind, "finalized", "-n", team, as_operator,
                               *kind_type, "-p", json.dumps(body), *extra, check=False)

    try:
        for kind, shown in (("gpujob", "GpuJob"), ("pod", "Pod")):
            for body, what in (
                    ({"metadata": {"finalizers": [names.FINALIZER, "example.com/keep",
                                                  "example.com/new"]}},
                     "metadata.finalizers[example.com/new] (added)"),
                    ({"metadata": {"finalizers": [names.FINALIZER]}},
                     "metadata.finalizers[example.com/keep] (removed)"),
                    ({"metadata": {"labels": {"team": "other"}}}, "labels"),
                    ({"metadata": {"annotations": {"team": "other"}}}, "annotations")):
                refused = patch(kind, body)
                assert refused.returncode != 0, (kind, body)
                assert f"may change a {shown} only by removing its carpool.dev/ finalizer; " \
                       f"this request also changes {what}" in refused.stderr, refused.stderr
            own = patch(kind, {"metadata": {"finalizers": ["example.com/keep"]}})
            assert own.returncode == 0, own.stderr
            stored = json.loads(cluster.kubectl("get", kind, "finalized", "-n", team,
                                                "-o", "json").stdout)
            assert stored["metadata"]["finalizers"] == ["example.com/keep"]
        status = patch("gpujob", {"status": {"message": "checked"}}, "--subresource=status")
        assert status.returncode == 0, status.stderr  # status is not this policy's business
        admin = cluster.kubectl("label", "gpujob", "finalized", "-n", team, "team=mine",
                                check=False)
        assert admin.returncode == 0, admin.stderr  # other callers are not affected
    finally:
        for kind in ("gpujob", "pod"):
            cluster.kubectl("patch", kind, "finalized", "-n", team, "--type=merge",
                            "-p", '{"metadata": {"finalizers": null}}', check=False)
            cluster.kubectl("delete", kind, "finalized", "-n", team, "--wait=false",
                            check=False)


def test_a_tenant_cannot_take_carpools_finalizer_off_a_pod_or_put_it_on_one(
        cluster: devcluster.Cluster, people: dict[str, str]) -> None:
    """Carpool's finalizer keeps a job's pod until the operator has recorded its run; alice
    (`edit`) may delete the pod, but not remove the finalizer (its GPU time would go unbilled
    if she deleted the job and the pod while no operator watched), nor put it on a pod of
    her own."""
    alice, team = people["alice"], people["team"]
    pod = annotated_pod("held", None, {})
    pod["metadata"]["finalizers"] = [names.FINALIZER]
    cluster.kubectl("create", "-n", team, "-f", "-", stdin=yaml.safe_dump(pod))  # as Carpool
    try:
        for body in ('{"metadata": {"finalizers": null}}', '{"metadata": {"finalizers": []}}'):
            stripped = cluster.kubectl("patch", "pod", "held", "-n", team, f"--as={alice}",
                                       "--type=merge", "-p", body, check=False)
            assert stripped.returncode != 0, stripped.stdout
            assert f"may not add, change or remove metadata.finalizers[{names.FINALIZER}]" \
                in stripped.stderr, stripped.stderr
        removed = cluster.kubectl(
            "patch", "pod", "held", "-n", team, f"--as={alice}", "--type=json", "-p",
            '[{"op": "remove", "path": "/metadata/finalizers/0"}]', check=False)
        assert removed.returncode != 0, removed.stdout
        deleted = cluster.kubectl("delete", "pod", "held", "-n", team, f"--as={alice}",
                                  "--wait=false", check=False)
        assert deleted.returncode == 0, deleted.stderr  # deleting her pod stays hers
        held = json.loads(cluster.kubectl("get", "pod", "held", "-n", team, "-o",
                                          "json").stdout)
        assert held["metadata"]["deletionTimestamp"]
        assert held["metadata"]["finalizers"] == [names.FINALIZER]
        own = annotated_pod("forged-hold", None, {})
        own["metadata"]["finalizers"] = [names.FINALIZER]
        forged = cluster.kubectl("create", f"--as={alice}", "-n", team, "-f", "-",
                                 stdin=yaml.safe_dump(own), check=False)
        assert forged.returncode != 0
        assert f"may not set metadata.finalizers[{names.FINALIZER}]" in forged.stderr, (
            forged.stderr)
        cluster.kubectl("create", f"--as={alice}", "-n", team, "-f", "-",
                        stdin=yaml.safe_dump(annotated_pod("plain-hold", None, {})))
        added = cluster.kubectl("patch", "pod", "plain-hold", "-n", team, f"--as={alice}",
                                "--type=merge", "-p", json.dumps(
                                    {"metadata": {"finalizers": [names.FINALIZER]}}),
                                check=False)
        assert added.returncode != 0, added.stdout
        assert f"may not add, change or remove metadata.finalizers[{names.FINALIZER}]" \
            in added.stderr, added.stderr
    finally:
        cluster.kubectl("patch", "pod", "held", "-n", team, "--type=merge",
                        "-p", '{"metadata": {"finalizers": null}}', check=False)
        cluster.kubectl("delete", "pod", "held", "plain-hold", "-n", team, "--wait=false",
                        "--ignore-not-found", check=False)


# --- what runs with host access, checked by the API server's Pod Security admission ---------

HOST_ACCESS = {"device-plugin", "mps-daemon"}  # the node agents; see docs/reliability.md
# The capabilities a long-running container may add, each for one reason: the device plugin's
# watchdog stops pods past their memory grant (KILL); the MPS control daemon starts each MPS
# server as its clients' user (SETUID, SETGID).
ADDED_CAPABILITIES = {("device-plugin", "device-plugin"): {"KILL"},
                      ("mps-daemon", "mps-control"): {"SETUID", "SETGID"}}


def test_only_the_node_agents_need_more_than_restricted(cluster: devcluster.Cluster,
                                                       rbac: Rbac) -> None:
    """Every pod the chart makes, dry-run created in a namespace enforcing the `restricted` Pod
    Security Standard: the operator, extender and scheduler pass; the device plugin and MPS
    daemon are refused (hostPath, root, hostPID for the memory watchdog) and pass `privileged`
    level without being privileged containers: no privileged flag, no capability but KILL; the
    only privileged container is the MPS daemon's init container that sets EXCLUSIVE_PROCESS."""
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", rbac.release, str(CHART), "--namespace",
         rbac.namespace], capture_output=True, text=True, timeout=120, check=True).stdout
    workloads = [o for o in yaml.safe_load_all(rendered)
                 if o and o["kind"] in ("Deployment", "DaemonSet")]
    suffix = rbac.namespace.removeprefix("relsec-")
    restricted, privileged = f"relsec-psa-r-{suffix}", f"relsec-psa-p-{suffix}"
    for namespace, level in ((restricted, "restricted"), (privileged, "privileged")):
        cluster.kubectl("create", "namespace", namespace)
        cluster.kubectl("label", "namespace", namespace,
                        f"pod-security.kubernetes.io/enforce={level}")
    try:
        verdicts = {}
        for workload in workloads:
            template = workload["spec"]["template"]
            component = template["metadata"]["labels"]["app.kubernetes.io/component"]
            for container in template["spec"]["containers"]:
                security = container.get("securityContext") or {}
                assert not security.get("privileged"), workload["metadata"]["name"]
                added = set((security.get("capabilities") or {}).get("add") or [])
                allowed = ADDED_CAPABILITIES.get((component, container["name"]), set())
                assert added <= allowed, (workload["metadata"]["name"], container["name"], added)
            for container in template["spec"].get("initContainers") or []:
                # the one privileged container: sets EXCLUSIVE_PROCESS on MPS GPUs and exits
                assert (component, container["name"]) == ("mps-daemon", "exclusive-process")
                assert container["command"] == ["nvidia-smi", "-c", "EXCLUSIVE_PROCESS"]
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": workload["metadata"]["name"],
                                "labels": template["metadata"]["labels"]},
                   "spec": template["spec"]}
            for namespace in (restricted, privileged):
                result = cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f",
                                         "-", stdin=yaml.safe_dump(pod), check=False)
                verdicts[(workload["metadata"]["name"], namespace)] = result
            admitted = verdicts[(workload["metadata"]["name"], restricted)]
            if component in HOST_ACCESS:
                assert admitted.returncode != 0, workload["metadata"]["name"]
                assert 'violates PodSecurity "restricted' in admitted.stderr, admitted.stderr
                assert "hostPath" in admitted.stderr, admitted.stderr
            else:
                assert admitted.returncode == 0, (workload["metadata"]["name"], admitted.stderr)
            at_privileged = verdicts[(workload["metadata"]["name"], privileged)]
            assert at_privileged.returncode == 0, at_privileged.stderr
        components = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                      for w in workloads}
        assert components >= {"operator", "extender", "scheduler", "device-plugin"}, components
    finally:
        for namespace in (restricted, privileged):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
