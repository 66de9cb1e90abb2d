"""GpuNode status: schema, round trip into the placement inventory, publish rate limiting."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from carpool.core.gpunode import inventory_from_gpunode
from carpool.core.resources import Isolation
from carpool.deviceplugin.backends.fake import FakeBackend, fake_gpu_uuid
from carpool.deviceplugin.telemetry import (
    PodPeak,
    cached_datasets,
    should_publish,
    status_from_backend,
)

NOW = datetime(2026, 11, 29, 19, 30, tzinfo=UTC)


def mig_backend() -> FakeBackend:
    return FakeBackend.from_spec({
        "node": "gpu-a",
        "driverVersion": "580.1",
        "cudaVersion": "13.0",
        "gpus": [
            {"model": "H200", "count": 1, "temperatureC": 51},
            {"model": "A100", "migInstances": [
                {"profile": "3g.40gb", "slices": 3, "memoryMiB": 40192},
                {"profile": "1g.10gb", "slices": 1, "memoryMiB": 9856},
            ]},
        ],
    })


def test_status_has_the_crd_schema() -> None:
    backend = mig_backend()
    backend.set_memory_used(0, 2048)
    status = status_from_backend(
        backend, sharing_mode="mps", now=NOW, unhealthy={fake_gpu_uuid("gpu-a", 1)},
        datasets=["imagenet", "coco", "imagenet"],
        pod_peaks=[PodPeak("lab", "train-1", fake_gpu_uuid("gpu-a", 0), 3000)],
    )
    assert set(status) == {"driverVersion", "cudaVersion", "sharingMode", "datasets", "gpus",
                           "pods", "heartbeat"}
    assert status["heartbeat"] == "2026-11-29T19:30:00Z"
    assert status["datasets"] == ["coco", "imagenet"]
    first, second = status["gpus"]
    assert set(first) == {"index", "uuid", "model", "memoryTotalMiB", "memoryUsedMiB",
                          "temperatureC", "slowdownTemperatureC", "powerW", "utilizationPct",
                          "health", "migInstances"}
    assert (first["model"], first["memoryTotalMiB"]) == ("H200", 143771)
    assert first["memoryUsedMiB"] == 2048
    assert first["temperatureC"] == 51.0 and first["health"] == "Healthy"
    assert second["health"] == "Unhealthy"
    assert [m["profile"] for m in second["migInstances"]] == ["3g.40gb", "1g.10gb"]
    assert status["pods"] == [{"namespace": "lab", "name": "train-1",
                               "gpuUuid": fake_gpu_uuid("gpu-a", 0), "peakMemoryMiB": 3000}]


def test_status_round_trips_into_the_placement_inventory() -> None:
    status = status_from_backend(mig_backend(), sharing_mode="mps", now=NOW, datasets=["coco"])
    inv = inventory_from_gpunode("gpu-a", status, {"topology.kubernetes.io/zone": "z1"}, now=NOW)
    assert [g.model for g in inv.gpus] == ["H200", "A100"]
    assert inv.gpus[1].mig_instances[0].slices == 3
    assert inv.zone == "z1" and inv.datasets == frozenset({"coco"}) and inv.ready
    assert Isolation.MIG in inv.sharing and Isolation.MPS in inv.sharing


def test_a_gpu_in_exclusive_process_mode_says_so_and_placement_reads_it() -> None:
    backend = FakeBackend.from_spec({"node": "gpu-a", "gpus": [
        {"model": "H200", "exclusiveProcess": True}, {"model": "H200"}]})
    status = status_from_backend(backend, sharing_mode="mps", now=NOW)
    assert [g.get("exclusiveProcess") for g in status["gpus"]] == [True, None]
    inv = inventory_from_gpunode("gpu-a", status, {})
    assert [g.exclusive_process for g in inv.gpus] == [True, False]
    status["gpus"][1]["exclusiveProcess"] = "yes"
    with pytest.raises(ValueError, match=r"gpus\[1\]\.exclusiveProcess must be true or false"):
        inventory_from_gpunode("gpu-a", status, {})


def test_stale_heartbeat_makes_the_node_not_ready() -> None:
    status = status_from_backend(mig_backend(), sharing_mode="mps", now=NOW)
    later = NOW + timedelta(minutes=5)
    assert not inventory_from_gpunode("gpu-a", status, {}, now=later).ready
    assert inventory_from_gpunode("gpu-a", status, {}).ready


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["gpus"][0].pop("uuid"), r"gpus\[0\]\.uuid is missing"),
        (lambda s: s["gpus"][0].update(memoryTotalMiB="80Gi"), r"memoryTotalMiB must be a non-neg"),
        (lambda s: s["gpus"][0].update(health="Sick"), r"health must be"),
        (lambda s: s.update(sharingMode="magic"), r"sharingMode must be one of"),
        (lambda s: s.update(gpus={}), r"gpus must be a list"),
        (lambda s: s["gpus"][1].update(uuid=s["gpus"][0]["uuid"]), r"not unique"),
    ],
)
def test_bad_status_is_rejected_with_the_field_named(mutate: object, message: str) -> None:
    status = copy.deepcopy(status_from_backend(mig_backend(), sharing_mode="mps", now=NOW))
    mutate(status)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        inventory_from_gpunode("gpu-a", status, {})


def test_publish_only_on_structural_change_threshold_or_interval() -> None:
    backend = mig_backend()
    first = status_from_backend(backend, sharing_mode="mps", now=NOW)
    assert should_publish(None, 0.0, first, 0.0)
    backend.set_temperature(0, 52.0)  # +1 C: below the 3 C threshold
    small = status_from_backend(backend, sharing_mode="mps", now=NOW)
    assert not should_publish(first, 0.0, small, 5.0)
    assert should_publish(first, 0.0, small, 31.0)  # heartbeat interval
    backend.set_temperature(0, 60.0)
    hot = status_from_backend(backend, sharing_mode="mps", now=NOW)
    assert should_publish(first, 0.0, hot, 5.0)
    unhealthy = status_from_backend(backend, sharing_mode="mps", now=NOW,
                                    unhealthy={fake_gpu_uuid("gpu-a", 0)})
    assert should_publish(small, 0.0, unhealthy, 1.0)


def test_cached_datasets_are_the_cache_subdirectories(tmp_path: Path) -> None:
    for name in ("imagenet", "coco", ".partial"):
        (tmp_path / name).mkdir()
    (tmp_path / "README").write_text("x")
    assert cached_datasets(tmp_path) == ["coco", "imagenet"]
    assert cached_datasets(tmp_path / "missing") == []
    assert cached_datasets(None) == []
