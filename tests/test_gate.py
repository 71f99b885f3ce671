"""The daemon's one gate: every stop, restart and retry of the IMEX daemon passes `admit`.

From the source: the supervisor's stop, restart, retry and stray ending are called only
by `Reconciler.carry_out`, which takes only a `DaemonOrder`, and only `admit` makes one;
a planted call elsewhere is caught. Then each path that stops or restarts the daemon,
driven through the node's core, and how the gate judges it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
from structlog.testing import capture_logs

from imexd.agent.actions import Publish, SaveState, Survey
from imexd.agent.gate import Cause, DaemonOrder, admit
from imexd.agent.inputs import Retarget
from imexd.bus.events import Connected, Synced
from imexd.membership.claim import Reason
from imexd.membership.desired import Desired
from imexd.membership.shard import DOMAIN_DELETED, Plan
from imexd.messages import DomainSpec, Received
from imexd.topics import TopicRef
from tests.test_core import CLIQUE, DOMAIN, TOPICS, Driver

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


@pytest.mark.parametrize("cause", [DOMAIN_DELETED, Reason.NOT_IN_SPEC, Reason.RELEASED])
def test_the_shards_own_causes_pass(cause: str) -> None:
    """A domain delete, a spec without us, a FATAL daemon's release."""
    assert admit("stop", "x", cause, running=RUNS, desired=STOPPED, incumbent=True) is not None


@pytest.mark.parametrize("cause", [Reason.LOST_CONFLICT, Reason.CLAIMED, ""])
def test_another_nodes_record_moves_no_incumbent(cause: str) -> None:
    """Another node's record stops or moves the daemon only of a member whose record did
    not stand without a break."""
    for desired in (STOPPED, MOVED):
        assert admit("restart", "x", cause, running=RUNS, desired=desired, incumbent=True) is None
        assert admit("restart", "x", cause, running=RUNS, desired=desired, incumbent=False)


def spec(state: Literal["active", "deleting"], nodes: list[str] | None = None) -> Received:
    record = DomainSpec(domain=DOMAIN, max_nodes=4, state=state, nodes=nodes, generation=2)
    ref = TopicRef(kind="spec", domain=DOMAIN)
    return Received(topic=TOPICS.spec(DOMAIN), ref=ref, payload=record, retained=False)


def test_every_stop_path_of_the_core_passes_the_gate() -> None:
    """Each way the core takes a settled member's daemon down, driven by its inputs, is
    an order the gate admitted, with its cause: a domain delete, a spec without us, a
    FATAL daemon's release (tests/test_core.py), a new target, the agent's leave, an
    operator's retry; a restart that keeps the identity; a daemon none of ours."""
    running = (DOMAIN, CLIQUE, 0)
    causes: dict[str, str] = {}

    def settled() -> Driver:
        d = Driver()
        d.settle()
        return d

    def stop(d: Driver, path: str) -> None:
        order = d.core.order("stop", path, running, d.core.desired)
        assert order is not None, path
        causes[path] = order.cause

    d = settled()
    d.bus(spec("deleting"), at=2.0)
    d.step(2.0)
    assert d.core.desired.cleanup
    stop(d, "domain deleted")

    d = settled()
    d.bus(spec("active", nodes=["n7"]), at=2.0)
    d.step(2.0)
    assert not d.core.desired.run
    stop(d, "not in the spec")

    d = settled()
    d.core.clique = "c2"  # discovery found another clique: the target moved
    d.feed(Retarget(), 2.0)
    d.bus(Synced(at=2.0))
    d.step(2.1)  # the first plan of the new shard: what ran in the old one stops
    assert not d.core.desired.run
    stop(d, "new target")

    d = settled()
    causes["leave"] = d.core.shutdown().cause
    causes["same identity"] = getattr(d.core.order("restart", "x", running, RUNS), "cause", "")
    causes["none of ours"] = getattr(d.core.order("end_strays", "x", None, STOPPED), "kind", "")

    assert causes == {
        "domain deleted": DOMAIN_DELETED,
        "not in the spec": Reason.NOT_IN_SPEC,
        "new target": Cause.LEFT_SHARD,
        "leave": Cause.LEAVE,
        "same identity": Cause.SAME_IDENTITY,
        "none of ours": "end_strays",
    }


def test_a_rival_record_gives_no_order_against_an_incumbent() -> None:
    """A member on our slot while our record stood without a break moves nothing: the
    daemon keeps running, and the gate gives the reconciler no order to stop it; after
    our link broke (no longer incumbent), the settle stamps decide and it may."""
    d = Driver()
    d.settle()
    incumbent = [d.core.shard.incumbent]
    assert d.core.order("stop", "x", (DOMAIN, CLIQUE, 0), STOPPED) is None
    assert d.core.order("restart", "x", (DOMAIN, CLIQUE, 0), MOVED) is None
    d.bus(Connected(broker="b", protocol="5", will_delay=True, link=2), at=3.0)
    incumbent.append(d.core.shard.incumbent)
    assert incumbent == [True, False]
    assert d.core.order("restart", "x", (DOMAIN, CLIQUE, 0), MOVED) is not None


@pytest.mark.parametrize(
    ("cause", "kept"), [(Reason.PARTITION_HEALED, True), (Reason.NOT_IN_SPEC, False)]
)
def test_a_plan_against_the_rule_is_held_by_the_core(
    monkeypatch: pytest.MonkeyPatch, cause: Reason, *, kept: bool
) -> None:
    """Should a membership step ever stop a continuous member's daemon for another node's
    record, the core holds what runs: nothing of the plan is published or saved, and the
    broken promise is logged as an error; for the node's own reason the stop goes on."""
    d = Driver()
    d.settle()
    runs = d.core.desired
    decision = d.core.shard.decision
    assert decision is not None
    gone = msgspec.structs.replace(decision, reason=cause, publish=True, settled=False)
    stop = Plan(desired=Desired(domain=DOMAIN, clique=CLIQUE), decision=gone, publish=True)

    def derive(now: float, **_: Any) -> Plan:
        return stop

    monkeypatch.setattr(d.core.shard, "derive", derive)
    with capture_logs() as logs:
        actions = d.step(2.0)
    events = [(e["event"], e["log_level"]) for e in logs if e["log_level"] == "error"]
    if kept:
        assert events == [("membership.daemon_kept", "error")]
        assert d.core.desired == runs
        assert Survey() in actions
        assert not [a for a in actions if isinstance(a, Publish | SaveState)]
    else:
        assert events == []
        assert not d.core.desired.run
        assert [a for a in actions if isinstance(a, Publish)]
