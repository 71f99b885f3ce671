"""Hostile member records against a running domain (issue 9, points 1 to 5).

Each test forms a domain of real agents (tests/cluster.py), then a raw MQTT client
publishes one retained record on a node's member topic, which broker ACLs would allow
that node to write. Whatever the record says, every agent stays alive, no daemon is
restarted (pids unchanged), nothing bad reaches a file, and a record refused at the wire
is counted in imexd_bus_dropped_total. Every wait is bounded.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import Cluster, Node, formed, pids, slot_of, untouched
from tests.support import during, loopback_address

pytestmark = pytest.mark.slow

MEMBERS = "imex/v2/domains/d1/members/c1/"
WATCH_S = 4.0
"""How long a wrong reaction gets to show (reconcile, reload window, probes)."""


def record(node: str, **fields: Any) -> bytes:
    base: dict[str, Any] = {
        "v": 1,
        "node": node,
        "domain": "d1",
        "clique": "c1",
        "address": loopback_address(),
        "slot": 7,
        "incarnation": 1,
        "state": "member",
        "max_nodes": 8,
        "mode": "names",
    }
    return json.dumps({**base, **fields}).encode()


def inject(c: Cluster, node: str, payload: bytes) -> None:
    with c.client() as client:
        client.publish(MEMBERS + node, payload, retain=True)


def files(nodes: list[Node]) -> dict[str, tuple[str, str]]:
    """Each node's hosts file and nodes_config.cfg."""
    return {
        n.name: (n.hosts_file.read_text(), (n.run_dir / "nodes_config.cfg").read_text())
        for n in nodes
    }


def steady(nodes: list[Node], before: dict[str, int | None], written: Any) -> list[str]:
    """Watch for WATCH_S: every complaint about dead agents, daemons or files."""

    def check() -> str | None:
        for n in nodes:
            if not n.alive():
                return f"{n.name}: the agent exited ({n.proc.poll() if n.proc else None})"
            if n.daemon_pids_on_host() != [before[n.name]]:
                return f"{n.name}: daemons {n.daemon_pids_on_host()}, was {before[n.name]}"
        if written is not None and files(nodes) != written:
            return "a hosts file or nodes_config.cfg changed"
        return None

    return during(WATCH_S, check)


def new_drops(nodes: list[Node], counts: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per node, the reasons newly counted in imexd_bus_dropped_total."""
    out: dict[str, Any] = {}
    for n in nodes:
        if not n.alive():
            out[n.name] = "agent dead"
            continue
        now = n.dropped()
        out[n.name] = {r: v - counts[n.name].get(r, 0) for r, v in now.items()} | {}
        out[n.name] = {r: v for r, v in out[n.name].items() if v}
    return out


def three(c: Cluster, **kw: Any) -> tuple[list[Node], dict[str, int | None]]:
    nodes = [c.add(f"n{i}", **kw) for i in (1, 2, 3)]
    formed(c, nodes)
    return nodes, pids(nodes)


def assert_dropped_once_at_the_wire(
    c: Cluster, nodes: list[Node], before: dict[str, int | None], payload: bytes
) -> None:
    """Inject on n3's topic: steady everywhere, one `address` drop counted by every agent."""
    written = files(nodes)
    counts = {n.name: n.dropped() for n in nodes}
    inject(c, "n3", payload)
    problems = steady(nodes, before, written)
    drops = new_drops(nodes, counts)
    for n in nodes:
        d = drops[n.name]
        if d != {"address": 1}:
            problems.append(f"{n.name}: dropped {d}, expected {{'address': 1}}")
    if all(n.alive() for n in nodes):
        problems += untouched(nodes, before)
    assert problems == [], problems


def test_a_member_at_the_sentinel_address_is_dropped(c: Cluster) -> None:
    """(1) `"address": "127.0.0.2"`: today render raises and every agent exits."""
    nodes, before = three(c)
    n3 = nodes[2]
    payload = record("n3", address="127.0.0.2", slot=slot_of(n3), incarnation=99)
    assert_dropped_once_at_the_wire(c, nodes, before, payload)


def test_an_ipv6_zone_id_cannot_inject_a_hosts_line(c: Cluster) -> None:
    """(2) A zone id holding a newline and a fake hosts line never reaches a hosts file."""
    nodes, before = three(c)
    n3 = nodes[2]
    evil = "fe80::1%x\n10.66.6.6 imex-0000000000-0000 login-node"
    payload = record("n3", address=evil, slot=slot_of(n3), incarnation=99)
    assert_dropped_once_at_the_wire(c, nodes, before, payload)
    for n in nodes:
        text = n.hosts_file.read_text()
        assert "10.66.6.6" not in text, n.name
        assert "login-node" not in text, n.name


def test_a_record_posing_as_member_on_a_held_slot_does_not_evict(c: Cluster) -> None:
    """(3) A lower-named `member` on a held slot: the incumbent keeps slot and daemon."""
    nodes, before = three(c)
    incumbent = nodes[1]
    slot = slot_of(incumbent)
    written = files(nodes)
    inject(c, "a1", record("a1", slot=slot))
    problems = steady(nodes, before, written)
    if all(n.alive() for n in nodes):
        if incumbent.slot() != slot:
            problems.append(f"the incumbent moved from slot {slot} to {incumbent.slot()}")
        for n in nodes:
            if n.hosts_slots().get(slot) != incumbent.address:
                problems.append(f"{n.name} maps slot {slot} to {n.hosts_slots().get(slot)}")
            if not n.ready():
                problems.append(f"{n.name} is not ready: {n.condition('SlotSettled')}")
        problems += untouched(nodes, before)
    assert problems == [], problems


def contested(node: Node) -> float | None:
    """imexd_slot_contested from the node's /metrics (None: not exported)."""
    code, body = node.get("/metrics")
    assert code == 200, (code, body)
    assert isinstance(body, str), body
    for family in text_string_to_metric_families(body):
        if family.name == "imexd_slot_contested":
            return float(family.samples[0].value)
    return None


def forge_on_holders_slot(c: Cluster, holder: Node) -> int:
    """Publish a0's `member` record on `holder`'s slot with its exact `settled` stamp;
    the slot."""
    slot = slot_of(holder)
    with c.client() as client:
        own = client.retained(MEMBERS + holder.name)[MEMBERS + holder.name]
    stamp = json.loads(own)["settled"]
    assert isinstance(stamp, float), own
    inject(c, "a0", record("a0", slot=slot, settled=stamp))
    return slot


def holder_kept(nodes: list[Node], holder: Node, slot: int) -> list[str]:
    """What shows that `holder` lost its slot, that a node's hosts block points the slot
    elsewhere, or that a node does not report the contest (empty: none of it)."""
    problems = []
    if holder.slot() != slot:
        problems.append(f"the holder moved from slot {slot} to {holder.slot()}")
    for n in nodes:
        if n.hosts_slots().get(slot) != holder.address:
            problems.append(f"{n.name} maps slot {slot} to {n.hosts_slots().get(slot)}")
        settled = n.condition("SlotSettled")
        if (settled.get("status"), settled.get("reason")) != ("True", "SlotContested"):
            problems.append(f"{n.name}: SlotSettled {settled}")
        elif "a0" not in settled.get("message", ""):
            problems.append(f"{n.name}: the contender is not named: {settled}")
        if contested(n) != 1.0:
            problems.append(f"{n.name}: imexd_slot_contested {contested(n)}")
        if not n.ready():
            problems.append(f"{n.name} is not ready")
    return problems


def test_a_member_copying_the_holders_stamp_with_a_lower_name_does_not_evict(
    c: Cluster,
) -> None:
    """(Issue 20, case 1) A `member` record on a held slot with the holder's exact
    `settled` stamp and a lower node name: it used to rank first, so the holder gave its
    slot up and its daemon was stopped and started again. The holder keeps slot and
    daemon, every node keeps its address in the hosts block, and all report the conflict
    (SlotSettled SlotContested naming the contender, imexd_slot_contested 1)."""
    nodes, before = three(c)
    holder = nodes[1]
    written = files(nodes)
    slot = forge_on_holders_slot(c, holder)
    problems = steady(nodes, before, written)
    if all(n.alive() for n in nodes):
        problems += holder_kept(nodes, holder, slot) + untouched(nodes, before)
    assert problems == [], problems


def test_the_holder_keeps_its_slot_across_a_reconnect_while_the_forged_member_stands(
    c: Cluster,
) -> None:
    """(Issue 20, case 1) The holder's link is cut and comes back within the will delay
    while the forged record stands: its new snapshot gives its own record back as it
    published it, so it is still the incumbent and nothing moves."""
    slow_will = {"bus": {"will_delay_s": 6.0}}
    nodes = [
        c.add("n1", overrides=slow_will),
        c.add("n2", overrides=slow_will, via_proxy=True),
        c.add("n3", overrides=slow_will),
    ]
    formed(c, nodes)
    before = pids(nodes)
    holder = nodes[1]
    assert holder.proxy is not None
    written = files(nodes)
    slot = forge_on_holders_slot(c, holder)
    c.wait(lambda: holder.condition("SlotSettled").get("reason") == "SlotContested", 10)
    links = len(holder.log_events("bus_connected"))
    holder.proxy.cut()
    time.sleep(0.3)
    holder.proxy.heal()
    c.wait(lambda: len(holder.log_events("bus_connected")) > links and holder.ready(), 20)
    problems = steady(nodes, before, written)
    if all(n.alive() for n in nodes):
        problems += holder_kept(nodes, holder, slot) + untouched(nodes, before)
    assert problems == [], problems


def test_a_standby_with_another_max_nodes_causes_no_mismatch(c: Cluster) -> None:
    """(4) A `standby` record with max_nodes 4 is in no node list: no NodeMapMismatch."""
    nodes, before = three(c)
    written = files(nodes)
    inject(c, "n9", record("n9", state="standby", slot=None, max_nodes=4))
    problems = steady(nodes, before, written)

    def mismatch() -> str | None:
        for n in nodes:
            settled = n.condition("SlotSettled")
            if settled.get("reason") == "NodeMapMismatch" or not n.ready():
                return f"{n.name}: ready {n.ready()}, SlotSettled {settled}"
        return None

    problems += during(1.0, mismatch)
    if all(n.alive() for n in nodes):
        problems += untouched(nodes, before)
    assert problems == [], problems


def test_a_claim_that_never_settles_frees_its_slot_after_the_stale_bound(c: Cluster) -> None:
    """(5) A bogus `claiming` record on the only free slot stops counting after 2 s.

    max_nodes 3: n1 and n2 hold two slots; "a0" (a lower name than any real node) claims
    the third and never settles. A real n3 then takes that slot instead of waiting in
    DomainFull; n1 and n2 keep their daemons.
    """
    small = {"domain": {"max_nodes": 3, "claim_stale_s": 2.0}}
    nodes = [c.add(f"n{i}", overrides=small) for i in (1, 2)]
    formed(c, nodes)
    before = pids(nodes)
    free = ({0, 1, 2} - {slot_of(n) for n in nodes}).pop()
    inject(c, "a0", record("a0", state="claiming", slot=free, max_nodes=3))
    time.sleep(0.5)
    claimed = time.monotonic()
    n3 = c.add("n3", overrides=small)
    try:
        c.wait(lambda: n3.ready() and n3.slot() == free, timeout=25)
    except AssertionError:
        pytest.fail(f"n3 never took slot {free}: SlotSettled {n3.condition('SlotSettled')}")
    took = time.monotonic() - claimed
    assert took >= 2.0, f"n3 took the claimed slot after {took:.1f} s, before the bound"
    c.wait(lambda: all(n.up_with(3) for n in [*nodes, n3]), timeout=30)
    assert untouched(nodes, before) == []
    assert n3.daemon_starts() == 1


def test_a_forged_health_report_is_put_back_by_its_owner(c: Cluster) -> None:
    """A report on n2's health topic that n2 did not write (ready false) is replaced by
    n2's own at once, not at its next periodic report (here a minute away), and counted."""
    nodes, _ = three(c, overrides={"health": {"report_interval_s": 60.0}})
    n2 = nodes[1]
    topic = "imex/v2/domains/d1/health/n2"
    with c.client() as client:
        own = json.loads(client.retained(topic)[topic])
    forged = {**own, "ready": False, "at": own["at"] + 1}
    inject_at = time.monotonic()
    with c.client() as client:
        client.publish(topic, json.dumps(forged).encode(), retain=True)

    def served() -> dict[str, Any]:
        with c.client() as client:
            copy = client.retained(topic).get(topic)
        return json.loads(copy) if copy else {}

    c.wait(
        lambda: served().get("ready") is True and served().get("node") == "n2",
        timeout=20,
        what="n2's own report back on its topic",
    )
    assert time.monotonic() - inject_at < 60, "put back by the periodic report, not at once"
    assert n2.log_events("bus_record_put_back"), "the put-back is logged"
    # The metrics show the facts as last judged, at most REPORT_PACE_S after the count moved.
    c.wait(
        lambda: "imexd_bus_records_put_back_total 1.0" in n2.get("/metrics")[1],
        timeout=5,
        what="the put-back counted in n2's metrics",
    )
