"""The node agent's periodic work: the watchdog loop, per-pod peaks, metrics, the MPS daemon."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from carpool.core.names import ANN_ASSIGNMENT, ANN_ISOLATION
from carpool.deviceplugin.agent import Telemetry, Watchdog, health_step
from carpool.deviceplugin.backends.base import ProcessActivity, ProcessMemory
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool.deviceplugin.handshake import ServedPod
from carpool.deviceplugin.mps import MpsDaemon
from carpool.deviceplugin.plugin import PluginConfig, PluginState
from carpool.deviceplugin.pods import StaticPodSource

NODE = "n1"


class RecordingWriter:
    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.events: list[tuple[str, str]] = []

    async def publish_status(self, node: str, status: Any) -> None:
        self.statuses.append(dict(status))

    async def pod_event(self, pod: ServedPod, reason: str, message: str, warning: bool) -> None:
        self.events.append((pod.key, reason))


def running_pod(name: str, gpu: str, memory_mib: int, isolation: str) -> ServedPod:
    assignment = {"node": NODE, "gpus": [{"uuid": gpu, "index": 0, "memoryMiB": memory_mib,
                                          "cores": 0}]}
    return ServedPod("lab", name, f"uid-{name}", "Running", False,
                   {ANN_ASSIGNMENT: json.dumps(assignment), ANN_ISOLATION: isolation},
                   (("main", 1),))


def test_watchdog_kills_timesliced_and_mps_pods_over_their_grant_and_tracks_peaks() -> None:
    """An MPS client that raised its own limit is fenced only at the GPU's ceiling, so the
    watchdog holds MPS pods to their grants too; a pod within its grant and a process outside
    pods are left alone."""
    backend = FakeBackend.from_spec({"node": NODE, "gpus": [{"model": "T4"}]})
    gpu = backend.inventory()[0].uuid
    pods = StaticPodSource([running_pod("greedy", gpu, 2048, "timeslice"),
                            running_pod("raised", gpu, 2048, "mps"),
                            running_pod("honest", gpu, 2048, "mps")])
    backend.set_processes([ProcessMemory(100, gpu, 3000), ProcessMemory(200, gpu, 5000),
                           ProcessMemory(300, gpu, 999), ProcessMemory(400, gpu, 2000)])
    state = PluginState(PluginConfig(NODE, "mps"), backend, pods)
    writer = RecordingWriter()
    telemetry = Telemetry(state, writer)
    killed: list[int] = []
    owners = {100: "uid-greedy", 200: "uid-raised", 300: None, 400: "uid-honest"}
    dog = Watchdog(state, writer, telemetry, pod_of=owners.get, kill=killed.append)

    async def three_readings() -> list[list[str]]:
        return [await dog.step() for _ in range(3)]

    steps = asyncio.run(three_readings())
    assert [len(s) for s in steps] == [2, 2, 2]
    assert all("killed 1 process" in line for line in steps[2])
    assert killed == [100, 200]  # by pod name: greedy, raised; the host process is no pod's
    assert writer.events == [("lab/greedy", "GpuMemoryOverGrant"),
                             ("lab/raised", "GpuMemoryOverGrant")] * 2 + [
        ("lab/greedy", "GpuMemoryKilled"), ("lab/raised", "GpuMemoryKilled")]
    assert telemetry.peaks == {("lab", "greedy", gpu): 3000, ("lab", "raised", gpu): 5000,
                               ("lab", "honest", gpu): 2000}
    assert asyncio.run(telemetry.step())
    assert {(p["name"], p["peakMemoryMiB"]) for p in writer.statuses[0]["pods"]} == {
        ("greedy", 3000), ("raised", 5000), ("honest", 2000)}
    assert not asyncio.run(telemetry.step())  # nothing moved: rate-limited
    metrics = generate_latest(state.metrics.registry).decode()
    assert 'carpool_gpu_watchdog_kills_total{node="n1"} 2.0' in metrics
    assert "carpool_gpu_pod_memory_peak_mib" in metrics


def test_the_gpunode_says_when_each_pod_last_used_its_gpu_where_the_driver_measures() -> None:
    """Per-process GPU activity, when the backend measures it, becomes each pod's
    lastActiveTime (to the minute) and the GpuNode's processActivity; a backend that cannot
    say leaves both out, so no pod there is taken for idle."""
    backend = FakeBackend.from_spec({"node": NODE, "gpus": [{"model": "T4"}]})
    gpu = backend.inventory()[0].uuid
    pods = StaticPodSource([running_pod("busy", gpu, 2048, "mps"),
                            running_pod("idle", gpu, 2048, "mps")])
    backend.set_processes([ProcessMemory(100, gpu, 500), ProcessMemory(200, gpu, 500)])
    state = PluginState(PluginConfig(NODE, "mps"), backend, pods)
    writer = RecordingWriter()
    telemetry = Telemetry(state, writer)
    owners = {100: "uid-busy", 200: "uid-idle"}
    dog = Watchdog(state, writer, telemetry, pod_of=owners.get, kill=lambda pid: None)
    asyncio.run(dog.step())
    assert asyncio.run(telemetry.step())
    assert "processActivity" not in writer.statuses[-1]  # the fake measures nothing yet
    assert all("lastActiveTime" not in p for p in writer.statuses[-1]["pods"])

    backend.set_activity([ProcessActivity(100, gpu, 35)])
    asyncio.run(dog.step())
    assert asyncio.run(telemetry.step())
    status = writer.statuses[-1]
    assert status["processActivity"] is True
    active = {p["name"]: p.get("lastActiveTime") for p in status["pods"]}
    assert active["idle"] is None and active["busy"].endswith(":00Z")


def test_health_step_feeds_metrics_and_status() -> None:
    backend = FakeBackend.from_spec({"node": NODE, "gpus": [{"model": "T4", "count": 2}]})
    state = PluginState(PluginConfig(NODE), backend, StaticPodSource())
    backend.set_temperature(1, 71.0)
    backend.inject_xid(1, 79)
    assert asyncio.run(health_step(state, 0.0))
    metrics = generate_latest(state.metrics.registry).decode()
    sick = backend.inventory()[1].uuid
    assert f'carpool_gpu_healthy{{gpu="1",model="T4",node="n1",uuid="{sick}"}} 0.0' in metrics
    assert f'carpool_gpu_temperature_celsius{{gpu="1",model="T4",node="n1",uuid="{sick}"}} 71.0' \
        in metrics
    writer = RecordingWriter()
    asyncio.run(Telemetry(state, writer).step())
    gpus = writer.statuses[0]["gpus"]
    assert (gpus[1]["health"], gpus[1]["healthReason"]) == ("Unhealthy", "xid 79: Xid 79")
    assert "healthReason" not in gpus[0]


FAKE_CONTROL = """#!/bin/sh
# Stands in for nvidia-cuda-mps-control: -d creates the control pipe, stdin takes commands.
if [ "$1" = "-d" ]; then
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  echo started >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  exit 0
fi
read cmd
case "$cmd" in
  get_server_list) echo 4242 ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
  *) echo "unknown $cmd" >&2; exit 1 ;;
esac
"""


def test_mps_daemon_start_is_idempotent_and_stop_quits(tmp_path: Path) -> None:
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(FAKE_CONTROL)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    daemon = MpsDaemon(tmp_path / "pipe", tmp_path / "log", binary=str(binary))
    assert not daemon.running()
    daemon.start()
    daemon.start()  # already answering: not started twice
    assert daemon.running() and daemon.command("get_server_list") == "4242"
    assert (tmp_path / "log" / "control.log").read_text().count("started") == 1
    daemon.stop()
    assert not daemon.running()
    missing = MpsDaemon(tmp_path / "p2", tmp_path / "l2", binary=os.fspath(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="not on PATH"):
        missing.start()
