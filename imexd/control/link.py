"""The control plane's link to the broker: one short-lived MQTT connection per command.

Its own `Link`, not `imexd.bus.link.Bus`: the commands are one-shot (connect, read a
snapshot, write, verify, leave), and an unreachable broker must be a clear error, not
retries; and Bus's snapshot ping needs a node's ACL grant, which the control plane's user
lacks. The `Link` proves its snapshot with an echo of its own non-retained message on
`{p}/domains/_control/sync/{client_id}` (never a domain, no agent subscribes). The rule to
know: an echo is a barrier only behind messages of its own QoS, so the link syncs once per
QoS it reads at (the QoS 1 echo on `.../sync/{client_id}/q1`). It connects and decodes
through the agents' own code (`imexd.bus.mqtt`, `imexd.messages.decode_message`). Why,
the sync topics, and refused subscriptions and broker repairs:
docs/control-plane.md#why-a-direct-mqtt-client.

With `[control] private_key` every spec, workload, assignment and retry request the link
puts is signed there (`Link.seal`, `imexd.signing`); with `[control] public_key` it reads
only the records of those kinds that verify (the rest are counted in `Store.dropped`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

from imexd.bus.mqtt import Client, connect, topic_matches
from imexd.bus.repairs import StaleCopies, engaged, refusal_waits
from imexd.bus.signatures import Signatures
from imexd.control.store import Store
from imexd.errors import BusError, ConfigError
from imexd.messages import Dropped, Received, WorkloadRecord, decode_message
from imexd.names import client_id
from imexd.settings import BrokerURL, BusSettings, Settings, parse_broker_url
from imexd.signing import SIGNED_KINDS, Signer, Verifier, load_signer, load_verifier
from imexd.topics import Topics

CONNECT_TIMEOUT_S: Final = 5.0
"""Bound on reaching a broker (TCP, TLS, CONNACK); each URL of `[bus] url` gets it."""
OPERATION_TIMEOUT_S: Final = 5.0
"""Bound on each broker round trip (SUBACK, PUBACK, the sync echo)."""
SUBSCRIBE_RETRY_S: Final = (0.25, 2.0)
"""First and largest wait before a refused subscription is asked for again on a repaired
link (`imexd.bus.repairs.refusal_waits`), within the operation timeout: a command waits
less than the agent, which paces by its reconnect settings."""
READ_QOS: Final = 0
"""QoS of the control plane's subscriptions, except the workload filters of a link that
races for a channel (`Link(race=True)`) and their sync echo (QoS 1). Its reads need the
retained snapshot, which a broker sends at SUBACK at any QoS, and live reports that
agents send again every report interval; at QoS 0 a clustered NATS serves them with a
plain subscription, where QoS 1 makes it create a JetStream consumer per subscription,
which times out or is refused for tens of seconds after a server died (nats-server 2.9).
And at QoS 0 a snapshot has no size limit: Mosquitto delivers one QoS 1 subscription at
most 20 messages in flight plus `max_queued_messages` (1000) queued, and drops the rest
without a word, so `workload delete` without --domain did not find the 1021st workload
of a fleet."""
READ_AGAIN_MAX: Final = 3
"""Fresh snapshots a read on a repaired link asks for after its first, at most, until one
brings no topic it lacked (`Link.read`): nats-server 2.14 leaves a retained message whose
load timed out out of a new subscription's snapshot, without a word (server/mqtt.go,
`loadRetainedMessages`), and caches those it loaded, so the next snapshot mostly has it."""
SYNC_LEVEL: Final = "_control"
"""Topic level under `{p}/domains/` for the sync echo: never a domain (not DNS-1123)."""
SYNC_QOS1_LEVEL: Final = "q1"
"""Last level of the QoS 1 sync echo's topic (module docstring)."""


@dataclass(frozen=True, slots=True)
class Logged:
    """One workload message as it arrived: their order is the channel race's referee."""

    topic: str
    payload: bytes
    record: WorkloadRecord | None
    """The decoded record; None for a deletion (an empty payload)."""


class _NotGrantedError(BusError):
    """A broker kept refusing (or did not answer) a subscription: another may grant it."""


def default_client_id() -> str:
    """`imexd-control-<pid>-<random>`: the random part keeps two control planes with the
    same pid (one per container, say) from taking each other's session over."""
    return client_id("imexd-control", str(os.getpid()), secrets.token_hex(3))


def open_link(settings: Settings, *, race: bool = False) -> Link:
    """The control plane's `Link` for `settings`: its `[bus]`, and the `[control]` keys
    that sign what it writes and verify what it reads (ConfigError naming a key that
    cannot be loaded)."""
    control = settings.control
    return Link(
        settings.bus,
        race=race,
        signer=load_signer(control.private_key) if control.private_key else None,
        verifier=load_verifier(control.public_key) if control.public_key else None,
    )


class Link:
    """One short-lived MQTT connection of the control plane (an async context manager).

    Entering connects to the first broker of `[bus] url` that answers within
    `connect_timeout_s` (the versions `[bus] protocol` allows, `mqtt.protocol_versions`:
    with "auto" MQTT 5, else 3.1.1 only when the broker refuses 5), or raises BusError
    naming each broker and why. `read` subscribes and returns once the retained snapshot
    is in `store`; `put` publishes a retained message; `verify` proves the broker kept
    what was put (a refused publish is otherwise invisible). A lost link raises BusError
    from the next call. A subscription refused for longer than the operation timeout moves
    the link to the next broker, while nothing was written on it (`store` keeps what it
    read, and the new broker's snapshot is applied over it).
    """

    def __init__(
        self,
        settings: BusSettings,
        *,
        client_id: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        timeout_s: float = OPERATION_TIMEOUT_S,
        race: bool = False,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.settings = settings
        self.race = race
        """Workload filters at QoS 1: the channel race of `workload create` judges by
        every message of them (`qos`)."""
        self.signer = signer
        """Signs the records `put` writes (`seal`); None: written unsigned."""
        self.verifier = verifier
        """Verifies the control-plane records read; None: accepted unsigned."""
        self._signatures = Signatures(verifier) if verifier is not None else None
        """The agents' check of those records (`imexd.bus.signatures`)."""
        self.topics = Topics(settings.topic_prefix)
        self.client_id = client_id or default_client_id()
        self.brokers: tuple[BrokerURL, ...] = tuple(parse_broker_url(u) for u in settings.url)
        if not self.brokers:
            raise ValueError("settings.url names no broker")
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.store = Store()
        self.changed = asyncio.Event()
        """Set on every message and when the link is lost; the waiter clears it."""
        self._watchers: set[Callable[[], None]] = set()
        """Called after each message is in `store`, and when the link is lost (`wait_until`)."""
        self.broker: str | None = None
        self.lost: str | None = None
        self._client: Client | None = None
        self._index = 0
        """Which of `brokers` the link is on."""
        self._wrote = False
        """Something was published on this link: it may no longer move to another broker."""
        self._reader: asyncio.Task[None] | None = None
        self._sync_topic = f"{self.topics.prefix}/domains/{SYNC_LEVEL}/sync/{self.client_id}"
        self._sync_topic_q1 = f"{self._sync_topic}/{SYNC_QOS1_LEVEL}"
        self._filters: list[str] = []
        self._seq = itertools.count(1)
        self._echoes: dict[int, asyncio.Future[None]] = {}
        self._last: dict[str, bytes] = {}
        self._repaired = False
        """This link gets the broker repairs (`imexd.bus.repairs.engaged`)."""
        self._copies = StaleCopies()
        """On a repaired link, the stale retained copies dropped (`_on_message`)."""
        self.workload_log: list[Logged] = []
        """Every valid workload message in the order the broker delivered it, the
        retained snapshot first (see `put_echoed`)."""

    async def __aenter__(self) -> Self:
        await self._open(range(len(self.brokers)), [self._sync_topic])
        return self

    async def _open(self, order: Iterable[int], filters: Sequence[str]) -> None:
        """Link to the first broker of `order` (indexes into `brokers`) that answers and
        grants every filter of `filters`; BusError naming each broker and why otherwise."""
        errors: list[str] = []
        for index in order:
            broker = self.brokers[index]
            try:
                client = await self._connect(broker)
            except BusError as exc:
                errors.append(str(exc))
                continue
            self._client, self._index, self.broker, self.lost = client, index, str(broker), None
            self._repaired = engaged(self.settings.broker, "5" if client.v5 else "3.1.1")
            self._copies.live.clear()
            self._reader = asyncio.create_task(self._read(client), name="control-read")
            try:
                await self._grant(client, filters)
            except _NotGrantedError as exc:
                errors.append(str(exc))
                await self._close()
                continue
            except BaseException:
                await self._close()
                raise
            self._filters = list(filters)
            return
        raise BusError("; ".join(errors))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        reader, client = self._reader, self._client
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if client is not None:
            await client.close(self.timeout_s)
        self._client = None

    async def _connect(self, broker: BrokerURL) -> Client:
        return await connect(
            self.settings,
            broker,
            client_id=self.client_id,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
        )

    # Incoming messages.

    async def _read(self, client: Client) -> None:
        try:
            async for message in client.messages():
                self._on_message(
                    message.topic,
                    message.payload,
                    retained=message.retained,
                    expiry_s=message.expiry_s,
                )
            self.lost = "the broker closed the connection"
        except BusError as exc:
            self.lost = str(exc)
        for echo in self._echoes.values():
            if not echo.done():
                echo.set_exception(BusError(f"lost the broker {self.broker}: {self.lost}"))
        self.changed.set()
        self._notify()

    def _on_message(
        self, topic: str, payload: bytes, *, retained: bool, expiry_s: int | None
    ) -> None:
        if topic in (self._sync_topic, self._sync_topic_q1):
            with contextlib.suppress(ValueError):
                echo = self._echoes.get(int(payload))
                if echo is not None and not echo.done():
                    echo.set_result(None)
            return
        if self._repaired and self._copies.stale(topic, retained=retained):
            return
        if retained and self._last.get(topic) == payload:
            return  # read again (`read`, a new broker's snapshot): nothing changed
        self._last[topic] = payload
        result = decode_message(self.topics, topic, payload, retained=retained)
        if self._signatures is not None and not isinstance(result, Dropped):
            result = self._signatures.check(result)  # the agents' own check
        if isinstance(result, Dropped):
            self.store.dropped[result.reason.value] += 1
            return
        if result.ref.kind == "workload":
            record = result.payload if isinstance(result, Received) else None
            live = isinstance(record, WorkloadRecord) and record.state != "deleted"
            self.workload_log.append(
                Logged(
                    topic, payload, record if live and isinstance(record, WorkloadRecord) else None
                )
            )
        expires_at = time.time() + expiry_s if expiry_s is not None else None
        self.store.apply(result, expires_at=expires_at)
        self.changed.set()
        self._notify()

    @property
    def stale_retained(self) -> int:
        """Retained copies dropped because a live message on their topic came first."""
        return self._copies.dropped

    def _notify(self) -> None:
        for watcher in list(self._watchers):
            watcher()

    # Operations.

    def _live(self) -> Client:
        if self._client is None or self.lost is not None:
            raise BusError(f"lost the broker {self.broker}: {self.lost or 'not connected'}")
        return self._client

    def raise_if_lost(self) -> None:
        """BusError when the link is gone (the reader saw it end)."""
        self._live()

    async def _subscribe(self, filters: Sequence[str]) -> None:
        """Subscribe `filters` here, or (nothing written yet) on the next broker that
        grants them along with every earlier subscription. The first QoS 1 filter brings
        the QoS 1 sync echo's topic along (`sync`)."""
        if self._sync_topic_q1 not in self._filters and any(self.qos(f) == 1 for f in filters):
            filters = [*filters, self._sync_topic_q1]
        client = self._live()
        try:
            await self._grant(client, filters)
        except _NotGrantedError as exc:
            others = [(self._index + k) % len(self.brokers) for k in range(1, len(self.brokers))]
            if self._wrote or not others:
                raise BusError(str(exc)) from None
            await self._close()
            try:
                await self._open(others, [*self._filters, *filters])
            except BusError as failed:
                raise BusError(f"{exc}; {failed}") from None
            return
        self._filters.extend(filters)

    async def _grant(self, client: Client, filters: Sequence[str]) -> None:
        """Subscribe `filters`, asking again with backoff (on a repaired link) for those the
        broker refused until the operation timeout; `_NotGrantedError` naming the broker
        and what it refused (or that it did not answer) when that did not do."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        wanted = list(filters)
        waits = iter(refusal_waits(self._repaired, *SUBSCRIBE_RETRY_S, random.random))
        for attempt in itertools.count():
            try:
                refusals = await self._subscribe_qos(client, wanted)
            except BusError as exc:
                raise _NotGrantedError(f"cannot subscribe at {self.broker}: {exc}") from None
            refused = [(f, r) for f, r in zip(wanted, refusals, strict=True) if r is not None]
            if not refused:
                return
            wanted = [f for f, _ in refused]
            delay = next(waits, None)
            if delay is None or loop.time() + delay - started > self.timeout_s:
                named = ", ".join(f"{f} (code {r})" for f, r in refused)
                raise _NotGrantedError(
                    f"the broker {self.broker} refused the subscription to {named}, "
                    f"{attempt + 1} times in {loop.time() - started:.1f} s: check its ACL for "
                    "this user (a clustered broker also refuses some for a while after one "
                    "of its servers died)"
                )
            await asyncio.sleep(delay)

    def qos(self, topic_filter: str) -> int:
        """QoS 1 for a workload filter of a racing link (the channel race judges by every
        message of it, in the broker's order: none may be missed, and a QoS 0 message may
        be lost across a NATS cluster's routes) and for the QoS 1 sync echo, `READ_QOS`
        for every other filter."""
        if topic_filter == self._sync_topic_q1:
            return 1
        levels = topic_filter.split("/")
        base = self.topics.prefix.count("/") + 1
        workloads = levels[base : base + 1] == ["domains"] and len(levels) > base + 2
        return 1 if self.race and workloads and levels[base + 2] == "workloads" else READ_QOS

    async def _subscribe_qos(self, client: Client, filters: Sequence[str]) -> list[str | None]:
        """Subscribe each filter at its `qos`; per filter None when granted, else why not."""
        refusals: dict[str, str | None] = {}
        for qos in sorted({self.qos(f) for f in filters}):
            group = [f for f in filters if self.qos(f) == qos]
            refusals.update(zip(group, await client.subscribe(group, qos=qos), strict=True))
        return [refusals[f] for f in filters]

    def _uncovered(self, topics: Iterable[str]) -> list[str]:
        """Those of `topics` that no filter we subscribed covers (a topic subscribed by
        name is found without matching it against every filter)."""
        named = set(self._filters)
        wildcards = [f for f in named if "+" in f or "#" in f]
        return [
            t for t in topics if t not in named and not any(topic_matches(f, t) for f in wildcards)
        ]

    async def read(self, *filters: str) -> Store:
        """Subscribe to `filters`; returns once their retained snapshot is in `store`.

        On a repaired link (a broker repair: a NATS cluster may leave records out of a
        snapshot, `READ_AGAIN_MAX`) the new filters are subscribed again until a fresh
        snapshot brings no topic the link lacked; a copy read twice is applied once
        (`_on_message`)."""
        # A filter subscribed already was read then, and its subscription keeps the store
        # current since: no round trip for it.
        if new := [f for f in filters if f not in self._filters]:
            await self._subscribe(new)
            await self.sync()
            if self._repaired:
                await self._read_again(new)
        # A member record is judged with its node's presence, where the node's Last Will
        # goes (`Store.members`): read the presence of every node that has one.
        if unread := self._uncovered(self.topics.presence(n) for n in self.store.written):
            await self.read(*sorted(unread))
        return self.store

    async def _read_again(self, filters: Sequence[str]) -> None:
        """Subscribe `filters` again and sync, until that brings no new topic (at most
        `READ_AGAIN_MAX` times). A refusal ends it: the link keeps what it read."""
        for _ in range(READ_AGAIN_MAX):
            known = set(self._last)
            try:
                await self._grant(self._live(), filters)
            except _NotGrantedError:
                return
            await self.sync()
            if set(self._last) <= known:
                return

    async def sync(self) -> None:
        """Every message the broker queued for us before now is delivered: one round trip
        per QoS the link reads at, each echo behind the messages of its QoS (module
        docstring)."""
        client = self._live()
        topics = [t for t in (self._sync_topic, self._sync_topic_q1) if t in self._filters]
        loop = asyncio.get_running_loop()
        echoes = {next(self._seq): (topic, loop.create_future()) for topic in topics}
        self._echoes.update((seq, echo) for seq, (_, echo) in echoes.items())
        waiting = ""
        try:
            async with asyncio.timeout(self.timeout_s):
                for seq, (topic, _) in echoes.items():
                    await client.publish(topic, str(seq).encode())
                for topic, echo in echoes.values():
                    waiting = topic
                    await echo
        except TimeoutError:
            raise BusError(
                f"no echo of our sync message on {waiting} within {self.timeout_s:g} s: "
                "the broker must let the control plane read and write it (ACL)"
            ) from None
        except BusError as exc:
            raise BusError(f"cannot publish to {self.broker}: {exc}") from None
        finally:
            for seq in echoes:
                self._echoes.pop(seq, None)

    def seal(self, topic: str, payload: bytes) -> bytes:
        """What `put` publishes for `payload` on `topic`: a spec, workload, assignment or
        retry request signed with `[control] private_key`; a clear, another kind of
        record, or any record without a key, as it is. Signatures are deterministic
        (Ed25519), so sealing again gives the same bytes (`verify`, `put_echoed`)."""
        ref = self.topics.parse(topic)
        if not payload or ref is None or ref.kind not in SIGNED_KINDS:
            return payload
        if self.signer is None:
            if self.verifier is not None:
                raise ConfigError(
                    [
                        "control.private_key: expected a key where control.public_key is set: "
                        "what this command writes would not verify"
                    ]
                )
            return payload
        return self.signer.seal(topic, payload)

    async def put(self, topic: str, payload: bytes) -> None:
        """Publish a retained message (QoS 1); an empty payload deletes the retained one.
        A record the control plane signs goes out sealed (`seal`).

        The topic is subscribed first when no filter covers it, so `verify` can see it.
        """
        data = self.seal(topic, payload)
        if self._uncovered([topic]):
            await self._subscribe([topic])
        client = self._live()
        self._wrote = True
        try:
            await client.publish(topic, data, retain=True)
        except BusError as exc:
            raise BusError(f"cannot publish to {topic}: {exc}") from None

    async def put_echoed(self, topic: str, payload: bytes) -> int:
        """Publish a retained workload record and wait for its echo on our subscription;
        the echo's index in `workload_log`.

        Every message before that index reached the broker before ours, in the order every
        other subscriber of the topic sees too (one broker delivers them all the same
        order): what the channel race (`imexd.control.workloads`) decides by. No echo
        within the operation timeout (an ACL that drops the publish) raises BusError.
        """
        if self._uncovered([topic]):
            raise ValueError(f"{topic} is not subscribed: no echo would come")
        start = len(self.workload_log)
        found: list[int] = []
        sealed = self.seal(topic, payload)

        def echoed() -> bool:
            for index in range(start, len(self.workload_log)):
                logged = self.workload_log[index]
                if logged.topic == topic and logged.payload == sealed:
                    found.append(index)
                    return True
            return False

        await self.put(topic, payload)
        if not await self.wait_until(echoed, self.timeout_s):
            raise BusError(
                f"no echo of our write to {topic} within {self.timeout_s:g} s: the broker must "
                "let the control plane read and write it (ACL)"
            )
        return found[0]

    async def verify(self, written: Mapping[str, bytes]) -> list[str]:
        """The topics of `written` whose last message is not what we put there (as `put`
        sealed it).

        A publish that an ACL refused still gets its PUBACK (MQTT 3.1.1, and the MQTT client
        drops MQTT 5 reason codes), so only reading it back tells.
        """
        await self.sync()
        return sorted(t for t, p in written.items() if self._last.get(t) != self.seal(t, p))

    async def wait_until(self, done: Callable[[], bool], within_s: float) -> bool:
        """Wait at most `within_s` seconds until `done()` holds over the store; whether it did.

        `done()` is asked once now, then after each message as it enters the store (not
        once per batch the client read), so the wait ends on the very message that made it
        hold, and nothing else wakes it: no re-check timer, only the deadline. Time alone
        never makes a waited-for state true here: reports go stale or expire (less UP, not
        more), and agents republish theirs every `[health] report_interval_s`, which is a
        message. A lost link raises BusError.
        """
        if done():
            return True
        self.raise_if_lost()
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def check() -> None:
            if held.done():
                return
            if self.lost is not None:
                held.set_exception(BusError(f"lost the broker {self.broker}: {self.lost}"))
                return
            try:
                if done():
                    held.set_result(None)
            except Exception as exc:  # handed to the waiter, which raises it
                held.set_exception(exc)

        self._watchers.add(check)
        try:
            async with asyncio.timeout(within_s):
                await held
        except TimeoutError:
            return False
        finally:
            self._watchers.discard(check)
        return True
