"""Faults and invariants for reliability runs on the local cluster (e2e/test_reliability_*).

Faults: kill -9 a control-plane component by kwokctl's pid file and start it again with
`kwokctl start cluster` (it starts whatever is not running), or kill -9 one of Carpool's own
processes and spawn it again. Invariants are pure functions over what the pods say (the
extender's `carpool.dev/assignment` annotations) so a run can check them every second from a
watch-fed copy of the pods, without loading the API server with lists.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from carpool import devcluster
from carpool.core import names

TERMINAL_POD_PHASES = frozenset({"Succeeded", "Failed"})
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                 "kwok-controller")


# --------------------------------------------------------------------------------------------
# Faults


def component_pid(paths: devcluster.ClusterPaths, component: str) -> int | None:
    """The live pid of a kwokctl-run component from its pid file, or None."""
    try:
        pid = int((paths.workdir / "pids" / f"{component}.pid").read_text().strip())
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except (OSError, ValueError):
        return None
    return pid if Path(argv0).name == component else None


def kill_component(paths: devcluster.ClusterPaths, component: str) -> int:
    """SIGKILL one kwokctl-run component (no chance to clean up); returns the pid killed."""
    pid = component_pid(paths, component)
    if pid is None:
        raise RuntimeError(f"{component} of cluster {paths.name} is not running")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def start_stopped_components(paths: devcluster.ClusterPaths, bin_dir: Path,
                             timeout: float = 180) -> float:
    """Start what is not running (kwokctl) until the whole cluster is healthy; seconds taken.

    A component may exit on its own after an outage (kube-controller-manager gives up when it
    cannot renew its lease), so this starts again whatever has stopped until all are healthy.
    """
    started = time.monotonic()
    while True:
        if devcluster.remove_stale_pid_files(paths.workdir):
            subprocess.run([str(bin_dir / "kwokctl"), "--name", paths.name, "start", "cluster",
                            "--timeout=60s"], env=devcluster.kwokctl_env(bin_dir),
                           capture_output=True, text=True, timeout=120, check=False)
        health = devcluster.wait_healthy(paths, bin_dir, timeout=30)
        if health.healthy:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"cluster {paths.name} did not recover: {health.problems}")


@dataclass
class Supervisor:
    """Restarts control-plane components that exit, as kubelet or systemd does for a real
    control plane; records each restart it made."""

    paths: devcluster.ClusterPaths
    bin_dir: Path
    interval: float = 2.0
    restarts: list[str] = field(default_factory=list)
    paused: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(200)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.paused.is_set():
                continue
            stopped = [c for c in CONTROL_PLANE if component_pid(self.paths, c) is None]
            if stopped:
                stamp = datetime.now(UTC).strftime("%H:%M:%S")
                self.restarts.append(f"{stamp} {', '.join(stopped)}")
                with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                    start_stopped_components(self.paths, self.bin_dir)


def kill_process(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL one of Carpool's own processes (and its session) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait(10)


class ApiProxy:
    """A TCP relay in front of the API server, to cut one client off and let it back in.

    The client's kubeconfig points here (same host, so the server certificate still matches);
    `cut()` closes every relayed connection and refuses new ones until `restore()`.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def kubeconfig(self, source: Path, target: Path) -> Path:
        """A copy of `source` whose cluster server is this proxy."""
        config = yaml.safe_load(source.read_text())
        for entry in config["clusters"]:
            entry["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        target.write_text(yaml.safe_dump(config))
        return target

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client_sock, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                self.refused += 1
                client_sock.close()
                continue
            try:
                server_sock = socket.create_connection(self.upstream, timeout=5)
                server_sock.settimeout(None)
            except OSError:
                client_sock.close()
                continue
            with self._lock:
                if self._cut.is_set():  # cut while connecting
                    client_sock.close()
                    server_sock.close()
                    continue
                self._open.update((client_sock, server_sock))
            for a, b in ((client_sock, server_sock), (server_sock, client_sock)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                for sock in (source, sink):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.close()  # the other direction's pump then ends with an OSError
                    self._open.discard(sock)


# --------------------------------------------------------------------------------------------
# Invariants (pure)


@dataclass(frozen=True)
class GpuCapacity:
    node: str
    memory_mib: int
    healthy: bool


@dataclass(frozen=True)
class Holding:
    """One GPU that one live pod holds, as its assignment annotation says."""

    pod: str  # namespace/name
    project: str
    gpu_uuid: str
    memory_mib: int
    cores: int
    exclusive: bool
    assigned_at: str


def holdings(pod: Mapping[str, Any]) -> list[Holding]:
    """The GPUs a pod holds: none once it terminated or when it has no (readable) assignment.

    A malformed annotation counts as holding nothing; the run's bad-input tests check that
    the components survive such annotations, this only measures placements.
    """
    meta = pod.get("metadata") or {}
    if (pod.get("status") or {}).get("phase") in TERMINAL_POD_PHASES:
        return []
    annotations = meta.get("annotations") or {}
    raw = annotations.get(names.ANN_ASSIGNMENT)
    if not raw:
        return []
    try:
        gpus = json.loads(raw)["gpus"]
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        project = (meta.get("labels") or {}).get(names.LABEL_PROJECT, "")
        exclusive = annotations.get(names.ANN_ISOLATION) == "exclusive"
        return [Holding(key, project, str(g["uuid"]), int(g.get("memoryMiB", 0)),
                        int(g.get("cores", 0)), exclusive,
                        annotations.get(names.ANN_ASSIGNED_AT, "")) for g in gpus]
    except (ValueError, KeyError, TypeError):
        return []


def overcommitted_gpus(held: Iterable[Holding], capacity: Mapping[str, GpuCapacity]
                       ) -> list[str]:
    """GPUs whose grants exceed them: memory over the total, cores over 100 %, or an exclusive
    grant sharing its GPU. Each entry says which GPU and by how much."""
    by_gpu: dict[str, list[Holding]] = {}
    for h in held:
        by_gpu.setdefault(h.gpu_uuid, []).append(h)
    problems = []
    for uuid, grants in sorted(by_gpu.items()):
        gpu = capacity.get(uuid)
        memory = sum(g.memory_mib for g in grants)
        cores = sum(g.cores for g in grants)
        pods = sorted(g.pod for g in grants)
        if gpu is not None and memory > gpu.memory_mib:
            problems.append(f"{uuid} on {gpu.node}: {memory} MiB granted of {gpu.memory_mib} "
                            f"({pods})")
        if cores > 100:
            problems.append(f"{uuid}: {cores}% cores granted ({pods})")
        if len(grants) > 1 and any(g.exclusive for g in grants):
            problems.append(f"{uuid}: an exclusive grant shares the GPU ({pods})")
    return problems


def gpu_equivalents(h: Holding, capacity: Mapping[str, GpuCapacity]) -> float:
    """carpool.core.gpuhours' fraction: 1 exclusive, else max(memory share, cores share)."""
    if h.exclusive:
        return 1.0
    gpu = capacity.get(h.gpu_uuid)
    memory_share = h.memory_mib / gpu.memory_mib if gpu and gpu.memory_mib else 0.0
    return min(1.0, max(memory_share, h.cores / 100))


def projects_over_quota(held: Iterable[Holding], capacity: Mapping[str, GpuCapacity],
                        limits: Mapping[str, float]) -> list[str]:
    """Projects (without borrowing) holding more GPU equivalents than their concurrent GPUs."""
    use: dict[str, float] = {}
    for h in held:
        use[h.project] = use.get(h.project, 0.0) + gpu_equivalents(h, capacity)
    return [f"{p}: {use[p]:.3f} GPUs held of {limits[p]}" for p in sorted(use)
            if p in limits and use[p] > limits[p] + 1e-6]


def placed_on_unhealthy(held: Iterable[Holding], unhealthy_since: Mapping[str, datetime],
                        grace_s: float) -> list[str]:
    """Pods assigned to a GPU more than `grace_s` after it was marked Unhealthy."""
    problems = []
    for h in held:
        since = unhealthy_since.get(h.gpu_uuid)
        if since is None or not h.assigned_at:
            continue
        assigned = datetime.fromisoformat(h.assigned_at.replace("Z", "+00:00"))
        if (assigned - since).total_seconds() > grace_s:
            problems.append(f"{h.pod} assigned to unhealthy {h.gpu_uuid} at {h.assigned_at}")
    return problems


def capacities(gpunodes: Iterable[Mapping[str, Any]]) -> dict[str, GpuCapacity]:
    """GPU uuid -> capacity and health, from GpuNode objects."""
    out = {}
    for obj in gpunodes:
        node = obj["metadata"]["name"]
        for gpu in (obj.get("status") or {}).get("gpus") or []:
            out[gpu["uuid"]] = GpuCapacity(node, int(gpu.get("memoryTotalMiB", 0)),
                                           gpu.get("health", "Healthy") == "Healthy")
    return out


# --------------------------------------------------------------------------------------------
# A watch-fed view of Carpool's pods, sampled every second


@dataclass
class Sampler:
    """Keeps a copy of Carpool-managed pods from a watch (relisting after any error, e.g. while
    the API server is down) and checks the invariants every `interval` seconds."""

    api: Any
    capacity: dict[str, GpuCapacity]
    quota_limits: dict[str, float]
    interval: float = 1.0
    unhealthy_grace_s: float = 5.0
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    succeeded_pods: dict[str, set[str]] = field(default_factory=dict)  # job key -> pod names
    unhealthy_since: dict[str, datetime] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    max_live_pods: int = 0
    peak_project_gpus: dict[str, float] = field(default_factory=dict)  # how close quotas came
    peak_gpu_memory_share: float = 0.0  # the fullest GPU seen, as a share of its memory
    watch_restarts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for target in (self._watch_loop, self._sample_loop):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def mark_unhealthy(self, gpu_uuid: str, when: datetime) -> None:
        with self._lock:
            self.unhealthy_since[gpu_uuid] = when

    def _record(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        self.pods[key] = pod
        if (pod.get("status") or {}).get("phase") == "Succeeded":
            job = f"{meta['namespace']}/{(meta.get('labels') or {}).get(names.LABEL_JOB)}"
            self.succeeded_pods.setdefault(job, set()).add(meta["name"])

    def _watch_loop(self) -> None:
        from kubernetes import client, watch

        core = client.CoreV1Api(self.api)
        selector = f"{names.LABEL_MANAGED}=true"
        while not self._stop.is_set():
            try:
                listed = self.api.sanitize_for_serialization(core.list_pod_for_all_namespaces(
                    label_selector=selector, _request_timeout=30))
                with self._lock:
                    self.pods.clear()
                    for pod in listed.get("items") or []:
                        self._record(pod)
                stream = watch.Watch().stream(
                    core.list_pod_for_all_namespaces, label_selector=selector,
                    resource_version=listed["metadata"]["resourceVersion"],
                    timeout_seconds=60, _request_timeout=90)
                for event in stream:
                    if self._stop.is_set():
                        return
                    pod = self.api.sanitize_for_serialization(event["object"])
                    with self._lock:
                        if event["type"] == "DELETED":
                            self._record(pod)  # a last Succeeded state still counts
                            meta = pod["metadata"]
                            self.pods.pop(f"{meta['namespace']}/{meta['name']}", None)
                        elif event["type"] in ("ADDED", "MODIFIED"):
                            self._record(pod)
            except Exception:  # any failure: relist (the API server may be down)
                self.watch_restarts += 1
                self._stop.wait(1.0)

    def check(self) -> list[str]:
        with self._lock:
            held = [h for pod in self.pods.values() for h in holdings(pod)]
            live = sum(1 for p in self.pods.values()
                       if (p.get("status") or {}).get("phase") not in TERMINAL_POD_PHASES)
            self.max_live_pods = max(self.max_live_pods, live)
            unhealthy = dict(self.unhealthy_since)
        use: dict[str, float] = {}
        memory: dict[str, int] = {}
        for h in held:
            use[h.project] = use.get(h.project, 0.0) + gpu_equivalents(h, self.capacity)
            memory[h.gpu_uuid] = memory.get(h.gpu_uuid, 0) + h.memory_mib
        for project, gpus in use.items():
            self.peak_project_gpus[project] = max(self.peak_project_gpus.get(project, 0.0),
                                                  round(gpus, 3))
        for uuid, mib in memory.items():
            gpu = self.capacity.get(uuid)
            if gpu is not None and gpu.memory_mib:
                self.peak_gpu_memory_share = max(self.peak_gpu_memory_share,
                                                 round(mib / gpu.memory_mib, 3))
        return (overcommitted_gpus(held, self.capacity)
                + projects_over_quota(held, self.capacity, self.quota_limits)
                + placed_on_unhealthy(held, unhealthy, self.unhealthy_grace_s))

    def _sample_loop(self) -> None:
        previous: set[str] = set()
        while not self._stop.wait(self.interval):
            now = set(self.check())
            self.samples += 1
            # A breach seen in two samples in a row is real, not a watch event still in flight.
            lasting = sorted(now & previous)
            if lasting:
                stamp = datetime.now(UTC).strftime("%H:%M:%S")
                self.violations.extend(f"{stamp} {v}" for v in lasting)
            previous = now
