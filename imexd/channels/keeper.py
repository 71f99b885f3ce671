"""The agent's side of IMEX channels: keep this node's channel devices in step with the bus.

The control plane writes a `WorkloadRecord` per workload of a domain; `ChannelKeeper`
follows the workloads of the node's domain (its own subscription on the agent's bus),
and its task `channels` makes what `imexd.channels.devices.plan` says the node should
have: device nodes, CDI specs and env files (`imexd.channels.devices.Devices`, in a
worker thread). It keeps `ChannelFacts` for health, metrics and the HealthReport.

When it removes, and when not:

- nothing before a synced view of the workloads (the bus's snapshot of the workloads
  filter after the last subscription change, or after a reconnect); a node with no
  domain has a synced view at once (no workloads): stale channel nodes left from before
  the agent started go then (CVE-2024-42511);
- a workload deleted (its tombstone, state `deleted`), the node dropped from its `nodes`,
  the domain's spec `deleting` or `deleted`, or the domain left: its device node, CDI spec
  and env file go at the next apply. A record missing from a snapshot is not a deletion:
  the agent's anti-entropy pass (imexd.agent.rebuild) hands the keeper the newest version
  it holds and gives it back to the broker;
- a channel that two active records of the domain claim: the one that held it first
  keeps it (`imexd.channels.devices.channel_holders`: the order the records came in, and
  at start the devices on disk), the other gets no device on any node;
- the node leaving (SIGTERM): `clear()` removes everything of ours; a hand-over (SIGUSR2)
  keeps everything, for the next agent;
- `[channels] manage = false`: the keeper makes and removes nothing and only reads the
  driver;
- `[channels] simulate = true` (no GPU): a channel made is ready with the reason
  Simulated, and its message says whether the node is a stand-in file.

Failed operations (MknodFailed, CdiWriteFailed, EnvWriteFailed) are retried with the
common backoff; every CHECK_S the driver is read again and the devices are applied anew,
which repairs what someone else removed or changed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Final, Protocol

import structlog

from imexd.bus.events import Connected, ConnectFailed, Disconnected, Event, SubscribeRefused, Synced
from imexd.channels.devices import (
    SIMULATED,
    Applied,
    Devices,
    Driver,
    Refusal,
    Want,
    channel_holders,
    plan,
    read_driver,
)
from imexd.facts import ChannelFacts, ChannelState
from imexd.health.guard import Guard, describe
from imexd.logs import get_logger
from imexd.messages import Deleted, DomainSpec, MemberRecord, Received, WorkloadRecord
from imexd.retry import backoff_delay
from imexd.settings import ChannelsSettings, Settings
from imexd.topics import Topics

TASK: Final = "channels"
"""The agent task's name (and heartbeat)."""
CHECK_S: Final = 10.0
"""Seconds between two reads of the driver and fresh applies when nothing else happens."""
RETRY_INITIAL_S: Final = 0.5
RETRY_MAX_S: Final = 30.0
"""Backoff of a retried apply after a failed mknod, chown, chmod or file write."""
APPLY_LIMIT_S: Final = 30.0
"""How long one apply may keep the task's heartbeat alive: a filesystem that hangs longer
shows as a wedged task in /healthz."""
NOT_MANAGED: Final = "NotManaged"

_UNREAD: Final = Driver(major=None, count=None, channel0=None, error="not read yet")


class Subscriptions(Protocol):
    """The part of `imexd.bus.link.Bus` the keeper uses: its own topic filter."""

    async def subscribe(self, topic_filter: str, /) -> None: ...

    async def unsubscribe(self, topic_filter: str) -> None: ...


class ChannelKeeper:
    """The workloads of the node's domain, and the channel devices made for them."""

    def __init__(
        self,
        settings: ChannelsSettings,
        *,
        node: str,
        topics: Topics,
        log: structlog.typing.FilteringBoundLogger,
        on_change: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.node = node
        self.topics = topics
        self.log = log
        self.on_change = on_change
        """Called when the keeper moved the facts itself (followed a domain, applied, saw
        the driver, judged the channels): the agent's report judges them at once."""
        self.devices = Devices(settings)

        # The view of the workloads.
        self.told = False
        """The agent said which domain the node is in (before that, nothing is done)."""
        self.domain: str | None = None
        self.clique: str | None = None
        self.records: dict[str, WorkloadRecord] = {}
        """The domain's workload records by name, as the bus delivered them."""
        self.deleting = False
        """The domain's spec says `deleting`: its channels go, whatever records are left
        (the agent reads the spec of the domain it is in; the keeper only looks)."""
        self.synced = False
        """`records` is the broker's whole set (or there is no domain): removals allowed."""
        self.sync_after = 0.0
        """time.monotonic() of the last subscription change: only a later Synced counts."""
        self.shown = False
        """`states` follow a synced view of the current domain (else health says Pending)."""

        # What the last apply did.
        self.driver = _UNREAD
        self.driver_logged = False
        self.held: dict[int, str] = {}
        """Channel -> the workload that holds it in the domain (`devices.channel_holders`):
        sticky in a conflict, on every node, whatever the node lists."""
        self.seeded = False
        """`held` was read from the devices on disk: done once, before the first plan, so
        that a conflict resolved before a restart is resolved the same way after it."""
        self.states: tuple[ChannelState, ...] = ()
        self.channel0_open = False
        self.operations: Counter[tuple[str, str]] = Counter()
        self.wake = asyncio.Event()
        self.retry_at: float | None = None
        self.attempt = 0

        self._io = threading.Lock()
        """Held by every filesystem call, which runs in a worker thread: a leave's clear
        never interleaves with an apply still running after its task was cancelled."""
        self._closed = False
        """Set by `clear()` (under `_io`): no apply runs after a leave."""

    @classmethod
    def from_settings(cls, settings: Settings, *, on_change: Callable[[], None]) -> ChannelKeeper:
        """The keeper of the agent configured by `settings`, with the driver read once
        (two small /proc files), so that the agent's first member record has the count."""
        node = settings.node.name
        keeper = cls(
            settings.channels,
            node=node,
            topics=Topics(settings.bus.topic_prefix),
            log=get_logger("channels", node=node),
            on_change=on_change,
        )
        keeper.driver = read_driver(settings.channels)
        return keeper

    # -- inputs ---------------------------------------------------------------------

    async def follow(self, bus: Subscriptions, domain: str | None, clique: str | None) -> None:
        """Follow the node's domain and clique as the agent wants them now.

        A new domain is a new subscription: its records count once its snapshot is in. No
        domain means no workloads: everything of ours goes at the next apply. A clique of
        None (discovery pending) holds the devices as they are.
        """
        if self.told and domain == self.domain:
            if clique != self.clique:
                self.clique = clique
                self._changed()
            return
        old = self.domain if self.told else None
        self.told = True
        self.domain, self.clique = domain, clique
        self.records.clear()
        if old is not None:
            self.held = {}  # another domain's channels: its devices go at the next apply
        self.deleting = False
        self.states, self.shown = (), False
        self.retry_at, self.attempt = None, 0
        if domain is None:
            self.synced = True
        else:
            # Only a snapshot completed after this point covers the new subscription.
            self.synced = False
            self.sync_after = time.monotonic()
        self.log.info("channels.follow", domain=domain, previous=old)
        self._changed()
        if old is not None:
            await bus.unsubscribe(self.topics.workloads_filter(old))
        if domain is not None:
            await bus.subscribe(self.topics.workloads_filter(domain))

    def on_event(self, event: Event) -> None:
        """Take one bus event in (every event the agent reads; others are ignored).

        Only the task wakes: the agent judges its facts after every bus event anyway, and
        `on_change` is for what the task did (news a `workload create --wait` waits for).
        """
        if isinstance(event, Received | Deleted):
            ref = event.ref
            if not self.told or ref.domain != self.domain:
                return
            if ref.kind == "spec":
                payload = event.payload if isinstance(event, Received) else None
                deleting = isinstance(payload, DomainSpec) and payload.state != "active"
                if deleting != self.deleting:
                    self.deleting = deleting
                    self.log.info("channels.domain_deleting", domain=ref.domain, now=deleting)
                    self.wake.set()
                return
            if ref.kind != "workload":
                return
            if isinstance(event, Deleted):
                self.records.pop(ref.workload, None)
            elif isinstance(event.payload, WorkloadRecord):
                self.records[ref.workload] = event.payload
            self.wake.set()
        elif self.domain is None:
            return  # no domain: the view is empty and stays synced whatever the link does
        elif isinstance(event, Connected | Disconnected | ConnectFailed | SubscribeRefused):
            self.synced = False
        elif isinstance(event, Synced) and event.at >= self.sync_after and self._covers(event):
            self.synced = True
            self.wake.set()

    def _covers(self, event: Synced) -> bool:
        """Whether `event` proves our workloads filter's snapshot (a Synced that does not
        say which filters it covers counts, as before)."""
        assert self.domain is not None  # noqa: S101 - on_event checked it
        wanted = self.topics.workloads_filter(self.domain)
        return event.filters is None or wanted in event.filters

    def _changed(self) -> None:
        self.wake.set()
        self.on_change()

    # -- the task -------------------------------------------------------------------

    async def run(self, guard: Guard) -> None:
        """The agent's `channels` task: apply on every change, every CHECK_S, and on retry."""
        next_check = 0.0
        while True:
            guard.heartbeats.beat(TASK)
            due = next_check if self.retry_at is None else min(next_check, self.retry_at)
            await guard.rest(TASK, self.wake, due)
            now = time.monotonic()
            if not self.wake.is_set() and now < due:
                continue
            self.wake.clear()
            next_check = now + CHECK_S
            await guard.beating(TASK, self.step(), limit=APPLY_LIMIT_S)

    async def step(self) -> None:
        """Read the driver, plan, and apply what the current view allows."""
        driver = await asyncio.to_thread(read_driver, self.settings)
        if driver != self.driver or not self.driver_logged:
            self.driver_logged = True
            self.log.info(
                "channels.driver",
                major=driver.major,
                count=driver.count,
                channel0=driver.channel0,
                error=driver.error or None,
            )
            self.driver = driver
            self.on_change()
        if not self.settings.manage:
            self._show_unmanaged()
            return
        if not self.told or not self.synced:
            return  # nothing is removed before a synced view
        if self.domain is None or self.deleting:
            wants: dict[int, Want] = {}
            refusals: list[Refusal] = []
        elif self.clique is None:
            return  # the clique is not known yet: keep what is there
        else:
            if not self.seeded:
                self.held = await asyncio.to_thread(self._held_on_disk, driver.major)
                self.seeded = True
                if self.held:
                    self.log.info("channels.held_on_disk", held=self.held)
            self.held = channel_holders(self.records.values(), domain=self.domain, before=self.held)
            wants, refusals = plan(
                self.records.values(),
                node=self.node,
                domain=self.domain,
                clique=self.clique,
                driver=driver,
                held=self.held,
            )
        domain = self.domain
        try:
            applied = await asyncio.to_thread(self._apply, wants, driver.major)
        except Exception as exc:
            # A bug or an unexpected error: nothing half-made stays wrong for longer
            # than the retry; say so once per attempt, with the traceback.
            self._schedule_retry()
            self.log.error("channels.apply_failed", error=describe(exc), exc_info=exc)
            return
        if applied is None or domain != self.domain:
            return  # left meanwhile: a later step applies the new view
        self._take(applied, refusals)

    def _held_on_disk(self, major: int | None) -> dict[int, str]:
        with self._io:
            return self.devices.held_on_disk(major)

    def _apply(self, wants: Mapping[int, Want], major: int | None) -> Applied | None:
        with self._io:
            if self._closed:
                return None
            return self.devices.apply(wants, major=major)

    def _take(self, applied: Applied, refusals: list[Refusal]) -> None:
        """Keep what an apply did: states, counters; retry failures."""
        self.operations.update(applied.ops)
        self.channel0_open = applied.channel0_open
        states = _states(applied, refusals, simulate=self.settings.simulate)
        if states != self.states:
            self._log_states(states)
        self.states, self.shown = states, True
        for problem in applied.problems:
            self.log.warning("channels.stale_entry_kept", problem=problem)
        if applied.failures:
            delay = self._schedule_retry()
            self.log.warning(
                "channels.retry",
                failed=[f.workload for f in applied.failures],
                retry_in_s=round(delay, 2),
            )
        else:
            self.retry_at, self.attempt = None, 0
        self.on_change()

    def _schedule_retry(self) -> float:
        delay = backoff_delay(self.attempt, RETRY_INITIAL_S, RETRY_MAX_S)
        self.attempt += 1
        self.retry_at = time.monotonic() + delay
        return delay

    def _log_states(self, states: tuple[ChannelState, ...]) -> None:
        before = {s.workload: s for s in self.states}
        for state in states:
            if before.get(state.workload) == state:
                continue
            if state.ready:
                self.log.info(
                    "channels.ready",
                    workload=state.workload,
                    channel=state.channel,
                    generation=state.generation,
                    simulated=state.message or None,
                )
            else:
                self.log.warning(
                    "channels.not_ready",
                    workload=state.workload,
                    channel=state.channel,
                    reason=state.reason,
                    message=state.message,
                )
        gone = sorted(set(before) - {s.workload for s in states})
        if gone:
            self.log.info("channels.removed", workloads=gone)

    def _show_unmanaged(self) -> None:
        """manage = false: list the node's workloads, make nothing."""
        listed = (
            _listed(self.records.values(), self.node, self.domain)
            if self.domain is not None
            else []
        )
        states = tuple(
            ChannelState(
                workload=r.workload,
                channel=r.channel,
                generation=r.generation,
                reason=NOT_MANAGED,
                message="[channels] manage = false: another tool makes the device",
            )
            for r in listed
        )
        if (states, self.synced) != (self.states, self.shown):
            self.states, self.shown = states, self.synced
            self.on_change()

    async def clear(self) -> None:
        """The node leaves: remove every channel node, CDI spec and env file of ours.

        Never raises: a leave must go on (what could not be removed is logged).
        """
        if not self.settings.manage:
            return
        try:
            applied = await asyncio.to_thread(self._clear)
        except Exception as exc:
            self.log.error("channels.clear_failed", error=describe(exc), exc_info=exc)
            return
        self.operations.update(applied.ops)
        removed = applied.ops.get(("remove", "ok"), 0)
        self.log.info("channels.cleared", removed=removed, problems=applied.problems or None)
        self.states, self.held = (), {}

    def _clear(self) -> Applied:
        with self._io:
            self._closed = True
            return self.devices.clear()

    # -- facts ----------------------------------------------------------------------

    @property
    def count(self) -> int | None:
        """The driver's ImexChannelCount as last read (for our member record)."""
        return self.driver.count

    def facts(self, members: Iterable[MemberRecord]) -> ChannelFacts:
        """The channel facts as of now; `members`: the shard's member records."""
        count = self.driver.count
        mismatch = tuple(
            sorted(
                (r.node, r.channel_count)
                for r in members
                if r.node != self.node
                and r.channel_count is not None
                and count is not None
                and r.channel_count != count
            )
        )
        return ChannelFacts(
            managed=self.settings.manage,
            synced=self.shown or (self.told and self.domain is None),
            count=count,
            major=self.driver.major,
            driver_error=self.driver.error,
            workloads=self.states,
            channel0_open=self.channel0_open,
            mismatch=mismatch,
            operations=MappingProxyType(dict(self.operations)),
        )


def _simulated(channel: int, *, standin: bool) -> str:
    if standin:
        return (
            f"channel{channel} is a stand-in file, not a device: [channels] simulate, and "
            "the agent may not mknod"
        )
    return f"channel{channel} is a device node of a simulated driver: [channels] simulate"


def _listed(records: Iterable[WorkloadRecord], node: str, domain: str) -> list[WorkloadRecord]:
    """The active records of `domain` that list `node`, by name."""
    return sorted(
        (r for r in records if r.state == "active" and r.domain == domain and r.lists(node)),
        key=lambda r: r.workload,
    )


def _states(
    applied: Applied, refusals: Iterable[Refusal], *, simulate: bool
) -> tuple[ChannelState, ...]:
    """Every listed workload's state after an apply, by name: made, or why not. With a
    simulated driver a made channel is ready with the reason Simulated, which says
    whether its node is a stand-in file."""
    out = {
        name: ChannelState(
            workload=name,
            channel=want.channel,
            generation=want.generation,
            ready=True,
            reason=SIMULATED if simulate else "",
            message=_simulated(want.channel, standin=name in applied.standins) if simulate else "",
        )
        for name, want in applied.made.items()
    }
    for refusal in [*refusals, *applied.failures]:
        out[refusal.workload] = ChannelState(
            workload=refusal.workload,
            channel=refusal.channel,
            generation=refusal.generation,
            reason=refusal.reason,
            message=refusal.message,
        )
    return tuple(out[name] for name in sorted(out))
