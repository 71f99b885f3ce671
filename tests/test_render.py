"""Rendering: config.cfg, nodes_config.cfg, the hosts block, and `imexd render`."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from imexd.cli.main import main
from imexd.errors import ConfigError
from imexd.imex import EMPTY_SLOT_ADDRESS, check_extra
from imexd.membership.slots import resolve
from imexd.messages import MemberRecord, MemberState, address_problem
from imexd.render import (
    RenderError,
    merge_hosts,
    parse_hosts_block,
    remove_hosts_block,
    render_config,
    render_hosts_block,
    render_nodes_config,
    render_nodes_config_addresses,
    render_nodes_config_names,
    slot_name,
    verify_hosts_block,
)
from imexd.settings import ImexSettings, NodeSettings, Settings

# Every config.cfg key IMEX.md lists, copied here so that a key dropped from the
# renderer fails a test.
IMEX_KEYS = [
    "LOG_LEVEL",
    "LOG_FILE_NAME",
    "STATS_FILE_NAME",
    "LOG_APPEND_TO_LOG",
    "LOG_FILE_MAX_SIZE",
    "LOG_MAX_ROTATE_COUNT",
    "LOG_USE_SYSLOG",
    "DAEMONIZE",
    "BIND_INTERFACE_IP",
    "SERVER_PORT",
    "IMEX_NODE_CONFIG_FILE",
    "NETWORK_INTERFACE",
    "IMEX_WAIT_FOR_QUORUM",
    "IMEX_ENABLE_AUTH_ENCRYPTION",
    "IMEX_AUTH_ENCRYPTION_MODE",
    "IMEX_AUTH_SOURCE",
    "IMEX_SERVER_KEY",
    "IMEX_SERVER_CERT",
    "IMEX_SERVER_CERT_AUTH",
    "IMEX_CLIENT_KEY",
    "IMEX_CLIENT_CERT",
    "IMEX_CLIENT_CERT_AUTH",
    "IMEX_SECURITY_TARGET_OVERRIDE",
    "IMEX_GSS_SERVICE_NAME",
    "IMEX_GSS_TIMEOUT_SEC",
    "IMEX_GSS_RETRY_INTERVAL_SEC",
    "IMEX_GSS_SEC_CONTEXT_LIFETIME_SEC",
    "IMEX_GSS_SHUTDOWN_ON_FAILURE",
    "IMEX_CMD_ENABLED",
    "IMEX_CMD_BIND_INTERFACE_IP",
    "IMEX_CMD_PORT",
    "IMEX_CMD_UNIX_DOMAIN_PATH",
    "IMEX_NODE_DISCONNECTED_GRACE_TIME",
]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "render.md"


def _settings(*, extra: Mapping[str, str] | None = None, run_dir: str = "/run/imexd") -> Settings:
    return Settings(
        node=NodeSettings(name="gpu-a", address="10.0.0.1", clique="c.1"),
        imex=ImexSettings(
            run_dir=run_dir,
            server_port=51000,
            cmd_port=51005,
            extra=MappingProxyType(dict(extra or {})),
        ),
    )


def _config_values(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        assert key not in values, f"{key} twice"
        values[key] = value
    return values


# config.cfg


def test_config_lists_every_imex_key_once() -> None:
    """config.cfg holds every key IMEX.md documents, each exactly once."""
    values = _config_values(render_config(_settings()))
    assert set(IMEX_KEYS) <= set(values)


def test_config_lines_are_key_equals_value() -> None:
    """Every line is a `KEY=value` line without spaces around `=`, or the one header comment."""
    lines = render_config(_settings()).splitlines()
    assert lines[0].startswith("# ")
    for line in lines[1:]:
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", line), line


def test_config_sets_what_the_agent_needs() -> None:
    """The agent's own values replace IMEX's defaults; the rest keeps IMEX's defaults."""
    values = _config_values(render_config(_settings(run_dir="/var/run/x")))
    assert values["DAEMONIZE"] == "0"
    assert values["LOG_FILE_NAME"] == ""
    assert values["BIND_INTERFACE_IP"] == "10.0.0.1"
    assert values["IMEX_CMD_BIND_INTERFACE_IP"] == "10.0.0.1"
    assert values["SERVER_PORT"] == "51000"
    assert values["IMEX_CMD_PORT"] == "51005"
    assert values["IMEX_CMD_ENABLED"] == "1"
    assert values["IMEX_NODE_CONFIG_FILE"] == "/var/run/x/nodes_config.cfg"
    assert values["LOG_LEVEL"] == "4"
    assert values["IMEX_WAIT_FOR_QUORUM"] == "RECOVERY"
    assert values["IMEX_ENABLE_AUTH_ENCRYPTION"] == "0"
    assert values["IMEX_NODE_DISCONNECTED_GRACE_TIME"] == "-1"


def test_config_address_argument_wins() -> None:
    """An explicit address replaces the settings' node address in both bind keys."""
    values = _config_values(render_config(_settings(), address="fd00::7"))
    assert values["BIND_INTERFACE_IP"] == values["IMEX_CMD_BIND_INTERFACE_IP"] == "fd00::7"


def test_config_extra_overrides_in_place_and_appends_sorted() -> None:
    """Extra keys override a known key where it stands and new keys come last, sorted."""
    text = render_config(
        _settings(extra={"ZZ_NEW": "1", "IMEX_WAIT_FOR_QUORUM": "NONE", "AA_NEW": "x y"})
    )
    keys = [line.partition("=")[0] for line in text.splitlines()[1:]]
    assert keys[-2:] == ["AA_NEW", "ZZ_NEW"]
    assert keys[:-2] == list(_config_values(render_config(_settings())))
    assert "IMEX_WAIT_FOR_QUORUM=NONE\n" in text
    assert "AA_NEW=x y\n" in text


def test_config_is_stable_for_the_same_input() -> None:
    """The same settings give the same bytes, whatever order the extra table came in."""
    a = render_config(_settings(extra={"B": "2", "A": "1"}))
    b = render_config(_settings(extra={"A": "1", "B": "2"}))
    assert a == b == render_config(_settings(extra={"A": "1", "B": "2"}))


@pytest.mark.parametrize("key", ["DAEMONIZE", "IMEX_NODE_CONFIG_FILE", "SERVER_PORT"])
def test_config_refuses_reserved_extra_keys(key: str) -> None:
    """An extra key the agent owns is a ConfigError that names the key."""
    assert check_extra({key: "1"})
    with pytest.raises(ConfigError, match=key):
        render_config(_settings(extra={key: "1"}))


# nodes_config.cfg


def test_slot_name_is_pinned() -> None:
    """Slot names never change between versions: a rename would restart every daemon."""
    assert slot_name("job-1", "abc.1", 0) == "imex-33039d26-0000"
    assert slot_name("job-1", "abc.1", 17) == "imex-33039d26-0017"


@given(
    st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True),
    st.from_regex(r"([A-Za-z0-9][A-Za-z0-9._-]{0,20})?", fullmatch=True),
    st.integers(0, 2047),
)
def test_slot_name_format(domain: str, clique: str, slot: int) -> None:
    """A slot name is `imex-<8 lowercase hex>-<slot:04d>`, a valid DNS-1123 label."""
    name = slot_name(domain, clique, slot)
    assert re.fullmatch(r"imex-[0-9a-f]{8}-[0-9]{4}", name)
    assert int(name[-4:]) == slot


@given(
    st.tuples(st.text(max_size=8), st.text(max_size=8)),
    st.tuples(st.text(max_size=8), st.text(max_size=8)),
)
def test_slot_names_differ_across_domains_and_cliques(
    a: tuple[str, str], b: tuple[str, str]
) -> None:
    """Two different (domain, clique) pairs never share slot names."""
    assume(a != b)
    assert slot_name(*a, 0) != slot_name(*b, 0)


@given(st.integers(1, 2048))
def test_names_mode_has_exactly_max_nodes_lines(max_nodes: int) -> None:
    """Names mode: exactly max_nodes lines, slot i on line i, nothing else."""
    text = render_nodes_config_names("job-1", "c.1", max_nodes)
    lines = text.split("\n")
    assert lines[-1] == ""
    assert lines[:-1] == [slot_name("job-1", "c.1", i) for i in range(max_nodes)]


def test_addresses_mode_lists_members_in_slot_order_skipping_gaps() -> None:
    """Addresses mode: member addresses by slot, empty slots left out."""
    text = render_nodes_config_addresses({5: "10.0.0.6", 0: "10.0.0.1", 2: "10.0.0.3"})
    assert text == "10.0.0.1\n10.0.0.3\n10.0.0.6\n"


def test_render_nodes_config_dispatches_on_mode() -> None:
    """The mode picks the format; an unknown mode is a ValueError."""
    slots = {1: "10.0.0.2"}
    assert render_nodes_config(
        domain="d", clique="c", max_nodes=2, mode="names", slots=slots
    ) == render_nodes_config_names("d", "c", 2)
    assert (
        render_nodes_config(domain="d", clique="c", max_nodes=2, mode="addresses", slots=slots)
        == "10.0.0.2\n"
    )
    with pytest.raises(ValueError, match="mode"):
        render_nodes_config(domain="d", clique="c", max_nodes=2, mode="other", slots=slots)


def _record(node: str, slot: int | None, state: str = "member", **kw: object) -> MemberRecord:
    fields: dict[str, object] = {
        "node": node,
        "domain": "job-1",
        "clique": "c.1",
        "address": f"10.0.0.{(slot or 0) + 1}",
        "slot": slot,
        "incarnation": 1,
        "state": MemberState(state),
        "max_nodes": 4,
        "mode": "names",
    }
    fields.update(kw)
    return MemberRecord(**fields)  # type: ignore[arg-type]


# hosts: strategies

_MARKER_RE = re.compile(r"^(# BEGIN imexd \S+|# END imexd)$")


def _has_marker(text: str) -> bool:
    return any(_MARKER_RE.match(line.rstrip(" \t\r")) for line in text.split("\n"))


_line = st.one_of(
    st.text(st.characters(blacklist_characters="\n"), max_size=30),
    st.sampled_from(
        [
            "127.0.0.1 localhost",
            "::1 localhost ip6-localhost",
            "# comment",
            "",
            "\r",
            "  # BEGIN imexd x",
            "# BEGIN imexd",
            "# END imexd x",
            "#END imexd",
            "10.0.0.9 imex-0123abcd-0001",
            "127.0.0.2 imex-0123abcd-0002\r",
            "caf\u00e9 \udcff bytes",
        ]
    ),
)
surrounding = st.builds(
    lambda lines, sep, end: sep.join(lines) + (sep if end and lines else ""),
    st.lists(_line, max_size=8),
    st.sampled_from(["\n", "\r\n"]),
    st.booleans(),
).filter(lambda t: not _has_marker(t))
domains = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?", fullmatch=True)
cliques = st.from_regex(r"([A-Za-z0-9][A-Za-z0-9._-]{0,12})?", fullmatch=True)
addresses = st.ip_addresses().map(str).filter(lambda a: address_problem(a) is None)


@st.composite
def slot_maps(draw: st.DrawFn) -> tuple[int, dict[int, str | None]]:
    max_nodes = draw(st.integers(1, 24))
    slots = draw(
        st.dictionaries(st.integers(0, max_nodes - 1), st.none() | addresses, max_size=max_nodes)
    )
    return max_nodes, slots


def _full(max_nodes: int, slots: Mapping[int, str | None]) -> dict[int, str | None]:
    return {i: slots.get(i) for i in range(max_nodes)}


# hosts: properties


@given(surrounding, domains, cliques, slot_maps())
def test_merge_then_remove_gives_back_the_text(
    text: str, domain: str, clique: str, sm: tuple[int, dict[int, str | None]]
) -> None:
    """Removing the block from a merged text gives back the original bytes exactly."""
    max_nodes, slots = sm
    merged = merge_hosts(text, domain, clique, slots, max_nodes)
    assert remove_hosts_block(merged) == text


@given(surrounding, domains, cliques, slot_maps())
def test_merge_appends_and_keeps_the_text_as_prefix(
    text: str, domain: str, clique: str, sm: tuple[int, dict[int, str | None]]
) -> None:
    """Into a text without a block, the block is appended after the untouched text."""
    max_nodes, slots = sm
    merged = merge_hosts(text, domain, clique, slots, max_nodes)
    assert merged.startswith(text)
    assert merged.rstrip("\n").endswith("# END imexd")


@given(surrounding, domains, cliques, slot_maps())
def test_merge_is_idempotent(
    text: str, domain: str, clique: str, sm: tuple[int, dict[int, str | None]]
) -> None:
    """Applying the same merge twice changes nothing."""
    max_nodes, slots = sm
    once = merge_hosts(text, domain, clique, slots, max_nodes)
    assert merge_hosts(once, domain, clique, slots, max_nodes) == once


@given(surrounding, domains, cliques, slot_maps())
def test_parse_inverts_merge(
    text: str, domain: str, clique: str, sm: tuple[int, dict[int, str | None]]
) -> None:
    """parse(merge(x)) gives back the domain and every slot's address (None: empty)."""
    max_nodes, slots = sm
    merged = merge_hosts(text, domain, clique, slots, max_nodes)
    assert parse_hosts_block(merged) == (domain, _full(max_nodes, slots))


@given(st.tuples(surrounding, surrounding), domains, cliques, slot_maps(), slot_maps())
def test_merge_replaces_a_block_in_the_middle(
    texts: tuple[str, str],
    domain: str,
    clique: str,
    old: tuple[int, dict[int, str | None]],
    new: tuple[int, dict[int, str | None]],
) -> None:
    """A block between two texts is replaced where it stands; both texts keep their bytes."""
    before, after = texts
    assume(before == "" or before.endswith("\n"))
    old_block = render_hosts_block("old-domain", "x", old[1], old[0])
    current = before + old_block + after
    merged = merge_hosts(current, domain, clique, new[1], new[0])
    assert merged == before + render_hosts_block(domain, clique, new[1], new[0]) + after
    assert remove_hosts_block(merged) == before + after


@given(surrounding, domains, domains, cliques, slot_maps())
def test_merge_drops_every_other_domains_block(
    text: str, stale: str, domain: str, clique: str, sm: tuple[int, dict[int, str | None]]
) -> None:
    """A node is in one domain at a time: merging leaves exactly one block, its own."""
    max_nodes, slots = sm
    stale_block = render_hosts_block("z", "s", {}, 1)
    with_stale = stale_block + merge_hosts(text, stale, "s", {0: "10.9.9.9"}, 3)
    merged = merge_hosts(with_stale, domain, clique, slots, max_nodes)
    begins = [line for line in merged.split("\n") if re.match(r"# BEGIN imexd \S+$", line)]
    assert begins == [f"# BEGIN imexd {domain}"]
    assert merged.startswith(f"# BEGIN imexd {domain}\n")
    assert remove_hosts_block(merged) == text


# hosts: examples


def test_merge_into_text_without_final_newline() -> None:
    """A text without a final newline gets one before the block, and gets it back on removal."""
    merged = merge_hosts("127.0.0.1 localhost", "d", "c", {0: "10.0.0.1"}, 1)
    assert merged == (
        f"127.0.0.1 localhost\n# BEGIN imexd d\n10.0.0.1 {slot_name('d', 'c', 0)}\n# END imexd"
    )
    assert remove_hosts_block(merged) == "127.0.0.1 localhost"


def test_merge_into_empty_text() -> None:
    """An empty (or missing) hosts file becomes the block alone, newline-terminated."""
    merged = merge_hosts("", "d", "c", {}, 2)
    assert merged == (
        f"# BEGIN imexd d\n127.0.0.2 {slot_name('d', 'c', 0)}\n"
        f"127.0.0.2 {slot_name('d', 'c', 1)}\n# END imexd\n"
    )
    assert remove_hosts_block(merged) == ""


def test_crlf_text_keeps_its_line_endings() -> None:
    """CRLF lines outside the block stay CRLF; the block itself uses LF."""
    text = "127.0.0.1 localhost\r\n10.0.0.5 other\r\n"
    merged = merge_hosts(text, "d", "c", {0: "10.0.0.1"}, 1)
    assert merged.startswith(text)
    assert remove_hosts_block(merged) == text


def test_unterminated_block_owns_only_its_slot_lines() -> None:
    """A BEGIN without END takes only the slot lines right after it, never the rest."""
    text = (
        "127.0.0.1 localhost\n"
        "# BEGIN imexd old\n"
        "10.0.0.1 imex-0123abcd-0000\n"
        "10.0.0.2 imex-0123abcd-0001\n"
        "10.1.1.1 database\n"
        "10.1.1.2 cache\n"
    )
    assert remove_hosts_block(text) == "127.0.0.1 localhost\n10.1.1.1 database\n10.1.1.2 cache\n"
    merged = merge_hosts(text, "d", "c", {}, 1)
    assert merged == (
        "127.0.0.1 localhost\n"
        + render_hosts_block("d", "c", {}, 1)
        + "10.1.1.1 database\n10.1.1.2 cache\n"
    )


def test_begin_at_end_of_file_without_newline() -> None:
    """A lone BEGIN line at the very end is removed together with the newline before it."""
    assert remove_hosts_block("a\n# BEGIN imexd x") == "a"
    assert parse_hosts_block("a\n# BEGIN imexd x") == ("x", {})


def test_begin_inside_a_block_ends_the_first_one() -> None:
    """A second BEGIN before any END closes the first block at its last slot line."""
    text = (
        "# BEGIN imexd a\n10.0.0.1 imex-0123abcd-0000\nkeep me\n"
        "# BEGIN imexd b\n10.0.0.2 imex-0123abcd-0000\n# END imexd\ntail\n"
    )
    assert remove_hosts_block(text) == "keep me\ntail\n"
    assert parse_hosts_block(text) == ("a", {0: "10.0.0.1"})


def test_terminated_block_owns_everything_between_its_markers() -> None:
    """Between BEGIN and END every line is the block's (foreign lines there are dropped)."""
    text = "x\n# BEGIN imexd a\nhand edit\n10.0.0.1 imex-0123abcd-0003\n# END imexd\ny\n"
    assert remove_hosts_block(text) == "x\ny\n"
    assert parse_hosts_block(text) == ("a", {3: "10.0.0.1"})


def test_stray_end_marker_is_kept() -> None:
    """An END marker with no BEGIN is ordinary text and survives the merge."""
    text = "# END imexd\n127.0.0.1 localhost\n"
    merged = merge_hosts(text, "d", "c", {}, 1)
    assert merged.startswith(text)
    assert remove_hosts_block(merged) == text


def test_markers_tolerate_trailing_whitespace() -> None:
    """Markers are recognised with trailing spaces, tabs or a CR (an editor's doing)."""
    text = "# BEGIN imexd a \t\r\n10.0.0.1 imex-0123abcd-0000\r\n# END imexd  \nz\n"
    assert remove_hosts_block(text) == "z\n"


def test_parse_without_block_is_none() -> None:
    """A text with no imexd block parses to None."""
    assert parse_hosts_block("127.0.0.1 localhost\n") is None


def test_non_utf8_bytes_survive_as_surrogates() -> None:
    """Text decoded with surrogateescape keeps undecodable bytes through merge and removal."""
    text = b"10.0.0.9 caf\xe9\n".decode("utf-8", "surrogateescape")
    merged = merge_hosts(text, "d", "c", {}, 1)
    assert remove_hosts_block(merged).encode("utf-8", "surrogateescape") == b"10.0.0.9 caf\xe9\n"


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ({0: EMPTY_SLOT_ADDRESS}, "sentinel"),
        ({0: "gpu-a"}, "not an IP address"),
        ({4: "10.0.0.1"}, "outside"),
        ({-1: "10.0.0.1"}, "outside"),
    ],
)
def test_merge_refuses_bad_slots(slots: dict[int, str | None], match: str) -> None:
    """A slot out of range, a non-address or the sentinel as an address is a ValueError."""
    with pytest.raises(ValueError, match=match):
        merge_hosts("", "d", "c", slots, 4)


def test_merge_refuses_a_bad_domain() -> None:
    """A domain name with spaces could not be parsed back from its marker: ValueError."""
    with pytest.raises(ValueError, match="domain"):
        merge_hosts("", "a b", "c", {}, 1)


HOSTILE_ADDRESSES = [
    ("fe80::1%x\n10.66.6.6 imex-00000000-0000 login-node", "zone id"),
    ("fe80::1%eth0", "zone id"),
    ("10.0.0.1 evil-name", "not an IP address"),
    ("10.0.0.1\n10.66.6.6 login-node", "not an IP address"),
    ("0.0.0.0", "unspecified"),
    ("ff02::1", "multicast"),
    ("2001:DB8::1", "not canonical"),
    (EMPTY_SLOT_ADDRESS, "sentinel"),
]


@pytest.mark.parametrize(("address", "why"), HOSTILE_ADDRESSES)
def test_the_hosts_block_refuses_hostile_addresses(address: str, why: str) -> None:
    """An address that could not stand alone on a hosts line is a RenderError, no text."""
    with pytest.raises(RenderError, match=why):
        merge_hosts("127.0.0.1 localhost\n", "d", "c", {0: "10.0.0.1", 1: address}, 4)


@pytest.mark.parametrize(("address", "why"), HOSTILE_ADDRESSES)
def test_the_address_list_refuses_hostile_addresses(address: str, why: str) -> None:
    """Addresses mode holds the same line to the same rule."""
    with pytest.raises(RenderError, match=why):
        render_nodes_config_addresses({0: "10.0.0.1", 1: address})


@pytest.mark.parametrize(("address", "why"), HOSTILE_ADDRESSES[:-1])
def test_config_refuses_a_hostile_bind_address(address: str, why: str) -> None:
    """config.cfg binds the node address: a hostile one would inject keys."""
    with pytest.raises(RenderError, match=why):
        render_config(_settings(), address=address)


def test_a_forged_block_does_not_verify() -> None:
    """The parse-back check refuses a block whose lines say more or less than asked."""
    slots: dict[int, str | None] = {0: "10.0.0.1"}
    good = render_hosts_block("d", "c", slots, 2)
    verify_hosts_block(good, "d", "c", slots, 2)
    name0, name1 = slot_name("d", "c", 0), slot_name("d", "c", 1)
    forged = {
        "an extra name": good.replace(f"10.0.0.1 {name0}\n", f"10.0.0.1 {name0} login-node\n"),
        "an extra line": good.replace(f"10.0.0.1 {name0}\n", f"10.0.0.1 {name0}\n10.6.6.6 x\n"),
        "another address": good.replace("10.0.0.1", "10.0.0.9"),
        "a lost slot": good.replace(f"{EMPTY_SLOT_ADDRESS} {name1}\n", ""),
        "a carriage return": good.replace(f"{name0}\n", f"{name0}\r\n"),
        "another domain": good.replace("# BEGIN imexd d", "# BEGIN imexd e"),
        "no end marker": good.replace("# END imexd\n", ""),
    }
    for what, text in forged.items():
        with pytest.raises(RenderError, match="hosts block"):
            verify_hosts_block(text, "d", "c", slots, 2)
        assert text != good, what


@given(slot_maps(), domains, cliques)
def test_every_rendered_block_verifies(
    slot_map: tuple[int, dict[int, str | None]], domain: str, clique: str
) -> None:
    """Whatever valid members render, each line parses back to one address and one name."""
    max_nodes, slots = slot_map
    block = render_hosts_block(domain, clique, slots, max_nodes)
    verify_hosts_block(block, domain, clique, slots, max_nodes)
    lines = block.split("\n")[1:-2]
    assert len(lines) == max_nodes
    for slot, line in enumerate(lines):
        assert line.split() == [
            slots.get(slot) or EMPTY_SLOT_ADDRESS,
            slot_name(domain, clique, slot),
        ]


# imexd render


def _doc_blocks() -> dict[str, str]:
    """The example inputs and outputs embedded in docs/render.md, by name."""
    text = DOCS.read_text()
    found = re.findall(r"<!-- example: ([\w-]+) -->\n```[\w-]*\n(.*?)```", text, re.DOTALL)
    return dict(found)


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The docs' example: settings, members and a current hosts file in tmp_path."""
    for name in [n for n in os.environ if n.startswith("IMEXD_")]:
        monkeypatch.delenv(name)
    blocks = _doc_blocks()
    paths = {
        "settings": tmp_path / "imexd.toml",
        "members": tmp_path / "members.json",
        "hosts": tmp_path / "hosts",
    }
    for name, path in paths.items():
        path.write_text(blocks[name])
    monkeypatch.setenv("IMEXD_IMEX_HOSTS_FILE", str(paths["hosts"]))
    return paths


def _render(example: dict[str, Path], *extra: str) -> list[str]:
    return [
        "render",
        "--config",
        str(example["settings"]),
        "--members",
        str(example["members"]),
        *extra,
    ]


def test_render_output_is_the_documented_one(
    example: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`imexd render` on the docs' 3-member example prints exactly what the docs show."""
    assert main(_render(example)) == 0
    out = capsys.readouterr().out.replace(str(example["hosts"]), "/etc/hosts")
    assert out == _doc_blocks()["output"]


def test_render_maps_only_members(
    example: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The example's claiming and standby nodes get no slot: their slots stay on 127.0.0.2."""
    records = json.loads(example["members"].read_text())
    assert {r["state"] for r in records} >= {"member", "claiming", "standby"}
    assert main(_render(example)) == 0
    block = parse_hosts_block(capsys.readouterr().out)
    assert block is not None
    members = {r["slot"]: r["address"] for r in records if r["state"] == "member"}
    assert {s: a for s, a in block[1].items() if a is not None} == members


def test_render_out_writes_the_three_files(
    example: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out writes config.cfg, nodes_config.cfg and hosts; a second run changes nothing."""
    out = tmp_path / "out"
    assert main(_render(example, "--out", str(out))) == 0
    first = capsys.readouterr().out
    assert first.count("written") == 3
    assert main(_render(example)) == 0
    printed = capsys.readouterr().out.replace(str(example["hosts"]), "/etc/hosts")
    for name, header in [
        ("config.cfg", "/run/imexd/config.cfg"),
        ("nodes_config.cfg", "/run/imexd/nodes_config.cfg"),
        ("hosts", "/etc/hosts"),
    ]:
        assert f"==> {header} <==\n{(out / name).read_text()}" in printed
    assert main(_render(example, "--out", str(out))) == 0
    assert capsys.readouterr().out.count("unchanged") == 3


def test_render_with_a_missing_hosts_file(
    example: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing hosts file counts as empty: the hosts output is the block alone."""
    example["hosts"].unlink()
    assert main(_render(example)) == 0
    hosts = capsys.readouterr().out.split(f"==> {example['hosts']} <==\n")[1]
    assert hosts.startswith("# BEGIN imexd job-42\n")


Records = list[dict[str, Any]]


def _bad_members(records: Records, **change: object) -> str:
    bad = [dict(r) for r in records]
    bad[1].update(change)
    return json.dumps(bad)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: "not json", "not a JSON list of member records"),
        (lambda r: json.dumps({"v": 1}), "not a JSON list of member records"),
        (lambda r: _bad_members(r, address="gpu-b"), "not an IP address"),
        (lambda r: _bad_members(r, state="boss"), "not a JSON list of member records"),
        (lambda r: _bad_members(r, max_nodes=8), "max_nodes 8, expected 4"),
        (lambda r: _bad_members(r, mode="addresses"), "mode 'addresses', expected 'names'"),
        (lambda r: _bad_members(r, domain="job-7"), "domain 'job-7', expected 'job-42'"),
        (lambda r: _bad_members(r, clique="other.1"), "clique 'other.1'"),
        (lambda r: _bad_members(r, node=r[0]["node"]), "more than one record"),
    ],
)
def test_render_rejects_bad_members(
    example: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    mutate: Callable[[Records], str],
    message: str,
) -> None:
    """Invalid member input is one clear line on stderr and exit 2."""
    records = json.loads(example["members"].read_text())
    example["members"].write_text(mutate(records))
    assert main(_render(example)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("imexd render: ")
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_render_keeps_the_slot_holder_the_agent_keeps(
    example: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two members on one slot render the one `membership.resolve` keeps, as the agent does."""
    records = json.loads(example["members"].read_text())
    example["members"].write_text(_bad_members(records, slot=records[0]["slot"]))
    decoded = msgspec.json.decode(example["members"].read_bytes(), type=list[MemberRecord])
    kept = resolve(decoded, max_nodes=4).members
    assert main(_render(example)) == 0
    block = parse_hosts_block(capsys.readouterr().out)
    assert block is not None
    assert {s: a for s, a in block[1].items() if a is not None} == {
        slot: record.address for slot, record in kept.items()
    }


def test_render_missing_members_file(
    example: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A members file that cannot be read is exit 2 with the path in the message."""
    example["members"].unlink()
    assert main(_render(example)) == 2
    assert f"cannot read {example['members']}" in capsys.readouterr().err


def test_render_reserved_extra_key_is_a_config_error(
    example: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """An `[imex] extra` key the agent owns makes `imexd render` exit 2 naming it."""
    with example["settings"].open("a") as fh:
        fh.write('\n[imex.extra]\nDAEMONIZE = "1"\n')
    assert main(_render(example)) == 2
    assert "imex.extra.DAEMONIZE" in capsys.readouterr().err


def test_the_simulator_reads_what_we_render(tmp_path: Path) -> None:
    """The simulator reads our config.cfg (comment, empty values), node list and hosts block."""
    from imexd.sim.config import load_config, read_node_list
    from imexd.sim.hosts import parse_hosts

    settings = _settings(run_dir=str(tmp_path))
    settings.config_path.write_text(render_config(settings))
    settings.nodes_config_path.write_text(render_nodes_config_names("job-1", "c.1", 3))
    config = load_config(str(settings.config_path))
    assert config.daemonize is False
    assert config.node_config_file == str(settings.nodes_config_path)
    assert (config.bind_interface_ip, config.server_port) == ("10.0.0.1", 51000)
    names = read_node_list(config.node_config_file)
    assert names == [slot_name("job-1", "c.1", i) for i in range(3)]
    hosts = parse_hosts(merge_hosts("127.0.0.1 localhost\n", "job-1", "c.1", {1: "10.0.0.1"}, 3))
    assert [hosts[name] for name in names] == [EMPTY_SLOT_ADDRESS, "10.0.0.1", EMPTY_SLOT_ADDRESS]


def test_imex_tls_between_daemons_is_rendered_from_extra() -> None:
    """docs/security.md's example turns on IMEX's own TLS between daemons through
    `[imex] extra`: the keys replace the documented defaults where they stand."""
    tls = {
        "IMEX_ENABLE_AUTH_ENCRYPTION": "1",
        "IMEX_AUTH_ENCRYPTION_MODE": "SSL_TLS",
        "IMEX_AUTH_SOURCE": "FILE",
        "IMEX_SERVER_KEY": "/etc/nvidia-imex/pki/node.key",
        "IMEX_SERVER_CERT": "/etc/nvidia-imex/pki/node.crt",
        "IMEX_SERVER_CERT_AUTH": "/etc/nvidia-imex/pki/ca.crt",
        "IMEX_CLIENT_KEY": "/etc/nvidia-imex/pki/node.key",
        "IMEX_CLIENT_CERT": "/etc/nvidia-imex/pki/node.crt",
        "IMEX_CLIENT_CERT_AUTH": "/etc/nvidia-imex/pki/ca.crt",
    }
    plain = render_config(_settings())
    assert "IMEX_ENABLE_AUTH_ENCRYPTION=0\n" in plain
    text = render_config(_settings(extra=tls))
    for key, value in tls.items():
        assert f"{key}={value}\n" in text
    keys = [line.partition("=")[0] for line in text.splitlines()[1:]]
    assert keys == list(_config_values(plain)), "no key added: each replaces its default"
