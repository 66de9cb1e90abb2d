"""`carpool-testbed nodes create|delete|heartbeat`: simulated GPU nodes (KWOK), their GpuNodes."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from carpool.core.names import RESOURCE_GPU
from carpool_testbed import crds, simnodes, traces


def _add_sources(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="from_file", type=Path, metavar="FILE.yaml",
                        help="nodes described in YAML (see examples/nodes.yaml)")
    source.add_argument("--from-openb", type=Path, metavar="CSV", nargs="?",
                        const=traces.node_list(),
                        help="the openb trace's node list (default: the repo's traces/openb/"
                             f"{traces.NODE_LIST}, or $CARPOOL_TRACES)")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="with --from-openb: only the first N GPU nodes")
    parser.add_argument("--shares-per-gpu", type=int, metavar="N",
                        help=f"{RESOURCE_GPU} shares per GPU (default: the file's, "
                             f"else {simnodes.DEFAULT_SHARES_PER_GPU})")


def _add_kubeconfig(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", type=Path,
                        help="cluster to talk to (default: $KUBECONFIG or ~/.kube/config)")


def register(commands: Any) -> None:
    """Add the `nodes` command to the `carpool-testbed` parser's sub-commands."""
    nodes = commands.add_parser("nodes", help="simulated GPU nodes (KWOK) with GpuNode status",
                                description=__doc__)
    actions = nodes.add_subparsers(dest="action", required=True)

    create = actions.add_parser("create", help="create or update nodes (idempotent)")
    _add_sources(create)
    create.add_argument("--dry-run", action="store_true",
                        help="print the Node and GpuNode objects instead of applying them")
    create.add_argument("--skip-crds", action="store_true",
                        help="do not apply the Carpool CRDs first")
    _add_kubeconfig(create)
    create.set_defaults(run=guarded(run_create))

    delete = actions.add_parser("delete", help="delete nodes and their GpuNodes")
    group = delete.add_mutually_exclusive_group(required=True)
    group.add_argument("--all", action="store_true", help="every simulated node")
    group.add_argument("--from", dest="from_file", type=Path, metavar="FILE.yaml")
    group.add_argument("--from-openb", type=Path, metavar="CSV", nargs="?",
                       const=traces.node_list())
    delete.add_argument("--limit", type=int, metavar="N")
    _add_kubeconfig(delete)
    delete.set_defaults(run=guarded(run_delete), shares_per_gpu=None)

    heartbeat = actions.add_parser(
        "heartbeat", help="keep simulated GpuNodes' heartbeats fresh, as live plugins would")
    heartbeat.add_argument("--interval", type=float, default=30.0, metavar="SECONDS")
    heartbeat.add_argument("--once", action="store_true", help="beat once and exit")
    _add_kubeconfig(heartbeat)
    heartbeat.set_defaults(run=guarded(run_heartbeat))


def _selected(args: argparse.Namespace) -> list[simnodes.SimNode]:
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if args.shares_per_gpu is not None and args.shares_per_gpu < 1:
        raise ValueError(f"--shares-per-gpu must be at least 1, got {args.shares_per_gpu}")
    if args.from_file is not None:
        if args.limit is not None:
            raise ValueError("--limit applies to --from-openb only")
        return simnodes.load_nodes_yaml(args.from_file, args.shares_per_gpu)
    return simnodes.load_openb(args.from_openb, limit=args.limit,
                               shares_per_gpu=args.shares_per_gpu
                               or simnodes.DEFAULT_SHARES_PER_GPU)


def run_create(args: argparse.Namespace) -> int:
    nodes = _selected(args)
    now = datetime.now(UTC)
    if args.dry_run:
        print(simnodes.to_json(nodes, now))
        return 0
    api = simnodes.api_client(args.kubeconfig)
    try:
        if not args.skip_crds:
            crds.apply_crds(api)
        started = time.monotonic()
        simnodes.apply_nodes(api, nodes, now)
    finally:
        api.close()
    print(f"applied {simnodes.summary(nodes)} in {time.monotonic() - started:.1f}s")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    api = simnodes.api_client(args.kubeconfig)
    try:
        names = (simnodes.simulated_node_names(api) if args.all
                 else [n.name for n in _selected(args)])
        simnodes.delete_nodes(api, names)
    finally:
        api.close()
    print(f"deleted {len(names)} simulated node(s)")
    return 0


def run_heartbeat(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise ValueError(f"--interval must be positive, got {args.interval}")
    api = simnodes.api_client(args.kubeconfig)
    try:
        while True:
            names = simnodes.simulated_node_names(api)
            simnodes.beat(api, names)
            if args.once:
                print(f"refreshed {len(names)} heartbeat(s)")
                return 0
            time.sleep(args.interval)
    finally:
        api.close()


def guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input becomes one line on stderr and exit status 2; an API refusal, status 1."""

    def run(args: argparse.Namespace) -> int:
        from carpool.kube.errors import ApiError

        try:
            return command(args)
        except (ValueError, OSError) as err:
            print(f"carpool-testbed nodes: {err}", file=sys.stderr)
            return 2
        except ApiError as err:
            print(f"carpool-testbed nodes: the API server refused: {err.status} {err.reason}: "
                  f"{err.message}", file=sys.stderr)
            return 1

    return run


def main(argv: list[str] | None = None) -> int:
    """`python -m carpool_testbed.nodes ...`: the same as `carpool-testbed nodes ...`."""
    parser = argparse.ArgumentParser(prog="carpool-testbed")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
