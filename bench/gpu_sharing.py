"""GPU sharing on a real NVIDIA GPU, through the device plugin's own answers (`make gpu-check`).

  (a) the NVML backend's inventory and the GpuNode status the plugin would publish;
  (b) an MPS control daemon, the plugin's Allocate answers (over its real gRPC socket) for four
      containers of 8 GiB / 25 % each, and CUDA work run with exactly that environment: a
      10 GiB allocation must fail and a 6 GiB one succeed in each;
  (c) ResNet-50 fp16 batch-8 inference: 1 process exclusive vs 4 processes time-sliced vs 4
      processes under MPS, every process started with the environment Allocate returned;
  (d) the time-slice watchdog against a process that holds more than its grant;
  (e) isolation (`--isolation` runs only this part): the plugin's own MPS setup (control daemon
      fenced at the node's ceiling before any server starts, `mps.MpsDaemon.fence`) and its
      Allocate answer for an 8 GiB / 25 % pod; then clients that keep that environment, raise
      their memory limit, ask for 100 % of the SMs, or drop the pipe directory, each alone on
      the GPU: what memory each could allocate and the bf16 matmul rate it got; and the
      watchdog against the client that raised its memory limit. Escapes are counted against
      the grant and the ceiling, and the one only EXCLUSIVE_PROCESS can stop is reported so.
First it measures how much CPU four busy processes get against one (`--cpu-only` stops there):
eager inference is launch-bound, so that bounds the ratios in (c). `--cuda-graph` makes each
request one graph replay instead, which shows what the GPU itself can give.

Needs the `carpool` package importable plus torch and
torchvision. `--dry-run` exercises the plugin side with the fake backend, without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

GIB = 1024
RESNET_BATCH = 8
WORKER_FLAG = "--worker"
# the throughput setups, in the order each round runs them
SETUPS = {
    "exclusive": "exclusive, 1 process",
    "timeslice": "time-sliced, 4 processes",
    "mps": "MPS, 4 processes (8 GiB / 25 % each)",
    "mps_open": "MPS, 4 processes (8 GiB each, no SM cap)",
}


# --- worker side (runs in a subprocess with the plugin's environment) --------------------------


def worker_memory() -> dict[str, Any]:
    """Try 10 GiB, then 6 GiB, then time a bf16 matmul: the MPS caps as the client sees them."""
    import torch

    out: dict[str, Any] = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    torch.cuda.init()
    for gib in (10, 6):
        try:
            block = torch.empty(gib * 1024**3, dtype=torch.uint8, device="cuda")
            block.fill_(1)
            torch.cuda.synchronize()
            out[f"alloc_{gib}GiB"] = "ok"
            del block
        except RuntimeError as err:  # torch.OutOfMemoryError, or a plain CUDA error under MPS
            out[f"alloc_{gib}GiB"] = "refused: " + str(err).splitlines()[0][:160]
        torch.cuda.empty_cache()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # start the matmul together with the other clients
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    out["matmul_tflops"] = round(2 * 8192**3 * reps / (time.perf_counter() - start) / 1e12, 1)
    return out


def worker_resnet(seconds: float, graph: bool) -> dict[str, Any]:
    """Serve ResNet-50 fp16 batch-8 requests back to back for `seconds`; latency per request.

    `graph`: each request replays a captured CUDA graph of the forward pass (one launch), as a
    tuned inference server does, instead of eager PyTorch's ~160 kernel launches from Python.

    Set up as a serving process would be: one intra-op CPU thread (the work is on the GPU; a
    pool per process only fights the other workers for cores) and no garbage-collector pauses
    inside the timed loop."""
    import gc

    import torch
    import torchvision

    torch.set_num_threads(1)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(weights=None).half().cuda().eval()
    model = model.to(memory_format=torch.channels_last)
    batch = torch.randn(RESNET_BATCH, 3, 224, 224, device="cuda", dtype=torch.float16)
    batch = batch.to(memory_format=torch.channels_last)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and cuDNN's autotuning) off the capture
            for _ in range(30):
                model(batch)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        forward: Any = lambda: model(batch)  # noqa: E731
        if graph:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                model(batch)
            forward = captured.replay
            for _ in range(10):
                forward()
            torch.cuda.synchronize()
        gc.collect()
        gc.freeze()
        gc.disable()
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
        latencies = []
        end = time.perf_counter() + seconds
        while (now := time.perf_counter()) < end:
            forward()
            torch.cuda.synchronize()
            latencies.append(time.perf_counter() - now)
        gc.enable()
    return {"requests": len(latencies), "seconds": seconds, "latencies_ms":
            [round(x * 1000, 3) for x in latencies]}


def worker_escape(ladder: list[int]) -> dict[str, Any]:
    """Allocate each size of `ladder` (GiB) in turn, then time a bf16 matmul alone: what this
    client's environment lets it take."""
    import torch

    out: dict[str, Any] = {"mps_env": {
        k: v for k, v in sorted(os.environ.items())
        if k.startswith("CUDA_MPS_") and k != "CUDA_MPS_LOG_DIRECTORY"}}
    torch.cuda.init()
    for gib in ladder:
        try:
            block = torch.empty(gib * 1024**3, dtype=torch.uint8, device="cuda")
            block.fill_(1)
            torch.cuda.synchronize()
            out[f"{gib}GiB"] = "ok"
            del block
        except RuntimeError as err:
            out[f"{gib}GiB"] = "refused: " + str(err).splitlines()[0][:100]
        torch.cuda.empty_cache()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 40
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    out["matmul_tflops"] = round(2 * 8192**3 * reps / (time.perf_counter() - start) / 1e12, 1)
    return out


def worker_hog(gib: int, seconds: float) -> dict[str, Any]:
    """Hold `gib` GiB for up to `seconds` (the watchdog should kill us first)."""
    import torch

    block = torch.empty(gib * 1024**3, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    time.sleep(seconds)
    return {"survived": True}


def worker_spin(seconds: float) -> dict[str, Any]:
    """Pure-Python busy loop: how much CPU this process gets, in loop turns per second."""
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    turns, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            turns += 1
    return {"turns_per_s": turns / seconds}


def worker_main(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "memory":
        result = worker_memory()
    elif kind == "resnet":
        result = worker_resnet(float(argv[1]), argv[2:] == ["graph"])
    elif kind == "spin":
        result = worker_spin(float(argv[1]))
    elif kind == "hog":
        result = worker_hog(int(argv[1]), float(argv[2]))
    elif kind == "escape":
        result = worker_escape([int(x) for x in argv[1:]])
    else:
        raise SystemExit(f"unknown worker {kind!r}")
    print(json.dumps({"result": result}), flush=True)
    return 0


# --- parent side ----------------------------------------------------------------------------


def log(text: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {text}", flush=True)


def client_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without GPU selection or MPS settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CUDA_MPS_") and k not in ("CUDA_VISIBLE_DEVICES",
                                                          "NVIDIA_VISIBLE_DEVICES")}
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


def wait_ready(proc: subprocess.Popen[str], deadline: float) -> dict[str, Any] | None:
    """Read the worker's stdout up to its {"ready": true} line; None if it died first."""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        if line.startswith('{"ready"'):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
    return None


def run_workers(kind: list[str], envs: list[dict[str, str]], timeout_s: float = 180.0
                ) -> list[dict[str, Any]]:
    """Start one worker per env, wait until all are ready, release them together, collect."""
    # stderr to files, not pipes: a chatty worker must never block on a full pipe
    errs = [tempfile.TemporaryFile("w+") for _ in envs]  # noqa: SIM115 (closed below)
    try:
        return _run(kind, envs, errs, timeout_s)
    finally:
        for err in errs:
            err.close()


def _run(kind: list[str], envs: list[dict[str, str]], errs: list[Any], timeout_s: float
         ) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), WORKER_FLAG, *kind],
                         env=client_env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=err, text=True)
        for env, err in zip(envs, errs, strict=True)
    ]
    deadline = time.monotonic() + timeout_s
    for p, err in zip(procs, errs, strict=True):
        if not wait_ready(p, deadline):
            for other in procs:
                other.kill()
            raise RuntimeError(f"worker {kind} did not get ready: {tail(err)}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p, err in zip(procs, errs, strict=True):
        out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        found = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        result = next((f["result"] for f in found if "result" in f), None)
        if result is None:
            raise RuntimeError(f"worker {kind} failed (exit {p.returncode}): {tail(err)}")
        results.append(result)
    return results


def tail(err: Any) -> str:
    err.seek(0)
    return str(err.read())[-3000:]


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Throughput and latency of one setup over its rounds (each a list of worker results)."""
    results = [r for one in rounds for r in one]
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    seconds = sum(max(r["seconds"] for r in one) for one in rounds)
    requests = sum(r["requests"] for r in results)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"req_per_s": requests / seconds, "p50_ms": statistics.median(latencies),
            "p99_ms": p99, "requests": requests,
            "per_process_req_per_s": [round(r["requests"] / r["seconds"], 1) for r in results]}


def pod_view(name: str, gpu_uuid: str, index: int, memory_mib: int, cores: int,
             isolation: str) -> Any:
    from carpool.core.assignment import AssignedGpu, Assignment, encode_assignment
    from carpool.core.names import ANN_ASSIGNED_AT, ANN_ASSIGNMENT, ANN_ISOLATION, SCHEDULER_NAME
    from carpool.core.ownership import Owner
    from carpool.core.resources import Isolation
    from carpool.core.timestamps import format_timestamp
    from carpool.deviceplugin.handshake import ServedPod

    assignment = Assignment("bench-node", (AssignedGpu(gpu_uuid, index, memory_mib, cores),),
                            Isolation.parse(isolation) if isolation else None)
    return ServedPod("bench", name, f"uid-{name}", "Pending", False, {
        ANN_ASSIGNMENT: encode_assignment(assignment),
        ANN_ASSIGNED_AT: format_timestamp(time.time()),
        ANN_ISOLATION: isolation,
    }, (("main", 1),), owner=Owner(name, f"uid-{name}"), scheduler=SCHEDULER_NAME)


async def plugin_allocations(backend: Any, pipe_dir: Path,
                             requests: list[tuple[str, str, int, int]], ceiling_pct: int = 100
                             ) -> list[dict[str, Any]]:
    """Serve the plugin on a scratch socket and ask it, as the kubelet would, for each
    (pod name, isolation, memory MiB, cores %): GetPreferredAllocation, then Allocate.
    Pods arrive one at a time, as the handshake requires. Returns each answer as a dict."""
    import grpc

    from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc
    from carpool.deviceplugin.plugin import PluginConfig, PluginServer, PluginState
    from carpool.deviceplugin.pods import StaticPodSource
    from carpool.deviceplugin.sharing import MpsSettings

    source = StaticPodSource()
    config = PluginConfig("bench-node", "mps", shares_per_gpu=16,
                          mps=MpsSettings(pipe_dir=str(pipe_dir), ceiling_pct=ceiling_pct))
    state = PluginState(config, backend, source)
    gpu = state.gpus[0]
    plugin_dir = Path(tempfile.mkdtemp(prefix="cpb-", dir="/tmp"))
    server = PluginServer(state, plugin_dir)
    await server.serve()
    answers = []
    try:
        async with grpc.aio.insecure_channel(f"unix://{server.socket}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            devices = None
            async for listing in stub.ListAndWatch(api_pb2.Empty()):
                devices = [d.ID for d in listing.devices]
                break
            assert devices
            free = list(devices)
            for name, isolation, memory, cores in requests:
                source.add(pod_view(name, gpu.uuid, gpu.index, memory, cores, isolation))
                preferred = await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
                    container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=free, allocation_size=1)]))
                chosen = list(preferred.container_responses[0].deviceIDs)
                free = [d for d in free if d not in chosen]
                response = await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=chosen)]))
                c = response.container_responses[0]
                answers.append({
                    "pod": name, "deviceIDs": chosen, "envs": dict(sorted(c.envs.items())),
                    "mounts": [{"containerPath": m.container_path, "hostPath": m.host_path}
                               for m in c.mounts],
                    "allocatedAnnotation": source.pods[f"bench/{name}"].annotations.get(
                        "carpool.dev/allocated"),
                })
    finally:
        await server.close()
        shutil.rmtree(plugin_dir, ignore_errors=True)
    return answers


def host_env(answer: dict[str, Any]) -> dict[str, str]:
    """The Allocate answer as a host process sees it (container mount paths -> host paths)."""
    from carpool.deviceplugin.sharing import ContainerSetup, MountSpec, host_view

    setup = ContainerSetup(answer["envs"], tuple(MountSpec(m["containerPath"], m["hostPath"])
                                                 for m in answer["mounts"]))
    return host_view(setup)


def find_mps_control() -> str:
    for candidate in (shutil.which("nvidia-cuda-mps-control"),
                      "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
                      "/usr/bin/nvidia-cuda-mps-control"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("nvidia-cuda-mps-control not found: MPS needs the driver's MPS tools")


def cpu_scaling(seconds: float = 3.0, rounds: int = 3) -> float:
    """How much CPU four busy processes get together, relative to one alone (4.0 = perfect).

    Eager inference is launch-bound: each worker runs at its CPU's speed. On a host whose
    vCPUs slow down when several are busy, four MPS clients cannot reach 4x one exclusive
    process, whatever the GPU does; this puts the sharing ratios in context."""
    alone, together = 0.0, 0.0
    for _ in range(rounds):
        alone += run_workers(["spin", str(seconds)], [{}])[0]["turns_per_s"]
        together += sum(r["turns_per_s"] for r in run_workers(["spin", str(seconds)], [{}] * 4))
    return together / alone


def part_a(backend: Any) -> dict[str, Any]:
    from carpool.deviceplugin.telemetry import status_from_backend

    status = status_from_backend(backend, sharing_mode="mps", now=datetime.now(UTC),
                                 shares_per_gpu=16)
    log("(a) GpuNode status the plugin would publish:")
    print(json.dumps(status, indent=2), flush=True)
    return status


class EventLog:
    """The watchdog's cluster side, kept in memory: the Events it would post on pods."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def publish_status(self, node: str, status: Any) -> None: ...

    async def pod_event(self, pod: Any, reason: str, message: str, warning: bool) -> None:
        self.events.append(f"{reason}: {message}")


def part_watchdog(backend: Any, answers: list[dict[str, Any]], gpu_uuid: str,
                  env: dict[str, str] | None = None, isolation: str = "timeslice",
                  grant_gib: int = 4, hold_gib: int = 6) -> dict[str, Any]:
    """A 'pod' granted `grant_gib` holds `hold_gib` (by default a time-sliced one, 4 and 6 GiB):
    the watchdog warns twice, then kills."""
    from carpool.deviceplugin.agent import Watchdog
    from carpool.deviceplugin.plugin import PluginConfig, PluginState
    from carpool.deviceplugin.pods import StaticPodSource

    env = env if env is not None else host_env(answers[0])
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), WORKER_FLAG, "hog",
                             str(hold_gib), "60"], env=client_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    ready = wait_ready(proc, time.monotonic() + 120)
    if ready is None:
        raise RuntimeError("the memory hog did not start")
    pid = int(ready.get("pid", proc.pid))
    pod = pod_view("hog", gpu_uuid, 0, grant_gib * GIB, 0, isolation)
    pod = dataclasses.replace(pod, phase="Running")
    source = StaticPodSource([pod])
    state = PluginState(PluginConfig("bench-node", "mps"), backend, source)
    writer = EventLog()
    dog = Watchdog(state, writer, pod_of=lambda p: pod.uid if p == pid else None)
    steps: list[list[str]] = []
    for _ in range(5):
        steps.append(asyncio.run(dog.step()))
        if proc.poll() is not None:
            break
        time.sleep(1.0)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    return {"steps": steps, "exit_code": proc.returncode, "events": writer.events}


PINNED, THREADS, PIPE = ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                         "CUDA_MPS_PIPE_DIRECTORY")


def part_isolation(backend: Any, ceiling_pct: int) -> dict[str, Any]:
    """(e) What clients of an 8 GiB / 25 % MPS grant get when they keep or change the
    environment the plugin handed them, each alone on the GPU, under the plugin's own fenced
    MPS daemon; and the watchdog against the one that raised its memory limit."""
    from carpool.core.resources import mps_ceiling_mib as ceiling_mib
    from carpool.deviceplugin.mps import MpsDaemon

    gpus = backend.inventory()
    gpu = gpus[0]
    root = Path(tempfile.mkdtemp(prefix="carpool-iso-", dir="/tmp"))
    pipe_dir, log_dir = root / "pipe", root / "log"
    grant_gib, cores = 8, 25
    answers = asyncio.run(plugin_allocations(
        backend, pipe_dir, [("tenant", "mps", grant_gib * GIB, cores),
                            ("uncapped", "mps", grant_gib * GIB, 0)], ceiling_pct))
    honest, uncapped = host_env(answers[0]), host_env(answers[1])
    ceiling = ceiling_mib(gpu.memory_total_mib, ceiling_pct)
    ladder = [grant_gib + 2, ceiling // GIB - 4, ceiling // GIB + 6]
    clients: dict[str, dict[str, str]] = {
        "keeps the plugin's environment": honest,
        # what the fence allows (the largest grant the GPU may hold): the yardstick for escapes
        "reference: a grant at the ceiling": honest | {PINNED: f"0={ceiling}M",
                                                       THREADS: str(ceiling_pct)},
        "raises its memory limit (0=140G)": honest | {PINNED: "0=140G"},
        "asks for 100 % of the SMs": honest | {THREADS: "100"},
        "drops both limits": {k: v for k, v in honest.items() if k not in (PINNED, THREADS)},
        "uncapped pod (no gpu.cores): plugin's environment": uncapped,
        "drops the pipe directory (skips MPS)": {k: v for k, v in honest.items() if k != PIPE},
    }
    daemon = MpsDaemon(pipe_dir, log_dir, binary=find_mps_control())
    daemon.start()
    report: dict[str, Any] = {"ceiling_pct": ceiling_pct, "ceiling_mib": ceiling,
                              "grant": {"memory_gib": grant_gib, "cores_pct": cores},
                              "allocate_envs": [a["envs"] for a in answers], "ladder_gib": ladder}
    try:
        daemon.fence(ceiling_pct, [(g.uuid, g.memory_total_mib) for g in gpus])
        report["daemon_defaults"] = {
            "active_threads": daemon.command("get_default_active_thread_percentage"),
            "pinned_memory": daemon.command(f"get_default_device_pinned_mem_limit {gpu.uuid}")}
        log(f"(e) MPS daemon fenced before any server: {report['daemon_defaults']}; "
            f"Allocate for 8 GiB / 25 %: {answers[0]['envs']}")
        results = {}
        for name, env in clients.items():
            [results[name]] = run_workers(["escape", *map(str, ladder)], [env])
            log(f"    {name}: {json.dumps(results[name])}")
        report["clients"] = results
        report["watchdog"] = part_watchdog(backend, [], gpu.uuid,
                                           env=clients["raises its memory limit (0=140G)"],
                                           isolation="mps", grant_gib=grant_gib, hold_gib=20)
        log(f"    watchdog on the client holding 20 GiB of an 8 GiB grant: "
            f"{json.dumps(report['watchdog'])}")
        report["server_list"] = daemon.command("get_server_list")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return report


def print_isolation(report: dict[str, Any], gpu: Any) -> int:
    """The isolation table; returns the number of escapes beyond the daemon's ceiling other
    than the one only EXCLUSIVE_PROCESS can stop."""
    ladder, ceiling_pct = report["ladder_gib"], report["ceiling_pct"]
    results = report["clients"]
    full = results["drops the pipe directory (skips MPS)"]["matmul_tflops"]
    at_grant = results["keeps the plugin's environment"]["matmul_tflops"]
    at_ceiling = results["reference: a grant at the ceiling"]["matmul_tflops"]
    grant = report["grant"]
    print()
    print(f"Isolation on {gpu.model}: MPS daemon fenced at {ceiling_pct} % "
          f"({report['ceiling_mib']} MiB, {ceiling_pct} % threads) before any server; each "
          f"client alone; grant {grant['memory_gib']} GiB / {grant['cores_pct']} %")
    print()
    print(f"An escape takes more than the ceiling allows: a {ladder[-1]} GiB allocation, or over "
          f"1.1x the matmul rate of a client granted the ceiling ({at_ceiling:.0f} TFLOP/s; "
          f"SM throughput is not linear in the thread percentage).")
    print()
    print("| client | MPS variables it ran with | " + " | ".join(f"{g} GiB" for g in ladder)
          + " | bf16 TFLOP/s | of the GPU | outcome |")
    print("|---|---|" + "---|" * len(ladder) + "---:|---:|---|")
    escapes = 0
    for name, r in results.items():
        share = r["matmul_tflops"] / full if full else 0.0
        cells = ["ok" if r[f"{g}GiB"] == "ok" else "refused" for g in ladder]
        over_ceiling = cells[-1] == "ok" or r["matmul_tflops"] > 1.1 * at_ceiling
        over_grant = cells[0] == "ok" or r["matmul_tflops"] > 1.1 * at_grant
        if name.startswith("reference"):
            outcome = "what the fence allows"
        elif PIPE not in r["mps_env"]:
            outcome = "outside MPS: the whole GPU; only EXCLUSIVE_PROCESS stops it"
        elif over_ceiling:
            outcome = "ESCAPE beyond the daemon's ceiling"
            escapes += 1
        elif name.startswith("uncapped"):
            outcome = "held to its memory share of the SMs (what it is billed)"
        elif over_grant:
            outcome = "above its grant, held at the ceiling"
        else:
            outcome = "held to its grant"
        variables = ", ".join(f"{k.removeprefix('CUDA_MPS_')}={v}" for k, v in r["mps_env"].items()
                              if k != PIPE) or "none"
        print(f"| {name} | {variables} | " + " | ".join(cells)
              + f" | {r['matmul_tflops']:.0f} | {share:.0%} | {outcome} |")
    dog = report["watchdog"]
    print()
    print(f"watchdog, MPS client holding 20 GiB of its {grant['memory_gib']} GiB grant: "
          f"{len(dog['steps'])} readings, exit code {dog['exit_code']}; events: "
          f"{'; '.join(e.split(':')[0] for e in dog['events'])}")
    print(f"escapes beyond the ceiling (other than skipping MPS): {escapes}")
    return escapes


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        return worker_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per throughput run")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="each request replays a CUDA graph instead of eager launches")
    parser.add_argument("--cpu-only", action="store_true",
                        help="only measure how the CPU scales from 1 to 4 busy processes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="throughput rounds; each runs every setup once")
    parser.add_argument("--json", type=Path, help="also write all results here")
    parser.add_argument("--isolation", action="store_true",
                        help="only part (e): what escaping MPS clients get under the fence")
    parser.add_argument("--ceiling", type=int, default=50,
                        help="the MPS ceiling (%% of each GPU), as the plugin's --mps-ceiling")
    parser.add_argument("--dry-run", action="store_true",
                        help="fake backend, no GPU: only the plugin's Allocate answers")
    args = parser.parse_args()
    try:
        import carpool.deviceplugin  # noqa: F401
    except ImportError:
        raise SystemExit("the carpool package is not importable: install it (pip install "
                         "--no-deps --target DIR a built wheel; PYTHONPATH=DIR)") from None

    report: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds")}
    if args.isolation and not args.dry_run:
        from carpool.deviceplugin.backends.nvml import NvmlBackend

        nvml = NvmlBackend()
        try:
            report["isolation"] = part_isolation(nvml, args.ceiling)
            gpu0 = nvml.inventory()[0]
            print(f"{gpu0.model}, driver {nvml.driver_version()}, {report['date']}")
            escapes = print_isolation(report["isolation"], gpu0)
        finally:
            nvml.close()
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        return 1 if escapes else 0
    report["cpu_scaling_4"] = cpu_scaling()
    log(f"CPU: 4 busy processes get {report['cpu_scaling_4']:.2f}x the CPU of one "
        f"(a ceiling for launch-bound sharing ratios)")
    if args.cpu_only:
        return 0
    mps_root = Path(tempfile.mkdtemp(prefix="carpool-mps-", dir="/tmp"))
    pipe_dir, log_dir = mps_root / "pipe", mps_root / "log"
    client_requests = [(f"mps-{n}", "mps", 8 * GIB, 25) for n in range(4)]
    slice_requests = [(f"ts-{n}", "timeslice", 8 * GIB, 25) for n in range(4)]
    exclusive_request = [("exclusive", "exclusive", 0, 100)]
    # the same memory caps without an SM cap: what the 25 % thread limit costs in throughput
    # (cores 100: a grant without cores is held to its memory share, see gpuhours.sm_share_pct)
    open_requests = [(f"mps-open-{n}", "mps", 8 * GIB, 100) for n in range(4)]

    if args.dry_run:
        from carpool.deviceplugin.backends.fake import FakeBackend

        backend: Any = FakeBackend.from_spec({"node": "bench-node", "gpus": [{"model": "H200"}]})
        answers = asyncio.run(plugin_allocations(
            backend, pipe_dir, exclusive_request + slice_requests + client_requests
            + open_requests))
        for a in answers:
            print(json.dumps({**a, "hostEnv": host_env(a)}), flush=True)
        part_a(backend)
        return 0

    from carpool.deviceplugin.backends.nvml import NvmlBackend
    from carpool.deviceplugin.mps import MpsDaemon

    backend = NvmlBackend()
    report["status"] = part_a(backend)
    report["nvml_event_gpus"] = backend.event_gpus
    gpu = backend.inventory()[0]
    answers = asyncio.run(plugin_allocations(
        backend, pipe_dir, exclusive_request + slice_requests + client_requests + open_requests))
    report["allocate"] = answers
    excl, slices, clients, opened = answers[0], answers[1:5], answers[5:9], answers[9:13]
    log("(b) Allocate answers for the four 8 GiB / 25 % MPS containers:")
    for a in clients:
        print(json.dumps({"pod": a["pod"], "deviceIDs": a["deviceIDs"], "envs": a["envs"],
                          "mounts": a["mounts"]}), flush=True)

    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in SETUPS}
    memory: list[dict[str, Any]] = []
    resnet = ["resnet", str(args.seconds)] + (["graph"] if args.cuda_graph else [])
    for round_no in range(1, args.rounds + 1):
        # every setup once per round, back to back, so that drift in the VM's CPU speed (the
        # work is launch-bound) hits all of them alike; the ratios use the sums over rounds
        log(f"(c) round {round_no}/{args.rounds}: ResNet-50 fp16 batch {RESNET_BATCH}, "
            f"{args.seconds:.0f}s per setup")
        runs["exclusive"].append(run_workers(resnet, [host_env(excl)]))
        runs["timeslice"].append(run_workers(resnet, [host_env(a) for a in slices]))
        daemon = MpsDaemon(pipe_dir, log_dir, binary=find_mps_control())
        daemon.start()
        try:
            if round_no == 1:
                log("(b) memory caps and SM share under MPS, 4 clients with the plugin's env")
                memory = run_workers(["memory"], [host_env(a) for a in clients])
                report["mps_memory"] = memory
                for n, m in enumerate(memory):
                    log(f"    client {n}: 10 GiB {m['alloc_10GiB']}; 6 GiB {m['alloc_6GiB']}; "
                        f"bf16 matmul {m['matmul_tflops']} TFLOP/s while all 4 ran")
            runs["mps"].append(run_workers(resnet, [host_env(a) for a in clients]))
            runs["mps_open"].append(run_workers(resnet, [host_env(a) for a in opened]))
            report["mps_server_list"] = daemon.command("get_server_list")
        finally:
            daemon.stop()
        for name in SETUPS:
            log(f"    {name}: {summarize(runs[name][-1:])}")

    log("(d) time-slice watchdog: a pod granted 4 GiB holding 6 GiB")
    try:
        report["watchdog"] = part_watchdog(backend, slices, gpu.uuid)
        log(f"    {json.dumps(report['watchdog'])}")
    except Exception as err:  # report, do not hide the sharing results
        report["watchdog"] = {"error": repr(err)}
        log(f"    watchdog demo failed: {err!r}")
    log("(e) isolation: escaping MPS clients under the plugin's fenced daemon")
    report["isolation"] = part_isolation(backend, args.ceiling)
    backend.close()

    rows = {name: summarize(runs[name]) for name in SETUPS}
    report["throughput"] = rows
    report["rounds"] = [{name: summarize([runs[name][n]])["req_per_s"] for name in SETUPS}
                        for n in range(args.rounds)]
    base, mps, uncapped = rows["exclusive"], rows["mps"], rows["mps_open"]
    print()
    print(f"GPU sharing on {gpu.model} ({gpu.memory_total_mib} MiB), driver "
          f"{report['status']['driverVersion']}, CUDA {report['status']['cudaVersion']}, "
          f"{report['date']}")
    mode = "CUDA graph replay" if args.cuda_graph else "eager"
    print(f"ResNet-50 fp16, batch {RESNET_BATCH}, {mode}, {args.rounds} rounds x "
          f"{args.seconds:.0f}s per setup, requests back to back in each process")
    print()
    print("| setup | req/s | vs exclusive | p50 ms | p99 ms | p99 vs exclusive |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, label in SETUPS.items():
        r = rows[name]
        print(f"| {label} | {r['req_per_s']:.0f} | {r['req_per_s'] / base['req_per_s']:.2f}x | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p99_ms'] / base['p99_ms']:.2f}x |")
    print()
    print("| round | " + " | ".join(SETUPS) + " | MPS vs exclusive |")
    print("|---:|" + "---:|" * (len(SETUPS) + 1))
    for n, one in enumerate(report["rounds"], start=1):
        print(f"| {n} | " + " | ".join(f"{one[name]:.0f}" for name in SETUPS)
              + f" | {one['mps'] / one['exclusive']:.2f}x |")
    mps_ok = (mps["req_per_s"] >= 4 * base["req_per_s"], mps["p99_ms"] <= 1.2 * base["p99_ms"])
    caps_ok = all(m["alloc_10GiB"].startswith("refused") and m["alloc_6GiB"] == "ok"
                  for m in memory)
    print()
    print(f"CPU: 4 busy processes got {report['cpu_scaling_4']:.2f}x the CPU of one (a ceiling "
          f"for the eager, launch-bound ratios)")
    print(f"memory caps: 10 GiB refused and 6 GiB allowed in all 4 MPS clients: {caps_ok}")
    print(f"target MPS >= 4x exclusive throughput: {mps_ok[0]}; p99 <= 1.2x exclusive: "
          f"{mps_ok[1]} (25 % SM cap); without the SM cap: "
          f"{uncapped['req_per_s'] / base['req_per_s']:.2f}x, p99 "
          f"{uncapped['p99_ms'] / base['p99_ms']:.2f}x")
    print_isolation(report["isolation"], gpu)
    if args.json:
        for r in report.get("allocate", []):
            r.pop("allocatedAnnotation", None)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
