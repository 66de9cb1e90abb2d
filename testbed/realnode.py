"""One real node in the local cluster: containerd, runc, a CNI bridge, the kubelet and the
Carpool device plugin, all on this machine.

`python -m carpool_testbed.realnode up|down|status` (after `make cluster`); the e2e suite uses
`running_node()`. KWOK nodes have no kubelet; this node proves that a real kubelet accepts the
device plugin over its real socket and starts containers with what Allocate returned.

Everything lives under `$CARPOOL_CACHE/realnode/` (containerd's root and state, its socket, the
kubelet's root dir with `pod-resources/`, CNI config and IPAM state, pod
logs, process logs and pid files), so the node touches nothing a host containerd or kubelet would
use, except what the tools hard-code: the kubelet's device-plugin socket directory is always
/var/lib/kubelet/device-plugins, containerd's shims put their sockets in /run/containerd/s,
CRI puts network namespaces in /var/run/netns, and libcni caches results in /var/lib/cni.

No registry can be reached, so the sandbox (pause) image and the test image are written here as
OCI image-layout archives (a layer holding Debian's static busybox) and imported with `ctr`.
See docs/real-node.md for what runs in this sandbox, what does not, and timings.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from carpool.core import names
from carpool.deviceplugin.watchdog import pod_of_pid
from carpool_testbed import crds, devcluster

DEFAULT_NODE_NAME: Final = "carpool-real-0"
DEFAULT_MAX_PODS: Final = 16
# Pods for the real node tolerate this; everything else (other tests' pods) stays off it.
REAL_NODE_TAINT: Final = {"key": f"{names.GROUP}/real-node", "value": "true",
                          "effect": "NoSchedule"}
LABEL_REAL_NODE: Final = f"{names.GROUP}/real-node"

IMAGE_REPOSITORY: Final = "carpool.local"
PAUSE_IMAGE: Final = f"{IMAGE_REPOSITORY}/pause:1"
TEST_IMAGE: Final = f"{IMAGE_REPOSITORY}/busybox:1"
# The test image as CUDA and PyTorch images are: NVIDIA_VISIBLE_DEVICES=all in its config.
ALL_GPUS_IMAGE: Final = f"{IMAGE_REPOSITORY}/busybox-all-gpus:1"
# A shell line for the test image: the NVIDIA device nodes the runtime put into the container.
PRINT_DEVICE_NODES: Final = (
    "echo DEVICE_NODES=$(cd /dev && ls -d nvidia* 2>/dev/null | tr '\\n' ,); ")
CRI_NAMESPACE: Final = "k8s.io"
KUBELET_DEVICE_PLUGIN_DIR: Final = Path("/var/lib/kubelet/device-plugins")
BUSYBOX: Final = Path("/bin/busybox")
CNI_BIN_DIR: Final = Path("/usr/lib/cni")
POD_SUBNET: Final = "10.88.77.0/24"
BRIDGE: Final = "carpool0"
# The node's InternalIP: the bridge's gateway address. The kubelet refuses a loopback node IP,
# this kernel has no dummy links, and the bridge keeps the kubelet off the machine's real NIC.
NODE_IP: Final = devcluster.POD_API_ADDRESS
KUBE_PROXY_ENV: Final = "CARPOOL_KUBE_PROXY"

# The sandbox's process: sleep until told to stop, exit 0 on SIGTERM, reap children (`wait`).
PAUSE_COMMAND: Final = ("/bin/sh", "-c",
                        "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done")

FAKE_GPU_MODEL: Final = "H200"
FAKE_GPU_COUNT: Final = 2


class NodeError(RuntimeError):
    """The real node could not be brought up or down; the message says which step and why."""


# --------------------------------------------------------------------------------------------
# Locations


@dataclass(frozen=True)
class NodePaths:
    """Where the node keeps its files. Short paths: unix sockets are limited to 107 bytes."""

    base: Path

    @classmethod
    def default(cls) -> NodePaths:
        return cls(devcluster.cache_dir() / "realnode")

    @property
    def etc(self) -> Path:
        return self.base / "etc"

    @property
    def containerd_config(self) -> Path:
        return self.etc / "containerd.toml"

    @property
    def containerd_root(self) -> Path:
        return self.base / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.base / "run" / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.base / "run" / "containerd.sock"

    @property
    def registry_hosts(self) -> Path:
        """containerd's registry host configuration (config_path): one hosts.toml per host."""
        return self.etc / "certs.d"

    @property
    def cni_conf_dir(self) -> Path:
        return self.etc / "cni"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.base / "cni-ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.base / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.etc / "kubelet.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.etc / "kubelet.kubeconfig"

    @property
    def plugin_dir(self) -> Path:
        """Not under --root-dir: the kubelet serves device-plugin registration at this fixed
        path (v1beta1's DevicePluginPath), whatever its root directory."""
        return KUBELET_DEVICE_PLUGIN_DIR

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_root / "pod-resources" / "kubelet.sock"

    @property
    def pod_logs(self) -> Path:
        return self.base / "pod-logs"

    @property
    def images(self) -> Path:
        return self.base / "images"

    @property
    def reports(self) -> Path:
        """The device plugin's per-pod report directories (jobs' checkpoints, progress)."""
        return self.base / "reports"

    @property
    def fake_gpus(self) -> Path:
        return self.etc / "fake-gpus.yaml"

    @property
    def fake_usage(self) -> Path:
        """The fake GPUs' process memory, which tests write (the plugin's --fake-usage-file)."""
        return self.etc / "fake-gpu-usage.json"

    @property
    def mps_dir(self) -> Path:
        return self.base / "mps"

    @property
    def cdi_spec_dir(self) -> Path:
        """The CDI spec directory: the device plugin writes the node's spec, containerd reads."""
        return self.base / "cdi"

    @property
    def logs(self) -> Path:
        return self.base / "logs"

    @property
    def pids(self) -> Path:
        return self.base / "pids"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def pid_file(self, component: str) -> Path:
        return self.pids / f"{component}.pid"


# --------------------------------------------------------------------------------------------
# Progress and timings


@dataclass
class Timings:
    """Seconds per stage, in order; printed as it goes and kept for the report."""

    stream: Any = None
    stages: list[tuple[str, float]] = field(default_factory=list)

    @contextlib.contextmanager
    def stage(self, title: str) -> Iterator[None]:
        out = self.stream if self.stream is not None else sys.stderr
        print(f"==> [realnode] {title}", file=out, flush=True)
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.stages.append((title, took))
            print(f"    done in {took:.1f}s", file=out, flush=True)

    def table(self) -> str:
        rows = [f"| {title} | {took:.1f} |" for title, took in self.stages]
        return "\n".join(["| stage | seconds |", "|---|---|", *rows])


# --------------------------------------------------------------------------------------------
# Host packages


@functools.cache
def containerd_bin_dir() -> Path:
    """containerd, its runc shim and ctr, built once per machine by hack/build-containerd.sh
    (Debian bookworm's containerd 1.6 cannot apply CDI devices)."""
    script = devcluster.repo_root() / "hack" / "build-containerd.sh"
    done = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise NodeError(f"{script} failed (exit {done.returncode})")
    for line in lines[:-1]:
        print(f"    {line}", file=sys.stderr)
    return Path(lines[-1])


def install_packages(timings: Timings, iptables: bool = False) -> None:
    """runc, CNI plugins and static busybox from Debian (hack/node/install.sh), iptables too
    when kube-proxy will run; containerd built from the Go module proxy
    (`containerd_bin_dir`)."""
    script = devcluster.repo_root() / "hack" / "node" / "install.sh"
    with timings.stage("host packages (hack/node/install.sh: apt-get when missing)"):
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False,
                              env=dict(os.environ, NEED_IPTABLES="1" if iptables else "0"))
        for line in done.stdout.splitlines():
            print(f"    {line}", file=sys.stderr)
        if done.returncode != 0:
            raise NodeError(f"{script} failed (exit {done.returncode}): {done.stderr.strip()}")
    with timings.stage("containerd (hack/build-containerd.sh: built once per machine)"):
        containerd_bin_dir()


# --------------------------------------------------------------------------------------------
# OCI images without a registry or Docker


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data),
                **extra}


def oci_platform() -> dict[str, str]:
    machine = platform.machine()
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
    return {"architecture": arch, "os": "linux"}


def busybox_layer(busybox: Path = BUSYBOX) -> bytes:
    """An uncompressed layer tar: /bin/busybox plus a symlink per applet, reproducibly.

    Fixed owner, mode and mtime and a sorted order, so the same busybox gives the same digest.
    """
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        for name in ("bin", "dev", "etc", "proc", "sys", "var", "run"):
            add_dir(name)
        add_dir("tmp", 0o1777)
        payload = busybox.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(payload), 0o755
        tar.addfile(info, io.BytesIO(payload))
        for applet in sorted(set(applets) - {"busybox"}):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(link)
        for name, text in (("etc/passwd", "root:x:0:0:root:/:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_oci_archive(path: Path, reference: str, layer: bytes,
                      command: Sequence[str], env: Sequence[str] = ()) -> str:
    """Writes an OCI image-layout tar for `reference` ("repo/name:tag"); returns its manifest
    digest. `ctr images import` reads the name from the `io.containerd.image.name` annotation.
    """
    layer_blob = Blob("application/vnd.oci.image.layer.v1.tar", layer)
    config = {
        **oci_platform(),
        "config": {"Env": ["PATH=/bin", *env], "Cmd": list(command), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_blob.digest]},
        "history": [{"created_by": "carpool.realnode: static busybox"}],
    }
    config_blob = Blob("application/vnd.oci.image.config.v1+json",
                       json.dumps(config, sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_blob.descriptor(), "layers": [layer_blob.descriptor()]}
    manifest_blob = Blob("application/vnd.oci.image.manifest.v1+json",
                         json.dumps(manifest, sort_keys=True).encode())
    tag = reference.rsplit(":", 1)[1]
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_blob.descriptor(
                 platform=oci_platform(),
                 annotations={"io.containerd.image.name": reference,
                              "org.opencontainers.image.ref.name": tag})]}
    files: list[tuple[str, bytes]] = [
        ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        ("index.json", json.dumps(index, sort_keys=True).encode()),
    ]
    files += [(f"blobs/sha256/{b.digest.split(':')[1]}", b.data)
              for b in (layer_blob, config_blob, manifest_blob)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return manifest_blob.digest


def build_images(paths: NodePaths) -> dict[str, Path]:
    """The pause and test images as OCI archives (one shared busybox layer); the second test
    image asks for every GPU in its environment, as CUDA images do."""
    layer = busybox_layer()
    archives = {PAUSE_IMAGE: paths.images / "pause.oci.tar",
                TEST_IMAGE: paths.images / "busybox.oci.tar",
                ALL_GPUS_IMAGE: paths.images / "busybox-all-gpus.oci.tar"}
    write_oci_archive(archives[PAUSE_IMAGE], PAUSE_IMAGE, layer, PAUSE_COMMAND)
    write_oci_archive(archives[TEST_IMAGE], TEST_IMAGE, layer, ("/bin/sh",))
    write_oci_archive(archives[ALL_GPUS_IMAGE], ALL_GPUS_IMAGE, layer, ("/bin/sh",),
                      env=("NVIDIA_VISIBLE_DEVICES=all",))
    return archives


# --------------------------------------------------------------------------------------------
# Configuration files


def containerd_config(paths: NodePaths, snapshotter: str, nvidia_runtime: str = "") -> str:
    """containerd 1.7 (config version 2): private root/state/socket, CRI with our pause image,
    CDI devices from the node's own spec directory, runc with cgroupfs (no systemd here), CNI
    from Debian's plugins and our conf dir. `nvidia_runtime`: the NVIDIA container runtime's
    binary as the handler `nvidia` (a RuntimeClass names it), beside the default runc."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    nvidia_lines = "".join(f"\n{line}" for line in (
        f"    [{cri}.containerd.runtimes.nvidia]",
        '      runtime_type = "io.containerd.runc.v2"',
        f"      [{cri}.containerd.runtimes.nvidia.options]",
        "        SystemdCgroup = false",
        f'        BinaryName = "{nvidia_runtime}"')) if nvidia_runtime else ""
    return f"""version = 2
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{paths.containerd_socket}"

[ttrpc]
  address = "{paths.containerd_socket}.ttrpc"

[debug]
  level = "info"

[metrics]
  address = ""

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  disable_apparmor = true
  # This machine withholds CAP_SYS_RESOURCE, so runc cannot set the kubelet's negative
  # oom_score_adj (-998 for sandboxes): clamp it to containerd's own (0) instead.
  restrict_oom_score_adj = true
  # The device plugin names GPUs as CDI devices; their spec is the node's own, not the host's.
  enable_cdi = true
  cdi_spec_dirs = ["{paths.cdi_spec_dir}"]
  [{cri}.containerd]
    snapshotter = "{snapshotter}"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which('runc') or 'runc'}"{nvidia_lines}
  # Image pulls read each registry's hosts.toml here (registry_hosts_toml): the local
  # registry is plain HTTP on loopback.
  [{cri}.registry]
    config_path = "{paths.registry_hosts}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{paths.cni_conf_dir}"
    max_conf_num = 1
"""


# The local registry (hack/images/registry.sh) the node pulls Carpool's images from.
DEFAULT_REGISTRY: Final = "localhost:5001"


def registry_address() -> str:
    return os.environ.get("CARPOOL_REGISTRY", DEFAULT_REGISTRY)


def registry_hosts_toml(registry: str) -> str:
    """containerd's hosts.toml for `registry` ("host:port"): pull and resolve over plain HTTP
    from that address (a registry on this machine's loopback)."""
    return f"""server = "http://{registry}"

[host."http://{registry}"]
  capabilities = ["pull", "resolve"]
"""


def write_registry_hosts(paths: NodePaths, registry: str) -> Path:
    """Writes `<registry_hosts>/<registry>/hosts.toml` (containerd reads it on each pull)."""
    folder = paths.registry_hosts / registry
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts.toml").write_text(registry_hosts_toml(registry))
    return folder / "hosts.toml"


def cni_config(paths: NodePaths) -> dict[str, Any]:
    """A bridge with host-local addresses; no masquerade (pods need no way out of the host)."""
    return {
        "cniVersion": "1.0.0",
        "name": "carpool-realnode",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                     "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(paths.cni_ipam_dir)},
        }],
    }


def kubelet_configuration(paths: NodePaths, port: int,
                          max_pods: int = DEFAULT_MAX_PODS) -> dict[str, Any]:
    """KubeletConfiguration for this sandbox; each departure from the defaults says why."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        "imageServiceEndpoint": f"unix://{paths.containerd_socket}",
        # No systemd here; containerd's runc is set to cgroupfs too.
        "cgroupDriver": "cgroupfs",
        # The machine mounts cgroup v1 controllers (hybrid); 1.35 refuses v1 unless told.
        "failCgroupV1": False,
        "failSwapOn": False,
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": port - 2,
        # A dev node on loopback: the API server (admin) is the only client.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "registerNode": True,
        "registerWithTaints": [dict(REAL_NODE_TAINT)],
        "podLogsDir": str(paths.pod_logs),
        # Small by default (a shared 2-core machine); the chart test's node holds Carpool's six
        # pods, a rolling update's surge, 20 running jobs and probes at once.
        "maxPods": max_pods,
        # The shared disk is not ours to police: evict only when it is really full.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 99,
        "imageGCLowThresholdPercent": 98,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "resolvConf": "",
        "serializeImagePulls": False,
    }


def kube_proxy_binary() -> Path:
    """kube-proxy, built by hack/build-k8s.sh beside the other binaries only when asked for
    (CARPOOL_KUBE_PROXY=1): the real node is its only user."""
    os.environ[KUBE_PROXY_ENV] = "1"
    return devcluster.binaries_dir() / "kube-proxy"


def kube_proxy_configuration(paths: NodePaths, node: str, kubeconfig: Path) -> dict[str, Any]:
    """iptables mode for the pod subnet; it changes no sysctl it can avoid (conntrack sizes,
    timeouts, route_localnet): the machine is shared and not ours to tune."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node,
        "mode": "iptables",
        "clusterCIDR": POD_SUBNET,
        "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{NODE_IP}/32"],
        "iptables": {"localhostNodePorts": False},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
    }


def fake_gpu_spec(node: str) -> dict[str, Any]:
    return {"node": node, "gpus": [{"model": FAKE_GPU_MODEL, "count": FAKE_GPU_COUNT}]}


HOSTS_FILE: Final = Path("/etc/hosts")
HOSTS_MARKER: Final = "# carpool.realnode"


def set_hosts_entry(node: str, present: bool, hosts: Path = HOSTS_FILE) -> None:
    """Adds (or removes) `NODE_IP node` in /etc/hosts, tagged with a marker comment.

    The API server reaches a kubelet (logs, exec) by the node's Hostname address first, and
    nothing else resolves the node's name on this machine.
    """
    lines = hosts.read_text().splitlines() if hosts.is_file() else []
    kept = [line for line in lines if not line.endswith(f"{HOSTS_MARKER} {node}")]
    if present:
        kept.append(f"{NODE_IP} {node} {HOSTS_MARKER} {node}")
    if kept != lines:
        hosts.write_text("\n".join(kept) + "\n")


def ensure_bridge() -> None:
    """The CNI bridge, made before the first pod so the node IP exists for the kubelet."""
    def ip(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)

    if ip("link", "show", BRIDGE).returncode != 0:
        made = ip("link", "add", BRIDGE, "type", "bridge")
        if made.returncode != 0 and shutil.which("brctl"):  # busybox's ip makes no bridges
            made = subprocess.run(["brctl", "addbr", BRIDGE], capture_output=True, text=True,
                                  check=False)
        if made.returncode != 0:
            raise NodeError(f"`ip link add {BRIDGE} type bridge` failed: {made.stderr.strip()}")
    if NODE_IP not in ip("-4", "addr", "show", BRIDGE).stdout:
        prefix = POD_SUBNET.split("/")[1]
        added = ip("addr", "add", f"{NODE_IP}/{prefix}", "dev", BRIDGE)
        if added.returncode != 0:
            raise NodeError(f"`ip addr add {NODE_IP}/{prefix} dev {BRIDGE}` failed: "
                            f"{added.stderr.strip()}")
    ip("link", "set", BRIDGE, "up")


# --------------------------------------------------------------------------------------------
# Processes (pid files, verified against /proc before any signal)


def _pid_alive(paths: NodePaths, component: str, marker: str) -> int | None:
    try:
        pid = int(paths.pid_file(component).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return None
    return pid if marker in cmdline else None


# Children this process started, kept until stopped: a Popen dropped while its child runs warns.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _spawn(paths: NodePaths, component: str, command: Sequence[str],
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.pids.mkdir(parents=True, exist_ok=True)
    with paths.log(component).open("ab") as log:
        log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
    paths.pid_file(component).write_text(str(process.pid))
    _CHILDREN[process.pid] = process
    return process


def _stop(paths: NodePaths, component: str, marker: str, grace: float = 10) -> bool:
    """SIGTERM the component named by its pid file (if it is what we started), then SIGKILL."""
    pid = _pid_alive(paths, component, marker)
    paths.pid_file(component).unlink(missing_ok=True)
    if pid is None:
        return False
    child = _CHILDREN.pop(pid, None)
    if child is not None:  # started by this process: let Popen reap it
        child.terminate()
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        return True
    with contextlib.suppress(ProcessLookupError):  # started by an earlier `up`
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _pid_running(pid):
        time.sleep(0.1)
    if _pid_running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def _pid_running(pid: int) -> bool:
    """Alive and not a zombie (an earlier `up`'s child is reaped by init, not by us)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait(what: str, check: Callable[[], bool], timeout: float, log: Path | None = None,
          interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tail = ""
            if log is not None and log.is_file():
                tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(interval)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(str(path))
        except OSError:
            return False
        return True


def ctr(paths: NodePaths, *args: str, timeout: float = 120,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [str(containerd_bin_dir() / "ctr"), "--address", str(paths.containerd_socket),
               "-n", CRI_NAMESPACE, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise NodeError(f"`{' '.join(command)}` failed (exit {done.returncode}): "
                        f"{done.stderr.strip()}")
    return done


# --------------------------------------------------------------------------------------------
# The node


@dataclass(frozen=True)
class NodeSettings:
    name: str = DEFAULT_NODE_NAME
    kubelet_port: int = 10250
    snapshotter: str = "overlayfs"
    shares_per_gpu: int = 4
    sharing_mode: str = "mps"
    # False: the chart's device-plugin DaemonSet serves this node instead of a host process.
    device_plugin: bool = True
    registry: str = field(default_factory=registry_address)
    # The e2e tests hand bare pods to the plugin; a product plugin serves only GpuJobs' pods.
    serve_unowned: bool = True
    # True: kube-proxy (iptables mode) routes ClusterIPs for pods on this node; for Carpool's
    # own pods (the Helm chart) in a cluster made with devcluster's pods option.
    kube_proxy: bool = False
    # The kubelet's maxPods; the scheduler leaves pods Pending ("Too many pods") beyond it.
    max_pods: int = DEFAULT_MAX_PODS
    # Services ("namespace/name") whose ClusterIPs a user-space forwarder serves for the pods
    # (carpool_testbed.serviceproxy), where kube-proxy cannot run (no iptables); the API
    # server's `default/kubernetes` is always among them. Empty: no forwarder.
    userspace_services: tuple[str, ...] = ()
    # The NVIDIA container runtime's binary: containerd's handler `nvidia`. Empty: none.
    nvidia_runtime: str = ""


@dataclass
class RealNode:
    """A running real node: its settings, paths, the cluster it joined, and stage timings."""

    cluster: devcluster.Cluster
    settings: NodeSettings
    paths: NodePaths
    timings: Timings

    @property
    def name(self) -> str:
        return self.settings.name

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check, stdin=stdin, timeout=timeout)

    def node_object(self) -> dict[str, Any] | None:
        done = self.kubectl("get", "node", self.name, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def ready(self) -> bool:
        node = self.node_object()
        conditions = ((node or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def allocatable_shares(self) -> int:
        node = self.node_object() or {}
        value = ((node.get("status") or {}).get("allocatable") or {}).get(names.RESOURCE_GPU)
        return int(value) if value is not None else 0

    def expected_shares(self) -> int:
        return FAKE_GPU_COUNT * self.settings.shares_per_gpu

    # --- containerd ---------------------------------------------------------------------

    def start_containerd(self) -> None:
        p = self.paths
        for d in (p.etc, p.containerd_root, p.containerd_state, p.cni_conf_dir, p.cni_ipam_dir):
            d.mkdir(parents=True, exist_ok=True)
        p.containerd_config.write_text(containerd_config(
            p, self.settings.snapshotter, self.settings.nvidia_runtime))
        shutil.rmtree(p.registry_hosts, ignore_errors=True)
        write_registry_hosts(p, self.settings.registry)
        for stale in p.cni_conf_dir.iterdir():
            stale.unlink()
        (p.cni_conf_dir / "10-carpool.conflist").write_text(json.dumps(cni_config(p), indent=2))
        ensure_bridge()
        if _pid_alive(p, "containerd", str(p.containerd_config)) is None:
            p.containerd_socket.unlink(missing_ok=True)
            bins = containerd_bin_dir()  # containerd finds its shim on PATH
            _spawn(p, "containerd", [str(bins / "containerd"), "--config",
                                     str(p.containerd_config)],
                   env={**os.environ, "PATH": f"{bins}:{os.environ.get('PATH', '')}"})
        _wait("containerd's socket", lambda: _socket_answers(p.containerd_socket), 60,
              p.log("containerd"))
        _wait("containerd to answer `ctr version`",
              lambda: ctr(p, "version", check=False, timeout=10).returncode == 0, 30,
              p.log("containerd"))

    def import_images(self) -> list[str]:
        archives = build_images(self.paths)
        for archive in archives.values():
            ctr(self.paths, "images", "import", "--snapshotter", self.settings.snapshotter,
                str(archive))
        listed = ctr(self.paths, "images", "ls", "-q").stdout.split()
        missing = [ref for ref in archives if ref not in listed]
        if missing:
            raise NodeError(f"ctr images import did not produce {missing}; have {listed}")
        return sorted(archives)

    def import_layout(self, layout: Path, base_name: str) -> str:
        """Import an OCI image layout directory (e.g. `make images`' build/images/carpool) as
        `<base_name>:<its tag>`; returns that reference."""
        index = json.loads((layout / "index.json").read_text())
        tags = [m.get("annotations", {}).get("org.opencontainers.image.ref.name")
                for m in index.get("manifests", [])]
        if len(tags) != 1 or not tags[0]:
            raise NodeError(f"{layout}/index.json must name exactly one tagged image: {tags}")
        reference = f"{base_name}:{tags[0]}"
        self.paths.images.mkdir(parents=True, exist_ok=True)
        archive = self.paths.images / f"{layout.name}.layout.tar"
        with tarfile.open(archive, "w") as tar:
            for path in sorted(layout.rglob("*")):
                tar.add(path, arcname=str(path.relative_to(layout)), recursive=False)
        ctr(self.paths, "images", "import", "--base-name", base_name, "--snapshotter",
            self.settings.snapshotter, str(archive), timeout=600)
        if reference not in ctr(self.paths, "images", "ls", "-q").stdout.split():
            raise NodeError(f"ctr images import of {layout} did not produce {reference}")
        return reference

    # --- kubelet ------------------------------------------------------------------------

    def write_kubelet_files(self) -> None:
        p = self.paths
        p.kubelet_root.mkdir(parents=True, exist_ok=True)
        p.pod_logs.mkdir(parents=True, exist_ok=True)
        p.kubelet_config.write_text(yaml.safe_dump(
            kubelet_configuration(p, self.settings.kubelet_port, self.settings.max_pods),
            sort_keys=False))
        shutil.copyfile(self.cluster.kubeconfig, p.kubelet_kubeconfig)

    def kubelet_command(self) -> list[str]:
        p = self.paths
        return [
            str(self.cluster.bin_dir / "kubelet"),
            "--config", str(p.kubelet_config),
            "--kubeconfig", str(p.kubelet_kubeconfig),
            "--root-dir", str(p.kubelet_root),
            "--cert-dir", str(p.kubelet_root / "pki"),
            "--hostname-override", self.name,
            "--node-ip", NODE_IP,
            "--node-labels", f"{LABEL_REAL_NODE}=true,{names.LABEL_SHARING}="
                             f"{self.settings.sharing_mode}",
            "--v", "2",
        ]

    def start_kubelet(self) -> None:
        if _pid_alive(self.paths, "kubelet", str(self.paths.kubelet_config)) is None:
            _spawn(self.paths, "kubelet", self.kubelet_command())

    def stop_kubelet(self) -> bool:
        return _stop(self.paths, "kubelet", str(self.paths.kubelet_config))

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            log = self.paths.log("kubelet").read_text(errors="replace")
            if "strict decoding failed" in log.rsplit("\n==== ", 1)[-1]:
                raise NodeError(f"the kubelet ignored part of {self.paths.kubelet_config}: "
                                + log.split("strict decoding error: ", 1)[1].split("\n")[0])
            return self.ready()

        _wait(f"node {self.name} to be Ready", ready, timeout, self.paths.log("kubelet"),
              interval=1.0)

    # --- kube-proxy ----------------------------------------------------------------------

    def kube_proxy_config_path(self) -> Path:
        return self.paths.etc / "kube-proxy.yaml"

    def start_kube_proxy(self) -> None:
        path = self.kube_proxy_config_path()
        path.write_text(yaml.safe_dump(kube_proxy_configuration(
            self.paths, self.name, self.paths.kubelet_kubeconfig), sort_keys=False))
        binary = kube_proxy_binary()
        (self.paths.etc / "kube-proxy.binary").write_text(str(binary))  # for `down`
        if _pid_alive(self.paths, "kube-proxy", str(path)) is None:
            _spawn(self.paths, "kube-proxy", [str(binary), "--config", str(path), "--v", "2"])
        _wait("kube-proxy to sync its rules", lambda: _http_ok("http://127.0.0.1:10256/healthz"),
              60, self.paths.log("kube-proxy"), interval=0.5)

    # --- ClusterIPs without iptables -----------------------------------------------------

    def service_proxy_command(self) -> list[str]:
        services = dict.fromkeys(("default/kubernetes", *self.settings.userspace_services))
        return [sys.executable, "-m", "carpool_testbed.serviceproxy",
                "--kubectl", str(self.cluster.bin_dir / "kubectl"),
                "--kubeconfig", str(self.paths.kubelet_kubeconfig),
                *(f"--service={s}" for s in services)]

    def start_service_proxy(self) -> None:
        if _pid_alive(self.paths, "serviceproxy", "carpool_testbed.serviceproxy") is None:
            _spawn(self.paths, "serviceproxy", self.service_proxy_command())

        def api_reachable() -> bool:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                return sock.connect_ex((devcluster.KUBERNETES_SERVICE_IP, 443)) == 0

        _wait("the API server at its ClusterIP", api_reachable, 60,
              self.paths.log("serviceproxy"), interval=0.5)

    # --- device plugin ------------------------------------------------------------------

    def plugin_command(self) -> list[str]:
        p = self.paths
        return [
            sys.executable, "-m", "carpool.deviceplugin",
            "--node-name", self.name,
            "--backend", "fake", "--fake-spec", str(p.fake_gpus),
            "--fake-usage-file", str(p.fake_usage),
            "--sharing-mode", self.settings.sharing_mode,
            "--shares-per-gpu", str(self.settings.shares_per_gpu),
            "--plugin-dir", str(p.plugin_dir),
            "--mps-pipe-dir", str(p.mps_dir / "pipe"),
            "--mps-log-dir", str(p.mps_dir / "log"),
            "--metrics-port", "0",
            "--publish-interval", "5",
            "--reports-dir", str(p.reports),
            "--kubeconfig", str(self.cluster.kubeconfig),
            "--device-delivery", "cdi", "--cdi-spec-dir", str(p.cdi_spec_dir),
        ] + (["--allow-unowned-pods"] if self.settings.serve_unowned else [])

    def start_plugin(self) -> None:
        p = self.paths
        p.etc.mkdir(parents=True, exist_ok=True)
        p.fake_gpus.write_text(yaml.safe_dump(fake_gpu_spec(self.name), sort_keys=False))
        p.fake_usage.unlink(missing_ok=True)  # no process holds GPU memory yet
        (p.mps_dir / "pipe").mkdir(parents=True, exist_ok=True)
        if _pid_alive(p, "deviceplugin", "carpool.deviceplugin") is None:
            _spawn(p, "deviceplugin", self.plugin_command())

    def stop_plugin(self) -> bool:
        return _stop(self.paths, "deviceplugin", "carpool.deviceplugin")

    def wait_shares(self, timeout: float = 60) -> None:
        want = self.expected_shares()
        _wait(f"node {self.name} to advertise {want} {names.RESOURCE_GPU}",
              lambda: self.allocatable_shares() == want, timeout,
              self.paths.log("deviceplugin"), interval=0.5)

    def restart_plugin(self, settings: NodeSettings | None = None) -> None:
        """Restarts the plugin (with `settings`, if given) and returns once the kubelet serves
        the new plugin's devices.

        The node's allocatable lags the kubelet's device manager by a status report, so a pod
        created as soon as the shares show could still meet the stopped plugin's devices,
        which the kubelet marked unhealthy. Seeing the shares drop to 0 first, then come
        back, means the kubelet has taken the new plugin's healthy devices."""
        assert self.stop_plugin(), "the device plugin was not running"
        _wait(f"node {self.name} to drop its {names.RESOURCE_GPU} shares",
              lambda: self.allocatable_shares() == 0, 60, self.paths.log("deviceplugin"),
              interval=0.5)
        if settings is not None:
            self.settings = settings
        self.start_plugin()
        self.wait_shares()

    def set_gpu_usage(self, processes: Sequence[tuple[int, str, int]]) -> None:
        """What the fake GPUs report from now on: (host pid, GPU UUID, MiB) per process, as
        NVML would list them. Written aside and renamed over: the plugin never reads half."""
        aside = self.paths.fake_usage.with_suffix(".tmp")
        aside.write_text(json.dumps({"processes": [
            {"pid": pid, "gpu": gpu, "usedMiB": mib} for pid, gpu, mib in processes]}))
        aside.replace(self.paths.fake_usage)

    def registrations(self) -> int:
        """How many times the plugin has registered with a kubelet (from its log)."""
        log = self.paths.log("deviceplugin")
        if not log.is_file():
            return 0
        return log.read_text(errors="replace").count("with the kubelet (")


def pod_pids(pod_uid: str, marker: str = "", proc: Path = Path("/proc")) -> list[int]:
    """Host pids of a pod's processes (by their cgroup, as the device plugin's watchdog finds
    them) whose command line holds `marker` (the sandbox's pause process has its own)."""
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or pod_of_pid(int(entry.name), proc) != pod_uid:
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if marker in command:
            out.append(int(entry.name))
    return sorted(out)


def start(cluster: devcluster.Cluster, settings: NodeSettings | None = None,
          paths: NodePaths | None = None, timings: Timings | None = None) -> RealNode:
    """Installs, configures and starts containerd, the kubelet and the device plugin."""
    node = RealNode(cluster, settings or NodeSettings(), paths or NodePaths.default(),
                    timings or Timings())
    if os.geteuid() != 0:
        raise NodeError("the real node needs root (containerd, runc, mounts, the CNI bridge, "
                        "/var/lib/kubelet/device-plugins); run it as root or skip it")
    t = node.timings
    install_packages(t, iptables=node.settings.kube_proxy)
    with t.stage(f"containerd ({node.settings.snapshotter} snapshotter)"):
        node.start_containerd()
    with t.stage("pause and test images: build OCI archives, ctr images import"):
        for ref in node.import_images():
            print(f"    {ref}", file=sys.stderr)
    with t.stage(f"kubelet {cluster.bin_dir.name.split('-')[1]}: register node {node.name}"):
        node.write_kubelet_files()
        set_hosts_entry(node.name, present=True)
        node.start_kubelet()
        node.wait_ready()
    if node.settings.kube_proxy:
        with t.stage("kube-proxy (iptables) synced"):
            node.start_kube_proxy()
    if node.settings.userspace_services:
        with t.stage("service proxy (user space) serves the API server's ClusterIP"):
            node.start_service_proxy()
    if node.settings.device_plugin:
        with t.stage("device plugin (fake backend) registered; node advertises shares"):
            crds.apply_crds(cluster.api())  # the plugin publishes the node's GpuNode
            node.start_plugin()
            node.wait_shares()
    return node


def attach(cluster: devcluster.Cluster, settings: NodeSettings, paths: NodePaths,
           timings: Timings | None = None) -> RealNode | None:
    """The node an earlier `up` left running (its kubelet alive and the Node Ready), or None."""
    if _pid_alive(paths, "kubelet", str(paths.kubelet_config)) is None:
        return None
    node = RealNode(cluster, settings, paths, timings or Timings())
    return node if node.ready() else None


def _mounts_under(base: Path) -> list[str]:
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            point = line.split()[1].replace("\\040", " ")
            if point == str(base) or point.startswith(f"{base}/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def _shim_pids(paths: NodePaths) -> list[int]:
    """containerd shims started by our containerd (they name its socket on their command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (cmdline and cmdline[0].endswith(b"containerd-shim-runc-v2")
                and str(paths.containerd_socket).encode() in cmdline):
            pids.append(int(proc.name))
    return pids


def stop(paths: NodePaths | None = None, cluster: devcluster.Cluster | None = None,
         node_name: str = DEFAULT_NODE_NAME) -> list[str]:
    """Stops the plugin, kubelet, containers and containerd; unmounts; deletes the Node.

    Only processes recorded in our pid files (checked against their command line) and shims
    of our own containerd are signalled. Returns what was done, for the log.
    """
    p = paths or NodePaths.default()
    done = []
    if cluster is not None and _pid_alive(p, "kubelet", str(p.kubelet_config)) is not None:
        # Let the kubelet tear its pods down through CRI (sandboxes, CNI DEL, netns, logs).
        drained = cluster.kubectl("delete", "pods", "--all-namespaces", "--field-selector",
                                  f"spec.nodeName={node_name}", "--grace-period=1",
                                  "--timeout=60s", check=False, timeout=90)
        done += [line for line in drained.stdout.splitlines() if line.strip()]
    if _stop(p, "deviceplugin", "carpool.deviceplugin"):
        done.append("device plugin stopped")
    if _stop(p, "kubelet", str(p.kubelet_config)):
        done.append("kubelet stopped")
    proxy_config = p.etc / "kube-proxy.yaml"
    if _stop(p, "kube-proxy", str(proxy_config)):
        done.append("kube-proxy stopped")
    proxy_binary = p.etc / "kube-proxy.binary"
    if proxy_binary.is_file():
        # Its chains in the machine's iptables go with it.
        binary = proxy_binary.read_text().strip()
        if Path(binary).is_file():
            subprocess.run([binary, "--cleanup"], capture_output=True, check=False, timeout=60)
            done.append("kube-proxy rules removed")
        proxy_binary.unlink()
    proxy_config.unlink(missing_ok=True)
    if _stop(p, "serviceproxy", "carpool_testbed.serviceproxy"):
        done.append("service proxy stopped")
    for address in _service_addresses_on_loopback():
        subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", "lo"], capture_output=True,
                       check=False)
        done.append(f"{address} removed from lo")
    if _socket_answers(p.containerd_socket):
        for task in ctr(p, "tasks", "ls", "-q", check=False).stdout.split():
            ctr(p, "tasks", "kill", "-s", "SIGKILL", task, check=False)
        time.sleep(0.5)
        for task in ctr(p, "tasks", "ls", "-q", check=False).stdout.split():
            ctr(p, "tasks", "delete", "-f", task, check=False)
        containers = ctr(p, "containers", "ls", "-q", check=False).stdout.split()
        if containers:
            ctr(p, "containers", "delete", *containers, check=False)
            done.append(f"{len(containers)} containers removed")
    if _stop(p, "containerd", str(p.containerd_config)):
        done.append("containerd stopped")
    for pid in _shim_pids(p):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        done.append(f"shim {pid} killed")
    for point in _mounts_under(p.base):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        done.append(f"unmounted {point}")
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
    if _pid_alive(p, "kubelet", str(p.kubelet_config)) is None:
        # What our kubelet left in its fixed device-plugin directory.
        for name in ("kubelet.sock", "kubelet_internal_checkpoint"):
            (p.plugin_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        set_hosts_entry(node_name, present=False)
    if cluster is not None:
        for kind in ("node", "gpunode"):
            gone = cluster.kubectl("delete", kind, node_name, "--ignore-not-found", check=False)
            if gone.stdout.strip():
                done.append(gone.stdout.strip())
    return done


def _service_addresses_on_loopback() -> list[str]:
    """ClusterIPs the service proxy put on lo (the API server's service range, 10.0.0.0/24)."""
    shown = subprocess.run(["ip", "-4", "addr", "show", "dev", "lo"], capture_output=True,
                           text=True, check=False).stdout
    prefix = devcluster.KUBERNETES_SERVICE_IP.rsplit(".", 1)[0] + "."
    return [word.split("/")[0] for line in shown.splitlines() for word in line.split()[1:2]
            if line.strip().startswith("inet ") and word.startswith(prefix)
            and word.endswith("/32")]


def reset(paths: NodePaths) -> None:
    """Forgets the last run's pods: the kubelet's root (checkpoints, pod dirs), pod logs,
    containerd's state and CNI addresses. Images in containerd's content store stay."""
    leftover = _mounts_under(paths.base)
    if leftover:
        raise NodeError(f"still mounted under {paths.base}: {', '.join(leftover)}")
    for folder in (paths.kubelet_root, paths.pod_logs, paths.containerd_state,
                   paths.cni_ipam_dir):
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def running_node(cluster: devcluster.Cluster, settings: NodeSettings | None = None,
                 timings: Timings | None = None) -> Iterator[RealNode]:
    """The real node for a block (the e2e session): started clean, stopped and removed after."""
    paths = NodePaths.default()
    with exclusive(paths, wait_s=240):
        stop(paths, cluster, (settings or NodeSettings()).name)
        reset(paths)
        node = start(cluster, settings, paths, timings)
        try:
            yield node
        finally:
            for line in stop(paths, cluster, node.name):
                print(f"    {line}", file=sys.stderr)


@contextlib.contextmanager
def exclusive(paths: NodePaths, wait_s: float = 0) -> Iterator[None]:
    """One real node per machine (fixed kubelet port, device-plugin dir, bridge): a lock file.

    Waits up to `wait_s` for another holder (an e2e session, `make node`) to finish.
    """
    paths.base.mkdir(parents=True, exist_ok=True)
    with (paths.base / "lock").open("a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.seek(0)
                    raise NodeError(f"the real node is in use ({paths.base / 'lock'}: "
                                    f"{handle.read().strip() or 'unknown holder'})") from None
                time.sleep(1)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:200]}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool_testbed.realnode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default=DEFAULT_NODE_NAME, help="the Node's name")
    parser.add_argument("--snapshotter", default="overlayfs", choices=("overlayfs", "native"))
    parser.add_argument("--no-device-plugin", action="store_true",
                        help="start no device plugin on the host (the chart's DaemonSet will)")
    parser.add_argument("--kube-proxy", action="store_true",
                        default=os.environ.get(KUBE_PROXY_ENV, "") not in ("", "0"),
                        help="run kube-proxy for the node (Carpool's chart as pods; needs a "
                             "cluster made with `devcluster up --pods`)")
    parser.add_argument("--registry", default=registry_address(),
                        help="the registry containerd pulls from over HTTP (hosts.toml); "
                             "default $CARPOOL_REGISTRY or " + DEFAULT_REGISTRY)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="join a real node to the running `make cluster` cluster")
    sub.add_parser("down", help="stop the node's processes and delete its Node")
    sub.add_parser("images", help="only write the OCI archives (prints their paths)")
    sub.add_parser("config", help="print the generated containerd, CNI and kubelet files")
    args = parser.parse_args(argv)
    paths = NodePaths.default()
    try:
        if args.command == "images":
            for ref, archive in build_images(paths).items():
                print(f"{ref}\t{archive}")
            return 0
        if args.command == "config":
            settings = NodeSettings(name=args.name, snapshotter=args.snapshotter)
            print(f"# {paths.containerd_config}\n{containerd_config(paths, settings.snapshotter)}")
            print(f"# {paths.registry_hosts / args.registry}/hosts.toml\n"
                  f"{registry_hosts_toml(args.registry)}")
            print(f"# {paths.cni_conf_dir}/10-carpool.conflist\n"
                  f"{json.dumps(cni_config(paths), indent=2)}\n")
            print(f"# {paths.kubelet_config}\n" + yaml.safe_dump(
                kubelet_configuration(paths, settings.kubelet_port, settings.max_pods),
                sort_keys=False))
            return 0
        cluster_paths = devcluster.ClusterPaths.for_name()
        bin_dir = devcluster.known_bin_dir(cluster_paths)
        cluster = None
        if bin_dir is not None and cluster_paths.kubeconfig.is_file():
            cluster = devcluster.Cluster.at(cluster_paths, bin_dir, devcluster.extender_port())
        if args.command == "down":
            with exclusive(paths):
                for line in stop(paths, cluster, args.name):
                    print(line)
            return 0
        if cluster is None:
            raise NodeError("no local cluster; run `make cluster` first")
        with exclusive(paths):
            node = start(cluster, NodeSettings(name=args.name, snapshotter=args.snapshotter,
                                               device_plugin=not args.no_device_plugin,
                                               kube_proxy=args.kube_proxy,
                                               registry=args.registry), paths)
        print(node.timings.table())
        print(f"node {node.name} is Ready; logs in {paths.logs}")
        return 0
    except (NodeError, devcluster.ClusterError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
