"""Which broker the link tries next, and how long it waits first.

Brokers (`[bus] url`) are tried in turn: after a failed connect the next one is tried at
once until each was tried in this round; then the link waits, doubling the wait per
failed round (`imexd.retry.backoff_delay`). A link that ends, even one that worked, is
followed by one jittered wait, so that a fleet does not reconnect to a restarted broker
at the same instant, and the next attempt goes to the next broker. Only a link that held
(`stable`) resets the backoff, so a broker that drops every link at once is not hammered.
"""

from __future__ import annotations

from collections.abc import Callable

from imexd.retry import backoff_delay


class Rotation:
    """The reconnect loop's position among `count` brokers and its backoff."""

    def __init__(
        self, count: int, initial_s: float, max_s: float, rand: Callable[[], float]
    ) -> None:
        if count < 1:
            raise ValueError("no broker to rotate over")
        self.index = 0
        """The broker to try next."""
        self._count = count
        self._initial_s = initial_s
        self._max_s = max_s
        self._rand = rand
        self._rounds = 0
        self._left = count

    def left_cleanly(self) -> None:
        """A link was left on purpose (new will, new client id): the same broker, at once."""
        self._rounds, self._left = 0, self._count

    def next(self, *, lost: bool, stable: bool = False) -> float | None:
        """After a link was lost (`lost`) or a connect failed: move to the next broker and
        say how long to wait first (None: try it at once)."""
        if lost:
            if stable:
                self._rounds = 0
            self._left = 1
        self.index = (self.index + 1) % self._count
        self._left -= 1
        if self._left > 0:
            return None
        delay = backoff_delay(self._rounds, self._initial_s, self._max_s, self._rand)
        self._rounds += 1
        self._left = self._count
        return delay
