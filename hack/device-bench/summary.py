"""The table of docs/benchmarks.md's "Pods/s end to end" paragraph, from `bench/extender.py
--cluster --null-extender` logs (hack/device-bench/run-extender.sh writes one per size)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

RATE = re.compile(r"^(without extender|null extender|with extender)\s+(\d+) of (\d+) pods bound; "
                  r"(\d+) pods/s")
CPU = re.compile(r"Carpool extender process CPU ([\d.]+) s")
FILTER = re.compile(r"extender filter: \d+ calls, mean ([\d.]+) ms")


def row(path: Path) -> str:
    """One table row; a setup that did not finish shows as '–'."""
    nodes, pods = path.stem.split("-")[1:3]
    rates: dict[str, float] = {}
    cpu = filter_ms = ""
    last_cpu = 0.0
    for line in path.read_text(errors="replace").splitlines():
        if match := CPU.search(line):
            last_cpu = float(match[1])
        elif match := RATE.match(line):
            rates[match[1]] = float(match[4])
            if match[1] == "with extender":
                cpu = f"{1000 * last_cpu / max(int(match[2]), 1):.1f} ms"
        elif match := FILTER.search(line):
            filter_ms = f"{match[1]} ms"
    none, null, carpool = (rates.get(k) for k in ("without extender", "null extender",
                                                  "with extender"))

    def rate(value: float | None) -> str:
        return f"{value:,.0f} pods/s" if value else "–"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a and b else "–"

    return (f"| {int(nodes):,}, {int(pods):,} | {rate(none)} | {rate(null)} | **{rate(carpool)}** "
            f"| {ratio(carpool, null)} | {ratio(carpool, none)} | {filter_ms or '–'} "
            f"| {cpu or '–'} |")


def main(paths: list[str]) -> int:
    print("| nodes, pods | no extender | null extender | Carpool's extender | Carpool / null "
          "| Carpool / none | Carpool's filter mean | Carpool's CPU per pod |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        print(row(Path(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
