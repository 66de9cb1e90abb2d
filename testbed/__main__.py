"""`carpool-testbed` (or `python -m carpool_testbed`): simulated GPU nodes, the trace replay and
the tenant chaos run."""

from __future__ import annotations

import argparse
import sys

from carpool_testbed import nodes, tenantchaos
from carpool_testbed import simulate as simulate_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carpool-testbed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    nodes.register(commands)
    simulate_cli.register(commands)
    tenantchaos.register(commands)
    args = parser.parse_args(argv)
    # each command sets `run` (set_defaults) to a function of the parsed args returning the status
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
