"""What the agent knows about its node: one immutable snapshot of facts.

The agent fills a `Facts` from what its components already track (bus, membership,
supervisor, probes, fabric discovery, channel devices); `imexd.health.conditions` turns
it into conditions and `imexd.health.fleet.sight` judges the node's domain from it. Its own module
because both read it and neither may import the other's rules: plain data, no behaviour,
and only the leaf `imexd.daemon.state` from imexd.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal, NamedTuple

import msgspec

from imexd.daemon.state import DaemonState

DAEMON_STATES: Final = tuple(state.value for state in DaemonState)
"""The supervisor's states, as `DaemonFacts.state` holds them."""

MembershipState = Literal["none", "claiming", "member", "standby", "out", "leaving"]
MembershipReason = Literal[
    "",
    "DomainFull",
    "NotInSpec",
    "NodeMapMismatch",
    "DuplicateNode",
    "Released",
    "RecordOverwritten",
]
LastWrite = Literal["rename", "in_place"]
"""How the files were last written (`imexd.files.WriteMethod` without "unchanged")."""
FabricSource = Literal["config", "nvml"]
NodeListMode = Literal["names", "addresses"]
"""`[domain] mode`: how nodes_config.cfg lists the members (`messages.Mode`)."""


class Member(NamedTuple):
    """A settled member of the node's (domain, clique), as its record says."""

    node: str
    address: str


class Contest(NamedTuple):
    """A slot on which member records of several nodes stand (a forged record, or both
    sides of a split): who keeps it in this node's files, and who contends."""

    slot: int
    holder: str
    """The member the files list on the slot (the incumbent, or the first by rank)."""
    contenders: tuple[str, ...]
    """The other nodes whose member record stands on the slot, sorted."""


class SlotLink(NamedTuple):
    """One member slot as the node's last `ctl -N -j` saw it."""

    node: str
    """The member's node name (not the slot host name)."""
    status: str
    """Its IMEX status word (READY, WAITING_FOR_PEERS, ...; UNAVAILABLE if unknown)."""
    connected: bool
    """Whether it is connected to every other member (empty slots do not count)."""


_EMPTY: Final[Mapping[str, int]] = MappingProxyType({})


class BusFacts(msgspec.Struct, frozen=True, kw_only=True):
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
    no_retained_wildcard: str = ""
    """Why the broker's retained snapshot cannot be trusted: it did not send our own
    record, flagged retained, to a new wildcard subscription; "" when it did."""
    retained_not_served: bool = False
    """With `no_retained_wildcard`: nor to a subscription of its own topic."""
    subscribe_refused: str = ""
    """Which filter the broker refuses to subscribe us to, and where (a clustered broker
    refuses some for a while after a server died); "" when none."""
    reconnects: int = 0
    """Reconnections since the agent started (cumulative, for metrics)."""
    stale_retained: int = 0
    """Retained copies dropped because a live message on their topic came first (a
    clustered broker's late snapshot; cumulative, for metrics)."""
    resync_corrections: int = 0
    """Records the periodic re-read found different from the view (lost updates;
    cumulative, for metrics)."""
    records_put_back: int = 0
    """Our records (the health report) someone wrote over, published again by the bus
    (cumulative, for metrics)."""
    dropped: Mapping[str, int] = msgspec.field(default_factory=lambda: _EMPTY)
    """Messages dropped since the agent started, by `messages.DropReason` value
    (cumulative, for metrics)."""
    control_key: str = ""
    """The fingerprint of `[control] public_key`, which the control plane's records are
    verified with; "" when they are accepted unsigned."""
    unverified: tuple[tuple[str, str], ...] = ()
    """(topic, DropReason value) where the broker holds a control-plane record that does
    not verify, or lacks one that was cleared without a signed deletion; by topic."""


class MembershipFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Where the node stands in its (domain, clique)."""

    state: MembershipState = "none"
    """none: nothing claimed yet (e.g. waiting for the retained snapshot); claiming: a
    claim is published and not settled; member: settled; standby: no slot for now;
    out: kept out by the spec or a mismatch; leaving: the domain is being left."""
    reason: MembershipReason = ""
    """Why the node is not a working member (standby, out, or member with a daemon
    refused), or what a member should know (RecordOverwritten: someone wrote over its
    record lately; DuplicateNode while it keeps its slot: that recurs); "" when nothing
    is wrong. Takes precedence over `state`."""
    detail: str = ""
    """A human sentence for `reason`, e.g. which nodes the spec lists."""
    offending: tuple[str, ...] = ()
    """NodeMapMismatch: the members whose max_nodes or mode differ from ours."""
    max_nodes: int = 18
    """Slots of the (domain, clique)."""
    members: Mapping[int, Member] = msgspec.field(default_factory=lambda: MappingProxyType({}))
    """Settled members by slot, this node included when it is one."""
    contested: tuple[Contest, ...] = ()
    """Slots of the shard on which another node's member record stands beside the
    holder's, by slot (SlotContested, imexd_slot_contested)."""
    overwritten: int = 0
    """Records someone else wrote on this node's member topic, each put back by this
    agent (cumulative, for metrics)."""


class DaemonFacts(msgspec.Struct, frozen=True, kw_only=True):
    """The supervised IMEX daemon, its files and its local probe."""

    state: str = "STOPPED"
    """The supervisor's state: one of `DAEMON_STATES`."""
    pid: int | None = None
    """The daemon's pid while one runs."""
    restarts: int = 0
    """Restarts of a daemon that had been running and exited unplanned, since the agent
    started (cumulative, for metrics and reports)."""
    start_failures: int = 0
    """Starts that never reached RUNNING (missing binary, immediate exit), cumulative."""
    reloads: int = 0
    """SIGUSR1 reloads sent since the agent started (cumulative, for metrics)."""
    last_exit: str | None = None
    """How the last daemon exited, e.g. "exit 3" or "signal SIGKILL"; None before any."""
    reason: str = ""
    """The supervisor's machine-readable problem, e.g. "DaemonCrashLoop" (FATAL after
    too many failed starts) or "ConflictingDaemon" (it refuses to start); "" when none."""
    message: str = ""
    """The human side of `reason` (exit and last line, who conflicts), or why the
    daemon is in its state."""
    last_line: str = ""
    """The daemon's last output line, for BACKOFF messages."""
    write_error: str = ""
    """Why the last write of config.cfg, nodes_config.cfg or hosts failed; "" if none."""
    write_path: str = ""
    """The file that `write_error` is about."""
    write_method: LastWrite = "rename"
    """How the files were last written: atomically by rename, or in place under a lock
    (bind-mounted or read-only-folder hosts files); conditions say which."""
    imex_status: str = ""
    """The daemon's last state word (READY, WAITING_FOR_PEERS, ...): of `ctl -q`, or READY
    from its own line; "" before any."""
    probe_error: str = ""
    """Why the last `ctl -q` failed or timed out; "" when it succeeded."""
    identified: int | None = None
    """The node id the running daemon logged at start (`Identified this node as ID <n>`);
    None when unknown. Health compares it with the node's expected id."""


class LinkFacts(msgspec.Struct, frozen=True, kw_only=True):
    """The last domain probe (`ctl -N -j`) turned into per-member facts (`fleet.links`)."""

    error: str = ""
    """Why the probe failed or timed out; "" when it succeeded."""
    slots: Mapping[int, SlotLink] = msgspec.field(default_factory=lambda: MappingProxyType({}))
    """Per member slot (empty slots excluded: they are unreachable by design)."""
    unreachable: tuple[str, ...] = ()
    """Member nodes this node cannot reach."""
    version_mismatch: tuple[str, ...] = ()
    """Member nodes whose cell reads `!V!` (driver version skew)."""


class FabricFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Where the clique came from and whether NVML discovery worked."""

    source: FabricSource = "config"
    """"config": set in the settings (including "" for no multi-node NVLink);
    "nvml": discovered from GPU fabric info."""
    error: str = ""
    """Why NVML discovery failed and what to set instead; "" when it did not."""


class ChannelState(msgspec.Struct, frozen=True, kw_only=True):
    """One workload's channel on this node: made as its record asks, or why not."""

    workload: str
    channel: int
    generation: int = 0
    """The generation of the WorkloadRecord this state is about."""
    ready: bool = False
    """The device node, CDI spec and env file exist as the record asks."""
    reason: str = ""
    """Why not ready: a ChannelsReady reason (ChannelConflict, MknodFailed, ...); when
    ready, "" or Simulated (`[channels] simulate`, the message says how)."""
    message: str = ""


_NO_OPS: Final[Mapping[tuple[str, str], int]] = MappingProxyType({})


class ChannelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """The node's IMEX channel devices (imexd.channels.keeper keeps them)."""

    managed: bool = True
    """`[channels] manage`: false means another tool owns dev_dir and imexd touches nothing."""
    synced: bool = False
    """The workloads of the node's domain are known (the bus's snapshot is in, or the
    node has no domain): only then is anything removed."""
    count: int | None = None
    """The driver's ImexChannelCount; None when its parameters cannot be read."""
    major: int | None = None
    """The `nvidia-caps-imex-channels` major of /proc/devices; None when not listed."""
    driver_error: str = ""
    """Why the driver's count or major is unknown; "" when both were read."""
    workloads: tuple[ChannelState, ...] = ()
    """The active workloads of the node's domain that list this node, by name."""
    channel0_open: bool = False
    """channel0 exists with o+rw bits: any local process can open it."""
    mismatch: tuple[tuple[str, int], ...] = ()
    """(node, ImexChannelCount) of the shard's members whose count differs from ours."""
    operations: Mapping[tuple[str, str], int] = msgspec.field(default_factory=lambda: _NO_OPS)
    """Operations on the device nodes and files since the agent started, by (op, result)
    (op: mknod, fix, remove, cdi, env; result: ok, error), cumulative for metrics."""


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the agent knows that health depends on: one immutable snapshot.

    The agent rebuilds it (`msgspec.structs.replace`) whenever a component reports a change
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
    domain_probe: LinkFacts | None = None
    """None before the first domain probe of the current daemon."""
    fabric: FabricFacts = FabricFacts()
    clique_known: bool = True
    """False while `[node] clique = "auto"` and no discovery has succeeded yet."""
    mode: NodeListMode = "names"
    """`[domain] mode`: which line of nodes_config.cfg is this node's (its IMEX node id)."""
    channels: ChannelFacts = ChannelFacts()
    """The channel devices of the domain's workloads on this node."""

    @property
    def daemon_applicable(self) -> bool:
        """A node in a domain runs a daemon unless its clique is known to be empty."""
        return self.domain is not None and (not self.clique_known or self.clique != "")
