"""`kubectl carpool`: queue, why, quota, nodes, report."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("kubectl carpool: not implemented yet", file=sys.stderr)
    return 2
