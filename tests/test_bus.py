"""The bus client against a real Mosquitto: replay, failover, will, drops, dead links.

Every wait is bounded (asyncio.timeout); everything listens on loopback only. Brokers
that misbehave on purpose (frozen, MQTT 3.1.1 only, refusing subscriptions) are the tests'
fault proxy in front of a real Mosquitto (tests/faultproxy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import aiomqtt
import msgspec
import pytest
import trustme
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from structlog.testing import capture_logs

from imexd.bus.echoes import Echoes
from imexd.bus.engine import CHECK_OVER
from imexd.bus.events import (
    BrokerChecked,
    Connected,
    ConnectFailed,
    Disconnected,
    Event,
    Refused,
    SubscribeRefused,
    Synced,
    WillSpec,
)
from imexd.bus.link import Bus
from imexd.bus.mqtt import protocol_versions, refuses_protocol, topic_matches
from imexd.bus.records import Record
from imexd.demo.brokers import free_port
from imexd.errors import BusError
from imexd.messages import (
    Assignment,
    DaemonInfo,
    Deleted,
    Dropped,
    DropReason,
    HealthReport,
    MemberRecord,
    MemberState,
    Presence,
    Received,
    decode_message,
    encode,
)
from imexd.settings import BusSettings
from imexd.topics import Topics
from tests.brokers import Mosquitto
from tests.faultproxy import FaultProxy, Only311, RefusedSubscriptions, protocol_level, read_packet
from tests.support import raw_client

E = TypeVar("E", bound=Event)
TOPICS = Topics("imex/v2")
REPO = Path(__file__).resolve().parent.parent
AS_ROOT = "user root"
"""Mosquitto started as root drops to user mosquitto, which cannot read the test's files
(ACL, passwords, certificates) or bind its Unix socket; this keeps it root. Ignored when
the tests do not run as root."""


def fast_settings(*urls: str, **overrides: object) -> BusSettings:
    """Settings that make reconnects and pings quick enough for tests."""
    values: dict[str, object] = {
        "url": urls,
        "reconnect_initial_s": 0.05,
        "reconnect_max_s": 0.4,
        "ping_interval_s": 5.0,
        "will_delay_s": 1.0,
    }
    values.update(overrides)
    return BusSettings(**values)  # type: ignore[arg-type]


def record(node: str = "n1", *, slot: int = 0, domain: str = "d1") -> MemberRecord:
    return MemberRecord(
        node=node,
        domain=domain,
        clique="",
        address="127.0.0.1",
        slot=slot,
        incarnation=1,
        state=MemberState.MEMBER,
        max_nodes=18,
        mode="names",
    )


def bus_for(settings: BusSettings, node: str, **kwargs: object) -> Bus:
    kwargs.setdefault("timeout_s", 2.0)
    return Bus(settings, node=node, client_id=f"imexd-{node}", **kwargs)  # type: ignore[arg-type]


async def next_event(
    bus: Bus,
    kind: type[E],
    where: Callable[[E], bool] = lambda _: True,
    *,
    within: float = 5.0,
    seen: list[Event] | None = None,
) -> E:
    """The next event of `kind` (matching `where`); earlier ones go to `seen`."""
    async with asyncio.timeout(within):
        async for event in bus.events():
            if isinstance(event, kind) and where(event):
                return event
            if seen is not None:
                seen.append(event)
    raise AssertionError(f"the bus closed before a {kind.__name__} event")


async def no_event(bus: Bus, kind: type[E], where: Callable[[E], bool], seconds: float) -> None:
    """Assert that no matching event arrives within `seconds`."""
    with contextlib.suppress(TimeoutError):
        event = await next_event(bus, kind, where, within=seconds)
        raise AssertionError(f"unexpected {event}")


async def synced(bus: Bus) -> None:
    """Until the current link delivered its retained snapshot (`Bus.synced_at` is set).

    Polls instead of reading `Synced` from `bus.events()`, which would take that event
    away from the test that reads the events after it."""
    while bus.synced_at is None:  # noqa: ASYNC110 - see above
        await asyncio.sleep(0.01)


def member_topic(node: str = "n1") -> str:
    return TOPICS.member("d1", "", node)


MEMBERS = TOPICS.members_filter("d1", "")


# Pure functions.


def test_topic_filters_match_like_mqtt() -> None:
    """`+` matches one level, `#` the rest, and levels must line up exactly otherwise."""
    assert topic_matches("a/+/c", "a/b/c")
    assert topic_matches("a/#", "a/b/c")
    assert topic_matches("a/#", "a")
    assert not topic_matches("a/+", "a/b/c")
    assert not topic_matches("a/b", "a/b/c")
    assert not topic_matches("a/b/c", "a/b")


@pytest.mark.parametrize(
    ("topic", "payload", "reason"),
    [
        (member_topic(), b"x" * (16 * 1024 + 1), DropReason.OVERSIZED),
        (member_topic(), b"{nope", DropReason.NOT_JSON),
        (member_topic(), b"[1, 2]", DropReason.NOT_OBJECT),
        (member_topic(), b'{"v": 2, "node": "n1"}', DropReason.VERSION),
        (member_topic(), b'{"v": 1, "node": "n1"}', DropReason.SCHEMA),
        (member_topic("n2"), encode(record("n1")), DropReason.TOPIC_MISMATCH),
        ("imex/v2/domains/d1/members/none/n1/x", encode(record()), DropReason.UNKNOWN_TOPIC),
        ("imex/v2/domains/d1/members/none/N_1", b"", DropReason.UNKNOWN_TOPIC),
        ("imex/v2/domains/D1/health/n1", b"", DropReason.UNKNOWN_TOPIC),
        ("other/prefix", b"{}", DropReason.UNKNOWN_TOPIC),
        (TOPICS.ping("n1"), b"", DropReason.NOT_JSON),
    ],
)
def test_wrong_messages_are_dropped_with_a_reason(
    topic: str, payload: bytes, reason: DropReason
) -> None:
    """Each kind of wrong message maps to its DropReason; decoding never raises."""
    result = decode_message(TOPICS, topic, payload, retained=False)
    assert isinstance(result, Dropped)
    assert result.reason is reason


def test_messages_decode_into_typed_events() -> None:
    """Valid payloads become Received with the right type; empty ones become Deleted."""
    got = decode_message(TOPICS, member_topic(), encode(record()), retained=True)
    assert isinstance(got, Received)
    assert got.payload == record()
    assert got.retained
    assert got.ref.kind == "member"
    assigned = decode_message(
        TOPICS, TOPICS.assignment("n1"), encode(Assignment(domain=None)), retained=True
    )
    assert isinstance(assigned, Received)
    assert isinstance(assigned.payload, Assignment)
    gone = decode_message(TOPICS, TOPICS.health("d1", "n1"), b"", retained=False)
    assert isinstance(gone, Deleted)
    assert gone.ref.kind == "health"
    assert gone.ref.node == "n1"


def test_presence_records_decode_and_must_match_their_topic() -> None:
    """A presence record decodes on its own node's topic and is dropped on another's."""
    here = Presence(node="n1", incarnation=3, at=1.0, domain=None, address="10.0.0.1")
    got = decode_message(TOPICS, TOPICS.presence("n1"), encode(here), retained=True)
    assert isinstance(got, Received)
    assert got.payload == here
    forged = decode_message(TOPICS, TOPICS.presence("n2"), encode(here), retained=True)
    assert isinstance(forged, Dropped)
    assert forged.reason is DropReason.TOPIC_MISMATCH


def test_only_an_unsupported_protocol_answer_triggers_the_fallback() -> None:
    """MQTT 5's 0x84 and 3.1.1's code 1 mean "speak 3.1.1"; other refusals do not."""
    unsupported = ReasonCode(PacketTypes.CONNACK, "Unsupported protocol version")
    assert refuses_protocol(MqttConnectError(unsupported))
    assert refuses_protocol(MqttConnectError(1))
    assert not refuses_protocol(MqttConnectError(ReasonCode(PacketTypes.CONNACK, "Not authorized")))
    assert not refuses_protocol(MqttConnectError(5))
    assert not refuses_protocol(aiomqtt.MqttError("timed out"))


def test_protocol_setting_chooses_the_versions_tried() -> None:
    """ "auto" tries MQTT 5 then 3.1.1 at every connect; "5" and "3.1.1" try only theirs."""
    assert protocol_versions(fast_settings("mqtt://h", protocol="auto")) == (True, False)
    assert protocol_versions(fast_settings("mqtt://h", protocol="5")) == (True,)
    assert protocol_versions(fast_settings("mqtt://h", protocol="3.1.1")) == (False,)


def test_only_a_broker_disconnect_says_taken_over() -> None:
    """`taken_over` is the broker's DISCONNECT 0x8E, not any lost link."""
    assert Disconnected("b", "x", reason_code=0x8E).taken_over
    assert not Disconnected("b", "x", reason_code=0x8D).taken_over
    assert not Disconnected("b", "x").taken_over


def test_bad_arguments_are_refused_up_front() -> None:
    """A wrong node name, client id or will topic fails at construction, not later."""
    settings = fast_settings("mqtt://127.0.0.1:1")
    with pytest.raises(ValueError, match="DNS-1123"):
        Bus(settings, node="Bad_Name", client_id="x")
    with pytest.raises(ValueError, match="client_id"):
        Bus(settings, node="n1", client_id="")
    with pytest.raises(ValueError, match="wildcards"):
        Bus(settings, node="n1", client_id="x", will=WillSpec("a/+/b"))
    with pytest.raises(ValueError, match="client_id"):
        Bus(settings, node="n1", client_id="x").set_client_id("")


# Against a real broker.


async def test_retained_record_reaches_a_second_bus_and_deletion_follows(broker: Mosquitto) -> None:
    """A record retained by one bus arrives typed in another's snapshot; None deletes it."""
    settings = fast_settings(broker.url)
    async with bus_for(settings, "n1") as a:
        await a.subscribe(MEMBERS)
        async with asyncio.timeout(5):
            await synced(a)
        await a.retain(member_topic(), record())
        async with bus_for(settings, "n2") as b:
            await b.subscribe(MEMBERS)
            connected = await next_event(b, Connected)
            assert connected.protocol == "5"
            assert connected.broker == broker.url
            got = await next_event(b, Received)
            assert got.payload == record()
            assert got.retained
            await next_event(b, Synced)
            assert b.synced_at is not None
            await a.retain(member_topic(), None)
            gone = await next_event(b, Deleted)
            assert gone.topic == member_topic()
            assert gone.ref.node == "n1"
            # What a benchmark counts at the receiver: the record and its deletion.
            assert b.deliveries[("member", gone.ref.domain)] == 2
        assert a.writes["member"] == 2  # set, then cleared
        assert a.refused_topics == frozenset()
        assert a.connected
        assert a.broker == broker.url


async def test_a_new_subscription_delivers_its_snapshot_before_synced(broker: Mosquitto) -> None:
    """subscribe() on a live link is followed by the retained records, then Synced."""
    settings = fast_settings(broker.url)
    async with bus_for(settings, "n1") as a, bus_for(settings, "n2") as b:
        async with asyncio.timeout(5):
            await synced(a)
            await synced(b)
        for n in range(3):
            await a.retain(member_topic(f"m{n}"), record(f"m{n}", slot=n))
        await next_event(b, Synced)
        await b.subscribe(MEMBERS)
        seen: list[Event] = []
        await next_event(b, Synced, seen=seen)
        nodes = {e.ref.node for e in seen if isinstance(e, Received)}
        assert nodes == {"m0", "m1", "m2"}

        await b.unsubscribe(MEMBERS)
        await a.retain(member_topic("m3"), record("m3", slot=3))
        await b.subscribe(TOPICS.specs_filter())  # one more round trip: Synced
        seen.clear()
        await next_event(b, Synced, seen=seen)
        assert not [e for e in seen if isinstance(e, Received)]


SHARD = 200
"""Members of one shard: more retained records than any broker's in-flight window
(Mosquitto's `max_inflight_messages` is 20)."""


async def test_synced_comes_after_a_snapshot_larger_than_the_in_flight_window(
    broker: Mosquitto,
) -> None:
    """SHARD retained members all arrive before Synced, at connect and for a subscription
    on a live link: the ping is a barrier behind QoS 1 records, not a message past them."""
    settings = fast_settings(broker.url)
    async with raw_client(broker) as c:
        for n in range(SHARD):
            payload = encode(record(f"m{n:03d}", slot=n % 18))
            await c.publish(member_topic(f"m{n:03d}"), payload, qos=1, retain=True)
    wanted = {f"m{n:03d}" for n in range(SHARD)}
    async with bus_for(settings, "n1") as a:
        await a.subscribe(MEMBERS)
        seen: list[Event] = []
        await next_event(a, Synced, seen=seen)
        assert {e.ref.node for e in seen if isinstance(e, Received)} == wanted
    async with bus_for(settings, "n2") as b:
        async with asyncio.timeout(5):
            await synced(b)
        await next_event(b, Synced)
        await b.subscribe(MEMBERS)
        seen = []
        await next_event(b, Synced, seen=seen)
        assert {e.ref.node for e in seen if isinstance(e, Received)} == wanted


async def test_broker_restart_reconnects_resubscribes_and_republishes(broker: Mosquitto) -> None:
    """After a restart that lost every retained record, the record is back for the peer."""
    settings = fast_settings(broker.url)
    async with bus_for(settings, "n1") as a, bus_for(settings, "n2") as b:
        await a.subscribe(MEMBERS)
        await b.subscribe(MEMBERS)
        await a.retain(member_topic(), record())
        await next_event(b, Received)
        broker.stop()  # persistence false: the broker forgets the record
        broker.start()  # on the same port
        lost = await next_event(b, Disconnected)
        assert lost.broker == broker.url
        await next_event(b, Connected)
        again = await next_event(b, Received, lambda e: e.topic == member_topic())
        assert again.payload == record()
        async with asyncio.timeout(5):
            await synced(a)
            await synced(b)
        assert a.reconnects == 1
        assert b.reconnects == 1
        assert a.last_error is not None
        assert a.refused_topics == frozenset()


async def test_a_record_retained_without_replay_waits_for_its_caller_on_a_new_link(
    broker: Mosquitto,
) -> None:
    """`retain(replay=False)`: after a restart that lost it, the bus does not publish the
    record again by itself (its caller judges the new snapshot first), and a record with
    replay does come back; the caller's own publication then reaches the peer."""
    settings = fast_settings(broker.url)
    async with bus_for(settings, "n1") as a, bus_for(settings, "n2") as b:
        await a.subscribe(MEMBERS)
        await b.subscribe(MEMBERS)
        async with asyncio.timeout(5):
            await synced(a)  # without a link, a record without replay waits for the next
        await a.retain(member_topic(), record(), replay=False)
        await a.retain(member_topic("n1x"), record("n1x", slot=1))
        await next_event(b, Received, lambda e: e.topic == member_topic())
        broker.stop()  # persistence false: the broker forgets both records
        broker.start()
        await next_event(b, Connected)
        await next_event(b, Received, lambda e: e.topic == member_topic("n1x"))
        async with asyncio.timeout(5):
            await synced(a)
        await no_event(b, Received, lambda e: e.topic == member_topic(), 1.0)
        await a.retain(member_topic(), record(), replay=False)
        again = await next_event(b, Received, lambda e: e.topic == member_topic())
        assert again.payload == record()


async def test_fails_over_to_the_next_broker(tmp_path: Path, broker: Mosquitto) -> None:
    """With [dead, live] it connects to the live one; when that dies, to the next again."""
    dead = f"mqtt://127.0.0.1:{free_port()}"
    second = Mosquitto(tmp_path / "second")
    second.start()
    try:
        settings = fast_settings(dead, broker.url, second.url)
        with capture_logs() as logs:
            async with bus_for(settings, "n1") as bus:
                first = await next_event(bus, Connected)
                assert first.broker == broker.url
                assert bus.broker == broker.url
                broker.stop()
                await next_event(bus, Disconnected)
                then = await next_event(bus, Connected)
                assert then.broker == second.url
                async with asyncio.timeout(5):
                    await synced(bus)
        failed = [e for e in logs if e["event"] == "bus_connect_failed"]
        assert failed
        assert failed[0]["broker"] == dead
    finally:
        second.stop()


async def test_unix_socket_broker(tmp_path: Path) -> None:
    """unix:// URLs connect through the broker's Unix socket listener."""
    broker = Mosquitto(tmp_path / "unix", unix_socket=True, extra_config=AS_ROOT)
    broker.start()
    try:
        async with bus_for(fast_settings(f"unix://{broker.socket_path}"), "n1") as bus:
            await bus.subscribe(MEMBERS)
            await bus.retain(member_topic(), record())
            got = await next_event(bus, Received)
            assert got.payload == record()
            assert bus.broker == f"unix://{broker.socket_path}"
    finally:
        broker.stop()


async def test_not_connected_publish_fails_and_close_is_bounded() -> None:
    """With no broker, publish raises BusError, and close() returns promptly."""
    bus = bus_for(fast_settings(f"mqtt://127.0.0.1:{free_port()}"), "n1")
    async with bus:
        await bus.subscribe(MEMBERS)  # desired state only: no error while away
        await bus.retain(member_topic(), record())
        with pytest.raises(BusError, match="not connected"):
            await bus.publish(TOPICS.assignment("n1"), Assignment(domain=None))
        await asyncio.sleep(0.2)
        assert bus.last_error is not None
        assert "cannot connect" in bus.last_error
        started = time.monotonic()
    assert time.monotonic() - started < 1.0
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("bus")]
    async with asyncio.timeout(1):
        assert {type(e) for e in [e async for e in bus.events()]} == {ConnectFailed}


async def test_close_while_connecting_to_a_frozen_broker_is_bounded(broker: Mosquitto) -> None:
    """A connect that hangs (no CONNACK) does not hold close() beyond its bound."""
    with FaultProxy(broker.host, broker.port) as relay:
        relay.drop()
        bus = bus_for(fast_settings(relay.url), "n1", timeout_s=10.0, close_timeout_s=0.3)
        async with bus:
            await asyncio.sleep(0.3)  # the connect now waits for a CONNACK
            assert not bus.connected
            started = time.monotonic()
        assert time.monotonic() - started < 2.0
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("bus")]


async def test_publish_with_message_expiry(broker: Mosquitto) -> None:
    """A one-off and a retained report with message expiry both reach a subscriber."""
    settings = fast_settings(broker.url)
    report = HealthReport(
        node="n1",
        domain="d1",
        clique="",
        slot=0,
        incarnation=1,
        at=1.0,
        ready=True,
        conditions=[],
        daemon=DaemonInfo(state="RUNNING"),
    )
    async with bus_for(settings, "n1") as bus:
        await bus.subscribe(TOPICS.health_filter("d1"))
        async with asyncio.timeout(5):
            await synced(bus)
        await bus.retain(TOPICS.health("d1", "n1"), report, message_expiry_s=30)
        got = await next_event(bus, Received)
        assert got.payload == report
        await bus.publish(
            TOPICS.health("d1", "n1"), msgspec.structs.replace(report, at=2.0), message_expiry_s=5
        )
        got = await next_event(bus, Received)
        assert isinstance(got.payload, HealthReport)
        assert got.payload.at == 2.0


# Last Will.

_AGENT = """
import asyncio, sys
from imexd.bus.link import Bus
from imexd.bus.events import WillSpec
from imexd.logs import configure_logging
from imexd.settings import BusSettings
from imexd.messages import MemberRecord, MemberState
from imexd.topics import Topics

async def main(url: str) -> None:
    configure_logging("warning", "json", stream=sys.stderr)
    topic = Topics("imex/v2").member("d1", "", "n1")
    settings = BusSettings(url=(url,), will_delay_s=1.0, ping_interval_s=5.0)
    rec = MemberRecord(node="n1", domain="d1", clique="", address="127.0.0.1", slot=0,
                       incarnation=1, state=MemberState.MEMBER, max_nodes=18, mode="names")
    async with Bus(settings, node="n1", client_id="imexd-n1", will=WillSpec(topic)) as bus:
        await bus.subscribe(Topics("imex/v2").members_filter("d1", ""))
        await bus.retain(topic, rec)
        while bus.synced_at is None:
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1]))
"""


@contextlib.asynccontextmanager
async def agent_process(url: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A real agent-like process holding the n1 record, with a will; killed at the end."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _AGENT, url, stdout=subprocess.PIPE, env=env, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            line = await proc.stdout.readline()
        assert line == b"ready\n"
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_will_clears_the_record_after_the_delay_when_killed(broker: Mosquitto) -> None:
    """SIGKILL: no DISCONNECT, so after will_delay_s the empty retained payload arrives."""
    async with bus_for(fast_settings(broker.url), "obs") as observer:
        await observer.subscribe(MEMBERS)
        async with agent_process(broker.url) as proc:
            await next_event(observer, Received, lambda e: e.topic == member_topic())
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            gone = await next_event(observer, Deleted, within=5)
            waited = time.monotonic() - killed
        assert gone.topic == member_topic()
        assert 0.8 <= waited <= 3.5, waited
    async with bus_for(fast_settings(broker.url), "late") as late:
        await late.subscribe(MEMBERS)
        seen: list[Event] = []
        await next_event(late, Synced, seen=seen)
        assert not [e for e in seen if isinstance(e, Received)]


async def test_a_quick_reconnect_keeps_the_record(broker: Mosquitto) -> None:
    """Killed, then the same client id back within the will delay: the will never fires."""
    settings = fast_settings(broker.url, will_delay_s=1.0)
    async with bus_for(settings, "obs") as observer:
        await observer.subscribe(MEMBERS)
        async with agent_process(broker.url) as proc:
            await next_event(observer, Received, lambda e: e.topic == member_topic())
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        # The restarted agent does not republish: the record must still be the old one.
        async with bus_for(settings, "n1", will=WillSpec(member_topic())) as back:
            await next_event(back, Connected, within=2)
            await no_event(observer, Deleted, lambda _: True, 2.0)
    async with bus_for(settings, "late") as late:
        await late.subscribe(MEMBERS)
        got = await next_event(late, Received)
        assert got.payload == record()


async def test_clean_close_suppresses_the_will(broker: Mosquitto) -> None:
    """close() sends DISCONNECT: the record outlives the will delay (hand-over)."""
    settings = fast_settings(broker.url, will_delay_s=0.5)
    async with bus_for(settings, "obs") as observer:
        await observer.subscribe(MEMBERS)
        async with bus_for(settings, "n1", will=WillSpec(member_topic())) as bus:
            await bus.retain(member_topic(), record())
            await next_event(observer, Received)
        await no_event(observer, Deleted, lambda _: True, 1.5)


async def test_set_will_reconnects_cleanly_without_firing_the_old_will(broker: Mosquitto) -> None:
    """A changed will reconnects at once; the clean DISCONNECT keeps the old will quiet."""
    settings = fast_settings(broker.url, will_delay_s=0.5)
    old, new = member_topic(), TOPICS.member("d2", "", "n1")
    async with bus_for(settings, "obs") as observer:
        await observer.subscribe(TOPICS.all_members_filter("d1"))
        await observer.subscribe(TOPICS.all_members_filter("d2"))
        async with bus_for(settings, "n1", will=WillSpec(old)) as bus:
            await bus.retain(old, record())
            await next_event(observer, Received)
            bus.set_will(WillSpec(new))
            lost = await next_event(bus, Disconnected)
            assert lost.reason == "will changed"
            assert lost.reason_code is None
            await next_event(bus, Connected)
            assert bus.reconnects == 0  # deliberate: not a reconnect an alert should see
            bus.set_will(WillSpec(new))  # unchanged: no reconnect
            await no_event(observer, Deleted, lambda _: True, 1.2)
            assert bus.reconnects == 0


async def test_a_session_take_over_ends_the_link_and_counts(broker: Mosquitto) -> None:
    """A second client with our client id ends our link; the event and the link-down log
    carry the broker's DISCONNECT reason (0x8E from Mosquitto >= 2.0.12; older ones just
    close, which shows as no reason code), and the reconnect counts."""
    settings = fast_settings(broker.url, reconnect_initial_s=3.0, reconnect_max_s=3.0)
    with capture_logs() as logs:
        async with bus_for(settings, "n1") as bus:
            await next_event(bus, Synced)
            async with aiomqtt.Client(
                "127.0.0.1",
                broker.port,
                identifier="imexd-n1",
                protocol=aiomqtt.ProtocolVersion.V5,
                timeout=2,
            ):
                lost = await next_event(bus, Disconnected)
            assert lost.reason_code in (None, 0x8E)
            assert bus.last_error == lost.reason
            await next_event(bus, Connected, within=6)
            assert bus.reconnects == 1  # a lost link: this one counts
    down = [e for e in logs if e["event"] == "bus_disconnected"]
    assert down[0]["reason_code"] == lost.reason_code
    assert down[0]["taken_over"] is lost.taken_over


async def test_the_brokers_disconnect_reason_is_reported(broker: Mosquitto) -> None:
    """An MQTT 5 DISCONNECT "Session taken over" (0x8E) from the broker is on the
    Disconnected event and, as a warning, on the link-down log event."""
    with FaultProxy(broker.host, broker.port) as relay:
        settings = fast_settings(relay.url, reconnect_initial_s=3.0, reconnect_max_s=3.0)
        with capture_logs() as logs:
            async with bus_for(settings, "n1") as bus:
                await next_event(bus, Synced)
                relay.end_with(bytes([0xE0, 2, 0x8E, 0]))  # DISCONNECT, no properties
                lost = await next_event(bus, Disconnected)
                assert lost.reason_code == 0x8E
                assert lost.taken_over
                assert "Session taken over" in lost.reason
    down = [e for e in logs if e["event"] == "bus_disconnected"]
    assert down[0]["reason_code"] == 0x8E
    assert down[0]["taken_over"] is True
    assert down[0]["log_level"] == "warning"


async def test_set_client_id_stops_fighting_over_the_shared_id(broker: Mosquitto) -> None:
    """After set_client_id the bus reconnects under the new id at once; the old id's
    owner can then connect without ending our link, and the switch is no reconnect."""
    async with bus_for(fast_settings(broker.url), "n1") as bus:
        bus.set_client_id("imexd-n1")  # unchanged: nothing happens
        await next_event(bus, Synced)
        bus.set_client_id("imexd-n1-duplicate")
        assert bus.client_id == "imexd-n1-duplicate"
        lost = await next_event(bus, Disconnected)
        assert lost.reason == "client id changed"
        await next_event(bus, Synced)
        async with aiomqtt.Client(
            "127.0.0.1",
            broker.port,
            identifier="imexd-n1",
            protocol=aiomqtt.ProtocolVersion.V5,
            timeout=2,
        ):
            await no_event(bus, Disconnected, lambda _: True, 1.0)
        assert bus.connected
        assert bus.reconnects == 0


async def test_set_client_id_while_down_applies_at_the_next_connect(broker: Mosquitto) -> None:
    """Without a link the new id is simply used by the next connect."""
    broker.stop()
    async with bus_for(fast_settings(broker.url), "n1") as bus:
        await next_event(bus, ConnectFailed)
        bus.set_client_id("imexd-n1-b")
        broker.start()
        await next_event(bus, Synced, within=5)
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="imexd-n1", timeout=2):
            await no_event(bus, Disconnected, lambda _: True, 1.0)


# Wrong messages on the wire.


async def test_wrong_messages_are_dropped_counted_and_logged_once(broker: Mosquitto) -> None:
    """Garbage, oversized, wrong v and spoofed records are dropped; the bus keeps working."""
    bad = [
        (member_topic("n9"), b"not json"),
        (member_topic("n9"), b"not json"),  # the same sender and reason again: logged once
        (member_topic("n9"), b"{" + b" " * (17 * 1024) + b"}"),
        (member_topic("n9"), b"x" * (256 * 1024)),  # over our Maximum Packet Size: never sent
        (member_topic("n9"), b'"a string"'),
        (member_topic("n9"), b'{"v": 7, "node": "n9"}'),
        (member_topic("n9"), encode(record("n8"))),  # spoofed: n8 speaking on n9's topic
        (member_topic("n9"), encode(record("n9")).replace(b"127.0.0.1", b"not-an-ip")),
        ("imex/v2/domains/d1/whatever", b"{}"),
    ]
    counted: list[int] = []
    with capture_logs() as logs:
        async with bus_for(fast_settings(broker.url), "n1") as bus:
            bus.on_counted = lambda: counted.append(sum(bus.dropped.values()))
            await bus.subscribe("imex/v2/#")
            async with asyncio.timeout(5):
                await synced(bus)
            async with aiomqtt.Client(broker.host, broker.port, identifier="raw") as raw:
                for topic, payload in bad:
                    await raw.publish(topic, payload, qos=1)
                await raw.publish(member_topic("n7"), encode(record("n7")), qos=1)
            got = await next_event(bus, Received)
            assert got.topic == member_topic("n7")
            assert bus.connected
    assert bus.dropped == {
        "not_json": 2,
        "oversized": 1,
        "not_object": 1,
        "version": 1,
        "topic_mismatch": 1,
        "schema": 0,
        "address": 1,  # "not-an-ip"
        "unknown_topic": 1,
        "unsigned": 0,  # no [control] public_key: control-plane records are not checked
        "signature": 0,
        "stale": 0,  # counted by the agent's order (imexd.agent.rebuild), not the bus
    }
    assert counted == [1, 2, 3, 4, 5, 6, 7, 8]  # each drop told at once: facts read them
    dropped = [e for e in logs if e["event"] == "bus_message_dropped"]
    assert sorted(e["reason"] for e in dropped) == sorted(
        [
            "not_json",
            "oversized",
            "not_object",
            "version",
            "topic_mismatch",
            "address",
            "unknown_topic",
        ]
    )
    assert all(e["log_level"] == "warning" for e in dropped)


# Misbehaving brokers: a relay in front of a real one.


async def test_a_silently_dead_link_is_replaced(broker: Mosquitto) -> None:
    """A frozen link (no RST, no FIN) is noticed by the ping and replaced when it thaws;
    the record survives because the reconnect comes within the will delay."""
    settings = fast_settings(ping_interval_s=0.3, will_delay_s=2.0)
    with FaultProxy(broker.host, broker.port) as relay:
        settings = replace(settings, url=(relay.url,))
        async with (
            bus_for(fast_settings(broker.url), "obs") as observer,
            bus_for(
                settings, "n1", ping_timeout_s=0.5, timeout_s=1.0, will=WillSpec(member_topic())
            ) as bus,
        ):
            await observer.subscribe(MEMBERS)
            await bus.subscribe(MEMBERS)
            await bus.retain(member_topic(), record())
            await next_event(observer, Received)
            await next_event(bus, Synced)
            await asyncio.sleep(0.4)

            relay.drop()
            frozen = time.monotonic()
            lost = await next_event(bus, Disconnected, within=3)
            assert time.monotonic() - frozen < 2 * (0.3 + 0.5)
            assert "no ping echo" in lost.reason
            assert bus.last_error == lost.reason
            assert not bus.connected
            assert bus.synced_at is None
            await asyncio.sleep(0.5)  # a few connects hang on the frozen relay meanwhile

            relay.cut()  # a partition this long breaks every connection that lived through it
            relay.heal()
            await next_event(bus, Connected, within=5)
            await next_event(bus, Synced, within=3)
            assert bus.reconnects == 1
            await no_event(observer, Deleted, lambda _: True, 1.5)


async def test_falls_back_to_mqtt_311_when_5_is_refused(broker: Mosquitto) -> None:
    """A broker answering MQTT 5 with "unsupported version" gets 3.1.1, said in a log."""
    only_311 = Only311()
    with FaultProxy(broker.host, broker.port, rule=only_311) as relay:
        with capture_logs() as logs:
            async with bus_for(
                fast_settings(relay.url), "n1", will=WillSpec(member_topic())
            ) as bus:
                up = await next_event(bus, Connected)
                assert up.protocol == "3.1.1"
                assert not up.will_delay
                await bus.subscribe(MEMBERS)
                await bus.retain(member_topic(), record())
                got = await next_event(bus, Received)
                assert got.payload == record()
                await bus.retain(TOPICS.health("d1", "n1"), None, message_expiry_s=5)
        assert only_311.refused == 1
    fallback = [e for e in logs if e["event"] == "bus_protocol_fallback"]
    assert len(fallback) == 1
    assert "no Will Delay" in fallback[0]["message"]


async def test_falls_back_to_mqtt_311_when_5_is_closed_before_connack(broker: Mosquitto) -> None:
    """A broker that hangs up on an MQTT 5 CONNECT without CONNACK gets 3.1.1 at once,
    without waiting for the connect timeout."""
    only_311 = Only311(close=True)
    with FaultProxy(broker.host, broker.port, rule=only_311) as relay:
        with capture_logs() as logs:
            async with bus_for(fast_settings(relay.url), "n1", timeout_s=5.0) as bus:
                up = await next_event(bus, Connected, within=3)
                assert up.protocol == "3.1.1"
                await bus.subscribe(MEMBERS)
                await bus.retain(member_topic(), record())
                got = await next_event(bus, Received)
                assert got.payload == record()
        assert only_311.refused == 1
    fallback = [e for e in logs if e["event"] == "bus_protocol_fallback"]
    assert len(fallback) == 1
    assert "closed" in fallback[0]["message"]


async def test_every_connect_tries_mqtt_5_again(broker: Mosquitto) -> None:
    """The fallback is for one connect only: after a lost link MQTT 5 is asked again."""
    only_311 = Only311()
    with FaultProxy(broker.host, broker.port, rule=only_311) as relay:
        async with bus_for(fast_settings(relay.url), "n1") as bus:
            assert (await next_event(bus, Connected)).protocol == "3.1.1"
            relay.cut()  # breaks the link
            relay.heal()
            await next_event(bus, Disconnected)
            assert (await next_event(bus, Connected)).protocol == "3.1.1"
        assert only_311.refused == 2


async def test_protocol_5_never_falls_back(broker: Mosquitto) -> None:
    """With bus.protocol = "5" a broker refusing MQTT 5 is a failed connect, retried as 5."""
    only_311 = Only311()
    with FaultProxy(broker.host, broker.port, rule=only_311) as relay:
        async with bus_for(fast_settings(relay.url, protocol="5"), "n1") as bus:
            failed = await next_event(bus, ConnectFailed)
            assert 'bus.protocol = "5"' in failed.error
            await next_event(bus, ConnectFailed)
            assert not bus.connected
        assert only_311.refused >= 2
        assert only_311.levels == [5] * len(only_311.levels)


async def test_protocol_311_connects_with_311(broker: Mosquitto) -> None:
    """With bus.protocol = "3.1.1" the first CONNECT already speaks 3.1.1."""
    only_311 = Only311()
    with FaultProxy(broker.host, broker.port, rule=only_311) as relay:
        async with bus_for(fast_settings(relay.url, protocol="3.1.1"), "n1") as bus:
            up = await next_event(bus, Connected)
            assert up.protocol == "3.1.1"
            assert not up.will_delay
        assert only_311.refused == 0
        assert only_311.levels == [4]


async def test_a_connect_that_times_out_does_not_fall_back() -> None:
    """Silence (a partition healing mid-connect) is a failed connect, not a protocol
    verdict: every later connect still speaks MQTT 5."""
    writers: list[asyncio.StreamWriter] = []
    levels: list[int] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            levels.append(protocol_level(await read_packet(reader)))
            await reader.read()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with bus_for(fast_settings(f"mqtt://127.0.0.1:{port}"), "n1", timeout_s=0.3) as bus:
            for _ in range(3):
                failed = await next_event(bus, ConnectFailed, within=10)
                assert "timed out" in failed.error
        assert len(levels) >= 3
        assert levels == [5] * len(levels)
    finally:
        for writer in writers:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


# Broker security: ACLs, passwords, TLS.


async def test_a_publish_refused_by_the_acl_is_reported(tmp_path: Path) -> None:
    """The broker silently drops a forbidden publish; the missing echo reports it."""
    acl = tmp_path / "acl"
    acl.write_text(
        "topic read imex/#\n"
        "topic readwrite imex/v2/nodes/n1/ping\n"
        f"topic write {member_topic('n1')}\n"
    )
    broker = Mosquitto(tmp_path / "acl-broker", extra_config=f"acl_file {acl}\n{AS_ROOT}")
    broker.start()
    try:
        with capture_logs() as logs:
            async with bus_for(fast_settings(broker.url), "n1", echo_timeout_s=0.5) as bus:
                await bus.subscribe(MEMBERS)
                await bus.retain(member_topic("n1"), record("n1"))
                await bus.retain(member_topic("n2"), record("n2", slot=1))
                refused = await next_event(bus, Refused)
                assert refused.topic == member_topic("n2")
                assert bus.refused_topics == {member_topic("n2")}
        assert [e["topic"] for e in logs if e["event"] == "bus_publish_refused"] == [
            member_topic("n2")
        ]
    finally:
        broker.stop()


@pytest.fixture
def auth_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """A broker that admits only user `agent` with password `right-secret`."""
    passwd = tmp_path / "mosquitto.passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(passwd), "agent", "right-secret"],
        check=True,
        capture_output=True,
    )
    broker = Mosquitto(
        tmp_path / "auth", extra_config=f"password_file {passwd}\nallow_anonymous false\n{AS_ROOT}"
    )
    broker.start()
    yield broker
    broker.stop()


async def test_password_is_read_at_each_connect_and_never_logged(
    tmp_path: Path, auth_broker: Mosquitto
) -> None:
    """A wrong password fails (and retries); fixing the file lets the next attempt in."""
    secret = tmp_path / "bus.password"
    secret.write_text("wrong-secret\n")
    settings = fast_settings(auth_broker.url, username="agent", password_file=str(secret))
    with capture_logs() as logs:
        async with bus_for(settings, "n1") as bus:
            failed = await next_event(bus, ConnectFailed)
            assert "authori" in failed.error.lower()
            assert bus.last_error == failed.error
            secret.write_text("right-secret\n")
            await next_event(bus, Connected)
    assert "secret" not in repr(logs)


async def test_mqtts_with_a_client_certificate(tmp_path: Path) -> None:
    """mqtts:// verifies the broker against ca_file and presents cert_file/key_file."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("n1")
    files = {name: tmp_path / name for name in ("ca.pem", "srv.pem", "srv.key", "cl.pem", "cl.key")}
    ca.cert_pem.write_to_path(str(files["ca.pem"]))
    server.cert_chain_pems[0].write_to_path(str(files["srv.pem"]))
    server.private_key_pem.write_to_path(str(files["srv.key"]))
    client.cert_chain_pems[0].write_to_path(str(files["cl.pem"]))
    client.private_key_pem.write_to_path(str(files["cl.key"]))
    tls_port = free_port()
    broker = Mosquitto(
        tmp_path / "tls",
        extra_config=(
            f"listener {tls_port} 127.0.0.1\n"
            f"cafile {files['ca.pem']}\ncertfile {files['srv.pem']}\n"
            f"keyfile {files['srv.key']}\nrequire_certificate true\n{AS_ROOT}"
        ),
    )
    broker.start()
    settings = fast_settings(
        f"mqtts://127.0.0.1:{tls_port}",
        ca_file=str(files["ca.pem"]),
        cert_file=str(files["cl.pem"]),
        key_file=str(files["cl.key"]),
    )
    try:
        async with bus_for(settings, "n1") as bus:
            await bus.subscribe(MEMBERS)
            await bus.retain(member_topic(), record())
            got = await next_event(bus, Received)
            assert got.payload == record()
            assert bus.broker == f"mqtts://127.0.0.1:{tls_port}"
    finally:
        broker.stop()


async def test_a_late_echo_clears_the_refused_verdict() -> None:
    """An echo that arrives after the timeout takes the PublishRefused verdict back."""
    refused: list[str] = []
    echoes = Echoes(0.05, refused.append)
    echoes.expect("t", b"A")
    await asyncio.sleep(0.15)
    assert echoes.refused == {"t"}
    assert refused == ["t"]
    echoes.seen("t", b"other")
    assert echoes.refused == {"t"}
    echoes.seen("t", b"A")
    assert echoes.refused == set()


async def test_a_retained_copy_is_no_echo_but_proves_the_broker_kept_it() -> None:
    """Seen on a three-server NATS cluster: the broker kept a claim, its live echo never
    came, and a re-read's snapshot held the claim. The copy clears nothing but the refusal
    (the broker kept it); the wait for the live echo goes on, and when it times out the
    echo is lost (not refused), so that the shard can publish its claim again."""
    refused: list[str] = []
    lost: list[str] = []
    echoes = Echoes(0.05, refused.append, on_lost=lost.append)
    echoes.expect("t", b"A")
    echoes.seen("t", b"A", live=False)
    await asyncio.sleep(0.15)
    assert (refused, lost, echoes.refused) == ([], ["t"], set())
    echoes.expect("t", b"B")
    echoes.seen("t", b"B", live=False)
    echoes.seen("t", b"B")  # the live echo after all
    await asyncio.sleep(0.15)
    assert (refused, lost) == ([], ["t"])


async def test_a_kept_record_stays_kept_when_its_wait_starts_over() -> None:
    """A wait that starts over because no subscription could carry the echo (a refused
    filter) keeps what the snapshot showed: the record is lost at the next expiry, not
    refused."""
    refused: list[str] = []
    lost: list[str] = []
    can_tell = {"now": False}
    echoes = Echoes(0.05, refused.append, lambda _: can_tell["now"], on_lost=lost.append)
    echoes.expect("t", b"A")
    echoes.seen("t", b"A", live=False)
    await asyncio.sleep(0.08)  # expired once: could not tell, started over
    can_tell["now"] = True
    await asyncio.sleep(0.1)
    assert (refused, lost, echoes.refused) == ([], ["t"], set())


async def test_a_barrier_comes_back_on_a_live_link_only(broker: Mosquitto) -> None:
    """barrier() is a round trip through the broker: True while linked, False without a link."""
    async with bus_for(fast_settings(broker.url), "n1") as bus:
        assert not await bus.barrier()  # not connected yet
        await next_event(bus, Synced)
        assert await bus.barrier()
        broker.stop()
        await next_event(bus, Disconnected)
        assert not await bus.barrier()


# Refused subscriptions: a clustered broker refuses some for a while, an ACL for good.


def settings_311(*urls: str, **overrides: object) -> BusSettings:
    return fast_settings(*urls, protocol="3.1.1", **overrides)


async def test_a_refused_subscription_is_retried_on_the_link_until_granted(
    broker: Mosquitto,
) -> None:
    """A filter refused twice is subscribed again with backoff on the same link; no
    Synced comes before it is granted, and our record's missing echo meanwhile is not
    judged refused (its filter was not granted yet)."""
    refusing = RefusedSubscriptions({MEMBERS: {1, 2}})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        # Retries after 0.4-0.8 s and 0.8-1.6 s: longer than the echo may take.
        settings = settings_311(relay.url, reconnect_initial_s=0.8, reconnect_max_s=2.0)
        bus = bus_for(settings, "n1", echo_timeout_s=0.5)
        await bus.subscribe(MEMBERS)
        await bus.retain(member_topic("n1"), record("n1"))
        seen: list[Event] = []
        with capture_logs() as logs:
            async with bus:
                await next_event(bus, Synced, within=10, seen=seen)
                assert bus.subscribe_refused == ""
        refusals = [e for e in seen if isinstance(e, SubscribeRefused)]
        assert [e.topic_filter for e in refusals] == [MEMBERS, MEMBERS]
        assert relay.url in refusals[0].detail
        assert MEMBERS in refusals[0].detail
        assert not [e for e in seen if isinstance(e, Disconnected | Refused)]
        assert relay.accepted == 1
        assert refusing.seen[MEMBERS] == 3
        warned = [e for e in logs if e["event"] == "bus_subscribe_refused"]
        assert [(e["filter"], e["reason"]) for e in warned] == [(MEMBERS, "SubscribeRefused")] * 2


async def test_a_subscription_that_stays_refused_fails_over_to_the_next_broker(
    broker: Mosquitto,
) -> None:
    """After a few refused retries the link is dropped, naming the broker and the filter,
    and the next broker of [bus] url serves the whole desired state."""
    refusing = RefusedSubscriptions({MEMBERS: None})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        bus = bus_for(settings_311(relay.url, broker.url), "n1")
        await bus.subscribe(MEMBERS)
        async with bus:
            seen: list[Event] = []
            down = await next_event(bus, Disconnected, within=10, seen=seen)
            assert not [e for e in seen if isinstance(e, Synced)]
            assert down.broker == relay.url
            assert MEMBERS in down.reason
            assert relay.url in down.reason
            assert "refused" in down.reason
            assert refusing.refused[MEMBERS] == 4  # the first try and three retries
            connected = await next_event(bus, Connected, within=10)
            assert connected.broker == broker.url
            await next_event(bus, Synced, within=10)
            assert bus.subscribe_refused == ""
            assert MEMBERS in (bus.last_error or "")


async def test_a_new_subscription_refused_while_linked_holds_synced_back(
    broker: Mosquitto,
) -> None:
    """A filter subscribed on a synced link and refused gets no Synced until a retry is
    granted; the link stays."""
    refusing = RefusedSubscriptions({MEMBERS: {1}})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        settings = settings_311(relay.url, reconnect_initial_s=0.4, reconnect_max_s=1.0)
        async with bus_for(settings, "n1") as bus:
            await next_event(bus, Synced)
            await bus.subscribe(MEMBERS)
            refused = await next_event(bus, SubscribeRefused)
            assert refused.topic_filter == MEMBERS
            assert bus.synced_at is None
            assert MEMBERS in bus.subscribe_refused
            await next_event(bus, Synced, within=5)
            assert bus.subscribe_refused == ""
            assert relay.accepted == 1


async def test_a_refused_retained_check_subscription_is_retried_not_judged(
    broker: Mosquitto,
) -> None:
    """On MQTT 3.1.1 the retained-wildcard check subscribes our filter again (a second read
    of the shard, which nats-server 2.9 sometimes needs); refused, it is retried and the
    check answers once granted (never BrokerNoRetainedWildcard for a refusal)."""
    refusing = RefusedSubscriptions({MEMBERS: {2}})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        lost = msgspec.structs.replace(record("n1"), state=MemberState.LOST, slot=None)
        will = WillSpec(member_topic("n1"), tombstone=lost)
        bus = bus_for(settings_311(relay.url), "n1", will=will)
        await bus.subscribe(MEMBERS)
        await bus.retain(member_topic("n1"), record("n1"))
        seen: list[Event] = []
        async with bus:
            checked = await next_event(bus, BrokerChecked, within=10, seen=seen)
            assert checked.ok
            assert bus.no_retained_wildcard == ""
        assert [e.topic_filter for e in seen if isinstance(e, SubscribeRefused)] == [MEMBERS]
        assert refusing.seen[MEMBERS] == 4  # replay, the check (refused), retry, the check
        assert relay.accepted == 1


class CheckClient:
    """A link whose broker refuses every SUBSCRIBE: what the narrow check meets where an
    ACL refuses its filter (`Bus._check_retained` is called with it directly)."""

    v5 = True

    def __init__(self) -> None:
        self.subscribed: list[str] = []

    async def subscribe(self, filters: list[str], *, qos: int = 1) -> list[str | None]:
        self.subscribed.extend(filters)
        return ["code 135"] * len(filters)


async def test_a_refused_narrow_check_gives_no_verdict() -> None:
    """On MQTT 5 the check subscribes a filter of our record alone; refused, that is no
    verdict (no BrokerChecked, never BrokerNoRetainedWildcard), logged, and the check is
    over for the link (the link's task does not ask again: it would spin)."""
    topic = member_topic("n1")
    bus = bus_for(fast_settings("mqtt://127.0.0.1:1"), "n1", will=WillSpec(topic))
    bus._subs.add([MEMBERS])
    bus._records.declare(topic, Record(encode(record("n1")), None))
    bus._protocol = "5"
    client = CheckClient()
    with capture_logs() as logs:
        done = await bus._check_retained(client)  # type: ignore[arg-type]
    assert done == CHECK_OVER
    assert client.subscribed == [topic.replace("/members/", "/+/")]
    assert bus.no_retained_wildcard == ""
    assert bus._queue.empty()
    assert [e["event"] for e in logs] == ["bus_broker_check_refused"]


class GrantingClient:
    """A link whose broker grants the check's new filter and sends our record's retained
    copy for it, as any broker does for a filter it has not granted before."""

    v5 = False

    def __init__(self, bus: Bus, topic: str, payload: bytes) -> None:
        self.bus, self.topic, self.payload = bus, topic, payload
        self.subscribed: list[str] = []

    async def subscribe(self, filters: list[str], *, qos: int = 1) -> list[str | None]:
        self.subscribed.extend(filters)
        for topic_filter in filters:
            if topic_matches(topic_filter, self.topic):
                self.bus._dispatch(self.topic, self.payload, retained=True)
        return [None] * len(filters)

    async def unsubscribe(self, topic_filter: str) -> None:
        pass


async def test_a_reread_without_our_copy_is_no_verdict_the_check_asks_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen on nats-server 2.14: the repaired link's check re-read the shard's filter, the
    broker sent no retained copy again for a filter it had granted (`bus_resync_empty`),
    and the link judged BrokerNoRetainedWildcard and never synced (a node missing from a
    formation for good). A re-read without our copy proves nothing: the check asks with
    its own new filter, which brings the copy, and the link passes."""
    topic = member_topic("n1")
    payload = encode(record("n1"))
    bus = bus_for(fast_settings("mqtt://127.0.0.1:1"), "n1", will=WillSpec(topic))
    bus._subs.add([MEMBERS])
    bus._records.declare(topic, Record(payload, None))
    bus._repairing = True
    client = GrantingClient(bus, topic, payload)

    async def blind_read(_client: object, filters: list[str]) -> bool:
        assert filters == [MEMBERS]
        return True  # granted, and no retained copy came back

    async def no_round_trip(_client: object) -> None:
        return None

    monkeypatch.setattr(bus, "_read_again", blind_read)
    monkeypatch.setattr(bus, "_round_trip", no_round_trip)
    assert await bus._check_retained(client) == CHECK_OVER  # type: ignore[arg-type]
    assert bus.no_retained_wildcard == ""
    assert client.subscribed == [topic.replace("/members/", "/+/")]
    checked = bus._queue.get_nowait()
    assert isinstance(checked, BrokerChecked)
    assert checked.ok


async def test_a_subscription_refused_for_good_is_reported_and_does_not_spin(
    broker: Mosquitto,
) -> None:
    """A broker that refuses our members filter for good (an ACL that refuses SUBSCRIBEs;
    Mosquitto 2.0's acl_file grants them and filters delivery instead): the bus says so,
    naming the broker and the filter, never syncs, and reconnects with the capped backoff
    (a link dropped for a refusal never counts as stable)."""
    refusing = RefusedSubscriptions({MEMBERS: None})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        settings = settings_311(relay.url, reconnect_initial_s=0.05, reconnect_max_s=0.4)
        bus = bus_for(settings, "n1")
        await bus.subscribe(MEMBERS)
        with capture_logs() as logs:
            async with bus:
                refused = await next_event(bus, SubscribeRefused)
                assert refused.broker == relay.url
                assert MEMBERS in bus.subscribe_refused
                assert relay.url in bus.subscribe_refused
                await no_event(bus, Synced, lambda _: True, 3.0)
                assert MEMBERS in (bus.last_error or "")
        waits = [e["delay_s"] for e in logs if e["event"] == "bus_reconnect_wait"]
        # Each link: the first try and three retries (0.35 s at most), then a wait that
        # grows to its cap: a handful of links in 3 s, not a spin.
        assert 2 <= relay.accepted <= 8
        assert max(waits) >= 0.2
        lost = [e["reason"] for e in logs if e["event"] == "bus_disconnected"]
        assert all(MEMBERS in reason for reason in lost if reason != "closed")


async def test_a_ping_echo_is_ours_only_with_the_stamp_we_sent() -> None:
    """Found by the simulator (seeds 600117, 604814): a new agent run that resumes its
    past run's MQTT 5 session is handed that run's queued ping echo; its sequence number
    matched the new run's first ping, which then proved a snapshot that was not in yet,
    and the agent resumed a record whose end the rest of the snapshot would have shown.
    An echo is ours only with the seq and the `sent` stamp of a ping we sent."""
    from imexd.bus.pings import Pings
    from imexd.logs import get_logger
    from imexd.messages import Ping

    sent: list[Ping] = []
    published = asyncio.Event()

    class Sender:
        async def publish(self, topic: str, payload: bytes, *, qos: int) -> None:
            sent.append(msgspec.json.decode(payload, type=Ping))
            published.set()

    pings = Pings("n1", "imex/v2/nodes/n1/ping", timeout_s=5.0)
    log = get_logger("test")
    trip = asyncio.ensure_future(pings.round_trip(Sender(), log))  # type: ignore[arg-type]
    await asyncio.wait_for(published.wait(), 1.0)
    ours = sent[0]
    pings.echoed(Ping(node="n1", seq=ours.seq, sent=ours.sent - 7.5))  # a past run's
    await asyncio.sleep(0.05)
    assert not trip.done()
    pings.echoed(ours)
    assert await asyncio.wait_for(trip, 1.0) >= 0.0
