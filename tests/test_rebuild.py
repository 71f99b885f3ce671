"""The rebuild's decision (imexd.agent.rebuild): pure, driven by bus events, no broker."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from imexd.agent.rebuild import TASK, Held, Outcome, Rebuild, Rebuilder, Verdict, decide, verdict
from imexd.bus.events import Connected, Disconnected, Synced
from imexd.health.conditions import Heartbeats
from imexd.health.guard import Guard
from imexd.health.metrics import Metrics
from imexd.logs import get_logger
from imexd.messages import (
    Assignment,
    BrokerEpoch,
    Deleted,
    DomainSpec,
    Received,
    WorkloadRecord,
    decode_message,
    encode,
)
from imexd.topics import Topics

T = Topics("imex/v2")
NODE = "n1"


def received(topic: str, data: bytes, *, retained: bool = True) -> Received:
    event = decode_message(T, topic, data, retained=retained)
    assert isinstance(event, Received), event
    return event


def spec(
    generation: int, *, domain: str = "d1", state: Literal["active", "deleting"] = "active"
) -> Received:
    record = DomainSpec(domain=domain, nodes=["n1"], generation=generation, state=state)
    return received(T.spec(domain), encode(record))


def workload(
    generation: int, *, name: str = "job-a", state: Literal["claiming", "active"] = "active"
) -> Received:
    record = WorkloadRecord(
        workload=name, domain="d1", channel=1, generation=generation, state=state
    )
    return received(T.workload("d1", name), encode(record))


def epoch(value: str, *, retained: bool = True) -> Received:
    return received(
        T.epoch(), encode(BrokerEpoch(epoch=value, node="n9", at=1.0)), retained=retained
    )


def deleted(topic: str, *, retained: bool = False) -> Deleted:
    event = decode_message(T, topic, b"", retained=retained)
    assert isinstance(event, Deleted)
    return event


def held(event: Received) -> Held:
    return Held(event.topic, event.ref, event.payload, event.data)


def rebuild() -> Rebuild:
    ids = (f"e{i}" for i in itertools.count(100))
    return Rebuild(node=NODE, new_epoch=lambda: next(ids))


def link(r: Rebuild, *snapshot: Received | Deleted, v5: bool = True) -> Outcome:
    """A new link (MQTT 5, or 3.1.1) with `snapshot`; the outcome of its first Synced."""
    r.apply(Disconnected("b", "gone"), 0.0)
    r.apply(Connected("b", "5" if v5 else "3.1.1", will_delay=v5), 0.0)
    for event in snapshot:
        r.apply(event, 0.0)
    outcome = r.apply(Synced(1.0), 0.0)
    assert outcome is not None
    return outcome


def settle(r: Rebuild) -> None:
    """Publish what is due and let every echo come back, as a healthy broker does."""
    for h in r.take():
        r.apply(Received(h.topic, h.ref, h.payload, retained=False, data=h.data), 0.0)
    new = r.take_epoch()
    if new is not None:
        r.apply(epoch(new.epoch, retained=False), 0.0)


# The verdict.


def test_the_verdict_compares_the_epoch_of_the_previous_link_with_the_snapshots() -> None:
    """Same epoch: kept; gone or replaced: lost; none seen before, or a partial snapshot:
    unknown."""
    assert verdict("e1", "e1") is Verdict.KEPT
    assert verdict("e1", None) is Verdict.LOST
    assert verdict("e1", "e2") is Verdict.LOST
    assert verdict(None, "e1") is Verdict.UNKNOWN
    assert verdict(None, None) is Verdict.UNKNOWN
    assert verdict("e1", None, complete=False) is Verdict.UNKNOWN


def test_a_lost_broker_gets_back_what_is_missing_or_older_only() -> None:
    """Missing and older generations are restored; the same or a newer one is left alone."""
    mine = {e.topic: held(e) for e in (spec(3), workload(2), workload(5, name="job-b"))}
    theirs = {
        T.workload("d1", "job-a"): held(workload(1)),
        T.workload("d1", "job-b"): held(workload(6, name="job-b")),
    }
    outcome = decide(mine, theirs, previous="e1", found=None)
    assert outcome.verdict is Verdict.LOST
    assert [h.topic for h in outcome.restore] == [T.spec("d1"), T.workload("d1", "job-a")]
    assert outcome.gone == ()
    assert outcome.write_epoch


def test_a_kept_broker_says_what_was_deleted_while_away_and_restores_nothing() -> None:
    """The same epoch: a followed record missing from the snapshot was deleted meanwhile."""
    mine = {e.topic: held(e) for e in (spec(3), workload(2))}
    outcome = decide(mine, {T.spec("d1"): held(spec(3))}, previous="e1", found="e1")
    assert outcome.verdict is Verdict.KEPT
    assert outcome.restore == ()
    assert [h.topic for h in outcome.gone] == [T.workload("d1", "job-a")]
    assert not outcome.write_epoch


gens = st.integers(min_value=0, max_value=5)
tables = st.dictionaries(st.sampled_from(["a", "b", "c"]), gens, max_size=3)


@given(
    mine=tables,
    theirs=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.none() | gens, max_size=3),
    previous=st.none() | st.sampled_from(["e1", "e2"]),
    found=st.none() | st.sampled_from(["e1", "e2"]),
    complete=st.booleans(),
)
def test_decide_never_replaces_a_newer_record_nor_restores_on_a_kept_broker(
    mine: dict[str, int],
    theirs: dict[str, int | None],
    previous: str | None,
    found: str | None,
    complete: bool,
) -> None:
    """Whatever the generations: a restore is only ever of a record we hold, onto a topic
    that is empty or older, and only when the broker lost its state; a deletion is only
    inferred when it kept it."""

    def h(name: str, gen: int) -> Held:
        return held(workload(gen, name=f"job-{name}"))

    held_records = {h(n, g).topic: h(n, g) for n, g in mine.items()}
    snapshot = {h(n, 0).topic: None if g is None else h(n, g) for n, g in theirs.items()}
    outcome = decide(held_records, snapshot, previous=previous, found=found, complete=complete)
    said = verdict(previous, found, complete=complete)
    for record in outcome.restore:
        assert said is Verdict.LOST
        assert held_records[record.topic] is record
        there = snapshot.get(record.topic)
        assert there is None or there.older_than(record)
    for record in outcome.gone:
        assert said is Verdict.KEPT
        assert snapshot.get(record.topic) is None
    assert outcome.write_epoch == (complete and found is None)


# The state machine, link by link.


def test_an_empty_broker_gets_the_exact_bytes_back_and_then_an_epoch() -> None:
    """First link: the epoch is adopted, nothing restored. After a restart without
    persistence: the spec and the workload come back as they came, then a new epoch."""
    r = rebuild()
    a, w = spec(3), workload(2)
    first = link(r, epoch("e1"), a, w)
    assert first.verdict is Verdict.UNKNOWN
    assert r.epoch == "e1"
    again = link(r)
    assert again.verdict is Verdict.LOST
    due, new = r.take(), r.take_epoch()
    assert [(h.topic, h.data) for h in due] == [(a.topic, a.data), (w.topic, w.data)]
    assert new is not None
    assert (new.epoch, new.node) == ("e100", NODE)


def test_an_epoch_written_by_another_agent_first_stands() -> None:
    """A fleet reconnects at once: an agent whose epoch is still due when another agent's
    comes writes none, and takes that one as the broker's."""
    r = rebuild()
    link(r, epoch("e1"), spec(3))
    link(r)
    assert r.epoch_due is not None
    r.apply(epoch("e2", retained=False), 0.0)
    assert r.take_epoch() is None
    settle(r)
    assert r.epoch == "e2"


def test_unknown_fields_of_a_newer_writer_come_back_too() -> None:
    """The restore is of the bytes that came, not of what this version decodes."""
    r = rebuild()
    data = b'{"v":1,"domain":"d1","generation":4,"future":{"x":1}}'
    link(r, epoch("e1"), received(T.spec("d1"), data))
    link(r)
    due = r.take()
    assert [h.data for h in due] == [data]


def test_a_record_deleted_while_the_link_was_up_never_comes_back() -> None:
    """A live deletion forgets the record: an empty broker later does not get it back."""
    r = rebuild()
    link(r, epoch("e1"), spec(3), workload(2))
    r.apply(deleted(T.workload("d1", "job-a")), 0.0)
    link(r)
    due = r.take()
    assert [h.topic for h in due] == [T.spec("d1")]


def test_a_record_deleted_while_away_from_a_kept_broker_is_taken_in() -> None:
    """Back on the same epoch without the spec: the outcome says it is gone, nothing is
    restored, and a later empty broker does not get it back either."""
    r = rebuild()
    link(r, epoch("e1"), spec(3), workload(2))
    outcome = link(r, epoch("e1"), workload(2))
    assert [h.topic for h in outcome.gone] == [T.spec("d1")]
    assert (r.take(), r.take_epoch()) == ([], None)
    link(r)
    due = r.take()
    assert [h.topic for h in due] == [T.workload("d1", "job-a")]


def test_a_deleting_spec_comes_back_as_it_is_and_a_claim_not_at_all() -> None:
    """`deleting` keeps nodes out, so it is restored; a workload claim in flight is not."""
    r = rebuild()
    link(r, epoch("e1"), spec(3, state="deleting"), workload(2, state="claiming"))
    link(r)
    due = r.take()
    assert [(h.topic, h.payload.state) for h in due] == [(T.spec("d1"), "deleting")]  # type: ignore[union-attr]


def test_the_newest_generation_wins_when_several_agents_restore() -> None:
    """A record that comes back older than the one we restored is restored again; a newer
    one is taken as is."""
    r = rebuild()
    link(r, epoch("e1"), spec(5))
    link(r)
    r.take()
    r.apply(spec(4), 0.0)
    assert [h.payload.generation for h in r.due] == [5]  # type: ignore[union-attr]
    r.take()
    r.apply(spec(6), 0.0)
    assert r.due == []
    assert r.held[T.spec("d1")].generation == 6


def test_the_new_epoch_is_ours_only_once_the_restores_came_back() -> None:
    """A link lost between the restores and their echoes finds the broker lost again (not
    kept), so the records it restores are never read as deleted."""
    r = rebuild()
    link(r, epoch("e1"), spec(3))
    link(r, epoch("e2"))  # another agent rebuilt first and wrote e2
    r.take()  # published, echo not back yet
    outcome = link(r, epoch("e2"))
    assert outcome.verdict is Verdict.LOST
    assert [h.topic for h in outcome.restore] == [T.spec("d1")]
    settle(r)
    assert r.epoch == "e2"
    assert link(r, epoch("e2"), spec(3)).verdict is Verdict.KEPT


def test_an_mqtt_311_link_restores_nothing_and_writes_no_epoch() -> None:
    """Its snapshot may be partial (NATS): a record missing there is no evidence."""
    r = rebuild()
    link(r, epoch("e1"), spec(3), v5=False)
    outcome = link(r, v5=False)
    assert outcome.verdict is Verdict.UNKNOWN
    assert (r.take(), r.take_epoch()) == ([], None)


def test_a_domain_left_is_forgotten_and_an_assignment_of_another_node_never_held() -> None:
    """Only what the agent still follows comes back: not the spec of a domain it left."""
    r = rebuild()
    own = received(T.assignment(NODE), encode(Assignment(domain="d1")))
    other = received(T.assignment("n2"), encode(Assignment(domain="d1")))
    link(r, epoch("e1"), spec(3), spec(1, domain="d2"), own, other)
    r.follow("d2")
    link(r)
    due = r.take()
    assert sorted(h.topic for h in due) == sorted([T.spec("d2"), T.assignment(NODE)])


# Random interleavings.

TOPICS = [T.spec("d1"), T.workload("d1", "job-a")]
step = st.one_of(
    st.tuples(
        st.just("link"), st.sampled_from(["5", "3.1.1"]), st.sampled_from([None, "e1", "e2"])
    ),
    st.tuples(st.just("receive"), st.sampled_from(TOPICS), gens),
    st.tuples(st.just("delete"), st.sampled_from(TOPICS), st.booleans()),
    st.tuples(st.just("settle"), st.none(), st.none()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=30))
def test_nothing_deleted_comes_back_and_nothing_is_invented(
    steps: list[tuple[str, object, object]],
) -> None:
    """Whatever the links, records and deletions: a restore is always bytes that came on
    its topic, never of a topic whose last news was a deletion."""
    r = rebuild()
    r.apply(Connected("b", "5", will_delay=True), 0.0)
    last: dict[str, bytes] = {}
    seen: set[bytes] = set()
    for kind, a, b in steps:
        if kind == "link":
            snapshot = [] if b is None else [epoch(str(b))]
            link(r, *snapshot, v5=a == "5")
        elif kind == "receive":
            topic, gen = str(a), int(b)  # type: ignore[call-overload]
            event = spec(gen) if topic == TOPICS[0] else workload(gen)
            r.apply(event, 0.0)
            last[topic] = event.data
            seen.add(event.data)
        elif kind == "delete":
            r.apply(deleted(str(a), retained=bool(b)), 0.0)
            last[str(a)] = b""
        due = r.take()
        for h in due:
            assert h.data in seen
            assert last.get(h.topic) != b"", f"{h.topic} was deleted, then restored"
        if kind == "settle":
            settle(r)


# The agent's task, against a fake bus.


class FakeBus:
    """Records what the rebuilder publishes, as a broker would take it."""

    def __init__(self) -> None:
        self.put: list[tuple[str, bytes]] = []
        self.done = asyncio.Event()

    async def put_retained(self, topic: str, data: bytes) -> None:
        self.put.append((topic, data))
        if topic == T.epoch():
            self.done.set()


async def test_the_task_publishes_the_restores_then_the_epoch_and_counts_them() -> None:
    """Spec and workload as they came, then a new epoch; one rebuild and two records in
    the metrics; the link's deletions and restores handed to the agent before Synced."""
    metrics = Metrics()
    rebuilder = Rebuilder(NODE, T, metrics=metrics, log=get_logger("test"), rand=lambda: 0.0)
    a, w = spec(3), workload(2)
    for event in (Connected("b", "5", will_delay=True), epoch("e1"), a, w):
        assert rebuilder.on_event(event) == []
    assert rebuilder.on_event(Synced(1.0)) == []
    rebuilder.on_event(Disconnected("b", "gone"))
    rebuilder.on_event(Connected("b", "5", will_delay=True))
    taken_in = rebuilder.on_event(Synced(2.0))
    assert [(e.topic, e.data) for e in taken_in if isinstance(e, Received)] == [
        (a.topic, a.data),
        (w.topic, w.data),
    ]
    bus = FakeBus()
    guard = Guard(Heartbeats(), Metrics(), get_logger("test"))
    guard.heartbeats.register(TASK, 1.0)
    task = asyncio.create_task(rebuilder.run(bus, guard))
    try:
        async with asyncio.timeout(5):
            await bus.done.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert bus.put[:2] == [(a.topic, a.data), (w.topic, w.data)]
    assert [t for t, _ in bus.put[2:]] == [T.epoch()]
    text = metrics.render().decode()
    assert "imexd_broker_rebuilds_total 1.0" in text
    assert 'imexd_broker_records_restored_total{kind="spec"} 1.0' in text
    assert 'imexd_broker_records_restored_total{kind="workload"} 1.0' in text
