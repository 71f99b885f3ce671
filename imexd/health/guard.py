"""Containment of the agent's named tasks: restarts with backoff, and their heartbeats.

One job: keep one failing loop from taking the agent (and the IMEX daemon) down, and
keep /healthz honest about which loop is wedged. Its own module because it is the same
rule for every task the agent runs (events, membership, reconcile, probe, report,
discover, watchdog) and has nothing to do with what those tasks decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

import structlog

from imexd.health.conditions import Heartbeats
from imexd.health.metrics import Metrics
from imexd.retry import backoff_delay

BEAT_S: Final = 1.0
"""How often a task at work beats its heartbeat (one at rest owes none: `Guard.rest`)."""
TASK_RESTART_INITIAL_S: Final = 0.5
TASK_RESTART_MAX_S: Final = 30.0
"""Backoff of a task restarted after an unexpected error (capped, jittered)."""
TASK_STABLE_S: Final = 60.0
"""A task that ran this long before failing starts its backoff afresh."""
TASK_FAILURES_TO_EXIT: Final = 10
TASK_FAILURE_WINDOW_S: Final = 300.0
"""This many unexpected errors of one task within the window end the agent as a hand-over
(exit 75, daemon left running, record kept) so that systemd starts a fresh agent."""
WORK_MARGIN_S: Final = 10.0
"""Beyond its own bound, how long a task's awaited work may keep its heartbeat alive."""

_T = TypeVar("_T")


def describe(exc: BaseException) -> str:
    """An error as one line: its type and its message."""
    return f"{type(exc).__name__}: {exc}"


class Guard:
    """Starts the agent's loops as named, guarded tasks that beat their heartbeats."""

    def __init__(
        self,
        heartbeats: Heartbeats,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.heartbeats = heartbeats
        self.metrics = metrics
        self.log = log
        self.give_up = asyncio.Event()
        """Set when a task keeps failing: the agent exits as in a hand-over."""

    def start(
        self,
        group: asyncio.TaskGroup,
        name: str,
        loop: Callable[[], Coroutine[Any, Any, None]],
    ) -> asyncio.Task[None]:
        """Run `loop` in `group` as the task `name`, with a heartbeat and restarts."""
        self.heartbeats.register(name, BEAT_S)
        self.metrics.known_task(name)  # its failure counter reads 0, not "No data"
        return group.create_task(self._guarded(name, loop), name=name)

    async def _guarded(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run one of the agent's loops; restart it with backoff after an unexpected error.

        Containment: no input and no bug in one task may stop or restart the IMEX daemon.
        The error is one `agent.task_failed` event with its traceback and a count in
        imexd_task_failures_total; the other tasks go on. A task that fails
        TASK_FAILURES_TO_EXIT times within TASK_FAILURE_WINDOW_S sets `give_up`, which
        ends the agent as a hand-over.
        """
        failures: list[float] = []
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                await loop()
            except Exception as exc:
                now = time.monotonic()
                if now - started >= TASK_STABLE_S:
                    attempt = 0
                failures = [t for t in failures if now - t <= TASK_FAILURE_WINDOW_S]
                failures.append(now)
                delay = backoff_delay(
                    attempt,
                    TASK_RESTART_INITIAL_S,
                    TASK_RESTART_MAX_S,
                )
                attempt += 1
                self.metrics.count_task_failure(name)
                self.log.error(
                    "agent.task_failed",
                    task=name,
                    error=describe(exc),
                    failures=len(failures),
                    restart_in_s=round(delay, 2),
                    exc_info=exc,
                )
                if len(failures) >= TASK_FAILURES_TO_EXIT:
                    self.log.error(
                        "agent.giving_up",
                        task=name,
                        failures=len(failures),
                        window_s=TASK_FAILURE_WINDOW_S,
                        why="exiting as a hand-over: the daemon keeps running for the next agent",
                    )
                    self.give_up.set()
                    await asyncio.Event().wait()  # cancelled by the agent's run()
                await self.beating(name, asyncio.sleep(delay), limit=delay)
            else:
                return

    async def rest(self, name: str, wake: asyncio.Event | None, until: float | None) -> bool:
        """Wait at rest for `wake` or until time.monotonic() reaches `until` (None or
        math.inf: no deadline); True when `wake` is set.

        Waiting for the next input is not being wedged: no heartbeat is owed meanwhile,
        so no timer wakes an idle agent to beat. Each loop states its own deadlines.
        """
        event = wake if wake is not None else asyncio.Event()
        with self.heartbeats.resting(name):
            if not event.is_set():
                if until is None or until == math.inf:
                    await event.wait()  # no deadline: no timeout to arm
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, until - time.monotonic())):
                            await event.wait()
        return event.is_set()

    async def beating(self, name: str, work: Coroutine[Any, Any, _T], *, limit: float) -> _T:
        """Await `work` while beating `name`'s heartbeat for at most `limit` + a margin.

        A task waiting on bounded outside work (a ctl probe, a daemon stop) is not wedged:
        /healthz must not fail because IMEX is slow. Past the bound the beats stop, so
        work that never ends still shows as a wedged task. The beats come from a timer of
        the loop, so that work done at once (most of it) costs no task and no wait.
        """
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + limit + WORK_MARGIN_S
        beats = self.heartbeats
        timer: asyncio.TimerHandle

        def beat() -> None:
            nonlocal timer
            if time.monotonic() < deadline:
                beats.beat(name)
                timer = loop.call_later(BEAT_S, beat)

        timer = loop.call_later(BEAT_S, beat)
        try:
            return await work
        finally:
            timer.cancel()
