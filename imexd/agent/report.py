"""The `report` task: the facts judged, and what they say told to the bus and systemd.

In a burst of changes the facts are judged at most once per `health.REPORT_PACE_S`, the
first at once (`Pacer`); the daemon's, its probes' and the channels' news at once, never
held by a pause. The HealthReport is published when readiness or a condition moved, a
change of detail only at the schedule's pace, and every `[health] report_interval_s`
(`health.ReportSchedule`); the presence with it, re-sent only when what it says moved or
once per interval. Nothing is published for topics that may be another agent's (a
duplicate of our name), and no report follows the clear of our records (`lock`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from imexd.agent.core import NodeCore
from imexd.agent.pacer import Pacer
from imexd.bus.link import Bus
from imexd.facts import Facts
from imexd.health.conditions import REPORT_PACE_S, Health, ReportSchedule
from imexd.health.guard import Guard
from imexd.health.sdnotify import Notifier
from imexd.messages import HealthReport


class Reporter:
    """The `report` task's state: its pace, schedule and last presence."""

    def __init__(
        self,
        core: NodeCore,
        *,
        health: Health,
        notifier: Notifier,
    ) -> None:
        self.core = core
        self.health = health
        self.notifier = notifier
        self.changed = asyncio.Event()
        """The facts may have moved: judged again (paced)."""
        self.urgent = asyncio.Event()
        """What moved is news a job waits for (the daemon, its probes, the channels):
        judged at once, never paced."""
        self.pace = Pacer(REPORT_PACE_S)
        self.lock = asyncio.Lock()
        """Held while a report is published or our records cleared: no report after a clear."""
        self.presence_said: tuple[int, str | None] | None = None
        self.presence_due = 0.0
        """Wall-clock time of the next presence record (also sent when `presence_said` moves)."""

    async def run(self, bus: Bus, guard: Guard, facts: Callable[[], Facts]) -> None:
        """Judge `facts()` at each change (paced) and publish what the schedule says."""
        interval = self.core.settings.health.report_interval_s
        schedule = ReportSchedule(interval)
        heartbeats, health = guard.heartbeats, self.health
        while True:
            heartbeats.beat("report")
            due = max(0.0, schedule.next_at() - time.monotonic())
            with heartbeats.resting("report"):  # changes in a burst: one turn
                await self.pace.wait(self.changed, due, self.urgent)
            if health.update(facts()):
                schedule.changed(health.gist(), time.monotonic())
            self.notifier.status(health.summary())
            now = time.monotonic()
            if now >= schedule.next_at():
                schedule.published(health.gist(), now)
                await self.publish(bus, health.report())

    async def publish(self, bus: Bus, report: HealthReport) -> None:
        """Publish our report and presence, unless we are leaving or may be a duplicate."""
        core = self.core
        shard, topics = core.shard, core.topics
        interval = core.settings.health.report_interval_s
        if shard.duplicate:
            return  # those topics belong to another agent of our name
        # Presence only says "an agent runs as this node, in this domain": re-sent when
        # that changes or once per report interval, not with every report of a formation.
        said = (shard.incarnation, report.domain)
        if said != self.presence_said or report.at >= self.presence_due:
            self.presence_said, self.presence_due = said, report.at + interval
            presence = shard.presence(report.domain, at=report.at)
            await bus.retain(topics.presence(core.node), presence)
        async with self.lock:
            if (current := shard.current) is None or core.desired.cleanup:
                return
            topic = topics.health(current[0], core.node)
            await bus.retain(topic, report, message_expiry_s=3 * interval)
