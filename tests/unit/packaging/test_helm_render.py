"""The Helm chart rendered with `helm template` and read back: kinds, RBAC, the scheduler's
configuration, component flags, values checks, CRD copies and the Grafana dashboard.

Component flags are parsed with the components' own argument parsers, so a renamed flag fails
here rather than in a crash-looping pod.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import crds
from carpool_testbed.devcluster import CARPOOL_PERCENTAGE_OF_NODES

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "carpool"
POLICIES = REPO / "hack" / "policies"
NAMESPACE = "carpool-system"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> Path:
    """Helm from hack/build-k8s.sh (built once per machine; its last line is the bin dir)."""
    built = subprocess.run(["bash", str(REPO / "hack" / "build-k8s.sh")], check=True,
                           stdout=subprocess.PIPE, text=True, cwd=REPO)
    return Path(built.stdout.strip().splitlines()[-1]) / "helm"


def render(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(helm), "template", "carpool", str(CHART), "--namespace", NAMESPACE,
         "--kube-version", "1.35.4", *args],
        capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise AssertionError(f"helm template failed: {result.stderr}")
    return result


def objects(helm: Path, *args: str) -> list[Obj]:
    return [o for o in yaml.safe_load_all(render(helm, *args).stdout) if o]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


@pytest.fixture(scope="module")
def default(helm: Path) -> list[Obj]:
    return objects(helm)


def rules_of(objs: list[Obj], role: str) -> list[Obj]:
    return list(find(objs, "ClusterRole", role)["rules"])


def granted(rules: list[Obj]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for r in rules for group in r["apiGroups"]
            for resource in r["resources"] for verb in r["verbs"]}


def test_default_install_has_every_component(default: list[Obj]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in default
                   if o["kind"] in ("Deployment", "DaemonSet", "Service", "ConfigMap",
                                    "PriorityClass"))
    assert kinds == [
        ("ConfigMap", "carpool-dashboard"),
        ("ConfigMap", "carpool-scheduler-config"),
        ("DaemonSet", "carpool-device-plugin-exclusive"),
        ("DaemonSet", "carpool-device-plugin-mig"),
        ("DaemonSet", "carpool-device-plugin-mps"),
        ("DaemonSet", "carpool-device-plugin-timeslice"),
        ("DaemonSet", "carpool-mps-daemon"),
        ("Deployment", "carpool-extender"),
        ("Deployment", "carpool-operator"),
        ("Deployment", "carpool-scheduler"),
        ("PriorityClass", "carpool-job"),
        ("Service", "carpool-device-plugin-metrics"),
        ("Service", "carpool-extender"),
        ("Service", "carpool-operator-metrics"),
    ]
    assert not [o for o in default if o["kind"] == "ServiceMonitor"]  # opt-in
    assert all(o["metadata"].get("namespace") == NAMESPACE for o in default
               if o["kind"] not in CLUSTER_SCOPED
               and not (o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == "kube-system"))
    assert not [o for o in default if o["kind"] in CLUSTER_SCOPED and "namespace" in o["metadata"]]


CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "PriorityClass",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def test_no_role_grants_secrets_or_wildcards(default: list[Obj]) -> None:
    for role in (o for o in default if o["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            where = f"{role['kind']}/{role['metadata']['name']}"
            assert "secrets" not in rule["resources"], where
            assert "*" not in rule["resources"] + rule["verbs"] + rule["apiGroups"], where


def test_operator_rbac(default: list[Obj]) -> None:
    rules = granted(rules_of(default, "carpool-operator"))
    group = names.GROUP
    for verb in ("get", "list", "watch"):
        for resource in ("gpujobs", "projectquotas", "gpunodes"):
            assert (group, resource, verb) in rules
    assert {(group, "gpujobs/status", "patch"), (group, "projectquotas/status", "patch"),
            ("", "pods", "create"), ("", "pods", "delete"), ("", "pods", "watch"),
            ("", "pods", "patch"),  # its finalizer off, once a pod's run is on record
            ("", "persistentvolumeclaims", "create"),  # checkpoint claims
            ("events.k8s.io", "events", "create")} <= rules
    # the specs belong to users and the platform team; the operator writes statuses, and
    # patches a GpuJob only to take off the finalizer an earlier release put on it
    writes = {(r, v) for g, r, v in rules if g == group and "/" not in r} - {
        (r, v) for r in ("gpujobs", "projectquotas", "gpunodes") for v in ("get", "list", "watch")}
    assert writes == {("gpujobs", "patch")}
    assert not [r for r in rules if r[1] in ("configmaps", "secrets", "serviceaccounts")]
    lease_role = find(default, "Role", "carpool-operator-leader")
    assert granted(lease_role["rules"]) == {("coordination.k8s.io", "leases", v)
                                            for v in ("create", "get", "update")}
    assert lease_role["rules"][1]["resourceNames"] == ["carpool-operator"]


def test_device_plugin_rbac_is_its_node_agent_work_only(default: list[Obj]) -> None:
    assert granted(rules_of(default, "carpool-device-plugin")) == {
        ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "patch"),
        (names.GROUP, "gpunodes", "get"), (names.GROUP, "gpunodes", "create"),
        (names.GROUP, "gpunodes/status", "get"), (names.GROUP, "gpunodes/status", "update"),
        (names.GROUP, "gpunodes/status", "patch"),
        (names.GROUP, "gpujobs/status", "get"),
        (names.GROUP, "gpujobs/status", "patch"),  # jobs' reports; narrowed by a policy
        ("events.k8s.io", "events", "create"),
    }


def test_extender_rbac(default: list[Obj]) -> None:
    assert granted(rules_of(default, "carpool-extender")) == {
        ("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "watch"),
        ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "patch"),
        ("", "pods/binding", "create"),
        (names.GROUP, "gpunodes", "get"), (names.GROUP, "gpunodes", "list"),
        (names.GROUP, "gpunodes", "watch"),
        # the GpuJob's spec.gpu is what a pod's grant and isolation are checked against
        (names.GROUP, "gpujobs", "get"), (names.GROUP, "gpujobs", "list"),
        (names.GROUP, "gpujobs", "watch"),
    }


def test_every_service_account_is_bound_to_its_own_role(default: list[Obj]) -> None:
    accounts = {o["metadata"]["name"] for o in default if o["kind"] == "ServiceAccount"}
    assert accounts == {"carpool-operator", "carpool-extender", "carpool-scheduler",
                        "carpool-device-plugin"}
    for binding in (o for o in default if o["kind"] == "ClusterRoleBinding"):
        (subject,) = binding["subjects"]
        assert subject["namespace"] == NAMESPACE
        role = binding["roleRef"]["name"]
        assert role == subject["name"] or (subject["name"] == "carpool-scheduler"
                                           and role.startswith("system:"))
    pods = [o["spec"]["template"]["spec"] for o in default
            if o["kind"] in ("Deployment", "DaemonSet")]
    assert {p.get("serviceAccountName") for p in pods} == accounts | {None}
    mps = find(default, "DaemonSet", "carpool-mps-daemon")["spec"]["template"]["spec"]
    assert mps["automountServiceAccountToken"] is False


def scheduler_config(objs: list[Obj]) -> Obj:
    config: Obj = yaml.safe_load(
        find(objs, "ConfigMap", "carpool-scheduler-config")["data"]["config.yaml"])
    return config


def test_scheduler_calls_the_extender_for_carpool_resources(default: list[Obj]) -> None:
    config = scheduler_config(default)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["profiles"] == [{"schedulerName": names.SCHEDULER_NAME,
                                   "percentageOfNodesToScore": CARPOOL_PERCENTAGE_OF_NODES}]
    assert config["leaderElection"]["resourceName"] == "carpool-scheduler"
    assert config["leaderElection"]["resourceNamespace"] == NAMESPACE
    (extender,) = config["extenders"]
    service = find(default, "Service", "carpool-extender")
    port = service["spec"]["ports"][0]["port"]
    assert extender["urlPrefix"] == f"http://carpool-extender.{NAMESPACE}.svc:{port}/"
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter", "prioritize", "bind")
    assert extender["nodeCacheCapable"] is True
    assert extender["weight"] > 0
    assert extender["managedResources"] == [
        {"name": r, "ignoredByScheduler": True}
        for r in (names.RESOURCE_GPU, names.RESOURCE_GPU_MEMORY, names.RESOURCE_GPU_CORES)]
    deployment = find(default, "Deployment", "carpool-scheduler")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--config=/etc/carpool-scheduler/config.yaml" in container["command"]
    assert container["volumeMounts"][0]["mountPath"] == "/etc/carpool-scheduler"


def test_carpools_profile_can_rank_every_feasible_node(helm: Path) -> None:
    config = scheduler_config(objects(helm, "--set", "scheduler.percentageOfNodesToScore=100"))
    assert config["profiles"] == [{"schedulerName": names.SCHEDULER_NAME,
                                   "percentageOfNodesToScore": 100}]
    adaptive = scheduler_config(objects(helm, "--set", "scheduler.percentageOfNodesToScore=0"))
    assert adaptive["profiles"] == [{"schedulerName": names.SCHEDULER_NAME}]


def test_scheduler_restarts_when_its_configuration_changes(helm: Path) -> None:
    def checksum(*args: str) -> str:
        objs = objects(helm, *args)
        annotations = find(objs, "Deployment", "carpool-scheduler")["spec"]["template"][
            "metadata"]["annotations"]
        return str(annotations["checksum/config"])

    assert checksum() != checksum("--set", "scheduler.extenderTimeout=30s")


def test_a_pinned_extender_ip_is_what_the_scheduler_calls(helm: Path) -> None:
    """No cluster DNS needed: carpool-scheduler calls the Service's pinned ClusterIP."""
    objs = objects(helm, "--set", "extender.serviceClusterIP=10.0.0.155",
                   "--set", "extender.port=18099")
    (extender,) = scheduler_config(objs)["extenders"]
    assert extender["urlPrefix"] == "http://10.0.0.155:18099/"
    assert find(objs, "Service", "carpool-extender")["spec"]["clusterIP"] == "10.0.0.155"


def test_pod_annotations_reach_every_carpool_pod(helm: Path) -> None:
    """One value rolls every component on `helm upgrade` (the MPS daemon too, on delete)."""
    objs = objects(helm, "--set-string", "podAnnotations.example\\.com/rollout=2")
    templates = [o for o in objs if o["kind"] in ("Deployment", "DaemonSet")]
    assert len(templates) == 8
    for obj in templates:
        annotations = obj["spec"]["template"]["metadata"].get("annotations") or {}
        assert annotations.get("example.com/rollout") == "2", obj["metadata"]["name"]
    scheduler = find(objs, "Deployment", "carpool-scheduler")["spec"]["template"]["metadata"]
    assert "checksum/config" in scheduler["annotations"]


def container(obj: Obj) -> Obj:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_operator_deployment(default: list[Obj]) -> None:
    operator = find(default, "Deployment", "carpool-operator")
    c = container(operator)
    assert operator["spec"]["replicas"] == 2
    assert c["command"][:4] == ["kopf", "run", "--standalone", "--all-namespaces"]
    assert c["command"][-2:] == ["-m", "carpool.operator.handlers"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["command"]
    env = {e["name"]: e for e in c["env"]}
    assert env["CARPOOL_NAMESPACE"]["valueFrom"] == {"fieldRef":
                                                     {"fieldPath": "metadata.namespace"}}
    assert env["CARPOOL_METRICS_PORT"]["value"] == "9090"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # every MPS job runs as the one client user (docs/concepts.md, MPS)
    assert env["CARPOOL_MPS_CLIENT_UID"]["value"] == "1000"
    assert env["CARPOOL_MPS_CLIENT_GID"]["value"] == "1000"
    assert "CARPOOL_JOB_RUNTIME_CLASS" not in env
    # every CARPOOL_* variable the chart sets is one the operator reads
    source = "".join(p.read_text() for p in (REPO / "operator").glob("*.py"))
    for name in env:
        if name.startswith("CARPOOL_"):
            assert f'"{name}"' in source, f"the operator never reads {name}"


def test_the_extender_scores_with_carpools_policy_unless_a_weight_is_set(
        default: list[Obj], helm: Path) -> None:
    """One source for the weights: scoring.CARPOOL, which the benchmarks and tests run."""
    from carpool.core.scoring import CARPOOL
    from carpool.extender.__main__ import parse_args

    def weights(objs: list[Obj]) -> dict[str, float]:
        c = container(find(objs, "Deployment", "carpool-extender"))
        args = vars(parse_args(c["args"]))
        return {k.removeprefix("weight_"): v for k, v in args.items() if k.startswith("weight_")}

    terms = ("fragmentation", "balance", "scarcity", "packing", "alignment", "temperature",
             "locality")
    assert weights(default) == {t: getattr(CARPOOL, t) for t in terms}
    changed = weights(objects(helm, "--set-json", "extender.weights.locality=1.5"))
    assert changed == {t: 1.5 if t == "locality" else getattr(CARPOOL, t) for t in terms}


def test_extender_flags_parse(default: list[Obj]) -> None:
    from carpool.extender.__main__ import parse_args

    c = container(find(default, "Deployment", "carpool-extender"))
    assert c["command"] == ["python", "-m", "carpool.extender"]
    args = parse_args(c["args"])
    assert (args.port, args.policy, args.filter_best) == (18080, "binpack", 1)
    assert {p["path"] for p in (c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"])
            } == {"/livez", "/healthz"}


@pytest.mark.parametrize("mode", ["mps", "mig", "timeslice", "exclusive"])
def test_device_plugin_per_sharing_label(default: list[Obj], mode: str) -> None:
    from carpool.deviceplugin.__main__ import parse_args

    daemonset = find(default, "DaemonSet", f"carpool-device-plugin-{mode}")
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {names.LABEL_SHARING: mode}
    c = container(daemonset)
    args = parse_args([*c["args"], "--node-name", "n"])
    assert args.sharing_mode == mode
    assert args.backend == "nvml"
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}
            } in c["env"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/var/lib/kubelet/device-plugins" in mounts
    if mode == "mps":
        # the MPS daemon DaemonSet runs the control daemon; the plugin only points clients at it
        assert args.no_manage_mps
        assert args.mps_ceiling == 50  # checked against the daemon's fence before serving
        assert str(args.mps_pipe_dir) == "/run/carpool/mps/pipe"
        assert "/run/carpool/mps" in mounts
        # the user the operator sets on MPS jobs' pods, checked again in Allocate
        assert (args.mps_client_uid, args.mps_client_gid) == (1000, 1000)
    else:
        assert (args.mps_client_uid, args.mps_client_gid) == (None, None)
    assert not args.allow_unowned_pods
    # NVML (and in MPS mode nvidia-cuda-mps-control, which only `compute` mounts) from the
    # NVIDIA runtime, asked for by a volume mount too: it may ignore NVIDIA_VISIBLE_DEVICES
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == ("compute,utility" if mode == "mps"
                                                 else "utility")
    gpus = next(m for m in c["volumeMounts"]
                if m["mountPath"] == "/var/run/nvidia-container-devices/all")
    assert {"name": gpus["name"], "hostPath": {"path": "/dev/null", "type": "CharDevice"}
            } in spec["volumes"]
    # GPUs reach job containers as CDI devices from the spec the plugin writes on the host
    assert args.device_delivery == "cdi" and args.cdi_spec_dir == "/var/run/cdi"
    cdi = next(m for m in c["volumeMounts"] if m["mountPath"] == "/var/run/cdi")
    assert {"name": cdi["name"], "hostPath": {"path": "/var/run/cdi",
                                               "type": "DirectoryOrCreate"}} in spec["volumes"]
    # the memory watchdog maps GPU processes to pods through the host's /proc
    assert spec["hostPID"] is (mode in ("timeslice", "mps"))


def test_mps_daemon_shares_the_pipe_directory(default: list[Obj]) -> None:
    daemonset = find(default, "DaemonSet", "carpool-mps-daemon")
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {names.LABEL_SHARING: "mps"}
    env = {e["name"]: e["value"] for e in container(daemonset)["env"]}
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/carpool/mps/pipe"
    assert env["CARPOOL_MPS_CEILING_PERCENT"] == "50"  # the fence, set before any server
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"]}
    assert host_paths == {"/run/carpool/mps", "/run/carpool/mps/shm", "/dev/null"}
    for c in (container(daemonset), spec["initContainers"][0]):
        assert "/var/run/nvidia-container-devices/all" in {
            m["mountPath"] for m in c["volumeMounts"]}
    # EXCLUSIVE_PROCESS by default, from a privileged init container that exits; the daemon
    # itself stays unprivileged
    [init] = spec["initContainers"]
    assert init["command"] == ["nvidia-smi", "-c", "EXCLUSIVE_PROCESS"]
    assert init["securityContext"] == {"privileged": True}
    assert not (container(daemonset).get("securityContext") or {}).get("privileged")
    # it may only switch to its clients' user, to start their MPS server
    assert container(daemonset)["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["SETUID", "SETGID"]}
    # upgrades never restart the daemon under running MPS clients
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_fake_backend_is_a_value(helm: Path, tmp_path: Path) -> None:
    """devicePlugin.backend=fake: every plugin reads the shared simulated-GPU spec as its own
    node's, and the MPS daemon (no driver to serve) is ready once its pipe directory exists."""
    from carpool.deviceplugin.__main__ import make_backend, parse_args

    objs = objects(helm, "--set", "devicePlugin.backend=fake",
                   "--set", "devicePlugin.fakeGpus[0].model=T4",
                   "--set", "devicePlugin.fakeGpus[0].count=3")
    spec_map = find(objs, "ConfigMap", "carpool-device-plugin-fake-gpus")
    spec_file = tmp_path / "gpus.yaml"
    spec_file.write_text(spec_map["data"]["gpus.yaml"])
    daemonset = find(objs, "DaemonSet", "carpool-device-plugin-mps")
    c = container(daemonset)
    args = parse_args([*c["args"], "--node-name", "node-a"])
    assert (args.backend, str(args.fake_spec)) == ("fake", "/etc/carpool/fake/gpus.yaml")
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/carpool/fake")
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == spec_map["metadata"]["name"]
    args.fake_spec = spec_file
    gpus = make_backend(args).inventory()
    assert [g.model for g in gpus] == ["T4"] * 3
    mps = container(find(objs, "DaemonSet", "carpool-mps-daemon"))
    assert {"name": "CARPOOL_MPS_BACKEND", "value": "fake"} in mps["env"]
    assert mps["readinessProbe"]["exec"]["command"] == ["/usr/local/bin/mps-ready.sh"]
    assert not [o for o in objects(helm) if o["metadata"]["name"].endswith("-fake-gpus")]


def test_the_runtime_class_reaches_job_pods_through_the_operator(helm: Path) -> None:
    objs = objects(helm, "--set", "devicePlugin.runtimeClassName=nvidia",
                   "--set", "mpsDaemon.clientUid=null")
    env = {e["name"]: e.get("value") for e in container(
        find(objs, "Deployment", "carpool-operator"))["env"]}
    assert env["CARPOOL_JOB_RUNTIME_CLASS"] == "nvidia"
    assert "CARPOOL_MPS_CLIENT_UID" not in env
    plugin = find(objs, "DaemonSet", "carpool-device-plugin-mps")
    assert not [a for a in container(plugin)["args"] if a.startswith("--mps-client-uid")]
    assert plugin["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def test_device_delivery_values(helm: Path) -> None:
    """env delivery: no spec, no spec directory; cdi: driver mounts and an nvidia-ctk spec
    reach the plugin's flags, the spec from the host file the value names."""
    from carpool.deviceplugin.__main__ import parse_args

    env = container(find(objects(helm, "--set", "devicePlugin.deviceDelivery=env"),
                         "DaemonSet", "carpool-device-plugin-mps"))
    assert parse_args([*env["args"], "--node-name", "n"]).device_delivery == "env"
    assert "/var/run/cdi" not in {m["mountPath"] for m in env["volumeMounts"]}
    objs = objects(helm, "--set", "devicePlugin.cdi.specDir=/etc/cdi",
                   "--set", "devicePlugin.cdi.driverMounts={/usr/local/nvidia/lib64}",
                   "--set", "devicePlugin.cdi.driverSpec=/etc/nvidia/cdi.yaml")
    daemonset = find(objs, "DaemonSet", "carpool-device-plugin-mps")
    args = parse_args([*container(daemonset)["args"], "--node-name", "n"])
    assert args.cdi_spec_dir == "/etc/cdi"
    assert [m.host_path for m in args.cdi_driver_mount] == ["/usr/local/nvidia/lib64"]
    mount = next(m for m in container(daemonset)["volumeMounts"]
                 if m["mountPath"] == str(args.cdi_driver_spec))
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": "/etc/nvidia/cdi.yaml", "type": "File"}


def test_values_switch_components(helm: Path) -> None:
    objs = objects(helm, "--set", "devicePlugin.sharingModes={mig}", "--set",
                   "scheduler.enabled=false", "--set", "metrics.serviceMonitor.enabled=true",
                   "--set-string", "devicePlugin.nodeSelector.nvidia\\.com/gpu\\.present=true")
    daemonsets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
    assert list(daemonsets) == ["carpool-device-plugin-mig"]  # no MPS nodes: no MPS daemon
    assert daemonsets["carpool-device-plugin-mig"]["spec"]["template"]["spec"][
        "nodeSelector"] == {names.LABEL_SHARING: "mig", "nvidia.com/gpu.present": "true"}
    assert not [o for o in objs if "scheduler" in o["metadata"]["name"]]
    monitors = sorted(o["metadata"]["name"] for o in objs if o["kind"] == "ServiceMonitor")
    assert monitors == ["carpool-device-plugin", "carpool-extender", "carpool-operator"]
    none = objects(helm, "--set", "rbac.create=false")
    assert not [o for o in none if o["kind"].endswith(("Role", "RoleBinding"))]


@pytest.mark.parametrize(("flag", "message"), [
    ("operator.replicas=two", "at '/operator/replicas': got string, want integer"),
    ("devicePlugin.sharingModes={mps,gpu}", "/devicePlugin/sharingModes/1"),
    ("extender.policy=random", "/extender/policy"),
    ("devicePlugin.backend=cuda", "/devicePlugin/backend"),
    ("devicePlugin.deviceDelivery=volume", "/devicePlugin/deviceDelivery"),
    ("mpsDaemon.clientUid=0", "/mpsDaemon/clientUid"),
    ("extender.weights.spread=1", "additional properties 'spread' not allowed"),
    ("devicePlugin.cdi.driverMounts={lib64}", "/devicePlugin/cdi/driverMounts/0"),
    ("operatr.enabled=false", "additional properties 'operatr' not allowed"),
])
def test_schema_refuses_bad_values(helm: Path, flag: str, message: str) -> None:
    result = render(helm, "--set", flag, check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_chart_crds_are_the_repository_crds(helm: Path) -> None:
    check = subprocess.run(["bash", str(REPO / "hack" / "sync-chart-crds.sh"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + "\n(run make chart-crds)"
    rendered = [o for o in objects(helm, "--include-crds")
                if o["kind"] == "CustomResourceDefinition"]
    assert sorted(rendered, key=lambda c: c["metadata"]["name"]) == sorted(
        crds.load_crds(), key=lambda c: c["metadata"]["name"])


def metric_names() -> set[str]:
    """Every series name the operator and device plugin can expose."""
    from prometheus_client import REGISTRY

    from carpool.deviceplugin.metrics import GpuMetrics
    from carpool.operator import metrics as operator_metrics

    assert operator_metrics.QUEUE_LENGTH is not None  # imported: registered in REGISTRY
    families = [*REGISTRY.collect(), *GpuMetrics("n").registry.collect()]
    out = set()
    for family in families:
        for suffix in ("", "_total", "_bucket", "_count", "_sum"):
            out.add(family.name + suffix)
    return out


def dashboard_exprs(dashboard: Obj) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield str(target["expr"])


def test_dashboard_queries_only_metrics_that_exist(default: list[Obj]) -> None:
    data = find(default, "ConfigMap", "carpool-dashboard")
    assert data["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(data["data"]["carpool.json"])
    exprs = list(dashboard_exprs(dashboard))
    used = {m for e in exprs for m in re.findall(r"\bcarpool_[a-z0-9_]+", e)}
    assert used <= metric_names(), used - metric_names()
    for wanted in ("carpool_queue_length", "carpool_wait_seconds_bucket",
                   "carpool_project_gpu_hours", "carpool_project_budget_remaining_gpu_hours",
                   "carpool_gpu_temperature_celsius", "carpool_gpu_memory_used_mib",
                   "carpool_eta_first_estimate_relative_error_bucket",
                   "carpool_eta_first_range_total", "carpool_eta_first_starts_total"):
        assert wanted in used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_images_carry_what_the_chart_runs(default: list[Obj]) -> None:
    """The carpool image copies every package folder setup.py maps, the build context lets
    them in, and every module the chart starts exists; the MPS script parses."""
    import importlib.util

    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    for folder in ("src", "operator", "extender", "deviceplugin"):
        assert f"COPY {folder}/ {folder}/" in dockerfile
        assert f"!{folder}/**" in ignore
    modules = set()
    for obj in default:
        if obj["kind"] not in ("Deployment", "DaemonSet"):
            continue
        command = container(obj).get("command") or []
        if "-m" in command:
            modules.add(command[command.index("-m") + 1])
    assert modules == {"carpool.operator.handlers", "carpool.extender", "carpool.deviceplugin"}
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    for name in ("mps-entrypoint.sh", "mps-ready.sh"):
        script = REPO / "docker" / name
        assert subprocess.run(["sh", "-n", str(script)], capture_output=True).returncode == 0
        assert name in (REPO / "docker" / "mps.Dockerfile").read_text()
        assert name in (REPO / "hack" / "images" / "build.py").read_text()


# --- the policies from hack/policies ---------------------------------------------------------


def policy_sources() -> list[Obj]:
    return [o for path in sorted(POLICIES.glob("*.yaml"))
            for o in yaml.safe_load_all(path.read_text()) if o]


def test_chart_policies_are_the_hack_policies(helm: Path) -> None:
    """Drift check of files/policies/, and the rendered objects are hack/policies' objects with
    only the release's names, the chart's labels and the release's writer accounts."""
    check = subprocess.run(["bash", str(POLICIES / "sync-chart.sh"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + "\n(run bash hack/policies/sync-chart.sh)"
    limits = {"interactive": {"maxGpus": 2, "maxDuration": "8h"}}
    rendered = {(o["kind"], o["metadata"]["name"]): o
                for o in objects(helm, "--show-only", "templates/policies.yaml", "--set-json",
                                 f"policies.classLimits={json.dumps(limits)}")}
    sources = policy_sources()
    assert len(rendered) == len(sources) == 22
    accounts = {variable: f"'system:serviceaccount:{NAMESPACE}:carpool-{component}'"
                for variable, component in (("operator", "operator"), ("extender", "extender"),
                                            ("devicePlugin", "device-plugin"))}
    # the chart's settings, as JSON (a CEL literal): defaults, and the limits set above
    accounts.update({"podSecurityLevel": "'baseline'", "runtimeClasses": "[]",
                     "platformRuntimeClass": "''",
                     "priorityClasses": "[]", "extraResources": "[]", "resourceClaims": "false",
                     "classLimits": '{"interactive":{"maxDuration":"8h","maxGpus":"2"}}'})
    for source in sources:
        # release "carpool" is the chart's full name, so the names are hack/policies' own
        got = rendered[(source["kind"], source["metadata"]["name"])]
        assert got["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert source["metadata"]["labels"].items() <= got["metadata"]["labels"].items()
        for variable in got.get("spec", {}).get("variables", []):
            if variable["name"] in accounts:
                assert variable["expression"] == accounts[variable["name"]]
        strip = {k: v for k, v in got.items() if k != "metadata"}
        expected = {k: v for k, v in source.items() if k != "metadata"}
        for expression in (expected.get("spec", {}).get("matchResources") or {}).get(
                "namespaceSelector", {}).get("matchExpressions", []):
            # the tenant-isolation binding: system namespaces and the release's own
            expression["values"] = ["kube-system", "kube-public", "kube-node-lease", NAMESPACE]
        if source["kind"] == "ValidatingAdmissionPolicy":
            for variable in expected["spec"].get("variables", []):
                if variable["name"] in accounts:
                    variable["expression"] = accounts[variable["name"]]
        assert strip == expected, source["metadata"]["name"]


def test_policies_follow_the_release_and_the_toggles(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "template", "team", str(CHART), "--namespace", "gpu",
         "--kube-version", "1.35.4", "--show-only", "templates/policies.yaml"],
        capture_output=True, text=True, timeout=60, check=True)
    renamed = [o for o in yaml.safe_load_all(result.stdout) if o]
    names_ = sorted(o["metadata"]["name"] for o in renamed)
    assert all(n.startswith("team-carpool-") for n in names_), names_
    bindings = {o["metadata"]["name"]: o["spec"]["policyName"] for o in renamed
                if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert bindings == {"team-carpool-gpunode-own-node": "team-carpool-gpunode-own-node",
                        "team-carpool-gpujob-reports-own-node":
                            "team-carpool-gpujob-reports-own-node",
                        "team-carpool-pod-metadata": "team-carpool-pod-metadata",
                        "team-carpool-operator-finalizer-only":
                            "team-carpool-operator-finalizer-only",
                        "team-carpool-gpujob-only": "team-carpool-gpujob-only",
                        "team-carpool-tenant-isolation": "team-carpool-tenant-isolation",
                        "team-carpool-tenant-priority": "team-carpool-tenant-priority",
                        "team-carpool-tenant-devices": "team-carpool-tenant-devices"}
    door = next(o for o in renamed if o["metadata"]["name"] == "team-carpool-gpujob-only"
                and o["kind"] == "ValidatingAdmissionPolicy")
    (operator,) = [v for v in door["spec"]["variables"] if v["name"] == "operator"]
    assert operator["expression"] == "'system:serviceaccount:gpu:team-carpool-operator'"
    tenants = next(o for o in renamed if o["metadata"]["name"] == "team-carpool-tenant-isolation"
                   and o["kind"] == "ValidatingAdmissionPolicyBinding")
    [exempt] = tenants["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert (exempt["operator"], exempt["values"]) == (
        "NotIn", ["kube-system", "kube-public", "kube-node-lease", "gpu"])
    extra = subprocess.run(
        [str(helm), "template", "team", str(CHART), "--namespace", "gpu", "--kube-version",
         "1.35.4", "--show-only", "templates/policies.yaml", "--set",
         "policies.exemptNamespaces={gpu-operator,kube-system}"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    [binding] = [o for o in yaml.safe_load_all(extra) if o and o["metadata"]["name"] ==
                 "team-carpool-tenant-isolation" and o["kind"].endswith("Binding")]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0][
        "values"] == ["kube-system", "kube-public", "kube-node-lease", "gpu", "gpu-operator"]
    metadata = next(o for o in renamed if o["metadata"]["name"] == "team-carpool-pod-metadata"
                    and o["kind"] == "ValidatingAdmissionPolicy")
    accounts = {v["name"]: v["expression"] for v in metadata["spec"]["variables"]
                if v["name"] in ("operator", "extender", "devicePlugin")}
    assert accounts == {"operator": "'system:serviceaccount:gpu:team-carpool-operator'",
                        "extender": "'system:serviceaccount:gpu:team-carpool-extender'",
                        "devicePlugin": "'system:serviceaccount:gpu:team-carpool-device-plugin'"}
    finalizer = next(o for o in renamed
                     if o["metadata"]["name"] == "team-carpool-operator-finalizer-only"
                     and o["kind"] == "ValidatingAdmissionPolicy")
    (operator,) = [v for v in finalizer["spec"]["variables"] if v["name"] == "operator"]
    assert operator["expression"] == "'system:serviceaccount:gpu:team-carpool-operator'"

    def kinds(*args: str) -> list[str]:
        """The kinds of the policy objects rendered with these values."""
        ours = ("-platform-team", "-gpujob-edit", "-gpujob-view", "-cluster-view",
                "-gpunode-own-node", "-gpujob-reports-own-node", "-pod-metadata",
                "-operator-finalizer-only", "-gpujob-only", "-tenant-isolation",
                "-tenant-priority", "-tenant-devices", "-class-limits")
        return sorted(o["kind"] for o in objects(helm, *args)
                      if o["metadata"]["name"].endswith(ours))

    off = ("--set", "policies.tenantPriority=false", "--set", "policies.tenantDevices=false")
    assert kinds() == ["ClusterRole"] * 4 + ["ValidatingAdmissionPolicy"] * 8 + [
        "ValidatingAdmissionPolicyBinding"] * 8  # on by default; class limits when set
    assert kinds("--set", "policies.classLimits.batch.maxGpus=8") == ["ClusterRole"] * 4 + [
        "ValidatingAdmissionPolicy"] * 9 + ["ValidatingAdmissionPolicyBinding"] * 9
    assert kinds("--set", "policies.gpuNodeOwnNode=false", "--set",
                 "policies.gpuJobReports=false", "--set",
                 "policies.podMetadata=false", "--set", "policies.userRoles=false",
                 "--set", "policies.operatorFinalizerOnly=false", "--set",
                 "policies.gpujobOnly=false", "--set", "policies.tenantIsolation=false",
                 *off) == []
    assert kinds("--set", "policies.userRoles=false") == [
        "ValidatingAdmissionPolicy"] * 8 + ["ValidatingAdmissionPolicyBinding"] * 8
    assert kinds("--set", "rbac.create=false", "--set", "policies.podMetadata=false",
                 "--set", "policies.gpuJobReports=false",
                 "--set", "policies.operatorFinalizerOnly=false", "--set",
                 "policies.gpujobOnly=false", "--set", "policies.tenantIsolation=false",
                 *off) == [
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
