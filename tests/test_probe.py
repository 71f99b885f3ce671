"""Tests of imexd.daemon.ctl: the ctl output parsers (pure) and the bounded ctl runner.

The fixtures under tests/fixtures/ctl are the IMEX.md samples and documented variants.
The runner is tested against tiny real scripts, not the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imexd.daemon.ctl import (
    NodeStatus,
    Prober,
    parse_domain_json,
    parse_domain_text,
    parse_state,
)
from imexd.errors import ParseError, ProbeError
from imexd.imex import ConnectionState, ImexDomainState, ImexState
from imexd.process import OUTPUT_LIMIT
from imexd.settings import DaemonSettings, ImexSettings, Settings
from tests.support import until

FIXTURES = Path(__file__).parent / "fixtures" / "ctl"
C = ConnectionState.CONNECTED
N = ConnectionState.NEVER_CONNECTED
INV = ConnectionState.INVALID


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# parse_state


def test_parse_state_ready_exact() -> None:
    """`READY\\n` is READY and exact."""
    parsed = parse_state("READY\n")
    assert parsed.state is ImexState.READY
    assert parsed.exact


@pytest.mark.parametrize("word", [s.value for s in ImexState])
def test_parse_state_every_word(word: str) -> None:
    """Every documented state word parses to its enum member, also from bytes."""
    assert parse_state(f"{word}\n").state == ImexState(word)
    assert parse_state(f"{word}\n".encode()).state == ImexState(word)


@pytest.mark.parametrize("text", ["READY", "READY\n\n", " READY\n", "READY\r\n"])
def test_parse_state_loose_ready_is_not_exact(text: str) -> None:
    """Whitespace around the word still names the state but is not the exact contract."""
    parsed = parse_state(text)
    assert parsed.state is ImexState.READY
    assert not parsed.exact


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "ready\n",
        "Ready",
        "READY READY\n",
        "READY\nINIT_GPU\n",
        "OK\n",
        "<html>503</html>",
    ],
)
def test_parse_state_rejects_anything_else(text: str) -> None:
    """Anything but one known word is a ParseError."""
    with pytest.raises(ParseError):
        parse_state(text)


def test_parse_state_rejects_wrong_types_and_bad_utf8() -> None:
    """Non-text input and invalid UTF-8 are ParseErrors, not TypeErrors."""
    with pytest.raises(ParseError, match="expected text"):
        parse_state(42)  # type: ignore[arg-type]
    with pytest.raises(ParseError, match="UTF-8"):
        parse_state(b"\xffREADY\n")


# parse_domain_text


def test_text_570172_two_nodes() -> None:
    """The 570.172 sample: hosts, states, versions, an all-C matrix, UP."""
    status = parse_domain_text(fixture("n_570172.txt"))
    assert status.state is ImexDomainState.UP
    assert status.timestamp == "5/4/2026 06:08:10.580"
    assert list(status.nodes) == [0, 1]
    assert status.nodes[0] == NodeStatus(
        index=0,
        host="172.31.48.81",
        host_name=None,
        state=ImexState.READY,
        version="570.172",
        local=False,
        connections={0: C, 1: C},
    )
    assert status.nodes[1].host == "172.31.48.82"
    assert status.nodes[1].connections == {0: C, 1: C}
    assert status.local is None


def test_text_570172_eighteen_nodes() -> None:
    """A full NVL72 domain: two-digit indices and a blank line before the verdict."""
    status = parse_domain_text(fixture("n_570172_18.txt"))
    assert status.state is ImexDomainState.UP
    assert sorted(status.nodes) == list(range(18))
    assert status.nodes[10].host == "172.31.54.95"
    assert status.nodes[17].host == "172.31.56.47"
    assert all(n.version == "570.172" and n.ready for n in status.nodes.values())
    assert all(n.connections == dict.fromkeys(range(18), C) for n in status.nodes.values())


def test_text_older_layout_without_version_column() -> None:
    """The ~570.124 layout (no !V!/!M! legend, no Version column) parses with version None."""
    status = parse_domain_text(fixture("n_570124.txt"))
    assert status.state is ImexDomainState.UP
    assert status.timestamp == "3/25/2025 10:39:43.659"
    node = status.nodes[0]
    assert (node.host, node.state, node.version, node.local) == (
        "10.136.206.48",
        ImexState.READY,
        None,
        False,
    )
    assert node.connections == {0: C}


def test_text_local_node_marked_with_asterisks() -> None:
    """`* name *` marks the local node; host names are kept as the host."""
    status = parse_domain_text(fixture("n_local.txt"))
    assert [n.host for n in status.nodes.values()] == [
        "compute-domain-daemon-0000",
        "compute-domain-daemon-0001",
        "compute-domain-daemon-0002",
    ]
    assert [n.local for n in status.nodes.values()] == [False, True, False]
    assert status.local is not None
    assert status.local.index == 1
    assert status.local.version == "580.159.04"


def test_text_down_peer() -> None:
    """A down peer: UNAVAILABLE, its row all I, the others N towards it, DEGRADED."""
    status = parse_domain_text(fixture("n_down.txt"))
    assert status.state is ImexDomainState.DEGRADED
    down = status.nodes[2]
    assert down.state is ImexState.UNAVAILABLE
    assert down.version is None
    assert not down.ready
    assert down.connections == {0: INV, 1: INV, 2: INV}
    assert status.nodes[0].connections == {0: C, 1: C, 2: N}
    assert status.nodes[1].connections == {0: C, 1: C, 2: N}


def _two_node_text(row0: str, row1: str, *, state0: str = "READY", verdict: str = "UP") -> str:
    return (
        "1/2/2026 03:04:05.678\nNodes:\n"
        f"Node #0   - 10.0.0.1   - {state0}   - Version: 570.172\n"
        "Node #1   - 10.0.0.2   - READY   - Version: 570.172\n\n"
        " Nodes From\\To  0   1\n"
        f"       0        {row0}\n"
        f"       1        {row1}\n"
        f"Domain State: {verdict}\n"
    )


def test_text_every_legend_cell() -> None:
    """Each legend cell maps to its state; an unknown letter reads UNKNOWN."""
    status = parse_domain_text(_two_node_text("R   D", "A   !V!"))
    assert status.nodes[0].connections == {
        0: ConnectionState.RECOVERING,
        1: ConnectionState.DISCONNECTED,
    }
    assert status.nodes[1].connections == {
        0: ConnectionState.AUTHENTICATING,
        1: ConnectionState.VERSION_MISMATCH,
    }
    status = parse_domain_text(_two_node_text("!M!   X", "C   C"))
    assert status.nodes[0].connections == {
        0: ConnectionState.MAP_MISMATCH,
        1: ConnectionState.UNKNOWN,
    }


def test_text_unknown_words_are_kept_raw() -> None:
    """A node state or domain verdict this version does not know is kept as a string."""
    status = parse_domain_text(_two_node_text("C   C", "C   C", state0="BRAND_NEW", verdict="ODD"))
    assert status.nodes[0].state == "BRAND_NEW"
    assert not status.nodes[0].ready
    assert status.state == "ODD"


def test_text_empty_version_is_none() -> None:
    """`- Version:` with no value reads as no version."""
    text = _two_node_text("C   C", "C   C").replace(
        "Version: 570.172\nNode #1", "Version:\nNode #1"
    )
    assert parse_domain_text(text).nodes[0].version is None


@pytest.mark.parametrize(
    "text",
    [
        _two_node_text("C   C", "C   C").replace("Domain State: UP\n", ""),
        _two_node_text("C   C", "C"),
        _two_node_text("C   C", "C   C   C"),
        _two_node_text("C   C", "C   C").replace("       1        C   C\n", ""),
        _two_node_text("C   C", "C   C").replace("Node #1", "Node #0"),
        _two_node_text("C   C", "C   C").replace("0   1\n", "0   2\n"),
        _two_node_text("C   C", "C   C").replace(" Nodes From\\To  0   1\n", ""),
        _two_node_text("C   C", "C   C").replace("Nodes:\n", ""),
        _two_node_text("C   C", "C   C").replace("- READY   - Version", "READY - Version"),
        _two_node_text("C   C", "Cx  C"),
        _two_node_text("C   C", "C   C").replace("       1  ", "       7  "),
        "Nodes:\n\n Nodes From\\To  0\n 0 C\nDomain State: UP\n",
        "<html><body>502 Bad Gateway</body></html>",
    ],
    ids=[
        "no-verdict",
        "short-row",
        "long-row",
        "missing-row",
        "duplicate-node",
        "column-mismatch",
        "no-header",
        "no-nodes-line",
        "bad-node-line",
        "bad-cell",
        "unknown-row",
        "no-node-lines",
        "html",
    ],
)
def test_text_garbage_is_parse_error(text: str) -> None:
    """Truncated, inconsistent or foreign text is a ParseError."""
    with pytest.raises(ParseError):
        parse_domain_text(text)


@pytest.mark.parametrize("name", ["n_570172.txt", "n_local.txt", "n_down.txt"])
def test_text_every_truncation_before_the_verdict_fails(name: str) -> None:
    """Cutting a sample anywhere before its verdict line gives a ParseError."""
    text = fixture(name)
    end = text.index("Domain State:")
    for cut in range(0, end, 7):
        with pytest.raises(ParseError):
            parse_domain_text(text[:cut])


# parse_domain_json


def test_json_sample() -> None:
    """The IMEX.md `-N -j` sample: verdict, timestamp, node fields and connections."""
    status = parse_domain_json(fixture("nj_sample.json"))
    assert status.state is ImexDomainState.DEGRADED
    assert status.timestamp == "9/23/2026 16:54:29.117"
    assert status.nodes == {
        0: NodeStatus(
            index=0,
            host="10.0.0.1",
            host_name="gpu-node-a",
            state=ImexState.READY,
            version="NO_GPU",
            local=False,
            connections={0: C, 3: N},
        )
    }


def _doc(**node: object) -> str:
    base: dict[str, object] = {
        "status": "READY",
        "host": "10.0.0.1",
        "hostName": "N/A",
        "connections": {"0": {"status": "CONNECTED"}},
    }
    base.update(node)
    return json.dumps({"timestamp": "t", "status": "UP", "nodes": {"0": base}})


def test_json_tolerates_new_fields_and_words() -> None:
    """Unknown fields are ignored, unknown words degrade to UNKNOWN or stay raw."""
    doc = json.loads(_doc(connections={"0": {"status": "TELEPORTING", "rtt": 1}}, extra=[1]))
    doc["new_top_field"] = {"x": 1}
    doc["status"] = "PARTIAL"
    doc["nodes"]["0"]["status"] = "WARMING_UP"
    status = parse_domain_json(json.dumps(doc))
    assert status.state == "PARTIAL"
    node = status.nodes[0]
    assert node.state == "WARMING_UP"
    assert node.connections == {0: ConnectionState.UNKNOWN}
    assert node.host_name is None
    assert node.version is None


def test_json_every_connection_word() -> None:
    """Each ConnectionState name in JSON maps to itself."""
    conns = {str(i): {"status": s.value} for i, s in enumerate(ConnectionState)}
    status = parse_domain_json(_doc(connections=conns))
    assert list(status.nodes[0].connections.values()) == list(ConnectionState)


def test_json_simulator_spelling_of_map_mismatch() -> None:
    """The simulator's NODE_MAP_MISMATCH reads as MAP_MISMATCH, not UNKNOWN."""
    status = parse_domain_json(_doc(connections={"1": {"status": "NODE_MAP_MISMATCH"}}))
    assert status.nodes[0].connections == {1: ConnectionState.MAP_MISMATCH}


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"UP"',
        "{}",
        '{"status": "UP"}',
        '{"status": "UP", "nodes": []}',
        '{"status": "UP", "nodes": {}}',
        '{"status": 1, "nodes": {"0": {"status": "READY", "host": "a"}}}',
        '{"status": "", "nodes": {"0": {"status": "READY", "host": "a"}}}',
        '{"status": "UP", "timestamp": 5, "nodes": {"0": {"status": "READY", "host": "a"}}}',
        '{"status": "UP", "nodes": {"x": {"status": "READY", "host": "a"}}}',
        '{"status": "UP", "nodes": {"-1": {"status": "READY", "host": "a"}}}',
        '{"status": "UP", "nodes": {"0": "READY"}}',
        '{"status": "UP", "nodes": {"0": {"host": "a"}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY"}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY", "host": "a", "hostName": 3}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY", "host": "a", "connections": []}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY", "host": "a", '
        '"connections": {"0": "CONNECTED"}}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY", "host": "a", '
        '"connections": {"0": {"status": null}}}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY", "host": "a", '
        '"connections": {"zero": {"status": "CONNECTED"}}}}}',
        '{"status": "UP", "nodes": {"0": {"status": "READY", "host": "a"}}',
        "[" * 100_000,
        "NaN-ish garbage",
    ],
)
def test_json_wrong_shapes_are_parse_errors(text: str) -> None:
    """Wrong types, missing fields, bad keys, truncation and deep nesting are ParseErrors."""
    with pytest.raises(ParseError):
        parse_domain_json(text)


def test_huge_input_is_refused() -> None:
    """Input over OUTPUT_LIMIT is refused before any parsing."""
    big = " " * (OUTPUT_LIMIT + 1)
    for parse in (parse_state, parse_domain_text, parse_domain_json):
        with pytest.raises(ParseError, match="more than"):
            parse(big)
        with pytest.raises(ParseError, match="more than"):
            parse(big.encode())


# Property tests: nothing but ParseError ever escapes.

PARSERS = (parse_state, parse_domain_text, parse_domain_json)


def _only_parse_errors(data: str | bytes) -> None:
    for parse in PARSERS:
        with contextlib.suppress(ParseError):
            parse(data)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_random_text_only_parse_errors(text: str) -> None:
    """Random text never raises anything but ParseError."""
    _only_parse_errors(text)


@settings(max_examples=300, deadline=None)
@given(st.binary())
def test_random_bytes_only_parse_errors(data: bytes) -> None:
    """Random bytes never raise anything but ParseError."""
    _only_parse_errors(data)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_random_json_only_parse_errors(value: object) -> None:
    """Random JSON documents never raise anything but ParseError."""
    _only_parse_errors(json.dumps(value))


@settings(max_examples=300, deadline=None)
@given(
    path=st.sampled_from(
        [
            ("status",),
            ("timestamp",),
            ("nodes",),
            ("nodes", "0"),
            ("nodes", "0", "status"),
            ("nodes", "0", "host"),
            ("nodes", "0", "hostName"),
            ("nodes", "0", "version"),
            ("nodes", "0", "connections"),
            ("nodes", "0", "connections", "3"),
            ("nodes", "0", "connections", "3", "status"),
        ]
    ),
    value=JSON_VALUES,
)
def test_json_sample_with_any_field_replaced(path: tuple[str, ...], value: object) -> None:
    """The sample with any one field set to any JSON value parses or is a ParseError."""
    doc = json.loads(fixture("nj_sample.json"))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with contextlib.suppress(ParseError):
        parse_domain_json(json.dumps(doc))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["n_570172.txt", "n_local.txt", "n_down.txt", "n_570124.txt"]),
    data=st.data(),
)
def test_text_samples_mutated_only_parse_errors(name: str, data: st.DataObject) -> None:
    """A sample with a random slice replaced by random text parses or is a ParseError."""
    text = fixture(name)
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 40)))
    insert = data.draw(st.text(alphabet="CNIRDA!VM#*-: 0123456789\n\\", max_size=20))
    with contextlib.suppress(ParseError):
        parse_domain_text(text[:start] + insert + text[end:])


# The runner, against real scripts.


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _prober(ctl: Path | str, tmp_path: Path, **kw: object) -> Prober:
    return Prober(ctl=str(ctl), config_path=str(tmp_path / "config.cfg"), **kw)  # type: ignore[arg-type]


def _gone(pid: int) -> bool:
    """No such process, or a zombie that is not ours to reap (a reparented grandchild)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() != os.getpid()
    except psutil.NoSuchProcess:
        return True


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


async def test_ready_script_passes_config_and_args(tmp_path: Path) -> None:
    """The ctl is run as `<ctl> -c <config.cfg> -q` and `READY\\n` with exit 0 is ready."""
    args_file = tmp_path / "args"
    ctl = _script(tmp_path, "ctl", f'printf "%s\\n" "$@" > {args_file}\nprintf "READY\\n"\n')
    prober = _prober(ctl, tmp_path)
    result = await prober.run(["-q"], timeout=5)
    assert (result.rc, result.stdout, result.stderr) == (0, "READY\n", "")
    assert args_file.read_text().split("\n")[:3] == ["-c", str(tmp_path / "config.cfg"), "-q"]
    probe = await prober.local()
    assert (probe.state, probe.ready, probe.reason, probe.error) == (
        ImexState.READY,
        True,
        "",
        None,
    )


async def test_env_is_merged_over_the_agent_environment(tmp_path: Path) -> None:
    """`[imex] env` reaches the ctl, and the agent's own environment (PATH) is kept."""
    ctl = _script(tmp_path, "ctl", 'printf "%s|%s\\n" "$IMEXD_TEST_VAR" "${PATH:+has-path}"\n')
    result = await _prober(ctl, tmp_path, env={"IMEXD_TEST_VAR": "v a l"}).run([], timeout=5)
    assert result.stdout == "v a l|has-path\n"


async def test_not_ready_word_and_loose_ready(tmp_path: Path) -> None:
    """Another state word or a READY without its newline is not ready, with a reason."""
    waiting = _script(tmp_path, "waiting", "echo WAITING_FOR_PEERS\n")
    probe = await _prober(waiting, tmp_path).local()
    assert (probe.state, probe.ready) == (ImexState.WAITING_FOR_PEERS, False)
    assert "WAITING_FOR_PEERS" in probe.reason
    loose = _script(tmp_path, "loose", "printf READY\n")
    probe = await _prober(loose, tmp_path).local()
    assert (probe.state, probe.ready) == (ImexState.READY, False)
    assert "exactly" in probe.reason
    assert isinstance(probe.error, ParseError)


async def test_exit_1_reports_stderr(tmp_path: Path) -> None:
    """A ctl exiting 1 gives rc and stderr back, and the probe's reason quotes stderr."""
    ctl = _script(tmp_path, "ctl", "echo 'Unable to connect to IMEX daemon' >&2\nexit 1\n")
    result = await _prober(ctl, tmp_path).run(["-q"], timeout=5)
    assert result.rc == 1
    assert result.stderr == "Unable to connect to IMEX daemon\n"
    probe = await _prober(ctl, tmp_path).local()
    assert (probe.state, probe.ready) == (None, False)
    assert "exited with 1" in probe.reason
    assert "Unable to connect to IMEX daemon" in probe.reason
    assert isinstance(probe.error, ProbeError)


async def test_ready_with_nonzero_exit_is_not_ready(tmp_path: Path) -> None:
    """READY printed by a ctl that exits 1 does not count."""
    ctl = _script(tmp_path, "ctl", "echo READY\nexit 1\n")
    probe = await _prober(ctl, tmp_path).local()
    assert (probe.state, probe.ready) == (ImexState.READY, False)
    assert "exited with 1" in probe.reason


async def test_hung_ctl_is_killed_with_its_group(tmp_path: Path) -> None:
    """A hung ctl and its children are killed at the timeout and reaped; ProbeError says so."""
    pid_file, child_file = tmp_path / "pid", tmp_path / "child"
    ctl = _script(
        tmp_path, "ctl", f"echo $$ > {pid_file}\nsleep 1000 &\necho $! > {child_file}\nwait\n"
    )
    started = time.monotonic()
    with pytest.raises(ProbeError, match=r"ctl timed out after 0\.5 s"):
        await _prober(ctl, tmp_path).run(["-q"], timeout=0.5)
    assert time.monotonic() - started < 1.5
    leader, child = int(pid_file.read_text()), int(child_file.read_text())
    assert not psutil.pid_exists(leader), "the ctl itself must be reaped, not a zombie"
    await until(lambda: _gone(child), within=3, interval=0.02, what="the ctl's child gone")


async def test_hung_ctl_probe_reports_instead_of_raising(tmp_path: Path) -> None:
    """Prober.local and Prober.domain turn a timeout into a reason."""
    ctl = _script(tmp_path, "ctl", "exec sleep 1000\n")
    prober = _prober(ctl, tmp_path, timeout=0.3)
    local = await prober.local()
    assert (local.state, local.ready) == (None, False)
    assert "timed out" in local.reason
    domain = await prober.domain()
    assert domain.status is None
    assert not domain.ok
    assert isinstance(domain.error, ProbeError)


async def test_cancelled_probe_kills_and_reaps_the_ctl_before_it_returns(tmp_path: Path) -> None:
    """Cancelling a probe task mid-run kills the ctl and reaps it before the cancellation
    completes: an agent that shuts down during a probe leaves no child behind its event
    loop (one reaped later finds its loop closed: 'subprocess ... is still running')."""
    pid_file = tmp_path / "pid"
    ctl = _script(tmp_path, "ctl", f"echo $$ > {pid_file}\nexec sleep 1000\n")
    task = asyncio.create_task(_prober(ctl, tmp_path).run(["-q"], timeout=30))
    await until(lambda: _read(pid_file), within=5.0, interval=0.02, what=f"{pid_file} written")
    pid = int(_read(pid_file))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not psutil.pid_exists(pid), "the cancelled ctl was not reaped when the task ended"


async def test_missing_binary_names_the_setting(tmp_path: Path) -> None:
    """A missing ctl is a ProbeError naming imex.ctl; the probes report it as a reason."""
    prober = _prober(tmp_path / "no-such-ctl", tmp_path)
    with pytest.raises(ProbeError, match=r"imex\.ctl"):
        await prober.run(["-q"], timeout=5)
    probe = await prober.local()
    assert not probe.ready
    assert "IMEXD_IMEX_CTL" in probe.reason


async def test_not_executable_binary(tmp_path: Path) -> None:
    """A ctl without the execute bit is a ProbeError, not an OSError."""
    ctl = tmp_path / "ctl"
    ctl.write_text("#!/bin/sh\necho READY\n")
    ctl.chmod(stat.S_IRUSR | stat.S_IWUSR)
    if os.access(ctl, os.X_OK):  # root may execute anything with some x bit; none here
        pytest.skip("this user can execute a file without x bits")
    with pytest.raises(ProbeError, match="not executable"):
        await _prober(ctl, tmp_path).run(["-q"], timeout=5)


async def test_domain_probe_json_and_text(tmp_path: Path) -> None:
    """`-N -j` and `-N` outputs come back parsed; the args say which was asked."""
    ctl = _script(
        tmp_path,
        "ctl",
        f'if [ "$4" = "-j" ]; then cat {FIXTURES / "nj_sample.json"}; '
        f"else cat {FIXTURES / 'n_down.txt'}; fi\n",
    )
    prober = _prober(ctl, tmp_path)
    probe = await prober.domain()
    assert probe.ok
    assert probe.status is not None
    assert probe.status.nodes[0].host_name == "gpu-node-a"
    probe = await prober.domain(json_format=False)
    assert probe.status is not None
    assert probe.status.nodes[2].state is ImexState.UNAVAILABLE


async def test_domain_probe_parses_output_whatever_the_exit_code(tmp_path: Path) -> None:
    """A report that parses is used even when the ctl exits non-zero."""
    ctl = _script(tmp_path, "ctl", f"cat {FIXTURES / 'nj_sample.json'}\nexit 1\n")
    probe = await _prober(ctl, tmp_path).domain()
    assert probe.status is not None
    assert probe.status.state is ImexDomainState.DEGRADED


async def test_domain_probe_garbage(tmp_path: Path) -> None:
    """Garbage output is a ParseError reason; garbage with exit 1 quotes stderr instead."""
    ctl = _script(tmp_path, "ctl", "echo '<html>oops</html>'\n")
    probe = await _prober(ctl, tmp_path).domain()
    assert probe.status is None
    assert isinstance(probe.error, ParseError)
    ctl = _script(tmp_path, "ctl2", "echo 'connection refused' >&2\nexit 1\n")
    probe = await _prober(ctl, tmp_path).domain()
    assert isinstance(probe.error, ProbeError)
    assert "connection refused" in probe.reason


async def test_runaway_output_is_capped(tmp_path: Path) -> None:
    """Output beyond OUTPUT_LIMIT is dropped, flagged, and refused by the domain probe."""
    ctl = _script(tmp_path, "ctl", "head -c 3000000 /dev/zero | tr '\\0' x\n")
    result = await _prober(ctl, tmp_path).run(["-N", "-j"], timeout=10)
    assert result.truncated
    assert len(result.stdout) == OUTPUT_LIMIT
    probe = await _prober(ctl, tmp_path).domain()
    assert probe.status is None
    assert "more than" in probe.reason


async def test_settings_are_a_valid_target(tmp_path: Path) -> None:
    """Prober.from_settings takes imex.ctl, <run_dir>/config.cfg, imex.env, probe_timeout_s."""
    args_file = tmp_path / "args"
    ctl = _script(tmp_path, "ctl", f'printf "%s\\n" "$@" "$X" > {args_file}\necho READY\n')
    config = Settings(
        imex=ImexSettings(ctl=str(ctl), run_dir=str(tmp_path / "run"), env={"X": "from-env"}),
        daemon=DaemonSettings(probe_timeout_s=2.5),
    )
    prober = Prober.from_settings(config)
    assert (prober.ctl, prober.config_path, dict(prober.env), prober.timeout) == (
        str(ctl),
        str(tmp_path / "run" / "config.cfg"),
        {"X": "from-env"},
        2.5,
    )
    result = await Prober.from_settings(config).run(["-q"])
    assert result.stdout == "READY\n"
    assert args_file.read_text().split("\n")[:4] == [
        "-c",
        str(tmp_path / "run" / "config.cfg"),
        "-q",
        "from-env",
    ]


def test_prober_validates_up_front() -> None:
    """A Prober with no ctl or a non-positive timeout is refused at construction."""
    with pytest.raises(ValueError, match="ctl"):
        Prober(ctl="", config_path="/run/imexd/config.cfg")
    with pytest.raises(ValueError, match="timeout"):
        Prober(ctl="nvidia-imex-ctl", config_path="/run/imexd/config.cfg", timeout=0)
