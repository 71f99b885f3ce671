"""The agent: one root coroutine that keeps this node's IMEX daemon in its domain.

`run(settings, stop=..., handover=...)` wires the pieces together and owns their
lifecycle; it decides nothing itself. The node's core (imexd.agent.core.NodeCore) takes
what happens in, with the time, and says what to do; this driver feeds it and carries its
actions out. The reconciler (imexd.agent.reconcile) writes the files and drives the
supervisor, a stop or restart only as an order of the daemon's gate (imexd.agent.gate).
Named long-lived tasks, each with a heartbeat that /healthz watches (imexd.health.guard
contains the failures of each): `events` (the bus into the core, membership woken once
per batch), `membership` (retarget and step when woken or when the core's next timer is
due), `presences` (imexd.agent.presences), `reconcile` (the rounds the core paces),
`probe` (imexd.agent.probes), `report` (imexd.agent.report), `channels`
(imexd.channels.keeper), `rebuild` (imexd.agent.rebuild), `discover` (NVML, with `[node]
clique = "auto"`: imexd.agent.discovery) and `watchdog` (WATCHDOG=1 to systemd while no
task is wedged).

Signals are handled in the CLI layer only: SIGTERM/SIGINT set `stop` (leave: clear our
record, stop the daemon, exit 0), SIGUSR2 sets `handover` too (exit 75, the daemon
running and the record in place for the next agent to adopt).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Final

from imexd.agent import actions as act
from imexd.agent import discovery
from imexd.agent.core import NodeCore
from imexd.agent.inputs import BusInput, DaemonInput, Discovered, Input, Retarget, Step, Surveyed
from imexd.agent.presences import Presences
from imexd.agent.probes import DaemonProbes
from imexd.agent.rebuild import Rebuilder
from imexd.agent.reconcile import Reconciler
from imexd.agent.report import Reporter
from imexd.agent.snapshot import bus_facts, gather
from imexd.agent.statefile import StateStore
from imexd.bus.events import Connected, Event, Synced
from imexd.bus.link import Bus
from imexd.channels.keeper import ChannelKeeper
from imexd.daemon.ctl import Prober
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.daemon.supervisor import Supervisor
from imexd.errors import FileWriteError
from imexd.facts import BusFacts, FabricFacts, Facts
from imexd.files import remove_stale_temps
from imexd.health.conditions import Health, Heartbeats
from imexd.health.guard import Guard, describe
from imexd.health.http import HealthServer
from imexd.health.metrics import Metrics
from imexd.health.sdnotify import Notifier
from imexd.logs import get_logger
from imexd.membership.shard import ShardView
from imexd.messages import now as wire_now
from imexd.settings import SHUTDOWN_MARGIN_S, Settings, node_address_problem
from imexd.signing import load_verifier
from imexd.topics import Topics

EXIT_HANDOVER: Final = 75
"""Exit status after a SIGUSR2 hand-over: the unit restarts the agent (EX_TEMPFAIL)."""


class Agent:
    """The driver: the node's parts and tasks around its core; see the module docstring."""

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
        shard = ShardView.from_settings(settings, self.log)
        self.core = NodeCore(settings, shard=shard, started_at=wire_now(), log=self.log)
        auto = settings.node.clique == "auto"
        self.fabric = FabricFacts(source="nvml" if auto else "config")
        self.wake = asyncio.Event()
        """Wakes membership: set once per batch of bus events (`_events_loop`), and when
        the core asks (the daemon's state, a discovery, an operator's retry)."""
        self.stepped = asyncio.Event()
        """Set after every membership step (the core's `view_ready` may have moved)."""
        self.dirty = asyncio.Event()
        """Wakes reconcile: what should run changed (`Reconcile`)."""
        self.daemon_seen: tuple[DaemonState, int] = (DaemonState.STOPPED, 0)
        """(state, reloads_sent) of the last daemon snapshot: a start or a signal is news."""
        self.bus_facts = BusFacts()
        self.presences = Presences(self.core, self.guard)
        self.reporter = Reporter(self.core, health=self.health, notifier=self.notifier)
        self.changed, self.urgent = self.reporter.changed, self.reporter.urgent
        prober = Prober.from_settings(settings)
        self.probes = DaemonProbes(
            settings, prober, metrics=self.metrics, log=self.log, on_change=self._news
        )
        self.channels = ChannelKeeper.from_settings(settings, on_change=self._news)
        self.rebuild = Rebuilder.from_settings(settings, metrics=self.metrics, log=self.log)

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
            hb, health, metrics = self.heartbeats, self.health, self.metrics
            server = HealthServer(s.health.listen, heartbeats=hb, health=health, metrics=metrics)
            await stack.enter_async_context(server)
            bus, supervisor = self._start()
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
                await self._tasks(bus, stop)
            except Exception as exc:
                failed = True
                self.log.error("agent.failed", error=describe(exc), exc_info=exc)
            finally:
                self.notifier.stopping()
            # A bug (or a task failing again and again) ends the agent like a hand-over:
            # the daemon keeps running and our record stays, for the next agent to adopt.
            keep_imex = handover.is_set() or failed or self.guard.give_up.is_set()
            code = await self._shutdown(handover=keep_imex)
        self.log.info("agent.exit", code=code)
        return code

    async def _tasks(self, bus: Bus, stop: asyncio.Event) -> None:
        """Run the named tasks until `stop` (or the guard gives up)."""
        guard, reconciler, core, supervisor = (
            self.guard,
            self._reconciler,
            self.core,
            self._parts()[1],
        )
        loops = {
            "events": lambda: self._events_loop(bus),
            "membership": lambda: self._membership_loop(bus),
            "presences": lambda: self.presences.run(bus),
            "reconcile": lambda: reconciler.run(
                core,
                guard,
                dirty=self.dirty,
                stepped=self.stepped,
                changed=self.changed,
                prove=bus.barrier,
                carry=self._do,
            ),
            "probe": lambda: self.probes.run(
                guard,
                supervisor,
                wanted=lambda: core.desired.run,
                members=lambda: {slot: m.node for slot, m in core.desired.members.items()},
            ),
            "report": lambda: self.reporter.run(bus, guard, self.facts),
            "channels": lambda: self.channels.run(guard),
            "rebuild": lambda: self.rebuild.run(bus, guard),
            "watchdog": self._watchdog_loop,
        }
        if self.settings.node.clique == "auto":
            loops["discover"] = lambda: discovery.run(
                guard,
                interval_s=self.settings.node.discover_interval_s,
                found=self._discovered,
                log=self.log,
            )
        async with asyncio.TaskGroup() as tasks:
            running = [guard.start(tasks, name, loop) for name, loop in loops.items()]
            await _first_of(stop, guard.give_up)
            for task in running:
                task.cancel()

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
        core = self.core
        core.start(saved)
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
        will = core.will(wire_now())
        bus = Bus(s.bus, node=self.node, client_id=core.client_id, will=will, verifier=verifier)
        bus.on_counted = self.changed.set  # the bus facts' counters moved (report loop)
        supervisor = Supervisor.from_settings(s, on_change=self._on_daemon_change)
        self.bus, self.supervisor = bus, supervisor
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
        _, supervisor = self._parts()
        shard, reconciler = self.shard, self._reconciler
        budget = self.settings.daemon.stop_timeout_s + SHUTDOWN_MARGIN_S
        try:
            async with asyncio.timeout(budget):
                if handover:
                    self.log.info("agent.handover", pid=supervisor.pid)
                    supervisor.detach()
                    return EXIT_HANDOVER
                self.log.info("agent.leave", domain=shard.current)
                await self._do(self.core.leave(time.time()))
                await reconciler.carry_out(self.core.shutdown())
                await self.channels.clear()
                if shard.published or shard.current is None:
                    await reconciler.clean_up()
        except TimeoutError:
            self.log.error("agent.shutdown_timeout", budget_s=budget)
        except FileWriteError as exc:
            self.log.warning("agent.cleanup_failed", error=str(exc))
        except Exception as exc:
            self.log.error("agent.shutdown_failed", error=describe(exc), exc_info=exc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reconciler.carry_out(self.core.shutdown()), budget)
        return 0

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
                self.state_store.keep(state, metrics=self.metrics)
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
                    async with self.reporter.lock:  # no report after a clear
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

    # -- bus events and membership ---------------------------------------------------

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
            self.presences.synced.set()
        if (sorted_out := self.core.sort(event)) is not None:
            return sorted_out
        # The control plane's records reach the core only when newer than the held ones
        # (imexd.order); a held one takes the place of an older copy or a clear.
        for found in self.rebuild.on_event(event):
            for action in self._feed(BusInput(found)):
                self._do_now(action)
            self.channels.on_event(found)
            if isinstance(found, Connected):
                # The facts name this link's broker, even when it ended before they were
                # judged; everything else in them is read afresh when they are (`facts`).
                self.bus_facts = bus_facts(bus, synced=self.shard.synced, previous=self.bus_facts)
            # Refused: logged by the bus, a lost claim echo re-sent by the shard, in the facts.
            self.changed.set()
        self.rebuild.count_drops(bus)
        return True

    async def _membership_loop(self, bus: Bus) -> None:
        """Retarget and step when woken or when the core's next timer is due."""
        while True:
            self.heartbeats.beat("membership")
            # Nothing due and no record: no step.
            await self.guard.rest("membership", self.wake, self.core.next_due(time.monotonic()))
            self.wake.clear()
            await self._do(self._feed(Retarget()))
            if not self.shard.member:
                # A step that may claim judges the slots with every peer's will in.
                await self.presences.current(bus)
            await self._step(time.monotonic())
            self.presences.follow.set()  # the peers it now holds records of

    async def _step(self, now: float) -> None:
        """One membership step of the core, carried out."""
        happened = Step(channel_count=self.channels.count)
        await self._do(self.core.feed(happened, now=now, wall=wire_now()))
        self.stepped.set()
        self.changed.set()

    # -- daemon, probes, discovery, facts, watchdog ------------------------------------

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

    def _discovered(self, fabric: FabricFacts, found: Discovered | None) -> None:
        """A discovery's outcome: its facts, and the clique into the core."""
        self.fabric = fabric
        if found is not None:
            self._feed(found)
        self.wake.set()
        self.changed.set()

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
