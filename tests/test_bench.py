"""Every benchmark script starts: its imports resolve from any working folder (the
harness puts the checkout's tests on the path once) and `--help` exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "harness.py")


def test_the_scripts_are_found() -> None:
    """SCRIPTS is read from the folder, so a new benchmark is checked without an edit
    here; a wrong folder would leave it empty and the case below would check nothing."""
    assert "formation.py" in SCRIPTS
    assert "scale.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts_from_any_folder(script: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout, done.stdout
