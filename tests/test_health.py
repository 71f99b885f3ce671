"""The pure health model: every condition reason, readiness, reports and heartbeats."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import msgspec
import pytest
from msgspec.structs import replace

from imexd import messages
from imexd.facts import (
    BusFacts,
    ChannelFacts,
    ChannelState,
    Contest,
    DaemonFacts,
    FabricFacts,
    Facts,
    LinkFacts,
    Member,
    MembershipFacts,
    SlotLink,
)
from imexd.health import conditions as health
from imexd.health import fleet
from imexd.health.conditions import Health, Heartbeats
from imexd.messages import Condition, HealthReport

T0 = 1_000.0


def working(**changes: Any) -> Facts:
    """A member of d1 with a READY daemon and a healthy three-node domain."""
    members = {
        0: Member("n1", "10.0.0.1"),
        1: Member("n2", "10.0.0.2"),
        2: Member("n3", "10.0.0.3"),
    }
    base = Facts(
        node="n1",
        domain="d1",
        clique="c0ffee.1",
        address="10.0.0.1",
        slot=0,
        incarnation=4,
        driver="570.86",
        bus=BusFacts(connected=True, synced=True, broker="mqtt://10.0.0.9:1883"),
        membership=MembershipFacts(state="member", max_nodes=18, members=members),
        daemon=DaemonFacts(state="RUNNING", pid=4242, restarts=1, imex_status="READY"),
        domain_probe=LinkFacts(
            slots={s: SlotLink(m.node, "READY", True) for s, m in members.items()}
        ),
        fabric=FabricFacts(source="nvml"),
        channels=ChannelFacts(synced=True, count=2048, major=242),
    )
    return replace(base, **changes)


def judge(facts: Facts) -> dict[str, Condition]:
    return {c.type: c for c in health.conditions(facts, [], T0)}


def cond(facts: Facts, kind: str) -> Condition:
    return judge(facts)[kind]


def daemon(**changes: Any) -> Facts:
    return working(daemon=replace(working().daemon, **changes))


def membership(**changes: Any) -> Facts:
    return working(membership=replace(working().membership, **changes))


def probe(**changes: Any) -> Facts:
    base = working().domain_probe
    assert base is not None
    return working(domain_probe=replace(base, **changes))


# Readiness


def test_working_member_is_ready_with_every_condition_true() -> None:
    """A settled member with a READY daemon and a connected domain is ready on all counts."""
    conds = health.conditions(working(), [], T0)
    assert [(c.type, c.status, c.reason) for c in conds] == [
        ("BusConnected", "True", "Connected"),
        ("SlotSettled", "True", "Settled"),
        ("DaemonReady", "True", "Ready"),
        ("DomainUp", "True", "Up"),
        ("FabricReady", "True", "Ready"),
        ("ChannelsReady", "True", "NoWorkloads"),
    ]
    assert messages.ready(conds)
    assert messages.reason_line(conds) == ""


def test_idle_node_is_ready_and_says_it_has_no_domain() -> None:
    """A node without a domain has nothing to do, so it is ready and says why."""
    facts = Facts(node="n1", bus=BusFacts(connected=True, synced=True))
    conds = judge(facts)
    assert (conds["SlotSettled"].status, conds["SlotSettled"].reason) == ("True", "NoDomain")
    assert (conds["DaemonReady"].status, conds["DaemonReady"].reason) == ("True", "NotApplicable")
    assert (conds["DomainUp"].status, conds["DomainUp"].reason) == ("Unknown", "NoDomain")
    assert messages.ready(list(conds.values()))


def test_domain_up_is_not_part_of_readiness() -> None:
    """A peer being down must not take this node out of service."""
    facts = probe(unreachable=("n2",))
    conds = health.conditions(facts, [], T0)
    assert cond(facts, "DomainUp").status == "False"
    assert messages.ready(conds)


def test_missing_readiness_condition_is_not_ready() -> None:
    """A condition list without one of the readiness types is not ready."""
    conds = [c for c in health.conditions(working(), [], T0) if c.type != "BusConnected"]
    assert not messages.ready(conds)
    assert messages.failing(conds)[0].reason == "Missing"


# BusConnected


def test_bus_disconnected_names_broker_and_last_error() -> None:
    """A lost broker link says where it tried and what went wrong."""
    facts = working(bus=BusFacts(broker="mqtt://b:1883", last_error="connection refused"))
    c = cond(facts, "BusConnected")
    assert (c.status, c.reason) == ("False", "Disconnected")
    assert "mqtt://b:1883" in c.message
    assert "connection refused" in c.message
    assert not messages.ready(health.conditions(facts, [], T0))


def test_bus_connected_but_not_synced_is_not_ready() -> None:
    """Until the retained snapshot is seen, the member records mean nothing."""
    facts = working(bus=BusFacts(connected=True, synced=False))
    assert cond(facts, "BusConnected").reason == "Syncing"
    assert cond(facts, "BusConnected").status == "False"


def test_bus_publish_refused_names_the_topics() -> None:
    """A retained publish that never came back is reported as a likely ACL refusal."""
    topic = "imex/v2/domains/d1/members/c0ffee.1/n1"
    facts = working(bus=BusFacts(connected=True, synced=True, refused=(topic,)))
    c = cond(facts, "BusConnected")
    assert (c.status, c.reason) == ("False", "PublishRefused")
    assert topic in c.message
    assert "ACL" in c.message


def test_a_refused_subscription_says_which_filter_and_broker() -> None:
    """The broker refuses a filter we need (a NATS cluster after a server died): False
    SubscribeRefused with the bus's words, ahead of PublishRefused (whose echo could only
    come through that filter)."""
    why = "the broker mqtt://b:1883 refused our subscription to imex/v2/x/+ (code 128)"
    facts = working(
        bus=BusFacts(connected=True, synced=False, subscribe_refused=why, refused=("t",))
    )
    c = cond(facts, "BusConnected")
    assert (c.status, c.reason, c.message) == ("False", "SubscribeRefused", why)


def test_a_broker_without_retained_wildcards_is_not_trusted() -> None:
    """The broker did not send our record back to a wildcard subscription: BusConnected
    False with BrokerNoRetainedWildcard and the bus's words, whatever synced says."""
    why = "the broker mqtt://b:1883 did not send our retained record back"
    facts = working(bus=BusFacts(connected=True, synced=True, no_retained_wildcard=why))
    c = cond(facts, "BusConnected")
    assert (c.status, c.reason, c.message) == ("False", "BrokerNoRetainedWildcard", why)


def test_a_broker_that_does_not_serve_our_record_at_all_says_so() -> None:
    """Nor to a subscription of its own topic (a NATS cluster whose retained feed died with
    a server): BusConnected False with BrokerRetainedNotServed and the bus's words."""
    why = "the broker mqtt://b:1883 did not send our retained record back ... nor to one"
    bus = BusFacts(connected=True, synced=True, no_retained_wildcard=why, retained_not_served=True)
    c = cond(working(bus=bus), "BusConnected")
    assert (c.status, c.reason, c.message) == ("False", "BrokerRetainedNotServed", why)


# SlotSettled


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("claiming", "Claiming"),
        ("none", "Joining"),
        ("leaving", "Leaving"),
        ("standby", "NoSlot"),
        ("out", "NoSlot"),
    ],
)
def test_slot_not_settled_states(state: Any, reason: str) -> None:
    """Each unsettled membership state has its own reason."""
    c = cond(membership(state=state), "SlotSettled")
    assert (c.status, c.reason) == ("False", reason)


def test_slot_claiming_names_the_slot() -> None:
    """A pending claim says which slot it wants."""
    facts = replace(membership(state="claiming"), slot=5)
    assert "slot 5" in cond(facts, "SlotSettled").message


def test_slot_domain_full() -> None:
    """A node that found every slot taken says how many slots the domain has."""
    facts = membership(state="standby", reason="DomainFull", max_nodes=2)
    c = cond(replace(facts, slot=None), "SlotSettled")
    assert (c.status, c.reason) == ("False", "DomainFull")
    assert "all 2 slots of d1/c0ffee.1" in c.message


def test_slot_not_in_spec() -> None:
    """A node left out of the spec's node list says so, with the spec's detail."""
    facts = membership(state="out", reason="NotInSpec", detail="the spec lists n2, n3")
    c = cond(facts, "SlotSettled")
    assert (c.status, c.reason) == ("False", "NotInSpec")
    assert "n1" in c.message
    assert "n2, n3" in c.message


def test_slot_node_map_mismatch_names_offending_members() -> None:
    """A member with another max_nodes or mode blocks the daemon, and is named."""
    facts = membership(reason="NodeMapMismatch", offending=("n7", "n9"))
    c = cond(facts, "SlotSettled")
    assert (c.status, c.reason) == ("False", "NodeMapMismatch")
    assert "n7, n9" in c.message
    assert not messages.ready(health.conditions(facts, [], T0))


def test_slot_settled_says_where() -> None:
    """A settled slot says where it is, not how full the shard is: a peer's join or leave
    changes no other member's report."""
    c = cond(working(), "SlotSettled")
    assert c.message == "slot 0 of d1/c0ffee.1"


def test_a_contested_slot_is_settled_and_named() -> None:
    """Another node's member record on a held slot: still settled and ready (the holder
    keeps it), with a reason that names the slot, its holder and who contends."""
    contested = (Contest(0, "n1", ("a0",)), Contest(2, "n3", ("z9", "zz")))
    facts = membership(contested=contested)
    c = cond(facts, "SlotSettled")
    assert (c.status, c.reason) == ("True", "SlotContested")
    assert c.message == (
        "slot 0 of d1/c0ffee.1; another node's member record stands on a held slot: "
        "slot 0 is kept by n1 against a0; slot 2 is kept by n3 against z9, zz"
    )
    assert messages.ready(health.conditions(facts, [], T0))


def test_empty_clique_topic_level_is_none() -> None:
    """The empty clique reads as `none` in messages, as on the bus."""
    facts = replace(membership(state="claiming"), clique="")
    assert "d1/none" in cond(facts, "SlotSettled").message


# DaemonReady


def test_daemon_starting() -> None:
    """A daemon within its start seconds is Starting."""
    c = cond(daemon(state="STARTING", imex_status=""), "DaemonReady")
    assert (c.status, c.reason) == ("False", "Starting")


def test_daemon_running_before_first_probe_is_starting() -> None:
    """RUNNING without a probe answer yet is still Starting, with its pid."""
    c = cond(daemon(imex_status=""), "DaemonReady")
    assert (c.status, c.reason) == ("False", "Starting")
    assert "4242" in c.message


def test_daemon_backoff_has_exit_and_last_line() -> None:
    """A restart pending after a crash says how the daemon exited and what it said."""
    facts = daemon(
        state="BACKOFF", pid=None, restarts=3, last_exit="exit 3", last_line="bind failed"
    )
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "Backoff")
    assert c.message == "restart 3 pending after exit 3: bind failed"


def test_daemon_crash_loop_uses_supervisor_message() -> None:
    """FATAL after too many failed starts carries the supervisor's exit and last line."""
    facts = daemon(
        state="FATAL", reason="DaemonCrashLoop", message="exit 3: cannot bind 10.0.0.1:50000"
    )
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "DaemonCrashLoop")
    assert c.message == "exit 3: cannot bind 10.0.0.1:50000"
    line = messages.reason_line(health.conditions(facts, [], T0))
    assert line == "DaemonReady=False DaemonCrashLoop: exit 3: cannot bind 10.0.0.1:50000"


def test_daemon_fatal_without_message_builds_it_from_the_exit() -> None:
    """FATAL without a supervisor message falls back to the last exit and line."""
    facts = daemon(state="FATAL", last_exit="signal SIGSEGV", last_line="oops")
    c = cond(facts, "DaemonReady")
    assert (c.reason, c.message) == ("DaemonCrashLoop", "signal SIGSEGV: oops")


def test_daemon_conflicting() -> None:
    """Another IMEX daemon on our config or ports is reported, not fought."""
    facts = daemon(
        state="STOPPED",
        pid=None,
        reason="ConflictingDaemon",
        message="pid 77 runs /etc/nvidia-imex/config.cfg",
    )
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "ConflictingDaemon")
    assert "pid 77" in c.message


def test_daemon_config_write_failed_says_which_file_and_how() -> None:
    """A failed file write names the file, the method and the error."""
    facts = daemon(write_error="read-only file system", write_path="/etc/hosts")
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "ConfigWriteFailed")
    assert c.message == "cannot write /etc/hosts (by rename): read-only file system"
    facts = daemon(write_error="EBUSY", write_path="/etc/hosts", write_method="in_place")
    assert "(in place)" in cond(facts, "DaemonReady").message


def test_daemon_ready_mentions_in_place_writes() -> None:
    """Files written in place (bind-mounted hosts) are visible in the Ready message."""
    c = cond(daemon(write_method="in_place"), "DaemonReady")
    assert (c.status, c.reason) == ("True", "Ready")
    assert "in place" in c.message


def test_daemon_not_applicable_for_empty_clique_is_ready() -> None:
    """A member without multi-node NVLink runs no daemon and is still ready."""
    facts = working(clique="", daemon=DaemonFacts(), domain_probe=None)
    conds = health.conditions(facts, [], T0)
    c = {x.type: x for x in conds}
    assert (c["DaemonReady"].status, c["DaemonReady"].reason) == ("True", "NotApplicable")
    assert (c["FabricReady"].status, c["FabricReady"].reason) == ("True", "NotApplicable")
    assert (c["DomainUp"].status, c["DomainUp"].reason) == ("Unknown", "NotApplicable")
    assert messages.ready(conds)


def test_daemon_probe_failed() -> None:
    """A failing `ctl -q` is ProbeFailed with the error, not a guess at the state."""
    c = cond(daemon(probe_error="timed out after 5 s"), "DaemonReady")
    assert (c.status, c.reason) == ("False", "ProbeFailed")
    assert "timed out after 5 s" in c.message


def test_daemon_not_ready_gives_the_imex_state_word() -> None:
    """A running daemon that is not READY says which IMEX state it is in."""
    c = cond(daemon(imex_status="WAITING_FOR_PEERS"), "DaemonReady")
    assert (c.status, c.reason, c.message) == (
        "False",
        "NotReady",
        "IMEX state WAITING_FOR_PEERS",
    )


def test_daemon_not_started_while_slot_unsettled() -> None:
    """A stopped daemon waiting for its slot says it waits for the slot."""
    facts = replace(membership(state="claiming"), daemon=DaemonFacts())
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "NotStarted")
    assert "slot" in c.message


def test_daemon_that_identified_as_its_slot_is_ready() -> None:
    """The id the daemon logged matches the slot (names mode): nothing to say."""
    assert cond(daemon(identified=0), "DaemonReady").reason == "Ready"
    assert cond(daemon(identified=None), "DaemonReady").reason == "Ready", "unknown: no check"


def test_daemon_that_identified_as_another_node_is_an_identity_mismatch() -> None:
    """Another id than the slot: DaemonReady False, IdentityMismatch naming both ids."""
    c = cond(working(slot=1, daemon=replace(working().daemon, identified=2)), "DaemonReady")
    assert (c.status, c.reason) == ("False", "IdentityMismatch")
    assert "pid 4242 identified this node as ID 2, but its slot is 1" in c.message
    assert not messages.ready(health.conditions(daemon(identified=5), [], T0))


def test_identity_in_addresses_mode_is_the_index_among_the_members() -> None:
    """Addresses mode: nodes_config.cfg lists the members in slot order, so slot 7 of
    members {2, 7, 9} is node id 1."""
    members = {s: Member(f"n{s}", f"10.0.0.{s}") for s in (2, 7, 9)}
    facts = working(
        slot=7, mode="addresses", membership=replace(working().membership, members=members)
    )
    assert health.expected_id(facts) == 1
    ok = replace(facts, daemon=replace(facts.daemon, identified=1))
    assert cond(ok, "DaemonReady").reason == "Ready"
    wrong = replace(facts, daemon=replace(facts.daemon, identified=7))
    c = cond(wrong, "DaemonReady")
    assert (c.status, c.reason) == ("False", "IdentityMismatch")
    assert "as ID 7, but its index among the members in slot order is 1 (slot 7)" in c.message


def test_identity_is_not_judged_without_a_settled_slot() -> None:
    """A claiming node has no expected id yet."""
    assert health.expected_id(membership(state="claiming")) is None


def test_daemon_stopping_and_other_supervisor_reasons() -> None:
    """STOPPING has its own reason and an unknown supervisor reason passes through."""
    assert cond(daemon(state="STOPPING"), "DaemonReady").reason == "Stopping"
    c = cond(daemon(state="STOPPED", reason="SpawnFailed", message="no such file"), "DaemonReady")
    assert (c.status, c.reason, c.message) == ("False", "SpawnFailed", "no such file")


# DomainUp (fleet.sight, as health wraps it)


def test_domain_up_judged_over_members_only() -> None:
    """Empty slots (15 of 18 here) do not make the domain look degraded."""
    c = cond(working(), "DomainUp")
    assert (c.status, c.reason) == ("True", "Up")
    assert fleet.sight(working()).state == "UP"


def test_domain_peers_unreachable_names_them() -> None:
    """Members that are unreachable or not connected are named in the message."""
    base = working().domain_probe
    assert base is not None
    slots = dict(base.slots)
    slots[2] = SlotLink("n3", "READY", False)
    facts = probe(slots=MappingProxyType(slots), unreachable=("n2",))
    c = cond(facts, "DomainUp")
    assert (c.status, c.reason) == ("False", "PeersUnreachable")
    assert "n2, n3" in c.message
    assert fleet.sight(facts).state == "DOWN"


def test_domain_degraded_when_some_peers_are_fine() -> None:
    """One of two peers unreachable is DEGRADED, not DOWN."""
    facts = probe(unreachable=("n3",))
    assert fleet.sight(facts).state == "DEGRADED"
    assert "n3" in cond(facts, "DomainUp").message


def test_domain_member_missing_from_probe_is_unreachable() -> None:
    """A member the probe did not show at all is counted as not connected."""
    facts = probe(slots=MappingProxyType({0: SlotLink("n1", "READY", True)}))
    assert "n2, n3" in cond(facts, "DomainUp").message


def test_domain_version_mismatch() -> None:
    """`!V!` cells become VersionMismatch naming the nodes."""
    c = cond(probe(version_mismatch=("n2",)), "DomainUp")
    assert (c.status, c.reason) == ("False", "VersionMismatch")
    assert "n2" in c.message


def test_domain_forming_before_the_first_probe() -> None:
    """Without a domain probe yet, or a daemon not READY, the domain is Forming."""
    assert cond(working(domain_probe=None), "DomainUp").reason == "Forming"
    assert cond(daemon(imex_status="WAITING_FOR_PEERS"), "DomainUp").reason == "Forming"
    assert fleet.sight(working(domain_probe=None)).state == "FORMING"


def test_domain_not_judged_while_the_local_daemon_is_down() -> None:
    """A crash-looping local daemon makes DomainUp point at DaemonReady, not at peers."""
    facts = daemon(state="FATAL", reason="DaemonCrashLoop", message="exit 3")
    c = cond(facts, "DomainUp")
    assert (c.status, c.reason) == ("False", "DaemonDown")
    assert "FATAL" in c.message
    assert fleet.sight(facts).state is None
    assert health.report(facts, [], T0).domain_view is None


def test_domain_probe_failed_is_unknown() -> None:
    """A failing `ctl -N -j` makes the domain unknown, not down."""
    c = cond(probe(error="exit 1"), "DomainUp")
    assert (c.status, c.reason) == ("Unknown", "ProbeFailed")
    assert fleet.sight(probe(error="exit 1")).state is None


def test_long_name_lists_are_shortened() -> None:
    """A message names a few nodes and counts the rest, to keep reports small."""
    names = tuple(f"n{i}" for i in range(2, 20))
    c = cond(probe(unreachable=names), "DomainUp")
    assert "and 10 more" in c.message


# FabricReady


def test_fabric_discovery_failed() -> None:
    """NVML discovery failure says what failed and what to set instead."""
    facts = working(fabric=FabricFacts(source="nvml", error="NVML: GPUs disagree; set clique"))
    c = cond(facts, "FabricReady")
    assert (c.status, c.reason) == ("False", "DiscoveryFailed")
    assert "set clique" in c.message


def test_fabric_ready_says_where_the_clique_came_from() -> None:
    """A clique from the settings and one from NVML read differently."""
    assert "NVML" in cond(working(), "FabricReady").message
    assert "configuration" in cond(working(fabric=FabricFacts()), "FabricReady").message


# since, messages, reports


def test_since_is_kept_while_status_and_reason_hold() -> None:
    """A changed message keeps `since`; a changed reason resets it."""
    first = health.conditions(probe(unreachable=("n2",)), [], T0)
    second = health.conditions(probe(unreachable=("n2", "n3")), first, T0 + 10)
    third = health.conditions(working(), second, T0 + 20)
    up = {c.type: c for c in second}["DomainUp"]
    assert up.since == T0
    assert "n3" in up.message
    assert {c.type: c for c in third}["DomainUp"].since == T0 + 20
    assert {c.type: c for c in third}["BusConnected"].since == T0


def test_messages_are_one_clipped_line() -> None:
    """Daemon output with newlines and great length becomes one short line."""
    facts = daemon(state="FATAL", message="exit 3:\n" + "x" * 1000)
    c = cond(facts, "DaemonReady")
    assert "\n" not in c.message
    assert len(c.message) == health.MESSAGE_MAX


def test_report_validates_against_the_payload_type() -> None:
    """The report round-trips through strict decoding and shows the members only."""
    facts = working()
    rep = health.report(facts, health.conditions(facts, [], T0), T0 + 1)
    decoded = messages.decode(messages.encode(rep), HealthReport)
    assert decoded == rep
    assert rep.ready
    assert rep.at == T0 + 1
    assert rep.daemon.imex_status == "READY"
    assert rep.domain_view is not None
    assert rep.domain_view.status == "UP"
    assert sorted(rep.domain_view.nodes) == ["0", "1", "2"]
    schema = messages.json_schemas()["HealthReport"]
    assert set(schema["$defs"]["HealthReport"]["required"]) <= set(msgspec.to_builtins(rep))


def test_idle_report_has_no_domain_view() -> None:
    """An idle node reports no domain, no slot and no domain view."""
    facts = Facts(node="n1", bus=BusFacts(connected=True, synced=True))
    rep = health.report(facts, health.conditions(facts, [], T0), T0)
    assert (rep.domain, rep.slot, rep.domain_view, rep.ready) == (None, None, None, True)
    assert isinstance(messages.decode(messages.encode(rep), HealthReport), HealthReport)


def test_summary_lines() -> None:
    """The systemd STATUS line says what the node does, or why it is not ready."""
    ok = working()
    assert health.summary(ok, health.conditions(ok, [], T0)) == (
        "ready: d1 slot 0, IMEX READY, domain UP"
    )
    idle = Facts(node="n1", bus=BusFacts(connected=True, synced=True))
    assert health.summary(idle, health.conditions(idle, [], T0)) == "ready: idle (no domain)"
    bad = daemon(state="FATAL", message="exit 3: boom")
    assert health.summary(bad, health.conditions(bad, [], T0)) == (
        "not ready: DaemonReady=False DaemonCrashLoop: exit 3: boom"
    )


def test_health_update_reports_changes_only() -> None:
    """Health.update is True when the report changed and keeps `since` across updates."""
    now = [T0]
    h = Health(working(), clock=lambda: now[0])
    now[0] = T0 + 5
    assert not h.update(working())
    assert h.update(daemon(imex_status="WAITING_FOR_PEERS"))
    assert not h.is_ready
    assert {c.type: c for c in h.conditions}["DaemonReady"].since == T0 + 5
    assert h.report().at == T0 + 5
    assert h.summary().startswith("not ready: DaemonReady=False NotReady")


def test_the_same_facts_again_change_nothing_and_new_ones_are_judged_afresh() -> None:
    """An update with equal facts keeps conditions, report and summary exactly; the next
    different facts are judged as if every snapshot had been (the summary follows)."""
    now = [T0]
    h = Health(daemon(imex_status="WAITING_FOR_PEERS"), clock=lambda: now[0])
    before = (h.conditions, h.summary(), messages.encode(h.report()))
    now[0] = T0 + 5
    assert not h.update(daemon(imex_status="WAITING_FOR_PEERS"))  # equal, not the same object
    assert (h.conditions, h.summary()) == before[:2]
    assert messages.encode(msgspec.structs.replace(h.report(), at=T0)) == before[2]
    now[0] = T0 + 9
    assert h.update(working())
    assert h.is_ready
    assert {c.type: c for c in h.conditions}["DaemonReady"].since == T0 + 9
    assert h.summary() == health.summary(working(), h.conditions)
    fresh = health.conditions(working(), before[0], T0 + 9)
    assert list(h.conditions) == fresh


# Heartbeats


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_heartbeat_goes_stale_after_three_of_its_own_intervals() -> None:
    """Each task is judged by its own interval, and a beat makes it fresh again."""
    clock = FakeClock()
    hb = Heartbeats(clock=clock)
    hb.register("bus", 10.0)
    hb.register("main", 1.0)
    clock.t += 3.5
    assert hb.stale() == [("main", 3.5)]
    hb.beat("main")
    clock.t += 27.0
    assert [name for name, _ in hb.stale()] == ["bus", "main"]
    assert "task bus silent for 30.5 s (interval 10 s)" in hb.describe(hb.stale())
    hb.beat("bus")
    hb.beat("main")
    assert hb.stale() == []


def test_a_task_at_rest_is_never_stale_and_leaving_the_rest_beats() -> None:
    """Waiting for the next input is not being wedged: no beat is owed meanwhile."""
    clock = FakeClock()
    hb = Heartbeats(clock=clock)
    hb.register("events", 1.0)
    with hb.resting("events"):
        clock.t += 3600.0
        assert hb.stale() == []
    assert hb.stale() == []  # leaving the rest beat it
    clock.t += 3.5
    assert hb.stale() == [("events", 3.5)]  # at work, silent: wedged


def test_heartbeat_of_an_unknown_name_is_a_bug() -> None:
    """Beating an unknown task, or registering one without an interval, raises."""
    hb = Heartbeats(clock=FakeClock())
    with pytest.raises(KeyError):
        hb.beat("nobody")
    with pytest.raises(ValueError, match="must be > 0"):
        hb.register("bad", 0)


def test_daemon_waits_for_an_unknown_clique() -> None:
    """Before NVML discovery succeeds the daemon is not applicable-by-default: it waits."""
    facts = working(clique="", clique_known=False, daemon=DaemonFacts(state="STOPPED"))
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "NotStarted")
    assert "waiting for the clique" in c.message
    assert not messages.ready(list(judge(facts).values()))


def test_a_mismatch_keeps_the_daemon_from_starting_and_says_so() -> None:
    """A node refusing to start over NodeMapMismatch says that, not just "not started"."""
    facts = working(
        membership=replace(working().membership, reason="NodeMapMismatch", offending=("n9",)),
        daemon=DaemonFacts(state="STOPPED"),
    )
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "NodeMapMismatch")
    assert "refusing to start" in c.message
    assert "not started" in cond(facts, "SlotSettled").message


def test_a_node_that_disagrees_with_the_spec_names_itself_first() -> None:
    """Refused for its own max_nodes (the spec's differs): both messages start with it."""
    own = "n1: max_nodes 4 here, the domain spec says 8; the spec decides, so only this node"
    facts = working(
        membership=replace(
            working().membership, reason="NodeMapMismatch", offending=(), detail=own
        ),
        daemon=DaemonFacts(state="STOPPED"),
    )
    assert cond(facts, "SlotSettled").message.startswith(own)
    assert cond(facts, "DaemonReady").message.startswith(f"refusing to start: {own}")


def test_a_mismatch_with_a_running_daemon_keeps_it() -> None:
    """A running daemon is kept through a mismatch, and the message says so."""
    facts = membership(reason="NodeMapMismatch", offending=(), detail="")
    slot = cond(facts, "SlotSettled")
    assert slot.reason == "NodeMapMismatch"
    assert "a running daemon is kept" in slot.message
    assert "members  of" not in slot.message
    assert cond(facts, "DaemonReady").reason == "Ready"


# Honest status without the bus (issue 9, defect 10)


def test_domain_view_is_unknown_while_the_bus_is_down() -> None:
    """With the link down the member records may be stale: DomainUp Unknown BusDown, no state."""
    facts = working(bus=BusFacts(broker="mqtt://b:1883", last_error="connection refused"))
    c = cond(facts, "DomainUp")
    assert (c.status, c.reason) == ("Unknown", "BusDown")
    assert "connection refused" in c.message
    assert fleet.sight(facts).state is None
    assert fleet.domain_view(facts) is None
    assert "domain UP" not in health.summary(facts, health.conditions(facts, [], T0))


def test_domain_view_is_unknown_until_the_snapshot_is_synced() -> None:
    """Connected but not yet synced is no fresher than disconnected."""
    facts = working(bus=BusFacts(connected=True, synced=False))
    c = cond(facts, "DomainUp")
    assert (c.status, c.reason) == ("Unknown", "BusDown")
    assert "not yet synced" in c.message
    assert health.report(facts, health.conditions(facts, [], T0), T0).domain_view is None


def test_bus_down_keeps_its_since_while_it_lasts() -> None:
    """The condition's since says how long the view has been stale."""
    facts = working(bus=BusFacts())
    first = health.conditions(facts, [], T0)
    later = {c.type: c for c in health.conditions(facts, first, T0 + 60)}
    assert later["DomainUp"].since == T0


# Duplicate node names and released slots (issue 9, defects 6 and 12)


def test_duplicate_node_is_not_ready_and_says_why() -> None:
    """A second agent with our name: SlotSettled False DuplicateNode, no daemon, not ready."""
    facts = working(
        membership=MembershipFacts(
            state="out", reason="DuplicateNode", detail="incarnation 7 from 10.0.0.9"
        ),
        daemon=DaemonFacts(),
        slot=None,
    )
    conds = health.conditions(facts, [], T0)
    by_type = {c.type: c for c in conds}
    assert (by_type["SlotSettled"].status, by_type["SlotSettled"].reason) == (
        "False",
        "DuplicateNode",
    )
    assert "10.0.0.9" in by_type["SlotSettled"].message
    assert by_type["DaemonReady"].status == "False"
    assert "another agent" in by_type["DaemonReady"].message
    assert not messages.ready(conds)


def test_a_record_written_over_ours_is_said_and_keeps_the_node_ready() -> None:
    """RecordOverwritten: the node is settled and ready, SlotSettled says what was written."""
    facts = membership(
        state="member",
        reason="RecordOverwritten",
        detail="someone wrote member slot 0 at 10.6.6.6 (incarnation 1) on this node's "
        "member topic; put back",
    )
    conds = health.conditions(facts, [], T0)
    by_type = {c.type: c for c in conds}
    settled = by_type["SlotSettled"]
    assert (settled.status, settled.reason) == ("True", "RecordOverwritten")
    assert "10.6.6.6" in settled.message
    assert by_type["DaemonReady"].status == "True"
    assert messages.ready(conds)


def test_a_settled_node_with_a_same_name_agent_keeps_its_daemon_and_says_so() -> None:
    """DuplicateNode while holding the slot: SlotSettled True with that reason, the
    daemon still ready, and the message says the slot and daemon are kept."""
    facts = membership(state="member", reason="DuplicateNode", detail="written over 2 times")
    conds = health.conditions(facts, [], T0)
    by_type = {c.type: c for c in conds}
    settled = by_type["SlotSettled"]
    assert (settled.status, settled.reason) == ("True", "DuplicateNode")
    assert "keeps its slot and daemon" in settled.message
    assert by_type["DaemonReady"].status == "True"


def test_a_daemon_left_running_while_we_stand_aside_is_reported_unsupervised() -> None:
    """Standing aside with a daemon of our config running: DaemonReady says Unsupervised
    with its pid, not that no daemon runs."""
    facts = working(
        membership=MembershipFacts(state="out", reason="DuplicateNode", detail="taken over"),
        daemon=DaemonFacts(
            state="RUNNING", pid=4242, reason="Unsupervised", message="pid 4242 runs ..."
        ),
        slot=None,
    )
    c = cond(facts, "DaemonReady")
    assert (c.status, c.reason) == ("False", "Unsupervised")
    assert "4242" in c.message


def test_released_slot_says_why() -> None:
    """A node that gave its slot up (FATAL daemon, standby waiting) says Released."""
    facts = membership(state="standby", reason="Released", detail="daemon FATAL for 300 s")
    c = cond(facts, "SlotSettled")
    assert (c.status, c.reason) == ("False", "Released")
    assert "FATAL" in c.message


# ChannelsReady (issue 12)


def channels(**changes: Any) -> Facts:
    return working(channels=replace(working().channels, **changes))


def made(workload: str, channel: int, generation: int = 1) -> ChannelState:
    return ChannelState(workload=workload, channel=channel, generation=generation, ready=True)


def refused(workload: str, channel: int, reason: str, message: str) -> ChannelState:
    return ChannelState(workload=workload, channel=channel, reason=reason, message=message)


def test_channels_ready_lists_the_workloads() -> None:
    """Every listed workload's device made: True Ready, naming each workload and channel."""
    c = cond(channels(workloads=(made("job-a", 3), made("job-b", 7))), "ChannelsReady")
    assert (c.status, c.reason) == ("True", "Ready")
    assert "job-a on channel 3" in c.message
    assert "job-b on channel 7" in c.message


def test_channels_without_workloads_or_domain() -> None:
    """No workload lists the node, or no domain: True NoWorkloads."""
    c = cond(working(), "ChannelsReady")
    assert (c.status, c.reason) == ("True", "NoWorkloads")
    assert "d1" in c.message
    idle = Facts(node="n1", bus=BusFacts(connected=True, synced=True))
    assert (cond(idle, "ChannelsReady").status, cond(idle, "ChannelsReady").reason) == (
        "True",
        "NoWorkloads",
    )


def test_channels_pending_until_the_view_is_synced() -> None:
    """Before the workloads snapshot is in: Unknown Pending, and still ready for /readyz."""
    facts = channels(synced=False, workloads=(made("job-a", 3),))
    c = cond(facts, "ChannelsReady")
    assert (c.status, c.reason) == ("Unknown", "Pending")
    assert "d1" in c.message
    assert messages.ready(health.conditions(facts, [], T0))


def test_channels_not_managed_is_true_and_lists_the_workloads() -> None:
    """manage = false: True NotManaged, whatever the workloads' states."""
    state = ChannelState(workload="job-a", channel=3, reason="NotManaged", message="another tool")
    c = cond(channels(managed=False, synced=False, workloads=(state,)), "ChannelsReady")
    assert (c.status, c.reason) == ("True", "NotManaged")
    assert "job-a on channel 3" in c.message


@pytest.mark.parametrize(
    "reason",
    [
        "NoChannelDevice",
        "ChannelOutOfRange",
        "ChannelConflict",
        "MknodFailed",
        "CdiWriteFailed",
        "EnvWriteFailed",
    ],
)
def test_channels_first_failing_workload_gives_the_reason(reason: str) -> None:
    """A workload without its device: False with its reason, its name, channel and message."""
    facts = channels(
        workloads=(
            made("job-a", 3),
            refused("job-b", 9, reason, "why it failed"),
            refused("job-c", 11, "MknodFailed", "later"),
        ),
        mismatch=(("n2", 1024),),
    )
    c = cond(facts, "ChannelsReady")
    assert (c.status, c.reason) == ("False", reason)
    assert "job-b channel 9: why it failed" in c.message
    assert "1 more" in c.message
    assert messages.ready(health.conditions(facts, [], T0))  # not part of /readyz


def test_channel_count_mismatch_names_nodes_and_counts() -> None:
    """A member with another ImexChannelCount: False ChannelCountMismatch, devices still made."""
    facts = channels(workloads=(made("job-a", 3),), mismatch=(("n2", 1024), ("n3", 4096)))
    c = cond(facts, "ChannelsReady")
    assert (c.status, c.reason) == ("False", "ChannelCountMismatch")
    assert "2048 on n1" in c.message
    assert "n2 1024" in c.message
    assert "n3 4096" in c.message


def test_world_writable_channel0_beside_other_channels() -> None:
    """channel0 open to all while a workload uses another channel: False WorldWritableChannel0."""
    c = cond(channels(workloads=(made("job-a", 3),), channel0_open=True), "ChannelsReady")
    assert (c.status, c.reason) == ("False", "WorldWritableChannel0")
    assert "channel 3" in c.message
    only0 = cond(channels(workloads=(made("job-0", 0),), channel0_open=True), "ChannelsReady")
    assert (only0.status, only0.reason) == ("True", "Ready")


def test_report_carries_the_channels_view() -> None:
    """The HealthReport lists the driver's count and major and each workload's state."""
    facts = channels(
        workloads=(made("job-a", 3, generation=2), refused("job-b", 5000, "ChannelOutOfRange", "x"))
    )
    report = health.report(facts, health.conditions(facts, [], T0), T0)
    assert report.channels == messages.ChannelsView(
        count=2048,
        major=242,
        workloads=[
            messages.ChannelInfo(workload="job-a", channel=3, generation=2, ready=True),
            messages.ChannelInfo(
                workload="job-b", channel=5000, ready=False, reason="ChannelOutOfRange", message="x"
            ),
        ],
    )
    decoded = msgspec.json.decode(messages.encode(report), type=HealthReport)
    assert decoded.channels == report.channels


def test_a_report_with_many_workloads_stays_within_the_payload_limit() -> None:
    """2000 failing workloads with long messages would make a report every reader drops
    (and the node's whole health with it): messages go first, then the last workloads by
    name, counted in `omitted`; the report still decodes."""
    many = tuple(refused(f"job-{i:05d}", i + 1, "MknodFailed", "x" * 150) for i in range(2000))
    facts = channels(workloads=many)
    report = health.report(facts, health.conditions(facts, [], T0), T0)
    data = messages.encode(report)
    assert len(data) <= messages.MAX_PAYLOAD
    view = report.channels
    assert view is not None
    assert view.omitted > 0
    assert len(view.workloads) + view.omitted == 2000
    assert [w.workload for w in view.workloads] == [w.workload for w in many[: len(view.workloads)]]
    assert isinstance(messages.decode(data, HealthReport), HealthReport)
    few = channels(workloads=many[:3])
    kept = health.report(few, health.conditions(few, [], T0), T0).channels
    assert kept is not None
    assert (kept.omitted, kept.workloads[0].message) == (0, "x" * 150)


# When reports are published.


def test_the_gist_is_readiness_and_condition_statuses() -> None:
    """A settled slot's message is detail; a claim losing its slot flips a status."""
    h = Health(membership(state="claiming", reason="Claimed"))
    claiming = h.gist()
    h.update(membership(state="claiming", reason="LostConflict"))
    assert h.gist() == claiming
    h.update(working())
    assert h.gist() != claiming
    assert h.gist()[0] is True


def test_a_workloads_channel_made_ready_is_in_the_gist() -> None:
    """`imexd workload create --wait` waits for every listed node to report the channel
    ready: seen holding that report for REPORT_HOLD_S (0.5 to 0.9 s of a 0.9 s create on 4
    nodes), because ChannelsReady stayed True while a new workload came and was made. Each
    workload's readiness for its generation is part of the gist; its message is not."""
    h = Health(channels(workloads=(made("job-a", 3),)))
    before = h.gist()
    h.update(channels(workloads=(made("job-a", 3), made("job-b", 7))))
    assert h.gist() != before, "job-b's channel made ready"
    made_b = h.gist()
    h.update(channels(workloads=(made("job-a", 3), made("job-b", 7, generation=2))))
    assert h.gist() != made_b, "a new generation made ready"
    again = h.gist()
    h.update(channels(workloads=(made("job-a", 3), made("job-b", 7, generation=2))))
    assert h.gist() == again
    failing = (made("job-a", 3), refused("job-c", 9, "MknodFailed", "EPERM"))
    h.update(channels(workloads=failing))
    detail = h.gist()
    h.update(channels(workloads=(made("job-a", 3), refused("job-c", 9, "MknodFailed", "EIO"))))
    assert h.gist() == detail, "a message is detail"


def test_a_gist_change_is_published_at_once_a_detail_after_the_hold() -> None:
    """The first report and every gist change go out at once; a change of detail only
    waits until `hold_s` after the last publication, taking later changes with it; an
    unchanged report goes out every interval."""
    s = health.ReportSchedule(interval_s=30.0, hold_s=1.0)
    assert s.next_at() <= 0.0  # the first turn publishes
    s.published(("a",), 10.0)
    s.changed(("a",), 10.2)  # detail only
    assert s.next_at() == 11.0
    s.changed(("a",), 10.7)  # folded into the held one
    assert s.next_at() == 11.0
    s.changed(("b",), 10.8)  # the gist moved: now
    assert s.next_at() == 10.8
    s.published(("b",), 10.8)
    assert s.next_at() == 40.8
    s.changed(("b",), 15.0)  # a detail long after the last publication: due already
    assert s.next_at() <= 15.0
