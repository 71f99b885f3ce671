"""An empty broker rebuilt by the fleet, and nothing deleted brought back (imexd.agent.rebuild).

Real agent processes (tests/cluster.py), a real Mosquitto without persistence restarted on
the same address, the control plane through the real CLI. Two domains with a workload
each, plus a domain and a workload deleted before the broker dies. The issue's 18 agents
are the benchmark's (`bench/formation.py --phase rebuild`): eighteen agent processes and
their probes do not fit the two cores that the test suite shares. Every wait is bounded.
"""

from __future__ import annotations

import subprocess

import pytest

from imexd.topics import Topics
from tests.cluster import Cluster, Node, pids, untouched
from tests.support import IMEXD, during

pytestmark = pytest.mark.slow

T = Topics("imex/v2")
WAIT_S = 60.0


def imexd(c: Cluster, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """`imexd ARGS` as the control plane: no settings file, the fleet's settings in env."""
    return subprocess.run(
        [IMEXD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=c.control_env(),
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def metric(node: Node, name: str) -> float:
    """The sum of a counter's samples on the node's /metrics (0 when absent)."""
    _, text = node.get("/metrics")
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_an_empty_broker_gets_every_spec_and_workload_back(c: Cluster) -> None:
    """The broker restarts empty on its address: the agents give back the specs, workloads
    and assignments they follow, byte for byte, `domain status --wait` and `workload status
    --wait` succeed with nobody running `create`, no daemon restarts, and the domain and
    workload deleted before the loss stay deleted."""
    names = [f"n{i}" for i in range(1, 6)]
    nodes = [c.add(name, domain=None) for name in names]
    c.wait(c.all_ready, timeout=WAIT_S)
    ok(imexd(c, "domain", "create", "d1", "--nodes", "n1,n2"))
    ok(imexd(c, "domain", "create", "d2", "--nodes", "n3,n4"))
    ok(imexd(c, "domain", "create", "d3", "--nodes", "n5"))
    for domain in ("d1", "d2", "d3"):
        ok(imexd(c, "domain", "status", domain, "--wait", str(WAIT_S)))
    ok(imexd(c, "workload", "create", "job-a", "--domain", "d1", "--wait", "30"))
    ok(imexd(c, "workload", "create", "job-b", "--domain", "d2", "--wait", "30"))
    ok(imexd(c, "workload", "create", "gone", "--domain", "d1", "--wait", "30"))
    ok(imexd(c, "workload", "delete", "gone", "--wait", "30"))
    ok(imexd(c, "domain", "delete", "d3", "--timeout", "30"))
    kept = [T.spec("d1"), T.spec("d2"), T.workload("d1", "job-a"), T.workload("d2", "job-b")]
    kept += [T.assignment(n) for n in names[:4]]
    deleted = [T.spec("d3"), T.workload("d1", "gone"), T.assignment("n5")]
    with c.client() as client:
        before = {topic: client.retained(topic).get(topic) for topic in kept + deleted}
    assert all(before[topic] for topic in kept), before
    assert not any(before[topic] for topic in deleted), before
    running = nodes[:4]
    pids_before = pids(running)

    c.broker.stop()
    c.broker.start()

    for domain in ("d1", "d2"):
        ok(imexd(c, "domain", "status", domain, "--wait", str(WAIT_S)))
    for workload in ("job-a", "job-b"):
        ok(imexd(c, "workload", "status", workload, "--wait", str(WAIT_S)))
    with c.client() as client:
        c.wait(lambda: client.retained(T.epoch()) != {}, timeout=WAIT_S)
        after = {topic: client.retained(topic).get(topic) for topic in kept + deleted}
    assert {t: after[t] for t in kept} == {t: before[t] for t in kept}, "byte for byte"

    def resurrected() -> str | None:
        with c.client() as client:
            back = [t for t in deleted if client.retained(t)]
            back += sorted(client.retained("imex/v2/domains/d3/#"))
        return f"deleted records came back: {back}" if back else None

    assert during(3.0, resurrected) == []
    assert untouched(running, pids_before) == []
    assert nodes[4].daemon_pid() is None
    assert sum(metric(n, "imexd_broker_rebuilds_total") for n in running) >= 1


def test_an_agent_away_during_a_delete_brings_nothing_back(c: Cluster) -> None:
    """n2's link is cut while `domain delete` runs on a healthy broker: when it comes back
    the broker's epoch is the one it saw, so it takes the deletion in (leaves, its daemon
    stops) and restores neither the spec, the workload, its assignment nor its record."""
    n1 = c.add("n1", domain=None)
    n2 = c.add("n2", domain=None, via_proxy=True)
    c.wait(c.all_ready, timeout=WAIT_S)
    ok(imexd(c, "domain", "create", "d1", "--nodes", "n1,n2"))
    ok(imexd(c, "workload", "create", "job-a", "--domain", "d1", "--wait", "30"))
    ok(imexd(c, "domain", "status", "d1", "--wait", str(WAIT_S)))
    assert n2.proxy is not None
    n2.proxy.drop()
    c.wait(lambda: n2.condition("BusConnected").get("status") == "False", timeout=20)
    # n2's will marks it lost; the delete does not wait for a lost record and clears it.
    ok(imexd(c, "domain", "delete", "d1", "--timeout", "40"))
    assert n1.daemon_pid() is None
    n2.proxy.heal()
    c.wait(lambda: n2.condition("BusConnected").get("status") == "True", timeout=30)
    c.wait(lambda: n2.daemon_pid() is None, timeout=30)
    assert n2.log_events("rebuild.deleted_while_away") != []
    assert n2.log_events("rebuild.restored") == []

    def resurrected() -> str | None:
        with c.client() as client:
            back = sorted(client.retained("imex/v2/domains/d1/#"))
            back += sorted(client.retained(T.assignment("n2")))
        return f"deleted records came back: {back}" if back else None

    assert during(3.0, resurrected) == []
    status = imexd(c, "domain", "status", "d1", "--wait", "0")
    assert status.returncode == 1
    assert "nothing on the bus" in status.stderr
