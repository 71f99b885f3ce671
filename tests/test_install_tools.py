"""scripts/install-tools, which scripts/test runs as root for what a fresh machine lacks:
it installs packages without starting or enabling any service they ship. Run against
fake apt-get, dpkg-query, deb-systemd-helper and update-rc.d, so the machine is not
touched."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install-tools"

FAKES = {
    "apt-get": r"""#!/bin/bash
echo "apt-get $*" >> "$LOG"
[ "$1" = install ] || exit 0
"$POLICY" slurmd start; echo "policy answered $?" >> "$LOG"
for package in "${@:5}"; do
    echo "$package" >> "$DB"
    [ "$package" = slurm-wlm ] && echo slurmd >> "$DB"
done
exit 0
""",
    "dpkg-query": r"""#!/bin/bash
if [ "$1" = -W ]; then sed 's/^/ii  /' "$DB"; exit 0; fi
[ "$1" = -L ] && cat "$FILES/$2" 2>/dev/null
exit 0
""",
    "deb-systemd-helper": '#!/bin/bash\necho "deb-systemd-helper $*" >> "$LOG"\n',
    "update-rc.d": '#!/bin/bash\necho "update-rc.d $*" >> "$LOG"\n',
}

UNITS = {
    "slurmd": "/usr/lib/systemd/system/slurmd.service\n/etc/init.d/slurmd\n/usr/sbin/slurmd\n",
    "munge": "/lib/systemd/system/munge.service\n/usr/sbin/munged\n",
    "mosquitto": "/lib/systemd/system/mosquitto.service\n/lib/systemd/system/x@.service\n",
}


def run(tmp_path: Path, *packages: str, policy_exists: bool = False) -> tuple[list[str], Path]:
    """Run the script with fakes on PATH; the fakes' log and the policy-rc.d path."""
    bin_dir, files = tmp_path / "bin", tmp_path / "files"
    bin_dir.mkdir()
    files.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for package, listing in UNITS.items():
        (files / package).write_text(listing)
    db, log, policy = tmp_path / "db", tmp_path / "log", tmp_path / "policy-rc.d"
    db.write_text("mosquitto\n")  # installed before: its unit is the machine's business
    if policy_exists:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DB": str(db),
        "LOG": str(log),
        "FILES": str(files),
        "POLICY": str(policy),
        "IMEXD_POLICY_RC_D": str(policy),
    }
    subprocess.run(
        ["bash", str(SCRIPT), *packages],
        env=env,
        check=True,
        timeout=30,
        capture_output=True,
    )
    return log.read_text().splitlines(), policy


def test_nothing_starts_while_it_installs_and_nothing_it_added_stays_enabled(
    tmp_path: Path,
) -> None:
    """Every start is refused during the install; the units and init scripts of the
    packages it added (slurmd, pulled in by slurm-wlm, and munge) are disabled after."""
    log, policy = run(tmp_path, "slurm-wlm", "munge")
    assert log[:3] == [
        "apt-get update -qq",
        "apt-get install -y -qq --no-install-recommends slurm-wlm munge",
        "policy answered 101",
    ]
    assert sorted(log[3:]) == [
        "deb-systemd-helper disable munge.service",
        "deb-systemd-helper disable slurmd.service",
        "update-rc.d slurmd disable",
    ]
    assert not policy.exists(), "the script's own policy-rc.d is removed after the install"


def test_a_package_that_was_installed_before_keeps_its_units(tmp_path: Path) -> None:
    """A package already on the machine (mosquitto here) is not touched, and template
    units are never disabled."""
    log, _ = run(tmp_path, "mosquitto")
    assert not [line for line in log if "disable" in line]


def test_a_policy_rc_d_the_machine_has_is_left_in_place(tmp_path: Path) -> None:
    """Where the machine has its own policy-rc.d, the script uses it and keeps it."""
    log, policy = run(tmp_path, "munge", policy_exists=True)
    assert "policy answered 101" in log
    assert policy.read_text() == "#!/bin/sh\nexit 101\n"


def test_no_packages_is_no_apt_call(tmp_path: Path) -> None:
    """Called with nothing to install, it runs no apt-get at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "apt-get").chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(SCRIPT)], env=env, check=True, timeout=30)
