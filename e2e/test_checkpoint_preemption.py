"""Preemption with a checkpoint that really happens, on the real node, in the carpool image.

A preemptible batch job runs examples/train.py (the carpool image: Python and carpool.workload)
on both of the node's GPUs, with its checkpoints on a volume from its claim template (a
hostPath PersistentVolume here: one node). A short job of another project then needs a GPU:
the operator preempts the batch job, its process gets SIGTERM from the real kubelet, saves
and reports a checkpoint through the device plugin within its grace period, the GpuJob shows
it, the job is requeued and its next attempt resumes from that checkpoint: the step counter
continues. Each attempt is billed on its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import checkpointing, names
from carpool.core.gpuhours import gpu_hours
from carpool_testbed import realnode, stack

REPO = Path(__file__).resolve().parents[1]
LAYOUT = REPO / "build" / "images" / "carpool"
IMAGE_BASE = "ghcr.io/carpool-dev/carpool"
GRACE_S = 20
STEPS = 150
STEP_S = 0.2


def _time(text: str) -> float:
    return checkpointing.parse_time(text)


@pytest.fixture(scope="module")
def carpool_image(real_node: realnode.RealNode) -> str:
    """The carpool image of this tree (hack/images/build.py), imported into the node."""
    if not (LAYOUT / "index.json").is_file():
        subprocess.run([sys.executable, str(REPO / "hack/images/build.py"), "--out",
                        str(LAYOUT.parent)], check=True, timeout=1200,
                       env=dict(os.environ, PYTHONSAFEPATH="1"))
    return real_node.import_layout(LAYOUT, IMAGE_BASE)


class World:
    def __init__(self, node: realnode.RealNode, pods: Any) -> None:
        self.node, self.pods = node, pods
        self.suffix = uuid.uuid4().hex[:6]
        self.namespace = f"ckpt-{self.suffix}"
        self.volume = node.paths.base / "volumes" / self.namespace

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return self.node.kubectl(*args, stdin=stdin).stdout

    def job(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", "gpujob", name, "-n", self.namespace,
                                            "-o", "json")).get("status") or {})

    def template(self, image: str, command: list[str], **extra: Any) -> dict[str, Any]:
        spec = self.pods.manifest("unused", 1)["spec"]
        template = {k: v for k, v in spec.items()
                    if k in ("nodeSelector", "tolerations", "dnsPolicy")}
        main = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command,
                **extra.pop("container", {})}
        return {"spec": {**template, "restartPolicy": "Never", "containers": [main], **extra}}


@pytest.fixture
def world(real_node: realnode.RealNode, pods: Any) -> Iterator[World]:
    w = World(real_node, pods)
    w.volume.mkdir(parents=True)
    w.volume.chmod(0o777)  # the image runs as 65532
    try:
        yield w
    finally:
        w.node.kubectl("delete", "namespace", w.namespace, "--wait=false", check=False)
        for kind in ("projectquota", "persistentvolume"):
            w.node.kubectl("delete", kind, f"lo-{w.suffix}", f"hi-{w.suffix}",
                           w.namespace, "--ignore-not-found", "--wait=false", check=False)


def test_a_preempted_job_saves_on_sigterm_reports_and_resumes(
        world: World, carpool_image: str, carpool_stack: Path) -> None:
    ns, suffix = world.namespace, world.suffix
    storage_class = f"ckpt-{suffix}"
    code = (REPO / "examples" / "train.py").read_text()
    train = {
        "project": f"lo-{suffix}", "class": "batch", "preemptible": True,
        "gpu": {"count": 2, "memory": "8Gi", "isolation": "exclusive", "models": ["H200"]},
        "estimatedDuration": "5m",
        "checkpoint": {"gracePeriod": f"{GRACE_S}s", "volumeClaimTemplate": {"spec": {
            "storageClassName": storage_class, "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}}}}},
        "template": world.template(
            carpool_image,
            ["python3", "/app/train.py", "--steps", str(STEPS), "--step-seconds", str(STEP_S),
             "--checkpoint-every", "1000"],
            container={"volumeMounts": [{"name": "code", "mountPath": "/app"}]},
            volumes=[{"name": "code", "configMap": {"name": "train"}}]),
    }
    manifests = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        *({"apiVersion": names.API_VERSION, "kind": "ProjectQuota",
           "metadata": {"name": f"{p}-{suffix}"},
           "spec": {"namespaces": [ns], "concurrent": {"gpus": 2}}} for p in ("lo", "hi")),
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": ns},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                  "storageClassName": storage_class,
                  "persistentVolumeReclaimPolicy": "Retain",
                  "hostPath": {"path": str(world.volume), "type": "Directory"}}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "train", "namespace": ns},
         "data": {"train.py": code}},
        {"apiVersion": names.API_VERSION, "kind": "GpuJob",
         "metadata": {"name": "train", "namespace": ns}, "spec": train},
    ]
    world.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests))

    def diagnose(error: AssertionError) -> AssertionError:
        events = world.node.kubectl("get", "events", "-n", ns, check=False).stdout
        return AssertionError(
            f"{error}\ntrain: {world.job('train')}\n{events}\noperator log:\n"
            f"{stack.log_tail(carpool_stack / 'operator.log', 20)}\ndevice plugin log:\n"
            f"{stack.log_tail(world.node.paths.log('deviceplugin'), 20)}")

    try:
        world.pods.wait_for("train running with progress reported", lambda: (
            s if (s := world.job("train")).get("phase") == "Running"
            and (s.get("progress") or {}).get("value", 0) >= 0.1 else None), timeout=180)
    except AssertionError as error:
        raise diagnose(error) from None
    # the first attempt's output, followed until its container exits
    follow = subprocess.Popen(
        [str(world.node.cluster.bin_dir / "kubectl"), "--kubeconfig",
         str(world.node.cluster.kubeconfig), "logs", "-f", "train-1", "-n", ns],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    urgent = {"project": f"hi-{suffix}", "class": "short", "estimatedDuration": "1m",
              "gpu": {"count": 1, "memory": "8Gi", "isolation": "exclusive",
                      "models": ["H200"]},
              "template": world.template(realnode.TEST_IMAGE, ["/bin/sh", "-c", "sleep 5"])}
    world.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(
        {"apiVersion": names.API_VERSION, "kind": "GpuJob",
         "metadata": {"name": "urgent", "namespace": ns}, "spec": urgent}))
    def requeued() -> dict[str, Any] | None:
        status = world.job("train")
        history = status.get("history") or []
        return status if any(r.get("outcome") == "Preempted" for r in history) else None

    try:
        after = world.pods.wait_for("train preempted and requeued", requeued,
                                    timeout=GRACE_S + 60)
    except AssertionError as error:
        raise diagnose(error) from None
    try:
        first_log, _ = follow.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        follow.kill()
        first_log = follow.communicate()[0]

    # attempt 1 got SIGTERM, saved a checkpoint and had it recorded before it exited
    saved = re.findall(r"attempt=1 step=(\d+) checkpoint (\S+) .* recorded=True", first_log)
    stopped = re.search(r"attempt=1 step=(\d+) stopping on SIGTERM with ([\d.]+)s", first_log)
    assert saved and stopped, first_log
    step, path = int(saved[-1][0]), saved[-1][1]
    assert 0 < step < STEPS and step == int(stopped.group(1)), first_log
    assert float(stopped.group(2)) > 0
    assert after["lastCheckpoint"] == {"time": after["lastCheckpointTime"], "path": path,
                                       "progress": pytest.approx(step / STEPS), "attempt": 1}
    preempted = [e for e in json.loads(world.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=train",
        "-o", "json"))["items"] if e["reason"] == "Preempted"]
    assert preempted, "no Preempted event"
    told = min(_time(e.get("eventTime") or e["firstTimestamp"]) for e in preempted)
    # within the grace period after the operator told it to stop (event times have seconds)
    assert told - 1 <= _time(after["lastCheckpointTime"]) <= told + GRACE_S, (told, after)
    assert (world.volume / Path(path).name).is_file()

    try:
        done = world.pods.wait_for("train to finish its second attempt", lambda: (
            s if (s := world.job("train")).get("phase") in ("Succeeded", "Failed") else None),
            timeout=180)
    except AssertionError as error:
        raise diagnose(error) from None
    assert done["phase"] == "Succeeded", done

    # attempt 2 resumed from that checkpoint: the counter continued
    second_log = world.kubectl("logs", "train-2", "-n", ns)
    assert f"attempt=2 step={step} resumed from {path}" in second_log, second_log
    assert f"attempt=2 step={STEPS} done" in second_log, second_log
    assert done["resumedProgress"] == pytest.approx(step / STEPS)
    assert done["lastCheckpoint"]["attempt"] == 2
    pod2 = json.loads(world.kubectl("get", "pod", "train-2", "-n", ns, "-o", "json"))
    env2 = {e["name"]: e.get("value") for e in pod2["spec"]["containers"][0]["env"]}
    assert env2["CARPOOL_RESUME_FROM"] == path and env2["CARPOOL_ATTEMPT"] == "2"

    # billed per attempt: both GPUs over each attempt's own span
    first_run, second_run = sorted(done["history"], key=lambda r: r["attempt"])
    assert first_run["outcome"] == "Preempted" and second_run["outcome"] == "Succeeded"
    expected = sum(gpu_hours(2.0, _time(r["start"]), _time(r["end"]))
                   for r in (first_run, second_run))
    assert done["gpuHours"] == pytest.approx(expected, abs=2e-4)
