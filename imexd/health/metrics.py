"""Prometheus metrics of one agent, each `Metrics` with series of its own.

Most values are a view of the facts the agent already keeps (daemon state and restarts,
bus link, members, slot, domain state, readiness): they are read from the last
`update_from` snapshot when Prometheus scrapes, so no code path has to remember to bump
a gauge. Events that facts do not carry (a reconcile's duration, a file write, a failed
probe) are counted as they happen. Each `Metrics` holds its own series, so tests and
several agents in one process (the demo, scenario tests) share none. The text format is
written by `imexd.health.exposition`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from imexd import __version__, messages
from imexd.facts import DAEMON_STATES, Facts
from imexd.health import exposition, fleet
from imexd.health.exposition import Counters, Family, Histogram, counter, gauge
from imexd.messages import Condition, DropReason

CONTENT_TYPE: Final = exposition.CONTENT_TYPE
"""The Content-Type of `render()`: the Prometheus text format 0.0.4."""

FILES: Final = ("config.cfg", "nodes_config.cfg", "hosts", "state")
"""The `file` label values pre-created at zero, so rates work from the first write."""
PROBE_KINDS: Final = ("local", "domain")
"""The `kind` label values of probe failures: `ctl -q`, `ctl -N -j`, bus round trip."""
CHANNEL_OPS: Final = ("mknod", "fix", "remove", "cdi", "env")
"""The `op` label values of imexd_channel_operations_total, shown from zero."""
CHANNEL_RESULTS: Final = ("ok", "error")
RESTORED_KINDS: Final = ("spec", "workload", "assignment", "retry")
"""The `kind` label values of imexd_broker_records_restored_total, shown from zero."""
RECONCILE_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The agent's metrics; `render()` is what `/metrics` serves."""

    def __init__(self, *, version: str = __version__) -> None:
        self._version = version
        self._facts: Facts | None = None
        self._ready = False
        self._conditions: tuple[Condition, ...] = ()
        self._reconcile = Histogram(
            "imexd_reconcile_seconds",
            "Seconds one reconcile took (membership change to files written and daemon signalled).",
            RECONCILE_BUCKETS,
        )
        self._writes = Counters(
            "imexd_file_writes",
            "Files written (config.cfg, nodes_config.cfg, hosts, state).",
            ["file"],
        )
        self._write_failures = Counters(
            "imexd_file_write_failures",
            "File writes that failed (the previous file was left intact).",
            ["file"],
        )
        self._probe_failures = Counters(
            "imexd_probe_failures",
            "Probes that failed or timed out, by kind (local: ctl -q, domain: ctl -N -j, "
            "ping: bus round trip).",
            ["kind"],
        )
        self._task_failures = Counters(
            "imexd_task_failures",
            "Unexpected errors that ended one of the agent's tasks, which was restarted with "
            "backoff (the IMEX daemon is left alone), by task.",
            ["task"],
        )
        self._rebuilds = Counters(
            "imexd_broker_rebuilds",
            "Rounds in which the agent gave the broker back control-plane records it follows "
            "that the broker served in an older version or not at all (imexd.agent.rebuild).",
        )
        self._restored = Counters(
            "imexd_broker_records_restored",
            "Control-plane records (spec, workload, assignment, retry request, tombstones "
            "included) the agent published again, verbatim, to a broker that served them "
            "older or not at all, by kind.",
            ["kind"],
        )
        self._unconfirmed = Counters(
            "imexd_broker_restores_unconfirmed",
            "Restored records the broker did not give back within a few seconds (an ACL "
            "that does not grant agents the rebuild).",
        )
        for kind in RESTORED_KINDS:
            self._restored.show(kind)
        for name in FILES:
            self._writes.show(name)
            self._write_failures.show(name)
        for kind in PROBE_KINDS:
            self._probe_failures.show(kind)

    def update_from(self, facts: Facts, conds: Sequence[Condition]) -> None:
        """Take the snapshot that the fact-derived series show from now on."""
        self._facts = facts
        self._ready = messages.ready(conds)
        self._conditions = tuple(conds)

    def observe_reconcile(self, seconds: float) -> None:
        self._reconcile.observe(seconds)

    def count_write(self, file: str, *, ok: bool) -> None:
        """Count one write of `file` (a base name such as "hosts"), failed or not."""
        self._writes.inc(file)
        if not ok:
            self._write_failures.inc(file)

    def count_probe_failure(self, kind: str) -> None:
        """Count one failed probe of `kind` (see PROBE_KINDS)."""
        self._probe_failures.inc(kind)

    def known_task(self, task: str) -> None:
        """Show imexd_task_failures_total of `task` from zero (the guard starts it)."""
        self._task_failures.show(task)

    def count_task_failure(self, task: str) -> None:
        """Count one unexpected error that ended the agent's task `task`."""
        self._task_failures.inc(task)

    def count_rebuild(self) -> None:
        """Count one link whose broker had lost its retained state."""
        self._rebuilds.inc()

    def count_restored(self, kind: str) -> None:
        """Count one record of `kind` (see RESTORED_KINDS) given back to the broker."""
        self._restored.inc(kind)

    def count_unconfirmed_restores(self, count: int) -> None:
        """Count restored records that did not come back from the broker."""
        self._unconfirmed.inc(amount=count)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (content type CONTENT_TYPE)."""
        counted = (
            self._writes,
            self._write_failures,
            self._probe_failures,
            self._task_failures,
            self._rebuilds,
            self._restored,
            self._unconfirmed,
        )
        return exposition.render(
            [*self._collect_facts(), self._reconcile.family(), *(c.family() for c in counted)]
        )

    def _collect_facts(self) -> Iterable[Family]:
        f = self._facts
        if f is None:
            return
        d, bus = f.daemon, f.bus

        condition = gauge(
            "imexd_condition",
            "1 per condition of the node's health with its current status and reason "
            "(the HealthReport's conditions: alert on a reason such as PublishRefused, "
            "NodeMapMismatch or BrokerNoRetainedWildcard).",
            labels=["type", "status", "reason"],
        )
        for c in self._conditions:
            condition.add([c.type, c.status, c.reason], 1.0)
        yield condition

        state = gauge(
            "imexd_daemon_state",
            "1 for the supervisor's current state of the IMEX daemon, 0 for the others.",
            labels=["state"],
        )
        for name in DAEMON_STATES:
            state.add([name], 1.0 if d.state == name else 0.0)
        yield state
        yield counter(
            "imexd_daemon_restarts",
            "Restarts of an IMEX daemon that had been running and exited unplanned "
            "(running jobs lost their imports), since the agent started; a planned stop "
            "or restart does not count.",
            d.restarts,
        )
        yield counter(
            "imexd_daemon_start_failures",
            "IMEX daemon starts that never reached RUNNING (missing binary, immediate exit).",
            d.start_failures,
        )
        yield counter("imexd_daemon_reloads", "SIGUSR1 reloads sent to the IMEX daemon.", d.reloads)
        yield gauge(
            "imexd_bus_connected", "1 while connected to a broker.", 1.0 if bus.connected else 0.0
        )
        yield counter("imexd_bus_reconnects", "Reconnections to the broker.", bus.reconnects)
        yield counter(
            "imexd_bus_stale_retained",
            "Retained copies dropped because a live message on their topic came first (a "
            "clustered broker's late snapshot).",
            bus.stale_retained,
        )
        yield counter(
            "imexd_bus_resync_corrections",
            "Records the periodic re-read of the bus found different from the agent's view "
            "(updates the broker lost).",
            bus.resync_corrections,
        )
        yield counter(
            "imexd_bus_records_put_back",
            "Records of this node other than its member record (its health report) that "
            "someone wrote over; each was published again by this agent at once.",
            bus.records_put_back,
        )
        yield counter(
            "imexd_record_overwritten",
            "Records someone else wrote on this node's member topic (a forged or cloned "
            "record, a second agent with this node name); each was put back by this agent.",
            f.membership.overwritten,
        )
        dropped = counter(
            "imexd_bus_dropped",
            "Bus messages dropped as invalid, by reason.",
            labels=["reason"],
        )
        for reason in _drop_reasons(bus.dropped):
            dropped.add([reason], bus.dropped.get(reason, 0))
        yield dropped
        yield gauge(
            "imexd_domain_members",
            "Settled members of the node's (domain, clique).",
            len(f.membership.members),
        )
        yield gauge(
            "imexd_slot", "The node's slot; -1 without one.", -1 if f.slot is None else f.slot
        )
        yield gauge(
            "imexd_slot_contested",
            "Slots of the node's (domain, clique) on which another node's member record "
            "stands beside the holder's (a forged record, or both sides of a split); the "
            "holder keeps the slot, SlotSettled reason SlotContested names who contends.",
            len(f.membership.contested),
        )
        judged = fleet.sight(f).state
        domain = gauge(
            "imexd_domain_state",
            "1 for the domain's state as this node judges it over the members; all 0 "
            "when there is nothing to judge.",
            labels=["state"],
        )
        for name in fleet.SIGHT_STATES:
            domain.add([name], 1.0 if judged == name else 0.0)
        yield domain
        yield gauge("imexd_ready", "1 when /readyz answers 200.", 1.0 if self._ready else 0.0)
        yield from _channel_metrics(f)
        info = gauge(
            "imexd_info",
            "Constant 1, labelled with who this agent is.",
            labels=["node", "domain", "clique", "version"],
        )
        info.add([f.node, f.domain or "", f.clique, self._version], 1.0)
        yield info


def _channel_metrics(f: Facts) -> Iterable[Family]:
    """The channel series: one ready gauge per workload (gone with it), the count, the ops."""
    c = f.channels
    ready = gauge(
        "imexd_channel_ready",
        "1 while the workload's channel device, CDI spec and env file are as its record "
        "asks on this node, 0 while not (the reason is in ChannelsReady).",
        labels=["workload", "channel"],
    )
    for w in c.workloads:
        ready.add([w.workload, str(w.channel)], 1.0 if w.ready else 0.0)
    yield ready
    if c.count is not None:
        yield gauge("imexd_channel_count", "The driver's ImexChannelCount on this node.", c.count)
    ops = counter(
        "imexd_channel_operations",
        "Operations on the channel device nodes (mknod, fix, remove) and the workloads' "
        "CDI specs and env files, by result.",
        labels=["op", "result"],
    )
    for op in sorted({*CHANNEL_OPS, *(o for o, _ in c.operations)}):
        for result in CHANNEL_RESULTS:
            ops.add([op, result], c.operations.get((op, result), 0))
    yield ops


def _drop_reasons(counts: Mapping[str, int]) -> list[str]:
    return sorted({r.value for r in DropReason} | set(counts))
