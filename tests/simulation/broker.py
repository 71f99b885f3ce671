"""The model broker: the MQTT semantics the membership code relies on, and no more.

One shard's member topics and the nodes' presence topics (one of each per node), all
retained. What it models, each as the agents' docs describe the broker (docs/membership.md,
docs/bus.md):

- the retained record of every topic; an empty publication deletes it;
- subscriptions: the shard's members filter and single presence topics, added and removed
  while a session lives;
- per-subscriber order: every accepted publication is queued to every session whose
  subscriptions cover its topic, in the order the broker accepted it, each delivery with a
  seeded delay that never lets it pass the one before (so a node's own publication comes
  back, its echo, after everything accepted before it);
- a SUBSCRIBE's retained snapshot, in no particular order, queued before anything accepted
  after it; a ping queued after it comes back once the snapshot is delivered (what the
  agent's bus turns into `Synced`);
- sessions: MQTT 5 resumes the session of a client id that reconnects within its expiry
  (the Will Delay), with what was queued for it meanwhile delivered first; MQTT 3.1.1
  starts afresh; a connect with a client id whose link the broker still holds takes that
  session over;
- the Last Will of a link that dies without DISCONNECT, the node's presence marked lost:
  after the Will Delay unless the client id connects again first (MQTT 5), at once with
  the will's hold_s (3.1.1); on a take-over, 3.1.1 brokers that publish the old link's
  will do so at once;
- a restart: every will (of connected clients and those still delayed) published at
  once, then every link closed; the broker comes back after a while, empty or with the
  retained records it persisted (before or after those wills), with no sessions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

import msgspec

from imexd.bus.events import Protocol, WillSpec
from imexd.messages import MemberRecord, MemberState, Presence, ended
from tests.simulation.clock import Clock
from tests.simulation.timings import CONNECT_TIMEOUT_S, HOP_S, SPIKE_S, WILL_DELAY_S

if TYPE_CHECKING:
    from tests.simulation.node import SimNode
    from tests.simulation.oracle import Oracle

Author = Literal["agent", "will", "hostile"]
"""Who wrote a record the broker accepted: the node's own agent, the broker for the
node's link (its will), or the hostile writer (with the node's credentials)."""
ItemKind = Literal["record", "ping", "eof"]
TopicKind = Literal["member", "presence"]
Topic = tuple[TopicKind, str]
"""A topic of the model: the member topic of a node in the shard, or its presence."""
Payload = MemberRecord | Presence
MEMBERS: Final = "members"
"""The subscription that covers every member topic of the shard (the members filter)."""


def member(node: str) -> Topic:
    return ("member", node)


def presence(node: str) -> Topic:
    return ("presence", node)


@dataclass(slots=True, eq=False)
class Link:
    """One connection of one agent to the broker, as each end sees it."""

    node: SimNode
    number: int
    """The agent's count of connect attempts (`Connected.link`), which its will says."""
    client_id: str
    will: WillSpec | None
    will_record: Presence | None
    """The will as this link's CONNECT carries it (hold_s and link filled in)."""
    net_ok: bool = True
    """The network between the agent and the broker works for this link."""
    broker_open: bool = False
    """The broker holds this link as connected."""
    client_open: bool = False
    """The agent holds this link as up (it took the CONNACK)."""
    uplink_at: float = 0.0
    """When the agent's last packet on this link reaches the broker (packets keep order)."""
    up_at: float = 0.0
    checked: bool = False
    """The retained check ran on this link (after its first own echo)."""
    session: Session | None = None
    published: set[Topic] = field(default_factory=set)
    """The agent's records it published on this link (the bus puts back only those)."""


@dataclass(slots=True, eq=False)
class Item:
    """One delivery queued for a session."""

    due: float
    kind: ItemKind
    topic: Topic = ("member", "")
    record: Payload | None = None
    retained: bool = False
    token: object = None
    """A ping's: what the agent asked it for."""
    seq: int = 0
    """A live record's place in the broker's order of accepted records; a ping's, the
    place of the last record accepted before it (what its return proves was seen)."""
    link: Link | None = None
    """An end of link's: the link it closes."""


@dataclass(slots=True, eq=False)
class Session:
    """What the broker keeps for a client id: its queue, subscriptions and current link."""

    client_id: str
    link: Link | None = None
    queue: deque[Item] = field(default_factory=deque)
    last_due: float = 0.0
    pumping: bool = False
    filters: set[str] = field(default_factory=set)
    """MEMBERS, and the nodes whose presence topic it subscribed."""

    def covers(self, topic: Topic) -> bool:
        kind, node = topic
        return MEMBERS in self.filters if kind == "member" else node in self.filters


class Broker:
    """The model broker (see the module); `up` while it serves."""

    def __init__(
        self,
        clock: Clock,
        *,
        protocol: Protocol,
        takeover_will: bool,
        persist_wills: bool,
        spike_p: float,
    ) -> None:
        self.clock = clock
        self.protocol: Protocol = protocol
        self.takeover_will = takeover_will
        """A 3.1.1 broker publishes the will of a link that a new one took over."""
        self.persist_wills = persist_wills
        """A persisting restart keeps the wills it published while shutting down."""
        self.spike_p = spike_p
        """The share of deliveries that are late (`timings.SPIKE_S`)."""
        self.oracle: Oracle | None = None
        self.up = True
        self.retained: dict[Topic, Payload] = {}
        """topic -> the retained record on it."""
        self.authors: dict[Topic, Author] = {}
        """topic -> who wrote what it holds (or last cleared it)."""
        self.ended: dict[str, MemberRecord] = {}
        """node -> its member record as it stood when a will (or a forged one) ended it: the
        record stays on the broker, ended, until its node writes another, even once a later
        presence replaced the will (not MQTT: the ground truth the oracle reads)."""
        self.history: dict[str, list[tuple[Topic, Payload]]] = {}
        """node -> every record accepted on its topics, oldest first (what a replay takes)."""
        self.sessions: dict[str, Session] = {}
        self.seq = 0
        """Records accepted so far (and restarts, which change what is retained)."""
        self._wills: dict[str, tuple[Link, int]] = {}
        """client id -> a delayed will pending (its link, and a token that a reconnect voids)."""
        self._will_tokens = 0

    def member_record(self, node: str) -> MemberRecord | None:
        """What `node`'s member topic holds."""
        record = self.retained.get(member(node))
        return record if isinstance(record, MemberRecord) else None

    def presence_of(self, node: str) -> Presence | None:
        """What `node`'s presence topic holds."""
        record = self.retained.get(presence(node))
        return record if isinstance(record, Presence) else None

    def stands(self, node: str) -> bool:
        """Whether `node`'s member record stands on the broker, no will having ended it."""
        standing = self.member_record(node)
        return (
            standing is not None
            and standing.state is not MemberState.LOST
            and self.ended.get(node) != standing
        )

    # -- delays ---------------------------------------------------------------------

    def hop(self) -> float:
        """One packet's delay between an agent and the broker."""
        rng = self.clock.rng
        delay = rng.uniform(*HOP_S)
        if self.spike_p and rng.random() < self.spike_p:
            delay += rng.uniform(*SPIKE_S)
        return delay

    def _deliver_delay(self, node: SimNode) -> float:
        delay = self.hop()
        if self.clock.now < node.slow_until:
            delay += self.clock.rng.uniform(0.0, node.slow_s)
        return delay

    def _uplink(self, link: Link) -> float:
        """When a packet the agent sends now on `link` reaches the broker."""
        link.uplink_at = max(self.clock.now + self.hop(), link.uplink_at)
        return link.uplink_at

    # -- what an agent sends --------------------------------------------------------

    def connect(self, link: Link) -> None:
        self.clock.at(self._uplink(link), self._on_connect, link)

    def subscribe(self, link: Link, filters: frozenset[str]) -> None:
        self.clock.at(self._uplink(link), self._on_subscribe, link, filters)

    def unsubscribe(self, link: Link, filters: frozenset[str]) -> None:
        self.clock.at(self._uplink(link), self._on_unsubscribe, link, filters)

    def publish(self, link: Link, topic: Topic, record: Payload | None) -> None:
        link.published.add(topic)
        self.clock.at(self._uplink(link), self._on_publish, link, topic, record)

    def ping(self, link: Link, token: object) -> None:
        self.clock.at(self._uplink(link), self._on_ping, link, token)

    def disconnect(self, link: Link) -> None:
        """A clean DISCONNECT: the will of the link is dropped."""
        self.clock.at(self._uplink(link), self._on_disconnect, link)

    def _open(self, link: Link) -> bool:
        """Whether a packet of `link` arriving now is taken."""
        return self.up and link.net_ok and link.broker_open

    def _on_connect(self, link: Link) -> None:
        if not self.up or not link.net_ok:
            self.clock.at(self.clock.now + CONNECT_TIMEOUT_S, link.node.on_connect_failed, link)
            return
        session = self.sessions.get(link.client_id)
        old = session.link if session is not None else None
        if old is not None and old.broker_open:
            # A take-over: the broker drops the old link (its agent is gone or, with the
            # same client id, is this one's past).
            old.broker_open = False
            if self.protocol == "3.1.1" and self.takeover_will and old.will_record is not None:
                self.accept(presence(old.node.name), old.will_record, "will")
        self._wills.pop(link.client_id, None)  # back within the Will Delay: no will
        present = session is not None and self.protocol == "5"
        if not present:
            session = Session(link.client_id)
            self.sessions[link.client_id] = session
        assert session is not None
        session.link = link
        link.session = session
        link.broker_open = True
        if self.clock.tracing:
            self.clock.note(f"broker: {link.node.name} link {link.number} open")
        self.clock.at(self.clock.now + self.hop(), link.node.on_connack, link, present)

    def _on_subscribe(self, link: Link, filters: frozenset[str]) -> None:
        if not self._open(link) or link.session is None:
            return
        session = link.session
        session.filters |= filters
        covered = [
            (topic, record)
            for topic, record in self.retained.items()
            if (MEMBERS in filters if topic[0] == "member" else topic[1] in filters)
        ]
        snapshot = sorted(covered, key=lambda entry: entry[0])
        self.clock.rng.shuffle(snapshot)  # a snapshot comes in no particular order
        for topic, record in snapshot:
            self._enqueue(session, Item(0.0, "record", topic, record, retained=True))

    def _on_unsubscribe(self, link: Link, filters: frozenset[str]) -> None:
        if self._open(link) and link.session is not None:
            link.session.filters -= filters

    def _on_publish(self, link: Link, topic: Topic, record: Payload | None) -> None:
        if self._open(link):
            self.accept(topic, record, "agent")

    def _on_ping(self, link: Link, token: object) -> None:
        if self._open(link) and link.session is not None:
            self._enqueue(link.session, Item(0.0, "ping", token=token, seq=self.seq))

    def _on_disconnect(self, link: Link) -> None:
        if not self._open(link):
            return
        link.broker_open = False
        self._offline(link)

    # -- what the broker does -------------------------------------------------------

    def accept(self, topic: Topic, record: Payload | None, author: Author) -> None:
        """Take `record` (None: a delete) on `topic`, and queue it to every session,
        connected or resumable, whose subscriptions cover it."""
        self.seq += 1
        if record is None:
            self.retained.pop(topic, None)
        else:
            self.retained[topic] = record
            self.history.setdefault(topic[1], []).append((topic, record))
        self.authors[topic] = author
        standing = self.member_record(topic[1])
        if isinstance(record, Presence) and standing is not None and ended(standing, record):
            self.ended[topic[1]] = standing
        if self.clock.tracing:
            what = "cleared" if record is None else describe(record)
            self.clock.note(f"broker: {topic[1]}'s {topic[0]} <- {what} (by {author})")
        if self.oracle is not None:
            self.oracle.on_accept(topic, record, author)
        for session in self.sessions.values():
            if session.covers(topic):
                self._enqueue(session, Item(0.0, "record", topic, record, seq=self.seq))

    def link_died(self, link: Link) -> None:
        """The broker notices that `link` died without DISCONNECT: its will."""
        if not self.up or not link.broker_open:
            return
        link.broker_open = False
        self._offline(link)
        will = link.will_record
        if will is None:
            return
        if self.protocol == "5":
            self._will_tokens += 1
            self._wills[link.client_id] = (link, self._will_tokens)
            self.clock.at(
                self.clock.now + WILL_DELAY_S, self._will_due, link.client_id, self._will_tokens
            )
        else:
            self.accept(presence(will.node), will, "will")

    def armed(self, node: str) -> bool:
        """Whether a will of `node` may still end its record: a link of it that the broker
        holds, or a will delayed."""
        links = [s.link for s in self.sessions.values() if s.link is not None]
        pending = [link for link, _ in self._wills.values()]
        return any(
            link.node.name == node and link.will_record is not None
            for link in [*[x for x in links if x.broker_open], *pending]
        )

    def _offline(self, link: Link) -> None:
        """A link ended: MQTT 5 keeps its session for its expiry; 3.1.1 drops it."""
        session = link.session
        if session is None or session.link is not link:
            return
        if self.protocol == "3.1.1":
            self.sessions.pop(link.client_id, None)
            return
        self.clock.at(self.clock.now + WILL_DELAY_S, self._expire, session, link)

    def _expire(self, session: Session, link: Link) -> None:
        expired = session.link is link and not link.broker_open
        if expired and self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]

    def _will_due(self, client_id: str, token: int) -> None:
        pending = self._wills.get(client_id)
        if pending is None or pending[1] != token or not self.up:
            return
        del self._wills[client_id]
        will = pending[0].will_record
        if will is not None:
            self.accept(presence(will.node), will, "will")

    def restart(self, down_s: float, *, empty: bool) -> None:
        """Shut down (every will at once, then every link closed) and come back after
        `down_s`: empty, or with what was retained. A broker that persists the wills it
        published while shutting down comes back with them; one that does not keeps the
        sessions instead, and publishes the will of each whose client does not connect
        again within its expiry after the restart (as Mosquitto does with persistence)."""
        if not self.up:
            return
        open_links = [s.link for s in self.sessions.values() if s.link and s.link.broker_open]
        delayed = [link for link, _ in self._wills.values()]
        self._wills.clear()
        for link in delayed:
            if link.will_record is not None:
                self.accept(presence(link.will_record.node), link.will_record, "will")
        before = dict(self.retained), dict(self.authors), dict(self.ended)
        if self.oracle is not None:
            self.oracle.on_shutdown()
        for link in open_links:
            if link.will_record is not None:
                self.accept(presence(link.will_record.node), link.will_record, "will")
        after = dict(self.retained), dict(self.authors), dict(self.ended)
        for link in open_links:
            link.broker_open = False
            if link.session is not None:
                self._enqueue(link.session, Item(0.0, "eof", link=link))
        self.up = False
        self.seq += 1
        self.sessions = {}
        if empty and self.oracle is not None:
            self.oracle.on_state_lost()
        kept = after if self.persist_wills else before
        self.retained, self.authors, self.ended = ({}, {}, {}) if empty else kept
        rearm = [] if empty or self.persist_wills else open_links
        if not empty and self.oracle is not None:
            self.oracle.on_state_kept()
        self.clock.at(self.clock.now + down_s, self._come_back, rearm)

    def _come_back(self, rearm: list[Link]) -> None:
        self.up = True
        if self.clock.tracing:
            self.clock.note(f"broker: up again, {len(self.retained)} retained records")
        for link in rearm:
            self._will_tokens += 1
            self._wills[link.client_id] = (link, self._will_tokens)
            self.clock.at(
                self.clock.now + WILL_DELAY_S, self._will_due, link.client_id, self._will_tokens
            )

    # -- deliveries -----------------------------------------------------------------

    def _enqueue(self, session: Session, item: Item) -> None:
        link = session.link
        delay = self._deliver_delay(link.node) if link is not None else self.hop()
        item.due = max(self.clock.now + delay, session.last_due)
        session.last_due = item.due
        session.queue.append(item)
        self._kick(session)

    def resume(self, session: Session) -> None:
        """The session's new link took its CONNACK: what was queued goes out now, first."""
        now = self.clock.now
        for item in session.queue:
            item.due = max(item.due, now)
        session.last_due = max(session.last_due, now)
        self._kick(session)

    def _kick(self, session: Session) -> None:
        if session.pumping or not session.queue:
            return
        session.pumping = True
        self.clock.at(session.queue[0].due, self._pump, session)

    def _pump(self, session: Session) -> None:
        session.pumping = False
        queue = session.queue
        now = self.clock.now
        while queue and queue[0].due <= now:
            link = session.link
            if link is None or not link.client_open or not link.net_ok:
                return  # kept for the next link of this session (`resume`)
            item = queue.popleft()
            link.node.on_item(link, item)
        self._kick(session)


def describe(record: Payload) -> str:
    """A record in a trace's words."""
    if isinstance(record, Presence):
        if record.lost:
            return f"will inc {record.incarnation} link {record.link} hold {record.hold_s:g}"
        said = "stopped" if record.stopped is not None else "runs"
        return f"presence ({said}) inc {record.incarnation}"
    where = "" if record.slot is None else f" slot {record.slot}"
    return (
        f"{record.state.value}{where} inc {record.incarnation} link {record.link} "
        f"seq {record.seq} at {record.address}"
    )


def will_of(will: WillSpec | None, *, protocol: Protocol, link: int) -> Presence | None:
    """The will a link's CONNECT carries, as the agent's bus fills it in."""
    if will is None or not isinstance(will.tombstone, Presence):
        return None
    payload = will.payload(WILL_DELAY_S, broker_waits=protocol == "5", link=link)
    return msgspec.json.decode(payload, type=Presence)
