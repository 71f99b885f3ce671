"""One simulated node: the agent's own core (`NodeCore`) and a real `ShardView` in it.

The decisions are the agent's: each input goes into the node's core as the driver
(imexd.agent.run) feeds it, and its actions are carried out on the model broker and
daemon, so the simulator and the agent cannot drift apart. The agent's I/O around the
core is modelled here, each after the part it stands for:

- the bus (`imexd.bus.engine`): connect with the will (the node's presence marked lost,
  one per run), subscribe (the members filter and our own presence from the start, the
  presence of each peer followed), a ping that proves a snapshot (`Synced`), the
  retained check after the first own echo (`BrokerChecked`), our presence replayed on
  every link and put back when written over, reconnects with the real `Rotation`
  backoff, and a deliberate reconnect when the will or the client id changes (the
  core's `SetWill` and `SetClientId`);
- the membership loop (`Agent._membership_loop`): a turn once per batch of deliveries
  and at the core's own timers (`NodeCore.next_due`); a turn that may claim first waits
  for the presences the core names (`Followed.current`), then steps;
- the presences task (`imexd.agent.presences`): the presence of every peer the view
  holds a record of followed (`Followed.follow`), a snapshot awaited only
  where a claim waits for it (`Followed.claim_waits`);
- the reconcile task (`Reconciler.run`): the rounds the core paces
  (`NodeCore.reconcile_next`), its round trip, and `Reconciler.apply` on the model;
- the daemon, as a model: running or not, its slot, the members its hosts file lists.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Set
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from imexd.agent.actions import (
    Action,
    Apply,
    AwaitView,
    Clear,
    Disown,
    Pause,
    ProveLink,
    Publish,
    Reconcile,
    SaveState,
    SetClientId,
    SetWill,
    StepSoon,
    Subscribe,
    Unsubscribe,
)
from imexd.agent.core import NodeCore
from imexd.agent.inputs import BusInput, Input, Proven, Reconciled, Retarget, Step
from imexd.bus.engine import _STABLE_S as STABLE_S
from imexd.bus.events import (
    BrokerChecked,
    Connected,
    ConnectFailed,
    Disconnected,
    Event,
    Protocol,
    Synced,
    WillSpec,
)
from imexd.bus.rotation import Rotation
from imexd.membership.desired import Desired
from imexd.membership.shard import ShardView
from imexd.messages import (
    Deleted,
    MemberRecord,
    MemberState,
    Payload,
    Presence,
    Received,
    ended,
)
from imexd.nodestate import NodeState
from imexd.settings import Settings, settings_from_mapping
from imexd.topics import TopicRef, Topics
from tests.simulation.broker import (
    MEMBERS,
    Broker,
    Item,
    Link,
    Topic,
    member,
    presence,
    will_of,
)
from tests.simulation.clock import Clock
from tests.simulation.timings import (
    BEAT_S,
    CLAIM_STALE_S,
    CLIENT_DETECT_MAX_S,
    CLIQUE,
    CONFIRM_GRACE_S,
    DETECT_MAX_S,
    DOMAIN,
    ECHO_TIMEOUT_S,
    RECONNECT_INITIAL_S,
    RECONNECT_MAX_S,
    SETTLE_S,
    TAKEOVER_WATCH_S,
    WALL_ORIGIN,
)

if TYPE_CHECKING:
    from tests.simulation.oracle import Oracle

TOPICS = Topics("imex/v2")
BROKER = "mqtt://sim"
Members = dict[int, tuple[str, str]]
"""slot -> (node, address): what a hosts file lists."""
SPIN_TURNS = 100
"""Turns of one node's membership loop at one instant of the simulated clock that make a
busy loop: a timer that stays due (`ShardView.due_at` in the past) wakes the loop at once,
again and again, and the agent's task spins without ever waiting. The oracle is told
(`Oracle.on_spin`), and the loop then waits for its next event: turns that change nothing
at one instant change nothing more when repeated, so the run goes on as the agent's
would, less the spinning."""


@dataclass(frozen=True, slots=True)
class SyncPing:
    """The ping after a SUBSCRIBE (`LinkEngine._settle`): its return is `Synced`."""

    filters: frozenset[str]
    """The subscriptions (MEMBERS, presence nodes) granted when it was sent."""
    new_link: bool
    """The first of its link: the link's whole snapshot, not one more subscription's."""
    life: int
    """The agent run that sent it (`Pings`: an echo is ours only if it carries what we
    sent; a resumed session can hand a new run its past run's echoes)."""


def _silent_log(clock: Clock) -> structlog.typing.FilteringBoundLogger:
    """The view's logger: nothing at all, or with a trace, its warnings and errors as notes
    (`membership.daemon_kept` says a plan broke `own_change`)."""

    def keep(_: object, level: str, event: structlog.typing.EventDict) -> str:
        clock.note(f"  {level}: {event.pop('event')} {event}")
        raise structlog.DropEvent

    level = logging.WARNING if clock.tracing else logging.CRITICAL
    processors = [keep] if clock.tracing else []
    wrapper = structlog.make_filtering_bound_logger(level)
    logger: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
        None, wrapper_class=wrapper, processors=processors
    ).bind()
    return logger


@dataclass(slots=True)
class Daemon:
    """The model IMEX daemon of a node: whether it runs, on which slot, with which hosts."""

    running: bool = False
    slot: int | None = None
    members: Members | None = None


class SimNode:
    """A node: its agent (a `ShardView` and the loops around it) and its daemon."""

    def __init__(
        self,
        name: str,
        index: int,
        *,
        clock: Clock,
        broker: Broker,
        oracle: Oracle,
        protocol: Protocol,
        max_nodes: int,
        skew_s: float,
    ) -> None:
        self.name = name
        self.address = f"10.0.0.{index + 1}"
        self.clock = clock
        self.broker = broker
        self.oracle = oracle
        self.protocol: Protocol = protocol
        self.max_nodes = max_nodes
        self.skew_s = skew_s
        """How far this node's wall clock (settle stamps) is off."""
        self.topic = TOPICS.member(DOMAIN, CLIQUE, name)
        self.ref = TopicRef(kind="member", domain=DOMAIN, clique=CLIQUE, node=name)
        self.saved = NodeState()
        """The state dir: kept across crashes."""
        self.alive = False
        self.life = 0
        """Counts the agent's starts: timers of an earlier life are ignored."""
        self.cut_until = float("-inf")
        """The node's network is cut until then (a `drop`)."""
        self.slow_until = float("-inf")
        self.slow_s = 0.0
        self.log = _silent_log(clock)
        self._reset()

    def _reset(self) -> None:
        """A fresh agent process (its state dir and network aside)."""
        shard = ShardView(
            node=self.name,
            address=self.address,
            max_nodes=self.max_nodes,
            mode="names",
            settle_s=SETTLE_S,
            claim_stale_s=CLAIM_STALE_S,
            confirm_grace_s=CONFIRM_GRACE_S,
            takeover_watch_s=TAKEOVER_WATCH_S,
            log=self.log,
        )
        settings = _settings(self.name, self.address, self.max_nodes)
        self.core = NodeCore(settings, shard=shard, started_at=self._wall(), log=self.log)
        self.daemon = Daemon()
        self.applied: tuple[tuple[str, str, int], Members] | None = None
        """(identity, members) the daemon was started or last reloaded with."""
        self.link: Link | None = None
        self.links = 0
        self.client_id = f"imexd-{self.name}"
        self.will: WillSpec | None = None
        self.filters: set[str] = {MEMBERS, self.name}
        """The bus's subscriptions, kept across links: the shard's members filter, our own
        presence (subscribed at start), and the presences followed."""
        self.presence: Presence | None = None
        """Our presence as the bus declares it (`Bus.retain`): replayed on every link."""
        self.presence_before: Presence | None = None
        self.answered: Presence | None = None
        """The copy written over our presence that was last put back (`_put_back`)."""
        self.granted: frozenset[str] = frozenset()
        """Bus filters the model broker has nothing on (the spec, our retry request and
        health report): granted with every snapshot."""
        self.reading: tuple[list[str], int] | None = None
        """While the presences task waits for the snapshot of presence topics it began to
        follow: those topics, and the wait's token (`Presences._read`)."""
        self.follow_token = 0
        self.claim_waiting = False
        """A turn that may claim waits for presences (`Presences.current`)."""
        self.wake = False
        self.rotation = Rotation(1, RECONNECT_INITIAL_S, RECONNECT_MAX_S, self.clock.rng.random)
        self.synced_at = float("-inf")
        self.step_at: float | None = None
        self.step_token = 0
        self.turned_at = float("-inf")
        self.turns = 0
        """Turns of the membership loop at `turned_at` (SPIN_TURNS)."""
        self.dirty = False
        self.rec_at: float | None = None
        self.rec_token = 0
        self.rec_busy = False
        self.waiting_view = False
        self.proof: tuple[int, int] | None = None
        """(token, mark) of the round trip that proves the deletions up to mark."""
        self.pings = 0
        self.saved_at_start = 0
        """The incarnation this run started with (what a diagnosis compares)."""
        self.first_state: MemberState | None = None
        """The state of the first record this run published (what a diagnosis reads)."""
        self.resumed_ended = False
        """This run resumed (its first record a member's) a past record of ours that a will
        on our presence had ended (what a diagnosis reads)."""
        self.resumed_from: MemberRecord | None = None
        """The past record this run's first record resumed, if it did (a diagnosis
        reads it)."""
        self.proven_seq = 0
        """How far into the broker's order the last proof (a round trip) reached."""

    @property
    def shard(self) -> ShardView:
        return self.core.shard

    @property
    def desired(self) -> Desired:
        return self.core.desired

    @property
    def up(self) -> bool:
        """The agent's link is up and its view synced."""
        return self.link is not None and self.link.client_open and self.shard.synced

    def _note(self, text: str) -> None:
        if self.clock.tracing:
            self.clock.note(f"{self.name}: {text}")

    # -- the agent's life -------------------------------------------------------------

    def start(self) -> None:
        """The agent starts (its state dir bumps the incarnation) and joins the shard."""
        self.life += 1
        self.alive = True
        self._reset()
        incarnation = self.saved.incarnation + 1
        self.saved = replace(self.saved, incarnation=incarnation)
        self.saved_at_start = incarnation
        self.core.start(self.saved)
        self._carry(self._feed(Retarget()))  # the members filter is subscribed from the start
        self.will = self.core.will(self._wall())
        self._note(f"agent starts, incarnation {incarnation}")
        self.oracle.on_start(self)
        self._declare_presence()
        self._connect(floor=0.0)

    def _wall(self) -> float:
        """This node's wall clock (`wire_now`)."""
        return WALL_ORIGIN + self.clock.now + self.skew_s

    def crash(self) -> None:
        """The node dies, daemon and all: the broker notices its link's end (its will)."""
        self._note("crashes")
        self._die()
        self.oracle.on_gone(self)

    def leave(self) -> None:
        """SIGTERM: our presence says we stopped, our record is cleared, the daemon stops,
        DISCONNECT (`Agent._shutdown`, `NodeCore.leave`)."""
        self._note("leaves")
        link = self.link
        if link is not None and link.client_open:
            self._carry(self.core.leave(self._wall()))
            link.client_open = False
            self.broker.disconnect(link)
            self.link = None
        self._die()
        self.oracle.on_gone(self, left=True)

    def _die(self) -> None:
        self.alive = False
        self.life += 1
        self.daemon = Daemon()
        link = self.link
        if link is not None:
            # The process is gone: its socket closes without DISCONNECT.
            link.net_ok = False
            link.client_open = False
            self.clock.at(
                self.clock.now + self.clock.rng.uniform(0.0, DETECT_MAX_S),
                self.broker.link_died,
                link,
            )

    def cut(self, down_s: float) -> None:
        """The node's network fails for `down_s`: both ends notice in their own time."""
        self.cut_until = self.clock.now + down_s
        link = self.link
        self._note(f"network cut for {down_s:.2f} s")
        if link is None or not link.net_ok:
            return
        link.net_ok = False
        rng = self.clock.rng
        self.clock.at(self.clock.now + rng.uniform(0.0, DETECT_MAX_S), self.broker.link_died, link)
        if link.client_open:
            self.clock.at(
                self.clock.now + rng.uniform(0.1, CLIENT_DETECT_MAX_S),
                self._notice_dead,
                self.life,
                link,
            )

    def slow(self, extra_s: float, for_s: float) -> None:
        """Deliveries to this node are late by up to `extra_s` for `for_s`."""
        self.slow_until = self.clock.now + for_s
        self.slow_s = extra_s
        self._note(f"deliveries slowed by up to {extra_s:.2f} s for {for_s:.2f} s")

    # -- the bus ----------------------------------------------------------------------

    def _connect(self, floor: float) -> None:
        self.links += 1
        link = Link(
            node=self,
            number=self.links,
            client_id=self.client_id,
            will=self.will,
            will_record=will_of(self.will, protocol=self.protocol, link=self.links),
            net_ok=self.clock.now >= self.cut_until,
            uplink_at=floor,
        )
        self.link = link
        self.broker.connect(link)

    def _current(self, link: Link) -> bool:
        return self.alive and link is self.link

    def on_connect_failed(self, link: Link) -> None:
        if not self._current(link) or link.client_open:
            return
        self._apply(ConnectFailed(BROKER, "connection refused"))
        self._retry_after(self.rotation.next(lost=False))

    def _retry_after(self, delay: float | None) -> None:
        self.clock.at(self.clock.now + (delay or 0.0), self._reconnect_due, self.life, self.link)

    def _reconnect_due(self, life: int, link: Link | None) -> None:
        if life == self.life and self.alive and link is self.link:
            self._connect(floor=0.0)

    def on_connack(self, link: Link, present: bool) -> None:
        if not self._current(link):
            return
        if not link.net_ok:
            self.clock.at(self.clock.now + BEAT_S, self.on_connect_failed, link)
            return
        link.client_open = True
        link.up_at = self.clock.now
        self._note(f"link {link.number} up (session {'resumed' if present else 'new'})")
        self._apply(
            Connected(BROKER, self.protocol, will_delay=self.protocol == "5", link=link.number)
        )
        if link.session is not None:
            self.broker.resume(link.session)
        if link.client_id != self.client_id or link.will != self.will:
            self._leave_link("will changed")  # changed while connecting: as the engine does
            return
        # `LinkEngine._serve`: subscribe everything, replay our presence, prove the snapshot.
        filters = frozenset(self.filters)
        self.broker.subscribe(link, filters)
        if self.presence is not None:
            self.broker.publish(link, presence(self.name), self.presence)
        self._ping(link, SyncPing(filters, new_link=True, life=self.life))

    def _notice_dead(self, life: int, link: Link) -> None:
        if life == self.life:
            self._link_lost(link, "ping timed out", None)

    def _link_lost(self, link: Link, reason: str, code: int | None) -> None:
        if not self._current(link) or not link.client_open:
            return
        link.client_open = False
        self._note(f"link {link.number} lost ({reason})")
        self._apply(Disconnected(BROKER, reason, code))
        self.oracle.on_link_down(self)
        if self.proof is not None:
            self._proof_failed()  # `Bus.barrier` returns False when the link ends
        stable = self.clock.now - link.up_at >= STABLE_S
        self._retry_after(self.rotation.next(lost=True, stable=stable))

    def _leave_link(self, reason: str) -> None:
        """A deliberate reconnect (a new will or client id): DISCONNECT, then connect."""
        link = self.link
        if link is None or not link.client_open:
            return  # the next CONNECT carries them
        link.client_open = False
        self.broker.disconnect(link)
        self._note(f"link {link.number} left ({reason})")
        self._apply(Disconnected(BROKER, reason))
        if self.proof is not None:
            self._proof_failed()
        self.rotation.left_cleanly()
        self._connect(floor=link.uplink_at)

    def _ping(self, link: Link, token: object) -> None:
        self.broker.ping(link, token)

    def on_item(self, link: Link, item: Item) -> None:
        """One delivery of the broker on `link`."""
        if not self._current(link) or not link.client_open:
            return
        if item.kind == "eof":
            code = None if self.protocol == "3.1.1" else 0x8B  # server shutting down
            self._link_lost(link, "the broker closed the link", code)
            return
        if item.kind == "ping":
            self._on_ping(item)
            return
        topic, ref = _address(item.topic)
        record = item.record
        event: Event = (
            Deleted(topic, ref, item.retained)
            if record is None
            else Received(topic, ref, record, item.retained)
        )
        step = self._apply(event)
        if item.topic == presence(self.name) and not item.retained:
            self._put_back(link, record)
        if (
            item.topic == member(self.name)
            and record is not None
            and not item.retained
            and not link.checked
            and self._current(link)
            and link.client_open
        ):
            # The engine checks the broker's retained snapshots once our record came back
            # live on this link (`imexd.bus.check`); this broker passes it.
            link.checked = True
            self._ping(link, "check")
        if step:
            self._request_step()

    def _put_back(self, link: Link, record: object) -> None:
        """`LinkEngine._put_back`: a live copy of our presence that is not ours (a will of
        an earlier link, the hostile writer's) goes back under ours, once per copy."""
        ours = self.presence
        if (
            ours is None
            or not isinstance(record, Presence)
            or record in (ours, self.presence_before, self.answered)
            or presence(self.name) not in link.published
        ):
            return
        self.answered = record
        self.broker.publish(link, presence(self.name), ours)

    def _on_ping(self, item: Item) -> None:
        token = item.token
        if isinstance(token, SyncPing) and token.life == self.life:
            filters = frozenset(map(_filter, token.filters)) | self.granted
            self._apply(Synced(at=self.clock.now, filters=filters))
            if token.new_link:
                self.synced_at = self.clock.now
                self.oracle.on_synced(self)
            reading = self.reading
            if reading is not None and self.core.presences.synced_covers(reading[0]):
                self._read(reading[0])  # the presences' snapshot is in
            self._request_step()
        elif token == "check":
            self._apply(BrokerChecked(BROKER, ok=True))
            self._request_step()
        elif isinstance(token, int) and self.proof is not None and self.proof[0] == token:
            mark = self.proof[1]
            self.proof = None
            self.proven_seq = max(self.proven_seq, item.seq)
            self._proven(mark, ok=True)

    # -- the core -----------------------------------------------------------------------

    def _feed(self, happened: Input) -> list[Action]:
        return self.core.feed(happened, now=self.clock.now, wall=self._wall())

    def _apply(self, event: Event) -> bool:
        """One bus event into the core as the events loop takes it in (`Agent._on_event`);
        whether membership steps on it."""
        sorted_out = self.core.sort(event)
        if sorted_out is not None:
            return sorted_out
        self._carry(self._feed(BusInput(event)))
        return True

    def _carry(self, actions: list[Action]) -> None:
        """The core's actions on the model broker, daemon and state dir (`Agent._do`)."""
        relink = ""
        for action in actions:
            match action:
                case Publish(topic, payload):
                    self._publish(topic, payload)
                case Clear(topics):
                    for topic in topics:
                        self._publish(topic, None)
                case SetWill(will):
                    if will != self.will:
                        self.will = will
                        relink = relink or "will changed"
                case SetClientId(client_id):
                    if client_id != self.client_id:
                        self.client_id = client_id
                        relink = "client id changed"
                case Disown(topic) if topic == TOPICS.presence(self.name):
                    self._note("stands aside: another agent runs as this node")
                    self.presence = None  # the other agent's to write (`Bus.disown`)
                case SaveState(state):
                    self.saved = state
                case Reconcile():
                    self.dirty = True
                    self._schedule_reconcile(self.clock.now)
                case StepSoon():
                    self._request_step()
                case Subscribe(filters) | Unsubscribe(filters):
                    model = {_filter(MEMBERS)}  # the members filter is the model's own
                    extra = frozenset(filters) - model
                    if isinstance(action, Subscribe):
                        self.granted |= extra
                    else:
                        self.granted -= extra
                case _:
                    pass  # subscriptions the model has nothing on, a survey, a probe
        if relink:
            if self.will is not None:
                self._declare_presence()  # its incarnation may have moved
            self._leave_link(relink)

    def _publish(self, topic: str, payload: Payload | None) -> None:
        """`Bus.retain` of a member record or our presence on the current link (a presence
        the bus replays: our will's, or the last word of a leave)."""
        ref = TOPICS.parse(topic)
        link = self.link
        if ref is None or link is None or not link.client_open:
            return
        if ref.kind == "member" and (payload is None or isinstance(payload, MemberRecord)):
            if payload is not None and self.first_state is None:
                self.first_state = payload.state
                resumed = payload.state is MemberState.MEMBER
                self.resumed_ended = resumed and self._past_ended()
                self.resumed_from = self.shard.past if resumed else None
            self.broker.publish(link, member(self.name), payload)
        elif ref.kind == "presence" and (payload is None or isinstance(payload, Presence)):
            self.broker.publish(link, presence(self.name), payload)

    def _declare_presence(self) -> None:
        """Our presence now (`Reporter.publish`: at start and whenever the incarnation
        changes), published on the current link and replayed on the next."""
        self.presence_before = self.presence
        self.presence = self.shard.presence(DOMAIN, at=self._wall())
        link = self.link
        if link is not None and link.client_open:
            self.broker.publish(link, presence(self.name), self.presence)

    def _subscribe(self, nodes: Set[str], *, synced: bool) -> None:
        """`Bus.subscribe` of the presence of `nodes`: on the link now, with the round trip
        that proves the snapshot (`LinkEngine._settle`) unless `synced` is False, else on
        the next link."""
        self.filters |= nodes
        link = self.link
        if link is not None and link.client_open:
            self.broker.subscribe(link, frozenset(nodes))
            if synced:
                self._ping(link, SyncPing(frozenset(self.filters), new_link=False, life=self.life))

    def _unsubscribe(self, nodes: Set[str]) -> None:
        self.filters -= nodes
        link = self.link
        if link is not None and link.client_open:
            self.broker.unsubscribe(link, frozenset(nodes))

    # -- the membership loop and the presences task ---------------------------------------

    def _request_step(self) -> None:
        """The events loop took a batch in: membership turns."""
        self.wake = True
        self._schedule_step(self.clock.now)

    def _schedule_step(self, at: float) -> None:
        if self.step_at is not None and self.step_at <= at:
            return
        self.step_at = at
        self.step_token += 1
        self.clock.at(at, self._step_due, self.life, self.step_token)

    def _step_due(self, life: int, token: int) -> None:
        if life != self.life or token != self.step_token:
            return
        self.step_at = None
        if self.claim_waiting:
            return  # the turn waits for presences: it goes on when they are in
        now = self.clock.now
        self.turns = self.turns + 1 if now == self.turned_at else 1
        self.turned_at = now
        if self.turns > SPIN_TURNS:
            self.oracle.on_spin(self, self.core.next_due(now))
            return
        self.wake = False
        self._carry(self._feed(Retarget()))
        if not self.shard.member and not self.core.presences.current():
            # A turn that may claim judges the slots with every peer's will in.
            self.claim_waiting = True
            self._follow()
            return
        self._turn()

    def _turn(self) -> None:
        """The step of a turn, and what it schedules (`Agent._step`)."""
        self._carry(self._feed(Step()))
        if self.core.view_ready and self.waiting_view:
            self.waiting_view = False
            self._schedule_reconcile(self.clock.now)
        self._follow()  # the peers it now holds records of
        if self.wake:
            self._schedule_step(self.clock.now)
            return
        due = self.core.next_due(self.clock.now)
        if due is not None:
            self._schedule_step(due)

    def _follow(self) -> None:
        """The presences task (`Presences.run`): follow what the core names, one batch of
        new presences at a time, their snapshot awaited only where a claim waits for it
        (at most ECHO_TIMEOUT_S)."""
        core = self.core
        while self.reading is None:
            dropped, new = core.presences.follow()
            if dropped:
                self._unsubscribe({_node(t) for t in dropped})
            if not new:
                break
            waits = core.presences.claim_waits(new)
            self._subscribe({_node(t) for t in new}, synced=waits)
            if not waits:
                core.presences.taken(new)
                continue
            self.follow_token += 1
            self.reading = (new, self.follow_token)
            at = self.clock.now + ECHO_TIMEOUT_S
            self.clock.at(at, self._read_late, self.life, self.follow_token)
        self._claim_may_go_on()

    def _read(self, topics: list[str]) -> None:
        self.reading = None
        self.core.presences.taken(topics)
        self._follow()

    def _read_late(self, life: int, token: int) -> None:
        reading = self.reading
        if life == self.life and reading is not None and reading[1] == token:
            self._read(reading[0])  # given up on: each wait is bounded

    def _claim_may_go_on(self) -> None:
        """A turn that waits for presences goes on once the core has them (a member's
        turns never wait), or once no read is left to wait for."""
        if not self.claim_waiting:
            return
        if self.shard.member or self.core.presences.current() or self.reading is None:
            self.claim_waiting = False
            self._turn()

    def _past_ended(self) -> bool:
        """Whether a will accepted on our presence so far ended the past record we resume."""
        past = self.shard.past
        history = self.broker.history.get(self.name, [])
        return past is not None and any(
            isinstance(said, Presence) and ended(past, said) for _, said in history
        )

    # -- the reconcile task -------------------------------------------------------------

    def _schedule_reconcile(self, at: float) -> None:
        if self.rec_busy or (self.rec_at is not None and self.rec_at <= at):
            return
        self.rec_at = at
        self.rec_token += 1
        self.clock.at(at, self._reconcile_due, self.life, self.rec_token)

    def _reconcile_due(self, life: int, token: int) -> None:
        if life != self.life or token != self.rec_token:
            return
        self.rec_at = None
        self._reconcile()

    def _reconcile(self) -> None:
        """Turns of `Reconciler.run`, up to a wait, a proof or an apply."""
        if not self.dirty or self.rec_busy:
            return
        now = self.clock.now
        applied = None if self.applied is None else self.applied[1]
        members = None if applied is None else {s: a for s, (_, a) in applied.items()}
        match self.core.reconcile_next(now, members):
            case Pause(until):
                self._schedule_reconcile(until)
            case ProveLink(mark):
                link = self.link
                if link is None or not link.client_open:
                    self._proven(mark, ok=False)
                    return
                self.rec_busy = True
                self.pings += 1
                self.proof = (self.pings, mark)
                self._ping(link, self.pings)
                # `Bus.barrier`: bounded by the link's ping timeout, not the loop's beat.
                self.clock.at(now + CLIENT_DETECT_MAX_S, self._proof_late, self.life, self.pings)
            case AwaitView():
                self.waiting_view = True  # stepped on the resynced view, or BEAT_S on
                self._schedule_reconcile(now + BEAT_S)
            case Apply():
                self.dirty = False
                stopped = self._apply_desired()
                self._feed(Reconciled(ok=True, probe_now=stopped))
                if self.dirty:
                    self._schedule_reconcile(self.clock.now)

    def _proof_late(self, life: int, token: int) -> None:
        if life == self.life and self.proof is not None and self.proof[0] == token:
            self._proof_failed()

    def _proof_failed(self) -> None:
        """No round trip came back (`Bus.barrier` is False when the link ends)."""
        proof, self.proof = self.proof, None
        if proof is not None:
            self._proven(proof[1], ok=False)

    def _proven(self, mark: int, *, ok: bool) -> None:
        self.rec_busy = False
        self._feed(Proven(mark, ok))
        self._reconcile()

    def _apply_desired(self) -> bool:
        """`Reconciler.apply` on the model daemon; True when nothing runs now."""
        desired = self.desired
        daemon = self.daemon
        before = set() if daemon.members is None else {n for n, _ in daemon.members.values()}
        if not desired.run or desired.domain is None or desired.slot is None:
            if daemon.running:
                self._note(f"daemon stops (slot {daemon.slot})")
                self.oracle.on_daemon_touched(self, "stopped", daemon.slot)
            self.daemon = Daemon()
            self.applied = None
            self.oracle.on_applied(self, before)
            return True
        members = {slot: (m.node, m.address) for slot, m in desired.members.items()}
        identity = (desired.domain, desired.clique, desired.slot)
        previous = self.applied
        self.applied = (identity, members)
        if previous is None or not daemon.running:
            self._note(f"daemon starts on slot {desired.slot} with {_hosts(members)}")
            self.oracle.on_daemon_started(self)
        elif previous[0] != identity:
            self._note(f"daemon restarts on slot {desired.slot} (was {daemon.slot})")
            self.oracle.on_daemon_touched(self, "restarted", daemon.slot)
        elif previous[1] != members:
            self._note(f"SIGUSR1: hosts {_hosts(members)}")
        self.daemon = Daemon(running=True, slot=desired.slot, members=members)
        self.oracle.on_applied(self, before)
        return False


@functools.cache
def _address(topic: Topic) -> tuple[str, TopicRef]:
    """The bus topic of a model topic, and what it addresses."""
    kind, node = topic
    if kind == "presence":
        return TOPICS.presence(node), TopicRef(kind="presence", node=node)
    ref = TopicRef(kind="member", domain=DOMAIN, clique=CLIQUE, node=node)
    return TOPICS.member(DOMAIN, CLIQUE, node), ref


def _node(topic: str) -> str:
    """The node of a presence topic."""
    ref = TOPICS.parse(topic)
    assert ref is not None
    return ref.node


@functools.cache
def _settings(name: str, address: str, max_nodes: int) -> Settings:
    """A node's settings as the simulator runs it (what its core reads)."""
    return settings_from_mapping(
        {
            "node": {"name": name, "address": address, "clique": CLIQUE},
            "domain": {
                "name": DOMAIN,
                "max_nodes": max_nodes,
                "settle_s": SETTLE_S,
                "claim_stale_s": CLAIM_STALE_S,
            },
            "bus": {"url": BROKER},
        },
        environ={},
    )


@functools.cache
def _filter(name: str) -> str:
    """The bus filter of a model subscription (MEMBERS, or a node's presence)."""
    return TOPICS.members_filter(DOMAIN, CLIQUE) if name == MEMBERS else TOPICS.presence(name)


def _hosts(members: Members) -> str:
    return "{" + ", ".join(f"{slot}: {node}" for slot, (node, _) in members.items()) + "}"
