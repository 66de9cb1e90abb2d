"""The local development cluster: a real control plane on loopback with simulated (KWOK) nodes.

`python -m carpool_testbed.devcluster up|down|status|kubeconfig` (`make cluster`,
`make cluster-down`).

It runs kwokctl v0.7.0's *binary* runtime with the binaries `hack/build-k8s.sh` built from the
Go module proxy: etcd, kube-apiserver, kube-controller-manager, kube-scheduler (with a
KubeSchedulerConfiguration that calls the Carpool extender) and the kwok controller, which plays
kubelet for the simulated nodes. kwokctl 0.7.0 picks component flags by the binaries' stamped
versions and works with Kubernetes 1.35, so no launcher of our own is needed.

Deviations from kwokctl's defaults, and why:
- every component listens on 127.0.0.1, on ports we choose (see `allocate_ports`): kwokctl's
  own choice races when parallel test sessions create clusters at the same moment.
- admission is on (kwokctl's default with the secure port), except the ServiceAccount plugin:
  simulated pods mount nothing, and with it a pod created right after its namespace races the
  controller that creates the namespace's `default` ServiceAccount.
- `CARPOOL_CLUSTER_PODS=1` (`up --pods`) makes a cluster whose pods on the real node can run
  Carpool itself (the Helm chart): the ServiceAccount plugin is on, so pods get tokens; the API
  server also listens on the real node's bridge address (`POD_API_ADDRESS`) and advertises it,
  so the `kubernetes` Service's endpoint is reachable from the pod bridge (kube-proxy on the
  real node routes the ClusterIP there); its certificate also names that address and the
  Service's ClusterIP. It listens on every address then: the port is TLS with client
  certificates or tokens, as on any node. Its kube-scheduler keeps only the default profile:
  the chart's carpool-scheduler schedules Carpool's pods.
- the kwok controller manages only nodes annotated `kwok.x-k8s.io/node: fake`, so a real kubelet
  can join the same cluster later without kwok taking its node over; more kwok workers.
- Node and Pod lifecycles come from `hack/kwok/stages.yaml`: nodes Ready with the capacity they
  were created with, liveness by Lease (renewed every 150 s, `KWOK_HEARTBEAT_FACTOR`; status
  refreshed every 5 min); pods Running, Succeeded
  after the `carpool.dev/simulated-duration` annotation's seconds, removed when deleted.

State lives in `$CARPOOL_CACHE/clusters/<name>` (`KWOK_WORKDIR=$CARPOOL_CACHE`, name from
`$CARPOOL_CLUSTER`, default `carpool`); the kubeconfig is `<that dir>/kubeconfig.yaml`. `up`
reuses a healthy cluster, applies a changed scheduler configuration or stage set by restarting
that one component, restarts stopped components, and recreates a cluster made with other
binaries or flags, or one that will not come back. Test sessions share one cluster
(`shared_session`): the last one out deletes it if a test session created it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from carpool.core import names

DEFAULT_CLUSTER_NAME: Final = "carpool"
DEFAULT_EXTENDER_PORT: Final = 18080
EXTENDER_PORT_ENV: Final = "CARPOOL_EXTENDER_PORT"
# The `percentageOfNodesToScore` of Carpool's scheduler profile, as the chart ships it
# (helm/carpool/values.yaml says why; a render test keeps the two equal).
CARPOOL_PERCENTAGE_OF_NODES: Final = 10

# The annotation that puts a Node under the kwok controller (see the module docstring).
KWOK_NODE_ANNOTATION: Final = ("kwok.x-k8s.io/node", "fake")
# A taint real workloads never tolerate, so only pods meant for simulated nodes land there.
KWOK_NODE_TAINT: Final = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}

COMPONENTS: Final = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok-controller",
)
# What a cluster runs (kwokctl's binary runtime, its components, devcluster's probes); also
# what hack/device-bench/stage.sh carries, in this order (alike binaries side by side compress
# better together).
REQUIRED_BINARIES: Final = ("kube-apiserver", "kube-controller-manager", "kube-scheduler",
                            "kubectl", "kwok", "kwokctl", "etcd")
STATE_FILE: Final = "carpool-cluster.json"
BIND_ADDRESS: Final = "127.0.0.1"
PODS_ENV: Final = "CARPOOL_CLUSTER_PODS"
# The real node's bridge address (carpool_testbed.realnode), where pods reach the API server.
POD_API_ADDRESS: Final = "10.88.77.1"
# The `kubernetes` Service's ClusterIP: the first address of the API server's default
# service-cluster-ip-range (10.0.0.0/24), which kwokctl leaves as it is.
KUBERNETES_SERVICE_IP: Final = "10.0.0.1"
EXTENDER_RESOURCES: Final = (
    names.RESOURCE_GPU,
    names.RESOURCE_GPU_MEMORY,
    names.RESOURCE_GPU_CORES,
)


class ClusterError(RuntimeError):
    """The cluster could not be brought to the requested state; the message says why."""


# --------------------------------------------------------------------------------------------
# Locations


def cache_dir() -> Path:
    return Path(os.environ.get("CARPOOL_CACHE", Path.home() / ".cache" / "carpool"))


def cluster_name() -> str:
    return os.environ.get("CARPOOL_CLUSTER", DEFAULT_CLUSTER_NAME)


def extender_port() -> int:
    raw = os.environ.get(EXTENDER_PORT_ENV, str(DEFAULT_EXTENDER_PORT))
    try:
        port = int(raw)
    except ValueError:
        raise ClusterError(f"{EXTENDER_PORT_ENV}={raw!r} is not a port number") from None
    if not 0 < port < 65536:
        raise ClusterError(f"{EXTENDER_PORT_ENV}={port} is outside 1..65535")
    return port


def repo_root() -> Path:
    """The checkout this module belongs to: it holds hack/build-k8s.sh and hack/kwok/.

    The editable install links files, so the module's real path leads back to the checkout;
    the working directory is the fallback for other layouts.
    """
    starts = [Path(__file__).resolve().parent, Path.cwd().resolve()]
    for start in starts:
        for candidate in (start, *start.parents):
            if (candidate / "hack" / "build-k8s.sh").is_file():
                return candidate
    raise ClusterError("cannot find the Carpool checkout (hack/build-k8s.sh); run from the repo")


@dataclass(frozen=True)
class ClusterPaths:
    """Where one named cluster keeps its files (all under kwokctl's workdir)."""

    name: str
    workdir: Path

    @classmethod
    def for_name(cls, name: str | None = None) -> ClusterPaths:
        name = name or cluster_name()
        return cls(name=name, workdir=cache_dir() / "clusters" / name)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig.yaml"

    @property
    def kwok_config(self) -> Path:
        return self.workdir / "kwok.yaml"

    @property
    def scheduler_config(self) -> Path:
        """The copy kwokctl hands to kube-scheduler (ours plus its clientConnection)."""
        return self.workdir / "scheduler.yaml"

    @property
    def lock(self) -> Path:
        """Held while this cluster is created, reused or deleted."""
        return self.inputs_dir / "lock"

    @property
    def kwokctl_options(self) -> Path:
        return self.inputs_dir / "kwokctl-options.yaml"

    @property
    def state(self) -> Path:
        return self.workdir / STATE_FILE

    @property
    def inputs_dir(self) -> Path:
        """Generated inputs for kwokctl; outside the workdir, which kwokctl deletes on failure."""
        return cache_dir() / "cluster-inputs" / self.name

    @property
    def extender_pid(self) -> Path:
        return self.workdir / "carpool" / "extender.pid"

    @property
    def extender_log(self) -> Path:
        return self.workdir / "logs" / "carpool-extender.log"


# --------------------------------------------------------------------------------------------
# Progress


class Progress:
    """Prints each stage with its duration, so `make cluster` and CI logs show where time goes."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()

    @contextlib.contextmanager
    def stage(self, title: str) -> Iterator[None]:
        print(f"==> [cluster] {title}", file=self.stream, flush=True)
        start = time.monotonic()
        try:
            yield
        finally:
            print(f"    done in {time.monotonic() - start:.1f}s", file=self.stream, flush=True)

    def note(self, message: str) -> None:
        print(f"    {message}", file=self.stream, flush=True)

    def total(self) -> float:
        return time.monotonic() - self.started


# --------------------------------------------------------------------------------------------
# Binaries


def binaries_dir(progress: Progress | None = None) -> Path:
    """The directory with the locally built binaries, building them first if needed.

    `CARPOOL_BIN_DIR` overrides; otherwise hack/build-k8s.sh (a no-op once cached) prints it on
    its last line. Its progress goes to stderr as it happens.
    """
    override = os.environ.get("CARPOOL_BIN_DIR")
    if override:
        path = Path(override)
        _require_binaries(path)
        return path
    script = repo_root() / "hack" / "build-k8s.sh"
    last = ""
    with subprocess.Popen(
        ["bash", str(script)], stdout=subprocess.PIPE, text=True, cwd=script.parent.parent
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line:
                last = line
            if progress is not None:
                progress.note(line)
    if proc.returncode != 0:
        raise ClusterError(f"{script} failed (exit {proc.returncode}); see its output above")
    path = Path(last)
    _require_binaries(path)
    return path


def _require_binaries(path: Path) -> None:
    missing = [b for b in REQUIRED_BINARIES if not os.access(path / b, os.X_OK)]
    if missing:
        raise ClusterError(f"{path} lacks {', '.join(missing)}; run `make binaries`")


# --------------------------------------------------------------------------------------------
# Generated configuration


def scheduler_configuration(port: int) -> dict[str, Any]:
    """KubeSchedulerConfiguration: the stock profile plus `carpool-scheduler`, and the extender.

    Extenders are global in v1: both profiles consult it, but only for pods that request one of
    its managed resources. `clientConnection` stays unset because kwokctl appends its own.
    """
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        # One scheduler per cluster: skip the lease so a restart schedules at once.
        "leaderElection": {"leaderElect": False},
        "profiles": [
            {"schedulerName": "default-scheduler"},
            {"schedulerName": names.SCHEDULER_NAME,
             "percentageOfNodesToScore": CARPOOL_PERCENTAGE_OF_NODES},
        ],
        "extenders": [
            {
                "urlPrefix": f"http://127.0.0.1:{port}/",
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "bindVerb": "bind",
                "weight": 5,  # Carpool scores span 0..10; 5 outweighs the default spread plugins
                "enableHTTPS": False,
                "nodeCacheCapable": True,
                "httpTimeout": "10s",
                "ignorable": False,
                "managedResources": [
                    {"name": r, "ignoredByScheduler": True} for r in EXTENDER_RESOURCES
                ],
            }
        ],
    }


def stages_file() -> Path:
    return repo_root() / "hack" / "kwok" / "stages.yaml"


def pods_enabled() -> bool:
    """Whether clusters are made for pods that talk to the API server (see the docstring)."""
    return os.environ.get(PODS_ENV, "") not in ("", "0")


def apiserver_args(pods: bool) -> list[str]:
    if pods:
        return ["bind-address=0.0.0.0", f"advertise-address={POD_API_ADDRESS}"]
    return ["disable-admission-plugins=ServiceAccount"]


def _extra_args(*per_component: list[str]) -> list[str]:
    """`--extra-args` flags, the components' first args first: kwokctl 0.7.0 indexes a
    component's patch by the position of its first arg among all of them, so any other order
    with a repeated component panics (index out of range)."""
    ordered = [group[0] for group in per_component if group]
    ordered += [arg for group in per_component for arg in group[1:]]
    return [flag for arg in ordered for flag in ("--extra-args", arg)]


def kwokctl_create_args(paths: ClusterPaths, bin_dir: Path, scheduler_config: Path,
                        pods: bool = False) -> list[str]:
    """The `kwokctl create cluster` command line (also printed by `up`).

    The first `-c` file (written by `_write_kwokctl_options`) holds the loopback address and
    the ports; the second, the Pod stages.
    """
    return [
        str(bin_dir / "kwokctl"),
        "--name",
        paths.name,
        "-c",
        str(paths.kwokctl_options),
        "-c",
        str(stages_file()),
        "create",
        "cluster",
        "--runtime",
        "binary",
        "--kube-apiserver-binary",
        str(bin_dir / "kube-apiserver"),
        "--kube-controller-manager-binary",
        str(bin_dir / "kube-controller-manager"),
        "--kube-scheduler-binary",
        str(bin_dir / "kube-scheduler"),
        "--kwok-controller-binary",
        str(bin_dir / "kwok"),
        "--etcd-binary",
        str(bin_dir / "etcd"),
        "--kube-scheduler-config",
        str(scheduler_config),
        "--secure-port=true",
        "--kube-admission=true",
        *_extra_args(
            [f"kube-apiserver={a}" for a in apiserver_args(pods)],
            [
                "kwok-controller=manage-all-nodes=false",
                "kwok-controller=manage-nodes-with-annotation-selector="
                + "=".join(KWOK_NODE_ANNOTATION),
            ],
        ),
        "--kubeconfig=",  # leave ~/.kube/config alone; ours is in the workdir
        "--quiet-pull",
    ]


def kwokctl_env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["KWOK_WORKDIR"] = str(cache_dir())
    env["KWOK_KUBECTL_BINARY"] = str(bin_dir / "kubectl")
    env["KWOK_RUNTIME"] = "binary"
    return env


# kwokctl picks ports by trying to listen on them, so two clusters created at the same moment
# (parallel test sessions) can pick the same ones, and it ignores the ports of other clusters
# in the binary runtime. We pick them instead, under a lock shared by every cluster in the
# cache, skipping ports in use and ports any cluster's saved configuration records. The range
# lies below Linux's ephemeral ports (32768+) and away from kwokctl's own (counting down from
# 32767).
PORT_RANGE: Final = range(20000, 30000)
# kwok's workers wait on the API server most of the time; its default of 4 each falls behind
# (nodes stay NotReady for minutes) once a benchmark adds a thousand nodes on two cores.
KWOK_PARALLELISM: Final = {
    "nodePlayStageParallelism": 16,
    "podPlayStageParallelism": 16,
    "nodeLeaseParallelism": 16,
}
# kwokctl scales every heartbeat setting by this factor (its default, 5: node Leases of 200 s
# renewed every 50 s, nodes NotReady 200 s after the last renewal, checked every 25 s). At 5,000
# nodes the renewals alone were 97 writes/s, three quarters of an idle cluster's writes and
# about half a core of API server and etcd on the 2-core machine. 15 keeps kubelet's ratios
# (renew every quarter of the Lease, NotReady after one Lease) at 600 s Leases renewed every
# 150 s: a dead kwok controller's nodes turn NotReady after 10 minutes instead of 3.3, and
# nothing here waits for that.
KWOK_HEARTBEAT_FACTOR: Final = 15
PORT_OPTIONS: Final = (
    "etcdPort",
    "etcdPeerPort",
    "kubeApiserverPort",
    "kubeControllerManagerPort",
    "kubeSchedulerPort",
    "kwokControllerPort",
)


def recorded_ports() -> set[int]:
    """Ports any cluster under the cache was configured with (running or not)."""
    ports: set[int] = set()
    for config in (cache_dir() / "clusters").glob("*/kwok.yaml"):
        with contextlib.suppress(OSError, yaml.YAMLError):
            for doc in yaml.safe_load_all(config.read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "KwokctlConfiguration":
                    options = doc.get("options") or {}
                    ports.update(int(options[k]) for k in PORT_OPTIONS if options.get(k))
    return ports


def port_free(port: int) -> bool:
    """Whether nothing listens on `port`, on loopback or on all addresses."""
    for host in (BIND_ADDRESS, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def allocate_ports(name: str) -> dict[str, int]:
    """Free ports for a new cluster; the search starts at a place that depends on its name."""
    taken = recorded_ports()
    span = len(PORT_RANGE)
    start = zlib.crc32(name.encode()) % span
    chosen: list[int] = []
    for offset in range(span):
        port = PORT_RANGE[(start + offset) % span]
        if port not in taken and port_free(port):
            chosen.append(port)
            if len(chosen) == len(PORT_OPTIONS):
                return dict(zip(PORT_OPTIONS, chosen, strict=True))
    raise ClusterError(f"no {len(PORT_OPTIONS)} free ports in {PORT_RANGE}")


def _write_kwokctl_options(paths: ClusterPaths, ports: Mapping[str, int], pods: bool) -> None:
    documents = [
        {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokctlConfiguration",
            "options": {"bindAddress": BIND_ADDRESS, "heartbeatFactor": KWOK_HEARTBEAT_FACTOR,
                        **ports, **(
                {"kubeApiserverCertSANs": [POD_API_ADDRESS, KUBERNETES_SERVICE_IP]}
                if pods else {})},
        },
        {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokConfiguration",
            "options": dict(KWOK_PARALLELISM),
        },
    ]
    paths.kwokctl_options.write_text(yaml.safe_dump_all(documents, sort_keys=False))


def _fingerprint(create_args: Sequence[str], scheduler_yaml: str) -> dict[str, str]:
    """What a cluster is made from. A change of `cluster` (binaries, flags) needs a new cluster;
    the scheduler configuration and the stages are applied by restarting one component."""
    digest = hashlib.sha256
    portable_args = ["<stages>" if a == str(stages_file()) else a for a in create_args]
    return {
        "binDir": str(Path(create_args[0]).parent),
        # The stages travel by content (below), so the checkout they come from does not matter.
        "cluster": digest(
            json.dumps([*portable_args, BIND_ADDRESS, KWOK_PARALLELISM,
                        KWOK_HEARTBEAT_FACTOR]).encode()
        ).hexdigest(),
        "scheduler": digest(scheduler_yaml.encode()).hexdigest(),
        "stages": digest(stages_file().read_bytes()).hexdigest(),
    }


def known_bin_dir(paths: ClusterPaths) -> Path | None:
    """The binaries an existing cluster was made with (no build): for `down` and `status`."""
    candidates = [os.environ.get("CARPOOL_BIN_DIR"), (_read_state(paths) or {}).get("binDir")]
    for candidate in candidates:
        if candidate and os.access(Path(candidate) / "kwokctl", os.X_OK):
            return Path(candidate)
    return None


# --------------------------------------------------------------------------------------------
# Health


def _pid_of(workdir: Path, component: str) -> int | None:
    """The live pid of a component, or None; a pid file naming some other process is stale."""
    pid_file = workdir / "pids" / f"{component}.pid"
    try:
        pid = int(pid_file.read_text().strip())
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except (OSError, ValueError):
        return None
    return pid if Path(argv0).name == component else None


def remove_stale_pid_files(workdir: Path) -> list[str]:
    """Deletes pid files whose process is gone or reused, so kwokctl starts those components."""
    removed = []
    for pid_file in sorted((workdir / "pids").glob("*.pid")):
        if _pid_of(workdir, pid_file.stem) is None:
            pid_file.unlink(missing_ok=True)
            removed.append(pid_file.stem)
    return removed


def component_ports(paths: ClusterPaths) -> dict[str, int]:
    """Host ports kwokctl chose for each component, read from its saved configuration."""
    ports: dict[str, int] = {}
    if not paths.kwok_config.is_file():
        return ports
    for doc in yaml.safe_load_all(paths.kwok_config.read_text()):
        if not isinstance(doc, dict) or doc.get("kind") != "KwokctlConfiguration":
            continue
        for component in doc.get("components") or []:
            for port in component.get("ports") or []:
                if port.get("port") and not str(port.get("name", "")).startswith("peer"):
                    ports.setdefault(component["name"], int(port["port"]))
    return ports


def _https_ok(port: int, path: str = "/healthz", timeout: float = 2.0) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # loopback health probe of a self-signed component
    for scheme in ("https", "http"):
        try:
            with urllib.request.urlopen(
                f"{scheme}://127.0.0.1:{port}{path}",
                timeout=timeout,
                context=context if scheme == "https" else None,
            ) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError, ssl.SSLError):
            continue
    return False


@dataclass(frozen=True)
class Health:
    """One look at the cluster: which components run, and whether the API serves."""

    exists: bool
    running: dict[str, bool]
    api_ready: bool
    scheduler_ready: bool
    problems: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        return self.exists and not self.problems


def inspect(paths: ClusterPaths, bin_dir: Path | None) -> Health:
    if not paths.kwok_config.is_file():
        return Health(False, {}, False, False, ("no cluster",))
    running = {c: _pid_of(paths.workdir, c) is not None for c in COMPONENTS}
    problems = [f"{c} is not running" for c, up in running.items() if not up]
    api_ready = False
    if running["kube-apiserver"] and bin_dir is not None and paths.kubeconfig.is_file():
        probe = _kubectl(bin_dir, paths.kubeconfig, "get", "--raw", "/readyz", timeout=10)
        api_ready = probe.returncode == 0 and probe.stdout.strip() == "ok"
    if not api_ready:
        problems.append("kube-apiserver is not ready")
    ports = component_ports(paths)
    scheduler_ready = running["kube-scheduler"] and _https_ok(ports.get("kube-scheduler", 0))
    if not scheduler_ready:
        problems.append("kube-scheduler is not healthy")
    for component in ("kube-controller-manager", "kwok-controller"):
        if running[component] and not _https_ok(ports.get(component, 0)):
            problems.append(f"{component} is not healthy")
    return Health(True, running, api_ready, scheduler_ready, tuple(problems))


def wait_healthy(paths: ClusterPaths, bin_dir: Path, timeout: float) -> Health:
    """Polls until healthy, `timeout` passes, or (after a 10 s start-up) a component has died."""
    start = time.monotonic()
    while True:
        health = inspect(paths, bin_dir)
        elapsed = time.monotonic() - start
        died = elapsed > 10 and not all(health.running.values())
        if health.healthy or elapsed > timeout or died:
            return health
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------
# Commands


def _kubectl(
    bin_dir: Path, kubeconfig: Path, *args: str, timeout: float = 60, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        check=False,
    )


def _kwokctl(bin_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "kwokctl"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=kwokctl_env(bin_dir),
        check=False,
    )


def _log_tail(paths: ClusterPaths, lines: int = 15) -> str:
    chunks = []
    for component in COMPONENTS:
        log = paths.workdir / "logs" / f"{component}.log"
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            chunks.append(f"--- {log}\n" + "\n".join(tail))
    return "\n".join(chunks)


@dataclass(frozen=True)
class Cluster:
    """A running local cluster, as handed to tests and the demo."""

    name: str
    workdir: Path
    kubeconfig: Path
    bin_dir: Path
    extender_port: int
    reused: bool = False  # True when `up` found it already healthy

    @classmethod
    def at(cls, paths: ClusterPaths, bin_dir: Path, port: int, reused: bool = False) -> Cluster:
        return cls(paths.name, paths.workdir, paths.kubeconfig, bin_dir, port, reused)

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Runs the cluster's kubectl against it; raises with stderr when `check` and it fails."""
        result = _kubectl(self.bin_dir, self.kubeconfig, *args, timeout=timeout, stdin=stdin)
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def api(self) -> Any:
        """A `kubernetes.client.ApiClient` for this cluster, for tests and scripts that use
        its typed APIs (imported lazily: the CLI stays light)."""
        from carpool.kube.client import generated_client

        return generated_client(self.kubeconfig)

    def kube(self) -> Any:
        """A `carpool.kube.client.Api` for this cluster."""
        from carpool.kube.client import Api

        return Api.load(self.kubeconfig)


def up(
    name: str | None = None,
    port: int | None = None,
    progress: Progress | None = None,
    start_extender_if_available: bool = False,
    pods: bool | None = None,
) -> Cluster:
    """Starts the cluster, or reuses it when it is healthy and made from the same inputs.

    `pods` (default: `$CARPOOL_CLUSTER_PODS`): a cluster for Carpool's own pods (docstring).
    """
    progress = progress or Progress()
    pods = pods_enabled() if pods is None else pods
    paths = ClusterPaths.for_name(name)
    port = port if port is not None else extender_port()

    with progress.stage("binaries (hack/build-k8s.sh; cached by version)"):
        bin_dir = binaries_dir(progress)

    with progress.stage("scheduler configuration and KWOK stages"):
        configuration = scheduler_configuration(port)
        if pods:  # the chart's own carpool-scheduler, a pod, serves Carpool's pods
            configuration = {**configuration, "profiles": configuration["profiles"][:1],
                             "extenders": []}
        scheduler_yaml = yaml.safe_dump(configuration, sort_keys=False)
        paths.inputs_dir.mkdir(parents=True, exist_ok=True)
        scheduler_input = paths.inputs_dir / "scheduler-config.yaml"
        scheduler_input.write_text(scheduler_yaml)
        args = kwokctl_create_args(paths, bin_dir, scheduler_input, pods)
        wanted = _fingerprint(args, scheduler_yaml)
        progress.note(f"extender http://127.0.0.1:{port}/ ; stages {stages_file()}")

    cluster = Cluster.at(paths, bin_dir, port)
    if paths.kwok_config.is_file() and _reuse(paths, bin_dir, wanted, scheduler_yaml, progress):
        cluster = Cluster.at(paths, bin_dir, port, reused=True)
        _maybe_start_extender(cluster, start_extender_if_available, progress)
        progress.note(f"kubeconfig: {paths.kubeconfig}")
        return cluster

    for attempt in (1, 2):
        try:
            _create(paths, bin_dir, args, wanted, progress, pods)
            break
        except ClusterError as error:
            if attempt == 2:
                raise
            progress.note(f"attempt {attempt} failed, deleting and retrying: {error}")
            delete(paths, bin_dir)
    version = cluster.kubectl("version", "-o", "json").stdout
    progress.note(f"server {json.loads(version)['serverVersion']['gitVersion']}")
    _maybe_start_extender(cluster, start_extender_if_available, progress)
    progress.note(f"kubeconfig: {paths.kubeconfig}")
    return cluster


def _create(
    paths: ClusterPaths,
    bin_dir: Path,
    args: Sequence[str],
    wanted: Mapping[str, str],
    progress: Progress,
    pods: bool = False,
) -> None:
    # The ports lock is machine-wide: chosen ports are recorded in kwok.yaml before release.
    with _locked(cache_dir() / "cluster-inputs" / "ports.lock"):
        ports = allocate_ports(paths.name)
        _write_kwokctl_options(paths, ports, pods)
        with progress.stage("kwokctl create cluster (etcd, apiserver, controller-manager, ...)"):
            progress.note(" ".join(args))
            progress.note("ports " + ", ".join(f"{k}={v}" for k, v in ports.items()))
            created = subprocess.run(
                args,
                capture_output=True,
                text=True,
                env=kwokctl_env(bin_dir),
                timeout=600,
                check=False,
            )
        if created.returncode != 0:
            raise ClusterError(
                f"kwokctl create cluster failed (exit {created.returncode}):\n"
                f"{created.stderr.strip()}\n{_log_tail(paths)}"
            )
    _write_state(paths, wanted)
    with progress.stage("waiting for the API server, scheduler and controllers"):
        health = wait_healthy(paths, bin_dir, timeout=120)
        if not health.healthy:
            raise ClusterError(
                f"cluster {paths.name!r} did not become healthy: {'; '.join(health.problems)}\n"
                + _log_tail(paths)
            )


def _reuse(
    paths: ClusterPaths,
    bin_dir: Path,
    wanted: dict[str, str],
    scheduler_yaml: str,
    progress: Progress,
) -> bool:
    """Makes an existing cluster serve `wanted`, restarting only what changed or stopped.

    Returns False after deleting it when it needs recreating. A cluster other live test sessions
    use is never deleted under them: it is reused (with a note) until they are done.
    """
    with progress.stage(f"existing cluster {paths.name!r}: checking it"):
        recorded = _read_state(paths) or {}
        others = [pid for pid in _live_users(paths) if pid != os.getpid()]
        if recorded.get("cluster") != wanted["cluster"]:
            if not others:
                progress.note("made with other binaries or flags: recreating it")
                delete(paths, bin_dir)
                return False
            progress.note(
                f"made with other binaries or flags, but {len(others)} other test session(s) "
                "use it: reusing it; it is recreated once they are done"
            )
            wanted = {**wanted, "cluster": recorded.get("cluster", ""), "binDir": str(bin_dir)}
        restart = []
        if recorded.get("scheduler") != wanted["scheduler"]:
            _install_scheduler_config(paths, scheduler_yaml)
            restart.append("kube-scheduler")
        if recorded.get("stages") != wanted["stages"]:
            _install_stages(paths)
            restart.append("kwok-controller")
        for component in restart:
            progress.note(f"new configuration: restarting {component}")
            _stop_component(paths, component)
        health = inspect(paths, bin_dir)
        if not restart:
            progress.note("healthy, reusing it" if health.healthy else "; ".join(health.problems))
    if not health.healthy:
        with progress.stage("starting its stopped components"):
            removed = remove_stale_pid_files(paths.workdir)
            if removed:
                progress.note(f"stale pid files removed: {', '.join(removed)}")
            # kwokctl would wait 2 minutes for an API server that cannot bind its port.
            _kwokctl(bin_dir, "--name", paths.name, "start", "cluster", "--timeout=30s")
            health = wait_healthy(paths, bin_dir, timeout=60)
            progress.note("healthy" if health.healthy else "; ".join(health.problems))
    if health.healthy:
        _write_state(paths, wanted)
        return True
    if others:
        raise ClusterError(
            f"cluster {paths.name!r} is unhealthy ({'; '.join(health.problems)}) and in use by "
            f"test sessions {others}; not deleting it under them\n{_log_tail(paths)}"
        )
    with progress.stage("deleting it to start afresh"):
        delete(paths, bin_dir)
    return False


def _install_scheduler_config(paths: ClusterPaths, scheduler_yaml: str) -> None:
    """Replaces the scheduler's configuration, keeping the clientConnection kwokctl added."""
    current = yaml.safe_load(paths.scheduler_config.read_text())
    config = yaml.safe_load(scheduler_yaml)
    config["clientConnection"] = current["clientConnection"]
    paths.scheduler_config.write_text(yaml.safe_dump(config, sort_keys=False))


def _install_stages(paths: ClusterPaths) -> None:
    """Swaps the Stage documents in the kwok controller's configuration (kwokctl's kwok.yaml)."""
    documents = [
        doc
        for doc in yaml.safe_load_all(paths.kwok_config.read_text())
        if isinstance(doc, dict) and doc.get("kind") != "Stage"
    ]
    documents += list(yaml.safe_load_all(stages_file().read_text()))
    paths.kwok_config.write_text(yaml.safe_dump_all(documents, sort_keys=False))


def _stop_component(paths: ClusterPaths, component: str, grace: float = 10) -> None:
    """Stops one component by its pid file, so `kwokctl start cluster` starts it afresh."""
    pid = _pid_of(paths.workdir, component)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    (paths.workdir / "pids" / f"{component}.pid").unlink(missing_ok=True)


def delete(paths: ClusterPaths, bin_dir: Path | None) -> None:
    """Stops every component and removes the workdir (also when kwokctl cannot)."""
    stop_extender(paths)
    if bin_dir is not None and paths.workdir.exists():
        _kwokctl(bin_dir, "--name", paths.name, "delete", "cluster", timeout=120)
    for component in COMPONENTS:  # whatever kwokctl left behind, by pid file only
        pid = _pid_of(paths.workdir, component)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(paths.workdir, ignore_errors=True)


def _read_state(paths: ClusterPaths) -> dict[str, str] | None:
    try:
        data = json.loads(paths.state.read_text())
    except (OSError, ValueError):
        return None
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else None


def _write_state(paths: ClusterPaths, fingerprint: Mapping[str, str]) -> None:
    paths.state.write_text(json.dumps(dict(fingerprint), indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Sharing one cluster between test sessions


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """An exclusive lock between processes (several pytest runs may start at once)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _live_users(paths: ClusterPaths) -> list[int]:
    users = []
    for entry in (paths.inputs_dir / "users").glob("*"):
        pid = int(entry.name) if entry.name.isdigit() else -1
        if pid > 0 and Path(f"/proc/{pid}").exists():
            users.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return users


@contextlib.contextmanager
def shared_session(
    name: str | None = None, keep: bool = False, progress: Progress | None = None
) -> Iterator[Cluster]:
    """The cluster for one pytest session: started or reused, shared with concurrent sessions.

    A cluster some test session created is deleted when the last session using it ends, unless
    `keep`; a cluster that was already running (e.g. from `make cluster`) is left alone.
    """
    progress = progress or Progress()
    paths = ClusterPaths.for_name(name)
    ephemeral = paths.inputs_dir / "created-by-tests"
    me = paths.inputs_dir / "users" / str(os.getpid())
    with _locked(paths.lock):
        cluster = up(name, progress=progress)
        if not cluster.reused:
            ephemeral.touch()
        me.parent.mkdir(parents=True, exist_ok=True)
        me.touch()
    how = "reused" if cluster.reused else "started"
    progress.note(f"cluster {paths.name!r} {how}; ready in {progress.total():.1f}s")
    try:
        yield cluster
    finally:
        with _locked(paths.lock):
            me.unlink(missing_ok=True)
            if ephemeral.exists() and not keep and not _live_users(paths):
                with progress.stage(f"deleting cluster {paths.name!r} (a test session made it)"):
                    delete(paths, cluster.bin_dir)
                    ephemeral.unlink(missing_ok=True)


def kwok_node(
    name: str,
    capacity: Mapping[str, str],
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Node manifest the kwok controller will run pods on.

    It carries the kwok annotation (the controller manages only those) and a taint that keeps
    ordinary pods away; `capacity` is also the allocatable, since nothing is reserved.
    """
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "type": "kwok", **(labels or {})},
            "annotations": {
                KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1],
                **(annotations or {}),
            },
        },
        "spec": {"taints": [dict(KWOK_NODE_TAINT)]},
        "status": {"capacity": dict(capacity), "allocatable": dict(capacity)},
    }


KWOK_TOLERATION: Final = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


# --------------------------------------------------------------------------------------------
# The extender process


def extender_available() -> bool:
    """Whether `python -m carpool.extender` can run in this installation."""
    try:
        return importlib.util.find_spec("carpool.extender.__main__") is not None
    except ImportError:
        return False


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def start_extender(
    kubeconfig: Path,
    port: int,
    log_path: Path | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 30,
    serve_unowned: bool = True,
) -> subprocess.Popen[bytes]:
    """Spawns `python -m carpool.extender --port N --kubeconfig K` and waits until it listens.

    Output goes to `log_path` (or is inherited). Raises with the log's tail if it exits or
    never listens.
    The test bed's extender also places bare pods (`serve_unowned`), which many tests schedule;
    the demo's and the tenant tests' extender does not, like the chart's.
    """
    if port_open(port):
        raise ClusterError(f"port {port} is taken; stop its process or set {EXTENDER_PORT_ENV}")
    env = dict(os.environ)
    command = [sys.executable, "-m", "carpool.extender", "--port", str(port)]
    command += ["--kubeconfig", str(kubeconfig), *extra_args]
    command += ["--allow-unowned-pods"] if serve_unowned else []
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("ab")
    try:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
    finally:
        if log is not None:
            log.close()
    deadline = time.monotonic() + timeout
    while not port_open(port):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process(process)
            tail = ""
            if log_path is not None and log_path.is_file():
                tail = "\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            raise ClusterError(f"{' '.join(command)} did not start listening on {port}{tail}")
        time.sleep(0.1)
    return process


def stop_process(process: subprocess.Popen[bytes], grace: float = 5) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _maybe_start_extender(cluster: Cluster, wanted: bool, progress: Progress) -> None:
    if not wanted:
        return
    paths = ClusterPaths.for_name(cluster.name)
    if _extender_pid(paths) is not None:
        progress.note(f"extender already running on port {cluster.extender_port}")
        return
    if not extender_available():
        progress.note("carpool.extender is not runnable yet; not starting it")
        return
    with progress.stage(f"starting the Carpool extender on port {cluster.extender_port}"):
        process = start_extender(cluster.kubeconfig, cluster.extender_port, paths.extender_log)
        paths.extender_pid.parent.mkdir(parents=True, exist_ok=True)
        paths.extender_pid.write_text(str(process.pid))
        progress.note(f"pid {process.pid}, log {paths.extender_log}")


def _extender_pid(paths: ClusterPaths) -> int | None:
    try:
        pid = int(paths.extender_pid.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"carpool.extender" in cmdline else None


def stop_extender(paths: ClusterPaths) -> None:
    """Stops the extender `up --extender` started for this cluster, if it still runs."""
    pid = _extender_pid(paths)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    paths.extender_pid.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# CLI


def _status(paths: ClusterPaths) -> int:
    bin_dir = known_bin_dir(paths)
    health = inspect(paths, bin_dir)
    print(f"cluster:    {paths.name} ({paths.workdir})")
    print(f"kubeconfig: {paths.kubeconfig}")
    if not health.exists:
        print("state:      absent (run `make cluster`)")
        return 1
    ports = component_ports(paths)
    for component in COMPONENTS:
        pid = _pid_of(paths.workdir, component)
        state = f"running (pid {pid})" if pid else "stopped"
        print(f"  {component:<24} {state:<22} port {ports.get(component, '-')}")
    port = _scheduler_extender_port(paths)
    extender = "listening" if port and port_open(port) else "not listening"
    print(f"extender:   http://127.0.0.1:{port}/ ({extender})")
    print("state:      " + ("healthy" if health.healthy else "; ".join(health.problems)))
    return 0 if health.healthy else 1


def _scheduler_extender_port(paths: ClusterPaths) -> int | None:
    try:
        config = yaml.safe_load(paths.scheduler_config.read_text())
        url = str(config["extenders"][0]["urlPrefix"])
    except (OSError, KeyError, IndexError, TypeError, yaml.YAMLError):
        return None
    return int(url.rstrip("/").rsplit(":", 1)[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m carpool_testbed.devcluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--name", help=f"cluster name (default $CARPOOL_CLUSTER or {DEFAULT_CLUSTER_NAME})"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="start or reuse the cluster; prints the kubeconfig path")
    up_parser.add_argument(
        "--extender-port",
        type=int,
        default=None,
        help=f"port of the extender the scheduler calls (default "
        f"${EXTENDER_PORT_ENV} or {DEFAULT_EXTENDER_PORT})",
    )
    up_parser.add_argument(
        "--extender",
        action="store_true",
        help="also run `python -m carpool.extender` in the background",
    )
    up_parser.add_argument(
        "--pods",
        action="store_true",
        help=f"a cluster for Carpool's own pods on the real node (as ${PODS_ENV}=1)",
    )
    sub.add_parser("down", help="stop the cluster and delete its state")
    sub.add_parser("status", help="components, ports, health; exit 1 unless healthy")
    sub.add_parser("kubeconfig", help="print the kubeconfig path")
    args = parser.parse_args(argv)
    paths = ClusterPaths.for_name(args.name)
    if getattr(args, "pods", False):
        os.environ[PODS_ENV] = "1"
    try:
        if args.command == "up":
            progress = Progress()
            with _locked(paths.lock):
                cluster = up(args.name, args.extender_port, progress, args.extender)
                # Started by hand: test sessions must not delete it when they end.
                (paths.inputs_dir / "created-by-tests").unlink(missing_ok=True)
            print(f"==> [cluster] ready in {progress.total():.1f}s", file=sys.stderr)
            print(cluster.kubeconfig)
            return 0
        if args.command == "down":
            existed = paths.workdir.exists()
            with _locked(paths.lock):
                delete(paths, known_bin_dir(paths))
            print(f"cluster {paths.name}: {'deleted' if existed else 'was not there'}")
            return 0
        if args.command == "status":
            return _status(paths)
        print(paths.kubeconfig)
        return 0
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
