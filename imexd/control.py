"""The control plane: `imexd domain ...` and `imexd node ...`, a CLI over the agents' bus.

Agents do all the work; the control plane only writes the two retained inputs they follow
(a domain's `DomainSpec` and each node's `Assignment`) and reads the two retained outputs
they publish (`MemberRecord`s and `HealthReport`s):

- `domain create NAME [--nodes a,b] [--max-nodes N]`: the spec (state `active`, generation
  one above the previous spec's), then an assignment for each listed node;
- `domain delete NAME [--timeout S]`: the spec in state `deleting`, a wait until no member
  record of NAME is left, then the assignments pointing at NAME, the spec and leftover
  health reports are cleared (see `delete` for what happens at the timeout);
- `domain list`, `domain status NAME [--json] [--watch] [--wait S]`: tables judged by the
  pure `judge` (UP / DEGRADED / DOWN / FORMING / UNKNOWN, see there);
- `node assign NODE DOMAIN`, `node unassign NODE`.

Exit codes: 0 success (for `status`: the domain is UP), 1 failure (broker unreachable, a
write the broker did not keep, members left at a delete's timeout, a domain not UP),
2 usage errors (a name that is not DNS-1123), 130 interrupted.

Why a direct aiomqtt `Link` and not `imexd.bus.Bus`: the commands are one-shot (connect,
read a snapshot, write, verify, leave), so Bus's reconnect loop and replayed desired state
would only hide an unreachable broker behind retries, where an operator wants a clear error
within seconds. And Bus proves its snapshot with a ping on `{p}/nodes/{node}/ping` with a
DNS-1123 `node`, while the shipped broker ACL grants ping topics per user (`%u`) and names
the control plane's user `imexd_control` (not a DNS-1123 name, on purpose), so a Bus-based
control plane would never sync there. The `Link` proves its snapshot the same way (an echo
of its own non-retained message, which the broker queues after every retained message of
the earlier subscriptions) on `{p}/domains/_control/sync/{client_id}`: readable and writable
under the shipped ACL's `{p}/domains/#` grant, and matched by no agent subscription (`_control`
is not a DNS-1123 label, so it is never a domain). The decoding is the agents' own
(`imexd.bus.decode_message`), so both sides drop the same malformed messages.

`python -m imexd.control --write-schemas docs/schemas` regenerates the shipped JSON Schemas
from `imexd.wire.json_schemas()`; `--check-schemas` fails when they differ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Self, TextIO

import aiomqtt
import msgspec
from paho.mqtt.reasoncodes import ReasonCode

from imexd import health as hl
from imexd.bus import (
    Deleted,
    Received,
    abort_client,
    decode_message,
    describe_error,
    discard_client,
    mqtt_client,
    protocol_versions,
    read_password,
    refuses_protocol,
    topic_matches,
)
from imexd.errors import BusError
from imexd.settings import (
    BrokerURL,
    BusSettings,
    Settings,
    is_dns1123_label,
    is_dns1123_subdomain,
    load_settings,
    parse_broker_url,
)
from imexd.wire import (
    Assignment,
    Condition,
    DomainSpec,
    Dropped,
    HealthReport,
    MemberRecord,
    Presence,
    Topics,
    encode,
    json_schemas,
)

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

CONNECT_TIMEOUT_S: Final = 5.0
"""Bound on reaching a broker (TCP, TLS, CONNACK); each URL of `[bus] url` gets it."""
OPERATION_TIMEOUT_S: Final = 5.0
"""Bound on each broker round trip (SUBACK, PUBACK, the sync echo)."""
STALE_INTERVALS: Final = 3
"""A report older than this many `[health] report_interval_s` (by its `at`) is stale."""
FUTURE_SKEW_S: Final = 30.0
"""A report stamped more than this many seconds ahead of our clock is not fresh: the
node's clock (or ours) is wrong, and its age would read as fresh for that long."""
SEEN_WITHIN_S: Final = 600.0
"""`node assign --seen-within` default: an agent must have reported the node this recently."""
HEALTH_GRACE_S: Final = 2.0
"""After the members left, how long `delete` waits for their own health report clears
before it clears what is left itself (bounded by what is left of --timeout)."""
SYNC_LEVEL: Final = "_control"
"""Topic level under `{p}/domains/` for the sync echo: never a domain (not DNS-1123)."""
CONTROL_NAME: Final = "imexd-control"
"""Placeholder `[node] name` while loading settings: the control plane has no node, and a
host name that is not DNS-1123 must not make its settings invalid."""
SCHEMA_NAMES: Final = ("MemberRecord", "HealthReport", "DomainSpec", "Assignment", "Presence")

DomainState = Literal["UP", "DEGRADED", "DOWN", "FORMING", "UNKNOWN"]
ReportState = Literal["fresh", "stale", "future", "missing"]

FORMING_REASONS: Final = frozenset({"Syncing", "Joining", "Claiming", "NotStarted", "Starting"})
"""Readiness reasons of a node that is still joining for the first time."""
START_WORDS: Final = frozenset(
    {"INITIALIZING", "STARTING_AUTH_SERVER", "WAITING_FOR_PEERS", "INIT_GPU"}
)
"""IMEX states of a daemon on its way to READY (NotReady with these counts as forming)."""
VERSION_MISMATCH: Final = "VersionMismatch"
CLOCK_SKEW: Final = "ClockSkew"
BUS_DOWN: Final = "BusDown"
"""The DomainUp reason of an agent whose link to the broker is down or not synced yet."""
UNKNOWN_REASONS: Final = ("NoSpec", "NoMembers", "Partial", BUS_DOWN)
"""Domain-level reasons that say what the bus does not tell (never a failure)."""


# Names.


def domain_problem(name: str) -> str | None:
    """None when `name` can name a domain, else a sentence saying why not."""
    if is_dns1123_label(name):
        return None
    return (
        f"domain name {name!r} is not a DNS-1123 label: lowercase letters, digits and '-', "
        "starting and ending with a letter or digit, at most 63 characters"
    )


def node_problem(name: str) -> str | None:
    """None when `name` can name a node, else a sentence saying why not."""
    if is_dns1123_subdomain(name):
        return None
    return (
        f"node name {name!r} is not a DNS-1123 subdomain: dot-separated labels of lowercase "
        "letters, digits and '-', at most 253 characters"
    )


def parse_nodes(text: str | None) -> tuple[list[str] | None, list[str]]:
    """`--nodes a,b,c` as a list (None when not given) and the problems with it."""
    if text is None:
        return None, []
    nodes = [part.strip() for part in text.split(",")]
    problems: list[str] = []
    if not any(nodes):
        return [], ["--nodes names no node"]
    if "" in nodes:
        problems.append(f"--nodes {text!r} has an empty name")
    problems.extend(p for n in nodes if n and (p := node_problem(n)) is not None)
    twice = sorted(n for n, count in Counter(nodes).items() if n and count > 1)
    if twice:
        problems.append(f"--nodes lists {', '.join(twice)} more than once")
    return [n for n in nodes if n], problems


def max_nodes_problem(value: int | None) -> str | None:
    """None when `--max-nodes` is absent or in 1..2048, else why not."""
    if value is None or 1 <= value <= 2048:
        return None
    return f"--max-nodes {value}: expected 1 to 2048 slots per clique"


def next_spec(
    previous: DomainSpec | None,
    name: str,
    *,
    nodes: list[str] | None,
    max_nodes: int | None,
    default_max_nodes: int,
) -> DomainSpec:
    """The spec `domain create` writes: exactly the given node list, state active.

    The generation grows by one over the previous spec's (1 for a new domain). Without
    `--max-nodes` the previous spec's value is kept (changing it would make every member
    report NodeMapMismatch), else the `[domain] max_nodes` setting is used.
    """
    if max_nodes is None:
        max_nodes = previous.max_nodes if previous is not None else default_max_nodes
    return DomainSpec(
        domain=name,
        nodes=nodes,
        max_nodes=max_nodes,
        state="active",
        generation=previous.generation + 1 if previous is not None else 1,
    )


# What the control plane saw on the bus.


@dataclass(frozen=True, slots=True)
class SeenReport:
    """A HealthReport and when the broker drops it (MQTT 5 message expiry)."""

    report: HealthReport
    expires_at: float | None = None
    """Wall-clock time of expiry; None when unknown (MQTT 3.1.1, or none was set)."""


@dataclass(slots=True)
class Store:
    """The latest retained state of the subscribed topics, by what it addresses."""

    specs: dict[str, DomainSpec] = field(default_factory=dict)
    members: dict[tuple[str, str, str], MemberRecord] = field(default_factory=dict)
    """(domain, clique, node) -> record."""
    reports: dict[tuple[str, str], SeenReport] = field(default_factory=dict)
    """(domain, node) -> report."""
    assignments: dict[str, str | None] = field(default_factory=dict)
    """node -> domain (None: an explicit null assignment)."""
    presences: dict[str, Presence] = field(default_factory=dict)
    """node -> the agent's retained presence record."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Malformed messages ignored, by `wire.DropReason` value."""

    def apply(self, event: Received | Deleted, *, expires_at: float | None = None) -> None:
        """Take one decoded message (an empty payload deletes)."""
        ref = event.ref
        payload = event.payload if isinstance(event, Received) else None
        match ref.kind:
            case "spec":
                if isinstance(payload, DomainSpec):
                    self.specs[ref.domain] = payload
                else:
                    self.specs.pop(ref.domain, None)
            case "member":
                key = (ref.domain, ref.clique, ref.node)
                if isinstance(payload, MemberRecord):
                    self.members[key] = payload
                else:
                    self.members.pop(key, None)
            case "health":
                if isinstance(payload, HealthReport):
                    self.reports[(ref.domain, ref.node)] = SeenReport(payload, expires_at)
                else:
                    self.reports.pop((ref.domain, ref.node), None)
            case "assignment":
                if isinstance(payload, Assignment):
                    self.assignments[ref.node] = payload.domain
                else:
                    self.assignments.pop(ref.node, None)
            case "presence":
                if isinstance(payload, Presence):
                    self.presences[ref.node] = payload
                else:
                    self.presences.pop(ref.node, None)
            case "ping":
                pass

    def records_of(self, domain: str) -> list[MemberRecord]:
        return [r for (d, _, _), r in sorted(self.members.items()) if d == domain]

    def reports_of(self, domain: str) -> list[SeenReport]:
        return [s for (d, _), s in sorted(self.reports.items()) if d == domain]

    def assigned_to(self, domain: str) -> list[str]:
        return sorted(n for n, d in self.assignments.items() if d == domain)

    def elsewhere(self, node: str, domain: str) -> list[str]:
        """Why `node` belongs to a live domain other than `domain`, one phrase each: an
        assignment to a domain whose spec exists and is not deleting, or a member record
        in another domain."""
        out: list[str] = []
        other = self.assignments.get(node)
        spec = self.specs.get(other) if other is not None and other != domain else None
        if spec is not None and spec.state != "deleting":
            out.append(f"assigned to {other} (spec generation {spec.generation}, active)")
        out.extend(
            f"{record.state.value} record in {d}"
            for (d, _, n), record in sorted(self.members.items())
            if n == node and d != domain
        )
        return out

    def last_seen(self, node: str) -> tuple[float | None, bool]:
        """When an agent last reported `node` (its presence or a health report, by their
        `at`; None: never), and whether it holds a member record anywhere (a live agent
        keeps one; its will clears it when it dies)."""
        times = [s.report.at for (_, n), s in self.reports.items() if n == node]
        presence = self.presences.get(node)
        if presence is not None:
            times.append(presence.at)
        recorded = any(n == node for _, _, n in self.members)
        return (max(times) if times else None), recorded

    def domains(self) -> list[str]:
        """Every domain with a spec, a member record, a health report or an assignment."""
        names = set(self.specs)
        names.update(d for d, _, _ in self.members)
        names.update(d for d, _ in self.reports)
        names.update(d for d in self.assignments.values() if d is not None)
        return sorted(names)


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


@dataclass(slots=True)
class _Node:
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
    notes: list[tuple[str, str]] = field(default_factory=list)
    """(reason, text) found by looking at the other members (links, driver skew)."""
    failed_by_peers: bool = False

    @property
    def ready(self) -> bool:
        """A fresh report that says ready, of a node that holds a member record."""
        return self.record is not None and self.fresh is not None and self.fresh.ready

    @property
    def bus_down(self) -> bool:
        """The fresh report says the agent's link to the broker is down or not synced:
        what it says of its peers (its domain view) is stale."""
        if self.fresh is None:
            return False
        return any(
            c.type == hl.DOMAIN_UP and c.status == "Unknown" and c.reason == BUS_DOWN
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
    out = [by_type[t] for t in hl.READINESS_TYPES if t in by_type and by_type[t].status != "True"]
    up = by_type.get(hl.DOMAIN_UP)
    if up is not None and up.status == "False" and up.reason != "DaemonDown":
        out.append(up)  # DaemonDown only points at DaemonReady, which is listed already
    return out


def _forming(report: HealthReport) -> bool:
    """Not ready only because the node is still joining for the first time."""
    if report.daemon.restarts:
        return False
    for cond in _failing(report):
        if cond.type == hl.DOMAIN_UP or cond.reason in FORMING_REASONS:
            continue
        if cond.reason == "NotReady" and (report.daemon.imex_status or "") in START_WORDS:
            continue
        return False
    return True


def _ready_since(report: HealthReport) -> float:
    """When the node's DaemonReady condition last changed (its report time if absent)."""
    return next((c.since for c in report.conditions if c.type == hl.DAEMON_READY), report.at)


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


def _links(nodes: Mapping[str, _Node], report_interval_s: float) -> bool:
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
            if v.node != e.name and (v.status != hl.IMEX_READY or not v.connected)
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
            "state): whether every member has reported cannot be told; create the spec again "
            "(`imexd domain create NAME --nodes ...`) or give `domain status --nodes`"
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
            since = next(
                (c.since for c in e.fresh.conditions if c.type == hl.DOMAIN_UP), e.fresh.at
            )
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
                f"{CLOCK_SKEW}: {e.name}'s report is stamped {ahead:.0f} s ahead of this host's "
                "clock: check the clocks (NTP) of both"
            )
    for e in nodes.values():
        if e.fresh is None or not e.expected:
            continue
        for cond in e.fresh.conditions:
            if cond.type == hl.DOMAIN_UP and cond.reason == VERSION_MISMATCH:
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
    (Syncing, Joining, Claiming, NotStarted, Starting, NotReady in a start-up IMEX state)
    and its daemon never restarted; *failed* otherwise (DaemonCrashLoop, Stale, ...). Also
    failures: a ready member whose domain view says a ready peer is not READY or not
    connected (PeersUnreachable; unless that peer became ready less than one report
    interval before the view was reported: late news), and a skew between members
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
    views_pending = _links(nodes, report_interval_s)
    unknowns = _unknowns(nodes, listed=listed is not None or spec is not None)
    reasons = _skew(nodes, now)
    rows = sorted(
        (_row(e, now) for e in nodes.values()),
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


def _row(e: _Node, now: float) -> NodeRow:
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
    if seen is None:
        reasons.append("NoReport")
        details.append("NoReport: no health report on the bus (not joined yet, or gone)")
    elif e.future:
        reasons.append(CLOCK_SKEW)
        details.append(
            f"{CLOCK_SKEW}: report stamped {seen.at - now:.0f} s ahead of this host's clock"
        )
    elif report is None:
        reasons.append("Stale")
        details.append(f"Stale: last report {now - seen.at:.0f} s ago (too old, or expired)")
    elif record is not None:
        for cond in _failing(report):
            reasons.append(cond.reason)
            details.append(hl.describe(cond))
    for reason, text in e.notes:
        reasons.append(reason)
        details.append(f"{reason}: {text}")
    pending = not e.ready and (
        seen is None
        or (report is not None and (record is None or _forming(report)))
        or (record is None and not e.future)
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
    if slot is None and seen is not None:
        slot = seen.slot
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


# Rendering: pure functions from judgements to text.


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
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


def render_status(status: DomainStatus) -> str:
    """The `domain status` table: a headline, one row per node, then each reason's text."""
    spec = status.spec
    if spec is None:
        about = "no spec: members taken from their records"
    else:
        listed = f"{len(spec.nodes)} nodes listed" if spec.nodes is not None else "any node"
        about = (
            f"spec generation {spec.generation}, {spec.state}, max_nodes {spec.max_nodes}, {listed}"
        )
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
        lines.extend(_table(header, rows))
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


def summarize(store: Store, *, now: float, report_interval_s: float) -> list[DomainSummary]:
    """Every domain the bus knows, judged."""
    out = []
    for name in store.domains():
        spec = store.specs.get(name)
        records = store.records_of(name)
        status = judge(
            name,
            spec=spec,
            records=records,
            reports=store.reports_of(name),
            now=now,
            report_interval_s=report_interval_s,
        )
        out.append(
            DomainSummary(
                domain=name,
                spec=spec.state if spec else "-",
                generation=spec.generation if spec else None,
                max_nodes=spec.max_nodes if spec else (records[0].max_nodes if records else None),
                listed=len(spec.nodes) if spec and spec.nodes is not None else None,
                assigned=len(store.assigned_to(name)),
                members=len({r.node for r in records}),
                ready=status.ready,
                state=status.state,
            )
        )
    return out


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
    return "\n".join(_table(header, rows)) + "\n"


# The link to the broker.


def default_client_id() -> str:
    """`imexd-control-<pid>-<random>`: the random part keeps two control planes with the
    same pid (one per container, say) from taking each other's session over."""
    return f"imexd-control-{os.getpid()}-{secrets.token_hex(3)}"


class Link:
    """One short-lived MQTT connection of the control plane (an async context manager).

    Entering connects to the first broker of `[bus] url` that answers within
    `connect_timeout_s` (the versions `[bus] protocol` allows, `bus.protocol_versions`:
    with "auto" MQTT 5, else 3.1.1 only when the broker refuses 5), or raises BusError
    naming each broker and why. `read` subscribes and returns once the retained snapshot
    is in `store`; `put` publishes a retained message; `verify` proves the broker kept
    what was put (a refused publish is otherwise invisible). A lost link raises BusError
    from the next call.
    """

    def __init__(
        self,
        settings: BusSettings,
        *,
        client_id: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        timeout_s: float = OPERATION_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.client_id = client_id or default_client_id()
        self.brokers: tuple[BrokerURL, ...] = tuple(parse_broker_url(u) for u in settings.url)
        if not self.brokers:
            raise ValueError("settings.url names no broker")
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.store = Store()
        self.changed = asyncio.Event()
        """Set on every message and when the link is lost; the waiter clears it."""
        self.broker: str | None = None
        self.lost: str | None = None
        self._client: aiomqtt.Client | None = None
        self._reader: asyncio.Task[None] | None = None
        self._sync_topic = f"{self.topics.prefix}/domains/{SYNC_LEVEL}/sync/{self.client_id}"
        self._filters: list[str] = []
        self._seq = itertools.count(1)
        self._echoes: dict[int, asyncio.Future[None]] = {}
        self._last: dict[str, bytes] = {}

    async def __aenter__(self) -> Self:
        errors: list[str] = []
        for broker in self.brokers:
            try:
                self._client = await self._connect(broker)
            except BusError as exc:
                errors.append(str(exc))
                continue
            self.broker = str(broker)
            break
        else:
            raise BusError("; ".join(errors))
        self._reader = asyncio.create_task(self._read(self._client), name="control-read")
        try:
            await self._subscribe([self._sync_topic])
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        reader, client = self._reader, self._client
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if client is not None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await client.__aexit__(None, None, None)
            except (aiomqtt.MqttError, TimeoutError):
                abort_client(client)
        self._client = None

    async def _connect(self, broker: BrokerURL) -> aiomqtt.Client:
        password = self._password()
        versions = protocol_versions(self.settings)
        for v5 in versions:
            client = self._new_client(broker, v5=v5, password=password)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await client.__aenter__()
            except TimeoutError:
                discard_client(client)
                raise BusError(
                    f"cannot connect to {broker}: no answer within {self.connect_timeout_s:g} s"
                ) from None
            except aiomqtt.MqttError as exc:
                abort_client(client)
                if v5 and refuses_protocol(exc) and len(versions) > 1:
                    continue
                raise BusError(f"cannot connect to {broker}: {describe_error(exc)}") from None
            except BaseException:
                discard_client(client)
                raise
            return client
        raise BusError(
            f"cannot connect to {broker}: it refuses MQTT "
            + " and ".join("5" if v5 else "3.1.1" for v5 in versions)
        )

    def _password(self) -> str | None:
        return read_password(self.settings)

    def _new_client(self, broker: BrokerURL, *, v5: bool, password: str | None) -> aiomqtt.Client:
        return mqtt_client(
            self.settings,
            broker,
            client_id=self.client_id,
            v5=v5,
            password=password,
            timeout_s=self.timeout_s,
        )

    # Incoming messages.

    async def _read(self, client: aiomqtt.Client) -> None:
        try:
            async for message in client.messages:
                raw = message.payload
                payload = bytes(raw) if isinstance(raw, bytes | bytearray) else b""
                expiry = getattr(message.properties, "MessageExpiryInterval", None)
                self._on_message(
                    message.topic.value,
                    payload,
                    retained=bool(message.retain),
                    expiry_s=expiry if isinstance(expiry, int) else None,
                )
            self.lost = "the broker closed the connection"
        except aiomqtt.MqttError as exc:
            self.lost = describe_error(exc)
        for echo in self._echoes.values():
            if not echo.done():
                echo.set_exception(BusError(f"lost the broker {self.broker}: {self.lost}"))
        self.changed.set()

    def _on_message(
        self, topic: str, payload: bytes, *, retained: bool, expiry_s: int | None
    ) -> None:
        if topic == self._sync_topic:
            with contextlib.suppress(ValueError):
                echo = self._echoes.get(int(payload))
                if echo is not None and not echo.done():
                    echo.set_result(None)
            return
        self._last[topic] = payload
        result = decode_message(self.topics, topic, payload, retained=retained)
        if isinstance(result, Dropped):
            self.store.dropped[result.reason.value] += 1
            return
        expires_at = time.time() + expiry_s if expiry_s is not None else None
        self.store.apply(result, expires_at=expires_at)
        self.changed.set()

    # Operations.

    def _live(self) -> aiomqtt.Client:
        if self._client is None or self.lost is not None:
            raise BusError(f"lost the broker {self.broker}: {self.lost or 'not connected'}")
        return self._client

    def raise_if_lost(self) -> None:
        """BusError when the link is gone (the reader saw it end)."""
        self._live()

    async def _subscribe(self, filters: Sequence[str]) -> None:
        client = self._live()
        try:
            codes: list[int | ReasonCode] = list(
                await client.subscribe([(f, 1) for f in filters], timeout=self.timeout_s)
            )
        except aiomqtt.MqttError as exc:
            raise BusError(f"cannot subscribe at {self.broker}: {describe_error(exc)}") from None
        for topic_filter, code in zip(filters, codes, strict=False):
            value = code.value if isinstance(code, ReasonCode) else code
            if value >= 0x80:
                raise BusError(
                    f"the broker {self.broker} refused the subscription to {topic_filter} "
                    f"(code {code}): check its ACL for this user"
                )
        self._filters.extend(filters)

    async def read(self, *filters: str) -> Store:
        """Subscribe to `filters`; returns once their retained snapshot is in `store`."""
        new = [f for f in filters if f not in self._filters]
        if new:
            await self._subscribe(new)
        await self.sync()
        return self.store

    async def sync(self) -> None:
        """One round trip: every message the broker queued for us before it is delivered."""
        client = self._live()
        seq = next(self._seq)
        echo: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._echoes[seq] = echo
        try:
            async with asyncio.timeout(self.timeout_s):
                await client.publish(self._sync_topic, str(seq).encode(), qos=1)
                await echo
        except TimeoutError:
            raise BusError(
                f"no echo of our sync message on {self._sync_topic} within {self.timeout_s:g} s: "
                "the broker must let the control plane read and write it (ACL)"
            ) from None
        except aiomqtt.MqttError as exc:
            raise BusError(f"cannot publish to {self.broker}: {describe_error(exc)}") from None
        finally:
            self._echoes.pop(seq, None)

    async def put(self, topic: str, payload: bytes) -> None:
        """Publish a retained message (QoS 1); an empty payload deletes the retained one.

        The topic is subscribed first when no filter covers it, so `verify` can see it.
        """
        if not any(topic_matches(f, topic) for f in self._filters):
            await self._subscribe([topic])
        client = self._live()
        try:
            await client.publish(topic, payload, qos=1, retain=True, timeout=self.timeout_s)
        except aiomqtt.MqttError as exc:
            raise BusError(f"cannot publish to {topic}: {describe_error(exc)}") from None

    async def verify(self, written: Mapping[str, bytes]) -> list[str]:
        """The topics of `written` whose last message is not what we put there.

        A publish that an ACL refused still gets its PUBACK (MQTT 3.1.1, and aiomqtt 2.x
        drops MQTT 5 reason codes), so only reading it back tells.
        """
        await self.sync()
        return sorted(t for t, p in written.items() if self._last.get(t) != p)

    async def wait_until(self, done: Callable[[], bool], within_s: float) -> bool:
        """Wait at most `within_s` seconds until `done()` holds over the store; whether it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            self.changed.clear()
            if done():
                return True
            self.raise_if_lost()
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await self.changed.wait()


# Commands: each opens one link, reads what it needs, writes, verifies, and says what it did.


def _refused(refused: Sequence[str], err: TextIO) -> int:
    print(
        f"imexd: the broker did not keep our write to {', '.join(refused)} "
        "(refused by its ACL for the control plane's user, or written again since)",
        file=err,
    )
    return EXIT_FAILED


def _taken(store: Store, nodes: Iterable[str], domain: str, command: str, err: TextIO) -> int:
    """EXIT_USAGE after naming each node of `nodes` that another live domain holds, else
    EXIT_OK. Moving such a node stops the IMEX daemon a running job there may use."""
    taken = {n: why for n in nodes if (why := store.elsewhere(n, domain))}
    for node, why in taken.items():
        print(
            f"imexd {command}: node {node} is in another domain: {'; '.join(why)}. Moving it "
            f"to {domain} stops its IMEX daemon there (a running job loses IMEX); give --steal "
            "to move it anyway",
            file=err,
        )
    return EXIT_USAGE if taken else EXIT_OK


async def create(
    settings: Settings,
    name: str,
    *,
    nodes: list[str] | None,
    max_nodes: int | None,
    out: TextIO,
    err: TextIO,
    steal: bool = False,
) -> int:
    """Write the domain's spec, then the listed nodes' assignments (so that an assigned
    node already finds the spec, and its list position, when it joins).

    Refuses (EXIT_USAGE, writing nothing) when a listed node is in another live domain
    (`Store.elsewhere`), unless `steal`."""
    async with Link(settings.bus) as link:
        t = link.topics
        filters = [t.spec(name), *(t.assignment(n) for n in nodes or ())]
        if nodes and not steal:
            filters += [t.specs_filter(), t.all_members_filter("+")]
        store = await link.read(*filters)
        if not steal and _taken(store, nodes or (), name, "domain create", err):
            return EXIT_USAGE
        previous = store.specs.get(name)
        before = {n: store.assignments.get(n) for n in nodes or ()}
        spec = next_spec(
            previous,
            name,
            nodes=nodes,
            max_nodes=max_nodes,
            default_max_nodes=settings.domain.max_nodes,
        )
        if previous is not None and previous.max_nodes != spec.max_nodes:
            print(
                f"warning: max_nodes of {name} changes from {previous.max_nodes} to "
                f"{spec.max_nodes}: members configured otherwise report NodeMapMismatch",
                file=err,
            )
        written = {t.spec(name): encode(spec)}
        for node in nodes or ():
            written[t.assignment(node)] = encode(Assignment(domain=name))
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
    if refused:
        return _refused(refused, err)
    verb = "created"
    if previous is not None:
        verb = "re-activated" if previous.state == "deleting" else "updated"
    listed = ",".join(spec.nodes) if spec.nodes is not None else "any node"
    print(
        f"domain {name}: {verb} (generation {spec.generation}, max_nodes {spec.max_nodes}, "
        f"nodes {listed})",
        file=out,
    )
    for node, was in before.items():
        note = f" (moved from {was})" if was not in (None, name) else ""
        print(f"node {node}: assigned to {name}{note}", file=out)
    return EXIT_OK


async def delete(settings: Settings, name: str, *, wait_s: float, out: TextIO, err: TextIO) -> int:
    """Set the spec to `deleting`, wait for the members to leave, then clear what is left.

    Agents that see `deleting` clear their member record and health report, stop their
    daemon and remove their files. Once no member record of the domain is left, the
    assignments that point at it are cleared first (an assigned agent then goes idle and
    does not rejoin), then the spec, then health reports left by vanished nodes. Two cases
    keep the spec in state `deleting` (a tombstone), so that nodes still pointing at the
    domain stay out of it:

    - members still hold records at the timeout (exit 1): their assignments and the
      health reports of nodes without records are cleared all the same, but their records
      are kept (the node may still run a daemon); running delete again finishes the job;
    - members without an assignment to the domain were seen (static nodes: `[domain] name`
      in their settings), which would otherwise form the domain again (exit 0).
    """
    async with Link(settings.bus) as link:
        t = link.topics
        store = await link.read(
            t.spec(name), t.all_members_filter(name), t.health_filter(name), t.assignments_filter()
        )
        spec = store.specs.get(name)
        records = store.records_of(name)
        if (
            spec is None
            and not records
            and not store.assigned_to(name)
            and not store.reports_of(name)
        ):
            print(
                f"domain {name}: nothing to delete (no spec, records, reports or assignments)",
                file=out,
            )
            return EXIT_OK
        static = sorted({r.node for r in records} - set(store.assigned_to(name)))
        if spec is None or spec.state != "deleting":
            spec = DomainSpec(
                domain=name,
                nodes=spec.nodes if spec is not None else None,
                max_nodes=spec.max_nodes
                if spec is not None
                else records[0].max_nodes
                if records
                else settings.domain.max_nodes,
                state="deleting",
                generation=spec.generation + 1 if spec is not None else 1,
            )
            await link.put(t.spec(name), encode(spec))
            refused = await link.verify({t.spec(name): encode(spec)})
            if refused:
                return _refused(refused, err)
        members = sorted({r.node for r in records})
        print(
            f"domain {name}: deleting (generation {spec.generation}); waiting up to {wait_s:g} s "
            f"for {len(members)} member(s) to leave"
            + (f": {', '.join(members)}" if members else ""),
            file=out,
        )
        started = time.monotonic()
        await link.wait_until(lambda: not store.records_of(name), wait_s)
        left = sorted({r.node for r in store.records_of(name)})
        # Agents clear their health report right after their record: give those a moment.
        grace = min(HEALTH_GRACE_S, max(0.0, wait_s - (time.monotonic() - started)))
        await link.wait_until(
            lambda: not any(s.report.node in members for s in store.reports_of(name)), grace
        )
        written: dict[str, bytes] = {}
        for node in store.assigned_to(name):
            written[t.assignment(node)] = b""
        keep_spec = bool(left or static)
        if not keep_spec:
            written[t.spec(name)] = b""
        reports = [s.report for s in store.reports_of(name) if s.report.node not in left]
        for report in reports:
            written[t.health(name, report.node)] = b""
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
        stuck = [_describe_member(store, name, node) for node in left]
    if refused:
        return _refused(refused, err)
    assignments = sum(1 for topic in written if topic.endswith("/assignment"))
    cleared = f"{assignments} assignment(s), {len(reports)} leftover health report(s)"
    if left:
        print(
            f"imexd: domain {name}: {len(left)} member(s) still hold records after {wait_s:g} s: "
            f"{'; '.join(stuck)}. Cleared {cleared}; the spec stays in state deleting so that "
            f"they leave when they come back. Run `imexd domain delete {name}` again to finish.",
            file=err,
        )
        return EXIT_FAILED
    if static:
        print(
            f"domain {name}: all members left; cleared {cleared}. The spec stays in state "
            f"deleting: {', '.join(static)} name this domain in their settings ([domain] name) "
            f"and would form it again without it. Change their settings, then run "
            f"`imexd domain delete {name}` again to clear the spec.",
            file=out,
        )
        return EXIT_OK
    print(f"domain {name}: deleted (cleared the spec, {cleared})", file=out)
    return EXIT_OK


def _describe_member(store: Store, domain: str, node: str) -> str:
    record = next((r for r in store.records_of(domain) if r.node == node), None)
    seen = store.reports.get((domain, node))
    parts = [node]
    if record is not None:
        parts.append(f"record {record.state.value}")
    if seen is not None:
        parts.append(f"last report {time.time() - seen.report.at:.0f} s ago")
        reason = hl.reason_line(seen.report.conditions)
        if reason:
            parts.append(reason)
    return " (".join([parts[0], ", ".join(parts[1:]) + ")"]) if len(parts) > 1 else node


async def list_domains(settings: Settings, *, out: TextIO) -> int:
    """Print every domain with a spec, records, reports or assignments."""
    async with Link(settings.bus) as link:
        t = link.topics
        store = await link.read(
            t.specs_filter(),
            t.all_members_filter("+"),
            t.health_filter("+"),
            t.assignments_filter(),
        )
    summaries = summarize(
        store, now=time.time(), report_interval_s=settings.health.report_interval_s
    )
    print(render_list(summaries), end="", file=out)
    return EXIT_OK


async def assign(
    settings: Settings,
    node: str,
    domain: str | None,
    *,
    out: TextIO,
    err: TextIO,
    steal: bool = False,
    force: bool = False,
    seen_within_s: float = SEEN_WITHIN_S,
) -> int:
    """Write (or with None: clear) a node's retained assignment.

    Assigning refuses (EXIT_USAGE, writing nothing) a node in another live domain unless
    `steal` (see `create`), and a node that no agent reported within `seen_within_s`
    seconds (presence record or health report; a member record counts as seen) unless
    `force`: a typo would otherwise create a phantom domain that never forms."""
    async with Link(settings.bus) as link:
        t = link.topics
        topic = t.assignment(node)
        filters = [topic, *([t.spec(domain)] if domain else [])]
        if domain is not None:
            filters += [t.specs_filter(), t.all_members_filter("+")]
            filters += [t.health_filter("+"), t.presence(node)]
        store = await link.read(*filters)
        if domain is not None and not steal and _taken(store, [node], domain, "node assign", err):
            return EXIT_USAGE
        if domain is not None and not force:
            at, recorded = store.last_seen(node)
            if not recorded and (at is None or time.time() - at > seen_within_s):
                when = "never" if at is None else f"last {time.time() - at:.0f} s ago"
                print(
                    f"imexd node assign: no agent reported node {node} within "
                    f"{seen_within_s:g} s ({when}): a typo, or a node without a running agent; "
                    f"assigning it to {domain} would wait for it forever. Give --force to "
                    "assign it anyway",
                    file=err,
                )
                return EXIT_USAGE
        before = store.assignments.get(node)
        spec = store.specs.get(domain) if domain else None
        payload = encode(Assignment(domain=domain)) if domain else b""
        await link.put(topic, payload)
        refused = await link.verify({topic: payload})
    if refused:
        return _refused(refused, err)
    if domain is None:
        was = f"was {before}" if before else "it had no assignment"
        print(f"node {node}: unassigned ({was})", file=out)
        return EXIT_OK
    note = f" (moved from {before})" if before not in (None, domain) else ""
    print(f"node {node}: assigned to {domain}{note}", file=out)
    if spec is not None and spec.state == "deleting":
        print(f"warning: {domain} is being deleted: {node} leaves it at once", file=err)
    elif spec is not None and spec.nodes is not None and node not in spec.nodes:
        print(
            f"warning: the spec of {domain} lists only {', '.join(spec.nodes)}: {node} stays "
            f"out (NotInSpec) until `imexd domain create {domain} --nodes ...` lists it",
            file=err,
        )
    return EXIT_OK


def _fingerprint(status: DomainStatus) -> bytes:
    """The judgement without what changes with every second (ages, the time)."""
    still = msgspec.structs.replace(
        status,
        at=0.0,
        nodes=[msgspec.structs.replace(r, age_s=None) for r in status.nodes],
    )
    return msgspec.json.encode(still)


async def status(
    settings: Settings,
    name: str,
    *,
    as_json: bool,
    wait: float,
    out: TextIO,
    err: TextIO,
    nodes: Sequence[str] | None = None,
) -> int:
    """Print the domain's state once: after the retained snapshot, wait up to `wait`
    seconds more for it to become UP (changes in flight), then print and exit 0 if UP.

    `nodes` (`--nodes`) are the members to judge, instead of the spec's list."""
    interval = settings.health.report_interval_s
    async with Link(settings.bus) as link:
        t = link.topics
        store = await link.read(t.spec(name), t.all_members_filter(name), t.health_filter(name))

        def judged() -> DomainStatus:
            return _judge_store(store, name, interval, nodes)

        await link.wait_until(lambda: judged().state == "UP", wait)
        result = judged()
    if as_json:
        print(status_json(result), file=out)
    elif result.known:
        print(render_status(result), end="", file=out)
    if not result.known:
        print(
            f"imexd: domain {name}: nothing on the bus (no spec, member record or health report)",
            file=err,
        )
        return EXIT_FAILED
    return EXIT_OK if result.state == "UP" else EXIT_FAILED


def _judge_store(
    store: Store, name: str, report_interval_s: float, nodes: Sequence[str] | None = None
) -> DomainStatus:
    return judge(
        name,
        spec=store.specs.get(name),
        records=store.records_of(name),
        reports=store.reports_of(name),
        now=time.time(),
        report_interval_s=report_interval_s,
        expect=nodes,
    )


async def _event_or(event: asyncio.Event, stop: asyncio.Event, at_most_s: float) -> None:
    """Wait until `event` or `stop` is set, at most `at_most_s` seconds."""
    waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waiters, timeout=at_most_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def watch(
    settings: Settings,
    name: str,
    *,
    as_json: bool,
    stop: asyncio.Event,
    out: TextIO,
    err: TextIO,
    retry_s: float = 2.0,
    nodes: Sequence[str] | None = None,
) -> int:
    """Redraw the status on every change (and as reports age) until `stop`.

    On a terminal the screen is redrawn; otherwise each new table follows the previous
    one (with --json: one JSON document per line). A lost link is reconnected; a broker
    unreachable at the start is an error. The exit status is that of the last state.
    """
    interval = settings.health.report_interval_s
    tty = out.isatty()
    last: bytes | None = None
    state: DomainState | None = None
    connected_once = False
    while not stop.is_set():
        try:
            async with Link(settings.bus) as link:
                t = link.topics
                store = await link.read(
                    t.spec(name), t.all_members_filter(name), t.health_filter(name)
                )
                connected_once = True
                while not stop.is_set():
                    link.changed.clear()
                    result = _judge_store(store, name, interval, nodes)
                    key = _fingerprint(result)
                    if key != last:
                        last, state = key, result.state
                        _draw(result, as_json=as_json, tty=tty, out=out)
                    await _event_or(link.changed, stop, 1.0)
                    link.raise_if_lost()
        except BusError as exc:
            if not connected_once:
                raise
            print(f"imexd: {exc}; reconnecting", file=err, flush=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry_s):
                    await stop.wait()
    return EXIT_OK if state == "UP" else EXIT_FAILED


def _draw(result: DomainStatus, *, as_json: bool, tty: bool, out: TextIO) -> None:
    if as_json:
        out.write(status_json(result) + "\n")
    elif tty:
        out.write("\x1b[H\x1b[2J" + render_status(result) + "(watching; Ctrl-C to stop)\n")
    else:
        out.write(render_status(result) + "\n")
    out.flush()


# The CLI layer: argument checks (exit 2), settings, the event loop, signals, errors.


def load_control_settings(config: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """The same settings file and IMEXD_* environment as the agent's; only [bus], [domain]
    max_nodes and [health] report_interval_s matter here."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("IMEXD_NODE_NAME", CONTROL_NAME)
    return load_settings(config, environ=env)


def _usage(command: str, problems: Sequence[str]) -> int:
    for problem in problems:
        print(f"imexd {command}: {problem}", file=sys.stderr)
    return EXIT_USAGE


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(main)
    except BusError as exc:
        print(f"imexd: {exc}", file=sys.stderr)
        return EXIT_FAILED


def cli_domain_create(args: argparse.Namespace) -> int:
    """`imexd domain create NAME [--nodes a,b,c] [--max-nodes N]`."""
    nodes, problems = parse_nodes(args.nodes)
    problems = [
        p for p in (domain_problem(args.name), max_nodes_problem(args.max_nodes)) if p
    ] + problems
    if problems:
        return _usage("domain create", problems)
    settings = load_control_settings(args.config)
    return _run(
        create(
            settings,
            args.name,
            nodes=nodes,
            max_nodes=args.max_nodes,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
        )
    )


def cli_domain_delete(args: argparse.Namespace) -> int:
    """`imexd domain delete NAME [--timeout S]`."""
    problems = [p for p in (domain_problem(args.name),) if p]
    if not args.timeout >= 0:
        problems.append(f"--timeout {args.timeout}: expected seconds >= 0")
    if problems:
        return _usage("domain delete", problems)
    settings = load_control_settings(args.config)
    return _run(delete(settings, args.name, wait_s=args.timeout, out=sys.stdout, err=sys.stderr))


def cli_domain_list(args: argparse.Namespace) -> int:
    """`imexd domain list`."""
    settings = load_control_settings(args.config)
    return _run(list_domains(settings, out=sys.stdout))


def cli_domain_status(args: argparse.Namespace) -> int:
    """`imexd domain status NAME [--nodes a,b] [--json] [--watch] [--wait S]`."""
    nodes, problems = parse_nodes(args.nodes)
    problems = [p for p in (domain_problem(args.name),) if p] + problems
    if not args.wait >= 0:
        problems.append(f"--wait {args.wait}: expected seconds >= 0")
    if problems:
        return _usage("domain status", problems)
    settings = load_control_settings(args.config)
    if not args.watch:
        return _run(
            status(
                settings,
                args.name,
                as_json=args.json,
                wait=args.wait,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        )

    async def watching() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            return await watch(
                settings,
                args.name,
                as_json=args.json,
                stop=stop,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    return _run(watching())


def cli_node_assign(args: argparse.Namespace) -> int:
    """`imexd node assign NODE DOMAIN [--steal] [--force] [--seen-within S]`."""
    problems = [p for p in (node_problem(args.node), domain_problem(args.domain)) if p]
    seen_within = SEEN_WITHIN_S if args.seen_within is None else args.seen_within
    if not seen_within >= 0:
        problems.append(f"--seen-within {seen_within}: expected seconds >= 0")
    if problems:
        return _usage("node assign", problems)
    settings = load_control_settings(args.config)
    return _run(
        assign(
            settings,
            args.node,
            args.domain,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
            force=args.force,
            seen_within_s=float(seen_within),
        )
    )


def cli_node_unassign(args: argparse.Namespace) -> int:
    """`imexd node unassign NODE`."""
    problems = [p for p in (node_problem(args.node),) if p]
    if problems:
        return _usage("node unassign", problems)
    settings = load_control_settings(args.config)
    return _run(assign(settings, args.node, None, out=sys.stdout, err=sys.stderr))


# JSON Schemas shipped under docs/schemas/.


def schema_texts() -> dict[str, str]:
    """File name -> content of each shipped schema, generated from the payload types."""
    schemas = json_schemas()
    return {
        f"{name}.json": json.dumps(schemas[name], indent=2, sort_keys=True) + "\n"
        for name in SCHEMA_NAMES
    }


def write_schemas(folder: Path) -> list[Path]:
    """(Re)write the schemas into `folder`; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, text in schema_texts().items():
        path = folder / filename
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def outdated_schemas(folder: Path) -> list[str]:
    """The schema files in `folder` that are missing or differ from the generated ones."""
    out = []
    for filename, text in schema_texts().items():
        path = folder / filename
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(filename)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m imexd.control --write-schemas DIR | --check-schemas DIR`."""
    parser = argparse.ArgumentParser(
        prog="python -m imexd.control",
        description="Generate or check the JSON Schemas of the bus payloads.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-schemas", metavar="DIR", help="write the schemas into DIR")
    action.add_argument("--check-schemas", metavar="DIR", help="exit 1 if DIR's schemas differ")
    args = parser.parse_args(argv)
    if args.write_schemas:
        for path in write_schemas(Path(args.write_schemas)):
            print(path)
        return EXIT_OK
    outdated = outdated_schemas(Path(args.check_schemas))
    if outdated:
        print(
            f"outdated in {args.check_schemas}: {', '.join(outdated)} "
            f"(run python -m imexd.control --write-schemas {args.check_schemas})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
