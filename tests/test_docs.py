"""The operator docs stay true to the code: reasons, commands, links and the README's start.

The `imexd` commands of the docs' fenced blocks are examples run as written where they can
run here (`RUN`: the version, the example settings, the schemas, `discover` without NVML,
the control plane against a test broker), and every other one is said not to be (`NOT_RUN`,
with why); all of them must parse with the real CLI, and the `--help` of each runs.

Reasons are read from the source with `ast` rather than listed here, so a new condition
reason or supervisor code in `imexd/health/conditions.py` or `imexd/daemon/state.py`
fails this file until docs/troubleshooting.md explains it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from imexd import messages
from imexd.cli.control import add_control_commands
from imexd.cli.main import build_parser
from imexd.demo.brokers import find_mosquitto
from imexd.topics import TopicRef, Topics
from tests.brokers import Mosquitto
from tests.test_layout import _graph

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
HEALTH_SOURCES = tuple(
    ROOT / "imexd" / name for name in ("health/conditions.py", "health/fleet.py", "messages.py")
)
DAEMON_SOURCE = ROOT / "imexd" / "daemon" / "state.py"

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
_T = typing.TypeVar("_T", str, tuple[str, str])


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
    """Reason literals of the conditions (health/conditions.py, fleet.sight, messages.failing):
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
    """The reason extractor finds the reasons health/conditions.py is known to produce."""
    assert {"PeersUnreachable", "PublishRefused", "DaemonCrashLoop", "Missing"} <= (
        _health_reasons()
    )


def test_every_health_reason_is_in_troubleshooting() -> None:
    """Every condition reason health/conditions.py can produce is explained in
    troubleshooting.md."""
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


ARCHITECTURE = DOCS / "architecture.md"


def _section(text: str, heading: str) -> str:
    """The lines of `text` from `heading` to the next heading of its level or above."""
    level = heading.split(" ", maxsplit=1)[0]
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next(
        (i for i in range(start, len(lines)) if re.match(rf"#{{1,{len(level)}}} ", lines[i])),
        len(lines),
    )
    return "\n".join(lines[start:end])


def test_the_architecture_map_names_every_module_and_no_other() -> None:
    """docs/architecture.md's map: each module of imexd/ (a package's in its package's row)
    and nothing that is not one."""
    table = _section(ARCHITECTURE.read_text(), "### The map")
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\|[^|]*\| `([a-z_]+(?:\.py|/))`.*$", table, re.M)
    }
    package = ROOT / "imexd"
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        parent = path.parent.relative_to(package)
        row = rows.get(f"{parent}/") if parent.parts else table
        if row is None or f"`{path.name}`" not in row:
            missing.append(str(path.relative_to(ROOT)))
    assert missing == [], f"modules not in the map of docs/architecture.md: {missing}"
    named = set(re.findall(r"`([a-z_]+\.py)`", table))
    existing = {p.name for p in package.rglob("*.py")}
    assert named <= existing, f"the map names modules that do not exist: {named - existing}"


def _documented_topics(contract: str) -> set[str]:
    """The topics of the bus contract's topic table: the first cell of each row."""
    return set(re.findall(r"^\| `(\{p\}/[^`]*)` \|", contract, re.M))


def _documented_payloads(contract: str) -> set[str]:
    """The payload types of the bus contract's fields table: each row `| Name | `v, ...`."""
    return set(re.findall(r"^\| ([A-Z][A-Za-z]+) \| `v, ", contract, re.M))


def _documented_conditions(health: str) -> set[str]:
    """The condition types of the health section's condition table: rows whose first
    cell is one CamelCase word (the endpoint table's rows start with a backtick)."""
    return set(re.findall(r"^\| ([A-Z][a-z]+(?:[A-Z][a-z]+)+) \|", health, re.M))


def _both_ways(documented: set[_T], actual: set[_T]) -> tuple[list[_T], list[_T]]:
    """(what the code has and the docs do not, what the docs name and the code has not)."""
    return sorted(actual - documented), sorted(documented - actual)


def _built_topics() -> dict[str, str]:
    """Topic kind -> its topic as the docs write it: `{p}` and `{name}` placeholders."""
    topics = Topics("{p}")
    built = {
        "member": topics.member("{domain}", "c", "{node}").replace("/c/", "/{clique}/"),
        "health": topics.health("{domain}", "{node}"),
        "spec": topics.spec("{domain}"),
        "workload": topics.workload("{domain}", "{workload}"),
        "retry": topics.retry("{domain}", "{node}"),
        "assignment": topics.assignment("{node}"),
        "ping": topics.ping("{node}"),
        "presence": topics.presence("{node}"),
    }
    assert set(built) == _topic_kinds(), "a topic kind this test does not build"
    return {kind: _unescape(topic) for kind, topic in built.items()}


def _topic_kinds() -> set[str]:
    return set(typing.get_args(typing.get_type_hints(TopicRef)["kind"]))


def test_the_architecture_lists_every_topic_payload_and_condition() -> None:
    """docs/architecture.md's bus contract and health sections against messages.py and
    topics.py, both ways: every topic kind, payload type and condition type has its row,
    and no row names a topic, payload or condition that the code does not have."""
    text = ARCHITECTURE.read_text()
    contract = _section(text, "## Bus contract")
    missing, extra = _both_ways(_documented_topics(contract), set(_built_topics().values()))
    assert missing == [], f"topics missing from the bus contract: {missing}"
    assert extra == [], f"the bus contract names topics the code does not build: {extra}"
    payloads = {p.__name__ for p in typing.get_args(messages.Payload)}
    missing, extra = _both_ways(_documented_payloads(contract), payloads)
    assert missing == [], f"payloads missing from the bus contract's fields table: {missing}"
    assert extra == [], f"the fields table names payloads messages.py does not have: {extra}"
    health = _section(text, "## Health")
    missing, extra = _both_ways(_documented_conditions(health), set(messages.CONDITION_TYPES))
    assert missing == [], f"conditions missing from the health table: {missing}"
    assert extra == [], f"the health table names conditions messages.py does not have: {extra}"
    words = {6: "six", 7: "seven", 8: "eight"}
    assert f"into {words.get(len(messages.CONDITION_TYPES))} conditions" in health


def test_the_contract_checks_see_a_stale_row() -> None:
    """Not blind: a row for a topic, payload or condition the code lacks is reported."""
    topic = "| `{p}/nodes/{node}/gone` | yes, QoS 1 | control plane | Gone |"
    assert _documented_topics(topic) == {"{p}/nodes/{node}/gone"}
    assert _documented_payloads("| Gone | `v, node` |") == {"Gone"}
    health = "| condition | True when |\n| GoneReady | never |\n| `GET /x` | 404 |"
    assert _documented_conditions(health) == {"GoneReady"}
    assert _both_ways({"GoneReady", "BusConnected"}, {"BusConnected"}) == ([], ["GoneReady"])


def _diagram() -> str:
    """The architecture's opening picture: its first fenced block."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if _FENCE.match(line)) + 1
    end = next(i for i in range(start, len(lines)) if _FENCE.match(lines[i]))
    return "\n".join(lines[start:end])


def _control_groups() -> dict[str, list[str]]:
    """The control plane's command groups (imexd/cli/control.py) -> their subcommands,
    in the parser's order; a group without subcommands (`gc`) has none."""
    parser = argparse.ArgumentParser(prog="imexd")
    add_control_commands(parser.add_subparsers())
    groups: dict[str, list[str]] = {}
    for line in _subcommands(parser):
        group, *rest = line.split()[1:]
        groups.setdefault(group, []).extend(rest)
    return groups


def _diagram_problems(diagram: str) -> list[str]:
    """What the picture says that the CLI and topics.py do not: a control plane group
    missing or with other subcommands than the CLI's, an `imexd` command that does not
    exist, topic kinds other than TopicRef's."""
    problems = []
    groups = _control_groups()
    commands = {line.split()[1] for line in _subcommands(build_parser())}
    mentions = re.findall(r"\bimexd ([a-z][a-z-]*)((?: [a-z][a-z-]*(?:\|[a-z][a-z-]*)*)?)", diagram)
    named = {name for name, _ in mentions}
    problems += [f"imexd {g} missing" for g in groups if g not in named]
    problems += [f"imexd {n}: no such command" for n in sorted(named - commands)]
    for name, subs in mentions:
        if name in groups and subs.strip() != "|".join(groups[name]):
            problems.append(f"imexd {name}{subs}: the CLI has {'|'.join(groups[name])!r}")
    kinds = re.search(r"topic kinds: ([a-z,|\s]+?)[;.(]", diagram)
    documented = {k.strip(" |\n") for k in kinds.group(1).split(",")} if kinds else set()
    missing, extra = _both_ways(documented, _topic_kinds())
    problems += [f"topic kind {k} missing" for k in missing]
    problems += [f"topic kind {k}: no such kind" for k in extra]
    return problems


def test_the_architecture_diagram_names_every_command_group_and_topic_kind() -> None:
    """docs/architecture.md's picture names each control plane command group with all of
    its subcommands, and the topic kinds, as the code has them: no group, subcommand or
    kind missing, none that the code does not have."""
    problems = _diagram_problems(_diagram())
    assert problems == [], f"the picture of docs/architecture.md disagrees: {problems}"


def test_the_diagram_check_sees_drift() -> None:
    """Not blind: a stale subcommand, a missing group and an unknown topic kind are
    reported."""
    diagram = "imexd domain create|delete\nimexd frob\n| topic kinds: member, |\n| gone; |"
    problems = _diagram_problems(diagram)
    assert "imexd workload missing" in problems
    assert "imexd frob: no such command" in problems
    assert any(p.startswith("imexd domain create|delete:") for p in problems)
    assert "topic kind gone: no such kind" in problems
    assert "topic kind spec missing" in problems


def _module_of(path: str) -> str:
    """`membership/shard.py` -> `imexd.membership.shard`; `health/` -> `imexd.health`."""
    return "imexd." + path.removesuffix("/").removesuffix(".py").replace("/", ".")


@cache
def _import_graph() -> Mapping[str, frozenset[str]]:
    """imexd module -> the imexd modules it imports, lazy and type-only imports included
    (the graph tests/test_layout.py checks)."""
    return {name: frozenset(imports) for name, imports in _graph().items()}


def _layers(table: str) -> dict[str, int]:
    """The map's modules and packages (`imexd.health`) -> their layer's place, lowest 0;
    a row with an empty layer cell is in the layer above it."""
    layers: dict[str, int] = {}
    names: list[str] = []
    for row in re.finditer(r"^\| ([^|]*?) ?\| (`[^|]*)\|", table, re.M):
        if row.group(1):
            names.append(row.group(1))
        for path in re.findall(r"`([a-z_]+(?:\.py|/))`", row.group(2)):
            layers[_module_of(path)] = len(names) - 1
    return layers


def _layer_of(module: str, layers: Mapping[str, int]) -> int | None:
    """The layer of a module: its own row's, or its package's."""
    return layers.get(module, layers.get(".".join(module.split(".")[:2])))


def _upward_imports(layers: Mapping[str, int]) -> set[tuple[str, str]]:
    """Each import of a module from a later layer of the map than its own."""
    return {
        (module, imported)
        for module, imports in _import_graph().items()
        for imported in imports
        if (low := _layer_of(module, layers)) is not None
        and (high := _layer_of(imported, layers)) is not None
        and high > low
    }


def test_the_architecture_layers_hold() -> None:
    """docs/architecture.md's layering against the imports: a module imports from its
    own layer of the map and the layers before it; the exceptions the Modules section
    lists (`- `a.py` imports `b/c.py``) are exactly the imports that do otherwise."""
    text = ARCHITECTURE.read_text()
    layers = _layers(_section(text, "### The map"))
    assert {"imexd.imex", "imexd.health", "imexd.cli"} <= layers.keys()
    assert layers["imexd.imex"] < layers["imexd.messages"] < layers["imexd.cli"]
    listed = {
        (_module_of(a), _module_of(b))
        for a, b in re.findall(r"^- `([a-z_/]+\.py)` imports `([a-z_/]+\.py)`", text, re.M)
    }
    missing, extra = _both_ways(listed, _upward_imports(layers))
    assert missing == [], f"imports against the layers of docs/architecture.md: {missing}"
    assert extra == [], f"docs/architecture.md lists exceptions no module makes: {extra}"


def test_the_layer_check_sees_an_upward_import() -> None:
    """Not blind: with the daemon's state put in a layer after the facts, the facts'
    import of it is upward."""
    layers = _layers("| leaves | `facts.py` | x | |\n| edges | `daemon/` | x | |")
    assert layers == {"imexd.facts": 0, "imexd.daemon": 1}
    assert ("imexd.facts", "imexd.daemon.state") in _upward_imports(layers)


def test_the_architecture_names_who_imports_the_leaves() -> None:
    """docs/architecture.md's "imported by" lists (what IMEX is, what may name a node)
    name exactly the modules that import the leaf, no more and no fewer."""
    table = _section(ARCHITECTURE.read_text(), "### Where each decision lives")
    rows = re.findall(r"^\|[^|]*\| `([a-z_/]+\.py)` \| [^|]*imported by ([^|]*)\|", table, re.M)
    assert {leaf for leaf, _ in rows} >= {"imex.py", "names.py"}
    graph = _import_graph()
    for leaf, cell in rows:
        listed = {_module_of(path) for path in re.findall(r"`([a-z_/]+\.py)`", cell)}
        importers = {m for m, imports in graph.items() if _module_of(leaf) in imports}
        missing, extra = _both_ways(listed, importers)
        assert missing == [], f"{leaf}: importers missing from docs/architecture.md: {missing}"
        assert extra == [], f"{leaf}: docs/architecture.md names non-importers: {extra}"


def _unescape(topic: str) -> str:
    """A topic built from `{name}` placeholders, with their braces as the docs write them."""
    return topic.replace("%7B", "{").replace("%7D", "}")


def test_every_supervisor_code_is_in_troubleshooting() -> None:
    """Every supervisor reason code of daemon/state.py is explained in troubleshooting.md."""
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


# ---------------------------------------------------------------------------------
# The docs' shell examples, run as written where they can run here

_COMMAND_LANGS = frozenset({"sh", "bash", "shell", "console"})
"""Fenced blocks whose every `imexd ...` line is a command; in other blocks (transcripts
with output) only lines after a `$ ` prompt are."""
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
_OPENING_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
_IMEX_BINARIES = ("nvidia-imex", "nvidia-imex-ctl")
"""What a node with the IMEX package has on PATH; `imexd config` checks for both."""


@dataclass(frozen=True)
class Example:
    """One `imexd` command line of a fenced block, with where it is and what follows it."""

    page: str
    line: int
    command: str
    """The command as written, without its `$ ` prompt, environment or `# comment`."""
    env: tuple[str, ...]
    """`NAME=value` words written before it."""
    after: tuple[str, ...]
    """The block's lines after it (a transcript's output)."""


def _logical_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(index of the first line, the line) with backslash continuations joined."""
    start, parts = 0, list[str]()
    for i, line in enumerate(lines):
        if not parts:
            start = i
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped.strip())
        yield start, " ".join(p for p in parts if p)
        parts = []


def _examples() -> list[Example]:
    """Every `imexd` command of every fenced block in README.md and docs/*.md."""
    found: list[Example] = []
    for page in _markdown_files():
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = _OPENING_FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if _FENCE.match(lines[j])), len(lines))
            body = lines[i + 1 : end]
            commands_only = opening.group(2) in _COMMAND_LANGS
            for k, text in _logical_lines(body):
                prompt = text.startswith("$ ")
                if not (prompt or commands_only):
                    continue
                words = text.removeprefix("$ ").split()
                env = []
                while words and _ASSIGNMENT.match(words[0]):
                    env.append(words.pop(0))
                if not words or words[0] != "imexd":
                    continue
                command = " ".join(words).split(" #", 1)[0].strip()
                found.append(
                    Example(
                        page=str(page.relative_to(ROOT)),
                        line=i + 2 + k,
                        command=command,
                        env=tuple(env),
                        after=tuple(body[k + 1 :]),
                    )
                )
            i = end + 1
    return found


HELP_FORM = re.compile(r"^imexd(?: [a-z][a-z-]*)* (?:--help|-h)$")
"""`imexd [COMMAND ...] --help`: always runnable, so always run."""

RUN: dict[str, str] = {
    "imexd --version": "prints the version",
    "imexd config --example > /etc/imexd/imexd.toml": "writes the example settings",
    "imexd config --config /etc/imexd/imexd.toml": "validates the example just written",
    "imexd schemas --check docs/schemas": "the checked-in schemas are current",
    "imexd discover": "without NVML: the documented message (a GPU host skips it)",
    "imexd domain list": "against a broker started by the test",
    "imexd domain status job-42": "against a broker started by the test: nothing there, exit 1",
    "imexd keys create /etc/imexd/keys": "makes a key pair in a temporary folder",
}
"""The examples that are executed, as written (paths under /etc mapped to a temporary
folder, the broker to the test's): adding an example to the docs means adding it here or
to NOT_RUN, on purpose."""

NOT_RUN: tuple[tuple[str, str], ...] = (
    (r"imexd run\b", "starts agents: the README tour runs in tests/test_tour.py"),
    (r"imexd (status|check)\b", "asks a running agent's HTTP endpoint"),
    (r"imexd render --config n1/", "needs the README tour's files (tests/test_tour.py)"),
    (r"imexd domain status (tour\b|<domain>)", "needs the tour's or an operator's domain"),
    (
        r"imexd domain (create|delete|status) (d1|job-1234)\b",
        "needs agents reporting on a broker (tests/test_control.py runs these)",
    ),
    (r"imexd workload ", "needs agents that make channels (tests/test_workloads.py)"),
    (r"imexd gc ", "needs squeue's job list and records on a broker (tests/test_gc.py)"),
    (r"imexd schemas --write\b", "rewrites the checked-in schemas: a developer's step"),
    (r"imexd config .*--env-file /etc/", "the operator's env file (tests/test_envfile.py)"),
)
"""Documented commands that cannot run here, each pattern with why."""


def _not_run_reason(command: str) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.match(pattern, command)), None)


def test_every_documented_command_is_run_or_said_not_to_be() -> None:
    """Each `imexd` example is run (RUN or a --help form) or matches one NOT_RUN reason."""
    examples = _examples()
    commands = {e.command for e in examples}
    assert {"imexd --version", "imexd domain list", "imexd discover"} <= commands
    unsorted = sorted(
        f"{e.page}:{e.line}: {e.command}"
        for e in examples
        if e.command not in RUN
        and not HELP_FORM.match(e.command)
        and _not_run_reason(e.command) is None
    )
    assert not unsorted, "add to RUN (and run it) or to NOT_RUN (with why):\n" + "\n".join(unsorted)
    both = sorted(c for c in RUN if _not_run_reason(c) is not None)
    assert not both, f"in RUN and NOT_RUN: {both}"
    stale = sorted(c for c in RUN if c not in commands)
    assert not stale, f"RUN names commands the docs no longer show: {stale}"
    unused = [p for p, _ in NOT_RUN if not any(re.match(p, c) for c in commands)]
    assert not unused, f"NOT_RUN patterns that match no example: {unused}"


@dataclass
class _Shell:
    """Runs documented commands with the venv's imexd, /etc/imexd mapped to `etc`."""

    root: Path
    env: dict[str, str]

    @property
    def etc(self) -> Path:
        return self.root / "etc-imexd"

    def run(self, command: str, extra: Mapping[str, str] | None = None) -> CompletedProcess[str]:
        words = shlex.split(command.replace("/etc/imexd/", f"{self.etc}/"))
        target = None
        if ">" in words:
            at = words.index(">")
            words, target = words[:at], Path(words[at + 1])
        imexd = Path(sys.executable).with_name("imexd")
        result = subprocess.run(
            [str(imexd), *words[1:]],
            env={**self.env, **(extra or {})},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if target is not None and result.returncode == 0:
            target.write_text(result.stdout)
        return result


@pytest.fixture
def shell(tmp_path: Path) -> _Shell:
    """A clean environment (no IMEXD_* of ours) whose PATH has stand-in IMEX binaries."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in _IMEX_BINARIES:
        fake = bindir / name
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(tmp_path)
    (tmp_path / "etc-imexd").mkdir()
    return _Shell(tmp_path, env)


def _documented(command: str) -> Example:
    return next(e for e in _examples() if e.command == command)


_SHELL_OPERATORS = frozenset({">", ">>", "<", "|", "||", "&", "&&", ";"})
_SAMPLES = {r"\$\{?[A-Z_][A-Z0-9_]*\}?": "1001", r"<([a-z-]+)>": r"\1"}
"""Shell variables and `<placeholders>` of the examples, and what stands for them."""


def _argv(command: str) -> list[str]:
    """The example's words up to the first shell operator, placeholders filled in."""
    for pattern, sample in _SAMPLES.items():
        command = re.sub(pattern, sample, command)
    words: list[str] = []
    for word in shlex.split(command):
        if word in _SHELL_OPERATORS or re.match(r"^\d?>", word):
            break
        words.append(word)
    return words


def _command_path(argv: list[str]) -> list[str]:
    """The subcommand words of `argv` (`imexd domain status`), options and values left out."""
    parser, path = build_parser(), ["imexd"]
    for word in argv[1:]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        path.append(word)
    return path


def test_every_documented_command_parses() -> None:
    """Every example, run here or not, is accepted by the real CLI's parser: its options exist."""
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(_argv("imexd domain status job-42 --no-such-option")[1:])
    assert _argv("imexd check && echo ready") == ["imexd", "check"]
    assert _argv("imexd domain status <domain> --uid $SLURM_JOB_UID")[3:] == [
        "domain",
        "--uid",
        "1001",
    ]
    refused: list[str] = []
    for example in _examples():
        argv = _argv(example.command)
        if HELP_FORM.match(" ".join(argv)):
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            if exc.code not in (0, None):
                refused.append(
                    f"{example.page}:{example.line}: {example.command}: {err.getvalue()}"
                )
    assert not refused, "\n".join(refused)


def test_the_help_of_every_documented_command_runs() -> None:
    """`--help` of each documented command (and each documented --help form) exits 0 with usage."""
    paths = {" ".join(_command_path(_argv(e.command))) for e in _examples()}
    forms = {e.command for e in _examples() if HELP_FORM.match(e.command)}
    assert {"imexd", "imexd domain status", "imexd config"} <= paths
    for command in sorted({f"{p} --help" for p in paths} | forms):
        run = subprocess.run(
            [str(Path(sys.executable).with_name("imexd")), *command.split()[1:]],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert run.returncode == 0, f"{command}: {run.stderr}"
        usage = command.rsplit(" ", 1)[0]
        assert run.stdout.startswith(f"usage: {usage}"), (command, run.stdout[:200])


def test_version_and_schemas_examples_run(shell: _Shell) -> None:
    """`imexd --version` names the version; `schemas --check docs/schemas` finds them current."""
    version = shell.run("imexd --version")
    assert version.returncode == 0, version.stderr
    assert re.fullmatch(r"imexd \d+\.\d+\.\d+\S*\n", version.stdout)
    documented = _documented("imexd --version")
    assert documented.page == "docs/install.md"
    schemas = shell.run("imexd schemas --check docs/schemas")
    assert schemas.returncode == 0, schemas.stdout + schemas.stderr


def test_the_example_settings_written_as_documented_validate(shell: _Shell) -> None:
    """`config --example > FILE`, then `config --config FILE`: valid, every key printed."""
    written = shell.run("imexd config --example > /etc/imexd/imexd.toml")
    assert written.returncode == 0, written.stderr
    path = shell.etc / "imexd.toml"
    assert path.read_text() == written.stdout
    assert "[bus]" in written.stdout
    checked = shell.run("imexd config --config /etc/imexd/imexd.toml")
    assert checked.returncode == 0, checked.stderr
    printed = {line.split(" = ", 1)[0] for line in checked.stdout.splitlines()}
    assert {"node.name", "domain.max_nodes", "bus.url", "imex.binary"} <= printed


def test_discover_without_nvml_prints_what_the_docs_show(shell: _Shell) -> None:
    """On a host without the NVIDIA driver, `imexd discover` exits 1 with the documented line."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this host has the NVIDIA driver: the documented failure cannot happen")
    example = next(e for e in _examples() if e.command == "imexd discover" and e.after)
    run = shell.run("imexd discover")
    assert run.returncode == 1
    assert run.stderr.splitlines()[0] == example.after[0]


def test_keys_create_as_documented(shell: _Shell) -> None:
    """`imexd keys create /etc/imexd/keys` makes control.key (0600) and control.pub and
    prints the lines security.md shows; a second run overwrites nothing (exit 2)."""
    made = shell.run("imexd keys create /etc/imexd/keys")
    assert made.returncode == 0, made.stderr
    keys = shell.etc / "keys"
    assert (keys / "control.key").stat().st_mode & 0o777 == 0o600
    assert (keys / "control.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    text = (DOCS / "security.md").read_text()
    for line in made.stdout.splitlines():
        label = line.split(":", 1)[0]
        shown = line.replace(str(shell.etc), "/etc/imexd").split(" (", 1)[-1]
        assert f"# {label}:" in text, line
        assert shown in text, line
    assert shell.run("imexd keys create /etc/imexd/keys").returncode == 2


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_control_plane_examples_against_a_broker(shell: _Shell, broker: Mosquitto) -> None:
    """`domain list` exits 0 on an empty bus; `domain status job-42` exits 1: nothing there."""
    example = _documented("imexd domain list")
    env = dict(word.split("=", 1) for word in example.env)
    assert env.get("IMEXD_BUS_URL", "").startswith("mqtts://"), "the example names its broker"
    listed = shell.run("imexd domain list", {"IMEXD_BUS_URL": broker.url})
    assert listed.returncode == 0, listed.stderr
    status = shell.run("imexd domain status job-42", {"IMEXD_BUS_URL": broker.url})
    assert status.returncode == 1
    assert "domain job-42: nothing on the bus" in status.stderr
