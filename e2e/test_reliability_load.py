"""Load with churn and faults: many GpuJobs over many simulated GPU nodes, every component
killed (-9) and restarted mid-run, a GPU turning Unhealthy, invariants sampled every second.

Runs on a cluster of its own (`$CARPOOL_LOAD_CLUSTER`, default carpool-load; its scheduler calls
the extender on `$CARPOOL_LOAD_EXTENDER_PORT`, default 18095), because it kills the API server
and etcd. Scale by environment (docs/reliability.md lists the runs and their times):

    CARPOOL_LOAD_JOBS=1000 CARPOOL_LOAD_NODES=500 CARPOOL_LOAD_RATE=2.5 \
        .venv/bin/pytest e2e/test_reliability_load.py -s

Jobs arrive at RATE per second over five projects (3 in 10 to one whose concurrent quota of 2
GPUs is less than its demand, so its jobs queue and the quota invariant bites; 1 in 10 to one
with a GPU-hour budget per 5 minutes below its demand while jobs arrive) and finish after 3-12
simulated seconds, so jobs finish while new ones arrive. KWOK runs the pods of all nodes but
`$CARPOOL_LOAD_PLUGIN_NODES` (default 4): there the real device plugin (fake GPU backend) hands
out the GPUs, driven by a stand-in kubelet (carpool_testbed.chaos.StandInKubelet), and 1 job in
10 is pinned to them. Checked every second from a watch-fed copy of the pods
(carpool_testbed.chaos): no GPU holds more memory or cores than it has, no exclusive grant
shares a GPU, no project holds more
GPUs than its concurrent quota, no project used more GPU-hours in the current period than its
budget, no pod is assigned to a GPU after it turned Unhealthy, and in the device plugin's own
Allocate answers no GPU is over-committed and no pod got other GPUs than assigned. At the end:
every job Succeeded, none ran to success twice, the operator, extender and device plugins are
alive, and each plugin's published GpuNode status is fresh and names its node's GPUs. Results
go to `$CARPOOL_LOAD_REPORT` (default build/reliability-load.json) for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import chaos, crds, devcluster, simnodes, stack

REPO = Path(__file__).resolve().parents[1]
JOBS = int(os.environ.get("CARPOOL_LOAD_JOBS", "1000"))
NODES = int(os.environ.get("CARPOOL_LOAD_NODES", "500"))
RATE = float(os.environ.get("CARPOOL_LOAD_RATE", "2.5"))
TIMEOUT_S = float(os.environ.get("CARPOOL_LOAD_TIMEOUT", "1500"))
FAULTS = os.environ.get("CARPOOL_LOAD_FAULTS", "1") == "1"
REPORT = Path(os.environ.get("CARPOOL_LOAD_REPORT", str(REPO / "build" / "reliability-load.json")))
# Nodes whose pods the real device plugin serves (a stand-in kubelet drives it; KWOK runs the
# rest); one job in ten is pinned to them.
PLUGIN_NODES = int(os.environ.get("CARPOOL_LOAD_PLUGIN_NODES", "4"))
GPUS_PER_NODE = 8
# project (and its namespace) -> concurrent GPUs; "tight" is where the quota invariant bites,
# "budget" is where the GPU-hour budget does. Names carry a run id, so a kept cluster can run
# again without meeting the last run's jobs.
RUN = datetime.now(UTC).strftime("%H%M%S")
TIGHT, BUDGETED = f"load-tight-{RUN}", f"load-budget-{RUN}"
OTHERS = (f"load-a-{RUN}", f"load-b-{RUN}", f"load-c-{RUN}")
TIGHT_GPUS = float(os.environ.get("CARPOOL_LOAD_TIGHT_GPUS", "2"))
PROJECTS = {TIGHT: TIGHT_GPUS, BUDGETED: 400.0, **{p: 400.0 for p in OTHERS}}
POLL_S = max(5.0, JOBS / 500)  # how often the run lists every GpuJob for its progress
PLUGIN_LABEL = ("carpool.dev/load-kubelet", "stand-in")
# Share of jobs that are gangs of 2-16 workers (spec.workers), in the projects without a tight
# quota or a budget, never pinned to the device-plugin nodes; checked: no worker of a gang
# attempt is ever bound to a node while another worker of that attempt was never created.
GANG_SHARE = float(os.environ.get("CARPOOL_LOAD_GANG_SHARE", "0"))
# The budgeted project: one job in ten, each with maxDuration 90 s (admission claims fraction x
# 90 s until the job ends). Its budget per 5-minute period is FACTOR x its mean demand per
# period while jobs arrive, so busier periods meet the budget and its jobs wait for the refill;
# at least 120 GPU-seconds, so the biggest job's claim fits a period.
BUDGET_PERIOD_S = 300.0
MEAN_JOB_GPU_S = 0.415 * 7.5  # the mix's mean GPU equivalents x mean simulated seconds
BUDGET_FACTOR = float(os.environ.get("CARPOOL_LOAD_BUDGET_FACTOR", "1.0"))
BUDGET_GPU_S = max(120.0, BUDGET_FACTOR * RATE / 10 * MEAN_JOB_GPU_S * BUDGET_PERIOD_S)


def log(message: str) -> None:
    print(f"[load {datetime.now(UTC).strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


@pytest.fixture(scope="module")
def load_cluster() -> Iterator[devcluster.Cluster]:
    name = os.environ.get("CARPOOL_LOAD_CLUSTER", "carpool-load")
    port = os.environ.get("CARPOOL_LOAD_EXTENDER_PORT", "18095")
    saved = os.environ.get(devcluster.EXTENDER_PORT_ENV)
    os.environ[devcluster.EXTENDER_PORT_ENV] = port
    try:
        session = devcluster.shared_session(
            name, keep=os.environ.get("CARPOOL_KEEP_CLUSTER") == "1",
            progress=devcluster.Progress(sys.stderr))
        cluster = session.__enter__()
    finally:
        if saved is None:
            os.environ.pop(devcluster.EXTENDER_PORT_ENV, None)
        else:
            os.environ[devcluster.EXTENDER_PORT_ENV] = saved
    try:
        yield cluster
    finally:
        session.__exit__(None, None, None)


@dataclass
class Carpool:
    """The operator and extender this run owns, so it can kill and restart them."""

    cluster: devcluster.Cluster
    log_dir: Path
    extender_kubeconfig: Path  # through a chaos.ApiProxy, so it can be cut off
    plugin_dirs: dict[str, Path] = field(default_factory=dict)  # node -> its plugin directory
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, component: str) -> None:
        if component.startswith("device-plugin:"):
            node = component.removeprefix("device-plugin:")
            spec = self.log_dir / f"{node}.yaml"
            spec.write_text(yaml.safe_dump(simnodes.parse_nodes({"nodes": [{
                "name": node, "gpus": [{"model": "H200", "count": GPUS_PER_NODE}]}]}
            )[0].backend_spec()))
            with (self.log_dir / f"plugin-{node}.log").open("ab") as out:
                self.processes[component] = subprocess.Popen(
                    [sys.executable, "-m", "carpool.deviceplugin", "--node-name", node,
                     "--backend", "fake", "--fake-spec", str(spec),
                     "--plugin-dir", str(self.plugin_dirs[node]), "--sharing-mode", "mps",
                     "--no-manage-mps", "--metrics-port", "0", "--publish-interval", "10",
                     "--kubeconfig", str(self.cluster.kubeconfig)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        elif component == "extender":
            self.processes[component] = devcluster.start_extender(
                self.extender_kubeconfig, self.cluster.extender_port,
                self.log_dir / "extender.log", timeout=60)
        else:
            self.processes[component] = stack.start_operator(
                self.cluster.kubeconfig, self.log_dir / "operator.log",
                {"CARPOOL_RESYNC_SECONDS": "2"})

    def kill(self, component: str) -> None:
        chaos.kill_process(self.processes[component])

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.processes.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            devcluster.stop_process(process)


def job_manifest(rng: random.Random, index: int, project: str, on_plugin_nodes: bool = False,
                 gang: bool = False) -> dict[str, Any]:
    shape = rng.random()
    if shape < 0.1:
        gpu: dict[str, Any] = {"count": 1, "memory": "100Gi", "isolation": "exclusive"}
    elif shape < 0.2:
        gpu = {"count": 2, "memory": f"{rng.choice((16, 24, 40))}Gi", "isolation": "mps",
               "cores": rng.choice((25, 50))}
    else:
        gpu = {"count": 1, "memory": f"{rng.choice((8, 16, 24, 40, 70))}Gi", "isolation": "mps",
               "cores": rng.choice((10, 20, 25, 30, 50))}
    pod_spec: dict[str, Any] = {"containers": [{"name": "main", "image": "trainer"}]}
    if on_plugin_nodes:
        pod_spec["nodeSelector"] = dict([PLUGIN_LABEL])
    spec: dict[str, Any] = {"project": project, "class": rng.choice(["short", "long", "batch"]),
                            "gpu": gpu, "estimatedDuration": "10m",
                            "simulatedDuration": f"{rng.randint(3, 12)}s",
                            "template": {"spec": pod_spec}}
    if project == BUDGETED:  # claims fraction x 90 s of the budget, released at the end
        spec.update(estimatedDuration="20s", maxDuration="90s")
    if gang:
        spec["workers"] = [{"name": "worker", "replicas": rng.randint(2, 16)}]
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": f"j{index:05d}", "namespace": project}, "spec": spec}


def list_jobs(custom: Any, namespace: str) -> list[dict[str, Any]]:
    """Every GpuJob of a namespace, in pages (one list of thousands can outlast a timeout)."""
    items: list[dict[str, Any]] = []
    token = None
    while True:
        page = custom.list_namespaced_custom_object(
            names.GROUP, names.VERSION, namespace, "gpujobs", limit=500,
            _continue=token, _request_timeout=60)
        items += page["items"]
        token = page["metadata"].get("continue")
        if not token:
            return items


def retrying(what: str, call: Callable[[], Any], deadline_s: float = 180) -> Any:
    """Retry through API-server outages; AlreadyExists after a lost reply counts as done."""
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except ApiException as err:
            if err.status == 409:
                return None
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {err}") from err
        except Exception as err:  # connection refused/reset while it restarts
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {err}") from err
        time.sleep(1)


@dataclass
class FaultLog:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, fault: str, started: float, recovered_s: float, note: str = "") -> None:
        self.rows.append({"fault": fault, "at_s": round(started, 1),
                          "recovered_s": round(recovered_s, 1), "note": note})
        log(f"fault {fault}: recovered in {recovered_s:.1f}s {note}")


def rss_mib(pid: int | None) -> float | None:
    """A process's resident memory from /proc, or None when it is not running."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def mark_gpu_unhealthy(api: Any, node: str) -> str:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    obj = custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.GPUNODE_PLURAL, node)
    gpus = obj["status"]["gpus"]
    gpus[0]["health"] = "Unhealthy"
    gpus[0]["healthReason"] = "Xid 79 (chaos: fell off the bus)"
    custom.patch_cluster_custom_object_status(
        names.GROUP, names.VERSION, names.GPUNODE_PLURAL, node, {"status": {"gpus": gpus}},
        _content_type="application/merge-patch+json")
    return str(gpus[0]["uuid"])


def published_by_plugins(custom: Any, nodes: list[simnodes.SimNode]) -> list[str]:
    """What is wrong with the GpuNode status each device plugin published: a stale heartbeat
    (it stopped publishing, e.g. after its restart), other GPUs than its node has, or a GPU
    reporting more memory used than it has."""
    problems = []
    for node in nodes:
        status = custom.get_cluster_custom_object(names.GROUP, names.VERSION,
                                                  names.GPUNODE_PLURAL, node.name,
                                                  _request_timeout=30).get("status") or {}
        age = (datetime.now(UTC) - datetime.fromisoformat(
            str(status.get("heartbeat", "2000-01-01T00:00:00Z")).replace("Z", "+00:00")))
        if age.total_seconds() > 60:
            problems.append(f"{node.name}: heartbeat {age.total_seconds():.0f} s old")
        gpus = status.get("gpus") or []
        if [g.get("uuid") for g in gpus] != [g.uuid for g in node.backend().inventory()]:
            problems.append(f"{node.name}: published GPUs {[g.get('uuid') for g in gpus]}")
        problems += [f"{node.name}: {g.get('uuid')} uses {g.get('memoryUsedMiB')} MiB of "
                     f"{g.get('memoryTotalMiB')}" for g in gpus
                     if int(g.get("memoryUsedMiB") or 0) > int(g.get("memoryTotalMiB") or 0)]
    return problems


def test_invariant_checks_catch_breaches() -> None:
    """The sampler's checks flag what they exist to flag (else a clean run proves nothing)."""
    capacity = {"g0": chaos.GpuCapacity("n0", 1000, True)}
    over = [chaos.Holding("ns/a", "p", "g0", 600, 50, False, "2026-01-01T00:00:10Z"),
            chaos.Holding("ns/b", "p", "g0", 600, 60, False, "2026-01-01T00:00:10Z")]
    assert len(chaos.overcommitted_gpus(over, capacity)) == 2  # memory and cores
    assert chaos.projects_over_quota(over, capacity, {"p": 1.0})
    assert not chaos.projects_over_quota(over, capacity, {"p": 1.2})
    since = {"g0": datetime(2026, 1, 1, tzinfo=UTC)}
    assert len(chaos.placed_on_unhealthy(over, since, 5.0)) == 2
    assert not chaos.placed_on_unhealthy(over, since, 15.0)
    pod = {"metadata": {"name": "a", "namespace": "ns", "annotations": {
        names.ANN_ASSIGNMENT: "{not json"}}, "status": {"phase": "Running"}}
    assert chaos.holdings(pod) == []
    # the budget: 0.5 GPU for 60 s and 1 GPU for 30 s since the period began = 60 GPU-s
    budget = chaos.Budget(gpu_hours=50 / 3600, period_s=300, anchor=1000.0)
    runs = [chaos.Run("ns/a", "p", 0.5, 900.0, 1060.0), chaos.Run("ns/b", "p", 1.0, 1260.0, None),
            chaos.Run("ns/c", "q", 1.0, 1000.0, None)]
    assert abs(chaos.budget_used(runs, "p", budget, now=1290.0) * 3600 - 60) < 1e-6
    assert chaos.projects_over_budget(runs, {"p": budget}, now=1290.0)
    assert not chaos.projects_over_budget(runs, {"p": budget}, now=1290.0, open_until=1265.0)
    assert not chaos.projects_over_budget(runs, {"p": budget}, now=1320.0)  # refilled at 1300
    finished = {"metadata": {"name": "d", "namespace": "ns", "labels": {
        names.LABEL_PROJECT: "p"}, "annotations": {names.ANN_ASSIGNMENT: json.dumps(
            {"node": "n0", "gpus": [{"uuid": "g0", "index": 0, "memoryMiB": 500,
                                     "cores": 20}]})}},
        "status": {"phase": "Succeeded", "containerStatuses": [{"state": {"terminated": {
            "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:10Z"}}}]}}
    run = chaos.pod_run(finished, capacity)
    assert run is not None and run.end is not None
    assert (run.fraction, run.end - run.start) == (0.5, 10.0)
    # the device plugin's answers: two 600 MiB MPS caps on a 1000 MiB GPU, one GPU not assigned
    answer = {"CUDA_VISIBLE_DEVICES": "g0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=600M",
              "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CARPOOL_ISOLATION": "mps"}
    answers = {p: chaos.plugin_grants(p, answer, capacity) for p in ("ns/a", "ns/b")}
    problems = chaos.plugin_overcommits(answers, {"ns/a": {"g0"}, "ns/b": {"g1"}}, capacity)
    assert len(problems) == 2 and "600 MiB" not in problems[0], problems
    assert not chaos.plugin_overcommits({"ns/a": answers["ns/a"]}, {"ns/a": {"g0"}}, capacity)


@pytest.mark.timeout(TIMEOUT_S + 900)
def test_load_with_churn_and_faults(load_cluster: devcluster.Cluster,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    from kubernetes import client

    cluster = load_cluster
    api = cluster.api()
    crds.apply_crds(api)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    paths = devcluster.ClusterPaths.for_name(cluster.name)
    log_dir = Path(tmp_path_factory.mktemp("load-logs"))
    started_utc = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
    log(f"cluster {cluster.name}; {JOBS} jobs over {NODES} nodes x {GPUS_PER_NODE} H200, "
        f"{RATE}/s, faults={'on' if FAULTS else 'off'}; logs in {log_dir}")

    nodes = simnodes.parse_nodes({"nodes": [{
        "name": "load", "replicas": NODES, "sharing": "mps", "zone": "zone-a",
        "gpus": [{"model": "H200", "count": GPUS_PER_NODE}]}]})
    plugin_nodes = [dataclasses.replace(n, kwok=False, labels=(*n.labels, PLUGIN_LABEL))
                    for n in simnodes.parse_nodes({"nodes": [{
                        "name": f"loaddp-{RUN}", "replicas": PLUGIN_NODES, "sharing": "mps",
                        "zone": "zone-a", "gpus": [{"model": "H200", "count": GPUS_PER_NODE}]}]}
                    )] if PLUGIN_NODES else []
    started = time.monotonic()
    simnodes.apply_nodes(api, plugin_nodes, workers=8)
    # the stand-in kubelet right away: the node lifecycle controller taints a node not Ready
    # (short paths: unix socket paths are limited to 107 bytes)
    plugin_dirs = {n.name: Path(f"/tmp/cpl-{RUN}-{i}") for i, n in enumerate(plugin_nodes)}
    kubelet = chaos.StandInKubelet(cluster.api(), plugin_dirs, {})
    kubelet.start()
    simnodes.apply_nodes(api, nodes, workers=8)
    log(f"{NODES} + {PLUGIN_NODES} nodes applied in {time.monotonic() - started:.0f}s")
    anchor = datetime.now(UTC).replace(microsecond=0)
    budget = chaos.Budget(BUDGET_GPU_S / 3600, BUDGET_PERIOD_S, anchor.timestamp())
    for project, gpus in PROJECTS.items():
        namespace = client.V1Namespace(metadata=client.V1ObjectMeta(name=project))
        retrying("namespace", lambda: core.create_namespace(namespace))  # noqa: B023
        spec: dict[str, Any] = {"namespaces": [project], "concurrent": {"gpus": int(gpus)}}
        if project == BUDGETED:
            spec["gpuHours"] = {"budget": budget.gpu_hours, "period": f"{BUDGET_PERIOD_S:.0f}s",
                                "periodAnchor": anchor.strftime("%Y-%m-%dT%H:%M:%SZ")}
        custom.patch_cluster_custom_object(
            names.GROUP, names.VERSION, "projectquotas", project,
            {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
             "metadata": {"name": project}, "spec": spec},
            field_manager="carpool-load", _content_type="application/apply-patch+yaml",
            force=True)
    gpunodes = custom.list_cluster_custom_object(names.GROUP, names.VERSION,
                                                 names.GPUNODE_PLURAL)["items"]
    capacity = chaos.capacities(gpunodes)  # every GPU the extender may use (a kept cluster's too)
    assert len(capacity) >= NODES * GPUS_PER_NODE

    server = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, _, port = server.removeprefix("https://").partition(":")
    proxy = chaos.ApiProxy((host, int(port)))
    kubelet.capacity = capacity
    carpool = Carpool(cluster, log_dir,
                      proxy.kubeconfig(cluster.kubeconfig, log_dir / "extender.kubeconfig"),
                      plugin_dirs)
    for node in plugin_dirs:
        carpool.start(f"device-plugin:{node}")
    for node in plugin_dirs:
        kubelet.wait_registered(node, 1, timeout=120)
    devcluster.stop_extender(paths)
    carpool.start("extender")
    carpool.start("operator")
    sampler = chaos.Sampler(cluster.api(), capacity, PROJECTS, budgets={BUDGETED: budget},
                            extra_checks=[kubelet.check])
    sampler.start()
    faults = FaultLog()
    fault_errors: list[str] = []
    supervisor = chaos.Supervisor(paths, cluster.bin_dir)
    supervisor.start()
    rng = random.Random(20261129)
    # 3 jobs in 10 bill the tight project: more than its 2 GPUs can run, so it queues there;
    # 1 in 10 the budgeted one; 1 in 10 runs on the device plugin's nodes.
    # gangs among 4 in 10 of all jobs (the other projects', not pinned), GANG_SHARE of all
    gang_rng = random.Random(20261206)
    manifests = [job_manifest(rng, i, TIGHT if i % 10 < 3 else BUDGETED if i % 10 == 3
                              else OTHERS[i % 3], on_plugin_nodes=bool(plugin_nodes)
                              and i % 10 == 5,
                              gang=i % 10 > 5 and gang_rng.random() < GANG_SHARE / 0.4)
                 for i in range(JOBS)]
    gang_workers = {f"{m['metadata']['namespace']}/{m['metadata']['name']}":
                    sum(w["replicas"] for w in m["spec"]["workers"])
                    for m in manifests if m["spec"].get("workers")}
    submitted = 0
    t0 = time.monotonic()

    def submit_all() -> None:
        nonlocal submitted
        submit_api = cluster.api()
        submit = client.CustomObjectsApi(submit_api)

        def create(body: dict[str, Any]) -> None:
            retrying(f"create {body['metadata']['name']}",
                     lambda: submit.create_namespaced_custom_object(
                         names.GROUP, names.VERSION, body["metadata"]["namespace"], "gpujobs",
                         body, _request_timeout=30))

        with submit_api, ThreadPoolExecutor(max_workers=4) as pool:
            for i, body in enumerate(manifests):
                delay = t0 + i / RATE - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(create, body)
                submitted = i + 1

    def inject_faults() -> None:
        plan: list[tuple[str, Callable[[], str]]] = []

        def restart_own(component: str) -> Callable[[], str]:
            def run() -> str:
                carpool.kill(component)
                time.sleep(2)
                carpool.start(component)
                return "kill -9, restarted after 2 s"
            return run

        def restart_control_plane(component: str, down_s: float) -> Callable[[], str]:
            def run() -> str:
                supervisor.paused.set()  # this fault decides when the component comes back
                try:
                    pid = chaos.kill_component(paths, component)
                    time.sleep(down_s)
                    took = chaos.start_stopped_components(paths, cluster.bin_dir)
                finally:
                    supervisor.paused.clear()
                return (f"kill -9 pid {pid}, down {down_s:.0f} s, cluster healthy {took:.1f} s "
                        "after the restart began")
            return run

        def cut_off() -> str:
            proxy.cut()
            time.sleep(20)
            proxy.restore()
            return (f"extender's API connections cut for 20 s ({proxy.refused} reconnects "
                    "refused), then restored")

        def restart_plugin() -> str:
            node = plugin_nodes[0].name
            before = kubelet.registrations[node]
            carpool.kill(f"device-plugin:{node}")
            time.sleep(2)
            carpool.start(f"device-plugin:{node}")
            took = kubelet.wait_registered(node, before + 1, timeout=120)
            return (f"kill -9 of {node}'s device plugin, restarted after 2 s, registered "
                    f"again {took:.1f} s later ({kubelet.plugin_down_retries} allocation "
                    "retries while it was down, so far)")

        def unhealthy() -> str:
            uuid = mark_gpu_unhealthy(api, nodes[0].name)
            sampler.mark_unhealthy(uuid, datetime.now(UTC))
            return f"GPU {uuid} on {nodes[0].name} marked Unhealthy"

        plan = [("operator", restart_own("operator")),
                ("extender", restart_own("extender")),
                *([("device-plugin", restart_plugin)] if plugin_nodes else []),
                ("extender-cut-off", cut_off),
                ("kube-scheduler", restart_control_plane("kube-scheduler", 2)),
                ("gpu-unhealthy", unhealthy),
                ("kube-apiserver", restart_control_plane("kube-apiserver", 5)),
                ("etcd", restart_control_plane("etcd", 5)),
                ("operator-again", restart_own("operator"))]
        window = max(120.0, JOBS / RATE)
        for n, (name, fault) in enumerate(plan):
            at = t0 + 15 + n * (window / len(plan))
            while time.monotonic() < at:
                time.sleep(0.5)
            began = time.monotonic()
            try:
                note = fault()
            except Exception as err:  # recorded and failed on below
                fault_errors.append(f"{name}: {type(err).__name__}: {err}")
                continue
            faults.add(name, began - t0, time.monotonic() - began, note)

    submitter = threading.Thread(target=submit_all, daemon=True)
    submitter.start()
    injector = threading.Thread(target=inject_faults, daemon=True)
    if FAULTS:
        injector.start()

    phases: dict[str, int] = {}
    loads: list[float] = []  # 1-minute load average at each progress line
    done_at = None
    progress: list[tuple[float, int]] = []
    peak_rss: dict[str, float] = {}  # component -> its largest RSS (MiB) at a progress line
    shown = 0  # violations printed so far
    try:
        deadline = t0 + TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            try:
                jobs = []
                for project in PROJECTS:
                    jobs += list_jobs(custom, project)
            except Exception as err:  # the API server may be down on purpose
                log(f"list failed ({type(err).__name__}); retrying")
                continue
            loads.append(os.getloadavg()[0])
            for component, pid in [
                    *((c, carpool.processes[c].pid) for c in ("operator", "extender")),
                    *((c, chaos.component_pid(paths, c)) for c in ("kube-apiserver", "etcd"))]:
                rss = rss_mib(pid)
                if rss is not None:
                    peak_rss[component] = max(peak_rss.get(component, 0.0), round(rss, 1))
            phases = {}
            for job in jobs:
                phase = (job.get("status") or {}).get("phase", "New")
                phases[phase] = phases.get(phase, 0) + 1
            finished = phases.get("Succeeded", 0)
            progress.append((time.monotonic() - t0, finished))
            log(f"submitted {submitted}, phases {dict(sorted(phases.items()))}, "
                f"live pods {sampler.max_live_pods} max, {len(sampler.violations)} violations, "
                f"plugin allocations {kubelet.allocated}, "
                f"alive {carpool.alive()}")
            # New breaches are printed as they come, so a run cut short still says what broke.
            for violation in sampler.violations[shown:shown + 10]:
                log(f"VIOLATION {violation}")
            shown = len(sampler.violations)
            if finished == JOBS and not injector.is_alive():
                done_at = time.monotonic() - t0
                break
        injector.join(1)
        submitter.join(1)
        final_jobs = jobs
        published = retrying("GpuNodes", lambda: published_by_plugins(custom, plugin_nodes))
    finally:
        sampler.stop()
        supervisor.stop()
        alive = carpool.alive()
        carpool.stop()
        kubelet.stop()
        for directory in plugin_dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
        proxy.close()
        sampler.api.close()
        for project in PROJECTS:  # a kept cluster's next run should not list these jobs
            with contextlib.suppress(Exception):
                core.delete_namespace(project)
                custom.delete_cluster_custom_object(names.GROUP, names.VERSION,
                                                    "projectquotas", project)
        api.close()

    attempts: dict[int, int] = {}
    for job in final_jobs:
        n = int((job.get("status") or {}).get("attempts") or 0)
        attempts[n] = attempts.get(n, 0) + 1
    twice = {job: pods for job, pods in sampler.succeeded_pods.items() if len(pods) > 1}
    report = {
        "jobs": JOBS, "nodes": NODES, "gpus": NODES * GPUS_PER_NODE, "rate_per_s": RATE,
        "finished_s": done_at, "phases": phases, "attempts": attempts,
        "jobs_per_s": round(JOBS / done_at, 2) if done_at else None,
        "samples": sampler.samples, "violations": sampler.violations[:50],
        "violation_count": len(sampler.violations), "succeeded_twice": len(twice),
        "max_live_pods": sampler.max_live_pods,
        "peak_project_gpus": sampler.peak_project_gpus, "quota_gpus": PROJECTS,
        "peak_gpu_memory_share": sampler.peak_gpu_memory_share,
        "watch_restarts": sampler.watch_restarts, "peak_rss_mib": peak_rss,
        "budget": {"project": BUDGETED, "gpu_hours": round(budget.gpu_hours, 5),
                   "period_s": BUDGET_PERIOD_S,
                   "peak_share_used": sampler.peak_budget_share.get(BUDGETED)},
        "device_plugin": {
            "nodes": list(plugin_dirs), "allocations": kubelet.allocated,
            "registrations": kubelet.registrations, "refusals": kubelet.refusals[:20],
            "refusal_count": len(kubelet.refusals),
            "retries_while_down": kubelet.plugin_down_retries,
            "pods_failed_admission": kubelet.failed_pods, "published_problems": published},
        "faults": faults.rows, "fault_errors": fault_errors,
        "control_plane_restarts_by_supervisor": supervisor.restarts, "alive_at_end": alive,
        "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "load_average_during_run": {"min": min(loads, default=0.0),
                                    "max": max(loads, default=0.0),
                                    "mean": round(sum(loads) / max(1, len(loads)), 1)},
        "started_utc": started_utc, "tight_quota_gpus": TIGHT_GPUS, "gang_share": GANG_SHARE,
        "gangs": {"jobs": len(gang_workers), "share": round(len(gang_workers) / JOBS, 3),
                  "workers": sum(gang_workers.values()),
                  "partial_starts": (partial := sampler.partial_gangs(gang_workers)),
                  "attempts_created_in_part": sampler.incomplete_gangs(gang_workers)},
    }
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2))
    log(json.dumps(report, indent=2))
    assert not fault_errors, fault_errors
    assert done_at is not None, f"not all jobs finished within {TIMEOUT_S:.0f}s: {phases}"
    assert phases == {"Succeeded": JOBS}
    assert not twice, f"jobs that succeeded with two pods: {list(twice.items())[:5]}"
    assert not partial, f"gangs started in part: {partial[:10]}"
    assert not sampler.violations, sampler.violations[:20]
    assert all(alive.values()), f"a component died on its own: {alive}\n" + "\n".join(
        stack.log_tail(log_dir / f"{c}.log") for c, ok in alive.items() if not ok)
    assert sampler.samples >= done_at * 0.8  # sampled about every second
    if plugin_nodes:  # the real device plugin served its share of the load, refusing none
        assert kubelet.allocated >= JOBS // 20, kubelet.allocated
        assert not kubelet.failed_pods, kubelet.refusals[:10]
        assert not published, published
    if FAULTS:
        assert [f["fault"] for f in faults.rows] == [
            "operator", "extender", *(["device-plugin"] if plugin_nodes else []),
            "extender-cut-off", "kube-scheduler", "gpu-unhealthy",
            "kube-apiserver", "etcd", "operator-again"]
