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

import errno
import os
import socket
import time
from collections.abc import Sequence
from enum import StrEnum

import msgspec

from imexd.sim.command import (
    MAX_LINE,
    CmdTarget,
    CommandError,
    NodeState,
    address_family,
    exchange,
)


class LinkStatus(StrEnum):
    """A cell of the connectivity matrix; the value is the `-N -j` status word.

    CONNECTED, NEVER_CONNECTED and INVALID are seen in real output; the other words
    are the simulator's spelling of the remaining legend entries.
    """

    CONNECTED = "CONNECTED"
    NEVER_CONNECTED = "NEVER_CONNECTED"
    INVALID = "INVALID"
    RECOVERING = "RECOVERING"
    DISCONNECTED = "DISCONNECTED"
    AUTHENTICATING = "AUTHENTICATING"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    NODE_MAP_MISMATCH = "NODE_MAP_MISMATCH"

    @property
    def letter(self) -> str:
        """The cell as the `-N` text matrix prints it."""
        return _LETTERS[self]


_LETTERS = {
    LinkStatus.CONNECTED: "C",
    LinkStatus.NEVER_CONNECTED: "N",
    LinkStatus.INVALID: "I",
    LinkStatus.RECOVERING: "R",
    LinkStatus.DISCONNECTED: "D",
    LinkStatus.AUTHENTICATING: "A",
    LinkStatus.VERSION_MISMATCH: "!V!",
    LinkStatus.NODE_MAP_MISMATCH: "!M!",
}


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


def ask_all_blocking(
    targets: Sequence[CmdTarget], request: Request, *, timeout_s: float
) -> list[Reply | CommandError]:
    """Send `request` to every target at once and read each reply, without an event loop
    (`-N`'s peers): non-blocking sockets under one selector, all within one deadline;
    each answer, or why there is none."""
    import selectors  # noqa: PLC0415 - lazy: `-q` asks one target only

    deadline = time.monotonic() + timeout_s
    frame = encode(request)
    results: list[Reply | CommandError] = [
        CommandError(f"no answer from {t} within {timeout_s * 1000:.0f} ms") for t in targets
    ]
    with selectors.DefaultSelector() as selector:
        for index, target in enumerate(targets):
            try:
                sock = socket.socket(address_family(target), socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex(target.path or (target.host, target.port))
            except (OSError, ValueError) as exc:
                results[index] = CommandError(f"cannot talk to {target}: {exc}")
                continue
            if code not in (0, errno.EINPROGRESS):
                sock.close()
                results[index] = CommandError(f"cannot talk to {target}: {os.strerror(code)}")
                continue
            selector.register(sock, selectors.EVENT_WRITE, [index, target, b"", False])
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)  # noqa: S101 - only sockets registered
                state = key.data
                index, target, line, sent = state
                outcome = _step(conn, target, frame, line, sent)
                if isinstance(outcome, tuple):  # still talking: sent, or part of a line read
                    state[2], state[3] = outcome
                    if outcome[1] and not sent:
                        selector.modify(conn, selectors.EVENT_READ, state)
                    continue
                selector.unregister(conn)
                conn.close()
                results[index] = outcome
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
    return results


def _step(
    sock: socket.socket, target: CmdTarget, frame: bytes, line: bytes, sent: bool
) -> tuple[bytes, bool] | Reply | CommandError:
    """One step of one non-blocking exchange: send the request once the connection is up,
    then read until the reply's newline; the reply, why it failed, or (line, sent) so far."""
    try:
        if not sent:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                return CommandError(f"cannot talk to {target}: {os.strerror(error)}")
            sock.sendall(frame)  # one small frame: the socket's buffer takes it whole
            return line, True
        chunk = sock.recv(MAX_LINE)
    except OSError as exc:
        return CommandError(f"cannot talk to {target}: {exc}")
    if not chunk:
        return CommandError(f"{target} closed the connection without answering")
    line += chunk
    if len(line) > MAX_LINE:
        return CommandError(f"{target} answered more than {MAX_LINE} bytes")
    if not line.endswith(b"\n"):
        return line, True
    try:
        return decode_reply(target, line)
    except CommandError as exc:
        return exc


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
