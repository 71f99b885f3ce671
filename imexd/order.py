"""One order for the control plane's records: the newest version wins, and a deletion is a
version too.

Every spec, workload, assignment and retry request carries a `generation` its writer
raises (the control plane writes the topic's previous generation + 1, its tombstone
included; where the broker holds nothing, the Unix time in whole seconds, so that a record
made again after a broker lost everything still outranks what readers remember of the old
one). A deletion is a tombstone, a retained record of its own (`tombstone`), never an
empty payload. Versions are ordered by (generation, tombstone, bytes): a tombstone wins a
tie, and the bytes break what is left, so that two writers of one generation still end in
one winner on every reader.

`Order` is what a reader holds, pure: per topic the newest version it saw. `offer` says
whether a record is newer (apply it), the same (nothing to do) or older (stale: not
applied, and answered with the held version); an empty payload (`cleared`) removes nothing
the reader holds, since it only says that the broker no longer serves it. `due` is the
anti-entropy pass: the held versions newer than what the broker serves, to publish again
verbatim (the signature included). However records are interleaved, repeated, replayed
or lost, a reader that was offered a version holds it or a newer one, and readers offered
the same versions hold the same one (tests/test_order.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum
from typing import Final

import msgspec

from imexd.messages import Assignment, DomainSpec, Payload, Retry, WorkloadRecord, tombstone

ORDERED: Final = (DomainSpec, WorkloadRecord, Assignment, Retry)
"""The payloads ordered by generation (the control plane's records)."""


def first_generation(now: float | None = None) -> int:
    """The generation of a record on a topic where the broker serves nothing: the Unix
    time in whole seconds, so that it outranks what readers remember of a record the
    broker lost."""
    return int(time.time() if now is None else now)


def next_generation(previous: int | None, now: float | None = None) -> int:
    """The generation a writer gives its record over the topic's `previous` one (its
    tombstone included; None: the broker serves nothing)."""
    return previous + 1 if previous is not None else first_generation(now)


class Version(msgspec.Struct, frozen=True):
    """One record of a topic as a reader holds it: its place in the order and its bytes."""

    generation: int
    tombstone: bool
    data: bytes
    at: float = 0.0
    """When its writer wrote it (wall-clock seconds, 0: unknown): a tombstone's age."""

    @property
    def rank(self) -> tuple[int, bool, bytes]:
        """The order: greater is newer."""
        return (self.generation, self.tombstone, self.data)

    def newer(self, other: Version | None) -> bool:
        """Whether this version outranks `other` (None: nothing)."""
        return other is None or self.rank > other.rank


def version(payload: Payload, data: bytes) -> Version | None:
    """The version of a record as it came (`data`: its bytes); None for a payload that is
    not ordered by generation."""
    if not isinstance(payload, ORDERED):
        return None
    at = payload.at
    return Version(payload.generation, tombstone(payload), data, at)


class Verdict(StrEnum):
    """What a reader does with a record offered to it."""

    NEW = "new"
    """Newer than what it held: apply it."""
    SAME = "same"
    """What it holds: nothing changes."""
    STALE = "stale"
    """Older than what it holds: not applied; answer with the held version."""


class Order(msgspec.Struct):
    """Per topic, the newest version a reader saw, and what the broker serves now."""

    held: dict[str, Version] = msgspec.field(default_factory=dict)
    served: dict[str, Version | None] = msgspec.field(default_factory=dict)
    """What the current link showed on each topic (None: nothing, a clear); a topic
    missing has shown nothing since the link came up."""

    def offer(self, topic: str, record: Version) -> Verdict:
        """Take a record the broker served on `topic`."""
        self.served[topic] = record
        mine = self.held.get(topic)
        if record.newer(mine):
            self.held[topic] = record
            return Verdict.NEW
        if mine is not None and record.rank == mine.rank:
            return Verdict.SAME
        return Verdict.STALE

    def cleared(self, topic: str) -> bool:
        """Take an empty payload on `topic`: it removes nothing. True when the reader
        holds a version there (to give back), False when it holds none."""
        self.served[topic] = None
        return topic in self.held

    def link_up(self) -> None:
        """A new link: nothing is known yet of what its broker serves."""
        self.served.clear()

    def due(self, topics: Iterable[str]) -> list[tuple[str, Version]]:
        """The anti-entropy pass over `topics` (after the snapshot of a link): each held
        version that the broker serves an older version of, or nothing."""
        out = []
        for topic in sorted(set(topics)):
            mine = self.held.get(topic)
            if mine is not None and mine.newer(self.served.get(topic)):
                out.append((topic, mine))
        return out

    def forget(self, keep: Callable[[str, Version], bool]) -> list[str]:
        """Drop the held versions `keep` refuses (a domain no longer followed, a tombstone
        past its expiry); the topics dropped."""
        gone = [t for t, v in self.held.items() if not keep(t, v)]
        for topic in gone:
            del self.held[topic]
            self.served.pop(topic, None)
        return gone

    def __iter__(self) -> Iterator[tuple[str, Version]]:
        return iter(sorted(self.held.items()))
