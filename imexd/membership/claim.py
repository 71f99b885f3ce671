"""What one node holds of a shard's slots: its own published claim (`ClaimState`, in a
`Phase`), the outcome of one step of the slot rules (`Decision`, with its `Reason`), the
resolved shard (`SlotMap`) and the barrier of a claim (`Echo`).

Values only: `imexd.membership.slots` holds the rules that make them.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import msgspec

from imexd.messages import MemberRecord, MemberState


class Phase(StrEnum):
    """Where this node's own claim stands (what it last published)."""

    NONE = "none"
    """Nothing published yet: just started, or not yet synced."""
    CLAIMING = "claiming"
    MEMBER = "member"
    STANDBY = "standby"
    RELEASED = "released"
    """Standby after giving our slot up (`step(release=True)`): no claim while it lasts."""
    OUT = "out"
    """Not in the spec's allow-list: the record is cleared and no daemon runs."""


class Reason(StrEnum):
    """Machine-readable reason of the SlotSettled condition."""

    SETTLED = "Settled"
    RESUMED = "Resumed"
    """Our own member record was still retained (agent restart): kept as is."""
    CLAIMED = "Claimed"
    WAITING_FOR_ECHO = "WaitingForEcho"
    """Our claim has not come back live from the broker yet (its echo settles it)."""
    LOST_CONFLICT = "LostConflict"
    PARTITION_HEALED = "PartitionHealed"
    SLOT_CONTESTED = "SlotContested"
    """Another node's member record stands on our settled slot; we keep it (incumbent,
    or ranking first)."""
    DOMAIN_FULL = "DomainFull"
    NOT_IN_SPEC = "NotInSpec"
    RELEASED = "Released"
    """We gave our slot up (`step(release=True)`) to a node waiting as standby."""


_RECORD_STATE: Mapping[Phase, MemberState | None] = {
    Phase.NONE: None,
    Phase.CLAIMING: MemberState.CLAIMING,
    Phase.MEMBER: MemberState.MEMBER,
    Phase.STANDBY: MemberState.STANDBY,
    Phase.RELEASED: MemberState.STANDBY,
    Phase.OUT: None,
}


class ClaimState(msgspec.Struct, frozen=True, kw_only=True):
    """What this node has published about itself, kept by the agent between steps."""

    node: str
    incarnation: int
    """This agent run's incarnation: only our record of this incarnation is our echo."""
    phase: Phase = Phase.NONE
    slot: int | None = None
    since: float = 0.0
    """`now` when the current phase and slot were published (the claim's start)."""
    settled: float | None = None
    """Wall-clock seconds when our claim settled into member (MemberRecord.settled);
    None unless we are a member. Publish it in our record."""

    @property
    def record_state(self) -> MemberState | None:
        """The `state` of the record to publish; None: clear the record (empty payload)."""
        return _RECORD_STATE[self.phase]

    @property
    def record_released(self) -> bool:
        """The `released` flag of the record to publish."""
        return self.phase is Phase.RELEASED


class Echo(msgspec.Struct, frozen=True, kw_only=True):
    """The barrier of one claim: what stood on its slot when the claim came back live.

    Taken (`barrier`) by whoever reads the bus in order, at the moment the live echo of
    the last record this node published arrives, from the records as they stand then;
    the records that arrive later were accepted after our claim and cannot beat it.
    """

    slot: int
    rival: MemberRecord | None
    """The competing record on the slot at that moment (None: the slot was ours)."""
    view: SlotMap | None = None
    """The other nodes' records at that moment, resolved: the broker accepted every one
    of them before our claim. A claim that lost deals its next slot from it (None: not
    taken by `barrier`; the next slot comes from the records as they stand)."""


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one `step`: the state to keep, and whether to publish it."""

    claim: ClaimState
    """Keep this as our state; when `publish`, publish its record (or clear it)."""
    publish: bool
    """The record changed: publish `claim.record_state` and `claim.slot` (None: clear)."""
    settled: bool
    """We are a member: the agent may write our slot and start the daemon."""
    reason: Reason
    message: str
    view: SlotMap
    """The other nodes' records as this step resolved them (our own left out): with our
    own slot when `settled`, the members the files list (`members`)."""

    def members(self, address: str) -> dict[int, tuple[str, str]]:
        """slot -> (node, address) of the settled members, ours (at `address`) included.

        Our settled slot is ours in the full resolution too (`step` settles only when no
        member that beats ours stands on the slot, and a member beats every claim), so
        the others' view needs no second `resolve`.
        """
        out = {slot: (r.node, r.address) for slot, r in self.view.members.items()}
        if self.settled and self.claim.slot is not None:
            out[self.claim.slot] = (self.claim.node, address)
        return dict(sorted(out.items()))

    def contests(self) -> dict[int, frozenset[str]]:
        """slot -> the nodes whose member record stands on a slot that `members` gives
        to another node: ours included, where another member record stands on it."""
        out = dict(self.view.contenders)
        slot = self.claim.slot
        if self.settled and slot is not None:
            rival = self.view.winners.get(slot)
            if rival is not None and rival.state is MemberState.MEMBER:
                out[slot] = out.get(slot, frozenset()) | {rival.node}
        return dict(sorted(out.items()))


class SlotMap(msgspec.Struct, frozen=True, kw_only=True):
    """The resolved shard: who wins each slot, and who is left waiting."""

    max_nodes: int
    winners: Mapping[int, MemberRecord]
    """slot -> the winning record (member or claim), in slot order."""
    losers: frozenset[str]
    """Nodes whose claim or member record lost its slot: they must claim again."""
    standby: frozenset[str]
    """Allowed nodes waiting in state standby for a slot (released ones are not)."""
    ignored: frozenset[str]
    """Nodes outside the spec's allow-list, whose records take no part."""
    stale: frozenset[str] = frozenset()
    """Nodes whose stale claim took no part (`stale_claims`)."""
    contenders: Mapping[int, frozenset[str]] = msgspec.field(default_factory=dict)
    """slot -> the other nodes whose member record stands on a slot that a member won:
    a contested slot (a forged record, or two sides of a split)."""

    @property
    def nodes(self) -> dict[int, str]:
        """slot -> node of every winner."""
        return {slot: r.node for slot, r in self.winners.items()}

    @property
    def slots(self) -> dict[str, int]:
        """node -> slot of every winner."""
        return {r.node: slot for slot, r in self.winners.items()}

    @property
    def members(self) -> dict[int, MemberRecord]:
        """slot -> record of the winners in state member: what the files list."""
        return {s: r for s, r in self.winners.items() if r.state is MemberState.MEMBER}
