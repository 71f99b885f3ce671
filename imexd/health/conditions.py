"""The health model: the agent's facts in, conditions, readiness and a HealthReport out.

Everything here is pure (no I/O, no clock unless one is passed in), so every reason an
operator can read in `/readyz`, `imexd status` or `imexd domain status` is tested with
plain asserts. The agent fills one `imexd.facts.Facts` snapshot; `conditions` turns it
into Kubernetes-style conditions whose `since` stays put while status and reason do not
change, and `report` builds the payload served at `/status` and published on the bus.
Whether the domain is UP is not decided here: DomainUp is `imexd.health.fleet.sight`'s
verdict. The condition types and readiness (`messages.ready`, `failing`, `describe`) belong to the
HealthReport contract in imexd.messages. `Health` keeps the latest snapshot for the HTTP
handlers, and `Heartbeats` is the liveness side: wedged tasks, never the broker or the
peers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple

import msgspec

from imexd import messages, topics
from imexd.facts import BusFacts, ChannelFacts, DaemonFacts, Facts
from imexd.health import fleet
from imexd.messages import (
    BUS_CONNECTED,
    CHANNELS_READY,
    DAEMON_READY,
    DOMAIN_UP,
    FABRIC_READY,
    SLOT_SETTLED,
    ChannelInfo,
    ChannelsView,
    Condition,
    DaemonInfo,
    HealthReport,
    ready,
    reason_line,
)

Status = Literal["True", "False", "Unknown"]

IMEX_READY: Final = fleet.IMEX_READY
MESSAGE_MAX: Final = 300
"""Characters a condition message keeps: reports travel in 16 KiB bus payloads."""
CHANNEL_MESSAGE_MAX: Final = 160
"""Characters a workload's ChannelInfo message keeps: a report lists every workload."""
REPORT_PACE_S: Final = 0.1
"""Seconds between two judgements of the facts while changes keep coming (a formation
delivers dozens of records per node in a second): the first change after a quiet period
is judged at once, the ones within this pause after it together at its end
(`imexd.agent.pacer.Pacer`). So /readyz and systemd's STATUS= lag a burst by at most this much,
and never miss its last change; the daemon's, its probes' and the channels' news is judged
at once."""
REPORT_HOLD_S: Final = 1.0
"""Seconds after the last published report that a report whose `Health.gist` is the same
(only details changed: a message, a reason, the slot being claimed, the domain view short
of DomainUp) waits before it is published, taking whatever changes meanwhile with it. A
report whose gist changed (readiness, a condition's status, a workload's channel made
ready) goes out at once: that is what `imexd domain status --wait`, `workload create
--wait` and the control plane judge by. A formation thus costs each
node a few reports instead of one per judgement, and no detail is older than this."""


# Conditions


class _Verdict(NamedTuple):
    status: Status
    reason: str
    message: str


def conditions(facts: Facts, previous: Sequence[Condition], now: float) -> list[Condition]:
    """Judge the facts, keeping each condition's `since` while its status and reason hold.

    A message may change (another peer unreachable) without resetting `since`: the
    operator wants to know how long the node has been in trouble, not since when the
    wording changed.
    """
    before = {c.type: c for c in previous}
    verdicts = {
        BUS_CONNECTED: _bus(facts),
        SLOT_SETTLED: _slot(facts),
        DAEMON_READY: _daemon(facts),
        DOMAIN_UP: _domain(facts),
        FABRIC_READY: _fabric(facts),
        CHANNELS_READY: _channels(facts),
    }
    out: list[Condition] = []
    for kind, verdict in verdicts.items():
        old = before.get(kind)
        unchanged = old is not None and (old.status, old.reason) == verdict[:2]
        out.append(
            Condition(
                type=kind,
                status=verdict.status,
                reason=verdict.reason,
                message=_clip(verdict.message),
                since=old.since if old is not None and unchanged else now,
            )
        )
    return out


def _bus(f: Facts) -> _Verdict:
    bus = f.bus
    at = f" to {bus.broker}" if bus.broker else ""
    if not bus.connected:
        why = f": {bus.last_error}" if bus.last_error else ""
        return _Verdict("False", "Disconnected", f"not connected{at}{why}")
    if bus.subscribe_refused:
        return _Verdict("False", "SubscribeRefused", bus.subscribe_refused)
    if bus.refused:
        return _Verdict(
            "False",
            "PublishRefused",
            f"the broker did not echo our retained publish on {fleet.name_list(bus.refused)}: "
            "check its ACL for this node",
        )
    if bus.no_retained_wildcard and bus.retained_not_served:
        return _Verdict("False", "BrokerRetainedNotServed", bus.no_retained_wildcard)
    if bus.no_retained_wildcard:
        return _Verdict("False", "BrokerNoRetainedWildcard", bus.no_retained_wildcard)
    if not bus.synced:
        return _Verdict("False", "Syncing", f"connected{at}, waiting for the retained state")
    if bus.unverified:
        # Connected all the same: a record no node can forge must not make every node
        # unready by being forged; the reason says it, and the agent keeps what it held.
        return _Verdict("True", "UnverifiedRecords", f"connected{at}; {_unverified(bus)}")
    return _Verdict("True", "Connected", f"connected{at}")


UNVERIFIED_SHOWN: Final = 3
"""How many topics UnverifiedRecords names."""
UNVERIFIED_WHY: Final = {
    "unsigned": "unsigned",
    "signature": "signed with another key",
}


def _unverified(bus: BusFacts) -> str:
    """The control-plane records that do not verify with the control key, in a sentence."""
    shown = ", ".join(
        f"{topic} ({UNVERIFIED_WHY.get(why, why)})"
        for topic, why in bus.unverified[:UNVERIFIED_SHOWN]
    )
    more = len(bus.unverified) - UNVERIFIED_SHOWN
    tail = f" and {more} more" if more > 0 else ""
    return (
        f"ignoring {len(bus.unverified)} control-plane record(s) that control.public_key "
        f"does not verify: {shown}{tail}; the agent keeps what the control plane signed"
    )


def _slot(f: Facts) -> _Verdict:
    m = f.membership
    if f.domain is None:
        return _Verdict("True", "NoDomain", "no domain assigned: the node is idle")
    where = f"{f.domain}/{f.clique or topics.NO_CLIQUE_TOPIC}"
    detail = f": {m.detail}" if m.detail else ""
    if m.reason == "DomainFull":
        return _Verdict(
            "False", "DomainFull", f"all {m.max_nodes} slots of {where} are taken{detail}"
        )
    if m.reason == "NotInSpec":
        return _Verdict(
            "False", "NotInSpec", f"the spec of {f.domain} does not list {f.node}{detail}"
        )
    if m.reason == "DuplicateNode" and m.state == "member":
        return _Verdict(
            "True",
            "DuplicateNode",
            f"slot {f.slot} of {where}, but another live agent runs as {f.node}{detail}; "
            "this one keeps its slot and daemon and puts its record back",
        )
    if m.reason == "RecordOverwritten":
        return _Verdict("True", "RecordOverwritten", f"slot {f.slot} of {where}{detail}")
    if m.reason == "DuplicateNode":
        return _Verdict(
            "False",
            "DuplicateNode",
            f"another live agent runs as {f.node}{detail}; this one publishes nothing and "
            "runs no daemon until that one leaves",
        )
    if m.reason == "Released":
        return _Verdict("False", "Released", f"slot of {where} given up{detail}")
    if m.reason == "NodeMapMismatch":
        who = (
            f"members {fleet.name_list(m.offending)} of {where} use a different max_nodes or mode"
            if m.offending
            else f"the node list of {where} would differ"
        )
        running = f.daemon.state == "RUNNING"
        effect = "a running daemon is kept" if running else "the daemon is not started"
        if not m.offending and m.detail:  # this node itself is the odd one: it leads
            return _Verdict("False", "NodeMapMismatch", f"{m.detail}; {effect}")
        return _Verdict("False", "NodeMapMismatch", f"{who}; {effect}{detail}")
    if m.state == "member":
        if m.contested:
            # Settled all the same: the holder keeps its slot and daemon (incumbency), so
            # a forged record must not make every node unready; the reason says it.
            contests = "; ".join(
                f"slot {c.slot} is kept by {c.holder} against {fleet.name_list(c.contenders)}"
                for c in m.contested
            )
            return _Verdict(
                "True",
                "SlotContested",
                f"slot {f.slot} of {where}; another node's member record stands on a held "
                f"slot: {contests}",
            )
        # Not how full the shard is: every member would publish a new report whenever a
        # peer joined or left (k reports per change); `imexd domain status` shows that.
        return _Verdict("True", "Settled", f"slot {f.slot} of {where}")
    if m.state == "claiming":
        return _Verdict("False", "Claiming", f"claiming slot {f.slot} of {where}")
    if m.state == "leaving":
        return _Verdict("False", "Leaving", f"leaving {where}{detail}")
    if m.state in ("standby", "out"):
        return _Verdict("False", "NoSlot", f"no slot in {where}{detail}")
    return _Verdict("False", "Joining", f"joining {where}: waiting for the member snapshot")


def _daemon(f: Facts) -> _Verdict:
    d = f.daemon
    if f.domain is None:
        return _Verdict("True", "NotApplicable", "no domain assigned: no daemon to run")
    if not f.daemon_applicable:
        return _Verdict(
            "True", "NotApplicable", "empty clique (no multi-node NVLink): member without a daemon"
        )
    if not f.clique_known:
        return _Verdict(
            "False", "NotStarted", "waiting for the clique: NVML fabric discovery has not succeeded"
        )
    if d.reason == "Unsupervised":
        return _Verdict("False", "Unsupervised", d.message)
    if f.membership.reason == "DuplicateNode" and f.membership.state != "member":
        return _Verdict(
            "False", "NotStarted", f"another agent runs as {f.node}: this one runs no daemon"
        )
    if f.membership.reason == "NodeMapMismatch" and d.state != "RUNNING":
        return _Verdict(
            "False",
            "NodeMapMismatch",
            f"refusing to start: {f.membership.detail}"
            if f.membership.detail and not f.membership.offending
            else "refusing to start: members would write different node lists "
            f"({f.membership.detail or 'max_nodes or mode differ'})",
        )
    if d.reason == "ConflictingDaemon":
        return _Verdict("False", "ConflictingDaemon", d.message or "another IMEX daemon runs")
    if d.write_error:
        how = "in place" if d.write_method == "in_place" else "by rename"
        return _Verdict(
            "False",
            "ConfigWriteFailed",
            f"cannot write {d.write_path or 'the IMEX files'} ({how}): {d.write_error}",
        )
    if d.state == "FATAL" or d.reason == "DaemonCrashLoop":
        text = d.message or _exit_text(d) or "too many failed starts"
        return _Verdict("False", "DaemonCrashLoop", text)
    if d.reason:
        return _Verdict("False", d.reason, d.message or f"daemon {d.state}")
    if d.state == "BACKOFF":
        after = _exit_text(d)
        after = f" after {after}" if after else ""
        return _Verdict("False", "Backoff", f"restart {d.restarts} pending{after}")
    if d.state == "STARTING":
        return _Verdict("False", "Starting", "the daemon is starting")
    if d.state == "STOPPING":
        return _Verdict("False", "Stopping", "the daemon is stopping")
    if d.state != "RUNNING":
        if f.membership.state != "member" or f.membership.reason:
            return _Verdict("False", "NotStarted", "the daemon starts once the slot is settled")
        return _Verdict("False", "NotStarted", d.message or f"the daemon is {d.state}")
    expected = expected_id(f)
    if d.identified is not None and expected is not None and d.identified != expected:
        what = (
            f"its index among the members in slot order is {expected} (slot {f.slot})"
            if f.mode == "addresses"
            else f"its slot is {expected}"
        )
        return _Verdict(
            "False",
            "IdentityMismatch",
            f"pid {d.pid} identified this node as ID {d.identified}, but {what}: peers reach "
            "it under another node id; check the hosts block and nodes_config.cfg (two entries "
            "that resolve to this node's address)",
        )
    if d.probe_error:
        return _Verdict("False", "ProbeFailed", f"ctl -q failed: {d.probe_error}")
    if not d.imex_status:
        return _Verdict("False", "Starting", f"pid {d.pid}: waiting for the first probe")
    if d.imex_status != IMEX_READY:
        return _Verdict("False", "NotReady", f"IMEX state {d.imex_status}")
    note = "; files written in place" if d.write_method == "in_place" else ""
    return _Verdict("True", "Ready", f"pid {d.pid}, IMEX READY{note}")


def expected_id(f: Facts) -> int | None:
    """The IMEX node id this node's daemon must log: its line in nodes_config.cfg.

    Names mode: its slot. Addresses mode: its index among the settled members in slot
    order (the file lists their addresses). None while it holds no settled slot.
    """
    if f.slot is None or f.membership.state != "member":
        return None
    if f.mode == "addresses":
        slots = sorted(f.membership.members)
        return slots.index(f.slot) if f.slot in slots else None
    return f.slot


def _exit_text(d: DaemonFacts) -> str:
    parts = [p for p in (d.last_exit, d.last_line) if p]
    return ": ".join(parts)


def _domain(f: Facts) -> _Verdict:
    seen = fleet.sight(f)
    return _Verdict(seen.status, seen.reason, seen.message)


def _fabric(f: Facts) -> _Verdict:
    if f.fabric.error:
        return _Verdict("False", "DiscoveryFailed", f.fabric.error)
    if not f.clique:
        return _Verdict("True", "NotApplicable", "no multi-node NVLink (empty clique)")
    if f.fabric.source == "config":
        return _Verdict("True", "Ready", f"clique {f.clique} (set in the configuration)")
    return _Verdict("True", "Ready", f"clique {f.clique} (discovered through NVML)")


def _channels(f: Facts) -> _Verdict:
    c = f.channels
    if f.domain is None:
        return _Verdict("True", "NoWorkloads", "no domain assigned: no workloads")
    if not c.managed:
        return _Verdict(
            "True",
            "NotManaged",
            f"[channels] manage = false: another tool makes the channel devices ({_listed(c)})",
        )
    if not c.synced:
        return _Verdict("Unknown", "Pending", f"waiting for the workloads of {f.domain}")
    failing = [w for w in c.workloads if not w.ready]
    if failing:
        first = failing[0]
        more = f" (and {len(failing) - 1} more)" if len(failing) > 1 else ""
        return _Verdict(
            "False",
            first.reason,
            f"workload {first.workload} channel {first.channel}: {first.message}{more}",
        )
    if c.mismatch and c.count is not None:
        others = ", ".join(f"{node} {count}" for node, count in c.mismatch)
        return _Verdict(
            "False",
            "ChannelCountMismatch",
            f"ImexChannelCount is {c.count} on {f.node} but {others}: channels past the "
            "smallest count fail on some nodes; set NVreg_ImexChannelCount alike everywhere "
            "(devices are still made)",
        )
    used = sorted({w.channel for w in c.workloads if w.channel != 0})
    if c.channel0_open and used:
        return _Verdict(
            "False",
            "WorldWritableChannel0",
            f"channel0 is readable and writable by everyone while workloads use channel "
            f"{', '.join(map(str, used))}: any local process can open channel0 and so reach "
            "the domain past the channels' isolation; set [channels] keep_channel0 = false, "
            "or give channel 0's workload a mode without o+rw (devices are still made)",
        )
    if not c.workloads:
        return _Verdict("True", "NoWorkloads", f"no workload of {f.domain} lists {f.node}")
    simulated = [w for w in c.workloads if w.reason == "Simulated"]
    if simulated:
        return _Verdict("True", "Simulated", f"{_listed(c)}: {simulated[0].message}")
    return _Verdict("True", "Ready", _listed(c))


def _listed(c: ChannelFacts) -> str:
    if not c.workloads:
        return "no workloads"
    return ", ".join(f"{w.workload} on channel {w.channel}" for w in c.workloads)


def channels_view(c: ChannelFacts) -> ChannelsView:
    """The HealthReport's view of the node's channels."""
    return ChannelsView(
        count=c.count,
        major=c.major,
        workloads=[
            ChannelInfo(
                workload=w.workload,
                channel=w.channel,
                generation=w.generation,
                ready=w.ready,
                reason=w.reason,
                message=_clip(w.message, CHANNEL_MESSAGE_MAX),
            )
            for w in c.workloads
        ],
    )


def _clip(text: str, limit: int = MESSAGE_MAX) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _fit(rep: HealthReport) -> HealthReport:
    """`rep` within MAX_PAYLOAD: a node with many workloads first loses the channels'
    messages, then the last workloads by name (counted in `omitted`); an oversized report
    would be dropped by every reader, and the node's whole health with it."""
    view = rep.channels
    size = len(messages.encode(rep))
    if view is None or size <= messages.MAX_PAYLOAD:
        return rep
    infos = [msgspec.structs.replace(w, message="") for w in view.workloads]
    size -= sum(len(w.message) for w in view.workloads)  # at least this much went
    kept = len(infos)
    while kept and size > messages.MAX_PAYLOAD - 32:  # 32: room for "omitted"
        kept -= 1
        size -= len(msgspec.json.encode(infos[kept])) + 1
    view = msgspec.structs.replace(view, workloads=infos[:kept], omitted=len(infos) - kept)
    fitted = msgspec.structs.replace(rep, channels=view)
    if len(messages.encode(fitted)) > messages.MAX_PAYLOAD:  # the rest alone is too big
        view = msgspec.structs.replace(view, workloads=[], omitted=len(infos))
        fitted = msgspec.structs.replace(rep, channels=view)
    return fitted


def report(facts: Facts, conds: Sequence[Condition], now: float) -> HealthReport:
    """The HealthReport served at /status and published on the node's health topic."""
    d = facts.daemon
    return _fit(
        HealthReport(
            node=facts.node,
            domain=facts.domain,
            clique=facts.clique,
            slot=facts.slot,
            incarnation=facts.incarnation,
            at=now,
            ready=ready(conds),
            conditions=list(conds),
            daemon=DaemonInfo(
                state=d.state,
                pid=d.pid,
                restarts=d.restarts,
                last_exit=d.last_exit,
                imex_status=d.imex_status or None,
            ),
            domain_view=fleet.domain_view(facts),
            address=facts.address,
            driver=facts.driver,
            channels=channels_view(facts.channels),
            control_key=facts.bus.control_key,
        )
    )


def summary(facts: Facts, conds: Sequence[Condition]) -> str:
    """One line for systemd's STATUS= and logs: what the node does, or why not ready."""
    if not ready(conds):
        return _clip("not ready: " + reason_line(conds))
    if facts.domain is None:
        return "ready: idle (no domain)"
    where = f"{facts.domain} slot {facts.slot}"
    if not facts.daemon_applicable:
        return f"ready: {where}, no daemon (empty clique)"
    state = fleet.sight(facts).state
    tail = f", domain {state}" if state else ""
    return f"ready: {where}, IMEX {facts.daemon.imex_status}{tail}"


class Health:
    """The node's current facts and conditions, for the HTTP handlers and the reporter.

    The agent calls `update` with each new snapshot; handlers read `conditions`,
    `is_ready` and `report()` without running anything.
    """

    def __init__(self, facts: Facts, *, clock: Callable[[], float] = messages.now) -> None:
        self._clock = clock
        self._facts = facts
        self._conditions: tuple[Condition, ...] = tuple(conditions(facts, (), clock()))
        self._fingerprint = self._fingerprint_of()
        self._summary: str | None = None
        """`summary()` of the current facts and conditions, once asked (None: not yet)."""

    @property
    def facts(self) -> Facts:
        return self._facts

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return self._conditions

    @property
    def is_ready(self) -> bool:
        return ready(self._conditions)

    def update(self, facts: Facts) -> bool:
        """Take a new snapshot; True when the report changed (publish it on change).

        The same facts make the same conditions (each keeps its `since`) and the same
        report: most snapshots of a formation are, and cost only the comparison.
        """
        if facts == self._facts:
            return False
        self._facts = facts
        self._summary = None
        self._conditions = tuple(conditions(facts, self._conditions, self._clock()))
        fingerprint = self._fingerprint_of()
        changed = fingerprint != self._fingerprint
        self._fingerprint = fingerprint
        return changed

    def gist(self) -> tuple[object, ...]:
        """What a published report must say without delay (`REPORT_HOLD_S`): readiness,
        each condition's status, and each workload's channel readiness for its generation
        (what `imexd workload create --wait` waits for, while ChannelsReady may stay True
        as a new workload comes and is made)."""
        workloads = ((w.workload, w.generation, w.ready) for w in self._facts.channels.workloads)
        return (self.is_ready, *((c.type, c.status) for c in self._conditions), *workloads)

    def report(self) -> HealthReport:
        """The report as of now."""
        return report(self._facts, self._conditions, self._clock())

    def summary(self) -> str:
        if self._summary is None:
            self._summary = summary(self._facts, self._conditions)
        return self._summary

    def _fingerprint_of(self) -> bytes:
        return messages.encode(msgspec.structs.replace(self.report(), at=0.0))


class ReportSchedule:
    """When the report loop publishes: a changed report at once when its gist changed
    (`Health.gist`), else `hold_s` after the last publication (with whatever changed
    meanwhile), and an unchanged one every `interval_s`. Times are time.monotonic()."""

    def __init__(self, interval_s: float, hold_s: float = REPORT_HOLD_S) -> None:
        self.interval_s = interval_s
        self.hold_s = hold_s
        self._said: tuple[object, ...] | None = None
        self._said_at = -math.inf
        self._held = math.inf
        """When a changed report that is not out yet is due (inf: none is waiting)."""
        self._periodic = -math.inf

    def changed(self, gist: tuple[object, ...], now: float) -> None:
        """The report changed (`Health.update` said so); `gist` is its new gist."""
        urgent = gist != self._said
        self._held = min(self._held, now if urgent else self._said_at + self.hold_s)

    def next_at(self) -> float:
        """When the next publication is due."""
        return min(self._held, self._periodic)

    def published(self, gist: tuple[object, ...], now: float) -> None:
        """The report with `gist` went out at `now`."""
        self._said, self._said_at = gist, now
        self._held, self._periodic = math.inf, now + self.interval_s


# Liveness


class _Resting:
    """`Heartbeats.resting`: a class, not a generator, as every loop enters it each turn."""

    __slots__ = ("_beats", "_name")

    def __init__(self, beats: Heartbeats, name: str) -> None:
        self._beats, self._name = beats, name

    def __enter__(self) -> None:
        self._beats._resting.add(self._name)

    def __exit__(self, *_exc: object) -> None:
        self._beats._resting.discard(self._name)
        self._beats.beat(self._name)


class Heartbeats:
    """Stamps of the agent's long-running tasks: the concrete meaning of "alive".

    Each task registers with its own loop interval and beats once per turn; a task at
    work silent for more than `factor` of its intervals is wedged and fails `/healthz`.
    A task at rest (`resting`: waiting for its next input) owes no beat, so an idle
    agent is not woken every interval only to say it lives.
    Nothing here depends on the broker or the peers: a broker outage must not get
    agents restarted by their liveness probe.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, factor: float = 3.0) -> None:
        self._clock = clock
        self._factor = factor
        self._tasks: dict[str, tuple[float, float]] = {}
        self._resting: set[str] = set()

    def register(self, name: str, interval_s: float) -> None:
        """Start watching `name`, expected to beat every `interval_s` seconds."""
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval of {name!r} must be > 0, not {interval_s}")
        self._tasks[name] = (interval_s, self._clock())

    def beat(self, name: str) -> None:
        """Stamp `name` as alive now."""
        interval, _ = self._tasks[name]
        self._tasks[name] = (interval, self._clock())

    def resting(self, name: str) -> _Resting:
        """While inside, `name` waits for its next input: at rest, not wedged however long
        it waits. Leaving beats it: from then on it is at work."""
        return _Resting(self, name)

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def interval(self, name: str) -> float:
        return self._tasks[name][0]

    def stale(self, now: float | None = None) -> list[tuple[str, float]]:
        """The wedged tasks with their age in seconds, oldest first."""
        t = self._clock() if now is None else now
        out = [
            (name, t - last)
            for name, (interval, last) in self._tasks.items()
            if t - last > self._factor * interval and name not in self._resting
        ]
        return sorted(out, key=lambda item: -item[1])

    def describe(self, stale: Sequence[tuple[str, float]]) -> str:
        """Why the agent is not live, on one line."""
        return "; ".join(
            f"task {name} silent for {age:.1f} s (interval {self._tasks[name][0]:g} s)"
            if name in self._tasks
            else f"task {name} silent for {age:.1f} s"
            for name, age in stale
        )
