"""The product wheel: the core, the three components and the kubectl plugin, nothing of the
test bed. Built from the files git tracks, as `make images` builds it, then installed apart
and imported from there."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
TESTBED_MODULES = {p.stem for p in (REPO / "testbed").glob("*.py")} - {"__init__", "__main__"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, image_builder: ModuleType) -> Path:
    built: Path = image_builder.project_wheel(tmp_path_factory.mktemp("wheel"))
    return built


def test_the_wheel_holds_the_product_and_no_test_bed_module(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    package = [n for n in names if not n.startswith("carpool-")]  # the .dist-info
    assert package and all(n.startswith("carpool/") for n in package), package
    modules = {Path(n).stem for n in package if n.endswith(".py")}
    assert TESTBED_MODULES, "the test bed's modules were not found"
    assert not modules & TESTBED_MODULES, sorted(modules & TESTBED_MODULES)
    assert not [n for n in names if "testbed" in n or n.endswith(".csv")]
    for module in ("carpool/core/scoring.py", "carpool/operator/handlers.py",
                   "carpool/extender/__main__.py", "carpool/deviceplugin/__main__.py",
                   "carpool/deviceplugin/api/v1beta1/api_pb2.py", "carpool/cli/kubectl_plugin.py"):
        assert module in names, module
    # no top-level __init__.py in the components: they never shadow the standard library
    assert "carpool/operator/__init__.py" not in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kubectl-carpool" in scripts and "carpool-testbed" not in scripts
    assert "carpool = carpool.cli.main:main" in scripts


def test_the_installed_wheel_imports_every_component(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True)
    probe = ("import carpool, carpool.operator.handlers, carpool.extender.__main__, "
             "carpool.deviceplugin.__main__, carpool.cli.kubectl_plugin, operator, json;"
             "import importlib.util as u;"
             f"assert carpool.__file__.startswith({str(target)!r}), carpool.__file__;"
             "assert u.find_spec('carpool_testbed') is None or "
             f"not u.find_spec('carpool_testbed').origin.startswith({str(target)!r});"
             "assert hasattr(operator, 'itemgetter')")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                            text=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    # `carpool simulate queue` from the wheel alone, on files the user names
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,8000,65536,1,T4\n")
    (tmp_path / "pods.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
        "deletion_time,scheduled_time\np-0,1000,1024,1,1000,,BE,Succeeded,0,60,0\n")
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from carpool.cli.main import main; sys.exit(main())",
         "simulate", "queue", "--trace", "pods.csv", "--nodes", "nodes.csv", "--scale", "1",
         "--jobs", "1", "--policy", "carpool", "-o", "json"],
        cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert '"policy": "carpool"' in result.stdout
