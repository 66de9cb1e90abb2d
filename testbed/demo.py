"""`make demo`: Carpool on a local cluster with simulated GPU nodes, start to finish.

Brings up the cluster (building Kubernetes once), starts the extender and the operator, creates
simulated GPU nodes of mixed models and temperatures and two projects with quotas, then submits
interactive, short, long and batch jobs and narrates what happens: queueing with reasons and
estimated starts, a preemption of borrowed work, placement on exact GPUs, and at the end the
GPU-hours report. Simulated jobs last seconds, so the whole story takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from carpool.core import names
from carpool.core.durations import format_duration
from carpool.core.job_status import ESTIMATE_PRECISION, ESTIMATE_STEPS_S
from carpool.core.timestamps import epoch_of
from carpool_testbed import devcluster, simnodes, stack

NODES: dict[str, Any] = {"sharesPerGpu": 8, "nodes": [
    {"name": "h200-a", "zone": "zone-a", "sharing": "mps", "datasets": ["imagenet"],
     "gpus": [{"model": "H200", "count": 3, "temperatureC": 45},
              {"model": "H200", "count": 1, "temperatureC": 86}]},  # hot: near slowdown
    {"name": "a100-b", "zone": "zone-b", "sharing": "mps", "datasets": ["c4"],
     "gpus": [{"model": "A100", "count": 4, "temperatureC": 52}]},
    {"name": "t4-c", "zone": "zone-c", "sharing": "timeslice",
     "gpus": [{"model": "T4", "count": 2, "temperatureC": 60}]},
]}

# Added once the story is over, for the README tour's MIG job (examples/gpujobs.yaml): a MIG
# node offers its GPU to exclusive jobs too, so during the story it would change where the
# borrowed shards land.
MIG_NODE: dict[str, Any] = {"sharesPerGpu": 8, "nodes": [
    {"name": "h200-mig", "zone": "zone-a", "sharing": "mig",
     "gpus": [{"model": "H200", "count": 1, "migInstances": [
         {"profile": "3g.71gb", "slices": 3, "memoryMiB": 71424},
         {"profile": "2g.35gb", "slices": 2, "memoryMiB": 35584},
         {"profile": "1g.18gb", "slices": 1, "memoryMiB": 17920},
         {"profile": "1g.18gb", "slices": 1, "memoryMiB": 17920}]}]},
]}

QUOTAS = [
    {"name": "vision", "namespaces": ["vision"], "concurrent": {"gpus": 6, "memory": "1Ti"},
     "gpuHours": {"budget": 500, "period": "7d"}, "borrowing": {"enabled": True}, "weight": 2},
    {"name": "nlp", "namespaces": ["nlp"], "concurrent": {"gpus": 2},
     "gpuHours": {"budget": 200, "period": "7d", "onExhausted": "PreemptibleOnly"},
     "borrowing": {"enabled": True}, "weight": 1},
]


GRACE_S = 5  # the preemptible shards' checkpoint grace


def gpujob(name: str, namespace: str, job_class: str, gpu: dict[str, Any], seconds: int,
           preemptible: bool = False, dataset: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "project": namespace, "class": job_class, "gpu": gpu,
        "estimatedDuration": f"{seconds}s", "simulatedDuration": f"{seconds}s",
        "preemptible": preemptible,
        "template": {"spec": {"containers": [{"name": "main", "image": "lab/trainer:1.0"}]}},
    }
    if preemptible:
        spec["checkpoint"] = {"gracePeriod": f"{GRACE_S}s"}
    if dataset:
        spec["dataset"] = {"name": dataset, "size": "150Gi"}
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


EXCLUSIVE = {"count": 1, "memory": "40Gi", "isolation": "exclusive"}

NLP_BATCH = [gpujob(f"pretrain-shard-{i}", "nlp", "batch", EXCLUSIVE, 150, preemptible=True)
             for i in range(6)]
VISION_JOBS = [
    gpujob("notebook", "vision", "interactive", EXCLUSIVE, 40),
    gpujob("finetune-a", "vision", "short",
           {"count": 1, "memory": "24Gi", "cores": 50, "isolation": "mps"}, 30, dataset="imagenet"),
    gpujob("finetune-b", "vision", "short",
           {"count": 1, "memory": "24Gi", "cores": 50, "isolation": "mps"}, 30, dataset="imagenet"),
    gpujob("detector-long", "vision", "long",
           {"count": 4, "memory": "60Gi", "isolation": "exclusive",
            "models": ["H200", "A100"]}, 60),
    gpujob("sweep-0", "vision", "batch",
           {"count": 1, "memory": "10Gi", "cores": 25, "isolation": "mps"}, 20),
    gpujob("sweep-1", "vision", "batch",
           {"count": 1, "memory": "10Gi", "cores": 25, "isolation": "mps"}, 20),
]


class Narrator:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"\n[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)


def _jobs(cluster: devcluster.Cluster) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "gpujobs", "-A", "-o", "json").stdout
    return list(json.loads(out)["items"])


def _show(cluster: devcluster.Cluster) -> None:
    print(cluster.kubectl("get", "gpujobs", "-A", "-o", "wide").stdout, flush=True)


def _wait(until: Callable[[], bool], timeout: float, interval: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return True
        time.sleep(interval)
    return False


def _phase_counts(jobs: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for job in jobs:
        phase = (job.get("status") or {}).get("phase", "New")
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def _preempted(jobs: Sequence[dict[str, Any]]) -> list[str]:
    """Jobs that lost an attempt to preemption (now stopping, requeued or running again)."""
    out = []
    for job in jobs:
        status = job.get("status") or {}
        outcomes = {r.get("outcome") for r in status.get("history") or []}
        if status.get("phase") == "Preempted" or "Preempted" in outcomes:
            out.append(f"{job['metadata']['namespace']}/{job['metadata']['name']}")
    return out


class EstimateLog:
    """Every estimated start the demo showed, by job, and when each job really started: the
    first run that began after the estimate was first shown (a preempted job waits again,
    and its `startTime` is that of its first run, from before the wait)."""

    def __init__(self) -> None:
        self.shown: dict[str, list[tuple[float, float]]] = {}  # key -> (seen at, estimate)
        self.starts: dict[str, set[float]] = {}  # key -> starts of its runs
        self.submitted: dict[str, float] = {}

    def observe(self, jobs: Sequence[dict[str, Any]], now: float) -> None:
        for job in jobs:
            key = f"{job['metadata']['namespace']}/{job['metadata']['name']}"
            status = job.get("status") or {}
            submitted = epoch_of(status.get("submitTime"))
            if submitted is not None:
                self.submitted.setdefault(key, submitted)
            starts = self.starts.setdefault(key, set())
            for started in (status.get("startTime"),
                            *((r or {}).get("start") for r in status.get("history") or [])):
                if (epoch := epoch_of(started)) is not None:
                    starts.add(epoch)
            estimate = epoch_of(status.get("estimatedStart"))
            if estimate is None or status.get("phase") not in ("Queued", "Preempted"):
                continue
            shown = self.shown.setdefault(key, [])
            if not shown or shown[-1][1] != estimate:
                shown.append((now, estimate))

    def lines(self) -> list[str]:
        """One line per job shown an estimate: each estimate beside the actual start."""
        out = []
        for key in sorted(self.shown):
            seen, first = self.shown[key][0]
            started = min((s for s in self.starts.get(key, ()) if s >= seen - 1), default=None)
            if started is None:
                out.append(f"    {key}: shown {_clock(first)}; has not started")
                continue
            wait = started - seen
            off = started - first
            relative = f", {abs(off) / wait:.0%} of the {format_duration(wait)} wait" \
                if wait >= 1 else ""
            later = len(self.shown[key]) - 1
            revised = (f"; {later} later estimate(s), last {_clock(self.shown[key][-1][1])}"
                       if later else "")
            out.append(f"    {key}: estimated {_clock(first)}, started {_clock(started)} — "
                       f"{'late' if off > 0 else 'early'} by {format_duration(abs(off))}"
                       f"{relative}{revised}")
        return out


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch))


def progress_line(jobs: Sequence[dict[str, Any]], now: float) -> str:
    """Phases and the next estimated start, for the wait while the queue drains."""
    counts = _phase_counts(jobs)
    text = ", ".join(f"{n} {phase.lower()}" for phase, n in sorted(counts.items()))
    upcoming = sorted(
        (estimate, f"{j['metadata']['namespace']}/{j['metadata']['name']}")
        for j in jobs
        if (estimate := epoch_of((j.get("status") or {}).get("estimatedStart"))) is not None
        and (j.get("status") or {}).get("phase") in ("Queued", "Preempted"))
    if upcoming:
        estimate, key = upcoming[0]
        text += f"; next: {key} estimated in {format_duration(max(0.0, estimate - now))}"
    return text


def _report(cluster: devcluster.Cluster) -> str:
    """The kubectl plugin's report, run as a user would run it."""
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli.kubectl_plugin", "report", "--since", "1d",
         "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True, text=True, check=False)
    return result.stdout + result.stderr


def install_chart(cluster: devcluster.Cluster) -> None:
    chart = devcluster.repo_root() / "helm" / "carpool"
    disabled = ["operator", "extender", "scheduler", "devicePlugin", "mpsDaemon"]
    command = [str(cluster.bin_dir / "helm"), "upgrade", "--install", "carpool", str(chart),
               "--namespace", "carpool-system", "--create-namespace",
               "--kubeconfig", str(cluster.kubeconfig)]
    for component in disabled:
        command += ["--set", f"{component}.enabled=false"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    print(f"    {result.stdout.strip().splitlines()[0] if result.stdout.strip() else ''}")
    if result.returncode != 0:
        raise SystemExit(f"helm install failed: {result.stderr.strip()}")


def run(log_dir: Path) -> int:
    say = Narrator().say
    progress = devcluster.Progress(sys.stdout)
    cluster = devcluster.up(progress=progress)
    say("Installing the Helm chart: CRDs, the carpool-job PriorityClass, RBAC, dashboard. "
        "No container images can be built here, so the operator and extender run as local "
        "processes instead of the chart's Deployments")
    install_chart(cluster)
    say("Starting Carpool: the scheduler extender and the operator")
    processes = stack.start_detached(cluster, log_dir)
    print(f"    extender pid {processes['extender']}, operator pid {processes['operator']}, "
          f"simulated nodes' heartbeat pid {processes['heartbeat']}; logs in {log_dir}")
    api = cluster.api()

    say("Creating simulated GPU nodes (KWOK): H200s (one running hot), A100s, T4s")
    nodes = simnodes.parse_nodes(NODES)
    mig_nodes = simnodes.parse_nodes(MIG_NODE)
    # a rerun tells the same story: the tour's MIG node comes back at the end
    simnodes.delete_nodes(api, [n.name for n in mig_nodes])
    simnodes.apply_nodes(api, nodes)
    print(simnodes.summary(nodes))

    say("Two projects: vision (6 GPUs guaranteed, weight 2) and nlp (2 GPUs, may borrow)")
    for ns in ("vision", "nlp"):
        cluster.kubectl("create", "namespace", ns, check=False)
    quotas = [{"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
               "metadata": {"name": q["name"]}, "spec": {k: v for k, v in q.items() if k != "name"}}
              for q in QUOTAS]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(quotas))
    # A rerun starts from a clean queue.
    cluster.kubectl("delete", "gpujobs", "--all", "-n", "vision", "--wait=true", check=False)
    cluster.kubectl("delete", "gpujobs", "--all", "-n", "nlp", "--wait=true", check=False)

    say("nlp submits 6 preemptible batch shards, one whole GPU each: 2 in its guarantee, "
        "4 borrowed from idle GPUs")
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(NLP_BATCH))
    _wait(lambda: _phase_counts(_jobs(cluster)).get("Running", 0) >= 6, 60)
    _show(cluster)

    say("vision submits an interactive notebook, two short fine-tunes, a 4-GPU long job and "
        "two batch sweeps. vision is within its guarantee, so borrowed nlp shards get "
        f"preempted ({GRACE_S}s checkpoint grace) and requeued")
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(VISION_JOBS))
    estimates = EstimateLog()
    for _ in range(8):
        time.sleep(1)
        estimates.observe(_jobs(cluster), time.time())
    _show(cluster)
    print(f"    preempted so far: {', '.join(_preempted(_jobs(cluster))) or 'none yet'}")

    say("Waiting jobs say why they wait and when they will start (status.reason, "
        "status.estimatedStart):")
    for job in _jobs(cluster):
        status = job.get("status") or {}
        if status.get("phase") in ("Queued", "Preempted"):
            print(f"    {job['metadata']['namespace']}/{job['metadata']['name']}: "
                  f"{status.get('reason')} — {status.get('message')}")

    say("Letting the queue drain (simulated jobs last 20-150 s)...")
    last_line = 0.0

    def drained() -> bool:
        nonlocal last_line
        jobs, now = _jobs(cluster), time.time()
        estimates.observe(jobs, now)
        if now - last_line >= 15:
            say(progress_line(jobs, now))
            last_line = now
        return all((j.get("status") or {}).get("phase") in ("Succeeded", "Failed")
                   for j in jobs)

    done = _wait(drained, 420, 2)
    estimates.observe(_jobs(cluster), time.time())
    _show(cluster)
    print(f"    preempted and requeued along the way: {', '.join(_preempted(_jobs(cluster)))}")
    if not done:
        print("    (some jobs are still running; the report counts them up to now)")

    say("Each estimated start the demo showed, beside the actual start:")
    print("\n".join(estimates.lines()) or "    (no job had to wait)")
    print(f"    (estimates are written rounded to within {ESTIMATE_PRECISION:.0%} of the time "
          f"until them, {ESTIMATE_STEPS_S[0]:.0f} to {ESTIMATE_STEPS_S[-1]:.0f} s, and count on "
          f"a preempted job keeping its GPUs for its whole checkpoint grace, {GRACE_S} s here; "
          f"a simulated pod leaves as soon as it is told to stop)")

    say("GPU-hours by project (`kubectl carpool report`):")
    print(_report(cluster))

    say("One more node for the README's tour: an H200 split into MIG instances")
    simnodes.apply_nodes(api, mig_nodes)
    print(simnodes.summary(mig_nodes))

    kubeconfig = cluster.kubeconfig
    print(f"""
Explore (the README's tour goes step by step):
  export KUBECONFIG={kubeconfig}
  {cluster.bin_dir}/kubectl get gpujobs -A           # queue, phases, nodes, estimated starts
  {cluster.bin_dir}/kubectl describe gpujob -n vision detector-long
  .venv/bin/kubectl-carpool queue | quota | nodes | why -n nlp pretrain-shard-0
  {cluster.bin_dir}/kubectl apply -f examples/gpujobs.yaml
Stop:
  make cluster-down      # stops the operator, the extender and the cluster
""")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool_testbed.demo", description=__doc__)
    parser.add_argument("--log-dir", type=Path,
                        default=devcluster.cache_dir() / "demo-logs")
    args = parser.parse_args(argv)
    return run(args.log_dir)


if __name__ == "__main__":
    sys.exit(main())
