"""The agent's facts in one snapshot: what health, readiness and the reports judge.

Gathered from the parts that hold them (the node's core, the supervisor, the bus, the
reconciler, the probes, the channels) each time the report loop judges, so that health
reads one immutable `Facts` instead of the agent's moving parts.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from imexd.agent.core import NodeCore
from imexd.agent.probes import DaemonProbes
from imexd.agent.reconcile import Reconciler
from imexd.bus.link import Bus
from imexd.channels.keeper import ChannelKeeper
from imexd.daemon.state import PROBLEMS as DAEMON_PROBLEMS
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.facts import BusFacts, DaemonFacts, FabricFacts, Facts

UNSUPERVISED: Final = "Unsupervised"
"""DaemonReady's reason for a daemon of our config that runs while we stand aside."""


def bus_facts(bus: Bus, *, synced: bool, previous: BusFacts) -> BusFacts:
    """The bus facts as of now (drop counters move without any event)."""
    return BusFacts(  # every field: faster than msgspec.structs.replace
        connected=bus.connected,
        synced=bus.connected and synced,
        broker=bus.broker or previous.broker,
        last_error=bus.last_error or "",
        refused=tuple(sorted(bus.refused_topics)),
        reconnects=bus.reconnects,
        stale_retained=bus.stale_retained,
        resync_corrections=bus.resync_corrections,
        records_put_back=bus.put_back,
        dropped=MappingProxyType(dict(bus.dropped)),
        no_retained_wildcard=bus.no_retained_wildcard,
        retained_not_served=bus.retained_not_served,
        subscribe_refused=bus.subscribe_refused,
        control_key=bus.control_key,
        unverified=bus.unverified,
    )


def gather(
    core: NodeCore,
    *,
    status: DaemonStatus,
    bus: BusFacts,
    reconciler: Reconciler,
    probes: DaemonProbes,
    channels: ChannelKeeper,
    fabric: FabricFacts,
) -> Facts:
    """One snapshot of everything health depends on."""
    shard, desired = core.shard, core.desired
    domain = shard.current[0] if shard.current else None
    reason, message = status.reason or "", status.detail
    last_line = status.last_lines[-1] if status.last_lines else ""
    state, pid = status.state.value, status.pid
    if core.unsupervised is not None and pid is None:
        state, pid, reason = DaemonState.RUNNING.value, core.unsupervised, UNSUPERVISED
        message = (
            f"pid {pid} runs this node's IMEX config, unsupervised: this agent stands "
            "aside for another agent of this node's name and neither adopts nor stops it"
        )
    settings = core.settings
    return Facts(
        node=core.node,
        domain=None if desired.cleanup else domain or core.wanted_domain,
        clique=shard.current[1] if shard.current else (core.clique or ""),
        address=settings.node.address,
        slot=shard.claim.slot,
        incarnation=shard.incarnation,
        driver=core.driver,
        bus=bus,
        membership=shard.facts(desired),
        daemon=DaemonFacts(
            state=state,
            pid=pid,
            restarts=status.restarts,
            start_failures=status.start_failures,
            reloads=status.reloads_sent,
            last_exit=status.last_exit,
            # Only problems are reasons; health names the ordinary states itself.
            reason=reason if reason in DAEMON_PROBLEMS or reason == UNSUPERVISED else "",
            message=message if state != DaemonState.RUNNING.value or reason == UNSUPERVISED else "",
            last_line=last_line,
            write_error=reconciler.write_error,
            write_path=reconciler.write_path,
            write_method=reconciler.write_method,
            imex_status=probes.imex_status,
            probe_error=probes.probe_error,
            identified=status.identified,
        ),
        domain_probe=probes.domain_view,
        fabric=fabric,
        clique_known=core.clique is not None or shard.current is not None,
        mode=settings.domain.mode,
        channels=channels.facts(shard.records.values()),
    )
