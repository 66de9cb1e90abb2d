"""Where a KWOK cluster's node setup spends its time: create, Ready, steady heartbeats, delete.

On the devcluster named by `--cluster` (brought up if needed), `--nodes` simulated GPU nodes
(8 GPUs each, as bench/peers.py and bench/admission.py make them) are applied through
`carpool_testbed.simnodes.apply_nodes`, then the bench waits until every one is Ready,
watches the idle cluster for `--steady` seconds, and deletes them with
`simnodes.delete_nodes`. For each phase it prints the wall-clock time, the API server's writes
by `VERB resource[/subresource]` (apiserver_request_total, every client) and the CPU seconds
of each cluster process, so the cost of node objects, KWOK's Ready stage, node leases and
status heartbeats shows apart.

    CARPOOL_CLUSTER=<name> .venv/bin/python bench/kwok_nodes.py --nodes 1000 \
        --cluster <name> --extender-port <port> [--steady 60] [--delete-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from carpool.kube.client import Api
from carpool.kube.resources import NODES
from carpool_testbed import crds, devcluster, simnodes
from carpool_testbed.scripts import load_script

HERE = Path(__file__).resolve().parent


admission = load_script(HERE / "admission.py")


class Phase:
    """Wall time, API writes and per-process CPU between `start` and `stop`."""

    def __init__(self, name: str, api: Any, pids: dict[str, int]) -> None:
        self.name, self.api, self.pids = name, api, pids
        self.t0 = time.monotonic()
        self.writes0 = admission._api_requests(api)
        self.cpu0 = {k: admission._cpu_seconds(p) for k, p in pids.items()}

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        writes1 = admission._api_requests(self.api)
        cpu = {k: round(admission._cpu_seconds(p) - self.cpu0[k], 1)
               for k, p in self.pids.items()}
        writes = {k: v - self.writes0.get(k, 0.0) for k, v in writes1.items()
                  if v > self.writes0.get(k, 0.0)}
        top = dict(sorted(((k, round(v)) for k, v in writes.items()),
                          key=lambda kv: -kv[1])[:8])
        return {"phase": self.name, "wall_s": round(wall, 1),
                "writes": round(sum(writes.values())),
                "writes_per_s": round(sum(writes.values()) / max(wall, 1e-9), 1),
                "top_writes": top, "cpu_s": cpu}


def ready_count(kube: Api, prefix: str) -> int:
    listed, _ = kube.list_all(NODES.path(), {"labelSelector": f"{simnodes.LABEL_SIMULATED}=true"})
    ready = 0
    for node in listed:
        if not str((node.get("metadata") or {}).get("name", "")).startswith(prefix):
            continue
        for condition in (node.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Ready" and condition.get("status") == "True":
                ready += 1
    return ready


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    os.environ[devcluster.EXTENDER_PORT_ENV] = str(args.extender_port)
    cluster = devcluster.up(args.cluster, port=args.extender_port,
                            progress=devcluster.Progress(sys.stderr))
    api = cluster.api()
    kube = Api.of(api)
    crds.apply_crds(api)
    pids = {**admission._component_pids(args.cluster), "bench (this client)": os.getpid()}
    tag = f"kn{int(time.time()) % 100000}"
    prefix = f"bench-{tag}-"
    nodes = simnodes.parse_nodes({"nodes": [{
        "name": f"{prefix}n{i}", "zone": "zone-a", "sharing": "mps",
        "labels": admission.topology_labels(i),
        "gpus": [{"model": f"BENCH{tag}", "count": 8, "memoryTotalMiB": 141 * 1024}]}
        for i in range(args.nodes)]})
    results = []
    phase = Phase("create", api, pids)
    simnodes.apply_nodes(api, nodes)
    results.append(phase.stop())
    print(json.dumps(results[-1]), file=sys.stderr)
    phase = Phase("until Ready", api, pids)
    deadline = time.monotonic() + args.ready_timeout
    while (count := ready_count(kube, prefix)) < args.nodes and time.monotonic() < deadline:
        time.sleep(2)
    results.append({**phase.stop(), "ready": count})
    print(json.dumps(results[-1]), file=sys.stderr)
    phase = Phase("steady", api, pids)
    time.sleep(args.steady)
    results.append(phase.stop())
    print(json.dumps(results[-1]), file=sys.stderr)
    phase = Phase("delete", api, pids)
    simnodes.delete_nodes(api, [n.name for n in nodes])
    results.append(phase.stop())
    print(json.dumps(results[-1]), file=sys.stderr)
    if args.delete_cluster:
        devcluster.delete(devcluster.ClusterPaths.for_name(args.cluster),
                          cluster.bin_dir)
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| phase | wall s | API writes | writes/s | most writes | CPU s |",
             "|---|---:|---:|---:|---|---|"]
    for r in results:
        top = ", ".join(f"{k} {v}" for k, v in list(r["top_writes"].items())[:4])
        cpu = ", ".join(f"{k} {v}" for k, v in sorted(r["cpu_s"].items(), key=lambda kv: -kv[1])
                        if v >= 0.5)
        lines.append(f"| {r['phase']} | {r['wall_s']} | {r['writes']} | {r['writes_per_s']} "
                     f"| {top} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cluster", default=devcluster.cluster_name())
    parser.add_argument("--extender-port", type=int, default=devcluster.extender_port())
    parser.add_argument("--steady", type=float, default=60.0,
                        help="seconds to watch the idle cluster once every node is Ready")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--delete-cluster", action="store_true")
    args = parser.parse_args()
    print(table(run(args)))


if __name__ == "__main__":
    main()
