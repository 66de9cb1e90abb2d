"""`helm install` of helm/carpool runs every Carpool component as a pod on the real node.

Its own cluster (`carpool-e2e-chart`, made with devcluster's pods option: ServiceAccount
tokens, the API server reachable from the pod bridge) and its own real node (kube-proxy for
ClusterIPs, no host device plugin: the chart's DaemonSet serves the node). The images are built
without an engine (or reused: CARPOOL_E2E_IMAGES=reuse), pushed to the local registry, and
pulled by the node's containerd. After the install no Carpool process runs on the host: a
GpuJob goes Queued -> Running -> Succeeded through the in-cluster operator, carpool-scheduler,
extender and device plugin; `helm upgrade` under 20 running GpuJobs rolls every component while
probe jobs time admissions and bindings; `helm uninstall` leaves no Carpool object but CRDs.

The tests run in file order and build on each other (install, job, upgrade, uninstall).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool.core.timestamps import epoch_seconds
from carpool_testbed import devcluster, realnode, waiting

REPO = Path(__file__).resolve().parents[1]
CLUSTER = "carpool-e2e-chart"
RELEASE = "carpool"
NAMESPACE = "carpool-system"
# In the API server's default service range (10.0.0.0/24); carpool-scheduler calls it, no DNS.
EXTENDER_IP = "10.0.0.155"
# Carpool's 6 pods, a rolling update's surge, 20 running load jobs and the probes.
MAX_PODS = 64
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
# kubectl polls once a second here: the upgrade is measured while they run
wait_for = functools.partial(waiting.wait_for, interval=1.0)


@dataclass
class Release:
    """The installed chart: the node, helm, the pushed image refs and what the tests measured."""

    node: realnode.RealNode
    helm: Path
    refs: dict[str, str]
    measured: dict[str, float] = field(default_factory=dict)
    # Namespaces whose GpuJobs outlive the release (the uninstall step removes them).
    kept: list[str] = field(default_factory=list)

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.node.kubectl(*args, check=check, stdin=stdin, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm_run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(self.helm), "--kubeconfig", str(self.node.cluster.kubeconfig),
                               *args], capture_output=True, text=True, timeout=timeout,
                              check=False)
        assert done.returncode == 0, f"helm {' '.join(args[:2])}: {done.stderr[-3000:]}"
        return done

    def values(self) -> dict[str, Any]:
        """Values only: the registry's images, the real node's taint, fake GPUs, a pinned
        extender ClusterIP (no cluster DNS here)."""
        on_node = {"nodeSelector": {"kubernetes.io/hostname": self.node.name},
                   "tolerations": [toleration()]}
        carpool_repo, tag = _tag(self.refs["carpool"]).rsplit(":", 1)
        mps_repo, mps_tag = _tag(self.refs["carpool-mps"]).rsplit(":", 1)
        sched_repo, sched_tag = _tag(self.refs["kube-scheduler"]).rsplit(":", 1)
        return {
            "image": {"repository": carpool_repo, "tag": tag, "pullPolicy": "Always"},
            "mpsDaemon": {"image": {"repository": mps_repo, "tag": mps_tag,
                                    "pullPolicy": "Always"}},
            "scheduler": {"image": {"repository": sched_repo, "tag": sched_tag,
                                    "pullPolicy": "Always"}, **on_node},
            "operator": {"resyncSeconds": 2, **on_node},
            "extender": {"serviceClusterIP": EXTENDER_IP, **on_node},
            "devicePlugin": {"backend": "fake", "sharingModes": ["mps"], "sharesPerGpu": 16,
                             "publishInterval": 5, "tolerations": [toleration()],
                             # the node's containerd reads CDI specs from its own directory
                             "cdi": {"specDir": str(self.node.paths.cdi_spec_dir)}},
        }

    def pods(self) -> list[dict[str, Any]]:
        return list(self.json("get", "pods", "-n", NAMESPACE, "-l", INSTANCE)["items"])


def toleration() -> dict[str, str]:
    taint = realnode.REAL_NODE_TAINT
    return {"key": taint["key"], "operator": "Exists", "effect": taint["effect"]}


def _tag(ref: str) -> str:
    return ref.split("@")[0]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return pod["status"].get("phase") == "Running" and conditions.get("Ready") == "True"


def _component(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"].get("app.kubernetes.io/component", "?"))


def _push(registry: str, measured: dict[str, float]) -> dict[str, str]:
    """Builds (or reuses) carpool, carpool-mps and kube-scheduler and pushes them; records
    how long the build and the push took."""
    layouts = REPO / "build" / "images"
    wanted = ("carpool", "carpool-mps", "kube-scheduler")
    reuse = os.environ.get("CARPOOL_E2E_IMAGES") == "reuse" and all(
        (layouts / name / "index.json").is_file() for name in wanted)
    start = time.monotonic()
    if not reuse:
        scheduler = devcluster.binaries_dir() / "kube-scheduler"
        built = subprocess.run([sys.executable, str(REPO / "hack" / "images" / "build.py"),
                                "--out", str(layouts), "--with-scheduler", str(scheduler)],
                               capture_output=True, text=True, timeout=900, check=False)
        assert built.returncode == 0, built.stderr[-3000:]
        measured["images_build_s"] = time.monotonic() - start
    start = time.monotonic()
    env = dict(os.environ, REGISTRY=registry, CARPOOL_REGISTRY_PORT=registry.rsplit(":", 1)[1])
    subprocess.run(["bash", str(REPO / "hack" / "images" / "registry.sh"), "up"], env=env,
                   check=True, capture_output=True, timeout=900)
    done = subprocess.run(["bash", str(REPO / "hack" / "images" / "push.sh")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    measured["registry_and_push_s"] = time.monotonic() - start
    refs = {}
    for line in done.stdout.splitlines():
        ref, digest = line.split()
        refs[ref.rsplit("/", 1)[1].split(":")[0]] = f"{ref}@{digest}"
    assert set(wanted) <= set(refs), done.stdout
    return refs


@pytest.fixture(scope="module")
def release(request: pytest.FixtureRequest) -> Iterator[Release]:
    """Cluster (pods option), real node (kube-proxy, no host plugin), images pushed."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        os.environ[devcluster.PODS_ENV] = "1"
        try:
            session = devcluster.shared_session(
                name=CLUSTER, keep=os.environ.get("CARPOOL_KEEP_CLUSTER") == "1",
                progress=devcluster.Progress(sys.stderr))
            cluster = session.__enter__()
        finally:
            os.environ.pop(devcluster.PODS_ENV, None)
    try:
        helm = devcluster.known_bin_dir(devcluster.ClusterPaths.for_name(CLUSTER))
        assert helm is not None
        settings = realnode.NodeSettings(device_plugin=False, kube_proxy=True,
                                         max_pods=MAX_PODS)
        with capture.global_and_fixture_disabled():
            context = realnode.running_node(cluster, settings)
            node = context.__enter__()
        try:
            measured: dict[str, float] = {}
            refs = _push(node.settings.registry, measured)
            yield Release(node, helm / "helm", refs, measured)
        finally:
            with capture.global_and_fixture_disabled():
                context.__exit__(None, None, None)
    finally:
        with capture.global_and_fixture_disabled():
            session.__exit__(None, None, None)


@pytest.mark.timeout(1200)  # its setup builds the images, the cluster and the node
def test_helm_install_runs_every_component_ready_on_the_real_node(release: Release) -> None:
    values = yaml.safe_dump(release.values())
    start = time.monotonic()
    release.helm_run("install", RELEASE, str(REPO / "helm" / "carpool"), "-n", NAMESPACE,
                     "--create-namespace", "-f", _values_file(values))
    wanted = {"operator": 2, "extender": 1, "scheduler": 1, "device-plugin": 1,
              "mps-daemon": 1}

    def all_ready() -> list[dict[str, Any]] | None:
        pods = release.pods()
        counts: dict[str, int] = {}
        for pod in pods:
            if _ready(pod):
                counts[_component(pod)] = counts.get(_component(pod), 0) + 1
        return pods if counts == wanted and len(pods) == sum(wanted.values()) else None

    try:
        pods = wait_for("every Carpool pod Running and Ready", all_ready, timeout=300)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{_diagnose(release)}") from None
    release.measured["install_to_ready_s"] = time.monotonic() - start
    for pod in pods:
        assert pod["spec"]["nodeName"] == release.node.name, pod["metadata"]["name"]
        for status in pod["status"]["containerStatuses"]:
            # Pulled from the registry by digest, nothing imported.
            assert "@sha256:" in status["imageID"] and "localhost:" in status["imageID"], status
    # The DaemonSet's plugin registered with the kubelet: the node advertises its shares.
    wait_for("the node to advertise 2 x 16 shares", lambda: release.json(
        "get", "node", release.node.name)["status"]["allocatable"].get(
            names.RESOURCE_GPU) == "32", timeout=60)
    print(f"install to Ready: {release.measured['install_to_ready_s']:.1f}s", file=sys.stderr)


def _values_file(text: str) -> str:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"carpool-e2e-values-{os.getpid()}.yaml"
    path.write_text(text)
    return str(path)


def _diagnose(release: Release) -> str:
    out = [release.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout]
    out.append(release.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp",
                               check=False).stdout[-4000:])
    for pod in release.pods():
        name = pod["metadata"]["name"]
        out.append(f"--- {name}\n" + release.kubectl(
            "logs", "-n", NAMESPACE, name, "--all-containers", "--tail=20",
            check=False).stdout)
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# A GpuJob through the in-cluster components


PRINT_ENV = ("env | grep -E '^(CUDA|NVIDIA|CARPOOL)_' | sort; " + realnode.PRINT_DEVICE_NODES
             + "if [ -d \"$CUDA_MPS_PIPE_DIRECTORY\" ]; then echo MPS_PIPE_MOUNTED=yes; fi; "
             "echo USER=$(id -u):$(id -g); echo DONE")


def gpujob(name: str, namespace: str, project: str, script: str, cores: int = 50,
           memory: str = "12Gi") -> dict[str, Any]:
    """A one-GPU MPS GpuJob for the real node (its template tolerates the node's taint)."""
    return {
        "apiVersion": names.API_VERSION, "kind": "GpuJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"project": project, "class": "short",
                 "gpu": {"count": 1, "memory": memory, "cores": cores, "isolation": "mps",
                         "models": ["H200"]},
                 "estimatedDuration": "5m",
                 "template": {"spec": {
                     "nodeSelector": {"kubernetes.io/hostname": realnode.DEFAULT_NODE_NAME},
                     "tolerations": [toleration()],
                     "dnsPolicy": "Default",
                     "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "main", "image": realnode.TEST_IMAGE,
                                     "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", script]}]}}},
    }


def quota(project: str, namespace: str, gpus: int) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
            "metadata": {"name": project},
            "spec": {"namespaces": [namespace], "concurrent": {"gpus": gpus}}}


def kubectl_carpool(release: Release, *args: str) -> str:
    """`kubectl carpool ...` as a user runs it: kubectl finds the plugin on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, KUBECONFIG=str(release.node.cluster.kubeconfig),
               PATH=f"{bin_dir}:{release.node.cluster.bin_dir}:{os.environ.get('PATH', '')}")
    done = subprocess.run(["kubectl", "carpool", *args], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl carpool {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout


def _no_carpool_on_the_host() -> list[str]:
    """Carpool processes on this machine, for this cluster (its kubeconfig on their command
    line, as the test bed starts them), that are not in a pod's cgroup."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cgroup = (proc / "cgroup").read_text()
        except OSError:
            continue
        component = any(f"carpool.{c}" in cmdline
                         for c in ("operator", "extender", "deviceplugin"))
        if component and CLUSTER in cmdline and "kubepods" not in cgroup:
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def test_a_gpujob_runs_through_the_in_cluster_components(release: Release) -> None:
    """Held Queued by its quota (`why` says so), admitted when the quota allows it, placed by
    carpool-scheduler and the extender, given its GPU by the device plugin, Succeeded."""
    namespace = project = f"chart-{uuid.uuid4().hex[:6]}"
    release.kubectl("create", "namespace", namespace)
    release.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([
        quota(project, namespace, 0), gpujob("print-env", namespace, project, PRINT_ENV)]))
    phases: list[str] = []

    def phase() -> str:
        job = release.json("get", "gpujob", "print-env", "-n", namespace)
        current = str((job.get("status") or {}).get("phase", ""))
        if current and (not phases or phases[-1] != current):
            phases.append(current)
        return current

    try:
        wait_for("the GpuJob to be Queued", lambda: phase() == "Queued", timeout=60,
                 interval=0.5)
    except AssertionError as error:
        job = release.json("get", "gpujob", "print-env", "-n", namespace)
        raise AssertionError(f"{error}\njob: {json.dumps(job)[-2000:]}\n"
                             f"{_diagnose(release)}") from None
    why = kubectl_carpool(release, "why", "print-env", "-n", namespace)
    assert "BLOCKING" in why, why  # the quota holds it, and `why` says which rule
    queue = kubectl_carpool(release, "queue", "-A")
    assert "print-env" in queue, queue
    release.kubectl("patch", "projectquota", project, "--type=merge",
                    "-p", json.dumps({"spec": {"concurrent": {"gpus": 1}}}))
    try:
        wait_for("the GpuJob to finish", lambda: phase() in ("Succeeded", "Failed"),
                 timeout=120, interval=0.5)
    except AssertionError as error:
        raise AssertionError(f"{error}\nphases {phases}\n{_diagnose(release)}") from None
    job = release.json("get", "gpujob", "print-env", "-n", namespace)
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert phases[0] == "Queued" and phases[-1] == "Succeeded", phases
    assert set(phases) <= {"Queued", "Admitted", "Running", "Succeeded"}, phases
    assert status["submitTime"] <= status["admitTime"] <= status["startTime"] \
        <= status["completionTime"], status
    assert status["node"] == release.node.name
    pod = release.json("get", "pod", status["podName"], "-n", namespace)
    assignment = json.loads(pod["metadata"]["annotations"][names.ANN_ASSIGNMENT])
    assert [g["uuid"] for g in status["gpus"]] == [g["uuid"] for g in assignment["gpus"]]
    allocated = pod["metadata"]["annotations"].get(names.ANN_ALLOCATED)
    assert allocated, "the chart's device plugin did not mark the pod"
    logs = release.kubectl("logs", status["podName"], "-n", namespace).stdout
    env = dict(line.split("=", 1) for line in logs.split("DONE")[0].split() if "=" in line)
    uuids = ",".join(g["uuid"] for g in assignment["gpus"])
    assert env["CUDA_VISIBLE_DEVICES"] == uuids and env["NVIDIA_VISIBLE_DEVICES"] == "void", env
    # the GPU from the runtime, through the CDI spec the chart's device plugin wrote
    nodes = {n for n in env.get("DEVICE_NODES", "").split(",") if n}
    assert nodes == {f"nvidia{g['index']}" for g in assignment["gpus"]} | {
        "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}, env
    assert env["USER"] == "1000:1000", env  # every MPS client runs as mpsDaemon.clientUid
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=12G", env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50", env
    assert env.get("MPS_PIPE_MOUNTED") == "yes", env
    assert _no_carpool_on_the_host() == []
    assert json.loads(kubectl_carpool(release, "queue", "-A", "-o", "json")) is not None
    assert release.node.name in kubectl_carpool(release, "nodes")
    assert project in kubectl_carpool(release, "quota", "-n", namespace)
    assert project in kubectl_carpool(release, "report", "--since", "1h", "-A")
    release.kubectl("delete", "namespace", namespace, "--wait=false")
    release.kubectl("delete", "projectquota", project)


# --------------------------------------------------------------------------------------------
# Day two: upgrade under load, uninstall

LOAD_JOBS = 20
# A load job runs until the test touches its stop file, however slowly the 20 started on a busy
# machine; one never told to stop fails after 15 minutes instead of running on.
STOP_FILE = "/tmp/carpool-stop"
LOAD_SCRIPT = (f"i=0; while [ ! -e {STOP_FILE} ] && [ $i -lt 900 ]; do sleep 1; i=$((i+1)); "
               f"done; test -e {STOP_FILE}")
PROBE_EVERY_S = 1.0
ROLLED = ("operator", "extender", "scheduler", "device-plugin")
ROLLOUT_ANNOTATION = "carpool.dev/rollout"


class Watcher:
    """Polls the namespace's GpuJobs and pods; records when each job was first seen admitted
    (status.admitTime set), its pod first seen bound (spec.nodeName) and the job first seen
    started (status.startTime: a pod of it ran), in wall-clock seconds. Resolution: one poll
    (two kubectl calls, about 0.5-1.5 s here)."""

    def __init__(self, release: Release, namespace: str) -> None:
        self.release, self.namespace = release, namespace
        self.created: dict[str, float] = {}
        self.admitted: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.stop = False

    def poll(self) -> None:
        now = time.time()
        jobs = self.release.json("get", "gpujobs", "-n", self.namespace)["items"]
        for job in jobs:
            if (job.get("status") or {}).get("admitTime"):
                self.admitted.setdefault(job["metadata"]["name"], now)
            if (job.get("status") or {}).get("startTime"):
                self.started.setdefault(job["metadata"]["name"], now)
        pods = self.release.json("get", "pods", "-n", self.namespace)["items"]
        for pod in pods:
            job_name = (pod["metadata"].get("labels") or {}).get(names.LABEL_JOB)
            if job_name and pod["spec"].get("nodeName"):
                self.bound.setdefault(job_name, now)

    def run(self) -> None:
        while not self.stop:
            with contextlib.suppress(subprocess.SubprocessError, json.JSONDecodeError):
                self.poll()
            time.sleep(0.5)


def longest_stall(waits: list[tuple[float, float]], events: list[float]) -> float:
    """The longest time some probe waited while no probe at all got through: for each wait
    (created, done), the largest gap between successive events inside it, its ends included."""
    longest = 0.0
    for created, done in waits:
        points = [created, *sorted(e for e in events if created < e < done), done]
        longest = max(longest, *(b - a for a, b in itertools.pairwise(points)))
    return longest


def _pod_uids(release: Release) -> dict[str, set[str]]:
    uids: dict[str, set[str]] = {}
    for pod in release.pods():
        uids.setdefault(_component(pod), set()).add(pod["metadata"]["uid"])
    return uids


def _job_pods(release: Release, namespace: str) -> dict[str, list[dict[str, Any]]]:
    by_job: dict[str, list[dict[str, Any]]] = {}
    for pod in release.json("get", "pods", "-n", namespace)["items"]:
        job_name = (pod["metadata"].get("labels") or {}).get(names.LABEL_JOB, "")
        by_job.setdefault(job_name, []).append(pod)
    return by_job


def _why_not(release: Release, namespace: str, job: dict[str, Any]) -> str:
    """A job's status, its pods' and its events, for a failed assertion."""
    name = job["metadata"]["name"]
    pods = [{"name": p["metadata"]["name"], "phase": p["status"].get("phase"),
             "reason": p["status"].get("reason"), "message": p["status"].get("message")}
            for p in _job_pods(release, namespace).get(name, [])]
    events = release.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={name}", check=False).stdout
    return f"{name}: {json.dumps(job['status'])}\npods: {json.dumps(pods)}\n{events}"


def _restarts(pod: dict[str, Any]) -> int:
    return sum(int(s.get("restartCount", 0)) for s in pod["status"].get("containerStatuses", []))


@pytest.mark.timeout(900)
def test_helm_upgrade_under_load_rolls_every_component_and_loses_no_job(
        release: Release) -> None:
    """20 GpuJobs run through `helm upgrade` of a value that rolls every component; probe jobs
    submitted before, during and after time admissions and bindings."""
    namespace = project = f"load-{uuid.uuid4().hex[:6]}"
    release.kubectl("create", "namespace", namespace)
    release.kept.append(namespace)  # the uninstall step removes its jobs as the docs say
    load = [f"load-{i:02d}" for i in range(LOAD_JOBS)]
    release.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([
        quota(project, namespace, 2),
        *(gpujob(name, namespace, project, LOAD_SCRIPT, cores=4, memory="2Gi")
          for name in load)]))

    def load_running() -> dict[str, str] | None:
        """Each load job's one pod (uid) when all of them are Running, on one pod each."""
        jobs = release.json("get", "gpujobs", "-n", namespace)["items"]
        phases = {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in jobs}
        pods = _job_pods(release, namespace)
        if not all(phases.get(n) == "Running" and len(pods.get(n, [])) == 1 for n in load):
            return None
        return {n: pods[n][0]["metadata"]["uid"] for n in load
                if pods[n][0]["status"].get("phase") == "Running"} or None

    try:
        started = wait_for(f"{LOAD_JOBS} GpuJobs Running", load_running, timeout=300,
                           interval=2)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{_diagnose(release)}") from None
    assert len(started) == LOAD_JOBS, started
    before = _pod_uids(release)
    leader = release.json("get", "lease", "carpool-operator", "-n", NAMESPACE)["spec"]
    watcher = Watcher(release, namespace)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    probes: list[str] = []

    def probe() -> None:
        name = f"probe-{len(probes):03d}"
        release.kubectl("create", "-f", "-", stdin=json.dumps(
            gpujob(name, namespace, project, "true", cores=2, memory="1Gi")))
        watcher.created[name] = time.time()
        probes.append(name)

    def probe_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            begun = time.monotonic()
            probe()
            time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - begun)))

    try:
        probe_for(12)  # the baseline
        upgrade_start = time.time()
        release.helm_run("upgrade", RELEASE, str(REPO / "helm" / "carpool"), "-n", NAMESPACE,
                         "--reuse-values", "--set-string",
                         "podAnnotations." + ROLLOUT_ANNOTATION.replace(".", "\\.") + "=2")

        def rolled() -> bool:
            pods = release.pods()
            now = _pod_uids(release)
            fresh = all(now.get(c) and not (now[c] & before.get(c, set())) for c in ROLLED)
            # The old pods are gone and every new one is Ready.
            return fresh and all(_ready(p) for p in pods) and sum(map(len, now.values())) == 6

        while not rolled():
            if time.time() - upgrade_start > 240:
                raise AssertionError(f"the upgrade did not roll in 240 s\n{_diagnose(release)}")
            probe_for(PROBE_EVERY_S)
        rolled_at = time.time()
        # At the moment the roll ends every load job still runs, on the pod it started on.
        assert load_running() == started, _job_pods(release, namespace)
        probe_for(10)  # after
        wait_for("every probe started",
                 lambda: all(p in watcher.started for p in probes), timeout=120)
    finally:
        watcher.stop = True
        thread.join(10)
    after = _pod_uids(release)
    # The MPS daemon's pod stays (OnDelete: never restarted under MPS clients); its template
    # has the new value, so deleting the pod, as docs/operations.md says, updates it.
    assert after["mps-daemon"] == before["mps-daemon"]
    daemonset = release.json("get", "daemonset", "-n", NAMESPACE, "-l",
                             f"{INSTANCE},app.kubernetes.io/component=mps-daemon")["items"][0]
    assert daemonset["spec"]["template"]["metadata"]["annotations"].get(
        ROLLOUT_ANNOTATION) == "2", daemonset["spec"]["template"]["metadata"]

    # The operator's leader handed over (the Lease's holder changed) during the roll.
    lease = release.json("get", "lease", "carpool-operator", "-n", NAMESPACE)["spec"]
    assert lease["holderIdentity"] != leader["holderIdentity"], (leader, lease)
    acquired = epoch_seconds(lease["acquireTime"])
    assert acquired is not None
    measured = {"roll_s": rolled_at - upgrade_start,
                "leader_acquired_after_s": acquired - upgrade_start}
    stages = {"admit": watcher.admitted, "bind": watcher.bound, "start": watcher.started}
    for window, (lo, hi) in {"baseline": (0.0, upgrade_start),
                             "roll": (upgrade_start, rolled_at),
                             "after": (rolled_at, time.time())}.items():
        chosen = [p for p in probes if lo <= watcher.created[p] < hi]
        measured[f"{window}_probes"] = float(len(chosen))
        for stage, seen in stages.items():
            took = [seen[p] - watcher.created[p] for p in chosen]
            measured[f"{window}_{stage}_median_s"] = statistics.median(took)
            measured[f"{window}_{stage}_max_s"] = max(took)
            measured[f"{window}_{stage}_stall_s"] = longest_stall(
                [(watcher.created[p], seen[p]) for p in chosen], list(seen.values()))
    release.measured.update(measured)
    print("upgrade: " + ", ".join(f"{k}={v:.1f}" for k, v in measured.items()),
          file=sys.stderr)

    # The load ends when the test says so.
    pods = _job_pods(release, namespace)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: release.kubectl(
            "exec", "-n", namespace, pods[n][0]["metadata"]["name"], "--",
            "touch", STOP_FILE), load))
    every = load + probes

    def finished() -> list[dict[str, Any]] | None:
        jobs = release.json("get", "gpujobs", "-n", namespace)["items"]
        done = [j for j in jobs if (j.get("status") or {}).get("phase") in ("Succeeded",
                                                                          "Failed")]
        return jobs if len(done) == len(every) else None

    jobs = wait_for("every GpuJob finished", finished, timeout=180, interval=3)
    assert sorted(j["metadata"]["name"] for j in jobs) == sorted(every)
    pods = _job_pods(release, namespace)
    retried = []
    for job in jobs:
        status, name = job["status"], job["metadata"]["name"]
        assert status["phase"] == "Succeeded", _why_not(release, namespace, job)
        # One history record and at most one pod per attempt.
        assert len(status.get("history", [])) == status.get("attempts"), (name, status)
        assert 1 <= len(pods.get(name, [])) <= status["attempts"], (name, pods.get(name))
        if status["attempts"] != 1:
            retried.append(name)
    # The running jobs were not touched; a probe may have been retried (a pod bound while its
    # node's device plugin was being replaced is refused by the kubelet, then requeued).
    assert not [n for n in retried if n.startswith("load-")], retried
    for name in load:
        assert [p["metadata"]["uid"] for p in pods[name]] == [started[name]], pods[name]
        assert _restarts(pods[name][0]) == 0, pods[name][0]["status"]
    release.measured["probes_retried"] = float(len(retried))
    billed = sum(float(j["status"].get("gpuHours", 0)) for j in jobs)
    assert billed > 0

    def quota_used() -> float | None:
        used = (release.json("get", "projectquota", project).get("status") or {}).get(
            "usedGpuHours")
        # usedGpuHours is rounded to 4 decimals, each job's gpuHours to 6; one load job
        # billed twice would add at least its own hours (more than 0.0002 here).
        return float(used) if used is not None and abs(float(used) - billed) <= 2e-4 else None

    wait_for(f"the quota to bill {billed:.4f} GPU-hours once", quota_used, timeout=60)
    # The accounting report (status.history) agrees: one run per attempt, the same total.
    report = json.loads(kubectl_carpool(release, "report", "-n", namespace, "--by", "job",
                                        "--since", "1h", "-o", "json"))
    runs = {row["key"].split("/", 1)[1]: row["runs"] for row in report["rows"]}
    attempts = {j["metadata"]["name"]: j["status"]["attempts"] for j in jobs}
    assert runs == attempts, (runs, attempts)
    assert abs(report["total_gpu_hours"] - billed) <= 1e-4 * len(jobs), (report, billed)
    for job in jobs:
        assert abs(float(job["status"]["gpuHours"]) - sum(
            r["gpu_hours"] for r in report["rows"]
            if r["key"] == f"{namespace}/{job['metadata']['name']}")) <= 1e-4, job["status"]

    # docs/operations.md: drain the node's MPS jobs, then delete its daemon pod to update it.
    old = next(iter(before["mps-daemon"]))
    release.kubectl("delete", "pod", "-n", NAMESPACE, "-l",
                    f"{INSTANCE},app.kubernetes.io/component=mps-daemon", "--wait=false")

    def mps_updated() -> bool:
        daemons = [p for p in release.pods() if _component(p) == "mps-daemon"]
        return len(daemons) == 1 and daemons[0]["metadata"]["uid"] != old and _ready(
            daemons[0]) and daemons[0]["metadata"]["annotations"].get(ROLLOUT_ANNOTATION) == "2"

    wait_for("the MPS daemon's new pod Ready", mps_updated, timeout=120)


def test_helm_uninstall_leaves_no_carpool_object_but_the_crds(release: Release) -> None:
    """Nothing of the release stays but what docs/operations.md says stays, and its steps for
    removing that work: the CRDs, the PriorityClass, the components' Leases, and the jobs' pods
    (Carpool's finalizer holds each until an operator records its run: without one they stay
    Terminating once deleted, until it is taken off)."""
    release.helm_run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
    wait_for("Carpool's pods to be gone", lambda: release.pods() == [], timeout=120)
    kinds = ("pods,services,serviceaccounts,configmaps,deployments,daemonsets,roles,"
             "rolebindings")
    left = release.json("get", kinds, "-A", "-l", INSTANCE)["items"]
    cluster_kinds = ("clusterroles,clusterrolebindings,validatingadmissionpolicies,"
                     "validatingadmissionpolicybindings")
    left += release.json("get", cluster_kinds, "-l", INSTANCE)["items"]
    named = release.json("get", "clusterroles,clusterrolebindings,validatingadmissionpolicies,"
                         "validatingadmissionpolicybindings")["items"]
    left += [o for o in named if o["metadata"]["name"].startswith(RELEASE)]
    left += [o for o in release.json("get", "all", "-n", NAMESPACE)["items"]]
    assert [f"{o['kind']}/{o['metadata']['name']}" for o in left] == []
    crd_names = [f"{c}.{names.GROUP}" for c in ("gpujobs", "projectquotas", "gpunodes")]
    crds = release.kubectl("get", "crd", "-o", "name").stdout.split()
    assert {f"customresourcedefinition.apiextensions.k8s.io/{c}" for c in crd_names} <= set(
        crds), crds

    # What stays on purpose, and removing it as the docs say.
    jobs = release.json("get", "gpujobs", "-A")["items"]
    kept = [j for j in jobs if j["metadata"]["namespace"] in release.kept]
    assert len(kept) >= LOAD_JOBS, [j["metadata"]["name"] for j in jobs]
    assert not [j for j in kept if names.FINALIZER in j["metadata"].get("finalizers", [])]
    held = [p for p in release.json("get", "pods", "-A")["items"]
            if names.FINALIZER in p["metadata"].get("finalizers", [])]
    assert held, "the load jobs' pods carry Carpool's finalizer"
    release.kubectl("get", "priorityclass", "carpool-job")
    leases = {o["metadata"]["name"] for o in release.json("get", "leases", "-n", NAMESPACE)[
        "items"]}
    assert {"carpool-operator", "carpool-scheduler"} <= leases, leases
    release.kubectl("delete", "crd", *crd_names, "--wait=false")
    wait_for("the CRDs to be gone", lambda: not set(crd_names) & {
        n.split("/", 1)[1] for n in release.kubectl("get", "crd", "-o", "name").stdout.split()},
        timeout=120)
    # Without the operator, the jobs' pods (deleted with their jobs) wait for their finalizer
    # to be taken off, as docs/guides/platform.md says.
    time.sleep(5)
    terminating = [p for p in release.json("get", "pods", "-A")["items"]
                   if p["metadata"].get("deletionTimestamp")
                   and names.FINALIZER in p["metadata"].get("finalizers", [])]
    assert terminating, "the jobs' pods wait for Carpool's finalizer"
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: release.kubectl(
            "patch", "pod", p["metadata"]["name"], "-n", p["metadata"]["namespace"],
            "--type=json", "-p", json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]),
            check=False), held))
    wait_for("the jobs' pods to be gone", lambda: not [
        p for p in release.json("get", "pods", "-A")["items"]
        if names.FINALIZER in p["metadata"].get("finalizers", [])], timeout=120)
    release.kubectl("delete", "priorityclass", "carpool-job")
    release.kubectl("delete", "namespace", NAMESPACE, "--timeout=120s")
    print("measured: " + json.dumps({k: round(v, 1) for k, v in release.measured.items()}),
          file=sys.stderr)
