"""The records of a shard's nodes as this agent holds them, and how long it keeps each.

`Peers` is the book that `ShardView` keeps of its shard's member records (ours among
them): the newest version taken in per node, which records came from a snapshot, which a
new link has not confirmed yet, which a will or a clear dropped without a round trip
proving it, which a will holds for its hold_s, since when each claim has stood, and which
member has held its slot first (incumbency). It decides nothing about our own claim; the
view asks it what stands.
"""

from __future__ import annotations

from typing import Final

import structlog

from imexd.membership import slots as mb
from imexd.membership.claim import Echo
from imexd.messages import LINK_END, DomainSpec, MemberRecord, MemberState, Version, version

CONFIRM_MARGIN_S: Final = 2.0
"""Added to [bus] reconnect_max_s: a peer's connect and replay after its last backoff."""


class Peers:
    """The member records of one shard, with what this view knows about each."""

    def __init__(
        self,
        *,
        node: str,
        max_nodes: int,
        claim_stale_s: float,
        confirm_grace_s: float,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.node = node
        """This agent's node: its record is in the book, but it is no peer."""
        self.max_nodes = max_nodes
        self.claim_stale_s = claim_stale_s
        self.confirm_grace_s = confirm_grace_s
        """How long a record missing from a new link's snapshot is kept: after a broker
        restart every live peer reconnects within its capped reconnect backoff and
        re-publishes its record; a record still missing after that is gone."""
        self.log = log
        self.records: dict[str, MemberRecord] = {}
        self.snapshot_records: set[str] = set()
        """Nodes whose record we hold came from a snapshot (retained), not live (`found`)."""
        self.unconfirmed: set[str] = set()
        """Nodes whose records come from a previous link and were not seen again yet: always
        a subset of `records` (whatever drops a record drops it here too)."""
        self.confirm_by: float | None = None
        """`now` after which the unconfirmed records are dropped."""
        self.versions: dict[str, Version] = {}
        """Peer or us -> the newest version (`messages.version`) of a record or Last Will
        taken in for it: anything not newer is not applied (`newer`)."""
        self.unproven: dict[str, tuple[MemberRecord, int]] = {}
        """Peers' records dropped on this link (a clear, a will), or held by a will for its
        hold_s (`lost`), that no round trip through the broker has come back after yet,
        with the deletion's mark (`proof_mark`). A link that ends first may have ended with
        a broker that shut down (it publishes every will, then closes the links): they
        come back, unconfirmed (`restore_unproven`)."""
        self.deletions = 0
        """Deletions taken in so far: the mark of the last one."""
        self.lost: dict[str, float] = {}
        """Peers whose tombstone (state lost) came: `now` at which their previous record,
        kept in `records` meanwhile, is dropped."""
        self.claims_seen: dict[str, tuple[tuple[int, int | None], float]] = {}
        """Peers' claiming records: (incarnation, slot) and `now` first seen, so that
        claims which never settle stop counting after claim_stale_s."""
        self.incumbents: dict[int, str] = {}
        """slot -> the node whose member record has stood there first in this view,
        kept across a reconnect while that record comes back unchanged, forgotten when
        it leaves or changes slot or is dropped (`mb.resolve(incumbents=...)`)."""
        self.before: dict[str, MemberRecord] = {}
        """The records held when the last link ended (`reconnected`)."""

    def clear(self) -> None:
        """A new shard: nothing of the old one's records counts."""
        self.records.clear()
        self.snapshot_records.clear()
        self.unconfirmed.clear()
        self.confirm_by = None
        self.versions.clear()
        self.unproven.clear()
        self.lost.clear()
        self.claims_seen.clear()
        self.incumbents.clear()
        self.before.clear()

    def reconnected(self) -> None:
        """A new link: every record held is unconfirmed until the link gives it again.

        Kept meanwhile: a broker that restarted without its retained state gets them back
        only as the peers reconnect, and dropping them would rewrite the hosts block and
        send SIGUSR1 twice for a membership that never changed.
        """
        self.unconfirmed = set(self.records)
        self.confirm_by = None
        self.before = dict(self.records)

    def synced(self, now: float) -> None:
        """The new link's snapshot is in: what it did not confirm has its grace from now."""
        if self.unconfirmed and self.confirm_by is None:
            self.confirm_by = now + self.confirm_grace_s

    def due_at(self, now: float) -> list[float]:
        """The times at which the book changes without an event: the end of the grace for
        unconfirmed records, and each peer's claim turning stale."""
        due = [self.confirm_by] if self.confirm_by is not None else []
        return due + [
            at + self.claim_stale_s
            for _, at in self.claims_seen.values()
            if at + self.claim_stale_s > now
        ]

    # -- taking records in ----------------------------------------------------------

    def newer(self, record: MemberRecord) -> bool:
        """Whether `record` (of the current shard) is newer than what we took in for its
        node, and if so keep its version: a record or will not newer is a copy, a replay
        or an earlier link's will, and changes nothing. A record without a place (an agent
        that predates it) is taken in its order of arrival, as is what follows it.

        The record we took in last, given again while we no longer hold it, counts as
        new: a new link dropped it unconfirmed (`drop_unconfirmed`, which keeps its
        version), and it stands on the broker after all. Every other way a record goes
        either forgets its version (a clear) or holds a later one (a will)."""
        new, held = version(record), self.versions.get(record.node)
        if new is None:
            self.versions.pop(record.node, None)
            return True
        if held is not None and (new < held or (new == held and record.node in self.records)):
            return False
        self.versions[record.node] = new
        return True

    def ended_by_will(self, record: MemberRecord, own_end: Version | None) -> bool:
        """Whether the version we hold for `record`'s node is a will that ends it (for our
        own node also `own_end`, the end our presence said)."""
        held, new = self.versions.get(record.node), version(record)
        if held is not None and held[2] != LINK_END:
            held = None
        if record.node == self.node and own_end is not None:
            held = own_end if held is None else max(held, own_end)
        return held is not None and (new is None or new < held)

    def put(self, node: str, record: MemberRecord, *, retained: bool, now: float) -> None:
        """Hold `record` as `node`'s record: it stands, confirmed, and no will holds it."""
        before = self.records.get(node)
        if node in self.unconfirmed and before is not None and before != record:
            # Changed while our link was down: we did not see it stand unbroken.
            self.forget_incumbent(node)
        self.records[node] = record
        if retained:
            self.snapshot_records.add(node)
        else:
            self.snapshot_records.discard(node)
        self.lost.pop(node, None)
        self.unconfirmed.discard(node)
        self.track_claim(record, now)

    def drop(self, node: str) -> MemberRecord | None:
        """Drop `node`'s record (cleared, or its will's hold ran out): the one it was."""
        record = self.records.pop(node, None)
        self.lost.pop(node, None)
        self.unconfirmed.discard(node)
        self.claims_seen.pop(node, None)
        return record

    def track_claim(self, record: MemberRecord, now: float) -> None:
        """Remember since when each peer's claim (incarnation, slot) has stood unchanged."""
        if record.node == self.node or record.state is not MemberState.CLAIMING:
            self.claims_seen.pop(record.node, None)
            return
        key = (record.incarnation, record.slot)
        seen = self.claims_seen.get(record.node)
        if seen is None or seen[0] != key:
            self.claims_seen[record.node] = (key, now)

    # -- what stands ----------------------------------------------------------------

    def followed(self) -> frozenset[str]:
        """The peers whose presence the agent follows: those it holds a record of in the
        current shard, since their Last Will is their presence (`messages.Presence`)."""
        return frozenset(n for n in self.records if n != self.node)

    def found(self) -> frozenset[str]:
        """The followed peers whose record came from a snapshot, not live: only such a
        record can be a dead node's (a live one has a live writer), so a step that may
        claim waits for their presence, and for no other."""
        return frozenset(n for n in self.snapshot_records if n in self.records and n != self.node)

    def stale(self, now: float) -> frozenset[str]:
        """The peers whose claims stood unchanged for claim_stale_s (they do not count)."""
        return mb.stale_claims(
            self.records.values(),
            {node: at for node, (_, at) in self.claims_seen.items()},
            now=now,
            stale_after_s=self.claim_stale_s,
            me=self.node,
        )

    def barrier(self, slot: int, spec: DomainSpec | None, now: float) -> Echo:
        """What stands on `slot` against our claim now (`mb.barrier`)."""
        return mb.barrier(
            self.node,
            slot,
            self.records.values(),
            max_nodes=self.max_nodes,
            spec=spec,
            stale=self.stale(now),
        )

    def rival(self, slot: int, spec: DomainSpec | None, now: float) -> MemberRecord | None:
        """The record of another node that competes on `slot` and may have taken it while
        our link was down: not one a previous link left unconfirmed, nor a claim held
        unchanged since the last link ended (a claim settles only by a new record, so that
        one settled nothing meanwhile; a broker that restarted from its disk can give it
        back beside our claim, our member record lost)."""
        confirmed = [
            r
            for n, r in self.records.items()
            if n not in self.unconfirmed
            and not (r.state is MemberState.CLAIMING and self.before.get(n) == r)
        ]
        return mb.barrier(
            self.node,
            slot,
            confirmed,
            max_nodes=self.max_nodes,
            spec=spec,
            stale=self.stale(now),
        ).rival

    def seat_incumbents(self, spec: DomainSpec | None) -> None:
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
                and mb.allowed(node, spec)
            ):
                on.setdefault(record.slot, []).append(node)
        for slot, nodes in on.items():
            if slot not in self.incumbents and len(nodes) == 1 and nodes[0] not in self.unconfirmed:
                self.incumbents[slot] = nodes[0]

    def forget_incumbent(self, node: str) -> None:
        """`node` no longer holds a slot first in this view (its record changed unseen)."""
        for slot in [s for s, n in self.incumbents.items() if n == node]:
            del self.incumbents[slot]

    # -- records that go ------------------------------------------------------------

    def drop_lost(self, now: float) -> None:
        """Drop the peers whose tombstone's hold ran out, as if their records were cleared."""
        gone = sorted(node for node, until in self.lost.items() if now >= until)
        for node in gone:
            record = self.drop(node)
            if record is not None:
                self.unprove(record)
        if gone:
            self.log.info("membership.records_gone", nodes=gone, why="lost: hold_s passed")

    def drop_unconfirmed(self, now: float) -> list[str]:
        """Forget the records a new link did not confirm in time, or whose slot moved on;
        the nodes whose records went.

        Another node's confirmed record on the slot of an unconfirmed one supersedes it at
        once: the slot was freed and taken while this node was away. Our own says nothing
        of the others (a broker restored from its disk gives back our claim as it stood).
        """
        if not self.unconfirmed:
            self.confirm_by = None
            return []
        expired = self.confirm_by is not None and now >= self.confirm_by
        taken = {
            r.slot
            for node, r in self.records.items()
            if node not in self.unconfirmed and node != self.node and r.slot is not None
        }
        gone = sorted(
            node for node in self.unconfirmed if expired or self.records[node].slot in taken
        )
        if not gone:
            return []
        self.log.info(
            "membership.records_gone", nodes=gone, why="not re-published after a reconnect"
        )
        for node in gone:
            self.records.pop(node, None)
            self.lost.pop(node, None)
            self.unconfirmed.discard(node)
        if not self.unconfirmed:
            self.confirm_by = None
        return gone

    def hold(self, node: str, until: float) -> None:
        """A will of `node` keeps its record until `until`, then drops it (`drop_lost`):
        a deletion to come, unproven as one until a round trip after it."""
        self.lost[node] = until
        self.unprove(self.records[node])

    def unprove(self, record: MemberRecord) -> None:
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

    def restore_unproven(self) -> None:
        """The link ended before a round trip came back after these deletions.

        A broker that shuts down publishes every client's will, ignoring the Will Delay,
        and then closes the links: those wills say nothing about the peers, which come
        back with the broker. The records return unconfirmed, as after any reconnect,
        whether dropped or still held by a will: their nodes publish newer ones, or the
        grace for a new link drops them. A deletion that a round trip proved never comes
        back this way, nor a record that a newer one replaced since.
        """
        restored = sorted(n for n in self.unproven if n not in self.records or n in self.lost)
        for node in restored:
            self.records.setdefault(node, self.unproven[node][0])
            self.lost.pop(node, None)
            self.unconfirmed.add(node)
        self.unproven.clear()
        if restored:
            self.log.info(
                "membership.deletions_unproven",
                nodes=restored,
                why="the link ended before a round trip through the broker came back "
                "after them (a broker shutting down publishes every will first)",
            )
