"""A TCP fault-injection proxy for tests: one per agent link, in front of a broker.

`FaultProxy` listens on a fresh 127.x.y.z address and forwards every connection to the
target (the broker). Its asyncio loop runs in a thread of its own; the test steers it from
the outside with thread-safe calls that return once the change is in effect:

- `delay(seconds, direction)`: every chunk read from then on is forwarded `seconds`
  after it arrived, in order (a slow or congested link).
- `drop(direction)`: a silent partition. Sockets stay open, nothing is forwarded, no
  close is passed on; new connections are accepted but reach nothing (their SYN "got
  lost"). What was held back is delivered, in order, at `heal()`, as TCP retransmission
  would: if one end closed meanwhile, the other sees the close then.
- `cut()`: every connection is reset (both sides) and new ones are reset at once.
- `hang_up(count)`: like `cut()`, but a new connection is closed only once its first
  bytes (the client's CONNECT) arrived, as a load balancer with no backend does; after
  `count` such connections (None: until `heal()`) the link is transparent again.
- `heal()`: back to a transparent link (no delay, no drop, no cut).

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
from collections.abc import Coroutine
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
    """One direction of one connection: reads chunks, forwards them late and in order."""

    def __init__(self, way: _Way, src: asyncio.StreamReader, counter: list[int]) -> None:
        self.way = way
        self.src = src
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.ready = asyncio.Event()
        self.counter = counter

    async def read(self) -> None:
        """Read until EOF or error; a None item marks the end."""
        try:
            while True:
                data = await self.src.read(_CHUNK)
                if not data:
                    break
                self.queue.append((time.monotonic() + self.way.delay_s, data))
                self.ready.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.queue.append((time.monotonic() + self.way.delay_s, None))
            self.ready.set()

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


class FaultProxy:
    """A TCP proxy to `target` with delay, drop (silent partition), cut and heal."""

    def __init__(self, target_host: str, target_port: int, *, host: str | None = None) -> None:
        self.target = (target_host, target_port)
        self.host = host or loopback_address()
        self.port = free_port(self.host)
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
        up = _Pipe(self.up, client_r, self.bytes_up)
        reading = asyncio.create_task(up.read())
        conn.tasks.append(reading)
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
            down = _Pipe(self.down, upstream_r, self.bytes_down)
            forwarding = [
                asyncio.create_task(up.write(upstream_w)),
                asyncio.create_task(down.read()),
                asyncio.create_task(down.write(client_w)),
            ]
            conn.tasks += forwarding
            await asyncio.gather(reading, *forwarding, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            client_w.close()
            if conn.upstream_w is not None:
                conn.upstream_w.close()
