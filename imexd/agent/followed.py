"""Which peers' presences the node follows, and which a claim waits for: pure.

A peer's Last Will is its presence (`messages.Presence`), so the node follows the
presence topic of every peer its shard holds a record of, and no other (`follow`). A
step that may claim waits until the presences of the peers whose records came from a
snapshot were taken in (`current`): only such a record can be a dead node's, and a
subscription that no claim waits for costs no round trip (`claim_waits`). The
`presences` task (imexd.agent.presences) and the simulator carry it out.
"""

from __future__ import annotations

from imexd.membership.shard import ShardView
from imexd.topics import Topics


class Followed:
    """The presence topics of the peers we follow, and those whose retained copies the
    shard has taken in."""

    def __init__(self, topics: Topics, shard: ShardView) -> None:
        self.topics = topics
        self.shard = shard
        self.followed: set[str] = set()
        self.read: set[str] = set()
        self.synced_filters: frozenset[str] | None = frozenset()
        """The filters of the last `Synced` taken in (None: all)."""
        self._topics: dict[str, str] = {}

    def topics_of(self, nodes: frozenset[str]) -> set[str]:
        """The presence topics of `nodes` (each encoded once: asked at every step)."""
        known = self._topics
        for node in nodes - known.keys():
            known[node] = self.topics.presence(node)
        return {known[node] for node in nodes}

    def follow(self) -> tuple[list[str], list[str]]:
        """(dropped, new): the presence topics to unsubscribe and to subscribe, so that we
        follow the presence of every peer the shard holds a record of, and no other
        (`ShardView.followed`)."""
        wanted = self.topics_of(self.shard.followed())
        dropped = sorted(self.followed - wanted)
        self.read &= wanted
        new = sorted(wanted - self.followed)
        self.followed = wanted
        return dropped, new

    def taken(self, topics: list[str]) -> None:
        """The retained copies of `topics` were taken in (or given up on: waits are bounded)."""
        self.read |= set(topics)

    def current(self) -> bool:
        """Whether the presence of every peer whose record came from a snapshot was taken
        in (`ShardView.found`): a step that may claim waits for those, and for no other."""
        return self.topics_of(self.shard.found()) <= self.read

    def claim_waits(self, topics: list[str]) -> bool:
        """Whether a claim waits for the snapshot of these new presence topics: only one
        that may claim, and only for peers found in a snapshot (else no round trip)."""
        shard = self.shard
        return not shard.member and bool(set(topics) & self.topics_of(shard.found()))

    def synced_covers(self, topics: list[str]) -> bool:
        """Whether the last `Synced` taken in covers `topics`."""
        return self.synced_filters is None or self.synced_filters >= set(topics)
