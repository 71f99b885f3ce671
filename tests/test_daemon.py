"""The daemon supervisor: pure helpers, then real processes (a fake `nvidia-imex`).

Every daemon here is a real child process on 127.0.0.0/8 settings; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from imexd.agent.probes import PROBE_SERIES_S, DaemonProbes
from imexd.daemon.ctl import DomainResult, DomainTable, LocalProbe, NodeStatus, Prober
from imexd.daemon.inotify import Inotify
from imexd.daemon.output import (
    EXIT_LINE_CHARS,
    DaemonOutput,
    Tail,
    parse_imex_line,
    quote_lines,
    says_ready,
)
from imexd.daemon.process import daemon_environment, spawn_error
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.daemon.supervisor import Supervisor
from imexd.demo.brokers import free_port
from imexd.health.conditions import Heartbeats
from imexd.health.guard import BEAT_S, Guard
from imexd.health.metrics import Metrics
from imexd.imex import PACKAGE_CONFIG, ConnectionState, ImexDomainState, ImexState
from imexd.logs import get_logger
from imexd.process import (
    Endpoint,
    ImexProcess,
    classify_processes,
    config_argument,
    daemon_endpoints,
    describe_exit,
    find_imex_processes,
    group_members,
    is_imex_daemon,
    read_imex_config,
    survives_signal,
)
from imexd.settings import DaemonSettings, ImexSettings, Settings
from tests import support
from tests.support import loopback_address, wait_for

FAKE_SOURCE = Path(__file__).with_name("fake_daemon.py")
SIM_BINARY = Path(sys.executable).with_name("imexd-sim-daemon")
SIM_CTL = Path(sys.executable).with_name("imexd-sim-ctl")

FAST = DaemonSettings(
    start_s=0.3,
    stable_s=2.0,
    backoff_initial_s=0.1,
    backoff_max_s=0.5,
    crash_loop_starts=3,
    crash_loop_window_s=10.0,
    fatal_cooldown_s=1.0,
    stop_timeout_s=0.5,
)

# ---------------------------------------------------------------------------------
# Pure helpers


def test_imex_log_lines_are_split_into_level_and_message() -> None:
    """IMEX's bracketed format and its `LEVEL:` prefix lines map to structlog levels."""
    line = parse_imex_line(
        "[Sep 18 2026 06:40:33] [INFO] [tid 77] IMEX library communication bind port = 50000"
    )
    assert (line.level, line.message, line.tid) == (
        "info",
        "IMEX library communication bind port = 50000",
        77,
    )
    assert line.imex_time == "Sep 18 2026 06:40:33"
    assert parse_imex_line("[Sep  8 2026 06:40:33] [ERROR] [tid 1] boom").level == "error"
    assert parse_imex_line("[Sep 18 2026 06:40:33] [WARNING] [tid 1] hm").level == "warning"
    warn = parse_imex_line(
        "WARNING: failed to open IMEX log file errno = No such file or directory"
    )
    assert (warn.level, warn.message) == (
        "warning",
        "failed to open IMEX log file errno = No such file or directory",
    )
    assert parse_imex_line("INFO: using stderr for IMEX logging").level == "info"
    plain = parse_imex_line("IMEX Log initializing at: 9/18/2026 06:40:33.561")
    assert (plain.level, plain.message, plain.tid) == (
        "info",
        "IMEX Log initializing at: 9/18/2026 06:40:33.561",
        None,
    )


@pytest.mark.parametrize(
    ("line", "ready"),
    [
        ("IMEX daemon state changed from INIT_GPU to READY", True),
        ("[Sep 18 2026 06:40:33] [INFO] [tid 77] IMEX daemon state changed from X to READY", True),
        ("IMEX Daemon State Changed From WAITING_FOR_RECOVERY to READY.", True),
        ("IMEX daemon state changed from READY to SHUTTING_DOWN", False),
        ("IMEX daemon state changed from INIT_GPU to READY_SOON", False),
        ("IMEX daemon state changed from INIT_GPU to READYING", False),
        ("IMEX daemon state changed from INIT_GPU to NOT_READY", False),
        ("IMEX daemon state changed from INIT_GPU to ready", False),
        ("Node 3 state changed from INIT_GPU to READY", False),
        ("Node #0   - 172.31.48.81    - READY                - Version: 570.172", False),
        ("READY", False),
    ],
)
def test_only_the_daemons_own_change_to_ready_says_ready(line: str, *, ready: bool) -> None:
    """The daemon says READY with its own state change to the whole word READY: a peer's
    change, a change away from READY, or READY elsewhere in a line says nothing."""
    assert says_ready(parse_imex_line(line).message) is ready


def test_daemon_environment_adds_imex_env_and_drops_systemd_notify_variables() -> None:
    """The daemon gets our environment plus `[imex] env`, never NOTIFY_SOCKET or WATCHDOG_*."""
    env = daemon_environment(
        {"PATH": "/bin", "NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2"},
        {"IMEX_X": "1", "PATH": "/opt/bin", "NOTIFY_SOCKET": "/x"},
    )
    assert env == {"PATH": "/opt/bin", "IMEX_X": "1"}


def test_exit_descriptions_name_the_code_or_the_signal() -> None:
    """A returncode reads as `exit N` or as the signal's name."""
    assert describe_exit(0) == "exit 0"
    assert describe_exit(3) == "exit 3"
    assert describe_exit(-9) == "SIGKILL"
    assert describe_exit(-11) == "SIGSEGV"


def test_a_crash_reason_quotes_the_last_three_lines_without_imex_time_and_tid() -> None:
    """IMEX's time and tid are dropped, the level kept; only the last 3; long lines cut."""
    lines = [
        "IMEX Log initializing at: 9/18/2026 06:40:33.561",
        "[Sep 18 2026 06:40:33] [INFO] [tid 77] IMEX version 570.148.08 is running",
        "WARNING: failed to open IMEX log file",
        "[Sep 18 2026 06:40:34] [ERROR] [tid 77] Lost the GPU, exiting",
    ]
    assert quote_lines(lines) == (
        "[INFO] IMEX version 570.148.08 is running | WARNING: failed to open IMEX log file"
        " | [ERROR] Lost the GPU, exiting"
    )
    assert quote_lines([]) == ""
    long = quote_lines(["x" * 1000])
    assert (len(long), long[-3:]) == (EXIT_LINE_CHARS, "...")


def test_a_binary_that_cannot_run_is_named_with_its_path(tmp_path: Path) -> None:
    """The start failure names the file, PATH for a bare name, and a missing interpreter."""
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory")
    gone = str(tmp_path / "nvidia-imex")
    assert spawn_error(gone, missing) == f"cannot run {gone}: No such file or directory"
    assert spawn_error("nvidia-imex", missing, str(tmp_path)) == (
        f"cannot run nvidia-imex: not found on PATH ({tmp_path})"
    )
    script = tmp_path / "nvidia-imex"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    assert spawn_error("nvidia-imex", missing, str(tmp_path)) == (
        f"cannot run {script}: No such file or directory "
        "(the file exists: its interpreter or dynamic loader is missing)"
    )
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert spawn_error(str(script), denied) == f"cannot run {script}: Permission denied"


def test_a_signal_is_survived_when_caught_blocked_or_ignored() -> None:
    """/proc status masks tell whether SIGUSR1 (bit 9) would kill a process still starting."""
    usr1 = f"{1 << 9:016x}"
    base = "Name:\tnvidia-imex\nSigBlk:\t{blk}\nSigIgn:\t{ign}\nSigCgt:\t{cgt}\n"
    zero = "0" * 16
    assert not survives_signal(base.format(blk=zero, ign=zero, cgt=zero), signal.SIGUSR1)
    for masks in ({"blk": usr1}, {"ign": usr1}, {"cgt": usr1}):
        text = base.format(**({"blk": zero, "ign": zero, "cgt": zero} | masks))
        assert survives_signal(text, signal.SIGUSR1), masks
    assert not survives_signal(base.format(blk=zero, ign=zero, cgt=usr1), signal.SIGUSR2)
    assert survives_signal("Name:\tgone\n", signal.SIGUSR1)


def test_a_real_process_survives_sigusr1_only_once_its_handler_is_installed() -> None:
    """The masks of a live child change when it installs its handler."""
    code = (
        "import signal, sys, time; sys.stdin.readline(); "
        "signal.signal(signal.SIGUSR1, lambda *a: None); print('ok', flush=True); time.sleep(30)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            status = Path(f"/proc/{proc.pid}/status")
            assert not survives_signal(status.read_text(), signal.SIGUSR1)
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "ok\n"
            assert survives_signal(status.read_text(), signal.SIGUSR1)
        finally:
            proc.kill()


@pytest.mark.parametrize(
    ("cmdline", "daemon", "config"),
    [
        (["/usr/bin/nvidia-imex", "-c", PACKAGE_CONFIG], True, PACKAGE_CONFIG),
        (["nvidia-imex"], True, None),
        (["/usr/bin/nvidia-imex-ctl", "-c", "/run/imexd/config.cfg", "-q"], False, None),
        (
            ["/v/bin/python3.11", "/v/bin/imexd-sim-daemon", "-c", "/run/a/config.cfg"],
            True,
            "/run/a/config.cfg",
        ),
        (["python", "-u", "-X", "dev", "/x/nvidia-imex", "--config=/a.cfg"], True, "/a.cfg"),
        (["python3", "-m", "imexd.sim.daemon", "-c/b.cfg"], True, "/b.cfg"),
        (["python", "-c", "print('nvidia-imex')", "-c", "/x"], False, None),
        (["vim", "nvidia-imex.cfg"], False, None),
        (["/usr/bin/imexd", "run", "-c", "/etc/imexd/imexd.toml"], False, None),
        ([], False, None),
    ],
)
def test_imex_daemons_are_recognised_by_program_and_config_argument(
    cmdline: list[str], daemon: bool, config: str | None
) -> None:
    """The program (after a Python interpreter) decides; the ctl and other tools are not daemons."""
    assert is_imex_daemon(cmdline) is daemon
    if daemon:
        assert config_argument(cmdline) == config


def test_daemon_config_is_read_into_endpoints(tmp_path: Path) -> None:
    """config.cfg keys give the listening endpoints, with IMEX's defaults and wildcards."""
    cfg = tmp_path / "config.cfg"
    cfg.write_text("# c\nBIND_INTERFACE_IP=10.0.0.1\nSERVER_PORT=51000\n\nIMEX_CMD_PORT=51005\n")
    values = read_imex_config(str(cfg))
    assert values == {
        "BIND_INTERFACE_IP": "10.0.0.1",
        "SERVER_PORT": "51000",
        "IMEX_CMD_PORT": "51005",
    }
    assert daemon_endpoints(values) == (
        Endpoint("10.0.0.1", 51000, "SERVER_PORT"),
        Endpoint("", 51005, "IMEX_CMD_PORT"),
    )
    assert daemon_endpoints({}) == (
        Endpoint("", 50000, "SERVER_PORT"),
        Endpoint("", 50005, "IMEX_CMD_PORT"),
    )
    assert daemon_endpoints({"IMEX_CMD_ENABLED": "0", "SERVER_PORT": "x"}) == ()
    assert read_imex_config(str(tmp_path / "missing.cfg")) is None


def _proc(pid: int, config: str) -> ImexProcess:
    return ImexProcess(pid, ("nvidia-imex", "-c", config), config, 1.0)


def test_classify_finds_ours_and_conflicts_but_not_other_simulated_nodes() -> None:
    """Ours = same config path; conflicts = package config or our address and port."""
    configs: dict[str, Mapping[str, str]] = {
        "/run/a/config.cfg": {
            "BIND_INTERFACE_IP": "127.0.0.2",
            "SERVER_PORT": "50000",
            "IMEX_CMD_BIND_INTERFACE_IP": "127.0.0.2",
            "IMEX_CMD_PORT": "50005",
        },
        "/run/b/config.cfg": {  # another simulated node: other address, same ports
            "BIND_INTERFACE_IP": "127.0.0.3",
            "SERVER_PORT": "50000",
            "IMEX_CMD_BIND_INTERFACE_IP": "127.0.0.3",
            "IMEX_CMD_PORT": "50005",
        },
        "/run/c/config.cfg": {  # same address and server port
            "BIND_INTERFACE_IP": "127.0.0.2",
            "SERVER_PORT": "50000",
            "IMEX_CMD_BIND_INTERFACE_IP": "127.0.0.2",
            "IMEX_CMD_PORT": "51005",
        },
        "/run/d/config.cfg": {  # command port on every interface: takes ours
            "BIND_INTERFACE_IP": "127.0.0.4",
            "SERVER_PORT": "52000",
            "IMEX_CMD_PORT": "50005",
        },
    }
    survey = classify_processes(
        [
            _proc(1, "/run/a/config.cfg"),
            _proc(2, "/run/b/config.cfg"),
            _proc(3, "/run/c/config.cfg"),
            _proc(4, "/run/d/config.cfg"),
            _proc(5, PACKAGE_CONFIG),
            _proc(6, "/run/unreadable/config.cfg"),
            _proc(7, "/run/a/../a/config.cfg"),
        ],
        config_path="/run/a/config.cfg",
        read_config=configs.get,
    )
    assert [p.pid for p in survey.ours] == [1, 7]
    why = {p.pid: reason for p, reason in survey.conflicts}
    assert sorted(why) == [3, 4, 5]
    assert why[3] == (
        "uses 127.0.0.2:50000 (SERVER_PORT in /run/c/config.cfg), "
        "which our SERVER_PORT 127.0.0.2:50000 needs"
    )
    assert why[4].startswith("uses *:50005 (IMEX_CMD_PORT")
    assert why[5].startswith(f"runs the package config {PACKAGE_CONFIG}")


def test_without_our_own_config_only_the_package_config_conflicts() -> None:
    """When our config.cfg cannot be read, ports cannot be compared: only the package counts."""
    survey = classify_processes(
        [_proc(3, "/run/c/config.cfg"), _proc(5, PACKAGE_CONFIG)],
        config_path="/run/a/config.cfg",
        read_config={"/run/c/config.cfg": {}}.get,
    )
    assert [p.pid for p, _ in survey.conflicts] == [5]


def _no_config(path: str) -> Mapping[str, str] | None:
    return None


def test_our_config_path_with_another_file_is_a_conflict_not_ours() -> None:
    """Another container's daemon on our path (hostPID) is a conflict, never adopted or ended."""
    mine = ImexProcess(
        3, ("nvidia-imex", "-c", "/run/imexd/config.cfg"), "/run/imexd/config.cfg", 1.0
    )
    same = dataclasses.replace(mine, pid=4, config_file=(10, 7))
    theirs = dataclasses.replace(mine, pid=5, config_file=(11, 7))
    survey = classify_processes(
        [mine, same, theirs],
        config_path="/run/imexd/config.cfg",
        read_config=_no_config,
        own_file=(10, 7),
    )
    assert [p.pid for p in survey.ours] == [3, 4]
    [(proc, why)] = survey.conflicts
    assert proc.pid == 5
    assert why == (
        "runs /run/imexd/config.cfg from another mount namespace (another container or pod "
        "on this node: not this agent's file)"
    )
    unknown = classify_processes(
        [theirs], config_path="/run/imexd/config.cfg", read_config=_no_config
    )
    assert [p.pid for p in unknown.ours] == [5]


def _can_unshare_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    return probe.returncode == 0


# ---------------------------------------------------------------------------------
# Real processes


@dataclass
class Node:
    """One simulated node's files: a fake `nvidia-imex` and its config on a loopback address."""

    root: Path
    binary: Path
    config: Path
    address: str
    server_port: int
    cmd_port: int
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def path(self, name: str) -> str:
        return str(self.root / name)

    def write_config(self, path: Path, *, address: str, server_port: int, cmd_port: int) -> None:
        nodes = path.with_name("nodes_config.cfg")
        nodes.write_text(address + "\n")
        path.write_text(
            f"BIND_INTERFACE_IP={address}\nSERVER_PORT={server_port}\n"
            f"IMEX_CMD_PORT={cmd_port}\nIMEX_CMD_BIND_INTERFACE_IP={address}\n"
            f"IMEX_NODE_CONFIG_FILE={nodes}\nLOG_FILE_NAME=\nDAEMONIZE=0\n"
        )

    def supervisor(
        self,
        env: Mapping[str, str] | None = None,
        *,
        settings: DaemonSettings = FAST,
        reload_min_interval_s: float = 0.5,
        binary: str | None = None,
        on_change: list[DaemonStatus] | Callable[[DaemonStatus], None] | None = None,
        **kwargs: Any,
    ) -> Supervisor:
        return Supervisor(
            binary=binary or str(self.binary),
            config_path=self.config,
            env=dict(env or {}),
            settings=settings,
            reload_min_interval_s=reload_min_interval_s,
            conflict_recheck_s=0.2,
            on_change=on_change.append if isinstance(on_change, list) else on_change,
            rand=lambda: 1.0,
            **kwargs,
        )

    def run_outside(self, config: Path, env: Mapping[str, str] | None = None) -> psutil.Process:
        """Start a daemon that no supervisor owns (a previous agent's, or a stranger's).

        Returns once it is up: the fake wrote its pidfile, the simulator listens.
        """
        pidfile = self.root / f"outside-{len(self.children)}.pid"
        values = read_imex_config(str(config)) or {}
        address, port = values["BIND_INTERFACE_IP"], int(values["SERVER_PORT"])
        proc = subprocess.Popen(
            [str(self.binary), "-c", str(config)],
            env={**os.environ, "FAKE_IMEX_PIDFILE": str(pidfile), **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.children.append(proc)
        if self.binary == SIM_BINARY:
            wait_for(lambda: listening(address, port))
        else:
            wait_for(pidfile.exists)
        return psutil.Process(proc.pid)


async def until(sup: Supervisor, predicate: Callable[[DaemonStatus], bool]) -> DaemonStatus:
    """The supervisor's status once `predicate` holds; TimeoutError after 5 s."""
    async with asyncio.timeout(5.0):
        return await sup.wait_for(predicate)


def read_pids(path: Path) -> list[int]:
    """The pids a fake daemon wrote to its pidfile, once it has written them."""
    wait_for(path.exists)
    return [int(word) for word in path.read_text().split()]


def signal_log(path: Path) -> list[tuple[float, str, str]]:
    """The simulator's signal log: (unix time in s, signal name, honoured|ignored) per line."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        stamp, name, verdict = line.split()
        at = float(stamp)
        entries.append((at / 1000 if at > 1e11 else at, name, verdict))
    return entries


def reloads(path: Path) -> list[tuple[float, str, str]]:
    """The SIGUSR1 entries of a simulator's signal log."""
    return [entry for entry in signal_log(path) if entry[1] == "SIGUSR1"]


def reap(pid: int) -> None:
    """Kill (if needed) and reap a daemon that is this test process's own child."""
    if not gone(pid):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def catches(pid: int, sig: signal.Signals) -> bool:
    """True once process `pid` has a handler for (or ignores) `sig`."""
    return survives_signal(Path(f"/proc/{pid}/status").read_text(), sig)


def listening(address: str, port: int) -> bool:
    """True when something accepts TCP connections on address:port."""
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (gone, or a zombie waiting for its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def make_node(tmp_path: Path, binary: Path) -> Iterator[Node]:
    """Files of one node on a fresh loopback address; kills what the test left running."""
    run = tmp_path / "run"
    run.mkdir()
    n = Node(
        root=tmp_path,
        binary=binary,
        config=run / "config.cfg",
        address=loopback_address(),
        server_port=free_port(),
        cmd_port=free_port(),
    )
    n.write_config(n.config, address=n.address, server_port=n.server_port, cmd_port=n.cmd_port)
    try:
        yield n
    finally:
        for proc in n.children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """A fake daemon binary named nvidia-imex and a config.cfg on a fresh loopback address."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    binary = bindir / "nvidia-imex"
    binary.write_text(f"#!{sys.executable}\n" + FAKE_SOURCE.read_text())
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    yield from make_node(tmp_path, binary)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Node]:
    """The simulator (`imexd-sim-daemon`) with a config.cfg on a fresh loopback address."""
    assert SIM_BINARY.exists(), f"{SIM_BINARY} is missing: pip install -e . in the venv"
    yield from make_node(tmp_path, SIM_BINARY)


def states(changes: list[DaemonStatus]) -> list[str]:
    """The sequence of distinct states seen by an on_change recorder."""
    seen: list[str] = []
    for status in changes:
        if not seen or seen[-1] != status.state.value:
            seen.append(status.state.value)
    return seen


async def test_start_runs_the_daemon_in_its_own_group_and_streams_its_output(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start reaches RUNNING after start_s; output becomes log events; leaving stops it."""
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    with capture_logs() as logs:
        async with node.supervisor({"IMEX_TEST_VAR": "yes"}) as sup:
            status = await sup.ensure_started()
            assert status.state is DaemonState.STARTING
            assert status.pid is not None
            pid = status.pid
            status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
            assert status.reason is None
            assert status.pid == pid
            proc = psutil.Process(pid)
            assert proc.cmdline()[-2:] == ["-c", str(node.config)]
            assert os.getpgid(pid) == pid
            environ = proc.environ()
            assert environ["IMEX_TEST_VAR"] == "yes"
            assert "NOTIFY_SOCKET" not in environ
            assert sup.environment["IMEX_TEST_VAR"] == "yes"
            await until(sup, lambda s: any("IMEX version" in line for line in s.last_lines))
        assert sup.state is DaemonState.STOPPED
        assert sup.last_exit == "exit 0"
        assert gone(pid)
    transitions = [(e["from"], e["to"]) for e in logs if e["event"] == "daemon.state"]
    assert transitions == [
        ("STOPPED", "STARTING"),
        ("STARTING", "RUNNING"),
        ("RUNNING", "STOPPING"),
        ("STOPPING", "STOPPED"),
    ]
    output = [e for e in logs if e["event"] == "daemon.output"]
    assert all(e["source"] == "nvidia-imex" for e in output)
    version = next(e for e in output if e["line"].startswith("IMEX version"))
    assert (version["log_level"], version["stream"], version["tid"]) == ("info", "stderr", pid)
    init = next(e for e in output if e["line"].startswith("IMEX Log initializing"))
    assert init["stream"] == "stdout"
    assert any(e["line"] == "Shutting down" for e in output)


async def test_a_crash_backs_off_and_restarts_with_the_restart_counted(node: Node) -> None:
    """An exit while RUNNING => BACKOFF, then a new daemon after the delay, counted."""
    changes: list[DaemonStatus] = []
    env = {"FAKE_IMEX_EXIT_AFTER_S": "0.6", "FAKE_IMEX_EXIT_ONCE": node.path("once")}
    async with node.supervisor(env, on_change=changes) as sup:
        first = (await sup.ensure_started()).pid
        await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert sup.reason == "DaemonCrashed"
        assert re.fullmatch(r"exit 3 after 0\.\d s, restart in 0\.1 s; last lines: .*", sup.detail)
        assert sup.detail.endswith("| [ERROR] Lost the GPU, exiting")
        status = await until(sup, lambda s: s.state is DaemonState.RUNNING and s.pid != first)
        assert (status.restarts, status.crashes, status.last_exit) == (1, 1, "exit 3")
        assert (status.start_failures, status.fatal_since) == (0, None)
    assert states(changes)[:6] == [
        "STARTING",
        "RUNNING",
        "BACKOFF",
        "STARTING",
        "RUNNING",
        "STOPPING",
    ]


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0.5)[0])


def test_inotify_wakes_on_a_write_to_a_watched_file_only(tmp_path: Path) -> None:
    """The watch follows the open file; after `clear()` its writes wake nothing."""
    path = tmp_path / "out"
    path.write_bytes(b"")
    inotify = Inotify.open()
    fd = os.open(path, os.O_RDONLY)
    try:
        inotify.watch(fd)
        assert not _readable(inotify.fileno())
        with path.open("ab") as out:
            out.write(b"line\n")
        assert _readable(inotify.fileno())
        inotify.drain()
        assert not _readable(inotify.fileno())
        inotify.clear()
        inotify.drain()  # the removal's own IN_IGNORED
        with path.open("ab") as out:
            out.write(b"line\n")
        assert not _readable(inotify.fileno())
        with pytest.raises(OSError, match="inotify_add_watch"):
            inotify.watch(10**6)  # not an open file
    finally:
        os.close(fd)
        inotify.close()
        inotify.close()


async def test_output_is_read_when_the_daemon_writes_not_on_a_timer(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With inotify the output is read when the daemon writes: a line written a second
    after the first comes without the reads every `output_poll_s` that a timer makes."""
    script = tmp_path / "quiet-daemon"
    script.write_text("#!/bin/sh\necho first\nsleep 1\necho second\nexec sleep 30\n")
    script.chmod(0o755)
    reads: list[float] = []
    poll = DaemonOutput.poll

    def counted(self: DaemonOutput, tail: Tail) -> None:
        reads.append(time.monotonic())
        poll(self, tail)

    monkeypatch.setattr(DaemonOutput, "poll", counted)
    with capture_logs() as logs:
        async with node.supervisor(binary=str(script), output_poll_s=0.05) as sup:
            await sup.ensure_started()
            sup.listening = False
            await until(sup, lambda s: "second" in s.last_lines)
    assert "first" in sup.last_lines
    assert len(reads) <= 6, f"{len(reads)} reads: a timer at 0.05 s makes 20 a second"
    assert not [e for e in logs if e["event"] == "daemon.output_polled"]


async def test_without_inotify_the_output_is_read_on_the_timer(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No inotify (another kernel, instances used up): the output is read every
    `output_poll_s`, and the log says so once."""

    def missing() -> Inotify:
        raise OSError(errno.EMFILE, "inotify_init1: Too many open files")

    monkeypatch.setattr(Inotify, "open", staticmethod(missing))
    with capture_logs() as logs:
        async with node.supervisor(output_poll_s=0.05) as sup:
            await sup.ensure_started()
            sup.listening = False
            await until(sup, lambda s: any("IMEX version" in line for line in s.last_lines))
    polled = [e for e in logs if e["event"] == "daemon.output_polled"]
    assert len(polled) == 1
    assert "Too many open files" in polled[0]["error"]
    assert "0.05 s" in polled[0]["consequence"]


async def test_the_daemon_outlives_its_log_reader(node: Node, tmp_path: Path) -> None:
    """The daemon starts with SIGPIPE ignored, so a dead agent's pipe cannot kill it."""
    script = tmp_path / "plain-daemon"
    script.write_text("#!/bin/sh\nexec sleep 30\n")  # sh and sleep keep the disposition
    script.chmod(0o755)
    async with node.supervisor(binary=str(script)) as sup:
        pid = (await sup.ensure_started()).pid
        assert pid is not None
        status = await asyncio.to_thread(Path(f"/proc/{pid}/status").read_text)
        ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
        assert int(ignored.split()[1], 16) & (1 << (signal.SIGPIPE - 1))


async def test_a_crash_loop_turns_fatal_and_is_retried_after_the_cooldown(node: Node) -> None:
    """crash_loop_starts quick failures => FATAL with exit code and last stderr line; retried."""
    broken = node.root / "broken"
    broken.write_bytes(b"")
    changes: list[DaemonStatus] = []
    env = {"FAKE_IMEX_FAIL_IF_EXISTS": str(broken)}
    slow_start = dataclasses.replace(FAST, start_s=1.5)  # a loaded host is slow to even fail
    async with node.supervisor(env, on_change=changes, settings=slow_start) as sup:
        await sup.ensure_started()
        fatal = await until(sup, lambda s: s.state is DaemonState.FATAL)
        fatal_at = time.monotonic()
        assert fatal.reason == "DaemonCrashLoop"
        assert re.fullmatch(
            r"exit 3 after \d\.\d s, 3 failures within 10 s, next try in 1\.0 s; last lines: "
            r"IMEX Log initializing at: .* \| \[ERROR\] Failed to read node configuration file "
            r"for .* \| fatal: no usable node configuration",
            fatal.detail,
        ), fatal.detail
        assert (fatal.crashes, fatal.start_failures, fatal.restarts, fatal.pid) == (3, 3, 0, None)
        assert fatal.fatal_since == pytest.approx(fatal_at, abs=0.3)
        assert fatal.last_lines[-1] == "fatal: no usable node configuration"
        assert fatal.next_start_at is not None
        assert fatal.next_start_at - time.time() == pytest.approx(1.0, abs=0.3)
        again = await sup.ensure_started()
        assert (again.state, again.restarts) == (DaemonState.FATAL, 0)
        os.unlink(broken)
        status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        assert time.monotonic() - fatal_at >= 0.8
        assert (status.restarts, status.start_failures, status.fatal_since) == (0, 3, None)
    assert states(changes)[:8] == [
        "STARTING",
        "BACKOFF",
        "STARTING",
        "BACKOFF",
        "STARTING",
        "FATAL",
        "STARTING",
        "RUNNING",
    ]


async def test_retry_ends_a_fatal_wait_at_once_and_forgets_the_failures(node: Node) -> None:
    """`retry` (imexd node retry): FATAL with a 10-minute cool-down starts again now; the
    failures are forgotten, so the next one backs off instead of going straight back to
    FATAL; a running daemon is left alone."""
    broken = node.root / "broken"
    broken.write_bytes(b"")
    env = {"FAKE_IMEX_FAIL_IF_EXISTS": str(broken)}
    long_cooldown = dataclasses.replace(FAST, start_s=1.5, fatal_cooldown_s=600.0)
    async with node.supervisor(env, settings=long_cooldown) as sup:
        await sup.ensure_started()
        await until(sup, lambda s: s.state is DaemonState.FATAL)
        # The cause persists: the retried start fails once more, and backs off (not FATAL).
        failed = await sup.retry("operator")
        assert failed.state is not DaemonState.FATAL
        backoff = await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert (backoff.reason, backoff.fatal_since) == ("DaemonCrashed", None)
        await until(sup, lambda s: s.state is DaemonState.FATAL)
        os.unlink(broken)  # the operator fixed the cause
        started = await sup.retry("operator")
        assert started.state is DaemonState.STARTING
        running = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        again = await sup.retry("operator")
        assert (again.state, again.pid, again.restarts) == (DaemonState.RUNNING, running.pid, 0)


async def test_a_daemon_that_cannot_be_executed_ends_fatal_with_the_reason(node: Node) -> None:
    """A missing binary is a failed start: backoff, then FATAL naming the error."""
    async with node.supervisor(binary=node.path("no-such-nvidia-imex")) as sup:
        await sup.ensure_started()
        status = await until(sup, lambda s: s.state is DaemonState.FATAL)
    assert (status.restarts, status.start_failures) == (0, FAST.crash_loop_starts)
    assert status.reason == "DaemonCrashLoop"
    assert status.detail == (
        f"cannot run {node.path('no-such-nvidia-imex')}: No such file or directory, "
        "3 failures within 10 s, next try in 1.0 s"
    )


async def test_a_missing_binary_is_named_at_the_first_failure(node: Node) -> None:
    """ENOENT at spawn is DaemonStartFailed in BACKOFF at once, naming the path, not a crash."""
    binary = node.path("no-such-nvidia-imex")
    changes: list[DaemonStatus] = []
    async with node.supervisor(binary=binary, on_change=changes) as sup:
        first = await sup.ensure_started()
    assert (first.state, first.reason) == (DaemonState.BACKOFF, "DaemonStartFailed")
    assert first.detail == f"cannot run {binary}: No such file or directory, retry in 0.1 s"
    assert (first.crashes, first.start_failures, first.last_lines) == (1, 1, ())
    assert (changes[0].reason, changes[0].detail) == (first.reason, first.detail)


async def test_a_crash_quotes_only_the_exited_daemons_own_lines(node: Node, tmp_path: Path) -> None:
    """A daemon that dies silently reads `no output`, never the previous daemon's lines."""
    quiet = tmp_path / "quiet"
    script = tmp_path / "nvidia-imex"
    script.write_text(
        f'#!/bin/sh\n[ -e "{quiet}" ] && kill -9 $$\n'
        'echo "[Sep 18 2026 06:40:33] [INFO] [tid $$] first daemon line" >&2\nexec sleep 30\n'
    )
    script.chmod(0o755)
    async with node.supervisor(binary=str(script)) as sup:
        first = await sup.ensure_started()
        await until(sup, lambda s: any("first daemon line" in line for line in s.last_lines))
        assert first.pid is not None
        quiet.touch()
        os.kill(first.pid, signal.SIGKILL)
        own = await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert own.reason == "DaemonCrashed"
        assert own.detail.startswith("SIGKILL after ")
        assert own.detail.endswith("; last lines: [INFO] first daemon line")
        silent = await until(sup, lambda s: s.state is DaemonState.BACKOFF and s.crashes == 2)
    assert silent.reason == "DaemonCrashed"
    assert re.fullmatch(r"SIGKILL after 0\.\d s, restart in 0\.\d s; no output", silent.detail)
    assert silent.last_lines == ()


async def test_fatal_since_holds_through_failed_probation_tries(node: Node) -> None:
    """FATAL records since when; a failed try after the cool-down keeps it; stop clears it."""
    async with node.supervisor(binary=node.path("no-such-nvidia-imex")) as sup:
        await sup.ensure_started()
        fatal = await until(sup, lambda s: s.state is DaemonState.FATAL)
        assert fatal.fatal_since is not None
        assert fatal.fatal_since <= time.monotonic()
        retried = await until(sup, lambda s: s.start_failures > fatal.start_failures)
        assert retried.state is DaemonState.FATAL
        assert retried.fatal_since == fatal.fatal_since
        assert retried.restarts == 0
        stopped = await sup.stop()
        assert (stopped.state, stopped.fatal_since) == (DaemonState.STOPPED, None)


async def test_a_daemon_ignoring_sigterm_is_killed_with_its_whole_group(node: Node) -> None:
    """stop() sends SIGTERM to the group, SIGKILL after stop_timeout_s; nothing is left."""
    pidfile = Path(node.path("pids"))
    env = {
        "FAKE_IMEX_IGNORE_TERM": "1",
        "FAKE_IMEX_CHILD": "1",
        "FAKE_IMEX_PIDFILE": str(pidfile),
    }
    async with node.supervisor(env) as sup:
        await sup.ensure_started()
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        leader, child = await asyncio.to_thread(read_pids, pidfile)
        assert os.getpgid(child) == leader
        began = time.monotonic()
        status = await sup.stop()
        took = time.monotonic() - began
    assert status.state is DaemonState.STOPPED
    assert status.last_exit == "SIGKILL"
    assert FAST.stop_timeout_s <= took < FAST.stop_timeout_s + 3.0
    assert gone(leader)
    assert gone(child)
    assert group_members(leader) == []


async def test_a_crashed_daemons_leftover_children_are_killed(node: Node) -> None:
    """When the daemon dies, whatever is left of its process group is killed too."""
    pidfile = Path(node.path("pids"))
    env = {
        "FAKE_IMEX_CHILD": "1",
        "FAKE_IMEX_PIDFILE": str(pidfile),
        "FAKE_IMEX_EXIT_AFTER_S": "0.4",
        "FAKE_IMEX_EXIT_ONCE": node.path("once"),
    }
    async with node.supervisor(env) as sup:
        await sup.ensure_started()
        leader, child = await asyncio.to_thread(read_pids, pidfile)
        await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert gone(child)
        assert group_members(leader) == []


async def test_reloads_are_dropped_while_the_daemon_is_down(node: Node) -> None:
    """In BACKOFF there is nothing to signal: the next start reads the files anyway."""
    env = {"FAKE_IMEX_EXIT_AFTER_S": "0.1", "FAKE_IMEX_EXIT_CODE": "1"}
    settings = DaemonSettings(
        start_s=0.3, backoff_initial_s=2.0, backoff_max_s=2.0, stop_timeout_s=0.5
    )
    async with node.supervisor(env, settings=settings) as sup:
        await sup.ensure_started()
        await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert sup.request_reload("hosts changed") is False
        assert sup.status.reload_pending is False
        assert sup.reloads_sent == 0


async def test_restart_replaces_the_daemon_only_when_told(node: Node) -> None:
    """restart() stops the daemon and starts a new one at once; nothing else restarts it."""
    changes: list[DaemonStatus] = []
    async with node.supervisor(on_change=changes) as sup:
        first = (await sup.ensure_started()).pid
        assert first is not None
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        again = await sup.ensure_started()
        assert again.pid == first
        status = await sup.restart("config.cfg changed")
        assert status.state is DaemonState.STARTING
        assert status.pid not in (None, first)
        assert (status.restarts, status.crashes) == (0, 0), "planned: not a restart"
        assert gone(first)
    assert states(changes)[:5] == ["STARTING", "RUNNING", "STOPPING", "STOPPED", "STARTING"]


async def test_a_planned_stop_then_a_start_is_not_a_restart(node: Node) -> None:
    """A domain delete stops a RUNNING daemon and the next domain starts one: nothing
    crashed, so `restarts` (and ImexdDaemonRestarted) stays 0; a crash still counts."""
    async with node.supervisor() as sup:
        await sup.ensure_started()
        first = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        stopped = await sup.stop("the domain was deleted")
        assert (stopped.state, stopped.restarts) == (DaemonState.STOPPED, 0)
        await sup.ensure_started()
        second = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        assert second.pid != first.pid
        assert (second.restarts, second.crashes) == (0, 0)
        assert second.pid is not None
        os.kill(second.pid, signal.SIGKILL)
        third = await until(sup, lambda s: s.state is DaemonState.RUNNING and s.pid != second.pid)
        assert (third.restarts, third.crashes) == (1, 1)


async def test_a_matching_running_daemon_is_adopted_and_its_death_noticed(node: Node) -> None:
    """With adopt=True a daemon on our config keeps running (same pid) and is watched by pidfd."""
    outside = node.run_outside(node.config)
    with capture_logs() as logs:
        async with node.supervisor() as sup:
            status = await sup.ensure_started(adopt=True)
            assert (status.state, status.pid, status.adopted) == (
                DaemonState.RUNNING,
                outside.pid,
                True,
            )
            assert status.restarts == 0
            outside.kill()
            crashed = await until(sup, lambda s: s.state is DaemonState.BACKOFF)
            assert crashed.reason == "DaemonCrashed"
            assert crashed.detail.startswith(
                f"adopted daemon pid {outside.pid} exited (status unknown: not our child) after "
            )
            assert crashed.detail.endswith(", restart in 0.1 s; no output")
            status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
            assert status.pid != outside.pid
            assert (status.adopted, status.restarts) == (False, 1)
    adopted = next(e for e in logs if e["event"] == "daemon.adopted")
    assert adopted["output"].startswith("not streamed")


async def test_a_daemon_on_our_config_is_ended_as_a_stray_when_files_changed(
    node: Node,
) -> None:
    """Without adopt, a daemon running our config path is ended and ours started."""
    outside = node.run_outside(node.config)
    async with node.supervisor() as sup:
        status = await sup.ensure_started(adopt=False)
        assert status.state is DaemonState.STARTING
        assert status.pid != outside.pid
        assert outside.wait(timeout=5) == 0


async def test_a_conflicting_daemon_blocks_the_start_until_it_exits(node: Node) -> None:
    """A daemon on our address and port => STOPPED with ConflictingDaemon; start once it is gone."""
    other = node.root / "other" / "config.cfg"
    other.parent.mkdir()
    node.write_config(
        other, address=node.address, server_port=node.server_port, cmd_port=free_port()
    )
    outside = node.run_outside(other)
    async with node.supervisor() as sup:
        status = await sup.ensure_started()
        assert status.state is DaemonState.STOPPED
        assert status.pid is None
        assert status.reason == "ConflictingDaemon"
        assert status.detail.startswith(f"pid {outside.pid} (")
        assert f"uses {node.address}:{node.server_port} (SERVER_PORT in {other})" in status.detail
        assert status.next_start_at is not None
        await asyncio.sleep(0.5)
        assert sup.state is DaemonState.STOPPED
        assert sup.pid is None
        outside.terminate()
        status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        assert status.reason is None


def _run_in_mount_namespace(node: Node, theirs: Path, pidfile: Path) -> subprocess.Popen[bytes]:
    """The fake daemon on `node.config`, where its own mount namespace binds `theirs`."""
    script = f'mount --bind "{theirs}" "{node.config}" && exec "{node.binary}" -c "{node.config}"'
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env={**os.environ, "FAKE_IMEX_PIDFILE": str(pidfile)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    node.children.append(proc)
    return proc


@pytest.mark.skipif(
    not _can_unshare_mounts(), reason="needs root and unshare(1) to make a mount namespace"
)
async def test_a_daemon_of_another_container_on_our_path_blocks_the_start(node: Node) -> None:
    """As with hostPID: a daemon whose mount namespace has another file at our config path
    (another imexd pod's) is ConflictingDaemon; it is neither adopted nor ended."""
    theirs = node.root / "theirs.cfg"
    theirs.write_text(node.config.read_text())
    pidfile = node.root / "theirs.pid"
    proc = _run_in_mount_namespace(node, theirs, pidfile)
    [pid] = await asyncio.to_thread(read_pids, pidfile)
    assert pid == proc.pid
    async with node.supervisor() as sup:
        status = await sup.ensure_started(adopt=True)
        assert (status.state, status.reason) == (DaemonState.STOPPED, "ConflictingDaemon")
        assert status.detail.startswith(f"pid {pid} (")
        assert "from another mount namespace" in status.detail
        await asyncio.sleep(0.3)
        assert proc.poll() is None
        assert sup.pid is None
        proc.kill()
        await asyncio.to_thread(proc.wait, 5)
        status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        assert status.adopted is False


async def test_simulated_nodes_on_other_addresses_do_not_conflict(node: Node) -> None:
    """A daemon with the same ports on another loopback address is not in our way."""
    other = node.root / "other" / "config.cfg"
    other.parent.mkdir()
    node.write_config(
        other, address=loopback_address(), server_port=node.server_port, cmd_port=node.cmd_port
    )
    outside = node.run_outside(other)
    async with node.supervisor() as sup:
        status = await sup.ensure_started()
        assert status.state is DaemonState.STARTING
        assert outside.is_running()
    found = {p.pid: p for p in find_imex_processes()}
    assert found[outside.pid].config_path == str(other)


async def test_a_handed_over_daemon_survives_and_is_adopted_by_the_next_supervisor(
    node: Node,
) -> None:
    """detach() leaves the daemon running (its output still drained) for the next agent."""
    env = {"FAKE_IMEX_LOG_EVERY_S": "0.05"}
    async with node.supervisor(env) as sup:
        await sup.ensure_started()
        pid = (await until(sup, lambda s: s.state is DaemonState.RUNNING)).pid
        assert pid is not None
        sup.detach()
    assert (sup.state, sup.pid) == (DaemonState.RUNNING, pid)
    try:
        await asyncio.sleep(0.5)
        assert not gone(pid)
        async with node.supervisor() as nxt:
            status = await nxt.ensure_started(adopt=True)
            assert (status.state, status.pid, status.adopted) == (DaemonState.RUNNING, pid, True)
        assert nxt.state is DaemonState.STOPPED
        assert nxt.last_exit == "unknown (adopted)"
    finally:
        reap(pid)  # spawned by the first supervisor: still this test process's child


async def test_output_files_are_fresh_at_each_spawn_and_stay_bounded(node: Node) -> None:
    """A spawn truncates the output files; past output_max_bytes they are cut, lines still come."""
    out, err = (node.config.with_name(n) for n in ("nvidia-imex.out", "nvidia-imex.err"))
    err.write_text("[Jan 01 2026 00:00:00] [ERROR] [tid 1] old daemon line\n")
    env = {"FAKE_IMEX_LOG_EVERY_S": "0.001"}
    cap = 1024

    def heartbeats() -> list[MutableMapping[str, Any]]:
        return [e for e in logs if e["event"] == "daemon.output" and e["line"] == "heartbeat"]

    with capture_logs() as logs:
        async with node.supervisor(env, output_max_bytes=cap) as sup:
            await sup.ensure_started()
            assert out.exists()  # both streams go to files beside the config, fresh
            async with asyncio.timeout(10.0):
                while len(heartbeats()) < 5 * cap // 60:  # five files' worth
                    assert err.stat().st_size < cap + 16 * 1024
                    await asyncio.sleep(0.05)
    output = [e for e in logs if e["event"] == "daemon.output"]
    assert "old daemon line" not in [e["line"] for e in output]
    # never a line cut in two by a truncation: every stderr line parses whole
    assert all("tid" in e for e in output if e["stream"] == "stderr")


async def test_sim_output_is_still_logged_after_a_hand_over(sim: Node) -> None:
    """The next supervisor tails an adopted daemon's output files: its lines stay events."""
    async with sim.supervisor() as sup:
        await sup.ensure_started()
        pid = (await until(sup, lambda s: s.state is DaemonState.RUNNING)).pid
        assert pid is not None
        await asyncio.to_thread(wait_for, lambda: catches(pid, signal.SIGHUP))
        sup.detach()
    try:
        with capture_logs() as logs:
            async with sim.supervisor() as nxt:
                status = await nxt.ensure_started(adopt=True)
                assert (status.pid, status.adopted) == (pid, True)
                assert any("IMEX version" in line for line in status.last_lines)
                os.kill(pid, signal.SIGHUP)
                await until(nxt, lambda s: "Received SIGHUP" in s.last_lines[-1])
        adopted = next(e for e in logs if e["event"] == "daemon.adopted")
        assert adopted["output"] == "streamed"
        output = [e for e in logs if e["event"] == "daemon.output"]
        hup = next(e for e in output if e["line"].startswith("Received SIGHUP"))
        assert (hup["stream"], hup["pid"], hup["source"]) == ("stderr", pid, "nvidia-imex")
        assert not any(e["line"].startswith("IMEX version") for e in output)  # not replayed
    finally:
        reap(pid)


async def test_cancelling_the_owner_stops_the_daemon_and_the_cancel_propagates(
    node: Node,
) -> None:
    """A cancelled agent task leaves the context: the daemon is stopped, CancelledError kept."""
    started = asyncio.Event()
    pids: list[int] = []

    async def agent() -> None:
        async with node.supervisor() as sup:
            status = await sup.ensure_started()
            assert status.pid is not None
            pids.append(status.pid)
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(agent())
    async with asyncio.timeout(5.0):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone(pids[0])


async def test_commands_need_an_entered_supervisor(node: Node) -> None:
    """Using the supervisor outside its context is a clear error, not a hang."""
    sup = node.supervisor()
    with pytest.raises(RuntimeError, match="enter the Supervisor"):
        await sup.ensure_started()
    async with sup:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        sup.request_reload("late")


def test_relative_config_paths_are_refused(node: Node) -> None:
    """The config path identifies our daemon among all processes, so it must be absolute."""
    with pytest.raises(ValueError, match="absolute"):
        Supervisor(
            binary="nvidia-imex",
            config_path="run/config.cfg",
            env={},
            settings=FAST,
            reload_min_interval_s=6.0,
        )


# ---------------------------------------------------------------------------------
# The same behaviours against the simulator, the reference stand-in for nvidia-imex


def ctl_query(node: Node) -> str:
    """What `imexd-sim-ctl -c CONFIG -q` prints (the local daemon's state word)."""
    done = subprocess.run(
        [str(SIM_CTL), "-c", str(node.config), "-q"],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    )
    return done.stdout


async def test_sim_starts_to_ready_and_stops_gracefully(sim: Node) -> None:
    """The simulator started by the supervisor answers READY and exits 0 on SIGTERM."""
    async with sim.supervisor() as sup:
        await sup.ensure_started()
        pid = (await until(sup, lambda s: s.state is DaemonState.RUNNING)).pid
        assert pid is not None
        await asyncio.to_thread(wait_for, lambda: ctl_query(sim) == "READY\n")
        assert any("IMEX version" in line for line in sup.last_lines)
    assert (sup.state, sup.last_exit) == (DaemonState.STOPPED, "exit 0")
    assert gone(pid)


async def test_sim_crash_backs_off_and_restarts_with_the_restart_counted(sim: Node) -> None:
    """A simulated crash (IMEXD_SIM_EXIT_AFTER_S) => BACKOFF, then a counted restart."""
    env = {"IMEXD_SIM_EXIT_AFTER_S": "0.8", "IMEXD_SIM_EXIT_CODE": "7"}
    async with sim.supervisor(env) as sup:
        first = (await sup.ensure_started()).pid
        status = await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert status.reason == "DaemonCrashed"
        assert status.detail.startswith("exit 7 after ")
        assert "; last lines: " in status.detail
        assert status.last_exit == "exit 7"
        status = await until(sup, lambda s: s.pid not in (None, first))
        assert (status.restarts, status.crashes, status.start_failures) == (1, 1, 0)


async def test_sim_crash_loop_is_fatal_with_exit_code_and_last_stderr_line(sim: Node) -> None:
    """A simulator failing at start => FATAL; the reason holds `exit 3` and its last line."""
    env = {"IMEXD_SIM_EXIT_AFTER_S": "0", "IMEXD_SIM_EXIT_CODE": "3"}
    slow_start = dataclasses.replace(FAST, start_s=5.0)  # a loaded host is slow to even fail
    async with sim.supervisor(env, settings=slow_start) as sup:
        await sup.ensure_started()
        async with asyncio.timeout(20.0):
            status = await sup.wait_for(lambda s: s.state is DaemonState.FATAL)
    assert status.crashes == FAST.crash_loop_starts
    assert (status.start_failures, status.restarts) == (FAST.crash_loop_starts, 0)
    last = status.last_lines[-1]
    assert "Simulated failure at start: exiting with code 3" in last
    assert status.reason == "DaemonCrashLoop"
    assert status.detail.startswith("exit 3 after ")
    assert status.detail.endswith(quote_lines(status.last_lines))
    assert "Simulated failure at start: exiting with code 3" in status.detail


async def test_sim_ignoring_sigterm_is_killed_after_the_stop_timeout(sim: Node) -> None:
    """IMEXD_SIM_IGNORE_SIGTERM=1: stop() kills it with SIGKILL after stop_timeout_s."""
    async with sim.supervisor({"IMEXD_SIM_IGNORE_SIGTERM": "1"}) as sup:
        await sup.ensure_started()
        pid = (await until(sup, lambda s: s.state is DaemonState.RUNNING)).pid
        assert pid is not None
        # On a loaded host the simulator can still be importing when start_s is over
        await asyncio.to_thread(wait_for, lambda: catches(pid, signal.SIGTERM))
        began = time.monotonic()
        status = await sup.stop()
        took = time.monotonic() - began
    assert status.last_exit == "SIGKILL"
    assert FAST.stop_timeout_s <= took < FAST.stop_timeout_s + 3.0
    assert gone(pid)
    assert group_members(pid) == []


async def test_sim_reload_burst_at_the_default_window_is_never_ignored(sim: Node) -> None:
    """10 requests over 2 s => at most 2 SIGUSR1, all honoured by IMEX's 5 s window, last after."""
    siglog = sim.root / "signals"
    interval = ImexSettings().reload_min_interval_s
    assert interval == 6.0
    env = {"IMEXD_SIM_SIGNAL_LOG": str(siglog)}
    async with sim.supervisor(env, reload_min_interval_s=interval) as sup:
        await sup.ensure_started()
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        for i in range(10):
            assert sup.request_reload(f"hosts changed {i}")
            await asyncio.sleep(0.2)
        last_request = time.time()
        assert sup.status.reload_pending
        async with asyncio.timeout(interval + 3.0):
            status = await sup.wait_for(lambda s: not s.reload_pending)
        await asyncio.to_thread(wait_for, lambda: len(reloads(siglog)) == status.reloads_sent)
    sent = reloads(siglog)
    assert 1 <= len(sent) <= 2
    assert [verdict for _, _, verdict in sent] == ["honoured"] * len(sent)
    assert sent[-1][0] >= last_request - 0.01


async def test_sim_reloads_keep_their_distance_and_the_last_change_arrives(sim: Node) -> None:
    """With a 1 s IMEX window and 1.2 s pacing, a 2 s burst gives spaced, honoured signals."""
    siglog = sim.root / "signals"
    env = {"IMEXD_SIM_SIGNAL_LOG": str(siglog), "IMEXD_SIM_RELOAD_WINDOW_S": "1"}
    async with sim.supervisor(env, reload_min_interval_s=1.2) as sup:
        await sup.ensure_started()
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        for i in range(10):
            assert sup.request_reload(f"hosts changed {i}")
            await asyncio.sleep(0.2)
        last_request = time.time()
        async with asyncio.timeout(5.0):
            status = await sup.wait_for(lambda s: not s.reload_pending)
        await asyncio.to_thread(wait_for, lambda: len(reloads(siglog)) == status.reloads_sent)
    sent = reloads(siglog)
    assert len(sent) >= 2
    assert all(verdict == "honoured" for _, _, verdict in sent)
    times = [at for at, _, _ in sent]
    assert all(b - a >= 1.1 for a, b in itertools.pairwise(times))
    assert times[-1] >= last_request - 0.01


async def test_sim_matching_daemon_is_adopted_signalled_and_its_death_noticed(sim: Node) -> None:
    """A running simulator on our config is adopted (same pid), reloaded, and replaced on death."""
    siglog = sim.root / "signals"
    outside = sim.run_outside(sim.config, {"IMEXD_SIM_SIGNAL_LOG": str(siglog)})
    async with sim.supervisor(reload_min_interval_s=0.5) as sup:
        status = await sup.ensure_started(adopt=True)
        assert (status.state, status.pid, status.adopted) == (
            DaemonState.RUNNING,
            outside.pid,
            True,
        )
        assert sup.request_reload("hosts changed")
        await until(sup, lambda s: s.reloads_sent == 1)
        await asyncio.to_thread(wait_for, lambda: len(reloads(siglog)) == 1)
        assert reloads(siglog)[0][2] == "honoured"
        outside.kill()
        status = await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        assert status.last_exit == "unknown (adopted)"
        status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        assert status.pid != outside.pid
        assert (status.adopted, status.restarts) == (False, 1)


async def test_sim_stray_on_our_config_is_ended(sim: Node) -> None:
    """A simulator on our config whose files changed (adopt=False) is ended; ours runs."""
    outside = sim.run_outside(sim.config)
    async with sim.supervisor() as sup:
        status = await sup.ensure_started(adopt=False)
        assert status.pid not in (None, outside.pid)
        assert outside.wait(timeout=5) == 0
        await until(sup, lambda s: s.state is DaemonState.RUNNING)


async def test_sim_conflicting_daemon_blocks_the_start_until_it_is_gone(sim: Node) -> None:
    """A simulator on our address and SERVER_PORT blocks ours with ConflictingDaemon."""
    other = sim.root / "other" / "config.cfg"
    other.parent.mkdir()
    sim.write_config(other, address=sim.address, server_port=sim.server_port, cmd_port=free_port())
    outside = sim.run_outside(other)
    async with sim.supervisor() as sup:
        status = await sup.ensure_started()
        assert status.state is DaemonState.STOPPED
        assert status.reason == "ConflictingDaemon"
        assert status.detail.startswith(f"pid {outside.pid} (")
        assert "SERVER_PORT" in status.detail
        outside.terminate()
        status = await until(sup, lambda s: s.state is DaemonState.RUNNING)
        await asyncio.to_thread(wait_for, lambda: ctl_query(sim) == "READY\n")


async def test_sim_ready_makes_a_start_running_before_start_s(sim: Node) -> None:
    """start_s bounds a start: once ctl -q says READY, report_ready makes it RUNNING."""
    slow = dataclasses.replace(FAST, start_s=30.0, stable_s=60.0)
    async with sim.supervisor(settings=slow) as sup:
        started = time.monotonic()
        status = await sup.ensure_started()
        assert status.state is DaemonState.STARTING
        await asyncio.to_thread(wait_for, lambda: ctl_query(sim) == "READY\n", timeout=20.0)
        assert sup.report_ready()
        # Checked while start_s (30 s) has not elapsed.
        assert time.monotonic() - started < 30.0
        assert sup.state is DaemonState.RUNNING
        assert not sup.report_ready()  # RUNNING already: nothing to do


async def test_a_crash_after_an_early_ready_is_a_crash_of_a_running_daemon(node: Node) -> None:
    """A daemon RUNNING on READY that exits counts as a restart, not as a failed start."""
    slow = dataclasses.replace(FAST, start_s=30.0)
    env = {"FAKE_IMEX_EXIT_AFTER_S": "0.6", "FAKE_IMEX_EXIT_ONCE": node.path("once")}
    async with node.supervisor(env, settings=slow) as sup:
        first = (await sup.ensure_started()).pid
        assert sup.report_ready()
        await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        status = await until(sup, lambda s: s.pid not in (None, first))
        assert (status.restarts, status.crashes, status.start_failures) == (1, 1, 0)


async def test_without_ready_an_exit_inside_start_s_is_a_failed_start(node: Node) -> None:
    """The same exit with no READY reported is a start that failed, as before."""
    slow = dataclasses.replace(FAST, start_s=30.0)
    env = {"FAKE_IMEX_EXIT_AFTER_S": "0.6", "FAKE_IMEX_EXIT_ONCE": node.path("once")}
    async with node.supervisor(env, settings=slow) as sup:
        first = (await sup.ensure_started()).pid
        await until(sup, lambda s: s.state is DaemonState.BACKOFF)
        status = await until(sup, lambda s: s.pid not in (None, first))
        assert (status.restarts, status.crashes, status.start_failures) == (0, 1, 1)


# ---------------------------------------------------------------------------------
# The agent's probes of a supervised daemon (imexd.agent.probes), with a fake ctl


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeCtl(Prober):
    """A ctl that runs nothing: `ctl -q` says READY once `ready()` holds (INITIALIZING
    before), `ctl -N -j` shows member 0 alone, so member 1 never connects. Each call
    takes `took_s` and is recorded as (kind, start, end)."""

    ctl: str = "fake-ctl"
    config_path: str = "/run/imexd/config.cfg"
    ready: Callable[[], bool] = lambda: False
    took_s: float = 0.02
    calls: list[tuple[str, float, float]] = field(default_factory=list)

    async def local(self, *, timeout: float | None = None) -> LocalProbe:  # noqa: ASYNC109 - the Prober's signature
        started = time.monotonic()
        await asyncio.sleep(self.took_s)
        self.calls.append(("local", started, time.monotonic()))
        if self.ready():
            return LocalProbe(ImexState.READY, True, "", self.took_s)
        return LocalProbe(ImexState.INITIALIZING, False, "IMEX is INITIALIZING", self.took_s)

    async def domain(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the Prober's signature
        json_format: bool = True,
    ) -> DomainResult:
        started = time.monotonic()
        await asyncio.sleep(self.took_s)
        self.calls.append(("domain", started, time.monotonic()))
        alone = NodeStatus(0, "10.0.0.1", None, ImexState.READY, None, True, {0: C_LINK})
        return DomainResult(DomainTable(ImexDomainState.DEGRADED, "t", {0: alone}), "", 0.0)

    def count(self, kind: str, after: float = 0.0) -> int:
        """How many `kind` probes started at or after `after`."""
        return sum(1 for k, started, _ in self.calls if k == kind and started >= after)


C_LINK = ConnectionState.CONNECTED
TWO_MEMBERS = {0: "n1", 1: "n2"}
"""The members the daemon was given: member 1's link never shows (FakeCtl)."""


@asynccontextmanager
async def probed(
    node: Node,
    env: Mapping[str, str],
    settings: DaemonSettings,
    ctl: FakeCtl,
    binary: str | None = None,
) -> AsyncIterator[tuple[Supervisor, DaemonProbes]]:
    """A started daemon and the agent's probe task on it, wired as the agent wires them."""
    probes = DaemonProbes(
        Settings(daemon=settings),
        ctl,
        metrics=Metrics(),
        log=get_logger("test"),
        on_change=lambda: None,
    )
    seen = [(DaemonState.STOPPED, 0)]

    def changed(status: DaemonStatus) -> None:
        before, seen[0] = seen[0], (status.state, status.reloads_sent)
        probes.on_daemon_change(status, before)

    heartbeats = Heartbeats()
    heartbeats.register("probe", BEAT_S)
    guard = Guard(heartbeats, Metrics(), get_logger("test"))
    async with node.supervisor(env, settings=settings, on_change=changed, binary=binary) as sup:
        task = asyncio.create_task(
            probes.run(guard, sup, wanted=lambda: True, members=lambda: TWO_MEMBERS)
        )
        try:
            await sup.ensure_started()
            yield sup, probes
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


QUIET_TIMERS = dataclasses.replace(
    FAST, start_s=30.0, stable_s=60.0, probe_interval_s=30.0, domain_probe_interval_s=600.0
)
"""Timers no test waits for: whatever happens sooner came from the daemon's words."""


async def test_the_daemons_ready_line_makes_a_start_running_without_ctl(node: Node) -> None:
    """The daemon's own `state changed from ... to READY` line makes a start RUNNING, and
    its state READY, though `ctl -q` never said READY (and `start_s` is 30 s away); the
    detail says the line did it, and the domain probes begin."""
    ctl = FakeCtl()
    env = {"FAKE_IMEX_READY_AFTER_S": "0.3"}
    with capture_logs() as logs:
        async with probed(node, env, QUIET_TIMERS, ctl) as (sup, probes):
            await until(sup, lambda s: s.state is DaemonState.RUNNING)
            await support.until(lambda: ctl.count("domain"), within=5.0)  # the series' first
            assert probes.imex_status == "READY"
            assert probes.probe_error == ""
    running = [e for e in logs if e["event"] == "daemon.state" and e["to"] == "RUNNING"]
    assert [e["reason"] for e in running] == ["its output says READY"]


async def test_the_ready_line_leaves_ctl_q_to_its_interval(node: Node) -> None:
    """No `ctl -q` follows the READY line: the next waits for `probe_interval_s`, and its
    answer stays the truth (INITIALIZING here is the daemon's state again)."""
    ctl = FakeCtl()
    timers = dataclasses.replace(QUIET_TIMERS, probe_interval_s=1.0)
    env = {"FAKE_IMEX_READY_AFTER_S": "0.3"}
    async with probed(node, env, timers, ctl) as (sup, probes):
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        said = time.monotonic()
        assert probes.imex_status == "READY"
        await asyncio.sleep(0.5)
        assert ctl.count("local", said) == 0
        await support.until(lambda: probes.imex_status != "READY", within=5.0)
        assert probes.imex_status == "INITIALIZING"
        assert sup.state is DaemonState.RUNNING  # a later not-READY is the probes' to report


async def test_a_daemon_without_a_ready_line_is_running_by_ctl(node: Node) -> None:
    """A daemon that prints no READY line is RUNNING once `ctl -q` says READY: its lines
    ask for a probe while it is starting."""
    ctl = FakeCtl(ready=lambda: True)
    with capture_logs() as logs:
        async with probed(node, {}, QUIET_TIMERS, ctl) as (sup, probes):
            await until(sup, lambda s: s.state is DaemonState.RUNNING)
            assert probes.imex_status == "READY"
    running = [e for e in logs if e["event"] == "daemon.state" and e["to"] == "RUNNING"]
    assert [e["reason"] for e in running] == ["ctl -q says READY"]


async def test_a_silent_start_is_probed_on_the_series_not_at_its_spawn(
    node: Node, tmp_path: Path
) -> None:
    """A daemon that prints nothing (no READY line) is asked on PROBE_SERIES_S after its
    spawn (0.2, 0.5, 1 s, ...), not at the spawn itself and not a whole probe interval
    (30 s here) later: RUNNING by ctl soon after it says READY, though `start_s` is 30 s
    away."""
    script = tmp_path / "silent-daemon"
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    script.chmod(0o755)
    said = [False]
    ctl = FakeCtl(ready=lambda: said[0])
    spawned = time.monotonic()
    async with probed(node, {}, QUIET_TIMERS, ctl, binary=str(script)) as (sup, _):
        assert sup.state is DaemonState.STARTING
        await support.until(lambda: ctl.count("local") >= 2, within=5.0)
        starts = sorted(started - spawned for _, started, _ in ctl.calls)
        assert starts[0] >= PROBE_SERIES_S[0] - 0.05, ctl.calls
        said[0] = True
        asked = time.monotonic()
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        assert time.monotonic() - asked < PROBE_SERIES_S[-1] + 1.0


async def test_a_chatty_daemon_does_not_run_domain_probes_back_to_back(node: Node) -> None:
    """A READY daemon that writes a line every 20 ms while a member is missing (the real
    one logs every reconnect attempt): its lines ask for a `ctl -N -j` only between the
    timed ones (the series after READY), never two in a row."""
    ctl = FakeCtl(ready=lambda: True)
    env = {"FAKE_IMEX_READY_AFTER_S": "0.2", "FAKE_IMEX_LOG_EVERY_S": "0.02"}
    async with probed(node, env, QUIET_TIMERS, ctl) as (sup, probes):
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        await support.until(lambda: probes.imex_status == "READY", within=5.0)
        ready = time.monotonic()
        await asyncio.sleep(1.6)  # the series' probes at 0.2, 0.5 and 1.0 s
        domain = ctl.count("domain", ready)
        assert 2 <= domain <= 8, f"{domain} ctl -N -j in 1.6 s: {ctl.calls}"  # 3 timed, 4 more
        assert ctl.count("local", ready) == 0


async def test_a_chatty_daemon_that_is_not_ready_costs_one_more_ctl_q_per_interval(
    node: Node,
) -> None:
    """A daemon RUNNING by `start_s` but not READY, writing a line every 20 ms: between two
    timed `ctl -q` (`probe_interval_s`), its lines ask for one more, not one per line."""
    ctl = FakeCtl()
    timers = dataclasses.replace(QUIET_TIMERS, start_s=0.3, probe_interval_s=0.5)
    env = {"FAKE_IMEX_LOG_EVERY_S": "0.02"}
    async with probed(node, env, timers, ctl) as (sup, _):
        await until(sup, lambda s: s.state is DaemonState.RUNNING)
        running = time.monotonic()
        await asyncio.sleep(2.0)
        local = ctl.count("local", running)
        assert 2 <= local <= 12, f"{local} ctl -q in 2 s: {ctl.calls}"  # 5 timed, 5 more
