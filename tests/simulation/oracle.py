"""The oracle: the three invariants of docs/membership.md, checked against what really
happened (the broker's records and who wrote them, which nodes live), never against
what a view believes.

1. **A settled member's daemon is touched only by its own decision.** Stopping or
   restarting a running daemon is a breach unless, since it started, the node's
   continuity was really lost (its record stopped standing on the broker: its will, its
   presence marked lost, fired and ended it, the broker lost its state, or its link went
   down while a record it did not write stood on its topic or a will it did not write
   ended its record) and another node's claim or member record on the daemon's slot
   reached the broker (a rival that the stamps may rank first once continuity is lost:
   `own_change`). A leave and a crash end the daemon with the node: no breach.
2. **Hosts files converge.** After the last fault and `QUIET_S`, every live node is a
   settled member whose daemon runs, and all of them list the same slot map: every live
   node, at its real address, each on the slot its own daemon runs, each slot once.
3. **Nothing dead comes back.** A node that crashed or left (and did not start again)
   leaves every live peer's hosts file within `GONE_BOUND_S` of its end (within
   `REJOIN_BOUND_S` of the peer's next snapshot, where the peer's link was down), and once
   a peer dropped it after a round trip proved its end, never returns to that peer's
   hosts file. A dead node's member record stays on the broker as it wrote it (its will,
   on its presence topic, is what ends it): the rule is about the hosts files.

A record (or will) that the hostile writer forged on a node's topics with a version the
node never wrote past (it died before it could outbid it) is the broker's to keep, not the agents'
to repair (docs/membership.md, *What a node with valid credentials that lies can still
do*): that node is left out of rules 2 and 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from imexd.messages import LINK_END, MemberRecord, MemberState, Presence, Version, ended, version
from tests.simulation.broker import Author, Broker, Payload, Topic, member, presence
from tests.simulation.clock import Clock
from tests.simulation.timings import GONE_BOUND_S, REJOIN_BOUND_S

if TYPE_CHECKING:
    from tests.simulation.node import SimNode

DAEMON_TOUCHED = "1 daemon touched"
NO_CONVERGENCE = "2 no convergence"
DEAD_RETURNED = "3 dead node listed"
RUNAWAY = "runaway"
"""Not an invariant: the run did not go quiet within its event budget, or an agent's
membership loop spun (turned without end at one instant); reported only when the run
broke no invariant."""
RULES = (DAEMON_TOUCHED, NO_CONVERGENCE, DEAD_RETURNED, RUNAWAY)

_CONTENDING = frozenset({MemberState.CLAIMING, MemberState.MEMBER})


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: which, when, and what was seen."""

    rule: str
    at: float
    detail: str
    nodes: tuple[str, ...] = ()
    """The nodes it is about (what a diagnosis looks at)."""


class Broken(Exception):  # noqa: N818 - it is what happened, not an error of the code
    """Raised at the first violation: the run stops there."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.detail)
        self.violation = violation


class Oracle:
    """Watches one run (see the module)."""

    def __init__(self, clock: Clock, broker: Broker) -> None:
        self.clock = clock
        self.broker = broker
        self.nodes: dict[str, SimNode] = {}
        self.broken: dict[str, bool] = {}
        """node -> its record does not stand on the broker as it wrote it (ground truth)."""
        self.lost: set[str] = set()
        """Nodes whose record was `broken` at some time since their daemon started."""
        self.rivals: dict[str, set[int]] = {}
        """node -> the slots on which another node's claim or member record stood on the
        broker since its daemon started."""
        self.dead: dict[str, float] = {}
        """node -> when it crashed or left (nodes that lived and are not running now)."""
        self.gone_from: dict[str, set[str]] = {}
        """live node -> the dead nodes its hosts file stopped listing once a round trip
        through the broker came back after their end (`ShardView.proven`)."""
        self.taint: dict[str, Version] = {}
        """node -> the version of a hostile record on its topic that it never wrote past."""
        self.ended: dict[str, int] = {}
        """dead node -> the broker's `seq` at its end (a will that ends its record, its
        clear, or a broker that lost its record): a peer that has seen that far and lists
        it no more has taken its end in."""
        self.last_seq: dict[Topic, int] = {}
        """topic -> the broker's `seq` of the last record accepted on it."""
        self.left_unpublished: set[str] = set()
        """Nodes that left before they published in their run (what a diagnosis reads)."""
        self.overwritten: set[str] = set()
        """Nodes on whose topics the hostile writer wrote while their daemon ran."""
        self.restored: dict[str, MemberRecord] = {}
        """node -> its own record as the last persisting broker restart gave it back."""
        self.hostile_on: set[str] = set()
        """Running nodes on whose topics the hostile writer wrote during this run."""
        self.masked: set[str] = set()
        """Nodes a record or will of whose was accepted below a hostile version on their
        topics (the peers that took the forgery in ignore it)."""
        self.forged: set[MemberRecord] = set()
        """Every member record the hostile writer wrote: a peer that holds one holds a
        forgery, whatever came after it on the broker."""
        self.vacated: set[str] = set()
        """Nodes whose slot a hostile record left while their member record or claim stood
        (a claim or standby elsewhere, a will): kept across their restarts, which may
        resume it."""
        self.will_hidden: set[str] = set()
        """Nodes whose will, ending the member record that stands, the hostile writer wrote
        over with a presence that does not end it (a replay of an older presence)."""
        self.written_first: set[str] = set()
        """Nodes on whose topics the hostile writer wrote before their agent, in its current
        (or next) run, published anything."""
        self.spun: Violation | None = None
        """The first spin of a membership loop (`on_spin`)."""
        self.emptied: float | None = None
        """When the broker last restarted without its retained records."""
        self.started_at: dict[str, float] = {}
        """node -> when its daemon last started (what a diagnosis reads)."""
        self._before_wills: tuple[dict[str, bool], set[str]] = ({}, set())
        """`broken` and `lost` as a broker began to publish its wills while shutting down."""

    def _fail(self, rule: str, detail: str, *nodes: str) -> None:
        raise Broken(Violation(rule, self.clock.now, detail, tuple(sorted(set(nodes)))))

    # -- the broker -------------------------------------------------------------------

    def on_accept(self, topic: Topic, record: Payload | None, author: Author) -> None:
        kind, name = topic
        self.last_seq[topic] = self.broker.seq
        if author == "hostile":
            self._hostile(name, record)
        else:
            self._versioned(name, _version(record) if record is not None else None, record)
        if kind == "presence":
            will = record if isinstance(record, Presence) and record.lost else None
            if will is not None and self._ends(name, will):
                self._end(name)
                if author == "will":
                    self._break(name)
            return
        if record is None:
            self._end(name)
        elif author == "agent":
            self.broken[name] = False
        if isinstance(record, MemberRecord) and record.state in _CONTENDING:
            for node, slots in self.rivals.items():
                if node != name and record.slot is not None:
                    slots.add(record.slot)

    def _hostile(self, name: str, record: Payload | None) -> None:
        """The hostile writer wrote `record` on a topic of `name`."""
        target = self.nodes.get(name)
        if target is not None and target.daemon.running:
            self.overwritten.add(name)
        if target is not None and target.alive:
            self.hostile_on.add(name)
        if target is not None and (not target.alive or target.first_state is None):
            self.written_first.add(name)
        if isinstance(record, MemberRecord):
            self.forged.add(record)
        if self._leaves_slot(name, record):
            self.vacated.add(name)
        standing = self.broker.member_record(name)
        if (
            isinstance(record, Presence)
            and standing is not None
            and self.broker.ended.get(name) == standing
            and not ended(standing, record)
        ):
            self.will_hidden.add(name)
        new = None if record is None else _version(record)
        held = self.taint.get(name)
        if new is not None and (held is None or new > held):
            self.taint[name] = new

    def _leaves_slot(self, name: str, record: Payload | None) -> bool:
        """Whether the hostile `record` on a topic of `name` leaves the slot of the member
        record it found standing there (the broker keeps `record` already)."""
        before = self.broker.member_record(name)
        if isinstance(record, MemberRecord):  # the member record it replaced
            kept = [r for (kind, _), r in self.broker.history.get(name, []) if kind == "member"]
            found = kept[-2] if len(kept) > 1 else None
            before = found if isinstance(found, MemberRecord) else None
        if before is None or before.state not in _CONTENDING:
            return False
        if isinstance(record, MemberRecord):
            return record.slot != before.slot
        return isinstance(record, Presence) and record.lost

    def _versioned(self, name: str, new: Version | None, record: Payload | None) -> None:
        """A record or will of `name` that its agent or its link wrote: past a hostile
        version it ends the taint, below one the peers that took the forgery ignore it."""
        held = self.taint.get(name)
        if held is None or (isinstance(record, Presence) and not record.lost):
            return
        if record is None or (new is not None and new > held):
            del self.taint[name]
        else:
            self.masked.add(name)

    def _ends(self, name: str, will: Presence) -> bool:
        """Whether `will` ends the member record that stands for `name` on the broker."""
        standing = self.broker.member_record(name)
        return standing is not None and ended(standing, will)

    def _end(self, name: str) -> None:
        """`name`'s record ended on the broker now: a dead node's end, for rule 3."""
        if name in self.dead and name not in self.ended:
            self.ended[name] = self.broker.seq

    def _break(self, node: str) -> None:
        """`node`'s record no longer stands as it wrote it: its continuity is lost."""
        self.broken[node] = True
        self.lost.add(node)

    def on_state_lost(self) -> None:
        """The broker restarts without its retained records (called before it drops them)."""
        self.emptied = self.clock.now
        for node in self.nodes:
            self._break(node)
        for node in self.dead:
            self.ended.setdefault(node, self.broker.seq)

    def on_shutdown(self) -> None:
        """The broker shuts down: what continuity was as its wills begin to go out."""
        self._before_wills = dict(self.broken), set(self.lost)

    def on_state_kept(self) -> None:
        """The broker restarted with the records it persisted: those from before the wills
        it published while shutting down (continuity as it was then), or with them."""
        if not self.broker.persist_wills:
            broken, lost = self._before_wills
            self.broken, self.lost = dict(broken), set(lost)
        for node in self.nodes:
            record = self.broker.member_record(node)
            if self.broker.stands(node) and self.broker.authors.get(("member", node)) == "agent":
                assert record is not None
                self.restored[node] = record

    # -- the nodes --------------------------------------------------------------------

    def on_start(self, node: SimNode) -> None:
        self.dead.pop(node.name, None)
        self.ended.pop(node.name, None)
        self.left_unpublished.discard(node.name)
        self.gone_from[node.name] = set()
        for gone in self.gone_from.values():
            gone.discard(node.name)

    def on_gone(self, node: SimNode, *, left: bool = False) -> None:
        self.dead[node.name] = self.clock.now
        if left and not node.shard.published:
            self.left_unpublished.add(node.name)
        if not self.broker.stands(node.name):
            topics = (member(node.name), presence(node.name))
            self.ended[node.name] = max(self.last_seq.get(t, 0) for t in topics)
        self.rivals.pop(node.name, None)
        self.gone_from.pop(node.name, None)
        self.written_first.discard(node.name)
        self.hostile_on.discard(node.name)
        for peer in self.nodes.values():
            if peer.alive:
                self._check_later(node.name, peer)

    def on_spin(self, node: SimNode, due: float | None) -> None:
        """A node's membership loop turns without end at one instant (`node.SPIN_TURNS`):
        kept, and reported at the end unless an invariant breaks first."""
        if self.spun is None:
            synced = "synced" if node.shard.synced else "not synced"
            self.spun = Violation(
                RUNAWAY,
                self.clock.now,
                f"{node.name}'s membership loop spins: {node.turns} turns at one instant, "
                f"a timer due at {due:.3f} and its view {synced}"
                if due is not None
                else f"{node.name}'s membership loop spins with no timer due",
                (node.name,),
            )

    def on_link_down(self, node: SimNode) -> None:
        """The node's link went down while a record it did not write stood on its topic, or
        a will it did not write had ended its record: it cannot have seen its own put back."""
        name = node.name
        if self.broker.authors.get(("member", name)) == "hostile" or not self.broker.stands(name):
            self._break(name)

    def on_synced(self, node: SimNode) -> None:
        for dead in self.dead:
            self._check_later(dead, node)

    def on_daemon_started(self, node: SimNode) -> None:
        """A daemon starts: its continuity and rivals are counted from now (a record that
        does not stand as it wrote it now, say a will that fired while the member record
        was still on its way, is no continuity)."""
        self.started_at[node.name] = self.clock.now
        if not self.broken.get(node.name, False):
            self.lost.discard(node.name)
        self.overwritten.discard(node.name)
        self.rivals[node.name] = {
            r.slot
            for (kind, other), r in self.broker.retained.items()
            if kind == "member"
            and other != node.name
            and isinstance(r, MemberRecord)
            and r.state in _CONTENDING
            and r.slot is not None
        }

    def on_daemon_touched(self, node: SimNode, what: str, slot: int | None) -> None:
        """Rule 1: a running daemon was stopped or restarted while the node lives."""
        lost = node.name in self.lost
        rival = slot is not None and slot in self.rivals.get(node.name, set())
        if lost and rival:
            if self.clock.tracing:
                self.clock.note(f"oracle: {node.name}'s daemon {what}: continuity was lost")
            return
        why = "its record stood on the broker" if not lost else "no rival reached its slot"
        self._fail(
            DAEMON_TOUCHED, f"{node.name}'s daemon on slot {slot} was {what}: {why}", node.name
        )

    def on_applied(self, node: SimNode, before: set[str]) -> None:
        """Rule 3, as each hosts file changes (`before`: whom it listed until now): a dead
        node listed again after a proven deletion, or listed past its deadline."""
        listed = _listed(node)
        running = node.daemon.running
        gone = self.gone_from.setdefault(node.name, set())
        for dead in self.dead:
            if dead in self.taint:
                continue
            if dead not in listed:
                end = self.ended.get(dead)
                proven = end is not None and node.proven_seq >= end
                if running and dead in before and proven:
                    gone.add(dead)  # dropped once a round trip proved its end
            elif dead in gone:
                self._fail(
                    DEAD_RETURNED,
                    f"{dead} (gone since {self.dead[dead]:.3f}) is back in {node.name}'s "
                    "hosts file after a round trip proved its end",
                    dead,
                    node.name,
                )
            elif self.clock.now >= self._deadline(dead, node):
                self._still_listed(dead, node)

    def _deadline(self, dead: str, peer: SimNode) -> float:
        return max(self.dead[dead] + GONE_BOUND_S, peer.synced_at + REJOIN_BOUND_S)

    def _check_later(self, dead: str, peer: SimNode) -> None:
        self.clock.at(self._deadline(dead, peer), self._check, dead, self.dead[dead], peer)

    def _check(self, dead: str, since: float, peer: SimNode) -> None:
        if self.dead.get(dead) != since or not peer.alive or not peer.up or dead in self.taint:
            return
        if self.clock.now < self._deadline(dead, peer):
            return  # the peer synced again meanwhile: checked at its own deadline
        if dead in _listed(peer):
            self._still_listed(dead, peer)

    def _still_listed(self, dead: str, peer: SimNode) -> None:
        self._fail(
            DEAD_RETURNED,
            f"{dead} (gone since {self.dead[dead]:.3f}) is still in {peer.name}'s hosts "
            f"file, whose view synced at {peer.synced_at:.3f}",
            dead,
            peer.name,
        )

    # -- the end ----------------------------------------------------------------------

    def final(self) -> None:
        """Rule 2 after the quiet period (and rule 3 once more), then a spin if one was
        seen."""
        live = sorted(n.name for n in self.nodes.values() if n.alive)
        maps: dict[str, dict[int, tuple[str, str]]] = {}
        for name in live:
            node = self.nodes[name]
            if not node.up:
                self._fail(NO_CONVERGENCE, f"{name} is not connected and synced", name)
            if not node.daemon.running or node.daemon.members is None:
                why = node.shard.facts(node.desired)
                self._fail(
                    NO_CONVERGENCE,
                    f"{name}'s daemon does not run ({why.state} {why.reason} {why.detail})",
                    name,
                )
            assert node.daemon.members is not None
            desired = {slot: (m.node, m.address) for slot, m in node.desired.members.items()}
            if desired != node.daemon.members or node.desired.slot != node.daemon.slot:
                self._fail(NO_CONVERGENCE, f"{name}'s daemon does not run what it desires", name)
            maps[name] = node.daemon.members
        tolerated = {n for n in self.taint if n in self.dead}
        truth = {name: self.nodes[name].address for name in live}
        for name, members in maps.items():
            listed = {node for node, _ in members.values()}
            extra = listed - set(live) - tolerated
            missing = set(live) - listed
            if extra or missing:
                self._fail(
                    NO_CONVERGENCE,
                    f"{name} lists {_show(members)}: missing {sorted(missing)}, "
                    f"dead {sorted(extra)}",
                    name,
                    *missing,
                    *extra,
                )
            wrong = [(s, n, a) for s, (n, a) in members.items() if n in truth and truth[n] != a]
            if wrong:
                self._fail(
                    NO_CONVERGENCE,
                    f"{name} lists wrong addresses {wrong}",
                    name,
                    *(n for _, n, _ in wrong),
                )
            own = self.nodes[name].daemon.slot
            if own is None or members.get(own, ("", ""))[0] != name:
                self._fail(
                    NO_CONVERGENCE, f"{name} runs slot {own} but lists {_show(members)}", name
                )
        first = maps[live[0]] if live else {}
        for name, members in maps.items():
            same = {s: v for s, v in members.items() if v[0] not in tolerated}
            base = {s: v for s, v in first.items() if v[0] not in tolerated}
            if same != base:
                differ = {entry[1][0] for entry in set(same.items()) ^ set(base.items())}
                self._fail(
                    NO_CONVERGENCE,
                    f"hosts files differ: {live[0]} {_show(first)}, {name} {_show(members)}",
                    live[0],
                    name,
                    *differ,
                )
        if self.spun is not None:
            raise Broken(self.spun)


def _listed(node: SimNode) -> set[str]:
    members = node.daemon.members
    return set() if members is None else {n for n, _ in members.values()}


def _show(members: dict[int, tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{slot}: {node}" for slot, (node, _) in sorted(members.items())) + "}"


def _version(record: Payload) -> Version | None:
    """Where a record or will stands among what its node wrote (`messages.version`); a
    presence that is no will has no place."""
    if isinstance(record, Presence):
        return (record.incarnation, record.link, LINK_END) if record.lost else None
    return version(record)
