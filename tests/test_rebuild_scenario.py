"""The order of the control plane's records with real agents (imexd.agent.rebuild,
imexd.order): a replayed older spec, a node frozen through a domain's delete and a broker
restart, and a standby broker restored from an older snapshot change nothing and bring
nothing deleted back.

Real agent processes (tests/cluster.py), a real Mosquitto restarted on the same address
(without persistence, or from a copy of an earlier persistence file), the control plane
through the real CLI. Every wait is bounded.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from imexd.topics import Topics
from tests.brokers import Mosquitto
from tests.cluster import Cluster, Node, checked, pids, untouched
from tests.support import during, wait_for

pytestmark = pytest.mark.slow

T = Topics("imex/v2")
WAIT_S = 60.0
WATCH_S = 4.0
"""How long a wrong reaction gets to show (reconcile, reload window, probes)."""
CHANNELS: dict[str, dict[str, Any]] = {"channels": {"simulate": True}}
"""A stand-in channel file where the agent may not mknod (the test may run unprivileged)."""


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def served(c: Cluster, topic: str) -> dict[str, Any] | None:
    """The record the broker serves on `topic`, decoded (None: nothing)."""
    with c.client() as client:
        data = client.retained(topic).get(topic)
    return None if not data else dict(json.loads(data))


def generation(c: Cluster, topic: str) -> int:
    record = served(c, topic)
    assert record is not None, f"nothing on {topic}"
    return int(record["generation"])


def channel(node: Node, number: int) -> Path:
    return node.dev_dir / f"channel{number}"


def test_a_replayed_older_spec_changes_nothing_and_the_newer_goes_back(c: Cluster) -> None:
    """Generation 1 of a spec (n1, n2) published again after generation 2 (n1, n2, n3): no
    daemon is stopped or restarted, n3 keeps its channel, the stale copy is counted, and
    the broker serves generation 2 again."""
    nodes = [c.add(name, domain=None, overrides=CHANNELS) for name in ("n1", "n2", "n3")]
    c.wait(c.all_ready, timeout=WAIT_S, what="idle nodes ready")
    ok(c.imexd("domain", "create", "d1", "--nodes", "n1,n2"))
    with c.client() as client:
        first = client.retained(T.spec("d1"))[T.spec("d1")]
    ok(c.imexd("domain", "create", "d1", "--nodes", "n1,n2,n3", "--wait", str(WAIT_S)))
    ok(c.imexd("workload", "create", "job-a", "--domain", "d1", "--wait", str(WAIT_S)))
    newest = generation(c, T.spec("d1"))
    before = pids(nodes)
    assert channel(nodes[2], 1).exists()

    with c.client() as client:
        client.publish(T.spec("d1"), first, retain=True)
    c.wait(
        lambda: generation(c, T.spec("d1")) == newest,
        timeout=WAIT_S,
        what="the broker serves the newer spec again",
    )

    def changed() -> str | None:
        if not channel(nodes[2], 1).exists():
            return "n3's channel was removed"
        return "; ".join(untouched(nodes, before)) or None

    assert during(WATCH_S, changed) == []
    assert nodes[2].dropped().get("stale", 0) >= 1
    assert "3 of 3 members ready" in ok(c.imexd("domain", "status", "d1", "--wait", "5"))


def test_a_domain_deleted_while_a_node_was_frozen_stays_deleted(c: Cluster) -> None:
    """n3's agent is stopped (SIGSTOP) while d1 is deleted, then the broker restarts
    without persistence: the agents that saw the delete give the tombstones back, and n3,
    continued, leaves: no spec, workload or assignment of d1 comes back, `domain list`
    does not show it."""
    frozen_settings: dict[str, dict[str, Any]] = {"bus": {"keepalive_s": 2.0}, **CHANNELS}
    nodes = [c.add(name, domain=None, overrides=CHANNELS) for name in ("n1", "n2")]
    n3 = c.add("n3", domain=None, overrides=frozen_settings)
    nodes.append(n3)
    c.wait(c.all_ready, timeout=WAIT_S, what="idle nodes ready")
    ok(c.imexd("domain", "create", "d1", "--nodes", "n1,n2,n3", "--wait", str(WAIT_S)))
    ok(c.imexd("workload", "create", "job-a", "--domain", "d1", "--wait", str(WAIT_S)))
    assert n3.daemon_pid() is not None
    n3.signal(signal.SIGSTOP)
    try:
        c.wait(
            lambda: (served(c, T.presence("n3")) or {}).get("lost") is True,
            timeout=WAIT_S,
            what="the broker ended n3's link: its will is on the bus",
        )
        ok(c.imexd("domain", "delete", "d1", "--timeout", "40"))
        assert (served(c, T.spec("d1")) or {}).get("state") == "deleted"
        c.broker.stop()
        c.broker.start()
        c.wait(
            lambda: (served(c, T.spec("d1")) or {}).get("state") == "deleted",
            timeout=WAIT_S,
            what="n1 and n2 give the spec's tombstone back",
        )
    finally:
        n3.signal(signal.SIGCONT)
    c.wait(lambda: n3.daemon_pid() is None, timeout=WAIT_S, what="n3 leaves the deleted d1")

    def resurrected() -> str | None:
        spec = served(c, T.spec("d1"))
        workload = served(c, T.workload("d1", "job-a"))
        assigned = [served(c, T.assignment(n.name)) for n in nodes]
        back = []
        if spec is not None and spec.get("state") != "deleted":
            back.append(f"spec {spec}")
        if workload is not None and workload.get("state") == "active":
            back.append(f"workload {workload}")
        back += [f"assignment {a}" for a in assigned if a is not None and a.get("domain")]
        return "; ".join(back) or None

    assert during(WATCH_S, resurrected) == []
    listed = ok(c.imexd("domain", "list"))
    assert "d1" not in listed.split(), listed
    assert not channel(n3, 1).exists()


@pytest.fixture
def persistent(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster whose Mosquitto keeps its retained state on disk (mosquitto.db)."""
    yield from checked(tmp_path, Mosquitto(tmp_path / "broker", persistence=True))


STANDBY_NODES = 18
"""Agents of the standby test: two domains of 8 with a workload each, a third domain of one
node that is deleted, and one idle node."""


@pytest.mark.timeout(300)
def test_a_standby_restored_from_an_older_snapshot_is_healed(persistent: Cluster) -> None:
    """Agents in two domains with a workload each. A copy of the broker's disk is taken;
    then a spec is updated, a workload and a third domain deleted. A standby started from
    the copy on the same address serves the older versions: the agents give back the
    newest, no daemon is touched, and no deleted control-plane record comes back."""
    c = persistent
    names = [f"n{i:02d}" for i in range(1, STANDBY_NODES + 1)]
    nodes = [c.add(name, domain=None, overrides=CHANNELS) for name in names]
    c.wait(c.all_ready, timeout=2 * WAIT_S, what="idle nodes ready")
    per = min(8, (len(names) - 1) // 2)  # a domain holds at most max_nodes (8) members
    a, b = names[:per], names[per : 2 * per]
    ok(c.imexd("domain", "create", "da", "--nodes", ",".join(a), "--wait", str(2 * WAIT_S)))
    ok(c.imexd("domain", "create", "db", "--nodes", ",".join(b), "--wait", str(2 * WAIT_S)))
    ok(c.imexd("domain", "create", "dc", "--nodes", names[-1], "--wait", str(WAIT_S)))
    ok(c.imexd("workload", "create", "job-a", "--domain", "da", "--wait", str(WAIT_S)))
    ok(c.imexd("workload", "create", "job-b", "--domain", "db", "--wait", str(WAIT_S)))
    ok(c.imexd("workload", "create", "gone", "--domain", "db", "--wait", str(WAIT_S)))
    broker = c.broker
    assert isinstance(broker, Mosquitto)
    broker.stop()  # Mosquitto writes its state at exit
    snapshot = broker.workdir / "older.db"
    shutil.copy(broker.workdir / "mosquitto.db", snapshot)
    broker.start()
    ok(c.imexd("domain", "status", "da", "--wait", str(WAIT_S)))
    # Newer than the snapshot: an update, a deleted workload, a deleted domain.
    ok(c.imexd("domain", "create", "da", "--nodes", ",".join(a)))
    ok(c.imexd("workload", "delete", "gone", "--wait", str(WAIT_S)))
    ok(c.imexd("domain", "delete", "dc", "--timeout", str(WAIT_S)))
    topics = [
        T.spec("da"),
        T.spec("db"),
        T.spec("dc"),
        T.workload("da", "job-a"),
        T.workload("db", "job-b"),
        T.workload("db", "gone"),
        *(T.assignment(n) for n in names),
    ]
    with c.client() as client:
        newest = {t: client.retained(t).get(t) for t in topics}
    running = [n for n in nodes if n.name in a + b]
    before = pids(running)

    def given_back() -> int:
        """The newer da spec given back to a broker that served an older one."""
        events = (e for n in nodes for e in n.log_events("rebuild.restored"))
        return sum(1 for e in events if e.get("topic") == T.spec("da"))

    given_back_before = given_back()
    broker.stop()
    shutil.copy(snapshot, broker.workdir / "mosquitto.db")
    broker.start()

    def healed() -> bool:
        with c.client() as client:
            return all(client.retained(t).get(t) == newest[t] for t in topics)

    c.wait(healed, timeout=WAIT_S, what="the broker serves the newest version of every record")
    # The standby served the older spec (read at once, the agents that reconnect first
    # may already have given the newer back): an agent gave the newer one back.
    assert given_back() > given_back_before
    assert untouched(running, before) == []
    assert nodes[-1].daemon_pid() is None
    for domain in ("da", "db"):
        ok(c.imexd("domain", "status", domain, "--wait", str(WAIT_S)))
    assert during(WATCH_S, lambda: "; ".join(untouched(running, before)) or None) == []
    wait_for(
        lambda: "dc" not in c.imexd("domain", "list").stdout.split(),
        timeout=WAIT_S,
        what="domain list without the deleted dc (its member's stale record cleared)",
        seen=lambda: c.imexd("domain", "list").stdout,
    )
