"""The agent's channel keeper: bus events in, device nodes, CDI specs and env files out.

No broker: events are built as the bus delivers them, the subscriptions go to a fake, and
the devices are made in a tmp folder with a fake driver (`imexd.demo.nodes.fake_driver`).
Making a character device needs root; those tests skip otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from imexd.bus.events import Connected, Disconnected, SubscribeRefused, Synced
from imexd.channels.keeper import ChannelKeeper
from imexd.demo.nodes import CHANNEL_MAJOR, fake_driver
from imexd.facts import ChannelFacts, ChannelState, Facts
from imexd.health.conditions import Heartbeats
from imexd.health.guard import Guard
from imexd.health.metrics import Metrics
from imexd.logs import get_logger
from imexd.messages import Deleted, DomainSpec, MemberRecord, MemberState, Received, WorkloadRecord
from imexd.settings import ChannelsSettings
from imexd.topics import TopicRef, Topics
from tests.support import until

TOPICS = Topics("imex/v2")
UNTIL_S = 5.0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")


class FakeBus:
    """The keeper's subscriptions, recorded in order."""

    def __init__(self) -> None:
        self.filters: list[str] = []
        self.calls: list[tuple[str, str]] = []

    async def subscribe(self, topic_filter: str) -> None:
        self.filters.append(topic_filter)
        self.calls.append(("subscribe", topic_filter))

    async def unsubscribe(self, topic_filter: str) -> None:
        self.filters.remove(topic_filter)
        self.calls.append(("unsubscribe", topic_filter))


def make(
    tmp_path: Path, *, major: int | None = CHANNEL_MAJOR, count: int = 2048, **changes: Any
) -> ChannelKeeper:
    """A keeper of node n1 with a fake driver and its folders under `tmp_path`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {**fake_driver(tmp_path, major=major, count=count), **changes}
    settings = ChannelsSettings(**values)
    return ChannelKeeper(
        settings, node="n1", topics=TOPICS, log=get_logger("test"), on_change=lambda: None
    )


def record(name: str, channel: int, *, domain: str = "d1", **changes: Any) -> WorkloadRecord:
    values: dict[str, Any] = {"generation": 1, **changes}
    return WorkloadRecord(workload=name, domain=domain, channel=channel, **values)


def received(rec: WorkloadRecord) -> Received:
    ref = TopicRef("workload", domain=rec.domain, workload=rec.workload)
    return Received(TOPICS.workload(rec.domain, rec.workload), ref, rec, retained=True)


def deleted(name: str, domain: str = "d1") -> Deleted:
    ref = TopicRef("workload", domain=domain, workload=name)
    return Deleted(TOPICS.workload(domain, name), ref, retained=False)


def synced() -> Synced:
    return Synced(time.monotonic())


def dev(keeper: ChannelKeeper, channel: int) -> Path:
    return Path(keeper.settings.dev_dir) / f"channel{channel}"


def cdi(keeper: ChannelKeeper, name: str) -> Path:
    return Path(keeper.settings.cdi_dir) / f"imexd-{name}.json"


def env(keeper: ChannelKeeper, name: str) -> Path:
    return Path(keeper.settings.env_dir) / f"{name}.env"


def plant(keeper: ChannelKeeper, channel: int, mode: int = 0o666) -> Path:
    """A stale channel node, as a crashed agent or the driver's channel0 leave it."""
    path = dev(keeper, channel)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(CHANNEL_MAJOR, channel))
    os.chmod(path, mode)
    return path


def states(keeper: ChannelKeeper) -> dict[str, tuple[bool, str]]:
    return {s.workload: (s.ready, s.reason) for s in keeper.facts([]).workloads}


async def joined(
    tmp_path: Path, *records: WorkloadRecord, bus: FakeBus | None = None, **changes: Any
) -> ChannelKeeper:
    """A keeper that follows d1 (clique c1), got `records` and the snapshot, and applied."""
    keeper = make(tmp_path, **changes)
    await keeper.follow(bus or FakeBus(), "d1", "c1")
    for rec in records:
        keeper.on_event(received(rec))
    keeper.on_event(synced())
    await keeper.step()
    return keeper


# Sync gating


@needs_root
async def test_nothing_is_removed_before_the_snapshot_is_in(tmp_path: Path) -> None:
    """A stale node stays until the workloads view is synced, then goes (CVE-2024-42511)."""
    keeper = make(tmp_path)
    stale = plant(keeper, 5)
    before = time.monotonic()
    bus = FakeBus()
    await keeper.follow(bus, "d1", "c1")
    assert bus.filters == ["imex/v2/domains/d1/workloads/+"]
    keeper.on_event(Synced(before))  # a snapshot of the subscriptions before ours
    await keeper.step()
    assert stale.exists()
    assert not keeper.facts([]).synced
    # Seen in CI after a hand-over: a snapshot completed after our follow, but of the
    # filters subscribed before ours (the link's first sync, still in flight): it removed
    # the devices the previous agent left, which were made anew a moment later.
    keeper.on_event(Synced(time.monotonic(), filters=frozenset()))
    await keeper.step()
    assert stale.exists()
    assert not keeper.facts([]).synced
    keeper.on_event(synced())
    await keeper.step()
    assert not stale.exists()
    assert keeper.facts([]).synced


@needs_root
async def test_a_node_without_domain_removes_stale_nodes_at_once(tmp_path: Path) -> None:
    """No domain means no workloads: nothing to wait for, every channel node goes."""
    keeper = make(tmp_path)
    stale = plant(keeper, 0)
    await keeper.step()
    assert stale.exists(), "nothing happens before the agent says where the node is"
    bus = FakeBus()
    await keeper.follow(bus, None, None)
    assert bus.calls == []
    await keeper.step()
    assert not stale.exists()
    facts = keeper.facts([])
    assert facts.synced
    assert facts.workloads == ()


@needs_root
async def test_keep_channel0_keeps_the_drivers_channel0(tmp_path: Path) -> None:
    """keep_channel0: a channel0 no workload wants stays; it shows as open to everyone."""
    keeper = make(tmp_path, keep_channel0=True)
    zero = plant(keeper, 0)
    await keeper.follow(FakeBus(), None, None)
    await keeper.step()
    assert zero.exists()
    assert keeper.facts([]).channel0_open


# Making and removing


@needs_root
async def test_a_listed_workload_gets_its_device_cdi_spec_and_env_file(tmp_path: Path) -> None:
    """An active record that lists the node: char device 242:N, owner, mode, CDI, env."""
    keeper = await joined(
        tmp_path,
        record("job-a", 3, uid=1000, gid=1001, mode=0o640, nodes=["n1", "n2"]),
        record("job-b", 4, nodes=["n2"]),
        record("job-c", 5, state="claiming"),
    )
    info = os.lstat(dev(keeper, 3))
    assert stat.S_ISCHR(info.st_mode)
    assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (CHANNEL_MAJOR, 3)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (1000, 1001, 0o640)
    assert not dev(keeper, 4).exists()
    assert not dev(keeper, 5).exists()
    spec = json.loads(cdi(keeper, "job-a").read_text())
    assert spec["kind"] == "imexd.io/channel"
    [device] = spec["devices"]
    assert device["name"] == "job-a"
    assert device["containerEdits"]["deviceNodes"][0]["hostPath"] == str(dev(keeper, 3))
    assert "IMEXD_CLIQUE=c1" in device["containerEdits"]["env"]
    assert env(keeper, "job-a").read_text().splitlines() == [
        "IMEX_CHANNEL=3",
        "IMEXD_WORKLOAD=job-a",
        "IMEXD_DOMAIN=d1",
        "IMEXD_CLIQUE=c1",
        "IMEXD_CHANNEL_DEVICE=/dev/nvidia-caps-imex-channels/channel3",
    ]
    facts = keeper.facts([])
    assert facts.workloads == (ChannelState(workload="job-a", channel=3, generation=1, ready=True),)
    assert (facts.count, facts.major, facts.driver_error) == (2048, CHANNEL_MAJOR, "")
    assert facts.operations[("mknod", "ok")] == 1


@needs_root
async def test_a_new_mode_is_fixed_in_place(tmp_path: Path) -> None:
    """A changed mode or owner keeps the inode: a process that opened it keeps it."""
    keeper = await joined(tmp_path, record("job-a", 3))
    inode = os.lstat(dev(keeper, 3)).st_ino
    keeper.on_event(received(record("job-a", 3, mode=0o600, uid=7, generation=2)))
    await keeper.step()
    info = os.lstat(dev(keeper, 3))
    assert info.st_ino == inode
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o600, 7)
    assert keeper.facts([]).workloads[0].generation == 2
    assert keeper.facts([]).operations[("fix", "ok")] == 1


@needs_root
async def test_a_deleted_workload_and_a_dropped_node_lose_their_devices(tmp_path: Path) -> None:
    """The record deleted, or the node no longer listed: node, CDI spec and env file go."""
    keeper = await joined(tmp_path, record("job-a", 3), record("job-b", 4))
    assert dev(keeper, 3).exists()
    assert dev(keeper, 4).exists()
    keeper.on_event(deleted("job-a"))
    keeper.on_event(received(record("job-b", 4, nodes=["n2"], generation=2)))
    await keeper.step()
    for path in (dev(keeper, 3), dev(keeper, 4), cdi(keeper, "job-a"), env(keeper, "job-b")):
        assert not path.exists(), path
    assert keeper.facts([]).workloads == ()


@needs_root
async def test_records_of_another_domain_are_ignored(tmp_path: Path) -> None:
    """A late event of a domain the node left makes nothing."""
    keeper = await joined(tmp_path)
    keeper.on_event(received(record("job-x", 3, domain="d2")))
    await keeper.step()
    assert not dev(keeper, 3).exists()


@needs_root
async def test_a_refused_subscription_removes_nothing_until_synced_again(tmp_path: Path) -> None:
    """The broker refuses the workloads filter: the view may be partial, so nothing is
    removed (a live job's device stays) until the bus syncs again."""
    keeper = await joined(tmp_path, record("job-a", 3))
    keeper.on_event(
        SubscribeRefused("mqtt://b:1883", "imex/v2/domains/d1/workloads/+", "128", "refused")
    )
    keeper.on_event(deleted("job-a"))
    await keeper.step()
    assert dev(keeper, 3).exists(), "a partial view removes nothing"
    keeper.on_event(synced())
    await keeper.step()
    assert not dev(keeper, 3).exists()


@needs_root
async def test_a_reconnect_keeps_workloads_missing_from_the_new_snapshot(
    tmp_path: Path,
) -> None:
    """A record missing from a resynced snapshot is no deletion (the agent's anti-entropy
    pass gives it back): the channel stays; its tombstone removes it."""
    keeper = await joined(tmp_path, record("job-a", 3), record("job-b", 4))
    keeper.on_event(Disconnected("mqtt://x", "lost", None))
    keeper.on_event(Connected("mqtt://x", "5", True))
    keeper.on_event(received(record("job-b", 4)))
    keeper.on_event(synced())
    await keeper.step()
    assert dev(keeper, 3).exists()
    keeper.on_event(received(record("job-a", 3, state="deleted", generation=2)))
    await keeper.step()
    assert not dev(keeper, 3).exists()
    assert dev(keeper, 4).exists()


# Join, leave, hand-over


@needs_root
async def test_another_domain_replaces_the_subscription_and_then_the_devices(
    tmp_path: Path,
) -> None:
    """Moving to d2: d1's devices stay until d2's snapshot is in, then only d2's exist."""
    bus = FakeBus()
    keeper = make(tmp_path)
    await keeper.follow(bus, "d1", "c1")
    keeper.on_event(received(record("job-a", 3)))
    keeper.on_event(synced())
    await keeper.step()
    await keeper.follow(bus, "d2", "c1")
    assert bus.filters == ["imex/v2/domains/d2/workloads/+"]
    await keeper.step()
    assert dev(keeper, 3).exists()
    assert not keeper.facts([]).synced
    keeper.on_event(received(record("job-z", 9, domain="d2")))
    keeper.on_event(synced())
    await keeper.step()
    assert not dev(keeper, 3).exists()
    assert dev(keeper, 9).exists()
    assert "IMEXD_DOMAIN=d2" in env(keeper, "job-z").read_text()


@needs_root
async def test_leaving_the_domain_removes_everything(tmp_path: Path) -> None:
    """The node is taken out of its domain: its workloads' devices go at the next apply."""
    bus = FakeBus()
    keeper = await joined(tmp_path, record("job-a", 3), bus=bus)
    await keeper.follow(bus, None, None)
    assert bus.calls[1:] == [("unsubscribe", "imex/v2/domains/d1/workloads/+")]
    await keeper.step()
    assert not dev(keeper, 3).exists()
    assert not cdi(keeper, "job-a").exists()
    assert not env(keeper, "job-a").exists()


@needs_root
async def test_a_domain_being_deleted_loses_its_channels_whatever_records_are_left(
    tmp_path: Path,
) -> None:
    """The spec says `deleting` (a static node keeps naming the domain): its workloads'
    devices go even while their records are still on the broker, and come back if the
    domain is created again."""
    keeper = await joined(tmp_path, record("job-a", 3))
    assert dev(keeper, 3).exists()
    topic = "imex/v2/domains/d1/spec"
    spec = DomainSpec(domain="d1", state="deleting", generation=2)
    keeper.on_event(Received(topic, TopicRef("spec", domain="d1"), spec, retained=False))
    await keeper.step()
    assert not dev(keeper, 3).exists()
    assert not cdi(keeper, "job-a").exists()
    other = DomainSpec(domain="d2", state="active", generation=1)
    keeper.on_event(Received(topic, TopicRef("spec", domain="d2"), other, retained=False))
    await keeper.step()
    assert not dev(keeper, 3).exists(), "another domain's spec changes nothing"
    keeper.on_event(Deleted(topic, TopicRef("spec", domain="d1"), retained=False))
    await keeper.step()
    assert dev(keeper, 3).exists()


@needs_root
async def test_an_unknown_clique_holds_the_devices(tmp_path: Path) -> None:
    """Discovery pending (clique None): nothing is made or removed until it is known."""
    keeper = make(tmp_path)
    stale = plant(keeper, 7)
    await keeper.follow(FakeBus(), "d1", None)
    keeper.on_event(received(record("job-a", 3)))
    keeper.on_event(synced())
    await keeper.step()
    assert stale.exists()
    assert not dev(keeper, 3).exists()
    await keeper.follow(FakeBus(), "d1", "c9")
    await keeper.step()
    assert not stale.exists()
    assert "IMEXD_CLIQUE=c9" in env(keeper, "job-a").read_text()


@needs_root
async def test_clear_removes_everything_and_no_apply_follows(tmp_path: Path) -> None:
    """A leave clears every node, spec and env file; an apply after it does nothing."""
    keeper = await joined(tmp_path, record("job-a", 3))
    await keeper.clear()
    assert not dev(keeper, 3).exists()
    assert not cdi(keeper, "job-a").exists()
    assert not env(keeper, "job-a").exists()
    keeper.on_event(received(record("job-a", 3, generation=2)))
    await keeper.step()
    assert not dev(keeper, 3).exists()


# Refusals and retries


@needs_root
async def test_a_conflict_gives_the_channel_to_its_holder_or_to_none(tmp_path: Path) -> None:
    """Two workloads on one channel: the one whose device is made keeps it; else neither."""
    keeper = await joined(tmp_path, record("job-a", 3))
    keeper.on_event(received(record("job-b", 3)))
    await keeper.step()
    assert states(keeper) == {"job-a": (True, ""), "job-b": (False, "ChannelConflict")}
    assert dev(keeper, 3).exists()

    fresh = await joined(tmp_path / "other", record("job-a", 3), record("job-b", 3))
    assert states(fresh) == {
        "job-a": (False, "ChannelConflict"),
        "job-b": (False, "ChannelConflict"),
    }
    assert not dev(fresh, 3).exists()


@needs_root
async def test_a_restarted_keeper_resolves_a_conflict_as_before(tmp_path: Path) -> None:
    """A new keeper (an agent restart) over the same folders reads who held the channel
    from disk: the holder keeps its device (same inode), the other stays refused."""
    keeper = await joined(tmp_path, record("job-b", 3))
    keeper.on_event(received(record("job-a", 3)))
    await keeper.step()
    assert states(keeper) == {"job-a": (False, "ChannelConflict"), "job-b": (True, "")}
    inode = os.lstat(dev(keeper, 3)).st_ino
    again = await joined(tmp_path, record("job-a", 3), record("job-b", 3))
    assert states(again) == {"job-a": (False, "ChannelConflict"), "job-b": (True, "")}
    assert os.lstat(dev(again, 3)).st_ino == inode


@needs_root
async def test_a_channel_held_for_another_node_is_refused_here(tmp_path: Path) -> None:
    """A workload that does not list this node holds channel 3 first: a later one that
    does list it gets no device here (a channel is one workload's across the domain)."""
    keeper = await joined(tmp_path, record("job-a", 3, nodes=["n2"]))
    keeper.on_event(received(record("job-b", 3, nodes=["n1"], uid=6666)))
    await keeper.step()
    assert states(keeper) == {"job-b": (False, "ChannelConflict")}
    assert not dev(keeper, 3).exists()
    keeper.on_event(deleted("job-a"))
    await keeper.step()
    assert states(keeper) == {"job-b": (True, "")}
    assert os.lstat(dev(keeper, 3)).st_uid == 6666


async def test_a_channel_past_the_drivers_count_is_refused(tmp_path: Path) -> None:
    """channel >= ImexChannelCount: ChannelOutOfRange, and nothing is made."""
    keeper = await joined(tmp_path, record("job-a", 5), count=4)
    assert states(keeper) == {"job-a": (False, "ChannelOutOfRange")}
    assert not dev(keeper, 5).exists()
    assert keeper.facts([]).count == 4


async def test_without_the_channel_device_every_workload_is_refused(tmp_path: Path) -> None:
    """/proc/devices without nvidia-caps-imex-channels: NoChannelDevice, the why in facts."""
    keeper = await joined(tmp_path, record("job-a", 3), major=None)
    assert states(keeper) == {"job-a": (False, "NoChannelDevice")}
    facts = keeper.facts([])
    assert facts.major is None
    assert "nvidia-caps-imex-channels" in facts.driver_error


async def test_a_failed_mknod_is_retried_with_backoff(tmp_path: Path) -> None:
    """dev_dir cannot be made: MknodFailed naming the path, a retry scheduled, then made."""
    blocker = tmp_path / "dev"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the dev folder should be\n")
    keeper = await joined(tmp_path, record("job-a", 3))
    [state] = keeper.facts([]).workloads
    assert (state.ready, state.reason) == (False, "MknodFailed")
    assert str(tmp_path / "dev") in state.message
    first = keeper.retry_at
    assert first is not None
    assert keeper.attempt == 1
    await keeper.step()
    assert keeper.attempt == 2
    if os.geteuid() != 0:
        return
    blocker.unlink()
    await keeper.step()
    assert states(keeper) == {"job-a": (True, "")}
    assert (keeper.retry_at, keeper.attempt) == (None, 0)


# manage = false, facts


async def test_manage_false_touches_nothing_and_lists_the_workloads(tmp_path: Path) -> None:
    """manage = false: stale entries stay, nothing is made, workloads say NotManaged."""
    keeper = make(tmp_path, manage=False)
    stale = dev(keeper, 5)
    stale.parent.mkdir(parents=True)
    stale.write_text("not ours to judge\n")
    await keeper.follow(FakeBus(), "d1", "c1")
    keeper.on_event(received(record("job-a", 3)))
    keeper.on_event(synced())
    await keeper.step()
    await keeper.clear()
    assert stale.exists()
    assert not dev(keeper, 3).exists()
    facts = keeper.facts([])
    assert not facts.managed
    assert facts.count == 2048
    assert states(keeper) == {"job-a": (False, "NotManaged")}


def member(node: str, count: int | None) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain="d1",
        clique="c1",
        address="10.0.0.1",
        slot=0,
        incarnation=1,
        state=MemberState.MEMBER,
        max_nodes=8,
        mode="names",
        channel_count=count,
    )


async def test_a_member_with_another_channel_count_is_a_mismatch(tmp_path: Path) -> None:
    """Members whose ImexChannelCount differs from ours are named; unknown counts are not."""
    keeper = make(tmp_path)
    assert keeper.facts([member("n2", 1024)]).mismatch == (), "our count is not known yet"
    await keeper.step()
    members = [member("n1", 1), member("n2", 1024), member("n3", 2048), member("n4", None)]
    assert keeper.count == 2048
    assert keeper.facts(members).mismatch == (("n2", 1024),)


def test_channel_metrics_follow_the_facts() -> None:
    """One ready series per workload (gone with it), the count, and every operation."""
    metrics = Metrics()
    channels = ChannelFacts(
        synced=True,
        count=2048,
        major=242,
        workloads=(
            ChannelState(workload="job-a", channel=3, ready=True),
            ChannelState(workload="job-b", channel=4, reason="MknodFailed", message="x"),
        ),
        operations={("mknod", "ok"): 2, ("remove", "error"): 1},
    )
    metrics.update_from(Facts(node="n1", domain="d1", channels=channels), [])
    text = metrics.render().decode()
    assert 'imexd_channel_ready{channel="3",workload="job-a"} 1.0' in text
    assert 'imexd_channel_ready{channel="4",workload="job-b"} 0.0' in text
    assert "imexd_channel_count 2048.0" in text
    assert 'imexd_channel_operations_total{op="mknod",result="ok"} 2.0' in text
    assert 'imexd_channel_operations_total{op="remove",result="error"} 1.0' in text
    assert 'imexd_channel_operations_total{op="cdi",result="error"} 0.0' in text
    gone = ChannelFacts(workloads=(channels.workloads[0],))
    metrics.update_from(Facts(node="n1", domain="d1", channels=gone), [])
    text = metrics.render().decode()
    assert "job-b" not in text
    assert "imexd_channel_count " not in text


# The task


@needs_root
async def test_the_task_applies_on_every_change(tmp_path: Path) -> None:
    """The guarded `channels` task reacts to events without a step being asked for."""
    keeper = make(tmp_path)
    changes: list[float] = []
    keeper.on_change = lambda: changes.append(time.monotonic())
    heartbeats = Heartbeats()
    guard = Guard(heartbeats, Metrics(), get_logger("test"))
    async with asyncio.TaskGroup() as tasks:
        task = guard.start(tasks, "channels", lambda: keeper.run(guard))
        await keeper.follow(FakeBus(), "d1", "c1")
        keeper.on_event(received(record("job-a", 3)))
        keeper.on_event(synced())
        await until(lambda: dev(keeper, 3).exists(), within=UNTIL_S, interval=0.02)
        keeper.on_event(deleted("job-a"))
        await until(lambda: not dev(keeper, 3).exists(), within=UNTIL_S, interval=0.02)
        assert heartbeats.stale() == []
        task.cancel()
    assert changes
