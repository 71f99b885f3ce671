"""A cluster of real agents for scenario tests: one `imexd run` process per node.

Each node gets its own loopback address, signal log and health port, and the folder
every simulated node has (`imexd.demo.nodes.node_folder`: state and run dirs, a hosts
file, channel folders with a fake driver, so no agent touches /dev); its IMEX daemon is
the simulator, pointed at the node's hosts file. Timings
are the demo's fast ones (`imexd.demo.timings.FAST`: settle, probes, reload window, will
delay) so scenarios run in seconds; everything else is the agent exactly as shipped.
Every wait is bounded. The helpers at the end (`formed`, `members`, `slot_of`, `pids`,
`untouched`) are what several scenario modules ask of a running cluster.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeAlias

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from prometheus_client.parser import text_string_to_metric_families

from imexd.demo.brokers import free_port
from imexd.demo.nodes import node_folder
from imexd.demo.timings import FAST, SIM_RELOAD_WINDOW_S
from imexd.render import parse_hosts_block
from imexd.settings_text import render_toml
from tests import forkserver
from tests.brokers import Mosquitto
from tests.faultproxy import FaultProxy
from tests.nats_servers import Nats, NatsCluster
from tests.support import imexd, loopback_address, wait_for

VENV_BIN = Path(sys.executable).parent

BusBroker: TypeAlias = Mosquitto | Nats | NatsCluster
"""What a `Cluster` runs its agents on: a Mosquitto, one nats-server, or a NATS cluster."""


def broker_urls(broker: BusBroker) -> list[str]:
    """Every MQTT URL of `broker` (one per server)."""
    return [broker.url] if isinstance(broker, Mosquitto) else broker.urls


def broker_endpoint(broker: BusBroker) -> tuple[str, int]:
    """Where a test client connects: the broker, or the first NATS server that runs."""
    if isinstance(broker, NatsCluster):
        server = next((s for s in broker.servers if s.alive()), broker.servers[0])
        return server.host, server.port
    return broker.host, broker.port


def broker_protocol(broker: BusBroker) -> str | None:
    """The `[bus] protocol` clients of `broker` must use; None: the default (auto)."""
    return None if isinstance(broker, Mosquitto) else broker.protocol


def _merge(base: dict[str, dict[str, Any]], extra: Mapping[str, Mapping[str, Any]]) -> None:
    for section, table in extra.items():
        target = base.setdefault(section, {})
        for key, value in table.items():
            if isinstance(value, Mapping) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = value


AgentProcess = subprocess.Popen[bytes] | forkserver.ForkedAgent
"""An agent's process, as `spawn_agent` started it."""
FORK_AGENTS = False
"""Fork the agents from tests/forkserver.py's server instead of starting `python -m imexd`
(tests/conftest.py turns it on for the test run; the benchmarks, which time the whole
start, leave it off)."""


def spawn_agent(
    config: Path,
    log: Path,
    *,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AgentProcess:
    """`imexd run --config CONFIG`, in a session of its own (a Ctrl-C or a test's signal
    reaches it only when sent to it), stdout and stderr appended to `log`: as shipped
    (`python -m imexd`), or with FORK_AGENTS forked from a process that has imported the
    agent already (tests/forkserver.py).

    The environment is this process's without any `IMEXD_*` variable (those would
    override the settings file), plus `env`; `prefix` runs it through another command
    (`ip netns exec NS`), always as its own process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    if FORK_AGENTS and not prefix:
        return forkserver.server().spawn(
            ["run", "--config", str(config)], clean | dict(env or {}), log
        )
    with log.open("ab") as out:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "imexd", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean | dict(env or {}),
            start_new_session=True,
        )


class Node:
    """One simulated GPU node: an agent process and, through it, a simulated daemon."""

    def __init__(
        self,
        root: Path,
        name: str,
        broker_urls: list[str],
        *,
        domain: str | None,
        clique: str,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        address: str | None = None,
        dir_name: str | None = None,
        netns: str | None = None,
    ) -> None:
        self.name = name
        self.address = address or loopback_address()
        self.dir = root / (dir_name or name)
        self.netns = netns
        """The network namespace the agent runs in (None: the test's own)."""
        self.http_host = "127.0.0.1" if netns is None else self.address
        self.signal_log = self.dir / "signals.log"
        self.health_port = free_port()
        self.config_path = self.dir / "imexd.toml"
        self.log_path = self.dir / "agent.log"
        self.proc: AgentProcess | None = None
        self.proxy: FaultProxy | None = None
        """The fault proxy on this node's bus link, when `Cluster.add(via_proxy=True)`."""
        self.sections: dict[str, dict[str, Any]] = node_folder(
            self.dir,
            name=name,
            address=self.address,
            health_listen=f"{self.http_host}:{self.health_port}",
        )
        self.hosts_file = Path(self.sections["imex"]["hosts_file"])
        _merge(
            self.sections,
            {
                "node": {"clique": clique},
                "domain": {"max_nodes": 8},
                "bus": {"url": broker_urls},
                "imex": {
                    "binary": str(VENV_BIN / "imexd-sim-daemon"),
                    "ctl": str(VENV_BIN / "imexd-sim-ctl"),
                    "env": {
                        "IMEXD_SIM_RELOAD_WINDOW_S": SIM_RELOAD_WINDOW_S,
                        "IMEXD_SIM_SIGNAL_LOG": str(self.signal_log),
                    },
                },
                "log": {"level": "info", "format": "json"},
            },
        )
        _merge(self.sections, FAST)
        if domain is not None:
            self.sections["domain"]["name"] = domain
        else:
            self.sections["domain"]["assigned"] = True
        if overrides:
            _merge(self.sections, overrides)
        self.write_config()

    # Settings and process.

    @property
    def url(self) -> str:
        return f"http://{self.http_host}:{self.health_port}"

    @property
    def run_dir(self) -> Path:
        return Path(self.sections["imex"]["run_dir"])

    @property
    def dev_dir(self) -> Path:
        """Where the agent makes the channel device nodes (`[channels] dev_dir`)."""
        return Path(self.sections["channels"]["dev_dir"])

    @property
    def cdi_dir(self) -> Path:
        return Path(self.sections["channels"]["cdi_dir"])

    @property
    def env_dir(self) -> Path:
        return Path(self.sections["channels"]["env_dir"])

    def write_config(self) -> None:
        self.config_path.write_text(render_toml(self.sections))

    def start(self) -> None:
        """Start the agent (a new process; the previous one must have ended)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} still runs"
        prefix = [] if self.netns is None else ["ip", "netns", "exec", self.netns]
        self.proc = spawn_agent(self.config_path, self.log_path, prefix=prefix)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 20.0) -> int:
        """Wait for the agent to exit; its exit status."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM: leave the domain; the exit status."""
        self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """SIGKILL the agent alone (its daemon survives, as under KillMode=process)."""
        self.signal(signal.SIGKILL)
        self.wait_exit(10)

    def crash(self) -> None:
        """The whole node dies: SIGKILL the agent and its daemon."""
        self.kill()
        for pid in self.daemon_pids_on_host():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # Observations.

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, Any]:
        """GET a health endpoint: (status code, JSON or text); (0, None) if unreachable."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:  # noqa: S310
                body = resp.read()
                code = resp.status
        except urllib.error.HTTPError as exc:
            body, code = exc.read(), exc.code
        except OSError:
            return 0, None
        try:
            return code, json.loads(body)
        except ValueError:
            return code, body.decode()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        return body if code == 200 and isinstance(body, dict) else {}

    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def brief(self) -> str:
        """This node in one line, for a failed wait's message."""
        if not self.alive():
            return "not running"
        status = self.status()
        if not status:
            return "running, no /status"
        view = status.get("domain_view") or {}
        daemon = status.get("daemon") or {}
        failing = [
            f"{c.get('type')}={c.get('status')} {c.get('reason')}"
            for c in status.get("conditions", [])
            if c.get("status") != "True"
        ]
        return (
            f"ready={status.get('ready')} slot={status.get('slot')} "
            f"daemon={daemon.get('state')} view={view.get('status')} "
            f"{len(view.get('nodes') or {})} nodes; " + ", ".join(failing)
        )

    def daemon_pid(self) -> int | None:
        pid = self.status().get("daemon", {}).get("pid")
        return pid if isinstance(pid, int) else None

    def domain_view(self) -> dict[str, Any]:
        """/status domain_view: {"status": UP|DEGRADED|..., "nodes": {slot: ...}}."""
        view = self.status().get("domain_view")
        return view if isinstance(view, dict) else {}

    def up_with(self, count: int) -> bool:
        """Whether this node judges the domain UP with exactly `count` members."""
        view = self.domain_view()
        return view.get("status") == "UP" and len(view.get("nodes", {})) == count

    def condition(self, kind: str) -> dict[str, Any]:
        """The /status condition of type `kind` ({} when absent)."""
        for cond in self.status().get("conditions", []):
            if cond.get("type") == kind:
                return dict(cond)
        return {}

    def dropped(self) -> dict[str, float]:
        """imexd_bus_dropped_total per reason, from /metrics."""
        code, body = self.get("/metrics")
        assert code == 200, (code, body)
        assert isinstance(body, str), body
        return {
            sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(body)
            if family.name == "imexd_bus_dropped"
            for sample in family.samples
            if sample.name == "imexd_bus_dropped_total"
        }

    def slot_from_state(self) -> int | None:
        """The slot the agent saved in its state dir."""
        data = json.loads((self.dir / "state" / "state.json").read_text())
        slot = data.get("slot")
        return slot if isinstance(slot, int) else None

    def slot(self) -> int | None:
        slot = self.status().get("slot")
        return slot if isinstance(slot, int) else None

    def hosts_slots(self) -> dict[int, str | None]:
        """The hosts block's slot -> address (None for the sentinel); {} without a block."""
        parsed = parse_hosts_block(self.hosts_file.read_text())
        return {} if parsed is None else parsed[1]

    def signals(self) -> list[str]:
        """The simulator's signal log lines (`<time> <SIGNAME> honoured|ignored|early`)."""
        if not self.signal_log.exists():
            return []
        return self.signal_log.read_text().splitlines()

    def reloads(self) -> list[str]:
        """The daemon's fate of every SIGUSR1 it got: `honoured`, `ignored` (the reload
        window dropped it: a change not taken) or `early` (before its names were read:
        nothing to take; a loaded machine delays the simulator's start)."""
        return [line.split()[2] for line in self.signals() if line.split()[1:2] == ["SIGUSR1"]]

    def ctl(self, *args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
        """Run imexd-sim-ctl against this node's daemon, resolving names as it does."""
        env = {**os.environ, "IMEXD_SIM_HOSTS_FILE": str(self.hosts_file)}
        return subprocess.run(
            [str(VENV_BIN / "imexd-sim-ctl"), "-c", str(self.run_dir / "config.cfg"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )

    def domain_json(self) -> dict[str, Any]:
        proc = self.ctl("-N", "-j")
        if proc.returncode != 0:
            return {}
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    def log_events(self, event: str) -> list[dict[str, Any]]:
        """The agent's JSON log events named `event`."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if f'"{event}"' not in line:
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if data.get("event") == event:
                found.append(data)
        return found

    def daemon_starts(self) -> int:
        """How many daemons the agents of this node spawned (not adopted), from their logs."""
        return sum(1 for e in self.log_events("daemon.state") if e.get("to") == "STARTING")

    def log_problems(self) -> list[str]:
        """Log lines that show a bug: a traceback or an event logged with an exception."""
        problems = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "Traceback" in line:
                problems.append(line)
                continue
            with suppress(ValueError):
                data = json.loads(line)
                if isinstance(data, dict) and ("exception" in data or "exc_info" in data):
                    problems.append(line)
        return problems

    def daemon_pids_on_host(self) -> list[int]:
        """Simulated daemons running this node's config path (adopted or not)."""
        needle = str(self.run_dir / "config.cfg")
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(b"imexd-sim-daemon" in part for part in cmdline) and needle.encode() in cmdline:
                pids.append(int(entry.name))
        return pids


def _no_delay(_client: Any, _userdata: Any, sock: Any) -> None:
    """TCP_NODELAY on a test client's link, as imexd's own links have it (imexd.bus.mqtt):
    with Nagle's algorithm a SUBSCRIBE's or PUBLISH's packet that follows another waits
    for the broker's delayed ACK, some 40 ms a round trip."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BusClient:
    """A plain MQTT client for tests (MQTT 5; 3.1.1 on NATS, on its first live server):
    publish anything, read the retained snapshot."""

    _ids = itertools.count()

    def __init__(self, broker: BusBroker, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"test-{os.getpid()}-{next(self._ids)}",
            protocol=paho.MQTTv5 if broker_protocol(broker) is None else paho.MQTTv311,
        )
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        """Notified on every SUBACK and message: `retained` and `record` wait on it."""
        self._messages: list[tuple[str, bytes]] = []
        self._retained: set[int] = set()
        """Indexes into `_messages` of the messages the broker flagged retained."""
        self._subacks: set[int] = set()
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._client.on_socket_open = _no_delay
        self._client.connect(*broker_endpoint(broker))
        self._client.loop_start()

    def _on_message(self, _client: Any, _userdata: Any, message: paho.MQTTMessage) -> None:
        with self._arrived:
            if message.retain:
                self._retained.add(len(self._messages))
            self._messages.append((message.topic, bytes(message.payload)))
            self._arrived.notify_all()

    def _on_subscribe(self, _client: Any, _userdata: Any, mid: int, *_rest: Any) -> None:
        with self._arrived:
            self._subacks.add(mid)
            self._arrived.notify_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the broker's acknowledgement."""
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(self.timeout)
        assert info.is_published(), topic

    def retained(self, topic_filter: str) -> dict[str, bytes]:
        """topic -> payload of every retained record under `topic_filter` right now.

        A marker published after the SUBACK comes back after the whole snapshot.
        """
        marker = f"test/marker/{os.getpid()}/{next(self._ids)}"
        with self._lock:
            self._messages.clear()
            self._retained.clear()
        result, mid = self._client.subscribe([(topic_filter, 1), (marker, 1)])
        assert result == paho.MQTT_ERR_SUCCESS
        assert mid is not None
        self._until(lambda: mid in self._subacks, f"the SUBACK of {topic_filter}")
        self.publish(marker, b"end")
        self._until(lambda: any(t == marker for t, _ in self._messages), f"marker {marker}")
        self._client.unsubscribe([topic_filter, marker])
        with self._lock:
            # Only the snapshot: live messages (agents' pings, fresh reports) that pass
            # while it is delivered are not retained records.
            return {
                t: p
                for i, (t, p) in enumerate(self._messages)
                if i in self._retained and t != marker and p
            }

    def record(self, topic_filter: str) -> Self:
        """Keep every message on `topic_filter` from now on, in arrival order (`seen`)."""
        result, mid = self._client.subscribe([(topic_filter, 1)])
        assert result == paho.MQTT_ERR_SUCCESS
        assert mid is not None
        self._until(lambda: mid in self._subacks, f"the SUBACK of {topic_filter}")
        return self

    def seen(self) -> list[tuple[str, bytes]]:
        """Every message received so far (since the last `retained`)."""
        with self._lock:
            return list(self._messages)

    def _until(self, arrived: Callable[[], bool], what: str) -> None:
        """Wait until `arrived` (called with the lock held) is true, woken by each SUBACK
        and message instead of polling; an AssertionError after `timeout` seconds."""
        with self._arrived:
            if not self._arrived.wait_for(arrived, timeout=self.timeout):
                raise AssertionError(f"not within {self.timeout:g} s: {what}")


class Cluster:
    """A broker and some nodes; `close()` ends every process it started.

    The broker is a Mosquitto (started here when none is given) or a started `Nats` or
    `NatsCluster`: agents on NATS get `[bus] protocol = "3.1.1"` (it speaks nothing else;
    "auto" would cost a refused MQTT 5 attempt and a warning at every connect) and all of
    the cluster's URLs, rotated by one per node so that the agents spread over the servers.
    """

    def __init__(self, root: Path, *, broker: BusBroker | None = None) -> None:
        self.root = root
        self.broker: BusBroker = broker or Mosquitto(root / "broker", persistence=False)
        if broker is None:
            self.broker.start()
        self.nodes: dict[str, Node] = {}
        self.forced: list[str] = []
        """What `close()` had to kill because the agents did not end it themselves."""

    def add(
        self,
        name: str,
        *,
        domain: str | None = "d1",
        clique: str = "c1",
        start: bool = True,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        via_proxy: bool = False,
        key: str | None = None,
        address: str | None = None,
        netns: str | None = None,
        bus_url: str | None = None,
    ) -> Node:
        """A new node (defaults: the cluster's broker, a fresh loopback address).

        `via_proxy` routes its bus link through its own fault proxy (`node.proxy`); `key`
        names it in `nodes` and names its folder (two agents with one node name); `netns`
        runs the agent in that network namespace, at `address` and over `bus_url`, with
        its health endpoint on `address`.
        """
        proxy = FaultProxy(self.broker.host, self.broker.port).start() if via_proxy else None
        spread = broker_urls(self.broker)
        shift = len(self.nodes) % len(spread)
        spread = spread[shift:] + spread[:shift]
        urls = [proxy.url] if proxy is not None else [bus_url] if bus_url else spread
        protocol = broker_protocol(self.broker)
        settings: dict[str, dict[str, Any]] = (
            {} if protocol is None else {"bus": {"protocol": protocol}}
        )
        _merge(settings, overrides or {})
        node = Node(
            self.root,
            name,
            urls,
            domain=domain,
            clique=clique,
            overrides=settings,
            address=address,
            dir_name=key,
            netns=netns,
        )
        node.proxy = proxy
        self.nodes[key or name] = node
        if start:
            node.start()
        return node

    def wait(
        self, predicate: Callable[[], object], timeout: float = 30.0, *, what: str | None = None
    ) -> None:
        """`wait_for` whose failure shows every node's state as seen last."""
        wait_for(predicate, timeout=timeout, interval=0.1, what=what, seen=self.brief)

    def brief(self) -> dict[str, str]:
        """Each node's state in one line: process, readiness, its view of the domain, and
        the conditions that are not True (what a failed wait saw last)."""
        return {name: node.brief() for name, node in self.nodes.items()}

    def all_ready(self, names: list[str] | None = None) -> bool:
        chosen = [self.nodes[n] for n in names] if names else list(self.nodes.values())
        return all(node.ready() for node in chosen)

    def client(self) -> BusClient:
        """A test MQTT client on the cluster's broker (use it as a context manager)."""
        return BusClient(self.broker)

    def control_env(self) -> dict[str, str]:
        """The environment of `imexd domain ...` as the control plane of this cluster:
        no settings file, the fleet's settings as IMEXD_ variables."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
        protocol = broker_protocol(self.broker)
        return (
            env
            | {
                "IMEXD_BUS_URL": ",".join(broker_urls(self.broker)),
                "IMEXD_DOMAIN_MAX_NODES": "8",
                "IMEXD_HEALTH_REPORT_INTERVAL_S": str(FAST["health"]["report_interval_s"]),
            }
            | ({} if protocol is None else {"IMEXD_BUS_PROTOCOL": protocol})
        )

    def imexd(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """`imexd ARGS` as this cluster's control plane (`control_env`, plus `env`). The
        bound is above any `--wait` a scenario gives, so that the command's own verdict,
        not the bound, ends a slow wait."""
        return imexd(*args, env=self.control_env() | dict(env or {}), timeout=timeout)

    def check_closed(self) -> None:
        """After `close`: nothing left behind (agents or daemons still running, anything
        close had to kill) and no traceback in any agent's log."""
        assert self.forced == [], "close() had to kill what the agents left"
        for node in self.nodes.values():
            assert not node.alive(), node.name
            assert node.daemon_pids_on_host() == [], node.name
            assert node.log_problems() == [], node.name

    def close(self) -> None:
        """SIGTERM every agent (they leave), then kill whatever they left behind.

        Anything killed here is recorded in `forced`: after a clean run it stays empty.
        Fault proxies are healed first, so that every agent can leave over its link.
        """
        for node in self.nodes.values():
            if node.proxy is not None:
                node.proxy.heal()
        for node in self.nodes.values():
            if node.alive():
                node.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for node in self.nodes.values():
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.forced.append(f"agent {node.name} (pid {node.proc.pid})")
                    node.proc.kill()
                    node.proc.wait(timeout=5)
        for node in self.nodes.values():
            for pid in node.daemon_pids_on_host():
                self.forced.append(f"daemon of {node.name} (pid {pid})")
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for node in self.nodes.values():
            if node.proxy is not None:
                node.proxy.close()
        self.broker.stop()


# What several scenario modules ask of a running cluster.


def checked(root: Path, broker: BusBroker | None = None) -> Iterator[Cluster]:
    """The body of every cluster fixture: a cluster on `broker` (started here; a Mosquitto
    of its own when None), closed after the test and checked for what it left behind
    (`Cluster.check_closed`). A fixture says `yield from checked(tmp_path, broker)`."""
    if broker is not None:
        broker.start()
    cluster = Cluster(root, broker=broker)
    try:
        yield cluster
    finally:
        cluster.close()
    cluster.check_closed()


def formed(c: Cluster, nodes: list[Node], timeout: float = 90) -> None:
    """Wait until `nodes` are ready and each judges the domain UP with all of them, both
    within `timeout` seconds: a loaded machine may take most of it for either step."""
    names = [n.name for n in nodes]
    deadline = time.monotonic() + timeout
    c.wait(lambda: c.all_ready(names), timeout=timeout, what=f"{names} ready")
    c.wait(
        lambda: all(n.up_with(len(nodes)) for n in nodes),
        timeout=max(deadline - time.monotonic(), 10.0),
        what=f"each of {names} judges the domain UP with {len(nodes)} members",
    )


QUIET_S = 2 * float(FAST["imex"]["reload_min_interval_s"])
"""No signal for this long: a formation's last SIGUSR1, paced by the reload window, is out."""


def quiet(c: Cluster, nodes: list[Node], quiet_s: float = QUIET_S, timeout: float = 20) -> None:
    """Wait until no daemon of `nodes` got a signal for `quiet_s`: a SIGUSR1 of the
    formation (a node that started before a peer joined), paced by the daemon's reload
    window, may still be on its way when the domain is UP. A test that compares the
    signals before and after a change takes its "before" after this."""
    seen = {n.name: n.signals() for n in nodes}
    since = time.monotonic()

    def still() -> bool:
        nonlocal seen, since
        now = {n.name: n.signals() for n in nodes}
        if now != seen:
            seen, since = now, time.monotonic()
        return time.monotonic() - since >= quiet_s

    c.wait(still, timeout=timeout, what=f"no signal to {[n.name for n in nodes]} for {quiet_s:g} s")


def members(node: Node) -> dict[int, str]:
    """The hosts block's member slots (the sentinel left out)."""
    return {slot: addr for slot, addr in node.hosts_slots().items() if addr is not None}


def slot_of(node: Node) -> int:
    """The node's settled slot, from /status."""
    slot = node.slot()
    assert slot is not None, node.name
    return slot


def pids(nodes: list[Node]) -> dict[str, int | None]:
    """Each node's daemon pid, from /status."""
    return {n.name: n.daemon_pid() for n in nodes}


def untouched(nodes: list[Node], before: dict[str, int | None]) -> list[str]:
    """What shows that a daemon of `nodes` was restarted or replaced (empty: none was)."""
    problems = []
    now = pids(nodes)
    for n in nodes:
        if now[n.name] != before[n.name]:
            problems.append(f"{n.name}: daemon pid {before[n.name]} -> {now[n.name]}")
        restarts = n.status().get("daemon", {}).get("restarts")
        if restarts != 0:
            problems.append(f"{n.name}: daemon restarts = {restarts}")
        if n.daemon_pids_on_host() != [before[n.name]]:
            problems.append(f"{n.name}: daemons on host {n.daemon_pids_on_host()}")
    return problems


async def end_in_process(
    nodes: Iterable[Node], runs: Iterable[tuple[asyncio.Event, asyncio.Task[int]]], wait_s: float
) -> None:
    """End in-process agents (`Agent.run` tasks): set every `stop`, give each task
    `wait_s` to leave, cancel what is left, then kill the nodes' daemons still running."""
    runs = list(runs)
    for stop, _ in runs:
        stop.set()
    for _, task in runs:
        with suppress(Exception):
            await asyncio.wait_for(asyncio.shield(task), wait_s)
        if not task.done():
            task.cancel()
    for node in nodes:
        for pid in node.daemon_pids_on_host():
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
