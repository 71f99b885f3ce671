"""The Slurm scripts of config/slurm: the imexd command lines they run and their exits.

Each script runs under `sh` and `bash` with a fake `imexd`, `scontrol` and `logger` on
PATH: small shell scripts written into tmp_path that append their argv to a log and exit
with a status chosen per command (`FAKE_EXIT_<command>_<action>`). No broker, no Slurm.
The rule the tests hold the scripts to: a prolog skips a job that needs no IMEX
(IMEXD_PARTITIONS, IMEXD_MIN_NODES) and otherwise fails (non-zero, imexd's own status)
when imexd does, logging imexd's own reason (every step goes to `logger -t imexd-slurm`),
and deletes what it created; an epilog or the TaskProlog always exits 0 (a failing
epilog would only be logged by Slurm, and a failing TaskProlog would kill the task of
every job on the cluster), logging what went wrong at priority err.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from imexd.cli.main import build_parser
from tests.brokers import Mosquitto

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "config" / "slurm"
COMMON = SLURM / "imexd-slurm-common.sh"
"""The code the prologs and epilogs source from beside themselves."""
SCRIPTS = sorted(path for path in SLURM.glob("*.sh") if path != COMMON)
IMEXD = Path(sys.executable).parent / "imexd"
"""The installed imexd of this virtual environment."""
SHELLS = [shell for shell in ("sh", "bash", "dash") if shutil.which(shell)]
CONFIG = "/etc/imexd/control.toml"
JOB = "4242"
HOSTS = "GPU-01\ngpu-02\n"
"""What the fake `scontrol show hostnames` prints: one name upper case, as Slurm allows."""
NODES = "gpu-01,gpu-02"
SEPARATOR = "\x1f"
"""Between the arguments of a call in the fakes' log (no argument holds one)."""

FAKE = r"""#!/bin/sh
# Record this call (one line, the arguments after the name, each after a \037) and exit
# as told.
name=${0##*/}
sep=$(printf '\037')
line=$name
for arg in "$@"; do
    line="$line$sep$arg"
done
printf '%s\n' "$line" >>"$FAKE_LOG"
if [ "$name" = scontrol ]; then
    printf '%s' "$FAKE_HOSTS"
fi
if [ "$name" = imexd ] && [ "${1:-}" = workload ] && [ "${2:-}" = env ]; then
    printf 'export IMEX_CHANNEL=7\nexport IMEXD_WORKLOAD=%s\nnoise\n' "$3"
fi
eval "out=\${FAKE_OUT_${name}_${1:-}_${2:-}:-}"
if [ -n "$out" ]; then
    printf '%s\n' "$out" >&2
fi
eval "status=\${FAKE_EXIT_${name}_${1:-}_${2:-}:-0}"
exit "$status"
"""


@dataclass(frozen=True)
class Run:
    """One script run: its exit status, output, and the commands it called in order."""

    status: int
    stdout: str
    stderr: str
    calls: list[list[str]]

    def of(self, program: str) -> list[list[str]]:
        """The argument lists of the calls of one program."""
        return [call[1:] for call in self.calls if call[0] == program]

    def logged(self, priority: str = "") -> list[str]:
        """The messages given to `logger -t imexd-slurm` (at `user.<priority>`, or any)."""
        return [
            call[4]
            for call in self.of("logger")
            if call[:2] == ["-t", "imexd-slurm"] and call[3].startswith(f"user.{priority}")
        ]


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder with the fake `imexd`, `scontrol` and `logger`."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("imexd", "scontrol", "logger"):
        path = folder / name
        path.write_text(FAKE)
        path.chmod(0o755)
    return folder


def run_script(
    script: str,
    bin_dir: Path,
    *,
    shell: str = "sh",
    env: dict[str, str] | None = None,
    drop: tuple[str, ...] = (),
    folder: Path = SLURM,
) -> Run:
    """Run <folder>/<script> (config/slurm by default) with the fakes first on PATH and a
    Slurm job's variables."""
    log = bin_dir.parent / "calls.log"
    log.unlink(missing_ok=True)
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_LOG": str(log),
        "FAKE_HOSTS": HOSTS,
        "IMEXD_SLURM_ENV": str(bin_dir.parent / "no-such-slurm.env"),
        "SLURM_JOB_ID": JOB,
        "SLURM_JOB_NODELIST": "gpu-[01-02]",
        "SLURM_JOB_UID": "1001",
        "SLURM_JOB_GID": "2002",
    }
    full = {key: value for key, value in (base | (env or {})).items() if key not in drop}
    done = subprocess.run(
        [shell, str(folder / script)],
        env=full,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    lines = log.read_text().splitlines() if log.exists() else []
    return Run(done.returncode, done.stdout, done.stderr, [x.split(SEPARATOR) for x in lines])


def test_the_seven_scripts_are_there() -> None:
    """config/slurm holds the two layouts' prologs and epilogs, the pair that picks one of
    them by partition, the TaskProlog, and the code that the prologs and epilogs share."""
    assert [p.name for p in SCRIPTS] == [
        "imexd-epilog-perjob.sh",
        "imexd-epilog-shared.sh",
        "imexd-epilog.sh",
        "imexd-prolog-perjob.sh",
        "imexd-prolog-shared.sh",
        "imexd-prolog.sh",
        "imexd-taskprolog.sh",
    ]
    assert sorted(SLURM.glob("*.sh")) == sorted([*SCRIPTS, COMMON])


@pytest.mark.parametrize("script", [*SCRIPTS, COMMON], ids=lambda p: p.name)
@pytest.mark.parametrize("shell", SHELLS)
def test_syntax(script: Path, shell: str) -> None:
    """Every script parses under sh, bash and dash (`-n`)."""
    done = subprocess.run(
        [shell, "-n", str(script)], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck() -> None:
    """shellcheck finds nothing in the scripts and the common file, read as POSIX sh and
    following each `.` of the common file."""
    done = subprocess.run(
        ["shellcheck", "-s", "sh", "-x", *map(str, [*SCRIPTS, COMMON])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_header_says_where_to_install(script: Path) -> None:
    """Every script is executable, POSIX sh with `set -eu`, and names its slurm.conf line."""
    text = script.read_text()
    assert os.access(script, os.X_OK)
    assert text.startswith("#!/bin/sh\n")
    assert "\nset -eu\n" in text
    key = "TaskProlog" if "taskprolog" in script.name else "Slurmctld"
    line = f"=/etc/slurm/{script.name}"
    assert any(key in row and line in row for row in text.splitlines() if row.startswith("#"))


def test_common_file_is_sourced_not_run() -> None:
    """The common file is not executable, only defines functions, and its header names
    where it goes: beside the scripts that source it, in /etc/slurm."""
    text = COMMON.read_text()
    assert not os.access(COMMON, os.X_OK)
    assert text.startswith("# shellcheck shell=sh\n")
    assert "install -m 0644 imexd-slurm-common.sh /etc/slurm/imexd-slurm-common.sh" in text
    assert "\nset " not in text
    sourcing = [s for s in SCRIPTS if '. "$common"' in s.read_text()]
    assert [s.name for s in sourcing] == [s.name for s in SCRIPTS if "taskprolog" not in s.name]


@pytest.mark.parametrize(
    "script",
    [
        "imexd-prolog-perjob.sh",
        "imexd-prolog-shared.sh",
        "imexd-epilog-perjob.sh",
        "imexd-epilog-shared.sh",
        "imexd-prolog.sh",
        "imexd-epilog.sh",
    ],
)
@pytest.mark.parametrize("shell", SHELLS)
def test_missing_common_file(bin_dir: Path, tmp_path: Path, shell: str, script: str) -> None:
    """A script installed without imexd-slurm-common.sh beside it logs at err which file
    it misses and exits as its header promises: 2 from a prolog, 0 from an epilog."""
    prolog = "prolog" in script
    status, consequence = (2, "the job does not start") if prolog else (0, "nothing deleted")
    installed = tmp_path / "etc-slurm"
    installed.mkdir()
    shutil.copy(SLURM / script, installed / script)
    env = {"IMEXD_DOMAIN": "rack-07", "IMEXD_LAYOUT_PERJOB": "gpu", "SLURM_JOB_PARTITION": "gpu"}
    run = run_script(script, bin_dir, shell=shell, env=env, folder=installed)
    assert (run.status, run.of("imexd"), run.of("scontrol")) == (status, [], [])
    message = (
        f"cannot read {installed}/imexd-slurm-common.sh: install it beside this script; "
        f"{consequence}"
    )
    assert run.logged("err") == [message]
    assert run.stderr.splitlines() == [f"imexd-slurm: {message}"]
    (installed / "imexd-slurm-common.sh").write_text(COMMON.read_text())
    role = "prolog" if prolog else "epilog"
    shutil.copy(SLURM / f"imexd-{role}-perjob.sh", installed)  # what the mixed pair runs
    works = run_script(script, bin_dir, shell=shell, env=env, folder=installed)
    assert (works.status, works.logged("err")) == (0, [])
    assert len(works.of("imexd")) >= 1


@pytest.mark.parametrize("shell", SHELLS)
def test_perjob_prolog_creates_the_domain_and_waits(bin_dir: Path, shell: str) -> None:
    """The per-job prolog creates job-<id> with channel 0 for the job's user and waits in
    the same command (`domain create --wait`): one imexd call."""
    run = run_script("imexd-prolog-perjob.sh", bin_dir, shell=shell)
    assert run.status == 0, run.stderr
    assert run.of("scontrol") == [["show", "hostnames", "gpu-[01-02]"]]
    assert run.of("imexd") == [
        ["domain", "create", f"job-{JOB}", "--nodes", NODES, "--channel",
         "--uid", "1001", "--gid", "2002", "--mode", "0600", "--wait", "240", "--config",
         CONFIG],
    ]  # fmt: skip


@pytest.mark.parametrize("status", [1, 2])
def test_perjob_prolog_fails_with_imexd_and_deletes_the_domain(bin_dir: Path, status: int) -> None:
    """A failing create (2: refused; 1: not UP in time) fails the prolog with imexd's
    status; the domain is deleted again, waiting for its members to leave."""
    run = run_script(
        "imexd-prolog-perjob.sh", bin_dir, env={"FAKE_EXIT_imexd_domain_create": str(status)}
    )
    assert run.status == status
    calls = run.of("imexd")
    assert calls[-1] == ["domain", "delete", f"job-{JOB}", "--wait", "30", "--config", CONFIG]
    assert calls[-2][:2] == ["domain", "create"]
    assert f"exited {status}" in run.stderr
    assert any(c[:2] == ["-p", "user.err"] for c in (call[2:] for call in run.of("logger")))


@pytest.mark.parametrize("shell", SHELLS)
def test_shared_prolog_creates_the_workload(bin_dir: Path, shell: str) -> None:
    """The shared prolog creates workload job-<id> in IMEXD_DOMAIN for the job's user."""
    run = run_script(
        "imexd-prolog-shared.sh", bin_dir, shell=shell, env={"IMEXD_DOMAIN": "rack-07"}
    )
    assert run.status == 0, run.stderr
    assert run.of("imexd") == [
        ["workload", "create", f"job-{JOB}", "--domain", "rack-07", "--nodes", NODES,
         "--uid", "1001", "--gid", "2002", "--mode", "0600", "--wait", "60", "--config", CONFIG],
    ]  # fmt: skip


@pytest.mark.parametrize("status", [1, 2, 3])
def test_shared_prolog_fails_when_create_fails(bin_dir: Path, status: int) -> None:
    """`workload create` exiting 1, 2 or 3 fails the prolog with that status, after a delete."""
    run = run_script(
        "imexd-prolog-shared.sh",
        bin_dir,
        env={"IMEXD_DOMAIN": "rack-07", "FAKE_EXIT_imexd_workload_create": str(status)},
    )
    assert run.status == status
    assert run.of("imexd")[1:] == [
        ["workload", "delete", f"job-{JOB}", "--domain", "rack-07", "--wait", "30", "--config",
         CONFIG]
    ]  # fmt: skip
    assert f"imexd workload create exited {status}" in run.stderr


def test_shared_prolog_still_fails_when_the_cleanup_fails(bin_dir: Path) -> None:
    """A failing cleanup after a failed create does not turn the prolog's failure into 0."""
    run = run_script(
        "imexd-prolog-shared.sh",
        bin_dir,
        env={
            "IMEXD_DOMAIN": "rack-07",
            "FAKE_EXIT_imexd_workload_create": "3",
            "FAKE_EXIT_imexd_workload_delete": "1",
        },
    )
    assert run.status == 3


def test_shared_prolog_needs_the_domain(bin_dir: Path) -> None:
    """Without IMEXD_DOMAIN the shared prolog fails at once, naming it, and calls nothing."""
    run = run_script("imexd-prolog-shared.sh", bin_dir)
    assert run.status == 2
    assert "IMEXD_DOMAIN is not set" in run.stderr
    assert run.of("imexd") == []


def test_settings_file_and_binary_override(bin_dir: Path, tmp_path: Path) -> None:
    """IMEXD_SLURM_ENV's file sets IMEXD_DOMAIN, IMEXD, IMEXD_CONFIG and IMEXD_CHANNEL_MODE."""
    other = tmp_path / "opt" / "imexd-1.2"
    other.mkdir(parents=True)
    shutil.copy(bin_dir / "imexd", other / "imexd")
    (bin_dir / "imexd").unlink()
    defaults = tmp_path / "slurm.env"
    defaults.write_text(
        f"IMEXD={other / 'imexd'}\nIMEXD_DOMAIN=rack-09\nIMEXD_CONFIG=/etc/imexd/c2.toml\n"
        "IMEXD_CHANNEL_MODE=0660\n"
    )
    run = run_script("imexd-prolog-shared.sh", bin_dir, env={"IMEXD_SLURM_ENV": str(defaults)})
    assert run.status == 0, run.stderr
    assert run.of("imexd") == [
        ["workload", "create", f"job-{JOB}", "--domain", "rack-09", "--nodes", NODES,
         "--uid", "1001", "--gid", "2002", "--mode", "0660", "--wait", "60",
         "--config", "/etc/imexd/c2.toml"],
    ]  # fmt: skip


def test_settings_file_may_use_unset_variables(bin_dir: Path, tmp_path: Path) -> None:
    """The settings file is sourced with unset variables allowed (`set -u` stays off)."""
    defaults = tmp_path / "slurm.env"
    defaults.write_text("IMEXD_DOMAIN=${SLURM_JOB_PARTITION}rack-01\n")
    run = run_script("imexd-prolog-shared.sh", bin_dir, env={"IMEXD_SLURM_ENV": str(defaults)})
    assert run.status == 0, run.stderr
    assert run.of("imexd")[0][3:5] == ["--domain", "rack-01"]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(("partition", "domain"), [("", "rack-01"), ("gpu", "gpu")])
def test_settings_file_may_have_failing_commands(
    bin_dir: Path, tmp_path: Path, shell: str, partition: str, domain: str
) -> None:
    """A settings file with commands that fail, such as a `[ ... ] && KEY=value` that
    does not apply to this job as its last line, is read like any other, under `set -e`
    too: only a file that does not parse or that ends the shell is broken."""
    defaults = tmp_path / "slurm.env"
    defaults.write_text(
        "IMEXD_DOMAIN=$(cat /nonexistent/imexd-domain 2>/dev/null)\n"
        "IMEXD_DOMAIN=${IMEXD_DOMAIN:-rack-01}\n"
        '[ -n "$SLURM_JOB_PARTITION" ] && IMEXD_DOMAIN=$SLURM_JOB_PARTITION\n'
    )
    env = {"IMEXD_SLURM_ENV": str(defaults), "SLURM_JOB_PARTITION": partition}
    run = run_script("imexd-prolog-shared.sh", bin_dir, shell=shell, env=env)
    assert run.status == 0, run.stderr
    assert run.of("imexd")[0][3:5] == ["--domain", domain]
    env_dir = tmp_path / "workloads"
    env_dir.mkdir()
    (env_dir / f"job-{JOB}.env").write_text("IMEX_CHANNEL=5\n")
    task = run_script(
        "imexd-taskprolog.sh",
        bin_dir,
        shell=shell,
        env=env | {"IMEXD_CHANNELS_ENV_DIR": str(env_dir)},
    )
    assert (task.status, task.stdout, task.stderr) == (0, "export IMEX_CHANNEL=5\n", "")


@pytest.mark.parametrize(
    ("script", "status", "calls"),
    [
        ("imexd-prolog-perjob.sh", 2, 0),
        ("imexd-prolog-shared.sh", 2, 0),
        ("imexd-epilog-perjob.sh", 0, 1),
        ("imexd-epilog-shared.sh", 0, 1),
        ("imexd-prolog.sh", 2, 0),
        ("imexd-epilog.sh", 0, 0),
        ("imexd-taskprolog.sh", 0, 0),
    ],
)
def test_broken_settings_file(
    bin_dir: Path, tmp_path: Path, script: str, status: int, calls: int
) -> None:
    """A settings file that does not source fails a prolog (status 2, nothing run) and is
    skipped, with an error logged, by the epilogs (which still delete, except the mixed
    one: without the file it cannot tell the layout) and the TaskProlog."""
    defaults = tmp_path / "slurm.env"
    defaults.write_text("IMEXD_DOMAIN=rack-01\nIMEXD_LAYOUT_PERJOB=gpu\nif then fi (\n")
    env = {"IMEXD_SLURM_ENV": str(defaults), "IMEXD_CHANNELS_ENV_DIR": str(tmp_path)}
    env |= {"SLURM_JOB_PARTITION": "gpu"}
    run = run_script(script, bin_dir, env=env)
    assert run.status == status
    assert len(run.of("imexd")) == calls
    assert f"cannot read the settings in {defaults}" in run.stderr


@pytest.mark.parametrize("script", ["imexd-prolog-perjob.sh", "imexd-prolog-shared.sh"])
def test_prolog_fails_without_nodes(bin_dir: Path, script: str) -> None:
    """A failing `scontrol` or an empty node list fails the prolog before any imexd call."""
    env = {"IMEXD_DOMAIN": "rack-07"}
    failing = run_script(script, bin_dir, env=env | {"FAKE_EXIT_scontrol_show_hostnames": "1"})
    empty = run_script(script, bin_dir, env=env | {"FAKE_HOSTS": ""})
    assert (failing.status, empty.status) == (1, 1)
    assert (failing.of("imexd"), empty.of("imexd")) == ([], [])
    assert "scontrol show hostnames gpu-[01-02] failed" in failing.stderr
    assert "no nodes in gpu-[01-02]" in empty.stderr


@pytest.mark.parametrize("script", ["imexd-prolog-perjob.sh", "imexd-prolog-shared.sh"])
@pytest.mark.parametrize("variable", ["SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_UID"])
def test_prolog_needs_the_job(bin_dir: Path, script: str, variable: str) -> None:
    """A prolog run without the job's variables fails with status 2 naming the variable."""
    run = run_script(script, bin_dir, env={"IMEXD_DOMAIN": "rack-07"}, drop=(variable,))
    assert run.status == 2
    assert f"{variable} is not set" in run.stderr
    assert run.of("imexd") == []


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("delete_status", [0, 1, 2])
def test_perjob_epilog_deletes_the_domain_and_exits_0(
    bin_dir: Path, shell: str, delete_status: int
) -> None:
    """The per-job epilog deletes job-<id>; a failed delete is logged and still exits 0."""
    run = run_script(
        "imexd-epilog-perjob.sh",
        bin_dir,
        shell=shell,
        env={"FAKE_EXIT_imexd_domain_delete": str(delete_status)},
    )
    assert run.status == 0
    assert run.of("imexd") == [
        ["domain", "delete", f"job-{JOB}", "--wait", "30", "--config", CONFIG]
    ]
    errors = [c for c in run.of("logger") if c[2:4] == ["-p", "user.err"]]
    if delete_status:
        assert errors
        assert f"exited {delete_status}" in errors[0][4]
    else:
        assert errors == []


@pytest.mark.parametrize("delete_status", [0, 1])
def test_shared_epilog_deletes_the_workload_and_exits_0(bin_dir: Path, delete_status: int) -> None:
    """The shared epilog deletes workload job-<id> in IMEXD_DOMAIN, and exits 0 regardless."""
    run = run_script(
        "imexd-epilog-shared.sh",
        bin_dir,
        env={"IMEXD_DOMAIN": "rack-07", "FAKE_EXIT_imexd_workload_delete": str(delete_status)},
    )
    assert run.status == 0
    assert run.of("imexd") == [
        ["workload", "delete", f"job-{JOB}", "--domain", "rack-07", "--wait", "30", "--config",
         CONFIG]
    ]  # fmt: skip
    assert ("imexd workload delete exited 1" in run.stderr) == bool(delete_status)


def test_shared_epilog_without_domain_lets_imexd_find_it(bin_dir: Path) -> None:
    """Without IMEXD_DOMAIN the epilog names only the workload (unique across domains)."""
    run = run_script("imexd-epilog-shared.sh", bin_dir)
    assert run.status == 0
    assert run.of("imexd") == [
        ["workload", "delete", f"job-{JOB}", "--wait", "30", "--config", CONFIG]
    ]


@pytest.mark.parametrize("script", ["imexd-epilog-perjob.sh", "imexd-epilog-shared.sh"])
def test_epilog_without_job_exits_0(bin_dir: Path, script: str) -> None:
    """An epilog run without SLURM_JOB_ID deletes nothing, logs, and exits 0."""
    run = run_script(script, bin_dir, drop=("SLURM_JOB_ID",))
    assert run.status == 0
    assert run.of("imexd") == []
    assert "SLURM_JOB_ID is not set" in run.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_taskprolog_exports_the_env_file(bin_dir: Path, tmp_path: Path, shell: str) -> None:
    """The TaskProlog turns the agent's env file into `export` lines, without imexd."""
    env_dir = tmp_path / "workloads"
    env_dir.mkdir()
    (env_dir / f"job-{JOB}.env").write_text(
        "IMEX_CHANNEL=5\nIMEXD_WORKLOAD=job-4242\nIMEXD_DOMAIN=rack-07\n"
        "IMEXD_CLIQUE=uuid.1\nIMEXD_CHANNEL_DEVICE=/dev/nvidia-caps-imex-channels/channel5"
    )  # the last line without a newline is still read
    (env_dir / "job-1.env").write_text("IMEX_CHANNEL=1\n")
    run = run_script(
        "imexd-taskprolog.sh", bin_dir, shell=shell, env={"IMEXD_CHANNELS_ENV_DIR": str(env_dir)}
    )
    assert run.status == 0, run.stderr
    assert run.stdout.splitlines() == [
        "export IMEX_CHANNEL=5",
        "export IMEXD_WORKLOAD=job-4242",
        "export IMEXD_DOMAIN=rack-07",
        "export IMEXD_CLIQUE=uuid.1",
        "export IMEXD_CHANNEL_DEVICE=/dev/nvidia-caps-imex-channels/channel5",
    ]
    assert run.of("imexd") == []


def test_taskprolog_without_workload_prints_nothing(bin_dir: Path, tmp_path: Path) -> None:
    """A job without an env file (no workload on this node) gets no lines and exit 0."""
    run = run_script("imexd-taskprolog.sh", bin_dir, env={"IMEXD_CHANNELS_ENV_DIR": str(tmp_path)})
    assert (run.status, run.stdout, run.of("imexd")) == (0, "", [])
    outside = run_script("imexd-taskprolog.sh", bin_dir, drop=("SLURM_JOB_ID",))
    assert (outside.status, outside.stdout) == (0, "")


@pytest.mark.parametrize("env_status", [0, 1])
def test_taskprolog_asks_the_bus_when_told(bin_dir: Path, tmp_path: Path, env_status: int) -> None:
    """With IMEXD_TASKPROLOG_BUS=yes and no env file it prints `imexd workload env`'s
    export lines, or nothing when that fails; it exits 0 either way."""
    run = run_script(
        "imexd-taskprolog.sh",
        bin_dir,
        env={
            "IMEXD_CHANNELS_ENV_DIR": str(tmp_path),
            "IMEXD_TASKPROLOG_BUS": "yes",
            "IMEXD_DOMAIN": "rack-07",
            "FAKE_EXIT_imexd_workload_env": str(env_status),
        },
    )
    assert run.status == 0
    assert run.of("imexd") == [
        ["workload", "env", f"job-{JOB}", "--domain", "rack-07", "--config", CONFIG]
    ]
    expected = [] if env_status else ["export IMEX_CHANNEL=7", f"export IMEXD_WORKLOAD=job-{JOB}"]
    assert run.stdout.splitlines() == expected


def _parser_has_workloads() -> bool:
    try:
        build_parser().parse_args(["workload", "list"])
    except SystemExit:
        return False
    return True


@pytest.mark.skipif(not _parser_has_workloads(), reason="imexd has no `workload` commands yet")
def test_every_command_line_parses(bin_dir: Path, tmp_path: Path) -> None:
    """Every imexd command line the scripts run is accepted by the real CLI parser."""
    env = {"IMEXD_DOMAIN": "rack-07", "IMEXD_TASKPROLOG_BUS": "yes", "IMEXD_SEEN_WITHIN": "120"}
    env |= {"IMEXD_CHANNELS_ENV_DIR": str(tmp_path)}
    failing = {f"FAKE_EXIT_imexd_{c}": "1" for c in ("workload_create", "domain_create")}
    calls = [
        call
        for script in SCRIPTS
        for extra in ({}, failing)
        for call in run_script(script.name, bin_dir, env=env | extra).of("imexd")
    ]
    assert {" ".join(c[:2]) for c in calls} == {
        "domain create", "domain delete", "workload create", "workload delete",
        "workload env",
    }  # fmt: skip
    parser = build_parser()
    for call in calls:
        parser.parse_args(call)


PROLOGS = ["imexd-prolog-perjob.sh", "imexd-prolog-shared.sh"]
CONTROLLER_SCRIPTS = [*PROLOGS, "imexd-epilog-perjob.sh", "imexd-epilog-shared.sh"]


@pytest.mark.parametrize("script", CONTROLLER_SCRIPTS)
@pytest.mark.parametrize("partitions", ["gpu,nvl72", "gpu nvl72", " nvl72 , gpu "])
def test_filter_skips_other_partitions(bin_dir: Path, script: str, partitions: str) -> None:
    """A job on a partition IMEXD_PARTITIONS does not list (commas or spaces) exits 0 at
    once, logging why, and runs no imexd; a listed partition's job is handled."""
    env = {"IMEXD_DOMAIN": "rack-07", "IMEXD_PARTITIONS": partitions}
    other = run_script(script, bin_dir, env=env | {"SLURM_JOB_PARTITION": "cpu"})
    assert (other.status, other.of("imexd")) == (0, [])
    assert other.logged("info") == [
        f"job {JOB}: partition cpu is not in IMEXD_PARTITIONS ({partitions}): "
        f"no IMEX {'domain' if 'perjob' in script else 'channel'}, nothing to do"
    ]
    assert other.logged("info")[0] in other.stderr
    listed = run_script(script, bin_dir, env=env | {"SLURM_JOB_PARTITION": "nvl72"})
    assert listed.status == 0, listed.stderr
    assert len(listed.of("imexd")) >= 1


@pytest.mark.parametrize("script", CONTROLLER_SCRIPTS)
def test_filter_without_partition_variable(bin_dir: Path, script: str) -> None:
    """With IMEXD_PARTITIONS set, a job without SLURM_JOB_PARTITION is not listed."""
    env = {"IMEXD_DOMAIN": "rack-07", "IMEXD_PARTITIONS": "gpu"}
    run = run_script(script, bin_dir, env=env)
    assert (run.status, run.of("imexd")) == (0, [])
    assert "partition (none) is not in IMEXD_PARTITIONS (gpu)" in run.logged("info")[0]


@pytest.mark.parametrize("script", CONTROLLER_SCRIPTS)
def test_filter_skips_single_node_jobs(bin_dir: Path, script: str) -> None:
    """A one-node job is skipped by default (IMEXD_MIN_NODES=2) and handled with 1."""
    env = {"IMEXD_DOMAIN": "rack-07", "FAKE_HOSTS": "gpu-01\n"}
    single = run_script(script, bin_dir, env=env)
    assert (single.status, single.of("imexd")) == (0, [])
    assert "1 node(s)" in single.logged("info")[0]
    assert "fewer than IMEXD_MIN_NODES=2" in single.logged("info")[0]
    allowed = run_script(script, bin_dir, env=env | {"IMEXD_MIN_NODES": "1"})
    assert allowed.status == 0, allowed.stderr
    assert allowed.of("imexd")[0][2] == f"job-{JOB}"
    more = run_script(script, bin_dir, env={"IMEXD_DOMAIN": "rack-07", "IMEXD_MIN_NODES": "3"})
    assert (more.status, more.of("imexd")) == (0, [])


@pytest.mark.parametrize("script", PROLOGS)
@pytest.mark.parametrize("value", ["two", "-1", "2.5"])
def test_prolog_refuses_a_bad_min_nodes(bin_dir: Path, script: str, value: str) -> None:
    """A prolog fails with status 2 naming a bad IMEXD_MIN_NODES, before running imexd."""
    run = run_script(script, bin_dir, env={"IMEXD_DOMAIN": "r", "IMEXD_MIN_NODES": value})
    assert (run.status, run.of("imexd")) == (2, [])
    assert f"IMEXD_MIN_NODES={value}: expected a whole number of nodes" in run.logged("err")[0]


@pytest.mark.parametrize("script", ["imexd-epilog-perjob.sh", "imexd-epilog-shared.sh"])
def test_epilog_deletes_despite_a_bad_min_nodes(bin_dir: Path, script: str) -> None:
    """An epilog logs a bad IMEXD_MIN_NODES at err and deletes regardless (exit 0)."""
    run = run_script(script, bin_dir, env={"IMEXD_MIN_NODES": "x", "FAKE_HOSTS": "gpu-01\n"})
    assert run.status == 0
    assert [c[1] for c in run.of("imexd")] == ["delete"]
    assert "IMEXD_MIN_NODES=x" in run.logged("err")[0]


def test_shared_prolog_refuses_a_bad_wait(bin_dir: Path) -> None:
    """IMEXD_WAIT sets `workload create --wait`; a value that is no whole number fails."""
    bad = run_script(
        "imexd-prolog-shared.sh", bin_dir, env={"IMEXD_DOMAIN": "r", "IMEXD_WAIT": "1m"}
    )
    assert (bad.status, bad.of("imexd")) == (2, [])
    assert "IMEXD_WAIT=1m: expected a whole number of seconds" in bad.stderr
    good = run_script(
        "imexd-prolog-shared.sh", bin_dir, env={"IMEXD_DOMAIN": "r", "IMEXD_WAIT": "15"}
    )
    create = good.of("imexd")[0]
    assert create[create.index("--wait") + 1] == "15"


@pytest.mark.parametrize("shell", SHELLS)
def test_prolog_logs_every_step(bin_dir: Path, shell: str) -> None:
    """Each imexd call is logged (command line, each output line, exit status) through
    `logger -t imexd-slurm` at info, with the same lines on stderr."""
    table = "domain job-4242: UP\nNODE    SLOT  STATE\ngpu-01  0     READY"
    run = run_script(
        "imexd-prolog-perjob.sh",
        bin_dir,
        shell=shell,
        env={"FAKE_OUT_imexd_domain_create": table},
    )
    assert run.status == 0, run.stderr
    logged = run.logged("info")
    domain = f"job-{JOB}"
    assert (
        f"{domain}: running imexd domain create {domain} --nodes {NODES} --channel --uid 1001 "
        f"--gid 2002 --mode 0600 --wait 240 --config {CONFIG}" in logged
    )
    assert [m for m in logged if m.startswith(f"{domain}: domain create: ")] == [
        f"{domain}: domain create: {line}" for line in table.splitlines()
    ]
    assert [m for m in logged if " exited " in m] == [
        f"{domain}: imexd domain create exited 0",
    ]
    assert run.logged("err") == []
    assert run.stderr.splitlines() == [f"imexd-slurm: {m}" for m in logged]


def test_logging_survives_a_missing_logger(bin_dir: Path) -> None:
    """Without `logger` (or with a failing one) the lines still reach stderr."""
    (bin_dir / "logger").unlink()
    run = run_script("imexd-prolog-perjob.sh", bin_dir)
    assert run.status == 0, run.stderr
    assert f"imexd-slurm: job-{JOB}: imexd domain create exited 0" in run.stderr.splitlines()


def test_perjob_prolog_fails_fast_on_a_node_without_agent(bin_dir: Path) -> None:
    """`domain create` refusing a node that no agent reported (exit 2) fails the prolog at
    once with imexd's message at err, passing IMEXD_SEEN_WITHIN; nothing waits."""
    reason = (
        "imexd domain create: no agent reported node gpu-02 within 120 s (never): a typo, "
        "or a node without a running agent"
    )
    run = run_script(
        "imexd-prolog-perjob.sh",
        bin_dir,
        env={
            "IMEXD_SEEN_WITHIN": "120",
            "FAKE_EXIT_imexd_domain_create": "2",
            "FAKE_OUT_imexd_domain_create": reason,
        },
    )
    assert run.status == 2
    create, delete = run.of("imexd")
    assert create[create.index("--seen-within") + 1] == "120"
    assert delete[:2] == ["domain", "delete"]
    errors = run.logged("err")
    assert f"job-{JOB}: domain create: {reason}" in errors
    assert f"job-{JOB}: imexd domain create exited 2" in errors
    assert any("deleting the domain, the job does not start" in m for m in errors)


def test_perjob_prolog_passes_no_seen_within_by_default(bin_dir: Path) -> None:
    """Without IMEXD_SEEN_WITHIN the prolog leaves `domain create`'s own default."""
    run = run_script("imexd-prolog-perjob.sh", bin_dir)
    assert "--seen-within" not in run.of("imexd")[0]


def test_shared_prolog_names_the_nodes_without_channel(bin_dir: Path) -> None:
    """A `workload create` that times out logs imexd's table and reason at err, then one
    line naming each node that lacks the channel with its reason."""
    output = (
        "workload job-4242 in rack-07: created on channel 3 (generation 1, nodes "
        "gpu-01,gpu-02, uid 1001, gid 2002, mode 0600)\n"
        "workload job-4242 in rack-07: PENDING, 0 of 2 nodes ready (channel 3)\n"
        "NODE    READY  REASON       AGE\n"
        "gpu-01  no     MknodFailed  1s\n"
        "gpu-02  no     NoReport     -\n"
        "imexd: workload job-4242 in rack-07: not ready after 5 s (the record is kept): "
        "gpu-02 NoReport"
    )
    run = run_script(
        "imexd-prolog-shared.sh",
        bin_dir,
        env={
            "IMEXD_DOMAIN": "rack-07",
            "IMEXD_WAIT": "5",
            "FAKE_EXIT_imexd_workload_create": "1",
            "FAKE_OUT_imexd_workload_create": output,
        },
    )
    assert run.status == 1
    errors = run.logged("err")
    for line in output.splitlines():
        assert f"job-{JOB}: workload create: {line}" in errors
    assert (
        f"job-{JOB}: no channel on gpu-01 (MknodFailed), gpu-02 (NoReport) after 5 s: a node "
        "without a running imexd agent never reports one (imexd check, systemctl status "
        "imexd there)"
    ) in errors
    assert run.of("imexd")[-1][:2] == ["workload", "delete"]


@pytest.mark.parametrize("script", PROLOGS)
def test_prolog_logs_a_missing_imexd(bin_dir: Path, script: str) -> None:
    """An IMEXD that does not exist fails the prolog (127) with the shell's reason logged."""
    run = run_script(script, bin_dir, env={"IMEXD_DOMAIN": "r", "IMEXD": str(bin_dir / "no-imexd")})
    assert run.status == 127
    errors = run.logged("err")
    assert any("no-imexd" in m and "not found" in m for m in errors), errors


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "imexd-prolog-perjob.sh",
            [
                f"job-{JOB}: domain create: imexd domain create: no agent reported node {node} "
                "within 600 s (never)"
                for node in ("gpu-01", "gpu-02")
            ],
        ),
        (
            "imexd-prolog-shared.sh",
            [f"job-{JOB}: no channel on gpu-01 (NoReport), gpu-02 (NoReport) after 2 s: a node"],
        ),
    ],
)
def test_prolog_fails_fast_with_the_real_imexd(
    bin_dir: Path, broker: Mosquitto, script: str, expected: list[str]
) -> None:
    """Against a real broker with no agents, the real `imexd` refuses the job's nodes:
    the prolog fails within seconds (2 per job, 1 shared: not ready by IMEXD_WAIT), its
    err lines name every node and why, and it deletes what it created."""
    config = bin_dir.parent / "control.toml"
    config.write_text(f'[bus]\nurl = ["{broker.url}"]\n')
    env = {"IMEXD": str(IMEXD), "IMEXD_CONFIG": str(config), "IMEXD_DOMAIN": "rack-07"}
    started = time.monotonic()
    run = run_script(script, bin_dir, env=env | {"IMEXD_WAIT": "2"})
    assert run.status == (2 if "perjob" in script else 1), run.stderr
    assert time.monotonic() - started < 15
    errors = run.logged("err")
    for line in expected:
        assert any(m.startswith(line) for m in errors), (line, errors)
    kind = "domain" if "perjob" in script else "workload"
    assert run.logged("info")[-1] == f"job-{JOB}: imexd {kind} delete exited 0"


# ---------------------------------------------------------------------------------
# imexd-prolog.sh and imexd-epilog.sh: the pair that picks a layout per partition

LAYOUTS = {
    "IMEXD_LAYOUT_PERJOB": "gpu-a, gpu-b",
    "IMEXD_LAYOUT_SHARED": "rack07:rack-07,rack08:rack-08",
}
"""A mixed cluster's lists: two per-job partitions, two shared ones with their domains."""


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("role", ["prolog", "epilog"])
@pytest.mark.parametrize(
    ("partition", "domain"), [("gpu-b", ""), ("rack07", "rack-07"), ("rack08", "rack-08")]
)
def test_mixed_pair_runs_the_partitions_layout(
    bin_dir: Path, shell: str, role: str, partition: str, domain: str
) -> None:
    """The mixed prolog or epilog runs exactly the imexd command lines of the partition's
    layout's own script (per job, or shared in the partition's domain), and exits as it
    does."""
    layout = "shared" if domain else "perjob"
    env = LAYOUTS | {"SLURM_JOB_PARTITION": partition}
    run = run_script(f"imexd-{role}.sh", bin_dir, shell=shell, env=env)
    own = run_script(f"imexd-{role}-{layout}.sh", bin_dir, env={"IMEXD_DOMAIN": domain})
    assert run.status == own.status == 0, run.stderr
    assert run.of("imexd") == own.of("imexd")
    assert len(run.of("imexd")) == 1
    if layout == "shared":
        assert run.of("imexd")[0][:5] == [
            "workload", "create" if role == "prolog" else "delete", f"job-{JOB}", "--domain",
            domain,
        ]  # fmt: skip
    where = f", domain {domain}" if domain else ""
    assert run.logged("info")[0] == f"job {JOB}: partition {partition}: layout {layout}{where}"


@pytest.mark.parametrize("role", ["prolog", "epilog"])
def test_mixed_pair_reads_the_lists_from_the_settings_file(
    bin_dir: Path, tmp_path: Path, role: str
) -> None:
    """The lists come from the settings file; the partition's domain there wins over the
    file's IMEXD_DOMAIN, and IMEXD_PARTITIONS does not filter (the lists do)."""
    defaults = tmp_path / "slurm.env"
    defaults.write_text(
        "IMEXD_DOMAIN=rack-99\nIMEXD_PARTITIONS=gpu-a\nIMEXD_CONFIG=/etc/imexd/c2.toml\n"
        + "".join(f'{key}="{value}"\n' for key, value in LAYOUTS.items())
    )
    env = {"IMEXD_SLURM_ENV": str(defaults), "SLURM_JOB_PARTITION": "rack08"}
    run = run_script(f"imexd-{role}.sh", bin_dir, env=env)
    assert run.status == 0, run.stderr
    (call,) = run.of("imexd")
    assert call[3:5] == ["--domain", "rack-08"]
    assert call[-2:] == ["--config", "/etc/imexd/c2.toml"]


@pytest.mark.parametrize("status", [1, 2, 3])
def test_mixed_prolog_fails_with_the_layouts_prolog(bin_dir: Path, status: int) -> None:
    """A failing create fails the mixed prolog with imexd's status, after the layout's
    prolog deleted the workload again."""
    env = LAYOUTS | {
        "SLURM_JOB_PARTITION": "rack07",
        "FAKE_EXIT_imexd_workload_create": str(status),
    }
    run = run_script("imexd-prolog.sh", bin_dir, env=env)
    assert run.status == status
    assert [c[:2] for c in run.of("imexd")] == [["workload", "create"], ["workload", "delete"]]


@pytest.mark.parametrize("role", ["prolog", "epilog"])
@pytest.mark.parametrize("partition", ["cpu", ""])
def test_mixed_pair_skips_an_unlisted_partition(bin_dir: Path, role: str, partition: str) -> None:
    """A job on a partition in neither list (or on none) exits 0 at once, logging why at
    info, and runs neither scontrol nor imexd."""
    env = LAYOUTS | {"SLURM_JOB_PARTITION": partition}
    run = run_script(f"imexd-{role}.sh", bin_dir, env=env)
    assert (run.status, run.of("imexd"), run.of("scontrol")) == (0, [], [])
    assert run.logged() == [
        f"job {JOB}: partition {partition or '(none)'} is in neither IMEXD_LAYOUT_PERJOB "
        "(gpu-a, gpu-b) nor IMEXD_LAYOUT_SHARED (rack07:rack-07,rack08:rack-08): no IMEX, "
        "nothing to do"
    ]
    assert run.logged("info") == run.logged()


@pytest.mark.parametrize("role", ["prolog", "epilog"])
@pytest.mark.parametrize(
    ("lists", "reason"),
    [
        (
            {"IMEXD_LAYOUT_SHARED": "gpu-a:rack-07"},
            "partition gpu-a is in IMEXD_LAYOUT_PERJOB (gpu-a, gpu-b) and IMEXD_LAYOUT_SHARED "
            "(gpu-a:rack-07): name it in one",
        ),
        (
            {"IMEXD_LAYOUT_PERJOB": "", "IMEXD_LAYOUT_SHARED": "gpu-a:rack-07 gpu-a:rack-08"},
            "IMEXD_LAYOUT_SHARED=gpu-a:rack-07 gpu-a:rack-08: two domains for partition gpu-a",
        ),
        *(
            (
                {"IMEXD_LAYOUT_SHARED": f"rack07:rack-07,{entry}"},
                f"IMEXD_LAYOUT_SHARED=rack07:rack-07,{entry}: expected PARTITION:DOMAIN "
                f"pairs, not '{entry}'",
            )
            for entry in ("rack08", "rack08:", ":rack-08", "rack08:rack:08")
        ),
        (
            {"IMEXD_LAYOUT_PERJOB": "gpu-b,rack08:rack-08"},
            "IMEXD_LAYOUT_PERJOB=gpu-b,rack08:rack-08: expected partition names, not "
            "'rack08:rack-08' (PARTITION:DOMAIN pairs go in IMEXD_LAYOUT_SHARED)",
        ),
    ],
)
def test_mixed_pair_refuses_a_bad_setting(
    bin_dir: Path, role: str, lists: dict[str, str], reason: str
) -> None:
    """A partition in both lists, two domains for one partition or an entry of the wrong
    form fails the prolog with 2 and ends the epilog with 0, both naming the setting at
    err and running nothing."""
    env = {"IMEXD_LAYOUT_PERJOB": "gpu-a, gpu-b", "SLURM_JOB_PARTITION": "gpu-a"} | lists
    run = run_script(f"imexd-{role}.sh", bin_dir, env=env)
    status, consequence = (
        (2, "the job does not start") if role == "prolog" else (0, "nothing deleted")
    )
    assert (run.status, run.of("imexd"), run.of("scontrol")) == (status, [], [])
    assert run.logged("err") == [f"job {JOB}: {reason}; {consequence}"]


def test_mixed_epilog_deletes_after_a_harmless_change(bin_dir: Path, tmp_path: Path) -> None:
    """The epilog deletes what the prolog made after the settings file changed in what
    does not move the job's partition: the lists' order and separators, other
    partitions, IMEXD_DOMAIN and IMEXD_PARTITIONS."""
    defaults = tmp_path / "slurm.env"
    env = {"IMEXD_SLURM_ENV": str(defaults)}
    made, deleted = {}, {}
    for partition in ("gpu-b", "rack08"):
        defaults.write_text(
            'IMEXD_LAYOUT_PERJOB="gpu-a,gpu-b"\n'
            'IMEXD_LAYOUT_SHARED="rack07:rack-07,rack08:rack-08"\nIMEXD_DOMAIN=rack-07\n'
        )
        prolog = run_script(
            "imexd-prolog.sh", bin_dir, env=env | {"SLURM_JOB_PARTITION": partition}
        )
        assert prolog.status == 0, prolog.stderr
        made[partition] = prolog.of("imexd")[0][:5]
        defaults.write_text(
            'IMEXD_LAYOUT_PERJOB="gpu-c gpu-b gpu-a"\nIMEXD_PARTITIONS=cpu\n'
            'IMEXD_LAYOUT_SHARED="rack09:rack-09 rack08:rack-08 rack07:rack-07"\n'
            "IMEXD_DOMAIN=rack-09\n"
        )
        epilog = run_script(
            "imexd-epilog.sh", bin_dir, env=env | {"SLURM_JOB_PARTITION": partition}
        )
        assert (epilog.status, epilog.logged("err")) == (0, [])
        (delete,) = epilog.of("imexd")
        deleted[partition] = delete[:5]
    assert made == {
        "gpu-b": ["domain", "create", f"job-{JOB}", "--nodes", NODES],
        "rack08": ["workload", "create", f"job-{JOB}", "--domain", "rack-08"],
    }
    assert deleted == {
        "gpu-b": ["domain", "delete", f"job-{JOB}", "--wait", "30"],
        "rack08": ["workload", "delete", f"job-{JOB}", "--domain", "rack-08"],
    }


@pytest.mark.parametrize("role", ["prolog", "epilog"])
def test_mixed_pair_needs_the_layouts_script(bin_dir: Path, tmp_path: Path, role: str) -> None:
    """Installed without the picked layout's script beside it, the mixed prolog fails with
    2 and the epilog ends with 0, each naming the missing file at err."""
    installed = tmp_path / "etc-slurm"
    installed.mkdir()
    for name in (f"imexd-{role}.sh", "imexd-slurm-common.sh", f"imexd-{role}-perjob.sh"):
        shutil.copy(SLURM / name, installed / name)
    env = LAYOUTS | {"SLURM_JOB_PARTITION": "rack07"}
    run = run_script(f"imexd-{role}.sh", bin_dir, env=env, folder=installed)
    status, consequence = (
        (2, "the job does not start") if role == "prolog" else (0, "nothing deleted")
    )
    assert (run.status, run.of("imexd")) == (status, [])
    missing = installed / f"imexd-{role}-shared.sh"
    assert run.logged("err") == [
        f"job {JOB}: cannot read {missing}: install it beside this script; {consequence}"
    ]
