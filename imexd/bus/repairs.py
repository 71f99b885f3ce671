"""The broker repairs: what a link does only for a broker that reorders or loses messages.

A single Mosquitto keeps MQTT's order and loses nothing it acknowledged, so on it the
link needs none of this. A clustered broker does not: nats-server 2.9's MQTT (measured
in docs/brokers.md) feeds each server's retained map asynchronously and sets up a
JetStream consumer per subscription, and it
- sends a new subscription's retained copies after live messages its consumer already
  delivered, so a copy may be older than what came first (`Repairs.intercept` drops it:
  `stale_retained`);
- loses live updates published while that consumer is being set up, and echoes of our
  own publications, so a view can stay wrong until someone reads the broker again
  (`Repairs` schedules re-reads and `Repairs.differences` says what they correct, by each
  record's writer's order: a snapshot that lags behind what came live holds older
  versions, which change nothing; the shard
  publishes a claim again when the link says an echo may be lost: `repaired`); and a
  server may miss a record in its retained map as well as its live update, so that its
  subscribers' re-reads cannot correct them: the periodic re-read publishes our own
  records again (`Repairs.refreshing`); and 2.14 gives up storing a retained message
  after its 5 s request timeout: a re-read publishes again a record of ours that came
  back to us and is missing from the snapshot, instead of telling the caller it was
  cleared (`Repairs.differences`);
- refuses new QoS 1 subscriptions for tens of seconds after a server of the cluster
  died (`refusal_waits`: the link subscribes again on the same link before it gives
  the link up for the next broker; the control plane's link asks again the same way);
- makes a JetStream consumer for every QoS 1 subscription, through its cluster's meta
  group (from 2.9.12 on replicated like the streams, whatever `consumer_replicas` says),
  which times out creating hundreds at once (`subscription_qos`: only the filters whose
  order a caller judges by get one; the figures are in docs/performance.md).

Which links get them is the broker profile (`[bus] broker`, `engaged`): "mosquitto"
none, "nats" all, "auto" all on a link that runs MQTT 3.1.1 (the only version NATS
speaks) and none on MQTT 5. The link (`imexd.bus.engine`) owns the I/O; this module owns
the repairs' state and verdicts, so it holds no client and sends nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final, Literal

import msgspec

from imexd.bus.mqtt import QOS, topic_matches
from imexd.messages import (
    Assignment,
    DomainSpec,
    HealthReport,
    MemberRecord,
    Payload,
    Received,
    Retry,
    WorkloadRecord,
    decode_message,
    tombstone,
    version,
)
from imexd.retry import backoff_delay
from imexd.settings import BrokerProfile
from imexd.topics import Topics

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

SUBSCRIBE_RETRIES: Final = 3
"""SUBSCRIBEs of a refused filter retried on one repaired link (with backoff) before the
link is dropped for the next broker. Answers nats-server 2.9 refusing new QoS 1
subscriptions for tens of seconds after a server of its cluster died; elsewhere a refusal
is an ACL's, and the link is given up at once."""


def refusal_waits(
    repaired: bool, initial_s: float, largest_s: float, rand: Callable[[], float]
) -> list[float]:
    """The waits before each new SUBSCRIBE of a refused filter on one link: none unless
    the link is `repaired`, else SUBSCRIBE_RETRIES of them, doubling from `initial_s` up
    to `largest_s`, jittered (`imexd.retry`). The agent's link and the control plane's
    both ask again by these, each with its own pace."""
    if not repaired:
        return []
    return [backoff_delay(n, initial_s, largest_s, rand) for n in range(SUBSCRIBE_RETRIES)]


def subscription_qos(repaired: bool, ordered: bool) -> int:
    """The QoS to subscribe a filter at: QOS (1) on a link without the repairs, and for
    an `ordered` filter (`Bus.subscribe`) on any link; 0 for the others, the ping's
    included, on a repaired link.

    A NATS server makes each QoS 1 subscription a JetStream consumer, created through
    the cluster's meta group, and 2.14 times out those of hundreds of agents connecting at
    once (refused SUBSCRIBEs, links lost: docs/brokers.md). A QoS 0 subscription is a
    plain NATS one. What it gives up is delivery across the loss of a route or a link:
    the re-reads correct that for retained records, and an ordered filter keeps its one
    order because its consumer reads the one stream. The ping's echo still marks the end
    of a snapshot: NATS writes a new subscription's retained copies out before it reads
    the client's next packet (`imexd.bus.pings`). Mosquitto would not keep that barrier
    for a QoS 1 snapshot past its in-flight window, which is why only repaired links (a
    NATS cluster) mix the two."""
    return QOS if ordered or not repaired else 0


RESYNC_SETTLE_S: Final = 1.0
"""A re-read also follows every burst of changes, this many seconds after its last live
message, so that an update lost in a formation is corrected seconds after it, not a
whole `[bus] resync_interval_s` later (a NATS cluster loses such updates:
docs/brokers.md). A burst that never ends is corrected by the periodic re-read, which no
burst puts off."""


def place(payload: Payload) -> tuple[float, ...] | None:
    """Where a record stands among those its writer published (greater is later), or None
    when it carries no order: a member record's or will's `version` (incarnation, link,
    seq), a health report's
    (incarnation, at), a control-plane record's (generation, tombstone). A re-read judges
    a snapshot's copy by it, so a clustered broker's snapshot that lags behind what came
    live (NATS feeds each server's retained map asynchronously) changes nothing."""
    if isinstance(payload, MemberRecord):
        return version(payload)
    if isinstance(payload, HealthReport):
        return (payload.incarnation, payload.at)
    if isinstance(payload, DomainSpec | WorkloadRecord | Assignment | Retry):
        return (payload.generation, int(tombstone(payload))) if payload.generation else None
    return None


def engaged(profile: BrokerProfile, protocol: Literal["5", "3.1.1"]) -> bool:
    """Whether a link of `protocol` under the broker profile gets the repairs."""
    if profile == "auto":
        return protocol == "3.1.1"
    return profile == "nats"


class StaleCopies:
    """The stale-copy filter of one link: nats-server 2.9 sends a new subscription's
    retained copies after the live messages its JetStream consumer already delivered, so
    a retained copy of a topic that got a live message since a filter covering it was
    last subscribed is older than that message. The agent's bus (`Repairs`) and the
    control plane's link (`imexd.control.link`) both drop such copies."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        """Topics that got a live message since a filter covering them was subscribed."""
        self.dropped = 0
        """Retained copies dropped because a live message on their topic came first."""

    def subscribed(self, filters: Iterable[str]) -> None:
        """`filters` were (re)subscribed: the retained copies the broker sends for them now
        are a fresh snapshot, whatever came live before."""
        wanted = list(filters)
        self.live = {t for t in self.live if not any(topic_matches(f, t) for f in wanted)}

    def stale(self, topic: str, *, retained: bool) -> bool:
        """Note one incoming message; whether it is a stale retained copy (counted)."""
        if not retained:
            self.live.add(topic)
            return False
        if topic in self.live:
            self.dropped += 1
            return True
        return False


class Verdict(msgspec.Struct):
    """What a re-read's snapshot says differently from what the link delivered."""

    deliver: list[tuple[str, bytes]] = msgspec.field(default_factory=list)
    """(topic, payload) to deliver flagged retained (b"": the record is gone)."""
    republish: list[str] = msgspec.field(default_factory=list)
    """Our own records the broker's copy differs from: publish them again."""
    refresh: list[str] = msgspec.field(default_factory=list)
    """Our own records the broker's copy matches, published again by a periodic re-read
    (`Repairs.refreshing`): another server of the cluster may have lost them."""
    blind: bool = False
    """The snapshot was empty while we hold records: nothing was deleted on its word."""


class Repairs:
    """The repairs' state for one bus, over its links.

    Per link (`link_up`): the topics that got a live message since a filter covering them
    was last subscribed, and the payload delivered last per topic (what a re-read
    compares the broker's snapshot with). Over the bus's life: the counters and the
    timing of re-reads.
    """

    def __init__(
        self,
        *,
        resync_s: float,
        ping_topic: str,
        rand: Callable[[], float],
        topics: Topics,
    ) -> None:
        self._topics = topics
        self._resync_s = resync_s
        self._ping_topic = ping_topic
        self._rand = rand
        self._copies = StaleCopies()
        self._known: dict[str, bytes] = {}
        """Per topic, the payload we delivered last on this link (b"": deleted)."""
        self._doubted: dict[str, bytes] = {}
        """Per topic, what the last re-read's snapshot said where it contradicted us with
        no order to judge by (it lacked a record we hold, or held one where a clear came):
        a second re-read that says the same, with nothing live on the topic in between,
        is believed. A lagging server's snapshot lacks what was just published and still
        holds what was just cleared; a clear lost, or a record the broker kept after a
        clear it lost, stays."""
        self._gone: set[str] = set()
        """Topics whose record we delivered and then a clear, kept across links."""
        self._snapshot: dict[str, bytes] | None = None
        """While a re-read runs: the retained copies it got, held back from the caller."""
        self._snapshot_filters: list[str] = []
        self._last_live = -math.inf
        """time.monotonic() of the last live message on a filter (not a ping)."""
        self._last_reread = -math.inf
        self._next_periodic = math.inf
        self.refreshing = False
        """The re-read under way is the periodic one: it publishes our records again even
        where our server holds them. A server of a cluster that missed one of them (its
        retained map lacks it, and its subscribers missed the live update) serves every
        re-read of those subscribers without it, and only a new publication reaches them
        (seen on nats-server 2.14.0: docs/performance.md)."""
        self.burst = asyncio.Event()
        """Set by the first live message since the last re-read: the link's task then
        schedules the re-read that follows the burst."""
        self.resyncs = 0
        """Re-reads completed."""
        self.resync_corrections = 0
        """Topics a re-read corrected: a record delivered, changed or deleted, or one of
        ours published again, because the broker's snapshot said otherwise."""

    @property
    def stale_retained(self) -> int:
        """Retained copies dropped because a live message on their topic came first."""
        return self._copies.dropped

    def link_up(self) -> None:
        """A new link: nothing is live on it yet, nothing delivered; re-reads start over."""
        self._copies.live.clear()
        self._known.clear()
        self._doubted.clear()
        self._next_periodic = self._jittered()

    def subscribed(self, filters: Iterable[str]) -> None:
        """`filters` were (re)subscribed: the retained copies the broker sends for them now
        are a fresh snapshot, whatever came live before."""
        self._copies.subscribed(filters)

    def intercept(self, topic: str, payload: bytes, *, retained: bool) -> bool:
        """Note one incoming message; True when it must not reach the caller: a retained
        copy older than a live message that came first on its topic (nats-server 2.9
        sends a new subscription's copies after its consumer's live deliveries), or a
        re-read's copy, which `differences` weighs once the snapshot is complete."""
        if topic == self._ping_topic:
            return False
        if self._copies.stale(topic, retained=retained):
            return True
        if not retained:
            self._doubted.pop(topic, None)
            if self._known.get(topic) == payload:
                return False  # it repeats what we delivered (a peer's refresh): no news
            if self._last_live <= self._last_reread:
                self.burst.set()  # the first of a burst: its re-read is scheduled
            self._last_live = time.monotonic()
            return False
        if self._snapshot is not None and any(
            topic_matches(f, topic) for f in self._snapshot_filters
        ):
            self._snapshot[topic] = payload
            return True
        return False

    def delivered(self, topic: str, payload: bytes) -> None:
        """`payload` reached the caller on `topic` (what a re-read compares with)."""
        if payload:
            self._gone.discard(topic)
        elif self._known.get(topic):
            self._gone.add(topic)
        self._known[topic] = payload

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop what was delivered on topics no subscription of ours covers now."""
        self._known = {t: k for t, k in self._known.items() if keep(t)}
        self._gone = {t for t in self._gone if keep(t)}

    def due(self) -> float:
        """time.monotonic() of the next re-read: the periodic one (`[bus]
        resync_interval_s`, jittered by +-25 % so that a fleet does not re-read in step;
        a burst's re-read does not put it off), or the one after a burst of live messages,
        whichever comes first; inf: none."""
        if self._resync_s <= 0:
            return math.inf
        due = self._next_periodic
        if self._last_live > self._last_reread:
            due = min(due, self._last_live + RESYNC_SETTLE_S)
        if self._doubted:  # believed on its second sight
            due = min(due, self._last_reread + RESYNC_SETTLE_S)
        return due

    def begin(self, filters: list[str]) -> None:
        """A re-read of `filters` starts: hold their retained copies back."""
        started = time.monotonic()
        self.refreshing = started >= self._next_periodic
        self._last_reread = started
        if self.refreshing:  # a burst's re-read does not put the periodic one off
            self._next_periodic = self._jittered()
        self._snapshot, self._snapshot_filters = {}, filters

    def end(self) -> dict[str, bytes]:
        """The re-read's snapshot is complete (or abandoned): the copies it held back."""
        snapshot = self._snapshot or {}
        self._snapshot, self._snapshot_filters = None, []
        return snapshot

    def differences(
        self,
        filters: list[str],
        snapshot: Mapping[str, bytes],
        *,
        ours: Mapping[str, bytes],
        published: Mapping[str, bytes],
        log: FilteringBoundLogger,
    ) -> Verdict:
        """What the fresh `snapshot` of `filters` says differently from what we delivered,
        given `ours` (the records we publish ourselves and replay, by topic) and
        `published` (ours as this link published them, the member record included).

        A record that carries its writer's order (`place`) is judged by it: a copy later
        than the one we hold comes out as received, an earlier one is left alone, so a
        snapshot that lags behind what came live changes nothing. Topics with a live
        message during the re-read are left alone (it is newer). One of `published` that
        came back to us and that the snapshot lacks is a store the broker lost (no clear
        came live): it goes out again, and the caller hears nothing. Any other record we
        hold that the snapshot lacks comes out as deleted, and a copy of a topic cleared
        since as received, once a second re-read says the same with nothing live on the
        topic in between (`_doubted`; the second re-read follows RESYNC_SETTLE_S after the
        first); a record we never delivered, or a different one, as received. Ours go out
        again where the snapshot differs; on a periodic re-read (`refreshing`), every one
        of `published` that the snapshot shows as we published it goes out again too. An
        empty snapshot while we hold records is a broker that did not send the retained
        messages again for a SUBSCRIBE of an existing filter (Mosquitto, amqtt and
        nats-server 2.9 do): it deletes nothing (logged: `bus_resync_empty`).
        """
        self._known = {t: p for t, p in self._known.items() if p}  # a clear: in `_gone`
        scope = {
            t
            for t in itertools.chain(self._known, ours)
            if any(topic_matches(f, t) for f in filters)
        }
        verdict = Verdict()
        doubted, self._doubted = self._doubted, {}
        verdict.blind = not snapshot and any(self._known.get(t) for t in scope)
        if verdict.blind:
            log.warning(
                "bus_resync_empty",
                filters=filters,
                why="the broker sent no retained message for a re-read of filters that "
                "hold records: nothing is deleted on its word",
            )
        for topic in sorted(scope | set(snapshot)):
            if topic == self._ping_topic or topic in self._copies.live:
                continue
            fresh = snapshot.get(topic, b"")
            held = self._known.get(topic, b"")
            own = ours.get(topic)
            later = None if own is not None or fresh == held else self._later(topic, fresh, held)
            if later is not None:
                if later:
                    verdict.deliver.append((topic, fresh))
                continue
            if self.refreshing and fresh and published.get(topic) == fresh:
                verdict.refresh.append(topic)
                continue
            if own is not None:
                if fresh != own:
                    verdict.republish.append(topic)
                continue
            if fresh == held or (verdict.blind and not fresh):
                continue
            if not fresh and held and published.get(topic) == held:
                # Ours, echoed, and no clear came live: the broker lost its store
                # (nats-server 2.14 gives up after its 5 s request timeout).
                verdict.republish.append(topic)
                continue
            if (not fresh or topic in self._gone) and doubted.get(topic) != fresh:
                self._doubted[topic] = fresh  # said once: the next re-read decides
                continue
            verdict.deliver.append((topic, fresh))
        return verdict

    def _later(self, topic: str, fresh: bytes, held: bytes) -> bool | None:
        """Whether the snapshot's `fresh` copy is later than `held`, what we delivered
        last (b"": nothing, or a clear), by their writer's order; None: the order cannot
        tell (either lacks an order, or both have the same, or `held` is a clear, which
        carries none: a record the writer published just before its clear, which we
        missed, and one after it look alike)."""
        if not held:
            return None
        new, old = self._order(topic, fresh), self._order(topic, held)
        return None if new is None or old is None or new == old else new > old

    def _order(self, topic: str, payload: bytes) -> tuple[float, ...] | None:
        """The writer's order of the record `payload` on `topic` (`place`; None: none)."""
        if not payload or self._topics.parse(topic) is None:
            return None
        message = decode_message(self._topics, topic, payload, retained=True)
        return place(message.payload) if isinstance(message, Received) else None

    def corrected(self, topics: list[str], log: FilteringBoundLogger) -> None:
        """A re-read put `topics` right (delivered or published again): counted, logged."""
        if not topics:
            return
        self.resync_corrections += len(topics)
        log.warning(
            "bus_resync_corrected",
            topics=topics[:20],
            count=len(topics),
            total=self.resync_corrections,
            why="the broker's retained snapshot differed from what the link delivered",
        )

    def _jittered(self) -> float:
        if self._resync_s <= 0:
            return math.inf
        return time.monotonic() + self._resync_s * (0.75 + 0.5 * self._rand())
