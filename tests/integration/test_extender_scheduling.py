"""The extender with the real kube-scheduler and API server on the local cluster.

These tests run their own extender process and their own kube-scheduler (the cluster's
binary, a private scheduler name, calling that extender), and put their pods on their own
tainted KWOK nodes, so they neither disturb nor depend on what else uses the cluster.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core import names
from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB
from carpool_testbed import crds, devcluster, simnodes, stack

pytestmark = pytest.mark.cluster

T = TypeVar("T")
RUN = uuid.uuid4().hex[:6]
SCHEDULER = f"carpool-it-{RUN}"
TAINT = {"key": "carpool.dev/extender-it", "value": RUN, "effect": "NoSchedule"}


def eventually(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)



class ExtenderProcess:
    """`python -m carpool.extender` against the cluster, restartable."""

    def __init__(self, kubeconfig: Path, port: int, log: Path) -> None:
        self.kubeconfig, self.port, self.log = kubeconfig, port, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                # These tests place bare pods: no GpuJob owns them, which the shipped
                # extender refuses (tests/integration/test_security_policies.py covers that).
                [sys.executable, "-m", "carpool.extender", "--port", str(self.port),
                 "--host", "127.0.0.1", "--kubeconfig", str(self.kubeconfig),
                 "--allow-unowned-pods"],
                stdout=out, stderr=subprocess.STDOUT)
        eventually(self.healthy, 60, "the extender to sync its cache")

    def healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"extender exited: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no chance to tidy up, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def api(cluster: devcluster.Cluster) -> Iterator[Any]:
    api = cluster.api()
    yield api
    api.close()


@pytest.fixture(scope="module")
def core(api: Any) -> Any:
    return client.CoreV1Api(api)


@pytest.fixture(scope="module")
def extender(cluster: devcluster.Cluster, api: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[ExtenderProcess]:
    crds.apply_crds(api)
    log = tmp_path_factory.mktemp("extender") / "extender.log"
    process = ExtenderProcess(cluster.kubeconfig, stack.free_port(), log)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def scheduler(cluster: devcluster.Cluster, extender: ExtenderProcess,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    """A private kube-scheduler (the cluster's binary) whose only profile calls our extender."""
    workdir = tmp_path_factory.mktemp("scheduler")
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(cluster.kubeconfig)},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": SCHEDULER}],
        "extenders": [{
            "urlPrefix": f"http://127.0.0.1:{extender.port}/",
            "filterVerb": "filter", "prioritizeVerb": "prioritize", "bindVerb": "bind",
            "weight": 5, "nodeCacheCapable": True, "httpTimeout": "10s",
            "managedResources": [{"name": r, "ignoredByScheduler": True} for r in (
                names.RESOURCE_GPU, names.RESOURCE_GPU_MEMORY, names.RESOURCE_GPU_CORES)],
        }],
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    log = (workdir / "scheduler.log").open("wb")
    process = subprocess.Popen(
        [str(cluster.bin_dir / "kube-scheduler"), f"--config={workdir / 'config.yaml'}",
         "--secure-port=0", "--v=2"], stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1)
    assert process.poll() is None, (workdir / "scheduler.log").read_text()[-3000:]
    yield process
    process.terminate()
    process.wait(10)
    log.close()


@pytest.fixture(scope="module")
def namespace(core: Any) -> Iterator[str]:
    name = f"extender-it-{RUN}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


class Nodes:
    """Simulated GPU nodes for one test, tainted so only this module's pods land there."""

    def __init__(self, api: Any, core: Any, prefix: str) -> None:
        self.api, self.core, self.prefix = api, core, prefix
        self.created: list[str] = []

    def add(self, *nodes: simnodes.SimNode) -> list[str]:
        simnodes.apply_nodes(self.api, list(nodes), datetime.now(UTC))
        for node in nodes:
            self.core.patch_node(node.name, {"spec": {"taints": [TAINT]}})
            self.created.append(node.name)
        return [n.name for n in nodes]

    def node(self, suffix: str, model: str = "A100", count: int = 1, temperature: float = 40.0,
             datasets: Sequence[str] = (), memory_gib: int | None = None) -> simnodes.SimNode:
        memory = memory_gib * 1024 if memory_gib else GPU_MODEL_MEMORY_MIB.get(model)
        return simnodes.SimNode(
            name=f"{self.prefix}-{suffix}-{RUN}",
            gpus=(simnodes.SimGpuGroup(model=model, count=count, memory_total_mib=memory,
                                       temperature_c=temperature),),
            datasets=tuple(datasets))

    def delete(self) -> None:
        simnodes.delete_nodes(self.api, self.created)


@pytest.fixture
def nodes(api: Any, core: Any, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    made = Nodes(api, core, request.node.name.removeprefix("test_")[:20].replace("_", "-"))
    yield made
    made.delete()


def gpu_pod(name: str, *, gpus: int = 1, memory_gib: int = 10, cores: int = 0,
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    limits = {names.RESOURCE_GPU: str(gpus), names.RESOURCE_GPU_MEMORY: str(memory_gib)}
    if cores:
        limits[names.RESOURCE_GPU_CORES] = str(cores)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "schedulerName": SCHEDULER,
            "tolerations": [{"key": TAINT["key"], "operator": "Equal", "value": RUN,
                             "effect": "NoSchedule"}, devcluster.KWOK_TOLERATION],
            "containers": [{"name": "main", "image": "registry.invalid/carpool/sim:1",
                            "resources": {"limits": limits}}],
        },
    }


def create_pods(core: Any, namespace: str, pods: Sequence[dict[str, Any]]) -> None:
    """Create all pods at (nearly) the same instant, from parallel threads."""
    barrier = threading.Barrier(len(pods))
    errors: list[BaseException] = []

    def create(pod: dict[str, Any]) -> None:
        barrier.wait()
        try:
            core.create_namespaced_pod(namespace, pod)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def read_pod(core: Any, namespace: str, name: str) -> dict[str, Any]:
    resp = core.read_namespaced_pod(name, namespace, _preload_content=False)
    pod: dict[str, Any] = json.loads(resp.data)
    return pod


def node_of(core: Any, namespace: str, name: str) -> str | None:
    return read_pod(core, namespace, name)["spec"].get("nodeName")


def wait_bound(core: Any, namespace: str, name: str, timeout: float = 60) -> str:
    return eventually(lambda: node_of(core, namespace, name), timeout, f"pod {name} bound")


def scheduling_events(core: Any, namespace: str, name: str) -> list[str]:
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return [e.message or "" for e in events.items if e.reason == "FailedScheduling"]


def per_gpu_memory(core: Any, namespace: str) -> dict[str, int]:
    """MiB assigned per GPU over every pod in the namespace that holds an assignment."""
    used: dict[str, int] = {}
    for pod in core.list_namespaced_pod(namespace).items:
        text = (pod.metadata.annotations or {}).get(names.ANN_ASSIGNMENT)
        if text and pod.status.phase not in ("Succeeded", "Failed"):
            assignment = json.loads(text)
            assert assignment["node"] == pod.spec.node_name or not pod.spec.node_name
            for gpu in assignment["gpus"]:
                used[gpu["uuid"]] = used.get(gpu["uuid"], 0) + gpu["memoryMiB"]
    return used


def delete_pods(core: Any, namespace: str, pods: Sequence[str]) -> None:
    for name in pods:
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def pods(core: Any, namespace: str) -> Iterator[list[str]]:
    """Names of the pods a test created; deleted after it."""
    created: list[str] = []
    yield created
    delete_pods(core, namespace, created)


def test_a_job_restricted_to_a_model_lands_only_there(
        core: Any, namespace: str, scheduler: Any, nodes: Nodes, pods: list[str]) -> None:
    t4, h200 = nodes.add(nodes.node("t4", model="T4", count=4),
                         nodes.node("h200", model="H200", count=1))
    batch = [gpu_pod(f"model-{i}-{RUN}", memory_gib=10,
                     annotations={names.ANN_MODELS: "H200"}) for i in range(3)]
    pods.extend(p["metadata"]["name"] for p in batch)
    create_pods(core, namespace, batch)
    for name in pods:
        assert wait_bound(core, namespace, name) == h200
    assignment = json.loads(read_pod(core, namespace, pods[0])["metadata"]["annotations"][
        names.ANN_ASSIGNMENT])
    assert assignment["node"] == h200 and len(assignment["gpus"]) == 1
    assert t4 not in {node_of(core, namespace, n) for n in pods}


def extenders_pick(extender: ExtenderProcess, namespace: str, pod: dict[str, Any],
                   node_names: Sequence[str]) -> str | None:
    """The node the extender's filter passes first for `pod` (not created yet) among
    `node_names`, asked as the scheduler will ask. Under the pod's own name, so the
    nomination it leaves is its own and steers nothing else."""
    probe = {**pod, "metadata": {**pod["metadata"], "namespace": namespace}}
    request = urllib.request.Request(
        f"http://127.0.0.1:{extender.port}/filter", method="POST",
        data=json.dumps({"Pod": probe, "NodeNames": list(node_names)}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        passed = json.loads(response.read()).get("NodeNames") or []
    return str(passed[0]) if passed else None


def wait_seen(extender: ExtenderProcess, namespace: str, pod: dict[str, Any],
              node_names: Sequence[str], best: str) -> None:
    """Wait until the extender's cache has the new nodes as the API server has them (each
    is four writes, which its watches deliver a moment later; before that, a node it does
    not know yet cannot win), shown by its filter picking `best`."""
    eventually(lambda: extenders_pick(extender, namespace, pod, node_names) == best or None,
               30, f"the extender to see {', '.join(node_names)} and pick {best}")


def test_of_two_equal_nodes_the_cooler_wins(
        core: Any, namespace: str, extender: ExtenderProcess, scheduler: Any, nodes: Nodes,
        pods: list[str]) -> None:
    warm, cool = nodes.add(nodes.node("warm", temperature=75.0),
                           nodes.node("cool", temperature=35.0))
    name = f"cool-{RUN}"
    pods.append(name)
    pod = gpu_pod(name, memory_gib=10)
    wait_seen(extender, namespace, pod, [warm, cool], cool)
    core.create_namespaced_pod(namespace, pod)
    assert wait_bound(core, namespace, name) == cool


def test_the_node_with_the_dataset_cached_wins(
        core: Any, namespace: str, extender: ExtenderProcess, scheduler: Any, nodes: Nodes,
        pods: list[str]) -> None:
    far, near = nodes.add(nodes.node("far"), nodes.node("near", datasets=["imagenet"]))
    name = f"data-{RUN}"
    pods.append(name)
    pod = gpu_pod(name, memory_gib=10, annotations={
        names.ANN_DATASET: "imagenet", names.ANN_DATASET_SIZE: "150"})
    wait_seen(extender, namespace, pod, [far, near], near)
    core.create_namespaced_pod(namespace, pod)
    assert wait_bound(core, namespace, name) == near


def test_two_pods_that_exceed_one_gpu_together_are_never_bound_to_it_together(
        core: Any, namespace: str, scheduler: Any, nodes: Nodes, pods: list[str]) -> None:
    [only] = nodes.add(nodes.node("one-gpu", memory_gib=40))
    batch = [gpu_pod(f"pair-{i}-{RUN}", memory_gib=30) for i in range(2)]
    pods.extend(p["metadata"]["name"] for p in batch)
    create_pods(core, namespace, batch)  # the same instant
    winner = eventually(lambda: [n for n in pods if node_of(core, namespace, n)], 60,
                        "one of the pair bound")
    assert len(winner) == 1
    [loser] = [n for n in pods if n not in winner]
    # first, possibly, "allocation in flight" (the winner was still binding); then the fit
    eventually(lambda: any("10 GiB free, job needs 30 GiB" in r
                           for r in scheduling_events(core, namespace, loser)), 90,
               f"a FailedScheduling event for {loser} naming the memory shortfall")
    time.sleep(3)  # give a wrong second bind every chance to happen
    assert node_of(core, namespace, loser) is None
    assert max(per_gpu_memory(core, namespace).values()) <= 40 * 1024
    assert only == node_of(core, namespace, winner[0])


def test_a_burst_of_pods_never_over_commits_any_gpu(
        core: Any, namespace: str, scheduler: Any, nodes: Nodes, pods: list[str]) -> None:
    made = nodes.add(*(nodes.node(f"burst{i}", count=2, memory_gib=40) for i in range(3)))
    # 6 GPUs x 40 GiB hold 12 pods of 20 GiB; ask for 18 at once
    batch = [gpu_pod(f"burst-{i}-{RUN}", memory_gib=20) for i in range(18)]
    pods.extend(p["metadata"]["name"] for p in batch)
    create_pods(core, namespace, batch)
    eventually(lambda: sum(1 for n in pods if node_of(core, namespace, n)) >= 12, 120,
               "12 of 18 pods bound")
    time.sleep(3)
    bound = [n for n in pods if node_of(core, namespace, n)]
    assert len(bound) == 12
    used = per_gpu_memory(core, namespace)
    assert len(used) == 6 and max(used.values()) <= 40 * 1024
    assert {node_of(core, namespace, n) for n in bound} <= set(made)


def test_restarting_the_extender_loses_no_pod_and_double_books_no_gpu(
        core: Any, namespace: str, scheduler: Any, extender: ExtenderProcess, nodes: Nodes,
        pods: list[str]) -> None:
    nodes.add(*(nodes.node(f"restart{i}", count=2, memory_gib=40) for i in range(2)))
    # 4 GPUs x 40 GiB hold 8 pods of 20 GiB; 12 arrive in two waves around a crash
    first = [gpu_pod(f"restart-a{i}-{RUN}", memory_gib=20) for i in range(6)]
    second = [gpu_pod(f"restart-b{i}-{RUN}", memory_gib=20) for i in range(6)]
    pods.extend(p["metadata"]["name"] for p in first + second)
    create_pods(core, namespace, first)
    time.sleep(0.5)
    extender.kill()  # mid-flight: some of the first wave may be half bound
    create_pods(core, namespace, second)  # pending while no extender answers
    time.sleep(2)
    extender.start()
    eventually(lambda: sum(1 for n in pods if node_of(core, namespace, n)) >= 8, 120,
               "8 of 12 pods bound after the restart")
    time.sleep(3)
    bound = [n for n in pods if node_of(core, namespace, n)]
    assert len(bound) == 8
    used = per_gpu_memory(core, namespace)
    assert max(used.values()) <= 40 * 1024
    for name in pods:  # none lost: each is bound or still pending, waiting to be scheduled
        pod = read_pod(core, namespace, name)
        assert pod["status"]["phase"] in ("Pending", "Running"), (name, pod["status"])


def call_extender(extender: ExtenderProcess, verb: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{extender.port}/{verb}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def test_cpu_requests_steer_pods_by_the_cpu_left_for_the_idle_gpus(
        namespace: str, extender: ExtenderProcess, nodes: Nodes) -> None:
    """The CPU-balance term in the live path: the pod's CPU request from its spec, the
    node's from its allocatable, the workload's CPU per GPU learned from the pods seen."""
    eight = simnodes.SimGpuGroup(model="A100", count=8)
    poor, rich = nodes.add(
        simnodes.SimNode(name=f"cpu-poor-{RUN}", gpus=(eight,), cpu_milli=24_000),
        simnodes.SimNode(name=f"cpu-rich-{RUN}", gpus=(eight,), cpu_milli=128_000))

    def pod(name: str, cpu: str) -> dict[str, Any]:
        manifest = gpu_pod(name, memory_gib=16, cores=100)
        manifest["metadata"].update(namespace=namespace, uid=f"uid-{name}")
        manifest["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu}
        return manifest

    # the scheduler asks about pods that bring 12 cores per GPU (they need not exist)
    for i in range(250):
        call_extender(extender, "filter", {"Pod": pod(f"learn-{i}-{RUN}", "12"),
                                           "NodeNames": [poor, rich]})

    def scores(cpu: str) -> dict[str, int]:
        result = call_extender(extender, "prioritize", {"Pod": pod(f"ask-{RUN}", cpu),
                                                        "NodeNames": [poor, rich]})
        return {entry["Host"]: entry["Score"] for entry in result}

    # (equal raw scores would come back as 10 and 9: prioritize names one favourite)
    eventually(lambda: scores("20") == {rich: 10, poor: 0}, 30,
               "a CPU-heavy pod to prefer the CPU-rich node")
    assert scores("1") == {poor: 10, rich: 0}  # light pods use the CPU-poor node's GPUs
