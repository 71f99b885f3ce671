"""The IMEX daemon supervisor: one explicit state machine around one `nvidia-imex`.

States follow supervisord's model (`DaemonState`), and every change of state is one
structured log event, `daemon.state` with `from`, `to` and `reason`:

    STOPPED --ensure_started--> STARTING --start_s alive--> RUNNING
    STARTING/RUNNING --exit--> BACKOFF --delay--> STARTING ...
    BACKOFF --crash_loop_starts failures in crash_loop_window_s--> FATAL
    FATAL --fatal_cooldown_s--> STARTING (one more try: a failure goes straight back)
    any running state --stop/restart/leave--> STOPPING --> STOPPED

Why it looks the way it does:
- IMEX reads its files only at start and a restart makes it a "new instance" whose
  peers tear down memory imported from it, so the supervisor never restarts a healthy
  daemon on its own: only crashes (with capped, jittered exponential backoff, reset
  after `stable_s` alive) and explicit `restart()` calls (config.cfg or the node's
  identity changed) start a new one.
- SIGUSR1 (re-resolve host names, reconnect) is honoured at most once per 5 s and
  silently dropped inside that window, so `request_reload()` paces signals at least
  `reload_min_interval_s` apart and coalesces every request that arrives inside the
  window into one signal sent when the window ends: the last change always arrives.
  The window is taken to start when the daemon starts (or is adopted), because the
  daemon has just read every file then, and an early SIGUSR1 could reach a process
  that has not installed its handler yet (the default action kills it).
- An agent restart (upgrade, crash) must not restart IMEX: at start the supervisor
  looks for a daemon already running our config path (`find_imex_processes`,
  `classify_processes`) and, when the agent says the files on disk are what it would
  write now, adopts it instead of starting a new one, watching its exit with a pidfd,
  since it is not our child.
- The daemon's stdout and stderr are files next to config.cfg (`nvidia-imex.out`,
  `nvidia-imex.err`, opened O_APPEND), not pipes: whoever supervises the daemon, the
  agent that started it or the one that adopted it after a hand-over, tails them and
  logs each line as a `daemon.output` event, and no reader is needed for the daemon to
  write (a pipe without one would kill it with SIGPIPE, or block it when full). A
  spawn truncates them; when one grows past `output_max_bytes` it is truncated after it
  was read to its end (the daemon's O_APPEND writes then start again at 0), so they
  stay small even while no agent runs for long; a line written in the instant between
  that last read and the truncation is lost. Regular files cannot be watched with
  epoll, so they are read every `output_poll_s`.
- The daemon runs in its own process group (session); stopping it is SIGTERM to the
  group, SIGKILL after `stop_timeout_s`, and whatever is left of the group is killed
  and waited for, so nothing is left behind, never waiting forever.

The supervisor is an async context manager: leaving it stops the daemon, unless
`detach()` was called (hand over for an upgrade), in which case the daemon keeps
running, writing to its output files for the next agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import random
import re
import select
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, Self

import psutil

from imexd.logs import get_logger
from imexd.process import (
    ImexProcess,
    Survey,
    describe_exit,
    end_group,
    open_pidfd,
    signal_process,
    survey_processes,
    survives_sigusr1,
    wait_readable,
)
from imexd.retry import backoff_delay
from imexd.settings import DaemonSettings, Settings

OUTPUT_SOURCE = "nvidia-imex"
"""The `source` field of every `daemon.output` event (a line of the daemon's output)."""

OUTPUT_FILES = {"stdout": "nvidia-imex.out", "stderr": "nvidia-imex.err"}
"""The daemon's output files, by stream, in `output_dir` (config.cfg's folder by default)."""

OUTPUT_MAX_BYTES = 4 * 1024 * 1024
"""An output file read to its end is truncated once it is larger than this."""

OUTPUT_POLL_S = 0.2
"""How often the output files are read for new lines."""

OUTPUT_MODE = 0o640
"""The output files' permissions: the daemon's log is not for every local user."""

ADOPT_SEED_BYTES = 16 * 1024
"""How much of an adopted daemon's output files is read back into `last_lines`."""

_STREAM_FDS = {"stdout": 1, "stderr": 2}

LAST_LINES = 50
"""How many lines of the daemon's output are kept for status and error reasons."""

MAX_LINE_BYTES = 16 * 1024
"""A longer line is cut there: one runaway line must not grow the agent's memory."""

KILL_WAIT_S = 5.0
"""How long to wait for a SIGKILLed process to disappear before reporting it."""

STRIPPED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
"""systemd's variables for the agent itself: the daemon must not notify on our behalf."""

HANDLER_RECHECK_S = 0.1
"""How soon to look again when a due SIGUSR1 would still kill the daemon."""


class DaemonState(enum.Enum):
    """Where the daemon process is in its life (supervisord's process states)."""

    STOPPED = "STOPPED"
    """Not running and not about to run: not asked to, stopped, or blocked (see reason)."""
    STARTING = "STARTING"
    """Started less than `start_s` ago."""
    RUNNING = "RUNNING"
    """Alive for at least `start_s`, or adopted."""
    BACKOFF = "BACKOFF"
    """Exited unexpectedly; waiting for the backoff delay before the next start."""
    STOPPING = "STOPPING"
    """SIGTERM sent; SIGKILL follows after `stop_timeout_s`."""
    FATAL = "FATAL"
    """Crash loop: waiting `fatal_cooldown_s` before one more start."""


class DaemonReason(enum.StrEnum):
    """Why the daemon is not RUNNING: the machine-readable word of `DaemonStatus.reason`."""

    STOPPED = "DaemonStopped"
    STARTING = "DaemonStarting"
    STOPPING = "DaemonStopping"
    CRASHED = "DaemonCrashed"
    CRASH_LOOP = "DaemonCrashLoop"
    CONFLICT = "ConflictingDaemon"


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """A snapshot of the supervisor, for health reports and readiness.

    `reason` is None only while RUNNING; otherwise it is a machine-readable code
    (`DaemonStopped`, `DaemonStarting`, `DaemonStopping`, `DaemonCrashed`,
    `DaemonCrashLoop`, `ConflictingDaemon`) and `detail` says the rest for a person,
    e.g. `exit 3: <the daemon's last stderr line>`. Two fields, so that health reads
    the code without parsing a sentence.
    """

    state: DaemonState
    pid: int | None
    adopted: bool
    """The daemon was started by a previous agent: exit code and output are unknown."""
    restarts: int
    """New daemons (spawned or adopted) that replaced one that had reached RUNNING.

    Whatever ended the previous one (a crash, a requested restart, a stop); a daemon
    that never ran does not make its successor a restart: see `start_failures`.
    """
    crashes: int
    """Unexpected exits (including failures to execute the binary)."""
    start_failures: int
    """Starts that never reached RUNNING: the binary could not run, or it exited in STARTING."""
    fatal_since: float | None
    """time.monotonic() since when the daemon is in a crash loop (FATAL, and the tries
    after each cool-down that failed again); None once a daemon reaches RUNNING or is
    stopped. How long the node has had no working daemon, e.g. to give up its slot."""
    last_exit: str | None
    """How the last daemon ended: `exit 3`, `SIGKILL`, `unknown (adopted)`, ..."""
    reason: DaemonReason | None
    detail: str
    """What happened, for a person (empty while RUNNING)."""
    since: float
    """Wall-clock time (Unix seconds) of the last change of state."""
    next_start_at: float | None
    """Wall-clock time of the next start attempt (BACKOFF, FATAL, blocked), else None."""
    reloads_sent: int
    reload_pending: bool
    """A SIGUSR1 is owed to the daemon and will be sent when its window ends."""
    last_lines: tuple[str, ...]
    """The last `LAST_LINES` lines of the daemon's stdout and stderr, oldest first."""


# ---------------------------------------------------------------------------------
# Pure helpers: output lines, environment, backoff, exit status


@dataclass(frozen=True, slots=True)
class ImexLine:
    """One line of daemon output, split into structlog level and message."""

    level: str
    """debug, info, warning, error or critical."""
    message: str
    imex_time: str | None = None
    tid: int | None = None


_IMEX_LINE = re.compile(
    r"^\[(?P<time>[A-Z][a-z]{2} +\d{1,2} \d{4} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\] "
    r"\[(?P<level>[A-Za-z]+)\] \[tid (?P<tid>\d+)\] ?(?P<message>.*)$"
)
_PREFIXED_LINE = re.compile(
    r"^(?P<level>INFO|WARNING|WARN|ERROR|DEBUG|FATAL|CRITICAL|NOTICE): ?(?P<message>.*)$"
)
_LEVELS = {
    "TRACE": "debug",
    "VERBOSE": "debug",
    "DEBUG": "debug",
    "INFO": "info",
    "NOTICE": "info",
    "WARN": "warning",
    "WARNING": "warning",
    "ERROR": "error",
    "FATAL": "critical",
    "CRITICAL": "critical",
}


def parse_imex_line(line: str) -> ImexLine:
    """Read IMEX's `[Sep 18 2026 06:40:33] [INFO] [tid 77] message` format.

    Also `WARNING: ...`-prefixed lines (printed before logging is set up); anything
    else is an info-level message as it is.
    """
    m = _IMEX_LINE.match(line)
    if m is not None:
        return ImexLine(
            _LEVELS.get(m["level"].upper(), "info"), m["message"], m["time"], int(m["tid"])
        )
    m = _PREFIXED_LINE.match(line)
    if m is not None:
        return ImexLine(_LEVELS[m["level"]], m["message"])
    return ImexLine("info", line)


def daemon_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The daemon's environment: ours plus `[imex] env`, without systemd's notify variables.

    NOTIFY_SOCKET and the watchdog variables belong to the agent's unit; a daemon that
    inherited them could send READY/WATCHDOG messages on the agent's behalf.
    """
    env = {**base, **extra}
    for name in STRIPPED_ENV:
        env.pop(name, None)
    return env


# ---------------------------------------------------------------------------------
# The supervisor


class _Output:
    """The read end of one of the daemon's output files, split into lines."""

    def __init__(self, fd: int, stream: str, path: str) -> None:
        self.fd = fd
        self.stream = stream
        self.path = path
        self.buf = bytearray()
        self.open = True


class _Child:
    """One daemon process being watched: spawned by us, or adopted from a previous agent."""

    def __init__(
        self,
        *,
        pid: int,
        pidfd: int,
        pgid: int | None,
        adopted: bool,
        started: float,
        outputs: list[_Output],
    ) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.pgid = pgid
        """Its process group when it leads one (signals go to the group), else None."""
        self.adopted = adopted
        self.started = started
        """time.monotonic() of its start (estimated from its age when adopted)."""
        self.outputs = outputs
        """Its output files being tailed; empty when they are not ours (adopted)."""
        self.exited = asyncio.Event()
        self.stable = False
        self.ran = False
        """It reached RUNNING (or was adopted): its successor is a restart."""
        self.last_stderr: str | None = None
        self.released = False


class Supervisor:
    """Runs, watches and signals one IMEX daemon; see the module docstring.

    Drive it from the agent's reconcile step, asking for exactly what a change needs:
    `ensure_started(adopt=...)` when the daemon should run, `restart(reason)` when
    config.cfg or the node's identity changed, `request_reload(reason)` when only host
    names moved (names mode), `stop()` when the node leaves its domain, `detach()`
    before leaving for a hand over. State is read from `status` (a frozen snapshot),
    awaited with `wait_for`, or pushed through `on_change`.
    """

    def __init__(
        self,
        *,
        binary: str,
        config_path: str | os.PathLike[str],
        env: Mapping[str, str],
        settings: DaemonSettings,
        reload_min_interval_s: float,
        conflict_recheck_s: float = 5.0,
        on_change: Callable[[DaemonStatus], None] | None = None,
        rand: Callable[[], float] = random.random,
        output_dir: str | os.PathLike[str] | None = None,
        output_max_bytes: int = OUTPUT_MAX_BYTES,
        output_poll_s: float = OUTPUT_POLL_S,
    ) -> None:
        """Validate and store; nothing runs until the supervisor is entered.

        `config_path` must be absolute: it is the daemon's `-c` argument and how the
        daemon is recognised after an agent restart. `on_change` is called (in the
        event loop, must not block) with a new snapshot after every change of state,
        pid or reload bookkeeping. `rand` feeds the backoff jitter (tests pin it).
        `output_dir` holds the daemon's output files (`OUTPUT_FILES`; config.cfg's
        folder by default: every agent of the node must find them there), truncated
        past `output_max_bytes` and read every `output_poll_s` seconds.
        """
        path = os.fspath(config_path)
        if not os.path.isabs(path):
            raise ValueError(f"config_path = {path!r}: expected an absolute path")
        if not binary.strip():
            raise ValueError("binary: expected a program name or path")
        if reload_min_interval_s < 0 or conflict_recheck_s <= 0:
            raise ValueError("reload_min_interval_s >= 0 and conflict_recheck_s > 0 expected")
        if output_max_bytes <= 0 or output_poll_s <= 0:
            raise ValueError("output_max_bytes > 0 and output_poll_s > 0 expected")
        folder = os.path.dirname(path) if output_dir is None else os.fspath(output_dir)
        self._output_paths = {
            stream: os.path.join(folder, name) for stream, name in OUTPUT_FILES.items()
        }
        self._output_max = output_max_bytes
        self._output_poll = output_poll_s
        self._binary = binary
        self._config_path = os.path.normpath(path)
        self._env = daemon_environment(os.environ, env)
        self._settings = settings
        self._reload_interval = reload_min_interval_s
        self._conflict_recheck = conflict_recheck_s
        self._on_change = on_change
        self._rand = rand
        self._log = get_logger("daemon")

        self._state = DaemonState.STOPPED
        self._reason: DaemonReason | None = DaemonReason.STOPPED
        self._detail = "not started yet"
        self._since = time.time()
        self._child: _Child | None = None
        self._want_running = False
        self._adopt_ok = False
        self._restart_reason: str | None = None
        self._stop_reason = "stopped by the agent"
        self._next_start: float | None = None
        self._failures: deque[float] = deque()
        self._backoff_step = 0
        self._probation = False
        self._restarts = 0
        self._last_ran = False
        self._start_failures = 0
        self._fatal_since: float | None = None
        self._crashes = 0
        self._last_exit: str | None = None
        self._reloads_sent = 0
        self._reload_pending: str | None = None
        self._reload_requests = 0
        self._last_reload: float | None = None
        self._reload_held_until = 0.0
        self._lines: deque[str] = deque(maxlen=LAST_LINES)
        self._output_lines = 0
        self._conflict: str | None = None
        self._detached = False
        self._closed = False

        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._tail_task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._changed = asyncio.Event()
        self._acks: list[asyncio.Future[DaemonStatus]] = []

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> Supervisor:
        """A supervisor for the agent's settings: `[imex]` binary, env and pacing, `[daemon]`."""
        return cls(
            binary=settings.imex.binary,
            config_path=settings.config_path,
            env=settings.imex.env,
            settings=settings.daemon,
            reload_min_interval_s=settings.imex.reload_min_interval_s,
            **kwargs,
        )

    # -- observation ------------------------------------------------------------

    @property
    def state(self) -> DaemonState:
        return self._state

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def last_exit(self) -> str | None:
        return self._last_exit

    @property
    def reason(self) -> DaemonReason | None:
        return self._reason

    @property
    def detail(self) -> str:
        return self._detail

    @property
    def last_lines(self) -> tuple[str, ...]:
        return tuple(self._lines)

    @property
    def reloads_sent(self) -> int:
        return self._reloads_sent

    @property
    def config_path(self) -> str:
        return self._config_path

    @property
    def output_paths(self) -> Mapping[str, str]:
        """The daemon's output files by stream (`stdout`, `stderr`)."""
        return MappingProxyType(self._output_paths)

    @property
    def environment(self) -> Mapping[str, str]:
        """The daemon's environment: the ctl probes must run with the same one."""
        return MappingProxyType(self._env)

    @property
    def status(self) -> DaemonStatus:
        """A consistent snapshot of everything a health model needs."""
        child = self._child
        next_start = None
        if child is None and self._want_running and self._next_start is not None:
            next_start = time.time() + max(0.0, self._next_start - time.monotonic())
        return DaemonStatus(
            state=self._state,
            pid=child.pid if child is not None else None,
            adopted=child.adopted if child is not None else False,
            restarts=self.restarts,
            crashes=self._crashes,
            start_failures=self._start_failures,
            fatal_since=self._fatal_since,
            last_exit=self._last_exit,
            reason=self._reason,
            detail=self._detail,
            since=self._since,
            next_start_at=next_start,
            reloads_sent=self._reloads_sent,
            reload_pending=self._reload_pending is not None,
            last_lines=tuple(self._lines),
        )

    async def wait_for(self, predicate: Callable[[DaemonStatus], bool]) -> DaemonStatus:
        """Wait until `predicate(status)` holds (bound it with `asyncio.timeout`)."""
        while True:
            status = self.status
            if predicate(status):
                return status
            self._check_open()
            await self._changed.wait()

    # -- commands ---------------------------------------------------------------

    async def ensure_started(self, *, adopt: bool = False) -> DaemonStatus:
        """Make the daemon run; returns once the attempt is decided (not after `start_s`).

        `adopt`: the files on disk are exactly what the agent would write now, so a
        daemon already running our config path may be kept (adopted) instead of
        ended as a stray. Idempotent: while a daemon runs nothing happens; in BACKOFF
        or FATAL the pending delay is kept (use `restart` when the files changed).
        """
        self._check_open()
        self._want_running = True
        if self._child is None:
            self._adopt_ok = adopt
        return await self._command()

    async def restart(self, reason: str) -> DaemonStatus:
        """Replace the daemon now (config.cfg or the node's identity changed).

        Stops the running daemon (if any) and starts a new one at once: a requested
        restart skips the crash backoff and the FATAL cool-down, since the new files
        may cure the crash. Returns once the new daemon is started (or blocked).
        """
        self._check_open()
        self._want_running = True
        self._restart_reason = reason
        self._adopt_ok = False
        return await self._command()

    async def stop(self, reason: str = "stopped by the agent") -> DaemonStatus:
        """Stop the daemon (SIGTERM to its group, SIGKILL after `stop_timeout_s`); bounded."""
        self._check_open()
        self._want_running = False
        self._restart_reason = None
        self._stop_reason = reason
        return await self._command()

    def request_reload(self, reason: str) -> bool:
        """Ask for one SIGUSR1 (host names changed); False when it is dropped.

        RUNNING: sent at once when the last signal (or the start) is at least
        `reload_min_interval_s` ago, else sent when that window ends; requests that
        arrive meanwhile ride on that one signal, so the last one always arrives.
        STARTING: deferred the same way (the window starts at the daemon's start).
        Any other state: dropped, because the next daemon to start reads the files
        on disk, which already hold the change.
        """
        self._check_open()
        child = self._child
        if (
            child is None
            or child.exited.is_set()
            or self._state not in (DaemonState.STARTING, DaemonState.RUNNING)
            or not self._want_running
            or self._restart_reason is not None
        ):
            self._log.info(
                "daemon.reload_dropped",
                reason=reason,
                state=self._state.value,
                why="not running: the next start reads the current files",
            )
            return False
        self._reload_pending = reason
        self._reload_requests += 1
        self._log.debug("daemon.reload_requested", reason=reason, pending=self._reload_requests)
        self._kick.set()
        self._notify()
        return True

    async def end_strays(self, why: str) -> int:
        """End every daemon running our config path that this supervisor did not start.

        For an agent that has nothing to run (no domain any more) while a previous agent
        left a daemon behind; returns how many were ended.
        """
        self._check_open()
        own = {self.pid} if self.pid is not None else set()
        survey = await asyncio.to_thread(survey_processes, str(self.config_path), exclude=own)
        for proc in survey.ours:
            await self._end_stray(proc, why)
        return len(survey.ours)

    def detach(self) -> None:
        """Hand over: leaving the context keeps the daemon running for the next agent."""
        self._detached = True
        self._log.info("daemon.detach", pid=self.pid)

    # -- context manager --------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._task is not None:
            raise RuntimeError("a Supervisor can be entered only once")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="daemon-supervisor")
        self._tail_task = asyncio.create_task(self._tail(), name="daemon-output")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        """Stop the loop, then stop or hand over the daemon; never leaves a process behind.

        If this is cancelled midway, the `finally` kills what is left (SIGKILL).
        """
        self._closed = True
        task = self._task
        failure: BaseException | None = None
        try:
            if self._tail_task is not None:
                self._tail_task.cancel()
                await asyncio.wait({self._tail_task})
            if task is not None:
                task.cancel()
                await asyncio.wait({task})
                if not task.cancelled():
                    failure = task.exception()
            self._fail_acks()
            child = self._child
            if child is not None:
                if self._detached:
                    self._hand_over(child)
                else:
                    await self._terminate(child, self._stop_reason_on_exit())
        finally:
            self._last_resort()
            self._notify()
        if failure is not None:
            raise RuntimeError("the daemon supervisor loop failed") from failure

    def _stop_reason_on_exit(self) -> str:
        return "the agent is leaving" if self._want_running else self._stop_reason

    # -- the loop ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._task is None:
            raise RuntimeError("enter the Supervisor (async with) before using it")
        if self._closed or self._task.done():
            raise RuntimeError("the daemon supervisor is closed")

    async def _command(self) -> DaemonStatus:
        """Wake the loop and wait until it has acted on everything asked so far."""
        assert self._loop is not None  # noqa: S101 - _check_open ran
        fut: asyncio.Future[DaemonStatus] = self._loop.create_future()
        self._acks.append(fut)
        self._kick.set()
        return await fut

    def _fail_acks(self) -> None:
        for fut in self._acks:
            if not fut.done():
                fut.set_exception(RuntimeError("the daemon supervisor is closed"))
        self._acks.clear()

    async def _run(self) -> None:
        """The state machine's one task: act, acknowledge, sleep until a kick or a timer."""
        try:
            while True:
                self._kick.clear()
                n = len(self._acks)
                await self._step()
                status = self.status
                for fut in self._acks[:n]:
                    if not fut.done():
                        fut.set_result(status)
                del self._acks[:n]
                if not self._kick.is_set():
                    await self._sleep(self._deadline())
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("daemon.loop_failed")
            self._fail_acks()
            raise
        finally:
            self._notify()

    async def _sleep(self, deadline: float | None) -> None:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                await self._kick.wait()
        except TimeoutError:
            pass

    def _deadline(self) -> float | None:
        """The next moment a timer matters: start_s, stable_s, a reload window, a start."""
        child = self._child
        s = self._settings
        if not self._want_running:
            return None
        if child is None:
            return self._next_start
        if child.exited.is_set():
            return None
        deadlines: list[float] = []
        if self._state is DaemonState.STARTING:
            deadlines.append(child.started + s.start_s)
        elif not child.stable:
            deadlines.append(child.started + s.stable_s)
        if self._reload_pending is not None and self._state is DaemonState.RUNNING:
            deadlines.append(self._reload_due())
        return min(deadlines, default=None)

    def _reload_due(self) -> float:
        last = self._last_reload
        due = time.monotonic() if last is None else last + self._reload_interval
        return max(due, self._reload_held_until)

    async def _step(self) -> None:
        """Do what the current state and the agent's wishes call for, once."""
        child = self._child
        if child is not None and child.exited.is_set():
            await self._on_exit(child)
            child = None
        if not self._want_running:
            self._next_start = None
            self._reload_pending = None
            if child is not None:
                await self._terminate(child, self._stop_reason)
            elif self._state is not DaemonState.STOPPED or self._conflict is not None:
                self._conflict = None
                self._set(DaemonState.STOPPED, DaemonReason.STOPPED, self._stop_reason)
            return
        if self._restart_reason is not None:
            reason, self._restart_reason = self._restart_reason, None
            if child is not None:
                await self._terminate(child, f"restart: {reason}")
                child = None
            self._next_start = None
        if child is not None:
            self._tick(child)
            return
        if self._next_start is not None and time.monotonic() < self._next_start:
            return
        await self._start()

    def _tick(self, child: _Child) -> None:
        """Timers of a live daemon: STARTING -> RUNNING, stability, a due reload."""
        now = time.monotonic()
        s = self._settings
        age = now - child.started
        if self._state is DaemonState.STARTING and age >= s.start_s:
            self._set(DaemonState.RUNNING, None, f"alive for {s.start_s:g} s")
        if self._state is DaemonState.RUNNING and not child.stable and age >= s.stable_s:
            child.stable = True
            if self._failures or self._backoff_step or self._probation:
                self._log.info("daemon.stable", pid=child.pid, alive_s=round(age, 1))
            self._failures.clear()
            self._backoff_step = 0
            self._probation = False
        if (
            self._state is DaemonState.RUNNING
            and self._reload_pending is not None
            and now >= self._reload_due()
        ):
            if survives_sigusr1(child.pid):
                self._send_reload(child)
            else:
                # Still starting up (no handler yet): SIGUSR1 would kill it. Its files
                # are read at start anyway, but the change may have come after that.
                self._reload_held_until = now + HANDLER_RECHECK_S
                self._log.debug("daemon.reload_held", pid=child.pid, why="no SIGUSR1 handler yet")

    # -- starting ---------------------------------------------------------------

    async def _start(self) -> None:
        """One start attempt: look around (adopt, end strays, or stop at a conflict), then run."""
        self._next_start = None
        if self._state is DaemonState.FATAL:
            self._probation = True
        try:
            found = await asyncio.to_thread(
                survey_processes, self._config_path, exclude={os.getpid()}
            )
        except (OSError, psutil.Error) as exc:
            self._log.warning("daemon.survey_failed", error=str(exc))
            found = Survey((), ())
        if found.conflicts:
            proc, why = found.conflicts[0]
            detail = f"pid {proc.pid} ({proc.command}) {why}"
            if detail != self._conflict:
                self._log.warning(
                    "daemon.conflict", reason=f"{DaemonReason.CONFLICT}: {detail}", pid=proc.pid
                )
            self._conflict = detail
            self._next_start = time.monotonic() + self._conflict_recheck
            self._set(DaemonState.STOPPED, DaemonReason.CONFLICT, detail)
            return
        if self._conflict is not None:
            self._log.info(
                "daemon.conflict_gone", reason=f"{DaemonReason.CONFLICT}: {self._conflict}"
            )
            self._conflict = None
        adopted: _Child | None = None
        for proc in sorted(found.ours, key=lambda p: p.create_time):
            if adopted is None and self._adopt_ok:
                adopted = self._adopt(proc)
                if adopted is not None:
                    continue
            why = (
                "another daemon was adopted"
                if adopted is not None
                else "its files may differ from what the agent writes now"
            )
            await self._end_stray(proc, why)
        self._adopt_ok = False
        if adopted is not None:
            self._begin(adopted)
            output = "streamed"
            if not adopted.outputs:
                output = "not streamed: its stdout/stderr are not " + " and ".join(
                    self._output_paths.values()
                )
            elif len(adopted.outputs) < len(self._output_paths):
                output = f"streamed: only {adopted.outputs[0].stream}"
            self._log.info("daemon.adopted", pid=adopted.pid, output=output)
            self._set(DaemonState.RUNNING, None, f"adopted pid {adopted.pid}")
        else:
            self._spawn()

    def _begin(self, child: _Child) -> None:
        """Make `child` the watched daemon; its start (or adoption) opens a reload window."""
        assert self._loop is not None  # noqa: S101 - set in __aenter__
        self._child = child
        if self._last_ran:
            self._restarts += 1
            self._last_ran = False
        self._last_reload = time.monotonic()
        self._reload_pending = None
        self._reload_requests = 0
        self._loop.add_reader(child.pidfd, self._on_pidfd, child)

    def _spawn(self) -> None:
        """Start `binary -c config` in a new session, stdout/stderr into fresh output files."""
        argv = [self._binary, "-c", self._config_path]
        actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        writers: list[int] = []
        outputs: list[_Output] = []
        try:
            for stream, path in self._output_paths.items():
                target = _STREAM_FDS[stream]
                opened = self._open_output(stream, path)
                if opened is None:
                    actions.append((os.POSIX_SPAWN_OPEN, target, os.devnull, os.O_WRONLY, 0))
                    continue
                writer, output = opened
                writers.append(writer)
                outputs.append(output)
                actions.append((os.POSIX_SPAWN_DUP2, writer, target))
            try:
                pid = os.posix_spawnp(
                    self._binary,
                    argv,
                    self._env,
                    file_actions=actions,
                    setsid=True,
                    # SIGPIPE stays ignored (inherited from Python, as systemd's
                    # IgnoreSIGPIPE=yes does): the daemon writes to files, but whatever
                    # it may write to a pipe or socket without a reader must not kill
                    # IMEX and tear down the memory that running jobs import.
                    setsigdef=(signal.SIGXFSZ, signal.SIGUSR1, signal.SIGTERM),
                    setsigmask=(),
                )
            except OSError as exc:
                for output in outputs:
                    self._close_output(output)
                self._crashed(
                    f"cannot run {self._binary}: {exc.strerror or exc}",
                    "not started",
                    uptime=0.0,
                    ran=False,
                )
                return
        finally:
            for writer in writers:
                os.close(writer)
        pidfd = os.pidfd_open(pid)  # our unreaped child: cannot be gone yet
        child = _Child(
            pid=pid,
            pidfd=pidfd,
            pgid=pid,
            adopted=False,
            started=time.monotonic(),
            outputs=outputs,
        )
        self._begin(child)
        self._set(
            DaemonState.STARTING,
            DaemonReason.STARTING,
            f"pid {pid}, RUNNING after {self._settings.start_s:g} s alive",
        )
        self._tick(child)

    def _open_output(self, stream: str, path: str) -> tuple[int, _Output] | None:
        """Truncate `path` for a new daemon: (its write end, our reader), or None (logged).

        Without its file the daemon's stream goes to /dev/null: a run dir we cannot
        write to must not keep IMEX from starting, only its output from being read.
        """
        flags = os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            writer = os.open(path, os.O_WRONLY | flags, OUTPUT_MODE)
            try:
                reader = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                os.close(writer)
                raise
        except OSError as exc:
            self._log.error(
                "daemon.output_unavailable",
                stream=stream,
                path=path,
                error=str(exc),
                consequence="this stream of the daemon goes to /dev/null",
            )
            return None
        return writer, _Output(reader, stream, path)

    def _adopt(self, proc: ImexProcess) -> _Child | None:
        """Watch a daemon a previous agent started; None when it is gone (or its pid reused)."""
        opened = open_pidfd(proc)
        if opened is None:
            return None
        pidfd, pgid = opened
        age = max(0.0, time.time() - proc.create_time)
        child = _Child(
            pid=proc.pid,
            pidfd=pidfd,
            pgid=pgid,
            adopted=True,
            started=time.monotonic() - age,
            outputs=self._adopted_outputs(proc.pid),
        )
        child.stable = age >= self._settings.stable_s
        return child

    def _adopted_outputs(self, pid: int) -> list[_Output]:
        """Readers of our output files that daemon `pid` writes to, at their end.

        A daemon started by an older agent, or by hand, writes elsewhere: nothing to
        tail. The end of each file is read back into `last_lines` (not logged again).
        """
        outputs: list[_Output] = []
        for stream, path in self._output_paths.items():
            try:
                theirs = os.stat(f"/proc/{pid}/fd/{_STREAM_FDS[stream]}")
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                ours = os.fstat(fd)
                if (ours.st_dev, ours.st_ino) != (theirs.st_dev, theirs.st_ino):
                    os.close(fd)
                    continue
                end = os.lseek(fd, 0, os.SEEK_END)
                start = max(0, end - ADOPT_SEED_BYTES)
                tail = os.pread(fd, end - start, start)
            except OSError:
                os.close(fd)
                continue
            lines = tail.split(b"\n")[:-1]  # the last one is unfinished (or empty)
            if start > 0:
                lines = lines[1:]  # the first one is cut
            for raw in lines:
                line = raw.decode("utf-8", errors="replace").rstrip("\r")
                if line.strip():
                    self._lines.append(line)
            outputs.append(_Output(fd, stream, path))
        return outputs

    async def _end_stray(self, proc: ImexProcess, why: str) -> None:
        """End a daemon running our config path that we will not adopt (TERM, then KILL)."""
        self._log.warning("daemon.stray", pid=proc.pid, command=proc.command, why=why)
        opened = open_pidfd(proc)
        if opened is None:
            return
        pidfd, pgid = opened
        try:
            signal_process(pidfd, pgid, signal.SIGTERM)
            if not await wait_readable(pidfd, self._settings.stop_timeout_s):
                self._log.warning("daemon.kill", pid=proc.pid, why="stray ignored SIGTERM")
                signal_process(pidfd, pgid, signal.SIGKILL)
                if not await wait_readable(pidfd, KILL_WAIT_S):
                    self._log.error("daemon.unkillable", pid=proc.pid)
            if pgid is not None:
                await self._kill_group(pgid)
        finally:
            os.close(pidfd)

    # -- running ----------------------------------------------------------------

    def _on_pidfd(self, child: _Child) -> None:
        """The pidfd became readable: the process has exited."""
        assert self._loop is not None  # noqa: S101 - readers exist only after __aenter__
        self._loop.remove_reader(child.pidfd)
        child.exited.set()
        self._kick.set()

    async def _tail(self) -> None:
        """Read the daemon's output files every `output_poll_s` (files cannot be awaited)."""
        while True:
            await asyncio.sleep(self._output_poll)
            child = self._child
            if child is None or child.released:
                continue
            for output in child.outputs:
                try:
                    self._read_output(child, output, final=False)
                except Exception:  # a bug here must not end the daemon's supervision
                    self._log.exception("daemon.output_failed", path=output.path)

    def _read_output(self, child: _Child, output: _Output, *, final: bool) -> None:
        """Log the whole lines written since the last read; truncate a file grown too big.

        `final` (the daemon exited): also the last, unfinished line.
        """
        if not output.open:
            return
        try:
            if os.fstat(output.fd).st_size < os.lseek(output.fd, 0, os.SEEK_CUR):
                os.lseek(output.fd, 0, os.SEEK_SET)  # truncated by someone else
            at_end = False
            emitted = self._output_lines
            for _ in range(64):  # at most 4 MiB at a time: the loop must not stall
                data = os.read(output.fd, 65536)
                if not data:
                    at_end = True
                    break
                self._split(child, output, data)
            if final and output.buf:
                self._emit(child, output.stream, bytes(output.buf))
                output.buf.clear()
            if self._output_lines != emitted:
                self._wake()
            if at_end and not final:
                pos = os.lseek(output.fd, 0, os.SEEK_CUR)
                if pos > self._output_max:
                    self._truncate(output, pos)
        except OSError as exc:
            self._log.error(
                "daemon.output_unreadable", stream=output.stream, path=output.path, error=str(exc)
            )
            self._close_output(output)

    def _split(self, child: _Child, output: _Output, data: bytes) -> None:
        output.buf += data
        while (nl := output.buf.find(b"\n")) >= 0:
            line = bytes(output.buf[:nl])
            del output.buf[: nl + 1]
            self._emit(child, output.stream, line)
        if len(output.buf) > MAX_LINE_BYTES:
            self._emit(child, output.stream, bytes(output.buf[:MAX_LINE_BYTES]) + b" [cut]")
            output.buf.clear()

    def _truncate(self, output: _Output, size: int) -> None:
        """Empty an output file read to its end; the daemon's O_APPEND writes restart at 0."""
        ours = os.fstat(output.fd)
        try:
            there = os.stat(output.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):
            return  # replaced: not the daemon's file any more
        try:
            os.truncate(output.path, 0)
        except OSError as exc:
            self._log.warning("daemon.output_truncate_failed", path=output.path, error=str(exc))
            return
        os.lseek(output.fd, 0, os.SEEK_SET)
        self._log.debug("daemon.output_truncated", path=output.path, size=size)

    def _emit(self, child: _Child, stream: str, raw: bytes) -> None:
        """One line of daemon output: kept for reasons and logged as a `daemon.output` event."""
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line.strip():
            return
        self._lines.append(line)
        self._output_lines += 1
        if stream == "stderr":
            child.last_stderr = line
        parsed = parse_imex_line(line)
        extra: dict[str, Any] = {}
        if parsed.tid is not None:
            extra["tid"] = parsed.tid
            extra["imex_time"] = parsed.imex_time
        log = getattr(self._log, parsed.level)
        log(
            "daemon.output",
            line=parsed.message,
            source=OUTPUT_SOURCE,
            stream=stream,
            pid=child.pid,
            **extra,
        )

    @staticmethod
    def _close_output(output: _Output) -> None:
        if output.open:
            output.open = False
            os.close(output.fd)

    def _send_reload(self, child: _Child) -> None:
        """SIGUSR1 to the daemon itself (not its group), carrying every pending request."""
        reason, requests = self._reload_pending, self._reload_requests
        self._reload_pending = None
        self._reload_requests = 0
        try:
            signal.pidfd_send_signal(child.pidfd, signal.SIGUSR1)
        except ProcessLookupError:
            return  # it just exited: the exit is handled next, the next start reads the files
        self._last_reload = time.monotonic()
        self._reloads_sent += 1
        self._log.info("daemon.reload", pid=child.pid, reason=reason, requests=requests)
        self._notify()

    # -- exits and stopping -----------------------------------------------------

    async def _on_exit(self, child: _Child) -> None:
        """The daemon exited on its own: a crash, whatever the code (IMEX never exits by itself)."""
        uptime = time.monotonic() - child.started
        exit_desc = await self._finish(child)
        detail = exit_desc if child.last_stderr is None else f"{exit_desc}: {child.last_stderr}"
        if child.adopted:
            detail = f"adopted daemon pid {child.pid} exited (status unknown: not our child)"
        self._crashed(detail, exit_desc, uptime=uptime, ran=child.ran)

    def _crashed(self, detail: str, exit_desc: str, *, uptime: float, ran: bool) -> None:
        """Count a failure; BACKOFF with a growing delay, or FATAL in a crash loop.

        Failures count since the last stable run (`stable_s` alive clears them),
        inside `crash_loop_window_s`: a crash in RUNNING counts like one in STARTING,
        since a daemon dying every minute is looping too. The one try after FATAL is on
        probation: failing again goes straight back to FATAL.
        """
        s = self._settings
        now = time.monotonic()
        before = (self._state, self._reason, self._detail)
        self._crashes += 1
        if not ran:
            self._start_failures += 1
        self._last_exit = exit_desc
        while self._failures and now - self._failures[0] > s.crash_loop_window_s:
            self._failures.popleft()
        self._failures.append(now)
        if self._probation or len(self._failures) >= s.crash_loop_starts:
            self._next_start = now + s.fatal_cooldown_s
            self._log.error(
                "daemon.crash_loop",
                failures=len(self._failures),
                window_s=s.crash_loop_window_s,
                retry_in_s=s.fatal_cooldown_s,
                last_lines=list(self._lines)[-5:],
            )
            self._set(DaemonState.FATAL, DaemonReason.CRASH_LOOP, detail)
        else:
            delay = backoff_delay(
                self._backoff_step, s.backoff_initial_s, s.backoff_max_s, self._rand
            )
            self._backoff_step += 1
            self._next_start = now + delay
            self._log.warning(
                "daemon.crashed",
                exit=exit_desc,
                uptime_s=round(uptime, 2),
                retry_in_s=round(delay, 2),
            )
            self._set(DaemonState.BACKOFF, DaemonReason.CRASHED, detail)
        if (self._state, self._reason, self._detail) == before:
            self._notify()  # same state and reason (a failed try after FATAL): new counters

    async def _terminate(self, child: _Child, why: str) -> None:
        """SIGTERM to the group, SIGKILL after `stop_timeout_s`, then clean up; bounded."""
        self._set(DaemonState.STOPPING, DaemonReason.STOPPING, why)
        if not child.exited.is_set():
            signal_process(child.pidfd, child.pgid, signal.SIGTERM)
            if not await self._wait_exit(child, self._settings.stop_timeout_s):
                self._log.warning(
                    "daemon.kill",
                    pid=child.pid,
                    why=f"still running {self._settings.stop_timeout_s:g} s after SIGTERM",
                )
                signal_process(child.pidfd, child.pgid, signal.SIGKILL)
                if not await self._wait_exit(child, KILL_WAIT_S):
                    self._log.error("daemon.unkillable", pid=child.pid)
        self._last_exit = await self._finish(child)
        self._set(DaemonState.STOPPED, DaemonReason.STOPPED, why)

    async def _wait_exit(self, child: _Child, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await child.exited.wait()
        except TimeoutError:
            return False
        return True

    async def _finish(self, child: _Child) -> str:
        """After the daemon's exit: read its last lines, kill what is left of its group, reap it."""
        for output in child.outputs:
            self._read_output(child, output, final=True)
        if child.pgid is not None:
            await self._kill_group(child.pgid)
        exit_desc = "unknown (adopted)"
        if not child.adopted:
            exit_desc = "unknown"
            try:
                # WNOHANG: the pidfd said it exited, so this never blocks
                res = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222
            except ChildProcessError:
                res = None
            if res is not None:
                code = res.si_status if res.si_code == os.CLD_EXITED else -res.si_status
                exit_desc = describe_exit(code)
        self._release(child)
        if self._child is child:
            self._child = None
            self._reload_pending = None
            self._last_ran = child.ran
        return exit_desc

    async def _kill_group(self, pgid: int) -> None:
        """SIGKILL whatever is left of the daemon's process group; log what survives."""
        try:
            left = await end_group(pgid, wait_s=KILL_WAIT_S)
        except PermissionError as exc:
            self._log.error("daemon.orphans", pgid=pgid, error=str(exc))
            return
        if left:
            self._log.error("daemon.orphans", pgid=pgid, pids=left)

    def _release(self, child: _Child) -> None:
        """Close the pidfd and the output files of `child` (idempotent)."""
        if child.released:
            return
        child.released = True
        for output in child.outputs:
            self._close_output(output)
        if self._loop is not None and not child.exited.is_set():
            self._loop.remove_reader(child.pidfd)
        os.close(child.pidfd)

    def _hand_over(self, child: _Child) -> None:
        """Leave the daemon running, writing to its output files for the next agent."""
        for output in child.outputs:
            self._read_output(child, output, final=False)
        self._log.info("daemon.handed_over", pid=child.pid, state=self._state.value)
        self._release(child)

    def _last_resort(self) -> None:
        """Shutdown was interrupted: SIGKILL the daemon's group, reap it, close everything."""
        child = self._child
        if child is None or child.released:
            return  # stopped, or handed over (the snapshot keeps the running daemon's pid)
        if not self._detached and not child.exited.is_set():
            self._log.error("daemon.killed_on_exit", pid=child.pid)
            signal_process(child.pidfd, child.pgid, signal.SIGKILL)
            select.select([child.pidfd], [], [], KILL_WAIT_S)
            if not child.adopted:
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | os.WNOHANG)
        self._release(child)
        self._child = None

    # -- bookkeeping ------------------------------------------------------------

    def _set(self, to: DaemonState, code: DaemonReason | None, detail: str) -> None:
        """Enter state `to` because of `code` (None only for RUNNING) and `detail`.

        One `daemon.state` log event per change of state, its reason "Code: detail".
        """
        old = self._state
        reason = None if to is DaemonState.RUNNING else code
        status_detail = "" if to is DaemonState.RUNNING else detail
        if old is to and (reason, status_detail) == (self._reason, self._detail):
            return
        self._state = to
        self._reason = reason
        self._detail = status_detail
        if to is DaemonState.RUNNING and self._child is not None:
            self._child.ran = True
        if to is DaemonState.FATAL and self._fatal_since is None:
            self._fatal_since = time.monotonic()
        elif to in (DaemonState.RUNNING, DaemonState.STOPPED):
            self._fatal_since = None
        if old is not to:
            self._since = time.time()
            level = {DaemonState.FATAL: "error", DaemonState.BACKOFF: "warning"}.get(to, "info")
            getattr(self._log, level)(
                "daemon.state",
                **{"from": old.value, "to": to.value},
                reason=detail if code is None else f"{code}: {detail}",
                pid=self.pid,
                restarts=self.restarts,
            )
        self._notify()

    def _wake(self) -> None:
        """Wake `wait_for` callers only (new output lines: not worth an `on_change`)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _notify(self) -> None:
        """Wake `wait_for` callers and call `on_change` with a fresh snapshot."""
        self._wake()
        if self._on_change is not None:
            try:
                self._on_change(self.status)
            except Exception:
                self._log.exception("daemon.on_change_failed")
