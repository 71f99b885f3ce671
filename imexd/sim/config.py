"""What both simulated tools read: config.cfg, nodes_config.cfg, names and the environment.

The daemon and the ctl must agree on every rule here (the real ctl resolves names
exactly as the daemon does), so the rules live in one module: config.cfg with IMEX's
defaults (its keys are read and checked by `imexd.sim.cfgfile`, which `-q` imports
alone), the node list and its digest, the node's own identity, and the `IMEXD_SIM_*`
knobs; names are resolved in `imexd.sim.hosts`, which `-N` imports alone. Every
failure is an `ImexConfigError` whose message is the exact line the real tool prints,
so the CLI layer only prints it and exits 1.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from imexd.sim.cfgfile import (
    DEFAULT_CMD_PORT,
    DEFAULT_LOG_FILE,
    DEFAULT_NODES_PATH,
    DEFAULT_SERVER_PORT,
    ImexConfigError,
    check_values,
    read_config,
)
from imexd.sim.hosts import same_address

DEFAULT_VERSION = "570.172"
NO_GPU_VERSION = "NO_GPU"
STATE_FILE_NAME = "imexd-sim-persist.json"
"""The stand-in for /var/run/nvidia-imex/persist.dat, kept in IMEXD_SIM_STATE_DIR."""


# config.cfg


@dataclass(frozen=True, kw_only=True)
class ImexConfig:
    """The config.cfg keys the simulator acts on, with nvidia-imex's defaults."""

    path: str
    """Where the file was read; its folder is the default state dir."""
    values: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Every key as written, for the start-up configuration block of the log."""
    log_level: int = 4
    """0 off, 1 fatal, 2 error, 3 warning, 4 info."""
    log_file_name: str = DEFAULT_LOG_FILE
    """Empty or unopenable: log to stderr."""
    log_append: bool = True
    daemonize: bool = True
    """1 = fork into the background like the packaged service; imexd writes 0."""
    bind_interface_ip: str = ""
    """Empty: the node list entry that is an address of a local interface."""
    server_port: int = DEFAULT_SERVER_PORT
    node_config_file: str = DEFAULT_NODES_PATH
    wait_for_quorum: str = "RECOVERY"
    """RECOVERY: wait for former peers after an unclean exit; NONE: never wait."""
    auth_encryption: bool = False
    """Accepted, not modelled: peer links are plain TCP."""
    cmd_enabled: bool = True
    cmd_bind_interface_ip: str = ""
    """Empty: all interfaces."""
    cmd_port: int = DEFAULT_CMD_PORT
    cmd_unix_domain_path: str = ""
    """Non-empty: the command service listens on this Unix socket instead of TCP."""
    disconnected_grace_time: int = -1
    """Seconds a lost peer stays RECOVERING before cleanup (DISCONNECTED); -1 never."""


def config_from_values(values: Mapping[str, str], path: str) -> ImexConfig:
    """Validate the keys the simulator uses (`imexd.sim.cfgfile.check_values`); unknown
    keys are kept but ignored."""
    fields: dict[str, Any] = check_values(values, path)
    return ImexConfig(path=path, values=MappingProxyType(dict(values)), **fields)


def load_config(path: str) -> ImexConfig:
    """Read and validate config.cfg; a missing file fails like `nvidia-imex-ctl` does."""
    return config_from_values(read_config(path), path)


# nodes_config.cfg


def read_node_list(path: str) -> list[str]:
    """One address or host name per line; blank and `#` lines are skipped.

    The index of an entry among the others is its IMEX node id. The real file format
    documents neither comments nor blank lines; imexd never writes them.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise ImexConfigError(f"Failed to read node configuration file {path}") from None
    entries = [line.strip() for line in text.splitlines()]
    entries = [e for e in entries if e and not e.startswith("#")]
    if not entries:
        raise ImexConfigError(f"Failed to read node configuration file {path}")
    return entries


def node_list_digest(entries: Iterable[str]) -> str:
    """Equal on two nodes exactly when their node lists are equal, in the same order."""
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


# Names


def local_addresses() -> set[str]:
    """Addresses of this host's interfaces (psutil), for an empty BIND_INTERFACE_IP."""
    import psutil  # noqa: PLC0415 - only needed when BIND_INTERFACE_IP is empty

    found: set[str] = set()
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                found.add(addr.address.split("%", 1)[0])
    return found


def find_identity(
    addresses: list[str | None], bind_ip: str, local: Iterable[str] = ()
) -> int | None:
    """The first entry that resolves to BIND_INTERFACE_IP, or to a local address."""
    wanted = [bind_ip] if bind_ip else list(local)
    for index, address in enumerate(addresses):
        if address is not None and any(same_address(address, w) for w in wanted):
            return index
    return None


# The environment


@dataclass(frozen=True, kw_only=True)
class SimEnv:
    """The `IMEXD_SIM_*` knobs: test speed-ups and fault injection (docs/simulator.md)."""

    version: str = DEFAULT_VERSION
    """IMEXD_SIM_VERSION: what `--version`, the log and `-N` report."""
    hosts_file: str | None = None
    """IMEXD_SIM_HOSTS_FILE: resolve names only through this hosts file."""
    state_dir: str | None = None
    """IMEXD_SIM_STATE_DIR: folder of the recovery state; default the config's folder."""
    signal_log: str | None = None
    """IMEXD_SIM_SIGNAL_LOG: append `<time> <SIGNAME> honoured|ignored|early` per signal."""
    reload_window_s: float = 5.0
    """IMEXD_SIM_RELOAD_WINDOW_S: SIGUSR1 is honoured at most once per this window."""
    start_delay_s: float = 0.0
    """IMEXD_SIM_START_DELAY_S: seconds spent INITIALIZING."""
    recovery_timeout_s: float = 10.0
    """IMEXD_SIM_RECOVERY_TIMEOUT_S: longest WAITING_FOR_RECOVERY."""
    exit_after_s: float | None = None
    """IMEXD_SIM_EXIT_AFTER_S: exit (like a crash) after this long; 0 = at start."""
    exit_code: int = 1
    """IMEXD_SIM_EXIT_CODE: the code of that exit."""
    abort_after_s: float | None = None
    """IMEXD_SIM_ABORT_AFTER_S: die by SIGABRT after this long."""
    ignore_sigterm: bool = False
    """IMEXD_SIM_IGNORE_SIGTERM=1: SIGTERM, SIGINT and SIGQUIT are ignored."""
    cmd_hang: bool = False
    """IMEXD_SIM_CMD_HANG=1: the command service accepts and never answers."""
    heartbeat_s: float = 0.5
    """IMEXD_SIM_HEARTBEAT_S: interval of peer heartbeats."""
    peer_timeout_s: float = 1.5
    """IMEXD_SIM_PEER_TIMEOUT_S: silence after which a peer counts as lost."""
    retry_max_s: float = 3.0
    """IMEXD_SIM_RETRY_MAX_S: cap of the reconnect backoff (it starts at 0.5 s)."""
    identify_as: int | None = None
    """IMEXD_SIM_IDENTIFY_AS: the node id logged in `Identified this node as ID <n>`
    instead of the real one (the fault an agent's identity check must catch)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SimEnv:
        """Read and check every knob; a bad one is an error naming it."""
        env = os.environ if environ is None else environ

        def text(name: str) -> str | None:
            value = env.get(f"IMEXD_SIM_{name}", "").strip()
            return value or None

        def seconds(name: str, default: float | None) -> float | None:
            value = text(name)
            if value is None:
                return default
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if not math.isfinite(number) or number < 0:
                raise ImexConfigError(f"IMEXD_SIM_{name}={value}: expected seconds >= 0")
            return number

        def flag(name: str) -> bool:
            return text(name) in ("1", "true", "yes")

        identify_text = text("IDENTIFY_AS")
        if identify_text is not None and not identify_text.isdigit():
            raise ImexConfigError(f"IMEXD_SIM_IDENTIFY_AS={identify_text}: expected a node id >= 0")
        code_text = text("EXIT_CODE") or "1"
        if not code_text.isdigit() or int(code_text) > 255:
            raise ImexConfigError(f"IMEXD_SIM_EXIT_CODE={code_text}: expected 0..255")
        return cls(
            version=text("VERSION") or DEFAULT_VERSION,
            hosts_file=text("HOSTS_FILE"),
            state_dir=text("STATE_DIR"),
            signal_log=text("SIGNAL_LOG"),
            reload_window_s=seconds("RELOAD_WINDOW_S", 5.0) or 0.0,
            start_delay_s=seconds("START_DELAY_S", 0.0) or 0.0,
            recovery_timeout_s=seconds("RECOVERY_TIMEOUT_S", 10.0) or 0.0,
            exit_after_s=seconds("EXIT_AFTER_S", None),
            exit_code=int(code_text),
            abort_after_s=seconds("ABORT_AFTER_S", None),
            ignore_sigterm=flag("IGNORE_SIGTERM"),
            cmd_hang=flag("CMD_HANG"),
            heartbeat_s=max(0.05, seconds("HEARTBEAT_S", 0.5) or 0.0),
            peer_timeout_s=max(0.1, seconds("PEER_TIMEOUT_S", 1.5) or 0.0),
            retry_max_s=max(0.5, seconds("RETRY_MAX_S", 3.0) or 0.0),
            identify_as=int(identify_text) if identify_text is not None else None,
        )
