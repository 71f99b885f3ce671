"""Scenarios with real agent processes, a real Mosquitto and simulated IMEX daemons."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import cluster

pytestmark = pytest.mark.slow


def test_four_agents_form_a_domain(tmp_path: Path) -> None:
    """Four agents settle unique slots, map the same hosts, and their daemons start once."""
    with cluster(tmp_path) as c:
        nodes = [c.add(f"n{i}") for i in range(1, 5)]
        c.wait(c.all_ready, timeout=40)
        c.wait(lambda: all(len(n.hosts_slots()) == 8 for n in nodes))
        maps = [{k: v for k, v in n.hosts_slots().items() if v} for n in nodes]
        assert all(m == maps[0] for m in maps)
        assert sorted(maps[0].values()) == sorted(n.address for n in nodes)
        assert sorted(n.slot() for n in nodes) == sorted(maps[0])  # type: ignore[type-var]
        c.wait(lambda: all(n.status()["domain_view"]["status"] == "UP" for n in nodes))
        view = nodes[0].domain_json()
        members = {str(n.slot()) for n in nodes}
        for slot in members:
            entry = view["nodes"][slot]
            assert entry["status"] == "READY"
            assert all(entry["connections"][o]["status"] == "CONNECTED" for o in members)
        assert all(n.status()["daemon"]["restarts"] == 0 for n in nodes)
        for n in nodes:
            starts = [e for e in n.log_events("daemon.state") if e.get("to") == "STARTING"]
            assert len(starts) == 1, n.name
            assert n.daemon_pids_on_host() == [n.daemon_pid()]
