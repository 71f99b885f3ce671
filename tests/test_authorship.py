"""Each record has one author (issue 20, cases 2 and 3, and standing aside on evidence).

Real agents (tests/cluster.py) on a real Mosquitto: a record written over a live node's
own member topic is put back by that node within a round trip, not at the next periodic
re-read; a record of a node's name published live while its agent starts after a
hand-over is no second agent (the new agent resumes and adopts the daemon); a node
whose link was down past its will delay claims again when another node took its slot
meanwhile, instead of replaying its old record over the new holder. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from imexd.agent.run import EXIT_HANDOVER
from tests.cluster import Cluster, Node, formed, members, pids, slot_of, untouched
from tests.support import loopback_address

pytestmark = pytest.mark.slow

MEMBERS = "imex/v2/domains/d1/members/c1/"
PUT_BACK_S = 5.0
"""Far below the periodic re-read (`[bus] resync_interval_s`, 30 s +-25 %), far above a
round trip on a loaded machine."""


def retained_record(c: Cluster, node: str) -> dict[str, Any] | None:
    """The broker's retained member record of `node` (None: none)."""
    with c.client() as client:
        payload = client.retained(MEMBERS + node).get(MEMBERS + node)
    return None if payload is None else json.loads(payload)


def overwritten_total(node: Node) -> float:
    """imexd_record_overwritten_total of `node`, summed over its labels."""
    code, body = node.get("/metrics")
    assert code == 200, (code, body)
    assert isinstance(body, str), body
    return sum(
        sample.value
        for family in text_string_to_metric_families(body)
        if family.name == "imexd_record_overwritten"
        for sample in family.samples
        if sample.name == "imexd_record_overwritten_total"
    )


def test_a_record_written_over_a_live_nodes_topic_is_put_back_at_once(c: Cluster) -> None:
    """(2) n3's record with another address, published once on n3's topic: n3 puts its
    own back within a round trip, counts and logs it, and every peer maps n3's slot
    to n3 again; no daemon is restarted."""
    nodes = [c.add(f"n{i}") for i in (1, 2, 3)]
    formed(c, nodes)
    n3 = nodes[2]
    before = pids(nodes)
    own = retained_record(c, "n3")
    assert own is not None
    forged = {**own, "address": loopback_address()}
    with c.client() as client:
        client.publish(MEMBERS + "n3", json.dumps(forged).encode(), retain=True)
    injected = time.monotonic()
    try:
        c.wait(lambda: retained_record(c, "n3") == own, timeout=PUT_BACK_S)
    except AssertionError:
        pytest.fail(f"n3's record was not put back within {PUT_BACK_S} s")
    took = time.monotonic() - injected
    c.wait(lambda: all(n.hosts_slots().get(slot_of(n3)) == n3.address for n in nodes))
    # The metrics show the facts as last judged, at most REPORT_PACE_S after the count.
    c.wait(lambda: overwritten_total(n3) == 1, timeout=5, what="the overwrite counted")
    [event] = n3.log_events("membership.record_overwritten")
    assert forged["address"] in event["what"], event
    # Ours stands again: the condition says so; the count and the log keep the history.
    c.wait(
        lambda: n3.condition("SlotSettled").get("reason") == "Settled", what="SlotSettled: Settled"
    )
    assert n3.ready()
    assert untouched(nodes, before) == [], f"put back after {took:.1f} s"


def test_a_live_record_of_our_name_during_a_handover_is_no_second_agent(c: Cluster) -> None:
    """(stand aside on evidence) n1 hands over; while its successor reads the snapshot,
    a record of n1 with another address is published live once. One record is not a
    second agent: the successor resumes its slot, adopts the running daemon, puts its
    own record back, and reports no DuplicateNode."""
    n1 = c.add("n1", via_proxy=True)
    n2 = c.add("n2")
    nodes = [n1, n2]
    formed(c, nodes)
    assert n1.proxy is not None
    before = pids(nodes)
    slot = slot_of(n1)
    own = retained_record(c, "n1")
    assert own is not None
    n1.signal(signal.SIGUSR2)
    assert n1.wait_exit() == EXIT_HANDOVER
    connects = len(n1.log_events("bus_connected"))
    # The successor's snapshot comes 1 s late: the record below, published once its
    # SUBSCRIBE is on the broker, reaches it live, right after that snapshot.
    n1.proxy.delay(1.0, "down")
    n1.start()
    c.wait(lambda: len(n1.log_events("bus_connected")) > connects, timeout=15)
    time.sleep(0.2)
    forged = {**own, "address": loopback_address(), "incarnation": 99}
    with c.client() as client:
        client.publish(MEMBERS + "n1", json.dumps(forged).encode(), retain=True)
    n1.proxy.heal()
    problems = []
    try:
        c.wait(lambda: n1.ready() and n1.slot() == slot, timeout=20)
    except AssertionError:
        problems.append(f"n1 not back on slot {slot}: SlotSettled {n1.condition('SlotSettled')}")
    record = retained_record(c, "n1") or {}
    if record.get("address") != n1.address:
        problems.append(f"n1's record on the broker: {record}")
    if n1.condition("SlotSettled").get("reason") == "DuplicateNode":
        problems.append("the successor stood aside as DuplicateNode")
    if n1.daemon_starts() != 1:
        problems.append(f"n1's agents started {n1.daemon_starts()} daemons (1: the first run)")
    problems += untouched(nodes, before)
    assert problems == [], problems


def test_a_node_back_after_its_will_claims_again_and_leaves_the_new_holder_alone(
    c: Cluster,
) -> None:
    """(3) n3's link is cut past its will delay; n4 takes n3's freed slot meanwhile.
    When n3's link heals, n3 does not replay its old member record over n4: it claims
    again (another slot, its daemon restarted for it), and n4, n1, n2 keep their daemons."""
    n1, n2 = c.add("n1"), c.add("n2")
    n3 = c.add("n3", via_proxy=True)
    formed(c, [n1, n2, n3])
    assert n3.proxy is not None
    slot = slot_of(n3)
    n3.proxy.cut()
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in (n1, n2)), timeout=15)
    n4 = c.add("n4")
    c.wait(lambda: n4.ready() and n4.slot() == slot, timeout=30)
    c.wait(lambda: all(n.up_with(3) for n in (n1, n2, n4)), timeout=30)
    stayed = [n1, n2, n4]
    before = pids(stayed)
    n3.proxy.heal()
    problems = []
    try:
        c.wait(lambda: n3.ready() and n3.slot() not in (None, slot), timeout=30)
        c.wait(lambda: all(n.up_with(4) for n in [*stayed, n3]), timeout=30)
    except AssertionError:
        problems.append(f"n3 did not settle elsewhere: SlotSettled {n3.condition('SlotSettled')}")
    if n4.slot() != slot:
        problems.append(f"n4 moved from slot {slot} to {n4.slot()}")
    for n in stayed:
        if members(n).get(slot) != n4.address:
            problems.append(f"{n.name} maps slot {slot} to {members(n).get(slot)}")
    if not n3.log_events("membership.reclaim_after_reconnect"):
        problems.append("n3 logged no reclaim_after_reconnect")
    problems += untouched(stayed, before)
    assert problems == [], problems


def test_an_agent_that_stands_aside_reports_the_daemon_it_left_running(c: Cluster) -> None:
    """(stand aside on evidence, and tell the truth) n1's agent dies alone, its daemon
    runs on; a second agent named n1 (another address) takes the name meanwhile. n1's
    agent comes back, the broker hands its session back and forth: the evidence makes it
    stand aside, and /status reports its old daemon as running, unsupervised, with its
    pid (not STOPPED with none), and nothing stops that daemon."""
    n1, n2 = c.add("n1"), c.add("n2")
    formed(c, [n1, n2])
    pid = n1.daemon_pid()
    assert pid is not None
    n1.kill()
    other = c.add("n1", key="n1-other")
    c.wait(other.ready, timeout=30)
    n1.start()
    problems = []
    try:
        c.wait(lambda: n1.condition("SlotSettled").get("reason") == "DuplicateNode", timeout=20)
        c.wait(lambda: n1.condition("DaemonReady").get("reason") == "Unsupervised", timeout=15)
    except AssertionError:
        problems.append(
            f"n1: SlotSettled {n1.condition('SlotSettled')}, DaemonReady "
            f"{n1.condition('DaemonReady')}"
        )
    daemon = n1.status().get("daemon", {})
    if (daemon.get("state"), daemon.get("pid")) != ("RUNNING", pid):
        problems.append(f"n1's /status daemon: {daemon}, its daemon runs as pid {pid}")
    if pid not in n1.daemon_pids_on_host():
        problems.append(f"n1's daemon {pid} was stopped")
    n1.stop()
    for left in n1.daemon_pids_on_host():
        os.kill(left, signal.SIGKILL)  # unsupervised: nobody else ends it
    assert problems == [], problems
