"""The health model: the agent's facts in, conditions, readiness and a HealthReport out.

Everything here is pure (no I/O, no clock unless one is passed in), so every reason an
operator can read in `/readyz`, `imexd status` or `imexd domain status` is tested with
plain asserts. The agent fills one `Facts` snapshot from what its components already
track (bus, membership, supervisor, probes, fabric discovery); `conditions` turns it into
Kubernetes-style conditions whose `since` stays put while status and reason do not
change, `ready` decides `/readyz`, and `report` builds the payload served at `/status`
and published on the bus. `Health` keeps the latest snapshot for the HTTP handlers, and
`Heartbeats` is the liveness side: wedged tasks, never the broker or the peers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, NamedTuple

import msgspec

from imexd import messages
from imexd.messages import Condition, DaemonInfo, DomainView, HealthReport, SlotView

Status = Literal["True", "False", "Unknown"]

# Condition types.
BUS_CONNECTED: Final = "BusConnected"
SLOT_SETTLED: Final = "SlotSettled"
DAEMON_READY: Final = "DaemonReady"
DOMAIN_UP: Final = "DomainUp"
FABRIC_READY: Final = "FabricReady"
CONDITION_TYPES: Final = (BUS_CONNECTED, SLOT_SETTLED, DAEMON_READY, DOMAIN_UP, FABRIC_READY)
READINESS_TYPES: Final = (BUS_CONNECTED, SLOT_SETTLED, DAEMON_READY)
"""The conditions `/readyz` requires. DomainUp is left out on purpose: a node must not
be taken out of service because a peer is down, and FabricReady shows up in DaemonReady
through the clique anyway."""

DAEMON_STATES: Final = ("STOPPED", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "FATAL")
DOMAIN_STATES: Final = ("UP", "DEGRADED", "DOWN", "FORMING")
IMEX_READY: Final = "READY"
MESSAGE_MAX: Final = 300
"""Characters a condition message keeps: reports travel in 16 KiB bus payloads."""
NAMES_MAX: Final = 8
"""Node names a message lists before it says "and N more"."""

MembershipState = Literal["none", "claiming", "member", "standby", "out", "leaving"]
MembershipReason = Literal[
    "", "DomainFull", "NotInSpec", "NodeMapMismatch", "DuplicateNode", "Released"
]
WriteMethod = Literal["rename", "in_place"]
FabricSource = Literal["config", "nvml"]


class Member(NamedTuple):
    """A settled member of the node's (domain, clique), as its record says."""

    node: str
    address: str


class SlotProbe(NamedTuple):
    """One member slot as the node's last `ctl -N -j` saw it."""

    node: str
    """The member's node name (not the slot host name)."""
    status: str
    """Its IMEX status word (READY, WAITING_FOR_PEERS, ...; UNAVAILABLE if unknown)."""
    connected: bool
    """Whether it is connected to every other member (empty slots do not count)."""


_EMPTY: Final[Mapping[str, int]] = MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class BusFacts:
    """What the bus client knows about its broker link."""

    connected: bool = False
    """A session with the broker is up (CONNACK received)."""
    synced: bool = False
    """Connected, subscribed, and the retained snapshot has been seen since the last
    (re)connect: only then do the member records mean anything."""
    broker: str = ""
    """The broker URL in use, or last tried."""
    last_error: str = ""
    """Why the last connection attempt or connection failed; "" when none did."""
    refused: tuple[str, ...] = ()
    """Topics whose retained publish did not come back in time: the broker most likely
    refused them (ACL), which MQTT 3.1.1 and aiomqtt 2.x cannot report otherwise."""
    reconnects: int = 0
    """Reconnections since the agent started (cumulative, for metrics)."""
    dropped: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """Messages dropped since the agent started, by `messages.DropReason` value
    (cumulative, for metrics)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipFacts:
    """Where the node stands in its (domain, clique)."""

    state: MembershipState = "none"
    """none: nothing claimed yet (e.g. waiting for the retained snapshot); claiming: a
    claim is published and not settled; member: settled; standby: no slot for now;
    out: kept out by the spec or a mismatch; leaving: the domain is being left."""
    reason: MembershipReason = ""
    """Why the node is not a working member (standby, out, or member with a daemon
    refused); "" when nothing is wrong. Takes precedence over `state`."""
    detail: str = ""
    """A human sentence for `reason`, e.g. which nodes the spec lists."""
    offending: tuple[str, ...] = ()
    """NodeMapMismatch: the members whose max_nodes or mode differ from ours."""
    max_nodes: int = 18
    """Slots of the (domain, clique)."""
    members: Mapping[int, Member] = field(default_factory=lambda: MappingProxyType({}))
    """Settled members by slot, this node included when it is one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonFacts:
    """The supervised IMEX daemon, its files and its local probe."""

    state: str = "STOPPED"
    """The supervisor's state: one of `DAEMON_STATES`."""
    pid: int | None = None
    """The daemon's pid while one runs."""
    restarts: int = 0
    """Restarts of a daemon that had been running, since the agent started (cumulative,
    for metrics and reports)."""
    start_failures: int = 0
    """Starts that never reached RUNNING (missing binary, immediate exit), cumulative."""
    reloads: int = 0
    """SIGUSR1 reloads sent since the agent started (cumulative, for metrics)."""
    last_exit: str | None = None
    """How the last daemon exited, e.g. "exit 3" or "signal SIGKILL"; None before any."""
    reason: str = ""
    """The supervisor's machine-readable problem, e.g. "DaemonCrashLoop" (FATAL after
    too many failed starts) or "ConflictingDaemon" (it refuses to start); "" when none.
    A supervisor reason string "Word: text" splits with `split_reason`."""
    message: str = ""
    """The human side of `reason` (exit and last line, who conflicts), or why the
    daemon is in its state."""
    last_line: str = ""
    """The daemon's last output line, for BACKOFF messages."""
    write_error: str = ""
    """Why the last write of config.cfg, nodes_config.cfg or hosts failed; "" if none."""
    write_path: str = ""
    """The file that `write_error` is about."""
    write_method: WriteMethod = "rename"
    """How the files were last written: atomically by rename, or in place under a lock
    (bind-mounted or read-only-folder hosts files); conditions say which."""
    imex_status: str = ""
    """The last word of `ctl -q` (READY, WAITING_FOR_PEERS, ...); "" before any."""
    probe_error: str = ""
    """Why the last `ctl -q` failed or timed out; "" when it succeeded."""


def split_reason(text: str) -> tuple[str, str]:
    """Split a supervisor reason such as "DaemonCrashLoop: exit 3: <line>" into the
    machine-readable word and the human message; text without a leading CamelCase word
    is all message."""
    word, sep, rest = text.partition(":")
    if sep and _REASON_WORD.match(word):
        return word, rest.strip()
    return "", text.strip()


_REASON_WORD: Final = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainProbe:
    """The last domain probe (`ctl -N -j`), judged over the members only."""

    error: str = ""
    """Why the probe failed or timed out; "" when it succeeded."""
    slots: Mapping[int, SlotProbe] = field(default_factory=lambda: MappingProxyType({}))
    """Per member slot (empty slots excluded: they are unreachable by design)."""
    unreachable: tuple[str, ...] = ()
    """Member nodes this node cannot reach."""
    version_mismatch: tuple[str, ...] = ()
    """Member nodes whose cell reads `!V!` (driver version skew)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FabricFacts:
    """Where the clique came from and whether NVML discovery worked."""

    source: FabricSource = "config"
    """"config": set in the settings (including "" for no multi-node NVLink);
    "nvml": discovered from GPU fabric info."""
    error: str = ""
    """Why NVML discovery failed and what to set instead; "" when it did not."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """Everything the agent knows that health depends on: one immutable snapshot.

    The agent rebuilds it (`dataclasses.replace`) whenever a component reports a change
    and hands it to `Health.update`; nothing here is read from the system.
    """

    node: str
    """This node's name."""
    domain: str | None = None
    """The domain the node belongs to or is joining; None: idle, nothing to do."""
    clique: str = ""
    """The node's clique; "" means no multi-node NVLink: a member without a daemon."""
    address: str = ""
    """The address IMEX binds and peers connect to."""
    slot: int | None = None
    """The node's slot once claimed (claiming or settled); None otherwise."""
    incarnation: int = 0
    """Grows with every agent start on this node."""
    driver: str = ""
    """The GPU driver version, "" when unknown."""
    bus: BusFacts = BusFacts()
    membership: MembershipFacts = MembershipFacts()
    daemon: DaemonFacts = DaemonFacts()
    domain_probe: DomainProbe | None = None
    """None before the first domain probe of the current daemon."""
    fabric: FabricFacts = FabricFacts()
    clique_known: bool = True
    """False while `[node] clique = "auto"` and no discovery has succeeded yet."""

    @property
    def daemon_applicable(self) -> bool:
        """A node in a domain runs a daemon unless its clique is known to be empty."""
        return self.domain is not None and (not self.clique_known or self.clique != "")


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
    if bus.refused:
        return _Verdict(
            "False",
            "PublishRefused",
            f"the broker did not echo our retained publish on {_names(bus.refused)}: "
            "check its ACL for this node",
        )
    if not bus.synced:
        return _Verdict("False", "Syncing", f"connected{at}, waiting for the retained state")
    return _Verdict("True", "Connected", f"connected{at}")


def _slot(f: Facts) -> _Verdict:
    m = f.membership
    if f.domain is None:
        return _Verdict("True", "NoDomain", "no domain assigned: the node is idle")
    where = f"{f.domain}/{messages.clique_level(f.clique)}"
    detail = f": {m.detail}" if m.detail else ""
    if m.reason == "DomainFull":
        return _Verdict(
            "False", "DomainFull", f"all {m.max_nodes} slots of {where} are taken{detail}"
        )
    if m.reason == "NotInSpec":
        return _Verdict(
            "False", "NotInSpec", f"the spec of {f.domain} does not list {f.node}{detail}"
        )
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
            f"members {_names(m.offending)} of {where} use a different max_nodes or mode"
            if m.offending
            else f"the node list of {where} would differ"
        )
        running = f.daemon.state == "RUNNING"
        effect = "a running daemon is kept" if running else "the daemon is not started"
        return _Verdict("False", "NodeMapMismatch", f"{who}; {effect}{detail}")
    if m.state == "member":
        return _Verdict(
            "True",
            "Settled",
            f"slot {f.slot} of {where} ({len(m.members)} of {m.max_nodes} slots taken)",
        )
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
    if f.membership.reason == "DuplicateNode":
        return _Verdict(
            "False", "NotStarted", f"another agent runs as {f.node}: this one runs no daemon"
        )
    if f.membership.reason == "NodeMapMismatch" and d.state != "RUNNING":
        return _Verdict(
            "False",
            "NodeMapMismatch",
            "refusing to start: members would write different node lists "
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
    if d.probe_error:
        return _Verdict("False", "ProbeFailed", f"ctl -q failed: {d.probe_error}")
    if not d.imex_status:
        return _Verdict("False", "Starting", f"pid {d.pid}: waiting for the first probe")
    if d.imex_status != IMEX_READY:
        return _Verdict("False", "NotReady", f"IMEX state {d.imex_status}")
    note = "; files written in place" if d.write_method == "in_place" else ""
    return _Verdict("True", "Ready", f"pid {d.pid}, IMEX READY{note}")


def _exit_text(d: DaemonFacts) -> str:
    parts = [p for p in (d.last_exit, d.last_line) if p]
    return ": ".join(parts)


class _DomainJudgement(NamedTuple):
    verdict: _Verdict
    state: str | None
    """UP, DEGRADED, DOWN or FORMING; None when the node has no domain to judge."""


def _judge_domain(f: Facts) -> _DomainJudgement:
    if f.domain is None:
        return _DomainJudgement(_Verdict("Unknown", "NoDomain", "no domain assigned"), None)
    if not f.daemon_applicable:
        return _DomainJudgement(
            _Verdict("Unknown", "NotApplicable", "empty clique: no IMEX domain to join"), None
        )
    if not f.bus.synced:
        # Without the bus the member records may be stale: what this node last saw of
        # its domain is no judgement of it now (the condition's `since` says how long).
        why = f": {f.bus.last_error}" if f.bus.last_error and not f.bus.connected else ""
        link = "down" if not f.bus.connected else "up but not yet synced"
        return _DomainJudgement(
            _Verdict(
                "Unknown", "BusDown", f"the bus link is {link}{why}; the domain view is stale"
            ),
            None,
        )
    forming = _DomainJudgement(
        _Verdict("False", "Forming", "waiting for the daemon and the first domain probe"),
        "FORMING",
    )
    probe = f.domain_probe
    d = f.daemon
    if d.state in ("FATAL", "BACKOFF") or d.reason or d.write_error:
        # Nothing to judge while this node's own daemon is down: DaemonReady says why.
        return _DomainJudgement(
            _Verdict("False", "DaemonDown", f"the local daemon is {d.state}: see DaemonReady"),
            None,
        )
    if f.membership.state != "member" or d.state != "RUNNING" or probe is None:
        return forming
    if probe.error:
        return _DomainJudgement(
            _Verdict("Unknown", "ProbeFailed", f"ctl -N -j failed: {probe.error}"), None
        )
    members = {slot: m.node for slot, m in f.membership.members.items()}
    if probe.version_mismatch:
        return _DomainJudgement(
            _Verdict(
                "False",
                "VersionMismatch",
                f"driver version differs on {_names(probe.version_mismatch)} (!V!)",
            ),
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
        return _DomainJudgement(
            _Verdict("True", "Up", f"{len(members)} members READY and connected"), "UP"
        )
    others = set(members.values()) - {f.node}
    state = "DOWN" if others and others <= set(bad) else "DEGRADED"
    return _DomainJudgement(
        _Verdict(
            "False",
            "PeersUnreachable",
            f"{len(bad)} of {len(members)} members not READY or not connected: {_names(bad)}",
        ),
        state,
    )


def _domain(f: Facts) -> _Verdict:
    return _judge_domain(f).verdict


def domain_state(facts: Facts) -> str | None:
    """The domain as this node judges it over its members: one of DOMAIN_STATES, or None
    when there is nothing to judge (idle, no daemon, failed probe).

    IMEX's own "Domain State" is not used: in names mode the empty slots point at the
    sentinel address, so it reads DEGRADED until every slot is filled.
    """
    return _judge_domain(facts).state


def domain_view(facts: Facts) -> DomainView | None:
    """The members as the last domain probe saw them, for the HealthReport."""
    state = domain_state(facts)
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


def _fabric(f: Facts) -> _Verdict:
    if f.fabric.error:
        return _Verdict("False", "DiscoveryFailed", f.fabric.error)
    if not f.clique:
        return _Verdict("True", "NotApplicable", "no multi-node NVLink (empty clique)")
    if f.fabric.source == "config":
        return _Verdict("True", "Ready", f"clique {f.clique} (set in the configuration)")
    return _Verdict("True", "Ready", f"clique {f.clique} (discovered through NVML)")


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMES_MAX])
    more = len(names) - NAMES_MAX
    return f"{shown} and {more} more" if more > 0 else shown


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MESSAGE_MAX else line[: MESSAGE_MAX - 3] + "..."


def ready(conds: Sequence[Condition]) -> bool:
    """Bus synced, slot settled (or no domain) and daemon READY (or not applicable)."""
    by_type = {c.type: c for c in conds}
    return all(k in by_type and by_type[k].status == "True" for k in READINESS_TYPES)


def failing(conds: Sequence[Condition]) -> list[Condition]:
    """The readiness conditions that are not True, in readiness order."""
    by_type = {c.type: c for c in conds}
    out: list[Condition] = []
    for kind in READINESS_TYPES:
        c = by_type.get(kind)
        if c is None:
            c = Condition(type=kind, status="Unknown", reason="Missing", message="", since=0.0)
        if c.status != "True":
            out.append(c)
    return out


def describe(cond: Condition) -> str:
    """`Type=Status Reason: message` on one line."""
    text = f"{cond.type}={cond.status} {cond.reason}"
    return f"{text}: {cond.message}" if cond.message else text


def reason_line(conds: Sequence[Condition]) -> str:
    """Why the node is not ready, on one line (empty when it is)."""
    return "; ".join(describe(c) for c in failing(conds))


def report(facts: Facts, conds: Sequence[Condition], now: float) -> HealthReport:
    """The HealthReport served at /status and published on the node's health topic."""
    d = facts.daemon
    return HealthReport(
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
        domain_view=domain_view(facts),
        address=facts.address,
        driver=facts.driver,
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
    state = domain_state(facts)
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
        """Take a new snapshot; True when the report changed (publish it on change)."""
        self._facts = facts
        self._conditions = tuple(conditions(facts, self._conditions, self._clock()))
        fingerprint = self._fingerprint_of()
        changed = fingerprint != self._fingerprint
        self._fingerprint = fingerprint
        return changed

    def report(self) -> HealthReport:
        """The report as of now."""
        return report(self._facts, self._conditions, self._clock())

    def summary(self) -> str:
        return summary(self._facts, self._conditions)

    def _fingerprint_of(self) -> bytes:
        return messages.encode(msgspec.structs.replace(self.report(), at=0.0))


# Liveness


class Heartbeats:
    """Stamps of the agent's long-running tasks: the concrete meaning of "alive".

    Each task registers with its own loop interval and beats once per turn; a task
    silent for more than `factor` of its intervals is wedged and fails `/healthz`.
    Nothing here depends on the broker or the peers: a broker outage must not get
    agents restarted by their liveness probe.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, factor: float = 3.0) -> None:
        self._clock = clock
        self._factor = factor
        self._tasks: dict[str, tuple[float, float]] = {}

    def register(self, name: str, interval_s: float) -> None:
        """Start watching `name`, expected to beat every `interval_s` seconds."""
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval of {name!r} must be > 0, not {interval_s}")
        self._tasks[name] = (interval_s, self._clock())

    def unregister(self, name: str) -> None:
        """Stop watching `name` (a task that ended on purpose)."""
        self._tasks.pop(name, None)

    def beat(self, name: str) -> None:
        """Stamp `name` as alive now."""
        interval, _ = self._tasks[name]
        self._tasks[name] = (interval, self._clock())

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
            if t - last > self._factor * interval
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
