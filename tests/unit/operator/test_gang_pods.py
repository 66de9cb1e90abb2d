"""A gang's pods: one per worker, pinned where the admission placed it, with what torchrun
reads, and a headless Service for rank 0's address."""

from __future__ import annotations

from typing import Any

from carpool.core import names
from carpool.core.assignment import AssignedGpu, Assignment, parse_assignment
from carpool.core.decoding import worker_requests_from_spec
from carpool.core.resources import Isolation
from carpool.operator.pods import (
    MASTER_PORT,
    build_gang_service,
    build_worker_pods,
    gang_service_name,
    pod_name,
    worker_pod_name,
)


def _job() -> dict[str, Any]:
    return {"metadata": {"name": "train", "namespace": "lab", "uid": "u-1"},
            "spec": {"project": "lab", "gpu": {"count": 2, "memory": "40Gi",
                                               "isolation": "exclusive"},
                     "workers": [{"name": "lead", "replicas": 1, "gpu": {"count": 4}},
                                 {"name": "rest", "replicas": 2}],
                     "template": {"spec": {"containers": [{"name": "main", "image": "t"}]}}}}


def _planned(node: str, uuids: list[str]) -> Assignment:
    return Assignment(node, tuple(AssignedGpu(u, i, 40960, 100, container="main")
                                  for i, u in enumerate(uuids)), Isolation.EXCLUSIVE)


def test_one_pod_per_worker_pinned_with_torchrun_env() -> None:
    job = _job()
    requests = worker_requests_from_spec(job["spec"])
    planned = [_planned("n1", ["a", "b", "c", "d"]), _planned("n2", ["e", "f"]),
               _planned("n2", ["g", "h"])]
    pods = build_worker_pods(job, requests, 3, planned)
    assert [p["metadata"]["name"] for p in pods] == [
        pod_name("train", 3), "train-3-w1", "train-3-w2"]
    for rank, pod in enumerate(pods):
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["annotations"][names.ANN_WORKER_RANK] == str(rank)
        assert parse_assignment(meta["annotations"][names.ANN_PLANNED]) == planned[rank]
        assert (spec["hostname"], spec["subdomain"]) == (f"w{rank}", "train")
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "w0.train"
        assert env["MASTER_PORT"] == str(MASTER_PORT)
        assert env["WORLD_SIZE"] == env["PET_NNODES"] == "3"
        assert env["RANK"] == env["NODE_RANK"] == env["PET_NODE_RANK"] == str(rank)
        gpus = spec["containers"][0]["resources"]["limits"][names.RESOURCE_GPU]
        assert env["LOCAL_WORLD_SIZE"] == env["PET_NPROC_PER_NODE"] == gpus
    assert [p["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_GPU]
            for p in pods] == ["4", "2", "2"]


def test_the_headless_service_selects_the_job_s_pods_and_is_owned_by_it() -> None:
    service = build_gang_service(_job())
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"][names.LABEL_JOB] == "train"
    assert service["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_names_stay_valid_for_long_or_dotted_job_names() -> None:
    assert gang_service_name("train") == "train"
    assert gang_service_name("7b.run").startswith("gang-")
    long = "x" * 70
    assert len(worker_pod_name(long, 12, 15)) <= 63
    assert worker_pod_name("train", 1, 0) == pod_name("train", 1)
