"""The MQTT boundary: the only module that imports aiomqtt and paho.

The agent's resilient link (`imexd.bus.link.Bus`) and the control plane's one-shot link
(`imexd.control.link.Link`) both connect through `connect` and talk through `Client`.
What they get is imexd's own: `Message`s with plain bytes, subscription results as text,
the broker's DISCONNECT reason as an int, and every failure as `imexd.errors.BusError`
(`raise BusError(...) from exc`, as httpcore does), so no aiomqtt or paho type reaches
the core and a library upgrade touches this file only.

Why it is built this way:
- Every connect asks for MQTT 5 (its Will Delay keeps a link blip from dropping the node)
  and falls back to 3.1.1 for that connect only when the broker says so (`[bus]
  protocol`, `protocol_versions`, `refuses_protocol`): a timeout is an outage, not a
  verdict.
- A paho hook gives what aiomqtt 2.x hides: a hang-up before CONNACK (which would
  otherwise wait for the timeout), and the reason code of the broker's DISCONNECT
  (`Client.server_reason`, e.g. `imexd.bus.events.SESSION_TAKEN_OVER`).
- A dead link is dropped without DISCONNECT (`Client.abort`), so the broker publishes the
  will; a clean leave sends DISCONNECT (`Client.close`), which suppresses it.
- The password is read anew for every connect, so a rotated secret is picked up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Self

import aiomqtt
import msgspec
import paho.mqtt.client as paho
from aiomqtt.exceptions import MqttConnectError
from aiomqtt.topic import MAX_TOPIC_LENGTH
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers
from paho.mqtt.reasoncodes import ReasonCode

from imexd.errors import BusError
from imexd.messages import MAX_PAYLOAD
from imexd.settings import BrokerURL, BusSettings

QOS: Final = 1
"""Every imexd message is QoS 1: records must arrive, duplicates are harmless."""

_UNSUPPORTED_PROTOCOL: Final = frozenset({1, 0x84})
"""CONNACK codes meaning "not this protocol version" (3.1.1's 1, MQTT 5's 0x84)."""

_MAX_PACKET: Final = 4 * MAX_PAYLOAD
"""MQTT 5 Maximum Packet Size we accept: a payload of 16 KiB plus a long topic and
properties; oversized payloads up to this size still arrive and are counted."""


# Pure helpers.


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether an MQTT topic filter (with `+` and `#`) matches a topic name.

    aiomqtt's rule (`aiomqtt.Topic.matches`, `$share/<group>/` stripped, `a/#` matching
    `a`), without its validation of both strings: the bus checks its own filters and
    topics when they are given to it, and this runs several times per delivered message
    (tests/test_mqtt.py holds it equal to aiomqtt's rule).
    """
    if topic_filter == topic and not topic.startswith("$share/"):
        return True
    if "+" not in topic_filter and "#" not in topic_filter and topic_filter[:6] != "$share":
        return False  # a topic name (a peer's presence) matches itself only
    pattern = topic_filter.split("/")
    if pattern[0] == "$share":
        pattern = pattern[2:]
    levels = topic.split("/")
    depth = len(levels)
    for i, level in enumerate(pattern):
        if level == "#":
            return True
        if i >= depth or (level != "+" and level != levels[i]):
            return False
    return depth == len(pattern)


def protocol_versions(settings: BusSettings) -> tuple[bool, ...]:
    """The MQTT versions one connect may try, in order: True for MQTT 5, False for 3.1.1.

    "auto" asks for MQTT 5 at every connect (its Will Delay keeps a blip from dropping
    the node) and falls back to 3.1.1 for that connect only when `refuses_protocol`.
    """
    match settings.protocol:
        case "5":
            return (True,)
        case "3.1.1":
            return (False,)
        case _:
            return (True, False)


class _ClosedBeforeConnackError(aiomqtt.MqttError):
    """The broker closed the connection after our CONNECT without a CONNACK."""


def refuses_protocol(exc: BaseException) -> bool:
    """Whether a failed connect means "the broker does not speak this MQTT version".

    Only the broker's own word counts: a CONNACK "unsupported protocol version", or a
    hang-up before any CONNACK (what some 3.1.1-only brokers do with an MQTT 5 CONNECT).
    A connect that times out says nothing about the protocol: a partition healing
    mid-connect looks just like that, and must not cost the Will Delay.
    """
    if isinstance(exc, _ClosedBeforeConnackError):
        return True
    if not isinstance(exc, MqttConnectError):
        return False
    rc = exc.rc
    value = rc.value if isinstance(rc, ReasonCode) else rc
    return value in _UNSUPPORTED_PROTOCOL


def describe_error(exc: BaseException) -> str:
    """One line for an exception and its causes (aiomqtt hides the reason in __cause__)."""
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(parts) < 4:
        text = str(current) or type(current).__name__
        if text not in parts:
            parts.append(text)
        current = current.__cause__
    return ": ".join(parts)


def _network_error(exc: BaseException) -> bool:
    """The connection failed below MQTT (refused, no route, unknown host): an address
    that no broker answers, most likely a wrong `[bus] url`."""
    current: BaseException | None = exc
    for _ in range(4):
        if current is None:
            return False
        if isinstance(current, ssl.SSLError | TimeoutError):
            return False  # TLS: a broker answered; a timeout has its own message
        if isinstance(current, OSError):
            return True
        current = current.__cause__ or current.__context__
    return False


def _failure(exc: aiomqtt.MqttError) -> BusError:
    """An aiomqtt error as imexd's own, its text saying why (causes included)."""
    error = BusError(describe_error(exc))
    error.__cause__ = exc
    return error


def read_password(settings: BusSettings) -> str | None:
    """The password from `password_file` (blocking), or None without a user name.

    Read anew for every connection, so a rotated secret is picked up; never logged.
    """
    if not (settings.username and settings.password_file):
        return None
    try:
        return Path(settings.password_file).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise BusError(
            f"cannot read bus.password_file {settings.password_file}: {reason}"
        ) from None


def _whole_seconds(seconds: float) -> int:
    return max(0, math.ceil(seconds))


def _properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call] # paho leaves it untyped


# paho's cost per packet.


def _lighten_properties() -> bool:
    """Make paho's MQTT 5 `Properties` cheap to create, clear, set and pack; whether it
    was done.

    paho 2.x builds two tables of 27 property names and types in every `Properties()`,
    which it creates for every PUBLISH and PUBACK it decodes, and `unpack` first clears
    the new object by trying all 27 names. That made an MQTT 5 link cost far more CPU than
    a 3.1.1 link (docs/performance.md). The tables are the same
    for every instance and paho never changes them, so every instance now shares one
    copy, and `clear` drops the set properties from the instance's own attributes (where
    paho's `__setattr__` puts them). Its scans of the names for a name's identifier and
    back, made on every property set, packed and read, are lookups in tables built once.
    Everything else, validation included, is paho's own.
    Done only where `Properties` looks as expected (paho 2: `types`, `names` and
    `properties` set in `__init__`, properties held as instance attributes); otherwise
    paho is left as it is, which is only slower.
    """
    cls = Properties
    if getattr(cls, "_imexd_light", False):
        return True
    original = cls.__init__
    probe = object.__new__(cls)
    try:
        original(probe, PacketTypes.PUBLISH)  # type: ignore[no-untyped-call] # paho's
        tables = {name: probe.__dict__[name] for name in ("types", "names", "properties")}
    except (KeyError, TypeError):
        return False
    if not isinstance(tables["names"], dict) or not isinstance(tables["properties"], dict):
        return False
    compressed = tuple(name.replace(" ", "") for name in tables["names"])

    def __init__(self: Properties, packetType: int) -> None:  # noqa: N803, N807 - paho's names
        fields = self.__dict__
        fields["packetType"] = packetType
        fields.update(tables)

    unset = 1 + len(tables)  # the attributes of an instance without properties

    def clear(self: Properties) -> None:
        fields = self.__dict__
        if len(fields) > unset:  # a new one (every unpack clears it first) holds none
            for name in compressed:
                fields.pop(name, None)

    # paho finds a name's identifier, an identifier's name and whether a property may
    # repeat by scanning the 27 names (compressing each) on every property set, packed
    # and read: the same answers, looked up. A name's first identifier and an
    # identifier's last name, as paho's scans find them.
    idents: dict[str, int] = {}
    for name, ident in tables["names"].items():
        idents.setdefault(name.replace(" ", ""), ident)
    names = {ident: name for name, ident in tables["names"].items()}

    def getIdentFromName(_self: Properties, compressedName: str) -> int:  # noqa: N802, N803
        return idents.get(compressedName, -1)

    def getNameFromIdent(_self: Properties, identifier: int) -> str | None:  # noqa: N802
        return names.get(identifier)

    def allowsMultiple(_self: Properties, compressedName: str) -> bool:  # noqa: N802, N803
        return idents.get(compressedName, -1) in _REPEATABLE

    def pack(self: Properties) -> bytes:
        buffer = b""
        fields = self.__dict__
        for name in compressed:  # paho's order
            if name in fields:
                identifier = idents[name]
                attr_type = tables["properties"][identifier][0]
                values = fields[name] if identifier in _REPEATABLE else (fields[name],)
                for value in values:
                    buffer += self.writeProperty(identifier, attr_type, value)  # type: ignore[no-untyped-call]
        return VariableByteIntegers.encode(len(buffer)) + buffer  # type: ignore[no-untyped-call,no-any-return]

    cls._imexd_paho_init = original  # type: ignore[attr-defined] # paho's own, for tests
    cls._imexd_paho_clear = cls.clear  # type: ignore[attr-defined]
    cls._imexd_paho_pack = cls.pack  # type: ignore[attr-defined]
    cls._imexd_paho_lookups = (  # type: ignore[attr-defined]
        cls.getIdentFromName,
        cls.getNameFromIdent,
        cls.allowsMultiple,
    )
    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.clear = clear  # type: ignore[method-assign]
    cls.getIdentFromName = getIdentFromName  # type: ignore[method-assign]
    cls.getNameFromIdent = getNameFromIdent  # type: ignore[method-assign]
    cls.allowsMultiple = allowsMultiple  # type: ignore[method-assign]
    cls.pack = pack  # type: ignore[method-assign]
    cls._imexd_light = True  # type: ignore[attr-defined]
    return True


_REPEATABLE: Final = (11, 38)
"""The identifiers paho lets a property hold several values of (Subscription Identifier,
User Property)."""

LIGHT_PROPERTIES: Final = _lighten_properties()
"""Whether paho's `Properties` were made cheap (`_lighten_properties`)."""


# What a client reports.


class Message(msgspec.Struct, frozen=True):
    """One incoming message, as plain data."""

    topic: str
    payload: bytes
    retained: bool
    """True when it comes from the broker's retained store (a snapshot), not live."""
    expiry_s: int | None
    """The Message Expiry Interval left (MQTT 5), None when it has none."""


class Will(msgspec.Struct, frozen=True):
    """The Last Will: a retained payload (QoS 1) on `topic`, delayed by `delay_s` (MQTT 5
    Will Delay; the session must outlive it, so it is also the session expiry).

    `payload` goes out on an MQTT 5 link, `payload_311` (None: the same) on a 3.1.1 one,
    which has no Will Delay: the payload may tell readers to wait instead.
    """

    topic: str
    delay_s: float
    payload: bytes = b""
    payload_311: bytes | None = None


class _Watch(msgspec.Struct):
    """What paho says about one connection that aiomqtt 2.x does not pass on."""

    server_reason: ReasonCode | None = None
    """The reason code of a DISCONNECT the broker sent (MQTT 5)."""


_LINK_ENDED: Final = object()
"""Put into aiomqtt's message queue once its link ended: `MessageStream` raises then."""


def _watch(client: aiomqtt.Client) -> _Watch:
    """Hook paho's disconnect callback of `client`, in front of aiomqtt's own.

    aiomqtt 2.x ignores a socket closed before CONNACK (the connect then waits for its
    timeout) and drops whether a DISCONNECT came from the broker. The hook fails the
    pending connect at once with `_ClosedBeforeConnackError` and keeps the broker's
    DISCONNECT reason in the returned `_Watch`. Once aiomqtt took the link's end, the hook
    also queues `_LINK_ENDED` behind the messages still to be read (`MessageStream`).
    """
    watch = _Watch()
    inner = client._client
    forward = client._on_disconnect  # what aiomqtt installed on paho

    def on_disconnect(
        paho_client: paho.Client,
        userdata: object,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None = None,
    ) -> None:
        if flags.is_disconnect_packet_from_server:
            watch.server_reason = reason_code
        connecting = client._connected
        if client._lock.locked() and not connecting.done():
            connecting.set_exception(
                _ClosedBeforeConnackError("the broker closed the connection before CONNACK")
            )
        ended = client._disconnected.done()
        forward(paho_client, userdata, flags, reason_code, properties)
        if not ended and client._disconnected.done():
            client._queue.put_nowait(_LINK_ENDED)  # type: ignore[arg-type] # read by us only

    inner.on_disconnect = on_disconnect
    return watch


def _translate(client: aiomqtt.Client) -> None:
    """Queue each incoming message as our `Message`, in place of aiomqtt's own.

    aiomqtt's paho callback wraps every message in its `Message` and `Topic`, which
    `MessageStream` only took apart again. The same callback, the same queue and the same
    checks (a topic aiomqtt would refuse raises, which ends the link as it did), one
    object fewer per message.
    """
    queue = client._queue

    def on_message(_client: paho.Client, _userdata: object, message: paho.MQTTMessage) -> None:
        topic = message.topic
        if not topic or len(topic) > MAX_TOPIC_LENGTH or "+" in topic or "#" in topic:
            raise ValueError(f"Invalid topic: {topic}")
        raw = message.payload
        expiry = getattr(getattr(message, "properties", None), "MessageExpiryInterval", None)
        translated = Message(
            topic=topic,
            payload=bytes(raw) if isinstance(raw, bytes | bytearray) else b"",
            retained=bool(message.retain),
            expiry_s=expiry if isinstance(expiry, int) else None,
        )
        try:
            queue.put_nowait(translated)  # type: ignore[arg-type] # read by MessageStream only
        except asyncio.QueueFull:
            MQTT_LOG.warning("Message queue is full. Discarding message.")

    client._client.on_message = on_message


def _guard_writer(client: aiomqtt.Client) -> None:
    """Register paho's write interest only while its socket is still the open one.

    aiomqtt defers `add_writer(fd)` to the loop (paho may ask from the connect's executor
    thread); when the link breaks in between, paho has closed the socket by the time it
    runs: asyncio then logs EBADF as an error, or, were the number reused, would watch
    someone else's descriptor. The same deferral, with the check made when it runs;
    asked from the loop itself (every publish but the CONNECT), it is queued without
    waking the loop through its self-pipe (two system calls a packet).
    """
    loop = client._loop

    def register_write(paho_client: paho.Client, userdata: object, sock: object) -> None:
        def write() -> None:
            try:
                paho_client.loop_write()
            except Exception as exc:  # a broken pipe: the link is over, as aiomqtt has it
                if not client._disconnected.done():
                    client._disconnected.set_exception(exc)

        def when_still_open() -> None:
            current = paho_client.socket()
            if current is not None and current is sock and current.fileno() >= 0:
                loop.add_writer(current.fileno(), write)

        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:  # the connect's executor thread
            on_loop = False
        if on_loop:
            loop.call_soon(when_still_open)  # no wake-up byte through the loop's self-pipe
        else:
            loop.call_soon_threadsafe(when_still_open)

    client._client.on_socket_register_write = register_write


def _own_end(ended: asyncio.Future[None]) -> None:
    """Mark the end of a link as seen (its cause is read where the end is handled)."""
    if not ended.cancelled():
        ended.exception()


class Client:
    """One connection to one broker, made by `connect`; every failure is a BusError."""

    def __init__(self, inner: aiomqtt.Client, *, v5: bool) -> None:
        self._inner = inner
        self._watch = _watch(inner)
        _translate(inner)
        _guard_writer(inner)
        self.v5 = v5
        """Whether the link speaks MQTT 5 (else 3.1.1: no will delay, no properties)."""

    @property
    def server_reason(self) -> int | None:
        """The reason code of the DISCONNECT the broker sent on this link, if any."""
        reason = self._watch.server_reason
        return int(reason.value) if reason is not None else None

    async def subscribe(self, filters: Sequence[str], *, qos: int = QOS) -> list[str | None]:
        """Subscribe at QoS `qos` (1; 0 only where at-most-once delivery will do); per
        filter None when granted, else the broker's refusal."""
        try:
            codes: list[int | ReasonCode] = list(
                await self._inner.subscribe([(f, qos) for f in filters])
            )
        except aiomqtt.MqttError as exc:
            raise _failure(exc) from exc
        refusals: list[str | None] = [None] * len(filters)
        for i, code in enumerate(codes[: len(filters)]):
            failed = code.is_failure if isinstance(code, ReasonCode) else code >= 0x80
            refusals[i] = str(code) if failed else None
        return refusals

    async def unsubscribe(self, topic_filter: str) -> None:
        try:
            await self._inner.unsubscribe(topic_filter)
        except aiomqtt.MqttError as exc:
            raise _failure(exc) from exc

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = QOS,
        retain: bool = False,
        expiry_s: float | None = None,
    ) -> None:
        """Publish and wait for the acknowledgement; `expiry_s` only counts on MQTT 5."""
        properties = None
        if expiry_s is not None and self.v5:
            properties = _properties(PacketTypes.PUBLISH)
            properties.MessageExpiryInterval = max(1, _whole_seconds(expiry_s))
        try:
            await self._inner.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        except aiomqtt.MqttError as exc:
            raise _failure(exc) from exc

    def messages(self) -> MessageStream:
        """`async for message in client.messages()`; raises BusError when the link ends."""
        return MessageStream(self._inner)

    async def close(self, timeout_s: float) -> str | None:
        """Clean DISCONNECT (the broker drops our will), bounded in time; None when it
        went out, else why not (the link is then aborted)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._inner.__aexit__(None, None, None)
        except (aiomqtt.MqttError, TimeoutError) as exc:
            self.abort()
            return describe_error(exc)
        return None

    def abort(self) -> None:
        """Drop the connection at once, without DISCONNECT.

        Without DISCONNECT the broker publishes our will (after its delay) if we do not
        come back: right for a dead link, where a DISCONNECT that slips through late would
        keep a stale record alive. Shutting the socket down wakes aiomqtt's reader, which
        then closes it and ends its own tasks.
        """
        # aiomqtt has no abort; its paho client owns the socket.
        sock = self._inner._client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def discard(self) -> None:
        """Close the socket of a client whose connect was cancelled, without callbacks.

        Cancelling aiomqtt's connect cancels its internal CONNACK future, after which its
        disconnect callback would fail; closing the socket through paho directly avoids
        that callback and still ends aiomqtt's reader and housekeeping task.
        """
        self._inner._client._sock_close()


class MessageStream:
    """The incoming messages of one link, each a `Message` (`_translate` queues them).

    Read from aiomqtt's message queue itself: aiomqtt's own iterator makes a task and an
    `asyncio.wait` for every message, about a third of what a delivered message cost the
    agent in CPU before it. The link's end arrives in the same queue (`_watch`), after the
    messages that came before it, and raises like aiomqtt's iterator did.
    """

    def __init__(self, inner: aiomqtt.Client) -> None:
        self._inner = inner
        self._queue = inner._queue

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Message:
        message = await self._queue.get()
        if message is _LINK_ENDED:
            self._queue.put_nowait(message)  # every later read ends too
            cause = self._inner._disconnected.exception()
            error = aiomqtt.MqttError("Disconnected during message iteration")
            error.__cause__ = cause
            raise _failure(error)
        return message  # type: ignore[return-value] # queued as ours (`_translate`)


_NO_DELAY: Final = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)
"""Send each packet at once (TCP_NODELAY; paho leaves Nagle's algorithm on). A round trip
of imexd is a few small packets written back to back (a SUBSCRIBE, then the ping that
proves its snapshot; a claim, then its barrier): with Nagle's algorithm the second waits
for the ACK of the first, which the peer's kernel may delay (Linux's delayed ACK;
docs/performance.md has what it cost). A Unix socket has no such option."""


def _client(
    settings: BusSettings,
    broker: BrokerURL,
    *,
    client_id: str,
    v5: bool,
    password: str | None,
    timeout_s: float,
    will: Will | None,
    resume: bool = False,
) -> aiomqtt.Client:
    """An aiomqtt client for one connection attempt to `broker` (TLS, Unix socket, auth).

    `resume` (the agent's bus, MQTT 5 only): Clean Start off, and the session outlives
    the Will Delay (Session Expiry Interval = the delay, at least 1 s), so that a reconnect
    within the delay resumes the session and the broker drops the delayed will. Otherwise
    (3.1.1, where a persistent session of a departed node would never expire, and the
    control plane's short links) every connection starts a fresh session. On MQTT 5 the
    broker is told the largest packet we take (it discards larger messages instead of
    making us buffer them).
    """
    tls = None
    if broker.tls:
        tls = aiomqtt.TLSParameters(
            ca_certs=settings.ca_file or None,
            certfile=settings.cert_file or None,
            keyfile=settings.key_file or None,
        )
    connect_properties: Properties | None = None
    if v5:
        connect_properties = _properties(PacketTypes.CONNECT)
        connect_properties.MaximumPacketSize = _MAX_PACKET
    aio_will: aiomqtt.Will | None = None
    delay = _whole_seconds(will.delay_s if will is not None else settings.will_delay_s)
    if connect_properties is not None and (will is not None or resume):
        # The will is delayed only while the session lives: it must outlive the delay.
        connect_properties.SessionExpiryInterval = max(1, delay) if resume else delay
    if will is not None:
        will_properties: Properties | None = None
        if connect_properties is not None:
            will_properties = _properties(PacketTypes.WILLMESSAGE)
            will_properties.WillDelayInterval = delay
        payload = will.payload if v5 or will.payload_311 is None else will.payload_311
        aio_will = aiomqtt.Will(
            will.topic, payload=payload or None, qos=QOS, retain=True, properties=will_properties
        )
    unix = broker.scheme == "unix"
    return aiomqtt.Client(
        broker.path if unix else broker.host,
        broker.port or 1883,
        transport="unix" if unix else "tcp",
        socket_options=() if unix else _NO_DELAY,
        username=settings.username or None,
        password=password,
        identifier=client_id,
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
        will=aio_will,
        clean_session=None if v5 else True,
        clean_start=not resume if v5 else paho.MQTT_CLEAN_START_FIRST_ONLY,
        properties=connect_properties,
        keepalive=max(1, round(settings.keepalive_s)),
        timeout=timeout_s,
        tls_params=tls,
        logger=MQTT_LOG,
    )


class _LateReply(logging.Filter):
    """aiomqtt logs a SUBACK or UNSUBACK that came after its request timed out (or was
    cancelled with its link) as an error with a traceback. Nothing is lost: the link
    subscribes again or is replaced. It becomes one warning without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Unexpected message ID"):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


MQTT_LOG: Final = logging.getLogger("mqtt")
"""aiomqtt's logger (its default name), with late replies demoted (`_LateReply`)."""
MQTT_LOG.addFilter(_LateReply())


Fallback = Callable[[str, str], None]
"""Told (error, message) when a connect falls back from MQTT 5 to 3.1.1."""


async def connect(
    settings: BusSettings,
    broker: BrokerURL,
    *,
    client_id: str,
    timeout_s: float,
    will: Will | None = None,
    connect_timeout_s: float | None = None,
    on_fallback: Fallback | None = None,
    resume: bool = False,
    took_v5: bool = False,
) -> Client:
    """Connect to `broker` with the first MQTT version it accepts.

    Every connect asks for MQTT 5 first (unless `[bus] protocol` says otherwise): a
    fallback to 3.1.1 holds for this connect only, and only when the broker said so.
    `timeout_s` bounds every broker round trip of the client (aiomqtt's own bound, the
    connect included); `connect_timeout_s`, when given, bounds each attempt as a whole.
    `resume`: on MQTT 5, resume the session of `client_id` (see `_client`).
    `took_v5`: this broker accepted MQTT 5 before, so a hang-up before CONNACK is a link
    fault (a load balancer with no backend, a broker restarting), not a refusal: only
    its CONNACK "unsupported protocol version" falls back then.
    Raises BusError naming the broker when the connect failed.
    """
    versions = protocol_versions(settings)
    for attempt, v5 in enumerate(versions, start=1):
        password = None
        if settings.username and settings.password_file:  # else no file to read off the loop
            password = await asyncio.to_thread(read_password, settings)
        inner = _client(
            settings,
            broker,
            client_id=client_id,
            v5=v5,
            password=password,
            timeout_s=timeout_s,
            will=will,
            resume=resume,
        )
        client = Client(inner, v5=v5)
        try:
            async with asyncio.timeout(connect_timeout_s):
                await inner.__aenter__()
        except TimeoutError:
            client.discard()
            if connect_timeout_s is None:
                raise
            raise BusError(
                f"cannot connect to {broker}: no answer within {connect_timeout_s:g} s"
            ) from None
        except aiomqtt.MqttError as exc:
            client.abort()
            refused = v5 and refuses_protocol(exc)
            if took_v5 and isinstance(exc, _ClosedBeforeConnackError):
                refused = False
            if refused and attempt < len(versions):
                if on_fallback is not None:
                    on_fallback(
                        describe_error(exc),
                        (
                            "the broker closed the connection to MQTT 5 before CONNACK"
                            if isinstance(exc, _ClosedBeforeConnackError)
                            else "the broker refused MQTT 5"
                        )
                        + ": this link uses 3.1.1, no Will Delay (the will fires at once)",
                    )
                continue
            detail = describe_error(exc)
            if refused:
                detail += ' (bus.protocol = "5": no fallback to 3.1.1)'
            elif _network_error(exc):
                detail += " (is a broker listening there? check [bus] url or IMEXD_BUS_URL)"
            raise BusError(f"cannot connect to {broker}: {detail}") from None
        except BaseException:
            client.discard()
            raise
        # aiomqtt keeps the link's end as an exception on this future, awaited only by its
        # own iterator and `__aexit__`; we learn of the end from `_watch` (and read the
        # cause there), so a link that ends while no one awaits it is not a lost error.
        inner._disconnected.add_done_callback(_own_end)
        return client
    raise AssertionError("protocol_versions() is never empty")  # pragma: no cover
