"""Simulated GPU nodes without a cluster: parsing, the Node and GpuNode objects, the CLI."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.names import GPUNODE_PLURAL, LABEL_SHARING, LABEL_ZONE, RESOURCE_GPU
from carpool.core.resources import Isolation
from carpool.deviceplugin.backends.fake import fake_gpu_uuid
from carpool_testbed import __main__ as cli
from carpool_testbed import crds, simnodes

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "nodes.yaml"
NOW = datetime(2026, 11, 29, 19, 0, tzinfo=UTC)


def node_doc(**fields: Any) -> dict[str, Any]:
    return {"nodes": [{"name": "n1", "gpus": [{"model": "A100", "count": 2}], **fields}]}


def test_example_file_parses_with_replicas_and_per_node_shares() -> None:
    nodes = {n.name: n for n in simnodes.load_nodes_yaml(EXAMPLE)}
    assert sorted(nodes) == ["a100-0", "a100-1", "h200-a", "h200-mig", "t4-edge"]
    hot = nodes["h200-a"]
    assert hot.gpu_count == 4 and hot.zone == "zone-a" and hot.datasets == ("imagenet", "coco")
    assert [g.temperature_c for g in hot.gpus] == [41.0, 84.0]
    assert hot.cpu_milli == 96_000 and hot.memory_mib == 1024 * 1024
    assert simnodes.advertised_shares(hot) == 4 * 8
    assert simnodes.advertised_shares(nodes["h200-mig"]) == 4  # one share per MIG instance
    assert simnodes.advertised_shares(nodes["t4-edge"]) == 2 * 4  # its own sharesPerGpu


def test_command_line_shares_override_the_file_default_but_not_a_node_setting() -> None:
    nodes = {n.name: n for n in simnodes.load_nodes_yaml(EXAMPLE, shares_per_gpu=2)}
    assert nodes["a100-0"].shares_per_gpu == 2
    assert nodes["t4-edge"].shares_per_gpu == 4


def test_exclusive_nodes_advertise_one_share_per_gpu() -> None:
    (node,) = simnodes.parse_nodes(node_doc(sharing="exclusive", sharesPerGpu=8))
    assert simnodes.advertised_shares(node) == 2


def test_a_bare_list_is_accepted() -> None:
    (node,) = simnodes.parse_nodes(node_doc()["nodes"])
    assert node.name == "n1" and node.shares_per_gpu == simnodes.DEFAULT_SHARES_PER_GPU


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (node_doc(gpu=[{"model": "A100"}]), "nodes[0]: unknown field(s) gpu"),
        (node_doc(sharing="vgpu"), "nodes[0].sharing: must be one of"),
        (node_doc(gpus=[{"model": "A100", "count": 0}]), "nodes[0].gpus[0].count"),
        (node_doc(gpus=[{"model": "B200"}]), "nodes[0].gpus[0].memoryTotalMiB"),
        (node_doc(gpus=[]), "nodes[0].gpus: a GPU node needs at least one GPU"),
        (node_doc(gpus=[{"model": "A100", "temperatureC": "hot"}]),
         "nodes[0].gpus[0].temperatureC"),
        (node_doc(gpus=[{"model": "H200", "migInstances": [
            {"profile": "8g.200gb", "slices": 8, "memoryMiB": 1}]}]),
         "nodes[0].gpus[0].migInstances[0].slices"),
        (node_doc(name="Bad_Name"), "nodes[0].name"),
        (node_doc(zone="zone a"), "zone value 'zone a'"),
        (node_doc(cpu="lots"), "nodes[0]: cpu/memory"),
        (node_doc(replicas=0), "nodes[0].replicas"),
        (node_doc(datasets="imagenet"), "nodes[0].datasets: must be a list"),
        ({"nodes": [{"name": "n1", "gpus": [{"model": "T4"}]},
                    {"name": "n1", "gpus": [{"model": "T4"}]}]}, "'n1' appears twice"),
        ({"node": []}, "unknown field(s) node"),
        ({"nodes": [{"name": "n1", "gpus": [{"model": "T4"}]}], "sharesPerGpu": 0},
         "sharesPerGpu: must be an integer >= 1"),
    ],
)
def test_bad_node_files_are_refused_naming_the_field(document: object, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        simnodes.parse_nodes(document, "f.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("f.yaml")


OPENB = """sn,cpu_milli,memory_mib,gpu,model
openb-node-0000,64000,262144,2,P100
openb-node-0001,96000,786432,8,G2
openb-node-0002,32000,131072,0,T4
openb-node-0003,96000,786432,1,V100M32
openb-node-0004,96000,786432,4,A10
"""


def test_openb_rows_become_nodes_in_file_order_with_rotating_zones() -> None:
    nodes = simnodes.nodes_from_openb(_rows(OPENB), shares_per_gpu=4)
    assert [n.name for n in nodes] == ["openb-node-0000", "openb-node-0001", "openb-node-0003",
                                       "openb-node-0004"]  # the GPU-less row is skipped
    assert [n.zone for n in nodes] == ["zone-a", "zone-b", "zone-c", "zone-a"]
    g2 = nodes[1]
    assert (g2.cpu_milli, g2.memory_mib, g2.gpu_count, g2.gpus[0].model) == (96000, 786432, 8,
                                                                              "G2")
    assert simnodes.advertised_shares(g2) == 32


def test_openb_limit_counts_gpu_nodes() -> None:
    nodes = simnodes.nodes_from_openb(_rows(OPENB), limit=3)
    assert [n.name[-4:] for n in nodes] == ["0000", "0001", "0003"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,two,T4\n", "line 2: not a node row"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,2,Z80\n", "unknown GPU model 'Z80'"),
        ("name,gpus\nn1,2\n", "line 2: not a node row"),
    ],
)
def test_bad_openb_rows_are_refused_with_their_line(text: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        simnodes.nodes_from_openb(_rows(text))


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_a_node_for_a_stand_in_kubelet_is_not_kwoks() -> None:
    (node,) = simnodes.parse_nodes(node_doc())
    manifest = simnodes.node_manifest(dataclasses.replace(node, kwok=False))
    assert simnodes.KWOK_NODE_ANNOTATION not in manifest["metadata"]["annotations"]
    assert manifest["metadata"]["labels"] == simnodes.node_manifest(node)["metadata"]["labels"]


def test_node_manifest_is_a_kwok_node_with_equal_capacity_and_allocatable() -> None:
    (node,) = simnodes.parse_nodes(node_doc(zone="zone-b", cpu="1500m", memory="8Gi",
                                            labels={"team": "vision"}))
    manifest = simnodes.node_manifest(node)
    assert manifest["metadata"]["annotations"][simnodes.KWOK_NODE_ANNOTATION] == "fake"
    labels = manifest["metadata"]["labels"]
    assert labels[LABEL_ZONE] == "zone-b" and labels[LABEL_SHARING] == "mps"
    assert labels[simnodes.LABEL_GPU_MODEL] == "A100" and labels["team"] == "vision"
    assert labels[simnodes.LABEL_SIMULATED] == "true" and labels["type"] == "kwok"
    assert manifest["spec"] == {}  # no taint: KWOK manages it by its annotation
    status = simnodes.node_status_manifest(node)["status"]
    assert status["capacity"] == status["allocatable"] == {
        "cpu": "1500m", "memory": "8192Mi", "pods": "110", RESOURCE_GPU: "16"}


def test_taints_are_opt_in() -> None:
    (node,) = simnodes.parse_nodes(node_doc(taints=[{"key": "team", "value": "a"},
                                                    {"key": "gpu", "effect": "NoExecute"}]))
    assert simnodes.node_manifest(node)["spec"] == {"taints": [
        {"key": "team", "value": "a", "effect": "NoSchedule"},
        {"key": "gpu", "effect": "NoExecute"}]}
    with pytest.raises(ValueError, match=r"nodes\[0\].taints\[0\].effect"):
        simnodes.parse_nodes(node_doc(taints=[{"key": "k", "effect": "Never"}]))


def test_mixed_model_nodes_are_labelled_mixed() -> None:
    (node,) = simnodes.parse_nodes(node_doc(gpus=[{"model": "A100"}, {"model": "H100"}]))
    assert simnodes.node_labels(node)[simnodes.LABEL_GPU_MODEL] == "mixed"


def test_gpunode_status_comes_from_the_fake_backend_and_reads_back_as_inventory() -> None:
    nodes = {n.name: n for n in simnodes.load_nodes_yaml(EXAMPLE)}
    status = simnodes.gpunode_status(nodes["h200-a"], NOW)
    assert status["heartbeat"] == "2026-11-29T19:00:00Z"
    assert [g["uuid"] for g in status["gpus"]] == [fake_gpu_uuid("h200-a", i) for i in range(4)]
    assert status["gpus"][3]["temperatureC"] == 84.0
    assert status["gpus"][0]["memoryTotalMiB"] == 143771
    assert status["datasets"] == ["coco", "imagenet"] and status["zone"] == "zone-a"
    # what the extender and operator will read from it
    inventory = inventory_from_gpunode("h200-a", status, simnodes.node_labels(nodes["h200-a"]),
                                       now=NOW)
    assert inventory.ready and inventory.zone == "zone-a" and len(inventory.gpus) == 4
    assert inventory.datasets == frozenset({"coco", "imagenet"})
    mig = inventory_from_gpunode("h200-mig", simnodes.gpunode_status(nodes["h200-mig"], NOW), {})
    assert Isolation.MIG in mig.sharing
    assert [m.profile for m in mig.gpus[0].mig_instances] == ["3g.71gb", "2g.35gb", "1g.18gb",
                                                             "1g.18gb"]


def undeclared(value: object, schema: dict[str, Any], path: str = "status") -> list[str]:
    """Paths in `value` that the OpenAPI schema does not declare (the API server would prune
    them silently)."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        out = []
        for key, item in value.items():
            if key not in properties:
                out.append(f"{path}.{key}")
            else:
                out += undeclared(item, properties[key], f"{path}.{key}")
        return out
    if isinstance(value, list):
        return [p for i, item in enumerate(value)
                for p in undeclared(item, schema.get("items", {}), f"{path}[{i}]")]
    return []


def test_every_published_gpunode_field_is_declared_in_the_crd() -> None:
    schema = crds.crd_schema(GPUNODE_PLURAL)["properties"]["status"]
    for node in simnodes.load_nodes_yaml(EXAMPLE):
        assert undeclared(simnodes.gpunode_status(node, NOW), schema) == []


def test_dry_run_prints_every_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(node_doc()))
    assert cli.main(["nodes", "create", "--from", str(path), "--dry-run"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(o["kind"], o["metadata"]["name"]) for o in listing["items"]] == [
        ("Node", "n1"), ("GpuNode", "n1")]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--limit", "5"], "--limit applies to --from-openb only"),
        (["--shares-per-gpu", "0"], "--shares-per-gpu must be at least 1"),
    ],
)
def test_cli_refuses_bad_options(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 argv: list[str], expected: str) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(node_doc()))
    assert cli.main(["nodes", "create", "--from", str(path), "--dry-run", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_cli_names_the_bad_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(node_doc(sharing="vgpu")))
    assert cli.main(["nodes", "create", "--from", str(path), "--dry-run"]) == 2
    assert f"{path}: nodes[0].sharing" in capsys.readouterr().err
