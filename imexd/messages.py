"""The bus contract: payload types, strictly decoded, and what each topic may carry.

Every payload is a UTF-8 JSON object of at most 16 KiB with `"v": 1`. Unknown fields
are ignored (forward compatibility); anything else that is wrong is a `Dropped` with a
reason from a small fixed set, which the bus counts in `imexd_bus_dropped_total{reason}`
and logs once per sender and reason. These types are also the source of the JSON
Schemas shipped in docs/schemas/ (`imexd.messages.json_schemas`).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar, assert_never

import msgspec

from imexd.imex import EMPTY_SLOT_ADDRESS
from imexd.topics import TopicRef, Topics, clique_level, route

MAX_PAYLOAD: Final = 16 * 1024
VERSION: Final = 1
MAX_HOLD_S: Final = 300.0
"""The longest a peer keeps the record of a lost node, whatever its tombstone's hold_s."""
MAX_CHANNEL: Final = (1 << 20) - 1
"""The largest minor number Linux has; agents refuse any channel >= the driver's count."""

NodeName = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="DNS-1123 subdomain",
    ),
]
DomainName = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="DNS-1123 label",
    ),
]
CliqueId = Annotated[
    str,
    msgspec.Meta(
        max_length=128,
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]*)?$",
        description='"<cluster-uuid>.<clique-id>", or "" without multi-node NVLink',
    ),
]
WorkloadName = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="DNS-1123 label",
    ),
]
Slot = Annotated[int, msgspec.Meta(ge=0, le=2047)]
Channel = Annotated[
    int,
    msgspec.Meta(
        ge=0,
        le=MAX_CHANNEL,
        description="IMEX channel number: the minor of /dev/nvidia-caps-imex-channels/channel<N>",
    ),
]
MaxNodes = Annotated[int, msgspec.Meta(ge=1, le=2048)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Mode = Literal["names", "addresses"]


ADDRESS_CACHE_SIZE: Final = 4096
"""Distinct addresses whose verdict `address_problem` remembers (least recently used go
first): a fleet's agents and control plane see a few thousand; more only costs rechecks."""
ADDRESS_CACHE_MAX_LEN: Final = 64
"""Longer strings (no IP address is) are judged afresh, so that hostile inputs cannot
make the cache hold more than ADDRESS_CACHE_SIZE short strings."""


def address_problem(address: str) -> str | None:
    """None when `address` may be a node's address on the bus and in files, else why not.

    Allowed: an IPv4 address, or an IPv6 address without a zone id, written exactly as
    `str(ipaddress.ip_address(address))` prints it, so that one address has one spelling
    and a hosts line holds nothing but it. Refused: anything else, the unspecified and
    multicast addresses (no peer can reach a node there), IPv4-mapped IPv6 addresses (use
    the IPv4 address; Python versions print them differently) and EMPTY_SLOT_ADDRESS.
    The texts quote the address with repr(), so a hostile one cannot forge log lines.

    Every record and report is checked where it is decoded and where it is built, so the
    verdict is remembered per distinct address (bounded: ADDRESS_CACHE_SIZE).
    """
    if len(address) > ADDRESS_CACHE_MAX_LEN:
        return _address_problem(address)
    return _remembered_address_problem(address)


def _address_problem(address: str) -> str | None:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"address {address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id is not None:
            return f"address {address!r} has a zone id"
        if ip.ipv4_mapped is not None:
            return f"address {address!r} is IPv4-mapped: use {str(ip.ipv4_mapped)!r}"
    if str(ip) != address:
        return f"address {address!r} is not canonical: write {str(ip)!r}"
    if ip.is_unspecified:
        return f"address {address!r} is unspecified"
    if ip.is_multicast:
        return f"address {address!r} is multicast"
    if address == EMPTY_SLOT_ADDRESS:
        return f"address {address!r} is the empty-slot sentinel"
    return None


_remembered_address_problem: Final = functools.lru_cache(maxsize=ADDRESS_CACHE_SIZE)(
    _address_problem
)


class MemberState(StrEnum):
    """Where a node stands in its (domain, clique)."""

    CLAIMING = "claiming"
    MEMBER = "member"
    STANDBY = "standby"
    LEAVING = "leaving"
    LOST = "lost"
    """The node's link ended without DISCONNECT: its Last Will, a tombstone. Peers keep the
    node's previous record for `hold_s`, then drop it as if it had been cleared."""


class MemberRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A node's retained record on `{p}/domains/{domain}/members/{clique}/{node}`."""

    v: Literal[1] = 1
    node: NodeName
    domain: DomainName
    clique: CliqueId
    address: Annotated[str, msgspec.Meta(max_length=64, description="IPv4 or IPv6 address")]
    slot: Slot | None
    incarnation: Count
    state: MemberState
    max_nodes: MaxNodes
    mode: Mode
    driver: Annotated[str, msgspec.Meta(max_length=64)] = ""
    settled: float | None = None
    """Wall-clock seconds when this node's claim settled into `member`, kept unchanged
    while it stays a member (also across agent restarts); None for claims, standby and
    agents that predate the field. Earlier wins a slot two members hold (membership/slots.py)."""
    channel_count: Count | None = None
    """The driver's ImexChannelCount on this node (None: unknown, or an agent that
    predates channels): it must be equal on every member (ChannelCountMismatch)."""
    released: bool = False
    """Standby only: the node gave its slot up (its daemon cannot run) and seeks none
    while that lasts, so peers do not rank it among the nodes waiting for a slot."""
    hold_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Lost only: seconds the peers keep the node's previous record before dropping it
    (0 when the broker already waited a Will Delay; peers clamp it to MAX_HOLD_S)."""
    seq: Count = 0
    """The record's place among those this agent run (`incarnation`) published: 1 for its
    first, one more for each record that says something new; a record published again
    unchanged keeps its seq. 0: no place (a Last Will, which the broker writes when it
    fires, and agents that predate the field). `version` reads it."""
    link: Count = 0
    """The writer's link to the broker (counted from 1 in its run) that this record was
    published on, or, in a Last Will, the link whose end it says. 0: an agent that
    predates the field. `version` reads it."""

    def __post_init__(self) -> None:
        problem = address_problem(self.address)
        if problem is not None:
            raise ValueError(problem)
        if self.slot is not None and self.slot >= self.max_nodes:
            raise ValueError(f"slot {self.slot} is not below max_nodes {self.max_nodes}")
        if self.state in (MemberState.CLAIMING, MemberState.MEMBER) and self.slot is None:
            raise ValueError(f"a {self.state.value} record needs a slot")
        if self.released and self.state is not MemberState.STANDBY:
            raise ValueError(f"a {self.state.value} record cannot be released")
        if self.hold_s and self.state is not MemberState.LOST:
            raise ValueError(f"a {self.state.value} record cannot have hold_s {self.hold_s}")


LINK_END: Final = 1 << 62
"""The `seq` a Last Will stands at in `version`: after every record of the link it ends."""

Version = tuple[int, int, int]
"""(incarnation, link, seq) of a member record or Last Will: later is greater."""


def version(record: MemberRecord) -> Version | None:
    """Where `record` stands among everything its writer published: (incarnation, link,
    seq), later is greater. A Last Will (state lost) ends its link: it comes after every
    record published on that link and before any of a later link or run. None for a record
    without a place (seq 0: an agent that predates it), which is ordered by its arrival."""
    if record.state is MemberState.LOST:
        return (record.incarnation, record.link, LINK_END)
    if record.seq == 0:
        return None
    return (record.incarnation, record.link, record.seq)


class Condition(msgspec.Struct, frozen=True, kw_only=True):
    """One fact about the node, Kubernetes-style: status "True", "False" or "Unknown"."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    since: float


class DaemonInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The supervised IMEX daemon as the agent sees it."""

    state: str
    pid: int | None = None
    restarts: Count = 0
    last_exit: str | None = None
    imex_status: str | None = None


class SlotView(msgspec.Struct, frozen=True, kw_only=True):
    """One member slot as the node's own `ctl -N -j` saw it."""

    node: str
    status: str
    connected: bool


class DomainView(msgspec.Struct, frozen=True, kw_only=True):
    """The domain as judged by this node over the members only."""

    status: str
    nodes: dict[str, SlotView] = msgspec.field(default_factory=dict)


class ChannelInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One workload's channel on this node, as the agent made it (or could not). A ready
    one is sent without its empty reason and message, so that 200 workloads fit a report
    (`HealthReport`, MAX_PAYLOAD) instead of the last ones being omitted."""

    workload: WorkloadName
    channel: Channel
    generation: Count = 0
    """The generation of the WorkloadRecord this state is about."""
    ready: bool
    """The device node (and CDI spec and env file) exist as the record asks."""
    reason: str = ""
    """Why not ready (a ChannelsReady reason such as ChannelConflict); "" when ready, or
    Simulated when ready from a simulated driver (`[channels] simulate`)."""
    message: str = ""


class ChannelsView(msgspec.Struct, frozen=True, kw_only=True):
    """The node's IMEX channels: what the driver offers and each workload's channel."""

    count: Count | None = None
    """The driver's ImexChannelCount; None when its parameters cannot be read."""
    major: Count | None = None
    """The `nvidia-caps-imex-channels` major of /proc/devices; None when not listed."""
    workloads: list[ChannelInfo] = msgspec.field(default_factory=list)
    """The workloads of the node's domain that list this node, by name."""
    omitted: Count = 0
    """Workloads left out of `workloads` (the last by name) so that the report stays
    within MAX_PAYLOAD; their state is in the agent's /metrics and logs."""


class HealthReport(msgspec.Struct, frozen=True, kw_only=True):
    """A node's retained report on `{p}/domains/{domain}/health/{node}` and at /status."""

    v: Literal[1] = 1
    node: NodeName
    domain: DomainName | None
    clique: CliqueId
    slot: Slot | None
    incarnation: Count
    at: float
    ready: bool
    conditions: list[Condition]
    daemon: DaemonInfo
    domain_view: DomainView | None = None
    address: str = ""
    """The node's address, or "" when unknown; checked like MemberRecord.address."""
    driver: str = ""
    channels: ChannelsView | None = None
    """The node's IMEX channels; None from agents that predate workloads."""
    control_key: str = ""
    """The fingerprint of the key the agent verifies the control plane's records with
    (`[control] public_key`, `imexd.signing.fingerprint`); "": it accepts them unsigned."""

    def __post_init__(self) -> None:
        problem = address_problem(self.address) if self.address else None
        if problem is not None:
            raise ValueError(problem)


# What a HealthReport's conditions mean: the agent writes them (imexd.health.conditions),
# every reader of reports (imexd.health.fleet, imexd.cli.query, the control plane) reads
# them back.

BUS_CONNECTED: Final = "BusConnected"
SLOT_SETTLED: Final = "SlotSettled"
DAEMON_READY: Final = "DaemonReady"
DOMAIN_UP: Final = "DomainUp"
FABRIC_READY: Final = "FabricReady"
CHANNELS_READY: Final = "ChannelsReady"
CONDITION_TYPES: Final = (
    BUS_CONNECTED,
    SLOT_SETTLED,
    DAEMON_READY,
    DOMAIN_UP,
    FABRIC_READY,
    CHANNELS_READY,
)
READINESS_TYPES: Final = (BUS_CONNECTED, SLOT_SETTLED, DAEMON_READY)
"""The conditions `/readyz` requires. DomainUp is left out on purpose: a node must not
be taken out of service because a peer is down, and FabricReady shows up in DaemonReady
through the clique anyway. ChannelsReady is left out too: a channel concerns one workload,
`imexd workload status` judges it, and IMEX itself runs without channels."""


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


class DomainSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The control plane's retained spec on `{p}/domains/{domain}/spec`.

    `deleted` is the domain's tombstone: the version that says it is gone (imexd.order).
    """

    v: Literal[1] = 1
    domain: DomainName
    nodes: list[NodeName] | None = None
    max_nodes: MaxNodes = 18
    state: Literal["active", "deleting", "deleted"] = "active"
    generation: Count = 0
    """The version: one more than the topic's previous record (its tombstone included),
    or the Unix time in whole seconds where the broker held none (imexd.order)."""
    at: float = 0.0
    """Wall-clock seconds when the control plane wrote this version (0: unknown): how old
    a tombstone is (`[control] tombstone_expiry_s`, `imexd gc --tombstones`)."""


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    """The control plane's retained assignment on `{p}/nodes/{node}/assignment`; one to
    no domain (null) is its tombstone."""

    v: Literal[1] = 1
    domain: DomainName | None
    generation: Count = 0
    """The version, as DomainSpec.generation (0: a writer that predates it)."""
    at: float = 0.0
    """Wall-clock seconds when the control plane wrote this version (0: unknown)."""


class WorkloadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The control plane's retained record on `{p}/domains/{domain}/workloads/{workload}`.

    A named user of the domain's IMEX: the agents of the listed nodes make the channel's
    device node with this owner and mode (plus a CDI spec and an env file) while the
    record is `active`; a `claiming` record only reserves the channel while the writer
    checks that no other control-plane client took it first (imexd.control.workloads).
    """

    v: Literal[1] = 1
    workload: WorkloadName
    domain: DomainName
    channel: Channel
    nodes: list[NodeName] | None = None
    """The nodes the workload runs on; None: every node of the domain."""
    uid: Annotated[int, msgspec.Meta(ge=0, le=4294967294)] = 0
    gid: Annotated[int, msgspec.Meta(ge=0, le=4294967294)] = 0
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o777, description="permission bits")] = 0o660
    state: Literal["claiming", "active", "deleted"] = "active"
    """`deleted`: the workload's tombstone (imexd.order)."""
    generation: Count = 0
    """The version, as DomainSpec.generation."""
    owner: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """Who wrote the record (the control-plane client's id): tells two writers apart."""
    created: float = 0.0
    """Wall-clock seconds when the workload was first created."""
    at: float = 0.0
    """Wall-clock seconds when the control plane wrote this version (0: unknown)."""

    def lists(self, node: str) -> bool:
        """Whether the workload runs on `node` (a record without a node list: every node)."""
        return self.nodes is None or node in self.nodes


class Ping(msgspec.Struct, frozen=True, kw_only=True):
    """A round trip through the broker on `{p}/nodes/{node}/ping` that proves the link."""

    v: Literal[1] = 1
    node: NodeName
    seq: Count
    sent: float


class Presence(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's retained word on `{p}/nodes/{node}/presence` that it runs on `node`.

    Written whatever the node does (also while it is in no domain), so the control plane
    can tell a node that an agent reported from a typo; `at` says when. It is also where
    the agent's one Last Will goes, set once per agent run (`lost`): a will does not
    follow the node from domain to domain, so joining or leaving one never changes the
    will, which MQTT can change only by connecting again. Its peers follow it
    (`lost_record`).
    """

    v: Literal[1] = 1
    node: NodeName
    incarnation: Count
    at: float
    """Wall-clock seconds when the agent wrote this."""
    domain: DomainName | None
    """The domain the agent is in, None when it is in none."""
    address: Annotated[str, msgspec.Meta(max_length=64, description="IPv4 or IPv6 address")]
    stopped: float | None = None
    """Wall-clock seconds when the agent stopped cleanly: its last word before it left
    (not at a hand-over, whose successor goes on). None while it runs."""
    lost: bool = False
    """True in the agent's Last Will: the broker wrote it because the agent's link ended
    without a goodbye. It ends every member record of this node that its link and run
    wrote (`lost_record`)."""
    link: Count = 0
    """Lost only: the link whose end the will says (`Connected.link`, counted from 1 in
    the run); 0: an agent that predates the field."""
    hold_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Lost only: seconds the peers keep the node's records before dropping them (0 when
    the broker already waited a Will Delay), as MemberRecord.hold_s."""

    def __post_init__(self) -> None:
        problem = address_problem(self.address)
        if problem is not None:
            raise ValueError(problem)
        if (self.link or self.hold_s) and not self.lost:
            raise ValueError("only a lost presence (a Last Will) has a link and hold_s")


def presence_end(presence: Presence) -> Version | None:
    """The version past which `presence` ends its node's member records, or None when it
    ends none: a Last Will ends the records of its link and of earlier ones (it comes
    after every record of that link, before any of a later link or run); a clean stop's
    last word (`stopped`) ends every record of its run and of earlier runs."""
    if presence.lost:
        return (presence.incarnation, presence.link, LINK_END)
    if presence.stopped is not None:
        return (presence.incarnation, LINK_END, LINK_END)
    return None


def lost_record(record: MemberRecord, presence: Presence) -> MemberRecord | None:
    """The end that `presence` makes of `record`, a member record of the same node, as a
    tombstone (state lost) at `presence_end`, which every reader orders by `version`; None
    when the presence ends nothing."""
    end = presence_end(presence)
    if presence.node != record.node or end is None:
        return None
    return MemberRecord(
        node=record.node,
        domain=record.domain,
        clique=record.clique,
        address=presence.address,
        slot=None,
        incarnation=presence.incarnation,
        state=MemberState.LOST,
        max_nodes=record.max_nodes,
        mode=record.mode,
        hold_s=presence.hold_s,
        link=end[1],
    )


def ended(record: MemberRecord, presence: Presence | None) -> bool:
    """Whether `presence` ends `record` (`presence_end` is later than its version)."""
    end = None if presence is None or presence.node != record.node else presence_end(presence)
    held = version(record)
    return end is not None and (held is None or end > held)


class Retry(msgspec.Struct, frozen=True, kw_only=True):
    """An operator's retained request on `{p}/domains/{domain}/retry/{node}` (`imexd node
    retry`): end the daemon's crash-loop wait (FATAL, BACKOFF) and start it now.

    Under the domain, so that the agents' read of the domains covers it with no new grant.
    The agent acts on each request once, and only on one written after it started (a new
    agent has no crash loop to clear), so a request kept by the broker is harmless.
    """

    v: Literal[1] = 1
    node: NodeName
    domain: DomainName
    at: float
    """Wall-clock seconds when it was written: tells one request from the next."""
    by: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """Who asked (the control-plane client's id), for the agent's log."""
    generation: Count = 0
    """The version, as DomainSpec.generation: the agent acts on a request only when it is
    newer than the last it saw (0: a writer that predates it)."""
    state: Literal["asked", "done"] = "asked"
    """`done`: the request's tombstone, written when `imexd node retry` ends."""


Payload = (MemberRecord | HealthReport | DomainSpec | Assignment | Ping | Presence
           | WorkloadRecord | Retry)  # fmt: skip
P = TypeVar("P", MemberRecord, HealthReport, DomainSpec, Assignment, Ping, Presence,
            WorkloadRecord, Retry)  # fmt: skip


class DropReason(StrEnum):
    """Why a message was dropped: the `reason` label of imexd_bus_dropped_total."""

    OVERSIZED = "oversized"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    VERSION = "version"
    SCHEMA = "schema"
    ADDRESS = "address"
    """A well-formed payload whose address is refused (`address_problem`)."""
    TOPIC_MISMATCH = "topic_mismatch"
    UNKNOWN_TOPIC = "unknown_topic"
    UNSIGNED = "unsigned"
    """With `[control] public_key`: a control-plane record (spec, workload, assignment,
    retry request) without the control key's signature (`imexd.signing`)."""
    SIGNATURE = "signature"
    """With `[control] public_key`: a control-plane record whose signature does not verify
    (another key, another topic, changed bytes)."""
    STALE = "stale"
    """A spec, workload, assignment or retry request older than the version the agent
    holds (`imexd.order`): not applied, and answered with the held version."""


class Dropped(msgspec.Struct, frozen=True):
    """A message that failed decoding, with why."""

    reason: DropReason
    detail: str


_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()
_TYPED = (MemberRecord, HealthReport, DomainSpec, Assignment, Ping, Presence, WorkloadRecord,
          Retry)  # fmt: skip
_typed_decoders: Final[dict[type[Any], msgspec.json.Decoder[Any]]] = {}
"""Each kind's own decoder, made at its first payload: a command that reads two kinds
does not pay for eight at its start."""


def decode(payload: bytes, kind: type[P]) -> P | Dropped:
    """Decode and validate one payload; never raises for bad input.

    A valid payload is decoded in one pass by the type's own decoder (its checks are the
    same ones, `__post_init__` included); only one that fails is decoded again step by
    step, to say why in the order of the reasons below.
    """
    if len(payload) > MAX_PAYLOAD:
        return Dropped(DropReason.OVERSIZED, f"{len(payload)} bytes > {MAX_PAYLOAD}")
    typed = _typed_decoders.get(kind)
    if typed is None and kind in _TYPED:
        typed = _typed_decoders[kind] = msgspec.json.Decoder(kind)
    if typed is not None:
        with contextlib.suppress(msgspec.DecodeError):
            result: P = typed.decode(payload)
            return result
    return _decode_stepwise(payload, kind)


def _decode_stepwise(payload: bytes, kind: type[P]) -> P | Dropped:
    """`decode` one check at a time, so that a bad payload gets the first reason."""
    if len(payload) > MAX_PAYLOAD:
        return Dropped(DropReason.OVERSIZED, f"{len(payload)} bytes > {MAX_PAYLOAD}")
    try:
        obj: Any = _json_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return Dropped(DropReason.NOT_JSON, str(exc))
    if not isinstance(obj, dict):
        return Dropped(DropReason.NOT_OBJECT, f"a JSON {type(obj).__name__}, not an object")
    if obj.get("v") != VERSION:
        return Dropped(DropReason.VERSION, f"v = {obj.get('v')!r}, expected {VERSION}")
    address = obj.get("address")
    if "address" in kind.__struct_fields__ and isinstance(address, str) and address:
        problem = address_problem(address)
        if problem is not None:
            return Dropped(DropReason.ADDRESS, problem)
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        return Dropped(DropReason.SCHEMA, str(exc))


def encode(payload: Payload) -> bytes:
    """Encode a payload as compact JSON."""
    return _json_encoder.encode(payload)


def to_builtins(payload: Payload) -> Any:
    """The payload as plain dicts and lists (for HTTP responses and tests)."""
    return msgspec.to_builtins(payload)


SIGNED_TYPES: Final = (DomainSpec, WorkloadRecord, Assignment, Retry)
"""The payloads the control plane signs with `[control] private_key` (`imexd.signing`)."""
SIG_SCHEMA: Final = {
    "description": "The control plane's Ed25519 signature (base64url, no padding) over the "
    "topic, a newline and the record without this member; always the last member, written "
    'exactly as `,"sig":"..."}` (docs/security.md). Absent when the control plane '
    "has no key.",
    "pattern": "^[A-Za-z0-9_-]{86}$",
    "type": "string",
}


def json_schemas() -> dict[str, Any]:
    """JSON Schemas of every payload, keyed by type name (shipped under docs/schemas/)."""
    schemas: dict[str, Any] = {}
    for cls in (MemberRecord, HealthReport, DomainSpec, Assignment, Presence, WorkloadRecord,
                Retry):  # fmt: skip
        schema = msgspec.json.schema(cls)
        body = schema["$defs"][cls.__name__]
        # `v` has a default for the producers' convenience, but the wire requires it.
        body["required"] = sorted({"v", *body.get("required", [])})
        if cls in SIGNED_TYPES:
            body["properties"]["sig"] = SIG_SCHEMA
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schemas[cls.__name__] = schema
    return schemas


def tombstone(payload: Payload) -> bool:
    """Whether `payload` is a deletion: a spec or workload `deleted`, an assignment to no
    domain, a retry request `done`."""
    if isinstance(payload, DomainSpec | WorkloadRecord):
        return payload.state == "deleted"
    if isinstance(payload, Assignment):
        return payload.domain is None
    if isinstance(payload, Retry):
        return payload.state == "done"
    return False


def now() -> float:
    """Wall-clock time for `at` and `since` fields (seconds since the epoch)."""
    return round(time.time(), 3)


def check_topic(ref: TopicRef, payload: Payload) -> str | None:
    """None when the payload may be published on its topic, else why not.

    A node can only speak for itself: the record's node, domain and clique must be the
    ones its topic names (with broker ACLs on `%u` this makes spoofing impossible).
    """
    if isinstance(payload, MemberRecord):
        if (payload.node, payload.domain, payload.clique) != (ref.node, ref.domain, ref.clique):
            return (
                f"record says {payload.node}@{payload.domain}/{clique_level(payload.clique)}, "
                f"topic says {ref.node}@{ref.domain}/{clique_level(ref.clique)}"
            )
    elif isinstance(payload, HealthReport):
        if payload.node != ref.node or (payload.domain or "") != ref.domain:
            return (
                f"report says {payload.node}@{payload.domain}, topic says {ref.node}@{ref.domain}"
            )
    elif isinstance(payload, DomainSpec):
        if payload.domain != ref.domain:
            return f"spec says {payload.domain}, topic says {ref.domain}"
    elif isinstance(payload, WorkloadRecord):
        if (payload.workload, payload.domain) != (ref.workload, ref.domain):
            return (
                f"workload says {payload.workload}@{payload.domain}, "
                f"topic says {ref.workload}@{ref.domain}"
            )
    elif isinstance(payload, Ping) and payload.node != ref.node:
        return f"ping says {payload.node}, topic says {ref.node}"
    elif isinstance(payload, Presence) and payload.node != ref.node:
        return f"presence says {payload.node}, topic says {ref.node}"
    elif isinstance(payload, Retry) and (payload.node, payload.domain) != (ref.node, ref.domain):
        return f"retry says {payload.node}@{payload.domain}, topic says {ref.node}@{ref.domain}"
    return None


# Turning one MQTT message into what it means: the agent's bus and the control plane
# decode alike, so both sides drop the same malformed messages.


@dataclass(frozen=True, slots=True)
class Received:
    """A valid payload on a topic of the contract (our own publications included)."""

    topic: str
    ref: TopicRef
    payload: Payload
    retained: bool
    """True when it comes from the broker's retained store (a snapshot), not live."""
    data: bytes = field(default=b"", compare=False, repr=False)
    """The payload's bytes as they came: what an agent gives back to a broker that serves
    an older version or none (imexd.agent.rebuild), unknown fields of a newer writer
    and the signature included."""


class Deleted(msgspec.Struct, frozen=True):
    """An empty payload on the topic of a record (any but a ping): the record is gone."""

    topic: str
    ref: TopicRef
    retained: bool


def decode_message(
    topics: Topics, topic: str, payload: bytes, *, retained: bool
) -> Received | Deleted | Dropped:
    """Turn one MQTT message into an event, or say why it is dropped; never raises.

    A record must agree with its topic (`check_topic`): a node can only speak for itself.
    """
    ref, problem = route(topics.prefix, topic)
    if ref is None:
        return Dropped(DropReason.UNKNOWN_TOPIC, "not a topic of the imexd contract")
    if problem is not None:
        return Dropped(DropReason.UNKNOWN_TOPIC, problem)
    if not payload:
        if ref.kind == "ping":
            return Dropped(DropReason.NOT_JSON, "empty payload")
        return Deleted(topic, ref, retained)
    result: Payload | Dropped
    match ref.kind:
        case "member":
            result = decode(payload, MemberRecord)
        case "health":
            result = decode(payload, HealthReport)
        case "spec":
            result = decode(payload, DomainSpec)
        case "workload":
            result = decode(payload, WorkloadRecord)
        case "assignment":
            result = decode(payload, Assignment)
        case "ping":
            result = decode(payload, Ping)
        case "presence":
            result = decode(payload, Presence)
        case "retry":
            result = decode(payload, Retry)
        case _:
            assert_never(ref.kind)
    if isinstance(result, Dropped):
        return result
    mismatch = check_topic(ref, result)
    if mismatch is not None:
        return Dropped(DropReason.TOPIC_MISMATCH, mismatch)
    return Received(topic, ref, result, retained, data=payload)
