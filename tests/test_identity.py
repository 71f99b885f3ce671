"""The identity check: the daemon's own idea of its node id against the node's slot.

IMEX logs `Identified this node as ID <n>` at start (its line in nodes_config.cfg). The
agent reads it from the daemon's output it already tails; a daemon that took another
line than the node's slot is DaemonReady False, IdentityMismatch. The pure comparison is
tested in test_health.py; here the parser, and one real agent with a simulated daemon
that is told to identify as another node (IMEXD_SIM_IDENTIFY_AS).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from imexd.agent.run import Agent
from imexd.daemon.output import identified_id
from imexd.messages import DAEMON_READY
from imexd.settings import settings_from_mapping
from tests.brokers import Mosquitto
from tests.cluster import Node, end_in_process
from tests.support import until

WAIT_S = 30.0


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Identified this node as ID 3, using bind IP of '10.0.0.1'", 3),
        ("Identified this node as ID 12", 12),
        ("Identified this node as ID 0, using bind IP of '10.1.2.3', and network interface", 0),
        ("Treating node config entry 'imex-1a2b3c4d-0000' as a host name.", None),
        ("Attempting connection for target node 6 - x-0006:50000, attempt #161", None),
    ],
)
def test_the_identity_line_is_read_from_the_message(message: str, expected: int | None) -> None:
    """The node id is taken from IMEX's identity line, and from no other line."""
    assert identified_id(message) == expected


async def test_a_daemon_that_identifies_as_another_node_is_an_identity_mismatch(
    tmp_path: Path,
) -> None:
    """A real agent, a simulated daemon logging ID 5 in slot 0: DaemonReady False,
    IdentityMismatch naming both ids, and the node is not ready."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1")
    node.sections["imex"]["env"]["IMEXD_SIM_IDENTIFY_AS"] = "5"
    agent = Agent(settings_from_mapping(node.sections, environ={}))
    stop, handover = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(agent.run(stop=stop, handover=handover))

    def daemon_ready() -> tuple[str, str, str] | None:
        for c in agent.health.conditions:
            if c.type == DAEMON_READY:
                return c.status, c.reason, c.message
        return None

    try:
        await until(
            lambda: task.done() or (daemon_ready() or ("", "", ""))[1] == "IdentityMismatch"
        )
        assert not task.done(), "the agent ended"
        status, _, message = daemon_ready() or ("", "", "")
        assert status == "False"
        assert "identified this node as ID 5, but its slot is 0" in message
        assert agent.facts().daemon.identified == 5
        assert not agent.health.is_ready
    finally:
        await end_in_process([node], [(stop, task)], WAIT_S)
        broker.stop()
