"""config.cfg as both simulated tools read it: `KEY=value` lines, checked key by key.

Kept apart from `imexd.sim.config` (which adds the node list, names and identity)
because `imexd-sim-ctl -q` reads config.cfg at every one of the agent's probes: this
module imports only what that needs, so the simulated ctl costs about what a small C
program's start costs, like the real one. Every failure is an `ImexConfigError` whose
message is the exact line the real tool prints.
"""

from __future__ import annotations

from collections.abc import Mapping

from imexd.errors import ImexdError

DEFAULT_CONFIG_PATH = "/etc/nvidia-imex/config.cfg"
DEFAULT_NODES_PATH = "/etc/nvidia-imex/nodes_config.cfg"
DEFAULT_LOG_FILE = "/var/log/nvidia-imex.log"
DEFAULT_SERVER_PORT = 50000
DEFAULT_CMD_PORT = 50005

USAGE = (
    "Usage: nvidia-imex-ctl [-i <IP> <PORT>|-u <unix domain socket path>|"
    "-c <nvidia-imex config.cfg path>] <-n|-N|-q|-s|-d|-m> [-t <timeout>]"
)


class ImexConfigError(ImexdError):
    """A file or setting the simulated tools cannot use; the message is printed as is."""


_BOOL_KEYS = {
    "LOG_APPEND_TO_LOG": "log_append",
    "DAEMONIZE": "daemonize",
    "IMEX_ENABLE_AUTH_ENCRYPTION": "auth_encryption",
    "IMEX_CMD_ENABLED": "cmd_enabled",
}
_PORT_KEYS = {"SERVER_PORT": "server_port", "IMEX_CMD_PORT": "cmd_port"}
_STR_KEYS = {
    "LOG_FILE_NAME": "log_file_name",
    "BIND_INTERFACE_IP": "bind_interface_ip",
    "IMEX_NODE_CONFIG_FILE": "node_config_file",
    "IMEX_CMD_BIND_INTERFACE_IP": "cmd_bind_interface_ip",
    "IMEX_CMD_UNIX_DOMAIN_PATH": "cmd_unix_domain_path",
}


def is_ip(text: str) -> bool:
    """An IPv4 or IPv6 literal, as nodes_config.cfg and config.cfg may hold.

    A dotted quad that `ipaddress` would take is recognised here, so that `ctl -q`
    reading config.cfg does not import it; anything else is its verdict."""
    octets = text.split(".")
    if len(octets) == 4 and all(_octet(o) for o in octets):
        return True
    import ipaddress  # noqa: PLC0415 - lazy: IPv6 and the refusals only

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _octet(text: str) -> bool:
    """0 to 255 in ASCII decimal, without a leading zero (as `ipaddress` requires)."""
    return (
        0 < len(text) <= 3
        and text.isascii()
        and text.isdigit()
        and (text == "0" or text[0] != "0")
        and int(text) <= 255
    )


def parse_config_text(text: str, path: str) -> dict[str, str]:
    """`KEY=value` lines; `#` comments and blank lines are skipped; the last key wins."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ImexConfigError(f"Invalid line {number} in configuration file {path}: {raw}")
        values[key.strip()] = value.strip()
    return values


def read_config(path: str) -> dict[str, str]:
    """The keys of the config.cfg at `path`; a missing file fails like `nvidia-imex-ctl`."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError):
        raise ImexConfigError(f"Unable to open configuration file at {path}") from None
    return parse_config_text(text, path)


def check_values(values: Mapping[str, str], path: str) -> dict[str, bool | int | str]:
    """Validate the keys the simulator uses: the fields of `ImexConfig` that they set
    (`imexd.sim.config`). Unknown keys are ignored."""
    fields: dict[str, bool | int | str] = {}

    def bad(key: str, expected: str) -> ImexConfigError:
        return ImexConfigError(
            f"Invalid value '{values[key]}' for {key} in configuration file {path}: "
            f"expected {expected}"
        )

    for key, value in values.items():
        if key in _BOOL_KEYS:
            if value not in ("0", "1"):
                raise bad(key, "0 or 1")
            fields[_BOOL_KEYS[key]] = value == "1"
        elif key in _PORT_KEYS:
            if not value.isdigit() or not 1 <= int(value) <= 65535:
                raise bad(key, "a port 1..65535")
            fields[_PORT_KEYS[key]] = int(value)
        elif key in _STR_KEYS:
            fields[_STR_KEYS[key]] = value
        elif key == "LOG_LEVEL":
            if value not in ("0", "1", "2", "3", "4"):
                raise bad(key, "0..4")
            fields["log_level"] = int(value)
        elif key == "IMEX_WAIT_FOR_QUORUM":
            if value not in ("RECOVERY", "NONE"):
                raise bad(key, "RECOVERY or NONE")
            fields["wait_for_quorum"] = value
        elif key == "IMEX_NODE_DISCONNECTED_GRACE_TIME":
            try:
                grace = int(value)
            except ValueError:
                raise bad(key, "-1, 0 or a number of seconds") from None
            if grace < -1:
                raise bad(key, "-1, 0 or a number of seconds")
            fields["disconnected_grace_time"] = grace
    for key in ("BIND_INTERFACE_IP", "IMEX_CMD_BIND_INTERFACE_IP"):
        if values.get(key) and not is_ip(values[key]):
            raise bad(key, "an IPv4 or IPv6 address, or empty")
    return fields
