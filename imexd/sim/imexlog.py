"""IMEX's own log format, so the agent's log capture sees what it will see in production.

`[Sep 18 2026 06:40:33] [INFO] [tid 77] message` lines to LOG_FILE_NAME, or to stderr
after the two-line preamble the real daemon prints when that file cannot be opened.
The file starts with `IMEX Log initializing at: <clock>` and a configuration block.
LOG_LEVEL filters: 0 off, 1 fatal, 2 error, 3 warning, 4 info. Rotation is not
modelled.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import TextIO

from imexd.sim.config import ImexConfig
from imexd.sim.table import format_timestamp

LEVELS = {"FATAL": 1, "ERROR": 2, "WARNING": 3, "INFO": 4}


def format_line(level: str, message: str, at: float | None = None) -> str:
    """One log line, without its newline."""
    stamp = time.strftime("%b %d %Y %H:%M:%S", time.localtime(at))
    return f"[{stamp}] [{level}] [tid {threading.get_native_id()}] {message}"


class ImexLog:
    """A line-buffered IMEX log on a file or stderr."""

    def __init__(self, stream: TextIO, level: int) -> None:
        self.stream = stream
        self.level = level

    @property
    def to_stderr(self) -> bool:
        """Whether lines already reach stderr (so errors need not be printed twice)."""
        return self.stream is sys.stderr

    @classmethod
    def open(cls, cfg: ImexConfig, version: str) -> ImexLog:
        """Open LOG_FILE_NAME (stderr when empty or unopenable) and write the header."""
        stream: TextIO = sys.stderr
        if cfg.log_file_name:
            try:
                stream = open(  # noqa: SIM115 - the log lives as long as the process
                    cfg.log_file_name, "a" if cfg.log_append else "w", buffering=1, encoding="utf-8"
                )
            except OSError as exc:
                reason = exc.strerror or str(exc)
                print(f"WARNING: failed to open IMEX log file errno = {reason}", file=sys.stderr)
                print("INFO: using stderr for IMEX logging", file=sys.stderr)
        else:
            print(
                "WARNING: failed to open IMEX log file errno = " + os.strerror(2), file=sys.stderr
            )
            print("INFO: using stderr for IMEX logging", file=sys.stderr)
        log = cls(stream, cfg.log_level)
        log.header(cfg, version)
        return log

    def header(self, cfg: ImexConfig, version: str) -> None:
        """The first lines of every run, like the real daemon's configuration block."""
        if self.level <= 0:
            return
        self.stream.write(f"IMEX Log initializing at: {format_timestamp(time.time())}\n")
        self.info(f"IMEX version {version} is running with the following configuration options:")
        self.info(f"Logging level = {cfg.log_level}")
        self.info(f"Logging file name/path = {cfg.log_file_name}")
        self.info(f"Append to log file = {int(cfg.log_append)}")
        self.info(f"Run in background = {int(cfg.daemonize)}")
        self.info(f"IMEX Library communication bind interface = {cfg.bind_interface_ip}")
        self.info(f"IMEX library communication bind port = {cfg.server_port}")
        self.info(f"Node config file = {cfg.node_config_file}")
        self.info(f"Wait for quorum = {cfg.wait_for_quorum}")
        self.info(f"Enable authentication and encryption = {int(cfg.auth_encryption)}")
        self.info(f"Enable IMEX command service = {int(cfg.cmd_enabled)}")
        self.info(f"IMEX command service bind interface = {cfg.cmd_bind_interface_ip}")
        self.info(f"IMEX command service port = {cfg.cmd_port}")
        self.info(f"IMEX command service unix domain path = {cfg.cmd_unix_domain_path}")
        self.info(f"Node disconnected grace time = {cfg.disconnected_grace_time}")

    def write(self, level: str, message: str) -> None:
        """Log `message` at `level` (FATAL, ERROR, WARNING, INFO) when LOG_LEVEL allows."""
        if LEVELS[level] > self.level:
            return
        # A full disk or a closed stderr must not take the daemon down.
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(format_line(level, message) + "\n")

    def info(self, message: str) -> None:
        self.write("INFO", message)

    def warning(self, message: str) -> None:
        self.write("WARNING", message)

    def error(self, message: str) -> None:
        self.write("ERROR", message)

    def flush(self) -> None:
        """Before fork() and os._exit(), which skip Python's own flushing."""
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()
