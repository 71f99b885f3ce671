"""The agent's MQTT bus connection: one resilient link.

A `Bus` owns one named task that keeps one connection to one of the configured brokers
(`[bus] url`, tried in turn) and replays the caller's *desired state* onto every new
connection: its subscriptions, its retained records and its Last Will. The caller never
reconnects, re-subscribes or re-publishes itself; it declares what it wants and reads
typed events:

    async with Bus(settings.bus, node=node, client_id=client_id("imexd", node), will=will) as bus:
        await bus.subscribe(bus.topics.members_filter(domain, clique))
        await bus.retain(bus.topics.member(domain, clique, node), record)
        async for event in bus.events():
            ...

Why it is built this way:
- Brokers restart and may lose (persistence off) or keep stale (persistence on) retained
  state, so after every connect the bus re-subscribes, then re-publishes its records, then
  proves the retained snapshot was delivered (a ping through its own topic comes back
  after every retained message of the subscriptions: `Synced`).
- Links die silently (a frozen broker, a dropped NAT entry): a periodic round trip through
  the broker proves the link, and a missing echo tears it down *without* DISCONNECT, so
  the broker publishes our will if we stay away. A clean close sends DISCONNECT, which
  suppresses the will (hand-over keeps the record; a leave clears it first).
- Every connect asks for MQTT 5 (its Will Delay keeps a link blip from dropping the node)
  and falls back to 3.1.1 for that connect only when the broker says so (`imexd.mqtt`
  decides). On MQTT 5 the bus resumes its session (Clean Start off, the session outlives
  the Will Delay), so a reconnect within the delay suppresses the will on every broker
  that follows the spec. The will is a tombstone (`WillSpec.tombstone`, state lost) whose
  `hold_s` tells peers how long to keep the node: 0 where the broker already waited its
  Will Delay, the delay itself on 3.1.1 (no Will Delay there).
- A broker must deliver retained messages to wildcard subscriptions, or the snapshot
  says nothing: once our own record (on the will's topic) came back live, the bus
  subscribes its filter again and expects the record back flagged retained before a
  round trip returns (`BrokerChecked`); until a link passes that check, no `Synced`.
- A busy loop is not a dead link: the ping's deadline grows by the time this process's
  own event loop ran late while waiting (up to 3 ping timeouts), so hundreds of agents
  in one loop, or a stalled disk, do not tear down links that work.
- The reason code of the broker's DISCONNECT is reported (`Disconnected.reason_code`,
  e.g. a session taken over by a second client with our id; `set_client_id` ends such a
  fight).
- A subscription the broker refuses (SUBACK failure) leaves a partial view: a clustered
  broker (NATS 2.9) refuses some for tens of seconds after a server died, an ACL for
  good. The bus subscribes a refused filter again with backoff on the same link, then
  drops the link for the next broker (`SubscribeRefused`, `subscribe_refused`); until
  every filter is granted there is no `Synced`, and a record whose echo could only come
  through a refused filter is not judged refused.
- A clustered broker may deliver a stale retained copy, or lose a live update: nats-server
  2.9 sends a new subscription's retained copies (from the server's own, possibly lagging,
  copy of the retained map) after live messages its JetStream consumer already delivered,
  and updates published while that consumer is being set up never arrive live. So a
  retained copy that comes after a live message on its topic (since the filter was last
  subscribed on this link) is stale and dropped (`stale_retained`), and every
  `[bus] resync_interval_s` the bus re-reads its filters on the live link (anti-entropy):
  it subscribes them again, waits for the fresh snapshot (a round trip) and emits only the
  differences with what it delivered (`Received`, or `Deleted` for a record the snapshot no
  longer holds, both flagged retained), leaving alone topics that changed within
  `resync_quiet_s` or live during the re-read, and publishes its own records again where
  the broker lost them (`resync_corrections`, log `bus_resync_corrected`).
- A record whose slot may have been taken while the link was down (the member record)
  is not replayed blindly on a new link (`retain(replay=False)`): the caller judges the
  new link's snapshot first and publishes it again, or claims again.
- The MQTT client drops PUBACK reason codes and MQTT 3.1.1 has none, so a publish refused by
  an ACL is only visible as "our own retained record did not come back": the bus tracks
  that per topic (`refused_topics`, `Refused`).
- Anything wrong on the wire is dropped, counted per reason (`dropped`, exported by the
  health module as `imexd_bus_dropped_total{reason}`) and logged once per sender topic
  and reason; it never ends or stalls the connection.

Why one module of about 1500 lines: the reconnect loop, the replay of the desired state,
the sync by ping, the echo tracking, the retries of refused subscriptions, the retained
check, the stale-copy filter and the periodic re-read all read and write one link state
(the current client, its leave event, the lock that orders replay against callers'
changes, the filters still refused and the check's verdict, both of which hold `Synced`
back, what the link delivered per topic); split over modules, that state machine would
be spread over several files sharing private state.
Everything that is not that state machine already lives elsewhere: the MQTT client in
`imexd.mqtt`, decoding in `imexd.messages`, the backoff rule in `imexd.retry`.

Callers see `imexd.messages` payloads, the event classes below and `imexd.errors.BusError`;
the control plane's one-shot commands use their own short link (`imexd.control.link`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal, Self

import msgspec

from imexd.errors import BusError
from imexd.logs import get_logger
from imexd.messages import (
    Deleted,
    Dropped,
    DropReason,
    MemberRecord,
    Payload,
    Ping,
    Presence,
    Received,
    decode_message,
    encode,
    now,
)
from imexd.mqtt import (
    QOS,
    SESSION_TAKEN_OVER,
    Client,
    Will,
    connect,
    describe_error,
    topic_matches,
)
from imexd.names import is_dns1123_subdomain
from imexd.retry import backoff_delay
from imexd.settings import BrokerURL, BusSettings, parse_broker_url
from imexd.topics import TopicRef, Topics

_STABLE_S: Final = 10.0
"""A link that lasted this long resets the reconnect backoff."""

_SUBSCRIBE_RETRIES: Final = 3
"""SUBSCRIBEs of a refused filter retried on one link (with backoff) before the link is
dropped for the next broker."""

RESYNC_QUIET_S: Final = 5.0
"""A re-read leaves alone a topic whose record changed this recently: a clustered
broker's snapshot may lag behind what was just delivered live (NATS 2.9 feeds each
server's retained map asynchronously), and a "correction" would then flap it."""
RESYNC_SETTLE_S: Final = 1.0
"""On a link that may lose updates, a re-read also follows every burst of changes,
`resync_quiet_s` + this many seconds after its last live message, so that an update lost
in a formation is corrected seconds after it, not a whole `[bus] resync_interval_s` later
(a NATS cluster loses such updates: docs/brokers.md). Such a link runs MQTT 3.1.1 (NATS
speaks nothing else), or its broker lost an update already (a re-read corrected one:
`Bus.lossy`); on an MQTT 5 broker that never did (Mosquitto) it would cost every agent a
snapshot per burst for nothing (docs/performance.md)."""
RESYNC_SETTLE_MAX_S: Final = 15.0
"""A burst that never ends (links that keep dropping on an overloaded cluster) defers its
re-read at most this long after its first live message."""

_LATENESS_SLICE_S: Final = 0.25
"""A ping deadline is watched in slices this long; a slice that ends late measures how
late this process's own event loop ran (see `_within_loop_time`)."""

_MAX_LATENESS: Final = 3.0
"""The ping deadline grows by the loop's lateness up to this many ping timeouts."""

_MAX_DROP_LOG_KEYS: Final = 4096
"""Distinct (topic, reason) pairs remembered for log-once; a flood cannot grow memory."""

Protocol = Literal["5", "3.1.1"]


# Events: what the caller reads from `Bus.events()`.


@dataclass(frozen=True, slots=True)
class Connected:
    """The link is up (CONNACK received); subscriptions and records are being replayed
    (those of `retain(replay=False)` are left to the caller, after `Synced`)."""

    broker: str
    protocol: Protocol
    will_delay: bool
    """Whether the will is delayed (MQTT 5); with 3.1.1 it fires at once."""


DELIBERATE_REASONS: Final = frozenset({"closed", "will changed", "client id changed"})
"""`Disconnected.reason` of links the bus ended itself."""


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The link is down; the bus reconnects by itself."""

    broker: str
    reason: str
    reason_code: int | None = None
    """The reason code of the broker's DISCONNECT (MQTT 5 only), e.g. 0x8E; None when
    the broker sent none (MQTT 3.1.1, a dead link, or our own clean leave)."""

    @property
    def taken_over(self) -> bool:
        """Whether another client connected with our client id (a duplicate agent, or a
        restarted one); only MQTT 5 brokers say so."""
        return self.reason_code == SESSION_TAKEN_OVER

    @property
    def deliberate(self) -> bool:
        """Whether the bus itself ended the link: closing, or reconnecting on purpose to
        install another will or client id (not a failure, not a reconnect to count)."""
        return self.reason in DELIBERATE_REASONS


@dataclass(frozen=True, slots=True)
class ConnectFailed:
    """An attempt to connect failed (also `last_error`); the bus tries again by itself.

    Lets the agent say why BusConnected is False without polling.
    """

    broker: str
    error: str


@dataclass(frozen=True, slots=True)
class Synced:
    """Every retained message of the current subscriptions was delivered before this.

    Emitted after each connect, and after each `subscribe()` while connected.
    """

    at: float
    """time.monotonic() when the snapshot was complete."""
    filters: frozenset[str] | None = None
    """The filters whose snapshot it proves: those granted on this link before its round
    trip began (None: not said). A filter subscribed meanwhile has its own Synced."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Our retained publication did not come back in time: the broker refused it (ACL),
    or a clustered broker lost its echo (the shard publishes a claim again then)."""

    topic: str
    detail: str
    ref: TopicRef | None = None
    """What the topic addresses (None: not an imexd topic)."""
    lossy_link: bool = False
    """The link may lose an echo (MQTT 3.1.1, or a broker a re-read found losing an
    update: see RESYNC_SETTLE_S); on an MQTT 5 broker that never did, a missing echo is a
    refusal or an overloaded agent, and publishing again would only add load."""


@dataclass(frozen=True, slots=True)
class EchoLost:
    """Our retained publication was kept by the broker (a snapshot held it) but its live
    echo did not come in time: a clustered broker lost the echo. Not a refusal; the shard
    publishes a claim again on a link that may lose updates (as for `Refused`)."""

    topic: str
    ref: TopicRef | None = None
    lossy_link: bool = False


@dataclass(frozen=True, slots=True)
class SubscribeRefused:
    """The broker refused a subscription we need (SUBACK failure): the bus subscribes it
    again with backoff, then drops the link for the next broker; no `Synced` meanwhile."""

    broker: str
    topic_filter: str
    code: str
    """The broker's refusal (e.g. "128", or an MQTT 5 reason such as "Not authorized")."""
    detail: str
    """What `Bus.subscribe_refused` says: naming the broker and every refused filter."""


SUBSCRIBE_REFUSED: Final = "SubscribeRefused"
"""The reason BusConnected gives while a subscription we need is refused."""

NO_RETAINED_WILDCARD: Final = "BrokerNoRetainedWildcard"


@dataclass(frozen=True, slots=True)
class BrokerChecked:
    """Whether the broker delivered our own record, flagged retained, to a new wildcard
    subscription (checked once per link, after the record first came back live)."""

    broker: str
    ok: bool
    detail: str = ""
    """Why not, naming the broker; "" when ok."""


Event = (
    Connected
    | Disconnected
    | ConnectFailed
    | Synced
    | EchoLost
    | Received
    | Deleted
    | Refused
    | BrokerChecked
    | SubscribeRefused
)


@dataclass(frozen=True, slots=True)
class WillSpec:
    """The Last Will, retained (QoS 1) on `topic`, the node's member topic: `tombstone`
    (state lost) with its `hold_s` set per link, or an empty payload without one; in no
    domain, its presence topic: a Presence marked lost.

    The broker publishes it when the link ends without DISCONNECT, after `delay_s`
    (MQTT 5 Will Delay; None: `BusSettings.will_delay_s`) so that a quick reconnect does not
    flap membership. Where the broker does not wait (3.1.1, or `[bus] broker_will_delay =
    false`), the tombstone's hold_s is the delay: the peers wait instead.
    """

    topic: str
    delay_s: float | None = None
    tombstone: MemberRecord | Presence | None = None

    def payload(self, delay_s: float, *, broker_waits: bool) -> bytes:
        """The will's payload on a link whose broker waits the Will Delay, or not."""
        if self.tombstone is None:
            return b""
        if isinstance(self.tombstone, Presence):
            return encode(self.tombstone)
        hold_s = 0.0 if broker_waits else float(delay_s)
        return encode(msgspec.structs.replace(self.tombstone, hold_s=hold_s))


def _check_topic_name(topic: str) -> None:
    if not topic or "+" in topic or "#" in topic or "\0" in topic:
        raise ValueError(f"{topic!r} is not a topic name (empty or with wildcards)")


def _check_client_id(client_id: str) -> None:
    if not client_id or len(client_id.encode()) > 65535 or "\0" in client_id:
        raise ValueError(f"client_id must be a non-empty string, not {client_id!r}")


def _check_filter(topic_filter: str) -> None:
    levels = topic_filter.split("/")
    if not topic_filter or "#" in levels[:-1] or "\0" in topic_filter:
        raise ValueError(f"{topic_filter!r} is not a topic filter")
    if any(("+" in lv and lv != "+") or ("#" in lv and lv != "#") for lv in levels):
        raise ValueError(f"{topic_filter!r} is not a topic filter")


async def _first_set(events: set[asyncio.Event], timeout_s: float) -> None:
    """Wait until one of `events` is set, or `timeout_s` passed."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def _unless(leave: asyncio.Event, operation: Coroutine[Any, Any, object]) -> bool:
    """Run one broker operation unless its link is left first; True when it completed."""
    task: asyncio.Task[object] = asyncio.ensure_future(operation)
    left = asyncio.ensure_future(leave.wait())
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await task
    if task.cancelled():
        return False
    task.result()  # re-raises the operation's error
    return True


async def _within_loop_time(
    operation: Coroutine[Any, Any, None], timeout_s: float
) -> tuple[bool, float]:
    """Run `operation` for `timeout_s` seconds of time that the event loop was free to
    notice it: (whether it completed, seconds the loop ran late meanwhile).

    A ping echo that came in time but was read late because this process's own event loop
    was busy (hundreds of agents in one loop, a slow disk) proves a live link, not a dead
    one. So the deadline is watched in slices of `_LATENESS_SLICE_S`; each slice that ends
    later than it asked for adds its overrun to the deadline, up to `_MAX_LATENESS` x
    `timeout_s`, so that a link that is really dead is still given up. The operation's
    error is raised; it is cancelled when it did not complete.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(operation)
    deadline = loop.time() + timeout_s
    late = 0.0
    try:
        while True:
            remaining = deadline + late - loop.time()
            if remaining <= 0:
                return False, late
            step = min(remaining, _LATENESS_SLICE_S)
            asked = loop.time()
            done, _ = await asyncio.wait({task}, timeout=step)
            if done:
                task.result()
                return True, late
            overrun = max(0.0, loop.time() - asked - step)
            late = min(late + overrun, _MAX_LATENESS * timeout_s)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await task
        elif not task.cancelled():
            # Done as we were cancelled (the link went down): its error is retrieved
            # here, or asyncio logs it as never retrieved.
            task.exception()


class _LinkLostError(BusError):
    """The current connection failed; the reconnect loop replaces it."""


@dataclass(slots=True)
class _Retained:
    payload: bytes
    """b"": delete the retained record once, then forget the entry."""
    expiry_s: float | None
    replay: bool = True
    """Published again on every new link; False: only when the caller publishes it on
    that link (after judging its snapshot). A clear is always replayed."""


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


class _Echoes:
    """Which retained publications still wait to come back, and which never did.

    A publication counts as accepted when the same payload arrives on its topic within
    `timeout` seconds (live, or from a snapshot); otherwise it is refused until it, or a
    later publication on that topic, comes back: a slow broker or a loaded node only
    delays the echo, and the late echo clears the verdict.
    """

    def __init__(
        self,
        timeout: float,
        on_refused: Callable[[str], None],
        can_tell: Callable[[str], bool] = lambda _: True,
        on_lost: Callable[[str], None] = lambda _: None,
    ) -> None:
        self._timeout = timeout
        self._on_refused = on_refused
        self._on_lost = on_lost
        """Called when the live echo timed out of a publication a snapshot showed kept."""
        self._can_tell = can_tell
        """Whether an echo on a topic could come at all now (a subscription covering it is
        granted); when not, an expired wait starts over instead of judging."""
        self._pending: dict[str, tuple[bytes, asyncio.TimerHandle]] = {}
        self._late: dict[str, bytes] = {}
        """Payloads that timed out: their echo may still arrive and clear `refused`."""
        self.refused: set[str] = set()
        self._kept: set[str] = set()
        """Pending topics whose payload a snapshot showed: accepted, live echo awaited."""

    def expect(self, topic: str, payload: bytes) -> None:
        self._cancel(topic)
        self._late.pop(topic, None)
        handle = asyncio.get_running_loop().call_later(self._timeout, self._expired, topic)
        self._pending[topic] = (payload, handle)

    def seen(self, topic: str, payload: bytes, *, live: bool = True) -> None:
        """`payload` arrived on `topic`: live (the echo), or a snapshot's retained copy,
        which proves the broker kept it but is no echo (the wait for that goes on)."""
        waiting = self._pending.get(topic)
        if waiting is not None and waiting[0] == payload:
            if live:
                self._cancel(topic)
            else:
                self._kept.add(topic)
            self.refused.discard(topic)
        elif self._late.get(topic) == payload:
            del self._late[topic]
            self.refused.discard(topic)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Stop tracking topics no longer covered by our subscriptions."""
        for topic in [t for t in self._pending if not keep(t)]:
            self._cancel(topic)
        self._late = {t: p for t, p in self._late.items() if keep(t)}
        self.refused = {t for t in self.refused if keep(t)}

    def reset(self) -> None:
        """The link is gone: every publication is redone on the next one."""
        for topic in list(self._pending):
            self._cancel(topic)

    def _cancel(self, topic: str) -> None:
        self._kept.discard(topic)
        waiting = self._pending.pop(topic, None)
        if waiting is not None:
            waiting[1].cancel()

    def _expired(self, topic: str) -> None:
        if not self._can_tell(topic) and topic in self._pending:
            kept = topic in self._kept
            self.expect(topic, self._pending[topic][0])  # start over, knowing what it knew
            if kept:
                self._kept.add(topic)
            return
        if topic in self._kept:
            self._cancel(topic)
            self._on_lost(topic)
            return
        waiting = self._pending.pop(topic, None)
        if waiting is not None:
            self._late[topic] = waiting[0]
        self.refused.add(topic)
        self._on_refused(topic)


class Bus:
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
        resync_quiet_s: float = RESYNC_QUIET_S,
        rand: Callable[[], float] = random.random,
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
        resync_quiet_s: a periodic re-read (`[bus] resync_interval_s`) corrects no topic
            whose record changed within this many seconds (`RESYNC_QUIET_S`).
        rand: source of jitter in [0, 1).
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
        if not resync_quiet_s >= 0:
            raise ValueError(f"resync_quiet_s must be >= 0, not {resync_quiet_s!r}")
        if will is not None:
            _check_topic_name(will.topic)
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.node = node
        self.client_id = client_id
        self.brokers: tuple[BrokerURL, ...] = tuple(parse_broker_url(u) for u in settings.url)
        if not self.brokers:
            raise ValueError("settings.url names no broker")
        self._will = will
        self._timeout_s = timeout_s
        self._ping_interval_s = settings.ping_interval_s
        self._ping_timeout_s = (
            ping_timeout_s if ping_timeout_s is not None else max(2.0, settings.ping_interval_s)
        )
        self._close_timeout_s = close_timeout_s
        self._resync_s = settings.resync_interval_s
        self._resync_quiet_s = resync_quiet_s
        self._rand = rand
        self._ping_topic = self.topics.ping(node)
        self._log = get_logger("bus", client_id=client_id)

        # Desired state, replayed on every connection.
        self._filters: dict[str, None] = {}
        self._retained: dict[str, _Retained] = {}
        self._dropped_filters: set[str] = set()
        """Filters given up while no link was up: a resumed MQTT 5 session may hold them."""

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
        self._seq = itertools.count()
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._dead_reason: str | None = None
        self._ever_connected = False
        self._took_v5: set[str] = set()
        """Brokers that accepted MQTT 5 on this bus: a later hang-up before CONNACK from
        one of them is a link fault, not a refusal (`imexd.mqtt.connect`)."""
        self._link_since = 0.0
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._echoes = _Echoes(
            echo_timeout_s, self._refused, self._echo_can_come, on_lost=self._echo_lost
        )
        self._drop_logged: set[tuple[str, str]] = set()

        self._connected = False
        self._broker: str | None = None
        self._protocol: Protocol | None = None
        self.reconnects = 0
        """Connections established after a lost link or a failed connect (after the first
        one); the deliberate reconnects of `set_will` and `set_client_id` do not count."""
        self.last_error: str | None = None
        """Why the last connection attempt or link failed (never holds secrets)."""
        self.synced_at: float | None = None
        """time.monotonic() of the last `Synced` on the current link; None while down."""
        self.dropped: Counter[str] = Counter({reason.value: 0 for reason in DropReason})
        """Dropped incoming messages per DropReason value (imexd_bus_dropped_total)."""
        self.deliveries: Counter[tuple[str, str]] = Counter()
        """Messages the broker delivered, by (topic kind, domain) (`("other", "")` for a
        topic outside the contract): what a benchmark counts at the receiver."""
        self.writes: Counter[str] = Counter()
        """Records set or cleared through `retain`, by topic kind."""
        self.no_retained_wildcard = ""
        """Why the broker cannot be trusted with the retained snapshot (it did not send our
        own record back, flagged retained, to a new wildcard subscription); "" while no
        link failed that check since one passed it. No `Synced` while it is set."""
        self.retained_checked = False
        """The current link passed the retained-wildcard check."""
        self._own_echo = asyncio.Event()
        """Set when our own record (on the will's topic) came back live on this link."""
        self._checking: str | None = None
        """The will topic whose retained copy the check is waiting for."""
        self._check_seen = False
        self._sync_withheld = False
        """A snapshot completed while the broker was not trusted: `Synced` once it is."""
        self._granted: set[str] = set()
        """Filters the broker granted on this link (what a `Synced` can cover)."""
        self._missing: dict[str, str] = {}
        """Filters (ours, or the ping topic) the broker refused on this link: the refusal."""
        self._refusal = asyncio.Event()
        """Set when a subscription was refused (or a refused one dropped): retry, resync."""
        self._refusal_drop = False
        """The current link was dropped for refused subscriptions: not a stable link."""
        self.subscribe_refused = ""
        """Which subscriptions the broker of this link refuses, naming it and them; "" when
        none. No `Synced` while it is set (BusConnected reason `SubscribeRefused`)."""
        self._live_topics: set[str] = set()
        """Topics that got a live message on this link since a filter covering them was
        last subscribed: a retained copy of one of them arriving now is stale."""
        self._put_on_link: set[str] = set()
        """Topics of our records published on this link (see `_Retained.replay`)."""
        self._known: dict[str, tuple[bytes, float]] = {}
        """Per topic, the payload we delivered last on this link (b"": deleted) and
        time.monotonic() then: what a re-read compares the broker's snapshot with."""
        self._snapshot: dict[str, bytes] | None = None
        """While a re-read runs: the retained copies it got, held back from the caller."""
        self._snapshot_filters: list[str] = []
        self.stale_retained = 0
        """Retained copies dropped because a live message on their topic came first."""
        self.resyncs = 0
        """Periodic re-reads completed (`[bus] resync_interval_s`)."""
        self.resync_corrections = 0
        """Topics a re-read corrected: a record delivered, changed or deleted, or one of
        ours published again, because the broker's snapshot said otherwise."""
        self.lossy = False
        """The broker lost an update: a re-read corrected something (see RESYNC_SETTLE_S).
        A stale retained copy does not count: on Mosquitto a live message queued before
        a SUBSCRIBE was processed comes before that SUBSCRIBE's copy of it, harmlessly."""
        self._last_live = -math.inf
        """time.monotonic() of the last live message on a filter (not a ping)."""
        self._first_live = -math.inf
        """time.monotonic() of the first live message since the last re-read began."""
        self._burst = asyncio.Event()
        """Set by that first live message: the link's task then schedules its re-read."""
        self._last_reread = -math.inf
        """time.monotonic() when the last re-read began."""

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

    async def subscribe(self, *topic_filters: str) -> None:
        """Add filters (QoS 1), kept across reconnects; one `Synced` follows their snapshot
        (one SUBSCRIBE and one round trip for all of them). Before the first connect they
        are only noted: that connect subscribes them with the rest."""
        for topic_filter in topic_filters:
            _check_filter(topic_filter)
        async with self._lock:
            new = [f for f in dict.fromkeys(topic_filters) if f not in self._filters]
            if not new:
                return
            for topic_filter in new:
                self._filters[topic_filter] = None
                self._dropped_filters.discard(topic_filter)
            live = self._live()
            if live is None:
                return
            client, leave = live
            try:
                if not await _unless(leave, self._subscribe(client, new)):
                    return
            except BusError as exc:
                self._declare_dead(client, f"subscribe failed: {exc}")
                return
            if any(f in self._missing for f in new):
                return  # the link's task retries it, then resyncs
        await _unless(leave, self._resync(client))

    async def unsubscribe(self, topic_filter: str) -> None:
        """Remove a filter now and from later connections."""
        async with self._lock:
            if topic_filter not in self._filters:
                return
            del self._filters[topic_filter]
            self._granted.discard(topic_filter)
            self._echoes.forget(self._covered)
            self._known = {t: k for t, k in self._known.items() if self._covered(t)}
            if self._missing.pop(topic_filter, None) is not None:
                self._refusal.set()  # maybe nothing is refused now: resync
            live = self._live()
            if live is None:
                self._dropped_filters.add(topic_filter)
                return
            client, leave = live
            try:
                if not await _unless(leave, client.unsubscribe(topic_filter)):
                    self._dropped_filters.add(topic_filter)
            except BusError as exc:
                self._dropped_filters.add(topic_filter)
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
        entry = _Retained(data, message_expiry_s, replay=replay or not data)
        async with self._lock:
            self._retained[topic] = entry
            live = self._live()
            if live is None:
                return
            client, leave = live
            try:
                await _unless(leave, self._put_retained(client, topic, entry))
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

    async def put_retained(self, topic: str, data: bytes) -> None:
        """Publish `data` retained (QoS 1) once, and never again on a reconnect: a record
        written by someone else that the agent gives back to a broker that lost it
        (imexd.rebuild). Replaying it would undo a later deletion. BusError when it cannot
        be sent."""
        _check_topic_name(topic)
        client = self._client
        if client is None:
            raise BusError(f"cannot publish to {topic}: not connected to a broker")
        try:
            await client.publish(topic, data, qos=QOS, retain=True)
        except BusError as exc:
            raise BusError(f"cannot publish to {topic}: {exc}") from exc

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
            return await _unless(leave, self._round_trip(client))
        except BusError:
            return False

    def set_will(self, will: WillSpec | None) -> None:
        """Change the Last Will (a domain switch moves the member topic).

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
        """Connect, serve, and reconnect with capped jittered backoff until closed.

        Brokers are tried in turn: after a failed connect the next one is tried at once
        until each was tried in this round; then the bus waits, doubling the wait per
        failed round. A link that ends (even one that worked) is followed by one jittered
        wait, so that a fleet does not reconnect to a restarted broker at the same instant,
        and the next attempt goes to the next broker.
        """
        index = 0
        rounds = 0
        left = len(self.brokers)
        while not self._closing:
            try:
                await self._session(index)
            except _LinkLostError:
                # _link_down logged why. Only a link that held resets the backoff, so a
                # broker that drops us right after each connect is not hammered.
                self._unplanned = True
                stable = time.monotonic() - self._link_since >= _STABLE_S
                if stable and not self._refusal_drop:
                    rounds = 0
                left = 1
            except BusError as exc:
                self._unplanned = True
                self._connect_failed(self.brokers[index], str(exc))
            except Exception as exc:  # a bug: log it, keep the agent on the bus
                self._unplanned = True
                self._log.exception("bus_session_crashed", broker=str(self.brokers[index]))
                self._connect_failed(self.brokers[index], describe_error(exc))
            else:
                rounds, left = 0, len(self.brokers)
                continue  # a clean leave (new will, or close): reconnect at once, or stop
            index = (index + 1) % len(self.brokers)
            left -= 1
            if left > 0:
                continue
            delay = backoff_delay(
                rounds,
                self.settings.reconnect_initial_s,
                self.settings.reconnect_max_s,
                self._rand,
            )
            rounds += 1
            left = len(self.brokers)
            self._log.info(
                "bus_reconnect_wait", delay_s=round(delay, 3), next=str(self.brokers[index])
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    async def _session(self, index: int) -> None:
        """One connection: connect, replay, serve until a clean leave or a failure.

        Returns after a clean leave (DISCONNECT sent). Raises `_LinkLostError` when an
        established link failed (it was dropped without DISCONNECT), another BusError
        when connecting failed.
        """
        broker = self.brokers[index]
        leave = self._leave = asyncio.Event()
        self._gone = asyncio.Event()
        if self._closing:
            return
        will = self._will
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
            except* _LinkLostError as group:
                reason = self._dead_reason or str(group.exceptions[0])
                raise _LinkLostError(reason) from None
        except BaseException as exc:
            # A failed link gets no DISCONNECT: the broker then publishes our will if we
            # stay away, and a DISCONNECT arriving late cannot keep a stale record alive.
            client.abort()
            if not isinstance(exc, _LinkLostError):
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
        """Connect to `broker` (`imexd.mqtt.connect`: MQTT 5 first, 3.1.1 only when the
        broker says so, for this connect only; a broker that took MQTT 5 before says so
        only with its CONNACK); (client, v5). BusError when it failed."""
        s = self.settings
        mqtt_will = None
        if will is not None:
            delay_s = s.will_delay_s if will.delay_s is None else will.delay_s
            mqtt_will = Will(
                will.topic,
                delay_s,
                payload=will.payload(delay_s, broker_waits=s.broker_will_delay),
                payload_311=will.payload(delay_s, broker_waits=False),
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
            raise _LinkLostError(str(exc)) from None

    async def _serve(
        self, client: Client, leave: asyncio.Event, reader: asyncio.Task[None]
    ) -> None:
        """Replay the desired state, prove the snapshot, then prove the link periodically."""
        try:
            if not leave.is_set():
                async with self._lock:
                    self._client = client
                    await self._forget_filters(client)
                    await self._subscribe(client, [self._ping_topic, *self._filters])
                    for topic, entry in list(self._retained.items()):
                        if entry.replay:
                            await self._put_retained(client, topic, entry)
                await self._settle(client, leave)
            checked = False
            next_ping = time.monotonic() + self._ping_interval_s
            next_resync = self._next_resync()
            while not leave.is_set():
                waits = {leave, self._refusal, self._burst}
                if not checked:
                    waits.add(self._own_echo)
                self._burst.clear()
                due = min(next_ping, next_resync, self._next_settle())
                await _first_set(waits, max(0.0, due - time.monotonic()))
                if leave.is_set():
                    break
                if self._refusal.is_set():
                    await self._settle(client, leave)
                elif not checked and self._own_echo.is_set():
                    checked = await self._check_retained(client)
                elif time.monotonic() >= min(next_resync, self._next_settle()):
                    await self._reread(client)  # its round trip proves the link too
                    next_resync = self._next_resync()
                    next_ping = time.monotonic() + self._ping_interval_s
                elif time.monotonic() >= next_ping:
                    await self._round_trip(client)
                    next_ping = time.monotonic() + self._ping_interval_s
        except BusError as exc:
            # Drop the link and let the reader end the session: it takes the client's
            # disconnect result, which would otherwise be left unread.
            self._kill(client, str(exc))
            await asyncio.wait({reader}, timeout=self._timeout_s)
            raise _LinkLostError(str(exc)) from None
        reader.cancel()

    async def _settle(self, client: Client, leave: asyncio.Event) -> None:
        """Get every refused subscription granted, then prove the snapshot (`Synced`).

        A refused filter is subscribed again after a backoff (`imexd.retry`), at most
        `_SUBSCRIBE_RETRIES` times on this link; one still refused then is a link problem:
        BusError, and the reconnect loop tries the next broker (its backoff then grows, as
        such a link does not count as stable, so an ACL refusal does not spin).
        """
        self._refusal.clear()
        s = self.settings
        for attempt in range(_SUBSCRIBE_RETRIES):
            if not self._wanted_missing():
                break
            delay = backoff_delay(attempt, s.reconnect_initial_s, s.reconnect_max_s, self._rand)
            await _first_set({leave}, delay)
            if leave.is_set():
                return
            async with self._lock:
                wanted = self._wanted_missing()
                if wanted:
                    await self._subscribe(client, wanted)
        if self._wanted_missing():
            self._refusal_drop = True
            raise BusError(
                f"{self.subscribe_refused}; still refused after {_SUBSCRIBE_RETRIES} retries: "
                "dropping the link for the next broker"
            )
        self._refusal.clear()
        covered = frozenset(self._granted)
        await self._round_trip(client)
        self._mark_synced(covered)

    def _wanted_missing(self) -> list[str]:
        """The refused filters we still want (a caller may have unsubscribed some)."""
        self._missing = {
            f: code
            for f, code in self._missing.items()
            if f == self._ping_topic or f in self._filters
        }
        self.subscribe_refused = self._refusal_detail()
        return list(self._missing)

    def _refusal_detail(self) -> str:
        if not self._missing:
            return ""
        refused = ", ".join(f"{f} (code {code})" for f, code in self._missing.items())
        return f"the broker {self._broker} refused our subscription to {refused}"

    def _echo_can_come(self, topic: str) -> bool:
        """Whether a granted subscription of ours covers `topic` (so its echo can come)."""
        return any(topic_matches(f, topic) for f in self._filters if f not in self._missing)

    async def _forget_filters(self, client: Client) -> None:
        """Unsubscribe what a resumed MQTT 5 session may still hold from an older link."""
        stale = sorted(self._dropped_filters - set(self._filters))
        self._dropped_filters.clear()
        if client.v5:
            for topic_filter in stale:
                await client.unsubscribe(topic_filter)

    def _check_target(self) -> tuple[str, str, str] | None:
        """(our record's topic, the shard's wildcard filter covering it, the check's own
        filter), if we have both a record and such a filter.

        The check's filter matches that one topic only: `{p}/domains/D/+/C/N` for the
        member topic `{p}/domains/D/members/C/N` (no other kind of topic has three levels
        under a domain)."""
        will = self._will
        if will is None or not self._retained.get(will.topic, _Retained(b"", None)).payload:
            return None
        if not self._retained[will.topic].replay and will.topic not in self._put_on_link:
            return None  # the caller publishes it on this link after Synced
        for topic_filter in self._filters:
            if topic_filter != will.topic and topic_matches(topic_filter, will.topic):
                levels = will.topic.split("/")
                if len(levels) < 3:
                    return None
                levels[-3] = "+"  # {p}/domains/D/members/C/N -> {p}/domains/D/+/C/N
                return will.topic, topic_filter, "/".join(levels)
        return None

    async def _check_retained(self, client: Client) -> bool:
        """The broker must send our record, flagged retained, to a new wildcard
        subscription before a round trip returns, or its snapshots cannot be trusted.

        On a link that may lose updates (MQTT 3.1.1, or one where a re-read corrected
        something) the shard's own filter is subscribed again and read like a re-read:
        nats-server 2.9 sometimes grants a reconnecting client's first SUBSCRIBE without
        the retained messages, and this second read completes its view before any claim
        counts. False when that subscription was refused (the link's task retries it).
        Elsewhere (Mosquitto over MQTT 5) that second read would send every record of the
        shard again, k messages to each of k nodes: the check's own filter, which
        matches our record only, is subscribed at QoS 0 and dropped at once, under the
        bus lock, so that no record of ours is published while it overlaps the shard's
        (its echo would come once per matching subscription, and a second echo could pass
        for a later record's). A refusal of that filter gives no verdict on this link.
        """
        target = self._check_target()
        if target is None:
            return True
        topic, shard_filter, topic_filter = target
        refusal: str | None = None
        self._check_seen = False
        self._checking = topic
        try:
            if self._may_lose:
                if not await self._read_again(client, [shard_filter]):
                    return False
                topic_filter = shard_filter
            else:
                async with self._lock:
                    (refusal,) = await client.subscribe([topic_filter], qos=0)
                    if refusal is None:
                        await self._round_trip(client)
                        await client.unsubscribe(topic_filter)
        finally:
            self._checking = None
        broker = self._broker or ""
        if refusal is not None:
            self._log.warning(
                "bus_broker_check_refused", broker=broker, filter=topic_filter, code=refusal
            )
            return True
        if self._check_seen:
            self.retained_checked = True
            if self.no_retained_wildcard:
                self._log.info("bus_retained_wildcard_ok", broker=broker)
            self.no_retained_wildcard = ""
            self._emit(BrokerChecked(broker, ok=True))
            if self._sync_withheld:
                self._mark_synced()
            return True
        detail = (
            f"the broker {broker} did not send our retained record back to a new "
            f"subscription of {topic_filter}: it does not deliver retained messages to "
            "wildcard subscriptions, so the member snapshot cannot be trusted"
        )
        if not self.no_retained_wildcard:
            self._log.warning(
                "bus_broker_check_failed", reason=NO_RETAINED_WILDCARD, broker=broker, detail=detail
            )
        self.no_retained_wildcard = detail
        self.synced_at = None
        self._emit(BrokerChecked(broker, ok=False, detail=detail))
        return True

    def _next_resync(self) -> float:
        """time.monotonic() of the next re-read: the interval jittered by +-25 % (so that
        a fleet does not re-read in step), or never."""
        if self._resync_s <= 0:
            return math.inf
        return time.monotonic() + self._resync_s * (0.75 + 0.5 * self._rand())

    def _next_settle(self) -> float:
        """time.monotonic() of the re-read that follows a burst of changes (when re-reads
        are on, the link may lose updates, and a live message came since the last one
        began), or never."""
        if self._resync_s <= 0 or not self._may_lose or self._last_live <= self._last_reread:
            return math.inf
        return min(
            self._last_live + self._resync_quiet_s + RESYNC_SETTLE_S,
            self._first_live + RESYNC_SETTLE_MAX_S,
        )

    async def _reread(self, client: Client) -> None:
        """Anti-entropy: subscribe every granted filter again on this link and correct
        what we delivered by the broker's fresh retained snapshot (`_correct`).

        The snapshot's copies are held back (`_snapshot`) until a round trip marks its end,
        so a copy equal to what we delivered is never emitted again; live messages meanwhile
        are delivered as usual and win over the snapshot. A refused SUBSCRIBE is left to
        the link's task (it retries, then resyncs); a lost round trip ends the link.
        """
        self._last_reread = time.monotonic()
        filters = [f for f in self._filters if f not in self._missing]
        if filters and await self._read_again(client, filters):
            self.resyncs += 1

    async def _read_again(self, client: Client, filters: list[str]) -> bool:
        """Subscribe `filters` again, hold the fresh snapshot's copies back until a round
        trip marks its end, and emit only what it says differently (`_correct`). False when
        a SUBSCRIBE was refused (nothing judged: the link's task retries it)."""
        started = time.monotonic()
        async with self._lock:
            self._snapshot, self._snapshot_filters = {}, filters
            try:
                await self._subscribe(client, filters)
                if any(f in self._missing for f in filters):
                    return False
                await self._round_trip(client)
                snapshot = self._snapshot
            finally:
                self._snapshot, self._snapshot_filters = None, []
            await self._correct(client, filters, snapshot, started)
        return True

    async def _correct(
        self, client: Client, filters: list[str], snapshot: dict[str, bytes], started: float
    ) -> None:
        """Emit what the fresh `snapshot` of `filters` says differently from what we
        delivered; publish our own records again where the broker's copy is not ours
        (those the caller publishes itself, `retain(replay=False)`, come out as any
        other record: the caller puts its own back).

        Left alone: topics with a live message during the re-read (it is newer) and
        topics whose record changed within `resync_quiet_s` before it (the snapshot may
        lag). A record we hold that the snapshot lacks comes out as `Deleted`; a record we
        never delivered, or a different one, as `Received`; both flagged retained.
        """
        quiet_from = started - self._resync_quiet_s
        self._known = {t: (p, at) for t, (p, at) in self._known.items() if p or at >= quiet_from}
        scope = {
            t
            for t in itertools.chain(self._known, self._retained)
            if any(topic_matches(f, t) for f in filters)
        }
        corrected: list[str] = []
        # An empty snapshot while we hold records is a broker that did not send the
        # retained messages again for a SUBSCRIBE of an existing filter (Mosquitto, amqtt
        # and nats-server 2.9 do; MQTT 5's Retain Handling 1 would not): it deletes nothing.
        blind = not snapshot and any(self._known.get(t, (b"", 0.0))[0] for t in scope)
        if blind:
            self._log.warning(
                "bus_resync_empty",
                broker=self._broker,
                filters=filters,
                why="the broker sent no retained message for a re-read of filters that "
                "hold records: nothing is deleted on its word",
            )
        for topic in sorted(scope | set(snapshot)):
            if topic == self._ping_topic or topic in self._live_topics:
                continue
            fresh = snapshot.get(topic, b"")
            held, at = self._known.get(topic, (b"", -math.inf))
            if at >= quiet_from:
                continue
            ours = self._retained.get(topic)
            if ours is not None and ours.payload and ours.replay:
                if fresh != ours.payload:
                    corrected.append(topic)
                    await self._put_retained(client, topic, ours)
                continue
            if fresh == held or (blind and not fresh):
                continue
            result = decode_message(self.topics, topic, fresh, retained=True)
            if isinstance(result, Dropped):
                self._drop(topic, result)
                continue
            corrected.append(topic)
            self._known[topic] = (fresh, time.monotonic())
            self._emit(result)
        if corrected:
            self.lossy = True
            self.resync_corrections += len(corrected)
            self._log.warning(
                "bus_resync_corrected",
                broker=self._broker,
                topics=corrected[:20],
                count=len(corrected),
                total=self.resync_corrections,
                why="the broker's retained snapshot differed from what the link delivered",
            )

    async def _subscribe(self, client: Client, filters: Iterable[str]) -> None:
        """Subscribe; a refused filter is noted (`_missing`) for the link's task to retry.

        Topics these filters cover start over as not live: their retained copies that the
        broker sends now are a fresh snapshot (see `_dispatch`)."""
        wanted = list(filters)
        self._live_topics = {
            t for t in self._live_topics if not any(topic_matches(f, t) for f in wanted)
        }
        answers = dict(zip(wanted, await client.subscribe(wanted), strict=True))
        if answers.get(self._ping_topic) is not None:
            answers[self._ping_topic] = await self._ping_at_qos0(client)
        refusals = [answers[f] for f in wanted]
        refused: list[tuple[str, str]] = []
        for topic_filter, refusal in zip(wanted, refusals, strict=True):
            if refusal is None:
                self._missing.pop(topic_filter, None)
                self._granted.add(topic_filter)
            else:
                self._missing[topic_filter] = refusal
                refused.append((topic_filter, refusal))
        self.subscribe_refused = self._refusal_detail()
        if not refused:
            return
        self.synced_at = None
        self._refusal.set()
        broker = self._broker or ""
        for topic_filter, refusal in refused:
            self._log.warning(
                "bus_subscribe_refused",
                reason=SUBSCRIBE_REFUSED,
                broker=broker,
                filter=topic_filter,
                code=refusal,
            )
            self._emit(SubscribeRefused(broker, topic_filter, refusal, self.subscribe_refused))

    async def _ping_at_qos0(self, client: Client) -> str | None:
        """Subscribe the ping topic at QoS 0 where the broker refused it at QoS 1; the
        refusal, or None.

        The ping is a barrier behind the snapshot only at the snapshot's QoS: Mosquitto
        sends QoS 0 at once but queues QoS 1 messages beyond its in-flight window (20),
        so a QoS 0 echo came back after 21 of 200 retained members. A clustered NATS
        refuses new QoS 1 subscriptions (JetStream consumers) for tens of seconds after
        a server died, and it writes a new subscription's retained copies out before it
        reads our next packet, so there a QoS 0 echo still comes after them.
        """
        (refusal,) = await client.subscribe([self._ping_topic], qos=0)
        if refusal is None:
            self._log.info(
                "bus_ping_qos0", broker=self._broker, why="the broker refused the ping at QoS 1"
            )
        return refusal

    async def _put_retained(self, client: Client, topic: str, entry: _Retained) -> None:
        self._put_on_link.add(topic)
        if self._covered(topic):
            self._echoes.expect(topic, entry.payload)
        expiry_s = entry.expiry_s if entry.payload else None
        await client.publish(topic, entry.payload, qos=QOS, retain=True, expiry_s=expiry_s)
        if not entry.payload and self._retained.get(topic) is entry:
            del self._retained[topic]

    async def _round_trip(self, client: Client) -> float:
        """Publish a Ping to our own topic and wait for it; the seconds it took.

        The broker sends every retained message of a subscription before anything we
        publish after its SUBACK at the same QoS, so the echo (QoS 1, like the records;
        see `_ping_at_qos0`) also marks the end of the snapshot.
        """
        seq = next(self._seq)
        echo: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[seq] = echo
        started = time.monotonic()

        async def exchange() -> None:
            ping = Ping(node=self.node, seq=seq, sent=now())
            await client.publish(self._ping_topic, encode(ping), qos=QOS)
            await echo

        try:
            came, late = await _within_loop_time(exchange(), self._ping_timeout_s)
        finally:
            self._pings.pop(seq, None)
        if not came:
            reason = (
                f"no ping echo within {self._ping_timeout_s:g} s (+{late:.1f} s that this "
                "agent's event loop ran late): the link is dead"
            )
            raise _LinkLostError(reason)
        if late >= self._ping_timeout_s / 2:
            self._log.info("bus_ping_loop_late", late_s=round(late, 3))
        return time.monotonic() - started

    async def _resync(self, client: Client) -> None:
        """After a new subscription: prove its snapshot arrived, or replace the link."""
        covered = frozenset(self._granted)
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

    @property
    def _may_lose(self) -> bool:
        """Whether this link may lose an update or an echo: MQTT 3.1.1 (NATS), or a broker
        a re-read found losing one (`lossy`)."""
        return self.lossy or self._protocol == "3.1.1"

    def _covered(self, topic: str) -> bool:
        return any(topic_matches(f, topic) for f in self._filters)

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
        self._own_echo = asyncio.Event()
        self.retained_checked = False
        self._sync_withheld = False
        self._missing.clear()
        self._granted.clear()
        self._refusal.clear()
        self._refusal_drop = False
        self.subscribe_refused = ""
        self._live_topics.clear()
        self._known.clear()
        self._put_on_link.clear()
        self._connected = True
        self._broker = str(broker)
        self._protocol = "5" if v5 else "3.1.1"
        self._log.info(
            "bus_connected",
            broker=self._broker,
            protocol=self._protocol,
            will=will.topic if will else None,
            reconnects=self.reconnects,
        )
        self._emit(Connected(self._broker, self._protocol, will_delay=v5))

    def _link_down(self, broker: BrokerURL, reason: str, reason_code: int | None) -> None:
        self._gone.set()
        self._client = None
        self._connected = False
        self._broker = None
        self._protocol = None
        self.synced_at = None
        self.subscribe_refused = ""
        self._echoes.reset()
        for echo in self._pings.values():
            echo.cancel()
        self._pings.clear()
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
        if self._missing:
            return
        self._sync_withheld = bool(self.no_retained_wildcard) and self._check_target() is not None
        if self._sync_withheld:
            return
        self.no_retained_wildcard = ""
        self.synced_at = time.monotonic()
        filters = frozenset(self._granted) if covered is None else covered
        self._emit(Synced(self.synced_at, filters=filters & set(self._filters)))

    def _emit(self, event: Event) -> None:
        self._queue.put_nowait(event)

    def _refused(self, topic: str) -> None:
        detail = "our retained publication did not come back: the broker refused it (ACL?)"
        self._log.warning("bus_publish_refused", topic=topic, detail=detail)
        self._emit(Refused(topic, detail, ref=self.topics.parse(topic), lossy_link=self._may_lose))

    def _echo_lost(self, topic: str) -> None:
        lossy = self._may_lose
        self._log.info("bus_echo_lost", topic=topic[:300], lossy_link=lossy)
        self._emit(EchoLost(topic, ref=self.topics.parse(topic), lossy_link=lossy))

    def _dispatch(self, topic: str, payload: bytes, *, retained: bool) -> None:
        """Decode one message into an event; drop, count and log-once anything wrong."""
        ref = self.topics.parse(topic)
        self.deliveries[("other", "") if ref is None else (ref.kind, ref.domain)] += 1
        self._echoes.seen(topic, payload, live=not retained)
        will = self._will
        if will is not None and topic == will.topic and payload:
            if retained and self._checking == topic:
                self._check_seen = True
                if self._snapshot is None:
                    return  # the check's own filter: what we published, already delivered
            if not retained and self._retained.get(topic, _Retained(b"", None)).payload == payload:
                self._own_echo.set()
        if topic != self._ping_topic:
            if not retained:
                self._live_topics.add(topic)
                at = time.monotonic()
                if self._last_live <= self._last_reread:
                    self._first_live = at
                    self._burst.set()
                self._last_live = at
            elif topic in self._live_topics:
                # Older than the live message that came first (NATS 2.9 sends a new
                # subscription's retained copies after its consumer's live deliveries).
                self.stale_retained += 1
                self._log.debug("bus_stale_retained_dropped", topic=topic[:300])
                return
            elif self._snapshot is not None and any(
                topic_matches(f, topic) for f in self._snapshot_filters
            ):
                self._snapshot[topic] = payload  # a re-read's copy: `_correct` judges it
                return
        result = decode_message(self.topics, topic, payload, retained=retained)
        if isinstance(result, Dropped):
            self._drop(topic, result)
        elif isinstance(result, Received) and isinstance(result.payload, Ping):
            # Only our own pings reach us (our ping topic); other pings are ignored.
            echo = self._pings.get(result.payload.seq) if topic == self._ping_topic else None
            if echo is not None and not echo.done():
                echo.set_result(None)
        else:
            self._known[topic] = (payload, time.monotonic())
            self._emit(result)

    def _drop(self, topic: str, dropped: Dropped) -> None:
        self.dropped[dropped.reason.value] += 1
        key = (topic, dropped.reason.value)
        if key in self._drop_logged or len(self._drop_logged) >= _MAX_DROP_LOG_KEYS:
            return
        self._drop_logged.add(key)
        self._log.warning(
            "bus_message_dropped",
            topic=topic[:300],
            reason=dropped.reason.value,
            detail=dropped.detail[:300],
        )
