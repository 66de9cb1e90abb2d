"""The operator's reconcile pass at scale, in one process: where its time goes, and its writes.

Builds `--nodes` simulated GPU nodes (8 GPUs each: H100 80 GiB and H200 141 GiB, MPS and
exclusive nodes) and `--jobs` GpuJobs in memory, and runs the real operator pass
(`Reconciler.run_pass`: observe, decide, act) over an in-memory API that stores what the
operator writes and counts every write by verb and resource. No API server, so it times the
operator's own work and nothing else. The pass runs as in a cluster:

1. `fill`: every job is new; the pass admits what fits (one pod and one status write each)
   and the rest wait. A stand-in scheduler then binds each created pod where the admission
   put it and its container starts (the extender's annotation, as KWOK would run it).
2. `steady`: nothing changed; what a pass costs with the queue as it is (the resync every
   `CARPOOL_RESYNC_SECONDS`), and how many writes it makes (ideally none).
3. `refresh`: `--finish` running jobs have finished: the pass records them, admits what fits
   into the freed GPUs and refreshes every waiting job's estimated start. Its decide time is
   the ETA refresh over the whole queue.

For each pass it prints the seconds of observe (read), decide and act (wall clock, and CPU
seconds of the process, which a shared machine disturbs less), the writes by kind, and the
process's peak RSS (the in-memory API's objects included); the summary gives the median,
lowest and highest of the last `--repeat` passes of each kind. `--profile` adds the top
functions of one phase by cumulative time (cProfile).

`--burst` runs instead the shape of bench/peers.py's Carpool round: one-GPU jobs of 40-120 s
(`admission._job`, whole GPUs of one model) on nodes of 8 whole GPUs, no scheduler (the round
holds kube-scheduler, so no pod starts), and the admissions of the burst carried out over
several passes, as a pass's time budget splits them on a 2-core API server: each pass carries
out at most its share of the GPUs (`--burst 0.41,0.19,0.23,0.17`: the 50,000-job round's
16,560, 7,575, 9,114 and 6,751 admissions of 40,000), `--gap` seconds of clock apart, then
`--after` passes that admit nothing more. It prints the writes per admission by kind.

`--decisions FILE` writes every pass's decisions (admissions with their node and GPUs,
preemptions, expiries, waits with their estimates, the projects' status), one per line; with
`--clock EPOCH` every timestamp and every pass's time is fixed (`--gap` s apart), so two runs
of one seed decide alike and a change meant to keep every decision is checked with `cmp`.

    .venv/bin/python bench/operator_cycle.py --nodes 5000 --jobs 50000 [--finish 500]
        [--repeat 3] [--no-memo] [--profile refresh]
    .venv/bin/python bench/operator_cycle.py --nodes 5000 --jobs 50000 --burst
        0.41,0.19,0.23,0.17 [--gap 200] [--after 1]
    ... [--clock 2000000000 --decisions FILE]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import logging
import pstats
import random
import re
import resource
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from carpool.core import names
from carpool.core.assignment import AssignedGpu, Assignment, encode_assignment
from carpool.core.queueing import CycleResult
from carpool.core.resources import Isolation
from carpool.kube.errors import Conflict, NotFound
from carpool.operator.kube import GPUJOBS, PODS, QUOTAS, Kube
from carpool.operator.reconciler import Reconciler, ReconcilerConfig
from carpool_testbed import simnodes
from carpool_testbed.scripts import load_script

Obj = dict[str, Any]
PATH = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?"
                  r"/(?P<res>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
KINDS = (GPUJOBS, PODS, QUOTAS, names.GPUNODE_PLURAL, "nodes")


def _merge(target: Obj, patch: Obj) -> None:
    """JSON merge patch (RFC 7386) of `patch` into `target`."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merged = dict(target[key])
            _merge(merged, value)
            target[key] = merged
        else:
            target[key] = copy.deepcopy(value)


class MemoryApi:
    """What `carpool.kube.client.Api` offers the operator, over dicts in memory; every write
    counted by (verb, resource[/subresource])."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Obj]] = {kind: {} for kind in KINDS}
        self.version = 1
        self.writes = 0
        self.counts: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.clock: float | None = None  # epoch seconds of every timestamp (None: the time)

    def timestamp(self) -> str:
        """Now, or the fixed clock (`--clock`), as the API server writes times."""
        at = datetime.now(UTC) if self.clock is None else datetime.fromtimestamp(self.clock, UTC)
        return at.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _stamp(self, obj: Obj) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)

    def put(self, kind: str, obj: Obj) -> None:
        """An object as something other than the operator wrote it (setup, the scheduler)."""
        meta = obj["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", self.timestamp())
        key = f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]
        with self.lock:
            self._stamp(obj)
            self.objects[kind][key] = obj

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Obj:
        match = PATH.match(path.split("?", 1)[0])
        if match is None:
            raise ValueError(f"unexpected path {path}")
        ns, res, name, sub = match["ns"], match["res"], match["name"], match["sub"]
        if method != "GET":
            with self.lock:
                self.writes += 1
                self.counts[(method, res + (f"/{sub}" if sub else ""))] += 1
        store = self.objects.get(res)
        key = f"{ns}/{name}" if ns else str(name)
        if store is None:  # Events, PriorityClasses, Services, claims: counted only
            if res == "events" and body:
                with self.lock:
                    self.counts[("POST", f"events {body.get('reason')}")] += 1
            return dict(body or {})
        with self.lock:
            if method == "POST":
                meta = body["metadata"]
                key = f"{ns}/{meta['name']}" if ns else meta["name"]
                if key in store:
                    raise Conflict(409, "AlreadyExists")
                obj = copy.deepcopy(body)
                obj["metadata"].update(uid=str(uuid.uuid4()), namespace=ns,
                                       creationTimestamp=self.timestamp())
                self._stamp(obj)
                store[key] = obj
                return dict(obj)
            obj = store.get(key)
            if obj is None:
                raise NotFound(404, "NotFound")
            if method == "GET":
                return obj
            if method == "DELETE":
                return store.pop(key)
            updated = dict(obj)  # PATCH: a new object, as the API server's watch would show
            patch = {k: v for k, v in body.items() if k != "metadata" or sub is None}
            if sub is None and "metadata" in body:
                meta = dict(updated["metadata"])
                _merge(meta, {k: v for k, v in body["metadata"].items()
                              if k != "resourceVersion"})
                updated["metadata"] = meta
                patch.pop("metadata", None)
            _merge(updated, patch)
            updated["metadata"] = dict(updated["metadata"])
            self._stamp(updated)
            store[key] = updated
            return updated

    def get(self, path: str, query: Any = None) -> Obj | None:
        try:
            return self.request("GET", path)
        except NotFound:
            return None

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Obj, content_type: str = "", query: Any = None) -> Obj:
        return self.request("PATCH", path, body)

    def delete(self, path: str, query: Any = None) -> Obj | None:
        try:
            return self.request("DELETE", path)
        except NotFound:
            return None


class MemoryInformers:
    """The watch caches as `operator.informer.Informers` offers them, always caught up."""

    def __init__(self, api: MemoryApi):
        self.api = api

    def objects(self, kind: str) -> list[Obj]:
        with self.api.lock:
            return list(self.api.objects[kind].values())

    def get(self, kind: str, key: str) -> Obj | None:
        return self.api.objects[kind].get(key)

    def gone_at(self, kind: str, uid: str) -> None:
        return None

    def gone(self, kind: str) -> list[tuple[float, Obj]]:
        return []

    def arrived(self, kind: str) -> int:
        return 0

    def arrived_since(self, kind: str, count: int) -> list[Obj]:
        return []

    def caught_up(self, timeout: float) -> bool:
        return True


def _nodes(count: int) -> list[simnodes.SimNode]:
    """Half H100 80 GiB, half H200 141 GiB; one node in four offers whole GPUs only."""
    document = {"nodes": [{
        "name": f"gpu-{i:05d}", "zone": f"zone-{i % 4}",
        "sharing": "exclusive" if i % 4 == 3 else "mps",
        "gpus": [{"model": "H100" if i % 2 else "H200", "count": 8,
                  "memoryTotalMiB": (80 if i % 2 else 141) * 1024}]} for i in range(count)]}
    return simnodes.parse_nodes(document)


def _job(i: int, project: str, rng: random.Random) -> Obj:
    """One of a mix of shapes: MPS shares of one GPU, whole GPUs (1, 2 or 4), any model or
    one, four classes, 1 to 8 hours (no running job outlives its estimate while the bench
    runs, or every pass would move the estimates behind it). Each its own template (no
    trailing number), so the bench's early finishes teach no other job's run time."""
    cls = rng.choices(["interactive", "short", "long", "batch"], [1, 3, 2, 4])[0]
    shape = rng.random()
    if shape < 0.45:
        gpu: Obj = {"count": 1, "memory": f"{rng.choice([16, 24, 32, 48])}Gi",
                    "cores": rng.choice([25, 34, 50]), "isolation": "mps"}
    else:
        gpu = {"count": rng.choice([1, 1, 1, 2, 2, 4]), "memory": "40Gi",
               "isolation": "exclusive"}
    if rng.random() < 0.3:
        gpu["models"] = [rng.choice(["H100", "H200"])]
    seconds = rng.randint(3600, 8 * 3600)
    return {"apiVersion": names.API_VERSION, "kind": "GpuJob",
            "metadata": {"name": f"j{i}-run", "namespace": project},
            "spec": {"project": project, "class": cls, "preemptible": cls == "batch",
                     "gpu": gpu, "estimatedDuration": f"{seconds}s",
                     "template": {"spec": {"containers": [{"name": "main",
                                                           "image": "work"}]}}}}


def build(args: argparse.Namespace) -> MemoryApi:
    api = MemoryApi()
    api.clock = args.clock
    now = datetime.fromtimestamp(api.clock, UTC) if api.clock else datetime.now(UTC)
    for node in _nodes(args.nodes):
        api.put("nodes", simnodes.node_manifest(node))
        gpunode = simnodes.gpunode_manifest(node)
        gpunode["status"] = simnodes.gpunode_status(node, now)
        api.put(names.GPUNODE_PLURAL, gpunode)
    gpus = args.nodes * 8
    projects = [f"p{i}" for i in range(args.projects)]
    for project in projects:
        api.put(QUOTAS, {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
                         "metadata": {"name": project},
                         "spec": {"namespaces": [project],
                                  "concurrent": {"gpus": gpus // args.projects},
                                  "borrowing": {"enabled": True}}})
    rng = random.Random(args.seed)
    for i in range(args.jobs):
        api.put(GPUJOBS, _job(i, projects[i % len(projects)], rng))
    return api


def schedule(api: MemoryApi) -> int:
    """The stand-in scheduler and kubelet: each pod not on a node yet is bound where its
    job's admission put it (the extender's assignment annotation) and starts running."""
    started = api.timestamp()
    bound = 0
    for key, pod in list(api.objects[PODS].items()):
        if pod["spec"].get("nodeName"):
            continue
        job = api.objects[GPUJOBS].get(f"{pod['metadata']['namespace']}/"
                                       f"{pod['metadata']['ownerReferences'][0]['name']}")
        status = (job or {}).get("status") or {}
        if job is None or not status.get("node"):
            continue
        isolation = Isolation.parse(str(job["spec"]["gpu"].get("isolation", "mps")))
        assignment = Assignment(status["node"], tuple(
            AssignedGpu(g["uuid"], int(g.get("index", 0)), int(g["memoryMiB"]),
                        int(g.get("cores", 0)), container="main") for g in status["gpus"]),
            isolation)
        pod = dict(pod, spec=dict(pod["spec"], nodeName=status["node"]))
        annotations = {**pod["metadata"].get("annotations", {}),
                       names.ANN_ASSIGNMENT: encode_assignment(assignment)}
        pod["metadata"] = dict(pod["metadata"], annotations=annotations)
        pod["status"] = {"phase": "Running", "startTime": started, "containerStatuses": [
            {"state": {"running": {"startedAt": started}}}]}
        api.objects[PODS][key] = pod
        api._stamp(pod)
        bound += 1
    return bound


def finish(api: MemoryApi, count: int, rng: random.Random) -> int:
    """`count` running pods end (their containers exit 0)."""
    running = [k for k, p in api.objects[PODS].items() if (p.get("status") or {}).get(
        "phase") == "Running"]
    ended = api.timestamp()
    for key in rng.sample(sorted(running), min(count, len(running))):
        pod = api.objects[PODS][key]
        begun = pod["status"]["startTime"]
        pod = dict(pod, status={"phase": "Succeeded", "startTime": begun, "containerStatuses": [
            {"state": {"terminated": {"startedAt": begun, "finishedAt": ended,
                                      "reason": "Completed", "exitCode": 0}}}]})
        api.objects[PODS][key] = pod
        api._stamp(pod)
    return min(count, len(running))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PassTimes(logging.Handler):
    """The pass's own log line (read/decide/act seconds, writes), kept."""

    LINE = re.compile(r"(\d+) jobs, (\d+) admitted, (\d+) preempted, (\d+) waiting, (\d+) "
                      r"writes; read ([0-9.]+)s decide ([0-9.]+)s act ([0-9.]+)s")

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = self.LINE.search(record.getMessage())
        if match:
            keys = ("jobs", "admitted", "preempted", "waiting", "writes", "read", "decide",
                    "act")
            self.last = {k: float(v) for k, v in zip(keys, match.groups(), strict=True)}


class StageCpu:
    """CPU seconds of the process (the writer's threads included) in each stage of a pass:
    on a shared machine they say more than the pass's own wall-clock times."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.seconds: dict[str, float] = {}
        for stage in ("observe", "decide", "act"):
            setattr(reconciler, stage, self._timed(stage, getattr(reconciler, stage)))

    def _timed(self, stage: str, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[stage] = time.process_time() - started
        return timed


def one_pass(reconciler: Reconciler, api: MemoryApi, times: PassTimes, cpu: StageCpu,
             label: str, profile: bool, now: float | None = None,
             decisions: io.TextIOBase | None = None) -> dict[str, Any]:
    before = Counter(api.counts)
    profiler = cProfile.Profile() if profile else None
    started, cpu_started = time.monotonic(), time.process_time()
    if profiler:
        profiler.enable()
    result = reconciler.run_pass(time.time() if now is None else now)
    reconciler.wait_for_writes()
    if profiler:
        profiler.disable()
    total, cpu_total = time.monotonic() - started, time.process_time() - cpu_started
    writes = {f"{verb} {res}": n - before.get((verb, res), 0)
              for (verb, res), n in sorted(api.counts.items()) if n > before.get((verb, res), 0)}
    row = {"phase": label, **times.last, "total_s": round(total, 2),
           **{f"{k}_cpu": round(v, 2) for k, v in cpu.seconds.items()},
           "total_cpu": round(cpu_total, 2), "writes_by_kind": writes,
           "peak_rss_mib": round(_peak_rss_mib())}
    print(json.dumps(row), flush=True)
    if decisions is not None:
        write_decisions(decisions, label, result)
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
        print(out.getvalue(), file=sys.stderr)
    return row


def write_decisions(out: io.TextIOBase, label: str, result: CycleResult) -> None:
    """Every decision of a pass, one per line (`--decisions`): two runs of the same seed and
    `--clock` decided alike if and only if these lines are the same."""
    out.write(f"pass {label} at {result.now!r}: {len(result.admissions)} admitted, "
              f"{len(result.preemptions)} preempted, {len(result.waits)} waiting\n")
    for item in (*result.admissions, *result.preemptions, *result.expiries, *result.waits,
                 *result.projects):
        out.write(f"{item!r}\n")


def build_burst(args: argparse.Namespace) -> MemoryApi:
    """bench/peers.py's Carpool round: nodes of 8 whole GPUs (H100 and H200 alternately),
    20 projects of an equal guarantee with borrowing, one-GPU jobs of 40-120 s."""
    admission = load_script(Path(__file__).parent / "admission.py")  # the peers round's jobs
    api = MemoryApi()
    api.clock = args.clock
    now = datetime.fromtimestamp(api.clock, UTC) if api.clock else datetime.now(UTC)
    models = ("H100", "H200")
    document = {"nodes": [{"name": f"gpu-{i:05d}", "zone": f"zone-{i % 4}",
                           "sharing": "exclusive",
                           "gpus": [{"model": models[i % 2], "count": 8,
                                     "memoryTotalMiB": 80 * 1024}]} for i in range(args.nodes)]}
    for node in simnodes.parse_nodes(document):
        api.put("nodes", simnodes.node_manifest(node))
        gpunode = simnodes.gpunode_manifest(node)
        gpunode["status"] = simnodes.gpunode_status(node, now)
        api.put(names.GPUNODE_PLURAL, gpunode)
    projects = [f"p{i}" for i in range(args.projects)]
    for project in projects:
        api.put(QUOTAS, {"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
                         "metadata": {"name": project},
                         "spec": {"namespaces": [project],
                                  "concurrent": {"gpus": args.nodes * 8 // args.projects},
                                  "borrowing": {"enabled": True}}})
    rng = random.Random(args.seed)
    for i in range(args.jobs):
        project = projects[i % len(projects)]
        api.put(GPUJOBS, admission._job(project, f"j{i}", project, rng, models[i % 2],
                                        exclusive=True))
    return api


def run_burst(args: argparse.Namespace) -> dict[str, Any]:
    """The burst carried out over passes (`--burst`), then `--after` passes; the writes per
    admission by kind over all of them."""
    api = build_burst(args)
    times = PassTimes()
    logging.getLogger("carpool.operator.reconciler").addHandler(times)
    logging.getLogger("carpool.operator.reconciler").setLevel(logging.INFO)
    config = ReconcilerConfig(admission_budget_s=0, admission_budget_max_s=0)
    reconciler = Reconciler(Kube(api), config, MemoryInformers(api))  # type: ignore
    cpu = StageCpu(reconciler)
    shares = [float(s) for s in args.burst.split(",")]
    started = args.clock or time.time()
    for i, share in enumerate(shares + [0.0] * args.after):
        # at most this pass's share of the GPUs carried out (0: the admissions left, if any)
        reconciler.config.max_admissions_per_pass = round(share * args.nodes * 8)
        # the clock moves `--gap` s a pass (a pass at 50,000 jobs takes minutes on 2 cores)
        api.clock = started + i * args.gap if args.clock else None
        one_pass(reconciler, api, times, cpu, f"burst {i + 1}" if share else "after", False,
                 started + i * args.gap, args.decisions)
    admitted = api.counts[("POST", PODS)]
    per = {f"{verb} {res}": round(n / max(1, admitted), 3)
           for (verb, res), n in sorted(api.counts.items())}
    summary = {"admitted": admitted, "writes per admission": per}
    print(json.dumps(summary), flush=True)
    return summary


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    started = time.monotonic()
    api = build(args)
    print(f"built {args.nodes} nodes and {args.jobs} jobs in "
          f"{time.monotonic() - started:.1f}s", file=sys.stderr)
    times = PassTimes()
    logging.getLogger("carpool.operator.reconciler").addHandler(times)
    logging.getLogger("carpool.operator.reconciler").setLevel(logging.INFO)
    config = ReconcilerConfig(admission_budget_s=0, admission_budget_max_s=0)
    reconciler = Reconciler(Kube(api), config, MemoryInformers(api))  # type: ignore
    if args.no_memo:  # every pass places from scratch, as before the memo was kept
        reconciler.config.admission = replace(reconciler.config.admission, timeline_memo=None)
    cpu = StageCpu(reconciler)
    rows: list[dict[str, Any]] = []

    def step(label: str, profile: bool) -> None:
        # with `--clock`, the clock moves `--gap` s a pass; else passes run at the time
        now = args.clock + len(rows) * args.gap if args.clock else None
        api.clock = now
        rows.append(one_pass(reconciler, api, times, cpu, label, profile, now, args.decisions))

    step("fill", args.profile == "fill")
    print(f"scheduled {schedule(api)} pods", file=sys.stderr)
    step("settle", False)
    rng = random.Random(args.seed + 1)
    for i in range(args.repeat):
        step("steady", args.profile == "steady" and i == 0)
        print(f"{finish(api, args.finish, rng)} pods finished", file=sys.stderr)
        step("refresh", args.profile == "refresh" and i == 0)
        schedule(api)
        step("settle", False)
    summary = {}
    for phase in ("steady", "refresh", "settle"):
        picked = [r for r in rows if r["phase"] == phase][-args.repeat:]
        summary[phase] = {k: (round(statistics.median(r[k] for r in picked), 2),
                              round(min(r[k] for r in picked), 2),
                              round(max(r[k] for r in picked), 2))
                          for k in ("observe_cpu", "decide_cpu", "act_cpu", "total_cpu",
                                    "total_s", "writes")}
    print(json.dumps({"summary (median, min, max)": summary}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--jobs", type=int, default=50000)
    parser.add_argument("--projects", type=int, default=20)
    parser.add_argument("--finish", type=int, default=500,
                        help="running jobs that finish before each refresh pass")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", choices=("fill", "steady", "refresh"))
    parser.add_argument("--no-memo", action="store_true",
                        help="keep no placement memo from pass to pass")
    parser.add_argument("--burst", metavar="SHARES",
                        help="the peers round's shape, its admissions carried out over passes "
                             "of these shares of the GPUs (comma-separated)")
    parser.add_argument("--gap", type=float, default=200.0,
                        help="--burst, or with --clock: seconds of clock between passes")
    parser.add_argument("--clock", type=float, metavar="EPOCH",
                        help="a fixed clock from this time (after the run: a pass never runs "
                             "before the time), so two runs of a seed decide alike")
    parser.add_argument("--decisions", type=argparse.FileType("w"), metavar="FILE",
                        help="write every pass's decisions here, one per line")
    parser.add_argument("--after", type=int, default=1,
                        help="--burst: passes after the burst's last admission")
    args = parser.parse_args()
    if args.burst:
        run_burst(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
