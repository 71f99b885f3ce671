"""Channels with real agents: workload records on the broker, device nodes on the nodes.

Each node's agent makes its channel devices under its own folder with a fake driver
(major 242, 2048 channels: `imexd.demo.nodes.fake_driver`); the workload records are
published as a control plane in another language would, straight onto the broker. Making
character devices needs root: the module skips otherwise. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest

from imexd.agent.run import EXIT_HANDOVER
from imexd.demo.nodes import CHANNEL_MAJOR
from imexd.messages import MemberRecord, WorkloadRecord, decode, encode
from tests.cluster import Cluster, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root"),
]

WAIT_S = 30.0


def publish(c: Cluster, name: str, channel: int, **fields: Any) -> None:
    """Retain the active WorkloadRecord `name` of d1 on the cluster's broker."""
    record = WorkloadRecord(workload=name, domain="d1", channel=channel, **fields)
    with c.client() as client:
        client.publish(f"imex/v2/domains/d1/workloads/{name}", encode(record), retain=True)


def delete(c: Cluster, name: str) -> None:
    """Retain the tombstone of d1's workload `name`, one generation above its record, as
    `imexd workload delete` ends (a clear is no deletion: agents give the record back)."""
    topic = f"imex/v2/domains/d1/workloads/{name}"
    with c.client() as client:
        current = msgspec.json.decode(client.retained(topic)[topic], type=WorkloadRecord)
        tombstone = msgspec.structs.replace(
            current, state="deleted", nodes=None, generation=current.generation + 1
        )
        client.publish(topic, encode(tombstone), retain=True)


def generation(c: Cluster, name: str, domain: str = "d1") -> int:
    """The generation of the workload record the control plane wrote (it starts at the
    clock's second)."""
    topic = f"imex/v2/domains/{domain}/workloads/{name}"
    with c.client() as client:
        return msgspec.json.decode(client.retained(topic)[topic], type=WorkloadRecord).generation


def device(node: Node, channel: int) -> Path:
    return node.dev_dir / f"channel{channel}"


def handoff_files(node: Node, name: str) -> list[Path]:
    return [node.cdi_dir / f"imexd-{name}.json", node.env_dir / f"{name}.env"]


def listed(node: Node) -> dict[str, dict[str, Any]]:
    """The workloads in the node's /status `channels`, by name."""
    view = node.status().get("channels") or {}
    return {w["workload"]: w for w in view.get("workloads", [])}


def ready_with(node: Node, name: str, generation: int) -> bool:
    entry = listed(node).get(name)
    return entry is not None and entry["ready"] and entry["generation"] == generation


def test_a_workload_gets_its_device_on_its_nodes_only(c: Cluster) -> None:
    """Listed nodes make 242:N with the owner and mode, report it ready; a new mode is fixed
    in place; the record deleted, device, CDI spec and env file go."""
    n1, n2, n3 = (c.add(name) for name in ("n1", "n2", "n3"))
    c.wait(c.all_ready, timeout=60)
    publish(c, "job-a", 3, nodes=["n1", "n2"], uid=1000, gid=1001, mode=0o660, generation=1)
    c.wait(lambda: ready_with(n1, "job-a", 1) and ready_with(n2, "job-a", 1), timeout=WAIT_S)
    inodes = {}
    for node in (n1, n2):
        info = os.lstat(device(node, 3))
        assert stat.S_ISCHR(info.st_mode), node.name
        assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (CHANNEL_MAJOR, 3)
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (1000, 1001, 0o660)
        inodes[node.name] = info.st_ino
        assert all(path.exists() for path in handoff_files(node, "job-a")), node.name
        cond = node.condition("ChannelsReady")
        assert (cond["status"], cond["reason"]) == ("True", "Ready"), cond
        assert node.status()["channels"]["count"] == 2048
        code, metrics = node.get("/metrics")
        assert code == 200
        assert 'imexd_channel_ready{channel="3",workload="job-a"} 1.0' in metrics
    assert not device(n3, 3).exists()
    assert listed(n3) == {}
    assert n3.condition("ChannelsReady")["reason"] == "NoWorkloads"

    publish(c, "job-a", 3, nodes=["n1", "n2"], uid=1000, gid=1001, mode=0o600, generation=2)
    c.wait(lambda: ready_with(n1, "job-a", 2) and ready_with(n2, "job-a", 2), timeout=WAIT_S)
    for node in (n1, n2):
        info = os.lstat(device(node, 3))
        assert stat.S_IMODE(info.st_mode) == 0o600, node.name
        assert info.st_ino == inodes[node.name], f"{node.name}: recreated, not fixed in place"

    delete(c, "job-a")
    c.wait(lambda: listed(n1) == {} and listed(n2) == {}, timeout=WAIT_S)
    for node in (n1, n2):
        assert not device(node, 3).exists(), node.name
        assert not any(path.exists() for path in handoff_files(node, "job-a")), node.name
        assert "job-a" not in node.get("/metrics")[1]


def test_a_stale_channel_node_is_removed_after_start(c: Cluster) -> None:
    """A channel node no live workload owns, left before the agent started, goes
    (CVE-2024-42511), while a live workload's node stays."""
    n1 = c.add("n1", start=False)
    publish(c, "job-a", 3, nodes=["n1"], generation=1)
    n1.dev_dir.mkdir(parents=True)
    stale = device(n1, 7)
    os.mknod(stale, stat.S_IFCHR | 0o666, os.makedev(CHANNEL_MAJOR, 7))
    other = n1.dev_dir / "README"
    other.write_text("not a channel node: left alone\n")
    n1.start()
    c.wait(lambda: ready_with(n1, "job-a", 1), timeout=WAIT_S)
    assert not stale.exists()
    assert other.exists()
    assert device(n1, 3).exists()


def test_a_hand_over_keeps_the_devices_and_a_leave_removes_them(c: Cluster) -> None:
    """SIGUSR2 keeps the device for the next agent (same inode); SIGTERM removes it all."""
    n1 = c.add("n1")
    publish(c, "job-a", 3, generation=1)
    c.wait(lambda: ready_with(n1, "job-a", 1), timeout=WAIT_S)
    inode = os.lstat(device(n1, 3)).st_ino
    n1.signal(signal.SIGUSR2)
    assert n1.wait_exit() == EXIT_HANDOVER
    assert os.lstat(device(n1, 3)).st_ino == inode
    assert all(path.exists() for path in handoff_files(n1, "job-a"))

    n1.start()
    c.wait(lambda: ready_with(n1, "job-a", 1), timeout=WAIT_S)
    # The channel is ready at once from the devices on disk; wait until the agent took
    # the daemon over too: an agent leaves running a daemon it has not taken over yet.
    c.wait(c.all_ready, timeout=WAIT_S)
    assert os.lstat(device(n1, 3)).st_ino == inode, "the next agent keeps the node"
    assert n1.stop() == 0
    assert not device(n1, 3).exists()
    assert not any(path.exists() for path in handoff_files(n1, "job-a"))
    assert list(n1.cdi_dir.iterdir()) == []
    assert list(n1.env_dir.iterdir()) == []


def test_members_with_different_channel_counts_say_so(c: Cluster) -> None:
    """Each member record carries the driver's count; a member with another count makes
    ChannelsReady False ChannelCountMismatch on the others, naming it and its count."""
    n1 = c.add("n1")
    n2 = c.add("n2", start=False)
    (n2.dir / "driver-params").write_text("ImexChannelCount: 1024\nCreateImexChannel0: 0\n")
    n2.start()
    c.wait(c.all_ready, timeout=60)

    def counts() -> dict[str, int | None]:
        with c.client() as client:
            found = client.retained("imex/v2/domains/d1/members/#")
        return {
            record.node: record.channel_count
            for record in (decode(p, MemberRecord) for p in found.values())
            if isinstance(record, MemberRecord)
        }

    c.wait(lambda: counts() == {"n1": 2048, "n2": 1024}, timeout=WAIT_S)
    c.wait(lambda: n1.condition("ChannelsReady").get("reason") == "ChannelCountMismatch")
    message = n1.condition("ChannelsReady")["message"]
    assert "2048 on n1" in message
    assert "n2 1024" in message
    assert n2.condition("ChannelsReady")["reason"] == "ChannelCountMismatch"
    assert n2.status()["channels"]["count"] == 1024


# The operator's commands end to end: `imexd workload ...` and `domain create --channel`.


def test_a_shared_domain_serves_two_jobs_on_their_own_channels(c: Cluster) -> None:
    """The shared layout: one rack domain, two jobs created by the CLI get channels 1 and
    2 on their nodes, `--wait` returns once they are ready, `env` prints what a TaskProlog
    exports, and deleting one job leaves the other's channel and the IMEX daemons alone."""
    nodes = [c.add(name) for name in ("n1", "n2", "n3")]
    c.wait(c.all_ready, timeout=60)
    pids = {n.name: n.daemon_pid() for n in nodes}
    a = c.imexd("workload", "create", "job-a", "--domain", "d1", "--nodes", "n1,n2",
                "--uid", "1000", "--gid", "1000", "--wait", "30")  # fmt: skip
    assert a.returncode == 0, a.stdout + a.stderr
    b = c.imexd("workload", "create", "job-b", "--domain", "d1", "--nodes", "n2,n3",
                "--uid", "1001", "--gid", "1001", "--mode", "0600", "--wait", "30")  # fmt: skip
    assert b.returncode == 0, b.stdout + b.stderr
    # Each job's device exists at once: --wait returned when every node reported it ready.
    for node, channel, owner, mode in (
        (nodes[0], 1, 1000, 0o660),
        (nodes[1], 1, 1000, 0o660),
        (nodes[1], 2, 1001, 0o600),
        (nodes[2], 2, 1001, 0o600),
    ):
        info = os.lstat(device(node, channel))
        assert (os.minor(info.st_rdev), info.st_uid, stat.S_IMODE(info.st_mode)) == (
            channel,
            owner,
            mode,
        ), node.name
    assert not device(nodes[0], 2).exists()
    assert not device(nodes[2], 1).exists()
    status = c.imexd("workload", "status", "job-b")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "READY, 2 of 2 nodes ready" in status.stdout, status.stdout
    env = c.imexd("workload", "env", "job-b")
    assert env.returncode == 0, env.stderr
    assert "export IMEX_CHANNEL=2" in env.stdout.splitlines()
    listing = c.imexd("workload", "list", "--domain", "d1")
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[:3] for line in listing.stdout.splitlines()[1:]] == [
        ["d1", "job-a", "1"],
        ["d1", "job-b", "2"],
    ]
    gone = c.imexd("workload", "delete", "job-a", "--wait", "30")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert not device(nodes[0], 1).exists()
    assert not device(nodes[1], 1).exists()
    assert device(nodes[1], 2).exists(), "the other job keeps its channel"
    assert {n.name: n.daemon_pid() for n in nodes} == pids, "no IMEX restart for a job"
    again = c.imexd("workload", "create", "job-c", "--domain", "d1", "--nodes", "n1",
                    "--wait", "30")  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert device(nodes[0], 1).exists(), "the freed channel 1 is the lowest free one again"


def test_a_per_job_domain_gets_its_channel_with_one_command(c: Cluster) -> None:
    """The per-job layout: `domain create --channel --wait` in a prolog makes the domain
    and workload of the same name on channel 0 and exits 0 once the domain is UP and every
    node has the channel; `domain delete --wait` in the epilog removes both."""
    nodes = [c.add(name, domain=None) for name in ("n1", "n2")]
    c.wait(c.all_ready, timeout=60)
    made = c.imexd("domain", "create", "job-7", "--nodes", "n1,n2", "--channel",
                   "--uid", "1000", "--gid", "1000", "--wait", "30")  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    assert "domain job-7: UP, 2 of 2 members ready" in made.stdout
    assert "workload job-7 in job-7: READY, 2 of 2 nodes ready" in made.stdout
    for node in nodes:  # made before the command returned
        assert ready_with(node, "job-7", generation(c, "job-7", "job-7")), node.name
        info = os.lstat(device(node, 0))
        assert (os.minor(info.st_rdev), info.st_uid) == (0, 1000), node.name
    ended = c.imexd("domain", "delete", "job-7", "--wait", "30")
    assert ended.returncode == 0, ended.stdout + ended.stderr
    c.wait(lambda: not any(device(n, 0).exists() for n in nodes), timeout=WAIT_S)
    with c.client() as client:
        left = client.retained("imex/v2/domains/job-7/#")
    # What stays are tombstones: the spec's and the workload's, `deleted`.
    assert sorted(left) == ["imex/v2/domains/job-7/spec", "imex/v2/domains/job-7/workloads/job-7"]
    assert all(json.loads(left[t])["state"] == "deleted" for t in left), left


# Issue 21: a channel is one workload's across the domain; every read is complete; the
# keeper remembers across a restart.


def assert_device(node: Node, channel: int, uid: int, gid: int, mode: int) -> os.stat_result:
    """The node has `<dev_dir>/channel<N>`: a character device 242:N with this owner and mode."""
    info = os.lstat(device(node, channel))
    assert stat.S_ISCHR(info.st_mode), node.name
    assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (CHANNEL_MAJOR, channel)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (uid, gid, mode), node.name
    return info


def assert_no_device(node: Node, channel: int) -> None:
    with pytest.raises(FileNotFoundError):
        os.lstat(device(node, channel))


def refused_with(node: Node, name: str, reason: str) -> bool:
    entry = listed(node).get(name)
    return entry is not None and not entry["ready"] and entry["reason"] == reason


def test_a_channel_held_on_one_node_is_given_to_no_other_workload_anywhere(c: Cluster) -> None:
    """job1 holds channel 5 on n1; a second active record on channel 5 that lists n2 and n3
    gets no device there; status, list and domain status show the conflict with exit 1;
    create refuses to write a record on the held channel."""
    n1, n2, n3 = (c.add(name) for name in ("n1", "n2", "n3"))
    c.wait(c.all_ready, timeout=60)
    made = c.imexd("workload", "create", "job1", "--domain", "d1", "--nodes", "n1",
                   "--channel", "5", "--uid", "1001", "--gid", "1001", "--wait", "30")  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    publish(c, "job2", 5, nodes=["n2", "n3"], uid=6666, gid=6666, generation=1)
    c.wait(lambda: all(refused_with(n, "job2", "ChannelConflict") for n in (n2, n3)), WAIT_S)
    for node in (n2, n3):
        assert_no_device(node, 5)
        assert "job1 keeps it" in listed(node)["job2"]["message"]
    assert_device(n1, 5, 1001, 1001, 0o660)
    assert ready_with(n1, "job1", generation(c, "job1"))
    status = c.imexd("workload", "status", "job1")
    assert status.returncode == 1, status.stdout + status.stderr
    assert "ChannelConflict: channel 5 of d1 is claimed by workloads job1, job2" in status.stdout
    listing = c.imexd("workload", "list")
    assert listing.returncode == 1
    assert "ChannelConflict: channel 5 of d1" in listing.stderr
    domain = c.imexd("domain", "status", "d1")
    assert domain.returncode == 1
    assert "ChannelConflict: channel 5 of d1" in domain.stderr
    again = c.imexd("workload", "create", "job3", "--domain", "d1", "--channel", "5")
    assert again.returncode == 2
    assert "channel 5 of d1 is used by workload" in again.stderr
    delete(c, "job1")
    c.wait(lambda: ready_with(n2, "job2", 1) and ready_with(n3, "job2", 1), WAIT_S)
    assert_no_device(n1, 5)
    for node in (n2, n3):
        assert_device(node, 5, 6666, 6666, 0o660)


def test_a_conflict_resolved_before_a_hand_over_stays_resolved_after_it(c: Cluster) -> None:
    """job-a's device was made first; job-b on the same channel is refused; after a
    hand-over (SIGUSR2) the next agent reads the holder from disk: job-a keeps the same
    device node, job-b stays refused."""
    n1 = c.add("n1")
    publish(c, "job-a", 3, nodes=["n1"], uid=1000, gid=1000, generation=1)
    c.wait(lambda: ready_with(n1, "job-a", 1), timeout=WAIT_S)
    publish(c, "job-b", 3, nodes=["n1"], uid=6666, gid=6666, generation=1)
    c.wait(lambda: refused_with(n1, "job-b", "ChannelConflict"), timeout=WAIT_S)
    inode = assert_device(n1, 3, 1000, 1000, 0o660).st_ino
    n1.signal(signal.SIGUSR2)
    assert n1.wait_exit() == EXIT_HANDOVER
    n1.start()
    c.wait(lambda: ready_with(n1, "job-a", 1), timeout=WAIT_S)
    c.wait(c.all_ready, timeout=WAIT_S)  # the daemon taken over too (see the test above)
    assert refused_with(n1, "job-b", "ChannelConflict")
    assert assert_device(n1, 3, 1000, 1000, 0o660).st_ino == inode


MANY = 200
"""Workloads on one node: more retained records than any broker's in-flight window."""


@pytest.mark.timeout(300)
def test_every_device_stays_across_a_restart_with_many_workloads(c: Cluster) -> None:
    """MANY workloads on n1: after a hand-over the next agent's first apply sees them all
    (no device removed and made again), and `workload delete` finds the last one."""
    n1 = c.add("n1")
    c.wait(c.all_ready, timeout=60)
    with c.client() as client:
        for channel in range(1, MANY + 1):
            record = WorkloadRecord(
                workload=f"w{channel:03d}", domain="d1", channel=channel, nodes=["n1"],
                uid=1000, gid=1000, generation=1,
            )  # fmt: skip
            client.publish(
                f"imex/v2/domains/d1/workloads/w{channel:03d}", encode(record), retain=True
            )

    def made() -> int:
        return sum(1 for path in n1.dev_dir.glob("channel*"))

    c.wait(lambda: made() == MANY, timeout=120)
    inodes = {channel: os.lstat(device(n1, channel)).st_ino for channel in range(1, MANY + 1)}
    n1.signal(signal.SIGUSR2)
    assert n1.wait_exit() == EXIT_HANDOVER
    n1.start()
    last = f'imexd_channel_ready{{channel="{MANY}",workload="w{MANY}"}} 1.0'
    c.wait(lambda: last in (n1.get("/metrics")[1] or ""), timeout=120)
    now = {channel: os.lstat(device(n1, channel)).st_ino for channel in range(1, MANY + 1)}
    assert now == inodes, "devices were removed and made again after the restart"
    gone = c.imexd("workload", "delete", f"w{MANY}", "--domain", "d1", "--wait", "30")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert_no_device(n1, MANY)
