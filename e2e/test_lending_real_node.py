"""Lending within a GPU on the real node: a borrower placed into an idle grant, reclaimed when
the owner's use rises, checkpointed and requeued, the owner never refused memory.

The node's two GPUs are the device plugin's fake H200s (143771 MiB each); the GPU memory its
processes hold is what this test writes into the plugin's usage file (`RealNode.set_gpu_usage`,
host pids and MiB, as NVML would list them), so everything above the driver is the real thing:
the plugin's watchdog finds each process's pod by its cgroup and publishes the pods' peaks in
the GpuNode status, the operator (lending on) lends and reclaims, the extender binds, the real
kubelet starts and stops the containers, and the stopping borrower reports its checkpoint
through the plugin.

The test plays the GPU: each second it sets each process's memory from what its workload wants,
granting growth only where the GPU has the memory left (a refusal is what a CUDA allocation
would meet). On each GPU (an MPS client may hold at most half of it, the plugin's ceiling):
alice's service holds 60 GiB and uses 55; her training job holds 70 GiB and, idle, uses 6, so
64 GiB of it are lent. bob's preemptible sweep asks for 40 GiB, more than the 10.4 GiB left
free, and is placed into the lent memory, where it uses 30. alice's training grows to 30 GiB
(its lent part still covers bob: he stays), then on by 0.5 GiB/s towards 68 GiB: past 33 GiB
the lent part no longer covers bob, the operator tells him to stop, his job saves a checkpoint
on SIGTERM, reports it and exits within its 10 s grace; it is queued again, and the training
reaches 68 GiB with every allocation granted, which it could not have while bob's 30 GiB stayed
(68 + 55 + 30 > 140.4).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool.core import checkpointing, names
from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB
from carpool_testbed import realnode, stack, tenants
from carpool_testbed.tenants import tenant, user_roles

GIB = 1024
TOTAL_MIB = GPU_MODEL_MEMORY_MIB[realnode.FAKE_GPU_MODEL]
GRACE_S = 10
OWNER_GRANT_GIB, OWNER_IDLE_GIB, OWNER_STEP_GIB, OWNER_TOP_GIB = 70, 6, 30, 68
OWNER_GROWTH_MIB_PER_S = GIB // 2
SERVICE_GRANT_GIB, SERVICE_USE_GIB = 60, 55
BORROWER_GRANT_GIB, BORROWER_USE_GIB = 40, 30
OWNER_MARK, SERVICE_MARK = "carpool-lending-owner", "carpool-lending-service"
BORROWER_MARK = "carpool-lending-borrower"


def sleeper(mark: str) -> str:
    """Sleeps until told to stop (exit 0 on SIGTERM); `mark` tells its shell among the pod's
    processes."""
    return f": {mark}; trap 'exit 0' TERM; sleep 3600 & wait"


# On SIGTERM: writes checkpoint.json (written aside, renamed over) into the report directory
# the plugin mounted, waits for the plugin's acknowledgement (up to 5 s), exits 0.
BORROWER_SCRIPT = (
    f": {BORROWER_MARK}; "
    "save() { r=$CARPOOL_REPORT_DIR; "
    "printf '{\"time\": \"%s\", \"path\": \"/checkpoint/sweep-%s\"}' "
    "\"$(date -u +%Y-%m-%dT%H:%M:%SZ)\" \"$CARPOOL_ATTEMPT\" > $r/checkpoint.json.new; "
    "mv $r/checkpoint.json.new $r/checkpoint.json; echo SAVED; "
    "for i in 1 2 3 4 5 6 7 8 9 10; do [ -f $r/checkpoint.ack ] && break; sleep 0.5; done; "
    "echo ACK=$(cat $r/checkpoint.ack 2>/dev/null); exit 0; }; "
    "trap save TERM; sleep 3600 & wait")


class Gpu(threading.Thread):
    """The test's stand-in for the driver: each second, every live process of the owner's and
    the borrower's pods holds what its workload wants where the GPU has it, and the plugin's
    usage file says so."""

    def __init__(self, node: realnode.RealNode) -> None:
        super().__init__(daemon=True)
        self.node = node
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pods: dict[str, tuple[str, str, tuple[str, ...]]] = {}  # role -> uid, mark, GPUs
        self.want: dict[str, int] = {}  # role -> MiB per GPU it wants
        self.held: dict[tuple[str, str], int] = {}  # (role, GPU) -> MiB held
        self.refused: list[str] = []
        self.most: dict[str, int] = {}  # GPU -> most memory held at once
        self.seen: set[str] = set()  # roles whose processes were found
        self.gone_at: dict[str, float] = {}  # role -> when its processes were first gone
        self.errors: list[BaseException] = []

    def add(self, role: str, pod_uid: str, mark: str, gpus: list[str], want_mib: int) -> None:
        with self.lock:
            self.pods[role] = (pod_uid, mark, tuple(gpus))
            self.want[role] = want_mib

    def set_want(self, role: str, mib: int) -> None:
        with self.lock:
            self.want[role] = mib

    def holding(self, role: str) -> int:
        with self.lock:
            return min((m for (r, _), m in self.held.items() if r == role), default=0)

    def tick(self) -> None:
        with self.lock:
            processes = []
            live: dict[str, list[int]] = {}
            for role, (uid, mark, _) in self.pods.items():
                live[role] = realnode.pod_pids(uid, mark)
                if live[role]:
                    self.seen.add(role)
                elif role in self.seen:
                    self.gone_at.setdefault(role, time.time())
                    for key in [k for k in self.held if k[0] == role]:
                        del self.held[key]  # its memory is freed with its processes
            for role, (_, _, gpus) in self.pods.items():
                if not live[role]:
                    continue
                for gpu in gpus:
                    have = self.held.get((role, gpu), 0)
                    want = self.want[role]
                    others = sum(m for (r, g), m in self.held.items() if g == gpu and r != role)
                    if want > have and others + want > TOTAL_MIB:
                        self.refused.append(f"{role} on {gpu}: {want} MiB asked, "
                                            f"{TOTAL_MIB - others} MiB left")
                    else:
                        self.held[(role, gpu)] = want
                    processes.append((live[role][0], gpu, self.held.get((role, gpu), 0)))
            for gpu in {g for _, g in self.held}:
                used = sum(m for (_, g), m in self.held.items() if g == gpu)
                self.most[gpu] = max(self.most.get(gpu, 0), used)
        self.node.set_gpu_usage(processes)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.tick()
            except Exception as error:  # surfaced by the test
                self.errors.append(error)
                return
            self.stop.wait(1.0)


@pytest.fixture
def lending_operator(session_stack: Any) -> Iterator[int]:
    """The session's operator and extender with lending on; the operator's metrics port."""
    port = stack.free_port()
    env = {"CARPOOL_LENDING": "true", "CARPOOL_LENDING_OBSERVED_S": "5",
           "CARPOOL_LENDING_RECLAIM_WITHIN_S": "30", "CARPOOL_METRICS_PORT": str(port)}
    with session_stack.with_settings(env, ("--lending",)):
        yield port


@pytest.fixture
def gpu(real_node: realnode.RealNode) -> Iterator[Gpu]:
    driver = Gpu(real_node)
    driver.start()
    try:
        yield driver
    finally:
        driver.stop.set()
        driver.join(timeout=10)
        real_node.set_gpu_usage([])


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def gpu_job(pods: Any, project: str, cls: str, memory_gib: int, count: int,
            preemptible: bool, script: str) -> dict[str, Any]:
    node_spec = pods.manifest("unused", 1)["spec"]
    return {
        "project": project, "class": cls, "preemptible": preemptible,
        "gpu": {"count": count, "memory": f"{memory_gib}Gi", "isolation": "mps"},
        "checkpoint": {"gracePeriod": f"{GRACE_S}s"},
        "estimatedDuration": "1h",
        "template": {"spec": {
            **{k: v for k, v in node_spec.items()
               if k in ("nodeSelector", "tolerations", "dnsPolicy")},
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": realnode.TEST_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", script]}]}},
    }


def test_a_borrower_in_an_idle_grant_is_reclaimed_and_the_owner_never_refused(
        real_node: realnode.RealNode, pods: Any, lending_operator: int, gpu: Gpu,
        carpool_stack: Path, tmp_path: Path) -> None:
    with tenants.World(real_node.cluster, tmp_path, "lendnode") as world:
        owners, sweeps = world.namespace("owners"), world.namespace("sweeps")
        world.apply_cluster_scoped(user_roles(world))
        owner_project = world.project("owners", [owners])
        sweep_project = world.project("sweeps", [sweeps])
        alice, bob = tenant(world, owners, "alice"), tenant(world, sweeps, "bob")
        for user, namespace in ((alice, owners), (bob, sweeps)):
            pods.wait_for("the GpuJob roles to aggregate into edit",
                          lambda user=user, namespace=namespace: tenants.can_create_gpujobs(
                              world, user, namespace))

        def diagnose(error: AssertionError) -> AssertionError:
            events = world.admin("get", "events", "-A", "--field-selector",
                                 "involvedObject.kind=GpuJob")
            return AssertionError(
                f"{error}\nalice's job: {alice.status(owners, 'train')}\nbob's job: "
                f"{bob.status(sweeps, 'sweep') if bob_created else None}\n{events[-3000:]}\n"
                f"GPU: held {gpu.held} refused {gpu.refused[:3]}\noperator log:\n"
                f"{stack.log_tail(carpool_stack / 'operator.log', 25)}\ndevice plugin log:\n"
                f"{stack.log_tail(real_node.paths.log('deviceplugin'), 15)}")

        bob_created = False

        def run_owner(name: str, grant_gib: int, mark: str, role: str, use_gib: int
                      ) -> list[str]:
            """alice's job `name` on both GPUs, running and holding `use_gib` on each."""
            alice.kubectl("create", "-n", owners, "-f", "-", stdin=yaml.safe_dump({
                "apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": name},
                "spec": gpu_job(pods, owner_project, "long", grant_gib, 2, False,
                                sleeper(mark))}))
            status = pods.wait_for(f"alice's {name} running", lambda: (
                s if (s := alice.status(owners, name)).get("phase") == "Running" else None),
                timeout=120)
            pod = json.loads(alice.kubectl("get", "pod", "-n", owners, status["podName"],
                                           "-o", "json"))
            uuids = [g["uuid"] for g in status["gpus"]]
            gpu.add(role, pod["metadata"]["uid"], mark, uuids, use_gib * GIB)
            pods.wait_for(f"alice's {name} holding {use_gib} GiB",
                          lambda: gpu.holding(role) == use_gib * GIB, timeout=60)
            return uuids

        try:
            run_owner("serve", SERVICE_GRANT_GIB, SERVICE_MARK, "service", SERVICE_USE_GIB)
            owner_gpus = run_owner("train", OWNER_GRANT_GIB, OWNER_MARK, "owner",
                                   OWNER_IDLE_GIB)

            # bob's sweep: more than the GPUs have free, so only alice's lent memory fits it
            bob.kubectl("create", "-n", sweeps, "-f", "-", stdin=yaml.safe_dump({
                "apiVersion": names.API_VERSION, "kind": "GpuJob", "metadata": {"name": "sweep"},
                "spec": gpu_job(pods, sweep_project, "batch", BORROWER_GRANT_GIB, 1, True,
                                BORROWER_SCRIPT)}))
            bob_created = True
            sweep = pods.wait_for("bob's sweep running in alice's lent memory", lambda: (
                s if (s := bob.status(sweeps, "sweep")).get("phase") == "Running" else None),
                timeout=120)
            assert sweep["gpus"][0]["borrowed"] is True, sweep
            assert sweep["gpus"][0]["uuid"] in owner_gpus, (sweep, owner_gpus)
            sweep_pod = json.loads(bob.kubectl("get", "pod", "-n", sweeps, sweep["podName"],
                                               "-o", "json"))
            gpu.add("borrower", sweep_pod["metadata"]["uid"], BORROWER_MARK,
                    [sweep["gpus"][0]["uuid"]], BORROWER_USE_GIB * GIB)
            pods.wait_for("bob's sweep holding its memory",
                          lambda: gpu.holding("borrower") == BORROWER_USE_GIB * GIB, timeout=60)

            # alice's job grows within what its lent part leaves bob: he stays
            gpu.set_want("owner", OWNER_STEP_GIB * GIB)
            pods.wait_for("alice's job's new peak seen by the operator", lambda: int(
                alice.status(owners, "train").get("peakMemoryMiB") or 0) >= OWNER_STEP_GIB * GIB,
                timeout=60)
            time.sleep(6)  # a few operator passes (resync 2 s)
            assert bob.status(sweeps, "sweep")["phase"] == "Running"

            # then on, 0.5 GiB/s, towards nearly all of its grant
            want = OWNER_STEP_GIB * GIB
            ramp_started = time.time()
            while want < OWNER_TOP_GIB * GIB:
                time.sleep(1)
                want = min(OWNER_TOP_GIB * GIB, want + OWNER_GROWTH_MIB_PER_S)
                gpu.set_want("owner", want)
            pods.wait_for("alice's job holding nearly all its grant",
                          lambda: gpu.holding("owner") == OWNER_TOP_GIB * GIB or gpu.refused,
                          timeout=60)

            def requeued() -> dict[str, Any] | None:
                status = bob.status(sweeps, "sweep")
                return status if status.get("phase") == "Queued" and any(
                    r.get("outcome") == "Preempted" for r in status.get("history") or []) \
                    else None

            after = pods.wait_for("bob's sweep off the GPU and queued again", requeued,
                                  timeout=60)
        except AssertionError as error:
            raise diagnose(error) from None
        assert not gpu.errors, gpu.errors

        # the owner was never refused memory, and got what bob's staying would have denied it
        assert gpu.refused == [], gpu.refused
        assert gpu.holding("owner") == OWNER_TOP_GIB * GIB
        assert OWNER_TOP_GIB + SERVICE_USE_GIB + BORROWER_USE_GIB > TOTAL_MIB / GIB
        assert max(gpu.most.values()) <= TOTAL_MIB, gpu.most
        owner_now = alice.status(owners, "train")
        assert owner_now["phase"] == "Running" and owner_now["attempts"] == 1, owner_now
        assert not [r for r in owner_now.get("history") or [] if r.get("outcome")], owner_now
        owner_events = json.loads(alice.kubectl("get", "events", "-n", owners, "-o", "json"))
        assert not [e for e in owner_events["items"]
                    if e.get("reason") in ("GpuMemoryOverGrant", "GpuMemoryKilled",
                                           "Preempted")], owner_events

        # bob was told, naming the owner; he saved, reported and left within his grace
        events = json.loads(bob.kubectl("get", "events", "-n", sweeps, "-o", "json"))["items"]
        told = [e for e in events if e.get("reason") == "Preempted"]
        assert told and f"lent by {owners}/train" in told[0]["message"], told
        told_at = min(checkpointing.parse_time(e.get("eventTime") or e["firstTimestamp"])
                      for e in told)
        stopped_at = gpu.gone_at["borrower"]
        assert stopped_at - told_at <= GRACE_S + 1.5, (told_at, stopped_at)  # ticks of 1 s
        assert after["attempts"] == 1, after  # nothing is lent now: he waits
        checkpoint = after["lastCheckpoint"]
        assert checkpoint["path"] == "/checkpoint/sweep-1" and checkpoint["attempt"] == 1
        assert told_at - 1 <= checkpointing.parse_time(after["lastCheckpointTime"]) \
            <= told_at + GRACE_S + 1
        reclaim_count = metric(lending_operator, "carpool_owner_reclaim_seconds_count")
        reclaim_sum = metric(lending_operator, "carpool_owner_reclaim_seconds_sum")
        assert reclaim_count == 1 and reclaim_sum <= 30, (reclaim_count, reclaim_sum)
        pods.timings.stages.append(
            ("lending: owner's ramp start → borrower's processes gone",
             stopped_at - ramp_started))
        pods.timings.stages.append(("lending: Preempted event → borrower's processes gone",
                                    stopped_at - told_at))
        pods.timings.stages.append(("lending: operator's owner reclaim time", reclaim_sum))
