"""Benchmark: what three real imexd agents get from each MQTT broker that starts here.

    .venv/bin/python bench/brokers.py
    .venv/bin/python bench/brokers.py --brokers mosquitto-5,nats-cluster --keep

For each broker it can start on free loopback ports (Mosquitto 2 with MQTT 5, the same
Mosquitto with `[bus] protocol = "3.1.1"` forced, one nats-server with JetStream, a
three-server NATS cluster with `mqtt { stream_replicas: 3, consumer_replicas: 1 }`, a
private RabbitMQ node with its MQTT plugin, amqtt), the script runs three agents as
`imexd run` processes with simulated IMEX daemons (tests/cluster.py's `Node`: the demo's
fast timings, so `[bus] will_delay_s` = 2 s), on a dotted clique (`<uuid>.7`) with dotted
node names, and measures, each step bounded (a miss is printed as MISS, never hidden):

1. formation: from the agents' start until `imexd domain status d1 --nodes ... --wait`
   exits 0 (the control plane's judgement: every member READY and connected), and
   until every agent judges the domain UP with all three;
2. bus: the agents' BusConnected condition (True, or False with its reason, e.g.
   BrokerNoRetainedWildcard);
3. broker restart (SIGTERM, start on the same ports and store): from the stop until
   every agent linked up again, is synced and judges the domain UP; whether a retained
   marker published before survived (a new subscriber gets it; a refused subscription
   is retried, and none granted is "unknown", not "no"); daemons restarted and SIGUSR1
   per node meanwhile; what `imexd domain status` said (retried within 30 s);
4. server kill (NATS cluster only): SIGKILL the server the first agent is on; from the
   kill until that agent linked up elsewhere and every agent is connected, synced and UP
   (failover); how many agents lost their link; the same checks. Then the server
   rejoins: until the cluster and every agent are well again;
5. agent crash: SIGKILL one agent and its daemon; from the kill until neither peer's
   hosts block maps it (the Will Delay of 2 s, through the broker or the peers' hold).

A broker that cannot start within its bound is skipped with the reason. Everything runs
in a temporary folder (`--keep` keeps it, with every agent's JSON log); every process the
script started is ended on exit. The table's last lines are the broker versions. Not a
test: brokers differ, and so do loaded machines; docs/brokers.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import harness  # noqa: F401 - first: the checkout's tests on the path
import paho.mqtt.client as paho
import psutil
from harness import MosquittoTarget, NatsTarget, Target, pids_alive
from paho.mqtt.enums import CallbackAPIVersion

from imexd.demo import DemoError
from imexd.demo.brokers import free_port, log_tail
from imexd.names import client_id
from tests.cluster import Node
from tests.nats_servers import mqtt_connect_problem
from tests.support import imexd

DOMAIN: Final = "d1"
CLIQUE: Final = "b3c1d2e4-0000-4000-8000-00000000beef.7"
NODES: Final = ("gpu-1.bench.internal", "gpu-2.bench.internal", "gpu-3.bench.internal")
FORM_S: Final = 90.0
"""Bound on a formation (three agents and daemons on a loaded two-core machine)."""
RECOVER_S: Final = 60.0
"""Bound on the domain coming back after a broker restart or a server kill."""
DROP_S: Final = 30.0
"""Bound on the peers dropping a crashed node (the Will Delay is 2 s)."""
RABBIT_START_S: Final = 60.0
POLL_S: Final = 0.1
QUIET_S: Final = 5.0
"""After a failover: how long to keep watching for late effects before counting them."""
BROKERS: Final = ("mosquitto-5", "mosquitto-3.1.1", "nats", "nats-cluster", "rabbitmq", "amqtt")


# Brokers: the two only this benchmark starts (Mosquitto and NATS: `harness`).


def _otp_release() -> str:
    found = sorted(Path("/usr/lib/erlang/releases").glob("[0-9]*"))
    return found[-1].name if found else "unknown"


class RabbitTarget:
    """A private RabbitMQ node (its own name, ports, database, logs and plugins file in
    `folder`) with the MQTT plugin; the system's RabbitMQ, if any, is left alone."""

    protocol = "3.1.1"
    """RabbitMQ 3.10 closes the socket on an MQTT 5 CONNECT; "auto" costs a 10 s timeout."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.node = f"imexd-bench-{secrets.token_hex(3)}@localhost"
        self.amqp_port, self.dist_port, self.port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = folder / "rabbitmq.out"

    @property
    def urls(self) -> list[str]:
        return [f"mqtt://127.0.0.1:{self.port}"]

    @property
    def endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def _env(self) -> dict[str, str]:
        f = self.folder
        (f / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "mqtt.allow_anonymous = true\n"
            "loopback_users = none\n"
            "log.console = false\n"
        )
        (f / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "HOME": str(f),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(f / "mnesia"),
            "RABBITMQ_LOG_BASE": str(f / "log"),
            "RABBITMQ_CONFIG_FILE": str(f / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(f / "enabled_plugins"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(f / "plugins-expand"),
            "RABBITMQ_PID_FILE": str(f / "rabbitmq.pid"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(f / "feature_flags"),
            "RABBITMQ_QUORUM_DIR": str(f / "quorum"),
            "RABBITMQ_STREAM_DIR": str(f / "stream"),
        }

    def start(self) -> None:
        binary = "/usr/lib/rabbitmq/bin/rabbitmq-server"
        if not os.access(binary, os.X_OK):
            raise DemoError(f"{binary} is not installed")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary],
                env=self._env(),
                cwd=self.folder,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + RABBIT_START_S
        while problem := mqtt_connect_problem("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise DemoError(
                    f"RabbitMQ did not accept MQTT on port {self.port} within "
                    f"{RABBIT_START_S:g} s: {problem}\n{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the Erlang VM (a clean shutdown), SIGKILL to its group after 30 s."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        group = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            proc.wait(timeout=10)

    def version(self) -> str:
        plugins = sorted(Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*"))
        release = plugins[-1].name.split("-", 1)[1] if plugins else "unknown"
        return f"RabbitMQ {release} (rabbitmq_mqtt), Erlang/OTP {_otp_release()}"

    def processes(self) -> list[psutil.Process]:
        return pids_alive([self.proc.pid if self.proc is not None else None])


class AmqttTarget:
    """amqtt (the demo's Python broker) as its own process on a fixed port; MQTT 3.1.1."""

    protocol = "3.1.1"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = folder / "amqtt.log"

    @property
    def urls(self) -> list[str]:
        return [f"mqtt://127.0.0.1:{self.port}"]

    @property
    def endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def start(self) -> None:
        conf = self.folder / "amqtt.yaml"
        conf.write_text(
            "listeners:\n  default:\n    type: tcp\n"
            f"    bind: 127.0.0.1:{self.port}\n"
            "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "amqtt"), "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 20
        while problem := mqtt_connect_problem("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise DemoError(f"amqtt did not start: {problem}\n{log_tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def version(self) -> str:
        return f"amqtt {importlib.metadata.version('amqtt')}"

    def processes(self) -> list[psutil.Process]:
        return pids_alive([self.proc.pid if self.proc is not None else None])


def make_target(name: str, folder: Path) -> Target:
    if name == "mosquitto-5":
        return MosquittoTarget(folder, None)
    if name == "mosquitto-3.1.1":
        return MosquittoTarget(folder, "3.1.1")
    if name == "nats":
        return NatsTarget(folder, 1)
    if name == "nats-cluster":
        return NatsTarget(folder, 3)
    if name == "rabbitmq":
        return RabbitTarget(folder)
    if name == "amqtt":
        return AmqttTarget(folder)
    raise ValueError(f"unknown broker {name!r}: expected one of {', '.join(BROKERS)}")


# Measuring.


@dataclass
class Row:
    broker: str
    scenario: str
    value: str
    detail: str = ""


@dataclass
class Run:
    name: str
    target: Target
    folder: Path
    nodes: list[Node] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def row(self, scenario: str, value: str, detail: str = "") -> None:
        self.rows.append(Row(self.name, scenario, value, detail))
        print(f"  {scenario:<16} {value:<14} {detail}", flush=True)


def until(predicate: Callable[[], bool], bound_s: float) -> float | None:
    """Seconds until `predicate()` held (polled), None when it did not within `bound_s`."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > bound_s:
            return None
        time.sleep(POLL_S)


def domain_status(run: Run, wait_s: float) -> tuple[int, str]:
    """`imexd domain status` as a control plane would run it: exit status, last line."""
    env = {"IMEXD_BUS_URL": ",".join(run.target.urls)}
    if run.target.protocol is not None:
        env["IMEXD_BUS_PROTOCOL"] = run.target.protocol
    names = ",".join(n.name for n in run.nodes)
    command = ["domain", "status", DOMAIN, "--nodes", names, "--wait", f"{wait_s:g}"]
    try:
        proc = imexd(*command, env=env, timeout=wait_s + 30)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {wait_s + 30:g} s"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, lines[-1] if lines else ""


def domain_status_retried(run: Run, bound_s: float) -> str:
    """`domain status --wait 10`, again while it fails, until `bound_s` passed: what the
    control plane got (a NATS cluster refuses subscriptions for a while after a failure)."""
    deadline = time.monotonic() + bound_s
    tries = 0
    while True:
        tries += 1
        code, line = domain_status(run, 10.0)
        if code == 0:
            return "domain status UP" + (f" at try {tries}" if tries > 1 else "")
        if time.monotonic() > deadline:
            return f"domain status failed {tries} times, last exit {code}: {line}"


def all_up(nodes: list[Node], count: int) -> Callable[[], bool]:
    return lambda: all(n.ready() and n.up_with(count) for n in nodes)


def bus_conditions(nodes: list[Node]) -> str:
    """Each distinct BusConnected verdict of `nodes`, e.g. `True` or `False BrokerNo...`."""
    verdicts = []
    for node in nodes:
        cond = node.condition("BusConnected")
        verdicts.append(f"{cond.get('status', '?')} {cond.get('reason', '')}".strip())
    return ", ".join(sorted(set(verdicts)))


def links(nodes: list[Node]) -> dict[str, tuple[int, str]]:
    """Per node: how many bus links it brought up so far (its `bus_connected` log events)
    and the broker of the last one."""
    out = {}
    for node in nodes:
        events = node.log_events("bus_connected")
        out[node.name] = (len(events), str(events[-1].get("broker", "")) if events else "")
    return out


def back(nodes: list[Node], before: dict[str, tuple[int, str]], moved: list[str]) -> bool:
    """Every node of `moved` brought a new link up, every node's bus is connected and
    synced, and every node judges the domain UP with all of them."""
    now = links(nodes)
    return (
        all(now[name][0] > before[name][0] for name in moved)
        and all(n.condition("BusConnected").get("status") == "True" for n in nodes)
        and all_up(nodes, len(nodes))()
    )


def daemon_state(nodes: list[Node]) -> dict[str, tuple[int | None, int]]:
    """Per node: its daemon's pid and how many SIGUSR1 it got so far."""
    return {n.name: (n.daemon_pid(), len(n.reloads())) for n in nodes}


def daemon_changes(nodes: list[Node], before: dict[str, tuple[int | None, int]]) -> str:
    restarted = [n.name for n in nodes if n.daemon_pid() != before[n.name][0]]
    reloads = [len(n.reloads()) - before[n.name][1] for n in nodes]
    return f"daemons restarted: {len(restarted)}, SIGUSR1 per node: {reloads}"


class Marker:
    """A retained message outside imexd's topics: did the broker keep its retained state?"""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.topic = f"bench/marker/{secrets.token_hex(4)}"
        self.payload = secrets.token_hex(8).encode()

    @contextlib.contextmanager
    def _client(self) -> Iterator[paho.Client]:
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id("bench", secrets.token_hex(4)),
            protocol=paho.MQTTv311,
        )
        client.connect(*self.target.endpoint)
        client.loop_start()
        try:
            yield client
        finally:
            client.disconnect()
            client.loop_stop()

    def publish(self) -> None:
        with self._client() as client:
            client.publish(self.topic, self.payload, qos=1, retain=True).wait_for_publish(10)

    def kept(self, bound_s: float = 30.0) -> str:
        """Whether a new subscriber gets the marker, flagged retained: `yes`, `NO` (every
        subscription was granted, none got it) or why it is unknown. A subscription the
        broker refused (a NATS cluster shortly after a server died) is tried again with a
        new client, as is one granted without the marker, until `bound_s` passed."""
        deadline = time.monotonic() + bound_s
        refused = granted = 0
        while time.monotonic() < deadline:
            try:
                got, ok = self._read_once()
            except OSError:
                time.sleep(1.0)
                continue
            if got:
                return "yes"
            if ok:
                granted += 1
            else:
                refused += 1
                time.sleep(1.0)
        if granted:
            return f"NO ({granted} granted subscriptions without it, {refused} refused)"
        return f"unknown ({refused} subscriptions refused)"

    def _read_once(self) -> tuple[bool, bool]:
        """One new subscriber: (got the marker retained, the subscription was granted)."""
        got: list[bool] = []
        acks: list[bool] = []

        def on_message(_c: object, _u: object, message: paho.MQTTMessage) -> None:
            if message.payload == self.payload and message.retain:
                got.append(True)

        def on_subscribe(_c: object, _u: object, _mid: int, codes: list[Any], _p: object) -> None:
            acks.append(all(not code.is_failure for code in codes))

        with self._client() as client:
            client.on_message = on_message
            client.on_subscribe = on_subscribe
            client.subscribe(self.topic, qos=1)
            until(lambda: bool(got) or bool(acks), 10.0)
            if not got and acks and acks[0]:
                until(lambda: bool(got), 3.0)
        return bool(got), bool(acks) and acks[0]


def start_nodes(run: Run) -> None:
    urls = run.target.urls
    overrides = {} if run.target.protocol is None else {"bus": {"protocol": run.target.protocol}}
    for i, name in enumerate(NODES):
        shift = i % len(urls)
        node = Node(
            run.folder / "nodes",
            name,
            urls[shift:] + urls[:shift],
            domain=DOMAIN,
            clique=CLIQUE,
            overrides=overrides,
        )
        run.nodes.append(node)
    for node in run.nodes:
        node.start()


def formation(run: Run) -> bool:
    started = time.monotonic()
    start_nodes(run)
    code, line = domain_status(run, FORM_S)
    took = time.monotonic() - started
    if code != 0:
        run.row("formation", "MISS", f"domain status exit {code}: {line}")
    else:
        run.row("formation", f"{took:.1f} s", "domain status UP (start -> exit 0)")
    agents = until(all_up(run.nodes, len(run.nodes)), 10.0 if code else 30.0)
    run.row(
        "agents UP",
        "MISS" if agents is None else f"{time.monotonic() - started:.1f} s",
        "every agent judges the domain UP with all three",
    )
    run.row("BusConnected", bus_conditions(run.nodes))
    return code == 0 and agents is not None


def broker_restart(run: Run, marker: Marker) -> None:
    before, linked = daemon_state(run.nodes), links(run.nodes)
    started = time.monotonic()
    run.target.stop()
    run.target.start()
    restarted = time.monotonic() - started
    took = until(lambda: back(run.nodes, linked, list(linked)), RECOVER_S)
    kept = marker.kept()
    answer = domain_status_retried(run, 30.0)
    run.row(
        "broker restart",
        "MISS" if took is None else f"{restarted + took:.1f} s",
        f"stop -> every agent reconnected, synced, UP (broker back after {restarted:.1f} s); "
        f"retained kept: "
        f"{kept}; {daemon_changes(run.nodes, before)}" + f"; {answer}",
    )


def links_lost(nodes: list[Node], linked: dict[str, tuple[int, str]]) -> int:
    """How many of `nodes` brought up a new link since `linked` (i.e. lost theirs)."""
    now = links(nodes)
    return sum(1 for name, (count, _) in linked.items() if now[name][0] > count)


def server_kill(run: Run, marker: Marker) -> None:
    """SIGKILL the first agent's server, then start it again: each until all is well."""
    assert isinstance(run.target, NatsTarget)
    victim = run.target.servers[0]
    before, linked = daemon_state(run.nodes), links(run.nodes)
    moved = [name for name, (_, broker) in linked.items() if broker == victim.url]
    victim.kill()
    took = until(lambda: back(run.nodes, linked, moved), RECOVER_S)
    time.sleep(QUIET_S)  # what comes late (a second link loss, a rewrite) counts too
    kept = marker.kept()
    answer = domain_status_retried(run, 30.0)
    run.row(
        "server kill",
        "MISS" if took is None else f"{took:.1f} s",
        f"SIGKILL {victim.name} ({len(moved)} of {len(run.nodes)} agents on it) -> every "
        f"agent connected, synced, UP; links lost: {links_lost(run.nodes, linked)}; "
        f"retained kept: {kept}; {daemon_changes(run.nodes, before)}" + f"; {answer}",
    )
    before, linked = daemon_state(run.nodes), links(run.nodes)
    started = time.monotonic()
    try:
        victim.start()
        if run.target.cluster is not None:
            run.target.cluster.wait_ready(time.monotonic() + RECOVER_S)
    except DemoError as exc:
        run.row("server rejoin", "MISS", str(exc).splitlines()[0])
        return
    took = until(lambda: back(run.nodes, linked, []), RECOVER_S)
    time.sleep(QUIET_S)
    run.row(
        "server rejoin",
        "MISS" if took is None else f"{time.monotonic() - started - QUIET_S:.1f} s",
        f"{victim.name} started again -> cluster ready, every agent connected, synced, UP; "
        f"links lost: {links_lost(run.nodes, linked)}; {daemon_changes(run.nodes, before)}",
    )


def agent_crash(run: Run) -> None:
    victim, peers = run.nodes[-1], run.nodes[:-1]
    address = victim.address
    victim.crash()

    def dropped() -> bool:
        return all(address not in n.hosts_slots().values() for n in peers)

    took = until(dropped, DROP_S)
    run.row(
        "agent crash",
        "MISS" if took is None else f"{took:.1f} s",
        "SIGKILL agent and daemon -> no peer's hosts block maps it (will_delay_s = 2 s)",
    )


def end(run: Run) -> None:
    """SIGTERM every agent, kill what is left (agents, daemons), stop the broker."""
    for node in run.nodes:
        if node.alive():
            node.signal(signal.SIGTERM)
    for node in run.nodes:
        if node.proc is not None:
            try:
                node.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(timeout=5)
        for pid in node.daemon_pids_on_host():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    run.target.stop()


def bench(name: str, folder: Path) -> Run:
    target = make_target(name, folder / "broker")
    run = Run(name, target, folder)
    print(f"{name}:", flush=True)
    try:
        target.start()
    except DemoError as exc:
        run.row("start", "SKIP", str(exc).splitlines()[0])
        return run
    except BaseException:
        target.stop()
        raise
    try:
        if not formation(run):
            run.row("the rest", "SKIP", "the domain never formed")
            return run
        marker = Marker(target)
        marker.publish()
        if isinstance(target, NatsTarget) and target.cluster is not None:
            server_kill(run, marker)
        broker_restart(run, marker)
        agent_crash(run)
        problems = [line for n in run.nodes for line in n.log_problems()]
        if problems:
            run.row("agent logs", "PROBLEM", problems[0][:160])
    finally:
        end(run)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--brokers", default=",".join(BROKERS), help=f"comma-separated, of {', '.join(BROKERS)}"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    args = parser.parse_args()
    names = [b.strip() for b in args.brokers.split(",") if b.strip()]
    unknown = [b for b in names if b not in BROKERS]
    if unknown:
        parser.error(f"unknown broker(s) {unknown}: expected some of {', '.join(BROKERS)}")
    # SIGTERM ends the run as Ctrl-C does: through the cleanup of every `bench`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(tempfile.mkdtemp(prefix="imexd-brokers-"))
    runs: list[Run] = []
    load = os.getloadavg()
    try:
        for name in names:
            runs.append(bench(name, work / re.sub(r"[^a-z0-9]+", "-", name)))
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("| broker | scenario | value | detail |\n| --- | --- | --- | --- |")
    for run in runs:
        for row in run.rows:
            print(f"| {row.broker} | {row.scenario} | {row.value} | {row.detail} |")
    print()
    for run in runs:
        print(f"{run.name}: {run.target.version()}")
    print(f"load average at start: {load[0]:.1f} (1 min), {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
