"""The node's core, pure: inputs with explicit times in, actions out.

No broker, no daemon, no event loop and no sleeping: each test feeds `NodeCore` what the
driver would (bus events, the daemon's state, timers) at the times it names, and reads
the actions and the reconcile rounds it asks for.
"""

from __future__ import annotations

from typing import Any

import msgspec

from imexd.agent.actions import (
    Action,
    Apply,
    AwaitView,
    Clear,
    Follow,
    Pause,
    ProveLink,
    Publish,
    Reconcile,
    SaveState,
    SetWill,
    StepSoon,
    Subscribe,
    Survey,
)
from imexd.agent.core import NodeCore
from imexd.agent.inputs import (
    BusInput,
    DaemonInput,
    Input,
    Proven,
    Reconciled,
    Retarget,
    Step,
    Surveyed,
)
from imexd.bus.events import BrokerChecked, Connected, Synced
from imexd.daemon.state import DaemonState
from imexd.logs import get_logger
from imexd.membership.claim import Reason
from imexd.membership.shard import ShardView
from imexd.messages import (
    Assignment,
    Deleted,
    MemberRecord,
    MemberState,
    Presence,
    Received,
    Retry,
)
from imexd.nodestate import NodeState
from imexd.settings import Settings, settings_from_mapping
from imexd.topics import TopicRef, Topics

ME, DOMAIN, CLIQUE = "n1", "d1", "c1"
WALL = 1_700_000_000.0
TOPICS = Topics("imex/v2")


def settings(**sections: dict[str, Any]) -> Settings:
    raw: dict[str, dict[str, Any]] = {
        "node": {"name": ME, "address": "10.0.0.1", "clique": CLIQUE},
        "domain": {"name": DOMAIN, "max_nodes": 4, "settle_s": 1.0},
        "bus": {"url": "mqtt://127.0.0.1:1"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return settings_from_mapping(raw, environ={})


class Driver:
    """Feeds a core the way the agent does, on a clock the test moves."""

    def __init__(self, s: Settings | None = None, *, incarnation: int = 3) -> None:
        s = s or settings()
        log = get_logger("test")
        self.core = NodeCore(s, shard=ShardView.from_settings(s, log), started_at=WALL, log=log)
        self.core.start(NodeState(incarnation=incarnation))
        self.now = 0.0

    def feed(self, happened: Input, at: float | None = None) -> list[Action]:
        self.now = self.now if at is None else at
        return self.core.feed(happened, now=self.now, wall=WALL + self.now)

    def bus(self, *events: Any, at: float | None = None) -> list[Action]:
        return [a for e in events for a in self.feed(BusInput(e), at)]

    def echo(self, actions: list[Action]) -> None:
        """The broker gives back each member record we published, live."""
        for action in actions:
            if isinstance(action, Publish) and isinstance(action.payload, MemberRecord):
                self.bus(received(action.payload, retained=False))

    def step(self, at: float) -> list[Action]:
        actions = self.feed(Step(), at)
        self.echo(actions)
        return actions

    def join(self) -> list[Action]:
        """Retarget at t=0 into d1/c1, then the link's snapshot."""
        actions = self.feed(Retarget(), 0.0)
        self.bus(Connected(broker="b", protocol="5", will_delay=True, link=1), Synced(at=0.0))
        return actions

    def settle(self) -> None:
        """Join, claim slot 0 alone, and settle it (its echo, the broker checked)."""
        self.join()
        self.step(0.0)
        self.bus(BrokerChecked(broker="b", ok=True))
        self.step(1.5)
        assert self.core.desired.run, self.core.desired


def received(record: MemberRecord, *, retained: bool = True) -> Received:
    ref = TopicRef(kind="member", domain=record.domain, clique=record.clique, node=record.node)
    topic = TOPICS.member(record.domain, record.clique, record.node)
    return Received(topic=topic, ref=ref, payload=record, retained=retained)


def cleared(node: str) -> Deleted:
    """The live clear of `node`'s member record (a leave)."""
    ref = TopicRef(kind="member", domain=DOMAIN, clique=CLIQUE, node=node)
    return Deleted(topic=TOPICS.member(DOMAIN, CLIQUE, node), ref=ref, retained=False)


def member(node: str, slot: int, *, incarnation: int = 1) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain=DOMAIN,
        clique=CLIQUE,
        address="10.0.0.9",
        slot=slot,
        incarnation=incarnation,
        state=MemberState.MEMBER,
        max_nodes=4,
        mode="names",
        settled=WALL - 100,
    )


def test_a_join_follows_the_target_and_subscribes_its_shard() -> None:
    """The first retarget follows d1 and subscribes its members (ordered), its spec, our
    retry request and our health report (not ordered)."""
    d = Driver()
    actions = d.join()
    assert actions == [
        Follow(DOMAIN, CLIQUE),
        Subscribe((TOPICS.members_filter(DOMAIN, CLIQUE),)),
        Subscribe(
            (TOPICS.spec(DOMAIN), TOPICS.retry(DOMAIN, ME), TOPICS.health(DOMAIN, ME)),
            ordered=False,
        ),
    ]
    assert d.feed(Retarget(), 0.1) == [Follow(DOMAIN, CLIQUE)]  # nothing moved


def test_a_lone_node_claims_settles_saves_and_is_applied_at_once() -> None:
    """Claim, echo, settle: the member record is published (not replayed by the bus), the
    slot saved, and the first change is applied at once; the next within settle_s waits."""
    d = Driver()
    d.join()
    claim = d.step(0.0)
    [published] = [a for a in claim if isinstance(a, Publish)]
    assert isinstance(published.payload, MemberRecord)
    assert (published.payload.state, published.payload.slot) == (MemberState.CLAIMING, 0)
    assert not published.replay
    d.bus(BrokerChecked(broker="b", ok=True))
    settled = d.step(1.5)
    assert SaveState(NodeState(domain=DOMAIN, clique=CLIQUE, slot=0, incarnation=3)) in settled
    assert Reconcile() in settled
    round_ = d.core.reconcile_next(1.5, None)
    assert isinstance(round_, Apply)
    assert (round_.desired.run, round_.desired.slot, round_.retry) == (True, 0, None)
    assert d.core.reconcile_next(1.6, {0: "10.0.0.1"}) == Pause(2.5)  # coalesced


def test_a_removed_member_waits_settle_s_and_a_link_proof() -> None:
    """A member gone is applied only once it stood for settle_s and a round trip through
    the broker proved the link; a proof that did not come back (timed out on a link still
    up) settles once more and proves again: it never lets the removal through."""
    d = Driver()
    d.settle()
    applied = {0: "10.0.0.1", 1: "10.0.0.9"}  # the daemon was given n2 too
    d.core.rounds.quiet_at = 0.0
    d.core.desired_at = 10.0
    assert d.core.reconcile_next(10.2, applied) == Pause(11.0)
    proof = d.core.reconcile_next(11.0, applied)
    assert isinstance(proof, ProveLink)
    d.feed(Proven(proof.mark, ok=False), 11.1)
    assert d.core.reconcile_next(11.1, applied) == Pause(12.1)
    again = d.core.reconcile_next(12.1, applied)
    assert isinstance(again, ProveLink)
    d.feed(Proven(again.mark, ok=True), 12.2)
    assert isinstance(d.core.reconcile_next(12.2, applied), Apply)


def test_a_proof_made_before_the_link_dropped_proves_nothing_on_the_next() -> None:
    """A round trip came back, then the link dropped before the round applied: the round
    waits for the resynced view and proves again there."""
    d = Driver()
    d.settle()
    applied = {0: "10.0.0.1", 1: "10.0.0.9"}
    d.core.rounds.quiet_at = 0.0
    d.core.desired_at = 10.0
    proof = d.core.reconcile_next(11.0, applied)
    assert isinstance(proof, ProveLink)
    d.feed(Proven(proof.mark, ok=True), 11.1)
    d.bus(Connected(broker="b", protocol="5", will_delay=True, link=2), at=11.2)
    assert d.core.reconcile_next(11.2, applied) == AwaitView()
    d.bus(Synced(at=11.3), BrokerChecked(broker="b", ok=True))
    d.step(11.4)
    assert isinstance(d.core.reconcile_next(11.4, applied), ProveLink)


def test_a_deletion_during_the_proof_waits_for_a_later_round_trip() -> None:
    """A member's record cleared while the round trip that proves an earlier deletion is
    under way reaches no daemon until a round trip begun after it came back."""
    d = Driver()
    d.settle()
    d.bus(received(member("n2", 1), retained=False), received(member("n3", 2), retained=False))
    d.step(2.0)
    applied = {0: "10.0.0.1", 1: "10.0.0.9", 2: "10.0.0.9"}
    d.core.rounds.quiet_at = 0.0
    d.bus(cleared("n2"), at=3.0)
    d.step(3.0)
    first = d.core.reconcile_next(4.0, applied)
    assert isinstance(first, ProveLink)
    d.bus(cleared("n3"), at=4.1)  # during the round trip, after its mark
    d.step(4.1)
    assert set(d.core.shard.unproven) == {"n2", "n3"}
    d.feed(Proven(first.mark, ok=True), 4.2)
    assert set(d.core.shard.unproven) == {"n3"}
    assert d.core.reconcile_next(4.2, applied) == Pause(5.1)  # n3's removal settles first
    second = d.core.reconcile_next(5.1, applied)
    assert isinstance(second, ProveLink)
    assert second.mark > first.mark
    d.feed(Proven(second.mark, ok=True), 5.2)
    assert not d.core.shard.unproven
    round_ = d.core.reconcile_next(5.2, applied)
    assert isinstance(round_, Apply)
    assert set(round_.desired.members) == {0}


def test_an_outbid_record_goes_out_only_on_the_link_whose_will_ends_it() -> None:
    """A record of our name that we did not write, above our incarnation: ours goes back
    with a raised incarnation only on the next link, whose will (of that incarnation)
    ends it; the link in between keeps the old will, and the daemon keeps running."""
    d = Driver()
    d.settle()
    runs = d.core.desired
    forged = msgspec.structs.replace(
        member(ME, 0, incarnation=5), address="10.0.0.1", seq=9, link=1
    )
    d.bus(received(forged, retained=False), at=2.0)
    actions = d.step(2.0)
    wills = [a for a in actions if isinstance(a, SetWill)]
    assert [getattr(w.will and w.will.tombstone, "incarnation", None) for w in wills] == [6]
    assert SaveState(NodeState(domain=DOMAIN, clique=CLIQUE, slot=0, incarnation=6)) in actions
    assert not [a for a in actions if isinstance(a, Publish)]
    d.bus(Connected(broker="b", protocol="5", will_delay=True, link=2), at=2.1)
    d.bus(received(forged), Synced(at=2.1), BrokerChecked(broker="b", ok=True))
    again = d.step(2.2)
    [published] = [a for a in again if isinstance(a, Publish)]
    assert isinstance(published.payload, MemberRecord)
    assert (published.payload.incarnation, published.payload.slot) == (6, 0)
    assert d.core.shard.continuous
    assert d.core.desired == runs


def test_a_dropped_link_waits_for_the_resynced_view() -> None:
    """After the link went, reconcile waits for a step on the resynced snapshot."""
    d = Driver()
    d.settle()
    d.bus(Connected(broker="b", protocol="5", will_delay=True, link=2), at=2.0)
    assert d.core.reconcile_next(5.0, None) == AwaitView()
    d.bus(Synced(at=2.1))
    d.step(2.2)
    assert isinstance(d.core.reconcile_next(5.0, None), Apply)


def test_a_failed_round_is_tried_again_on_the_local_backoff() -> None:
    """A failed reconcile round sets a retry time 0.25 to 0.5 s on, then longer."""
    d = Driver()
    d.feed(Reconciled(ok=False), 10.0)
    first = d.core.rounds.retry_at
    assert first is not None
    assert 10.25 <= first <= 10.5
    d.feed(Reconciled(ok=True), 11.0)
    assert d.core.rounds.retry_at is None


def test_a_fatal_daemon_gives_its_slot_up_after_release_after_s_latched() -> None:
    """FATAL since t=10: a step is due at 10 + release_after_s, which gives the slot up
    (stop admitted for the node's own cause) and keeps it given up for claim_stale_s."""
    d = Driver(settings(daemon={"release_after_s": 5.0}))
    d.settle()
    standby = msgspec.structs.replace(
        member("n2", 0), slot=None, state=MemberState.STANDBY, settled=None
    )
    d.bus(received(standby, retained=False), at=9.0)  # waits for a slot
    assert d.feed(DaemonInput(DaemonState.FATAL, fatal_since=10.0), 10.0) == [StepSoon()]
    assert d.core.next_due(11.0) == 15.0
    d.step(15.0)
    assert not d.core.desired.run
    assert d.core.released_until == 15.0 + 30.0
    order = d.core.order("stop", "not a settled member", (DOMAIN, CLIQUE, 0), d.core.desired)
    assert order is not None
    assert order.cause == Reason.RELEASED


def test_an_operator_retry_is_applied_once_and_ends_the_release() -> None:
    """A retry request newer than the agent's start reconciles with a retry order (its
    cause the operator's), once, and ends the release of a FATAL daemon's slot."""
    d = Driver()
    d.settle()
    d.core.released_until = 99.0
    topic = TOPICS.retry(DOMAIN, ME)
    ref = TopicRef(kind="retry", domain=DOMAIN, node=ME)
    asked = Retry(node=ME, domain=DOMAIN, state="asked", at=WALL + 1, by="ops")
    assert d.bus(Received(topic=topic, ref=ref, payload=asked, retained=False)) == [Reconcile()]
    assert d.bus(Received(topic=topic, ref=ref, payload=asked, retained=False)) == []
    d.core.rounds.quiet_at = 0.0
    round_ = d.core.reconcile_next(2.0, None)
    assert isinstance(round_, Apply)
    assert round_.retry is not None
    assert (round_.retry.kind, round_.retry.why) == ("retry", "imexd node retry by ops")
    assert d.core.released_until == 0.0


def test_an_unassignment_leaves_the_shard_and_clears_our_records() -> None:
    """Assigned mode: the control plane unassigns us; the retarget clears our records,
    drops the shard's filters, and what should run is cleanup, admitted as our own."""
    d = Driver(settings(domain={"name": "", "assigned": True}))
    ref = TopicRef(kind="assignment", node=ME)
    topic = TOPICS.assignment(ME)
    d.bus(Received(topic=topic, ref=ref, payload=Assignment(domain=DOMAIN), retained=True))
    d.settle()
    d.bus(Received(topic=topic, ref=ref, payload=Assignment(domain=None), retained=False))
    actions = d.feed(Retarget(), 3.0)
    assert Clear((TOPICS.member(DOMAIN, CLIQUE, ME), TOPICS.health(DOMAIN, ME))) in actions
    assert d.core.desired.cleanup
    order = d.core.order("stop", "left", (DOMAIN, CLIQUE, 0), d.core.desired)
    assert order is not None
    assert order.cause == "LeftShard"


def test_a_leave_before_publishing_clears_the_record_a_past_run_left() -> None:
    """Found by the simulator (seed 406124): a run that left before it published cleared
    nothing, so its past run's record, ended by a will, stood on the broker; the next
    run's presence wrote over that will, and the run after it resumed the ended record
    on a slot another node had settled since. A leaving agent clears a past run's record
    of ours that stands, published in this run or not; one that a clear removed, or one
    that another agent may have written, it leaves alone."""
    past = msgspec.structs.replace(member(ME, 1, incarnation=2), address="10.0.0.1")
    clear = Clear((TOPICS.member(DOMAIN, CLIQUE, ME), TOPICS.health(DOMAIN, ME)))
    d = Driver()
    d.join()
    d.bus(received(past))
    assert clear in d.core.leave(WALL + 1)
    d.bus(cleared(ME))
    assert clear not in d.core.leave(WALL + 2)
    foreign = Driver()
    foreign.join()
    foreign.bus(received(msgspec.structs.replace(past, address="10.9.9.9")))
    assert clear not in foreign.core.leave(WALL + 1)


def test_our_own_presence_in_a_snapshot_reaches_the_view() -> None:
    """A peer's presence is news only as an end; our own, found in a snapshot, also says
    which past run spoke last (`ShardView.last_run`), so it goes to the view."""
    d = Driver()

    def presence(node: str, *, retained: bool) -> Received:
        said = Presence(node=node, incarnation=2, at=WALL, domain=DOMAIN, address="10.0.0.1")
        ref = TopicRef(kind="presence", node=node)
        return Received(topic=TOPICS.presence(node), ref=ref, payload=said, retained=retained)

    assert d.core.sort(presence(ME, retained=True)) is None
    assert d.core.sort(presence(ME, retained=False)) is False
    assert d.core.sort(presence("n2", retained=True)) is False


def test_standing_aside_surveys_once_per_probe_interval() -> None:
    """While a record of our name that we did not write is watched (hold), a daemon of our
    config that nobody supervises is looked for once per `[daemon] probe_interval_s`,
    however often membership steps, and reported."""
    d = Driver(settings(daemon={"probe_interval_s": 0.25}))
    d.join()
    d.bus(received(member(ME, 0, incarnation=7)))
    steps = [k / 64 for k in range(64)]  # a step every 1/64 s for 1 s
    surveys = [t for t in steps if Survey() in d.feed(Step(), t)]
    assert surveys == [0.0, 0.25, 0.5, 0.75]
    assert d.core.next_due(0.99) == 1.0
    d.feed(Surveyed(4242))
    assert d.core.unsupervised == 4242
