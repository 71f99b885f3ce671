"""The systemd unit: `systemd-analyze verify`, and the settings its exits depend on.

`systemd-analyze verify` checks that ExecStart's binary exists, so the unit is verified
from a copy in a temporary folder whose ExecStart names this virtual environment's
`imexd`, next to a stub `nvidia-imex.service` for Conflicts= (verify also reads the
folders of the files it is given). Its messages go to stderr; the only lines ignored
are those about unit files of the host's own unit folders that do not name imexd
(a container's or a distribution's broken units are not ours to fix).
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from imexd.cli.main import build_parser
from imexd.settings import (
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    SHUTDOWN_MARGIN_S,
    UNIT_TIMEOUT_STOP_S,
    iter_settings,
)
from tests.support import wait_for

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "imexd.service"
ENV_EXAMPLE = ROOT / "systemd" / "imexd.env"
DOC = ROOT / "docs" / "systemd.md"

HANDOVER_EXIT = 75
"""The agent's exit status after SIGUSR2 (hand-over): EX_TEMPFAIL, restarted by systemd."""
CONFIG_ERROR_EXIT = 2
"""`imexd run` exits 2 on an invalid configuration (imexd/cli/main.py): no restart helps."""
IMEX_PERSIST_DIR = "/run/nvidia-imex"
"""Where nvidia-imex keeps persist.dat (as /var/run/nvidia-imex) for its recovery."""
HOST_UNIT_DIRS = ("/lib/systemd/", "/usr/lib/systemd/", "/etc/systemd/", "/run/systemd/")

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(text: str) -> Unit:
    """Sections of a unit file as ordered (key, value) lists; repeated keys are kept."""
    unit: Unit = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            unit.setdefault(section, [])
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a KEY=value line: {raw!r}"
        unit[section].append((key.strip(), value.strip()))
    return unit


def values(unit: Unit, section: str, key: str) -> list[str]:
    """Every value of a key, each space-separated list split into words."""
    return [word for k, v in unit.get(section, []) if k == key for word in v.split()]


def single(unit: Unit, section: str, key: str) -> str:
    found = [v for k, v in unit.get(section, []) if k == key]
    assert len(found) == 1, f"[{section}] {key}= set {len(found)} times, expected once"
    return found[0]


def seconds(span: str) -> float:
    """A systemd time span (`30s`, `1min 30s`, `90`) in seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "": 1}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit]
    assert total > 0, f"not a time span: {span!r}"
    return total


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


def default(section: str, key: str) -> object:
    return next(s.default for s in iter_settings() if (s.section, s.key) == (section, key))


def verify_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart on this venv's imexd, beside a nvidia-imex.service stub."""
    imexd = Path(sys.executable).with_name("imexd")
    assert imexd.is_file(), f"{imexd} missing: install the package (pip install -e .)"
    text = UNIT.read_text()
    fixed = re.sub(r"^ExecStart=\S+", f"ExecStart={imexd}", text, count=1, flags=re.M)
    assert fixed != text
    (tmp_path / "imexd.service").write_text(fixed)
    (tmp_path / "nvidia-imex.service").write_text(
        "[Unit]\nDescription=stub of the IMEX package's unit\n\n"
        "[Service]\nType=forking\nExecStart=/bin/true\n"
    )
    return tmp_path / "imexd.service"


def ours(line: str) -> bool:
    """False only for a message about a host unit file that does not concern imexd."""
    if "imexd" in line or "nvidia-imex" in line:
        return True
    return not any(line.startswith(d) for d in HOST_UNIT_DIRS)


def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is missing (scripts/test installs the systemd package)")
    return found


def test_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts the unit without a single warning about it."""
    path = verify_copy(tmp_path)
    proc = subprocess.run(
        [analyze(), "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SYSTEMD_LOG_TARGET": "console"},
    )
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    mine = [ln for ln in lines if ours(ln)]
    assert mine == [], "\n".join(mine)
    assert proc.returncode == 0 or len(lines) > len(mine), proc.returncode


def test_verify_reports_a_broken_unit(tmp_path: Path) -> None:
    """The verify check is not blind: a misspelt key and a missing binary are reported."""
    path = verify_copy(tmp_path)
    path.write_text(
        path.read_text()
        .replace("KillMode=process", "KilMode=process")
        .replace(f"ExecStart={Path(sys.executable).with_name('imexd')}", "ExecStart=/nonexistent")
    )
    proc = subprocess.run(
        [analyze(), "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SYSTEMD_LOG_TARGET": "console"},
    )
    out = proc.stdout + proc.stderr
    assert "KilMode" in out
    assert "/nonexistent" in out


def test_hardening_exposure_is_low(tmp_path: Path) -> None:
    """`systemd-analyze security --offline` rates the unit's exposure below 5 (of 10)."""
    path = verify_copy(tmp_path)
    proc = subprocess.run(
        [analyze(), "security", "--offline=true", "--no-pager", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SYSTEMD_LOG_TARGET": "console"},
    )
    if "--offline" in proc.stderr and "unrecognized" in proc.stderr:
        pytest.skip("this systemd-analyze predates `security --offline` (systemd < 250)")
    match = re.search(r"Overall exposure level for imexd\.service: (\d+(?:\.\d+)?)", proc.stdout)
    assert match, proc.stdout[-2000:] + proc.stderr
    assert float(match.group(1)) < 5.0


def test_notify_watchdog_and_start(unit: Unit) -> None:
    """The agent is Type=notify with the main process as the only notifier and a watchdog."""
    assert single(unit, "Service", "Type") == "notify"
    assert single(unit, "Service", "NotifyAccess") == "main"
    watchdog = seconds(single(unit, "Service", "WatchdogSec"))
    assert 10 <= watchdog <= 120
    assert seconds(single(unit, "Service", "TimeoutStartSec")) >= 30


def test_execstart_runs_the_agent_with_the_default_config(unit: Unit) -> None:
    """ExecStart is `imexd run --config <default path>` as the real CLI parses it."""
    argv = shlex.split(single(unit, "Service", "ExecStart"))
    assert argv[0] == "/usr/local/bin/imexd"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run"
    assert args.config == DEFAULT_CONFIG_PATH


def test_stop_is_leave_and_only_the_agent_is_signalled(unit: Unit) -> None:
    """KillMode=process: stop signals only the agent, which stops IMEX itself."""
    assert single(unit, "Service", "KillMode") == "process"
    assert values(unit, "Service", "KillSignal") in ([], ["SIGTERM"])
    assert values(unit, "Service", "ExecStop") == []


def test_stop_timeout_exceeds_the_agents_bounded_shutdown(unit: Unit) -> None:
    """TimeoutStopSec leaves the agent its whole bounded shutdown plus a margin."""
    stop_timeout_s = default("daemon", "stop_timeout_s")
    assert isinstance(stop_timeout_s, float)
    bound = stop_timeout_s + SHUTDOWN_MARGIN_S
    assert seconds(single(unit, "Service", "TimeoutStopSec")) >= bound + 10


def test_the_stop_timeout_settings_know_the_units(unit: Unit) -> None:
    """settings.UNIT_TIMEOUT_STOP_S is the unit's TimeoutStopSec, the default of
    [daemon] service_stop_timeout_s (the agent's shutdown margin is settings.SHUTDOWN_MARGIN_S
    itself, which validation adds to [daemon] stop_timeout_s)."""
    assert seconds(single(unit, "Service", "TimeoutStopSec")) == UNIT_TIMEOUT_STOP_S
    assert default("daemon", "service_stop_timeout_s") == UNIT_TIMEOUT_STOP_S


def test_reload_is_the_hand_over(unit: Unit, tmp_path: Path) -> None:
    """ExecReload= sends SIGUSR2 to the main process only: run as systemd would (with
    $MAINPID replaced), it reaches a process that exits 75 on it, as the agent does."""
    argv = shlex.split(single(unit, "Service", "ExecReload"))
    assert "$MAINPID" in argv, "the signal must go to the agent only, never to the daemon"
    assert Path(argv[0]).is_absolute()
    ready = tmp_path / "ready"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGUSR2, lambda *_: sys.exit(75))\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(30)\n",
        ]
    )
    try:

        def started() -> bool:
            assert child.poll() is None, "the stand-in agent ended"
            return ready.exists()

        wait_for(started, timeout=20, interval=0.02, what="the stand-in agent started")
        reload = [a.replace("$MAINPID", str(child.pid)) for a in argv]
        subprocess.run(reload, check=True, timeout=10)
        assert child.wait(timeout=10) == HANDOVER_EXIT
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)


def test_docs_make_reload_the_upgrade_path() -> None:
    """docs/systemd.md and docs/install.md name `systemctl reload imexd` for upgrades and
    configuration changes, and how to recover after the start limit."""
    doc = DOC.read_text()
    install = (ROOT / "docs" / "install.md").read_text()
    assert "systemctl reload imexd" in doc
    assert "systemctl reload imexd" in install
    assert "systemctl reset-failed imexd && systemctl start imexd" in doc
    assert "systemctl kill --kill-whom=main" not in install


def test_restart_covers_crash_and_hand_over(unit: Unit) -> None:
    """Crashes restart, the hand-over exit restarts cleanly, a config error does not."""
    assert single(unit, "Service", "Restart") == "on-failure"
    assert str(HANDOVER_EXIT) in values(unit, "Service", "RestartForceExitStatus")
    assert str(HANDOVER_EXIT) in values(unit, "Service", "SuccessExitStatus")
    assert str(CONFIG_ERROR_EXIT) in values(unit, "Service", "RestartPreventExitStatus")
    assert seconds(single(unit, "Unit", "StartLimitIntervalSec")) >= 60
    assert 2 <= int(single(unit, "Unit", "StartLimitBurst")) <= 10
    assert f"StartLimitBurst={single(unit, 'Unit', 'StartLimitBurst')}" in DOC.read_text()


def test_conflicts_with_the_package_unit_and_waits_for_its_stop(unit: Unit) -> None:
    """Starting imexd stops nvidia-imex.service first, and waits for the network."""
    assert "nvidia-imex.service" in values(unit, "Unit", "Conflicts")
    assert "nvidia-imex.service" in values(unit, "Unit", "After")
    assert "network-online.target" in values(unit, "Unit", "After")
    assert "network-online.target" in values(unit, "Unit", "Wants")
    assert values(unit, "Install", "WantedBy") == ["multi-user.target"]


def writable_paths(unit: Unit) -> set[str]:
    """What ProtectSystem=strict leaves writable: ReadWritePaths plus managed folders."""
    paths = {p.lstrip("-") for p in values(unit, "Service", "ReadWritePaths")}
    paths |= {f"/run/{d}" for d in values(unit, "Service", "RuntimeDirectory")}
    paths |= {f"/var/lib/{d}" for d in values(unit, "Service", "StateDirectory")}
    for key in ("LogsDirectory", "CacheDirectory", "ConfigurationDirectory"):
        assert values(unit, "Service", key) == [], f"{key}= makes more writable"
    return paths


def test_writable_paths_are_exactly_what_is_written(unit: Unit) -> None:
    """Only the default run dir, state dir, hosts file, IMEX's persist dir and the CDI
    folder are writable (the channel nodes and env files live in /dev and the run dir)."""
    assert single(unit, "Service", "ProtectSystem") == "strict"
    cdi_dir = str(default("channels", "cdi_dir"))
    expected = {
        default("imex", "run_dir"),
        default("node", "state_dir"),
        default("imex", "hosts_file"),
        IMEX_PERSIST_DIR,
        cdi_dir.replace("/var/run/", "/run/", 1),
    }
    assert str(default("channels", "env_dir")).startswith(str(default("imex", "run_dir")) + "/")
    assert str(default("channels", "dev_dir")).startswith("/dev/")
    assert writable_paths(unit) == expected
    assert single(unit, "Service", "RuntimeDirectoryPreserve") == "yes"


def test_hardening_keeps_the_gpu_devices(unit: Unit) -> None:
    """The sandbox is on, but nothing in it hides /dev/nvidia* from IMEX."""
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
    }.items():
        assert single(unit, "Service", key) == value, key
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "ProcSubset"):
        assert values(unit, "Service", key) == [], f"{key}= would hide GPU devices or /proc"
    assert set(values(unit, "Service", "RestrictAddressFamilies")) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }
    assert int(single(unit, "Service", "LimitNOFILE")) >= 65536


def test_capabilities_are_few_and_each_documented(unit: Unit) -> None:
    """The bounding set holds no broad capability, and docs/systemd.md explains each one."""
    caps = values(unit, "Service", "CapabilityBoundingSet")
    assert caps, "an empty CapabilityBoundingSet= line would keep every capability"
    assert not any(c.startswith("~") for c in caps), "a deny list keeps everything else"
    broad = {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_MODULE", "CAP_NET_ADMIN", "CAP_SETUID"}
    assert not broad & set(caps)
    doc = DOC.read_text()
    for cap in caps:
        assert f"`{cap}`" in doc, f"{cap} is not explained in docs/systemd.md"


def test_environment_example_names_real_settings() -> None:
    """Every IMEXD_* variable in systemd/imexd.env is a real setting."""
    known = {s.env for s in iter_settings()}
    names = re.findall(r"^#?\s*(IMEXD_[A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), flags=re.M)
    assert names
    assert all(n.startswith(ENV_PREFIX) for n in names)
    assert set(names) <= known, set(names) - known
