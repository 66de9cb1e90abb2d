"""Bad input against the running processes: the extender over real HTTP, the device plugin over
its real unix socket, and pods carrying malformed or oversized `carpool.dev/assignment`.

The unit suites fuzz the extender's app and the plugin's handlers in-process
(tests/unit/extender/test_extender_http.py, test_deviceplugin_kubelet_protocol.py); here the real
`python -m carpool.extender` and `python -m carpool.deviceplugin` processes, fed by the real API
server, take the abuse: every answer is a 2xx/4xx (HTTP) or a deliberate gRPC status, never a
500, an UNKNOWN/INTERNAL status or a dead process, and both still do their job afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core import names
from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool_testbed import crds, devcluster, stack
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster

EXAMPLES = int(os.environ.get("CARPOOL_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])
DELIBERATE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
SHARES = 4




@dataclass(frozen=True)
class World:
    namespace: str
    node: str  # a node name no kubelet runs: pods bound there stay Pending (in flight)
    gpus: tuple[str, ...]
    extender_port: int
    plugin_socket: Path
    extender: subprocess.Popen[bytes]
    plugin: subprocess.Popen[bytes]
    logs: Path


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    """Just enough kubelet for the plugin to serve: it accepts every registration."""

    def Register(self, request: api_pb2.RegisterRequest, context: Any) -> api_pb2.Empty:
        return api_pb2.Empty()


@pytest.fixture(scope="module")
def world(cluster: devcluster.Cluster, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[World]:
    api = cluster.api()
    crds.apply_crds(api)
    tag = f"fzc{uuid.uuid4().hex[:6]}"
    node = f"{tag}-node"
    client.CoreV1Api(api).create_namespace(client.V1Namespace(
        metadata=client.V1ObjectMeta(name=tag)))
    logs = Path(tmp_path_factory.mktemp("fuzz-components"))
    plugin_dir = Path(f"/tmp/{tag}")  # short: unix socket paths are limited to 107 bytes
    plugin_dir.mkdir()
    spec = {"node": node, "gpus": [{"model": "H200", "count": 2}]}
    (logs / "node.yaml").write_text(yaml.safe_dump(spec))
    gpus = tuple(g.uuid for g in FakeBackend.from_spec(spec).inventory())
    kubelet = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
        FakeKubelet(), kubelet)
    kubelet.add_insecure_port(f"unix://{plugin_dir / 'kubelet.sock'}")
    kubelet.start()
    port = stack.free_port()
    extender = devcluster.start_extender(cluster.kubeconfig, port, logs / "extender.log",
                                         ["--host", "127.0.0.1"], timeout=60)
    with (logs / "plugin.log").open("wb") as out:
        plugin = subprocess.Popen(
            [sys.executable, "-m", "carpool.deviceplugin", "--node-name", node,
             "--backend", "fake", "--fake-spec", str(logs / "node.yaml"),
             "--plugin-dir", str(plugin_dir), "--shares-per-gpu", str(SHARES),
             "--sharing-mode", "mps", "--no-manage-mps", "--metrics-port", "0",
             "--publish-interval", "5", "--kubeconfig", str(cluster.kubeconfig),
             "--allow-unowned-pods"],  # the fuzzed pods are bare, as the extender's are
            stdout=out, stderr=subprocess.STDOUT)
    socket_path = plugin_dir / "carpool-gpu.sock"
    try:
        wait_for("the plugin socket", socket_path.exists)
        wait_for("the extender to sync", lambda: http_get(port, "/healthz") == 200)
        yield World(tag, node, gpus, port, socket_path, extender, plugin, logs)
    finally:
        devcluster.stop_process(extender)
        devcluster.stop_process(plugin)
        kubelet.stop(0)
        client.CoreV1Api(api).delete_namespace(tag)
        with contextlib.suppress(ApiException):
            client.CustomObjectsApi(api).delete_cluster_custom_object(
                names.GROUP, names.VERSION, names.GPUNODE_PLURAL, node)
        for leftover in plugin_dir.iterdir():
            leftover.unlink()
        plugin_dir.rmdir()


def http_get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return 0


def http_post(port: int, path: str, body: bytes,
              headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def assert_alive(w: World) -> None:
    for name, process in (("extender", w.extender), ("device plugin", w.plugin)):
        log = w.logs / ("extender.log" if name == "extender" else "plugin.log")
        assert process.poll() is None, f"the {name} died:\n{log.read_text()[-3000:]}"


def pod_manifest(name: str, gpu_count: str = "1") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
            "spec": {"schedulerName": names.SCHEDULER_NAME, "containers": [
                {"name": "main", "resources": {"limits": {names.RESOURCE_GPU: gpu_count}}}]}}


# --- the extender over HTTP -------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4), max_leaves=15)


def extender_bodies(node: str) -> st.SearchStrategy[Any]:
    pod = st.fixed_dictionaries({}, optional={
        "metadata": st.fixed_dictionaries({}, optional={
            "name": st.text(max_size=6) | JSON, "namespace": st.just("default") | JSON,
            "uid": st.uuids().map(str) | JSON,
            "annotations": st.dictionaries(st.sampled_from(
                [names.ANN_ASSIGNMENT, names.ANN_ISOLATION, names.ANN_MODELS,
                 names.ANN_DATASET_SIZE, names.ANN_POLICY]), st.text(max_size=30) | JSON)}),
        "spec": st.fixed_dictionaries({}, optional={"containers": st.lists(
            st.fixed_dictionaries({"name": st.just("c")}, optional={
                "resources": st.fixed_dictionaries({}, optional={"limits": st.dictionaries(
                    st.sampled_from([names.RESOURCE_GPU, names.RESOURCE_GPU_MEMORY,
                                     names.RESOURCE_GPU_CORES]),
                    st.sampled_from(["1", "2", "0", "-1", "1.5", "1e3", "x", "99999999999"])
                    | JSON)})}), max_size=3) | JSON})})
    node_names = st.lists(st.sampled_from([node, "nope", "", "a" * 300]), max_size=4)
    return st.one_of(
        JSON,
        st.fixed_dictionaries({"Pod": pod}, optional={"NodeNames": node_names | JSON,
                                                      "Nodes": JSON}),
        st.fixed_dictionaries({}, optional={"PodName": st.text(max_size=8) | JSON,
                                            "PodNamespace": st.just("default") | JSON,
                                            "PodUID": JSON, "Node": st.just(node) | JSON}))


def test_extender_process_survives_fuzzed_http(world: World) -> None:
    statuses: dict[int, int] = {}

    @FUZZ
    @given(body=extender_bodies(world.node), path=st.sampled_from(
        ["/filter", "/prioritize", "/bind"]))
    def one(body: Any, path: str) -> None:
        status, answer = http_post(world.extender_port, path, json.dumps(body).encode())
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 404, 409, 413), (status, answer[:300], body)
        if status == 400:
            assert json.loads(answer).get("Error"), answer

    one()
    assert set(statuses) >= {400}, statuses
    # Protocol-level abuse on the same process.
    raw_payloads = [b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + os.urandom(64),  # TLS hello
                    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * 70000 + b"\r\n\r\n",
                    b"POST /filter HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n{",
                    b"POST /filter HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                    b"BREW /filter HTCPCP/1.0\r\n\r\n", os.urandom(4096), b"\r\n" * 5000]
    for payload in raw_payloads:
        with (socket.create_connection(("127.0.0.1", world.extender_port), timeout=5) as conn,
              contextlib.suppress(OSError)):
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            reply = conn.recv(200)
            assert not reply.startswith(b"HTTP/1.1 5"), (payload[:40], reply)
    status, _ = http_post(world.extender_port, "/filter", b"{}", {"Content-Type": "text/plain"})
    assert status == 400
    assert_alive(world)
    assert http_get(world.extender_port, "/healthz") == 200
    status, answer = http_post(world.extender_port, "/filter", json.dumps(
        {"Pod": pod_manifest("after-fuzz"), "NodeNames": [world.node]}).encode())
    assert status == 200 and "FailedNodes" in json.loads(answer), answer
    print(f"\nextender HTTP fuzz: {EXAMPLES} bodies {statuses}, {len(raw_payloads) + 2} raw")


def test_extender_refuses_deeply_nested_json(world: World) -> None:
    deep = b'{"Pod": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # under the 1 MiB body limit
    status, answer = http_post(world.extender_port, "/filter", deep)
    assert_alive(world)
    assert status == 400, (status, answer[:200])


# --- the device plugin over its unix socket ---------------------------------------------------


def share_ids(gpus: tuple[str, ...]) -> st.SearchStrategy[list[str]]:
    real = st.sampled_from([f"{g}::{n}" for g in gpus for n in range(SHARES)])
    odd = st.sampled_from(["", "::", "GPU-x::0", f"{gpus[0]}::99", f"{gpus[0]}::-1",
                           f"{gpus[0]}", f"{gpus[0]}::0::0", "a" * 5000, "\x00", "ü::1"])
    return st.lists(real | odd | st.text(max_size=12), max_size=12)


def test_device_plugin_process_survives_fuzzed_grpc(world: World) -> None:
    codes: dict[str, int] = {}

    async def call(stub: api_pb2_grpc.DevicePluginStub, kind: str, ids: list[str],
                   size: int) -> None:
        try:
            if kind == "allocate":
                await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
            elif kind == "preferred":
                await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
                    container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=ids, must_include_deviceIDs=ids[:1],
                        allocation_size=size)]), timeout=10)
            elif kind == "prestart":
                await stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=ids),
                                             timeout=10)
            else:
                await stub.Allocate(api_pb2.AllocateRequest(container_requests=[]), timeout=10)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.aio.AioRpcError as err:
            codes[err.code().name] = codes.get(err.code().name, 0) + 1
            assert err.code() in DELIBERATE, (err.code(), err.details(), kind, ids, size)
            assert err.details(), (kind, ids)

    @FUZZ
    @given(kind=st.sampled_from(["allocate", "preferred", "prestart", "empty"]),
           ids=share_ids(world.gpus), size=st.integers(-3, 20))
    def one(kind: str, ids: list[str], size: int) -> None:
        async def go() -> None:
            async with grpc.aio.insecure_channel(f"unix://{world.plugin_socket}") as channel:
                stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
                await call(stub, kind, ids, size)
        asyncio.run(go())

    one()
    # Not gRPC at all, on the same socket.
    for payload in (os.urandom(2048), b"GET / HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                    + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" * 100):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(str(world.plugin_socket))
            with contextlib.suppress(OSError):
                conn.sendall(payload)
                conn.recv(100)
    assert_alive(world)
    assert set(codes) - {"OK"}, codes  # errors were provoked, not just OKs
    print(f"\ndevice plugin gRPC fuzz: {EXAMPLES} requests {codes}, 3 raw payloads")


# --- malformed and oversized assignment annotations -------------------------------------------

BAD_ASSIGNMENTS = {
    "not-json": "{gpus: [",
    "a-list": "[1, 2, 3]",
    "gpus-not-list": json.dumps({"node": "x", "gpus": "GPU-1"}),
    "uuid-int": json.dumps({"node": "{node}", "gpus": [{"uuid": 7, "index": 0}]}),
    "negative-memory": json.dumps({"node": "{node}", "gpus": [
        {"uuid": "{gpu0}", "index": 0, "memoryMiB": -4096, "cores": -5}]}),
    "huge-numbers": json.dumps({"node": "{node}", "gpus": [
        {"uuid": "{gpu0}", "index": 10**30, "memoryMiB": 10**30, "cores": 10**30}]}),
    "unknown-gpu": json.dumps({"node": "{node}", "gpus": [
        {"uuid": "GPU-does-not-exist", "index": 0, "memoryMiB": 1024, "cores": 10}]}),
    "other-node": json.dumps({"node": "elsewhere", "gpus": [
        {"uuid": "{gpu0}", "index": 0, "memoryMiB": 1024, "cores": 10}]}),
    "oversized": json.dumps({"node": "{node}", "gpus": [
        {"uuid": "{gpu0}", "index": 0, "memoryMiB": 1024, "cores": 10, "pad": "x" * 200_000}]}),
    "empty": "",
    "null": "null",
}


async def allocate(world: World, ids: list[str]) -> tuple[str, dict[str, str]]:
    """Allocate as the kubelet does; a refusal must be a deliberate status (returned by name)."""
    async with grpc.aio.insecure_channel(f"unix://{world.plugin_socket}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        try:
            answer = await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=ids)]), timeout=15)
        except grpc.aio.AioRpcError as err:
            assert "RecursionError" not in (err.details() or ""), err.details()
            assert err.code() in DELIBERATE, (err.code(), err.details())
            return err.code().name, {}
        return "OK", dict(answer.container_responses[0].envs)


def bound_pod(name: str, node: str, assignment: str, gpu_count: str = "1") -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {
                names.ANN_ASSIGNMENT: assignment, names.ANN_ASSIGNED_AT: stamp,
                names.ANN_ISOLATION: "mps"}},
            "spec": {"nodeName": node, "schedulerName": names.SCHEDULER_NAME, "containers": [
                {"name": "main", "image": "example.invalid/x",
                 "resources": {"limits": {names.RESOURCE_GPU: gpu_count}}}]}}


def test_bad_assignment_annotations_crash_neither_component(
        world: World, cluster: devcluster.Cluster) -> None:
    """Pods in flight on the plugin's node with broken assignments, next to one good pod on the
    other GPU: the extender's cache takes them all in, the plugin hands the good pod its GPU and
    refuses the rest with a deliberate status."""
    core = client.CoreV1Api(cluster.api())
    gpu0, gpu1 = world.gpus
    created = []
    for name, text in BAD_ASSIGNMENTS.items():
        body = bound_pod(f"bad-{name}", world.node,
                         text.replace("{node}", world.node).replace("{gpu0}", gpu0))
        try:
            core.create_namespaced_pod(world.namespace, body)
            created.append(name)
        except ApiException as err:  # the API server's own limit (256 KiB of annotations)
            assert err.status == 422 and "must have at most" in (err.body or ""), err.body
    too_big = bound_pod("bad-too-big", world.node, "x" * 300_000)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(world.namespace, too_big)
    assert refused.value.status == 422
    good = json.dumps({"node": world.node, "gpus": [
        {"uuid": gpu1, "index": 1, "memoryMiB": 8192, "cores": 25}]})
    core.create_namespaced_pod(world.namespace, bound_pod("good", world.node, good))
    time.sleep(3)  # both watch streams deliver them

    assert_alive(world)
    assert http_get(world.extender_port, "/healthz") == 200
    status, answer = http_post(world.extender_port, "/filter", json.dumps(
        {"Pod": pod_manifest("after-bad-annotations"), "NodeNames": [world.node]}).encode())
    assert status == 200, answer

    code, envs = asyncio.run(allocate(world, [f"{gpu1}::0"]))
    assert code == "OK", code
    assert envs["CUDA_VISIBLE_DEVICES"] == gpu1
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G"
    marked = core.read_namespaced_pod("good", world.namespace).metadata.annotations
    assert names.ANN_ALLOCATED in marked
    # The broken ones on GPU 0: whatever the plugin decides, it is a deliberate answer.
    answers = [asyncio.run(allocate(world, [f"{gpu0}::{n}"])) for n in range(2)]
    outcomes = [code for code, _ in answers]
    served = {name: json.loads(annotations[names.ANN_ALLOCATED])
              for name, annotations in (
                  (p.metadata.name, p.metadata.annotations or {})
                  for p in core.list_namespaced_pod(world.namespace).items)
              if names.ANN_ALLOCATED in annotations}
    print(f"\nserved: {sorted(served)}; answers {answers}")
    assert_alive(world)
    print(f"\nbad annotations: {len(created)} stored ({created}); 1 refused by the API server; "
          f"good pod allocated; GPU-0 allocations: {outcomes}")


@pytest.mark.parametrize("case", ["unknown-gpu", "more-memory-than-the-gpu"])
def test_plugin_refuses_assignments_it_cannot_honour(world: World, cluster: devcluster.Cluster,
                                                     case: str) -> None:
    """The only pod in flight asks for something this node cannot give: Allocate must refuse
    it (a deliberate status), not start a container on a GPU that is not there or with an MPS
    limit far beyond the GPU."""
    core = client.CoreV1Api(cluster.api())
    core.delete_collection_namespaced_pod(world.namespace, grace_period_seconds=0)
    wait_for("an empty namespace", lambda: not core.list_namespaced_pod(world.namespace).items)
    gpu0, _ = world.gpus
    grant = ({"uuid": "GPU-does-not-exist", "index": 0, "memoryMiB": 1024, "cores": 10}
             if case == "unknown-gpu" else
             {"uuid": gpu0, "index": 0, "memoryMiB": 10**7, "cores": 10})
    core.create_namespaced_pod(world.namespace, bound_pod(
        f"cannot-{case}", world.node, json.dumps({"node": world.node, "gpus": [grant]})))
    time.sleep(2)
    code, envs = asyncio.run(allocate(world, [f"{gpu0}::1"]))
    core.delete_namespaced_pod(f"cannot-{case}", world.namespace, grace_period_seconds=0)
    assert_alive(world)
    assert code != "OK", envs


def test_deeply_nested_assignment_does_not_block_the_node(
        world: World, cluster: devcluster.Cluster) -> None:
    """Runs last: one pod whose assignment is 5,000 nested brackets, next to a good pod."""
    core = client.CoreV1Api(cluster.api())
    gpu0, _ = world.gpus
    core.create_namespaced_pod(world.namespace,
                               bound_pod("bad-deep", world.node, "[" * 5000 + "]" * 5000))
    good = json.dumps({"node": world.node, "gpus": [
        {"uuid": gpu0, "index": 0, "memoryMiB": 4096, "cores": 10}]})
    core.create_namespaced_pod(world.namespace, bound_pod("good-2", world.node, good))
    time.sleep(3)
    assert_alive(world)
    assert http_get(world.extender_port, "/healthz") == 200  # the extender's cache copes
    status, _ = http_post(world.extender_port, "/filter", json.dumps(
        {"Pod": pod_manifest("after-deep"), "NodeNames": [world.node]}).encode())
    assert status == 200
    code, envs = asyncio.run(allocate(world, [f"{gpu0}::3"]))
    assert code == "OK" and envs["CUDA_VISIBLE_DEVICES"] == gpu0, code
