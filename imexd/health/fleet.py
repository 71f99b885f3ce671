"""Whether a domain is UP: the one home of that rule, for the fleet and for one node.

Pure functions, no I/O, no clock of their own (`now` is an argument). Which function
answers which question:

- `links(table, members, mode)`: what does this node's `ctl -N -j` say of each member
  (READY? connected to every other READY member?). A dead daemon is named alone; a broken
  link between two live members names both ends. The agent calls it after each probe.
- `sight(facts)`: is the domain UP as this node sees it (its DomainUp condition and its
  UP/DEGRADED/DOWN/FORMING verdict); `domain_view(facts)` is the same verdict per member,
  for the node's HealthReport. imexd.health.conditions only wraps `sight` into the
  condition.
- `judge(spec, records, reports, ...)`: is the domain UP from every member's record and
  report on the bus: `imexd domain status` and `domain list`, `domain status --wait`
  (Slurm prologs), the demo and the benchmarks. It reads the nodes' DomainUp conditions
  and domain views, so a change of `sight` shows in `judge` too.
- `judge_workload(record, reports, members, ...)`, in `imexd.channels.fleet`: is a
  workload's IMEX channel ready on every node it lists (`imexd workload create --wait`,
  `workload status` and `list`), from the ChannelInfo each node's report carries.

The tables they print are rendered here too, so the same judgement reads the same
everywhere.

One piece because the per-node rule (`sight`), the fleet's (`judge`) and the tables must
use the same words for ready, joining and failed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

import msgspec

from imexd.imex import ConnectionState, ImexState
from imexd.messages import (
    DAEMON_READY,
    DOMAIN_UP,
    READINESS_TYPES,
    Condition,
    DomainSpec,
    DomainView,
    HealthReport,
    MemberRecord,
    MemberState,
    Mode,
    SlotView,
    describe,
)

if TYPE_CHECKING:
    from imexd.daemon.ctl import DomainTable
    from imexd.facts import Facts, LinkFacts

STALE_INTERVALS: Final = 3
"""A report older than this many `[health] report_interval_s` (by its `at`) is stale."""
FUTURE_SKEW_S: Final = 30.0
"""A report stamped more than this many seconds ahead of our clock is not fresh: the
node's clock (or ours) is wrong, and its age would read as fresh for that long."""
DomainState = Literal["UP", "DEGRADED", "DOWN", "FORMING", "UNKNOWN"]
ReportState = Literal["fresh", "stale", "future", "missing"]

FORMING_REASONS: Final = frozenset({"Syncing", "Joining", "Claiming", "NotStarted", "Starting"})
"""Readiness reasons of a node that is still joining for the first time."""
START_WORDS: Final = frozenset(
    {"INITIALIZING", "STARTING_AUTH_SERVER", "WAITING_FOR_PEERS", "INIT_GPU"}
)
"""IMEX states of a daemon on its way to READY (NotReady with these counts as forming)."""
START_GRACE_INTERVALS: Final = 2
"""Report intervals a first daemon may answer UNAVAILABLE (its command service not
listening yet) and still count as forming; past them it is a failure."""
VERSION_MISMATCH: Final = "VersionMismatch"
CLOCK_SKEW: Final = "ClockSkew"
BUS_DOWN: Final = "BusDown"
LOST: Final = "Lost"
"""A member whose record is its Last Will (state lost): its link ended without DISCONNECT."""
AGENT_DOWN: Final = "AgentDown"
"""A member without a report whose agent the bus says is gone: it stopped cleanly (its
presence says so) or its will fired, and no later word of it came."""
"""The DomainUp reason of an agent whose link to the broker is down or not synced yet."""
IMEX_READY: Final = ImexState.READY.value
UNKNOWN_REASONS: Final = ("NoSpec", "NoMembers", "Partial", BUS_DOWN)
"""Domain-level reasons that say what the bus does not tell (never a failure)."""


class SeenReport(msgspec.Struct, frozen=True):
    """A HealthReport and when the broker drops it (MQTT 5 message expiry)."""

    report: HealthReport
    expires_at: float | None = None
    """Wall-clock time of expiry; None when unknown (MQTT 3.1.1, or none was set)."""


# Judging a domain: pure functions of what the bus holds.


class NodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One node of a domain as the control plane judges it."""

    node: str
    clique: str | None
    """From its record or report; None when it has neither."""
    slot: int | None
    address: str
    daemon: str
    """The daemon's state from the report, "-" without one."""
    imex: str
    """The IMEX state word from the report, "-" without one."""
    ready: bool
    """A fresh report that says ready."""
    report: ReportState
    """fresh, stale (too old or expired), future (stamped more than FUTURE_SKEW_S ahead:
    clock skew) or missing."""
    age_s: float | None
    """Seconds since the report's `at` (negative when stamped ahead of our clock)."""
    expected: bool
    """Counts towards the domain's state: listed by the spec (or `--nodes`), or holding a
    member record when nothing lists the nodes. A report alone never makes a node count."""
    pending: bool
    """Not ready, but only because it has not joined yet (no failure)."""
    failed: bool
    """Not ready, or not connected, for a reason that is a failure."""
    record: str | None
    """The member record's state (claiming, member, standby, leaving), None without one."""
    driver: str
    restarts: int | None
    reasons: list[str]
    """Machine-readable reasons, e.g. DaemonCrashLoop, PeersUnreachable, Stale, NoReport."""
    details: list[str]
    """One human line per reason."""


class DomainStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A domain's overall state and its nodes: what `domain status --json` prints."""

    v: Literal[1] = 1
    domain: str
    state: DomainState
    reasons: list[str]
    """Why it is not UP, one "Reason: text" line each."""
    ready: int
    members: int
    """Nodes that count (`NodeRow.expected`)."""
    spec: DomainSpec | None
    nodes: list[NodeRow]
    at: float
    """Wall-clock time of the judgement."""

    @property
    def known(self) -> bool:
        """Whether the bus holds anything about this domain at all."""
        return self.spec is not None or bool(self.nodes)


class _Node(msgspec.Struct):
    """What the bus says about one node of the domain, while judging it."""

    name: str
    expected: bool
    unlisted: bool = False
    """A node list exists (spec or `expect`) and does not name this node."""
    record: MemberRecord | None = None
    seen: SeenReport | None = None
    fresh: HealthReport | None = None
    """The report when it is neither too old, expired, nor from the future."""
    future: bool = False
    """The report is stamped more than FUTURE_SKEW_S ahead of our clock (clock skew)."""
    notes: list[tuple[str, str]] = msgspec.field(default_factory=list)
    """(reason, text) found by looking at the other members (links, driver skew)."""
    failed_by_peers: bool = False
    down: str | None = None
    """Why the bus says the node's agent is gone (a clean stop, its will), if it does."""

    @property
    def lost(self) -> bool:
        """The node's record is its Last Will: its link ended without DISCONNECT."""
        return self.record is not None and self.record.state is MemberState.LOST

    @property
    def ready(self) -> bool:
        """A fresh report that says ready, of a node that holds a member record (not lost)."""
        return (
            self.record is not None
            and not self.lost
            and self.fresh is not None
            and self.fresh.ready
        )

    @property
    def bus_down(self) -> bool:
        """The fresh report says the agent's link to the broker is down or not synced:
        what it says of its peers (its domain view) is stale."""
        if self.fresh is None:
            return False
        return any(
            c.type == DOMAIN_UP and c.status == "Unknown" and c.reason == BUS_DOWN
            for c in self.fresh.conditions
        )

    @property
    def clique(self) -> str | None:
        if self.record is not None:
            return self.record.clique
        return self.seen.report.clique if self.seen is not None else None


def _failing(report: HealthReport) -> list[Condition]:
    """The readiness conditions that are not True, then DomainUp when it is False."""
    by_type = {c.type: c for c in report.conditions}
    out = [by_type[t] for t in READINESS_TYPES if t in by_type and by_type[t].status != "True"]
    up = by_type.get(DOMAIN_UP)
    if up is not None and up.status == "False" and up.reason != "DaemonDown":
        out.append(up)  # DaemonDown only points at DaemonReady, which is listed already
    return out


def _forming(report: HealthReport, report_interval_s: float) -> bool:
    """Not ready only because the node is still joining for the first time: joining
    reasons, an IMEX start-up state, or a first daemon that has not answered for less
    than START_GRACE_INTERVALS report intervals (UNAVAILABLE: not listening yet)."""
    if report.daemon.restarts:
        return False
    word = report.daemon.imex_status or ""
    for cond in _failing(report):
        if cond.type == DOMAIN_UP or cond.reason in FORMING_REASONS:
            continue
        if cond.reason == "NotReady" and word in START_WORDS:
            continue
        if (
            cond.reason == "NotReady"
            and word == ImexState.UNAVAILABLE.value
            and report.at - cond.since < START_GRACE_INTERVALS * report_interval_s
        ):
            continue
        return False
    return True


def _ready_since(report: HealthReport) -> float:
    """When the node's DaemonReady condition last changed (its report time if absent)."""
    return next((c.since for c in report.conditions if c.type == DAEMON_READY), report.at)


def seconds_text(seconds: float) -> str:
    """`45` for 45.2 s; past 1e6 s three digits (a stamp of 1e308 gave 309): `1e+308`."""
    return f"{seconds:.0f}" if abs(seconds) < 1e6 else f"{seconds:.3g}"


def _gather(
    listed: Sequence[str] | None,
    records: Iterable[MemberRecord],
    reports: Iterable[SeenReport | HealthReport],
    *,
    now: float,
    stale_after: float,
) -> dict[str, _Node]:
    nodes: dict[str, _Node] = {}

    def entry(name: str) -> _Node:
        if name not in nodes:
            inside = listed is not None and name in listed
            nodes[name] = _Node(name, expected=inside, unlisted=listed is not None and not inside)
        return nodes[name]

    for name in listed or ():
        entry(name)
    for record in records:
        e = entry(record.node)
        if e.record is None or record.incarnation >= e.record.incarnation:
            e.record = record
        if listed is None:
            e.expected = True
    for item in reports:
        seen = item if isinstance(item, SeenReport) else SeenReport(item)
        e = entry(seen.report.node)
        e.seen = seen
        old = now - seen.report.at > stale_after
        expired = seen.expires_at is not None and now >= seen.expires_at
        e.future = seen.report.at - now > FUTURE_SKEW_S
        e.fresh = None if old or expired or e.future else seen.report
    return nodes


def _peer_links(nodes: Mapping[str, _Node], report_interval_s: float) -> bool:
    """Judge connectivity as each ready member with a daemon sees it; True while some
    view is not settled yet (not probed, or missing members, or only late)."""
    pending = False
    for e in nodes.values():
        report = e.fresh
        if not e.ready or report is None or not report.clique or not e.expected or e.bus_down:
            continue
        view = report.domain_view
        if view is None or view.status == "FORMING":
            pending = True
            continue
        peers = {
            n.name
            for n in nodes.values()
            if n.expected and n.clique == report.clique and n.name != e.name
        }
        if not peers <= {v.node for v in view.nodes.values()}:
            pending = True
        if view.status == "UP":
            continue
        suspects = sorted(
            v.node
            for v in view.nodes.values()
            if v.node != e.name and (v.status != IMEX_READY or not v.connected)
        )
        known = [nodes[s] for s in suspects if s in nodes]
        if any(not s.ready for s in known):
            continue  # a member that is not ready explains it; its own row says why
        # A suspect that became ready after this report was written is only late news.
        if known and all(
            s.fresh is not None and _ready_since(s.fresh) > report.at - report_interval_s
            for s in known
        ):
            pending = True
            continue
        e.failed_by_peers = True
        who = ", ".join(suspects) or "its peers"
        e.notes.append(
            ("PeersUnreachable", f"{e.name} does not reach {who} (its domain view: {view.status})")
        )
    return pending


def _unknowns(nodes: Mapping[str, _Node], *, listed: bool) -> list[str]:
    """What keeps the bus from telling the whole domain: no spec (NoSpec), a member
    view naming nodes that hold no record here (Partial: the broker lost retained state,
    or records are still on their way), members whose bus link is down (BusDown)."""
    lines: list[str] = []
    if not listed and any(e.expected for e in nodes.values()):
        lines.append(
            "NoSpec: no spec on the bus (a static domain, or the broker lost its retained "
            "state): whether every member has reported cannot be told; give `domain status "
            "--nodes`, or write a spec with the nodes (`imexd domain create NAME --nodes ...`)"
        )
    for e in nodes.values():
        if not e.expected or not e.ready or e.bus_down or e.fresh is None:
            continue
        view = e.fresh.domain_view
        named = sorted({v.node for v in view.nodes.values()}) if view is not None else []
        missing = [n for n in named if n not in nodes or nodes[n].record is None]
        if missing:
            lines.append(
                f"Partial: {e.name}'s domain view names {', '.join(missing)}, which hold no "
                "member record"
            )
    for e in nodes.values():
        if e.expected and e.bus_down and e.fresh is not None:
            since = next((c.since for c in e.fresh.conditions if c.type == DOMAIN_UP), e.fresh.at)
            lines.append(
                f"{BUS_DOWN}: {e.name}'s link to the broker is down or not synced "
                f"(for {max(0.0, e.fresh.at - since):.0f} s when it reported): its domain view "
                "is stale"
            )
            e.notes.append(
                (BUS_DOWN, "its link to the broker is down or not synced: its view is stale")
            )
    return lines


def _skew(nodes: Mapping[str, _Node], now: float) -> list[str]:
    """Failures between members: VersionMismatch (`!V!` cells a member reports, or
    differing driver fields) and ClockSkew (a report stamped ahead of our clock)."""
    lines: list[str] = []
    for e in nodes.values():
        if e.future and e.expected and e.seen is not None:
            ahead = e.seen.report.at - now
            lines.append(
                f"{CLOCK_SKEW}: {e.name}'s report is stamped {seconds_text(ahead)} s ahead of "
                "this host's clock: check the clocks (NTP) of both"
            )
    for e in nodes.values():
        if e.fresh is None or not e.expected:
            continue
        for cond in e.fresh.conditions:
            if cond.type == DOMAIN_UP and cond.reason == VERSION_MISMATCH:
                lines.append(f"{VERSION_MISMATCH}: {e.name} reports {cond.message}")
    by_version: dict[str, list[str]] = {}
    for e in nodes.values():
        driver = (e.seen.report.driver if e.seen else "") or (e.record.driver if e.record else "")
        if driver and e.expected:
            by_version.setdefault(driver, []).append(e.name)
    if len(by_version) > 1:
        common = max(by_version, key=lambda d: (len(by_version[d]), d))
        lines.append(
            f"{VERSION_MISMATCH}: driver "
            + "; ".join(f"{d} on {', '.join(sorted(ns))}" for d, ns in sorted(by_version.items()))
        )
        for driver, names in by_version.items():
            for name in names if driver != common else ():
                nodes[name].notes.append(
                    (VERSION_MISMATCH, f"driver {driver}, most members run {common}")
                )
    return lines


def judge(
    domain: str,
    *,
    spec: DomainSpec | None,
    records: Iterable[MemberRecord],
    reports: Iterable[SeenReport | HealthReport],
    now: float,
    report_interval_s: float,
    expect: Sequence[str] | None = None,
    down: Mapping[str, str] | None = None,
) -> DomainStatus:
    """The domain's state from its spec, member records and health reports.

    Members are the nodes of `expect` (`domain status --nodes`) when given, else the spec's
    listed nodes, else (a spec without a list, or no spec: a static domain, or a spec the
    broker lost) every node with a member record. A report of a node without a member
    record is shown (NoRecord) but never counted: it may be a leftover, or the report of
    a node that is not in the domain. A report is *stale* when its `at` is older than
    STALE_INTERVALS report intervals or its message expiry passed, and *from the future*
    when its `at` is more than FUTURE_SKEW_S ahead of our clock (ClockSkew, a failure).
    A member is *ready* with a record and a fresh report that says ready; *pending*
    without a report or a record, or when it fails readiness only with joining reasons
    (Syncing, Joining, Claiming, NotStarted, Starting, NotReady in a start-up IMEX state,
    or UNAVAILABLE for less than START_GRACE_INTERVALS report intervals) and its daemon
    never restarted; *failed* otherwise (DaemonCrashLoop, Stale, ...). Also
    failures: a ready member whose domain view says a ready peer is not READY or not
    connected (PeersUnreachable; unless that peer became ready less than one report
    interval before the view was reported: late news), a member without a report whose
    agent the bus says is gone (`down`, node -> why: AgentDown, not NoReport), and a skew
    between members
    (VersionMismatch: a `!V!` cell in a member's view, or members whose `driver` fields
    differ; ClockSkew).

    What the bus cannot tell is never UP: no spec and no `expect` (NoSpec: 1 of 1 and 1
    of 3 look alike; a spec that lists no nodes is the operator's choice of "any"), no
    member at all (NoMembers), a member view naming nodes without a record (Partial), a
    member whose bus link is down or not synced (BusDown: its view is stale).

    - UP: every member ready, nothing failed, every ready member with a daemon sees every
      member of its clique READY and connected (domain view UP), and nothing unknown;
    - FORMING: not UP, nothing failed, and something is joining (pending members, views
      not probed yet);
    - UNKNOWN: not UP, nothing failed or joining, but the bus does not tell the whole
      domain (the reasons above);
    - DOWN: something failed and no member is ready;
    - DEGRADED: something failed and some member is ready.
    """
    listed = list(expect) if expect is not None else spec.nodes if spec is not None else None
    nodes = _gather(
        listed, records, reports, now=now, stale_after=STALE_INTERVALS * report_interval_s
    )
    for name, why in (down or {}).items():
        if name in nodes:
            nodes[name].down = why
    views_pending = _peer_links(nodes, report_interval_s)
    unknowns = _unknowns(nodes, listed=listed is not None or spec is not None)
    reasons = _skew(nodes, now)
    held = frozenset((e.clique, e.record.slot) for e in nodes.values() if e.record is not None)
    rows = sorted(
        (_row(e, now, held, report_interval_s) for e in nodes.values()),
        key=lambda r: (r.clique or "", r.slot is None, r.slot or 0, r.node),
    )
    members = [r for r in rows if r.expected]
    ready = sum(1 for r in members if r.ready)
    failures = any(r.failed for r in members) or bool(reasons)
    joining = views_pending or any(r.pending for r in members)
    state: DomainState
    if not members:
        state = "UNKNOWN"
        unknowns = [
            "NoMembers: no spec lists nodes and no node holds a member record of the domain"
        ]
    elif ready == len(members) and not failures and not views_pending and not unknowns:
        state = "UP"
    elif failures:
        state = "DOWN" if ready == 0 else "DEGRADED"
    elif joining:
        state = "FORMING"
    else:
        state = "UNKNOWN"
    reasons[:0] = [
        f"{r.reasons[0]}: {r.node}" for r in members if (r.failed or r.pending) and r.reasons
    ]
    if state == "FORMING" and views_pending:
        reasons.append("Forming: a member's domain view has not seen every member yet")
    reasons.extend(unknowns)
    if spec is not None and spec.state == "deleting":
        reasons.insert(0, "Deleting: the spec is in state deleting")
    return DomainStatus(
        domain=domain,
        state=state,
        reasons=reasons,
        ready=ready,
        members=len(members),
        spec=spec,
        nodes=rows,
        at=now,
    )


def _row(
    e: _Node,
    now: float,
    held: frozenset[tuple[str | None, int | None]],
    report_interval_s: float,
) -> NodeRow:
    seen = e.seen.report if e.seen is not None else None
    record, report = e.record, e.fresh
    reasons: list[str] = []
    details: list[str] = []
    if e.unlisted:
        reasons.append("NotInSpec")
        details.append("NotInSpec: the spec's node list does not include this node")
    if seen is not None and record is None:
        reasons.append("NoRecord")
        details.append(
            "NoRecord: a health report but no member record (not joined, left, or the broker "
            "lost the record): the report is not counted"
        )
    if e.lost:
        hold = e.record.hold_s if e.record is not None else 0.0
        reasons.append(LOST)
        details.append(
            f"{LOST}: its link to the broker ended without a goodbye (its Last Will is on "
            f"the bus); peers drop it from their node lists {hold:g} s after the will. "
            f"Bring it back, or if it is gone for good: imexd node forget {e.name}"
        )
    if seen is None and e.down is not None and not e.lost:
        reasons.append(AGENT_DOWN)
        details.append(f"{AGENT_DOWN}: {e.down}")
    elif seen is None:
        reasons.append("NoReport")
        details.append("NoReport: no health report on the bus (not joined yet, or gone)")
    elif e.future:
        reasons.append(CLOCK_SKEW)
        ahead = seconds_text(seen.at - now)
        details.append(f"{CLOCK_SKEW}: report stamped {ahead} s ahead of this host's clock")
    elif report is None:
        reasons.append("Stale")
        ago = seconds_text(now - seen.at)
        details.append(f"Stale: last report {ago} s ago (too old, or expired)")
    elif record is not None:
        for cond in _failing(report):
            reasons.append(cond.reason)
            details.append(describe(cond))
    for reason, text in e.notes:
        reasons.append(reason)
        details.append(f"{reason}: {text}")
    pending = (
        not e.ready
        and not e.lost
        and e.down is None
        and (
            seen is None
            or (report is not None and (record is None or _forming(report, report_interval_s)))
            or (record is None and not e.future)
        )
    )
    failed = (
        (not e.ready and not pending)
        or any(reason != BUS_DOWN for reason, _ in e.notes)
        or e.failed_by_peers
    )
    state: ReportState = (
        "missing"
        if seen is None
        else "future"
        if e.future
        else "stale"
        if report is None
        else "fresh"
    )
    slot = record.slot if record is not None and record.slot is not None else None
    if slot is None and seen is not None and (e.clique, seen.slot) not in held:
        slot = seen.slot  # `held`: a member's record's slot, never a mere report's
    return NodeRow(
        node=e.name,
        clique=e.clique,
        slot=slot,
        address=(record.address if record else "") or (seen.address if seen else ""),
        daemon=seen.daemon.state if seen else "-",
        imex=(seen.daemon.imex_status or "-") if seen else "-",
        ready=e.ready,
        report=state,
        age_s=round(now - seen.at, 3) if seen is not None else None,
        expected=e.expected,
        pending=pending and e.expected,
        failed=failed and e.expected,
        record=record.state.value if record else None,
        driver=(seen.driver if seen else "") or (record.driver if record else ""),
        restarts=seen.daemon.restarts if seen else None,
        reasons=list(dict.fromkeys(reasons)),
        details=details,
    )


# What one node sees of its domain: pure functions of the agent's own facts.

SIGHT_STATES: Final = ("UP", "DEGRADED", "DOWN", "FORMING")
"""The node's verdict on its domain (`Sight.state`), as /metrics exports it."""
NAMES_MAX: Final = 8
"""Node names a message lists before it says "and N more"."""


def name_list(names: Sequence[str]) -> str:
    """The names comma-separated, at most NAMES_MAX of them, then "and N more"."""
    shown = ", ".join(names[:NAMES_MAX])
    more = len(names) - NAMES_MAX
    return f"{shown} and {more} more" if more > 0 else shown


def links(table: DomainTable, members: Mapping[int, str], mode: Mode) -> LinkFacts:
    """Per member slot: its IMEX state and whether it is connected to the others.

    `table` is this node's `ctl -N -j`, `members` the settled members (slot -> node
    name). In addresses mode the table indexes the members in slot order, in names mode
    by slot. A member that is not READY is unreachable. A READY member is connected when
    its links with every other READY member are CONNECTED both ways: a dead daemon is
    named alone instead of making every member look disconnected from it, and a broken
    link between two live members names both ends.
    """
    from imexd.facts import LinkFacts, SlotLink  # noqa: PLC0415 - lazy: the control commands build none

    if mode == "addresses":
        index_of = {slot: i for i, slot in enumerate(sorted(members))}
    else:
        index_of = {slot: slot for slot in members}
    nodes = {slot: table.nodes.get(index) for slot, index in index_of.items()}
    words = {
        slot: _word(node.state) if node is not None else ImexState.UNAVAILABLE.value
        for slot, node in nodes.items()
    }
    ready = {slot for slot, word in words.items() if word == ImexState.READY.value}

    def linked(a: int, b: int) -> bool:
        node_a, node_b = nodes[a], nodes[b]
        return (
            node_a is not None
            and node_b is not None
            and node_a.connections.get(index_of[b]) is ConnectionState.CONNECTED
            and node_b.connections.get(index_of[a]) is ConnectionState.CONNECTED
        )

    slots: dict[int, SlotLink] = {}
    unreachable: list[str] = []
    mismatch: set[str] = set()
    for slot in index_of:
        node = nodes[slot]
        for other_slot, other in index_of.items():
            if (
                other_slot != slot
                and node is not None
                and node.connections.get(other) is ConnectionState.VERSION_MISMATCH
            ):
                mismatch.add(members[other_slot])
        peers = [o for o in ready if o != slot]
        connected = slot in ready and all(linked(slot, o) for o in peers)
        if not connected:
            unreachable.append(members[slot])
        slots[slot] = SlotLink(node=members[slot], status=words[slot], connected=connected)
    return LinkFacts(
        slots=MappingProxyType(slots),
        unreachable=tuple(sorted(set(unreachable))),
        version_mismatch=tuple(sorted(mismatch)),
    )


def _word(state: ImexState | str) -> str:
    return state.value if isinstance(state, ImexState) else state


class Sight(NamedTuple):
    """The node's DomainUp condition and its verdict on the domain."""

    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    state: str | None
    """One of SIGHT_STATES; None when the node has nothing to judge (idle, no daemon,
    a failed probe, the bus down)."""


def sight(f: Facts) -> Sight:
    """Is the domain UP, as this node sees it over its members (its DomainUp condition).

    IMEX's own "Domain State" is not used: in names mode the empty slots point at the
    sentinel address, so it reads DEGRADED until every slot is filled.
    """
    if f.domain is None:
        return Sight("Unknown", "NoDomain", "no domain assigned", None)
    if not f.daemon_applicable:
        return Sight("Unknown", "NotApplicable", "empty clique: no IMEX domain to join", None)
    if not f.bus.synced:
        # Without the bus the member records may be stale: what this node last saw of
        # its domain is no judgement of it now (the condition's `since` says how long).
        why = f": {f.bus.last_error}" if f.bus.last_error and not f.bus.connected else ""
        link = "down" if not f.bus.connected else "up but not yet synced"
        return Sight(
            "Unknown", "BusDown", f"the bus link is {link}{why}; the domain view is stale", None
        )
    forming = Sight(
        "False", "Forming", "waiting for the daemon and the first domain probe", "FORMING"
    )
    probe = f.domain_probe
    d = f.daemon
    if d.state in ("FATAL", "BACKOFF") or d.reason or d.write_error:
        # Nothing to judge while this node's own daemon is down: DaemonReady says why.
        return Sight("False", "DaemonDown", f"the local daemon is {d.state}: see DaemonReady", None)
    if f.membership.state != "member" or d.state != "RUNNING" or probe is None:
        return forming
    if probe.error:
        return Sight("Unknown", "ProbeFailed", f"ctl -N -j failed: {probe.error}", None)
    members = {slot: m.node for slot, m in f.membership.members.items()}
    if probe.version_mismatch:
        return Sight(
            "False",
            "VersionMismatch",
            f"driver version differs on {name_list(probe.version_mismatch)} (!V!)",
            "DEGRADED",
        )
    if d.imex_status != IMEX_READY:
        return forming
    unwell = set(probe.unreachable)
    for slot, node in members.items():
        seen = probe.slots.get(slot)
        if seen is None or seen.status != IMEX_READY or not seen.connected:
            unwell.add(node)
    bad = sorted(unwell)
    if not bad:
        return Sight("True", "Up", f"{len(members)} members READY and connected", "UP")
    others = set(members.values()) - {f.node}
    state = "DOWN" if others and others <= set(bad) else "DEGRADED"
    return Sight(
        "False",
        "PeersUnreachable",
        f"{len(bad)} of {len(members)} members not READY or not connected: {name_list(bad)}",
        state,
    )


def domain_view(facts: Facts) -> DomainView | None:
    """The members as the node's last domain probe saw them, for its HealthReport."""
    state = sight(facts).state
    if state is None:
        return None
    probe = facts.domain_probe
    nodes: dict[str, SlotView] = {}
    if probe is None:
        return DomainView(status=state, nodes=nodes)
    for slot, member in sorted(facts.membership.members.items()):
        seen = probe.slots.get(slot)
        nodes[str(slot)] = SlotView(
            node=member.node,
            status=seen.status if seen is not None else "UNKNOWN",
            connected=seen.connected if seen is not None else False,
        )
    return DomainView(status=state, nodes=nodes)


# Rendering: pure functions from judgements to text.


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, trailing blanks trimmed: every table imexd
    prints."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = []
    for row in (header, *rows):
        cells = [str(c).ljust(w) for c, w in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _yes(row: NodeRow) -> str:
    if row.report == "missing":
        return "-"
    if row.report in ("stale", "future"):
        return row.report
    return "yes" if row.ready else "no"


def render_status(status: DomainStatus, *, nodes_given: bool = False) -> str:
    """The `domain status` table: a headline, one row per node, then each reason's text.

    The headline says where the members came from: `nodes_given` (`--nodes`, as `judge`'s
    `expect`), else the spec's list, else the member records."""
    spec = status.spec
    given = "members from --nodes"
    if spec is None:
        about = f"no spec: {given}" if nodes_given else "no spec: members taken from their records"
    else:
        listed = f"{len(spec.nodes)} nodes listed" if spec.nodes is not None else "any node"
        about = (
            f"spec generation {spec.generation}, {spec.state}, max_nodes {spec.max_nodes}, {listed}"
        )
        if nodes_given:
            about += f"; {given}"
    lines = [
        f"domain {status.domain}: {status.state}, {status.ready} of {status.members} "
        f"members ready ({about})"
    ]
    several = len({r.clique for r in status.nodes if r.clique is not None}) > 1
    header = ["SLOT", "NODE", "ADDRESS", "DAEMON", "IMEX", "READY", "REASONS"]
    if several:
        header.insert(0, "CLIQUE")
    rows = []
    for r in status.nodes:
        cells = [
            "-" if r.slot is None else str(r.slot),
            r.node,
            r.address or "-",
            r.daemon,
            r.imex,
            _yes(r),
            ",".join(r.reasons) or "-",
        ]
        if several:
            cells.insert(0, r.clique or "-")
        rows.append(cells)
    if rows:
        lines.extend(table(header, rows))
    details = [f"  {r.node}: {d}" for r in status.nodes for d in r.details]
    if details:
        lines.append("reasons:")
        lines.extend(details)
    skew = [
        line
        for line in status.reasons
        if line.startswith(("Deleting", "Forming", VERSION_MISMATCH, CLOCK_SKEW, *UNKNOWN_REASONS))
    ]
    lines.extend(f"  {line}" for line in skew)
    return "\n".join(lines) + "\n"


def status_json(status: DomainStatus) -> str:
    """`domain status --json`: the DomainStatus as one JSON document."""
    return json.dumps(msgspec.to_builtins(status), sort_keys=False)


class DomainSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One line of `domain list`."""

    domain: str
    spec: str
    """The spec's state (active, deleting), or "-" without a spec (a static domain)."""
    generation: int | None
    max_nodes: int | None
    listed: int | None
    """Nodes the spec lists; None without a list."""
    assigned: int
    members: int
    """Nodes with a member record."""
    ready: int
    state: DomainState


def render_list(summaries: Sequence[DomainSummary]) -> str:
    """The `domain list` table."""
    if not summaries:
        return "no domains: no spec, member record, health report or assignment on the bus\n"

    def opt(value: int | None, empty: str = "-") -> str:
        return empty if value is None else str(value)

    header = [
        "DOMAIN",
        "SPEC",
        "GENERATION",
        "MAX_NODES",
        "LISTED",
        "ASSIGNED",
        "MEMBERS",
        "READY",
        "STATE",
    ]
    rows = [
        [
            s.domain,
            s.spec,
            opt(s.generation),
            opt(s.max_nodes),
            opt(s.listed, "any"),
            str(s.assigned),
            str(s.members),
            str(s.ready),
            s.state,
        ]
        for s in summaries
    ]
    return "\n".join(table(header, rows)) + "\n"
