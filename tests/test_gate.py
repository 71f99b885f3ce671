"""The daemon's one gate: every stop, restart and retry of the IMEX daemon passes `admit`.

From the source: the supervisor's stop, restart, retry and stray ending are called only
by `Reconciler.carry_out`, which takes only a `DaemonOrder`, and only `admit` makes one;
a planted call elsewhere is caught. Then each path that stops or restarts the daemon,
driven through the node's core, and how the gate judges it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from imexd.agent.gate import Cause, DaemonOrder, admit
from imexd.membership import slots as mb
from imexd.membership.desired import Desired
from imexd.membership.shard import DOMAIN_DELETED
from tests.test_core import CLIQUE, DOMAIN, Driver

ROOT = Path(__file__).resolve().parent.parent / "imexd"
DAEMON_CALLS = frozenset({"stop", "restart", "retry", "end_strays"})
"""The supervisor's calls that end or replace a daemon."""
CARRIER = ("imexd/agent/reconcile.py", "carry_out")
"""The one function that makes them, from an order."""


def _supervisor(node: ast.expr) -> bool:
    """Whether `node` names a supervisor (`supervisor`, `self.supervisor`, `x.supervisor`)."""
    if isinstance(node, ast.Name):
        return "supervisor" in node.id
    if isinstance(node, ast.Attribute):
        return "supervisor" in node.attr
    return False


def daemon_calls(source: str, path: str) -> list[tuple[str, str]]:
    """(path, function) of each call of a supervisor's stop, restart, retry or end_strays."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in DAEMON_CALLS
                and _supervisor(child.func.value)
            ):
                found.append((path, function))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def _all_daemon_calls() -> set[tuple[str, str]]:
    calls: set[tuple[str, str]] = set()
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT.parent).as_posix()
        if relative.startswith("imexd/daemon/"):
            continue  # the supervisor itself: its own crash handling
        calls |= set(daemon_calls(path.read_text(), relative))
    return calls


def test_only_the_carrier_of_orders_stops_or_restarts_the_daemon() -> None:
    """Outside the daemon package, the supervisor's stop, restart, retry and end_strays
    are called in one place: `Reconciler.carry_out`, which takes an order."""
    assert _all_daemon_calls() == {CARRIER}


def test_a_planted_bypass_is_caught() -> None:
    """Not blind: a stop called straight from the agent's loop is reported."""
    planted = (
        "class Agent:\n"
        "    async def _reconcile_loop(self):\n"
        "        await self.supervisor.stop('a peer said so')\n"
        "    async def _shutdown(self):\n"
        "        _, supervisor = self._parts()\n"
        "        await supervisor.restart('why not')\n"
    )
    assert daemon_calls(planted, "imexd/agent/run.py") == [
        ("imexd/agent/run.py", "_reconcile_loop"),
        ("imexd/agent/run.py", "_shutdown"),
    ]


def test_an_order_is_made_by_the_gate_only() -> None:
    """A `DaemonOrder` built by hand is refused: only `admit` holds the key."""
    with pytest.raises(TypeError, match="admit only"):
        DaemonOrder("stop", "a peer said so", "")


RUNS = Desired(domain=DOMAIN, clique=CLIQUE, slot=0, run=True)
MOVED = Desired(domain=DOMAIN, clique=CLIQUE, slot=1, run=True)
STOPPED = Desired(domain=DOMAIN, clique=CLIQUE)


@pytest.mark.parametrize("cause", sorted(Cause))
def test_the_nodes_own_causes_pass_even_an_incumbent(cause: str) -> None:
    """Leave, a new target, an operator's retry, a restart that keeps the identity: the
    node's own, admitted whatever the records say."""
    assert admit("stop", "x", cause, running=RUNS, desired=STOPPED, incumbent=True) is not None


@pytest.mark.parametrize("cause", [DOMAIN_DELETED, mb.Reason.NOT_IN_SPEC, mb.Reason.RELEASED])
def test_the_shards_own_causes_pass(cause: str) -> None:
    """A domain delete, a spec without us, a FATAL daemon's release."""
    assert admit("stop", "x", cause, running=RUNS, desired=STOPPED, incumbent=True) is not None


@pytest.mark.parametrize("cause", [mb.Reason.LOST_CONFLICT, mb.Reason.CLAIMED, ""])
def test_another_nodes_record_moves_no_incumbent(cause: str) -> None:
    """Another node's record stops or moves the daemon only of a member whose record did
    not stand without a break."""
    for desired in (STOPPED, MOVED):
        assert admit("restart", "x", cause, running=RUNS, desired=desired, incumbent=True) is None
        assert admit("restart", "x", cause, running=RUNS, desired=desired, incumbent=False)


def test_every_stop_path_of_the_core_passes_the_gate() -> None:
    """Each way the core takes the daemon down yields an admitted order with its cause:
    the agent's leave, an operator's retry, a FATAL daemon's release, a domain delete, a
    move off the slot while not incumbent; and a rival's record against an incumbent
    changes nothing the reconciler could act on."""
    running = (DOMAIN, CLIQUE, 0)
    causes: dict[str, str] = {}

    d = Driver()
    d.settle()
    causes["leave"] = d.core.shutdown().cause
    none_of_ours = d.core.order("end_strays", "x", None, Desired(cleanup=True))
    assert none_of_ours is not None
    # A rival member on our slot while our record stood: the daemon keeps running.
    assert d.core.order("stop", "x", running, STOPPED) is None
    assert d.core.desired.run

    d.core.departures[running] = (mb.Reason.LOST_CONFLICT, False)  # our link broke first
    moved = d.core.order("restart", "identity", running, MOVED)
    assert moved is not None
    causes["moved while not incumbent"] = moved.cause

    d = Driver()
    d.settle()
    d.core.departures[running] = (DOMAIN_DELETED, True)
    deleted = d.core.order("stop", "left", running, Desired(cleanup=True))
    assert deleted is not None
    causes["domain deleted"] = deleted.cause
    same = d.core.order("restart", "addresses", running, RUNS)
    assert same is not None
    causes["same identity"] = same.cause

    assert causes == {
        "leave": Cause.LEAVE,
        "moved while not incumbent": mb.Reason.LOST_CONFLICT,
        "domain deleted": DOMAIN_DELETED,
        "same identity": Cause.SAME_IDENTITY,
    }
