"""The agent: one root coroutine that keeps this node's IMEX daemon in its domain.

`run(settings, stop=..., handover=...)` wires the pieces together and owns their
lifecycle. It decides nothing itself: the node's core (imexd.agent.core.NodeCore) takes
what happens in with the time and says what to do, and this driver feeds it and carries
its actions out; the reconciler (imexd.agent.reconcile) writes the files and drives the
supervisor, carrying out only orders of the daemon's gate (imexd.agent.gate); fleet and
health (imexd.health.fleet, imexd.health.conditions) judge the facts, and
imexd.health.guard contains the failures of each task. Named long-lived tasks, each with
a heartbeat that /healthz watches:

- `events`: reads the bus (our shard's records, the domain's spec, our assignment and
  retry requests, link state) into the core and wakes `membership` once for all that
  was queued;
- `membership`: feeds the core a retarget and a step, when woken or when its next timer
  is due, and carries out what it says (publish, subscribe, save, survey);
- `presences`: follows the presence of the peers the shard holds records of;
- `reconcile`: runs the rounds the core paces, and the `Reconciler` in them;
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
import os
import time
from collections.abc import Callable
from typing import Final

from imexd.agent import actions as act
from imexd.agent.core import NodeCore
from imexd.agent.inputs import (
    BusInput,
    DaemonInput,
    Discovered,
    Input,
    Proven,
    Reconciled,
    Retarget,
    Step,
    Surveyed,
)
from imexd.agent.pacer import Pacer
from imexd.agent.probes import DaemonProbes
from imexd.agent.rebuild import Rebuilder
from imexd.agent.reconcile import Reconciler
from imexd.agent.rounds import LOCAL_RETRY_S
from imexd.agent.snapshot import bus_facts, gather
from imexd.agent.statefile import RecordFile, StateStore
from imexd.bus.events import Event, Synced
from imexd.bus.link import Bus
from imexd.channels.keeper import ChannelKeeper
from imexd.daemon.ctl import Prober
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.daemon.supervisor import Supervisor
from imexd.errors import DiscoveryError, FileWriteError
from imexd.fabric import discover
from imexd.facts import BusFacts, FabricFacts, Facts
from imexd.files import remove_stale_temps
from imexd.health.conditions import REPORT_PACE_S, Health, Heartbeats, ReportSchedule
from imexd.health.guard import BEAT_S, Guard, describe
from imexd.health.http import HealthServer
from imexd.health.metrics import Metrics
from imexd.health.sdnotify import Notifier
from imexd.logs import get_logger
from imexd.membership.desired import Desired
from imexd.membership.shard import ShardView
from imexd.messages import HealthReport
from imexd.messages import now as wire_now
from imexd.nodestate import NodeState
from imexd.retry import backoff_delay
from imexd.settings import SHUTDOWN_MARGIN_S, Settings, node_address_problem
from imexd.signing import load_verifier
from imexd.topics import Topics

EXIT_HANDOVER: Final = 75
"""Exit status after a SIGUSR2 hand-over: the unit restarts the agent (EX_TEMPFAIL)."""
DISCOVERY_TIMEOUT_S: Final = 20.0


async def _until(holds: Callable[[], bool], moved: asyncio.Event, limit: float) -> None:
    """Wait until `holds()`, looking again each time `moved` is set, at most `limit`
    seconds (then go on regardless: what it waits for is bounded, not required)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            while not holds():
                moved.clear()
                await moved.wait()


class Agent:
    """The agent's driver and tasks; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.node = settings.node.name
        self.topics = Topics(settings.bus.topic_prefix)
        self.log = get_logger("agent", node=self.node)
        self.state_store = StateStore(settings.node.state_dir)
        self.heartbeats = Heartbeats()
        self.metrics = Metrics()
        self.guard = Guard(self.heartbeats, self.metrics, self.log)
        self.notifier = Notifier.from_env()
        self.health = Health(Facts(node=self.node, address=settings.node.address))
        self.bus: Bus | None = None
        self.supervisor: Supervisor | None = None
        self.reconciler: Reconciler | None = None
        auto = settings.node.clique == "auto"
        self.fabric = FabricFacts(source="nvml" if auto else "config")
        self.core = NodeCore(
            settings,
            shard=ShardView.from_settings(settings, self.log),
            started_at=wire_now(),
            log=self.log,
        )
        self.wake = asyncio.Event()
        """Wakes membership: set once per batch of bus events (`_events_loop`), and when
        the core asks (the daemon's state, a discovery, an operator's retry)."""
        self.stepped = asyncio.Event()
        """Set after every membership step (the core's `view_ready` may have moved)."""
        self.follow = asyncio.Event()
        """Wakes the presences task: the shard's records may have changed."""
        self.presences_moved = asyncio.Event()
        self.synced_seen = asyncio.Event()
        self.dirty = asyncio.Event()
        """Wakes reconcile: what should run changed (`Reconcile`)."""
        self.presence_said: tuple[int, str | None] | None = None
        self.presence_due = 0.0
        """Wall-clock time of the next presence record (also sent when `presence_said` moves)."""
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

    @property
    def shard(self) -> ShardView:
        """The view of our current shard (the core's)."""
        return self.core.shard

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
            if self.core.target() is not None:
                await self._do(self._feed(Retarget()))
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
        for path in (s.config_path, s.nodes_config_path, s.imex.hosts_file):
            remove_stale_temps(path)
        try:
            saved = self.state_store.load_and_bump()
        except FileWriteError as exc:
            self.log.error("state.unwritable", error=str(exc))
            saved = self.state_store.current
        self.core.start(saved)
        self.log.info(
            "agent.start",
            incarnation=self.shard.incarnation,
            previous_domain=saved.domain,
            previous_slot=saved.slot,
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
            client_id=self.core.client_id,
            will=self.core.will(wire_now()),
            verifier=verifier,
        )
        bus.on_counted = self.changed.set  # the bus facts' counters moved (report loop)
        supervisor = Supervisor.from_settings(s, on_change=self._on_daemon_change)
        self.bus, self.supervisor = bus, supervisor
        core = self.core
        self.reconciler = Reconciler(
            s,
            supervisor,
            metrics=self.metrics,
            log=self.log,
            current=lambda: core.desired,
            gate=core.order,
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
                if not shard.duplicate:
                    # Our presence's last word: this agent stopped, so that the control
                    # plane refuses the node at once (AgentDown) instead of counting it
                    # seen for `--seen-within`. Not while our topics may be another agent's.
                    now = time.time()
                    presence = shard.presence(None, at=now, stopped=now)
                    await bus.retain(self.topics.presence(self.node), presence)
                if shard.current is not None and shard.published:
                    # Only records this agent wrote: a duplicate never clears the other's.
                    await self._do([self.core.clear(*shard.current)])
                await self._reconciler.carry_out(self.core.shutdown())
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
                await asyncio.wait_for(self._reconciler.carry_out(self.core.shutdown()), budget)
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

    @property
    def _reconciler(self) -> Reconciler:
        assert self.reconciler is not None  # noqa: S101 - set in run
        return self.reconciler

    def _parts(self) -> tuple[Bus, Supervisor]:
        assert self.bus is not None  # noqa: S101 - set in run
        assert self.supervisor is not None  # noqa: S101 - set in run
        return self.bus, self.supervisor

    # -- the core's inputs and actions ------------------------------------------------

    def _feed(self, happened: Input) -> list[act.Action]:
        """`happened` into the core, as of now."""
        return self.core.feed(happened, now=time.monotonic(), wall=wire_now())

    def _do_now(self, action: act.Action) -> bool:
        """Carry out `action` if it needs no wait; whether it did."""
        match action:
            case act.SetWill(will):
                self._parts()[0].set_will(will)
            case act.SetClientId(client):
                self._parts()[0].set_client_id(client)
            case act.Disown(topic):
                self._parts()[0].disown(topic)
            case act.SaveState(state):
                try:
                    self.state_store.save(state)
                except FileWriteError as exc:
                    self.metrics.count_write("state", ok=False)
                    self.log.error("state.unwritable", error=str(exc))
                else:
                    self.metrics.count_write("state", ok=True)
            case act.Reconcile():
                self.dirty.set()
            case act.StepSoon():
                self.wake.set()
            case act.ProbeNow():
                self.probes.now()
            case _:
                return False
        return True

    async def _do(self, actions: list[act.Action]) -> None:
        """Carry out the core's `actions`, in order."""
        bus, supervisor = self._parts()
        for action in actions:
            match action:
                case act.Publish(topic, payload, replay):
                    await bus.retain(topic, payload, replay=replay)
                case act.Clear(topics):
                    async with self.report_lock:
                        for topic in topics:
                            await bus.retain(topic, None)
                case act.Subscribe(filters, ordered):
                    await bus.subscribe(*filters, ordered=ordered)
                case act.Unsubscribe(filters):
                    for topic_filter in filters:
                        await bus.unsubscribe(topic_filter)
                case act.Follow(domain, clique):
                    await self.channels.follow(bus, domain, clique)
                    self.rebuild.follow(domain)
                case act.Survey():
                    self._feed(Surveyed(await supervisor.running_unsupervised()))
                case _:
                    self._do_now(action)

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

    def _on_event(self, event: Event, bus: Bus) -> bool:
        """Take one bus event in; whether membership should step on it."""
        if isinstance(event, Synced):
            self.synced_seen.set()
        if (sorted_out := self.core.sort(event)) is not None:
            return sorted_out
        # The control plane's records reach the core only when newer than the held ones
        # (imexd.order); a held one takes the place of an older copy or a clear.
        for found in self.rebuild.on_event(event):
            for action in self._feed(BusInput(found)):
                self._do_now(action)
            self.channels.on_event(found)
            # Refused: logged by the bus, a lost claim echo re-sent by the shard, in the facts.
            self.bus_facts = bus_facts(bus, synced=self.shard.synced, previous=self.bus_facts)
            self.changed.set()
        self.rebuild.count_drops(bus)
        return True

    # -- membership -----------------------------------------------------------------

    async def _membership_loop(self) -> None:
        while True:
            self.heartbeats.beat("membership")
            # Nothing due and no record: no step.
            await self.guard.rest("membership", self.wake, self.core.next_due(time.monotonic()))
            self.wake.clear()
            await self._do(self._feed(Retarget()))
            if not self.shard.member:
                # A step that may claim judges the slots with every peer's will in.
                await self._presences_current()
            await self._step(time.monotonic())
            self.follow.set()  # the peers it now holds records of

    async def _step(self, now: float) -> None:
        """One membership step of the core, carried out."""
        happened = Step(channel_count=self.channels.count)
        await self._do(self.core.feed(happened, now=now, wall=wire_now()))
        self.stepped.set()
        self.changed.set()

    async def _presences_loop(self, bus: Bus) -> None:
        """Follow the presence of every peer the shard holds a record of, and no other
        (`NodeCore.follow_presences`). Off membership's path, so that a member steps on
        new records at once; a step that may claim waits for it (`_presences_current`)."""
        limit = bus.timeout_s + bus.echo_timeout_s
        while True:
            self.heartbeats.beat("presences")
            with self.heartbeats.resting("presences"):
                await self.follow.wait()
            self.follow.clear()
            # Records that came meanwhile are followed in turn.
            while True:
                dropped, new = self.core.follow_presences()
                for topic in dropped:
                    await bus.unsubscribe(topic)
                if not new:
                    break
                read = self._presences_read(bus, new)
                await self.guard.beating("presences", read, limit=limit)
                self.core.presences_taken(new)
                self.presences_moved.set()

    async def _presences_current(self) -> None:
        """Until the core has the presences a claim waits for (`NodeCore.presences_current`;
        at most a round trip and an echo timeout; a link that drops gives them with its
        snapshot)."""
        if self.core.presences_current():
            return
        bus, _ = self._parts()
        self.follow.set()
        limit = bus.timeout_s + bus.echo_timeout_s
        wait = _until(self.core.presences_current, self.presences_moved, limit)
        await self.guard.beating("membership", wait, limit=limit)

    async def _presences_read(self, bus: Bus, topics: list[str]) -> None:
        """Subscribe the presence `topics`; when a claim waits for them, until (at most
        `bus.echo_timeout_s` after the SUBSCRIBE) the events loop took in the Synced that
        covers them, else with no round trip."""
        if not self.core.claim_waits(topics):
            await bus.subscribe(*topics, ordered=False, synced=False)
            return
        await bus.subscribe(*topics, ordered=False)
        await _until(lambda: self.core.synced_covers(topics), self.synced_seen, bus.echo_timeout_s)

    # -- reconcile ------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        """Run the reconcile rounds the core paces (`NodeCore.reconcile_next`)."""
        core = self.core
        while True:
            self.heartbeats.beat("reconcile")
            await self.guard.rest("reconcile", self.dirty, core.rounds.retry_at)
            due = core.rounds.retry_at is not None and time.monotonic() >= core.rounds.retry_at
            if not self.dirty.is_set() and not due:
                continue
            applied = self._reconciler.applied
            members = None if applied is None else applied.members
            match core.reconcile_next(time.monotonic(), members):
                case act.Pause(until):
                    await asyncio.sleep(until - time.monotonic())
                case act.ProveLink(mark):
                    self._feed(Proven(mark, await self._link_proven()))
                case act.AwaitView():
                    with contextlib.suppress(TimeoutError):
                        await _until(lambda: core.view_ready, self.stepped, BEAT_S)
                case act.Apply(desired, saved, retry):
                    self.dirty.clear()
                    if retry is not None:
                        await self._reconciler.carry_out(retry)
                        self.wake.set()
                    await self._apply(desired, saved)

    async def _apply(self, desired: Desired, saved: NodeState) -> None:
        """One reconcile round: the `Reconciler` applies `desired`, bounded, its failure
        contained (tried again on the core's backoff, said in DaemonReady)."""
        s, reconciler = self.settings, self._reconciler
        started = time.monotonic()
        # Starting and stopping the daemon are bounded by the supervisor's timeouts.
        bound = 2 * s.daemon.stop_timeout_s + s.daemon.start_s
        try:
            work = reconciler.apply(desired, saved)
            probe = await self.guard.beating("reconcile", work, limit=bound)
        except Exception as exc:
            # Nothing was applied that the next round would not redo: retry it, and say
            # why in DaemonReady (for anything but a failed write, the traceback is logged).
            reconciler.write_failures += 1
            self._feed(Reconciled(ok=False))
            retry_in_s = round((self.core.rounds.retry_at or started) - time.monotonic(), 2)
            if isinstance(exc, FileWriteError):
                self.log.warning("reconcile.write_failed", error=str(exc), retry_in_s=retry_in_s)
            else:
                reconciler.write_error = f"reconcile failed: {describe(exc)}"
                reconciler.write_path = ""
                self.log.error(
                    "reconcile.failed", error=describe(exc), retry_in_s=retry_in_s, exc_info=exc
                )
        else:
            reconciler.write_error = reconciler.write_path = ""
            # "soon": the start or the paced SIGUSR1 starts the domain probes
            # (_on_daemon_change), not this write.
            await self._do(self._feed(Reconciled(ok=True, probe_now=probe == "now")))
        self.metrics.observe_reconcile(time.monotonic() - started)
        self.changed.set()

    async def _link_proven(self) -> bool:
        """A round trip through the broker came back (bounded by BEAT_S for the heartbeat)."""
        bus, _ = self._parts()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(BEAT_S):
                return await bus.barrier()
        return False

    # -- daemon, probes, reports, discovery, watchdog -----------------------------------

    def _news(self) -> None:
        """The daemon, its probes or a channel moved: readiness, DomainUp and ChannelsReady
        follow from them, and a prolog waits for those, so the report loop judges at once."""
        self.urgent.set()
        self.changed.set()

    def _on_daemon_change(self, status: DaemonStatus) -> None:
        seen, self.daemon_seen = self.daemon_seen, (status.state, status.reloads_sent)
        self.probes.on_daemon_change(status, seen)
        self._news()
        for action in self._feed(DaemonInput(status.state, status.fatal_since)):
            self._do_now(action)

    async def _probe_loop(self) -> None:
        core = self.core
        await self.probes.run(
            self.guard,
            self._parts()[1],
            wanted=lambda: core.desired.run,
            members=lambda: {slot: m.node for slot, m in core.desired.members.items()},
        )

    def facts(self) -> Facts:
        """One snapshot of everything health depends on."""
        bus, supervisor = self._parts()
        self.bus_facts = bus_facts(bus, synced=self.shard.synced, previous=self.bus_facts)
        return gather(
            self.core,
            status=supervisor.status,
            bus=self.bus_facts,
            reconciler=self._reconciler,
            probes=self.probes,
            channels=self.channels,
            fabric=self.fabric,
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
        shard, interval = self.shard, self.settings.health.report_interval_s
        if shard.duplicate:
            return  # those topics belong to another agent of our name
        # Presence only says "an agent runs as this node, in this domain": re-sent when
        # that changes or once per report interval, not with every report of a formation.
        said = (shard.incarnation, report.domain)
        if said != self.presence_said or report.at >= self.presence_due:
            self.presence_said, self.presence_due = said, report.at + interval
            presence = shard.presence(report.domain, at=report.at)
            await bus.retain(self.topics.presence(self.node), presence)
        async with self.report_lock:
            if (current := shard.current) is None or self.core.desired.cleanup:
                return
            topic = self.topics.health(current[0], self.node)
            await bus.retain(topic, report, message_expiry_s=3 * interval)

    async def _discover_loop(self) -> None:
        """NVML fabric discovery: at once, then every `[node] discover_interval_s`; a
        failure is tried again on the local backoff (at most that interval)."""
        interval = self.settings.node.discover_interval_s
        next_at, failures = 0.0, 0
        while True:
            self.heartbeats.beat("discover")
            if time.monotonic() < next_at:
                await self.guard.rest("discover", None, next_at)
                continue
            try:
                found = await discover(DISCOVERY_TIMEOUT_S)
            except DiscoveryError as exc:
                self.fabric = FabricFacts(source="nvml", error=str(exc))
                delay = min(backoff_delay(failures, *LOCAL_RETRY_S), interval)
                failures += 1
                self.log.error(
                    "fabric.discovery_failed", error=str(exc), retry_in_s=round(delay, 2)
                )
                next_at = time.monotonic() + delay
            else:
                failures = 0
                self.fabric = FabricFacts(source="nvml")
                driver = found.report.driver_version or ""
                self._feed(Discovered(found.clique, driver, found.reason))
                next_at = time.monotonic() + interval
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
