"""The agent's shard view, pure: bus events in, plans out, on a fake clock.

No broker, no daemon, no event loop: each test feeds `ShardView.apply` the events the
bus would deliver and reads what `derive` tells the agent to do.
"""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
from hypothesis import given

from imexd.bus.events import (
    BrokerChecked,
    Connected,
    Disconnected,
    EchoLost,
    Refused,
    SubscribeRefused,
    Synced,
)
from imexd.logs import get_logger
from imexd.membership import slots as mb
from imexd.membership.claim import Echo, Phase, Reason
from imexd.membership.desired import Desired
from imexd.membership.shard import (
    FIRST_START_WINDOWS,
    OVERWRITE_PACE_S,
    RECLAIMS_ON_LOST_ECHO,
    Identity,
    Plan,
    ShardView,
)
from imexd.messages import (
    MAX_HOLD_S,
    Deleted,
    DomainSpec,
    MemberRecord,
    MemberState,
    Presence,
    Received,
)
from imexd.nodestate import NodeState
from imexd.topics import TopicRef, Topics

CLAIMING = MemberState.CLAIMING
ME = "n1"
MY_ADDRESS = "10.0.0.1"
DOMAIN, CLIQUE = "d1", "c1"
SETTLE_S = 1.0
GRACE_S = 5.0
WALL = 1_700_000_000.0
SESSION_TAKEN_OVER = 0x8E


def view(incarnation: int = 3) -> ShardView:
    """A view of n1 (incarnation 3) that joined d1/c1 at t=0 and holds a synced snapshot."""
    v = ShardView(
        node=ME,
        address=MY_ADDRESS,
        max_nodes=4,
        mode="names",
        settle_s=SETTLE_S,
        claim_stale_s=30.0,
        confirm_grace_s=GRACE_S,
        log=get_logger("test"),
    )
    v.start(incarnation)
    v.join((DOMAIN, CLIQUE), now=0.0)
    v.apply(Synced(at=0.0), now=0.0)
    return v


def rec(
    node: str,
    slot: int | None,
    state: MemberState = MemberState.MEMBER,
    *,
    inc: int = 1,
    address: str = "",
    settled: float | None = WALL - 100,
) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain=DOMAIN,
        clique=CLIQUE,
        address=address or f"10.0.1.{sum(map(ord, node)) % 250 + 1}",
        slot=slot,
        incarnation=inc,
        state=state,
        max_nodes=4,
        mode="names",
        settled=settled if state is MemberState.MEMBER else None,
    )


def received(record: MemberRecord, *, retained: bool = True) -> Received:
    ref = TopicRef(kind="member", domain=record.domain, clique=record.clique, node=record.node)
    return Received(topic="t", ref=ref, payload=record, retained=retained)


def deleted(node: str) -> Deleted:
    ref = TopicRef(kind="member", domain=DOMAIN, clique=CLIQUE, node=node)
    return Deleted(topic="t", ref=ref, retained=False)


def derive(v: ShardView, now: float, *, running: bool = False) -> Plan:
    return v.derive(
        now, wall_now=WALL + now, saved=NodeState(), running=running, release=lambda: False
    )


def publish(v: ShardView, plan: Plan, now: float) -> None:
    """What the agent does with a plan: publish (the broker echoes it), then commit."""
    if plan.decision is not None and plan.publish:
        record = v.record(plan.decision.claim, driver="")
        v.sending(record)
        v.published = v.published or record is not None
        if record is not None:
            v.apply(received(record, retained=False), now)
            # After the first live echo of our record on a link, the bus checks that the
            # broker gives it back retained to a wildcard subscription.
            v.apply(BrokerChecked(broker="b", ok=True), now)
    v.commit(plan)


def settle(v: ShardView) -> Plan:
    """Claim, echo and settle; the plan of the settling step."""
    publish(v, derive(v, 0.0), 0.0)
    plan = derive(v, SETTLE_S + 0.1)
    publish(v, plan, SETTLE_S + 0.1)
    return plan


def test_nothing_is_derived_before_the_snapshot() -> None:
    """Until the retained snapshot completed, the view asks for nothing."""
    v = view()
    v.join((DOMAIN, CLIQUE), now=10.0)
    v.apply(Synced(at=9.0), now=10.0)  # a snapshot of the old subscriptions
    assert derive(v, 10.0) == Plan()
    v.apply(Synced(at=10.5), now=10.5)
    assert derive(v, 10.5).publish


def test_only_a_snapshot_of_the_shards_filters_syncs_the_view() -> None:
    """A Synced that proves other filters (an earlier subscription's round trip, ended
    after the join) does not sync the view; one that covers its filters does."""
    v = view()
    members = f"imex/v2/domains/{DOMAIN}/members/{CLIQUE}/+"
    spec = f"imex/v2/domains/{DOMAIN}/spec"
    v.join((DOMAIN, CLIQUE), now=10.0, needs=frozenset({members, spec}))
    v.apply(Synced(at=10.5, filters=frozenset({"imex/v2/nodes/n1/ping", spec})), now=10.5)
    synced = [v.synced]
    assert derive(v, 10.5) == Plan()
    v.apply(Synced(at=10.6, filters=frozenset({members, spec, "x/+"})), now=10.6)
    synced.append(v.synced)
    assert synced == [False, True]
    assert derive(v, 10.6).publish


def test_a_refused_subscription_holds_the_view_until_the_bus_syncs_again() -> None:
    """A filter the broker refuses (a clustered broker after a server died) leaves a
    partial view: nothing is derived until the bus got it and synced again."""
    v = view()
    v.join((DOMAIN, CLIQUE), now=10.0)
    v.apply(Synced(at=10.5), now=10.5)
    synced = [v.synced]
    topic_filter = f"imex/v2/domains/{DOMAIN}/members/+"
    v.apply(SubscribeRefused("mqtt://b:1883", topic_filter, "code 128", "refused"), now=11.0)
    synced.append(v.synced)
    assert derive(v, 11.0) == Plan()
    v.apply(Synced(at=11.5), now=11.5)
    synced.append(v.synced)
    assert synced == [True, False, True]
    assert derive(v, 11.5).publish


def test_a_lone_node_claims_then_settles_and_runs() -> None:
    """The first step publishes a claim; its live echo makes it a member."""
    v = view()
    first = derive(v, 0.0)
    assert first.decision is not None
    assert first.publish
    assert first.desired is not None
    assert not first.desired.run
    record = v.record(first.decision.claim, driver="")
    assert record is not None
    assert (record.state, record.slot, record.incarnation) == (MemberState.CLAIMING, 0, 3)
    publish(v, first, 0.0)
    plan = derive(v, SETTLE_S + 0.1)
    assert plan.desired is not None
    assert plan.desired.run
    assert plan.desired.slot == 0
    assert {s: (m.node, m.address) for s, m in plan.desired.members.items()} == {
        0: (ME, MY_ADDRESS)
    }
    publish(v, plan, SETTLE_S + 0.1)
    assert v.facts(plan.desired).state == "member"


@given(
    peers=st.dictionaries(
        st.sampled_from(["n0", "n2", "n3", "n4", "n5"]),
        st.tuples(st.integers(0, 3), st.sampled_from(list(MemberState))),
        max_size=5,
    )
)
def test_decided_members_are_those_a_second_resolve_gave(
    peers: dict[str, tuple[int, MemberState]],
) -> None:
    """`Decision.members` names the same (node, address) per slot as resolving the
    records again with our own published record did (the agent's former second pass)."""
    v = view()
    for node, (slot, state) in peers.items():
        keep = None if state in (MemberState.STANDBY, MemberState.LEAVING) else slot
        v.apply(received(rec(node, keep, state)), 0.0)
    plan = settle(v)
    assert plan.decision is not None
    assert plan.desired is not None
    records = dict(v.records)
    mine = v.record(v.claim, driver="")
    if mine is not None:
        records[ME] = mine
    else:
        records.pop(ME, None)
    stale = mb.stale_claims(
        v.records.values(),
        {node: at for node, (_, at) in v.peers.claims_seen.items()},
        now=SETTLE_S + 0.1,
        stale_after_s=v.claim_stale_s,
        me=ME,
    )
    again = mb.resolve(records.values(), max_nodes=4, wall_now=WALL + SETTLE_S + 0.1, stale=stale)
    expected = {slot: (r.node, r.address) for slot, r in again.members.items()}
    assert plan.decision.members(MY_ADDRESS) == expected
    assert {s: (m.node, m.address) for s, m in plan.desired.members.items()} == expected


def test_records_missing_after_a_reconnect_are_kept_for_the_grace() -> None:
    """A new link's snapshot without a peer keeps its record until confirm_grace_s."""
    v = view()
    v.apply(received(rec("n2", 1)), 0.0)
    v.apply(Connected(broker="b", protocol="5", will_delay=True), 1.0)
    v.apply(Synced(at=1.0), 1.0)
    assert v.peers.confirm_by == 1.0 + GRACE_S
    derive(v, 2.0)
    assert "n2" in v.records
    derive(v, 1.0 + GRACE_S)
    assert "n2" not in v.records
    assert v.peers.confirm_by is None


def test_a_confirmed_record_supersedes_an_unconfirmed_one_on_its_slot() -> None:
    """A record seen again on the new link drops the stale one that held its slot."""
    v = view()
    v.apply(received(rec("n2", 1)), 0.0)
    v.apply(Connected(broker="b", protocol="5", will_delay=True), 1.0)
    v.apply(received(rec("n3", 1)), 1.0)
    v.apply(Synced(at=1.0), 1.0)
    derive(v, 1.5)
    assert set(v.records) == {"n3"}


def test_a_record_dropped_unconfirmed_is_taken_again_when_it_comes_unchanged() -> None:
    """Seen in the delayed-deliveries formation test under load: views that were ready
    lacked settled members the broker held, for good. A record that a new link did not
    confirm within the grace (or that another record's slot superseded) was dropped, but
    its version stayed, so the same record given again later was taken for a copy of
    what we hold and never came back. It stands on the broker, so it stands here."""
    for superseded in (False, True):
        v = view()
        v.apply(received(msgspec.structs.replace(rec("n2", 1), seq=1, link=1)), 0.0)
        v.apply(Connected(broker="b", protocol="5", will_delay=True), 1.0)
        if superseded:
            v.apply(received(msgspec.structs.replace(rec("n3", 1), seq=1, link=1)), 1.0)
        v.apply(Synced(at=1.0), 1.0)
        derive(v, 1.0 + GRACE_S)
        assert "n2" not in v.records
        v.apply(received(msgspec.structs.replace(rec("n2", 1), seq=1, link=1)), 1.5 + GRACE_S)
        derive(v, 1.6 + GRACE_S)
        assert "n2" in v.records, superseded


def test_our_own_record_does_not_supersede_an_unconfirmed_one() -> None:
    """Found by the simulator (seed 400665): a broker restarted from its disk gave back our
    claim that had lost to n2's member on its slot, beside n2's record, which a will of
    the shutdown had ended unproven; our own claim dropped n2's record at once as if the
    slot had been settled meanwhile, our claim settled there, and n2 came back to it: two
    members on one slot. Our own record says nothing of the others."""
    v = view()
    v.apply(received(rec("n2", 1)), 0.0)
    ours = msgspec.structs.replace(
        rec(ME, 1, state=MemberState.CLAIMING, address=MY_ADDRESS), seq=1, link=1
    )
    v.apply(Connected(broker="b", protocol="5", will_delay=True), 1.0)
    v.apply(received(ours), 1.0)
    v.apply(Synced(at=1.0), 1.0)
    derive(v, 1.5)
    assert "n2" in v.records
    assert "n2" in v.peers.unconfirmed


def test_deletions_that_no_round_trip_proved_come_back_when_the_link_ends() -> None:
    """A broker shutting down publishes every will, then drops the link: the deletions
    that no round trip came back after return, unconfirmed; a proven one stays gone."""
    v = view()
    v.apply(received(rec("n2", 1)), 0.0)
    v.apply(received(rec("n3", 2)), 0.0)
    v.apply(deleted("n2"), 0.0)
    v.proven(v.proof_mark())
    v.apply(deleted("n3"), 5.0)
    v.apply(Disconnected(broker="b", reason="lost"), 50.0)
    assert set(v.records) == {"n3"}
    assert v.peers.unconfirmed == {"n3"}
    assert not v.synced
    assert not v.unproven


def test_a_record_of_our_name_that_we_did_not_write_is_replaced_at_once() -> None:
    """A record of our name before we published, live or retained, published again or
    not, is no evidence of a second agent: we claim over it at once, newer than it."""
    v = view()
    other = rec(ME, 0, inc=9, address="10.9.9.9")
    assert v.apply(received(other, retained=False), 0.0) is None
    again = msgspec.structs.replace(other, settled=WALL)
    assert v.apply(received(again, retained=False), 0.1) is None
    plan = derive(v, 0.1)
    assert plan.outbid
    assert plan.publish
    assert plan.decision is not None
    assert v.incarnation == 10
    record = v.record(plan.decision.claim, driver="")
    assert record is not None
    assert record.incarnation == 10
    assert v.duplicate == ""


def test_a_taken_session_is_a_duplicate_unless_we_hold_a_settled_slot() -> None:
    """Another client took our session: without a settled slot we stand aside (even with
    a claim out); with one we keep it and its daemon."""
    taken = Disconnected(broker="b", reason="taken", reason_code=SESSION_TAKEN_OVER)
    assert view().apply(taken, 0.0) is Identity.ASIDE
    claiming = view()
    publish(claiming, derive(claiming, 0.0), 0.0)
    assert claiming.apply(taken, 0.5) is Identity.ASIDE
    assert not claiming.published  # its record is the other agent's now: never cleared
    v = view()
    settle(v)
    assert v.apply(taken, 3.0) is None
    assert v.duplicate == ""


def _links_taken(v: ShardView, other: MemberRecord) -> Identity | None:
    """Two links (at 3 and 4 s) that end without a reason code, each after `other`, a
    record of our name, came live on it: what the last end says."""
    taken = None
    for at in (3.0, 4.0):
        v.apply(Connected(broker="b", protocol="3.1.1", will_delay=False), at)
        v.apply(received(msgspec.structs.replace(other, seq=int(at)), retained=False), at)
        taken = v.apply(Disconnected(broker="b", reason="lost"), at + 0.5)
    return taken


def test_links_taken_in_a_row_after_another_writer_are_a_duplicate() -> None:
    """Without a reason code, links ended while only a retained record of our name stood
    prove nothing; TAKEN_LINKS links in a row, each after another writer published a
    record of our name live on it, are a second agent: stand aside, back once it is gone."""
    v = view()
    other = rec(ME, 0, inc=9, address="10.9.9.9")
    v.apply(received(other), 0.0)
    lost = Disconnected(broker="b", reason="lost")
    assert v.apply(lost, 1.0) is None
    assert v.apply(lost, 2.0) is None
    assert _links_taken(v, other) is Identity.ASIDE
    v.apply(Connected(broker="b", protocol="3.1.1", will_delay=False), 5.0)
    v.apply(Synced(at=5.0), 5.0)
    plan = derive(v, 5.0)
    assert (plan.hold, plan.desired) == (True, None)  # what runs keeps running
    assert v.facts(Desired()).reason == "DuplicateNode"
    assert v.apply(deleted(ME), 6.0) is Identity.BACK
    assert v.duplicate == ""


def test_an_aside_agent_comes_back_when_no_link_gives_the_other_record_back() -> None:
    """Standing aside, our link ends with a broker that restarted empty: the other agent's
    record never comes back (no agent of our name publishes it) and, once the new link's
    grace is over, it is gone as surely as by a clear: back under our own identity."""
    v = view()
    other = rec(ME, 0, inc=9, address="10.9.9.9")
    v.apply(received(other), 0.0)
    assert _links_taken(v, other) is Identity.ASIDE
    v.apply(Connected(broker="b", protocol="3.1.1", will_delay=False), 5.0)
    v.apply(Synced(at=5.0), 5.0)  # an empty snapshot
    assert derive(v, 5.0).hold
    identities = [v.identity]  # None: within the grace the other may still publish it
    due = v.due_at(5.0)
    assert due == 5.0 + GRACE_S
    plan = derive(v, due)
    identities.append(v.identity)
    assert identities == [None, Identity.BACK]
    assert v.duplicate == ""
    assert not plan.hold


def test_a_stale_record_of_our_name_is_outbid_at_once() -> None:
    """A record of our name with a higher incarnation (a run of ours we never saved):
    raise ours over it at once, no watch."""
    v = view()
    v.apply(received(rec(ME, 0, inc=9)), 0.0)
    plan = derive(v, 0.0)
    assert plan.outbid
    assert v.incarnation == 10
    assert plan.decision is not None
    record = v.record(plan.decision.claim, driver="")
    assert record is not None
    assert record.incarnation == 10


def test_a_deleted_domain_is_left_once() -> None:
    """A spec in state deleting: clean up, and clear our records only the first time."""
    v = view()
    settle(v)
    spec = DomainSpec(domain=DOMAIN, state="deleting")
    ref = TopicRef(kind="spec", domain=DOMAIN)
    v.apply(Received(topic="t", ref=ref, payload=spec, retained=False), 2.0)
    plan = derive(v, 2.0)
    assert plan.leave
    assert plan.desired is not None
    assert plan.desired.cleanup
    v.left()
    assert v.facts(plan.desired).state == "leaving"
    assert not derive(v, 3.0).leave


def test_a_spec_with_other_max_nodes_is_a_mismatch() -> None:
    """The spec's max_nodes differs from ours: NodeMapMismatch, and no daemon starts."""
    v = view()
    spec = DomainSpec(domain=DOMAIN, max_nodes=8)
    ref = TopicRef(kind="spec", domain=DOMAIN)
    v.apply(Received(topic="t", ref=ref, payload=spec, retained=True), 0.0)
    plan = settle(v)
    assert plan.desired is not None
    assert not plan.desired.run
    assert plan.mismatch_detail.startswith(f"{ME}: max_nodes 4 here, the domain spec says 8")
    assert v.facts(plan.desired).reason == "NodeMapMismatch"
    kept = derive(v, 2.0, running=True)
    assert kept.desired is not None
    assert kept.desired.run  # a mismatch never stops a running daemon


def test_with_a_spec_only_the_node_that_disagrees_with_it_is_refused() -> None:
    """The spec decides max_nodes: a member with another max_nodes refuses itself (its
    message names it first) and never keeps the nodes that match the spec from starting."""
    v = view()
    spec = DomainSpec(domain=DOMAIN, max_nodes=4)
    ref = TopicRef(kind="spec", domain=DOMAIN)
    v.apply(Received(topic="t", ref=ref, payload=spec, retained=True), 0.0)
    odd = msgspec.structs.replace(rec("n9", 1), max_nodes=8)
    v.apply(received(odd), 0.0)
    plan = settle(v)
    assert plan.desired is not None
    assert plan.desired.run, "n1 matches the spec: n9's max_nodes is n9's problem"
    assert plan.mismatch == ()
    assert v.facts(plan.desired).reason != "NodeMapMismatch"

    w = view()
    w.apply(
        Received(topic="t", ref=ref, payload=DomainSpec(domain=DOMAIN, max_nodes=8), retained=True),
        0.0,
    )
    w.apply(received(rec("n2", 1)), 0.0)  # max_nodes 4 like n1, both against the spec's 8
    plan = settle(w)
    assert plan.desired is not None
    assert not plan.desired.run
    assert plan.mismatch == (), "the spec decides: n2 is not the odd one here"
    assert plan.mismatch_detail.startswith(f"{ME}: max_nodes 4 here, the domain spec says 8")


def test_our_cleared_record_is_published_again() -> None:
    """Someone cleared our record (a duplicate's will, an operator): publish it again."""
    v = view()
    settle(v)
    v.apply(deleted(ME), 3.0)
    assert v.reassert_at == 3.0
    assert derive(v, 3.0).publish


# The barrier: our claim settles at its own live echo, by the broker's order.


def claim(v: ShardView, now: float) -> MemberRecord:
    """Derive and publish the first claim, without its echo; the record sent."""
    plan = derive(v, now)
    assert plan.decision is not None
    assert plan.publish
    record = v.record(plan.decision.claim, driver="")
    assert record is not None
    v.sending(record)
    v.published = True
    v.commit(plan)
    return record


def slot_phase(v: ShardView, now: float) -> tuple[int | None, Phase, bool]:
    """Step (and publish what the step asks, without its echo): our slot and phase."""
    plan = derive(v, now)
    if plan.decision is not None and plan.publish:
        record = v.record(plan.decision.claim, driver="")
        v.sending(record)
    v.commit(plan)
    return v.claim.slot, v.claim.phase, bool(plan.desired and plan.desired.run)


def reason(v: ShardView) -> Reason | None:
    """The reason of the last step (None: no step yet)."""
    return v.decision.reason if v.decision is not None else None


def barrier_of(v: ShardView) -> Echo | None:
    """The barrier of our claim as the view holds it now."""
    return v.echo


def test_a_rival_claim_before_my_echo_beats_me_even_with_a_higher_name() -> None:
    """n9's claim on our slot reached us before our echo: the broker accepted it first.
    We wait for the echo, whose view deals our next slot, and move then."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(received(rec("n9", mine.slot, CLAIMING), retained=False), 0.1)
    assert slot_phase(v, 0.1)[:2] == (mine.slot, Phase.CLAIMING)
    assert reason(v) is Reason.WAITING_FOR_ECHO
    v.apply(received(mine, retained=False), 0.2)
    slot, phase, _ = slot_phase(v, 0.2)
    assert (phase, slot) == (Phase.CLAIMING, 1)
    assert reason(v) is Reason.LOST_CONFLICT


def test_a_rival_claim_after_my_echo_loses_even_with_a_lower_name() -> None:
    """n0's claim on our slot came after our echo: accepted after ours, it cannot win."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(received(mine, retained=False), 0.1)
    v.apply(received(rec("n0", mine.slot, CLAIMING), retained=False), 0.1)
    v.apply(BrokerChecked(broker="b", ok=True), 0.1)
    slot, phase, _ = slot_phase(v, 0.2)
    assert (phase, slot) == (Phase.MEMBER, mine.slot)


def test_a_retained_copy_of_my_claim_is_no_echo() -> None:
    """Our claim in a snapshot (retained) settles nothing; a later rival still beats it."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(received(mine, retained=True), 0.1)
    assert v.echo is None
    assert slot_phase(v, 0.2)[1] is Phase.CLAIMING
    v.apply(received(rec("n9", mine.slot, CLAIMING), retained=False), 0.3)
    assert slot_phase(v, 0.3)[:2] == (0, Phase.CLAIMING)  # lost; waits for the echo
    v.apply(received(mine, retained=False), 0.4)
    echo = barrier_of(v)
    assert echo is not None
    assert echo.rival is not None
    assert slot_phase(v, 0.4)[:2] == (1, Phase.CLAIMING)


def test_an_old_echo_with_the_same_bytes_is_not_the_barrier() -> None:
    """Slot 0, then 1, then 0 again: the echo of the first claim is not the last one's."""
    v = view()
    first = claim(v, 0.0)
    other = msgspec.structs.replace(first, slot=1)
    v.sending(other)  # moved before any echo (a spec's position does that)
    v.sending(first)  # and back
    v.apply(received(first, retained=False), 0.3)  # the echo of the FIRST claim of 0
    assert v.echo is None
    v.apply(received(other, retained=False), 0.35)
    assert v.echo is None
    assert v.in_flight  # the last claim of 0 is still on its way
    v.apply(received(rec("n7", 0, CLAIMING), retained=False), 0.4)  # accepted before ours
    v.apply(received(first, retained=False), 0.5)  # the last claim's echo
    echo = barrier_of(v)
    assert echo is not None
    assert echo.rival == rec("n7", 0, CLAIMING)
    assert slot_phase(v, 0.5)[:2] == (1, Phase.CLAIMING)


def test_a_claim_in_flight_loses_to_a_rival_in_the_new_snapshot() -> None:
    """A reconnect voids the old echo (the bus's replay before the sync is none); a
    rival in the new link's snapshot counts as earlier than our claim, which is
    published again: we move at its new echo."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(Connected(broker="b", protocol="5", will_delay=True), 0.1)
    v.apply(received(mine, retained=False), 0.2)  # the bus's replay, before the sync
    assert v.echo is None
    v.apply(received(rec("n9", mine.slot, CLAIMING), retained=True), 0.2)
    v.apply(Synced(at=0.3), 0.3)
    assert slot_phase(v, 0.3)[:2] == (mine.slot, Phase.CLAIMING)
    assert v.in_flight  # published again, waiting for the new link's echo
    v.apply(received(mine, retained=False), 0.4)  # the new link's echo
    assert slot_phase(v, 0.4)[:2] == (1, Phase.CLAIMING)


def test_a_clear_claim_on_a_new_link_settles_on_its_new_echo() -> None:
    """After a reconnect the claim is published again (same record) and only the new
    link's echo settles it; the old link's echo arriving late settles nothing."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(Connected(broker="b", protocol="5", will_delay=True), 0.1)
    v.apply(received(mine, retained=False), 0.15)  # the bus's replay, before the sync
    v.apply(Synced(at=0.2), 0.2)
    assert v.echo is None
    assert slot_phase(v, 0.2)[1] is Phase.CLAIMING  # published again, not settled
    assert v.in_flight
    v.apply(received(mine, retained=False), 0.3)  # the new echo
    v.apply(BrokerChecked(broker="b", ok=True), 0.3)  # the new link's broker check
    assert slot_phase(v, 0.3)[:2] == (mine.slot, Phase.MEMBER)


def refused(record: MemberRecord, *, repaired: bool = True) -> Refused:
    """The bus's verdict when our publication of `record` did not come back in time."""
    topic = Topics("imex/v2").member(record.domain, record.clique, record.node)
    ref = TopicRef("member", record.domain, record.clique, record.node)
    return Refused(topic, "did not come back", ref=ref, repaired=repaired)


def test_a_claim_whose_echo_was_lost_is_published_again_and_settles_on_the_new_echo() -> None:
    """Seen on a three-server NATS cluster: the broker kept a claim but never delivered
    its echo to the claimant, which waited for it until the link ended (a member missing
    from the whole clique). A claim whose echo timed out is published again (at most
    RECLAIMS_ON_LOST_ECHO times) and settles on that publication's echo only."""
    v = view()
    mine = claim(v, 0.0)
    assert v.in_flight
    assert v.echo is None
    v.apply(refused(mine), 5.0)
    plan = derive(v, 5.0)
    assert plan.publish, "the claim is published again"
    assert not v.in_flight, "the lost publication's echo no longer counts"
    publish(v, plan, 5.1)  # published again; its echo comes back
    assert slot_phase(v, 5.2)[:2] == (mine.slot, Phase.MEMBER)


def test_a_claim_the_broker_kept_without_its_echo_is_published_again() -> None:
    """Seen on a three-server NATS cluster at 256 nodes: a re-read's snapshot held our
    claim (so the bus did not call it refused) but its live echo never came; the claimant
    waited for good and its clique never formed. EchoLost on a repaired link publishes the
    claim again, like a lost echo."""
    v = view()
    mine = claim(v, 0.0)
    topic = Topics("imex/v2").member(mine.domain, mine.clique, mine.node)
    ref = TopicRef("member", mine.domain, mine.clique, mine.node)
    v.apply(EchoLost(topic, ref=ref, repaired=True), 5.0)
    plan = derive(v, 5.0)
    assert plan.publish, "the claim is published again"
    publish(v, plan, 5.1)
    assert slot_phase(v, 5.2)[:2] == (mine.slot, Phase.MEMBER)


def test_a_late_echo_on_a_link_that_loses_nothing_is_waited_for() -> None:
    """Seen with 1024 agents on 2 cores and one Mosquitto: echoes came late because the
    agents' loops were seconds behind, and claims published again only added load. On an
    MQTT 5 link whose broker lost nothing the claim waits for its echo."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(refused(mine, repaired=False), 5.0)
    assert not derive(v, 5.0).publish
    assert v.in_flight
    v.apply(received(mine, retained=False), 7.0)  # the late echo
    v.apply(BrokerChecked(broker="b", ok=True), 7.0)
    assert slot_phase(v, 7.1)[:2] == (mine.slot, Phase.MEMBER)


def test_a_claim_is_published_again_on_a_lost_echo_only_a_few_times() -> None:
    """A broker that refuses our publications for good (an ACL) is not asked forever."""
    v = view()
    mine = claim(v, 0.0)
    for attempt in range(RECLAIMS_ON_LOST_ECHO):
        v.apply(refused(mine), 5.0 * (attempt + 1))
        plan = derive(v, 5.0 * (attempt + 1))
        assert plan.publish
        v.sending(v.record(plan.decision.claim, driver="") if plan.decision else None)
        v.commit(plan)
    v.apply(refused(mine), 100.0)
    assert not derive(v, 100.0).publish


# The first start: held while the shard forms, bounded.


def test_the_first_start_waits_for_claims_in_flight() -> None:
    """Settled while n2 still claims: no start until n2 is a member, then one start."""
    v = view()
    publish(v, derive(v, 0.0), 0.0)
    v.apply(received(rec("n2", 1, CLAIMING), retained=False), 0.05)
    plan = derive(v, 0.1)
    publish(v, plan, 0.1)
    assert plan.desired is not None
    assert plan.desired.slot == 0
    assert not plan.desired.run
    assert plan.wake_at == 0.1 + FIRST_START_WINDOWS * SETTLE_S
    assert v.facts(plan.desired).detail.startswith("daemon start waits")
    v.apply(received(rec("n2", 1), retained=False), 0.2)
    started = derive(v, 0.2)
    assert started.desired is not None
    assert started.desired.run
    assert set(started.desired.members) == {0, 1}


def test_the_first_start_waits_for_listed_nodes_but_not_forever() -> None:
    """A spec lists n2 and n3: the start waits for them, at most FIRST_START_WINDOWS x
    settle_s; after the start nothing holds it again."""
    v = view()
    spec = DomainSpec(domain=DOMAIN, nodes=[ME, "n2", "n3"], max_nodes=4)
    ref = TopicRef(kind="spec", domain=DOMAIN)
    v.apply(Received(topic="t", ref=ref, payload=spec, retained=True), 0.0)
    publish(v, derive(v, 0.0), 0.0)
    held = derive(v, 0.1)
    publish(v, held, 0.1)
    assert held.desired is not None
    assert not held.desired.run
    v.apply(received(rec("n2", 1), retained=False), 0.2)
    assert not slot_phase(v, 0.2)[2]
    bound = 0.1 + FIRST_START_WINDOWS * SETTLE_S
    assert slot_phase(v, bound)[2]  # n3 never came: start without it
    v.apply(received(rec("n4", 3, CLAIMING), retained=False), bound + 1)
    assert slot_phase(v, bound + 1)[2]  # started: later claims are joins


def test_a_formed_shard_starts_at_once() -> None:
    """Every listed node a member already: no hold at all."""
    v = view()
    spec = DomainSpec(domain=DOMAIN, nodes=[ME, "n2"], max_nodes=4)
    ref = TopicRef(kind="spec", domain=DOMAIN)
    v.apply(Received(topic="t", ref=ref, payload=spec, retained=True), 0.0)
    v.apply(received(rec("n2", 1)), 0.0)
    plan = settle(v)
    assert plan.desired is not None
    assert plan.desired.run
    assert plan.wake_at is None


# Lost tombstones: a peer's will (state lost) holds its record for hold_s.


def tombstone(node: str, hold_s: float, *, inc: int = 1) -> MemberRecord:
    """The Last Will of `node`: state lost, no slot, `hold_s`."""
    base = rec(node, None, MemberState.STANDBY, inc=inc)
    return msgspec.structs.replace(base, state=MemberState.LOST, settled=None, hold_s=hold_s)


def members(plan: Plan) -> dict[int, str]:
    assert plan.desired is not None
    return {slot: m.node for slot, m in plan.desired.members.items()}


def with_peer() -> tuple[ShardView, MemberRecord]:
    """A settled view of n1 (slot 0) with the member n2 on slot 1."""
    v = view()
    n2 = rec("n2", 1)
    v.apply(received(n2), 0.0)
    settle(v)
    assert members(derive(v, 2.0)) == {0: ME, 1: "n2"}
    return v, n2


def test_a_lost_peer_keeps_its_record_until_hold_s_then_is_dropped() -> None:
    """A peer's tombstone keeps its previous record (and slot) for hold_s, then drops it
    as a clear would, and the plan asks to be derived again when the hold ends."""
    v, n2 = with_peer()
    v.apply(received(tombstone("n2", 5.0), retained=False), 10.0)
    assert v.records["n2"] == n2
    plan = derive(v, 14.9)
    assert members(plan) == {0: ME, 1: "n2"}
    assert plan.wake_at == 15.0
    assert members(derive(v, 15.0)) == {0: ME}
    assert "n2" not in v.records
    assert not v.peers.lost


def test_a_lost_peer_that_comes_back_within_hold_s_is_kept() -> None:
    """A new record of a lost peer cancels the hold: nothing changes, ever."""
    v, n2 = with_peer()
    v.apply(received(tombstone("n2", 5.0), retained=False), 10.0)
    v.apply(received(n2, retained=False), 11.0)
    assert not v.peers.lost
    assert members(derive(v, 20.0)) == {0: ME, 1: "n2"}


def test_a_second_tombstone_keeps_the_first_deadline() -> None:
    """The tombstone again (a new link's snapshot) does not extend the hold."""
    v, _ = with_peer()
    v.apply(received(tombstone("n2", 5.0), retained=False), 10.0)
    v.apply(Connected(broker="b", protocol="3.1.1", will_delay=False, repaired=True), 12.0)
    v.apply(received(tombstone("n2", 5.0)), 12.0)
    v.apply(Synced(at=12.0), 12.0)
    assert "n2" not in v.peers.unconfirmed
    assert members(derive(v, 14.9)) == {0: ME, 1: "n2"}
    assert members(derive(v, 15.0)) == {0: ME}


def test_a_leave_during_the_hold_drops_the_peer_at_once() -> None:
    """A clear (empty payload) while the hold runs drops the peer now."""
    v, _ = with_peer()
    v.apply(received(tombstone("n2", 5.0), retained=False), 10.0)
    v.apply(deleted("n2"), 11.0)
    assert not v.peers.lost
    assert members(derive(v, 11.0)) == {0: ME}


def test_a_tombstone_of_an_unknown_node_stays_out_of_membership() -> None:
    """A lost node this view never had a record of is not a member, not even held."""
    v = view()
    v.apply(received(tombstone("n9", 5.0)), 0.0)
    assert "n9" not in v.records
    assert not v.peers.lost
    settle(v)
    assert members(derive(v, 2.0)) == {0: ME}


def test_a_tombstone_without_hold_drops_the_peer_at_once() -> None:
    """hold_s 0: the broker already waited its Will Delay; the peer goes now."""
    v, _ = with_peer()
    v.apply(received(tombstone("n2", 0.0), retained=False), 10.0)
    assert "n2" not in v.records
    assert members(derive(v, 10.0)) == {0: ME}


def test_a_will_not_newer_than_the_record_changes_nothing() -> None:
    """A will ends its link: it drops the peer's record of that link, but the same will
    again, or a will of an earlier link after the peer's record of a later one (a broker
    that publishes it anew, or re-delivers it), changes nothing; the will of its new link
    drops it again. No time window takes part."""
    v = view()
    n2 = msgspec.structs.replace(rec("n2", 1), seq=1, link=1)
    v.apply(received(n2), 0.0)
    settle(v)
    will1 = msgspec.structs.replace(tombstone("n2", 0.0), link=1)
    v.apply(received(will1, retained=False), 10.0)
    assert members(derive(v, 10.0)) == {0: ME}
    back = msgspec.structs.replace(n2, seq=2, link=2)
    v.apply(received(back, retained=False), 11.0)
    assert members(derive(v, 11.0)) == {0: ME, 1: "n2"}
    for second in range(12, 40):
        v.apply(received(will1, retained=bool(second % 2)), float(second))
        v.apply(received(n2, retained=True), float(second))  # an older copy
        assert members(derive(v, second + 0.5)) == {0: ME, 1: "n2"}, second
        assert v.records["n2"] == back
    will2 = msgspec.structs.replace(will1, link=2)
    v.apply(received(will2, retained=False), 50.0)
    assert members(derive(v, 50.0)) == {0: ME}


def test_an_unproven_will_given_again_in_the_next_snapshot_still_ends_the_record() -> None:
    """Found by the simulator (tests/simulation): a peer's will taken in, the link ended
    before a round trip proved it, so the record came back unconfirmed; the next link's
    snapshot gave the same will again, which equalled the held version and so confirmed
    the dead record, for good. A will given again ends what it ended."""
    v = view()
    n2 = msgspec.structs.replace(rec("n2", 1), seq=1, link=1)
    v.apply(received(n2), 0.0)
    settle(v)
    will = msgspec.structs.replace(tombstone("n2", 0.0), link=1)
    v.apply(received(will, retained=False), 10.0)
    assert "n2" not in v.records
    v.apply(Disconnected(broker="b", reason="lost"), 10.1)  # before any proof
    assert "n2" in v.records  # restored, unconfirmed
    assert "n2" in v.peers.unconfirmed
    reconnect(v, 11.0, received(will))
    assert "n2" not in v.records
    assert members(derive(v, 11.0)) == {0: ME}
    assert members(derive(v, 11.0 + GRACE_S + 1.0)) == {0: ME}


def test_a_will_held_when_the_link_ends_is_unproven_like_a_deletion() -> None:
    """Found by the simulator (tests/simulation): a broker that shuts down publishes every
    will, then closes the links. A peer's will held for its hold_s when our link ended
    was no more proven than a deletion: its hold ran out while the broker was away, and
    the next link's first step dropped the record and let our claim take its slot, which
    the peer, back with the broker, still held. The will comes back as the record did,
    unconfirmed: the peer's newer record confirms it, the grace for a new link ends it."""
    v, n2 = with_peer()
    n2 = msgspec.structs.replace(n2, seq=1, link=1)
    v.apply(received(n2, retained=False), 3.0)
    will = msgspec.structs.replace(tombstone("n2", 5.0), link=1)
    v.apply(received(will, retained=False), 10.0)
    assert "n2" in v.peers.lost
    v.apply(Disconnected(broker="b", reason="lost"), 10.1)  # before any proof
    assert "n2" not in v.peers.lost
    reconnect(v, 20.0, received(n2))  # the broker's copy from before its shutdown
    assert members(derive(v, 20.0)) == {0: ME, 1: "n2"}
    assert "n2" in v.peers.unconfirmed
    back = msgspec.structs.replace(n2, seq=2, link=2)
    v.apply(received(back, retained=False), 21.0)
    assert members(derive(v, 21.0 + GRACE_S)) == {0: ME, 1: "n2"}


def test_a_proven_will_runs_its_hold_across_a_link_end() -> None:
    """A will that a round trip proved was no shutdown's: a link that ends afterwards
    does not bring its record back, and its hold ends it."""
    v, _ = with_peer()
    v.apply(received(tombstone("n2", 5.0), retained=False), 10.0)
    v.proven(v.proof_mark())
    v.apply(Disconnected(broker="b", reason="lost"), 10.1)
    reconnect(v, 11.0)
    assert members(derive(v, 15.0)) == {0: ME}


def test_the_hold_is_clamped() -> None:
    """A tombstone asking for a day is held MAX_HOLD_S at most."""
    v, _ = with_peer()
    v.apply(received(tombstone("n2", 86400.0), retained=False), 10.0)
    assert v.peers.lost["n2"] == 10.0 + MAX_HOLD_S
    assert members(derive(v, 10.0 + MAX_HOLD_S - 0.1)) == {0: ME, 1: "n2"}
    assert members(derive(v, 10.0 + MAX_HOLD_S)) == {0: ME}


def test_our_own_tombstone_makes_us_publish_again() -> None:
    """Our own will while we run (a past link's): as if our record were cleared."""
    v = view()
    settle(v)
    v.apply(received(tombstone(ME, 5.0, inc=3), retained=False), 3.0)
    assert v.reassert_at == 3.0
    assert not v.peers.lost
    assert derive(v, 3.0).publish


def test_the_will_is_our_presence_marked_lost_whatever_the_shard() -> None:
    """One will per agent run: our presence marked lost, with the link it ends and hold_s
    set per link, whether we are in a shard or not, so joining or leaving one never
    changes it (MQTT changes a will only by connecting again)."""
    v = view()
    topics = Topics("imex/v2")
    will = v.will(topics, at=12.5)
    v.join(None, now=1.0)
    assert v.will(topics, at=12.5) == will
    assert will.topic == topics.presence(ME)
    said = msgspec.json.decode(will.payload(5.0, broker_waits=False, link=4), type=Presence)
    assert (said.node, said.address, said.incarnation) == (ME, MY_ADDRESS, 3)
    assert (said.domain, said.at, said.stopped, said.lost) == (None, 12.5, None, True)
    assert (said.link, said.hold_s) == (4, 5.0)
    waited = msgspec.json.decode(will.payload(5.0, broker_waits=True, link=4), type=Presence)
    assert waited.hold_s == 0.0


def presence_will(node: str, *, inc: int = 1, link: int = 1, hold_s: float = 0.0) -> Received:
    will = Presence(
        node=node,
        incarnation=inc,
        at=WALL,
        domain=None,
        address="10.0.9.9",
        lost=True,
        link=link,
        hold_s=hold_s,
    )
    ref = TopicRef(kind="presence", node=node)
    return Received(topic="p", ref=ref, payload=will, retained=False)


def test_our_own_will_given_live_changes_nothing_and_in_a_snapshot_ends_our_record() -> None:
    """Our will given live while our link is up is a broker shutting down (or a forgery):
    no incarnation raised, no reconnect for a new will. In a new link's snapshot it says
    our will fired while we were away: our record of that link is ended, and we claim
    again rather than resume it."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    mine = presence_will(ME, inc=3, link=ours.link)
    v.apply(mine, 3.0)
    assert (v.incarnation, v.outbid) == (3, False)
    assert v.records[ME] == ours
    v.apply(Connected(broker="b", protocol="5", will_delay=True, link=ours.link + 1), 5.0)
    v.apply(Received(mine.topic, mine.ref, mine.payload, retained=True), 5.0)
    v.apply(received(ours), 5.0)
    v.apply(Synced(at=5.0), 5.0)
    assert ME not in v.records
    assert v.incarnation == 3


def test_our_will_seen_before_our_record_still_ends_it() -> None:
    """Found by the simulator: a snapshot gave our presence (our will fired while we were
    away) before our record, or before we joined the shard; nothing was held then, so our
    record, coming next, was resumed on a slot another node had taken. The end our
    presence says is kept node-wide and ends the record that comes after it."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    mine = presence_will(ME, inc=3, link=ours.link)
    v.join(None, now=4.0)
    v.apply(Received(mine.topic, mine.ref, mine.payload, retained=True), 4.5)
    v.join((DOMAIN, CLIQUE), now=5.0)
    v.apply(received(ours), 5.0)
    v.apply(Synced(at=5.0), 5.0)
    assert ME not in v.records


def test_a_replay_of_our_ended_record_given_live_is_not_resumed() -> None:
    """Found by the simulator: a restarted agent's snapshot gave its presence, the will of
    its past run's last link, which ended its record there; then an older record of that
    run came live (a replay on its topic before the agent published), and the agent
    resumed it, old settle stamp and all, on a slot another node had settled since. A
    record of ours that our presence ended is not resumed, however it comes."""
    v = view(incarnation=4)
    v.apply(received(rec("n2", 0, settled=WALL + 10)), 0.1)
    mine = presence_will(ME, inc=3, link=5)
    v.apply(Received(mine.topic, mine.ref, mine.payload, retained=True), 0.1)
    old = msgspec.structs.replace(rec(ME, 0, inc=3, address=MY_ADDRESS), seq=2, link=1)
    v.apply(received(old, retained=False), 0.2)
    assert ME not in v.records
    plan = derive(v, 0.2)
    assert plan.decision is not None
    assert (plan.decision.claim.phase, plan.decision.claim.slot) == (Phase.CLAIMING, 1)


def test_our_record_seen_before_our_will_is_not_resumed_past_a_foreign_one() -> None:
    """Found by the simulator (seed 213750): a restarted agent's snapshot gave its past
    run's record first, kept as the record to resume from (`past`), then its presence,
    the will that ended that record. A record of our name that we did not write came
    next, and the agent resumed from `past`, old settle stamp and all, on a slot another
    node had settled since. A past record that our will ended is not resumed, whichever
    of the two came first."""
    v = view(incarnation=4)
    v.apply(received(rec("n2", 0, settled=WALL + 10)), 0.1)
    old = msgspec.structs.replace(rec(ME, 0, inc=3, address=MY_ADDRESS), seq=2, link=5)
    v.apply(received(old), 0.1)
    mine = presence_will(ME, inc=3, link=5)
    v.apply(Received(mine.topic, mine.ref, mine.payload, retained=True), 0.1)
    v.apply(Synced(at=0.1), 0.1)
    forged = rec(ME, 3, inc=4, state=MemberState.CLAIMING, address="10.66.0.1")
    v.apply(received(msgspec.structs.replace(forged, seq=3, link=2), retained=False), 0.2)
    plan = derive(v, 0.2)
    assert plan.decision is not None
    assert (plan.decision.claim.phase, plan.decision.claim.slot) == (Phase.CLAIMING, 1)


def test_a_record_older_than_the_last_run_that_spoke_is_not_resumed() -> None:
    """Found by the simulator (seeds 600117, 604814): run 2 of a node crashed right after
    it published its presence, which wrote over the will that ended run 1's record; run
    3 found run 1's record and a presence that ended nothing, and resumed the record on a
    slot another node had settled since. Run 2 resumed nothing (it would have published
    the record again as its own): a record of a run before the last one whose presence
    we find is not resumed, as that presence may have replaced the word of its end."""
    v = view(incarnation=3)
    old = msgspec.structs.replace(rec(ME, 0, inc=1, address=MY_ADDRESS), seq=2, link=1)
    v.apply(received(old), 0.1)
    later = Presence(node=ME, incarnation=2, at=WALL, domain=DOMAIN, address=MY_ADDRESS)
    v.apply(Received("p", TopicRef(kind="presence", node=ME), later, retained=True), 0.1)
    v.apply(Synced(at=0.1), 0.1)
    plan = derive(v, 0.2)
    assert plan.decision is not None
    assert plan.decision.claim.phase is Phase.CLAIMING
    assert plan.decision.reason is not Reason.RESUMED


def test_a_clean_stops_presence_ends_the_records_of_its_run() -> None:
    """Found by the simulator: a run that stopped cleanly before it published left the
    previous run's record standing, and a node joining later listed it for good. A
    presence that says the run stopped ends every record of that run and earlier ones."""
    v = view()
    n2 = msgspec.structs.replace(rec("n2", 1, inc=4), seq=2, link=1)
    v.apply(received(n2), 0.0)
    settle(v)
    stopped = Presence(
        node="n2", incarnation=5, at=WALL, domain=None, address="10.0.9.9", stopped=WALL
    )
    v.apply(Received("p", TopicRef(kind="presence", node="n2"), stopped, retained=True), 3.0)
    assert members(derive(v, 3.0)) == {0: ME}


def test_a_will_of_ours_later_than_our_run_is_outbid() -> None:
    """Found by the simulator: a will of our name at a later incarnation than ours (only
    someone else can have written it) stood in every peer's view over our records, which
    they then ignored for good. We raise our incarnation over it, as over any record of
    our name that we did not write."""
    v = view()
    settle(v)
    forged = presence_will(ME, inc=7, link=1)
    v.apply(forged, 3.0)
    assert v.outbid
    plan = derive(v, 3.0)
    assert (plan.outbid, v.incarnation) == (True, 8)


def test_an_incarnation_is_raised_only_by_a_plan_that_hands_it_to_the_agent() -> None:
    """Found by the simulator: a record of our name that we did not write raised our
    incarnation as it came, while the step that watches such a record held (no plan for
    the agent to save the raise from); the agent then stopped, its presence saying the
    raised incarnation, and its next run, one above the saved one, started at it: that
    presence ended every record of the new run. Until a plan carries the raise, our
    presence and will say the incarnation the agent saved."""
    v = ShardView(
        node=ME,
        address=MY_ADDRESS,
        max_nodes=4,
        mode="names",
        settle_s=SETTLE_S,
        claim_stale_s=30.0,
        confirm_grace_s=GRACE_S,
        takeover_watch_s=5.0,
        log=get_logger("test"),
    )
    v.start(1)
    v.join((DOMAIN, CLIQUE), now=0.0)
    v.apply(Synced(at=0.0), now=0.0)
    forged = msgspec.structs.replace(rec(ME, 1, CLAIMING, inc=1, address=MY_ADDRESS), link=3)
    v.apply(received(forged, retained=False), 0.1)
    assert derive(v, 0.1).hold  # watching the record of our name
    assert v.presence(None, at=WALL, stopped=WALL).incarnation == 1
    plan = derive(v, 6.0)  # the watch is over: outbid it
    assert plan.outbid
    assert v.presence(None, at=WALL).incarnation == 2


def test_only_records_found_in_a_snapshot_wait_for_their_presence() -> None:
    """A record that came live has a live writer; one found in a snapshot may be a dead
    node's, so a step that may claim waits for its presence (`found`), and for no other's."""
    v = view()
    v.apply(received(rec("n2", 1)), 0.0)
    v.apply(received(rec("n3", 2), retained=False), 0.1)
    assert v.followed() == {"n2", "n3"}
    assert v.found() == {"n2"}
    v.apply(received(msgspec.structs.replace(rec("n2", 1), seq=3), retained=False), 0.2)
    assert v.found() == frozenset()


def test_a_peers_presence_will_ends_its_record_of_that_link() -> None:
    """A peer's Last Will is its presence, marked lost: it ends the peer's record of its
    link (and earlier ones) as a tombstone on its member topic would, with its hold; a
    will of an earlier link or run changes nothing; a record of a later link comes back."""
    v = view()
    n2 = msgspec.structs.replace(rec("n2", 1), seq=1, link=2)
    v.apply(received(n2), 0.0)
    settle(v)
    assert v.followed() == {"n2"}
    v.apply(presence_will("n2", link=1), 5.0)  # an earlier link's
    assert members(derive(v, 5.0)) == {0: ME, 1: "n2"}
    v.apply(presence_will("n2", link=2, hold_s=2.0), 6.0)
    assert members(derive(v, 7.0)) == {0: ME, 1: "n2"}  # held
    assert members(derive(v, 8.0)) == {0: ME}
    assert v.followed() == frozenset()
    v.apply(received(msgspec.structs.replace(n2, seq=2, link=3), retained=False), 9.0)
    assert members(derive(v, 9.0)) == {0: ME, 1: "n2"}
    v.apply(presence_will("n2", link=2), 10.0)  # the old will again: older
    assert members(derive(v, 10.0)) == {0: ME, 1: "n2"}


def test_a_will_found_in_a_snapshot_drops_the_record_at_once() -> None:
    """A newcomer finds a dead node's record and then, retained, its will: the record was
    dead before we saw it, so no hold keeps it; our own presence is never judged."""
    v = view()
    v.apply(received(msgspec.structs.replace(rec("n2", 1), seq=4, link=1)), 0.0)
    will = presence_will("n2", link=1, hold_s=5.0)
    v.apply(Received(will.topic, will.ref, will.payload, retained=True), 0.1)
    assert "n2" not in v.records
    settle(v)
    assert members(derive(v, 1.0)) == {0: ME}
    mine = presence_will(ME, inc=3, link=1)
    v.apply(mine, 2.0)
    assert members(derive(v, 2.0)) == {0: ME}


def test_a_broker_without_retained_wildcards_unsyncs_the_view() -> None:
    """BrokerChecked not ok: the snapshot cannot be trusted, nothing is derived."""
    v = view()
    v.apply(BrokerChecked(broker="b", ok=False, detail="no"), 0.0)
    assert not v.synced
    assert derive(v, 1.0) == Plan()
    v.apply(BrokerChecked(broker="b", ok=True), 1.0)
    assert not v.synced  # only the next Synced of a trusted link syncs it


def test_a_claim_settles_only_once_the_broker_passed_the_retained_check() -> None:
    """Our claim's echo settles it only on a link whose broker passed the check: a
    snapshot without the peers' records would let two nodes win one slot."""
    v = view()
    plan = derive(v, 0.0)
    assert plan.decision is not None
    record = v.record(plan.decision.claim, driver="")
    v.sending(record)
    v.published = True
    assert record is not None
    v.apply(received(record, retained=False), 0.1)
    v.commit(plan)
    assert derive(v, SETTLE_S + 0.2) == Plan()  # held: nothing settles, nothing changes
    assert v.claim.phase is Phase.CLAIMING
    v.apply(BrokerChecked(broker="b", ok=True), SETTLE_S + 0.3)
    settled = derive(v, SETTLE_S + 0.4)
    assert settled.decision is not None
    assert settled.decision.settled


# The owner is the only author of its record.


def test_a_record_written_over_ours_is_put_back_at_the_next_step() -> None:
    """A live record on our topic that we did not publish, while nothing of ours is in
    flight: the next step publishes ours again; counted, and shown as RecordOverwritten
    until the echo of ours says it stands again (no clock: the count and the log keep
    the history)."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    forged = msgspec.structs.replace(ours, address="10.6.6.6")
    assert v.apply(received(forged, retained=False), 3.0) is None
    assert v.overwritten_total == 1
    plan = derive(v, 3.0)
    assert plan.publish
    assert plan.decision is not None
    assert v.record(plan.decision.claim, driver="") == ours
    assert plan.desired is not None
    assert plan.desired.run  # the daemon is untouched
    facts = v.facts(plan.desired)
    assert (facts.state, facts.reason, facts.overwritten) == ("member", "RecordOverwritten", 1)
    assert "10.6.6.6" in facts.detail
    publish(v, plan, 3.0)  # and its echo: ours stands again
    assert not derive(v, 3.1).publish
    facts = v.facts(plan.desired)
    assert (facts.state, facts.reason, facts.overwritten) == ("member", "", 1)


def test_our_records_carry_their_place_in_this_run() -> None:
    """Each record that says something new gets the next seq; one published again
    unchanged keeps it (peers see no new record); a copy of ours written over it with a
    later place (a forgery of this run) is outranked by the record we put back, so that
    no re-read prefers the forgery as the later copy."""
    v = view()
    assert claim(view(), 0.0).seq == 1
    settle(v)
    ours = v.last_sent
    assert ours is not None
    assert (ours.state, ours.seq) == (MemberState.MEMBER, 2)
    assert v.record(v.claim, driver="") == ours  # nothing new: the same place
    assert v.record(v.claim, driver="") == ours  # asking twice changes nothing
    forged = msgspec.structs.replace(ours, address="10.6.6.6", seq=40)
    v.apply(received(forged, retained=False), 3.0)
    plan = derive(v, 3.0)
    assert plan.publish
    assert plan.decision is not None
    back = v.record(plan.decision.claim, driver="")
    assert back == msgspec.structs.replace(ours, seq=41)
    v2 = view(incarnation=4)  # a new run starts over, after every record of the last
    assert claim(v2, 0.0).seq == 1


def test_what_came_before_our_last_publication_is_no_overwrite() -> None:
    """A record on our topic while our last publication is in flight was accepted before
    it (the broker's order): ours replaces it anyway, nothing is counted."""
    v = view()
    mine = claim(v, 0.0)
    other = rec(ME, 2, CLAIMING, inc=3, address=MY_ADDRESS)
    v.apply(received(other, retained=False), 0.1)
    v.apply(received(mine, retained=False), 0.2)
    assert v.overwritten_total == 0
    assert v.reassert_at is None


def test_overwrites_are_put_back_at_once_and_paced_only_for_a_live_duplicate() -> None:
    """Written over again and again: our record goes back at once each time, and no
    number of overwrites makes a duplicate. Once the broker showed another live session
    with our name, a settled node keeps its slot and daemon, says DuplicateNode, and
    puts its record back at most once per OVERWRITE_PACE_S."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    forged = msgspec.structs.replace(ours, address="10.6.6.6")
    for at in (3.0, 3.5, 4.0):
        v.apply(received(forged, retained=False), at)
        plan = derive(v, at)
        assert plan.publish, at
        publish(v, plan, at)
        v.apply(received(v.last_sent or ours, retained=False), at)  # its echo
    assert plan.desired is not None
    assert v.duplicate == ""
    assert v.facts(plan.desired).reason == ""  # each put back, each echoed
    taken = Disconnected(broker="b", reason="taken", reason_code=SESSION_TAKEN_OVER)
    assert v.apply(taken, 5.0) is None
    reconnect(v, 5.0)
    publish(v, derive(v, 5.0), 5.0)
    v.apply(received(v.last_sent or ours, retained=False), 5.0)
    v.last_reassert = 5.0
    v.apply(received(forged, retained=False), 5.5)
    plan = derive(v, 5.5)
    assert not plan.publish  # paced
    assert plan.wake_at == 5.0 + OVERWRITE_PACE_S
    assert plan.desired is not None
    assert plan.desired.run
    facts = v.facts(plan.desired)
    assert (facts.state, facts.reason) == ("member", "DuplicateNode")
    assert derive(v, 5.0 + OVERWRITE_PACE_S).publish


def test_a_claim_written_over_again_is_put_back() -> None:
    """Without a settled slot too, a record written over ours again and again is put
    back each time: only a live session shows a second agent."""
    v = view()
    mine = claim(v, 0.0)
    v.apply(received(mine, retained=False), 0.1)
    forged = msgspec.structs.replace(mine, address="10.6.6.6")
    assert v.apply(received(forged, retained=False), 0.2) is None
    publish(v, derive(v, 0.3), 0.3)
    assert v.last_sent is not None
    v.apply(received(v.last_sent, retained=False), 0.35)  # its echo
    assert v.apply(received(forged, retained=False), 0.4) is None
    assert v.duplicate == ""
    assert v.reassert_at is not None  # ours goes back at the next step


def test_our_past_run_is_resumed_over_a_record_of_our_name_written_after_it() -> None:
    """The snapshot holds our past run's member record (lower incarnation, our address),
    then a record of our name from elsewhere arrives live: one record is not a second
    agent; we resume our slot (no claim, no watch) and publish ours over it."""
    v = view()
    past = rec(ME, 2, inc=2, address=MY_ADDRESS)
    v.apply(received(past), 0.0)
    v.apply(received(rec(ME, 3, inc=99, address="10.6.6.6"), retained=False), 0.0)
    plan = derive(v, 0.1)
    assert plan.decision is not None
    assert plan.decision.reason is Reason.RESUMED
    assert plan.publish
    assert plan.desired is not None
    assert (plan.desired.slot, plan.desired.run) == (2, True)
    assert v.duplicate == ""


def test_a_foreign_record_of_our_name_is_never_resumed() -> None:
    """A record of our name at another address is outbid and a fresh claim is made for
    our previous slot at once; its slot is not taken over."""
    v = view()
    v.apply(received(rec(ME, 3, inc=9, address="10.6.6.6")), 0.0)
    plan = v.derive(
        0.0,
        wall_now=WALL,
        saved=NodeState(domain=DOMAIN, clique=CLIQUE, slot=1, incarnation=3),
        running=False,
        release=lambda: False,
    )
    assert plan.outbid
    assert plan.decision is not None
    assert (plan.decision.claim.phase, plan.decision.claim.slot) == (Phase.CLAIMING, 1)


def test_a_record_of_our_name_that_we_outbid_stays_foreign() -> None:
    """Found by the simulator: a record of our name at our own address and an incarnation
    above ours, which no past run of ours wrote, was outbid (our incarnation raised over it), after
    which it ranked below our incarnation and passed for our past run's record: it was
    resumed, on the slot and with the stamp its writer chose. Our past runs are those
    before the incarnation this run started with; raising ours changes none of them."""
    v = view()
    forged = rec(ME, 2, inc=5, address=MY_ADDRESS, settled=WALL - 500)
    v.apply(received(forged), 0.0)
    plan = derive(v, 0.0)
    assert plan.outbid
    assert v.incarnation == 6
    assert plan.decision is not None
    assert plan.decision.reason is not Reason.RESUMED
    assert plan.decision.claim.phase is Phase.CLAIMING
    assert members(derive(v, 0.1)) == {}


def reconnect(v: ShardView, now: float, *snapshot: Received) -> None:
    """A new link: Connected, its snapshot, Synced."""
    v.apply(Connected(broker="b", protocol="5", will_delay=True), now)
    for event in snapshot:
        v.apply(event, now)
    v.apply(Synced(at=now), now)


def test_a_reconnect_whose_snapshot_holds_our_record_publishes_it_again() -> None:
    """Our record as we last published it is in the new snapshot: the link was as good as
    continuous; our record is published again (its echo starts the broker check)."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    reconnect(v, 5.0, received(ours))
    plan = derive(v, 5.1)
    assert v.continuous
    assert plan.publish
    assert plan.decision is not None
    assert v.record(plan.decision.claim, driver="") == ours


def test_a_reconnect_after_our_will_replays_our_record_when_nothing_took_the_slot() -> None:
    """Our will fired (the snapshot holds our tombstone) and nothing competes on our slot:
    our member record is published again, and continuity returns at its echo."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    reconnect(v, 5.0, received(tombstone(ME, 0.0, inc=3)), received(rec("n2", 1)))
    plan = derive(v, 5.1)
    continuity = [v.continuous]
    assert plan.publish
    assert plan.desired is not None
    assert plan.desired.run
    publish(v, plan, 5.1)
    continuity.append(v.continuous)
    assert continuity == [False, True]
    assert v.claim.slot == ours.slot


def test_a_reconnect_claims_again_when_another_node_took_our_slot() -> None:
    """Our will fired and n2 settled our slot meanwhile: we do not replay our record (its
    earlier stamp would evict n2); we claim another slot, and stop running until it
    settles (the daemon restarts there)."""
    v = view()
    settle(v)
    ours = v.last_sent
    assert ours is not None
    assert ours.slot == 0
    taker = rec("n2", 0, settled=WALL + 4.0)
    reconnect(v, 5.0, received(tombstone(ME, 0.0, inc=3)), received(taker))
    plan = derive(v, 5.1)
    assert plan.publish
    assert plan.decision is not None
    assert (plan.decision.claim.phase, plan.decision.claim.slot) == (Phase.CLAIMING, 1)
    assert plan.desired is not None
    assert not plan.desired.run
    assert members(plan) == {0: "n2"}


def test_a_replayed_record_whose_echo_meets_a_rival_claims_again() -> None:
    """Nothing was on our slot in the snapshot, but a claim accepted before our replayed
    record stands there at its echo: that claim settles (it saw no one); we claim again."""
    v = view()
    settle(v)
    reconnect(v, 5.0, received(tombstone(ME, 0.0, inc=3)))
    plan = derive(v, 5.1)
    record = v.record(plan.decision.claim, driver="") if plan.decision else None
    assert plan.publish
    assert record is not None
    v.sending(record)
    v.commit(plan)
    v.apply(received(rec("n2", 0, CLAIMING), retained=False), 5.2)
    v.apply(received(record, retained=False), 5.3)
    assert not v.continuous
    plan = derive(v, 5.4)
    assert plan.decision is not None
    assert (plan.decision.claim.phase, plan.decision.claim.slot) == (Phase.CLAIMING, 1)


def test_a_kept_record_whose_echo_was_lost_stands_as_if_it_came_back() -> None:
    """A member record published again on a new link, kept by the broker (a snapshot
    held it) but its live echo lost: it is no longer in flight, its rival check runs, and
    a record written over it afterwards is put back."""
    v = view()
    settle(v)
    reconnect(v, 5.0, received(tombstone(ME, 0.0, inc=3)))
    plan = derive(v, 5.1)
    record = v.record(plan.decision.claim, driver="") if plan.decision else None
    assert record is not None
    v.sending(record)
    v.commit(plan)
    ref = TopicRef(kind="member", domain=DOMAIN, clique=CLIQUE, node=ME)
    v.apply(EchoLost(topic="t", ref=ref, repaired=True), 10.0)
    assert v.in_flight == []
    assert v.continuous
    v.apply(received(rec(ME, 3, inc=3, address="10.6.6.6"), retained=False), 11.0)
    assert v.overwritten_total == 1


def test_no_step_is_due_while_the_view_is_not_synced() -> None:
    """Found by the simulator: a timer came due while the link was down; `derive` waits
    for the snapshot without touching it, so it stayed due and the membership loop turned
    without pause until the link was back. An unsynced view has no timer due; the
    snapshot's Synced is the event that wakes the next step."""
    v = view()
    v.apply(received(rec("n2", 1, MemberState.CLAIMING)), now=5.0)
    settle(v)
    assert v.due_at(6.0) is not None  # n2's claim turns stale at 35 s
    v.apply(Disconnected(broker="b", reason="lost"), 7.0)
    assert v.due_at(40.0) is None
    assert not derive(v, 40.0).publish
    v.apply(Connected(broker="b", protocol="5", will_delay=True, link=2), 41.0)
    assert v.due_at(41.0) is None
    v.apply(Synced(at=41.0), 41.0)
    assert v.due_at(41.0) is not None


def test_a_peers_claim_turning_stale_is_a_step_due_without_any_event() -> None:
    """`due_at` names every time-based change, so an idle agent waits for events alone:
    a peer's claim counts until claim_stale_s unchanged, then a step is due."""
    v = view()
    settle(v)
    assert v.due_at(5.0) is None  # a settled member among settled members: no timer
    v.apply(received(rec("n2", 1, MemberState.CLAIMING)), now=5.0)
    assert v.due_at(5.0) == 35.0  # claim_stale_s = 30 after it was first seen
    assert v.due_at(36.0) is None  # stale already: nothing more is due for it
