"""The command line: exit codes and one-line errors instead of tracebacks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from imexd.demo.brokers import free_port


def _imexd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "imexd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_fatal_start_error_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """An agent that cannot bind its health port says so on one line and exits 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "imexd.toml"
        config.write_text(
            f'[node]\nname = "n1"\naddress = "127.0.0.1"\nclique = ""\n'
            f'state_dir = "{tmp_path / "state"}"\n'
            f'[bus]\nurl = "mqtt://127.0.0.1:{free_port()}"\n'
            f'[imex]\nrun_dir = "{tmp_path / "run"}"\nhosts_file = "{tmp_path / "hosts"}"\n'
            f'[health]\nlisten = "127.0.0.1:{port}"\n'
        )
        proc = _imexd("run", "--config", str(config))
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_usage_errors_exit_2() -> None:
    """An unknown subcommand is a usage error (argparse's exit 2)."""
    proc = _imexd("no-such-command")
    assert proc.returncode == 2


def test_a_closed_pipe_is_not_a_traceback() -> None:
    """Output whose reader went away (`| head`) ends quietly instead of a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "imexd", "config", "--example"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr
