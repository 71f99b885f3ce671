"""The agent's MQTT link: one resilient connection that replays the caller's desired state.

A `Bus` owns one named task that keeps one connection to one of the configured brokers
(`[bus] url`, tried in turn: `imexd.bus.rotation`) and replays the caller's desired state
onto every new connection: its subscriptions, its retained records (`imexd.bus.records`)
and its Last Will. The caller never reconnects, re-subscribes or re-publishes itself; it
declares what it wants and reads typed events (`imexd.bus.events`).

This module is what callers use: the desired state they declare and what they may ask.
How the link runs is `imexd.bus.engine`: after every connect it re-subscribes, publishes
the records again, and proves with a round trip through its own ping topic
(`imexd.bus.pings`) that the retained snapshot arrived (`Synced`); the same round trip,
repeated, proves the link, and a missing echo drops it without DISCONNECT so that the
broker publishes the will. A snapshot counts only while every filter is granted and the
broker passed the retained-wildcard check (`imexd.bus.check`); our own records must come
back (`imexd.bus.echoes`). Every connect asks for MQTT 5 and resumes its session; 3.1.1
only where the broker says so (`imexd.bus.mqtt`). Anything wrong on the wire is dropped,
counted per reason and logged once (`imexd.bus.drops`). What a clustered broker needs
beyond this is `imexd.bus.repairs`, engaged per link by the broker profile (`[bus]
broker`); on Mosquitto none of it runs. docs/bus.md gives the reasons for each rule.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from types import TracebackType
from typing import Self

from imexd.bus.engine import LinkEngine
from imexd.bus.events import RETAINED_NOT_SERVED, Event, WillSpec
from imexd.bus.mqtt import QOS
from imexd.bus.records import Record
from imexd.bus.waits import unless
from imexd.errors import BusError
from imexd.logs import get_logger
from imexd.messages import Dropped, Payload, encode
from imexd.names import is_dns1123_subdomain
from imexd.settings import BusSettings
from imexd.signing import Verifier


def _check_topic_name(topic: str) -> None:
    if not topic or "+" in topic or "#" in topic or "\0" in topic:
        raise ValueError(f"{topic!r} is not a topic name (empty or with wildcards)")


def _check_client_id(client_id: str) -> None:
    if not client_id or len(client_id.encode()) > 65535 or "\0" in client_id:
        raise ValueError(f"client_id must be a non-empty string, not {client_id!r}")


class EventStream:
    """`async for event in bus.events()`: ends after the bus is closed."""

    def __init__(self, queue: asyncio.Queue[Event | None]) -> None:
        self._queue = queue

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        event = await self._queue.get()
        if event is None:
            self._queue.put_nowait(None)  # every other reader ends too
            raise StopAsyncIteration
        return event

    def queued(self) -> Event | None:
        """The next event if one is queued already, without waiting; None when none is or
        the bus was closed (the next `anext` then ends the iteration)."""
        if self._queue.empty():
            return None
        event = self._queue.get_nowait()
        if event is None:
            self._queue.put_nowait(None)
        return event


class Bus(LinkEngine):
    """One resilient MQTT connection that replays the caller's desired state.

    Construct it inside a running event loop and enter it (`async with`): entering only
    starts the connection task, so the caller works (and its /healthz stays up) while no
    broker is reachable. Methods that change desired state (`subscribe`, `unsubscribe`,
    `retain`, `set_will`) never fail because the broker is away: they apply now when
    connected, else on the next connect. Only `publish` (one-off messages) raises
    `BusError` when the message cannot be sent.
    """

    def __init__(
        self,
        settings: BusSettings,
        *,
        node: str,
        client_id: str,
        will: WillSpec | None = None,
        timeout_s: float = 10.0,
        ping_timeout_s: float | None = None,
        echo_timeout_s: float = 5.0,
        close_timeout_s: float = 5.0,
        rand: Callable[[], float] = random.random,
        verifier: Verifier | None = None,
    ) -> None:
        """Validate everything up front; connect nothing yet.

        node: the name on our ping topic `{p}/nodes/{node}/ping` (DNS-1123 subdomain).
        client_id: the MQTT client identifier; the broker ends an older connection with
            the same id (session take-over), which is what makes a quick restart keep
            the record: the delayed will of the old connection is dropped.
        timeout_s: bound on connecting and on every broker round trip (SUBACK, PUBACK).
        ping_timeout_s: how long a liveness ping may take; default max(2, ping interval).
        echo_timeout_s: how long a retained publication may take to come back before it
            counts as refused.
        close_timeout_s: bound on the clean DISCONNECT at close.
        rand: source of jitter in [0, 1).
        verifier: the control plane's public key (`[control] public_key`): specs,
            workloads, assignments and retry requests it did not sign are dropped
            (`imexd.bus.signatures`); None: accepted unsigned.
        """
        if not is_dns1123_subdomain(node):
            raise ValueError(f"node {node!r} is not a DNS-1123 subdomain")
        _check_client_id(client_id)
        for name, value in (
            ("timeout_s", timeout_s),
            ("echo_timeout_s", echo_timeout_s),
            ("close_timeout_s", close_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value!r}")
        if will is not None:
            _check_topic_name(will.topic)
        super().__init__(
            settings,
            node=node,
            client_id=client_id,
            will=will,
            timeout_s=timeout_s,
            ping_timeout_s=ping_timeout_s,
            echo_timeout_s=echo_timeout_s,
            close_timeout_s=close_timeout_s,
            rand=rand,
            verifier=verifier,
        )

    # Public state.

    @property
    def connected(self) -> bool:
        """Whether a broker link is up (CONNACK received, not yet lost)."""
        return self._connected

    @property
    def broker(self) -> str | None:
        """The URL of the broker we are connected to."""
        return self._broker

    @property
    def subscribe_refused(self) -> str:
        """Which subscriptions the broker of this link refuses, naming it and them; "" when
        none. No `Synced` while it is set (BusConnected reason `SubscribeRefused`)."""
        return self._subs.detail

    @property
    def no_retained_wildcard(self) -> str:
        """Why the broker cannot be trusted with the retained snapshot (it did not send our
        own record back, flagged retained, to a new wildcard subscription); "" while no
        link failed that check since one passed it. No `Synced` while it is set."""
        return self._check.failed

    @property
    def retained_not_served(self) -> bool:
        """The failed check's broker did not send our record to a subscription of its own
        topic either (`imexd.bus.check`: BusConnected `BrokerRetainedNotServed`)."""
        return self._check.reason == RETAINED_NOT_SERVED

    @property
    def retained_checked(self) -> bool:
        """The current link passed the retained-wildcard check."""
        return self._check.passed

    @property
    def repaired(self) -> bool:
        """Whether the current link gets the broker repairs (`[bus] broker`): the broker may
        reorder or lose messages, so a missing echo may be a loss, not a refusal."""
        return self._repairing

    @property
    def stale_retained(self) -> int:
        """Retained copies dropped because a live message on their topic came first."""
        return self._repairs.stale_retained

    @property
    def resyncs(self) -> int:
        """Re-reads completed (repaired links only)."""
        return self._repairs.resyncs

    @property
    def control_key(self) -> str:
        """The fingerprint of the key the control plane's records are verified with; ""
        when they are accepted unsigned (no `[control] public_key`)."""
        return "" if self._signatures is None else self._signatures.fingerprint

    @property
    def unverified(self) -> tuple[tuple[str, str], ...]:
        """(topic, DropReason value) where the broker holds a control-plane record that does
        not verify (`imexd.bus.signatures`), by topic."""
        return () if self._signatures is None else tuple(sorted(self._signatures.standing.items()))

    @property
    def resync_corrections(self) -> int:
        """Topics a re-read corrected (delivered, changed, deleted, or ours published
        again) because the broker's snapshot said otherwise."""
        return self._repairs.resync_corrections

    @property
    def timeout_s(self) -> float:
        """The bound on connecting and on every broker round trip (the constructor's
        `timeout_s`)."""
        return self._timeout_s

    @property
    def echo_timeout_s(self) -> float:
        """How long a retained publication may take to come back (the constructor's
        `echo_timeout_s`); the agent waits as long for a record it gave back to a broker
        (imexd.agent.rebuild)."""
        return self._echo_timeout_s

    @property
    def refused_topics(self) -> frozenset[str]:
        """Retained publications the broker did not give back in time (PublishRefused).

        Only topics covered by our own subscriptions are checked: the agent's member
        filter covers its member record. A broker ACL must let a node read what it writes.
        """
        return frozenset(self._echoes.refused)

    # Lifecycle.

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def start(self) -> None:
        """Start the connection task (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"bus:{self.client_id}")

    async def close(self) -> None:
        """Disconnect cleanly (DISCONNECT suppresses the will); bounded in time.

        A leave clears its record with `retain(topic, None)` before; a hand-over just
        closes. The DISCONNECT gets close_timeout_s; a task still busy after that (a
        connect that hangs) is cancelled and its link dropped. The bus cannot be reused.
        """
        self._closing = True
        self._wake.set()
        if self._leave is not None:
            self._leave.set()
        task = self._task
        if task is not None:
            try:
                done, _ = await asyncio.wait({task}, timeout=self._close_timeout_s + 1.0)
                if not done:
                    task.cancel()
                    await asyncio.wait({task}, timeout=self._close_timeout_s)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._log.error("bus_task_failed", exc_info=task.exception())
        self._echoes.reset()
        self._queue.put_nowait(None)

    def events(self) -> EventStream:
        """The events, in arrival order; the iteration ends when the bus is closed."""
        return EventStream(self._queue)

    # Desired state.

    async def subscribe(
        self, *topic_filters: str, ordered: bool = True, synced: bool = True
    ) -> None:
        """Add filters, kept across reconnects; one `Synced` follows their snapshot (one
        SUBSCRIBE and one round trip for all of them), unless `synced` is False (a caller
        that waits for no snapshot: the SUBSCRIBE alone). Before the first connect they are
        only noted: that connect subscribes them with the rest.

        `ordered`: the caller judges by the order in which the broker delivers these
        filters' messages (a claim settles at its echo; a channel's first holder keeps
        it). Such a filter is subscribed at QoS 1 on every broker, and so is every filter
        on a link without the broker repairs. On a repaired link the others, and the
        ping, are subscribed at QoS 0 (`imexd.bus.repairs.subscription_qos`
        says why)."""
        async with self._lock:
            new = self._subs.add(topic_filters, ordered=ordered)
            if not new:
                return
            live = self._live()
            if live is None:
                return
            client, leave = live
            try:
                if not await unless(leave, self._subscribe(client, new)):
                    return
            except BusError as exc:
                self._declare_dead(client, f"subscribe failed: {exc}")
                return
            if any(f in self._subs.refused for f in new):
                return  # the link's task retries it, then resyncs
        if synced:
            await unless(leave, self._resync(client))

    async def unsubscribe(self, topic_filter: str) -> None:
        """Remove a filter now and from later connections."""
        async with self._lock:
            if not self._subs.remove(topic_filter):
                return
            self._echoes.forget(self._subs.covers)
            self._repairs.forget(self._subs.covers)
            if self._signatures is not None:
                self._signatures.forget(self._subs.covers)
            live = self._live()
            if live is None:
                self._subs.dropped.add(topic_filter)
                return
            client, leave = live
            try:
                if not await unless(leave, client.unsubscribe(topic_filter)):
                    self._subs.dropped.add(topic_filter)
            except BusError as exc:
                self._subs.dropped.add(topic_filter)
                self._declare_dead(client, f"unsubscribe failed: {exc}")

    async def retain(
        self,
        topic: str,
        payload: Payload | None,
        *,
        message_expiry_s: float | None = None,
        replay: bool = True,
    ) -> None:
        """Set (or with None: clear) our retained record on `topic`.

        A record is published now when connected and again after every reconnect, with
        `message_expiry_s` (MQTT 5) so that a report of a vanished node ages out. None
        publishes an empty retained payload once (deleting the record on the broker) and
        then forgets the topic. Returns once the broker acknowledged it, or at once when
        no link is up (it is then published on the next connect).

        `replay=False`: the record is not published again on a new link by the bus; the
        caller publishes it there itself once it judged that link's snapshot (a member
        record whose slot may have been taken while the link was down). It still counts
        as ours for the retained check, from its first publication on a link.
        """
        _check_topic_name(topic)
        ref = self.topics.parse(topic)
        self.writes["other" if ref is None else ref.kind] += 1
        data = b"" if payload is None else encode(payload)
        entry = Record(data, message_expiry_s, replay=replay or not data)
        async with self._lock:
            self._records.declare(topic, entry)
            live = self._live()
            if live is None:
                return
            client, leave = live
            try:
                await unless(leave, self._put_retained(client, topic, entry))
            except BusError as exc:
                self._declare_dead(client, f"publish to {topic} failed: {exc}")

    async def publish(
        self,
        topic: str,
        payload: Payload,
        *,
        qos: int = QOS,
        message_expiry_s: float | None = None,
    ) -> None:
        """Publish a one-off message (not retained, not replayed); BusError if it fails."""
        _check_topic_name(topic)
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
        client = self._client
        if client is None:
            raise BusError(f"cannot publish to {topic}: not connected to a broker")
        try:
            await client.publish(topic, encode(payload), qos=qos, expiry_s=message_expiry_s)
        except BusError as exc:
            raise BusError(f"cannot publish to {topic}: {exc}") from exc

    async def put_retained(
        self, topic: str, data: bytes, *, message_expiry_s: float | None = None
    ) -> None:
        """Publish `data` retained (QoS 1) once, and never again on a reconnect: a record
        written by someone else that the agent gives back to a broker that serves an
        older version or none (imexd.agent.rebuild), with the MQTT 5 message expiry
        `message_expiry_s` (a tombstone's rest). BusError when it cannot be sent."""
        _check_topic_name(topic)
        client = self._client
        if client is None:
            raise BusError(f"cannot publish to {topic}: not connected to a broker")
        try:
            await client.publish(topic, data, qos=QOS, retain=True, expiry_s=message_expiry_s)
        except BusError as exc:
            raise BusError(f"cannot publish to {topic}: {exc}") from exc

    def drop(self, topic: str, dropped: Dropped) -> None:
        """Count and log a message the caller drops after decoding (a record older than
        the one it holds: `imexd.order`), like one the bus dropped itself."""
        self._drop(topic, dropped)

    async def barrier(self) -> bool:
        """One round trip through the broker on the current link; True when it came back.

        Whatever the broker delivered before the echo, it delivered while still serving
        us: a broker that shuts down publishes every will and then drops the link, so
        deletions followed by a barrier that came back were not that. False when no link
        is up, or the link ended or timed out first (its own pings then replace it).
        """
        live = self._live()
        if live is None:
            return False
        client, leave = live
        try:
            return await unless(leave, self._round_trip(client))
        except BusError:
            return False

    def set_will(self, will: WillSpec | None) -> None:
        """Change the Last Will (the agent's presence will, when it raises its incarnation
        or stands aside for another agent of its name; a join or a leave keeps it).

        The will is part of CONNECT, so a change reconnects cleanly: the DISCONNECT
        suppresses the old will, so clear the old record yourself first. A will known
        before the bus connects belongs in the constructor: the first CONNECT carries it.
        """
        if will == self._will:
            return
        if will is not None:
            _check_topic_name(will.topic)
        self._will = will
        self._leave_link("will changed")

    def set_client_id(self, client_id: str) -> None:
        """Use another MQTT client id from the next connection on (reconnecting now when
        connected, cleanly: the DISCONNECT suppresses the will of the current link).

        An agent that finds another live agent of its own node name uses it to stop the
        two of them from taking the shared client id's session from each other.
        """
        _check_client_id(client_id)
        if client_id == self.client_id:
            return
        self.client_id = client_id
        self._log = get_logger("bus", client_id=client_id)
        self._leave_link("client id changed")
