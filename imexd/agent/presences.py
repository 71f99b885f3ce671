"""The `presences` task: the presence of every peer the shard holds a record of, followed.

A peer's Last Will is its presence (`messages.Presence`), so the agent follows the
presence topic of each peer its shard holds a record of, and no other
(`imexd.agent.followed.Followed.follow`): one SUBSCRIBE for the new ones, an UNSUBSCRIBE for the
gone ones. Off membership's path, so that a member steps on new records at once; a step
that may claim waits (`current`) until the presences of the peers whose records came from
a snapshot were taken in (`Followed.current`): only such a record can be a dead
node's, and a subscription that no claim waits for costs no round trip.
"""

from __future__ import annotations

import asyncio

from imexd.agent.core import NodeCore
from imexd.agent.pacer import until
from imexd.bus.link import Bus
from imexd.health.guard import Guard


class Presences:
    """The `presences` task and the wait of a step that may claim."""

    def __init__(self, core: NodeCore, guard: Guard) -> None:
        self.core = core
        self.guard = guard
        self.follow = asyncio.Event()
        """Wakes the task: the shard's records may have changed (set after every step)."""
        self.moved = asyncio.Event()
        """Set when presences were taken in (or given up on)."""
        self.synced = asyncio.Event()
        """Set when the events loop took in a `Synced` (the core noted its filters)."""

    async def run(self, bus: Bus) -> None:
        """Follow the presences the core names, each time a step may have moved them;
        records that came meanwhile are followed in turn."""
        limit = bus.timeout_s + bus.echo_timeout_s
        heartbeats = self.guard.heartbeats
        while True:
            heartbeats.beat("presences")
            with heartbeats.resting("presences"):
                await self.follow.wait()
            self.follow.clear()
            while True:
                dropped, new = self.core.presences.follow()
                for topic in dropped:
                    await bus.unsubscribe(topic)
                if not new:
                    break
                await self.guard.beating("presences", self._read(bus, new), limit=limit)
                self.core.presences.taken(new)  # or given up on: each wait is bounded
                self.moved.set()

    async def current(self, bus: Bus) -> None:
        """Until the core has the presences a claim waits for (at most a round trip and an
        echo timeout; a link that drops gives them with its snapshot)."""
        if self.core.presences.current():
            return
        self.follow.set()
        limit = bus.timeout_s + bus.echo_timeout_s
        wait = until(self.core.presences.current, self.moved, limit)
        await self.guard.beating("membership", wait, limit=limit)

    async def _read(self, bus: Bus, topics: list[str]) -> None:
        """Subscribe the presence `topics`; when a claim waits for them, until (at most
        `bus.echo_timeout_s` after the SUBSCRIBE) the `Synced` that covers them came."""
        if not self.core.presences.claim_waits(topics):
            await bus.subscribe(*topics, ordered=False, synced=False)
            return
        await bus.subscribe(*topics, ordered=False)
        await until(
            lambda: self.core.presences.synced_covers(topics), self.synced, bus.echo_timeout_s
        )
