"""How the agent's loops wait on changes: bounded (`until`), and coalesced (`Pacer`).

`until` waits for a condition that an event says may have moved, at most a bound: what
the agent waits for that way (a presence's snapshot, a resynced view) is bounded, not
required.

A `Pacer` coalesces for a loop that recomputes on every change: the agent's report
loop judges the facts and conditions again after every bus event; a formation delivers
dozens of member records per node within a second or two, and each recomputation costs
about as much as the event itself. The pacer keeps the first change after a quiet
period immediate and folds the changes that follow within `pause_s` into one turn at the
end of the pause. The event is cleared only after the pause, so a change that arrives
during it is taken by that turn: the last change is never lost, only delayed by at most
`pause_s`. News that a job waits for (`urgent`: the daemon's state, what its probes
said, a channel made) is never held: it ends a pause at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable


async def until(holds: Callable[[], bool], moved: asyncio.Event, limit: float) -> None:
    """Wait until `holds()`, looking again each time `moved` is set, at most `limit`
    seconds (then go on regardless)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            while not holds():
                moved.clear()
                await moved.wait()


class Pacer:
    """At most one turn per `pause_s` while changes keep coming; the first one at once."""

    def __init__(
        self,
        pause_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if pause_s < 0:
            raise ValueError(f"pause_s must be >= 0, not {pause_s}")
        self.pause_s = pause_s
        self._clock = clock
        self._sleep = sleep
        self._quiet_at = float("-inf")
        """clock() from which a change starts a turn at once (`pause_s` after the last)."""

    async def wait(
        self,
        changed: asyncio.Event,
        limit_s: float | None,
        urgent: asyncio.Event | None = None,
    ) -> bool:
        """Wait up to `limit_s` (None: for as long as it takes) for `changed`, then clear
        it (and `urgent`); True when it was set.

        A change within `pause_s` of the previous changed turn waits for the end of the
        pause first, unless `urgent` is set or gets set meanwhile (set it together with
        `changed`); what is set meanwhile is cleared with it, for this turn to take. A
        turn without a change (`limit_s` ran out) starts no pause.
        """
        if not changed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit_s):
                    await changed.wait()
            if not changed.is_set():
                return False
        if (hold := self._quiet_at - self._clock()) > 0:
            await self._hold(hold, urgent)
        self._quiet_at = self._clock() + self.pause_s
        changed.clear()
        if urgent is not None:
            urgent.clear()
        return True

    async def _hold(self, seconds: float, urgent: asyncio.Event | None) -> None:
        """Sleep `seconds`, or until `urgent` is set."""
        if urgent is None:
            await self._sleep(seconds)
            return
        if urgent.is_set():
            return
        pause = asyncio.ensure_future(self._sleep(seconds))
        news = asyncio.ensure_future(urgent.wait())
        try:
            await asyncio.wait((pause, news), return_when=asyncio.FIRST_COMPLETED)
        finally:
            pause.cancel()
            news.cancel()
