"""The one layer that talks to the Kubernetes API server, shared by every component and the
test bed: loading credentials (`client`), requests with errors as types (`client`,
`errors`), list-then-watch (`watching`), backoff (`retry`), the paths (`resources`) and
leader election (`leases`). An import-linter contract keeps the kubernetes package out of
everything else (kopf, which the operator runs under, talks to the API server itself).

Import from the modules (`carpool.kube.client`, ...): this package imports nothing itself, so
`carpool.kube.errors` costs no kubernetes import.
"""
