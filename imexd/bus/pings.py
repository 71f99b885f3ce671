"""The sync ping: one round trip through the broker on the node's own ping topic.

A broker sends every retained message of a subscription before anything the same
connection publishes after its SUBACK at the same QoS, so an echo marks the end of a
snapshot (`Synced`), and an echo that does not come marks a dead link (docs/bus.md).
The ping is subscribed at the snapshot's QoS, 1, except on a repaired link
(`imexd.bus.repairs.subscription_qos`), where it is QoS 0: Mosquitto queues QoS 1
messages beyond its in-flight window (20) but sends QoS 0 at once, so there a QoS 0 echo
would overtake a large snapshot; nats-server writes a new subscription's retained copies
out before it reads the client's next packet, so there a QoS 0 echo still comes after
them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING

from imexd.bus.mqtt import QOS, Client
from imexd.bus.waits import within_loop_time
from imexd.errors import BusError
from imexd.messages import Ping, encode, now

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


class LinkLostError(BusError):
    """The current connection failed; the reconnect loop replaces it."""


class Pings:
    """The pings in flight on one bus, by sequence number."""

    def __init__(self, node: str, topic: str, timeout_s: float) -> None:
        self.topic = topic
        self._node = node
        self._timeout_s = timeout_s
        self._seq = itertools.count()
        self._waiting: dict[int, tuple[float, asyncio.Future[None]]] = {}
        """seq -> (the `sent` stamp of that ping, its echo): an echo is ours only if it
        carries both, as a resumed session can hand us a past run's echo of the same seq."""

    async def round_trip(self, client: Client, log: FilteringBoundLogger) -> float:
        """Publish a Ping to our own topic and wait for it; the seconds it took.
        `LinkLostError` when it did not come back in time (counted in time the event loop
        was free: `within_loop_time`)."""
        seq = next(self._seq)
        echo: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ping = Ping(node=self._node, seq=seq, sent=now())
        self._waiting[seq] = (ping.sent, echo)
        started = time.monotonic()

        async def exchange() -> None:
            await client.publish(self.topic, encode(ping), qos=QOS)
            await echo

        try:
            came, late = await within_loop_time(exchange(), self._timeout_s)
        finally:
            self._waiting.pop(seq, None)
        if not came:
            raise LinkLostError(
                f"no ping echo within {self._timeout_s:g} s (+{late:.1f} s that this "
                "agent's event loop ran late): the link is dead"
            )
        if late >= self._timeout_s / 2:
            log.info("bus_ping_loop_late", late_s=round(late, 3))
        return time.monotonic() - started

    def echoed(self, ping: Ping) -> None:
        """A ping came back on our topic: the echo of ours if it is the one we sent."""
        waiting = self._waiting.get(ping.seq)
        if waiting is None or waiting[0] != ping.sent:
            return  # a past run's (a resumed session), or one we no longer wait for
        echo = waiting[1]
        if not echo.done():
            echo.set_result(None)

    def cancel(self) -> None:
        """The link is down: no ping in flight will come back."""
        for _, echo in self._waiting.values():
            echo.cancel()
        self._waiting.clear()
