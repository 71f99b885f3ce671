"""The anti-entropy pass: the control plane's records this agent follows, newest only.

The broker is a cache the fleet can rebuild. Every spec, workload, assignment and retry
request carries its writer's generation, and a deletion is a tombstone (`imexd.order`).
`Rebuilder` stands between the bus and the agent's readers (the shard, the channel keeper,
the assignment and retry requests): it holds per topic the newest version it saw (also
across restarts, in the state dir) and passes on only what is newer. An older copy (a
replay, a stale standby broker restored from an older disk) is not applied, counted
(`imexd_bus_dropped_total{reason="stale"}`) and answered at once with the held version; an
empty payload removes nothing it holds (it only says the broker lost the record) and is
answered the same way. After every connect's snapshot, and every `[control]
anti_entropy_s`, the same pass publishes each held version that the broker serves older or
not at all, verbatim (its bytes, signature included): never an older one, and for a
deleted record its tombstone. An empty broker, a stale standby and a broker that lost a
moment of updates are healed alike, with no mark of the broker's identity to compare.

What it follows: its own assignment, and the spec, workloads and own retry request of its
domain; after it left a domain that was being deleted or deleted, that domain's records
(through `{p}/domains/{d}/#`) until the spec's tombstone is `[control]
tombstone_expiry_s` old, so that a node that was away while the domain was deleted cannot
bring it back. Workloads `claiming` belong to a command in flight and are never given back,
nor are retry requests (only the control plane may write them; the order still keeps an
older request from being acted on).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol

import structlog

from imexd.agent.statefile import RecordFile
from imexd.bus.events import Connected, Disconnected, Event, Synced
from imexd.bus.mqtt import topic_matches
from imexd.errors import BusError, FileWriteError
from imexd.health.guard import Guard
from imexd.health.metrics import Metrics
from imexd.messages import (
    Assignment,
    Deleted,
    DomainSpec,
    Dropped,
    DropReason,
    Payload,
    Received,
    Retry,
    WorkloadRecord,
    decode_message,
)
from imexd.order import Order, Verdict, Version, version
from imexd.settings import Settings
from imexd.signing import SIGNED_KINDS
from imexd.topics import TopicRef, Topics

TASK: Final = "rebuild"
"""The agent task's name (and heartbeat)."""
PUBLISH_LIMIT_S: Final = 30.0
"""How long one round of publishes may keep the task's heartbeat alive (each publish is
bounded by the MQTT client's own timeout)."""


class Publisher(Protocol):
    """The part of `imexd.bus.link.Bus` the rebuilder uses."""

    @property
    def echo_timeout_s(self) -> float: ...

    async def put_retained(
        self, topic: str, data: bytes, *, message_expiry_s: float | None = None
    ) -> None: ...

    async def subscribe(self, *topic_filters: str, ordered: bool = True) -> None: ...

    async def unsubscribe(self, topic_filter: str) -> None: ...

    def drop(self, topic: str, dropped: Dropped) -> None: ...


class Store(Protocol):
    """Where the held records are kept across restarts (`statefile.RecordFile`)."""

    def load(self) -> dict[str, bytes]: ...

    def save(self, records: dict[str, bytes]) -> None: ...


class Rebuilder:
    """The agent's side of the order: `on_event` for every bus event, `run` as a task."""

    @classmethod
    def from_settings(
        cls, settings: Settings, *, metrics: Metrics, log: structlog.typing.FilteringBoundLogger
    ) -> Rebuilder:
        """The agent's rebuilder: its records kept in the state dir across restarts."""
        return cls(
            settings.node.name,
            Topics(settings.bus.topic_prefix),
            metrics=metrics,
            log=log,
            store=RecordFile(settings.node.state_dir),
            expiry_s=settings.control.tombstone_expiry_s,
            period_s=settings.control.anti_entropy_s,
        )

    def __init__(
        self,
        node: str,
        topics: Topics,
        *,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        expiry_s: float,
        period_s: float,
        store: Store | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """expiry_s: `[control] tombstone_expiry_s`; period_s: `[control] anti_entropy_s`."""
        self.node = node
        self.topics = topics
        self.metrics = metrics
        self.log = log
        self.store = store
        self.expiry_s = expiry_s
        self.period_s = period_s
        self.clock = clock
        self.order = Order()
        self.domain: str | None = None
        """The domain the agent follows now."""
        self.delivered: dict[str, bytes] = {}
        """Topic -> the bytes the agent's readers last got there."""
        self.judged: set[str] = set()
        """Topics whose snapshot this link has shown (the pass judges only those)."""
        self.linked = False
        self.due: dict[str, Version] = {}
        """Held versions to publish now."""
        self.awaiting: dict[str, bytes] = {}
        """Published versions whose echo has not come back yet."""
        self.following: set[str] = set()
        """The `{p}/domains/{d}/#` filters subscribed for deleted domains."""
        self.dirty = False
        """The held versions changed since they were last saved."""
        self.drops: list[tuple[str, Dropped]] = []
        """Stale copies seen, for the bus's drop counter (`count_drops`)."""
        self.wake = asyncio.Event()
        if store is not None:
            self._load(store)

    def _load(self, store: Store) -> None:
        for topic, data in store.load().items():
            payload = self._payload(topic, data)
            if payload is not None and (held := version(payload, data)) is not None:
                self.order.held[topic] = held

    def _payload(self, topic: str, data: bytes) -> Payload | None:
        found = decode_message(self.topics, topic, data, retained=True)
        return found.payload if isinstance(found, Received) else None

    # -- what it follows --------------------------------------------------------------

    def follow(self, domain: str | None) -> None:
        """The agent follows `domain` now: forget what it no longer follows (it would not
        see a deletion there, so it must not give those back), keep deleted domains."""
        self.domain = domain
        now = self.clock()
        remembered = self.remembered(now)
        gone = self.order.forget(lambda t, v: self._keeps(t, v, remembered, now))
        for topic in gone:
            self.delivered.pop(topic, None)
            self.due.pop(topic, None)
        if gone:
            self.dirty = True
        self.wake.set()

    def remembered(self, now: float) -> frozenset[str]:
        """The domains whose spec the agent holds deleting or deleted, not yet expired."""
        out = set()
        for topic, held in self.order:
            ref = self.topics.parse(topic)
            if ref is None or ref.kind != "spec" or self._expired(held, now):
                continue
            spec = self._payload(topic, held.data)
            if isinstance(spec, DomainSpec) and spec.state != "active":
                out.add(ref.domain)
        return frozenset(out)

    def _expired(self, held: Version, now: float) -> bool:
        return held.tombstone and held.at > 0 and now - held.at > self.expiry_s

    def _keeps(self, topic: str, held: Version, remembered: frozenset[str], now: float) -> bool:
        ref = self.topics.parse(topic)
        if ref is None or self._expired(held, now):
            return False
        if ref.kind == "assignment":
            return ref.node == self.node
        if ref.kind == "retry" and ref.node != self.node:
            return False
        return ref.domain == self.domain or ref.domain in remembered

    def _followed(self, ref: TopicRef) -> bool:
        if ref.kind not in SIGNED_KINDS:
            return False
        if ref.kind == "assignment":
            return ref.node == self.node
        if ref.kind == "retry" and ref.node != self.node:
            return False
        return ref.domain == self.domain or ref.domain in self.remembered(self.clock())

    # -- events -----------------------------------------------------------------------

    def on_event(self, event: Event) -> list[Event]:
        """Take one bus event in; the events the agent's readers get instead (none: an
        older copy or a clear; a held version in place of either where the readers do not
        have it yet)."""
        if isinstance(event, Connected):
            self.order.link_up()
            self.judged.clear()
            self.awaiting.clear()
            self.linked = True
        elif isinstance(event, Disconnected):
            self.linked = False
        elif isinstance(event, Synced):
            return [*self._pass(event.filters), event]
        elif isinstance(event, Received) and self._followed(event.ref):
            return self._received(event)
        elif isinstance(event, Deleted) and self._followed(event.ref):
            return self._cleared(event)
        return [event]

    def _received(self, event: Received) -> list[Event]:
        topic = event.topic
        found = version(event.payload, event.data)
        if found is None:
            return [event]
        if self.awaiting.get(topic) == event.data:
            del self.awaiting[topic]
        verdict = self.order.offer(topic, found)
        if verdict is Verdict.NEW:
            self.dirty = True
            self.due.pop(topic, None)
            return self._deliver(event)
        if verdict is Verdict.SAME:
            self.due.pop(topic, None)
            return [] if self.delivered.get(topic) == event.data else self._deliver(event)
        held = self.order.held[topic]
        self.drops.append(
            (
                topic,
                Dropped(
                    DropReason.STALE,
                    f"generation {found.generation} is older than the held {held.generation}",
                ),
            )
        )
        self._give_back(topic, held)
        return self._held(topic, event.ref)

    def _cleared(self, event: Deleted) -> list[Event]:
        topic = event.topic
        if not self.order.cleared(topic):
            return [event]  # nothing held: nothing to remove, nothing to give back
        self._give_back(topic, self.order.held[topic])
        return self._held(topic, event.ref)

    def _deliver(self, event: Received) -> list[Event]:
        self.delivered[event.topic] = event.data
        return [event]

    def _held(self, topic: str, ref: TopicRef) -> list[Event]:
        """The held version for the readers, unless they have it already."""
        held = self.order.held[topic]
        if self.delivered.get(topic) == held.data:
            return []
        found = decode_message(self.topics, topic, held.data, retained=True)
        if not isinstance(found, Received):
            return []
        return self._deliver(Received(topic, ref, found.payload, retained=True, data=held.data))

    def _give_back(self, topic: str, held: Version) -> None:
        payload = self._payload(topic, held.data)
        if isinstance(payload, Retry):
            return  # only the control plane writes these: the order guards the agent itself
        if isinstance(payload, WorkloadRecord) and payload.state == "claiming":
            return  # a command in flight writes it again or gives it up
        if (
            isinstance(payload, Assignment)
            and payload.domain is not None
            and self.topics.spec(payload.domain) in self.order.held
            and self.order.held[self.topics.spec(payload.domain)].tombstone
        ):
            return  # an assignment to a domain this agent knows deleted holds nothing
        self.due[topic] = held
        self.wake.set()

    def _pass(self, filters: frozenset[str] | None) -> list[Event]:
        """The anti-entropy pass over the held topics this Synced covers (first time on
        this link): what the broker serves older or not at all is given back, and handed
        to the readers where they lack it."""
        out: list[Event] = []
        if not self.linked:
            return out
        covered = [
            topic
            for topic, _ in self.order
            if topic not in self.judged
            and (filters is None or any(topic_matches(f, topic) for f in filters))
        ]
        self.judged.update(covered)
        for topic, held in self.order.due(covered):
            ref = self.topics.parse(topic)
            if ref is None or not self._followed(ref):
                continue
            self._give_back(topic, held)
            out += self._held(topic, ref)
        return out

    def periodic(self) -> None:
        """The slow pass: what this link's broker was last seen serving older or not at
        all, of the topics it has shown."""
        if not self.linked:
            return
        for topic, held in self.order.due(self.judged):
            ref = self.topics.parse(topic)
            if ref is not None and self._followed(ref):
                self._give_back(topic, held)

    # -- the task ---------------------------------------------------------------------

    async def run(self, bus: Publisher, guard: Guard) -> None:
        """The agent's `rebuild` task: publish what is due, follow deleted domains, save
        the held versions, the slow pass; say which publishes did not come back within
        the bus's echo timeout (the broker's ACL may not give agents the rebuild grants)."""
        check_at: float | None = None
        next_pass = time.monotonic() + self.period_s
        while True:
            guard.heartbeats.beat(TASK)
            soonest = next_pass if check_at is None else min(next_pass, check_at)
            await guard.rest(TASK, self.wake, soonest)
            self.wake.clear()
            mono = time.monotonic()
            if check_at is not None and mono >= check_at:
                check_at = None
                self._check_echoes()
            if mono >= next_pass:
                next_pass = mono + self.period_s
                self.periodic()
            due, self.due = self.due, {}
            if due:
                check_at = time.monotonic() + bus.echo_timeout_s
                await guard.beating(TASK, self._publish(bus, due), limit=PUBLISH_LIMIT_S)
            follow, leave = self._deleted_moves()
            if follow or leave:  # mostly neither: no task, no wait
                work = self._follow_deleted(bus, follow, leave)
                await guard.beating(TASK, work, limit=PUBLISH_LIMIT_S)
            if self.dirty:
                self.save()

    def count_drops(self, bus: Publisher) -> None:
        """Hand the stale copies seen to the bus's drop counter."""
        drops, self.drops = self.drops, []
        for topic, dropped in drops:
            bus.drop(topic, dropped)

    async def _publish(self, bus: Publisher, due: Mapping[str, Version]) -> None:
        """Give each due version back, verbatim; a tombstone with the rest of its expiry."""
        now = self.clock()
        if due:
            self.metrics.count_rebuild()
        try:
            for topic, held in sorted(due.items()):
                expiry = None
                if held.tombstone and held.at > 0:
                    expiry = max(1.0, self.expiry_s - (now - held.at))
                self.awaiting[topic] = held.data
                await bus.put_retained(topic, held.data, message_expiry_s=expiry)
                ref = self.topics.parse(topic)
                self.metrics.count_restored(ref.kind if ref is not None else "other")
                self.log.info(
                    "rebuild.restored",
                    topic=topic,
                    generation=held.generation,
                    tombstone=held.tombstone,
                )
        except BusError as exc:
            # The link went: the next one's pass judges its own snapshot again.
            self.log.warning("rebuild.publish_failed", error=str(exc))

    def _deleted_moves(self) -> tuple[list[str], list[str]]:
        """The filters of the domains left deleted (or being deleted) to subscribe, and
        those to unsubscribe (expired, or active again)."""
        wanted = {
            self.topics.domain_filter(d) for d in self.remembered(self.clock()) if d != self.domain
        }
        return sorted(wanted - self.following), sorted(self.following - wanted)

    async def _follow_deleted(self, bus: Publisher, follow: list[str], leave: list[str]) -> None:
        """Subscribe the domains left deleted (or being deleted); drop the expired ones."""
        for topic_filter in follow:
            await bus.subscribe(topic_filter, ordered=False)
            self.following.add(topic_filter)
        for topic_filter in leave:
            await bus.unsubscribe(topic_filter)
            self.following.discard(topic_filter)

    def save(self) -> None:
        """Keep the held versions in the state dir (the task, after each round)."""
        if self.store is None:
            return
        self.dirty = False
        try:
            self.store.save({topic: held.data for topic, held in self.order})
        except FileWriteError as exc:
            self.dirty = True
            self.log.error("state.unwritable", error=str(exc))

    def _check_echoes(self) -> None:
        if missing := sorted(self.awaiting):
            self.awaiting.clear()
            self.metrics.count_unconfirmed_restores(len(missing))
            self.log.warning(
                "rebuild.unconfirmed",
                topics=missing,
                why="the broker did not give these records back: its ACL may not grant "
                "agents the rebuild (docs/security.md)",
            )
