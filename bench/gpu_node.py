"""Carpool on a real GPU node as users run it (`make gpu-node`): everything through pods.

On the GPU machine (root; hack/gpu-node/unpack.sh has put the carried binaries in place) it
starts a control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, through
the test bed's devcluster), a real node (containerd with CDI, runc, a CNI bridge, the kubelet:
testbed/realnode.py), a local registry with Carpool's images, and `helm install`s the chart with
the real NVML backend and the chart's MPS daemon. Then, each through GpuJobs or pods:

  node       the GpuNode status the chart's device plugin published from NVML
  tenants    two projects' 8 GiB / 25 % MPS jobs (images with different USERs) on one GPU at
             once: what each container sees, 10 GiB refused and 6 GiB allowed, and bf16 matmul
             throughput against each alone and both time-sliced
  nogrant    a pod with no grant whose image sets NVIDIA_VISIBLE_DEVICES=all
  isolation  the isolation table of `make gpu-check` (bench/gpu_sharing.py part e), each
             client a GpuJob whose process changes its own environment before CUDA starts
  watchdog   an MPS job that raises its memory limit and holds 20 GiB of an 8 GiB grant
  preempt    a preemptible GPU training job preempted by another project's job: checkpoint
             on SIGTERM, resume from it on the GPU

Job images are built on the machine from its own Python and PyTorch (one layer of those files,
imported into containerd), so gigabytes never travel. `--fake` runs the same plumbing on a
machine without GPUs (the plugin's fake backend; job images from the running Python, without
PyTorch, so the workers report no GPU): `node`, `tenants` and `nogrant` only.
Results: tables on stdout, everything measured in `--out`/gpu-node.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from carpool.core import names
from carpool_testbed import devcluster, realnode

REPO = Path(__file__).resolve().parents[1]

CLUSTER = "carpool-gpu"
RELEASE = "carpool"
NAMESPACE = "carpool-system"
EXTENDER_IP = "10.0.0.155"
JOB_REPO = "carpool.local/job"
CDI_KIND = "nvidia.com/gpu"
CDI_SPEC = Path("/etc/cdi/carpool-nvidia.yaml")
WORKER = "/opt/carpool/bench/gpu_node_worker.py"
TENANTS = {"team-a": 1001, "team-b": 1002}
PARTS = ("node", "tenants", "nogrant", "isolation", "watchdog", "preempt")
GRANT_MEMORY, GRANT_CORES = "8Gi", 25
NVIDIA_RUNTIME_CLASS = "nvidia"
NVIDIA_RUNTIME_CONFIG = Path("/etc/nvidia-container-runtime/config.toml")


def say(text: str) -> None:
    print(f"==> [gpu-node {time.strftime('%H:%M:%S')}] {text}", flush=True)


@contextlib.contextmanager
def stage(title: str, timings: dict[str, float]) -> Iterator[None]:
    say(title)
    start = time.monotonic()
    try:
        yield
    finally:
        timings[title] = round(time.monotonic() - start, 1)
        print(f"    done in {timings[title]:.1f}s", flush=True)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 1.0,
             diagnose: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    extra = f"\n{diagnose()}" if diagnose else ""
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}; last: "
                       f"{str(last)[:800]}{extra}")


# --------------------------------------------------------------------------------------------
# The node's GPUs for containerd: a CDI spec (what `nvidia-ctk cdi generate` writes)


def driver_files() -> tuple[list[str], list[str], list[str]]:
    """Device nodes, driver libraries and driver programs on this machine."""
    nodes = sorted(str(p) for p in Path("/dev").glob("nvidia*")
                   if not p.is_dir() and p.name != "nvidia-caps")
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                            check=False).stdout
    wanted = re.compile(r"^(libcuda|libnvidia-ml|libnvidia-ptxjitcompiler|libnvidia-nvvm|"
                        r"libcudadebugger|libnvidia-gpucomp|libnvidia-allocator|"
                        r"libnvidia-pkcs11)\.so")
    libs: set[str] = set()
    for line in listed.splitlines():
        if "=>" not in line:
            continue
        name, path = line.strip().split(" ", 1)[0], line.rsplit("=>", 1)[1].strip()
        if wanted.match(name) and "x86-64" in line:
            libs.add(path)
            libs.add(os.path.realpath(path))
    programs = [p for name in ("nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
                               "nvidia-debugdump")
                if (p := shutil.which(name))]
    return nodes, sorted(libs), programs


def cdi_spec(gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """One CDI device per GPU (by index and by UUID) and `all`; the driver's libraries and
    programs are mounted at /usr/lib/x86_64-linux-gnu and /usr/bin in the container."""
    nodes, libs, programs = driver_files()
    common = [n for n in nodes if not re.fullmatch(r"/dev/nvidia\d+", n)]
    mounts = [{"hostPath": lib, "containerPath": f"/usr/lib/x86_64-linux-gnu/{Path(lib).name}",
               "options": ["ro", "nosuid", "nodev", "bind"]} for lib in libs]
    mounts += [{"hostPath": p, "containerPath": f"/usr/bin/{Path(p).name}",
                "options": ["ro", "nosuid", "nodev", "bind"]} for p in programs]
    devices = []
    for gpu in gpus:
        edits = {"deviceNodes": [{"path": f"/dev/nvidia{gpu['index']}"}]}
        devices += [{"name": str(gpu["index"]), "containerEdits": edits},
                    {"name": gpu["uuid"], "containerEdits": edits}]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": [
        {"path": f"/dev/nvidia{g['index']}"} for g in gpus]}})
    return {"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": devices,
            "containerEdits": {"deviceNodes": [{"path": n} for n in common], "mounts": mounts}}


def nvidia_runtime_config() -> str:
    """The NVIDIA container runtime in CDI mode: NVIDIA_VISIBLE_DEVICES=all in a container of
    its RuntimeClass becomes the CDI device `nvidia.com/gpu=all` of the spec above."""
    return f"""[nvidia-container-runtime]
log-level = "info"
mode = "cdi"
runtimes = ["runc"]

[nvidia-container-runtime.modes.cdi]
default-kind = "{CDI_KIND}"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]
annotation-prefixes = ["cdi.k8s.io/"]
"""


def host_gpus() -> list[dict[str, Any]]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,"
                          "driver_version,compute_mode", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    return [{"index": int(r[0]), "uuid": r[1], "name": r[2], "memory_mib": int(r[3]),
             "driver": r[4], "compute_mode": r[5]} for r in rows]


# --------------------------------------------------------------------------------------------
# Job images from this machine's Python and PyTorch


def torch_closure(roots: tuple[str, ...] = ("torch", "numpy")
                  ) -> list[importlib.metadata.Distribution]:
    """torch and every distribution it requires, with the extras it asks for (torch's CUDA
    libraries come as extras of `cuda-toolkit`); other markers are ignored: more is harmless."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    extras: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        requirement = todo.pop()
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(\[([^\]]*)\])?", requirement)
        if not match:
            continue
        name = match.group(1).lower().replace("_", "-")
        wanted = {e.strip() for e in (match.group(3) or "").split(",") if e.strip()}
        if name in seen and wanted <= extras[name]:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        extras[name] = extras.get(name, set()) | wanted
        for r in dist.requires or []:
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", r)
            if extra is None or extra.group(1) in extras[name]:
                todo.append(r)
    return list(seen.values())


def shared_libraries(files: list[Path]) -> set[str]:
    """What the dynamic loader resolves for `files` (ldd), the driver's libraries left out:
    those come from the node (CDI), never from an image."""
    found: set[str] = set()
    for chunk in range(0, len(files), 200):
        out = subprocess.run(["ldd", *map(str, files[chunk:chunk + 200])], capture_output=True,
                             text=True, check=False).stdout
        for line in out.splitlines():
            match = re.search(r"(/\S+) \(0x", line)
            if match and not re.search(r"/(libcuda|libnvidia-)", match.group(1)):
                found.add(match.group(1))
    return found


def link_chain(path: Path) -> list[str]:
    """`path` and every symlink it passes through to its file, so the links work in a layer."""
    chain = []
    for _ in range(16):
        chain.append(str(path))
        if not path.is_symlink():
            break
        target = Path(os.readlink(path))
        path = target if target.is_absolute() else path.parent / target
        path = Path(os.path.realpath(path.parent)) / path.name
    return chain


def layer_paths() -> list[str]:
    """Absolute paths (files and symlinks, real directories) for the PyTorch layer."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    paths: set[str] = set()
    for dist in torch_closure():
        for f in dist.files or []:
            full = (site / f).resolve() if not (site / f).is_symlink() else site / f
            if full.exists() and "__pycache__" not in full.parts:
                paths.add(str(full))
    # Whole trees where a distribution's file list may miss what is loaded at run time.
    for tree in ("torch", "nvidia", "triton"):
        for p in (site / tree).rglob("*"):
            if "__pycache__" not in p.parts and (p.is_file() or p.is_symlink()):
                paths.add(str(p))
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for p in stdlib.rglob("*"):
        if not {"test", "tests", "idlelib", "__pycache__", "tkinter", "turtledemo"} & set(
                p.relative_to(stdlib).parts) and (p.is_file() or p.is_symlink()):
            paths.add(str(p))
    executable = Path(os.path.realpath(sys.executable))
    venv = Path(sys.prefix)
    if venv != Path(sys.base_prefix):
        paths.add(str(venv / "pyvenv.cfg"))
    for start in [Path(sys.executable), *(venv / "bin").glob("python*")]:
        paths.update(link_chain(start))
    objects = [executable] + [Path(p) for p in paths if ".so" in Path(p).name]
    for lib in shared_libraries(objects):
        real_dir = Path(os.path.realpath(Path(lib).parent))
        paths.add(str(real_dir / Path(lib).name))
        paths.add(os.path.realpath(lib))
    paths.add("/usr/lib64/ld-linux-x86-64.so.2")
    return sorted(p for p in paths if os.path.lexists(p))


def small_layer(busybox: Path) -> bytes:
    """The worker, carpool's workload API, /etc/passwd for both tenants, a shell, the merged
    /usr links, /tmp."""
    import io

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes | None = None, mode: int = 0o644,
                link: str | None = None, kind: bytes = tarfile.REGTYPE) -> None:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, 0
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif kind == tarfile.DIRTYPE:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                payload = data or b""
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))

        for top in ("bin", "sbin", "lib", "lib64"):
            if os.path.islink(f"/{top}"):
                add(top, link=os.readlink(f"/{top}"))
        add("tmp", mode=0o1777, kind=tarfile.DIRTYPE)
        for name in ("etc", "opt", "opt/carpool", "opt/carpool/bench", "usr", "usr/bin",
                     "home", "dev", "proc", "sys", "run", "var"):
            add(name, mode=0o755, kind=tarfile.DIRTYPE)
        users = "".join(f"{t}:x:{u}:{u}:{t}:/tmp:/bin/sh\n" for t, u in TENANTS.items())
        add("etc/passwd", f"root:x:0:0:root:/root:/bin/sh\n{users}".encode())
        add("etc/group", ("root:x:0:\n" + "".join(f"{t}:x:{u}:\n" for t, u in
                                                 TENANTS.items())).encode())
        add("usr/bin/busybox", busybox.read_bytes(), 0o755)
        for applet in ("sh", "ls", "cat", "env", "id", "sleep", "touch"):
            add(f"usr/bin/{applet}", link="busybox")
        add(WORKER.lstrip("/"), (REPO / "bench" / "gpu_node_worker.py").read_bytes())
        source = REPO / "src" / "carpool"
        for path in sorted(source.rglob("*.py")):
            add(f"opt/carpool/src/carpool/{path.relative_to(source)}", path.read_bytes())
    return buffer.getvalue()


def build_job_images(node: realnode.RealNode, work: Path) -> dict[str, str]:
    """Three images sharing two layers (this machine's PyTorch; the worker): `job-a` runs as
    UID 1001, `job-b` as 1002, `nogrant` as 1001 and sets NVIDIA_VISIBLE_DEVICES=all, as CUDA
    images do. Written as an OCI layout and streamed into `ctr images import`."""
    layout = work / "job-layout"
    shutil.rmtree(layout, ignore_errors=True)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    listing = work / "torch-layer.list"
    paths = layer_paths()
    listing.write_text("\n".join(p.lstrip("/") for p in paths) + "\n")
    big = work / "torch-layer.tar"
    # One pass over the gigabytes: tar writes the layer and sha256sum names it on the way.
    hashed = subprocess.run(
        f"set -o pipefail; tar -C / --create --file - --no-recursion --numeric-owner "
        f"--owner=0 --group=0 --mtime=@0 --files-from {listing} | tee {big} | sha256sum",
        shell=True, executable="/bin/bash", capture_output=True, text=True, check=False)
    if hashed.returncode != 0:
        raise RuntimeError(f"the PyTorch layer: {hashed.stderr[-2000:]}")
    big_digest = "sha256:" + hashed.stdout.split()[0]
    big.rename(blobs / big_digest.split(":")[1])
    small = small_layer(Path(realnode.BUSYBOX))
    small_digest = "sha256:" + hashlib.sha256(small).hexdigest()
    (blobs / small_digest.split(":")[1]).write_bytes(small)
    layers = [(big_digest, (blobs / big_digest.split(":")[1]).stat().st_size),
              (small_digest, len(small))]
    venv_bin = str(Path(sys.prefix) / "bin")
    base_env = [f"PATH={venv_bin}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH=/opt/carpool/src",
                "HOME=/tmp", "PYTHONUNBUFFERED=1"]
    images = {"job-a": ("1001", []), "job-b": ("1002", []),
              "nogrant": ("1001", ["NVIDIA_VISIBLE_DEVICES=all",
                                   "NVIDIA_DRIVER_CAPABILITIES=compute,utility"])}
    manifests = []
    refs = {}
    for name, (user, env) in images.items():
        config = {**realnode.oci_platform(),
                  "config": {"Env": base_env + env, "User": user, "WorkingDir": "/tmp",
                             "Cmd": ["python3", WORKER]},
                  "rootfs": {"type": "layers", "diff_ids": [d for d, _ in layers]}}
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
        (blobs / config_digest.split(":")[1]).write_bytes(config_bytes)
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                               "digest": config_digest, "size": len(config_bytes)},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                "digest": d, "size": s} for d, s in layers]}
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
        (blobs / manifest_digest.split(":")[1]).write_bytes(manifest_bytes)
        ref = f"{JOB_REPO}-{name}:1"
        refs[name] = ref
        manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "digest": manifest_digest, "size": len(manifest_bytes),
                          "platform": realnode.oci_platform(),
                          "annotations": {"io.containerd.image.name": ref,
                                          "org.opencontainers.image.ref.name": "1"}})
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (layout / "index.json").write_text(json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
         "manifests": manifests}))
    tar = subprocess.Popen(["tar", "-C", str(layout), "-cf", "-", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        [str(realnode.containerd_bin_dir() / "ctr"), "--address",
         str(node.paths.containerd_socket), "-n", realnode.CRI_NAMESPACE,
         "images", "import", "--snapshotter", node.settings.snapshotter, "-"],
        stdin=tar.stdout, capture_output=True, text=True, check=False)
    tar.wait()
    if imported.returncode != 0:
        raise RuntimeError(f"ctr images import of the job images failed: {imported.stderr}")
    shutil.rmtree(layout, ignore_errors=True)
    say(f"job images: {len(paths)} files, PyTorch layer {layers[0][1] / 2**30:.2f} GiB; "
        f"{', '.join(refs.values())}")
    return refs


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Bench:
    node: realnode.RealNode
    helm: Path
    fake: bool
    out: Path
    results: dict[str, Any] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Where the plugin hands GPUs out through NVIDIA_VISIBLE_DEVICES (its env delivery), job
    # containers need the NVIDIA runtime's RuntimeClass; with CDI delivery, none.
    job_runtime_class: str = ""
    watchdog_isolation: str = "mps"

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.node.kubectl(*args, check=check, stdin=stdin, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def as_tenant(self, user: str, *args: str, stdin: str | None = None) -> str:
        return self.kubectl("--as", user, *args, stdin=stdin).stdout

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-node.json").write_text(json.dumps(
            {"results": self.results, "timings": self.timings}, indent=2, default=str))

    # --- install ---------------------------------------------------------------------------

    def values(self, refs: dict[str, str]) -> dict[str, Any]:
        def split(ref: str) -> tuple[str, str]:
            repo, tag = ref.split("@")[0].rsplit(":", 1)
            return repo, tag

        on_node = {"nodeSelector": {"kubernetes.io/hostname": self.node.name},
                   "tolerations": [toleration()]}
        carpool_repo, tag = split(refs["carpool"])
        mps_repo, mps_tag = split(refs["carpool-mps"])
        sched_repo, sched_tag = split(refs["kube-scheduler"])
        # The plugin writes the node's CDI spec where this node's containerd reads it.
        plugin: dict[str, Any] = {"sharingModes": ["mps"], "publishInterval": 5,
                                  "tolerations": [toleration()],
                                  "cdi": {"specDir": str(self.node.paths.cdi_spec_dir)}}
        values: dict[str, Any] = {
            "image": {"repository": carpool_repo, "tag": tag, "pullPolicy": "Always"},
            "mpsDaemon": {"image": {"repository": mps_repo, "tag": mps_tag,
                                    "pullPolicy": "Always"},
                          # the card's compute mode is not ours to change
                          "exclusiveProcess": False},
            "scheduler": {"image": {"repository": sched_repo, "tag": sched_tag,
                                    "pullPolicy": "Always"}, **on_node},
            "operator": {"resyncSeconds": 2, **on_node},
            "extender": {"serviceClusterIP": EXTENDER_IP, **on_node},
            "devicePlugin": plugin,
        }
        if self.fake:
            plugin |= {"backend": "fake", "fakeGpus": [{"model": "H200", "count": 1}]}
        else:
            # The plugin (NVML) and the MPS daemon reach the driver through the NVIDIA runtime
            # (its RuntimeClass, which the operator also puts on job pods); job containers get
            # their GPUs only as the CDI devices Allocate names (NVIDIA_VISIBLE_DEVICES=void).
            plugin["runtimeClassName"] = NVIDIA_RUNTIME_CLASS
            # job containers get the driver's files from the spec-wide edits of that spec
            plugin["cdi"]["driverSpec"] = str(CDI_SPEC)
        return values

    def install(self, refs: dict[str, str]) -> None:
        """`helm install` (a release an earlier run left is uninstalled first), then waits
        until every Carpool pod is Ready."""
        subprocess.run([str(self.helm), "--kubeconfig", str(self.node.cluster.kubeconfig),
                        "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--ignore-not-found"],
                       capture_output=True, text=True, timeout=300, check=False)
        values = self.out / "values.yaml"
        values.write_text(yaml.safe_dump(self.values(refs)))
        done = subprocess.run([str(self.helm), "--kubeconfig", str(self.node.cluster.kubeconfig),
                               "install", RELEASE, str(REPO / "helm" / "carpool"), "-n",
                               NAMESPACE, "--create-namespace", "-f", str(values)],
                              capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"helm install: {done.stderr[-3000:]}")
        wanted = {"operator": 2, "extender": 1, "scheduler": 1, "device-plugin": 1,
                  "mps-daemon": 1}

        def all_ready() -> bool:
            counts: dict[str, int] = {}
            for pod in self.json("get", "pods", "-n", NAMESPACE)["items"]:
                if ready(pod):
                    part = pod["metadata"]["labels"].get("app.kubernetes.io/component", "?")
                    counts[part] = counts.get(part, 0) + 1
            return counts == wanted

        wait_for("every Carpool pod Running and Ready", all_ready, 300, 2,
                 diagnose=self.diagnose)

    def installed(self) -> bool:
        """The release is deployed and every Carpool pod is Ready (a run before this one)."""
        done = subprocess.run([str(self.helm), "--kubeconfig", str(self.node.cluster.kubeconfig),
                               "status", RELEASE, "-n", NAMESPACE], capture_output=True,
                              text=True, check=False)
        pods = self.json("get", "pods", "-n", NAMESPACE)["items"] if done.returncode == 0 else []
        return bool(pods) and all(ready(p) for p in pods)

    def imported_job_images(self) -> dict[str, str]:
        listed = realnode.ctr(self.node.paths, "images", "ls", "-q").stdout.split()
        refs = {name: f"{JOB_REPO}-{name}:1" for name in ("job-a", "job-b", "nogrant")}
        return refs if all(ref in listed for ref in refs.values()) else {}

    def diagnose(self) -> str:
        out = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout,
               self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp",
                            check=False).stdout[-5000:]]
        for pod in self.json("get", "pods", "-n", NAMESPACE)["items"]:
            name = pod["metadata"]["name"]
            out.append(f"--- {name}\n" + self.kubectl(
                "logs", "-n", NAMESPACE, name, "--all-containers", "--tail=30",
                check=False).stdout)
        return "\n".join(out)

    # --- tenants ---------------------------------------------------------------------------

    def setup_tenants(self) -> None:
        objects: list[dict[str, Any]] = []
        for team in TENANTS:
            objects += [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": team}},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": {"name": f"{team}-edit", "namespace": team},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": "edit"},
                 "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                               "name": f"{team}-user"}]},
                {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
                 "metadata": {"name": team},
                 "spec": {"namespaces": [team], "concurrent": {"gpus": 1}}},
            ]
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))

    def template(self, image: str, args: list[str], grace: int = 5,
                 runtime_class: str | None = None) -> dict[str, Any]:
        command = ["python3", WORKER, *args]
        runtime_class = self.job_runtime_class if runtime_class is None else runtime_class
        return {"spec": {
            **({"runtimeClassName": runtime_class} if runtime_class else {}),
            "nodeSelector": {"kubernetes.io/hostname": self.node.name},
            "tolerations": [toleration()], "dnsPolicy": "Default", "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace,
            "containers": [{"name": "main", "image": image,
                            "imagePullPolicy": "Never",
                            "command": command}]}}

    def gpujob(self, team: str, name: str, image: str, args: list[str],
               isolation: str = "mps", memory: str | None = GRANT_MEMORY,
               cores: int | None = GRANT_CORES,
               **spec: Any) -> dict[str, Any]:
        gpu: dict[str, Any] = {"count": 1, "isolation": isolation}
        if memory:
            gpu["memory"] = memory
        if cores:
            gpu["cores"] = cores
        body = {"project": team, "class": "short", "gpu": gpu, "estimatedDuration": "5m",
                "template": self.template(image, args)}
        body.update(spec)
        return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
                "metadata": {"name": name, "namespace": team}, "spec": body}

    def submit(self, *jobs: dict[str, Any]) -> None:
        for job in jobs:
            team = job["metadata"]["namespace"]
            self.as_tenant(f"{team}-user", "apply", "-f", "-", stdin=yaml.safe_dump(job))

    def job_status(self, team: str, name: str) -> dict[str, Any]:
        got = self.kubectl("get", "gpujob", name, "-n", team, "-o", "json", check=False)
        return dict(json.loads(got.stdout).get("status") or {}) if got.returncode == 0 else {}

    def pod_of(self, team: str, name: str) -> str | None:
        return self.job_status(team, name).get("podName")

    def logs(self, team: str, pod: str) -> str:
        return self.kubectl("logs", pod, "-n", team, check=False).stdout

    def result(self, team: str, name: str, timeout: float = 240) -> dict[str, Any]:
        """The job's final status and its worker's RESULT line."""
        status = wait_for(f"GpuJob {team}/{name} to finish", lambda: (
            s if (s := self.job_status(team, name)).get("phase") in ("Succeeded", "Failed")
            else None), timeout, diagnose=lambda: self.job_diagnose(team, name))
        log = self.logs(team, status.get("podName", ""))
        found = [line for line in log.splitlines() if line.startswith("RESULT ")]
        out: dict[str, Any] = json.loads(found[-1][7:]) if found else {"log": log[-1500:]}
        out["phase"] = status.get("phase")
        out["gpus"] = [g.get("uuid") for g in status.get("gpus") or []]
        return out

    def job_diagnose(self, team: str, name: str) -> str:
        pod = self.pod_of(team, name) or ""
        return "\n".join([
            json.dumps(self.job_status(team, name))[-1500:],
            self.kubectl("get", "events", "-n", team, check=False).stdout[-2500:],
            self.logs(team, pod)[-1500:] if pod else "(no pod)",
            self.kubectl("logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator",
                         "--tail=15", check=False).stdout])

    def delete_jobs(self, team: str) -> None:
        self.kubectl("delete", "gpujobs", "--all", "-n", team, "--wait=true", "--timeout=90s",
                     check=False)
        wait_for(f"{team}'s pods to go", lambda: not self.json("get", "pods", "-n", team)[
            "items"], 120, 1)

    # --- parts -----------------------------------------------------------------------------

    def part_node(self) -> None:
        gpunode = wait_for("the GpuNode's status", lambda: (
            g if (g := json.loads(self.kubectl("get", "gpunode", self.node.name, "-o", "json",
                                               check=False).stdout or "{}")).get("status")
            else None), 120, 2)
        self.results["gpunode"] = gpunode["status"]
        self.results["node_allocatable"] = self.json("get", "node", self.node.name)[
            "status"]["allocatable"]
        if not self.fake:
            self.results["host_gpus"] = host_gpus()

    def run_together(self, label: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Submits `jobs`, waits until each worker is READY, starts them together (touching
        /tmp/go in each container), and collects their results."""
        self.submit(*jobs)
        keys = [(j["metadata"]["namespace"], j["metadata"]["name"]) for j in jobs]

        def all_ready() -> bool:
            """Every worker READY, or ended without one (it saw no GPU: nothing to start)."""
            for team, name in keys:
                pod = self.pod_of(team, name)
                ended = self.job_status(team, name).get("phase") in ("Succeeded", "Failed")
                if not ended and (not pod or "READY" not in self.logs(team, pod)):
                    return False
            return True

        wait_for(f"{label}: every worker READY", all_ready, 240, 1,
                 diagnose=lambda: "\n".join(self.job_diagnose(t, n) for t, n in keys))
        for team, name in keys:
            if self.job_status(team, name).get("phase") == "Running":
                self.kubectl("exec", "-n", team, str(self.pod_of(team, name)), "--", "python3",
                             WORKER, "go", check=False)
        results = [self.result(team, name) for team, name in keys]
        for team in {t for t, _ in keys}:
            self.delete_jobs(team)
        return results

    def part_tenants(self, seconds: float) -> None:
        a, b = self.images["job-a"], self.images["job-b"]
        probe = ["probe", "--seconds", str(seconds)]
        runs: dict[str, list[dict[str, Any]]] = {}
        runs["mps_alone"] = self.run_together("team-a alone (MPS 8 GiB / 25 %)", [
            self.gpujob("team-a", "alone-a", a, probe)])
        runs["mps_together"] = self.run_together("team-a and team-b together (MPS)", [
            self.gpujob("team-a", "mps-a", a, probe), self.gpujob("team-b", "mps-b", b, probe)])
        runs["timeslice_alone"] = self.run_together("team-a alone (time-sliced)", [
            self.gpujob("team-a", "ts-alone-a", a, probe, isolation="timeslice", cores=None)])
        runs["timeslice_together"] = self.run_together("both time-sliced", [
            self.gpujob("team-a", "ts-a", a, probe, isolation="timeslice", cores=None),
            self.gpujob("team-b", "ts-b", b, probe, isolation="timeslice", cores=None)])
        together = runs["mps_together"]
        if not self.fake and all("matmul" in r for r in together):
            start = max(r["matmul"]["start"] for r in together)
            end = min(r["matmul"]["end"] for r in together)
            self.results["mps_overlap_s"] = round(end - start, 2)
        self.results["tenants"] = runs

    def part_nogrant(self) -> None:
        """A tenant's pod with no grant, its image setting NVIDIA_VISIBLE_DEVICES=all: under
        the node's default runtime, and (a real node) asking for the NVIDIA RuntimeClass."""
        classes = {"default runtime": ""}
        if not self.fake:
            classes[f"runtimeClassName: {NVIDIA_RUNTIME_CLASS}"] = NVIDIA_RUNTIME_CLASS
        self.results["nogrant"] = {}
        for label, runtime_class in classes.items():
            name = f"no-grant-{runtime_class or 'default'}"
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": "team-a"},
                   "spec": self.template(self.images["nogrant"], ["probe", "--try-gib", "1"],
                                         runtime_class=runtime_class)["spec"]}
            created = self.kubectl("--as", "team-a-user", "apply", "-f", "-",
                                   stdin=yaml.safe_dump(pod), check=False)
            if created.returncode != 0:
                self.results["nogrant"][label] = {"refused": created.stderr.strip()[-600:]}
                continue
            wait_for(f"the pod {name} to finish", lambda n=name: self.json(  # type: ignore[misc]
                "get", "pod", n, "-n", "team-a")["status"].get("phase") in (
                    "Succeeded", "Failed"), 180, 1)
            log = self.logs("team-a", name)
            found = [line for line in log.splitlines() if line.startswith("RESULT ")]
            self.results["nogrant"][label] = (json.loads(found[-1][7:]) if found
                                              else {"log": log[-1500:]})
            self.kubectl("delete", "pod", name, "-n", "team-a", "--wait=false")

    def part_isolation(self, ceiling_pct: int) -> None:
        gpu = host_gpus()[0]
        ceiling_gib = gpu["memory_mib"] * ceiling_pct // 100 // 1024
        ladder = [10, ceiling_gib - 4, ceiling_gib + 6]
        base = ["escape", "--ladder", *map(str, ladder), "--seconds", "3"]
        pinned, threads, pipe = ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY")
        clients: list[tuple[str, list[str], dict[str, Any]]] = [
            ("keeps the plugin's environment", [], {}),
            ("reference: a grant at the ceiling", [],
             {"memory": f"{ceiling_gib}Gi", "cores": ceiling_pct}),
            ("raises its memory limit (0=140G)", ["--set", f"{pinned}=0=140G"], {}),
            ("asks for 100 % of the SMs", ["--set", f"{threads}=100"], {}),
            ("drops both limits", ["--unset", pinned, "--unset", threads], {}),
            ("uncapped job (no gpu.cores): plugin's environment", [], {"cores": None}),
            ("drops the pipe directory (skips MPS)", ["--unset", pipe], {}),
        ]
        rows = []
        for i, (label, extra, grant) in enumerate(clients):
            job = self.gpujob("team-a", f"iso-{i}", self.images["job-a"], base + extra, **grant)
            self.submit(job)
            result = self.result("team-a", f"iso-{i}")
            say(f"isolation: {label}: {json.dumps(result)[:400]}")
            rows.append({"client": label, **result})
            self.delete_jobs("team-a")
        self.results["isolation"] = {"ladder_gib": ladder, "ceiling_pct": ceiling_pct,
                                     "rows": rows}

    def part_watchdog(self) -> None:
        job = self.gpujob("team-a", "hog", self.images["job-a"],
                          ["hog", "--gib", "20", "--seconds", "120"],
                          isolation=self.watchdog_isolation,
                          cores=GRANT_CORES if self.watchdog_isolation == "mps" else None)
        self.submit(job)
        status = self.result("team-a", "hog", timeout=200)
        events = self.json("get", "events", "-n", "team-a")["items"]
        self.results["watchdog"] = {
            "result": status, "job_status": self.job_status("team-a", "hog"),
            "events": [{"reason": e["reason"], "object": e["involvedObject"]["name"],
                        "type": e["type"], "message": e["message"][:300]} for e in events
                       if e["involvedObject"]["name"].startswith("hog")]}
        self.delete_jobs("team-a")

    def part_preempt(self) -> None:
        volume = self.node.paths.base / "volumes" / "ckpt"
        volume.mkdir(parents=True, exist_ok=True)
        volume.chmod(0o777)
        objects = [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "ckpt"},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                      "storageClassName": "ckpt", "persistentVolumeReclaimPolicy": "Retain",
                      "hostPath": {"path": str(volume), "type": "Directory"}}}]
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
        train = self.gpujob(
            "team-b", "train", self.images["job-b"],
            ["train", "--steps", "400", "--step-seconds", "0.1"], isolation="exclusive",
            cores=None, preemptible=True,
            checkpoint={"gracePeriod": "20s", "volumeClaimTemplate": {"spec": {
                "storageClassName": "ckpt", "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}}}}})
        train["spec"]["class"] = "batch"
        self.submit(train)
        wait_for("train running with progress", lambda: (
            (s := self.job_status("team-b", "train")).get("phase") == "Running"
            and (s.get("progress") or {}).get("value", 0) >= 0.1), 240, 1,
            diagnose=lambda: self.job_diagnose("team-b", "train"))
        # attempt 1's output, followed until its container exits (the pod goes with it)
        follow = subprocess.Popen(
            [str(self.node.cluster.bin_dir / "kubectl"), "--kubeconfig",
             str(self.node.cluster.kubeconfig), "logs", "-f", "train-1", "-n", "team-b"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        urgent = self.gpujob("team-a", "urgent", self.images["job-a"],
                             ["probe", "--try-gib", "1"], isolation="exclusive", cores=None)
        self.submit(urgent)
        def preempted() -> dict[str, Any] | None:
            status = self.job_status("team-b", "train")
            history = status.get("history") or []
            return status if any(r.get("outcome") == "Preempted" for r in history) else None

        after = wait_for("train preempted and requeued", preempted, 120, 1,
                         diagnose=lambda: self.job_diagnose("team-b", "train"))
        try:
            first_log = follow.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            follow.kill()
            first_log = follow.communicate()[0]
        done = wait_for("train's second attempt to finish", lambda: (
            s if (s := self.job_status("team-b", "train")).get("phase") in (
                "Succeeded", "Failed") else None), 300, 2,
            diagnose=lambda: self.job_diagnose("team-b", "train"))
        self.results["preempt"] = {
            "first_attempt_log": [line for line in first_log.splitlines()
                                  if "attempt=" in line][-4:],
            "second_attempt_log": [line for line in self.logs("team-b", "train-2").splitlines()
                                   if "attempt=" in line][:2] + [
                line for line in self.logs("team-b", "train-2").splitlines()
                if "done" in line],
            "after_preemption": {k: after.get(k) for k in ("lastCheckpoint", "history")},
            "final": {k: done.get(k) for k in ("phase", "resumedProgress", "lastCheckpoint",
                                               "gpuHours", "attempt")},
            "urgent": self.result("team-a", "urgent")}
        self.delete_jobs("team-a")
        self.delete_jobs("team-b")


def ready(pod: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return pod["status"].get("phase") == "Running" and conditions.get("Ready") == "True"


def toleration() -> dict[str, str]:
    taint = realnode.REAL_NODE_TAINT
    return {"key": taint["key"], "operator": "Exists", "effect": taint["effect"]}


def push_images(registry: str) -> dict[str, str]:
    env = dict(os.environ, REGISTRY=registry, CARPOOL_REGISTRY_PORT=registry.rsplit(":", 1)[1])
    # its own session: the registry outlives this process (a later --reuse run pulls from it)
    subprocess.run(["setsid", "bash", str(REPO / "hack" / "images" / "registry.sh"), "up"],
                   env=env, check=True, capture_output=True, timeout=300)
    done = subprocess.run(["bash", str(REPO / "hack" / "images" / "push.sh")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"push.sh: {done.stderr[-3000:]}")
    refs = {}
    for line in done.stdout.splitlines():
        ref, digest = line.split()
        refs[ref.rsplit("/", 1)[1].split(":")[0]] = f"{ref}@{digest}"
    return refs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake", action="store_true", help="no GPU: the fake backend")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from {','.join(PARTS)}")
    parser.add_argument("--seconds", type=float, default=8.0, help="matmul window per job")
    parser.add_argument("--ceiling", type=int, default=50, help="devicePlugin.mpsCeilingPercent")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--keep", action="store_true", help="leave the cluster and node up")
    parser.add_argument("--reuse", action="store_true",
                        help="use the node, release and job images a --keep run left running")
    parser.add_argument("--watchdog-isolation", default="mps", choices=("mps", "timeslice"))
    parser.add_argument("--job-runtime-class", default="",
                        help="RuntimeClass of job pods (nvidia: the plugin's env delivery)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    if args.fake:
        parts = [p for p in parts if p in ("node", "tenants", "nogrant")]
    timings: dict[str, float] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[devcluster.PODS_ENV] = "1"
    progress = devcluster.Progress(sys.stdout)
    with stage("control plane (devcluster --pods)", timings):
        cluster = devcluster.up(CLUSTER, progress=progress, pods=True)
    paths = realnode.NodePaths.default()
    nvidia_runtime = "" if args.fake else shutil.which("nvidia-container-runtime") or ""
    if not args.fake and not nvidia_runtime:
        parser.error("no nvidia-container-runtime on PATH (hack/gpu-node/stage.sh carries it)")
    settings = realnode.NodeSettings(device_plugin=False, max_pods=32,
                                     nvidia_runtime=nvidia_runtime,
                                     userspace_services=(f"{NAMESPACE}/{RELEASE}-extender",))
    node_timings = realnode.Timings(sys.stdout)
    node = realnode.attach(cluster, settings, paths, node_timings) if args.reuse else None
    if node is None:
        with stage("real node (containerd, runc, kubelet, service proxy)", timings), \
                realnode.exclusive(paths):
            realnode.stop(paths, cluster, settings.name)
            realnode.reset(paths)
            node = realnode.start(cluster, settings, paths, node_timings)
    else:
        say(f"reusing the running node {node.name} (--reuse)")
    bench = Bench(node, cluster.bin_dir / "helm", args.fake, args.out, timings=timings,
                  job_runtime_class=args.job_runtime_class,
                  watchdog_isolation=args.watchdog_isolation)
    try:
        if not args.fake:
            with stage("CDI spec for the node's GPUs", timings):
                gpus = host_gpus()
                CDI_SPEC.parent.mkdir(parents=True, exist_ok=True)
                CDI_SPEC.write_text(yaml.safe_dump(cdi_spec(gpus), sort_keys=False))
                NVIDIA_RUNTIME_CONFIG.parent.mkdir(parents=True, exist_ok=True)
                NVIDIA_RUNTIME_CONFIG.write_text(nvidia_runtime_config())
                node.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(
                    {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": NVIDIA_RUNTIME_CLASS}, "handler": "nvidia"}))
                bench.results["host_gpus"] = gpus
                say(f"{len(gpus)} GPU(s): {gpus}")
        if not (args.reuse and bench.installed()):
            with stage("registry and push (carpool, carpool-mps, kube-scheduler)", timings):
                refs = push_images(node.settings.registry)
            with stage("helm install (nvml backend, MPS daemon)" if not args.fake
                       else "helm install (fake backend)", timings):
                bench.install(refs)
        bench.setup_tenants()
        if set(parts) - {"node"}:
            bench.images = bench.imported_job_images() if args.reuse else {}
            if not bench.images:
                with stage("job images from this machine's PyTorch", timings):
                    bench.images = build_job_images(node, node.paths.base / "job-images")
        for part in parts:
            with stage(f"part {part}", timings):
                if part == "node":
                    bench.part_node()
                elif part == "tenants":
                    bench.part_tenants(args.seconds)
                elif part == "nogrant":
                    bench.part_nogrant()
                elif part == "isolation":
                    bench.part_isolation(args.ceiling)
                elif part == "watchdog":
                    bench.part_watchdog()
                elif part == "preempt":
                    bench.part_preempt()
            bench.save()
    except Exception as error:  # the log and the partial results are what the run leaves
        say(f"FAILED: {error}")
        bench.results["error"] = str(error)[-4000:]
        bench.save()
        with contextlib.suppress(Exception):
            print(bench.diagnose()[-6000:])
        return 1
    finally:
        bench.save()
        if not args.keep:
            for line in realnode.stop(paths, cluster, node.name):
                print(f"    {line}")
    print_tables(bench.results, bench.timings)
    return 0


# --------------------------------------------------------------------------------------------
# Tables (markdown, as docs/benchmarks.md shows them)


def _matmul(r: dict[str, Any]) -> str:
    m = r.get("matmul") or {}
    return f"{m['it_per_s']:.1f} it/s, {m['tflops']:.0f} TFLOP/s" if m else "-"


def print_tables(results: dict[str, Any], timings: dict[str, float]) -> None:
    print("\n| stage | seconds |\n|---|---:|")
    for title, took in timings.items():
        print(f"| {title} | {took:.1f} |")
    if "gpunode" in results:
        status = results["gpunode"]
        print("\nGpuNode status (the chart's device plugin, NVML):\n")
        print("```\n" + yaml.safe_dump(status, sort_keys=False)[:3000] + "```")
    runs = results.get("tenants") or {}
    if runs:
        print("\n| run | job | UID | GPUs seen | 10 GiB | 6 GiB | bf16 matmul "
              "(8192³) |\n|---|---|---:|---|---|---|---:|")
        for label, rows in runs.items():
            for r in rows:
                seen = ", ".join(d["uuid"] for d in r.get("devices", [])) or str(
                    r.get("nvidia_smi_L", "-"))
                cells = ["ok" if str(r.get(f"alloc_{g}GiB", "-")).startswith("ok") else
                         ("refused" if str(r.get(f"alloc_{g}GiB", "")).startswith("refused")
                          else "-") for g in (10, 6)]
                print(f"| {label} | {r.get('phase')} | {r.get('uid', '-')} | {seen} | "
                      f"{cells[0]} | {cells[1]} | {_matmul(r)} |")
        if "mps_overlap_s" in results:
            print(f"\nMPS jobs' matmul windows overlapped {results['mps_overlap_s']} s")
    for label, r in (results.get("nogrant") or {}).items():
        print(f"\nno grant, image sets NVIDIA_VISIBLE_DEVICES=all, {label}: "
              + (f"refused: {r['refused']}" if "refused" in r else
                 f"device_count={r.get('device_count')}, /dev: {r.get('dev_nvidia')}, "
                 f"nvidia-smi: {r.get('nvidia_smi_L')}, {r.get('cuda_error', '')}"))
    iso = results.get("isolation")
    if iso:
        ladder = iso["ladder_gib"]
        print("\n| client | MPS variables it ran with | " + " | ".join(
            f"{g} GiB" for g in ladder) + " | bf16 TFLOP/s | phase |")
        print("|---|---|" + "---|" * len(ladder) + "---:|---|")
        for r in iso["rows"]:
            env = ", ".join(f"{k.removeprefix('CUDA_MPS_')}={v}" for k, v in
                            (r.get("env") or {}).items() if k.startswith("CUDA_MPS_")
                            and k != "CUDA_MPS_PIPE_DIRECTORY") or "none"
            if "CUDA_MPS_PIPE_DIRECTORY" not in (r.get("env") or {}):
                env += " (no pipe)"
            cells = [("ok" if v == "ok" else "refused") for v in (r.get("ladder") or {}).values()]
            cells += ["-"] * (len(ladder) - len(cells))
            tflops = (r.get("matmul") or {}).get("tflops", "-")
            print(f"| {r['client']} | {env} | " + " | ".join(cells)
                  + f" | {tflops} | {r.get('phase')} |")
    dog = results.get("watchdog")
    if dog:
        print(f"\nwatchdog: job phase {dog['job_status'].get('phase')}, "
              f"reason {dog['job_status'].get('reason', '-')}; events:")
        for e in dog["events"]:
            print(f"  {e['type']} {e['reason']} {e['object']}: {e['message']}")
    pre = results.get("preempt")
    if pre:
        print("\npreemption:")
        for line in pre["first_attempt_log"] + pre["second_attempt_log"]:
            print(f"  {line}")
        print(f"  final: {json.dumps(pre['final'])}")


if __name__ == "__main__":
    sys.exit(main())
