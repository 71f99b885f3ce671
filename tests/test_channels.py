"""IMEX channel devices: parsing the driver's facts, the per-node plan, and real device nodes.

The device tests make real character devices with mknod in tmp_path (the major need not
belong to a loaded driver: nothing opens them) and check them with os.lstat; they need
root and are skipped otherwise. CDI specs are validated against a JSON schema written for
these tests from the CDI specification's text (tests/fixtures/cdi-spec.schema.json).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator  # type: ignore[import-untyped] # no stubs

from imexd.channels.devices import (
    CDI_KIND,
    CONTAINER_DEV_DIR,
    DEVICE_NAME,
    Applied,
    Devices,
    Driver,
    Want,
    cdi_spec,
    channel_holders,
    env_text,
    parse_driver_params,
    parse_proc_devices,
    plan,
    read_driver,
    standin_text,
)
from imexd.channels.fleet import judge_workload, render_workload_status
from imexd.errors import ConfigError
from imexd.facts import BusFacts, ChannelFacts, ChannelState, Facts
from imexd.health import conditions as health
from imexd.health.conditions import CHANNEL_MESSAGE_MAX
from imexd.messages import ChannelsView, DaemonInfo, HealthReport, WorkloadRecord
from imexd.settings import ChannelsSettings, load_settings

FIXTURES = Path(__file__).parent / "fixtures"
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mknod and chown need root (CI runs as root)")

MAJOR = 242
DRIVER = Driver(major=MAJOR, count=2048, channel0=False)
NODE = "node-a"
UID, GID = 4242, 4343

# /proc/devices of an H200 node with driver 570 (character block trimmed of unrelated lines).
PROC_DEVICES = """\
Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
  5 /dev/console
 10 misc
136 pts
195 nvidia-frontend
195 nvidia
234 nvidia-nvswitch
235 nvidia-nvlink
241 nvidia-caps
242 nvidia-caps-imex-channels
508 nvidia-uvm
510 nvidia-modeset

Block devices:
  7 loop
  8 sd
259 blkext
"""

# /proc/driver/nvidia/params of the same node (abridged).
DRIVER_PARAMS = """\
ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
EnableStreamMemOPs: 0
RegistryDwords: ""
RegistryDwordsPerDevice: ""
RmMsg: ""
GpuBlacklist: ""
ImexChannelCount: 2048
CreateImexChannel0: 0
GrdmaPciTopoCheckOverride: 0
"""


def _record(
    workload: str,
    channel: int,
    *,
    domain: str = "d1",
    nodes: list[str] | None = None,
    state: str = "active",
    generation: int = 1,
    uid: int = UID,
    gid: int = GID,
    mode: int = 0o660,
) -> WorkloadRecord:
    return WorkloadRecord(
        workload=workload,
        domain=domain,
        channel=channel,
        nodes=nodes,
        uid=uid,
        gid=gid,
        mode=mode,
        state="claiming" if state == "claiming" else "active",
        generation=generation,
    )


def _want(workload: str = "w1", channel: int = 3, **changes: Any) -> Want:
    want = Want(
        workload=workload,
        domain="d1",
        clique="0b1f-uuid.7",
        channel=channel,
        uid=UID,
        gid=GID,
        mode=0o660,
        generation=1,
    )
    return msgspec.structs.replace(want, **changes)


def _plan(
    records: list[WorkloadRecord], *, driver: Driver = DRIVER, held: dict[int, str] | None = None
) -> tuple[dict[int, Want], list[Any]]:
    return plan(records, node=NODE, domain="d1", clique="c.1", driver=driver, held=held or {})


# --- parsing ---------------------------------------------------------------------------


def test_proc_devices_gives_the_channel_major() -> None:
    """The H200 line `242 nvidia-caps-imex-channels` gives major 242, not nvidia-caps's."""
    assert parse_proc_devices(PROC_DEVICES) == 242


def test_a_block_device_of_the_same_name_does_not_count() -> None:
    """Only the "Character devices:" block names the channel device."""
    text = f"Character devices:\n  1 mem\n\nBlock devices:\n242 {DEVICE_NAME}\n"
    assert parse_proc_devices(text) is None


def test_proc_devices_without_the_line_or_garbage_gives_none() -> None:
    """No line, a line before any header, a bad number or noise: no major."""
    assert parse_proc_devices("Character devices:\n  1 mem\n") is None
    assert parse_proc_devices(f"242 {DEVICE_NAME}\n") is None
    assert parse_proc_devices(f"Character devices:\nabc {DEVICE_NAME}\n") is None
    assert parse_proc_devices(f"Character devices:\n0 {DEVICE_NAME}\n") is None
    assert parse_proc_devices(f"Character devices:\n{'9' * 5000} {DEVICE_NAME}\n") is None
    assert parse_proc_devices(f"Character devices:\n242 {DEVICE_NAME}-x\n") is None
    assert parse_proc_devices("\x00\xff garbage :::\n") is None
    assert parse_proc_devices("") is None


def test_driver_params_give_count_and_channel0() -> None:
    """ImexChannelCount and CreateImexChannel0 are read among the driver's other params."""
    assert parse_driver_params(DRIVER_PARAMS) == (2048, False)
    created = DRIVER_PARAMS.replace("CreateImexChannel0: 0", "CreateImexChannel0: 1")
    assert parse_driver_params(created) == (2048, True)


def test_driver_params_garbage_gives_none() -> None:
    """A missing key, a negative, non-numeric or absurd value is unknown, not a crash."""
    assert parse_driver_params("") == (None, None)
    assert parse_driver_params("garbage\n\x00: :\n") == (None, None)
    assert parse_driver_params("ImexChannelCount: -1\nCreateImexChannel0: yes\n") == (None, None)
    assert parse_driver_params(f"ImexChannelCount: {'9' * 5000}\n") == (None, None)
    assert parse_driver_params("ImexChannelCount: 99999999\n") == (None, None)
    assert parse_driver_params("ImexChannelCount: 0\n") == (0, None)


def test_read_driver_reads_both_files(tmp_path: Path) -> None:
    """With both files readable, every fact is known and there is no error."""
    devices, params = tmp_path / "devices", tmp_path / "params"
    devices.write_text(PROC_DEVICES)
    params.write_text(DRIVER_PARAMS)
    settings = ChannelsSettings(proc_devices=str(devices), driver_params=str(params))
    assert read_driver(settings) == Driver(major=242, count=2048, channel0=False, error="")


def test_read_driver_never_raises(tmp_path: Path) -> None:
    """Missing files and a missing line are facts with a reason naming the path."""
    devices, params = tmp_path / "devices", tmp_path / "params"
    missing = read_driver(ChannelsSettings(proc_devices=str(devices), driver_params=str(params)))
    assert (missing.major, missing.count, missing.channel0) == (None, None, None)
    assert f"cannot read {devices}: No such file or directory" in missing.error
    assert f"cannot read {params}" in missing.error

    devices.write_text("Character devices:\n  1 mem\n")
    params.mkdir()
    partial = read_driver(ChannelsSettings(proc_devices=str(devices), driver_params=str(params)))
    assert partial.major is None
    assert f"{devices} lists no {DEVICE_NAME} character device" in partial.error
    assert "Is a directory" in partial.error


# --- the plan --------------------------------------------------------------------------


def test_an_active_listed_workload_is_wanted() -> None:
    """The want carries the record's channel, owner, mode and generation, and the clique."""
    wants, refusals = _plan([_record("w1", 5, nodes=[NODE, "node-b"], generation=3, mode=0o600)])
    assert refusals == []
    assert wants == {
        5: Want(
            workload="w1",
            domain="d1",
            clique="c.1",
            channel=5,
            uid=UID,
            gid=GID,
            mode=0o600,
            generation=3,
        )
    }


def test_a_record_without_nodes_lists_every_node() -> None:
    """nodes None: every node of the domain makes the device."""
    wants, _ = _plan([_record("w1", 5, nodes=None)])
    assert list(wants) == [5]


def test_other_nodes_domains_and_claims_are_ignored() -> None:
    """Only active records of the node's domain that list this node count."""
    records = [
        _record("elsewhere", 1, nodes=["node-b"]),
        _record("other-domain", 2, domain="d2"),
        _record("claim", 3, state="claiming"),
    ]
    assert _plan(records) == ({}, [])


def test_no_channel_device_refuses_every_workload() -> None:
    """Without a major (no driver) nothing can be made; the message says why."""
    driver = Driver(major=None, count=None, channel0=None, error="/proc/devices lists no such")
    wants, refusals = _plan([_record("b", 2), _record("a", 1)], driver=driver)
    assert wants == {}
    assert [(r.workload, r.reason) for r in refusals] == [
        ("a", "NoChannelDevice"),
        ("b", "NoChannelDevice"),
    ]
    assert "/proc/devices lists no such" in refusals[0].message


def test_no_channel_device_says_why_in_whole_words(tmp_path: Path) -> None:
    """Seen on a machine without a GPU: the reason shown for NoChannelDevice was cut
    mid-sentence ("(the NVIDIA driver is not loaded, or ...") because it repeated itself
    and carried the driver parameters' problems too. It is the major's own clause, whole
    within the report's limit for a channel message."""
    devices, params = tmp_path / "devices", tmp_path / "params"
    devices.write_text("Character devices:\n  1 mem\n")
    driver = read_driver(ChannelsSettings(proc_devices=str(devices), driver_params=str(params)))
    assert "cannot read" in driver.error  # the parameters' problem is known, not repeated
    _, refusals = _plan([_record("w1", 1)], driver=driver)
    message = refusals[0].message
    assert message == (
        f"{devices} lists no {DEVICE_NAME} character device (the NVIDIA driver is not "
        "loaded, or too old for IMEX channels)"
    )
    on_proc = message.replace(str(devices), "/proc/devices")
    assert len(on_proc) <= CHANNEL_MESSAGE_MAX
    missing = read_driver(ChannelsSettings(proc_devices=str(tmp_path / "none")))
    _, refusals = _plan([_record("w1", 1)], driver=missing)
    assert refusals[0].message.startswith(f"cannot read {tmp_path / 'none'}: No such file")


def test_a_channel_at_or_above_the_count_is_out_of_range() -> None:
    """Channels 0..count-1 exist; an unknown count checks nothing."""
    driver = msgspec.structs.replace(DRIVER, count=4)
    wants, refusals = _plan([_record("a", 3), _record("b", 4, generation=7)], driver=driver)
    assert list(wants) == [3]
    assert [(r.workload, r.channel, r.generation, r.reason) for r in refusals] == [
        ("b", 4, 7, "ChannelOutOfRange")
    ]
    assert "ImexChannelCount is 4" in refusals[0].message
    wants, refusals = _plan([_record("b", 4)], driver=msgspec.structs.replace(DRIVER, count=None))
    assert list(wants) == [4]
    assert refusals == []


def test_a_conflict_without_a_holder_gives_the_channel_to_none() -> None:
    """Two workloads on one channel, neither device made yet: neither gets it."""
    wants, refusals = _plan([_record("a", 5), _record("b", 5), _record("c", 6)])
    assert list(wants) == [6]
    assert [(r.workload, r.reason) for r in refusals] == [
        ("a", "ChannelConflict"),
        ("b", "ChannelConflict"),
    ]
    assert "also used by workload(s) b" in refusals[0].message


def test_a_conflict_is_sticky() -> None:
    """The workload whose device this agent made keeps the channel."""
    wants, refusals = _plan([_record("a", 5), _record("b", 5)], held={5: "b"})
    assert wants[5].workload == "b"
    assert [(r.workload, r.reason) for r in refusals] == [("a", "ChannelConflict")]
    assert "b keeps it" in refusals[0].message


def test_a_holder_that_is_gone_keeps_nothing() -> None:
    """held names a workload no longer on the channel: the rest still conflict."""
    wants, refusals = _plan([_record("a", 5), _record("b", 5)], held={5: "gone"})
    assert wants == {}
    assert {r.workload for r in refusals} == {"a", "b"}


def test_a_channel_is_one_workloads_across_the_domain() -> None:
    """Two workloads on one channel conflict on every node, whatever their node lists: the
    holder keeps it where it is listed, the other gets it nowhere."""
    records = [_record("a", 5, nodes=[NODE]), _record("b", 5, nodes=["node-b", "node-c"])]
    wants, refusals = _plan(records, held={5: "a"})
    assert wants[5].workload == "a"
    assert refusals == []
    for node in ("node-b", "node-c"):
        wants, refusals = plan(
            records, node=node, domain="d1", clique="c.1", driver=DRIVER, held={5: "a"}
        )
        assert wants == {}, node
        assert [(r.workload, r.reason) for r in refusals] == [("b", "ChannelConflict")]
        assert "a keeps it" in refusals[0].message
    wants, refusals = _plan(records)
    assert wants == {}
    assert [(r.workload, r.reason) for r in refusals] == [("a", "ChannelConflict")]
    other = _record("c", 5, domain="d2", nodes=["node-b"])
    wants, _ = plan(
        [*records, other], node="node-b", domain="d2", clique="c.1", driver=DRIVER, held={}
    )
    assert wants[5].workload == "c", "another domain's channel 5 is another channel"


def test_a_channel_holder_stays_while_its_record_is_active_on_the_channel() -> None:
    """The only record on a channel holds it; a second one never takes it from the holder;
    with the holder gone and two left, none holds it until one is left."""
    a, b, c = _record("a", 5), _record("b", 5, nodes=["x"]), _record("c", 5)
    assert channel_holders([a], domain="d1", before={}) == {5: "a"}
    assert channel_holders([a, b], domain="d1", before={5: "a"}) == {5: "a"}
    assert channel_holders([a, b], domain="d1", before={}) == {}
    assert channel_holders([b, c], domain="d1", before={5: "a"}) == {}
    assert channel_holders([b], domain="d1", before={5: "a"}) == {5: "b"}
    moved = _record("a", 6, generation=2)
    assert channel_holders([moved, b], domain="d1", before={5: "a"}) == {5: "b", 6: "a"}
    claiming = _record("c", 5, state="claiming")
    assert channel_holders([claiming, b], domain="d1", before={}) == {5: "b"}
    assert channel_holders([_record("a", 5, domain="d2")], domain="d1", before={}) == {}


_NODES = ["n1", "n2", "n3"]
_records = st.lists(
    st.builds(
        _record,
        workload=st.sampled_from(["a", "b", "c", "d"]),
        channel=st.integers(min_value=0, max_value=3),
        domain=st.sampled_from(["d1", "d1", "d2"]),
        nodes=st.none() | st.lists(st.sampled_from(_NODES), unique=True, max_size=3),
        state=st.sampled_from(["active", "active", "claiming"]),
        generation=st.integers(min_value=1, max_value=3),
    ),
    max_size=8,
)


@given(
    history=st.lists(_records, min_size=1, max_size=4),
    forgets=st.lists(st.sets(st.integers(min_value=0, max_value=3)), min_size=3, max_size=3),
)
def test_no_two_workloads_of_a_domain_ever_hold_one_channel(
    history: list[list[WorkloadRecord]], forgets: list[set[int]]
) -> None:
    """Over any sequence of workload views, each node planning with what it knows of the
    holders (all of it, or less after a restart: `forgets`), no channel of d1 has devices
    for two workloads, on any nodes."""
    known = [{} for _ in _NODES]  # type: list[dict[int, str]]
    for records in history:
        devices: dict[int, set[str]] = {}
        for index, node in enumerate(_NODES):
            before = {c: w for c, w in known[index].items() if c not in forgets[index]}
            known[index] = channel_holders(records, domain="d1", before=before)
            wants, _ = plan(
                records, node=node, domain="d1", clique="c.1", driver=DRIVER, held=known[index]
            )
            for channel, want in wants.items():
                devices.setdefault(channel, set()).add(want.workload)
        assert all(len(names) == 1 for names in devices.values()), devices


@given(st.permutations([("a", 5), ("b", 5), ("c", 6), ("d", 9999), ("e", 1)]))
def test_the_plan_does_not_depend_on_record_order(order: list[tuple[str, int]]) -> None:
    """Same records in any order: same wants in the same order, refusals by name."""
    driver = msgspec.structs.replace(DRIVER, count=100)
    wants, refusals = _plan([_record(name, channel) for name, channel in order], driver=driver)
    assert [(channel, want.workload) for channel, want in wants.items()] == [(6, "c"), (1, "e")]
    assert [r.workload for r in refusals] == ["a", "b", "d"]


# --- hand-off files ----------------------------------------------------------------------


def _cdi_validator() -> Any:
    schema = json.loads((FIXTURES / "cdi-spec.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _edits(spec: dict[str, Any]) -> dict[str, Any]:
    edits: dict[str, Any] = spec["devices"][0]["containerEdits"]
    return edits


def _node_edit(spec: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = _edits(spec)["deviceNodes"][0]
    return node


def _without(mapping: dict[str, Any], key: str) -> None:
    del mapping[key]


@pytest.mark.parametrize(
    ("why", "breaks"),
    [
        ("no cdiVersion", lambda spec: _without(spec, "cdiVersion")),
        ("cdiVersion not semver", lambda spec: spec.update(cdiVersion="0.6")),
        ("no kind", lambda spec: _without(spec, "kind")),
        ("kind without a class", lambda spec: spec.update(kind="imexd.io")),
        ("kind with two slashes", lambda spec: spec.update(kind="imexd.io/channel/x")),
        ("kind class ends in a dash", lambda spec: spec.update(kind="imexd.io/channel-")),
        ("kind vendor with an underscore", lambda spec: spec.update(kind="imexd_io/channel")),
        ("kind class over 63 characters", lambda spec: spec.update(kind="imexd.io/" + "c" * 64)),
        ("no devices", lambda spec: spec.update(devices=[])),
        ("device without a name", lambda spec: _without(spec["devices"][0], "name")),
        ("device name starts with a dot", lambda spec: spec["devices"][0].update(name=".w1")),
        ("device name ends in a newline", lambda spec: spec["devices"][0].update(name="w1\n")),
        ("env entry without '='", lambda spec: _edits(spec)["env"].append("IMEX_CHANNEL")),
        ("env entry with an empty name", lambda spec: _edits(spec)["env"].append("=3")),
        ("relative device node path", lambda spec: _node_edit(spec).update(path="dev/x")),
        ("relative device node hostPath", lambda spec: _node_edit(spec).update(hostPath="x")),
        ("device node without a path", lambda spec: _without(_node_edit(spec), "path")),
        ("unknown node type", lambda spec: _node_edit(spec).update(type="x")),
        ("major as a string", lambda spec: _node_edit(spec).update(major="242")),
        ("fileMode as a string", lambda spec: _node_edit(spec).update(fileMode="0660")),
        ("permission outside r, w, m", lambda spec: _node_edit(spec).update(permissions="rx")),
        ("permission twice", lambda spec: _node_edit(spec).update(permissions="rr")),
        ("negative uid", lambda spec: _node_edit(spec).update(uid=-1)),
        ("gid beyond uint32", lambda spec: _node_edit(spec).update(gid=2**32)),
        ("stray top-level key", lambda spec: spec.update(stray=1)),
        ("misspelt edit key", lambda spec: _edits(spec).update(envs=[])),
        ("top-level edits not an object", lambda spec: spec.update(containerEdits=[])),
    ],
)
def test_the_cdi_schema_rejects_a_broken_spec(why: str, breaks: Callable[[Any], object]) -> None:
    """The validator is live: imexd's spec passes, the same spec broken in one place fails."""
    validator = _cdi_validator()
    spec = cdi_spec(_want(), major=MAJOR, dev_dir="/dev/x")
    validator.validate(spec)
    broken = json.loads(json.dumps(spec))
    breaks(broken)
    assert not validator.is_valid(broken), why


def test_the_cdi_schema_accepts_the_optional_parts_the_spec_defines() -> None:
    """Top-level edits, annotations, mounts, hooks and a pipe node are valid CDI too."""
    spec = cdi_spec(_want(), major=MAJOR, dev_dir="/dev/x")
    spec["annotations"] = {"imexd.io/domain": "d1"}
    spec["devices"].append({"name": "foo-bar123.B_az"})
    spec["containerEdits"] = {
        "env": ["EMPTY="],
        "deviceNodes": [{"path": "/dev/fifo", "type": "p", "permissions": "mwr"}],
        "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro", "bind"]}],
        "hooks": [{"hookName": "createContainer", "path": "/bin/true", "timeout": 5}],
        "additionalGids": [5],
    }
    validator = _cdi_validator()
    validator.validate(spec)
    for kind in ("vendor.com/foo", "foo.bar.baz/foo-bar123.B_az", "x/y"):
        validator.validate({**spec, "kind": kind})


def test_the_cdi_spec_is_the_contract_and_valid_cdi() -> None:
    """One device named after the workload: its channel node and the workload's env."""
    spec = cdi_spec(_want(channel=7, mode=0o600), major=MAJOR, dev_dir="/host/dev/chan")
    _cdi_validator().validate(spec)
    assert spec == {
        "cdiVersion": "0.6.0",
        "kind": CDI_KIND,
        "devices": [
            {
                "name": "w1",
                "containerEdits": {
                    "deviceNodes": [
                        {
                            "path": f"{CONTAINER_DEV_DIR}/channel7",
                            "hostPath": "/host/dev/chan/channel7",
                            "type": "c",
                            "major": MAJOR,
                            "minor": 7,
                            "fileMode": 0o600,
                            "permissions": "rw",
                            "uid": UID,
                            "gid": GID,
                        }
                    ],
                    "env": [
                        "IMEX_CHANNEL=7",
                        "IMEXD_WORKLOAD=w1",
                        "IMEXD_DOMAIN=d1",
                        "IMEXD_CLIQUE=0b1f-uuid.7",
                    ],
                },
            }
        ],
    }


def test_the_env_file_is_key_value_lines() -> None:
    """The env file has the contract's lines, no quotes."""
    assert env_text(_want(channel=7)) == (
        "IMEX_CHANNEL=7\n"
        "IMEXD_WORKLOAD=w1\n"
        "IMEXD_DOMAIN=d1\n"
        "IMEXD_CLIQUE=0b1f-uuid.7\n"
        f"IMEXD_CHANNEL_DEVICE={CONTAINER_DEV_DIR}/channel7\n"
    )


def test_the_env_file_sources_in_a_shell(tmp_path: Path) -> None:
    """`set -a; . file` exports every line as written (a Slurm TaskProlog's use)."""
    path = tmp_path / "w1.env"
    path.write_text(env_text(_want(clique="")))
    proc = subprocess.run(
        ["sh", "-c", 'set -a; . "$1"; exec env', "sh", str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        timeout=10,
    )
    seen = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert seen["IMEX_CHANNEL"] == "3"
    assert seen["IMEXD_CLIQUE"] == ""
    assert seen["IMEXD_CHANNEL_DEVICE"] == f"{CONTAINER_DEV_DIR}/channel3"


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"workload": "../etc"}, "'../etc'"),
        ({"workload": "a/b"}, "'a/b'"),
        ({"domain": "d\nEVIL=1"}, "'d\\nEVIL=1'"),
        ({"clique": "c x"}, "'c x'"),
        ({"channel": -1}, "-1"),
        ({"mode": 0o4755}, "0o4755"),
        ({"uid": -1}, "uid -1"),
        ({"gid": 4294967295}, "gid 4294967295"),
    ],
)
def test_unsafe_values_are_refused_by_name(changes: dict[str, Any], named: str) -> None:
    """A value that could leave its folder or add a line is a ValueError naming it."""
    want = _want(**changes)
    with pytest.raises(ValueError, match=r"is not|beyond") as caught:
        env_text(want)
    assert named in str(caught.value)
    with pytest.raises(ValueError, match=r"is not|beyond"):
        cdi_spec(want, major=MAJOR, dev_dir="/dev/x")


# --- device nodes (root) -------------------------------------------------------------------


@pytest.fixture
def settings(tmp_path: Path) -> ChannelsSettings:
    return ChannelsSettings(
        dev_dir=str(tmp_path / "dev" / "nvidia-caps-imex-channels"),
        cdi_dir=str(tmp_path / "cdi"),
        env_dir=str(tmp_path / "env"),
    )


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """A umask that would strip the wanted bits if mode were set at mknod only."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _node(settings: ChannelsSettings, channel: int) -> Path:
    return Path(settings.dev_dir) / f"channel{channel}"


def _mknod(path: Path, major: int, minor: int, mode: int = 0o666) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    os.chmod(path, mode)


def _assert_device(path: Path, want: Want) -> os.stat_result:
    st_ = os.lstat(path)
    assert stat.S_ISCHR(st_.st_mode), path
    assert (os.major(st_.st_rdev), os.minor(st_.st_rdev)) == (MAJOR, want.channel)
    assert (st_.st_uid, st_.st_gid) == (want.uid, want.gid)
    assert stat.S_IMODE(st_.st_mode) == want.mode
    return st_


def _names(folder: str) -> list[str]:
    return sorted(os.listdir(folder))


@needs_root
@pytest.mark.usefixtures("strict_umask")
def test_apply_makes_the_device_cdi_spec_and_env_file(settings: ChannelsSettings) -> None:
    """A wanted channel: the node (dev_dir made 0755), a valid CDI spec and the env file."""
    want = _want(channel=3, mode=0o660)
    applied = Devices(settings).apply({3: want}, major=MAJOR)
    assert applied.made == {"w1": want}
    assert applied.failures == []
    assert applied.held == {3: "w1"}
    assert applied.ops == {("mknod", "ok"): 1, ("cdi", "ok"): 1, ("env", "ok"): 1}
    assert not applied.channel0_open
    _assert_device(_node(settings, 3), want)
    for folder in (settings.dev_dir, settings.cdi_dir, settings.env_dir):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755, folder

    spec_path = Path(settings.cdi_dir) / "imexd-w1.json"
    spec = json.loads(spec_path.read_text())
    _cdi_validator().validate(spec)
    assert spec == cdi_spec(want, major=MAJOR, dev_dir=settings.dev_dir)
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"] == str(
        _node(settings, 3)
    )
    env_path = Path(settings.env_dir) / "w1.env"
    assert env_path.read_text() == env_text(want)
    for path in (spec_path, env_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


@needs_root
def test_a_second_apply_changes_nothing(settings: ChannelsSettings) -> None:
    """The same wants again: no operation, the hand-off files keep their inode."""
    devices = Devices(settings)
    devices.apply({3: _want()}, major=MAJOR)
    spec = Path(settings.cdi_dir) / "imexd-w1.json"
    before = (os.stat(spec).st_ino, os.lstat(_node(settings, 3)).st_ino)
    applied = devices.apply({3: _want()}, major=MAJOR)
    assert applied.ops == {}
    assert applied.made == {"w1": _want()}
    assert (os.stat(spec).st_ino, os.lstat(_node(settings, 3)).st_ino) == before


@needs_root
def test_a_right_node_is_fixed_in_place(settings: ChannelsSettings) -> None:
    """Owner and mode change on the same inode (an open descriptor stays valid)."""
    _mknod(_node(settings, 3), MAJOR, 3, mode=0o666)
    inode = os.lstat(_node(settings, 3)).st_ino
    want = _want(uid=7, gid=8, mode=0o600)
    applied = Devices(settings).apply({3: want}, major=MAJOR)
    assert applied.ops["fix", "ok"] == 1
    assert ("mknod", "ok") not in applied.ops
    assert _assert_device(_node(settings, 3), want).st_ino == inode


@needs_root
@pytest.mark.parametrize(("major", "minor"), [(MAJOR, 7), (MAJOR + 1, 3)])
def test_a_node_of_another_device_is_replaced(
    settings: ChannelsSettings, major: int, minor: int
) -> None:
    """A wrong minor or major at the path is unlinked and made anew."""
    _mknod(_node(settings, 3), major, minor)
    applied = Devices(settings).apply({3: _want()}, major=MAJOR)
    assert applied.ops["remove", "ok"] == 1
    assert applied.ops["mknod", "ok"] == 1
    _assert_device(_node(settings, 3), _want())


@needs_root
def test_a_regular_file_at_the_path_is_replaced(settings: ChannelsSettings) -> None:
    """A regular file named channel3 becomes the device."""
    _node(settings, 3).parent.mkdir(parents=True)
    _node(settings, 3).write_text("not a device")
    Devices(settings).apply({3: _want()}, major=MAJOR)
    _assert_device(_node(settings, 3), _want())


@needs_root
def test_a_symlink_at_the_path_is_replaced_and_its_target_untouched(
    settings: ChannelsSettings, tmp_path: Path
) -> None:
    """chown/chmod never follow a symlink named channel3: the link itself is replaced."""
    target = tmp_path / "precious"
    target.write_text("keep me")
    target.chmod(0o600)
    _node(settings, 3).parent.mkdir(parents=True)
    _node(settings, 3).symlink_to(target)
    Devices(settings).apply({3: _want(mode=0o666)}, major=MAJOR)
    _assert_device(_node(settings, 3), _want(mode=0o666))
    st_ = os.stat(target)
    assert target.read_text() == "keep me"
    assert (stat.S_IMODE(st_.st_mode), st_.st_uid) == (0o600, 0)


@needs_root
def test_stale_channel_nodes_are_removed_and_other_names_kept(
    settings: ChannelsSettings, tmp_path: Path
) -> None:
    """Every channel<digits> entry no want owns goes (CVE-2024-42511); other names stay."""
    dev = Path(settings.dev_dir)
    for channel in (0, 1, 9):
        _mknod(_node(settings, channel), MAJOR, channel, mode=0o666)
    _mknod(dev / "channel007", MAJOR, 7)
    target = tmp_path / "target"
    target.write_text("t")
    (dev / "channel12").symlink_to(target)
    for name in ("README", "channelx", "channel", "xchannel1"):
        (dev / name).write_text(name)
    applied = Devices(settings).apply({9: _want(channel=9)}, major=MAJOR)
    assert _names(settings.dev_dir) == ["README", "channel", "channel9", "channelx", "xchannel1"]
    assert applied.ops["remove", "ok"] == 4
    assert applied.problems == []
    assert not applied.channel0_open
    assert target.read_text() == "t"
    _assert_device(_node(settings, 9), _want(channel=9))


@needs_root
def test_keep_channel0_keeps_the_drivers_channel0(settings: ChannelsSettings) -> None:
    """keep_channel0: a world-writable channel0 nobody wants stays, and is reported open."""
    _mknod(_node(settings, 0), MAJOR, 0, mode=0o666)
    _mknod(_node(settings, 4), MAJOR, 4)
    devices = Devices(replace(settings, keep_channel0=True))
    applied = devices.apply({3: _want()}, major=MAJOR)
    assert _names(settings.dev_dir) == ["channel0", "channel3"]
    assert applied.channel0_open
    assert stat.S_IMODE(os.lstat(_node(settings, 0)).st_mode) == 0o666


@needs_root
def test_a_workload_on_channel0_owns_it_even_with_keep_channel0(
    settings: ChannelsSettings,
) -> None:
    """Wanted channel 0 gets the workload's owner and mode: it is no longer open."""
    _mknod(_node(settings, 0), MAJOR, 0, mode=0o666)
    want = _want(channel=0, mode=0o600)
    applied = Devices(replace(settings, keep_channel0=True)).apply({0: want}, major=MAJOR)
    assert not applied.channel0_open
    _assert_device(_node(settings, 0), want)


@needs_root
def test_keep_channel0_does_not_keep_a_finished_workloads_channel0(
    settings: ChannelsSettings,
) -> None:
    """A channel 0 given to a workload keeps the job's owner and mode: once the workload is
    gone it is no longer the driver's and goes, even with keep_channel0."""
    devices = Devices(replace(settings, keep_channel0=True))
    devices.apply({0: _want(channel=0, mode=0o600)}, major=MAJOR)
    assert _names(settings.dev_dir) == ["channel0"]
    applied = devices.apply({}, major=MAJOR)
    assert _names(settings.dev_dir) == []
    assert applied.ops["remove", "ok"] >= 1


@needs_root
def test_without_keep_channel0_it_is_removed(settings: ChannelsSettings) -> None:
    """The default removes the driver's channel0 so that channels isolate."""
    _mknod(_node(settings, 0), MAJOR, 0, mode=0o666)
    applied = Devices(settings).apply({3: _want()}, major=MAJOR)
    assert _names(settings.dev_dir) == ["channel3"]
    assert not applied.channel0_open


@needs_root
def test_a_failure_on_one_channel_does_not_stop_the_others(settings: ChannelsSettings) -> None:
    """A folder at channel5 cannot be replaced: MknodFailed names it; channel3 is made."""
    blocked = _node(settings, 5)
    blocked.mkdir(parents=True)
    (blocked / "inside").write_text("x")
    wants = {3: _want("a", 3), 5: _want("b", 5)}
    applied = Devices(settings).apply(wants, major=MAJOR)
    assert list(applied.made) == ["a"]
    assert applied.held == {3: "a"}
    assert [(f.workload, f.channel, f.reason) for f in applied.failures] == [
        ("b", 5, "MknodFailed")
    ]
    assert f"remove {blocked}" in applied.failures[0].message
    assert "Is a directory" in applied.failures[0].message
    assert applied.ops["remove", "error"] >= 1
    assert not (Path(settings.cdi_dir) / "imexd-b.json").exists()
    _assert_device(_node(settings, 3), wants[3])


@needs_root
def test_an_owner_chown_would_ignore_is_refused(settings: ChannelsSettings) -> None:
    """uid -1 would leave a previous owner on the node: MknodFailed, nothing made."""
    _mknod(_node(settings, 3), MAJOR, 3)
    applied = Devices(settings).apply({3: _want(uid=-1)}, major=MAJOR)
    assert [(f.reason, f.message) for f in applied.failures] == [
        ("MknodFailed", f"owner -1:{GID} is not in 0..4294967294")
    ]
    assert _names(settings.dev_dir) == []


@needs_root
def test_dev_dir_that_is_a_file_fails_every_channel(settings: ChannelsSettings) -> None:
    """dev_dir is a regular file: each want is MknodFailed with the path and errno text."""
    Path(settings.dev_dir).parent.mkdir(parents=True)
    Path(settings.dev_dir).write_text("oops")
    applied = Devices(settings).apply({3: _want("a", 3), 4: _want("b", 4)}, major=MAJOR)
    assert applied.made == {}
    assert applied.held == {}
    assert [(f.workload, f.reason) for f in applied.failures] == [
        ("a", "MknodFailed"),
        ("b", "MknodFailed"),
    ]
    assert str(_node(settings, 3)) in applied.failures[0].message
    assert "Not a directory" in applied.failures[0].message
    assert Path(settings.dev_dir).read_text() == "oops"


@needs_root
def test_a_read_only_dev_dir_fails_mknod(settings: ChannelsSettings) -> None:
    """A read-only file system (a tmpfs mounted ro): MknodFailed, nothing else changes."""
    dev = Path(settings.dev_dir)
    dev.mkdir(parents=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(dev)],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    )
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        applied = Devices(settings).apply({3: _want()}, major=MAJOR)
    finally:
        subprocess.run(["umount", str(dev)], check=True, timeout=10)
    assert [f.reason for f in applied.failures] == ["MknodFailed"]
    assert f"mknod {_node(settings, 3)}: Read-only file system" in applied.failures[0].message
    assert applied.ops == {("mknod", "error"): 1}


@needs_root
@pytest.mark.parametrize(
    ("folder", "reason", "op"),
    [("cdi_dir", "CdiWriteFailed", "cdi"), ("env_dir", "EnvWriteFailed", "env")],
)
def test_a_hand_off_write_failure_keeps_the_device(
    settings: ChannelsSettings, folder: str, reason: str, op: str
) -> None:
    """A CDI or env folder that is a file: the workload is refused, its device is held."""
    path = Path(getattr(settings, folder))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a folder")
    applied = Devices(settings).apply({3: _want()}, major=MAJOR)
    assert applied.made == {}
    assert applied.held == {3: "w1"}
    assert [(f.workload, f.reason) for f in applied.failures] == [("w1", reason)]
    assert str(path) in applied.failures[0].message
    assert applied.ops[op, "error"] == 1
    _assert_device(_node(settings, 3), _want())


@needs_root
def test_stale_hand_off_files_go_and_foreign_ones_stay(settings: ChannelsSettings) -> None:
    """Our imexd-*.json and *.env of gone workloads and killed writes' temps are removed."""
    cdi, env = Path(settings.cdi_dir), Path(settings.env_dir)
    cdi.mkdir(parents=True)
    env.mkdir(parents=True)
    for name in ("imexd-gone.json", "nvidia.yaml", "other.json", "imexd-x.yaml"):
        (cdi / name).write_text(name)
    (cdi / ".imexd-gone.json.ab12cd.imexd-tmp").write_text("half")
    (env / "gone.env").write_text("IMEX_CHANNEL=9\n")
    (env / "notes.txt").write_text("keep")
    applied = Devices(settings).apply({3: _want()}, major=MAJOR)
    assert _names(settings.cdi_dir) == [
        "imexd-w1.json",
        "imexd-x.yaml",
        "nvidia.yaml",
        "other.json",
    ]
    assert _names(settings.env_dir) == ["notes.txt", "w1.env"]
    assert applied.ops["remove", "ok"] == 2


@needs_root
def test_a_symlink_at_a_hand_off_path_is_replaced(
    settings: ChannelsSettings, tmp_path: Path
) -> None:
    """The CDI spec is written to its own path, never through a symlink to elsewhere."""
    target = tmp_path / "victim"
    target.write_text("victim")
    Path(settings.cdi_dir).mkdir(parents=True)
    (Path(settings.cdi_dir) / "imexd-w1.json").symlink_to(target)
    Devices(settings).apply({3: _want()}, major=MAJOR)
    assert target.read_text() == "victim"
    assert not (Path(settings.cdi_dir) / "imexd-w1.json").is_symlink()


@needs_root
def test_without_a_major_nothing_is_made_and_stale_nodes_go(settings: ChannelsSettings) -> None:
    """major None: every want is refused NoChannelDevice; the cleanup still runs."""
    _mknod(_node(settings, 3), MAJOR, 3)
    applied = Devices(settings).apply({3: _want()}, major=None)
    assert [f.reason for f in applied.failures] == ["NoChannelDevice"]
    assert _names(settings.dev_dir) == []


@needs_root
def test_clear_removes_everything_of_ours(settings: ChannelsSettings) -> None:
    """A leave: no channel node, CDI spec or env file of ours is left; others stay."""
    devices = Devices(settings)
    devices.apply({3: _want("a", 3), 4: _want("b", 4)}, major=MAJOR)
    (Path(settings.cdi_dir) / "vendor.json").write_text("{}")
    (Path(settings.dev_dir) / "README").write_text("r")
    applied = devices.clear()
    assert applied == Applied(
        made={}, failures=[], ops=applied.ops, channel0_open=False, held={}, problems=[]
    )
    assert applied.ops == {("remove", "ok"): 6}
    assert _names(settings.dev_dir) == ["README"]
    assert _names(settings.cdi_dir) == ["vendor.json"]
    assert _names(settings.env_dir) == []


@needs_root
def test_held_on_disk_survives_a_restart(settings: ChannelsSettings) -> None:
    """A new Devices reads who holds which channel from our specs and the nodes in place."""
    Devices(settings).apply({3: _want("a", 3), 4: _want("b", 4)}, major=MAJOR)
    os.unlink(_node(settings, 4))
    _mknod(_node(settings, 4), MAJOR, 9)
    (Path(settings.cdi_dir) / "imexd-junk.json").write_text("{not json")
    assert Devices(settings).held_on_disk(MAJOR) == {3: "a"}
    assert Devices(settings).held_on_disk(None) == {}


@needs_root
def test_plan_and_apply_keep_a_conflict_sticky(settings: ChannelsSettings) -> None:
    """a made channel 5; b arrives on 5 too: a keeps its device, b is refused."""
    devices = Devices(settings)
    wants, _ = _plan([_record("a", 5)])
    first = devices.apply(wants, major=MAJOR)
    wants, refusals = _plan([_record("a", 5), _record("b", 5)], held=first.held)
    second = devices.apply(wants, major=MAJOR)
    assert list(second.made) == ["a"]
    assert [(r.workload, r.reason) for r in refusals] == [("b", "ChannelConflict")]
    assert os.lstat(_node(settings, 5)).st_uid == UID


def _podman_image() -> str | None:
    proc = subprocess.run(
        ["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    images = [line for line in proc.stdout.splitlines() if line and "<none>" not in line]
    return images[0] if images else None


@needs_root
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
def test_a_container_sees_only_its_channel(settings: ChannelsSettings) -> None:
    """podman with our CDI spec gives the container its channel node and env, no other."""
    image = _podman_image()
    if image is None:
        pytest.skip("podman has no local image to run")
    Devices(settings).apply({3: _want("a", 3), 4: _want("b", 4)}, major=MAJOR)
    proc = subprocess.run(
        [
            "podman",
            "--cdi-spec-dir",
            settings.cdi_dir,
            "run",
            "--rm",
            "--network=none",
            "--pull=never",
            "--device",
            f"{CDI_KIND}=a",
            image,
            "sh",
            "-c",
            f'ls {CONTAINER_DEV_DIR}; echo "IMEX_CHANNEL=$IMEX_CHANNEL"',
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["channel3", "IMEX_CHANNEL=3"]


# --- a simulated driver ([channels] simulate) -------------------------------------------------

_APPLY_IN_CHILD = """
import json, sys
from dataclasses import asdict
from imexd.channels.devices import Devices, Want
from imexd.settings import ChannelsSettings

job = json.loads(sys.argv[1])
devices = Devices(ChannelsSettings(**job["settings"]))
wants = {w["channel"]: Want(**w) for w in job["wants"]}
applied = devices.apply(wants, major=job["major"])
print(json.dumps({
    "made": sorted(applied.made),
    "standins": sorted(applied.standins),
    "failures": [[f.workload, f.reason, f.message] for f in applied.failures],
    "ops": sorted([op, result, n] for (op, result), n in applied.ops.items()),
    "held": {str(c): w for c, w in devices.held_on_disk(job["major"]).items()},
}))
"""


def _apply_without_mknod(
    settings: ChannelsSettings, wants: list[Want], major: int = MAJOR, *, chown: bool = True
) -> dict[str, Any]:
    """`Devices.apply` in a child process that may not mknod (nor, with `chown` False,
    give a file away): root without CAP_MKNOD (setpriv), or this unprivileged user as it
    is; what it did, as JSON."""
    if IS_ROOT and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_MKNOD")
    job = {
        "settings": {
            name: getattr(settings, name)
            for name in ("dev_dir", "cdi_dir", "env_dir", "simulate", "manage")
        },
        "wants": [_fields(w) for w in wants],
        "major": major,
    }
    dropped = "-mknod" if chown else "-mknod,-chown"
    prefix = ["setpriv", f"--bounding-set={dropped}"] if IS_ROOT else []
    done = subprocess.run(
        [*prefix, sys.executable, "-c", _APPLY_IN_CHILD, json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _fields(want: Want) -> dict[str, Any]:
    return {name: getattr(want, name) for name in Want.__struct_fields__}


def _mine(want: Want) -> Want:
    """`want` owned by a uid and gid this test may give away (its own, without root)."""
    return want if IS_ROOT else msgspec.structs.replace(want, uid=os.getuid(), gid=os.getgid())


@pytest.fixture
def simulated(settings: ChannelsSettings) -> ChannelsSettings:
    return replace(settings, simulate=True)


def test_simulate_makes_a_marked_stand_in_where_mknod_is_not_permitted(
    simulated: ChannelsSettings,
) -> None:
    """An agent that may not mknod, on a simulated driver: channel3 is a regular file
    whose text says it is no device, with the workload's owner and mode; the CDI spec
    and env file are written as for a device, and the stand-in counts as held."""
    want = _mine(_want(channel=3, mode=0o600))
    done = _apply_without_mknod(simulated, [want])
    assert (done["made"], done["standins"], done["failures"]) == (["w1"], ["w1"], [])
    assert done["held"] == {"3": "w1"}
    node = _node(simulated, 3)
    info = os.lstat(node)
    assert stat.S_ISREG(info.st_mode)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (want.uid, want.gid, 0o600)
    assert node.read_text() == standin_text(MAJOR, 3)
    assert node.read_text().startswith("imexd stand-in for an IMEX channel device: NOT a device")
    assert (Path(simulated.env_dir) / "w1.env").read_text() == env_text(want)
    assert (Path(simulated.cdi_dir) / "imexd-w1.json").exists()
    again = _apply_without_mknod(simulated, [msgspec.structs.replace(want, mode=0o640)])
    assert again["ops"] == [["cdi", "ok", 1], ["fix", "ok", 1]]  # the spec has the mode
    assert os.lstat(node).st_ino == info.st_ino, "fixed in place, as a device node is"
    assert stat.S_IMODE(os.lstat(node).st_mode) == 0o640
    gone = _apply_without_mknod(simulated, [])
    assert gone["made"] == []
    assert not node.exists()


def test_a_stand_in_that_cannot_be_given_to_its_owner_is_not_left(
    simulated: ChannelsSettings,
) -> None:
    """An agent that may not give a file away (no CAP_CHOWN: any user but root) and a
    workload of another uid: MknodFailed naming the chown, and no stand-in stays behind
    with the agent's own owner."""
    done = _apply_without_mknod(simulated, [_want(channel=3, uid=4242)], chown=False)
    [(workload, reason, message)] = done["failures"]
    assert (workload, reason) == ("w1", "MknodFailed")
    assert f"chown {_node(simulated, 3)} to 4242:{GID}: Operation not permitted" in message
    assert not _node(simulated, 3).exists()


def test_without_simulate_an_agent_that_may_not_mknod_fails(settings: ChannelsSettings) -> None:
    """The same agent on a real driver: MknodFailed naming EPERM, and no stand-in is
    made (nor is a stand-in left there taken for a channel)."""
    node = _node(settings, 3)
    node.parent.mkdir(parents=True)
    node.write_text(standin_text(MAJOR, 3))
    done = _apply_without_mknod(settings, [_mine(_want(channel=3))])
    assert done["made"] == []
    [(workload, reason, message)] = done["failures"]
    assert (workload, reason) == ("w1", "MknodFailed")
    assert f"mknod {node}: Operation not permitted (EPERM)" in message
    assert done["held"] == {}
    assert not node.exists(), "the stand-in went: without simulate it is no channel"


@needs_root
def test_simulate_with_mknod_permitted_makes_a_real_device(simulated: ChannelsSettings) -> None:
    """Root on a simulated driver: a real character device in the private dev_dir."""
    applied = Devices(simulated).apply({3: _want()}, major=MAJOR)
    assert (set(applied.made), applied.standins) == ({"w1"}, frozenset())
    _assert_device(_node(simulated, 3), _want())


def test_simulate_needs_a_dev_dir_outside_dev(tmp_path: Path) -> None:
    """simulate = true with dev_dir under /dev is one error naming both keys."""
    config = tmp_path / "imexd.toml"
    config.write_text('[node]\nname = "n1"\n[channels]\nsimulate = true\n')
    with pytest.raises(ConfigError, match=r"channels\.simulate = true: expected channels\.dev_dir"):
        load_settings(config, environ={})
    config.write_text(
        f'[node]\nname = "n1"\n[channels]\nsimulate = true\ndev_dir = "{tmp_path}/dev"\n'
    )
    assert load_settings(config, environ={}).channels.simulate


def test_simulated_channels_read_simulated_in_health_and_workload_status() -> None:
    """Ready from a simulated driver: ChannelsReady True Simulated with the keeper's
    message, and `workload status` shows the node ready with the reason Simulated."""
    message = "channel3 is a stand-in file, not a device: [channels] simulate"
    state = ChannelState(
        workload="w1", channel=3, generation=1, ready=True, reason="Simulated", message=message
    )
    facts = Facts(
        node=NODE,
        domain="d1",
        bus=BusFacts(connected=True, synced=True),
        channels=ChannelFacts(synced=True, count=2048, major=MAJOR, workloads=(state,)),
    )
    condition = {c.type: c for c in health.conditions(facts, [], 0.0)}["ChannelsReady"]
    assert (condition.status, condition.reason) == ("True", "Simulated")
    assert condition.message == f"w1 on channel 3: {message}"
    info = health.channels_view(facts.channels).workloads[0]
    rec = _record("w1", 3, nodes=[NODE])
    base = HealthReport(
        node=NODE,
        domain="d1",
        clique="c.1",
        slot=0,
        incarnation=1,
        at=100.0,
        ready=True,
        conditions=[],
        daemon=DaemonInfo(state="RUNNING"),
        channels=ChannelsView(count=2048, major=MAJOR, workloads=[info]),
    )
    status = judge_workload(rec, reports=[base], members=[], now=100.0, report_interval_s=30.0)
    assert (status.state, status.nodes[0].ready, status.nodes[0].reason) == (
        "READY",
        True,
        "Simulated",
    )
    text = render_workload_status(status)
    assert f"{NODE}  yes    Simulated" in text
    assert f"{NODE}: Simulated: {message}" in text
