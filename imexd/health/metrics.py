"""Prometheus metrics of one agent, in a registry of its own.

Most values are a view of the facts the agent already keeps (daemon state and restarts,
bus link, members, slot, domain state, readiness): they are read from the last
`update_from` snapshot when Prometheus scrapes, so no code path has to remember to bump
a gauge. Events that facts do not carry (a reconcile's duration, a file write, a failed
probe) are counted as they happen. A private `CollectorRegistry` keeps tests and several
agents in one process (the demo, scenario tests) from sharing series.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from imexd import __version__, messages
from imexd.facts import DAEMON_STATES, Facts
from imexd.health import fleet
from imexd.messages import Condition, DropReason

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
"""The Content-Type of `render()`: the Prometheus text format 0.0.4."""

FILES: Final = ("config.cfg", "nodes_config.cfg", "hosts", "state")
"""The `file` label values pre-created at zero, so rates work from the first write."""
PROBE_KINDS: Final = ("local", "domain")
"""The `kind` label values of probe failures: `ctl -q`, `ctl -N -j`, bus round trip."""
CHANNEL_OPS: Final = ("mknod", "fix", "remove", "cdi", "env")
"""The `op` label values of imexd_channel_operations_total, shown from zero."""
CHANNEL_RESULTS: Final = ("ok", "error")
RESTORED_KINDS: Final = ("spec", "workload", "assignment")
"""The `kind` label values of imexd_broker_records_restored_total, shown from zero."""
RECONCILE_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The agent's metrics; `render()` is what `/metrics` serves."""

    def __init__(self, *, version: str = __version__) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._version = version
        self._facts: Facts | None = None
        self._ready = False
        self._conditions: tuple[Condition, ...] = ()
        self.registry.register(_FactsCollector(self))
        self._reconcile = Histogram(
            "imexd_reconcile_seconds",
            "Seconds one reconcile took (membership change to files written and daemon signalled).",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self._writes = Counter(
            "imexd_file_writes",
            "Files written (config.cfg, nodes_config.cfg, hosts, state).",
            ["file"],
            registry=self.registry,
        )
        self._write_failures = Counter(
            "imexd_file_write_failures",
            "File writes that failed (the previous file was left intact).",
            ["file"],
            registry=self.registry,
        )
        self._probe_failures = Counter(
            "imexd_probe_failures",
            "Probes that failed or timed out, by kind (local: ctl -q, domain: ctl -N -j, "
            "ping: bus round trip).",
            ["kind"],
            registry=self.registry,
        )
        self._task_failures = Counter(
            "imexd_task_failures",
            "Unexpected errors that ended one of the agent's tasks, which was restarted with "
            "backoff (the IMEX daemon is left alone), by task.",
            ["task"],
            registry=self.registry,
        )
        self._rebuilds = Counter(
            "imexd_broker_rebuilds",
            "Links on which the agent found that the broker had lost its retained state (the "
            "epoch record its previous link saw was gone or replaced) and gave back what it "
            "follows (imexd.agent.rebuild).",
            registry=self.registry,
        )
        self._restored = Counter(
            "imexd_broker_records_restored",
            "Control-plane records (spec, workload, assignment) the agent published again "
            "to a broker that had lost them, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self._unconfirmed = Counter(
            "imexd_broker_restores_unconfirmed",
            "Restored records the broker did not give back within a few seconds (an ACL "
            "that does not grant agents the rebuild).",
            registry=self.registry,
        )
        for kind in RESTORED_KINDS:
            self._restored.labels(kind=kind)
        for name in FILES:
            self._writes.labels(file=name)
            self._write_failures.labels(file=name)
        for kind in PROBE_KINDS:
            self._probe_failures.labels(kind=kind)

    def update_from(self, facts: Facts, conds: Sequence[Condition]) -> None:
        """Take the snapshot that the fact-derived series show from now on."""
        self._facts = facts
        self._ready = messages.ready(conds)
        self._conditions = tuple(conds)

    def observe_reconcile(self, seconds: float) -> None:
        self._reconcile.observe(seconds)

    def count_write(self, file: str, *, ok: bool) -> None:
        """Count one write of `file` (a base name such as "hosts"), failed or not."""
        self._writes.labels(file=file).inc()
        if not ok:
            self._write_failures.labels(file=file).inc()

    def count_probe_failure(self, kind: str) -> None:
        """Count one failed probe of `kind` (see PROBE_KINDS)."""
        self._probe_failures.labels(kind=kind).inc()

    def known_task(self, task: str) -> None:
        """Show imexd_task_failures_total of `task` from zero (the guard starts it)."""
        self._task_failures.labels(task=task)

    def count_task_failure(self, task: str) -> None:
        """Count one unexpected error that ended the agent's task `task`."""
        self._task_failures.labels(task=task).inc()

    def count_rebuild(self) -> None:
        """Count one link whose broker had lost its retained state."""
        self._rebuilds.inc()

    def count_restored(self, kind: str) -> None:
        """Count one record of `kind` (see RESTORED_KINDS) given back to the broker."""
        self._restored.labels(kind=kind).inc()

    def count_unconfirmed_restores(self, count: int) -> None:
        """Count restored records that did not come back from the broker."""
        self._unconfirmed.inc(count)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (content type CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def _collect_facts(self) -> Iterable[Metric]:
        f = self._facts
        if f is None:
            return
        d, bus = f.daemon, f.bus

        condition = GaugeMetricFamily(
            "imexd_condition",
            "1 per condition of the node's health with its current status and reason "
            "(the HealthReport's conditions: alert on a reason such as PublishRefused, "
            "NodeMapMismatch or BrokerNoRetainedWildcard).",
            labels=["type", "status", "reason"],
        )
        for c in self._conditions:
            condition.add_metric([c.type, c.status, c.reason], 1.0)
        yield condition

        state = GaugeMetricFamily(
            "imexd_daemon_state",
            "1 for the supervisor's current state of the IMEX daemon, 0 for the others.",
            labels=["state"],
        )
        for name in DAEMON_STATES:
            state.add_metric([name], 1.0 if d.state == name else 0.0)
        yield state
        yield CounterMetricFamily(
            "imexd_daemon_restarts",
            "Restarts of an IMEX daemon that had been running and exited unplanned "
            "(running jobs lost their imports), since the agent started; a planned stop "
            "or restart does not count.",
            d.restarts,
        )
        yield CounterMetricFamily(
            "imexd_daemon_start_failures",
            "IMEX daemon starts that never reached RUNNING (missing binary, immediate exit).",
            d.start_failures,
        )
        yield CounterMetricFamily(
            "imexd_daemon_reloads", "SIGUSR1 reloads sent to the IMEX daemon.", d.reloads
        )
        yield GaugeMetricFamily(
            "imexd_bus_connected", "1 while connected to a broker.", 1.0 if bus.connected else 0.0
        )
        yield CounterMetricFamily(
            "imexd_bus_reconnects", "Reconnections to the broker.", bus.reconnects
        )
        yield CounterMetricFamily(
            "imexd_bus_stale_retained",
            "Retained copies dropped because a live message on their topic came first (a "
            "clustered broker's late snapshot).",
            bus.stale_retained,
        )
        yield CounterMetricFamily(
            "imexd_bus_resync_corrections",
            "Records the periodic re-read of the bus found different from the agent's view "
            "(updates the broker lost).",
            bus.resync_corrections,
        )
        yield CounterMetricFamily(
            "imexd_record_overwritten",
            "Records someone else wrote on this node's member topic (a forged or cloned "
            "record, a second agent with this node name); each was put back by this agent.",
            f.membership.overwritten,
        )
        dropped = CounterMetricFamily(
            "imexd_bus_dropped",
            "Bus messages dropped as invalid, by reason.",
            labels=["reason"],
        )
        for reason in _drop_reasons(bus.dropped):
            dropped.add_metric([reason], bus.dropped.get(reason, 0))
        yield dropped
        yield GaugeMetricFamily(
            "imexd_domain_members",
            "Settled members of the node's (domain, clique).",
            len(f.membership.members),
        )
        yield GaugeMetricFamily(
            "imexd_slot", "The node's slot; -1 without one.", -1 if f.slot is None else f.slot
        )
        yield GaugeMetricFamily(
            "imexd_slot_contested",
            "Slots of the node's (domain, clique) on which another node's member record "
            "stands beside the holder's (a forged record, or both sides of a split); the "
            "holder keeps the slot, SlotSettled reason SlotContested names who contends.",
            len(f.membership.contested),
        )
        judged = fleet.sight(f).state
        domain = GaugeMetricFamily(
            "imexd_domain_state",
            "1 for the domain's state as this node judges it over the members; all 0 "
            "when there is nothing to judge.",
            labels=["state"],
        )
        for name in fleet.SIGHT_STATES:
            domain.add_metric([name], 1.0 if judged == name else 0.0)
        yield domain
        yield GaugeMetricFamily(
            "imexd_ready", "1 when /readyz answers 200.", 1.0 if self._ready else 0.0
        )
        yield from _channel_metrics(f)
        info = GaugeMetricFamily(
            "imexd_info",
            "Constant 1, labelled with who this agent is.",
            labels=["node", "domain", "clique", "version"],
        )
        info.add_metric([f.node, f.domain or "", f.clique, self._version], 1.0)
        yield info


def _channel_metrics(f: Facts) -> Iterable[Metric]:
    """The channel series: one ready gauge per workload (gone with it), the count, the ops."""
    c = f.channels
    ready = GaugeMetricFamily(
        "imexd_channel_ready",
        "1 while the workload's channel device, CDI spec and env file are as its record "
        "asks on this node, 0 while not (the reason is in ChannelsReady).",
        labels=["workload", "channel"],
    )
    for w in c.workloads:
        ready.add_metric([w.workload, str(w.channel)], 1.0 if w.ready else 0.0)
    yield ready
    if c.count is not None:
        yield GaugeMetricFamily(
            "imexd_channel_count", "The driver's ImexChannelCount on this node.", c.count
        )
    ops = CounterMetricFamily(
        "imexd_channel_operations",
        "Operations on the channel device nodes (mknod, fix, remove) and the workloads' "
        "CDI specs and env files, by result.",
        labels=["op", "result"],
    )
    for op in sorted({*CHANNEL_OPS, *(o for o, _ in c.operations)}):
        for result in CHANNEL_RESULTS:
            ops.add_metric([op, result], c.operations.get((op, result), 0))
    yield ops


def _drop_reasons(counts: Mapping[str, int]) -> list[str]:
    return sorted({r.value for r in DropReason} | set(counts))


class _FactsCollector(Collector):
    """Reads the fact-derived series from a Metrics at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics._collect_facts())
