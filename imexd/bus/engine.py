"""The link's engine: one connection at a time to one of the brokers, until closed.

`LinkEngine` is what `imexd.bus.link.Bus` runs on: the state of the current link and the
task that keeps it. Per connection it connects (`imexd.bus.mqtt`), replays the desired
state (subscriptions, our records, the will), proves the retained snapshot with a round
trip (`Synced`) once every filter is granted and the broker passed the retained-wildcard
check, serves the link (reads, periodic round trips, re-reads on a repaired link), and on
its end waits as `imexd.bus.rotation` says before the next connect. What callers use,
and the desired state they declare, is `Bus`; docs/bus.md gives the reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from imexd.bus.check import RetainedCheck, check_filters
from imexd.bus.drops import Drops
from imexd.bus.echoes import Echoes
from imexd.bus.events import (
    SUBSCRIBE_REFUSED,
    Connected,
    ConnectFailed,
    Disconnected,
    EchoLost,
    Event,
    Protocol,
    Refused,
    SubscribeRefused,
    Synced,
    WillSpec,
)
from imexd.bus.mqtt import QOS, Client, Will, connect, describe_error
from imexd.bus.pings import LinkLostError, Pings
from imexd.bus.records import Record, Records
from imexd.bus.repairs import (
    SUBSCRIBE_RETRIES,
    Repairs,
    engaged,
    refusal_waits,
    subscription_qos,
)
from imexd.bus.rotation import Rotation
from imexd.bus.signatures import Signatures
from imexd.bus.subscriptions import Subscriptions
from imexd.bus.waits import first_set
from imexd.errors import BusError
from imexd.logs import get_logger
from imexd.messages import Dropped, Ping, Received, decode_message
from imexd.settings import BrokerURL, BusSettings, parse_broker_url
from imexd.signing import Verifier
from imexd.topics import TopicRef, Topics

_STABLE_S: Final = 10.0
"""A link that lasted this long resets the reconnect backoff."""

CHECK_OVER: Final = "over"
"""The retained-wildcard check passed, or cannot be asked on this link."""
CHECK_NONE: Final = "none"
"""No record of ours that a wildcard filter covers stands yet (an agent in no shard): the
check is asked at the echo of one."""
CHECK_REFUSED: Final = "refused"
"""The check's re-read was refused: the link's task subscribes again, then asks again."""
CHECK_FAILED: Final = "failed"
"""Our copy did not come: the verdict stands (on a repaired link the check is asked again,
then the link moves: `LinkEngine._check_failed`)."""


def _unjudged(ref: TopicRef | None) -> bool:
    """Whether our record on a topic of this kind is never judged refused for want of its
    echo: a health report, which we follow only to put back a copy someone else wrote. It
    is re-sent every report interval, and on a link that may lose echoes (QoS 0 there) a
    lost one would read as an ACL refusal; the member record's echo already proves that
    the broker takes our writes."""
    return ref is not None and ref.kind == "health"


class LinkEngine:
    """The state of the current link and the task that keeps one (see the module)."""

    def __init__(
        self,
        settings: BusSettings,
        *,
        node: str,
        client_id: str,
        will: WillSpec | None,
        timeout_s: float,
        ping_timeout_s: float | None,
        echo_timeout_s: float,
        close_timeout_s: float,
        rand: Callable[[], float],
        verifier: Verifier | None,
    ) -> None:
        """The arguments as `Bus` checked them (`Bus.__init__` says what each means)."""
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.node = node
        self.client_id = client_id
        self.brokers: tuple[BrokerURL, ...] = tuple(parse_broker_url(u) for u in settings.url)
        if not self.brokers:
            raise ValueError("settings.url names no broker")
        self._will = will
        self._timeout_s = timeout_s
        self._echo_timeout_s = echo_timeout_s
        self._ping_interval_s = settings.ping_interval_s
        self._close_timeout_s = close_timeout_s
        self._rand = rand
        self._ping_topic = self.topics.ping(node)
        self._log = get_logger("bus", client_id=client_id)

        # Desired state, replayed on every connection.
        self._subs = Subscriptions(self._ping_topic)
        self._records = Records()

        # Link state.
        self._lock = asyncio.Lock()
        self._client: Client | None = None
        self._leave: asyncio.Event | None = None
        self._gone = asyncio.Event()
        """Set as soon as the current link is being left or was found dead."""
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._leave_reason = "closed"
        """Why the current link is left cleanly (set_will, set_client_id)."""
        self._unplanned = False
        """A link was lost or a connect failed since the last link came up."""
        self._pings = Pings(
            node,
            self._ping_topic,
            max(2.0, settings.ping_interval_s) if ping_timeout_s is None else ping_timeout_s,
        )
        self._dead_reason: str | None = None
        self._ever_connected = False
        self._took_v5: set[str] = set()
        """Brokers that accepted MQTT 5 on this bus: a later hang-up before CONNACK from
        one of them is a link fault, not a refusal (`imexd.bus.mqtt.connect`)."""
        self._link_since = 0.0
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._echoes = Echoes(
            echo_timeout_s, self._refused, self._subs.can_echo, on_lost=self._echo_lost
        )
        self._drops = Drops()
        self._signatures = Signatures(verifier) if verifier is not None else None
        """The control plane's signatures, checked on every record (`[control] public_key`)."""

        self._connected = False
        self._broker: str | None = None
        self._protocol: Protocol | None = None
        self.reconnects = 0
        """Connections established after a lost link or a failed connect (after the first
        one); the deliberate reconnects of `set_will` and `set_client_id` do not count."""
        self.links = 0
        """Connect attempts so far: the number of the current link (`Connected.link`), which
        its Last Will carries (`WillSpec.payload`)."""
        self.last_error: str | None = None
        """Why the last connection attempt or link failed (never holds secrets)."""
        self.synced_at: float | None = None
        """time.monotonic() of the last `Synced` on the current link; None while down."""
        self.dropped = self._drops.counts
        """Dropped incoming messages per DropReason value (imexd_bus_dropped_total)."""
        self.on_counted: Callable[[], object] | None = None
        """Called when a message moved a counter here without an event (dropped as
        malformed, or held back by a repair): the caller's facts read those counters."""
        self.deliveries: Counter[tuple[str, str]] = Counter()
        """Messages the broker delivered, by (topic kind, domain) (`("other", "")` for a
        topic outside the contract): what a benchmark counts at the receiver."""
        self.writes: Counter[str] = Counter()
        """Records set or cleared through `retain`, by topic kind."""
        self.put_back = 0
        """Our records that someone wrote over and that we published again
        (imexd_bus_records_put_back_total)."""
        self._overwritten: set[str] = set()
        """Topics of ours that a live copy not ours reached: put back at the next turn."""
        self._answered: dict[str, bytes] = {}
        """The copy not ours that each put-back answered: the same copy again is not
        answered again, so two writers of one topic settle instead of answering each
        other for ever (a second agent of our name: DuplicateNode)."""
        self._overwrite = asyncio.Event()
        self._check = RetainedCheck()
        self._refusal_drop = False
        """The current link was dropped for refused subscriptions or a failed retained
        check: not a stable link."""
        self._repairs = Repairs(
            resync_s=settings.resync_interval_s,
            ping_topic=self._ping_topic,
            rand=rand,
            topics=self.topics,
        )
        self._repairing = False
        """The current link gets the broker repairs (`imexd.bus.repairs.engaged`)."""

    def _leave_link(self, reason: str) -> None:
        """Leave the current link cleanly; the loop reconnects with the new settings."""
        self._leave_reason = reason
        self._gone.set()
        if self._leave is not None:
            self._leave.set()

    def _live(self) -> tuple[Client, asyncio.Event] | None:
        """The current link and its leave event, unless it is already being left.

        An operation on a link that is being left (new will, close) or lost would wait
        for an acknowledgement that never comes while holding the lock that the next
        link needs for its replay; the desired state is replayed there anyway.
        """
        client, gone = self._client, self._gone
        if client is None or gone.is_set():
            return None
        return client, gone

    # The connection loop.

    async def _run(self) -> None:
        """Connect, serve, and reconnect with capped jittered backoff until closed
        (`imexd.bus.rotation` says which broker is next and how long to wait first)."""
        s = self.settings
        turn = Rotation(len(self.brokers), s.reconnect_initial_s, s.reconnect_max_s, self._rand)
        while not self._closing:
            broker = self.brokers[turn.index]
            try:
                await self._session(turn.index)
            except LinkLostError:
                # _link_down logged why; a link dropped for refusals did not hold.
                self._unplanned = True
                held = time.monotonic() - self._link_since >= _STABLE_S
                delay = turn.next(lost=True, stable=held and not self._refusal_drop)
            except BusError as exc:
                self._unplanned = True
                self._connect_failed(broker, str(exc))
                delay = turn.next(lost=False)
            except Exception as exc:  # a bug: log it, keep the agent on the bus
                self._unplanned = True
                self._log.exception("bus_session_crashed", broker=str(broker))
                self._connect_failed(broker, describe_error(exc))
                delay = turn.next(lost=False)
            else:
                turn.left_cleanly()
                continue  # a clean leave (new will, or close): reconnect at once, or stop
            if delay is None:
                continue
            next_broker = str(self.brokers[turn.index])
            self._log.info("bus_reconnect_wait", delay_s=round(delay, 3), next=next_broker)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    async def _session(self, index: int) -> None:
        """One connection: connect, replay, serve until a clean leave or a failure.

        Returns after a clean leave (DISCONNECT sent). Raises `LinkLostError` when an
        established link failed (it was dropped without DISCONNECT), another BusError
        when connecting failed.
        """
        broker = self.brokers[index]
        leave = self._leave = asyncio.Event()
        self._gone = asyncio.Event()
        if self._closing:
            return
        will = self._will
        self.links += 1
        client, v5 = await self._connect(broker, will)
        self._link_up(broker, v5=v5, will=will)
        reason = "closed"
        clean = False
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    reader = tg.create_task(self._read(client), name=f"bus-read:{self.client_id}")
                    tg.create_task(
                        self._serve(client, leave, reader), name=f"bus-link:{self.client_id}"
                    )
                clean = True
            except* LinkLostError as group:
                reason = self._dead_reason or str(group.exceptions[0])
                raise LinkLostError(reason) from None
        except BaseException as exc:
            # A failed link gets no DISCONNECT: the broker then publishes our will if we
            # stay away, and a DISCONNECT arriving late cannot keep a stale record alive.
            client.abort()
            if not isinstance(exc, LinkLostError):
                reason = describe_error(exc)
            raise
        finally:
            reason_code = None
            if clean:
                reason = "closed" if self._closing else self._leave_reason
                await self._disconnect(client)
            else:
                reason_code = client.server_reason
            self._link_down(broker, reason, reason_code)

    async def _connect(self, broker: BrokerURL, will: WillSpec | None) -> tuple[Client, bool]:
        """Connect to `broker` (`imexd.bus.mqtt.connect`: MQTT 5 first, 3.1.1 only when the
        broker says so, for this connect only; a broker that took MQTT 5 before says so
        only with its CONNACK); (client, v5). BusError when it failed."""
        s = self.settings
        mqtt_will = None
        if will is not None:
            delay_s = s.will_delay_s if will.delay_s is None else will.delay_s
            mqtt_will = Will(
                will.topic,
                delay_s,
                payload=will.payload(delay_s, broker_waits=s.broker_will_delay, link=self.links),
                payload_311=will.payload(delay_s, broker_waits=False, link=self.links),
            )

        def fallback(error: str, message: str) -> None:
            self._log.warning(
                "bus_protocol_fallback",
                broker=str(broker),
                protocol="3.1.1",
                error=error,
                message=message,
            )

        client = await connect(
            s,
            broker,
            client_id=self.client_id,
            timeout_s=self._timeout_s,
            will=mqtt_will,
            on_fallback=fallback,
            resume=True,
            took_v5=str(broker) in self._took_v5,
        )
        if client.v5:
            self._took_v5.add(str(broker))
        return client, client.v5

    async def _read(self, client: Client) -> None:
        """Deliver every incoming message; ends the link when the client reports it lost."""
        try:
            async for message in client.messages():
                self._dispatch(message.topic, message.payload, retained=message.retained)
        except BusError as exc:
            raise LinkLostError(str(exc)) from None

    async def _serve(
        self, client: Client, leave: asyncio.Event, reader: asyncio.Task[None]
    ) -> None:
        """Replay the desired state, prove the snapshot, then prove the link periodically."""
        try:
            if not leave.is_set():
                async with self._lock:
                    self._client = client
                    await self._forget_filters(client)
                    await self._subscribe(client, [self._ping_topic, *self._subs.wanted])
                    for topic, entry in self._records.replayed():
                        await self._put_retained(client, topic, entry)
                await self._settle(client, leave)
            checked = False
            check_at = 0.0  # once our echo came; after a failed check, its next try
            check_waits = iter(self._refusal_waits())
            next_ping = time.monotonic() + self._ping_interval_s
            burst = self._repairs.burst
            while not leave.is_set():
                waits = {leave, self._subs.changed, self._overwrite}
                if self._repairing:
                    waits.add(burst)
                if not checked and not check_at:
                    waits.add(self._check.own_echo)
                burst.clear()
                reread_at = self._repairs.due() if self._repairing else math.inf
                due = min(next_ping, reread_at, check_at or math.inf)
                await first_set(waits, max(0.0, due - time.monotonic()))
                if leave.is_set():
                    break
                if self._overwrite.is_set():
                    await self._put_back(client)
                if self._subs.changed.is_set():
                    await self._settle(client, leave)
                elif not checked and self._check.own_echo.is_set() and time.monotonic() >= check_at:
                    outcome = await self._check_retained(client)
                    checked = outcome == CHECK_OVER
                    if outcome == CHECK_FAILED:
                        delay = self._check_failed(check_waits)
                        checked = delay is None
                        if delay is not None:
                            check_at = time.monotonic() + delay
                elif self._repairing and time.monotonic() >= self._repairs.due():
                    await self._reread(client)  # its round trip proves the link too
                    next_ping = time.monotonic() + self._ping_interval_s
                elif time.monotonic() >= next_ping:
                    await self._round_trip(client)
                    next_ping = time.monotonic() + self._ping_interval_s
        except BusError as exc:
            # Drop the link and let the reader end the session: it takes the client's
            # disconnect result, which would otherwise be left unread.
            self._kill(client, str(exc))
            await asyncio.wait({reader}, timeout=self._timeout_s)
            raise LinkLostError(str(exc)) from None
        reader.cancel()

    def _check_failed(self, waits: Iterator[float]) -> float | None:
        """After a failed check of this link: the wait before it is asked again (the next
        of `waits`), or None when the verdict stands for the link.

        On a repaired link (nats-server) a loaded server may send our copy after the round
        trip, and one restarted under a cluster may not serve a retained record it holds:
        it is asked again by the refused-subscription rule (`refusal_waits`), then the link
        is dropped for the next broker, as for a subscription still refused. Elsewhere the
        verdict stands until the next connect (RabbitMQ's plugin fails every time)."""
        delay = next(waits, None)
        if delay is None and self._repairing:
            raise self._drop_for_next_broker(
                f"{self._check.failed}; still so after {SUBSCRIBE_RETRIES} more checks"
            )
        return delay

    def _refusal_waits(self) -> list[float]:
        """This link's waits before asking the broker again for what it refused or failed
        (`refusal_waits`, paced by the reconnect backoff's settings)."""
        s = self.settings
        return refusal_waits(self._repairing, s.reconnect_initial_s, s.reconnect_max_s, self._rand)

    def _drop_for_next_broker(self, why: str) -> BusError:
        """The error that ends a link whose asking again ran out, for the next broker; such
        a link does not count as stable, so the reconnect backoff grows."""
        self._refusal_drop = True
        return BusError(f"{why}: dropping the link for the next broker")

    async def _settle(self, client: Client, leave: asyncio.Event) -> None:
        """Get every refused subscription granted, then prove the snapshot (`Synced`).

        On a repaired link a refused filter is subscribed again after each of
        `refusal_waits` (paced by the reconnect backoff's settings); one still refused
        then is a link problem: BusError, and the reconnect loop tries the next broker
        (its backoff then grows, as such a link does not count as stable, so an ACL
        refusal does not spin). Elsewhere a refusal is an ACL's and the link is given up
        at once.
        """
        subs = self._subs
        subs.changed.clear()
        waits = self._refusal_waits()
        for delay in waits:
            if not subs.still_refused(self._broker or ""):
                break
            await first_set({leave}, delay)
            if leave.is_set():
                return
            async with self._lock:
                wanted = subs.still_refused(self._broker or "")
                if wanted:
                    await self._subscribe(client, wanted)
        if subs.still_refused(self._broker or ""):
            raise self._drop_for_next_broker(
                f"{subs.detail}; still refused after {len(waits)} retries"
            )
        subs.changed.clear()
        covered = frozenset(subs.granted)
        await self._round_trip(client)
        self._mark_synced(covered)

    async def _forget_filters(self, client: Client) -> None:
        """Unsubscribe what a resumed MQTT 5 session may still hold from an older link."""
        stale = self._subs.forget_dropped()
        if client.v5:
            for topic_filter in stale:
                await client.unsubscribe(topic_filter)

    def _check_target(self) -> tuple[str, str, str] | None:
        """(our record's topic, the shard's wildcard filter covering it, the check's own
        filter), if we have both a record that such a filter covers (our member record:
        `check_filters`) and it stands on this link."""
        for topic in self._records.topics():
            filters = check_filters(topic, self._subs.wanted)
            if filters is not None and self._records.held(topic):
                return (topic, *filters)
        return None  # none, or the caller publishes it on this link after Synced

    async def _check_retained(self, client: Client) -> str:
        """The retained-wildcard check of this link (`imexd.bus.check` says why and how):
        CHECK_OVER when it passed or cannot be asked on this link, CHECK_REFUSED when a
        repaired link's SUBSCRIBE was refused (the link's task retries it), CHECK_FAILED
        when our copy did not come (`_check_failed` says what then)."""
        target = self._check_target()
        if target is None:
            self._check.own_echo.clear()  # asked again at the echo of a record it covers
            return CHECK_NONE
        topic, shard_filter, topic_filter = target
        refusal: str | None = None
        served: bool | None = None
        try:
            narrow = True
            if self._repairing:
                self._check.begin(topic, narrow=False)
                if not await self._read_again(client, [shard_filter]):
                    return CHECK_REFUSED
                # A re-read without our copy proves nothing (nats-server 2.14 may send no
                # copies again for a filter it granted): then ask as a new filter does.
                narrow = not self._check.seen
                if not narrow:
                    topic_filter = shard_filter
            if narrow:
                refusal = await self._read_own(client, topic, topic_filter)
            seen = self._check.seen
            # Which failure: a broker that serves our record only to a subscription of its
            # own topic, or one that does not serve it at all (`check.verdict`).
            if refusal is None and not seen and await self._read_own(client, topic, topic) is None:
                served = self._check.seen
        finally:
            self._check.end()
        broker = self._broker or ""
        if refusal is not None:
            self._log.warning(
                "bus_broker_check_refused", broker=broker, filter=topic_filter, code=refusal
            )
            return CHECK_OVER
        verdict = self._check.verdict(broker, topic_filter, self._log, seen=seen, served=served)
        if not verdict.ok:
            self.synced_at = None
            self._check.withheld = True  # a check that passes later brings Synced back
        self._emit(verdict)
        if verdict.ok and self._check.withheld:
            self._mark_synced()
        return CHECK_OVER if verdict.ok else CHECK_FAILED

    async def _read_own(self, client: Client, topic: str, topic_filter: str) -> str | None:
        """Subscribe `topic_filter` (matching our record's `topic` only) at QoS 0 under the
        bus lock, wait a round trip for our record's copy (`RetainedCheck.seen`), and drop
        it again; the broker's refusal, or None when it granted it."""
        self._check.begin(topic, narrow=True)
        async with self._lock:
            (refusal,) = await client.subscribe([topic_filter], qos=0)
            if refusal is None:
                await self._round_trip(client)
                await client.unsubscribe(topic_filter)
        return refusal

    async def _reread(self, client: Client) -> None:
        """Anti-entropy (a repair): subscribe every granted filter again on this link and
        correct what we delivered by the broker's fresh retained snapshot. A refused
        SUBSCRIBE is left to the link's task (it retries, then resyncs); a lost round trip
        ends the link."""
        filters = [f for f in self._subs.wanted if f not in self._subs.refused]
        if filters and await self._read_again(client, filters):
            self._repairs.resyncs += 1

    async def _read_again(self, client: Client, filters: list[str]) -> bool:
        """Subscribe `filters` again, hold the fresh snapshot's copies back until a round
        trip marks its end, and put right what it says differently (`Repairs.differences`); live
        messages meanwhile are delivered as usual and win over the snapshot. False when a
        SUBSCRIBE was refused (nothing judged: the link's task retries it)."""
        async with self._lock:
            self._repairs.begin(filters)
            try:
                await self._subscribe(client, filters)
                if any(f in self._subs.refused for f in filters):
                    return False
                await self._round_trip(client)
            finally:
                snapshot = self._repairs.end()
            log = self._log.bind(broker=self._broker)
            ours, published = self._records.ours(), self._records.published_here()
            verdict = self._repairs.differences(
                filters, snapshot, ours=ours, published=published, log=log
            )
            for topic in [*verdict.republish, *verdict.refresh]:
                record = self._records.get(topic)
                if record is not None:
                    await self._put_retained(client, topic, record)
            delivered = [t for t, p in verdict.deliver if self._deliver(t, p, retained=True)]
        self._repairs.corrected([*verdict.republish, *delivered], log)
        return True

    async def _subscribe(self, client: Client, filters: Iterable[str]) -> None:
        """Subscribe; a refused filter is noted (`Subscriptions.refused`) for the link's task
        to retry.

        On a repaired link the topics these filters cover start over as not live: their
        retained copies that the broker sends now are a fresh snapshot."""
        wanted = list(filters)
        if self._repairing:
            self._repairs.subscribed(wanted)
        groups: dict[int, list[str]] = {}
        for topic_filter in wanted:
            groups.setdefault(self._qos(topic_filter), []).append(topic_filter)
        answers: dict[str, str | None] = {}
        for qos in sorted(groups, reverse=True):  # the ordered filters first
            group = groups[qos]
            answers.update(zip(group, await client.subscribe(group, qos=qos), strict=True))
        broker = self._broker or ""
        refused = self._subs.answered(broker, wanted, [answers[f] for f in wanted])
        if not refused:
            return
        self.synced_at = None
        for topic_filter, refusal in refused:
            self._log.warning(
                "bus_subscribe_refused",
                reason=SUBSCRIBE_REFUSED,
                broker=broker,
                filter=topic_filter,
                code=refusal,
            )
            self._emit(SubscribeRefused(broker, topic_filter, refusal, self._subs.detail))

    def _qos(self, topic_filter: str) -> int:
        """The QoS to subscribe `topic_filter` at on this link (`subscription_qos`)."""
        return subscription_qos(self._repairing, self._subs.ordered(topic_filter))

    async def _put_retained(self, client: Client, topic: str, entry: Record) -> None:
        self._records.publishing(topic)
        if self._subs.covers(topic) and not _unjudged(self.topics.parse(topic)):
            self._echoes.expect(topic, entry.payload)
        expiry_s = entry.expiry_s if entry.payload else None
        await client.publish(topic, entry.payload, qos=QOS, retain=True, expiry_s=expiry_s)
        self._records.sent(topic, entry)

    async def _round_trip(self, client: Client) -> float:
        return await self._pings.round_trip(client, self._log)

    def disown(self, topic: str) -> None:
        """Stop holding our record on `topic` without clearing it on the broker: it is
        another agent's now (we stand aside as a duplicate of its node)."""
        self._records.forget(topic)
        self._overwritten.discard(topic)
        self._answered.pop(topic, None)

    async def _put_back(self, client: Client) -> None:
        """Publish again our records that someone wrote over (`_dispatch`): the owner puts
        its own back within a round trip (the first time logged as a warning)."""
        self._overwrite.clear()
        topics, self._overwritten = sorted(self._overwritten), set()
        async with self._lock:
            for topic in topics:
                record = self._records.get(topic)
                if record is None or not record.payload or not record.replay:
                    continue
                # Logged before the publish: a reader that sees our record back on the
                # broker finds the line that says why it is there.
                level = self._log.info if self.put_back else self._log.warning
                self.put_back += 1
                level("bus_record_put_back", topic=topic[:300], times=self.put_back)
                await self._put_retained(client, topic, record)
        self._counted()

    async def _resync(self, client: Client) -> None:
        """After a new subscription: prove its snapshot arrived, or replace the link."""
        covered = frozenset(self._subs.granted)
        try:
            await self._round_trip(client)
        except BusError as exc:
            self._declare_dead(client, str(exc))
            return
        if self._client is client:
            self._mark_synced(covered)

    async def _disconnect(self, client: Client) -> None:
        """Clean DISCONNECT (the broker drops our will), bounded in time."""
        error = await client.close(self._close_timeout_s)
        if error is not None:
            self._log.warning("bus_disconnect_unclean", error=error)

    # State changes and incoming messages.

    def _declare_dead(self, client: Client, reason: str) -> None:
        """A caller's operation found the link dead: drop it; the loop reconnects."""
        if self._client is client:
            self._kill(client, reason)

    def _kill(self, client: Client, reason: str) -> None:
        """Drop the link without DISCONNECT; the first reason given is the one reported."""
        if self._dead_reason is None:
            self._dead_reason = reason
        self._gone.set()
        client.abort()

    def _link_up(self, broker: BrokerURL, *, v5: bool, will: WillSpec | None) -> None:
        if self._ever_connected and self._unplanned:
            self.reconnects += 1
        self._unplanned = False
        self._ever_connected = True
        self._link_since = time.monotonic()
        self._dead_reason = None
        self._check.link_up()
        self._subs.link_up()
        self._refusal_drop = False
        self._records.link_up()
        if self._signatures is not None:
            self._signatures.link_up()
        self._connected = True
        self._broker = str(broker)
        self._protocol = "5" if v5 else "3.1.1"
        self._repairing = engaged(self.settings.broker, self._protocol)
        self._repairs.link_up()
        self._log.info(
            "bus_connected",
            broker=self._broker,
            protocol=self._protocol,
            will=will.topic if will else None,
            reconnects=self.reconnects,
        )
        self._emit(
            Connected(
                self._broker,
                self._protocol,
                will_delay=v5,
                repaired=self._repairing,
                link=self.links,
            )
        )

    def _link_down(self, broker: BrokerURL, reason: str, reason_code: int | None) -> None:
        self._gone.set()
        self._client = None
        self._connected = False
        self._broker = None
        self._protocol = None
        self.synced_at = None
        self._subs.detail = ""
        self._echoes.reset()
        self._pings.cancel()
        event = Disconnected(str(broker), reason, reason_code)
        if not event.deliberate:
            self.last_error = reason
        log = self._log.warning if event.taken_over else self._log.info
        log(
            "bus_disconnected",
            broker=str(broker),
            reason=reason,
            reason_code=reason_code,
            taken_over=event.taken_over,
        )
        self._emit(event)

    def _connect_failed(self, broker: BrokerURL, error: str) -> None:
        self.last_error = error
        self._log.warning("bus_connect_failed", broker=str(broker), error=error)
        self._emit(ConnectFailed(str(broker), error))

    def _mark_synced(self, covered: frozenset[str] | None = None) -> None:
        """Emit `Synced` for the filters `covered` (None: all granted now), unless the
        broker failed the retained check and a check of this link is still to come (our
        record is replayed, so its echo starts one), or a subscription we need is refused
        (the link's task retries it, then resyncs)."""
        if self._subs.refused:
            return
        self._check.withheld = bool(self._check.failed) and self._check_target() is not None
        if self._check.withheld:
            return
        self._check.failed = ""
        self.synced_at = time.monotonic()
        filters = frozenset(self._subs.granted) if covered is None else covered
        self._emit(Synced(self.synced_at, filters=filters & set(self._subs.wanted)))

    def _emit(self, event: Event) -> None:
        self._queue.put_nowait(event)

    def _refused(self, topic: str) -> None:
        detail = "our retained publication did not come back: the broker refused it (ACL?)"
        self._log.warning("bus_publish_refused", topic=topic, detail=detail)
        self._emit(Refused(topic, detail, ref=self.topics.parse(topic), repaired=self._repairing))

    def _echo_lost(self, topic: str) -> None:
        self._log.info("bus_echo_lost", topic=topic[:300], repaired=self._repairing)
        self._emit(EchoLost(topic, ref=self.topics.parse(topic), repaired=self._repairing))

    def _dispatch(self, topic: str, payload: bytes, *, retained: bool) -> None:
        """Decode one message into an event; drop, count and log-once anything wrong."""
        ref = self.topics.parse(topic)
        self.deliveries[("other", "") if ref is None else (ref.kind, ref.domain)] += 1
        self._echoes.seen(topic, payload, live=not retained)
        if (
            not retained
            and self._records.overwritten(topic, payload)
            and self._answered.get(topic) != payload
        ):
            self._answered[topic] = payload
            self._overwritten.add(topic)
            self._overwrite.set()
        if payload and (ours := self._records.payload(topic)):
            if self._check.saw(topic, retained=retained) and self._check.narrow:
                return  # the check's own filter: what we published, already delivered
            if not retained and ours == payload and not self._check.own_echo.is_set():
                self._check.own_echo.set()  # the check looks for a record it can ask about
        if self._repairing and self._repairs.intercept(topic, payload, retained=retained):
            self._counted()
            return
        self._deliver(topic, payload, retained=retained)

    def _deliver(self, topic: str, payload: bytes, *, retained: bool) -> bool:
        """Decode one message and hand it to the caller; False when it was dropped."""
        result = decode_message(self.topics, topic, payload, retained=retained)
        if self._signatures is not None and not isinstance(result, Dropped):
            result = self._signatures.check(result)
        if isinstance(result, Dropped):
            self._drop(topic, result)
            return False
        if isinstance(result, Received) and isinstance(result.payload, Ping):
            if topic == self._ping_topic:  # only ours reach us; others are ignored
                self._pings.echoed(result.payload)
            return True
        if self._repairing:
            self._repairs.delivered(topic, payload)
        self._emit(result)
        return True

    def _drop(self, topic: str, dropped: Dropped) -> None:
        self._drops.drop(topic, dropped, self._log)
        self._counted()

    def _counted(self) -> None:
        if self.on_counted is not None:
            self.on_counted()
