"""What the platform sets on every job pod: its runtime class and the MPS client user."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.core import names
from carpool.core.decoding import gpu_request_from_spec
from carpool.core.resources import Isolation
from carpool.operator.pods import PlatformPodSettings, apply_platform_settings, build_pod
from carpool.operator.reconciler import ReconcilerConfig
from carpool.operator.settings import OperatorSettings

SETTINGS = PlatformPodSettings(runtime_class="nvidia", mps_uid=1000, mps_gid=2000)


def _pod(isolation: str, template_spec: dict[str, Any]) -> dict[str, Any]:
    spec = {"project": "vision", "class": "short", "estimatedDuration": "10m",
            "gpu": {"count": 1, "memory": "8Gi", "cores": 25, "isolation": isolation},
            "template": {"spec": template_spec}}
    job = {"apiVersion": names.API_VERSION, "kind": "GpuJob",
           "metadata": {"name": "train", "namespace": "team", "uid": "u-1"}, "spec": spec}
    request = gpu_request_from_spec(spec)
    return apply_platform_settings(build_pod(job, request, 1), request.isolation, SETTINGS)


def test_an_mps_job_runs_as_the_platforms_user_whatever_its_template_says() -> None:
    pod = _pod("mps", {
        "runtimeClassName": "runc",
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "fsGroup": 3000},
        "initContainers": [{"name": "fetch", "image": "i",
                            "securityContext": {"runAsUser": 33}}],
        "containers": [{"name": "main", "image": "i",
                        "securityContext": {"runAsUser": 4242, "runAsGroup": 4242,
                                            "readOnlyRootFilesystem": True}},
                       {"name": "side", "image": "i"}]})
    spec = pod["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["securityContext"] == {"runAsUser": 1000, "runAsGroup": 2000,
                                       "runAsNonRoot": False, "fsGroup": 3000}
    main, side = spec["containers"]
    # a container's own user would win over the pod's: it is replaced, the rest kept
    assert main["securityContext"] == {"runAsUser": 1000, "runAsGroup": 2000,
                                       "readOnlyRootFilesystem": True}
    assert "securityContext" not in side  # the pod's applies
    assert spec["initContainers"][0]["securityContext"] == {"runAsUser": 1000,
                                                            "runAsGroup": 2000}


@pytest.mark.parametrize("isolation", ["exclusive", "timeslice"])
def test_other_jobs_keep_their_user_and_get_the_runtime_class(isolation: str) -> None:
    pod = _pod(isolation, {"securityContext": {"runAsUser": 4242},
                           "containers": [{"name": "main", "image": "i"}]})
    assert pod["spec"]["securityContext"] == {"runAsUser": 4242}
    assert pod["spec"]["runtimeClassName"] == "nvidia"


def test_without_settings_the_pod_is_the_templates() -> None:
    template = {"runtimeClassName": "kata", "containers": [{"name": "main", "image": "i"}]}
    spec = {"project": "p", "class": "short", "estimatedDuration": "1m",
            "gpu": {"count": 1, "isolation": "mps", "memory": "1Gi"},
            "template": {"spec": template}}
    job = {"metadata": {"name": "j", "namespace": "n", "uid": "u"}, "spec": spec}
    pod = build_pod(job, gpu_request_from_spec(spec), 1)
    before = repr(pod)
    assert repr(apply_platform_settings(pod, Isolation.MPS, PlatformPodSettings())) == before


def test_settings_from_the_environment_name_the_bad_value() -> None:
    config = ReconcilerConfig.from_environment({"CARPOOL_JOB_RUNTIME_CLASS": "nvidia",
                                                "CARPOOL_MPS_CLIENT_UID": "1000",
                                                "CARPOOL_MPS_CLIENT_GID": " "})
    assert config.platform == PlatformPodSettings("nvidia", 1000, None)
    assert ReconcilerConfig.from_environment({}).platform == PlatformPodSettings()
    for value in ("0", "-1", "root"):
        with pytest.raises(ValueError, match="CARPOOL_MPS_CLIENT_UID must be a user or group"):
            OperatorSettings.from_environment({"CARPOOL_MPS_CLIENT_UID": value})
