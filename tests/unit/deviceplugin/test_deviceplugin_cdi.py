"""The node's CDI spec and what Allocate names from it, in both delivery modes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from carpool.core.assignment import AssignedGpu
from carpool.core.resources import Isolation
from carpool.deviceplugin.__main__ import cdi_settings, parse_args
from carpool.deviceplugin.backends.base import GpuFacts, MigFacts
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool.deviceplugin.cdi import (
    CONTROL_NODES,
    KIND,
    SPEC_FILE,
    CdiSettings,
    DeviceDelivery,
    DriverMount,
    driver_edits,
    mig_cap_nodes,
    node_spec,
    qualified_names,
    write_spec,
)
from carpool.deviceplugin.sharing import MpsSettings, container_setup

H200 = 143771


def gpu(index: int, uuid: str, minor: int | None = None,
        migs: tuple[MigFacts, ...] = ()) -> GpuFacts:
    return GpuFacts(index, uuid, "H200", H200, 0, 40.0, 90.0, 60.0, 0.0,
                    mig_enabled=bool(migs), mig_instances=migs, minor_number=minor)


def test_one_device_per_gpu_and_mig_instance_with_its_own_nodes() -> None:
    mig = MigFacts("MIG-a", "1g.18gb", 1, 16384,
                   ("/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"))
    spec = node_spec([gpu(0, "GPU-a", minor=3, migs=(mig,)), gpu(1, "GPU-b")],
                     ["/dev/nvidiactl", "/dev/nvidia-uvm"],
                     CdiSettings(driver_mounts=(DriverMount("/usr/lib/nv", "/usr/local/nvidia"),)))
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "carpool.dev/gpu"
    devices = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    # the GPU's node is its driver minor, not its index; a GPU index 1 without one is nvidia1
    assert devices == {
        "GPU-a": [{"path": "/dev/nvidia3", "permissions": "rw"}],
        "MIG-a": [{"path": "/dev/nvidia3", "permissions": "rw"},
                  {"path": "/dev/nvidia-caps/nvidia-cap21", "permissions": "rw"},
                  {"path": "/dev/nvidia-caps/nvidia-cap22", "permissions": "rw"}],
        "GPU-b": [{"path": "/dev/nvidia1", "permissions": "rw"}],
    }
    assert spec["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/nvidiactl", "permissions": "rw"},
                        {"path": "/dev/nvidia-uvm", "permissions": "rw"}],
        "mounts": [{"hostPath": "/usr/lib/nv", "containerPath": "/usr/local/nvidia",
                    "options": ["ro", "nosuid", "nodev", "bind"]}],
    }


def test_a_fake_node_backs_every_node_with_its_stand_in() -> None:
    backend = FakeBackend.from_spec({"node": "n", "gpus": [{"model": "H200", "count": 2}]})
    settings = CdiSettings(stand_in="/dev/null")
    spec = node_spec(backend.inventory(), settings.control_nodes(), settings)
    nodes = [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    nodes += spec["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/nvidia0", "/dev/nvidia1", *CONTROL_NODES]
    assert {n["hostPath"] for n in nodes} == {"/dev/null"}
    assert "mounts" not in spec["containerEdits"]  # no empty lists in the file


def test_a_name_cdi_refuses_is_refused_here() -> None:
    with pytest.raises(ValueError, match="cannot name a CDI device"):
        node_spec([gpu(0, "GPU a/b")], [])


def test_nvidia_ctk_edits_are_merged_without_duplicates_and_raise_the_version() -> None:
    generated = {
        "cdiVersion": "0.7.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
        "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidiactl", "permissions": "rw"}],
            "mounts": [{"hostPath": "/usr/lib/libcuda.so.580", "containerPath":
                        "/usr/lib/libcuda.so.580", "options": ["ro", "nosuid", "nodev", "bind"]}],
            "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                       "args": ["nvidia-cdi-hook", "update-ldcache"]}],
        },
    }
    edits, version = driver_edits(generated)
    assert version == "0.7.0"
    spec = node_spec([gpu(0, "GPU-a")], ["/dev/nvidiactl"],
                     CdiSettings(driver_edits=edits, version=version))
    common = spec["containerEdits"]
    assert common["deviceNodes"] == [{"path": "/dev/nvidiactl", "permissions": "rw"}]
    assert common["mounts"][0]["hostPath"] == "/usr/lib/libcuda.so.580"
    assert common["hooks"][0]["args"][1] == "update-ldcache"
    assert [d["name"] for d in spec["devices"]] == ["GPU-a"]  # its own devices are not taken
    assert driver_edits({"cdiVersion": "0.3.0"})[1] == "0.5.0"
    with pytest.raises(ValueError, match=r"containerEdits\.intelRdt is not merged"):
        driver_edits({"cdiVersion": "0.7.0", "containerEdits": {"intelRdt": {}}})
    with pytest.raises(ValueError, match="cdiVersion is missing"):
        driver_edits({"kind": "nvidia.com/gpu"})
    with pytest.raises(ValueError, match=r"cdiVersion .v1. is not MAJOR\.MINOR\.PATCH"):
        driver_edits({"cdiVersion": "v1"})


def test_mig_capability_nodes_from_the_drivers_table() -> None:
    table = "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n" \
            "gpu1/gi1/access 111\ngpu1/gi1/ci0/access 112\n"
    assert mig_cap_nodes(table, 1, 1, 0) == ("/dev/nvidia-caps/nvidia-cap111",
                                             "/dev/nvidia-caps/nvidia-cap112")
    assert mig_cap_nodes(table, 0, 2, 0) == ()
    assert mig_cap_nodes("", 0, 1, 0) == ()


def test_the_spec_is_written_atomically_as_valid_json(tmp_path: Path) -> None:
    spec = node_spec([gpu(0, "GPU-a")], ["/dev/nvidiactl"])
    path = write_spec(spec, tmp_path / "cdi")
    assert path.name == SPEC_FILE and json.loads(path.read_text()) == spec
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    spec["devices"] = []
    write_spec(spec, tmp_path / "cdi")
    assert json.loads(path.read_text())["devices"] == []
    assert os.listdir(tmp_path / "cdi") == [SPEC_FILE]  # no temporary file left behind


def test_allocate_in_cdi_mode_names_devices_and_voids_the_runtime_variable() -> None:
    gpus = [AssignedGpu("GPU-a", 0, 8192, 25), AssignedGpu("GPU-b", 1, 8192, 25)]
    setup = container_setup(Isolation.MPS, gpus, MpsSettings("/host/pipe"))
    assert setup.cdi_devices == ("carpool.dev/gpu=GPU-a", "carpool.dev/gpu=GPU-b")
    assert setup.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert setup.envs["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert setup.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G,1=8G"
    mig = container_setup(Isolation.MIG, [AssignedGpu("GPU-a", 0, 9856, 0, "MIG-1")])
    assert mig.cdi_devices == ("carpool.dev/gpu=MIG-1",)
    # a MIG instance named on a GPU handed out whole is not what the container gets
    whole = container_setup(Isolation.EXCLUSIVE, [AssignedGpu("GPU-a", 0, 9856, 0, "MIG-1")])
    assert whole.cdi_devices == ("carpool.dev/gpu=GPU-a",)
    assert qualified_names([AssignedGpu("GPU-z", 0, 1, 1)]) == [f"{KIND}=GPU-z"]


def test_allocate_in_env_mode_names_no_cdi_device() -> None:
    gpus = [AssignedGpu("GPU-a", 0, 4096, 30)]
    for isolation in (Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE):
        setup = container_setup(isolation, gpus, delivery=DeviceDelivery.ENV)
        assert setup.cdi_devices == ()
        assert setup.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a"


def test_a_real_node_takes_the_driver_files_from_the_toolkits_spec_when_given_none(
        tmp_path: Path) -> None:
    base = ["--node-name", "n", "--cdi-spec-dir", str(tmp_path)]
    assert cdi_settings(parse_args(base)).driver_edits == {}  # none there: a warning only
    (tmp_path / "nvidia.yaml").write_text(
        "cdiVersion: 0.6.0\nkind: nvidia.com/gpu\ndevices: []\ncontainerEdits:\n"
        "  mounts: [{hostPath: /usr/lib/libcuda.so.1, containerPath: /usr/lib/libcuda.so.1}]\n")
    found = cdi_settings(parse_args(base))
    assert found.driver_edits["mounts"][0]["hostPath"] == "/usr/lib/libcuda.so.1"
    assert found.version == "0.6.0"
    # given driver files, or a fake node, or the environment mode: the spec is not read
    assert cdi_settings(parse_args([*base, "--cdi-driver-mount", "/opt/nv"])).driver_edits == {}
    assert cdi_settings(parse_args([*base, "--device-delivery", "env"])).driver_edits == {}


def test_flags_build_the_settings_and_name_the_bad_one(tmp_path: Path) -> None:
    base = ["--node-name", "n", "--backend", "fake", "--fake-spec", "x.yaml"]
    args = parse_args([*base, "--cdi-driver-mount", "/usr/local/nvidia/lib64",
                       "--cdi-driver-mount", "/opt/nv/bin:/usr/local/nvidia/bin"])
    settings = cdi_settings(args)
    assert settings.stand_in == "/dev/null" and settings.spec_dir == "/var/run/cdi"
    assert settings.driver_mounts == (
        DriverMount("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib64"),
        DriverMount("/opt/nv/bin", "/usr/local/nvidia/bin"))
    assert args.device_delivery == "cdi"
    with pytest.raises(SystemExit):
        parse_args([*base, "--cdi-driver-mount", "lib64"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("cdiVersion: 0.6.0\ncontainerEdits: {mounts: {}}\n")
    with pytest.raises(SystemExit, match=r"containerEdits\.mounts must be a list"):
        cdi_settings(parse_args([*base, "--cdi-driver-spec", str(bad)]))
