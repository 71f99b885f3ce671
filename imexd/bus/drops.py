"""What the link drops: malformed or foreign messages, counted per reason, logged once.

Anything wrong on the wire (`imexd.messages.decode_message` says what) is dropped; it
never ends or stalls the connection. Each (sender topic, reason) is logged once, so a
flood neither fills the log nor, past `MAX_LOG_KEYS` pairs, grows memory.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Final

from imexd.messages import Dropped, DropReason

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

MAX_LOG_KEYS: Final = 4096
"""Distinct (topic, reason) pairs remembered for log-once."""


class Drops:
    """Dropped incoming messages of one bus."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter({reason.value: 0 for reason in DropReason})
        """Per DropReason value (imexd_bus_dropped_total)."""
        self._logged: set[tuple[str, str]] = set()

    def drop(self, topic: str, dropped: Dropped, log: FilteringBoundLogger) -> None:
        """Count one dropped message; log it unless its (topic, reason) was logged."""
        self.counts[dropped.reason.value] += 1
        key = (topic, dropped.reason.value)
        if key in self._logged or len(self._logged) >= MAX_LOG_KEYS:
            return
        self._logged.add(key)
        log.warning(
            "bus_message_dropped",
            topic=topic[:300],
            reason=dropped.reason.value,
            detail=dropped.detail[:300],
        )
