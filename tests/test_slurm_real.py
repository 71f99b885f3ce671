"""The Slurm scripts of config/slurm under a real Slurm: Debian's slurmctld and slurmd.

The module starts its own munged (own key and socket), slurmctld and slurmd (one node:
this host, two CPUs) from a slurm.conf in a temporary folder, on free ports, without
systemd or cgroups (`ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`).
`PrologSlurmctld`, `EpilogSlurmctld` and `TaskProlog` are the shipped scripts, installed
into a folder of their own by the `install` lines of docs/operations.md (the scripts of
both layouts, and beside them the common file that the prologs and epilogs source), each
started by a two-line wrapper that only sets what /etc/imexd/slurm.env and the system
PATH would give them on a real controller (slurmctld passes its scripts no environment):
`IMEXD_SLURM_ENV` (this folder's settings file), `SLURM_CONF` (for `scontrol`; a real
controller has /etc/slurm/slurm.conf) and a PATH whose first folder holds a fake `imexd`
and a fake `logger`. The fake imexd records its arguments and the job's variables,
writes the workload's env file as an agent would (for the TaskProlog), and fails when a
test tells it to. Partition `gpu` (OverSubscribe=EXCLUSIVE) is listed in IMEXD_PARTITIONS,
partition `cpu` is not; for the pair that picks a layout by partition (imexd-prolog.sh,
imexd-epilog.sh) `gpu` is per job and `rack` shared (domain rack-08).

Skipped, with the reason, when the Slurm or munge programs are missing, when not root
(slurmd runs jobs as their user), or when the daemons do not come up within 30 s.
Reproduce by hand: `apt-get install slurm-wlm munge`, then
`.venv/bin/pytest -q tests/test_slurm_real.py`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from imexd.demo.brokers import free_port
from tests.support import wait_for

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "operations.md"
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "scancel")
MISSING = [name for name in PROGRAMS if shutil.which(name, path="/usr/sbin:/usr/bin") is None]
START_S = 30.0
"""How long the daemons may take to come up before the module is skipped."""
JOB_S = 60.0
"""How long one job (prolog, task, epilog) may take."""
SEPARATOR = "\x1f"

pytestmark = [
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"no {', '.join(MISSING)}: apt-get install slurm-wlm munge to run these tests",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd must run as root to start jobs"),
    pytest.mark.timeout(240),
]

FAKE_IMEXD = r"""#!/bin/sh
# A fake imexd: record the call and the job's variables, act like the control plane and
# an agent for create and delete, and fail when $DIR/fail-<command>-<action> exists
# (its first line the exit status, the rest the message).
dir=@DIR@
sep=$(printf '\037')
line=""
for arg in "$@"; do
    line="$line$arg$sep"
done
printf '%s%s%s%s%s\n' "$line" "${SLURM_SCRIPT_CONTEXT:-}" "$sep" "${SLURM_JOB_PARTITION:-}" \
    "$sep${SLURM_JOB_UID:-}" >>"$dir/imexd.log"
fail=$dir/fail-${1:-}-${2:-}
if [ -f "$fail" ]; then
    sed 1d "$fail" >&2
    exit "$(head -n 1 "$fail")"
fi
name=${3:-}
case "${1:-} ${2:-}" in
"domain create") channel=0 domain=$name ;;
"workload create") channel=3 domain=$5 ;;
"domain delete" | "workload delete")
    rm -f "$dir/workloads/$name.env"
    echo "$name: deleted"
    exit 0
    ;;
*)
    echo "$name: ready"
    exit 0
    ;;
esac
printf 'IMEX_CHANNEL=%s\nIMEXD_WORKLOAD=%s\nIMEXD_DOMAIN=%s\nIMEXD_CHANNEL_DEVICE=%s\n' \
    "$channel" "$name" "$domain" "/dev/nvidia-caps-imex-channels/channel$channel" \
    >"$dir/workloads/$name.env"
echo "workload $name in $domain: created on channel $channel"
"""

FAKE_LOGGER = r"""#!/bin/sh
# A fake logger: `logger -t TAG -p PRIORITY MESSAGE` appends TAG PRIORITY MESSAGE.
printf '%s\037%s\037%s\n' "$2" "$4" "$5" >>@DIR@/logger.log
"""

WRAPPER = """#!/bin/sh
IMEXD_SLURM_ENV={dir}/slurm.env PATH={dir}/bin SLURM_CONF={dir}/slurm.conf \\
    exec /bin/sh {script} "$@"
"""
WRAPPER_BY_LAYOUT = """#!/bin/sh
layout=$(cat {dir}/layout)  # perjob, shared, or mixed: the pair that picks by partition
[ "$layout" != mixed ] || layout=""
IMEXD_SLURM_ENV={dir}/slurm.env PATH={dir}/bin SLURM_CONF={dir}/slurm.conf \\
    exec /bin/sh {installed}/imexd-{kind}${{layout:+-$layout}}.sh "$@"
"""


def install_scripts(folder: Path) -> None:
    """Run the `install` lines of docs/operations.md with `folder` for /etc/slurm, the
    per-job line also for the shared layout; fail unless they install every script."""
    lines = [
        line
        for line in OPERATIONS.read_text().splitlines()
        if line.startswith("install ") and "config/slurm/" in line
    ]
    lines += [line.replace("-perjob", "-shared") for line in lines if "-perjob" in line]
    for line in lines:
        subprocess.run(
            ["sh", "-c", line.replace("/etc/slurm/", f"{folder}/")],
            cwd=ROOT,
            check=True,
            timeout=10,
        )
    shipped = sorted(path.name for path in (ROOT / "config" / "slurm").glob("*.sh"))
    assert sorted(path.name for path in folder.iterdir()) == shipped, lines


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on which nothing listens now, outside the ephemeral range
    (`imexd.demo.brokers.free_port`)."""
    return [free_port() for _ in range(count)]


@dataclass
class Cluster:
    """The running Slurm: its folder, environment for the client commands, and helpers."""

    dir: Path
    env: dict[str, str]

    def command(self, *args: str, timeout: float = JOB_S) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def imexd_calls(self, job: str) -> list[list[str]]:
        """The fake imexd's calls for job <job>: argv, then script context, partition, uid."""
        log = self.dir / "imexd.log"
        lines = log.read_text().splitlines() if log.exists() else []
        calls = [line.split(SEPARATOR) for line in lines]
        return [call for call in calls if f"job-{job}" in call]

    def logged(self, job: str) -> list[tuple[str, str, str]]:
        """(tag, priority, message) of the lines the scripts logged about job <job>."""
        log = self.dir / "logger.log"
        lines = log.read_text().splitlines() if log.exists() else []
        rows = [tuple(line.split(SEPARATOR)) for line in lines]
        return [(r[0], r[1], r[2]) for r in rows if f"job {job}:" in r[2] or f"job-{job}" in r[2]]

    def job_field(self, job: str, field: str) -> str:
        """One `Key=value` field of `scontrol show job` (empty when the job is gone)."""
        shown = self.command("scontrol", "-o", "show", "job", job).stdout
        for item in shown.split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        return ""

    def logs(self) -> str:
        """The tail of the daemons' logs, for a failure message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.dir / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)


def _write_files(folder: Path) -> tuple[Path, str]:
    """Write slurm.conf, the settings file, the wrappers and the fakes; return the conf
    and the node name."""
    node = socket.gethostname().split(".")[0]
    for sub in ("munge", "state", "spool", "log", "bin", "workloads", "etc-slurm"):
        (folder / sub).mkdir(mode=0o700)
    installed = folder / "etc-slurm"
    install_scripts(installed)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for name, text in (("imexd", FAKE_IMEXD), ("logger", FAKE_LOGGER)):
        path = folder / "bin" / name
        path.write_text(text.replace("@DIR@", str(folder)))
        path.chmod(0o755)
    (folder / "layout").write_text("perjob")
    (folder / "slurm.env").write_text(
        f"IMEXD={folder}/bin/imexd\nIMEXD_CONFIG={folder}/control.toml\n"
        "IMEXD_PARTITIONS=gpu\nIMEXD_MIN_NODES=1\nIMEXD_DOMAIN=rack-07\nIMEXD_WAIT=5\n"
        f"IMEXD_CHANNELS_ENV_DIR={folder}/workloads\n"
        "IMEXD_LAYOUT_PERJOB=gpu\nIMEXD_LAYOUT_SHARED=rack:rack-08\n"
    )
    for kind in ("prolog", "epilog"):
        wrapper = folder / f"{kind}.sh"
        wrapper.write_text(WRAPPER_BY_LAYOUT.format(dir=folder, installed=installed, kind=kind))
        wrapper.chmod(0o755)
    task = folder / "taskprolog.sh"
    task.write_text(WRAPPER.format(dir=folder, script=installed / "imexd-taskprolog.sh"))
    task.chmod(0o755)
    ctld_port, slurmd_port = free_ports(2)
    conf = folder / "slurm.conf"
    conf.write_text(
        f"""ClusterName=imexdtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge/socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
PrologSlurmctld={folder}/prolog.sh
EpilogSlurmctld={folder}/epilog.sh
TaskProlog={folder}/taskprolog.sh
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=gpu Nodes={node} Default=YES OverSubscribe=EXCLUSIVE MaxTime=INFINITE State=UP
PartitionName=cpu Nodes={node} MaxTime=INFINITE State=UP
PartitionName=rack Nodes={node} MaxTime=INFINITE State=UP
"""
    )
    return conf, node


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Stop the daemons this module started, last first: SIGTERM, then SIGKILL."""
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _start(folder: Path, processes: list[subprocess.Popen[bytes]]) -> tuple[Cluster, str]:
    """Start munged, slurmctld and slurmd in `folder`, appending them to `processes`;
    return the cluster and "" once the node is idle, or why not after START_S."""
    conf, node = _write_files(folder)
    env = {"PATH": "/usr/sbin:/usr/bin:/bin", "SLURM_CONF": str(conf), "HOME": str(folder)}
    started = Cluster(folder, env)
    daemons = [
        ["munged", "--foreground", "--force", f"--socket={folder}/munge/socket",
         f"--key-file={folder}/munge/munge.key", f"--pid-file={folder}/munge/pid",
         f"--log-file={folder}/log/munged.log", f"--seed-file={folder}/munge/seed"],
        ["slurmctld", "-D", "-i", "-f", str(conf)],
        ["slurmd", "-D", "-N", node, "-f", str(conf)],
    ]  # fmt: skip
    for argv in daemons:
        with (folder / "log" / f"{argv[0]}.out").open("wb") as out:
            processes.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        if argv[0] == "munged":
            # slurmctld needs munge's socket at once.
            deadline = time.monotonic() + START_S
            while not (folder / "munge" / "socket").exists():
                if time.monotonic() > deadline or processes[0].poll() is not None:
                    return started, f"munged did not start within {START_S:g} s"
                time.sleep(0.1)
    deadline = time.monotonic() + START_S
    while True:
        state = started.command("sinfo", "-h", "-N", "-o", "%T", timeout=10).stdout.split()
        if state and all(s == "idle" for s in state):
            return started, ""
        exited = [a[0] for a, p in zip(daemons, processes, strict=True) if p.poll() is not None]
        if exited:
            return started, f"{', '.join(exited)} exited"
        if time.monotonic() > deadline:
            return started, f"node {state} after {START_S:g} s"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """munged, slurmctld and slurmd of this module, up and the node idle. A start that
    fails because another program took a port between picking and binding is tried
    again on new ports (three times at most)."""
    why = ""
    for _ in range(3):
        processes: list[subprocess.Popen[bytes]] = []
        try:
            started, why = _start(tmp_path_factory.mktemp("slurm"), processes)
            if not why:
                yield started
                with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                    started.command("scancel", "--user=root", timeout=10)
                return
            logs = started.logs()
        finally:
            _stop(processes)
        if "Address already in use" not in logs:
            break
    pytest.skip(f"Slurm did not come up ({why})\n{logs}")


@pytest.fixture
def slurm(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with the per-job layout and no failure asked of the fake imexd."""
    (cluster.dir / "layout").write_text("perjob")
    yield cluster
    for fail in cluster.dir.glob("fail-*"):
        fail.unlink()


def srun_env(slurm: Cluster, partition: str) -> tuple[str, dict[str, str]]:
    """Run `srun env` on a partition; return the job id and the task's environment."""
    done = slurm.command("srun", "-p", partition, "-N", "1", "-t", "1", "env")
    assert done.returncode == 0, done.stderr + slurm.logs()
    task = dict(line.partition("=")[::2] for line in done.stdout.splitlines() if "=" in line)
    return task["SLURM_JOB_ID"], task


@pytest.mark.parametrize(("layout", "channel"), [("perjob", "0"), ("shared", "3")])
def test_job_gets_its_channel(slurm: Cluster, layout: str, channel: str) -> None:
    """Slurm runs the prolog with the job's variables, the TaskProlog's exports reach the
    task's environment, and the epilog deletes what the prolog created."""
    (slurm.dir / "layout").write_text(layout)
    job, task = srun_env(slurm, "gpu")
    assert task["IMEX_CHANNEL"] == channel
    assert task["IMEXD_WORKLOAD"] == f"job-{job}"
    assert task["IMEXD_CHANNEL_DEVICE"] == f"/dev/nvidia-caps-imex-channels/channel{channel}"
    create = slurm.imexd_calls(job)[0]
    node = socket.gethostname().split(".")[0].lower()
    if layout == "perjob":
        assert create[:5] == ["domain", "create", f"job-{job}", "--nodes", node]
        assert create[5:12] == ["--channel", "--uid", "0", "--gid", "0", "--mode", "0600"]
    else:
        assert create[:7] == ["workload", "create", f"job-{job}", "--domain", "rack-07",
                              "--nodes", node]  # fmt: skip
        assert create[create.index("--wait") + 1] == "5"
    assert create[-3:] == ["prolog_slurmctld", "gpu", "0"]

    def deleted() -> bool:
        return any(c[1] == "delete" for c in slurm.imexd_calls(job))

    wait_for(deleted, timeout=JOB_S, interval=0.2, what=f"the epilog's delete of job-{job}")
    delete = next(c for c in slurm.imexd_calls(job) if c[1] == "delete")
    assert delete[-3:] == ["epilog_slurmctld", "gpu", "0"]
    assert not (slurm.dir / "workloads" / f"job-{job}.env").exists()
    tags = {tag for tag, _, _ in slurm.logged(job)}
    assert tags == {"imexd-slurm"}
    assert ("user.info", f"job-{job}: imexd {create[0]} create exited 0") in {
        (priority, message) for _, priority, message in slurm.logged(job)
    }


def test_other_partition_is_not_touched(slurm: Cluster) -> None:
    """A job on partition cpu (not in IMEXD_PARTITIONS) runs without imexd and without
    IMEX variables; prolog and epilog log why they skipped it."""
    job, task = srun_env(slurm, "cpu")
    assert "IMEX_CHANNEL" not in task

    def both_skipped() -> bool:
        return len(slurm.logged(job)) >= 2

    wait_for(
        both_skipped,
        timeout=JOB_S,
        interval=0.2,
        what=f"the prolog's and epilog's skip lines for job {job}",
    )
    assert slurm.imexd_calls(job) == []
    reason = "partition cpu is not in IMEXD_PARTITIONS (gpu)"
    assert [(p, reason in m) for _, p, m in slurm.logged(job)] == [("user.info", True)] * 2


def test_failing_prolog_requeues_a_batch_job(slurm: Cluster) -> None:
    """A prolog failing because a node has no live agent logs imexd's reason, deletes the
    domain again, and Slurm 22.05 runs the epilog and requeues the batch job: pending,
    eligible again only minutes later (when it all repeats)."""
    reason = "imexd domain create: no agent reported node x within 600 s (never)"
    (slurm.dir / "fail-domain-create").write_text(f"2\n{reason}\n")
    submitted = slurm.command("sbatch", "--parsable", "-p", "gpu", "-t", "1",
                              "-o", "/dev/null", "--wrap", "true")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        # The failed start ends the job's run: Slurm runs EpilogSlurmctld, then requeues.
        wait_for(
            lambda: len(slurm.imexd_calls(job)) >= 3,
            timeout=JOB_S,
            interval=0.2,
            what=f"the epilog of job {job}",
        )
        wait_for(
            lambda: slurm.job_field(job, "JobState") == "PENDING",
            timeout=JOB_S,
            interval=0.2,
            what=f"job {job} pending again after the failed prolog",
        )
        assert slurm.job_field(job, "Restarts") == "1"
        assert slurm.job_field(job, "BatchFlag") == "1"
        assert [(c[1], c[-3]) for c in slurm.imexd_calls(job)] == [
            ("create", "prolog_slurmctld"),
            ("delete", "prolog_slurmctld"),
            ("delete", "epilog_slurmctld"),
        ]
        # Slurm holds the requeued job back for a while (two minutes in 22.05).
        eligible = datetime.fromisoformat(slurm.job_field(job, "EligibleTime"))
        assert eligible > datetime.now() + timedelta(seconds=60)
        errors = [m for _, p, m in slurm.logged(job) if p == "user.err"]
        assert f"job-{job}: domain create: {reason}" in errors
        assert f"job-{job}: imexd domain create exited 2" in errors
    finally:
        slurm.command("scancel", job, timeout=10)


def test_failing_prolog_kills_an_srun_job(slurm: Cluster) -> None:
    """An interactive job (srun) whose prolog fails is killed, not requeued: srun fails."""
    (slurm.dir / "fail-domain-create").write_text("1\nbroker unreachable\n")
    done = slurm.command("srun", "-p", "gpu", "-N", "1", "-t", "1", "true")
    assert done.returncode != 0
    assert "PrologSlurmctld failed" in done.stderr


def test_mixed_pair_picks_the_layout_by_partition(slurm: Cluster) -> None:
    """With imexd-prolog.sh and imexd-epilog.sh, a job on `gpu` gets its own domain and one
    on `rack` a workload in rack-08 (IMEXD_PARTITIONS, which lists only gpu, is not used:
    the layout lists are the filter); each task sees its channel, and each epilog
    deletes what its prolog made."""
    (slurm.dir / "layout").write_text("mixed")
    node = socket.gethostname().split(".")[0].lower()
    perjob, task = srun_env(slurm, "gpu")
    assert task["IMEX_CHANNEL"] == "0"
    shared, task = srun_env(slurm, "rack")
    assert (task["IMEX_CHANNEL"], task["IMEXD_DOMAIN"]) == ("3", "rack-08")

    def deleted() -> bool:
        return all(len(slurm.imexd_calls(job)) == 2 for job in (perjob, shared))

    wait_for(
        deleted,
        timeout=JOB_S,
        interval=0.2,
        what=f"the epilogs' deletes of jobs {perjob} and {shared}",
    )
    assert [c[:5] + c[-3:-1] for c in slurm.imexd_calls(perjob)] == [
        ["domain", "create", f"job-{perjob}", "--nodes", node, "prolog_slurmctld", "gpu"],
        ["domain", "delete", f"job-{perjob}", "--wait", "30", "epilog_slurmctld", "gpu"],
    ]
    assert [c[:5] + c[-3:-1] for c in slurm.imexd_calls(shared)] == [
        ["workload", "create", f"job-{shared}", "--domain", "rack-08", "prolog_slurmctld", "rack"],
        ["workload", "delete", f"job-{shared}", "--domain", "rack-08", "epilog_slurmctld", "rack"],
    ]
    assert ("user.info", f"job {shared}: partition rack: layout shared, domain rack-08") in {
        (priority, message) for _, priority, message in slurm.logged(shared)
    }
