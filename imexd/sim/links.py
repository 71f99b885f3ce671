"""The simulated daemon's peer links: one outgoing connection per other node.

Separate from `imexd.sim.daemon` because it is the one part with its own protocol
mechanics (a callback-driven `asyncio.Protocol`, heartbeats stamped without a task
wake-up, the `-N` matrix cell of each peer); the daemon only creates, retargets and
restarts links and reads their cells.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

from imexd.sim.command import MAX_LINE, LinkStatus
from imexd.sim.protocol import (
    PEER_DECODER,
    Bye,
    Heartbeat,
    Hello,
    Link,
    encode,
)

HEARTBEAT = encode(Heartbeat())
"""Pre-encoded: compared as bytes on receipt, so heartbeats are never decoded."""


class Outgoing(asyncio.Protocol):
    """The dialling end of one peer connection, driven by callbacks.

    Heartbeats only stamp `last_seen`: an idle link costs no task wake-up and no
    timer, so 72 daemons with 17 peers each stay cheap. One watchdog per daemon
    aborts links that went silent.
    """

    def __init__(self, hello: bytes) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._hello = hello
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.last_seen = loop.time()
        self.peer_hello: asyncio.Future[Hello | None] = loop.create_future()
        """The peer's hello, or None when the connection ended before it came."""
        self.closed: asyncio.Future[None] = loop.create_future()
        self.said_bye = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self._hello)

    def data_received(self, data: bytes) -> None:
        self.last_seen = self._loop.time()
        self._buffer += data
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[: end + 1])
            del self._buffer[: end + 1]
            if line == HEARTBEAT:
                continue
            try:
                frame = PEER_DECODER.decode(line)
            except ValueError:
                self.abort()
                return
            if isinstance(frame, Hello) and not self.peer_hello.done():
                self.peer_hello.set_result(frame)
            elif isinstance(frame, Bye):
                self.said_bye = True
                self.abort()
                return
        if len(self._buffer) > MAX_LINE:
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.peer_hello.done():
            self.peer_hello.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, frame: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class PeerLink:
    """Our outgoing connection to one other node: one cell of our matrix row."""

    def __init__(self, index: int, entry: str, address: str | None) -> None:
        self.index = index
        self.entry = entry
        self.address = address
        self.status = LinkStatus.NEVER_CONNECTED
        self.changed = False
        self.lost_at: float | None = None
        self.attempt = 0
        self.restart = False
        """Set by SIGUSR1: the current connection is closed on purpose, not lost."""
        self.wake = asyncio.Event()
        """Cuts a backoff sleep short (SIGUSR1, or the peer just said hello to us)."""
        self.conn: Outgoing | None = None

    def set(self, status: LinkStatus) -> None:
        if status != self.status:
            self.status = status
            self.changed = True
        if status is not LinkStatus.RECOVERING:
            self.lost_at = None

    def restarting(self) -> bool:
        """Whether the connection just ended was closed on purpose by a reload."""
        return self.restart

    def retarget(self, address: str | None) -> None:
        """A new address is a new peer: the cell starts over as never connected."""
        self.address = address
        self.status = LinkStatus.NEVER_CONNECTED
        self.changed = False
        self.lost_at = None
        self.attempt = 0

    def view(self, grace_s: int) -> Link:
        """The cell now; RECOVERING turns DISCONNECTED once the grace time has passed."""
        status = self.status
        if (
            status is LinkStatus.RECOVERING
            and grace_s > 0
            and self.lost_at is not None
            and time.monotonic() - self.lost_at >= grace_s
        ):
            status = LinkStatus.DISCONNECTED
        return Link(status=status, changed=self.changed)
