"""Class limits a platform team sets per project (ProjectQuota spec.classLimits): the rule
(quota.class_limit_refusal), reading it from the object, and a refused job in the cycle."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from carpool.core.decoding import quota_from_object
from carpool.core.jobs import ClassLimit, ClusterSnapshot, Job
from carpool.core.queueing import AdmissionConfig, WaitReason, admission_cycle
from carpool.core.quota import class_limit_refusal
from carpool.core.resources import GpuRequest, Isolation, JobClass
from carpool_testbed.builders import GIB, gpu_job, gpu_node, packing_placer, project_quota

LIMITS = ClassLimit(JobClass.INTERACTIVE, max_gpus=2, max_duration_s=8 * 3600,
                    max_grace_s=600, min_gpu_memory_mib=1024, min_gpu_cores_pct=10)
QUOTA = project_quota("a", class_limits=(LIMITS,))
WHERE = "ProjectQuota a spec.classLimits.interactive"


def interactive(count: int = 1, memory_mib: int = 8 * GIB, cores: int = 0,
                **fields: Any) -> Job:
    job = gpu_job("a/j", "a", JobClass.INTERACTIVE, count, **{"max_duration_s": 3600.0, **fields})
    return replace(job, request=GpuRequest(count, memory_mib, cores, isolation=Isolation.MPS))


@pytest.mark.parametrize(("job", "message"), [
    (interactive(count=16), f"spec.gpu.count 16 is more than {WHERE}.maxGpus 2"),
    (interactive(max_duration_s=10 * 365 * 86400.0),
     f"spec.maxDuration 3650d is longer than {WHERE}.maxDuration 8h"),
    (interactive(max_duration_s=0.0),
     f"spec.maxDuration must be set for class interactive: {WHERE}.maxDuration is 8h"),
    (interactive(checkpoint_grace_s=365 * 86400.0),
     f"spec.checkpoint.gracePeriod 365d is longer than {WHERE}.maxGracePeriod 10m"),
    (interactive(memory_mib=0), f"spec.gpu.memory 0Mi is less than {WHERE}.minGpuMemory 1024Mi"),
    (interactive(cores=1), f"spec.gpu.cores 1 is less than {WHERE}.minGpuCores 10"),
])
def test_a_job_beyond_its_class_limits_is_refused_naming_field_and_limit(
        job: Job, message: str) -> None:
    assert class_limit_refusal(job, QUOTA) == message


def test_within_the_limits_or_another_class_passes() -> None:
    assert class_limit_refusal(interactive(count=2, cores=0), QUOTA) is None  # cores unset
    assert class_limit_refusal(interactive(cores=10), QUOTA) is None
    batch = replace(interactive(count=16), job_class=JobClass.BATCH)
    assert class_limit_refusal(batch, QUOTA) is None
    assert class_limit_refusal(interactive(count=16), project_quota("a")) is None


def test_class_limits_are_read_from_the_projectquota() -> None:
    quota = quota_from_object({"metadata": {"name": "a"}, "spec": {
        "namespaces": ["a"], "classLimits": {
            "interactive": {"maxGpus": 2, "maxDuration": "8h", "maxGracePeriod": "10m",
                            "minGpuMemory": "1Gi", "minGpuCores": 10},
            "batch": {"maxGpus": 8}}}})
    assert quota.class_limits == (ClassLimit(JobClass.BATCH, max_gpus=8), LIMITS)


def test_the_cycle_refuses_the_job_without_queueing_it() -> None:
    jobs = (interactive(count=16), replace(gpu_job("a/ok", "a", JobClass.INTERACTIVE),
                                           max_duration_s=3600))
    result = admission_cycle(ClusterSnapshot(0.0, jobs, {"a": QUOTA},
                                             {"n1": gpu_node("n1", gpus=2)}),
                             AdmissionConfig(node_placer=packing_placer))
    assert [a.job_key for a in result.admissions] == ["a/ok"]
    (wait,) = result.waits
    assert wait.reason is WaitReason.CLASS_LIMIT and wait.reason.refused
    assert wait.message == f"spec.gpu.count 16 is more than {WHERE}.maxGpus 2"
    assert wait.position == 0 and wait.estimated_start is None
