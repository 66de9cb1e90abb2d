"""The one layer that talks to the Kubernetes API server, shared by every component and the
test bed: loading credentials (`client`), requests with errors as types (`client`,
`errors`), list-then-watch (`watching`), backoff (`retry`), the paths (`resources`) and
leader election (`leases`). An import-linter contract keeps the kubernetes package out of
everything else (kopf, which the operator runs under, talks to the API server itself).
"""

from carpool.kube.client import Api, Obj, generated_client, load_configuration
from carpool.kube.errors import (
    ApiError,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    Unreachable,
)
from carpool.kube.retry import Backoff
from carpool.kube.watching import Reflector, Store, object_key

__all__ = ["Api", "ApiError", "Backoff", "Conflict", "Forbidden", "Gone", "Invalid",
           "NotFound", "Obj", "Reflector", "Store", "Unreachable", "generated_client",
           "load_configuration", "object_key"]
