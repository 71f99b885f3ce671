"""`imexd-sim-daemon`: a stand-in for `nvidia-imex` with real sockets and real peers.

Start-up follows the real daemon: read config.cfg, read nodes_config.cfg, resolve the
names, find this node's own entry (each failure prints the real message and exits 1),
then optionally fork into the background. The running daemon listens on
BIND_INTERFACE_IP:SERVER_PORT, dials every other entry's SERVER_PORT with backoff,
serves `imexd-sim-ctl` on its command port, and moves through the state words
INITIALIZING, STARTING_AUTH_SERVER, WAITING_FOR_RECOVERY (after an unclean exit),
INIT_GPU, READY and SHUTTING_DOWN. Signals act like the real ones: SIGUSR1 re-resolves
and restarts outgoing connections at most once per window, SIGHUP reloads nothing,
SIGTERM/SIGINT/SIGQUIT tell the peers and exit 0. `IMEXD_SIM_*` variables inject
faults (see docs/simulator.md).

Each node keeps one outgoing link per peer; its state is this node's row of the
`-N` matrix. Incoming connections only carry the peer's hello and our heartbeats; a
hello from a peer we are not connected to cuts our backoff short, so a domain forms
as fast as its slowest node starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from imexd.sim.cfgfile import ImexConfigError, is_ip
from imexd.sim.command import MAX_LINE, LinkStatus, NodeState
from imexd.sim.config import (
    NO_GPU_VERSION,
    STATE_FILE_NAME,
    ImexConfig,
    SimEnv,
    find_identity,
    load_config,
    local_addresses,
    node_list_digest,
    read_node_list,
)
from imexd.sim.hosts import Resolver, dialable
from imexd.sim.imexlog import ImexLog, format_line
from imexd.sim.links import HEARTBEAT, Outgoing, PeerLink
from imexd.sim.protocol import (
    PEER_DECODER,
    REQUEST_DECODER,
    Bye,
    Hello,
    Link,
    QueryReply,
    QueryRequest,
    Request,
    StatusReply,
    encode,
)

RETRY_INITIAL_S = 0.5
"""First reconnect delay; doubles up to IMEXD_SIM_RETRY_MAX_S (3 s), like IMEX's."""
COMMAND_READ_TIMEOUT_S = 5.0
"""A ctl that connects and sends nothing is dropped after this long."""
MAX_WRITE_BUFFER = 64 * 1024
"""A peer this far behind on heartbeats has stopped reading: drop it."""


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    """What start-up settled before serving: the node list, its addresses, who we are."""

    cfg: ImexConfig
    env: SimEnv
    entries: tuple[str, ...]
    addresses: tuple[str | None, ...]
    me: int
    nogpu: bool

    @property
    def bind_ip(self) -> str:
        """BIND_INTERFACE_IP, or the address of our own entry when it is empty."""
        return self.cfg.bind_interface_ip or self.addresses[self.me] or ""

    @property
    def version(self) -> str:
        """What peers and `-N` report: NO_GPU with --nogpu, like the real daemon."""
        return NO_GPU_VERSION if self.nogpu else self.env.version


class RecoveryFile:
    """The stand-in for persist.dat: were we running, with which list and which peers."""

    def __init__(self, folder: str) -> None:
        self.path = Path(folder) / STATE_FILE_NAME

    def load(self) -> dict[str, Any]:
        """The last saved state; empty when absent or unreadable (a fresh node)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save(self, *, running: bool, digest: str, peers: set[int]) -> None:
        """Atomically: a crash while writing must not look like a clean exit."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(
                json.dumps({"running": running, "digest": digest, "peers": sorted(peers)}),
                encoding="utf-8",
            )
            tmp.replace(self.path)
        except OSError:
            pass  # recovery is best effort, as with the real persist.dat


class SimDaemon:
    """One simulated `nvidia-imex`: `run()` serves until `stop` is set."""

    def __init__(self, plan: NodePlan, log: ImexLog, stop: asyncio.Event) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.env = plan.env
        self.log = log
        self.stop = stop
        self.state = NodeState.INITIALIZING
        self.instance = os.urandom(16).hex()
        self.digest = node_list_digest(plan.entries)
        self.exit_code = 0
        self.links = {
            j: PeerLink(j, entry, plan.addresses[j])
            for j, entry in enumerate(plan.entries)
            if j != plan.me
        }
        self.accepted: set[asyncio.StreamWriter] = set()
        self.instances: dict[int, str] = {}
        self.resolver = Resolver(plan.env.hosts_file)
        self.reload_requested = asyncio.Event()
        self.recovery = RecoveryFile(
            plan.env.state_dir or os.path.dirname(os.path.abspath(self.cfg.path))
        )
        self.peers_seen: set[int] = set()
        self.former: set[int] = set()
        self.former_back = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        """Connection handlers: owned here, so shutdown can end them before the loop."""

    # Lifecycle

    async def run(self) -> int:
        """Serve until `stop`; then say goodbye to every peer. Returns the exit code."""
        self._check_recovery()
        async with contextlib.AsyncExitStack() as stack:
            if self.cfg.cmd_enabled:
                try:
                    server = await self._serve_commands()
                except OSError as exc:
                    self._fail(f"Failed to start the IMEX command service: {exc}")
                    return 1
                if self.cfg.cmd_unix_domain_path:
                    stack.callback(_unlink, self.cfg.cmd_unix_domain_path)
                stack.push_async_callback(_close_server, server)
            async with asyncio.TaskGroup() as tg:
                self._spawn(tg, self._lifecycle(tg, stack), "lifecycle")
                self._spawn(tg, self._reloader(), "reloader")
                self._spawn_faults(tg)
                await self.stop.wait()
                self._shutdown()
                for task in (*self._tasks, *self._handlers):
                    task.cancel()
                await asyncio.gather(*self._handlers, return_exceptions=True)
        self.log.info("IMEX daemon shut down")
        return self.exit_code

    async def _lifecycle(self, tg: asyncio.TaskGroup, stack: contextlib.AsyncExitStack) -> None:
        """INITIALIZING, STARTING_AUTH_SERVER, (WAITING_FOR_RECOVERY), INIT_GPU, READY."""
        if self.env.start_delay_s:
            await asyncio.sleep(self.env.start_delay_s)
        self._set_state(NodeState.STARTING_AUTH_SERVER)
        if self.cfg.auth_encryption:
            self.log.warning("Authentication and encryption are not modelled by the simulator")
        try:
            server = await asyncio.start_server(
                self._handle(self._accept), self.plan.bind_ip, self.cfg.server_port, limit=MAX_LINE
            )
        except OSError as exc:
            self._fail(
                f"Failed to bind IMEX server to {self.plan.bind_ip}:{self.cfg.server_port}: {exc}"
            )
            return
        stack.push_async_callback(_close_server, server)
        self.log.info(f"IMEX server listening on {self.plan.bind_ip}:{self.cfg.server_port}")
        self.recovery.save(running=True, digest=self.digest, peers=self.former | self.peers_seen)
        for link in self.links.values():
            self._spawn(tg, self._dial(link), f"dial-{link.index}")
        self._spawn(tg, self._heartbeats(), "heartbeats")
        if self.former:
            self._set_state(NodeState.WAITING_FOR_RECOVERY)
            try:
                async with asyncio.timeout(self.env.recovery_timeout_s):
                    await self.former_back.wait()
                self.log.info("Recovery complete: a former peer reconnected")
            except TimeoutError:
                self.log.warning(
                    f"Recovery timed out after {self.env.recovery_timeout_s:g} s; continuing"
                )
        if not self.plan.nogpu:
            self._set_state(NodeState.INIT_GPU)
            await asyncio.sleep(0)
        self._set_state(NodeState.READY)

    def _check_recovery(self) -> None:
        """After an unclean exit with the same node list, wait for former peers."""
        saved = self.recovery.load()
        if not saved.get("running"):
            return
        if saved.get("digest") != self.digest:
            self.log.info("Node configuration changed since the last run; discarding recovery data")
            return
        if self.cfg.wait_for_quorum != "RECOVERY":
            return
        peers = saved.get("peers")
        if isinstance(peers, list):
            self.former = {p for p in peers if isinstance(p, int) and p in self.links}
        if self.former:
            self.log.info(
                "Previous run ended uncleanly; waiting for former peers "
                + ", ".join(str(p) for p in sorted(self.former))
            )

    def _shutdown(self) -> None:
        """SHUTTING_DOWN: tell every peer on every connection, then close them all.

        A `bye` is a few bytes on an idle socket, so `write` sends it at once; closing
        afterwards still flushes anything left.
        """
        self._set_state(NodeState.SHUTTING_DOWN)
        bye = encode(Bye())
        for writer in self.accepted:
            if not writer.transport.is_closing():
                writer.write(bye)
            writer.close()
        for link in self.links.values():
            if link.conn is not None:
                link.conn.send(bye)
                if link.conn.transport is not None:
                    link.conn.transport.close()
        self.recovery.save(running=False, digest=self.digest, peers=set())

    def _fail(self, message: str) -> None:
        """A start-up failure: log it, and end with exit code 1."""
        self.log.error(message)
        if not self.log.to_stderr:
            print(message, file=sys.stderr)
        self.exit_code = 1
        self.stop.set()

    def _set_state(self, state: NodeState) -> None:
        if state != self.state:
            self.log.info(f"IMEX daemon state changed from {self.state} to {state}")
            self.state = state

    def _spawn(
        self, tg: asyncio.TaskGroup, coro: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        task = tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _handle(
        self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]:
        """A server callback whose task we own (asyncio's own would log its cancellation)."""

        def start(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task: asyncio.Task[None] = asyncio.ensure_future(handler(reader, writer))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

        return start

    # Fault injection

    def _spawn_faults(self, tg: asyncio.TaskGroup) -> None:
        if self.env.exit_after_s is not None:
            self._spawn(tg, self._exit_later(self.env.exit_after_s), "fault-exit")
        if self.env.abort_after_s is not None:
            self._spawn(tg, self._abort_later(self.env.abort_after_s), "fault-abort")

    async def _exit_later(self, delay: float) -> None:
        """IMEXD_SIM_EXIT_AFTER_S: die like a crash (no goodbye, recovery file kept)."""
        await asyncio.sleep(delay)
        self.log.error(f"Simulated failure: exiting with code {self.env.exit_code}")
        self.log.flush()
        os._exit(self.env.exit_code)

    async def _abort_later(self, delay: float) -> None:
        """IMEXD_SIM_ABORT_AFTER_S: die by SIGABRT, like an assertion in the real daemon."""
        await asyncio.sleep(delay)
        self.log.error("Simulated failure: aborting")
        self.log.flush()
        os.abort()

    # Reload (SIGUSR1)

    def request_reload(self) -> None:
        """Called for an honoured SIGUSR1; the pacing was decided by the signal desk."""
        self.reload_requested.set()

    async def _reloader(self) -> None:
        """Re-resolve every name and restart every outgoing connection."""
        while True:
            await self.reload_requested.wait()
            self.reload_requested.clear()
            self.log.info("Reloading: re-resolving host names and restarting connections")
            addresses = await self.resolver.resolve(self.plan.entries)
            for j, link in self.links.items():
                if addresses[j] != link.address:
                    self.log.info(
                        f"Node config entry '{link.entry}' now resolves to "
                        f"{addresses[j] or 'nothing'} (was {link.address or 'nothing'})"
                    )
                    link.retarget(addresses[j])
                link.restart = True
                if link.conn is not None:
                    link.conn.abort()
                link.wake.set()

    # Outgoing links

    async def _dial(self, link: PeerLink) -> None:
        """Keep one connection to `link`'s peer, retrying with capped backoff."""
        delay = RETRY_INITIAL_S
        port = self.cfg.server_port
        while True:
            link.restart = False
            link.wake.clear()
            address = link.address
            if address is None or not dialable(address):
                await link.wake.wait()
                delay = RETRY_INITIAL_S
                continue
            link.attempt += 1
            if link.attempt <= 3 or link.attempt % 20 == 0:
                self.log.info(
                    f"Attempting connection for target node {link.index} - "
                    f"{link.entry}:{port}, attempt #{link.attempt}"
                )
            conn, hello = await self._connect(address)
            if hello is None or link.restarting():
                conn.abort()
                if not link.restarting():
                    await _sleep_or_wake(link.wake, delay)
                    delay = min(delay * 2, self.env.retry_max_s)
                continue
            delay = RETRY_INITIAL_S
            link.attempt = 0
            link.conn = conn
            try:
                self._connected(link, hello)
                await asyncio.shield(conn.closed)
            finally:
                link.conn = None
                conn.abort()
            self._disconnected(link, conn)
            if not link.restarting():
                await _sleep_or_wake(link.wake, delay)

    async def _connect(self, address: str) -> tuple[Outgoing, Hello | None]:
        """One attempt: connect and exchange hellos within the peer timeout."""
        conn = Outgoing(encode(self._hello()))
        try:
            async with asyncio.timeout(self.env.peer_timeout_s):
                await asyncio.get_running_loop().create_connection(
                    lambda: conn,
                    address,
                    self.cfg.server_port,
                    local_addr=self._source_for(address),
                )
                return conn, await asyncio.shield(conn.peer_hello)
        except (OSError, TimeoutError):
            return conn, None

    def _source_for(self, address: str) -> tuple[str, int] | None:
        """Dial from our own address, as a real node would, when the families agree."""
        source = self.plan.bind_ip
        if not source:
            return None
        return (source, 0) if (":" in source) == (":" in address) else None

    def _connected(self, link: PeerLink, hello: Hello) -> None:
        self._met(hello)
        if hello.digest != self.digest:
            if link.status is not LinkStatus.NODE_MAP_MISMATCH:
                self.log.error(
                    f"Node map mismatch with node {link.index} ({link.entry}); "
                    "communication disabled"
                )
            link.set(LinkStatus.NODE_MAP_MISMATCH)
            return
        if link.status is not LinkStatus.CONNECTED:
            self.log.info(f"Connection established to node {link.index} - {link.entry}")
        link.set(LinkStatus.CONNECTED)

    def _disconnected(self, link: PeerLink, conn: Outgoing) -> None:
        """The cell after a connection ended: D after a goodbye, else R (or D at once)."""
        if link.restarting():
            return
        if conn.said_bye:
            self.log.info(f"Node {link.index} ({link.entry}) is shutting down")
            link.set(LinkStatus.DISCONNECTED)
            return
        self.log.info(
            f"Node disconnect event detected for node {link.index} with address "
            f"{link.address}, attempting to reconnect"
        )
        if self.cfg.disconnected_grace_time == 0:
            link.set(LinkStatus.DISCONNECTED)
        else:
            link.set(LinkStatus.RECOVERING)
            link.lost_at = time.monotonic()

    # Incoming links

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer dialled us: exchange hellos, then wait for its goodbye or its end."""
        try:
            async with asyncio.timeout(self.env.peer_timeout_s):
                hello = PEER_DECODER.decode(await reader.readline())
            if not isinstance(hello, Hello):
                return
            writer.write(encode(self._hello()))
            self._met(hello)
            if hello.digest != self.digest:
                self.log.error(
                    f"Node map mismatch with connecting node {hello.node}; communication disabled"
                )
            self.accepted.add(writer)
            while line := await reader.readline():
                if isinstance(PEER_DECODER.decode(line), Bye):
                    break
        except (OSError, TimeoutError, ValueError):
            pass  # gone, silent or nonsense: the dialler will try again
        finally:
            self.accepted.discard(writer)
            writer.close()

    async def _heartbeats(self) -> None:
        """One timer feeds every incoming connection and checks every outgoing one."""
        loop = asyncio.get_running_loop()
        period = self.env.heartbeat_s
        while True:
            # Beat on wall-clock multiples of the period: all daemons of a host beat
            # together, so each receives its peers' beats in one wake-up, not 17.
            await asyncio.sleep(period - time.time() % period)
            for writer in list(self.accepted):
                transport = writer.transport
                if transport.is_closing():
                    continue
                if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
                    transport.abort()  # the peer stopped reading
                else:
                    writer.write(HEARTBEAT)
            stale = loop.time() - self.env.peer_timeout_s
            for link in self.links.values():
                if link.conn is not None and link.conn.last_seen < stale:
                    self.log.info(f"No heartbeat from node {link.index} for too long")
                    link.conn.abort()

    def _hello(self) -> Hello:
        return Hello(
            node=self.plan.me,
            digest=self.digest,
            instance=self.instance,
            version=self.plan.version,
            state=self.state,
        )

    def _met(self, hello: Hello) -> None:
        """Note a peer's instance; wake our link to it; count it for recovery."""
        previous = self.instances.get(hello.node)
        if previous != hello.instance:
            self.instances[hello.node] = hello.instance
            if previous is not None:
                self.log.info(
                    f"Node {hello.node} reconnected as a new instance; cleaning up "
                    "memory imported from its previous instance"
                )
        if hello.digest != self.digest:
            return
        if hello.node in self.former:
            self.former_back.set()
        if hello.node in self.links and hello.node not in self.peers_seen:
            self.peers_seen.add(hello.node)
            self.recovery.save(
                running=True, digest=self.digest, peers=self.former | self.peers_seen
            )
        link = self.links.get(hello.node)
        if link is not None and link.status is not LinkStatus.CONNECTED:
            link.wake.set()

    # Command service

    async def _serve_commands(self) -> asyncio.Server:
        handler = self._handle(self._command)
        if self.cfg.cmd_unix_domain_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.cmd_unix_domain_path)
            return await asyncio.start_unix_server(
                handler, self.cfg.cmd_unix_domain_path, limit=MAX_LINE
            )
        host = self.cfg.cmd_bind_interface_ip or None
        return await asyncio.start_server(handler, host, self.cfg.cmd_port, limit=MAX_LINE)

    async def _command(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request, one reply (none at all with IMEXD_SIM_CMD_HANG=1)."""
        try:
            async with asyncio.timeout(COMMAND_READ_TIMEOUT_S):
                request = REQUEST_DECODER.decode(await reader.readline())
            if self.env.cmd_hang:
                await reader.read()  # until the client gives up
                return
            writer.write(encode(self._reply(request)))
            await writer.drain()
        except (OSError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    def _reply(self, request: Request) -> QueryReply | StatusReply:
        if isinstance(request, QueryRequest):
            return QueryReply(state=self.state)
        grace = self.cfg.disconnected_grace_time
        links = [
            Link(status=LinkStatus.CONNECTED, changed=True)
            if j == self.plan.me
            else self.links[j].view(grace)
            for j in range(len(self.plan.entries))
        ]
        return StatusReply(
            node=self.plan.me,
            state=self.state,
            version=self.plan.version,
            instance=self.instance,
            pid=os.getpid(),
            digest=self.digest,
            server_port=self.cfg.server_port,
            cmd_port=self.cfg.cmd_port,
            nodes=list(self.plan.entries),
            links=links,
        )


async def _sleep_or_wake(wake: asyncio.Event, delay: float) -> None:
    """Back off for about `delay` s (jittered so that restarted domains spread out)."""
    jittered = delay * random.uniform(0.8, 1.2)  # noqa: S311 - jitter, not security
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(jittered):
            await wake.wait()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


async def _close_server(server: asyncio.Server) -> None:
    server.close()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            await server.wait_closed()


# Signals: the CLI layer only decides and records; the daemon acts on events.


class SignalDesk:
    """Turns signals into events, with the real daemon's SIGUSR1 pacing.

    The time of each signal is taken in the handler, and the window is counted from
    the last honoured SIGUSR1, as IMEX does; each verdict can be appended to
    IMEXD_SIM_SIGNAL_LOG so that tests can check an agent's pacing.
    """

    def __init__(self, daemon: SimDaemon, stop: asyncio.Event) -> None:
        self.daemon = daemon
        self.stop = stop
        self.env = daemon.env
        self.log = daemon.log
        self.last_reload: float | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        at, now = time.time(), time.monotonic()
        name = sig.name
        if sig == signal.SIGUSR1:
            window = self.env.reload_window_s
            if self.last_reload is None or now - self.last_reload >= window:
                self.last_reload = now
                verdict = "honoured"
                self.log.info("Received SIGUSR1: restarting connections to peers")
                self.daemon.request_reload()
            else:
                verdict = "ignored"
                self.log.info(
                    f"Received SIGUSR1 {now - self.last_reload:.3f} s after the last reload; "
                    f"ignored (at most one reload per {window:g} s)"
                )
        elif sig == signal.SIGHUP:
            verdict = "honoured"
            self.log.info("Received SIGHUP: dumping the log buffer; nothing is reloaded")
        elif self.env.ignore_sigterm:
            verdict = "ignored"
            self.log.info(f"Received {name}: ignored (IMEXD_SIM_IGNORE_SIGTERM)")
        else:
            verdict = "honoured"
            self.log.info(f"Received {name}: shutting down")
            self.stop.set()
        if not record_signal(self.env, at, name, verdict):
            self.log.warning(f"Cannot write {self.env.signal_log}")


def record_signal(env: SimEnv, at: float, name: str, verdict: str) -> bool:
    """Append `<time> <SIGNAME> honoured|ignored|early` to IMEXD_SIM_SIGNAL_LOG, if set."""
    if not env.signal_log:
        return True
    try:
        with open(env.signal_log, "a", encoding="utf-8") as out:
            out.write(f"{at:.3f} {name} {verdict}\n")
    except OSError:
        return False
    return True


def install_early_handlers(env: SimEnv) -> None:
    """Signals that arrive before the event loop runs: never a default-action death.

    A stop request exits 0 at once (there are no peers to tell yet); SIGUSR1 has
    nothing to do (the names are about to be, or were just, read anyway) and is recorded
    as `early`, so that a test can tell it from one the reload window dropped
    (`ignored`: a change the daemon did not take); the rest are recorded like later
    ones. The loop's handlers replace these once it runs.
    """

    def early(signum: int, _frame: object) -> None:
        sig = signal.Signals(signum)
        stop = sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
        honoured = sig == signal.SIGHUP or (stop and not env.ignore_sigterm)
        verdict = "early" if sig == signal.SIGUSR1 else "honoured" if honoured else "ignored"
        record_signal(env, time.time(), sig.name, verdict)
        if stop and honoured:
            raise SystemExit(0)

    for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, early)


# Start-up and the command line


DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"


@dataclass(frozen=True)
class _Args:
    config: str = DEFAULT_CONFIG
    port: int | None = None
    nogpu: bool = False
    version: bool = False


def _parse(argv: Sequence[str]) -> _Args:
    """The command line. The form the agent starts every daemon with (`-c CONFIG`, as the
    real daemon's unit does) is read without importing argparse, which every start would
    otherwise pay for; any other goes through the parser, help and errors included."""
    return _agents_form(argv) or _parsed(argv)


def _agents_form(argv: Sequence[str]) -> _Args | None:
    """`-c CONFIG` (or `--config CONFIG`) read by hand; None for any other form."""
    if len(argv) == 2 and argv[0] in ("-c", "--config") and not argv[1].startswith("-"):
        return _Args(config=argv[1])
    return None


def _parsed(argv: Sequence[str]) -> _Args:
    """Any form, through argparse."""
    import argparse  # noqa: PLC0415 - only for the forms the agent does not use

    parser = argparse.ArgumentParser(
        prog="imexd-sim-daemon", description="Simulated nvidia-imex daemon (imexd)."
    )
    parser.add_argument("-c", "--config", default=DEFAULT_CONFIG)
    parser.add_argument("-p", "--port", type=int, default=None, help="overrides SERVER_PORT")
    parser.add_argument("--nogpu", action="store_true", help="run without a GPU (NO_GPU)")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parsed = parser.parse_args(argv)
    return _Args(parsed.config, parsed.port, parsed.nogpu, parsed.version)


def plan_node(cfg: ImexConfig, env: SimEnv, log: ImexLog, *, nogpu: bool) -> NodePlan:
    """Read the node list, resolve it and find ourselves, or raise the real message."""
    entries = read_node_list(cfg.node_config_file)
    for entry in entries:
        if not is_ip(entry):
            log.info(f"Treating node config entry '{entry}' as a host name.")
    addresses = asyncio.run(Resolver(env.hosts_file).resolve(entries))
    local = () if cfg.bind_interface_ip else local_addresses()
    me = find_identity(addresses, cfg.bind_interface_ip, local)
    if me is None:
        raise ImexConfigError(
            "No matching network interface found for any IP addresses in the node "
            f"configuration file {cfg.node_config_file}."
        )
    address = cfg.bind_interface_ip or addresses[me] or ""
    # The line agents check their slot against; IMEXD_SIM_IDENTIFY_AS only falsifies it.
    said = me if env.identify_as is None else env.identify_as
    log.info(f"Identified this node as ID {said}, using bind IP of '{address}'")
    return NodePlan(
        cfg=cfg,
        env=env,
        entries=tuple(entries),
        addresses=tuple(addresses),
        me=me,
        nogpu=nogpu,
    )


def daemonize() -> None:
    """DAEMONIZE=1: double fork, new session, stdio on /dev/null; the parent exits 0."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


async def serve(plan: NodePlan, log: ImexLog) -> int:
    """The root coroutine: run one daemon until a signal (or a failure) stops it."""
    stop = asyncio.Event()
    daemon = SimDaemon(plan, log, stop)
    SignalDesk(daemon, stop).install(asyncio.get_running_loop())
    return await daemon.run()


def main(argv: Sequence[str] | None = None) -> int:
    """`imexd-sim-daemon -c CONFIG [-p PORT] [--nogpu] [--version]`."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        env = SimEnv.from_environ()
    except ImexConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.version:
        print(f"IMEX version is: {env.version}")
        return 0
    if env.exit_after_s == 0:
        message = f"Simulated failure at start: exiting with code {env.exit_code}"
        print(format_line("ERROR", message), file=sys.stderr)
        return env.exit_code
    install_early_handlers(env)
    try:
        cfg = load_config(args.config)
    except ImexConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.port is not None:
        cfg = replace(cfg, server_port=args.port)
    log = ImexLog.open(cfg, env.version)
    try:
        plan = plan_node(cfg, env, log, nogpu=args.nogpu)
    except ImexConfigError as exc:
        log.write("ERROR", str(exc))
        if not log.to_stderr:
            print(exc, file=sys.stderr)
        return 1
    if cfg.daemonize:
        log.flush()
        daemonize()
    try:
        return asyncio.run(serve(plan, log))
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled by the loop
        return 0
    finally:
        log.flush()


if __name__ == "__main__":
    sys.exit(main())
