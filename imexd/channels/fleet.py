"""Is a workload's channel ready on every node it lists: the one judgement of it.

`judge_workload` reads a workload's record and its domain's health reports and says
READY, PENDING, FAILED or UNKNOWN, with one row per listed node; `imexd workload status`,
`workload list` and `workload create --wait` use it (a Slurm prolog that ran
`domain create --channel` waits with `workload status --wait`). Apart from
imexd.health.fleet, which judges whether a *domain* is UP, because a channel is a
different question asked by different commands; both judge reports alike (`report_state`: fresh,
stale or stamped in the future).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal

import msgspec

from imexd.health.fleet import (
    AGENT_DOWN,
    CLOCK_SKEW,
    FUTURE_SKEW_S,
    STALE_INTERVALS,
    ReportState,
    SeenReport,
    seconds_text,
    table,
)
from imexd.messages import HealthReport, MemberRecord, WorkloadRecord

WorkloadState = Literal["READY", "PENDING", "FAILED", "UNKNOWN"]
WORKLOAD_PENDING_REASONS: Final = frozenset({"NoReport", "NotListed", "OldGeneration", "Pending"})
"""Per-node reasons of a channel that is only not made yet (no failure)."""


def report_state(seen: SeenReport, *, now: float, report_interval_s: float) -> ReportState:
    """fresh, stale (older than STALE_INTERVALS report intervals, or expired) or future
    (stamped more than FUTURE_SKEW_S ahead of `now`): the same rule as `judge`'s."""
    if seen.report.at - now > FUTURE_SKEW_S:
        return "future"
    old = now - seen.report.at > STALE_INTERVALS * report_interval_s
    expired = seen.expires_at is not None and now >= seen.expires_at
    return "stale" if old or expired else "fresh"


class WorkloadNodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One listed node of a workload: is the workload's channel ready there?"""

    node: str
    ready: bool
    """Its fresh report lists the workload ready, on the record's channel and generation."""
    reason: str
    """Why not ready: the agent's reason (ChannelConflict, MknodFailed, ...) or NoReport,
    Stale, ClockSkew, NoChannels, NotListed, OldGeneration. When ready: "", or Simulated
    (the node's driver is simulated, `[channels] simulate`)."""
    message: str
    pending: bool
    """Not ready only because the node has not made it yet (no failure)."""
    report: ReportState
    age_s: float | None
    """Seconds since the report's `at` (None without a report)."""


class WorkloadStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A workload's channel as judged over its nodes' reports: `workload status --json`."""

    v: Literal[1] = 1
    workload: str
    domain: str
    channel: int
    generation: int
    state: WorkloadState
    """READY (every listed node ready), FAILED (a node reports a failure), PENDING (nodes
    not ready yet, none failed) or UNKNOWN (no node to judge: no list, no member)."""
    ready: int
    listed: int
    record: WorkloadRecord
    nodes: list[WorkloadNodeRow]
    reasons: list[str]
    """Why not READY, one "Reason: node" line each (plus Claiming or NoNodes)."""
    at: float


def _workload_row(
    record: WorkloadRecord, node: str, seen: SeenReport | None, now: float, interval: float
) -> WorkloadNodeRow:
    def row(
        reason: str, message: str, *, report: ReportState = "fresh", ready: bool = False
    ) -> WorkloadNodeRow:
        return WorkloadNodeRow(
            node=node,
            ready=ready or not reason,
            reason=reason,
            message=message,
            pending=reason in WORKLOAD_PENDING_REASONS,
            report=report,
            age_s=round(now - seen.report.at, 3) if seen is not None else None,
        )

    if seen is None:
        return row("NoReport", "no health report of this domain from the node", report="missing")
    state = report_state(seen, now=now, report_interval_s=interval)
    if state == "future":
        ahead = seen.report.at - now
        return row(
            CLOCK_SKEW, f"report stamped {seconds_text(ahead)} s ahead of this host", report=state
        )
    if state == "stale":
        ago = seconds_text(now - seen.report.at)
        return row("Stale", f"last report {ago} s ago", report=state)
    channels = seen.report.channels
    if channels is None:
        return row("NoChannels", "its report has no channels (an agent without channel support)")
    info = next((i for i in channels.workloads if i.workload == record.workload), None)
    if info is None:
        if channels.omitted:
            return row(
                "NotListed",
                f"its report left out {channels.omitted} workloads to stay within 16 KiB; "
                "see the node's /metrics (imexd_channel_ready)",
            )
        return row("NotListed", "its report does not list the workload yet")
    if (info.channel, info.generation) != (record.channel, record.generation):
        return row(
            "OldGeneration",
            f"it reports channel {info.channel} generation {info.generation}, the record "
            f"asks for channel {record.channel} generation {record.generation}",
        )
    if not info.ready:
        return row(info.reason or "NotReady", info.message)
    return row(info.reason, info.message, ready=True)  # "" or Simulated


def channel_conflicts(records: Iterable[WorkloadRecord]) -> dict[tuple[str, int], list[str]]:
    """(domain, channel) -> the active workloads on it, for every channel two or more
    active records of one domain claim. A channel is one workload's across its domain
    (agents give it to the one that held it first, and to no other on any node), so each
    of these is a conflict whatever the records' node lists."""
    names: dict[tuple[str, int], set[str]] = {}
    for record in records:
        if record.state == "active":
            names.setdefault((record.domain, record.channel), set()).add(record.workload)
    return {key: sorted(found) for key, found in sorted(names.items()) if len(found) > 1}


def conflict_line(domain: str, channel: int, workloads: Sequence[str]) -> str:
    """One ChannelConflict line for `workload status`/`list` and `domain status`."""
    return (
        f"ChannelConflict: channel {channel} of {domain} is claimed by workloads "
        f"{', '.join(workloads)}: only the one that held it first has a device, on no node "
        "the others; delete the one that should not be there"
    )


def judge_workload(
    record: WorkloadRecord,
    *,
    reports: Iterable[SeenReport | HealthReport],
    members: Iterable[MemberRecord],
    now: float,
    report_interval_s: float,
    workloads: Iterable[WorkloadRecord] = (),
    down: Mapping[str, str] | None = None,
) -> WorkloadStatus:
    """The workload's state from its domain's health reports.

    The nodes judged are the record's list, or without one the domain's members (their
    member records). A node is ready only when its fresh report lists the workload ready
    with the record's channel and generation: an older generation is the agent catching
    up, not a success. A stale report is not ready (the agent is gone or cut off).
    Another active record of the domain on the same channel (`workloads`: the domain's
    records) is a ChannelConflict: FAILED, however ready the nodes are. A node not ready
    whose agent the bus says is gone (`down`, node -> why) reads AgentDown, a failure,
    whatever its last report still says (NotListed, NoReport).
    """
    listed = (
        sorted(set(record.nodes))
        if record.nodes is not None
        else sorted({m.node for m in members if m.domain == record.domain})
    )
    by_node: dict[str, SeenReport] = {}
    for item in reports:
        seen = item if isinstance(item, SeenReport) else SeenReport(item)
        was = by_node.get(seen.report.node)
        if seen.report.domain == record.domain and (was is None or seen.report.at >= was.report.at):
            by_node[seen.report.node] = seen
    rows = [
        _workload_row(record, node, by_node.get(node), now, report_interval_s) for node in listed
    ]
    gone = down or {}
    rows = [
        WorkloadNodeRow(
            node=r.node,
            ready=False,
            reason=AGENT_DOWN,
            message=gone[r.node],
            pending=False,
            report=r.report,
            age_s=r.age_s,
        )
        if not r.ready and r.node in gone
        else r
        for r in rows
    ]
    ready = sum(1 for r in rows if r.ready)
    reasons = [f"{r.reason}: {r.node}" for r in rows if not r.ready]
    state: WorkloadState
    if not rows:
        state = "UNKNOWN"
        reasons.append("NoNodes: the workload lists no node and the domain has no member")
    elif ready == len(rows):
        state = "READY"
    elif any(not r.ready and not r.pending for r in rows):
        state = "FAILED"
    else:
        state = "PENDING"
    if record.state == "claiming":
        reasons.insert(0, "Claiming: the record is a claim still being decided (agents ignore it)")
        if state == "READY":
            state = "PENDING"
    rivals = channel_conflicts([record, *workloads]).get((record.domain, record.channel))
    if record.state == "active" and rivals:
        reasons.insert(0, conflict_line(record.domain, record.channel, rivals))
        state = "FAILED"
    return WorkloadStatus(
        workload=record.workload,
        domain=record.domain,
        channel=record.channel,
        generation=record.generation,
        state=state,
        ready=ready,
        listed=len(rows),
        record=record,
        nodes=rows,
        reasons=reasons,
        at=now,
    )


def _nodes_text(record: WorkloadRecord) -> str:
    return ",".join(record.nodes) if record.nodes is not None else "all"


def render_workload_status(status: WorkloadStatus) -> str:
    """`workload status`: a headline, one row per listed node, then each reason's text."""
    r = status.record
    lines = [
        f"workload {status.workload} in {status.domain}: {status.state}, {status.ready} of "
        f"{status.listed} nodes ready (channel {status.channel}, generation "
        f"{status.generation}, {r.state}, nodes {_nodes_text(r)}, uid {r.uid}, gid {r.gid}, "
        f"mode {r.mode:04o})"
    ]
    rows = [
        [
            row.node,
            "yes" if row.ready else "no",
            row.reason or "-",
            "-" if row.age_s is None else f"{row.age_s:.0f}s",
        ]
        for row in status.nodes
    ]
    if rows:
        lines.extend(table(["NODE", "READY", "REASON", "AGE"], rows))
    # Nodes that say the same are named together: 18 nodes without a driver, one line.
    said: dict[tuple[str, str], list[str]] = {}
    for row in status.nodes:
        if row.message:
            said.setdefault((row.reason, row.message), []).append(row.node)
    details = [
        f"  {', '.join(nodes)}: {reason}: {message}" for (reason, message), nodes in said.items()
    ]
    details += [
        f"  {line}"
        for line in status.reasons
        if line.startswith(("Claiming", "NoNodes", "ChannelConflict"))
    ]
    if details:
        lines.append("reasons:")
        lines.extend(details)
    return "\n".join(lines) + "\n"


def workload_status_json(status: WorkloadStatus) -> str:
    """`workload status --json`: the WorkloadStatus as one JSON document."""
    return json.dumps(msgspec.to_builtins(status), sort_keys=False)


def render_workload_list(statuses: Sequence[WorkloadStatus]) -> str:
    """The `workload list` table: DOMAIN WORKLOAD CHANNEL STATE NODES READY."""
    if not statuses:
        return "no workloads on the bus\n"
    rows = [
        [
            s.domain,
            s.workload,
            str(s.channel),
            s.record.state,
            _nodes_text(s.record),
            f"{s.ready}/{s.listed} ready",
        ]
        for s in statuses
    ]
    header = ["DOMAIN", "WORKLOAD", "CHANNEL", "STATE", "NODES", "READY"]
    return "\n".join(table(header, rows)) + "\n"


def workload_list_json(statuses: Sequence[WorkloadStatus]) -> str:
    """`workload list --json`: a JSON array of WorkloadStatus documents."""
    return json.dumps([msgspec.to_builtins(s) for s in statuses], sort_keys=False)
