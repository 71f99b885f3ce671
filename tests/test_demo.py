"""`imexd demo`: the pure pieces it shows, and whole runs as a newcomer starts them.

Whole runs start `python -m imexd demo` as a subprocess (no terminal, so the table is
appended as snapshots) with TMPDIR inside the test's folder: every process the demo
starts names that folder on its command line, so the test can prove none is left, and
kill any that is (after a failed run) so that nothing leaks into other tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import pytest

from imexd.cli.main import main
from imexd.demo import DemoError, brokers, scenario, screen
from imexd.health.fleet import judge
from imexd.messages import Condition, DaemonInfo, DomainView, HealthReport, SlotView
from tests.support import until

IS_ROOT = os.geteuid() == 0
RUN_TIMEOUT_S = 90.0
"""A 3-node run takes 15-50 s on a busy 2-core machine; a hung one is stopped here."""
STOP_TIMEOUT_S = 40.0
"""Ctrl-C to exit: the demo's cleanup is bounded well below this."""
SLOW_TEST_TIMEOUT_S = RUN_TIMEOUT_S + STOP_TIMEOUT_S + 20
"""pytest-timeout for whole runs: above our own bounded waits, so those report first."""

has_broker = pytest.mark.skipif(
    brokers.find_mosquitto() is None and importlib.util.find_spec("amqtt") is None,
    reason="neither Mosquitto nor the demo extra (amqtt) is installed",
)


# Pure pieces.


def _report(
    node: str,
    *,
    ready: bool = True,
    sees: str | None = "UP",
    members: tuple[str, ...] = ("n1", "n2"),
    not_ready: tuple[str, ...] = (),
) -> HealthReport:
    conds = [
        Condition(type="BusConnected", status="True", reason="Connected", message="", since=0),
        Condition(type="SlotSettled", status="True", reason="Settled", message="", since=0),
        Condition(
            type="DaemonReady",
            status="True" if ready else "False",
            reason="Ready" if ready else "DaemonCrashed",
            message="" if ready else "SIGKILL",
            since=0,
        ),
    ]
    view = None
    if sees is not None:
        nodes = {
            str(i): SlotView(
                node=m, status="UNAVAILABLE" if m in not_ready else "READY", connected=True
            )
            for i, m in enumerate(members)
        }
        view = DomainView(status=sees, nodes=nodes)
    return HealthReport(
        node=node,
        domain="demo",
        clique="sim.0",
        slot=members.index(node) if node in members else None,
        incarnation=1,
        at=0.0,
        ready=ready,
        conditions=conds,
        daemon=DaemonInfo(state="RUNNING", pid=4242, restarts=1, imex_status="READY"),
        domain_view=view,
    )


def test_table_lines_align_and_fit_the_terminal() -> None:
    """Columns line up under the header, and a width cuts lines instead of wrapping them."""
    rows = [
        screen.Row("n1", "127.1.1.10", "up", _report("n1")),
        screen.Row("n2", "127.1.1.11", "down", None, orphan_pid=77),
    ]
    lines = screen.table_lines(rows)
    assert lines[0].split()[:9] == list(screen.HEADER)
    assert lines[1].index("127.1.1.10") == lines[0].index("ADDRESS")
    assert "1 restart" in lines[1]
    assert lines[2].split()[3:6] == ["down", "RUNNING", "77"]
    assert "IMEX keeps running without its agent" in lines[2]
    assert all(len(line) <= 40 for line in screen.table_lines(rows, width=40))


def test_at_80_columns_notes_go_below_their_row_whole_words() -> None:
    """On an 80-column terminal the note is not cut to a letter: it goes on lines of its
    own below the row, wrapped between words; colours move nothing."""
    why = "NotReady: IMEX state UNAVAILABLE, waiting for the command service of the daemon"
    report = _report("n2", ready=False, not_ready=("n2",))
    cond = msgspec.structs.replace(report.conditions[-1], reason="NotReady", message=why[10:])
    report = msgspec.structs.replace(report, conditions=[*report.conditions[:-1], cond])
    rows = [
        screen.Row("node-1", "127.83.227.10", "up", _report("n1")),
        screen.Row("node-2", "127.83.227.11", "up", report),
    ]
    lines = screen.table_lines(rows, width=80)
    assert all(len(line) <= 80 for line in lines), lines
    assert not any(line.endswith("…") for line in lines), lines
    below = " ".join(line.strip() for line in lines[4:])
    assert lines[3].startswith("1     node-2"), lines
    assert lines[3].endswith("UP"), lines
    assert below.startswith("1 restart; NotReady: IMEX state UNAVAILABLE"), lines
    coloured = screen.table_lines(rows, width=80, color=True)
    assert [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in coloured] == lines


def _frames() -> list[list[screen.Row]]:
    """The tables of one demo run, from start to end: the cells change, the nodes do not."""
    names = [(f"node-{i}", f"127.83.227.{10 + i}") for i in range(1, 5)]
    members = tuple(name for name, _ in names)
    ready = {n: _report(n, members=members) for n in members}
    recovering = msgspec.structs.replace(
        _report("node-2", ready=False, members=members, not_ready=("node-2",), sees="DEGRADED"),
        daemon=DaemonInfo(
            state="BACKOFF", pid=4194303, restarts=2, imex_status="WAITING_FOR_RECOVERY"
        ),
    )
    return [
        [screen.Row(n, a, "starting", None) for n, a in names],
        [screen.Row(n, a, "up", ready[n]) for n, a in names],
        [screen.Row(n, a, "up", recovering if n == "node-2" else ready[n]) for n, a in names[:3]]
        + [screen.Row(*names[3], "down", None, orphan_pid=4194302)],
        [screen.Row(n, a, "left", ready[n], stopped=True) for n, a in names],
    ]


def _column_starts(header: str) -> list[int]:
    return [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]


@pytest.mark.parametrize("width", [80, 100, 200, 0])
def test_the_tables_columns_stay_in_place_from_frame_to_frame(width: int) -> None:
    """Seen at 80 columns: the table changed its layout between frames as cells grew and
    shrank (PIDs, IMEX states, notes). Each column keeps its place and width for the whole
    run, whatever the cells say; only the terminal's width picks the layout."""
    tables = [screen.table_lines(rows, width=width) for rows in _frames()]
    headers = {lines[0] for lines in tables}
    assert len(headers) == 1, headers
    header = headers.pop()
    starts = [at for at in _column_starts(header) if not header.startswith("NOTE", at)]
    for lines in tables:
        assert all(len(line) <= (width or 1000) for line in lines), lines
        rows = [line for line in lines[1:] if not line.startswith(screen.NOTE_INDENT)]
        assert len(rows) == 4, lines
        for row in rows:
            for column in starts[1:]:
                assert row[column - 1] == " ", (column, row, header)
                assert row[column] != " ", (column, row, header)
    if width == 80:
        assert header.split() == ["SLOT", "NODE", "AGENT", "DAEMON", "PID", "IMEX", "READY", "SEES"]
    if width in (200, 0):
        assert header.split() == [*screen.HEADER, "NOTE"]


def test_rows_of_agents_that_left_claim_nothing_from_their_last_report() -> None:
    """Seen at the end of a run: `LEAVING - 4 of 4 agents left` above rows that still
    said RUNNING and READY from each agent's last /status. A row whose agent is not up
    shows what the demo knows: the daemon stopped (the agent left and nothing of the node
    runs), running alone (its pid checked), or nothing."""
    left, down, stopping = _frames()[3][0], _frames()[2][3], _frames()[1][1]
    stopping = dataclasses.replace(stopping, agent="leaving")
    cells = {row.agent: screen.table_lines([row])[1].split() for row in (left, down, stopping)}
    assert cells["left"][:9] == ["-", "node-1", left.address, "left", "STOPPED", "-", "-", "-", "-"]
    assert cells["down"][3:9] == ["down", "RUNNING", "4194302", "-", "-", "-"]
    assert cells["leaving"][3:9] == ["leaving", "-", "-", "-", "-", "-"]
    assert "left the domain; its daemon stopped" in screen.table_lines([left])[1]


def test_without_a_terminal_only_changes_are_printed() -> None:
    """Seen in a CI log: a full table every second while anything changed. Without a
    terminal the headline is printed when the domain's state or reason changes, and the
    table only at the story's milestones (forced), and then only when it changed."""
    out, now = io.StringIO(), [0.0]
    shown = screen.Screen(out, tty=False, color=False, clock=lambda: now[0])
    tables = [screen.table_lines(rows) for rows in _frames()]
    for index, lines in enumerate([*tables, *tables]):
        now[0] = float(index)
        shown.frame(f"[ {index} s] FORMING - starting", lines, verdict=("FORMING", "starting"))
    assert out.getvalue() == "[ 0 s] FORMING - starting\n"
    now[0] = 9.0
    shown.frame("[ 9 s] UP - all", tables[1], verdict=("UP", "all"), force=True)
    shown.frame("[ 9 s] UP - all", tables[1], verdict=("UP", "all"), force=True)
    text = out.getvalue()
    assert text.count("SLOT  NODE") == 1
    assert text.endswith("[ 9 s] UP - all\n" + "\n".join(tables[1]) + "\n\n")
    now[0] = 9.5  # a headline within a second of the last one waits
    shown.frame("[ 9.5 s] DOWN", tables[1], verdict=("DOWN", "x"))
    assert out.getvalue() == text
    now[0] = 11.0
    shown.frame("[11 s] LEAVING", tables[3], verdict=("LEAVING", "all"))
    shown.frame("[11 s] LEAVING", tables[3], verdict=("LEAVING", "all"), force=True)
    assert out.getvalue() == text + "[11 s] LEAVING\n" + "\n".join(tables[3]) + "\n\n"


def test_events_wrap_between_words_on_a_terminal() -> None:
    """An event longer than the terminal is wrapped at a space, its lines indented."""
    text = "[   2.9 s] noticed after 0.3 s: domain DEGRADED " + "word " * 20
    lines = screen.wrap_event(text.strip(), 40)
    assert all(len(line) <= 40 for line in lines)
    assert " ".join(" ".join(lines).split()) == " ".join(text.split())
    assert lines[1].startswith("          ")


def test_table_lines_say_why_a_node_is_not_ready_and_colour_only_words() -> None:
    """A node that is not ready shows its first failing condition; colours move no column."""
    rows = [
        screen.Row("n1", "127.1.1.10", "up", _report("n1")),
        screen.Row("n2", "127.1.1.11", "up", _report("n2", ready=False, not_ready=("n2",))),
    ]
    plain = screen.table_lines(rows)
    assert "DaemonCrashed: SIGKILL" in plain[2]
    coloured = screen.table_lines(rows, color=True)
    assert [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in coloured] == plain
    assert "\x1b[32mRUNNING\x1b[0m" in coloured[1]
    assert "\x1b[" not in coloured[0]


def test_the_headline_is_fleets_judgement(tmp_path: Path) -> None:
    """The demo's headline is `fleet.judge`'s state and reasons; LEAVING once agents leave."""
    out = screen.Screen(io.StringIO(), tty=False, color=False)
    run = scenario.Demo(scenario.Options(nodes=2, broker=None), out, parent=tmp_path)
    assert run.verdict() == ("FORMING", "starting")
    run.status = judge(
        "demo",
        spec=None,
        records=[],
        reports=[_report("n1")],
        now=0.0,
        report_interval_s=2.0,
        expect=["n1", "n2"],
    )
    assert run.verdict() == (
        run.status.state,
        "0 of 2 members ready: " + "; ".join(run.status.reasons[:2]),
    )
    run.leaving = True
    assert run.verdict()[0] == "LEAVING"


def test_choose_broker_prefers_mosquitto_and_falls_back_to_amqtt(tmp_path: Path) -> None:
    """Mosquitto when installed, amqtt without it or when forced; a bad choice names itself."""
    mosquitto = "/usr/sbin/mosquitto"
    choose = brokers.choose_broker
    assert isinstance(choose({}, tmp_path, mosquitto), brokers.MosquittoBroker)
    assert isinstance(choose({}, tmp_path, None), brokers.AmqttBroker)
    forced = {brokers.BROKER_ENV: "amqtt"}
    assert isinstance(choose(forced, tmp_path, mosquitto), brokers.AmqttBroker)
    with pytest.raises(DemoError, match="no mosquitto binary"):
        choose({brokers.BROKER_ENV: "mosquitto"}, tmp_path, None)
    with pytest.raises(DemoError, match="IMEXD_DEMO_BROKER=rabbit"):
        choose({brokers.BROKER_ENV: "rabbit"}, tmp_path, mosquitto)


def test_bad_node_count_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--nodes outside 2..32 exits 2 before anything starts."""
    assert main(["demo", "--nodes", "1"]) == 2
    assert "--nodes 1: expected 2..32" in capsys.readouterr().err


# Whole runs.


def _leftovers(root: Path) -> list[tuple[int, str]]:
    """Processes whose command line names `root` (agents, daemons, probes, Mosquitto)."""
    needle = str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state != "Z":
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def _kill_leftovers(root: Path) -> None:
    for pid, _ in _leftovers(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class DemoRun:
    """`python -m imexd demo` in the background, its output collected line by line."""

    def __init__(
        self, root: Path, *args: str, broker: str | None = None, prefix: Sequence[str] = ()
    ) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
        env["TMPDIR"] = str(root)
        if broker is not None:
            env[brokers.BROKER_ENV] = broker
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "imexd", "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self._new_line.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._new_line:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no line with {text!r}:\n{self.output}")
                self._new_line.wait(min(left, 0.5))

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        """The exit status; a demo still running after `timeout` is stopped (AssertionError)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"demo still running after {timeout:g} s:\n{self.output}"
            ) from None
        self._finish()
        return code

    def stop(self) -> None:
        """Ctrl-C, as a user would; SIGKILL if the demo does not end in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._finish()

    def _finish(self) -> None:
        self._reader.join(timeout=5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


class Demos:
    """Starts demo runs with TMPDIR in one folder; `close` ends whatever is left of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: list[DemoRun] = []

    def start(self, *args: str, broker: str | None = None, prefix: Sequence[str] = ()) -> DemoRun:
        run = DemoRun(self.root, *args, broker=broker, prefix=prefix)
        self.runs.append(run)
        return run

    def close(self) -> None:
        for run in self.runs:
            if run.proc.poll() is None:
                run.stop()
        _kill_leftovers(self.root)


@pytest.fixture
def demos(tmp_path: Path) -> Iterator[Demos]:
    """Demo runs whose processes are all ended after the test, even when it fails."""
    root = tmp_path / "tmp"
    root.mkdir()
    runner = Demos(root)
    try:
        yield runner
    finally:
        runner.close()


def _assert_nothing_left(root: Path) -> None:
    assert _leftovers(root) == []
    assert list(root.iterdir()) == [], "the demo's folder is still there"


def _assert_full_story(out: str) -> None:
    for expected in (
        "SLOT  NODE",
        "domain UP: ",
        "$ imexd workload create demo-job --domain demo --uid ",
        "workload demo-job in demo: created on channel 1 (",
        "workload demo-job in demo: READY, ",
        "$ imexd workload env demo-job --config node-1/imexd.toml",
        "    export IMEX_CHANNEL=1",
        "every agent made channel 1 for demo-job, in its node's folder: the device "
        "dev/nvidia-caps-imex-channels/channel1",
        "    NODE    DEVICE ",
        "workload demo-job in demo: deleted (channel 1 freed)",
        "channel 1 removed from every node: no device, CDI spec or env file of demo-job",
        "crash 1: SIGKILL the IMEX daemon of node-",
        "noticed after",
        "domain UP again",
        "crash 2: SIGKILL the agent of node-",
        "its peers dropped it from the domain",
        "adopted its running daemon",
        "agents left the domain and stopped their daemons",
        "Summary",
        "formation ",
        "workload         demo-job: channel 1 ready on ",
        "cleanup          nothing left running, folder removed",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    story = [
        "domain UP: ",
        "created on channel 1",
        "removed from every node",
        "crash 1: ",
        "crash 2: ",
        "Summary",
    ]
    lines = out.splitlines()
    at = [next(i for i, line in enumerate(lines) if s in line) for s in story]
    assert at == sorted(at), f"the acts are out of order:\n{out}"
    leaving = next(i for i, line in enumerate(lines) if "LEAVING - " in line)
    header = next(i for i in range(leaving, len(lines)) if lines[i].startswith("SLOT  NODE"))
    rows = [line.split() for line in lines[header + 1 : lines.index("", header)]]
    assert rows, out
    assert all(row[3:9] == ["left", "STOPPED", "-", "-", "-", "-"] for row in rows), out


def _device_rows(out: str) -> list[list[str]]:
    """The rows of the demo's table of the workload's files on each node."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    NODE    DEVICE "))
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("    node-"):
            break
        rows.append(line.split("  "))
    return [[cell.strip() for cell in row if cell.strip()] for row in rows]


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
@has_broker
def test_demo_forms_crashes_recovers_and_leaves_nothing(demos: Demos) -> None:
    """Three nodes form the domain, run a workload on its own channel (each node's device,
    CDI spec and env file shown, then gone), survive a daemon and an agent crash, and
    leave nothing."""
    run = demos.start("--nodes", "3")
    code = run.wait()
    assert code == 0, run.output
    _assert_full_story(run.output)
    owner = f"{os.getuid()}:{os.getgid()}"
    device = "char device 242:1" if IS_ROOT else "stand-in file"
    assert _device_rows(run.output) == [
        [f"node-{i}", device, owner, "0600", "written", "written"] for i in (1, 2, 3)
    ], run.output
    _assert_nothing_left(demos.root)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
@pytest.mark.skipif(importlib.util.find_spec("amqtt") is None, reason="the demo extra is missing")
def test_demo_runs_on_the_builtin_amqtt_broker(demos: Demos) -> None:
    """Without Mosquitto the in-process amqtt broker (MQTT 3.1.1) carries the whole story;
    and agents that may not mknod (as any user but root; here root less CAP_MKNOD where
    setpriv can drop it) make the workload's channel as stand-in files, said so."""
    prefix = ["setpriv", "--bounding-set=-mknod"] if IS_ROOT and shutil.which("setpriv") else []
    run = demos.start("--nodes", "2", broker="amqtt", prefix=prefix)
    code = run.wait()
    assert code == 0, run.output
    assert "amqtt (Python, in this process)" in run.output
    assert "MQTT 3.1.1" in run.output
    _assert_full_story(run.output)
    if prefix or not IS_ROOT:
        owner = f"{os.getuid()}:{os.getgid()}"
        assert _device_rows(run.output) == [
            [f"node-{i}", "stand-in file", owner, "0600", "written", "written"] for i in (1, 2)
        ], run.output
        assert "(a stand-in file where the agent may not mknod: the driver is simulated)" in (
            run.output
        )
        assert "Simulated: channel1 is a stand-in file, not a device" in run.output
    _assert_nothing_left(demos.root)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
@has_broker
def test_ctrl_c_during_formation_cleans_up(demos: Demos) -> None:
    """SIGINT while the agents start ends every process, removes the folder and exits 130."""
    run = demos.start("--nodes", "3")
    run.wait_for_line("started 3 agents", timeout=RUN_TIMEOUT_S)
    assert _leftovers(demos.root), "the agents should be running now"
    run.proc.send_signal(signal.SIGINT)
    code = run.wait(timeout=STOP_TIMEOUT_S)
    assert code == 130, run.output
    assert "interrupted by SIGINT: cleaning up" in run.output
    assert "cleaned up: nothing left running, folder removed" in run.output
    _assert_nothing_left(demos.root)


def _ignores_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


async def test_cleanup_ends_every_process_of_the_folder(tmp_path: Path) -> None:
    """Cleanup ends what names the folder, SIGKILL for what ignores SIGTERM, then removes it."""
    out = screen.Screen(io.StringIO(), tty=False, color=False)
    run = scenario.Demo(scenario.Options(nodes=2, broker=None), out, parent=tmp_path)
    codes = (
        "import time; time.sleep(60)",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
    )
    procs = [
        await asyncio.to_thread(
            subprocess.Popen, [sys.executable, "-c", code, str(run.folder / "node-1")]
        )
        for code in codes
    ]
    try:
        stubborn = procs[1].pid  # until it ignores SIGTERM, SIGTERM ends it before it refuses
        await until(lambda: _ignores_sigterm(stubborn), within=30, what="SIGTERM ignored")
        started = time.monotonic()
        await run.close()
        assert all(proc.poll() is not None for proc in procs)
        assert time.monotonic() - started >= brokers.KILL_WAIT_S  # SIGTERM, a wait, SIGKILL
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert run.cleanup.stray_processes == 2
    assert not run.folder.exists()
    assert scenario.cleanup_text(run.cleanup) == (
        "nothing left running, folder removed (had to end 2 process(es))"
    )


def test_free_ports_lie_outside_the_kernels_ephemeral_range() -> None:
    """Seen in CI: an agent's health port, picked by free_port() when the test began, was
    taken by an outgoing connection's ephemeral port before the agent bound it ("address
    already in use"). free_port() hands out ports the kernel never picks for outgoing
    connections, and never the same one twice in a process."""
    low, high = brokers.ephemeral_ports()
    ports = [brokers.free_port() for _ in range(200)]
    assert not [p for p in ports if low <= p <= high]
    assert len(set(ports)) == len(ports)


def test_free_ports_keep_to_the_range_the_environment_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen in a full run: a test's broker failed to start ("Address already in use") on
    a port another xdist worker's broker held. Each worker now picks from its own range
    (tests/conftest.py sets PORTS_ENV), children included; a wrong value names itself."""
    low, high = brokers.ephemeral_ports()
    first = 12000 if low > 12100 else high + 1
    monkeypatch.setenv(brokers.PORTS_ENV, f"{first}-{first + 99}")
    ports = [brokers.free_port() for _ in range(20)]
    assert all(first <= p <= first + 99 for p in ports), ports
    for wrong in ("12000", "x-y", "20000-10000", "80-90", "60000-70000"):
        monkeypatch.setenv(brokers.PORTS_ENV, wrong)
        with pytest.raises(DemoError, match=f"{brokers.PORTS_ENV}={wrong}: expected LOW-HIGH"):
            brokers.free_port()


def test_child_pythons_ignore_the_current_folder(tmp_path: Path) -> None:
    """Run from the folder that holds a clone, a child `python -m imexd` still imports
    the installed package: the clone's `imexd/` must not shadow it."""
    from imexd.demo.nodes import DemoNode, _tool
    from imexd.process import python_module

    node = DemoNode(
        name="n1",
        address="127.0.0.1",
        folder=tmp_path / "n1",
        settings={"node": {}, "imex": {}, "health": {}},
    )
    assert node.command()[:4] == [sys.executable, "-P", "-m", "imexd"]
    assert node.command()[4:] == ["run", "--config", str(node.config_path)]
    wrapper = Path(_tool("no-such-imexd-tool", "imexd.sim.daemon", tmp_path))
    assert f'"{sys.executable}" -P -m imexd.sim.daemon' in wrapper.read_text()

    shadow = tmp_path / "clone" / "imexd"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise SystemExit('the clone shadowed imexd')\n")
    done = subprocess.run(
        [*python_module("imexd"), "--version"],
        cwd=shadow.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "shadowed" not in done.stderr
