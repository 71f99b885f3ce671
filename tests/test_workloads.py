"""Workloads in the control plane: channel allocation, its race, and the commands' output.

The pure parts (lowest free channel, who won a claim, the judgement of a workload) are
tested with plain values; the commands run against a real Mosquitto, in-process, with the
agents' side faked by retained HealthReports that carry a `ChannelsView`, as an agent
publishes them. Concurrent clients race through `workloads.create` on one event loop, and
a raw observer replays every workload record the broker passed on, in its order.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

from imexd.channels.fleet import judge_workload, render_workload_status
from imexd.cli.main import main
from imexd.control import workloads
from imexd.control.commands import load_control_settings
from imexd.control.link import Link, Logged
from imexd.health.fleet import SeenReport
from imexd.messages import (
    CHANNELS_READY,
    ChannelInfo,
    ChannelsView,
    Condition,
    DomainSpec,
    HealthReport,
    Presence,
    WorkloadRecord,
    encode,
)
from imexd.settings import Settings
from imexd.topics import Topics
from tests.brokers import Mosquitto
from tests.reports import member_record, report
from tests.support import cancel_and_wait, raw_client, spy_calls
from tests.test_control import retained, valid

T = Topics("imex/v2")
WAIT_S = 10.0
INTERVAL = 30.0
"""The report interval the control plane is configured with (env fixture)."""


# Pure: picking, racing, judging.


def record(workload: str, channel: int, **fields: Any) -> WorkloadRecord:
    return WorkloadRecord(
        workload=workload, domain=fields.pop("domain", "d1"), channel=channel, **fields
    )


def logged(r: WorkloadRecord | None, workload: str = "") -> Logged:
    name = r.workload if r is not None else workload
    return Logged(T.workload("d1", name), encode(r) if r else b"", r)


def test_lowest_free_starts_at_1_and_stops_below_the_count() -> None:
    """Channel 0 is never picked; nothing is free when 1..count-1 are used."""
    assert workloads.lowest_free([], 4) == 1
    assert workloads.lowest_free([0, 1, 3], 4) == 2
    assert workloads.lowest_free([1, 2, 3], 4) is None
    assert workloads.lowest_free([], 1) is None


def test_the_first_standing_record_on_a_channel_wins() -> None:
    """A rival that arrived before our echo wins, unless it was cleared before it."""
    ours = record("w2", 1, state="claiming")
    rival = record("w1", 1, state="claiming")
    before = [logged(rival)]
    assert workloads.first_rival(before, domain="d1", workload="w2", channel=1) == rival
    assert workloads.first_rival(before, domain="d1", workload="w2", channel=2) is None
    cleared = [logged(rival), logged(None, "w1")]
    assert workloads.first_rival(cleared, domain="d1", workload="w2", channel=1) is None
    own = [logged(ours)]
    assert workloads.first_rival(own, domain="d1", workload="w2", channel=1) is None
    moved = [logged(rival), logged(record("w1", 5))]
    assert workloads.first_rival(moved, domain="d1", workload="w2", channel=1) is None


NOW = 1_800_000_000.0


def channel_report(
    node: str,
    slot: int,
    *,
    infos: list[ChannelInfo] | None = None,
    count: int | None = 8,
    at: float = NOW,
    domain: str = "d1",
) -> HealthReport:
    base = report(node, slot, {slot: node}, at=at, domain=domain)
    view = ChannelsView(count=count, major=242, workloads=infos or []) if count != -1 else None
    return msgspec.structs.replace(base, channels=view)


def info(workload: str, channel: int, generation: int, **fields: Any) -> ChannelInfo:
    return ChannelInfo(
        workload=workload,
        channel=channel,
        generation=generation,
        ready=fields.pop("ready", True),
        **fields,
    )


def judge(rec: WorkloadRecord, *reports: HealthReport, members: tuple[str, ...] = ()) -> Any:
    return judge_workload(
        rec,
        reports=[SeenReport(r) for r in reports],
        members=[member_record(n, i) for i, n in enumerate(members)],
        now=NOW,
        report_interval_s=2.0,
    )


def test_a_workload_is_ready_when_every_listed_node_reports_its_generation_ready() -> None:
    """READY needs the record's channel and generation ready in every fresh report."""
    rec = record("w1", 3, nodes=["n1", "n2"], generation=2)
    good = [info("w1", 3, 2)]
    status = judge(rec, channel_report("n1", 0, infos=good), channel_report("n2", 1, infos=good))
    assert (status.state, status.ready, status.listed) == ("READY", 2, 2)
    old = judge(
        rec,
        channel_report("n1", 0, infos=good),
        channel_report("n2", 1, infos=[info("w1", 3, 1)]),
    )
    assert old.state == "PENDING"
    assert [(r.node, r.reason) for r in old.nodes] == [("n1", ""), ("n2", "OldGeneration")]


def test_a_failure_reason_missing_reports_and_stale_ones_are_told_apart() -> None:
    """An agent's refusal fails; a missing report is pending; a stale one is not ready."""
    rec = record("w1", 1, nodes=["n1", "n2", "n3"], generation=1)
    conflict = info("w1", 1, 1, ready=False, reason="ChannelConflict", message="w9 has it")
    status = judge(
        rec,
        channel_report("n1", 0, infos=[conflict]),
        channel_report("n2", 1, infos=[info("w1", 1, 1)], at=NOW - 7),
    )
    assert status.state == "FAILED"
    rows = {r.node: r for r in status.nodes}
    assert (rows["n1"].reason, rows["n1"].message) == ("ChannelConflict", "w9 has it")
    assert (rows["n2"].reason, rows["n2"].report, rows["n2"].ready) == ("Stale", "stale", False)
    assert (rows["n3"].reason, rows["n3"].pending) == ("NoReport", True)
    text = render_workload_status(status)
    assert text.startswith("workload w1 in d1: FAILED, 0 of 3 nodes ready (channel 1,")
    assert "n1: ChannelConflict: w9 has it" in text


def test_nodes_that_say_the_same_are_named_on_one_line() -> None:
    """Four nodes without a driver give one reasons line naming the four, not four lines."""
    rec = record("w1", 1, nodes=["n1", "n2", "n3", "n4"], generation=1)
    none = info("w1", 1, 1, ready=False, reason="NoChannelDevice", message="no driver")
    other = info("w1", 1, 1, ready=False, reason="MknodFailed", message="EPERM")
    reports = [channel_report(n, i, infos=[none]) for i, n in enumerate(("n1", "n2", "n4"))]
    status = judge(rec, *reports, channel_report("n3", 2, infos=[other]))
    details = render_workload_status(status).split("reasons:\n", 1)[1].splitlines()
    assert details == ["  n1, n2, n4: NoChannelDevice: no driver", "  n3: MknodFailed: EPERM"]


def test_another_active_record_on_the_channel_fails_a_ready_workload() -> None:
    """Ready on every node, but another active workload of the domain holds the channel
    too, on other nodes: FAILED with a ChannelConflict line naming both."""
    rec = record("job1", 5, nodes=["n1"], generation=1)
    rival = record("job2", 5, nodes=["n2", "n3"], generation=1)
    ready = channel_report("n1", 0, infos=[info("job1", 5, 1)])
    assert judge(rec, ready).state == "READY"
    status = judge_workload(
        rec,
        reports=[ready],
        members=[],
        now=NOW,
        report_interval_s=2.0,
        workloads=[rec, rival, record("job3", 5, domain="d2"), record("job4", 5, state="claiming")],
    )
    assert status.state == "FAILED"
    assert status.reasons[0].startswith("ChannelConflict: channel 5 of d1 is claimed by ")
    assert "job1, job2:" in status.reasons[0]
    assert "ChannelConflict: channel 5 of d1" in render_workload_status(status)


def test_a_node_whose_agent_is_gone_reads_agent_down_not_not_listed() -> None:
    """Issue 25: a crashed agent's node read NotListed ("not made yet") while its last
    report stood, and a stopped one NoReport. With the bus saying its agent is gone, the
    row is AgentDown, a failure; a node that has the channel ready stays ready."""
    rec = record("w1", 3, nodes=["n1", "n2", "n3"], generation=1)
    status = judge_workload(
        rec,
        reports=[
            SeenReport(channel_report("n1", 0, infos=[info("w1", 3, 1)])),
            SeenReport(channel_report("n2", 1, infos=[])),
        ],
        members=[],
        now=NOW,
        report_interval_s=2.0,
        down={"n1": "stopped", "n2": "its will fired", "n3": "its agent stopped 4 s ago"},
    )
    assert [(r.node, r.reason) for r in status.nodes] == [
        ("n1", ""),
        ("n2", "AgentDown"),
        ("n3", "AgentDown"),
    ]
    assert status.state == "FAILED"
    assert not any(r.pending for r in status.nodes)
    assert "AgentDown: n3" in status.reasons


def test_a_report_stamped_in_the_far_future_is_clock_skew_in_few_words() -> None:
    """A workload's node row for a report stamped 1e308 says ClockSkew briefly."""
    rec = record("w1", 1, nodes=["n1"], generation=1)
    status = judge(rec, channel_report("n1", 0, infos=[info("w1", 1, 1)], at=1e308))
    assert (status.nodes[0].reason, status.state) == ("ClockSkew", "FAILED")
    assert status.nodes[0].message == "report stamped 1e+308 s ahead of this host"


def test_without_a_node_list_the_members_are_judged() -> None:
    """Nodes None: the domain's member records say which nodes must have the channel."""
    rec = record("w1", 1, generation=1)
    status = judge(rec, channel_report("n1", 0, infos=[info("w1", 1, 1)]), members=("n1", "n2"))
    assert [r.node for r in status.nodes] == ["n1", "n2"]
    assert status.state == "PENDING"
    assert judge(rec).state == "UNKNOWN"
    claiming = judge(
        msgspec.structs.replace(rec, state="claiming"),
        channel_report("n1", 0, infos=[info("w1", 1, 1)]),
        members=("n1",),
    )
    assert claiming.state == "PENDING"
    assert claiming.reasons[0].startswith("Claiming:")


def test_the_smallest_fresh_count_bounds_the_channels() -> None:
    """Stale reports and reports without a count do not count."""
    seen = [
        SeenReport(channel_report("n1", 0, count=8)),
        SeenReport(channel_report("n2", 1, count=4)),
        SeenReport(channel_report("n3", 2, count=2, at=NOW - 100)),
        SeenReport(channel_report("n4", 3, count=None)),
    ]
    assert workloads.channel_count(seen, now=NOW, report_interval_s=2.0) == 4
    assert workloads.channel_count(seen[3:], now=NOW, report_interval_s=2.0) is None


# Against a real broker.


@pytest.fixture(autouse=True)
def generations_from_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record on an empty topic starts at generation 0 here, not at the clock's second
    (tests/test_order.py and tests/test_control.py hold that), so that a new workload's
    claim is 0 and its active record 1, which the reports here name."""
    monkeypatch.setattr("imexd.order.first_generation", lambda now=None: 0)


@pytest.fixture
def env(broker: Mosquitto, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A control plane that reaches `broker` with no settings file."""
    for name in list(os.environ):
        if name.startswith("IMEXD_"):
            monkeypatch.delenv(name)
    values = {"IMEXD_BUS_URL": broker.url, "IMEXD_HEALTH_REPORT_INTERVAL_S": str(INTERVAL)}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


@pytest.fixture
def settings(env: dict[str, str]) -> Settings:
    return load_control_settings(None, environ=env)


async def put(broker: Mosquitto, items: Mapping[str, bytes | None]) -> None:
    async with raw_client(broker) as c:
        for topic, payload in items.items():
            await c.publish(topic, payload or None, qos=1, retain=True)


async def cli(*args: str) -> int:
    """`imexd ARGS` in a worker thread (its own event loop)."""
    return await asyncio.to_thread(main, list(args))


async def records(broker: Mosquitto, domain: str = "+") -> dict[str, dict[str, Any]]:
    """The retained workload records, by workload name, checked against the schema; their
    tombstones left out."""
    got = await retained(broker, T.workloads_filter(domain))
    out = {}
    for payload in got.values():
        doc = valid("WorkloadRecord", payload)
        if doc["state"] != "deleted":
            out[doc["workload"]] = doc
    return out


def live(node: str, slot: int, *, domain: str = "d1", **kw: Any) -> bytes:
    """A fresh HealthReport of `node`, stamped now."""
    return encode(channel_report(node, slot, at=time.time(), domain=domain, **kw))


def members(domain: str, nodes: list[str]) -> dict[str, bytes | None]:
    return {
        T.member(domain, "c1", n): encode(member_record(n, i, domain=domain))
        for i, n in enumerate(nodes)
    }


async def create(settings: Settings, name: str, domain: str = "d1", **kw: Any) -> tuple[int, str]:
    """`workloads.create` with --wait 0 unless given; (exit code, stdout + stderr)."""
    out = io.StringIO()
    options: dict[str, Any] = {
        "nodes": None,
        "channel": None,
        "uid": None,
        "gid": None,
        "mode": None,
        "wait_s": 0.0,
        "as_json": False,
    }
    options.update(kw)
    code = await workloads.create(settings, name, domain=domain, out=out, err=out, **options)
    return code, out.getvalue()


async def test_channels_are_allocated_lowest_free_from_1(
    broker: Mosquitto, settings: Settings
) -> None:
    """New workloads get 1, 2, ...; a freed channel is reused; 0 only on request."""
    for name in ("w1", "w2", "w3"):
        assert (await create(settings, name))[0] == 0
    got = await records(broker)
    assert {n: d["channel"] for n, d in got.items()} == {"w1": 1, "w2": 2, "w3": 3}
    assert got["w1"]["state"] == "active"
    assert got["w1"]["generation"] == 1
    assert got["w1"]["owner"].startswith("imexd-control-")
    assert got["w1"]["nodes"] is None
    assert (got["w1"]["uid"], got["w1"]["gid"], got["w1"]["mode"]) == (0, 0, 0o660)
    assert await cli("workload", "delete", "w2", "--domain", "d1", "--wait", "0") == 0
    assert (await create(settings, "w4"))[0] == 0
    assert (await records(broker))["w4"]["channel"] == 2
    code, text = await create(settings, "w0", channel=0)
    assert code == 0, text
    assert "w0 in d1: created on channel 0" in text
    assert (await create(settings, "w5"))[0] == 0
    assert (await records(broker))["w5"]["channel"] == 4


async def test_an_explicit_channel_that_is_taken_is_a_usage_error(
    broker: Mosquitto, settings: Settings
) -> None:
    """--channel used by another workload: exit 2 naming it, nothing written."""
    assert (await create(settings, "w1", channel=5))[0] == 0
    code, text = await create(settings, "w2", channel=5)
    assert code == 2
    assert "channel 5 of d1 is used by workload w1" in text
    assert sorted(await records(broker)) == ["w1"]
    code, text = await create(settings, "w1", channel=6)
    assert code == 2
    assert "exists on channel 5, not 6" in text


async def test_out_of_channels_exits_3_with_the_count_and_the_used(
    broker: Mosquitto, settings: Settings
) -> None:
    """The smallest count the domain's nodes report bounds allocation; then exit 3."""
    await put(broker, {T.health("d1", "n1"): live("n1", 0, count=8)})
    await put(broker, {T.health("d1", "n2"): live("n2", 1, count=4)})
    for name in ("w1", "w2", "w3"):
        assert (await create(settings, name))[0] == 0
    code, text = await create(settings, "w4")
    assert code == 3
    assert "no free channel in d1: its nodes offer 4 channels" in text
    assert "3 are used" in text
    code, text = await create(settings, "w4", channel=4)
    assert code == 2
    assert "--channel 4 is out of range: the nodes of d1 offer 4 channels (0 to 3)" in text
    assert (await create(settings, "w4", channel=0))[0] == 0
    assert sorted(await records(broker)) == ["w1", "w2", "w3", "w4"]


async def test_creating_again_keeps_the_channel_and_updates_the_rest(
    broker: Mosquitto, settings: Settings
) -> None:
    """A re-create is an update: same channel and created, generation + 1, new fields."""
    assert (await create(settings, "w1"))[0] == 0
    assert (await create(settings, "w2"))[0] == 0
    first = (await records(broker))["w2"]
    code, text = await create(settings, "w2", nodes=["n1"], uid=1000, gid=100, mode=0o600)
    assert code == 0
    assert (
        "w2 in d1: updated on channel 2 (generation 2, nodes n1, uid 1000, gid 100, mode 0600)"
        in text
    )
    again = (await records(broker))["w2"]
    assert (again["channel"], again["generation"], again["created"]) == (2, 2, first["created"])
    assert (again["nodes"], again["uid"], again["gid"], again["mode"]) == (["n1"], 1000, 100, 0o600)


async def test_without_nodes_the_spec_list_is_taken(broker: Mosquitto, settings: Settings) -> None:
    """No --nodes: the spec's node list; a deleting domain is refused."""
    await put(
        broker, {T.spec("d1"): encode(DomainSpec(domain="d1", nodes=["n2", "n1"], max_nodes=8))}
    )
    assert (await create(settings, "w1"))[0] == 0
    assert (await records(broker))["w1"]["nodes"] == ["n2", "n1"]
    deleting = DomainSpec(domain="d2", nodes=None, max_nodes=8, state="deleting")
    await put(broker, {T.spec("d2"): encode(deleting)})
    code, text = await create(settings, "w1", domain="d2")
    assert code == 2
    assert "domain d2 is being deleted" in text


@contextlib.asynccontextmanager
async def observer(broker: Mosquitto) -> AsyncIterator[list[tuple[str, bytes]]]:
    """Every workload message the broker passes on, in its order (topic, payload)."""
    seen: list[tuple[str, bytes]] = []
    ready = asyncio.Event()

    async def watch() -> None:
        async with raw_client(broker) as c:
            await c.subscribe(T.workloads_filter("+"), qos=1)
            ready.set()
            async for message in c.messages:
                payload = message.payload if isinstance(message.payload, bytes) else b""
                seen.append((message.topic.value, payload))

    task = asyncio.create_task(watch(), name="observer")
    async with asyncio.timeout(WAIT_S):
        await ready.wait()
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def replay_never_shares(seen: list[tuple[str, bytes]]) -> list[str]:
    """Replay the broker's order: any moment with two active workloads of a domain on one
    channel, as text."""
    standing: dict[str, dict[str, Any]] = {}
    problems = []
    for topic, payload in seen:
        if payload:
            standing[topic] = json.loads(payload)
        else:
            standing.pop(topic, None)
        active: dict[tuple[str, int], str] = {}
        for doc in standing.values():
            if doc["state"] != "active":
                continue
            key = (doc["domain"], doc["channel"])
            if key in active and active[key] != doc["workload"]:
                problems.append(f"{doc['workload']} and {active[key]} active on {key}")
            active[key] = doc["workload"]
    return problems


def contested(seen: list[tuple[str, bytes]]) -> int:
    """How many claims were published on a channel another workload had claimed."""
    claims: dict[tuple[str, int], set[str]] = {}
    for _, payload in seen:
        if payload:
            doc = json.loads(payload)
            if doc["state"] == "claiming":
                claims.setdefault((doc["domain"], doc["channel"]), set()).add(doc["workload"])
    return sum(len(names) - 1 for names in claims.values())


async def test_two_clients_racing_never_share_a_channel(
    broker: Mosquitto, settings: Settings
) -> None:
    """Twenty pairs of clients create two workloads of one domain at once: every pair ends
    on two channels, and no moment of the broker's order had both active on one."""
    async with observer(broker) as seen:
        for round_ in range(20):
            domain = f"r{round_}"
            results = await asyncio.gather(
                create(settings, "a", domain=domain), create(settings, "b", domain=domain)
            )
            assert [code for code, _ in results] == [0, 0], results
        await asyncio.sleep(0.2)
    final = await records(broker)
    assert final  # by name only: the last round's
    by_domain: dict[str, set[int]] = {}
    for payload in (await retained(broker, T.workloads_filter("+"))).values():
        doc = json.loads(payload)
        assert doc["state"] == "active"
        by_domain.setdefault(doc["domain"], set()).add(doc["channel"])
    assert by_domain == {f"r{i}": {1, 2} for i in range(20)}
    assert replay_never_shares(seen) == []
    assert contested(seen) >= 1, "the clients never raced for one channel"


async def test_eight_clients_at_once_get_eight_channels(
    broker: Mosquitto, settings: Settings
) -> None:
    """Eight concurrent creates in one domain end on channels 1..8, one each."""
    async with observer(broker) as seen:
        results = await asyncio.gather(*(create(settings, f"w{i}") for i in range(8)))
        assert [code for code, _ in results] == [0] * 8, results
        await asyncio.sleep(0.2)
    got = await records(broker)
    assert sorted(d["channel"] for d in got.values()) == list(range(1, 9))
    assert all(d["state"] == "active" for d in got.values())
    assert replay_never_shares(seen) == []
    assert contested(seen) >= 1


async def test_two_clients_asking_for_one_explicit_channel(
    broker: Mosquitto, settings: Settings
) -> None:
    """Both ask for --channel 7: one gets it, the other is refused (exit 2)."""
    for round_ in range(5):
        domain = f"x{round_}"
        results = await asyncio.gather(
            create(settings, "a", domain=domain, channel=7),
            create(settings, "b", domain=domain, channel=7),
        )
        assert sorted(code for code, _ in results) == [0, 2], results
        got = await records(broker, domain)
        assert [d["channel"] for d in got.values()] == [7]


async def test_hostile_records_on_workload_topics_are_ignored(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record naming another workload or domain than its topic, a channel out of range
    and garbage are dropped: they hold no channel and are not listed."""
    await put(
        broker,
        {
            T.workload("d1", "w1"): encode(record("w2", 1)),
            T.workload("d1", "w3"): encode(record("w3", 2, domain="d9")),
            T.workload(
                "d1", "w4"
            ): b'{"v": 1, "workload": "w4", "domain": "d1", "channel": 1048576}',
            T.workload("d1", "w5"): b"\xff not json",
            T.workload("d1", "W6"): encode(record("w6", 3)),
        },
    )
    assert (await create(settings, "w7"))[0] == 0
    w7 = (await retained(broker, T.workload("d1", "w7")))[T.workload("d1", "w7")]
    assert valid("WorkloadRecord", w7)["channel"] == 1
    capsys.readouterr()
    assert await cli("workload", "list") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == ["d1      w7        1        active  all    0/0 ready"]
    assert await cli("workload", "status", "w2") == 1
    assert "no workload w2 in any domain" in capsys.readouterr().err


async def test_list_shows_each_workload_with_its_readiness(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table: DOMAIN WORKLOAD CHANNEL STATE NODES READY; --json: an array."""
    assert (await create(settings, "w1", nodes=["n1", "n2"]))[0] == 0
    assert (await create(settings, "w2", domain="d2"))[0] == 0
    await put(broker, {T.health("d1", "n1"): live("n1", 0, infos=[info("w1", 1, 1)])})
    capsys.readouterr()
    assert await cli("workload", "list") == 0
    assert capsys.readouterr().out.splitlines() == [
        "DOMAIN  WORKLOAD  CHANNEL  STATE   NODES  READY",
        "d1      w1        1        active  n1,n2  1/2 ready",
        "d2      w2        1        active  all    0/0 ready",
    ]
    assert await cli("workload", "list", "--domain", "d2", "--json") == 0
    docs = json.loads(capsys.readouterr().out)
    assert [(d["workload"], d["channel"], d["state"]) for d in docs] == [("w2", 1, "UNKNOWN")]


async def test_status_judges_each_node_from_its_report(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ready, not ready with the agent's reason, and a stale report, per node."""
    assert (await create(settings, "w1", nodes=["n1", "n2", "n3"]))[0] == 0
    conflict = info("w1", 1, 1, ready=False, reason="ChannelConflict", message="w9 holds it")
    old = time.time() - 4 * INTERVAL
    await put(
        broker,
        {
            T.health("d1", "n1"): live("n1", 0, infos=[info("w1", 1, 1)]),
            T.health("d1", "n2"): live("n2", 1, infos=[conflict]),
            T.health("d1", "n3"): encode(channel_report("n3", 2, infos=[info("w1", 1, 1)], at=old)),
        },
    )
    capsys.readouterr()
    assert await cli("workload", "status", "w1", "--wait", "0") == 1
    out = capsys.readouterr().out
    assert out.startswith("workload w1 in d1: FAILED, 1 of 3 nodes ready (channel 1, generation 1")
    lines = out.splitlines()
    assert lines[1].split() == ["NODE", "READY", "REASON", "AGE"]
    assert lines[2].split()[:3] == ["n1", "yes", "-"]
    assert lines[3].split()[:3] == ["n2", "no", "ChannelConflict"]
    assert lines[4].split()[:3] == ["n3", "no", "Stale"]
    assert "n2: ChannelConflict: w9 holds it" in out
    await put(
        broker,
        {
            T.health("d1", "n2"): live("n2", 1, infos=[info("w1", 1, 1)]),
            T.health("d1", "n3"): live("n3", 2, infos=[info("w1", 1, 1)]),
        },
    )
    assert await cli("workload", "status", "w1", "--domain", "d1", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["state"], doc["ready"], doc["listed"]) == ("READY", 3, 3)
    assert [n["node"] for n in doc["nodes"]] == ["n1", "n2", "n3"]


@contextlib.asynccontextmanager
async def fake_agent(
    broker: Mosquitto, node: str, domain: str = "d1", *, answer: bool = True
) -> AsyncIterator[None]:
    """An agent of `node` that reports each active workload listing it as ready (when
    `answer`) and stops listing deleted ones, like a real agent's HealthReport."""
    ready = asyncio.Event()

    async def agent() -> None:
        held: dict[str, WorkloadRecord] = {}
        async with raw_client(broker) as c:
            await c.subscribe(T.workloads_filter(domain), qos=1)
            ready.set()
            async for message in c.messages:
                name = message.topic.value.rsplit("/", 1)[1]
                raw = message.payload if isinstance(message.payload, bytes) else b""
                got = msgspec.json.decode(raw, type=WorkloadRecord) if raw else None
                if got is not None and got.state == "active" and got.lists(node):
                    held[name] = got
                else:
                    held.pop(name, None)
                infos = [info(w.workload, w.channel, w.generation) for w in held.values()]
                if answer:
                    await c.publish(
                        T.health(domain, node),
                        live(node, 0, domain=domain, infos=infos),
                        qos=1,
                        retain=True,
                    )

    task = asyncio.create_task(agent(), name=f"fake-{node}")
    async with asyncio.timeout(WAIT_S):
        await ready.wait()
    try:
        yield
    finally:
        await cancel_and_wait(task)


async def test_create_waits_until_every_listed_node_has_the_channel(
    broker: Mosquitto, settings: Settings
) -> None:
    """--wait returns as the last listed node reports the channel ready: one line each."""
    async with fake_agent(broker, "n1"), fake_agent(broker, "n2"):
        started = time.monotonic()
        code, text = await create(settings, "w1", nodes=["n1", "n2"], wait_s=WAIT_S)
        assert code == 0, text
        assert time.monotonic() - started < WAIT_S / 2
    assert "w1 in d1: READY, 2 of 2 nodes ready (channel 1, generation 1" in text
    assert [line.split()[:2] for line in text.splitlines()[3:5]] == [["n1", "yes"], ["n2", "yes"]]
    async with fake_agent(broker, "n1"):
        out, err = io.StringIO(), io.StringIO()
        code = await workloads.create(
            settings,
            "w2",
            domain="d1",
            nodes=["n1"],
            channel=None,
            uid=None,
            gid=None,
            mode=None,
            wait_s=WAIT_S,
            as_json=True,
            out=out,
            err=err,
        )
    assert code == 0
    doc = json.loads(out.getvalue())
    assert (doc["workload"], doc["channel"], doc["state"], doc["ready"]) == ("w2", 2, "READY", 1)
    assert "workload w2 in d1: created on channel 2" in err.getvalue()


async def test_create_exits_1_when_a_node_lacks_the_channel_at_the_deadline(
    broker: Mosquitto, settings: Settings
) -> None:
    """A node that never reports the workload: exit 1 naming it and why; record kept."""
    async with fake_agent(broker, "n1"):
        code, text = await create(settings, "w1", nodes=["n1", "n2"], wait_s=1.0)
    assert code == 1
    assert "workload w1 in d1: not ready after 1 s (the record is kept): n2: NoReport" in text
    assert (await records(broker))["w1"]["state"] == "active"


async def test_delete_waits_until_no_node_lists_the_workload(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """delete writes the tombstone and returns once the agents stopped listing it; a node that
    keeps listing it makes it exit 1; an unknown workload exits 1."""
    async with fake_agent(broker, "n1"):
        assert (await create(settings, "w1", wait_s=0.0, nodes=["n1"]))[0] == 0
        assert await cli("workload", "status", "w1", "--wait", "5") == 0
        capsys.readouterr()
        assert await cli("workload", "delete", "w1", "--wait", "5") == 0
    assert "workload w1 in d1: deleted (channel 1 freed)" in capsys.readouterr().out
    assert await records(broker) == {}
    assert (await create(settings, "w2", nodes=["n2"]))[0] == 0
    await put(broker, {T.health("d1", "n2"): live("n2", 1, infos=[info("w2", 1, 1)])})
    assert await cli("workload", "delete", "w2", "--wait", "0.5") == 1
    assert "still listed after 0.5 s by n2" in capsys.readouterr().err
    assert await records(broker) == {}
    assert await cli("workload", "delete", "w2", "--domain", "d1") == 1
    assert "no workload w2 in domain d1" in capsys.readouterr().err


async def test_delete_waits_for_a_node_that_has_not_shown_its_channels(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen with 200 workloads: right after a hand-over, the new agent's first report lists
    no workload (ChannelsReady Unknown, Pending: its first apply is still to come), and
    `delete --wait` took that for "no node lists it" and returned while the device was
    still there. A report that cannot say (channels pending, or workloads omitted to fit
    the payload) keeps the delete waiting, and the error names the node and why."""
    pending = Condition(
        type=CHANNELS_READY, status="Unknown", reason="Pending", message="", since=NOW
    )
    assert (await create(settings, "w1", nodes=["n1"]))[0] == 0
    first = channel_report("n1", 0, at=time.time())
    conditions = [c for c in first.conditions if c.type != CHANNELS_READY] + [pending]
    report = msgspec.structs.replace(first, conditions=conditions)
    await put(broker, {T.health("d1", "n1"): encode(report)})
    assert await cli("workload", "delete", "w1", "--wait", "0.5") == 1
    assert "n1 has not shown its channels yet" in capsys.readouterr().err
    assert (await create(settings, "w2", nodes=["n2"]))[0] == 0
    view = ChannelsView(count=8, major=242, workloads=[info("w0", 1, 1)], omitted=1)
    cut = msgspec.structs.replace(channel_report("n2", 0, at=time.time()), channels=view)
    await put(broker, {T.health("d1", "n2"): encode(cut)})
    assert await cli("workload", "delete", "w2", "--wait", "0.5") == 1
    assert "n2 has not shown its channels yet" in capsys.readouterr().err


async def test_env_prints_the_exports_of_an_active_workload(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """`workload env`: four export lines; exit 1 for an unknown or claiming workload."""
    assert (await create(settings, "w1", domain="job-7", channel=3, nodes=["n1"]))[0] == 0
    await put(
        broker, {T.health("job-7", "n1"): live("n1", 0, domain="job-7", infos=[info("w1", 3, 1)])}
    )
    capsys.readouterr()
    assert await cli("workload", "env", "w1") == 0
    assert capsys.readouterr().out.splitlines() == [
        "export IMEX_CHANNEL=3",
        "export IMEXD_WORKLOAD=w1",
        "export IMEXD_DOMAIN=job-7",
        "export IMEXD_CHANNEL_DEVICE=/dev/nvidia-caps-imex-channels/channel3",
    ]
    assert await cli("workload", "env", "nope") == 1
    assert "no workload nope in any domain" in capsys.readouterr().err
    await put(broker, {T.workload("d1", "w9"): encode(record("w9", 4, state="claiming"))})
    assert await cli("workload", "env", "w9", "--domain", "d1") == 1
    assert "is not active (state claiming" in capsys.readouterr().err


async def test_env_of_a_workload_not_ready_exits_1_with_the_reason(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen on a machine without a GPU: `workload env` printed a device path and exited 0
    while the workload was FAILED on every node. It exits 1, prints no export line, and
    says which nodes lack the channel and why."""
    assert (await create(settings, "w1", nodes=["n1", "n2"]))[0] == 0
    missing = info("w1", 1, 1, ready=False, reason="NoChannelDevice", message="no driver")
    await put(broker, {T.health("d1", "n1"): live("n1", 0, infos=[missing])})
    capsys.readouterr()
    assert await cli("workload", "env", "w1") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("imexd workload env: workload w1 in d1 is not ready (FAILED")
    assert "n1: NoChannelDevice (no driver); n2: NoReport" in err
    await put(broker, {T.health("d1", "n1"): live("n1", 0, infos=[info("w1", 1, 1)])})
    assert await cli("workload", "env", "w1") == 1
    assert "is not ready (PENDING" in capsys.readouterr().err
    await put(broker, {T.health("d1", "n2"): live("n2", 1, infos=[info("w1", 1, 1)])})
    assert await cli("workload", "env", "w1") == 0
    assert "export IMEX_CHANNEL=1" in capsys.readouterr().out.splitlines()


async def test_domain_may_be_omitted_only_when_the_name_is_unique(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """One domain with the name: found; two: exit 2 naming both."""
    assert (await create(settings, "w1", domain="d1", nodes=["n1"]))[0] == 0
    assert (await create(settings, "w1", domain="d2", nodes=["n2"]))[0] == 0
    assert (await create(settings, "w2", domain="d2", nodes=["n2"]))[0] == 0
    ready = {
        T.health("d1", "n1"): live("n1", 0, infos=[info("w1", 1, 1)]),
        T.health("d2", "n2"): live(
            "n2", 0, domain="d2", infos=[info("w1", 1, 1), info("w2", 2, 1)]
        ),
    }
    await put(broker, ready)
    capsys.readouterr()
    assert await cli("workload", "env", "w2") == 0
    assert "IMEXD_DOMAIN=d2" in capsys.readouterr().out
    for action in ("status", "env", "delete"):
        assert await cli("workload", action, "w1") == 2
        assert (
            f"imexd workload {action}: workload w1 exists in domains d1, d2: give --domain"
            in capsys.readouterr().err
        )
    assert await cli("workload", "delete", "w1", "--domain", "d2", "--wait", "0") == 0
    assert await cli("workload", "env", "w1") == 0
    assert "IMEXD_DOMAIN=d1" in capsys.readouterr().out


async def test_domain_create_with_channel_and_domain_delete(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`domain create --channel` makes workload NAME of domain NAME (no value: channel 0,
    on the spec's nodes); `domain delete` clears the domain's workloads."""
    # --force: no agent runs here to report n1 and n2 (domain create refuses unseen nodes).
    args = ["domain", "create", "job-1", "--nodes", "n1,n2", "--channel", "--uid", "1000"]
    args.append("--force")
    assert await cli(*args) == 0
    out = capsys.readouterr().out
    assert "domain job-1: created" in out
    assert "workload job-1 in job-1: created on channel 0" in out
    doc = (await records(broker, "job-1"))["job-1"]
    assert (doc["channel"], doc["nodes"], doc["uid"], doc["mode"]) == (0, ["n1", "n2"], 1000, 0o660)
    assert await cli("domain", "create", "job-2", "--channel", "5", "--mode", "0600") == 0
    doc = (await records(broker, "job-2"))["job-2"]
    assert (doc["channel"], doc["nodes"], doc["mode"]) == (5, None, 0o600)
    assert (await create(load_control_settings(None, environ=env), "extra", domain="job-1"))[0] == 0
    capsys.readouterr()
    assert await cli("domain", "delete", "job-1", "--timeout", "1") == 0
    assert "2 workload(s): extra, job-1" in capsys.readouterr().out
    assert await records(broker, "job-1") == {}
    assert sorted(await records(broker)) == ["job-2"]
    await put(broker, {T.workload("job-3", "w1"): encode(record("w1", 1, domain="job-3"))})
    assert await cli("domain", "delete", "job-3", "--timeout", "0") == 0
    assert await records(broker, "job-3") == {}


async def test_a_second_client_rewriting_the_same_workload_is_caught(
    broker: Mosquitto, settings: Settings
) -> None:
    """Two clients creating one workload name at once: both agree on its channel, and a
    client whose write was overwritten says so (exit 1) instead of claiming success."""
    for round_ in range(5):
        domain = f"s{round_}"
        results = await asyncio.gather(
            create(settings, "w", domain=domain, uid=1),
            create(settings, "w", domain=domain, uid=2),
        )
        codes = sorted(code for code, _ in results)
        assert codes in ([0, 0], [0, 1]), results
        for code, text in results:
            if code == 1:
                assert "did not keep our write" in text
        got = await records(broker, domain)
        assert [d["channel"] for d in got.values()] == [1]


async def test_a_claim_the_acl_drops_ends_with_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broker that silently drops the control plane's workload writes: no echo of the
    claim comes back, and create exits 1 naming the topic instead of waiting forever."""
    acl = tmp_path / "acl"
    acl.write_text("topic read imex/v2/#\ntopic readwrite imex/v2/domains/_control/#\n")
    b = Mosquitto(tmp_path / "acl-broker", extra_config=f"acl_file {acl}")
    b.start()
    try:
        monkeypatch.setenv("IMEXD_BUS_URL", b.url)
        code = await cli("workload", "create", "w1", "--domain", "d1", "--wait", "0")
    finally:
        b.stop()
    assert code == 1
    assert "no echo of our write to imex/v2/domains/d1/workloads/w1" in capsys.readouterr().err


MANY = 250
"""More retained records than any broker's in-flight window (Mosquitto's is 20)."""


async def test_every_read_sees_every_record_beyond_the_in_flight_window(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """With MANY retained workloads, `list` shows them all and `delete` finds the last
    one: the snapshot barrier comes behind every QoS 1 record, not past them."""
    names = [f"w{i:03d}" for i in range(1, MANY + 1)]
    await put(broker, {T.workload("d1", n): encode(record(n, i)) for i, n in enumerate(names, 1)})
    capsys.readouterr()
    assert await cli("workload", "list", "--domain", "d1", "--json") == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["workload"] for d in docs] == names
    assert await cli("workload", "delete", names[-1], "--domain", "d1", "--wait", "0") == 0
    assert f"workload {names[-1]} in d1: deleted" in capsys.readouterr().out
    assert await cli("workload", "status", names[-2], "--wait", "0") == 1
    assert "no workload" not in capsys.readouterr().err
    code, text = await create(settings, "extra", channel=MANY - 1)
    assert code == 2, text
    assert f"channel {MANY - 1} of d1 is used by workload {names[-2]}" in text


async def test_domain_delete_and_list_see_every_record_beyond_the_in_flight_window(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`domain delete` clears all MANY workloads of its domain (a QoS 1 read), and `domain
    list` counts MANY specs (QoS 0 reads): no read stops at the broker's window."""
    names = [f"w{i:03d}" for i in range(1, MANY + 1)]
    await put(broker, {T.workload("d1", n): encode(record(n, i)) for i, n in enumerate(names, 1)})
    specs = {
        T.spec(f"s{i:03d}"): encode(DomainSpec(domain=f"s{i:03d}", nodes=None, max_nodes=8))
        for i in range(MANY)
    }
    await put(broker, specs)
    capsys.readouterr()
    assert await cli("domain", "list") == 0
    text = capsys.readouterr().out
    rows = text.splitlines()[1:]
    assert sum(1 for row in rows if row.startswith("s")) == MANY, text[:2000]
    assert await cli("domain", "delete", "d1", "--timeout", "0") == 0
    assert f"{MANY} workload(s)" in capsys.readouterr().out
    assert await records(broker, "d1") == {}


async def test_a_channel_conflict_is_shown_with_exit_1_and_not_written_again(
    broker: Mosquitto, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second active record on job1's channel (another writer's, other nodes): `workload
    status`, `list` and `domain status` name the conflict and exit 1, and `create` refuses
    to write either record again."""
    assert (await create(settings, "job1", nodes=["n1"], channel=5))[0] == 0
    rival = record("job2", 5, nodes=["n2", "n3"], uid=6666, generation=1)
    await put(broker, {T.workload("d1", "job2"): encode(rival)})
    capsys.readouterr()
    assert await cli("workload", "status", "job1", "--wait", "0") == 1
    assert "ChannelConflict: channel 5 of d1 is claimed by workloads job1, job2" in (
        capsys.readouterr().out
    )
    assert await cli("workload", "list") == 1
    assert "ChannelConflict: channel 5 of d1" in capsys.readouterr().err
    assert await cli("domain", "status", "d1") == 1
    assert "ChannelConflict: channel 5 of d1" in capsys.readouterr().err
    before = await records(broker)
    for name in ("job1", "job2"):
        code, text = await create(settings, name, nodes=["n1"], channel=5)
        assert code == 2, text
        assert "is also claimed by workload" in text
    assert await records(broker) == before


QUEUED = 1100
"""More retained records than Mosquitto delivers to one QoS 1 subscription at once: 20 in
flight plus `max_queued_messages` (1000) queued; the rest it drops, with no error."""


async def test_reads_that_do_not_race_see_records_beyond_the_brokers_queue(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """QUEUED workloads over many domains (per-job domains): `workload list` shows them
    all and `workload delete` of the last one, without --domain (the Slurm epilog's
    default), finds it: only `create`'s channel race reads at QoS 1."""
    names = [f"job-{i:04d}" for i in range(1, QUEUED + 1)]
    await put(broker, {T.workload(n, n): encode(record(n, 0, domain=n)) for n in names})
    capsys.readouterr()
    assert await cli("workload", "list", "--json") == 0
    assert len(json.loads(capsys.readouterr().out)) == QUEUED
    assert await cli("workload", "delete", names[-1], "--wait", "0") == 0
    assert f"workload {names[-1]} in {names[-1]}: deleted" in capsys.readouterr().out


async def test_a_listed_workload_is_read_in_one_snapshot_and_written_in_one_claim(
    broker: Mosquitto, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 43: `workload create --nodes` reads the listed nodes' member records and
    presences with the rest in one snapshot (a read of the domain's members made a second
    round trip for their presences, the other members' too); then the claim and the
    record. An update is one write."""
    now = time.time()
    standing: dict[str, bytes | None] = dict(members("d1", ["n1", "n2", "n3"]))
    for n in ("n1", "n2", "n3"):
        presence = Presence(node=n, incarnation=1, at=now, domain="d1", address="10.0.0.1")
        standing[T.presence(n)] = encode(presence)
    await put(broker, standing)
    calls = spy_calls(monkeypatch, Link, "sync", "put")
    code, text = await create(settings, "w1", nodes=["n1", "n2"])
    assert code == 0, text
    made = [name for name, _ in calls]
    assert made == ["sync", "put", "put", "sync"]  # snapshot, claim, record, its check
    calls.clear()
    code, text = await create(settings, "w1", nodes=["n1", "n2"], uid=1000)
    assert code == 0, text
    assert [n for n, _ in calls] == ["sync", "put", "sync"]
