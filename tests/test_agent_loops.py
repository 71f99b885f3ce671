"""The agent's loops, in process, none paced by a clock of its own: how often membership
steps, when a failed discovery is tried again (how often an agent standing aside looks
for a daemon nobody supervises is the core's: tests/test_core.py).

One in-process `Agent` (`test_agent_containment.running_agent`: a real Mosquitto and the
simulated daemon; no broker at all where none is needed); records are handed to its bus
as the link hands over what it read.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from imexd import fabric
from imexd.agent.run import Agent
from imexd.errors import DiscoveryError
from imexd.fabric import Discovery
from imexd.messages import MemberRecord, MemberState, encode
from imexd.settings import settings_from_mapping
from tests.cluster import Node, end_in_process
from tests.support import until
from tests.test_agent_containment import running_agent

WAIT_S = 30.0
NO_BROKER = "mqtt://127.0.0.1:1"
"""Nothing listens there: what is tested needs no bus."""

TURNS = 10
"""Turns of the event loop that a burst may take to reach membership: no clock runs in
them, so a step they hold was taken at once."""


def standby(node: str) -> MemberRecord:
    """A peer waiting for a slot: it changes no daemon, only what the shard holds."""
    return MemberRecord(
        node=node,
        domain="d1",
        clique="c1",
        address="127.0.0.1",
        slot=None,
        incarnation=1,
        state=MemberState.STANDBY,
        max_nodes=8,
        mode="names",
        seq=1,
        link=1,
    )


async def test_a_burst_of_queued_records_costs_one_step_taken_at_once(tmp_path: Path) -> None:
    """Every record queued together is taken in before membership steps, and it steps once
    on all of them; a burst right after that step is stepped on at once too, not held
    back by a pause."""
    async with running_agent(tmp_path) as r:
        agent = r.agent
        bus = agent.bus
        assert bus is not None
        await asyncio.sleep(0.5)  # the start's last steps
        seen: list[set[str]] = []
        step = agent._step

        async def counted(now: float) -> None:
            seen.append(set(agent.shard.records))
            await step(now)

        agent._step = counted  # type: ignore[method-assign]
        for burst in (("p1", "p2", "p3"), ("p4", "p5", "p6")):
            before = len(seen)
            for node in burst:
                topic = agent.topics.member("d1", "c1", node)
                bus._dispatch(topic, encode(standby(node)), retained=False)
            for _ in range(TURNS):
                await asyncio.sleep(0)
            assert len(seen) == before + 1, f"{len(seen) - before} steps for the burst {burst}"
            assert set(burst) <= seen[-1]


def gaps(times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(times)]


@asynccontextmanager
async def failing_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **node: object
) -> AsyncIterator[list[float]]:
    """An agent with `[node] clique = "auto"` (and `node`'s other settings) whose every NVML
    discovery fails: time.monotonic() of each try."""
    tries: list[float] = []

    async def failing(timeout: float) -> Discovery:  # noqa: ASYNC109 - discover's own
        tries.append(time.monotonic())
        raise DiscoveryError("no GPU here")

    monkeypatch.setattr(fabric, "discover", failing)
    folder = Node(tmp_path, "n1", [NO_BROKER], domain="d1", clique="auto")
    folder.sections["node"].update(node)
    agent = Agent(settings_from_mapping(folder.sections, environ={}))
    stop, handover = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(agent.run(stop=stop, handover=handover))
    try:
        yield tries
        assert not task.done(), "the agent ended"
    finally:
        await end_in_process([folder], [(stop, task)], WAIT_S)


async def test_a_failed_discovery_is_tried_again_on_the_local_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed discovery is tried again after 0.5 s, then after twice as long each time
    (jittered down to half), as a failed reconcile round is: not after a fixed wait."""
    async with failing_discovery(tmp_path, monkeypatch) as tries:
        await until(lambda: len(tries) >= 4, within=10.0, what="4 discoveries")
    waits = gaps(tries)
    assert 0.25 <= waits[0] < 1.0, waits
    assert waits[2] >= 1.0 > waits[0], waits  # 1 to 2 s by then


async def test_a_failed_discovery_waits_at_most_the_discovery_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backoff never waits longer than `[node] discover_interval_s`."""
    async with failing_discovery(tmp_path, monkeypatch, discover_interval_s=0.3) as tries:
        await until(lambda: len(tries) >= 5, within=10.0, what="5 discoveries")
    waits = gaps(tries)
    assert max(waits) < 0.3 + 0.5, waits
