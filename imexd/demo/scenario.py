"""The demo's story: form a domain, run a workload on its own channel, crash a daemon,
crash an agent, leave; and its figures.

1. formation: the agents claim slots, write the IMEX files, start their daemons; the
   table fills in until the domain is UP;
2. a workload: `imexd workload create` gives it an IMEX channel; every node's agent makes
   the channel's device (a stand-in file where it may not mknod: the nodes' driver is
   simulated, docs/channels.md), CDI spec and env file, which the demo shows from disk;
   `imexd workload env` prints the job's lines; `imexd workload delete` and every node's
   files are checked gone;
3. crash 1: SIGKILL one node's IMEX daemon; its agent restarts it with backoff while
   the peers see it gone, then the domain is UP again;
4. crash 2: SIGKILL one node's agent; its daemon keeps running, the broker publishes
   the agent's will and the peers drop the node; the agent is started again, takes its
   old slot back and adopts the running daemon instead of restarting IMEX;
5. shutdown: SIGTERM every agent (each leaves the domain and stops its daemon), stop the
   broker, remove the temporary folder, and check that nothing is left behind.

Whether the domain is UP is judged as `imexd domain status --nodes` judges it
(`fleet.judge`): the members' records come from the bus over the control plane's
one-shot link, the health reports from each agent's `/status` (polled every POLL_S, the
resolution of the measured times). The broker is embedded unless `--broker` names one
(brokers.py). Every wait is bounded; a failure exits 1 with the reason; the stop event
(Ctrl-C, SIGTERM or SIGHUP, set by the CLI) cleans up at any point and exits 128 + the
signal number (130 for Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self, TextIO

import aiohttp
import psutil

from imexd import messages
from imexd.control.link import Link
from imexd.demo import DemoError
from imexd.demo.brokers import (
    Broker,
    ExternalBroker,
    MosquittoBroker,
    choose_broker,
    find_mosquitto,
    log_tail,
    pick_addresses,
)
from imexd.demo.nodes import (
    AGENT_STOP_TIMEOUT_S,
    DOMAIN,
    DemoNode,
    demo_processes,
    end_processes,
    node_settings,
)
from imexd.demo.screen import Screen, headline, table_lines
from imexd.demo.timings import FAST
from imexd.errors import BusError, ConfigError
from imexd.health.fleet import DomainStatus, SeenReport, judge, table
from imexd.messages import HealthReport
from imexd.process import python_module
from imexd.settings import Settings, load_settings

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
WORKLOAD: Final = "demo-job"
"""The workload the demo creates and deletes (act 2)."""
WORKLOAD_MODE: Final = "0600"
WORKLOAD_WAIT_S: Final = 30.0
"""`--wait` of `workload create` and `delete`: the agents act within a second or two."""
COMMAND_TIMEOUT_S: Final = WORKLOAD_WAIT_S + 30.0
"""A control-plane command that runs longer than this is killed (a Python start, a
connection and its own wait)."""
KEEP_ENV: Final = "IMEXD_DEMO_KEEP"
"""Set (not 0): keep the folder with the agents' and daemons' logs, to look into a run."""


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
    workload_channel: int | None = None
    workload_nodes: int = 0
    workload_standins: int = 0
    """Nodes whose channel node is a stand-in file (the agent may not mknod)."""
    workload_ready_s: float = 0.0
    workload_removed_s: float = 0.0
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
        self.link: Link | None = None
        """The control plane's link: the members' records, as `domain status` reads them."""
        self.status: DomainStatus | None = None
        """fleet's last judgement of the domain; None before the first round."""
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
        if isinstance(self.broker, MosquittoBroker) and self.broker.pid is not None:
            return [self.broker.pid]
        return []

    # Output.

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def event(self, text: str) -> None:
        self.screen.say(f"[{self.elapsed():6.1f} s] {text}")

    def redraw(self, *, force: bool = False) -> None:
        if not self.nodes:
            return
        (state, detail), rows = self.verdict(), [n.row() for n in self.nodes]
        width, color = self.screen.width, self.screen.color
        head = headline(self.elapsed(), DOMAIN, state, detail, color=color, width=width)
        lines = table_lines(rows, color=color, width=width)
        self.screen.frame(head, lines, verdict=(state, detail), force=force)

    # Watching the agents.

    async def _poll(self) -> None:
        """Read every agent's /status, judge the domain, redraw, wake the waiters."""
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                reports = await asyncio.gather(*(self._fetch(http, n) for n in self.nodes))
                for node, report in zip(self.nodes, reports, strict=True):
                    node.report = report if node.alive() else None
                    if node.report is not None and node.agent == "starting":
                        node.agent, node.orphan_pid = "up", None
                    await self._check_orphan(node)
                self.status = self._judge()
                self.redraw()
                async with self._updated:
                    self._updated.notify_all()
                await asyncio.sleep(POLL_S)

    @staticmethod
    async def _fetch(http: aiohttp.ClientSession, node: DemoNode) -> HealthReport | None:
        if not node.alive():
            return None
        try:
            async with http.get(node.url) as resp:
                if resp.status != 200:
                    return None
                report = messages.decode(await resp.read(), HealthReport)
        except (aiohttp.ClientError, TimeoutError):
            return None
        return report if isinstance(report, HealthReport) else None

    def _judge(self) -> DomainStatus:
        """The domain as `imexd domain status --nodes <the demo's nodes>` would judge it,
        with each agent's `/status` for its report (fresher than its last publish), and
        the report the bus still holds for an agent that does not answer (a killed agent's
        report goes stale there: a failure, as `domain status` shows it)."""
        store = self.link.store if self.link is not None else None
        on_bus = {s.report.node: s for s in store.reports_of(DOMAIN)} if store is not None else {}
        reports: list[HealthReport | SeenReport] = []
        for n in self.nodes:
            if n.report is not None:
                reports.append(n.report)
            elif n.name in on_bus:
                reports.append(on_bus[n.name])
        return judge(
            DOMAIN,
            spec=store.specs.get(DOMAIN) if store is not None else None,
            records=store.records_of(DOMAIN) if store is not None else (),
            reports=reports,
            now=time.time(),
            report_interval_s=float(FAST["health"]["report_interval_s"]),
            expect=[n.name for n in self.nodes],
        )

    def verdict(self) -> tuple[str, str]:
        """The headline's state and why: fleet's judgement, or LEAVING at the end."""
        if self.leaving:
            left = sum(1 for n in self.nodes if not n.alive())
            return "LEAVING", f"{left} of {len(self.nodes)} agents left"
        status = self.status
        if status is None:
            return "FORMING", "starting"
        if status.state == "UP":
            return "UP", f"all {status.members} members READY and connected"
        detail = f"{status.ready} of {status.members} members ready"
        if status.reasons:
            more = f" (+{len(status.reasons) - 2} more)" if len(status.reasons) > 2 else ""
            detail += ": " + "; ".join(status.reasons[:2]) + more
        return status.state, detail

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
                    f"its last log lines:\n{log_tail(node.log_path)}"
                )
        problem = self.broker.failure() if self.broker else None
        if problem:
            raise DemoError(f"the broker stopped: {problem}")
        if self.link is not None and self.link.lost is not None:
            raise DemoError(f"lost the link to the broker: {self.link.lost}")

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
        state, detail = self.verdict()
        lines = [f'  domain "{DOMAIN}": {state} - {detail}']
        lines += ["  " + line for line in table_lines([n.row() for n in self.nodes])]
        for node in self.nodes:
            if node.report is None or not node.report.ready:
                lines.append(f"  {node.name} ({node.log_path.name}, last lines):")
                lines.append(log_tail(node.log_path))
        return "\n".join(lines)

    def _up(self) -> bool:
        return not self.leaving and self.status is not None and self.status.state == "UP"

    # The acts.

    async def play(self) -> Results:
        """Form the domain, crash a daemon, crash an agent, shut down; the timings."""
        await self._setup()
        await self._form()
        await self._workload()
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
            loaded = load_settings(str(self.nodes[0].config_path), environ={})
        except ConfigError as exc:  # a bug of the demo, said plainly
            raise DemoError(f"the demo wrote an invalid agent config: {exc}") from None
        self.link = await self._read_members(loaded)
        self.screen.say(
            f"  nodes    {names[0]} .. {names[-1]} on {addresses[0]} .. {addresses[-1]}, "
            f"IMEX ports {ports[0]}/{ports[1]}, each with a simulated IMEX daemon"
        )
        fate = f"kept: {KEEP_ENV} is set" if self.keep else "removed at the end"
        self.screen.say(f"  folder   {self.folder} ({fate})")
        self.screen.say("  Ctrl-C stops the demo at any time and cleans up.")
        self.screen.say()
        self._poller = asyncio.create_task(self._poll(), name="demo-poll")

    async def _read_members(self, settings: Settings) -> Link:
        """The control plane's link, subscribed to the domain's spec, member records and health
        reports (what `domain status` reads)."""
        try:
            link = await self._stack.enter_async_context(Link(settings.bus))
            await link.read(
                link.topics.spec(DOMAIN),
                link.topics.all_members_filter(DOMAIN),
                link.topics.health_filter(DOMAIN),
            )
        except BusError as exc:
            raise DemoError(f"cannot read the members' records from the broker: {exc}") from None
        return link

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
        self.results.formed_s = at - self._t0
        self.event(
            f"domain UP: {len(self.nodes)} members READY and connected "
            f"after {self.results.formed_s:.1f} s"
        )
        self.redraw(force=True)

    async def _control(self, *args: str) -> tuple[int, list[str]]:
        """Run `imexd ARGS --config <the first node's settings>` as a user would (its own
        session: Ctrl-C reaches the demo, which ends it); its exit status and lines."""
        command = python_module("imexd", *args, "--config", str(self.nodes[0].config_path))
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self._agent_env(),
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT_S):
                output, _ = await proc.communicate()
        except TimeoutError:
            raise DemoError(
                f"`imexd {' '.join(args)}` did not end within {COMMAND_TIMEOUT_S:g} s"
            ) from None
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None  # noqa: S101 - communicate() waited for it
        return proc.returncode, output.decode(errors="replace").splitlines()

    async def _show(self, *args: str) -> list[str]:
        """`imexd ARGS` on screen with its output indented; DemoError when it fails."""
        config = self.nodes[0].config_path.relative_to(self.folder)
        self.event(f"$ imexd {' '.join(args)} --config {config}")
        code, lines = await self._control(*args)
        for line in lines:
            self.screen.say(f"    {line}")
        if code != 0:
            raise DemoError(f"`imexd {' '.join(args)}` exited with status {code}")
        return lines

    def _workload_files(self, node: DemoNode, channel: int) -> list[Path]:
        """The channel's device node, CDI spec and env file on `node`, as its agent makes
        them (docs/channels.md)."""
        ch = node.channels
        return [
            Path(str(ch["dev_dir"])) / f"channel{channel}",
            Path(str(ch["cdi_dir"])) / f"imexd-{WORKLOAD}.json",
            Path(str(ch["env_dir"])) / f"{WORKLOAD}.env",
        ]

    def _node_row(self, node: DemoNode, channel: int) -> list[str]:
        """What `node` holds for the workload, read from its disk: a row of the table
        NODE DEVICE OWNER MODE CDI ENV; DemoError when something is missing."""
        device, spec, env = self._workload_files(node, channel)
        try:
            info = os.lstat(device)
        except OSError as exc:
            raise DemoError(f"{node.name} has no {device}: {exc.strerror}") from None
        if stat.S_ISCHR(info.st_mode):
            kind = f"char device {os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
        else:
            kind = "stand-in file"
            self.results.workload_standins += 1
        missing = [p.name for p in (spec, env) if not p.is_file()]
        if missing:
            raise DemoError(f"{node.name} lacks {', '.join(missing)} of workload {WORKLOAD}")
        mode = f"{stat.S_IMODE(info.st_mode):04o}"
        return [node.name, kind, f"{info.st_uid}:{info.st_gid}", mode, "written", "written"]

    async def _workload(self) -> None:
        """A workload on its own channel: created, ready on every node, then deleted and
        checked gone, with the control plane's commands as shipped."""
        r = self.results
        started = time.monotonic()
        owner = ["--uid", str(os.getuid()), "--gid", str(os.getgid())]
        await self._show(
            "workload", "create", WORKLOAD, "--domain", DOMAIN, *owner,
            "--mode", WORKLOAD_MODE, "--wait", f"{WORKLOAD_WAIT_S:g}",
        )  # fmt: skip
        r.workload_ready_s = time.monotonic() - started
        lines = await self._show("workload", "env", WORKLOAD)
        channel = next(
            (
                int(line.split("=", 1)[1])
                for line in lines
                if line.startswith("export IMEX_CHANNEL=")
            ),
            None,
        )
        if channel is None:
            raise DemoError(f"`imexd workload env {WORKLOAD}` printed no IMEX_CHANNEL")
        r.workload_channel, r.workload_nodes = channel, len(self.nodes)
        rows = [self._node_row(node, channel) for node in self.nodes]
        dev = Path(str(self.nodes[0].channels["dev_dir"])).relative_to(self.nodes[0].folder)
        standin = (
            " (a stand-in file where the agent may not mknod: the driver is simulated)"
            if r.workload_standins
            else ""
        )
        self.event(
            f"every agent made channel {channel} for {WORKLOAD}, in its node's folder: the "
            f"device {dev}/channel{channel}{standin}, the CDI spec cdi/imexd-{WORKLOAD}.json "
            f"for containers and the env file workloads/{WORKLOAD}.env for jobs"
        )
        header = ["NODE", "DEVICE", "OWNER", "MODE", "CDI SPEC", "ENV FILE"]
        for line in table(header, rows):
            self.screen.say(f"    {line}")
        deleted = time.monotonic()
        await self._show("workload", "delete", WORKLOAD, "--wait", f"{WORKLOAD_WAIT_S:g}")

        def removed() -> bool:
            return not any(
                p.exists() or p.is_symlink()
                for n in self.nodes
                for p in self._workload_files(n, channel)
            )

        at = await self.wait_for(f"the files of {WORKLOAD} going", removed, WORKLOAD_WAIT_S)
        r.workload_removed_s = at - deleted
        self.event(
            f"channel {channel} removed from every node: no device, CDI spec or env file of "
            f"{WORKLOAD} is left; the IMEX daemons were not touched"
        )

    async def _crash_daemon(self, node: DemoNode) -> None:
        """SIGKILL a node's IMEX daemon: its agent restarts it, the peers reconnect."""
        r = self.results
        r.daemon_node = node.name
        report = node.report
        pid = report.daemon.pid if report else None
        restarts = report.daemon.restarts if report else 0
        if pid is None or not await asyncio.to_thread(self._is_ours, pid):
            raise DemoError(f"{node.name} reports no running daemon of this demo (pid {pid})")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        self.event(f"crash 1: SIGKILL the IMEX daemon of {node.name} (pid {pid})")

        def noticed() -> bool:
            """Its agent reports the daemon gone or back, or the domain is not UP."""
            own = node.report
            if own is not None and (
                own.daemon.pid != pid or own.daemon.state != "RUNNING" or not own.ready
            ):
                return True
            return self.status is not None and self.status.state != "UP"

        at = await self.wait_for("noticing the dead daemon", noticed, NOTICE_TIMEOUT_S)
        r.daemon_noticed_s = at - killed
        self.event(f"noticed after {r.daemon_noticed_s:.1f} s: domain {self.verdict()[0]}")
        self.redraw(force=True)

        def recovered() -> bool:
            own = node.report
            return self._up() and own is not None and own.daemon.pid not in (None, pid)

        at = await self.wait_for("the domain recovering", recovered, RECOVER_TIMEOUT_S)
        r.daemon_recovered_s = at - killed
        r.daemon_restarts = (node.report.daemon.restarts if node.report else 0) - restarts
        new_pid = node.report.daemon.pid if node.report else None
        self.event(
            f"domain UP again {r.daemon_recovered_s:.1f} s after the crash: the agent "
            f"restarted the daemon (pid {new_pid}) with backoff and the peers reconnected"
        )
        self.redraw(force=True)

    async def _crash_agent(self, node: DemoNode) -> None:
        """SIGKILL a node's agent: the will drops it, a new agent rejoins and adopts."""
        r = self.results
        r.agent_node = node.name
        report = node.report
        if report is None or report.daemon.pid is None:
            raise DemoError(f"{node.name} reports no running daemon before crash 2")
        pid, slot = report.daemon.pid, report.slot
        others = [n for n in self.nodes if n is not node]
        node.orphan_pid = pid
        await node.kill()
        killed = time.monotonic()
        self.event(
            f"crash 2: SIGKILL the agent of {node.name}; its IMEX daemon (pid {pid}) keeps running"
        )

        def dropped() -> bool:
            """Every peer's domain view has left the node out."""
            return all(
                o.report is not None
                and o.report.domain_view is not None
                and node.name not in {v.node for v in o.report.domain_view.nodes.values()}
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
            return self._up() and node.report is not None

        at = await self.wait_for("the restarted agent rejoining", rejoined, RECOVER_TIMEOUT_S)
        r.agent_rejoined_s = at - killed
        r.agent_restart_to_up_s = at - restarted
        now = node.report
        r.same_slot = now is not None and now.slot == slot
        r.adopted = now is not None and now.daemon.pid == pid
        r.adopted_pid = pid
        how = (
            f"adopted its running daemon (pid {pid}): IMEX was not restarted"
            if r.adopted
            else f"restarted its daemon (pid {pid} -> {now.daemon.pid if now else '?'})"
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
        daemons = await asyncio.to_thread(demo_processes, self.folder, exclude=self._broker_pid())
        running = [" ".join(p.info["cmdline"] or []) for p in daemons]
        for node, code in zip(self.nodes, codes, strict=True):
            node.stopped = code == 0 and not any(str(node.folder) in line for line in running)
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
    standins = (
        f" (stand-in files on {r.workload_standins}: no CAP_MKNOD)" if r.workload_standins else ""
    )
    lines = [
        "Summary",
        f"  broker           {broker}",
        f"  formation        {nodes} nodes: domain UP after {r.formed_s:.1f} s",
        f"  workload         {WORKLOAD}: channel {r.workload_channel} ready on "
        f"{r.workload_nodes} nodes after {r.workload_ready_s:.1f} s"
        f"{standins}, removed from every node "
        f"{r.workload_removed_s:.1f} s after its delete",
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


@dataclasses.dataclass(slots=True)
class Interrupt:
    """How the CLI stops the demo: its signal handlers call `signal`, which only sets
    `stop` and records the signal; the demo ends, cleans up and says so."""

    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    received: list[signal.Signals] = dataclasses.field(default_factory=list)
    notice: Callable[[str], None] | None = None
    """Where to say that a second signal changes nothing (the demo's screen)."""

    def signal(self, sig: signal.Signals) -> None:
        if self.received and self.notice is not None:
            self.notice(f"{sig.name}: still cleaning up, within {AGENT_STOP_TIMEOUT_S:g} s or so")
        self.received.append(sig)
        self.stop.set()


async def run_demo(options: Options, out: TextIO, interrupt: Interrupt) -> int:
    """The whole demo; the exit status (0 ok, 1 failed, 128 + signal when stopped)."""
    screen = Screen.for_stream(out)
    interrupt.notice = screen.say
    received = interrupt.received
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
                results = await _until_stopped(demo.play(), interrupt.stop)
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
