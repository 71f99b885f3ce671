"""The re-read's verdict (`imexd.bus.repairs.Repairs.differences`) on versioned records.

A member record carries its writer's order: (incarnation, seq), seq counting the
records one agent run published. A clustered broker's server may serve a snapshot
older than what came live (nats-server 2.9 and 2.14 feed each server's retained map
asynchronously, and a restarted server can stay behind for a minute: docs/brokers.md),
or newer (the live update was lost while a consumer was set up). These tests drive the
verdict directly, with no broker: a snapshot is what a re-read got, `delivered` what the
link gave the agent before it.
"""

from __future__ import annotations

import time

import structlog

from imexd.bus.repairs import Repairs, Verdict
from imexd.messages import DomainSpec, MemberRecord, MemberState, encode
from imexd.topics import Topics

TOPICS = Topics("imex")
PEER = TOPICS.member("d1", "c1", "n2")
FILTER = TOPICS.members_filter("d1", "c1")
LOG = structlog.get_logger("test")


def peer(seq: int, *, incarnation: int = 3, state: MemberState = MemberState.MEMBER) -> bytes:
    return encode(
        MemberRecord(
            node="n2",
            domain="d1",
            clique="c1",
            address="10.0.0.2",
            slot=None if state is MemberState.LOST else 1,
            incarnation=incarnation,
            state=state,
            max_nodes=18,
            mode="addresses",
            settled=1.0e9 if state is MemberState.MEMBER else None,
            seq=seq,
        )
    )


def repairs(quiet_s: float) -> Repairs:
    return Repairs(
        resync_s=30.0,
        resync_quiet_s=quiet_s,
        ping_topic=TOPICS.ping("n1"),
        rand=lambda: 0.5,
        topics=TOPICS,
    )


def verdict(
    r: Repairs, snapshot: dict[str, bytes], filters: list[str] | None = None
) -> list[tuple[str, bytes]]:
    return r.differences(
        filters or [FILTER], snapshot, ours={}, published={}, started=time.monotonic(), log=LOG
    ).deliver


def test_a_reread_never_applies_an_older_copy_of_a_peer_record() -> None:
    # A restarted server's retained map lags: its copy is the peer's previous record,
    # while the link delivered the peer's latest live. No quiet time protects it here.
    r = repairs(quiet_s=0.0)
    r.delivered(PEER, peer(5))
    assert verdict(r, {PEER: peer(4)}) == []
    r.delivered(PEER, peer(1, incarnation=4))  # the peer's agent restarted
    assert verdict(r, {PEER: peer(9, incarnation=3)}) == []


def test_a_newer_copy_is_applied_at_once_even_within_the_quiet_time() -> None:
    # The live update from seq 4 to 5 was lost; the record changed a moment ago, which
    # the quiet time would protect, but the snapshot's copy is the writer's later one.
    r = repairs(quiet_s=60.0)
    r.delivered(PEER, peer(4))
    assert verdict(r, {PEER: peer(5)}) == [(PEER, peer(5))]


def test_a_copy_of_a_record_deleted_since_is_not_brought_back() -> None:
    # The peer left (its record cleared, live); a lagging server still holds its last
    # record: once the quiet time is over that copy must not come back.
    r = repairs(quiet_s=0.0)
    r.delivered(PEER, peer(5))
    r.delivered(PEER, b"")
    assert verdict(r, {PEER: peer(5)}) == []
    assert verdict(r, {PEER: peer(4)}) == []
    # A record the peer wrote after the clear (it joined again) is news.
    assert verdict(r, {PEER: peer(6)}) == [(PEER, peer(6))]


def test_a_newer_copy_of_a_record_deleted_lately_waits_for_the_quiet_time() -> None:
    # Cleared live a moment ago, and the snapshot holds a later record than the last one
    # we saw: it may be the record the peer wrote just before its clear (we missed it),
    # so the quiet time still decides.
    r = repairs(quiet_s=60.0)
    r.delivered(PEER, peer(4))
    r.delivered(PEER, b"")
    assert verdict(r, {PEER: peer(5)}) == []


def test_records_without_an_order_keep_the_quiet_time_rule() -> None:
    spec_topic = TOPICS.spec("d1")
    old, new = (
        encode(DomainSpec(domain="d1", generation=1)),
        encode(DomainSpec(domain="d1", generation=2)),
    )
    r = repairs(quiet_s=60.0)
    r.delivered(spec_topic, new)
    assert verdict(r, {spec_topic: old}, [spec_topic]) == []  # changed lately: left alone
    r = repairs(quiet_s=0.0)
    r.delivered(spec_topic, new)
    assert verdict(r, {spec_topic: old}, [spec_topic]) == [(spec_topic, old)]


def test_tombstones_and_records_of_agents_without_seq_keep_the_quiet_time_rule() -> None:
    # A Last Will is written by the broker when it fires, long after it was set: its
    # place among the writer's records is unknown, so it has no order.
    r = repairs(quiet_s=0.0)
    r.delivered(PEER, peer(5))
    lost = peer(0, state=MemberState.LOST)
    assert verdict(r, {PEER: lost}) == [(PEER, lost)]
    r = repairs(quiet_s=60.0)
    r.delivered(PEER, peer(0))  # an agent that predates seq
    assert verdict(r, {PEER: peer(0, incarnation=4)}) == []


def test_our_own_record_that_the_snapshot_lacks_is_published_again_never_deleted() -> None:
    """Seen on nats-server 2.14.0 after a server kill: the server logged "unable to store
    retained message ... timeout after 5s" for a late joiner's member record; its re-reads
    delivered the record's absence as a clear, the membership took it for a write by
    another agent ("cleared it", `record_overwritten`) and, on the second, judged a
    duplicate node and stepped out. A record this link published, that came back to us
    and that no live clear followed, is one the broker lost: it goes out again, and the
    view is told nothing. A clear by anyone else comes live (it is delivered as usual)."""
    own = TOPICS.member("d1", "c1", "n1")
    record = peer(3).replace(b'"n2"', b'"n1"')
    r = repairs(quiet_s=0.0)

    def reread() -> Verdict:
        return r.differences(
            [FILTER],
            {PEER: peer(1)},
            ours={},
            published={own: record},
            started=time.monotonic(),
            log=LOG,
        )

    r.delivered(own, record)
    lost = reread()
    assert lost.republish == [own]
    assert (own, b"") not in lost.deliver
    # After a live clear (someone else's, or ours) the snapshot's word stands.
    r.delivered(own, b"")
    cleared = reread()
    assert own not in cleared.republish
