"""Extender latency at the openb cluster's scale: filter, prioritize and bind over HTTP.

The 1,213 openb GPU nodes (6,212 GPUs) are loaded straight into the extender's cache (no
cluster); a child process serves the real aiohttp app; this process plays kube-scheduler:
for each pod (shapes drawn from the openb trace) it POSTs /filter with all node names,
/prioritize with the nodes that passed, and /bind to the best one, with `--concurrency`
scheduling loops at once. The API server behind bind is the in-memory fake, with
`--api-delay-ms` added per call (a local API server answers in a few ms); a bound pod is
reported Running to the cache at once, as KWOK would. Prints p50/p99 per verb.

    PYTHONSAFEPATH=1 .venv/bin/python bench/extender.py [--pods 2000] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB, GPU_MODEL_SLOWDOWN_C
from carpool.core.resources import Gpu, NodeInventory

TRACES = Path(os.environ.get("CARPOOL_TRACES",
                             Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"))
NODES_CSV = TRACES / "openb_node_list_gpu_node.csv"
PODS_CSV = TRACES / "openb_pod_list_default.csv"


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


# --- the server (child process) -------------------------------------------------------------


def serve(port: int, api_delay_s: float) -> None:
    from aiohttp import web

    from carpool.extender.cache import ClusterCache
    from carpool.extender.fake import FakeCluster
    from carpool.extender.server import make_app
    from carpool.extender.service import Extender, Settings

    cache = ClusterCache()
    for inventory in openb_inventories():
        cache.put_inventory(inventory)
    for kind in ("nodes", "gpunodes", "pods"):
        cache.mark_synced(kind)

    def watch(event: str, pod: dict[str, Any]) -> None:
        if pod["spec"].get("nodeName"):
            pod["status"]["phase"] = "Running"  # KWOK starts bound pods at once
        cache.apply_pod(event, pod, time.time())

    cluster = FakeCluster(delay_s=api_delay_s, on_change=watch)
    extender = Extender(cache, cluster, Settings())
    app = make_app(extender)

    async def add_pods(request: web.Request) -> web.Response:
        for pod in await request.json():
            cluster.add_pod(pod)
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"memo_hits": extender.ranker.hits,
                                  "workload_rebuilds": extender.ranker.workload_rebuilds,
                                  "memo_misses": extender.ranker.misses,
                                  **cache.counts()})

    app.router.add_post("/bench/pods", add_pods)
    app.router.add_get("/bench/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the load (this process) ----------------------------------------------------------------


def pod_manifest(name: str, shape: dict[str, Any]) -> dict[str, Any]:
    annotations = {"carpool.dev/models": shape["models"]} if shape["models"] else {}
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


async def load(port: int, pods: list[dict[str, Any]], node_names: list[str],
               concurrency: int) -> dict[str, list[float]]:
    base = f"http://127.0.0.1:{port}"
    timings: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": [],
                                       "filter+prioritize": []}
    outcomes = {"bound": 0, "unschedulable": 0, "bind_error": 0}
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for pod in pods:
        queue.put_nowait(pod)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.post(f"{base}/bench/pods", json=pods) as resp:
            assert resp.status == 200

        async def post(verb: str, body: Any) -> tuple[Any, float]:
            data = json.dumps(body)
            started = time.perf_counter()
            async with session.post(f"{base}/{verb}", data=data) as resp:
                result = await resp.json()
            return result, time.perf_counter() - started

        async def scheduler_loop() -> None:
            while not queue.empty():
                pod = queue.get_nowait()
                filtered, t_filter = await post("filter", {"Pod": pod, "NodeNames": node_names})
                feasible = filtered["NodeNames"]
                timings["filter"].append(t_filter)
                if not feasible:
                    outcomes["unschedulable"] += 1
                    continue
                scores, t_prio = await post("prioritize", {"Pod": pod, "NodeNames": feasible})
                timings["prioritize"].append(t_prio)
                timings["filter+prioritize"].append(t_filter + t_prio)
                best = max(scores, key=lambda s: (s["Score"], s["Host"]))["Host"]
                meta = pod["metadata"]
                result, t_bind = await post("bind", {
                    "PodName": meta["name"], "PodNamespace": meta["namespace"],
                    "PodUID": meta["uid"], "Node": best})
                timings["bind"].append(t_bind)
                outcomes["bound" if not result["Error"] else "bind_error"] += 1

        started = time.perf_counter()
        await asyncio.gather(*(scheduler_loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        async with session.get(f"{base}/bench/stats") as resp:
            stats = await resp.json()
    print(f"pods {len(pods)}: {outcomes}; {len(pods) / elapsed:.0f} pods/s through "
          f"filter+prioritize+bind; server {stats}")
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--api-delay-ms", type=float, default=2.0)
    parser.add_argument("--port", type=int, default=18181)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.api_delay_ms / 1000)
        return 0
    inventories = openb_inventories()
    node_names = [inv.name for inv in inventories]
    rng = random.Random(args.seed)
    shapes = openb_pod_shapes()
    pods = [pod_manifest(f"pod-{i:05d}", rng.choice(shapes)) for i in range(args.pods)]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--port", str(args.port), "--api-delay-ms",
         str(args.api_delay_ms)], env=dict(os.environ, PYTHONSAFEPATH="1"))
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
        print(f"extender cache: {len(inventories)} nodes, "
              f"{sum(len(i.gpus) for i in inventories)} GPUs; concurrency {args.concurrency}; "
              f"fake API server delay {args.api_delay_ms} ms per call")
        timings = asyncio.run(load(args.port, pods, node_names, args.concurrency))
    finally:
        server.terminate()
        server.wait(10)
    print(f"{'verb':<18} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for verb, values in timings.items():
        if values:
            ms = [v * 1000 for v in values]
            print(f"{verb:<18} {len(ms):>6} {percentile(ms, 0.5):>8.2f} "
                  f"{percentile(ms, 0.99):>8.2f} {statistics.fmean(ms):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
