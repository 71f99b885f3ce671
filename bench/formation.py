"""Benchmark: how fast N imexd agents form IMEX domains and follow joins, leaves and crashes.

    .venv/bin/python bench/formation.py --nodes 4,18,72
    .venv/bin/python bench/formation.py --quick
    .venv/bin/python bench/formation.py --nodes 8 --agents process --phases jobstart
    .venv/bin/python bench/formation.py --nodes 18 --phases rebuild

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
   node crash): until no remaining node of group 0 maps it, split into SIGKILL -> the
   broker delivers the will (the Will Delay plus the broker's noticing and will timer, at
   the bench's subscriber) and will -> the last peer's files (delivery, coalescing, the
   write), and will -> the last peer's HealthReport without it.

Job start (`--phases jobstart`, its own run with its own broker): N agents in assigned
mode, started and idle (ready, no domain); per round, from just before `imexd domain
create JOB --nodes n1,...` until `imexd domain status JOB --wait S` exits 0 (rerun until
it does, bounded), both run as processes with the control plane's settings in IMEXD_
variables (as a Slurm prolog would run them); then one `imexd domain create JOB --nodes
... --wait S` process (the prolog form, as config/slurm runs it); `imexd domain delete
--wait` between rounds, until the agents are idle again. Reported: min/median/max over
`--job-rounds`, the create and status processes apart, spec on the bus -> every node's
HealthReport ready (the agents' part), daemon starts per node and SIGUSR1 per round.

Shared domain (`--phases shared`, its own run with its own broker): N agents in one
static domain with `[channels]` (a fake driver), formed and quiet; per round, `imexd
workload create JOB --domain D --nodes ... --wait S` until it exits 0 (every node reports
the channel ready) and `imexd workload delete JOB --domain D --wait 30` until it exits 0
(no node lists it), each one process as the shared-layout Slurm scripts run them, and
`imexd --version` for the interpreter's share. Reported: median (min, max) over
`--job-rounds`.

Rebuild (`--phases rebuild`, its own run with its own broker): N agents in assigned
mode in two domains of N/2 (`imexd domain create --nodes`), with one workload each
(`imexd workload create --wait`); once everything is UP and quiet, the broker (no
persistence) is stopped and started again, empty, on its address. Measured from its start
until `imexd domain status --wait` of both domains and `imexd workload status --wait` of
both workloads, all four started at once right after the restart, have exited 0 (each
one's time, and the slowest: nobody runs `create` again); the records the agents
restored (imexd.agent.rebuild), the agents that found the broker lost, and the daemons started
or restarted meanwhile (must be 0).

Agents as processes (`--agents process`): every agent is its own `imexd run` process with
its own settings file and JSON log, on the fast timings of `imexd.demo.timings` (or the
shipped ones with `--timings shipped`), since in one process N agents share one event
loop and mislead above N = 4. They are watched from outside: their logs (read as they
grow), their hosts files, /readyz and /status, and the broker (without daemons, the
member records the broker holds stand for the files). The in-process join (3.) is
skipped; the process join (4.) is the join.

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
one run with one method per phase, output, main) follow the order of a run. Its broker,
its nodes' settings and its in-process agents are started as every benchmark starts them
(bench/harness.py: `broker_target`, `agent_sections`, `InProcAgent`), its agent processes
as the tests do (tests/cluster.py's `spawn_agent`). Hundreds of membership-only agents in
many cliques, on Mosquitto or a NATS cluster, are bench/scale.py's job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import shlex
import shutil
import signal
import statistics
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
from harness import (
    BenchError,
    Figure,
    InProcAgent,
    agent_sections,
    broker_target,
    cpu_seconds,
    cpu_total,
    end_agents,
    log_agents,
    machine,
    print_figures,
    restart,
    sweep,
)

from imexd.agent.run import Agent
from imexd.daemon.output import says_ready
from imexd.demo.brokers import free_port
from imexd.demo.timings import FAST, SIM_RELOAD_WINDOW_S, with_fast
from imexd.render import parse_hosts_block
from imexd.settings import Settings, settings_from_mapping
from imexd.settings_text import render_toml
from tests.cluster import AgentProcess, spawn_agent

VENV_BIN: Final = Path(sys.executable).parent
SIM_DAEMON: Final = VENV_BIN / "imexd-sim-daemon"
SIM_CTL: Final = VENV_BIN / "imexd-sim-ctl"
IMEXD: Final = VENV_BIN / "imexd"
PREFIX: Final = "imex/v2"
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
JOB_START_TARGET_S: Final = 1.5
JOB_START_TARGET_N: Final = 8
RSS_TARGET_MB: Final = 32.0
CPU_TARGET_PCT: Final = 0.1
SHARED_TARGETS_S: Final = {4: 0.3, 18: 0.5}
"""`workload create` on a formed domain of N nodes, median (issue 22)."""
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
        "membership.join",
        "daemon.output",
        "rebuild.broker_lost_state",
        "rebuild.restored",
        "rebuild.epoch_written",
    }
)


# Processes ----------------------------------------------------------------------------


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
    """Publishes on `imex/v2/#` (seen by the benchmark's subscriber)."""
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
    """A subscriber on `imex/v2/#` and `$SYS/broker/#` that counts what the agents publish."""

    def __init__(self, endpoint: tuple[str, int]) -> None:
        self.host, self.port = endpoint
        self.published: list[tuple[float, str]] = []
        self.total = 0
        self.sys: dict[str, int] = {}
        self.tick = asyncio.Event()
        self.up = asyncio.Event()
        self.records: dict[str, tuple[float, dict[str, Any] | None]] = {}
        """topic -> (when it last changed, the decoded record or None when cleared):
        the member records as the broker holds them."""
        self.record_log: list[tuple[float, str, dict[str, Any] | None]] = []
        self.reports: dict[str, tuple[float, dict[str, Any]]] = {}
        """node -> (when it arrived, the last HealthReport it published)."""
        self.report_log: list[tuple[float, dict[str, Any]]] = []
        self.specs: list[tuple[float, str]] = []
        """(when, domain) of every DomainSpec published."""

    async def run(self) -> None:
        async with aiomqtt.Client(self.host, self.port, identifier="imexd-bench-monitor") as c:
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
                    now = time.monotonic()
                    kind = topic_kind(topic)
                    self.published.append((now, kind))
                    self._keep(now, kind, topic, message.payload)

    def _keep(self, now: float, kind: str, topic: str, payload: Any) -> None:
        """Member records, health reports and specs, decoded, with their arrival time."""
        if kind not in ("members", "health", "spec"):
            return
        data: dict[str, Any] | None = None
        if isinstance(payload, bytes) and payload:
            with contextlib.suppress(ValueError):
                decoded = json.loads(payload)
                if isinstance(decoded, dict):
                    data = decoded
        if kind == "members":
            self.records[topic] = (now, data)
            self.record_log.append((now, topic, data))
        elif kind == "health" and data is not None:
            self.reports[str(data.get("node"))] = (now, data)
            self.report_log.append((now, data))
        elif kind == "spec" and data is not None:
            self.specs.append((now, str(data.get("domain"))))

    def members_of(self, domain: str) -> dict[int, str]:
        """slot -> address of the `member` records of `domain` the broker holds now."""
        out: dict[int, str] = {}
        for _, record in self.records.values():
            if (
                record is not None
                and record.get("domain") == domain
                and record.get("state") == "member"
                and isinstance(record.get("slot"), int)
            ):
                out[record["slot"]] = str(record.get("address"))
        return out

    def cleared(self, node: str, after: float) -> float | None:
        """When the broker first delivered an empty member record of `node` (its will, or
        its own clear) after `after`."""
        for at, topic, record in self.record_log:
            if at >= after and record is None and topic.rsplit("/", 1)[-1] == node:
                return at
        return None

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
    """One simulated GPU node: its folder, address, files, and what its files say.

    An agent is either a coroutine of this process (`InProcNode`) or an `imexd run`
    process (`ProcNode`); the phases see both through this interface, and both feed
    their log events into the run's `Capture` (a process's from its JSON log)."""

    def __init__(
        self, run: Run, name: str, group: int, host: int, *, assigned: bool = False
    ) -> None:
        self.run = run
        self.name = name
        self.group = group
        self.assigned = assigned
        """Assigned mode: idle until the control plane assigns a domain (job start)."""
        self.address = f"127.{run.octet}.{group}.{host}"
        self.dir = run.root / name
        self.dir.mkdir(parents=True)
        self.hosts_file = self.dir / "hosts"
        """Written with the node's settings (`sections`)."""
        self.signal_log = self.dir / "signals.log"
        self.view: dict[int, str] = {}
        """slot -> address of the members its files map (or its membership, no daemon)."""
        self.view_at = 0.0
        self.ready_at: float | None = None
        self.started_at = 0.0

    @property
    def domain(self) -> str:
        return DOMAIN if self.run.daemons else f"{DOMAIN}-g{self.group}"

    def sections(self, health_listen: str) -> dict[str, dict[str, Any]]:
        """The node's settings: the shipped defaults (or the fast table, `--timings fast`)
        but for what the docstring lists."""
        sections = agent_sections(
            self.dir,
            name=self.name,
            address=self.address,
            clique=f"{CLUSTER}.{self.group}" if self.run.daemons else "",
            domain=None if self.assigned else self.domain,
            max_nodes=self.run.opts.max_nodes,
            urls=self.run.broker.urls,
            health_listen=health_listen,
        )
        sections["imex"] |= {"binary": str(SIM_DAEMON), "ctl": str(SIM_CTL)}
        sections["imex"]["env"]["IMEXD_SIM_SIGNAL_LOG"] = str(self.signal_log)
        if self.run.fast:
            sections["imex"]["env"]["IMEXD_SIM_RELOAD_WINDOW_S"] = SIM_RELOAD_WINDOW_S
            sections = with_fast(sections)
        sections["bus"]["will_delay_s"] = self.run.opts.will_delay_s
        sections["daemon"] = sections.get("daemon", {}) | self.run.daemon_overrides()
        return sections

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

    def connected_at(self, *, will: bool = False) -> float | None:
        """When its bus link first came up (CONNACK); with `will`, the first link that
        carried its Last Will."""
        ups = [
            s.at
            for s in self.run.capture.events("bus_connected", node=self.name)
            if s.fields.get("will") or not will
        ]
        return min(ups) if ups else None

    def daemon_starts(self, after: float = 0.0, before: float = INF) -> int:
        """Daemons started (STARTING) or adopted between `after` and `before`."""
        cap = self.run.capture
        states = cap.events("daemon.state", node=self.name, after=after, before=before)
        adopted = cap.events("daemon.adopted", node=self.name, after=after, before=before)
        return sum(1 for s in states if s.fields.get("to") == "STARTING") + len(adopted)

    def from_bus(self) -> None:
        """Without daemons no file is written: take the member records the broker holds
        for its domain (what every agent of the domain is being sent)."""
        members = self.run.monitor.members_of(self.domain)
        if members != self.view:
            self.view, self.view_at = members, time.monotonic()

    # What each kind of agent does its own way.

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def leave(self) -> None:
        """Stop it gracefully (what SIGTERM does): it leaves its domain."""
        raise NotImplementedError

    async def exited(self, limit_s: float) -> int | None:
        """Its exit code once it ended (None: still running after `limit_s`)."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Bring `view` up to date where the run's file-written events do not."""

    async def is_ready(self) -> bool:
        raise NotImplementedError

    def not_ready_because(self) -> str:
        return self.name


class InProcNode(Node):
    """An agent running as a coroutine of this process (`harness.InProcAgent`)."""

    def __init__(
        self, run: Run, name: str, group: int, host: int, *, assigned: bool = False
    ) -> None:
        super().__init__(run, name, group, host, assigned=assigned)
        self.settings: Settings = settings_from_mapping(self.sections("127.0.0.1:0"))
        self.hosted: InProcAgent | None = None

    @property
    def agent(self) -> Agent | None:
        return None if self.hosted is None else self.hosted.agent

    def start(self) -> None:
        self.hosted = InProcAgent(self.name, self.settings)
        self.started_at = time.monotonic()
        self.hosted.start()

    @property
    def alive(self) -> bool:
        return self.hosted is not None and self.hosted.alive

    def leave(self) -> None:
        if self.hosted is not None:
            self.hosted.leave()

    async def exited(self, limit_s: float) -> int | None:
        return None if self.hosted is None else await self.hosted.exited(limit_s)

    def refresh(self) -> None:
        """Without daemons no file is written: take the agent's membership instead."""
        if self.hosted is None or self.run.daemons:
            return
        members = self.hosted.members()
        if members != self.view:
            self.view, self.view_at = members, time.monotonic()

    async def is_ready(self) -> bool:
        return self.agent is not None and self.agent.health.is_ready

    def not_ready_because(self) -> str:
        return f"{self.name}: {self.agent.health.summary()}" if self.agent else self.name


class ProcNode(Node):
    """An agent as shipped: an `imexd run` process with its own settings file and JSON
    log, watched from outside: its log (read into the run's capture as it grows), its
    files, its /readyz and /status, and the broker (the bench's Monitor)."""

    def __init__(
        self, run: Run, name: str, group: int, host: int, *, assigned: bool = False
    ) -> None:
        super().__init__(run, name, group, host, assigned=assigned)
        self.health_port = free_port()
        self.config = self.dir / "imexd.toml"
        sections = self.sections(f"127.0.0.1:{self.health_port}")
        sections["log"] = {"level": "info", "format": "json"}
        self.config.write_text(render_toml(sections))
        self.log_path = self.dir / "agent.log"
        self.proc: AgentProcess | None = None
        self.killed_at: float | None = None
        self._hosts_mtime = 0
        self._log_offset = 0
        self._last_status: dict[str, Any] = {}

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.proc = spawn_agent(self.config, self.log_path)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def leave(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    async def exited(self, limit_s: float) -> int | None:
        deadline = time.monotonic() + limit_s
        while self.proc is not None and time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.05)
        return None if self.proc is None else self.proc.poll()

    def read_log(self) -> None:
        """Feed the events of its log written since the last call into the capture, on
        this process's monotonic clock (the log's timestamps are UTC wall clock)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self._log_offset += end + 1
        for line in chunk[: end + 1].splitlines():
            if not any(f'"{e}"'.encode() in line for e in CAPTURED):
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                data = json.loads(line)
                if isinstance(data, dict) and data.get("event") in CAPTURED:
                    wall = datetime.fromisoformat(str(data["timestamp"])).timestamp()
                    at = wall - self.run.wall_offset
                    self.run.capture.seen.append(Seen(at, self.name, str(data["event"]), data))

    def refresh(self) -> None:
        self.read_log()
        if not self.run.daemons:
            self.from_bus()
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

    async def _get(self, path: str) -> tuple[int, bytes]:
        """One HTTP/1.0 GET on its health port: (status, body); (0, b"") when it fails."""
        try:
            async with asyncio.timeout(2.0):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.health_port)
                writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
                await writer.drain()
                raw = await reader.read()
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        except (OSError, TimeoutError):
            return 0, b""
        head, _, body = raw.partition(b"\r\n\r\n")
        parts = head.split(None, 2)
        return (int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0), body

    async def is_ready(self) -> bool:
        code, _ = await self._get("/readyz")
        return code == 200

    async def status(self) -> dict[str, Any]:
        """Its /status (the HealthReport), or {} when it does not answer."""
        code, body = await self._get("/status")
        with contextlib.suppress(ValueError):
            data = json.loads(body) if code == 200 else {}
            if isinstance(data, dict):
                self._last_status = data
                return data
        return {}

    def not_ready_because(self) -> str:
        bad = [
            f"{c.get('type')} {c.get('reason')}"
            for c in self._last_status.get("conditions", [])
            if isinstance(c, dict) and c.get("status") != "True"
        ]
        return f"{self.name}: {', '.join(bad) or 'no answer'}"

    def usage(self) -> psutil.Process | None:
        if not self.alive:
            return None
        assert self.proc is not None
        return psutil.Process(self.proc.pid)


# Figures -------------------------------------------------------------------------------


@dataclass
class Result:
    """The figures of one run (one N, one daemon mode, one kind of agent, one benchmark)."""

    n: int
    daemons: bool
    agents: str = "inproc"
    kind: str = "domain"
    """domain: formation, leave, join, idle, crash; jobstart: the job start."""
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


JOB_FORMS: Final = {
    "commands": "`imexd domain create` and `imexd domain status --wait` as two processes",
    "prolog": "one `imexd domain create --wait` process, as the shipped Slurm prolog runs it",
}


@dataclass
class JobRound:
    """One job start: its times from just before `domain create`."""

    form: str
    total_s: float = 0.0
    create_s: float | None = None
    status_s: float = 0.0
    status_runs: int = 0
    spec_s: float | None = None
    """Start -> the spec reached the bench's subscriber."""
    ready_s: float | None = None
    """Spec -> the last node's HealthReport ready in the job's domain."""
    busy_s: float = 0.0
    """CPU seconds the whole machine spent from start to exit: on a small machine the
    job start's wall time is mostly the CPU its processes need, and this is steadier."""
    starts: list[int] = field(default_factory=list)
    sigusr1: int = 0
    parts: dict[str, float] = field(default_factory=dict)
    """`JOB_PARTS` name -> seconds from the start until the last node got there."""
    ok: bool = False
    problem: str = ""

    def describe(self) -> str:
        parts = [f"{self.total_s:.3f} s {'UP' if self.ok else 'FAILED ' + self.problem}"]
        if self.create_s is not None:
            parts.append(f"create {self.create_s:.3f} s, status {self.status_s:.3f} s")
        if self.spec_s is not None and self.ready_s is not None:
            parts.append(f"spec at {self.spec_s:.3f} s, all ready {self.ready_s:.3f} s later")
        return "; ".join(parts)


JOB_PARTS: Final = {
    "spec on the bus": "the create process up to its publish, at the bench's subscriber",
    "joins": "each agent took the spec in and joined the shard (`membership.join`)",
    "claims settled": "each agent's claim settled as a member (`membership.step`)",
    "first daemon start": "the first agent spawned its daemon (`daemon.state` STARTING)",
    "daemon starts": "each agent spawned its daemon",
    "READY lines": "each daemon printed READY, as its agent read it (`daemon.output`)",
    "RUNNING": "each agent took its daemon for RUNNING (`daemon.state`)",
    "reports ready": "each node's HealthReport `ready` reached the bench's subscriber",
    "exit": "the command exited 0",
}
"""The parts of a job start, in order, each until the last node got there (the first
daemon start excepted), from the agents' own logs and the bench's subscriber."""


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return f"min {min(values):.3f} / max {max(values):.3f} s"


async def run_command(
    argv: Sequence[str], env: Mapping[str, str], limit_s: float
) -> tuple[int, str]:
    """Run a command to its end (killed after `limit_s`): its exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env),
    )
    try:
        async with asyncio.timeout(limit_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"killed after {limit_s:g} s"
    return proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace")


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
    agents: str = "inproc"
    """inproc: the N agents are coroutines of this process; process: `imexd run` each."""
    timings: str = "shipped"
    """shipped: the defaults; fast: imexd.demo.timings.FAST (what the tests and demo use)."""
    phases: tuple[str, ...] = ("domain", "jobstart")
    """Of domain, jobstart, shared."""
    job_rounds: int = 3
    job_wait_s: float = 60.0


class Run:
    """One benchmark run: a broker, N agents (in this process, or `imexd run` processes),
    one more agent process, the phases."""

    def __init__(self, opts: Options, n: int, *, daemons: bool, root: Path, octet: int) -> None:
        self.opts = opts
        self.n = n
        self.daemons = daemons
        self.root = root
        self.octet = octet
        self.capture = Capture()
        self.fast = opts.timings == "fast"
        self.processes = opts.agents == "process"
        self.reload_s = (
            float(FAST["imex"]["reload_min_interval_s"]) if self.fast else RELOAD_MIN_INTERVAL_S
        )
        """The agents' `[imex] reload_min_interval_s` (the quiet time between phases)."""
        self.wall_offset = time.time() - time.monotonic()
        """Wall clock minus monotonic clock: puts the processes' log times on ours."""
        self.broker = broker_target("mosquitto", root / "broker", extra_config=SYS_INTERVAL)
        self.monitor = Monitor(self.broker.endpoint)
        self.nodes: list[Node] = []
        self.proc: ProcNode | None = None
        self.result = Result(n, daemons, opts.agents)
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
        mode = f"{'sim' if self.daemons else 'none'} {self.opts.agents}"
        print(f"  [{mode} N={self.n}] {text}", flush=True)

    def group(self, g: int) -> list[Node]:
        members: list[Node] = [n for n in self.nodes if n.group == g and n.alive]
        proc = self.proc
        if proc is not None and proc.alive and proc.group == g and proc not in members:
            members.append(proc)
        return members

    def all_nodes(self) -> list[Node]:
        """Every node of the run, the extra agent process included."""
        extra = [self.proc] if self.proc is not None and self.proc not in self.nodes else []
        return [*self.nodes, *extra]

    def refresh(self) -> None:
        """Bring every node's view up to date: read the hosts files agents just wrote."""
        for proc in self.all_nodes():
            if isinstance(proc, ProcNode):
                proc.read_log()
        seen = self.capture.seen
        written: dict[str, float] = {}
        while self._seen_index < len(seen):
            s = seen[self._seen_index]
            self._seen_index += 1
            if s.event == "file.written" and str(s.fields.get("path", "")).endswith("/hosts"):
                written[s.node] = s.at
        if written:
            for node in self.all_nodes():
                at = written.get(node.name)
                if at is not None:
                    view = node.read_hosts()
                    if view != node.view:
                        node.view, node.view_at = view, at
        for node in self.all_nodes():
            node.refresh()

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
                if node.ready_at is None and await node.is_ready():
                    node.ready_at = now
            if all(node.ready_at is not None for node in nodes):
                return max(node.ready_at or 0.0 for node in nodes)
            if now > deadline:
                late = [n for n in nodes if n.ready_at is None]
                for n in late[:3]:
                    if isinstance(n, ProcNode):
                        await n.status()
                why = [n.not_ready_because() for n in late[:3]]
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
            self.refresh()
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
            if now - last_daemon > self.reload_s + 0.5 and now - last_file > 0.5:
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
        counts = [per_node.get(n.name, 0) for n in nodes]
        self.result.add(
            f"{phase}: SIGUSR1 sent per node (max)",
            max(counts, default=0),
            "count",
            note=f"total {sum(counts)} over {len(counts)} nodes",
        )

    def new_node(self, name: str, group: int, host: int, *, assigned: bool = False) -> Node:
        """A node of the run's kind (`--agents`), not started yet."""
        kind = ProcNode if self.processes else InProcNode
        node = kind(self, name, group, host, assigned=assigned)
        self.nodes.append(node)
        return node

    def agent_processes(self) -> list[psutil.Process]:
        """The `imexd run` processes of the nodes (process mode) that are alive now."""
        procs = [n.usage() for n in self.nodes if isinstance(n, ProcNode)]
        return [p for p in procs if p is not None]

    # The phases: `execute` runs them in order, each one a method.

    async def execute(self) -> Result:
        """Every phase in order (the module docstring says what each one measures)."""
        groups = await self._start()
        await self._formation(groups)
        await self._leave()
        if not self.processes:
            await self._join()  # in process mode the next phase is the join
        await self._join_process()
        await self.measure_idle()
        victim = await self._crash()
        self._over_the_run(victim)
        return self.result

    async def _start(self, *, assigned: bool = False) -> list[int]:
        """The broker, its monitor, the loop-lag probe and the nodes (not started yet;
        `assigned`: in assigned mode); the node groups."""
        self.broker.start()
        self._monitor_task = asyncio.create_task(self.monitor.run(), name="monitor")
        self._lag_task = asyncio.create_task(self.lag.run(), name="loop-lag")
        async with asyncio.timeout(10):
            await self.monitor.up.wait()
        gs = self.opts.group_size
        for i in range(self.n):
            self.new_node(f"node-{i:03d}", i // gs, 10 + i % gs, assigned=assigned)
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
        procs_cpu = cpu_total(self.agent_processes())
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
        if self.processes:
            r.add(
                "formation: CPU of the agent processes",
                procs_cpu,
                "CPU-s",
                note=f"start -> files final, all {self.n} agents: {procs_cpu / self.n * 1000:.0f} "
                "ms per agent, Python start-up and imports included",
            )
        else:
            spent = cpu1.user + cpu1.system - cpu0.user - cpu0.system
            r.add(
                "formation: CPU of the in-process agents",
                spent,
                "CPU-s",
                note=f"start -> files final, all {self.n} agents: {spent / self.n * 1000:.0f} "
                "ms per agent, serialised on one core here",
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
                "(daemon start, first probe)",
            )
        formation_busy = busy()
        daemons_cpu = cpu_total(self.daemon_processes())
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
        t0 = time.monotonic()
        leaver.leave()
        t_left, _ = await self._wait_gone(leaver, 20, "leave")
        r.add(
            "leave: stop -> visible on all",
            t_left - t0,
            below=LEAVE_TARGET_S,
            files=True,
            note=self.lag.describe(t0, t_left),
        )
        code = await leaver.exited(30)
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
            t0 = time.monotonic()
            second.leave()
            t_left2, _ = await self._wait_gone(second, 20, "leave 2")
            await second.exited(30)  # until then it counts as a member of the group
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
        if not self.daemons and not self.processes:
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
        t_crash, per_node = await self._wait_gone(victim, self.opts.will_delay_s + 20, "crash")
        will = self.opts.will_delay_s
        self.result.add(
            "crash: SIGKILL -> visible on all",
            t_crash - t0,
            below=will + 0.5,
            files=True,
            target=f"< {will + 0.5:g} s (will delay {will:g} s + 0.5 s)",
            note=self.lag.describe(t0 + will, t_crash),
        )
        await self.quiesce()  # the peers' reports of the change are out by now
        self._crash_parts(victim, t0, t_crash, per_node)
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
            per_node.append(
                sig.get("SIGUSR1 honoured", 0)
                + sig.get("SIGUSR1 ignored", 0)
                + sig.get("SIGUSR1 early", 0)
            )
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

    def _crash_parts(
        self, victim: ProcNode, t0: float, t_crash: float, per_node: Sequence[float]
    ) -> None:
        """What "crash: visible on all" is made of: the broker's will (the Will Delay, from
        the moment the broker notices the dead socket, plus its will timer's granularity),
        then every peer's reaction (its coalescing window, the write)."""
        r = self.result
        will = self.opts.will_delay_s
        t_will = self.monitor.cleared(victim.name, t0)
        if t_will is None:
            r.add("crash: SIGKILL -> will delivered by the broker", None, note="not seen")
            return
        r.add(
            "crash: SIGKILL -> will delivered by the broker",
            t_will - t0,
            note=f"will delay {will:g} s + {t_will - t0 - will:+.3f} s (the broker: socket "
            "close seen, its will timer); at the bench's subscriber",
        )
        first = min(per_node, default=t_crash)
        what = "files" if self.daemons else "member records at the broker"
        r.add(
            "crash: will delivered -> visible on all",
            t_crash - t_will,
            note=f"every peer's {what} drop the node; first peer {first - t_will:+.3f} s, "
            f"last {t_crash - t_will:+.3f} s (delivery, the peer's coalescing, the write)",
        )
        reports = self._reports_drop(victim, t_will)
        if reports is not None:
            r.add(
                "crash: will delivered -> every peer's report drops it",
                reports - t_will,
                note="the last peer's HealthReport (domain_view) without the node, as the "
                "control plane reads it",
            )

    def _reports_drop(self, victim: Node, after: float) -> float | None:
        """When the last peer of its group published a HealthReport whose domain_view no
        longer names `victim` (None: not every peer did, or no domain views)."""
        peers = {n.name for n in self.group(victim.group) if n is not victim}
        seen: dict[str, float] = {}
        for at, report in self.monitor.report_log:
            node = str(report.get("node"))
            if at < after or node not in peers or node in seen:
                continue
            view = report.get("domain_view")
            if not isinstance(view, dict) or not isinstance(view.get("nodes"), dict):
                continue
            names = {v.get("node") for v in view["nodes"].values() if isinstance(v, dict)}
            if victim.name not in names:
                seen[node] = at
        return max(seen.values()) if peers and set(seen) == peers else None

    async def _wait_gone(self, gone: Node, limit_s: float, what: str) -> tuple[float, list[float]]:
        """Until the rest of its group maps the others and not `gone`: that time, and
        each node's own time."""
        expected = {
            node: frozenset(m.address for m in self.group(gone.group) if m is not gone)
            for node in self.group(gone.group)
            if node is not gone
        }
        if not self.daemons and not self.processes and self.proc in expected:
            expected.pop(self.proc)
        return await self.wait_views(expected, limit_s, what)

    # The job start: idle agents in assigned mode, the control plane as processes.

    def control_env(self) -> dict[str, str]:
        """The environment of `imexd domain ...` as a Slurm prolog of this fleet would
        run it: no settings file, the fleet's settings as IMEXD_ variables (the broker,
        `max_nodes`, which the spec carries, and `report_interval_s`, how old a report may
        be), as tests/cluster.py's `Cluster.control_env` does."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
        fleet = settings_from_mapping(self.nodes[0].sections("127.0.0.1:0"))
        return env | {
            "IMEXD_BUS_URL": ",".join(self.broker.urls),
            "IMEXD_DOMAIN_MAX_NODES": str(self.opts.max_nodes),
            "IMEXD_HEALTH_REPORT_INTERVAL_S": str(fleet.health.report_interval_s),
        }

    async def execute_job_start(self) -> Result:
        """N agents in assigned mode, started and idle (ready, no domain); then, round by
        round, a job's domain over all of them: `imexd domain create` and `imexd domain
        status --wait` as two processes (the second rerun until it exits 0), then the same
        two commands in one shell script (a Slurm prolog); `imexd domain delete` and the
        agents idle again between rounds."""
        await self._start(assigned=True)
        for node in self.nodes:
            node.start()
        if await self.wait_ready(self.nodes, 60 + 2 * self.n, "idle agents") is None:
            raise BenchError("job start: the idle agents never became ready")
        await self.quiesce()
        env = self.control_env()
        names = ",".join(n.name for n in self.nodes)
        rounds: dict[str, list[JobRound]] = {form: [] for form in JOB_FORMS}
        for i in range(self.opts.job_rounds):
            for form in JOB_FORMS:
                job = f"job{i}-{form}"
                done = await self._job_round(job, form, names, env)
                rounds[form].append(done)
                self.log(f"{job}: {done.describe()}")
                await self._job_delete(job, env)
        self._job_figures(rounds)
        return self.result

    async def _job_round(self, job: str, form: str, names: str, env: Mapping[str, str]) -> JobRound:
        wait = self.opts.job_wait_s
        create = [str(IMEXD), "domain", "create", job, "--nodes", names]
        status = [str(IMEXD), "domain", "status", job, "--wait", f"{wait:g}"]
        t0 = time.monotonic()
        busy = cpu_busy()
        done = JobRound(form)
        if form == "prolog":
            code, out = await run_command([*create, "--wait", f"{wait:g}"], env, wait + 30)
        else:
            code, out = await run_command(create, env, 30)
            done.create_s = time.monotonic() - t0
            if code != 0:
                raise BenchError(f"{job}: domain create exited {code}: {out.strip()[-300:]}")
            deadline = t0 + wait
            while True:
                t1 = time.monotonic()
                code, out = await run_command(status, env, wait + 30)
                done.status_s = time.monotonic() - t1
                done.status_runs += 1
                if code == 0 or time.monotonic() > deadline:
                    break
        t_end = time.monotonic()
        done.total_s = t_end - t0
        done.busy_s = busy() * done.total_s
        done.ok = code == 0 and f"domain {job}: UP" in out
        if not done.ok:
            done.problem = f"exit {code}: {' '.join(out.split())[-300:]}"
        # What the bus saw: the spec, then every node's report ready in the job's domain.
        spec_at = min((at for at, d in self.monitor.specs if d == job and at >= t0), default=None)
        ready_at: dict[str, float] = {}
        for at, report in self.monitor.report_log:
            node = str(report.get("node"))
            if at >= t0 and report.get("domain") == job and report.get("ready") is True:
                ready_at.setdefault(node, at)
        if spec_at is not None:
            done.spec_s = spec_at - t0
            if len(ready_at) == self.n:
                done.ready_s = max(ready_at.values()) - spec_at
        self.refresh()
        done.parts = self._job_parts(job, t0, t_end, done, ready_at)
        done.starts = [n.daemon_starts(t0, t_end) for n in self.nodes]
        done.sigusr1 = sum(self.reloads(t0, t_end).values())
        return done

    def _job_parts(
        self, job: str, t0: float, t_end: float, done: JobRound, ready_at: Mapping[str, float]
    ) -> dict[str, float]:
        """When each part of a job start (`JOB_PARTS`) ended, from `t0`: the last node's
        first such event (the first daemon start: the first node's); a part that some node
        did not reach is left out."""
        names = {n.name for n in self.nodes}

        def last(event: str, holds: Callable[[Mapping[str, Any]], bool]) -> float | None:
            first: dict[str, float] = {}
            for seen in self.capture.events(event, after=t0, before=t_end):
                if seen.node in names and holds(seen.fields):
                    first.setdefault(seen.node, seen.at - t0)
            return max(first.values()) if len(first) == len(names) else None

        starting = [
            s.at - t0
            for s in self.capture.events("daemon.state", after=t0, before=t_end)
            if s.node in names and s.fields.get("to") == "STARTING"
        ]
        parts = {
            "spec on the bus": done.spec_s,
            "joins": last("membership.join", lambda f: f.get("domain") == job),
            "claims settled": last("membership.step", lambda f: f.get("phase") == "member"),
            "first daemon start": min(starting, default=None),
            "daemon starts": last("daemon.state", lambda f: f.get("to") == "STARTING"),
            "READY lines": last("daemon.output", lambda f: says_ready(str(f.get("line", "")))),
            "RUNNING": last("daemon.state", lambda f: f.get("to") == "RUNNING"),
            "reports ready": max(ready_at.values()) - t0 if len(ready_at) == self.n else None,
            "exit": done.total_s if done.ok else None,
        }
        return {name: at for name, at in parts.items() if at is not None}

    async def _job_delete(self, job: str, env: Mapping[str, str]) -> None:
        """`imexd domain delete`, then until no record of the job is on the bus and every
        agent is ready (idle) again and quiet."""
        code, out = await run_command(
            [str(IMEXD), "domain", "delete", job, "--wait", "30"], env, 60
        )
        if code != 0:
            self.log(f"{job}: domain delete exited {code}: {out.strip()[-300:]}")
        deadline = time.monotonic() + 60
        while True:
            records = [
                rec
                for _, rec in self.monitor.records.values()
                if rec is not None and rec.get("domain") == job
            ]
            ready = [await n.is_ready() for n in self.nodes]
            if not records and all(ready):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{job}: {len(records)} records left, not idle after delete")
            await asyncio.sleep(0.1)
        await self.quiesce()

    async def execute_shared(self) -> Result:
        """N agents in one formed domain (`[domain] name`, `[channels]` on a fake driver);
        then, round by round, a job's channel as the shared-layout Slurm scripts make and
        remove it: `imexd workload create JOB --domain D --nodes ... --wait S` (exit 0 once
        every node reports the channel ready) and `imexd workload delete JOB --domain D
        --wait 30` (exit 0 once no node lists it), each one process, timed from its spawn
        to its exit. `imexd --version` is timed too: the interpreter's share of each."""
        await self._start()
        for node in self.nodes:
            node.start()
        if await self.wait_ready(self.nodes, 60 + 2 * self.n, "formed domain") is None:
            raise BenchError("shared: the domain never formed")
        await self.quiesce()
        env = self.control_env()
        domain = self.nodes[0].domain
        members = [n for n in self.nodes if n.domain == domain]
        names = ",".join(n.name for n in members)
        wait = f"{self.opts.job_wait_s:g}"
        creates: list[float] = []
        deletes: list[float] = []
        starts: list[float] = []
        failed: list[str] = []
        for i in range(self.opts.job_rounds):
            job = f"job{i}"
            t0 = time.monotonic()
            code, _ = await run_command([str(IMEXD), "--version"], env, 30)
            starts.append(time.monotonic() - t0)
            create = [str(IMEXD), "workload", "create", job, "--domain", domain]
            t0 = time.monotonic()
            code, out = await run_command(
                [*create, "--nodes", names, "--wait", wait], env, self.opts.job_wait_s + 30
            )
            creates.append(time.monotonic() - t0)
            if code != 0:
                failed.append(f"{job} create exit {code}: {' '.join(out.split())[-300:]}")
            delete = [str(IMEXD), "workload", "delete", job, "--domain", domain, "--wait", "30"]
            t0 = time.monotonic()
            code, out = await run_command(delete, env, 60)
            deletes.append(time.monotonic() - t0)
            if code != 0:
                failed.append(f"{job} delete exit {code}: {' '.join(out.split())[-300:]}")
            self.log(f"{job}: create {creates[-1]:.3f} s, delete {deletes[-1]:.3f} s")
            await asyncio.sleep(0.2)
        target = SHARED_TARGETS_S.get(len(members))
        over = sum(1 for t in creates if target is not None and t > target)
        self.result.add(
            f"shared: workload create on {len(members)} nodes -> exit 0",
            statistics.median(creates),
            target=f"<= {target:g} s median" if target is not None else "",
            ok=None if target is None else not failed and statistics.median(creates) <= target,
            note=_spread(creates)
            + f" over {len(creates)} rounds"
            + (f"; {over} over target" if over else "")
            + (f"; FAILED: {failed[0]}" if failed else ""),
        )
        self.result.add(
            f"shared: workload delete on {len(members)} nodes -> exit 0",
            statistics.median(deletes),
            note=_spread(deletes) + " (until no node lists the workload)",
        )
        self.result.add(
            "shared: `imexd --version` (the interpreter's share)",
            statistics.median(starts),
            note=_spread(starts),
        )
        return self.result

    async def execute_rebuild(self) -> Result:
        """Two domains with a workload each; the broker restarted empty: until the control
        plane sees both UP and both workloads ready again (the docstring's rebuild)."""
        await self._start(assigned=True)
        for node in self.nodes:
            node.start()
        if await self.wait_ready(self.nodes, 60 + 2 * self.n, "idle agents") is None:
            raise BenchError("rebuild: the idle agents never became ready")
        env = self.control_env()
        wait = f"{self.opts.job_wait_s:g}"
        half = self.n // 2
        domains = {"rebuild-a": self.nodes[:half], "rebuild-b": self.nodes[half:]}
        setup: list[list[str]] = []
        for domain, nodes in domains.items():
            names = ",".join(n.name for n in nodes)
            setup += [
                [str(IMEXD), "domain", "create", domain, "--nodes", names],
                [str(IMEXD), "domain", "status", domain, "--wait", wait],
                [
                    str(IMEXD),
                    "workload",
                    "create",
                    f"{domain}-job",
                    "--domain",
                    domain,
                    "--wait",
                    wait,
                ],
            ]
        for command in setup:
            code, out = await run_command(command, env, self.opts.job_wait_s + 30)
            if code != 0:
                raise BenchError(f"rebuild: {shlex.join(command[1:4])} exited {code}: {out[-300:]}")
        await self.quiesce()
        # The monitor's link ends with the broker (the figures come from the agents' logs).
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._monitor_task
            self._monitor_task = None
        restart(self.broker)
        t0 = time.monotonic()
        checks = [[str(IMEXD), "domain", "status", d, "--wait", wait] for d in domains]
        checks += [[str(IMEXD), "workload", "status", f"{d}-job", "--wait", wait] for d in domains]

        async def timed(command: list[str]) -> tuple[list[str], int, str, float]:
            # `workload status` exits 1 at once while its record is not back: rerun it.
            while True:
                code, out = await run_command(command, env, self.opts.job_wait_s + 30)
                at = time.monotonic() - t0
                if code == 0 or at > self.opts.job_wait_s:
                    return command, code, out, at

        done = await asyncio.gather(*(timed(c) for c in checks))
        t_end = time.monotonic()
        self._rebuild_figures(done, t0, t_end)
        return self.result

    def _rebuild_figures(
        self, done: Sequence[tuple[list[str], int, str, float]], t0: float, t_end: float
    ) -> None:
        r = self.result
        failed = [f"{shlex.join(c[1:4])}: exit {code}" for c, code, _, _ in done if code != 0]
        r.add(
            "rebuild: empty broker start -> every domain UP, every workload ready",
            max(at for *_, at in done),
            ok=not failed,
            target="every check exits 0",
            note="; ".join(f"{c[1]} {c[3]} {at:.3f} s" for c, _, _, at in done)
            + (f"; FAILED: {failed}" if failed else "")
            + " (each a process started at once after the restart, Python start-up included)",
        )
        self.refresh()
        ups = [s.at - t0 for s in self.capture.events("bus_connected", after=t0, before=t_end)]
        lost_at = [s.at - t0 for s in self.capture.events("rebuild.broker_lost_state", after=t0)]
        r.add(
            "rebuild: empty broker start -> last agent connected",
            max(ups) if ups else None,
            note=f"first {min(ups, default=0.0):.3f} s; each agent's snapshot judged (broker "
            f"lost) {_spread(lost_at)}",
        )
        back: dict[str, float] = {}
        for seen in self.capture.events("rebuild.restored", after=t0, before=t_end):
            topic = str(seen.fields.get("topic"))
            if topic.endswith("/spec"):
                back.setdefault(topic.split("/")[-2], seen.at - t0)
        r.add(
            "rebuild: empty broker start -> both specs restored",
            max(back.values()) if len(back) == 2 else None,
            note=f"{ {d: round(at, 3) for d, at in sorted(back.items())} } (the first agent's "
            "publish of each, acknowledged by the broker)",
        )
        restored = self.capture.events("rebuild.restored", after=t0, before=t_end)
        lost = {s.node for s in self.capture.events("rebuild.broker_lost_state", after=t0)}
        epochs = self.capture.events("rebuild.epoch_written", after=t0, before=t_end)
        r.add(
            "rebuild: records restored (all agents)",
            len(restored),
            "count",
            note=f"{len({s.fields.get('topic') for s in restored})} distinct topics; "
            f"{len(lost)} of {self.n} agents found the broker lost; "
            f"{len(epochs)} epoch(s) written",
        )
        if self.daemons:
            starts = sum(n.daemon_starts(t0, t_end) for n in self.nodes)
            r.add(
                "rebuild: daemons started or restarted",
                starts,
                "count",
                target="0",
                ok=starts == 0,
            )
            r.add(
                "rebuild: SIGUSR1 sent (all nodes)",
                sum(self.reloads(t0, t_end).values()),
                "count",
            )

    def _job_figures(self, rounds: Mapping[str, list[JobRound]]) -> None:
        r = self.result
        target = JOB_START_TARGET_S if self.n == JOB_START_TARGET_N else None
        for form, done in rounds.items():
            if not done:
                continue
            what = JOB_FORMS[form]
            totals = [d.total_s for d in done]
            failed = [d.problem for d in done if not d.ok]
            over = sum(1 for t in totals if target is not None and t > target)
            r.add(
                f"job start ({form}): create -> status exit 0",
                statistics.median(totals),
                target=f"<= {target:g} s, every round" if target is not None else "",
                ok=None if target is None else not failed and over == 0,
                note=f"{what}; min {min(totals):.3f} / median {statistics.median(totals):.3f} / "
                f"max {max(totals):.3f} s over {len(done)} rounds"
                + (f"; {over} over target" if over else "")
                + (f"; FAILED: {failed[0]}" if failed else ""),
            )
            if form == "commands":
                r.add(
                    f"job start ({form}): the create process",
                    statistics.median(d.create_s or 0.0 for d in done),
                    note=_spread([d.create_s or 0.0 for d in done])
                    + " (Python start-up, connect, retained snapshot, publish)",
                )
                r.add(
                    f"job start ({form}): the status process(es)",
                    statistics.median(d.status_s for d in done),
                    note=_spread([d.status_s for d in done])
                    + f"; status runs per round: {[d.status_runs for d in done]}",
                )
            ready = [d.ready_s for d in done if d.ready_s is not None]
            for part, what in JOB_PARTS.items():
                ends = [d.parts[part] for d in done if part in d.parts]
                r.add(
                    f"job start ({form}): start -> {part}",
                    statistics.median(ends) if ends else None,
                    note=f"{what}; {_spread(ends)}"
                    + ("" if len(ends) == len(done) else f"; in {len(ends)} of {len(done)} rounds"),
                )
            cpu = [d.busy_s for d in done]
            r.add(
                f"job start ({form}): machine CPU busy, start -> exit 0",
                statistics.median(cpu),
                "CPU-s",
                note=f"min {min(cpu):.2f} / max {max(cpu):.2f} CPU-s (every process on the "
                "machine: agents, daemons, ctl probes, commands, broker, this bench)",
            )
            r.add(
                f"job start ({form}): spec -> every node's report ready",
                statistics.median(ready) if ready else None,
                note=_spread(ready)
                + " (the agents' work, at the bench's subscriber)"
                + (
                    ""
                    if len(ready) == len(done)
                    else f"; not all ready in {len(done) - len(ready)}"
                ),
            )
            if self.daemons:
                starts = [s for d in done for s in d.starts]
                r.add(
                    f"job start ({form}): daemon starts per node per round (max)",
                    max(starts, default=0),
                    "count",
                    target="exactly 1",
                    ok=bool(starts) and all(s == 1 for s in starts),
                    note=f"min {min(starts, default=0)}",
                )
                r.add(
                    f"job start ({form}): SIGUSR1 per round (all nodes, max)",
                    max(d.sigusr1 for d in done),
                    "count",
                    target="0",
                    ok=all(d.sigusr1 == 0 for d in done),
                )

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
        agents = [a for a in self.agent_processes() if a.pid != proc.pid]
        a0 = cpu_seconds(agents)
        rss: list[int] = []
        while time.monotonic() - t0 < self.opts.idle_s:
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(1.0)
        c1, m1 = proc.cpu_times(), me.cpu_times()
        d1 = cpu_seconds(daemons)
        a1 = cpu_seconds(agents)
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
        if self.processes:
            spent_agents = sum(a1.get(pid, 0.0) - a0.get(pid, 0.0) for pid in a1 if pid in a0)
            pct = spent_agents / elapsed * 100
            r.add(
                "other agent processes idle CPU, per agent",
                pct / max(len(a1), 1),
                "% core",
                note=f"{len(a1)} agent processes: {pct:.1f} % core in all, their ctl probes not "
                "included",
            )
        else:
            bench = (m1.user + m1.system - m0.user - m0.system) / elapsed * 100
            alive = sum(1 for n in self.nodes if n.alive)
            r.add(
                "in-process agents idle CPU, per agent",
                bench / max(alive, 1),
                "% core",
                note=f"{alive} agents in this process: {bench:.1f} % core in all",
            )
        probes = m1.children_user + m1.children_system - m0.children_user - m0.children_system
        if self.daemons and not self.processes:
            r.add(
                "idle: ctl probes of the in-process agents",
                max(0.0, probes) / elapsed * 100,
                "% core",
                note="`imexd-sim-ctl -q` every probe_interval_s, `-N -j` every "
                "domain_probe_interval_s, per agent (Python start-up each time)",
            )
        if self.daemons:
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
            node.leave()
        hosted = [n.hosted for n in self.nodes if isinstance(n, InProcNode) and n.hosted]
        await end_agents(hosted, 25)
        for agent in hosted:
            exc = agent.failure()
            if exc is not None and not self.result.error:
                self.result.error = f"agent {agent.name} failed: {exc!r}"
        deadline = time.monotonic() + 25
        for node in self.all_nodes():
            if isinstance(node, ProcNode):
                if node in self.nodes:
                    await node.exited(max(0.1, deadline - time.monotonic()))
                node.kill()
        for helper in (self._monitor_task, self._lag_task):
            if helper is not None:
                helper.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                    await helper
        self.broker.stop()
        sweep(self.root)


# Output --------------------------------------------------------------------------------


def describe_run(daemons: bool, agents: str, kind: str) -> str:
    mode = "simulated daemons" if daemons else 'no daemons (clique "")'
    who = "agents as `imexd run` processes" if agents == "process" else "agents in process"
    what = {
        "jobstart": "job start",
        "shared": "shared-domain workloads",
        "rebuild": "an empty broker rebuilt",
    }.get(kind, "formation, leave, join, idle, crash")
    return f"{mode}, {who}: {what}"


def print_result(result: Result) -> None:
    mode = describe_run(result.daemons, result.agents, result.kind)
    title = f"N = {result.n}, {mode}; {result.load}"
    print_figures(title, result.figures, result.error, target_width=30)


def print_summary(results: Sequence[Result]) -> None:
    """Per (mode, N) and figure with a target: the median of the repeats, and the verdicts."""
    print("\nSummary (median of the repeats; verdicts of every repeat)")
    keys: dict[tuple[str, str, bool, int], list[Result]] = {}
    for r in results:
        keys.setdefault((r.kind, r.agents, r.daemons, r.n), []).append(r)
    for (kind, agents, daemons, n), runs in keys.items():
        print(f"  N = {n}, {describe_run(daemons, agents, kind)}, {len(runs)} run(s)")
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
            print(f"    {name:<60} {shown:>12} {spread:<16} {figs[0].target:<28} {verdicts}")


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
                for kind in opts.phases:
                    index += 1
                    result = await one_run(
                        opts,
                        n=n,
                        daemons=daemons,
                        kind=kind,
                        base=base,
                        index=index,
                        octet=octet,
                        log_out=log_out,
                    )
                    capture_runs.append(result)
    return capture_runs


async def one_run(
    opts: Options,
    *,
    n: int,
    daemons: bool,
    kind: str,
    base: Path,
    index: int,
    octet: int,
    log_out: TextIO,
) -> Result:
    """One run of one benchmark (`kind`) in its own work folder with its own broker."""
    if opts.max_load is not None:
        await wait_for_load(opts.max_load, 300.0)
    root = base / f"run{index}-{kind}-{opts.agents}-{'sim' if daemons else 'none'}-{n}"
    root.mkdir(parents=True)
    run = Run(opts, n, daemons=daemons, root=root, octet=octet)
    run.result.kind = kind
    log_agents(log_out, run.capture)
    print(f"\nrun {index}: N = {n}, {describe_run(daemons, opts.agents, kind)}", flush=True)
    try:
        if kind == "jobstart":
            await run.execute_job_start()
        elif kind == "shared":
            await run.execute_shared()
        elif kind == "rebuild":
            await run.execute_rebuild()
        else:
            await run.execute()
    except (BenchError, TimeoutError) as exc:
        run.result.error = str(exc) or type(exc).__name__
        run.log(f"FAILED: {run.result.error}")
    finally:
        await run.close()
    print_result(run.result)
    if run.result.anomalous:
        print(f"  kept {root} and {base / 'agents.log'} to investigate")
    elif not opts.keep:
        shutil.rmtree(root, ignore_errors=True)
    return run.result


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
        "--agents",
        choices=("inproc", "process"),
        default="inproc",
        help="inproc: N agents in this process (default); process: N `imexd run` processes",
    )
    parser.add_argument(
        "--timings",
        choices=("shipped", "fast"),
        default=None,
        help="the agents' settings: the shipped defaults, or imexd.demo.timings.FAST "
        "(default: shipped in process, fast as processes)",
    )
    parser.add_argument(
        "--phases",
        default="domain,jobstart",
        help="comma-separated: domain (formation, leave, join, idle, crash), jobstart, "
        "shared (workload create and delete on a formed domain), rebuild "
        "(default domain,jobstart)",
    )
    parser.add_argument("--job-rounds", type=int, default=3, help="job start rounds per form (3)")
    parser.add_argument(
        "--job-wait-s",
        type=float,
        default=60.0,
        help="job start: `domain status --wait` seconds, and the bound of a round (60)",
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
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    if not phases or set(phases) - {"domain", "jobstart", "shared", "rebuild"}:
        parser.error(f"--phases {args.phases!r}: expected domain, jobstart, shared, rebuild")
    timings = args.timings or ("fast" if args.agents == "process" else "shipped")
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
        agents=args.agents,
        timings=timings,
        phases=phases,
        job_rounds=max(1, args.job_rounds),
        job_wait_s=args.job_wait_s,
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
        "[domain] name, [bus] url, [imex] binary/ctl = simulator, [health] listen; "
        + ("the fast timings of imexd.demo.timings.FAST; " if opts.timings == "fast" else "")
        + f"[bus] will_delay_s = {opts.will_delay_s:g}; max_nodes {opts.max_nodes}, "
        f"groups of {opts.group_size}; agents {opts.agents}"
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
                "agents": r.agents,
                "kind": r.kind,
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
