"""What the settings name on this host: files that must be readable, programs that must run,
the control plane's keys, the folder the daemon's config is written to, and the node's
address.

Apart from imexd.settings, which validates values without touching the host, because
settings are also built for other machines (the tests, the demo's and the benchmark's
agents, the Kubernetes manifests checked offline). The CLI runs these checks where the
files are used: `imexd run` and `imexd config` check both the bus's files and the IMEX
programs, the control-plane commands the bus's files. A missing file is one problem
naming the key, the path and why, reported with the other wrong keys (exit 2), instead of
a TLS or spawn error retried without a name. An address no interface holds yet is only
a warning: it may come up after the agent starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from imexd.errors import ConfigError
from imexd.settings import Settings, node_address_problem
from imexd.signing import key_problems

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


def uncreatable(path: str) -> tuple[str, bool] | None:
    """None when `path` is a folder this process can write in, or can create; else why
    not, and whether the reason is this user's (permission denied) rather than the
    path's (a regular file in the way, a read-only file system), which holds for all."""
    target = Path(path)
    try:
        if target.exists():
            if not target.is_dir():
                return "not a directory", False
            return _unwritable(target, "cannot write in it")
        parent = target.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot create it: {parent} is not a directory", False
        return _unwritable(parent, f"cannot create it in {parent}")
    except OSError as exc:
        return f"cannot look at it: {exc.strerror or exc}", False


def _unwritable(folder: Path, doing: str) -> tuple[str, bool] | None:
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return f"{doing}: read-only file system", False
    return f"{doing}: permission denied (uid {os.geteuid()})", True


def _run_dir(settings: Settings) -> tuple[str, bool] | None:
    """Why the daemon's config cannot be written into [imex] run_dir; None on a node that
    runs no daemon."""
    if settings.node.clique == "":
        return None
    found = uncreatable(settings.imex.run_dir)
    if found is None:
        return None
    why, mine = found
    return f"imex.run_dir = {settings.imex.run_dir!r}: {why}", mine


def run_dir_problems(settings: Settings, *, agent: bool) -> list[str]:
    """The [imex] run_dir when no one can write it, and with `agent` (this process is the
    agent) also when this user cannot: the agent would retry the daemon's config forever."""
    found = _run_dir(settings)
    return [found[0]] if found is not None and (agent or not found[1]) else []


def warnings(settings: Settings) -> list[str]:
    """What `imexd config` warns of, one line each: what the agent runs with but fails on
    (a `[node] address` no interface holds: the agent logs it as
    `agent.address_not_local`), and a run_dir that only this user cannot write (the agent
    may run as another, and systemd's RuntimeDirectory= creates it for the agent)."""
    lines = []
    if why := node_address_problem(settings.node):
        lines.append(f"node.address = {settings.node.address!r}: {why}")
    if (found := _run_dir(settings)) is not None and found[1]:
        lines.append(f"{found[0]}; `imexd run` as this user refuses to start")
    return lines


def check(settings: Settings, *, programs: bool, agent: bool = False) -> None:
    """Raise ConfigError naming every missing file and every `[control]` key that cannot
    be loaded (and, with `programs`, program and run folder; `agent`: as
    `run_dir_problems`)."""
    problems = bus_file_problems(settings)
    problems += key_problems(settings.control.private_key, settings.control.public_key)
    if programs:
        problems += program_problems(settings) + run_dir_problems(settings, agent=agent)
    if problems:
        raise ConfigError(problems)
