"""The node's CDI spec: how the container runtime gives a container exactly its GPUs.

The invariant: a container reaches a GPU only through a device the plugin named in its Allocate
answer (`cdi_devices`), which the runtime resolves from this spec. Nothing an image or a pod
can set (an `NVIDIA_VISIBLE_DEVICES` in the image, say) adds a device, because the runtime, not
an environment variable, decides which device nodes exist in the container.

The spec (kind `carpool.dev/gpu`) has one device per GPU, named by its UUID, and one per MIG
instance, named by the MIG UUID: each brings the GPU's device node (`/dev/nvidia<minor>`; a MIG
instance also its capability nodes). Every device also brings the spec-wide edits: the control
nodes (`/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`, those the host has), the
driver's files as read-only bind mounts (`CdiSettings.driver_mounts`), and, when a spec that
`nvidia-ctk cdi generate` wrote is merged in (`driver_edits`), its spec-wide edits: the
driver libraries, binaries and hooks it found. A fake node backs every device node with one
stand-in host file (`/dev/null`), so containers on a node with fake GPUs still start and show
the device nodes they were given.

Everything here but `write_spec` and `present_control_nodes` is pure.
"""

from __future__ import annotations

import enum
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool.core.assignment import AssignedGpu
from carpool.deviceplugin.backends.base import GpuFacts

VENDOR = "carpool.dev"
CLASS = "gpu"
KIND = f"{VENDOR}/{CLASS}"
# 0.5.0 brought `hostPath` on device nodes, which the fake node's stand-ins need.
CDI_VERSION = "0.5.0"
DEFAULT_SPEC_DIR = "/var/run/cdi"
SPEC_FILE = "carpool.dev-gpu.json"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


class DeviceDelivery(enum.Enum):
    """How Allocate gives a container its GPUs."""

    CDI = "cdi"  # CDI device names; the runtime adds the device nodes (docs/operations.md)
    ENV = "env"  # NVIDIA_VISIBLE_DEVICES, for runtimes without CDI: an image can set it too


@dataclass(frozen=True)
class DriverMount:
    """A host path of the driver (libraries, binaries) bound read-only into every GPU container."""

    host_path: str
    container_path: str

    @classmethod
    def parse(cls, text: str) -> DriverMount:
        """`HOST[:CONTAINER]`, both absolute; CONTAINER defaults to HOST."""
        host, _, container = text.partition(":")
        container = container or host
        for what, path in (("host path", host), ("container path", container)):
            if not path.startswith("/"):
                raise ValueError(f"--cdi-driver-mount {text!r}: the {what} must be absolute")
        return cls(host, container)


@dataclass(frozen=True)
class CdiSettings:
    """What the node's spec contains beyond its GPUs' own device nodes."""

    spec_dir: str = DEFAULT_SPEC_DIR
    driver_mounts: tuple[DriverMount, ...] = ()
    # A host file that backs every device node (a fake node's GPUs: "/dev/null"); "" for none.
    stand_in: str = ""
    # Spec-wide edits merged from another spec (`driver_edits`) and the version they need.
    driver_edits: Mapping[str, Any] = field(default_factory=dict)
    version: str = CDI_VERSION

    def control_nodes(self) -> list[str]:
        """All control nodes on a fake node (stand-ins); on a real one those the host has."""
        return list(CONTROL_NODES) if self.stand_in else present_control_nodes()


def device_name(gpu: AssignedGpu) -> str:
    """The CDI device of one assigned GPU: its MIG instance when it has one, else the GPU."""
    return gpu.mig_instance or gpu.uuid


def qualified_names(gpus: Sequence[AssignedGpu]) -> list[str]:
    """Fully qualified CDI names (`carpool.dev/gpu=<uuid>`) for Allocate's `cdi_devices`."""
    return [f"{KIND}={device_name(g)}" for g in gpus]


def _node(path: str, stand_in: str) -> dict[str, Any]:
    node: dict[str, Any] = {"path": path, "permissions": "rw"}
    if stand_in:
        node["hostPath"] = stand_in
    return node


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{name!r} cannot name a CDI device (letters, digits, '_.:-' only)")
    return name


def node_spec(gpus: Sequence[GpuFacts], control_nodes: Iterable[str],
              settings: CdiSettings = CdiSettings()) -> dict[str, Any]:
    """The CDI spec for a node's GPUs (a JSON-ready dict).

    `control_nodes`: the control device nodes to give every GPU container (those the host has;
    a fake node passes all of `CONTROL_NODES`)."""
    devices = []
    for gpu in gpus:
        own = [_node(f"/dev/nvidia{gpu.minor}", settings.stand_in)]
        devices.append({"name": _check_name(gpu.uuid), "containerEdits": {"deviceNodes": own}})
        for mig in gpu.mig_instances:
            caps = [_node(path, settings.stand_in) for path in mig.cap_nodes]
            devices.append({"name": _check_name(mig.uuid),
                            "containerEdits": {"deviceNodes": own + caps}})
    common: dict[str, Any] = {
        "deviceNodes": [_node(path, settings.stand_in) for path in control_nodes],
        "mounts": [{"hostPath": m.host_path, "containerPath": m.container_path,
                    "options": ["ro", "nosuid", "nodev", "bind"]}
                   for m in settings.driver_mounts],
    }
    for key, extra in settings.driver_edits.items():
        common[key] = [*common.get(key, []), *(x for x in extra if x not in common.get(key, []))]
    return {"cdiVersion": settings.version, "kind": KIND, "devices": devices,
            "containerEdits": {k: v for k, v in common.items() if v}}


def _version_key(version: str) -> tuple[int, int, int]:
    found = _VERSION.match(version)
    if not found:
        raise ValueError(f"cdiVersion {version!r} is not MAJOR.MINOR.PATCH")
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def driver_edits(other: Any, source: str = "the merged spec") -> tuple[dict[str, Any], str]:
    """The spec-wide `containerEdits` of another CDI spec (e.g. `nvidia-ctk cdi generate`'s:
    driver libraries, binaries, IPC sockets and ldcache hooks) and the cdiVersion the merged
    spec needs (at least ours). Its per-device edits are not taken: Carpool names the GPUs."""
    if not isinstance(other, Mapping):
        raise ValueError(f"{source}: a CDI spec must be a mapping")
    version = other.get("cdiVersion")
    if not isinstance(version, str):
        raise ValueError(f"{source}: cdiVersion is missing")
    edits = other.get("containerEdits") or {}
    if not isinstance(edits, Mapping):
        raise ValueError(f"{source}: containerEdits must be a mapping")
    allowed = {"env", "deviceNodes", "mounts", "hooks"}
    unknown = sorted(set(edits) - allowed)
    if unknown:
        raise ValueError(f"{source}: containerEdits.{unknown[0]} is not merged (only "
                         f"{', '.join(sorted(allowed))})")
    for key, value in edits.items():
        if not isinstance(value, list):
            raise ValueError(f"{source}: containerEdits.{key} must be a list")
    needed = max(version, CDI_VERSION, key=_version_key)
    return {k: list(v) for k, v in edits.items()}, needed


MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"


def mig_cap_nodes(mig_minors: str, gpu_minor: int, gpu_instance: int,
                  compute_instance: int) -> tuple[str, ...]:
    """The capability device nodes of one MIG instance, from the driver's `mig-minors` table
    (lines like `gpu0/gi1/access 12` and `gpu0/gi1/ci0/access 13`): a process needs both its
    GPU instance's and its compute instance's to open it. Missing entries give ()."""
    minors = {}
    for line in mig_minors.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    gi = f"gpu{gpu_minor}/gi{gpu_instance}/access"
    ci = f"gpu{gpu_minor}/gi{gpu_instance}/ci{compute_instance}/access"
    if gi not in minors or ci not in minors:
        return ()
    return tuple(f"/dev/nvidia-caps/nvidia-cap{minors[key]}" for key in (gi, ci))


NVIDIA_SPEC_NAMES = ("nvidia.yaml", "nvidia.json")


def nvidia_spec_in(spec_dir: Path) -> Path | None:
    """The spec the NVIDIA Container Toolkit writes into the spec directory (its
    nvidia-cdi-refresh service keeps `/var/run/cdi/nvidia.yaml`, toolkit >= 1.18), if any."""
    for name in NVIDIA_SPEC_NAMES:
        if (spec_dir / name).is_file():
            return spec_dir / name
    return None


def present_control_nodes(root: str = "/") -> list[str]:
    """The control device nodes this host has (NVML needs /dev/nvidiactl; CUDA the uvm ones)."""
    return [p for p in CONTROL_NODES if os.path.exists(os.path.join(root, p.lstrip("/")))]


def write_spec(spec: Mapping[str, Any], spec_dir: str | Path) -> Path:
    """Write the spec into `spec_dir` atomically: a runtime reading the directory sees the old
    file or the new one, never half of one (the temporary name is not `.json`, which runtimes
    would read)."""
    folder = Path(spec_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / SPEC_FILE
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{SPEC_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(spec, out, indent=2, sort_keys=True)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
