"""Carpool's own images, built without a container engine, pushed to a real registry and pulled
by the real node's containerd through its registry host configuration (hosts.toml).

The images are built (hack/images/build.py: Debian packages and the locked wheels, cached),
the CNCF distribution registry serves on loopback (hack/images/registry.sh) and crane pushes
them (hack/images/push.sh). Nothing is imported into containerd for these images: the kubelet
asks CRI to pull `localhost:PORT/...`, and the pod's imageID must be the digest pushed.
CARPOOL_E2E_IMAGES=reuse pushes the layouts already in build/images (`make images`) instead
of building them again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import names
from carpool_testbed import devcluster, realnode

REPO = Path(__file__).resolve().parents[1]
USER_ID = 65532


@pytest.fixture(scope="module")
def pushed(real_node: realnode.RealNode) -> Iterator[dict[str, str]]:
    """{"carpool": "localhost:PORT/carpool:V@sha256:...", "carpool-mps": ...}, pushed now."""
    layouts = REPO / "build" / "images"
    reuse = os.environ.get("CARPOOL_E2E_IMAGES") == "reuse" and all(
        (layouts / name / "index.json").is_file() for name in ("carpool", "carpool-mps"))
    if not reuse:
        built = subprocess.run([sys.executable, str(REPO / "hack" / "images" / "build.py"),
                                "--out", str(layouts)], capture_output=True, text=True,
                               timeout=900, check=False)
        assert built.returncode == 0, built.stderr[-3000:]
    registry = real_node.settings.registry
    env = dict(os.environ, REGISTRY=registry,
               CARPOOL_REGISTRY_PORT=registry.rsplit(":", 1)[1])
    subprocess.run(["bash", str(REPO / "hack" / "images" / "registry.sh"), "up"], env=env,
                   check=True, capture_output=True, timeout=900)
    done = subprocess.run(["bash", str(REPO / "hack" / "images" / "push.sh")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    refs = {}
    for line in done.stdout.splitlines():
        ref, digest = line.split()
        refs[ref.rsplit("/", 1)[1].split(":")[0]] = f"{ref}@{digest}"
    assert {"carpool", "carpool-mps"} <= set(refs), done.stdout
    yield refs


def _tolerate_real_node(node: realnode.RealNode) -> dict[str, Any]:
    taint = realnode.REAL_NODE_TAINT
    return {"nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": [{"key": taint["key"], "operator": "Exists",
                             "effect": taint["effect"]}]}


def _tag(ref: str) -> str:
    return ref.split("@")[0]


def test_the_node_pulls_carpool_from_the_registry_and_runs_it_as_the_chart_does(
        real_node: realnode.RealNode, pushed: dict[str, str], pods: Any) -> None:
    """The chart's security context (65532, read-only root, no capabilities): every component
    imports, the CLI runs, and the image came from the registry by the pushed digest."""
    name = f"image-check-{uuid.uuid4().hex[:6]}"
    check = ("import os, carpool.operator.handlers, carpool.extender, carpool.deviceplugin, "
             "carpool.cli.kubectl_plugin; print('uid', os.getuid()); "
             "import subprocess; subprocess.run(['kubectl-carpool', '--help'], check=True, "
             "stdout=subprocess.DEVNULL)")
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            **_tolerate_real_node(real_node),
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": USER_ID,
                                "runAsGroup": USER_ID},
            "containers": [{
                "name": "main", "image": _tag(pushed["carpool"]),
                "imagePullPolicy": "Always",
                "command": ["python", "-c", check],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }
    pods.create(pod)
    try:
        def finished() -> dict[str, Any] | None:
            got = json.loads(real_node.kubectl("get", "pod", name, "-o", "json").stdout)
            return got if got["status"].get("phase") in ("Succeeded", "Failed") else None

        got = pods.wait_for(f"pod {name} to finish", finished, timeout=240, interval=1)
        logs = real_node.kubectl("logs", name, check=False).stdout
        assert got["status"]["phase"] == "Succeeded", (logs, got["status"])
        assert f"uid {USER_ID}" in logs
        (status,) = got["status"]["containerStatuses"]
        assert status["imageID"].endswith(pushed["carpool"].split("@")[1]), status
        events = real_node.kubectl("get", "events", "--field-selector",
                                   f"involvedObject.name={name}", "-o", "json").stdout
        reasons = [e["reason"] for e in json.loads(events)["items"]]
        assert "Pulled" in reasons or "Pulling" in reasons, reasons
    finally:
        pods.delete_all()


def test_the_charts_mps_daemon_is_ready_on_a_node_without_gpus(
        real_node: realnode.RealNode, pushed: dict[str, str], pods: Any) -> None:
    """The chart's MPS daemon DaemonSet (rendered by helm with devicePlugin.backend=fake) from
    the registry's carpool-mps image reaches Running and Ready on the real node."""
    helm = devcluster.known_bin_dir(devcluster.ClusterPaths.for_name())
    assert helm is not None
    namespace = f"mps-{uuid.uuid4().hex[:6]}"
    taint = realnode.REAL_NODE_TAINT
    repository, tag = _tag(pushed["carpool-mps"]).rsplit(":", 1)
    rendered = subprocess.run(
        [str(helm / "helm"), "template", "carpool", str(REPO / "helm" / "carpool"),
         "--namespace", namespace, "--show-only", "templates/mps-daemon.yaml",
         "--set", "devicePlugin.backend=fake",
         "--set", f"mpsDaemon.image.repository={repository}",
         "--set", f"mpsDaemon.image.tag={tag}",
         "--set", "mpsDaemon.image.pullPolicy=Always",
         "--set", f"devicePlugin.mpsDir={real_node.paths.mps_dir}",
         "--set", f"devicePlugin.tolerations[0].key={taint['key']}",
         "--set", "devicePlugin.tolerations[0].operator=Exists"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    (daemonset,) = [o for o in yaml.safe_load_all(rendered) if o]
    real_node.kubectl("create", "namespace", namespace)
    try:
        real_node.kubectl("apply", "-f", "-", stdin=json.dumps(daemonset))

        def ready() -> dict[str, Any] | None:
            listed = json.loads(real_node.kubectl("get", "pods", "-n", namespace, "-o",
                                                  "json").stdout)["items"]
            for pod in listed:
                conditions = {c["type"]: c["status"]
                              for c in pod["status"].get("conditions", [])}
                if pod["status"].get("phase") == "Running" and conditions.get("Ready") == "True":
                    return dict(pod)
            return None

        pod = pods.wait_for("the MPS daemon pod to be Running and Ready", ready, timeout=240,
                       interval=1)
        assert pod["spec"]["nodeName"] == real_node.name
        assert pod["spec"]["nodeSelector"][names.LABEL_SHARING] == "mps"
        (status,) = pod["status"]["containerStatuses"]
        assert status["imageID"].endswith(pushed["carpool-mps"].split("@")[1]), status
        assert (real_node.paths.mps_dir / "pipe").is_dir()
    finally:
        real_node.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
