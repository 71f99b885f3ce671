"""How the records of a shard come and go: records received, cleared, ended by a will.

`RecordEvents` is the layer of `ShardView` (imexd.membership.shard) that takes member
records, specs and presences off the bus into the book of the shard's records (`Peers`):
a record is taken only when it is newer than what we hold (`Peers.newer`); a Last Will,
on a member topic or as a presence, keeps the node's previous record for its hold_s and
then drops it; a clear drops it at once. A record on our own topic goes on to our own
record's lifecycle (`OwnRecord._on_own`).
"""

from __future__ import annotations

import msgspec

from imexd.membership.namesake import Identity
from imexd.membership.own import OwnRecord
from imexd.messages import (
    MAX_HOLD_S,
    Deleted,
    DomainSpec,
    MemberRecord,
    MemberState,
    Presence,
    Received,
    ended,
    lost_record,
    presence_end,
    version,
)
from imexd.topics import TopicRef


class RecordEvents(OwnRecord):
    """The bus events that change the shard's records, its spec and its wills."""

    def _on_received(self, event: Received, now: float) -> Identity | None:
        ref, payload = event.ref, event.payload
        if ref.kind == "presence" and isinstance(payload, Presence):
            return self._on_presence(event, payload, now)
        if ref.kind == "member" and isinstance(payload, MemberRecord):
            ours = ref.node == self.node  # judged whatever its version: ours goes back over it
            here = (ref.domain, ref.clique) == self.current
            if here and ours and payload.state is not MemberState.LOST:
                self.past_stands = self.past_stands or not self._foreign(payload)
            if here and ours and self.peers.ended_by_will(payload, self.own_end):
                # Ours, which our will ended: we claim again, not resume it. Given live (a
                # replay: our own echoes come after any end we know of), it is written
                # over ours all the same, and ours goes back over it.
                if event.retained:
                    return None
                return self._on_own(payload, live=True, now=now)
            if here and not self.peers.newer(payload) and not ours:
                if version(payload) == self.peers.versions.get(ref.node):
                    if payload.state is MemberState.LOST and ref.node in self.peers.records:
                        # The will we hold, given again: it still ends the record (one
                        # restored unproven when a link ended before a round trip).
                        return self._on_lost(event, payload, now)
                    self.peers.unconfirmed.discard(ref.node)  # what we hold, given again
                return None
            if (ref.domain, ref.clique) == self.current and payload.state is MemberState.LOST:
                return self._on_lost(event, payload, now)
            if (ref.domain, ref.clique) == self.current:
                self.peers.put(ref.node, payload, retained=event.retained, now=now)
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

    def _on_deleted(self, event: Deleted, now: float, *, will: bool = False) -> Identity | None:
        """A record cleared (an empty topic: no version, so what comes next is taken in
        order), or dropped by a will (`will`: its version stays)."""
        ref = event.ref
        if ref.kind == "member" and (ref.domain, ref.clique) == self.current:
            if not will:
                self.peers.versions.pop(ref.node, None)
                self.past_stands = self.past_stands and ref.node != self.node
            record = self.peers.drop(ref.node)
            if record is not None and ref.node != self.node:
                self.peers.unprove(record)
            if ref.node == self.node:
                if self.names.duplicate:
                    return self.names.gone()
                return self._on_own(None, live=not event.retained, now=now)
        elif ref.kind == "spec" and self.current and ref.domain == self.current[0]:
            self.spec = None
        return None

    def _on_lost(self, event: Received, tombstone: MemberRecord, now: float) -> Identity | None:
        """A node's Last Will (state lost), newer than its records here (`Peers.newer`): keep
        its previous record for its hold_s, unproven like a deletion until a round trip
        after it (`Peers.hold`).

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
        if node not in self.peers.records:
            return None
        hold = min(max(tombstone.hold_s, 0.0), MAX_HOLD_S)
        self.peers.unconfirmed.discard(node)
        if hold <= 0.0:
            retained = event.retained
            return self._on_deleted(
                Deleted(event.topic, event.ref, retained=retained), now, will=True
            )
        if node not in self.peers.lost:
            self.peers.hold(node, now + hold)
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
        if ours and presence.incarnation < self.started_as:
            self.last_run = max(self.last_run, presence.incarnation)
        if ours and (end := presence_end(presence)) is not None:
            # Kept across shards: our record may come after it in a snapshot, or in the
            # shard we join next (`Peers.ended_by_will`).
            self.own_end = end if self.own_end is None else max(self.own_end, end)
        held = self.peers.records.get(presence.node)
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
