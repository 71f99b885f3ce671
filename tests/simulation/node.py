"""One simulated node: a real `ShardView`, driven as imexd.agent.run drives it.

The agent's parts that turn the shard's plans into effects are modelled here, each
after the method it stands for:

- the bus (`imexd.bus.engine`): connect with the will (the node's presence marked lost,
  one per run), subscribe (the members filter and our own presence from the start, the
  presence of each peer followed), a ping that proves a snapshot (`Synced`), the
  retained check after the first own echo (`BrokerChecked`), our presence replayed on
  every link and put back when written over, reconnects with the real `Rotation`
  backoff, and a deliberate reconnect when the will or the client id changes
  (`Agent._take`, an outbid in `Agent._claim`);
- the membership loop (`Agent._membership_loop`, `_presences_current`, `_step`,
  `_claim`): a turn once per batch of deliveries and at the shard's own timers
  (`ShardView.due_at`); one that may claim first waits for the presences of the peers
  whose records came from a snapshot (`ShardView.found`), then it steps; the node
  state it saves;
- the presences task (`Agent._follow_presences`, `_presences_read`): after each step,
  the presence of every peer the view holds a record of (`ShardView.followed`),
  subscribed with a round trip only where a claim may wait for it;
- the reconcile loop (`Agent._reconcile_loop`, `Reconciler.apply`): coalescing within
  `settle_s`, a removed member applied only once it stood `settle_s` and a round trip
  proved it (`ShardView.proven`), and no change while the view is not ready;
- the daemon, as a model: running or not, its slot, the members its hosts file lists.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Set
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

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
from imexd.membership.shard import Identity, Plan, ShardView
from imexd.messages import Deleted, MemberState, Presence, Received, ended
from imexd.nodestate import NodeState
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
    BUS_TIMEOUT_S,
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
SHARD = (DOMAIN, CLIQUE)
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
        self.shard = ShardView(
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
        self.daemon = Daemon()
        self.desired = Desired()
        self.desired_at = 0.0
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
        self.presences: set[str] = set()
        """The peers whose presence we follow (`Agent.presences`)."""
        self.presences_read: set[str] = set()
        """Those of them whose retained copies the shard has taken in, or whose wait for
        them was given up (`Agent.presences_read`)."""
        self.synced_filters: frozenset[str] | None = frozenset()
        """The filters of the last `Synced` taken in (`Agent.synced_filters`)."""
        self.following: tuple[frozenset[str], int] | None = None
        """While the presences task waits for the snapshot of presences it began to follow
        (`Agent._presences_read`): those presences, and the wait's token."""
        self.follow_token = 0
        self.awaiting: int | None = None
        """While a turn that may claim waits for the presences of the peers found in a
        snapshot (`Agent._presences_current`): the wait's token."""
        self.await_token = 0
        self.resumed = False
        """The next turn goes on past its wait for presences (`_presences_current`)."""
        self.wake = False
        self.rotation = Rotation(1, RECONNECT_INITIAL_S, RECONNECT_MAX_S, self.clock.rng.random)
        self.synced_at = float("-inf")
        self.view_ready = False
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
        self.quiet_at = 0.0
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
        self.proven_seq = 0
        """How far into the broker's order the last proof (a round trip) reached."""

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
        self.shard.start(incarnation)
        self.shard.join(SHARD, self.clock.now, needs=frozenset({_filter(MEMBERS)}))
        self.will = self.shard.will(TOPICS, at=self._wall())
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
        DISCONNECT (`Agent._shutdown`)."""
        self._note("leaves")
        link = self.link
        if link is not None and link.client_open:
            if not self.shard.duplicate:
                wall = self._wall()
                stopped = self.shard.presence(None, at=wall, stopped=wall)
                self.broker.publish(link, presence(self.name), stopped)
            if self.shard.published:
                self.broker.publish(link, member(self.name), None)
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
        self._ping(link, SyncPing(filters, new_link=True))

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
        self._apply(event)
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
        if isinstance(token, SyncPing):
            self._apply(Synced(at=self.clock.now, filters=frozenset(map(_filter, token.filters))))
            self.synced_filters = token.filters
            if token.new_link:
                self.synced_at = self.clock.now
                self.oracle.on_synced(self)
            following = self.following
            if following is not None and token.filters >= following[0]:
                self._read(following[0])  # the presences' snapshot is in
            self._request_step()
        elif token == "check":
            self._apply(BrokerChecked(BROKER, ok=True))
            self._request_step()
        elif isinstance(token, int) and self.proof is not None and self.proof[0] == token:
            mark = self.proof[1]
            self.proof = None
            self.proven_seq = max(self.proven_seq, item.seq)
            self.shard.proven(mark)
            self._finish()

    def _apply(self, event: Event) -> None:
        """One bus event into the shard, and the identity change it asks for."""
        shard = self.shard
        identity = shard.apply(event, self.clock.now)
        if identity is Identity.ASIDE:
            self._note("stands aside: another agent runs as this node")
            self.will = None
            self.client_id = f"imexd-{self.name}-duplicate-{shard.incarnation}"
            self.presence = None  # the other agent's to write (`Bus.disown`)
            self._leave_link("client id changed")
        elif identity is Identity.BACK:
            self._note("back: the other agent's record is gone")
            self.client_id = f"imexd-{self.name}"
            self.will = shard.will(TOPICS, at=self._wall())
            self._declare_presence()
            self._leave_link("client id changed")
        if not shard.synced:
            self.view_ready = False

    def _declare_presence(self) -> None:
        """Our presence now (`Agent._publish_report`: at start and whenever the
        incarnation changes), published on the current link and replayed on the next."""
        self.presence_before = self.presence
        self.presence = self.shard.presence(DOMAIN, at=self._wall())
        link = self.link
        if link is not None and link.client_open:
            self.broker.publish(link, presence(self.name), self.presence)

    def _subscribe(self, nodes: Set[str], *, synced: bool = True) -> None:
        """`Bus.subscribe` of the presence of `nodes`: on the link now, with the round trip
        that proves the snapshot (`LinkEngine._settle`) when `synced`, else on the next
        link."""
        self.filters |= nodes
        link = self.link
        if link is not None and link.client_open:
            self.broker.subscribe(link, frozenset(nodes))
            if synced:
                self._ping(link, SyncPing(frozenset(self.filters), new_link=False))

    def _unsubscribe(self, nodes: Set[str]) -> None:
        self.filters -= nodes
        link = self.link
        if link is not None and link.client_open:
            self.broker.unsubscribe(link, frozenset(nodes))

    # -- the membership loop ------------------------------------------------------------

    def _request_step(self) -> None:
        """The events loop took a batch in: membership turns (once the wait for followed
        presences, if one is on, is over)."""
        self.wake = True
        if self.awaiting is None:
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
        if self.awaiting is not None:
            return  # the turn is waiting for presences: it goes on when the wait ends
        now = self.clock.now
        self.turns = self.turns + 1 if now == self.turned_at else 1
        self.turned_at = now
        if self.turns > SPIN_TURNS:
            self.oracle.on_spin(self, self.shard.due_at(now))
            return
        resumed, self.resumed = self.resumed, False
        if not resumed:
            self.wake = False
            if not self.shard.member and not self._presences_current():
                return  # the turn goes on once their presences are in, or the wait is over
        self._step_on()

    def _step_on(self) -> None:
        """The rest of a turn: the step, then the presences of the peers it now holds
        records of (`Agent.follow`), then the next turn's time."""
        self._step()
        self._follow_presences()
        if self.wake:
            self._schedule_step(self.clock.now)
            return
        due = self.shard.due_at(self.clock.now)
        if due is not None:
            self._schedule_step(due)

    def _presences_current(self) -> bool:
        """`Agent._presences_current`: whether the presence of every peer whose record came
        from a snapshot (`ShardView.found`) was taken in; if not, the turn waits until the
        presences task says so, at most the bus's timeout and an echo timeout."""
        if self._found_read():
            return True
        self._follow_presences()
        if self._found_read():
            return True
        self.await_token += 1
        self.awaiting = self.await_token
        self.clock.at(
            self.clock.now + BUS_TIMEOUT_S + ECHO_TIMEOUT_S,
            self._await_over,
            self.life,
            self.await_token,
        )
        return False

    def _found_read(self) -> bool:
        return self.shard.found() <= self.presences_read

    def _presences_moved(self) -> None:
        """`Agent.presences_moved`: a turn waiting for presences looks again."""
        if self.awaiting is not None and self._found_read():
            self._resume()

    def _await_over(self, life: int, token: int) -> None:
        if life == self.life and self.awaiting == token:
            self._resume()  # bounded, not required: the turn goes on

    def _resume(self) -> None:
        self.awaiting = None
        self.resumed = True
        self._schedule_step(self.clock.now)

    def _follow_presences(self) -> None:
        """`Agent._follow_presences`, the presences task: follow the presence of every peer
        the view holds a record of, and no other. Newly followed ones are read at once
        (subscribed without a round trip) unless a claim may wait for one of them: then,
        with the round trip, until a `Synced` covers them, at most ECHO_TIMEOUT_S
        (`Agent._presences_read`), the task doing nothing else meanwhile."""
        if self.following is not None:
            return  # in a read: the task follows again when it ends
        while True:
            wanted = set(self.shard.followed())
            if gone := self.presences - wanted:
                self._unsubscribe(gone)
            self.presences_read &= wanted
            new = frozenset(wanted - self.presences)
            self.presences = wanted
            if not new:
                return
            if self.shard.member or not new & self.shard.found():
                self._subscribe(new, synced=False)
                self.presences_read |= new
                self._presences_moved()
                continue
            self._subscribe(new)
            read = self.synced_filters
            if read is None or read >= new:
                self.presences_read |= new
                self._presences_moved()
                continue
            self.follow_token += 1
            self.following = (new, self.follow_token)
            self.clock.at(
                self.clock.now + ECHO_TIMEOUT_S, self._follow_late, self.life, self.follow_token
            )
            return

    def _follow_late(self, life: int, token: int) -> None:
        following = self.following
        if life == self.life and following is not None and following[1] == token:
            self._read(following[0])  # bounded, not required: given up on

    def _read(self, nodes: frozenset[str]) -> None:
        """The presences task's read of `nodes` is over: they count as read, and the task
        follows the records that came meanwhile."""
        self.following = None
        self.presences_read |= nodes
        self._presences_moved()
        self._follow_presences()

    def _step(self) -> None:
        """`Agent._step`: derive, publish, commit, and what should run."""
        now = self.clock.now
        shard = self.shard
        desired = self.desired
        plan = shard.derive(
            now,
            wall_now=self._wall(),
            saved=self.saved,
            running=desired.run and (desired.domain, desired.clique) == shard.current,
            release=lambda: False,
        )
        if plan.hold:
            pass
        elif plan.desired is None:
            return
        else:
            self._claim(plan)
        if shard.synced:
            self.view_ready = True
            if self.waiting_view:
                self.waiting_view = False
                self._schedule_reconcile(now)

    def _claim(self, plan: Plan) -> None:
        """`Agent._claim`."""
        shard = self.shard
        decision = plan.decision
        assert decision is not None
        assert plan.desired is not None
        if plan.outbid:
            self.saved = replace(self.saved, incarnation=shard.incarnation)
        if plan.publish:
            record = shard.record(decision.claim, driver="")
            shard.sending(record)
            if self.first_state is None and record is not None:
                self.first_state = record.state
                self.resumed_ended = record.state is MemberState.MEMBER and self._past_ended()
            link = self.link
            if link is not None and link.client_open:
                self.broker.publish(link, member(self.name), record)
            shard.sent(record)
        shard.commit(plan)
        if plan.outbid:
            # Our will must end this incarnation's links: a new one, and a new link.
            self.will = shard.will(TOPICS, at=self._wall())
            self._declare_presence()
            self._leave_link("will changed")
        if decision.settled and decision.claim.slot is not None:
            self.saved = NodeState(
                domain=DOMAIN,
                clique=CLIQUE,
                slot=decision.claim.slot,
                incarnation=shard.incarnation,
            )
        if plan.desired != self.desired:
            self.desired = plan.desired
            self.desired_at = self.clock.now
            self.dirty = True
            self._schedule_reconcile(self.clock.now)

    def _past_ended(self) -> bool:
        """Whether a will accepted on our presence so far ended the past record we resume."""
        past = self.shard.past
        history = self.broker.history.get(self.name, [])
        return past is not None and any(
            isinstance(said, Presence) and ended(past, said) for _, said in history
        )

    # -- the reconcile loop -------------------------------------------------------------

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

    def _removes_members(self) -> bool:
        """`Agent._removes_members`: the desired hosts drop or move a member applied."""
        if self.applied is None or not self.desired.run:
            return False
        kept = {slot: m.address for slot, m in self.desired.members.items()}
        return any(kept.get(slot) != address for slot, (_, address) in self.applied[1].items())

    def _reconcile(self) -> None:
        """One turn of `Agent._reconcile_loop`, up to its proof or its apply."""
        if not self.dirty or self.rec_busy:
            return
        now = self.clock.now
        if now < self.quiet_at:
            self._schedule_reconcile(self.quiet_at)
            return
        removes = self._removes_members()
        if removes and now < self.desired_at + SETTLE_S:
            self._schedule_reconcile(self.desired_at + SETTLE_S)
            return
        if removes or self.shard.unproven:
            self.rec_busy = True
            link = self.link
            mark = self.shard.proof_mark()
            if link is None or not link.client_open:
                self._proof_failed()
                return
            self.pings += 1
            self.proof = (self.pings, mark)
            self._ping(link, self.pings)
            self.clock.at(now + BEAT_S, self._proof_late, self.life, self.pings)
            return
        self._finish()

    def _proof_late(self, life: int, token: int) -> None:
        if life == self.life and self.proof is not None and self.proof[0] == token:
            self._proof_failed()

    def _proof_failed(self) -> None:
        """No round trip came back: a removal waits settle_s more (a broker shutting down
        drops the link after its wills), then the view decides."""
        self.proof = None
        self.rec_busy = True
        if self._removes_members():
            self.clock.at(self.clock.now + SETTLE_S, self._after_wait, self.life)
        else:
            self._finish()

    def _after_wait(self, life: int) -> None:
        if life == self.life:
            self._finish()

    def _finish(self) -> None:
        """The end of a round: wait for a ready view, else apply what is desired now."""
        self.rec_busy = False
        if not self.view_ready:
            self.waiting_view = True
            return
        self.dirty = False
        stopped = self._apply_desired()
        self.quiet_at = 0.0 if stopped else self.clock.now + SETTLE_S
        if self.dirty:
            self._schedule_reconcile(self.clock.now)

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


@functools.cache
def _filter(name: str) -> str:
    """The bus filter of a model subscription (MEMBERS, or a node's presence)."""
    return TOPICS.members_filter(DOMAIN, CLIQUE) if name == MEMBERS else TOPICS.presence(name)


def _hosts(members: Members) -> str:
    return "{" + ", ".join(f"{slot}: {node}" for slot, (node, _) in members.items()) + "}"
