"""The domain judgement and its tables: pure functions over HealthReports built by the
real health model (`imexd.health.fleet.judge`, `render_status`, `status_json`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from imexd import facts as fx
from imexd.health.fleet import (
    FUTURE_SKEW_S,
    STALE_INTERVALS,
    START_GRACE_INTERVALS,
    DomainStatus,
    SeenReport,
    judge,
    render_status,
)
from imexd.messages import DOMAIN_UP, DomainSpec, HealthReport, MemberRecord, MemberState
from tests.reports import CRASH, INTERVAL, NOW, SPEC, THREE, member_record, report


def records(members: Mapping[int, str] = THREE) -> list[MemberRecord]:
    return [member_record(n, s) for s, n in members.items()]


def judged(
    reports: Sequence[HealthReport | SeenReport],
    *,
    spec: DomainSpec | None = SPEC,
    recs: list[MemberRecord] | None = None,
    now: float = NOW + 1,
) -> DomainStatus:
    return judge(
        "d1",
        spec=spec,
        records=records() if recs is None else recs,
        reports=reports,
        now=now,
        report_interval_s=INTERVAL,
    )


def row(status: DomainStatus, node: str) -> Any:
    return next(r for r in status.nodes if r.node == node)


# Pure: the overall state.


def test_every_member_ready_and_connected_is_up() -> None:
    """Three ready members whose views see each other READY and connected make UP."""
    status = judged([report(n, s, THREE) for s, n in THREE.items()])
    assert status.state == "UP"
    assert (status.ready, status.members) == (3, 3)
    assert status.reasons == []
    assert [r.slot for r in status.nodes] == [0, 1, 2]


def test_a_crash_looping_member_makes_the_domain_degraded() -> None:
    """A FATAL member fails with DaemonCrashLoop while the others stay ready: DEGRADED."""
    reports = [
        report("n1", 0, THREE, down=("n2",)),
        report("n2", 1, THREE, daemon=CRASH),
        report("n3", 2, THREE, down=("n2",)),
    ]
    status = judged(reports)
    assert status.state == "DEGRADED"
    assert status.ready == 2
    n2 = row(status, "n2")
    assert n2.reasons == ["DaemonCrashLoop"]
    assert n2.failed
    assert not n2.ready
    assert any("signal SIGKILL" in d for d in n2.details)
    assert status.reasons[0] == "DaemonCrashLoop: n2"
    assert row(status, "n1").reasons == ["PeersUnreachable"]
    assert not row(status, "n1").failed, "a peer that is down explains n1's complaint"


def test_no_member_ready_with_failures_is_down() -> None:
    """Every member crash looping is DOWN."""
    status = judged([report(n, s, THREE, daemon=CRASH) for s, n in THREE.items()])
    assert status.state == "DOWN"
    assert status.ready == 0


def test_a_domain_without_reports_or_with_joining_members_is_forming() -> None:
    """Listed nodes that have not reported, or only start, make FORMING, not a failure."""
    assert judged([], recs=[]).state == "FORMING"
    starting = fx.DaemonFacts(state="STARTING", pid=7)
    reports = [
        report("n1", 0, THREE, down=("n2", "n3")),
        report("n2", 1, THREE, daemon=starting),
    ]
    status = judged(reports)
    assert status.state == "FORMING"
    assert row(status, "n2").pending
    assert row(status, "n3").reasons == ["NoReport"]
    waiting = fx.DaemonFacts(state="RUNNING", pid=7, imex_status="WAITING_FOR_PEERS")
    status = judged([report("n1", 0, THREE), report("n2", 1, THREE, daemon=waiting)])
    assert status.state == "FORMING"


def test_a_member_whose_agent_is_gone_is_agent_down_not_no_report() -> None:
    """A listed node without a report whose agent the bus says is gone (`down`: a clean
    stop, its will) is a failure with that reason (issue 25), not a joining NoReport; a
    report of it is the agent back, whatever `down` says."""
    reports = [report("n1", 0, THREE), report("n2", 1, THREE)]
    gone = {"n3": "its agent stopped 8 s ago (a clean stop: its last word)"}
    status = judge(
        "d1",
        spec=SPEC,
        records=records({0: "n1", 1: "n2"}),
        reports=reports,
        now=NOW + 1,
        report_interval_s=INTERVAL,
        down=gone,
    )
    n3 = row(status, "n3")
    assert n3.reasons == ["AgentDown"]
    assert n3.failed
    assert not n3.pending
    assert status.state == "DEGRADED"
    assert "AgentDown: its agent stopped 8 s ago" in n3.details[0]
    back = judge(
        "d1",
        spec=SPEC,
        records=records(),
        reports=[*reports, report("n3", 2, THREE)],
        now=NOW + 1,
        report_interval_s=INTERVAL,
        down=gone,
    )
    assert "AgentDown" not in row(back, "n3").reasons


def test_a_daemon_not_answering_yet_after_its_start_is_forming_for_a_while() -> None:
    """Just started, IMEX answers `ctl -q` with UNAVAILABLE until its command service
    listens: a healthy start reads FORMING, not DOWN; still UNAVAILABLE after
    START_GRACE_INTERVALS report intervals, or after a restart, it is a failure."""
    quiet = fx.DaemonFacts(state="RUNNING", pid=7, imex_status="UNAVAILABLE")
    fresh = [report(n, s, THREE, daemon=quiet, probed=False) for s, n in THREE.items()]
    status = judged(fresh)
    assert (status.state, status.ready) == ("FORMING", 0), status.reasons
    assert all(r.pending and not r.failed for r in status.nodes)
    long_ago = NOW - START_GRACE_INTERVALS * INTERVAL - 1
    old = [
        report(n, s, THREE, daemon=quiet, probed=False, since=long_ago) for s, n in THREE.items()
    ]
    assert judged(old).state == "DOWN"
    again = msgspec.structs.replace(quiet, restarts=1)
    restarted = [report(n, s, THREE, daemon=again, probed=False) for s, n in THREE.items()]
    assert judged(restarted).state == "DOWN"


def test_views_not_probed_yet_or_missing_a_member_keep_it_forming() -> None:
    """All ready is not UP until every view has been probed and lists every member."""
    reports = [report(n, s, THREE, probed=s != 1) for s, n in THREE.items()]
    assert judged(reports).state == "FORMING"
    two = {0: "n1", 1: "n2"}
    reports = [report(n, s, two if s == 0 else THREE) for s, n in THREE.items()]
    assert judged(reports).state == "FORMING"


def test_a_restarted_daemon_that_is_not_ready_is_a_failure() -> None:
    """Starting again after a crash is not joining: the domain is DEGRADED."""
    backoff = fx.DaemonFacts(state="STARTING", pid=9, restarts=1, last_exit="exit 1")
    reports = [
        report("n1", 0, THREE, down=("n2",)),
        report("n2", 1, THREE, daemon=backoff),
        report("n3", 2, THREE, down=("n2",)),
    ]
    assert judged(reports).state == "DEGRADED"


def test_a_stale_report_counts_as_not_ready() -> None:
    """A report older than three intervals, or past its expiry, is stale and failed."""
    old = NOW - STALE_INTERVALS * INTERVAL - 1
    reports: list[HealthReport | SeenReport] = [
        report("n1", 0, THREE),
        report("n2", 1, THREE),
        report("n3", 2, THREE, at=old),
    ]
    status = judged(reports)
    assert status.state == "DEGRADED"
    n3 = row(status, "n3")
    assert (n3.report, n3.ready, n3.reasons) == ("stale", False, ["Stale"])
    expired = SeenReport(report("n3", 2, THREE), expires_at=NOW)
    status = judged([report("n1", 0, THREE), report("n2", 1, THREE), expired])
    assert row(status, "n3").report == "stale"
    assert status.state == "DEGRADED"
    assert "stale" in render_status(status)


def test_a_version_skew_seen_by_a_member_is_reported() -> None:
    """A `!V!` cell (DomainUp reason VersionMismatch) keeps the domain from UP."""
    reports = [report(n, s, THREE, skew=("n3",) if s == 0 else ()) for s, n in THREE.items()]
    status = judged(reports)
    assert status.state == "DEGRADED"
    assert any(r.startswith("VersionMismatch: n1 reports") for r in status.reasons)
    assert "VersionMismatch" in row(status, "n1").reasons
    assert "VersionMismatch" in render_status(status)


def test_differing_drivers_are_a_version_mismatch() -> None:
    """Members whose driver fields differ are DEGRADED, the odd one named."""
    drivers = {"n1": "570.86", "n2": "570.86", "n3": "565.57"}
    reports = [report(n, s, THREE, driver=drivers[n]) for s, n in THREE.items()]
    status = judged(reports)
    assert status.state == "DEGRADED"
    assert "VersionMismatch: driver 565.57 on n3; 570.86 on n1, n2" in status.reasons
    assert row(status, "n3").reasons == ["VersionMismatch"]
    assert row(status, "n1").reasons == []


def test_ready_members_that_cannot_reach_each_other_are_degraded() -> None:
    """A ready member's view that says a long-ready peer is disconnected is a failure."""
    n3 = report("n3", 2, THREE, since=NOW - 100)
    reports = [report("n1", 0, THREE, down=("n3",)), report("n2", 1, THREE), n3]
    status = judged(reports)
    assert status.state == "DEGRADED"
    assert row(status, "n1").failed
    assert "PeersUnreachable" in row(status, "n1").reasons
    fresh_n3 = report("n3", 2, THREE, since=NOW - 0.5)
    late = judged([report("n1", 0, THREE, down=("n3",)), report("n2", 1, THREE), fresh_n3])
    assert late.state == "FORMING", "n3 became ready after n1 reported: late news"


def test_without_a_spec_the_members_are_the_record_holders_and_never_up() -> None:
    """Without a spec the members are the nodes with a record; all ready is still UNKNOWN."""
    two = {0: "n1", 1: "n2"}
    recs = records(two)
    status = judged([report(n, s, two) for s, n in two.items()], spec=None, recs=recs)
    assert status.state == "UNKNOWN", "1 of 1 and 3 of 3 look alike without a node list"
    assert (status.ready, status.members) == (2, 2)
    assert any(r.startswith("NoSpec: ") for r in status.reasons)
    text = render_status(status)
    assert "no spec" in text
    assert "NoSpec: " in text


def test_a_node_list_given_to_status_replaces_a_missing_spec() -> None:
    """`--nodes` judges a spec-less (static) domain against that list: UP when all are."""
    two = {0: "n1", 1: "n2"}
    reports = [report(n, s, two) for s, n in two.items()]
    status = judge(
        "d1",
        spec=None,
        records=records(two),
        reports=reports,
        now=NOW + 1,
        report_interval_s=INTERVAL,
        expect=["n1", "n2"],
    )
    assert status.state == "UP"
    assert (status.ready, status.members) == (2, 2)
    more = judge(
        "d1",
        spec=None,
        records=records(two),
        reports=reports,
        now=NOW + 1,
        report_interval_s=INTERVAL,
        expect=["n1", "n2", "n3"],
    )
    assert more.state == "FORMING"
    assert row(more, "n3").reasons == ["NoReport"]


def test_an_empty_view_is_unknown_not_up() -> None:
    """No spec and no member record (at most reports) is UNKNOWN, never UP or FORMING."""
    assert judged([], spec=None, recs=[]).state == "UNKNOWN"
    two = {0: "n1", 1: "n2"}
    status = judged([report(n, s, two) for s, n in two.items()], spec=None, recs=[])
    assert status.state == "UNKNOWN"
    assert status.members == 0
    assert any(r.startswith("NoMembers: ") for r in status.reasons)


def test_the_lost_retained_state_of_a_broker_restart_is_not_up() -> None:
    """Spec lost and one record back whose view forgot its peers: not `UP, 1 of 1`."""
    one = {0: "n1"}
    status = judged([report("n1", 0, one)], spec=None, recs=records(one))
    assert status.state != "UP"
    assert status.state == "UNKNOWN"


def test_a_view_naming_nodes_without_a_record_is_partial() -> None:
    """A member's view that names nodes with no record here makes the domain UNKNOWN."""
    spec = DomainSpec(domain="d1", nodes=None, max_nodes=8, generation=1)
    status = judged(
        [report(n, s, THREE) for s, n in THREE.items() if n == "n1"],
        spec=spec,
        recs=records({0: "n1"}),
    )
    assert status.state == "UNKNOWN"
    assert "Partial: n1's domain view names n2, n3, which hold no member record" in (status.reasons)


def test_reports_of_nodes_without_a_member_record_do_not_count() -> None:
    """A report without a member record is shown as NoRecord and never counted as ready."""
    one = {0: "n1"}
    ghost = report("n9", 5, {5: "n9"})
    spec = DomainSpec(domain="d1", nodes=None, max_nodes=8, generation=1)
    status = judged([report("n1", 0, one), ghost], spec=spec, recs=records(one))
    assert status.state == "UP"
    assert (status.ready, status.members) == (1, 1)
    n9 = row(status, "n9")
    assert (n9.expected, n9.ready, n9.reasons) == (False, False, ["NoRecord"])
    listed = judged(
        [report(n, s, THREE) for s, n in THREE.items()], recs=records({0: "n1", 1: "n2"})
    )
    assert listed.state != "UP", "n3 is listed and reports ready, but holds no record"
    assert listed.ready == 2
    assert row(listed, "n3").reasons == ["NoRecord"]


def test_a_report_without_a_record_is_not_shown_in_a_members_slot() -> None:
    """A report of a node without a member record that claims a member's slot shows no
    slot (its row is not the member's); with the slot free, the report's slot is shown."""
    intruder = report("n9", 1, {1: "n9"})
    status = judged([*(report(n, s, THREE) for s, n in THREE.items()), intruder])
    assert row(status, "n2").slot == 1
    assert row(status, "n9").slot is None
    slot_cells = [line.split()[:2] for line in render_status(status).splitlines()[1:5]]
    assert ["1", "n9"] not in slot_cells
    free = judged([report("n1", 0, THREE), report("n9", 5, {5: "n9"})], recs=records({0: "n1"}))
    assert row(free, "n9").slot == 5


def test_a_report_stamped_in_the_far_future_says_so_briefly() -> None:
    """A stamp of 1e308 is ClockSkew with a short number, not 300 digits."""
    reports = [report("n1", 0, THREE), report("n2", 1, THREE), report("n3", 2, THREE, at=1e308)]
    status = judged(reports)
    text = render_status(status)
    assert "ClockSkew" in text
    assert max(len(line) for line in [*text.splitlines(), *status.reasons]) < 200
    assert "1e+308 s ahead" in text


def test_a_report_from_the_future_is_clock_skew() -> None:
    """A report stamped more than 30 s ahead is not fresh: ClockSkew, not ready."""
    reports = [
        report("n1", 0, THREE),
        report("n2", 1, THREE),
        report("n3", 2, THREE, at=NOW + 1 + FUTURE_SKEW_S + 15),
    ]
    status = judged(reports)
    assert status.state == "DEGRADED"
    n3 = row(status, "n3")
    assert (n3.report, n3.ready, n3.reasons) == ("future", False, ["ClockSkew"])
    assert any(r.startswith("ClockSkew: n3's report is stamped 45 s ahead") for r in status.reasons)
    assert "ClockSkew" in render_status(status)
    near = [report(n, s, THREE, at=NOW + 20) for s, n in THREE.items()]
    assert judged(near).state == "UP", "a few seconds of skew are tolerated"


def bus_down(r: HealthReport) -> HealthReport:
    """The report of an agent whose link to the broker is down: DomainUp Unknown BusDown."""
    conds = [
        msgspec.structs.replace(
            c, status="Unknown", reason="BusDown", message="the bus link is down"
        )
        if c.type == DOMAIN_UP
        else c
        for c in r.conditions
    ]
    return msgspec.structs.replace(r, conditions=conds)


def test_a_node_whose_bus_is_down_has_a_stale_view() -> None:
    """A view reported while the agent's bus is down or unsynced never counts for UP."""
    reports = [report("n1", 0, THREE), report("n2", 1, THREE), bus_down(report("n3", 2, THREE))]
    status = judged(reports)
    assert status.state == "UNKNOWN"
    assert "BusDown" in row(status, "n3").reasons
    assert any(r.startswith("BusDown: n3") for r in status.reasons)


def test_a_node_outside_the_spec_list_does_not_count() -> None:
    """A reporting node the spec does not list is shown as NotInSpec and not counted."""
    spec = DomainSpec(domain="d1", nodes=["n1", "n2"], max_nodes=8)
    two = {0: "n1", 1: "n2"}
    out = report("n3", 2, THREE, membership="out", daemon=fx.DaemonFacts())
    status = judged(
        [*(report(n, s, two) for s, n in two.items()), out], spec=spec, recs=records(two)
    )
    assert status.state == "UP"
    assert status.members == 2
    assert row(status, "n3").reasons[0] == "NotInSpec"


def test_members_without_multi_node_nvlink_are_up_without_a_view() -> None:
    """Nodes with an empty clique run no daemon; ready is all they need to be UP."""
    recs = [member_record("n1", 0, clique=""), member_record("n2", 1, clique="")]
    reports = [
        report("n1", 0, {}, clique="", daemon=fx.DaemonFacts(), probed=False),
        report("n2", 1, {}, clique="", daemon=fx.DaemonFacts(), probed=False),
    ]
    spec = DomainSpec(domain="d1", nodes=["n1", "n2"], max_nodes=8)
    assert judged(reports, spec=spec, recs=recs).state == "UP"


def test_the_status_table_lists_each_node_with_its_reasons() -> None:
    """The table has one row per node and the reasons' messages below it."""
    reports = [report("n1", 0, THREE), report("n2", 1, THREE, daemon=CRASH), report("n3", 2, THREE)]
    text = render_status(judged(reports))
    lines = text.splitlines()
    assert lines[0].startswith("domain d1: DEGRADED, 2 of 3 members ready (spec generation 1")
    assert lines[1].split() == ["SLOT", "NODE", "ADDRESS", "DAEMON", "IMEX", "READY", "REASONS"]
    assert lines[3].split() == ["1", "n2", "127.0.0.11", "FATAL", "-", "no", "DaemonCrashLoop"]
    assert "  n2: DaemonReady=False DaemonCrashLoop: signal SIGKILL" in text


def test_the_json_document_round_trips() -> None:
    """`--json` output decodes back into the same DomainStatus."""
    status = judged([report(n, s, THREE) for s, n in THREE.items()])
    doc = msgspec.json.encode(status)
    assert msgspec.json.decode(doc, type=DomainStatus) == status


def test_a_lost_member_is_not_ready_with_reason_lost() -> None:
    """A member whose record is its Last Will (state lost) is not ready: Lost, a failure,
    even while its last report still says ready."""
    n2 = member_record("n2", 1)
    lost = msgspec.structs.replace(n2, state=MemberState.LOST, slot=None, settled=None, hold_s=5.0)
    recs = [member_record("n1", 0), lost, member_record("n3", 2)]
    status = judged([report(n, s, THREE) for s, n in THREE.items()], recs=recs)
    assert status.state == "DEGRADED"
    n2_row = row(status, "n2")
    assert not n2_row.ready
    assert n2_row.failed
    assert n2_row.reasons[0] == "Lost"
    assert n2_row.slot == 1  # from its last report
    assert "Lost: n2" in status.reasons
