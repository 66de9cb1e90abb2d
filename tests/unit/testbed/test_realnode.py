"""The real node's pure parts: OCI archives written by hand, and the generated configuration."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from carpool_testbed import realnode


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _read_archive(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile()}


def _blob(files: dict[str, bytes], digest: str) -> bytes:
    algorithm, hexdigest = digest.split(":")
    assert algorithm == "sha256"
    data = files[f"blobs/sha256/{hexdigest}"]
    assert hashlib.sha256(data).hexdigest() == hexdigest, "blob content does not match its name"
    return data


def test_oci_archive_is_a_consistent_image_layout(tmp_path: Path) -> None:
    layer = _tar({"bin/hello": b"#!/bin/sh\necho hi\n"})
    digest = realnode.write_oci_archive(tmp_path / "img.tar", "carpool.local/hello:7", layer,
                                        ("/bin/hello", "--loud"))
    files = _read_archive(tmp_path / "img.tar")
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    (entry,) = index["manifests"]
    assert entry["digest"] == digest
    assert entry["annotations"] == {"io.containerd.image.name": "carpool.local/hello:7",
                                    "org.opencontainers.image.ref.name": "7"}
    manifest_bytes = _blob(files, entry["digest"])
    assert entry["size"] == len(manifest_bytes)
    manifest = json.loads(manifest_bytes)
    (layer_entry,) = manifest["layers"]
    assert _blob(files, layer_entry["digest"]) == layer
    assert layer_entry["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    config = json.loads(_blob(files, manifest["config"]["digest"]))
    # An uncompressed layer's diff ID is its own digest.
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer_entry["digest"]]}
    assert config["config"]["Cmd"] == ["/bin/hello", "--loud"]
    assert config["os"] == "linux" and config["architecture"] == entry["platform"]["architecture"]


def test_oci_archive_is_reproducible(tmp_path: Path) -> None:
    layer = _tar({"a": b"1"})
    first = realnode.write_oci_archive(tmp_path / "1.tar", "x.local/a:1", layer, ("/a",))
    second = realnode.write_oci_archive(tmp_path / "2.tar", "x.local/a:1", layer, ("/a",))
    assert first == second
    assert (tmp_path / "1.tar").read_bytes() == (tmp_path / "2.tar").read_bytes()


def test_busybox_layer_links_every_applet_to_the_binary(tmp_path: Path) -> None:
    fake = tmp_path / "busybox"
    fake.write_text("#!/bin/sh\nprintf 'sh\\nsleep\\nbusybox\\nenv\\n'\n")
    fake.chmod(0o755)
    layer = realnode.busybox_layer(fake)
    assert layer == realnode.busybox_layer(fake)
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        binary = tar.extractfile(members["bin/busybox"])
        assert binary is not None and binary.read() == fake.read_bytes()
    assert members["bin/busybox"].mode == 0o755
    links = {name: m.linkname for name, m in members.items() if m.issym()}
    assert links == {"bin/env": "busybox", "bin/sh": "busybox", "bin/sleep": "busybox"}
    assert members["tmp"].mode == 0o1777


def test_containerd_config_keeps_everything_under_the_node_directory(tmp_path: Path) -> None:
    paths = realnode.NodePaths(tmp_path)
    text = realnode.containerd_config(paths, "native")
    assert f'root = "{paths.containerd_root}"' in text
    assert f'address = "{paths.containerd_socket}"' in text
    assert f'sandbox_image = "{realnode.PAUSE_IMAGE}"' in text
    assert 'snapshotter = "native"' in text
    assert "SystemdCgroup = false" in text
    assert "restrict_oom_score_adj = true" in text
    assert f'config_path = "{paths.registry_hosts}"' in text
    # CDI devices from the node's own spec directory, where its device plugin writes
    cri = tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == [str(paths.cdi_spec_dir)]


def test_registry_hosts_send_pulls_to_the_local_registry_over_http(tmp_path: Path) -> None:
    import tomllib

    paths = realnode.NodePaths(tmp_path)
    written = realnode.write_registry_hosts(paths, "localhost:5001")
    assert written == paths.registry_hosts / "localhost:5001" / "hosts.toml"
    hosts = tomllib.loads(written.read_text())
    assert hosts["server"] == "http://localhost:5001"
    assert hosts["host"]["http://localhost:5001"]["capabilities"] == ["pull", "resolve"]


def test_kubelet_configuration_matches_the_runtime_and_the_sandbox(tmp_path: Path) -> None:
    paths = realnode.NodePaths(tmp_path)
    config = realnode.kubelet_configuration(paths, 10250)
    assert config["containerRuntimeEndpoint"] == f"unix://{paths.containerd_socket}"
    assert config["cgroupDriver"] == "cgroupfs"  # as containerd's runc (SystemdCgroup = false)
    assert config["failCgroupV1"] is False and config["failSwapOn"] is False
    assert config["address"] == realnode.NODE_IP
    assert config["podLogsDir"] == str(paths.pod_logs)
    assert config["registerWithTaints"] == [realnode.REAL_NODE_TAINT]
    assert config["maxPods"] == realnode.DEFAULT_MAX_PODS
    assert realnode.kubelet_configuration(paths, 10250, max_pods=48)["maxPods"] == 48


def test_hosts_entry_is_added_once_and_removed_cleanly(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    realnode.set_hosts_entry("node-a", present=True, hosts=hosts)
    realnode.set_hosts_entry("node-a", present=True, hosts=hosts)
    lines = hosts.read_text().splitlines()
    assert lines[0] == "127.0.0.1 localhost"
    assert [line.split()[:2] for line in lines[1:]] == [[realnode.NODE_IP, "node-a"]]
    realnode.set_hosts_entry("node-a", present=False, hosts=hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n"


@pytest.mark.parametrize(("reference", "tag"), [("carpool.local/pause:1", "1"),
                                                ("localhost:5000/x/y:v2", "v2")])
def test_tag_is_taken_after_the_last_colon(tmp_path: Path, reference: str, tag: str) -> None:
    realnode.write_oci_archive(tmp_path / "t.tar", reference, _tar({"f": b""}), ("/f",))
    index = json.loads(_read_archive(tmp_path / "t.tar")["index.json"])
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == tag


def test_kube_proxy_serves_the_pod_subnet_and_leaves_sysctls_alone(tmp_path: Path) -> None:
    config = realnode.kube_proxy_configuration(realnode.NodePaths(tmp_path), "n1",
                                               tmp_path / "kubeconfig")
    assert config["mode"] == "iptables" and config["hostnameOverride"] == "n1"
    assert config["clusterCIDR"] == realnode.POD_SUBNET
    assert config["conntrack"]["maxPerCore"] == 0
    assert config["iptables"] == {"localhostNodePorts": False}
    assert config["nodePortAddresses"] == [f"{realnode.NODE_IP}/32"]


def test_containerd_config_adds_the_nvidia_handler_only_when_asked(tmp_path: Path) -> None:
    import tomllib

    paths = realnode.NodePaths(tmp_path)
    plain = tomllib.loads(realnode.containerd_config(paths, "overlayfs"))
    cri = plain["plugins"]["io.containerd.grpc.v1.cri"]
    assert set(cri["containerd"]["runtimes"]) == {"runc"}
    gpu = tomllib.loads(realnode.containerd_config(paths, "overlayfs",
                                                   nvidia_runtime="/opt/nct/runtime"))
    cri = gpu["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == [str(paths.cdi_spec_dir)]
    runtimes = cri["containerd"]["runtimes"]
    assert cri["containerd"]["default_runtime_name"] == "runc"  # tenants' pods: no env door
    assert runtimes["nvidia"]["options"] == {"SystemdCgroup": False,
                                             "BinaryName": "/opt/nct/runtime"}


def test_pod_pids_finds_a_pods_processes_by_cgroup_and_command(tmp_path: Path) -> None:
    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    for pid, cgroup, command in (
            (7, f"0::/kubepods/besteffort/pod{uid}/abc\n", b"/bin/sh\0-c\0trap ... WORKLOAD"),
            (8, f"0::/kubepods/besteffort/pod{uid}/def\n", b"/bin/sh\0-c\0pause"),
            (9, "0::/system.slice/other\n", b"WORKLOAD")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(cgroup)
        (tmp_path / str(pid) / "cmdline").write_bytes(command)
    (tmp_path / "self").mkdir()
    assert realnode.pod_pids(uid, proc=tmp_path) == [7, 8]
    assert realnode.pod_pids(uid, "WORKLOAD", proc=tmp_path) == [7]
