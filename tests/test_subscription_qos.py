"""The QoS each filter is subscribed at (`imexd.bus.repairs.subscription_qos`).

Seen on nats-server 2.14.0: 256 agents in 16 cliques on a three-server cluster did not
form within 47 s, in three runs; their links were lost about three times each, most
with "Operation timed out". NATS makes every QoS 1 subscription a JetStream consumer,
created through the cluster's meta group, and each agent subscribed seven filters at QoS
1. Only the filters whose order a caller judges by need one (the members filter: a
claim settles at its echo; the workloads filter: a channel's first holder keeps it), so
a repaired link (the broker profile of a NATS cluster) subscribes the others, and the
ping, at QoS 0. Mosquitto links keep QoS 1 for everything: Mosquitto sends QoS 0 at once
but holds QoS 1 beyond its in-flight window, so a QoS 0 ping could overtake a QoS 1
snapshot there.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from imexd.bus.events import Synced
from imexd.bus.link import Bus
from imexd.settings import BusSettings
from imexd.topics import Topics
from tests import nats_builds
from tests.nats_servers import Nats
from tests.support import wait_for

TOPICS = Topics("imex/v2")
MEMBERS = TOPICS.members_filter("d1", "c1")
SPEC = TOPICS.spec("d1")
RETRY = TOPICS.retry("d1", "n1")


class RecordingClient:
    """A link whose broker grants everything and keeps each SUBSCRIBE's filters and QoS."""

    v5 = False

    def __init__(self) -> None:
        self.subscribes: list[tuple[list[str], int]] = []

    async def subscribe(self, filters: list[str], *, qos: int = 1) -> list[str | None]:
        self.subscribes.append((list(filters), qos))
        return [None] * len(filters)


def wanting(settings: BusSettings, client_id: str = "imexd-n1") -> Bus:
    bus = Bus(settings, node="n1", client_id=client_id, timeout_s=2.0)
    bus._subs.add([MEMBERS])
    bus._subs.add([SPEC, RETRY], ordered=False)
    return bus


def qos_of(client: RecordingClient) -> dict[str, int]:
    return {f: qos for filters, qos in client.subscribes for f in filters}


async def test_a_repaired_link_subscribes_only_the_ordered_filters_at_qos_1() -> None:
    bus = wanting(BusSettings(url=("mqtt://127.0.0.1:1",), broker="nats"))
    bus._repairing = True
    client = RecordingClient()
    await bus._subscribe(client, [TOPICS.ping("n1"), MEMBERS, SPEC, RETRY])  # type: ignore[arg-type]
    assert qos_of(client) == {MEMBERS: 1, TOPICS.ping("n1"): 0, SPEC: 0, RETRY: 0}
    assert client.subscribes[0] == ([MEMBERS], 1), "the ordered filters first"
    assert bus._subs.granted == {TOPICS.ping("n1"), MEMBERS, SPEC, RETRY}


async def test_a_link_without_repairs_subscribes_everything_at_qos_1_at_once() -> None:
    bus = wanting(BusSettings(url=("mqtt://127.0.0.1:1",), broker="mosquitto"))
    client = RecordingClient()
    await bus._subscribe(client, [TOPICS.ping("n1"), MEMBERS, SPEC, RETRY])  # type: ignore[arg-type]
    assert client.subscribes == [([TOPICS.ping("n1"), MEMBERS, SPEC, RETRY], 1)]


def test_a_filter_wanted_once_as_ordered_stays_ordered() -> None:
    bus = wanting(BusSettings(url=("mqtt://127.0.0.1:1",)))
    assert bus._subs.add([SPEC, MEMBERS], ordered=False) == []
    assert bus._subs.ordered(MEMBERS)
    assert bus._subs.add([SPEC]) == []
    assert bus._subs.ordered(SPEC)
    assert not bus._subs.ordered(TOPICS.ping("n1")), "the ping is not the caller's"


@pytest.fixture(params=nats_builds.PARAMS)
def nats(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Nats]:
    server = Nats(tmp_path / "nats", binary=request.param)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def consumers(server: Nats) -> int:
    """JetStream consumers on the server (its monitoring endpoint `/jsz`)."""
    url = f"http://{server.host}:{server.monitor_port}/jsz"
    with urllib.request.urlopen(url, timeout=5.0) as answer:
        return int(json.load(answer)["consumers"])


async def synced_consumers(server: Nats, broker: str, baseline: int) -> int:
    """The consumers one bus of profile `broker` adds to `server`'s `baseline`, once it
    has synced a members filter (ordered), a spec and a retry filter (not ordered); after
    it closed, its consumers are gone again (waited for, at most 10 s)."""
    settings = BusSettings(url=(server.url,), protocol="3.1.1", broker=broker)  # type: ignore[arg-type]
    bus = wanting(settings, client_id=f"imexd-n1-{broker}")
    async with bus:
        async with asyncio.timeout(20):
            async for event in bus.events():
                if isinstance(event, Synced):
                    break
        added = consumers(server) - baseline
    wait_for(lambda: consumers(server) == baseline, timeout=10.0, interval=0.1)  # bus closed
    return added


@pytest.mark.slow
async def test_on_nats_only_the_ordered_filter_costs_a_consumer(nats: Nats) -> None:
    baseline = consumers(nats)
    assert await synced_consumers(nats, "nats", baseline) == 1
    # The same bus without the repairs: a consumer per filter and one for the ping.
    assert await synced_consumers(nats, "mosquitto", baseline) == 4
