"""What every benchmark shares: its error, its figures, the machine it ran on, the CPU
and memory of the processes it watches, the sweep of the processes it left, the one way
to give a node its settings (`agent_sections`) and to run it in this process
(`InProcAgent`, with its logs), the one way to start a broker (`broker_target`), and the
way to the tests' launchers.

The benchmarks are scripts run from the checkout (`.venv/bin/python bench/NAME.py`), so
this folder is first on their import path and they import this module as `harness`,
first. Importing it also puts the checkout on the path, once for every benchmark, so
that they start nodes and brokers with the launchers the tests use (`tests.cluster`'s
simulated nodes, `tests.brokers`' Mosquitto, `tests.nats_servers`), not with copies of
them, and writes the checkout's bytecode (`compile_bytecode`), as an installed package
has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import psutil
import structlog
from structlog.typing import Processor

from imexd.agent.run import Agent
from imexd.demo.nodes import node_folder
from imexd.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
"""The checkout the benchmarks measure."""
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after bench/: `tests` is the checkout's test package

from imexd.demo.brokers import find_mosquitto  # noqa: E402 - after the path
from tests.brokers import Mosquitto  # noqa: E402 - after the path
from tests.nats_servers import Nats, NatsCluster, find_nats_server  # noqa: E402


def compile_bytecode(tree: Path = ROOT) -> None:
    """Write the bytecode of `tree`'s imexd, as installing its wheel does. A checkout
    installed editable under PYTHONDONTWRITEBYTECODE=1 (the default of the machines these
    figures come from) would compile every imported module of imexd again in every
    process a benchmark starts: each agent, control command, simulated daemon and `ctl`
    probe, which no installed node does."""
    import compileall

    compileall.compile_dir(tree / "imexd", quiet=1)


compile_bytecode()


def log_agents(out: TextIO, tap: Processor) -> None:
    """Route the in-process agents' logs to `out` as shipped (JSON lines, level info),
    through `tap` first: a structlog processor that notes the events a benchmark times."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            tap,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def agent_sections(
    folder: Path,
    *,
    name: str,
    address: str,
    clique: str,
    domain: str | None,
    max_nodes: int,
    urls: Sequence[str],
    bus: Mapping[str, Any] | None = None,
    health_listen: str = "127.0.0.1:0",
) -> dict[str, dict[str, Any]]:
    """A benchmark node's settings: the shipped defaults but for what makes it distinct
    (the simulated node's folder, `imexd.demo.nodes.node_folder`: state and run dirs,
    hosts file, a fake driver; its name, address and health listener), its clique, its
    domain (None: assigned mode, idle until the control plane assigns one) of at most
    `max_nodes`, and its bus: `urls`, plus the `[bus]` keys of `bus`. A benchmark changes
    more (daemons, timings) on the result."""
    sections = node_folder(folder, name=name, address=address, health_listen=health_listen)
    sections["node"]["clique"] = clique
    sections["domain"] = {"max_nodes": max_nodes}
    if domain is None:
        sections["domain"]["assigned"] = True
    else:
        sections["domain"]["name"] = domain
    sections["bus"] = {"url": list(urls), **(bus or {})}
    return sections


class InProcAgent:
    """An agent as a coroutine of this process (formation.py's in-process nodes, scale.py's
    workers). Its log events carry its name as `bench_node` (tasks the agent creates
    inherit the context), and `leave` is what SIGTERM does to `imexd run`."""

    def __init__(self, name: str, settings: Settings) -> None:
        self.name = name
        self.agent = Agent(settings)
        self.stop = asyncio.Event()
        self.handover = asyncio.Event()
        self.task: asyncio.Task[int] | None = None

    def start(self, on_exit: Callable[[], None] | None = None) -> None:
        """Start it (once); `on_exit` is called when its run ends, however it ends."""
        if self.task is None:
            self.task = asyncio.create_task(self._main(on_exit), name=f"agent-{self.name}")

    async def _main(self, on_exit: Callable[[], None] | None) -> int:
        structlog.contextvars.bind_contextvars(bench_node=self.name)
        try:
            return await self.agent.run(stop=self.stop, handover=self.handover)
        finally:
            if on_exit is not None:
                on_exit()

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def leave(self) -> None:
        self.stop.set()

    async def exited(self, limit_s: float) -> int | None:
        """Its exit code once it ended (None: not started, or still running after `limit_s`)."""
        if self.task is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                return await asyncio.shield(self.task)
        return None

    def members(self) -> dict[int, str]:
        """Its settled membership: slot -> address."""
        return {slot: m.address for slot, m in self.agent.core.desired.members.items()}

    def failure(self) -> BaseException | None:
        """What ended its run with an error (None: running, cancelled, or a clean exit)."""
        task = self.task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()


async def end_agents(agents: Iterable[InProcAgent], limit_s: float) -> None:
    """Every agent leaves; those still running after `limit_s` are cancelled (bounded)."""
    running = []
    for agent in agents:
        agent.leave()
        if agent.alive and agent.task is not None:
            running.append(agent.task)
    if not running:
        return
    _, pending = await asyncio.wait(running, timeout=limit_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5)


class BenchError(Exception):
    """A phase did not complete in time, or the setup failed."""


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


def print_figures(
    title: str, figures: Sequence[Figure], error: str | None = None, *, target_width: int = 10
) -> None:
    """One run's table: a title line, the error if any, then a row per figure."""
    print(f"\n{title}")
    if error:
        print(f"  ERROR: {error}")
    width = max((len(f.name) for f in figures), default=10)
    print(f"  {'figure':<{width}}  {'value':>12}  {'target':<{target_width}}  verdict  note")
    for f in figures:
        print(
            f"  {f.name:<{width}}  {f.shown():>12}  {f.target:<{target_width}}  "
            f"{f.verdict:<7}  {f.note}"
        )


def cpu_seconds(procs: Iterable[psutil.Process]) -> dict[int, float]:
    """pid -> user + system CPU seconds of each process still alive."""
    out: dict[int, float] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
    return out


def cpu_total(procs: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of the processes still alive, together."""
    return sum(cpu_seconds(procs).values())


def rss_mb(procs: Iterable[psutil.Process]) -> float:
    """The resident memory of the processes still alive, together, in MiB."""
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total / 2**20


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


def machine() -> str:
    """The machine and the code measured: CPUs (and their model), memory, Python, load,
    the commit (and whether the agent's code differs from it)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    tree = "not a git checkout"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "imexd")
        tree = f"commit {head}" + (" with uncommitted changes in imexd/" if dirty else "")
    return (
        f"{os.cpu_count()} CPUs ({model or platform.processor()}), "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}, "
        f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {tree}"
    )


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


# Brokers: one shape for every benchmark (start, stop, where to connect, its processes).


class Target(Protocol):
    @property
    def protocol(self) -> str | None:
        """The `[bus] protocol` the agents get; None: the default (auto)."""

    @property
    def urls(self) -> list[str]: ...

    @property
    def endpoint(self) -> tuple[str, int]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def version(self) -> str: ...

    def processes(self) -> list[psutil.Process]: ...


def first_line(command: list[str]) -> str:
    """The first line a command prints (a version), or "unknown (why)"."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0] if lines else "unknown"


def pids_alive(pids: Iterable[int | None]) -> list[psutil.Process]:
    """The processes of `pids` that still run."""
    found = []
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
    return found


class MosquittoTarget:
    """A Mosquitto on a free port; `persistence`: whether a restart keeps its store;
    `extra_config`: directives of the benchmark's own."""

    def __init__(
        self,
        folder: Path,
        protocol: str | None,
        *,
        persistence: bool = True,
        extra_config: str = "",
    ) -> None:
        self.server = Mosquitto(folder, persistence=persistence, extra_config=extra_config)
        self.protocol = protocol

    @property
    def urls(self) -> list[str]:
        return [self.server.url]

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def version(self) -> str:
        return first_line([find_mosquitto() or "mosquitto", "-h"])

    def processes(self) -> list[psutil.Process]:
        proc = self.server.proc
        return pids_alive([proc.pid if proc is not None else None])


class NatsTarget:
    """One nats-server, or a cluster of `size` configured as docs/brokers.md does (each
    consumer `consumer_replicas` replicas in memory; None: the server's default)."""

    protocol = "3.1.1"

    def __init__(
        self,
        folder: Path,
        size: int,
        *,
        binary: str | None = None,
        consumer_replicas: int | None = 1,
    ) -> None:
        self.binary = binary
        self.cluster = (
            NatsCluster(folder, size=size, binary=binary, consumer_replicas=consumer_replicas)
            if size > 1
            else None
        )
        self.single = Nats(folder, binary=binary) if size == 1 else None

    @property
    def servers(self) -> list[Nats]:
        if self.cluster is not None:
            return self.cluster.servers
        return [self.single] if self.single else []

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def endpoint(self) -> tuple[str, int]:
        server = next((s for s in self.servers if s.alive()), self.servers[0])
        return server.host, server.port

    def start(self) -> None:
        if self.cluster is not None:
            self.cluster.start()
        elif self.single is not None:
            self.single.start()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def version(self) -> str:
        return first_line([self.binary or find_nats_server() or "nats-server", "--version"])

    def processes(self) -> list[psutil.Process]:
        return pids_alive(s.pid for s in self.servers)


BROKER_KINDS = ("mosquitto", "nats", "nats-cluster")


def broker_target(
    kind: str,
    folder: Path,
    *,
    extra_config: str = "",
    nats_server: str | None = None,
    consumer_replicas: int | None = 1,
) -> Target:
    """The broker `kind` (of BROKER_KINDS) with its files in `folder`, not started yet.

    Mosquitto keeps no store, so a restart brings it back empty, and takes the benchmark's
    `extra_config`; NATS runs the binary `nats_server` (None: `find_nats_server`), a
    cluster (three servers) with its consumers' `consumer_replicas` replicas in memory
    (None: nats-server's default, the streams' replicas on disk). Starting a NATS target
    blocks (its readiness check runs an event loop of its own): start it in a thread."""
    if kind == "mosquitto":
        return MosquittoTarget(folder, None, persistence=False, extra_config=extra_config)
    if kind in ("nats", "nats-cluster"):
        size = 1 if kind == "nats" else 3
        return NatsTarget(folder, size, binary=nats_server, consumer_replicas=consumer_replicas)
    raise BenchError(f"unknown broker {kind!r}: expected one of {', '.join(BROKER_KINDS)}")


def restart(target: Target) -> None:
    """Stop `target` and start it again on its ports (a Mosquitto without a store: empty)."""
    target.stop()
    target.start()
