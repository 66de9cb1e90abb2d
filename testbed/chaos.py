"""Faults and invariants for reliability runs on the local cluster (e2e/test_reliability_*).

Faults: kill -9 a control-plane component by kwokctl's pid file and start it again with
`kwokctl start cluster` (it starts whatever is not running), or kill -9 one of Carpool's own
processes and spawn it again. Invariants are pure functions over what the pods say (the
extender's `carpool.dev/assignment` annotations) so a run can check them every second from a
watch-fed copy of the pods, without loading the API server with lists.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from carpool.core import names
from carpool.core.assignment import AssignmentError, parse_assignment
from carpool.core.timestamps import epoch_of as parse_time
from carpool.core.timestamps import format_timestamp, format_timestamp_micro, parse_timestamp
from carpool_testbed import devcluster

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
    if (pod.get("status") or {}).get("phase") in TERMINAL_POD_PHASES:
        return []
    return assigned(pod)


def assigned(pod: Mapping[str, Any]) -> list[Holding]:
    """The GPUs the extender assigned a pod, whatever its phase (see `holdings`)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    raw = annotations.get(names.ANN_ASSIGNMENT)
    if not raw:
        return []
    try:
        assignment = parse_assignment(str(raw))
    except AssignmentError:
        return []
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    project = (meta.get("labels") or {}).get(names.LABEL_PROJECT, "")
    exclusive = annotations.get(names.ANN_ISOLATION) == "exclusive"
    return [Holding(key, project, g.uuid, g.memory_mib, g.cores_pct, exclusive,
                    annotations.get(names.ANN_ASSIGNED_AT, "")) for g in assignment.gpus]


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
        assigned = parse_timestamp(h.assigned_at)
        if (assigned - since).total_seconds() > grace_s:
            problems.append(f"{h.pod} assigned to unhealthy {h.gpu_uuid} at {h.assigned_at}")
    return problems


@dataclass(frozen=True)
class Run:
    """One pod's use of its GPUs: from its containers' start to their end (None: running).
    The same times the operator charges a run by (container startedAt / finishedAt)."""

    pod: str
    project: str
    fraction: float  # GPU equivalents held (carpool.core.gpuhours)
    start: float
    end: float | None


def latest_time(pod: Mapping[str, Any]) -> float:
    """The latest timestamp a pod carries (creation, deletion, conditions, container states).

    A watch delivers writes in order, and the write that set this time happened at or after it,
    so once a watcher has seen it, it has seen every write from before it: its view is current
    at least up to this time. (0.0 when the pod carries none.)"""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    stamps = [meta.get("creationTimestamp"), meta.get("deletionTimestamp"),
              status.get("startTime")]
    stamps += [c.get("lastTransitionTime") for c in status.get("conditions") or []]
    for container in status.get("containerStatuses") or []:
        for state in (container.get("state") or {}).values():
            stamps += [(state or {}).get("startedAt"), (state or {}).get("finishedAt")]
    return max((t for stamp in stamps if stamp and (t := parse_time(stamp))), default=0.0)


def pod_run(pod: Mapping[str, Any], capacity: Mapping[str, GpuCapacity]) -> Run | None:
    """The run of a pod that has started, with its assignment's GPU equivalents; else None."""
    held = assigned(pod)
    status = pod.get("status") or {}
    if not held or status.get("phase") in (None, "Pending"):
        return None
    start = parse_time(status.get("startTime"))
    end = None
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        for key in ("running", "terminated"):
            if key in state and (started := parse_time((state[key] or {}).get("startedAt"))):
                start = started
        if finished := parse_time((state.get("terminated") or {}).get("finishedAt")):
            end = max(end or finished, finished)
    if start is None:
        return None
    if status.get("phase") in TERMINAL_POD_PHASES and end is None:
        end = parse_time((pod.get("metadata") or {}).get("deletionTimestamp")) or start
    return Run(held[0].pod, held[0].project, sum(gpu_equivalents(h, capacity) for h in held),
               start, end)


@dataclass(frozen=True)
class Budget:
    """A project's hard GPU-hour budget, refilled every `period_s` counted from `anchor`."""

    gpu_hours: float
    period_s: float
    anchor: float

    def period_start(self, now: float) -> float:
        return self.anchor + ((now - self.anchor) // self.period_s) * self.period_s


def budget_used(runs: Iterable[Run], project: str, budget: Budget, now: float,
                open_until: float | None = None) -> float:
    """GPU-hours the project's runs used in the budget period containing `now`. Runs still
    open count up to `open_until` (default `now`): the last instant their state was known."""
    period = budget.period_start(now)
    until = now if open_until is None else min(now, open_until)
    used = 0.0
    for run in runs:
        if run.project != project:
            continue
        end = min(run.end if run.end is not None else until, now)
        used += max(0.0, end - max(run.start, period)) / 3600.0 * run.fraction
    return used


def projects_over_budget(runs: Iterable[Run], budgets: Mapping[str, Budget], now: float,
                         open_until: float | None = None) -> list[str]:
    """Projects that used more GPU-hours in the current period than their budget."""
    runs = list(runs)
    problems = []
    for project, budget in sorted(budgets.items()):
        used = budget_used(runs, project, budget, now, open_until)
        if used > budget.gpu_hours + 1e-6:
            period = datetime.fromtimestamp(budget.period_start(now), UTC).strftime("%H:%M:%S")
            problems.append(f"{project} over its budget in the period from {period}: "
                            f"{used:.5f} GPU-h used of {budget.gpu_hours:.5f}")
    return problems


def plugin_grants(pod: str, envs: Mapping[str, str], capacity: Mapping[str, GpuCapacity]
                  ) -> list[Holding]:
    """What the device plugin handed one container, read back from its Allocate answer:
    GPUs by UUID (CUDA_VISIBLE_DEVICES), MPS memory caps per visible device
    (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT "0=8G,1=4096M"), the MPS thread percentage (absent: no
    cap, counted as 0 here), the time-slice memory limit, and exclusivity."""
    uuids = [u for u in envs.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
    limits: dict[int, int] = {}
    for part in envs.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "").split(","):
        index, _, value = part.partition("=")
        if index.isdigit() and value[:-1].isdigit() and value[-1:] in ("G", "M"):
            limits[int(index)] = int(value[:-1]) * (1024 if value.endswith("G") else 1)
    exclusive = envs.get("CARPOOL_ISOLATION") == "exclusive"
    cores = int(envs.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0") or 0)
    timeslice = envs.get("CARPOOL_GPU_MEMORY_LIMIT_MIB", "")
    out = []
    for i, uuid in enumerate(uuids):
        gpu = capacity.get(uuid)
        memory = limits.get(i, int(timeslice) if timeslice.isdigit() else 0)
        if exclusive and gpu is not None:
            memory = gpu.memory_mib
        out.append(Holding(pod, "", uuid, memory, cores, exclusive, ""))
    return out


def plugin_overcommits(answers: Mapping[str, list[Holding]], assignments: Mapping[str, set[str]],
                       capacity: Mapping[str, GpuCapacity]) -> list[str]:
    """Over-commit in the device plugin's own answers (`answers`: live pod -> what the plugin
    handed it), and answers that name other GPUs than the extender assigned the pod."""
    problems = [f"device plugin: {p}" for p in
                overcommitted_gpus([h for hs in answers.values() for h in hs], capacity)]
    for pod, grants in sorted(answers.items()):
        handed = {h.gpu_uuid for h in grants}
        if pod in assignments and handed != assignments[pod]:
            problems.append(f"device plugin: {pod} was handed {sorted(handed)}, assigned "
                            f"{sorted(assignments[pod])}")
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
# Pods from a list and a resumed watch


def _kube(api: Any) -> Any:
    """A `carpool.kube` client on `api`'s credentials (imported late: the CLI stays light)."""
    from carpool.kube.client import Api

    return Api.of(api)


def watch_pods(api: Any, stop: threading.Event, on_list: Callable[[list[dict[str, Any]]], None],
               on_event: Callable[[str, dict[str, Any]], None], on_error: Callable[[], None],
               label_selector: str, field_selector: str = "") -> None:
    """List the pods, then watch (`carpool.kube.watching.Reflector`: a watch that times out
    is resumed, a list follows any error, e.g. the API server down or 410 Gone). Runs until
    `stop` is set."""
    from carpool.kube.client import Api
    from carpool.kube.resources import PODS
    from carpool.kube.retry import Backoff
    from carpool.kube.watching import Reflector

    reflector = Reflector(Api.of(api), PODS, on_list=lambda items, version: on_list(items),
                          on_event=on_event, on_error=lambda err: on_error(),
                          label_selector=label_selector, field_selector=field_selector,
                          watch_seconds=60, backoff=Backoff(first=1.0, most=1.0))

    def stop_when_told() -> None:
        stop.wait()
        reflector.stop()

    threading.Thread(target=stop_when_told, daemon=True).start()
    reflector.run()


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
    budgets: dict[str, Budget] = field(default_factory=dict)
    # More checks each sample (e.g. the device plugin's view): each returns its breaches.
    extra_checks: list[Callable[[], list[str]]] = field(default_factory=list)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Every run seen, kept after its pod is gone (budgets count finished runs too).
    runs: dict[str, Run] = field(default_factory=dict)
    peak_budget_share: dict[str, float] = field(default_factory=dict)  # used / budget
    stale_since: float | None = None  # the watch is down since then: open runs end there
    view_time: float = 0.0  # the view is current at least up to here (see `latest_time`)
    # job key (a gang worker's: `<job key>#w<rank>`) -> its pods that succeeded
    succeeded_pods: dict[str, set[str]] = field(default_factory=dict)
    # a gang's attempts: job key -> attempt -> the worker ranks whose pods were ever seen,
    # and the attempts of which some pod was seen bound to a node
    gang_ranks: dict[str, dict[str, set[int]]] = field(default_factory=dict)
    gang_bound: set[tuple[str, str]] = field(default_factory=set)
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
        self.view_time = max(self.view_time, latest_time(pod))
        if run := pod_run(pod, self.capacity):
            self.runs[key] = run
        job = f"{meta['namespace']}/{(meta.get('labels') or {}).get(names.LABEL_JOB)}"
        annotations = meta.get("annotations") or {}
        rank = annotations.get(names.ANN_WORKER_RANK)
        if rank is not None and str(rank).isdigit():
            attempt = str(annotations.get(names.ANN_GANG, "")).partition("/")[0]
            self.gang_ranks.setdefault(job, {}).setdefault(attempt, set()).add(int(rank))
            if (pod.get("spec") or {}).get("nodeName"):
                self.gang_bound.add((job, attempt))
        if (pod.get("status") or {}).get("phase") == "Succeeded":
            worker = f"{job}#w{rank}" if rank not in (None, "0") else job
            self.succeeded_pods.setdefault(worker, set()).add(meta["name"])

    def partial_gangs(self, workers: dict[str, int]) -> list[str]:
        """Gang attempts (job key -> its workers) with a worker bound to a node although
        some worker of the attempt was never seen: a gang started in part."""
        with self._lock:
            return [f"{job} attempt {attempt}: ranks {sorted(ranks)} of {workers[job]}"
                    for job, attempts in sorted(self.gang_ranks.items()) if job in workers
                    for attempt, ranks in sorted(attempts.items())
                    if len(ranks) != workers[job] and (job, attempt) in self.gang_bound]

    def incomplete_gangs(self, workers: dict[str, int]) -> int:
        """Gang attempts of which some worker pod was never seen (the operator stops such a
        gang whole; none of its workers may have been bound: `partial_gangs`)."""
        with self._lock:
            return sum(1 for job, attempts in self.gang_ranks.items() if job in workers
                       for ranks in attempts.values() if len(ranks) != workers[job])

    def _watch_loop(self) -> None:
        watch_pods(self.api, self._stop, self._listed, self._event, self._watch_failed,
                   f"{names.LABEL_MANAGED}=true")

    def _listed(self, pods: list[dict[str, Any]]) -> None:
        with self._lock:
            self.pods.clear()
            for pod in pods:
                self._record(pod)
            # Runs of pods deleted while the watch was down end when last known.
            for key, run in list(self.runs.items()):
                if run.end is None and key not in self.pods:
                    self.runs[key] = replace(run, end=self.stale_since or time.time())
            self.stale_since = None

    def _event(self, kind: str, pod: dict[str, Any]) -> None:
        with self._lock:
            if kind == "DELETED":
                self._record(pod)  # a last Succeeded state still counts
                meta = pod["metadata"]
                key = f"{meta['namespace']}/{meta['name']}"
                self.pods.pop(key, None)
                last = self.runs.get(key)
                if last is not None and last.end is None:
                    self.runs[key] = replace(last, end=time.time())
            elif kind in ("ADDED", "MODIFIED"):
                self._record(pod)

    def _watch_failed(self) -> None:
        self.watch_restarts += 1
        with self._lock:
            self.stale_since = self.stale_since or time.time()

    def check(self) -> list[str]:
        with self._lock:
            held = [h for pod in self.pods.values() for h in holdings(pod)]
            live = sum(1 for p in self.pods.values()
                       if (p.get("status") or {}).get("phase") not in TERMINAL_POD_PHASES)
            self.max_live_pods = max(self.max_live_pods, live)
            unhealthy = dict(self.unhealthy_since)
            runs = list(self.runs.values())
            stale_since = self.stale_since
            view_time = self.view_time
        # Budgets are judged at the instant the view is known to be current, not the wall
        # clock: a watch running behind still shows finished runs as running, and counting
        # them up to now made budgets look overspent (load run 12).
        now = min(time.time(), view_time) if view_time else time.time()
        for project, budget in self.budgets.items():
            used = budget_used(runs, project, budget, now, stale_since)
            if budget.gpu_hours > 0:
                self.peak_budget_share[project] = max(self.peak_budget_share.get(project, 0.0),
                                                      round(used / budget.gpu_hours, 3))
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
                + placed_on_unhealthy(held, unhealthy, self.unhealthy_grace_s)
                + projects_over_budget(runs, self.budgets, now, stale_since)
                + [problem for check in self.extra_checks for problem in check()])

    def _sample_loop(self) -> None:
        previous: set[str] = set()
        while not self._stop.wait(self.interval):
            now = self.check()
            self.samples += 1
            # A breach seen in two samples in a row is real, not a watch event still in flight.
            # Breaches are matched by what is breached (before ": "), as amounts may move.
            lasting = [v for v in now if breach_key(v) in previous]
            if lasting:
                stamp = datetime.now(UTC).strftime("%H:%M:%S")
                self.violations.extend(f"{stamp} {v}" for v in lasting)
            previous = {breach_key(v) for v in now}


def breach_key(problem: str) -> str:
    """What a breach message is about (a GPU, a project, a pod), without the amounts."""
    prefix = "device plugin: " if problem.startswith("device plugin: ") else ""
    return prefix + problem.removeprefix(prefix).split(": ", 1)[0]


# --------------------------------------------------------------------------------------------
# A stand-in kubelet, so the real device plugin runs under load on simulated nodes


@dataclass
class PluginAnswer:
    """What the device plugin answered for one pod (all its GPU containers)."""

    node: str
    device_ids: list[str]
    grants: list[Holding]


class StandInKubelet:
    """The kubelet's side of the device-plugin protocol, and just enough pod lifecycle, for a
    few simulated nodes that KWOK leaves alone (`SimNode.kwok = False`), so the real device
    plugin (`python -m carpool.deviceplugin --backend fake`) serves them under load.

    Per node it serves the Registration socket in that node's plugin directory and keeps the
    Node Ready. For each Carpool pod bound to one of its nodes it does what a kubelet does
    before starting the containers: offers the plugin's healthy device IDs that no live pod of
    the node holds (from ListAndWatch), asks GetPreferredAllocation for each GPU container,
    calls Allocate with the answer; then marks the pod Running and, after its
    `carpool.dev/simulated-duration`, Succeeded (like the KWOK stages), and removes pods being
    deleted. While the plugin is down (kill -9), it retries; a real kubelet would fail the pod
    (UnexpectedAdmissionError), which this run leaves to the KWOK-free tests. What the plugin
    answered is kept per live pod (`answers`), for `plugin_overcommits`.
    """

    def __init__(self, api: Any, plugin_dirs: Mapping[str, Path],
                 capacity: Mapping[str, GpuCapacity]) -> None:
        self.api = api
        self.kube = _kube(api)
        self.plugin_dirs = dict(plugin_dirs)
        self.capacity = capacity
        self.registrations: dict[str, int] = dict.fromkeys(plugin_dirs, 0)
        self.answers: dict[str, PluginAnswer] = {}  # live pods only
        self.assignments: dict[str, set[str]] = {}  # live pods: GPUs the extender assigned
        self.allocated = 0
        self.refusals: list[str] = []  # deliberate gRPC refusals (not the plugin being down)
        self.plugin_down_retries = 0
        self.failed_pods: list[str] = []
        self._handled: set[str] = set()  # pods whose allocation began
        self._due: dict[str, tuple[float, dict[str, Any]]] = {}  # pod -> (completion, pod)
        self._lock = threading.Lock()
        # The kubelet admits one pod at a time per node: device IDs are offered once.
        self._node_locks = {node: threading.Lock() for node in plugin_dirs}
        self._stop = threading.Event()
        self._servers: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._pool: Any = None

    # -- registration ---------------------------------------------------------------------

    def start(self) -> None:
        from concurrent import futures

        import grpc

        from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc

        kubelet = self

        class Registration(api_pb2_grpc.RegistrationServicer):
            def __init__(self, node: str) -> None:
                self.node = node

            def Register(self, request: Any, context: Any) -> Any:
                with kubelet._lock:
                    kubelet.registrations[self.node] += 1
                return api_pb2.Empty()

        for node, directory in self.plugin_dirs.items():
            directory.mkdir(parents=True, exist_ok=True)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            api_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
                Registration(node), server)
            server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")
            server.start()
            self._servers.append(server)
        self._pool = futures.ThreadPoolExecutor(max_workers=4)
        threads = [threading.Thread(target=self._node_loop, daemon=True),
                   threading.Thread(target=self._completion_loop, daemon=True)]
        threads += [threading.Thread(target=self._watch_loop, args=(node,), daemon=True)
                    for node in self.plugin_dirs]
        for thread in threads:
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for server in self._servers:
            server.stop(0)

    def wait_registered(self, node: str, count: int, timeout: float) -> float:
        """Seconds until `node`'s plugin has registered `count` times in all."""
        began = time.monotonic()
        while self.registrations[node] < count:
            if time.monotonic() - began > timeout:
                raise RuntimeError(f"the device plugin of {node} did not register again")
            time.sleep(0.2)
        return time.monotonic() - began

    def live_answers(self) -> dict[str, list[Holding]]:
        with self._lock:
            return {pod: list(a.grants) for pod, a in self.answers.items()}

    def check(self) -> list[str]:
        """The device plugin's view, for `Sampler.extra_checks`."""
        with self._lock:
            answers = {pod: list(a.grants) for pod, a in self.answers.items()}
            assignments = dict(self.assignments)
        return plugin_overcommits(answers, assignments, self.capacity)

    # -- the node -------------------------------------------------------------------------

    def _node_loop(self) -> None:
        """Ready, and the node Lease renewed, every 10 s (the node lifecycle controller's
        heartbeats; without them it taints the node and evicts its pods)."""
        from carpool.kube.resources import LEASES, NODES

        since = format_timestamp(time.time())
        while not self._stop.is_set():
            micro = format_timestamp_micro(time.time())
            for node in self.plugin_dirs:
                lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": node, "namespace": "kube-node-lease"},
                         "spec": {"holderIdentity": node, "leaseDurationSeconds": 40,
                                  "renewTime": micro}}
                with contextlib.suppress(Exception):
                    self.kube.request("PATCH", LEASES.path("kube-node-lease", node), lease,
                                      content_type="application/apply-patch+yaml",
                                      query={"fieldManager": "carpool-stand-in-kubelet",
                                             "force": "true"}, timeout=(10, 10))
            stamp = format_timestamp(time.time())
            conditions = [{"type": kind, "status": "False", "reason": f"KubeletHas{reason}",
                           "lastHeartbeatTime": stamp, "lastTransitionTime": since}
                          for kind, reason in (("MemoryPressure", "SufficientMemory"),
                                               ("DiskPressure", "NoDiskPressure"),
                                               ("PIDPressure", "SufficientPID"))]
            conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                               "lastHeartbeatTime": stamp, "lastTransitionTime": since})
            for node in self.plugin_dirs:
                with contextlib.suppress(Exception):  # the API server may be down on purpose
                    self.kube.request("PATCH", NODES.path(None, node, "status"),
                                      {"status": {"conditions": conditions}},
                                      content_type="application/strategic-merge-patch+json",
                                      timeout=(10, 10))
            self._stop.wait(10)

    # -- pods -----------------------------------------------------------------------------

    def _watch_loop(self, node: str) -> None:
        """This node's pods, as a kubelet watches them (`spec.nodeName=<node>`)."""
        def listed(pods: list[dict[str, Any]]) -> None:
            live = {self._see(pod, deleted=False) for pod in pods}
            with self._lock:  # pods that went away while the watch was down
                for key in [k for k, a in self.answers.items() if a.node == node]:
                    if key not in live:
                        self.answers.pop(key, None)
                        self.assignments.pop(key, None)

        def event(kind: str, pod: dict[str, Any]) -> None:
            self._see(pod, deleted=kind == "DELETED")

        watch_pods(self.api, self._stop, listed, event, lambda: None,
                   f"{names.LABEL_MANAGED}=true", f"spec.nodeName={node}")

    def _see(self, pod: dict[str, Any], deleted: bool) -> str:
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if node not in self.plugin_dirs:
            return key
        phase = (pod.get("status") or {}).get("phase")
        if deleted or phase in TERMINAL_POD_PHASES:
            with self._lock:  # the kubelet frees a terminated pod's devices
                self.answers.pop(key, None)
                self.assignments.pop(key, None)
                self._due.pop(key, None)
            return key
        if meta.get("deletionTimestamp"):
            self._pool.submit(self._remove, meta.get("namespace"), meta.get("name"))
            return key
        with self._lock:
            if key in self._handled:
                return key
            self._handled.add(key)
        self._pool.submit(self._admit, key, node, pod)
        return key

    def _remove(self, namespace: str, name: str) -> None:
        from carpool.kube.resources import PODS

        with contextlib.suppress(Exception):
            self.kube.request("DELETE", PODS.path(namespace, name),
                              query={"gracePeriodSeconds": 0}, timeout=(10, 30))

    def _devices(self, node: str) -> list[str]:
        """The plugin's healthy device IDs, from the first ListAndWatch answer."""
        import grpc

        from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc

        with grpc.insecure_channel(f"unix://{self.plugin_dirs[node] / 'carpool-gpu.sock'}"
                                   ) as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            stream = stub.ListAndWatch(api_pb2.Empty(), timeout=10)
            try:
                first = next(stream)
            finally:
                stream.cancel()
        return [d.ID for d in first.devices if d.health == "Healthy"]

    def _admit(self, key: str, node: str, pod: dict[str, Any]) -> None:
        """Allocate through the plugin (retrying while it is down), then run the pod."""
        import grpc

        counts = []
        for container in (pod.get("spec") or {}).get("containers") or []:
            limit = ((container.get("resources") or {}).get("limits") or {}).get(
                names.RESOURCE_GPU)
            if limit:
                counts.append(int(limit))
        began = time.monotonic()
        allocated = False
        while not allocated and not self._stop.is_set():
            try:
                with self._node_locks[node]:
                    ids, envs = self._allocate(node, counts)
                allocated = True
                continue
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED):
                    self.plugin_down_retries += 1
                elif time.monotonic() - began > 60:  # a kubelet gives up on admission
                    self.refusals.append(f"{key}: {code}: {err.details()}")
                    self._fail(pod)
                    return
                else:
                    self.refusals.append(f"{key}: {code} (retried): {err.details()}")
            except (StopIteration, OSError, ValueError):  # no device list yet: not serving
                self.plugin_down_retries += 1
            self._stop.wait(1.0)
        if not allocated:
            return
        grants = [h for env in envs for h in plugin_grants(key, env, self.capacity)]
        with self._lock:
            self.answers[key] = PluginAnswer(node, ids, grants)
            self.assignments[key] = {h.gpu_uuid for h in assigned(pod)}
            self.allocated += 1
        self._run(key, pod)

    def _allocate(self, node: str, counts: list[int]) -> tuple[list[str], list[dict[str, str]]]:
        """GetPreferredAllocation and Allocate per GPU container, over free device IDs."""
        import grpc

        from carpool.deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc

        with self._lock:
            in_use = {d for a in self.answers.values() if a.node == node for d in a.device_ids}
        available = [d for d in self._devices(node) if d not in in_use]
        ids: list[str] = []
        envs: list[dict[str, str]] = []
        with grpc.insecure_channel(f"unix://{self.plugin_dirs[node] / 'carpool-gpu.sock'}"
                                   ) as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            for count in counts:
                offer = [d for d in available if d not in ids]
                preferred = stub.GetPreferredAllocation(
                    api_pb2.PreferredAllocationRequest(container_requests=[
                        api_pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=offer, allocation_size=count)]),
                    timeout=30)
                chosen = list(preferred.container_responses[0].deviceIDs) or offer[:count]
                answer = stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=chosen)]), timeout=30)
                ids += chosen
                envs.append(dict(answer.container_responses[0].envs))
        return ids, envs

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> bool:
        """Patch a pod's status through outages; False once the pod is gone."""
        from carpool.kube.errors import NotFound
        from carpool.kube.resources import PODS

        meta = pod["metadata"]
        while not self._stop.is_set():
            try:
                self.kube.request("PATCH", PODS.path(meta["namespace"], meta["name"], "status"),
                                  {"status": status},
                                  content_type="application/strategic-merge-patch+json",
                                  timeout=(10, 30))
                return True
            except NotFound:
                return False
            except Exception:  # the API server may be down on purpose
                pass
            self._stop.wait(1.0)
        return False

    def _run(self, key: str, pod: dict[str, Any]) -> None:
        stamp = format_timestamp(time.time())
        containers = (pod.get("spec") or {}).get("containers") or []
        status = {
            "phase": "Running", "startTime": stamp, "podIP": "10.0.0.1", "hostIP": "10.0.0.1",
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": stamp}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "ready": True,
                                   "started": True, "restartCount": 0,
                                   "state": {"running": {"startedAt": stamp}}}
                                  for c in containers]}
        if not self._patch_status(pod, status):
            return
        duration = ((pod.get("metadata") or {}).get("annotations") or {}).get(
            names.ANN_SIM_DURATION, "")
        try:
            seconds = float(duration)
        except ValueError:
            return  # runs until deleted, as on KWOK
        with self._lock:
            self._due[key] = (time.time() + math.ceil(seconds), {**pod, "_started": stamp})

    def _completion_loop(self) -> None:
        while not self._stop.wait(0.5):
            now = time.time()
            with self._lock:
                due = [(k, p) for k, (at, p) in self._due.items() if at <= now]
                for key, _ in due:
                    self._due.pop(key, None)
            for _, pod in due:
                self._pool.submit(self._complete, pod)

    def _forget(self, pod: dict[str, Any]) -> None:
        """Free a pod's devices once its containers are done, as the kubelet does: at once,
        not when its own watch shows the new phase (that can lag many seconds under load)."""
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        with self._lock:
            self.answers.pop(key, None)
            self.assignments.pop(key, None)

    def _complete(self, pod: dict[str, Any]) -> None:
        stamp = format_timestamp(time.time())
        started = pod.get("_started", stamp)
        self._forget(pod)
        self._patch_status(pod, {
            "phase": "Succeeded",
            "conditions": [{"type": t, "status": "False", "reason": "PodCompleted",
                            "lastTransitionTime": stamp} for t in ("ContainersReady", "Ready")],
            "containerStatuses": [{"name": c["name"], "image": c.get("image", ""),
                                   "ready": False, "started": False, "restartCount": 0,
                                   "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                            "startedAt": started,
                                                            "finishedAt": stamp}}}
                                  for c in (pod.get("spec") or {}).get("containers") or []]})

    def _fail(self, pod: dict[str, Any]) -> None:
        """A kubelet that cannot get a pod its devices rejects it."""
        meta = pod["metadata"]
        self.failed_pods.append(f"{meta['namespace']}/{meta['name']}")
        self._forget(pod)
        self._patch_status(pod, {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                                 "message": "the device plugin refused the allocation"})
