"""The agent's loops, in process: how often membership steps, and when a failed local
action or a look around is tried again, with no clock of their own.

One in-process `Agent` (`test_agent_containment.running_agent`: a real Mosquitto and the
simulated daemon, or no broker at all where none is needed); records are handed to its
bus as the link hands over what it read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from imexd.messages import MemberRecord, MemberState, encode
from tests.test_agent_containment import running_agent

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
