"""Agents on NATS: nats-server's MQTT listener (3.1.1 only, retained messages in a
JetStream stream), alone (once per build of tests/nats_builds.py: Debian's 2.9.10 and
the upstream 2.14.0) and as a three-server JetStream cluster (Debian's build).

A real clique id holds a dot (`<uuid>.<clique>`) and so may a node name; NATS makes every
topic level a subject token, where a dot would split the level, so these tests use both
(the portable topics encode them). The agents are real `imexd run` processes with
simulated daemons (tests/cluster.py) told `[bus] protocol = "3.1.1"`; the control plane
is the `imexd` CLI with the same settings (`Cluster.control_env`). Every wait is bounded.

In the cluster test, nats-server 2.9.10 refuses new QoS 1 subscriptions (each a
JetStream consumer) for tens of seconds after a server died: the agents' bus and the
control plane's link ask again, then move to another server; the control plane's reads
and every agent filter but the members and workloads ones (whose order it judges by)
are QoS 0 (a plain NATS subscription, never refused that way); `until_ok` still backs
the one-shot CLI commands up. It takes 36 to 160 s (docs/performance.md).

`test_a_record_written_after_a_server_died_and_the_snapshots` needs no agents: it shows
what a server kill does to the other servers' retained snapshots on each build (2.14.0
leaves some without every record written since: docs/brokers.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imexd.control.link import Link
from imexd.errors import BusError
from imexd.settings import BusSettings
from imexd.topics import Topics
from tests import nats_builds
from tests.cluster import Cluster, Node, checked, members, pids, slot_of, untouched
from tests.nats_servers import Nats, NatsCluster, publish_retained, retained_copy

pytestmark = pytest.mark.slow

CLIQUE = "b3c1d2e4-0000-4000-8000-00000000beef.7"
"""A clique id as the driver reports it: the cluster UUID, a dot, the clique number."""
NAMES = ["n1", "n2.rack-a", "n3"]
"""The agents' node names: one holds a dot."""
TOPICS = Topics("imex/v2")
MEMBERS = TOPICS.members_filter("d1", CLIQUE)


@pytest.fixture(params=nats_builds.PARAMS)
def one(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """Agents on one nats-server (JetStream in tmp_path, so it survives a restart), once
    per build of tests/nats_builds.py (Debian's 2.9.10, the upstream 2.14.0)."""
    yield from checked(tmp_path, Nats(tmp_path / "nats", binary=request.param))


@pytest.fixture(params=nats_builds.CLUSTER_PARAMS)
def three(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """Agents on a cluster of three nats-servers (Debian's build; 2.14.0 too with
    `$IMEXD_TEST_NATS_CLUSTER_CURRENT` set: tests/nats_builds.py); each agent has all
    three URLs."""
    servers = NatsCluster(tmp_path / "nats", size=3, consumer_replicas=1, binary=request.param)
    yield from checked(tmp_path, servers)


KILL_RETRY_S = 20.0
"""How long a one-shot command is run again after a server of the cluster died: every
try asks each live server within its timeout (5 s a round trip), and on 2 cores both may
still refuse or time out for tens of seconds (nats-server 2.9.10)."""
RESYNC_S = 60.0
"""Bound for every agent to judge the domain UP again after a server kill: its link is
up on another server (`fail_over`), but UP also needs a synced snapshot, and nats-server
2.9.10 refuses the moved sessions' subscriptions for tens of seconds. On a loaded 2-core
machine (a full suite run) the fourth peer's record took over 30 s to reach every agent
after the second kill, and the three took over 30 s after the first; alone it takes a
few seconds."""
HEAL_S = 150.0
"""Bound for a restarted server to be current again (its JetStream consumers caught up)
before the next kill: under a full suite's load one consumer of 2.9.10 once stayed behind
past 30 s, and in another run the restarted server's `$MQTT_rmsgs` consumer was still not
current after 90 s (the test passed alone five times in six right after)."""


def until_ok(c: Cluster, *args: str, within: float) -> subprocess.CompletedProcess[str]:
    """`imexd ARGS`, run again while it fails, for at most `within` seconds.

    For a one-shot command right after a NATS server died: for tens of seconds (measured
    with nats-server 2.9.10) some QoS 1 subscriptions are refused (SUBACK 0x80) while
    JetStream places the consumer behind each one; the CLI asks again within its timeout
    and tries the next server, but every server may still refuse within that time.
    """
    deadline = time.monotonic() + within
    while True:
        done = c.imexd(*args)
        if done.returncode == 0 or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


def domain_up(c: Cluster, count: int, *, retry_s: float = 0.0) -> None:
    """`imexd domain status d1 --wait` says UP with `count` of `count` members ready."""
    up = until_ok(c, "domain", "status", "d1", "--wait", "30", within=retry_s)
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.startswith(f"domain d1: UP, {count} of {count} members ready"), up.stdout


def form(c: Cluster, names: list[str]) -> list[Node]:
    """Start idle agents `names` in the dotted clique, create d1 listing them through the
    CLI, and wait until every agent judges it UP and `domain status` says so."""
    nodes = [c.add(name, domain=None, clique=CLIQUE) for name in names]
    c.wait(c.all_ready, timeout=60)
    created = c.imexd("domain", "create", "d1", "--nodes", ",".join(names))
    assert created.returncode == 0, created.stdout + created.stderr
    # 60 s, not 30: on nats-server 2.14 a peer's record can arrive only through the
    # link's re-reads (issue 23: about 8 s for three idle agents); under the whole suite's
    # load it took more than 30 s in two of seven full runs. What each node saw is said.
    c.wait(
        lambda: all(n.up_with(len(nodes)) for n in nodes),
        timeout=60,
        what=f"UP with {len(nodes)} on every node",
    )
    assert [n.slot() for n in nodes] == list(range(len(nodes))), "list order is slot order"
    domain_up(c, len(nodes))
    return nodes


def member_records(c: Cluster) -> dict[str, dict[str, object]]:
    """Node name -> its retained member record, read through a new client."""
    with c.client() as client:
        snapshot = client.retained(MEMBERS)
    records = {}
    for topic, payload in snapshot.items():
        parsed = TOPICS.parse(topic)
        assert parsed is not None, topic
        records[parsed.node] = json.loads(payload)
    return records


def sees_members(c: Cluster, names: list[str]) -> bool:
    """Whether a new control-plane link reads exactly `names`' member records in the
    clique. The link has every server's URL: it asks again for a refused subscription,
    then tries the next server (nats-server 2.9.10 refuses some for a while after a
    server died); False when none granted it in time."""
    assert isinstance(c.broker, NatsCluster)
    settings = BusSettings(url=tuple(c.broker.urls), protocol=NatsCluster.protocol)

    async def read() -> list[str]:
        async with Link(settings) as link:
            store = await link.read(MEMBERS)
        return sorted(node for _, _, node in store.members)

    try:
        return asyncio.run(read()) == sorted(names)
    except BusError:
        return False


def broker_of(node: Node) -> str:
    """The URL of the broker the agent is connected to ("" while it is not)."""
    cond = node.condition("BusConnected")
    if cond.get("status") != "True":
        return ""
    return str(cond.get("message", "")).removeprefix("connected to ")


def server_with_agent(
    c: Cluster, servers: NatsCluster, nodes: list[Node], *, besides: Nats | None = None
) -> Nats:
    """A server (not `besides`) that one of `nodes` is connected and synced to."""
    found: list[Nats] = []

    def look() -> bool:
        used = {broker_of(n) for n in nodes}
        found[:] = [s for s in servers.servers if s is not besides and s.url in used]
        return bool(found)

    c.wait(look, timeout=30)
    return found[0]


def fail_over(c: Cluster, nodes: list[Node], dead: Nats) -> None:
    """Wait until every agent of `nodes` is connected to a server other than `dead` (synced
    comes later: `RESYNC_S`; an agent on a live server may have lost its link too,
    while JetStream moved its leaders). nats-server 2.9 recreates every JetStream
    consumer of every MQTT session that moves; on 2 busy cores its subscriptions are
    refused for tens of seconds before that settles (20 to 30 s is usual here),
    hence the wide bound."""
    c.wait(
        lambda: all(broker_of(n) not in ("", dead.url) for n in nodes),
        timeout=120,
        what=f"every agent on a server other than {dead.url}",
    )


@pytest.mark.timeout(240)  # form()'s bounded waits may take 60 s on 2.14
def test_a_dotted_clique_forms_takes_a_join_and_a_leave_on_nats(one: Cluster) -> None:
    """Three agents (one dotted name) form d1 in a dotted clique on 3.1.1; a fourth joins
    with a reload, not a restart; a leave clears its record and frees its slot."""
    c = one
    nodes = form(c, NAMES)
    for n in nodes:
        connects = n.log_events("bus_connected")
        assert connects[-1]["protocol"] == "3.1.1", (n.name, connects)
        assert n.log_events("bus_protocol_fallback") == [], n.name
        assert members(n) == {slot_of(m): m.address for m in nodes}, n.name
    assert sorted(member_records(c)) == sorted(NAMES)

    before = pids(nodes)
    n4 = c.add("n4.rack-b", domain=None, clique=CLIQUE)
    c.wait(n4.ready, timeout=30)
    created = c.imexd("domain", "create", "d1", "--nodes", ",".join([*NAMES, "n4.rack-b"]))
    assert created.returncode == 0, created.stdout + created.stderr
    c.wait(lambda: all(n.up_with(4) for n in [*nodes, n4]), timeout=30)
    domain_up(c, 4)
    assert untouched(nodes, before) == []
    for n in nodes:
        assert "ignored" not in n.reloads(), (n.name, n.signals())

    slot = slot_of(n4)
    assert n4.stop() == 0
    assert "n4.rack-b" not in member_records(c)
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in nodes))
    c.wait(lambda: all(n.up_with(3) for n in nodes))
    assert untouched(nodes, before) == []


@pytest.mark.timeout(240)  # form()'s bounded waits may take 60 s on 2.14
def test_a_crashed_node_is_dropped_after_the_will_delay_on_nats(one: Cluster) -> None:
    """SIGKILL on 3.1.1 (no Will Delay at the broker): the will, the node's presence
    marked lost, says hold_s = will_delay_s, so peers keep the node that long, then drop
    it."""
    c = one
    nodes = form(c, NAMES)
    victim, stay = nodes[1], [nodes[0], nodes[2]]
    slot = slot_of(victim)
    before = pids(stay)
    killed = time.monotonic()
    victim.crash()
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in stay), timeout=20)
    gone = time.monotonic() - killed
    will_delay = float(victim.sections["bus"]["will_delay_s"])
    assert gone >= 0.75 * will_delay, f"dropped after {gone:.1f} s, before the hold"
    presence = TOPICS.presence(victim.name)
    with c.client() as client:
        will = json.loads(client.retained(presence)[presence])
    assert (will["lost"], will["hold_s"]) == (True, will_delay), will
    c.wait(lambda: all(n.up_with(2) for n in stay))
    assert untouched(stay, before) == []


@pytest.mark.timeout(240)  # form()'s bounded waits may take 60 s on 2.14
def test_a_nats_restart_keeps_the_retained_state_and_the_daemons(one: Cluster) -> None:
    """nats-server stopped and started on the same store: the spec (which no agent
    republishes) and the member records are still there; no daemon restarts or reloads."""
    c = one
    nodes = form(c, NAMES)
    before = pids(nodes)
    hosts = {n.name: n.hosts_file.read_text() for n in nodes}
    signals = {n.name: n.signals() for n in nodes}
    c.broker.stop()
    c.wait(lambda: all(n.condition("BusConnected").get("status") == "False" for n in nodes))
    c.broker.start()
    c.wait(lambda: all(n.condition("BusConnected").get("status") == "True" for n in nodes))
    assert sorted(member_records(c)) == sorted(NAMES)
    domain_up(c, 3)
    assert untouched(nodes, before) == []
    assert {n.name: n.hosts_file.read_text() for n in nodes} == hosts
    for n in nodes:
        assert n.signals() == signals[n.name], n.name
        assert n.log_events("bus_connected")[-1]["reconnects"] >= 1, n.name


@pytest.mark.timeout(720)  # the waits below are bounded; this only backs them up
def test_agents_fail_over_across_a_nats_cluster(three: Cluster) -> None:
    """Three servers, agents with all three URLs: killing the server an agent is on, and
    later another, moves the agents over; the domain stays UP, the retained state is
    whole, no daemon restarts, and a spec change made between the kills reaches all."""
    c = three
    servers = c.broker
    assert isinstance(servers, NatsCluster)
    nodes = form(c, NAMES)
    idle = c.add("n4.rack-b", domain=None, clique=CLIQUE)
    c.wait(idle.ready, timeout=30)
    before = pids(nodes)

    first = server_with_agent(c, servers, nodes)
    first.kill()
    fail_over(c, [*nodes, idle], first)
    c.wait(lambda: all(n.up_with(3) for n in nodes), timeout=RESYNC_S)
    domain_up(c, 3, retry_s=KILL_RETRY_S)
    c.wait(lambda: sees_members(c, NAMES), timeout=30)
    assert untouched(nodes, before) == []

    # Back to three servers, then a spec change, then the next kill: only one server is
    # ever down (two of three would leave JetStream without a quorum).
    first.start()
    servers.wait_ready(time.monotonic() + HEAL_S)
    everyone = [*nodes, idle]
    names = [n.name for n in everyone]
    created = until_ok(c, "domain", "create", "d1", "--nodes", ",".join(names), within=30)
    assert created.returncode == 0, created.stdout + created.stderr
    second = server_with_agent(c, servers, nodes, besides=first)
    second.kill()
    fail_over(c, everyone, second)
    c.wait(lambda: all(n.up_with(4) for n in everyone), timeout=RESYNC_S)
    domain_up(c, 4, retry_s=KILL_RETRY_S)
    c.wait(lambda: sees_members(c, names), timeout=30)
    assert untouched(nodes, before) == []


FEED_S = 10.0
"""How long a record written after a server died may take to reach a live server's
snapshot: with its retained feed alive, well under a second here."""


def snapshots(servers: list[Nats], topic: str) -> dict[str, bytes | None]:
    """Per server, the retained copy of `topic` a new subscription through it gets."""
    return {s.name: asyncio.run(retained_copy(s, topic)) for s in servers}


def store_after_a_kill(live: list[Nats], topic: str, payload: bytes) -> None:
    """Publish a retained message through `live[0]` until the retained stream holds it
    (its last sequence grew): right after a kill a publish may time out, or be
    acknowledged while its store timed out (a leader moves)."""
    before = max(s.retained_stored() for s in live)
    deadline = time.monotonic() + RESYNC_S
    while True:
        with contextlib.suppress(BusError):
            asyncio.run(publish_retained(live[0], topic, payload, wait_s=5.0))
        stored = max(s.retained_stored() for s in live)
        if stored > before:
            return
        assert time.monotonic() < deadline, f"not stored: last sequence {stored}"
        time.sleep(1.0)


def serve_within(servers: list[Nats], topic: str, payload: bytes, within: float) -> bool:
    """Whether every server of `servers` serves `payload` on `topic` to a new subscription
    within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        if all(copy == payload for copy in snapshots(servers, topic).values()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("build", nats_builds.CLUSTER_PARAMS)
def test_a_record_written_after_a_server_died_and_the_snapshots(build: str, tmp_path: Path) -> None:
    """What docs/brokers.md says a server kill does to the retained snapshots, no agents
    involved. Each server fills its retained map from a `$MQTT_rmsgs` consumer: 2.9.10's
    is durable and replicated, so every live server serves a record written after the
    kill. From 2.10.11 on (nats-server commit f703123c4) it is ephemeral with one replica,
    placed on any server: killing the server that holds other servers' feeds leaves their
    snapshots without every record written since, until it is back. When this fails on
    2.14.0, nats-server keeps the feed: measure again and change docs/brokers.md."""
    servers = NatsCluster(tmp_path / "nats", size=3, consumer_replicas=1, binary=build)
    servers.start()
    try:
        feeds = {s.name: s.retained_feeds() for s in servers.servers}
        reader = {feed: name for name, (_, reads) in feeds.items() for feed in reads}
        hosts = {name: {reader.get(f, "?") for f in held} for name, (held, _) in feeds.items()}
        victim = next((s for s in servers.servers if hosts[s.name] - {s.name}), servers.servers[0])
        live = [s for s in servers.servers if s is not victim]
        victim.kill()
        topic, payload = "imexd-test/after-the-kill", secrets.token_hex(8).encode()
        store_after_a_kill(live, topic, payload)
        served = serve_within(live, topic, payload, FEED_S)
        if build == nats_builds.PARAMS[0].values[0]:  # Debian's 2.9.10
            assert served, snapshots(live, topic)
        elif not hosts[victim.name] - {victim.name}:
            pytest.skip(f"each server held its own retained feed this time: {hosts}")
        else:
            assert not served, f"2.14.0 kept its retained feeds ({hosts}): see the docstring"
            victim.start()
            assert serve_within(servers.servers, topic, payload, 30.0), snapshots(live, topic)
    finally:
        servers.kill()
