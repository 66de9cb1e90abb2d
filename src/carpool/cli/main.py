"""`carpool`: the commands that need no cluster (`carpool simulate queue`)."""

from __future__ import annotations

import argparse
import sys

from carpool.cli import simulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carpool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    simulator.register(commands)
    args = parser.parse_args(argv)
    # each command sets `run` (set_defaults) to a function of the parsed args returning the status
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
