"""Waiting on a link: for one of several events, for an operation unless the link is left,
and for a deadline counted in time the event loop was free (a busy loop is not a dead link).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, Final

from imexd.errors import BusError

LATENESS_SLICE_S: Final = 0.25
"""A ping deadline is watched in slices this long; a slice that ends late measures how
late this process's own event loop ran (see `within_loop_time`)."""

MAX_LATENESS: Final = 3.0
"""The ping deadline grows by the loop's lateness up to this many ping timeouts."""


async def first_set(events: set[asyncio.Event], timeout_s: float) -> None:
    """Wait until one of `events` is set, or `timeout_s` passed."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def unless(leave: asyncio.Event, operation: Coroutine[Any, Any, object]) -> bool:
    """Run one broker operation unless its link is left first; True when it completed."""
    task: asyncio.Task[object] = asyncio.ensure_future(operation)
    left = asyncio.ensure_future(leave.wait())
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await task
    if task.cancelled():
        return False
    task.result()  # re-raises the operation's error
    return True


async def within_loop_time(
    operation: Coroutine[Any, Any, None], timeout_s: float
) -> tuple[bool, float]:
    """Run `operation` for `timeout_s` seconds of time that the event loop was free to
    notice it: (whether it completed, seconds the loop ran late meanwhile).

    A ping echo that came in time but was read late because this process's own event loop
    was busy (hundreds of agents in one loop, a slow disk) proves a live link, not a dead
    one. So the deadline is watched in slices of `LATENESS_SLICE_S`; each slice that ends
    later than it asked for adds its overrun to the deadline, up to `MAX_LATENESS` x
    `timeout_s`, so that a link that is really dead is still given up. The operation's
    error is raised; it is cancelled when it did not complete.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(operation)
    deadline = loop.time() + timeout_s
    late = 0.0
    try:
        while True:
            remaining = deadline + late - loop.time()
            if remaining <= 0:
                return False, late
            step = min(remaining, LATENESS_SLICE_S)
            asked = loop.time()
            done, _ = await asyncio.wait({task}, timeout=step)
            if done:
                task.result()
                return True, late
            overrun = max(0.0, loop.time() - asked - step)
            late = min(late + overrun, MAX_LATENESS * timeout_s)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await task
        elif not task.cancelled():
            # Done as we were cancelled (the link went down): its error is retrieved
            # here, or asyncio logs it as never retrieved.
            task.exception()
