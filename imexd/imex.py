"""What IMEX is: its state words, its config keys and defaults, its ports, the sentinel.

Facts about `nvidia-imex` and `nvidia-imex-ctl` that several modules answer questions
with (the probe's parsers, the renderer, the settings' checks, the wire's address
check, the supervisor's process survey). They live in this leaf, which imports nothing
from imexd, so that none of those modules has to import another for a constant, and so
that a newer driver's word or key is added in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class ImexState(StrEnum):
    """The words `nvidia-imex-ctl -q` prints (IMEX.md), and a node's status in `-N`."""

    INITIALIZING = "INITIALIZING"
    STARTING_AUTH_SERVER = "STARTING_AUTH_SERVER"
    WAITING_FOR_PEERS = "WAITING_FOR_PEERS"
    WAITING_FOR_RECOVERY = "WAITING_FOR_RECOVERY"
    INIT_GPU = "INIT_GPU"
    READY = "READY"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNAVAILABLE = "UNAVAILABLE"


class ImexDomainState(StrEnum):
    """IMEX's own verdict on the domain (`Domain State:` / `"status"`).

    Not imexd's judgement (`fleet.DomainState`): IMEX counts the empty slots of names
    mode as unavailable, so it reads DEGRADED until every slot is filled.
    """

    UP = "UP"
    DEGRADED = "DEGRADED"
    DOWN = "DOWN"


class ConnectionState(StrEnum):
    """One cell of the connectivity matrix: how node `from` sees node `to`.

    UNKNOWN stands for any word or cell this version does not know, so that a newer
    daemon (or the simulator) adding a status degrades the verdict instead of the parse.
    """

    CONNECTED = "CONNECTED"
    NEVER_CONNECTED = "NEVER_CONNECTED"
    INVALID = "INVALID"
    RECOVERING = "RECOVERING"
    DISCONNECTED = "DISCONNECTED"
    AUTHENTICATING = "AUTHENTICATING"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    MAP_MISMATCH = "MAP_MISMATCH"
    UNKNOWN = "UNKNOWN"


TEXT_CELLS: Mapping[str, ConnectionState] = MappingProxyType(
    {
        "C": ConnectionState.CONNECTED,
        "N": ConnectionState.NEVER_CONNECTED,
        "I": ConnectionState.INVALID,
        "R": ConnectionState.RECOVERING,
        "D": ConnectionState.DISCONNECTED,
        "A": ConnectionState.AUTHENTICATING,
        "!V!": ConnectionState.VERSION_MISMATCH,
        "!M!": ConnectionState.MAP_MISMATCH,
    }
)
"""The `-N` text legend: cell letter -> connection state."""

JSON_ALIASES: Mapping[str, ConnectionState] = MappingProxyType(
    {"NODE_MAP_MISMATCH": ConnectionState.MAP_MISMATCH}
)
"""Other spellings of connection words (the simulator's), read as the same state."""

SERVER_PORT: Final = 50000
"""IMEX's default SERVER_PORT (daemon-to-daemon)."""

CMD_PORT: Final = 50005
"""IMEX's default IMEX_CMD_PORT (what `nvidia-imex-ctl` asks)."""

DEFAULT_PORTS: Mapping[str, int] = MappingProxyType(
    {"SERVER_PORT": SERVER_PORT, "IMEX_CMD_PORT": CMD_PORT}
)
"""The port a config.cfg without the key listens on, by key."""

PACKAGE_CONFIG: Final = "/etc/nvidia-imex/config.cfg"
"""The config of the distribution's `nvidia-imex.service` (and the daemon's default `-c`)."""

EMPTY_SLOT_ADDRESS: Final = "127.0.0.2"
"""Where the host name of an empty slot points (render.py writes it), never a node's address.

An unresolvable name makes IMEX retry DNS for it forever; a loopback address nothing
listens on fails fast and locally instead. The wire's address check refuses it too, so
that no record can carry it.
"""

# The keys of config.cfg in the order NVIDIA's package file lists them, with IMEX's
# own defaults (IMEX.md); render.render_config says where imexd needs something else.
IMEX_DEFAULTS: Final[tuple[tuple[str, str], ...]] = (
    ("LOG_LEVEL", "4"),
    ("LOG_FILE_NAME", "/var/log/nvidia-imex.log"),
    ("STATS_FILE_NAME", "/var/log/nvidia-imex-stats.log"),
    ("LOG_APPEND_TO_LOG", "1"),
    ("LOG_FILE_MAX_SIZE", "1024"),
    ("LOG_MAX_ROTATE_COUNT", "3"),
    ("LOG_USE_SYSLOG", "0"),
    ("DAEMONIZE", "1"),
    ("BIND_INTERFACE_IP", ""),
    ("SERVER_PORT", str(SERVER_PORT)),
    ("IMEX_NODE_CONFIG_FILE", "/etc/nvidia-imex/nodes_config.cfg"),
    ("NETWORK_INTERFACE", ""),
    ("IMEX_WAIT_FOR_QUORUM", "RECOVERY"),
    ("IMEX_ENABLE_AUTH_ENCRYPTION", "0"),
    ("IMEX_AUTH_ENCRYPTION_MODE", "SSL_TLS"),
    ("IMEX_AUTH_SOURCE", ""),
    ("IMEX_SERVER_KEY", ""),
    ("IMEX_SERVER_CERT", ""),
    ("IMEX_SERVER_CERT_AUTH", ""),
    ("IMEX_CLIENT_KEY", ""),
    ("IMEX_CLIENT_CERT", ""),
    ("IMEX_CLIENT_CERT_AUTH", ""),
    ("IMEX_SECURITY_TARGET_OVERRIDE", ""),
    ("IMEX_GSS_SERVICE_NAME", "host"),
    ("IMEX_GSS_TIMEOUT_SEC", "-1"),
    ("IMEX_GSS_RETRY_INTERVAL_SEC", "5"),
    ("IMEX_GSS_SEC_CONTEXT_LIFETIME_SEC", "-1"),
    ("IMEX_GSS_SHUTDOWN_ON_FAILURE", "1"),
    ("IMEX_CMD_ENABLED", "1"),
    ("IMEX_CMD_BIND_INTERFACE_IP", ""),
    ("IMEX_CMD_PORT", str(CMD_PORT)),
    ("IMEX_CMD_UNIX_DOMAIN_PATH", ""),
    ("IMEX_NODE_DISCONNECTED_GRACE_TIME", "-1"),
)

RESERVED_KEYS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "DAEMONIZE": "the agent supervises a foreground daemon; a forked one escapes it",
        "BIND_INTERFACE_IP": "set node.address (peers learn it from the member record)",
        "SERVER_PORT": "set imex.server_port",
        "IMEX_CMD_PORT": "set imex.cmd_port (the probes use it)",
        "IMEX_CMD_ENABLED": "the agent's probes need the command service",
        "IMEX_NODE_CONFIG_FILE": (
            "the agent writes the node list at <imex.run_dir>/nodes_config.cfg"
        ),
    }
)
"""config.cfg keys the agent owns: `[imex] extra` may not override them, each with why."""


def check_extra(extra: Mapping[str, str]) -> list[str]:
    """Problems with `[imex] extra`, one line per reserved key it sets (empty: fine).

    Settings validation calls this so a wrong key is reported at load, and the renderer
    again so no caller can render one.
    """
    return [
        f"imex.extra.{key} = {extra[key]!r}: the agent owns {key}: {why}"
        for key, why in RESERVED_KEYS.items()
        if key in extra
    ]
