"""bench/gpu_node.py's pure parts: the node's CDI spec, the job image's file set and layer."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def test_cdi_spec_names_each_gpu_by_index_and_uuid_and_shares_the_driver(
        gpu_node: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_node, "driver_files", lambda: (
        ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"],
        ["/usr/local/nvidia/lib64/libcuda.so.1"], ["/usr/local/nvidia/bin/nvidia-smi"]))
    spec = gpu_node.cdi_spec([{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}])
    assert spec["kind"] == "nvidia.com/gpu"
    devices = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]]
               for d in spec["devices"]}
    assert devices == {"0": ["/dev/nvidia0"], "GPU-a": ["/dev/nvidia0"], "1": ["/dev/nvidia1"],
                       "GPU-b": ["/dev/nvidia1"], "all": ["/dev/nvidia0", "/dev/nvidia1"]}
    edits = spec["containerEdits"]
    # the control nodes are every device's; no GPU node is
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert {(m["hostPath"], m["containerPath"]) for m in edits["mounts"]} == {
        ("/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        ("/usr/local/nvidia/bin/nvidia-smi", "/usr/bin/nvidia-smi")}
    assert all("ro" in m["options"] for m in edits["mounts"])


class _Dist:
    def __init__(self, requires: list[str]) -> None:
        self.requires = requires


def test_torch_closure_follows_the_extras_a_requirement_names(
        gpu_node: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    world: dict[str, Any] = {
        "torch": _Dist(["filelock", "cuda-toolkit[cublas,nvrtc]==13.0; platform_system == 'Linux'",
                        "opt-einsum>=3; extra == 'opt-einsum'"]),
        "numpy": _Dist([]),
        "filelock": _Dist([]),
        "cuda-toolkit": _Dist(["nvidia-cublas; extra == 'cublas'",
                               "nvidia-cuda-nvrtc; extra == \"nvrtc\"",
                               "nvidia-cufft; extra == 'cufft'"]),
        "nvidia-cublas": _Dist([]), "nvidia-cuda-nvrtc": _Dist([]), "nvidia-cufft": _Dist([]),
        "opt-einsum": _Dist([]),
    }

    def distribution(name: str) -> Any:
        if name not in world:
            raise importlib.metadata.PackageNotFoundError(name)
        return world[name]

    monkeypatch.setattr(gpu_node.importlib.metadata, "distribution", distribution)
    found = {name for name, dist in world.items() if dist in gpu_node.torch_closure()}
    assert found == {"torch", "numpy", "filelock", "cuda-toolkit", "nvidia-cublas",
                     "nvidia-cuda-nvrtc"}


def test_link_chain_keeps_every_link_to_the_file(gpu_node: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    real = tmp_path / "usr" / "bin" / "python3.12"
    real.write_text("")
    (tmp_path / "usr" / "bin" / "python3").symlink_to("python3.12")
    (tmp_path / "venv" / "bin" / "python").symlink_to(tmp_path / "usr" / "bin" / "python3")
    assert gpu_node.link_chain(tmp_path / "venv" / "bin" / "python") == [
        str(tmp_path / "venv" / "bin" / "python"), str(tmp_path / "usr" / "bin" / "python3"),
        str(real)]


def test_small_layer_has_both_tenants_a_shell_and_the_worker(gpu_node: ModuleType,
                                                            tmp_path: Path) -> None:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF")
    with tarfile.open(fileobj=io.BytesIO(gpu_node.small_layer(busybox))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        passwd = tar.extractfile("etc/passwd").read().decode()  # type: ignore[union-attr]
    assert "team-a:x:1001:1001" in passwd and "team-b:x:1002:1002" in passwd
    assert members["usr/bin/sh"].linkname == "busybox"
    assert members["tmp"].mode == 0o1777
    assert gpu_node.WORKER.lstrip("/") in members
    assert "opt/carpool/src/carpool/workload.py" in members
