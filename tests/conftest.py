"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokers import Mosquitto
from tests.cluster import Cluster, checked


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
