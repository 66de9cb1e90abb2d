"""The plugin against a kubelet stand-in speaking the real v1beta1 protocol over unix sockets.

The fake kubelet serves Registration on kubelet.sock; on Register it dials the plugin's socket
back, as the kubelet does, and follows ListAndWatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from carpool.core.names import (
    ANN_ALLOCATED,
    ANN_ASSIGNED_AT,
    ANN_ASSIGNMENT,
    ANN_ISOLATION,
    SCHEDULER_NAME,
)
from carpool.core.ownership import Owner
from carpool.deviceplugin.agent import health_step
from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool.deviceplugin.cdi import SPEC_FILE, CdiSettings, DeviceDelivery
from carpool.deviceplugin.handshake import ServedPod
from carpool.deviceplugin.health import HealthTracker
from carpool.deviceplugin.plugin import KUBELET_SOCKET, PluginConfig, PluginServer, PluginState
from carpool.deviceplugin.pods import StaticPodSource
from carpool.deviceplugin.sharing import MpsSettings
from carpool.kube.retry import Backoff

NODE = "gpu-node-1"
NOW = 1_800_000_000.0


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    """Registration service; on Register, connects to the plugin and follows ListAndWatch."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.requests: list[api_pb2.RegisterRequest] = []
        self.updates: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self.options: api_pb2.DevicePluginOptions | None = None
        self.channel: grpc.aio.Channel | None = None
        self.server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None

    async def Register(self, request: api_pb2.RegisterRequest, context: Any) -> api_pb2.Empty:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unsupported version")
        self.requests.append(request)
        self.channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        stub = api_pb2_grpc.DevicePluginStub(self.channel)
        self.options = await stub.GetDevicePluginOptions(api_pb2.Empty())
        self._watch = asyncio.create_task(self._follow(stub))
        return api_pb2.Empty()

    async def _follow(self, stub: api_pb2_grpc.DevicePluginStub) -> None:
        try:
            async for response in stub.ListAndWatch(api_pb2.Empty()):
                await self.updates.put({d.ID: d.health for d in response.devices})
        except grpc.aio.AioRpcError:
            pass  # the plugin went away (restart); a new Register starts a new watch

    def stub(self) -> api_pb2_grpc.DevicePluginStub:
        assert self.channel is not None, "plugin never registered"
        return api_pb2_grpc.DevicePluginStub(self.channel)

    async def start(self) -> None:
        self.server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.plugin_dir / KUBELET_SOCKET}")
        await self.server.start()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(grace=None)
        (self.plugin_dir / KUBELET_SOCKET).unlink(missing_ok=True)


def pod(name: str, gpus: list[dict[str, Any]], isolation: str = "", count: int | None = None,
        assigned_at: str = "2027-01-15T08:00:00Z", node: str = NODE, owner: str = "job"
        ) -> ServedPod:
    # the extender records the job's isolation in the assignment; the pod's own annotation
    # says the same here (a test below makes them differ)
    assignment: dict[str, Any] = {"node": node, "gpus": gpus}
    if isolation:
        assignment["isolation"] = isolation
    annotations = {ANN_ASSIGNMENT: json.dumps(assignment), ANN_ASSIGNED_AT: assigned_at}
    if isolation:
        annotations[ANN_ISOLATION] = isolation
    return ServedPod("lab", name, f"uid-{name}", "Pending", False, annotations,
                   (("main", count if count is not None else len(gpus)),),
                   Owner(owner, f"uid-{owner}") if owner else None, SCHEDULER_NAME)


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # unix socket paths are limited to ~107 bytes: keep the directory short
    path = Path(tempfile.mkdtemp(prefix="cp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


Running = tuple[FakeKubelet, PluginServer, FakeBackend, StaticPodSource]


@asynccontextmanager
async def running(plugin_dir: Path, spec: dict[str, Any], mode: str = "mps",
                  pods: list[ServedPod] | None = None, source: StaticPodSource | None = None,
                  reports_root: Path | None = None,
                  delivery: DeviceDelivery = DeviceDelivery.CDI,
                  mps_client: tuple[int | None, int | None] = (None, None)
                  ) -> AsyncIterator[Running]:
    backend = FakeBackend.from_spec(spec)
    source = source or StaticPodSource(pods)
    state = PluginState(
        PluginConfig(NODE, sharing_mode=mode, shares_per_gpu=4,
                     mps=MpsSettings(pipe_dir="/run/carpool/mps/pipe", shm_dir="/run/carpool/shm"),
                     reports_root=reports_root, delivery=delivery,
                     cdi=CdiSettings(spec_dir=str(plugin_dir / "cdi"), stand_in="/dev/null"),
                     mps_client_uid=mps_client[0], mps_client_gid=mps_client[1]),
        backend, source, health=HealthTracker(recover_after_s=0.0), clock=lambda: NOW,
    )
    state.write_cdi_spec()
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    server = PluginServer(state, plugin_dir, poll_s=0.05)
    await server.start()
    try:
        yield kubelet, server, backend, source
    finally:
        await server.close()
        await kubelet.stop()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=20))


TWO_H200 = {"node": NODE, "gpus": [{"model": "H200", "count": 2}]}


def test_register_then_list_and_watch(plugin_dir: Path) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, _server, backend, _):
            [request] = kubelet.requests
            assert (request.version, request.endpoint, request.resource_name) == (
                "v1beta1", "carpool-gpu.sock", "carpool.dev/gpu")
            assert request.options.get_preferred_allocation_available
            assert kubelet.options is not None
            assert kubelet.options.get_preferred_allocation_available
            devices = await kubelet.updates.get()
            uuids = [g.uuid for g in backend.inventory()]
            assert sorted(devices) == sorted(f"{u}::{n}" for u in uuids for n in range(4))
            assert set(devices.values()) == {"Healthy"}
    run(scenario())


def test_reregisters_when_the_kubelet_restarts(plugin_dir: Path) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, server, _, _):
            supervisor = asyncio.create_task(server.supervise())
            restarted = FakeKubelet(plugin_dir)
            try:
                await kubelet.updates.get()
                await kubelet.stop()  # kubelet goes away, removing its socket and the plugin's
                server.socket.unlink()
                await restarted.start()
                for _ in range(200):
                    if server.registrations == 2:
                        break
                    await asyncio.sleep(0.05)
                assert [r.endpoint for r in restarted.requests] == ["carpool-gpu.sock"]
                assert server.registrations == 2 and server.socket.exists()
                devices = await restarted.updates.get()
                assert len(devices) == 8
            finally:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor
                await restarted.stop()
    run(scenario())


def test_list_and_watch_reports_a_health_flip_and_recovery(plugin_dir: Path) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, server, backend, _):
            await kubelet.updates.get()
            sick = backend.inventory()[1].uuid
            backend.inject_xid(1, 79)  # "GPU has fallen off the bus"
            assert await health_step(server.state, 0.0)
            devices = await kubelet.updates.get()
            assert {h for d, h in devices.items() if d.startswith(sick)} == {"Unhealthy"}
            assert {h for d, h in devices.items() if not d.startswith(sick)} == {"Healthy"}
            assert not await health_step(server.state, 0.0)  # probe still fails: stays down
            backend.clear_fault(1)
            assert await health_step(server.state, 0.0)
            assert set((await kubelet.updates.get()).values()) == {"Healthy"}
            backend.inject_xid(0, 13, persistent=False)  # an application's illegal address
            assert not await health_step(server.state, 0.0)
    run(scenario())


def allocate(stub: api_pb2_grpc.DevicePluginStub, *ids: str) -> Awaitable[api_pb2.AllocateResponse]:
    return stub.Allocate(api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(ids))]))


def test_allocate_mps_follows_the_assignment_and_marks_the_pod(plugin_dir: Path) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, _server, backend, source):
            gpu0, gpu1 = (g.uuid for g in backend.inventory())
            source.add(pod("train", [{"uuid": gpu1, "index": 1, "memoryMiB": 8192, "cores": 25}],
                           isolation="mps"))
            stub = kubelet.stub()
            preferred = await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
                container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[f"{gpu0}::0", f"{gpu0}::1", f"{gpu1}::3"],
                    allocation_size=1)]))
            assert list(preferred.container_responses[0].deviceIDs) == [f"{gpu1}::3"]
            response = await allocate(stub, f"{gpu1}::3")
            [container] = response.container_responses
            assert [d.name for d in container.cdi_devices] == [f"carpool.dev/gpu={gpu1}"]
            assert dict(container.envs) == {
                "CARPOOL_ISOLATION": "mps",
                "NVIDIA_VISIBLE_DEVICES": "void",
                "CUDA_VISIBLE_DEVICES": gpu1,
                "CARPOOL_GPU_MEMORY_LIMIT_MIB": "8192",
                "CUDA_MPS_PIPE_DIRECTORY": "/run/carpool/mps",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
            }
            assert [(m.container_path, m.host_path) for m in container.mounts] == [
                ("/run/carpool/mps", "/run/carpool/mps/pipe"), ("/dev/shm", "/run/carpool/shm")]
            marked = json.loads(source.pods["lab/train"].annotations[ANN_ALLOCATED])
            assert marked["containers"]["main"] == {"deviceIDs": [f"{gpu1}::3"], "gpus": [gpu1]}
            # the pod is no longer in flight: a second Allocate finds nobody
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(stub, f"{gpu1}::2")
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    run(scenario())


def test_a_pod_no_gpujob_owns_is_refused_and_an_uncapped_one_gets_its_memory_share(
        plugin_dir: Path) -> None:
    """The GPU is handed only to a GpuJob's pod: a bare pod the extender assigned (a cluster
    without the admission policy) gets PERMISSION_DENIED, which the kubelet puts on the pod.
    An MPS grant without cores is held to its memory share of the SMs (what it is billed)."""
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, _server, backend, source):
            gpu0, _ = (g.uuid for g in backend.inventory())
            total = backend.inventory()[0].memory_total_mib
            source.add(pod("bare", [{"uuid": gpu0, "index": 0, "memoryMiB": 8192, "cores": 0}],
                           isolation="mps", owner=""))
            stub = kubelet.stub()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(stub, f"{gpu0}::0")
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "pod lab/bare is not owned by a GpuJob" in (err.value.details() or "")
            assert "Submit a GpuJob" in (err.value.details() or "")
            assert ANN_ALLOCATED not in source.pods["lab/bare"].annotations
            del source.pods["lab/bare"]
            source.add(pod("owned", [{"uuid": gpu0, "index": 0, "memoryMiB": 8192, "cores": 0}],
                           isolation="mps"))
            envs = dict((await allocate(stub, f"{gpu0}::1")).container_responses[0].envs)
            assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(-(-8192 * 100 // total))
    run(scenario())


def test_allocate_serves_the_isolation_the_extender_recorded_not_the_pods_annotation(
        plugin_dir: Path) -> None:
    """A tenant that changes its pod's `carpool.dev/isolation` after admission (a cluster
    without the admission policy) still gets the MPS share its job asked for and the extender
    recorded; a pod another scheduler placed is not served."""
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, _server, backend, source):
            gpu0, _ = (g.uuid for g in backend.inventory())
            share = [{"uuid": gpu0, "index": 0, "memoryMiB": 8192, "cores": 25}]
            changed = pod("changed", share, isolation="mps")
            source.add(dataclasses.replace(changed, annotations={
                **changed.annotations, ANN_ISOLATION: "exclusive"}))
            stub = kubelet.stub()
            envs = dict((await allocate(stub, f"{gpu0}::0")).container_responses[0].envs)
            assert envs["CARPOOL_ISOLATION"] == "mps"
            assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
            elsewhere = dataclasses.replace(pod("elsewhere", share, isolation="mps"),
                                            scheduler="default-scheduler")
            source.add(elsewhere)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(stub, f"{gpu0}::1")
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "was not placed by carpool-scheduler" in (err.value.details() or "")
    run(scenario())


def test_an_mps_share_goes_only_to_a_pod_running_as_the_mps_client_user(
        plugin_dir: Path) -> None:
    """With the MPS client user configured (mpsDaemon.clientUid/clientGid), Allocate refuses an
    MPS share to a pod with a container that runs as another user or group (its own setting
    over the pod's, an init container too), or leaves it to the image; the pod the operator
    makes (the user on the pod, none on its containers) is served."""
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200, mps_client=(1000, 1001)) as (
                kubelet, _server, backend, source):
            gpu0, _ = (g.uuid for g in backend.inventory())
            share = [{"uuid": gpu0, "index": 0, "memoryMiB": 8192, "cores": 25}]
            stub = kubelet.stub()
            refused = {
                "root": ((1000, 1001), (("main", 0, None),),
                         "container 'main' runs as user 0 (securityContext.runAsUser)"),
                "group": ((1000, 1001), (("setup", None, 0), ("main", None, None)),
                          "container 'setup' runs as group 0 (securityContext.runAsGroup)"),
                "unset": ((None, None), (("main", None, None),),
                          "container 'main' runs as user the image's"),
            }
            for n, (name, (run_as, containers, why)) in enumerate(refused.items()):
                source.add(dataclasses.replace(pod(name, share, isolation="mps"),
                                               run_as=run_as, containers_run_as=containers))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await allocate(stub, f"{gpu0}::{n}")
                assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, name
                details = err.value.details() or ""
                assert f"pod lab/{name}: {why}" in details, details
                assert "MPS clients on this node run as" in details
                assert ANN_ALLOCATED not in source.pods[f"lab/{name}"].annotations
                del source.pods[f"lab/{name}"]
            source.add(dataclasses.replace(pod("client", share, isolation="mps"),
                                           run_as=(1000, 1001),
                                           containers_run_as=(("main", None, None),)))
            envs = dict((await allocate(stub, f"{gpu0}::3")).container_responses[0].envs)
            assert envs["CARPOOL_ISOLATION"] == "mps"
    run(scenario())


def test_a_pods_run_as_user_is_read_from_the_pod_and_every_container() -> None:
    from carpool.deviceplugin.kube import pod_view
    view = pod_view({"metadata": {"namespace": "lab", "name": "p"}, "spec": {
        "securityContext": {"runAsUser": 1000},
        "initContainers": [{"name": "setup", "securityContext": {"runAsGroup": 7}}],
        "containers": [{"name": "main"}, {"name": "side", "securityContext": {
            "runAsUser": 0, "runAsGroup": 0}}]}})
    assert view.run_as == (1000, None)
    assert view.containers_run_as == (("setup", None, 7), ("main", None, None),
                                      ("side", 0, 0))


def test_allocate_hands_the_pod_its_report_directory(plugin_dir: Path) -> None:
    """With a reports root, Allocate creates the pod's own report directory (any user in the
    container may write it) and mounts it where the workload protocol says."""
    async def scenario() -> None:
        root = plugin_dir / "reports"
        async with running(plugin_dir, TWO_H200, reports_root=root) as (kubelet, _s, backend,
                                                                         source):
            gpu0 = backend.inventory()[0].uuid
            source.add(pod("train", [{"uuid": gpu0, "index": 0, "memoryMiB": 8192,
                                      "cores": 25}], isolation="mps"))
            response = await allocate(kubelet.stub(), f"{gpu0}::0")
            [container] = response.container_responses
            uid = source.pods["lab/train"].uid
            assert container.envs["CARPOOL_REPORT_DIR"] == "/var/run/carpool"
            assert ("/var/run/carpool", str(root / uid), False) in [
                (m.container_path, m.host_path, m.read_only) for m in container.mounts]
            assert (root / uid).is_dir() and (root / uid).stat().st_mode & 0o7777 == 0o1777
    run(scenario())


def test_allocate_mig_timeslice_and_exclusive(plugin_dir: Path) -> None:
    spec = {"node": NODE, "gpus": [
        {"model": "A100", "migInstances": [{"profile": "3g.40gb", "slices": 3, "memoryMiB": 40192},
                                           {"profile": "1g.10gb", "slices": 1, "memoryMiB": 9856}]},
        {"model": "A100", "count": 2},
    ]}

    async def scenario() -> None:
        async with running(plugin_dir, spec, mode="timeslice") as (kubelet, _server, backend,
                                                                     source):
            mig_gpu, gpu1, gpu2 = backend.inventory()
            mig = mig_gpu.mig_instances[1].uuid
            stub = kubelet.stub()
            devices = await kubelet.updates.get()
            assert sum(d.startswith(mig_gpu.uuid) for d in devices) == 2  # one per MIG instance

            source.add(pod("infer", [{"uuid": mig_gpu.uuid, "index": 0, "memoryMiB": 9856,
                                      "cores": 0, "migInstance": mig}], isolation="mig"))
            [answer] = (await allocate(stub, f"{mig_gpu.uuid}::1")).container_responses
            assert answer.envs["CUDA_VISIBLE_DEVICES"] == mig
            assert [d.name for d in answer.cdi_devices] == [f"carpool.dev/gpu={mig}"]

            source.add(pod("notebook", [{"uuid": gpu1.uuid, "index": 1, "memoryMiB": 4096,
                                         "cores": 30}], isolation="timeslice"))
            envs = dict((await allocate(stub, f"{gpu1.uuid}::0")).container_responses[0].envs)
            assert envs["CUDA_VISIBLE_DEVICES"] == gpu1.uuid
            assert envs["CARPOOL_GPU_MEMORY_LIMIT_MIB"] == "4096"
            assert not any(k.startswith("CUDA_MPS") for k in envs)

            whole = {"memoryMiB": 81920, "cores": 100}
            source.add(pod("big", [{"uuid": gpu1.uuid, "index": 1, **whole},
                                   {"uuid": gpu2.uuid, "index": 2, **whole}],
                           isolation="exclusive"))
            response = await allocate(stub, f"{gpu1.uuid}::1", f"{gpu2.uuid}::1")
            envs = dict(response.container_responses[0].envs)
            assert envs == {"CARPOOL_ISOLATION": "exclusive",
                            "CUDA_VISIBLE_DEVICES": f"{gpu1.uuid},{gpu2.uuid}",
                            "NVIDIA_VISIBLE_DEVICES": "void"}
            assert [d.name for d in response.container_responses[0].cdi_devices] == [
                f"carpool.dev/gpu={gpu1.uuid}", f"carpool.dev/gpu={gpu2.uuid}"]
            # every device Allocate named is in the node's spec
            written = json.loads((plugin_dir / "cdi" / SPEC_FILE).read_text())
            assert {mig, gpu1.uuid, gpu2.uuid} <= {d["name"] for d in written["devices"]}

            source.add(pod("wants-mps", [{"uuid": gpu2.uuid, "index": 2, "memoryMiB": 1024,
                                          "cores": 10}], isolation="mps"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(stub, f"{gpu2.uuid}::0")
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "timeslice mode" in (err.value.details() or "")
    run(scenario())


def test_the_kubelet_choice_is_matched_by_gpu_when_counts_tie(plugin_dir: Path) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, _server, backend, source):
            gpu0, gpu1 = (g.uuid for g in backend.inventory())
            # two in flight with the same count (a stale one and a fresh one): the shares' GPU
            # decides, so neither gets the other's GPU
            source.add(pod("old", [{"uuid": gpu0, "index": 0, "memoryMiB": 1024, "cores": 10}],
                           assigned_at="2027-01-15T07:00:00Z"))
            source.add(pod("new", [{"uuid": gpu1, "index": 1, "memoryMiB": 2048, "cores": 10}]))
            envs = dict((await allocate(kubelet.stub(), f"{gpu1}::0")).container_responses[0].envs)
            assert envs["CUDA_VISIBLE_DEVICES"] == gpu1
            assert ANN_ALLOCATED in source.pods["lab/new"].annotations
            assert ANN_ALLOCATED not in source.pods["lab/old"].annotations
    run(scenario())


@pytest.mark.parametrize(
    ("ids", "code", "words"),
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "no device IDs"),
        (["not-a-share"], grpc.StatusCode.INVALID_ARGUMENT, "not a Carpool share ID"),
        (["GPU-nope::0"], grpc.StatusCode.NOT_FOUND, "not advertised"),
        (["{0}::0", "{0}::1"], grpc.StatusCode.INVALID_ARGUMENT, "distinct GPUs"),
        (["{0}::0", "{1}::0"], grpc.StatusCode.FAILED_PRECONDITION, "assigned 2"),
    ],
)
def test_bad_allocate_requests_get_grpc_errors(plugin_dir: Path, ids: list[str],
                                               code: grpc.StatusCode, words: str) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, _server, backend, source):
            gpu0, gpu1 = (g.uuid for g in backend.inventory())
            source.add(pod("one", [{"uuid": gpu0, "index": 0, "memoryMiB": 1024, "cores": 10}]))
            stub = kubelet.stub()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(stub, *(i.format(gpu0, gpu1) for i in ids))
            assert err.value.code() is code
            assert words in (err.value.details() or "")
            # still serving afterwards
            ok = await allocate(stub, f"{gpu0}::2")
            assert dict(ok.container_responses[0].envs)["CUDA_VISIBLE_DEVICES"] == gpu0
    run(scenario())


def test_unhealthy_devices_and_bad_preferred_requests_are_refused(plugin_dir: Path) -> None:
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200) as (kubelet, server, backend, source):
            gpu0 = backend.inventory()[0].uuid
            source.add(pod("one", [{"uuid": gpu0, "index": 0, "memoryMiB": 1024, "cores": 10}]))
            backend.inject_xid(0, 48)  # double-bit ECC
            await health_step(server.state, 0.0)
            stub = kubelet.stub()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(stub, f"{gpu0}::0")
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
                    container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[f"{gpu0}::0"], allocation_size=3)]))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    run(scenario())


class MarksLostTwice(StaticPodSource):
    """The first two `allocated` marks fail, as while the API server restarts."""

    failures = 2

    async def mark_allocated(self, pod: ServedPod, value: str) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("API server unreachable")
        await super().mark_allocated(pod, value)


def test_a_lost_allocated_mark_is_retried_until_it_lands(plugin_dir: Path) -> None:
    source = MarksLostTwice()

    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200, source=source) as (_kubelet, server, backend,
                                                                      _source):
            gpu0 = backend.inventory()[0].uuid
            first = pod("first", [{"uuid": gpu0, "index": 0, "memoryMiB": 1024, "cores": 10}])
            source.add(first)
            server.state.retry_mark(first, '{"containers": {}}', Backoff(first=0.01, most=0.01), 3)
            for _ in range(100):
                if source.marked:
                    break
                await asyncio.sleep(0.01)
            assert source.marked == [("lab/first", '{"containers": {}}')]
            assert source.failures == 0
    run(scenario())


def test_a_process_outside_mps_is_refused_a_gpu_in_exclusive_process_mode(
        plugin_dir: Path) -> None:
    """Placement keeps them apart; an assignment that names such a GPU anyway is refused with
    the reason, rather than started into a CUDA error."""
    spec = {"node": NODE, "gpus": [{"model": "H200", "exclusiveProcess": True}]}

    async def scenario() -> None:
        async with running(plugin_dir, spec) as (kubelet, _server, backend, source):
            gpu0 = backend.inventory()[0].uuid
            source.add(pod("whole", [{"uuid": gpu0, "index": 0, "memoryMiB": 8192,
                                      "cores": 100}], isolation="exclusive"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(kubelet.stub(), f"{gpu0}::0")
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "runs MPS clients only (compute mode EXCLUSIVE_PROCESS)" in (
                err.value.details() or "")
            del source.pods["lab/whole"]
            source.add(pod("shared", [{"uuid": gpu0, "index": 0, "memoryMiB": 8192,
                                       "cores": 25}], isolation="mps"))
            assert (await allocate(kubelet.stub(), f"{gpu0}::1")).container_responses
    run(scenario())


def test_allocate_in_env_mode_names_the_gpus_in_the_runtime_variable(plugin_dir: Path) -> None:
    """For runtimes without CDI: no CDI device, the GPUs in NVIDIA_VISIBLE_DEVICES, no spec."""
    async def scenario() -> None:
        async with running(plugin_dir, TWO_H200, delivery=DeviceDelivery.ENV) as (
                kubelet, _server, backend, source):
            gpu0 = backend.inventory()[0].uuid
            source.add(pod("train", [{"uuid": gpu0, "index": 0, "memoryMiB": 8192,
                                      "cores": 25}], isolation="mps"))
            [answer] = (await allocate(kubelet.stub(), f"{gpu0}::0")).container_responses
            assert list(answer.cdi_devices) == []
            assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == gpu0
            assert not (plugin_dir / "cdi").exists()
    run(scenario())
