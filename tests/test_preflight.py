"""The host checks of `imexd run` and `imexd config`: the run folder and the node address.

Real folders under tmp_path; where a test runs as root, whom no permission stops, the
refusal of a folder's permissions is faked by replacing `os.access`.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from imexd import preflight
from imexd.errors import ConfigError
from imexd.settings import NodeSettings, Settings, node_address_problem, settings_from_mapping


def _settings(*, run_dir: Path, clique: str = "c1", address: str = "") -> Settings:
    return settings_from_mapping(
        {
            "node": {"name": "n1", "address": address, "clique": clique},
            "imex": {"run_dir": str(run_dir)},
        },
        environ={},
    )


def test_a_creatable_or_writable_run_dir_passes(tmp_path: Path) -> None:
    """A folder that exists and can be written, or one that can be made below an
    existing folder, is no problem."""
    assert preflight.uncreatable(str(tmp_path)) is None
    assert preflight.uncreatable(str(tmp_path / "a" / "b" / "run")) is None


def test_a_path_that_no_one_can_create_is_named_with_what_is_in_the_way(tmp_path: Path) -> None:
    """A regular file where the folder should be, or above it, is a reason for every
    user: `imexd config` and `imexd run` both refuse it."""
    (tmp_path / "file").write_text("")
    assert preflight.uncreatable(str(tmp_path / "file")) == ("not a directory", False)
    assert preflight.uncreatable(str(tmp_path / "file" / "a" / "run")) == (
        f"cannot create it: {tmp_path / 'file'} is not a directory",
        False,
    )
    settings = _settings(run_dir=tmp_path / "file" / "run")
    for agent in (False, True):
        with pytest.raises(ConfigError) as info:
            preflight.check(settings, programs=True, agent=agent)
        assert info.value.problems[-1].startswith(
            f"imex.run_dir = '{tmp_path / 'file' / 'run'}': cannot create it: "
        )


def test_a_node_without_a_daemon_needs_no_run_dir(tmp_path: Path) -> None:
    """`clique = ""` runs no daemon: its run_dir and its address are not checked."""
    (tmp_path / "file").write_text("")
    settings = _settings(run_dir=tmp_path / "file" / "run", clique="", address="1.2.3.4")
    assert preflight.run_dir_problems(settings, agent=True) == []
    assert preflight.warnings(settings) == []


def test_a_folder_this_user_cannot_write_stops_the_agent_and_warns_the_config_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Permission is the user's: `imexd run` (the agent) refuses to start, while `imexd
    config`, which another user may run for the agent, only warns."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    def access(path: object, mode: int, **kwargs: object) -> bool:
        if Path(str(path)) == locked:
            return False
        return real_access(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)
    settings = _settings(run_dir=locked / "run")
    why = f"imex.run_dir = '{locked / 'run'}': cannot create it in {locked}: permission denied"
    [problem] = preflight.run_dir_problems(settings, agent=True)
    assert problem.startswith(why)
    assert preflight.run_dir_problems(settings, agent=False) == []
    [warning] = preflight.warnings(settings)
    assert warning.startswith(why)
    assert warning.endswith("; `imexd run` as this user refuses to start")


def test_only_an_address_no_interface_holds_is_not_local() -> None:
    """Any 127.0.0.0/8 address and every address of an interface are this host's; one no
    interface holds gets the host's addresses and what to set."""
    held = [
        a.address.split("%", 1)[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family.name in ("AF_INET", "AF_INET6")
    ]
    for address in ("127.0.0.1", "127.45.6.7", *held):
        assert node_address_problem(_node(address)) is None, address
    elsewhere = next(a for a in ("203.0.113.77", "198.51.100.77", "192.0.2.77") if a not in held)
    why = node_address_problem(_node(elsewhere))
    assert why is not None
    assert why.startswith("not an address of this host (")
    assert why.endswith("set node.address to the node's address on the IMEX network")


def _node(address: str) -> NodeSettings:
    return NodeSettings(name="n1", address=address, clique="c1")
