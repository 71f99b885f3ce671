"""The ctl's side of the command service: where it listens, blocking round trips, the replies.

`imexd-sim-ctl -q` runs at every one of the agent's probes of a simulated daemon, so
this module, `imexd.sim.cfgfile` and the ctl's entry point import only the C socket
module: no event loop, no msgspec, no dataclasses, not even the `socket` module, whose
enums and selectors cost more than the round trip (`_socket` is what it wraps; the
command service's address is an IP literal or a Unix socket path, so nothing here needs
its name resolution). The frames are those
of `imexd.sim.protocol`: the query's request and its replies are kept here as bytes
(tests/test_sim_ctl.py checks them against the protocol's encoder), so that `-q`
(`imexd.sim.ctl.query`) decodes nothing unless a reply is not one of them. `-N` reads
the status replies with the standard json module, checked field by field as the
protocol's msgspec decoder checks them (`decode_status`): `-N` runs after every daemon
start, and msgspec's import would cost it more than its questions (docs/performance.md).
"""

from __future__ import annotations

import _socket
import errno
import os
import time
from enum import StrEnum

from imexd.errors import ImexdError
from imexd.sim.cfgfile import DEFAULT_CMD_PORT, check_values, read_config

MAX_LINE = 64 * 1024
"""Longest frame accepted; a status reply for 2048 nodes stays well below."""


class NodeState(StrEnum):
    """The words `nvidia-imex-ctl -q` prints."""

    INITIALIZING = "INITIALIZING"
    STARTING_AUTH_SERVER = "STARTING_AUTH_SERVER"
    WAITING_FOR_PEERS = "WAITING_FOR_PEERS"
    WAITING_FOR_RECOVERY = "WAITING_FOR_RECOVERY"
    INIT_GPU = "INIT_GPU"
    READY = "READY"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNAVAILABLE = "UNAVAILABLE"


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


QUERY_FRAME = b'{"type":"query"}\n'
"""`QueryRequest()` as `imexd.sim.protocol.encode` writes it."""
QUERY_REPLIES = {b'{"type":"query","state":"%s"}\n' % s.encode(): s for s in NodeState}
"""Every `QueryReply` as the simulated daemon writes it, to its state."""
STATUS_FRAME = b'{"type":"status"}\n'
"""`StatusRequest()` as `imexd.sim.protocol.encode` writes it."""


class CommandError(ImexdError):
    """The command service could not be reached, timed out or answered nonsense."""


class CmdTarget:
    """Where a command service listens: `host` and `port`, or a Unix socket `path`."""

    __slots__ = ("host", "path", "port")

    def __init__(self, host: str = "", port: int = 0, path: str = "") -> None:
        self.host = host
        self.port = port
        self.path = path

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CmdTarget):
            return NotImplemented
        return (self.host, self.port, self.path) == (other.host, other.port, other.path)

    def __hash__(self) -> int:
        return hash((self.host, self.port, self.path))

    def __repr__(self) -> str:
        return f"CmdTarget(host={self.host!r}, port={self.port!r}, path={self.path!r})"

    def __str__(self) -> str:
        if self.path:
            return self.path
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def target_from_config(path: str) -> CmdTarget:
    """Where the daemon of config.cfg at `path` serves commands; the whole file is
    checked as the daemon checks it."""
    fields = check_values(read_config(path), path)
    if not fields.get("cmd_enabled", True):
        raise CommandError(f"IMEX_CMD_ENABLED=0 in {path}: the command service is disabled")
    if unix_path := str(fields.get("cmd_unix_domain_path", "")):
        return CmdTarget(path=unix_path)
    host = str(fields.get("cmd_bind_interface_ip") or fields.get("bind_interface_ip") or "")
    return CmdTarget(host=host or "127.0.0.1", port=int(fields.get("cmd_port", DEFAULT_CMD_PORT)))


def address_family(target: CmdTarget) -> int:
    """The socket family of `target`: a Unix path, or an IPv6 or IPv4 literal."""
    if target.path:
        return _socket.AF_UNIX
    return _socket.AF_INET6 if ":" in target.host else _socket.AF_INET


def exchange(target: CmdTarget, frame: bytes, *, timeout_s: float) -> bytes:
    """Send one frame and read one reply line within `timeout_s` seconds, without an
    event loop: the real `nvidia-imex-ctl` is a small C program, and asyncio's import
    alone would make ours cost several times what the agent's probes of it cost."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = _socket.socket(address_family(target), _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(target.path or (target.host, target.port))
            sock.sendall(frame)
            line = b""
            while not line.endswith(b"\n"):
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = sock.recv(MAX_LINE)
                if not chunk:
                    break
                line += chunk
                if len(line) > MAX_LINE:
                    raise CommandError(f"{target} answered more than {MAX_LINE} bytes")
        finally:
            sock.close()
    except TimeoutError:
        raise CommandError(f"no answer from {target} within {timeout_s * 1000:.0f} ms") from None
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot talk to {target}: {exc}") from exc
    if not line:
        raise CommandError(f"{target} closed the connection without answering")
    return line


class Cell:
    """One node's view of its link to one node of the list (`-N`'s matrix cell)."""

    __slots__ = ("changed", "status")

    def __init__(self, *, status: LinkStatus, changed: bool) -> None:
        self.status = status
        self.changed = changed
        """Whether the cell ever left its initial NEVER_CONNECTED (the JSON `changed`)."""


class NodeStatus:
    """What `-N` reads of a node's `status` reply (`imexd.sim.protocol.StatusReply`)."""

    __slots__ = ("cmd_port", "links", "node", "nodes", "state", "version")

    def __init__(
        self,
        *,
        node: int,
        state: NodeState,
        version: str,
        cmd_port: int,
        nodes: list[str],
        links: list[Cell],
    ) -> None:
        self.node = node
        self.state = state
        self.version = version
        self.cmd_port = cmd_port
        self.nodes = nodes
        """The node list as the daemon read it at start (entries, not addresses)."""
        self.links = links
        """One per entry of `nodes`; its own entry is CONNECTED."""


_STATUS_FIELDS = {
    "node": int,
    "state": str,
    "version": str,
    "instance": str,
    "pid": int,
    "digest": str,
    "server_port": int,
    "cmd_port": int,
    "nodes": list,
    "links": list,
}
"""`StatusReply`'s fields and their JSON types (msgspec takes no bool for an int)."""
_STATES = frozenset(NodeState)
_LINK_STATES = frozenset(LinkStatus)


def decode_status(target: CmdTarget, line: bytes) -> NodeStatus:
    """A `status` reply, checked as strictly as `imexd.sim.protocol.decode_reply` checks
    it (tests/test_sim_ctl.py holds both to the same verdicts); CommandError otherwise."""
    import json  # noqa: PLC0415 - lazy: `-q` decodes nothing

    try:
        document = json.loads(line)
    except ValueError as exc:  # bad JSON, bad UTF-8
        raise CommandError(f"{target} answered something unreadable: {exc}") from None
    problem = _status_problem(document)
    if problem:
        raise CommandError(f"{target} answered something unreadable: {problem}")
    links = document["links"]
    return NodeStatus(
        node=document["node"],
        state=NodeState(document["state"]),
        version=document["version"],
        cmd_port=document["cmd_port"],
        nodes=document["nodes"],
        links=[Cell(status=LinkStatus(c["status"]), changed=c["changed"]) for c in links],
    )


def _status_problem(document: object) -> str:
    """What is wrong with a decoded status reply ("" when nothing is)."""
    if not isinstance(document, dict):
        return "expected an object"
    if document.get("type") != "status":
        return f"expected a status reply, got type {document.get('type')!r}"
    for name, kind in _STATUS_FIELDS.items():
        if name not in document:
            return f"object missing required field `{name}`"
        value = document[name]
        if type(value) is not kind:
            return f"expected {kind.__name__} for `{name}`, got {type(value).__name__}"
    if document["state"] not in _STATES:
        return f"invalid state {document['state']!r}"
    if not all(type(entry) is str for entry in document["nodes"]):
        return "expected str for every entry of `nodes`"
    for cell in document["links"]:
        if not isinstance(cell, dict) or type(cell.get("changed")) is not bool:
            return "expected {status, changed: bool} for every entry of `links`"
        if cell.get("status") not in _LINK_STATES:
            return f"invalid link status {cell.get('status')!r}"
    return ""


def exchange_all(
    targets: list[CmdTarget], frame: bytes, *, timeout_s: float
) -> list[bytes | CommandError]:
    """Send `frame` to every target at once and read one reply line from each, all
    within one deadline, without an event loop (`-N`'s peers): non-blocking sockets
    under one poll; each reply line, or why there is none."""
    import select  # noqa: PLC0415 - lazy: `-q` asks one target only

    deadline = time.monotonic() + timeout_s
    results: list[bytes | CommandError] = [
        CommandError(f"no answer from {t} within {timeout_s * 1000:.0f} ms") for t in targets
    ]
    poller = select.poll()
    talking: dict[int, _Talk] = {}
    try:
        for index, target in enumerate(targets):
            try:
                sock = _socket.socket(address_family(target), _socket.SOCK_STREAM)
            except (OSError, ValueError) as exc:
                results[index] = CommandError(f"cannot talk to {target}: {exc}")
                continue
            try:
                sock.setblocking(False)
                code = sock.connect_ex(target.path or (target.host, target.port))
            except (OSError, ValueError, OverflowError) as exc:  # a port beyond 65535
                sock.close()
                results[index] = CommandError(f"cannot talk to {target}: {exc}")
                continue
            if code not in (0, errno.EINPROGRESS):
                sock.close()
                results[index] = CommandError(f"cannot talk to {target}: {os.strerror(code)}")
                continue
            talking[sock.fileno()] = _Talk(index, target, sock)
            poller.register(sock.fileno(), select.POLLOUT)
        while talking and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(int(left * 1000) + 1):
                talk = talking[fd]
                outcome = talk.step(frame)
                if outcome is None:  # still talking
                    if talk.sent:
                        poller.modify(fd, select.POLLIN)
                    continue
                poller.unregister(fd)
                del talking[fd]
                talk.sock.close()
                results[talk.index] = outcome
    finally:
        for talk in talking.values():
            talk.sock.close()
    return results


class _Talk:
    """One exchange of `exchange_all`: the request sent once the connection is up, then
    the reply read until its newline."""

    __slots__ = ("index", "line", "sent", "sock", "target")

    def __init__(self, index: int, target: CmdTarget, sock: _socket.socket) -> None:
        self.index = index
        self.target = target
        self.sock = sock
        self.line = b""
        self.sent = False

    def step(self, frame: bytes) -> bytes | CommandError | None:
        """One step on readiness: the reply line, why it failed, or None (go on)."""
        target = self.target
        try:
            if not self.sent:
                error = self.sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
                if error:
                    return CommandError(f"cannot talk to {target}: {os.strerror(error)}")
                self.sock.sendall(frame)  # one small frame: the socket's buffer takes it whole
                self.sent = True
                return None
            chunk = self.sock.recv(MAX_LINE)
        except OSError as exc:
            return CommandError(f"cannot talk to {target}: {exc}")
        if not chunk:
            return CommandError(f"{target} closed the connection without answering")
        self.line += chunk
        if len(self.line) > MAX_LINE:
            return CommandError(f"{target} answered more than {MAX_LINE} bytes")
        return self.line if self.line.endswith(b"\n") else None
