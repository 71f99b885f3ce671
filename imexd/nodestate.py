"""What the agent remembers across restarts: last domain, clique, slot and incarnation.

A pure record: the shard decides what to remember (`imexd.membership.shard`), the agent's
state file keeps it (`imexd.agent.statefile`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeState:
    """The persisted facts; `incarnation` is this agent's, already incremented."""

    domain: str | None = None
    clique: str = ""
    slot: int | None = None
    incarnation: int = 0
