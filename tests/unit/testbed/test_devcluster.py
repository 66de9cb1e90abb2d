"""The parts of the dev-cluster launcher that decide things without a cluster: which ports a
new cluster gets, which pid files are stale, what the scheduler is told."""

from __future__ import annotations

import socket
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from carpool.core import names
from carpool_testbed import devcluster


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CARPOOL_CACHE", str(tmp_path))
    return tmp_path


def first_candidates(name: str, count: int) -> list[int]:
    span = len(devcluster.PORT_RANGE)
    start = zlib.crc32(name.encode()) % span
    return [devcluster.PORT_RANGE[(start + i) % span] for i in range(count)]


def _try_bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_new_ports_skip_those_other_clusters_recorded_and_those_in_use(cache: Path) -> None:
    candidates = first_candidates("fresh", 12)
    recorded = {"etcdPort": candidates[0], "kubeApiserverPort": candidates[2]}
    other = cache / "clusters" / "other"
    other.mkdir(parents=True)
    (other / "kwok.yaml").write_text(
        yaml.safe_dump({"kind": "KwokctlConfiguration", "options": recorded})
    )
    with socket.socket() as busy:
        occupied = next(p for p in candidates[1:] if _try_bind(busy, p))
        busy.listen()

        ports = devcluster.allocate_ports("fresh")

    assert set(ports) == set(devcluster.PORT_OPTIONS)
    chosen = list(ports.values())
    assert len(set(chosen)) == len(chosen)
    assert not {candidates[0], candidates[2], occupied} & set(chosen)
    assert all(p in devcluster.PORT_RANGE and p < 32768 for p in chosen)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "pids").mkdir()
    yield tmp_path


def spawn(argv0: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(argv0), "30"])


def test_pid_files_of_dead_or_foreign_processes_are_stale(workdir: Path, tmp_path: Path) -> None:
    sleep = Path("/bin/sleep")
    scheduler = tmp_path / "kube-scheduler"  # a process whose argv[0] names the component
    scheduler.symlink_to(sleep)
    alive, foreign = spawn(scheduler), spawn(sleep)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        (workdir / "pids" / "kube-scheduler.pid").write_text(str(alive.pid))
        (workdir / "pids" / "etcd.pid").write_text(str(foreign.pid))  # pid reused by `sleep`
        (workdir / "pids" / "kube-apiserver.pid").write_text(str(dead.pid))
        (workdir / "pids" / "kwok-controller.pid").write_text("not a pid")

        removed = devcluster.remove_stale_pid_files(workdir)

        assert removed == ["etcd", "kube-apiserver", "kwok-controller"]
        assert sorted(p.name for p in (workdir / "pids").iterdir()) == ["kube-scheduler.pid"]
        assert foreign.poll() is None, "stale pid files are dropped, never their processes"
    finally:
        for process in (alive, foreign):
            process.kill()
            process.wait()


def test_scheduler_keeps_the_default_profile_and_calls_the_extender_for_gpu_pods() -> None:
    config = devcluster.scheduler_configuration(port=23456)
    assert [p["schedulerName"] for p in config["profiles"]] == [
        "default-scheduler",
        names.SCHEDULER_NAME,
    ]
    assert "plugins" not in config["profiles"][0], "the stock profile stays stock"
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:23456/"
    assert [r["name"] for r in extender["managedResources"]] == [
        names.RESOURCE_GPU,
        names.RESOURCE_GPU_MEMORY,
        names.RESOURCE_GPU_CORES,
    ]
    assert "clientConnection" not in config, "kwokctl appends its own; a second one is invalid"


@pytest.mark.parametrize("raw", ["0", "70000", "http"])
def test_a_bad_extender_port_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devcluster.EXTENDER_PORT_ENV, raw)
    with pytest.raises(devcluster.ClusterError, match=devcluster.EXTENDER_PORT_ENV):
        devcluster.extender_port()


def test_kwok_nodes_carry_what_the_kwok_controller_selects_on() -> None:
    node = devcluster.kwok_node("n1", {"cpu": "4", names.RESOURCE_GPU: "8"}, labels={"a": "b"})
    key, value = devcluster.KWOK_NODE_ANNOTATION
    assert node["metadata"]["annotations"][key] == value
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["metadata"]["labels"]["a"] == "b"


def test_new_stages_and_scheduler_config_replace_the_old_ones_in_place(cache: Path) -> None:
    paths = devcluster.ClusterPaths.for_name("hot")
    paths.workdir.mkdir(parents=True)
    old_stage = {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": "x"}}
    kwokctl = {"kind": "KwokctlConfiguration", "options": {"kubeApiserverPort": 20001}}
    paths.kwok_config.write_text(yaml.safe_dump_all([kwokctl, old_stage]))
    connection = {"kubeconfig": str(paths.kubeconfig)}
    paths.scheduler_config.write_text(
        yaml.safe_dump({**devcluster.scheduler_configuration(1111), "clientConnection": connection})
    )

    devcluster._install_stages(paths)
    devcluster._install_scheduler_config(
        paths, yaml.safe_dump(devcluster.scheduler_configuration(2222))
    )

    documents = list(yaml.safe_load_all(paths.kwok_config.read_text()))
    assert documents[0] == kwokctl
    wanted = [
        d["metadata"]["name"] for d in yaml.safe_load_all(devcluster.stages_file().read_text())
    ]
    assert [d["metadata"]["name"] for d in documents[1:]] == wanted
    scheduler = yaml.safe_load(paths.scheduler_config.read_text())
    assert scheduler["clientConnection"] == connection
    assert scheduler["extenders"][0]["urlPrefix"] == "http://127.0.0.1:2222/"


def test_a_cluster_for_pods_gives_tokens_and_a_reachable_api_server(cache: Path) -> None:
    """The pods option turns the ServiceAccount plugin on and serves the API on the real
    node's bridge address (advertised: the `kubernetes` Service's endpoint)."""
    paths = devcluster.ClusterPaths.for_name("pods")
    plain = devcluster.kwokctl_create_args(paths, Path("/bin"), Path("/s.yaml"))
    pods = devcluster.kwokctl_create_args(paths, Path("/bin"), Path("/s.yaml"), pods=True)
    assert "kube-apiserver=disable-admission-plugins=ServiceAccount" in plain
    assert not any("ServiceAccount" in a for a in pods)
    assert "kube-apiserver=bind-address=0.0.0.0" in pods
    assert f"kube-apiserver=advertise-address={devcluster.POD_API_ADDRESS}" in pods
    paths.workdir.mkdir(parents=True)
    paths.inputs_dir.mkdir(parents=True)
    devcluster._write_kwokctl_options(paths, {"kubeApiserverPort": 1}, pods=True)
    options = next(yaml.safe_load_all(paths.kwokctl_options.read_text()))["options"]
    assert options["kubeApiserverCertSANs"] == [devcluster.POD_API_ADDRESS,
                                                devcluster.KUBERNETES_SERVICE_IP]
