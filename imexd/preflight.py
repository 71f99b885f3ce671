"""What the settings name on this host: files that must be readable, programs that must run.

Apart from imexd.settings, which validates values without touching the host, because
settings are also built for other machines (the tests, the demo's and the benchmark's
agents, the Kubernetes manifests checked offline). The CLI runs these checks where the
files are used: `imexd run` and `imexd config` check both the bus's files and the IMEX
programs, the control-plane commands the bus's files. A missing file is one problem
naming the key, the path and why, reported with the other wrong keys (exit 2), instead of
a TLS or spawn error retried without a name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from imexd.errors import ConfigError
from imexd.settings import Settings

BUS_FILES = ("ca_file", "cert_file", "key_file", "password_file")
"""[bus] keys that name files the agent and the control plane read (empty: unused)."""
PROGRAMS = ("binary", "ctl")
"""[imex] keys that name the programs the agent runs."""


def unreadable(path: str) -> str | None:
    """None when `path` is a file this process can open for reading, else why not."""
    try:
        with Path(path).open("rb"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def not_runnable(program: str) -> str | None:
    """None when `program` (a path, or a name on PATH) is an executable file, else why."""
    if "/" in program:
        target = Path(program)
        if not target.exists():
            return "no such file"
        if not target.is_file():
            return "not a file"
        return None if os.access(target, os.X_OK) else "not executable"
    if shutil.which(program) is not None:
        return None
    return f"not found on PATH ({os.environ.get('PATH', os.defpath)})"


def bus_file_problems(settings: Settings) -> list[str]:
    """One line per [bus] file that is set and cannot be read."""
    problems = []
    for key in BUS_FILES:
        path: str = getattr(settings.bus, key)
        if path and (why := unreadable(path)):
            problems.append(f"bus.{key} = {path!r}: cannot read it: {why}")
    return problems


def program_problems(settings: Settings) -> list[str]:
    """One line per [imex] program that cannot run. A node with `[node] clique = ""` (no
    multi-node NVLink) runs no daemon and needs neither."""
    if settings.node.clique == "":
        return []
    problems = []
    for key in PROGRAMS:
        program: str = getattr(settings.imex, key)
        if why := not_runnable(program):
            problems.append(
                f"imex.{key} = {program!r}: {why} (install the nvidia-imex package of the "
                "driver's version, or set the path)"
            )
    return problems


def check(settings: Settings, *, programs: bool) -> None:
    """Raise ConfigError naming every missing file (and, with `programs`, program)."""
    problems = bus_file_problems(settings)
    if programs:
        problems += program_problems(settings)
    if problems:
        raise ConfigError(problems)
