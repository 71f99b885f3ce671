"""Every time window of `imexd/membership/`, `imexd/bus/` and `imexd/agent/` has its row in
the "Timers and guards" table of docs/architecture.md, and every row names something the
code has.

Read from the source with `ast`. A time window is, in those three packages:
1. a module- or class-level assignment whose name ends in `_S` or `_MS`;
2. a module- or class-level number that scales a duration: an operand of `*` whose other
   operand is named `..._s` or `..._S` (`FIRST_START_WINDOWS * self.settle_s`);
3. a parameter named `..._s` whose default is a number (`Bus(timeout_s=10.0)`), named
   `module.Class.param` for a constructor's and `module.function.param` otherwise;
4. a number written into arithmetic, `min` or `max` beside a value named `..._s` or `..._S`
   (a window computed from settings or a constant), named by the nearest thing it is
   bound to: a keyword argument (`module.function.keyword`), a local
   (`module.function.local`), an attribute of `self` (`module.Class.attr`), else its
   function. `NOT_GUARDS` lists those that decide nothing, each with why.
`module` is the file's name without `.py` (unique across the three packages), functions
and classes are written by their nesting (`run.Agent._reconcile_loop.bound`). A row may
also name a window that no rule finds (a setting used as a window on its own, such as
`slots.stale_claims`); it must then name a definition, an assignment, a parameter or a
keyword argument that exists.

The table's targets (`MAX_ROWS`, `BROKER_NAMES`): at most 30 rows, and no broker is named
outside the bus.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from tests.test_docs import _section

ROOT = Path(__file__).resolve().parent.parent
PACKAGES: Final = ("membership", "bus", "agent")
"""The packages whose time windows the table lists, under imexd/."""
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADING: Final = "## Timers and guards"

MAX_ROWS: Final = 30
"""At most this many rows in the table: records carry their author's version, so no
window stands in for an order."""
BROKER_NAMES: Final = ("Mosquitto", "NATS", "nats-server", "RabbitMQ", "amqtt", "ejabberd")
"""No broker is named in the code or docstrings of
`imexd/membership/` and `imexd/agent/`; what one broker needs lives in `imexd/bus/`."""
SERVES: Final = frozenset({"1", "2", "3", "liveness", "cost"})
"""What a row may say it serves: one of DESIGN.md's three invariants, or neither."""
NOT_GUARDS: Final = {
    "pings.Pings.round_trip": "logs bus_ping_loop_late when the loop ran late by half the "
    "ping timeout; it decides nothing",
}
"""Windows rule 4 finds that guard nothing, each with why."""

_TIMEY = re.compile(r"_(?:M?S|s)$")
_CONSTANT = re.compile(r"_M?S$")
_NAME = re.compile(r"^[a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
_BROKER = re.compile(r"\b(?:" + "|".join(map(re.escape, BROKER_NAMES)) + r")\b", re.I)

_Scope = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _modules() -> dict[str, str]:
    """Module name (the file's, or the package's for `__init__.py`) -> its source."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / "imexd" / package).glob("*.py")):
            name = package if path.name == "__init__.py" else path.stem
            assert name not in found, (
                f"two modules named {name}: the table's names would be ambiguous"
            )
            found[name] = path.read_text()
    return found


def _statements(scope: _Scope) -> Iterator[ast.stmt]:
    """The statements of `scope` itself: its body and the blocks inside it (if, with, try,
    loops), not the bodies of the functions and classes it defines."""
    todo: list[ast.stmt] = list(scope.body)
    while todo:
        stmt = todo.pop(0)
        yield stmt
        if not isinstance(stmt, _DEFS):
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.stmt):
                    todo.append(child)
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    todo.extend(child.body)


def _targets(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return stmt.targets
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        return [stmt.target]
    return []


def _number(node: ast.expr | None) -> bool:
    """A number written in the source (or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_number(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _number(node.operand)
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    )


def _ident(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _timey(node: ast.AST) -> bool:
    """A value whose name says it counts seconds (`..._s`, `..._S`, `..._MS`)."""
    name = _ident(node)
    return name is not None and bool(_TIMEY.search(name))


class _Source:
    """One module's tree, with each node's parent and the dotted name of each scope."""

    def __init__(self, module: str, source: str) -> None:
        self.module = module
        self.tree = ast.parse(source)
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node

    def scope(self, node: ast.AST) -> _Scope:
        """The function, class or module `node` is written in."""
        up = self.parent.get(node)
        while up is not None and not isinstance(up, _Scope):
            up = self.parent.get(up)
        assert up is not None
        return up

    def dotted(self, scope: _Scope) -> str:
        """`module.Class.function` of a scope (`module` for the module)."""
        names: list[str] = []
        node: ast.AST | None = scope
        while node is not None and not isinstance(node, ast.Module):
            if isinstance(node, _DEFS):
                names.append(node.name)
            node = self.parent.get(node)
        return ".".join([self.module, *reversed(names)])

    def owner(self, node: ast.AST) -> str:
        """Rule 4's name of a window: the keyword argument, local or attribute of `self`
        nearest around `node`, else its function."""
        scope = self.scope(node)
        up = self.parent.get(node)
        while up is not None and up is not scope:
            if isinstance(up, ast.keyword) and up.arg is not None:
                return f"{self.dotted(scope)}.{up.arg}"
            if isinstance(up, ast.stmt):
                for target in _targets(up):
                    if isinstance(target, ast.Name):
                        return f"{self.dotted(scope)}.{target.id}"
                    if _is_self(target):
                        assert isinstance(target, ast.Attribute)
                        return f"{self.dotted(self.scope(scope))}.{target.attr}"
                break
            up = self.parent.get(up)
        return self.dotted(scope)

    def scopes(self) -> Iterator[_Scope]:
        yield self.tree
        for node in ast.walk(self.tree):
            if isinstance(node, _DEFS):
                yield node


def _is_self(target: ast.expr) -> bool:
    return (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    )


def time_windows(module: str, source: str) -> set[str]:
    """The time windows of one module, by the rules of this module's docstring."""
    src = _Source(module, source)
    found: set[str] = set()
    numbers: dict[str, str] = {}  # rule 2's candidates: name -> dotted name
    for scope in src.scopes():
        if not isinstance(scope, ast.Module | ast.ClassDef):
            continue
        for stmt in _statements(scope):
            value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
            for target in _targets(stmt):
                if not isinstance(target, ast.Name):
                    continue
                dotted = f"{src.dotted(scope)}.{target.id}"
                if _CONSTANT.search(target.id):
                    found.add(dotted)  # rule 1
                elif _number(value):
                    numbers[target.id] = dotted
    for node in ast.walk(src.tree):
        if isinstance(node, ast.BinOp):
            sides = (node.left, node.right)
            if isinstance(node.op, ast.Mult):
                for one, other in (sides, sides[::-1]):
                    name = _ident(one)
                    if name in numbers and _timey(other):
                        found.add(numbers[name])  # rule 2
            if any(_number(s) for s in sides) and any(_timey(s) for s in sides):
                found.add(src.owner(node))  # rule 4
        elif isinstance(node, ast.Call) and _ident(node.func) in ("min", "max"):
            if any(_number(a) for a in node.args) and any(_timey(a) for a in node.args):
                found.add(src.owner(node))  # rule 4
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [
                *zip(
                    positional[len(positional) - len(args.defaults) :], args.defaults, strict=True
                ),
                *zip(args.kwonlyargs, args.kw_defaults, strict=True),
            ]
            where = src.dotted(src.scope(node)) if node.name == "__init__" else src.dotted(node)
            for arg, default in pairs:
                if arg.arg.endswith("_s") and _number(default):
                    found.add(f"{where}.{arg.arg}")  # rule 3
    return found


def nameable(module: str, source: str) -> set[str]:
    """Every dotted name a row may use in `module`: its functions and classes, the names
    assigned at module and class level, a class's attributes of `self` and constructor
    parameters, and a function's parameters, locals and keyword arguments."""
    src = _Source(module, source)
    names: set[str] = set()
    for scope in src.scopes():
        here = src.dotted(scope)
        if scope is not src.tree:
            names.add(here)
        for stmt in _statements(scope):
            for target in _targets(stmt):
                if isinstance(target, ast.Name):
                    names.add(f"{here}.{target.id}")
        if isinstance(scope, ast.ClassDef):
            for node in ast.walk(scope):
                if isinstance(node, ast.stmt):
                    names.update(
                        f"{here}.{t.attr}"
                        for t in _targets(node)
                        if isinstance(t, ast.Attribute) and _is_self(t)
                    )
                if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                    names.update(f"{here}.{a.arg}" for a in _parameters(node))
        elif isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            names.update(f"{here}.{a.arg}" for a in _parameters(scope))
            for stmt in _statements(scope):
                for node in ast.walk(stmt):
                    if isinstance(node, ast.keyword) and node.arg is not None:
                        names.add(f"{here}.{node.arg}")
    return names


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    args = function.args
    return [*args.posonlyargs, *args.args, *args.kwonlyargs]


def table(text: str) -> list[list[str]]:
    """The rows of the "Timers and guards" table: five cells each (names, value, what it
    protects, what it serves, which broker), header and separator left out."""
    lines = [line for line in _section(text, HEADING).splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return [row for row in rows[2:] if row]


def row_names(row: list[str]) -> list[str]:
    """The code names of a row's first cell (one or more `module.NAME`)."""
    return re.findall(r"`([^`]+)`", row[0])


def problems(sources: dict[str, str], text: str) -> tuple[list[str], list[str]]:
    """(windows the code has and the table lacks, table names the code lacks)."""
    found: set[str] = set()
    known: set[str] = set()
    for module, source in sources.items():
        found |= time_windows(module, source)
        known |= nameable(module, source)
    listed = {name for row in table(text) for name in row_names(row)}
    missing = sorted(found - listed - set(NOT_GUARDS))
    unknown = sorted(listed - known)
    return missing, unknown


def broker_mentions() -> list[str]:
    """`path:line` of every broker name in `imexd/membership/` and `imexd/agent/`."""
    return [
        f"{path.relative_to(ROOT)}:{number}"
        for package in PACKAGES
        if package != "bus"
        for path in sorted((ROOT / "imexd" / package).glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if _BROKER.search(line)
    ]


# -- the table against the code ------------------------------------------------------


def test_every_time_window_has_its_row_and_every_row_names_code() -> None:
    """Each time window of the three packages is named by a row, and each name of a row
    is something the code defines."""
    missing, unknown = problems(_modules(), ARCHITECTURE.read_text())
    assert missing == [], f"time windows missing from docs/architecture.md ({HEADING}): {missing}"
    assert unknown == [], f"rows of {HEADING} name what the code lacks: {unknown}"


def test_the_exemptions_are_still_found() -> None:
    """Each of NOT_GUARDS is still a window the rules find (a stale exemption hides
    nothing)."""
    found = set().union(*(time_windows(m, s) for m, s in _modules().items()))
    assert set(NOT_GUARDS) <= found, f"stale NOT_GUARDS: {set(NOT_GUARDS) - found}"


def test_every_row_is_filled_in() -> None:
    """Every row names code once, gives a value, what it protects, what it serves (1, 2, 3,
    liveness or cost) and a broker ("all" or the one it answers)."""
    rows = table(ARCHITECTURE.read_text())
    assert rows, f"no table under {HEADING}"
    bad = []
    seen: set[str] = set()
    for row in rows:
        names = row_names(row) if row else []
        serves = {s.strip() for s in row[3].split(",")} if len(row) == 5 else set()
        if (
            len(row) != 5
            or not names
            or not all(_NAME.match(n) for n in names)
            or seen & set(names)
            or not all(row[1:])
            or not serves <= SERVES
        ):
            bad.append(" | ".join(row))
        seen.update(names)
    assert bad == [], "rows not filled in as the table's heading says:\n" + "\n".join(bad)


def test_the_checks_see_an_unlisted_window_and_a_stale_row() -> None:
    """Not blind: a planted module's window of each rule is reported missing, a row naming
    nothing is reported, and names the rules do not mean are not found."""
    planted = (
        "from typing import Final\n"
        "LATE_S: Final = 3.0\n"
        "TRIES = 4\n"
        "WINDOWS = 5\n"
        "class Watch:\n"
        "    GRACE_MS = 250\n"
        "    def __init__(self, *, wait_s: float = 2.0, count: int = 3) -> None:\n"
        "        self.bound = max(1.0, wait_s)\n"
        "    def due(self, settle_s: float) -> float:\n"
        "        margin = settle_s + 0.5\n"
        "        return call(limit=2 * settle_s, other=WINDOWS * settle_s, n=TRIES + 1) + margin\n"
    )
    expected = {
        "planted.LATE_S",
        "planted.Watch.GRACE_MS",
        "planted.WINDOWS",
        "planted.Watch.wait_s",
        "planted.Watch.bound",
        "planted.Watch.due.margin",
        "planted.Watch.due.limit",
    }
    assert time_windows("planted", planted) == expected
    assert expected <= nameable("planted", planted)
    doc = (
        f"# Page\n\n{HEADING}\n\n| name | value | protects | serves | broker |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| `planted.LATE_S` | 3 s | x | cost | all |\n"
        "| `planted.Gone.NEVER_S` | 1 s | x | 3 | all |\n\n## Next\n"
    )
    missing, unknown = problems({"planted": planted}, doc)
    assert missing == sorted(expected - {"planted.LATE_S"})
    assert unknown == ["planted.Gone.NEVER_S"]


# -- the table's targets -----------------------------------------------------------------


def test_the_table_has_at_most_max_rows() -> None:
    """At most MAX_ROWS timers and guards remain: records carry their author's version,
    and the windows that stood in for an order are gone."""
    rows = table(ARCHITECTURE.read_text())
    assert len(rows) <= MAX_ROWS, f"{len(rows)} rows, the target is at most {MAX_ROWS}"


def test_no_broker_is_named_outside_the_bus() -> None:
    """What one broker needs is said and done in imexd/bus/ only."""
    mentions = broker_mentions()
    assert mentions == [], f"broker names outside imexd/bus/: {mentions}"
