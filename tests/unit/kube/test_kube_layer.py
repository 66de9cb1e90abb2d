"""carpool.kube's pure parts: errors by status, backoff delays, resource paths."""

from __future__ import annotations

import threading

from carpool.kube import errors, resources
from carpool.kube.retry import Backoff


def test_an_api_error_gets_the_type_of_its_status_and_keeps_the_servers_message() -> None:
    body = '{"kind":"Status","message":"GpuJob.carpool.dev \\"x\\" is invalid: spec.gpu.cores"}'
    err = errors.ApiError.of(422, "Unprocessable Entity", body)
    assert isinstance(err, errors.Invalid)
    assert err.status == 422
    assert err.message == 'GpuJob.carpool.dev "x" is invalid: spec.gpu.cores'
    assert isinstance(errors.ApiError.of(404), errors.NotFound)
    assert isinstance(errors.ApiError.of(409), errors.Conflict)
    assert isinstance(errors.ApiError.of(410), errors.Gone)
    assert isinstance(errors.ApiError.of(503, "Service Unavailable"), errors.ServerError)
    assert type(errors.ApiError.of(418)) is errors.ApiError
    assert errors.ApiError.of(500, "", "not json").message == "not json"
    assert errors.Unreachable("refused").status == 0


def test_backoff_grows_to_its_cap_and_starts_over_after_a_success() -> None:
    backoff = Backoff(first=0.2, most=1.0)
    assert [backoff.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.reset()
    assert backoff.next() == 0.2
    assert list(Backoff(first=1, most=16).delays(5)) == [1, 2, 4, 8, 16]


def test_backoff_wait_returns_at_once_when_stopped() -> None:
    stop = threading.Event()
    stop.set()
    assert Backoff(first=30).wait(stop)


def test_resource_paths() -> None:
    assert resources.PODS.path() == "/api/v1/pods"
    assert resources.PODS.path("ns") == "/api/v1/namespaces/ns/pods"
    assert resources.PODS.path("ns", "p", "binding") == "/api/v1/namespaces/ns/pods/p/binding"
    assert resources.GPUJOBS.path("a b", "j") == \
        "/apis/carpool.dev/v1alpha1/namespaces/a%20b/gpujobs/j"
    assert resources.GPUNODES.path(None, "n1", "status") == \
        "/apis/carpool.dev/v1alpha1/gpunodes/n1/status"
    assert resources.LEASES.api_version == "coordination.k8s.io/v1"
    assert resources.NODES.api_version == "v1"
