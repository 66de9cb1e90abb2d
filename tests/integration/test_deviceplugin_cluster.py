"""The device plugin against the real API server: the handshake end to end, GpuNode status and
Events.

A pod bound (spec.nodeName) to a node no kubelet runs stays Pending, which is exactly the
in-flight state the plugin looks for; the plugin's gRPC server is driven the way the kubelet
drives it, over its unix socket.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.names import (
    ANN_ALLOCATED,
    ANN_ASSIGNED_AT,
    ANN_ASSIGNMENT,
    ANN_ISOLATION,
    GPUNODE_PLURAL,
    GROUP,
    RESOURCE_GPU,
    SCHEDULER_NAME,
    VERSION,
)
from carpool.deviceplugin.agent import Telemetry
from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool.deviceplugin.kube import KubernetesCluster
from carpool.deviceplugin.plugin import PluginConfig, PluginServer, PluginState
from carpool_testbed import crds

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def api(cluster: Any) -> Iterator[client.ApiClient]:
    api_client = cluster.api()
    crds.apply_crds(api_client)
    yield api_client
    api_client.close()


@pytest.fixture
def names(api: client.ApiClient) -> Iterator[tuple[str, str]]:
    """A fresh namespace and node name; both (and the GpuNode) are removed afterwards."""
    tag = f"dp{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=tag)))
    yield tag, f"{tag}-node"
    core.delete_namespace(tag)
    try:
        client.CustomObjectsApi(api).delete_cluster_custom_object(GROUP, VERSION, GPUNODE_PLURAL,
                                                                  f"{tag}-node")
    except ApiException as err:
        if err.status != 404:
            raise


def gpujob(api: client.ApiClient, namespace: str) -> client.V1OwnerReference:
    """A GpuJob (no operator runs here, so it only waits) to own the test's pod: the plugin
    serves only the pods of GpuJobs."""
    job = client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, "gpujobs",
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuJob", "metadata": {"name": "train"},
         "spec": {"project": "none", "gpu": {"count": 1, "memory": "6Gi"},
                  "template": {"spec": {"containers": [{"name": "main", "image": "x"}]}}}})
    return client.V1OwnerReference(api_version=f"{GROUP}/{VERSION}", kind="GpuJob",
                                   name="train", uid=job["metadata"]["uid"], controller=True)


def bound_pod(namespace: str, node: str, gpu_uuid: str,
              owner: client.V1OwnerReference | None = None) -> client.V1Pod:
    assignment = {"node": node, "gpus": [{"uuid": gpu_uuid, "index": 1, "memoryMiB": 6144,
                                          "cores": 30}]}
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="train", namespace=namespace,
                                     owner_references=[owner] if owner else None,
                                     annotations={
            ANN_ASSIGNMENT: json.dumps(assignment),
            ANN_ASSIGNED_AT: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            ANN_ISOLATION: "mps",
        }),
        spec=client.V1PodSpec(node_name=node, scheduler_name=SCHEDULER_NAME,
                              containers=[client.V1Container(
            name="main", image="example.invalid/train:1",
            resources=client.V1ResourceRequirements(limits={RESOURCE_GPU: "1"}))]),
    )


def test_allocate_finds_the_bound_pod_marks_it_and_publishes_status(
        api: client.ApiClient, names: tuple[str, str]) -> None:
    namespace, node = names
    backend = FakeBackend.from_spec({"node": node, "gpus": [{"model": "A100", "count": 2}]})
    gpu1 = backend.inventory()[1].uuid
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, bound_pod(namespace, node, gpu1,
                                                    gpujob(api, namespace)))
    cluster = KubernetesCluster(api, node)
    plugin_dir = Path(tempfile.mkdtemp(prefix="cpi-", dir="/tmp"))

    async def scenario() -> dict[str, str]:
        state = PluginState(PluginConfig(node, "mps", shares_per_gpu=4), backend, cluster)
        server = PluginServer(state, plugin_dir)
        await server.serve()
        try:
            async with grpc.aio.insecure_channel(f"unix://{server.socket}") as channel:
                stub = api_pb2_grpc.DevicePluginStub(channel)
                available = [f"{g.uuid}::{n}" for g in backend.inventory() for n in range(4)]
                preferred = await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
                    container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available, allocation_size=1)]))
                chosen = list(preferred.container_responses[0].deviceIDs)
                assert chosen == [f"{gpu1}::0"]
                answer = await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=chosen)]))
                with pytest.raises(grpc.aio.AioRpcError) as err:  # nobody left in flight
                    await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                        api_pb2.ContainerAllocateRequest(devices_ids=[f"{gpu1}::1"])]))
                assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert await Telemetry(state, cluster).step()
            [view] = await cluster.pods_on_node(node)
            await cluster.pod_event(view, "GpuMemoryOverGrant", "test event", warning=True)
            return dict(answer.container_responses[0].envs)
        finally:
            await server.close()

    try:
        envs = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        shutil.rmtree(plugin_dir, ignore_errors=True)
    assert envs["CUDA_VISIBLE_DEVICES"] == gpu1
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6G"
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"

    marked = core.read_namespaced_pod("train", namespace).metadata.annotations[ANN_ALLOCATED]
    assert json.loads(marked)["containers"]["main"]["gpus"] == [gpu1]

    gpunode = client.CustomObjectsApi(api).get_cluster_custom_object(
        GROUP, VERSION, GPUNODE_PLURAL, node)
    status = gpunode["status"]
    assert [g["uuid"] for g in status["gpus"]] == [g.uuid for g in backend.inventory()]
    assert status["sharesPerGpu"] == 4 and status["sharingMode"] == "mps"
    inventory = inventory_from_gpunode(node, status, {}, now=datetime.now(UTC))
    assert inventory.ready and [g.model for g in inventory.gpus] == ["A100", "A100"]

    deadline = time.monotonic() + 10
    while True:
        events = core.list_namespaced_event(namespace,
                                            field_selector="involvedObject.name=train").items
        if events or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(e.reason, e.type, e.reporting_component) for e in events] == [
        ("GpuMemoryOverGrant", "Warning", "carpool.dev/device-plugin")]
