"""Benchmark: how fast N imexd agents form IMEX domains and follow joins, leaves and crashes.

    .venv/bin/python bench/formation.py --nodes 4,18,72
    .venv/bin/python bench/formation.py --quick

For each N the script starts its own Mosquitto on a free loopback port, then runs N
agents *in this process* (N `Agent(settings).run()` coroutines in one event loop, each with
its own name, loopback address, state dir, run dir, hosts file and health port) and one
more agent as a real `imexd run` process. Their IMEX daemons are real simulator processes
(`imexd-sim-daemon`), or none at all with `--daemons none` (clique "": members without a
daemon, which write no IMEX files; membership is then read from the agent's state).

Nodes are grouped as a GB200 fleet is: groups of `--group-size` (default 18 = one NVL72)
nodes, one NVLink clique each, in one domain, so 72 nodes are four racks of 18 and the
bus is sharded per clique. Without daemons (clique "") a group is a domain of its own,
which shards the bus the same way.

Phases, in order, each ended by a bounded wait (a miss is reported, never hidden):
1. formation: all N agents start at once. Measured from the last agent connected (its
   first bus link up, CONNACK) until every node's hosts block maps every member of
   its group, identically on the whole group (read from the files each time an agent
   logs `file.written`), and until every node reports ready (/readyz: bus synced, slot
   settled, daemon RUNNING and READY, which needs `[daemon] start_s` = 3 s alive).
2. leave: one agent of group 0 is stopped (its stop event, as SIGTERM does): until no
   remaining node of group 0 maps it.
3. join: one more in-process agent: from its first bus link up until every node of
   group 0 (itself included) maps it.
4. join (process): if group 0 is full another agent leaves first; then one `imexd run`
   process joins (its link-up time is read from its JSON log).
5. idle: the process agent's RSS and CPU (psutil) over `--idle-s` seconds once the
   domain is formed and quiet; the bench process's CPU per in-process agent too.
6. crash: the process agent gets SIGKILL (its TCP link dies without DISCONNECT, as on a
   node crash): until no remaining node of group 0 maps it (Will Delay + settle).

Between phases the script waits until no daemon was started or signalled for
`reload_min_interval_s` + 0.5 s, so that SIGUSR1 deferred by the daemon's 5 s window is
counted in the phase that caused it.

Settings that differ from the shipped defaults (everything else is the default; the
script prints this list): per node `[node] name, address, clique, state_dir`,
`[domain] name`, `[bus] url`, `[imex] binary, ctl, run_dir, hosts_file, env`
(IMEXD_SIM_HOSTS_FILE, IMEXD_SIM_SIGNAL_LOG), `[health] listen`; and
`[bus] will_delay_s` = `--will-delay-s` (default 2 s instead of 5 s, so the crash phase
is short); `[daemon] probe_interval_s` and `domain_probe_interval_s` only when given on
the command line. `settle_s` stays 0.2 s, `reload_min_interval_s` 6 s, the simulator's
SIGUSR1 window 5 s, probes every 5 s (`ctl -q`) and 15 s (`ctl -N -j`), `start_s` 3 s.

Each phase also reports the messages through the broker, SIGUSR1 per node, CPU of the
agents, daemons and ctl probes, and how late this process's event loop ran (the time the
in-process agents waited for each other). `--profile PATH` writes a cProfile of
formation; docs/performance.md has the figures and what dominates them.

Every process the script starts (broker, agent process, daemons, ctl probes) has the
run's work folder on its command line; on exit, failure, SIGINT or SIGTERM it ends the
agents gracefully, then kills whatever still runs from that folder, then removes it
(`--keep` keeps it, with the agents' JSON logs).

One file on purpose (about 1500 lines): a script that is run, read and changed as one
experiment, not a library; its sections (log capture, the broker's view, nodes, figures,
one run with one method per phase, output, main) follow the order of a run. What it
shares with the demo and the tests (free ports, the Mosquitto launcher) it imports from
`imexd.demo.brokers`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TextIO

import aiomqtt
import psutil
import structlog

from imexd.agent import Agent
from imexd.demo.brokers import Mosquitto, free_port
from imexd.render import parse_hosts_block
from imexd.settings import Settings, render_toml, settings_from_mapping

VENV_BIN: Final = Path(sys.executable).parent
SIM_DAEMON: Final = VENV_BIN / "imexd-sim-daemon"
SIM_CTL: Final = VENV_BIN / "imexd-sim-ctl"
PREFIX: Final = "imex/v1"
DOMAIN: Final = "bench"
CLUSTER: Final = "b3c1d2e4-0000-4000-8000-00000000beef"
INF: Final = float("inf")
POLL_S: Final = 0.005
"""Polling period of the views (the hosts files are read only when an agent wrote them)."""
RELOAD_MIN_INTERVAL_S: Final = 6.0
"""The agent's default `[imex] reload_min_interval_s` (the quiet time between phases)."""
JOIN_TARGET_S: Final = 0.5
LEAVE_TARGET_S: Final = 0.5
FORMATION_TARGET_S: Final = 1.0
FORMATION_TARGET_N: Final = 18
RSS_TARGET_MB: Final = 55.0
CPU_TARGET_PCT: Final = 0.5
SYS_INTERVAL: Final = "sys_interval 1"
"""Mosquitto publishes its $SYS counters every second (the messages of each phase)."""
CAPTURED: Final = frozenset(
    {
        "bus_connected",
        "file.written",
        "daemon.state",
        "daemon.reload",
        "daemon.adopted",
        "membership.step",
    }
)


class BenchError(Exception):
    """A phase did not complete in time, or the setup failed."""


# Processes ----------------------------------------------------------------------------


def sweep(root: Path) -> int:
    """SIGKILL every process (but this one) whose command line names `root`."""
    needle = str(root)
    killed = 0
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        cmdline = proc.info.get("cmdline") or []
        if any(needle in part for part in cmdline):
            with contextlib.suppress(psutil.Error):
                proc.kill()
                killed += 1
    return killed


# Log capture: the in-process agents' events, with monotonic timestamps ------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """One captured log event of an in-process agent."""

    at: float
    node: str
    event: str
    fields: Mapping[str, Any]


class Capture:
    """A structlog processor that keeps the events the benchmark times, then passes on."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def __call__(
        self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        name = event_dict.get("event")
        if name in CAPTURED:
            node = str(event_dict.get("bench_node") or event_dict.get("node") or "")
            self.seen.append(Seen(time.monotonic(), node, str(name), dict(event_dict)))
        return event_dict

    def events(
        self, event: str, *, node: str | None = None, after: float = 0.0, before: float = INF
    ) -> list[Seen]:
        return [
            s
            for s in self.seen
            if s.event == event and after <= s.at <= before and (node is None or s.node == node)
        ]


def configure_capture(capture: Capture, out: TextIO) -> None:
    """Route the in-process agents' logs (JSON, level info, as shipped) through `capture`."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            capture,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


# The broker's view ---------------------------------------------------------------------


def topic_kind(topic: str) -> str:
    parts = topic.split("/")
    if topic.startswith("$SYS/"):
        return "$SYS"
    if len(parts) >= 5 and parts[2] == "domains":
        return parts[4]  # members, health, spec
    if len(parts) >= 5 and parts[2] == "nodes":
        return parts[4]  # ping, assignment
    return "other"


@dataclass
class BrokerCounts:
    """Running totals of what went through the broker.

    Mosquitto 2.0's `$SYS/broker/publish/messages/received` stays 0 for QoS 1 publishes,
    so the publishes in are counted at the benchmark's subscriber, which sees them all.
    """

    publishes: int = 0
    """Publishes on `imex/v1/#` (seen by the benchmark's subscriber)."""
    sent: int = 0
    """`$SYS/broker/publish/messages/sent`: PUBLISH packets the broker delivered."""
    packets_in: int = 0
    """`$SYS/broker/messages/received`: MQTT packets of any type received."""
    packets_out: int = 0
    """`$SYS/broker/messages/sent`: MQTT packets of any type sent."""
    monitor: int = 0
    """Messages delivered to the benchmark's own subscriber (subtracted from the sent)."""

    def __sub__(self, other: BrokerCounts) -> BrokerCounts:
        mine = self.monitor - other.monitor
        return BrokerCounts(
            publishes=self.publishes - other.publishes,
            sent=self.sent - other.sent - mine,
            packets_in=self.packets_in - other.packets_in,
            packets_out=self.packets_out - other.packets_out - mine,
            monitor=mine,
        )


class Monitor:
    """A subscriber on `imex/v1/#` and `$SYS/broker/#` that counts what the agents publish."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.published: list[tuple[float, str]] = []
        self.total = 0
        self.sys: dict[str, int] = {}
        self.tick = asyncio.Event()
        self.up = asyncio.Event()

    async def run(self) -> None:
        async with aiomqtt.Client("127.0.0.1", self.port, identifier="imexd-bench-monitor") as c:
            await c.subscribe(f"{PREFIX}/#")
            await c.subscribe("$SYS/broker/#")
            self.up.set()
            async for message in c.messages:
                self.total += 1
                topic = message.topic.value
                if topic.startswith("$SYS/"):
                    payload = message.payload
                    text = payload.decode() if isinstance(payload, bytes) else str(payload)
                    with contextlib.suppress(ValueError):
                        self.sys[topic] = int(text.split()[0])
                    if topic == "$SYS/broker/uptime":
                        self.tick.set()
                else:
                    self.published.append((time.monotonic(), topic_kind(topic)))

    async def snapshot(self) -> BrokerCounts:
        """The broker's counters at its next $SYS tick (at most ~1 s from now)."""
        self.tick.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3.0):
                await self.tick.wait()
        await asyncio.sleep(0.1)  # the rest of this tick's $SYS messages
        return BrokerCounts(
            publishes=len(self.published),
            sent=self.sys.get("$SYS/broker/publish/messages/sent", 0),
            packets_in=self.sys.get("$SYS/broker/messages/received", 0),
            packets_out=self.sys.get("$SYS/broker/messages/sent", 0),
            monitor=self.total,
        )

    def kinds(self, after: float, before: float) -> Counter[str]:
        return Counter(kind for at, kind in self.published if after <= at <= before)


class LoopLag:
    """How late this process's event loop runs a 10 ms timer: the time every in-process
    agent waited, on top of its own work, because another one held the loop."""

    PERIOD_S: Final = 0.01

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.PERIOD_S)
            late = loop.time() - before - self.PERIOD_S
            if late > 0.005:
                self.samples.append((time.monotonic(), late))

    def describe(self, after: float, before: float) -> str:
        late = [lag for at, lag in self.samples if after <= at <= before]
        if not late:
            return "event loop never late by > 5 ms"
        return (
            f"event loop late by > 5 ms {len(late)} times, at most {max(late) * 1000:.0f} ms, "
            f"{sum(late):.2f} s in all"
        )


# Nodes ---------------------------------------------------------------------------------


class Node:
    """One simulated GPU node: its folder, address, files, and what its files say."""

    def __init__(self, run: Run, name: str, group: int, host: int) -> None:
        self.run = run
        self.name = name
        self.group = group
        self.address = f"127.{run.octet}.{group}.{host}"
        self.dir = run.root / name
        self.dir.mkdir(parents=True)
        self.hosts_file = self.dir / "hosts"
        self.hosts_file.write_text("127.0.0.1 localhost\n")
        self.signal_log = self.dir / "signals.log"
        self.view: dict[int, str] = {}
        """slot -> address of the members its files map (or its membership, no daemon)."""
        self.view_at = 0.0
        self.ready_at: float | None = None

    def sections(self, health_listen: str) -> dict[str, dict[str, Any]]:
        """The node's settings: the shipped defaults but for what the docstring lists."""
        daemons = self.run.daemons
        domain = DOMAIN if daemons else f"{DOMAIN}-g{self.group}"
        return {
            "node": {
                "name": self.name,
                "address": self.address,
                "clique": f"{CLUSTER}.{self.group}" if daemons else "",
                "state_dir": str(self.dir / "state"),
            },
            "domain": {"name": domain, "max_nodes": self.run.opts.max_nodes},
            "bus": {"url": [self.run.broker.url], "will_delay_s": self.run.opts.will_delay_s},
            "imex": {
                "binary": str(SIM_DAEMON),
                "ctl": str(SIM_CTL),
                "run_dir": str(self.dir / "run"),
                "hosts_file": str(self.hosts_file),
                "env": {
                    "IMEXD_SIM_HOSTS_FILE": str(self.hosts_file),
                    "IMEXD_SIM_SIGNAL_LOG": str(self.signal_log),
                },
            },
            "health": {"listen": health_listen},
            "daemon": self.run.daemon_overrides(),
        }

    def read_hosts(self) -> dict[int, str]:
        try:
            parsed = parse_hosts_block(self.hosts_file.read_text())
        except OSError:
            return {}
        if parsed is None:
            return {}
        return {slot: addr for slot, addr in parsed[1].items() if addr is not None}

    def signals(self) -> Counter[str]:
        """`SIGUSR1 honoured`, `SIGUSR1 ignored`, ... from the simulator's signal log."""
        try:
            lines = self.signal_log.read_text().splitlines()
        except FileNotFoundError:
            return Counter()
        return Counter(" ".join(line.split()[1:3]) for line in lines if line.strip())


class InProcNode(Node):
    """An agent running as a coroutine of this process."""

    def __init__(self, run: Run, name: str, group: int, host: int) -> None:
        super().__init__(run, name, group, host)
        self.settings: Settings = settings_from_mapping(self.sections("127.0.0.1:0"))
        self.stop = asyncio.Event()
        self.handover = asyncio.Event()
        self.agent: Agent | None = None
        self.task: asyncio.Task[int] | None = None
        self.started_at = 0.0

    def start(self) -> None:
        self.agent = Agent(self.settings)
        self.started_at = time.monotonic()
        self.task = asyncio.create_task(self._main(self.agent), name=f"agent-{self.name}")

    async def _main(self, agent: Agent) -> int:
        # Tasks the agent creates inherit this context: its daemon's events carry our name.
        structlog.contextvars.bind_contextvars(bench_node=self.name)
        return await agent.run(stop=self.stop, handover=self.handover)

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def refresh(self) -> None:
        """Without daemons no file is written: take the agent's membership instead."""
        if self.agent is None or self.run.daemons:
            return
        members = {slot: m.address for slot, m in self.agent.desired.members.items()}
        if members != self.view:
            self.view, self.view_at = members, time.monotonic()

    def is_ready(self) -> bool:
        return self.agent is not None and self.agent.health.is_ready

    def connected_at(self, *, will: bool = False) -> float | None:
        """When its bus link first came up (CONNACK); with `will`, the first link that
        carried its Last Will (the agent reconnects once it knows its member topic)."""
        ups = [
            s.at
            for s in self.run.capture.events("bus_connected", node=self.name)
            if s.fields.get("will") or not will
        ]
        return ups[0] if ups else None

    def daemon_starts(self) -> int:
        states = self.run.capture.events("daemon.state", node=self.name)
        adopted = self.run.capture.events("daemon.adopted", node=self.name)
        return sum(1 for s in states if s.fields.get("to") == "STARTING") + len(adopted)


class ProcNode(Node):
    """An agent as shipped: an `imexd run` process with its own JSON log."""

    def __init__(self, run: Run, name: str, group: int, host: int) -> None:
        super().__init__(run, name, group, host)
        self.health_port = free_port()
        self.config = self.dir / "imexd.toml"
        sections = self.sections(f"127.0.0.1:{self.health_port}")
        sections["log"] = {"level": "info", "format": "json"}
        self.config.write_text(render_toml(sections))
        self.log_path = self.dir / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.killed_at: float | None = None
        self._hosts_mtime = 0

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
        with self.log_path.open("ab") as log:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "imexd", "run", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def refresh(self) -> None:
        if not self.run.daemons:
            return
        try:
            mtime = self.hosts_file.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._hosts_mtime:
            self._hosts_mtime = mtime
            view = self.read_hosts()
            if view != self.view:
                self.view, self.view_at = view, time.monotonic()

    async def is_ready(self) -> bool:
        try:
            async with asyncio.timeout(1.0):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.health_port)
                writer.write(b"GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                await writer.drain()
                line = await reader.readline()
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        except (OSError, TimeoutError):
            return False
        parts = line.split()
        return len(parts) >= 2 and parts[1] == b"200"

    def log_events(self, event: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                if f'"{event}"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    data = json.loads(line)
                    if isinstance(data, dict) and data.get("event") == event:
                        found.append(data)
        return found

    def connected_at(self) -> float | None:
        """Its first link-up time, from its log, on this process's monotonic clock."""
        ups = self.log_events("bus_connected")
        if not ups:
            return None
        wall = datetime.fromisoformat(str(ups[0]["timestamp"])).timestamp()
        return wall - (time.time() - time.monotonic())

    def daemon_starts(self) -> int:
        states = self.log_events("daemon.state")
        return sum(1 for e in states if e.get("to") == "STARTING") + len(
            self.log_events("daemon.adopted")
        )

    def usage(self) -> psutil.Process | None:
        if not self.alive:
            return None
        assert self.proc is not None
        return psutil.Process(self.proc.pid)


# Figures -------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured figure, next to its target when the issue sets one."""

    name: str
    value: float | None
    unit: str
    target: str = ""
    ok: bool | None = None
    """True: PASS, False: MISS, None: no target (information)."""
    note: str = ""

    @property
    def verdict(self) -> str:
        return "" if self.ok is None else "PASS" if self.ok else "MISS"

    def shown(self) -> str:
        if self.value is None:
            return "n/a"
        if self.unit == "s":
            return f"{self.value:.3f} s"
        if self.unit in ("", "count"):
            return f"{self.value:g}"
        return f"{self.value:.2f} {self.unit}"


@dataclass
class Result:
    """The figures of one run (one N, one daemon mode)."""

    n: int
    daemons: bool
    figures: list[Figure] = field(default_factory=list)
    error: str = ""
    load: str = ""

    @property
    def anomalous(self) -> bool:
        """A failure the logs should explain (kept even without --keep): an error, a
        daemon started more than once, or a node never ready."""
        return bool(self.error) or any(
            f.ok is False and f.name.startswith(("daemon starts", "formation: nodes never"))
            for f in self.figures
        )

    def add(
        self,
        name: str,
        value: float | None,
        unit: str = "s",
        *,
        below: float | None = None,
        target: str = "",
        ok: bool | None = None,
        note: str = "",
        files: bool = False,
    ) -> Figure:
        """One figure; `files`: a convergence time that the targets define on the files,
        which nodes without a daemon do not write (then no verdict, only the value)."""
        if below is not None:
            target = target or f"< {below:g} {unit}".rstrip()
            ok = value is not None and value < below
        if files and not self.daemons:
            name = name.replace("files final", "memberships final")
            ok = None
            note = "membership as the agents hold it (no files without a daemon)" + (
                f"; {note}" if note else ""
            )
        figure = Figure(name, value, unit, target, ok, note)
        self.figures.append(figure)
        return figure


def cpu_seconds(procs: Iterable[psutil.Process]) -> dict[int, float]:
    """pid -> user + system CPU seconds of each process still alive."""
    out: dict[int, float] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
    return out


def cpu_busy() -> Callable[[], float]:
    """A stopwatch of the whole machine's CPU use, in cores busy on average."""
    start, at = psutil.cpu_times(), time.monotonic()

    def busy() -> float:
        now, end = psutil.cpu_times(), time.monotonic()
        idle = (now.idle + now.iowait) - (start.idle + start.iowait)
        return max(0.0, (end - at) * (psutil.cpu_count() or 1) - idle) / max(end - at, 1e-9)

    return busy


# One run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    nodes: tuple[int, ...]
    daemons: tuple[bool, ...]
    group_size: int
    max_nodes: int
    will_delay_s: float
    idle_s: float
    repeat: int
    keep: bool
    workdir: Path | None
    json_out: Path | None
    profile: Path | None
    max_load: float | None
    probe_interval_s: float | None
    domain_probe_interval_s: float | None


class Run:
    """One benchmark run: a broker, N in-process agents, one agent process, the phases."""

    def __init__(self, opts: Options, n: int, *, daemons: bool, root: Path, octet: int) -> None:
        self.opts = opts
        self.n = n
        self.daemons = daemons
        self.root = root
        self.octet = octet
        self.capture = Capture()
        self.broker = Mosquitto(root / "broker", extra_config=SYS_INTERVAL)
        self.monitor = Monitor(self.broker.port)
        self.nodes: list[InProcNode] = []
        self.proc: ProcNode | None = None
        self.result = Result(n, daemons)
        self._monitor_task: asyncio.Task[None] | None = None
        self.lag = LoopLag()
        self._lag_task: asyncio.Task[None] | None = None
        self._seen_index = 0
        self._counts = BrokerCounts()
        """The broker's counters at the end of the last phase (its messages start there)."""

    # Helpers.

    def daemon_overrides(self) -> dict[str, Any]:
        """`[daemon]` keys changed on the command line (none by default)."""
        out: dict[str, Any] = {}
        if self.opts.probe_interval_s is not None:
            out["probe_interval_s"] = self.opts.probe_interval_s
        if self.opts.domain_probe_interval_s is not None:
            out["domain_probe_interval_s"] = self.opts.domain_probe_interval_s
        return out

    def log(self, text: str) -> None:
        print(f"  [{'sim' if self.daemons else 'none'} N={self.n}] {text}", flush=True)

    def group(self, g: int) -> list[Node]:
        members: list[Node] = [n for n in self.nodes if n.group == g and n.alive]
        if self.proc is not None and self.proc.alive and self.proc.group == g:
            members.append(self.proc)
        return members

    def refresh(self) -> None:
        """Bring every node's view up to date: read the hosts files agents just wrote."""
        seen = self.capture.seen
        written: dict[str, float] = {}
        while self._seen_index < len(seen):
            s = seen[self._seen_index]
            self._seen_index += 1
            if s.event == "file.written" and str(s.fields.get("path", "")).endswith("/hosts"):
                written[s.node] = s.at
        if written:
            for node in self.nodes:
                at = written.get(node.name)
                if at is not None:
                    view = node.read_hosts()
                    if view != node.view:
                        node.view, node.view_at = view, at
        for node in self.nodes:
            node.refresh()
        if self.proc is not None:
            self.proc.refresh()

    async def wait_views(
        self, expected: Mapping[Node, frozenset[str]], limit_s: float, what: str
    ) -> tuple[float, list[float]]:
        """Wait until each node maps exactly its expected addresses, the same map on each
        group; the time that became true, and each node's own time."""
        deadline = time.monotonic() + limit_s
        while True:
            self.refresh()
            done = all(
                frozenset(node.view.values()) == addrs and len(node.view) == len(addrs)
                for node, addrs in expected.items()
            )
            if done:
                maps: dict[int, dict[int, str]] = {}
                consistent = True
                for node in expected:
                    first = maps.setdefault(node.group, node.view)
                    consistent = consistent and first == node.view
                if consistent:
                    times = [node.view_at for node in expected]
                    return max(times), times
            if time.monotonic() > deadline:
                missing = [
                    f"{node.name} maps {len(node.view)}/{len(addrs)}"
                    for node, addrs in expected.items()
                    if frozenset(node.view.values()) != addrs
                ]
                raise BenchError(f"{what}: not converged in {limit_s:g} s: {missing[:5]}")
            await asyncio.sleep(POLL_S)

    def expect_groups(self, groups: Iterable[int]) -> dict[Node, frozenset[str]]:
        expected: dict[Node, frozenset[str]] = {}
        for g in groups:
            members = self.group(g)
            addrs = frozenset(n.address for n in members)
            for node in members:
                expected[node] = addrs
        return expected

    async def wait_ready(self, nodes: Sequence[Node], limit_s: float, what: str) -> float | None:
        """When the last of `nodes` became ready; None (and a MISS saying why) after
        `limit_s`: the other phases are still measured."""
        deadline = time.monotonic() + limit_s
        while True:
            now = time.monotonic()
            for node in nodes:
                if node.ready_at is None:
                    if isinstance(node, InProcNode):
                        ready = node.is_ready()
                    elif isinstance(node, ProcNode):
                        ready = await node.is_ready()
                    else:
                        ready = False
                    if ready:
                        node.ready_at = now
            if all(node.ready_at is not None for node in nodes):
                return max(node.ready_at or 0.0 for node in nodes)
            if now > deadline:
                late = [n for n in nodes if n.ready_at is None]
                why = [
                    f"{n.name}: {n.agent.health.summary()}"
                    for n in late[:3]
                    if isinstance(n, InProcNode) and n.agent is not None
                ]
                self.result.add(
                    f"{what}: nodes never ready",
                    len(late),
                    "count",
                    target=f"0 within {limit_s:g} s",
                    ok=False,
                    note="; ".join(why) or ", ".join(n.name for n in late[:5]),
                )
                self.log(f"{what}: {len(late)} nodes not ready in {limit_s:g} s: {why}")
                return None
            await asyncio.sleep(0.02)

    async def quiesce(self, limit_s: float = 30.0) -> None:
        """Until no daemon was started or signalled for the reload interval + 0.5 s, and no
        file written for 0.5 s: every deferred SIGUSR1 of the phase has been sent."""
        if not self.daemons:
            await asyncio.sleep(0.5)
            return
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            last_daemon = max(
                (
                    s.at
                    for s in self.capture.seen[-2000:]
                    if s.event == "daemon.reload"
                    or (s.event == "daemon.state" and s.fields.get("to") == "STARTING")
                ),
                default=0.0,
            )
            last_file = max(
                (s.at for s in self.capture.seen[-2000:] if s.event == "file.written"),
                default=0.0,
            )
            now = time.monotonic()
            if now - last_daemon > RELOAD_MIN_INTERVAL_S + 0.5 and now - last_file > 0.5:
                return
            await asyncio.sleep(0.1)
        self.log(f"warning: not quiet after {limit_s:g} s")

    def reloads(self, after: float, before: float) -> Counter[str]:
        return Counter(
            s.node for s in self.capture.events("daemon.reload", after=after, before=before)
        )

    def add_messages(
        self, phase: str, before: BrokerCounts, after: BrokerCounts, t0: float, t1: float
    ) -> None:
        kinds = self.monitor.kinds(t0, t1)
        d = after - before
        detail = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        self.result.add(
            f"{phase}: publishes in (deliveries out)",
            d.publishes,
            "count",
            note=f"out {d.sent}; by topic: {detail}; MQTT packets in {d.packets_in}, "
            f"out {d.packets_out}",
        )

    def add_reloads(self, phase: str, t0: float, t1: float, nodes: Sequence[Node]) -> None:
        if not self.daemons:
            return
        per_node = self.reloads(t0, t1)
        counts = [per_node.get(n.name, 0) for n in nodes if isinstance(n, InProcNode)]
        self.result.add(
            f"{phase}: SIGUSR1 sent per node (max)",
            max(counts, default=0),
            "count",
            note=f"total {sum(counts)} over {len(counts)} in-process nodes",
        )

    def new_node(self, name: str, group: int, host: int) -> InProcNode:
        node = InProcNode(self, name, group, host)
        self.nodes.append(node)
        return node

    # The phases: `execute` runs them in order, each one a method.

    async def execute(self) -> Result:
        """Every phase in order (the module docstring says what each one measures)."""
        groups = await self._start()
        await self._formation(groups)
        await self._leave()
        await self._join()
        await self._join_process()
        await self.measure_idle()
        victim = await self._crash()
        self._over_the_run(victim)
        return self.result

    async def _start(self) -> list[int]:
        """The broker, its monitor, the loop-lag probe and the nodes (not started yet);
        the node groups."""
        self.broker.start()
        self._monitor_task = asyncio.create_task(self.monitor.run(), name="monitor")
        self._lag_task = asyncio.create_task(self.lag.run(), name="loop-lag")
        async with asyncio.timeout(10):
            await self.monitor.up.wait()
        gs = self.opts.group_size
        for i in range(self.n):
            self.new_node(f"node-{i:03d}", i // gs, 10 + i % gs)
        groups = sorted({n.group for n in self.nodes})
        load = os.getloadavg()
        self.result.load = f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the run"
        self.log(f"{len(groups)} group(s) of <= {gs}; {self.result.load}")
        return groups

    async def _formation(self, groups: list[int]) -> None:
        """1. All agents start at once: until every file is final and every node ready."""
        r = self.result
        counts0 = await self.monitor.snapshot()
        busy = cpu_busy()
        me = psutil.Process()
        cpu0 = me.cpu_times()
        profiler = cProfile.Profile() if self.opts.profile is not None else None
        t_start = time.monotonic()
        if profiler is not None:
            profiler.enable()
        for node in self.nodes:
            node.start()
        t_files, per_node = await self.wait_views(
            self.expect_groups(groups), 60 + 2 * self.n, "formation"
        )
        cpu1 = me.cpu_times()
        ups = [n.connected_at() for n in self.nodes]
        will_ups = [n.connected_at(will=True) for n in self.nodes]
        if any(u is None for u in ups) or any(u is None for u in will_ups):
            raise BenchError("formation: an agent's files are final before its link is up")
        t_conn = max(u for u in ups if u is not None)
        t_will = max(u for u in will_ups if u is not None)
        r.add(
            "startup: start -> last agent connected",
            t_conn - t_start,
            note=f"{self.n} agents started at once; the last link with its will "
            f"{t_will - t_conn:+.3f} s later (reconnect when the will is set)",
        )
        r.add(
            "formation: last connected -> all files final",
            t_files - t_conn,
            below=FORMATION_TARGET_S if self.n == FORMATION_TARGET_N else None,
            files=True,
            note=f"per node p50 {statistics.median(per_node) - t_conn:.3f} s; "
            + self.lag.describe(t_conn, t_files),
        )
        settled = [
            min(
                (
                    s.at
                    for s in self.capture.events("membership.step", node=n.name)
                    if s.fields.get("phase") == "member"
                ),
                default=t_files,
            )
            for n in self.nodes
        ]
        r.add(
            "formation: last connected -> all slots settled",
            max(settled) - t_conn,
            note="every agent published its member record (files follow after settle_s)",
        )
        spent = cpu1.user + cpu1.system - cpu0.user - cpu0.system
        r.add(
            "formation: CPU of the in-process agents",
            spent,
            "CPU-s",
            note=f"start -> files final, all {self.n} agents: {spent / self.n * 1000:.0f} ms "
            "per agent, serialised on one core here",
        )
        if profiler is not None and self.opts.profile is not None:
            profiler.disable()
            target = self.opts.profile.with_name(
                f"{self.opts.profile.name}.{'sim' if self.daemons else 'none'}-{self.n}"
            )
            profiler.dump_stats(target)
            self.log(f"profile of start -> all files final written to {target}")
        t_ready = await self.wait_ready(self.nodes, 60 + 2 * self.n, "formation")
        if t_ready is not None:
            r.add(
                "formation: last connected -> all ready",
                t_ready - t_conn,
                note=f"files final -> all ready {t_ready - t_files:.3f} s "
                "(daemon start_s 3 s, first probe)",
            )
        formation_busy = busy()
        daemons_cpu = sum(cpu_seconds(self.daemon_processes()).values())
        if self.daemons:
            r.add(
                "formation: CPU of the simulated daemons",
                daemons_cpu,
                "CPU-s",
                note="start-up of the simulator (a Python program) and its peer links",
            )
        await self.quiesce()
        t_end = time.monotonic()
        self._counts = await self.monitor.snapshot()
        self.add_messages("formation", counts0, self._counts, t_start, t_end)
        self.add_reloads("formation", t_start, t_end, self.nodes)
        r.add("formation: machine CPU busy", formation_busy, "cores", note="start -> all ready")
        ready_text = "never" if t_ready is None else f"{t_ready - t_conn:.3f} s"
        self.log(f"formed: files {t_files - t_conn:.3f} s, ready {ready_text}")

    async def _leave(self) -> None:
        """2. One agent of group 0 leaves gracefully (its stop event, as SIGTERM does)."""
        r = self.result
        leaver = self.group(0)[-1]
        assert isinstance(leaver, InProcNode)
        t0 = time.monotonic()
        leaver.stop.set()
        t_left = await self._wait_gone(leaver, 20, "leave")
        r.add(
            "leave: stop -> visible on all",
            t_left - t0,
            below=LEAVE_TARGET_S,
            files=True,
            note=self.lag.describe(t0, t_left),
        )
        assert leaver.task is not None
        async with asyncio.timeout(30):
            code = await leaver.task
        r.add("leave: stop -> agent exited", time.monotonic() - t0, note=f"exit {code}")
        await self.quiesce()
        t1 = time.monotonic()
        before, self._counts = self._counts, await self.monitor.snapshot()
        self.add_messages("leave", before, self._counts, t0, t1)
        self.add_reloads("leave", t0, t1, self.group(0))
        self.log(f"leave: {t_left - t0:.3f} s")

    async def _join(self) -> None:
        """3. One more in-process agent joins group 0."""
        joiner = self.new_node("join-000", 0, 200)
        t0 = time.monotonic()
        joiner.start()
        t_join, _ = await self.wait_views(self.expect_groups([0]), 30, "join")
        up = joiner.connected_at()
        if up is None:
            raise BenchError("join: files final before the joiner's link is up")
        self.result.add(
            "join: connected -> visible on all",
            t_join - up,
            below=JOIN_TARGET_S,
            files=True,
            note=f"start -> visible {t_join - t0:.3f} s; " + self.lag.describe(up, t_join),
        )
        await self.wait_ready([joiner], 30, "join")
        await self.quiesce()
        t1 = time.monotonic()
        before, self._counts = self._counts, await self.monitor.snapshot()
        self.add_messages("join", before, self._counts, t0, t1)
        self.add_reloads("join", t0, t1, self.group(0))
        self.log(f"join: {t_join - up:.3f} s")

    async def _join_process(self) -> None:
        """4. An `imexd run` process joins group 0 (after another leave when it is full)."""
        if len(self.group(0)) >= self.opts.max_nodes:
            second = self.group(0)[-2]
            assert isinstance(second, InProcNode)
            t0 = time.monotonic()
            second.stop.set()
            t_left2 = await self._wait_gone(second, 20, "leave 2")
            self.result.add(
                "leave 2 (room for the process): visible on all",
                t_left2 - t0,
                below=LEAVE_TARGET_S,
                files=True,
            )
            await self.quiesce()
        self.proc = ProcNode(self, "proc-000", 0, 220)
        t0 = time.monotonic()
        self.proc.start()
        expected = self.expect_groups([0])
        if not self.daemons:
            expected.pop(self.proc)  # no files, and its membership is not in this process
        t_pjoin, _ = await self.wait_views(expected, 60, "join (process)")
        pup = self.proc.connected_at()
        self.result.add(
            "join (process agent): connected -> visible on all",
            None if pup is None else t_pjoin - pup,
            below=JOIN_TARGET_S,
            files=True,
            note=f"process start -> visible {t_pjoin - t0:.3f} s (includes Python start-up)",
        )
        await self.wait_ready([self.proc], 60, "join (process)")
        await self.quiesce()

    async def _crash(self) -> ProcNode:
        """6. SIGKILL the agent process: until no other node of group 0 maps it."""
        assert self.proc is not None
        counts4 = await self.monitor.snapshot()
        victim = self.proc
        t0 = time.monotonic()
        victim.kill()
        t_crash = await self._wait_gone(victim, self.opts.will_delay_s + 20, "crash")
        will = self.opts.will_delay_s
        self.result.add(
            "crash: SIGKILL -> visible on all",
            t_crash - t0,
            below=will + 0.5,
            files=True,
            target=f"< {will + 0.5:g} s (will delay {will:g} s + 0.5 s)",
            note=self.lag.describe(t0 + will, t_crash),
        )
        await self.quiesce()
        t1 = time.monotonic()
        self._counts = await self.monitor.snapshot()
        self.add_messages("crash", counts4, self._counts, t0, t1)
        self.add_reloads("crash", t0, t1, self.group(0))
        self.log(f"crash: {t_crash - t0:.3f} s")
        return victim

    def _over_the_run(self, victim: ProcNode) -> None:
        """Daemon starts and SIGUSR1 over the whole run (with simulated daemons)."""
        if not self.daemons:
            return
        r = self.result
        starts = {n.name: n.daemon_starts() for n in self.nodes}
        starts[victim.name] = victim.daemon_starts()
        wrong = sorted(k for k, v in starts.items() if v != 1)
        r.add(
            "daemon starts per node (min..max)",
            max(starts.values()),
            "count",
            target="exactly 1",
            ok=not wrong,
            note=f"min {min(starts.values())} over {len(starts)} nodes"
            + (f"; not 1: {wrong[:5]}" if wrong else ""),
        )
        signals = Counter[str]()
        per_node = []
        everyone: list[Node] = [*self.nodes, victim]
        for member in everyone:
            sig = member.signals()
            signals += sig
            per_node.append(sig.get("SIGUSR1 honoured", 0) + sig.get("SIGUSR1 ignored", 0))
        r.add(
            "SIGUSR1 per node over the run (max)",
            max(per_node),
            "count",
            note=f"mean {statistics.mean(per_node):.2f}; honoured {signals['SIGUSR1 honoured']}",
        )
        r.add(
            "SIGUSR1 inside the daemon's window (ignored)",
            signals["SIGUSR1 ignored"],
            "count",
            target="0",
            ok=signals["SIGUSR1 ignored"] == 0,
        )

    async def _wait_gone(self, gone: Node, limit_s: float, what: str) -> float:
        """Until the rest of its group maps the others and not `gone`."""
        expected = {
            node: frozenset(m.address for m in self.group(gone.group) if m is not gone)
            for node in self.group(gone.group)
            if node is not gone
        }
        if not self.daemons and self.proc in expected:
            expected.pop(self.proc)
        t, _ = await self.wait_views(expected, limit_s, what)
        return t

    def daemon_processes(self) -> list[psutil.Process]:
        """The simulated daemons of this run that are alive now."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info.get("cmdline") or []
            if any("imexd-sim-daemon" in a for a in cmdline) and any(
                str(self.root) in a for a in cmdline
            ):
                found.append(proc)
        return found

    async def measure_idle(self) -> None:
        r = self.result
        assert self.proc is not None
        proc = self.proc.usage()
        if proc is None:
            raise BenchError("idle: the agent process is gone")
        me = psutil.Process()
        # The loop-lag probe wakes 100 times a second: not while this process's CPU counts.
        if self._lag_task is not None:
            self._lag_task.cancel()
        counts0 = await self.monitor.snapshot()
        busy = cpu_busy()
        t0 = time.monotonic()
        c0, m0 = proc.cpu_times(), me.cpu_times()
        daemons = self.daemon_processes()
        d0 = cpu_seconds(daemons)
        rss: list[int] = []
        while time.monotonic() - t0 < self.opts.idle_s:
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(1.0)
        c1, m1 = proc.cpu_times(), me.cpu_times()
        d1 = cpu_seconds(daemons)
        elapsed = time.monotonic() - t0
        rss.append(proc.memory_info().rss)
        own = (c1.user + c1.system - c0.user - c0.system) / elapsed * 100
        kids = c1.children_user + c1.children_system - c0.children_user - c0.children_system
        r.add("agent process RSS (max while idle)", max(rss) / 2**20, "MB", below=RSS_TARGET_MB)
        r.add(
            "agent process idle CPU",
            own,
            "% core",
            below=CPU_TARGET_PCT,
            note=f"over {elapsed:.0f} s; + ctl probes it ran: {kids / elapsed * 100:.2f} % core "
            "(the simulator's ctl is a Python program)",
        )
        bench = (m1.user + m1.system - m0.user - m0.system) / elapsed * 100
        alive = sum(1 for n in self.nodes if n.alive)
        r.add(
            "in-process agents idle CPU, per agent",
            bench / max(alive, 1),
            "% core",
            note=f"{alive} agents in this process: {bench:.1f} % core in all",
        )
        probes = m1.children_user + m1.children_system - m0.children_user - m0.children_system
        if self.daemons:
            r.add(
                "idle: ctl probes of the in-process agents",
                max(0.0, probes) / elapsed * 100,
                "% core",
                note="`imexd-sim-ctl -q` every probe_interval_s, `-N -j` every "
                "domain_probe_interval_s, per agent (Python start-up each time)",
            )
            spent = sum(d1.get(pid, 0.0) - d0.get(pid, 0.0) for pid in d1 if pid in d0)
            r.add(
                "idle: simulated daemons",
                spent / elapsed * 100,
                "% core",
                note=f"{len(d0)} daemons, heartbeats every 0.5 s to each peer",
            )
        counts1 = await self.monitor.snapshot()
        d = counts1 - counts0
        r.add(
            "idle: publishes in per second",
            d.publishes / elapsed,
            "/s",
            note=f"deliveries out {d.sent / elapsed:.2f} /s; MQTT packets in "
            f"{d.packets_in / elapsed:.2f} /s (pings, reports, keep-alives)",
        )
        r.add("idle: machine CPU busy", busy(), "cores", note="daemons, probes, broker, agents")
        self._lag_task = asyncio.create_task(self.lag.run(), name="loop-lag")

    # Teardown.

    async def close(self) -> None:
        """End the agents gracefully (bounded), then every process of the run."""
        for node in self.nodes:
            node.stop.set()
        tasks = [n.task for n in self.nodes if n.task is not None and not n.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=25)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        for node in self.nodes:
            if node.task is not None and node.task.done() and not node.task.cancelled():
                exc = node.task.exception()
                if exc is not None and not self.result.error:
                    self.result.error = f"agent {node.name} failed: {exc!r}"
        if self.proc is not None:
            self.proc.kill()
        for helper in (self._monitor_task, self._lag_task):
            if helper is not None:
                helper.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                    await helper
        self.broker.stop()
        sweep(self.root)


# Output --------------------------------------------------------------------------------


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} CPUs ({model or platform.processor()}), "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}, "
        f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


def print_result(result: Result) -> None:
    mode = "simulated daemons" if result.daemons else 'no daemons (clique "")'
    print(f"\nN = {result.n}, {mode}; {result.load}")
    if result.error:
        print(f"  ERROR: {result.error}")
    width = max((len(f.name) for f in result.figures), default=10)
    print(f"  {'figure':<{width}}  {'value':>12}  {'target':<30}  verdict  note")
    for f in result.figures:
        print(f"  {f.name:<{width}}  {f.shown():>12}  {f.target:<30}  {f.verdict:<7}  {f.note}")


def print_summary(results: Sequence[Result]) -> None:
    """Per (mode, N) and figure with a target: the median of the repeats, and the verdicts."""
    print("\nSummary (median of the repeats; verdicts of every repeat)")
    keys: dict[tuple[bool, int], list[Result]] = {}
    for r in results:
        keys.setdefault((r.daemons, r.n), []).append(r)
    for (daemons, n), runs in keys.items():
        print(f"  N = {n}, {'simulated daemons' if daemons else 'no daemons'}, {len(runs)} run(s)")
        names = [f.name for f in runs[0].figures if f.ok is not None or f.unit == "s"]
        for name in names:
            figs = [f for r in runs for f in r.figures if f.name == name]
            values = [f.value for f in figs if f.value is not None]
            if not values:
                continue
            median = statistics.median(values)
            shown = Figure(name, median, figs[0].unit).shown()
            spread = f"({min(values):.3f}..{max(values):.3f})" if len(values) > 1 else ""
            verdicts = " ".join(f.verdict for f in figs if f.verdict)
            print(f"    {name:<52} {shown:>12} {spread:<16} {figs[0].target:<28} {verdicts}")


# Main ----------------------------------------------------------------------------------


async def wait_for_load(limit: float, patience_s: float) -> None:
    """Give other work on the machine a chance to finish (bounded): the figures are
    CPU-bound on a small machine."""
    for _ in range(int(patience_s / 5)):
        if os.getloadavg()[0] < limit:
            return
        await asyncio.sleep(5)
    print(f"  loadavg still {os.getloadavg()[0]:.2f} >= {limit:g}: running anyway")


async def bench(opts: Options, base: Path, log_out: TextIO) -> list[Result]:
    # SIGINT and SIGTERM cancel the benchmark, whose `finally` ends what it started (also
    # when started in the background, where SIGINT is ignored by default).
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    capture_runs: list[Result] = []
    octet = 250 + os.getpid() % 5
    index = 0
    for daemons in opts.daemons:
        for n in opts.nodes:
            for _ in range(opts.repeat):
                index += 1
                if opts.max_load is not None:
                    await wait_for_load(opts.max_load, 300.0)
                root = base / f"run{index}-{'sim' if daemons else 'none'}-{n}"
                root.mkdir(parents=True)
                run = Run(opts, n, daemons=daemons, root=root, octet=octet)
                configure_capture(run.capture, log_out)
                print(f"\nrun {index}: N = {n}, daemons {'sim' if daemons else 'none'}", flush=True)
                try:
                    await run.execute()
                except (BenchError, TimeoutError) as exc:
                    run.result.error = str(exc) or type(exc).__name__
                    run.log(f"FAILED: {run.result.error}")
                finally:
                    await run.close()
                print_result(run.result)
                capture_runs.append(run.result)
                if run.result.anomalous:
                    print(f"  kept {root} and {base / 'agents.log'} to investigate")
                elif not opts.keep:
                    shutil.rmtree(root, ignore_errors=True)
    return capture_runs


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", default=None, help="comma-separated N (default 4,18,72)")
    parser.add_argument(
        "--daemons",
        choices=("sim", "none", "both"),
        default="sim",
        help='sim: simulated IMEX daemons (default); none: clique "", no daemon; both',
    )
    parser.add_argument("--group-size", type=int, default=18, help="nodes per clique (18)")
    parser.add_argument("--max-nodes", type=int, default=18, help="[domain] max_nodes (18)")
    parser.add_argument("--will-delay-s", type=float, default=2.0, help="[bus] will_delay_s (2)")
    parser.add_argument("--idle-s", type=float, default=30.0, help="idle sampling seconds (30)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per N (1)")
    parser.add_argument("--quick", action="store_true", help="N=4 only, 10 s idle sampling")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the work folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="cProfile this process from start to all ready; stats to PATH.<mode>-<N>",
    )
    parser.add_argument(
        "--probe-interval-s",
        type=float,
        default=None,
        help="[daemon] probe_interval_s of the agents (default: the shipped 5 s)",
    )
    parser.add_argument(
        "--domain-probe-interval-s",
        type=float,
        default=None,
        help="[daemon] domain_probe_interval_s of the agents (default: the shipped 15 s)",
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="before each run wait (at most 5 min) for the 1-min loadavg to drop below this",
    )
    args = parser.parse_args(argv)
    nodes_text = args.nodes or ("4" if args.quick else "4,18,72")
    try:
        nodes = tuple(int(x) for x in nodes_text.split(",") if x.strip())
    except ValueError:
        parser.error(f"--nodes {nodes_text!r}: expected comma-separated integers")
    if not nodes or min(nodes) < 2:
        parser.error("--nodes: every N must be >= 2")
    if args.group_size < 2 or args.group_size > args.max_nodes:
        parser.error("--group-size: expected 2..max_nodes")
    daemons = {"sim": (True,), "none": (False,), "both": (True, False)}[args.daemons]
    return Options(
        nodes=nodes,
        daemons=daemons,
        group_size=args.group_size,
        max_nodes=args.max_nodes,
        will_delay_s=args.will_delay_s,
        idle_s=10.0 if args.quick and args.idle_s == 30.0 else args.idle_s,
        repeat=max(1, args.repeat),
        keep=args.keep,
        workdir=args.workdir,
        json_out=args.json,
        profile=args.profile,
        max_load=args.max_load,
        probe_interval_s=args.probe_interval_s,
        domain_probe_interval_s=args.domain_probe_interval_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if not SIM_DAEMON.exists():
        print(f"{SIM_DAEMON} is missing: run from the project's virtual environment")
        return 2
    base = Path(tempfile.mkdtemp(prefix="imexd-bench-", dir=opts.workdir))
    print(f"machine: {machine()}")
    print(f"work folder: {base}")
    print(
        "settings changed from the defaults: per-node name/address/clique/dirs/hosts file, "
        f"[domain] name, [bus] url, [imex] binary/ctl = simulator, [health] listen; "
        f"[bus] will_delay_s = {opts.will_delay_s:g}; max_nodes {opts.max_nodes}, "
        f"groups of {opts.group_size}"
        + (
            f"; [daemon] probe_interval_s = {opts.probe_interval_s:g}"
            if opts.probe_interval_s is not None
            else ""
        )
        + (
            f"; [daemon] domain_probe_interval_s = {opts.domain_probe_interval_s:g}"
            if opts.domain_probe_interval_s is not None
            else ""
        )
    )

    results: list[Result] = []
    try:
        with (base / "agents.log").open("w") as log_out:
            results = asyncio.run(bench(opts, base, log_out))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: cleaning up")
        return 130
    finally:
        sweep(base)
        if opts.keep or any(r.anomalous for r in results):
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print_summary(results)
    if opts.json_out is not None:
        data = [
            {
                "n": r.n,
                "daemons": r.daemons,
                "error": r.error,
                "load": r.load,
                "figures": [f.__dict__ for f in r.figures],
            }
            for r in results
        ]
        opts.json_out.write_text(json.dumps({"machine": machine(), "runs": data}, indent=1))
    misses = [f for r in results for f in r.figures if f.ok is False]
    return 1 if any(r.error for r in results) or misses else 0


if __name__ == "__main__":
    sys.exit(main())
