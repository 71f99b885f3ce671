"""The simulator's file and name rules: config.cfg, nodes_config.cfg, hosts, identity."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imexd.sim.cfgfile import ImexConfigError, is_ip, parse_config_text
from imexd.sim.config import (
    SimEnv,
    config_from_values,
    find_identity,
    load_config,
    node_list_digest,
    read_node_list,
)
from imexd.sim.hosts import (
    Resolver,
    dialable,
    hosts_file_from_environ,
    parse_hosts,
    same_address,
)


def test_config_text_skips_comments_and_blank_lines() -> None:
    """`KEY=value` lines with `#` comments and blank lines, spaces trimmed."""
    text = "# IMEX\n\nLOG_LEVEL=3\n  SERVER_PORT = 51000\nLOG_FILE_NAME=\n"
    assert parse_config_text(text, "c") == {
        "LOG_LEVEL": "3",
        "SERVER_PORT": "51000",
        "LOG_FILE_NAME": "",
    }


def test_defaults_are_imex_defaults() -> None:
    """Absent keys take nvidia-imex's documented defaults."""
    cfg = config_from_values({}, "/etc/nvidia-imex/config.cfg")
    assert (cfg.server_port, cfg.cmd_port, cfg.log_level) == (50000, 50005, 4)
    assert cfg.daemonize
    assert cfg.cmd_enabled
    assert cfg.log_append
    assert cfg.wait_for_quorum == "RECOVERY"
    assert cfg.node_config_file == "/etc/nvidia-imex/nodes_config.cfg"
    assert cfg.log_file_name == "/var/log/nvidia-imex.log"
    assert cfg.disconnected_grace_time == -1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("SERVER_PORT", "0"),
        ("SERVER_PORT", "http"),
        ("DAEMONIZE", "yes"),
        ("LOG_LEVEL", "7"),
        ("IMEX_WAIT_FOR_QUORUM", "ALL"),
        ("BIND_INTERFACE_IP", "node-a"),
        ("IMEX_NODE_DISCONNECTED_GRACE_TIME", "-5"),
    ],
)
def test_bad_values_name_the_key_and_value(key: str, value: str) -> None:
    """A wrong value fails with a message naming the key and the value."""
    with pytest.raises(ImexConfigError) as caught:
        config_from_values({key: value}, "c.cfg")
    assert key in str(caught.value)
    assert value in str(caught.value)


def test_a_line_without_equals_is_rejected() -> None:
    """A line that is not `KEY=value` is an error naming the line."""
    with pytest.raises(ImexConfigError, match="line 2"):
        parse_config_text("A=1\nnonsense\n", "c.cfg")


def test_missing_config_is_the_real_message(tmp_path: Path) -> None:
    """A missing config.cfg: `Unable to open configuration file at <path>`."""
    path = str(tmp_path / "config.cfg")
    with pytest.raises(ImexConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"Unable to open configuration file at {path}"


def test_node_list_and_its_digest(tmp_path: Path) -> None:
    """Entries keep their order; the digest changes with order or content."""
    path = tmp_path / "nodes_config.cfg"
    path.write_text("imex-abc-0000\n10.0.0.2\n\n# spare\nimex-abc-0002\n")
    entries = read_node_list(str(path))
    assert entries == ["imex-abc-0000", "10.0.0.2", "imex-abc-0002"]
    assert node_list_digest(entries) == node_list_digest(list(entries))
    assert node_list_digest(entries) != node_list_digest(entries[::-1])
    assert node_list_digest(entries) != node_list_digest([*entries, "x"])


@pytest.mark.parametrize("content", [None, "", "\n# nothing\n"])
def test_unreadable_node_list_is_the_real_message(tmp_path: Path, content: str | None) -> None:
    """Missing or empty: `Failed to read node configuration file <path>`."""
    path = tmp_path / "nodes_config.cfg"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ImexConfigError) as caught:
        read_node_list(str(path))
    assert str(caught.value) == f"Failed to read node configuration file {path}"


def test_hosts_format_first_address_wins() -> None:
    """/etc/hosts rules: comments, aliases, case-insensitive names, first line wins."""
    table = parse_hosts(
        "127.0.0.1 localhost\n"
        "# 10.9.9.9 imex-abc-0000\n"
        "10.0.0.1 imex-abc-0000 alias-a  # node a\n"
        "10.0.0.9 IMEX-ABC-0000\n"
        "not-an-ip imex-abc-0001\n"
        "fd00::2 imex-abc-0002\n"
    )
    assert table["imex-abc-0000"] == "10.0.0.1"
    assert table["alias-a"] == "10.0.0.1"
    assert "imex-abc-0001" not in table
    assert table["imex-abc-0002"] == "fd00::2"


async def test_resolver_uses_only_the_hosts_file(tmp_path: Path) -> None:
    """With IMEXD_SIM_HOSTS_FILE, names come from it alone; addresses stay as they are."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 imex-abc-0001\n127.20.0.1 imex-abc-0000\n")
    resolver = Resolver(str(hosts))
    got = await resolver.resolve(["imex-abc-0000", "imex-abc-0001", "localhost", "10.0.0.5"])
    assert got == ["127.20.0.1", "127.0.0.2", None, "10.0.0.5"]
    hosts.write_text("127.20.0.7 imex-abc-0001\n")
    assert await resolver.resolve(["imex-abc-0001"]) == ["127.20.0.7"]
    assert await Resolver(str(tmp_path / "missing")).resolve(["imex-abc-0000"]) == [None]


async def test_system_resolver_answers_localhost() -> None:
    """Without a hosts file the system resolver is asked."""
    (address,) = await Resolver(None).resolve(["localhost"])
    assert address in ("127.0.0.1", "::1")


def test_identity_is_the_entry_of_the_bind_address() -> None:
    """The first entry resolving to BIND_INTERFACE_IP, else to a local address."""
    addresses: list[str | None] = [None, "127.30.0.2", "127.30.0.3", "127.30.0.2"]
    assert find_identity(addresses, "127.30.0.2") == 1
    assert find_identity(addresses, "127.30.0.9") is None
    assert find_identity(addresses, "", ["127.30.0.3", "10.1.1.1"]) == 2
    assert find_identity(["::1"], "0:0:0:0:0:0:0:1") == 0


def test_the_sentinel_and_unresolved_entries_are_never_dialled() -> None:
    """Empty slots point at 127.0.0.2: never connected, never queried."""
    assert not dialable("127.0.0.2")
    assert not dialable(None)
    assert dialable("127.0.0.3")
    assert dialable("::ffff:7f00:2")  # another family: dialled, as ipaddress says


_ADDRESSES = st.one_of(
    st.ip_addresses().map(str),
    st.ip_addresses(v=6).map(lambda a: a.exploded),
    st.sampled_from(["127.0.0.2", "127.000.0.2", "gpu-a", "", "::1", "0:0:0:0:0:0:0:1"]),
)


@given(_ADDRESSES, _ADDRESSES)
def test_addresses_compare_as_ipaddress_compares_them(a: str, b: str) -> None:
    """`same_address` skips `ipaddress` for two dotted quads (the `-N` path imports it
    for nothing else): its verdict is still that of `ipaddress`, else of the text."""
    try:
        expected = ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        expected = a == b
    assert same_address(a, b) is expected


def test_environment_knobs_are_checked() -> None:
    """IMEXD_SIM_* values are read with defaults; a bad one names the variable."""
    env = SimEnv.from_environ({"IMEXD_SIM_RELOAD_WINDOW_S": "1.5", "IMEXD_SIM_CMD_HANG": "1"})
    assert env.reload_window_s == 1.5
    assert env.cmd_hang
    assert env.version == "570.172"
    assert env.exit_after_s is None
    assert SimEnv.from_environ({"IMEXD_SIM_EXIT_AFTER_S": "0"}).exit_after_s == 0
    with pytest.raises(ImexConfigError, match="IMEXD_SIM_START_DELAY_S"):
        SimEnv.from_environ({"IMEXD_SIM_START_DELAY_S": "soon"})
    with pytest.raises(ImexConfigError, match="IMEXD_SIM_EXIT_CODE"):
        SimEnv.from_environ({"IMEXD_SIM_EXIT_CODE": "300"})
    assert hosts_file_from_environ({"IMEXD_SIM_HOSTS_FILE": "/h"}) == "/h"


def _ipaddress_says(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    "text",
    [
        "0.0.0.0",
        "127.0.0.1",
        "255.255.255.255",
        "256.1.1.1",
        "01.2.3.4",
        "1.2.3",
        "1.2.3.4.5",
        "1.2.3.4 ",
        "1..3.4",
        "\u0661.2.3.4",
        "+1.2.3.4",
        "::1",
        "fe80::1%eth0",
        "::ffff:1.2.3.4",
        "node-a",
        "",
    ],
)
def test_is_ip_agrees_with_ipaddress(text: str) -> None:
    """The quick check of dotted quads (so that `ctl -q` need not import ipaddress)
    accepts and refuses exactly what `ipaddress` does."""
    assert is_ip(text) == _ipaddress_says(text)


@given(st.lists(st.text("0123456789+-\u0661 ", max_size=4), min_size=1, max_size=5))
def test_is_ip_agrees_with_ipaddress_on_any_dotted_text(parts: list[str]) -> None:
    """The same for any dots and digits, signs, spaces and non-ASCII digits."""
    text = ".".join(parts)
    assert is_ip(text) == _ipaddress_says(text)
