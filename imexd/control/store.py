"""What the control plane saw on the bus: the latest retained state, by what it addresses.

Pure: the link feeds it decoded messages (`apply`), the commands ask it questions
(`elsewhere`, `last_seen`, ...) and `summarize` judges every domain it knows with the
fleet's one judgement (`imexd.health.fleet.judge`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from imexd.health.fleet import DomainSummary, SeenReport, judge, seconds_text
from imexd.messages import (
    Assignment,
    Deleted,
    DomainSpec,
    HealthReport,
    MemberRecord,
    MemberState,
    Payload,
    Presence,
    Received,
    WorkloadRecord,
    ended,
    lost_record,
    tombstone,
)
from imexd.order import ORDERED


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A deletion the broker serves (imexd.order): its record, and when the broker will
    drop it (None: unknown)."""

    topic: str
    record: Payload
    expires_at: float | None
    at: float = 0.0
    """When the control plane wrote it (0: unknown)."""


@dataclass(slots=True)
class Store:
    """The latest retained state of the subscribed topics, by what it addresses.

    A tombstone (a spec or workload `deleted`) is no spec or workload here: `tombstones`
    holds it, and `generations` the generation the broker serves on every topic of the
    control plane's records, tombstones included, which the next write raises.
    """

    specs: dict[str, DomainSpec] = field(default_factory=dict)
    members: dict[tuple[str, str, str], MemberRecord] = field(default_factory=dict)
    """(domain, clique, node) -> record, as its node's Last Will leaves it: a record that
    the node's presence, marked lost, ends (`messages.ended`) reads as that will (state
    lost)."""
    written: dict[str, dict[tuple[str, str], MemberRecord]] = field(default_factory=dict)
    """node -> (domain, clique) -> its record as the broker serves it."""
    reports: dict[tuple[str, str], SeenReport] = field(default_factory=dict)
    """(domain, node) -> report."""
    assignments: dict[str, str | None] = field(default_factory=dict)
    """node -> domain (None: an explicit null assignment)."""
    presences: dict[str, Presence] = field(default_factory=dict)
    """node -> the agent's retained presence record."""
    workloads: dict[tuple[str, str], WorkloadRecord] = field(default_factory=dict)
    """(domain, workload) -> record."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Malformed messages ignored, by `messages.DropReason` value."""
    generations: dict[str, int] = field(default_factory=dict)
    """Topic -> the generation of the control-plane record the broker serves there."""
    tombstones: dict[str, Tombstone] = field(default_factory=dict)
    """Topic -> the tombstone the broker serves there."""

    def generation(self, topic: str) -> int | None:
        """The generation the broker serves on `topic` (None: nothing)."""
        return self.generations.get(topic)

    def apply(self, event: Received | Deleted, *, expires_at: float | None = None) -> None:
        """Take one decoded message (an empty payload deletes)."""
        ref = event.ref
        payload = event.payload if isinstance(event, Received) else None
        self.generations.pop(event.topic, None)
        self.tombstones.pop(event.topic, None)
        if isinstance(payload, ORDERED):
            self.generations[event.topic] = payload.generation
            if tombstone(payload):
                self.tombstones[event.topic] = Tombstone(
                    event.topic, payload, expires_at, payload.at
                )
                if not isinstance(payload, Assignment):
                    payload = None  # a spec or workload deleted is none
        match ref.kind:
            case "spec":
                if isinstance(payload, DomainSpec):
                    self.specs[ref.domain] = payload
                else:
                    self.specs.pop(ref.domain, None)
            case "member":
                shards = self.written.setdefault(ref.node, {})
                if isinstance(payload, MemberRecord):
                    shards[(ref.domain, ref.clique)] = payload
                else:
                    shards.pop((ref.domain, ref.clique), None)
                    self.members.pop((ref.domain, ref.clique, ref.node), None)
                self._apply_will(ref.node)
            case "health":
                if isinstance(payload, HealthReport):
                    self.reports[(ref.domain, ref.node)] = SeenReport(payload, expires_at)
                else:
                    self.reports.pop((ref.domain, ref.node), None)
            case "assignment":
                if isinstance(payload, Assignment):
                    self.assignments[ref.node] = payload.domain
                else:
                    self.assignments.pop(ref.node, None)
            case "workload":
                if isinstance(payload, WorkloadRecord):
                    self.workloads[(ref.domain, ref.workload)] = payload
                else:
                    self.workloads.pop((ref.domain, ref.workload), None)
            case "presence":
                if isinstance(payload, Presence):
                    self.presences[ref.node] = payload
                else:
                    self.presences.pop(ref.node, None)
                self._apply_will(ref.node)
            case "ping":
                pass

    def _apply_will(self, node: str) -> None:
        """Set `members` of `node` from what the broker serves and its presence."""
        presence = self.presences.get(node)
        for (domain, clique), record in self.written.get(node, {}).items():
            will = lost_record(record, presence) if presence and ended(record, presence) else None
            self.members[(domain, clique, node)] = will or record

    def records_of(self, domain: str) -> list[MemberRecord]:
        return [r for (d, _, _), r in sorted(self.members.items()) if d == domain]

    def workloads_of(self, domain: str) -> list[WorkloadRecord]:
        return [w for (d, _), w in sorted(self.workloads.items()) if d == domain]

    def reports_of(self, domain: str) -> list[SeenReport]:
        return [s for (d, _), s in sorted(self.reports.items()) if d == domain]

    def assigned_to(self, domain: str) -> list[str]:
        return sorted(n for n, d in self.assignments.items() if d == domain)

    def elsewhere(self, node: str, domain: str) -> list[str]:
        """Why `node` belongs to a live domain other than `domain`, one phrase each: an
        assignment to a domain whose spec exists and is not deleting, or a member record
        in another domain."""
        out: list[str] = []
        other = self.assignments.get(node)
        spec = self.specs.get(other) if other is not None and other != domain else None
        if spec is not None and spec.state != "deleting":
            out.append(f"assigned to {other} (spec generation {spec.generation}, active)")
        out.extend(
            f"{record.state.value} record in {d}"
            for (d, _, n), record in sorted(self.members.items())
            if n == node and d != domain
        )
        return out

    def last_seen(self, node: str) -> tuple[float | None, bool]:
        """When an agent last reported `node` (its presence or a health report, by their
        `at`; None: never), and whether it holds a member record anywhere (a live agent
        keeps one; its will clears it when it dies)."""
        times = [s.report.at for (_, n), s in self.reports.items() if n == node]
        presence = self.presences.get(node)
        if presence is not None:
            times.append(presence.at)
        recorded = any(n == node for _, _, n in self.members)
        return (max(times) if times else None), recorded

    def agent_down(self, node: str, *, now: float) -> str | None:
        """Why the bus says `node`'s agent is gone (None: it does not say so).

        Gone is news, not an age: the agent's presence says it stopped cleanly and nothing
        it wrote since says otherwise, or its will fired (a LOST member record, and no
        later incarnation of the agent has written its presence since; in no domain, its
        presence marked lost). A node whose agent merely went quiet is left to
        `--seen-within`.
        """
        records = [r for (_, _, n), r in self.members.items() if n == node]
        if any(r.state is not MemberState.LOST for r in records):
            return None
        presence = self.presences.get(node)
        if presence is not None and presence.lost:
            return (
                "its agent's link ended without a goodbye (its Last Will is its presence): "
                "the agent died, or lost the broker"
            )
        if presence is not None and presence.stopped is not None:
            later = [s.report.at for (_, n), s in self.reports.items() if n == node]
            if not any(at > presence.stopped for at in later):
                ago = seconds_text(now - presence.stopped)
                return f"its agent stopped {ago} s ago (a clean stop: its last word)"
        if records and (
            presence is None or presence.incarnation <= max(r.incarnation for r in records)
        ):
            where = ", ".join(sorted({r.domain for r in records}))
            return (
                f"its agent's link ended without a goodbye (its will is on the bus in {where}): "
                "the agent died, or lost the broker"
            )
        return None

    def agents_down(self, *, now: float) -> dict[str, str]:
        """`agent_down` of every node the bus holds a presence or a member record of."""
        names = set(self.presences) | {n for _, _, n in self.members}
        return {n: why for n in sorted(names) if (why := self.agent_down(n, now=now))}

    def domains(self) -> list[str]:
        """Every domain with a spec, a member record, a health report or an assignment (to a
        domain whose spec is not a tombstone)."""
        names = set(self.specs)
        names.update(d for d, _, _ in self.members)
        names.update(d for d, _ in self.reports)
        deleted = {
            t.record.domain for t in self.tombstones.values() if isinstance(t.record, DomainSpec)
        }
        names.update(d for d in self.assignments.values() if d is not None and d not in deleted)
        return sorted(names)


def summarize(store: Store, *, now: float, report_interval_s: float) -> list[DomainSummary]:
    """Every domain the bus knows, judged."""
    out = []
    for name in store.domains():
        spec = store.specs.get(name)
        records = store.records_of(name)
        status = judge(
            name,
            spec=spec,
            records=records,
            reports=store.reports_of(name),
            now=now,
            report_interval_s=report_interval_s,
            down=store.agents_down(now=now),
        )
        out.append(
            DomainSummary(
                domain=name,
                spec=spec.state if spec else "-",
                generation=spec.generation if spec else None,
                max_nodes=spec.max_nodes if spec else (records[0].max_nodes if records else None),
                listed=len(spec.nodes) if spec and spec.nodes is not None else None,
                assigned=len(store.assigned_to(name)),
                members=len({r.node for r in records}),
                ready=status.ready,
                state=status.state,
            )
        )
    return out
