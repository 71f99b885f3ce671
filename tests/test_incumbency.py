"""Incumbency and the one rule (issue 20), in the agent's judgement, on a fake clock.

A member whose record stood on the broker without a break keeps its slot and its daemon
against any other node's record, every observer keeps it in its files, and the conflict
is reported; `own_change` is the one rule of when a running daemon may stop or move.
The property test at the end drives hostile records, link drops, reconnects, fired wills
and spec changes through `ShardView` and a model broker, and finds no run in which a
running daemon stops or moves without one of the node's own reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from imexd.bus.events import BrokerChecked, Connected, Disconnected, Event, Protocol, Synced
from imexd.facts import Contest, Facts
from imexd.health import conditions as health
from imexd.health.metrics import Metrics
from imexd.membership.claim import Phase, Reason
from imexd.membership.desired import Desired
from imexd.membership.shard import DOMAIN_DELETED, Plan, ShardView, own_change
from imexd.messages import Deleted, DomainSpec, MemberRecord, MemberState, Received
from imexd.nodestate import NodeState
from imexd.topics import TopicRef
from tests.test_shard import (
    CLIQUE,
    DOMAIN,
    ME,
    MY_ADDRESS,
    SETTLE_S,
    WALL,
    derive,
    members,
    publish,
    rec,
    received,
    settle,
    view,
    with_peer,
)

FORGED_AT = "10.6.6.6"


def forged(node: str, slot: int, settled: float | None) -> MemberRecord:
    """A member record a hostile client publishes on `node`'s topic."""
    return rec(node, slot, settled=settled, address=FORGED_AT)


def addresses(plan: Plan) -> dict[int, str]:
    assert plan.desired is not None
    return {slot: m.address for slot, m in plan.desired.members.items()}


def reconnect(v: ShardView, now: float, *snapshot: MemberRecord, protocol: Protocol = "5") -> None:
    """A new link: Connected, the retained snapshot, Synced, the broker check."""
    v.apply(
        Connected(
            broker="b", protocol=protocol, will_delay=protocol == "5", repaired=protocol == "3.1.1"
        ),
        now,
    )
    for record in snapshot:
        v.apply(received(record), now)
    v.apply(Synced(at=now), now)
    v.apply(BrokerChecked(broker="b", ok=True), now)


# The holder


def test_a_member_copying_our_stamp_with_a_lower_name_leaves_our_daemon_alone() -> None:
    """Issue 20 case 1: a member record on our slot with our exact `settled` stamp and a
    lower name: we keep slot and daemon, keep ourselves in the files, and say so."""
    v = view()
    settle(v)
    assert v.continuous
    assert v.claim.settled is not None
    v.apply(received(forged("a0", 0, v.claim.settled), retained=False), 3.0)
    plan = derive(v, 3.0, running=True)
    assert plan.desired is not None
    assert (plan.desired.run, plan.desired.slot, plan.publish) == (True, 0, False)
    assert addresses(plan)[0] == MY_ADDRESS
    publish(v, plan, 3.0)
    assert v.decision is not None
    assert v.decision.reason is Reason.SLOT_CONTESTED
    assert "a0" in v.decision.message
    facts = v.facts(plan.desired)
    assert (facts.state, facts.contested) == ("member", (Contest(0, ME, ("a0",)),))


def test_continuity_survives_a_reconnect_whose_snapshot_holds_our_record() -> None:
    """The new link's snapshot gives our record back as we published it: still the
    incumbent, so a forged member in that snapshot moves nothing."""
    v = view()
    settle(v)
    mine, stamp = v.last_sent, v.claim.settled
    assert mine is not None
    reconnect(v, 5.0, forged("a0", 0, stamp), mine)
    plan = derive(v, 5.0, running=True)
    assert v.continuous
    assert plan.desired is not None
    assert (plan.desired.run, plan.desired.slot) == (True, 0)


@pytest.mark.parametrize("what", ["missing", "tombstone", "overwritten"])
def test_a_reconnect_that_lost_our_record_claims_again(what: str) -> None:
    """Our record is not in the new snapshot as we left it (a broker that lost its
    state, our will, a record written over ours): continuity is lost, and a member that
    stands on our slot keeps it; we claim again instead of replaying our record."""
    v = view()
    settle(v)
    mine, stamp = v.last_sent, v.claim.settled
    assert mine is not None
    lost = {
        "missing": [],
        "tombstone": [
            msgspec.structs.replace(mine, state=MemberState.LOST, slot=None, settled=None)
        ],
        "overwritten": [msgspec.structs.replace(mine, address=FORGED_AT, incarnation=9)],
    }[what]
    reconnect(v, 5.0, forged("a0", 0, stamp), *lost)
    plan = derive(v, 5.0, running=True)
    assert not v.continuous
    assert plan.decision is not None
    assert plan.decision.claim.phase is Phase.CLAIMING
    assert plan.decision.claim.slot != 0
    assert plan.desired is not None
    assert not plan.desired.run


def test_a_link_that_may_lose_updates_gives_no_incumbency() -> None:
    """On MQTT 3.1.1 (all that a NATS cluster speaks) the broker's order is not assumed:
    two members may settle one slot without a break on either side, so the stamps
    decide, for the holder and for observers."""
    v = view()
    settle(v)
    mine, stamp = v.last_sent, v.claim.settled
    assert mine is not None
    reconnect(v, 5.0, forged("a0", 0, stamp), mine, protocol="3.1.1")
    plan = derive(v, 5.0, running=True)
    assert (v.continuous, v.ordered, v.incumbent) == (True, False, False)
    assert plan.decision is not None
    assert plan.decision.reason is Reason.PARTITION_HEALED

    v, n2 = with_peer()
    mine = v.last_sent
    assert mine is not None
    reconnect(v, 5.0, n2, mine, protocol="3.1.1")
    v.apply(received(forged("a0", 1, n2.settled), retained=False), 6.0)
    assert members(derive(v, 6.0, running=True))[1] == "a0"


# Observers


def test_observers_keep_the_incumbent_in_their_files() -> None:
    """A member record forged on a peer's slot, with the peer's stamp and a lower name,
    changes nothing in our files, and we report the contested slot."""
    v, n2 = with_peer()
    v.apply(received(forged("a0", 1, n2.settled), retained=False), 3.0)
    plan = derive(v, 3.0, running=True)
    assert members(plan) == {0: ME, 1: "n2"}
    assert addresses(plan)[1] == n2.address
    publish(v, plan, 3.0)
    assert plan.desired is not None
    assert v.facts(plan.desired).contested == (Contest(1, "n2", ("a0",)),)


def test_a_fresh_observer_that_sees_both_in_one_snapshot_ranks_them() -> None:
    """With no incumbent known (both records in our first snapshot), the stamps decide:
    what a lying node can still do, documented in imexd.membership.slots."""
    v = view()
    n2 = rec("n2", 1)
    v.apply(received(n2), 0.0)
    v.apply(received(forged("a0", 1, n2.settled)), 0.0)
    plan = settle(v)
    assert members(plan)[1] == "a0"
    assert plan.desired is not None
    assert v.facts(plan.desired).contested == (Contest(1, "a0", ("n2",)),)


def test_an_incumbent_is_kept_across_our_reconnect_while_its_record_is_unchanged() -> None:
    """Our link drops; the new snapshot holds the peer's record unchanged and a forged
    one beside it: the peer stays. Had its record changed unseen, the stamps decide."""
    v, n2 = with_peer()
    mine = v.last_sent
    assert mine is not None
    reconnect(v, 5.0, forged("a0", 1, n2.settled), n2, mine)
    assert members(derive(v, 5.0, running=True)) == {0: ME, 1: "n2"}

    v, n2 = with_peer()
    moved = msgspec.structs.replace(n2, incarnation=2)
    reconnect(v, 5.0, forged("a0", 1, n2.settled), moved, mine)
    assert members(derive(v, 5.0, running=True)) == {0: ME, 1: "a0"}


def test_an_incumbent_that_leaves_its_slot_is_forgotten() -> None:
    """Once the incumbent's record is cleared, the member left on the slot holds it."""
    v, _ = with_peer()
    v.apply(received(forged("z9", 1, WALL - 500), retained=False), 3.0)
    assert members(derive(v, 3.0, running=True))[1] == "n2"
    v.apply(Deleted(topic="t", ref=TopicRef("member", DOMAIN, CLIQUE, "n2"), retained=False), 4.0)
    assert members(derive(v, 4.0, running=True))[1] == "z9"
    assert v.peers.incumbents[1] == "z9"


# The one rule


RUNS = Desired(domain=DOMAIN, clique=CLIQUE, slot=0, run=True)


@pytest.mark.parametrize("cause", [*Reason, DOMAIN_DELETED])
def test_own_change_lets_only_own_reasons_stop_a_continuous_member(cause: str) -> None:
    """A plan that stops or moves what runs passes only for the node's own reasons while
    continuity holds, and for any cause once it is lost; one that keeps the slot (new
    members: a SIGUSR1) or starts what did not run always passes."""
    own = cause in {Reason.NOT_IN_SPEC, Reason.RELEASED, DOMAIN_DELETED}
    stop = Desired(domain=DOMAIN, clique=CLIQUE)
    moved = Desired(domain=DOMAIN, clique=CLIQUE, slot=1, run=True)
    for changed in (stop, moved):
        assert own_change(RUNS, changed, cause, incumbent=True) is own
        assert own_change(RUNS, changed, cause, incumbent=False)
    assert own_change(RUNS, RUNS, cause, incumbent=True)
    assert own_change(Desired(), moved, cause, incumbent=True)


def test_standing_aside_keeps_what_runs() -> None:
    """The broker handed our session to another live agent of our name: the plan holds
    what runs (it used to ask for run=False, which stopped the daemon)."""
    v = view()
    v.apply(Disconnected(broker="b", reason="taken", reason_code=0x8E), 0.0)
    v.apply(Connected(broker="b", protocol="5", will_delay=True), 0.1)
    v.apply(Synced(at=0.1), 0.1)
    plan = derive(v, 0.5, running=True)
    assert (plan.hold, plan.desired, plan.decision) == (True, None, None)


def test_the_contest_is_a_metric() -> None:
    """imexd_slot_contested counts the contested slots of the node's shard."""
    v = view()
    settle(v)
    v.apply(received(forged("a0", 0, v.claim.settled), retained=False), 3.0)
    v.apply(received(rec("n2", 1)), 3.0)
    v.apply(received(forged("z9", 1, WALL - 100), retained=False), 3.0)
    plan = derive(v, 3.0, running=True)
    publish(v, plan, 3.0)
    assert plan.desired is not None
    facts = Facts(node=ME, domain=DOMAIN, clique=CLIQUE, slot=0, membership=v.facts(plan.desired))
    metrics = Metrics()
    metrics.update_from(facts, health.conditions(facts, [], 0.0))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert [s.value for s in families["imexd_slot_contested"].samples] == [2.0]


# The one rule as a property: a model broker, hostile clients, link events

HOSTILE = ("a0", "m5", "n0", "n2", "z9", ME)
"""Nodes whose topics hostile clients write (ours included)."""
STAMPS = ("copy", "zero", "negative", "earlier", "later", "future", "none")
SPECS: tuple[DomainSpec | None, ...] = (
    None,
    DomainSpec(domain=DOMAIN),
    DomainSpec(domain=DOMAIN, nodes=[ME, "n2"]),
    DomainSpec(domain=DOMAIN, nodes=["n2", "a0", ME]),
    DomainSpec(domain=DOMAIN, nodes=["n2", "a0"]),
    DomainSpec(domain=DOMAIN, max_nodes=8),
    DomainSpec(domain=DOMAIN, state="deleting"),
)


def own_reason(spec: DomainSpec | None) -> bool:
    """A spec that drops this node or deletes the domain: an own reason to stop."""
    return spec is not None and (
        spec.state == "deleting" or (spec.nodes is not None and ME not in spec.nodes)
    )


def member_ref(node: str) -> TopicRef:
    return TopicRef(kind="member", domain=DOMAIN, clique=CLIQUE, node=node)


SPEC_REF = TopicRef(kind="spec", domain=DOMAIN)


def started(note: Callable[[str], object] = lambda _: None) -> World:
    """A world whose link passed the broker's retained check, after the first step."""
    world = World(v=view(), note=note)
    world.v.apply(BrokerChecked(broker="b", ok=True), 0.0)
    world.step()
    return world


@dataclass
class World:
    """One agent's ShardView, a model broker (retained state and one FIFO of live
    deliveries, the broker's order), and what the agent has asked to run."""

    v: ShardView
    now: float = 0.0
    retained: dict[str, MemberRecord] = field(default_factory=dict)
    spec: DomainSpec | None = None
    queue: list[Event] = field(default_factory=list)
    connected: bool = True
    protocol: Protocol = "5"
    ours: MemberRecord | None = None
    """Our last record as published (None after a clear)."""
    desired: Desired = field(default_factory=Desired)
    released: bool = False
    excused: bool = False
    """Since the daemon started on its slot: an own reason occurred, or a reconnect's
    snapshot no longer held our record (continuity lost). A link on MQTT 3.1.1 (no
    broker order assumed) excuses a stop too."""
    trace: list[str] = field(default_factory=list)
    note: Callable[[str], object] = lambda _: None
    """Records what a run reached (hypothesis.event inside the property)."""

    def deliver(self, count: int) -> None:
        for message in self.queue[:count]:
            self.apply(message)
        del self.queue[:count]

    def apply(self, message: Event) -> None:
        """The view takes `message`; a spec that drops us is an own reason from now on."""
        if isinstance(message, Received) and isinstance(message.payload, DomainSpec):
            self.excused = self.excused or own_reason(message.payload)
        self.v.apply(message, self.now)

    def write(self, node: str, record: MemberRecord | None) -> None:
        """A client publishes `record` (None: clears) retained on `node`'s topic."""
        if record is None:
            self.retained.pop(node, None)
            message: Event = Deleted(topic="t", ref=member_ref(node), retained=False)
        else:
            self.retained[node] = record
            message = Received(topic="t", ref=member_ref(node), payload=record, retained=False)
        if self.connected:
            self.queue.append(message)

    def write_spec(self, spec: DomainSpec | None) -> None:
        self.spec = spec
        if not self.connected:
            return
        if spec is None:
            self.queue.append(Deleted(topic="s", ref=SPEC_REF, retained=False))
        else:
            self.queue.append(Received(topic="s", ref=SPEC_REF, payload=spec, retained=False))

    def drop(self) -> None:
        self.connected = False
        self.queue.clear()
        self.v.apply(Disconnected(broker="b", reason="lost"), self.now)

    def reconnect(
        self, order: Callable[[list[Event]], list[Event]], protocol: Protocol = "5"
    ) -> None:
        """Connected, the snapshot (in `order`), Synced; our record goes back at a step."""
        self.connected = True
        self.protocol = protocol
        if self.ours is None or self.retained.get(ME) != self.ours:
            self.excused = True
        if self.desired.run:
            self.note(f"a reconnect while running, continuity {'lost' if self.excused else 'kept'}")
        self.v.apply(
            Connected(
                broker="b",
                protocol=protocol,
                will_delay=protocol == "5",
                repaired=protocol == "3.1.1",
            ),
            self.now,
        )
        snapshot: list[Event] = [
            Received(topic="t", ref=member_ref(node), payload=record, retained=True)
            for node, record in self.retained.items()
        ]
        if self.spec is not None:
            snapshot.append(Received(topic="s", ref=SPEC_REF, payload=self.spec, retained=True))
        for message in order(snapshot):
            self.apply(message)
        # The bus replays no member record (`retain(replay=False)`): the view judges
        # this snapshot and publishes ours again itself at its next step.
        self.v.apply(Synced(at=self.now), self.now)
        self.v.apply(BrokerChecked(broker="b", ok=True), self.now)

    def step(self) -> None:
        """What the agent's `_step` does with the view's plan."""
        runs = self.desired.run and (self.desired.domain, self.desired.clique) == self.v.current
        plan = self.v.derive(
            self.now,
            wall_now=WALL + self.now,
            saved=NodeState(),
            running=runs,
            release=lambda: self.released,
        )
        if plan.hold or plan.desired is None:
            return
        if plan.desired.cleanup:
            self.set(plan.desired)
            if plan.leave:
                self.ours = None
                self.write(ME, None)
                self.v.left()
            return
        decision = plan.decision
        assert decision is not None
        if plan.publish:
            record = self.v.record(decision.claim, driver="")
            self.v.sending(record)
            self.v.published = self.v.published or record is not None
            self.ours = record
            self.write(ME, record)
        self.v.commit(plan)
        self.set(plan.desired)

    def set(self, desired: Desired) -> None:
        old = self.desired
        if old.run and not (desired.run and desired.slot == old.slot):
            assert self.excused or self.released or self.protocol != "5", (
                f"the daemon on slot {old.slot} was "
                f"{'moved to ' + str(desired.slot) if desired.run else 'stopped'} "
                f"without an own reason: {self.trace}"
            )
        if desired.run and not (old.run and old.slot == desired.slot):
            self.excused = False  # a new start: its own record of reasons
            self.note("a daemon started")
        if desired.run and self.v.decision and self.v.decision.reason is Reason.SLOT_CONTESTED:
            self.note("a running daemon's slot was contested")
        self.desired = desired


def hostile(draw: Callable[[st.SearchStrategy[Any]], Any], world: World) -> MemberRecord:
    """A record a hostile client writes: any node, state, slot, stamp (ours copied too)."""
    node = draw(st.sampled_from(HOSTILE))
    state = draw(st.sampled_from([MemberState.MEMBER, MemberState.MEMBER, MemberState.CLAIMING]))
    slot = world.v.claim.slot if draw(st.booleans()) else None
    slot = slot if slot is not None else draw(st.integers(0, 3))
    ours = world.v.claim.settled or WALL
    kind = draw(st.sampled_from(STAMPS))
    stamp = {
        "copy": ours,
        "zero": 0.0,
        "negative": -1.0,
        "earlier": ours - 1000,
        "later": ours + 1,
        "future": WALL + world.now + 3600,
        "none": None,
    }[kind]
    return MemberRecord(
        node=node,
        domain=DOMAIN,
        clique=CLIQUE,
        address=FORGED_AT,
        slot=slot,
        incarnation=draw(st.sampled_from([1, 2, 99])),
        state=state,
        max_nodes=draw(st.sampled_from([4, 4, 4, 8])),
        mode="names",
        settled=stamp if state is MemberState.MEMBER else None,
    )


def tombstone_of(node: str, hold_s: float = 0.0) -> MemberRecord:
    """A fired will of `node` (state lost), as the broker publishes it."""
    return MemberRecord(
        node=node,
        domain=DOMAIN,
        clique=CLIQUE,
        address=FORGED_AT,
        slot=None,
        incarnation=1,
        state=MemberState.LOST,
        max_nodes=4,
        mode="names",
        hold_s=hold_s,
    )


OPS = (
    "forge",
    "forge",
    "forge",
    "tombstone",
    "clear",
    "deliver",
    "deliver",
    "deliver",
    "time",
    "drop",
    "will",
    "wipe",
    "reconnect",
    "spec",
    "release",
)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_no_running_daemon_stops_without_an_own_reason(data: st.DataObject) -> None:
    """Hostile records (forged members on our slot with any stamp, copies, 0, negative,
    future, lower and higher names, claims, records over our own topic, tombstones and
    clears of peers and of ourselves), link drops, fired wills, a broker that loses its
    state, reconnects, spec changes and daemon failures, in any interleaving: once our
    daemon runs on slot s, it stops or moves only after an own reason or a reconnect
    whose snapshot no longer held our record."""
    world = started(event)
    for _ in range(data.draw(st.integers(5, 60), label="ops")):
        op = data.draw(st.sampled_from(OPS))
        world.trace.append(op)
        if op == "forge":
            record = hostile(data.draw, world)
            world.trace.append(f"{record.node}:{record.state.value}@{record.slot}")
            world.write(record.node, record)
        elif op == "tombstone":
            node = data.draw(st.sampled_from(HOSTILE))
            world.write(node, tombstone_of(node, data.draw(st.sampled_from([0.0, 3.0]))))
        elif op == "clear":
            world.write(data.draw(st.sampled_from(HOSTILE)), None)
        elif op == "deliver":
            world.deliver(data.draw(st.integers(1, 4)))
        elif op == "time":
            world.now += data.draw(st.sampled_from([0.1, SETTLE_S, 3.0, 40.0]))
        elif op == "drop" and world.connected:
            world.drop()
        elif op == "will" and not world.connected:
            world.retained[ME] = tombstone_of(ME)
        elif op == "wipe" and not world.connected:
            world.retained.clear()
            world.spec = None
        elif op == "reconnect" and not world.connected:
            protocols: list[Protocol] = ["5", "5", "5", "3.1.1"]
            protocol = data.draw(st.sampled_from(protocols))
            world.reconnect(lambda events: data.draw(st.permutations(events)), protocol)
        elif op == "spec":
            world.write_spec(data.draw(st.sampled_from(SPECS)))
        elif op == "release":
            world.released = True
        world.step()
        # Whatever drops a record drops its "unconfirmed" mark too (a peer's tombstone
        # whose hold ran out while its record was unconfirmed once crashed the step).
        assert world.v.peers.unconfirmed <= set(world.v.records), world.trace


def test_the_model_runs_a_daemon_and_keeps_it_through_hostile_records() -> None:
    """The property's model, unrolled once: a lone node settles and runs; a forged
    member with our stamp and a lower name, a link drop and a reconnect keep it."""
    world = started()
    world.deliver(1)
    world.now = SETTLE_S + 0.1
    world.step()
    world.deliver(1)
    world.step()
    assert (world.desired.run, world.desired.slot) == (True, 0)
    world.write("a0", forged("a0", 0, world.v.claim.settled))
    world.deliver(1)
    world.step()
    world.drop()
    world.reconnect(list)
    world.step()
    assert (world.desired.run, world.desired.slot, world.excused) == (True, 0, False)
    assert world.retained[ME] == world.ours
