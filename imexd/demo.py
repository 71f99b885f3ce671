"""`imexd demo`: a whole IMEX domain of simulated nodes on this machine, for a newcomer.

A newcomer should see what imexd does before owning a GPU rack or root: N agents
(`imexd run`, exactly as shipped) each supervise a simulated IMEX daemon
(`imexd-sim-daemon`) on its own loopback address, meet over an MQTT broker, form the
domain "demo", survive two crashes, and leave. The demo only starts processes, reads
each agent's `/status` and sends signals, so what it shows is the product's behaviour,
not a re-enactment:

1. formation: the agents claim slots, write the IMEX files, start their daemons; the
   table fills in until every member is READY and connected (domain UP);
2. crash 1: SIGKILL one node's IMEX daemon; its agent restarts it with backoff while
   the peers see it gone (DEGRADED), then the domain is UP again;
3. crash 2: SIGKILL one node's agent; its daemon keeps running, the broker publishes
   the agent's will and the peers drop the node; the agent is started again, takes its
   old slot back and adopts the running daemon instead of restarting IMEX;
4. shutdown: SIGTERM every agent (each leaves the domain and stops its daemon), stop the
   broker, remove the temporary folder, and check that nothing is left behind.

The broker is embedded unless `--broker` names one: Mosquitto when installed, else
amqtt (the `demo` extra), a pure-Python MQTT 3.1.1 broker run inside this process.
Every wait is bounded; a failure exits 1 with the reason, Ctrl-C (or SIGTERM, SIGHUP)
cleans up at any point and exits 128 + the signal number (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self, TextIO

import aiohttp
import psutil

from imexd.errors import ConfigError, ImexdError
from imexd.settings import load_settings, parse_broker_url, render_toml

DOMAIN: Final = "demo"
"""The one static domain every simulated node joins."""
CLIQUE: Final = "sim.0"
"""The simulated NVLink partition: all nodes share it, as the GPUs of one NVL72 do."""
MIN_NODES: Final = 2
MAX_NODES: Final = 32
"""More nodes than this only slow a laptop down; the benchmarks go further."""

POLL_S: Final = 0.25
"""Seconds between two rounds of `/status` requests: the resolution of the timings."""
HTTP_TIMEOUT_S: Final = 2.0
FORM_TIMEOUT_BASE_S: Final = 60.0
FORM_TIMEOUT_PER_NODE_S: Final = 5.0
"""Formation may take 60 s + 5 s per node: Python agents start slowly on a busy machine."""
NOTICE_TIMEOUT_S: Final = 30.0
RECOVER_TIMEOUT_S: Final = 60.0
AGENT_STOP_TIMEOUT_S: Final = 20.0
"""An agent leaves within stop_timeout_s + 5 s; this adds room for a loaded machine."""
KILL_WAIT_S: Final = 5.0
BROKER_START_TIMEOUT_S: Final = 10.0
SNAPSHOT_EVERY_S: Final = 1.0
"""Without a terminal a changed table is printed at most this often."""
LOG_TAIL_LINES: Final = 6

TIMINGS: Final[Mapping[str, Mapping[str, float | int]]] = {
    "domain": {"settle_s": 0.2},
    "bus": {
        "ping_interval_s": 1.0,
        "will_delay_s": 2.0,
        "reconnect_initial_s": 0.2,
        "reconnect_max_s": 1.0,
        "keepalive_s": 5.0,
    },
    "imex": {"reload_min_interval_s": 1.2},
    "daemon": {
        "start_s": 0.5,
        "stable_s": 10.0,
        "backoff_initial_s": 0.5,
        "backoff_max_s": 2.0,
        "crash_loop_starts": 5,
        "crash_loop_window_s": 30.0,
        "fatal_cooldown_s": 10.0,
        "stop_timeout_s": 3.0,
        "probe_interval_s": 1.0,
        "domain_probe_interval_s": 1.0,
        "probe_timeout_s": 5.0,
    },
    "health": {"report_interval_s": 2.0},
}
"""Production timings shortened to demo scale, as the scenario tests use them (the
simulator honours one SIGUSR1 a second). Probes stay at 1 s: each one starts a Python
process, and a laptop has few cores."""

SIM_RELOAD_WINDOW_S: Final = "1"
"""IMEXD_SIM_RELOAD_WINDOW_S: the simulated daemon honours one SIGUSR1 per second."""
BROKER_ENV: Final = "IMEXD_DEMO_BROKER"
"""`mosquitto` or `amqtt` forces the embedded broker; unset or `auto`: Mosquitto when
installed, else amqtt."""
KEEP_ENV: Final = "IMEXD_DEMO_KEEP"
"""Set (not 0): keep the folder with the agents' and daemons' logs, to look into a run."""
IMEX_PORTS: Final = (50000, 50005)
"""IMEX's default SERVER_PORT and IMEX_CMD_PORT, used when free on the demo addresses."""


READINESS: Final = ("BusConnected", "SlotSettled", "DaemonReady")
"""The conditions /readyz requires, in the order an agent reports them."""


class DemoError(ImexdError):
    """The demo could not show what it promised; the message says why (exit 1)."""


# What the table shows (pure).


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    """One agent's `/status` (its HealthReport), reduced to what the demo shows."""

    slot: int | None
    ready: bool
    daemon: str
    """The supervisor state: STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, FATAL."""
    pid: int | None
    restarts: int
    imex: str
    """The IMEX state word from `ctl -q` (READY, WAITING_FOR_PEERS...); "" if none."""
    sees: str
    """The domain as this node judges it (UP, DEGRADED, DOWN, FORMING); "" if none."""
    members: tuple[str, ...] | None
    """The node names in its domain view; None without a view."""
    not_ready: tuple[str, ...]
    """Members its view shows not READY (the culprits when the domain is not UP)."""
    unwell: tuple[str, ...]
    """Members its view shows not READY or not connected to every other member."""
    reason: str
    """The reason of the first failing readiness condition (e.g. DaemonCrashed)."""
    message: str
    """Its human message."""


def parse_status(data: object) -> NodeView | None:
    """A NodeView from a `/status` body; None if it is not a HealthReport."""
    if not isinstance(data, dict) or not isinstance(data.get("daemon"), dict):
        return None
    daemon: dict[str, Any] = data["daemon"]
    view = data.get("domain_view")
    members: tuple[str, ...] | None = None
    unwell: list[str] = []
    not_ready: list[str] = []
    if isinstance(view, dict) and isinstance(view.get("nodes"), dict):
        names = []
        for entry in view["nodes"].values():
            if isinstance(entry, dict):
                name = str(entry.get("node", ""))
                names.append(name)
                if entry.get("status") != "READY":
                    not_ready.append(name)
                if entry.get("status") != "READY" or not entry.get("connected"):
                    unwell.append(name)
        members = tuple(sorted(names))
    reason = message = ""
    for cond in data.get("conditions") or ():
        if (
            isinstance(cond, dict)
            and cond.get("type") in READINESS
            and cond.get("status") != "True"
        ):
            reason, message = str(cond.get("reason", "")), str(cond.get("message", ""))
            break
    slot, pid, restarts = data.get("slot"), daemon.get("pid"), daemon.get("restarts")
    return NodeView(
        slot=slot if isinstance(slot, int) else None,
        ready=data.get("ready") is True,
        daemon=str(daemon.get("state") or ""),
        pid=pid if isinstance(pid, int) else None,
        restarts=restarts if isinstance(restarts, int) else 0,
        imex=str(daemon.get("imex_status") or ""),
        sees=str(view.get("status", "")) if isinstance(view, dict) else "",
        members=members,
        not_ready=tuple(sorted(not_ready)),
        unwell=tuple(sorted(unwell)),
        reason=reason,
        message=message,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The domain's state as the demo reports it, with the reason in a few words."""

    state: str
    """UP, DEGRADED or FORMING."""
    detail: str


def judge_domain(views: Mapping[str, NodeView | None], *, formed: bool) -> Verdict:
    """UP when every node answers, is ready, and sees all of them as members, UP; else
    FORMING before the first UP and DEGRADED after it.

    The agents judge the domain over the members they know; the demo also knows how
    many nodes there should be, so a node whose agent is gone counts against it. The
    detail names nodes in trouble first, then how the others see the domain.
    """
    expected = sorted(views)
    troubled: list[str] = []
    seen: list[str] = []
    for name in expected:
        view = views[name]
        if view is None:
            troubled.append(f"{name}: agent not answering")
        elif not view.ready:
            troubled.append(f"{name}: {view.reason or 'not ready'}")
        elif view.sees != "UP" or view.members != tuple(expected):
            seen.append(_how_it_sees(name, view, expected))
    problems = troubled + seen
    if not problems:
        return Verdict("UP", f"all {len(expected)} members READY and connected")
    if not formed:
        ready = sum(1 for v in views.values() if v is not None and v.ready)
        return Verdict("FORMING", f"{ready} of {len(expected)} nodes ready")
    more = f" (+{len(problems) - 2} more)" if len(problems) > 2 else ""
    return Verdict("DEGRADED", "; ".join(problems[:2]) + more)


def _how_it_sees(name: str, view: NodeView, expected: Sequence[str]) -> str:
    lost = [n for n in expected if n not in (view.members or ())]
    if not view.sees or view.members is None:
        return f"{name}: no domain view yet"
    if lost:
        return f"{name} sees {view.sees} without {', '.join(lost)}"
    if view.not_ready:
        return f"{name} sees {view.sees}: {', '.join(view.not_ready)} not READY"
    if view.unwell:
        return f"{name} sees {view.sees}: {', '.join(view.unwell)} not all connected"
    return f"{name} sees {view.sees}"


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One node's line of the table: what its agent reports and how its processes are."""

    node: str
    address: str
    agent: str
    """starting, up, down (killed by the demo), leaving, left, exited."""
    view: NodeView | None
    orphan_pid: int | None = None
    """The daemon's pid while its agent is down and the daemon runs on alone."""


HEADER: Final = ("SLOT", "NODE", "ADDRESS", "AGENT", "DAEMON", "PID", "IMEX", "READY", "SEES")
GREEN: Final = frozenset({"UP", "READY", "RUNNING", "up", "yes"})
YELLOW: Final = frozenset(
    {"FORMING", "STARTING", "STOPPING", "INITIALIZING", "STARTING_AUTH_SERVER", "INIT_GPU"}
    | {"WAITING_FOR_PEERS", "WAITING_FOR_RECOVERY", "starting", "leaving", "left", "STOPPED"}
    | {"LEAVING"}
)
RED: Final = frozenset({"DEGRADED", "DOWN", "BACKOFF", "FATAL", "UNAVAILABLE", "down", "exited"})
NOTE_MAX: Final = 60


def _cells(row: Row) -> list[str]:
    v = row.view
    if v is None:
        daemon = "running alone" if row.orphan_pid else "-"
        pid = str(row.orphan_pid) if row.orphan_pid else "-"
        return ["-", row.node, row.address, row.agent, daemon, pid, "-", "-", "-"]
    return [
        "-" if v.slot is None else str(v.slot),
        row.node,
        row.address,
        row.agent,
        v.daemon or "-",
        "-" if v.pid is None else str(v.pid),
        v.imex or "-",
        "yes" if v.ready else "no",
        v.sees or "-",
    ]


def _note(row: Row) -> str:
    v = row.view
    if v is None:
        return "IMEX keeps running without its agent" if row.orphan_pid else ""
    parts = []
    if v.restarts:
        parts.append(f"{v.restarts} restart{'s' if v.restarts > 1 else ''}")
    if not v.ready and v.reason:
        parts.append(f"{v.reason}: {v.message}" if v.message else v.reason)
    note = "; ".join(parts)
    return note if len(note) <= NOTE_MAX else note[: NOTE_MAX - 3] + "..."


def _paint(text: str, word: str, *, color: bool) -> str:
    if not color:
        return text
    code = "32" if word in GREEN else "33" if word in YELLOW else "31" if word in RED else ""
    return f"\x1b[{code}m{text}\x1b[0m" if code else text


def table_lines(rows: Sequence[Row], *, color: bool = False, width: int = 0) -> list[str]:
    """The table, one string per line; `width` > 0 cuts lines to fit a terminal."""
    body = [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in [list(HEADER), *body]) for i in range(len(HEADER))]
    lines = []
    notes = ["NOTE", *(_note(r) for r in rows)]
    for index, (cells, note) in enumerate(zip([list(HEADER), *body], notes, strict=True)):
        plain_parts = [cell.ljust(w) for cell, w in zip(cells, widths, strict=True)]
        plain = "  ".join([*plain_parts, note]).rstrip()
        if width and len(plain) > width:
            lines.append(plain[: width - 1] + "…")
            continue
        painted = [
            _paint(part, cell, color=color and index > 0 and column > 2)
            for column, (part, cell) in enumerate(zip(plain_parts, cells, strict=True))
        ]
        lines.append("  ".join([*painted, note]).rstrip())
    return lines


# Small pieces of plumbing.


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _bindable(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def pick_addresses(count: int, rand: secrets.SystemRandom) -> tuple[list[str], tuple[int, int]]:
    """`count` loopback addresses 127.A.B.(10+i) and IMEX ports free on all of them.

    A random block keeps concurrent demos apart, B >= 128 keeps them off the blocks the
    scenario tests and the benchmark use (low B). IMEX's own ports are preferred, others
    are tried when something else holds them (a real nvidia-imex on 0.0.0.0).
    """
    for _ in range(40):
        block = f"127.{rand.randrange(10, 250)}.{rand.randrange(128, 254)}"
        addresses = [f"{block}.{10 + i}" for i in range(count)]
        candidates = [IMEX_PORTS, *((p, p + 5) for p in rand.sample(range(20000, 40000), 5))]
        for ports in candidates:
            if all(_bindable(a, p) for a in addresses for p in ports):
                return addresses, ports
    raise DemoError(
        "cannot bind loopback addresses 127.x.y.z other than 127.0.0.1: the simulated nodes "
        "need them (Linux has them; on macOS add aliases with `ifconfig lo0 alias`)"
    )


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join("      " + (line if len(line) <= 200 else line[:197] + "...") for line in text)


def _tool(name: str, module: str, folder: Path) -> str:
    """The simulator's console script, or a wrapper that runs its module.

    The agent recognises either form as an IMEX daemon (and adopts it after a restart).
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    wrapper = folder / name
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def demo_processes(folder: Path, *, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Every process whose command line names the demo's folder: agents, daemons, probes,
    the embedded Mosquitto. Nothing else on the machine is ever touched."""
    needle, skip = str(folder), {os.getpid(), *exclude}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"], ad_value=None):
        info = proc.info
        if info["pid"] in skip or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(needle in str(arg) for arg in info["cmdline"] or ()):
            found.append(proc)
    return found


async def end_processes(procs: Sequence[psutil.Process], grace_s: float = KILL_WAIT_S) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace_s` seconds."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = await asyncio.to_thread(psutil.wait_procs, procs, grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    await asyncio.to_thread(psutil.wait_procs, alive, grace_s)


# Brokers.


class Broker:
    """An MQTT broker the demo's agents use; an async context manager."""

    url: str = ""
    description: str = ""
    """One line for the header and the summary."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def failure(self) -> str | None:
        """Why the broker is gone while the demo needs it; None while it runs."""
        return None


class ExternalBroker(Broker):
    """The broker named by `--broker`: used as is, never started nor stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.description = f"{url} (given with --broker)"

    async def __aenter__(self) -> Self:
        """Fail at once when nothing listens there, not after the formation timeout."""
        target = parse_broker_url(self.url)
        try:
            async with asyncio.timeout(BROKER_START_TIMEOUT_S):
                if target.scheme == "unix":
                    _, writer = await asyncio.open_unix_connection(target.path)
                else:
                    _, writer = await asyncio.open_connection(target.host, target.port)
        except (OSError, TimeoutError) as exc:
            raise DemoError(f"cannot reach the broker {self.url}: {exc or 'timed out'}") from None
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return self


def find_mosquitto() -> str | None:
    """The mosquitto binary: on PATH, or where Debian puts it outside a user's PATH."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


class MosquittoBroker(Broker):
    """Mosquitto on a free port of 127.0.0.1, with a throwaway config, no persistence."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.folder = folder
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = folder / "mosquitto.log"

    async def __aenter__(self) -> Self:
        self.folder.mkdir(parents=True, exist_ok=True)
        problem = ""
        for _ in range(3):  # the free port can be taken between the probe and the bind
            port = free_port()
            problem = await self._start(port)
            if not problem:
                self.url = f"mqtt://127.0.0.1:{port}"
                self.description = f"Mosquitto ({self.binary}) at {self.url}, MQTT 5"
                return self
        raise DemoError(f"Mosquitto did not start: {problem}\n{_tail(self.log_path)}")

    async def _start(self, port: int) -> str:
        conf = self.folder / "mosquitto.conf"
        lines = [
            f"listener {port} 127.0.0.1",
            "allow_anonymous true",
            "persistence false",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if os.geteuid() == 0:
            # As root Mosquitto drops to user `mosquitto`, which cannot read our 0700 folder.
            lines.append("user root")
        conf.write_text("\n".join(lines) + "\n")
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                "-c",
                str(conf),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                return f"it exited with status {self.proc.returncode}"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return ""
        await self._stop()
        return f"not listening on port {port} after {BROKER_START_TIMEOUT_S:g} s"

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def failure(self) -> str | None:
        if self.proc is not None and self.proc.returncode is not None:
            return f"Mosquitto exited with status {self.proc.returncode}\n{_tail(self.log_path)}"
        return None


class AmqttBroker(Broker):
    """amqtt, a pure-Python MQTT 3.1.1 broker, inside this process (the `demo` extra).

    amqtt cannot parse an MQTT 5 CONNECT that carries properties: it waits for bytes
    that never come, where the 3.1.1 spec requires the answer "unacceptable protocol
    version". imexd's bus tries MQTT 5 first and falls back to 3.1.1 on that answer, so
    the demo's listener reads each CONNECT's protocol level first, gives that answer to
    MQTT 5 itself and hands every other connection to amqtt untouched. With 3.1.1 the
    agents' wills fire at once instead of after the Will Delay.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log_path = folder / "amqtt.log"
        self._broker: Any = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._log_handler: logging.Handler | None = None
        self._previous_handler: Any = None

    async def __aenter__(self) -> Self:
        try:
            from amqtt.broker import Broker as Amqtt  # noqa: PLC0415 - optional dependency
        except ImportError:
            raise DemoError(
                "no MQTT broker: install Mosquitto (e.g. `apt install mosquitto`), or the "
                "demo extra for the built-in one (`pip install 'imexd[demo]'`), or pass "
                "--broker mqtt://HOST:PORT"
            ) from None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._quiet_logs()
        config = {
            "listeners": {"default": {"type": "external"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
            },
        }
        try:
            self._broker = Amqtt(config)
            await self._broker.start()
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        except Exception as exc:
            await self._close()
            raise DemoError(f"the amqtt broker did not start: {exc}") from None
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"mqtt://127.0.0.1:{port}"
        self.description = f"amqtt (Python, in this process) at {self.url}, MQTT 3.1.1"
        return self

    def _quiet_logs(self) -> None:
        """amqtt and its state machine log to a file in the folder, not over the table."""
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._log_handler = handler
        for name in ("amqtt", "transitions"):
            logger = logging.getLogger(name)
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        loop = asyncio.get_running_loop()
        self._previous_handler = loop.get_exception_handler()

        def to_file(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            logging.getLogger("amqtt.demo").error("%s", context.get("message"), exc_info=None)

        loop.set_exception_handler(to_file)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception:  # amqtt's own failures stay in its log, never on the demo's screen
            logging.getLogger("amqtt.demo").exception("connection failed")
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from amqtt.adapters import StreamWriterAdapter  # noqa: PLC0415 - optional dependency

        async with asyncio.timeout(10):
            head = await reader.readexactly(1)
            for _ in range(4):  # the Remaining Length, 1 to 4 bytes
                head += await reader.readexactly(1)
                if head[-1] < 0x80:
                    break
            size = await reader.readexactly(2)
            name = await reader.readexactly(min(int.from_bytes(size, "big"), 6))
            level = await reader.readexactly(1)
        head += size + name + level
        if head[0] >> 4 == 1 and name == b"MQTT" and level[0] >= 5:
            writer.write(b"\x20\x02\x00\x01")  # CONNACK: unacceptable protocol version
            await writer.drain()
            return
        await self._broker.external_connected(
            _ReplayReader(head, reader), StreamWriterAdapter(writer), "default"
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._broker is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(KILL_WAIT_S):
                    await self._broker.shutdown()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=KILL_WAIT_S)
        if self._log_handler is not None:
            for name in ("amqtt", "transitions"):
                logging.getLogger(name).removeHandler(self._log_handler)
            self._log_handler.close()
            asyncio.get_running_loop().set_exception_handler(self._previous_handler)
            self._log_handler = None


class _ReplayReader:
    """amqtt's ReaderAdapter over a stream whose first bytes were already read."""

    def __init__(self, head: bytes, reader: asyncio.StreamReader) -> None:
        self._head = head
        self._reader = reader

    async def read(self, n: int = -1) -> bytes:
        if n < 0:
            data, self._head = self._head + await self._reader.read(), b""
            return data
        data, self._head = self._head[:n], self._head[n:]
        if len(data) < n:
            data += await self._reader.readexactly(n - len(data))
        return data

    def feed_eof(self) -> None:
        self._reader.feed_eof()


def choose_broker(env: Mapping[str, str], folder: Path, mosquitto: str | None) -> Broker:
    """The embedded broker: `IMEXD_DEMO_BROKER` if set, else Mosquitto when installed
    (`mosquitto`: its binary, or None), else amqtt."""
    wanted = env.get(BROKER_ENV, "").strip().lower() or "auto"
    if wanted not in ("auto", "mosquitto", "amqtt"):
        raise DemoError(f"{BROKER_ENV}={wanted}: expected mosquitto, amqtt or auto")
    if mosquitto is not None and wanted != "amqtt":
        return MosquittoBroker(mosquitto, folder)
    if wanted == "mosquitto":
        raise DemoError(f"{BROKER_ENV}=mosquitto, but no mosquitto binary is installed")
    return AmqttBroker(folder)


# Nodes.


class DemoNode:
    """One simulated GPU node: its folder, its agent process and its last `/status`."""

    def __init__(
        self,
        *,
        name: str,
        address: str,
        folder: Path,
        settings: Mapping[str, Mapping[str, object]],
    ) -> None:
        self.name = name
        self.address = address
        self.folder = folder
        self.config_path = folder / "imexd.toml"
        self.log_path = folder / "agent.log"
        self.health_port = free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.agent = "starting"
        """starting, up, down (killed by the demo), leaving, left, exited."""
        self.view: NodeView | None = None
        self.orphan_pid: int | None = None
        folder.mkdir(parents=True)
        hosts = folder / "hosts"
        hosts.write_text("127.0.0.1 localhost\n")
        sections = {k: dict(v) for k, v in settings.items()}
        sections["node"] |= {"name": name, "address": address, "state_dir": str(folder / "state")}
        sections["imex"] |= {
            "run_dir": str(folder / "run"),
            "hosts_file": str(hosts),
            "env": {
                "IMEXD_SIM_HOSTS_FILE": str(hosts),
                "IMEXD_SIM_RELOAD_WINDOW_S": SIM_RELOAD_WINDOW_S,
            },
        }
        sections["health"] |= {"listen": f"127.0.0.1:{self.health_port}"}
        self.config_path.write_text(render_toml(sections))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}/status"

    async def start(self, env: Mapping[str, str]) -> None:
        """Start `imexd run` in its own session: Ctrl-C reaches the demo, not the agents."""
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "imexd",
                "run",
                "--config",
                str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=dict(env),
                start_new_session=True,
            )
        self.agent = "starting"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        """SIGKILL the agent alone, as a crash: its daemon runs on."""
        if self.proc is not None and self.alive():
            self.proc.kill()
            await self.proc.wait()
        self.agent = "down"

    async def stop(self, grace_s: float = AGENT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM: the agent leaves the domain and stops its daemon; its exit status,
        None if it had to be killed."""
        if self.proc is None:
            return 0
        if self.alive():
            self.agent = "leaving"
            self.proc.terminate()
        try:
            async with asyncio.timeout(grace_s):
                code = await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            self.agent = "exited"
            return None
        self.agent = "left" if code == 0 else "exited"
        return code

    def row(self) -> Row:
        return Row(self.name, self.address, self.agent, self.view, self.orphan_pid)


def node_settings(
    *, nodes: int, broker_url: str, topic_prefix: str, ports: tuple[int, int], folder: Path
) -> dict[str, dict[str, object]]:
    """The settings every node shares: the domain, the broker, the simulator, the timings."""
    sections: dict[str, dict[str, object]] = {
        "node": {"clique": CLIQUE},
        "domain": {"name": DOMAIN, "max_nodes": nodes},
        "bus": {"url": [broker_url], "topic_prefix": topic_prefix},
        "imex": {
            "binary": _tool("imexd-sim-daemon", "imexd.sim.daemon", folder),
            "ctl": _tool("imexd-sim-ctl", "imexd.sim.ctl", folder),
            "server_port": ports[0],
            "cmd_port": ports[1],
        },
        "daemon": {},
        "health": {},
        "log": {"level": "info", "format": "json"},
    }
    for section, values in TIMINGS.items():
        sections[section] |= values
    return sections


# The screen.


class Screen:
    """Events scroll, the table stays below them and is redrawn in place on a terminal;
    elsewhere (a pipe, a CI log) each changed table is appended, at most once a second."""

    def __init__(self, out: TextIO, *, tty: bool, color: bool) -> None:
        self.out = out
        self.tty = tty
        self.color = color
        self._frame: list[str] = []
        self._drawn = 0
        self._last_key: list[str] | None = None
        self._last_print = 0.0
        self._gone = False

    @classmethod
    def for_stream(cls, out: TextIO) -> Screen:
        tty = out.isatty()
        return cls(out, tty=tty, color=tty and "NO_COLOR" not in os.environ)

    @property
    def width(self) -> int:
        """Columns of the terminal; 0 (no limit) without one."""
        return shutil.get_terminal_size().columns if self.tty else 0

    def _write(self, text: str) -> None:
        """One write per update: erase the live table, print `text`, draw the table again.

        The table's lines never wrap (they are cut to the width and height of the
        terminal), so moving the cursor up by their count lands on the table's first line.
        """
        erase = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        frame = "".join(line + "\n" for line in self._frame)
        self._emit(erase + text + frame)
        self._drawn = len(self._frame)

    def _emit(self, text: str) -> None:
        """Write and flush; a reader that went away (`imexd demo | head`) must not stop
        the cleanup, so output simply ends there."""
        if self._gone:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (BrokenPipeError, ValueError):
            self._gone = True

    def say(self, text: str = "") -> None:
        """Lines that stay: the header, events, the summary."""
        if self.tty:
            self._write(text + "\n")
        else:
            self._emit(text + "\n")

    def frame(self, key: list[str], lines: list[str], *, force: bool = False) -> None:
        """The live table; `key` is what counts as a change (the lines less the clock)."""
        if self.tty:
            rows = shutil.get_terminal_size().lines - 1
            if len(lines) > rows > 2:
                lines = [*lines[: rows - 1], f"... {len(lines) - rows + 1} more lines"]
            self._frame = lines
            self._write("")
            return
        now = time.monotonic()
        changed = key != self._last_key
        if changed and (force or now - self._last_print >= SNAPSHOT_EVERY_S):
            self._last_key, self._last_print = key, now
            self._emit("\n".join(lines) + "\n\n")

    def close(self) -> None:
        """Keep the last table on a terminal; the summary goes below it."""
        self._frame, self._drawn = [], 0
        self._emit("")


# The demo.


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """What the command line asked for."""

    nodes: int
    broker: str | None


@dataclasses.dataclass(slots=True)
class Results:
    """The measured times (seconds) and facts the summary reports."""

    formed_s: float = 0.0
    daemon_node: str = ""
    daemon_noticed_s: float = 0.0
    daemon_recovered_s: float = 0.0
    daemon_restarts: int = 0
    agent_node: str = ""
    agent_dropped_s: float = 0.0
    agent_rejoined_s: float = 0.0
    agent_restart_to_up_s: float = 0.0
    same_slot: bool = False
    adopted: bool = False
    adopted_pid: int | None = None
    shutdown_s: float = 0.0
    clean_exits: int = 0


@dataclasses.dataclass(slots=True)
class Cleanup:
    """What the final cleanup found and did."""

    killed_agents: int = 0
    stray_processes: int = 0
    left_processes: int = 0
    folder_removed: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)


class Demo:
    """The demo's resources (folder, broker, agents, poller) and its four acts."""

    def __init__(self, options: Options, screen: Screen, *, parent: Path | None = None) -> None:
        self.options = options
        self.screen = screen
        self.folder = Path(tempfile.mkdtemp(prefix="imexd-demo-", dir=parent))
        """Everything of the run lives here; `parent` None: the system's temporary folder."""
        self.nodes: list[DemoNode] = []
        self.broker: Broker | None = None
        self.results = Results()
        self.cleanup = Cleanup()
        self.verdict = Verdict("FORMING", "starting")
        self.formed = False
        self.leaving = False
        self.keep = os.environ.get(KEEP_ENV, "") not in ("", "0")
        self._t0 = time.monotonic()
        self._stack = contextlib.AsyncExitStack()
        self._updated = asyncio.Condition()
        self._poller: asyncio.Task[None] | None = None

    # Lifecycle.

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """End everything the demo started, whatever state it is in; bounded in time.

        Agents are stopped first (they leave and stop their daemons while the broker is
        still there), then anything still running from the folder (daemons of killed
        agents, probes), then the broker; the folder goes last.
        """
        c = self.cleanup
        self.leaving = True
        running = [n for n in self.nodes if n.alive()]
        if running:
            self.event(f"stopping {len(running)} agent(s) (SIGTERM: leave the domain)")
            codes = await asyncio.gather(*(n.stop() for n in running))
            c.killed_agents = sum(1 for code in codes if code is None)
        broker_pid = self._broker_pid()
        strays = await asyncio.to_thread(demo_processes, self.folder, exclude=broker_pid)
        if strays:
            c.stray_processes = len(strays)
            self.event(f"ending {len(strays)} leftover process(es) of the demo")
            await end_processes(strays)
        if self._poller is not None:
            await _cancel(self._poller)
        try:
            await self._stack.aclose()
        except Exception as exc:  # keep cleaning up: the folder must still go
            c.problems.append(f"stopping the broker failed: {exc}")
        left = await asyncio.to_thread(demo_processes, self.folder)
        if left:
            await end_processes(left)
            left = await asyncio.to_thread(demo_processes, self.folder)
        c.left_processes = len(left)
        if left:
            c.problems.append(f"processes still running: {', '.join(str(p.pid) for p in left)}")
        if self.keep:
            self.event(f"kept {self.folder} with every log ({KEEP_ENV} is set): remove it yourself")
            return
        await asyncio.to_thread(shutil.rmtree, self.folder, True)
        c.folder_removed = not self.folder.exists()
        if not c.folder_removed:
            c.problems.append(f"could not remove {self.folder}")

    def _broker_pid(self) -> list[int]:
        if isinstance(self.broker, MosquittoBroker) and self.broker.proc is not None:
            return [self.broker.proc.pid]
        return []

    # Output.

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def event(self, text: str) -> None:
        self.screen.say(f"[{self.elapsed():6.1f} s] {text}")

    def redraw(self, *, force: bool = False) -> None:
        if not self.nodes:
            return
        v, rows = self.verdict, [n.row() for n in self.nodes]
        key = [v.state, v.detail, *table_lines(rows)]
        head = f'[{self.elapsed():6.1f} s] domain "{DOMAIN}": {v.state} - {v.detail}'
        width = self.screen.width
        if width and len(head) > width:
            head = head[: width - 1] + "…"
        if self.screen.color:
            head = head.replace(f": {v.state} ", f": {_paint(v.state, v.state, color=True)} ", 1)
        lines = table_lines(rows, color=self.screen.color, width=width)
        self.screen.frame(key, [head, *lines], force=force)

    # Watching the agents.

    async def _poll(self) -> None:
        """Read every agent's /status, judge the domain, redraw, wake the waiters."""
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                views = await asyncio.gather(*(self._fetch(http, n) for n in self.nodes))
                for node, view in zip(self.nodes, views, strict=True):
                    node.view = view if node.alive() else None
                    if node.view is not None and node.agent == "starting":
                        node.agent, node.orphan_pid = "up", None
                    await self._check_orphan(node)
                self.verdict = self._judge()
                self.redraw()
                async with self._updated:
                    self._updated.notify_all()
                await asyncio.sleep(POLL_S)

    @staticmethod
    async def _fetch(http: aiohttp.ClientSession, node: DemoNode) -> NodeView | None:
        if not node.alive():
            return None
        try:
            async with http.get(node.url) as resp:
                if resp.status != 200:
                    return None
                return parse_status(await resp.json())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def _judge(self) -> Verdict:
        if self.leaving:
            left = sum(1 for n in self.nodes if not n.alive())
            return Verdict("LEAVING", f"{left} of {len(self.nodes)} agents left")
        return judge_domain({n.name: n.view for n in self.nodes}, formed=self.formed)

    async def _check_orphan(self, node: DemoNode) -> None:
        """While an agent is away, is its daemon still running on its own?"""
        if node.orphan_pid is None:
            return
        if not await asyncio.to_thread(self._is_ours, node.orphan_pid):
            node.orphan_pid = None

    def _is_ours(self, pid: int) -> bool:
        """A live process of this demo (its command line names the folder)."""
        try:
            proc = psutil.Process(pid)
            return proc.status() != psutil.STATUS_ZOMBIE and any(
                str(self.folder) in arg for arg in proc.cmdline()
            )
        except psutil.Error:
            return False

    def _check_processes(self) -> None:
        poller = self._poller
        if poller is not None and poller.done():
            error = None if poller.cancelled() else poller.exception()
            raise DemoError(f"watching the agents failed: {error!r}")
        for node in self.nodes:
            if node.agent in ("starting", "up") and node.proc and node.proc.returncode is not None:
                node.agent = "exited"
                raise DemoError(
                    f"the agent of {node.name} exited with status {node.proc.returncode}; "
                    f"its last log lines:\n{_tail(node.log_path)}"
                )
        problem = self.broker.failure() if self.broker else None
        if problem:
            raise DemoError(f"the broker stopped: {problem}")

    async def wait_for(self, what: str, check: Callable[[], bool], limit_s: float) -> float:
        """Wait until `check()` holds after a round of /status; its time.monotonic().

        DemoError after `limit_s` seconds, or as soon as an agent or the broker dies.
        """
        deadline = time.monotonic() + limit_s
        async with self._updated:
            while True:
                self._check_processes()
                if check():
                    return time.monotonic()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DemoError(
                        f"{what} did not happen within {limit_s:g} s\n{self._why()}\n"
                        f"  (run with {KEEP_ENV}=1 to keep every log in the folder)"
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._updated.wait()

    def _why(self) -> str:
        lines = [f'  domain "{DOMAIN}": {self.verdict.state} - {self.verdict.detail}']
        lines += ["  " + line for line in table_lines([n.row() for n in self.nodes])]
        for node in self.nodes:
            if node.view is None or not node.view.ready:
                lines.append(f"  {node.name} ({node.log_path.name}, last lines):")
                lines.append(_tail(node.log_path))
        return "\n".join(lines)

    def _up(self) -> bool:
        return self.verdict.state == "UP"

    # The acts.

    async def play(self) -> Results:
        """Form the domain, crash a daemon, crash an agent, shut down; the timings."""
        await self._setup()
        await self._form()
        # Two different nodes: each crash starts from a settled node.
        await self._crash_daemon(self.nodes[(len(self.nodes) - 1) // 2])
        await self._crash_agent(self.nodes[-1])
        await self._shutdown()
        return self.results

    async def _setup(self) -> None:
        o = self.options
        rand = secrets.SystemRandom()
        run = secrets.token_hex(3)
        if o.broker:
            broker: Broker = ExternalBroker(o.broker)
            # A shared broker may serve other demos: names and topics unique to this run.
            names = [f"node-{i}-{run}" for i in range(1, o.nodes + 1)]
        else:
            broker = choose_broker(os.environ, self.folder / "broker", find_mosquitto())
            names = [f"node-{i}" for i in range(1, o.nodes + 1)]
        addresses, ports = pick_addresses(o.nodes, rand)
        self.broker = await self._stack.enter_async_context(broker)
        self.screen.say(f"  broker   {self.broker.description}")
        settings = node_settings(
            nodes=o.nodes,
            broker_url=self.broker.url,
            topic_prefix=f"imexd-demo/{run}",
            ports=ports,
            folder=self.folder,
        )
        for name, address in zip(names, addresses, strict=True):
            node = DemoNode(
                name=name, address=address, folder=self.folder / name, settings=settings
            )
            self.nodes.append(node)
        try:
            load_settings(str(self.nodes[0].config_path), environ={})
        except ConfigError as exc:  # a bug of the demo, said plainly
            raise DemoError(f"the demo wrote an invalid agent config: {exc}") from None
        self.screen.say(
            f"  nodes    {names[0]} .. {names[-1]} on {addresses[0]} .. {addresses[-1]}, "
            f"IMEX ports {ports[0]}/{ports[1]}, each with a simulated IMEX daemon"
        )
        fate = f"kept: {KEEP_ENV} is set" if self.keep else "removed at the end"
        self.screen.say(f"  folder   {self.folder} ({fate})")
        self.screen.say("  Ctrl-C stops the demo at any time and cleans up.")
        self.screen.say()
        self._poller = asyncio.create_task(self._poll(), name="demo-poll")

    def _agent_env(self) -> dict[str, str]:
        """The demo's environment without IMEXD_* overrides meant for a real agent."""
        return {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}

    async def _form(self) -> None:
        self._t0 = time.monotonic()
        env = self._agent_env()
        await asyncio.gather(*(n.start(env) for n in self.nodes))
        self.event(
            f"started {len(self.nodes)} agents (`imexd run`); each claims a slot, writes "
            "the IMEX files and starts its daemon"
        )
        timeout = FORM_TIMEOUT_BASE_S + FORM_TIMEOUT_PER_NODE_S * len(self.nodes)
        at = await self.wait_for("the domain forming", self._up, timeout)
        self.formed = True
        self.results.formed_s = at - self._t0
        self.event(
            f"domain UP: {len(self.nodes)} members READY and connected "
            f"after {self.results.formed_s:.1f} s"
        )
        self.redraw(force=True)

    async def _crash_daemon(self, node: DemoNode) -> None:
        """SIGKILL a node's IMEX daemon: its agent restarts it, the peers reconnect."""
        r = self.results
        r.daemon_node = node.name
        view = node.view
        pid = view.pid if view else None
        restarts = view.restarts if view else 0
        if pid is None or not await asyncio.to_thread(self._is_ours, pid):
            raise DemoError(f"{node.name} reports no running daemon of this demo (pid {pid})")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        self.event(f"crash 1: SIGKILL the IMEX daemon of {node.name} (pid {pid})")

        def noticed() -> bool:
            v = node.view
            if v is not None and (v.pid != pid or v.daemon != "RUNNING" or not v.ready):
                return True
            return any(node.name in (n.view.unwell if n.view else ()) for n in self.nodes)

        at = await self.wait_for("noticing the dead daemon", noticed, NOTICE_TIMEOUT_S)
        r.daemon_noticed_s = at - killed
        self.event(f"noticed after {r.daemon_noticed_s:.1f} s: domain {self.verdict.state}")
        self.redraw(force=True)

        def recovered() -> bool:
            return self._up() and node.view is not None and node.view.pid not in (None, pid)

        at = await self.wait_for("the domain recovering", recovered, RECOVER_TIMEOUT_S)
        r.daemon_recovered_s = at - killed
        r.daemon_restarts = (node.view.restarts if node.view else 0) - restarts
        new_pid = node.view.pid if node.view else None
        self.event(
            f"domain UP again {r.daemon_recovered_s:.1f} s after the crash: the agent "
            f"restarted the daemon (pid {new_pid}) with backoff and the peers reconnected"
        )
        self.redraw(force=True)

    async def _crash_agent(self, node: DemoNode) -> None:
        """SIGKILL a node's agent: the will drops it, a new agent rejoins and adopts."""
        r = self.results
        r.agent_node = node.name
        view = node.view
        if view is None or view.pid is None:
            raise DemoError(f"{node.name} reports no running daemon before crash 2")
        pid, slot = view.pid, view.slot
        others = [n for n in self.nodes if n is not node]
        node.orphan_pid = pid
        await node.kill()
        killed = time.monotonic()
        self.event(
            f"crash 2: SIGKILL the agent of {node.name}; its IMEX daemon (pid {pid}) keeps running"
        )

        def dropped() -> bool:
            return all(
                o.view is not None
                and o.view.members is not None
                and node.name not in o.view.members
                for o in others
            )

        at = await self.wait_for("the peers dropping the dead agent", dropped, NOTICE_TIMEOUT_S)
        r.agent_dropped_s = at - killed
        self.event(
            f"the broker published {node.name}'s will: its peers dropped it from the domain "
            f"after {r.agent_dropped_s:.1f} s"
        )
        self.redraw(force=True)
        await node.start(self._agent_env())
        restarted = time.monotonic()
        self.event(f"started a new agent on {node.name}: it should take slot {slot} back")

        def rejoined() -> bool:
            return self._up() and node.view is not None

        at = await self.wait_for("the restarted agent rejoining", rejoined, RECOVER_TIMEOUT_S)
        r.agent_rejoined_s = at - killed
        r.agent_restart_to_up_s = at - restarted
        now = node.view
        r.same_slot = now is not None and now.slot == slot
        r.adopted = now is not None and now.pid == pid
        r.adopted_pid = pid
        how = (
            f"adopted its running daemon (pid {pid}): IMEX was not restarted"
            if r.adopted
            else f"restarted its daemon (pid {pid} -> {now.pid if now else '?'})"
        )
        where = f"slot {slot} again" if r.same_slot else f"slot {now.slot if now else '?'}"
        self.event(
            f"domain UP again {r.agent_restart_to_up_s:.1f} s after the restart: {node.name} "
            f"holds {where} and {how}"
        )
        self.redraw(force=True)

    async def _shutdown(self) -> None:
        self.leaving = True
        self.event("shutting down: SIGTERM every agent (each leaves and stops its daemon)")
        started = time.monotonic()
        codes = await asyncio.gather(*(n.stop() for n in self.nodes))
        self.results.shutdown_s = time.monotonic() - started
        self.results.clean_exits = sum(1 for code in codes if code == 0)
        self.verdict = self._judge()
        daemons = await asyncio.to_thread(demo_processes, self.folder, exclude=self._broker_pid())
        self.redraw(force=True)
        bad = [f"{n.name}: {c}" for n, c in zip(self.nodes, codes, strict=True) if c != 0]
        if bad:
            raise DemoError(f"agents did not leave cleanly (exit status): {', '.join(bad)}")
        if daemons:
            names = ", ".join(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:80]}" for p in daemons)
            raise DemoError(f"processes still running after every agent left: {names}")
        self.event(
            f"all {len(self.nodes)} agents left the domain and stopped their daemons "
            f"in {self.results.shutdown_s:.1f} s"
        )


def summary(results: Results, cleanup: Cleanup, *, broker: str, nodes: int) -> list[str]:
    """The closing lines: what was measured, what was cleaned up."""
    r = results
    lines = [
        "Summary",
        f"  broker           {broker}",
        f"  formation        {nodes} nodes: domain UP after {r.formed_s:.1f} s",
        f"  daemon crash     {r.daemon_node}: noticed after {r.daemon_noticed_s:.1f} s, "
        f"domain UP again after {r.daemon_recovered_s:.1f} s "
        f"({r.daemon_restarts} restart by its agent, after a backoff)",
        f"  agent crash      {r.agent_node}: dropped by its peers after {r.agent_dropped_s:.1f} s "
        f"(its will); restarted, domain UP again {r.agent_restart_to_up_s:.1f} s later, "
        f"{'same slot' if r.same_slot else 'NEW slot'}, daemon "
        f"{'adopted, not restarted' if r.adopted else 'restarted'}",
        f"  shutdown         {r.clean_exits} of {nodes} agents left cleanly "
        f"in {r.shutdown_s:.1f} s",
    ]
    lines.append(f"  cleanup          {cleanup_text(cleanup)}")
    lines.append(f"  (times measured by polling each agent's /status every {POLL_S:g} s)")
    return lines


def cleanup_text(c: Cleanup) -> str:
    """What the cleanup left behind, in one line."""
    if c.problems:
        return "PROBLEMS: " + "; ".join(c.problems)
    extra = ""
    if c.killed_agents or c.stray_processes:
        extra = f" (had to end {c.killed_agents + c.stray_processes} process(es))"
    folder = "folder removed" if c.folder_removed else "folder kept"
    return f"nothing left running, {folder}{extra}"


async def _until_stopped(play: Awaitable[Results], stop: asyncio.Event) -> Results | None:
    """Run the demo until it ends or `stop` is set (a signal); None when stopped."""
    task = asyncio.ensure_future(play)
    stopper = asyncio.create_task(stop.wait(), name="demo-stop")
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    await _cancel(task)
    return None


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait for its end, without taking our own cancellation for it."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: it failed while being cancelled, nothing to add


async def run_demo(options: Options, out: TextIO) -> int:
    """The whole demo; the exit status (0 ok, 1 failed, 128 + signal when stopped)."""
    screen = Screen.for_stream(out)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        if received:
            screen.say(f"{sig.name}: still cleaning up, within {AGENT_STOP_TIMEOUT_S:g} s or so")
        received.append(sig)
        stop.set()

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    screen.say(
        f'imexd demo: {options.nodes} simulated nodes form the IMEX domain "{DOMAIN}" '
        "on this machine (no GPU, no root)"
    )
    demo = Demo(options, screen)
    results: Results | None = None
    failure = ""
    try:
        async with demo:
            try:
                results = await _until_stopped(demo.play(), stop)
            except DemoError as exc:
                failure = str(exc)
            if failure:
                screen.say(f"\nFAILED: {failure}\n")
            elif results is None:
                name = received[0].name if received else "a signal"
                screen.say(f"\ninterrupted by {name}: cleaning up")
            elif not screen.tty:
                demo.redraw(force=True)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        screen.close()
    cleanup = demo.cleanup
    if results is not None and not failure:
        broker = demo.broker.description if demo.broker else "?"
        screen.say()
        for line in summary(results, cleanup, broker=broker, nodes=options.nodes):
            screen.say(line)
        return 1 if cleanup.problems else 0
    screen.say(f"cleaned up: {cleanup_text(cleanup)}")
    if results is None and not failure:
        return 128 + (received[0] if received else signal.SIGINT)
    return 1


def cli_demo(args: argparse.Namespace) -> int:
    """`imexd demo`: check the arguments (exit 2 when wrong), then run the demo."""
    nodes: int = args.nodes
    if not MIN_NODES <= nodes <= MAX_NODES:
        print(f"imexd demo: --nodes {nodes}: expected {MIN_NODES}..{MAX_NODES}", file=sys.stderr)
        return 2
    broker: str | None = args.broker
    if broker is not None:
        try:
            parse_broker_url(broker)
        except ValueError:
            print(
                f"imexd demo: --broker {broker}: expected mqtt://HOST[:PORT], "
                "mqtts://HOST[:PORT] or unix:///PATH",
                file=sys.stderr,
            )
            return 2
    return asyncio.run(run_demo(Options(nodes=nodes, broker=broker), sys.stdout))


__all__ = [
    "DemoError",
    "NodeView",
    "Verdict",
    "cli_demo",
    "judge_domain",
    "parse_status",
    "run_demo",
    "table_lines",
]
