"""spec.objectives decoded into the core's Objectives, with errors naming the field."""

from __future__ import annotations

import pytest

from carpool.core.decoding import gpu_request_from_spec
from carpool.core.resources import Objectives


def spec(**objectives: object) -> dict[str, object]:
    return {"gpu": {"count": 1, "memory": "8Gi"}, "objectives": objectives}


def test_a_job_without_objectives_has_none() -> None:
    assert gpu_request_from_spec({"gpu": {"count": 1, "memory": "8Gi"}}).objectives is None


def test_latency_and_slowdown_are_decoded() -> None:
    request = gpu_request_from_spec(spec(p99Latency="60ms", maxSlowdown=1.5))
    assert request.objectives == Objectives(p99_latency_s=0.06, max_slowdown=1.5)
    assert gpu_request_from_spec(spec(p99Latency="1.5s")).objectives == Objectives(1.5)


@pytest.mark.parametrize(("objectives", "field"), [
    ({"p99Latency": "soon"}, "spec.objectives.p99Latency"),
    ({"p99Latency": "0ms"}, "spec.objectives.p99Latency"),
    ({"maxSlowdown": "fast"}, "spec.objectives.maxSlowdown"),
    ({"maxSlowdown": 0.5}, "spec.objectives.maxSlowdown"),
])
def test_bad_objectives_name_the_field(objectives: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        gpu_request_from_spec(spec(**objectives))
