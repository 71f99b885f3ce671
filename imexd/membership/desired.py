"""What should run on this node: the one value membership hands the reconciler.

`imexd.membership.shard` derives a `Desired` from the records of its shard, and
`imexd.agent.reconcile` makes it real in the files and the daemon. It lives here, below
both, so that the rules never import the module that writes files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from imexd.facts import Member

_NO_MEMBERS: Final[MappingProxyType[int, Member]] = MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class Desired:
    """What should run on this node, derived from membership."""

    domain: str | None = None
    clique: str = ""
    slot: int | None = None
    run: bool = False
    """Whether the IMEX daemon should run (a settled member with a clique, no mismatch)."""
    members: MappingProxyType[int, Member] = field(default_factory=lambda: _NO_MEMBERS)
    """slot -> name and address of the settled members (the hosts block / node list)."""
    cleanup: bool = False
    """Not in a domain: remove our hosts block and IMEX files."""
