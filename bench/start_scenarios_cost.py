"""What start scenarios cost one admission cycle at scale (`AdmissionConfig.start_scenarios`).

Builds one `ClusterSnapshot`: `--nodes` nodes of 8 GPUs (H100 80 GiB and H200 141 GiB, one in
four exclusive), every GPU held by a running job (a whole GPU or an MPS share), `--waiting`
queued jobs of four classes and shapes, all of `--templates` templates whose learned run
times have a spread (P10-P90 e^-+0.5), so every running job's end is drawn in the scenarios.
Then runs `queueing.admission_cycle` on it with each setting of `--scenarios`, alternated,
`--repeat` times, and prints per setting the median, lowest and highest seconds (wall clock
and CPU of the process) of one cycle. No memo across cycles, as the operator runs it.

    .venv/bin/python bench/start_scenarios_cost.py [--nodes 2000] [--waiting 20000]
        [--scenarios 0,9] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from carpool.core.jobs import ClusterSnapshot, DurationEstimate, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, admission_cycle, extender_placer
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
    Phase,
)
from carpool.core.run_times import Z80, LearnKey

GIB = 1024
NOW = 1_800_000_000.0
PROJECTS = ("vision", "speech", "search", "ads")


def snapshot(nodes: int, waiting: int, templates: int, seed: int) -> ClusterSnapshot:
    rng = random.Random(seed)
    states: dict[str, NodeState] = {}
    jobs: list[Job] = []
    for n in range(nodes):
        name = f"n{n:05d}"
        model, memory = ("H100", 80) if n % 2 else ("H200", 141)
        exclusive = n % 4 == 3
        sharing = (frozenset({Isolation.EXCLUSIVE}) if exclusive else
                   frozenset({Isolation.MPS, Isolation.EXCLUSIVE}))
        gpus = tuple(Gpu(g, f"{name}-g{g}", model, memory * GIB) for g in range(8))
        states[name] = NodeState(NodeInventory(name, gpus, sharing=sharing))
        for gpu in gpus:
            key = f"{PROJECTS[len(jobs) % 4]}/r{len(jobs)}-run"
            if exclusive:
                request = GpuRequest(1, memory * GIB, 0, Isolation.EXCLUSIVE)
                grant = GpuGrant(gpu.uuid, memory * GIB, 100, exclusive=True)
            else:
                request = GpuRequest(1, memory * GIB // 2, 50)
                grant = GpuGrant(gpu.uuid, memory * GIB // 2, 50)
            started = NOW - rng.uniform(0, 3 * 3600)
            jobs.append(Job(key, key.split("/")[0], rng.choice(list(JobClass)), request,
                            started - 60, rng.uniform(3600, 4 * 3600), phase=Phase.RUNNING,
                            node=name, grants=(grant,), attempts=1,
                            runs=(RunRecord(1, started, None, 1.0),),
                            template=f"t{rng.randrange(templates)}"))
    for i in range(waiting):
        project = PROJECTS[i % 4]
        if rng.random() < 0.45:
            request = GpuRequest(1, rng.choice([16, 24, 32, 48]) * GIB, 50)
        else:
            request = GpuRequest(rng.choice([1, 1, 2, 4]), 40 * GIB, 0, Isolation.EXCLUSIVE)
        jobs.append(Job(f"{project}/q{i}-run", project, rng.choice(list(JobClass)), request,
                        NOW - rng.uniform(0, 3600), rng.uniform(3600, 4 * 3600),
                        template=f"t{rng.randrange(templates)}"))
    learned: dict[LearnKey, DurationEstimate] = {(p, f"t{t}"): DurationEstimate(
        2 * 3600.0, 1.0, 20, math.log(2 * 3600.0), 0.0, 0.1, 0.2, -0.5 * Z80, 0.5 * Z80)
        for p in PROJECTS for t in range(templates)}
    quotas = {p: ProjectQuota(p, frozenset({p}), guaranteed_gpus=nodes * 2, borrowing=True)
              for p in PROJECTS}
    return ClusterSnapshot(NOW, tuple(jobs), quotas, states, learned=learned)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--waiting", type=int, default=20000)
    parser.add_argument("--templates", type=int, default=50)
    parser.add_argument("--scenarios", default="0,9")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scene = snapshot(args.nodes, args.waiting, args.templates, args.seed)
    settings = [int(s) for s in args.scenarios.split(",")]
    times: dict[int, list[tuple[float, float]]] = {s: [] for s in settings}
    placer = extender_placer()
    for _ in range(args.repeat):
        for setting in settings:
            config = AdmissionConfig(node_placer=placer, start_scenarios=setting)
            wall, cpu = time.perf_counter(), time.process_time()
            result = admission_cycle(scene, config)
            times[setting].append((time.perf_counter() - wall, time.process_time() - cpu))
            print(json.dumps({"scenarios": setting, "wall_s": round(times[setting][-1][0], 2),
                              "cpu_s": round(times[setting][-1][1], 2),
                              "waits": len(result.waits)}), flush=True)
    for setting, found in times.items():
        walls, cpus = [w for w, _ in found], [c for _, c in found]
        print(f"scenarios {setting}: wall {statistics.median(walls):.2f} s "
              f"({min(walls):.2f}-{max(walls):.2f}), CPU {statistics.median(cpus):.2f} s "
              f"({min(cpus):.2f}-{max(cpus):.2f}), {args.repeat} cycles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
