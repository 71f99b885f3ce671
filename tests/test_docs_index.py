"""The docs' index stays whole and the docs speak to users, not of how they were written.

docs/README.md lists every page of docs/ and, in its commands table, every command of the
real CLI parser; README.md and docs/*.md never speak of development rounds ("stop 35",
"this stop", "earlier in the session"): that history belongs in CHANGELOG.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from imexd.cli.main import build_parser
from tests.test_docs import _INLINE_CODE, _LINK, _prose_lines, _section, _subcommands

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"

_DEV_ROUNDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "a numbered round",
        re.compile(r"\bstops? \d+\b(?!\s*(?:s|ms|min|seconds?|minutes?|%|of)\b)", re.I),
    ),
    ("a round named by place", re.compile(r"\b(?:this|last|previous|next) stop\b", re.I)),
    (
        "a working session",
        re.compile(r"\b(?:earlier in|in|during) this session\b|earlier in the session", re.I),
    ),
    ("a diary's aside", re.compile(r"\bnoticed, not changed\b|\bnot changed here\b", re.I)),
    ("earlier rounds of work", re.compile(r"\bearlier rounds\b", re.I)),
    ("the project's own issue", re.compile(r"\bissues? \d+\b", re.I)),
)
"""Phrases that speak of the development process, each with what it is. MQTT's own
"session" (clean session, session resume) is not among them."""


def _dev_round_mentions(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, what, the phrase) of each development-round mention in a text."""
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in _DEV_ROUNDS:
            for match in pattern.finditer(line):
                yield number, what, match.group(0)


def _pages() -> list[Path]:
    """The pages of docs/, its index left out."""
    return sorted(p for p in DOCS.glob("*.md") if p != INDEX)


def _listed_pages(index: str) -> set[str]:
    """The docs/ pages an index links to (outside code), anchors dropped."""
    targets = (
        target.partition("#")[0]
        for line in _prose_lines(index)
        for target in _LINK.findall(_INLINE_CODE.sub("", line))
    )
    return {t for t in targets if t.endswith(".md") and "/" not in t}


def _commands_in_table(index: str) -> set[str]:
    """The commands the commands table names: the code spans of each row's first cell."""
    table = _section(index, "## Commands")
    named: set[str] = set()
    for row in re.finditer(r"^\|([^|]*)\|", table, re.M):
        named.update(span.strip() for span in re.findall(r"`([^`]+)`", row.group(1)))
    return named


def _cli_commands() -> list[str]:
    """Every leaf command of the real parser, e.g. "imexd node retry"."""
    return list(_subcommands(build_parser()))


def test_every_page_is_listed_in_the_index() -> None:
    """Each page of docs/ is linked from docs/README.md."""
    listed = _listed_pages(INDEX.read_text())
    missing = [p.name for p in _pages() if p.name not in listed]
    assert missing == [], f"pages docs/README.md does not list: {missing}"


def test_the_index_lists_only_pages_that_exist() -> None:
    """Each docs page docs/README.md links to exists."""
    existing = {p.name for p in _pages()}
    stale = sorted(_listed_pages(INDEX.read_text()) - existing)
    assert stale == [], f"docs/README.md lists pages that do not exist: {stale}"


def test_every_cli_command_is_in_the_commands_table() -> None:
    """Each leaf command of the CLI's parser has its row in docs/README.md's commands table."""
    commands = _cli_commands()
    assert {"imexd gc", "imexd node retry", "imexd schemas", "imexd domain create"} <= set(commands)
    named = _commands_in_table(INDEX.read_text())
    missing = [c for c in commands if c not in named]
    assert missing == [], f"commands missing from docs/README.md's commands table: {missing}"


def test_the_commands_table_names_no_command_the_cli_lacks() -> None:
    """Each `imexd ...` command of the commands table is one the parser has."""
    commands = set(_cli_commands())
    named = {c for c in _commands_in_table(INDEX.read_text()) if c.startswith("imexd ")}
    extra = sorted(named - commands)
    assert extra == [], f"docs/README.md's commands table names unknown commands: {extra}"


def test_the_index_checks_see_a_gap() -> None:
    """Not blind: an unlisted page, a missing command and a command table row are found."""
    index = (
        "| [bus.md](bus.md#topics) | x |\n| `a.md` | not a link |\n\n"
        "## Commands\n\n| command | does |\n| --- | --- |\n"
        "| `imexd run` | runs |\n| `imexd-sim-daemon`, `imexd-sim-ctl` | the simulator |\n"
    )
    assert _listed_pages(index) == {"bus.md"}
    assert _commands_in_table(index) >= {"imexd run", "imexd-sim-daemon", "imexd-sim-ctl"}
    assert "imexd gc" not in _commands_in_table(index)


def test_readme_and_docs_speak_of_no_development_round() -> None:
    """README.md and docs/*.md hold no "stop N", "this stop", "earlier in the session",
    "issue N" or the like: the history of how the figures moved is CHANGELOG.md's."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {phrase!r} ({what})"
        for page in [README, *sorted(DOCS.glob("*.md"))]
        for number, what, phrase in _dev_round_mentions(page.read_text())
    ]
    assert found == [], "development rounds in the docs:\n" + "\n".join(found)


def test_the_dev_round_check_sees_a_diary() -> None:
    """Not blind: each kind of mention is found, and MQTT's sessions and claim rounds are
    not."""
    diary = (
        "Measured at stop 35.\nStops 36 and 37 agree.\nOn this stop's commits.\n"
        "Earlier in the session it was faster.\nNoticed, not changed.\n"
        "25 to 36 s (earlier rounds).\n0.39 s in a later run (issue 43).\n"
    )
    assert [n for n, _, _ in _dev_round_mentions(diary)] == [1, 2, 3, 4, 5, 6, 7]
    protocol = (
        "The agent resumes its MQTT 5 session; clean sessions on 3.1.1.\n"
        "A fresh clique settles in two claim rounds; the first round ends at the echo.\n"
        "SIGTERM stops the daemon; it stops 2 s later at most.\n"
    )
    assert list(_dev_round_mentions(protocol)) == []
