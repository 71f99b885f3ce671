"""The shard view's state, and the lifecycle of this node's own member record.

`OwnRecord` is the base of `ShardView` (imexd.membership.shard): the state the whole view
shares (the shard, the spec, our claim and incarnation, the link), with the composed
parts it owns (`Peers`, the book of the shard's records; `Namesakes`, another live agent
of our name; `FirstStart`, the hold of the first daemon start), and how our own record
lives on the broker: published (`sending`, `sent`), echoed back (the barrier of a claim),
written over by someone else and put back, outbid by a record of our name that we did
not write, published again on a new link (`_rejoin`) or given up to a rival that took our
slot meanwhile (`_claim_again`). Its state is read and written by every step, so it is a
base class rather than a part.
"""

from __future__ import annotations

from typing import Final

import msgspec
import structlog

from imexd.bus.events import EchoLost, Refused, WillSpec
from imexd.membership.claim import ClaimState, Decision, Echo, Phase
from imexd.membership.namesake import Identity, Namesakes
from imexd.membership.peers import Peers
from imexd.membership.plan import FirstStart
from imexd.messages import (
    DomainSpec,
    HealthReport,
    MemberRecord,
    MemberState,
    Mode,
    Presence,
    Version,
    encode,
)
from imexd.topics import TopicRef, Topics

OVERWRITE_PACE_S: Final = 5.0
"""While another live agent runs with our name (DuplicateNode, our slot kept), our record
is put back at most once per this many seconds, so that the two do not re-publish over
each other at link speed."""
RECLAIMS_ON_LOST_ECHO: Final = 3
"""Times a claim whose echo did not come back in time (`Refused`) is published again on
one link that may lose echoes (`Refused.repaired`): a broker that loses echoes may
keep the claim and never deliver its echo to the claimant, which would wait for it until
the link ends; a broker that refuses the publication for good (an ACL) is not asked
forever."""


class OwnRecord:
    """The view's shared state, and the lifecycle of our own member record in the shard."""

    def __init__(
        self,
        *,
        node: str,
        address: str,
        max_nodes: int,
        mode: Mode,
        settle_s: float,
        claim_stale_s: float,
        confirm_grace_s: float,
        takeover_watch_s: float = 0.0,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.node = node
        self.address = address
        self.max_nodes = max_nodes
        self.mode: Mode = mode
        self.settle_s = settle_s
        self.claim_stale_s = claim_stale_s
        self.confirm_grace_s = confirm_grace_s
        self.takeover_watch_s = takeover_watch_s
        self.log = log
        self.peers = Peers(
            node=node,
            max_nodes=max_nodes,
            claim_stale_s=claim_stale_s,
            confirm_grace_s=confirm_grace_s,
            log=log,
        )
        """The shard's member records (ours among them), and what we know of each."""
        self.names = Namesakes(node=node, takeover_watch_s=takeover_watch_s, log=log)
        """Another live agent that runs with our name, if any."""
        self.identity: Identity | None = None
        """A change of who we are on the bus that a step found (`derive`), for the agent
        to make and clear (`NodeCore`); a bus event's comes back from `apply`."""
        self.first = self._first_start()
        """The first daemon start in this shard, held while the shard forms."""
        self.incarnation = 0
        self.started_as = 0
        """The incarnation this run started with (the state dir's): every record of a past
        run of ours is below it, whatever ours is raised to since (`_foreign`)."""
        self.current: tuple[str, str] | None = None
        self.spec: DomainSpec | None = None
        self.claim = ClaimState(node=node, incarnation=0)
        self.decision: Decision | None = None
        self.wake_at: float | None = None
        self.synced = False
        self.trusted = False
        """The broker of this link gave our own record back, flagged retained, to a new
        wildcard subscription (`BrokerChecked`): only then does our claim's echo settle
        it, since a snapshot without the peers' records would let two nodes win a slot."""
        self.sync_after = 0.0
        self.needs: frozenset[str] = frozenset()
        """The bus filters a `Synced` must cover to sync the view (`join`)."""
        self.link = 0
        """The number of our current link (`Connected.link`), which our records carry."""
        self.mismatch: tuple[str, ...] = ()
        self.mismatch_detail = ""
        self.published = False
        """We published a record of this incarnation in the current shard (ours to clear)."""
        self.past_stands = False
        """A record of ours that a past run wrote stands on the broker in this shard (no
        clear removed it since; a will ends it, but it stays): ours to clear when we leave,
        whether we published or not."""
        self.past: MemberRecord | None = None
        """The last record of our name in this shard that a past run of ours wrote (lower
        incarnation, our address): what we resume from, even if another record of our
        name came after it."""
        self.replaying = False
        """Our member record was published again on a new link whose snapshot did not
        hold it: its echo is checked for a rival on our slot (`_on_own_echo`)."""
        self.replay_rival: MemberRecord | None = None
        """The rival on our slot at the echo of that re-publication: claim again."""
        self.own_end: Version | None = None
        """The latest end of a run or link of ours that our presence showed in a snapshot
        (a will that fired while we were away, a past run's stop): a record of ours it ends
        is not resumed. Node-wide, so not reset by `join`."""
        self.last_run = 0
        """The latest past run (incarnation) whose presence a snapshot showed on our
        presence topic: a record of an earlier run is not resumed, as that run's presence
        may have said how it ended (a will) before the later one wrote over it. Node-wide."""
        self.overwrite_open = False
        """A record written over ours stands on the broker: ours is not back yet (its
        echo has not come). RecordOverwritten, or DuplicateNode while `contested`."""
        self.overwritten_total = 0
        """Records written over ours since the agent started (a metric)."""
        self.overwritten = ""
        """What the last record written over ours said (RecordOverwritten)."""
        self.reassert_at: float | None = None
        """`now` at which our record is published again over another (None: none due)."""
        self.last_reassert = float("-inf")
        self.outbid = False
        """A record or will of our name that we did not write stands where ours would not
        come after it: the next plan raises our incarnation above `outbid_over` and says
        so (save it, and a will that says it)."""
        self.outbid_over = 0
        """The highest incarnation of such a record or will."""
        self.outbidding: MemberRecord | None = None
        """The record of our name we outbid last while ours stood without a break: ours
        goes back over it only on the next link (whose will ends the raised incarnation),
        so that link's snapshot showing it breaks no continuity (`_rejoin`)."""
        self.in_flight: list[bytes] = []
        """Our records published on this link (since it synced) whose live echo has not
        come back yet, oldest first (b"": a clear)."""
        self.last_sent: MemberRecord | None = None
        """The record we published last (None: none, or a clear)."""
        self.seq = 0
        """The place (`MemberRecord.seq`) of the last record of this run we published, or
        of a record of this run written over ours: the next new record gets the next."""
        self.echo: Echo | None = None
        """The barrier of our claim: taken at the live echo of `last_sent`."""
        self.continuous = False
        """Our member record has stood on the broker without a break, as far as this
        agent knows: set when our claim settles at its echo or a resumed record of ours
        is kept, cleared by a new link (`Connected`), set again when that link's
        snapshot gives our record back exactly as we last published it (`_rejoin`), or
        our record published again on it came back with no rival on our slot. While it holds
        (on a link that keeps the broker's order: `incumbent`), no other node's record
        moves us (`mb.step(incumbent=...)`, `own_change`)."""
        self.ordered = True
        """The link keeps the broker's order (not a repaired link, `Connected.repaired`,
        and no echo lost on it), which incumbency assumes: on a link that may lose
        updates (a repaired link: `Refused.repaired`) two members may settle one slot
        without a break on either side, and the stamps decide."""
        self.republish = False
        """A new link, or a lost echo: a claim in flight must be published again and wait
        for its echo."""
        self.reclaims = 0
        """Claims published again on this link because their echo was lost."""

    @property
    def member(self) -> bool:
        """Our claim settled: we hold a slot (no step of ours claims one now)."""
        return self.claim.phase is Phase.MEMBER

    @property
    def incumbent(self) -> bool:
        """We hold our slot first: our record stood without a break, on links that keep
        the broker's order (docs/membership.md, *Incumbency*)."""
        return self.continuous and self.ordered

    def _first_start(self) -> FirstStart:
        return FirstStart(
            node=self.node,
            address=self.address,
            max_nodes=self.max_nodes,
            settle_s=self.settle_s,
            log=self.log,
        )

    # -- our records on the bus ----------------------------------------------------

    def will(self, topics: Topics, *, at: float) -> WillSpec:
        """Our Last Will, one for the agent's run: our presence marked lost (the bus sets
        the link it ends and hold_s per link). It ends our member record wherever we are
        (`messages.lost_record`), so joining or leaving a shard never changes it."""
        return WillSpec(topics.presence(self.node), tombstone=self.presence(None, at=at, lost=True))

    def presence(
        self, domain: str | None, *, at: float, stopped: float | None = None, lost: bool = False
    ) -> Presence:
        """Our presence record: an agent runs (or ran) as this node, in `domain`."""
        return Presence(
            node=self.node,
            incarnation=self.incarnation,
            at=at,
            domain=domain,
            address=self.address,
            stopped=stopped,
            lost=lost,
        )

    def sending(self, record: MemberRecord | None) -> None:
        """We publish `record` on our member topic now (None: clear ours).

        Call it before the publish, so that its echo cannot come first. A new record
        voids the barrier of the one before.
        """
        self.in_flight.append(b"" if record is None else encode(record))
        self.last_sent = record
        if record is not None:
            self.seq = max(self.seq, record.seq)
        self.echo = None
        self.republish = False
        self.reassert_at = None

    def sent(self, record: MemberRecord | None) -> None:
        """The publish of `record` (after `sending`) returned: a record of ours stands in
        this shard, to be cleared when we leave it; it goes over what we outbid."""
        self.published = self.published or record is not None
        self.outbidding = None

    def _on_own(self, record: MemberRecord | None, *, live: bool, now: float) -> Identity | None:
        """A record on our own member topic (None: cleared): ours, or written over ours.

        The owner is the only author of its record. Once we published on this link, what
        comes while nothing of ours is in flight was accepted after our last publication:
        if it is not what we published, someone wrote over it, and ours goes back at the
        next step (one round trip). Before that (a new link, or a start) the next step
        judges the snapshot instead: resume, or claim again (`derive`).
        """
        data = b"" if record is None else encode(record)
        mine = b"" if self.last_sent is None else encode(self.last_sent)
        if live and record is not None and data not in self.in_flight and data != mine:
            self.names.foreign_live = True  # another writer is live now (TAKEN_LINKS)
        if live:
            self._on_own_echo(data, now)
        if record is not None and record.state is not MemberState.LOST and self._resumable(record):
            self.past = record
        if record is not None:
            self._outbid(record)
        if self.republish or self.in_flight or self.names.duplicate:
            return None
        if not self.published or data == mine:
            return None
        return self._overwritten(record, now)

    def _on_own_echo(self, data: bytes, now: float) -> None:
        """A live copy of our own record came back: the barrier of our claim, if it is the
        echo of the last thing we published.

        The broker forwards our publications back in the order we sent them; an echo of
        an older publication with the same bytes (a slot claimed, left and claimed again)
        is not our claim's echo: what stood on the slot in between may differ.
        """
        if data not in self.in_flight:
            return  # of a previous link, or a replay before this link synced
        del self.in_flight[: self.in_flight.index(data) + 1]
        if not self.in_flight:
            self.overwrite_open = False  # ours stands again
        record = self.last_sent
        if self.in_flight or record is None or record.slot is None:
            return
        if self.replaying and record.state is MemberState.MEMBER:
            # Our member record published again on a new link: a rival accepted before it
            # settled the slot while our record was gone; it stays, we claim again.
            self.replaying = False
            self.replay_rival = self.peers.rival(record.slot, self.spec, now)
            self.continuous = self.replay_rival is None
            return
        if record.state is not MemberState.CLAIMING:
            return
        self.echo = self.peers.barrier(record.slot, self.spec, now)

    def _outbid(self, record: MemberRecord) -> None:
        """A record or will of our name that we did not write stands where ours would not
        come after it (`messages.version`): raise our incarnation over it, so that what we
        publish next is newer everywhere (`Plan.outbid`: saved, and a will that says it)."""
        lost = record.state is MemberState.LOST
        if record.incarnation < self.incarnation or (not lost and not self._foreign(record)):
            return
        if record.incarnation == self.incarnation:
            self.seq = max(self.seq, record.seq)
            if record.link < self.link or (record.link == self.link and not lost):
                return  # what we publish next on this link comes after it
        if encode(record) == (b"" if self.last_sent is None else encode(self.last_sent)):
            return
        if not lost and self.continuous:
            self.outbidding = record  # written over ours while it stood: ours goes back
        self._raise_incarnation(record.incarnation, "a record of this node name")

    def _raise_incarnation(self, over: int, what: str) -> None:
        """Raise our incarnation above `over` at the next plan, so that what we publish
        next is newer everywhere (`Plan.outbid`: saved, and a will that says it). Not
        before: until the agent saved it, our presence and will say the incarnation it
        saved, which its next run starts above."""
        self.outbid_over = max(self.outbid_over, over)
        self.outbid = True
        self.log.info(
            "membership.incarnation_raised",
            incarnation=max(self.incarnation, over + 1),
            over=over,
            why=f"{what} that this agent did not write",
        )

    def _take_outbid(self) -> bool:
        """Whether this plan raises our incarnation (`_raise_incarnation`): it does now."""
        if not self.outbid:
            return False
        self.outbid = False
        self.incarnation = max(self.incarnation, self.outbid_over + 1)
        self.claim = msgspec.structs.replace(self.claim, incarnation=self.incarnation)
        return True

    def _overwritten(self, record: MemberRecord | None, now: float) -> Identity | None:
        """Someone wrote over our record: put ours back at once (paced only while another
        live agent runs with our name), count it, and say so."""
        what = (
            "cleared it"
            if record is None
            else f"wrote {record.state.value} slot {record.slot} at {record.address} "
            f"(incarnation {record.incarnation})"
        )
        if record is not None and record.incarnation == self.incarnation:
            # A copy of this run placed later than ours: ours, put back, goes after it.
            self.seq = max(self.seq, record.seq)
        self.overwrite_open = True
        self.overwritten_total += 1
        self.overwritten = what
        self.log.warning(
            "membership.record_overwritten",
            what=what,
            times=self.overwritten_total,
            why="a record on this node's member topic that this agent did not write; "
            "putting this node's record back",
        )
        due = now
        if self.names.contested:
            due = max(now, self.last_reassert + OVERWRITE_PACE_S)
        self.reassert_at = due if self.reassert_at is None else min(self.reassert_at, due)
        return None

    def _on_refused(self, event: Refused | EchoLost, now: float) -> None:
        """Our claim's echo did not come back in time on a link that may lose it: publish
        the claim again and settle on that publication's echo only (the lost one's, should
        it come late, no longer counts: like a claim carried over to a new link). On a
        link that loses nothing (one that keeps the broker's order) a late echo means an
        overloaded agent, which a second claim would only load more (1024 agents on 2 cores).

        Another record of ours that the broker kept but whose echo was lost is no longer
        in flight: it stands, and what comes on our topic from now on is judged by it."""
        ref, record = event.ref, self.last_sent
        if (
            ref is None
            or ref.kind != "member"
            or ref.node != self.node
            or (ref.domain, ref.clique) != self.current
            or record is None
        ):
            return
        if isinstance(event, EchoLost) and record.state is not MemberState.CLAIMING:
            data = encode(record)
            if data in self.in_flight:
                self._on_own_echo(data, now)  # kept by the broker: as good as its echo
            return
        if (
            not event.repaired
            or record.state is not MemberState.CLAIMING
            or self.echo is not None
            or self.reclaims >= RECLAIMS_ON_LOST_ECHO
        ):
            return
        self.reclaims += 1
        self.in_flight.clear()
        self.republish = True

    def _rejoin(self, own: MemberRecord | None, now: float) -> MemberRecord | None:
        """A new link, and we hold a slot: publish our member record again only where the
        snapshot still holds it, or holds nothing competing on its slot; else claim again
        (the rival returned).

        Our will may have fired while the link was down, and another node settled our
        slot since: replaying our record (with its earlier stamp) would evict it.
        """
        slot = self.claim.slot
        assert slot is not None  # noqa: S101 - a member holds a slot
        if (
            own is not None
            and self.node not in self.peers.unconfirmed
            and own in (self.last_sent, self.outbidding)
        ):
            self.continuous = True
            return None
        rival = self.peers.rival(slot, self.spec, now)
        self.replaying = rival is None  # its echo shows whether a rival came first
        return rival

    def _claim_again(self, rival: MemberRecord, why: str) -> None:
        """Give our slot up to `rival` and claim afresh: our daemon restarts on the slot
        the claim settles (a new node id; the rival's daemon, and its jobs, keep theirs)."""
        self.log.warning(
            "membership.reclaim_after_reconnect",
            slot=self.claim.slot,
            rival=rival.node,
            rival_state=rival.state.value,
            why=f"{rival.state.value} {rival.node}: {why}",
        )
        self.peers.records.pop(self.node, None)
        self.peers.unconfirmed.discard(self.node)
        self.past = None
        self.replay_rival = None
        self.replaying = False
        self.claim = ClaimState(node=self.node, incarnation=self.incarnation)
        self.decision = None

    def stale_own(self, ref: TopicRef, record: MemberRecord | HealthReport) -> bool:
        """Whether `record`, on `ref`, is a record of this node that its author (a past run
        of ours, or this one) deleted when it left that shard: ours (a member record, its
        will's tombstone, a health report), but not where we are now (the shard for a
        member record, the domain for a report). A broker restored from an older disk
        serves such records; we clear them."""
        current = self.current or (None, None)
        if isinstance(record, MemberRecord):
            elsewhere = (ref.domain, ref.clique) != current
        else:
            elsewhere = ref.domain != current[0]
        return (
            ref.node == self.node
            and elsewhere
            and record.incarnation <= self.incarnation
            and record.address == self.address
        )

    def _foreign(self, own: MemberRecord) -> bool:
        """Whether a record of our name may come from another agent, not our past run: a
        past run's is below the incarnation this run started with, at our address (one
        that we outbid since stays foreign)."""
        return own.incarnation >= self.started_as or own.address != self.address

    def _resumable(self, own: MemberRecord) -> bool:
        """Whether a record of our name is a past run's that we may resume: ours (not
        `_foreign`), not ended by a will or stop that our presence showed (`own_end`), and
        of the last run whose presence we found or later (`last_run`: a later run that
        resumed nothing wrote over the presence that may have said it ended)."""
        return (
            not self._foreign(own)
            and not self.peers.ended_by_will(own, self.own_end)
            and own.incarnation >= self.last_run
        )

    # -- another agent with our name ------------------------------------------------

    def _on_taken_over(self) -> Identity | None:
        """The broker handed our session to another client (`Namesakes.taken_over`)."""
        member = self.claim.phase is Phase.MEMBER
        return self._aside(self.names.taken_over(in_shard=self.current is not None, member=member))

    def _on_link_ended(self) -> Identity | None:
        """The broker ended our link without a reason code (`Namesakes.link_ended`)."""
        member = self.claim.phase is Phase.MEMBER
        return self._aside(self.names.link_ended(published=self.published, member=member))

    def _aside(self, identity: Identity | None) -> Identity | None:
        """Stand aside for another live agent of our name: the topic is its own, so we
        never clear it, and nothing of ours is due on it."""
        if identity is Identity.ASIDE:
            self.reassert_at = None
            self.published = False
        return identity
