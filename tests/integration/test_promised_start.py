"""A promised start kept through the real operator, API server and simulated node.

A job's first estimated start (`status.firstEstimatedStart`) is a promise: once it has
passed and the job still waits, the job is *due* and ranks ahead of all but interactive work
(`carpool.core.fairshare`). Here job R holds the node's only GPU and runs well past the time
it was expected to take (its pod, on a KWOK node, ends after `spec.simulatedDuration`; the
operator expects `spec.estimatedDuration`, the projects being new and their run times not
learned yet). Batch job B queues behind R and is promised R's expected end. Before that
passes, short job C of another project asks for the same GPU and goes ahead of B by class
(and is promised the same start, R's expected end). Once B's promise has passed, B's wait
says so (status and `kubectl carpool why`), C goes behind B (both due, the promise given first
is kept, although B's project uses the GPU now and C's does not) and, when R ends, B starts
before C.

Everything a user does is done as a tenant: ServiceAccounts bound to their namespace's `edit`
role (`carpool_testbed.tenants`). With the operator's CARPOOL_KEEP_PROMISES=false in the
environment the test fails: B's wait never says it is due, and C starts first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from carpool.core.queueing import DUE_NOTE as DUE
from carpool.core.timestamps import epoch_seconds
from carpool_testbed import tenants
from carpool_testbed.tenants import Obj, Tenant, tenant, user_roles
from carpool_testbed.waiting import wait_for

pytestmark = pytest.mark.cluster
WORLD_PREFIX = "due"  # the tenants' names (the `world` fixture)
R_EXPECTED_S = 10  # what R is expected to take: B's promise is about this long after R starts
R_RUNS_S = 35  # how long R runs: B's promise passes while R still holds the GPU
SETTLE_S = 8  # the operator's passes (every 2 s here) and status writes after a change


def _epoch(text: object) -> float:
    epoch = epoch_seconds(text if isinstance(text, str) else None)
    assert epoch is not None, f"expected a timestamp, got {text!r}"
    return epoch


def _status_when(who: Tenant, namespace: str, name: str, what: str, timeout: float,
                 accept: Callable[[Obj], bool]) -> Obj:
    """The job's status, as its tenant reads it, once `accept(status)` holds (waited for, at
    most `timeout` s)."""

    seen: list[Obj] = [{}]

    def probe() -> Obj | None:
        seen[0] = who.status(namespace, name)
        return seen[0] if accept(seen[0]) else None

    try:
        found: Obj = wait_for(what, probe, timeout=timeout, interval=0.3)
    except AssertionError as err:
        raise AssertionError(f"{err}; {namespace}/{name}'s status: {seen[0]}") from None
    return found


def test_a_job_past_its_promised_start_goes_before_a_later_short_job(
        world: tenants.World) -> None:
    model = world.name("m")
    node = world.node("n", model)
    team, rush = world.namespace("team"), world.namespace("rush")
    world.apply_cluster_scoped(user_roles(world))
    project, other = world.project("team", [team]), world.project("rush", [rush])
    alice, bob = tenant(world, team, "alice"), tenant(world, rush, "bob")
    wait_for("the GpuJob roles to aggregate into edit", lambda: (
        tenants.can_create_gpujobs(world, alice, team)
        and tenants.can_create_gpujobs(world, bob, rush)))

    # R holds the node's only GPU, expected for R_EXPECTED_S, running R_RUNS_S
    alice.submit(team, "r", project, "batch", model, node, f"{R_EXPECTED_S}s", f"{R_RUNS_S}s")
    running = _status_when(alice, team, "r", "R running", 30,
                           lambda s: s.get("phase") == "Running")
    r_ends = _epoch(running["startTime"]) + R_RUNS_S

    # B waits for R and is promised R's expected end
    alice.submit(team, "b", project, "batch", model, node, "5s", "5s")
    waiting = _status_when(alice, team, "b", "B's first estimated start", SETTLE_S,
                           lambda s: bool(s.get("firstEstimatedStart")))
    promise = _epoch(waiting["firstEstimatedStart"])
    assert promise + 1.5 * SETTLE_S <= r_ends, (
        f"B's promise must pass well before R ends at {r_ends:.0f}: {waiting}")
    assert DUE not in waiting["message"]

    # before the promise passes, another project's short job goes ahead of B: submitted a
    # second later at least (submit times are kept to the second; equal ones go by name)
    time.sleep(max(0.0, _epoch(waiting["submitTime"]) + 1.1 - time.time()))
    bob.submit(rush, "c", other, "short", model, node, "5s", "5s")
    ahead = _status_when(bob, rush, "c", "C queued", SETTLE_S,
                         lambda s: s.get("queuePosition") is not None)
    assert time.time() < promise, "C must be seen queued before B's promise passes"
    assert (ahead["phase"], ahead["queuePosition"]) == ("Queued", 1), ahead
    assert _epoch(ahead["submitTime"]) > _epoch(waiting["submitTime"]), (waiting, ahead)
    assert DUE not in alice.status(team, "b")["message"]

    # the promise passes while R runs: B's wait says it is due, and C goes behind B
    due = _status_when(alice, team, "b", "B's wait saying it is due",
                       promise - time.time() + SETTLE_S, lambda s: DUE in s.get("message", ""))
    assert time.time() > promise and due["phase"] == "Queued", due
    why = alice.carpool("why", "b", "-n", team)
    assert DUE in why, why
    promises = f"B promised {waiting['firstEstimatedStart']}, C {ahead['firstEstimatedStart']}"
    behind = _status_when(bob, rush, "c", f"C behind B ({promises})", SETTLE_S,
                          lambda s: s.get("queuePosition") == 2)
    assert behind["phase"] == "Queued", behind
    assert alice.status(team, "r")["phase"] == "Running", "R must still hold the GPU"

    # R ends: B starts first, then C
    timeout = r_ends - time.time() + 5 + 2 * SETTLE_S
    b_ran = _status_when(alice, team, "b", "B started", timeout,
                         lambda s: bool(s.get("startTime")))
    c_ran = _status_when(bob, rush, "c", "C started", timeout,
                         lambda s: bool(s.get("startTime")))
    assert _epoch(b_ran["startTime"]) < _epoch(c_ran["startTime"]), (
        f"B must start before C: B {b_ran['startTime']}, C {c_ran['startTime']}")
