"""systemd's sd_notify protocol, without libsystemd or any other dependency.

The agent is a `Type=notify` service: it says READY=1 once it runs (not once the
domain is UP: a node waiting for peers is a working agent), STATUS= with a one-line
summary whenever that changes, WATCHDOG=1 from its main loop, and STOPPING=1 on
shutdown. Messages are datagrams on the AF_UNIX socket named by NOTIFY_SOCKET (a path,
or `@name` for the abstract namespace). Outside systemd NOTIFY_SOCKET is unset and every
call is a no-op. Notification is advisory: a failure is logged once and never raised
into the agent, which must not stop supervising IMEX because systemd went away.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Final

from imexd.logs import get_logger

STATUS_MAX: Final = 1000
"""Characters of STATUS= text kept (systemd shows one line in `systemctl status`)."""

_log = get_logger("sdnotify")


def _socket_address(value: str) -> str | None:
    """The sendto() address for a NOTIFY_SOCKET value; None for unsupported forms."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # vsock: and other forms are not used for services on a host


class Notifier:
    """Sends sd_notify messages to one socket; a no-op when `address` is None."""

    def __init__(self, address: str | None = None, *, watchdog_usec: int | None = None) -> None:
        self._raw = address
        self._address = _socket_address(address) if address else None
        self._watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._last_status: str | None = None
        self._warned = False
        if address and self._address is None:
            self._warn("unsupported NOTIFY_SOCKET", value=address)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, pid: int | None = None
    ) -> Notifier:
        """The notifier systemd asked for through the environment.

        The watchdog applies only when WATCHDOG_PID is unset or names this process
        (systemd sets it so that children do not answer in the parent's name).
        """
        env = os.environ if environ is None else environ
        me = os.getpid() if pid is None else pid
        usec: int | None = None
        text = env.get("WATCHDOG_USEC", "")
        owner = env.get("WATCHDOG_PID", "")
        if text.isdigit() and int(text) > 0 and (not owner or owner == str(me)):
            usec = int(text)
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), None without one."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def ready(self) -> bool:
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """Send STATUS= when `text` differs from the last one sent; True if sent."""
        line = " ".join(text.split())[:STATUS_MAX]
        if line == self._last_status:
            return False
        sent = self.notify(f"STATUS={line}")
        if sent:
            self._last_status = line
        return sent

    def watchdog(self) -> bool:
        if self._watchdog_usec is None:
            return False
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def notify(self, message: str) -> bool:
        """Send one datagram of newline-separated assignments; True when it went out."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(message.encode(), self._address)
        except OSError as exc:
            self._warn("sd_notify failed", error=str(exc), message=message.split("=", 1)[0])
            self.close()
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _warn(self, event: str, **fields: str) -> None:
        # Log the first problem only: the watchdog would repeat it every few seconds.
        if self._warned:
            return
        self._warned = True
        _log.warning(event, socket=self._raw, **fields)
