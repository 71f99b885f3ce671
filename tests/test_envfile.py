"""Environment files parsed as systemd's EnvironmentFile= parses them (src/basic/env-file.c)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imexd.envfile import parse_env_file, read_env_file
from imexd.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=1\n", {"A": "1"}),
        ("A=1", {"A": "1"}),  # no newline at the end
        ("  A  =   1   \n", {"A": "1"}),  # blanks around the key and the value
        ("A=10.40.7.11    # the address\n", {"A": "10.40.7.11    # the address"}),
        ("# a comment\n; another\n   # indented\nA=1\n", {"A": "1"}),
        ("A=\n", {"A": ""}),
        ("A=", {"A": ""}),
        ("A='  x  # y '\n", {"A": "  x  # y "}),
        ('A="a \\"b\\" \\$c \\n"\n', {"A": 'a "b" $c \\n'}),
        ('A="x"y\n', {"A": "xy"}),
        ('A="x" # y\n', {"A": "x# y"}),  # blanks after a closing quote are dropped
        ("A=one\\\ntwo\n", {"A": "onetwo"}),  # a backslash joins lines
        ('A="one\\\ntwo"\n', {"A": "onetwo"}),
        ("A=a\\ b\n", {"A": "a b"}),
        ("A=$B ${C}\n", {"A": "$B ${C}"}),  # nothing is expanded
        ("A=1\nA=2\n", {"A": "2"}),  # the last one wins
        ("A=1\r\nB=2\r\n", {"A": "1", "B": "2"}),
        ("A=x=y\n", {"A": "x=y"}),
    ],
)
def test_values_as_systemd_reads_them(text: str, expected: dict[str, str]) -> None:
    """Each case is what systemd's parser makes of the text."""
    parsed = parse_env_file(text)
    assert parsed.problems == ()
    assert parsed.environ == expected


def test_a_comment_after_a_value_is_kept_and_warned_about() -> None:
    """`KEY=value  # note` is the value with the note; a warning names the line."""
    parsed = parse_env_file("# x\nIMEXD_NODE_ADDRESS=10.40.7.11    # the address\n", "f.env")
    assert parsed.environ == {"IMEXD_NODE_ADDRESS": "10.40.7.11    # the address"}
    assert len(parsed.warnings) == 1
    assert parsed.warnings[0].startswith("f.env:2: the value of IMEXD_NODE_ADDRESS")
    assert parsed.labels == {"IMEXD_NODE_ADDRESS": "f.env:2: IMEXD_NODE_ADDRESS"}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("export IMEXD_NODE_NAME=a\n", "f.env:1: 'export IMEXD_NODE_NAME': not a variable name"),
        ("A=1\nIMEXD_NODE_NAME\n", "f.env:2: 'IMEXD_NODE_NAME': expected NAME=VALUE"),
        ("A=1\nno equals sign", "f.env:2: 'no equals sign': expected NAME=VALUE"),
        ("1A=x\n", "f.env:1: '1A': not a variable name"),
        ("# old \\\nA=1\n", "f.env:1: a comment ends in a backslash"),
    ],
)
def test_what_systemd_skips_is_a_problem_naming_the_line(text: str, problem: str) -> None:
    """Lines systemd drops quietly (or reads differently between versions) are named."""
    parsed = parse_env_file(text, "f.env")
    assert any(p.startswith(problem) for p in parsed.problems), parsed.problems


def test_a_multi_line_value_is_named_by_its_first_line() -> None:
    """An assignment continued over lines is labelled with the line it starts on."""
    parsed = parse_env_file("A=1\nB='x\ny'\nC=2\n", "f.env")
    assert parsed.environ == {"A": "1", "B": "x\ny", "C": "2"}
    assert parsed.labels["C"] == "f.env:4: C"


def test_reading_names_the_file(tmp_path: Path) -> None:
    """A missing, non-UTF-8 or wrong file is a ConfigError naming the file (and line)."""
    with pytest.raises(ConfigError, match=r"missing\.env: cannot read"):
        read_env_file(str(tmp_path / "missing.env"))
    bad = tmp_path / "bad.env"
    bad.write_bytes(b"A=1\nB=\xff\n")
    with pytest.raises(ConfigError, match=r"bad\.env:2: not UTF-8"):
        read_env_file(str(bad))
    bad.write_text("export A=1\n")
    with pytest.raises(ConfigError, match=r"bad\.env:1: 'export A'"):
        read_env_file(str(bad))


def test_the_shipped_example_parses_to_nothing() -> None:
    """systemd/imexd.env is all comments: it sets nothing and has no problem."""
    parsed = read_env_file(str(ROOT / "systemd" / "imexd.env"))
    assert parsed.environ == {}
    assert parsed.warnings == ()


plain = st.text(alphabet="abcXYZ019._:/-,", min_size=1, max_size=20)


@given(st.dictionaries(st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,10}\Z"), plain, max_size=5))
def test_plain_assignments_round_trip(env: dict[str, str]) -> None:
    """NAME=value lines of plain values read back as they were written."""
    text = "".join(f"{k}={v}\n" for k, v in env.items())
    assert parse_env_file(text).environ == env


@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40))
def test_single_quotes_keep_anything_but_a_quote(value: str) -> None:
    """Inside single quotes every character but `'` is literal."""
    value = value.replace("'", "")
    assert parse_env_file(f"A='{value}'\n").environ == {"A": value}
