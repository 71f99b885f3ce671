"""The agent: one root coroutine that keeps this node's IMEX daemon in its domain.

`run(settings, stop=..., handover=...)` wires the pieces together and owns their
lifecycle. Named long-lived tasks, each with a heartbeat that /healthz watches:

- `events`: reads the bus (member records of our shard, the domain's spec, our
  assignment, link state) and wakes `membership`;
- `membership`: follows the target (domain, clique), claims a slot with the pure rules
  of `imexd.membership`, publishes our record, and derives what should run (`Desired`);
- `reconcile`: coalesces bursts (`[domain] settle_s`), writes the files and asks the
  supervisor for exactly what the change needs: start, SIGUSR1, restart, or nothing;
- `probe`: `ctl -q` and `ctl -N -j` against the running daemon;
- `report`: turns the facts into conditions, publishes the HealthReport, tells systemd;
- `discover`: NVML fabric discovery when `[node] clique = "auto"`;
- `watchdog`: WATCHDOG=1 to systemd while no task is wedged.

Signals are handled in the CLI layer only: SIGTERM/SIGINT set `stop` (leave: clear our
record, stop the daemon, exit 0), SIGUSR2 sets `handover` too (exit 75 with the daemon
running and the record in place, for the next agent to adopt).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final, TypeVar

from imexd import fleet
from imexd import membership as mb
from imexd.bus import (
    Bus,
    Connected,
    ConnectFailed,
    Disconnected,
    Event,
    Synced,
    WillSpec,
)
from imexd.daemon import Supervisor
from imexd.daemon_state import DaemonState, DaemonStatus
from imexd.errors import DiscoveryError, FileWriteError
from imexd.fabric import discover
from imexd.facts import (
    BusFacts,
    DaemonFacts,
    FabricFacts,
    Facts,
    LinkFacts,
    Member,
    MembershipFacts,
    MembershipState,
)
from imexd.files import remove_stale_temps
from imexd.health import Health, Heartbeats
from imexd.http import HealthServer
from imexd.logs import get_logger
from imexd.messages import (
    Assignment,
    Deleted,
    DomainSpec,
    HealthReport,
    MemberRecord,
    MemberState,
    Presence,
    Received,
    Topics,
)
from imexd.messages import now as wire_now
from imexd.metrics import Metrics
from imexd.probe import Prober
from imexd.reconcile import Desired, Reconciler
from imexd.retry import backoff_delay
from imexd.sdnotify import Notifier
from imexd.settings import Settings
from imexd.state import NodeState, StateStore

EXIT_HANDOVER: Final = 75
"""Exit status after a SIGUSR2 hand-over: the unit restarts the agent (EX_TEMPFAIL)."""
BEAT_S: Final = 1.0
"""Longest sleep of every loop: each beats its heartbeat at least this often."""
DISCOVERY_TIMEOUT_S: Final = 20.0
DISCOVERY_RETRY_S: Final = 30.0
"""Retry delay after a failed discovery (shorter than discover_interval_s)."""
WRITE_RETRY_INITIAL_S: Final = 0.5
WRITE_RETRY_MAX_S: Final = 30.0
DOMAIN_PROBE_AFTER_CHANGE_S: Final = 1.0
"""Delay of the extra domain probe after a change of members."""
SHUTDOWN_MARGIN_S: Final = 5.0
"""Added to [daemon] stop_timeout_s to bound the whole shutdown."""
DOUBT_S: Final = 1.0
"""Member deletions this recent when the link drops are taken back (a broker that shuts
down publishes every will at once, then closes the connections)."""
CONFIRM_MARGIN_S: Final = 2.0
"""Added to [bus] reconnect_max_s: a peer's connect and replay after its last backoff."""
TASK_RESTART_INITIAL_S: Final = 0.5
TASK_RESTART_MAX_S: Final = 30.0
"""Backoff of a task restarted after an unexpected error (capped, jittered)."""
TASK_STABLE_S: Final = 60.0
"""A task that ran this long before failing starts its backoff afresh."""
TASK_FAILURES_TO_EXIT: Final = 10
TASK_FAILURE_WINDOW_S: Final = 300.0
"""This many unexpected errors of one task within the window end the agent as a hand-over
(exit 75, daemon left running, record kept) so that systemd starts a fresh agent."""
SUSPECT_LOSSES: Final = 2
"""Link losses during the watch of a record of our name that make it a live duplicate."""
WORK_MARGIN_S: Final = 10.0
"""Beyond its own bound, how long a task's awaited work may keep its heartbeat alive."""

_T = TypeVar("_T")


class Agent:
    """The agent's state and tasks; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.node = settings.node.name
        self.topics = Topics(settings.bus.topic_prefix)
        self.log = get_logger("agent", node=self.node)
        self.state_store = StateStore(settings.node.state_dir)
        self.saved = NodeState()
        self.incarnation = 0
        self.heartbeats = Heartbeats()
        self.metrics = Metrics()
        self.notifier = Notifier.from_env()
        self.health = Health(Facts(node=self.node, address=settings.node.address))
        self.prober = Prober.from_settings(settings)
        self.bus: Bus | None = None
        self.supervisor: Supervisor | None = None

        # Inputs of membership.
        self.static_domain = settings.domain.name or None
        self.assigned_domain: str | None = None
        configured = settings.node.clique
        self.clique: str | None = None if configured == "auto" else configured
        self.driver = ""
        self.fabric = FabricFacts(source="nvml" if configured == "auto" else "config")

        # Membership state of the current (domain, clique) shard.
        self.current: tuple[str, str] | None = None
        self.records: dict[str, MemberRecord] = {}
        self.spec: DomainSpec | None = None
        self.claim = mb.ClaimState(node=self.node, incarnation=0)
        self.decision: mb.Decision | None = None
        self.synced = False
        self.sync_after = 0.0
        self.view_ready = asyncio.Event()
        """Set once membership stepped on the current synced snapshot, cleared when the
        link goes: only then does `desired` say what the broker says."""
        self.unconfirmed: set[str] = set()
        """Nodes whose records come from a previous link and were not seen again yet."""
        self.confirm_by: float | None = None
        """time.monotonic() after which the unconfirmed records are dropped."""
        self.deleted: dict[str, tuple[MemberRecord, float]] = {}
        """Peers' records deleted lately, with time.monotonic() of the deletion."""
        self.mismatch: tuple[str, ...] = ()
        self.mismatch_detail = ""
        self.published = False
        """We published a record of this incarnation in the current shard (ours to clear)."""
        self.own_cleared = False
        """Someone cleared our record (a duplicate's will, an operator): publish it again."""
        self.claims_seen: dict[str, tuple[tuple[int, int | None], float]] = {}
        """Peers' claiming records: (incarnation, slot) and the loop time first seen, so
        that claims which never settle stop counting after [domain] claim_stale_s."""
        self.duplicate = ""
        """Set (the why) when another live agent runs as this node: we publish nothing."""
        self.suspect_losses = 0
        """Link losses while `suspect_until` is set (see _on_suspect_link_loss)."""
        self.suspect_until: float | None = None
        """Loop time until which a record of our name that we did not write is watched
        for signs of a live agent before we claim over it."""
        self.released_until = 0.0
        """time.monotonic() until which our slot stays given up (FATAL daemon)."""
        self.wake = asyncio.Event()
        self.wake_at: float | None = None

        # Reconcile state.
        self.desired = Desired()
        self.dirty = asyncio.Event()
        self.reconciler: Reconciler | None = None

        # Probes and reports.
        self.imex_status = ""
        self.probe_error = ""
        self.domain_probe: LinkFacts | None = None
        self.probe_now = asyncio.Event()
        self.domain_probe_at: float | None = None
        self.changed = asyncio.Event()
        self.report_lock = asyncio.Lock()
        """Held while a report is published and while our records are cleared, so that
        no report follows a clear."""
        self.bus_facts = BusFacts()
        self.give_up = asyncio.Event()
        """Set when a task keeps failing: the agent exits as in a hand-over."""

    # -- lifecycle ------------------------------------------------------------------

    async def run(self, *, stop: asyncio.Event, handover: asyncio.Event) -> int:
        """Run until `stop`; leave (0) or hand over (EXIT_HANDOVER) when it is set."""
        s = self.settings
        remove_stale_temps(s.config_path)
        remove_stale_temps(s.nodes_config_path)
        remove_stale_temps(s.imex.hosts_file)
        self.saved = self._load_state()
        self.incarnation = self.saved.incarnation
        self.claim = mb.ClaimState(node=self.node, incarnation=self.incarnation)
        self.log.info(
            "agent.start",
            incarnation=self.incarnation,
            previous_domain=self.saved.domain,
            previous_slot=self.saved.slot,
            mode="assigned" if s.domain.assigned else "static",
        )
        bus = Bus(s.bus, node=self.node, client_id=self._client_id)
        supervisor = Supervisor.from_settings(s, on_change=self._on_daemon_change)
        self.bus, self.supervisor = bus, supervisor
        self.reconciler = Reconciler(
            s, supervisor, metrics=self.metrics, log=self.log, current=lambda: self.desired
        )
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(
                HealthServer(
                    s.health.listen,
                    heartbeats=self.heartbeats,
                    health=self.health,
                    metrics=self.metrics,
                )
            )
            await stack.enter_async_context(supervisor)
            await stack.enter_async_context(bus)
            if s.domain.assigned:
                await bus.subscribe(self.topics.assignment(self.node))
            self.notifier.ready()
            failed = False
            try:
                async with asyncio.TaskGroup() as tasks:
                    running = [
                        self._task(tasks, "events", lambda: self._events_loop(bus)),
                        self._task(tasks, "membership", self._membership_loop),
                        self._task(tasks, "reconcile", self._reconcile_loop),
                        self._task(tasks, "probe", self._probe_loop),
                        self._task(tasks, "report", self._report_loop),
                        self._task(tasks, "watchdog", self._watchdog_loop),
                    ]
                    if s.node.clique == "auto":
                        running.append(self._task(tasks, "discover", self._discover_loop))
                    await _first_of(stop, self.give_up)
                    for task in running:
                        task.cancel()
            except Exception as exc:
                failed = True
                self.log.error("agent.failed", error=_describe(exc), exc_info=exc)
            finally:
                self.notifier.stopping()
            # A bug (or a task failing again and again) ends the agent like a hand-over:
            # the daemon keeps running and our record stays, for the next agent to adopt.
            keep_imex = handover.is_set() or failed or self.give_up.is_set()
            code = await self._shutdown(handover=keep_imex)
        self.log.info("agent.exit", code=code)
        return code

    def _task(
        self,
        group: asyncio.TaskGroup,
        name: str,
        loop: Callable[[], Coroutine[Any, Any, None]],
    ) -> asyncio.Task[None]:
        self.heartbeats.register(name, BEAT_S)
        return group.create_task(self._guarded(name, loop), name=name)

    async def _guarded(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run one of the agent's loops; restart it with backoff after an unexpected error.

        Containment: no input and no bug in one task may stop or restart the IMEX daemon.
        The error is one `agent.task_failed` event with its traceback and a count in
        imexd_task_failures_total; the other tasks go on. A task that fails
        TASK_FAILURES_TO_EXIT times within TASK_FAILURE_WINDOW_S sets `give_up`, which
        ends the agent as a hand-over.
        """
        failures: list[float] = []
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                await loop()
            except Exception as exc:
                now = time.monotonic()
                if now - started >= TASK_STABLE_S:
                    attempt = 0
                failures = [t for t in failures if now - t <= TASK_FAILURE_WINDOW_S]
                failures.append(now)
                delay = backoff_delay(
                    attempt,
                    TASK_RESTART_INITIAL_S,
                    TASK_RESTART_MAX_S,
                )
                attempt += 1
                self.metrics.count_task_failure(name)
                self.log.error(
                    "agent.task_failed",
                    task=name,
                    error=_describe(exc),
                    failures=len(failures),
                    restart_in_s=round(delay, 2),
                    exc_info=exc,
                )
                if len(failures) >= TASK_FAILURES_TO_EXIT:
                    self.log.error(
                        "agent.giving_up",
                        task=name,
                        failures=len(failures),
                        window_s=TASK_FAILURE_WINDOW_S,
                        why="exiting as a hand-over: the daemon keeps running for the next agent",
                    )
                    self.give_up.set()
                    await asyncio.Event().wait()  # cancelled by run()
                await self._beating(name, asyncio.sleep(delay), limit=delay)
            else:
                return

    async def _beating(self, name: str, work: Coroutine[Any, Any, _T], *, limit: float) -> _T:
        """Await `work` while beating `name`'s heartbeat for at most `limit` + a margin.

        A task waiting on bounded outside work (a ctl probe, a daemon stop) is not wedged:
        /healthz must not fail because IMEX is slow. Past the bound the beats stop, so
        work that never ends still shows as a wedged task.
        """
        job = asyncio.ensure_future(work)
        deadline = time.monotonic() + limit + WORK_MARGIN_S
        try:
            while True:
                done, _ = await asyncio.wait({job}, timeout=BEAT_S)
                if done:
                    return job.result()
                if time.monotonic() < deadline:
                    self.heartbeats.beat(name)
        finally:
            if not job.done():
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job

    async def _shutdown(self, *, handover: bool) -> int:
        """Leave or hand over, bounded by stop_timeout_s + a margin."""
        bus, supervisor = self._parts()
        budget = self.settings.daemon.stop_timeout_s + SHUTDOWN_MARGIN_S
        try:
            async with asyncio.timeout(budget):
                if handover:
                    self.log.info("agent.handover", pid=supervisor.pid)
                    supervisor.detach()
                    return EXIT_HANDOVER
                self.log.info("agent.leave", domain=self.current)
                if self.current is not None and self.published:
                    # Only records this agent wrote: a duplicate never clears the other's.
                    domain, clique = self.current
                    await bus.retain(self.topics.member(domain, clique, self.node), None)
                    await bus.retain(self.topics.health(domain, self.node), None)
                await supervisor.stop("the agent is leaving")
                if self.published or self.current is None:
                    await asyncio.to_thread(self._reconciler.remove_files)
        except TimeoutError:
            self.log.error("agent.shutdown_timeout", budget_s=budget)
        except FileWriteError as exc:
            self.log.warning("agent.cleanup_failed", error=str(exc))
        except Exception as exc:
            self.log.error("agent.shutdown_failed", error=_describe(exc), exc_info=exc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(supervisor.stop("the agent is leaving"), budget)
        return 0

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
        events = aiter(bus.events())
        while True:
            self.heartbeats.beat("events")
            try:
                async with asyncio.timeout(BEAT_S):
                    event = await anext(events)
            except TimeoutError:
                continue
            except StopAsyncIteration:
                await asyncio.Event().wait()  # the bus closed: shutting down
                return
            self._on_event(event, bus)

    def _on_event(self, event: Event, bus: Bus) -> None:
        if isinstance(event, Connected):
            # Keep the records of the previous link until the new one confirms them: a
            # broker that restarted without its retained state gets them back only as
            # the peers reconnect, and dropping them meanwhile would rewrite the hosts
            # block and send SIGUSR1 twice for a membership that never changed.
            self.unconfirmed = set(self.records)
            self.confirm_by = None
            self._unsync()
        elif isinstance(event, Disconnected):
            self._unsync()
            self._doubt_recent_deletions()
            if event.taken_over:
                self._on_taken_over()
            elif not event.deliberate and self.suspect_until is not None:
                self._on_suspect_link_loss()
        elif isinstance(event, ConnectFailed):
            self._unsync()
        elif isinstance(event, Synced):
            if event.at >= self.sync_after:
                self.synced = True
                if self.unconfirmed and self.confirm_by is None:
                    self.confirm_by = time.monotonic() + self._confirm_grace_s
        elif isinstance(event, Received):
            self._on_received(event)
        elif isinstance(event, Deleted):
            ref = event.ref
            if ref.kind == "member" and (ref.domain, ref.clique) == self.current:
                record = self.records.pop(ref.node, None)
                self.unconfirmed.discard(ref.node)
                self.claims_seen.pop(ref.node, None)
                if record is not None and ref.node != self.node:
                    self._remember_deletion(record)
                if ref.node == self.node:
                    self.own_cleared = self.published
                    if self.duplicate:
                        self._duplicate_gone(bus)
            elif ref.kind == "spec" and self.current and ref.domain == self.current[0]:
                self.spec = None
            elif ref.kind == "assignment" and ref.node == self.node:
                self.assigned_domain = None
        # Refused: the bus logged it (bus_publish_refused); the facts carry it below.
        self._refresh_bus_facts(bus)
        self.wake.set()
        self.changed.set()

    def _unsync(self) -> None:
        self.synced = False
        self.view_ready.clear()

    def _refresh_bus_facts(self, bus: Bus) -> BusFacts:
        """The bus facts as of now (drop counters move without any event)."""
        self.bus_facts = replace(
            self.bus_facts,
            connected=bus.connected,
            synced=bus.connected and self.synced,
            broker=bus.broker or self.bus_facts.broker,
            last_error=bus.last_error or "",
            refused=tuple(sorted(bus.refused_topics)),
            reconnects=bus.reconnects,
            dropped=MappingProxyType(dict(bus.dropped)),
        )
        return self.bus_facts

    def _remember_deletion(self, record: MemberRecord) -> None:
        now = time.monotonic()
        self.deleted = {
            node: (r, at) for node, (r, at) in self.deleted.items() if now - at <= DOUBT_S
        }
        self.deleted[record.node] = (record, now)

    def _doubt_recent_deletions(self) -> None:
        """The link dropped: take back the deletions that arrived just before.

        A broker that shuts down publishes every client's will at once, ignoring the
        Will Delay, and then drops the link: those empty records say nothing about the
        peers, which come back with the broker. The records return unconfirmed.
        """
        now = time.monotonic()
        doubted = sorted(
            node
            for node, (_, at) in self.deleted.items()
            if now - at <= DOUBT_S and node not in self.records
        )
        for node in doubted:
            self.records[node] = self.deleted[node][0]
            self.unconfirmed.add(node)
        self.deleted.clear()
        if doubted:
            self.log.info(
                "membership.deletions_doubted",
                nodes=doubted,
                why="they came just before the link dropped (a broker shutting down)",
            )

    @property
    def _confirm_grace_s(self) -> float:
        """How long a record missing from a new link's snapshot is kept.

        After a broker restart every live peer reconnects within its capped reconnect
        backoff and re-publishes its record; a record still missing after that is gone.
        """
        return self.settings.bus.reconnect_max_s + CONFIRM_MARGIN_S

    def _on_received(self, event: Received) -> None:
        ref, payload = event.ref, event.payload
        if ref.kind == "member" and isinstance(payload, MemberRecord):
            if (ref.domain, ref.clique) == self.current:
                self.records[ref.node] = payload
                self.unconfirmed.discard(ref.node)
                self._track_claim(payload)
                if (
                    ref.node == self.node
                    and payload.incarnation != self.incarnation
                    and not event.retained
                    and not self.published
                ):
                    # A live publish of our name that we did not write: another agent
                    # (re)connected and replayed its record.
                    self._found_duplicate(
                        f"incarnation {payload.incarnation} from {payload.address} "
                        "published its record while this agent runs"
                    )
        elif ref.kind == "spec" and isinstance(payload, DomainSpec):
            if self.current is not None and ref.domain == self.current[0]:
                self.spec = payload
        elif ref.kind == "assignment" and isinstance(payload, Assignment) and ref.node == self.node:
            self.assigned_domain = payload.domain

    def _track_claim(self, record: MemberRecord) -> None:
        """Remember since when each peer's claim (incarnation, slot) has stood unchanged."""
        if record.node == self.node or record.state is not MemberState.CLAIMING:
            self.claims_seen.pop(record.node, None)
            return
        key = (record.incarnation, record.slot)
        seen = self.claims_seen.get(record.node)
        if seen is None or seen[0] != key:
            self.claims_seen[record.node] = (key, asyncio.get_running_loop().time())

    # -- duplicate node names -------------------------------------------------------

    @property
    def _client_id(self) -> str:
        return f"imexd-{self.node}"

    def _on_taken_over(self) -> None:
        """The broker handed our session to another client with our client id."""
        if self.duplicate:
            return
        if self.current is not None and not self.published:
            # We have not written anything yet, so the other client is not our own past:
            # another agent runs with this node's name and took the session back.
            self._found_duplicate("the broker handed this node's session to another client")
        else:
            self.log.warning(
                "bus.session_taken_over",
                why="another client connected with this node's client id; "
                "is a second agent running with this node name?",
            )

    def _on_suspect_link_loss(self) -> None:
        """The broker dropped our link while a record of our name stood that we did not write.

        Brokers that send no reason code (MQTT 3.1.1, Mosquitto before 2.0.12) close the
        old link silently when another client takes the session: two agents with one
        name then push each other off at every reconnect. A dead past run of ours does
        not do that, so a second loss within the watch is taken as a live duplicate.
        """
        self.suspect_losses += 1
        if self.suspect_losses >= SUSPECT_LOSSES:
            self._found_duplicate(
                f"the broker closed this node's link {self.suspect_losses} times while a "
                "record of this name that this agent did not write stood: another agent "
                "with this name keeps taking the session back"
            )

    def _found_duplicate(self, why: str) -> None:
        """Another live agent runs as this node: stand aside without touching its state.

        We publish nothing on its topics, run no daemon, drop our will (it would clear the
        other's record) and take another client id so that the two stop taking the
        broker session from each other. We come back once its record is gone.
        """
        if self.duplicate or self.published:
            return
        self.duplicate = why
        self.suspect_until = None
        bus, _ = self._parts()
        self.log.error("membership.duplicate_node", node=self.node, why=why)
        bus.set_will(None)
        bus.set_client_id(f"{self._client_id}-duplicate-{self.incarnation}")
        self.wake.set()
        self.changed.set()

    def _duplicate_gone(self, bus: Bus) -> None:
        """The other agent's record is gone: claim as usual under our own client id."""
        self.log.info("membership.duplicate_gone", node=self.node)
        self.duplicate = ""
        bus.set_client_id(self._client_id)
        if self.current is not None:
            domain, clique = self.current
            bus.set_will(WillSpec(self.topics.member(domain, clique, self.node)))
        self.wake.set()
        self.changed.set()

    def _foreign(self, own: MemberRecord) -> bool:
        """Whether a record of our name may come from another agent, not our past run."""
        return own.incarnation >= self.incarnation or own.address != self.settings.node.address

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
        loop = asyncio.get_running_loop()
        while True:
            self.heartbeats.beat("membership")
            timeout = BEAT_S
            if self.wake_at is not None:
                timeout = max(0.0, min(timeout, self.wake_at - loop.time()))
            if self.confirm_by is not None:
                timeout = max(0.0, min(timeout, self.confirm_by - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            self.wake.clear()
            await self._retarget()
            await self._step(loop.time())

    async def _retarget(self) -> None:
        """Leave the current shard and join the target one when they differ."""
        target = self._target()
        if target == self.current:
            return
        bus, _ = self._parts()
        old = self.current
        if old is not None:
            domain, clique = old
            self.log.info("membership.leave", domain=domain, clique=clique)
            async with self.report_lock:
                self.current = None  # no report for the old shard after the clears
                if self.published:
                    await bus.retain(self.topics.member(domain, clique, self.node), None)
                    await bus.retain(self.topics.health(domain, self.node), None)
            await bus.unsubscribe(self.topics.members_filter(domain, clique))
            await bus.unsubscribe(self.topics.spec(domain))
        self.current = target
        self.published = self.own_cleared = False
        self.claims_seen.clear()
        self.suspect_until = None
        if self.duplicate:
            self.duplicate = ""
            bus.set_client_id(self._client_id)
        self.records.clear()
        self.unconfirmed.clear()
        self.confirm_by = None
        self.deleted.clear()
        self.spec = None
        self._unsync()
        self.claim = mb.ClaimState(node=self.node, incarnation=self.incarnation)
        self.decision = None
        self.wake_at = None
        if target is None:
            bus.set_will(None)
            # No domain: clean up. A domain but no clique yet (discovery pending or
            # failing): nothing to run and nothing to remove; the node is not ready.
            self._set_desired(Desired(cleanup=self._wanted_domain is None))
            return
        domain, clique = target
        self.log.info("membership.join", domain=domain, clique=clique or "none")
        # Only a snapshot completed after this point covers the new subscriptions. The
        # will moves to the new member topic, which reconnects (a fresh snapshot).
        self.sync_after = time.monotonic()
        await bus.subscribe(self.topics.spec(domain))
        await bus.subscribe(self.topics.members_filter(domain, clique))
        bus.set_will(WillSpec(self.topics.member(domain, clique, self.node)))

    async def _step(self, now: float) -> None:
        """One membership step: claim, publish, and derive what should run."""
        if self.current is None:
            self.wake_at = None
            return
        if not self.synced:
            return
        self._drop_unconfirmed()
        s = self.settings
        domain, clique = self.current
        if self.spec is not None and self.spec.state == "deleting":
            await self._leave_deleted(domain, clique)
            return
        own = self.records.get(self.node)
        if self.duplicate or self._suspect(own, now):
            # Another agent may run as this node: hold everything, publish nothing.
            self.decision = None
            self._set_desired(Desired(domain=domain, clique=clique))
            self._view_stepped()
            self.changed.set()
            return
        if self.claim.phase is mb.Phase.NONE and own is not None and self._foreign(own):
            # A record of our name that no live agent re-published within the watch: a
            # run of ours whose incarnation we never saved. Outbid it.
            self.incarnation = max(self.incarnation, own.incarnation + 1)
            self.claim = replace(self.claim, incarnation=self.incarnation)
            self._save_state(replace(self.state_store.current, incarnation=self.incarnation))
        previous = (
            self.saved.slot if (self.saved.domain, self.saved.clique) == self.current else None
        )
        stale = mb.stale_claims(
            self.records.values(),
            {node: at for node, (_, at) in self.claims_seen.items()},
            now=now,
            stale_after_s=s.domain.claim_stale_s,
            me=self.node,
        )
        wall = wire_now()
        decision = mb.step(
            self.claim,
            self.records.values(),
            now=now,
            wall_now=wall,
            settle_s=s.domain.settle_s,
            max_nodes=s.domain.max_nodes,
            spec=self.spec,
            previous_slot=previous,
            stale=stale,
            release=self._release_due(),
        )
        if decision.publish or (self.own_cleared and decision.claim.record_state is not None):
            self.own_cleared = False
            await self._publish_claim(decision.claim)
        if self.decision is None or (decision.reason, decision.settled) != (
            self.decision.reason,
            self.decision.settled,
        ):
            self.log.info(
                "membership.step",
                phase=decision.claim.phase.value,
                slot=decision.claim.slot,
                reason=decision.reason.value,
                detail=decision.message,
            )
        self.claim = decision.claim
        self.decision = decision
        self.wake_at = decision.wake_at
        if decision.settled and decision.claim.slot is not None:
            self._save_state(
                NodeState(
                    domain=domain,
                    clique=clique,
                    slot=decision.claim.slot,
                    incarnation=self.incarnation,
                )
            )
        self.mismatch = tuple(
            mb.mismatches(
                self.records.values(),
                max_nodes=s.domain.max_nodes,
                mode=self.settings.domain.mode,
                spec=self.spec,
                stale=stale,
            )
        )
        self.mismatch_detail = ""
        if self.spec is not None and self.spec.max_nodes != s.domain.max_nodes:
            self.mismatch_detail = (
                f"the domain spec says max_nodes {self.spec.max_nodes}, "
                f"this node {s.domain.max_nodes}"
            )
        members = MappingProxyType(
            {
                slot: Member(node, address)
                for slot, (node, address) in decision.members(s.node.address).items()
            }
        )
        # A mismatch keeps the daemon from starting but never stops a running one: its
        # node list is fixed already, and the peers that agree with it would lose it
        # (and the jobs using it) because of one misconfigured newcomer.
        mismatched = bool(self.mismatch or self.mismatch_detail)
        running = self.desired.run and (self.desired.domain, self.desired.clique) == self.current
        run = decision.settled and clique != "" and (not mismatched or running)
        self._set_desired(
            Desired(
                domain=domain,
                clique=clique,
                slot=decision.claim.slot if decision.settled else None,
                run=run,
                members=members,
            )
        )
        self._view_stepped()
        self.changed.set()

    def _suspect(self, own: MemberRecord | None, now: float) -> bool:
        """Whether to keep watching a record of our name that we did not write.

        Before our first publish, such a record is either a past run of ours (its agent
        is gone: nothing re-publishes it) or another live agent with our name (it
        re-publishes on its next reconnect, or takes the broker session back). Watch for
        as long as a peer needs to reconnect after a broker restart.
        """
        if self.published or self.claim.phase is not mb.Phase.NONE:
            return False
        if own is None or not self._foreign(own):
            self.suspect_until = None
            return False
        if self.suspect_until is None:
            self.suspect_until = now + self._confirm_grace_s
            self.suspect_losses = 0
            self.log.info(
                "membership.own_name_seen",
                incarnation=own.incarnation,
                address=own.address,
                watch_s=round(self._confirm_grace_s, 1),
                why="a record of this node name that this agent did not write",
            )
        if now < self.suspect_until:
            self.wake_at = self.suspect_until
            return True
        self.suspect_until = None
        self.log.info("membership.own_name_stale", incarnation=own.incarnation)
        return False

    def _release_due(self) -> bool:
        """Whether to give our slot up: the daemon has been FATAL for release_after_s.

        Latched for claim_stale_s once it fires, so that a waiting node can claim the slot
        before we would take it back.
        """
        s = self.settings
        _, supervisor = self._parts()
        status = supervisor.status
        mono = time.monotonic()
        after = s.daemon.release_after_s
        if (
            after > 0
            and status.state is DaemonState.FATAL
            and status.fatal_since is not None
            and mono - status.fatal_since >= after
        ):
            if mono >= self.released_until:
                self.log.warning(
                    "membership.release", slot=self.claim.slot, fatal_for_s=round(after, 1)
                )
            self.released_until = mono + s.domain.claim_stale_s
        return mono < self.released_until

    def _drop_unconfirmed(self) -> None:
        """Forget the records a new link did not confirm in time, or whose slot moved on.

        A confirmed record on the slot of an unconfirmed one supersedes it at once: the
        slot was freed and taken while this node was away.
        """
        if not self.unconfirmed:
            self.confirm_by = None
            return
        expired = self.confirm_by is not None and time.monotonic() >= self.confirm_by
        taken = {
            r.slot
            for node, r in self.records.items()
            if node not in self.unconfirmed and r.slot is not None
        }
        gone = sorted(
            node for node in self.unconfirmed if expired or self.records[node].slot in taken
        )
        if not gone:
            return
        self.log.info(
            "membership.records_gone", nodes=gone, why="not re-published after a reconnect"
        )
        for node in gone:
            self.records.pop(node, None)
            self.unconfirmed.discard(node)
        if not self.unconfirmed:
            self.confirm_by = None

    async def _leave_deleted(self, domain: str, clique: str) -> None:
        """The control plane deletes the domain: clear our record and stop the daemon."""
        # Cleanup first: it stops the reports, so none follows the clears.
        self._set_desired(Desired(domain=domain, clique=clique, cleanup=True))
        if self.claim.phase is not mb.Phase.OUT:
            self.log.info("membership.domain_deleted", domain=domain)
            bus, _ = self._parts()
            async with self.report_lock:
                if self.published:
                    await bus.retain(self.topics.member(domain, clique, self.node), None)
                    await bus.retain(self.topics.health(domain, self.node), None)
            self.claim = replace(self.claim, phase=mb.Phase.OUT, slot=None)
            self.decision = None
        self._view_stepped()
        self.changed.set()

    def _own_record(self, claim: mb.ClaimState) -> MemberRecord | None:
        state = claim.record_state
        if state is None or self.current is None:
            return None
        domain, clique = self.current
        s = self.settings
        return MemberRecord(
            node=self.node,
            domain=domain,
            clique=clique,
            address=s.node.address,
            slot=claim.slot,
            incarnation=self.incarnation,
            state=state,
            max_nodes=s.domain.max_nodes,
            mode=self.settings.domain.mode,
            driver=self.driver,
            settled=claim.settled,
            released=claim.record_released,
        )

    async def _publish_claim(self, claim: mb.ClaimState) -> None:
        bus, _ = self._parts()
        assert self.current is not None  # noqa: S101 - only called inside a shard
        domain, clique = self.current
        record = self._own_record(claim)
        await bus.retain(self.topics.member(domain, clique, self.node), record)
        self.published = self.published or record is not None

    def _view_stepped(self) -> None:
        """`desired` now follows the synced snapshot (unless the link went meanwhile)."""
        if self.synced:
            self.view_ready.set()

    def _set_desired(self, desired: Desired) -> None:
        if desired != self.desired:
            self.desired = desired
            self.dirty.set()

    # -- reconcile ------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        s = self.settings
        reconciler = self._reconciler
        retry_at: float | None = None
        attempt = 0
        while True:
            self.heartbeats.beat("reconcile")
            timeout = BEAT_S if retry_at is None else max(0.0, retry_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(timeout, BEAT_S)):
                    await self.dirty.wait()
            due = retry_at is not None and time.monotonic() >= retry_at
            if not self.dirty.is_set() and not due:
                continue
            # Coalesce a burst of membership changes into one write and one signal.
            await asyncio.sleep(s.domain.settle_s)
            if self.current is not None and not self.view_ready.is_set():
                # The link dropped meanwhile: what membership saw just before may be a
                # broker's shutdown (it publishes every will first). Apply what it says
                # once it has stepped on the resynced snapshot instead.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BEAT_S):
                        await self.view_ready.wait()
                continue
            self.dirty.clear()
            started = time.monotonic()
            # Starting and stopping the daemon are bounded by the supervisor's timeouts.
            bound = 2 * s.daemon.stop_timeout_s + s.daemon.start_s
            delay = backoff_delay(attempt, WRITE_RETRY_INITIAL_S, WRITE_RETRY_MAX_S)
            try:
                probe = await self._beating(
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
                reconciler.write_error = f"reconcile failed: {_describe(exc)}"
                reconciler.write_path = ""
                retry_at = time.monotonic() + delay
                attempt += 1
                self.log.error(
                    "reconcile.failed",
                    error=_describe(exc),
                    retry_in_s=round(delay, 2),
                    exc_info=exc,
                )
            else:
                retry_at, attempt = None, 0
                reconciler.write_error = reconciler.write_path = ""
                if probe == "now":
                    self.probe_now.set()
                elif probe == "soon":
                    # A new daemon is probed when it turns RUNNING (_on_daemon_change). For
                    # a change of members, one domain probe a little later sees the links
                    # come and go: probing at once would only make every node spawn ctl
                    # processes (and -N asks every peer) at the same instant, before the
                    # paced SIGUSR1 even reached the daemon.
                    self.domain_probe_at = time.monotonic() + DOMAIN_PROBE_AFTER_CHANGE_S
            self.metrics.observe_reconcile(time.monotonic() - started)
            self.changed.set()

    # -- daemon and probes ----------------------------------------------------------

    def _on_daemon_change(self, status: DaemonStatus) -> None:
        if status.state is DaemonState.RUNNING:
            self.probe_now.set()
        self.changed.set()

    async def _probe_loop(self) -> None:
        s = self.settings
        next_local = 0.0
        next_domain = 0.0
        while True:
            self.heartbeats.beat("probe")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BEAT_S):
                    await self.probe_now.wait()
            now = time.monotonic()
            if self.probe_now.is_set():
                self.probe_now.clear()
                next_local = next_domain = now
            _, supervisor = self._parts()
            if not self.desired.run or supervisor.state not in (
                DaemonState.RUNNING,
                DaemonState.STARTING,
            ):
                if self.imex_status or self.probe_error or self.domain_probe:
                    self.imex_status, self.probe_error, self.domain_probe = "", "", None
                    self.changed.set()
                continue
            # A hung ctl (or IMEX command service) is bounded by probe_timeout_s and shows
            # in DaemonReady; it must not stall this task's heartbeat and fail /healthz.
            bound = s.daemon.probe_timeout_s
            if now >= next_local:
                next_local = now + s.daemon.probe_interval_s
                await self._beating("probe", self._probe_local(), limit=bound)
            if self.domain_probe_at is not None and now >= self.domain_probe_at:
                self.domain_probe_at = None
                next_domain = now
            if now >= next_domain:
                next_domain = now + s.daemon.domain_probe_interval_s
                await self._beating("probe", self._probe_domain(), limit=bound)

    async def _probe_local(self) -> None:
        result = await self.prober.local()
        status = result.state.value if result.state is not None else ""
        error = "" if result.ready or result.state is not None else result.reason
        if not result.ready and result.state is None:
            self.metrics.count_probe_failure("local")
        if (status, error) != (self.imex_status, self.probe_error):
            self.imex_status, self.probe_error = status, error
            self.log.info("probe.local", imex_state=status or None, error=error or None)
            self.changed.set()

    async def _probe_domain(self) -> None:
        result = await self.prober.domain()
        if result.status is None:
            self.metrics.count_probe_failure("domain")
            view = LinkFacts(error=result.reason)
        else:
            names = {slot: m.node for slot, m in self.desired.members.items()}
            view = fleet.links(result.status, names, self.settings.domain.mode)
        if view != self.domain_probe:
            self.domain_probe = view
            self.changed.set()

    # -- facts, reports, discovery, watchdog -------------------------------------------

    def facts(self) -> Facts:
        """One snapshot of everything health depends on."""
        _, supervisor = self._parts()
        status = supervisor.status
        decision = self.decision
        domain = self.current[0] if self.current else None
        membership = self._membership_facts(decision)
        reason, message = status.reason or "", status.detail
        last_line = status.last_lines[-1] if status.last_lines else ""
        return Facts(
            node=self.node,
            domain=None if self.desired.cleanup else domain or self._wanted_domain,
            clique=self.current[1] if self.current else (self.clique or ""),
            address=self.settings.node.address,
            slot=self.claim.slot,
            incarnation=self.incarnation,
            driver=self.driver,
            bus=self._refresh_bus_facts(self._parts()[0]),
            membership=membership,
            daemon=DaemonFacts(
                state=status.state.value,
                pid=status.pid,
                restarts=status.restarts,
                start_failures=status.start_failures,
                reloads=status.reloads_sent,
                last_exit=status.last_exit,
                # Only problems are reasons; health names the ordinary states itself.
                reason=reason if reason in ("DaemonCrashLoop", "ConflictingDaemon") else "",
                message=message if status.state is not DaemonState.RUNNING else "",
                last_line=last_line,
                write_error=self._reconciler.write_error,
                write_path=self._reconciler.write_path,
                write_method=self._reconciler.write_method,
                imex_status=self.imex_status,
                probe_error=self.probe_error,
            ),
            domain_probe=self.domain_probe,
            fabric=self.fabric,
            clique_known=self.clique is not None or self.current is not None,
        )

    def _membership_facts(self, decision: mb.Decision | None) -> MembershipFacts:
        s = self.settings
        base = MembershipFacts(max_nodes=s.domain.max_nodes, members=self.desired.members)
        if self.duplicate:
            return replace(base, state="out", reason="DuplicateNode", detail=self.duplicate)
        if self.suspect_until is not None:
            return replace(
                base,
                detail="a record of this node name that this agent did not write is on the "
                "bus; checking whether another agent runs as this node",
            )
        if self.claim.phase is mb.Phase.RELEASED:
            detail = decision.message if decision else "the daemon stayed FATAL"
            return replace(base, state="standby", reason="Released", detail=detail)
        if self.mismatch or self.mismatch_detail:
            detail = self.mismatch_detail or (
                f"max_nodes or mode differ from this node's ({s.domain.max_nodes}, {s.domain.mode})"
            )
            return replace(
                base,
                state="member" if decision and decision.settled else "claiming",
                reason="NodeMapMismatch",
                detail=detail,
                offending=self.mismatch,
            )
        phase = self.claim.phase
        if phase is mb.Phase.OUT:
            if self.desired.cleanup:
                return replace(base, state="leaving", detail="the domain is being deleted")
            return replace(base, state="out", reason="NotInSpec", detail="not in the spec's list")
        if phase is mb.Phase.STANDBY:
            return replace(
                base,
                state="standby",
                reason="DomainFull",
                detail=f"all {s.domain.max_nodes} slots are held",
            )
        state: MembershipState = (
            "member"
            if decision is not None and decision.settled
            else "claiming"
            if phase is mb.Phase.CLAIMING
            else "none"
        )
        return replace(base, state=state, detail=decision.message if decision else "")

    async def _report_loop(self) -> None:
        s = self.settings
        next_report = 0.0
        while True:
            self.heartbeats.beat("report")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BEAT_S):
                    await self.changed.wait()
            self.changed.clear()
            changed = self.health.update(self.facts())
            self.notifier.status(self.health.summary())
            now = time.monotonic()
            if changed or now >= next_report:
                next_report = now + s.health.report_interval_s
                await self._publish_report(self.health.report())

    async def _publish_report(self, report: HealthReport) -> None:
        """Publish our report and presence, unless we are leaving or may be a duplicate.

        Under the lock the leaves take, so that no report follows a clear.
        """
        bus, _ = self._parts()
        if self.duplicate or self.suspect_until is not None:
            return  # those topics may belong to another agent of our name
        await bus.retain(
            self.topics.presence(self.node),
            Presence(
                node=self.node,
                incarnation=self.incarnation,
                at=report.at,
                domain=report.domain,
                address=self.settings.node.address,
            ),
        )
        async with self.report_lock:
            if self.current is None or self.desired.cleanup:
                return
            await bus.retain(
                self.topics.health(self.current[0], self.node),
                report,
                message_expiry_s=3 * self.settings.health.report_interval_s,
            )

    async def _discover_loop(self) -> None:
        s = self.settings
        next_at = 0.0
        while True:
            self.heartbeats.beat("discover")
            if time.monotonic() < next_at:
                await asyncio.sleep(min(BEAT_S, next_at - time.monotonic()))
                continue
            try:
                found = await discover(DISCOVERY_TIMEOUT_S)
            except DiscoveryError as exc:
                self.fabric = FabricFacts(source="nvml", error=str(exc))
                self.log.error("fabric.discovery_failed", error=str(exc))
                next_at = time.monotonic() + min(DISCOVERY_RETRY_S, s.node.discover_interval_s)
            else:
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
            self.heartbeats.beat("watchdog")
            if interval is not None and not self.heartbeats.stale():
                self.notifier.watchdog()
            await asyncio.sleep(min(BEAT_S, interval or BEAT_S))


async def _first_of(*events: asyncio.Event) -> None:
    """Return once any of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def run(settings: Settings, *, stop: asyncio.Event, handover: asyncio.Event) -> int:
    """The root coroutine: run the agent until `stop` (tests drive these events)."""
    return await Agent(settings).run(stop=stop, handover=handover)
