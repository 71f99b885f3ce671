"""The operator docs stay true to the code: reasons, commands, links and the README's start.

Reasons are read from the source with `ast` rather than listed here, so a new condition
reason or supervisor code in `imexd/health.py` or `imexd/daemon_state.py` fails this file until
docs/troubleshooting.md explains it.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from imexd import messages
from imexd.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
HEALTH_SOURCES = tuple(ROOT / "imexd" / name for name in ("health.py", "fleet.py", "messages.py"))
DAEMON_SOURCE = ROOT / "imexd" / "daemon_state.py"

DEMO_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[demo]' && .venv/bin/imexd demo"
TEST_COMMAND = "scripts/test"

_REASON_CODE = re.compile(r"^([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+): ")
"""A supervisor reason: a CamelCase code, then ": " and the details."""
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose_lines(text: str) -> Iterator[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


@cache
def _health_reasons() -> frozenset[str]:
    """Reason literals of the conditions (health.py, fleet.sight, messages.failing):
    `_Verdict(status, reason, ...)`, `Sight(status, reason, ...)` and `reason="..."`."""
    reasons: set[str] = set()
    trees = [ast.parse(source.read_text()) for source in HEALTH_SOURCES]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if not isinstance(node, ast.Call):
            continue
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("_Verdict", "Sight")
            and len(node.args) > 1
        ):
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                reasons.add(arg.value)
        for kw in node.keywords:
            value = kw.value
            if (
                kw.arg == "reason"
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
                and value.value
            ):
                reasons.add(value.value)
    return frozenset(reasons)


def _leading_text(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _leading_text(node.values[0])
    return None


@cache
def _supervisor_codes() -> frozenset[str]:
    """Codes the supervisor puts before ": " in its reasons, and those its docs promise."""
    tree = ast.parse(DAEMON_SOURCE.read_text())
    codes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant | ast.JoinedStr):
            text = _leading_text(node)
            match = _REASON_CODE.match(text or "")
            if match:
                codes.add(match.group(1))
        if isinstance(node, ast.ClassDef) and node.name == "DaemonStatus":
            doc = ast.get_docstring(node) or ""
            codes.update(re.findall(r"`([A-Z][a-z]+(?:[A-Z][a-z]+)+)`", doc))
    return frozenset(codes)


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "imexd") -> Iterator[str]:
    """Every leaf command line of the parser, e.g. "imexd domain create"."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = list(_subcommands(sub, f"{prefix} {name}"))
                yield from nested or [f"{prefix} {name}"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = _INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown page's headings."""
    return frozenset(
        _slug(m.group(1))
        for line in _prose_lines(path.read_text())
        if (m := _HEADING.match(line)) is not None
    )


def _relative_links(path: Path) -> Iterator[str]:
    """Link targets of a Markdown page, outside code: inline and reference-style."""
    for line in _prose_lines(path.read_text()):
        prose = _INLINE_CODE.sub("", line)
        yield from _LINK.findall(prose)
        ref = _REFERENCE.match(prose)
        if ref:
            yield ref.group(1)


def test_health_reasons_are_found() -> None:
    """The reason extractor finds the reasons health.py is known to produce."""
    assert {"PeersUnreachable", "PublishRefused", "DaemonCrashLoop", "Missing"} <= (
        _health_reasons()
    )


def test_every_health_reason_is_in_troubleshooting() -> None:
    """Every condition reason health.py can produce is explained in troubleshooting.md."""
    text = TROUBLESHOOTING.read_text()
    missing = sorted(r for r in _health_reasons() if f"`{r}`" not in text)
    assert not missing, f"docs/troubleshooting.md does not explain: {missing}"


def test_every_condition_type_has_a_section() -> None:
    """Every condition type has its own heading in troubleshooting.md."""
    headings = {
        m.group(1)
        for line in _prose_lines(TROUBLESHOOTING.read_text())
        if (m := _HEADING.match(line)) is not None
    }
    assert set(messages.CONDITION_TYPES) <= headings


def test_every_supervisor_code_is_in_troubleshooting() -> None:
    """Every supervisor reason code of daemon_state.py is explained in troubleshooting.md."""
    codes = _supervisor_codes()
    assert {"DaemonCrashLoop", "ConflictingDaemon", "DaemonCrashed"} <= codes
    text = TROUBLESHOOTING.read_text()
    missing = sorted(c for c in codes if f"`{c}`" not in text)
    assert not missing, f"docs/troubleshooting.md does not explain: {missing}"


def test_every_cli_command_is_documented() -> None:
    """Every `imexd` subcommand appears in README.md or a page under docs/."""
    text = "\n".join(p.read_text() for p in _markdown_files())
    commands = list(_subcommands(build_parser()))
    assert "imexd domain create" in commands
    missing = [c for c in commands if c not in text]
    assert not missing, f"commands not documented: {missing}"


def test_relative_links_point_to_existing_files() -> None:
    """Every relative link in README.md and docs/*.md names a file and heading that exist."""
    broken: list[str] = []
    for page in _markdown_files():
        for target in _relative_links(page):
            if _SCHEME.match(target) or target.startswith("/"):
                continue
            file_part, _, fragment = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_opens_with_the_two_setup_commands() -> None:
    """README.md opens with its title, one sentence and a block of the demo and test commands."""
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ")
    assert lines[1] == ""
    assert lines[2].endswith(".")
    assert lines[3] == ""
    assert _FENCE.match(lines[4])
    end = next(i for i in range(5, len(lines)) if _FENCE.match(lines[i]))
    commands = [line.strip() for line in lines[5:end] if line.strip()]
    assert commands == [DEMO_COMMAND, TEST_COMMAND]
