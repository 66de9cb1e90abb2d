"""Tenant isolation on the real API server and kube-scheduler, acting as a tenant.

alice holds the built-in `edit` role in a project namespace (the chart's GpuJob roles aggregate
into it), which lets her create Pods, Deployments and GpuJobs there. Everything the chart's
admission policies must stop (hack/policies/gpujob-only.yaml and tenant-isolation.yaml) is tried
with `kubectl --as alice`: each refusal comes from the API server and names the field and what
to do instead. Then the defence behind admission: a pod with carpool.dev/gpu that got past it (a
break-glass admin's) is filtered out by the strict extender the chart runs, with the reason in
its FailedScheduling event. Pod Security levels for tenant namespaces are checked with the
operator's own pods: `baseline` takes a plain GpuJob's pod; `restricted` takes a compliant one
and refuses the rest with the job saying why.

The chart's RBAC and policy objects are rendered with `helm template` under this module's own
release name and applied alone (the policies are cluster-wide; removed afterwards).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from carpool.core import names
from carpool_testbed import crds, devcluster, simnodes, stack
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "helm" / "carpool"
KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
T = TypeVar("T")


@dataclass(frozen=True)
class Tenancy:
    cluster: devcluster.Cluster
    release: str
    system_ns: str  # the release namespace (exempt from tenant isolation)
    team: str  # alice's project namespace
    alice: str
    project: str

    def operator(self) -> str:
        return f"system:serviceaccount:{self.system_ns}:{self.release}-operator"

    def as_alice(self, *args: str, stdin: str | None = None
                 ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, f"--as={self.alice}", "-n", self.team,
                                    stdin=stdin, check=False)

    def create(self, obj: dict[str, Any], as_user: str | None = None
               ) -> subprocess.CompletedProcess[str]:
        user = as_user or self.alice
        return self.cluster.kubectl("create", f"--as={user}", "-n", self.team, "-f", "-",
                                    stdin=yaml.safe_dump(obj), check=False)


@pytest.fixture(scope="module")
def tenancy(cluster: devcluster.Cluster) -> Iterator[Tenancy]:
    suffix = uuid.uuid4().hex[:6]
    release, system_ns = f"carpool-ten-{suffix}", f"ten-sys-{suffix}"
    team, alice, project = f"ten-team-{suffix}", f"alice-{suffix}", f"ten-{suffix}"
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", release, str(CHART), "--namespace",
         system_ns], capture_output=True, text=True, timeout=120, check=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in KINDS]
    assert {f"{release}-gpujob-only", f"{release}-tenant-isolation"} <= {
        o["metadata"]["name"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    crds.apply_crds(cluster.api())
    for namespace in (system_ns, team):
        cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit",
                    f"--user={alice}", "-n", team)
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump({
        "apiVersion": names.API_VERSION, "kind": "ProjectQuota", "metadata": {"name": project},
        "spec": {"namespaces": [team], "concurrent": {"gpus": 2}}}))

    def can_create_gpujobs() -> bool:
        answer = cluster.kubectl("auth", "can-i", "create", "gpujobs.carpool.dev",
                                 f"--as={alice}", "-n", team, check=False)
        return answer.stdout.strip() == "yes"

    wait_for("the GpuJob roles to aggregate into edit", can_create_gpujobs)

    def enforced() -> bool:  # policies take effect a moment after they are created
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
                 "spec": {"hostPID": True, "containers": [{"name": "c", "image": "x"}]}}
        result = cluster.kubectl("create", "--dry-run=server", f"--as={alice}", "-n", team,
                                 "-f", "-", stdin=yaml.safe_dump(probe), check=False)
        return result.returncode != 0 and "tenant-isolation" in result.stderr

    wait_for("the tenant-isolation policy to be enforced", enforced)
    try:
        yield Tenancy(cluster, release, system_ns, team, alice, project)
    finally:
        cluster.kubectl("delete", "projectquota", project, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                        stdin=yaml.safe_dump_all(objects), check=False)
        for namespace in (system_ns, team):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def pod(name: str, container: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    main = {"name": "main", "image": "trainer", **(container or {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [main], **spec}}


def gpujob(t: Tenancy, name: str, container: dict[str, Any] | None = None,
           gpu: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    main = {"name": "main", "image": "trainer", **(container or {})}
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
            "spec": {"project": t.project, "class": "short",
                     "gpu": gpu or {"count": 1, "memory": "8Gi", "isolation": "mps"},
                     "simulatedDuration": "30s",
                     "template": {"spec": {"containers": [main], **spec}}}}


def refused(result: subprocess.CompletedProcess[str], policy: str, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    assert f"-{policy}" in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


# --- the variables isolation depends on -----------------------------------------------------

ISOLATION_VARIABLES = [
    ("NVIDIA_VISIBLE_DEVICES", "all"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=140G"),
    ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/mine"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
    ("CUDA_VISIBLE_DEVICES", "0,1,2,3"),
    ("NVIDIA_DRIVER_CAPABILITIES", "all"),
    ("CARPOOL_GPU_MEMORY_LIMIT_MIB", "999999"),
]


@pytest.mark.parametrize(("variable", "value"), ISOLATION_VARIABLES)
def test_a_tenant_cannot_set_isolation_variables(tenancy: Tenancy, variable: str,
                                                 value: str) -> None:
    env = {"env": [{"name": "HOME", "value": "/work"}, {"name": variable, "value": value}]}
    job = tenancy.create(gpujob(tenancy, f"env-{uuid.uuid4().hex[:5]}", env))
    refused(job, "tenant-isolation", f"spec.template.spec.containers[main].env sets {variable}:",
            "Remove them and ask for GPU memory and cores in the GpuJob's spec.gpu")
    plain = tenancy.create(pod(f"env-{uuid.uuid4().hex[:5]}", env))  # even without GPUs
    refused(plain, "tenant-isolation", f"spec.containers[main].env sets {variable}:")


def test_init_containers_are_checked_and_harmless_variables_pass(tenancy: Tenancy) -> None:
    init = {"name": "fetch", "image": "x", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                                                   "value": "all"}]}
    result = tenancy.create(pod("init-env", initContainers=[init]))
    refused(result, "tenant-isolation", "spec.initContainers[fetch].env sets "
                                        "NVIDIA_VISIBLE_DEVICES")
    fine = {"env": [{"name": "NVIDIA_TF32_OVERRIDE", "value": "0"},
                    {"name": "CUDA_LAUNCH_BLOCKING", "value": "1"}],
            "envFrom": [{"prefix": "APP_", "configMapRef": {"name": "settings"}}]}
    ok = tenancy.create(gpujob(tenancy, "harmless", fine))
    assert ok.returncode == 0, ok.stderr
    tenancy.cluster.kubectl("delete", "gpujob", "harmless", "-n", tenancy.team, "--wait=false",
                            check=False)


@pytest.mark.parametrize("source", [
    {"configMapRef": {"name": "settings"}},                    # no prefix: any key becomes a var
    {"secretRef": {"name": "creds"}, "prefix": "NVIDIA_"},     # NVIDIA_ + VISIBLE_DEVICES
    {"configMapRef": {"name": "settings"}, "prefix": "CUDA_"},  # CUDA_ + MPS_PIPE_DIRECTORY
    {"configMapRef": {"name": "settings"}, "prefix": "C"},     # C + ARPOOL_..., UDA_...
])
def test_env_from_cannot_smuggle_isolation_variables(tenancy: Tenancy,
                                                     source: dict[str, Any]) -> None:
    """envFrom's keys are not known at admission: only a prefix that no isolation variable
    begins with keeps them out."""
    result = tenancy.create(gpujob(tenancy, f"from-{uuid.uuid4().hex[:5]}", {"envFrom": [source]}))
    refused(result, "tenant-isolation", "spec.template.spec.containers[main].envFrom takes",
            "Give the envFrom a prefix such as APP_")


# --- privilege, host devices, host namespaces -----------------------------------------------


@pytest.mark.parametrize(("change", "field", "advice"), [
    ({"container": {"securityContext": {"privileged": True}}},
     "containers[main].securityContext.privileged", "sees every GPU on the node"),
    ({"container": {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}},
     "containers[main].securityContext.capabilities.add", "sees every GPU on the node"),
    ({"spec": {"volumes": [{"name": "gpu", "hostPath": {"path": "/dev/nvidia0"}}]},
      "container": {"volumeMounts": [{"name": "gpu", "mountPath": "/dev/nvidia0"}]}},
     "volumes[gpu].hostPath.path /dev/nvidia0", "Use a PersistentVolumeClaim"),
    ({"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
     "volumes[root].hostPath.path /", "may not mount host paths"),
    ({"spec": {"hostPID": True}}, "hostPID", "shares the node's processes"),
    ({"spec": {"hostIPC": True}}, "hostIPC", "MPS daemon's shared memory"),
])
def test_no_privilege_host_device_or_host_namespace(tenancy: Tenancy, change: dict[str, Any],
                                                    field: str, advice: str) -> None:
    name = f"host-{uuid.uuid4().hex[:5]}"
    job = tenancy.create(gpujob(tenancy, name, change.get("container"), **change.get("spec", {})))
    refused(job, "tenant-isolation", f"spec.template.spec.{field}", advice)
    plain = tenancy.create(pod(name, change.get("container"), **change.get("spec", {})))
    refused(plain, "tenant-isolation", f"spec.{field}", advice)


def test_a_debug_container_is_checked_too(tenancy: Tenancy) -> None:
    """`kubectl debug` adds an ephemeral container to a running pod (pods/ephemeralcontainers,
    an update): it may not bring what a pod may not have."""
    created = tenancy.create(pod("debuggee"))
    assert created.returncode == 0, created.stderr
    allowed = tenancy.cluster.kubectl("auth", "can-i", "update", "pods", "--subresource",
                                      "ephemeralcontainers", f"--as={tenancy.alice}", "-n",
                                      tenancy.team, check=False).stdout.strip()
    debug = {"spec": {"ephemeralContainers": [{
        "name": "dbg", "image": "busybox",
        "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}]}}
    result = tenancy.as_alice("patch", "pod", "debuggee", "--subresource=ephemeralcontainers",
                              "--type=strategic", "-p", json.dumps(debug))
    if allowed == "yes":
        refused(result, "tenant-isolation",
                "spec.ephemeralContainers[dbg].env sets CUDA_VISIBLE_DEVICES")
    else:  # edit does not grant it on this version: RBAC already closes the door
        assert result.returncode != 0 and "forbidden" in result.stderr.lower(), result.stderr
    labelled = tenancy.as_alice("label", "pod", "debuggee", "team=vision")
    assert labelled.returncode == 0, labelled.stderr  # other updates are not re-judged


# --- a GpuJob is the only door --------------------------------------------------------------


def gpu_pod(name: str, count: int = 1, scheduler: str = names.SCHEDULER_NAME,
            owner_uid: str = "") -> dict[str, Any]:
    obj = pod(name, {"resources": {"limits": {names.RESOURCE_GPU: str(count)}}},
              schedulerName=scheduler)
    if owner_uid:
        obj["metadata"]["ownerReferences"] = [{
            "apiVersion": names.API_VERSION, "kind": "GpuJob", "name": "real-job",
            "uid": owner_uid, "controller": True}]
    return obj


def test_a_tenant_cannot_ask_for_carpool_gpus_outside_a_gpujob(tenancy: Tenancy) -> None:
    advice = "Submit a GpuJob (apiVersion carpool.dev/v1alpha1) that asks for the GPUs in spec.gpu"
    through_carpool = tenancy.create(gpu_pod("sneaky"))
    refused(through_carpool, "gpujob-only",
            "spec.containers[main].resources asks for carpool.dev/gpu", advice)
    four_default = tenancy.create(gpu_pod("greedy", 4, scheduler="default-scheduler"))
    refused(four_default, "gpujob-only", "carpool.dev/gpu", advice)
    # an owner reference to a real GpuJob of hers proves nothing: the requester is alice
    job = tenancy.create(gpujob(tenancy, "real-job"))
    assert job.returncode == 0, job.stderr
    uid = tenancy.cluster.kubectl("get", "gpujob", "real-job", "-n", tenancy.team, "-o",
                                  "jsonpath={.metadata.uid}").stdout
    forged = tenancy.create(gpu_pod("forged-owner", owner_uid=uid))
    refused(forged, "gpujob-only", advice)
    # through a controller: the Deployment is stored; the pod its ReplicaSet makes is refused.
    # kube-controller-manager creates it as the replicaset-controller account when it runs with
    # per-controller credentials (kubeadm's default). This test bed's controller manager runs
    # as a system:masters admin, which the policy exempts, so the pod is created here as that
    # account by impersonation.
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "farm"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "farm"}},
                           "template": {"metadata": {"labels": {"app": "farm"}},
                                        "spec": gpu_pod("x")["spec"]}}}
    stored = tenancy.cluster.kubectl("create", "--dry-run=server", f"--as={tenancy.alice}",
                                     "-n", tenancy.team, "-f", "-",
                                     stdin=yaml.safe_dump(deployment), check=False)
    assert stored.returncode == 0, stored.stderr
    replica = gpu_pod("farm-7d9f8-abcde")
    replica["metadata"]["labels"] = {"app": "farm"}
    by_controller = tenancy.create(
        replica, as_user="system:serviceaccount:kube-system:replicaset-controller")
    refused(by_controller, "gpujob-only", advice)
    # nor can a GpuJob's template ask for them itself (the operator copies the template)
    extra = gpujob(tenancy, "template-gpus")
    extra["spec"]["template"]["spec"]["containers"].append(
        {"name": "side", "image": "x", "resources": {"limits": {names.RESOURCE_GPU: "4"}}})
    template = tenancy.create(extra)
    refused(template, "gpujob-only",
            "spec.template.spec.containers[side].resources asks for carpool.dev/gpu",
            "a GpuJob asks for GPUs in spec.gpu")
    tenancy.cluster.kubectl("delete", "gpujob", "real-job", "-n", tenancy.team, "--wait=false",
                            check=False)


def test_the_operators_account_may_create_gpu_pods(tenancy: Tenancy) -> None:
    """The door is the requester's identity: the release's operator account (whose RBAC the
    fixture applied) is let through, with the workload protocol's CARPOOL_* variables it sets
    in each attempt's pod; anyone else is not."""
    dry = ["--dry-run=server"]
    made = gpu_pod("by-operator")
    made["spec"]["containers"][0]["env"] = [{"name": "CARPOOL_JOB", "value": "real-job"},
                                            {"name": "CARPOOL_ATTEMPT", "value": "1"}]
    as_operator = tenancy.cluster.kubectl(
        "create", *dry, f"--as={tenancy.operator()}", "-n", tenancy.team, "-f", "-",
        stdin=yaml.safe_dump(made), check=False)
    assert as_operator.returncode == 0, as_operator.stderr
    other = f"system:serviceaccount:{tenancy.system_ns}:{tenancy.release}-extender"
    as_other = tenancy.cluster.kubectl(
        "create", *dry, f"--as={other}", "-n", tenancy.team, "-f", "-",
        stdin=yaml.safe_dump(gpu_pod("by-extender")), check=False)
    assert as_other.returncode != 0  # RBAC or the policy; never a GPU pod


# --- behind admission: the extender, and Pod Security with the operator's pods --------------


@pytest.fixture(scope="module")
def strict_stack(cluster: devcluster.Cluster, tenancy: Tenancy,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The extender as the chart runs it (places only GpuJobs' pods), an operator, and one
    simulated H200 node; yields the node's name."""
    node_name = f"{tenancy.team}-h200"
    node = simnodes.parse_nodes({"nodes": [{"name": node_name, "sharing": "mps",
                                            "gpus": [{"model": "H200", "count": 2}]}]})[0]
    simnodes.apply_nodes(cluster.api(), [node])
    log_dir = Path(tmp_path_factory.mktemp("tenant-stack"))
    try:
        with stack.running_stack(cluster, log_dir, {"CARPOOL_RESYNC_SECONDS": "2"},
                                 strict=True):
            yield node_name
    finally:
        cluster.kubectl("delete", "node", node_name, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "gpunode", node_name, "--ignore-not-found", check=False)


def test_a_gpu_pod_past_admission_is_not_placed(tenancy: Tenancy, strict_stack: str) -> None:
    """A break-glass admin (system:masters, exempt from the policy) creates a bare GPU pod;
    the extender filters every node out and the scheduler says why in the pod's events."""
    bare = gpu_pod("admin-bare")
    bare["spec"]["nodeSelector"] = {"kubernetes.io/hostname": strict_stack}
    tenancy.cluster.kubectl("create", "-n", tenancy.team, "-f", "-", stdin=yaml.safe_dump(bare))

    def failed_scheduling() -> str:
        events = tenancy.cluster.kubectl(
            "get", "events", "-n", tenancy.team, "-o", "json", "--field-selector",
            "involvedObject.name=admin-bare,reason=FailedScheduling").stdout
        return "\n".join(e.get("message", "") for e in json.loads(events)["items"])

    message = wait_for("the pod's FailedScheduling event", failed_scheduling, timeout=90)
    assert f"pod {tenancy.team}/admin-bare is not owned by a GpuJob" in message, message
    node = tenancy.cluster.kubectl("get", "pod", "admin-bare", "-n", tenancy.team, "-o",
                                   "jsonpath={.spec.nodeName}").stdout
    assert node == ""
    tenancy.cluster.kubectl("delete", "pod", "admin-bare", "-n", tenancy.team, "--wait=false")


def job_status(t: Tenancy, namespace: str, name: str) -> dict[str, Any]:
    out = t.cluster.kubectl("get", "gpujob", name, "-n", namespace, "-o", "json").stdout
    return dict(json.loads(out).get("status") or {})


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_pod_security_levels_for_tenant_namespaces(tenancy: Tenancy, strict_stack: str,
                                                   level: str) -> None:
    """A tenant namespace enforcing a Pod Security level, with the operator making the pods: a
    GpuJob whose template meets the level runs (the operator adds nothing a level refuses; the
    MPS pipe comes through Allocate, not the pod spec); one that does not is Failed with the
    API server's reason."""
    namespace = f"{tenancy.team}-{level}"
    cluster = tenancy.cluster
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("label", "namespace", namespace,
                    f"pod-security.kubernetes.io/enforce={level}")
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit",
                    f"--user={tenancy.alice}", "-n", namespace)
    cluster.kubectl("patch", "projectquota", tenancy.project, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/namespaces/-", "value": namespace}]))
    compliant: dict[str, Any] = {}
    if level == "restricted":
        compliant = {"securityContext": {
            "runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}}
    pinned = {"nodeSelector": {"kubernetes.io/hostname": strict_stack}}
    good = gpujob(tenancy, "meets-level", compliant, **pinned)
    bad = gpujob(tenancy, "below-level",
                 {"securityContext": {"capabilities": {"add": ["NET_RAW", "NET_ADMIN"]}}},
                 **pinned)
    try:
        for job in (good, bad):
            made = cluster.kubectl("create", f"--as={tenancy.alice}", "-n", namespace, "-f",
                                   "-", stdin=yaml.safe_dump(job), check=False)
            assert made.returncode == 0, made.stderr  # the policy has nothing against either
        ran = wait_for("the compliant job to run", lambda: (
            s := job_status(tenancy, namespace, "meets-level")).get("phase") in (
            "Running", "Succeeded") and s, timeout=90)
        assert ran["node"] == strict_stack
        failed = wait_for("the other job to be refused", lambda: (
            s := job_status(tenancy, namespace, "below-level")).get("phase") == "Failed" and s,
            timeout=90)
        assert failed["reason"] == "PodRejected", failed
        assert f'violates PodSecurity "{level}:latest"' in failed["message"], failed
    finally:
        cluster.kubectl("delete", "gpujobs", "--all", "-n", namespace, "--wait=false",
                        check=False)
        cluster.kubectl("patch", "projectquota", tenancy.project, "--type=merge", "-p",
                        json.dumps({"spec": {"namespaces": [tenancy.team]}}), check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
