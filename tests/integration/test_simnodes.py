"""Simulated GPU nodes on the real API server: Nodes KWOK runs, GpuNodes the extender reads.

Every node made here gets a per-run name prefix so it cannot collide with other tests' nodes
on the shared cluster, and is deleted at the end.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.names import GPUNODE_PLURAL, GROUP, LABEL_ZONE, RESOURCE_GPU, VERSION
from carpool_testbed import __main__ as cli
from carpool_testbed import crds, simnodes, traces

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "nodes.yaml"
NOW = datetime(2026, 11, 29, 19, 0, tzinfo=UTC)


def openb_node_list() -> Path:
    path = traces.node_list()
    assert path.is_file(), f"openb node list not found at {path}"
    return path


@pytest.fixture(scope="module")
def api(cluster: Any) -> Iterator[client.ApiClient]:
    api_client = cluster.api()
    crds.apply_crds(api_client)
    yield api_client
    api_client.close()


@pytest.fixture
def prefix(api: client.ApiClient) -> Iterator[str]:
    """A unique name prefix; every node carrying it is deleted afterwards."""
    tag = f"t{uuid.uuid4().hex[:6]}"
    yield tag
    names = [n for n in simnodes.simulated_node_names(api) if n.startswith(f"{tag}-")]
    simnodes.delete_nodes(api, names)


def renamed(nodes: Sequence[simnodes.SimNode], prefix: str) -> list[simnodes.SimNode]:
    return [dataclasses.replace(n, name=f"{prefix}-{n.name}") for n in nodes]


def gpunode(api: client.ApiClient, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(api).get_cluster_custom_object(
        GROUP, VERSION, GPUNODE_PLURAL, name)
    return obj


def wait_ready(api: client.ApiClient, names: Sequence[str], timeout_s: float = 90) -> None:
    """KWOK manages the nodes: it reports them Ready as a kubelet would."""
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout_s
    waiting = set(names)
    while waiting and time.monotonic() < deadline:
        for name in sorted(waiting):
            conditions = core.read_node(name).status.conditions or []
            if any(c.type == "Ready" and c.status == "True" for c in conditions):
                waiting.discard(name)
        time.sleep(0.5)
    assert not waiting, (f"KWOK never marked {len(waiting)} of {len(names)} nodes Ready, "
                         f"e.g. {sorted(waiting)[:3]}")


def test_nodes_from_yaml_become_ready_kwok_nodes_with_gpunodes(
    api: client.ApiClient, prefix: str
) -> None:
    nodes = renamed(simnodes.load_nodes_yaml(EXAMPLE), prefix)
    simnodes.apply_nodes(api, nodes, NOW)
    core = client.CoreV1Api(api)
    for node in nodes:
        live = core.read_node(node.name)
        assert live.metadata.annotations[simnodes.KWOK_NODE_ANNOTATION] == "fake"
        assert live.metadata.labels[LABEL_ZONE] == node.zone
        assert live.metadata.labels[simnodes.LABEL_GPU_MODEL] == node.gpus[0].model
        assert live.status.capacity == live.status.allocatable
        assert live.status.allocatable[RESOURCE_GPU] == str(simnodes.advertised_shares(node))

        published = gpunode(api, node.name)
        assert published["metadata"]["ownerReferences"][0]["uid"] == live.metadata.uid
        status = published["status"]
        assert status == simnodes.gpunode_status(node, NOW)  # nothing pruned or altered
        inventory = inventory_from_gpunode(node.name, status, live.metadata.labels,
                                           now=NOW + timedelta(seconds=5))
        assert inventory.ready and len(inventory.gpus) == node.gpu_count
    hot = gpunode(api, f"{prefix}-h200-a")["status"]["gpus"]
    assert [g["temperatureC"] for g in hot] == [41.0, 41.0, 41.0, 84.0]
    wait_ready(api, [n.name for n in nodes])


def test_applying_again_updates_in_place(api: client.ApiClient, prefix: str) -> None:
    nodes = renamed(simnodes.load_nodes_yaml(EXAMPLE), prefix)
    tainted = [dataclasses.replace(n, taints=(simnodes.Taint("maintenance"),)) for n in nodes]
    simnodes.apply_nodes(api, tainted, NOW)
    core = client.CoreV1Api(api)
    assert core.read_node(f"{prefix}-a100-0").spec.taints[0].key == "maintenance"
    changed = [dataclasses.replace(n, datasets=("laion",)) if n.name.endswith("a100-0") else n
               for n in nodes]
    later = NOW + timedelta(minutes=5)
    simnodes.apply_nodes(api, changed, later)
    assert not core.read_node(f"{prefix}-a100-0").spec.taints  # what the file dropped goes
    mine = [n for n in simnodes.simulated_node_names(api) if n.startswith(f"{prefix}-")]
    assert sorted(mine) == sorted(n.name for n in nodes)
    status = gpunode(api, f"{prefix}-a100-0")["status"]
    assert status["datasets"] == ["laion"]
    assert status["heartbeat"] == "2026-11-29T19:05:00Z"

    # an existing Node's resources change through /status (its main endpoint ignores status)
    grown = [dataclasses.replace(n, extra_resources=(("nvidia.com/gpu", "4"),)) for n in nodes]
    simnodes.apply_nodes(api, grown, later)
    assert core.read_node(f"{prefix}-a100-0").status.allocatable["nvidia.com/gpu"] == "4"

    simnodes.beat(api, [f"{prefix}-a100-1"], NOW + timedelta(minutes=9))
    beaten = gpunode(api, f"{prefix}-a100-1")["status"]
    assert beaten["heartbeat"] == "2026-11-29T19:09:00Z" and len(beaten["gpus"]) == 4


def test_fifty_openb_nodes(api: client.ApiClient, prefix: str) -> None:
    nodes = renamed(simnodes.load_openb(openb_node_list(), limit=50), prefix)
    assert len(nodes) == 50
    simnodes.apply_nodes(api, nodes, NOW)
    listed = client.CoreV1Api(api).list_node(label_selector=f"{simnodes.LABEL_SIMULATED}=true")
    mine = {n.metadata.name: n for n in listed.items if n.metadata.name.startswith(f"{prefix}-")}
    assert len(mine) == 50
    expected = {n.name: n for n in nodes}
    for name, live in mine.items():
        node = expected[name]
        assert live.status.allocatable["cpu"] == str(node.cpu_milli // 1000)
        assert live.status.allocatable[RESOURCE_GPU] == str(node.gpu_count * 8)
        gpus = gpunode(api, name)["status"]["gpus"]
        assert [g["model"] for g in gpus] == [node.gpus[0].model] * node.gpu_count
    wait_ready(api, list(mine))


def test_cli_create_and_delete(api: client.ApiClient, cluster: Any, prefix: str,
                               tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump({"nodes": [
        {"name": f"{prefix}-cli", "replicas": 2, "zone": "zone-q", "sharing": "exclusive",
         "gpus": [{"model": "H100", "count": 8}]}]}))
    kubeconfig = ["--kubeconfig", str(cluster.kubeconfig)]
    assert cli.main(["nodes", "create", "--from", str(path), *kubeconfig]) == 0
    assert cli.main(["nodes", "create", "--from", str(path), *kubeconfig]) == 0  # idempotent
    names = [f"{prefix}-cli-0", f"{prefix}-cli-1"]
    for name in names:
        assert gpunode(api, name)["status"]["sharingMode"] == "exclusive"
        node = client.CoreV1Api(api).read_node(name)
        assert node.status.allocatable[RESOURCE_GPU] == "8"  # exclusive: one share per GPU

    assert cli.main(["nodes", "delete", "--from", str(path), *kubeconfig]) == 0
    for name in names:
        with pytest.raises(ApiException) as gone:
            client.CoreV1Api(api).read_node(name)
        assert gone.value.status == 404
        with pytest.raises(ApiException) as gone:
            gpunode(api, name)
        assert gone.value.status == 404
