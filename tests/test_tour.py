"""The README's 5-minute tour, run as written: its shell blocks, in order, in a private
folder, on free ports and a private loopback range (the only changes made to the text).

A new user copies these blocks first; a tour that fails is the first hour ending red.
Each block runs in one bash; what the tour says a step shows is checked after it, with
bounded waits where the tour's own `sleep` is a person's pause (a loaded machine may need
longer).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from imexd.demo.brokers import free_port
from tests.support import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
MOSQUITTO = shutil.which("mosquitto", path="/usr/sbin:/usr/bin")


def tour_blocks() -> list[str]:
    """The ```sh blocks of the README's tour section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A 5-minute tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


def health_prefix() -> str:
    """A four-digit prefix P whose ports P1, P2 and P3 are free (the tour's `944$i`)."""
    for _ in range(100):
        prefix = str(free_port() // 10)
        if len(prefix) != 4:
            continue
        try:
            for i in (1, 2, 3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", int(f"{prefix}{i}")))
        except OSError:
            continue
        return prefix
    raise AssertionError("no free health ports")


class Tour:
    """The tour's blocks with its paths, ports and addresses made private."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / "imexd-tour"
        self.broker_port = str(free_port())
        self.health = health_prefix()
        self.net = f"127.251.{os.getpid() % 250}."
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
        self.env["PATH"] = f"{VENV_BIN}:{self.env.get('PATH', '')}:/usr/sbin"

    def text(self, block: str) -> str:
        return (
            block.replace("/tmp/imexd-tour", str(self.folder))
            .replace("18830", self.broker_port)
            .replace("944", self.health)
            .replace("127.60.0.", self.net)
        )

    def run(self, block: str, *, strict: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one block in the tour folder (its first block makes it); `strict`: stop at
        the first failing command and fail the test with the block's output."""
        cwd = self.folder if self.folder.exists() else self.root
        script = ("set -e\n" if strict else "") + self.text(block)
        # Files, not pipes: the processes a block starts in the background keep its
        # stdout open, and a pipe would be read until they end.
        out, err = self.root / "block.out", self.root / "block.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            code = subprocess.run(
                ["bash", "-c", script],
                cwd=cwd,
                env=self.env,
                stdout=stdout,
                stderr=stderr,
                timeout=120,
                check=False,
            ).returncode
        done = subprocess.CompletedProcess(script, code, out.read_text(), err.read_text())
        if strict:
            assert done.returncode == 0, f"{script}\n--- out\n{done.stdout}\n--- err\n{done.stderr}"
        return done

    def imexd(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV_BIN / "imexd"), *args],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def ready(self, i: int) -> bool:
        return self.imexd("check", "--config", f"n{i}/imexd.toml").returncode == 0

    def pids(self) -> list[int]:
        """The broker's and agents' pids the tour wrote down."""
        return [int(p.read_text()) for p in self.folder.glob("**/*.pid")]

    def leftovers(self) -> list[str]:
        """Processes that still run from the tour's folder (agents, daemons, the broker)."""
        mine = str(self.folder)
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if mine in cmdline:
                found.append(f"{proc.info['pid']}: {cmdline}")
        return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(MOSQUITTO is None, reason="the tour needs mosquitto (scripts/test installs it)")
@pytest.mark.skipif(
    shutil.which("jq") is None, reason="the tour needs jq (scripts/test installs it)"
)
@pytest.mark.timeout(300)
def test_the_readme_tour_runs_as_written(tmp_path: Path) -> None:
    """Every block of the tour succeeds in order and shows what the tour says: three ready
    nodes, a crashed daemon restarted, a leave reloaded not restarted, the domain UP on
    two named nodes, a workload's channel made and removed, and nothing left running."""
    tour = Tour(tmp_path)
    activate, start, imex_view, crash, control, workload, render, clean = tour_blocks()
    assert activate.strip() == ". .venv/bin/activate"
    started: list[int] = []
    try:
        tour.run(start)
        started = tour.pids()
        wait_for(
            lambda: all(tour.ready(i) for i in (1, 2, 3)), timeout=60, what="the three nodes ready"
        )
        assert "Domain State" in tour.run(imex_view).stdout

        tour.run(crash, strict=False)
        wait_for(lambda: tour.ready(3), timeout=60, what="node-3 ready after its daemon crashed")
        wait_for(
            lambda: (
                tour.imexd(
                    "domain",
                    "status",
                    "tour",
                    "--config",
                    "n1/imexd.toml",
                    "--nodes",
                    "node-1,node-3",
                ).returncode
                == 0
            ),
            timeout=60,
            what="node-1 and node-3 UP after node-2 left",
        )
        log = (tour.folder / "n1" / "agent.log").read_text()
        assert '"event": "daemon.reload"' in log or '"event":"daemon.reload"' in log

        shown = tour.run(control, strict=False)
        assert "UNKNOWN" in shown.stdout + shown.stderr
        assert "UP, 2 of 2" in shown.stdout

        made = tour.run(workload)
        assert "READY, 2 of 2 nodes ready" in made.stdout, made.stdout
        assert "export " in made.stdout, made.stdout
        for i in (1, 3):
            for folder in ("dev", "cdi", "workloads"):
                assert not any((tour.folder / f"n{i}" / folder).iterdir()), (i, folder)

        assert "imex-" in tour.run(render).stdout

        tour.run(clean)
        assert not tour.folder.exists()
        wait_for(
            lambda: not tour.leftovers() and not any(map(alive, started)),
            timeout=30,
            what="nothing of the tour running",
            seen=lambda: (tour.leftovers(), [p for p in started if alive(p)]),
        )
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for line in tour.leftovers():
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
