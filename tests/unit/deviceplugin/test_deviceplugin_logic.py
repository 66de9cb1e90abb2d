"""Pure pieces of the device plugin: handshake matching, per-mode env, watchdog, health."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from carpool.core.assignment import AssignedGpu
from carpool.core.names import ANN_ALLOCATED, ANN_ASSIGNED_AT, ANN_ASSIGNMENT
from carpool.core.resources import Isolation
from carpool.core.shares import ShareId
from carpool.deviceplugin.backends.base import HealthEvent, HealthEventKind, ProcessMemory
from carpool.deviceplugin.backends.fake import FakeBackend
from carpool.deviceplugin.devices import advertised_shares
from carpool.deviceplugin.handshake import (
    HandshakeError,
    ServedPod,
    allocated_annotation,
    in_flight,
    match_request,
    preferred_shares,
)
from carpool.deviceplugin.health import HealthTracker
from carpool.deviceplugin.sharing import (
    ContainerSetup,
    MountSpec,
    MpsSettings,
    container_setup,
    host_view,
    mps_memory_limit,
)
from carpool.deviceplugin.watchdog import (
    MemoryGrant,
    Verdict,
    pod_uid_from_cgroup,
    usage_by_pod,
    watchdog_step,
)

NODE = "n1"
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def pod(name: str, gpus: list[dict[str, object]], containers: tuple[tuple[str, int], ...] = (),
        at: str = "2027-01-15T08:00:00Z", phase: str = "Pending", node: str = NODE,
        extra: dict[str, str] | None = None) -> ServedPod:
    ann = {ANN_ASSIGNMENT: json.dumps({"node": node, "gpus": gpus}), ANN_ASSIGNED_AT: at,
           **(extra or {})}
    return ServedPod("ns", name, f"uid-{name}", phase, False, ann,
                   containers or (("main", len(gpus)),))


def g(uuid: str, mem: int = 1024, cores: int = 10, **kw: object) -> dict[str, object]:
    return {"uuid": uuid, "index": 0, "memoryMiB": mem, "cores": cores, **kw}


# --- handshake ------------------------------------------------------------------------------


def test_match_by_count_ignores_settled_running_and_foreign_pods() -> None:
    pods = [
        pod("two", [g("A"), g("B")]),
        pod("running", [g("A")], phase="Running"),
        pod("elsewhere", [g("A")], node="n2"),
        pod("done", [g("A")], extra={ANN_ALLOCATED: "{}"}),
        pod("one", [g("C")]),
    ]
    match = match_request(pods, NODE, [ShareId("C", 0)], T0)
    assert (match.pod.name, [x.uuid for x in match.gpus]) == ("one", ["C"])
    match = match_request(pods, NODE, [ShareId("A", 0), ShareId("B", 1)], T0)
    assert match.pod.name == "two"


def test_tie_breaks_prefer_gpu_match_then_fresh_then_oldest() -> None:
    stale = pod("stale", [g("A")], at="2027-01-15T07:49:00Z")  # 11 minutes before T0
    fresh_late = pod("fresh-late", [g("B")], at="2027-01-15T07:59:50Z")
    fresh_early = pod("fresh-early", [g("B")], at="2027-01-15T07:59:30Z")
    pods = [stale, fresh_late, fresh_early]
    assert match_request(pods, NODE, [ShareId("A", 0)], T0).pod.name == "stale"  # GPU decides
    assert match_request(pods, NODE, [ShareId("Z", 0)], T0).pod.name == "fresh-early"
    served = frozenset({("uid-fresh-early", "main")})
    assert match_request(pods, NODE, [ShareId("Z", 0)], T0, served).pod.name == "fresh-late"


def test_no_candidate_is_a_failed_precondition() -> None:
    with pytest.raises(HandshakeError) as err:
        match_request([pod("two", [g("A"), g("B")])], NODE, [ShareId("A", 0)], T0)
    assert err.value.code == "FAILED_PRECONDITION"
    assert "assigned 1 carpool.dev/gpu" in str(err.value)


def test_multi_container_pods_are_matched_container_by_container() -> None:
    p = pod("multi", [g("A", container="a"), g("B", container="b"), g("C", container="b")],
            containers=(("a", 1), ("b", 2)))
    assert [(c, [x.uuid for x in gs]) for _, c, gs in in_flight([p], NODE)] == [
        ("a", ["A"]), ("b", ["B", "C"])]
    value = allocated_annotation(p, "a", ["A::0"], ["A"], datetime(2027, 1, 15, tzinfo=UTC))
    done = ServedPod(p.namespace, p.name, p.uid, p.phase, False,
                   {**p.annotations, ANN_ALLOCATED: value}, p.gpu_containers)
    assert [c for _, c, _ in in_flight([done], NODE)] == ["b"]
    unnamed = pod("unnamed", [g("A"), g("B"), g("C")], containers=(("x", 2), ("y", 1)))
    assert [[x.uuid for x in gs] for _, _, gs in in_flight([unnamed], NODE)] == [["A", "B"],
                                                                                  ["C"]]


def test_a_pod_with_a_bad_assignment_is_skipped_not_fatal() -> None:
    bad = ServedPod("ns", "bad", "u", "Pending", False, {ANN_ASSIGNMENT: "{"}, (("main", 1),))
    assert in_flight([bad, pod("ok", [g("A")])], NODE)[0][0].name == "ok"


def test_preferred_shares_follow_the_assignment_on_distinct_gpus() -> None:
    available = [ShareId(u, n) for u in ("A", "B", "C") for n in range(3)]
    assert preferred_shares(available, [], 1, ["C"]) == [ShareId("C", 0)]
    assert preferred_shares(available, [], 2, ["C"]) == [ShareId("C", 0), ShareId("A", 0)]
    assert preferred_shares(available, [ShareId("B", 2)], 2, ["C"]) == [ShareId("B", 2),
                                                                       ShareId("C", 0)]
    assert preferred_shares(available, [], 2, []) == [ShareId("A", 0), ShareId("B", 0)]


# --- sharing ----------------------------------------------------------------------------------


def test_mps_limits_and_mounts_per_visible_device() -> None:
    gpus = [AssignedGpu("A", 0, 8192, 25), AssignedGpu("B", 1, 1536, 40)]
    setup = container_setup(Isolation.MPS, gpus, MpsSettings("/host/pipe", "/host/shm"))
    assert setup.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G,1=1536M"
    assert setup.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert setup.envs["CUDA_VISIBLE_DEVICES"] == "A,B"
    assert setup.mounts == (MountSpec("/run/carpool/mps", "/host/pipe"),
                            MountSpec("/dev/shm", "/host/shm"))
    assert host_view(setup)["CUDA_MPS_PIPE_DIRECTORY"] == "/host/pipe"
    whole = container_setup(Isolation.MPS, [AssignedGpu("A", 0, 0, 100)])
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in whole.envs
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in whole.envs
    assert mps_memory_limit(1024) == "1G" and mps_memory_limit(1000) == "1000M"


def test_mig_needs_an_instance_and_uses_its_uuid() -> None:
    setup = container_setup(Isolation.MIG, [AssignedGpu("A", 0, 9856, 0, "MIG-1")])
    assert setup == ContainerSetup({"CARPOOL_ISOLATION": "mig", "CUDA_VISIBLE_DEVICES": "MIG-1",
                                    "NVIDIA_VISIBLE_DEVICES": "void"},
                                   cdi_devices=("carpool.dev/gpu=MIG-1",))
    with pytest.raises(HandshakeError, match="names no MIG instance"):
        container_setup(Isolation.MIG, [AssignedGpu("A", 0, 9856, 0)])


# --- devices ----------------------------------------------------------------------------------


def test_share_counts_per_mode_and_unhealthy_gpus() -> None:
    backend = FakeBackend.from_spec({"node": NODE, "gpus": [
        {"model": "A100", "migInstances": [{"profile": "1g.10gb", "slices": 1, "memoryMiB": 9856}]},
        {"model": "A100"}]})
    mig, plain = backend.inventory()
    shares = advertised_shares(backend.inventory(), "mps", 4, {plain.uuid})
    assert [(s.share.gpu_uuid, s.healthy) for s in shares] == [(mig.uuid, True)] + [
        (plain.uuid, False)] * 4
    assert len(advertised_shares(backend.inventory(), "exclusive", 4)) == 2
    with pytest.raises(ValueError, match="unknown sharing mode"):
        advertised_shares(backend.inventory(), "shared", 4)


# --- watchdog ---------------------------------------------------------------------------------

CGROUP_V1 = "11:memory:/kubepods/burstable/pod1b4e28c1-58a1-4b2b-9d1c-0e1f2a3b4c5d/abc\n"
CGROUP_SYSTEMD = ("0::/kubepods.slice/kubepods-besteffort.slice/"
                  "kubepods-besteffort-pod1b4e28c1_58a1_4b2b_9d1c_0e1f2a3b4c5d.slice/cri-x.scope\n")


def test_pod_uid_from_both_cgroup_layouts() -> None:
    uid = "1b4e28c1-58a1-4b2b-9d1c-0e1f2a3b4c5d"
    assert pod_uid_from_cgroup(CGROUP_V1) == uid
    assert pod_uid_from_cgroup(CGROUP_SYSTEMD) == uid
    assert pod_uid_from_cgroup("0::/user.slice/session-1.scope\n") is None


def test_watchdog_warns_then_kills_on_the_third_consecutive_reading() -> None:
    grant = MemoryGrant("u1", "ns", "p", "A", 4096)
    usage = usage_by_pod([ProcessMemory(10, "A", 3000), ProcessMemory(11, "A", 2000),
                          ProcessMemory(12, "A", 9999), ProcessMemory(13, "B", 50)],
                         {10: "u1", 11: "u1", 12: None, 13: "u1"})
    assert usage[("u1", "A")] == (5000, (10, 11))
    strikes: dict[tuple[str, str], int] = {}
    verdicts = []
    for _ in range(3):
        strikes, found = watchdog_step(strikes, usage, [grant])
        verdicts.append(found[0].verdict)
    assert verdicts == [Verdict.WARN, Verdict.WARN, Verdict.KILL]
    assert found[0].pids == (10, 11) and strikes == {}
    strikes, _ = watchdog_step({}, usage, [grant])
    strikes, found = watchdog_step(strikes, {("u1", "A"): (100, (10,))}, [grant])
    assert found == [] and strikes == {}  # back under: the count starts again


# --- health -----------------------------------------------------------------------------------


def test_health_ignores_application_xids_and_recovers_after_quiet_probe() -> None:
    tracker = HealthTracker(recover_after_s=60)
    assert not tracker.record([HealthEvent("A", HealthEventKind.XID, 13)], 0.0)
    assert tracker.record([HealthEvent("A", HealthEventKind.XID, 79)], 0.0)
    assert tracker.unhealthy == {"A"} and tracker.reason("A") == "xid 79"
    assert not tracker.recheck(lambda u: True, 30.0)  # not quiet long enough
    assert not tracker.recheck(lambda u: False, 90.0)  # probe still failing
    assert tracker.recheck(lambda u: True, 90.0) and tracker.unhealthy == frozenset()
    assert tracker.record([HealthEvent("B", HealthEventKind.ECC, 1)], 100.0)


# --- proto ------------------------------------------------------------------------------------


def test_generated_stubs_match_the_proto_and_drift_is_detected(tmp_path: Path) -> None:
    from carpool.deviceplugin.api import generate

    assert generate.drifted(generate.HERE) == []
    copy = tmp_path / "stubs"
    generate.generate(copy)
    (copy / "api_pb2.py").write_text((copy / "api_pb2.py").read_text() + "# edited\n")
    (copy / "api_pb2_grpc.py").unlink()
    assert generate.drifted(copy) == ["api_pb2.py", "api_pb2_grpc.py"]
    grpc_stub = (generate.HERE / "api_pb2_grpc.py").read_text()
    assert "from carpool.deviceplugin.api.v1beta1 import api_pb2" in grpc_stub
    assert "'/v1beta1.DevicePlugin/Allocate'" in grpc_stub
    assert "'/v1beta1.Registration/Register'" in grpc_stub


def test_cli_rejects_incomplete_arguments() -> None:
    from carpool.deviceplugin.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--backend", "fake", "--node-name", "n"])
    with pytest.raises(SystemExit):
        parse_args(["--node-name", "n", "--shares-per-gpu", "0"])
    args = parse_args(["--node-name", "n", "--sharing-mode", "timeslice"])
    assert (args.sharing_mode, args.shares_per_gpu, args.backend) == ("timeslice", 8, "nvml")
