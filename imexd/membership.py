"""Slots inside one (domain, clique): who holds which, and what this node does next.

Pure: no I/O, no asyncio, no clocks. The agent keeps the retained member records of
its (domain, clique) shard, one per node, and calls these functions on every change and
on the timer that `Decision.wake_at` asks for; time comes in as `now` (monotonic) and
`wall_now` (wall clock, for settle stamps).

The conflict rule (`resolve`)
    Only `claiming` and `member` records with a slot below max_nodes compete. On each
    slot the winner is the record with the smallest rank:
      1. members with a believable settle stamp, earlier `settled` first;
      2. members without one: no stamp (an agent older than the field), or a stamp
         more than FUTURE_STAMP_S (30 s) ahead of the caller's wall clock;
      3. claims;
    and the node name breaks every tie. A member beats a claim; between two claims the
    lower name wins. The rank is a total order over the records of distinct nodes, so
    every node that holds the same records computes the same map, whatever order they
    arrived in. A DomainSpec that lists nodes is an allow-list: records of other nodes
    take no part; nor do standby and leaving records, nor claims the caller found stale
    (`stale_claims`: a live claim settles or moves within a settle window, so one that
    stands unchanged far longer belongs to a dead or broken agent, or to nobody).

Claiming (`step`)
    After the retained snapshot a node publishes `claiming` for its preferred slot. The
    claim settles into `member` once the node's own record came back from the broker
    (so the broker holds it and every subscriber will receive it) and `settle_s` passed
    with no record on the slot that beats it. Only then does the agent start its daemon.
    A claim that is beaten is given up at once for another slot; a node that finds no
    slot waits as `standby` and claims again when a slot frees. A member never yields to
    a claim: it yields only to a member that ranks first on the same slot, which exists only
    when both sides of a partition settled it.

Which slot (`preferred_slot`)
    A slot is *owned* by right when it is the node's position in the spec's list, or
    (without such a position) its previous slot from the state dir. A node claims an
    owned slot unless a record there would beat its claim (a member, or a lower-named
    claim): it pre-empts higher-named claims, because the list is authoritative and a
    previous slot may still carry a running daemon the agent wants to adopt. Any other
    slot is taken only when nobody holds it at all, so newcomers never disturb claims in
    flight. Those *free* slots are dealt out by rank: the nodes looking for one (losers
    of a conflict, standby nodes, and this node), sorted by name, take the free slots in
    order. Nodes that see the same records thus pick distinct slots, and eight nodes
    started at once need two claim rounds, not eight. Slots that a spec reserves for a
    listed node that holds nothing yet are not free to others, so list positions survive
    and edits of the list never cascade.

Why it converges
    Nothing depends on who arrived first, and every preference is a fixed order over
    node names, so no two nodes can push each other back and forth: a pre-empted claim
    was higher-named and the pre-empting one keeps its slot. Once the records stop
    changing from outside, the lowest-named claim in the shard is beaten by nothing but
    a member, so it settles or moves, within one delivery delay, to a slot no member
    holds; members are never displaced, so each claim round adds at least one member
    until the slots or the claimants run out, and the standby nodes are woken by the
    record change that frees a slot. The ranking of free slots makes the usual case far
    better than that bound: in the simulator of tests/test_membership.py a group of any
    size settles within two rounds of the last join, leave or crash.

Why a member never moves
    If every record reaches every subscriber within D seconds and `settle_s` > 2 D, a
    claim that would beat a settling claim is seen before the settle window ends, and a
    claim published after that sees the new member record before its own window ends,
    and loses to it (a member beats a claim). Two honest members therefore meet on one
    slot only after a partition (or a broker that lost its retained state): each side
    settled the slot while it could not see the other.

Who survives a healed partition, and why both sides agree
    Each member carries `settled`, its wall clock when its claim settled, unchanged for
    as long as it stays a member (an agent restart resumes its retained record and keeps
    the stamp). When the partition heals both sides hold both records, and the rank
    above is a function of the records alone, up to the one clock test: a stamp is
    disbelieved only when it lies more than 30 s in the reader's future, which honest
    nodes with synchronised clocks (NTP, well under a second) never produce, so both
    sides rank both members alike and agree that the one that settled first stays; the
    other claims again (PartitionHealed). Keeping the earlier one keeps the node that
    held the slot longest, usually the one whose daemon the running jobs use.

Why an injected record cannot evict a settled incumbent
    A record that appears directly as `member` on a held slot either carries no stamp,
    or a future one (both rank after every stamped member, so it cannot win by declaring
    itself), or a stamp later than the incumbent's (it loses to the earlier one), or a
    stamp earlier than the incumbent's: the one way to win is to lie about when it
    settled. Names no longer matter between stamped members. A record that lies about
    its stamp looks exactly like the other side of a healed partition, and no rule over
    the records can tell the two apart; what stops it is the broker's ACL
    (`pattern write .../members/+/%u`, and the check that a record agrees with its
    topic): only that node's credentials can write that record, so a node that lies
    with its own credentials is attributable, and one without them cannot write at all.
    A member without a stamp (an agent older than the field) still beats any claim, so
    an upgrade in place never moves a slot; it stamps its record at its next resume.

Releasing a slot (`step(release=True)`)
    A member whose daemon cannot run gives its slot up only when a node waits as
    standby for one: it publishes `standby` with `released` set (Phase.RELEASED,
    reason Released), which peers leave out of the nodes waiting for a slot, so the
    freed slot goes to a waiting node whatever the names. It claims nothing while the
    release holds and claims afresh once it ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from imexd.messages import DomainSpec, MemberRecord, MemberState, Mode, encode

_COMPETING = frozenset({MemberState.CLAIMING, MemberState.MEMBER})

FUTURE_STAMP_S: Final = 30.0
"""A member's `settled` more than this many seconds ahead of the reader's wall clock is
not believed: that member ranks as if it carried no stamp."""


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
    SETTLE_WINDOW = "SettleWindow"
    LOST_CONFLICT = "LostConflict"
    PARTITION_HEALED = "PartitionHealed"
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimState:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The outcome of one `step`: the state to keep, and whether to publish it."""

    claim: ClaimState
    """Keep this as our state; when `publish`, publish its record (or clear it)."""
    publish: bool
    """The record changed: publish `claim.record_state` and `claim.slot` (None: clear)."""
    settled: bool
    """We are a member: the agent may write our slot and start the daemon."""
    reason: Reason
    message: str
    wake_at: float | None
    """Call `step` again at this time even if no record changes (None: only on changes)."""
    view: SlotMap
    """The other nodes' records as this step resolved them (our own left out): with our
    own slot when `settled`, the members the files list (`members`)."""

    def members(self, address: str) -> dict[int, tuple[str, str]]:
        """slot -> (node, address) of the settled members, ours (at `address`) included.

        Our settled slot is ours in the full resolution too (`step` settles only a claim
        that no record on the slot beats), so the others' view needs no second `resolve`.
        """
        out = {slot: (r.node, r.address) for slot, r in self.view.members.items()}
        if self.settled and self.claim.slot is not None:
            out[self.claim.slot] = (self.claim.node, address)
        return dict(sorted(out.items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotMap:
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


def allowed(node: str, spec: DomainSpec | None) -> bool:
    """Whether the spec lets `node` in (no spec, or a spec without a list, lets all in)."""
    return spec is None or spec.nodes is None or node in spec.nodes


def newer(a: MemberRecord, b: MemberRecord) -> MemberRecord:
    """Of two records of one node, the one to keep: the higher incarnation wins.

    On a tie `b` wins: pass the later arrival as `b`, since within one incarnation the
    agent's latest publish is its current word.
    """
    if a.node != b.node:
        raise ValueError(f"records of different nodes: {a.node!r} and {b.node!r}")
    return a if a.incarnation > b.incarnation else b


def compatible(record: MemberRecord, *, max_nodes: int, mode: Mode) -> bool:
    """Whether `record`'s node would write the same node list as ours."""
    return record.max_nodes == max_nodes and record.mode == mode


def mismatches(
    records: Iterable[MemberRecord],
    *,
    max_nodes: int,
    mode: Mode,
    spec: DomainSpec | None = None,
    stale: frozenset[str] = frozenset(),
) -> list[str]:
    """Nodes whose max_nodes or mode differ from ours, sorted (NodeMapMismatch).

    Only claims and members can enter the node list: standby and leaving nodes, nodes
    outside the allow-list and stale claims cannot make it differ and are not reported.
    """
    return sorted(
        r.node
        for r in _latest(records).values()
        if r.state in _COMPETING
        and not (r.state is MemberState.CLAIMING and r.node in stale)
        and allowed(r.node, spec)
        and not compatible(r, max_nodes=max_nodes, mode=mode)
    )


def stale_claims(
    records: Iterable[MemberRecord],
    first_seen: Mapping[str, float],
    *,
    now: float,
    stale_after_s: float,
    me: str,
) -> frozenset[str]:
    """Nodes whose claim has stood unchanged for `stale_after_s` or more: dead claims.

    `first_seen` maps a node to the (monotonic) time the agent first saw its current
    claiming record, content and all; `now` is on the same clock. A live claim settles
    or moves within a settle window and an echo, so one that stands far longer belongs to
    an agent that is gone or broken (or to nobody: a record left behind or forged). Such
    claims take no part in `resolve`, `preferred_slot` and `step`, so a real node can
    take their slot. Our own claim (`me`) is never stale. Nodes disagree on this only
    for the moments around `stale_after_s`, which should be many settle windows.
    """
    return frozenset(
        r.node
        for r in _latest(records).values()
        if r.node != me
        and r.state is MemberState.CLAIMING
        and (seen := first_seen.get(r.node)) is not None
        and now - seen >= stale_after_s
    )


def resolve(
    records: Iterable[MemberRecord],
    *,
    max_nodes: int,
    spec: DomainSpec | None = None,
    wall_now: float | None = None,
    stale: frozenset[str] = frozenset(),
) -> SlotMap:
    """Apply the conflict rule: the same records give the same map on every node.

    Several records of one node (the caller normally keeps one) are reduced to the
    newest, ties broken by content, so the arrival order never matters. `wall_now` is
    the caller's wall clock, against which members' `settled` stamps are believed or
    not (None: every stamp is believed); claims of nodes in `stale` take no part.
    """
    winners: dict[int, MemberRecord] = {}
    losers: set[str] = set()
    standby: set[str] = set()
    ignored: set[str] = set()
    skipped: set[str] = set()
    for r in _latest(records).values():
        if not allowed(r.node, spec):
            ignored.add(r.node)
        elif r.state is MemberState.STANDBY:
            if not r.released:
                standby.add(r.node)
        elif r.state is MemberState.CLAIMING and r.node in stale:
            skipped.add(r.node)
        elif r.state in _COMPETING and r.slot is not None and r.slot < max_nodes:
            held = winners.get(r.slot)
            if held is None:
                winners[r.slot] = r
            elif _key(r, wall_now) < _key(held, wall_now):
                losers.add(held.node)
                winners[r.slot] = r
            else:
                losers.add(r.node)
    return SlotMap(
        max_nodes=max_nodes,
        winners=dict(sorted(winners.items())),
        losers=frozenset(losers),
        standby=frozenset(standby),
        ignored=frozenset(ignored),
        stale=frozenset(skipped),
    )


def preferred_slot(
    node: str,
    records: Iterable[MemberRecord],
    *,
    max_nodes: int,
    spec: DomainSpec | None = None,
    previous_slot: int | None = None,
    wall_now: float | None = None,
    stale: frozenset[str] = frozenset(),
) -> int | None:
    """The slot `node` should claim now, or None (standby, or not in the spec's list).

    In order: its list position when the spec lists it and no member or lower-named
    claim holds that position; else its previous slot on the same terms; else a free
    slot by rank (see the module docstring). Our own record is left out: the question
    is where we would stand if we claimed afresh.
    """
    if not allowed(node, spec):
        return None
    others = [r for r in records if r.node != node]
    view = resolve(others, max_nodes=max_nodes, spec=spec, wall_now=wall_now, stale=stale)
    return _choose(node, view, spec, previous_slot)


def echoed(me: ClaimState, records: Iterable[MemberRecord]) -> bool:
    """Whether the broker sent back exactly what we published (this incarnation).

    The agent also uses it to report PublishRefused when the echo does not come.
    """
    own = _latest(records).get(me.node)
    return (
        own is not None
        and own.incarnation == me.incarnation
        and own.state == me.record_state
        and own.slot == me.slot
        and own.released == me.record_released
    )


def step(
    me: ClaimState,
    records: Iterable[MemberRecord],
    *,
    now: float,
    settle_s: float,
    max_nodes: int,
    spec: DomainSpec | None = None,
    previous_slot: int | None = None,
    wall_now: float | None = None,
    stale: frozenset[str] = frozenset(),
    release: bool = False,
) -> Decision:
    """Advance our own claim by one step, from the records of our shard.

    Call it only once the retained snapshot was received, then on every record change
    and at `wake_at`. `records` may include our own record: it is how the echo is seen.
    `now` is the agent's monotonic clock (settle windows); `wall_now` its wall clock,
    which stamps a claim that settles (`ClaimState.settled`) and bounds the stamps of
    others (None: no stamp is set and every stamp is believed). Claims of nodes in
    `stale` take no part (ours never is). `release`: give our slot up to a node waiting
    as standby, and stay standby while it holds (a daemon that cannot run).
    """
    latest = _latest(records)
    own = latest.pop(me.node, None)
    view = resolve(
        latest.values(),
        max_nodes=max_nodes,
        spec=spec,
        wall_now=wall_now,
        stale=stale - {me.node},
    )
    at = _Step(
        me=me,
        view=view,
        spec=spec,
        previous_slot=previous_slot,
        now=now,
        settle_s=settle_s,
        wall_now=wall_now,
    )

    if not allowed(me.node, spec):
        return at.hold(Phase.OUT, None, Reason.NOT_IN_SPEC, "not in the spec's node list")

    if me.phase is Phase.MEMBER and me.slot is not None:
        rival = view.winners.get(me.slot)
        if rival is not None and at.beats(rival, MemberState.MEMBER, me.settled):
            return at.reclaim(
                Reason.PARTITION_HEALED,
                f"member {rival.node} also holds slot {me.slot} and ranks first "
                "(earlier settle time, then lower name)",
            )
        if release and view.standby:
            waiting = ", ".join(sorted(view.standby))
            return at.hold(
                Phase.RELEASED,
                None,
                Reason.RELEASED,
                f"released slot {me.slot} to the standby node(s) {waiting}",
            )
        return at.hold(Phase.MEMBER, me.slot, Reason.SETTLED, f"slot {me.slot}")

    if me.phase is Phase.RELEASED and release:
        return at.hold(
            Phase.RELEASED, None, Reason.RELEASED, "slot released; not claiming while released"
        )

    if me.phase is Phase.CLAIMING and me.slot is not None:
        rival = view.winners.get(me.slot)
        if rival is not None and _beats(rival, MemberState.CLAIMING, me.node):
            return at.reclaim(
                Reason.LOST_CONFLICT, f"{rival.state.value} {rival.node} wins slot {me.slot}"
            )
        position = _position(me.node, spec, max_nodes)
        if position is not None and position != me.slot and not _blocked(view, position, me.node):
            # A spec arrived or changed while we claimed: move to our position while no
            # daemon runs yet (a member would stay put).
            return at.claim(position, Reason.CLAIMED, "the spec's position")
        wake = me.since + settle_s
        if not echoed(me, [own] if own is not None else []):
            return at.hold(
                Phase.CLAIMING,
                me.slot,
                Reason.WAITING_FOR_ECHO,
                f"claim on slot {me.slot} not yet back from the broker",
                wake_at=wake if wake > now else None,
            )
        if now < wake:
            return at.hold(
                Phase.CLAIMING,
                me.slot,
                Reason.SETTLE_WINDOW,
                f"claim on slot {me.slot} settles at {wake:.3f}",
                wake_at=wake,
            )
        return at.hold(Phase.MEMBER, me.slot, Reason.SETTLED, f"slot {me.slot}")

    if (
        me.phase is Phase.NONE
        and own is not None
        and own.state is MemberState.MEMBER
        and own.slot is not None
        and own.slot < max_nodes
        and not at.beats(view.winners.get(own.slot), MemberState.MEMBER, own.settled)
    ):
        # Our previous run's member record is still retained (restart or hand-over
        # inside the will delay): keep the slot without a claim, and its settle stamp,
        # so that peers see no change and the running daemon can be adopted.
        return at.hold(
            Phase.MEMBER,
            own.slot,
            Reason.RESUMED,
            f"slot {own.slot} (resumed)",
            stamp=own.settled,
        )

    return at.reclaim(Reason.CLAIMED, "")


# Internals


def _rank(
    state: MemberState, settled: float | None, node: str, wall_now: float | None
) -> tuple[int, float, str]:
    """Smaller wins a slot (the rule of the module docstring).

    Stamped members first, by settle time; then members without a believable stamp;
    then claims; the node name breaks every tie.
    """
    if state is not MemberState.MEMBER:
        return (2, 0.0, node)
    if (
        settled is None
        or not math.isfinite(settled)
        or (wall_now is not None and settled > wall_now + FUTURE_STAMP_S)
    ):
        return (1, 0.0, node)
    return (0, settled, node)


def _key(r: MemberRecord, wall_now: float | None) -> tuple[int, float, str]:
    return _rank(r.state, r.settled, r.node, wall_now)


def _beats(
    rival: MemberRecord | None,
    state: MemberState,
    node: str,
    settled: float | None = None,
    wall_now: float | None = None,
) -> bool:
    """Whether `rival` wins a slot against a record of ours (`state`, `settled`)."""
    return rival is not None and _key(rival, wall_now) < _rank(state, settled, node, wall_now)


def _blocked(view: SlotMap, slot: int, node: str) -> bool:
    """Whether a claim by `node` on `slot` would lose to another node's record."""
    return _beats(view.winners.get(slot), MemberState.CLAIMING, node)


def _latest(records: Iterable[MemberRecord]) -> dict[str, MemberRecord]:
    """One record per node: the highest incarnation, ties by content (order-free)."""
    out: dict[str, MemberRecord] = {}
    for r in records:
        held = out.get(r.node)
        if held is None or (r.incarnation, encode(r)) > (held.incarnation, encode(held)):
            out[r.node] = r
    return out


def _position(node: str, spec: DomainSpec | None, max_nodes: int) -> int | None:
    """`node`'s position in the spec's list when it is a slot, else None."""
    if spec is None or spec.nodes is None or node not in spec.nodes:
        return None
    position = spec.nodes.index(node)
    return position if position < max_nodes else None


def _reserved(view: SlotMap, spec: DomainSpec | None, node: str) -> set[int]:
    """List positions kept for other listed nodes that hold no slot yet."""
    if spec is None or spec.nodes is None:
        return set()
    holding = view.slots
    return {
        position
        for position, listed in enumerate(spec.nodes[: view.max_nodes])
        if listed != node and listed not in holding
    }


def _choose(
    node: str, view: SlotMap, spec: DomainSpec | None, previous_slot: int | None
) -> int | None:
    """The slot rule of `preferred_slot`, given the map of the other nodes' records."""
    position = _position(node, spec, view.max_nodes)
    if position is not None and not _blocked(view, position, node):
        return position
    reserved = _reserved(view, spec, node)
    if (
        previous_slot is not None
        and 0 <= previous_slot < view.max_nodes
        and previous_slot not in reserved
        and not _blocked(view, previous_slot, node)
    ):
        return previous_slot
    free = [s for s in range(view.max_nodes) if s not in view.winners and s not in reserved]
    # Seekers that will take their own list position do not compete for free slots.
    seekers = sorted(
        n
        for n in view.losers | view.standby | {node}
        if n == node or (p := _position(n, spec, view.max_nodes)) is None or _blocked(view, p, n)
    )
    rank = seekers.index(node)
    return free[rank] if rank < len(free) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Step:
    """The inputs of one `step`, shared by the ways it can end."""

    me: ClaimState
    view: SlotMap
    """The other nodes' records, resolved."""
    spec: DomainSpec | None
    previous_slot: int | None
    now: float
    settle_s: float
    wall_now: float | None

    def beats(self, rival: MemberRecord | None, state: MemberState, settled: float | None) -> bool:
        """Whether `rival` wins a slot against our record in `state` stamped `settled`."""
        return _beats(rival, state, self.me.node, settled, self.wall_now)

    def hold(
        self,
        phase: Phase,
        slot: int | None,
        reason: Reason,
        message: str,
        *,
        wake_at: float | None = None,
        stamp: float | None = None,
    ) -> Decision:
        """Hold (phase, slot): published only when it differs from what we hold now.

        A member keeps its settle stamp; one that becomes a member now is stamped with
        `stamp` (a resumed record's), else `wall_now`; anything else carries none.
        """
        me = self.me
        changed = (phase, slot) != (me.phase, me.slot)
        settled: float | None = None
        if phase is Phase.MEMBER:
            settled = me.settled if not changed else (stamp if stamp is not None else self.wall_now)
        claim = ClaimState(
            node=me.node,
            incarnation=me.incarnation,
            phase=phase,
            slot=slot,
            since=self.now if changed else me.since,
            settled=settled,
        )
        return Decision(
            claim=claim,
            publish=changed,
            settled=phase is Phase.MEMBER,
            reason=reason,
            message=message,
            wake_at=wake_at,
            view=self.view,
        )

    def claim(self, slot: int, reason: Reason, message: str) -> Decision:
        """Publish a fresh claim on `slot` and wake when its settle window ends."""
        me = self.me
        return Decision(
            claim=ClaimState(
                node=me.node,
                incarnation=me.incarnation,
                phase=Phase.CLAIMING,
                slot=slot,
                since=self.now,
            ),
            publish=True,
            settled=False,
            reason=reason,
            message=f"claiming slot {slot}" + (f": {message}" if message else ""),
            wake_at=self.now + self.settle_s if self.settle_s > 0 else None,
            view=self.view,
        )

    def reclaim(self, reason: Reason, message: str) -> Decision:
        """Claim the preferred slot, or wait as standby when there is none."""
        slot = _choose(self.me.node, self.view, self.spec, self.previous_slot)
        if slot is not None:
            return self.claim(slot, reason, message)
        text = f"no free slot among {self.view.max_nodes}; waiting as standby"
        if message:
            text += f" ({message})"
        if reason is Reason.CLAIMED:
            reason = Reason.DOMAIN_FULL
        return self.hold(Phase.STANDBY, None, reason, text)
