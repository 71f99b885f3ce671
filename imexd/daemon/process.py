"""One IMEX daemon process at the OS level: launch it, hold its pidfd, signal and reap it.

The supervisor (`imexd/daemon/supervisor.py`) decides when a daemon starts, is adopted or stops;
this module does the system calls those decisions come down to: `posix_spawn` into a
new session with the output files as stdout and stderr, a pidfd to watch a process
that may not be our child (adopted), SIGTERM/SIGKILL to its process group with bounded
waits, `waitid` for the exit status. Separate so that the state machine reads as
decisions, and every file descriptor it holds is opened and closed in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import shutil
import signal
import time
from collections.abc import Mapping
from typing import Any

from structlog.typing import FilteringBoundLogger

from imexd.daemon.output import STREAM_FDS, DaemonOutput, Stream, Tail
from imexd.process import (
    ImexProcess,
    describe_exit,
    end_group,
    open_pidfd,
    signal_process,
    wait_readable,
)

KILL_WAIT_S = 5.0
"""How long to wait for a SIGKILLed process to disappear before reporting it."""

STRIPPED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
"""systemd's variables for the agent itself: the daemon must not notify on our behalf."""


def daemon_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The daemon's environment: ours plus `[imex] env`, without systemd's notify variables.

    NOTIFY_SOCKET and the watchdog variables belong to the agent's unit; a daemon that
    inherited them could send READY/WATCHDOG messages on the agent's behalf.
    """
    env = {**base, **extra}
    for name in STRIPPED_ENV:
        env.pop(name, None)
    return env


def launch(
    binary: str, config_path: str, env: Mapping[str, str], output: DaemonOutput
) -> tuple[int, list[Stream]]:
    """Start `binary -c config` in a new session, stdout/stderr into fresh output files.

    Returns its pid and the readers of its output files; raises OSError when the
    binary cannot run (nothing is left open then).
    """
    argv = [binary, "-c", config_path]
    actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    writers: list[int] = []
    streams: list[Stream] = []
    try:
        for stream in output.paths:
            target = STREAM_FDS[stream]
            opened = output.create(stream)
            if opened is None:
                actions.append((os.POSIX_SPAWN_OPEN, target, os.devnull, os.O_WRONLY, 0))
                continue
            writer, reader = opened
            writers.append(writer)
            streams.append(reader)
            actions.append((os.POSIX_SPAWN_DUP2, writer, target))
        try:
            pid = os.posix_spawnp(
                binary,
                argv,
                env,
                file_actions=actions,
                setsid=True,
                # SIGPIPE stays ignored (inherited from Python, as systemd's
                # IgnoreSIGPIPE=yes does): the daemon writes to files, but whatever
                # it may write to a pipe or socket without a reader must not kill
                # IMEX and tear down the memory that running jobs import.
                setsigdef=(signal.SIGXFSZ, signal.SIGUSR1, signal.SIGTERM),
                setsigmask=(),
            )
        except OSError:
            for reader in streams:
                reader.close()
            raise
    finally:
        for writer in writers:
            os.close(writer)
    return pid, streams


def spawn_error(binary: str, exc: OSError, path: str | None = None) -> str:
    """Why `binary` could not be run, naming the file: `cannot run /usr/bin/nvidia-imex: ...`.

    A bare name is looked up on `path` (the agent's PATH by default, where `posix_spawnp`
    looks): not found reads `not found on PATH (...)`. An existing file that fails with
    ENOENT lacks its interpreter or loader, which the error alone does not say.
    """
    why = exc.strerror or str(exc)
    search = os.environ.get("PATH", os.defpath) if path is None else path
    if "/" not in binary:
        found = shutil.which(binary, path=search)
        if found is None:
            return f"cannot run {binary}: not found on PATH ({search})"
        binary = found
    if exc.errno == errno.ENOENT and os.path.exists(binary):
        why += " (the file exists: its interpreter or dynamic loader is missing)"
    return f"cannot run {binary}: {why}"


class DaemonProcess:
    """One daemon process being watched: spawned by us, or adopted from a previous agent."""

    def __init__(
        self,
        *,
        pid: int,
        pidfd: int,
        pgid: int | None,
        adopted: bool,
        started: float,
        output: Tail,
    ) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.pgid = pgid
        """Its process group when it leads one (signals go to the group), else None."""
        self.adopted = adopted
        self.started = started
        """time.monotonic() of its start (estimated from its age when adopted)."""
        self.output = output
        """Its output files being tailed; none when they are not ours (adopted)."""
        self.exited = asyncio.Event()
        self.stable = False
        self.ran = False
        """It reached RUNNING (or was adopted): its successor is a restart."""
        self.released = False

    @classmethod
    def adopt(
        cls, proc: ImexProcess, output: DaemonOutput, *, stable_s: float
    ) -> DaemonProcess | None:
        """Watch a daemon a previous agent started; None when it is gone (or its pid reused)."""
        opened = open_pidfd(proc)
        if opened is None:
            return None
        pidfd, pgid = opened
        age = max(0.0, time.time() - proc.create_time)
        child = cls(
            pid=proc.pid,
            pidfd=pidfd,
            pgid=pgid,
            adopted=True,
            started=time.monotonic() - age,
            output=output.adopt(proc.pid),
        )
        child.stable = age >= stable_s
        return child

    def signal(self, sig: signal.Signals) -> None:
        """`sig` to its process group (or to it alone when it leads none)."""
        signal_process(self.pidfd, self.pgid, sig)

    async def wait_exit(self, seconds: float) -> bool:
        """Whether it exited within `seconds`."""
        try:
            async with asyncio.timeout(seconds):
                await self.exited.wait()
        except TimeoutError:
            return False
        return True

    def reap(self) -> str:
        """How it ended (`exit 3`, `SIGKILL`, ...), once the pidfd said it exited."""
        if self.adopted:
            return "unknown (adopted)"
        try:
            # WNOHANG: the pidfd said it exited, so this never blocks
            res = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return "unknown"
        if res is None:
            return "unknown"
        code = res.si_status if res.si_code == os.CLD_EXITED else -res.si_status
        return describe_exit(code)

    def kill_now(self) -> None:
        """SIGKILL its group and reap it without awaiting: for an interrupted shutdown."""
        self.signal(signal.SIGKILL)
        select.select([self.pidfd], [], [], KILL_WAIT_S)
        if not self.adopted:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)

    def release(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Close the pidfd (watched in `loop`) and the output files (idempotent)."""
        if self.released:
            return
        self.released = True
        self.output.close()
        if loop is not None and not self.exited.is_set():
            loop.remove_reader(self.pidfd)
        os.close(self.pidfd)


async def kill_group(pgid: int, log: FilteringBoundLogger) -> None:
    """SIGKILL whatever is left of the daemon's process group; log what survives."""
    try:
        left = await end_group(pgid, wait_s=KILL_WAIT_S)
    except PermissionError as exc:
        log.error("daemon.orphans", pgid=pgid, error=str(exc))
        return
    if left:
        log.error("daemon.orphans", pgid=pgid, pids=left)


async def end_stray(
    proc: ImexProcess,
    why: str,
    *,
    stop_timeout_s: float,
    log: FilteringBoundLogger,
) -> None:
    """End a daemon running our config path that we will not adopt (TERM, then KILL)."""
    log.warning("daemon.stray", pid=proc.pid, command=proc.command, why=why)
    opened = open_pidfd(proc)
    if opened is None:
        return
    pidfd, pgid = opened
    try:
        signal_process(pidfd, pgid, signal.SIGTERM)
        if not await wait_readable(pidfd, stop_timeout_s):
            log.warning("daemon.kill", pid=proc.pid, why="stray ignored SIGTERM")
            signal_process(pidfd, pgid, signal.SIGKILL)
            if not await wait_readable(pidfd, KILL_WAIT_S):
                log.error("daemon.unkillable", pid=proc.pid)
        if pgid is not None:
            await kill_group(pgid, log)
    finally:
        os.close(pidfd)
