"""The control plane against real agents: issue 5's "Done when", scenario by scenario.

Three agents in assigned mode (tests/cluster.py: real `imexd run` processes, simulated
IMEX daemons, a real Mosquitto) are driven only through `imexd domain ...` subprocesses,
as an operator would. The control plane gets the fleet's settings through the
environment: the broker URL, `[domain] max_nodes` (written into the spec; it must equal
the agents') and `[health] report_interval_s` (how old a report may be). Every wait is an
upper bound; each test takes well under 40 s on an idle machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped] # no stubs
from prometheus_client.parser import text_string_to_metric_families

from imexd.demo.timings import FAST
from tests.cluster import BusClient, Cluster, Node
from tests.support import wait_for

pytestmark = pytest.mark.slow

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"
NAMES = ["n1", "n2", "n3"]


def validator(kind: str) -> Any:
    return Draft202012Validator(json.loads((SCHEMAS / f"{kind}.json").read_text()))


def form_d1(c: Cluster) -> list[Node]:
    """Start n1..n3 idle in assigned mode, create d1 listing them, wait until it is UP."""
    nodes = [c.add(name, domain=None) for name in NAMES]
    c.wait(c.all_ready, timeout=30)  # idle nodes are ready too (no domain)
    created = c.imexd("domain", "create", "d1", "--nodes", ",".join(NAMES))
    assert created.returncode == 0, created.stderr
    assert re.search(
        r"domain d1: created \(generation \d+, max_nodes 8, nodes n1,n2,n3\)", created.stdout
    ), created.stdout
    c.wait(lambda: all(n.status().get("domain") == "d1" for n in nodes) and c.all_ready())
    assert [n.slot() for n in nodes] == [0, 1, 2], "the spec's list order is the slot order"
    up = c.imexd("domain", "status", "d1", "--wait", "30")
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.startswith("domain d1: UP, 3 of 3 members ready"), up.stdout
    return nodes


def crash_until_fatal(node: Node, timeout: float = 30.0) -> int:
    """SIGKILL the node's daemon each time it comes back until its supervisor is FATAL.

    Only pids that run this node's config (`daemon_pids_on_host`) are ever signalled.
    Returns how many daemons were killed.
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon = node.status().get("daemon", {})
        if daemon.get("state") == "FATAL":
            return len(killed)
        pid = daemon.get("pid")
        if isinstance(pid, int) and pid not in killed and pid in node.daemon_pids_on_host():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.05)
    raise AssertionError(f"{node.name} never went FATAL; killed {sorted(killed)}")


def tombstone(payload: bytes) -> bool:
    """A control-plane deletion (imexd.order): a spec or workload `deleted`, an assignment
    to no domain, a retry request `done`."""
    doc = json.loads(payload)
    return doc.get("state") in ("deleted", "done") or ("domain" in doc and doc["domain"] is None)


def retained(c: Cluster, topic_filter: str = "imex/v2/#") -> dict[str, bytes]:
    with c.client() as bus:
        return bus.retained(topic_filter)


def stopped(n: Node) -> bool:
    """Whether the node's supervisor says its daemon is STOPPED."""
    return bool(n.status()["daemon"]["state"] == "STOPPED")


def test_create_crash_loop_and_delete_through_the_cli(c: Cluster) -> None:
    """create => UP; one daemon crash loops => DaemonCrashLoop, DEGRADED; delete => idle."""
    nodes = form_d1(c)
    n2 = nodes[1]

    # One daemon killed each time it comes back: the supervisor gives up (FATAL).
    assert crash_until_fatal(n2) >= 3
    health = "imex/v2/domains/d1/health/n2"

    def crash_reported() -> bool:
        payload = retained(c, health).get(health)
        if payload is None:
            return False
        conds = {x["type"]: x for x in json.loads(payload)["conditions"]}
        return bool(conds["DaemonReady"]["reason"] == "DaemonCrashLoop")

    c.wait(crash_reported, timeout=15)
    report = json.loads(retained(c, health)[health])
    validator("HealthReport").validate(report)
    ready_cond = next(x for x in report["conditions"] if x["type"] == "DaemonReady")
    assert ready_cond["status"] == "False"
    assert "SIGKILL" in ready_cond["message"], ready_cond
    assert report["daemon"]["state"] == "FATAL"

    degraded = c.imexd("domain", "status", "d1", "--wait", "0")
    assert degraded.returncode == 1
    assert degraded.stdout.startswith("domain d1: DEGRADED, 2 of 3 members ready"), degraded.stdout
    row = next(line for line in degraded.stdout.splitlines() if line.split()[1:2] == ["n2"])
    cells = row.split()
    assert (cells[3], cells[5]) == ("FATAL", "no"), row
    assert "DaemonCrashLoop" in row
    assert "n2: DaemonReady=False DaemonCrashLoop: " in degraded.stdout

    # Issue 25: the cause is fixed; `node retry` starts the daemon now, not after the
    # cool-down. A request older than the agent (kept by the broker) is never acted on.
    stale = {"v": 1, "node": "n2", "domain": "d1", "at": 1.0, "by": "an old request"}
    with c.client() as bus:
        bus.publish("imex/v2/domains/d1/retry/n2", json.dumps(stale).encode(), retain=True)
    time.sleep(1.0)
    assert n2.status()["daemon"]["state"] == "FATAL"
    retried = c.imexd("node", "retry", "n2", "--wait", "30")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert "node n2: daemon RUNNING in d1" in retried.stdout, retried.stdout
    done = retained(c, "imex/v2/domains/d1/retry/+")
    assert [json.loads(p)["state"] for p in done.values()] == ["done"], "it ends with the command"
    up = c.imexd("domain", "status", "d1", "--wait", "30")
    assert up.returncode == 0, up.stdout + up.stderr
    again = c.imexd("node", "retry", "n2")
    assert (again.returncode, again.stdout.splitlines()[-1]) == (
        0,
        "node n2: its daemon in d1 is RUNNING: nothing to retry",
    ), again.stdout + again.stderr
    unknown = c.imexd("node", "retry", "n9")
    assert unknown.returncode == 2, unknown.stdout + unknown.stderr
    assert "node n9: no agent reported it (no presence record)" in unknown.stderr

    # Delete: every agent stops its daemon, removes its files and clears its records.
    deleted = c.imexd("domain", "delete", "d1", "--timeout", "30")
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    assert re.search(r"domain d1: deleted \(spec generation \d+, 3 assignment\(s\)", deleted.stdout)
    c.wait(lambda: all(n.daemon_pids_on_host() == [] for n in nodes), timeout=20)
    # The daemon's exit is seen on the host before the supervisor has reaped it (STOPPING).
    c.wait(
        lambda: all(n.ready() and n.status().get("domain") is None and stopped(n) for n in nodes)
    )
    for n in nodes:
        assert not (n.run_dir / "config.cfg").exists(), n.name
        assert not (n.run_dir / "nodes_config.cfg").exists(), n.name
        assert n.hosts_slots() == {}, n.name
        status = n.status()
        validator("HealthReport").validate(status)
        assert (status["domain"], status["slot"], status["daemon"]["state"]) == (
            None,
            None,
            "STOPPED",
        )
    # Presence records stay: the agents are alive, idle, and can be assigned again; and the
    # tombstones of the spec, the assignments and the retry request (imexd.order).
    left = {t for t, p in retained(c).items() if not t.endswith("/presence") and not tombstone(p)}
    assert left == set(), "spec, assignments, records and reports are all gone"
    assert sorted(retained(c, "imex/v2/nodes/+/presence")) == [
        f"imex/v2/nodes/{n.name}/presence" for n in nodes
    ]
    listed = c.imexd("domain", "list")
    assert (listed.returncode, listed.stdout.split()[0]) == (0, "no"), listed.stdout


def test_a_broker_outage_keeps_agents_live_and_daemons_running(c: Cluster) -> None:
    """Payloads, /status and /metrics are valid; a broker outage that loses every record
    restarts no daemon, and the agents give the spec back."""
    nodes = form_d1(c)

    # Everything the agents publish and serve validates against the shipped schemas.
    c.wait(lambda: len(retained(c, "imex/v2/domains/d1/health/+")) == 3, timeout=10)
    kinds = {"members": "MemberRecord", "health": "HealthReport", "spec": "DomainSpec"}
    got = {t: v for t, v in retained(c).items() if not t.endswith("/presence")}
    assert len(got) == 1 + 3 + 3 + 3, "\n".join(sorted(got))  # spec, assignments, records, reports
    for topic, payload in got.items():
        parts = topic.split("/")
        kind = (
            "Assignment" if parts[-1] == "assignment" else kinds[parts[4 if len(parts) > 4 else 3]]
        )
        validator(kind).validate(json.loads(payload))
    for n in nodes:
        validator("HealthReport").validate(n.status())
        code, text = n.get("/metrics")
        assert code == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert {"imexd_daemon_restarts", "imexd_bus_connected"} <= set(families), sorted(families)

    pids = {n.name: n.daemon_pid() for n in nodes}
    assert all(pids.values())

    c.broker.stop()
    not_live: list[str] = []

    def bus_down_everywhere() -> bool:
        for n in nodes:
            code, body = n.get("/healthz")
            if code != 200:
                not_live.append(f"{n.name}: {code} {body}")
        answers = [n.get("/readyz") for n in nodes]
        return all(
            code == 503
            and any(f["type"] == "BusConnected" and f["status"] == "False" for f in body["failing"])
            for code, body in answers
        )

    c.wait(bus_down_everywhere, timeout=20)
    assert not_live == [], "/healthz must not depend on the broker"
    assert [n.get("/healthz")[0] for n in nodes] == [200, 200, 200]

    c.broker.start()
    c.wait(c.all_ready, timeout=30)
    for n in nodes:
        assert n.get("/healthz")[0] == 200, n.get("/healthz")
        status = n.status()
        assert status["daemon"]["pid"] == pids[n.name], n.name
        assert status["daemon"]["restarts"] == 0, n.name
        assert n.daemon_pids_on_host() == [pids[n.name]], n.name
    # The broker lost its retained state (no persistence): the agents published theirs again.
    c.wait(lambda: len(retained(c, "imex/v2/domains/d1/members/+/+")) == 3, timeout=10)
    # The spec was lost with the rest, and the agents gave it back (imexd.agent.rebuild): the
    # status is UP again with nobody running `domain create`.
    up = c.imexd("domain", "status", "d1", "--wait", "30")
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.startswith("domain d1: UP, 3 of 3 members ready"), up.stdout
    assert re.search(r"spec generation \d+, active", up.stdout), up.stdout


def test_status_after_a_broker_lost_its_retained_state_is_not_up(c: Cluster) -> None:
    """Broker restarted without persistence, one agent back: it gives the spec back
    (imexd.agent.rebuild), and the status is FORMING with the two others missing, exit 1."""
    nodes = form_d1(c)
    frozen = nodes[1:]
    for n in frozen:
        assert n.proc is not None
        os.kill(n.proc.pid, signal.SIGSTOP)
    try:
        c.broker.stop()
        c.broker.start()
        members = "imex/v2/domains/d1/members/+/+"
        c.wait(lambda: list(retained(c, members)) == ["imex/v2/domains/d1/members/c1/n1"])
        c.wait(lambda: "imex/v2/domains/d1/health/n1" in retained(c, "imex/v2/domains/d1/#"))
        c.wait(lambda: "imex/v2/domains/d1/spec" in retained(c, "imex/v2/domains/d1/#"))
        partial = c.imexd("domain", "status", "d1", "--wait", "0")
        assert partial.returncode == 1, partial.stdout + partial.stderr
        assert partial.stdout.startswith("domain d1: FORMING, 1 of 3 members ready"), partial.stdout
        assert "n2: NoReport" in partial.stdout
    finally:
        for n in frozen:
            assert n.proc is not None
            os.kill(n.proc.pid, signal.SIGCONT)
    c.wait(lambda: len(retained(c, "imex/v2/domains/d1/members/+/+")) == 3, timeout=20)
    again = c.imexd("domain", "create", "d1", "--nodes", ",".join(NAMES))
    assert again.returncode == 0, again.stdout + again.stderr
    up = c.imexd("domain", "status", "d1", "--wait", "30")
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.startswith("domain d1: UP, 3 of 3 members ready"), up.stdout


def reports_after_leaving(seen: list[tuple[str, bytes]], names: list[str]) -> list[str]:
    """Health reports of `names` published after their member record was cleared."""
    late = []
    for name in names:
        cleared = max(
            i for i, (t, p) in enumerate(seen) if t.endswith(f"/members/c1/{name}") and not p
        )
        late += [
            f"{name} at message {i} (record cleared at {cleared})"
            for i, (t, p) in enumerate(seen)
            if i > cleared and t == f"imex/v2/domains/d1/health/{name}" and p
        ]
    return late


def trace(seen: list[tuple[str, bytes]]) -> str:
    return "\n".join(f"{i} {t} {'report' if p else 'cleared'}" for i, (t, p) in enumerate(seen))


def test_an_agent_publishes_no_report_after_it_left_a_deleted_domain(c: Cluster) -> None:
    """Once an agent cleared its record for a deleting spec, no report of it follows."""
    # Failed once (imexd/agent/run.py `_leave_deleted`): the report loop published a
    # HealthReport after the agent cleared its own, so the control plane found
    # "leftover" reports, and the agent's Bus kept the stale report as desired state,
    # publishing it again after a reconnect. Reports now stop before the clears.
    nodes = form_d1(c)
    assert len(nodes) == 3
    with BusClient(c.broker).record("imex/v2/domains/d1/#") as recorder:
        # Mark d1 as deleting without clearing anything afterwards: only the agents act.
        deleting = json.loads(retained(c, "imex/v2/domains/d1/spec")["imex/v2/domains/d1/spec"])
        deleting |= {"state": "deleting", "generation": deleting["generation"] + 1}
        with c.client() as bus:
            bus.publish("imex/v2/domains/d1/spec", json.dumps(deleting).encode(), retain=True)

        def left_and_quiet() -> bool:
            gone = {t.rsplit("/", 1)[1] for t, p in recorder.seen() if "/members/" in t and not p}
            return gone == set(NAMES)

        wait_for(left_and_quiet, timeout=20)
        time.sleep(2 * FAST["health"]["report_interval_s"])  # what a late report would need
        seen = recorder.seen()
    late = reports_after_leaving(seen, NAMES)
    assert late == [], "; ".join(late) + "\n" + trace(seen)
    assert retained(c, "imex/v2/domains/d1/health/+") == {}


def test_an_unassigned_agent_publishes_no_report_for_its_old_domain(c: Cluster) -> None:
    """`node unassign` makes the agent leave d1 for good: no report of it in d1 follows."""
    form_d1(c)
    with BusClient(c.broker).record("imex/v2/domains/d1/#") as recorder:
        done = c.imexd("node", "unassign", "n1")
        assert done.returncode == 0, done.stderr
        assert "node n1: unassigned (was d1)" in done.stdout

        def left() -> bool:
            return any(t.endswith("/members/c1/n1") and not p for t, p in recorder.seen())

        wait_for(left, timeout=20)
        time.sleep(2 * FAST["health"]["report_interval_s"])
        seen = recorder.seen()
    late = reports_after_leaving(seen, ["n1"])
    assert late == [], "; ".join(late) + "\n" + trace(seen)
    assert "imex/v2/domains/d1/health/n1" not in retained(c, "imex/v2/domains/d1/health/+")


def test_a_job_domain_is_joined_and_left_on_the_agents_first_link(c: Cluster) -> None:
    """Seen from outside: each of eight agents joining a per-job domain dropped its broker
    link and connected again (`bus_disconnected` reason "will changed"), three rounds of
    it per job start, because the will sat on the member topic. The will is the node's
    presence, set once per agent run: creating and deleting a domain of idle agents costs
    none of them a second connect."""
    nodes = form_d1(c)
    deleted = c.imexd("domain", "delete", "d1", "--wait", "30")
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    c.wait(lambda: all(n.status().get("domain") is None for n in nodes), what="all left d1")
    for n in nodes:
        connects = n.log_events("bus_connected")
        assert len(connects) == 1, (n.name, connects)
        assert connects[0]["will"] == f"imex/v2/nodes/{n.name}/presence", connects[0]
        assert n.log_events("bus_disconnected") == [], n.name


def test_a_prolog_fails_at_once_on_a_stopped_or_dead_node(c: Cluster) -> None:
    """Issue 25: `kill -TERM` one agent, then a job's prolog listing its node failed only
    after minutes (the default --seen-within counted the goodbye as a sighting). A stop
    is news now: `domain create --wait` exits 2 at once naming the node and AgentDown;
    a killed agent's will says the same once it fired; `domain status` says AgentDown
    for the stopped member, not NoReport. (`--steal`: the nodes are d1's.)"""
    nodes = form_d1(c)
    n2, n3 = nodes[1], nodes[2]
    assert n3.stop() == 0

    started = time.monotonic()
    refused = c.imexd("domain", "create", "d2", "--nodes", "n3", "--steal", "--wait", "60")
    took = time.monotonic() - started
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "node n3: AgentDown: its agent stopped" in refused.stderr, refused.stderr
    assert took < 30, f"refused after {took:.1f} s, not at once"
    status = c.imexd("domain", "status", "d1")
    assert "n3: AgentDown: its agent stopped" in status.stdout, status.stdout
    assert "NoReport" not in status.stdout, status.stdout
    retry = c.imexd("node", "retry", "n3")
    assert retry.returncode == 2, retry.stdout + retry.stderr
    assert "node n3: its agent stopped" in retry.stderr, retry.stderr

    n2.crash()  # agent and daemon; its will (its presence, marked lost) fires later

    def presence_lost(node: str) -> bool:
        topic = f"imex/v2/nodes/{node}/presence"
        payload = retained(c, topic).get(topic)
        return bool(payload) and json.loads(payload or b"{}").get("lost") is True

    wait_for(lambda: presence_lost("n2"), timeout=FAST["bus"]["will_delay_s"] + 15)
    dead = c.imexd("domain", "create", "d2", "--nodes", "n2", "--steal")
    assert dead.returncode == 2, dead.stdout + dead.stderr
    assert "node n2: AgentDown: its agent's link ended without a goodbye" in dead.stderr
    status = c.imexd("domain", "status", "d1", "--wait", "0")
    assert "n2: Lost" in status.stdout, status.stdout

    # An idle agent (the per-job layout between jobs): the same will, so a job's prolog
    # fails at once on it too.
    idle = c.add("n4", domain=None)
    c.wait(idle.ready, timeout=30)
    idle.crash()
    wait_for(lambda: presence_lost("n4"), timeout=FAST["bus"]["will_delay_s"] + 15)
    gone = c.imexd("domain", "create", "d3", "--nodes", "n4", "--wait", "60")
    assert gone.returncode == 2, gone.stdout + gone.stderr
    assert "node n4: AgentDown: its agent's link ended without a goodbye" in gone.stderr


def test_a_retry_request_from_the_far_future_does_not_block_a_genuine_one(c: Cluster) -> None:
    """A request of `imexd node retry` written with `at: 1e12` is one request like any
    other: a genuine retry after it still starts a FATAL daemon at once."""
    nodes = form_d1(c)
    n2 = nodes[1]
    forged = {"v": 1, "node": "n2", "domain": "d1", "at": 1e12, "by": "a forger"}
    with c.client() as bus:
        bus.publish("imex/v2/domains/d1/retry/n2", json.dumps(forged).encode(), retain=True)
        c.wait(lambda: n2.log_events("retry.asked"), timeout=10, what="n2 read the request")
        bus.publish("imex/v2/domains/d1/retry/n2", b"", retain=True)
    assert crash_until_fatal(n2) >= 3
    retried = c.imexd("node", "retry", "n2", "--wait", "30")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert "node n2: daemon RUNNING in d1" in retried.stdout, retried.stdout
