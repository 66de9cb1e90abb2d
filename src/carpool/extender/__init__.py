"""The kube-scheduler extender: HTTP filter, prioritize and bind over the placement core.

Run it with `python -m carpool.extender --port 18080 --kubeconfig PATH` (see `__main__`).
The parts, outside in:

- `server.make_app(extender)`: the aiohttp app (POST /filter, /prioritize, /bind; GET
  /healthz, /livez, /metrics).
- `service.Extender`: the verbs, over a `cache.ClusterCache` and a `service.ClusterPort`
  (`kube.KubeCluster` for real, `fake.FakeCluster` for tests and benchmarks).
- `cache.ClusterCache`: nodes, GPU inventories and who holds what, fed by `kube.start_informers`
  and by bind's assumptions.
- `ranking`: the one seam to `carpool.core.placement` (fit, reasons) and
  `carpool.core.scoring` (scores, GPU choice), memoised per node state.
- `wire`: the scheduler's JSON (Go field names) and the `carpool.dev/assignment` annotation.
"""
