"""The simulated clock: one queue of timed actions, run in time order, ties in the order
they were queued, so that a seed replays exactly."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any


class Clock:
    """Simulated time, the actions due, the run's random source and its notes."""

    def __init__(self, rng: random.Random, *, tracing: bool = False) -> None:
        self.now = 0.0
        self.rng = rng
        """Every draw of a run (delays, which old record a replay takes): the seed's."""
        self.tracing = tracing
        self.notes: list[tuple[float, str]] = []
        """What happened, for a trace (only while `tracing`: formatting costs)."""
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        """Actions run so far."""

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        """Run `action(*args)` at `when` (never before now)."""
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, action, args))

    def run_until(self, end: float, *, budget: int) -> int:
        """Run every action due up to `end`, then stand at `end`; stop early after
        `budget` actions. Returns the actions run."""
        queue = self._queue
        pop = heapq.heappop
        while queue and queue[0][0] <= end and self.events < budget:
            when, _, action, args = pop(queue)
            self.now = when
            self.events += 1
            action(*args)
        if self.events < budget:
            self.now = max(self.now, end)
        return self.events

    def note(self, text: str) -> None:
        """Keep one line for the trace (callers check `tracing` before formatting)."""
        self.notes.append((self.now, text))
