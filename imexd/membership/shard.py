"""The agent's view of its (domain, clique) shard: what the bus says, and what to do.

`ShardView` turns the bus events of one shard (member records, the domain's spec, the link
coming and going) into what this node must do next: its record, its claim, and what should
run (`Desired`). Events go in through `apply(event, now)`, a `Plan` comes out of
`derive(now, ...)`, and `commit(plan)` keeps it once the agent has published; the agent
(imexd.agent.run) only does the I/O, so this is testable without a broker, daemon or clock.
Two rules to know: a settled member's daemon stops or restarts only for the node's own
reasons, never for another node's record while our link was continuous (`own_change`);
and a claim settles only at the live echo of the last record we published
(`imexd.membership.slots`). The other guards (broker restarts, wills, stale claims, a
second agent with our name, records written over ours) and why each exists:
docs/membership.md#what-the-shard-guards-against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Final

import msgspec
import structlog

from imexd.bus.events import (
    BrokerChecked,
    Connected,
    ConnectFailed,
    Disconnected,
    EchoLost,
    Event,
    Refused,
    SubscribeRefused,
    Synced,
    WillSpec,
)
from imexd.facts import Contest, Member, MembershipFacts, MembershipState
from imexd.membership import slots as mb
from imexd.membership.desired import Desired
from imexd.messages import (
    LINK_END,
    MAX_HOLD_S,
    Deleted,
    DomainSpec,
    HealthReport,
    MemberRecord,
    MemberState,
    Mode,
    Presence,
    Received,
    Version,
    encode,
    ended,
    lost_record,
    presence_end,
    version,
)
from imexd.nodestate import NodeState
from imexd.settings import Settings
from imexd.topics import TopicRef, Topics

CONFIRM_MARGIN_S: Final = 2.0
"""Added to [bus] reconnect_max_s: a peer's connect and replay after its last backoff."""
TAKEN_LINKS: Final = 2
"""Links in a row that the broker ended without a reason code, each after a live record of
our name that we did not write came on it: another live agent takes our session (on
links whose broker says so, one reason code is evidence enough)."""
TAKEOVER_WATCH_DELAYS: Final = 6
"""First reconnect delays (`[bus] reconnect_initial_s`) that a new agent waits, before it
writes over a record of its name that it did not write, for another live agent of that
name to take the session back: such an agent lost its session to us and reconnects after
its first backoff. Two links of ours ended within the wait show it (TAKEN_LINKS); a
record alone is replaced once the wait is over."""
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
FIRST_START_WINDOWS: Final = 5
"""The first daemon start in a shard waits at most this many `[domain] settle_s` (1 s by
default) for claims in flight and listed nodes that are not members yet. A claim settles
within a round trip and the nodes of one job are assigned at once, so formation is done
well within it; a node that is stuck or absent delays the others' start by this much,
and joins later by SIGUSR1 like any newcomer."""


DOMAIN_DELETED: Final = "DomainDeleted"
"""The cause of a plan that leaves a domain the control plane deletes (`own_change`)."""
OWN_CAUSES: Final = frozenset({DOMAIN_DELETED, mb.Reason.NOT_IN_SPEC, mb.Reason.RELEASED})
"""The causes of a plan that are the node's own reasons to stop or restart its daemon,
among those `ShardView.derive` sees (`own_change`)."""


def own_change(running: Desired, desired: Desired, cause: str, *, incumbent: bool) -> bool:
    """Whether `desired` may replace `running` (what the daemon runs now): the one rule.

    The daemon of a settled member is stopped or restarted only for the node's own
    reasons: a leave (SIGTERM), a domain delete, a spec that drops the node, an
    unassignment, a daemon failure (its slot released), an operator command; never
    because of another node's record while this node's link has been continuous.
    `cause` is why the plan changed (a `membership.Reason`, or DOMAIN_DELETED);
    `incumbent`: our member record stood on the broker without a break, on links that
    keep the broker's order, so our link has been continuous (`ShardView.incumbent`).

    Why this is the whole rule: a leave, an unassignment and an operator's command to
    move the node end the shard itself (the agent leaves it before any plan of the new
    one), and the remaining own reasons reach the shard's judgement as a spec (deleting,
    or a list without us) or as the release of a failed daemon: OWN_CAUSES. Anything
    else that moves us off a slot is another node's record (a rival member, a claim
    that beat ours), and `membership.step` gives such a record no power over a member
    whose record stood without a break (its incumbency). Where our record did not
    stand (a reconnect whose snapshot lost it: a broker that lost its state, a will
    that fired), or the link does not keep the broker's order (a clustered broker may
    let two members settle one slot), we cannot know we were first, and the settle
    stamps decide.
    A change that keeps the same slot of the same shard running touches nothing: new
    members are a SIGUSR1, never a restart.
    """
    if not running.run or running.domain is None or running.slot is None:
        return True
    if desired.run and (desired.domain, desired.clique, desired.slot) == (
        running.domain,
        running.clique,
        running.slot,
    ):
        return True
    return cause in OWN_CAUSES or not incumbent


class Identity(StrEnum):
    """A change of who the agent is on the bus, for the agent to make (will, client id)."""

    ASIDE = "aside"
    """Another live agent runs as this node: drop the will, take another client id."""
    BACK = "back"
    """The other agent's record is gone: our own client id and will again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What the agent must do after one `derive`: publish, then `commit`, then run."""

    desired: Desired | None = None
    """What should run now; None: keep what runs (no shard, or no synced snapshot)."""
    leave: bool = False
    """The domain is being deleted while we are in it: clear our records, then `left()`."""
    decision: mb.Decision | None = None
    """The claim step: publish its record when `publish`, then `commit` the plan."""
    publish: bool = False
    wake_at: float | None = None
    """`derive` again at this time even if nothing changes (a first start held)."""
    outbid: bool = False
    """Our incarnation was raised over a record of ours we never saved: save it."""
    mismatch: tuple[str, ...] = ()
    mismatch_detail: str = ""
    hold: bool = False
    """Keep what runs and publish nothing (`desired` is None): another agent may run as
    this node, or a plan broke `own_change`."""


class ShardView:
    """The records, spec, claim and decision of this node's current shard."""

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
        """How long a new agent watches a record of its name that it did not write before
        it replaces it (TAKEOVER_WATCH_DELAYS)."""
        self.watch_until: float | None = None
        """While set: we watch such a record, publishing nothing (`_watch`)."""
        """How long a record missing from a new link's snapshot is kept: after a broker
        restart every live peer reconnects within its capped reconnect backoff and
        re-publishes its record; a record still missing after that is gone."""
        self.log = log
        self.incarnation = 0
        self.current: tuple[str, str] | None = None
        self.records: dict[str, MemberRecord] = {}
        self.spec: DomainSpec | None = None
        self.claim = mb.ClaimState(node=node, incarnation=0)
        self.decision: mb.Decision | None = None
        self.wake_at: float | None = None
        self.synced = False
        self.trusted = False
        """The broker of this link gave our own record back, flagged retained, to a new
        wildcard subscription (`BrokerChecked`): only then does our claim's echo settle
        it, since a snapshot without the peers' records would let two nodes win a slot."""
        self.sync_after = 0.0
        self.needs: frozenset[str] = frozenset()
        """The bus filters a `Synced` must cover to sync the view (`join`)."""
        self.unconfirmed: set[str] = set()
        """Nodes whose records come from a previous link and were not seen again yet: always
        a subset of `records` (whatever drops a record drops it here too)."""
        self.confirm_by: float | None = None
        """`now` after which the unconfirmed records are dropped."""
        self.versions: dict[str, Version] = {}
        """Peer or us -> the newest version (`messages.version`) of a record or Last Will
        taken in for it: anything not newer is not applied (`_on_received`)."""
        self.unproven: dict[str, tuple[MemberRecord, int]] = {}
        """Peers' records dropped on this link (a clear, a will) that no round trip through
        the broker has come back after yet, with the deletion's mark (`proof_mark`). A
        link that ends first may have ended with a broker that shut down (it publishes
        every will, then closes the links): they come back, unconfirmed (`Disconnected`)."""
        self.deletions = 0
        """Deletions taken in so far: the mark of the last one."""
        self.lost: dict[str, float] = {}
        """Peers whose tombstone (state lost) came: `now` at which their previous record,
        kept in `records` meanwhile, is dropped."""
        self.link = 0
        """The number of our current link (`Connected.link`), which our records carry."""
        self.mismatch: tuple[str, ...] = ()
        self.mismatch_detail = ""
        self.published = False
        """We published a record of this incarnation in the current shard (ours to clear)."""
        self.past: MemberRecord | None = None
        """The last record of our name in this shard that a past run of ours wrote (lower
        incarnation, our address): what we resume from, even if another record of our
        name came after it."""
        self.replaying = False
        """Our member record was published again on a new link whose snapshot did not
        hold it: its echo is checked for a rival on our slot (`_on_own_echo`)."""
        self.replay_rival: MemberRecord | None = None
        """The rival on our slot at the echo of that re-publication: claim again."""
        self.snapshot_records: set[str] = set()
        """Nodes whose record we hold came from a snapshot (retained), not live (`found`)."""
        self.own_end: Version | None = None
        """The latest end of a run or link of ours that our presence showed in a snapshot
        (a will that fired while we were away, a past run's stop): a record of ours it ends
        is not resumed. Node-wide, so not reset by `join`."""
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
        self.contested = ""
        """Why another live agent is taken to run with our name while we hold our slot
        (overwrites recur, or the broker took our session): DuplicateNode, reported
        while it lasts; we keep the slot and the daemon."""
        self.claims_seen: dict[str, tuple[tuple[int, int | None], float]] = {}
        """Peers' claiming records: (incarnation, slot) and `now` first seen, so that
        claims which never settle stop counting after claim_stale_s."""
        self.duplicate = ""
        """Set (the why) when another live agent runs as this node: we publish nothing."""
        self.foreign_live = False
        """A live record of our name that we did not write came on this link."""
        self.taken = 0
        """Links in a row ended without a reason code after `foreign_live` (TAKEN_LINKS)."""
        self.outbid = False
        """Our incarnation was raised over a record of our name that we did not write: the
        next plan says so (save it, and a will that says it)."""
        self.in_flight: list[bytes] = []
        """Our records published on this link (since it synced) whose live echo has not
        come back yet, oldest first (b"": a clear)."""
        self.last_sent: MemberRecord | None = None
        """The record we published last (None: none, or a clear)."""
        self.seq = 0
        """The place (`MemberRecord.seq`) of the last record of this run we published, or
        of a record of this run written over ours: the next new record gets the next."""
        self.echo: mb.Echo | None = None
        """The barrier of our claim: taken at the live echo of `last_sent`."""
        self.continuous = False
        """Our member record has stood on the broker without a break, as far as this
        agent knows: set when our claim settles at its echo or a resumed record of ours
        is kept, cleared by a new link (`Connected`), set again when that link's
        snapshot gives our record back exactly as we last published it (`_rejoin`), or
        our record published again on it came back with no rival on our slot. While it holds
        (on a link that keeps the broker's order: `incumbent`), no other node's record
        moves us (`mb.step(incumbent=...)`, `own_change`)."""
        self.incumbents: dict[int, str] = {}
        """slot -> the node whose member record has stood there first in this view,
        kept across a reconnect while that record comes back unchanged, forgotten when
        it leaves or changes slot or is dropped (`mb.resolve(incumbents=...)`)."""
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
        self.started = False
        """The daemon was asked to run in this shard: its first start is behind us."""
        self.hold_until: float | None = None
        """`now` until which the first start waits for the shard to form."""
        self.held = ""
        """Why the first start waits (empty: it does not)."""

    @property
    def member(self) -> bool:
        """Our claim settled: we hold a slot (no step of ours claims one now)."""
        return self.claim.phase is mb.Phase.MEMBER

    @property
    def incumbent(self) -> bool:
        """We hold our slot first: our record stood without a break, on links that keep
        the broker's order (docs/membership.md, *Incumbency*)."""
        return self.continuous and self.ordered

    @classmethod
    def from_settings(
        cls, settings: Settings, log: structlog.typing.FilteringBoundLogger
    ) -> ShardView:
        """The view of the agent configured by `settings`."""
        return cls(
            node=settings.node.name,
            address=settings.node.address,
            max_nodes=settings.domain.max_nodes,
            mode=settings.domain.mode,
            settle_s=settings.domain.settle_s,
            claim_stale_s=settings.domain.claim_stale_s,
            confirm_grace_s=settings.bus.reconnect_max_s + CONFIRM_MARGIN_S,
            takeover_watch_s=TAKEOVER_WATCH_DELAYS * settings.bus.reconnect_initial_s
            + CONFIRM_MARGIN_S,
            log=log,
        )

    def start(self, incarnation: int) -> None:
        """This agent run's incarnation (loaded from the state dir)."""
        self.incarnation = incarnation
        self.claim = mb.ClaimState(node=self.node, incarnation=incarnation)
        self.seq = 0

    # -- shards ---------------------------------------------------------------------

    def join(
        self, target: tuple[str, str] | None, now: float, *, needs: frozenset[str] = frozenset()
    ) -> bool:
        """Forget the old shard and follow `target`; True when we stood aside in it.

        `needs`: the bus filters whose snapshot the view is made of (the shard's members
        filter and the domain's spec); only a `Synced` covering all of them syncs it, so
        that the round trip of an earlier subscription cannot pass for theirs.
        """
        was_duplicate = bool(self.duplicate)
        self.current = target
        self.needs = needs
        self.published = False
        self.past = None
        self.continuous = self.replaying = False
        self.replay_rival = None
        self.reassert_at = None
        self.claims_seen.clear()
        self.duplicate = ""
        self.watch_until = None
        self.records.clear()
        self.snapshot_records.clear()
        self.unconfirmed.clear()
        self.confirm_by = None
        self.versions.clear()
        self.unproven.clear()
        self.lost.clear()
        self.spec = None
        # No shard: no snapshot to wait for (a leave keeps the link, so no Synced follows).
        self.synced = target is None
        self.claim = mb.ClaimState(node=self.node, incarnation=self.incarnation)
        self.decision = None
        self.wake_at = None
        self.in_flight.clear()
        self.overwrite_open = False
        self.last_sent = None
        self.echo = None
        self.incumbents.clear()
        self.republish = False
        self.started = False
        self.hold_until = None
        self.held = ""
        if target is not None:
            # Only a snapshot completed after this point covers the new subscriptions.
            self.sync_after = now
        return was_duplicate

    def leaving(self) -> bool:
        """We leave the current shard: nothing more is reported for it. True when we
        published in it, so that our records there must be cleared."""
        self.current = None
        return self.published

    def due_at(self, now: float) -> float | None:
        """When the next step is due without any event (None: no step is): a timer of the
        last plan, the end of the wait for a new link to confirm the old records, or a
        peer's claim turning stale (`claim_stale_s` unchanged). Time changes nothing else
        here, so between these an agent waits for events alone. While the view is not
        synced no timer can act (`derive` waits for the snapshot, whose Synced is an
        event), so none is due: a past one would otherwise be due again at every turn."""
        if self.current is None or not self.synced:
            return None
        due = [at for at in (self.wake_at, self.confirm_by) if at is not None]
        due += [
            at + self.claim_stale_s
            for _, at in self.claims_seen.values()
            if at + self.claim_stale_s > now
        ]
        return min(due) if due else None

    # -- bus events -----------------------------------------------------------------

    def apply(self, event: Event, now: float) -> Identity | None:
        """Take one bus event in; say when the agent must change its identity."""
        if isinstance(event, Connected):
            # Keep the records of the previous link until the new one confirms them: a
            # broker that restarted without its retained state gets them back only as
            # the peers reconnect, and dropping them meanwhile would rewrite the hosts
            # block and send SIGUSR1 twice for a membership that never changed.
            self.unconfirmed = set(self.records)
            self.confirm_by = None
            self.synced = False
            self.link = event.link
            self.foreign_live = False
            # The old link's echoes are gone, and the new one's snapshot comes in no
            # particular order: a claim in flight is published again once the snapshot is
            # in, and settles on that echo only (rivals in the snapshot count as earlier).
            self.in_flight.clear()
            self.overwrite_open = False  # the new link's snapshot is judged afresh
            self.echo = None
            self.republish = True
            self.reclaims = 0
            self.trusted = False
            # Our member record is published on this link once its snapshot is judged
            # (`derive`): our will may have fired, and our slot been taken, meanwhile;
            # continuity holds again only if this snapshot gives our record back.
            self.continuous = self.replaying = False
            self.replay_rival = None
            self.reassert_at = None
            self.ordered = not event.repaired
        elif isinstance(event, Disconnected):
            self.synced = False
            self._restore_unproven()
            if event.taken_over:
                return self._on_taken_over()
            if not event.deliberate and event.reason_code is None:
                return self._on_link_ended()
        elif isinstance(event, Refused | EchoLost):
            self.ordered = self.ordered and not event.repaired
            self._on_refused(event, now)
        elif isinstance(event, ConnectFailed | SubscribeRefused):
            # A refused filter leaves a partial view until the bus gets it (then Synced).
            self.synced = False
        elif isinstance(event, BrokerChecked):
            # A broker that keeps retained messages from wildcard subscriptions shows no
            # peers: nothing it says settles a claim (BrokerNoRetainedWildcard).
            self.trusted = event.ok
            self.synced = self.synced and event.ok
        elif isinstance(event, Synced):
            covered = event.filters is None or self.needs <= event.filters
            if event.at >= self.sync_after and covered:
                self.synced = True
                if self.unconfirmed and self.confirm_by is None:
                    self.confirm_by = now + self.confirm_grace_s
        elif isinstance(event, Received):
            return self._on_received(event, now)
        elif isinstance(event, Deleted):
            return self._on_deleted(event, now)
        return None

    def _on_received(self, event: Received, now: float) -> Identity | None:
        ref, payload = event.ref, event.payload
        if ref.kind == "presence" and isinstance(payload, Presence):
            return self._on_presence(event, payload, now)
        if ref.kind == "member" and isinstance(payload, MemberRecord):
            ours = ref.node == self.node  # judged whatever its version: ours goes back over it
            here = (ref.domain, ref.clique) == self.current
            if here and ours and event.retained and self._ended_by_will(payload):
                return None  # ours, which our will ended: we claim again, not resume it
            if here and not self._newer(payload) and not ours:
                if version(payload) == self.versions.get(ref.node):
                    if payload.state is MemberState.LOST and ref.node in self.records:
                        # The will we hold, given again: it still ends the record (one
                        # restored unproven when a link ended before a round trip).
                        return self._on_lost(event, payload, now)
                    self.unconfirmed.discard(ref.node)  # what we hold, given again
                return None
            if (ref.domain, ref.clique) == self.current and payload.state is MemberState.LOST:
                return self._on_lost(event, payload, now)
            if (ref.domain, ref.clique) == self.current:
                before = self.records.get(ref.node)
                if ref.node in self.unconfirmed and before is not None and before != payload:
                    # Changed while our link was down: we did not see it stand unbroken.
                    self._forget_incumbent(ref.node)
                self.records[ref.node] = payload
                if event.retained:
                    self.snapshot_records.add(ref.node)
                else:
                    self.snapshot_records.discard(ref.node)
                self.lost.pop(ref.node, None)
                self.unconfirmed.discard(ref.node)
                self._track_claim(payload, now)
                if ref.node == self.node:
                    return self._on_own(payload, live=not event.retained, now=now)
        elif (
            ref.kind == "spec"
            and isinstance(payload, DomainSpec)
            and self.current is not None
            and ref.domain == self.current[0]
        ):
            # The agent passes only specs newer than the last (imexd.agent.rebuild). A
            # tombstone (`deleted`) keeps nodes out and makes members leave as `deleting`.
            self.spec = (
                msgspec.structs.replace(payload, state="deleting")
                if payload.state == "deleted"
                else payload
            )
        return None

    def _ended_by_will(self, record: MemberRecord) -> bool:
        """Whether the version we hold for `record`'s node is a will that ends it (for our
        own node also the end our presence said, `own_end`)."""
        held, new = self.versions.get(record.node), version(record)
        if held is not None and held[2] != LINK_END:
            held = None
        if record.node == self.node and self.own_end is not None:
            held = self.own_end if held is None else max(held, self.own_end)
        return held is not None and (new is None or new < held)

    def _newer(self, record: MemberRecord) -> bool:
        """Whether `record` (of the current shard) is newer than what we took in for its
        node, and if so keep its version: a record or will not newer is a copy, a replay
        or an earlier link's will, and changes nothing. A record without a place (an agent
        that predates it) is taken in its order of arrival, as is what follows it."""
        new, held = version(record), self.versions.get(record.node)
        if new is None:
            self.versions.pop(record.node, None)
            return True
        if held is not None and new <= held:
            return False
        self.versions[record.node] = new
        return True

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
            self.foreign_live = True  # another writer is live now (TAKEN_LINKS)
        if live:
            self._on_own_echo(data, now)
        if (
            record is not None
            and record.state is not MemberState.LOST
            and not self._foreign(record)
        ):
            self.past = record
        if record is not None:
            self._outbid(record)
        if self.republish or self.in_flight or self.duplicate:
            return None
        if not self.published or data == mine:
            return None
        return self._overwritten(record, now)

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
        self._raise_incarnation(record.incarnation, "a record of this node name")

    def _raise_incarnation(self, over: int, what: str) -> None:
        """Raise our incarnation above `over`, so that what we publish next is newer
        everywhere (`Plan.outbid`: saved, and a will that says it)."""
        self.incarnation = over + 1
        self.claim = replace(self.claim, incarnation=self.incarnation)
        self.outbid = True
        self.log.info(
            "membership.incarnation_raised",
            incarnation=self.incarnation,
            over=over,
            why=f"{what} that this agent did not write",
        )

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
        if self.contested:
            due = max(now, self.last_reassert + OVERWRITE_PACE_S)
        self.reassert_at = due if self.reassert_at is None else min(self.reassert_at, due)
        return None

    def _contest(self, why: str) -> None:
        """Another live agent runs with our name while we hold our slot: say so, keep the
        slot and the daemon (they are ours), and keep putting our record back (paced)."""
        if why != self.contested:
            self.log.error("membership.duplicate_node", node=self.node, why=why, kept="slot")
        self.contested = why

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

    def _on_deleted(self, event: Deleted, now: float, *, will: bool = False) -> Identity | None:
        """A record cleared (an empty topic: no version, so what comes next is taken in
        order), or dropped by a will (`will`: its version stays)."""
        ref = event.ref
        if ref.kind == "member" and (ref.domain, ref.clique) == self.current:
            if not will:
                self.versions.pop(ref.node, None)
            record = self.records.pop(ref.node, None)
            self.lost.pop(ref.node, None)
            self.unconfirmed.discard(ref.node)
            self.claims_seen.pop(ref.node, None)
            if record is not None and ref.node != self.node:
                self._unproven(record)
            if ref.node == self.node:
                if self.duplicate:
                    return self._duplicate_gone()
                return self._on_own(None, live=not event.retained, now=now)
        elif ref.kind == "spec" and self.current and ref.domain == self.current[0]:
            self.spec = None
        return None

    def _on_lost(self, event: Received, tombstone: MemberRecord, now: float) -> Identity | None:
        """A node's Last Will (state lost), newer than its records here (`_newer`): keep
        its previous record for its hold_s.

        Ours (a past link's will, or a duplicate's): as if our record were cleared, so a
        running agent publishes it again (over it: `_outbid`). A peer's without a record
        of it here (a leftover of a long-gone node, or a tombstone in a new link's
        snapshot) stays out of membership. A hold of 0 (the broker waited its Will Delay)
        drops it at once. The same will again, or the will of a link that its node's
        newer record came from a later link than, is not newer: it changes nothing.
        """
        node = tombstone.node
        if node == self.node:
            self._outbid(tombstone)
            return self._on_deleted(Deleted(event.topic, event.ref, retained=True), now, will=True)
        if node not in self.records:
            return None
        hold = min(max(tombstone.hold_s, 0.0), MAX_HOLD_S)
        self.unconfirmed.discard(node)
        if hold <= 0.0:
            retained = event.retained
            return self._on_deleted(
                Deleted(event.topic, event.ref, retained=retained), now, will=True
            )
        if node not in self.lost:
            self.lost[node] = now + hold
            self.log.info("membership.peer_lost", peer=node, hold_s=round(hold, 3))
        return None

    def _on_presence(self, event: Received, presence: Presence, now: float) -> Identity | None:
        """A presence (a peer's, `followed`, or our own): its Last Will ends the node's
        record here, as a tombstone on its member topic at the will's version would
        (`_on_lost`); a will of an earlier link or run than the record changes nothing.
        One found retained (in a snapshot) is old news: the record it ends is dropped at
        once. Ours ends our record in a new link's snapshot when our will fired while the
        link was down: we claim again rather than resume a slot someone may hold now; given
        live, ours changes nothing."""
        ours = presence.node == self.node
        later = (presence.incarnation, presence.link) > (self.incarnation, self.link)
        if ours and presence.lost and later:
            # A will of ours that we cannot have left (a later run or link than ours):
            # someone else wrote it, and peers would take it over every record of ours.
            self._raise_incarnation(presence.incarnation, "a will of this node name")
            return None
        if ours and not event.retained:
            # Our own will given live while our link is up: a broker shutting down (the
            # link ends next), or a copy of it; the next link's snapshot tells which. It
            # is nothing we must outbid.
            return None
        if ours and (end := presence_end(presence)) is not None:
            # Kept across shards: our record may come after it in a snapshot, or in the
            # shard we join next (`_ended_by_will`).
            self.own_end = end if self.own_end is None else max(self.own_end, end)
        held = self.records.get(presence.node)
        if self.current is None or held is None:
            return None
        will = lost_record(held, presence)
        if will is None or (ours and not ended(held, presence)):
            return None
        if event.retained:
            will = msgspec.structs.replace(will, hold_s=0.0)
        self.log.info(
            "membership.will_seen",
            peer=presence.node,
            link=presence.link,
            retained=event.retained,
            why="the node's presence says its link ended without a goodbye",
        )
        domain, clique = self.current
        ref = TopicRef(kind="member", domain=domain, clique=clique, node=presence.node)
        return self._on_received(Received(event.topic, ref, will, retained=event.retained), now)

    def followed(self) -> frozenset[str]:
        """The peers whose presence the agent follows: those it holds a record of in the
        current shard, since their Last Will is their presence (`messages.Presence`)."""
        return frozenset(n for n in self.records if n != self.node)

    def found(self) -> frozenset[str]:
        """The followed peers whose record came from a snapshot, not live: only such a
        record can be a dead node's (a live one has a live writer), so a step that may
        claim waits for their presence, and for no other."""
        return frozenset(n for n in self.snapshot_records if n in self.records and n != self.node)

    def _drop_lost(self, now: float) -> None:
        """Drop the peers whose tombstone's hold ran out, as if their records were cleared."""
        gone = sorted(node for node, until in self.lost.items() if now >= until)
        for node in gone:
            del self.lost[node]
            record = self.records.pop(node, None)
            self.unconfirmed.discard(node)
            self.claims_seen.pop(node, None)
            if record is not None:
                self._unproven(record)
        if gone:
            self.log.info("membership.records_gone", nodes=gone, why="lost: hold_s passed")

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
        this shard, to be cleared when we leave it."""
        self.published = self.published or record is not None

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
            self.replay_rival = self._rival(record.slot, now)
            self.continuous = self.replay_rival is None
            return
        if record.state is not MemberState.CLAIMING:
            return
        self.echo = mb.barrier(
            self.node,
            record.slot,
            self.records.values(),
            max_nodes=self.max_nodes,
            spec=self.spec,
            stale=self._stale(now),
        )

    def _rival(self, slot: int, now: float) -> MemberRecord | None:
        """The record of another node that competes on `slot` in this link's view (the
        records a previous link left unconfirmed do not count)."""
        confirmed = [r for n, r in self.records.items() if n not in self.unconfirmed]
        return mb.barrier(
            self.node,
            slot,
            confirmed,
            max_nodes=self.max_nodes,
            spec=self.spec,
            stale=self._stale(now),
        ).rival

    def _stale(self, now: float) -> frozenset[str]:
        """The peers whose claims stood unchanged for claim_stale_s (they do not count)."""
        return mb.stale_claims(
            self.records.values(),
            {node: at for node, (_, at) in self.claims_seen.items()},
            now=now,
            stale_after_s=self.claim_stale_s,
            me=self.node,
        )

    def _unproven(self, record: MemberRecord) -> None:
        """A peer's record was dropped on this link: unproven until a round trip after it."""
        self.deletions += 1
        self.unproven[record.node] = (record, self.deletions)

    def proof_mark(self) -> int:
        """The mark of the last deletion taken in: pass it to `proven` once a round trip
        through the broker, begun after this call on the same link, came back."""
        return self.deletions

    def proven(self, mark: int) -> None:
        """A round trip through the broker came back after the deletions up to `mark`: the
        broker delivered them while it still served us, so they were no shutdown's."""
        self.unproven = {n: (r, m) for n, (r, m) in self.unproven.items() if m > mark}

    def _restore_unproven(self) -> None:
        """The link ended before a round trip came back after these deletions.

        A broker that shuts down publishes every client's will, ignoring the Will Delay,
        and then closes the links: those wills say nothing about the peers, which come
        back with the broker. The records return unconfirmed, as after any reconnect:
        their nodes publish newer ones, or the grace for a new link drops them. A
        deletion that a round trip proved never comes back this way.
        """
        restored = sorted(n for n in self.unproven if n not in self.records)
        for node in restored:
            self.records[node] = self.unproven[node][0]
            self.unconfirmed.add(node)
        self.unproven.clear()
        if restored:
            self.log.info(
                "membership.deletions_unproven",
                nodes=restored,
                why="the link ended before a round trip through the broker came back "
                "after them (a broker shutting down publishes every will first)",
            )

    def _track_claim(self, record: MemberRecord, now: float) -> None:
        """Remember since when each peer's claim (incarnation, slot) has stood unchanged."""
        if record.node == self.node or record.state is not MemberState.CLAIMING:
            self.claims_seen.pop(record.node, None)
            return
        key = (record.incarnation, record.slot)
        seen = self.claims_seen.get(record.node)
        if seen is None or seen[0] != key:
            self.claims_seen[record.node] = (key, now)

    # -- duplicate node names -------------------------------------------------------

    def _on_taken_over(self) -> Identity | None:
        """The broker handed our session to another client with our client id: another
        agent runs with this node's name (our own past run has ended before we started).
        Without a settled slot we stand aside; with one we keep it and its daemon, and
        the other one stands aside when we take the session back."""
        if self.duplicate:
            return None
        why = "the broker handed this node's session to another client"
        if self.current is not None and self.claim.phase is not mb.Phase.MEMBER:
            return self._found_duplicate(why)
        if self.claim.phase is mb.Phase.MEMBER:
            self._contest(why)
        self.log.warning(
            "bus.session_taken_over",
            why="another client connected with this node's client id; "
            "is a second agent running with this node name?",
        )
        return None

    def _watch(self, own: MemberRecord, now: float) -> bool:
        """Whether to keep watching `own`, a record of our name that we did not write,
        before we replace it: another live agent of our name takes our session back
        within its first reconnect delays (`_on_link_ended`), a record alone does not."""
        if self.published:
            return False
        if self.watch_until is None:
            self.watch_until = now + self.takeover_watch_s
            self.log.info(
                "membership.own_name_seen",
                incarnation=own.incarnation,
                address=own.address,
                watch_s=round(self.takeover_watch_s, 1),
                why="a record of this node name that this agent did not write",
            )
        if now < self.watch_until:
            self.wake_at = self.watch_until
            return True
        return False

    def _on_link_ended(self) -> Identity | None:
        """The broker ended our link without a reason code.

        Brokers that send no reason code (MQTT 3.1.1, and some MQTT 5 brokers) close the
        old link silently when another client takes the session: two agents with one
        name then push each other off at every reconnect, and each link of ours sees the
        other's record published live before it ends. TAKEN_LINKS such links in a row are
        taken as a live duplicate; a retained record alone never is.
        """
        watching = self.watch_until is not None and not self.published
        self.taken = self.taken + 1 if self.foreign_live or watching else 0
        self.foreign_live = False
        if self.taken < TAKEN_LINKS:
            return None
        why = (
            f"the broker ended this node's link {self.taken} times in a row after another "
            "writer published a record of this node's name on it: another agent with this "
            "name keeps taking the session"
        )
        if self.claim.phase is mb.Phase.MEMBER:
            self._contest(why)
            return None
        return self._found_duplicate(why)

    def _found_duplicate(self, why: str) -> Identity | None:
        """Another live agent runs as this node: stand aside without touching its state.

        We publish nothing on its topics, run no daemon, drop our will (it would clear the
        other's record) and take another client id so that the two stop taking the
        broker session from each other. We come back once its record is gone.
        """
        if self.duplicate or self.claim.phase is mb.Phase.MEMBER:
            return None
        self.duplicate = why
        self.reassert_at = None
        self.published = False  # the topic is the other agent's: never clear it
        self.log.error("membership.duplicate_node", node=self.node, why=why)
        return Identity.ASIDE

    def _duplicate_gone(self) -> Identity:
        """The other agent's record is gone: claim as usual under our own client id."""
        self.log.info("membership.duplicate_gone", node=self.node)
        self.duplicate = ""
        return Identity.BACK

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
        """Whether a record of our name may come from another agent, not our past run."""
        return own.incarnation >= self.incarnation or own.address != self.address

    # -- steps ----------------------------------------------------------------------

    def derive(
        self,
        now: float,
        *,
        wall_now: float,
        saved: NodeState,
        running: bool,
        release: Callable[[], bool],
    ) -> Plan:
        """One membership step on the records as they stand: what to do now.

        `now` is the monotonic clock, `wall_now` the wall clock (settle stamps); `saved`
        the node's state dir (its previous slot); `running` whether the daemon runs for
        this shard now; `release` says whether to give our slot up (asked only when a
        claim step is taken).
        """
        if self.current is None:
            self.wake_at = None
            return Plan()
        if not self.synced:
            return Plan()
        self._drop_unconfirmed(now)
        self._drop_lost(now)
        self._seat_incumbents()
        domain, clique = self.current
        # What the daemon runs now, as far as the shard is concerned (`own_change`).
        runs = Desired(domain=domain, clique=clique, slot=self.claim.slot, run=running)
        if self.spec is not None and self.spec.state == "deleting":
            return self._ruled(
                runs,
                Plan(
                    desired=Desired(domain=domain, clique=clique, cleanup=True),
                    leave=self.claim.phase is not mb.Phase.OUT,
                ),
                DOMAIN_DELETED,
            )
        own = self.records.get(self.node)
        if own is not None and self._foreign(own) and self.past is not None and not self.published:
            # A record of our name came after our past run's: resume from ours and put it
            # back (the owner's record wins; only a live session shows another agent).
            own = self.past
        if self.duplicate:
            # Another agent runs as this node: publish nothing, and keep what runs.
            self.decision = None
            return Plan(hold=True)
        rival, why = self.replay_rival, "it settled our slot while our record was gone"
        if self.republish and self.claim.phase is mb.Phase.MEMBER:
            rival, why = self._rejoin(own, now), "it took our slot while our link was down"
        if rival is not None:
            self._claim_again(rival, why)
            own = None
        echo = self.echo
        if echo is not None and echo.rival is None and not self.trusted:
            # Our claim is back and would settle: it does once the broker passed the
            # retained check of this link (BrokerChecked). Keep what runs meanwhile.
            return Plan()
        if self.claim.phase is mb.Phase.NONE and own is not None and self._foreign(own):
            # A record of our name that we did not write (a run of ours whose incarnation
            # we never saved, or anyone's): ours replaces it, newer than it, once no live
            # agent of our name took our session back within its reconnect delay.
            if self._watch(own, now):
                self.decision = None
                return Plan(hold=True)
            self._outbid(own)
        outbid, self.outbid = self.outbid, False
        previous = saved.slot if (saved.domain, saved.clique) == self.current else None
        stale = self._stale(now)
        records = {**self.records}
        if self.claim.phase is mb.Phase.NONE:
            # Resume only a record of ours: never a slot that another author wrote.
            records.pop(self.node, None)
            if own is not None and not self._foreign(own):
                records[self.node] = own
        decision = mb.step(
            self.claim,
            records.values(),
            now=now,
            wall_now=wall_now,
            echo=self.echo,
            max_nodes=self.max_nodes,
            spec=self.spec,
            previous_slot=previous,
            stale=stale,
            release=release(),
            incumbent=self.incumbent,
            incumbents=self.incumbents if self.ordered else {},
        )
        mismatch = tuple(
            mb.mismatches(
                self.records.values(),
                max_nodes=self.max_nodes,
                mode=self.mode,
                spec=self.spec,
                stale=stale,
            )
        )
        detail = ""
        if self.spec is not None and self.spec.max_nodes != self.max_nodes:
            detail = (
                f"{self.node}: max_nodes {self.max_nodes} here, the domain spec says "
                f"{self.spec.max_nodes}; the spec decides, so only this node is refused"
            )
        members = MappingProxyType(
            {
                slot: Member(node, address)
                for slot, (node, address) in decision.members(self.address).items()
            }
        )
        # A mismatch keeps the daemon from starting but never stops a running one: its
        # node list is fixed already, and the peers that agree with it would lose it
        # (and the jobs using it) because of one misconfigured newcomer.
        run = decision.settled and clique != "" and (not (mismatch or detail) or running)
        self.started = self.started or running
        wake_at = self._hold_first_start(now, decision, stale) if run else None
        run = run and wake_at is None
        self.started = self.started or run
        reassert = self.reassert_at is not None and now >= self.reassert_at
        if reassert:
            self.last_reassert = now
        wakes = (wake_at, self.reassert_at, *self.lost.values())
        plan = Plan(
            desired=Desired(
                domain=domain,
                clique=clique,
                slot=decision.claim.slot if decision.settled else None,
                run=run,
                members=members,
            ),
            decision=decision,
            publish=decision.publish
            or reassert
            or (self.republish and decision.claim.record_state is not None),
            wake_at=min((t for t in wakes if t is not None), default=None),
            outbid=outbid,
            mismatch=mismatch,
            mismatch_detail=detail,
        )
        return self._ruled(runs, plan, decision.reason)

    def _ruled(self, runs: Desired, plan: Plan, cause: str) -> Plan:
        """`plan`, or a hold when it would stop or restart what runs against `own_change`.

        `membership.step` gives another node's record no power over a member whose
        record stood without a break, so a hold here is a broken promise of the slot
        rules: it is logged as an error, and the daemon keeps running.
        """
        assert plan.desired is not None  # noqa: S101 - only plans that say what runs
        if own_change(runs, plan.desired, cause, incumbent=self.incumbent):
            return plan
        self.log.error(
            "membership.daemon_kept",
            slot=runs.slot,
            cause=cause,
            detail=plan.decision.message if plan.decision is not None else "",
            why="another node's record would stop or move the daemon of a member whose "
            "record stood without a break",
        )
        return Plan(hold=True, wake_at=plan.wake_at)

    def _seat_incumbents(self) -> None:
        """Keep `incumbents` true to the records: forget those whose record left its slot,
        and seat the one member of a slot that has exactly one (confirmed) member record.

        A slot on which several member records stand gets no incumbent: nobody here saw
        which came first, and `mb.resolve` ranks them by their stamps.
        """
        for slot, node in list(self.incumbents.items()):
            record = self.records.get(node)
            if record is None or record.state is not MemberState.MEMBER or record.slot != slot:
                del self.incumbents[slot]
        on: dict[int, list[str]] = {}
        for node, record in self.records.items():
            if (
                record.state is MemberState.MEMBER
                and record.slot is not None
                and 0 <= record.slot < self.max_nodes
                and mb.allowed(node, self.spec)
            ):
                on.setdefault(record.slot, []).append(node)
        for slot, nodes in on.items():
            if slot not in self.incumbents and len(nodes) == 1 and nodes[0] not in self.unconfirmed:
                self.incumbents[slot] = nodes[0]

    def _forget_incumbent(self, node: str) -> None:
        """`node` no longer holds a slot first in this view (its record changed unseen)."""
        for slot in [s for s, n in self.incumbents.items() if n == node]:
            del self.incumbents[slot]

    def _rejoin(self, own: MemberRecord | None, now: float) -> MemberRecord | None:
        """A new link, and we hold a slot: publish our member record again only where the
        snapshot still holds it, or holds nothing competing on its slot; else claim again
        (the rival returned).

        Our will may have fired while the link was down, and another node settled our
        slot since: replaying our record (with its earlier stamp) would evict it.
        """
        slot = self.claim.slot
        assert slot is not None  # noqa: S101 - a member holds a slot
        if own is not None and self.node not in self.unconfirmed and own == self.last_sent:
            self.continuous = True
            return None
        rival = self._rival(slot, now)
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
        self.records.pop(self.node, None)
        self.unconfirmed.discard(self.node)
        self.past = None
        self.replay_rival = None
        self.replaying = False
        self.claim = mb.ClaimState(node=self.node, incarnation=self.incarnation)
        self.decision = None

    def _hold_first_start(
        self, now: float, decision: mb.Decision, stale: frozenset[str]
    ) -> float | None:
        """Until when the first daemon start in this shard waits (None: start now).

        It waits while the shard still forms: claims of other allowed nodes in flight
        (not stale), or nodes that the spec lists (within max_nodes) not members yet;
        at most FIRST_START_WINDOWS x settle_s from the first time it could start, so a
        stuck or absent node cannot block it. Joins after the start are SIGUSR1s.
        """
        if self.started:
            return None
        spec = self.spec
        claims = sorted(
            r.node
            for r in self.records.values()
            if r.node != self.node
            and r.state is MemberState.CLAIMING
            and r.node not in stale
            and mb.allowed(r.node, spec)
            and r.slot is not None
            and r.slot < self.max_nodes
        )
        members = {node for node, _ in decision.members(self.address).values()}
        listed = spec.nodes[: self.max_nodes] if spec is not None and spec.nodes else []
        absent = sorted(n for n in listed if n not in members)
        if not claims and not absent:
            self._end_hold("formed")
            return None
        if self.hold_until is None:
            self.hold_until = now + FIRST_START_WINDOWS * self.settle_s
        if now >= self.hold_until:
            self._end_hold("bound reached", claiming=claims, not_members=absent)
            return None
        held = "daemon start waits for the shard to form: " + "; ".join(
            part
            for part in (
                f"claims in flight ({', '.join(claims)})" if claims else "",
                f"listed nodes not members yet ({', '.join(absent)})" if absent else "",
            )
            if part
        )
        if held != self.held:
            self.log.info(
                "membership.first_start_held",
                claiming=claims,
                not_members=absent,
                until_s=round(self.hold_until - now, 3),
            )
        self.held = held
        return self.hold_until

    def _end_hold(self, why: str, **detail: list[str]) -> None:
        if self.hold_until is not None:
            self.log.info("membership.first_start_released", why=why, **detail)
        self.hold_until = None
        self.held = ""

    def record(
        self, claim: mb.ClaimState, *, driver: str, channel_count: int | None = None
    ) -> MemberRecord | None:
        """The record `claim` publishes in the current shard (None: clear ours);
        `channel_count` is the driver's ImexChannelCount (None: unknown)."""
        state = claim.record_state
        if state is None or self.current is None:
            return None
        domain, clique = self.current
        record = MemberRecord(
            node=self.node,
            domain=domain,
            clique=clique,
            address=self.address,
            slot=claim.slot,
            incarnation=self.incarnation,
            state=state,
            max_nodes=self.max_nodes,
            mode=self.mode,
            driver=driver,
            settled=claim.settled,
            channel_count=channel_count,
            released=claim.record_released,
            seq=self.seq,
            link=self.link,
        )
        # Its place among this run's records: the last one's, when it says nothing new
        # (published again), else the next (a reader takes the later of two copies).
        return (
            record
            if record == self.last_sent
            else msgspec.structs.replace(record, seq=self.seq + 1)
        )

    def commit(self, plan: Plan) -> None:
        """Keep the claim step of `plan`, once its record (if any) is published."""
        decision = plan.decision
        if decision is None:
            return
        if self.decision is None or (decision.reason, decision.settled) != (
            self.decision.reason,
            self.decision.settled,
        ):
            # Every claim waits for its echo: only the claim and what its echo said are news.
            waiting = decision.reason is mb.Reason.WAITING_FOR_ECHO
            (self.log.debug if waiting else self.log.info)(
                "membership.step",
                phase=decision.claim.phase.value,
                slot=decision.claim.slot,
                reason=decision.reason.value,
                detail=decision.message,
            )
        if not decision.settled:
            self.continuous = False
        elif (self.claim.phase, self.claim.slot) != (mb.Phase.MEMBER, decision.claim.slot):
            # Settled at our claim's echo (no rival stood on the slot), or our retained
            # record resumed: it stands on the broker from here on.
            self.continuous = True
        self.claim = decision.claim
        self.decision = decision
        self.wake_at = plan.wake_at
        self.mismatch = plan.mismatch
        self.mismatch_detail = plan.mismatch_detail

    def left(self) -> None:
        """Our records of the deleted domain are cleared: we are out of it."""
        self.claim = replace(self.claim, phase=mb.Phase.OUT, slot=None)
        self.decision = None

    def _drop_unconfirmed(self, now: float) -> None:
        """Forget the records a new link did not confirm in time, or whose slot moved on.

        A confirmed record on the slot of an unconfirmed one supersedes it at once: the
        slot was freed and taken while this node was away.
        """
        if not self.unconfirmed:
            self.confirm_by = None
            return
        expired = self.confirm_by is not None and now >= self.confirm_by
        taken = {
            r.slot
            for node, r in self.records.items()
            if node not in self.unconfirmed and r.slot is not None
        }
        gone = sorted(
            node for node in self.unconfirmed if expired or self.records[node].slot in taken
        )
        if not gone:
            return
        self.log.info(
            "membership.records_gone", nodes=gone, why="not re-published after a reconnect"
        )
        for node in gone:
            self.records.pop(node, None)
            self.lost.pop(node, None)
            self.unconfirmed.discard(node)
        if not self.unconfirmed:
            self.confirm_by = None

    # -- facts ----------------------------------------------------------------------

    def facts(self, desired: Desired) -> MembershipFacts:
        """The membership facts of health, with `desired` as the agent applies it."""
        decision = self.decision
        contests = decision.contests() if decision is not None else {}
        base = MembershipFacts(
            max_nodes=self.max_nodes,
            members=desired.members,
            contested=tuple(
                Contest(slot, desired.members[slot].node, tuple(sorted(nodes)))
                for slot, nodes in contests.items()
                if slot in desired.members
            ),
            overwritten=self.overwritten_total,
        )
        if self.duplicate:
            return replace(base, state="out", reason="DuplicateNode", detail=self.duplicate)
        recent = self.overwrite_open and self.claim.phase is mb.Phase.MEMBER
        if recent and self.contested:
            return replace(base, state="member", reason="DuplicateNode", detail=self.contested)
        if recent:
            detail = f"someone {self.overwritten} on this node's member topic; put back"
            return replace(base, state="member", reason="RecordOverwritten", detail=detail)
        if self.watch_until is not None and not self.published:
            return replace(
                base,
                detail="a record of this node name that this agent did not write is on the "
                "bus; checking that no other agent runs as this node before replacing it",
            )
        if self.claim.phase is mb.Phase.RELEASED:
            detail = decision.message if decision else "the daemon stayed FATAL"
            return replace(base, state="standby", reason="Released", detail=detail)
        if self.mismatch or self.mismatch_detail:
            detail = self.mismatch_detail or (
                f"max_nodes or mode differ from this node's ({self.max_nodes}, {self.mode})"
            )
            return replace(
                base,
                state="member" if decision and decision.settled else "claiming",
                reason="NodeMapMismatch",
                detail=detail,
                offending=self.mismatch,
            )
        phase = self.claim.phase
        if phase is mb.Phase.OUT:
            if desired.cleanup:
                return replace(base, state="leaving", detail="the domain is being deleted")
            return replace(base, state="out", reason="NotInSpec", detail="not in the spec's list")
        if phase is mb.Phase.STANDBY:
            return replace(
                base,
                state="standby",
                reason="DomainFull",
                detail=f"all {self.max_nodes} slots are held",
            )
        state: MembershipState = (
            "member"
            if decision is not None and decision.settled
            else "claiming"
            if phase is mb.Phase.CLAIMING
            else "none"
        )
        detail = self.held or (decision.message if decision else "")
        return replace(base, state=state, detail=detail)
