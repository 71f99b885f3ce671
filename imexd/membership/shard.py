"""The agent's view of its (domain, clique) shard: what the bus says, and what to do.

`ShardView` turns the bus events of one shard (member records, the domain's spec, the link
coming and going) into what this node must do next: its record, its claim, and what should
run (`Desired`). Events go in through `apply(event, now)`, a `Plan` comes out of
`derive(now, ...)`, and `commit(plan)` keeps it once the agent has published; the node's
core (imexd.agent.core.NodeCore) turns the plan into actions and its driver does the I/O,
so this is testable without a broker, daemon or clock. Two rules to know: a settled
member's daemon stops or restarts only for the node's own reasons, never for another
node's record while our link was continuous (`own_change`, which the core's gate
`imexd.agent.gate.admit` applies to every plan); and a claim settles only at the live
echo of the last record we published (`imexd.membership.slots`). The other guards
(broker restarts, wills, stale claims, a second agent with our name, records written over
ours) and why each exists: docs/membership.md#what-the-shard-guards-against.

The view is built in layers, each a module: `own` (the state the view shares, and our own
record's lifecycle), then `intake` (records, clears and wills taken off the bus), then this
module (the link's events, the step and the facts of health). It owns three parts whose
state divides cleanly: `peers.Peers` (the book of the shard's records),
`namesake.Namesakes` (another live agent with our name) and `plan.FirstStart` (the hold
of the first daemon start).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

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
)
from imexd.facts import Contest, Member, MembershipFacts, MembershipReason, MembershipState
from imexd.membership import slots as mb
from imexd.membership.claim import ClaimState, Phase, Reason
from imexd.membership.desired import Desired
from imexd.membership.intake import RecordEvents
from imexd.membership.namesake import TAKEN_LINKS, TAKEOVER_WATCH_DELAYS, Identity
from imexd.membership.own import OVERWRITE_PACE_S, RECLAIMS_ON_LOST_ECHO
from imexd.membership.peers import CONFIRM_MARGIN_S
from imexd.membership.plan import (
    DOMAIN_DELETED,
    FIRST_START_WINDOWS,
    OWN_CAUSES,
    Plan,
    own_change,
)
from imexd.messages import (
    Deleted,
    MemberRecord,
    Received,
)
from imexd.nodestate import NodeState
from imexd.settings import Settings

__all__ = [
    "CONFIRM_MARGIN_S",
    "DOMAIN_DELETED",
    "FIRST_START_WINDOWS",
    "OVERWRITE_PACE_S",
    "OWN_CAUSES",
    "RECLAIMS_ON_LOST_ECHO",
    "TAKEN_LINKS",
    "TAKEOVER_WATCH_DELAYS",
    "Identity",
    "Plan",
    "ShardView",
    "own_change",
]


_Standing = tuple[MembershipState, MembershipReason, str, tuple[str, ...]]
"""The membership facts' (state, reason, detail, offending) (`ShardView.facts`)."""


class ShardView(RecordEvents):
    """The records, spec, claim and decision of this node's current shard."""

    @property
    def records(self) -> dict[str, MemberRecord]:
        """The shard's member records as they stand here, one per node (ours among them)."""
        return self.peers.records

    @property
    def unproven(self) -> dict[str, tuple[MemberRecord, int]]:
        """Peers' records dropped on this link that no round trip proved yet (`Peers`)."""
        return self.peers.unproven

    @property
    def duplicate(self) -> str:
        """Why another live agent runs as this node (empty: none does); we publish nothing."""
        return self.names.duplicate

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
        self.incarnation = self.started_as = incarnation
        self.claim = ClaimState(node=self.node, incarnation=incarnation)
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
        was_duplicate = bool(self.names.duplicate)
        self.current = target
        self.needs = needs
        self.published = self.past_stands = False
        self.past = self.outbidding = None
        self.continuous = self.replaying = False
        self.replay_rival = None
        self.reassert_at = None
        self.names.join()
        self.peers.clear()
        self.spec = None
        # No shard: no snapshot to wait for (a leave keeps the link, so no Synced follows).
        self.synced = target is None
        self.claim = ClaimState(node=self.node, incarnation=self.incarnation)
        self.decision = None
        self.wake_at = None
        self.in_flight.clear()
        self.overwrite_open = False
        self.last_sent = None
        self.echo = None
        self.republish = False
        self.first = self._first_start()
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
        due = [self.wake_at] if self.wake_at is not None else []
        due += self.peers.due_at(now)
        return min(due) if due else None

    # -- bus events -----------------------------------------------------------------

    def apply(self, event: Event, now: float) -> Identity | None:
        """Take one bus event in; say when the agent must change its identity."""
        if isinstance(event, Connected):
            # Keep the records of the previous link until the new one confirms them: a
            # broker that restarted without its retained state gets them back only as
            # the peers reconnect, and dropping them meanwhile would rewrite the hosts
            # block and send SIGUSR1 twice for a membership that never changed.
            self.peers.reconnected()
            self.synced = False
            self.link = event.link
            self.names.foreign_live = False
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
            self.peers.restore_unproven()
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
                self.peers.synced(now)
        elif isinstance(event, Received):
            return self._on_received(event, now)
        elif isinstance(event, Deleted):
            return self._on_deleted(event, now)
        return None

    def followed(self) -> frozenset[str]:
        """The peers whose presence the agent follows (`Peers.followed`)."""
        return self.peers.followed()

    def found(self) -> frozenset[str]:
        """The followed peers whose record came from a snapshot (`Peers.found`): a step
        that may claim waits for their presence, and for no other."""
        return self.peers.found()

    def proof_mark(self) -> int:
        """The mark of the last deletion taken in (`Peers.proof_mark`)."""
        return self.peers.proof_mark()

    def proven(self, mark: int) -> None:
        """A round trip came back after the deletions up to `mark` (`Peers.proven`)."""
        self.peers.proven(mark)

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
        if self.wake_at is not None and self.wake_at <= now:
            # A timer fires once: this is the step it asked for. Whatever still waits
            # sets it again below; a step that returns early must not keep it due.
            self.wake_at = None
        if not self.synced:
            return Plan()
        gone = self.peers.drop_unconfirmed(now)
        if self.names.duplicate and self.node in gone:
            # The other agent's record is gone without a clear: a broker that lost it (it
            # restarted empty) gave it back to no link of ours within the grace, so no
            # agent of our name published it again. Gone as surely as by a clear.
            self.identity = self.names.gone()
        self.peers.drop_lost(now)
        self.peers.seat_incumbents(self.spec)
        domain, clique = self.current
        if self.spec is not None and self.spec.state == "deleting":
            return Plan(
                desired=Desired(domain=domain, clique=clique, cleanup=True),
                leave=self.claim.phase is not Phase.OUT,
            )
        own = self.peers.records.get(self.node)
        past = self.past
        if past is not None and not self._resumable(past):
            # What ends it (our will, a later run's presence) may come after it.
            past = self.past = None
        if own is not None and self._foreign(own) and past is not None and not self.published:
            # A record of our name came after our past run's: resume from ours and put it
            # back (the owner's record wins; only a live session shows another agent).
            own = past
        if self.names.duplicate:
            # Another agent runs as this node: publish nothing, and keep what runs.
            self.decision = None
            return Plan(hold=True)
        rival, why = self.replay_rival, "it settled our slot while our record was gone"
        if self.republish and self.claim.phase is Phase.MEMBER:
            rival, why = self._rejoin(own, now), "it took our slot while our link was down"
        if rival is not None:
            self._claim_again(rival, why)
            own = None
        echo = self.echo
        if echo is not None and echo.rival is None and not self.trusted:
            # Our claim is back and would settle: it does once the broker passed the
            # retained check of this link (BrokerChecked). Keep what runs meanwhile.
            return Plan()
        if self.claim.phase is Phase.NONE and own is not None and self._foreign(own):
            # A record of our name that we did not write (a run of ours whose incarnation
            # we never saved, or anyone's): ours replaces it, newer than it, once no live
            # agent of our name took our session back within its reconnect delay.
            if self.names.watch(own, now, published=self.published):
                self.wake_at = self.names.watch_until
                self.decision = None
                return Plan(hold=True)
            self._outbid(own)
        outbid = self._take_outbid()
        previous = saved.slot if (saved.domain, saved.clique) == self.current else None
        stale = self.peers.stale(now)
        records = {**self.peers.records}
        if self.claim.phase is Phase.NONE:
            # Resume only a record of ours: never a slot that another author wrote.
            records.pop(self.node, None)
            if own is not None and self._resumable(own):
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
            incumbents=self.peers.incumbents if self.ordered else {},
        )
        mismatch = tuple(
            mb.mismatches(
                self.peers.records.values(),
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
        first = self.first
        first.started = first.started or running
        wake_at = (
            first.hold(now, decision, stale, records=self.peers.records, spec=self.spec)
            if run
            else None
        )
        run = run and wake_at is None
        first.started = first.started or run
        reassert = self.reassert_at is not None and now >= self.reassert_at
        if reassert:
            self.last_reassert = now
        wakes = (wake_at, self.reassert_at, *self.peers.lost.values())
        return Plan(
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

    def record(
        self, claim: ClaimState, *, driver: str, channel_count: int | None = None
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
            waiting = decision.reason is Reason.WAITING_FOR_ECHO
            (self.log.debug if waiting else self.log.info)(
                "membership.step",
                phase=decision.claim.phase.value,
                slot=decision.claim.slot,
                reason=decision.reason.value,
                detail=decision.message,
            )
        if decision.claim.phase is not Phase.MEMBER:
            # A replay is of the slot we held: a step that leaves it (a claim elsewhere)
            # ends it, so the echo of the member record that claim settles is no replay.
            self.replaying = False
        if not decision.settled:
            self.continuous = False
        elif (self.claim.phase, self.claim.slot) != (Phase.MEMBER, decision.claim.slot):
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
        self.claim = msgspec.structs.replace(self.claim, phase=Phase.OUT, slot=None)
        self.decision = None

    # -- facts ----------------------------------------------------------------------

    def facts(self, desired: Desired) -> MembershipFacts:
        """The membership facts of health, with `desired` as the agent applies it."""
        decision = self.decision
        contests = decision.contests() if decision is not None else {}
        state, reason, detail, offending = self._standing(desired)
        return MembershipFacts(
            state=state,
            reason=reason,
            detail=detail,
            offending=offending,
            max_nodes=self.max_nodes,
            members=desired.members,
            contested=tuple(
                Contest(slot, desired.members[slot].node, tuple(sorted(nodes)))
                for slot, nodes in contests.items()
                if slot in desired.members
            ),
            overwritten=self.overwritten_total,
        )

    def _standing(self, desired: Desired) -> _Standing:
        """(state, reason, detail, offending) of the membership facts."""
        decision = self.decision
        if self.names.duplicate:
            return "out", "DuplicateNode", self.names.duplicate, ()
        recent = self.overwrite_open and self.claim.phase is Phase.MEMBER
        if recent and self.names.contested:
            detail = self.names.contested
            return "member", "DuplicateNode", detail, ()
        if recent:
            detail = f"someone {self.overwritten} on this node's member topic; put back"
            return "member", "RecordOverwritten", detail, ()
        if self.names.watch_until is not None and not self.published:
            detail = (
                "a record of this node name that this agent did not write is on the "
                "bus; checking that no other agent runs as this node before replacing it"
            )
            return "none", "", detail, ()
        if self.claim.phase is Phase.RELEASED:
            detail = decision.message if decision else "the daemon stayed FATAL"
            return "standby", "Released", detail, ()
        if self.mismatch or self.mismatch_detail:
            detail = self.mismatch_detail or (
                f"max_nodes or mode differ from this node's ({self.max_nodes}, {self.mode})"
            )
            state: MembershipState = "member" if decision and decision.settled else "claiming"
            return state, "NodeMapMismatch", detail, self.mismatch
        phase = self.claim.phase
        if phase is Phase.OUT:
            if desired.cleanup:
                return "leaving", "", "the domain is being deleted", ()
            return "out", "NotInSpec", "not in the spec's list", ()
        if phase is Phase.STANDBY:
            return "standby", "DomainFull", f"all {self.max_nodes} slots are held", ()
        state = (
            "member"
            if decision is not None and decision.settled
            else "claiming"
            if phase is Phase.CLAIMING
            else "none"
        )
        detail = self.first.held or (decision.message if decision else "")
        return state, "", detail, ()
