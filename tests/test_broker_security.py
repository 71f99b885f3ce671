"""The shipped broker configuration (config/mosquitto.conf, config/mosquitto.acl) for real.

Every test starts Mosquitto with the shipped files (only ports and paths changed, the ACL
byte for byte; see tests/brokers.py) and throwaway certificates, and talks to it on
loopback with plain aiomqtt clients, as an agent or the control plane would. The broker
drops a forbidden publish and aiomqtt still reports success (it ignores the MQTT 5
PUBACK reason code), so every refusal is proven by reading the target topic back through
a fresh subscription, and every live "nothing arrived" by a later message that must
arrive after it. Refusals below MQTT (TLS) are shown on a raw connection, which sees
exactly how it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiomqtt
import pytest
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from imexd.messages import MAX_PAYLOAD
from imexd.topics import Topics, encode_level
from tests.brokers import CONTROL_USER, Identity, Pki, ShippedBroker
from tests.support import raw_client, until

pytestmark = pytest.mark.timeout(20)

T = Topics("imex/v2")
DOMAIN = "d1"
CLIQUE = "4cf6c0d6-8ad0-4e1e-a3a4-3ad6b0e3a3b1.32766"
WAIT_S = 5.0
"""Bound on every wait for the broker; they normally take milliseconds."""
CONNACK_OK = b"\x20\x02\x00\x00"
"""An MQTT 3.1.1 CONNACK accepting the connection."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """One throwaway CA for the module: the broker's and every client's certificates."""
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def broker(tmp_path: Path, pki: Pki) -> Iterator[ShippedBroker]:
    """Mosquitto with the shipped files, certificate mode (as shipped)."""
    b = ShippedBroker(tmp_path / "broker", pki)
    b.start()
    try:
        yield b
    finally:
        b.stop()


# Clients.


@contextlib.asynccontextmanager
async def client(
    broker: ShippedBroker,
    name: str | None,
    *,
    username: str | None = None,
    password: str | None = None,
    client_id: str | None = None,
) -> AsyncIterator[aiomqtt.Client]:
    """An MQTT 5 client over TLS, as imexd connects: with the certificate of `name` if any."""
    identity = broker.pki.client(name) if name is not None else None
    async with raw_client(
        broker,
        wait_s=WAIT_S,
        tls_params=broker.tls(identity),
        username=username,
        password=password,
        identifier=client_id,
        keepalive=30,
    ) as c:
        yield c


async def publish(c: aiomqtt.Client, topic: str, payload: bytes | None) -> None:
    """A retained QoS 1 publish, as the bus writes records; returns at PUBACK."""
    async with asyncio.timeout(WAIT_S):
        await c.publish(topic, payload, qos=1, retain=True)


async def retained(broker: ShippedBroker, topic: str, *, name: str = CONTROL_USER) -> bytes | None:
    """The retained payload on `topic` as `name` reads it now; None when it gets none.

    A barrier record written just before is subscribed to after `topic`, so its arrival
    proves that a retained message on `topic`, if the reader may have one, came first.
    """
    barrier_topic = T.spec("barrier")
    barrier = uuid.uuid4().bytes
    async with client(broker, CONTROL_USER) as control:
        await publish(control, barrier_topic, barrier)
    found: bytes | None = None
    async with client(broker, name) as reader, asyncio.timeout(WAIT_S):
        await reader.subscribe(topic, qos=1)
        await reader.subscribe(barrier_topic, qos=1)
        async for message in reader.messages:
            if message.topic.matches(barrier_topic) and message.payload == barrier:
                return found
            if message.topic.matches(topic):
                assert isinstance(message.payload, bytes)
                found = message.payload
    raise AssertionError("unreachable: the message iterator ended")


async def topics_until(c: aiomqtt.Client, topic: str) -> list[str]:
    """Topics of the messages `c` receives up to and including the first on `topic`."""
    seen: list[str] = []
    async with asyncio.timeout(WAIT_S):
        async for message in c.messages:
            seen.append(message.topic.value)
            if message.topic.matches(topic):
                return seen
    raise AssertionError("unreachable: the message iterator ended")


# Raw connections: how a connection ends below MQTT, wills, oversized packets.


def _length(n: int) -> bytes:
    """MQTT's variable-length 'remaining length'."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return len(raw).to_bytes(2, "big") + raw


def connect_packet(client_id: str, *, will_topic: str | None = None) -> bytes:
    """MQTT 3.1.1 CONNECT, clean session, keep-alive 30 s; the will clears `will_topic`."""
    flags = 0x02
    payload = _string(client_id)
    if will_topic is not None:
        flags |= 0x04 | 0x08 | 0x20  # a will, QoS 1, retained
        payload += _string(will_topic) + _string(b"")
    body = _string("MQTT") + bytes([4, flags]) + (30).to_bytes(2, "big") + payload
    return b"\x10" + _length(len(body)) + body


def publish_packet(topic: str, payload: bytes) -> bytes:
    """MQTT 3.1.1 PUBLISH, QoS 0, retained."""
    body = _string(topic) + payload
    return b"\x31" + _length(len(body)) + body


def tls_context(pki: Pki, identity: Identity | None) -> ssl.SSLContext:
    """A client TLS context trusting `pki`'s CA and presenting `identity` if given."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    if identity is not None:
        ctx.load_cert_chain(str(identity.cert_file), str(identity.key_file))
    return ctx


@contextlib.asynccontextmanager
async def raw(
    broker: ShippedBroker, ctx: ssl.SSLContext | None
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A TCP connection to the broker, over TLS when `ctx` is given; aborted at the end."""
    async with asyncio.timeout(WAIT_S):
        reader, writer = await asyncio.open_connection(broker.host, broker.port, ssl=ctx)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


async def connect_reply(
    broker: ShippedBroker, ctx: ssl.SSLContext | None, *, send_connect: bool = True
) -> bytes | Exception:
    """The broker's first bytes on a new connection, or how the connection failed.

    Without `send_connect` the client only completes its side of the TLS handshake and
    listens: a broker that refuses the client's certificate then answers with a TLS
    alert. (Data sent after the handshake that the broker never reads would make it
    reset the connection, which can overtake the alert.)
    """
    try:
        async with raw(broker, ctx) as (reader, writer), asyncio.timeout(WAIT_S):
            if send_connect:
                writer.write(connect_packet("probe"))
                await writer.drain()
            return await reader.read(4)
    except (ssl.SSLError, ConnectionError) as exc:
        return exc


async def wait_for_log(broker: ShippedBroker, text: str) -> None:
    """Until the broker's log shows `text` (another process's file: polled, bounded)."""
    await until(
        lambda: text in broker.log_path.read_text(errors="replace"),
        within=WAIT_S,
        what=f"{text!r} in the broker's log",
    )


# Who can connect.


async def test_a_node_with_a_certificate_from_the_ca_connects(broker: ShippedBroker) -> None:
    """A client certificate signed by the bus CA gets a CONNACK that accepts it."""
    reply = await connect_reply(broker, tls_context(broker.pki, broker.pki.client("n1")))
    assert reply == CONNACK_OK


async def test_an_anonymous_client_is_refused_at_the_tls_handshake(broker: ShippedBroker) -> None:
    """A TLS client without a certificate is refused by a TLS alert and never gets a CONNACK."""
    reply = await connect_reply(broker, tls_context(broker.pki, None), send_connect=False)
    assert isinstance(reply, ssl.SSLError), reply
    assert "CERTIFICATE_REQUIRED" in str(reply) or "HANDSHAKE_FAILURE" in str(reply), reply
    await wait_for_log(broker, "peer did not return a certificate")


async def test_a_certificate_from_another_ca_is_refused(
    broker: ShippedBroker, tmp_path: Path
) -> None:
    """A node certificate with the right CN from a foreign CA fails the TLS handshake."""
    intruder = Pki(tmp_path / "other-ca").client("n1")
    reply = await connect_reply(broker, tls_context(broker.pki, intruder), send_connect=False)
    assert isinstance(reply, ssl.SSLError), reply
    assert "UNKNOWN_CA" in str(reply), reply
    await wait_for_log(broker, "certificate verify failed")


async def test_a_client_without_tls_cannot_use_the_listener(broker: ShippedBroker) -> None:
    """Plain MQTT on the TLS port gets no CONNACK: the broker drops the connection."""
    reply = await connect_reply(broker, None)
    assert reply == b"" or isinstance(reply, ConnectionError), reply
    await wait_for_log(broker, "wrong version number")


async def test_a_revoked_node_certificate_is_refused(tmp_path: Path, pki: Pki) -> None:
    """With crlfile enabled, a node whose certificate the CA revoked fails the handshake."""
    crl = pki.revocation_list("n1-revoked")
    broker = ShippedBroker(tmp_path / "crl-broker", pki, crl_file=crl)
    broker.start()
    try:
        revoked = tls_context(pki, pki.client("n1-revoked"))
        reply = await connect_reply(broker, revoked, send_connect=False)
        assert isinstance(reply, ssl.SSLError), reply
        assert "REVOKED" in str(reply), reply
        assert await connect_reply(broker, tls_context(pki, pki.client("n2"))) == CONNACK_OK
    finally:
        broker.stop()


# What a node may write and read.


async def test_a_node_writes_its_own_records_and_peers_read_them(broker: ShippedBroker) -> None:
    """n1 writes its retained member and health records; n2 gets them live and retained."""
    member, health = T.member(DOMAIN, CLIQUE, "n1"), T.health(DOMAIN, "n1")
    async with client(broker, "n1") as n1, client(broker, "n2") as n2:
        await n2.subscribe(T.members_filter(DOMAIN, CLIQUE), qos=1)
        await n2.subscribe(T.health_filter(DOMAIN), qos=1)
        await publish(n1, member, b'{"v":1,"node":"n1"}')
        await publish(n1, health, b'{"v":1,"node":"n1","ready":true}')
        assert await topics_until(n2, health) == [member, health]
        # Its own link probe makes the round trip.
        await n1.subscribe(T.ping("n1"), qos=1)
        await n1.publish(T.ping("n1"), b"probe", qos=1)
        assert await topics_until(n1, T.ping("n1")) == [T.ping("n1")]
    assert await retained(broker, member, name="n2") == b'{"v":1,"node":"n1"}'
    assert await retained(broker, health, name="n2") == b'{"v":1,"node":"n1","ready":true}'


async def test_a_node_cannot_overwrite_or_clear_another_nodes_records(
    broker: ShippedBroker,
) -> None:
    """n1's publishes on n2's member, health and ping topics are dropped; n2's records stand."""
    member, health = T.member(DOMAIN, CLIQUE, "n2"), T.health(DOMAIN, "n2")
    async with client(broker, "n2") as n2:
        await publish(n2, member, b"n2-member")
        await publish(n2, health, b"n2-health")
        await n2.subscribe(T.ping("n2"), qos=1)
        async with client(broker, "n3") as watcher:
            await watcher.subscribe(T.all_members_filter(DOMAIN), qos=1)
            await watcher.subscribe(T.health_filter(DOMAIN), qos=1)
            assert await topics_until(watcher, health) == [member, health]  # the snapshot
            async with client(broker, "n1", username="n2") as n1:
                await publish(n1, member, b"forged-by-n1")
                await publish(n1, T.member(DOMAIN, "none", "n2"), b"forged-by-n1")
                await publish(n1, member, None)  # clearing is writing too
                await publish(n1, health, b"forged-by-n1")
                await n1.publish(T.ping("n2"), b"forged-by-n1", qos=1)
                # Its own record, published last, is the first thing anyone else sees.
                await publish(n1, T.member(DOMAIN, CLIQUE, "n1"), b"n1-member")
            mine = T.member(DOMAIN, CLIQUE, "n1")
            assert await topics_until(watcher, mine) == [mine]
        # n2 proves its own link after the forged probe: that probe never reached it.
        await n2.publish(T.ping("n2"), b"n2-probe", qos=1)
        async with asyncio.timeout(WAIT_S):
            message = await anext(aiter(n2.messages))
        assert message.payload == b"n2-probe"
    assert await retained(broker, member) == b"n2-member"
    assert await retained(broker, health) == b"n2-health"
    assert await retained(broker, T.member(DOMAIN, "none", "n2")) is None


async def test_a_dotted_node_writes_as_its_encoded_name_and_not_as_its_raw_name(
    broker: ShippedBroker,
) -> None:
    """The ACL's %u meets the encoded topic level: ip-10-0-1-2.ec2.internal writes its
    records with the CN ip-10-0-1-2%2Eec2%2Einternal, and with its raw dotted CN nothing."""
    node = "ip-10-0-1-2.ec2.internal"
    encoded = encode_level(node)
    assert encoded == "ip-10-0-1-2%2Eec2%2Einternal"
    member, health = T.member(DOMAIN, CLIQUE, node), T.health(DOMAIN, node)
    async with client(broker, node) as raw_name:
        await publish(raw_name, member, b"raw-name")
        await publish(raw_name, health, b"raw-name")
        await publish(raw_name, T.presence(node), b"raw-name")
    assert await retained(broker, member) is None
    assert await retained(broker, health) is None
    assert await retained(broker, T.presence(node)) is None
    async with client(broker, encoded) as encoded_name:
        await publish(encoded_name, member, b"encoded-name")
        await publish(encoded_name, health, b"encoded-name")
        await publish(encoded_name, T.presence(node), b"encoded-name")
        # Its link probe makes the round trip too.
        await encoded_name.subscribe(T.ping(node), qos=1)
        await encoded_name.publish(T.ping(node), b"probe", qos=1)
        assert await topics_until(encoded_name, T.ping(node)) == [T.ping(node)]
    assert await retained(broker, member) == b"encoded-name"
    assert await retained(broker, health) == b"encoded-name"
    assert await retained(broker, T.presence(node)) == b"encoded-name"


async def test_a_node_writes_only_its_own_presence_and_its_peers_read_it(
    broker: ShippedBroker,
) -> None:
    """n1's presence stands; its forgery of n2's is dropped; the control plane and the
    peers read it (it carries the node's Last Will, which ends its member records)."""
    async with client(broker, "n1") as n1:
        await publish(n1, T.presence("n1"), b"n1-here")
        await publish(n1, T.presence("n2"), b"forged-by-n1")
    assert await retained(broker, T.presence("n1"), name=CONTROL_USER) == b"n1-here"
    assert await retained(broker, T.presence("n2"), name=CONTROL_USER) is None
    assert await retained(broker, T.presence("n1"), name="n2") == b"n1-here"


async def test_a_node_cannot_write_another_nodes_assignment(broker: ShippedBroker) -> None:
    """A node's forgery of a peer's assignment is dropped; the control plane's stands."""
    async with client(broker, CONTROL_USER) as control:
        await publish(control, T.assignment("n2"), b"control-n2")
    async with client(broker, "n1") as n1:
        await publish(n1, T.assignment("n2"), b"forged-by-n1")
        await publish(n1, T.assignment("n3"), b"forged-by-n1")
    assert await retained(broker, T.assignment("n2")) == b"control-n2"
    assert await retained(broker, T.assignment("n3")) is None


async def test_only_the_control_plane_asks_a_node_to_retry_and_the_node_reads_it(
    broker: ShippedBroker,
) -> None:
    """`imexd node retry`'s request stands; a node cannot forge one, for a peer or itself,
    and reads its own through the domains' read grant."""
    async with client(broker, CONTROL_USER) as control:
        await publish(control, T.retry("d1", "n2"), b"control-retry")
    async with client(broker, "n1") as n1:
        await publish(n1, T.retry("d1", "n2"), b"forged-by-n1")
        await publish(n1, T.retry("d1", "n1"), b"forged-by-n1")
    assert await retained(broker, T.retry("d1", "n2"), name="n2") == b"control-retry"
    assert await retained(broker, T.retry("d1", "n1")) is None


async def test_a_node_gives_an_empty_broker_back_what_it_follows(broker: ShippedBroker) -> None:
    """The rebuild grants (imexd.agent.rebuild): a node writes a spec, a workload record and
    its own assignment; nothing else of the control plane's, and no peer's topic, opens up
    with them."""
    workload = T.workload(DOMAIN, "job-a")
    async with client(broker, "n1") as n1:
        await publish(n1, T.spec(DOMAIN), b"restored-spec")
        await publish(n1, workload, b"restored-workload")
        await publish(n1, T.assignment("n1"), b"restored-assignment")
        await publish(n1, T.health(DOMAIN, "n2"), b"forged-by-n1")
        await publish(n1, T.presence("n2"), b"forged-by-n1")
    assert await retained(broker, T.spec(DOMAIN)) == b"restored-spec"
    assert await retained(broker, workload) == b"restored-workload"
    assert await retained(broker, T.assignment("n1"), name="n1") == b"restored-assignment"
    assert await retained(broker, T.health(DOMAIN, "n2")) is None
    assert await retained(broker, T.presence("n2")) is None


async def test_the_control_plane_writes_specs_and_assignments_nodes_read_their_own(
    broker: ShippedBroker,
) -> None:
    """Nodes read specs and their own assignment, never a peer's assignment or link probe."""
    async with client(broker, CONTROL_USER) as control:
        await publish(control, T.spec(DOMAIN), b"spec")
        await publish(control, T.assignment("n1"), b"n1-assigned")
        await publish(control, T.assignment("n2"), b"n2-assigned")
    assert await retained(broker, T.assignment("n1"), name="n1") == b"n1-assigned"
    assert await retained(broker, T.assignment("n2"), name="n2") == b"n2-assigned"
    assert await retained(broker, T.assignment("n2"), name="n1") is None
    async with client(broker, "n1") as n1, client(broker, "n2") as n2:
        await n1.subscribe("imex/v2/#", qos=1)  # granted; delivery is filtered
        await n2.publish(T.ping("n2"), b"n2-probe", qos=1)
        await publish(n2, T.health(DOMAIN, "n2"), b"n2-health")
        seen = await topics_until(n1, T.health(DOMAIN, "n2"))
    assert sorted(seen) == sorted(
        [T.spec(DOMAIN), T.spec("barrier"), T.assignment("n1"), T.health(DOMAIN, "n2")]
    )


async def test_the_control_plane_clears_a_gone_nodes_records(broker: ShippedBroker) -> None:
    """The control plane may clear member and health records that their node left behind."""
    member, health = T.member(DOMAIN, CLIQUE, "n1"), T.health(DOMAIN, "n1")
    async with client(broker, "n1") as n1:
        await publish(n1, member, b"n1-member")
        await publish(n1, health, b"n1-health")
        await publish(n1, T.presence("n1"), b"n1-presence")
    assert await retained(broker, T.presence("n1")) == b"n1-presence"
    async with client(broker, CONTROL_USER) as control:
        await publish(control, member, None)
        await publish(control, health, None)
        await publish(control, T.presence("n1"), None)  # `imexd node forget`
        await publish(control, T.spec(DOMAIN), None)
    assert await retained(broker, member) is None
    assert await retained(broker, health) is None
    assert await retained(broker, T.presence("n1")) is None
    assert await retained(broker, T.spec(DOMAIN)) is None


async def test_a_will_lands_only_on_its_own_nodes_presence(broker: ShippedBroker) -> None:
    """A vanished node's will (an empty payload here) lands on its own presence, where the
    agent sets it; a will aimed at a peer's is dropped."""
    ctx = tls_context(broker.pki, broker.pki.client("n1"))
    ours, theirs = T.presence("n1"), T.presence("n2")
    async with client(broker, "n1") as n1, client(broker, "n2") as n2:
        await publish(n1, ours, b"n1-member")
        await publish(n2, theirs, b"n2-member")
    for will_topic, client_id in ((theirs, "n1-evil"), (ours, "n1-agent")):
        async with raw(broker, ctx) as (reader, writer), asyncio.timeout(WAIT_S):
            writer.write(connect_packet(client_id, will_topic=will_topic))
            await writer.drain()
            assert await reader.readexactly(4) == CONNACK_OK
        # Aborted without DISCONNECT: the broker sends the will (if the ACL allows it).
        await wait_for_log(broker, f"Client {client_id} closed its connection")
    assert await retained(broker, theirs) == b"n2-member"
    assert await retained(broker, ours) is None


# Broker-wide settings.


async def test_retained_records_survive_a_broker_restart(broker: ShippedBroker) -> None:
    """Members, specs and assignments are persisted and served again after a restart."""
    async with client(broker, "n1") as n1:
        await publish(n1, T.member(DOMAIN, CLIQUE, "n1"), b"n1-member")
    async with client(broker, CONTROL_USER) as control:
        await publish(control, T.spec(DOMAIN), b"spec")
        await publish(control, T.assignment("n1"), b"n1-assigned")
    await asyncio.to_thread(broker.stop)
    await asyncio.to_thread(broker.start)
    assert await retained(broker, T.member(DOMAIN, CLIQUE, "n1"), name="n2") == b"n1-member"
    assert await retained(broker, T.spec(DOMAIN), name="n1") == b"spec"
    assert await retained(broker, T.assignment("n1"), name="n1") == b"n1-assigned"


async def test_a_full_size_record_passes_and_an_oversized_packet_is_refused(
    broker: ShippedBroker,
) -> None:
    """A 16 KiB payload on the longest topic is stored; a bigger packet ends the connection."""
    node = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # 253 characters
    topic = T.member("x" * 63, "e" * 128, node)
    full = b"f" * MAX_PAYLOAD
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call] # paho: untyped
    properties.MessageExpiryInterval = 3600
    async with client(broker, CONTROL_USER) as control, asyncio.timeout(WAIT_S):
        await control.publish(topic, full, qos=1, retain=True, properties=properties)
    assert await retained(broker, topic) == full
    ctx = tls_context(broker.pki, broker.pki.client(CONTROL_USER))
    async with raw(broker, ctx) as (reader, writer), asyncio.timeout(WAIT_S):
        writer.write(connect_packet("oversized"))
        assert await reader.readexactly(4) == CONNACK_OK
        writer.write(publish_packet(topic, b"g" * (20 * 1024)))
        # Closed by the broker; with the rest of the packet unread, perhaps by a reset.
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read(1) == b""
    await wait_for_log(broker, "oversize packet")
    assert await retained(broker, topic) == full


@pytest.mark.parametrize("hardened", [False, True], ids=["as-shipped", "username-as-clientid"])
async def test_taking_over_a_peers_session_needs_use_username_as_clientid_off(
    tmp_path: Path, pki: Pki, hardened: bool
) -> None:
    """n1 connecting with n2's client id disconnects n2, unless use_username_as_clientid is on."""
    broker = ShippedBroker(tmp_path / "takeover", pki, username_as_clientid=hardened)
    broker.start()
    try:
        async with client(broker, "n2", client_id="imexd-n2") as n2:
            await n2.subscribe(T.ping("n2"), qos=1)
            async with client(broker, "n1", client_id="imexd-n2"):
                if hardened:
                    await n2.publish(T.ping("n2"), b"n2-probe", qos=1)
                    async with asyncio.timeout(WAIT_S):
                        message = await anext(aiter(n2.messages))
                    assert message.payload == b"n2-probe"
                else:
                    # MQTT 5 says "session taken over"; Mosquitto 2.0.11 "unspecified error".
                    with pytest.raises(aiomqtt.MqttError, match="Disconnected"):
                        async with asyncio.timeout(WAIT_S):
                            await anext(aiter(n2.messages))
                    await wait_for_log(broker, "already connected, closing old connection")
    finally:
        broker.stop()


# Password mode: the alternative the config describes (TLS without client certificates).


@pytest.fixture
def password_broker(tmp_path: Path, pki: Pki) -> Iterator[ShippedBroker]:
    """Mosquitto with the shipped files switched to password mode as the comments say."""
    passwords = {"n1": "n1-secret", "n2": "n2-secret", CONTROL_USER: "control-secret"}
    b = ShippedBroker(tmp_path / "password-broker", pki, passwords=passwords)
    b.start()
    try:
        yield b
    finally:
        b.stop()


async def test_password_mode_refuses_anonymous_clients_and_wrong_passwords(
    password_broker: ShippedBroker,
) -> None:
    """Without a user name, or with another node's name and a wrong password, CONNACK refuses."""
    for username, password in ((None, None), ("n2", "n1-secret"), ("n1", None)):
        with pytest.raises(MqttConnectError) as refused:
            async with client(password_broker, None, username=username, password=password):
                pass
        assert "authori" in str(refused.value).lower(), refused.value


async def test_password_mode_confines_nodes_to_their_own_records(
    password_broker: ShippedBroker,
) -> None:
    """A node logged in with its password writes its own member record and not a peer's."""
    ours, theirs = T.member(DOMAIN, CLIQUE, "n1"), T.member(DOMAIN, CLIQUE, "n2")
    async with client(password_broker, None, username="n2", password="n2-secret") as n2:
        await publish(n2, theirs, b"n2-member")
    async with client(password_broker, None, username="n1", password="n1-secret") as n1:
        await publish(n1, theirs, b"forged-by-n1")
        await publish(n1, ours, b"n1-member")
    async with client(
        password_broker, None, username=CONTROL_USER, password="control-secret"
    ) as control:
        await publish(control, T.spec(DOMAIN), b"spec")
        await control.subscribe(T.all_members_filter(DOMAIN), qos=1)
        seen: dict[str, object] = {}
        async with asyncio.timeout(WAIT_S):
            async for message in control.messages:
                seen[message.topic.value] = message.payload
                if len(seen) == 2:
                    break
    assert seen == {ours: b"n1-member", theirs: b"n2-member"}


WORKLOAD_CHANNELS = 2048
"""The driver's default ImexChannelCount: a domain holds at most this many workloads."""


async def test_a_whole_domain_of_workloads_reaches_a_qos_1_subscriber(
    broker: ShippedBroker,
) -> None:
    """An agent's QoS 1 subscription to its domain's workloads gets every record of a domain
    that uses all its channels: Mosquitto drops a snapshot's messages beyond the in-flight
    window plus `max_queued_messages` without a word, and the shipped queue holds it."""
    async with client(broker, CONTROL_USER) as control:
        for channel in range(WORKLOAD_CHANNELS):
            name = f"w{channel:04d}"
            payload = b'{"v":1,"workload":"%s","domain":"d1","channel":%d}' % (
                name.encode(),
                channel,
            )
            await publish(control, T.workload("d1", name), payload)
        await publish(control, T.spec("barrier"), b"end")
    got = 0
    async with client(broker, "n1") as agent, asyncio.timeout(60):
        await agent.subscribe(T.workloads_filter("d1"), qos=1)
        await agent.subscribe(T.spec("barrier"), qos=1)
        async for message in agent.messages:
            if message.topic.matches(T.spec("barrier")):
                break
            got += 1
    assert got == WORKLOAD_CHANNELS
