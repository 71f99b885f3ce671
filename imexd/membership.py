"""Slots inside one (domain, clique): who holds which, and what this node does next.

Pure: no I/O, no asyncio, no clocks. The agent keeps the retained member records of
its (domain, clique) shard, one per node, and calls these functions on every change and
on the timer that `Decision.wake_at` asks for; time comes in as `now`.

The conflict rule (`resolve`)
    Only `claiming` and `member` records with a slot below max_nodes compete. On each
    slot the winner is the record with the smallest key `(state is not member, node)`:
    a member beats a claim, and between two claims, or two members after a partition
    healed, the lower node name wins. The key is a total order over the records of
    distinct nodes, so every node that holds the same records computes the same map,
    whatever order they arrived in. A DomainSpec that lists nodes is an allow-list:
    records of other nodes take no part.

Claiming (`step`)
    After the retained snapshot a node publishes `claiming` for its preferred slot. The
    claim settles into `member` once the node's own record came back from the broker
    (so the broker holds it and every subscriber will receive it) and `settle_s` passed
    with no record on the slot that beats it. Only then does the agent start its daemon.
    A claim that is beaten is given up at once for another slot; a node that finds no
    slot waits as `standby` and claims again when a slot frees. A member never yields to
    a claim: it yields only to a lower-named member on the same slot, which exists only
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
    and loses to it (a member beats a claim). Two members on one slot therefore need a
    partition (or a broker that lost its retained state); then the lower name keeps the
    slot and the other claims again, which is the only case where a member moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from imexd.wire import DomainSpec, MemberRecord, MemberState, Mode, encode

_COMPETING = frozenset({MemberState.CLAIMING, MemberState.MEMBER})


class Phase(StrEnum):
    """Where this node's own claim stands (what it last published)."""

    NONE = "none"
    """Nothing published yet: just started, or not yet synced."""
    CLAIMING = "claiming"
    MEMBER = "member"
    STANDBY = "standby"
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


_RECORD_STATE: Mapping[Phase, MemberState | None] = {
    Phase.NONE: None,
    Phase.CLAIMING: MemberState.CLAIMING,
    Phase.MEMBER: MemberState.MEMBER,
    Phase.STANDBY: MemberState.STANDBY,
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

    @property
    def record_state(self) -> MemberState | None:
        """The `state` of the record to publish; None: clear the record (empty payload)."""
        return _RECORD_STATE[self.phase]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotMap:
    """The resolved shard: who wins each slot, and who is left waiting."""

    max_nodes: int
    winners: Mapping[int, MemberRecord]
    """slot -> the winning record (member or claim), in slot order."""
    losers: frozenset[str]
    """Nodes whose claim or member record lost its slot: they must claim again."""
    standby: frozenset[str]
    """Allowed nodes waiting in state standby."""
    ignored: frozenset[str]
    """Nodes outside the spec's allow-list, whose records take no part."""

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
) -> list[str]:
    """Nodes whose max_nodes or mode differ from ours, sorted (NodeMapMismatch).

    Leaving nodes and nodes outside the allow-list never enter the node list, so they
    cannot make it differ and are not reported.
    """
    return sorted(
        r.node
        for r in _latest(records).values()
        if r.state is not MemberState.LEAVING
        and allowed(r.node, spec)
        and not compatible(r, max_nodes=max_nodes, mode=mode)
    )


def resolve(
    records: Iterable[MemberRecord], *, max_nodes: int, spec: DomainSpec | None = None
) -> SlotMap:
    """Apply the conflict rule: the same records give the same map on every node.

    Several records of one node (the caller normally keeps one) are reduced to the
    newest, ties broken by content, so the arrival order never matters.
    """
    winners: dict[int, MemberRecord] = {}
    losers: set[str] = set()
    standby: set[str] = set()
    ignored: set[str] = set()
    for r in _latest(records).values():
        if not allowed(r.node, spec):
            ignored.add(r.node)
        elif r.state is MemberState.STANDBY:
            standby.add(r.node)
        elif r.state in _COMPETING and r.slot is not None and r.slot < max_nodes:
            held = winners.get(r.slot)
            if held is None:
                winners[r.slot] = r
            elif _key(r) < _key(held):
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
    )


def preferred_slot(
    node: str,
    records: Iterable[MemberRecord],
    *,
    max_nodes: int,
    spec: DomainSpec | None = None,
    previous_slot: int | None = None,
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
    return _choose(node, resolve(others, max_nodes=max_nodes, spec=spec), spec, previous_slot)


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
) -> Decision:
    """Advance our own claim by one step, from the records of our shard.

    Call it only once the retained snapshot was received, then on every record change
    and at `wake_at`. `records` may include our own record: it is how the echo is seen.
    """
    latest = _latest(records)
    own = latest.pop(me.node, None)
    view = resolve(latest.values(), max_nodes=max_nodes, spec=spec)
    at = _Step(me=me, view=view, spec=spec, previous_slot=previous_slot, now=now, settle_s=settle_s)

    if not allowed(me.node, spec):
        return at.hold(Phase.OUT, None, Reason.NOT_IN_SPEC, "not in the spec's node list")

    if me.phase is Phase.MEMBER and me.slot is not None:
        rival = view.winners.get(me.slot)
        if rival is None or not _beats(rival, MemberState.MEMBER, me.node):
            return at.hold(Phase.MEMBER, me.slot, Reason.SETTLED, f"slot {me.slot}")
        return at.reclaim(
            Reason.PARTITION_HEALED, f"member {rival.node} also holds slot {me.slot}, lower name"
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
        and not _beats(view.winners.get(own.slot), MemberState.MEMBER, me.node)
    ):
        # Our previous run's member record is still retained (restart or hand-over
        # inside the will delay): keep the slot without a claim, so that peers see no
        # change and the running daemon can be adopted.
        return at.hold(Phase.MEMBER, own.slot, Reason.RESUMED, f"slot {own.slot} (resumed)")

    return at.reclaim(Reason.CLAIMED, "")


def desired_hosts(slot_map: SlotMap) -> dict[int, str | None]:
    """Every slot 0..max_nodes-1 -> its member's address, or None (names mode).

    Claims are left out: a node enters the files only once it is a member.
    """
    members = slot_map.members
    return {s: (members[s].address if s in members else None) for s in range(slot_map.max_nodes)}


def desired_addresses(slot_map: SlotMap) -> list[str]:
    """Member addresses in slot order: nodes_config.cfg in addresses mode."""
    return [r.address for _, r in sorted(slot_map.members.items())]


# Internals


def _key(r: MemberRecord) -> tuple[bool, str]:
    """Smaller wins a slot: members before claims, then the lower node name."""
    return (r.state is not MemberState.MEMBER, r.node)


def _beats(rival: MemberRecord | None, state: MemberState, node: str) -> bool:
    """Whether `rival` wins a slot against a record of ours in `state`."""
    return rival is not None and _key(rival) < (state is not MemberState.MEMBER, node)


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

    def hold(
        self,
        phase: Phase,
        slot: int | None,
        reason: Reason,
        message: str,
        *,
        wake_at: float | None = None,
    ) -> Decision:
        """Hold (phase, slot): published only when it differs from what we hold now."""
        me = self.me
        changed = (phase, slot) != (me.phase, me.slot)
        claim = ClaimState(
            node=me.node,
            incarnation=me.incarnation,
            phase=phase,
            slot=slot,
            since=self.now if changed else me.since,
        )
        return Decision(
            claim=claim,
            publish=changed,
            settled=phase is Phase.MEMBER,
            reason=reason,
            message=message,
            wake_at=wake_at,
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
