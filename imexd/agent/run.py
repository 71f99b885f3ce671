"""The agent: one root coroutine that keeps this node's IMEX daemon in its domain.

`run(settings, stop=..., handover=...)` wires the pieces together and owns their
lifecycle; what it decides lives elsewhere: the shard view (imexd.membership.shard)
judges the records of our (domain, clique), the reconciler (imexd.agent.reconcile)
writes the files and drives the supervisor, fleet and health (imexd.health.fleet,
imexd.health.conditions) judge the facts, and imexd.health.guard contains the failures
of each task. Named long-lived tasks, each with a heartbeat that /healthz watches:

- `events`: reads the bus (our shard's records, the domain's spec, our assignment and
  retry requests, link state) into the shard view and wakes `membership` once for all
  that was queued;
- `membership`: follows the target (domain, clique), steps the shard view, publishes
  our record, and sets what should run (`Desired`);
- `reconcile`: applies the first change after a quiet period at once and coalesces what
  follows within `[domain] settle_s`, writes the files and asks the supervisor for
  exactly what the change needs (start, SIGUSR1, restart, or nothing), and passes on
  an operator's `imexd node retry`;
- `probe`: a start is RUNNING at the daemon's READY (its own line, or `ctl -q`); `ctl
  -q` and `ctl -N -j` after every start and delivered SIGUSR1, then periodically
  (imexd.agent.probes);
- `report`: turns the facts into conditions (in a burst of changes once per
  `health.REPORT_PACE_S`, the first at once; the daemon's, its probes' and the channels'
  news at once), publishes the HealthReport, tells systemd;
- `channels`: the channel devices of the domain's workloads (imexd.channels.keeper);
- `rebuild`: holds the newest spec, workloads, assignment and retry request this node
  follows, passes on only newer ones, and gives the broker back what it serves older or
  not at all (imexd.agent.rebuild);
- `discover`: NVML fabric discovery when `[node] clique = "auto"`;
- `watchdog`: WATCHDOG=1 to systemd while no task is wedged.

Signals are handled in the CLI layer only: SIGTERM/SIGINT set `stop` (leave: clear our
record, stop the daemon, exit 0), SIGUSR2 sets `handover` too (exit 75 with the daemon
running and the record in place, for the next agent to adopt).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Final

from imexd.agent.pacer import Pacer
from imexd.agent.probes import DaemonProbes
from imexd.agent.rebuild import Rebuilder
from imexd.agent.reconcile import Reconciler
from imexd.agent.statefile import RecordFile, StateStore
from imexd.bus.events import Event, Synced, WillSpec
from imexd.bus.link import Bus
from imexd.channels.keeper import ChannelKeeper
from imexd.daemon.ctl import Prober
from imexd.daemon.state import PROBLEMS as DAEMON_PROBLEMS
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.daemon.supervisor import Supervisor
from imexd.errors import DiscoveryError, FileWriteError
from imexd.fabric import discover
from imexd.facts import BusFacts, DaemonFacts, FabricFacts, Facts
from imexd.files import remove_stale_temps
from imexd.health.conditions import REPORT_PACE_S, Health, Heartbeats, ReportSchedule
from imexd.health.guard import BEAT_S, Guard, describe
from imexd.health.http import HealthServer
from imexd.health.metrics import Metrics
from imexd.health.sdnotify import Notifier
from imexd.logs import get_logger
from imexd.membership import slots as mb
from imexd.membership.desired import Desired
from imexd.membership.shard import Identity, Plan, ShardView
from imexd.messages import (
    Assignment,
    Deleted,
    HealthReport,
    MemberRecord,
    Presence,
    Received,
    Retry,
)
from imexd.messages import now as wire_now
from imexd.names import client_id
from imexd.nodestate import NodeState
from imexd.retry import backoff_delay
from imexd.settings import SHUTDOWN_MARGIN_S, Settings, node_address_problem
from imexd.signing import load_verifier
from imexd.topics import Topics

EXIT_HANDOVER: Final = 75
"""Exit status after a SIGUSR2 hand-over: the unit restarts the agent (EX_TEMPFAIL)."""
DISCOVERY_TIMEOUT_S: Final = 20.0
LOCAL_RETRY_S: Final = (0.5, 30.0)
"""(first, longest) wait before a failed local action is tried again: a reconcile round
(a file that cannot be written) and an NVML discovery (at most `[node]
discover_interval_s`). It doubles after each failure, jittered (`imexd.retry`), so a
fault that clears is soon noticed and one that stays costs little."""
UNSUPERVISED: Final = "Unsupervised"
"""DaemonReady's reason for such a daemon."""


def _report(event: Event) -> bool:
    """Whether `event` is about a health report, which the agent follows only so that the
    bus puts back a copy of its own someone else wrote (`Bus`), and to clear its own
    report in a domain it left (`Agent._note_stale_own`): only the latter wakes membership."""
    ref = getattr(event, "ref", None)
    return ref is not None and ref.kind == "health"


async def _until(holds: Callable[[], bool], moved: asyncio.Event, limit: float) -> None:
    """Wait until `holds()`, looking again each time `moved` is set, at most `limit`
    seconds (then go on regardless: what it waits for is bounded, not required)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            while not holds():
                moved.clear()
                await moved.wait()


class Agent:
    """The agent's state and tasks; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.node = settings.node.name
        self.topics = Topics(settings.bus.topic_prefix)
        self.log = get_logger("agent", node=self.node)
        self.state_store = StateStore(settings.node.state_dir)
        self.saved = NodeState()
        self.heartbeats = Heartbeats()
        self.metrics = Metrics()
        self.guard = Guard(self.heartbeats, self.metrics, self.log)
        self.notifier = Notifier.from_env()
        self.health = Health(Facts(node=self.node, address=settings.node.address))
        self.bus: Bus | None = None
        self.supervisor: Supervisor | None = None

        # Inputs of the target (domain, clique).
        self.static_domain = settings.domain.name or None
        self.assigned_domain: str | None = None
        configured = settings.node.clique
        self.clique: str | None = None if configured == "auto" else configured
        self.driver = ""
        self.fabric = FabricFacts(source="nvml" if configured == "auto" else "config")

        # Membership of the current (domain, clique) shard.
        self.shard = ShardView.from_settings(settings, self.log)
        self.view_ready = asyncio.Event()
        """Set once membership stepped on the current synced snapshot, cleared when the
        link goes: only then does `desired` say what the broker says."""
        self.released_until = 0.0
        """time.monotonic() until which our slot stays given up (FATAL daemon)."""
        self.started_at = wire_now()
        """Wall-clock start: an `imexd node retry` request written before it is a leftover."""
        self.retry_last: Retry | None = None
        """The last request taken in. A request is new when it differs from this one, not
        when its `at` is larger: a request dated in the future blocks no later one."""
        self.retry_asked: Retry | None = None
        self.stale_own: set[str] = set()
        """Topics of records of this node that a broker serves outside its shard."""
        self.presences: set[str] = set()
        """The presence topics of the peers we follow (`_follow_presences`)."""
        self.presences_read: set[str] = set()
        """Those of them whose retained copies the shard has taken in."""
        self.presences_moved = asyncio.Event()
        self.follow = asyncio.Event()
        """Wakes the presences task: the shard's records may have changed."""
        self.synced_filters: frozenset[str] | None = frozenset()
        """The filters of the last `Synced` the events loop took in (None: all)."""
        self.synced_seen = asyncio.Event()
        self.wake = asyncio.Event()
        """Wakes membership: set once per batch of bus events (`_events_loop`), and by the
        daemon's state, discovery and an operator's retry."""

        # Reconcile state.
        self.desired = Desired()
        self.desired_at = 0.0
        """time.monotonic() when `desired` last changed (`_reconcile_loop`)."""
        self.dirty = asyncio.Event()
        self.reconciler: Reconciler | None = None

        # Reports.
        self.presence_said: tuple[int, str | None] | None = None
        self.presence_due = 0.0
        """Wall-clock time of the next presence record (also sent when `presence_said` moves)."""
        self.unsupervised: int | None = None
        """The pid of a daemon running our config that this agent does not supervise,
        while it stands aside (`_survey_unsupervised`): reported as it is."""
        self.surveyed_at = -math.inf
        """time.monotonic() of the last survey (-inf: none since this agent last claimed)."""
        self.survey_due: float | None = None
        """time.monotonic() of the next survey while this agent stands aside (None: it
        does not)."""
        self.daemon_seen: tuple[DaemonState, int] = (DaemonState.STOPPED, 0)
        """(state, reloads_sent) of the last daemon snapshot: a start or a signal is news."""
        self.changed = asyncio.Event()
        """The facts may have moved: the report loop judges them again (paced)."""
        self.urgent = asyncio.Event()
        """What moved is news a job waits for (`_news`): judged at once, never paced."""
        self.probes = DaemonProbes(
            settings,
            Prober.from_settings(settings),
            metrics=self.metrics,
            log=self.log,
            on_change=self._news,
        )
        self.report_pace = Pacer(REPORT_PACE_S)
        self.report_lock = asyncio.Lock()
        """Held while a report is published or our records cleared: no report after a clear."""
        self.bus_facts = BusFacts()
        self.channels = ChannelKeeper.from_settings(settings, on_change=self._news)
        self.rebuild = Rebuilder(
            self.node,
            self.topics,
            metrics=self.metrics,
            log=self.log,
            store=RecordFile(settings.node.state_dir),
            expiry_s=settings.control.tombstone_expiry_s,
            period_s=settings.control.anti_entropy_s,
        )

    # -- lifecycle ------------------------------------------------------------------

    async def run(self, *, stop: asyncio.Event, handover: asyncio.Event) -> int:
        """Run until `stop`; leave (0) or hand over (EXIT_HANDOVER) when it is set."""
        s = self.settings
        async with contextlib.AsyncExitStack() as stack:
            # First, before a line is logged or a file touched: a taken health port ends
            # the agent with that one line (FatalError), not after a start it never made.
            await stack.enter_async_context(
                HealthServer(
                    s.health.listen,
                    heartbeats=self.heartbeats,
                    health=self.health,
                    metrics=self.metrics,
                )
            )
            bus, supervisor = self._start()
            guard = self.guard
            await stack.enter_async_context(supervisor)
            # What is known at start is subscribed before the first connect, so that it
            # rides on that connect's one SUBSCRIBE and one snapshot round trip.
            # None of them is judged by its order among others (`Bus.subscribe`).
            if s.domain.assigned:
                await bus.subscribe(self.topics.assignment(self.node), ordered=False)
            # Our own presence: our will lands there, and a new link's snapshot that shows
            # it fired ends the record we would otherwise resume (`ShardView`).
            await bus.subscribe(self.topics.presence(self.node), ordered=False)
            if self._target() is not None:
                await self._retarget()
            await stack.enter_async_context(bus)
            self.notifier.ready()
            failed = False
            try:
                async with asyncio.TaskGroup() as tasks:
                    running = [
                        guard.start(tasks, "events", lambda: self._events_loop(bus)),
                        guard.start(tasks, "membership", self._membership_loop),
                        guard.start(tasks, "presences", lambda: self._presences_loop(bus)),
                        guard.start(tasks, "reconcile", self._reconcile_loop),
                        guard.start(tasks, "probe", self._probe_loop),  # imexd.agent.probes
                        guard.start(tasks, "report", self._report_loop),
                        guard.start(tasks, "channels", lambda: self.channels.run(guard)),
                        guard.start(tasks, "rebuild", lambda: self.rebuild.run(bus, guard)),
                        guard.start(tasks, "watchdog", self._watchdog_loop),
                    ]
                    if s.node.clique == "auto":
                        running.append(guard.start(tasks, "discover", self._discover_loop))
                    await _first_of(stop, guard.give_up)
                    for task in running:
                        task.cancel()
            except Exception as exc:
                failed = True
                self.log.error("agent.failed", error=describe(exc), exc_info=exc)
            finally:
                self.notifier.stopping()
            # A bug (or a task failing again and again) ends the agent like a hand-over:
            # the daemon keeps running and our record stays, for the next agent to adopt.
            keep_imex = handover.is_set() or failed or guard.give_up.is_set()
            code = await self._shutdown(handover=keep_imex)
        self.log.info("agent.exit", code=code)
        return code

    def _start(self) -> tuple[Bus, Supervisor]:
        """Say the agent starts (and what it was), and build its bus and supervisor."""
        s = self.settings
        remove_stale_temps(s.config_path)
        remove_stale_temps(s.nodes_config_path)
        remove_stale_temps(s.imex.hosts_file)
        self.saved = self._load_state()
        self.shard.start(self.saved.incarnation)
        self.log.info(
            "agent.start",
            incarnation=self.shard.incarnation,
            previous_domain=self.saved.domain,
            previous_slot=self.saved.slot,
            mode="assigned" if s.domain.assigned else "static",
        )
        if os.geteuid() != 0:
            self.log.info("agent.unprivileged", uid=os.geteuid())
        if (why := node_address_problem(s.node)) is not None:
            self.log.warning("agent.address_not_local", address=s.node.address, error=why)
        verifier = load_verifier(s.control.public_key) if s.control.public_key else None
        bus = Bus(
            s.bus,
            node=self.node,
            client_id=self._client_id,
            will=self._will(),
            verifier=verifier,
        )
        bus.on_counted = self.changed.set  # the bus facts' counters moved (report loop)
        supervisor = Supervisor.from_settings(s, on_change=self._on_daemon_change)
        self.bus, self.supervisor = bus, supervisor
        self.reconciler = Reconciler(
            s, supervisor, metrics=self.metrics, log=self.log, current=lambda: self.desired
        )
        return bus, supervisor

    async def _shutdown(self, *, handover: bool) -> int:
        """Leave or hand over, bounded by stop_timeout_s + a margin."""
        bus, supervisor = self._parts()
        shard = self.shard
        budget = self.settings.daemon.stop_timeout_s + SHUTDOWN_MARGIN_S
        try:
            async with asyncio.timeout(budget):
                if handover:
                    self.log.info("agent.handover", pid=supervisor.pid)
                    supervisor.detach()
                    return EXIT_HANDOVER
                self.log.info("agent.leave", domain=shard.current)
                await self._say_stopped(bus)
                if shard.current is not None and shard.published:
                    # Only records this agent wrote: a duplicate never clears the other's.
                    await self._clear_records(bus, *shard.current)
                await supervisor.stop("the agent is leaving")
                await self.channels.clear()
                if shard.published or shard.current is None:
                    await self._remove_files()
        except TimeoutError:
            self.log.error("agent.shutdown_timeout", budget_s=budget)
        except FileWriteError as exc:
            self.log.warning("agent.cleanup_failed", error=str(exc))
        except Exception as exc:
            self.log.error("agent.shutdown_failed", error=describe(exc), exc_info=exc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(supervisor.stop("the agent is leaving"), budget)
        return 0

    async def _remove_files(self) -> None:
        """The leave's last step: remove the IMEX files and our hosts block. A file that
        cannot be removed (a run_dir below a regular file, a read-only folder) is one
        warning that names it; the leave is done all the same."""
        try:
            await asyncio.to_thread(self._reconciler.remove_files)
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            self.log.warning(
                "agent.cleanup_failed", error=f"cannot remove{where}: {exc.strerror or exc}"
            )

    async def _say_stopped(self, bus: Bus) -> None:
        """Our presence's last word: this agent stopped, so that the control plane refuses
        the node at once (AgentDown) instead of counting it seen for `--seen-within`.
        Not while our topics may be another agent's (a duplicate of our name)."""
        if self.shard.duplicate:
            return
        now = time.time()
        await bus.retain(
            self.topics.presence(self.node), self.shard.presence(None, at=now, stopped=now)
        )

    async def _clear_records(self, bus: Bus, domain: str, clique: str) -> None:
        """Clear our member record and health report of the shard (domain, clique)."""
        await bus.retain(self.topics.member(domain, clique, self.node), None)
        await bus.retain(self.topics.health(domain, self.node), None)

    @property
    def _reconciler(self) -> Reconciler:
        assert self.reconciler is not None  # noqa: S101 - set in run
        return self.reconciler

    def _parts(self) -> tuple[Bus, Supervisor]:
        assert self.bus is not None  # noqa: S101 - set in run
        assert self.supervisor is not None  # noqa: S101 - set in run
        return self.bus, self.supervisor

    def _load_state(self) -> NodeState:
        try:
            return self.state_store.load_and_bump()
        except FileWriteError as exc:
            self.log.error("state.unwritable", error=str(exc))
            return self.state_store.current

    def _save_state(self, state: NodeState) -> None:
        if state == self.state_store.current:
            return
        try:
            self.state_store.save(state)
        except FileWriteError as exc:
            self.metrics.count_write("state", ok=False)
            self.log.error("state.unwritable", error=str(exc))
        else:
            self.metrics.count_write("state", ok=True)

    # -- bus events -----------------------------------------------------------------

    async def _events_loop(self, bus: Bus) -> None:
        """Take in every event already queued, then wake membership once: a burst of
        records that arrives together costs one step, and no clock delays it."""
        events = bus.events()
        while True:
            with self.heartbeats.resting("events"):
                event = await anext(events, None)
                while event is None:
                    await asyncio.Event().wait()  # the bus closed: shutting down
            step = False
            while event is not None:
                step |= self._on_event(event, bus)
                event = events.queued()
            if step:
                self.wake.set()

    def _note_stale_own(self, event: Event) -> bool:
        """Whether `event` is a record of this node that a broker serves outside its shard
        (`ShardView.stale_own`: a standby restored from an older disk): the membership
        loop clears it."""
        if (
            isinstance(event, Received)
            and isinstance(event.payload, MemberRecord | HealthReport)
            and self.shard.stale_own(event.ref, event.payload)
        ):
            self.stale_own.add(event.topic)
            return True
        return False

    def _on_event(self, event: Event, bus: Bus) -> bool:
        """Take one bus event in; whether membership should step on it."""
        if isinstance(event, Synced):
            self.synced_filters = event.filters
            self.synced_seen.set()
        if _report(event):
            return self._note_stale_own(event)
        if (
            isinstance(event, Received)
            and isinstance(event.payload, Presence)
            and not event.payload.lost
            and event.payload.stopped is None
        ):
            return False  # news to membership only as an end (refreshed every report)
        # The control plane's records reach the readers only when newer than the held ones
        # (imexd.order); a held one takes the place of an older copy or a clear.
        for found in self.rebuild.on_event(event):
            self._take(found, bus)
        self.rebuild.count_drops(bus)
        return True

    def _take(self, event: Event, bus: Bus) -> None:
        """One bus event into the shard, the assignment, the retry requests and channels."""
        shard = self.shard
        identity = shard.apply(event, time.monotonic())
        if identity is Identity.ASIDE:
            # Our will would clear the other's record; another client id stops the two
            # from taking the broker session from each other.
            bus.set_will(None)
            bus.set_client_id(client_id("imexd", self.node, "duplicate", str(shard.incarnation)))
            # Its report and presence are the other agent's to write: neither replayed
            # nor put back by us.
            bus.disown(self.topics.presence(self.node))
            if shard.current is not None:
                bus.disown(self.topics.health(shard.current[0], self.node))
        elif identity is Identity.BACK:
            bus.set_client_id(self._client_id)
            bus.set_will(self._will())
        if not shard.synced:
            self.view_ready.clear()
        ref = getattr(event, "ref", None)
        if ref is not None and ref.kind == "assignment" and ref.node == self.node:
            if isinstance(event, Received) and isinstance(event.payload, Assignment):
                self.assigned_domain = event.payload.domain
            elif isinstance(event, Deleted):
                self.assigned_domain = None
        elif (
            isinstance(asked := getattr(event, "payload", None), Retry)
            and asked.state == "asked"
            and asked.at > self.started_at
            and asked != self.retry_last
        ):
            self.retry_last = self.retry_asked = asked  # each request once
            self.log.info("retry.asked", by=asked.by, at=asked.at)
            self.dirty.set()
        self._note_stale_own(event)
        self.channels.on_event(event)
        # Refused: logged by the bus, a lost claim echo re-sent by the shard, in the facts.
        self._refresh_bus_facts(bus)
        self.changed.set()

    def _refresh_bus_facts(self, bus: Bus) -> BusFacts:
        """The bus facts as of now (drop counters move without any event)."""
        self.bus_facts = BusFacts(  # every field: faster than dataclasses.replace
            connected=bus.connected,
            synced=bus.connected and self.shard.synced,
            broker=bus.broker or self.bus_facts.broker,
            last_error=bus.last_error or "",
            refused=tuple(sorted(bus.refused_topics)),
            reconnects=bus.reconnects,
            stale_retained=bus.stale_retained,
            resync_corrections=bus.resync_corrections,
            records_put_back=bus.put_back,
            dropped=MappingProxyType(dict(bus.dropped)),
            no_retained_wildcard=bus.no_retained_wildcard,
            retained_not_served=bus.retained_not_served,
            subscribe_refused=bus.subscribe_refused,
            control_key=bus.control_key,
            unverified=bus.unverified,
        )
        return self.bus_facts

    @property
    def _client_id(self) -> str:
        """`imexd-<node>` (a node name that is no valid client id encoded: names.client_id)."""
        return client_id("imexd", self.node)

    def _will(self) -> WillSpec:
        """Our will, one for the agent's run whatever shard it is in: our presence marked
        lost (`ShardView.will`), so that joining or leaving never connects again."""
        return self.shard.will(self.topics, at=wire_now())

    # -- membership -----------------------------------------------------------------

    @property
    def _wanted_domain(self) -> str | None:
        """The domain this node should be in: static, or as the control plane assigned."""
        return self.assigned_domain if self.settings.domain.assigned else self.static_domain

    def _target(self) -> tuple[str, str] | None:
        domain = self._wanted_domain
        if domain is None or self.clique is None:
            return None
        return domain, self.clique

    async def _membership_loop(self) -> None:
        while True:
            self.heartbeats.beat("membership")
            # Nothing due and no record: no step.
            await self.guard.rest("membership", self.wake, self._step_due())
            self.wake.clear()
            await self._retarget()
            if not self.shard.member:
                # A step that may claim judges the slots with every peer's will in.
                await self._presences_current()
            await self._step(time.monotonic())
            self.follow.set()  # the peers it now holds records of

    def _step_due(self) -> float | None:
        """time.monotonic() when a membership step is due without any event (None: none
        is): the shard's timers, the release of a FATAL daemon's slot, the survey while
        standing aside."""
        now = time.monotonic()
        due = [t for t in (self.shard.due_at(now), self.survey_due) if t is not None]
        if (release_at := self._release_at()) is not None and release_at > now:
            due.append(release_at)
        if self.released_until > now:
            due.append(self.released_until)
        return min(due) if due else None

    async def _retarget(self) -> None:
        """Leave the current shard and join the target one when they differ."""
        await self.channels.follow(self._parts()[0], self._wanted_domain, self.clique)
        self.rebuild.follow(self._wanted_domain)
        target = self._target()
        shard = self.shard
        if target == shard.current:
            return
        bus, _ = self._parts()
        old = shard.current
        if old is not None:
            domain, clique = old
            self.log.info("membership.leave", domain=domain, clique=clique)
            async with self.report_lock:
                if shard.leaving():  # no report for the old shard after the clears
                    await self._clear_records(bus, domain, clique)
            await bus.unsubscribe(self.topics.members_filter(domain, clique))
            await bus.unsubscribe(self.topics.spec(domain))
            await bus.unsubscribe(self.topics.retry(domain, self.node))
            await bus.unsubscribe(self.topics.health(domain, self.node))
        # Only a snapshot completed after this point, of both filters, covers the shard.
        filters = () if target is None else self._shard_filters(*target)
        if shard.join(target, time.monotonic(), needs=frozenset(filters)):
            bus.set_client_id(self._client_id)
        self.view_ready.clear()
        if target is None:
            # No domain: clean up. A domain but no clique yet (discovery pending or
            # failing): nothing to run and nothing to remove; the node is not ready.
            self._set_desired(Desired(cleanup=self._wanted_domain is None))
            return
        domain, clique = target
        self.log.info("membership.join", domain=domain, clique=clique or "none")
        # The will stays (it is our presence): the new filters' snapshot is all a join
        # waits for. A claim settles at its echo (imexd.membership.slots.barrier): the
        # members filter needs the broker's one order, the spec and the retry request not.
        spec, members = self._shard_filters(domain, clique)
        await bus.subscribe(members)
        # Our own health report too: a copy we did not write is put back by the bus.
        own = (self.topics.retry(domain, self.node), self.topics.health(domain, self.node))
        await bus.subscribe(spec, *own, ordered=False)

    async def _presences_loop(self, bus: Bus) -> None:
        """Follow the presence of every peer the shard holds a record of, and no other
        (`ShardView.followed`): a peer's Last Will is its presence. Off membership's path,
        so that a member steps on new records at once; a step that may claim waits for it
        (`_presences_current`)."""
        while True:
            self.heartbeats.beat("presences")
            with self.heartbeats.resting("presences"):
                await self.follow.wait()
            self.follow.clear()
            await self._follow_presences(bus)

    async def _follow_presences(self, bus: Bus) -> None:
        """One SUBSCRIBE for the presence topics of the peers newly held, an UNSUBSCRIBE
        for those no longer held; their retained copies, a will among them, are taken in
        (`_presences_read`) before `presences_read` says so; records that came meanwhile
        are followed in turn."""
        limit = bus.timeout_s + bus.echo_timeout_s
        while True:
            wanted = self._presence_topics(self.shard.followed())
            for topic in sorted(self.presences - wanted):
                await bus.unsubscribe(topic)
            self.presences_read &= wanted
            new = sorted(wanted - self.presences)
            self.presences = wanted
            if not new:
                return
            await self.guard.beating("presences", self._presences_read(bus, new), limit=limit)
            self.presences_read |= set(new)  # or given up on: each wait is bounded
            self.presences_moved.set()

    def _presence_topics(self, nodes: frozenset[str]) -> set[str]:
        return {self.topics.presence(n) for n in nodes}

    async def _presences_current(self) -> None:
        """Until the presence of every peer whose record came from a snapshot was taken in
        (`ShardView.found`; at most a round trip and an echo timeout; a link that drops
        gives them with its snapshot)."""
        bus, _ = self._parts()

        def read() -> bool:
            return self._presence_topics(self.shard.found()) <= self.presences_read

        if read():
            return
        self.follow.set()
        limit = bus.timeout_s + bus.echo_timeout_s
        await self.guard.beating(
            "membership", _until(read, self.presences_moved, limit), limit=limit
        )

    async def _presences_read(self, bus: Bus, topics: list[str]) -> None:
        """Subscribe the presence `topics` and wait (at most `bus.echo_timeout_s` after the
        SUBSCRIBE) until the events loop took in the Synced that covers them."""
        # Only a claim waits, and only for peers found in a snapshot: else no round trip.
        if self.shard.member or not set(topics) & self._presence_topics(self.shard.found()):
            await bus.subscribe(*topics, ordered=False, synced=False)
            return
        await bus.subscribe(*topics, ordered=False)

        def synced() -> bool:
            return self.synced_filters is None or self.synced_filters >= set(topics)

        await _until(synced, self.synced_seen, bus.echo_timeout_s)

    async def _clear_stale_own(self) -> None:
        """Clear the records of this node that a broker serves outside its shard (a standby
        restored from an older disk): we deleted them when we left, so they are not ours
        to keep (`ShardView.stale_own`)."""
        bus, _ = self._parts()
        while self.stale_own:
            topic = self.stale_own.pop()
            self.log.info("membership.stale_record_cleared", topic=topic)
            await bus.retain(topic, None)

    def _shard_filters(self, domain: str, clique: str) -> tuple[str, str]:
        """The bus filters a shard's view is made of: the domain's spec, its members."""
        return self.topics.spec(domain), self.topics.members_filter(domain, clique)

    async def _step(self, now: float) -> None:
        """One membership step: the shard view derives, the agent publishes and applies."""
        await self._clear_stale_own()
        shard = self.shard
        desired = self.desired
        plan = shard.derive(
            now,
            wall_now=wire_now(),
            saved=self.saved,
            running=desired.run and (desired.domain, desired.clique) == shard.current,
            release=self._release_due,
        )
        self.survey_due = None
        if plan.hold:
            # Another agent may run as this node: what runs keeps running, and a daemon
            # of our config that runs without us is reported as it is.
            await self._survey_unsupervised()
            self.survey_due = self.surveyed_at + self.settings.daemon.probe_interval_s
        elif plan.desired is None:
            return  # no shard, or no synced snapshot yet
        elif plan.desired.cleanup:
            await self._leave_deleted(plan)
        else:
            await self._claim(plan)
        if shard.synced:  # `desired` follows the synced snapshot (unless the link went)
            self.view_ready.set()
        self.changed.set()

    async def _survey_unsupervised(self) -> None:
        """While we stand aside, look for a daemon of our config that runs without us, so
        that /status tells the truth about it: at most once per `[daemon]
        probe_interval_s`, as often as a daemon of our own would be probed."""
        _, supervisor = self._parts()
        now = time.monotonic()
        if now - self.surveyed_at < self.settings.daemon.probe_interval_s:
            return
        self.surveyed_at = now
        pid = await supervisor.running_unsupervised()
        if pid != self.unsupervised:
            self.log.warning(
                "daemon.unsupervised",
                pid=pid,
                why="this agent stands aside for another agent of this node's name and "
                "neither adopts nor stops this daemon",
            )
        self.unsupervised = pid

    async def _claim(self, plan: Plan) -> None:
        """Publish the claim step of `plan`, keep it, and apply what should run."""
        shard = self.shard
        decision = plan.decision
        assert decision is not None  # noqa: S101 - a claim step
        assert plan.desired is not None  # noqa: S101 - a claim step
        self.unsupervised = None
        self.surveyed_at = -math.inf
        if plan.outbid:
            self._save_state(replace(self.state_store.current, incarnation=shard.incarnation))
        if plan.publish:
            await self._publish_claim(decision.claim)
        shard.commit(plan)
        if plan.outbid:
            # Our will must end this incarnation's link, after what we publish with it.
            self._parts()[0].set_will(self._will())
        if decision.settled and decision.claim.slot is not None and shard.current is not None:
            domain, clique = shard.current
            self._save_state(
                NodeState(
                    domain=domain,
                    clique=clique,
                    slot=decision.claim.slot,
                    incarnation=shard.incarnation,
                )
            )
        self._set_desired(plan.desired)

    def _release_due(self) -> bool:
        """Whether to give our slot up: the daemon has been FATAL for release_after_s.

        Latched for claim_stale_s once it fires, so that a waiting node can claim the slot
        before we would take it back.
        """
        s = self.settings
        mono = time.monotonic()
        release_at = self._release_at()
        if release_at is not None and mono >= release_at:
            if mono >= self.released_until:
                self.log.warning(
                    "membership.release",
                    slot=self.shard.claim.slot,
                    fatal_for_s=round(s.daemon.release_after_s, 1),
                )
            self.released_until = mono + s.domain.claim_stale_s
        return mono < self.released_until

    def _release_at(self) -> float | None:
        """time.monotonic() from which a FATAL daemon's slot is given up: release_after_s
        after it turned FATAL (None: it is not FATAL, or the release is off)."""
        status = self._parts()[1].status
        after = self.settings.daemon.release_after_s
        if after <= 0 or status.state is not DaemonState.FATAL or status.fatal_since is None:
            return None
        return status.fatal_since + after

    async def _leave_deleted(self, plan: Plan) -> None:
        """The control plane deletes the domain: clear our record and stop the daemon."""
        assert plan.desired is not None  # noqa: S101 - a leave step
        # Cleanup first: it stops the reports, so none follows the clears.
        self._set_desired(plan.desired)
        shard = self.shard
        if plan.leave and shard.current is not None:
            domain, clique = shard.current
            self.log.info("membership.domain_deleted", domain=domain)
            bus, _ = self._parts()
            async with self.report_lock:
                if shard.published:
                    shard.sending(None)  # the clear's echo is ours, not a record written over
                    await self._clear_records(bus, domain, clique)
            shard.left()

    async def _publish_claim(self, claim: mb.ClaimState) -> None:
        bus, _ = self._parts()
        shard = self.shard
        assert shard.current is not None  # noqa: S101 - only called inside a shard
        domain, clique = shard.current
        record = shard.record(claim, driver=self.driver, channel_count=self.channels.count)
        shard.sending(record)  # before the publish: its echo is the claim's barrier
        # Not replayed by the bus on a new link: the shard judges that link's snapshot
        # first (our slot may have been taken meanwhile) and publishes it again itself.
        await bus.retain(self.topics.member(domain, clique, self.node), record, replay=False)
        shard.sent(record)

    def _set_desired(self, desired: Desired) -> None:
        if desired != self.desired:
            self.desired = desired
            self.desired_at = time.monotonic()
            self.dirty.set()

    # -- reconcile ------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        s = self.settings
        reconciler = self._reconciler
        retry_at: float | None = None
        attempt = 0
        quiet_at = 0.0  # from then on a change is applied at once (settle_s after the last)
        while True:
            self.heartbeats.beat("reconcile")
            await self.guard.rest("reconcile", self.dirty, retry_at)
            due = retry_at is not None and time.monotonic() >= retry_at
            if not self.dirty.is_set() and not due:
                continue
            # Leading edge: the first change after a quiet period is applied at once; what
            # follows within settle_s of a round that wrote or signalled is coalesced into
            # one write and one signal.
            # The supervisor's SIGUSR1 pacing makes sure the last change reaches the daemon.
            if (wait := quiet_at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if (
                self._removes_members()
                and (wait := self.desired_at + s.domain.settle_s - time.monotonic()) > 0
            ):
                # A member moved or gone: only once that stood for settle_s, so that a
                # change its owner undid (a record written over and put back) reaches no
                # daemon. Newcomers do not wait.
                await asyncio.sleep(wait)
                continue
            if self._removes_members() or self.shard.unproven:
                mark = self.shard.proof_mark()
                if await self._link_proven():
                    self.shard.proven(mark)
                elif self._removes_members():
                    # A broker shutting down publishes every will, then drops the link:
                    # let its end reach the view, and apply what the resynced one says.
                    await asyncio.sleep(s.domain.settle_s)
            if self.shard.current is not None and not self.view_ready.is_set():
                # The link dropped meanwhile: what membership saw just before may be a
                # broker's shutdown (it publishes every will first). Apply what it says
                # once it has stepped on the resynced snapshot instead.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BEAT_S):
                        await self.view_ready.wait()
                continue
            self.dirty.clear()
            if (asked := self.retry_asked) is not None:
                self.retry_asked = None
                await self._parts()[1].retry(f"imexd node retry by {asked.by or 'an operator'}")
                self.released_until = 0.0  # claim again a slot that a FATAL daemon gave up
                self.wake.set()
            started = time.monotonic()
            quiet_at = started + s.domain.settle_s
            # Starting and stopping the daemon are bounded by the supervisor's timeouts.
            bound = 2 * s.daemon.stop_timeout_s + s.daemon.start_s
            delay = backoff_delay(attempt, *LOCAL_RETRY_S)
            try:
                probe = await self.guard.beating(
                    "reconcile", reconciler.apply(self.desired, self.saved), limit=bound
                )
            except FileWriteError as exc:
                reconciler.write_failures += 1
                retry_at = time.monotonic() + delay
                attempt += 1
                self.log.warning(
                    "reconcile.write_failed", error=str(exc), retry_in_s=round(delay, 2)
                )
            except Exception as exc:
                # Nothing was applied that the next round would not redo: retry it like a
                # failed write, and say why in DaemonReady (the traceback is in the log).
                reconciler.write_failures += 1
                reconciler.write_error = f"reconcile failed: {describe(exc)}"
                reconciler.write_path = ""
                retry_at = time.monotonic() + delay
                attempt += 1
                self.log.error(
                    "reconcile.failed",
                    error=describe(exc),
                    retry_in_s=round(delay, 2),
                    exc_info=exc,
                )
            else:
                retry_at, attempt = None, 0
                reconciler.write_error = reconciler.write_path = ""
                if probe == "now":
                    # Nothing was given to a running daemon (it was stopped, or there is
                    # nothing to run yet): no burst to coalesce, the next change goes at once.
                    quiet_at = 0.0
                    self.probes.now()
                # "soon": the start or the paced SIGUSR1 starts the domain probes
                # (_on_daemon_change), not this write.
            self.metrics.observe_reconcile(time.monotonic() - started)
            self.changed.set()

    async def _link_proven(self) -> bool:
        """A round trip through the broker came back (bounded by BEAT_S for the heartbeat)."""
        bus, _ = self._parts()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(BEAT_S):
                return await bus.barrier()
        return False

    def _removes_members(self) -> bool:
        """Whether `desired` drops a member the daemon was last given (a will, a leave)."""
        applied = self._reconciler.applied
        if applied is None or not self.desired.run:
            return False
        kept = {slot: m.address for slot, m in self.desired.members.items()}
        return any(kept.get(slot) != address for slot, address in applied.members.items())

    # -- daemon and probes ----------------------------------------------------------

    def _news(self) -> None:
        """The daemon, its probes or a channel moved: readiness, DomainUp and ChannelsReady
        follow from them, and a prolog waits for those, so the report loop judges at once."""
        self.urgent.set()
        self.changed.set()

    def _on_daemon_change(self, status: DaemonStatus) -> None:
        seen, self.daemon_seen = self.daemon_seen, (status.state, status.reloads_sent)
        self.probes.on_daemon_change(status, seen)
        self._news()
        if status.state is not seen[0]:
            self.wake.set()  # a FATAL daemon's slot is released after release_after_s

    async def _probe_loop(self) -> None:
        _, supervisor = self._parts()
        await self.probes.run(
            self.guard,
            supervisor,
            wanted=lambda: self.desired.run,
            members=lambda: {slot: m.node for slot, m in self.desired.members.items()},
        )

    # -- facts, reports, discovery, watchdog -------------------------------------------

    def facts(self) -> Facts:
        """One snapshot of everything health depends on."""
        _, supervisor = self._parts()
        status = supervisor.status
        shard = self.shard
        domain = shard.current[0] if shard.current else None
        reason, message = status.reason or "", status.detail
        last_line = status.last_lines[-1] if status.last_lines else ""
        state, pid = status.state.value, status.pid
        if self.unsupervised is not None and pid is None:
            state, pid, reason = DaemonState.RUNNING.value, self.unsupervised, UNSUPERVISED
            message = (
                f"pid {pid} runs this node's IMEX config, unsupervised: this agent stands "
                "aside for another agent of this node's name and neither adopts nor stops it"
            )
        return Facts(
            node=self.node,
            domain=None if self.desired.cleanup else domain or self._wanted_domain,
            clique=shard.current[1] if shard.current else (self.clique or ""),
            address=self.settings.node.address,
            slot=shard.claim.slot,
            incarnation=shard.incarnation,
            driver=self.driver,
            bus=self._refresh_bus_facts(self._parts()[0]),
            membership=shard.facts(self.desired),
            daemon=DaemonFacts(
                state=state,
                pid=pid,
                restarts=status.restarts,
                start_failures=status.start_failures,
                reloads=status.reloads_sent,
                last_exit=status.last_exit,
                # Only problems are reasons; health names the ordinary states itself.
                reason=reason if reason in DAEMON_PROBLEMS or reason == UNSUPERVISED else "",
                message=message
                if state != DaemonState.RUNNING.value or reason == UNSUPERVISED
                else "",
                last_line=last_line,
                write_error=self._reconciler.write_error,
                write_path=self._reconciler.write_path,
                write_method=self._reconciler.write_method,
                imex_status=self.probes.imex_status,
                probe_error=self.probes.probe_error,
                identified=status.identified,
            ),
            domain_probe=self.probes.domain_view,
            fabric=self.fabric,
            clique_known=self.clique is not None or shard.current is not None,
            mode=self.settings.domain.mode,
            channels=self.channels.facts(shard.records.values()),
        )

    async def _report_loop(self) -> None:
        schedule = ReportSchedule(self.settings.health.report_interval_s)
        while True:
            self.heartbeats.beat("report")
            now = time.monotonic()
            due = schedule.next_at()
            with self.heartbeats.resting("report"):  # changes in a burst: one turn
                await self.report_pace.wait(self.changed, max(0.0, due - now), self.urgent)
            health = self.health
            if health.update(self.facts()):
                schedule.changed(health.gist(), time.monotonic())
            self.notifier.status(health.summary())
            now = time.monotonic()
            if now >= schedule.next_at():
                schedule.published(health.gist(), now)
                await self._publish_report(health.report())

    async def _publish_report(self, report: HealthReport) -> None:
        """Publish our report and presence, unless we are leaving or may be a duplicate.

        Under the lock the leaves take, so that no report follows a clear.
        """
        bus, _ = self._parts()
        if self.shard.duplicate:
            return  # those topics belong to another agent of our name
        # Presence only says "an agent runs as this node, in this domain": re-sent when
        # that changes or once per report interval, not with every report of a formation.
        said = (self.shard.incarnation, report.domain)
        if said != self.presence_said or report.at >= self.presence_due:
            self.presence_said = said
            self.presence_due = report.at + self.settings.health.report_interval_s
            presence = self.shard.presence(report.domain, at=report.at)
            await bus.retain(self.topics.presence(self.node), presence)
        async with self.report_lock:
            current = self.shard.current
            if current is None or self.desired.cleanup:
                return
            await bus.retain(
                self.topics.health(current[0], self.node),
                report,
                message_expiry_s=3 * self.settings.health.report_interval_s,
            )

    async def _discover_loop(self) -> None:
        s = self.settings
        next_at = 0.0
        failures = 0
        while True:
            self.heartbeats.beat("discover")
            if time.monotonic() < next_at:
                await self.guard.rest("discover", None, next_at)
                continue
            try:
                found = await discover(DISCOVERY_TIMEOUT_S)
            except DiscoveryError as exc:
                self.fabric = FabricFacts(source="nvml", error=str(exc))
                delay = min(backoff_delay(failures, *LOCAL_RETRY_S), s.node.discover_interval_s)
                failures += 1
                self.log.error(
                    "fabric.discovery_failed", error=str(exc), retry_in_s=round(delay, 2)
                )
                next_at = time.monotonic() + delay
            else:
                failures = 0
                self.fabric = FabricFacts(source="nvml")
                self.driver = found.report.driver_version or ""
                if found.clique != self.clique:
                    self.log.info("fabric.clique", clique=found.clique, reason=found.reason)
                self.clique = found.clique
                next_at = time.monotonic() + s.node.discover_interval_s
            self.wake.set()
            self.changed.set()

    async def _watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_interval()
        while True:
            if interval is not None and not self.heartbeats.stale():
                self.notifier.watchdog()
            until = None if interval is None else time.monotonic() + interval
            await self.guard.rest("watchdog", None, until)


async def _first_of(*events: asyncio.Event) -> None:
    """Return once any of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def run(settings: Settings, *, stop: asyncio.Event, handover: asyncio.Event) -> int:
    """The root coroutine: run the agent until `stop` (tests drive these events)."""
    return await Agent(settings).run(stop=stop, handover=handover)
