# mypy: disable-error-code="no-untyped-call"
# (paho's Properties are untyped: every test here calls them)
"""The MQTT boundary's own rules: topic matching, and paho's lightened Properties.

Both exist for speed (docs/performance.md); these tests hold them to the behaviour of the
library code they stand in for.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt import MQTTException
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from imexd.bus import mqtt
from imexd.bus.mqtt import topic_matches
from imexd.settings import BusSettings, parse_broker_url
from tests.brokers import Mosquitto
from tests.support import until

ROOT = Path(__file__).resolve().parent.parent

LEVEL = st.sampled_from(["a", "b", "c", "", "imex", "n1%2Ex", "$SYS"])
TOPIC = st.lists(LEVEL, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def topic_filter(draw: st.DrawFn) -> str:
    """A valid filter: levels, `+` anywhere, `#` only last, sometimes a shared one."""
    levels = draw(st.lists(st.one_of(LEVEL, st.just("+")), min_size=1, max_size=5))
    if draw(st.booleans()):
        levels.append("#")
    text = "/".join(levels)
    if not text:
        text = "+"  # an empty filter is no filter
    if draw(st.integers(0, 9)) == 0:
        text = f"$share/group/{text}"
    return text


@given(topic_filter(), TOPIC)
def test_topic_matching_is_aiomqtts_rule(pattern: str, topic: str) -> None:
    """Every valid filter and topic match exactly when aiomqtt says they do."""
    assert topic_matches(pattern, topic) == aiomqtt.Topic(topic).matches(pattern)


@given(st.sampled_from(["a/b", "a", "a/b/c", "$share/g/a/b", "$sharex/a/b"]), TOPIC)
def test_a_filter_without_wildcards_matches_as_aiomqtt_says(pattern: str, topic: str) -> None:
    """A filter without `+` and `#` (a presence topic), shared or not, against any topic."""
    assert topic_matches(pattern, topic) == aiomqtt.Topic(topic).matches(pattern)
    assert topic_matches(pattern, pattern.removeprefix("$share/g/"))


def test_topic_matching_edge_cases() -> None:
    """`a/#` covers `a`, `+` needs a level, and a shared filter is matched without its
    `$share/<group>/` head (also when it equals the topic's text)."""
    assert topic_matches("a/#", "a")
    assert topic_matches("#", "a/b")
    assert not topic_matches("a/+", "a")
    assert topic_matches("a/+/", "a/b/")
    assert topic_matches("$share/g/a/+", "a/b")
    assert not topic_matches("$share/g/a", "$share/g/a")


# paho's Properties.


def paho_properties(packet_type: int) -> Properties:
    """A Properties made by paho's own constructor (as before the lightening)."""
    props = object.__new__(Properties)
    Properties._imexd_paho_init(props, packet_type)  # type: ignore[attr-defined]
    return props


CASES: list[tuple[int, dict[str, object]]] = [
    (PacketTypes.PUBLISH, {}),
    (
        PacketTypes.PUBLISH,
        {
            "PayloadFormatIndicator": 1,
            "MessageExpiryInterval": 90,
            "ContentType": "application/json",
            "ResponseTopic": "a/b",
            "CorrelationData": b"\x00\x01",
            "TopicAlias": 3,
            "UserProperty": [("k", "v"), ("k", "w")],
        },
    ),
    (
        PacketTypes.CONNECT,
        {
            "SessionExpiryInterval": 2,
            "ReceiveMaximum": 20,
            "MaximumPacketSize": 65536,
            "RequestProblemInformation": 0,
        },
    ),
    (PacketTypes.WILLMESSAGE, {"WillDelayInterval": 2, "MessageExpiryInterval": 5}),
    (PacketTypes.PUBACK, {"ReasonString": "not authorized", "UserProperty": ("a", "b")}),
]


def test_paho_properties_are_lightened() -> None:
    """On the installed paho the lightening applies (else only speed would be lost)."""
    assert mqtt.LIGHT_PROPERTIES


@pytest.mark.parametrize(("packet_type", "values"), CASES)
def test_light_properties_pack_and_unpack_like_pahos(
    packet_type: int, values: dict[str, object]
) -> None:
    """Set, packed, unpacked into an object that held other properties, printed and
    cleared: a lightened Properties behaves like one that paho's constructor made."""
    light, heavy = Properties(packet_type), paho_properties(packet_type)
    for name, value in values.items():
        setattr(light, name, value)
        setattr(heavy, name, value)
    wire = heavy.pack()
    assert light.pack() == wire
    assert light.json() == heavy.json()
    assert str(light) == str(heavy)
    assert light.isEmpty() == heavy.isEmpty() == (not values)
    for target in (Properties(packet_type), paho_properties(packet_type)):
        target.UserProperty = ("left", "from before")  # unpack must clear it
        _, length = target.unpack(wire[:])
        assert length == len(wire)
        assert target.json() == heavy.json()
    light.clear()
    Properties._imexd_paho_clear(heavy)  # type: ignore[attr-defined]
    assert light.isEmpty()
    assert heavy.isEmpty()
    assert light.__dict__.keys() == heavy.__dict__.keys()


@pytest.mark.parametrize(("packet_type", "values"), CASES)
def test_light_properties_pack_like_pahos_own_pack(
    packet_type: int, values: dict[str, object]
) -> None:
    """The lightened `pack` (set properties only, looked up) writes paho's bytes."""
    props = Properties(packet_type)
    for name, value in values.items():
        setattr(props, name, value)
    assert props.pack() == Properties._imexd_paho_pack(props)  # type: ignore[attr-defined]


def test_light_lookups_answer_as_pahos_scans() -> None:
    """A name's identifier, an identifier's name and whether a property repeats: the
    lookups give what paho's scans over the names give, for every name and identifier."""
    props = Properties(PacketTypes.PUBLISH)
    ident, name, multiple = Properties._imexd_paho_lookups  # type: ignore[attr-defined]
    names = [n.replace(" ", "") for n in props.names] + ["NoSuchProperty", ""]
    for compressed in names:
        assert props.getIdentFromName(compressed) == ident(props, compressed)
        assert props.allowsMultiple(compressed) == multiple(props, compressed)
    for identifier in [*props.names.values(), 0, 99]:
        assert props.getNameFromIdent(identifier) == name(props, identifier)


def test_light_properties_still_refuse_what_paho_refuses() -> None:
    """Validation is paho's own: an unknown name, or one that does not fit the packet."""
    props = Properties(PacketTypes.PUBLISH)
    with pytest.raises(MQTTException):
        props.NoSuchProperty = 1
    with pytest.raises(MQTTException):
        props.SessionExpiryInterval = 1


def test_the_shared_tables_stay_as_paho_builds_them() -> None:
    """Using many lightened Properties leaves the tables they share as a fresh paho
    constructor would build them."""
    for packet_type, values in CASES * 3:
        props = Properties(packet_type)
        for name, value in values.items():
            setattr(props, name, value)
        props.unpack(props.pack())
        props.clear()
    fresh = paho_properties(PacketTypes.PUBLISH)
    shared = Properties(PacketTypes.PUBLISH)
    for table in ("types", "names", "properties"):
        assert getattr(shared, table) == getattr(fresh, table)


async def test_a_link_the_broker_ended_leaves_no_unretrieved_exception(
    broker: Mosquitto,
) -> None:
    """The broker goes away while nobody reads the link's messages (a link between its
    connect and its reader, or one being closed): aiomqtt stores the end as an exception
    on a future that no one may ever await. The link owns that end, so asyncio never logs
    "Future exception was never retrieved" for it (seen on a NATS server killed under
    agents, as an `asyncio.error` in the agent's log)."""
    settings = BusSettings(url=(broker.url,), protocol="3.1.1")
    client = await mqtt.connect(
        settings, parse_broker_url(broker.url), client_id="ended", timeout_s=5.0
    )
    ended = client._inner._disconnected
    broker.stop()
    await until(ended.done, within=10, interval=0.02, what="aiomqtt's end of the link")
    # What asyncio's never-retrieved check looks at when the future is collected
    # (read before `exception()`, which clears it).
    assert ended._log_traceback is False
    assert ended.exception() is not None  # the end is an error, not a clean DISCONNECT


async def test_a_write_registered_as_the_link_breaks_touches_no_closed_socket(
    broker: Mosquitto,
) -> None:
    """paho asks for write interest (a publish), and the link breaks before the loop runs
    the deferred `add_writer`: the descriptor is closed by then, which asyncio reported
    as an `asyncio.error` (EBADF) in the agent's log (seen on a broker outage in CI)."""
    settings = BusSettings(url=(broker.url,), protocol="3.1.1")
    client = await mqtt.connect(
        settings, parse_broker_url(broker.url), client_id="breaking", timeout_s=5.0
    )
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        paho_client = client._inner._client
        sock = paho_client.socket()
        assert sock is not None
        paho_client.on_socket_register_write(paho_client, None, sock)  # type: ignore[misc]
        paho_client._sock_close()  # the reader saw the break, in the same loop turn
        await asyncio.sleep(0.1)
    finally:
        loop.set_exception_handler(None)
    assert errors == []


async def test_a_tcp_link_sends_each_packet_at_once(broker: Mosquitto) -> None:
    """TCP_NODELAY on every TCP link: a round trip of imexd is small packets written back
    to back, and with Nagle's algorithm the second waited for a delayed ACK (44 ms a
    round trip of `imexd workload create`; the broker's side is config/mosquitto.conf's
    `set_tcp_nodelay`)."""
    settings = BusSettings(url=(broker.url,))
    client = await mqtt.connect(
        settings, parse_broker_url(broker.url), client_id="nodelay", timeout_s=5.0
    )
    try:
        sock = client._inner._client.socket()
        assert isinstance(sock, socket.socket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        await client.close(2.0)


def test_the_shipped_and_the_demo_mosquitto_send_each_packet_at_once(tmp_path: Path) -> None:
    """Mosquitto leaves Nagle's algorithm on unless told: its SUBACK, the retained
    snapshot and the ping's echo then wait for the client's delayed ACK, 40 ms a round
    trip (1 to 2 ms with it)."""
    shipped = (ROOT / "config" / "mosquitto.conf").read_text().splitlines()
    assert "set_tcp_nodelay true" in shipped
    assert "set_tcp_nodelay true" in Mosquitto(tmp_path).config_text().splitlines()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_link_reads_its_messages_as_they_came(broker: Mosquitto, protocol: str) -> None:
    """`messages()` gives each message's topic, payload, whether it came from the retained
    store and (MQTT 5) the expiry left, in the order the broker sent them."""
    settings = BusSettings(url=(broker.url,), protocol=protocol)  # type: ignore[arg-type]
    url = parse_broker_url(broker.url)
    writer = await mqtt.connect(settings, url, client_id=f"w{protocol}", timeout_s=5.0)
    reader = await mqtt.connect(settings, url, client_id=f"r{protocol}", timeout_s=5.0)
    try:
        await writer.publish("t/kept", b"kept", retain=True, expiry_s=600.0)
        assert await reader.subscribe(["t/#"]) == [None]
        await writer.publish("t/live", b"")
        messages = reader.messages()
        async with asyncio.timeout(10):
            kept, live = await anext(messages), await anext(messages)
        v5 = protocol == "5"
        assert (kept.topic, kept.payload, kept.retained) == ("t/kept", b"kept", True)
        assert kept.expiry_s is None if not v5 else 0 < (kept.expiry_s or 0) <= 600
        assert live == mqtt.Message(topic="t/live", payload=b"", retained=False, expiry_s=None)
    finally:
        await writer.publish("t/kept", b"", retain=True)
        await reader.close(2.0)
        await writer.close(2.0)


async def test_a_publish_from_the_loop_wakes_no_self_pipe(
    broker: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    """paho asks for write interest from the connect's executor thread (through the
    loop's self-pipe) and from the loop itself for every publish (queued directly)."""
    settings = BusSettings(url=(broker.url,), protocol="3.1.1")
    loop = asyncio.get_running_loop()
    threadsafe: list[object] = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any, **kwargs: Any) -> asyncio.Handle:
        threadsafe.append(callback)
        return call_soon_threadsafe(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    client = await mqtt.connect(
        settings, parse_broker_url(broker.url), client_id="selfpipe", timeout_s=5.0
    )
    try:
        assert threadsafe, "the CONNECT, written from the executor thread"
        threadsafe.clear()
        for _ in range(3):
            await client.publish("t/x", b"1")
        assert [c for c in threadsafe if getattr(c, "__name__", "") == "when_still_open"] == []
    finally:
        await client.close(2.0)
