"""Helpers shared by the tests: free ports, loopback addresses, a real Mosquitto broker.

Everything here talks to 127.0.0.0/8 only, and every wait is bounded in time.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

_addr_counter = itertools.count(1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def loopback_address() -> str:
    """A fresh 127.x.y.z address, distinct per test and per concurrent pytest process."""
    n = next(_addr_counter)
    second = 10 + os.getpid() % 240
    return f"127.{second}.{n // 250 % 250}.{n % 250 + 2}"


def wait_for(
    predicate: Callable[[], object], *, timeout: float = 10.0, interval: float = 0.05
) -> None:
    """Poll `predicate` until it is truthy; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None
    )
    if found is None:
        raise RuntimeError("mosquitto is not installed (scripts/test installs it)")
    return found


class Broker:
    """A real Mosquitto on a free loopback port (and optionally a Unix socket).

    `stop()`/`start()` restart it on the same port; `persistence` decides whether the
    retained state survives a restart.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        persistence: bool = False,
        extra_config: str = "",
        unix_socket: bool = False,
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.port = free_port()
        self.socket_path = str(workdir / "mqtt.sock") if unix_socket else None
        self.persistence = persistence
        self.extra_config = extra_config
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def unix_url(self) -> str:
        assert self.socket_path is not None
        return f"unix://{self.socket_path}"

    def config_text(self) -> str:
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {self.workdir}/",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "max_keepalive 65535",
        ]
        if not any(line.split()[:1] == ["user"] for line in self.extra_config.splitlines()):
            # As root Mosquitto drops to the mosquitto user, which cannot read files in
            # pytest's private tmp dirs (sockets, ACLs, certificates); ignored otherwise.
            # Mosquitto refuses a second `user` line, so an extra config may set its own.
            lines.append("user root")
        if self.socket_path:
            lines += [f"listener 0 {self.socket_path}", "allow_anonymous true"]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self, *, timeout: float = 10.0) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self.config_text())
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("mosquitto did not start listening in time") from None
                time.sleep(0.05)

    def stop(self, *, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
