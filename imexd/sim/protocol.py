"""The simulator's two protocols: daemon to daemon, and ctl to daemon.

Both are one JSON object per line, decoded strictly with msgspec: a frame of the
wrong shape ends the connection instead of confusing the state machine. The real
IMEX protocols are private (gRPC inside NVIDIA's binaries); these only carry what the
observable behaviour needs.

Peer links (TCP to SERVER_PORT): the dialling node sends `hello`, the listening node
answers with its own `hello` and then a `hb` every heartbeat interval, so the dialler,
whose view is its row of the `-N` matrix, notices a silent peer within the peer
timeout. Either side sends `bye` before a graceful exit.

Command service (IMEX_CMD_PORT or IMEX_CMD_UNIX_DOMAIN_PATH): one request per
connection, `query` (the `-q` word) or `status` (this node's row and node list, from
which `-N` is assembled), answered by one line. The ctl's `-q` needs none of this
module (`imexd.sim.command`).
"""

from __future__ import annotations

import msgspec

from imexd.sim.command import (
    CmdTarget,
    CommandError,
    LinkStatus,
    NodeState,
    exchange,
)

# Peer frames


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Who is at the other end, and whether we may talk to it at all."""

    node: int
    """Its IMEX node id (line index in its node list)."""
    digest: str
    """Digest of its node list; different from ours = node map mismatch."""
    instance: str
    """New at every start: a change tells peers to clean up imports from the old one."""
    version: str
    state: NodeState


class Heartbeat(msgspec.Struct, frozen=True, tag="hb"):
    """Proof of life from the listening side, every heartbeat interval."""


class Bye(msgspec.Struct, frozen=True, tag="bye"):
    """Sent before a graceful exit, so peers clean up at once instead of waiting."""


PeerFrame = Hello | Heartbeat | Bye


# Command service


class QueryRequest(msgspec.Struct, frozen=True, tag="query"):
    """`-q`: the local state word."""


class StatusRequest(msgspec.Struct, frozen=True, tag="status"):
    """`-N`: everything one node knows about itself and its outgoing links."""


Request = QueryRequest | StatusRequest


class QueryReply(msgspec.Struct, frozen=True, tag="query"):
    state: NodeState


class Link(msgspec.Struct, frozen=True):
    """This node's view of its connection to one node of the list."""

    status: LinkStatus
    changed: bool
    """Whether the cell ever left its initial NEVER_CONNECTED (the JSON `changed`)."""


class StatusReply(msgspec.Struct, frozen=True, tag="status"):
    node: int
    state: NodeState
    version: str
    instance: str
    pid: int
    digest: str
    server_port: int
    cmd_port: int
    nodes: list[str]
    """The node list as read at start (entries, not addresses)."""
    links: list[Link]
    """One per entry of `nodes`; its own entry is CONNECTED."""


Reply = QueryReply | StatusReply

PEER_DECODER = msgspec.json.Decoder(PeerFrame)
REQUEST_DECODER = msgspec.json.Decoder(Request)
REPLY_DECODER = msgspec.json.Decoder(Reply)
_ENCODER = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """One frame: the JSON object and a newline."""
    return _ENCODER.encode(message) + b"\n"


def decode_reply(target: CmdTarget, line: bytes) -> Reply:
    """A command service's reply line, decoded strictly."""
    try:
        return REPLY_DECODER.decode(line)
    except msgspec.DecodeError as exc:
        raise CommandError(f"{target} answered something unreadable: {exc}") from exc


def ask_blocking(target: CmdTarget, request: Request, *, timeout_s: float) -> Reply:
    """Send one request and read its reply within `timeout_s` seconds, without an event
    loop (`imexd.sim.command.exchange`)."""
    return decode_reply(target, exchange(target, encode(request), timeout_s=timeout_s))
