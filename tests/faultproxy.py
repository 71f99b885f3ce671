"""The one TCP relay of the tests: a fault-injection proxy in front of a broker, and the
misbehaving brokers it can stand for.

`FaultProxy` listens on a fresh 127.x.y.z address and forwards every connection to the
target (the broker). Its asyncio loop runs in a thread of its own, so that plain tests
and tests with an event loop steer it alike, with thread-safe calls that return once the
change is in effect:

- `delay(seconds, direction)`: every chunk read from then on is forwarded `seconds`
  after it arrived, in order (a slow or congested link).
- `drop(direction)`: a silent partition. Sockets stay open, nothing is forwarded, no
  close is passed on; new connections are accepted but reach nothing (their SYN "got
  lost"). What was held back is delivered, in order, at `heal()`, as TCP retransmission
  would: if one end closed meanwhile, the other sees the close then.
- `cut()`: every connection is reset (both sides) and new ones are reset at once; a
  `cut()` then `heal()` breaks every connection that lived through a partition, as a
  long one does.
- `hang_up(count)`: like `cut()`, but a new connection is closed only once its first
  bytes (the client's CONNECT) arrived, as a load balancer with no backend does; after
  `count` such connections (None: until `heal()`) the link is transparent again.
- `end_with(data)`: every open connection's client gets `data` (an MQTT 5 DISCONNECT),
  then the connection is closed, as a broker that ends sessions does.
- `heal()`: back to a transparent link (no delay, no drop, no cut).

With a `Rule` the proxy reads whole MQTT packets and the rule decides what each one
becomes: the brokers below that refuse MQTT 5 (`Only311`), refuse subscriptions as a NATS
cluster does (`RefusedSubscriptions`), or withhold retained messages (`NoRetained`).

Directions: "up" is client -> broker, "down" broker -> client, "both" is both. Only
127.0.0.0/8 is used; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

from imexd.demo.brokers import free_port
from tests.support import loopback_address

Direction = Literal["up", "down", "both"]
T = TypeVar("T")
_CHUNK = 65536
_CONTROL_TIMEOUT_S = 5.0


@dataclass
class _Way:
    """The state of one direction: its delay and whether it is held (dropped)."""

    delay_s: float = 0.0
    held: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def set_held(self, held: bool) -> None:
        self.held = held
        if held:
            self.released.clear()
        else:
            self.released.set()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a vanished peer or a firewall reject would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Pipe:
    """One direction of one connection: what was read (or a rule sent) is forwarded
    late, in order, and not while the direction is held; None marks the end."""

    def __init__(self, way: _Way, counter: list[int]) -> None:
        self.way = way
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.ready = asyncio.Event()
        self.counter = counter

    def put(self, data: bytes | None) -> None:
        self.queue.append((time.monotonic() + self.way.delay_s, data))
        self.ready.set()

    async def read(
        self, src: asyncio.StreamReader, packets: Callable[[bytes], bytes] | None
    ) -> None:
        """Read chunks until EOF or error; with `packets`, whole MQTT packets, each one
        replaced by what `packets` makes of it (nothing: b"")."""
        try:
            while True:
                if packets is None:
                    data = await src.read(_CHUNK)
                    if not data:
                        break
                else:
                    data = packets(await read_packet(src))
                if data:
                    self.put(data)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.put(None)

    async def write(self, dst: asyncio.StreamWriter) -> None:
        """Forward queued chunks to `dst` when due and not held; close it after the end."""
        try:
            while True:
                while not self.queue:
                    self.ready.clear()
                    await self.ready.wait()
                due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self.way.released.wait()
                self.queue.popleft()
                if data is None:
                    break
                dst.write(data)
                await dst.drain()
                self.counter[0] += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()


class Link:
    """One proxied connection as a `Rule` sees it: it may answer either end (in order with
    what is forwarded that way) or hang up."""

    def __init__(self, up: _Pipe, down: _Pipe) -> None:
        self._up = up
        self._down = down

    def to_client(self, data: bytes) -> None:
        self._down.put(data)

    def to_broker(self, data: bytes) -> None:
        self._up.put(data)

    def hang_up(self) -> None:
        """Close the client's side once what was sent to it is out."""
        self._down.put(None)


class _Conn:
    """One client connection and its upstream twin."""

    def __init__(self, client_w: asyncio.StreamWriter) -> None:
        self.client_w = client_w
        self.upstream_w: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def reset(self) -> None:
        _reset(self.client_w)
        if self.upstream_w is not None:
            _reset(self.upstream_w)
        for task in self.tasks:
            task.cancel()

    def end_with(self, data: bytes) -> None:
        """Stop forwarding, send the client `data` and close its side; reset the broker's."""
        for task in self.tasks:
            task.cancel()
        self.client_w.write(data)
        self.client_w.close()
        if self.upstream_w is not None:
            _reset(self.upstream_w)


class FaultProxy:
    """A TCP proxy to `target` with delay, drop (silent partition), cut and heal; with a
    `rule`, MQTT-aware (the rule sees and may change every packet)."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        host: str | None = None,
        rule: Rule | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.host = host or loopback_address()
        self.port = free_port(self.host)
        self.rule = rule
        self.up = _Way()
        self.down = _Way()
        self.is_cut = False
        self.hangs_up = False
        self._hang_ups_left: int | None = None
        self.accepted = 0
        """Connections accepted so far (refused ones while cut included)."""
        self.hung_up = 0
        """Connections closed after their first bytes by `hang_up()`."""
        self.bytes_up = [0]
        self.bytes_down = [0]
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._started = False

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    # Life cycle.

    def start(self) -> Self:
        self._thread.start()
        self._started = True
        self._call(self._start())
        return self

    def close(self) -> None:
        """Reset every connection, stop listening and end the thread (idempotent)."""
        if not self._started:
            return
        self._started = False
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_CONTROL_TIMEOUT_S)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # Control (from any thread).

    def delay(self, seconds: float, direction: Direction = "both") -> None:
        """Forward every chunk read from now on `seconds` after it arrived, in order."""

        async def apply() -> None:
            for way in self._ways(direction):
                way.delay_s = seconds

        self._call(apply())

    def drop(self, direction: Direction = "both") -> None:
        """Silent partition: forward nothing, close nothing, until `heal()`."""

        async def apply() -> None:
            for way in self._ways(direction):
                way.set_held(True)

        self._call(apply())

    def cut(self) -> None:
        """Reset every connection and every new one until `heal()`."""

        async def apply() -> None:
            self.is_cut = True
            for conn in list(self._conns):
                conn.reset()
            self._conns.clear()

        self._call(apply())

    def hang_up(self, count: int | None = None) -> None:
        """Reset every connection; read each new one's first bytes, then close it; after
        `count` of them (None: until `heal()`) the link is transparent again."""
        self.cut()

        async def apply() -> None:
            self.hangs_up = True
            self._hang_ups_left = count

        self._call(apply())

    def end_with(self, data: bytes) -> None:
        """Send every open connection's client `data`, then close the connection."""

        async def apply() -> None:
            for conn in list(self._conns):
                conn.end_with(data)
            self._conns.clear()

        self._call(apply())

    def heal(self) -> None:
        """A transparent link again; what a drop held back is delivered now, in order."""

        async def apply() -> None:
            self.is_cut = False
            self.hangs_up = False
            for way in (self.up, self.down):
                way.delay_s = 0.0
                way.set_held(False)

        self._call(apply())

    def connections(self) -> int:
        """Client connections currently open through the proxy."""

        async def count() -> int:
            return len(self._conns)

        return self._call(count())

    # Inside the loop.

    def _ways(self, direction: Direction) -> list[_Way]:
        return {"up": [self.up], "down": [self.down], "both": [self.up, self.down]}[direction]

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=_CONTROL_TIMEOUT_S)

    async def _start(self) -> None:
        self.up.set_held(False)
        self.down.set_held(False)
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, reuse_address=True
        )

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.reset()
        self._conns.clear()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.is_cut:
            if self.hangs_up:
                if self._hang_ups_left is not None:
                    self._hang_ups_left -= 1
                    if self._hang_ups_left <= 0:
                        self.is_cut = self.hangs_up = False
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(client_r.read(1), timeout=_CONTROL_TIMEOUT_S)
                client_w.close()
                self.hung_up += 1
                return
            _reset(client_w)
            return
        conn = _Conn(client_w)
        self._conns.add(conn)
        current = asyncio.current_task()
        assert current is not None
        conn.tasks.append(current)
        up = _Pipe(self.up, self.bytes_up)
        down = _Pipe(self.down, self.bytes_down)
        rule, link = self.rule, Link(up, down)
        reading = asyncio.create_task(
            up.read(client_r, None if rule is None else lambda p: rule.up(p, link))
        )
        answering = asyncio.create_task(down.write(client_w))
        conn.tasks += [reading, answering]
        try:
            # While the way up is held, the connection attempt is lost too.
            await self.up.released.wait()
            if reading.done():
                return  # the client gave up before the link came back: its SYN is moot
            try:
                upstream_r, upstream_w = await asyncio.wait_for(
                    asyncio.open_connection(*self.target), timeout=_CONTROL_TIMEOUT_S
                )
            except (OSError, TimeoutError):
                _reset(client_w)
                return
            conn.upstream_w = upstream_w
            forwarding = [
                asyncio.create_task(up.write(upstream_w)),
                asyncio.create_task(
                    down.read(upstream_r, None if rule is None else lambda p: rule.down(p, link))
                ),
            ]
            conn.tasks += forwarding
            await asyncio.gather(reading, answering, *forwarding, return_exceptions=True)
        finally:
            answering.cancel()
            self._conns.discard(conn)
            client_w.close()
            if conn.upstream_w is not None:
                conn.upstream_w.close()


# MQTT packets, as the rules read them.


async def read_packet(reader: asyncio.StreamReader) -> bytes:
    """One whole MQTT control packet: fixed header, remaining length, the rest."""
    raw = bytearray(await reader.readexactly(1))
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        raw.append(byte)
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    raw += await reader.readexactly(length)
    return bytes(raw)


def remaining_length(length: int) -> bytes:
    """MQTT's variable byte integer for a packet's remaining length."""
    out = bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


def body(packet: bytes) -> bytes:
    """A packet without its fixed header (type, flags, remaining length)."""
    i = 1
    while packet[i] & 0x80:
        i += 1
    return packet[i + 1 :]


def protocol_level(connect: bytes) -> int:
    """A CONNECT's protocol level (5: MQTT 5, 4: 3.1.1), after the name "MQTT"."""
    return body(connect)[6]


def subscribe_filters(packet: bytes, *, v5: bool) -> list[str]:
    """The topic filters of a SUBSCRIBE packet."""
    rest = body(packet)[2:]  # the packet id
    if v5:  # the properties: a variable byte integer length, then that many bytes
        length, i, multiplier = 0, 0, 1
        while True:
            length += (rest[i] & 0x7F) * multiplier
            multiplier *= 128
            i += 1
            if not rest[i - 1] & 0x80:
                break
        rest = rest[i + length :]
    found = []
    while len(rest) >= 3:
        size = int.from_bytes(rest[:2], "big")
        found.append(rest[2 : 2 + size].decode(errors="replace"))
        rest = rest[2 + size + 1 :]  # the filter, then its options byte
    return found


# Misbehaving brokers: rules for a proxy in front of a real one.


class Rule:
    """What an MQTT-aware proxy makes of each whole packet; this one passes them all on.
    Called in the proxy's thread, one packet at a time, when the packet arrives."""

    def up(self, packet: bytes, link: Link) -> bytes:
        """A packet from the client: what to send on to the broker (b"": nothing)."""
        return packet

    def down(self, packet: bytes, link: Link) -> bytes:
        """A packet from the broker: what to send on to the client (b"": nothing)."""
        return packet


class Only311(Rule):
    """A broker that speaks MQTT 3.1.1 only: it answers an MQTT 5 CONNECT with 3.1.1's
    CONNACK "unacceptable protocol version", or (`close`) hangs up without a CONNACK, as
    some such brokers do."""

    def __init__(self, *, close: bool = False) -> None:
        self.close = close
        self.levels: list[int] = []
        """The protocol level of every CONNECT seen (5, or 4 = 3.1.1)."""
        self.refused = 0

    def up(self, packet: bytes, link: Link) -> bytes:
        if packet[0] >> 4 != 1:
            return packet
        self.levels.append(protocol_level(packet))
        if self.levels[-1] != 5:
            return packet
        self.refused += 1
        if not self.close:
            link.to_client(b"\x20\x02\x00\x01")
        link.hang_up()
        return b""


class RefusedSubscriptions(Rule):
    """An MQTT 3.1.1 broker that refuses SUBSCRIBEs as a NATS cluster does after a server
    died: the filters of `refuse` are answered here with a SUBACK failure (0x80), the
    others passed on. `refuse[filter]` holds which of that filter's SUBSCRIBEs (counted
    from 1, over all connections) are refused; None: all.

    It also drops the first `skip_retained[topic]` retained copies of a topic on their way
    to the client, as nats-server 2.14 leaves out of a new subscription's snapshot, without
    a word, a retained message whose load timed out (server/mqtt.go,
    `loadRetainedMessages`: "skip requests that timed out")."""

    def __init__(
        self, refuse: dict[str, set[int] | None], *, skip_retained: dict[str, int] | None = None
    ) -> None:
        self.refuse = refuse
        self.skip_retained = dict(skip_retained or {})
        """Retained copies still to drop, per topic."""
        self.skipped = 0
        self.seen: dict[str, int] = dict.fromkeys(refuse, 0)
        """SUBSCRIBEs seen per filter of `refuse`."""
        self.refused: dict[str, int] = dict.fromkeys(refuse, 0)
        self._pending: dict[tuple[Link, bytes], list[bool]] = {}
        """Per connection and packet id of a SUBSCRIBE passed on in part: which of its
        filters were refused here."""

    def _refuses(self, topic_filter: str) -> bool:
        if topic_filter not in self.refuse:
            return False
        self.seen[topic_filter] += 1
        which = self.refuse[topic_filter]
        refused = which is None or self.seen[topic_filter] in which
        self.refused[topic_filter] += refused
        return refused

    def up(self, packet: bytes, link: Link) -> bytes:
        """A SUBSCRIBE to pass on, in part or not at all (then the SUBACK is answered here)."""
        if packet[0] != 0x82:
            return packet
        rest = body(packet)
        packet_id, rest = rest[:2], rest[2:]
        entries: list[tuple[bytes, bool]] = []
        while rest:
            size = int.from_bytes(rest[:2], "big")
            entry, rest = rest[: 2 + size + 1], rest[2 + size + 1 :]
            entries.append((entry, self._refuses(entry[2 : 2 + size].decode())))
        refused = [r for _, r in entries]
        if not any(refused):
            return packet
        if all(refused):
            codes = bytes([0x80] * len(entries))
            link.to_client(b"\x90" + remaining_length(2 + len(codes)) + packet_id + codes)
            return b""
        self._pending[link, packet_id] = refused
        kept = packet_id + b"".join(e for e, r in entries if not r)
        return b"\x82" + remaining_length(len(kept)) + kept

    def down(self, packet: bytes, link: Link) -> bytes:
        if packet[0] == 0x90 and (refused := self._pending.pop((link, packet[2:4]), None)):
            granted = iter(packet[4:])
            codes = bytes(0x80 if r else next(granted) for r in refused)
            return b"\x90" + remaining_length(2 + len(codes)) + packet[2:4] + codes
        if packet[0] & 0xF1 == 0x31 and self._skips(packet):  # a retained PUBLISH
            return b""
        return packet

    def _skips(self, packet: bytes) -> bool:
        """Whether to drop this retained PUBLISH (`skip_retained`)."""
        rest = body(packet)
        topic = rest[2 : 2 + int.from_bytes(rest[:2], "big")].decode()
        if self.skip_retained.get(topic, 0) <= 0:
            return False
        self.skip_retained[topic] -= 1
        self.skipped += 1
        return True


def retained_copies(_topic: str, retained: bool) -> bool:
    """`NoRetained`'s default: drop every retained PUBLISH, pass every live one."""
    return retained


class NoRetained(Rule):
    """A broker that never delivers retained messages: every PUBLISH from the broker with
    the retain flag is dropped (and, at QoS 1, acknowledged to the broker on the client's
    behalf). Live messages pass. With `dropping` set False, it passes retained messages
    too (a broker that was only slow). `drop(topic, retained)` says which PUBLISHes it
    drops instead (a server that lost one record). With `wildcards_only` it passes the
    retained copies that follow a SUBSCRIBE of topics without a wildcard, as RabbitMQ's
    MQTT plugin (3.10) serves them; without, it is a server that serves no retained record
    at all (a NATS cluster's server whose retained feed died with another server,
    docs/brokers.md)."""

    def __init__(
        self, drop: Callable[[str, bool], bool] = retained_copies, *, wildcards_only: bool = False
    ) -> None:
        self._drop = drop
        self.wildcards_only = wildcards_only
        self.dropping = True
        self.dropped = 0
        self._v5 = False
        self._exact = False
        """The last SUBSCRIBE named its topics without a wildcard."""

    def up(self, packet: bytes, link: Link) -> bytes:
        kind = packet[0] >> 4
        if kind == 1:
            self._v5 = protocol_level(packet) == 5
        elif kind == 8:
            filters = subscribe_filters(packet, v5=self._v5)
            self._exact = all("+" not in f and "#" not in f for f in filters)
        return packet

    def down(self, packet: bytes, link: Link) -> bytes:
        kind, flags = packet[0] >> 4, packet[0] & 0x0F
        if not self.dropping or kind != 3 or (self.wildcards_only and self._exact):
            return packet
        rest = body(packet)
        size = int.from_bytes(rest[:2], "big")
        if not self._drop(rest[2 : 2 + size].decode(), bool(flags & 0x01)):
            return packet
        self.dropped += 1
        if (flags >> 1) & 0x03:
            link.to_broker(b"\x40\x02" + rest[2 + size : 4 + size])  # PUBACK
        return b""
