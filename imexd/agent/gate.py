"""The daemon's one gate: every stop, restart and retry of the IMEX daemon passes `admit`.

A running job's IMEX is touched only by the node's own decision (docs/membership.md,
*Incumbency*; the rule is `imexd.membership.shard.own_change`). The agent reaches the
daemon in several places: membership moves the node off its slot, the node leaves its
shard, the control plane deletes the domain, a FATAL daemon gives its slot up, the agent
stops, an operator asks for a retry. Each of them becomes a `DaemonOrder`, and only
`admit` makes one: the supervisor's stop, restart, retry and stray ending are called
only by `Reconciler.carry_out`, which takes nothing but an order
(tests/test_gate.py checks the source for any other caller).

The causes that are the node's own by nature, whatever the records say, are named here
(`EXEMPT`); every other cause is judged by `own_change`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Literal

from imexd.membership.desired import Desired
from imexd.membership.shard import own_change

Kind = Literal["stop", "restart", "retry", "end_strays"]
"""What an order does to the daemon: the supervisor's call of that name."""


class Cause(StrEnum):
    """The node's own reasons that no record can give: exempt from `own_change`."""

    LEAVE = "Leave"
    """The agent stops (SIGTERM): the node leaves its domain."""
    LEFT_SHARD = "LeftShard"
    """The node's target (domain, clique) moved: an unassignment, an assignment to another
    domain, a new static domain, the node's own clique discovered anew."""
    RETRY = "OperatorRetry"
    """`imexd node retry`: an operator's command (and a retry never ends a running daemon)."""
    SAME_IDENTITY = "SameIdentity"
    """A restart that keeps the node's domain, clique and slot: config.cfg moved with the
    node's settings, or addresses mode, whose daemon reads member addresses only at start
    (the operator chose that mode and its restarts)."""


EXEMPT: Final = frozenset(Cause)

IdentityKey = tuple[str, str, int]
"""(domain, clique, slot): what a daemon is started as, what a stop or restart moves."""


def runs_as(desired: Desired) -> IdentityKey | None:
    """What a daemon of `desired` runs as (None: it runs none)."""
    if not desired.run or desired.domain is None or desired.slot is None:
        return None
    return desired.domain, desired.clique, desired.slot


_KEY: Final = object()


@dataclass(frozen=True, slots=True)
class DaemonOrder:
    """A stop, restart or retry of the daemon that the gate admitted, with why."""

    kind: Kind
    why: str
    cause: str
    key: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.key is not _KEY:
            raise TypeError("a DaemonOrder is made by imexd.agent.gate.admit only")


def admit(
    kind: Kind,
    why: str,
    cause: str,
    *,
    running: Desired,
    desired: Desired,
    incumbent: bool,
) -> DaemonOrder | None:
    """The order to `kind` the daemon that runs `running` for `desired`, or None when the
    rule forbids it: a cause in EXEMPT, or one `own_change` accepts (`incumbent`: our
    record stood without a break when the change was decided)."""
    if cause in EXEMPT or own_change(running, desired, cause, incumbent=incumbent):
        return DaemonOrder(kind, why, cause, _KEY)
    return None
