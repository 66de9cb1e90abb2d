"""Operator faults: kill -9 during a long run, and two replicas at once (`make e2e`).

Runs on a cluster of its own (`carpool-e2e-faults`, extender port 18170) with its own extender
and operator processes, so killing the operator touches nothing else. Jobs are exclusive
one-GPU jobs of a few seconds (`spec.simulatedDuration`), ten projects without borrowing, so a
project's concurrent quota is its guarantee, counted in GPUs.

CARPOOL_FAULT_JOBS (default 1000) and CARPOOL_FAULT_KILLS (default 10) size the kill run;
CARPOOL_FAULT_CLUSTER and CARPOOL_FAULT_EXTENDER_PORT name another cluster and port.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from carpool.core import names
from carpool_testbed import crds, devcluster, simnodes, stack

# overridable, so that two sessions on one machine can each run it on clusters of their own
FAULT_CLUSTER = os.environ.get("CARPOOL_FAULT_CLUSTER", "carpool-e2e-faults")
FAULT_PORT = int(os.environ.get("CARPOOL_FAULT_EXTENDER_PORT", "18170"))
PROJECTS = 10
GUARANTEE = 6
Obj = dict[str, Any]


class World:
    """The faults cluster, its extender, and helpers to start and kill operators."""

    def __init__(self, cluster: devcluster.Cluster, log_dir: Path):
        self.cluster = cluster
        self.api = cluster.api()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.log_dir = log_dir
        self.operators: list[subprocess.Popen[bytes]] = []

    def start_operator(self, identity: str, log_name: str) -> subprocess.Popen[bytes]:
        process = stack.start_operator(self.cluster.kubeconfig, self.log_dir / log_name,
                                       {"CARPOOL_RESYNC_SECONDS": "2"}, identity=identity)
        self.operators.append(process)
        return process

    def lease_holder(self) -> str:
        try:
            lease = self.coordination.read_namespaced_lease("carpool-operator", "default")
        except client.ApiException:
            return ""
        return str(lease.spec.holder_identity or "")

    def setup(self, tag: str, nodes: int, gpus_per_node: int) -> list[str]:
        model = f"F{tag}"
        specs = simnodes.parse_nodes({"nodes": [{
            "name": f"f{tag}-n{i}", "zone": "zone-a", "sharing": "mps",
            "gpus": [{"model": model, "count": gpus_per_node, "memoryTotalMiB": 80 * 1024}]}
            for i in range(nodes)]})
        simnodes.apply_nodes(self.api, specs)
        projects = [f"f{tag}-p{i}" for i in range(PROJECTS)]
        for project in projects:
            self.core.create_namespace({"metadata": {"name": project}})
            self.custom.create_cluster_custom_object(
                names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, {
                    "apiVersion": names.API_VERSION, "kind": "ProjectQuota",
                    "metadata": {"name": project},
                    "spec": {"namespaces": [project], "concurrent": {"gpus": GUARANTEE}}})
        self.model = model
        return projects

    def submit(self, jobs: list[tuple[str, str, int]]) -> None:
        def create(job: tuple[str, str, int]) -> None:
            project, name, seconds = job
            body = {"apiVersion": names.API_VERSION, "kind": "GpuJob",
                    "metadata": {"name": name, "namespace": project},
                    "spec": {"project": project, "class": "short",
                             "gpu": {"count": 1, "memory": "10Gi", "isolation": "exclusive",
                                     "models": [self.model]},
                             "estimatedDuration": f"{seconds}s",
                             "simulatedDuration": f"{seconds}s",
                             "template": {"spec": {"containers": [{"name": "m",
                                                                   "image": "w"}]}}}}
            self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, project,
                                                        names.GPUJOB_PLURAL, body)

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(create, jobs))

    def jobs(self, projects: list[str]) -> list[Obj]:
        out: list[Obj] = []
        for project in projects:
            raw = self.custom.list_namespaced_custom_object(
                names.GROUP, names.VERSION, project, names.GPUJOB_PLURAL, _preload_content=False)
            out += json.loads(raw.data)["items"]
        return out

    def pods(self) -> list[Obj]:
        raw = self.core.list_pod_for_all_namespaces(
            label_selector=f"{names.LABEL_MANAGED}=true", _preload_content=False)
        return list(json.loads(raw.data)["items"])

    def stop_all(self) -> None:
        for process in self.operators:
            devcluster.stop_process(process)

    def cleanup(self, projects: list[str], tag: str) -> None:
        for project in projects:
            self.cluster.kubectl("delete", "namespace", project, "--wait=false", check=False)
            self.cluster.kubectl("delete", "projectquota", project, check=False)
        simnodes.delete_nodes(self.api, [n for n in simnodes.simulated_node_names(self.api)
                                         if n.startswith(f"f{tag}-")])


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    os.environ[devcluster.EXTENDER_PORT_ENV] = str(FAULT_PORT)
    cluster = devcluster.up(FAULT_CLUSTER, port=FAULT_PORT)
    crds.apply_crds(cluster.api())
    log_dir = Path(tempfile.mkdtemp(prefix="carpool-faults-"))
    paths = devcluster.ClusterPaths.for_name(FAULT_CLUSTER)
    devcluster.stop_extender(paths)
    extender = devcluster.start_extender(cluster.kubeconfig, FAULT_PORT,
                                         log_dir / "extender.log")
    here = World(cluster, log_dir)
    try:
        yield here
    finally:
        here.stop_all()
        devcluster.stop_process(extender)
        print(f"operator logs in {log_dir}")


def _held_gpus_by_namespace(pods: list[Obj]) -> dict[str, int]:
    """GPUs held right now per namespace: every pod not finished (terminating ones too)."""
    held: dict[str, int] = {}
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        namespace = pod["metadata"]["namespace"]
        count = int(pod["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_GPU])
        held[namespace] = held.get(namespace, 0) + count
    return held


def _leaderships(log: Path) -> int:
    """How many times an operator writing to `log` became leader."""
    if not log.is_file():
        return 0
    return log.read_text(errors="replace").count("became leader")


@pytest.mark.timeout(2400)
def test_kill_9_during_a_run_every_job_finishes_once_within_quota(world: World) -> None:
    total = int(os.environ.get("CARPOOL_FAULT_JOBS", "1000"))
    kills = int(os.environ.get("CARPOOL_FAULT_KILLS", "10"))
    rng = random.Random(7)
    tag = uuid.uuid4().hex[:5]
    projects = world.setup(tag, nodes=16, gpus_per_node=4)  # 64 GPUs, 60 guaranteed
    identity = f"faults-{tag}"
    log = world.log_dir / "operator-kills.log"
    operator = world.start_operator(identity, "operator-kills.log")
    samples: list[dict[str, int]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            started = time.monotonic()
            try:
                samples.append(_held_gpus_by_namespace(world.pods()))
            except Exception as err:  # a slow API server must not end the sampling
                print(f"sample failed: {err}")
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        jobs = [(projects[i % PROJECTS], f"j{i}", rng.randint(2, 6)) for i in range(total)]
        world.submit(jobs)
        kill_times: list[float] = []
        deadline = time.monotonic() + 1500
        # Random moments of the run, drawn as points of its progress (jobs finished, 2-50 %),
        # so all kills land before the end however fast this machine runs the jobs (pods go
        # on finishing while a restarted operator starts up); each also waits until the
        # restarted operator leads again, plus a random 0.5-4 s.
        marks = sorted(rng.sample(range(int(total * 0.02), int(total * 0.5)), kills))
        next_kill = time.monotonic() + rng.uniform(2, 6)
        while time.monotonic() < deadline:
            done = sum(1 for j in world.jobs(projects)
                       if (j.get("status") or {}).get("phase") in ("Succeeded", "Failed"))
            if done >= total:
                break
            if len(kill_times) < kills and time.monotonic() >= next_kill \
                    and done >= marks[len(kill_times)]:
                led = _leaderships(log)
                os.kill(operator.pid, signal.SIGKILL)  # no cleanup, no lease release
                operator.wait()
                kill_times.append(time.monotonic())
                print(f"kill {len(kill_times)} at {done} of {total} jobs finished")
                operator = world.start_operator(identity, "operator-kills.log")
                up_by = time.monotonic() + 180
                while _leaderships(log) <= led and time.monotonic() < up_by:
                    time.sleep(0.2)
                next_kill = time.monotonic() + rng.uniform(0.5, 4)
            time.sleep(0.5)
        sampling.set()
        sampler.join(timeout=10)
        print(f"{len(kill_times)} kills; checking the invariants")

        objects = world.jobs(projects)
        statuses = {f"{j['metadata']['namespace']}/{j['metadata']['name']}": j.get("status") or {}
                    for j in objects}
        unfinished = [(k, s.get("phase")) for k, s in statuses.items()
                      if s.get("phase") != "Succeeded"]
        assert not unfinished, f"{len(unfinished)} jobs not Succeeded: {unfinished[:5]}"
        pods_by_job: dict[str, list[Obj]] = {}
        for pod in world.pods():
            key = (pod["metadata"].get("annotations") or {}).get(names.ANN_JOB, "")
            pods_by_job.setdefault(key, []).append(pod)
        for key, status in statuses.items():
            history = status.get("history") or []
            assert [r.get("outcome") for r in history] == ["Succeeded"], (key, history)
            assert status["attempts"] == 1, (key, status["attempts"])
            pods = pods_by_job.get(key, [])
            assert len(pods) == 1 and pods[0]["status"]["phase"] == "Succeeded", (key, pods)
            assert pods[0]["metadata"]["name"].endswith("-1")

        # concurrent quota at every sampled instant
        assert len(samples) > 30
        worst = max((held.get(p, 0) for held in samples for p in projects), default=0)
        assert worst <= GUARANTEE, f"a project held {worst} GPUs, over its {GUARANTEE}"

        # GPU-hours: each project's used hours are the sum over its jobs
        time.sleep(5)  # one more pass writes the final quota status
        for project in projects:
            quota = world.custom.get_cluster_custom_object(
                names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, project)
            mine = [s.get("gpuHours", 0.0) for k, s in statuses.items()
                    if k.startswith(project + "/")]
            assert quota["status"]["usedGpuHours"] == pytest.approx(sum(mine), abs=1e-3)
            assert all(h > 0 for h in mine)
        print(f"{total} jobs, {len(kill_times)} kills, {len(samples)} samples, peak per project "
              f"{worst}, {_leaderships(log)} leaderships; invariants hold")
        # the run counts only if the kills all landed during it (checked last, so that a run
        # that ended early still says whether the invariants held)
        assert len(kill_times) == kills, f"only {len(kill_times)} kills before the run ended"
    finally:
        sampling.set()
        world.stop_all()
        world.cleanup(projects, tag)


def _passes(log: Path) -> int:
    if not log.is_file():
        return 0
    return sum(1 for line in log.read_text(errors="replace").splitlines()
               if "reconcile pass:" in line)


@pytest.mark.timeout(900)
def test_two_replicas_only_the_leader_acts(world: World) -> None:
    tag = uuid.uuid4().hex[:5]
    projects = world.setup(tag, nodes=2, gpus_per_node=4)
    try:
        a = world.start_operator(f"replica-a-{tag}", f"replica-a-{tag}.log")
        b = world.start_operator(f"replica-b-{tag}", f"replica-b-{tag}.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and world.lease_holder() not in (
                f"replica-a-{tag}", f"replica-b-{tag}"):
            time.sleep(1)
        leader_id = world.lease_holder()
        assert leader_id in (f"replica-a-{tag}", f"replica-b-{tag}"), leader_id
        leader = a if leader_id.startswith("replica-a") else b
        standby_id = f"replica-{'b' if leader is a else 'a'}-{tag}"
        leader_log = world.log_dir / f"{leader_id}.log"
        standby_log = world.log_dir / f"{standby_id}.log"

        world.submit([(projects[i % PROJECTS], f"j{i}", 2) for i in range(20)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            phases = [(j.get("status") or {}).get("phase") for j in world.jobs(projects)]
            if phases.count("Succeeded") == 20:
                break
            time.sleep(1)
        assert phases.count("Succeeded") == 20, phases
        assert _passes(leader_log) > 0
        assert _passes(standby_log) == 0, "the standby ran reconcile passes"
        assert world.lease_holder() == leader_id

        # the leader dies without releasing: the standby takes over once the lease expires
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and world.lease_holder() != standby_id:
            time.sleep(1)
        assert world.lease_holder() == standby_id
        world.submit([(projects[0], "after", 2)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = world.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, projects[0], names.GPUJOB_PLURAL, "after"
            ).get("status") or {}
            if status.get("phase") == "Succeeded":
                break
            time.sleep(1)
        assert status.get("phase") == "Succeeded", status
        assert _passes(standby_log) > 0
        assert "became leader" in standby_log.read_text(errors="replace")
    finally:
        world.stop_all()
        world.cleanup(projects, tag)
