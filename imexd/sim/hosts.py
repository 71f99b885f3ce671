"""Names to addresses, exactly as both simulated tools resolve them.

The real ctl resolves the node list's entries as the daemon does, so both read them
here: a per-node hosts file (IMEXD_SIM_HOSTS_FILE) or the system resolver, and the
sentinel address that neither dials. `imexd-sim-ctl -N` imports this module at every one
of the agent's domain probes, so it imports only the C socket module and `ipaddress`
only for what is not a dotted quad.
"""

from __future__ import annotations

import _socket
import os
from collections.abc import Iterable, Mapping

from imexd.sim.cfgfile import is_ip

SENTINEL_ADDRESS = "127.0.0.2"
"""Where imexd points empty slots; the simulator never dials it (see `dialable`)."""
HOSTS_FILE_VARIABLE = "IMEXD_SIM_HOSTS_FILE"


def hosts_file_from_environ(environ: Mapping[str, str] | None = None) -> str | None:
    """IMEXD_SIM_HOSTS_FILE: the one knob the ctl reads, to resolve names as the daemon."""
    env = os.environ if environ is None else environ
    return env.get(HOSTS_FILE_VARIABLE, "").strip() or None


def same_address(a: str, b: str) -> bool:
    """Addresses compared as addresses (`::1` equals `0:0:0:0:0:0:0:1`)."""
    if a == b:
        return True
    if _quad(a) and _quad(b):  # `is_ip` takes no leading zeros: one spelling each
        return False
    import ipaddress  # noqa: PLC0415 - lazy: IPv6 and names only

    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


def _quad(text: str) -> bool:
    return text.count(".") == 3 and is_ip(text)


def dialable(address: str | None) -> bool:
    """Whether a daemon should ever connect to, or a ctl query, this address.

    The real daemon dials the sentinel too and is refused forever; skipping it gives
    the same NEVER_CONNECTED cell without 17 refused connections per node every 3 s.
    """
    return address is not None and not same_address(address, SENTINEL_ADDRESS)


def parse_hosts(text: str) -> dict[str, str]:
    """/etc/hosts format: `address name [alias...]`; the first address for a name wins."""
    table: dict[str, str] = {}
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) < 2 or not is_ip(words[0]):
            continue
        for name in words[1:]:
            table.setdefault(name.lower(), words[0])
    return table


def read_hosts(path: str) -> dict[str, str]:
    """The table of a hosts file; unreadable = empty (every name unresolved).

    Read synchronously even from the event loop: a local file of a few hundred bytes
    costs less than a hop to a thread.
    """
    try:
        with open(path, encoding="utf-8") as file:
            return parse_hosts(file.read())
    except (OSError, UnicodeDecodeError):
        return {}


class Resolver:
    """Host names to addresses: the hosts file in IMEXD_SIM_HOSTS_FILE, else the system.

    With a hosts file nothing else is asked (no DNS), so each simulated node sees only
    its own /etc/hosts stand-in; the file is read again at every `resolve` so that a
    SIGUSR1 picks up what the agent rewrote.
    """

    def __init__(self, hosts_file: str | None) -> None:
        self.hosts_file = hosts_file

    async def resolve(self, entries: Iterable[str]) -> list[str | None]:
        """The address of each entry (itself when it is one), or None when unknown."""
        entries = list(entries)
        if self.hosts_file is not None:
            return self._from_file(self.hosts_file, entries)
        import asyncio  # noqa: PLC0415 - lazy: `imexd-sim-ctl` runs without asyncio

        return list(await asyncio.gather(*(self._system(e) for e in entries)))

    def resolve_blocking(self, entries: Iterable[str]) -> list[str | None]:
        """`resolve` without an event loop (`imexd-sim-ctl -N`): the system resolver is
        asked one entry after another."""
        entries = list(entries)
        if self.hosts_file is not None:
            return self._from_file(self.hosts_file, entries)
        return [self._system_blocking(e) for e in entries]

    @staticmethod
    def _from_file(path: str, entries: list[str]) -> list[str | None]:
        """Each entry through the hosts file at `path` (read now), an address as itself."""
        table = read_hosts(path)
        return [e if is_ip(e) else table.get(e.lower()) for e in entries]

    @staticmethod
    def _system_blocking(entry: str) -> str | None:
        if is_ip(entry):
            return entry
        try:
            infos = _socket.getaddrinfo(entry, None, 0, _socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return None
        return str(infos[0][4][0]) if infos else None

    @staticmethod
    async def _system(entry: str) -> str | None:
        import asyncio  # noqa: PLC0415 - see resolve

        if is_ip(entry):
            return entry
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                entry, None, type=_socket.SOCK_STREAM
            )
        except (OSError, UnicodeError):
            return None
        return str(infos[0][4][0]) if infos else None
