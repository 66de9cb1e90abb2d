"""The fake backend: specs, openb rows, deterministic UUIDs, test controls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool.deviceplugin.backends.base import HealthEventKind, ProcessMemory
from carpool.deviceplugin.backends.fake import FakeBackend, fake_gpu_uuid


def test_openb_row_gives_model_memory_and_stable_uuids() -> None:
    row = {"sn": "openb-node-0042", "cpu_milli": "96000", "memory_mib": "786432", "gpu": "8",
           "model": "V100M32"}
    gpus = FakeBackend.from_openb_row(row).inventory()
    assert [g.index for g in gpus] == list(range(8))
    assert {g.memory_total_mib for g in gpus} == {32768}
    assert gpus[3].uuid == fake_gpu_uuid("openb-node-0042", 3)
    assert [g.uuid for g in FakeBackend.from_openb_row(row).inventory()] == [g.uuid for g in gpus]
    assert len({g.uuid for g in gpus}) == 8
    assert fake_gpu_uuid("openb-node-0043", 3) != gpus[3].uuid


def test_unknown_model_and_bad_rows_are_explained() -> None:
    with pytest.raises(ValueError, match="unknown GPU model 'X9'"):
        FakeBackend.from_spec({"node": "n", "gpus": [{"model": "X9"}]})
    with pytest.raises(ValueError, match="not an openb node row"):
        FakeBackend.from_openb_row({"sn": "n", "gpu": "two", "model": "T4"})
    with pytest.raises(ValueError, match="'node'"):
        FakeBackend.from_spec({"gpus": []})


def test_yaml_spec(tmp_path: Path) -> None:
    spec = tmp_path / "node.yaml"
    spec.write_text("node: lab-1\ncudaVersion: '12.4'\ngpus:\n- {model: T4, count: 2}\n"
                    "- {model: Custom, memoryTotalMiB: 1000}\n")
    backend = FakeBackend.from_yaml(spec)
    assert [g.model for g in backend.inventory()] == ["T4", "T4", "Custom"]
    assert backend.inventory()[2].memory_total_mib == 1000
    assert backend.cuda_version() == "12.4"


def test_a_spec_without_node_describes_the_node_it_is_read_for(tmp_path: Path) -> None:
    """The chart's one spec, shared by every node of the DaemonSet."""
    spec = tmp_path / "gpus.yaml"
    spec.write_text("gpus:\n- {model: H200, count: 2}\n")
    one, two = FakeBackend.from_yaml(spec, node="a"), FakeBackend.from_yaml(spec, node="b")
    assert one.inventory()[0].uuid == fake_gpu_uuid("a", 0) != two.inventory()[0].uuid
    named = tmp_path / "named.yaml"
    named.write_text("node: lab-1\ngpus:\n- {model: H200}\n")
    assert FakeBackend.from_yaml(named, node="a").inventory()[0].uuid == fake_gpu_uuid("lab-1", 0)
    with pytest.raises(ValueError, match="'node' must be a non-empty string"):
        FakeBackend.from_yaml(spec)


def test_controls_change_readings_and_health() -> None:
    backend = FakeBackend.from_spec({"node": "n", "gpus": [{"model": "A10", "count": 2}]})
    uuid1 = backend.inventory()[1].uuid
    backend.set_temperature(1, 88.0)
    backend.set_processes([ProcessMemory(pid=7, gpu_uuid=uuid1, used_mib=500)])
    assert backend.inventory()[1].temperature_c == 88.0
    assert backend.process_memory()[0].used_mib == 500
    assert backend.health_events(0.0) == []
    backend.inject_xid(1, 79)
    [event] = backend.health_events(0.0)
    assert (event.gpu_uuid, event.kind, event.code) == (uuid1, HealthEventKind.XID, 79)
    assert not backend.probe(uuid1)
    backend.clear_fault(1)
    assert backend.probe(uuid1)


def test_a_usage_file_drives_process_memory_and_used_memory(tmp_path: Path) -> None:
    """The real node's test drives the plugin's fake GPUs from outside its process."""
    backend = FakeBackend.from_spec({"node": "n", "gpus": [{"model": "H200", "count": 2}]})
    usage = tmp_path / "usage.json"
    backend.usage_file = usage
    assert backend.process_memory() == []  # no file yet: nothing runs
    second = fake_gpu_uuid("n", 1)
    usage.write_text(json.dumps({"processes": [
        {"pid": 10, "gpu": 0, "usedMiB": 2048}, {"pid": 11, "gpu": second, "usedMiB": 512},
        {"pid": 12, "gpu": 1, "usedMiB": 256}]}))
    assert backend.process_memory() == [ProcessMemory(10, fake_gpu_uuid("n", 0), 2048),
                                        ProcessMemory(11, second, 512),
                                        ProcessMemory(12, second, 256)]
    assert [g.memory_used_mib for g in backend.inventory()] == [2048, 768]
    backend.set_processes([ProcessMemory(99, second, 1)])  # the file wins
    assert {p.pid for p in backend.process_memory()} == {10, 11, 12}


@pytest.mark.parametrize(("text", "message"), [
    ("[]", "'processes' must be a list"),
    ("{", "fake usage file"),
    ('{"processes": [{"pid": 0, "gpu": 0, "usedMiB": 1}]}', r"processes\[0\].pid"),
    ('{"processes": [{"pid": 5, "gpu": 0, "usedMiB": -1}]}', r"processes\[0\].usedMiB"),
    ('{"processes": [{"pid": 5, "gpu": 7, "usedMiB": 1}]}', r"processes\[0\].gpu"),
    ('{"processes": [{"pid": 5, "gpu": "GPU-x", "usedMiB": 1}]}', r"processes\[0\].gpu"),
])
def test_a_malformed_usage_file_is_explained(tmp_path: Path, text: str, message: str) -> None:
    backend = FakeBackend.from_spec({"node": "n", "gpus": [{"model": "H200"}]})
    backend.usage_file = tmp_path / "usage.json"
    backend.usage_file.write_text(text)
    with pytest.raises(ValueError, match=message):
        backend.process_memory()


def test_the_usage_file_is_a_flag_of_the_fake_backend_only(tmp_path: Path) -> None:
    from carpool.deviceplugin.__main__ import make_backend, parse_args

    spec = tmp_path / "node.yaml"
    spec.write_text("gpus: [{model: T4}]\n")
    usage = tmp_path / "usage.json"
    backend = make_backend(parse_args(["--node-name", "n", "--backend", "fake", "--fake-spec",
                                       str(spec), "--fake-usage-file", str(usage)]))
    assert backend.usage_file == usage
    with pytest.raises(SystemExit):
        parse_args(["--node-name", "n", "--fake-usage-file", str(usage)])
