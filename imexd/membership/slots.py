"""Slots inside one (domain, clique): who holds which, and what this node does next.

Pure: no I/O, no asyncio, no clocks. The agent calls these functions with the retained
member records of its shard on every change; time comes in as `now` (monotonic) and
`wall_now` (wall clock), the broker's order as an `Echo`. The rules a reader must know:
- `resolve`: on each slot the incumbent member wins; else the smallest rank (stamped
  members by `settled`, then members without a believable stamp, then claims; the node
  name breaks every tie).
- `step`: a claim settles at its own live echo, when no competing record stands on its
  slot in the view at that moment; no timer decides it.
The full rules (which slot, incumbency, release) are in docs/membership.md, with why two
members never share a slot: docs/membership.md#why-two-members-never-share-a-slot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final

import msgspec

from imexd.membership.claim import ClaimState, Decision, Echo, Phase, Reason, SlotMap
from imexd.messages import DomainSpec, MemberRecord, MemberState, Mode, encode

_COMPETING = frozenset({MemberState.CLAIMING, MemberState.MEMBER})
_NO_INCUMBENTS: Final[Mapping[int, str]] = MappingProxyType({})

FUTURE_STAMP_S: Final = 30.0
"""A member's `settled` more than this many seconds ahead of the reader's wall clock is
not believed: that member ranks as if it carried no stamp."""


def allowed(node: str, spec: DomainSpec | None) -> bool:
    """Whether the spec lets `node` in (no spec, or a spec without a list, lets all in)."""
    return spec is None or spec.nodes is None or node in spec.nodes


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
    With a spec, its max_nodes decides: a node that disagrees with the spec refuses
    itself, so it never holds back the nodes that agree (and is not reported here).
    """
    return sorted(
        r.node
        for r in _latest(records).values()
        if r.state in _COMPETING
        and not (r.state is MemberState.CLAIMING and r.node in stale)
        and allowed(r.node, spec)
        and (spec is None or r.max_nodes == spec.max_nodes)
        and (r.max_nodes, r.mode) != (max_nodes if spec is None else spec.max_nodes, mode)
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
    or moves within a round trip through the broker (its echo), so one that stands far
    longer belongs to an agent that is gone or broken (or to nobody: a record left
    behind or forged). Such claims take no part in `resolve`, `preferred_slot` and
    `step`, so a real node can take their slot. Our own claim (`me`) is never stale.
    Nodes disagree on this only for the moments around `stale_after_s`, which should be
    many round trips.
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
    incumbents: Mapping[int, str] = _NO_INCUMBENTS,
) -> SlotMap:
    """Apply the conflict rule: the same records give the same map on every node.

    Several records of one node (the caller normally keeps one) are reduced to the
    newest, ties broken by content, so the arrival order never matters. `wall_now` is
    the caller's wall clock, against which members' `settled` stamps are believed or
    not (None: every stamp is believed); claims of nodes in `stale` take no part.
    `incumbents`: slot -> the node the caller saw hold it first (docs/membership.md,
    *Incumbency*); its member record on that slot wins before any rank.
    """
    winners: dict[int, MemberRecord] = {}
    losers: set[str] = set()
    standby: set[str] = set()
    ignored: set[str] = set()
    skipped: set[str] = set()
    standing: dict[int, set[str]] = {}
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
            incumbent = incumbents.get(r.slot)
            if held is None:
                winners[r.slot] = r
            elif _seat(r, incumbent, wall_now) < _seat(held, incumbent, wall_now):
                losers.add(held.node)
                winners[r.slot] = r
            else:
                losers.add(r.node)
            if r.state is MemberState.MEMBER:
                standing.setdefault(r.slot, set()).add(r.node)
    contenders = {
        slot: frozenset(nodes - {winners[slot].node})
        for slot, nodes in sorted(standing.items())
        if len(nodes) > 1
    }
    return SlotMap(
        max_nodes=max_nodes,
        winners=dict(sorted(winners.items())),
        losers=frozenset(losers),
        standby=frozenset(standby),
        ignored=frozenset(ignored),
        stale=frozenset(skipped),
        contenders=contenders,
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
    slot dealt by turn (docs/membership.md, *Which slot*). Our own record is left out: the
    question is where we would stand if we claimed afresh.
    """
    if not allowed(node, spec):
        return None
    latest = _latest(records)
    own = latest.pop(node, None)
    view = resolve(latest.values(), max_nodes=max_nodes, spec=spec, wall_now=wall_now, stale=stale)
    return _choose(node, view, spec, previous_slot, losing=_losing(own, view))


def barrier(
    node: str,
    slot: int,
    records: Iterable[MemberRecord],
    *,
    max_nodes: int,
    spec: DomainSpec | None = None,
    stale: frozenset[str] = frozenset(),
) -> Echo:
    """The verdict on `node`'s claim of `slot` at the moment its live echo arrived.

    `records` are the shard's records as they stand at that moment (ours is left out);
    a competing record on the slot (a member, or a claim of another allowed node that is
    not in `stale`) was accepted by the broker before our claim, and beats it.
    """
    others = [r for r in records if r.node != node]
    view = resolve(others, max_nodes=max_nodes, spec=spec, stale=stale - {node})
    return Echo(slot=slot, rival=view.winners.get(slot), view=view)


def step(
    me: ClaimState,
    records: Iterable[MemberRecord],
    *,
    now: float,
    max_nodes: int,
    echo: Echo | None = None,
    spec: DomainSpec | None = None,
    previous_slot: int | None = None,
    wall_now: float | None = None,
    stale: frozenset[str] = frozenset(),
    release: bool = False,
    incumbent: bool = False,
    incumbents: Mapping[int, str] = _NO_INCUMBENTS,
) -> Decision:
    """Advance our own claim by one step, from the records of our shard.

    Call it only once the retained snapshot was received, then on every record change.
    `echo` is the barrier of our current claim (`barrier`, taken when the last record we
    published came back live; None: not back yet). `now` is the agent's monotonic clock
    (the start of a claim); `wall_now` its wall clock, which stamps a claim that settles
    (`ClaimState.settled`) and bounds the stamps of others (None: no stamp is set and
    every stamp is believed). Claims of nodes in `stale` take no part (ours never is).
    `release`: give our slot up to a node waiting as standby, and stay standby while it
    holds (a daemon that cannot run). `incumbent`: our member record has stood on the
    broker without a break since it settled, on links that keep the broker's order
    (`ShardView.incumbent`): as a member we keep our slot against any other member
    record (docs/membership.md, *Incumbency*); otherwise the stamps decide.
    `incumbents`: the other slots' incumbents, for `resolve`.
    """
    latest = _latest(records)
    own = latest.pop(me.node, None)
    view = resolve(
        latest.values(),
        max_nodes=max_nodes,
        spec=spec,
        wall_now=wall_now,
        stale=stale - {me.node},
        incumbents=incumbents,
    )
    at = _Step(
        me=me,
        own=own,
        view=view,
        spec=spec,
        previous_slot=previous_slot,
        now=now,
        wall_now=wall_now,
    )

    if not allowed(me.node, spec):
        return at.hold(Phase.OUT, None, Reason.NOT_IN_SPEC, "not in the spec's node list")

    if me.phase is Phase.MEMBER and me.slot is not None:
        rival = view.winners.get(me.slot)
        contender = rival if rival is not None and rival.state is MemberState.MEMBER else None
        if (
            contender is not None
            and not incumbent
            and at.beats(contender, MemberState.MEMBER, me.settled)
        ):
            return at.reclaim(
                Reason.PARTITION_HEALED,
                f"member {contender.node} also holds slot {me.slot} and ranks first "
                "(earlier settle time, then lower name), and this node cannot show it "
                "held the slot first (its record had a break, or its link may lose updates)",
            )
        if release and view.standby:
            waiting = ", ".join(sorted(view.standby))
            return at.hold(
                Phase.RELEASED,
                None,
                Reason.RELEASED,
                f"released slot {me.slot} to the standby node(s) {waiting}",
            )
        if contender is not None:
            why = (
                "this node has held it without a break"
                if incumbent
                else "this node ranks first (earlier settle time, then lower name)"
            )
            return at.hold(
                Phase.MEMBER,
                me.slot,
                Reason.SLOT_CONTESTED,
                f"slot {me.slot}, kept against member {contender.node} at "
                f"{contender.address}, whose record also stands on it: {why}",
            )
        return at.hold(Phase.MEMBER, me.slot, Reason.SETTLED, f"slot {me.slot}")

    if me.phase is Phase.RELEASED and release:
        return at.hold(
            Phase.RELEASED, None, Reason.RELEASED, "slot released; not claiming while released"
        )

    if me.phase is Phase.CLAIMING and me.slot is not None:
        return _claiming(at, me.slot, echo if echo is not None and echo.slot == me.slot else None)

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


def _claiming(at: _Step, slot: int, echo: Echo | None) -> Decision:
    """The step of a claim in flight on `slot`: wait for its echo, then settle or move."""
    view = at.view
    position = _position(at.me.node, at.spec, view.max_nodes)
    if position is not None and position != slot and not _blocked(view, position, at.me.node):
        # A spec arrived or changed while we claimed: move to our position while no
        # daemon runs yet (a member would stay put).
        return at.claim(position, Reason.CLAIMED, "the spec's position")
    if echo is None:
        # A rival already in view was accepted first and our claim is lost; we still
        # wait for the echo, whose view deals our next slot (see "Which slot").
        rival = view.winners.get(slot)
        first = f"; {rival.state.value} {rival.node} came first" if rival is not None else ""
        return at.hold(
            Phase.CLAIMING,
            slot,
            Reason.WAITING_FOR_ECHO,
            f"claim on slot {slot} not yet back from the broker{first}",
        )
    if echo.rival is not None:
        return at.reclaim(
            Reason.LOST_CONFLICT,
            f"{echo.rival.state.value} {echo.rival.node} stood on slot {slot} when the "
            "broker accepted our claim",
            dealer=echo.view,
        )
    late = view.winners.get(slot)
    if at.beats(late, MemberState.MEMBER, at.wall_now):
        # A member that settled where we could not see it (a partition, a broker that
        # lost its state) and ranks before a member stamped now: the slot is its.
        assert late is not None  # noqa: S101 - beats() is False for None
        return at.reclaim(
            Reason.PARTITION_HEALED, f"member {late.node} holds slot {slot} and ranks first"
        )
    return at.hold(Phase.MEMBER, slot, Reason.SETTLED, f"slot {slot}")


# Internals


def _rank(
    state: MemberState, settled: float | None, node: str, wall_now: float | None
) -> tuple[int, float, str]:
    """Smaller wins a slot (docs/membership.md, *The conflict rule*).

    Stamped members first, by settle time; then members without a believable stamp;
    then claims; the node name breaks every tie.
    """
    if state is not MemberState.MEMBER:
        return (2, 0.0, node)
    if (
        settled is None
        or not math.isfinite(settled)
        or settled <= 0.0
        or (wall_now is not None and settled > wall_now + FUTURE_STAMP_S)
    ):
        return (1, 0.0, node)
    return (0, settled, node)


def _key(r: MemberRecord, wall_now: float | None) -> tuple[int, float, str]:
    return _rank(r.state, r.settled, r.node, wall_now)


def _seat(
    r: MemberRecord, incumbent: str | None, wall_now: float | None
) -> tuple[bool, tuple[int, float, str]]:
    """Smaller wins a slot in `resolve`: the slot's incumbent member first, then `_rank`."""
    return (not (r.node == incumbent and r.state is MemberState.MEMBER), _key(r, wall_now))


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
    """Whether a record of another node competes on `slot`: a claim by `node` would lose
    to it (a member beats a claim, and a claim already there was accepted first)."""
    held = view.winners.get(slot)
    return held is not None and held.node != node


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


def _losing(own: MemberRecord | None, view: SlotMap) -> bool:
    """Whether our own record (`own`) is a claim or member that another record beats:
    the others count us among the losers, and so do we when dealing free slots."""
    return (
        own is not None
        and own.state in _COMPETING
        and own.slot is not None
        and _blocked(view, own.slot, own.node)
    )


def _choose(
    node: str,
    view: SlotMap,
    spec: DomainSpec | None,
    previous_slot: int | None,
    *,
    losing: bool,
    dealer: SlotMap | None = None,
) -> int | None:
    """The slot rule of `preferred_slot`, given the map of the other nodes' records.

    `losing`: our own record loses a conflict in the full map (we rank among the
    losers). `dealer`: the map at the echo of our claim that just lost: free slots are
    dealt from it, after every seeker in it, unless the slot it gives is held by now.
    """
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
    if dealer is not None:
        dealt = _deal(node, dealer, spec, _LAST)
        if dealt is not None and dealt not in view.winners and dealt not in reserved:
            return dealt
    return _deal(node, view, spec, _LOSER if losing else _WAITING)


_LOSER, _WAITING, _LAST = 0, 1, 2
"""The turns of `_deal`: losers of a conflict, then standby and fresh nodes, then a
node dealing at its lost claim's echo."""


def _deal(node: str, view: SlotMap, spec: DomainSpec | None, turn: int) -> int | None:
    """The free slot of `view` that falls to `node`, whose turn is `turn` (None: none is
    left for it).

    Free slots are neither held nor reserved. They go in order to the seekers: the
    losers and standby nodes of `view`, less those that will take their own list
    position, and `node`; ordered by turn (a loser's is _LOSER, a standby node's
    _WAITING), then by name.
    """
    reserved = _reserved(view, spec, node)
    free = [s for s in range(view.max_nodes) if s not in view.winners and s not in reserved]
    rank = sum(
        1
        for n in view.losers | view.standby
        if n != node
        and ((p := _position(n, spec, view.max_nodes)) is None or _blocked(view, p, n))
        and ((_LOSER if n in view.losers else _WAITING), n) < (turn, node)
    )
    return free[rank] if rank < len(free) else None


class _Step(msgspec.Struct, frozen=True, kw_only=True):
    """The inputs of one `step`, shared by the ways it can end."""

    me: ClaimState
    own: MemberRecord | None
    """Our own record as the bus gave it back (None: none)."""
    view: SlotMap
    """The other nodes' records, resolved."""
    spec: DomainSpec | None
    previous_slot: int | None
    now: float
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
            view=self.view,
        )

    def claim(self, slot: int, reason: Reason, message: str) -> Decision:
        """Publish a fresh claim on `slot`; its echo settles it (`Echo`)."""
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
            view=self.view,
        )

    def reclaim(self, reason: Reason, message: str, *, dealer: SlotMap | None = None) -> Decision:
        """Claim the preferred slot, or wait as standby when there is none; `dealer`: the
        map at the echo of our claim that lost (`_choose`)."""
        slot = _choose(
            self.me.node,
            self.view,
            self.spec,
            self.previous_slot,
            losing=_losing(self.own, self.view),
            dealer=dealer,
        )
        if slot is not None:
            return self.claim(slot, reason, message)
        text = f"no free slot among {self.view.max_nodes}; waiting as standby"
        if message:
            text += f" ({message})"
        if reason is Reason.CLAIMED:
            reason = Reason.DOMAIN_FULL
        return self.hold(Phase.STANDBY, None, reason, text)
