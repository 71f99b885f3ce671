"""Our retained records: what every new link publishes again, and what it did publish.

The caller declares its records (`Bus.retain`); the link replays them on each new
connection. A record whose slot may have been taken while the link was down (the member
record) is not replayed blindly: `replay=False` leaves it to the caller, who judges the
new link's snapshot first and then publishes it there (docs/bus.md, *Connection*).
"""

from __future__ import annotations

import msgspec


class Record(msgspec.Struct):
    """One retained record of ours."""

    payload: bytes
    """b"": delete the retained record once, then forget the entry."""
    expiry_s: float | None
    replay: bool = True
    """Published again on every new link; False: only when the caller publishes it on
    that link (after judging its snapshot). A clear is always replayed."""


class Records:
    """Our records by topic, and which of them were published on the current link."""

    def __init__(self) -> None:
        self._by_topic: dict[str, Record] = {}
        self._on_link: set[str] = set()
        self._previous: dict[str, bytes] = {}
        """The payload each record replaced: its echo may still arrive after the new one
        went out, and is ours, not someone else's."""

    def declare(self, topic: str, record: Record) -> None:
        """Set (or, with an empty payload, clear once) our record on `topic`."""
        if (old := self._by_topic.get(topic)) is not None:
            self._previous[topic] = old.payload
        self._by_topic[topic] = record

    def forget(self, topic: str) -> None:
        """Hold no record on `topic` any more, publishing nothing."""
        self._by_topic.pop(topic, None)
        self._previous.pop(topic, None)
        self._on_link.discard(topic)

    def get(self, topic: str) -> Record | None:
        return self._by_topic.get(topic)

    def replayed(self) -> list[tuple[str, Record]]:
        """What a new link publishes again, by topic."""
        return [(t, r) for t, r in self._by_topic.items() if r.replay]

    def ours(self) -> dict[str, bytes]:
        """The payloads we publish ourselves and replay, by topic (what a re-read compares
        the broker's snapshot with)."""
        return {t: r.payload for t, r in self._by_topic.items() if r.payload and r.replay}

    def published_here(self) -> dict[str, bytes]:
        """Our records as this link published them, by topic (`held` of each)."""
        return {t: payload for t in self._by_topic if (payload := self.held(t))}

    def link_up(self) -> None:
        """A new link: nothing of ours was published on it yet."""
        self._on_link.clear()

    def publishing(self, topic: str) -> None:
        """Our record on `topic` is being published on this link."""
        self._on_link.add(topic)

    def sent(self, topic: str, record: Record) -> None:
        """`record` went out; a clear is forgotten then, unless a newer record replaced it
        meanwhile (a clear that failed to go out is replayed on the next link)."""
        if not record.payload and self._by_topic.get(topic) is record:
            del self._by_topic[topic]
            self._previous.pop(topic, None)

    def overwritten(self, topic: str, payload: bytes) -> bool:
        """Whether `payload`, arriving on `topic`, is another copy than ours of a record we
        replay and published on this link: someone wrote over it (a member record is the
        caller's to judge: `replay=False`)."""
        record = self._by_topic.get(topic)
        return (
            record is not None
            and record.replay
            and bool(record.payload)
            and topic in self._on_link
            and payload not in (record.payload, self._previous.get(topic))
        )

    def topics(self) -> list[str]:
        """The topics we hold a record on."""
        return list(self._by_topic)

    def payload(self, topic: str) -> bytes:
        """Our declared record on `topic`; b"" when none."""
        record = self._by_topic.get(topic)
        return b"" if record is None else record.payload

    def held(self, topic: str) -> bytes:
        """Our record on `topic` as the broker should hold it from this link: b"" when we
        hold none, or only one that the caller has not yet published on this link."""
        record = self._by_topic.get(topic)
        if record is None or not record.payload:
            return b""
        if not record.replay and topic not in self._on_link:
            return b""
        return record.payload
