"""GPU topology from the backend to placement: NVLink peers and NUMA nodes reported in the
GpuNode status, read into the inventory, and NUMA nodes given to the kubelet (TopologyInfo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.core.gpunode import inventory_from_gpunode
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool.deviceplugin.cdi import CdiSettings
from carpool.deviceplugin.health import HealthTracker
from carpool.deviceplugin.plugin import PluginConfig, PluginState
from carpool.deviceplugin.pods import StaticPodSource
from carpool.deviceplugin.sharing import MpsSettings
from carpool.deviceplugin.telemetry import gpu_status

SPEC = {"node": "n1", "gpus": [{"model": "H100", "count": 4}],
        "nvlinkIslands": [[0, 1], [2, 3]], "numaNodes": [0, 0, 1, 1]}


def test_the_fake_backend_reports_nvlink_islands_and_numa_nodes() -> None:
    gpus = FakeBackend.from_spec(SPEC).inventory()
    assert [(g.numa_node, g.nvlink_peers) for g in gpus] == [
        (0, (1,)), (0, (0,)), (1, (3,)), (1, (2,))]
    plain = FakeBackend.from_spec({"node": "n1", "gpus": [{"model": "H100", "count": 2}]})
    assert [(g.numa_node, g.nvlink_peers) for g in plain.inventory()] == [(None, ())] * 2


@pytest.mark.parametrize(("key", "value"), [("nvlinkIslands", [[0, 9]]),
                                            ("numaNodes", [0, 1])])
def test_bad_fake_topology_is_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        FakeBackend.from_spec({**SPEC, key: value})


def test_the_gpunode_status_carries_topology_into_the_inventory() -> None:
    gpus = FakeBackend.from_spec(SPEC).inventory()
    status = {"gpus": [gpu_status(g, True) for g in gpus], "sharing": "exclusive"}
    assert status["gpus"][0]["nvlinkPeers"] == [1] and status["gpus"][2]["numaNode"] == 1
    inventory = inventory_from_gpunode("n1", status, {})
    assert [(g.numa_node, g.nvlink_peers) for g in inventory.gpus] == [
        (0, frozenset({1})), (0, frozenset({0})), (1, frozenset({3})), (1, frozenset({2}))]
    status["gpus"][0]["nvlinkPeers"] = ["one"]
    with pytest.raises(ValueError, match=r"gpus\[0\]\.nvlinkPeers"):
        inventory_from_gpunode("n1", status, {})


def test_list_and_watch_gives_each_share_its_gpu_s_numa_node(tmp_path: Path) -> None:
    state = PluginState(
        PluginConfig("n1", sharing_mode="mps", shares_per_gpu=2,
                     mps=MpsSettings(pipe_dir="/run/carpool/mps/pipe",
                                     shm_dir="/run/carpool/shm"),
                     cdi=CdiSettings(spec_dir=str(tmp_path), stand_in="/dev/null")),
        FakeBackend.from_spec(SPEC), StaticPodSource([]), health=HealthTracker())
    devices = state.device_list().devices
    assert len(devices) == 8
    numa = {d.ID: [n.ID for n in d.topology.nodes] for d in devices}
    gpus = FakeBackend.from_spec(SPEC).inventory()
    assert numa[f"{gpus[3].uuid}::1"] == [1] and numa[f"{gpus[0].uuid}::0"] == [0]
