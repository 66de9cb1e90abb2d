"""Kueue and Carpool side by side: the same one-GPU jobs, the same cluster, one invocation.

Kueue (sigs.k8s.io/kueue v0.17.0, built by hack/build-kueue.sh from the Go module proxy) runs
as a host process against the devcluster's API server, with its controllers, its admission
and conversion webhooks and its internal certificate management, configured as its manifests
ship it (`config/components/manager/controller_manager_config.yaml`: client QPS 50, burst
100, `--zap-log-level=2`) except for what a host process needs: webhook server, health probe
on loopback ports, metrics and the visibility API off, no leader election (one replica).

How the API server reaches a Kueue on the host: its webhook configurations name the Service
`kueue-webhook-service` in `kueue-system`, as shipped; that Service is of type ExternalName
with `externalName: localhost`. kube-apiserver's default service resolver sends a webhook
call for an ExternalName Service to `https://<externalName>:<port>`, and checks the TLS
certificate against the Service's DNS name (`kueue-webhook-service.kueue-system.svc`), which is
what Kueue's internal certificate names. (Endpoints or EndpointSlices cannot point at a
loopback address, so a Service with manual endpoints does not work here.)

Each round, for one system: `--nodes` KWOK nodes of 8 GPUs, 20 projects (Carpool:
ProjectQuotas of nodes x 8 / 20 GPUs with borrowing; Kueue: one ClusterQueue each with that
nominal quota of `nvidia.com/gpu`, all in one cohort, borrowing unlimited, a LocalQueue in the
project's namespace), `--jobs` one-GPU jobs (Carpool: GpuJobs with isolation exclusive; Kueue:
batch/v1 Jobs, suspended, in the project's LocalQueue), all created before the controller
starts, so the rates are the controller's and not the bench client's. With `--gang-share S`
that share of the jobs are gangs (`admission.gang_shapes`: 2-16 workers of 1-8 whole GPUs, in
one rack, required or preferred; the same gangs for both): Carpool's are GpuJobs with
spec.workers and spec.topology, Kueue's are Jobs of one pod per worker with Topology Aware
Scheduling (a Topology of block, rack and host on the nodes' labels, the flavor naming it, the
pods' podset-required/preferred-topology annotation naming the rack). kube-scheduler is
stopped until the burst is over (both: the admission path alone). Rounds alternate
Kueue, Carpool, Kueue, ... (the first system swaps each pair).

Both rounds are counted as the API server stores them, not by a watch of this bench's own
(which falls minutes behind with 50,000 jobs on a loaded machine; `carpool_testbed.stored`):
a round ends once the admitted jobs have not grown for `--idle-stop` seconds (or all are
admitted, or the window is over), counted as Carpool's jobs' pods in the projects'
namespaces and as Kueue's admitted Workloads, and the admission times are read by a
paginated LIST at its end: a Workload's Admitted condition (Kueue's clock when it admitted),
a GpuJob's pods' creation (the operator creates them, then writes Admitted).

Prints per system and round: admissions/s (burst: admitted / seconds from the controller's
start to the last admission; sustained: the middle 80 % of the admissions), creation (the
controller's start) -> admitted p50/p99 (to the second), the share of the cluster's GPUs
the admitted jobs hold when admissions stop (utilization), API writes per admission (the API
server's apiserver_request_total, every write of every client, from the controller's start
to the end of the round), CPU seconds per process per 1,000 admissions, each process's resident
memory at the end of the round (and its peak), and the medians' ratios.
With `--then-schedule S` kube-scheduler then runs, the controllers still up, until it has
bound nothing for 15 s (S seconds at most), and the gangs with some but not all of their
workers bound are counted (partial starts).

    PYTHONSAFEPATH=1 .venv/bin/python bench/peers.py [--jobs 5000] [--nodes 625] [--rounds 2]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from carpool.core.topology import TOPOLOGY_LABELS, TopologyLevel
from carpool_testbed import crds, devcluster, simnodes, stored
from carpool_testbed.scripts import load_script

HERE = Path(__file__).resolve().parent
KUEUE_NS = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
GPU = "nvidia.com/gpu"
KUEUE_SHIPPED_QPS, KUEUE_SHIPPED_BURST = 50, 100  # controller_manager_config.yaml
WEBHOOK_NAMES = ("kueue-mutating-webhook-configuration", "kueue-validating-webhook-configuration")
CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
RACK_LABEL = TOPOLOGY_LABELS[TopologyLevel.RACK]
BLOCK_LABEL = TOPOLOGY_LABELS[TopologyLevel.BLOCK]
FLAVOR_LABEL = "bench.carpool.dev/flavor"  # what a TAS ResourceFlavor's nodeLabels select
BACKGROUND = ("leases", "nodes")  # node heartbeats and leader leases: not per admission
SELECTED = ("mpod.kb.io", "mdeployment.kb.io", "mstatefulset.kb.io", "vpod.kb.io",
            "vdeployment.kb.io", "vstatefulset.kb.io")


admission = load_script(HERE / "admission.py")  # Carpool's side of the round


def kueue_home() -> Path:
    """Build (once, cached) and return the folder with `kueue` and `config/`."""
    built = subprocess.run(["bash", str(HERE.parent / "hack" / "build-kueue.sh")],
                           check=True, capture_output=True, text=True)
    return Path(built.stdout.strip().splitlines()[-1])


def _kubectl_apply(cluster: devcluster.Cluster, docs: list[dict[str, Any]]) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    stdin="\n---\n".join(yaml.safe_dump(d) for d in docs), timeout=180)


def install_kueue_api(cluster: devcluster.Cluster, home: Path, port: int) -> None:
    """CRDs (with the conversion webhook the shipped kustomization patches in), the
    namespace, the certificate Secret and the ExternalName Service; idempotent."""
    service_ref = {"namespace": KUEUE_NS, "name": WEBHOOK_SERVICE, "port": port}
    crds = []
    for path in sorted((home / "config").glob("kueue.x-k8s.io_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": {"service": {**service_ref, "path": "/convert"}},
                "conversionReviewVersions": ["v1"]}}
        crds.append(crd)
    _kubectl_apply(cluster, crds)
    _kubectl_apply(cluster, [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NS}},
        # the shipped empty Secret that Kueue's certificate rotator fills
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": "kueue-webhook-server-cert", "namespace": KUEUE_NS}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": WEBHOOK_SERVICE, "namespace": KUEUE_NS},
         "spec": {"type": "ExternalName", "externalName": "localhost",
                  "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}}])
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=120s",
                    *[f"crd/{c['metadata']['name']}" for c in crds])


def webhook_configurations(home: Path, port: int) -> list[dict[str, Any]]:
    """The shipped webhook configurations, named and pointed as the kustomization does
    (prefix `kueue-`, namespace kueue-system, pods/deployments/statefulsets outside
    kube-system and kueue-system), with the Service's port."""
    out = []
    not_system = {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                                        "operator": "NotIn",
                                        "values": ["kube-system", KUEUE_NS]}]}
    for doc in yaml.safe_load_all((home / "config" / "webhook-manifests.yaml").read_text()):
        if not doc:
            continue
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            hook["clientConfig"]["service"].update(
                {"name": WEBHOOK_SERVICE, "namespace": KUEUE_NS, "port": port})
            if hook["name"] in SELECTED:
                hook["namespaceSelector"] = not_system
        out.append(doc)
    return out


def kueue_config(port: int, qps: int, burst: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": KUEUE_NS,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{port + 1}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": WEBHOOK_SERVICE,
                                   "webhookSecretName": "kueue-webhook-server-cert"},
        "controller": {"groupKindConcurrency": {
            "Job.batch": 5, "Pod": 5, "Workload.kueue.x-k8s.io": 5,
            "LocalQueue.kueue.x-k8s.io": 1, "Cohort.kueue.x-k8s.io": 1,
            "ClusterQueue.kueue.x-k8s.io": 1, "ResourceFlavor.kueue.x-k8s.io": 1}},
        "clientConnection": {"qps": qps, "burst": burst},
        "integrations": {"frameworks": ["batch/job"]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def _job_manifest(namespace: str, name: str, seconds: int, gang: Any = None
                  ) -> dict[str, Any]:
    """A one-GPU Job, or for a gang (`admission.GangShape`) a Job of one pod per worker with
    the worker's GPUs, in one rack as Kueue's Topology Aware Scheduling is asked to."""
    pods, gpus = (gang.workers, gang.gpus) if gang is not None else (1, 1)
    annotations = {"carpool.dev/simulated-duration": str(seconds)}
    if gang is not None:
        kind = "required" if gang.required else "preferred"
        annotations[f"kueue.x-k8s.io/podset-{kind}-topology"] = RACK_LABEL
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kueue.x-k8s.io/queue-name": "jobs"}},
        "spec": {"suspend": True, "parallelism": pods, "completions": pods, "backoffLimit": 0,
                 "template": {
                     "metadata": {"annotations": annotations},
                     "spec": {"restartPolicy": "Never", "containers": [{
                         "name": "main", "image": "work",
                         "resources": {"requests": {GPU: str(gpus)},
                                       "limits": {GPU: str(gpus)}}}]}}},
    }


def partial_starts(bound: dict[str, list[bool]], gangs: dict[int, Any]) -> dict[str, int]:
    """Of the gangs with a pod bound, how many have some but not all of their workers bound
    (`admission.bound_pods`, keyed `<namespace>/j<i>`)."""
    started = partial = 0
    for key, flags in bound.items():
        index = int(key.rsplit("/j", 1)[1])
        if index not in gangs or not any(flags):
            continue
        started += 1
        partial += sum(flags) < gangs[index].workers
    return {"gangs_started": started, "partial_starts": partial}


def job_gpus(jobs: int, gangs: dict[int, Any]) -> dict[str, int]:
    """GPUs each job of the generated workload holds once admitted, by name (`j<i>`)."""
    return {f"j{i}": gangs[i].workers * gangs[i].gpus if i in gangs else 1
            for i in range(jobs)}


@contextlib.contextmanager
def kueue_running(cluster: devcluster.Cluster, home: Path, port: int, qps: int, burst: int,
                  log: Path) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """Webhook configurations applied, Kueue started (the process and its start time);
    both gone after the block."""
    config_dir = Path(tempfile.mkdtemp(prefix="carpool-bench-kueue-"))
    config = config_dir / "config.yaml"
    config.write_text(yaml.safe_dump(kueue_config(port, qps, burst, config_dir / "certs")))
    _kubectl_apply(cluster, webhook_configurations(home, port))
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    started = time.time()
    with log.open("wb") as out:
        process = subprocess.Popen([str(home / "kueue"), f"--config={config}",
                                    "--zap-log-level=2"], stdout=out, stderr=subprocess.STDOUT,
                                   env=env)
    try:
        mount_certificates(cluster, config_dir / "certs", process)
        yield process, started
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for name in WEBHOOK_NAMES:  # failurePolicy Fail: none may outlive Kueue
            kind = "mutatingwebhookconfiguration" if "mutating" in name else \
                "validatingwebhookconfiguration"
            cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)


def mount_certificates(cluster: devcluster.Cluster, cert_dir: Path,
                       process: subprocess.Popen[bytes], limit_s: float = 60) -> None:
    """Do what the kubelet's Secret volume does for Kueue's pod: once the certificate
    rotator has filled the Secret, its keys become files in the webhook's certificate
    folder (the rotator waits for them there before Kueue starts its controllers)."""
    core = client.CoreV1Api(cluster.api())
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and process.poll() is None:
        secret = core.read_namespaced_secret("kueue-webhook-server-cert", KUEUE_NS)
        data = secret.data or {}
        if "tls.crt" in data and "tls.key" in data:
            cert_dir.mkdir(parents=True, exist_ok=True)
            for key, value in data.items():
                (cert_dir / key).write_bytes(base64.b64decode(value))
            return
        time.sleep(0.5)
    raise RuntimeError("Kueue's certificate Secret was not filled in time")


def run_kueue(args: argparse.Namespace, cluster: devcluster.Cluster, home: Path,
              round_no: int, qps: int, burst: int) -> dict[str, Any]:
    api = cluster.api()
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    tag = f"k{int(time.time()) % 100000}"
    model = f"BENCH{tag}"
    nodes = simnodes.parse_nodes({"nodes": [{
        "name": f"bench-{tag}-n{i}", "zone": "zone-a", "sharing": "mps",
        "labels": {**admission.topology_labels(i), FLAVOR_LABEL: tag},
        "gpus": [{"model": model, "count": 8, "memoryTotalMiB": 141 * 1024}]}
        for i in range(args.nodes)]})
    # with the NVIDIA device plugin's resource, for Kueue's pods
    nodes = [dataclasses.replace(n, extra_resources=((GPU, "8"),)) for n in nodes]
    crds.apply_crds(api)  # the GpuNodes of the simulated nodes need them
    started = time.monotonic()
    simnodes.apply_nodes(api, nodes)
    print(f"  {len(nodes)} nodes in {time.monotonic() - started:.1f}s", file=sys.stderr)
    gpus = args.nodes * 8
    projects = [f"bench-{tag}-p{i}" for i in range(args.projects)]
    cohort = f"bench-{tag}"
    flavor = f"bench-{tag}"
    gangs = admission.gang_shapes(args.jobs, args.gang_share, args.seed)
    flavor_spec: dict[str, Any] = {}
    if gangs:  # Topology Aware Scheduling: block, rack, host, on the flavor's nodes
        custom.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "topologies", {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "Topology",
            "metadata": {"name": flavor},
            "spec": {"levels": [{"nodeLabel": BLOCK_LABEL}, {"nodeLabel": RACK_LABEL},
                                {"nodeLabel": "kubernetes.io/hostname"}]}})
        flavor_spec = {"nodeLabels": {FLAVOR_LABEL: tag}, "topologyName": flavor}
    custom.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "resourceflavors", {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ResourceFlavor",
        "metadata": {"name": flavor}, "spec": flavor_spec})
    for project in projects:
        core.create_namespace({"metadata": {"name": project}})
        custom.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ClusterQueue",
            "metadata": {"name": project},
            "spec": {"cohortName": cohort,
                     "namespaceSelector": {"matchLabels": {
                         "kubernetes.io/metadata.name": project}},
                     "resourceGroups": [{"coveredResources": [GPU], "flavors": [{
                         "name": flavor, "resources": [{
                             "name": GPU, "nominalQuota": gpus // args.projects}]}]}]}})
        custom.create_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, project,
                                               "localqueues", {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "LocalQueue",
            "metadata": {"name": "jobs", "namespace": project},
            "spec": {"clusterQueue": project}})
    rng = admission.random.Random(args.seed)
    # (with --then-schedule no job ends, and frees GPUs, while the binds are watched)
    manifests = [_job_manifest(projects[i % len(projects)], f"j{i}",
                               rng.randint(40, 120) + round(args.then_schedule), gangs.get(i))
                 for i in range(args.jobs)]
    pool = api.rest_client.pool_manager
    headers = {"Content-Type": "application/json", "Accept": "application/json"}

    def create(manifest: dict[str, Any]) -> None:
        url = (f"{api.configuration.host}/apis/batch/v1/namespaces/"
               f"{manifest['metadata']['namespace']}/jobs")
        for _ in range(5):
            response = pool.request("POST", url, body=json.dumps(manifest).encode(),
                                    headers=headers, retries=False)
            if response.status < 300 or response.status == 409:
                return
            if response.status == 422:  # invalid: no retry will help
                break
            time.sleep(0.5)
        raise RuntimeError(f"creating a Job failed: {response.status} {response.data[:300]!r}")

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as workers:
        list(workers.map(create, manifests))
    print(f"  created {len(manifests)} Jobs in {time.monotonic() - started:.1f}s",
          file=sys.stderr)
    settle(api)  # kube-controller-manager's job controller reacts to the new Jobs first
    scheduler = admission._component_pids(args.cluster).get("kube-scheduler")
    paused = [scheduler] if scheduler is not None else []
    admission._signal_scheduler(paused, signal.SIGSTOP)
    log = Path(tempfile.mkdtemp(prefix="carpool-bench-peers-")) / f"kueue-{round_no}.log"
    try:
        with kueue_running(cluster, home, args.kueue_port, qps, burst, log) as running:
            process, t0 = running  # t0: the process's start, as for Carpool's operator
            pids = {**admission._component_pids(args.cluster), "kueue": process.pid,
                    "bench (this client)": os.getpid()}
            cpu_before = {name: admission._cpu_seconds(pid) for name, pid in pids.items()}
            cpu_before["kueue"] = 0.0  # from its start, certificates included
            requests_before = admission._api_requests(api)
            keys = [f"{m['metadata']['namespace']}/{m['metadata']['name']}" for m in manifests]

            def admitted_by(end: float) -> dict[str, float]:
                """The stored Workloads admitted by `end` (Kueue creates a job's Workload as it
                reaches the Job, so they are few; kube-controller-manager creates an admitted
                Job's pods far behind it with 50,000 Jobs, so they are not counted)."""
                return stored.admitted_by(stored.workloads_admitted(stored.list_items(
                    api, f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}/workloads")), end, keys)

            # the same stop rule as Carpool's round, on Kueue's admitted Workloads as stored
            stop = stored.IdleStop(args.jobs,
                                   args.idle_stop or stored.default_idle_stop(args.jobs),
                                   time.monotonic())
            deadline = time.monotonic() + (args.kueue_timeout or args.timeout)
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError(f"kueue exited ({process.returncode}); see {log}")
                count = len(admitted_by(time.time()))
                print(f"  kueue t+{time.time() - t0:5.0f}s admitted {count}/{stop.target}",
                      file=sys.stderr)
                if stop.done(count, time.monotonic()):
                    break
                time.sleep(5)
            window = time.time() - t0
            cpu = {name: admission._cpu_seconds(pid) - cpu_before[name]
                   for name, pid in pids.items()}
            rss = admission.component_rss_mib(pids)
            requests_after = admission._api_requests(api)
            admitted = admitted_by(t0 + window)
            bound: dict[str, list[bool]] = {}
            if args.then_schedule:  # the admissions are counted: now start them
                admission._signal_scheduler(paused, signal.SIGCONT)
                bound = admission.bound_when_settled(api, projects,
                                                     "batch.kubernetes.io/job-name",
                                                     args.then_schedule)
        system = "kueue" if qps == KUEUE_SHIPPED_QPS else f"kueue-qps{qps}"
        result = summarize(system, admitted, t0, window, cpu, requests_before, requests_after,
                           job_gpus(args.jobs, gangs), gpus)
        result.update(partial_starts(bound, gangs), log=str(log), rss_mib=rss)
        # shown before the cleanup, which takes minutes with tens of thousands of Jobs
        print(json.dumps(result), file=sys.stderr)
        cleanup_kueue(cluster, projects, flavor, [n.name for n in nodes])
    finally:
        admission._signal_scheduler(paused, signal.SIGCONT)
    return result


def _foreground_writes(api: Any) -> float:
    writes: dict[str, float] = admission._api_requests(api)
    return sum(v for k, v in writes.items() if k.split(" ")[1].split("/")[0] not in BACKGROUND)


def settle(api: Any, quiet_per_s: float = 10.0, limit_s: float = 120.0) -> None:
    """Wait until the API server takes fewer than `quiet_per_s` writes a second besides
    node heartbeats and leases."""
    deadline = time.monotonic() + limit_s
    before = _foreground_writes(api)
    while time.monotonic() < deadline:
        time.sleep(3)
        after = _foreground_writes(api)
        if (after - before) / 3 < quiet_per_s:
            return
        before = after


def cleanup_kueue(cluster: devcluster.Cluster, projects: list[str], flavor: str,
                  node_names: list[str]) -> None:
    """With Kueue stopped its finalizers stay: take them off, then delete everything."""
    api = cluster.api()
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)

    pool = api.rest_client.pool_manager
    headers = {"Content-Type": "application/merge-patch+json", "Accept": "application/json"}

    def unfinalize(item: tuple[str, str]) -> None:
        namespace, name = item  # through the pool: the generated client costs ~10 ms a call
        pool.request("PATCH", f"{api.configuration.host}/apis/{KUEUE_GROUP}/{KUEUE_VERSION}/"
                     f"namespaces/{namespace}/workloads/{name}",
                     body=b'{"metadata":{"finalizers":null}}', headers=headers, retries=False)

    for project in projects:
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(project)
    items = custom.list_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "workloads")["items"]
    with ThreadPoolExecutor(max_workers=8) as workers:
        list(workers.map(unfinalize, [(w["metadata"]["namespace"], w["metadata"]["name"])
                                      for w in items
                                      if w["metadata"]["namespace"] in set(projects)]))
    for plural, name in [*[("clusterqueues", p) for p in projects],
                         ("resourceflavors", flavor), ("topologies", flavor)]:
        with contextlib.suppress(client.ApiException):
            custom.patch_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, plural, name,
                                               {"metadata": {"finalizers": None}})
            custom.delete_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, plural, name)
    simnodes.delete_nodes(api, node_names)
    # the next round's window must not pay for this one's deletions
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        left = {n.metadata.name for n in core.list_namespace().items} & set(projects)
        if not left:
            break
        time.sleep(2)
    settle(api)


def summarize(system: str, admitted: dict[str, float], t0: float, window: float,
              cpu: dict[str, float], before: dict[str, float], after: dict[str, float],
              gpus_of: dict[str, int], capacity: int) -> dict[str, Any]:
    """One round's measures; utilization: the GPUs the admitted jobs hold (by job name,
    `job_gpus`) over the cluster's, when the admissions stopped."""
    times = sorted(admitted.values())
    held = sum(gpus_of[key.rsplit("/", 1)[-1]] for key in admitted)
    n = len(times)
    low, high = (times[n // 10], times[n * 9 // 10]) if n else (0.0, 0.0)
    writes = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    total_writes = sum(writes.values())
    background = sum(v for k, v in writes.items()
                     if k.split(" ")[1].split("/")[0] in BACKGROUND)
    return {
        "system": system, "admitted": n, "utilization": held / capacity,
        "burst_rate": n / max(1e-9, times[-1] - t0) if n else 0.0,
        "sustained_rate": (n * 9 // 10 - n // 10) / (high - low) if high > low else 0.0,
        "p50": admission._percentile([t - t0 for t in times], 0.5),
        "p99": admission._percentile([t - t0 for t in times], 0.99),
        "writes_per_admission": total_writes / max(n, 1),
        "controller_writes_per_admission": (total_writes - background) / max(n, 1),
        "writes": {k: round(v / max(n, 1), 2) for k, v in
                   sorted(writes.items(), key=lambda kv: -kv[1]) if v / max(n, 1) >= 0.05},
        "cpu_s_per_1000": {k: round(1000 * v / max(n, 1), 2) for k, v in
                           sorted(cpu.items(), key=lambda kv: -kv[1])},
        "window_s": window,
    }


def run_carpool(args: argparse.Namespace, round_no: int) -> dict[str, Any]:
    """One bench/admission.py run with the same jobs (whole GPUs), nodes and projects."""
    carpool_args = admission.build_parser().parse_args([
        "--jobs", str(args.jobs), "--nodes", str(args.nodes), "--projects",
        str(args.projects), "--cluster", args.cluster, "--extender-port",
        str(args.extender_port), "--create-first", "--pause-scheduler", "--hold-scheduler",
        "--exclusive", "--stop-when-admitted", "--idle-stop", str(args.idle_stop),
        "--timeout", str(args.timeout),
        "--seed", str(args.seed), "--gang-share", str(args.gang_share),
        "--then-schedule", str(args.then_schedule), "--none-preemptible"])
    outcome = admission.run(carpool_args)
    raw = outcome["_raw"]
    gangs = admission.gang_shapes(args.jobs, args.gang_share, args.seed)
    return summarize("carpool", raw["admitted_at"], raw["t0"], outcome["window_s"],
                     raw["cpu_seconds"], raw["requests_before"], raw["requests_after"],
                     job_gpus(args.jobs, gangs), outcome["gpus"]) | partial_starts(
        raw["bound"], gangs) | {"log": outcome["log"], "rss_mib": raw["rss_mib"],
                                "jobs": args.jobs, "passes": outcome["passes"],
                                "pass_p50_s": outcome["pass_p50_s"],
                                "pass_max_s": outcome["pass_max_s"]}


def median_row(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def report(results: list[dict[str, Any]], command: str) -> str:
    systems = list(dict.fromkeys(r["system"] for r in results))
    by = {s: [r for r in results if r["system"] == s] for s in systems}
    lines = [f"`{command}`", "",
             "| round | system | admitted | GPUs held | admissions/s burst | sustained | p50 s "
             "| p99 s | API writes / admission (without leases, nodes) "
             "| partial starts / gangs started | CPU s / 1,000 admissions (top 4) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(results):
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in list(r["cpu_s_per_1000"].items())[:4])
        lines.append(f"| {i + 1} | {r['system']} | {r['admitted']} | {r['utilization']:.1%} "
                     f"| {r['burst_rate']:.1f} "
                     f"| {r['sustained_rate']:.1f} | {r['p50']:.1f} | {r['p99']:.1f} "
                     f"| {r['writes_per_admission']:.2f} "
                     f"({r['controller_writes_per_admission']:.2f}) "
                     f"| {r['partial_starts']} / {r['gangs_started']} | {cpu} |")
    others = [s for s in systems if s != "carpool"]
    lines.append("")
    lines.append("| median | " + " | ".join(systems) + " | "
                 + " | ".join(f"Carpool / {s}" for s in others) + " |")
    lines.append("|---|" + "---:|" * (len(systems) + len(others)))
    for key, label in (("utilization", "GPUs held by admitted jobs (share)"),
                       ("burst_rate", "admissions/s, burst"),
                       ("sustained_rate", "admissions/s, sustained"),
                       ("p50", "controller start -> admitted p50 (s)"),
                       ("p99", "controller start -> admitted p99 (s)"),
                       ("writes_per_admission", "API writes per admission"),
                       ("controller_writes_per_admission",
                        "API writes per admission, without leases and nodes")):
        values = {s: median_row(by[s], key) for s in systems}
        carpool = values.get("carpool", float("nan"))
        lines.append(f"| {label} | " + " | ".join(f"{values[s]:.2f}" for s in systems) + " | "
                     + " | ".join(f"{carpool / values[s] if values[s] else float('nan'):.2f}×"
                                  for s in others) + " |")
    for r in results:
        lines.append("")
        lines.append(f"{r['system']}: writes per admission by resource: "
                     + ", ".join(f"{k} {v}" for k, v in r["writes"].items()))
        if "passes" in r:  # the operator's passes: admission, ETA refresh, status writes
            lines.append(f"{r['system']}: {r['jobs'] - r['admitted']} jobs still waiting at "
                         f"the end; {r['passes']} reconcile passes, p50 {r['pass_p50_s']:.1f} s, "
                         f"longest {r['pass_max_s']:.1f} s")
        lines.append(f"{r['system']}: RSS at the end of the round, MiB (now / peak): " + ", ".join(
            f"{k} {v} / {r['rss_mib'].get(k + ' peak', v)}" for k, v in r["rss_mib"].items()
            if not k.endswith(" peak") and not k.startswith("bench")))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=625,
                        help="KWOK nodes of 8 GPUs (625: every job fits at once)")
    parser.add_argument("--projects", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (Kueue, Carpool)")
    parser.add_argument("--only", choices=("kueue", "kueue-tuned", "carpool"),
                        help="run only this system's rounds (kueue: both of Kueue's)")
    parser.add_argument("--cluster", default="carpool-bench-peers")
    parser.add_argument("--extender-port", type=int, default=18160)
    parser.add_argument("--kueue-port", type=int, default=19443)
    parser.add_argument("--kueue-qps", type=int, default=KUEUE_SHIPPED_QPS,
                        help="Kueue's client QPS (as shipped: 50)")
    parser.add_argument("--kueue-burst", type=int, default=KUEUE_SHIPPED_BURST,
                        help="Kueue's client burst (as shipped: 100)")
    parser.add_argument("--kueue-tuned-qps", type=int, default=0, metavar="N",
                        help="each round also runs Kueue with client QPS N (burst 2N)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="a round's window at most, seconds (Carpool's: until all that "
                             "fits is admitted and nothing more comes for --idle-stop s)")
    parser.add_argument("--idle-stop", type=float, default=0.0, metavar="S",
                        help="a round ends once the admitted jobs, as the API server "
                             "stores them, have not grown for S seconds (0: "
                             "`stored.default_idle_stop`, 20 s, 100 s at 50,000 jobs)")
    parser.add_argument("--kueue-timeout", type=float, default=0, metavar="S",
                        help="Kueue's rounds' window instead (default: --timeout): its "
                             "rate over a long queue, without waiting for it to admit all")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gang-share", type=float, default=0.0,
                        help="this share of the jobs are gangs of 2-16 workers in one rack "
                             "(Kueue: Topology Aware Scheduling; `admission.gang_shapes`)")
    parser.add_argument("--then-schedule", type=float, default=0.0, metavar="S",
                        help="once a round's admissions are counted, let kube-scheduler run "
                             "until it binds nothing more (S seconds at most), then count gangs "
                             "with some but not all workers bound")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ[devcluster.EXTENDER_PORT_ENV] = str(args.extender_port)
    cluster = devcluster.up(args.cluster, port=args.extender_port,
                            progress=devcluster.Progress(sys.stderr))
    home = Path()
    if args.only != "carpool":
        home = kueue_home()
        install_kueue_api(cluster, home, args.kueue_port)
    results = []
    for round_no in range(args.rounds):
        order = ["kueue", "carpool"] if round_no % 2 == 0 else ["carpool", "kueue"]
        if args.kueue_tuned_qps:
            order.append("kueue-tuned")
        for system in order:
            if args.only and not system.startswith(args.only):
                continue
            print(f"== round {round_no + 1}: {system}", file=sys.stderr)
            if system == "carpool":
                result = run_carpool(args, round_no)
            elif system == "kueue":
                result = run_kueue(args, cluster, home, round_no, args.kueue_qps,
                                   args.kueue_burst)
            else:
                result = run_kueue(args, cluster, home, round_no, args.kueue_tuned_qps,
                                   2 * args.kueue_tuned_qps)
            if system == "carpool":
                print(json.dumps(result), file=sys.stderr)
            results.append(result)
    command = "PYTHONSAFEPATH=1 .venv/bin/python bench/peers.py " + " ".join(sys.argv[1:])
    print(report(results, command))


if __name__ == "__main__":
    main()
