"""The workload protocol end to end within one process: the job's helper (carpool.workload)
writes reports, the node agent's reader (deviceplugin.reports) checks them and records them in
the GpuJob status (a fake status writer here), the operator decodes them and builds the next
attempt's pod; plus the hostile cases a tenant-written directory brings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from carpool import workload
from carpool.core import checkpointing as protocol
from carpool.core.decoding import job_from_object
from carpool.core.jobs import Job, RunRecord
from carpool.core.resources import GpuRequest, Isolation, JobClass, Phase
from carpool.core.run_times import expected_remaining, progress_remaining
from carpool.deviceplugin.handshake import ServedPod
from carpool.deviceplugin.reports import Refused, ReportReader, prepare, write_ack
from carpool.operator.pods import build_checkpoint_claim, build_pod

NOW = 1_800_000_000.0


class Statuses:
    """GpuJob statuses as a status writer sees them; refuses jobs listed in `refuse`."""

    def __init__(self) -> None:
        self.status: dict[tuple[str, str], dict[str, Any]] = {}
        self.refuse: set[tuple[str, str]] = set()

    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> None:
        if (namespace, name) in self.refuse:
            raise Refused("403 Forbidden: this token is bound to another node")
        self.status.setdefault((namespace, name), {}).update(status)


def job_pod(name: str = "train-2", uid: str = "uid-1", job: str = "lab/train") -> ServedPod:
    return ServedPod("lab", name, uid, "Running", False, {"carpool.dev/job": job}, (("main", 1),))


def reader(root: Path, pods: list[ServedPod], statuses: Statuses,
           clock: float = NOW) -> ReportReader:
    async def listed() -> list[ServedPod]:
        return pods
    return ReportReader("node-a", root, listed, statuses, clock=lambda: clock)


def step(r: ReportReader) -> list[str]:
    return asyncio.run(r.step())


# ---------------------------------------------------------------------------- reports


def test_reports_are_checked_strictly() -> None:
    good = protocol.parse_checkpoint(
        b'{"time": "2027-01-15T08:00:00Z", "path": "/checkpoint/s120", "progress": 0.25}', NOW)
    assert (good.path, good.progress) == ("/checkpoint/s120", 0.25)
    # a time in the future counts as now: no claiming work not yet saved
    assert protocol.parse_checkpoint(b'{"time": "2099-01-01T00:00:00Z"}', NOW).time == NOW
    for text, words in [
        (b"not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"path": "x"}', "'time'"),
        (b'{"time": "yesterday"}', "RFC 3339"),
        (b'{"time": "2027-01-15T08:00:00"}', "UTC offset"),
        (b'{"time": "2027-01-15T08:00:00Z", "progress": 1.5}', "0 to 1"),
        (b'{"time": "2027-01-15T08:00:00Z", "progress": true}', "0 to 1"),
        (b'{"time": "2027-01-15T08:00:00Z", "path": 7}', "'path'"),
        (b'{"time": "2027-01-15T08:00:00Z", "path": "' + b"x" * 5000 + b'"}', "bytes"),
    ]:
        with pytest.raises(protocol.ReportError, match=words):
            protocol.parse_checkpoint(text, NOW)
    with pytest.raises(protocol.ReportError, match="0 to 1"):
        protocol.parse_progress(b'{"progress": NaN, "time": "2027-01-15T08:00:00Z"}', NOW)


def test_a_checkpoint_goes_from_the_job_through_the_agent_into_the_status(
        tmp_path: Path) -> None:
    """The helper writes, the agent records and acknowledges, the helper sees the ack."""
    statuses = Statuses()
    directory = prepare(tmp_path, "uid-1")
    clock = [NOW - 30.0]
    run = workload.Run.from_environment(
        {"CARPOOL_ATTEMPT": "2", "CARPOOL_GRACE_PERIOD": "20",
         "CARPOOL_REPORT_DIR": str(directory)}, clock=lambda: clock[0])
    assert run.report_progress(0.4)
    agent = reader(tmp_path, [job_pod()], statuses)
    assert step(agent) == ["lab/train-2: recorded progress 0.400"]
    assert step(agent) == []  # nothing new: no second write
    assert statuses.status[("lab", "train")]["progress"]["attempt"] == 2

    clock[0] = NOW - 10.0
    agent_done = threading.Event()

    def agent_loop() -> None:
        while not agent_done.wait(0.05):
            step(agent)
    thread = threading.Thread(target=agent_loop)
    thread.start()
    try:
        assert run.report_checkpoint("/checkpoint/step-120", progress=0.5, wait_s=5.0)
    finally:
        agent_done.set()
        thread.join()
    status = statuses.status[("lab", "train")]
    assert status["lastCheckpointTime"] == protocol.format_time(NOW - 10.0)
    assert status["lastCheckpoint"] == {"time": protocol.format_time(NOW - 10.0),
                                        "path": "/checkpoint/step-120", "progress": 0.5,
                                        "attempt": 2}
    assert status["progress"]["value"] == 0.5


def test_without_a_report_directory_reports_are_dropped(tmp_path: Path) -> None:
    run = workload.Run.from_environment({})
    assert (run.attempt, run.resume_from, run.checkpoint_dir) == (1, None, None)
    assert not run.report_checkpoint(tmp_path / "c")
    assert not run.report_progress(0.1)
    with pytest.raises(ValueError, match="0 to 1"):
        workload.Run(report_dir=tmp_path).report_progress(2.0)
    with pytest.raises(ValueError, match="malformed"):
        workload.Run.from_environment({"CARPOOL_ATTEMPT": "two"})


def test_sigterm_sets_the_deadline_and_calls_back() -> None:
    run = workload.Run(grace_period_s=25.0, clock=lambda: NOW)
    seen: list[float] = []
    previous = signal.getsignal(signal.SIGTERM)
    try:
        run.on_preemption(seen.append)
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.stopping and run.deadline == NOW + 25.0 and seen == [NOW + 25.0]
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        assert seen == [NOW + 25.0] and run.seconds_left() == 25.0
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_hostile_report_directories(tmp_path: Path) -> None:
    """Links are never followed (reading or acknowledging), bad reports are ignored once,
    a pod may report only for a job in its own namespace, a refusal is not retried."""
    statuses = Statuses()
    secret = tmp_path / "host-secret"
    secret.write_text('{"time": "2027-01-15T08:00:00Z", "path": "stolen"}')
    root = tmp_path / "reports"
    one = prepare(root, "uid-1")
    (one / "checkpoint.json").symlink_to(secret)
    (one / "progress.json").write_text("{not json")
    two = prepare(root, "uid-2")
    (two / "checkpoint.json").write_text('{"time": "2027-01-15T08:00:00Z", "path": "p"}')
    three = prepare(root, "uid-3")
    (three / "checkpoint.json").write_text('{"time": "2027-01-15T08:00:00Z", "path": "q"}')
    statuses.refuse.add(("lab", "elsewhere"))
    pods = [job_pod(uid="uid-1"), job_pod("x-1", "uid-2", job="other-ns/train"),
            job_pod("elsewhere-1", "uid-3", job="lab/elsewhere")]
    agent = reader(root, pods, statuses)
    lines = step(agent)
    assert lines[0].startswith("lab/train-2: ignored progress.json: progress.json is not JSON")
    assert lines[1].startswith("lab/elsewhere-1: refused checkpoint 'q'")
    assert len(lines) == 2 and statuses.status == {}
    assert step(agent) == []  # neither the bad file nor the refusal is tried again

    # an ack planted as a link to a host file is replaced, the host file untouched
    (one / "checkpoint.json").unlink()
    (one / "checkpoint.ack").symlink_to(secret)
    write_ack(one, "2027-01-15T08:00:00.000Z")
    assert not (one / "checkpoint.ack").is_symlink()
    assert json.loads(secret.read_text())["path"] == "stolen"


def test_directories_of_gone_pods_are_removed_once_quiet(tmp_path: Path) -> None:
    statuses = Statuses()
    gone = prepare(tmp_path, "uid-gone")
    os.utime(gone, (NOW - 120, NOW - 120))
    fresh = prepare(tmp_path, "uid-fresh")
    os.utime(fresh, (NOW - 5, NOW - 5))
    step(reader(tmp_path, [], statuses))
    assert not gone.exists() and fresh.exists()
    with pytest.raises(ValueError):
        prepare(tmp_path, "../etc")


# ---------------------------------------------------------------------------- operator


def gpujob(status: dict[str, Any] | None = None, **checkpoint: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "project": "vision", "class": "batch", "preemptible": True,
        "gpu": {"count": 1, "memory": "8Gi", "isolation": "mps"},
        "checkpoint": {"gracePeriod": "20s", **checkpoint},
        "template": {"spec": {"containers": [
            {"name": "main", "image": "carpool", "env": [{"name": "CARPOOL_ATTEMPT",
                                                         "value": "forged"}]},
            {"name": "side", "image": "carpool"}]}},
    }
    return {"metadata": {"name": "train", "namespace": "lab", "uid": "u-1",
                         "creationTimestamp": "2027-01-15T07:00:00Z"},
            "spec": spec, "status": status or {}}


REQUEST = GpuRequest(count=1, memory_mib=8192, isolation=Isolation.MPS)


def test_each_attempt_learns_its_number_grace_storage_and_resume_point() -> None:
    first = build_pod(gpujob(volumeClaimTemplate={"spec": {"resources": {
        "requests": {"storage": "1Gi"}}, "accessModes": ["ReadWriteOnce"]}}), REQUEST, 1)
    for container in first["spec"]["containers"]:
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == {"CARPOOL_JOB": "lab/train", "CARPOOL_ATTEMPT": "1",
                       "CARPOOL_GRACE_PERIOD": "20", "CARPOOL_CHECKPOINT_DIR": "/checkpoint"}
        assert {"name": "carpool-checkpoint", "mountPath": "/checkpoint"} \
            in container["volumeMounts"]
    assert {"name": "carpool-checkpoint", "persistentVolumeClaim": {
        "claimName": "train-checkpoint"}} in first["spec"]["volumes"]

    status = {"lastCheckpoint": {"path": "/data/step-40", "progress": 0.4, "attempt": 1}}
    second = build_pod(gpujob(status, mountPath="/data", volumeClaimTemplate={"spec": {}}),
                       REQUEST, 2)
    env = {e["name"]: e["value"] for e in second["spec"]["containers"][0]["env"]}
    assert env["CARPOOL_ATTEMPT"] == "2" and env["CARPOOL_RESUME_FROM"] == "/data/step-40"
    assert env["CARPOOL_CHECKPOINT_DIR"] == "/data"

    # without a claim template: no storage, no volume; the default grace is Kubernetes' own
    plain = gpujob()
    del plain["spec"]["checkpoint"]
    pod = build_pod(plain, REQUEST, 1)
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert "CARPOOL_CHECKPOINT_DIR" not in env and env["CARPOOL_GRACE_PERIOD"] == "30"
    assert "volumes" not in pod["spec"] and build_checkpoint_claim(plain) is None


def test_the_claim_belongs_to_the_job() -> None:
    claim = build_checkpoint_claim(gpujob(volumeClaimTemplate={
        "metadata": {"labels": {"team": "a"}},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs"}}))
    assert claim is not None
    assert claim["metadata"]["name"] == "train-checkpoint"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert claim["metadata"]["labels"]["team"] == "a"
    assert claim["spec"]["storageClassName"] == "nfs"


def test_progress_counts_only_from_the_attempt_that_runs() -> None:
    status = {"lastCheckpointTime": "2027-01-15T08:00:00Z",
              "progress": {"value": 0.6, "time": "2027-01-15T08:10:00Z", "attempt": 2},
              "resumedProgress": 0.4}
    job = job_from_object(gpujob(status), Phase.RUNNING, 2, (), "n", [])
    assert job.last_checkpoint_at == protocol.parse_time("2027-01-15T08:00:00Z")
    assert (job.progress, job.resumed_progress) == (0.6, 0.4)
    older = job_from_object(gpujob(status), Phase.RUNNING, 3, (), "n", [])
    assert older.progress is None and older.progress_at is None


# ---------------------------------------------------------------------------- core


def running(progress: float | None, at: float | None, resumed: float = 0.0) -> Job:
    return Job(key="lab/train", project="vision", job_class=JobClass.BATCH, request=REQUEST,
               submitted_at=0.0, estimated_duration_s=10_000.0, max_duration_s=20_000.0,
               phase=Phase.RUNNING, attempts=2, progress=progress, progress_at=at,
               resumed_progress=resumed, runs=(RunRecord(2, 1000.0, None, 1.0),))


def test_the_expected_end_follows_reported_progress() -> None:
    # resumed at 0.4, at 0.6 after 1,000 s: 0.2 per 1,000 s, so 0.4 more takes 2,000 s
    job = running(0.6, 2000.0, resumed=0.4)
    assert progress_remaining(job, 2500.0) == pytest.approx(1500.0)
    assert expected_remaining(job, 2500.0, 10_000.0, 60.0) == pytest.approx(1500.0)
    # no progress since the resume: no rate, the estimate decides (10,000 - 1,500 run)
    assert progress_remaining(running(0.4, 2000.0, resumed=0.4), 2500.0) is None
    assert expected_remaining(running(None, None), 2500.0, 10_000.0, 60.0) == 8500.0
    # past what its progress promised: half its age more, as any overrunning job; never
    # beyond the limit's end
    assert expected_remaining(job, 9000.0, 10_000.0, 60.0) == 4000.0
    slow = running(0.01, 2000.0)
    assert expected_remaining(slow, 2000.0, 10_000.0, 60.0) == 19_000.0
