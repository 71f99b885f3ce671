"""The package's shape: no import cycle, the arrows each package may draw, rules that load
no I/O, and the MQTT libraries behind one module.

Read from the source with `ast` (every `import`, also the lazy ones inside functions),
so a cycle that only bites when a command imports late is caught here too.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "imexd"
MQTT_LIBRARIES = ("aiomqtt", "paho")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """`path` parsed once per test process: every rule here reads the same sources."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _imports(path: Path, *, runtime: bool = False) -> frozenset[str]:
    """Every module `path` imports (absolute names), lazy imports included; with
    `runtime`, not those under `if TYPE_CHECKING:` (types only, never loaded)."""
    found: set[str] = set()
    package = _module_name(path).rpartition(".")[0] if path.name != "__init__.py" else None
    for node in _walk(_tree(path), runtime=runtime):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = (package or _module_name(path)).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _walk(tree: ast.AST, *, runtime: bool) -> Iterator[ast.AST]:
    """ast.walk, skipping the bodies of `if TYPE_CHECKING:` when `runtime`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if runtime and isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _graph(*, runtime: bool = False) -> dict[str, set[str]]:
    """imexd module -> the imexd modules it imports (`runtime`: that it loads)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {
            imported
            for imported in _imports(path, runtime=runtime)
            if imported in modules and imported != name
        }
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, as a path that ends where it starts, or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in done and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (found := visit(start)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_one() -> None:
    """The check itself works: a two-module loop is reported."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    """No imexd module imports itself through others, not even lazily."""
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imex_is_a_leaf() -> None:
    """imexd/imex.py (what IMEX is) imports nothing from imexd."""
    assert not _graph()["imexd.imex"]


def test_only_mqtt_py_imports_the_mqtt_libraries() -> None:
    """aiomqtt and paho are imported by imexd/bus/mqtt.py only: their types stay behind it."""
    users = sorted(
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if any(name.split(".")[0] in MQTT_LIBRARIES for name in _imports(path))
    )
    assert users == ["imexd.bus.mqtt"]


JUDGE_NAME = re.compile(r"^_?judge(_|$)")
"""judge, _judge, judge_domain, _judge_store: names that promise a judgement."""


def _calls_fleet_judge(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "judge")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "judge")
        )
        for node in ast.walk(func)
    )


JUDGE_HOMES = {"imexd.health.fleet", "imexd.channels.fleet"}
"""The homes of judgements: whether a domain is UP (fleet), whether a workload's channel
is ready on its nodes (channels.fleet)."""


def test_the_domain_is_judged_in_fleet_only() -> None:
    """One home for "is the domain UP" (and one for "is the workload's channel READY"):
    elsewhere a function named after judging only gathers the inputs and hands them to
    `fleet.judge`."""
    own_rules = sorted(
        f"{_module_name(path)}.{node.name}"
        for path in PACKAGE.rglob("*.py")
        if _module_name(path) not in JUDGE_HOMES
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and JUDGE_NAME.match(node.name)
        and not _calls_fleet_judge(node)
    )
    assert own_rules == []


# Arrows between packages: what each package of imexd/ may import, stated once here
# (each package's __init__ docstring says it in words). "P.*" allows every module of P.

PACKAGE_MAY_IMPORT: dict[str, frozenset[str]] = {
    # The IMEX daemon, supervised: the leaves only. Never the bus, health, the agent or
    # the control plane (the agent's probe task asks it, in imexd.agent.probes).
    "imexd.daemon": frozenset(
        {
            "imexd.errors",
            "imexd.imex",
            "imexd.logs",
            "imexd.process",
            "imexd.retry",
            "imexd.settings",
        }
    ),
    # The message bus: the leaves below it. Never the shard, the agent, health or the
    # control plane, which read its events.
    "imexd.bus": frozenset(
        {
            "imexd.errors",
            "imexd.logs",
            "imexd.messages",
            "imexd.names",
            "imexd.retry",
            "imexd.settings",
            "imexd.signing",
            "imexd.topics",
        }
    ),
    # Membership: the pure slot rules, the agent's view of its shard and `Desired`. The
    # contract, the bus's events (no I/O), the facts it fills, the settings and the state
    # file's record; never the agent, the bus's link, the daemon, health or the control
    # plane.
    "imexd.membership": frozenset(
        {
            "imexd.bus.events",
            "imexd.facts",
            "imexd.messages",
            "imexd.settings",
            "imexd.nodestate",
            "imexd.topics",
        }
    ),
    # IMEX channels: the leaves and the contract; the domain's fleet module (report
    # freshness, tables); for the keeper task the bus's events and health's guard.
    # Never the agent, the command line or the control plane, which call in.
    "imexd.channels": frozenset(
        {
            "imexd.bus.events",
            "imexd.errors",
            "imexd.facts",
            "imexd.files",
            "imexd.health.fleet",
            "imexd.health.guard",
            "imexd.logs",
            "imexd.messages",
            "imexd.retry",
            "imexd.settings",
            "imexd.topics",
        }
    ),
    # Health: the leaves and the contract, `imexd` for the version, and the types of the
    # daemon's ctl table (fleet, for type checking only). Never the agent, the bus, the
    # command line or the control plane, which read its judgements.
    "imexd.health": frozenset(
        {
            "imexd",
            "imexd.daemon.ctl",
            "imexd.errors",
            "imexd.facts",
            "imexd.imex",
            "imexd.logs",
            "imexd.messages",
            "imexd.retry",
            "imexd.settings",
            "imexd.topics",
        }
    ),
    # The agent: the top of the node's layers, below the command line only. Every
    # package of the node and the leaves; never the control plane, the demo or the
    # simulator, which run beside it.
    "imexd.agent": frozenset(
        {
            "imexd.bus.*",
            "imexd.channels.*",
            "imexd.daemon.*",
            "imexd.health.*",
            "imexd.membership.*",
            "imexd.errors",
            "imexd.fabric",
            "imexd.facts",
            "imexd.files",
            "imexd.logs",
            "imexd.messages",
            "imexd.names",
            "imexd.order",
            "imexd.render",
            "imexd.retry",
            "imexd.settings",
            "imexd.signing",
            "imexd.nodestate",
            "imexd.topics",
        }
    ),
    # The simulator: written apart from the agent, so that the agent's parsers are tested
    # against output it did not write.
    "imexd.sim": frozenset({"imexd", "imexd.errors"}),
    # The control plane: a short-lived MQTT link (the bus's mqtt layer and its broker
    # repairs), the contract and the pure judgements of domains and workloads. Never the
    # agent, the shard, the daemon or the rest of health: it runs on no node.
    "imexd.control": frozenset(
        {
            "imexd",
            "imexd.bus.mqtt",
            "imexd.bus.repairs",
            "imexd.bus.signatures",
            "imexd.channels.fleet",
            "imexd.errors",
            "imexd.health.fleet",
            "imexd.messages",
            "imexd.names",
            "imexd.order",
            "imexd.preflight",
            "imexd.retry",
            "imexd.settings",
            "imexd.signing",
            "imexd.topics",
        }
    ),
    # The demo: starts `imexd run` processes and reads them as an operator would (the
    # control plane's link, the fleet judgement); never the agent's code in its process.
    "imexd.demo": frozenset(
        {
            "imexd",
            "imexd.control.link",
            "imexd.errors",
            "imexd.health.fleet",
            "imexd.messages",
            "imexd.process",
            "imexd.settings",
            "imexd.settings_text",
        }
    ),
}
TOP_OF_THE_LAYERS = "imexd.cli"
"""Nothing imports the command line but itself and `python -m imexd`."""


def _package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _wrong_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Each import across a package's border that PACKAGE_MAY_IMPORT does not allow."""
    return [
        f"{module} -> {imported}"
        for package, allowed in PACKAGE_MAY_IMPORT.items()
        for module, imports in sorted(graph.items())
        if _package(module, package)
        for imported in sorted(imports)
        if not _package(imported, package) and not _allowed(imported, allowed)
    ]


def _allowed(module: str, allowed: frozenset[str]) -> bool:
    return module in allowed or any(
        entry.endswith(".*") and _package(module, entry[:-2]) for entry in allowed
    )


def test_each_package_imports_only_what_it_may() -> None:
    """The arrows out of each package (PACKAGE_MAY_IMPORT): its own modules and the
    listed ones, nothing else of imexd."""
    wrong = _wrong_arrows(_graph())
    assert wrong == [], "imports across a package's border that it may not make: " + ", ".join(
        wrong
    )


def test_nothing_imports_the_command_line() -> None:
    """The CLI is the top: an import of it from below would pull argparse and every
    command into the agent."""
    importers = sorted(
        module
        for module, imports in _graph().items()
        if not _package(module, TOP_OF_THE_LAYERS)
        and module != "imexd.__main__"
        and any(_package(i, TOP_OF_THE_LAYERS) for i in imports)
    )
    assert importers == []


def test_the_package_rule_sees_a_wrong_arrow() -> None:
    """Not blind: an arrow from the daemon package to the bus is reported."""
    graph = _graph()
    graph["imexd.daemon.supervisor"] = graph["imexd.daemon.supervisor"] | {"imexd.bus"}
    assert _wrong_arrows(graph) == ["imexd.daemon.supervisor -> imexd.bus"]


PURE_RULES = (
    "imexd.membership",
    "imexd.agent.core",
    "imexd.agent.gate",
    "imexd.agent.rounds",
    "imexd.agent.followed",
    "imexd.agent.actions",
    "imexd.agent.inputs",
    "imexd.health.fleet",
    "imexd.channels.fleet",
    "imexd.render",
    "imexd.facts",
    "imexd.nodestate",
)
"""The rules a newcomer can own without a broker, a daemon or a disk: what they load."""
IO_MODULES = (
    "imexd.agent.run",
    "imexd.agent.reconcile",
    "imexd.agent.probes",
    "imexd.agent.presences",
    "imexd.agent.report",
    "imexd.agent.discovery",
    "imexd.agent.rebuild",
    "imexd.agent.statefile",
    "imexd.agent.snapshot",
    "imexd.bus.engine",
    "imexd.bus.link",
    "imexd.bus.mqtt",
    "imexd.daemon.process",
    "imexd.daemon.supervisor",
    "imexd.daemon.ctl",
    "imexd.files",
    "imexd.health.http",
    "imexd.process",
)
"""Modules that talk to the broker, run processes or write files."""


def _io_reached(graph: dict[str, set[str]]) -> list[str]:
    """Each pure rule that loads an I/O module, directly or through another module."""
    found = []
    for module in sorted(graph):
        if not any(_package(module, rule) for rule in PURE_RULES):
            continue
        seen: set[str] = set()
        todo = [module]
        while todo:
            for imported in graph[todo.pop()] - seen:
                seen.add(imported)
                todo.append(imported)
        found += [
            f"{module} -> {io}"
            for io in sorted(seen)
            if any(_package(io, entry) for entry in IO_MODULES)
        ]
    return found


def test_the_rules_load_no_io() -> None:
    """The pure rules (slots, the shard, `Desired`, the node's core and its gate, the
    fleet judgements, the renderer, the records) load nothing that does I/O, not even
    through a leaf: types that only the type checker reads (`if TYPE_CHECKING:`) do not
    count. The shard once loaded the file writer through the state file's record."""
    assert _io_reached(_graph(runtime=True)) == []


def test_the_io_rule_sees_the_core_reach_the_reconciler() -> None:
    """Not blind: the node's core importing the reconciler (which writes files) is reported."""
    graph = _graph(runtime=True)
    graph["imexd.agent.gate"] = graph["imexd.agent.gate"] | {"imexd.agent.reconcile"}
    assert "imexd.agent.core -> imexd.agent.reconcile" in _io_reached(graph)


def test_the_io_rule_sees_a_path_through_a_leaf() -> None:
    """Not blind: the shard reaching the file writer through a leaf is reported."""
    graph = _graph(runtime=True)
    graph["imexd.nodestate"] = graph["imexd.nodestate"] | {"imexd.files"}
    assert "imexd.membership.shard -> imexd.files" in _io_reached(graph)


def _part(module: str) -> str:
    """The package (or top-level module) of imexd that `module` belongs to."""
    return ".".join(module.split(".")[:2])


def _two_way(graph: dict[str, set[str]]) -> list[str]:
    """Each pair of parts of imexd (packages, top-level modules) that import each other."""
    arrows = {
        (_part(module), _part(imported))
        for module, imports in graph.items()
        for imported in imports
        if module != "imexd" and imported != "imexd" and _part(module) != _part(imported)
    }
    return sorted(f"{a} <-> {b}" for a, b in arrows if a < b and (b, a) in arrows)


def test_no_two_packages_import_each_other() -> None:
    """The layers are one way: no package imports a package (or top-level module) that
    imports it back, not even for types."""
    assert _two_way(_graph()) == []


def test_the_two_way_rule_sees_a_pair() -> None:
    """Not blind: the daemon importing the agent back is reported."""
    graph = _graph()
    graph["imexd.daemon.supervisor"] = graph["imexd.daemon.supervisor"] | {"imexd.agent.run"}
    assert _two_way(graph) == ["imexd.agent <-> imexd.daemon"]
