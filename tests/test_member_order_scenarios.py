"""Member records in their writers' order, with real agents (issue 41, points 3, 4, 5b).

A dead node's will followed at once by a broker restart (Mosquitto with and without
persistence, Debian's nats-server 2.9.10), a stranger's record of a node before and while
its domain is created, and forged copies of a live member's record that its owner puts
back. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokers import Mosquitto
from tests.cluster import (
    BusBroker,
    Cluster,
    Node,
    checked,
    formed,
    members,
    pids,
    quiet,
    slot_of,
    untouched,
)
from tests.nats_servers import Nats
from tests.support import IMEXD, during, loopback_address

pytestmark = pytest.mark.slow

MEMBERS = "imex/v2/domains/d1/members/c1/"
DEBIAN_NATS = "/usr/sbin/nats-server"


@pytest.fixture(params=["mosquitto", "mosquitto-persistent", "nats-2.9.10"])
def restartable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """Agents on a broker that the test restarts on the same port."""
    broker: BusBroker
    if request.param == "nats-2.9.10":
        if not os.access(DEBIAN_NATS, os.X_OK):
            pytest.skip(f"no {DEBIAN_NATS}")
        broker = Nats(tmp_path / "nats", binary=DEBIAN_NATS)
    else:
        persistent = request.param == "mosquitto-persistent"
        broker = Mosquitto(tmp_path / "broker", persistence=persistent)
    yield from checked(tmp_path, broker)


def test_a_dead_node_never_returns_after_a_broker_restart(restartable: Cluster) -> None:
    """n3 is killed; once its peers dropped it (its will), the broker restarts at once:
    n3 never comes back to a peer's hosts file, and no daemon restarts."""
    c = restartable
    nodes = [c.add(name) for name in ("n1", "n2", "n3")]
    formed(c, nodes)
    stay, victim = nodes[:2], nodes[2]
    slot = slot_of(victim)
    quiet(c, nodes)
    before = pids(stay)
    victim.crash()
    c.wait(
        lambda: all(n.hosts_slots().get(slot, "") is None for n in stay),
        timeout=30,
        what=f"the peers dropped {victim.name} (its will)",
    )
    links = {n.name: len(n.log_events("bus_connected")) for n in stay}
    c.broker.stop()
    c.broker.start()

    def back() -> str | None:
        for n in stay:
            if n.hosts_slots().get(slot) is not None:
                return f"{n.name} maps {victim.name}'s slot {slot} to {n.hosts_slots()[slot]}"
        return None

    def reconnected() -> bool:
        """Every peer on a new link to the restarted broker, its snapshot read."""
        return all(
            len(n.log_events("bus_connected")) > links[n.name]
            and n.condition("BusConnected").get("status") == "True"
            for n in stay
        )

    # Watched from the restart until the peers are back, then for as long again as a
    # resync and the drop of what it gave back take.
    seen = during(30.0, back, ends_when=reconnected)
    seen += [p for p in during(2.0, back) if p not in seen]
    assert seen == []
    assert untouched(stay, before) == []


def forged_k3(address: str, settled: float) -> bytes:
    """A member record of k3 that k3 did not write."""
    return json.dumps(
        {
            "v": 1,
            "node": "k3",
            "domain": "d1",
            "clique": "c1",
            "address": address,
            "slot": 2,
            "incarnation": 1,
            "state": "member",
            "max_nodes": 8,
            "mode": "names",
            "settled": settled,
        }
    ).encode()


def test_a_strangers_record_of_a_node_does_not_block_its_domain(c: Cluster) -> None:
    """A record of k3 placed before `domain create --wait` and published again twice
    during it: the create returns, k3 runs its daemon and its peers map its real address."""
    slow = {"bus": {"reconnect_max_s": 30.0}}  # the shipped reconnect bound
    nodes = [c.add(name, domain=None, overrides=slow) for name in ("k1", "k2", "k3")]
    c.wait(c.all_ready, timeout=60, what="three idle agents ready")
    k3 = nodes[2]
    stranger = loopback_address()
    with c.client() as client:
        client.publish(MEMBERS + "k3", forged_k3(stranger, time.time() - 50), retain=True)
    create = subprocess.Popen(
        [IMEXD, "domain", "create", "d1", "--nodes", "k1,k2,k3", "--wait", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=c.control_env(),
    )
    try:
        for delay in (0.5, 0.5):
            time.sleep(delay)
            with c.client() as client:
                payload = forged_k3(stranger, time.time() - 40)
                client.publish(MEMBERS + "k3", payload, retain=True)
        out, err = create.communicate(timeout=25)
    finally:
        if create.poll() is None:
            create.kill()
            create.communicate()
    assert create.returncode == 0, out + err
    c.wait(lambda: k3.daemon_pid() is not None, timeout=20, what="k3's daemon running")
    assert k3.condition("SlotSettled").get("reason") != "DuplicateNode"
    slot = slot_of(k3)
    c.wait(
        lambda: all(members(n).get(slot) == k3.address for n in nodes),
        timeout=20,
        what=f"every node maps k3's slot {slot} to {k3.address}",
    )


def retained_record(c: Cluster, node: Node) -> dict[str, object]:
    """`node`'s member record as the broker holds it."""
    with c.client() as client:
        payload = client.retained(MEMBERS + node.name)[MEMBERS + node.name]
    record: dict[str, object] = json.loads(payload)
    return record


def test_forged_copies_that_the_owner_puts_back_reach_no_daemon(c: Cluster) -> None:
    """Three forged copies of n2's record (another address, a later seq) published a
    second apart: n2 puts its own back each time, and no peer's daemon gets a SIGUSR1."""
    nodes = [c.add(name) for name in ("n1", "n2", "n3")]
    formed(c, nodes)
    holder = nodes[1]
    quiet(c, nodes)
    before = pids(nodes)
    signals = {n.name: n.signals() for n in nodes}
    hosts = {n.name: n.hosts_file.read_text() for n in nodes}
    for _ in range(3):
        record = retained_record(c, holder)
        seq = record.get("seq", 0)
        assert isinstance(seq, int)
        forged = {**record, "address": loopback_address(), "seq": seq + 1}
        with c.client() as client:
            client.publish(MEMBERS + holder.name, json.dumps(forged).encode(), retain=True)
        c.wait(
            lambda: retained_record(c, holder).get("address") == holder.address,
            timeout=10,
            what=f"{holder.name} put its record back",
        )
        time.sleep(1.0)
    quiet(c, nodes)
    assert {n.name: n.signals() for n in nodes} == signals
    assert {n.name: n.hosts_file.read_text() for n in nodes} == hosts
    assert untouched(nodes, before) == []
