"""Lost and stale updates of retained topics, and the bus's periodic re-read that repairs
them (`[bus] resync_interval_s`).

On a three-server nats-server 2.9.10 cluster, a subscriber that subscribes while a
record is being updated through another server gets the live updates first and then the
server's own, older retained copy, flagged retained (measured with plain clients: 8 of 8
rounds when 20 other clients subscribe at the same time); a view applied in arrival order
ends on the stale copy. The bus drops a retained copy that comes after a live message on
its topic, and re-reads its filters periodically. The re-read's rules are checked on a
real Mosquitto by putting a wrong view into the bus through its message path, as a lost
update leaves it. The control plane's link drops stale copies the same way. And a link
check that a busy event loop must not fail: the ping's deadline grows by the loop's own
lateness. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import imexd.bus.repairs
import imexd.bus.waits
from imexd.bus.events import Disconnected, Event, Synced
from imexd.bus.link import Bus
from imexd.bus.mqtt import Client, connect
from imexd.bus.repairs import RESYNC_SETTLE_S, SUBSCRIBE_RETRIES, refusal_waits
from imexd.control.link import Link
from imexd.errors import BusError
from imexd.messages import Deleted, MemberRecord, MemberState, Received, encode
from imexd.settings import BusSettings, parse_broker_url
from imexd.topics import Topics
from tests.brokers import Mosquitto
from tests.cluster import Cluster, pids, quiet, untouched
from tests.faultproxy import FaultProxy, NoRetained
from tests.nats_servers import NatsCluster, find_nats_server
from tests.support import until
from tests.test_bus import fast_settings

TOPICS = Topics("imex/v2")
CLIQUE = "b3c1d2e4-0000-4000-8000-00000000beef.7"
FILTER = TOPICS.members_filter("d1", CLIQUE)


def record(
    node: str, slot: int, state: MemberState = MemberState.CLAIMING, *, seq: int = 0
) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain="d1",
        clique=CLIQUE,
        address="127.0.0.1",
        slot=slot,
        incarnation=1,
        state=state,
        max_nodes=18,
        mode="names",
        seq=seq,
    )


def topic(node: str) -> str:
    return TOPICS.member("d1", CLIQUE, node)


def settings(*urls: str, **overrides: object) -> BusSettings:
    """`fast_settings` with the broker repairs engaged on every link (`[bus] broker =
    "nats"`), so that Mosquitto can stand in for the broker that needs them, and no
    periodic re-read unless a test asks for one."""
    return fast_settings(*urls, **{"resync_interval_s": 0.0, "broker": "nats", **overrides})


class View:
    """What a consumer of the bus holds per topic, applying events in order (as the
    shard does), and every event it got."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.records: dict[str, bytes] = {}
        self.events: list[Event] = []
        self.synced = asyncio.Event()
        self.changed = asyncio.Event()
        self._task = asyncio.create_task(self._read(), name="view")

    async def _read(self) -> None:
        async for event in self.bus.events():
            self.events.append(event)
            if isinstance(event, Received):
                self.records[event.topic] = encode(event.payload)
            elif isinstance(event, Deleted):
                self.records.pop(event.topic, None)
            elif isinstance(event, Synced):
                self.synced.set()
            self.changed.set()

    async def until(self, wanted: dict[str, bytes], within: float) -> None:
        """Wait until the view is exactly `wanted` (AssertionError after `within` s)."""
        try:
            async with asyncio.timeout(within):
                while self.records != wanted:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"the view is {self.records}, not {wanted}") from None

    def stop(self) -> None:
        self._task.cancel()


async def client_of(url: str, attempts: int = 3) -> Client:
    """A plain clean-session 3.1.1 client (a peer that writes records).

    A NATS 2.9 server under a burst of new MQTT sessions sometimes hangs up before CONNACK
    (seen in CI at the 21st connect of a round): the peers here are the test's load, not its
    subject, so a refused connect is tried again, `attempts` times at most."""
    s = BusSettings(url=(url,), protocol="3.1.1")
    for attempt in range(1, attempts):
        with contextlib.suppress(BusError):
            return await connect_peer(s, url)
        await asyncio.sleep(0.5 * attempt)
    return await connect_peer(s, url)


PEER_TIMEOUT_S = 30.0
"""A peer's round trips (PUBACK of a retained write): a NATS 2.9 cluster under the full
suite's load once took longer than 10 s to store one (a CI-like run)."""


async def connect_peer(s: BusSettings, url: str) -> Client:
    return await connect(
        s, parse_broker_url(url), client_id=f"peer-{secrets.token_hex(4)}", timeout_s=PEER_TIMEOUT_S
    )


def test_both_links_ask_again_for_a_refused_subscription_by_one_rule() -> None:
    """A refusal is asked for again only on a repaired link (elsewhere it is an ACL's),
    SUBSCRIBE_RETRIES times, each wait in [d/2, d] with d doubling up to the largest."""
    assert refusal_waits(False, 0.25, 2.0, lambda: 1.0) == []
    assert refusal_waits(True, 0.25, 2.0, lambda: 1.0)[:3] == [0.25, 0.5, 1.0]
    assert len(refusal_waits(True, 0.25, 2.0, lambda: 0.0)) == SUBSCRIBE_RETRIES
    assert refusal_waits(True, 0.5, 0.6, lambda: 0.0) == [0.25, 0.3, 0.3]


async def test_a_retained_copy_after_a_live_update_of_its_topic_is_dropped(
    broker: Mosquitto,
) -> None:
    """A retained copy that arrives after a live message on the same topic (NATS 2.9's
    order for a new subscription) is older than it: the bus drops and counts it, so the
    view keeps the live record."""
    async with Bus(settings(broker.url), node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        async with asyncio.timeout(5):
            await view.synced.wait()
        newer, older = encode(record("n2", 4)), encode(record("n2", 3))
        # What the broker's link delivers, in NATS's order: live first, stale copy after.
        bus._dispatch(topic("n2"), newer, retained=False)
        bus._dispatch(topic("n2"), older, retained=True)
        await asyncio.sleep(0.1)
        assert view.records == {topic("n2"): newer}
        assert bus.stale_retained == 1
        view.stop()


async def test_a_reread_corrects_a_view_that_lost_updates_and_emits_nothing_else(
    broker: Mosquitto,
) -> None:
    """The periodic re-read subscribes again and compares the broker's snapshot with what
    the bus delivered: a record it holds stale comes out again as the broker has it, one
    the broker no longer holds as a deletion, one it never delivered as a record; records
    it holds right come out no second time, and a second re-read changes nothing."""
    peer = await client_of(broker.url)
    current = {topic("n2"): encode(record("n2", 4, MemberState.MEMBER))}
    current[topic("n3")] = encode(record("n3", 1, MemberState.MEMBER))
    for t, payload in current.items():
        await peer.publish(t, payload, retain=True)
    s = settings(broker.url, resync_interval_s=0.4)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        await view.until(current, within=5)
        # The view lost updates leave: n2's older claim, n4 (whose clear was lost), and
        # n3 gone (a clear that the broker did not keep).
        bus._dispatch(topic("n2"), encode(record("n2", 3)), retained=True)
        bus._dispatch(topic("n4"), encode(record("n4", 2)), retained=True)
        bus._dispatch(topic("n3"), b"", retained=True)
        await until(lambda: bus.resync_corrections >= 3, within=10)
        await view.until(current, within=5)
        corrected = bus.resync_corrections
        assert corrected == 3
        deleted = [e.topic for e in view.events if isinstance(e, Deleted)]
        assert deleted == [topic("n3"), topic("n4")], "the injected clear, then n4's"
        before = len(view.events)
        wanted = bus.resyncs + 2
        await until(lambda: bus.resyncs >= wanted, within=10)
        assert view.records == current
        assert bus.resync_corrections == corrected, "a later re-read corrected again"
        later = [e for e in view.events[before:] if isinstance(e, Received | Deleted)]
        assert later == [], "a re-read emitted records the view already held"
        view.stop()
    await peer.close(2.0)


async def test_an_empty_reread_deletes_nothing(broker: Mosquitto) -> None:
    """A re-read whose snapshot is empty while the bus holds records (a broker that does
    not send retained messages again for a SUBSCRIBE of an existing filter) deletes none
    of them: it says nothing about the records, where deletions would flap the shard."""
    s = settings(broker.url, resync_interval_s=0.3)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        async with asyncio.timeout(5):
            await view.synced.wait()
        held = {topic(n): encode(record(n, i)) for i, n in enumerate(["n2", "n4"])}
        for t, payload in held.items():
            bus._dispatch(t, payload, retained=True)  # records the broker does not hold
        wanted = bus.resyncs + 2
        await until(lambda: bus.resyncs >= wanted, within=10)
        assert view.records == held
        assert bus.resync_corrections == 0
        view.stop()


async def test_a_reread_publishes_our_own_record_again_when_the_broker_lost_it(
    broker: Mosquitto,
) -> None:
    """Our own retained record, cleared on the broker behind our back, is published again
    (put back at once on the live clear, or by the next re-read); the peers then see it
    again."""
    s = settings(broker.url, resync_interval_s=0.4)
    mine = record("n1", 0, MemberState.MEMBER)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        await bus.retain(topic("n1"), mine)
        await view.until({topic("n1"): encode(mine)}, within=5)
        peer = await client_of(broker.url)
        await peer.publish(topic("n1"), b"", retain=True)
        await peer.close(2.0)
        await until(lambda: bus.resync_corrections + bus.put_back >= 1, within=10)
        await view.until({topic("n1"): encode(mine)}, within=10)
        assert any(isinstance(e, Deleted) and e.topic == topic("n1") for e in view.events)
        view.stop()


async def test_the_control_link_drops_a_retained_copy_after_a_live_update(
    broker: Mosquitto,
) -> None:
    """The control plane's link keeps the live record when the older retained copy of its
    topic comes after it (NATS 2.9's order), and counts the copy."""
    async with Link(settings(broker.url)) as link:
        store = await link.read(FILTER)
        newer, older = record("n2", 4), record("n2", 3)
        link._on_message(topic("n2"), encode(newer), retained=False, expiry_s=None)
        link._on_message(topic("n2"), encode(older), retained=True, expiry_s=None)
        assert store.members[("d1", CLIQUE, "n2")] == newer
        assert link.stale_retained == 1


async def test_a_busy_event_loop_does_not_end_a_link_that_works(broker: Mosquitto) -> None:
    """This process's own event loop is blocked for longer than the ping timeout while
    the echo is on its way (the link delays it 0.3 s): the echo, read late, still proves
    the link (no Disconnected), where a deadline in wall-clock time would end it."""
    with FaultProxy(broker.host, broker.port) as proxy:
        s = settings(proxy.url)
        async with Bus(
            s, node="n1", client_id="imexd-n1", timeout_s=5.0, ping_timeout_s=0.5
        ) as bus:
            view = View(bus)
            async with asyncio.timeout(5):
                await view.synced.wait()
            proxy.delay(0.3, "down")
            asyncio.get_running_loop().call_later(0.05, time.sleep, 1.2)  # a busy loop
            assert await bus.barrier()
            assert bus.connected
            assert not [e for e in view.events if isinstance(e, Disconnected)]
            view.stop()


@pytest.fixture
def nats3(tmp_path: Path) -> Iterator[NatsCluster]:
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server)")
    servers = NatsCluster(
        tmp_path / "nats", size=3, consumer_replicas=1
    )  # as docs/brokers.md recommends
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_subscriber_on_another_nats_server_ends_on_the_last_update(
    nats3: NatsCluster,
) -> None:
    """Four updates of one retained member topic through server 1 (QoS 1), published
    while a bus on server 2 subscribes among 20 other new subscriptions: what the bus's
    view holds in the end is the last update, in every round."""
    first, second = nats3.servers[0], nats3.servers[1]
    peer = await client_of(first.url)
    try:
        for round_ in range(3):
            node = f"p{round_}"
            await peer.publish(topic(node), encode(record(node, 0)), retain=True)
            others = [await client_of(second.url) for _ in range(20)]
            s = settings(second.url, protocol="3.1.1", resync_interval_s=1.0)
            async with Bus(s, node="n1", client_id=f"imexd-n1-{round_}", timeout_s=10.0) as bus:
                view = View(bus)
                async with asyncio.timeout(30):
                    await view.synced.wait()  # the link is up: the SUBSCRIBE goes out now

                async def updates(node: str = node) -> None:
                    for slot in range(1, 5):
                        await peer.publish(topic(node), encode(record(node, slot)), retain=True)
                        await asyncio.sleep(0.05)

                busy = [o.subscribe([f"imex/v2/load/{i}/+"]) for i, o in enumerate(others)]
                await asyncio.gather(bus.subscribe(FILTER), updates(), *busy)
                wanted = {topic(f"p{i}"): encode(record(f"p{i}", 4)) for i in range(round_ + 1)}
                await view.until(wanted, within=30)
                view.stop()
            for other in others:
                await other.close(2.0)
    finally:
        await peer.close(2.0)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_reread_follows_each_burst_of_changes_on_a_repaired_link(
    broker: Mosquitto, protocol: str
) -> None:
    """Seen on a three-server NATS cluster at 64 nodes: a peer's member record lost during
    a formation stayed lost until the periodic re-read, up to `resync_interval_s` (30 s)
    later. On a repaired link, whatever its protocol, a re-read also follows each burst
    of changes, RESYNC_SETTLE_S after its last live message, and
    corrects it; without a change since the last re-read there is none."""
    peer = await client_of(broker.url)
    current = {topic("n2"): encode(record("n2", 4, MemberState.MEMBER))}
    await peer.publish(topic("n2"), current[topic("n2")], retain=True)
    s = settings(broker.url, resync_interval_s=600.0, protocol=protocol)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        await view.until(current, within=5)
        assert bus.repaired
        await asyncio.sleep(RESYNC_SETTLE_S + 1.0)
        assert bus.resyncs == 0, "a re-read without any change"
        # The lost update: n2's older claim stands in the view (delivered live, as a
        # later update that never arrived leaves it); a burst of changes ends here.
        bus._dispatch(topic("n2"), encode(record("n2", 3)), retained=False)
        await until(lambda: bus.resync_corrections >= 1, within=5)
        assert view.records[topic("n2")] == current[topic("n2")]
        resyncs = bus.resyncs
        await asyncio.sleep(RESYNC_SETTLE_S + 1.0)
        assert bus.resyncs == resyncs, "a re-read without a change since the last one"
        view.stop()
    await peer.close(2.0)


async def test_every_burst_is_read_again_without_a_quiet_time(
    broker: Mosquitto,
) -> None:
    """Seen on nats-server 2.9.10 at 18 agents: a peer's member update lost during a
    formation waited 6 s (a quiet time, 5 s, then 1 s) for the re-read that put it right.
    Every record carries its writer's order (a re-read never applies an older copy), so
    any burst is read again RESYNC_SETTLE_S after its last live message."""
    peer = await client_of(broker.url)
    later = encode(record("n2", 4, MemberState.MEMBER, seq=2))
    await peer.publish(topic("n2"), later, retain=True)
    s = settings(broker.url, resync_interval_s=600.0)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        await view.until({topic("n2"): later}, within=5)
        # The lost update: n2's earlier claim stands in the view (delivered live).
        bus._dispatch(topic("n2"), encode(record("n2", 4, seq=1)), retained=False)
        await until(lambda: bus.resync_corrections >= 1, within=RESYNC_SETTLE_S + 4)
        assert view.records[topic("n2")] == later
        # A burst with a record without an order (seq 0: an agent that predates it) too.
        resyncs = bus.resyncs
        bus._dispatch(topic("n3"), encode(record("n3", 5)), retained=False)
        await until(lambda: bus.resyncs >= resyncs + 1, within=RESYNC_SETTLE_S + 4)
        view.stop()
    await peer.close(2.0)


@pytest.mark.parametrize(("profile", "protocol"), [("auto", "5"), ("mosquitto", "3.1.1")])
async def test_no_repair_runs_on_a_link_whose_broker_keeps_order(
    broker: Mosquitto, profile: str, protocol: str
) -> None:
    """Mosquitto keeps MQTT's order and loses nothing it acknowledged: under the "auto"
    profile on MQTT 5, or the "mosquitto" profile on any protocol, the link runs none of
    the repairs. A retained copy after a live message on its topic is delivered (on
    Mosquitto it is never older: it was queued before the SUBSCRIBE), and neither a burst
    of changes nor the periodic interval brings a re-read."""
    s = settings(broker.url, resync_interval_s=0.3, protocol=protocol, broker=profile)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        async with asyncio.timeout(5):
            await view.synced.wait()
        assert not bus.repaired
        live, copy = encode(record("n3", 1)), encode(record("n3", 2))
        bus._dispatch(topic("n3"), live, retained=False)
        bus._dispatch(topic("n3"), copy, retained=True)
        await asyncio.sleep(RESYNC_SETTLE_S + 1.0)
        assert view.records == {topic("n3"): copy}
        assert (bus.stale_retained, bus.resyncs, bus.resync_corrections) == (0, 0, 0)
        view.stop()


async def test_a_burst_that_never_ends_still_gets_its_reread(broker: Mosquitto) -> None:
    """Seen at 256 nodes on an overloaded NATS cluster: links kept dropping and coming
    back, so live messages never paused and the re-read after the burst never came. The
    periodic re-read (`resync_interval_s`, jittered by +-25 %) is not put off by a burst."""
    s = settings(broker.url, resync_interval_s=1.0, protocol="3.1.1")
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        async with asyncio.timeout(5):
            await view.synced.wait()
        began = time.monotonic()
        slot = 0
        while bus.resyncs == 0:
            assert time.monotonic() - began < 4.0, "no re-read during an endless burst"
            slot += 1  # a change each time: a message that repeats the record is no news
            bus._dispatch(topic("n3"), encode(record("n3", slot)), retained=False)
            await asyncio.sleep(0.1)
        view.stop()


class ServerThatLost:
    """The drop rule of a `NoRetained` proxy standing for a server of a cluster that lost
    `topic`'s record: its retained copies never come, and neither does its first live
    update; later live updates pass (`live_updates` counts them all)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.live_updates = 0

    def __call__(self, t: str, retained: bool) -> bool:
        if t != self.topic:
            return False
        if retained:
            return True
        self.live_updates += 1
        return self.live_updates == 1


@contextlib.asynccontextmanager
async def reader_behind(server: FaultProxy) -> AsyncIterator[View]:
    """The view of n2, a repaired link through `server`, synced on FILTER."""
    s = settings(server.url, resync_interval_s=600.0)
    async with Bus(s, node="n2", client_id="imexd-n2", timeout_s=2.0) as reader:
        view = View(reader)
        await reader.subscribe(FILTER)
        async with asyncio.timeout(5):
            await view.synced.wait()
        try:
            yield view
        finally:
            view.stop()


async def test_a_periodic_reread_publishes_our_records_again_for_a_server_that_lost_them(
    broker: Mosquitto,
) -> None:
    """Seen at 256 nodes on a three-server nats-server 2.14.0 cluster: three members of a
    clique, all on one server, lacked a peer's member record for 45 s. They had missed its
    live update, and their server's retained map lacked it too, so their re-reads had
    nothing to correct, while the peer's own server held it and the peer's re-reads found
    nothing to put right. A repaired link publishes its records again at each periodic
    re-read, whatever its own server says; the relay here is the server that lost the
    record (it drops the record's retained copies, and its first live update)."""
    mine = encode(record("n1", 0, MemberState.MEMBER))
    lost = ServerThatLost(topic("n1"))
    s = settings(broker.url, resync_interval_s=0.5)
    withheld = NoRetained(lost)
    with FaultProxy(broker.host, broker.port, rule=withheld) as server:
        async with (
            reader_behind(server) as view,
            Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as writer,
        ):
            await writer.subscribe(FILTER)
            await writer.retain(topic("n1"), record("n1", 0, MemberState.MEMBER))
            await view.until({topic("n1"): mine}, within=10)
            assert withheld.dropped >= 1
            assert lost.live_updates >= 2
            assert writer.resync_corrections == 0, "the writer's server held it all along"


async def test_changes_that_never_pause_do_not_put_off_the_refresh(broker: Mosquitto) -> None:
    """A re-read after each burst of changes is no periodic one: it neither refreshes our
    records nor puts the next periodic re-read off. Here a peer changes its record every
    1.3 s and each burst brings a re-read before the periodic one would come (every 1.5
    to 2.5 s); the server that lost our record still gets it again."""
    mine = encode(record("n1", 0, MemberState.MEMBER))
    s = settings(broker.url, resync_interval_s=2.0)
    lost = ServerThatLost(topic("n1"))
    with FaultProxy(broker.host, broker.port, rule=NoRetained(lost)) as server:
        async with reader_behind(server) as view:
            peer = await client_of(broker.url)
            async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as w:
                await w.subscribe(FILTER)
                await w.retain(topic("n1"), record("n1", 0, MemberState.MEMBER))
                began = time.monotonic()
                slot = 0
                while view.records.get(topic("n1")) != mine:
                    assert time.monotonic() - began < 12.0, "our record never came again"
                    slot += 1
                    await peer.publish(topic("n3"), encode(record("n3", slot)), retain=True)
                    await asyncio.sleep(1.3)
            await peer.close(2.0)


async def test_a_live_message_that_repeats_the_record_brings_no_reread(broker: Mosquitto) -> None:
    """Peers publish their records again at every periodic re-read: a live message that
    repeats what the link delivered last on its topic is no change, and starts no burst,
    so a formed domain does not re-read after each peer's refresh."""
    peer = await client_of(broker.url)
    current = encode(record("n2", 4, MemberState.MEMBER))
    s = settings(broker.url, resync_interval_s=600.0)
    async with Bus(s, node="n1", client_id="imexd-n1", timeout_s=2.0) as bus:
        view = View(bus)
        await bus.subscribe(FILTER)
        async with asyncio.timeout(5):
            await view.synced.wait()
        await peer.publish(topic("n2"), current, retain=True)
        await view.until({topic("n2"): current}, within=5)
        await until(lambda: bus.resyncs >= 1, within=5)  # the burst's re-read
        resyncs = bus.resyncs
        await peer.publish(topic("n2"), current, retain=True)
        await asyncio.sleep(0.2 + RESYNC_SETTLE_S + 1.0)
        assert bus.resyncs == resyncs, "a re-read after a message that changed nothing"
        view.stop()
    await peer.close(2.0)


async def test_a_ping_cancelled_as_its_publish_fails_leaves_no_unretrieved_error() -> None:
    """Seen in CI (a broker restart): the link's task was cancelled just as the ping's
    publish failed, and asyncio logged "Task exception was never retrieved" with the
    BusError into the agent's log. The watch of the ping retrieves it in every case."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:

        async def publish_fails() -> None:
            raise BusError("the client is not currently connected")

        watch = asyncio.create_task(imexd.bus.waits.within_loop_time(publish_fails(), 1.0))
        await asyncio.sleep(0)  # the watch waits on the publish, which fails next
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, BusError):
            await watch
        del watch
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert unretrieved == []


def test_a_formed_domain_whose_agents_refresh_their_records_touches_no_daemon(
    tmp_path: Path,
) -> None:
    """On repaired links every agent publishes its member record again at its periodic
    re-reads (here every 0.75 to 1.25 s), and its peers get the same record again: no
    daemon gets a signal or a restart while they do."""
    c = Cluster(tmp_path)
    try:
        fast = {"bus": {"broker": "nats", "resync_interval_s": 1.0}}
        nodes = [c.add(name, overrides=fast) for name in ("n1", "n2", "n3")]
        c.wait(lambda: all(n.up_with(3) for n in nodes), timeout=30)
        quiet(c, nodes)
        before, signals = pids(nodes), {n.name: n.signals() for n in nodes}
        with c.client() as client:
            client.record(TOPICS.members_filter("d1", "c1"))

            def refreshed() -> Counter[str]:
                return Counter(t.rsplit("/", 1)[-1] for t, payload in client.seen() if payload)

            # The retained copy, then at least two refreshes each.
            c.wait(lambda: all(refreshed()[n.name] >= 3 for n in nodes), timeout=30)
        assert untouched(nodes, before) == []
        assert {n.name: n.signals() for n in nodes} == signals
    finally:
        c.close()
