"""sd_notify against real AF_UNIX datagram sockets, path and abstract."""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from imexd.health.sdnotify import Notifier


class Listener:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value

    def receive(self) -> str:
        return self.sock.recv(4096).decode()

    def pending(self) -> list[str]:
        out: list[str] = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            return out
        finally:
            self.sock.setblocking(True)


@pytest.fixture
def path_listener() -> Iterator[Listener]:
    """A notify socket at a short file path (sun_path is limited to 108 bytes)."""
    folder = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    try:
        yield Listener(sock, path)
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(folder)


@pytest.fixture
def abstract_listener() -> Iterator[Listener]:
    """A notify socket in the abstract namespace, as systemd --user may use."""
    name = f"imexd-test-{secrets.token_hex(6)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    try:
        yield Listener(sock, "@" + name)
    finally:
        sock.close()


def test_lifecycle_messages_reach_a_path_socket(path_listener: Listener) -> None:
    """READY, STATUS, WATCHDOG and STOPPING arrive as separate datagrams."""
    n = Notifier.from_env({"NOTIFY_SOCKET": path_listener.env_value, "WATCHDOG_USEC": "4000000"})
    assert n.enabled
    assert n.ready()
    assert n.status("ready: d1 slot 0")
    assert n.watchdog()
    assert n.stopping()
    got = [path_listener.receive() for _ in range(4)]
    assert got == ["READY=1", "STATUS=ready: d1 slot 0", "WATCHDOG=1", "STOPPING=1"]
    n.close()


def test_abstract_socket_form(abstract_listener: Listener) -> None:
    """A NOTIFY_SOCKET starting with @ addresses the abstract namespace."""
    n = Notifier.from_env({"NOTIFY_SOCKET": abstract_listener.env_value})
    assert n.ready()
    assert abstract_listener.receive() == "READY=1"
    n.close()


def test_status_is_sent_only_on_change_and_on_one_line(path_listener: Listener) -> None:
    """A repeated STATUS is not resent, and newlines never split the line."""
    n = Notifier(path_listener.env_value)
    assert n.status("not ready:\nDaemonReady=False")
    assert not n.status("not ready: DaemonReady=False")
    assert n.status("ready")
    assert path_listener.receive() == "STATUS=not ready: DaemonReady=False"
    assert path_listener.receive() == "STATUS=ready"
    assert path_listener.pending() == []
    n.close()


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    """WATCHDOG_USEC=10 s means a ping every 5 s, when it is meant for this process."""
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "10000000"}
    assert Notifier.from_env(env, pid=42).watchdog_interval() == 5.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": "42"}, pid=42).watchdog_interval() == 5.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": "7"}, pid=42).watchdog_interval() is None
    assert Notifier.from_env({**env, "WATCHDOG_USEC": "soon"}).watchdog_interval() is None
    assert Notifier.from_env({"NOTIFY_SOCKET": "/run/x"}).watchdog_interval() is None


def test_without_notify_socket_everything_is_a_no_op() -> None:
    """Outside systemd nothing is sent and nothing fails."""
    n = Notifier.from_env({})
    assert not n.enabled
    assert not n.ready()
    assert not n.status("x")
    assert not n.watchdog()
    assert not n.stopping()


def test_failures_never_raise_and_are_logged_once(tmp_path: Path) -> None:
    """A vanished socket makes calls return False, with a single warning."""
    n = Notifier(str(tmp_path / "gone"), watchdog_usec=1_000_000)
    with structlog.testing.capture_logs() as logs:
        assert not n.ready()
        assert not n.watchdog()
        assert not n.status("x")
    assert [e["event"] for e in logs] == ["sd_notify failed"]
    assert logs[0]["log_level"] == "warning"


def test_status_is_retried_after_a_failure(tmp_path: Path) -> None:
    """A STATUS that failed to send is sent again once the socket exists."""
    path = str(tmp_path / "late")
    n = Notifier(path)
    with structlog.testing.capture_logs():
        assert not n.status("ready")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
        sock.settimeout(2.0)
        assert n.status("ready")
        assert sock.recv(100) == b"STATUS=ready"
    finally:
        sock.close()
        n.close()


def test_unsupported_socket_form_is_disabled_with_a_warning() -> None:
    """A vsock NOTIFY_SOCKET is not used for host services: disabled, logged."""
    with structlog.testing.capture_logs() as logs:
        n = Notifier("vsock:2:1234")
        assert not n.enabled
        assert not n.ready()
    assert [e["event"] for e in logs] == ["unsupported NOTIFY_SOCKET"]
