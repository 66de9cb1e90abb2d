"""Extender latency at the openb cluster's scale: filter, prioritize and bind over HTTP.

The 1,213 openb GPU nodes (6,212 GPUs) are loaded straight into the extender's cache (no
cluster); a child process serves the real aiohttp app; this process plays kube-scheduler:
for each pod (shapes drawn from the openb trace) it POSTs /filter with all node names,
/prioritize with the nodes that passed if more than one did (kube-scheduler skips it
otherwise; with the shipped `--filter-best 1` one does), and /bind to the best one, with
`--concurrency` scheduling loops at once. The API server behind bind is the in-memory fake, with
`--api-delay-ms` added per call (a local API server answers in a few ms); a bound pod is
reported Running to the cache at once, as KWOK would. Prints p50/p99 per verb.

    .venv/bin/python bench/extender.py [--pods 2000] [--concurrency 1]

With `--cold-passes` it times, in process, a demand shape's first filter (every node
evaluated) after `--pods` pods were placed.

With `--sampling` it replays the openb traces as bench/placement.py does, but lets Carpool choose
only among the nodes kube-scheduler's `percentageOfNodesToScore` sample would send it.

With `--cluster` it instead measures end to end on the running local cluster (`make cluster`):
1,000 tainted KWOK GPU nodes, a private kube-scheduler run twice on the same nodes — once
without extenders (pods ask for CPU only) and once calling a fresh Carpool extender (pods ask
for Carpool GPUs) — and pods/s from the first bind to the last, read from a watch.

    .venv/bin/python bench/extender.py --cluster [--nodes 1000] [--pods 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB, GPU_MODEL_SLOWDOWN_C
from carpool.core.resources import Gpu, NodeInventory
from carpool.extender.service import SHIPPED_FILTER_BEST
from carpool_testbed import devcluster, traces

NODES_CSV = traces.node_list()
PODS_CSV = traces.pod_list("default")
OPENB_NODES = 1213


def openb_inventories(seed: int = 0) -> list[NodeInventory]:
    """The openb GPU nodes as Carpool inventories (temperatures drawn, deterministic)."""
    rng = random.Random(seed)
    out = []
    with NODES_CSV.open() as f:
        for row in csv.DictReader(f):
            model = row["model"]
            gpus = tuple(
                Gpu(index=i, uuid=f"{row['sn']}-gpu{i}", model=model,
                    memory_total_mib=GPU_MODEL_MEMORY_MIB[model],
                    temperature_c=round(rng.uniform(30, 70), 1),
                    slowdown_temp_c=GPU_MODEL_SLOWDOWN_C[model])
                for i in range(int(row["gpu"])))
            out.append(NodeInventory(name=row["sn"], gpus=gpus, datasets=frozenset(
                {"imagenet"} if rng.random() < 0.1 else set())))
    return out


MIG_MODELS = frozenset({"G3"})  # 80 GiB models a synthesised cluster may partition


def synthetic_inventories(count: int, seed: int = 0) -> list[NodeInventory]:
    """`count` nodes of 8 GPUs each, models drawn from the openb cluster's GPU mix, sharing
    modes mixed (deterministic): of every 20 nodes, 2 offer MPS only (their GPUs in
    EXCLUSIVE_PROCESS mode), 2 time-slicing and exclusive GPUs only, 1 (if its model has 80
    GiB) MIG only with seven 1g.10gb instances per GPU; the rest every mode but MIG."""
    from carpool.core.resources import Isolation, MigInstance

    rng = random.Random(seed)
    with NODES_CSV.open() as f:
        rows = list(csv.DictReader(f))
    models = [row["model"] for row in rows for _ in range(int(row["gpu"]))]
    out = []
    for n in range(count):
        name = f"synth-node-{n:05d}"
        model = rng.choice(models)
        kind = n % 20
        sharing = frozenset({Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE})
        if kind < 2:
            sharing = frozenset({Isolation.MPS})
        elif kind < 4:
            sharing = frozenset({Isolation.TIMESLICE, Isolation.EXCLUSIVE})
        mig = kind == 4 and model in MIG_MODELS
        if mig:
            sharing = frozenset({Isolation.MIG})
        gpus = tuple(
            Gpu(index=i, uuid=f"{name}-gpu{i}", model=model,
                memory_total_mib=GPU_MODEL_MEMORY_MIB[model],
                temperature_c=round(rng.uniform(30, 70), 1),
                slowdown_temp_c=GPU_MODEL_SLOWDOWN_C[model],
                exclusive_process=kind < 2,
                mig_instances=tuple(MigInstance(f"{name}-gpu{i}-mig{j}", "1g.10gb", 1, 10240)
                                    for j in range(7)) if mig else ())
            for i in range(8))
        out.append(NodeInventory(name=name, gpus=gpus, sharing=sharing, datasets=frozenset(
            {"imagenet"} if rng.random() < 0.1 else set())))
    return out


def cluster_inventories(nodes: int) -> list[NodeInventory]:
    """The openb nodes at their own count (1,213), else a synthesised cluster of `nodes`."""
    return openb_inventories() if nodes == OPENB_NODES else synthetic_inventories(nodes)


def mixed_isolation(shapes: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """The shapes with sharing modes mixed in as a synthesised cluster offers them
    (deterministic): a whole-GPU pod asks for exclusive GPUs one time in three, a fraction
    of a GPU for time-slicing one time in seven and, if it needs at most 10 GiB, for a MIG
    instance one time in twenty (any model); the rest MPS."""
    rng = random.Random(seed)
    out = []
    for shape in shapes:
        draw = rng.random()
        isolation = ""
        if shape["cores"] >= 100 and draw < 1 / 3:
            isolation = "exclusive"
        elif shape["cores"] < 100 and shape["memory_gib"] <= 10 and draw < 1 / 20:
            isolation = "mig"
        elif shape["cores"] < 100 and draw < 1 / 20 + 1 / 7:
            isolation = "timeslice"
        out.append({**shape, "isolation": isolation,
                    "models": "" if isolation == "mig" else shape["models"]})
    return out


def pod_shapes(nodes: int) -> list[dict[str, Any]]:
    """The openb trace's shapes; for a synthesised cluster, with its sharing modes mixed in."""
    shapes = openb_pod_shapes()
    return shapes if nodes == OPENB_NODES else mixed_isolation(shapes)


def openb_pod_shapes() -> list[dict[str, Any]]:
    """GPU pods of the default trace as (count, memory GiB, cores %, models)."""
    shapes = []
    with PODS_CSV.open() as f:
        for row in csv.DictReader(f):
            count = int(row["num_gpu"])
            if count == 0:
                continue
            milli = int(row["gpu_milli"]) if count == 1 else 1000
            shapes.append({"count": count, "memory_gib": max(1, milli * 16 // 1000),
                           "cores": max(1, milli // 10),
                           "models": row["gpu_spec"].replace("|", ",")})
    return shapes


def openb_cache(nodes: int = OPENB_NODES) -> tuple[Any, Callable[[str, dict[str, Any]], None]]:
    """The extender's cache holding the openb nodes, or a synthesised cluster of `nodes`
    (synced), and a pod watch for it that reports bound pods Running at once, as KWOK does."""
    from carpool.extender.cache import ClusterCache

    cache = ClusterCache()
    for inventory in cluster_inventories(nodes):
        cache.put_inventory(inventory)
    for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
        cache.mark_synced(kind)

    def watch(event: str, pod: dict[str, Any]) -> None:
        if pod["spec"].get("nodeName"):
            pod["status"]["phase"] = "Running"
        cache.apply_pod(event, pod, time.time())

    return cache, watch


# --- the server (child process) -------------------------------------------------------------


def serve(port: int, api_delay_s: float, filter_best: int, nodes: int,
          bounded_search: bool) -> None:
    from aiohttp import web

    from carpool.extender.fake import LoopFakeCluster
    from carpool.extender.server import event_loop, make_app, tune_interpreter
    from carpool.extender.service import Extender, Settings

    cache, watch = openb_cache(nodes)

    gc_pauses: list[float] = []
    gc_started = [0.0]
    gc_ms = [0.0]  # all collections, every generation, so far
    gc_by_generation: list[list[float]] = [[], [], []]

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
            return
        took = (time.perf_counter() - gc_started[0]) * 1000
        gc_ms[0] += took
        gc_by_generation[info["generation"]].append(took)
        if info["generation"] == 2:
            gc_pauses.append(took)

    gc.callbacks.append(gc_timer)
    cluster = LoopFakeCluster(delay_s=api_delay_s, on_change=watch)
    extender = Extender(cache, cluster, Settings(filter_best=filter_best,
                                                 bounded_search=bounded_search))
    server_ms: dict[str, list[float]] = {"filter": [], "prioritize": []}
    cpu_ms: dict[str, list[float]] = {"filter": [], "prioritize": []}
    warm_cpu_ms: dict[str, list[float]] = {"filter": [], "prioritize": []}

    def timed(verb: str, method: Any) -> Any:
        def wrapper(args: Any) -> Any:
            started, cpu_started = time.perf_counter(), time.thread_time()
            misses = extender.ranker.misses
            try:
                return method(args)
            finally:
                server_ms[verb].append((time.perf_counter() - started) * 1000)
                cpu = (time.thread_time() - cpu_started) * 1000
                cpu_ms[verb].append(cpu)
                # warm: the shape was seen before (at most a few changed nodes evaluated)
                if extender.ranker.misses - misses < 50:
                    warm_cpu_ms[verb].append(cpu)
        return wrapper

    extender.filter = timed("filter", extender.filter)  # type: ignore[method-assign]
    extender.prioritize = timed("prioritize", extender.prioritize)  # type: ignore[method-assign]
    app = make_app(extender)
    tune_interpreter()  # as `python -m carpool.extender` does

    @web.middleware
    async def stamp(request: web.Request, handler: Any) -> web.StreamResponse:
        # when the handler started and ended, the collector's time and the nodes evaluated
        # meanwhile: the client splits its wall time with these (one clock: CLOCK_MONOTONIC)
        started, gc_before, misses = time.perf_counter(), gc_ms[0], extender.ranker.misses
        response: web.StreamResponse = await handler(request)
        response.headers["X-Bench"] = (f"{started!r} {time.perf_counter()!r} "
                                       f"{gc_ms[0] - gc_before:.3f} "
                                       f"{extender.ranker.misses - misses}")
        return response

    app.middlewares.append(stamp)

    async def add_pods(request: web.Request) -> web.Response:
        for pod in await request.json():
            cluster.add_pod(pod)
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
            both = [f + p for f, p in zip(times["filter"], times["prioritize"], strict=False)]
            return {verb: {"p50": round(percentile(v, 0.5), 2),
                           "p99": round(percentile(v, 0.99), 2)}
                    for verb, v in (*times.items(), ("filter+prioritize", both)) if v}

        return web.json_response({
            "server_ms": summary(server_ms),
            "cpu_ms": summary(cpu_ms),
            "warm_cpu_ms": {verb: {"n": len(v), "p50": round(percentile(v, 0.5), 2),
                                   "p99": round(percentile(v, 0.99), 2)}
                            for verb, v in warm_cpu_ms.items() if v},
            "gc_ms_by_generation": [
                {"n": len(p), "p50": round(percentile(p, 0.5), 2) if p else 0,
                 "max": round(max(p, default=0.0), 1), "total": round(sum(p))}
                for p in gc_by_generation],
            "gc_full_collections": len(gc_pauses),
            "gc_full_ms_max": round(max(gc_pauses, default=0.0), 1),
            "memo_warmed": extender.ranker.warmed,
            "memo_hits": extender.ranker.hits,
                                  "workload_rebuilds": extender.ranker.workload_rebuilds,
                                  "memo_misses": extender.ranker.misses,
                                  **cache.counts()})

    app.router.add_post("/bench/pods", add_pods)
    app.router.add_get("/bench/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                loop=event_loop())  # as the command serves


# --- the load (this process) ----------------------------------------------------------------


def pod_manifest(name: str, shape: dict[str, Any]) -> dict[str, Any]:
    annotations = {"carpool.dev/models": shape["models"]} if shape["models"] else {}
    if shape.get("isolation"):
        annotations["carpool.dev/isolation"] = shape["isolation"]
    limits = {"carpool.dev/gpu": str(shape["count"]),
              "carpool.dev/gpu-memory": str(shape["memory_gib"]),
              "carpool.dev/gpu-cores": str(shape["cores"])}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "bench", "uid": f"uid-{name}",
                         "annotations": annotations},
            "spec": {"schedulerName": "carpool-scheduler",
                     "containers": [{"name": "main", "image": "x",
                                     "resources": {"limits": limits, "requests": limits}}]},
            "status": {"phase": "Pending"}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Split:
    """Where one request's client-observed time went: to the handler's start (HTTP, the
    server's event loop busy elsewhere, waiting for a CPU), in the handler (its share of
    collections apart), and back (the answer's write and the client's read)."""

    __slots__ = ("back", "cold", "gc", "handler", "to_handler")

    def __init__(self, sent: float, received: float, header: str) -> None:
        started, ended, gc_ms, misses = header.split()
        self.to_handler = float(started) - sent
        self.handler = float(ended) - float(started)
        self.back = received - float(ended)
        self.gc = float(gc_ms) / 1000
        self.cold = int(misses) >= 50


def split_report(splits: dict[str, list[tuple[Split, ...]]]) -> None:
    """p50/p99 of each part per verb, and what the slowest 1 % of cycles were made of."""
    print(f"{'split (ms)':<18} {'part':<11} {'p50':>7} {'p99':>7}")
    for verb, cycles in splits.items():
        for part in ("to_handler", "handler", "gc", "back"):
            ms = [1000 * sum(getattr(s, part) for s in cycle) for cycle in cycles]
            if ms:
                print(f"{verb:<18} {part:<11} {percentile(ms, 0.5):>7.2f} "
                      f"{percentile(ms, 0.99):>7.2f}")
    cycles = splits.get("filter+prioritize") or []
    if not cycles:
        return
    total = [sum(s.to_handler + s.handler + s.back for s in c) for c in cycles]
    worst = [c for _, c in sorted(zip(total, cycles, strict=True), key=lambda x: -x[0])][
        : max(1, len(cycles) // 100)]
    mean = {part: 1000 * statistics.fmean(sum(getattr(s, part) for s in c) for c in worst)
            for part in ("to_handler", "handler", "gc", "back")}
    cold = sum(1 for c in worst if any(s.cold for s in c))
    print(f"slowest 1 % of filter+prioritize cycles ({len(worst)}): mean to handler "
          f"{mean['to_handler']:.1f}, in handler {mean['handler']:.1f} (of which collections "
          f"{mean['gc']:.1f}), back {mean['back']:.1f} ms; {cold} were a new shape's first pass")


async def load(port: int, pods: list[dict[str, Any]], node_names: list[str],
               concurrency: int) -> dict[str, list[float]]:
    base = f"http://127.0.0.1:{port}"
    timings: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": [],
                                       "filter+prioritize": []}
    outcomes = {"bound": 0, "unschedulable": 0, "bind_error": 0}
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for pod in pods:
        queue.put_nowait(pod)
    connector = aiohttp.TCPConnector(limit=concurrency + 64)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.post(f"{base}/bench/pods", json=pods) as resp:
            assert resp.status == 200

        splits: dict[str, list[tuple[Split, ...]]] = {"filter": [], "prioritize": [],
                                                      "filter+prioritize": []}
        last_split: list[Split] = []

        async def post(verb: str, body: Any) -> tuple[Any, float]:
            # orjson on this side too: kube-scheduler (Go) encodes and decodes in well under
            # a millisecond, and this client should not add more than it would.
            started = time.perf_counter()
            data = body if isinstance(body, bytes) else orjson.dumps(body)
            sent = time.perf_counter()
            async with session.post(f"{base}/{verb}", data=data) as resp:
                result = orjson.loads(await resp.read())
                header = resp.headers.get("X-Bench", "")
            received = time.perf_counter()
            if header and verb != "bind":
                last_split[:] = [Split(sent, received, header)]
            return result, received - started

        errors: Counter[str] = Counter()
        binds: set[asyncio.Task[None]] = set()
        names_json = orjson.dumps(node_names)

        async def bind(pod: dict[str, Any], node: str) -> None:
            meta = pod["metadata"]
            result, t_bind = await post("bind", {
                "PodName": meta["name"], "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"], "Node": node})
            timings["bind"].append(t_bind)
            outcomes["bound" if not result["Error"] else "bind_error"] += 1
            if result["Error"]:
                errors[result["Error"].split(":")[-1].strip()[:60]] += 1

        async def scheduler_loop() -> None:
            # kube-scheduler's cycle: filter and prioritize one pod at a time; the bind runs
            # on its own (the scheduler's binding goroutine) while the next pod is filtered.
            while not queue.empty():
                pod = queue.get_nowait()
                # as Go writes ExtenderArgs (its fields in order), the names encoded once
                filtered, t_filter = await post("filter", b'{"Pod":' + orjson.dumps(pod)
                                                + b',"Nodes":null,"NodeNames":' + names_json
                                                + b"}")
                feasible = filtered["NodeNames"]
                timings["filter"].append(t_filter)
                filter_split = tuple(last_split)
                splits["filter"].append(filter_split)
                if not feasible:
                    outcomes["unschedulable"] += 1
                    continue
                if len(feasible) == 1:  # kube-scheduler neither scores nor prioritizes then
                    timings["filter+prioritize"].append(t_filter)
                    splits["filter+prioritize"].append(filter_split)
                    best = feasible[0]
                else:
                    scores, t_prio = await post("prioritize",
                                                {"Pod": pod, "NodeNames": feasible})
                    timings["prioritize"].append(t_prio)
                    timings["filter+prioritize"].append(t_filter + t_prio)
                    splits["prioritize"].append(tuple(last_split))
                    splits["filter+prioritize"].append(filter_split + tuple(last_split))
                    best = max(scores, key=lambda s: (s["Score"], s["Host"]))["Host"]
                task = asyncio.get_running_loop().create_task(bind(pod, best))
                binds.add(task)
                task.add_done_callback(binds.discard)

        started = time.perf_counter()
        await asyncio.gather(*(scheduler_loop() for _ in range(concurrency)))
        while binds:
            await asyncio.gather(*list(binds))
        elapsed = time.perf_counter() - started
        async with session.get(f"{base}/bench/stats") as resp:
            stats = await resp.json()
    print(f"pods {len(pods)}: {outcomes}; {len(pods) / elapsed:.0f} pods/s through "
          f"filter+prioritize+bind")
    if errors:
        print(f"bind errors: {dict(errors.most_common(5))}")
    print(f"server-side handler wall time (no HTTP, no JSON): {stats.pop('server_ms')}")
    print(f"server-side handler CPU time (what contention does not inflate): "
          f"{stats.pop('cpu_ms')}")
    print(f"  of which warm requests (demand shape seen before; <50 nodes re-evaluated): "
          f"{stats.pop('warm_cpu_ms')}")
    print(f"server: {stats}")
    split_report(splits)
    return timings


def _stolen_ms() -> float:
    """CPU time, all CPUs, that the hypervisor gave to others while this VM wanted it
    (/proc/stat's steal column, in clock ticks); 0 where the kernel does not report it."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# --- end to end on the local cluster -----------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(probe: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def _answers(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=1):
            return True
    except OSError:
        return False


def _scheduler(bin_dir: Path, kubeconfig: Path, workdir: Path, name: str,
               extender_port: int | None, percentage: int | None) -> subprocess.Popen[bytes]:
    import yaml

    profile: dict[str, Any] = {"schedulerName": name}
    if percentage:
        profile["percentageOfNodesToScore"] = percentage
    config: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        # the defaults (50 qps) would cap binds at 50/s in both runs alike; lift them
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": 5000, "burst": 5000},
        "leaderElection": {"leaderElect": False},
        "profiles": [profile],
    }
    if extender_port is not None:
        config["extenders"] = [{
            "urlPrefix": f"http://127.0.0.1:{extender_port}/", "filterVerb": "filter",
            "prioritizeVerb": "prioritize", "bindVerb": "bind", "weight": 5,
            "nodeCacheCapable": True, "httpTimeout": "10s",
            "managedResources": [{"name": r, "ignoredByScheduler": True} for r in (
                "carpool.dev/gpu", "carpool.dev/gpu-memory", "carpool.dev/gpu-cores")]}]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / f"{name}.log").open("wb")
    return subprocess.Popen([str(bin_dir / "kube-scheduler"), f"--config={path}",
                             "--secure-port=0"], stdout=log, stderr=subprocess.STDOUT)


def serve_null(port: int, kubeconfig: str) -> None:
    """The least an extender can do (`--cluster --null-extender`): filter passes the first
    node it is asked about, bind POSTs the Binding as Carpool's extender does (through
    `KubeCluster`, on the same event loop). Against it, what the scheduler-extender protocol
    itself costs."""
    from aiohttp import web

    from carpool.extender.kube import KubeCluster, api_client
    from carpool.extender.server import event_loop

    cluster = KubeCluster(api_client(kubeconfig))

    def answer(body: dict[str, Any]) -> web.Response:
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def filter_(request: web.Request) -> web.Response:
        names = orjson.loads(await request.read()).get("NodeNames") or []
        return answer({"NodeNames": names[:1], "FailedNodes": {}, "Error": ""})

    async def bind(request: web.Request) -> web.Response:
        args = orjson.loads(await request.read())
        try:
            await cluster.bind_pod_async(args["PodNamespace"], args["PodName"], args["PodUID"],
                                         args["Node"], {})
        except Exception as exc:  # the scheduler retries, as with Carpool's
            return answer({"Error": str(exc)})
        return answer({"Error": ""})

    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/filter", filter_)
    app.router.add_post("/bind", bind)
    app.router.add_get("/livez", livez)
    web.run_app(app, host="127.0.0.1", port=port, print=None, loop=event_loop())


def _bind_times(core: Any, namespace: str, selector: str, count: int,
                timeout: float) -> list[float]:
    """Times at which a watch saw each selected pod of the namespace get its node."""
    from kubernetes import watch

    seen: dict[str, float] = {}
    running: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        stream: Any = watch.Watch()
        try:
            for event in stream.stream(core.list_namespaced_pod, namespace,
                                       label_selector=selector, timeout_seconds=30,
                                       deserialize=False):
                pod = event["object"]
                if pod.get("spec", {}).get("nodeName"):
                    seen.setdefault(pod["metadata"]["name"], time.monotonic())
                if pod.get("status", {}).get("phase") == "Running":
                    running.setdefault(pod["metadata"]["name"], time.monotonic())
                if len(seen) >= count or time.monotonic() > deadline:
                    stream.stop()
        except Exception as exc:  # a broken watch: list and watch again
            print(f"  (watch restarted: {exc})", file=sys.stderr)
    delays = sorted(running[n] - seen[n] for n in running if n in seen)
    if delays:
        print(f"  bind -> Running (KWOK) median {1000 * delays[len(delays) // 2]:.0f} ms")
    return sorted(seen.values())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _apiserver_binding_latency(api: Any) -> tuple[float, float]:
    """The API server's (sum of seconds, count) over POST pods/binding so far."""
    method, url, headers, body, _ = api.param_serialize("GET", "/metrics",
                                                        auth_settings=["BearerToken"])
    text = api.call_api(method, url, headers, body, _request_timeout=30).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith("apiserver_request_duration_seconds_") or (
                'subresource="binding"' not in line or 'verb="POST"' not in line):
            continue
        if line.startswith("apiserver_request_duration_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("apiserver_request_duration_seconds_count"):
            count += float(line.split()[-1])
    return total, count


def bench_cluster(args: argparse.Namespace) -> int:


    # a registered user of the shared cluster: nobody deletes it under us
    with devcluster.shared_session(progress=devcluster.Progress(sys.stderr)) as cluster:
        return _bench_cluster(args, cluster)


def _bench_cluster(args: argparse.Namespace, cluster: Any) -> int:
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from datetime import UTC, datetime

    from kubernetes import client

    from carpool.kube.client import generated_client
    from carpool_testbed import crds, simnodes

    bin_dir = cluster.bin_dir
    paths = cluster
    api = generated_client(paths.kubeconfig)
    crds.apply_crds(api)
    core = client.CoreV1Api(api)
    run = f"{random.randrange(16**6):06x}"
    node_run = args.keep_nodes or run  # kept nodes are named, and found again, by this
    taint = {"key": "carpool.dev/bench", "value": node_run, "effect": "NoSchedule"}
    nodes = [simnodes.SimNode(name=f"bench-{node_run}-{i:04d}",
                              gpus=(simnodes.SimGpuGroup(model="A100", count=8),))
             for i in range(args.nodes)]
    workdir = Path(tempfile.mkdtemp(prefix="carpool-bench-"))
    namespace = f"bench-{run}"
    processes: list[subprocess.Popen[bytes]] = []
    results: dict[str, float] = {}
    try:
        started = time.monotonic()
        existing = {n.metadata.name for n in core.list_node(
            label_selector="type=kwok").items} if args.keep_nodes else set()
        if not {n.name for n in nodes} <= existing:
            simnodes.apply_nodes(api, nodes, datetime.now(UTC), workers=16)
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda n: core.patch_node(n.name, {"spec": {"taints": [taint]}}),
                              nodes))
            print(f"{args.nodes} KWOK nodes (8 GPUs each) created in "
                  f"{time.monotonic() - started:.0f}s")
        else:
            print(f"{args.nodes} KWOK nodes (8 GPUs each) kept from an earlier run")
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        port = _free_port()
        log = (workdir / "extender.log").open("wb")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "carpool.extender", "--port", str(port), "--host",
             "127.0.0.1", "--kubeconfig", str(paths.kubeconfig), "--log-level", "INFO",
             "--allow-unowned-pods",  # the load is bare pods, not GpuJobs
             *args.extender_arg],
            stdout=log, stderr=subprocess.STDOUT))

        def extender_ready() -> bool:
            import urllib.request
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return False
            for line in text.splitlines():
                if line.startswith('carpool_extender_cache_objects{kind="nodes"}'):
                    return bool(float(line.split()[-1]) >= args.nodes)
            return False

        _wait(extender_ready, 120, "the extender to see every node")
        toleration = {"key": taint["key"], "operator": "Equal", "value": node_run,
                      "effect": "NoSchedule"}
        setups: list[tuple[str, int | None]] = [("without extender", None)]
        if args.null_extender:
            null_port = _free_port()
            processes.append(subprocess.Popen(
                [sys.executable, __file__, "--serve-null", "--port", str(null_port),
                 "--kubeconfig", str(paths.kubeconfig)],
                stdout=(workdir / "null-extender.log").open("wb"), stderr=subprocess.STDOUT))
            _wait(lambda: _answers(null_port), 60, "the null extender to start")
            setups.append(("null extender", null_port))
        setups.append(("with extender", port))
        for label, extender_port in setups:
            scheduler_name = f"bench-{label.split()[0]}-{run}"
            # (an extender is asked only about pods with a resource it manages)
            limits = ({"carpool.dev/gpu": "1", "carpool.dev/gpu-memory": "10"}
                      if extender_port else {})
            pods = [{"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{scheduler_name}-{i:05d}",
                                  "labels": {"bench": scheduler_name}},
                     "spec": {"schedulerName": scheduler_name,
                              "tolerations": [toleration, devcluster.KWOK_TOLERATION],
                              "containers": [{"name": "main", "image": "registry.invalid/x:1",
                                              "resources": {"requests": {"cpu": "100m"},
                                                            "limits": limits}}]}}
                    for i in range(args.pods)]
            with ThreadPoolExecutor(16) as pool:  # all pending before the scheduler starts
                list(pool.map(lambda p: core.create_namespaced_pod(namespace, p), pods))
            cpu_before = _cpu_seconds(processes[0].pid)
            api_before = _apiserver_binding_latency(api)
            processes.append(_scheduler(bin_dir, paths.kubeconfig, workdir, scheduler_name,
                                        extender_port, args.percentage))
            times = _bind_times(core, namespace, f"bench={scheduler_name}", args.pods, 600)
            api_after = _apiserver_binding_latency(api)
            binds = api_after[1] - api_before[1]
            print(f"  API server: {binds:.0f} Binding POSTs, mean "
                  f"{1000 * (api_after[0] - api_before[0]) / max(binds, 1):.1f} ms; Carpool "
                  f"extender process CPU {_cpu_seconds(processes[0].pid) - cpu_before:.1f} s")
            rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
            results[label] = rate
            print(f"{label:<17} {len(times)} of {args.pods} pods bound; "
                  f"{rate:.0f} pods/s (first to last bind)")
            processes[-1].terminate()
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        for verb in ("filter", "prioritize", "bind"):
            total = count = 0.0
            for line in metrics.splitlines():
                if line.startswith(f'carpool_extender_request_seconds_sum{{verb="{verb}"}}'):
                    total = float(line.split()[-1])
                if line.startswith(f'carpool_extender_request_seconds_count{{verb="{verb}"}}'):
                    count = float(line.split()[-1])
            if count:
                print(f"  extender {verb}: {count:.0f} calls, mean {1000 * total / count:.1f} ms")
        print("  " + "; ".join(line for line in metrics.splitlines()
                               if line.startswith(("carpool_extender_requests_total",
                                                   "carpool_extender_watch_events{"))))
        if results.get("without extender"):
            for label in results:
                if label != "without extender":
                    print(f"ratio {label}/without: "
                          f"{results[label] / results['without extender']:.2f}")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
        def delete_nodes() -> None:
            if not args.keep_nodes:
                simnodes.delete_nodes(api, [n.name for n in nodes], workers=16)

        for what, cleanup in (
                ("pods", lambda: core.delete_collection_namespaced_pod(
                    namespace, grace_period_seconds=0, _request_timeout=120)),
                ("namespace", lambda: core.delete_namespace(namespace)),
                ("nodes", delete_nodes)):
            try:
                cleanup()
            except Exception as exc:  # keep cleaning; say what was left behind
                print(f"cleanup of {what} failed: {exc}", file=sys.stderr)
    return 0


# --- what ranking only the scheduler's sample of nodes costs placement --------------------


def sampled_replay(nodes: list[Any], sequence: list[Any], scorer: Any,
                   percentage: int) -> tuple[float, float]:
    """The placement replay (bench/placement.py's protocol and Carpool's scorer), except that
    each pod's choice is Carpool's best among the feasible nodes kube-scheduler would have
    sent: from the node after the last cycle's stop, nodes are taken in order until
    `numFeasibleNodesToFind` fit (at least 100; 0 = the adaptive default, 50 − nodes/125 %,
    at least 5 %). 100 reproduces bench/placement.py. (GPU allocation at 100 % arrival, at
    the end.)"""
    from carpool.replay import simulation

    cluster = simulation._Cluster(nodes, scorer)
    n = len(nodes)
    share = percentage or max(5, 50 - n // 125)
    wanted = n if share >= 100 else max(100, n * share // 100)
    capacity = simulation.capacity_milli(nodes)
    plans_by_demand: dict[Any, dict[int, Any]] = {}
    start = arrived = allocated = 0
    at_full: float | None = None
    for pod in sequence:
        demand = pod.demand
        arrived += demand.gpu_total_milli
        plans = plans_by_demand.setdefault(demand, {})
        found = processed = 0
        best: tuple[int, Any] | None = None
        for i in range(n):
            node = (start + i) % n
            processed += 1
            profile_id = cluster.profile_id_of_node[node]
            if profile_id not in plans:
                plans[profile_id] = scorer.plan_uncached(cluster.profiles[profile_id], demand)
            plan = plans[profile_id]
            if plan is None:
                continue
            found += 1
            if best is None or (plan.score, -node) > (best[1].score, -best[0]):
                best = (node, plan)
            if found >= wanted:
                break
        start = (start + processed) % n
        if best is not None:
            cluster.move(best[0], best[1].after)
            allocated += demand.gpu_total_milli
        if at_full is None and arrived >= capacity:
            at_full = allocated / capacity
    end = allocated / capacity
    return (end if at_full is None else at_full), end


def bench_sampling(args: argparse.Namespace) -> int:
    from carpool.core import scoring
    from carpool.replay import simulation

    nodes = simulation.parse_nodes_csv(NODES_CSV.read_text())
    print(f"{'trace':<12} {'percentage':>10} {'at 100 %':>9} {'at end':>8}  (medians of "
          f"{args.seeds} seeds, Carpool's policy, {len(nodes)} nodes)")
    for trace in args.traces.split(","):
        pods = simulation.parse_pods_csv(traces.pod_list(trace).read_text())
        workload = simulation.target_workload(pods)
        for percentage in (int(p) for p in args.percentages.split(",")):
            results = []
            for seed in range(args.seeds):
                sequence = simulation.arrivals(pods, seed, simulation.capacity_milli(nodes))
                scorer = scoring.Scorer(scoring.PRESETS["carpool"], workload,
                                        simulation.gpu_supply(nodes))
                results.append(sampled_replay(nodes, sequence, scorer, percentage))
            full = statistics.median(r[0] for r in results)
            end = statistics.median(r[1] for r in results)
            print(f"{trace:<12} {percentage or 'adaptive':>10} {100 * full:>9.2f} "
                  f"{100 * end:>8.2f}", flush=True)
    return 0


# --- a new shape's first pass, in process ---------------------------------------------------


def bench_cold_passes(args: argparse.Namespace) -> int:
    """What a demand shape's first filter costs at `--nodes`, after `--pods` pods of trace
    shapes were placed through the extender (filter, then bind: nodes fill and their
    profiles diverge). Each round starts new scorers with an empty memo, as a change of the
    target workload does, and times one filter per distinct trace shape (every node
    named), in this process with the collector off, so only the placement code is timed."""
    from carpool.extender.fake import LoopFakeCluster
    from carpool.extender.ranking import Ranker
    from carpool.extender.service import Extender, Settings
    from carpool.extender.wire import decode_binding_args, decode_extender_args, decode_pod

    cache, watch = openb_cache(args.nodes)
    cluster = LoopFakeCluster(on_change=watch)
    extender = Extender(cache, cluster, Settings(filter_best=SHIPPED_FILTER_BEST,
                                                 bounded_search=args.search != "full"))
    names = cache.node_names()
    rng = random.Random(args.seed)
    shapes = pod_shapes(args.nodes)

    async def run_blocking(fn: Any, *fn_args: Any) -> Any:
        return fn(*fn_args)

    placed: list[dict[str, Any]] = []

    async def fill() -> None:
        for i in range(args.pods):
            pod = pod_manifest(f"fill-{i:05d}", rng.choice(shapes))
            placed.append(pod)
            cluster.add_pod(pod)
            chosen = extender.filter(decode_extender_args({"Pod": pod, "NodeNames": names}))
            if chosen["NodeNames"]:
                meta = pod["metadata"]
                await extender.bind_async(decode_binding_args({
                    "PodName": meta["name"], "PodNamespace": meta["namespace"],
                    "PodUID": meta["uid"], "Node": chosen["NodeNames"][0]}), run_blocking)
            while extender.warm(0.01):
                pass

    started = time.perf_counter()
    asyncio.run(fill())
    distinct = list({(s["count"], s["memory_gib"], s["cores"], s["models"],
                      s.get("isolation", "")): s for s in shapes}.values())
    print(f"{args.pods} pods placed in {time.perf_counter() - started:.1f} s "
          f"({cache.counts()['holds']} holding GPUs); {len(distinct)} distinct shapes")
    gc.collect()
    gc.freeze()
    gc.disable()
    per_shape: list[list[float]] = [[] for _ in distinct]
    for _ in range(args.rounds):
        # a new ranker that has learnt the same workload: new scorers, an empty memo
        ranker = Ranker(extender.settings.scoring, extender.settings.learn_workload)
        ranker.index = extender.ranker.index  # the nodes' index is the cache's, kept
        for pod in placed:
            ranker.observe(decode_pod(pod))
        ranker.set_supply(cache.supply())
        extender.ranker = ranker
        for i, shape in enumerate(distinct):
            body = decode_extender_args({"Pod": pod_manifest(f"cold-{i}", shape),
                                         "NodeNames": names})
            started = time.perf_counter()
            extender.filter(body)
            per_shape[i].append((time.perf_counter() - started) * 1000)
    gc.enable()
    best = sorted(min(times) for times in per_shape)
    print(f"first filter of a shape, ms (best of {args.rounds} rounds per shape): "
          f"min {best[0]:.1f}, median {statistics.median(best):.1f}, max {best[-1]:.1f}, "
          f"{statistics.median(best) * 1000 / len(names):.1f} us per node at the median")
    for shape, times in sorted(zip(distinct, per_shape, strict=True),
                               key=lambda x: -min(x[1]))[:5]:
        print(f"  slowest: {shape['count']} GPU(s), {shape['memory_gib']} GiB, "
              f"{shape['cores']} % cores, {shape.get('isolation') or 'mps'}: "
              f"{min(times):.1f} ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="scheduling loops at once (kube-scheduler runs one per profile)")
    parser.add_argument("--api-delay-ms", type=float, default=2.0)
    parser.add_argument("--filter-best", type=int, default=SHIPPED_FILTER_BEST,
                        help="the extender's --filter-best (0: filter passes every node that "
                             "fits, and the loop calls prioritize); default %(default)s, as "
                             "shipped")
    parser.add_argument("--search", choices=("bounded", "full", "both"), default="bounded",
                        help="how filter finds its best nodes: the shipped bounded search, "
                             "scoring every candidate (Settings.bounded_search off), or both, "
                             "alternated run by run (with --runs)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the load; with --search both, each setting this often")
    parser.add_argument("--port", type=int, default=18181)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-null", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", default="", help=argparse.SUPPRESS)
    parser.add_argument("--null-extender", action="store_true",
                        help="(--cluster) also a scheduler with an extender that does the "
                             "least an extender can: the protocol's own cost")
    parser.add_argument("--cluster", action="store_true",
                        help="end to end on the local cluster: pods/s with vs without extender")
    parser.add_argument("--nodes", type=int,
                        help=f"GPU nodes: {OPENB_NODES} (the default) are openb's, any other "
                             f"count a synthesised cluster of 8-GPU nodes in openb's model mix "
                             f"with mixed sharing modes; KWOK nodes for --cluster (default "
                             f"1000)")
    parser.add_argument("--keep-nodes", default="", metavar="ID",
                        help="(--cluster) name the nodes by ID, reuse them if they exist and "
                             "leave them for the next run (saves minutes when comparing)")
    parser.add_argument("--percentage", type=int,
                        default=devcluster.CARPOOL_PERCENTAGE_OF_NODES,
                        help="percentageOfNodesToScore of both runs' profiles (--cluster; "
                             "default %(default)s, as Carpool's profile ships; 0: the "
                             "scheduler's adaptive default)")
    parser.add_argument("--extender-arg", action="append", default=[],
                        help="an argument for the extender (--cluster), e.g. "
                             "--extender-arg=--filter-best=0; repeatable")
    parser.add_argument("--sampling", action="store_true",
                        help="replay the openb traces with Carpool choosing among "
                             "kube-scheduler's sample of feasible nodes only")
    parser.add_argument("--seeds", type=int, default=5, help="(--sampling)")
    parser.add_argument("--traces", default="default,gpuspec10", help="(--sampling)")
    parser.add_argument("--percentages", default="100,0,10",
                        help="(--sampling) percentageOfNodesToScore values; 0: adaptive")
    parser.add_argument("--cold-passes", action="store_true",
                        help="time a new shape's first filter in process, after --pods pods "
                             "were placed")
    parser.add_argument("--rounds", type=int, default=3, help="(--cold-passes)")
    args = parser.parse_args()
    if args.cold_passes:
        args.nodes = args.nodes or OPENB_NODES
        return bench_cold_passes(args)
    if args.sampling:
        return bench_sampling(args)
    if args.serve_null:
        serve_null(args.port, args.kubeconfig)
        return 0
    if args.cluster:
        args.nodes = args.nodes or 1000
        return bench_cluster(args)
    args.nodes = args.nodes or OPENB_NODES
    if args.serve:
        serve(args.port, args.api_delay_ms / 1000, args.filter_best, args.nodes,
              args.search == "bounded")
        return 0
    inventories = cluster_inventories(args.nodes)
    node_names = [inv.name for inv in inventories]
    rng = random.Random(args.seed)
    shapes = pod_shapes(args.nodes)
    pods = [pod_manifest(f"pod-{i:05d}", rng.choice(shapes)) for i in range(args.pods)]
    print(f"extender cache: {len(inventories)} nodes, "
          f"{sum(len(i.gpus) for i in inventories)} GPUs; concurrency {args.concurrency}; "
          f"fake API server delay {args.api_delay_ms} ms per call; filter passes "
          f"{args.filter_best or 'every fitting node'}")
    settings = ["bounded", "full"] if args.search == "both" else [args.search]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for run in range(args.runs):
        for search in settings if run % 2 == 0 else settings[::-1]:  # alternated
            print(f"--- run {run + 1}, search {search}", flush=True)
            results[search].append(one_run(args, search, pods, node_names))
    if args.runs > 1 or len(settings) > 1:
        print(f"{'search':<8} {'runs':>4} {'filter p50':>20} {'filter p99':>20} "
              f"{'bind p50':>20} {'bind p99':>20}  (ms, median [range])")
        for search, runs in results.items():
            cells = []
            for key in ("filter p50", "filter p99", "bind p50", "bind p99"):
                values = [r[key] for r in runs]
                cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}–"
                             f"{max(values):.2f}]")
            print(f"{search:<8} {len(runs):>4} " + " ".join(f"{c:>20}" for c in cells))
    return 0


def one_run(args: argparse.Namespace, search: str, pods: list[dict[str, Any]],
            node_names: list[str]) -> dict[str, float]:
    """One load against a fresh extender process; the percentiles it printed."""
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--port", str(args.port), "--api-delay-ms",
         str(args.api_delay_ms), "--filter-best", str(args.filter_best),
         "--nodes", str(args.nodes), "--search", search])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                import urllib.request
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/livez", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the extender did not start") from None
                time.sleep(0.2)
        stolen = _stolen_ms()
        cpu_before = _cpu_seconds(server.pid)
        timings = asyncio.run(load(args.port, pods, node_names, args.concurrency))
        print(f"extender process CPU per pod (all its threads, HTTP included): "
              f"{1000 * (_cpu_seconds(server.pid) - cpu_before) / len(pods):.2f} ms")
        print(f"CPU time the VM's host took from this machine during the load (steal): "
              f"{_stolen_ms() - stolen:.0f} ms; load average {os.getloadavg()[0]:.1f}")
    finally:
        server.terminate()
        server.wait(10)
    print(f"{'verb':<18} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    out = {}
    for verb, values in timings.items():
        if values:
            ms = [v * 1000 for v in values]
            out[f"{verb} p50"], out[f"{verb} p99"] = percentile(ms, 0.5), percentile(ms, 0.99)
            print(f"{verb:<18} {len(ms):>6} {percentile(ms, 0.5):>8.2f} "
                  f"{percentile(ms, 0.99):>8.2f} {statistics.fmean(ms):>8.2f}")
    return out


if __name__ == "__main__":
    sys.exit(main())
