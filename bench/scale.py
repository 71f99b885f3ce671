"""Benchmark at scale: hundreds of membership-only agents in many cliques, on one broker or
a three-server NATS cluster.

    .venv/bin/python bench/scale.py --nodes 256 --cliques 16
    .venv/bin/python bench/scale.py --nodes 1024 --cliques 57 --broker nats-cluster
    .venv/bin/python bench/scale.py --nodes 18 --cliques 1 --broker nats-cluster \
        --nats-server .venv/nats-server-2.14.0/nats-server   # another nats-server build
    .venv/bin/python bench/scale.py --nodes 64 --cliques 4 --workers 2   # a quick look
    .venv/bin/python bench/scale.py --nodes 256 --cliques 16 --profile   # where CPU goes
    .venv/bin/python bench/scale.py --nodes 256 --cliques 16 --rebuild   # an empty broker

bench/formation.py times a few dozen agents with their (simulated) IMEX daemons; this
script asks what the bus and membership do with a fleet: N agents in C cliques, the
cliques as even as they can be (1024 in 57: 55 of 18 and 2 of 17).

The agents are membership-only: `[node] clique = ""` (a member without a daemon, as on a
node without multi-node NVLink), so no IMEX daemon, ctl probe or IMEX file exists and the
loop measured is the bus and membership: connect, snapshot, claim, the claim's echo, the
member record, every peer's view. Membership is sharded per (domain, clique); a member
without a clique is alone in its domain's "" clique, so each clique of this benchmark is
a domain of its own (`scale-cNN`), one shard each, exactly as one domain's cliques are.
Node names hold dots (`n0007.c03.scale`), so their topic levels are encoded.

The agents run in `--workers` processes (default 4), whole cliques dealt round-robin,
each process one event loop with its share of `imexd.agent.Agent(settings).run()`
coroutines (this same script with `--worker SPEC`, steered over its stdin and stdout), so
that one core's loop is not the limit. One more process hosts a single agent of clique 0,
the crash victim. Every agent has the shipped settings but what makes it distinct (name,
address, state dir, run dir, hosts file, health port 0, a fake driver under its folder)
and `[bus] will_delay_s` = `--will-delay-s` (2 s, so the crash is short), plus the
broker's URLs (`--broker nats-cluster`: all three, in an order rotated per agent so the
agents spread over the servers; NATS: `[bus] protocol = "3.1.1"`, all it speaks).
`--nats-server PATH` runs that nats-server binary (default: the one on PATH, else
/usr/sbin/nats-server); its `--version` is printed with the machine. The cluster's
consumers (one per QoS 1 subscription) are held in memory with one replica, as
docs/brokers.md configures them (nats-server 2.9.12 and later ignore the replica count and
give them the streams' three); `--nats-consumer-replicas 0` leaves nats-server's default
(the streams' three replicas, on disk).

Phases, each ended by a bounded wait (a miss is reported as a miss, never hidden):
1. formation: every agent starts at once. Measured from the last agent's first link up
   (`bus_connected`) until, in every clique, every member's view (its settled members,
   slot -> address) holds every member of the clique and the views are identical; the
   views are polled every 10 ms in each worker. Also: start -> last connected, the agent
   CPU (the worker processes, psutil) per node from start to formed, the broker's CPU
   seconds and RSS, the messages delivered to each agent.
2. idle: `--idle-s` seconds once formed: messages per node per second, CPU of the agents
   and of the broker.
3. leave: one agent of clique 0 stops (its stop event, what SIGTERM does): until the rest
   of clique 0 agree without it.
4. join: a new agent of clique 0 starts (in the worker of clique 0): until all of clique
   0 agree with it (from its start, and from its first link up).
5. crash: SIGKILL of the victim's process (its link dies without DISCONNECT): until the
   rest of clique 0 agree without it; the Will Delay is part of this by design.
With `--rebuild` (Mosquitto only) phases 3 to 5 are replaced by: a DomainSpec and one
WorkloadRecord per domain written as the control plane would (generation 1); once the
agents hold them, the broker (no persistence) is stopped and started again, empty, on its
port. Measured from its start until a subscriber of the bench has every spec and workload
back (imexd.agent.rebuild: the agents give back what they follow), and until every agent's
`rebuild.broker_lost_state` (from the workers' logs); the agents' settled views must not
change meanwhile (their hosts files would be rewritten: there are no daemons to restart).
In phases 3 to 5 every agent of the other cliques must receive no member record: the
count of member records each agent received per domain is what its bus counts
(`Bus.deliveries`, and `Bus.writes` for what it sent), so deliveries across cliques are
counted at the receiver at any time.

Every process the script starts (broker, workers) has the run's work folder on its
command line; on exit, failure, SIGINT or SIGTERM the agents leave (bounded), then
whatever still runs from that folder is killed and the folder removed (`--keep` keeps it,
with each worker's JSON log). Runs are bounded: each wait by its own limit, the whole run
by `--limit-s`. The first lines printed say what ran: the machine, its load average, the
commit and whether the agent's code had uncommitted changes. `--profile` writes a cProfile
of each worker from the start to formed + 1 s (workerN.prof in the kept folder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime as dt
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiomqtt
import psutil
from harness import (
    BROKER_KINDS,
    BenchError,
    Figure,
    InProcAgent,
    MosquittoTarget,
    Target,
    agent_sections,
    broker_target,
    cpu_total,
    end_agents,
    first_line,
    log_agents,
    machine,
    print_figures,
    restart,
    rss_mb,
    sweep,
)

from imexd.messages import DomainSpec, WorkloadRecord, encode
from imexd.settings import settings_from_mapping
from imexd.topics import Topics
from tests.nats_servers import find_nats_server

SCRIPT: Final = Path(__file__).resolve()
"""This script: the workers run it with `--worker SPEC`."""
PREFIX: Final = "imex/v2"
INF: Final = float("inf")
POLL_S: Final = 0.01
"""How often a worker looks at its agents' views (an identity check while nothing moved)."""
LAG_PERIOD_S: Final = 0.01
FORMATION_TARGETS_S: Final = {256: 3.0, 1024: 10.0}
"""N -> seconds from the last connect to formed (issue 13, on a 2-core machine)."""
CPU_TARGET_MS: Final = 15.0
"""Agent CPU per node per formation."""
MAX_NODES: Final = 18
READY_TIMEOUT_S: Final = 120.0
"""A worker's start-up (imports, settings, agents built) at most."""
CHANGE_LIMIT_S: Final = 30.0
"""A leave or join converged at most this long after it began (a crash: plus the delay)."""
QUIT_LIMIT_S: Final = 40.0


# The plan: nodes, cliques, workers -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodePlan:
    name: str
    clique: int
    address: str
    index: int
    initial: bool = True
    """Started at formation (False: the joiner, started in the join phase)."""

    @property
    def domain(self) -> str:
        return f"scale-c{self.clique:02d}"


def clique_sizes(n: int, cliques: int) -> list[int]:
    """`n` nodes in `cliques` cliques as even as can be (the larger ones first)."""
    return [n // cliques + (1 if i < n % cliques else 0) for i in range(cliques)]


def plan_nodes(n: int, cliques: int) -> list[NodePlan]:
    nodes: list[NodePlan] = []
    for c, size in enumerate(clique_sizes(n, cliques)):
        for h in range(size):
            i = len(nodes)
            nodes.append(NodePlan(f"n{i:04d}.c{c:02d}.scale", c, f"127.200.{c}.{10 + h}", i))
    return nodes


def deal(nodes: Sequence[NodePlan], workers: int) -> list[list[NodePlan]]:
    """Whole cliques to workers, round-robin (clique c to worker c mod `workers`)."""
    out: list[list[NodePlan]] = [[] for _ in range(workers)]
    for node in nodes:
        out[node.clique % workers].append(node)
    return [w for w in out if w]


# The worker: one process, one event loop, many agents ------------------------------------


@dataclass
class Hosted:
    """One agent of a worker, and what the worker last told the bench about it."""

    plan: NodePlan
    run: InProcAgent
    seen_desired: object = None
    view: dict[int, str] = field(default_factory=dict)


class Worker:
    """Runs the agents of its spec; reads commands on stdin, writes events on stdout, one
    JSON object a line, times on the machine's monotonic clock (the same in every process).

    Commands: start RAMP_S (every initial agent, spread over RAMP_S seconds), join NAME,
    leave NAME, stats, quit.
    Events: ready, up (an agent's first link), views (the agents whose settled members changed),
    exit (an agent ended), stats, bye.
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = spec
        self.root = Path(spec["root"])
        self.hosted: dict[str, Hosted] = {}
        self.up: set[str] = set()
        self.connects: Counter[str] = Counter()
        """Links up per agent (more than one: a link was lost or declared dead)."""
        self.starter: asyncio.Task[None] | None = None
        self.lag_max = 0.0
        self.lag_total = 0.0
        self.topics = Topics(PREFIX)

    def emit(self, **event: Any) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    def capture(
        self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        """A structlog processor: an agent's first `bus_connected` is its link up."""
        if event_dict.get("event") == "bus_connected":
            node = str(event_dict.get("bench_node", ""))
            self.connects[node] += 1
            if node and node not in self.up:
                self.up.add(node)
                self.emit(ev="up", node=node, at=time.monotonic())
        return event_dict

    def sections(self, node: NodePlan) -> dict[str, dict[str, Any]]:
        """The node's settings: the shipped defaults but what the module docstring lists."""
        urls = list(self.spec["urls"])
        turn = node.index % len(urls)  # the agents spread over a cluster's servers
        bus: dict[str, Any] = {"will_delay_s": float(self.spec["will_delay_s"])}
        if self.spec.get("resync_interval_s") is not None:
            bus["resync_interval_s"] = float(self.spec["resync_interval_s"])
        if self.spec["protocol"] != "auto":
            bus["protocol"] = self.spec["protocol"]
        return agent_sections(
            self.root / "nodes" / node.name,
            name=node.name,
            address=node.address,
            clique="",  # no daemon: the membership alone is measured
            domain=node.domain,
            max_nodes=MAX_NODES,
            urls=urls[turn:] + urls[:turn],
            bus=bus,
        )

    def build(self) -> None:
        for raw in self.spec["nodes"]:
            plan = NodePlan(**raw)
            settings = settings_from_mapping(self.sections(plan))
            self.hosted[plan.name] = Hosted(plan, InProcAgent(plan.name, settings))

    def start(self, h: Hosted) -> None:
        name = h.plan.name
        h.run.start(on_exit=lambda: self.emit(ev="exit", node=name, at=time.monotonic()))

    async def start_all(self, hosted: Sequence[Hosted], ramp_s: float) -> None:
        """Start `hosted`, spread evenly over `ramp_s` seconds (0: all at once)."""
        t0 = time.monotonic()
        for i, h in enumerate(hosted):
            due = t0 + ramp_s * i / len(hosted)
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            self.start(h)

    async def watch(self) -> None:
        """Tell the bench every change of an agent's settled members (slot -> address): one
        line per poll for all the views that changed in it (a line per view cost the
        agents' CPU figure a write and a flush per change)."""
        while True:
            changed = []
            for h in self.hosted.values():
                desired = h.run.agent.core.desired
                if desired is h.seen_desired:
                    continue
                h.seen_desired = desired
                view = h.run.members()
                if view != h.view:
                    h.view = view
                    changed.append([h.plan.name, sorted(view.items())])
            if changed:
                self.emit(ev="views", at=time.monotonic(), views=changed)
            await asyncio.sleep(POLL_S)

    async def lag(self) -> None:
        """How late this loop runs a 10 ms timer: time every agent here waited for others."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            late = loop.time() - before - LAG_PERIOD_S
            if late > 0.005:
                self.lag_total += late
                self.lag_max = max(self.lag_max, late)

    def stats(self) -> dict[str, Any]:
        """Per agent: deliveries by kind, and by kind and domain for the member records;
        the loop's lateness since the last call."""
        per_node: dict[str, dict[str, int]] = {}
        for name, h in self.hosted.items():
            if h.run.task is None:
                continue  # not started (the joiner before its phase)
            bus = h.run.agent.bus
            counts: Counter[str] = Counter()
            if bus is not None:
                for (kind, domain), count in bus.deliveries.items():
                    counts[kind] += count
                    if kind == "member":
                        counts[f"member@{domain}"] += count
                counts["link@connects"] = self.connects[name]
                for kind, count in bus.writes.items():
                    counts[f"sent@{kind}"] += count
            per_node[name] = dict(counts)
        out = {"nodes": per_node, "lag_max": self.lag_max, "lag_total": self.lag_total}
        self.lag_max = self.lag_total = 0.0
        return out

    async def quit(self) -> None:
        """Every agent leaves (bounded), then the rest is cancelled."""
        if self.starter is not None:
            self.starter.cancel()
        await end_agents((h.run for h in self.hosted.values()), QUIT_LIMIT_S - 10)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        self.build()
        profiler_path: str | None = self.spec.get("profile")
        # CPU time, not wall time: on a loaded machine a wall clock charges the waits.
        profiler = cProfile.Profile(time.process_time) if profiler_path else None
        helpers = [
            asyncio.create_task(self.watch(), name="watch"),
            asyncio.create_task(self.lag(), name="lag"),
        ]
        self.emit(ev="ready", pid=os.getpid(), nodes=len(self.hosted))
        try:
            while line := await reader.readline():
                command = line.decode().split()
                match command:
                    case ["start", ramp]:
                        if profiler is not None:
                            profiler.enable()
                        initial = [h for h in self.hosted.values() if h.plan.initial]
                        self.starter = asyncio.create_task(self.start_all(initial, float(ramp)))
                    case ["join", name]:
                        self.start(self.hosted[name])
                    case ["leave", name]:
                        self.hosted[name].run.leave()
                    case ["stats"]:
                        if profiler is not None and profiler_path is not None:
                            profiler.disable()
                            profiler.dump_stats(profiler_path)
                            profiler = profiler_path = None  # the formation only
                        self.emit(ev="stats", **self.stats())
                    case ["quit"]:
                        break
                    case _:
                        self.emit(ev="error", text=f"unknown command {line!r}")
            await self.quit()
        finally:
            for task in helpers:
                task.cancel()
            self.emit(ev="bye")


def worker_main(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    worker = Worker(spec)
    with Path(spec["log"]).open("w") as out:
        log_agents(out, worker.capture)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(worker.serve())
    return 0


# The bench's side of a worker --------------------------------------------------------------


class WorkerProc:
    """A worker process as the bench sees it: its commands, its events, its CPU."""

    def __init__(self, bench: Bench, index: int, nodes: Sequence[NodePlan]) -> None:
        self.bench = bench
        self.index = index
        self.nodes = list(nodes)
        self.proc: asyncio.subprocess.Process | None = None
        self.ps: psutil.Process | None = None
        self.ready = asyncio.Event()
        self.stats_due: asyncio.Future[dict[str, Any]] | None = None
        self.bye = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None
        self.killed = False

    async def spawn(self, spec: Mapping[str, Any]) -> None:
        root = self.bench.root
        spec_path = root / f"worker{self.index}.json"
        spec_path.write_text(json.dumps(spec))
        with (root / f"worker{self.index}.stderr").open("wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(SCRIPT),
                "--worker",
                str(spec_path),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                limit=2**24,
                start_new_session=True,
            )
        self.ps = psutil.Process(self.proc.pid)
        self.reader = asyncio.create_task(self.read(), name=f"worker{self.index}")

    async def read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            ev = event.pop("ev")
            if ev == "ready":
                self.ready.set()
            elif ev == "stats":
                if self.stats_due is not None and not self.stats_due.done():
                    self.stats_due.set_result(event)
            elif ev == "bye":
                self.bye.set()
            else:
                self.bench.on_event(ev, event)
        self.bye.set()

    def send(self, command: str) -> None:
        if self.proc is not None and self.proc.stdin is not None and self.alive:
            self.proc.stdin.write(command.encode() + b"\n")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self.killed

    async def stats(self) -> dict[str, Any]:
        self.stats_due = asyncio.get_running_loop().create_future()
        self.send("stats")
        async with asyncio.timeout(30):
            return await self.stats_due

    def cpu(self) -> float:
        if self.ps is None:
            return 0.0
        with contextlib.suppress(psutil.Error):
            t = self.ps.cpu_times()
            return t.user + t.system
        return 0.0

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.killed = True


# Figures -------------------------------------------------------------------------------


# One run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    nodes: int
    cliques: int
    broker: str
    workers: int
    will_delay_s: float
    resync_interval_s: float | None
    idle_s: float
    limit_s: float
    keep: bool
    workdir: Path | None
    json_out: Path | None
    profile: bool = False
    ramp_s: float = 0.0
    rebuild: bool = False
    nats_server: str | None = None
    consumer_replicas: int | None = 1


def interpolate(samples: Sequence[tuple[float, ...]], at: float, index: int) -> float:
    """Field `index` of time-stamped `samples` at time `at`, linearly between two samples."""
    before = [s for s in samples if s[0] <= at]
    after = [s for s in samples if s[0] > at]
    if not before:
        return samples[0][index]
    if not after:
        return before[-1][index]
    (t0, v0), (t1, v1) = (before[-1][0], before[-1][index]), (after[0][0], after[0][index])
    return v0 + (v1 - v0) * (at - t0) / (t1 - t0)


class Bench:
    """One run: the broker, the workers, the phases."""

    def __init__(self, opts: Options, root: Path) -> None:
        self.opts = opts
        self.root = root
        self.plan = plan_nodes(opts.nodes, opts.cliques)
        self.clique0 = [p for p in self.plan if p.clique == 0]
        self.victim = self.clique0[-1]
        self.leaver = self.clique0[0]
        address = f"127.200.0.{10 + len(self.clique0)}"
        self.joiner = NodePlan(f"n{opts.nodes:04d}.c00.scale", 0, address, opts.nodes, False)
        self.broker: Target | None = None
        self.workers: list[WorkerProc] = []
        self.victim_worker: WorkerProc | None = None
        self.figures: list[Figure] = []
        self.error = ""
        self.ups: dict[str, float] = {}
        self.views: dict[str, tuple[float, frozenset[tuple[int, str]]]] = {}
        self.exited: dict[str, float] = {}
        self.changed = asyncio.Event()
        self.load = ""
        self.c0 = list(self.clique0)
        """Clique 0 as it should be now (the changes happen there)."""
        self.last_lag = 0.0
        """The workers' loop lateness at most, seconds, over the last `counts()` interval."""

    @property
    def anomalous(self) -> bool:
        """An error or a clique that never agreed: the logs should explain it (kept)."""
        return bool(self.error) or any(f.ok is False and f.value is None for f in self.figures)

    # Events from the workers.

    def on_event(self, ev: str, event: Mapping[str, Any]) -> None:
        node = str(event.get("node", ""))
        if ev == "up":
            self.ups.setdefault(node, float(event["at"]))
        elif ev == "views":
            at = float(event["at"])
            for name, pairs in event["views"]:
                self.views[str(name)] = (at, frozenset((int(s), str(a)) for s, a in pairs))
            self.changed.set()
        elif ev == "exit":
            self.exited[node] = float(event["at"])
            self.changed.set()
        elif ev == "error":
            self.log(f"worker: {event.get('text')}")

    def log(self, text: str) -> None:
        print(f"  [{self.opts.broker} N={self.opts.nodes}] {text}", flush=True)

    def add(self, name: str, value: float | None, unit: str = "s", **kw: Any) -> None:
        self.figures.append(Figure(name, value, unit, **kw))

    # Convergence.

    def agreed(self, members: Sequence[NodePlan]) -> float | None:
        """When `members` last changed their views, if every one maps exactly them (the same
        map on all); None while they do not."""
        want = {m.address for m in members}
        first: frozenset[tuple[int, str]] | None = None
        latest = 0.0
        for m in members:
            at_view = self.views.get(m.name)
            if at_view is None:
                return None
            at, view = at_view
            if {a for _, a in view} != want or len(view) != len(want):
                return None
            if first is None:
                first = view
            elif view != first:
                return None
            latest = max(latest, at)
        return latest

    async def wait_cliques(
        self, groups: Mapping[int, Sequence[NodePlan]], limit_s: float, what: str
    ) -> tuple[dict[int, float], str]:
        """Until every clique of `groups` agrees, at most `limit_s`: each agreed clique's
        time, and what was wrong with the others ("" when none was)."""
        deadline = time.monotonic() + limit_s
        done: dict[int, float] = {}
        while True:
            self.changed.clear()
            for c, members in groups.items():
                if c not in done:
                    at = self.agreed(members)
                    if at is not None:
                        done[c] = at
            if len(done) == len(groups):
                return done, ""
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(groups) - set(done))
                detail = []
                for c in missing[:3]:
                    want = {m.address for m in groups[c]}
                    wrong = []
                    for m in groups[c]:
                        view = self.views.get(m.name, (0.0, frozenset()))[1]
                        have = {a for _, a in view}
                        if have != want:
                            lacks = sorted(want - have)
                            extra = sorted(have - want)
                            wrong.append(f"{m.name} lacks {lacks} has extra {extra}")
                    detail.append(
                        f"clique {c} ({len(want)} members): "
                        + ("; ".join(wrong[:3]) or "views differ in their slots")
                    )
                problem = (
                    f"{len(missing)} of {len(groups)} cliques not agreed in {limit_s:g} s "
                    f"({'; '.join(detail)})"
                )
                self.log(f"{what}: {problem}")
                return done, problem
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self.changed.wait()

    def cliques(self, live: Iterable[NodePlan]) -> dict[int, list[NodePlan]]:
        out: dict[int, list[NodePlan]] = {}
        for p in live:
            out.setdefault(p.clique, []).append(p)
        return out

    # Counts.

    async def counts(self) -> dict[str, dict[str, int]]:
        """Every live agent's deliveries so far (by kind, and member records by domain)."""
        out: dict[str, dict[str, int]] = {}
        lag: list[float] = []
        for w in self.all_workers():
            if w.alive:
                stats = await w.stats()
                out.update(stats["nodes"])
                lag.append(float(stats["lag_max"]))
        self.last_lag = max(lag, default=0.0)
        return out

    def all_workers(self) -> list[WorkerProc]:
        extra = [self.victim_worker] if self.victim_worker is not None else []
        return [*self.workers, *extra]

    def agent_procs(self) -> list[psutil.Process]:
        return [w.ps for w in self.all_workers() if w.ps is not None and w.alive]

    # The run.

    async def setup(self) -> None:
        load = os.getloadavg()
        self.load = f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the run"
        self.broker = broker_target(
            self.opts.broker,
            self.root / "broker",
            nats_server=self.opts.nats_server,
            consumer_replicas=self.opts.consumer_replicas,
        )
        await asyncio.to_thread(self.broker.start)
        sizes = clique_sizes(self.opts.nodes, self.opts.cliques)
        self.log(
            f"{self.opts.cliques} cliques of {min(sizes)}..{max(sizes)}, "
            f"{self.opts.workers} worker processes + 1 (the crash victim); {self.load}"
        )
        if max(sizes) > MAX_NODES or min(sizes) < 2:
            raise BenchError(f"cliques of {min(sizes)}..{max(sizes)}: expected 2..{MAX_NODES}")
        rest = [p for p in self.plan if p != self.victim]
        dealt = deal(rest, self.opts.workers)
        for index, nodes in enumerate(dealt):
            if any(p.clique == 0 for p in nodes):
                nodes.append(self.joiner)
            self.workers.append(WorkerProc(self, index, nodes))
        self.victim_worker = WorkerProc(self, len(dealt), [self.victim])
        base = {
            "root": str(self.root),
            "urls": self.broker.urls,
            "protocol": self.broker.protocol or "auto",
            "will_delay_s": self.opts.will_delay_s,
            "resync_interval_s": self.opts.resync_interval_s,
        }
        for w in self.all_workers():
            spec = dict(base)
            spec["nodes"] = [asdict(p) for p in w.nodes]
            spec["log"] = str(self.root / f"worker{w.index}.log")
            if self.opts.profile:
                spec["profile"] = str(self.root / f"worker{w.index}.prof")
            await w.spawn(spec)
        async with asyncio.timeout(READY_TIMEOUT_S):
            for w in self.all_workers():
                await w.ready.wait()

    async def formation(self) -> None:
        n = self.opts.nodes
        assert self.broker is not None
        broker = self.broker.processes()
        groups = self.cliques(self.plan)
        samples = [self._sample_now(broker)]
        sampler = asyncio.create_task(self._sample(broker, samples), name="sampler")
        cpu0, broker0, rss0 = samples[0][1:]
        t0 = time.monotonic()
        for w in self.all_workers():
            w.send(f"start {self.opts.ramp_s}")
        limit = 30.0 + n / 15
        try:
            done, problem = await self.wait_cliques(groups, limit, "formation")
        finally:
            sampler.cancel()
        cpu1 = cpu_total(self.agent_procs())
        broker1 = cpu_total(broker)
        t_formed = time.monotonic() if problem else max(done.values())
        ups = [self.ups.get(p.name) for p in self.plan]
        if any(u is None for u in ups):
            raise BenchError(f"formation: {ups.count(None)} agents never connected")
        t_conn = max(u for u in ups if u is not None)
        self.add(
            "formation: start -> last agent connected",
            t_conn - t0,
            note=f"first {min(u for u in ups if u is not None) - t0:.3f} s",
        )
        target = FORMATION_TARGETS_S.get(n)
        per_clique = sorted(at - t_conn for at in done.values()) or [INF]
        self.add(
            "formation: last connected -> every clique agreed",
            None if problem else t_formed - t_conn,
            target=f"<= {target:g} s" if target else "",
            ok=(False if problem else None if target is None else t_formed - t_conn <= target),
            note=problem
            or f"per clique p50 {statistics.median(per_clique):.3f} s; "
            f"start -> formed {t_formed - t0:.3f} s",
        )
        per_node_ms = (cpu1 - cpu0) / n * 1000
        after_conn = (cpu1 - interpolate(samples, t_conn, 1)) / n * 1000
        self.add(
            "formation: agent CPU per node",
            per_node_ms,
            "ms",
            target=f"<= {CPU_TARGET_MS:g} ms",
            ok=per_node_ms <= CPU_TARGET_MS,
            note=f"the worker processes from start to formed: {cpu1 - cpu0:.2f} CPU-s for {n} "
            f"agents (their start, their logs and the bench's view polling included); "
            f"{after_conn:.1f} ms of it after the last connect",
        )
        self.add(
            "formation: broker CPU",
            broker1 - broker0,
            "CPU-s",
            note=f"start -> formed ({(broker1 - broker0) / max(t_formed - t0, 1e-9) * 100:.0f} "
            f"% of a core over {t_formed - t0:.2f} s)",
        )
        self.add(
            "formation: broker RSS (peak)",
            max(rss for *_, rss in samples),
            "MB",
            note=f"{len(broker)} process(es), sampled every 0.1 s; {rss0:.1f} MB before",
        )
        await asyncio.sleep(1.0)
        counts = await self.counts()
        totals = [sum(v for k, v in c.items() if "@" not in k) for c in counts.values()]
        members = [c.get("member", 0) for c in counts.values()]
        sent = [c.get("sent@member", 0) for c in counts.values()]
        kinds: Counter[str] = Counter()
        for c in counts.values():
            kinds.update({k: v for k, v in c.items() if "@" not in k})
        self.add(
            "formation: messages delivered per node",
            statistics.mean(totals),
            "msgs",
            note=f"max {max(totals)}; member records mean {statistics.mean(members):.1f}, max "
            f"{max(members)}; all nodes by kind: "
            + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
            + " (start -> formed + 1 s, counted by each agent's bus)",
        )
        self.add(
            "formation: member records published per node",
            statistics.mean(sent),
            "msgs",
            note=f"max {max(sent)}: every claim (a lost one is claimed again on the next "
            "free slot) and the member record",
        )
        sent_kinds: Counter[str] = Counter()
        for c in counts.values():
            sent_kinds.update({k[5:]: v for k, v in c.items() if k.startswith("sent@")})
        self.add(
            "formation: records published per node, all kinds",
            sum(sent_kinds.values()) / max(len(counts), 1),
            "msgs",
            note="by kind, all nodes: "
            + ", ".join(f"{k} {v}" for k, v in sorted(sent_kinds.items()))
            + " (retained records only; pings not counted)",
        )
        self.add_foreign("formation", counts)
        links = [c.get("link@connects", 0) for c in counts.values()]
        self.add(
            "formation: links up per agent",
            statistics.mean(links),
            "",
            note=f"max {max(links)}; more than 1: a link lost or declared dead (no ping echo "
            "within [bus] ping_interval_s, a timed-out operation) and reconnected",
        )
        self.add(
            "formation: worker event loop late by (max)",
            self.last_lag * 1000,
            "ms",
            note="a 10 ms timer in each worker: how long an agent waited for the others "
            "of its process (start -> formed + 1 s)",
        )
        if not problem:
            self.log(f"formed: {t_formed - t_conn:.3f} s after the last connect")

    async def _sample(
        self, broker: list[psutil.Process], out: list[tuple[float, float, float, float]]
    ) -> None:
        """Every 0.1 s, `_sample_now` into `out`."""
        while True:
            await asyncio.sleep(0.1)
            out.append(self._sample_now(broker))

    def _sample_now(self, broker: list[psutil.Process]) -> tuple[float, float, float, float]:
        """(when, agent CPU-s, broker CPU-s, broker RSS MB)."""
        agents = cpu_total(self.agent_procs())
        return time.monotonic(), agents, cpu_total(broker), rss_mb(broker)

    def add_foreign(self, phase: str, counts: Mapping[str, Mapping[str, int]]) -> None:
        """Member records an agent received from a clique not its own (must be none)."""
        domain = {p.name: p.domain for p in [*self.plan, self.joiner]}
        foreign = 0
        for node, c in counts.items():
            for key, v in c.items():
                if key.startswith("member@") and key != f"member@{domain[node]}":
                    foreign += v
        self.add(
            f"{phase}: member records delivered across cliques",
            foreign,
            "count",
            target="0",
            ok=foreign == 0,
            note="to any agent from another clique's shard, counted at the receiver",
        )

    async def idle(self) -> None:
        assert self.broker is not None
        broker = self.broker.processes()
        c0 = await self.counts()
        a0, b0, t0 = cpu_total(self.agent_procs()), cpu_total(broker), time.monotonic()
        await asyncio.sleep(self.opts.idle_s)
        c1 = await self.counts()
        a1, b1, t1 = cpu_total(self.agent_procs()), cpu_total(broker), time.monotonic()
        span = t1 - t0
        n = len(c1)
        delivered = sum(
            v - c0.get(node, {}).get(k, 0)
            for node, c in c1.items()
            for k, v in c.items()
            if "@" not in k
        )
        self.add(
            "idle: messages delivered per node per second",
            delivered / n / span,
            "/s",
            note=f"{n} agents over {span:.1f} s (shipped timings: a ping every 10 s)",
        )
        self.add(
            "idle: agent CPU per node",
            (a1 - a0) / n / span * 100,
            "% core",
            note=f"all workers {(a1 - a0) / span * 100:.0f} % of a core",
        )
        self.add("idle: broker CPU", (b1 - b0) / span * 100, "% core")
        self.add("idle: broker RSS", rss_mb(broker), "MB")

    async def change(
        self, phase: str, act: Callable[[], None], members: Sequence[NodePlan]
    ) -> tuple[float | None, str]:
        """Run `act` (a change in clique 0) and wait until `members` (clique 0 after it)
        agree; count what the other cliques received meanwhile. The time from `act` (None:
        no agreement), and what was wrong then."""
        c0 = await self.counts()
        t0 = time.monotonic()
        act()
        limit = CHANGE_LIMIT_S + (self.opts.will_delay_s if phase == "crash" else 0.0)
        done, problem = await self.wait_cliques({0: members}, limit, phase)
        await asyncio.sleep(0.5)  # what is still in flight reaches the other cliques too
        c1 = await self.counts()
        in_clique0 = {p.name for p in [*self.clique0, self.joiner]}
        others = [node for node in c1 if node not in in_clique0]
        mine = f"member@{self.clique0[0].domain}"
        crossed = own = 0
        for node in others:
            before = c0.get(node, {})
            for k, v in c1[node].items():
                if k == mine:
                    crossed += v - before.get(k, 0)
                elif k.startswith("member@"):
                    own += v - before.get(k, 0)
        self.add(
            f"{phase}: clique 0's member records delivered to other cliques",
            crossed,
            "count",
            target="0",
            ok=crossed == 0,
            note=f"to {len(others)} agents of {self.opts.cliques - 1} other cliques, from the "
            f"change until clique 0 agreed + 0.5 s; their own cliques' records meanwhile: "
            f"{own} (0 when the rest is idle)",
        )
        self.c0 = list(members)
        return (None, problem) if problem else (done[0] - t0, "")

    async def leave(self) -> None:
        leaver = self.leaver
        w = next(w for w in self.workers if leaver in w.nodes)
        rest = [p for p in self.c0 if p != leaver]
        took, problem = await self.change("leave", lambda: w.send(f"leave {leaver.name}"), rest)
        self.add(
            "leave: stop -> clique 0 agrees without it",
            took,
            ok=False if took is None else None,
            note=problem,
        )

    async def join(self) -> None:
        joiner = self.joiner
        w = next(w for w in self.workers if joiner in w.nodes)
        t0 = time.monotonic()
        took, problem = await self.change(
            "join", lambda: w.send(f"join {joiner.name}"), [*self.c0, joiner]
        )
        up = self.ups.get(joiner.name)
        note = problem or "its link-up time unknown"
        if took is not None and up is not None:
            note = f"its link up at +{up - t0:.3f} s, agreed {t0 + took - up:.3f} s after"
        self.add(
            "join: start -> clique 0 agrees with it",
            took,
            ok=False if took is None else None,
            note=note,
        )

    async def crash(self) -> None:
        w = self.victim_worker
        assert w is not None
        rest = [p for p in self.c0 if p != self.victim]
        took, problem = await self.change("crash", w.kill, rest)
        d = self.opts.will_delay_s
        self.add(
            "crash: SIGKILL -> clique 0 agrees without it",
            took,
            ok=False if took is None else None,
            note=problem
            or f"the Will Delay ({d:g} s) included by design: +{(took or 0) - d:.3f} s beyond it",
        )

    async def execute(self) -> None:
        await self.setup()
        await self.formation()
        await self.idle()
        if self.opts.rebuild:
            await self.rebuild()
            return
        if self.agreed(self.c0) is None:
            for phase in ("leave", "join", "crash"):
                self.add(f"{phase}: not run", None, ok=False, note="clique 0 never agreed")
            return
        await self.leave()
        await self.join()
        await self.crash()

    async def rebuild(self) -> None:
        """An empty broker on the same port: until every spec and workload is back."""
        assert self.broker is not None
        if not isinstance(self.broker, MosquittoTarget):
            raise BenchError("--rebuild: only a Mosquitto can be restarted empty")
        topics = Topics(PREFIX)
        domains = sorted({p.domain for p in self.plan})
        wanted = {topics.spec(d) for d in domains} | {topics.workload(d, "job") for d in domains}
        port = int(self.broker.urls[0].rsplit(":", 1)[1])
        async with aiomqtt.Client("127.0.0.1", port, identifier="imexd-bench-control") as c:
            for d in domains:
                spec = DomainSpec(domain=d, max_nodes=MAX_NODES, generation=1)
                job = WorkloadRecord(workload="job", domain=d, channel=1, generation=1)
                await c.publish(topics.spec(d), encode(spec), qos=1, retain=True)
                await c.publish(topics.workload(d, "job"), encode(job), qos=1, retain=True)
        await asyncio.sleep(2.0)  # every agent got them live (milliseconds)
        views = dict(self.views)
        await asyncio.to_thread(restart, self.broker)
        t0 = time.monotonic()
        wall0 = time.time()
        back: dict[str, float] = {}
        deadline = t0 + 60.0
        while len(back) < len(wanted) and time.monotonic() < deadline:
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                async with aiomqtt.Client("127.0.0.1", port, identifier="imexd-bench-watch") as c:
                    await c.subscribe(f"{PREFIX}/domains/+/spec")
                    await c.subscribe(f"{PREFIX}/domains/+/workloads/+")
                    async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                        async for message in c.messages:
                            if message.payload and message.topic.value in wanted:
                                back.setdefault(message.topic.value, time.monotonic() - t0)
                            if len(back) == len(wanted):
                                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # late view changes, if any
        self.add(
            "rebuild: empty broker start -> every spec and workload back",
            max(back.values()) if len(back) == len(wanted) else None,
            ok=len(back) == len(wanted),
            note=f"{len(back)} of {len(wanted)} records ({len(domains)} domains) at the "
            f"bench's subscriber; first {min(back.values(), default=0.0):.3f} s",
        )
        moved = sorted(n for n, (at, _) in self.views.items() if views.get(n, (at,))[0] != at)
        churn = sorted(
            n for n, (_, view) in self.views.items() if views.get(n, (0, view))[1] != view
        )
        self.add(
            "rebuild: agents whose settled view differs after it",
            len(churn),
            "count",
            target="0",
            ok=not churn,
            note=f"{', '.join(churn[:5])}; {len(moved)} agents' views moved and came back "
            "(the wills Mosquitto publishes as it shuts down, taken back as the link drops: "
            "a daemon's files wait for a proven link, imexd.agent.run)",
        )
        lost: list[float] = []
        restored = 0
        for w in self.all_workers():
            for line in (self.root / f"worker{w.index}.log").read_text().splitlines():
                if '"rebuild.' not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError):
                    event = json.loads(line)
                    if event["event"] == "rebuild.restored":
                        restored += 1
                    elif event["event"] == "rebuild.broker_lost_state":
                        at = dt.datetime.fromisoformat(str(event["timestamp"])).timestamp()
                        lost.append(at - wall0)
        self.add(
            "rebuild: empty broker start -> last agent found it lost",
            max(lost) if lost else None,
            note=f"{len(lost)} of {len(self.plan)} agents; first {min(lost, default=0.0):.3f} s; "
            f"{restored} records restored in all",
        )

    async def close(self) -> None:
        for w in self.all_workers():
            w.send("quit")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(QUIT_LIMIT_S):
                for w in self.all_workers():
                    if w.alive:
                        await w.bye.wait()
        for w in self.all_workers():
            w.kill()
            if w.reader is not None:
                w.reader.cancel()
        if self.broker is not None:
            self.broker.stop()
        sweep(self.root)


# Output and main -----------------------------------------------------------------------


def print_bench(bench: Bench) -> None:
    o = bench.opts
    title = (
        f"N = {o.nodes} in {o.cliques} cliques, broker {o.broker}, {o.workers} worker "
        f"processes; {bench.load}"
    )
    print_figures(title, bench.figures, bench.error)


async def run_bench(opts: Options, root: Path) -> Bench:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    bench = Bench(opts, root)
    try:
        async with asyncio.timeout(opts.limit_s):
            await bench.execute()
    except (BenchError, TimeoutError) as exc:
        bench.error = str(exc) or f"the run took more than --limit-s {opts.limit_s:g} s"
        bench.log(f"FAILED: {bench.error}")
    finally:
        await bench.close()
    return bench


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=256, help="agents (256)")
    parser.add_argument("--cliques", type=int, default=16, help="cliques, 18 nodes at most (16)")
    parser.add_argument(
        "--broker",
        choices=BROKER_KINDS,
        default="mosquitto",
        help="mosquitto (default), one nats-server, or a cluster of three",
    )
    parser.add_argument(
        "--nats-server",
        default=None,
        metavar="PATH",
        help="the nats-server binary (default: on PATH, else /usr/sbin/nats-server)",
    )
    parser.add_argument(
        "--nats-consumer-replicas",
        type=int,
        default=1,
        metavar="N",
        help="nats-cluster: replicas of each subscription's consumer, in memory (1, as "
        "docs/brokers.md configures it; nats-server 2.9.12 and later ignore it and use the "
        "streams' 3); 0: nats-server's default (the streams' 3, on disk)",
    )
    parser.add_argument("--workers", type=int, default=4, help="agent processes (4)")
    parser.add_argument("--will-delay-s", type=float, default=2.0, help="[bus] will_delay_s (2)")
    parser.add_argument(
        "--resync-interval-s",
        type=float,
        default=None,
        help="[bus] resync_interval_s (default: the shipped one; 0: no periodic re-read)",
    )
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle sampling seconds (10)")
    parser.add_argument(
        "--ramp-s",
        type=float,
        default=0.0,
        help="start the agents spread evenly over this many seconds (0: all at once)",
    )
    parser.add_argument("--limit-s", type=float, default=300.0, help="bound of the run (300)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the work folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="after formation: restart the broker empty instead of leave, join and crash",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile each worker from start to formed + 1 s: workerN.prof in the kept "
        "work folder (implies --keep; the profiler slows the agents)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 4:
        parser.error(f"--nodes {args.nodes}: expected at least 4")
    if not 1 <= args.cliques <= args.nodes // 2:
        parser.error(f"--cliques {args.cliques}: expected 1..{args.nodes // 2}")
    if -(-args.nodes // args.cliques) > MAX_NODES:
        parser.error(
            f"--nodes {args.nodes} in {args.cliques} cliques: more than {MAX_NODES} a clique"
        )
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: expected at least 1")
    return Options(
        nodes=args.nodes,
        cliques=args.cliques,
        broker=args.broker,
        workers=args.workers,
        will_delay_s=args.will_delay_s,
        resync_interval_s=args.resync_interval_s,
        idle_s=args.idle_s,
        limit_s=args.limit_s,
        keep=args.keep or args.profile,
        workdir=args.workdir,
        json_out=args.json,
        profile=args.profile,
        ramp_s=args.ramp_s,
        rebuild=args.rebuild,
        nats_server=args.nats_server,
        consumer_replicas=args.nats_consumer_replicas or None,
    )


def nats_server_version(binary: str | None) -> str:
    """`nats-server --version` of `binary` (None: the one `find_nats_server` finds)."""
    path = binary or find_nats_server()
    if path is None:
        return "no nats-server found"
    return f"{path}: {first_line([path, '--version'])}"


def raise_fd_limit() -> None:
    """Every agent holds a few sockets and the broker one per agent: the soft limit of
    open files goes up to the hard one (inherited by the broker and the workers)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--worker"] and len(args) == 2:
        return worker_main(Path(args[1]))
    opts = parse_args(args)
    raise_fd_limit()
    root = Path(tempfile.mkdtemp(prefix="imexd-scale-", dir=opts.workdir))
    print(f"machine: {machine()}")
    if opts.broker != "mosquitto":
        print(f"nats-server: {nats_server_version(opts.nats_server)}")
    print(f"work folder: {root}", flush=True)
    bench: Bench | None = None
    try:
        bench = asyncio.run(run_bench(opts, root))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: cleaning up")
        return 130
    finally:
        sweep(root)
        if opts.keep or (bench is not None and bench.anomalous):
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print_bench(bench)
    if opts.json_out is not None:
        data = {
            "options": {k: str(v) for k, v in asdict(opts).items()},
            "load": bench.load,
            "machine": machine(),
            "error": bench.error,
            "figures": [asdict(f) for f in bench.figures],
        }
        opts.json_out.write_text(json.dumps(data, indent=1))
    misses = [f for f in bench.figures if f.ok is False]
    return 1 if bench.error or misses else 0


if __name__ == "__main__":
    sys.exit(main())
