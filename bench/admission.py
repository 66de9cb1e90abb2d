"""Operator admission throughput and latency against the real API server.

On its own local cluster (default name `carpool-bench-admission`: real etcd, API server,
kube-scheduler with the Carpool extender, KWOK nodes) this starts the extender and the real
operator process (`kopf run -m carpool.operator.handlers`), creates `--nodes` simulated GPU
nodes and `--projects` ProjectQuotas, then creates `--jobs` GpuJobs as fast as it can (a few
threads) and follows them with a watch until all have started. It reports:

- admissions/s: jobs admitted / seconds from the first job created to the last admission of
  the initial burst (jobs admitted while capacity was free), and over the whole run; with
  `--create-first` every GpuJob exists before the operator starts (a queue of `--jobs` at
  startup) and the seconds count from the operator's start instead, so the rate is the
  operator's and not the bench client's creation rate;
- p50/p99 seconds from a job's creation (the create call's return; with `--create-first`,
  the operator's start) to the watch first showing it Admitted (or later); with
  `--stop-when-admitted`, to the creation of its pods as the API server stores them, without
  the watch (`carpool_testbed.stored`);
- the operator's peak RSS (VmHWM in /proc/<pid>/status);
- the median absolute error of the first estimated start a queued job showed vs. its actual
  start (status.startTime, from the pod), over jobs that waited;
- the same first estimates in the issue's terms, by the replay's rule
  (`carpool.replay.queue_replay.first_estimate_errors`, `eta_first` in the result):
  |estimated start - actual start| / actual wait (the server's creation time, as in the
  job's status.submitTime, or the operator's start if later, to the first start) over jobs
  that waited >= 60 s, median, P90 and signed; the share of them whose start fell inside
  the 80 % range shown with that first estimate
  (status.estimatedStartEarliest..Latest); seconds of error for jobs that waited less; the
  same per class (`eta_first_by_class`), and one line per job in the log folder's
  first_estimates.jsonl;
- beside those, what the operator's own `carpool_eta_*` metrics counted, scraped from its
  /metrics at the end (`eta_first_operator_metrics`): the same rule from the jobs' status,
  so a platform team's dashboard and this bench can be checked against each other.

The jobs' `estimatedDuration` is their simulated run time unless `--user-estimates realistic`
draws it from that run time as users estimate (`carpool.replay.job_traces.user_estimate`), and
with `--templates N` the jobs come from N templates (repeating name stems) with their own
typical run times, so that run-time learning from finished GpuJobs has something to learn;
`--arrival-rate` spreads the creations so later arrivals are estimated after jobs finished.

    .venv/bin/python bench/admission.py [--jobs 5000] [--nodes 200]
        [--create-first] [--user-estimates realistic --templates 8 --arrival-rate 6]
        [--write-doc docs/benchmarks.md]

The cluster is kept for reuse unless `--delete-cluster`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from carpool.core import names
from carpool.core.eta_accuracy import score_first_estimate
from carpool.core.timestamps import epoch_seconds
from carpool.core.topology import TOPOLOGY_LABELS, TopologyLevel
from carpool.replay.job_traces import user_estimate
from carpool.replay.queue_replay import Estimate, first_estimate_errors
from carpool_testbed import crds, devcluster, simnodes, stack, stored

SECTION = "## Operator admission (bench/admission.py)"
PASS_LINE = re.compile(r"read ([0-9.]+)s decide ([0-9.]+)s act ([0-9.]+)s")


class Tracker:
    """Follows every GpuJob through a watch; first-seen times per job."""

    def __init__(self, api: Any):
        self.custom = client.CustomObjectsApi(api)
        self.admitted: dict[str, float] = {}
        self.first_estimate: dict[str, float] = {}
        self.first_range: dict[str, tuple[float | None, float | None]] = {}
        self.started: dict[str, float] = {}
        self.first_started: dict[str, float] = {}  # a preempted job's later runs aside
        self.finished: set[str] = set()
        self.waited: set[str] = set()
        self.reasons: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        version = ""
        while not self.stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                        self.custom.list_cluster_custom_object, names.GROUP, names.VERSION,
                        names.GPUJOB_PLURAL, resource_version=version, timeout_seconds=30):
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion", version)
                    self._see(obj)
                    if self.stop.is_set():
                        break
            except Exception:  # expired resourceVersion etc.: relist
                version = ""
                time.sleep(0.5)

    def _see(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        status = obj.get("status") or {}
        phase = status.get("phase")
        now = time.time()
        with self.lock:
            if phase == "Queued" and status.get("reason"):
                if key not in self.waited:
                    self.reasons[status["reason"]] = self.reasons.get(status["reason"], 0) + 1
                self.waited.add(key)
            if phase == "Queued" and key not in self.first_estimate:
                estimate = epoch_seconds(status.get("estimatedStart"))
                if estimate is not None:
                    self.first_estimate[key] = estimate
                    self.first_range[key] = (epoch_seconds(status.get("estimatedStartEarliest")),
                                             epoch_seconds(status.get("estimatedStartLatest")))
            if phase in ("Admitted", "Running", "Succeeded", "Failed") \
                    and key not in self.admitted:
                self.admitted[key] = now
            start = epoch_seconds(status.get("startTime"))
            if start is not None:
                self.started[key] = start
                self.first_started.setdefault(key, start)
            if phase in ("Succeeded", "Failed"):
                self.finished.add(key)


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


COMPONENTS = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager",
              "kwok-controller")
REQUEST_LINE = re.compile(r'^apiserver_request_total\{(.*)\} (\S+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def component_rss_mib(pids: dict[str, int]) -> dict[str, float]:
    """Each process's resident and peak resident memory now, MiB (VmRSS, VmHWM)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            out[name] = round(_rss_kib(pid, "VmRSS") / 1024)
            out[f"{name} peak"] = round(_rss_kib(pid, "VmHWM") / 1024)
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _component_pids(cluster: str) -> dict[str, int]:
    workdir = devcluster.ClusterPaths.for_name(cluster).workdir
    pids = {}
    for name in COMPONENTS:
        try:
            pids[name] = int((workdir / "pids" / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            continue
    return pids


def _api_requests(api: Any) -> dict[str, float]:
    """The API server's request counters, per `VERB resource[/subresource]`."""
    response = api.rest_client.pool_manager.request(
        "GET", f"{api.configuration.host}/metrics", retries=False)
    totals: dict[str, float] = {}
    for line in response.data.decode().splitlines():
        if (match := REQUEST_LINE.match(line)) is None:
            continue
        labels = dict(LABEL.findall(match.group(1)))
        if labels.get("verb") in ("WATCH", "GET", "LIST"):
            continue
        key = f"{labels.get('verb')} {labels.get('resource')}" + (
            f"/{labels['subresource']}" if labels.get("subresource") else "")
        totals[key] = totals.get(key, 0.0) + float(match.group(2))
    return totals


def _strip_cel(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("x-kubernetes-validations", None)
        for value in node.values():
            _strip_cel(value)
    elif isinstance(node, list):
        for value in node:
            _strip_cel(value)


def _api_ceiling(api: Any, namespace: str, count: int, apiserver_pid: int | None,
                 workers: int = 16) -> dict[str, float]:
    """What the API server alone takes on this machine, before the operator starts: `count`
    pod creates (pods no scheduler picks up), then `count` status patches of GpuJobs made for
    it, each from `workers` threads through the client's pool: the operator's two writes per
    admission, without scheduling or simulated pods. For comparison, the same GpuJob status
    patches on a copy of the GpuJob CRD without its CEL rules (a temporary CRD). The objects
    are deleted afterwards. Besides writes/s (which other load on the machine moves), the API
    server's CPU milliseconds per write (which it moves much less)."""
    pool = api.rest_client.pool_manager
    base = api.configuration.host
    json_headers = {"Content-Type": "application/json", "Accept": "application/json"}
    merge_headers = {**json_headers, "Content-Type": "application/merge-patch+json"}
    jobs_url = (f"{base}/apis/{names.GROUP}/{names.VERSION}/namespaces/{namespace}/"
                f"{names.GPUJOB_PLURAL}")
    pods_url = f"{base}/api/v1/namespaces/{namespace}/pods"
    probe = _job(namespace, "ceiling", namespace, random.Random(0), "NONE")
    names_ = [f"ceiling-{i}" for i in range(count)]

    cpu_ms: dict[str, float] = {}

    def timed(call: Any, label: str = "") -> float:
        cpu = _cpu_seconds(apiserver_pid) if apiserver_pid else 0.0
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=workers) as threads:
            list(threads.map(call, names_))
        if apiserver_pid and label:
            cpu_ms[label] = (_cpu_seconds(apiserver_pid) - cpu) * 1000 / count
        return count / (time.monotonic() - started)

    def make_job(name: str) -> None:
        pool.request("POST", jobs_url, body=json.dumps(
            {**probe, "metadata": {"name": name, "namespace": namespace}}).encode(),
            headers=json_headers, retries=False)

    def create_pod(name: str) -> None:
        pool.request("POST", pods_url, body=json.dumps({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"bench": "ceiling"}},
            "spec": {"schedulerName": "nobody", "restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "work"}]}}).encode(),
            headers=json_headers, retries=False)

    def patch_status(name: str) -> None:
        pool.request("PATCH", f"{jobs_url}/{name}/status", body=json.dumps(
            {"status": {"phase": "Queued", "reason": "Capacity", "message": "ceiling"}}
        ).encode(), headers=merge_headers, retries=False)

    def delete(name: str) -> None:
        pool.request("DELETE", f"{pods_url}/{name}?gracePeriodSeconds=0", retries=False)
        pool.request("DELETE", f"{jobs_url}/{name}", retries=False)

    rates = {"gpujob_creates_per_s": timed(make_job, "gpujob_create_cpu_ms"),
             "pod_creates_per_s": timed(create_pod, "pod_create_cpu_ms"),
             "status_patches_per_s": timed(patch_status, "status_patch_cpu_ms")}
    timed(delete)
    # the same schema without CEL rules, under another name
    crd = next(c for c in crds.load_crds() if c["spec"]["names"]["plural"] == names.GPUJOB_PLURAL)
    crd = json.loads(json.dumps(crd))
    _strip_cel(crd)
    plural, kind = "gpujobnocels", "GpuJobNoCel"
    crd["metadata"] = {"name": f"{plural}.{names.GROUP}"}
    crd["spec"]["names"] = {"plural": plural, "singular": "gpujobnocel", "kind": kind,
                            "listKind": f"{kind}List"}
    crd_url = f"{base}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    pool.request("POST", crd_url, body=json.dumps(crd).encode(), headers=json_headers)
    time.sleep(5)  # established
    jobs_url = f"{base}/apis/{names.GROUP}/{names.VERSION}/namespaces/{namespace}/{plural}"
    probe = {**probe, "kind": kind}
    timed(make_job)
    rates["status_patches_without_cel_per_s"] = timed(patch_status,
                                                      "status_patch_without_cel_cpu_ms")
    pool.request("DELETE", f"{crd_url}/{plural}.{names.GROUP}")
    rates.update(cpu_ms)
    print("API server alone: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()),
          file=sys.stderr)
    return rates


def _signal_scheduler(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, signum)


def bound_pods(api: Any, namespaces: list[str], job_label: str) -> dict[str, list[bool]]:
    """Per job (`<namespace>/<job_label>`), whether each of its pods is bound to a node."""
    core = client.CoreV1Api(api)
    out: dict[str, list[bool]] = {}
    for namespace in namespaces:
        for pod in core.list_namespaced_pod(namespace, label_selector=job_label).items:
            job = pod.metadata.labels[job_label]
            out.setdefault(f"{namespace}/{job}", []).append(bool(pod.spec.node_name))
    return out


def bound_when_settled(api: Any, namespaces: list[str], job_label: str, limit_s: float,
                       quiet_s: float = 15.0) -> dict[str, list[bool]]:
    """`bound_pods` once kube-scheduler has bound nothing more for `quiet_s` (or after
    `limit_s`): a gang caught while its workers are still being bound is not a partial start,
    one left so when binding has stopped is."""
    deadline = time.monotonic() + limit_s
    last = bound_pods(api, namespaces, job_label)
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(5)
        now = bound_pods(api, namespaces, job_label)
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            break
    return last


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _job(namespace: str, name: str, project: str, rng: random.Random, model: str,
         exclusive: bool = False) -> dict[str, Any]:
    """A one-GPU job: an MPS share (25-50 % of the cores), or with `exclusive` a whole GPU
    (what bench/peers.py gives Carpool and Kueue alike)."""
    cls = rng.choices(["interactive", "short", "long", "batch"], [1, 3, 2, 4])[0]
    seconds = rng.randint(40, 120)
    memory, cores = rng.choice([16, 24, 32, 48]), rng.choice([25, 34, 50])
    gpu: dict[str, Any] = ({"count": 1, "memory": f"{memory}Gi", "isolation": "exclusive",
                            "models": [model]}
                           if exclusive else
                           {"count": 1, "memory": f"{memory}Gi", "cores": cores,
                            "isolation": "mps", "models": [model]})
    return {
        "apiVersion": names.API_VERSION, "kind": "GpuJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"project": project, "class": cls,
                 "preemptible": cls == "batch",
                 "gpu": gpu,
                 "estimatedDuration": f"{seconds}s", "simulatedDuration": f"{seconds}s",
                 "template": {"spec": {"containers": [{"name": "main", "image": "work"}]}}},
    }


NODES_PER_RACK, RACKS_PER_BLOCK = 8, 4


def topology_labels(index: int) -> dict[str, str]:
    """Node `index`'s rack and block (8 nodes a rack, 4 racks a block), by the labels Carpool's
    topology levels read; bench/peers.py gives Kueue's Topology the same labels."""
    rack = index // NODES_PER_RACK
    return {TOPOLOGY_LABELS[TopologyLevel.RACK]: f"r{rack}",
            TOPOLOGY_LABELS[TopologyLevel.BLOCK]: f"b{rack // RACKS_PER_BLOCK}"}


@dataclass(frozen=True)
class GangShape:
    """A gang in the generated workload: `workers` pods of `gpus` whole GPUs each, in one rack,
    either required or preferred."""

    workers: int
    gpus: int
    required: bool


def gang_shapes(jobs: int, share: float, seed: int, gpus_per_node: int = 8
                ) -> dict[int, GangShape]:
    """Which of `jobs` are gangs (a `share` of them) and their shapes: 2-16 workers of 1 to
    `gpus_per_node` GPUs, at most a rack's GPUs in all; drawn from a generator of its own, so
    both systems of bench/peers.py get the same gangs and the other jobs stay as they were."""
    rng = random.Random(f"bench-gangs-{seed}")
    rack = NODES_PER_RACK * gpus_per_node
    out = {}
    for i in range(jobs):
        if rng.random() >= share:
            continue
        workers = rng.choice([2, 2, 4, 4, 8, 16])
        gpus = rng.choice([g for g in (1, 2, 4, 8) if g <= gpus_per_node and workers * g <= rack])
        out[i] = GangShape(workers, gpus, required=rng.random() < 0.5)
    return out


def _make_gang(manifest: dict[str, Any], shape: GangShape) -> None:
    """Turn a `_job` manifest into a gang of `shape` (whole GPUs, in one rack), in place."""
    spec = manifest["spec"]
    spec["gpu"] = {"count": shape.gpus, "memory": "80Gi", "isolation": "exclusive",
                   "models": spec["gpu"]["models"]}
    spec["workers"] = [{"name": "worker", "replicas": shape.workers}]
    spec["topology"] = {"level": "rack", "mode": "required" if shape.required else "preferred"}


def job_pods(manifest: dict[str, Any]) -> int:
    """Pods a generated GpuJob has once admitted (one per worker, for a gang)."""
    return sum(w["replicas"] for w in manifest["spec"].get("workers", [])) or 1


def job_gpus(manifest: dict[str, Any]) -> int:
    """GPUs a generated GpuJob holds once admitted (every worker's, for a gang)."""
    spec = manifest["spec"]
    return int(spec["gpu"]["count"]) * job_pods(manifest)


def _vary_jobs(manifests: list[dict[str, Any]], templates: int, user_estimates: str,
               seed: int) -> None:
    """Rewrite the jobs `_job` made, in place and from a seeded generator of its own (so the
    default jobs stay draw for draw as they were). With `templates`, job i is a run of one
    of that many templates: named `t<k>-<i>` (run-time learning groups jobs by the name's
    stem), running the template's typical time (drawn from 40-120 s) times a log-normal
    factor (sigma 0.25). With realistic `user_estimates`, its estimatedDuration is drawn
    from its run time as users estimate (`job_traces.user_estimate`)."""
    rng = random.Random(f"bench-admission-jobs-{seed}")
    typical = [rng.uniform(40, 120) for _ in range(templates)]
    for i, manifest in enumerate(manifests):
        spec = manifest["spec"]
        seconds = int(spec["simulatedDuration"].removesuffix("s"))
        if templates:
            k = rng.randrange(templates)
            manifest["metadata"]["name"] = f"t{k}-{i}"
            seconds = max(10, round(typical[k] * math.exp(rng.gauss(0.0, 0.25))))
            spec["simulatedDuration"] = f"{seconds}s"
        estimate = user_estimate(seconds, rng) if user_estimates == "realistic" else seconds
        spec["estimatedDuration"] = f"{estimate:.0f}s"


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ[devcluster.EXTENDER_PORT_ENV] = str(args.extender_port)
    cluster = devcluster.up(args.cluster, port=args.extender_port,
                            progress=devcluster.Progress(sys.stderr))
    api = cluster.api()
    crds.apply_crds(api)  # the GpuNodes below need them; running_stack applies them again
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    rng = random.Random(args.seed)
    tag = f"{int(time.time()) % 100000}"
    model = f"BENCH{tag}"
    log_dir = Path(tempfile.mkdtemp(prefix="carpool-bench-admission-"))
    print(f"logs in {log_dir}", file=sys.stderr)

    nodes = simnodes.parse_nodes({"nodes": [{
        "name": f"bench-{tag}-n{i}", "zone": "zone-a", "sharing": "mps",
        "labels": topology_labels(i),
        "gpus": [{"model": model, "count": args.gpus_per_node,
                  "memoryTotalMiB": 141 * 1024}]} for i in range(args.nodes)]})
    started = time.monotonic()
    simnodes.apply_nodes(api, nodes, workers=8)
    print(f"{len(nodes)} nodes in {time.monotonic() - started:.1f}s", file=sys.stderr)
    gpus = args.nodes * args.gpus_per_node
    projects = [f"bench-{tag}-p{i}" for i in range(args.projects)]
    for project in projects:
        core.create_namespace({"metadata": {"name": project}})
        custom.create_cluster_custom_object(names.GROUP, names.VERSION,
                                            names.PROJECTQUOTA_PLURAL, {
            "apiVersion": names.API_VERSION, "kind": "ProjectQuota",
            "metadata": {"name": project},
            "spec": {"namespaces": [project], "concurrent": {"gpus": gpus // args.projects},
                     "borrowing": {"enabled": True}}})
    jobs = [(p, f"j{i}") for i in range(args.jobs) for p in [projects[i % len(projects)]]]
    manifests = [_job(p, name, p, rng, model, args.exclusive) for p, name in jobs]
    for i, shape in gang_shapes(args.jobs, args.gang_share, args.seed,
                                args.gpus_per_node).items():
        _make_gang(manifests[i], shape)
    if args.none_preemptible:
        for manifest in manifests:
            manifest["spec"]["preemptible"] = False
    for manifest in manifests:  # (with --then-schedule no job ends while it is watched)
        spec = manifest["spec"]
        for field in ("simulatedDuration", "estimatedDuration"):
            seconds = int(spec[field].removesuffix("s")) + round(args.then_schedule)
            spec[field] = f"{seconds}s"
    if args.templates or args.user_estimates != "exact":
        _vary_jobs(manifests, args.templates, args.user_estimates, args.seed)

    created: dict[str, float] = {}  # the create call's return, for latencies
    submitted: dict[str, float] = {}  # the server's creationTimestamp (to the second)
    # GpuJobs are created through the client's connection pool directly: the generated API
    # classes cost ~10 ms of CPU per call, which capped creation near 100/s on two cores
    pool = api.rest_client.pool_manager
    headers = {"Content-Type": "application/json", "Accept": "application/json"}

    def create(manifest: dict[str, Any]) -> None:
        meta = manifest["metadata"]
        url = (f"{api.configuration.host}/apis/{names.GROUP}/{names.VERSION}/namespaces/"
               f"{meta['namespace']}/{names.GPUJOB_PLURAL}")
        for _ in range(5):
            response = pool.request("POST", url, body=json.dumps(manifest).encode(),
                                    headers=headers, retries=False)
            if response.status < 300 or response.status == 409:
                break
            if response.status == 422:  # invalid: no retry will help
                raise RuntimeError(f"GpuJob refused: {response.data[:500]!r}")
            time.sleep(0.5)
        else:
            raise RuntimeError(f"creating a GpuJob failed: {response.status} "
                               f"{response.data[:300]!r}")
        key = f"{meta['namespace']}/{meta['name']}"
        created[key] = time.time()
        if response.status < 300:  # the server's creation time: the job's submitTime
            submitted[key] = epoch_seconds(
                json.loads(response.data)["metadata"]["creationTimestamp"]) or created[key]

    def create_all() -> tuple[float, float]:
        first = time.time()

        def paced(item: tuple[int, dict[str, Any]]) -> None:
            if args.arrival_rate > 0:  # job i is created at first + i / rate, not sooner
                time.sleep(max(0.0, first + item[0] / args.arrival_rate - time.time()))
            create(item[1])

        with ThreadPoolExecutor(max_workers=args.create_workers) as workers:
            list(workers.map(paced, enumerate(manifests)))
        print(f"created {len(manifests)} GpuJobs in {time.time() - first:.1f}s",
              file=sys.stderr)
        return first, time.time() - first

    ceiling = (_api_ceiling(api, projects[0], args.ceiling,
                            _component_pids(args.cluster).get("kube-apiserver"))
               if args.ceiling else {})
    if args.create_first:
        _, created_s = create_all()
    metrics_port = stack.free_port()
    env = {"CARPOOL_RESYNC_SECONDS": "5", "CARPOOL_METRICS_PORT": str(metrics_port)}
    paused: list[int] = []
    if args.pause_scheduler:
        scheduler = _component_pids(args.cluster).get("kube-scheduler")
        if scheduler is not None:
            paused.append(scheduler)
            _signal_scheduler(paused, signal.SIGSTOP)
    try:
        with stack.running_stack(cluster, log_dir, env) as processes:
            operator_start = time.time()
            operator_pid = processes["operator"].pid
            pids = {**_component_pids(args.cluster), "operator": operator_pid,
                    "extender": processes["extender"].pid, "bench (this client)": os.getpid()}
            cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
            requests_before = _api_requests(api)
            tracker = Tracker(cluster.api())
            # bench/peers.py counts admissions as the API server stores them, with no watch
            # of every job to fall behind the operator (`carpool_testbed.stored`)
            stop = stored.IdleStop(sum(job_pods(m) for m in manifests),
                                   args.idle_stop or stored.default_idle_stop(len(manifests)),
                                   time.monotonic()) if args.stop_when_admitted else None
            if stop is None:
                tracker.start()
            rss_samples: list[int] = []
            sampling = threading.Event()

            def sample_rss() -> None:
                while not sampling.is_set():
                    try:
                        rss_samples.append(_rss_kib(operator_pid, "VmRSS"))
                    except OSError:
                        return
                    time.sleep(1.0)

            threading.Thread(target=sample_rss, daemon=True).start()
            if args.create_first:
                t0 = operator_start
            else:
                time.sleep(3)  # let the operator win its lease and list
                t0, created_s = create_all()

            deadline = time.monotonic() + args.timeout
            last_count, last_change = -1, time.monotonic()
            while time.monotonic() < deadline:
                if stop is not None:
                    pods = stored.pods_in(api, projects)
                    print(f"  t+{time.time() - t0:5.0f}s pods of admitted jobs {pods}/"
                          f"{stop.target}  rss {rss_samples[-1] // 1024 if rss_samples else 0}"
                          " MiB", file=sys.stderr)
                    if stop.done(pods, time.monotonic()):
                        break
                    time.sleep(5)
                    continue
                with tracker.lock:
                    admitted, startedn = len(tracker.admitted), len(tracker.started)
                    finishedn = len(tracker.finished)
                print(f"  t+{time.time() - t0:5.0f}s admitted {admitted}/{len(manifests)} "
                      f"started {startedn} finished {finishedn}  "
                      f"rss {rss_samples[-1] // 1024 if rss_samples else 0} MiB", file=sys.stderr)
                if admitted != last_count:
                    last_count, last_change = admitted, time.monotonic()
                if paused and not args.hold_scheduler and (
                        admitted >= len(manifests) or time.monotonic() - last_change > 15):
                    _signal_scheduler(paused, signal.SIGCONT)  # the burst is over
                    paused.clear()
                    print("  kube-scheduler resumed", file=sys.stderr)
                if startedn >= len(manifests) and (
                        not args.drain or finishedn >= len(manifests)):
                    break
                time.sleep(5)
            peak_kib = _rss_kib(operator_pid, "VmHWM")
            operator_scores = _operator_eta_scores(metrics_port)
            window = time.time() - operator_start
            cpu_seconds = {name: _cpu_seconds(pid) - cpu_before[name]
                           for name, pid in pids.items()}
            rss_mib = component_rss_mib(pids)
            cpu = {name: seconds / window for name, seconds in cpu_seconds.items()}
            requests_after = _api_requests(api)
            requests = {k: (v - requests_before.get(k, 0.0)) / window
                        for k, v in requests_after.items() if v > requests_before.get(k, 0.0)}
            sampling.set()
            tracker.stop.set()
            with tracker.lock:
                admitted_at = dict(tracker.admitted)
                estimates = dict(tracker.first_estimate)
                ranges = dict(tracker.first_range)
                starts = dict(tracker.started)
                first_starts = dict(tracker.first_started)
                finished = len(tracker.finished)
                waited = set(tracker.waited)
                reasons = dict(tracker.reasons)
            if stop is not None:  # each job's last pod's creation, as stored
                admitted_at = stored.admitted_by(stored.pods_created(
                    (pod for project in projects for pod in stored.list_items(
                        api, f"/api/v1/namespaces/{project}/pods", metadata_only=True)),
                    names.LABEL_JOB), operator_start + window)
            bound: dict[str, list[bool]] = {}
            if paused and args.then_schedule:  # the admissions are counted: now start them
                _signal_scheduler(paused, signal.SIGCONT)
                paused.clear()
                bound = bound_when_settled(api, projects, names.LABEL_JOB, args.then_schedule)
            operator_log = log_dir / "operator.log"
            log_lines = operator_log.read_text(errors="replace").splitlines()
            failures = sum(1 for line in log_lines if "reconcile pass failed" in line)
            pass_seconds = [sum(float(x) for x in m.groups()) for line in log_lines
                            if (m := PASS_LINE.search(line))]

    finally:
        _signal_scheduler(paused, signal.SIGCONT)  # never leave the scheduler stopped

    # only this run's jobs (a namespace of an earlier run may still be terminating)
    admitted_at = {k: v for k, v in admitted_at.items() if k in created}
    starts = {k: v for k, v in starts.items() if k in created}
    latencies = [admitted_at[k] - max(created[k], t0) for k in admitted_at]
    times = sorted(admitted_at.values())
    # the initial burst: admissions of jobs that never had to wait
    burst = sorted(admitted_at[k] for k in admitted_at if k not in waited)
    burst_rate = len(burst) / max(1e-9, burst[-1] - t0) if burst else 0.0
    # sustained: the middle 80 % of the burst's admissions, without the start-up before the
    # first (process start, lease, lists, the first decision) and the tail after the last
    low, high = (burst[len(burst) // 10], burst[len(burst) * 9 // 10]) if burst else (0, 0)
    sustained_rate = (len(burst) * 9 // 10 - len(burst) // 10) / (high - low) \
        if high > low else 0.0
    total_rate = len(times) / max(1e-9, times[-1] - t0) if times else 0.0
    errors = [abs(starts[k] - estimates[k]) for k in estimates if k in starts]
    # the error in two parts: estimate -> the watch showing it Admitted (the queue's own
    # forecast, and pass timing), Admitted -> the pod running (scheduling and pod start)
    to_admit = [admitted_at[k] - estimates[k] for k in estimates
                if k in starts and k in admitted_at]
    to_start = [starts[k] - admitted_at[k] for k in estimates
                if k in starts and k in admitted_at]
    # the measures, by the replay's rule; a job arrives when the API server created
    # it, as its status.submitTime says (or when the operator started, if later: no
    # estimate could be shown before)
    samples = {k: (max(submitted.get(k, created[k]), t0), first_starts[k],
                   Estimate(estimates[k], *ranges.get(k, (None, None)))
                   if k in estimates else None)
               for k in first_starts if k in created}
    first = first_estimate_errors(samples.values())
    scores = [score_first_estimate(arrival, start, e.start, e.low, e.high)
              for arrival, start, e in samples.values() if e is not None]
    first["jobs_within_20pct"] = sum(1 for x in scores
                                     if x.relative is not None and x.relative <= 0.2)
    classes = {f"{m['metadata']['namespace']}/{m['metadata']['name']}": m["spec"]["class"]
               for m in manifests}
    first_by_class = {c: first_estimate_errors(s for k, s in samples.items() if classes[k] == c)
                      for c in sorted(set(classes.values()))}
    with (log_dir / "first_estimates.jsonl").open("w") as out:  # one line per job, to dig in
        for k, (arrival, start, estimate) in sorted(samples.items()):
            out.write(json.dumps({"job": k, "class": classes[k], "arrival": arrival,
                                  "start": start, "estimate": estimate and estimate.start,
                                  "low": estimate and estimate.low,
                                  "high": estimate and estimate.high}) + "\n")
    result = {
        "jobs": len(manifests), "create_first": args.create_first,
        "scheduler_paused": args.pause_scheduler,
        "projects": args.projects, "nodes": args.nodes,
        "gpus": gpus, "created_s": created_s, "admitted": len(admitted_at),
        "gpus_admitted": sum(job_gpus(m) for m in manifests
                             if f"{m['metadata']['namespace']}/{m['metadata']['name']}"
                             in admitted_at),
        "burst_admitted": len(burst), "burst_rate": burst_rate, "total_rate": total_rate,
        "sustained_rate": sustained_rate,
        "first_admission_s": (times[0] - t0) if times else None,
        "p50": _percentile(latencies, 0.5), "p99": _percentile(latencies, 0.99),
        "peak_rss_mib": peak_kib / 1024,
        "eta_jobs": len(errors), "eta_mae": statistics.median(errors) if errors else None,
        "eta_admit_minus_estimate_p50": statistics.median(to_admit) if to_admit else None,
        "eta_start_minus_admit_p50": statistics.median(to_start) if to_start else None,
        "eta_first": first, "eta_first_by_class": first_by_class,
        "eta_first_operator_metrics": operator_scores,
        "user_estimates": args.user_estimates, "templates": args.templates,
        "arrival_rate": args.arrival_rate,
        "started": len(starts), "finished": finished, "wait_reasons": reasons, "log": str(log_dir),
        "pass_failures": failures, "passes": len(pass_seconds),
        "pass_p50_s": _percentile(pass_seconds, 0.5), "pass_max_s": max(pass_seconds, default=0),
        "window_s": window, "api_ceiling": ceiling,
        "cpu_cores": {k: round(v, 2) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
        "api_writes_per_s": {k: round(v, 1) for k, v in
                             sorted(requests.items(), key=lambda kv: -kv[1]) if v >= 0.5},
        # for bench/peers.py, which summarises Kueue's rounds the same way; not printed
        "_raw": {"admitted_at": admitted_at, "t0": t0, "cpu_seconds": cpu_seconds,
                 "bound": bound,
                 "requests_before": requests_before, "requests_after": requests_after,
                 "rss_mib": rss_mib},
    }
    if args.delete_cluster:
        devcluster.delete(devcluster.ClusterPaths.for_name(args.cluster), cluster.bin_dir)
    else:
        unfinalize(api, projects)  # the operator is gone: its finalizers would hold them
        for project in projects:
            core.delete_namespace(project)
            custom.delete_cluster_custom_object(names.GROUP, names.VERSION,
                                                names.PROJECTQUOTA_PLURAL, project)
        simnodes.delete_nodes(api, [n.name for n in nodes])
    return result


def unfinalize(api: Any, namespaces: list[str]) -> None:
    """Take Carpool's finalizer off every pod (and any GpuJob an earlier release put it on) in
    these namespaces, once the operator has stopped, so deleting the namespaces deletes them
    instead of leaving them, and their namespaces, terminating for the next run to meet."""
    pool = api.rest_client.pool_manager
    host = api.configuration.host
    headers = {"Content-Type": "application/merge-patch+json", "Accept": "application/json"}
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    paths = [f"{host}/apis/{names.GROUP}/{names.VERSION}/namespaces/{namespace}/"
             f"{names.GPUJOB_PLURAL}/{job['metadata']['name']}" for namespace in namespaces
             for job in custom.list_namespaced_custom_object(
                 names.GROUP, names.VERSION, namespace, names.GPUJOB_PLURAL)["items"]
             if job["metadata"].get("finalizers")]
    paths += [f"{host}/api/v1/namespaces/{namespace}/pods/{pod.metadata.name}"
              for namespace in namespaces for pod in core.list_namespaced_pod(namespace).items
              if names.FINALIZER in (pod.metadata.finalizers or ())]

    def patch(path: str) -> None:
        pool.request("PATCH", path, body=b'{"metadata":{"finalizers":null}}', headers=headers,
                     retries=False)

    with ThreadPoolExecutor(max_workers=8) as workers:
        list(workers.map(patch, paths))


def _operator_eta_scores(port: int) -> dict[str, float]:
    """What the operator's own `carpool_eta_*` metrics counted over the run, summed over the
    classes: the jobs scored (waited >= 60 s, shown a first estimate), those within 20 %, and
    where their first start fell against the first range. They score by the rule the bench
    applies (`eta_accuracy.score_first_estimate`) from the same times (submitTime, the first
    estimate and range, startTime), so the two agree."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = {
                "carpool_eta_first_estimate_relative_error_count": "scored",
                "carpool_eta_first_estimate_relative_error_bucket":
                    "within_20pct" if sample.labels.get("le") == "0.2" else "",
                "carpool_eta_first_range_total": f"range_{sample.labels.get('result')}",
            }.get(sample.name, "")
            if key:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _operator_metrics_row(scores: dict[str, float], first: dict[str, Any]) -> str:
    ranged = sum(v for k, v in scores.items() if k.startswith("range_"))
    covered = first.get("eta_interval_coverage")
    return (f"{scores.get('scored', 0):.0f} scored ({first.get('jobs_waited_60s_with_estimate')}),"
            f" {scores.get('within_20pct', 0):.0f} within 20 % "
            f"({first.get('jobs_within_20pct')}), range inside / before / after "
            f"{scores.get('range_inside', 0):.0f} / {scores.get('range_before', 0):.0f} / "
            f"{scores.get('range_after', 0):.0f} of {ranged:.0f} "
            f"({round(covered * first['eta_ranged_jobs']) if covered is not None else 0} of "
            f"{first.get('eta_ranged_jobs') or 0} inside)")


def _first_estimate_row(first: dict[str, Any]) -> str:
    if first.get("eta_median_abs_rel_error") is None:
        return "-"
    coverage = (f"{first['eta_interval_coverage']:.0%} of {first['eta_ranged_jobs']} shown a range"
                if first.get("eta_interval_coverage") is not None else "no range shown")
    return (f"{first['eta_median_abs_rel_error']:.0%} / {first['eta_p90_abs_rel_error']:.0%}, "
            f"{first['eta_median_signed_rel_error']:+.0%}, {coverage} "
            f"({first['jobs_waited_60s_with_estimate']} of {first['jobs_waited_60s']} jobs "
            "that waited >= 60 s were shown an estimate)")


def table(result: dict[str, Any]) -> str:
    eta = (f"{result['eta_mae']:.1f} s over {result['eta_jobs']} jobs that waited"
           if result["eta_mae"] is not None else "n/a (no job waited)")
    if result.get("eta_admit_minus_estimate_p50") is not None:
        eta += (f" (median signed: Admitted - estimate "
                f"{result['eta_admit_minus_estimate_p50']:+.1f} s, running - Admitted "
                f"{result['eta_start_minus_admit_p50']:+.1f} s)")
    rows = [
        ("GpuJobs / projects / simulated nodes (GPUs)",
         f"{result['jobs']} / {result['projects']} / {result['nodes']} ({result['gpus']})"),
        ("created by the bench in", f"{result['created_s']:.1f} s"
         + (" (before the operator started)" if result.get("create_first") else "")),
        ("admissions/s, initial burst (jobs that never waited)",
         f"{result['burst_rate']:.1f} ({result['burst_admitted']} jobs)"),
        ("admissions/s, sustained (middle 80 % of the burst's admissions)",
         f"{result['sustained_rate']:.1f}"),
        ("first admission after the operator started / the first job created",
         f"{result['first_admission_s']:.1f} s" if result["first_admission_s"] is not None
         else "-"),
        ("admissions/s, whole run", f"{result['total_rate']:.1f} ({result['admitted']} jobs)"),
        ("creation (or operator start, if later) -> Admitted p50 / p99"
         if result.get("create_first") else "creation -> Admitted p50 / p99",
         f"{result['p50']:.1f} s / {result['p99']:.1f} s"),
        ("operator peak RSS (VmHWM)", f"{result['peak_rss_mib']:.0f} MiB "
         f"(read when {result.get('finished', 0)} jobs had finished)"),
        ("estimated vs actual start, median abs. error", eta),
        ("first estimate, waited >= 60 s: median / P90 |error| / wait, signed, in range",
         _first_estimate_row(result.get("eta_first") or {})),
        *((f"  {c} jobs", _first_estimate_row(errors))
          for c, errors in (result.get("eta_first_by_class") or {}).items()
          if errors.get("jobs_waited_60s")),
        ("the operator's carpool_eta_* metrics (the bench's own count)",
         _operator_metrics_row(result.get("eta_first_operator_metrics") or {},
                               result.get("eta_first") or {})),
        ("first estimate, waited < 60 s: median abs. error",
         f"{first['eta_short_wait_median_abs_error_s']:.1f} s over "
         f"{first['eta_short_wait_jobs']} jobs"
         if (first := result.get("eta_first") or {}).get("eta_short_wait_median_abs_error_s")
         is not None else "-"),
        ("jobs' estimatedDuration / templates / arrivals",
         f"{result.get('user_estimates', 'exact')} / {result.get('templates') or 'none'} / "
         + (f"{result['arrival_rate']:g} per s" if result.get("arrival_rate") else "a burst")),
        ("operator reconcile passes: count, p50 / max seconds",
         f"{result['passes']}, {result['pass_p50_s']:.2f} / {result['pass_max_s']:.2f}"),
        ("why jobs waited (first reason seen)",
         ", ".join(f"{k} {v}" for k, v in sorted(result["wait_reasons"].items())) or "-"),
    ]
    rows.append(("CPU cores used, operator start to end (2 = the whole machine)",
                 ", ".join(f"{k} {v:.2f}" for k, v in result["cpu_cores"].items())))
    rows.append(("API writes/s over the same window (all clients)",
                 ", ".join(f"{k} {v:.0f}"
                           for k, v in list(result["api_writes_per_s"].items())[:8])))
    if result.get("api_ceiling"):
        ceiling = result["api_ceiling"]
        rows.append(("API server alone, before the run (16 threads, writes/s)",
                     ", ".join(f"{k.removesuffix('_per_s').replace('_', ' ')} {v:.0f}"
                               for k, v in ceiling.items() if k.endswith("_per_s"))))
        rows.append(("API server CPU ms per write (same writes)",
                     ", ".join(f"{k.removesuffix('_cpu_ms').replace('_', ' ')} {v:.2f}"
                               for k, v in ceiling.items() if k.endswith("_cpu_ms"))))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def write_doc(path: Path, result: dict[str, Any], command: str, notes: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    machine = f"{os.cpu_count()} CPUs"
    section = (f"{SECTION}\n\n`{command}` on {machine}.\n\n{table(result)}\n\n{notes}\n")
    if SECTION in text:
        start = text.index(SECTION)
        following = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[following + 1:] if following >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--projects", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--cluster", default="carpool-bench-admission")
    parser.add_argument("--extender-port", type=int, default=18160)
    parser.add_argument("--create-workers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--drain", action="store_true",
                        help="follow the run until every job has finished, not only started "
                             "(the operator's peak RSS then includes every finished status)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--delete-cluster", action="store_true")
    parser.add_argument("--pause-scheduler", action="store_true",
                        help="stop kube-scheduler (SIGSTOP) until the admission burst is over:"
                        " the operator's admission path alone, without scheduling and"
                        " simulated pods competing for the same CPUs")
    parser.add_argument("--none-preemptible", action="store_true",
                        help="no job is preemptible (bench/peers.py: Kueue's jobs there share "
                             "one priority, so neither system preempts)")
    parser.add_argument("--hold-scheduler", action="store_true",
                        help="with --pause-scheduler, keep kube-scheduler stopped to the end "
                             "(bench/peers.py: no job starts, ends and frees GPUs while the "
                             "admissions are counted, as in Kueue's rounds)")
    parser.add_argument("--then-schedule", type=float, default=0.0, metavar="S",
                        help="with --hold-scheduler, once the admissions are counted let "
                             "kube-scheduler run until it binds nothing more (S seconds at "
                             "most) and record which pods of each job are bound "
                             "(bench/peers.py counts partial gang starts from it); every job "
                             "runs S seconds longer, so none ends and frees GPUs meanwhile")
    parser.add_argument("--ceiling", type=int, default=0, metavar="N",
                        help="first measure the API server alone with N pod creates and N "
                        "GpuJob status patches")
    parser.add_argument("--create-first", action="store_true",
                        help="create every GpuJob before the operator starts")
    parser.add_argument("--gang-share", type=float, default=0.0,
                        help="this share of the jobs are gangs of 2-16 workers of whole GPUs, "
                             "each in one rack (required or preferred): `gang_shapes`")
    parser.add_argument("--exclusive", action="store_true",
                        help="whole-GPU jobs (isolation exclusive) instead of MPS shares")
    parser.add_argument("--user-estimates", choices=("exact", "realistic"), default="exact",
                        help="each job's estimatedDuration: its simulated run time (exact), or "
                        "drawn from it as users estimate (realistic: mostly over, by up to "
                        "10x, some under, rounded up to round values; seeded by --seed)")
    parser.add_argument("--templates", type=int, default=0, metavar="N",
                        help="jobs come from N templates (repeating name stems) with their own "
                        "typical run times; 0: every job is j<i>, 40-120 s uniformly")
    parser.add_argument("--arrival-rate", type=float, default=0.0, metavar="JOBS_PER_S",
                        help="create the jobs at this rate (0: as fast as the bench can)")
    parser.add_argument("--write-doc", type=Path)
    parser.add_argument("--notes", default="")
    parser.add_argument("--stop-when-admitted", action="store_true",
                        help="count admissions as the API server stores them, not by this "
                             "bench's watch (which falls minutes behind the operator with "
                             "50,000 GpuJobs on a loaded machine): end the run once every "
                             "job's pods exist, or their count has not grown for --idle-stop "
                             "seconds; admission times are the pods' creation, listed at the "
                             "end (`carpool_testbed.stored`)")
    parser.add_argument("--idle-stop", type=float, default=0.0, metavar="S",
                        help="with --stop-when-admitted: seconds without a new pod that end "
                             "the run (0: `stored.default_idle_stop`, 20 s, 100 s at 50,000 "
                             "jobs)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    # SIGTERM (timeout, a CI cancel) unwinds like Ctrl-C, so the operator and extender stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    result.pop("_raw")
    print(json.dumps(result, indent=1))
    print(table(result))
    if args.write_doc:
        command = ".venv/bin/python bench/admission.py " + " ".join(sys.argv[1:])
        write_doc(args.write_doc, result, command, args.notes)


if __name__ == "__main__":
    main()
