"""The repo carries the openb trace files the test bed, the benchmarks and the tests read, as
its README lists them (so a fresh clone needs nothing beside it)."""

from __future__ import annotations

import hashlib
import re

import pytest

from carpool_testbed import traces

PLACEMENT_TRACES = ("default", "gpushare40", "multigpu20", "gpuspec10")


def test_the_default_folder_is_the_repo_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CARPOOL_TRACES", raising=False)
    assert traces.traces_dir() == traces.OPENB
    assert (traces.OPENB.parents[1] / "testbed" / "traces.py").is_file()


def test_every_file_the_test_bed_reads_is_in_the_repo_with_its_header() -> None:
    assert traces.OPENB.joinpath(traces.NODE_LIST).read_text().startswith(
        "sn,cpu_milli,memory_mib,gpu,model\n")
    for trace in PLACEMENT_TRACES:
        path = traces.OPENB / f"openb_pod_list_{trace}.csv"
        assert path.read_text().startswith("name,cpu_milli,memory_mib,num_gpu,gpu_milli"), path


def test_the_readme_lists_every_file_with_its_checksum() -> None:
    readme = (traces.OPENB / "README.md").read_text()
    listed = dict((name, digest) for digest, name in
                  re.findall(r"^([0-9a-f]{64})  (\S+\.csv)$", readme, re.M))
    shipped = {p.name for p in traces.OPENB.glob("*.csv")}
    assert set(listed) == shipped
    for name, digest in listed.items():
        assert hashlib.sha256((traces.OPENB / name).read_bytes()).hexdigest() == digest, name
