"""Processes: bounded child runs, process groups, and the survey of IMEX daemons on the host.

Everything imexd does to processes other than its one supervised daemon's state machine
lives here, so that the probe, the fabric discovery and the supervisor share one way of
running a child and one way of ending a process group:

- `run_bounded` runs a short-lived child (the ctl, the NVML child) in its own process
  group with a deadline; a child that hangs is killed with its whole group and reaped,
  so a periodic probe never stalls and never leaves zombies.
- `end_group`, `open_pidfd`, `signal_process` and `wait_readable` end and watch
  long-lived processes (the daemon, strays) through pidfds, never by a pid that may have
  been reused.
- The survey (`find_imex_processes`, `classify_processes`) finds other IMEX daemons
  with psutil and sorts them, purely, into ours (to adopt or end) and conflicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
import psutil

from imexd.imex import DEFAULT_PORTS, PACKAGE_CONFIG

OUTPUT_LIMIT = 1 << 20
"""Bytes of a bounded child's output kept (1 MiB): an 18-node `ctl -N -j` is about
10 KiB, so anything near this is garbage, and a runaway child must not fill the agent's
memory."""

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})


# ---------------------------------------------------------------------------------
# Bounded runs of short-lived children


class RunResult(msgspec.Struct, frozen=True):
    """What one bounded run printed. `rc` < 0 means killed by signal -rc; `truncated` that
    output beyond OUTPUT_LIMIT was dropped."""

    rc: int
    stdout: str
    stderr: str
    duration: float
    truncated: bool = False

    def tail(self, limit: int = 200) -> str:
        """The last non-blank line of stderr (else stdout), for one-line reasons."""
        for stream in (self.stderr, self.stdout):
            lines = [line.strip() for line in stream.splitlines() if line.strip()]
            if lines:
                last = lines[-1]
                return last if len(last) <= limit else last[:limit] + "..."
        return ""


class _Collector(asyncio.SubprocessProtocol):
    """Keeps up to `limit` bytes of each output pipe and signals exit and EOF."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.limit = limit
        self.out = bytearray()
        self.err = bytearray()
        self.truncated = False
        self.exited: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self._open_pipes = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buf = self.out if fd == 1 else self.err
        room = self.limit - len(buf)
        if len(data) > room:
            self.truncated = True
        if room > 0:
            buf += data[:room]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open_pipes.discard(fd)
        self._maybe_finished()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        if self.exited.done() and not self._open_pipes and not self.finished.done():
            self.finished.set_result(None)


def _kill_group(pid: int | None) -> None:
    """SIGKILL the child's whole process group (it leads its own session)."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


_REAP_S: Final = 5.0
"""Seconds a SIGKILLed child is waited for (reaped) before `run_bounded` goes on."""


async def run_bounded(
    argv: Sequence[str],
    *,
    timeout: float,  # noqa: ASYNC109 - the child's kill deadline, not the caller's
    env: Mapping[str, str] | None = None,
    output_limit: int = OUTPUT_LIMIT,
) -> RunResult:
    """Run `argv` in a new session (own process group) and collect its output.

    On timeout the whole group is SIGKILLed and the child reaped before TimeoutError
    is raised; on cancellation too, before the cancellation goes on (an agent that stops
    during a probe must not leave a child that outlives its event loop). OSError when it
    cannot start. Shared by the ctl probes and the NVML discovery child.
    """
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    transport, proto = await loop.subprocess_exec(
        lambda: _Collector(loop, output_limit),
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    pid = transport.get_pid()
    try:
        async with asyncio.timeout(timeout):
            await asyncio.shield(proto.finished)
    except BaseException:  # the timeout, a cancellation
        _kill_group(pid)
        # Reap before going on: bounded, since SIGKILL cannot be ignored.
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(_REAP_S):
                await asyncio.shield(proto.exited)
        raise
    finally:
        transport.close()
    rc = transport.get_returncode()
    return RunResult(
        rc=rc if rc is not None else -int(signal.SIGKILL),
        stdout=proto.out.decode("utf-8", errors="replace"),
        stderr=proto.err.decode("utf-8", errors="replace"),
        duration=time.monotonic() - started,
        truncated=proto.truncated,
    )


def describe_exit(returncode: int) -> str:
    """`exit N` for an exit code, the signal's name (`SIGKILL`) for a negative one."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def survives_signal(status: str, sig: signal.Signals) -> bool:
    """Whether a process whose /proc/<pid>/status is `status` survives `sig`.

    True when it catches, blocks or ignores it, and when the masks are missing.
    """
    bit = 1 << (sig - 1)
    masks = 0
    found = False
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigCgt", "SigBlk", "SigIgn"):
            found = True
            with contextlib.suppress(ValueError):
                masks |= int(value.strip(), 16)
    return not found or bool(masks & bit)


def survives_sigusr1(pid: int) -> bool:
    """Whether process `pid` has a SIGUSR1 handler (or is gone: do not hold a signal back)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return True  # gone (the exit is handled next) or unreadable: do not hold it back
    return survives_signal(status, signal.SIGUSR1)


# ---------------------------------------------------------------------------------
# Process groups and pidfds of long-lived processes


def signal_process(pidfd: int, pgid: int | None, sig: signal.Signals) -> None:
    """Signal a process's whole group when it leads one, else the process (by pidfd)."""
    try:
        if pgid is not None:
            os.killpg(pgid, sig)
        else:
            signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        pass


async def wait_readable(fd: int, seconds: float) -> bool:
    """Wait until `fd` (a pidfd: the process exited) is readable; False on timeout."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def on_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, on_ready)
    try:
        async with asyncio.timeout(seconds):
            await ready
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
    return True


async def wait_gone(pid: int, seconds: float) -> None:
    """Wait up to `seconds` for process `pid` to exit (at once when it is gone)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await wait_readable(pidfd, seconds)
    finally:
        os.close(pidfd)


async def end_group(pgid: int, *, wait_s: float) -> list[int]:
    """SIGKILL whatever is left of process group `pgid`, wait until it is gone.

    Returns the pids still there after `wait_s` (empty: all gone). PermissionError when
    the group may not be signalled. For our own child this runs before the leader is
    reaped, so the group id cannot have been reused. An adopted or stray leader is
    reaped by its own parent; the group id then lives on only while members remain (a
    reuse in the moment between would need the whole pid space to wrap around).
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return []
    left = await asyncio.to_thread(group_members, pgid)
    if left:
        await asyncio.gather(*(wait_gone(pid, wait_s) for pid in left))
        left = await asyncio.to_thread(group_members, pgid)
    return left


def open_pidfd(proc: ImexProcess) -> tuple[int, int | None] | None:
    """A pidfd for `proc` if it is still the same process, and its group if it leads one."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return None
    try:
        same = psutil.Process(proc.pid).create_time() == proc.create_time
        pgid = os.getpgid(proc.pid)
    except (OSError, psutil.Error):
        same = False
        pgid = -1
    if not same:
        os.close(pidfd)
        return None
    return pidfd, (pgid if pgid == proc.pid else None)


# ---------------------------------------------------------------------------------
# Finding other IMEX daemons (psutil) and judging them (pure)


@dataclass(frozen=True, slots=True)
class ImexProcess:
    """An IMEX daemon process found on this host."""

    pid: int
    cmdline: tuple[str, ...]
    config_path: str
    """Absolute path of its `-c` argument; the package config when it has none."""
    create_time: float
    """psutil's creation time: tells a process from a later one with the same pid."""
    config_file: tuple[int, int] | None = None
    """(st_dev, st_ino) of its config as the process itself sees it, through
    `/proc/<pid>/root`: a daemon in another container or pod (seen with hostPID) may run
    the same path with another file. None when unknown (no access, no such file)."""
    config_view: str | None = None
    """Where this agent reads that config (`/proc/<pid>/root/...`); None: `config_path`."""

    @property
    def command(self) -> str:
        text = shlex.join(self.cmdline)
        return text if len(text) <= 200 else text[:197] + "..."


class Endpoint(msgspec.Struct, frozen=True):
    """A TCP endpoint an IMEX daemon listens on, per its config.cfg."""

    host: str
    """The bind address; "" for every interface."""
    port: int
    key: str
    """The config key of the port (SERVER_PORT, IMEX_CMD_PORT)."""

    def __str__(self) -> str:
        host = self.host or "*"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


class Survey(msgspec.Struct, frozen=True):
    """The IMEX daemons that matter to a start: ours to adopt or end, and conflicts."""

    ours: tuple[ImexProcess, ...]
    """Running our config path: adopted (when the files match) or ended as strays."""
    conflicts: tuple[tuple[ImexProcess, str], ...]
    """Other daemons in our way, each with why (`uses the package config ...`)."""


def python_module(module: str, *args: str) -> list[str]:
    """`python -P -m module args`: a child Python that runs `module` of this interpreter's
    installation. `-P` keeps the current folder off the import path, so a clone's `imexd/`
    in the folder the command was started from never shadows the installed package."""
    return [sys.executable, "-P", "-m", module, *args]


_INTERPRETERS = re.compile(r"^(python[0-9.]*|pypy[0-9.]*)$")
_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})
_NOT_A_DAEMON = frozenset({"--version", "-v", "-h", "--help"})


def _program_index(cmdline: Sequence[str]) -> int:
    """Index of the program in `cmdline`: the script or module after a Python interpreter."""
    if not cmdline or not _INTERPRETERS.match(os.path.basename(cmdline[0])):
        return 0
    i = 1
    while i < len(cmdline):
        arg = cmdline[i]
        if arg == "-m":
            return i + 1 if i + 1 < len(cmdline) else 0
        if arg in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if arg == "-c" or not arg.startswith("-"):
            break
        i += 1
    if i < len(cmdline) and cmdline[i] != "-c":
        return i
    return 0


def is_imex_daemon(cmdline: Sequence[str], name: str = "") -> bool:
    """An IMEX daemon (or its simulator) by program name: not the ctl, not other tools.

    The simulator runs as `python .../imexd-sim-daemon` or `python -m
    imexd.sim.daemon`, so the program after an interpreter counts.
    """
    program = os.path.basename(cmdline[_program_index(cmdline)]) if cmdline else name
    if "imexd-sim-daemon" in program or program == "imexd.sim.daemon":
        return True
    return "nvidia-imex" in program and "nvidia-imex-ctl" not in program


def config_argument(cmdline: Sequence[str]) -> str | None:
    """The `-c`/`--config` argument given to the program in `cmdline`, if any."""
    args = list(cmdline[_program_index(cmdline) + 1 :])
    for i, arg in enumerate(args):
        if arg in ("-c", "--config"):
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("--config="):
            return arg.partition("=")[2]
        if arg.startswith("-c") and len(arg) > 2 and not arg.startswith("--"):
            return arg[2:]
    return None


def read_imex_config(path: str) -> dict[str, str] | None:
    """The `KEY=value` lines of an IMEX config.cfg; None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(1 << 20)
    except OSError:
        return None
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


def daemon_endpoints(config: Mapping[str, str]) -> tuple[Endpoint, ...]:
    """What a daemon with this config listens on: SERVER_PORT and, if enabled, the cmd port.

    An empty BIND_INTERFACE_IP makes the real daemon pick the node-list entry of a
    local interface, which we cannot know: it is taken as every interface, on the
    safe side. An unparsable port is left out.
    """
    endpoints: list[Endpoint] = []
    for host_key, port_key in (
        ("BIND_INTERFACE_IP", "SERVER_PORT"),
        ("IMEX_CMD_BIND_INTERFACE_IP", "IMEX_CMD_PORT"),
    ):
        if port_key == "IMEX_CMD_PORT" and config.get("IMEX_CMD_ENABLED", "1").strip() == "0":
            continue
        text = config.get(port_key, "").strip()
        try:
            port = int(text) if text else DEFAULT_PORTS[port_key]
        except ValueError:
            continue
        host = config.get(host_key, "").strip()
        endpoints.append(Endpoint("" if host in WILDCARD_HOSTS else host, port, port_key))
    return tuple(endpoints)


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b) or os.path.realpath(a) == os.path.realpath(b)


def file_identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file at `path`, None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _overlap(a: Endpoint, b: Endpoint) -> bool:
    return a.port == b.port and (a.host == b.host or not a.host or not b.host)


def classify_processes(
    processes: Iterable[ImexProcess],
    *,
    config_path: str,
    read_config: Callable[[str], Mapping[str, str] | None] = read_imex_config,
    package_config: str = PACKAGE_CONFIG,
    own_file: tuple[int, int] | None = None,
) -> Survey:
    """Sort IMEX daemons into ours (same config file) and conflicts.

    A conflict uses the package config (the distribution's service is running), runs
    our config path with another file (`own_file`, our config's (st_dev, st_ino), differs
    from the file the process sees: a daemon of another container or pod, visible with
    hostPID; never adopted or ended), or listens where our daemon must (same address, or
    every interface, and same port, per both config files). Daemons of simulated nodes on
    other loopback addresses are neither. When our own config cannot be read, only the
    package config and other files at our path count.
    """
    own_config = read_config(config_path)
    own = daemon_endpoints(own_config) if own_config is not None else ()
    ours: list[ImexProcess] = []
    conflicts: list[tuple[ImexProcess, str]] = []
    for proc in processes:
        if _same_path(proc.config_path, config_path):
            if None not in (proc.config_file, own_file) and proc.config_file != own_file:
                conflicts.append(
                    (
                        proc,
                        f"runs {proc.config_path} from another mount namespace (another "
                        "container or pod on this node: not this agent's file)",
                    )
                )
                continue
            ours.append(proc)
            continue
        if _same_path(proc.config_path, package_config):
            conflicts.append(
                (proc, f"runs the package config {package_config} (nvidia-imex.service?)")
            )
            continue
        theirs = read_config(proc.config_view or proc.config_path)
        if theirs is None:
            continue
        clash = next(
            ((t, o) for t in daemon_endpoints(theirs) for o in own if _overlap(t, o)), None
        )
        if clash is not None:
            t, o = clash
            conflicts.append(
                (proc, f"uses {t} ({t.key} in {proc.config_path}), which our {o.key} {o} needs")
            )
    return Survey(tuple(ours), tuple(conflicts))


def find_imex_processes(*, exclude: Collection[int] = ()) -> list[ImexProcess]:
    """Every live IMEX daemon (or simulator) on this host, with its absolute config path.

    One `psutil.Process` per pid, dropped after its look: `psutil.process_iter` would keep
    one for every process on the host (kernel threads too) in its cache for the agent's
    whole life."""
    found: list[ImexProcess] = []
    attrs = ["pid", "name", "cmdline", "create_time", "status"]
    for pid in psutil.pids():
        if pid in exclude:
            continue
        try:
            proc = psutil.Process(pid)
            info = proc.as_dict(attrs, ad_value=None)
        except psutil.NoSuchProcess:
            continue
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = tuple(info["cmdline"] or ())
        if not is_imex_daemon(cmdline, info["name"] or ""):
            continue
        config = config_argument(cmdline)
        if config is None:
            if any(arg in _NOT_A_DAEMON for arg in cmdline[1:]):
                continue
            config = PACKAGE_CONFIG
        elif not os.path.isabs(config):
            with contextlib.suppress(psutil.Error):
                config = os.path.join(proc.cwd(), config)
        config = os.path.normpath(config)
        view = f"/proc/{info['pid']}/root{config}"
        seen = file_identity(view)
        found.append(
            ImexProcess(
                info["pid"],
                cmdline,
                config,
                info["create_time"] or 0.0,
                config_file=seen,
                config_view=view if seen is not None else None,
            )
        )
    return found


def survey_processes(config_path: str, *, exclude: Collection[int] = ()) -> Survey:
    """`classify_processes` over `find_imex_processes` (blocking: run it in a thread)."""
    return classify_processes(
        find_imex_processes(exclude=exclude),
        config_path=config_path,
        own_file=file_identity(config_path),
    )


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid` (blocking: run it in a thread)."""
    members: list[int] = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                continue
        except (OSError, psutil.Error):
            continue
        members.append(pid)
    return members
