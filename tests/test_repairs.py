"""The re-read's verdict (`imexd.bus.repairs.Repairs.differences`) on versioned records.

Every record carries its writer's order (`imexd.bus.repairs.place`): a member record
(incarnation, link, seq), a will the link it ends, a control-plane record its
generation. A clustered broker's server may serve a snapshot older than what came live
(nats-server 2.9 and 2.14 feed each server's retained map asynchronously, and a
restarted server can stay behind for a minute: docs/brokers.md), or newer (the live
update was lost while a consumer was set up). These tests drive the verdict directly,
with no broker: a snapshot is what a re-read got, `delivered` what the link gave the
agent before it.
"""

from __future__ import annotations

import time

import structlog

from imexd.bus.repairs import Repairs, Verdict
from imexd.messages import DomainSpec, MemberRecord, MemberState, encode
from imexd.topics import Topics

TOPICS = Topics("imex")
PEER = TOPICS.member("d1", "c1", "n2")
OTHER = TOPICS.member("d1", "c1", "n3")
FILTER = TOPICS.members_filter("d1", "c1")
LOG = structlog.get_logger("test")


def peer(
    seq: int,
    *,
    incarnation: int = 3,
    state: MemberState = MemberState.MEMBER,
    link: int = 1,
    node: str = "n2",
) -> bytes:
    return encode(
        MemberRecord(
            node=node,
            domain="d1",
            clique="c1",
            address="10.0.0.2" if node == "n2" else "10.0.0.3",
            link=link,
            slot=None if state is MemberState.LOST else (1 if node == "n2" else 2),
            incarnation=incarnation,
            state=state,
            max_nodes=18,
            mode="addresses",
            settled=1.0e9 if state is MemberState.MEMBER else None,
            seq=seq,
        )
    )


def repairs() -> Repairs:
    return Repairs(
        resync_s=30.0,
        ping_topic=TOPICS.ping("n1"),
        rand=lambda: 0.5,
        topics=TOPICS,
    )


def verdict(
    r: Repairs, snapshot: dict[str, bytes], filters: list[str] | None = None
) -> list[tuple[str, bytes]]:
    return r.differences(filters or [FILTER], snapshot, ours={}, published={}, log=LOG).deliver


def test_a_reread_never_applies_an_older_copy_of_a_peer_record() -> None:
    # A restarted server's retained map lags: its copy is the peer's previous record,
    # while the link delivered the peer's latest live.
    r = repairs()
    r.delivered(PEER, peer(5))
    assert verdict(r, {PEER: peer(4)}) == []
    r.delivered(PEER, peer(1, incarnation=4))  # the peer's agent restarted
    assert verdict(r, {PEER: peer(9, incarnation=3)}) == []


def test_a_newer_copy_is_applied_at_once() -> None:
    # The live update from seq 4 to 5 was lost: however recently the record changed, the
    # snapshot's copy is the writer's later one.
    r = repairs()
    r.delivered(PEER, peer(4))
    assert verdict(r, {PEER: peer(5)}) == [(PEER, peer(5))]


def test_a_copy_of_a_record_cleared_since_comes_back_only_on_second_sight() -> None:
    # The peer left (its record cleared, live); a lagging server still holds its last
    # record, or one the peer wrote just before its clear that we missed. A clear has no
    # order, so one re-read's word brings nothing back; a second that says the same, with
    # nothing live on the topic in between, is a clear the broker lost, and stands.
    r = repairs()
    r.delivered(PEER, peer(5))
    r.delivered(PEER, b"")
    assert verdict(r, {PEER: peer(5)}) == []
    assert verdict(r, {PEER: peer(6)}) == []  # another copy: doubted afresh
    r.intercept(PEER, peer(6), retained=False)  # live on the topic: it starts over
    r.subscribed([FILTER])  # the next re-read subscribes again
    assert verdict(r, {PEER: peer(6)}) == []
    assert verdict(r, {PEER: peer(6)}) == [(PEER, peer(6))]


def test_a_record_the_snapshot_lacks_is_deleted_on_the_second_reread() -> None:
    # A lagging server's snapshot lacks what was just published; a clear lost live stays
    # lost. Seen missing twice, with nothing live on the topic in between, it is gone;
    # a live message in between starts over; the second re-read is due at once.
    r = repairs()
    r.link_up()
    r.delivered(PEER, peer(5))
    r.begin([FILTER])
    assert verdict(r, {OTHER: peer(1, node="n3")}) == [(OTHER, peer(1, node="n3"))]
    r.end()
    assert r.due() < time.monotonic() + 30 * 0.75  # the follow-up, before the periodic one
    r.delivered(OTHER, peer(1, node="n3"))
    assert verdict(r, {OTHER: peer(1, node="n3")}) == [(PEER, b"")]
    r.delivered(PEER, b"")
    r.delivered(PEER, peer(6))  # it came back live
    assert verdict(r, {OTHER: peer(1, node="n3")}) == []  # missing once
    r.intercept(PEER, peer(7), retained=False)  # live: what the snapshot said is old news
    r.delivered(PEER, peer(7))
    r.subscribed([FILTER])  # the next re-read subscribes again
    assert verdict(r, {OTHER: peer(1, node="n3")}) == []  # missing once again
    assert verdict(r, {OTHER: peer(1, node="n3")}) == [(PEER, b"")]


def test_control_plane_records_are_judged_by_their_generation() -> None:
    # A lagging snapshot's older spec changes nothing, a newer one is applied at once, a
    # tombstone of the same generation outranks the record; generation 0 (a writer that
    # predates it) has no order, and the snapshot's copy stands.
    spec_topic = TOPICS.spec("d1")

    def spec(generation: int, state: str = "active") -> bytes:
        return encode(DomainSpec(domain="d1", generation=generation, state=state))  # type: ignore[arg-type]

    r = repairs()
    r.delivered(spec_topic, spec(2))
    assert verdict(r, {spec_topic: spec(1)}, [spec_topic]) == []
    assert verdict(r, {spec_topic: spec(3)}, [spec_topic]) == [(spec_topic, spec(3))]
    deleted = spec(2, "deleted")
    assert verdict(r, {spec_topic: deleted}, [spec_topic]) == [(spec_topic, deleted)]
    r = repairs()
    r.delivered(spec_topic, spec(0))
    assert verdict(r, {spec_topic: spec(0, "deleting")}, [spec_topic]) == [
        (spec_topic, spec(0, "deleting"))
    ]


def test_a_will_is_ordered_after_its_link_and_before_the_next() -> None:
    # A Last Will ends its link: a lagging snapshot's will of an earlier link changes
    # nothing, the will of the link we hold a record of is news.
    r = repairs()
    r.delivered(PEER, peer(5, link=2))
    assert verdict(r, {PEER: peer(0, state=MemberState.LOST, link=1)}) == []
    lost = peer(0, state=MemberState.LOST, link=2)
    assert verdict(r, {PEER: lost}) == [(PEER, lost)]
    r = repairs()
    r.delivered(PEER, peer(0))  # an agent that predates seq: no order, the snapshot stands
    assert verdict(r, {PEER: peer(0, incarnation=4)}) == [(PEER, peer(0, incarnation=4))]


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
    r = repairs()

    def reread() -> Verdict:
        return r.differences(
            [FILTER],
            {PEER: peer(1)},
            ours={},
            published={own: record},
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
