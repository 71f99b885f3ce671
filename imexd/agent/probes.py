"""The agent's probes of its running daemon: when to ask `ctl`, and what it last said.

`ctl -q` runs `STARTING_PROBE_S` after a start and after the last one ended while the
daemon is STARTING (READY makes it RUNNING at once: `[daemon] start_s` bounds a start,
it is not a wait), then every `[daemon] probe_interval_s`; counted from the end, so that
slow probes on a busy host do not run back to back. `ctl -N -j` runs in a short series
once a start's `ctl -q` says READY and after every SIGUSR1 that was delivered
(`DOMAIN_PROBE_SERIES_S`), until it shows every member connected, and every `[daemon]
domain_probe_interval_s` of a RUNNING daemon, counted from its start: a daemon that has
not said READY has no links to show, so nothing asks for them sooner. A membership
change alone probes nothing: its SIGUSR1, paced by the daemon's reload window, starts
the series when it is sent. How the ctl runs (bounded, killed with its process group) is
`imexd.daemon.ctl`.

The daemon's own words come first: while it is not READY, or a member is missing from
its links, every new line it writes is probed at once (`on_output`; coalesced, at most
one probe per `HEARD_GAP_S`), and its output is read closely until READY. `ctl` stays
the truth, so the wording of the daemon's lines does not matter.
"""

from __future__ import annotations

import asyncio
import bisect
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

DOMAIN_PROBE_SERIES_S: Final = (0.2, 0.5, 1.0, 2.0, 4.0)
"""Seconds after a start's READY or a SIGUSR1 at which `ctl -N -j` runs until it shows every
member connected: the daemons reconnect at once (the real one retries every 0.5 to 3 s), so
a series finds the links without guessing one delay; then `domain_probe_interval_s`."""
STARTING_PROBE_S: Final = 0.2
"""Seconds from a start, and from one `ctl -q` probe's end, to the next probe while the
daemon is STARTING: READY makes it RUNNING."""
HEARD_GAP_S: Final = 0.05
"""The least time between two probes that the daemon's lines asked for (a chatty daemon
must not keep `ctl` running back to back)."""


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
        """The daemon's state word from `ctl -q` ("" while none was read)."""
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
        self._heard_probe = 0.0
        """time.monotonic() of the last probe its lines asked for."""
        self._said_ready = False
        """The `ctl -q` being handled said READY: the RUNNING it causes needs no other."""
        self._await_ready = False
        """This daemon's READY has not been read yet: when it is, the series begins."""
        self._started_at = 0.0
        """time.monotonic() of the daemon's start (or adoption): the periodic domain
        probe counts from it."""
        self._first_probe = 0.0
        """time.monotonic() of a new start's first `ctl -q` (0: none pending)."""
        self._due: list[float] = []
        """time.monotonic() of the pending series of domain probes (DOMAIN_PROBE_SERIES_S)."""
        self._last_domain = 0.0
        """time.monotonic() of the last domain probe's start."""
        self._supervisor: Supervisor | None = None
        self._members: Callable[[], Mapping[int, str]] = dict
        """Slot -> node of the members the daemon was given (the agent's `desired`)."""

    def now(self) -> None:
        """Probe at once (`ctl -q`): the daemon was just started, adopted or restarted."""
        self._now = True
        self._wake.set()

    def on_output(self) -> None:
        """The daemon wrote new lines: news while we wait for its READY or its links."""
        if self.imex_status != "READY" or not self._domain_complete():
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
            self._first_probe = self._started_at + STARTING_PROBE_S
            self._wake.set()
        elif status.reloads_sent > seen[1]:
            self._domain_soon()  # SIGUSR1 delivered: the links move now

    def _domain_soon(self) -> None:
        """Probe the domain DOMAIN_PROBE_SERIES_S after now, until every member is connected."""
        self._due = [time.monotonic() + d for d in DOMAIN_PROBE_SERIES_S]
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
            if self._now:
                self._now = False
                next_local = now
            if self._heard:
                self._heard = False
                soon = max(now, self._heard_probe + HEARD_GAP_S)
                if self.imex_status != "READY":
                    next_local = min(next_local, soon)
                else:
                    bisect.insort(self._due, soon)
                self._heard_probe = soon
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
            # A hung ctl (or IMEX command service) is bounded by probe_timeout_s and shows
            # in DaemonReady; it must not stall this task's heartbeat and fail /healthz.
            bound = s.daemon.probe_timeout_s
            if now >= next_local:
                await guard.beating("probe", self._local(), limit=bound)
                starting = supervisor.state is DaemonState.STARTING
                interval = s.daemon.probe_interval_s
                ended = time.monotonic()
                next_local = ended + (min(STARTING_PROBE_S, interval) if starting else interval)
            due = self._due
            asked = bool(due) and now >= due[0]
            while due and now >= due[0]:
                due.pop(0)
            if (asked or now >= next_domain) and supervisor.state is DaemonState.RUNNING:
                self._last_domain = now
                await guard.beating("probe", self._domain(), limit=bound)
                if self._domain_complete():
                    due.clear()

    async def _local(self) -> None:
        result = await self.prober.local()
        if result.ready and self._await_ready:
            self._await_ready = False
            self._domain_soon()  # now it has links to show
        if self._supervisor is not None:
            self._supervisor.listening = not result.ready  # its READY line is news
            if result.ready:
                self._said_ready = True
                try:
                    self._supervisor.report_ready()  # a STARTING daemon is RUNNING now
                finally:
                    self._said_ready = False
        status = result.state.value if result.state is not None else ""
        error = "" if result.ready or result.state is not None else result.reason
        if not result.ready and result.state is None:
            self.metrics.count_probe_failure("local")
        if (status, error) != (self.imex_status, self.probe_error):
            self.imex_status, self.probe_error = status, error
            self.log.info("probe.local", imex_state=status or None, error=error or None)
            self.on_change()

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
