"""`python -m carpool.deviceplugin --node-name N --backend nvml|fake ...`: run the node agent.

Serves the kubelet device plugin API (and keeps it registered across kubelet restarts), runs
the MPS control daemon in MPS mode, watches GPU health, enforces time-sliced memory grants,
publishes the node's GpuNode status and serves Prometheus metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from carpool.core.gpunode import SHARING_MODES
from carpool.deviceplugin.cdi import DEFAULT_SPEC_DIR, CdiSettings, DeviceDelivery, DriverMount
from carpool.deviceplugin.plugin import DEFAULT_PLUGIN_DIR, ENDPOINT, PluginConfig

log = logging.getLogger("carpool.deviceplugin")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m carpool.deviceplugin", description=__doc__)
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="this node's name (default: $NODE_NAME)")
    p.add_argument("--backend", choices=("nvml", "fake"), default="nvml")
    p.add_argument("--fake-spec", type=Path, help="fake backend: a YAML node spec")
    p.add_argument("--openb-node-list", type=Path,
                   help="fake backend: take this node's row from an openb node list CSV")
    p.add_argument("--fake-usage-file", type=Path,
                   help="fake backend, for tests: read each process's GPU memory from this "
                        "JSON file, which the host's test writes (a root-owned path, never "
                        "one a pod can write)")
    p.add_argument("--sharing-mode", choices=tuple(SHARING_MODES), default="mps")
    p.add_argument("--shares-per-gpu", type=int, default=8,
                   help="carpool.dev/gpu devices advertised per GPU (MPS/timeslice)")
    p.add_argument("--plugin-dir", type=Path, default=Path(DEFAULT_PLUGIN_DIR))
    p.add_argument("--endpoint", default=ENDPOINT, help="socket file name in --plugin-dir")
    p.add_argument("--mps-pipe-dir", type=Path, default=Path("/run/carpool/mps/pipe"))
    p.add_argument("--mps-log-dir", type=Path, default=Path("/run/carpool/mps/log"))
    p.add_argument("--mps-shm-dir", default="",
                   help="host tmpfs mounted as the clients' /dev/shm (empty: none)")
    p.add_argument("--no-manage-mps", action="store_true",
                   help="do not start the MPS control daemon (another container runs it; the "
                        "plugin still checks that its defaults hold the ceiling)")
    p.add_argument("--mps-ceiling", type=int, default=50, metavar="PERCENT",
                   help="the most one MPS client may hold of each GPU's memory and SMs, set on "
                        "the control daemon before any server starts (1-100)")
    p.add_argument("--mps-client-uid", type=int, default=None, metavar="UID",
                   help="the user every MPS client runs as (the chart's mpsDaemon.clientUid, "
                        "which the operator sets on MPS jobs' pods): Allocate refuses an MPS "
                        "share to a pod with a container running as another user")
    p.add_argument("--mps-client-gid", type=int, default=None, metavar="GID",
                   help="the group every MPS client runs as (mpsDaemon.clientGid), likewise")
    p.add_argument("--device-delivery", choices=("cdi", "env"), default="cdi",
                   help="hand GPUs to containers as CDI devices (the runtime adds exactly their "
                        "device nodes) or through NVIDIA_VISIBLE_DEVICES (runtimes without CDI)")
    p.add_argument("--cdi-spec-dir", default=DEFAULT_SPEC_DIR,
                   help="where the node's CDI spec is written (a directory the runtime reads)")
    p.add_argument("--cdi-driver-mount", action="append", default=[], metavar="HOST[:CONTAINER]",
                   help="a driver directory or file bound read-only into every GPU container "
                        "(repeatable), e.g. the driver's library directory")
    p.add_argument("--cdi-driver-spec", type=Path,
                   help="a CDI spec (e.g. from `nvidia-ctk cdi generate`) whose spec-wide edits "
                        "(driver libraries, binaries, hooks) every GPU container also gets")
    p.add_argument("--allow-unowned-pods", action="store_true",
                   help="serve pods that no GpuJob owns (test beds only)")
    p.add_argument("--dataset-dir", type=Path,
                   help="cache directory whose sub-folders are datasets")
    p.add_argument("--reports-dir", type=Path, default=Path("/var/lib/carpool/reports"),
                   help="host directory for the per-pod report directories jobs write "
                        "checkpoints and progress into (the same path inside this container)")
    p.add_argument("--metrics-port", type=int, default=9400, help="0 disables the endpoint")
    p.add_argument("--publish-interval", type=float, default=30.0,
                   help="GpuNode heartbeat, seconds (changes past thresholds go out sooner)")
    p.add_argument("--health-interval", type=float, default=5.0)
    p.add_argument("--recover-after", type=float, default=60.0,
                   help="seconds without errors before a probed GPU is Healthy again")
    p.add_argument("--watchdog-interval", type=float, default=5.0)
    p.add_argument("--watchdog-strikes", type=int, default=3)
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                   help="default: in-cluster configuration")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not args.node_name:
        p.error("--node-name (or $NODE_NAME) is required")
    if args.shares_per_gpu < 1:
        p.error("--shares-per-gpu must be at least 1")
    if not 1 <= args.mps_ceiling <= 100:
        p.error("--mps-ceiling must be between 1 and 100")
    for flag, value in (("--mps-client-uid", args.mps_client_uid),
                        ("--mps-client-gid", args.mps_client_gid)):
        if value is not None and value < 1:
            p.error(f"{flag} must be a user or group ID above 0, got {value}")
    if args.backend == "fake" and not (args.fake_spec or args.openb_node_list):
        p.error("--backend fake needs --fake-spec or --openb-node-list")
    if args.backend != "fake" and args.fake_usage_file:
        p.error("--fake-usage-file is only for --backend fake")
    try:
        args.cdi_driver_mount = [DriverMount.parse(m) for m in args.cdi_driver_mount]
    except ValueError as err:
        p.error(str(err))
    return args


def cdi_settings(args: argparse.Namespace) -> CdiSettings:
    """The node's CDI spec settings; a fake node backs its device nodes with /dev/null."""
    import yaml

    from carpool.deviceplugin.cdi import CDI_VERSION, driver_edits, nvidia_spec_in

    edits: dict[str, Any] = {}
    version = CDI_VERSION
    driver_spec = args.cdi_driver_spec
    if (driver_spec is None and not args.cdi_driver_mount and args.backend == "nvml"
            and args.device_delivery == "cdi"):
        # the NVIDIA Container Toolkit (>= 1.18) keeps one in the spec directory
        driver_spec = nvidia_spec_in(Path(args.cdi_spec_dir))
        if driver_spec is None:
            log.warning("no driver files for GPU containers: give --cdi-driver-spec or "
                        "--cdi-driver-mount (no nvidia.yaml in %s); containers get their GPUs' "
                        "device nodes but no driver libraries", args.cdi_spec_dir)
        else:
            log.info("GPU containers get the driver files of %s", driver_spec)
    if driver_spec:
        source = str(driver_spec)
        try:
            other = yaml.safe_load(driver_spec.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise SystemExit(f"--cdi-driver-spec {source}: {err}") from None
        try:
            edits, version = driver_edits(other, source)
        except ValueError as err:
            raise SystemExit(f"--cdi-driver-spec: {err}") from None
    return CdiSettings(args.cdi_spec_dir, tuple(args.cdi_driver_mount),
                       "/dev/null" if args.backend == "fake" else "", edits, version)


def make_backend(args: argparse.Namespace) -> Any:
    if args.backend == "nvml":
        from carpool.deviceplugin.backends.nvml import NvmlBackend
        return NvmlBackend()
    from carpool.deviceplugin.backends.fake import FakeBackend
    backend: FakeBackend | None = None
    if args.fake_spec:
        backend = FakeBackend.from_yaml(args.fake_spec, node=args.node_name)
    else:
        with args.openb_node_list.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get("sn") == args.node_name:
                    backend = FakeBackend.from_openb_row(row)
                    break
    if backend is not None:
        backend.usage_file = args.fake_usage_file
        return backend
    raise SystemExit(f"node {args.node_name} is not in {args.openb_node_list}")


async def run(args: argparse.Namespace) -> None:
    from prometheus_client import start_http_server

    from carpool.deviceplugin.agent import Telemetry, Watchdog, health_step, run_every
    from carpool.deviceplugin.health import HealthTracker
    from carpool.deviceplugin.kube import KubernetesCluster, load_config
    from carpool.deviceplugin.mps import MpsDaemon
    from carpool.deviceplugin.plugin import PluginServer, PluginState
    from carpool.deviceplugin.reports import REPORT_INTERVAL_S, ReportReader
    from carpool.deviceplugin.sharing import MpsSettings
    from carpool.deviceplugin.telemetry import PublishThresholds

    backend = make_backend(args)
    mps = MpsDaemon(args.mps_pipe_dir, args.mps_log_dir)
    if args.sharing_mode == "mps" and args.backend == "nvml":
        # before the plugin registers: no MPS client exists until it serves Allocate
        gpus = [(g.uuid, g.memory_total_mib) for g in backend.inventory()]
        if not args.no_manage_mps:
            await asyncio.to_thread(mps.start)
            await asyncio.to_thread(mps.fence, args.mps_ceiling, gpus)
        else:  # the MPS daemon's container fences; wait for it (it may start after us)
            deadline = time.monotonic() + 120
            while True:
                try:
                    await asyncio.to_thread(mps.check_fence, args.mps_ceiling, gpus)
                    break
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
                    if time.monotonic() > deadline:
                        raise
                    log.info("waiting for the MPS daemon's fence: %s", err)
                    await asyncio.sleep(2)
        log.info("MPS control daemon answering on %s; each client held to %d %% of each GPU",
                 args.mps_pipe_dir, args.mps_ceiling)
    cluster = KubernetesCluster(load_config(args.kubeconfig), args.node_name)
    config = PluginConfig(args.node_name, args.sharing_mode, args.shares_per_gpu,
                          MpsSettings(str(args.mps_pipe_dir), args.mps_shm_dir,
                                      args.mps_ceiling if args.sharing_mode == "mps" else 100),
                          serve_unowned=args.allow_unowned_pods,
                          reports_root=args.reports_dir,
                          delivery=DeviceDelivery(args.device_delivery),
                          cdi=cdi_settings(args),
                          mps_client_uid=args.mps_client_uid,
                          mps_client_gid=args.mps_client_gid)
    state = PluginState(config, backend, cluster, HealthTracker(args.recover_after))
    await asyncio.to_thread(state.write_cdi_spec)  # before registering: Allocate names its devices
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=state.metrics.registry)
    server = PluginServer(state, args.plugin_dir, args.endpoint)
    telemetry = Telemetry(state, cluster, args.dataset_dir,
                          PublishThresholds(interval_s=args.publish_interval))
    watchdog = Watchdog(state, cluster, telemetry, max_strikes=args.watchdog_strikes)
    reader = ReportReader(args.node_name, args.reports_dir,
                          lambda: cluster.pods_on_node(args.node_name), cluster,
                          gpu_models=lambda: {g.uuid: g.model for g in backend.inventory()},
                          on_measures=state.metrics.observe_services)
    tasks = [
        asyncio.create_task(server.supervise()),
        asyncio.create_task(run_every(0.0, lambda: health_step(state, args.health_interval),
                                      "health check")),
        asyncio.create_task(run_every(min(5.0, args.publish_interval), telemetry.step,
                                      "GpuNode status")),
        asyncio.create_task(run_every(args.watchdog_interval, watchdog.step, "watchdog")),
        asyncio.create_task(run_every(REPORT_INTERVAL_S, reader.step, "job reports")),
    ]
    stop = asyncio.Event()  # SIGTERM (the DaemonSet pod going away) and SIGINT end it cleanly
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error  # a loop that should run forever stopped: fail the pod visibly
        log.info("stopping")
    finally:
        stopping.cancel()
        for task in tasks:
            task.cancel()
        await server.close()
        backend.close()
        if args.sharing_mode == "mps" and args.backend == "nvml" and not args.no_manage_mps:
            await asyncio.to_thread(mps.stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
