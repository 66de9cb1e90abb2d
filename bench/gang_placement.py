"""Gang placement quality: how often Carpool puts a gang into the smallest domain that can hold
it, against an exact search, on generated clusters.

Each instance is a cluster of `--racks` racks of 4 nodes with 8 exclusive GPUs each: two
nodes per NVLink island, two racks per block, one zone (the labels of `core.topology`). Every
GPU is busy with a probability drawn per instance from 0.2-0.8; then one gang arrives: 2-16
workers of 1, 2, 4 or 8 GPUs each (`--shapes`; all workers of a gang alike, or, with
`--mixed`, each its own). Carpool places it with `core.gangs.place_gang` and the extender's own node
placer (`queueing.extender_placer`), exactly as the admission cycle does. The exact answer
tries every domain, smallest level first, with a complete search (bin packing of the
workers' GPU counts into the nodes' free GPUs, largest first, symmetric nodes tried once),
so it knows the smallest level at which the gang fits at all.

Reported, over instances where the gang fits somewhere (median of nothing: every instance
counts once; the figures are deterministic for a seed range):

- placed: the share Carpool places at all (the exact search finds a fit in every one);
- smallest level: the share placed at the smallest level that holds the gang;
- tightest domain: the share placed, at that level, in a domain with no more idle GPUs than
  any other domain of the level that holds the gang (the best fit the exact search finds);
- level gap: the mean number of levels above that smallest one (0 is optimal);
- the same by gang size.

    .venv/bin/python bench/gang_placement.py [--instances 2000] [--racks 4] [--mixed]
        [--shapes 1,2,4,8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

from carpool.core.gangs import place_gang
from carpool.core.placement import NodeState
from carpool.core.queueing import extender_placer
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, Isolation, NodeInventory
from carpool.core.topology import (
    TOPOLOGY_LABELS,
    TopologyLevel,
    domain_index,
)

GIB = 1024
GPUS_PER_NODE = 8
NODES_PER_RACK = 4
NODES_PER_ISLAND = 2
RACKS_PER_BLOCK = 2
SHAPES = (1, 2, 4, 8)


def cluster(rng: random.Random, racks: int) -> dict[str, NodeState]:
    """A cluster of `racks` racks, each GPU busy with one probability for the instance."""
    busy = rng.uniform(0.2, 0.8)
    out = {}
    for n in range(racks * NODES_PER_RACK):
        name = f"n{n:03d}"
        rack = n // NODES_PER_RACK
        labels = frozenset({
            (TOPOLOGY_LABELS[TopologyLevel.NVLINK_ISLAND], f"i{n // NODES_PER_ISLAND}"),
            (TOPOLOGY_LABELS[TopologyLevel.RACK], f"r{rack}"),
            (TOPOLOGY_LABELS[TopologyLevel.BLOCK], f"b{rack // RACKS_PER_BLOCK}"),
            (TOPOLOGY_LABELS[TopologyLevel.ZONE], "z0")})
        gpus = tuple(Gpu(i, f"{name}-g{i}", "H100", 80 * GIB) for i in range(GPUS_PER_NODE))
        held = tuple(GpuGrant(g.uuid, g.memory_total_mib, 100, exclusive=True)
                     for g in gpus if rng.random() < busy)
        out[name] = NodeState(NodeInventory(name, gpus, labels=labels), held)
    return out


def gang(rng: random.Random, mixed: bool, shapes: Sequence[int]) -> tuple[GpuRequest, ...]:
    workers = rng.randint(2, 16)
    if not mixed:
        count = rng.choice(shapes)
        return tuple(GpuRequest(count, 10 * GIB, isolation=Isolation.EXCLUSIVE)
                     for _ in range(workers))
    return tuple(GpuRequest(rng.choice(shapes), 10 * GIB, isolation=Isolation.EXCLUSIVE)
                 for _ in range(workers))


def packs(items: Sequence[int], bins: Sequence[int]) -> bool:
    """Whether every item (GPUs per worker) goes into some bin (free GPUs per node), each bin
    holding at most its size: a complete search, largest items first, bins of equal free
    space tried once per item."""
    items = sorted(items, reverse=True)
    free = sorted(bins, reverse=True)
    if sum(items) > sum(free) or (items and items[0] > free[0]):
        return False

    def place(i: int) -> bool:
        if i == len(items):
            return True
        tried: set[int] = set()
        for b, room in enumerate(free):
            if room < items[i] or room in tried:
                continue
            tried.add(room)
            free[b] -= items[i]
            if place(i + 1):
                free[b] += items[i]
                return True
            free[b] += items[i]
        return False

    return place(0)


def smallest_level(workers: Sequence[GpuRequest], states: dict[str, NodeState]
                   ) -> tuple[TopologyLevel, int] | None:
    """The smallest level with a domain that can hold every worker, and the fewest idle
    GPUs of such a domain at that level (exact)."""
    free = {name: sum(1 for f in s.free() if f.grants == 0) for name, s in states.items()}
    counts = [w.count for w in workers]
    index = domain_index(s.inventory for s in states.values())
    for level in TopologyLevel:
        fits = [sum(free[n] for n in d.nodes) for d in index[level]
                if packs(counts, [free[n] for n in d.nodes])]
        if fits:
            return level, min(fits)
    return None


def run(instances: int, racks: int, mixed: bool, shapes: Sequence[int], seed: int
        ) -> dict[str, object]:
    placer = extender_placer()
    rows: list[tuple[int, bool, int, bool]] = []  # (workers, placed, level gap, tightest)
    started = time.process_time()
    for i in range(instances):
        rng = random.Random(seed + i)
        states = cluster(rng, racks)
        workers = gang(rng, mixed, shapes)
        best = smallest_level(workers, states)
        if best is None:
            continue
        found = place_gang(workers, states, placer)
        if found is None:
            rows.append((len(workers), False, -1, False))
            continue
        index = domain_index(s.inventory for s in states.values())
        domain = next(d for d in index[found.level] if d.name == found.domain)
        idle = sum(1 for n in domain.nodes for f in states[n].free() if f.grants == 0)
        gap = int(found.level) - int(best[0])
        rows.append((len(workers), True, gap, gap == 0 and idle <= best[1]))
    cpu_s = time.process_time() - started
    return {"rows": rows, "cpu_s": cpu_s, "instances": instances}


def report(result: dict[str, object], command: str) -> str:
    rows = result["rows"]
    assert isinstance(rows, list)
    lines = [f"`{command}`: {result['instances']} instances, {len(rows)} where the gang fits "
             f"somewhere, {result['cpu_s']:.1f} CPU-seconds.", "",
             "| gang size | gangs | placed | in the smallest level | in the tightest domain "
             "| mean level gap |",
             "|---|---:|---:|---:|---:|---:|"]
    buckets = (("2-4", 2, 4), ("5-8", 5, 8), ("9-16", 9, 16), ("all", 2, 16))
    for label, low, high in buckets:
        part = [r for r in rows if low <= r[0] <= high]
        if not part:
            continue
        placed = [r for r in part if r[1]]
        best = [r for r in placed if r[2] == 0]
        tightest = [r for r in placed if r[3]]
        gap = statistics.fmean(r[2] for r in placed) if placed else 0.0
        lines.append(f"| {label} | {len(part)} | {100 * len(placed) / len(part):.1f} % | "
                     f"{100 * len(best) / len(part):.1f} % | "
                     f"{100 * len(tightest) / len(part):.1f} % | {gap:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=2000)
    parser.add_argument("--racks", type=int, default=4)
    parser.add_argument("--mixed", action="store_true",
                        help="each worker its own GPU count (default: all alike)")
    parser.add_argument("--shapes", default=",".join(map(str, SHAPES)),
                        help="GPUs per worker to draw from, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = [int(s) for s in args.shapes.split(",") if s]
    if not shapes or any(not 1 <= s <= GPUS_PER_NODE for s in shapes):
        parser.error(f"--shapes: GPUs per worker must be within 1..{GPUS_PER_NODE}")
    command = "bench/gang_placement.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(run(args.instances, args.racks, args.mixed, shapes, args.seed),
                 command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
