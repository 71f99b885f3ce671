"""Network faults between real agents and a real Mosquitto (issue 9's fault injection).

One node's bus link goes through a fault proxy (tests/faultproxy.py) that delays, drops
(silent partition) or cuts it; one scenario uses real network namespaces and a veth cut
where the test runs as root. Every wait is bounded; timings are imexd.demo.timings.FAST
(keepalive 5 s, will delay 2 s, ping every 1 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from imexd.demo.brokers import free_port
from imexd.demo.timings import FAST
from tests.brokers import Mosquitto
from tests.cluster import Cluster, Node, formed, members, pids, slot_of, untouched
from tests.support import IMEXD, during

pytestmark = pytest.mark.slow

MEMBERS = "imex/v2/domains/d1/members/c1/"


def last_protocol(node: Node) -> str | None:
    events = node.log_events("bus_connected")
    return events[-1].get("protocol") if events else None


# A partition longer than the keepalive, then heal.


def test_a_partition_longer_than_keepalive_heals_without_restarts(c: Cluster) -> None:
    """n3's link is silently dropped past keepalive + will delay, then healed.

    Peers drop n3 (its will fired), take it back at heal without restarting anything;
    n3 keeps its slot and daemon, says its domain view is stale while cut off (not UP),
    and is back on MQTT 5 (a connect that timed out in the partition is no reason to
    fall back to 3.1.1).
    """
    n1, n2 = c.add("n1"), c.add("n2")
    n3 = c.add("n3", via_proxy=True)
    nodes, peers = [n1, n2, n3], [n1, n2]
    formed(c, nodes)
    assert n3.proxy is not None
    slot = slot_of(n3)
    before = pids(nodes)
    assert last_protocol(n3) == "5"
    n3.proxy.drop()
    dropped = time.monotonic()
    c.wait(lambda: n3.condition("BusConnected").get("status") == "False", timeout=10)
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in peers), timeout=25)
    gone = time.monotonic() - dropped
    keepalive = FAST["bus"]["keepalive_s"]
    assert gone >= keepalive, f"peers dropped n3 {gone:.1f} s into the partition"
    problems = []
    view = n3.domain_view().get("status")
    up = n3.condition("DomainUp")
    if view == "UP" or (up.get("status"), up.get("reason")) != ("Unknown", "BusDown"):
        problems.append(f"n3 cut off from the bus: domain_view {view}, DomainUp {up}")
    # Heal while a reconnect attempt of n3 is in flight (connects time out after 10 s).
    time.sleep(max(0.0, dropped + 16 - time.monotonic()))
    n3.proxy.heal()
    healed = time.monotonic()
    c.wait(lambda: all(n.up_with(3) for n in nodes), timeout=30)
    recovered = time.monotonic() - healed
    assert n3.slot() == slot
    assert all(members(n) == members(n1) for n in nodes)
    problems += untouched(nodes, before)
    if last_protocol(n3) != "5":
        problems.append(f"n3 reconnected with MQTT {last_protocol(n3)} after the partition")
    assert problems == [], f"recovered {recovered:.1f} s after heal; " + "; ".join(problems)


# Delayed delivery while a domain forms.


def test_a_delayed_link_while_four_agents_form_never_doubles_a_slot(c: Cluster) -> None:
    """n1's records reach the broker 1 s late while n1..n4 start at once.

    The broker's own order never shows two `member` records on one slot, the slots are
    distinct and mapped alike, and each node's daemon starts once.
    """
    with c.client() as watch:
        watch.record(MEMBERS + "+")
        n1 = c.add("n1", via_proxy=True, start=False)
        assert n1.proxy is not None
        n1.proxy.delay(1.0, "up")
        nodes = [n1, *(c.add(f"n{i}", start=False) for i in (2, 3, 4))]
        for n in nodes:
            n.start()
        formed(c, nodes)
        stream = watch.seen()
    records: dict[str, dict[str, Any]] = {}
    doubled = []
    for topic, payload in stream:
        node = topic.rsplit("/", 1)[1]
        if not payload:
            records.pop(node, None)
            continue
        records[node] = json.loads(payload)
        holders: dict[int, list[str]] = {}
        for name, r in records.items():
            if r.get("state") == "member":
                holders.setdefault(r["slot"], []).append(name)
        doubled += [f"slot {s}: {h}" for s, h in holders.items() if len(h) > 1]
    assert doubled == [], doubled
    slots = {n.name: slot_of(n) for n in nodes}
    assert sorted(slots.values()) == [0, 1, 2, 3], slots
    for n in nodes:
        assert members(n) == {slots[m.name]: m.address for m in nodes}, n.name
        assert n.daemon_starts() == 1, n.name
        assert n.status()["daemon"]["restarts"] == 0, n.name


# Two agents with one node name.


def identity(record: bytes) -> tuple[object, ...]:
    """Who a member record says holds which slot; its version (link, seq) moves with
    every reconnect of its writer, by design."""
    fields = json.loads(record)
    return tuple(fields.get(k) for k in ("node", "address", "slot", "state", "settled"))


def test_a_duplicate_node_name_runs_nothing_and_leaves_the_first_alone(c: Cluster) -> None:
    """A second `n1` (own state dir and address) reports DuplicateNode and runs nothing.

    The first n1 stays ready with the same daemon and record; its peer keeps mapping the
    first's address; the second's SIGTERM does not clear the first one's record.
    """
    n1, n2 = c.add("n1"), c.add("n2")
    formed(c, [n1, n2])
    slot = slot_of(n1)
    before = pids([n1, n2])
    with c.client() as client:
        record = client.retained(MEMBERS + "n1")[MEMBERS + "n1"]
    dup = c.add("n1", key="n1-dup")

    def disturbed() -> str | None:
        # The second's first connect takes the broker session from the first once (the
        # client id is the node's): a readiness blip of its bus link, nothing more.
        if n1.condition("SlotSettled").get("status") != "True":
            return "the first n1 lost its slot"
        if n1.daemon_pid() != before["n1"]:
            return f"the first n1's daemon pid is {n1.daemon_pid()}"
        if n2.hosts_slots().get(slot) != n1.address:
            return f"n2 maps slot {slot} to {n2.hosts_slots().get(slot)}"
        return None

    def duplicate() -> bool:
        conds = dup.status().get("conditions", [])
        return any(cond.get("reason") == "DuplicateNode" for cond in conds)

    problems = during(8.0, disturbed)
    if not duplicate():
        conds = [
            (x.get("type"), x.get("status"), x.get("reason"))
            for x in dup.status().get("conditions", [])
        ]
        problems.append(f"the second n1 reports no DuplicateNode: {conds}")
    if dup.get("/readyz")[0] != 503:
        problems.append(f"the second n1's /readyz says {dup.get('/readyz')[0]}")
    if dup.daemon_starts() or dup.daemon_pids_on_host():
        problems.append(f"the second n1 started {dup.daemon_starts()} daemon(s)")
    if dup.alive():
        dup.stop()
    time.sleep(FAST["bus"]["will_delay_s"] + 1.0)  # a will of the second would fire by now
    with c.client() as client:
        after = client.retained(MEMBERS + "n1").get(MEMBERS + "n1")
    if after is None or identity(after) != identity(record):
        problems.append(f"the first n1's record changed: {record!r} -> {after!r}")
    problems += [p for p in [disturbed()] if p]
    c.wait(n1.ready, timeout=10)
    problems += untouched([n1, n2], before)
    assert problems == [], problems


# A broker restart without persistence.


def domain_status(c: Cluster) -> subprocess.Popen[str]:
    """`imexd domain status d1 --wait 0 --nodes n1,n2,n3` as the control plane, started.

    The domain has no spec: `--nodes` tells the control plane which nodes it must have,
    without it the status stays UNKNOWN (NoSpec).
    """
    env = c.control_env()
    return subprocess.Popen(
        [IMEXD, "domain", "status", "d1", "--wait", "0", "--nodes", "n1,n2,n3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def headline(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """The exit status and first line of a `domain status` run."""
    out, err = proc.communicate(timeout=30)
    return proc.returncode, (out.splitlines()[0] if out else err.strip())


def test_a_broker_restart_never_shows_up_on_a_partial_view(c: Cluster) -> None:
    """After a restart that lost every record, `domain status` is UP only with all three.

    n3's link holds everything it sends for the first 2 s, so its records come back
    last, within the peers' grace for records missing after a restart (reconnect_max_s
    + 2 s); meanwhile the view is partial and must not be judged UP. `domain status`
    runs every 0.4 s (overlapping) for 4 s. No daemon restarts.
    """
    n1, n2 = c.add("n1"), c.add("n2")
    n3 = c.add("n3", via_proxy=True)
    nodes = [n1, n2, n3]
    formed(c, nodes)
    before = pids(nodes)
    assert n3.proxy is not None
    n3.proxy.drop("up")
    c.broker.stop()
    c.broker.start()
    restarted = time.monotonic()
    runs = []
    while time.monotonic() - restarted < 4.0:
        runs.append(domain_status(c))
        time.sleep(0.4)
        if time.monotonic() - restarted >= 2.0:
            n3.proxy.heal()
    samples = [headline(proc) for proc in runs]
    lies = [
        f"exit {code}: {line}"
        for code, line in samples
        if (code == 0 or line.startswith("domain d1: UP"))
        and not line.startswith("domain d1: UP, 3 of 3")
    ]
    c.wait(lambda: all(n.up_with(3) for n in nodes), timeout=30)
    c.wait(lambda: headline(domain_status(c))[0] == 0, timeout=20)
    problems = [f"UP on a partial view: {lie}" for lie in lies] + untouched(nodes, before)
    assert problems == [], f"samples {samples}; " + "; ".join(problems)


# Network namespaces: a veth cut.


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _netns_works() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    probe = f"imexd-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns does not work here: {exc}"
    return None


class Net:
    """A bridge on the host side and one namespace per agent, joined by veth pairs."""

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.bridge = f"imxbr{tag}"
        self.subnet = f"10.213.{os.getpid() % 250}"
        self.host_ip = f"{self.subnet}.1"
        self.spaces: dict[str, tuple[str, str]] = {}
        """name -> (namespace, host-side veth)."""
        self._tag = tag
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def space(self, name: str, index: int) -> tuple[str, str]:
        """A namespace for `name` at .{index+2}: (namespace, its address)."""
        ns = f"imx{self._tag}{name}"
        veth = f"imxv{self._tag}{name}"
        address = f"{self.subnet}.{index + 2}"
        _ip("netns", "add", ns)
        self.spaces[name] = (ns, veth)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns, address

    def link(self, name: str, *, up: bool) -> None:
        _ip("link", "set", self.spaces[name][1], "up" if up else "down")

    def close(self) -> None:
        for ns, veth in self.spaces.values():
            subprocess.run(
                ["ip", "link", "del", veth], check=False, capture_output=True, timeout=10
            )
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=10)
        subprocess.run(
            ["ip", "link", "del", self.bridge], check=False, capture_output=True, timeout=10
        )


def test_a_veth_cut_between_namespaces_heals_without_restarts(tmp_path: Path) -> None:
    """Two agents in their own namespaces; one veth goes down past keepalive, then up."""
    why = _netns_works()
    if why is not None:
        pytest.skip(why)
    net = Net()
    cluster: Cluster | None = None
    try:
        port = free_port(net.host_ip)
        broker = Mosquitto(tmp_path / "broker", extra_config=f"listener {port} {net.host_ip}")
        broker.start()
        cluster = Cluster(tmp_path, broker=broker)
        url = f"mqtt://{net.host_ip}:{port}"
        nodes = []
        for i, name in enumerate(["na", "nb"]):
            ns, address = net.space(name, i)
            nodes.append(cluster.add(name, netns=ns, address=address, bus_url=url))
        na, nb = nodes
        formed(cluster, nodes)
        slot = slot_of(na)
        before = pids(nodes)
        net.link("na", up=False)
        cut = time.monotonic()
        cluster.wait(lambda: nb.hosts_slots().get(slot, "") is None, timeout=25)
        assert time.monotonic() - cut >= FAST["bus"]["keepalive_s"]
        net.link("na", up=True)
        cluster.wait(lambda: all(n.up_with(2) for n in nodes), timeout=40)
        assert na.slot() == slot
        assert untouched(nodes, before) == []
    finally:
        if cluster is not None:
            for name in net.spaces:
                net.link(name, up=True)
            cluster.close()
        net.close()
    assert cluster.forced == []
    for n in cluster.nodes.values():
        assert n.log_problems() == [], n.name


# A FATAL daemon with a standby node waiting (issue 9, defect 12).


def test_a_fatal_daemon_releases_its_slot_to_a_waiting_standby(c: Cluster) -> None:
    """One slot: n1's daemon never starts (FATAL), n2 waits; after release_after_s n2 runs.

    n1 gives its slot up (Released, record `standby`) instead of holding it forever, and
    does not take it back while n2 holds it.
    """
    one_slot: dict[str, dict[str, Any]] = {"domain": {"max_nodes": 1, "claim_stale_s": 2.0}}
    broken: dict[str, dict[str, Any]] = {
        **one_slot,
        "daemon": {"release_after_s": 2.0},
        "imex": {"env": {"IMEXD_SIM_EXIT_AFTER_S": "0.05", "IMEXD_SIM_EXIT_CODE": "3"}},
    }
    n1 = c.add("n1", overrides=broken)
    c.wait(lambda: n1.status().get("daemon", {}).get("state") == "FATAL", timeout=40)
    assert slot_of(n1) == 0
    n2 = c.add("n2", overrides=one_slot)
    c.wait(n2.ready, timeout=40)
    assert slot_of(n2) == 0
    c.wait(lambda: n1.condition("SlotSettled").get("reason") in ("Released", "DomainFull"))
    with c.client() as client:
        record = json.loads(client.retained(MEMBERS + "n1")[MEMBERS + "n1"])
    assert record["state"] == "standby", record
    assert n1.status()["daemon"]["state"] != "RUNNING"
    time.sleep(3.0)  # past n1's latch: it must not take the slot back from n2
    assert n2.ready()
    assert slot_of(n2) == 0
    assert n1.condition("SlotSettled").get("status") == "False"
