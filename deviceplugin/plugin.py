"""The kubelet-facing gRPC server: registration, ListAndWatch, GetPreferredAllocation, Allocate.

Thin: each method decodes the request, asks the pure modules (devices, handshake, sharing) and
answers; any request it cannot serve gets a gRPC status with a message, never a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc

from carpool.core import checkpointing
from carpool.core.assignment import AssignedGpu
from carpool.core.gpunode import SHARING_MODES
from carpool.core.names import RESOURCE_GPU, SCHEDULER_NAME
from carpool.core.ownership import unowned_refusal
from carpool.core.resources import Isolation
from carpool.core.shares import ShareId
from carpool.deviceplugin import reports
from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc
from carpool.deviceplugin.backends.base import GpuBackend, GpuFacts
from carpool.deviceplugin.cdi import CdiSettings, DeviceDelivery, node_spec, write_spec
from carpool.deviceplugin.devices import advertised_shares
from carpool.deviceplugin.handshake import (
    HandshakeError,
    Match,
    ServedPod,
    allocated_annotation,
    expected_container,
    match_request,
    mps_client_refusal,
    preferred_shares,
)
from carpool.deviceplugin.health import HealthTracker
from carpool.deviceplugin.metrics import GpuMetrics
from carpool.deviceplugin.pods import PodSource
from carpool.deviceplugin.sharing import MpsSettings, container_setup
from carpool.kube.retry import Backoff

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
ENDPOINT = "carpool-gpu.sock"

_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
}

@dataclass
class PluginConfig:
    node: str
    sharing_mode: str = "mps"
    shares_per_gpu: int = 8
    mps: MpsSettings = field(default_factory=MpsSettings)
    resource_name: str = RESOURCE_GPU
    # Serve pods that no GpuJob owns (a test bed's bare pods); off: they get PERMISSION_DENIED.
    serve_unowned: bool = False
    reports_root: Path | None = None  # per-pod report directories (reports.py); None: none
    delivery: DeviceDelivery = DeviceDelivery.CDI
    cdi: CdiSettings = field(default_factory=CdiSettings)  # the node's CDI spec (cdi.py)
    # the user and group every MPS client must run as (mpsDaemon.clientUid/clientGid; None:
    # any), checked in Allocate (handshake.mps_client_refusal)
    mps_client_uid: int | None = None
    mps_client_gid: int | None = None


MARK_WAIT_S = 2.0  # how long Allocate waits for the allocated mark before answering anyway


class PluginState:
    """What the gRPC methods share: the GPU view, health, and who was handed what.

    `changed()` wakes every ListAndWatch stream; readings come from the backend through
    `refresh()`, which the caller runs off the event loop's thread when the backend blocks.
    """

    def __init__(self, config: PluginConfig, backend: GpuBackend, pods: PodSource,
                 health: HealthTracker | None = None, metrics: GpuMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.backend = backend
        self.pods = pods
        self.health = health or HealthTracker()
        self.metrics = metrics or GpuMetrics(config.node)
        # at 0 from the start, so rate() and increase() read 0 until the first event
        self.metrics.allocations.labels(config.node, config.sharing_mode, "OK")
        self.metrics.watchdog_kills.labels(config.node)
        self.clock = clock
        self.gpus: list[GpuFacts] = backend.inventory()
        self.handed_over: set[tuple[str, str]] = set()  # (pod uid, container)
        self._retries: set[asyncio.Task[None]] = set()  # allocated marks being retried
        self._version = 0
        self._cond = asyncio.Condition()
        self._closed = False
        self._written_spec: dict[str, object] | None = None

    def write_cdi_spec(self) -> bool:
        """Write the node's CDI spec for the current GPUs (CDI delivery only) when it changed
        (a MIG layout did); returns whether it wrote. Run before registering: the runtime must
        know every device Allocate can name."""
        if self.config.delivery is not DeviceDelivery.CDI:
            return False
        cdi = self.config.cdi
        spec = node_spec(self.gpus, cdi.control_nodes(), cdi)
        if spec == self._written_spec:
            return False
        path = write_spec(spec, cdi.spec_dir)
        self._written_spec = spec
        log.info("wrote the CDI spec %s (%d devices)", path, len(spec["devices"]))
        return True

    def refresh_cdi_spec(self) -> bool:
        """Rewrite the spec if the GPUs' devices changed since the plugin wrote it at start
        (nothing before that first write)."""
        return self._written_spec is not None and self.write_cdi_spec()

    @property
    def version(self) -> int:
        return self._version

    async def changed(self) -> None:
        async with self._cond:
            self._version += 1
            self._cond.notify_all()

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    async def wait_change(self, seen: int) -> bool:
        """Block until the version moves past `seen`; False once the state is closed."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or self._version != seen)
            return not self._closed

    def retry_mark(self, pod: ServedPod, value: str, backoff: Backoff | None = None,
                   attempts: int = 5) -> None:
        """Keep trying to set `pod`'s allocated mark (1, 2, 4, 8, 16 s apart): until it lands
        the extender keeps other pods with the same GPU count off this node."""
        delays = (backoff or Backoff(first=1.0, most=16.0)).delays(attempts)

        async def attempt() -> None:
            for delay in delays:
                await asyncio.sleep(delay)
                try:
                    await self.pods.mark_allocated(pod, value)
                    log.info("annotated %s as allocated on a retry", pod.key)
                    return
                except Exception as err:
                    log.warning("allocated mark for %s still failing: %r", pod.key, err)
            log.error("gave up marking %s as allocated", pod.key)

        task = asyncio.get_running_loop().create_task(attempt())
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    def shares(self) -> list[tuple[ShareId, bool]]:
        return [(a.share, a.healthy) for a in advertised_shares(
            self.gpus, self.config.sharing_mode, self.config.shares_per_gpu,
            self.health.unhealthy)]

    def device_list(self) -> api_pb2.ListAndWatchResponse:
        """Every share, with its GPU's NUMA node where the backend knows it (TopologyInfo:
        the kubelet's topology manager aligns CPUs and memory with it)."""
        numa = {g.uuid: g.numa_node for g in self.gpus if g.numa_node is not None}

        def topology(share: ShareId) -> api_pb2.TopologyInfo | None:
            node = numa.get(share.gpu_uuid)
            return None if node is None else api_pb2.TopologyInfo(
                nodes=[api_pb2.NUMANode(ID=node)])

        return api_pb2.ListAndWatchResponse(devices=[
            api_pb2.Device(ID=str(share), health="Healthy" if ok else "Unhealthy",
                           topology=topology(share))
            for share, ok in self.shares()
        ])


def parse_ids(ids: Sequence[str], what: str) -> list[ShareId]:
    out = []
    for text in ids:
        try:
            out.append(ShareId.parse(text))
        except ValueError as err:
            raise HandshakeError("INVALID_ARGUMENT", f"{what}: {err}") from None
    return out


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, state: PluginState) -> None:
        self.state = state

    async def _abort(self, context: grpc.aio.ServicerContext, err: HandshakeError) -> None:
        log.warning("refusing request: %s", err)
        await context.abort(_CODES[err.code], str(err))

    async def GetDevicePluginOptions(self, request: api_pb2.Empty,
                                     context: grpc.aio.ServicerContext
                                     ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False,
                                           get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        seen = self.state.version
        yield self.state.device_list()
        while await self.state.wait_change(seen):
            seen = self.state.version
            yield self.state.device_list()

    async def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest,
                                     context: grpc.aio.ServicerContext
                                     ) -> api_pb2.PreferredAllocationResponse:
        try:
            pods = await self.state.pods.pods_on_node(self.state.config.node)
            now = self.state.clock()
            responses = []
            for req in request.container_requests:
                available = parse_ids(req.available_deviceIDs, "available_deviceIDs")
                must = parse_ids(req.must_include_deviceIDs, "must_include_deviceIDs")
                if req.allocation_size < 1 or req.allocation_size > len(available):
                    raise HandshakeError(
                        "INVALID_ARGUMENT",
                        f"allocation_size {req.allocation_size} with {len(available)} devices "
                        f"available")
                preferred = self._assigned_gpus(pods, req.allocation_size, now)
                chosen = preferred_shares(available, must, req.allocation_size, preferred)
                responses.append(api_pb2.ContainerPreferredAllocationResponse(
                    deviceIDs=[str(s) for s in chosen]))
            return api_pb2.PreferredAllocationResponse(container_responses=responses)
        except HandshakeError as err:
            await self._abort(context, err)
            raise AssertionError("unreachable") from err

    def _assigned_gpus(self, pods: list[ServedPod], count: int, now: float) -> list[str]:
        """The GPUs of the in-flight container this request is most likely for, or none."""
        match = expected_container(pods, self.state.config.node, count, now,
                                   frozenset(self.state.handed_over))
        return [g.uuid for g in match.gpus] if match else []

    async def Allocate(self, request: api_pb2.AllocateRequest,
                       context: grpc.aio.ServicerContext) -> api_pb2.AllocateResponse:
        try:
            if not request.container_requests:
                raise HandshakeError("INVALID_ARGUMENT", "Allocate with no container requests")
            responses = []
            for req in request.container_requests:
                responses.append(await self._allocate_one(list(req.devices_ids)))
            return api_pb2.AllocateResponse(container_responses=responses)
        except HandshakeError as err:
            self.state.metrics.allocations.labels(self.state.config.node, "", err.code).inc()
            await self._abort(context, err)
            raise AssertionError("unreachable") from err

    def _check_devices(self, ids: list[str]) -> list[ShareId]:
        if not ids:
            raise HandshakeError("INVALID_ARGUMENT", "a container request lists no device IDs")
        shares = parse_ids(ids, "devices_ids")
        known = dict(self.state.shares())
        unknown = [str(s) for s in shares if s not in known]
        if unknown:
            raise HandshakeError("NOT_FOUND",
                                 f"device IDs not advertised on node {self.state.config.node}: "
                                 f"{', '.join(unknown)}")
        if len(set(shares)) != len(shares):
            raise HandshakeError("INVALID_ARGUMENT", "the same device ID appears twice")
        gpus = [s.gpu_uuid for s in shares]
        if len(set(gpus)) != len(gpus):
            raise HandshakeError(
                "INVALID_ARGUMENT",
                f"{len(gpus)} shares but only {len(set(gpus))} distinct GPUs: each "
                f"{self.state.config.resource_name} is a whole distinct GPU")
        sick = [str(s) for s in shares if not known[s]]
        if sick:
            raise HandshakeError("FAILED_PRECONDITION",
                                 f"devices are unhealthy: {', '.join(sick)}")
        return shares

    def _check_honourable(self, pod: str, gpus: Sequence[AssignedGpu]) -> None:
        """Refuse an assignment this node cannot give (a GPU or MIG instance it does not have,
        more memory than the GPU holds): the annotation is only text on a pod, and starting a
        container on a missing GPU or with a cap beyond the card would silently break it."""
        facts = {g.uuid: g for g in self.state.gpus}
        for gpu in gpus:
            have = facts.get(gpu.uuid)
            if have is None:
                raise HandshakeError("FAILED_PRECONDITION",
                                     f"{pod} is assigned GPU {gpu.uuid}, which node "
                                     f"{self.state.config.node} does not have")
            if gpu.mig_instance and gpu.mig_instance not in {m.uuid for m in have.mig_instances}:
                raise HandshakeError("FAILED_PRECONDITION",
                                     f"{pod} is assigned MIG instance {gpu.mig_instance}, "
                                     f"which GPU {gpu.uuid} does not have")
            if gpu.memory_mib > have.memory_total_mib:
                raise HandshakeError("FAILED_PRECONDITION",
                                     f"{pod} is assigned {gpu.memory_mib} MiB on GPU {gpu.uuid}, "
                                     f"which holds {have.memory_total_mib} MiB")

    async def _allocate_one(self, ids: list[str]) -> api_pb2.ContainerAllocateResponse:
        state = self.state
        shares = self._check_devices(ids)
        pods = await state.pods.pods_on_node(state.config.node)
        match = match_request(pods, state.config.node, shares, state.clock(),
                              frozenset(state.handed_over))
        if not state.config.serve_unowned:
            if not match.pod.owner:
                raise HandshakeError("PERMISSION_DENIED", unowned_refusal(match.pod.key))
            if match.pod.scheduler != SCHEDULER_NAME:
                # every pod holding a Carpool GPU is one the operator's pod watch sees
                raise HandshakeError(
                    "PERMISSION_DENIED",
                    f"pod {match.pod.key} was not placed by {SCHEDULER_NAME} "
                    f"(spec.schedulerName {match.pod.scheduler!r}); Carpool serves GPUs only "
                    f"to the pods its scheduler placed")
        isolation = self._isolation(match)
        if isolation is Isolation.MPS and (why := mps_client_refusal(
                match.pod, state.config.mps_client_uid, state.config.mps_client_gid)):
            raise HandshakeError("PERMISSION_DENIED", why)
        self._check_honourable(match.pod.key, match.gpus)
        setup = container_setup(isolation, match.gpus, state.config.mps,
                                {g.uuid: g.memory_total_mib for g in state.gpus},
                                state.config.delivery)
        assigned = [g.uuid for g in match.gpus]
        if {s.gpu_uuid for s in shares} != set(assigned):
            log.warning("kubelet chose %s for %s/%s but the extender assigned %s; the container "
                        "gets the assigned GPUs", ids, match.pod.key, match.container, assigned)
        state.handed_over.add((match.pod.uid, match.container))
        value = allocated_annotation(match.pod, match.container, ids, assigned, datetime.now(UTC))
        try:  # bounded: a slow API server must not hold the kubelet's admission up
            await asyncio.wait_for(state.pods.mark_allocated(match.pod, value), MARK_WAIT_S)
        except Exception as err:  # the pod still starts; keep trying to mark it
            log.error("could not annotate %s as allocated yet (retrying in the background): %r",
                      match.pod.key, err)
            state.retry_mark(match.pod, value)
        state.metrics.allocations.labels(state.config.node, isolation.value, "OK").inc()
        log.info("allocated %s to %s/%s (%s)", assigned, match.pod.key, match.container,
                 isolation.value)
        envs = dict(setup.envs)
        mounts = [api_pb2.Mount(container_path=m.container_path, host_path=m.host_path,
                                read_only=m.read_only) for m in setup.mounts]
        if state.config.reports_root is not None:
            # where the job reports checkpoints and progress (reports.py); a failure here
            # costs the job its reports, not its start
            try:
                host = await asyncio.to_thread(reports.prepare, state.config.reports_root,
                                               match.pod.uid)
            except (OSError, ValueError) as err:
                log.error("no report directory for %s: %s", match.pod.key, err)
            else:
                envs[checkpointing.ENV_REPORT_DIR] = checkpointing.REPORT_MOUNT
                mounts.append(api_pb2.Mount(container_path=checkpointing.REPORT_MOUNT,
                                            host_path=str(host), read_only=False))
        return api_pb2.ContainerAllocateResponse(
            envs=envs, mounts=mounts,
            cdi_devices=[api_pb2.CDIDevice(name=name) for name in setup.cdi_devices])

    def _isolation(self, match: Match) -> Isolation:
        mode = self.state.config.sharing_mode
        wanted = match.isolation
        if wanted is None:
            wanted = Isolation.MIG if any(g.mig_instance for g in match.gpus) else Isolation(mode)
        if wanted not in SHARING_MODES[mode] and not (
            wanted is Isolation.MIG and all(g.mig_instance for g in match.gpus)
        ):
            raise HandshakeError(
                "FAILED_PRECONDITION",
                f"pod {match.pod.key} wants {wanted.value} isolation but node "
                f"{self.state.config.node} shares GPUs in {mode} mode")
        if wanted in (Isolation.TIMESLICE, Isolation.EXCLUSIVE):
            facts = {g.uuid: g for g in self.state.gpus}
            mps_only = [g.uuid for g in match.gpus
                        if g.uuid in facts and facts[g.uuid].exclusive_process]
            if mps_only:
                raise HandshakeError(
                    "FAILED_PRECONDITION",
                    f"pod {match.pod.key} wants {wanted.value} isolation but GPU "
                    f"{', '.join(mps_only)} runs MPS clients only (compute mode "
                    f"EXCLUSIVE_PROCESS): a process outside MPS cannot start there")
        return wanted

    async def PreStartContainer(self, request: api_pb2.PreStartContainerRequest,
                                context: grpc.aio.ServicerContext
                                ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


async def register(plugin_dir: Path, endpoint: str, resource_name: str,
                   timeout_s: float = 5.0) -> None:
    """Announce the plugin to the kubelet's Registration service."""
    target = f"unix://{plugin_dir / KUBELET_SOCKET}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        await stub.Register(
            api_pb2.RegisterRequest(
                version=API_VERSION, endpoint=endpoint, resource_name=resource_name,
                options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
            ),
            timeout=timeout_s,
        )


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class PluginServer:
    """Serves the DevicePlugin service on its socket and keeps it registered.

    The kubelet removes plugin sockets when it restarts and comes back with a new kubelet.sock;
    `supervise` notices either (polling inodes: no inotify dependency) and serves and registers
    again.
    """

    def __init__(self, state: PluginState, plugin_dir: Path, endpoint: str = ENDPOINT,
                 poll_s: float = 1.0) -> None:
        self.state = state
        self.plugin_dir = plugin_dir
        self.endpoint = endpoint
        self.poll_s = poll_s
        self.server: grpc.aio.Server | None = None
        self.registrations = 0
        self._kubelet_inode: int | None = None
        self._socket_inode: int | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.endpoint

    async def serve(self) -> None:
        await self.stop_serving()
        self.socket.unlink(missing_ok=True)
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(  # type: ignore[no-untyped-call]
            DevicePluginService(self.state), server)
        server.add_insecure_port(f"unix://{self.socket}")
        self.server = server  # before start(): a cancelled start must still be stopped
        await server.start()
        self._socket_inode = _inode(self.socket)

    async def stop_serving(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)
            self.server = None

    async def register(self) -> None:
        self._kubelet_inode = _inode(self.plugin_dir / KUBELET_SOCKET)
        await register(self.plugin_dir, self.endpoint, self.state.config.resource_name)
        self.registrations += 1
        log.info("registered %s with the kubelet (%s, registration %d)",
                 self.state.config.resource_name, self.socket, self.registrations)

    async def start(self) -> None:
        await self.serve()
        await self.register()

    def needs_restart(self) -> bool:
        kubelet = _inode(self.plugin_dir / KUBELET_SOCKET)
        return (kubelet is not None and kubelet != self._kubelet_inode) or (
            _inode(self.socket) != self._socket_inode)

    async def supervise(self) -> None:
        """Run forever: keep serving and registered across kubelet restarts."""
        backoff = Backoff(first=self.poll_s, most=30.0)
        while True:
            if self.server is None or self.needs_restart():
                if not (self.plugin_dir / KUBELET_SOCKET).exists():
                    await asyncio.sleep(self.poll_s)
                    continue
                try:
                    await self.start()
                    backoff.reset()
                except grpc.aio.AioRpcError as err:
                    delay = backoff.next()
                    log.warning("registration failed (%s: %s); retrying in %.0fs",
                                err.code().name, err.details(), delay)
                    await self.stop_serving()
                    await asyncio.sleep(delay)
                    continue
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        await self.state.close()
        await self.stop_serving()
        self.socket.unlink(missing_ok=True)
