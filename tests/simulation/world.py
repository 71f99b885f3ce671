"""One run: the nodes, the broker and the oracle of a schedule, on one clock.

The hostile writer lives here: it writes with a node's credentials on that node's topics
only, its member topic and its presence (the broker's ACL, docs/security.md), while that
node's agent runs and its link stands (so that the node itself sees the record and can
put its own back, and its will ends whatever its records say when the node dies), or
before the node's agent first joins. A forged will is the node's presence marked lost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from imexd.messages import MemberRecord, MemberState, Presence
from tests.simulation.broker import Broker, Payload, Topic, member, presence
from tests.simulation.clock import Clock
from tests.simulation.node import SimNode
from tests.simulation.oracle import RUNAWAY, Broken, Oracle, Violation
from tests.simulation.schedule import Schedule, Step
from tests.simulation.timings import CLIQUE, DOMAIN, WALL_ORIGIN, WILL_DELAY_S

EVENT_BUDGET = 400_000
"""Actions one run may take: far above what a schedule of a few dozen steps needs (a
few thousand), so that a run over it is a loop that never goes quiet."""


@dataclass(slots=True)
class Outcome:
    """What one run of a schedule showed."""

    schedule: Schedule
    violation: Violation | None
    events: int
    notes: list[tuple[float, str]] = field(default_factory=list)
    cause: str = ""
    """Why, when a rule broke (`diagnosis.CAUSES`)."""


class World:
    """The simulated fleet of one schedule."""

    def __init__(self, schedule: Schedule, *, tracing: bool = False) -> None:
        self.schedule = schedule
        self.clock = Clock(random.Random(f"run-{schedule.seed}"), tracing=tracing)
        self.broker = Broker(
            self.clock,
            protocol=schedule.protocol,
            takeover_will=schedule.takeover_will,
            persist_wills=schedule.persist_wills,
            spike_p=schedule.spike_p,
        )
        self.oracle = Oracle(self.clock, self.broker)
        self.broker.oracle = self.oracle
        self.nodes = {
            name: SimNode(
                name,
                index,
                clock=self.clock,
                broker=self.broker,
                oracle=self.oracle,
                protocol=schedule.protocol,
                max_nodes=schedule.max_nodes,
                skew_s=schedule.skews[index],
            )
            for index, name in enumerate(schedule.nodes)
        }
        self.oracle.nodes = self.nodes

    def run(self) -> Outcome:
        clock = self.clock
        for step in self.schedule.steps:
            clock.at(step.at, self._do, step)
        violation = None
        try:
            events = clock.run_until(self.schedule.end, budget=EVENT_BUDGET)
            if events >= EVENT_BUDGET:
                violation = Violation(RUNAWAY, clock.now, f"over {EVENT_BUDGET} actions")
            else:
                self.oracle.final()
        except Broken as broken:
            violation = broken.violation
        why = ""
        if violation is not None:
            from tests.simulation.diagnosis import cause

            why = cause(self, violation)
        return Outcome(self.schedule, violation, clock.events, clock.notes, why)

    def _do(self, step: Step) -> None:
        if self.clock.tracing:
            self.clock.note(f"step: {step}")
        node = self.nodes.get(step.node)
        match step.kind:
            case "broker":
                self.broker.restart(step.span_s, empty=step.empty)
            case "start":
                assert node is not None
                node.start()
            case "crash":
                assert node is not None
                node.crash()
            case "leave":
                assert node is not None
                node.leave()
            case "cut":
                assert node is not None
                node.cut(step.span_s)
            case "slow":
                assert node is not None
                node.slow(step.extra_s, step.span_s)
            case "replay" | "forge" | "place":
                assert node is not None
                self._hostile(step, node)

    def _hostile(self, step: Step, node: SimNode) -> None:
        """The hostile writer's record on `node`'s topic, if it may write there now."""
        link = node.link
        if step.kind == "place":
            allowed = not node.alive
        else:
            allowed = node.alive and link is not None and link.broker_open and self.broker.up
        if not allowed or not self.broker.up:
            return
        written = self._replayed(step, node) if step.kind == "replay" else self._forged(step, node)
        if written is not None:
            self.broker.accept(*written, "hostile")

    def _replayed(self, step: Step, node: SimNode) -> tuple[Topic, Payload] | None:
        """An older record of `node` that the broker once held on one of its topics (a
        will, or a presence that is none, included)."""
        retained = self.broker.retained
        history = self.broker.history.get(node.name, [])
        older = [(t, r) for t, r in history if retained.get(t) != r]
        return older[step.pick % len(older)] if older else None

    def _forged(self, step: Step, node: SimNode) -> tuple[Topic, Payload]:
        """A record `node` never wrote: its name, a state and slot of the writer's choice
        (a will: its presence marked lost), an incarnation at or above the node's,
        sometimes another address."""
        pick, now = step.pick, self.clock.now
        incarnation = node.saved.incarnation + (0 if node.alive else 1) + pick % 3
        slot = (pick >> 2) % self.schedule.max_nodes
        address = "10.66.0.1" if (pick >> 8) % 4 == 0 else node.address
        if step.form == "lost":
            will = Presence(
                node=node.name,
                incarnation=incarnation,
                at=WALL_ORIGIN + now,
                domain=None,
                address=address,
                lost=True,
                link=(pick >> 16) % 4,
                hold_s=0.0 if self.schedule.protocol == "5" else WILL_DELAY_S,
            )
            return presence(node.name), will
        return member(node.name), MemberRecord(
            node=node.name,
            domain=DOMAIN,
            clique=CLIQUE,
            address=address,
            slot=None if step.form == "standby" else slot,
            incarnation=incarnation,
            state=MemberState(step.form),
            max_nodes=self.schedule.max_nodes,
            mode="names",
            settled=WALL_ORIGIN + now - 1000 - (pick >> 10) % 100
            if step.form == "member"
            else None,
            seq=1 + (pick >> 12) % 40,
            link=(pick >> 16) % 4,
        )


def run(schedule: Schedule, *, tracing: bool = False) -> Outcome:
    """Run `schedule` once, deterministically."""
    return World(schedule, tracing=tracing).run()
