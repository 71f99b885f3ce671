"""The IMEX daemon supervisor: one explicit state machine around one `nvidia-imex`.

States follow supervisord's model (`DaemonState`); every change is one log event,
`daemon.state` with `from`, `to` and `reason`. Two rules to know:
- a healthy daemon is never restarted on the supervisor's own: a restart makes IMEX a new
  instance whose peers drop the memory imported from it, so only crashes (with backoff)
  and explicit `restart()` calls start a new one; an agent restart adopts a daemon that
  already runs our config when the files on disk are what the agent would write;
- SIGUSR1 is paced (`request_reload()`): at most one per `reload_min_interval_s`,
  requests inside the window coalesced into one, so the last change always arrives.
The transitions, and why starts, stops, adoption and hand-over work as they do:
docs/architecture.md#daemon-supervision. The snapshot it publishes is
`imexd/daemon/state.py`; the system calls are `imexd/daemon/process.py`.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, Self

import psutil

from imexd.daemon.inotify import Inotify
from imexd.daemon.output import (
    OUTPUT_MAX_BYTES,
    OUTPUT_POLL_S,
    DaemonOutput,
    Tail,
    quote_lines,
)
from imexd.daemon.process import (
    KILL_WAIT_S,
    DaemonProcess,
    daemon_environment,
    end_stray,
    kill_group,
    launch,
    spawn_error,
)
from imexd.daemon.state import DaemonReason, DaemonState, DaemonStatus
from imexd.logs import get_logger
from imexd.process import Survey, survey_processes, survives_sigusr1
from imexd.retry import backoff_delay
from imexd.settings import DaemonSettings, Settings

HANDLER_RECHECK_S = 0.1
"""How soon to look again when a due SIGUSR1 would still kill the daemon."""
OUTPUT_LISTEN_S = 0.005
"""How often the output is read while `listening`: the daemon's READY line is news."""
LISTEN_FOR_S = 60.0
"""Listening ends this long after a start: a daemon that never gets READY costs no more
wake-ups than any other."""


class Supervisor:
    """Runs, watches and signals one IMEX daemon (docs/architecture.md#daemon-supervision).

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
        past `output_max_bytes` and read when the daemon writes, at most every
        `output_poll_s` seconds (every `output_poll_s` where inotify is missing).
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
        self._output = DaemonOutput(folder, max_bytes=output_max_bytes, on_lines=self._on_lines)
        self._output_poll = output_poll_s
        self.on_output: Callable[[bool], None] | None = None
        """Called after a read found new lines of the daemon, with whether one of them
        says it is READY (the agent's probes listen: their READY makes a start RUNNING)."""
        self.listening = False
        """Read new output within OUTPUT_LISTEN_S instead of `output_poll_s` (the agent
        waits for the daemon's word), for at most LISTEN_FOR_S after its start."""
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
        self._child: DaemonProcess | None = None
        self._last_tail: Tail | None = None
        """The output of the running daemon, or of the last one; None after a failed spawn."""
        self._want_running = False
        self._adopt_ok = False
        self._restart_reason: str | None = None
        self._stop_reason = "stopped by the agent"
        self._next_start: float | None = None
        self._failures: deque[float] = deque()
        self._backoff_step = 0
        self._probation = False
        self._forgiven = False
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
        self._conflict: str | None = None
        self._detached = False
        self._closed = False

        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._tail_task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._changed = asyncio.Event()
        self._watching = asyncio.Event()
        """Set while a daemon is watched: without one, `_tail` sleeps on it, not a timer."""
        self._inotify: Inotify | None = None
        """Wakes `_tail` when the watched daemon writes (None: read on a timer instead)."""
        self._written = asyncio.Event()
        """Set by `_inotify` when the daemon wrote; `_tail` reads, then clears it."""
        self._notified = False
        """Whether the watched daemon's files are all under `_inotify`."""
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
        return self._lines()

    def _lines(self) -> tuple[str, ...]:
        tail = self._last_tail
        return tuple(tail.lines) if tail is not None else ()

    @property
    def reloads_sent(self) -> int:
        return self._reloads_sent

    @property
    def config_path(self) -> str:
        return self._config_path

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
            last_lines=self._lines(),
            identified=child.output.identified if child is not None else None,
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

    async def retry(self, why: str) -> DaemonStatus:
        """An operator's lever (`imexd node retry`): end a crash-loop wait and start now.

        In FATAL or BACKOFF the failures counted so far are forgotten (the operator says
        the cause is fixed), so the next failure backs off from the start again instead
        of going straight back to FATAL. Any other state is left alone: a running daemon
        is never restarted by it. Returns once the attempt is decided.
        """
        self._check_open()
        if self._state in (DaemonState.FATAL, DaemonState.BACKOFF) and self._next_start is not None:
            self._log.warning("daemon.retry", why=why, state=self._state.value)
            self._failures.clear()
            self._backoff_step = 0
            self._fatal_since = None
            self._forgiven = True  # not the probation try that ends a FATAL cool-down
            self._next_start = time.monotonic()
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
            await end_stray(proc, why, stop_timeout_s=self._settings.stop_timeout_s, log=self._log)
        return len(survey.ours)

    async def running_unsupervised(self) -> int | None:
        """The pid of a daemon that runs our config path without this supervisor (a past
        run's, left to an agent that stands aside), else None: reported, never touched."""
        self._check_open()
        if self._child is not None:
            return None
        try:
            survey = await asyncio.to_thread(survey_processes, str(self.config_path))
        except (OSError, psutil.Error) as exc:
            self._log.warning("daemon.survey_failed", error=str(exc))
            return None
        found = sorted(survey.ours, key=lambda p: p.create_time)
        return found[0].pid if found else None

    def report_ready(self, detail: str = "ctl -q says READY") -> bool:
        """The daemon said READY: a STARTING daemon is RUNNING at once; True if it moved.

        The agent calls it when its probes learn it, `detail` saying how (its output's
        READY line, or `ctl -q`); in any other state nothing happens (a start is RUNNING
        already, or the daemon is gone and its exit is handled by the loop).
        """
        self._check_open()
        child = self._child
        if self._state is not DaemonState.STARTING or child is None or child.exited.is_set():
            return False
        self._set(DaemonState.RUNNING, None, detail)
        self._kick.set()  # the next timer is stable_s (or a reload), not start_s
        return True

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
            self._close_inotify()
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

    def _tick(self, child: DaemonProcess) -> None:
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
        if self._state is DaemonState.FATAL and not self._forgiven:
            self._probation = True
        self._forgiven = False
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
        adopted: DaemonProcess | None = None
        for proc in sorted(found.ours, key=lambda p: p.create_time):
            if adopted is None and self._adopt_ok:
                adopted = DaemonProcess.adopt(proc, self._output, stable_s=self._settings.stable_s)
                if adopted is not None:
                    continue
            why = (
                "another daemon was adopted"
                if adopted is not None
                else "its files may differ from what the agent writes now"
            )
            await end_stray(proc, why, stop_timeout_s=self._settings.stop_timeout_s, log=self._log)
        self._adopt_ok = False
        if adopted is not None:
            self._begin(adopted)
            output = self._output.describe(adopted.output)
            self._log.info("daemon.adopted", pid=adopted.pid, output=output)
            self._set(DaemonState.RUNNING, None, f"adopted pid {adopted.pid}")
        else:
            self._spawn()

    def _begin(self, child: DaemonProcess) -> None:
        """Make `child` the watched daemon; its start (or adoption) opens a reload window."""
        assert self._loop is not None  # noqa: S101 - set in __aenter__
        self._child = child
        self._watch_output(child)
        self._watching.set()
        self.listening = True  # until the probes learn that it is READY
        self._last_tail = child.output
        if self._last_ran:
            self._restarts += 1
            self._last_ran = False
        self._last_reload = time.monotonic()
        self._reload_pending = None
        self._reload_requests = 0
        self._loop.add_reader(child.pidfd, self._on_pidfd, child)

    def _spawn(self) -> None:
        """Start a new daemon (`launch`) and watch it: STARTING."""
        try:
            pid, outputs = launch(self._binary, self._config_path, self._env, self._output)
        except OSError as exc:
            self._last_tail = None  # no daemon: no lines, never the previous one's
            path = self._env.get("PATH", os.defpath)
            self._crashed(spawn_error(self._binary, exc, path), "not started", ran=False)
            return
        pidfd = os.pidfd_open(pid)  # our unreaped child: cannot be gone yet
        child = DaemonProcess(
            pid=pid,
            pidfd=pidfd,
            pgid=pid,
            adopted=False,
            started=time.monotonic(),
            output=Tail(pid, outputs),
        )
        self._begin(child)
        self._set(
            DaemonState.STARTING,
            DaemonReason.STARTING,
            f"pid {pid}, RUNNING once READY or after {self._settings.start_s:g} s alive",
        )
        self._tick(child)

    # -- running ----------------------------------------------------------------

    def _on_pidfd(self, child: DaemonProcess) -> None:
        """The pidfd became readable: the process has exited."""
        assert self._loop is not None  # noqa: S101 - readers exist only after __aenter__
        self._loop.remove_reader(child.pidfd)
        child.exited.set()
        self._kick.set()

    def _watch_output(self, child: DaemonProcess) -> None:
        """Put `child`'s output files under inotify (those of the previous daemon out).

        A file that cannot be watched sends the daemon's output back to the timer.
        """
        assert self._loop is not None  # noqa: S101 - set in __aenter__
        self._notified = False
        try:
            if self._inotify is None:  # opened for the first daemon: none without one
                self._inotify = Inotify.open()
                self._loop.add_reader(self._inotify.fileno(), self._on_written)
            self._inotify.clear()
            for stream in child.output.streams:
                self._inotify.watch(stream.fd)
        except OSError as exc:
            if self._inotify is not None:
                self._inotify.clear()
            self._log.info(
                "daemon.output_polled",
                pid=child.pid,
                error=str(exc),
                consequence=f"its output is read every {self._output_poll:g} s",
            )
            return
        self._notified = True
        self._written.set()  # what it wrote before the watch (an adopted daemon's) is read

    def _on_written(self) -> None:
        """The inotify descriptor is readable: a watched file was written."""
        if self._inotify is not None:
            self._inotify.drain()
        self._written.set()

    def _close_inotify(self) -> None:
        inotify, self._inotify = self._inotify, None
        if inotify is not None and self._loop is not None:
            self._loop.remove_reader(inotify.fileno())
            inotify.close()

    async def _tail(self) -> None:
        """Read the watched daemon's output files when it writes (inotify), or every
        `output_poll_s` where that cannot be watched; reads are at least that far apart
        (OUTPUT_LISTEN_S while `listening`), however much it writes. Without a daemon no
        timer runs (an agent without one, or between daemons, costs no wake-ups)."""
        while True:
            await self._watching.wait()
            child = self._child
            listening = (
                self.listening
                and child is not None
                and time.monotonic() - child.started < LISTEN_FOR_S
            )
            gap = OUTPUT_LISTEN_S if listening else self._output_poll
            if self._notified:
                await self._written.wait()
                self._written.clear()
            else:
                await asyncio.sleep(gap)
            child = self._child
            if child is None or child.released:
                self._watching.clear()
                continue
            self._output.poll(child.output)
            if self._notified:
                await asyncio.sleep(gap)

    def _send_reload(self, child: DaemonProcess) -> None:
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

    async def _on_exit(self, child: DaemonProcess) -> None:
        """The daemon exited on its own: a crash, whatever the code (IMEX never exits by itself)."""
        uptime = time.monotonic() - child.started
        exit_desc = await self._finish(child)
        how = exit_desc
        if child.adopted:
            how = f"adopted daemon pid {child.pid} exited (status unknown: not our child)"
        self._crashed(
            f"{how} after {_seconds(uptime)}",
            exit_desc,
            uptime=uptime,
            ran=child.ran,
            lines=child.output.lines,
        )

    def _crashed(
        self,
        cause: str,
        exit_desc: str,
        *,
        ran: bool,
        uptime: float = 0.0,
        lines: Sequence[str] | None = None,
    ) -> None:
        """Count a failure; BACKOFF with a growing delay, or FATAL in a crash loop.

        Failures count since the last stable run (`stable_s` alive clears them),
        inside `crash_loop_window_s`: a crash in RUNNING counts like one in STARTING,
        since a daemon dying every minute is looping too. The one try after FATAL is on
        probation: failing again goes straight back to FATAL.

        `cause` is how it ended (`exit 3 after 0.4 s`, `cannot run PATH: ...`); `lines`
        are the exited daemon's own output (None: no daemon ran, a failed spawn). The
        reason is `DaemonCrashed`, or `DaemonStartFailed` when the binary could not
        run; `DaemonCrashLoop` in FATAL. Its detail quotes the last `EXIT_LINES`.
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
        if lines is None:
            said = ""
        else:
            quoted = quote_lines(lines)
            said = f"; last lines: {quoted}" if quoted else "; no output"
        if self._probation or len(self._failures) >= s.crash_loop_starts:
            self._next_start = now + s.fatal_cooldown_s
            loop = (
                f"{len(self._failures)} failures within {s.crash_loop_window_s:g} s, "
                f"next try in {_seconds(s.fatal_cooldown_s)}"
            )
            detail = f"{cause}, {loop}{said}"
            self._log.error(
                "daemon.crash_loop",
                failures=len(self._failures),
                window_s=s.crash_loop_window_s,
                retry_in_s=s.fatal_cooldown_s,
                last_lines=list(lines or ())[-5:],
            )
            self._set(DaemonState.FATAL, DaemonReason.CRASH_LOOP, detail)
        else:
            delay = backoff_delay(
                self._backoff_step, s.backoff_initial_s, s.backoff_max_s, self._rand
            )
            self._backoff_step += 1
            self._next_start = now + delay
            again = "retry" if lines is None else "restart"
            detail = f"{cause}, {again} in {_seconds(delay)}{said}"
            self._log.warning(
                "daemon.crashed",
                exit=exit_desc,
                cause=cause,
                uptime_s=round(uptime, 2),
                retry_in_s=round(delay, 2),
            )
            code = DaemonReason.START_FAILED if lines is None else DaemonReason.CRASHED
            self._set(DaemonState.BACKOFF, code, detail)
        if (self._state, self._reason, self._detail) == before:
            self._notify()  # same state and reason (a failed try after FATAL): new counters

    async def _terminate(self, child: DaemonProcess, why: str) -> None:
        """SIGTERM to the group, SIGKILL after `stop_timeout_s`, then clean up; bounded."""
        self._set(DaemonState.STOPPING, DaemonReason.STOPPING, why)
        if not child.exited.is_set():
            child.signal(signal.SIGTERM)
            if not await child.wait_exit(self._settings.stop_timeout_s):
                self._log.warning(
                    "daemon.kill",
                    pid=child.pid,
                    why=f"still running {self._settings.stop_timeout_s:g} s after SIGTERM",
                )
                child.signal(signal.SIGKILL)
                if not await child.wait_exit(KILL_WAIT_S):
                    self._log.error("daemon.unkillable", pid=child.pid)
        self._last_exit = await self._finish(child)
        self._last_ran = False  # a planned end: its successor is not a restart
        self._set(DaemonState.STOPPED, DaemonReason.STOPPED, why)

    async def _finish(self, child: DaemonProcess) -> str:
        """After the daemon's exit: read its last lines, kill what is left of its group, reap it."""
        self._output.read_all(child.output, final=True)
        if child.pgid is not None:
            await kill_group(child.pgid, self._log)
        exit_desc = child.reap()
        child.release(self._loop)
        if self._child is child:
            self._child = None
            self._notified = False
            if self._inotify is not None:
                self._inotify.clear()
            self._reload_pending = None
            self._last_ran = child.ran
        return exit_desc

    def _hand_over(self, child: DaemonProcess) -> None:
        """Leave the daemon running, writing to its output files for the next agent."""
        self._output.read_all(child.output, final=False)
        self._log.info("daemon.handed_over", pid=child.pid, state=self._state.value)
        child.release(self._loop)

    def _last_resort(self) -> None:
        """Shutdown was interrupted: SIGKILL the daemon's group, reap it, close everything."""
        child = self._child
        if child is None or child.released:
            return  # stopped, or handed over (the snapshot keeps the running daemon's pid)
        if not self._detached and not child.exited.is_set():
            self._log.error("daemon.killed_on_exit", pid=child.pid)
            child.kill_now()
        child.release(self._loop)
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

    def _on_lines(self, ready: bool) -> None:
        """New output lines (`ready`: one says the daemon is READY): wake `wait_for`
        callers and tell `on_output` (not worth an `on_change`: the lines are no state)."""
        self._wake()
        if self.on_output is not None:
            try:
                self.on_output(ready)
            except Exception:
                self._log.exception("daemon.on_output_failed")

    def _wake(self) -> None:
        """Wake `wait_for` callers."""
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


def _seconds(value: float) -> str:
    """A duration for a reason: `0.4 s`, `12 s`, `600 s`."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
