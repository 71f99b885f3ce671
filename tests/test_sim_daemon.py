"""The simulator as real processes: daemons on loopback addresses, observed through the ctl.

Each simulated node gets its own 127.x.y.z address, run folder, hosts file and state
folder, exactly as the agent's scenario tests and the demo will lay them out. Every
wait is bounded; every process started here is ended here, by its pid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imexd.demo.brokers import free_port
from imexd.sim.cfgfile import USAGE
from imexd.sim.command import CmdTarget, CommandError
from imexd.sim.protocol import StatusReply, StatusRequest, ask_blocking
from tests.support import loopback_address, wait_for

FIXTURES = Path(__file__).parent / "fixtures" / "imex"
BIN = Path(sys.executable).parent
LOG_LINE = re.compile(r"^\[\w{3} \d{2} \d{4} \d{2}:\d{2}:\d{2}\] \[[A-Z]+\] \[tid \d+\] .+$")


def tool(name: str, module: str) -> list[str]:
    """The installed console script, or the module when the scripts are not installed."""
    script = BIN / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


DAEMON = tool("imexd-sim-daemon", "imexd.sim.daemon")
CTL = tool("imexd-sim-ctl", "imexd.sim.ctl")


class SimNode:
    """One simulated node: its files, its environment and its daemon process."""

    def __init__(self, root: Path, index: int, address: str, cluster: SimCluster) -> None:
        self.root = root
        self.index = index
        self.address = address
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True)
        self.config = root / "config.cfg"
        self.nodes_file = root / "nodes_config.cfg"
        self.hosts = root / "hosts"
        self.log = root / "imex.log"
        self.state_dir = root / "state"
        self.state_dir.mkdir()
        self.signal_log = root / "signals.log"
        self.output = root / "output.log"
        self.env: dict[str, str] = {
            "IMEXD_SIM_HOSTS_FILE": str(self.hosts),
            "IMEXD_SIM_STATE_DIR": str(self.state_dir),
            "IMEXD_SIM_SIGNAL_LOG": str(self.signal_log),
        }

    def write_config(self, **overrides: str) -> None:
        keys = {
            "LOG_LEVEL": "4",
            "LOG_FILE_NAME": str(self.log),
            "DAEMONIZE": "0",
            "BIND_INTERFACE_IP": self.address,
            "SERVER_PORT": str(self.cluster.server_port),
            "IMEX_NODE_CONFIG_FILE": str(self.nodes_file),
            "IMEX_WAIT_FOR_QUORUM": "RECOVERY",
            "IMEX_CMD_ENABLED": "1",
            "IMEX_CMD_BIND_INTERFACE_IP": self.address,
            "IMEX_CMD_PORT": str(self.cluster.cmd_port),
            "IMEX_NODE_DISCONNECTED_GRACE_TIME": "-1",
        } | overrides
        self.config.write_text("".join(f"{k}={v}\n" for k, v in keys.items()))

    def write_hosts(self, mapping: dict[str, str]) -> None:
        self.hosts.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in mapping.items())
        )

    def start(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        with self.output.open("ab") as out:
            self.proc = subprocess.Popen(
                [*DAEMON, "-c", str(self.config), *args],
                env=os.environ | self.env | env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.cluster.procs.append(self.proc)
        return self.proc

    @property
    def start_pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def ctl(self, *args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
        return self.ctl_plain("-c", str(self.config), *args, timeout=timeout)

    def ctl_plain(self, *args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CTL, *args],
            env=os.environ | self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def state(self) -> str:
        return self.ctl("-q", "-t", "1000").stdout.strip()

    def domain(self, *args: str) -> str:
        result = self.ctl("-N", "-t", "1000", *args)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def signals(self) -> list[tuple[float, str, str]]:
        lines = self.signal_log.read_text().splitlines() if self.signal_log.exists() else []
        return [(float(t), name, verdict) for t, name, verdict in (ln.split() for ln in lines)]


class SimCluster:
    """`size` nodes named imex-abc-0000..., each on its own loopback address."""

    def __init__(self, root: Path, size: int, *, prefix: str = "imex-abc") -> None:
        self.server_port = free_port()
        self.cmd_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names = [f"{prefix}-{i:04d}" for i in range(size)]
        self.nodes = [SimNode(root / f"n{i}", i, loopback_address(), self) for i in range(size)]
        self.mapping = {n.address: name for n, name in zip(self.nodes, self.names, strict=True)}
        for node in self.nodes:
            node.write_config()
            node.nodes_file.write_text("".join(f"{name}\n" for name in self.names))
            node.write_hosts(
                {name: n.address for n, name in zip(self.nodes, self.names, strict=True)}
            )

    def __getitem__(self, index: int) -> SimNode:
        return self.nodes[index]

    def start_all(self, **env: str) -> None:
        for node in self.nodes:
            node.start(**env)
        for node in self.nodes:
            wait_for(lambda n=node: n.state() == "READY", timeout=15)  # type: ignore[misc]

    def wait_domain(self, index: int, status: str, timeout: float = 10.0) -> str:
        """`-N` of node `index` once its Domain State is `status`."""
        seen: list[str] = []

        def check() -> bool:
            seen[:] = [self.nodes[index].domain()]
            return seen[0].endswith(f"Domain State: {status}\n")

        wait_for(check, timeout=timeout, interval=0.1)
        return seen[0]

    def close(self) -> None:
        """SIGKILL whatever is left, by pid, and reap it."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[list[SimCluster]]:
    """A list to append clusters to; they are all torn down after the test."""
    clusters: list[SimCluster] = []
    yield clusters
    for cluster in clusters:
        cluster.close()


def cluster_of(clusters: list[SimCluster], root: Path, size: int) -> SimCluster:
    cluster = SimCluster(root, size)
    clusters.append(cluster)
    return cluster


def matrix(text: str) -> dict[int, list[str]]:
    """Rows of the `-N` matrix: node id -> cells."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(" Nodes From\\To"))
    rows: dict[int, list[str]] = {}
    for line in lines[start + 1 :]:
        if line.startswith("Domain State:"):
            break
        first, *cells = line.split()
        rows[int(first)] = cells
    return rows


def node_lines(text: str) -> dict[int, str]:
    return {int(ln.split()[1][1:]): ln for ln in text.splitlines() if ln.startswith("Node #")}


# Whole-domain behaviour


def test_three_nodes_up_then_degraded_then_up_again(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """All READY and UP; a SIGKILLed node turns UNAVAILABLE with a row of I; it comes back."""
    cluster = cluster_of(make_cluster, tmp_path, 3)
    cluster.start_all()
    text = cluster.wait_domain(0, "UP")
    legend = (FIXTURES / "ctl-N-570.172.txt").read_text().splitlines()[:9]
    assert text.splitlines()[:9] == legend
    lines = node_lines(text)
    assert lines[0].startswith(f"Node #0   * {cluster[0].address} *")
    assert re.search(r"- READY\s+- Version: 570\.172$", lines[2])
    assert matrix(text) == {i: ["C", "C", "C"] for i in range(3)}

    doc = json.loads(cluster[1].domain("-j"))
    assert doc["status"] == "UP"
    assert doc["nodes"]["2"]["hostName"] == "imex-abc-0002"
    assert doc["nodes"]["2"]["host"] == cluster[2].address
    assert "Node #1   * imex-abc-0001 *" in cluster[1].domain("-H")

    cluster[2].signal(signal.SIGKILL)
    cluster[2].wait()
    text = cluster.wait_domain(0, "DEGRADED")
    assert "UNAVAILABLE" in node_lines(text)[2]
    rows = matrix(text)
    assert rows[2] == ["I", "I", "I"]
    wait_for(lambda: matrix(cluster[0].domain())[0][2] == "R", timeout=5)
    assert "Node disconnect event detected for node 2" in cluster[0].log_text()

    cluster[2].start()
    cluster.wait_domain(0, "UP")
    assert "reconnected as a new instance" in cluster[0].log_text()
    assert "Recovery complete" in cluster[2].log_text()

    cluster[2].signal(signal.SIGTERM)
    assert cluster[2].wait() == 0
    wait_for(lambda: "Node 2 (imex-abc-0002) is shutting down" in cluster[0].log_text())
    wait_for(lambda: matrix(cluster[0].domain())[0][2] == "D", timeout=5)
    for node in cluster.nodes[:2]:
        node.signal(signal.SIGTERM)
        assert node.wait() == 0


def test_a_different_node_list_is_a_node_map_mismatch(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """A node whose list differs is `!M!` both ways, and the domain is DEGRADED."""
    cluster = cluster_of(make_cluster, tmp_path, 3)
    cluster[2].nodes_file.write_text("".join(f"{n}\n" for n in [*cluster.names, "imex-abc-0003"]))
    cluster.start_all()
    text = cluster.wait_domain(0, "DEGRADED")
    wait_for(lambda: matrix(cluster[0].domain())[0] == ["C", "C", "!M!"], timeout=5)
    wait_for(lambda: matrix(cluster[0].domain())[2][:2] == ["!M!", "!M!"], timeout=5)
    doc = json.loads(cluster[0].domain("-j"))
    assert doc["nodes"]["0"]["connections"]["2"]["status"] == "NODE_MAP_MISMATCH"
    assert "Node map mismatch" in cluster[0].log_text()
    assert "READY" in node_lines(text)[2]


def test_sigusr1_pacing_rereads_names_and_sighup_reloads_nothing(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """SIGUSR1 re-resolves at most once per window (from the last honoured one)."""
    cluster = cluster_of(make_cluster, tmp_path, 2)
    names = cluster.names
    cluster[0].write_hosts({names[0]: cluster[0].address, names[1]: "127.0.0.2"})
    cluster.start_all(IMEXD_SIM_RELOAD_WINDOW_S="1")
    text = cluster.wait_domain(0, "DEGRADED")
    assert matrix(text)[0] == ["C", "N"]
    assert "UNAVAILABLE" in node_lines(text)[1]

    cluster[0].write_hosts({names[0]: cluster[0].address, names[1]: cluster[1].address})
    start = time.monotonic()
    for at in (0.0, 0.3, 1.5):
        time.sleep(max(0.0, start + at - time.monotonic()))
        cluster[0].signal(signal.SIGUSR1)
    cluster.wait_domain(0, "UP")
    wait_for(lambda: len(cluster[0].signals()) == 3, timeout=5)
    (t0, n0, v0), (t1, n1, v1), (t2, n2, v2) = cluster[0].signals()
    assert (n0, n1, n2) == ("SIGUSR1", "SIGUSR1", "SIGUSR1")
    assert (v0, v1, v2) == ("honoured", "ignored", "honoured")
    assert t1 - t0 < 1.0 <= t2 - t0
    assert cluster[0].log_text().count("Reloading: re-resolving host names") == 2
    assert "now resolves to " + cluster[1].address in cluster[0].log_text()

    cluster[0].signal(signal.SIGHUP)
    wait_for(lambda: len(cluster[0].signals()) == 4, timeout=5)
    assert cluster[0].signals()[-1][1:] == ("SIGHUP", "honoured")
    assert cluster[0].state() == "READY"
    assert cluster[0].domain().endswith("Domain State: UP\n")
    assert cluster[0].log_text().count("Reloading: re-resolving host names") == 2

    cluster[0].signal(signal.SIGTERM)
    assert cluster[0].wait() == 0
    assert cluster[0].signals()[-1][1:] == ("SIGTERM", "honoured")
    assert "Node 0 (imex-abc-0000) is shutting down" in cluster[1].log_text()


def test_unclean_exit_waits_for_recovery_unless_the_list_changed(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """After SIGKILL: WAITING_FOR_RECOVERY until the timeout; a new list discards it."""
    cluster = cluster_of(make_cluster, tmp_path, 2)
    cluster.start_all()
    cluster.wait_domain(0, "UP")
    for node in cluster.nodes:
        node.signal(signal.SIGKILL)
        node.wait()
    # 5 s of recovery: long enough to be seen on a loaded machine, where starting the
    # simulator and asking its state can take seconds (1.5 s was missed at load 13).
    cluster[0].start(IMEXD_SIM_RECOVERY_TIMEOUT_S="5")
    wait_for(lambda: cluster[0].state() == "WAITING_FOR_RECOVERY", timeout=20)
    wait_for(lambda: cluster[0].state() == "READY", timeout=20)
    assert "Recovery timed out" in cluster[0].log_text()

    cluster[0].signal(signal.SIGKILL)
    cluster[0].wait()
    cluster[0].nodes_file.write_text("".join(f"{n}\n" for n in [*cluster.names, "spare"]))
    cluster[0].start(IMEXD_SIM_RECOVERY_TIMEOUT_S="30")
    wait_for(lambda: cluster[0].state() == "READY", timeout=20)
    assert "discarding recovery data" in cluster[0].log_text()


# Start-up failures and the exact messages


def test_missing_node_file_is_the_real_message(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """`Failed to read node configuration file <path>`, exit 1."""
    cluster = cluster_of(make_cluster, tmp_path, 1)
    cluster[0].nodes_file.unlink()
    proc = cluster[0].start()
    assert proc.wait(timeout=10) == 1
    message = f"Failed to read node configuration file {cluster[0].nodes_file}"
    assert message in cluster[0].output.read_text().splitlines()
    assert message in cluster[0].log_text()


def test_no_matching_interface_is_the_real_message(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """No entry resolves to BIND_INTERFACE_IP: the real message, exit 1."""
    cluster = cluster_of(make_cluster, tmp_path, 1)
    cluster[0].write_config(BIND_INTERFACE_IP=loopback_address())
    proc = cluster[0].start()
    assert proc.wait(timeout=10) == 1
    expected = (
        "No matching network interface found for any IP addresses in the node "
        f"configuration file {cluster[0].nodes_file}."
    )
    assert expected in cluster[0].output.read_text().splitlines()


def test_empty_log_file_name_logs_to_stderr_after_the_real_preamble(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """LOG_FILE_NAME empty: the two preamble lines, then IMEX-format lines on stderr."""
    cluster = cluster_of(make_cluster, tmp_path, 1)
    node = cluster[0]
    node.write_config(LOG_FILE_NAME="")
    node.start("--nogpu")
    wait_for(lambda: node.state() == "READY")
    node.signal(signal.SIGTERM)
    assert node.wait() == 0
    lines = node.output.read_text().splitlines()
    messages = (FIXTURES / "messages.txt").read_text().splitlines()
    assert lines[:2] == [messages[2], messages[3]]
    assert lines[2].startswith("IMEX Log initializing at: ")
    assert all(LOG_LINE.match(ln) for ln in lines[3:])
    sample = (FIXTURES / "daemon-log-580.159.04.txt").read_text().splitlines()
    assert all(LOG_LINE.match(ln) for ln in sample[1:])
    assert "IMEX version 570.172 is running with the following configuration options:" in lines[3]
    assert any(
        ln.endswith("Treating node config entry 'imex-abc-0000' as a host name.") for ln in lines
    )


def test_empty_bind_ip_finds_the_local_entry_and_port_flag_wins(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """BIND_INTERFACE_IP empty: the entry on a local interface; `-p` overrides the port."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    node.nodes_file.write_text("127.0.0.2\n127.0.0.1\n")
    node.write_config(BIND_INTERFACE_IP="", IMEX_CMD_BIND_INTERFACE_IP="127.0.0.1")
    port = free_port()
    node.start("-p", str(port), "--nogpu")
    wait_for(lambda: node.state() == "READY")
    assert "Identified this node as ID 1, using bind IP of '127.0.0.1'" in node.log_text()
    assert f"IMEX server listening on 127.0.0.1:{port}" in node.log_text()
    doc = json.loads(node.domain("-j"))
    assert doc["nodes"]["1"]["version"] == "NO_GPU"
    assert doc["nodes"]["0"]["connections"]["0"]["status"] == "INVALID"
    assert doc["nodes"]["1"]["connections"]["0"]["status"] == "NEVER_CONNECTED"
    assert doc["status"] == "DEGRADED"


def test_version_flag_and_version_override() -> None:
    """`--version` prints the real sentence; IMEXD_SIM_VERSION changes the version."""
    result = subprocess.run(
        [*DAEMON, "--version"],
        env=os.environ | {"IMEXD_SIM_VERSION": "570.148.08"},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "IMEX version is: 570.148.08\n")


def test_ctl_without_config_prints_the_real_message_and_usage(tmp_path: Path) -> None:
    """`Unable to open configuration file at <path>` plus the usage line, exit 1."""
    path = tmp_path / "absent.cfg"
    result = subprocess.run(
        [*CTL, "-c", str(path), "-q"], capture_output=True, text=True, timeout=10, check=False
    )
    usage = (FIXTURES / "ctl-usage.txt").read_text()
    assert usage == USAGE + "\n"
    assert result.returncode == 1
    assert result.stderr == f"Unable to open configuration file at {path}\n" + usage
    bad = subprocess.run([*CTL, "-x"], capture_output=True, text=True, timeout=10, check=False)
    assert bad.returncode == 1
    assert bad.stderr.endswith(usage)


def test_ctl_against_nothing_fails_fast() -> None:
    """No daemon: `-q` prints UNAVAILABLE and a reason, exit 1; `-N` exits 1."""
    target = [loopback_address(), str(free_port())]
    query = subprocess.run(
        [*CTL, "-i", *target, "-q"], capture_output=True, text=True, timeout=10, check=False
    )
    assert (query.returncode, query.stdout) == (1, "UNAVAILABLE\n")
    assert query.stderr
    domain = subprocess.run(
        [*CTL, "-i", *target, "-N", "-j"], capture_output=True, text=True, timeout=10, check=False
    )
    assert (domain.returncode, domain.stdout) == (1, "")


# Fault injection


def test_exit_at_start_prints_an_imex_error_line(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """IMEXD_SIM_EXIT_AFTER_S=0: one IMEX-format error line, then the chosen code."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    proc = node.start(IMEXD_SIM_EXIT_AFTER_S="0", IMEXD_SIM_EXIT_CODE="7")
    assert proc.wait(timeout=10) == 7
    (line,) = node.output.read_text().splitlines()
    assert LOG_LINE.match(line)
    assert "[ERROR]" in line


def test_identify_as_falsifies_only_the_identity_line(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """Every node logs `Identified this node as ID <its index>` in IMEX's format;
    IMEXD_SIM_IDENTIFY_AS logs another id (the node still serves as its own entry)."""
    cluster = cluster_of(make_cluster, tmp_path, 2)
    cluster[0].start()
    cluster[1].start(IMEXD_SIM_IDENTIFY_AS="5")
    wait_for(lambda: cluster[0].state() == cluster[1].state() == "READY")
    for index, said in ((0, 0), (1, 5)):
        lines = [line for line in cluster[index].log_text().splitlines() if "Identified" in line]
        assert len(lines) == 1
        assert LOG_LINE.match(lines[0])
        assert f"] Identified this node as ID {said}, using bind IP of '" in lines[0]


def test_exit_and_abort_after_a_while(tmp_path: Path, make_cluster: list[SimCluster]) -> None:
    """IMEXD_SIM_EXIT_AFTER_S exits with IMEXD_SIM_EXIT_CODE; ABORT_AFTER_S dies by SIGABRT."""
    cluster = cluster_of(make_cluster, tmp_path, 2)
    cluster[0].start(IMEXD_SIM_EXIT_AFTER_S="0.8", IMEXD_SIM_EXIT_CODE="3")
    cluster[1].start(IMEXD_SIM_ABORT_AFTER_S="0.8")
    assert cluster[0].wait() == 3
    assert cluster[1].wait() == -signal.SIGABRT


def test_ignored_sigterm_needs_sigkill(tmp_path: Path, make_cluster: list[SimCluster]) -> None:
    """IMEXD_SIM_IGNORE_SIGTERM=1: SIGTERM is logged as ignored; only SIGKILL ends it."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    node.start(IMEXD_SIM_IGNORE_SIGTERM="1")
    wait_for(lambda: node.state() == "READY")
    node.signal(signal.SIGTERM)
    wait_for(lambda: bool(node.signals()), timeout=5)
    assert node.signals()[-1][1:] == ("SIGTERM", "ignored")
    with pytest.raises(subprocess.TimeoutExpired):
        node.wait(timeout=0.5)
    assert node.state() == "READY"
    node.signal(signal.SIGKILL)
    assert node.wait() == -signal.SIGKILL


def test_a_hung_command_service_times_out_quickly(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """IMEXD_SIM_CMD_HANG=1: `-q -t 500` gives up after about half a second, exit 1."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    node.start(IMEXD_SIM_CMD_HANG="1")
    wait_for(lambda: "READY" in node.log_text())
    started = time.monotonic()
    result = node.ctl("-q", "-t", "500")
    assert result.returncode == 1
    assert result.stdout == "UNAVAILABLE\n"
    assert time.monotonic() - started < 2.5


def test_slow_start_is_initializing_first(tmp_path: Path, make_cluster: list[SimCluster]) -> None:
    """IMEXD_SIM_START_DELAY_S: INITIALIZING (with the command service up), then READY."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    node.start(IMEXD_SIM_START_DELAY_S="1.5")
    wait_for(lambda: node.state() == "INITIALIZING", timeout=5)
    wait_for(lambda: node.state() == "READY", timeout=5)


# Other ways in


def status_over(sock: Path) -> StatusReply | None:
    """The daemon's status through its Unix command socket, or None when not there."""
    try:
        reply = ask_blocking(CmdTarget(path=str(sock)), StatusRequest(), timeout_s=1)
    except CommandError:
        return None
    return reply if isinstance(reply, StatusReply) else None


def test_daemonize_and_unix_command_socket(tmp_path: Path, make_cluster: list[SimCluster]) -> None:
    """DAEMONIZE=1 forks into the background (exit 0); `-u PATH` reaches it."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    sock = tmp_path / "cmd.sock"
    node.write_config(DAEMONIZE="1", IMEX_CMD_UNIX_DOMAIN_PATH=str(sock))
    assert node.start().wait(timeout=10) == 0
    wait_for(lambda: status_over(sock) is not None)
    reply = status_over(sock)
    assert reply is not None
    try:
        assert reply.pid != node.start_pid
        wait_for(lambda: node.ctl_plain("-u", str(sock), "-q").stdout == "READY\n")
    finally:
        os.kill(reply.pid, signal.SIGTERM)
    wait_for(lambda: not sock.exists())


def test_monitor_mode_repeats_until_interrupted(
    tmp_path: Path, make_cluster: list[SimCluster]
) -> None:
    """`-n` prints the domain every second and exits 0 on SIGTERM."""
    node = cluster_of(make_cluster, tmp_path, 1)[0]
    node.start()
    wait_for(lambda: node.state() == "READY")
    out = tmp_path / "monitor.txt"
    with out.open("wb") as sink:
        monitor = subprocess.Popen(
            [*CTL, "-c", str(node.config), "-n"], env=os.environ | node.env, stdout=sink
        )
    try:
        wait_for(lambda: out.read_text().count("Domain State: UP") >= 2, timeout=10)
    finally:
        monitor.send_signal(signal.SIGTERM)
        assert monitor.wait(timeout=10) == 0


def test_the_daemon_program_runs_without_openssl() -> None:
    """`imexd-sim-daemon` speaks no TLS: its entry point keeps ssl out of the process, so
    asyncio does not load OpenSSL at each simulated daemon's start, and the
    installed script is that entry point."""
    probe = (
        "import sys\n"
        "sys.argv = ['imexd-sim-daemon', '--version']\n"
        "from imexd.sim import daemon_main\n"
        "code = daemon_main()\n"
        "import asyncio.sslproto\n"
        "print(code, asyncio.sslproto.ssl is None, '_ssl' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.splitlines()[-1] == "0 True False", done.stdout + done.stderr
    assert done.stdout.startswith("IMEX version is: ")
    script = BIN / "imexd-sim-daemon"
    if script.exists():
        assert "from imexd.sim import daemon_main" in script.read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["-c", "/run/a/config.cfg"],
        ["--config", "/run/a/config.cfg"],
        ["-c", "/run/a/config.cfg", "--nogpu"],
        ["-p", "50010", "-c", "/run/a/config.cfg"],
        ["--version"],
        [],
    ],
)
def test_the_daemons_command_line_reads_the_same_with_and_without_argparse(
    argv: list[str],
) -> None:
    """The agent's form (`-c CONFIG`) is read by hand, and means what the parser makes of
    it; every other form goes to the parser."""
    from imexd.sim import daemon

    by_hand = daemon._agents_form(argv)
    assert by_hand is None or by_hand == daemon._parsed(argv)
    assert (by_hand is not None) == (len(argv) == 2)  # the first two forms only
    assert daemon._parse(argv) == daemon._parsed(argv)


def test_a_daemon_started_as_the_agent_starts_it_imports_no_argparse() -> None:
    """`imexd-sim-daemon -c CONFIG` reads its command line without argparse."""
    code = (
        "import sys; from imexd.sim import daemon; "
        "daemon._parse(['-c', '/run/a/config.cfg']); print('argparse' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"
