"""`carpool`: the command-line entry point."""

from __future__ import annotations

import argparse
import sys

from carpool.cli import nodes
from carpool.cli import simulate as simulate_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carpool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    nodes.register(commands)
    simulate_cli.register(commands)
    args = parser.parse_args(argv)
    # each command sets `run` (set_defaults) to a function of the parsed args returning the status
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
