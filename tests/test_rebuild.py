"""The anti-entropy pass (imexd.agent.rebuild): driven by bus events, no broker."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Literal

from structlog.testing import capture_logs

from imexd.agent.rebuild import TASK, Rebuilder
from imexd.agent.statefile import RecordFile
from imexd.bus.events import Connected, Event, Synced
from imexd.health.conditions import Heartbeats
from imexd.health.guard import Guard
from imexd.health.metrics import Metrics
from imexd.logs import get_logger
from imexd.messages import (
    Assignment,
    Deleted,
    DomainSpec,
    Dropped,
    Received,
    Retry,
    WorkloadRecord,
    decode_message,
    encode,
)
from imexd.topics import Topics
from tests.support import until

T = Topics("imex/v2")
NODE = "n1"
NOW = 1_800_000_000.0

EXPIRY_S = 604800.0
PERIOD_S = 60.0

SpecState = Literal["active", "deleting", "deleted"]


def received(topic: str, data: bytes, *, retained: bool = True) -> Received:
    event = decode_message(T, topic, data, retained=retained)
    assert isinstance(event, Received), event
    return event


def spec(
    generation: int, *, nodes: list[str] | None = None, state: SpecState = "active"
) -> Received:
    record = DomainSpec(
        domain="d1", nodes=nodes or ["n1"], generation=generation, state=state, at=NOW
    )
    return received(T.spec("d1"), encode(record))


def workload(
    generation: int, *, state: Literal["claiming", "active", "deleted"] = "active"
) -> Received:
    record = WorkloadRecord(
        workload="job-a", domain="d1", channel=1, generation=generation, state=state, at=NOW
    )
    return received(T.workload("d1", "job-a"), encode(record))


def assignment(generation: int, domain: str | None = "d1") -> Received:
    record = Assignment(domain=domain, generation=generation, at=NOW)
    return received(T.assignment(NODE), encode(record))


def cleared(topic: str) -> Deleted:
    event = decode_message(T, topic, b"", retained=False)
    assert isinstance(event, Deleted)
    return event


def rebuilder(store: RecordFile | None = None) -> Rebuilder:
    log = get_logger("test")
    r = Rebuilder(
        NODE,
        T,
        metrics=Metrics(),
        log=log,
        store=store,
        clock=lambda: NOW,
        expiry_s=EXPIRY_S,
        period_s=PERIOD_S,
    )
    r.follow("d1")
    return r


def linked(r: Rebuilder, *events: Event) -> list[Event]:
    """A new link whose snapshot holds `events`: what the readers get, Synced included."""
    out = r.on_event(Connected("b", "5", will_delay=True))
    for event in events:
        out += r.on_event(event)
    return out + r.on_event(Synced(1.0))


def data(events: list[Event]) -> list[bytes]:
    return [e.data for e in events if isinstance(e, Received)]


def test_a_replayed_older_spec_is_not_applied_and_is_answered_with_the_newer() -> None:
    """Generation 1 after generation 2: the readers never see it, it is counted stale, and
    generation 2 is due, verbatim."""
    r = rebuilder()
    two, one = spec(2, nodes=["n1", "n2", "n3"]), spec(1, nodes=["n1", "n2"])
    assert data(linked(r, two)) == [two.data]
    assert r.on_event(one) == []
    assert [(t, d.reason.value) for t, d in r.drops] == [(one.topic, "stale")]
    assert {t: v.data for t, v in r.due.items()} == {two.topic: two.data}
    assert r.on_event(two) == [], "its echo: the same bytes, nothing to do"
    assert r.due == {}


def test_a_clear_removes_nothing_and_the_held_version_goes_back() -> None:
    """An empty payload on a held topic never reaches the readers: the held record is due."""
    r = rebuilder()
    w = workload(3)
    linked(r, w)
    assert r.on_event(cleared(w.topic)) == []
    assert r.due[w.topic].data == w.data
    assert r.on_event(cleared(T.workload("d1", "other"))) != [], "nothing held: passed on"


def test_a_held_tombstone_answers_an_older_active_copy() -> None:
    """The workload was deleted (generation 4): its active generation 3 coming back is
    stale, and the tombstone is what goes back."""
    r = rebuilder()
    gone = workload(4, state="deleted")
    linked(r, workload(3), gone)
    assert r.on_event(workload(3)) == []
    assert r.due[gone.topic].data == gone.data
    assert r.due[gone.topic].tombstone


def test_the_pass_after_a_reconnect_gives_back_what_the_broker_lacks_or_serves_older() -> None:
    """An empty broker gets everything held back; a stale one the newer versions; the
    readers, who had them, get nothing new."""
    r = rebuilder()
    s, w, a = spec(5), workload(2), assignment(7)
    linked(r, s, w, a)
    assert data(linked(r)) == []
    assert sorted(r.due) == sorted([s.topic, w.topic, a.topic])
    r.due.clear()
    assert data(linked(r, spec(4), w, a)) == []
    assert list(r.due) == [s.topic]


def test_a_restarted_agent_hands_its_readers_what_the_broker_lost(tmp_path: Path) -> None:
    """The held versions survive a restart (the state dir): a broker that lost them, or
    serves them older, gets them back and the readers get them as if it had served them."""
    first = rebuilder(RecordFile(tmp_path))
    s, w = spec(5), workload(2)
    linked(first, s, w)
    first.save()
    again = rebuilder(RecordFile(tmp_path))
    got = linked(again, spec(3))
    assert data(got) == [s.data, w.data]
    assert isinstance(got[-1], Synced)
    assert sorted(again.due) == sorted([s.topic, w.topic])


def test_a_deleted_domain_stays_followed_and_its_assignment_is_not_given_back() -> None:
    """After the domain's tombstone the agent leaves it but keeps following it; its own
    assignment to that domain, missing from an empty broker, is not written back."""
    r = rebuilder()
    gone = spec(9, state="deleted")
    linked(r, assignment(1), gone)
    r.follow(None)
    assert r.remembered(NOW) == frozenset({"d1"})
    assert gone.topic in r.order.held
    linked(r)
    assert list(r.due) == [gone.topic]
    assert r.on_event(spec(8)) == [], "an older active spec after the tombstone"


def test_an_expired_tombstone_is_forgotten() -> None:
    """A tombstone older than the expiry is neither followed nor given back."""
    r = rebuilder()
    linked(r, spec(9, state="deleted"))
    r.expiry_s = 10.0
    r.clock = lambda: NOW + 11.0
    r.follow(None)
    assert r.order.held == {}


def test_claims_and_retry_requests_are_never_given_back() -> None:
    """A `claiming` workload belongs to a command in flight, a retry request to the
    control plane alone: neither is published again, though both are ordered."""
    r = rebuilder()
    asked = Retry(node=NODE, domain="d1", at=NOW, generation=3)
    retry = received(T.retry("d1", NODE), encode(asked))
    linked(r, workload(1, state="claiming"), retry)
    linked(r)
    assert r.due == {}
    older = Retry(node=NODE, domain="d1", at=NOW + 5, generation=2)
    assert r.on_event(received(T.retry("d1", NODE), encode(older))) == []


class FakeBus:
    """Records what the rebuilder publishes; gives nothing back."""

    def __init__(self, *, echo_timeout_s: float = 5.0) -> None:
        self.echo_timeout_s = echo_timeout_s
        self.put: list[tuple[str, bytes, float | None]] = []
        self.subscribed: list[str] = []
        self.dropped: list[str] = []
        self.done = asyncio.Event()

    async def put_retained(
        self, topic: str, data: bytes, *, message_expiry_s: float | None = None
    ) -> None:
        self.put.append((topic, data, message_expiry_s))

    async def subscribe(self, *topic_filters: str, ordered: bool = True) -> None:
        self.subscribed.extend(topic_filters)
        self.done.set()  # after the publishes of the same round

    async def unsubscribe(self, topic_filter: str) -> None:
        self.subscribed.remove(topic_filter)

    def drop(self, topic: str, dropped: Dropped) -> None:
        self.dropped.append(dropped.reason.value)


async def test_the_task_publishes_verbatim_a_tombstone_with_its_expiry() -> None:
    """What is due goes out as it came; a tombstone with the rest of its expiry; the
    deleted domain is subscribed; the stale copy is counted by the bus."""
    metrics = Metrics()
    r = Rebuilder(
        NODE,
        T,
        metrics=metrics,
        log=get_logger("test"),
        clock=lambda: NOW + 100,
        expiry_s=EXPIRY_S,
        period_s=PERIOD_S,
    )
    r.follow("d1")
    gone = spec(9, state="deleted")
    linked(r, gone)
    r.follow(None)
    linked(r)
    r.on_event(spec(8))
    bus = FakeBus()
    r.count_drops(bus)
    assert bus.dropped == ["stale"]
    guard = Guard(Heartbeats(), Metrics(), get_logger("test"))
    guard.heartbeats.register(TASK, 1.0)
    task = asyncio.create_task(r.run(bus, guard))
    try:
        async with asyncio.timeout(5):
            await bus.done.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert bus.put == [(gone.topic, gone.data, r.expiry_s - 100)]
    assert bus.subscribed == [T.domain_filter("d1")]
    text = metrics.render().decode()
    assert 'imexd_broker_records_restored_total{kind="spec"} 1.0' in text


async def test_a_give_back_not_echoed_within_the_bus_echo_timeout_is_counted() -> None:
    """A record given back that the broker does not deliver back within the bus's own echo
    timeout (the wait after which the bus counts our records refused) is counted and
    logged as unconfirmed."""
    with capture_logs() as logs:
        r = rebuilder()
        linked(r, spec(9))
        r.on_event(spec(8))  # an older copy: spec 9 is given back
        bus = FakeBus(echo_timeout_s=0.05)
        guard = Guard(Heartbeats(), Metrics(), get_logger("test"))
        guard.heartbeats.register(TASK, 1.0)
        task = asyncio.create_task(r.run(bus, guard))
        try:
            await until(  # well below the shipped 5 s
                lambda: [e for e in logs if e["event"] == "rebuild.unconfirmed"],
                within=2.0,
                interval=0.01,
            )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    [unconfirmed] = [e for e in logs if e["event"] == "rebuild.unconfirmed"]
    assert unconfirmed["topics"] == [T.spec("d1")]
    assert [topic for topic, _, _ in bus.put] == [T.spec("d1")]
    text = r.metrics.render().decode()
    assert "imexd_broker_restores_unconfirmed_total 1.0" in text
