"""Fixtures for the end-to-end suite (`make e2e`): a real node in a local cluster of its own.

Session: the cluster `carpool-e2e` (real control plane; its kube-scheduler calls the extender on
port 18090, so it never collides with `make cluster` or the integration tests' cluster), CRDs,
the extender and the operator, then the real node (containerd, runc, kubelet v1.35.4 and the
Carpool device plugin; see carpool_testbed.realnode). Each test gets `pods`, which creates GPU
pods for the real node and deletes them afterwards, and `pod_resources`, a client of the kubelet's
pod-resources gRPC API compiled from e2e/podresources_v1.proto at the start of the session.

CARPOOL_KEEP_CLUSTER=1 keeps the cluster afterwards (the node is always stopped).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import grpc
import pytest

from carpool.core import names
from carpool_testbed import devcluster, realnode, stack
from carpool_testbed.waiting import wait_for

E2E_CLUSTER = "carpool-e2e"
E2E_EXTENDER_PORT = "18090"
os.environ.setdefault("CARPOOL_CLUSTER", E2E_CLUSTER)
os.environ.setdefault(devcluster.EXTENDER_PORT_ENV, E2E_EXTENDER_PORT)

TIMINGS = realnode.Timings(stream=sys.stderr)


# --------------------------------------------------------------------------------------------
# Session: cluster, Carpool, the real node


def _binaries() -> None:
    """Builds (once) or finds the binaries and sets CARPOOL_BIN_DIR for devcluster.

    `make e2e` has built them already; this runs the same script, reading its last line.
    """
    if os.environ.get("CARPOOL_BIN_DIR"):
        return
    script = devcluster.repo_root() / "hack" / "build-k8s.sh"
    built = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True,
                           check=False)
    lines = built.stdout.strip().splitlines()
    if built.returncode != 0 or not lines:
        raise RuntimeError(f"{script} failed (exit {built.returncode})")
    os.environ["CARPOOL_BIN_DIR"] = lines[-1]


def _start_cluster(keep: bool, attempts: int = 3) -> tuple[Any, devcluster.Cluster]:
    """shared_session, tried again when kwokctl's port choice loses a race.

    kwokctl picks free ports, then starts the components; a cluster another session creates at
    the same moment can take those ports first ("bind: address already in use").
    """
    for attempt in range(1, attempts + 1):
        session = devcluster.shared_session(keep=keep, progress=devcluster.Progress(sys.stderr))
        try:
            return session, session.__enter__()
        except devcluster.ClusterError as error:
            if "address already in use" not in str(error) or attempt == attempts:
                raise
            print(f"==> [e2e] cluster start lost a port race (attempt {attempt}); again",
                  file=sys.stderr)
            paths = devcluster.ClusterPaths.for_name()
            devcluster.delete(paths, devcluster.known_bin_dir(paths))
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[devcluster.Cluster]:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    keep = os.environ.get("CARPOOL_KEEP_CLUSTER") == "1"
    with capture.global_and_fixture_disabled():
        start = time.monotonic()
        _binaries()
        session, handle = _start_cluster(keep)
        TIMINGS.stages.append((f"cluster {handle.name} up (reused: {handle.reused})",
                               time.monotonic() - start))
    try:
        yield handle
    finally:
        with capture.global_and_fixture_disabled():
            session.__exit__(None, None, None)


class SessionStack:
    """The session's extender and operator; a test may run them with settings of its own for a
    while (`with_settings`), after which the defaults run again."""

    DEFAULTS: ClassVar[dict[str, str]] = {"CARPOOL_RESYNC_SECONDS": "2"}

    def __init__(self, cluster: devcluster.Cluster, log_dir: Path) -> None:
        self.cluster, self.log_dir = cluster, log_dir
        self._context: Any = None

    def start(self, env: dict[str, str], extender_args: tuple[str, ...] = ()) -> None:
        self._context = stack.running_stack(self.cluster, self.log_dir, env,
                                            extender_args=extender_args)
        self.processes = self._context.__enter__()

    def stop(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                print(f"{name} exited early:\n{stack.log_tail(self.log_dir / f'{name}.log')}")
        self._context.__exit__(None, None, None)

    @contextlib.contextmanager
    def with_settings(self, env: dict[str, str], extender_args: tuple[str, ...] = ()
                      ) -> Iterator[None]:
        self.stop()
        self.start({**self.DEFAULTS, **env}, extender_args)
        try:
            yield
        finally:
            self.stop()
            self.start(self.DEFAULTS)


@pytest.fixture(scope="session")
def session_stack(cluster: devcluster.Cluster, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[SessionStack]:
    """CRDs, the extender on the scheduler's port and one operator."""
    running = SessionStack(cluster, Path(tmp_path_factory.mktemp("carpool-logs")))
    with TIMINGS.stage("CRDs, Carpool extender and operator"):
        running.start(SessionStack.DEFAULTS)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def carpool_stack(session_stack: SessionStack) -> Path:
    """The session stack's log folder (operator.log, extender.log)."""
    return session_stack.log_dir


@pytest.fixture(scope="session")
def real_node(request: pytest.FixtureRequest, cluster: devcluster.Cluster,
              carpool_stack: Path) -> Iterator[realnode.RealNode]:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        context = realnode.running_node(cluster, timings=TIMINGS)
        node = context.__enter__()
    try:
        yield node
    finally:
        with capture.global_and_fixture_disabled():
            context.__exit__(None, None, None)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS.stages:
        terminalreporter.section("real node: stage timings")
        terminalreporter.write_line(TIMINGS.table())


# --------------------------------------------------------------------------------------------
# GPU pods on the real node


class Pods:
    """Creates pods for the real node through the Carpool scheduler and reads them back."""

    wait_for = staticmethod(wait_for)

    def __init__(self, node: realnode.RealNode, namespace: str = "default") -> None:
        self.node = node
        self.namespace = namespace
        self.created: list[tuple[str, str]] = []
        self.created_at: dict[str, float] = {}
        self.timings = TIMINGS

    def manifest(self, name: str, gpus: int, memory_gib: int = 0, cores: int = 0,
                 isolation: str = "mps", script: str = "",
                 image: str = realnode.TEST_IMAGE) -> dict[str, Any]:
        """A pod that prints its GPU environment, marks the end with DONE, then sleeps; with
        `gpus` 0 it asks Carpool for nothing."""
        limits = {names.RESOURCE_GPU: str(gpus)} if gpus else {}
        if memory_gib:
            limits[names.RESOURCE_GPU_MEMORY] = str(memory_gib)
        if cores:
            limits[names.RESOURCE_GPU_CORES] = str(cores)
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace,
                         "annotations": {names.ANN_ISOLATION: isolation}},
            "spec": real_node_pod_spec(self.node, limits, script or SLEEP_AFTER_ENV, image),
        }

    def create(self, manifest: dict[str, Any]) -> str:
        meta = manifest["metadata"]
        self.node.kubectl("create", "-f", "-", "-o", "name", stdin=json.dumps(manifest))
        self.created.append((meta.get("namespace", self.namespace), meta["name"]))
        self.created_at[meta["name"]] = time.monotonic()
        return str(meta["name"])

    def get(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        out = self.node.kubectl("get", "pod", name, "-n", namespace or self.namespace,
                                "-o", "json").stdout
        return dict(json.loads(out))

    def wait_printed(self, name: str, namespace: str | None = None,
                     timeout: float = 90) -> dict[str, str]:
        """Waits until the container has printed its environment; returns it as a dict."""
        def printed() -> dict[str, str] | None:
            done = self.node.kubectl("logs", name, "-n", namespace or self.namespace,
                                     check=False)
            if done.returncode != 0 or "DONE" not in done.stdout.split():
                phase = (self.get(name, namespace).get("status") or {}).get("phase")
                if phase == "Failed":
                    raise AssertionError(f"pod {name} failed: {self.describe(name, namespace)}")
                return None
            lines = done.stdout.split("DONE")[0].split()
            return dict(line.split("=", 1) for line in lines if "=" in line)

        try:
            env = wait_for(f"pod {name} to print its environment", printed, timeout)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.describe(name, namespace)}") from None
        if name in self.created_at:
            TIMINGS.stages.append((f"pod {name}: created → env printed (poll 0.5 s)",
                                   time.monotonic() - self.created_at.pop(name)))
        return env

    def describe(self, name: str, namespace: str | None = None) -> str:
        return self.node.kubectl("describe", "pod", name, "-n", namespace or self.namespace,
                                 check=False).stdout[-3000:]

    def events(self, name: str, namespace: str | None = None) -> list[dict[str, Any]]:
        out = self.node.kubectl("get", "events", "-n", namespace or self.namespace,
                                "--field-selector", f"involvedObject.name={name}",
                                "-o", "json").stdout
        return list(json.loads(out)["items"])

    def delete_all(self) -> None:
        for namespace, name in self.created:
            self.node.kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found",
                              "--wait=false", check=False)
        for namespace, name in self.created:
            self.node.kubectl("wait", "--for=delete", f"pod/{name}", "-n", namespace,
                              "--timeout=60s", check=False, timeout=90)
        self.created.clear()


# Prints the CUDA_*/NVIDIA_*/CARPOOL_* environment, the NVIDIA device nodes the runtime put in
# /dev, whether the MPS pipe mount is there and the container's cgroup (the kubelet's per-pod
# cgroup when cgroups work), then sleeps (exit 0 on SIGTERM: pod deletion is quick).
SLEEP_AFTER_ENV = (
    "env | grep -E '^(CUDA|NVIDIA|CARPOOL)_' | sort; " + realnode.PRINT_DEVICE_NODES +
    "if [ -d \"$CUDA_MPS_PIPE_DIRECTORY\" ]; then echo MPS_PIPE_MOUNTED=yes; fi; "
    "echo POD_CGROUP=$(grep -m1 kubepods /proc/self/cgroup | cut -d: -f3); "
    "echo DONE; trap 'exit 0' TERM; sleep 3600 & wait"
)


def real_node_pod_spec(node: realnode.RealNode, limits: dict[str, str],
                       script: str, image: str = realnode.TEST_IMAGE) -> dict[str, Any]:
    """Scheduled by Carpool onto the real node (it carries a taint nothing else tolerates)."""
    taint = realnode.REAL_NODE_TAINT
    return {
        "schedulerName": names.SCHEDULER_NAME,
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "tolerations": [{"key": taint["key"], "operator": "Exists", "effect": taint["effect"]}],
        "restartPolicy": "Never",
        "dnsPolicy": "Default",  # no cluster DNS here
        "terminationGracePeriodSeconds": 5,
        "containers": [{
            "name": "main",
            "image": image,
            "imagePullPolicy": "Never",  # built locally; no registry to pull from
            "command": ["/bin/sh", "-c", script],
            "resources": {"limits": limits},
        }],
    }


@pytest.fixture
def pods(real_node: realnode.RealNode) -> Iterator[Pods]:
    helper = Pods(real_node)
    try:
        yield helper
    finally:
        helper.delete_all()


# --------------------------------------------------------------------------------------------
# The kubelet's pod-resources API


def compile_proto(proto: Path, into: Path) -> ModuleType:
    """protoc (grpcio-tools) on `proto`; returns the generated message module."""
    from grpc_tools import protoc  # dev dependency

    code = protoc.main(["grpc_tools.protoc", f"-I{proto.parent}", f"--python_out={into}",
                        str(proto)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto} (exit {code})")
    generated = into / f"{proto.stem}_pb2.py"
    spec = importlib.util.spec_from_file_location(f"e2e_{proto.stem}_pb2", generated)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PodResourcesClient:
    """`v1.PodResourcesLister` over the kubelet's unix socket (unary calls, no stubs needed)."""

    def __init__(self, socket_path: Path, messages: ModuleType) -> None:
        self.socket_path = socket_path
        self.messages = messages

    def _call(self, method: str, request: Any, response_type: Any) -> Any:
        with grpc.insecure_channel(f"unix://{self.socket_path}") as channel:
            call = channel.unary_unary(
                f"/v1.PodResourcesLister/{method}",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=response_type.FromString,
            )
            return call(request, timeout=10)

    def devices(self) -> dict[tuple[str, str, str], dict[str, list[str]]]:
        """{(namespace, pod, container): {resource name: device IDs}} from List."""
        m = self.messages
        response = self._call("List", m.ListPodResourcesRequest(), m.ListPodResourcesResponse)
        table: dict[tuple[str, str, str], dict[str, list[str]]] = {}
        for pod in response.pod_resources:
            for container in pod.containers:
                table[(pod.namespace, pod.name, container.name)] = {
                    d.resource_name: list(d.device_ids) for d in container.devices}
        return table

    def allocatable(self) -> dict[str, list[str]]:
        """{resource name: device IDs} the kubelet can hand out (GetAllocatableResources)."""
        m = self.messages
        response = self._call("GetAllocatableResources", m.AllocatableResourcesRequest(),
                              m.AllocatableResourcesResponse)
        table: dict[str, list[str]] = {}
        for device in response.devices:
            table.setdefault(device.resource_name, []).extend(device.device_ids)
        return table


@pytest.fixture(scope="session")
def pod_resources(real_node: realnode.RealNode) -> Iterator[PodResourcesClient]:
    with tempfile.TemporaryDirectory(prefix="carpool-podresources-") as tmp:
        messages = compile_proto(Path(__file__).with_name("podresources_v1.proto"), Path(tmp))
        yield PodResourcesClient(real_node.paths.pod_resources_socket, messages)


