"""Settings: a TOML file plus `IMEXD_<SECTION>_<KEY>` environment overrides.

Everything is validated once, at load, into frozen dataclasses grouped by section. A
wrong key, type or value is reported together with every other wrong key, each naming
the key, the value found and what was expected (`ConfigError`); the CLI exits 2 on it.
Each field's docstring-like `doc` metadata states its unit, default and why; the
shipped `config/imexd.toml` and `docs/configuration.md` list every one of them.

One piece because the loader walks the declaration of every setting field by field; the
text forms of the same table (example file, reference) are in `imexd.settings_text`.
"""

from __future__ import annotations

import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

from imexd.errors import ConfigError
from imexd.imex import CMD_PORT, SERVER_PORT, check_extra
from imexd.messages import Mode, address_problem
from imexd.names import is_clique_id, is_dns1123_label, is_dns1123_subdomain

BrokerProfile = Literal["auto", "mosquitto", "nats"]
"""`[bus] broker`: which links get the broker repairs (`imexd.bus.repairs`)."""

LogFormat = Literal["auto", "json", "console"]
"""`[log] format`: "auto" is JSON lines off a terminal, the console renderer on one."""
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
"""Here and not in imexd.logs, so that loading settings does not import structlog: the
control-plane commands run as short processes (a Slurm prolog runs two) and pay for every
import."""

DEFAULT_CONFIG_PATH = "/etc/imexd/imexd.toml"
ENV_PREFIX = "IMEXD_"

UNIT_TIMEOUT_STOP_S = 30.0
"""TimeoutStopSec= of the shipped systemd/imexd.service (a test keeps them equal): the
default of [daemon] service_stop_timeout_s."""
SHUTDOWN_MARGIN_S = 5.0
"""What the agent's bounded shutdown adds to [daemon] stop_timeout_s (clearing its
records, disconnecting); imexd.agent.run bounds its shutdown with the same value."""

CONFIG_KEY_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TOPIC_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*$")

Check = Callable[[Any], str | None]
"""A check returns None when the value is right, else what was expected."""


def _setting(default: Any, doc: str, check: Check | None = None) -> Any:
    meta = {"doc": doc, "check": check}
    if isinstance(default, dict):
        frozen = MappingProxyType(dict(default))
        return field(default_factory=lambda: frozen, metadata=meta)
    if isinstance(default, list):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


# Checks: each returns None or the description of what was expected.


def _nonneg(v: float) -> str | None:
    return None if v >= 0 else "a duration in seconds >= 0"


def _positive(v: float) -> str | None:
    return None if v > 0 else "a duration in seconds > 0"


def _port(v: int) -> str | None:
    return None if 1 <= v <= 65535 else "a TCP port 1..65535"


def _one_of(*choices: str) -> Check:
    def check(v: str) -> str | None:
        return None if v in choices else "one of " + ", ".join(f'"{c}"' for c in choices)

    return check


def _abs_path(v: str) -> str | None:
    return None if v.startswith("/") else "an absolute path"


def _opt_path(v: str) -> str | None:
    return None if v == v.strip() else "a file path without surrounding spaces, or empty"


def _nonempty(v: str) -> str | None:
    return None if v.strip() else "a non-empty string"


def _node_name(v: str) -> str | None:
    return None if is_dns1123_subdomain(v) else "a DNS-1123 subdomain (e.g. gpu-node-01.rack1)"


def _domain_name(v: str) -> str | None:
    return None if v == "" or is_dns1123_label(v) else "empty or a DNS-1123 label (e.g. job-42)"


def _address(v: str) -> str | None:
    """Peers accept only what `messages.address_problem` accepts: refuse the rest at load."""
    problem = address_problem(v) if v else None
    if problem is None:
        return None
    return f"empty (auto) or an IPv4/IPv6 address as peers accept it ({problem})"


def _clique(v: str) -> str | None:
    if v in ("auto", "") or is_clique_id(v):
        return None
    return '"auto", "" (no multi-node NVLink) or a clique id such as <cluster-uuid>.<clique-id>'


def _max_nodes(v: int) -> str | None:
    return None if 1 <= v <= 2048 else "an integer 1..2048"


def _positive_int(v: int) -> str | None:
    return None if v >= 1 else "an integer >= 1"


def _topic_prefix(v: str) -> str | None:
    if TOPIC_PREFIX_RE.match(v):
        return None
    return "topic levels of letters, digits, '-' and '_' (no '.', which NATS refuses), e.g. imex/v2"


def _listen(v: str) -> str | None:
    try:
        parse_listen(v)
    except ValueError:
        return "HOST:PORT with a port 0..65535, e.g. 127.0.0.1:9440 or [::1]:9440"
    return None


def _extra(v: Mapping[str, str]) -> str | None:
    for key, value in v.items():
        if not CONFIG_KEY_RE.match(key) or "\n" in value or "\r" in value:
            return "a table of UPPER_CASE config.cfg keys to one-line values"
    return None


def _env(v: Mapping[str, str]) -> str | None:
    for key, value in v.items():
        if not ENV_NAME_RE.match(key) or "\0" in value:
            return "a table of environment variable names to string values"
    return None


def parse_listen(value: str) -> tuple[str, int]:
    """Split `HOST:PORT` (IPv6 hosts in brackets) into host and port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(value)
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not 0 <= port <= 65535:
        raise ValueError(value)
    return host, port


@dataclass(frozen=True, slots=True)
class BrokerURL:
    """One broker address from `[bus] url`."""

    scheme: Literal["mqtt", "mqtts", "unix"]
    host: str
    port: int
    path: str

    @property
    def tls(self) -> bool:
        return self.scheme == "mqtts"

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_broker_url(value: str) -> BrokerURL:
    """Parse mqtt://host[:port], mqtts://host[:port] or unix:///path; ValueError if not."""
    parts = urlsplit(value)
    if parts.scheme == "unix":
        if parts.netloc or not parts.path.startswith("/"):
            raise ValueError(value)
        return BrokerURL("unix", "", 0, parts.path)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ValueError(value)
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(value)
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(value) from exc
    if port is None:
        port = 8883 if parts.scheme == "mqtts" else 1883
    if not 1 <= port <= 65535:
        raise ValueError(value)
    scheme: Literal["mqtt", "mqtts"] = "mqtts" if parts.scheme == "mqtts" else "mqtt"
    return BrokerURL(scheme, parts.hostname, port, "")


def _urls(v: tuple[str, ...]) -> str | None:
    if not v:
        return "at least one broker URL"
    for url in v:
        try:
            parse_broker_url(url)
        except ValueError:
            return "mqtt://HOST[:PORT], mqtts://HOST[:PORT] or unix:///PATH (or a list of them)"
    return None


def _default_node_name() -> str:
    return socket.gethostname().lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSettings:
    """[node]: who this node is."""

    name: str = _setting(
        _default_node_name,
        "This node's name, a DNS-1123 subdomain. Default: the host name, lowercased.",
        _node_name,
    )
    address: str = _setting(
        "",
        "The address IMEX binds and peers connect to. Empty: the first non-loopback "
        "IPv4 address of the host (loopback if there is none).",
        _address,
    )
    clique: str = _setting(
        "auto",
        'The NVLink clique id. "auto": discovered through NVML; "": no multi-node '
        "NVLink (member without a daemon); anything else is used as is.",
        _clique,
    )
    state_dir: str = _setting(
        "/var/lib/imexd",
        "Where the agent keeps its last domain, slot and incarnation across restarts.",
        _abs_path,
    )
    discover_interval_s: float = _setting(
        300.0,
        "Seconds between NVML fabric re-discoveries (partitions can change); a failed "
        "discovery is tried again sooner, backing off, and at most this long after.",
        _positive,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainSettings:
    """[domain]: which IMEX domain this node belongs to and how its node list looks."""

    name: str = _setting(
        "",
        "Static mode: the domain to join (DNS-1123 label). Empty: no domain, the node idles.",
        _domain_name,
    )
    assigned: bool = _setting(
        False,
        "Follow the control plane's assignment ({prefix}/nodes/{node}/assignment) instead "
        "of a static name.",
    )
    max_nodes: int = _setting(
        18,
        "Slots per (domain, clique): the length of nodes_config.cfg. 18 = one GB200 NVL72. "
        "Must be equal on every node of a domain.",
        _max_nodes,
    )
    mode: Mode = _setting(  # noqa: RUF009 - a Literal alias: immutable
        "names",
        '"names": fixed slot host names, membership changes only rewrite hosts and send '
        'SIGUSR1; "addresses": member addresses, any change restarts the daemon.',
        _one_of(*get_args(Mode)),
    )
    settle_s: float = _setting(
        0.2,
        "Seconds of the window that coalesces a burst of membership changes before files "
        "are rewritten; the first daemon start of a domain waits at most 5 x settle_s "
        "while claims are in flight or listed nodes are not members yet. Slot claims do "
        "not wait for it: a claim settles when its own record comes back from the broker.",
        _nonneg,
    )
    claim_stale_s: float = _setting(
        30.0,
        "Seconds after which a claiming record that has not changed stops counting, so a "
        "left-over or bogus claim cannot hold a slot forever. Must exceed 4 x settle_s: a "
        "live claim settles (or yields) well within that.",
        _positive,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BusSettings:
    """[bus]: the MQTT broker(s)."""

    url: tuple[str, ...] = _setting(
        ["mqtt://127.0.0.1:1883"],
        "Broker URL or list of URLs tried in turn: mqtt://HOST[:1883], mqtts://HOST[:8883], "
        "unix:///PATH.",
        _urls,
    )
    topic_prefix: str = _setting(
        "imex/v2",
        "First levels of every topic imexd uses (v2: names in topic levels are encoded, "
        "docs/bus.md; v1 agents do not see v2 ones).",
        _topic_prefix,
    )
    username: str = _setting("", "MQTT user name; empty: anonymous.")
    password_file: str = _setting(
        "", "File holding the MQTT password (never given on a command line).", _opt_path
    )
    ca_file: str = _setting(
        "", "CA bundle for mqtts:// brokers; empty: the system's trust store.", _opt_path
    )
    cert_file: str = _setting("", "Client certificate for mqtts:// (with key_file).", _opt_path)
    key_file: str = _setting("", "Client private key for mqtts:// (with cert_file).", _opt_path)
    keepalive_s: float = _setting(
        30.0, "MQTT keep-alive in seconds (whole seconds on the wire).", _positive
    )
    will_delay_s: float = _setting(
        5.0,
        "MQTT 5 Will Delay: how long a vanished node keeps its member record, so that a "
        "quick reconnect does not flap membership (the agent's MQTT 5 session outlives it, "
        "at least 1 s, so a reconnect within it resumes the session and drops the will). "
        "On MQTT 3.1.1, which has no Will Delay, the will is a tombstone and the peers "
        "keep the node this long instead.",
        _nonneg,
    )
    reconnect_initial_s: float = _setting(
        0.5, "First reconnect delay; doubles up to reconnect_max_s, with jitter.", _positive
    )
    reconnect_max_s: float = _setting(30.0, "Largest reconnect delay in seconds.", _positive)
    ping_interval_s: float = _setting(
        10.0,
        "Seconds between round trips through the broker that prove the link is alive.",
        _positive,
    )
    broker: BrokerProfile = _setting(  # noqa: RUF009 - a Literal alias: immutable
        "auto",
        "The broker profile: which links get the repairs for a broker that reorders or "
        "loses messages (stale retained copies dropped, re-reads every resync_interval_s "
        "and after each burst of changes, refused subscriptions retried on the link, lost "
        "echoes published again, QoS 0 for the subscriptions whose order the agent does "
        'not judge by). "mosquitto": none. "nats": on every link (any clustered broker that '
        'loses updates). "auto": on links that run MQTT 3.1.1 (all that NATS speaks), none '
        'on MQTT 5; set "mosquitto" for a Mosquitto told protocol = "3.1.1".',
        _one_of(*get_args(BrokerProfile)),
    )
    resync_interval_s: float = _setting(
        30.0,
        "On a link with the broker repairs (see broker): seconds (jittered by +-25 %) "
        "between re-reads of the subscriptions: the broker's fresh retained snapshot is "
        "compared with what the agent holds and only differences come out, so an update a "
        "clustered broker lost (NATS 2.9) is corrected within this time; one also follows "
        "each burst of changes by 1 s. Each costs one SUBSCRIBE per filter, a copy of every "
        "record of the shard and domain (~20 for a rack of 18) and a round trip. 0: never.",
        _nonneg,
    )
    broker_will_delay: bool = _setting(
        True,
        "Whether the MQTT 5 broker applies the Will Delay (Mosquitto, EMQX, HiveMQ do): "
        "then a lost node's tombstone says hold_s 0 and peers drop it at once. Set false "
        "for an MQTT 5 broker that publishes wills at once: the tombstone then says "
        "hold_s = will_delay_s and the peers wait instead (as on MQTT 3.1.1).",
    )
    protocol: Literal["auto", "5", "3.1.1"] = _setting(
        "auto",
        '"auto": MQTT 5 at every connect, 3.1.1 for that connect only when the broker '
        'refuses 5 (CONNACK "unsupported protocol version") or closes before CONNACK (the '
        "latter only from a broker that has not taken MQTT 5 since the agent started); a "
        'timeout is an outage, not a verdict. "5": never 3.1.1 (keeps the Will Delay). '
        '"3.1.1": never 5.',
        _one_of("auto", "5", "3.1.1"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ImexSettings:
    """[imex]: the IMEX daemon, its tools and its files."""

    binary: str = _setting(
        "nvidia-imex", "The IMEX daemon binary (path or name on PATH).", _nonempty
    )
    ctl: str = _setting(
        "nvidia-imex-ctl", "The IMEX control tool (path or name on PATH).", _nonempty
    )
    run_dir: str = _setting(
        "/run/imexd", "Where config.cfg and nodes_config.cfg are written.", _abs_path
    )
    hosts_file: str = _setting(
        "/etc/hosts", "The hosts file that maps slot names to member addresses.", _abs_path
    )
    server_port: int = _setting(SERVER_PORT, "IMEX SERVER_PORT (daemon-to-daemon).", _port)
    cmd_port: int = _setting(CMD_PORT, "IMEX_CMD_PORT (the port nvidia-imex-ctl asks).", _port)
    reload_min_interval_s: float = _setting(
        6.0,
        "Least seconds between two SIGUSR1: IMEX honours one per 5 s and drops the rest, "
        "plus a margin.",
        _nonneg,
    )
    extra: Mapping[str, str] = _setting(
        {},
        "Extra config.cfg keys, added or overriding the rendered ones (e.g. "
        "IMEX_ENABLE_AUTH_ENCRYPTION).",
        _extra,
    )
    env: Mapping[str, str] = _setting(
        {}, "Environment variables for the daemon and for the ctl.", _env
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonSettings:
    """[daemon]: supervision of the IMEX daemon and its probes."""

    start_s: float = _setting(
        3.0,
        "Bound on a start, not a wait: the daemon is RUNNING as soon as it says READY (its "
        "own line, or `ctl -q`), or once alive this many seconds without READY; an exit "
        "before either is a failed start.",
        _nonneg,
    )
    stable_s: float = _setting(
        60.0, "Seconds alive after which the crash backoff is reset.", _nonneg
    )
    backoff_initial_s: float = _setting(
        1.0, "First restart delay after a crash; doubles, with jitter.", _nonneg
    )
    backoff_max_s: float = _setting(60.0, "Largest restart delay in seconds.", _nonneg)
    crash_loop_starts: int = _setting(
        5, "Failed starts inside crash_loop_window_s that make the daemon FATAL.", _positive_int
    )
    crash_loop_window_s: float = _setting(
        300.0, "The window, in seconds, in which failed starts are counted.", _positive
    )
    fatal_cooldown_s: float = _setting(
        600.0, "Seconds in FATAL before one more start is tried (never spun).", _positive
    )
    stop_timeout_s: float = _setting(
        10.0,
        "Seconds between SIGTERM and SIGKILL when stopping the daemon. With the agent's "
        f"{SHUTDOWN_MARGIN_S:g} s shutdown margin it must end before service_stop_timeout_s.",
        _positive,
    )
    service_stop_timeout_s: float = _setting(
        UNIT_TIMEOUT_STOP_S,
        "How long the service manager waits for the agent to stop before it kills it: "
        "systemd's TimeoutStopSec (30 s in the shipped unit), Kubernetes' "
        "terminationGracePeriodSeconds. Raise it together with that (a drop-in: systemctl "
        "edit imexd) to allow a longer stop_timeout_s.",
        _positive,
    )
    probe_interval_s: float = _setting(
        5.0,
        "Seconds between local probes (`ctl -q`); also between looks for a daemon of this "
        "node's config that no agent supervises, while the agent stands aside for another "
        "agent of its name.",
        _positive,
    )
    domain_probe_interval_s: float = _setting(
        15.0, "Seconds between domain probes (`ctl -N -j`).", _positive
    )
    probe_timeout_s: float = _setting(
        5.0, "Seconds before a hung ctl is killed and the probe counted as failed.", _positive
    )
    release_after_s: float = _setting(
        300.0,
        "Seconds a FATAL daemon's node keeps its slot while a standby node waits; then it "
        "releases the slot (its record becomes standby) and claims again once healthy. "
        "0: never release.",
        _nonneg,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthSettings:
    """[health]: HTTP endpoints and reports to the control plane."""

    listen: str = _setting(
        "127.0.0.1:9440",
        "HOST:PORT of /healthz, /readyz, /status and /metrics (port 0: any free port).",
        _listen,
    )
    report_interval_s: float = _setting(
        30.0, "Seconds between HealthReports on the bus (also sent on every change).", _positive
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelsSettings:
    """[channels]: the IMEX channel devices the agent makes for workloads (docs/channels.md)."""

    manage: bool = _setting(
        True,
        "Make and remove channel device nodes, CDI specs and env files for the workloads of "
        "the node's domain. false: another tool owns dev_dir (Slurm's switch/nvidia_imex, "
        "NVIDIA's DRA driver) and imexd touches nothing there.",
    )
    dev_dir: str = _setting(
        "/dev/nvidia-caps-imex-channels",
        "Where the channel device nodes `channel<N>` live. The agent owns this folder: at "
        "start it removes every channel node no live workload of this node owns.",
        _abs_path,
    )
    proc_devices: str = _setting(
        "/proc/devices",
        "The kernel's device list: the `nvidia-caps-imex-channels` line gives the major.",
        _abs_path,
    )
    driver_params: str = _setting(
        "/proc/driver/nvidia/params",
        "The NVIDIA driver's parameters: `ImexChannelCount` and `CreateImexChannel0`.",
        _abs_path,
    )
    cdi_dir: str = _setting(
        "/var/run/cdi",
        "Where a CDI spec per workload is written, for podman, containerd and CRI-O.",
        _abs_path,
    )
    env_dir: str = _setting(
        "/run/imexd/workloads",
        "Where an env file per workload (`<workload>.env`) is written, for bare metal.",
        _abs_path,
    )
    keep_channel0: bool = _setting(
        False,
        "Keep a channel0 node that no workload owns (the driver makes a world-writable one "
        "with NVreg_CreateImexChannel0=1). false: it is removed, so that channels isolate.",
    )
    simulate: bool = _setting(
        False,
        "The driver is simulated (a machine without a GPU: the demo, a tour, tests). Where "
        "the agent may not mknod (no CAP_MKNOD), it makes a stand-in file marked as such "
        "instead of the device node, and reports its channels Simulated. Needs a dev_dir "
        "outside /dev.",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlSettings:
    """[control]: the key pair that signs the control plane's records (docs/security.md)."""

    private_key: str = _setting(
        "",
        "The control plane's Ed25519 private key (PKCS8 PEM, made by `imexd keys create`): "
        "the commands that write (domain create and delete, workload create and delete, "
        "node assign, unassign and retry, gc) sign every spec, workload, assignment and "
        "retry request with it. Only on the control plane's hosts (the Slurm controller), "
        "mode 0600. Empty: they write unsigned records.",
        _opt_path,
    )
    public_key: str = _setting(
        "",
        "The control plane's Ed25519 public key (SubjectPublicKeyInfo PEM, control.pub of "
        "`imexd keys create`): the agent acts only on specs, workloads, assignments and "
        "retry requests signed with its private key and drops the rest (counted, and "
        "BusConnected says so). Empty: they are accepted unsigned.",
        _opt_path,
    )
    tombstone_expiry_s: float = _setting(
        604800.0,
        "Seconds a deletion (a spec or workload `deleted`, an assignment to no domain, a "
        "retry request `done`) is kept: the control plane writes it with this MQTT 5 "
        "message expiry, and agents give it back to a broker that lost it and keep "
        "following a deleted domain only this long after it was written (default 7 days). "
        "`imexd gc --tombstones S` clears older ones sooner.",
        _positive,
    )
    anti_entropy_s: float = _setting(
        60.0,
        "Agents: seconds between two comparisons of what the broker serves for the "
        "control-plane records the agent follows with the newest it holds (the same pass "
        "runs after every connect's snapshot); a record the broker lacks, or serves older, "
        "is published again as it came.",
        _positive,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LogSettings:
    """[log]: the agent's own logs."""

    level: LogLevel = _setting(  # noqa: RUF009 - a Literal alias: immutable
        "info", "debug, info, warning, error or critical.", _one_of(*LEVELS)
    )
    format: LogFormat = _setting(  # noqa: RUF009 - a Literal alias: immutable
        "auto",
        '"auto": JSON lines unless the output is a terminal; "json"; "console".',
        _one_of(*get_args(LogFormat)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """All settings, one frozen dataclass per section."""

    node: NodeSettings = field(default_factory=NodeSettings)
    domain: DomainSettings = field(default_factory=DomainSettings)
    bus: BusSettings = field(default_factory=BusSettings)
    imex: ImexSettings = field(default_factory=ImexSettings)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    channels: ChannelsSettings = field(default_factory=ChannelsSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    log: LogSettings = field(default_factory=LogSettings)

    @property
    def brokers(self) -> tuple[BrokerURL, ...]:
        return tuple(parse_broker_url(u) for u in self.bus.url)

    @property
    def config_path(self) -> Path:
        """Absolute path of the config.cfg the agent writes."""
        return Path(self.imex.run_dir) / "config.cfg"

    @property
    def nodes_config_path(self) -> Path:
        """Absolute path of the nodes_config.cfg the agent writes."""
        return Path(self.imex.run_dir) / "nodes_config.cfg"


SECTIONS: dict[str, type[Any]] = {
    "node": NodeSettings,
    "domain": DomainSettings,
    "bus": BusSettings,
    "imex": ImexSettings,
    "daemon": DaemonSettings,
    "health": HealthSettings,
    "channels": ChannelsSettings,
    "control": ControlSettings,
    "log": LogSettings,
}


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One setting, as listed in docs and the shipped config."""

    section: str
    key: str
    kind: str
    default: Any
    doc: str

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.section.upper()}_{self.key.upper()}"


def iter_settings() -> Iterator[SettingInfo]:
    """Every setting with its kind, default and doc, in section order."""
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            default: Any = f.default
            if default is MISSING:
                default = f.default_factory()  # type: ignore[operator]
            yield SettingInfo(section, f.name, _kind(hints[f.name]), default, f.metadata["doc"])


def _kind(tp: Any) -> str:
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "duration"
    if tp is str:
        return "str"
    if get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp)):
        return "str"
    if getattr(tp, "__origin__", None) is tuple:
        return "list"
    return "table"


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _coerce(kind: str, value: Any) -> tuple[Any, str | None]:
    """Check the TOML type of one value; return (value, None) or (None, expected type)."""
    if kind == "bool":
        return (value, None) if isinstance(value, bool) else (None, "true or false")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        return None, "an integer"
    if kind == "duration":
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value), None
        return None, "a number of seconds (integer or float)"
    if kind == "str":
        return (value, None) if isinstance(value, str) else (None, "a string")
    if kind == "list":
        if isinstance(value, str):
            return (value,), None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value), None
        return None, "a string or a list of strings"
    # table of scalars, kept as strings
    if isinstance(value, dict) and all(
        isinstance(v, str | int | float | bool) and not isinstance(v, dict) for v in value.values()
    ):
        return MappingProxyType({str(k): _scalar_text(v) for k, v in value.items()}), None
    return None, "a table of KEY = value"


def _scalar_text(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _env_value(kind: str, text: str) -> Any:
    """Turn an environment string into the TOML value it stands for."""
    if kind == "str":
        return text
    if kind == "bool":
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        return text
    if kind == "list" and not text.lstrip().startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    required: bool = False,
    env_labels: Mapping[str, str] | None = None,
) -> Settings:
    """Load settings from `path` (absent file = defaults unless `required`) and `environ`.

    Raises ConfigError listing every wrong key; `env_labels` names where a variable came
    from (an environment file's line) in those problems.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    problems: list[str] = []
    source = str(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        with open(source, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        if required or (path is not None and str(path) != DEFAULT_CONFIG_PATH):
            raise ConfigError([f"{source}: file not found"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}{_toml_hint(source, exc)}"]) from None
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read: {exc.strerror}"]) from None
    return settings_from_mapping(
        raw, environ=env, source=source, problems=problems, env_labels=env_labels
    )


def env_setting(name: str) -> tuple[str, str] | None:
    """(section, key) that an IMEXD_<SECTION>_<KEY> variable sets, checked or not; None
    for a name of no settings section (IMEXD_SIM_* and other tools'), which imexd ignores."""
    if not name.startswith(ENV_PREFIX):
        return None
    rest = name[len(ENV_PREFIX) :].lower()
    section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
    return None if section is None else (section, rest[len(section) + 1 :])


def _closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to a mistyped `word`, if one is near."""
    import difflib  # noqa: PLC0415 - lazy: only a mistake pays for it, not every agent

    close = difflib.get_close_matches(word, list(choices), n=1)
    return close[0] if close else None


def _did_you_mean(section: str, key: str, known: Iterable[str], *, env: bool) -> str:
    """`; did you mean IMEXD_DOMAIN_MAX_NODES?` (or `domain.max_nodes`) for a near miss."""
    close = _closest(key, known)
    if close is None:
        return ""
    name = f"{ENV_PREFIX}{section}_{close}".upper() if env else f"{section}.{close}"
    return f"; did you mean {name}?"


_TOML_AT_LINE = re.compile(r"\(at line (\d+), column \d+\)")


def _toml_hint(source: str, exc: tomllib.TOMLDecodeError) -> str:
    """What tomllib leaves out: the key a "Cannot overwrite a value" error is about
    (a key given twice in one table); "" for other errors."""
    found = _TOML_AT_LINE.search(str(exc))
    if not str(exc).startswith("Cannot overwrite a value") or found is None:
        return ""
    try:
        with open(source, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        key = lines[int(found.group(1)) - 1].split("=", 1)[0].strip()
    except (OSError, IndexError):
        return ""
    return f": duplicate key '{key}'" if key else ""


def settings_from_mapping(
    raw: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    source: str = "<settings>",
    problems: list[str] | None = None,
    env_labels: Mapping[str, str] | None = None,
) -> Settings:
    """Validate a parsed TOML document (plus environment overrides) into Settings."""
    problems = [] if problems is None else problems
    labels = env_labels or {}
    kinds = {(s.section, s.key): s.kind for s in iter_settings()}
    merged: dict[str, dict[str, tuple[Any, str, bool]]] = {}
    for section, table in raw.items():
        if section not in SECTIONS:
            close = _closest(section, SECTIONS)
            problems.append(
                f"[{section}]: unknown section in {source}; expected one of "
                + ", ".join(SECTIONS)
                + (f"; did you mean [{close}]?" if close else "")
            )
            continue
        if not isinstance(table, dict):
            problems.append(f"{section} = {_describe(table)}: expected a table [{section}]")
            continue
        for key, value in table.items():
            merged.setdefault(section, {})[key] = (value, f"{section}.{key}", False)
    for name, text in sorted((environ or {}).items()):
        if not name.startswith(ENV_PREFIX):
            continue
        split = env_setting(name)
        if split is None:
            continue  # IMEXD_SIM_* and other tools' variables
        env_section, key = split
        kind = kinds.get((env_section, key), "str")
        merged.setdefault(env_section, {})[key] = (
            _env_value(kind, text),
            labels.get(name, name),
            True,
        )
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values: dict[str, Any] = {}
        known = {f.name: f for f in fields(cls)}
        for key, (value, label, from_env) in merged.get(section, {}).items():
            if key not in known:
                problems.append(
                    f"{label}: unknown setting {section}.{key}; known: "
                    + ", ".join(known)
                    + _did_you_mean(section, key, known, env=from_env)
                )
                continue
            coerced, expected = _coerce(kinds[(section, key)], value)
            if expected is None:
                check = known[key].metadata["check"]
                expected = check(coerced) if check is not None else None
            if expected is not None:
                problems.append(f"{label} = {_describe(value)}: expected {expected}")
                continue
            values[key] = coerced
        try:
            built[section] = cls(**values)
        except TypeError as exc:  # pragma: no cover - guarded by the known-key check
            problems.append(f"[{section}]: {exc}")
    if not problems:
        problems.extend(_cross_checks(built))
    if problems:
        raise ConfigError(problems)
    node: NodeSettings = built["node"]
    if node.address == "":
        built["node"] = NodeSettings(
            name=node.name,
            address=default_address(),
            clique=node.clique,
            state_dir=node.state_dir,
            discover_interval_s=node.discover_interval_s,
        )
    return Settings(**built)


def _under_dev(path: str) -> bool:
    """Whether `path` is /dev or below it (after resolving `..`, not symlinks)."""
    return os.path.normpath(path) == "/dev" or os.path.normpath(path).startswith("/dev/")


def _cross_checks(built: Mapping[str, Any]) -> list[str]:
    """Rules between keys: each problem names the keys involved."""
    problems: list[str] = []
    node: NodeSettings = built["node"]
    imex: ImexSettings = built["imex"]
    bus: BusSettings = built["bus"]
    domain: DomainSettings = built["domain"]
    problems.extend(check_extra(imex.extra))
    if _node_name(node.name) is not None:
        problems.append(
            f"node.name = {node.name!r}: expected a DNS-1123 subdomain (the host name is "
            "not one: set node.name)"
        )
    if imex.server_port == imex.cmd_port:
        problems.append(
            f"imex.cmd_port = {imex.cmd_port}: expected a port other than imex.server_port"
        )
    if bool(bus.cert_file) != bool(bus.key_file):
        problems.append(
            "bus.cert_file / bus.key_file: expected both set (client certificate) or both empty"
        )
    if bus.reconnect_max_s < bus.reconnect_initial_s:
        problems.append(
            f"bus.reconnect_max_s = {bus.reconnect_max_s}: expected >= bus.reconnect_initial_s"
        )
    daemon: DaemonSettings = built["daemon"]
    if daemon.backoff_max_s < daemon.backoff_initial_s:
        problems.append(
            f"daemon.backoff_max_s = {daemon.backoff_max_s}: expected >= daemon.backoff_initial_s"
        )
    bound = daemon.stop_timeout_s + SHUTDOWN_MARGIN_S
    if bound >= daemon.service_stop_timeout_s:
        problems.append(
            f"daemon.stop_timeout_s = {daemon.stop_timeout_s}: expected less than "
            f"daemon.service_stop_timeout_s - {SHUTDOWN_MARGIN_S:g} s (the agent's shutdown "
            f"margin) = {daemon.service_stop_timeout_s - SHUTDOWN_MARGIN_S:g} s, or the service "
            f"manager kills the agent before it has stopped IMEX (the unit's "
            f"TimeoutStopSec={daemon.service_stop_timeout_s:g}s). To allow it, raise "
            "TimeoutStopSec in a drop-in (systemctl edit imexd: [Service] "
            f"TimeoutStopSec={math.ceil(bound) + 10}s) or Kubernetes' "
            "terminationGracePeriodSeconds, and daemon.service_stop_timeout_s to match"
        )
    if domain.claim_stale_s <= 4 * domain.settle_s:
        problems.append(
            f"domain.claim_stale_s = {domain.claim_stale_s}: expected more than 4 x "
            f"domain.settle_s ({4 * domain.settle_s}), or live claims would go stale"
        )
    channels: ChannelsSettings = built["channels"]
    if channels.simulate and _under_dev(channels.dev_dir):
        problems.append(
            f"channels.simulate = true: expected channels.dev_dir outside /dev (it is "
            f"{channels.dev_dir!r}): a simulated driver's stand-ins never go where jobs "
            "open real channel devices"
        )
    if domain.assigned and domain.name:
        problems.append(
            f"domain.name = {domain.name!r}: expected empty when domain.assigned = true "
            "(the control plane names the domain)"
        )
    return problems


HOST_ADDRESSES_SHOWN = 6
"""How many of the host's addresses `node_address_problem` names."""


def node_address_problem(node: NodeSettings) -> str | None:
    """None when `node.address` is one of this host's addresses (any of 127.0.0.0/8 is,
    on Linux), or the node runs no daemon (`clique = ""`); else why the IMEX daemon will
    not start. IMEX binds only an address an interface holds ("No matching network
    interface found"). A warning, not an error: the interface may come up later."""
    if node.clique == "":
        return None
    import ipaddress  # noqa: PLC0415 - lazy: only `imexd config` and the agent's start

    import psutil  # noqa: PLC0415 - lazy: as in default_address

    wanted = ipaddress.ip_address(node.address)
    if wanted.version == 4 and wanted in ipaddress.ip_network("127.0.0.0/8"):
        return None
    held = sorted(
        {
            ipaddress.ip_address(addr.address.split("%", 1)[0])
            for addrs in psutil.net_if_addrs().values()
            for addr in addrs
            if addr.family in (socket.AF_INET, socket.AF_INET6)
        },
        key=lambda ip: (ip.version, ip),
    )
    if wanted in held:
        return None
    shown = ", ".join(map(str, held[:HOST_ADDRESSES_SHOWN]))
    if len(held) > HOST_ADDRESSES_SHOWN:
        shown += f" and {len(held) - HOST_ADDRESSES_SHOWN} more"
    return (
        f"not an address of this host ({shown or 'it has none'}): the IMEX daemon cannot "
        "bind it and fails to start (DaemonCrashed) until an interface holds it; set "
        "node.address to the node's address on the IMEX network"
    )


def default_address() -> str:
    """The first non-loopback IPv4 address of this host, else 127.0.0.1."""
    import psutil  # noqa: PLC0415 - lazy: the control commands load settings, not this

    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return str(addr.address)
    return "127.0.0.1"
