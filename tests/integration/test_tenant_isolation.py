"""Tenant isolation on the real API server and kube-scheduler, acting as a tenant.

alice holds the built-in `edit` role in a project namespace (the chart's GpuJob roles aggregate
into it), which lets her create Pods, Deployments and GpuJobs there. Everything the chart's
admission policies (hack/policies/) and the GpuJob CRD's rules must stop is tried with
`kubectl --as alice`, one door per test: Carpool's metadata on pods, GpuJob template fields
Carpool decides, Pod Security `baseline` compared as container runtimes compare, priority
above Carpool's jobs, other vendors' GPUs and ResourceClaims, class limits. Each refusal comes
from the API server and names the field and what to do instead. Then what stands behind
admission: a pod with carpool.dev/gpu that got past it (a break-glass admin's) is filtered out
by the strict extender the chart runs, with the reason in its FailedScheduling event; Pod
Security levels for tenant namespaces are checked with the operator's own pods; a project's
class limits make the operator refuse a job, with the reason in its status and an Event.

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
POLICIES = ("gpunode-own-node", "gpujob-reports-own-node", "pod-metadata",
            "operator-finalizer-only", "gpujob-only", "tenant-isolation", "tenant-priority",
            "tenant-devices", "class-limits")
# the chart's policies.classLimits for this module (bound to alice's namespace only)
CLASS_LIMITS = {"interactive": {"maxGpus": 2, "maxDuration": "8h", "maxGracePeriod": "5m",
                                "minGpuMemory": "1Gi", "minGpuCores": 10}}
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

    def runtime_class(self) -> str:
        return f"nvidia-{self.release.removeprefix('carpool-ten-')}"

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
         system_ns, "--set-json", f"policies.classLimits={json.dumps(CLASS_LIMITS)}",
         "--set", f"devicePlugin.runtimeClassName=nvidia-{suffix}"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in KINDS]
    assert {f"{release}-{p}" for p in POLICIES} == {
        o["metadata"]["name"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    for obj in objects:  # the cluster-wide class limits only where this module looks
        if obj["metadata"]["name"] == f"{release}-class-limits" and obj["kind"].endswith(
                "Binding"):
            obj["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": team}}}
    objects.append({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                    "metadata": {"name": f"nvidia-{suffix}"}, "handler": "nvidia"})
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
    """Refused by the chart policy `policy` (or, with policy "crd", by the GpuJob CRD's own
    rules), the message holding each fragment."""
    assert result.returncode != 0, result.stdout
    if policy == "crd":
        assert 'The GpuJob "' in result.stderr and "is invalid" in result.stderr, (
            result.stderr)
    else:
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


# --- Pod Security baseline, stated as what is allowed ------------------------------------------

CAPS = "securityContext.capabilities.add has"


def caps(*names_: str) -> dict[str, Any]:
    return {"container": {"securityContext": {"capabilities": {"add": list(names_)}}}}


# (change to a pod: "container" fields of its main container, "spec" fields of the pod,
# "annotations"), the refused field as the message names it (after spec.), and a fragment of
# the reason. Each is a door the policy's earlier forbidden-list left open, or one it closed.
POD_SECURITY = [
    ({"container": {"securityContext": {"privileged": True}}},
     "containers[main].securityContext.privileged must be false", "Pod Security baseline"),
    (caps("SYS_ADMIN"), f"containers[main].{CAPS} SYS_ADMIN", "baseline allows only AUDIT_WRITE"),
    (caps("sys_admin"), f"containers[main].{CAPS} sys_admin", "compared"),
    (caps("all"), f"containers[main].{CAPS} all", "case-insensitively"),
    (caps("CAP_SYS_ADMIN"), f"containers[main].{CAPS} CAP_SYS_ADMIN", "with or without CAP_"),
    (caps("CHOWN", "SYS_MODULE", "dac_read_search", "BPF"),
     f"containers[main].{CAPS} SYS_MODULE, dac_read_search, BPF", "NET_BIND_SERVICE"),
    (caps("NET_RAW"), f"containers[main].{CAPS} NET_RAW", "SYS_CHROOT)"),
    ({"spec": {"volumes": [{"name": "gpu", "hostPath": {"path": "/dev/nvidia0"}}]},
      "container": {"volumeMounts": [{"name": "gpu", "mountPath": "/dev/nvidia0"}]}},
     "volumes[gpu].hostPath /dev/nvidia0 (host paths are not allowed)", "host paths"),
    ({"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
     "volumes[root].hostPath / (host paths are not allowed)", "other tenants"),
    ({"container": {"ports": [{"containerPort": 8080, "hostPort": 80}]}},
     "containers[main].ports hostPort 80 (host ports are not allowed)", "Remove them"),
    ({"container": {"securityContext": {"procMount": "Unmasked"}}, "spec": {"hostUsers": False}},
     "containers[main].securityContext.procMount must be Default", "unmasked /proc"),
    ({"container": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
     "containers[main].securityContext.seccompProfile.type must be RuntimeDefault or Localhost",
     "Pod Security baseline"),
    ({"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
     "securityContext.seccompProfile.type must be RuntimeDefault or Localhost", "baseline"),
    ({"spec": {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}},
     "securityContext.appArmorProfile.type must be RuntimeDefault or Localhost", "baseline"),
    ({"container": {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}},
     "containers[main].securityContext.appArmorProfile.type must be RuntimeDefault", "baseline"),
    ({"annotations": {"container.apparmor.security.beta.kubernetes.io/main": "unconfined"}},
     "annotations[container.apparmor.security.beta.kubernetes.io/main] unconfined",
     "runtime/default or localhost/"),
    ({"container": {"securityContext": {"seLinuxOptions": {"user": "system_u",
                                                            "type": "spc_t"}}}},
     "containers[main].securityContext.seLinuxOptions may set only type, one of container_t",
     "baseline"),
    ({"spec": {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "65536"},
                                               {"name": "net.ipv4.tcp_syncookies",
                                                "value": "1"}]}}},
     "securityContext.sysctls has kernel.msgmax (only kernel.shm_rmid_forced", "baseline"),
]


def with_change(change: dict[str, Any], obj: dict[str, Any], job: bool) -> dict[str, Any]:
    spec = obj["spec"]["template"]["spec"] if job else obj["spec"]
    spec["containers"][0].update(change.get("container", {}))
    spec.update(change.get("spec", {}))
    if change.get("annotations"):
        meta = obj["spec"]["template"].setdefault("metadata", {}) if job else obj["metadata"]
        meta["annotations"] = change["annotations"]
    return obj


@pytest.mark.parametrize(("change", "field", "reason"), POD_SECURITY,
                         ids=[f"ps{i}" for i in range(len(POD_SECURITY))])
def test_pod_security_baseline_as_the_runtime_compares(tenancy: Tenancy, change: dict[str, Any],
                                                       field: str, reason: str) -> None:
    """Pods and GpuJob templates alike: each field outside what baseline allows is refused,
    named with its path."""
    name = f"ps-{uuid.uuid4().hex[:5]}"
    in_metadata = field.startswith("annotations")
    job = tenancy.create(with_change(change, gpujob(tenancy, name), job=True))
    refused(job, "tenant-isolation",
            ("spec.template.metadata." if in_metadata else "spec.template.spec.") + field, reason)
    plain = tenancy.create(with_change(change, pod(name), job=False))
    refused(plain, "tenant-isolation", ("metadata." if in_metadata else "spec.") + field, reason)


def test_what_baseline_allows_passes(tenancy: Tenancy) -> None:
    """The allowlist is not a wall: baseline's capabilities in any spelling, safe sysctls,
    RuntimeDefault profiles and the container SELinux types are admitted."""
    fine = with_change({"container": {"securityContext": {
        "capabilities": {"add": ["chown", "CAP_NET_BIND_SERVICE", "Kill"], "drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
        "seLinuxOptions": {"type": "container_t", "level": "s0:c1,c2"}},
        "ports": [{"containerPort": 8080}]},
        "spec": {"securityContext": {"sysctls": [{"name": "net.ipv4.tcp_syncookies",
                                                  "value": "1"}],
                                     "appArmorProfile": {"type": "RuntimeDefault"}}}},
        pod("baseline-ok"), job=False)
    made = tenancy.cluster.kubectl("create", "--dry-run=server", f"--as={tenancy.alice}", "-n",
                                   tenancy.team, "-f", "-", stdin=yaml.safe_dump(fine),
                                   check=False)
    assert made.returncode == 0, made.stderr


@pytest.mark.parametrize("field", ["hostNetwork", "hostPID", "hostIPC"])
def test_no_host_namespace(tenancy: Tenancy, field: str) -> None:
    """A pod is refused by the policy; a GpuJob already by its CRD, which names the field."""
    host: dict[str, Any] = {field: True}
    plain = tenancy.create(pod(f"host-{uuid.uuid4().hex[:5]}", **host))
    refused(plain, "tenant-isolation", f"spec.{field} must be false")
    job = tenancy.create(gpujob(tenancy, f"host-{uuid.uuid4().hex[:5]}", **host))
    refused(job, "crd", f"spec.template.spec.{field} must not be true")


def test_a_runtime_class_only_if_the_platform_team_allows_it(tenancy: Tenancy) -> None:
    """The chart allows none by default (policies.runtimeClasses); the RuntimeClass exists,
    so what refuses it is the policy, naming the field. The operator's account may put the
    GPU nodes' class (devicePlugin.runtimeClassName, set by the fixture) on a job's pod."""
    runtime = tenancy.runtime_class()
    plain = tenancy.create(pod(f"rc-{uuid.uuid4().hex[:5]}", runtimeClassName=runtime))
    refused(plain, "tenant-isolation", f"spec.runtimeClassName {runtime} is not allowed here "
                                       "(allowed: none)", "policies.runtimeClasses")
    job = tenancy.create(gpujob(tenancy, f"rc-{uuid.uuid4().hex[:5]}", runtimeClassName=runtime))
    refused(job, "tenant-isolation", f"spec.template.spec.runtimeClassName {runtime}")
    by_operator = tenancy.cluster.kubectl(
        "create", "--dry-run=server", f"--as={tenancy.operator()}", "-n", tenancy.team, "-f",
        "-", stdin=yaml.safe_dump(pod("rc-operator", runtimeClassName=runtime)), check=False)
    assert by_operator.returncode == 0, by_operator.stderr


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
    privileged = {"spec": {"ephemeralContainers": [{
        "name": "dbg2", "image": "busybox",
        "securityContext": {"capabilities": {"add": ["sys_ptrace"]}}}]}}
    capable = tenancy.as_alice("patch", "pod", "debuggee", "--subresource=ephemeralcontainers",
                               "--type=strategic", "-p", json.dumps(privileged))
    if allowed == "yes":
        refused(result, "tenant-isolation",
                "spec.ephemeralContainers[dbg].env sets CUDA_VISIBLE_DEVICES")
        refused(capable, "tenant-isolation",
                "spec.ephemeralContainers[dbg2].securityContext.capabilities.add has sys_ptrace")
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
    assert forged.returncode != 0, forged.stdout  # both fences hold; either may answer
    assert advice in forged.stderr or "metadata.ownerReferences to GpuJob real-job" in (
        forged.stderr), forged.stderr
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


# --- GpuJob template fields Carpool decides (the GpuJob CRD's rules) --------------------------


@pytest.mark.parametrize(("spec", "field", "advice"), [
    ({"schedulingGates": [{"name": "hold"}]}, "spec.template.spec.schedulingGates must not be set",
     "hold the job's GPUs and quota without running"),
    ({"nodeName": "gpu-1"}, "spec.template.spec.nodeName must not be set", "chooses the node"),
    ({"schedulerName": "default-scheduler"}, "spec.template.spec.schedulerName must be unset",
     "Carpool's scheduler places"),
    ({"priorityClassName": "system-node-critical"},
     "spec.template.spec.priorityClassName must not be set", "spec.class"),
    ({"priority": 2000001000}, "spec.template.spec.priority must not be set", "carpool-job"),
    ({"preemptionPolicy": "PreemptLowerPriority"},
     "spec.template.spec.preemptionPolicy must not be set", "carpool-job"),
    ({"activeDeadlineSeconds": 315360000},
     "spec.template.spec.activeDeadlineSeconds must not be set", "set spec.maxDuration"),
    ({"terminationGracePeriodSeconds": 31536000},
     "spec.template.spec.terminationGracePeriodSeconds must not exceed the job's checkpoint "
     "grace (spec.checkpoint.gracePeriod, 30s when unset)", "ask for a longer grace"),
])
def test_template_fields_carpool_decides_are_refused(tenancy: Tenancy, spec: dict[str, Any],
                                                     field: str, advice: str) -> None:
    result = tenancy.create(gpujob(tenancy, f"tpl-{uuid.uuid4().hex[:5]}", **spec))
    refused(result, "crd", field, advice)


PRESTOP_REFUSED = ("spec.template.spec.containers[].lifecycle.preStop.sleep.seconds must be "
                   "less than the pod's grace")


@pytest.mark.parametrize(("seconds", "spec", "admitted"), [
    (31536000, {}, False),  # a year, against the default 30 s
    (30, {}, False),  # the API server wants it strictly shorter
    (29, {}, True),
    (45, {"terminationGracePeriodSeconds": 20}, False),  # the template's own grace first
    (90, {"checkpoint": {"gracePeriod": "2m"}}, True),
])
def test_a_prestop_sleep_must_end_within_the_pods_grace(tenancy: Tenancy, seconds: int,
                                                         spec: dict[str, Any],
                                                         admitted: bool) -> None:
    checkpoint = spec.pop("checkpoint", None)
    job = gpujob(tenancy, f"tpl-{uuid.uuid4().hex[:5]}",
                 {"lifecycle": {"preStop": {"sleep": {"seconds": seconds}}}}, **spec)
    if checkpoint:
        job["spec"]["checkpoint"] = checkpoint
    made = tenancy.cluster.kubectl("create", "--dry-run=server", f"--as={tenancy.alice}", "-n",
                                   tenancy.team, "-f", "-", stdin=yaml.safe_dump(job),
                                   check=False)
    if admitted:
        assert made.returncode == 0, made.stderr
    else:
        refused(made, "crd", PRESTOP_REFUSED, "the pod is killed at its grace")


def test_a_grace_within_the_checkpoint_grace_is_admitted(tenancy: Tenancy) -> None:
    job = gpujob(tenancy, "tpl-grace", terminationGracePeriodSeconds=60)
    job["spec"]["checkpoint"] = {"gracePeriod": "2m"}
    made = tenancy.cluster.kubectl("create", "--dry-run=server", f"--as={tenancy.alice}", "-n",
                                   tenancy.team, "-f", "-", stdin=yaml.safe_dump(job),
                                   check=False)
    assert made.returncode == 0, made.stderr


# --- Carpool's metadata on pods (hack/policies/pod-metadata.yaml) ------------------------------


def operator_pod(t: Tenancy, name: str, job_uid: str) -> dict[str, Any]:
    """A pod shaped as the operator makes it: Carpool's labels, annotations and owner."""
    obj = pod(name)
    obj["metadata"].update({
        "labels": {names.LABEL_MANAGED: "true", names.LABEL_JOB: "owner-job",
                   names.LABEL_PROJECT: t.project, "app": "mine"},
        "annotations": {names.ANN_JOB: f"{t.team}/owner-job", names.ANN_ISOLATION: "mps"},
        "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": "GpuJob",
                             "name": "owner-job", "uid": job_uid, "controller": True}]})
    return obj


@pytest.fixture(scope="module")
def carpool_pod(tenancy: Tenancy) -> str:
    """A pod the release's operator account created with Carpool's metadata, in alice's
    namespace."""
    job = tenancy.create(gpujob(tenancy, "owner-job"))
    assert job.returncode == 0, job.stderr
    uid = tenancy.cluster.kubectl("get", "gpujob", "owner-job", "-n", tenancy.team, "-o",
                                  "jsonpath={.metadata.uid}").stdout
    made = tenancy.create(operator_pod(tenancy, "attempt-1", uid), as_user=tenancy.operator())
    assert made.returncode == 0, made.stderr
    return uid


def patch_pod(t: Tenancy, user: str, body: Any, kind: str = "merge"
              ) -> subprocess.CompletedProcess[str]:
    return t.cluster.kubectl("patch", "pod", "attempt-1", "-n", t.team, f"--as={user}",
                             f"--type={kind}", "-p", json.dumps(body), check=False)


@pytest.mark.parametrize(("body", "kind", "field"), [
    ({"metadata": {"labels": {names.LABEL_JOB: "someone-elses"}}}, "merge",
     f"metadata.labels[{names.LABEL_JOB}]"),
    ({"metadata": {"labels": {names.LABEL_PROJECT: None}}}, "merge",
     f"metadata.labels[{names.LABEL_PROJECT}]"),
    ({"metadata": {"labels": {f"{names.GROUP}/anything": "x"}}}, "merge",
     f"metadata.labels[{names.GROUP}/anything]"),
    ({"metadata": {"annotations": {names.ANN_ISOLATION: "exclusive"}}}, "merge",
     f"metadata.annotations[{names.ANN_ISOLATION}]"),
    ({"metadata": {"annotations": {names.ANN_JOB: None}}}, "merge",
     f"metadata.annotations[{names.ANN_JOB}]"),
    ({"metadata": {"annotations": {names.ANN_ASSIGNMENT: "{}"}}}, "merge",
     f"metadata.annotations[{names.ANN_ASSIGNMENT}]"),
    ([{"op": "remove", "path": "/metadata/ownerReferences"}], "json",
     "metadata.ownerReferences to GpuJob owner-job"),
    ([{"op": "replace", "path": "/metadata/ownerReferences/0/controller", "value": False}],
     "json", "metadata.ownerReferences to GpuJob owner-job"),
])
def test_a_tenant_cannot_touch_carpools_metadata_on_a_pod(
        tenancy: Tenancy, carpool_pod: str, body: Any, kind: str, field: str) -> None:
    """On the operator's pod in her own namespace alice adds, changes or removes none of
    Carpool's labels, annotations or owner references; the message names the key."""
    result = patch_pod(tenancy, tenancy.alice, body, kind)
    refused(result, "pod-metadata", f"{tenancy.alice} may not add, change or remove {field}",
            "the rest of a pod's metadata is yours")


def test_the_rest_of_a_pods_metadata_stays_the_tenants(tenancy: Tenancy,
                                                       carpool_pod: str) -> None:
    mine = patch_pod(tenancy, tenancy.alice, {"metadata": {"labels": {"app": "renamed"},
                                                           "annotations": {"note": "x"}}})
    assert mine.returncode == 0, mine.stderr


def test_only_carpool_creates_pods_with_its_metadata(tenancy: Tenancy, carpool_pod: str) -> None:
    """alice's own pod shaped like an attempt, with Carpool's labels, annotations or owner: each
    refused at create, naming the key; a GpuJob template may not carry them either."""
    for key, value in ((names.LABEL_JOB, "someone-elses"), (names.LABEL_MANAGED, "true")):
        obj = pod(f"look-alike-{uuid.uuid4().hex[:4]}")
        obj["metadata"]["labels"] = {key: value}
        refused(tenancy.create(obj), "pod-metadata", f"{tenancy.alice} may not set "
                                                     f"metadata.labels[{key}]")
    obj = pod("look-alike-ann")
    obj["metadata"]["annotations"] = {names.ANN_JOB: "other-team/their-job"}
    refused(tenancy.create(obj), "pod-metadata", f"metadata.annotations[{names.ANN_JOB}]")
    owned = operator_pod(tenancy, "look-alike-owned", carpool_pod)
    owned["metadata"]["labels"] = {}
    owned["metadata"]["annotations"] = {}
    refused(tenancy.create(owned), "pod-metadata", "metadata.ownerReferences to GpuJob owner-job")
    job = gpujob(tenancy, "labelled-template")
    job["spec"]["template"]["metadata"] = {"labels": {names.LABEL_PROJECT: "other-project"}}
    refused(tenancy.create(job), "pod-metadata",
            f"spec.template.metadata.labels[{names.LABEL_PROJECT}]",
            "Remove them from the GpuJob's pod template")


def test_carpools_components_write_only_their_own(tenancy: Tenancy, carpool_pod: str) -> None:
    """The extender writes its hand-over annotations and nothing else of Carpool's; the
    garbage collector removes a deleted owner's reference and nothing else."""
    account = f"system:serviceaccount:{tenancy.system_ns}:{tenancy.release}-%s"
    extender = account % "extender"
    assignment = patch_pod(tenancy, extender, {"metadata": {"annotations": {
        names.ANN_ASSIGNMENT: "{}", names.ANN_ASSIGNED_AT: "2026-01-01T00:00:00Z"}}})
    assert assignment.returncode == 0, assignment.stderr
    label = patch_pod(tenancy, extender, {"metadata": {"labels": {names.LABEL_JOB: "x"}}})
    refused(label, "pod-metadata", f"metadata.labels[{names.LABEL_JOB}]")
    allocated = patch_pod(tenancy, extender,
                          {"metadata": {"annotations": {names.ANN_ALLOCATED: "{}"}}})
    refused(allocated, "pod-metadata", f"metadata.annotations[{names.ANN_ALLOCATED}]")
    collector = "system:serviceaccount:kube-system:generic-garbage-collector"
    relabel = patch_pod(tenancy, collector, {"metadata": {"labels": {names.LABEL_JOB: "x"}}})
    refused(relabel, "pod-metadata", f"metadata.labels[{names.LABEL_JOB}]")
    orphaned = patch_pod(tenancy, collector,
                         [{"op": "remove", "path": "/metadata/ownerReferences"}], "json")
    assert orphaned.returncode == 0, orphaned.stderr
    readd = patch_pod(tenancy, collector, {"metadata": {"ownerReferences": operator_pod(
        tenancy, "x", carpool_pod)["metadata"]["ownerReferences"]}})
    refused(readd, "pod-metadata", "metadata.ownerReferences to GpuJob owner-job")


# --- priority (hack/policies/tenant-priority.yaml) ---------------------------------------------


@pytest.mark.parametrize(("priority_class", "value"), [
    ("system-cluster-critical", 2000000000), ("system-node-critical", 2000001000)])
def test_no_tenant_pod_outranks_carpools_jobs(tenancy: Tenancy, priority_class: str,
                                              value: int) -> None:
    """The built-in critical classes are open to anyone who may create pods; in a project
    namespace they are refused, with the value the Priority plugin resolved."""
    result = tenancy.create(pod(f"prio-{uuid.uuid4().hex[:5]}", priorityClassName=priority_class))
    refused(result, "tenant-priority",
            f"spec.priorityClassName {priority_class} gives this pod priority {value}, above "
            "Carpool's jobs (PriorityClass carpool-job, 0)", "policies.priorityClasses")
    plain = tenancy.cluster.kubectl("create", "--dry-run=server", f"--as={tenancy.alice}", "-n",
                                    tenancy.team, "-f", "-", stdin=yaml.safe_dump(pod("plain")),
                                    check=False)
    assert plain.returncode == 0, plain.stderr  # no class: priority 0, Carpool's own


# --- other device doors (hack/policies/tenant-devices.yaml) ------------------------------------


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu",
                                      "gpu.intel.com/i915", "habana.ai/gaudi"])
def test_other_vendors_gpus_are_refused(tenancy: Tenancy, resource: str) -> None:
    """Any device resource beyond cpu, memory, ephemeral-storage, hugepages and Carpool's own
    (an allowlist: the next vendor's name is not known today)."""
    asks = {"resources": {"limits": {"cpu": "1", resource: "1"}}}
    plain = tenancy.create(pod(f"dev-{uuid.uuid4().hex[:5]}", asks))
    refused(plain, "tenant-devices", f"spec.containers[main].resources asks for {resource}",
            "policies.otherDevices.resources")
    job = tenancy.create(gpujob(tenancy, f"dev-{uuid.uuid4().hex[:5]}", asks))
    refused(job, "tenant-devices",
            f"spec.template.spec.containers[main].resources asks for {resource}")


def test_resource_claims_are_refused(tenancy: Tenancy) -> None:
    claims: dict[str, Any] = {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "any-gpu"}]}
    plain = tenancy.create(pod(f"dra-{uuid.uuid4().hex[:5]}", **claims))
    refused(plain, "tenant-devices", "spec.resourceClaims: devices claimed through Dynamic "
                                     "Resource Allocation", "policies.otherDevices.resourceClaims")
    job = tenancy.create(gpujob(tenancy, f"dra-{uuid.uuid4().hex[:5]}", **claims))
    refused(job, "tenant-devices", "spec.template.spec.resourceClaims")
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "any-gpu"},
                "spec": {"spec": {"devices": {"requests": [{
                    "name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}}}
    allowed = tenancy.cluster.kubectl("auth", "can-i", "create", "resourceclaimtemplates",
                                      f"--as={tenancy.alice}", "-n", tenancy.team,
                                      check=False).stdout.strip()
    created = tenancy.create(template)
    if allowed == "yes":
        refused(created, "tenant-devices", "resourceclaimtemplates cannot be created in a "
                                           "project namespace")
    else:  # `edit` does not grant it on this version: RBAC already closes the door
        assert created.returncode != 0 and "forbidden" in created.stderr.lower(), created.stderr


# --- class limits: the chart's (admission) and a ProjectQuota's (the operator) -----------------


@pytest.mark.parametrize(("change", "message"), [
    ({"gpu": {"count": 3, "memory": "8Gi"}, "maxDuration": "1h"},
     "spec.gpu.count 3 is more than class interactive allows (the chart's "
     "policies.classLimits.interactive.maxGpus: 2)"),
    ({}, "spec.maxDuration must be set for class interactive (the chart's "
         "policies.classLimits.interactive.maxDuration: 8h)"),
    ({"maxDuration": "3650d"}, "spec.maxDuration 3650d is longer than class interactive allows"),
    ({"maxDuration": "1h", "checkpoint": {"gracePeriod": "365d"}},
     "spec.checkpoint.gracePeriod 365d is longer than class interactive allows (the chart's "
     "policies.classLimits.interactive.maxGracePeriod: 5m)"),
    ({"maxDuration": "1h", "gpu": {"count": 1, "memory": "512Ki"}},
     "spec.gpu.memory 512Ki is less than class interactive grants (the chart's "
     "policies.classLimits.interactive.minGpuMemory: 1Gi)"),
    ({"maxDuration": "1h", "gpu": {"count": 1, "memory": "8Gi", "cores": 1}},
     "spec.gpu.cores 1 is less than class interactive grants"),
])
def test_the_charts_class_limits_refuse_at_apply(tenancy: Tenancy, change: dict[str, Any],
                                                 message: str) -> None:
    job = gpujob(tenancy, f"lim-{uuid.uuid4().hex[:5]}")
    job["spec"].update({"class": "interactive", **change})
    refused(tenancy.create(job), "class-limits", message, "ask the platform team")


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
    MPS pipe comes through Allocate, not the pod spec). Below baseline the chart's policy
    already refuses the GpuJob at creation; a baseline template in a `restricted` namespace
    passes the policy (chart value podSecurity: baseline) and its pod is refused by the API
    server's Pod Security admission: the job is Failed with that reason."""
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
    below = {"securityContext": {"capabilities": {"add": ["NET_RAW", "NET_ADMIN"]}}}
    bad = gpujob(tenancy, "below-level", below if level == "baseline" else {}, **pinned)
    try:
        made = cluster.kubectl("create", f"--as={tenancy.alice}", "-n", namespace, "-f",
                               "-", stdin=yaml.safe_dump(good), check=False)
        assert made.returncode == 0, made.stderr
        made = cluster.kubectl("create", f"--as={tenancy.alice}", "-n", namespace, "-f",
                               "-", stdin=yaml.safe_dump(bad), check=False)
        if level == "baseline":
            refused(made, "tenant-isolation", "securityContext.capabilities.add has NET_RAW, "
                                              "NET_ADMIN")
        else:
            assert made.returncode == 0, made.stderr  # baseline: the chart's level
        ran = wait_for("the compliant job to run", lambda: (
            s := job_status(tenancy, namespace, "meets-level")).get("phase") in (
            "Running", "Succeeded") and s, timeout=90)
        assert ran and ran["node"] == strict_stack
        if level == "baseline":
            return
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


def test_a_projects_class_limits_refuse_the_job_visibly(tenancy: Tenancy,
                                                        strict_stack: str) -> None:
    """Per-project limits (ProjectQuota spec.classLimits) need the project, which admission
    cannot read: the operator refuses the job, never queues it, says which field and limit in
    its status and in a Warning Event."""
    cluster = tenancy.cluster
    cluster.kubectl("patch", "projectquota", tenancy.project, "--type=merge", "-p", json.dumps(
        {"spec": {"classLimits": {"short": {"maxGpus": 1, "minGpuMemory": "4Gi"}}}}))
    try:
        big = gpujob(tenancy, "over-class-limit", gpu={"count": 2, "memory": "8Gi",
                                                        "isolation": "mps"})
        made = tenancy.create(big)
        assert made.returncode == 0, made.stderr  # the chart's limits hold only interactive
        expected = (f"spec.gpu.count 2 is more than ProjectQuota {tenancy.project} "
                    "spec.classLimits.short.maxGpus 1")
        status = wait_for("the job to be refused", lambda: (
            s := job_status(tenancy, tenancy.team, "over-class-limit")).get(
            "reason") == "ClassLimitExceeded" and s, timeout=60)
        assert status["phase"] == "Queued" and status["message"] == expected, status
        assert not status.get("queuePosition") and not status.get("node"), status

        def event() -> str:
            events = json.loads(cluster.kubectl(
                "get", "events", "-n", tenancy.team, "-o", "json", "--field-selector",
                "involvedObject.name=over-class-limit,reason=ClassLimitExceeded").stdout)
            return "\n".join(f"{e['type']}: {e['message']}" for e in events["items"])

        assert f"Warning: {expected}" in wait_for("the Warning Event", event, timeout=30)
    finally:
        cluster.kubectl("delete", "gpujob", "over-class-limit", "-n", tenancy.team,
                        "--wait=false", check=False)
        cluster.kubectl("patch", "projectquota", tenancy.project, "--type=json", "-p",
                        json.dumps([{"op": "remove", "path": "/spec/classLimits"}]), check=False)


def test_the_status_subresource_is_no_back_door(tenancy: Tenancy, carpool_pod: str) -> None:
    """The API server takes label and annotation changes through pods/status as well; an
    identity allowed to write pod status (a controller of the tenant's, a node) changes none
    of Carpool's there either."""
    writer = f"status-writer-{tenancy.team}"
    tenancy.cluster.kubectl("create", "role", "pod-status", "--verb=get,patch,update",
                            "--resource=pods/status", "-n", tenancy.team)
    tenancy.cluster.kubectl("create", "rolebinding", "pod-status", "--role=pod-status",
                            f"--user={writer}", "-n", tenancy.team)
    mine = tenancy.cluster.kubectl(
        "patch", "pod", "attempt-1", "-n", tenancy.team, f"--as={writer}",
        "--subresource=status", "--type=merge", "-p",
        json.dumps({"metadata": {"labels": {"team": "vision"}}}), check=False)
    assert mine.returncode == 0, mine.stderr  # the door is real: other labels change
    theirs = tenancy.cluster.kubectl(
        "patch", "pod", "attempt-1", "-n", tenancy.team, f"--as={writer}",
        "--subresource=status", "--type=merge", "-p",
        json.dumps({"metadata": {"labels": {names.LABEL_JOB: "someone-elses"}}}), check=False)
    refused(theirs, "pod-metadata", f"{writer} may not add, change or remove "
                                    f"metadata.labels[{names.LABEL_JOB}]")


def test_restricted_as_a_chart_value(tenancy: Tenancy) -> None:
    """policies.podSecurity: restricted, rendered by the chart into its own release's policy
    and bound to one namespace (where the module's baseline policy holds too): a pod that
    meets baseline only is refused naming each field restricted asks for; one that meets
    restricted passes."""
    cluster = tenancy.cluster
    suffix = uuid.uuid4().hex[:6]
    release, namespace = f"carpool-rst-{suffix}", f"{tenancy.team}-rst"
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", release, str(CHART), "--namespace",
         tenancy.system_ns, "--set", "policies.podSecurity=restricted",
         "--show-only", "templates/policies.yaml"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered)
               if o and o["metadata"]["name"] == f"{release}-tenant-isolation"]
    assert len(objects) == 2
    for obj in objects:
        if obj["kind"].endswith("Binding"):
            obj["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": namespace}}}
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit",
                    f"--user={tenancy.alice}", "-n", namespace)
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))

    def create(obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl("create", "--dry-run=server", f"--as={tenancy.alice}", "-n",
                               namespace, "-f", "-", stdin=yaml.safe_dump(obj), check=False)

    try:
        wait_for("the restricted policy to be enforced",
                 lambda: f"{release}-tenant-isolation" in create(pod("probe")).stderr)
        refused(create(pod("baseline-only", {"securityContext": {
            "capabilities": {"add": ["NET_BIND_SERVICE", "chown"]}}})),  # baseline: fine
            f"{suffix}-tenant-isolation",
            "spec.containers[main].securityContext.capabilities.add has chown (restricted "
            "allows only NET_BIND_SERVICE)",
            "spec.containers[main].securityContext.capabilities.drop must include ALL",
            "spec.containers[main].securityContext.seccompProfile.type must be set",
            "spec.containers[main].securityContext.allowPrivilegeEscalation must be false",
            "spec.containers[main].securityContext.runAsNonRoot must be true",
            "Pod Security restricted")
        compliant = pod("restricted-ok", {"securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["all"]},
            "runAsNonRoot": True, "runAsUser": 1000}},
            securityContext={"seccompProfile": {"type": "RuntimeDefault"}},
            volumes=[{"name": "scratch", "emptyDir": {}}])
        made = create(compliant)
        assert made.returncode == 0, made.stderr
        compliant["spec"]["volumes"] = [{"name": "repo", "gitRepo": {"repository": "x"}}]
        refused(create(compliant), f"{suffix}-tenant-isolation",
                "spec.volumes[repo] is not one of configMap, csi")
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                        stdin=yaml.safe_dump_all(objects), check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
