"""The agent's probes of its running daemon: when to ask `ctl`, and what it last said.

A start is RUNNING once the daemon says READY (`[daemon] start_s` bounds a start, it is
not a wait): in its own output, the line that says its state changed to READY
(`imexd.daemon.output.says_ready`), at once and without a `ctl`; for a daemon that
prints no such line, in the answer of `ctl -q`. After that `ctl` stays the truth: `ctl
-q` runs every `[daemon] probe_interval_s`, counted from the end of the last one so that
slow probes on a busy host do not run back to back, and what it says replaces what the
line said. An answer the ctl gave before a READY line came is older than the line and
does not undo it. `ctl -N -j` runs in a short series once READY is known (from the line
or from ctl) and after every SIGUSR1 that was delivered (`PROBE_SERIES_S`), until
it shows every member connected, and every `[daemon] domain_probe_interval_s` of a
RUNNING daemon, counted from its start: a daemon that has not said READY has no links
to show, so nothing asks for them sooner. A membership change alone probes nothing: its
SIGUSR1, paced by the daemon's reload window, starts the series when it is sent. How the
ctl runs (bounded, killed with its process group) is `imexd.daemon.ctl`.

The daemon's other lines are news while it is not READY (for `ctl -q`) or a member is
missing from its links (for `ctl -N -j`), and its output is read closely until READY. A
start is not probed at its spawn (a process spawned this instant serves no command
yet) but at each line it writes, and on `PROBE_SERIES_S` after it; a silent start that
never says READY is RUNNING at `start_s`, which asks `ctl -q` at once. What bounds the
cost of the lines, since the real daemon logs every reconnect attempt (every 0.5 to 3 s
per unreachable peer, without end): a probe that lines ask for is single-flight (the
lines heard while a probe runs ask for one probe after it, not one each); and outside a
start, lines ask for a probe at once only when the last one of its kind was a timed one:
after a probe that lines asked for, the next waits for its timer. So a daemon that writes
without pause costs at most one probe more per timed one (`probe_interval_s`, the series,
`domain_probe_interval_s`), and its lines never keep `ctl -N -j` running back to back;
only a start, which `start_s` ends, asks `ctl -q` for every line it writes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final

import structlog

from imexd.daemon.ctl import Prober
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.facts import LinkFacts
from imexd.health import fleet
from imexd.health.guard import BEAT_S, Guard
from imexd.health.metrics import Metrics

if TYPE_CHECKING:
    from imexd.daemon.supervisor import Supervisor
    from imexd.settings import Settings

PROBE_SERIES_S: Final = (0.2, 0.5, 1.0, 2.0, 4.0)
"""Seconds after a change at which a probe asks until it sees the change done, so that no
one delay is guessed: after a spawn, `ctl -q` until READY (for a daemon that prints no
READY line; then every `probe_interval_s`); after a start's READY or a SIGUSR1, `ctl -N
-j` until every member shows connected (the daemons reconnect at once, the real one
retries every 0.5 to 3 s; then `domain_probe_interval_s`)."""
READY_LINE = "its output says READY"
"""How a start became RUNNING when the daemon's own line said READY (`report_ready`)."""


class DaemonProbes:
    """What the last probes said (`imex_status`, `probe_error`, `domain_view`) and the
    task that keeps asking (`run`); `on_change` is called whenever one of them moved."""

    def __init__(
        self,
        settings: Settings,
        prober: Prober,
        *,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        on_change: Callable[[], object],
    ) -> None:
        self.settings = settings
        self.prober = prober
        self.metrics = metrics
        self.log = log
        self.on_change = on_change
        self.imex_status = ""
        """The daemon's state word from `ctl -q`, or READY from its own line ("" while
        this daemon said none)."""
        self.probe_error = ""
        """Why `ctl -q` gave no state word ("" when it did)."""
        self.domain_view: LinkFacts | None = None
        """What the last `ctl -N -j` showed of the members' links (None: not probed)."""
        self._now = False
        """Probe at once (`ctl -q`, and `ctl -N -j` unless a series is pending)."""
        self._wake = asyncio.Event()
        """Look at the flags and timers again."""
        self._heard = False
        """The daemon wrote lines since the last look (`on_output`)."""
        self._local_by_line = False
        """The last `ctl -q` was one that lines asked for: outside a start, the next waits
        for its timer."""
        self._domain_by_line = False
        """The last `ctl -N -j` was one that lines asked for: the next waits for its timer."""
        self._ready_lines = 0
        """How many READY lines this agent read: a `ctl -q` answer that began before the
        last one is older than it."""
        self._said_ready = False
        """A READY being handled makes the daemon RUNNING: that RUNNING needs no probe."""
        self._await_ready = False
        """This daemon's READY has not been read yet: when it is, the series begins."""
        self._started_at = 0.0
        """time.monotonic() of the daemon's start (or adoption): the periodic domain
        probe counts from it."""
        self._first_probe = 0.0
        self._local_ended = -math.inf
        """time.monotonic() of the last answer to `ctl -q`, or of a READY line."""
        self._starting: list[float] = []
        """time.monotonic() of the `ctl -q` probes left of a start's series
        (PROBE_SERIES_S), for a daemon that prints no READY line."""
        """time.monotonic() of a new start's first timed `ctl -q` (0: none pending)."""
        self._due: list[float] = []
        """time.monotonic() of the pending series of domain probes (PROBE_SERIES_S)."""
        self._last_domain = 0.0
        """time.monotonic() of the last domain probe's start."""
        self._supervisor: Supervisor | None = None
        self._members: Callable[[], Mapping[int, str]] = dict
        """Slot -> node of the members the daemon was given (the agent's `desired`)."""

    def now(self) -> None:
        """Probe at once (`ctl -q`): the daemon was just started, adopted or restarted."""
        self._now = True
        self._wake.set()

    def on_output(self, ready: bool) -> None:
        """The daemon wrote new lines (`ready`: one says it is READY): news while we wait
        for its READY or its links; a READY line is its READY at once."""
        supervisor = self._supervisor
        running = (DaemonState.STARTING, DaemonState.RUNNING)
        if ready and supervisor is not None and supervisor.state in running:
            self._ready_lines += 1
            self._ready(READY_LINE)
            self._status("READY", "", "line")
        elif self.imex_status != "READY" or not self._domain_complete():
            self._heard = True
            self._wake.set()

    def on_daemon_change(self, status: DaemonStatus, seen: tuple[DaemonState, int]) -> None:
        """The supervisor's news, `seen` being (state, reloads_sent) before it."""
        if status.state is not seen[0]:
            self._wake.set()  # whether there is a daemon to probe at all
        if status.state is DaemonState.RUNNING and seen[0] is not DaemonState.RUNNING:
            if not self._said_ready:  # RUNNING by `start_s` or by adoption: ask it now
                if seen[0] is not DaemonState.STARTING:  # adopted: it started before us
                    self._await_ready, self._started_at = True, time.monotonic()
                self.now()
        elif status.state is DaemonState.STARTING and seen[0] is not DaemonState.STARTING:
            # Not at once: a process spawned this instant serves no command yet. Its
            # lines (`on_output`) ask sooner; READY makes it RUNNING.
            self._await_ready, self._started_at = True, time.monotonic()
            # A daemon that prints no READY line is asked on the series, not a whole
            # probe interval later; its lines ask sooner.
            self._starting = [self._started_at + d for d in PROBE_SERIES_S]
            self._first_probe = self._starting.pop(0)
            self._heard = self._local_by_line = self._domain_by_line = False
            if self.imex_status or self.probe_error:  # a new daemon has said nothing yet
                self.imex_status, self.probe_error = "", ""
                self.on_change()
            self._wake.set()
        elif status.reloads_sent > seen[1]:
            self._domain_soon()  # SIGUSR1 delivered: the links move now

    def _domain_soon(self) -> None:
        """Probe the domain PROBE_SERIES_S after now, until every member is connected."""
        self._due = [time.monotonic() + d for d in PROBE_SERIES_S]
        self._wake.set()

    def _domain_complete(self) -> bool:
        """Whether the last domain probe shows every member READY and connected."""
        view = self.domain_view
        return (
            view is not None
            and not view.error
            and not view.unreachable
            and set(view.slots) == set(self._members())
        )

    async def run(
        self,
        guard: Guard,
        supervisor: Supervisor,
        *,
        wanted: Callable[[], bool],
        members: Callable[[], Mapping[int, str]],
    ) -> None:
        """The probe task: `wanted()` says whether a daemon should run, `members()` which
        members it was given."""
        s = self.settings
        self._supervisor, self._members = supervisor, members
        supervisor.on_output = self.on_output
        next_local = 0.0
        while True:
            guard.heartbeats.beat("probe")
            since = max(self._started_at, self._last_domain)  # this daemon's last probe
            next_domain = since + s.daemon.domain_probe_interval_s
            periodic = next_domain if supervisor.state is DaemonState.RUNNING else math.inf
            await guard.rest("probe", self._wake, min([next_local, periodic, *self._due[:1]]))
            self._wake.clear()
            now = time.monotonic()
            if self._first_probe:
                next_local, self._first_probe = self._first_probe, 0.0
            elif not self._starting and supervisor.state is DaemonState.RUNNING:
                next_local = max(next_local, self._local_ended + s.daemon.probe_interval_s)
            if self._now:
                self._now = False
                next_local = now
            heard, self._heard = self._heard, False
            if not wanted() or supervisor.state not in (DaemonState.RUNNING, DaemonState.STARTING):
                if self.imex_status or self.probe_error or self.domain_view:
                    self.imex_status, self.probe_error, self.domain_view = "", "", None
                    self.on_change()
                # Nothing to probe. Without a daemon its next start wakes the task
                # (`on_daemon_change`); one that runs unwanted is about to stop: look again.
                self._due.clear()
                idle = supervisor.state not in (DaemonState.RUNNING, DaemonState.STARTING)
                next_local = math.inf if idle else now + BEAT_S
                continue
            # Lines bring the next probe forward: a start's every time, else not twice in
            # a row (the module's docstring says why that bounds their cost).
            starting = supervisor.state is DaemonState.STARTING
            ready = self.imex_status == "READY"
            by_line = heard and not ready and now < next_local
            if by_line and (starting or not self._local_by_line):
                next_local = now
            else:
                by_line = False
            links_by_line = heard and ready and not self._domain_by_line
            # A hung ctl (or IMEX command service) is bounded by probe_timeout_s and shows
            # in DaemonReady; it must not stall this task's heartbeat and fail /healthz.
            bound = s.daemon.probe_timeout_s
            if now >= next_local:
                self._local_by_line = by_line
                await guard.beating("probe", self._local(), limit=bound)
                ended = self._local_ended = time.monotonic()
                series = self._starting
                while series and series[0] <= ended:
                    series.pop(0)
                if supervisor.state is DaemonState.STARTING and series:
                    next_local = min(series[0], ended + s.daemon.probe_interval_s)
                else:
                    next_local = ended + s.daemon.probe_interval_s
            due = self._due
            timed = (bool(due) and now >= due[0]) or now >= next_domain
            while due and now >= due[0]:
                due.pop(0)
            if (timed or links_by_line) and supervisor.state is DaemonState.RUNNING:
                self._domain_by_line = not timed
                self._last_domain = now
                await guard.beating("probe", self._domain(), limit=bound)
                if self._domain_complete():
                    due.clear()

    def _ready(self, detail: str) -> None:
        """The daemon said READY (`detail`: how): a start is RUNNING, its links are news."""
        self._heard = False  # what it wrote before READY asks for nothing more
        self._starting.clear()  # the start's series is over: `ctl -q` at its interval,
        self._local_ended = time.monotonic()  # counted from this answer
        if self._await_ready:
            self._await_ready = False
            self._domain_soon()  # now it has links to show
        supervisor = self._supervisor
        if supervisor is not None:
            supervisor.listening = False
            self._said_ready = True
            try:
                supervisor.report_ready(detail)  # a STARTING daemon is RUNNING now
            finally:
                self._said_ready = False

    def _status(self, status: str, error: str, source: str) -> None:
        """What the daemon's state is now: its word ("" for none), why none was read, and
        who said it (`ctl` or its own `line`)."""
        if (status, error) != (self.imex_status, self.probe_error):
            self.imex_status, self.probe_error = status, error
            self.log.info(
                "probe.local", imex_state=status or None, error=error or None, source=source
            )
            self.on_change()

    async def _local(self) -> None:
        lines = self._ready_lines
        result = await self.prober.local()
        if not result.ready and self._ready_lines != lines:
            return  # the daemon said READY while the ctl ran: its answer is older
        if result.ready:
            self._ready("ctl -q says READY")
        elif self._supervisor is not None:
            self._supervisor.listening = True  # its READY line is news
        status = result.state.value if result.state is not None else ""
        error = "" if result.ready or result.state is not None else result.reason
        if not result.ready and result.state is None:
            self.metrics.count_probe_failure("local")
        self._status(status, error, "ctl")

    async def _domain(self) -> None:
        result = await self.prober.domain()
        if result.status is None:
            self.metrics.count_probe_failure("domain")
            view = LinkFacts(error=result.reason)
        else:
            view = fleet.links(result.status, self._members(), self.settings.domain.mode)
        if view != self.domain_view:
            self.domain_view = view
            self.on_change()
