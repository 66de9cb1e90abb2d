"""Run the extender: `python -m carpool.extender --port 18080 --kubeconfig PATH`.

Starts the watches that feed the cache, then serves the scheduler verbs. Until the first list
of Nodes, GpuNodes and Pods is in, /healthz answers 503 and the verbs answer with an Error
(the scheduler retries the pod), so a restart never places a pod on a partial view.
"""

from __future__ import annotations

import argparse
import logging
import ssl
import sys
from dataclasses import replace

from aiohttp import web

from carpool.core.lending import LendingPolicy
from carpool.core.scoring import CARPOOL
from carpool.extender.cache import ClusterCache
from carpool.extender.kube import KubeCluster, api_client, start_informers
from carpool.extender.server import DEFAULT_MAX_BODY, event_loop, make_app, tune_interpreter
from carpool.extender.service import SHIPPED_FILTER_BEST, Extender, Settings
from carpool.extender.wire import Policy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m carpool.extender",
                                     description="Carpool kube-scheduler extender")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate")
    parser.add_argument("--tls-key", default=None, help="... and this key")
    parser.add_argument("--policy", choices=Policy.ALL, default=Policy.BINPACK,
                        help="placement policy when the job does not set one")
    for term in ("fragmentation", "balance", "scarcity", "packing", "alignment", "temperature",
                 "locality"):
        parser.add_argument(f"--weight-{term}", type=float, default=getattr(CARPOOL, term),
                            help=f"weight of the {term} score term (default %(default)s)")
    parser.add_argument("--static-workload", action="store_true",
                        help="do not learn the target workload from the pods seen")
    parser.add_argument("--bind-wait-seconds", type=float, default=Settings.bind_wait_s,
                        help="how long bind waits for an in-flight hand-over on its node")
    parser.add_argument("--filter-best", type=int, default=SHIPPED_FILTER_BEST, metavar="N",
                        help="filter passes only Carpool's N best nodes for the pod; 1 lets "
                             "the scheduler bind without scoring or prioritize; 0 passes "
                             "every node that fits (default %(default)s)")
    parser.add_argument("--allow-unowned-pods", action="store_true",
                        help="also place pods that no GpuJob owns (test beds and benchmarks; "
                             "without it such pods are filtered out with the reason)")
    parser.add_argument("--lending", action="store_true",
                        help="count owners' unused GPU memory as lent and bind the pods the "
                             "operator places there (the operator's CARPOOL_LENDING)")
    parser.add_argument("--lending-whole-gpus", action="store_true",
                        help="with --lending, whole-GPU (exclusive) owners lend too (the "
                             "operator's CARPOOL_LENDING_WHOLE_GPUS)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        scoring = replace(CARPOOL, fragmentation=args.weight_fragmentation,
                          balance=args.weight_balance, scarcity=args.weight_scarcity,
                          packing=args.weight_packing, alignment=args.weight_alignment,
                          temperature=args.weight_temperature, locality=args.weight_locality)
        settings = Settings(args.policy, scoring, learn_workload=not args.static_workload,
                            bind_wait_s=args.bind_wait_seconds, filter_best=args.filter_best,
                            serve_unowned=args.allow_unowned_pods)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        api = api_client(args.kubeconfig)
    except ValueError as exc:  # no kubeconfig or service account, or one that does not load
        print(f"error: cannot load the cluster configuration "
              f"({args.kubeconfig or 'in-cluster'}): {exc}", file=sys.stderr)
        return 2
    tune_interpreter()
    cache = ClusterCache(LendingPolicy(whole_gpus=args.lending_whole_gpus)
                         if args.lending else None)
    start_informers(api, cache)
    extender = Extender(cache, KubeCluster(api), settings)
    ssl_context = None
    if args.tls_cert:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(args.tls_cert, args.tls_key)
    web.run_app(make_app(extender, max_body=args.max_body_bytes), host=args.host,
                port=args.port, ssl_context=ssl_context, access_log=None, loop=event_loop(),
                print=lambda text: logging.getLogger(__name__).info("%s", text.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
