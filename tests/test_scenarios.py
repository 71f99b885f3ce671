"""Scenarios with real agent processes, a real Mosquitto and simulated IMEX daemons.

Every test starts its own broker and agents (tests/cluster.py, shortened timings) and
waits on conditions with upper bounds; the `c` fixture also checks, after `close()`,
that the agents left no process behind and logged no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest

from imexd.agent.run import EXIT_HANDOVER
from imexd.messages import DomainSpec, MemberRecord, MemberState, Presence, encode
from tests.cluster import Cluster, Node, members, pids, quiet, slot_of

pytestmark = pytest.mark.slow

MEMBERS = "imex/v2/domains/d1/members/c1/"


def form(
    c: Cluster, count: int, *, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> list[Node]:
    """Start `count` agents n1.. and wait until every one judges the domain UP."""
    nodes = [c.add(f"n{i}", overrides=overrides) for i in range(1, count + 1)]
    c.wait(c.all_ready, timeout=60)
    c.wait(lambda: all(n.up_with(count) for n in nodes), timeout=30)
    return nodes


def assert_untouched(nodes: list[Node], before_pids: dict[str, int | None]) -> None:
    """No daemon restarted or was replaced on `nodes`."""
    assert pids(nodes) == before_pids
    for n in nodes:
        assert n.status()["daemon"]["restarts"] == 0, n.name
        assert n.daemon_pids_on_host() == [before_pids[n.name]], n.name


def test_four_agents_form_a_domain(c: Cluster) -> None:
    """Four agents settle unique slots, map the same hosts, and their daemons start once."""
    nodes = form(c, 4)
    c.wait(lambda: all(len(n.hosts_slots()) == 8 for n in nodes))
    maps = [members(n) for n in nodes]
    assert all(m == maps[0] for m in maps)
    assert sorted(maps[0].values()) == sorted(n.address for n in nodes)
    assert sorted(slot_of(n) for n in nodes) == sorted(maps[0])
    slots = {str(slot_of(m)) for m in nodes}
    for n in nodes:
        view = n.domain_json()
        for slot in slots:
            entry = view["nodes"][slot]
            assert entry["status"] == "READY", (n.name, slot)
            assert all(
                entry["connections"][o]["status"] == "CONNECTED" for o in slots if o != slot
            ), (n.name, slot)
        # IMEX's own verdict counts the empty slots: it is not the agent's.
        assert view["status"] == "DEGRADED", n.name
    assert all(n.status()["daemon"]["restarts"] == 0 for n in nodes)
    for n in nodes:
        assert n.daemon_starts() == 1, n.name
        assert n.daemon_pids_on_host() == [n.daemon_pid()]


def test_a_joining_agent_makes_the_others_reload_not_restart(c: Cluster) -> None:
    """A fifth agent is taken in with one honoured SIGUSR1 per peer and no restart."""
    nodes = form(c, 4)
    quiet(c, nodes)
    before = pids(nodes)
    reloads = {n.name: len(n.reloads()) for n in nodes}
    n5 = c.add("n5")
    c.wait(lambda: all(n.up_with(5) for n in [*nodes, n5]), timeout=30)
    assert_untouched(nodes, before)
    for n in nodes:
        assert len(members(n)) == 5, n.name
        assert n.reloads()[reloads[n.name] :] == ["honoured"], (n.name, n.signals())
        assert "ignored" not in n.reloads(), (n.name, n.signals())
    assert n5.daemon_starts() == 1
    assert n5.reloads() == []
    for n in [*nodes, n5]:
        # The will is the node's presence: it rides on the first CONNECT, and no join
        # connects again.
        connects = n.log_events("bus_connected")
        assert len(connects) == 1, (n.name, connects)
        assert connects[0]["will"] == f"imex/v2/nodes/{n.name}/presence", n.name


def test_a_graceful_leave_frees_the_slot_without_restarts(c: Cluster) -> None:
    """SIGTERM clears the record, stops the daemon, removes the block; peers only reload."""
    nodes = form(c, 4)
    leaver, stay = nodes[3], nodes[:3]
    slot = slot_of(leaver)
    before = pids(stay)
    assert leaver.stop() == 0
    assert leaver.daemon_pids_on_host() == []
    assert leaver.hosts_file.read_text() == "127.0.0.1 localhost\n"
    assert not (leaver.run_dir / "nodes_config.cfg").exists()
    with c.client() as client:
        assert MEMBERS + leaver.name not in client.retained(MEMBERS + "+")
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in stay))
    c.wait(lambda: all(n.up_with(3) for n in stay))
    assert_untouched(stay, before)


def test_a_crashed_node_is_dropped_after_the_will_delay(c: Cluster) -> None:
    """SIGKILL: after its delay the will, the node's presence marked lost (hold 0: this
    Mosquitto applied the Will Delay), ends its record, which stays as it wrote it, and
    peers map the sentinel."""
    nodes = form(c, 4)
    victim, stay = nodes[3], nodes[:3]
    slot = slot_of(victim)
    before = pids(stay)
    killed = time.monotonic()
    victim.crash()
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in stay), timeout=20)
    gone = time.monotonic() - killed
    assert gone >= 1.5, f"the slot was freed after {gone:.1f} s, before the will delay"
    with c.client() as client:
        record = client.retained(MEMBERS + "+")[MEMBERS + victim.name]
        will = client.retained(f"imex/v2/nodes/{victim.name}/presence")
    written = msgspec.json.decode(record, type=MemberRecord)
    lost = msgspec.json.decode(will[f"imex/v2/nodes/{victim.name}/presence"], type=Presence)
    assert (lost.lost, lost.hold_s, lost.incarnation) == (True, 0.0, written.incarnation)
    assert lost.link >= written.link
    c.wait(lambda: all(n.up_with(3) for n in stay))
    assert_untouched(stay, before)


def test_a_broker_restart_loses_nothing(c: Cluster) -> None:
    """A broker that lost its retained state: agents re-publish; daemons and hosts stay."""
    nodes = form(c, 4)
    before = pids(nodes)
    hosts = {n.name: n.hosts_file.read_text() for n in nodes}
    quiet(c, nodes)
    signals = {n.name: n.signals() for n in nodes}
    c.broker.stop()
    c.broker.start()
    c.wait(lambda: all(n.condition("BusConnected").get("status") == "True" for n in nodes))
    with c.client() as client:
        c.wait(lambda: len(client.retained(MEMBERS + "+")) == 4, timeout=20)
    c.wait(lambda: all(n.up_with(4) for n in nodes))
    assert_untouched(nodes, before)
    assert {n.name: n.hosts_file.read_text() for n in nodes} == hosts
    for n in nodes:
        assert n.signals() == signals[n.name], n.name
        # The restart is one lost link; joining the domain (a new will) counts none.
        assert n.log_events("bus_connected")[-1]["reconnects"] >= 1, n.name


def test_a_node_lost_during_a_broker_outage_is_dropped_after_the_grace(c: Cluster) -> None:
    """A peer that never comes back after a broker restart leaves the hosts after a grace."""
    nodes = form(c, 3)
    stay, victim = nodes[:2], nodes[2]
    slot = slot_of(victim)
    quiet(c, nodes)
    before = pids(stay)
    reloads = {n.name: len(n.reloads()) for n in stay}
    c.broker.stop()
    victim.crash()
    c.broker.start()
    c.wait(lambda: all(n.condition("BusConnected").get("status") == "True" for n in stay))
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in stay), timeout=20)
    c.wait(lambda: all(n.up_with(2) for n in stay))
    for n in stay:
        gone = n.log_events("membership.records_gone")
        assert gone[-1]["nodes"] == [victim.name], n.name
        assert n.reloads()[reloads[n.name] :] == ["honoured"], (n.name, n.signals())
    assert_untouched(stay, before)


def _assert_formed_once(nodes: list[Node]) -> dict[str, int]:
    """Distinct slots 0..n-1 mapped alike everywhere, one daemon start per node; the slots."""
    slots = {n.name: slot_of(n) for n in nodes}
    assert sorted(slots.values()) == list(range(len(nodes))), slots
    for n in nodes:
        assert members(n) == {slots[m.name]: m.address for m in nodes}, n.name
        assert n.daemon_starts() == 1, n.name
        assert n.status()["daemon"]["restarts"] == 0, n.name
    return slots


def test_eight_agents_started_at_once_settle_unique_slots(c: Cluster) -> None:
    """Eight agents started together (elastic) fill the eight slots, one daemon start each."""
    nodes = [c.add(f"n{i}", start=False) for i in range(1, 9)]
    for n in nodes:
        n.start()
    c.wait(c.all_ready, timeout=60)
    c.wait(lambda: all(n.up_with(8) for n in nodes), timeout=30)
    _assert_formed_once(nodes)


def test_a_spec_listing_the_nodes_gives_them_their_list_positions(c: Cluster) -> None:
    """With a DomainSpec listing eight nodes, each takes its position in the list."""
    names = [f"n{i}" for i in (5, 2, 8, 1, 7, 3, 6, 4)]
    spec = DomainSpec(domain="d1", nodes=names, max_nodes=8, generation=1)
    with c.client() as client:
        client.publish("imex/v2/domains/d1/spec", encode(spec), retain=True)
    nodes = [c.add(name, start=False) for name in sorted(names)]
    for n in nodes:
        n.start()
    c.wait(c.all_ready, timeout=60)
    c.wait(lambda: all(n.up_with(8) for n in nodes), timeout=30)
    slots = _assert_formed_once(nodes)
    assert slots == {name: names.index(name) for name in names}


def test_a_restarted_agent_gets_its_previous_slot_back(c: Cluster) -> None:
    """An agent that left and starts again claims its previous slot, not the lowest free."""
    nodes = form(c, 4)
    by_slot = {slot_of(n): n for n in nodes}
    first, second = by_slot[1], by_slot[2]
    assert first.stop() == 0
    assert second.stop() == 0
    rest = [n for n in nodes if n not in (first, second)]
    c.wait(lambda: all(n.up_with(2) for n in rest))
    second.start()
    c.wait(lambda: second.ready() and second.slot() == 2, timeout=30)
    c.wait(lambda: all(n.up_with(3) for n in [*rest, second]))
    first.start()
    c.wait(lambda: all(n.up_with(4) for n in nodes), timeout=30)
    assert {n.name: n.slot() for n in nodes} == {n.name: s for s, n in by_slot.items()}


def _restart_and_adopt(c: Cluster, nodes: list[Node], node: Node, pid: int | None) -> None:
    """Start `node`'s agent again; it must adopt daemon `pid` while peers notice nothing."""
    peers = [n for n in nodes if n is not node]
    before = pids(peers)
    quiet(c, nodes)
    signals = {n.name: n.signals() for n in nodes}
    slot = node.slot_from_state()
    node.start()
    c.wait(node.ready, timeout=30)
    assert node.daemon_pid() == pid
    assert node.slot() == slot
    adopted = node.log_events("daemon.adopted")
    assert adopted[-1]["pid"] == pid
    resumed = [e for e in node.log_events("membership.step") if e["reason"] == "Resumed"]
    assert resumed[-1]["slot"] == slot
    c.wait(lambda: all(n.up_with(len(nodes)) for n in nodes))
    time.sleep(1.0)  # room for a late reload to show
    assert_untouched(peers, before)
    assert {n.name: n.signals() for n in nodes} == signals


def test_an_agent_killed_alone_and_restarted_adopts_its_daemon(c: Cluster) -> None:
    """SIGKILL leaves the daemon; an agent back within the will delay adopts it silently."""
    nodes = form(c, 4, overrides={"bus": {"will_delay_s": 6.0}})
    node = nodes[2]
    pid = node.daemon_pid()
    node.kill()
    assert node.daemon_pids_on_host() == [pid]
    _restart_and_adopt(c, nodes, node, pid)


def test_a_handed_over_agent_exits_75_and_its_successor_adopts(c: Cluster) -> None:
    """SIGUSR2 exits 75 with the daemon and record in place; the next agent adopts it."""
    nodes = form(c, 4)
    node = nodes[1]
    pid = node.daemon_pid()
    with c.client() as client:
        record = client.retained(MEMBERS + node.name)[MEMBERS + node.name]
    node.signal(signal.SIGUSR2)
    assert node.wait_exit() == EXIT_HANDOVER
    assert node.daemon_pids_on_host() == [pid]
    time.sleep(2.5)  # longer than the will delay: a clean DISCONNECT suppressed the will
    with c.client() as client:
        assert client.retained(MEMBERS + node.name) == {MEMBERS + node.name: record}
    _restart_and_adopt(c, nodes, node, pid)


def test_bad_messages_are_dropped_and_counted(c: Cluster) -> None:
    """Malformed, oversized, wrong-version and spoofed records are counted, nothing else."""
    nodes = form(c, 4)
    before = pids(nodes)
    hosts = {n.name: n.hosts_file.read_text() for n in nodes}
    counts = {n.name: n.dropped() for n in nodes}
    quiet(c, nodes)
    signals = {n.name: n.signals() for n in nodes}
    good = MemberRecord(
        node="n9",
        domain="d1",
        clique="c1",
        address="127.0.0.9",
        slot=7,
        incarnation=1,
        state=MemberState.MEMBER,
        max_nodes=8,
        mode="names",
    )
    record = json.loads(encode(good))
    with c.client() as client:
        client.publish(MEMBERS + "n9", b"{not json", retain=True)
        client.publish(MEMBERS + "n9", json.dumps({**record, "pad": "x" * 17000}).encode())
        client.publish(MEMBERS + "n9", json.dumps({**record, "v": 2}).encode())
        client.publish(MEMBERS + "n1", encode(good))
    expected = {"not_json": 1, "oversized": 1, "version": 1, "topic_mismatch": 1}

    def counted(n: Node) -> bool:
        now = n.dropped()
        return all(now.get(r, 0) - counts[n.name].get(r, 0) >= k for r, k in expected.items())

    c.wait(lambda: all(counted(n) for n in nodes), timeout=10)
    time.sleep(1.0)  # room for a wrong reaction to show
    for n in nodes:
        delta = {r: v - counts[n.name].get(r, 0) for r, v in n.dropped().items()}
        assert {r: v for r, v in delta.items() if v} == expected, n.name
        assert len(n.log_events("bus_message_dropped")) >= 4, n.name
        assert n.ready(), n.name
        assert n.up_with(4), n.name
        assert n.signals() == signals[n.name], n.name
        assert n.hosts_file.read_text() == hosts[n.name], n.name
    assert_untouched(nodes, before)


def test_a_node_without_a_clique_is_a_member_without_a_daemon(c: Cluster) -> None:
    """An empty clique joins shard `none` as a member and reports its daemon not applicable."""
    nodes = form(c, 2)
    quiet(c, nodes)
    signals = {n.name: n.signals() for n in nodes}
    lone = c.add("n3", clique="")
    c.wait(lone.ready, timeout=30)
    ready = lone.condition("DaemonReady")
    assert (ready["status"], ready["reason"]) == ("True", "NotApplicable"), ready
    status = lone.status()
    assert (status["ready"], status["clique"], status["slot"]) == (True, "", 0)
    assert lone.daemon_pids_on_host() == []
    assert lone.daemon_starts() == 0
    topic = "imex/v2/domains/d1/members/none/n3"
    with c.client() as client:
        record = json.loads(client.retained(topic)[topic])
    assert (record["state"], record["slot"], record["clique"]) == ("member", 0, "")
    time.sleep(0.5)
    assert all(n.up_with(2) for n in nodes)
    assert {n.name: n.signals() for n in nodes} == signals


def test_a_node_with_another_max_nodes_refuses_to_start(c: Cluster) -> None:
    """A newcomer whose max_nodes differs starts no daemon; running peers keep theirs."""
    nodes = form(c, 2)
    before = pids(nodes)
    odd = c.add("n3", overrides={"domain": {"max_nodes": 4}})
    c.wait(lambda: odd.condition("SlotSettled").get("reason") == "NodeMapMismatch", timeout=30)
    c.wait(
        lambda: all(n.condition("SlotSettled").get("reason") == "NodeMapMismatch" for n in nodes)
    )
    assert "n1" in odd.condition("SlotSettled")["message"]
    assert "n3" in nodes[0].condition("SlotSettled")["message"]
    time.sleep(1.0)
    assert odd.daemon_pids_on_host() == []
    assert odd.daemon_starts() == 0
    assert not odd.ready()
    assert_untouched(nodes, before)


def test_with_a_spec_only_the_node_with_another_max_nodes_is_refused(c: Cluster) -> None:
    """The spec decides: the nodes that match its max_nodes form, the odd one refuses
    itself and says so first."""
    spec = DomainSpec(domain="d1", max_nodes=8, generation=1)
    with c.client() as client:
        client.publish("imex/v2/domains/d1/spec", encode(spec), retain=True)
    nodes = [c.add(name, start=False) for name in ("n1", "n2")]
    odd = c.add("n3", start=False, overrides={"domain": {"max_nodes": 4}})
    for n in (*nodes, odd):
        n.start()
    c.wait(lambda: c.all_ready(["n1", "n2"]), timeout=60)
    c.wait(lambda: odd.condition("SlotSettled").get("reason") == "NodeMapMismatch", timeout=30)
    assert odd.condition("SlotSettled")["message"].startswith("n3: max_nodes 4 here")
    for n in nodes:
        assert n.condition("SlotSettled").get("reason") != "NodeMapMismatch", n.name
    assert odd.daemon_starts() == 0
    assert not odd.ready()


def test_addresses_mode_restarts_on_a_join_and_lists_addresses(c: Cluster) -> None:
    """In addresses mode a join restarts the daemons with the addresses in slot order."""
    mode = {"domain": {"mode": "addresses"}}
    nodes = form(c, 3, overrides=mode)
    before = pids(nodes)
    n4 = c.add("n4", overrides=mode)
    everyone = [*nodes, n4]
    c.wait(lambda: all(n.up_with(4) for n in everyone), timeout=30)
    by_slot = sorted(everyone, key=slot_of)
    expected = "".join(f"{n.address}\n" for n in by_slot)
    for n in everyone:
        assert (n.run_dir / "nodes_config.cfg").read_text() == expected, n.name
        assert n.hosts_slots() == {}, n.name
        assert n.reloads() == [], n.name
    for n in nodes:
        assert n.daemon_pid() != before[n.name], n.name
        assert n.status()["daemon"]["restarts"] == 0, "a planned restart is no crash"
        restarts = n.log_events("reconcile.restart")
        assert "addresses" in restarts[-1]["why"], n.name


def test_a_killed_daemon_says_daemon_crashed_with_its_own_last_lines(c: Cluster) -> None:
    """While a killed daemon waits for its restart, the node's DaemonReady reads
    DaemonCrashed with how it ended and the daemon's own last lines (not an unrelated
    line, not a bare Backoff), and then it runs again."""
    (node,) = form(c, 1, overrides={"daemon": {"backoff_initial_s": 5.0, "backoff_max_s": 5.0}})
    pid = node.daemon_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    c.wait(lambda: node.condition("DaemonReady")["reason"] == "DaemonCrashed", timeout=10)
    message = node.condition("DaemonReady")["message"]
    assert "SIGKILL" in message, message
    assert "last lines:" in message or "no output" in message, message
    c.wait(lambda: node.ready() and node.daemon_pid() not in (None, pid), timeout=30)
