"""The ctl's side of the command service: where it listens, one blocking round trip, `-q`.

`imexd-sim-ctl -q` runs at every one of the agent's probes of a simulated daemon, so
this module, `imexd.sim.cfgfile` and the ctl's entry point import only the C socket
module: no event loop, no msgspec, no dataclasses, not even the `socket` module, whose
enums and selectors cost more than the round trip (`_socket` is what it wraps; the
command service's address is an IP literal or a Unix socket path, so nothing here needs
its name resolution). The frames are those
of `imexd.sim.protocol`: the query's request and its replies are kept here as bytes
(tests/test_sim_ctl.py checks them against the protocol's encoder), so that `-q`
(`imexd.sim.ctl.query`) decodes nothing unless a reply is not one of them.
"""

from __future__ import annotations

import _socket
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


QUERY_FRAME = b'{"type":"query"}\n'
"""`QueryRequest()` as `imexd.sim.protocol.encode` writes it."""
QUERY_REPLIES = {b'{"type":"query","state":"%s"}\n' % s.encode(): s for s in NodeState}
"""Every `QueryReply` as the simulated daemon writes it, to its state."""


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
