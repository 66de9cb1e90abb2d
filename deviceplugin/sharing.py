"""What a container gets for its GPUs in each sharing mode: devices, environment and mounts.

Pure: the container's assigned GPUs and the node's settings in, a `ContainerSetup` out. The gRPC
layer copies it into a `ContainerAllocateResponse`; the GPU benchmark runs real CUDA work with
exactly this environment.

Devices: with CDI delivery (the default) the GPUs are CDI device names the runtime resolves
from the node's spec (`cdi.py`), and `NVIDIA_VISIBLE_DEVICES` is `void`, so that a runtime that
still reads it adds nothing, whatever the image sets. With environment delivery (runtimes
without CDI) the GPUs are `NVIDIA_VISIBLE_DEVICES`, which the NVIDIA runtime turns into devices.
`CUDA_VISIBLE_DEVICES` names the same GPUs by UUID in both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath

from carpool.core.assignment import AssignedGpu
from carpool.core.gpuhours import sm_share_pct
from carpool.core.resources import Isolation
from carpool.deviceplugin.cdi import DeviceDelivery, qualified_names
from carpool.deviceplugin.handshake import HandshakeError
from carpool.deviceplugin.mps import mps_memory_limit

CONTAINER_MPS_PIPE_DIR = "/run/carpool/mps"
CONTAINER_SHM_DIR = "/dev/shm"
NO_DEVICES = "void"  # NVIDIA_VISIBLE_DEVICES that makes the NVIDIA runtime add no GPU


@dataclass(frozen=True)
class MpsSettings:
    """Where the node's MPS control daemon lives (host paths)."""

    pipe_dir: str = "/run/carpool/mps/pipe"
    shm_dir: str = ""  # a host tmpfs shared by the daemon and clients; "" to leave /dev/shm alone
    # The most one client may hold of each GPU (memory and SMs, %), fenced on the control
    # daemon (see mps.py) and published so that placement grants no more on an MPS node.
    ceiling_pct: int = 100


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerSetup:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()
    cdi_devices: tuple[str, ...] = ()  # fully qualified CDI names


def container_setup(
    isolation: Isolation,
    gpus: Sequence[AssignedGpu],
    mps: MpsSettings = MpsSettings(),
    memory_totals: Mapping[str, int] | None = None,
    delivery: DeviceDelivery = DeviceDelivery.CDI,
) -> ContainerSetup:
    """Environment and mounts that give a container exactly its assigned GPUs.

    GPUs are named by UUID (CUDA_VISIBLE_DEVICES accepts UUIDs), so the numbering the container
    sees cannot disagree with the host's. MPS per-device limits index the visible devices.
    An MPS grant without `cores` gets its memory share of the SMs (`gpuhours.sm_share_pct`,
    the share it is billed for); `memory_totals` (GPU uuid -> MiB) says what that share is.
    """
    if not gpus:
        raise HandshakeError("FAILED_PRECONDITION", "the assignment lists no GPUs")
    envs = {"CARPOOL_ISOLATION": isolation.value}
    if isolation is Isolation.MIG:
        missing = [g.uuid for g in gpus if not g.mig_instance]
        if missing:
            raise HandshakeError(
                "FAILED_PRECONDITION",
                f"MIG isolation but the assignment names no MIG instance on {', '.join(missing)}",
            )
    else:
        gpus = [replace(g, mig_instance="") for g in gpus]
    visible = ",".join(g.mig_instance or g.uuid for g in gpus)
    cdi: tuple[str, ...] = ()
    if delivery is DeviceDelivery.CDI:
        cdi = tuple(qualified_names(gpus))
        envs |= {"NVIDIA_VISIBLE_DEVICES": NO_DEVICES, "CUDA_VISIBLE_DEVICES": visible}
    else:
        envs |= {"NVIDIA_VISIBLE_DEVICES": visible, "CUDA_VISIBLE_DEVICES": visible}
    if isolation in (Isolation.MIG, Isolation.EXCLUSIVE):
        return ContainerSetup(envs, cdi_devices=cdi)
    envs["CARPOOL_GPU_MEMORY_LIMIT_MIB"] = ",".join(str(g.memory_mib) for g in gpus)
    if isolation is Isolation.TIMESLICE:
        return ContainerSetup(envs, cdi_devices=cdi)  # no hard limit: the watchdog enforces memory

    # MPS: the client joins the node's daemon through the mounted pipe directory, with its own
    # pinned-memory cap per visible device and a share of the SMs.
    envs["CUDA_MPS_PIPE_DIRECTORY"] = CONTAINER_MPS_PIPE_DIR
    envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
        f"{n}={mps_memory_limit(g.memory_mib)}" for n, g in enumerate(gpus) if g.memory_mib > 0
    )
    if not envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]:
        del envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    totals = memory_totals or {}
    # one value per process: the largest grant
    cores = max(sm_share_pct(g.cores_pct, g.memory_mib, totals.get(g.uuid, 0)) for g in gpus)
    if cores < 100:
        envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cores)
    mounts = [MountSpec(CONTAINER_MPS_PIPE_DIR, mps.pipe_dir)]
    if mps.shm_dir:
        mounts.append(MountSpec(CONTAINER_SHM_DIR, mps.shm_dir))
    return ContainerSetup(envs, tuple(mounts), cdi)


def host_view(setup: ContainerSetup) -> dict[str, str]:
    """The same environment for a process on the host (no container): mounted paths are
    replaced by their host paths. Used by the GPU benchmark."""
    envs = dict(setup.envs)
    for mount in setup.mounts:
        for key, value in envs.items():
            if value == mount.container_path or PurePosixPath(value) == PurePosixPath(
                mount.container_path
            ):
                envs[key] = mount.host_path
    return envs
