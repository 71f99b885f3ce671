"""Formation with real agents: one daemon start each, with every node that formed with it.

Agent processes against a real Mosquitto (tests/cluster.py). Every wait is bounded;
timings are imexd.demo.timings.FAST.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.cluster import Cluster, formed
from tests.support import IMEXD

pytestmark = pytest.mark.slow


def test_nodes_started_together_start_their_daemons_once_with_everyone(c: Cluster) -> None:
    """`domain create --nodes` for four idle agents: each daemon starts exactly once, with
    the full list, so no SIGUSR1 is ever sent and no daemon is restarted."""
    names = ["n1", "n2", "n3", "n4"]
    nodes = [c.add(n, domain=None) for n in names]
    c.wait(c.all_ready, timeout=60)
    created = subprocess.run(
        [IMEXD, "domain", "create", "d1", "--nodes", ",".join(names)],
        capture_output=True,
        text=True,
        timeout=60,
        env=c.control_env(),
        check=False,
    )
    assert created.returncode == 0, created.stderr
    formed(c, nodes)
    first = {n.name: n.daemon_pid() for n in nodes}
    time.sleep(1.5)  # longer than FAST's reload window: a deferred SIGUSR1 would be sent
    for n in nodes:
        assert n.daemon_starts() == 1, n.name
        assert n.daemon_pid() == first[n.name], n.name
        assert n.status()["daemon"]["restarts"] == 0, n.name
        assert n.log_events("reconcile.reload") == [], n.name
        assert n.reloads() == [], (n.name, n.signals())
        assert [slot for slot in sorted(n.hosts_slots()) if n.hosts_slots()[slot]] == [0, 1, 2, 3]
