"""The bounded search (`Ranker.search`) passes the nodes, and bind pins the GPUs, that scoring
every candidate does, on random clusters as pods bind, start and leave."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from carpool.core.resources import Gpu, Isolation, MigInstance, NodeInventory
from carpool.extender import service
from carpool.extender.cache import ClusterCache
from carpool.extender.fake import FakeCluster
from carpool.extender.service import Extender, Settings
from carpool.extender.wire import BindingArgs, ExtenderArgs, decode_pod

NOW = 1_800_000_000.0
MODELS = {"A100": 80, "T4": 16, "V100": 32}
EVERY = frozenset({Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE})


def inventory(rng: random.Random, name: str) -> NodeInventory:
    model = rng.choice(sorted(MODELS))
    kind = rng.randrange(8)
    mig = kind == 0 and model == "A100"
    sharing = {0: frozenset({Isolation.MIG}) if mig else EVERY, 1: frozenset({Isolation.MPS}),
               2: frozenset({Isolation.TIMESLICE, Isolation.EXCLUSIVE})}.get(kind, EVERY)
    gpus = tuple(
        Gpu(i, f"{name}-g{i}", model, MODELS[model] * 1024,
            temperature_c=rng.choice([35.0, 40.0, 40.0, 55.0, 84.0]),
            healthy=rng.random() > 0.05, exclusive_process=kind == 1,
            mps_ceiling_pct=50 if kind == 3 else 100,
            mig_instances=tuple(MigInstance(f"{name}-g{i}-m{j}", "1g.10gb", 1, 10 * 1024)
                                for j in range(3)) if mig else ())
        for i in range(rng.choice([1, 2, 4, 8])))
    return NodeInventory(name, gpus, cpu_milli=rng.choice([0, 16_000]), sharing=sharing,
                         ready=rng.random() > 0.05,
                         datasets=frozenset({"imagenet"} if rng.random() < 0.2 else ()))


def pod(rng: random.Random, i: int) -> dict[str, Any]:
    count = rng.choice([1, 1, 1, 2, 4])
    isolation = rng.choice(["mps", "mps", "timeslice", "exclusive", "mig"])
    annotations = {"carpool.dev/isolation": isolation}
    if rng.random() < 0.3:
        annotations["carpool.dev/models"] = rng.choice(["T4", "A100,V100", "V100"])
    if rng.random() < 0.2:
        annotations |= {"carpool.dev/dataset": "imagenet", "carpool.dev/dataset-size": "200"}
    if rng.random() < 0.2:
        annotations["carpool.dev/policy"] = "spread"
    limits = {"carpool.dev/gpu": str(count),
              "carpool.dev/gpu-memory": str(rng.choice([4, 8, 10, 16, 30])),
              "carpool.dev/gpu-cores": str(rng.choice([10, 25, 50, 100]))}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": "default", "uid": f"u{i}",
                         "annotations": annotations},
            "spec": {"containers": [{"name": "main", "resources": {
                "limits": limits,
                "requests": {**limits, "cpu": rng.choice(["0", "2", "12"])}}}]},
            "status": {"phase": "Pending"}}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keep", [1, 3])
def test_the_bounded_search_passes_the_nodes_scoring_every_node_passes(
        seed: int, keep: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # filter's nominations expire on the monotonic clock: frozen, both extenders see the
    # same ones however slowly the machine runs the two filters of a pod one after the other
    monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=lambda: 1000.0,
                                                         time=lambda: NOW))
    rng = random.Random(seed)
    cache = ClusterCache()
    for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
        cache.mark_synced(kind)
    names = [f"n{i:03d}" for i in range(60)]
    for name in names:
        cache.put_inventory(inventory(rng, name))
    cluster = FakeCluster(on_change=lambda event, p: cache.apply_pod(event, p, NOW))
    bounded, full = (Extender(cache, cluster, Settings(filter_best=keep, bounded_search=b,
                                                       bind_wait_s=0.0), clock=lambda: NOW)
                     for b in (True, False))
    searched = 0
    for i in range(200):
        manifest = pod(rng, i)
        cluster.add_pod(manifest)
        asked = names if rng.random() < 0.7 else rng.sample(names, 40)
        args = ExtenderArgs(cluster.pod("default", f"p{i}"), tuple(asked), None)
        looked = bounded.ranker.hits + bounded.ranker.misses
        answer = full.filter(args)
        assert bounded.filter(args) == answer, f"pod {i}"
        searched += bounded.ranker.hits + bounded.ranker.misses - looked < len(asked) // 2
        passed = answer["NodeNames"]
        if passed and rng.random() < 0.8:
            node = passed[0]
            state = cache.state_of(node)
            assert state is not None
            demand, policy = decode_pod(args.pod), full._policy(decode_pod(args.pod))
            mine = bounded.ranker.evaluate(state, demand, policy).placement
            theirs = full.ranker.evaluate(state, demand, policy).placement
            assert mine == theirs
            # (it may wait for another pod's hand-over there, and then fail: a retry later)
            error = full.bind(BindingArgs(f"p{i}", "default", f"u{i}", node))["Error"]
            bounded.nominations.clear(f"default/p{i}")
            if not error and rng.random() < 0.7:  # it starts: no longer in flight
                running = cluster.pod("default", f"p{i}")
                running["status"]["phase"] = "Running"
                cluster.update_pod(running)
        if rng.random() < 0.15 and i > 10:  # one leaves
            gone = cluster.pod("default", f"p{rng.randrange(i)}")
            gone["status"]["phase"] = "Succeeded"
            cluster.update_pod(gone)
    assert searched > 100  # most filters scored less than half the nodes
