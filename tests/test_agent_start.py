"""The agent's start and end as an operator meets them: what it says first, and a leave
that ends cleanly when its files cannot be removed.

One in-process `Agent` against a real Mosquitto and the simulated daemon, driven by the
events the CLI's signals set; its log events are read with structlog's `capture_logs`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from imexd.agent.run import Agent
from imexd.errors import FatalError
from imexd.settings import settings_from_mapping
from tests.brokers import Mosquitto
from tests.cluster import Node, end_in_process
from tests.support import until

WAIT_S = 30.0


def _events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


async def test_a_taken_health_port_fails_the_agent_before_it_logs_or_writes(
    tmp_path: Path,
) -> None:
    """The health port is bound first: when it is taken the agent raises the one error
    the CLI prints, having logged nothing (no `agent.start`) and written no state."""
    node = Node(tmp_path, "n1", ["mqtt://127.0.0.1:1"], domain="d1", clique="c1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node.sections["health"]["listen"] = f"127.0.0.1:{port}"
        agent = Agent(settings_from_mapping(node.sections, environ={}))
        with capture_logs() as logs, pytest.raises(FatalError) as failed:
            async with asyncio.timeout(WAIT_S):
                await agent.run(stop=asyncio.Event(), handover=asyncio.Event())
    assert str(failed.value).startswith(f"cannot listen on 127.0.0.1:{port}: ")
    assert "[health] listen" in str(failed.value)
    assert logs == []
    assert not (node.dir / "state").exists()


async def test_a_run_dir_below_a_file_ends_in_a_clean_leave(tmp_path: Path) -> None:
    """A run_dir that became a path below a regular file (after the start's checks):
    the agent keeps retrying the write, and at stop leaves with exit 0 and one warning
    that names the file it could not remove, never `agent.shutdown_failed` or a
    traceback."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    try:
        node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1")
        (tmp_path / "file").write_text("")
        node.sections["imex"]["run_dir"] = str(tmp_path / "file" / "run")
        agent = Agent(settings_from_mapping(node.sections, environ={}))
        stop, handover = asyncio.Event(), asyncio.Event()
        with capture_logs() as logs:
            task = asyncio.create_task(agent.run(stop=stop, handover=handover))
            try:
                await until(
                    lambda: _events(logs, "reconcile.write_failed") or task.done(),
                    within=WAIT_S,
                    what="the agent's first failed write of its IMEX config",
                )
                assert not task.done(), "the agent ended before its first write"
                stop.set()
                async with asyncio.timeout(WAIT_S):
                    code = await task
            finally:
                await end_in_process([node], [(stop, task)], WAIT_S)
    finally:
        broker.stop()
    assert code == 0
    assert _events(logs, "agent.shutdown_failed") == []
    assert not [e for e in logs if "exc_info" in e]
    [warning] = _events(logs, "agent.cleanup_failed")
    config = tmp_path / "file" / "run" / "config.cfg"
    assert warning["error"] == f"cannot remove {config}: Not a directory"
    assert [e["code"] for e in _events(logs, "agent.exit")] == [0]
