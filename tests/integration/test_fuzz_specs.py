"""Fuzzed GpuJob and ProjectQuota specs against the real API server, with the operator running.

Every generated object is either refused by the API server with a message (HTTP 422/400 whose
text names a field), or accepted and then handled by the operator: a GpuJob gets a phase, a
ProjectQuota gets a status or is named in the operator's warning about it. The operator
process must still be alive afterwards and still admit a well-formed job. Hypothesis is
derandomized so CI runs the same ~100 cases each time; set CARPOOL_FUZZ_SEED to explore.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from carpool.core import names
from carpool_testbed import devcluster

pytestmark = pytest.mark.cluster

EXAMPLES = int(os.environ.get("CARPOOL_FUZZ_EXAMPLES", "60"))
SEED = os.environ.get("CARPOOL_FUZZ_SEED")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])

# Values that are often almost right: the interesting edge of the schema.
WEIRD_TEXT = st.sampled_from(["", " ", "-", "a" * 300, "ünïcode", "0", "-1", "1e9", "NaN",
                              "8Gi", "-8Gi", "8GiB", "0Gi", "1Ei", "1d", "0s", "1h30m", "1d2d",
                              "99999999999999999999h", "1.5h", "h", "interactive", "mig",
                              "1g.18gb", "8g.1gb", "spec", "null", "${x}", "a/b", "A"])
ANY_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                       st.floats(allow_nan=False, allow_infinity=False), WEIRD_TEXT,
                       st.text(max_size=20))
QUANTITY = st.one_of(st.sampled_from(["8Gi", "16Gi", "100Gi", "512Mi", "1Ti", "0.5Gi", "1"]),
                     WEIRD_TEXT, ANY_SCALAR)
DURATION = st.one_of(st.sampled_from(["30m", "2h", "1d12h", "90s", "1h30m", "500ms"]),
                     WEIRD_TEXT, ANY_SCALAR)


DELETE = object()  # a mutation that removes the field


def mutated(base: st.SearchStrategy[dict[str, Any]],
            fields: dict[tuple[str, ...], st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A valid spec with zero to three fields replaced by odd values or removed: most cases
    sit at the edge of the schema, where a refusal or an acceptance is a real question."""
    paths = sorted(fields)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        spec = draw(base)
        for _ in range(draw(st.integers(0, 3))):
            path = draw(st.sampled_from(paths))
            value = draw(st.one_of(fields[path], ANY_SCALAR, st.just(DELETE)))
            target = spec
            for key in path[:-1]:
                if not isinstance(target.get(key), dict):
                    target[key] = {}
                target = target[key]
            if value is DELETE:
                target.pop(path[-1], None)
            else:
                target[path[-1]] = value
        return spec

    return build()


VALID_GPU = st.one_of(
    st.fixed_dictionaries({"count": st.integers(1, 3), "memory": st.sampled_from(
        ["8Gi", "16Gi", "40Gi"]), "isolation": st.sampled_from(["mps", "timeslice"])},
        optional={"cores": st.integers(1, 100)}),
    st.fixed_dictionaries({"count": st.just(1), "memory": st.just("70Gi"),
                           "isolation": st.just("exclusive")}),
    st.fixed_dictionaries({"count": st.just(1), "memory": st.just("18Gi"),
                           "isolation": st.just("mig"), "migProfile": st.just("1g.18gb")}))
VALID_JOB = st.fixed_dictionaries({
    "project": st.sampled_from(["fuzz-project", "nobody"]),
    "class": st.sampled_from(["interactive", "short", "long", "batch"]),
    "gpu": VALID_GPU, "estimatedDuration": st.just("30m"), "maxDuration": st.just("2h"),
    "simulatedDuration": st.just("2s"),
    "template": st.just({"spec": {"containers": [{"name": "main", "image": "trainer"}]}})})
JOB_SPEC = mutated(VALID_JOB, {
    ("project",): st.sampled_from(["Bad_Name", "-x", "a" * 254, ""]),
    ("class",): st.sampled_from(["urgent", "INTERACTIVE"]),
    ("gpu", "count"): st.integers(-2, 20),
    ("gpu", "memory"): QUANTITY,
    ("gpu", "cores"): st.integers(-5, 120),
    ("gpu", "isolation"): st.sampled_from(["mps", "mig", "timeslice", "exclusive", "vgpu"]),
    ("gpu", "migProfile"): st.sampled_from(["1g.18gb", "3g.71gb", "8g.1gb", "big"]),
    ("gpu", "models"): st.lists(st.sampled_from(["H200", "A100", "", "x" * 70]), max_size=3),
    ("estimatedDuration",): DURATION, ("maxDuration",): DURATION,
    ("simulatedDuration",): DURATION,
    ("preemptible",): st.booleans(),
    ("placementPolicy",): st.sampled_from(["binpack", "spread", "random"]),
    ("checkpoint", "gracePeriod"): DURATION, ("checkpoint", "minRuntime"): DURATION,
    ("dataset", "name"): st.sampled_from(["imagenet", ""]), ("dataset", "size"): QUANTITY,
    ("template", "spec", "containers"): st.lists(st.fixed_dictionaries(
        {}, optional={"name": st.sampled_from(["main", ""]), "image": st.just("x")}),
        max_size=2),
    ("template", "spec", "nodeName"): st.just("somewhere"),
    ("template", "spec", "restartPolicy"): st.sampled_from(["Never", "OnFailure", "Always"]),
    ("template", "metadata", "labels"): st.dictionaries(
        st.sampled_from(["app", names.LABEL_JOB, names.LABEL_PROJECT]), st.text(max_size=8),
        max_size=2),
    ("unknownField",): ANY_SCALAR,
})
VALID_QUOTA = st.fixed_dictionaries({"namespaces": st.just(["fuzz-elsewhere"])}, optional={
    "gpuHours": st.fixed_dictionaries({"budget": st.floats(0, 1000), "period": st.sampled_from(
        ["1h", "7d", "30d"])}),
    "concurrent": st.fixed_dictionaries({}, optional={"gpus": st.integers(0, 100),
                                                      "memory": st.just("320Gi")}),
    "borrowing": st.fixed_dictionaries({"enabled": st.booleans()}),
    "weight": st.floats(0.1, 10)})
QUOTA_SPEC = mutated(VALID_QUOTA, {
    ("namespaces",): st.lists(st.sampled_from(["team-a", "fuzz-ns", "Bad", "", "a" * 64]),
                              max_size=3),
    ("gpuHours", "budget"): st.floats(-10, 1e12, allow_nan=False),
    ("gpuHours", "period"): DURATION,
    ("gpuHours", "periodAnchor"): st.sampled_from(["2026-01-01T00:00:00Z", "yesterday"]),
    ("gpuHours", "onExhausted"): st.sampled_from(["Hold", "PreemptibleOnly", "Panic"]),
    ("concurrent", "gpus"): st.integers(-3, 10**12),
    ("concurrent", "memory"): QUANTITY,
    ("borrowing", "enabled"): st.booleans(),
    ("borrowing", "maxGpus"): st.integers(-2, 50),
    ("weight",): st.floats(-1, 1e9, allow_nan=False),
    ("unknownField",): ANY_SCALAR,
})


@dataclass
class Outcomes:
    refused: list[str] = field(default_factory=list)  # the API server's messages
    accepted: list[str] = field(default_factory=list)  # names


def server_message(err: ApiException) -> str:
    try:
        return str(json.loads(err.body or "{}").get("message", ""))
    except ValueError:
        return str(err.body or "")


def submit(create: Any, outcomes: Outcomes, name: str, body: dict[str, Any]) -> None:
    """Create; a refusal must be a 4xx with a message that names what is wrong."""
    try:
        create(body)
    except ApiException as err:
        message = server_message(err)
        assert err.status in (400, 422), (err.status, message, body)
        assert message and ("spec" in message or "metadata" in message), (message, body)
        outcomes.refused.append(message)
        return
    except ValueError as err:  # the client could not even serialise it (e.g. huge ints)
        pytest.fail(f"client refused to send {body!r}: {err}")
    outcomes.accepted.append(name)


@pytest.fixture(scope="module")
def fuzz_namespace(cluster: devcluster.Cluster, carpool_stack: Any) -> Iterator[str]:
    """A namespace bound to the project `fuzz-project` (so some fuzzed jobs are admissible)."""
    namespace = f"fuzz-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": names.API_VERSION, "kind": "ProjectQuota",
        "metadata": {"name": "fuzz-project"},
        "spec": {"namespaces": [namespace], "concurrent": {"gpus": 2}}}))
    try:
        yield namespace
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "projectquota", "fuzz-project", "--ignore-not-found",
                        check=False)


def wait_until(what: str, probe: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if not last:
            return last
        time.sleep(1)
    raise AssertionError(f"{what} after {timeout:.0f}s: {last!r}")


def test_fuzzed_gpujobs_are_refused_with_a_message_or_handled(
        cluster: devcluster.Cluster, carpool_stack: dict[str, Any], fuzz_namespace: str) -> None:
    api = cluster.api()
    custom = client.CustomObjectsApi(api)
    outcomes = Outcomes()

    def create(body: dict[str, Any]) -> None:
        custom.create_namespaced_custom_object(names.GROUP, names.VERSION, fuzz_namespace,
                                               names.GPUJOB_PLURAL, body)

    @FUZZ
    @given(spec=JOB_SPEC)
    def one(spec: dict[str, Any]) -> None:
        name = f"fz-{uuid.uuid4().hex[:10]}"
        submit(create, outcomes, name, {"apiVersion": names.API_VERSION, "kind": "GpuJob",
                                        "metadata": {"name": name}, "spec": spec})

    one()
    assert outcomes.refused and outcomes.accepted, (len(outcomes.refused), outcomes.accepted)

    def unhandled() -> list[str]:
        jobs = custom.list_namespaced_custom_object(names.GROUP, names.VERSION, fuzz_namespace,
                                                    names.GPUJOB_PLURAL)["items"]
        return [j["metadata"]["name"] for j in jobs if not (j.get("status") or {}).get("phase")]

    wait_until("accepted jobs without a phase", unhandled, timeout=90)
    assert carpool_stack["operator"].poll() is None, "the operator died"
    print(f"\nGpuJob fuzz: {len(outcomes.refused)} refused, {len(outcomes.accepted)} accepted "
          f"and handled; e.g. {sorted(set(outcomes.refused))[:3]}")


def test_fuzzed_projectquotas_are_refused_with_a_message_or_handled(
        cluster: devcluster.Cluster, carpool_stack: dict[str, Any], fuzz_namespace: str) -> None:
    api = cluster.api()
    custom = client.CustomObjectsApi(api)
    outcomes = Outcomes()

    def create(body: dict[str, Any]) -> None:
        custom.create_cluster_custom_object(names.GROUP, names.VERSION,
                                            names.PROJECTQUOTA_PLURAL, body)

    @FUZZ
    @given(spec=QUOTA_SPEC)
    def one(spec: dict[str, Any]) -> None:
        name = f"fz-{uuid.uuid4().hex[:10]}"
        submit(create, outcomes, name, {"apiVersion": names.API_VERSION,
                                        "kind": "ProjectQuota", "metadata": {"name": name},
                                        "spec": spec})

    try:
        one()
        assert outcomes.refused and outcomes.accepted, (len(outcomes.refused),
                                                        outcomes.accepted)

        def unhandled() -> list[str]:
            return [name for name in outcomes.accepted
                    if not custom.get_cluster_custom_object(
                        names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL, name
                    ).get("status")]

        wait_until("accepted quotas without a status", unhandled, timeout=90)
        assert carpool_stack["operator"].poll() is None, "the operator died"
        # Still working: a well-formed job in the bound namespace is handled.
        custom.create_namespaced_custom_object(
            names.GROUP, names.VERSION, fuzz_namespace, names.GPUJOB_PLURAL,
            {"apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": "sentinel"},
             "spec": {"project": "fuzz-project", "gpu": {"count": 1, "memory": "8Gi"},
                      "template": {"spec": {"containers": [{"name": "m", "image": "x"}]}}}})
        def sentinel_unhandled() -> bool:
            job = custom.get_namespaced_custom_object(names.GROUP, names.VERSION, fuzz_namespace,
                                                      names.GPUJOB_PLURAL, "sentinel")
            return not (job.get("status") or {}).get("phase")

        wait_until("the sentinel job has no phase", sentinel_unhandled, timeout=60)
    finally:
        for name in outcomes.accepted:
            with contextlib.suppress(ApiException):
                custom.delete_cluster_custom_object(names.GROUP, names.VERSION,
                                                    names.PROJECTQUOTA_PLURAL, name)
    print(f"\nProjectQuota fuzz: {len(outcomes.refused)} refused, {len(outcomes.accepted)} "
          f"accepted and handled; e.g. {sorted(set(outcomes.refused))[:3]}")
