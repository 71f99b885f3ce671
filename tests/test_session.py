"""Bus semantics of clustered brokers (issue 13) against a real Mosquitto: the resumed
MQTT 5 session, the lost tombstone and the peers' hold, the retained-wildcard check.

A link is cut without DISCONNECT by a fault proxy (tests/faultproxy.py); a broker that
keeps retained messages from wildcard subscriptions is the same proxy in front of a real
Mosquitto, with a rule that withholds them (`NoRetained`). Every wait is bounded;
loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiomqtt
import msgspec
import pytest

from imexd.bus.events import BrokerChecked, Connected, Disconnected, Event, Synced, WillSpec
from imexd.bus.link import Bus
from imexd.messages import Deleted, MemberRecord, MemberState, Received, to_builtins
from imexd.settings import BusSettings
from tests.brokers import Mosquitto
from tests.cluster import Cluster, Node, formed, members, pids, quiet, slot_of
from tests.faultproxy import FaultProxy, NoRetained
from tests.test_bus import MEMBERS, TOPICS, bus_for, fast_settings, next_event, no_event

DOMAIN, CLIQUE = "d1", ""
NODE = "n1"


def tombstone(node: str = NODE) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain=DOMAIN,
        clique=CLIQUE,
        address="127.0.0.1",
        slot=None,
        incarnation=1,
        state=MemberState.LOST,
        max_nodes=18,
        mode="names",
    )


def live(node: str = NODE, domain: str = DOMAIN) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain=domain,
        clique=CLIQUE,
        address="127.0.0.1",
        slot=0,
        incarnation=1,
        state=MemberState.MEMBER,
        max_nodes=18,
        mode="names",
    )


def will(node: str = NODE) -> WillSpec:
    return WillSpec(TOPICS.member(DOMAIN, CLIQUE, node), tombstone=tombstone(node))


class Watch:
    """The live member messages a plain observer gets straight from the broker, as
    decoded JSON (None for an empty payload); its own snapshot left out."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any] | None] = []
        self._changed = asyncio.Event()

    def add(self, payload: dict[str, Any] | None) -> None:
        self.seen.append(payload)
        self._changed.set()

    def states(self) -> list[str]:
        return [p["state"] if p is not None else "" for p in self.seen]

    def tombstone(self) -> dict[str, Any] | None:
        return next((p for p in self.seen if p is not None and p["state"] == "lost"), None)

    async def until(self, predicate: Callable[[], object], within: float) -> None:
        """Until `predicate()` holds, at most `within` seconds (AssertionError then)."""
        try:
            async with asyncio.timeout(within):
                while not predicate():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"not within {within} s; seen {self.states()}") from None


@contextlib.asynccontextmanager
async def watcher(port: int) -> AsyncIterator[Watch]:
    """A `Watch` of the member records of d1, straight from the broker on `port`."""
    watch = Watch()
    bus = bus_for(fast_settings(f"mqtt://127.0.0.1:{port}"), "watch")
    async with bus:
        await bus.subscribe(MEMBERS)
        await next_event(bus, Synced)

        async def collect() -> None:
            async for event in bus.events():
                if isinstance(event, Received) and not event.retained:
                    watch.add(to_builtins(event.payload))
                elif isinstance(event, Deleted) and not event.retained:
                    watch.add(None)

        task = asyncio.create_task(collect())
        try:
            yield watch
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def agent_bus(settings: BusSettings) -> Bus:
    """The agent's bus of n1 with its tombstone will, its record retained and synced."""
    bus = bus_for(settings, NODE, will=will())
    bus.start()
    await bus.subscribe(MEMBERS)
    await bus.retain(TOPICS.member(DOMAIN, CLIQUE, NODE), live())
    await next_event(bus, Synced)
    return bus


# Session resume (MQTT 5).


async def test_a_blip_within_the_will_delay_resumes_the_session_without_a_will(
    broker: Mosquitto,
) -> None:
    """A link cut without DISCONNECT and back within will_delay_s: the agent resumes its
    session (Clean Start off): what was published to its subscriptions meanwhile is
    delivered live after the reconnect, and the broker never publishes the will."""
    with FaultProxy("127.0.0.1", broker.port) as proxy:
        settings = fast_settings(proxy.url, will_delay_s=3.0, ping_interval_s=0.5)
        async with watcher(broker.port) as watch:
            bus = await agent_bus(settings)
            try:
                proxy.cut()
                lost = await next_event(bus, Disconnected)
                assert not lost.deliberate
                async with bus_for(fast_settings(broker.url), "n2") as peer:
                    await next_event(peer, Synced)
                    await peer.publish(TOPICS.member(DOMAIN, CLIQUE, "n2"), live("n2"))
                proxy.heal()
                up = await next_event(bus, Connected, within=5)
                assert up.protocol == "5"
                queued = await next_event(
                    bus, Received, lambda e: e.topic == TOPICS.member(DOMAIN, CLIQUE, "n2")
                )
                assert not queued.retained  # kept by the session, not from a snapshot
                await asyncio.sleep(settings.will_delay_s + 1.0)
            finally:
                await bus.close()
        assert "lost" not in watch.states()
        assert "" not in watch.states()


async def test_a_hang_up_before_connack_from_a_broker_that_took_mqtt_5_keeps_mqtt_5(
    broker: Mosquitto,
) -> None:
    """Seen in CI: while the link was cut, a reconnect reached something that accepted the
    socket and closed it before CONNACK (as a load balancer with no backend does). The
    agent took that for a broker refusing MQTT 5 and came back on 3.1.1, without the Will
    Delay. A broker that accepted MQTT 5 before is not taken to refuse it on a hang-up."""
    with FaultProxy("127.0.0.1", broker.port) as proxy:
        settings = fast_settings(proxy.url, will_delay_s=3.0, ping_interval_s=0.5)
        bus = await agent_bus(settings)
        try:
            proxy.hang_up(count=1)  # one reconnect hung up on after its CONNECT
            await next_event(bus, Disconnected)
            up = await next_event(bus, Connected, within=5)
            assert up.protocol == "5"
        finally:
            await bus.close()


async def test_a_filter_given_up_while_away_is_dropped_from_the_resumed_session(
    broker: Mosquitto,
) -> None:
    """A filter unsubscribed while the link was down is still in the broker's session:
    the resumed link unsubscribes it, so nothing published there reaches the agent."""
    other = TOPICS.members_filter("d2", CLIQUE)
    with FaultProxy("127.0.0.1", broker.port) as proxy:
        bus = await agent_bus(fast_settings(proxy.url, will_delay_s=5.0))
        try:
            await bus.subscribe(other)
            await next_event(bus, Synced)
            proxy.cut()
            await next_event(bus, Disconnected)
            await bus.unsubscribe(other)
            proxy.heal()
            await next_event(bus, Synced, within=5)
            async with bus_for(fast_settings(broker.url), "n2") as peer:
                await next_event(peer, Synced)
                await peer.publish(TOPICS.member("d2", CLIQUE, "n2"), live("n2", domain="d2"))
            await no_event(bus, Received, lambda e: "d2" in e.topic, 1.5)
        finally:
            await bus.close()


async def test_a_link_away_past_the_will_delay_leaves_a_tombstone_held_zero(
    broker: Mosquitto,
) -> None:
    """MQTT 5, away for longer than the Will Delay: the broker waited, so the tombstone
    (state lost, the node's identity, no slot) says hold_s 0."""
    with FaultProxy("127.0.0.1", broker.port) as proxy:
        settings = fast_settings(proxy.url, will_delay_s=1.0)
        async with watcher(broker.port) as watch:
            bus = await agent_bus(settings)
            try:
                proxy.cut()
                cut = time.monotonic()
                await watch.until(watch.tombstone, 5)
                waited = time.monotonic() - cut
            finally:
                proxy.heal()
                await bus.close()
        got = watch.tombstone()
        assert got is not None
        assert waited >= 0.8, waited
        assert got["hold_s"] == 0
        assert (got["node"], got["domain"], got["slot"], got["incarnation"]) == (
            NODE,
            DOMAIN,
            None,
            1,
        )


async def test_on_311_the_tombstone_comes_at_once_and_asks_peers_to_hold(
    broker: Mosquitto,
) -> None:
    """MQTT 3.1.1 has no Will Delay: the tombstone comes at once with hold_s =
    will_delay_s, and the agent's record comes back when its link does."""
    with FaultProxy("127.0.0.1", broker.port) as proxy:
        settings = fast_settings(proxy.url, will_delay_s=4.0, protocol="3.1.1")
        async with watcher(broker.port) as watch:
            bus = await agent_bus(settings)
            try:
                proxy.cut()
                cut = time.monotonic()
                await watch.until(watch.tombstone, 3)
                assert time.monotonic() - cut < 2.0
                proxy.heal()
                await watch.until(lambda: watch.states()[-1] == "member", 5)
            finally:
                await bus.close()
        got = watch.tombstone()
        assert got is not None
        assert got["hold_s"] == 4.0


async def test_broker_will_delay_false_makes_peers_hold_on_mqtt5(broker: Mosquitto) -> None:
    """`[bus] broker_will_delay = false`: an MQTT 5 broker is not trusted to delay the
    will, so the tombstone asks the peers to hold it for will_delay_s."""
    with FaultProxy("127.0.0.1", broker.port) as proxy:
        settings = fast_settings(proxy.url, will_delay_s=1.0, broker_will_delay=False)
        async with watcher(broker.port) as watch:
            bus = await agent_bus(settings)
            try:
                proxy.cut()
                await watch.until(watch.tombstone, 5)
            finally:
                proxy.heal()
                await bus.close()
        got = watch.tombstone()
        assert got is not None
        assert got["hold_s"] == 1.0


# The retained-wildcard check.


async def test_a_normal_broker_passes_the_retained_wildcard_check(broker: Mosquitto) -> None:
    """Mosquitto sends our record, flagged retained, to a new wildcard subscription."""
    bus = await agent_bus(fast_settings(broker.url))
    try:
        checked = await next_event(bus, BrokerChecked)
        assert checked.ok
        assert bus.retained_checked
        assert bus.no_retained_wildcard == ""
        assert bus.synced_at is not None
    finally:
        await bus.close()


class CountingBus(Bus):
    """The agent's bus, counting the retained copies the broker delivers, per topic."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copies: dict[str, int] = {}

    def _dispatch(self, topic: str, payload: bytes, *, retained: bool) -> None:
        if retained:
            self.copies[topic] = self.copies.get(topic, 0) + 1
        super()._dispatch(topic, payload, retained=retained)


PEERS = ("p1", "p2", "p3")


async def retain_peers(port: int) -> None:
    """The records of PEERS, retained on the broker (each acknowledged)."""
    async with aiomqtt.Client("127.0.0.1", port, identifier="peers") as c:
        for peer in PEERS:
            payload = msgspec.json.encode(live(peer))
            await c.publish(TOPICS.member(DOMAIN, CLIQUE, peer), payload, qos=1, retain=True)


async def test_the_retained_check_brings_back_our_record_alone(broker: Mosquitto) -> None:
    """The check's wildcard filter matches our own record only: the shard's other records
    come once, with the snapshot, and not once more for the check (k messages to each of
    k nodes in a formation); our record comes back flagged retained and is not delivered
    to the caller a second time."""
    await retain_peers(broker.port)
    bus = CountingBus(
        fast_settings(broker.url), node=NODE, client_id=f"imexd-{NODE}", will=will(), timeout_s=2.0
    )
    bus.start()
    try:
        await bus.subscribe(MEMBERS)
        await bus.retain(TOPICS.member(DOMAIN, CLIQUE, NODE), live())
        seen: list[object] = []
        checked = await next_event(bus, BrokerChecked, seen=seen)  # type: ignore[arg-type]
        assert checked.ok
        peers = {TOPICS.member(DOMAIN, CLIQUE, p): 1 for p in PEERS}
        own = TOPICS.member(DOMAIN, CLIQUE, NODE)
        assert {t: n for t, n in bus.copies.items() if t != own} == peers
        assert bus.copies.get(own) == 1
        ours = [e for e in seen if isinstance(e, Received) and e.topic == own and e.retained]
        assert ours == []
    finally:
        await bus.close()


async def test_a_broker_without_retained_wildcards_is_reported_and_never_synced_again(
    broker: Mosquitto,
) -> None:
    """A broker that keeps retained messages from wildcard subscriptions: once our record
    came back live, the check fails (BrokerChecked not ok, naming the broker), the bus
    is no longer synced, and on the next link no Synced comes while the check fails. It
    serves our record to a subscription of its own topic (as RabbitMQ's plugin does): the
    failure is BrokerNoRetainedWildcard, not BrokerRetainedNotServed."""
    withheld = NoRetained(wildcards_only=True)
    with FaultProxy(broker.host, broker.port, rule=withheld) as relay:
        bus = await agent_bus(fast_settings(relay.url))
        try:
            checked = await next_event(bus, BrokerChecked)
            assert not checked.ok
            assert relay.url in checked.detail
            assert bus.no_retained_wildcard == checked.detail
            assert "wildcard subscriptions" in checked.detail
            assert not bus.retained_not_served
            assert bus.synced_at is None
            assert withheld.dropped > 0
            bus._kill(bus._client, "test: drop the link")  # type: ignore[arg-type]
            await next_event(bus, Connected)
            again = await next_event(bus, BrokerChecked, within=5)
            assert not again.ok
            await no_event(bus, Synced, lambda _: True, 1.0)
            assert bus.synced_at is None
        finally:
            await bus.close()


NATS_LIKE = {"broker": "nats", "reconnect_initial_s": 0.5, "reconnect_max_s": 1.0}
"""A repaired link (`[bus] broker = "nats"`) with rechecks slow enough to steer."""


async def test_a_failed_check_is_asked_again_on_a_repaired_link(broker: Mosquitto) -> None:
    """Seen on a loaded nats-server 2.14 cluster (256 agents): one check's retained copy
    came after its round trip, the link judged BrokerNoRetainedWildcard, and the node never
    synced again on that link (its peers lacked it for good). On a repaired link a failed
    check is asked again, with backoff: once the broker delivers, the link passes and is
    synced without a reconnect."""
    withheld = NoRetained()
    with FaultProxy(broker.host, broker.port, rule=withheld) as relay:
        bus = await agent_bus(fast_settings(relay.url, **NATS_LIKE))
        try:
            checked = await next_event(bus, BrokerChecked)
            assert not checked.ok
            assert bus.synced_at is None
            withheld.dropping = False
            seen: list[Event] = []
            again = await next_event(bus, BrokerChecked, lambda e: e.ok, within=5, seen=seen)
            assert again.ok
            assert not [e for e in seen if isinstance(e, (Connected, Disconnected))]
            assert bus.no_retained_wildcard == ""
            assert bus.synced_at is not None
        finally:
            await bus.close()


async def test_a_repaired_link_whose_check_keeps_failing_moves_to_the_next_broker(
    broker: Mosquitto,
) -> None:
    """Seen on nats-server 2.14 after a server was killed under a formed domain: the server
    an agent moved to never served its retained record, and every check on that link
    failed (the node unready for good: that server's retained feed had died with the
    killed one, docs/brokers.md, which the failure's detail names). After the
    refused-subscription rule's retries (`refusal_waits`) the link is dropped for the next
    broker, and the check passes there."""
    withheld = NoRetained()
    with FaultProxy(broker.host, broker.port, rule=withheld) as relay:
        bus = await agent_bus(fast_settings(relay.url, broker.url, **NATS_LIKE))
        try:
            checked = await next_event(bus, BrokerChecked)
            assert not checked.ok
            assert relay.url in checked.detail
            assert "nor to one of its own topic" in checked.detail
            assert bus.retained_not_served
            down = await next_event(bus, Disconnected, within=10)
            assert down.broker == relay.url
            assert "dropping the link for the next broker" in down.reason
            up = await next_event(bus, Connected, within=10)
            assert up.broker == broker.url
            passed = await next_event(bus, BrokerChecked, within=10)
            assert passed.ok
            assert bus.no_retained_wildcard == ""
        finally:
            await bus.close()


async def test_a_failed_check_on_a_link_without_repairs_stands_until_the_next_connect(
    broker: Mosquitto,
) -> None:
    """Elsewhere (RabbitMQ's plugin fails every time) the check is not asked again on the
    link: one verdict, no link dropped for it."""
    withheld = NoRetained(wildcards_only=True)
    with FaultProxy(broker.host, broker.port, rule=withheld) as relay:
        bus = await agent_bus(fast_settings(relay.url, broker="mosquitto"))
        try:
            checked = await next_event(bus, BrokerChecked)
            assert not checked.ok
            assert not bus.retained_not_served
            withheld.dropping = False
            await no_event(bus, BrokerChecked, lambda _: True, 2.0)
            await no_event(bus, Disconnected, lambda _: True, 0.1)
            assert bus.synced_at is None
        finally:
            await bus.close()


# Agents on MQTT 3.1.1: the peers hold a lost node for will_delay_s.

HOLD_S = 4.0
ON_311 = {"bus": {"protocol": "3.1.1", "will_delay_s": HOLD_S}}


def cluster_member(node: Node) -> str:
    return TOPICS.member("d1", "c1", node.name)


def files(node: Node) -> tuple[str, str]:
    """The node's hosts file and IMEX nodes file, as the daemon reads them."""
    return node.hosts_file.read_text(), (node.run_dir / "nodes_config.cfg").read_text()


def form_311(c: Cluster, *, proxied: str = "") -> list[Node]:
    """Three agents on MQTT 3.1.1 (will_delay_s HOLD_S) formed into d1/c1, and quiet: a
    SIGUSR1 of the formation, paced by reload_min_interval_s, may still be on its way
    when the domain is up, so wait until no daemon got a signal for a while (`quiet`)."""
    nodes = [c.add(f"n{i}", overrides=ON_311, via_proxy=f"n{i}" == proxied) for i in (1, 2, 3)]
    formed(c, nodes)
    quiet(c, nodes)
    return nodes


@pytest.mark.slow
def test_on_311_a_killed_agent_is_held_by_its_peers_then_dropped_with_one_sigusr1(
    c: Cluster,
) -> None:
    """SIGKILL on 3.1.1: the broker publishes the will (the node's presence marked lost)
    at once; the peers keep the node's slot in their hosts and nodes files for
    will_delay_s, then drop it with one SIGUSR1 each, and their daemons keep running."""
    nodes = form_311(c)
    victim, stay = nodes[2], nodes[:2]
    slot = slot_of(victim)
    before = pids(stay)
    kept = {n.name: files(n) for n in stay}
    reloads = {n.name: len(n.reloads()) for n in stay}
    killed = time.monotonic()
    victim.crash()
    presence = TOPICS.presence(victim.name)
    with c.client() as client:
        c.wait(
            lambda: b'"lost":true' in client.retained(presence).get(presence, b""),
            timeout=3,
        )
        will = json.loads(client.retained(presence)[presence])
    assert (will["lost"], will["hold_s"]) == (True, HOLD_S)
    time.sleep(max(0.0, killed + HOLD_S - 1.0 - time.monotonic()))
    held = {n.name: files(n) for n in stay}
    assert held == kept, "a peer changed its files within the hold"
    c.wait(lambda: all(n.hosts_slots().get(slot, "") is None for n in stay), timeout=15)
    gone = time.monotonic() - killed
    assert gone >= HOLD_S - 0.5, f"dropped {gone:.1f} s after the kill, hold {HOLD_S} s"
    c.wait(lambda: all(len(n.reloads()) > reloads[n.name] for n in stay), timeout=10)
    time.sleep(2.0)
    assert {n.name: len(n.reloads()) - reloads[n.name] for n in stay} == {"n1": 1, "n2": 1}
    assert all(victim.address not in members(n).values() for n in stay)
    assert pids(stay) == before


@pytest.mark.slow
def test_on_311_a_link_blip_within_the_hold_changes_nothing_on_the_peers(c: Cluster) -> None:
    """n3's link is cut and back within will_delay_s on 3.1.1: its will came, but its
    record (of a later link) came back in time, so no peer sends SIGUSR1 or rewrites a
    file."""
    nodes = form_311(c, proxied="n3")
    victim, stay = nodes[2], nodes[:2]
    assert victim.proxy is not None
    kept = {n.name: files(n) for n in stay}
    signals = {n.name: n.signals() for n in stay}
    before = pids(nodes)
    with c.client() as watch:
        watch.record(cluster_member(victim))
        watch.record(TOPICS.presence(victim.name))
        victim.proxy.cut()
        c.wait(lambda: any(b'"lost":true' in p for _, p in watch.seen()), timeout=5)
        time.sleep(0.5)
        victim.proxy.heal()
        c.wait(lambda: victim.condition("BusConnected").get("status") == "True", timeout=10)
        time.sleep(HOLD_S + 1.0)
        seen = watch.seen()
    last = json.loads([p for t, p in seen if t == cluster_member(victim)][-1])
    assert last["state"] == "member"
    back = json.loads([p for t, p in seen if t == TOPICS.presence(victim.name)][-1])
    assert back["lost"] is False
    assert {n.name: files(n) for n in stay} == kept
    assert {n.name: n.signals() for n in stay} == signals
    assert pids(nodes) == before
    c.wait(lambda: all(n.up_with(3) for n in nodes), timeout=15)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("wildcards_only", "reason"),
    [(True, "BrokerNoRetainedWildcard"), (False, "BrokerRetainedNotServed")],
    ids=["rabbitmq-like", "nats-feed-lost"],
)
def test_an_agent_on_a_broker_without_retained_wildcards_says_so_and_never_settles(
    c: Cluster, wildcards_only: bool, reason: str
) -> None:
    """The agent's BusConnected is False naming the broker, with BrokerNoRetainedWildcard
    where the broker serves our record to a subscription of its own topic only (RabbitMQ's
    plugin) and BrokerRetainedNotServed where it serves it nowhere (a NATS server whose
    retained feed died); its slot never settles while that holds."""
    assert isinstance(c.broker, Mosquitto)
    withheld = NoRetained(wildcards_only=wildcards_only)
    with FaultProxy(c.broker.host, c.broker.port, rule=withheld) as relay:
        node = c.add("n1", bus_url=relay.url)
        c.wait(lambda: node.condition("BusConnected").get("reason") == reason, timeout=20)
        bus = node.condition("BusConnected")
        assert bus["status"] == "False"
        assert relay.url in bus["message"]
        time.sleep(2.0)
        assert node.condition("SlotSettled").get("status") != "True"
        assert node.condition("BusConnected").get("reason") == reason
        assert not node.ready()
        assert len(node.log_events("bus_broker_check_failed")) == 1
        node.stop()
