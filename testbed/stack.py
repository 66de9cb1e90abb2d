"""Carpool's own processes on the local cluster: the operator and the extender.

Used by the demo and the integration tests; on a real cluster the Helm chart runs them. The
operator starts as users would start it, `kopf run -m carpool.operator.handlers`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from carpool_testbed import crds, devcluster


def start_operator(kubeconfig: Path, log_path: Path, env: Mapping[str, str] | None = None,
                   identity: str = "") -> subprocess.Popen[bytes]:
    """Spawn the operator (kopf, all namespaces, no kopf peering: we elect with a Lease)."""
    environment = dict(os.environ, KUBECONFIG=str(kubeconfig),
                       CARPOOL_KUBECONFIG=str(kubeconfig), **(env or {}))
    if identity:
        environment["CARPOOL_IDENTITY"] = identity
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
             "--log-format=plain", "-m", "carpool.operator.handlers"],
            env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process the test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def check_alive(processes: Mapping[str, subprocess.Popen[bytes]], log_dir: Path) -> None:
    """Raise, naming the component and the tail of its log, if one of `processes` has exited:
    a run whose operator or extender is gone measures nothing."""
    for name, process in processes.items():
        if process.poll() is not None:
            raise RuntimeError(f"the {name} exited ({process.returncode}); the end of "
                               f"{log_dir / f'{name}.log'}:\n{log_tail(log_dir / f'{name}.log')}")


@contextlib.contextmanager
def running_stack(cluster: devcluster.Cluster, log_dir: Path,
                  operator_env: Mapping[str, str] | None = None, strict: bool = False,
                  extender_args: Sequence[str] = ()
                  ) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """CRDs applied, the extender on the scheduler's port and one operator, for the block;
    `strict`: the extender places only GpuJobs' pods, as the chart's does."""
    crds.apply_crds(cluster.api())
    processes: dict[str, subprocess.Popen[bytes]] = {}
    paths = devcluster.ClusterPaths.for_name(cluster.name)
    devcluster.stop_extender(paths)  # one left by `make cluster` would hold the port
    deadline = time.monotonic() + 10
    while devcluster.port_open(cluster.extender_port) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        processes["extender"] = devcluster.start_extender(
            cluster.kubeconfig, cluster.extender_port, log_dir / "extender.log",
            extra_args=extender_args, serve_unowned=not strict)
        processes["operator"] = start_operator(cluster.kubeconfig, log_dir / "operator.log",
                                               operator_env)
        yield processes
    finally:
        for process in processes.values():
            devcluster.stop_process(process)


def _operator_pid_file(cluster_name: str) -> Path:
    return devcluster.ClusterPaths.for_name(cluster_name).workdir / "carpool-operator.pid"


def _heartbeat_pid_file(cluster_name: str) -> Path:
    return devcluster.ClusterPaths.for_name(cluster_name).workdir / "carpool-heartbeat.pid"


def _alive(pid_file: Path, marker: bytes) -> int | None:
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if marker in cmdline else None


def start_detached(cluster: devcluster.Cluster, log_dir: Path) -> dict[str, int]:
    """CRDs, extender, operator and the simulated nodes' heartbeat left running after this
    process exits (for `make demo`); `stop_detached` (run by `make cluster-down`) ends them."""
    crds.apply_crds(cluster.api())
    paths = devcluster.ClusterPaths.for_name(cluster.name)
    stop_detached(cluster.name)
    extender = devcluster.start_extender(cluster.kubeconfig, cluster.extender_port,
                                         log_dir / "extender.log", serve_unowned=False)
    paths.extender_pid.parent.mkdir(parents=True, exist_ok=True)
    paths.extender_pid.write_text(str(extender.pid))
    operator = start_operator(cluster.kubeconfig, log_dir / "operator.log",
                              {"CARPOOL_RESYNC_SECONDS": "2"})
    _operator_pid_file(cluster.name).write_text(str(operator.pid))
    # simulated GpuNodes have no plugin to beat: without this, `kubectl carpool` calls their
    # nodes not ready two minutes after the demo ends
    with (log_dir / "heartbeat.log").open("ab") as log:
        heartbeat = subprocess.Popen(
            [sys.executable, "-m", "carpool_testbed", "nodes", "heartbeat",
             "--kubeconfig", str(cluster.kubeconfig)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _heartbeat_pid_file(cluster.name).write_text(str(heartbeat.pid))
    return {"extender": extender.pid, "operator": operator.pid, "heartbeat": heartbeat.pid}


def stop_detached(cluster_name: str | None = None) -> None:
    name = cluster_name or devcluster.cluster_name()
    devcluster.stop_extender(devcluster.ClusterPaths.for_name(name))
    for pid_file, marker in ((_operator_pid_file(name), b"carpool.operator"),
                             (_heartbeat_pid_file(name), b"heartbeat")):
        pid = _alive(pid_file, marker)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
        pid_file.unlink(missing_ok=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["down"]:
        stop_detached()
    else:
        sys.exit("usage: python -m carpool_testbed.stack down")
