"""The order of the control plane's records (imexd.order): any interleaving, repetition,
replay and loss of versions and tombstones ends in the newest, on readers and, through
the anti-entropy pass, on the broker."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from imexd.messages import Assignment, DomainSpec, Retry, WorkloadRecord, encode, tombstone
from imexd.order import (
    Order,
    Verdict,
    Version,
    first_generation,
    next_generation,
    version,
)

TOPICS = ("t/a", "t/b", "t/c")

versions = st.builds(
    Version,
    generation=st.integers(min_value=0, max_value=6),
    tombstone=st.booleans(),
    data=st.sampled_from([b"x", b"y", b"z"]),
)
offers = st.lists(st.tuples(st.sampled_from(TOPICS), versions), max_size=30)


def newest(seen: list[tuple[str, Version]]) -> dict[str, Version]:
    out: dict[str, Version] = {}
    for topic, v in seen:
        if topic not in out or v.rank > out[topic].rank:
            out[topic] = v
    return out


@given(offers, st.randoms(use_true_random=False), st.lists(st.sampled_from(TOPICS)))
def test_a_reader_ends_on_the_newest_version_whatever_the_order(
    seen: list[tuple[str, Version]], rnd: random.Random, clears: list[str]
) -> None:
    """Offered in any order, with repeats and clears among them, a reader holds the newest
    version of each topic."""
    stream: list[tuple[str, Version | None]] = [*seen, *seen[: len(seen) // 2]]
    stream += [(t, None) for t in clears]
    rnd.shuffle(stream)
    order = Order()
    for topic, v in stream:
        if v is None:
            order.cleared(topic)
        else:
            order.offer(topic, v)
    assert order.held == newest(seen)


@given(offers)
def test_two_readers_offered_the_same_versions_hold_the_same(
    seen: list[tuple[str, Version]],
) -> None:
    """The order is total: two readers given one set of versions in opposite orders agree."""
    a, b = Order(), Order()
    for topic, v in seen:
        a.offer(topic, v)
    for topic, v in reversed(seen):
        b.offer(topic, v)
    assert a.held == b.held


def test_the_verdicts() -> None:
    """Newer is applied, the same bytes are nothing, older is stale, a clear removes
    nothing and a tombstone wins a tie."""
    order = Order()
    two = Version(2, False, b"two")
    assert order.offer("t", two) is Verdict.NEW
    assert order.offer("t", two) is Verdict.SAME
    assert order.offer("t", Version(1, False, b"one")) is Verdict.STALE
    assert order.cleared("t")
    assert order.held["t"] == two
    assert order.offer("t", Version(2, True, b"gone")) is Verdict.NEW
    assert order.offer("t", two) is Verdict.STALE
    assert not order.cleared("other")


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[list[tuple[str, Version]]], list[str]]:
    """What each of three readers saw (each loses some), and the broker's faults."""
    seen = draw(offers)
    readers = [[o for o in seen if draw(st.booleans())] for _ in range(3)]
    faults = draw(st.lists(st.sampled_from(["empty", "stale", "replay"]), max_size=4))
    return readers, faults


@settings(max_examples=200)
@given(histories(), st.randoms(use_true_random=False))
def test_the_anti_entropy_pass_gives_the_broker_the_newest_back(
    history: tuple[list[list[tuple[str, Version]]], list[str]], rnd: random.Random
) -> None:
    """Whatever each reader lost, and whether the broker comes back empty, from an older
    snapshot or with old versions replayed onto it, one pass per reader after its
    reconnect (and the answers to stale copies) leaves the broker serving, on every
    topic, the newest version any reader held, and every reader holding it."""
    seen, faults = history
    readers = [Order() for _ in seen]
    broker: dict[str, Version] = {}
    snapshots: list[dict[str, Version]] = [{}]
    for reader, records in zip(readers, seen, strict=True):
        for topic, v in records:
            reader.offer(topic, v)
            if v.newer(broker.get(topic)):
                broker[topic] = v
            snapshots.append(dict(broker))
    everything = [o for records in seen for o in records]
    for fault in faults:
        if fault == "empty":
            broker = {}
        elif fault == "stale":
            broker = dict(rnd.choice(snapshots))
        elif everything:
            topic, v = rnd.choice(everything)
            broker[topic] = v  # an older copy published again, as a replay would
    # Each reader reconnects: the snapshot, then its pass; what it publishes reaches all.
    pending: list[tuple[str, Version]] = []
    for reader in readers:
        reader.link_up()
        for topic in TOPICS:
            if topic in broker:
                reader.offer(topic, broker[topic])
            else:
                reader.cleared(topic)
        pending += reader.due(TOPICS)
        while pending:
            topic, v = pending.pop(0)
            broker[topic] = v  # a retained publish replaces what the broker held
            for other in readers:
                if other.offer(topic, v) is Verdict.STALE:
                    pending.append((topic, other.held[topic]))
    want = newest(everything)
    assert broker == want
    assert all(r.held == want for r in readers)


def test_versions_of_the_control_planes_records() -> None:
    """Each record's generation and tombstone, and nothing for other payloads."""
    spec = DomainSpec(domain="d1", generation=7, state="deleted", at=5.0)
    got = version(spec, encode(spec))
    assert got is not None
    assert (got.generation, got.tombstone, got.at) == (7, True, 5.0)
    assert tombstone(Assignment(domain=None))
    assert not tombstone(Assignment(domain="d1"))
    assert tombstone(Retry(node="n1", domain="d1", at=1.0, state="done"))
    assert tombstone(WorkloadRecord(workload="w", domain="d1", channel=1, state="deleted"))
    assert not tombstone(WorkloadRecord(workload="w", domain="d1", channel=1, state="claiming"))


def test_generations_start_at_the_clock_and_count_up() -> None:
    """A record on an empty topic starts at the Unix second; a later one counts up."""
    assert first_generation(1_700_000_000.7) == 1_700_000_000
    assert next_generation(None, 1_700_000_000.7) == 1_700_000_000
    assert next_generation(41) == 42
