"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from imexd.demo.brokers import PORTS_ENV, ephemeral_ports
from tests import cluster, forkserver
from tests.brokers import Mosquitto
from tests.cluster import Cluster, checked


def _declared_length(items: list[pytest.Item], default_s: float) -> tuple[float, bool]:
    """What a module says of its own length: the longest timeout above `default_s` that
    one of its tests declares (0: none) and whether it is a `slow` scenario module."""
    timeouts = [float(m.args[0]) for i in items if (m := i.get_closest_marker("timeout"))]
    longer = max((t for t in timeouts if t > default_s), default=0.0)
    return longer, any(i.get_closest_marker("slow") for i in items)


def pytest_configure(config: pytest.Config) -> None:
    """Fork the scenario agents from tests/forkserver.py's server (the imports of an agent
    are most of its start), and give each xdist worker its own share of the listen ports
    (PORTS_ENV, inherited by the demos and benches it starts): a broker that restarts on
    its port leaves it free for a moment, and a broker of another worker could take it
    meanwhile."""
    cluster.FORK_AGENTS = True
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2:
        return
    low, high = ephemeral_ports()
    ports = [p for p in range(10000, 65536) if not low <= p <= high]
    share = len(ports) // count
    index = int(worker[2:])
    os.environ[PORTS_ENV] = f"{ports[index * share]}-{ports[(index + 1) * share - 1]}"


def pytest_unconfigure(config: pytest.Config) -> None:
    forkserver.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long modules first: a module with a test that declares a longer timeout than the
    default, longest first, then the `slow` scenario modules, then the rest in
    collection order.

    scripts/test hands one module at a time to each worker (`--dist loadfile`, in this
    order with `--no-loadscope-reorder`): a long module picked up last would run on alone
    while the other worker has nothing left.
    """
    default_s = float(config.getini("timeout") or 0)
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(
        modules.values(),
        key=lambda group: tuple(-value for value in _declared_length(group, default_s)),
    )
    items[:] = [item for group in order for item in group]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """A fresh Mosquitto on a free loopback port, stopped after the test."""
    b = Mosquitto(tmp_path / "broker")
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def c(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of agent processes, closed after the test, then checked for leftovers
    (agents or daemons still running) and for tracebacks in every agent's log."""
    yield from checked(tmp_path)
