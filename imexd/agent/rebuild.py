"""Giving a broker that lost its retained state back what the agent follows.

The broker is a cache the fleet can rebuild: every agent publishes its own records again
after each connect (`imexd.bus`), and this module keeps the control plane's records it
follows (its domain's spec, the domain's workloads, its own assignment) as the exact bytes
that last came, and decides after each connect whether to give them back. `Rebuild`
decides and is pure: events go in (`apply`), what to publish comes out (`take`);
`Rebuilder` feeds the agent's events through, logs, counts and publishes in the agent's
task `rebuild`. The rule to know: a missing record is no evidence, since it may have been
deleted while we were away; the retained broker epoch decides (`verdict`): under the same
epoch it was deleted, under another or none the broker lost it and it is restored, newest
generation only. The decision table and what never comes back:
docs/bus.md#rebuilding-an-empty-broker.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Protocol

import structlog

from imexd.bus.events import Connected, Disconnected, Event, Synced
from imexd.errors import BusError
from imexd.health.guard import Guard
from imexd.health.metrics import Metrics
from imexd.messages import (
    Assignment,
    BrokerEpoch,
    Deleted,
    DomainSpec,
    Payload,
    Received,
    WorkloadRecord,
    encode,
    now,
)
from imexd.topics import TopicRef, Topics

TASK: Final = "rebuild"
"""The agent task's name (and heartbeat)."""
EPOCH_JITTER_S: Final = 1.0
"""An agent that finds no epoch waits up to this long (uniform) before it writes one, and
writes none if another agent's came meanwhile: a fleet that reconnects at once writes a
few epochs, not one per node (each of which every node would receive)."""
PUBLISH_LIMIT_S: Final = 30.0
"""How long one round of restores may keep the task's heartbeat alive (each publish is
bounded by the MQTT client's own timeout)."""
ECHO_WAIT_S: Final = 5.0
"""How long a restored record may take to come back before it counts as refused (the
broker's ACL does not give agents the rebuild grants)."""


class Verdict(StrEnum):
    """What a new link's snapshot says about the broker's retained state."""

    KEPT = "kept"
    """The epoch of the previous link is there: what is missing was deleted."""
    LOST = "lost"
    """The epoch of the previous link is gone or replaced: what is missing was lost."""
    UNKNOWN = "unknown"
    """No epoch seen before, or a snapshot that may be partial: nothing to infer."""


def verdict(previous: str | None, found: str | None, *, complete: bool = True) -> Verdict:
    """The broker's state after a reconnect, from the epoch the previous link saw and the
    one in the new link's snapshot (None: none), on a link whose snapshot is `complete`."""
    if previous is None or not complete:
        return Verdict.UNKNOWN
    return Verdict.KEPT if found == previous else Verdict.LOST


@dataclass(frozen=True, slots=True)
class Held:
    """A record the agent follows, as it came: what it restores."""

    topic: str
    ref: TopicRef
    payload: Payload
    data: bytes

    @property
    def generation(self) -> int | None:
        """The control plane's generation (None: the record has none, an assignment)."""
        if isinstance(self.payload, DomainSpec | WorkloadRecord):
            return self.payload.generation
        return None

    def older_than(self, other: Held) -> bool:
        """Whether this record is an older generation of `other`'s topic."""
        mine, theirs = self.generation, other.generation
        return mine is not None and theirs is not None and mine < theirs

    def event(self) -> Received:
        """This record as if the snapshot had held it."""
        return Received(self.topic, self.ref, self.payload, retained=True, data=self.data)


def followed(event: Received, node: str) -> Held | None:
    """The record of `event` when it is one an agent keeps for a rebuild: a spec, an
    active workload, or this node's own assignment; else None."""
    payload, ref = event.payload, event.ref
    if not event.data:
        return None
    if (
        isinstance(payload, DomainSpec)
        or (isinstance(payload, WorkloadRecord) and payload.state == "active")
        or (isinstance(payload, Assignment) and ref.node == node)
    ):
        return Held(event.topic, ref, payload, event.data)
    return None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one new link's snapshot decided."""

    verdict: Verdict
    previous: str | None
    """The epoch the previous link saw."""
    found: str | None
    """The epoch in this link's snapshot."""
    restore: tuple[Held, ...] = ()
    """Records to publish again (LOST)."""
    gone: tuple[Held, ...] = ()
    """Records deleted while the link was down (KEPT): to take in as deletions."""
    write_epoch: bool = False
    """The snapshot holds no epoch: write a new one, after the restores."""


def decide(
    held: Mapping[str, Held],
    snapshot: Mapping[str, Held | None],
    *,
    previous: str | None,
    found: str | None,
    complete: bool = True,
) -> Outcome:
    """What to restore and what was deleted, from the records `held` before the link went
    and what the new link's `snapshot` holds on those topics (None or absent: nothing)."""
    said = verdict(previous, found, complete=complete)
    restore: list[Held] = []
    gone: list[Held] = []
    for topic, mine in sorted(held.items()):
        theirs = snapshot.get(topic)
        if said is Verdict.LOST and (theirs is None or theirs.older_than(mine)):
            restore.append(mine)
        elif said is Verdict.KEPT and theirs is None:
            gone.append(mine)
    return Outcome(
        verdict=said,
        previous=previous,
        found=found,
        restore=tuple(restore),
        gone=tuple(gone),
        write_epoch=complete and found is None,
    )


@dataclass(slots=True)
class Rebuild:
    """One agent's followed records and broker epoch, and what a new link must restore.

    `apply` every bus event (in order); at the first `Synced` of a link it returns the
    `Outcome`, whose records the agent takes in (`gone` as deletions, `restore` as if in
    the snapshot) before the `Synced` itself; `take` gives what to publish.
    """

    node: str
    new_epoch: Callable[[], str]
    held: dict[str, Held] = field(default_factory=dict)
    epoch: str | None = None
    """The broker's epoch as this agent last saw it (kept across link losses)."""
    pending: bool = False
    """A link came up and its snapshot is not judged yet."""
    complete: bool = False
    """The current link delivers whole snapshots (MQTT 5)."""
    snapshot: dict[str, Held | None] = field(default_factory=dict)
    found: str | None = None
    restored: dict[str, Held] = field(default_factory=dict)
    """Records restored on this link: one that comes back older is restored again."""
    due: list[Held] = field(default_factory=list)
    epoch_due: BrokerEpoch | None = None
    awaiting: dict[str, bytes] = field(default_factory=dict)
    """Published restores whose echo has not come back yet."""
    adopt: str | None = None
    """The epoch to take as ours once this link's restores came back: until then a lost
    link must find the broker still lost, or it would read our records as deleted."""

    def follow(self, domain: str | None) -> None:
        """Forget the records of domains the agent no longer follows: it would not see
        their deletion, so it must not restore them."""
        self.held = {
            topic: held
            for topic, held in self.held.items()
            if held.ref.kind == "assignment" or held.ref.domain == domain
        }

    def apply(self, event: Event, wall_s: float) -> Outcome | None:
        """Take one bus event in; the outcome at the first `Synced` of a link (`wall_s`:
        the wall-clock time, for a new epoch)."""
        if isinstance(event, Connected):
            self.pending, self.complete = True, event.protocol == "5"
            self.snapshot, self.found = {}, None
            self.restored.clear()
            self.due.clear()
            self.awaiting.clear()
            self.epoch_due = self.adopt = None
        elif isinstance(event, Disconnected):
            self.pending = False
        elif isinstance(event, Received):
            self._received(event)
        elif isinstance(event, Deleted):
            self._deleted(event)
        elif isinstance(event, Synced) and self.pending:
            return self._synced(wall_s)
        return None

    def _received(self, event: Received) -> None:
        if isinstance(event.payload, BrokerEpoch):
            if self.pending:
                self.found = event.payload.epoch
            else:
                self.adopt = event.payload.epoch  # a live change is no loss of ours
                self.epoch_due = None  # another agent wrote one first
                self._settle()
            return
        if self.awaiting.get(event.topic) == event.data:
            del self.awaiting[event.topic]
            self._settle()
        record = followed(event, self.node)
        if self.pending:
            if record is not None or event.topic in self.held:
                self.snapshot[event.topic] = record
            return
        mine = self.restored.get(event.topic)
        if record is not None and mine is not None and record.older_than(mine):
            self.due.append(mine)  # several agents restore: the newest generation wins
            return
        if record is None:
            self.held.pop(event.topic, None)
        else:
            self.held[event.topic] = record

    def _deleted(self, event: Deleted) -> None:
        if event.ref.kind == "epoch":
            if self.pending:
                self.found = None
            return
        # A deletion seen is a deletion: it never comes back.
        self.held.pop(event.topic, None)
        self.restored.pop(event.topic, None)
        if self.pending:
            self.snapshot[event.topic] = None

    def _settle(self) -> None:
        """Take the epoch to adopt as ours once nothing restored is still on its way."""
        if self.adopt is not None and not self.awaiting and not self.due:
            self.epoch, self.adopt = self.adopt, None

    def _synced(self, wall_s: float) -> Outcome:
        self.pending = False
        outcome = decide(
            self.held,
            self.snapshot,
            previous=self.epoch,
            found=self.found,
            complete=self.complete,
        )
        for held in outcome.gone:
            self.held.pop(held.topic, None)
        kept = {h.topic for h in outcome.restore}
        for topic, theirs in self.snapshot.items():
            if topic in kept:
                continue
            if theirs is None:
                self.held.pop(topic, None)
            else:
                self.held[topic] = theirs
        self.snapshot = {}
        self.restored = {h.topic: h for h in outcome.restore}
        self.due = list(outcome.restore)
        if outcome.write_epoch:
            # Adopted when it comes back, after the restores (published first).
            self.epoch_due = BrokerEpoch(epoch=self.new_epoch(), node=self.node, at=wall_s)
        elif outcome.found is not None:
            self.adopt = outcome.found
            self._settle()
        return outcome

    def take(self) -> list[Held]:
        """The records to restore now (publish them before the epoch)."""
        due, self.due = self.due, []
        for held in due:
            self.awaiting[held.topic] = held.data
        return due

    def take_epoch(self) -> BrokerEpoch | None:
        """The new epoch to write now, unless another agent's came first."""
        epoch, self.epoch_due = self.epoch_due, None
        return epoch


class Publisher(Protocol):
    """The part of `imexd.bus.link.Bus` the rebuilder uses."""

    async def put_retained(self, topic: str, data: bytes) -> None: ...


class Rebuilder:
    """The agent's side of the rebuild: `on_event` for every bus event, `run` as a task."""

    def __init__(
        self,
        node: str,
        topics: Topics,
        *,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.state = Rebuild(node=node, new_epoch=lambda: secrets.token_hex(8))
        self.rand = rand
        self.topics = topics
        self.metrics = metrics
        self.log = log
        self.wake = asyncio.Event()

    def follow(self, domain: str | None) -> None:
        """The agent follows `domain` now (see `Rebuild.follow`)."""
        self.state.follow(domain)

    def on_event(self, event: Event) -> list[Event]:
        """Take one bus event in; at a link's first snapshot, the deletions and restores
        it decided, for the agent to take in as part of that snapshot."""
        state = self.state
        outcome = state.apply(event, now())
        if state.due or state.epoch_due:
            self.wake.set()
        if outcome is None:
            return []
        if outcome.verdict is Verdict.LOST:
            self.metrics.count_rebuild()
            self.log.warning(
                "rebuild.broker_lost_state",
                epoch_was=outcome.previous,
                epoch_found=outcome.found,
                restoring=[h.topic for h in outcome.restore],
            )
        if outcome.gone:
            self.log.info("rebuild.deleted_while_away", topics=[h.topic for h in outcome.gone])
        gone: list[Event] = [Deleted(h.topic, h.ref, retained=True) for h in outcome.gone]
        return gone + [h.event() for h in outcome.restore]

    async def run(self, bus: Publisher, guard: Guard) -> None:
        """The agent's `rebuild` task: publish the restores, then the new epoch; say which
        restores never came back (an ACL without the agents' rebuild grants)."""
        check_at: float | None = None
        while True:
            guard.heartbeats.beat(TASK)
            await guard.rest(TASK, self.wake, check_at)
            self.wake.clear()
            if check_at is not None and time.monotonic() >= check_at:
                check_at = None
                self._check_echoes()
            if due := self.state.take():
                check_at = time.monotonic() + ECHO_WAIT_S
            if due or self.state.epoch_due is not None:
                await guard.beating(TASK, self._publish(bus, due), limit=PUBLISH_LIMIT_S)

    async def _publish(self, bus: Publisher, due: list[Held]) -> None:
        """The restores, then (after a jittered wait) the new epoch if none came meanwhile."""
        try:
            for held in due:
                await bus.put_retained(held.topic, held.data)
                self.metrics.count_restored(held.ref.kind)
                self.log.info("rebuild.restored", topic=held.topic, generation=held.generation)
            if self.state.epoch_due is not None:
                await asyncio.sleep(EPOCH_JITTER_S * self.rand())
                if (epoch := self.state.take_epoch()) is not None:
                    await bus.put_retained(self.topics.epoch(), encode(epoch))
                    self.log.info("rebuild.epoch_written", epoch=epoch.epoch)
        except BusError as exc:
            # The link went: the next one judges its own snapshot again.
            self.log.warning("rebuild.publish_failed", error=str(exc))

    def _check_echoes(self) -> None:
        if missing := sorted(self.state.awaiting):
            self.metrics.count_unconfirmed_restores(len(missing))
            self.log.warning(
                "rebuild.unconfirmed",
                topics=missing,
                why="the broker did not give these restored records back: its ACL may not "
                "grant agents the rebuild (docs/security.md)",
            )
