"""Placement quality on the openb traces under the FGD paper's protocol, all policies, one run.

Replays every trace variant for every policy and seed through `carpool.core.scoring` (the
extender's code) and prints median GPU allocation at 100 % arrival and at the end next to the
FGD paper's published medians (Weng et al., USENIX ATC'23), with ratios and run time.
`--write` puts the table into docs/benchmarks.md (its "Placement quality" section).

    .venv/bin/python bench/placement.py [--seeds 10] [--jobs 2] [--write]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from carpool.replay import simulation
from carpool_testbed import simulate
from carpool_testbed.simulate import Outcome, Run, replay_all
from carpool_testbed.traces import NODE_LIST, traces_dir

ALL_POLICIES, PEER_POLICIES = simulate.ALL_POLICIES, simulate.PEER_POLICIES

TRACES = ("default", "gpushare40", "multigpu20", "gpuspec10")
# Published medians (%), FGD paper; "full" = at 100 % arrival, "end" = at 130 %.
PUBLISHED: dict[tuple[str, str], dict[str, float]] = {
    ("default", "end"): {"fgd": 95.40, "best-fit": 93.11, "dot-product": 90.80,
                         "random": 87.38},
    ("default", "full"): {"best-fit": 92.9},
    ("gpushare40", "full"): {"fgd": 93.96, "best-fit": 91.44},
    ("multigpu20", "full"): {"fgd": 95.53, "best-fit": 93.73},
    ("gpuspec10", "full"): {"fgd": 94.66, "best-fit": 93.10},
}
SECTION = "## Placement quality (openb trace, FGD protocol)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def published(trace: str, point: str, policy: str) -> float | None:
    """The paper's figure for this policy; Carpool is compared with FGD's."""
    figures = PUBLISHED.get((trace, point), {})
    return figures.get("fgd" if policy == "carpool" else policy)


def cell(ours: float, paper: float | None) -> tuple[str, str]:
    if paper is None:
        return f"{ours:.2f}", "–"
    return f"{ours:.2f}", f"{paper:.2f} ({ours / paper:.3f}×)"


def build_table(outcomes: list[Outcome], seeds: int) -> list[str]:
    lines = ["| trace | policy | at 100 % | paper (ratio) | at end | paper (ratio) | placed "
             "| dropped | CPU s/run |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for trace in TRACES:
        carpool = [o.result for o in outcomes
                   if o.run.policy == "carpool" and Path(o.run.pods_csv).stem.endswith(trace)]
        ours = simulation.summarize("carpool", carpool) if carpool else None
        for policy in ALL_POLICIES:
            mine = [o for o in outcomes
                    if o.run.policy == policy and Path(o.run.pods_csv).stem.endswith(trace)]
            if not mine:
                continue
            summary = simulation.summarize(policy, [o.result for o in mine])
            full, full_paper = cell(100 * summary.median_at_full,
                                    published(trace, "full", policy))
            end, end_paper = cell(100 * summary.median_at_end, published(trace, "end", policy))
            if policy in PEER_POLICIES and ours is not None:  # Carpool / the peer instead
                full_paper = f"Carpool {ours.median_at_full / summary.median_at_full:.3f}×"
                end_paper = f"Carpool {ours.median_at_end / summary.median_at_end:.3f}×"
            placed = sorted(o.result.placed for o in mine)[len(mine) // 2]
            dropped = sorted(o.result.dropped for o in mine)[len(mine) // 2]
            cpu = sum(o.cpu_seconds for o in mine) / len(mine)
            name = (f"**{policy}**" if policy == "carpool"
                    else f"*{policy}*" if policy in PEER_POLICIES else policy)
            lines.append(f"| {trace} | {name} | {full} | {full_paper} | {end} | {end_paper} "
                         f"| {placed} | {dropped} | {cpu:.2f} |")
    lines.append("")
    lines.append(f"Medians over {seeds} seeds (0..{seeds - 1}); allocation = allocated GPU milli "
                 "/ 6,212,000. Ratios: ours / paper's; Carpool's against FGD's; for the peers' "
                 "policies (in italics) Carpool's median / the peer's.")
    lines.extend(["", *verdicts(outcomes)])
    return lines


TARGETS = (("default", "end"), ("gpushare40", "full"), ("multigpu20", "full"),
           ("gpuspec10", "full"))


def verdicts(outcomes: list[Outcome]) -> list[str]:
    """Carpool against FGD's published median, per trace and read-out."""
    out = ["Carpool against FGD's published median —"]
    for trace, point in TARGETS:
        mine = [o.result for o in outcomes
                if o.run.policy == "carpool" and Path(o.run.pods_csv).stem.endswith(trace)]
        paper = published(trace, point, "carpool")
        if not mine or paper is None:
            continue
        summary = simulation.summarize("carpool", mine)
        ours = 100 * (summary.median_at_end if point == "end" else summary.median_at_full)
        label = "at the end" if point == "end" else "at 100 % arrival"
        verdict = "above" if ours > paper else "BELOW"
        out.append(f"- {trace} {label}: {ours:.2f} % vs {paper:.2f} % — {verdict}")
    return out


def write_docs(section_body: list[str]) -> None:
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = SECTION + "\n\n" + "\n".join(section_body).rstrip() + "\n"
    pattern = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    text = (pattern.sub(lambda _: block, text) if pattern.search(text)
            else text.rstrip("\n") + "\n\n" + block)
    DOCS.write_text(text if text.endswith("\n") else text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--policies", default=",".join(simulate.POLICIES),
                        help="comma-separated (default: Carpool's and the published "
                             "baselines); 'peers' stands for the GPU-sharing schedulers' "
                             "policies, 'all' for every policy")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    root = traces_dir()
    nodes_csv = root / NODE_LIST
    traces = [t for t in args.traces.split(",") if t]
    groups = {"peers": PEER_POLICIES, "all": ALL_POLICIES}
    policies = [q for p in args.policies.split(",") if p for q in groups.get(p, (p,))]
    if unknown := [p for p in policies if p not in ALL_POLICIES]:
        parser.error(f"unknown policies {unknown}; choose from {ALL_POLICIES}")
    missing = [p for p in [nodes_csv] + [root / f"openb_pod_list_{t}.csv" for t in traces]
               if not p.is_file()]
    if missing:
        parser.error(f"missing trace files: {', '.join(map(str, missing))} "
                     "(set CARPOOL_TRACES to the openb folder)")
    runs = [Run(str(nodes_csv), str(root / f"openb_pod_list_{trace}.csv"), policy, seed)
            for trace in traces for seed in range(args.seeds) for policy in policies]
    started = time.perf_counter()
    outcomes = replay_all(runs, args.jobs)
    wall = time.perf_counter() - started
    command = (f".venv/bin/python bench/placement.py --seeds {args.seeds} "
               f"--jobs {args.jobs}"
               + (f" --traces {args.traces}" if traces != list(TRACES) else "")
               + (f" --policies {args.policies}" if policies != list(simulate.POLICIES)
                  else ""))
    cpu = sum(o.cpu_seconds for o in outcomes)
    header = [f"`{command}`: {len(runs)} replays ({len(traces)} traces × "
              f"{len(policies)} policies × {args.seeds} seeds), {cpu:.0f} CPU-seconds in all, "
              f"{wall:.0f} s wall on {args.jobs} worker processes ({os.cpu_count()} CPUs; the "
              "figures are deterministic, the machine sets only the time).", ""]
    body = header + build_table(outcomes, args.seeds)
    print("\n".join(body))
    if args.write:
        write_docs([*body, "", *NOTES])
        print(f"\nwrote {DOCS}")
    return 0


NOTES = [
    "Protocol (the FGD paper, Weng et al., USENIX ATC'23): the trace shuffled with the seed, "
    "then pods drawn uniformly with replacement until the next would push the GPU request past "
    "130 % of capacity; no departures or retries; a pod that fits nowhere is dropped; CPU and "
    "memory are hard limits; `gpu_spec` restricts models; a sharing pod needs one GPU with idle "
    "≥ `gpu_milli`, a whole-GPU pod `num_gpu` idle GPUs. Every policy runs through "
    "`carpool.core.scoring.Scorer.plan`, the code the extender's filter and bind use; ties go "
    "to the lowest-numbered node. The trace files are in `traces/openb/`.",
    "",
    "Policies: *random*; *best-fit* (node score 1 − [0.5 cpu_left/128 cores + 0.5 gpu_left/8 "
    "GPUs], tightest GPU); *dot-product* (Tetris, capacity-normalised); *fgd* (least increase "
    "of fragmentation against the target workload, the shapes covering 95 % of the trace's GPU "
    "pods, exact rather than rounded to integer scores); *carpool* (FGD's term, plus an "
    "equal-weight CPU-balance term — idle GPU the node's free CPU could not feed at the "
    "workload's CPU-per-GPU ratio — plus a small model-scarcity term that keeps unconstrained "
    "pods off the models `gpu_spec`-constrained pods need).",
    "",
    "The GPU-sharing schedulers' policies (`carpool.replay.peers`, each written from the peer's "
    "code, cited there by file and function): *hami-NODE-GPU* is HAMi's extender with its "
    "node policy (binpack: the node whose GPUs are most used before the pod, by pods per slot "
    "+ cores + memory; spread: the least) and its GPU policy (binpack: the busiest GPU that "
    "fits; spread: the idlest), at most 10 pods per GPU (deviceSplitCount); HAMi's defaults are "
    "binpack-spread. *gpushare* is Aliyun's extender: kube-scheduler's default scores "
    "(LeastAllocated + BalancedAllocation on CPU and memory) pick the node, then the GPU with "
    "the least free GPU memory that fits. *volcano* is Volcano's GPU-share predicate (the "
    "lowest-indexed GPU with enough free GPU memory) with its default node order (nodeorder's "
    "least-requested + balanced-resource, plus binpack on CPU and memory). A sharing pod's GPU "
    "memory follows its compute share (the trace has no GPU memory); pods without GPUs go "
    "through kube-scheduler's default scores for HAMi and gpushare. Ties go to the "
    "lowest-numbered node and GPU, as for our policies.",
    "",
    "What it means: the CPU-balance term is most of Carpool's gain over FGD (the trace's GPU "
    "pods bring ≈ 11 cores per GPU; G2 nodes have 12, T4 nodes 52, so CPU-heavy pods belong on "
    "T4 nodes); the scarcity term is what lifts `gpuspec10`; exact arithmetic with a fixed "
    "tie-break matters (floating-point noise breaking FGD's exact ties costs it about 3 "
    "points). Our FGD lands below the paper's; the paper's simulator rounds FGD's score to an "
    "integer and breaks the resulting ties at random.",
]


if __name__ == "__main__":
    sys.exit(main())
