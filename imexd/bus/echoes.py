"""Which of our retained publications came back: the bus's proof that the broker kept them.

The MQTT client drops PUBACK reason codes and MQTT 3.1.1 has none, so a publication an
ACL refused is visible only as "our own retained record did not come back".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Echoes:
    """Which retained publications still wait to come back, and which never did.

    A publication counts as accepted when the same payload arrives on its topic within
    `timeout` seconds (live, or from a snapshot); otherwise it is refused until it, or a
    later publication on that topic, comes back: a slow broker or a loaded node only
    delays the echo, and the late echo clears the verdict.
    """

    def __init__(
        self,
        timeout: float,
        on_refused: Callable[[str], None],
        can_tell: Callable[[str], bool] = lambda _: True,
        on_lost: Callable[[str], None] = lambda _: None,
    ) -> None:
        self._timeout = timeout
        self._on_refused = on_refused
        self._on_lost = on_lost
        """Called when the live echo timed out of a publication a snapshot showed kept."""
        self._can_tell = can_tell
        """Whether an echo on a topic could come at all now (a subscription covering it is
        granted); when not, an expired wait starts over instead of judging."""
        self._pending: dict[str, tuple[bytes, asyncio.TimerHandle]] = {}
        self._late: dict[str, bytes] = {}
        """Payloads that timed out: their echo may still arrive and clear `refused`."""
        self.refused: set[str] = set()
        self._kept: set[str] = set()
        """Pending topics whose payload a snapshot showed: accepted, live echo awaited."""

    def expect(self, topic: str, payload: bytes) -> None:
        self._cancel(topic)
        self._late.pop(topic, None)
        handle = asyncio.get_running_loop().call_later(self._timeout, self._expired, topic)
        self._pending[topic] = (payload, handle)

    def seen(self, topic: str, payload: bytes, *, live: bool = True) -> None:
        """`payload` arrived on `topic`: live (the echo), or a snapshot's retained copy,
        which proves the broker kept it but is no echo (the wait for that goes on)."""
        waiting = self._pending.get(topic)
        if waiting is not None and waiting[0] == payload:
            if live:
                self._cancel(topic)
            else:
                self._kept.add(topic)
            self.refused.discard(topic)
        elif self._late.get(topic) == payload:
            del self._late[topic]
            self.refused.discard(topic)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Stop tracking topics no longer covered by our subscriptions."""
        for topic in [t for t in self._pending if not keep(t)]:
            self._cancel(topic)
        self._late = {t: p for t, p in self._late.items() if keep(t)}
        self.refused = {t for t in self.refused if keep(t)}

    def reset(self) -> None:
        """The link is gone: every publication is redone on the next one."""
        for topic in list(self._pending):
            self._cancel(topic)

    def _cancel(self, topic: str) -> None:
        self._kept.discard(topic)
        waiting = self._pending.pop(topic, None)
        if waiting is not None:
            waiting[1].cancel()

    def _expired(self, topic: str) -> None:
        if not self._can_tell(topic) and topic in self._pending:
            kept = topic in self._kept
            self.expect(topic, self._pending[topic][0])  # start over, knowing what it knew
            if kept:
                self._kept.add(topic)
            return
        if topic in self._kept:
            self._cancel(topic)
            self._on_lost(topic)
            return
        waiting = self._pending.pop(topic, None)
        if waiting is not None:
            self._late[topic] = waiting[0]
        self.refused.add(topic)
        self._on_refused(topic)
