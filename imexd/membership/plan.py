"""What one step of the shard hands the agent (`Plan`), and the rules a plan must keep.

`own_change` is the one rule of invariant 1: a plan may stop or restart a settled
member's daemon only for the node's own reasons. `FirstStart` holds the first daemon
start in a shard until the shard has formed, so that the daemon starts once with the
whole node list instead of once per newcomer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec
import structlog

from imexd.membership import slots as mb
from imexd.membership.claim import Decision, Reason
from imexd.membership.desired import Desired
from imexd.messages import DomainSpec, MemberRecord, MemberState

FIRST_START_WINDOWS: Final = 5
"""The first daemon start in a shard waits at most this many `[domain] settle_s` (1 s by
default) for claims in flight and listed nodes that are not members yet. A claim settles
within a round trip and the nodes of one job are assigned at once, so formation is done
well within it; a node that is stuck or absent delays the others' start by this much,
and joins later by SIGUSR1 like any newcomer."""


DOMAIN_DELETED: Final = "DomainDeleted"
"""The cause of a plan that leaves a domain the control plane deletes (`own_change`)."""
OWN_CAUSES: Final = frozenset({DOMAIN_DELETED, Reason.NOT_IN_SPEC, Reason.RELEASED})
"""The causes of a plan that are the node's own reasons to stop or restart its daemon,
among those `ShardView.derive` sees (`own_change`)."""


def own_change(running: Desired, desired: Desired, cause: str, *, incumbent: bool) -> bool:
    """Whether `desired` may replace `running` (what the daemon runs now): the one rule.

    The daemon of a settled member is stopped or restarted only for the node's own
    reasons: a leave (SIGTERM), a domain delete, a spec that drops the node, an
    unassignment, a daemon failure (its slot released), an operator command; never
    because of another node's record while this node's link has been continuous.
    `cause` is why the plan changed (a `membership.Reason`, or DOMAIN_DELETED);
    `incumbent`: our member record stood on the broker without a break, on links that
    keep the broker's order, so our link has been continuous (`ShardView.incumbent`).

    Why this is the whole rule: a leave, an unassignment and an operator's command to
    move the node end the shard itself (the agent leaves it before any plan of the new
    one), and the remaining own reasons reach the shard's judgement as a spec (deleting,
    or a list without us) or as the release of a failed daemon: OWN_CAUSES. Anything
    else that moves us off a slot is another node's record (a rival member, a claim
    that beat ours), and `membership.step` gives such a record no power over a member
    whose record stood without a break (its incumbency). Where our record did not
    stand (a reconnect whose snapshot lost it: a broker that lost its state, a will
    that fired), or the link does not keep the broker's order (a clustered broker may
    let two members settle one slot), we cannot know we were first, and the settle
    stamps decide.
    A change that keeps the same slot of the same shard running touches nothing: new
    members are a SIGUSR1, never a restart.
    """
    if not running.run or running.domain is None or running.slot is None:
        return True
    if desired.run and (desired.domain, desired.clique, desired.slot) == (
        running.domain,
        running.clique,
        running.slot,
    ):
        return True
    return cause in OWN_CAUSES or not incumbent


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What the agent must do after one `derive`: publish, then `commit`, then run."""

    desired: Desired | None = None
    """What should run now; None: keep what runs (no shard, or no synced snapshot)."""
    leave: bool = False
    """The domain is being deleted while we are in it: clear our records, then `left()`."""
    decision: Decision | None = None
    """The claim step: publish its record when `publish`, then `commit` the plan."""
    publish: bool = False
    wake_at: float | None = None
    """`derive` again at this time even if nothing changes (a first start held)."""
    outbid: bool = False
    """Our incarnation was raised over a record of ours we never saved: save it."""
    mismatch: tuple[str, ...] = ()
    mismatch_detail: str = ""
    hold: bool = False
    """Keep what runs and publish nothing (`desired` is None): another agent may run as
    this node, or a plan broke `own_change`."""


class FirstStart:
    """Whether the daemon started in this shard, and how long its first start waits."""

    def __init__(
        self,
        *,
        node: str,
        address: str,
        max_nodes: int,
        settle_s: float,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.node = node
        self.address = address
        self.max_nodes = max_nodes
        self.settle_s = settle_s
        self.log = log
        self.started = False
        """The daemon was asked to run in this shard: its first start is behind us."""
        self.hold_until: float | None = None
        """`now` until which the first start waits for the shard to form."""
        self.held = ""
        """Why the first start waits (empty: it does not)."""

    def hold(
        self,
        now: float,
        decision: Decision,
        stale: frozenset[str],
        *,
        records: Mapping[str, MemberRecord],
        spec: DomainSpec | None,
    ) -> float | None:
        """Until when the first daemon start in this shard waits (None: start now).

        It waits while the shard still forms: claims of other allowed nodes in flight
        (not stale), or nodes that the spec lists (within max_nodes) not members yet;
        at most FIRST_START_WINDOWS x settle_s from the first time it could start, so a
        stuck or absent node cannot block it. Joins after the start are SIGUSR1s.
        """
        if self.started:
            return None
        claims = sorted(
            r.node
            for r in records.values()
            if r.node != self.node
            and r.state is MemberState.CLAIMING
            and r.node not in stale
            and mb.allowed(r.node, spec)
            and r.slot is not None
            and r.slot < self.max_nodes
        )
        members = {node for node, _ in decision.members(self.address).values()}
        listed = spec.nodes[: self.max_nodes] if spec is not None and spec.nodes else []
        absent = sorted(n for n in listed if n not in members)
        if not claims and not absent:
            self._end("formed")
            return None
        if self.hold_until is None:
            self.hold_until = now + FIRST_START_WINDOWS * self.settle_s
        if now >= self.hold_until:
            self._end("bound reached", claiming=claims, not_members=absent)
            return None
        held = "daemon start waits for the shard to form: " + "; ".join(
            part
            for part in (
                f"claims in flight ({', '.join(claims)})" if claims else "",
                f"listed nodes not members yet ({', '.join(absent)})" if absent else "",
            )
            if part
        )
        if held != self.held:
            self.log.info(
                "membership.first_start_held",
                claiming=claims,
                not_members=absent,
                until_s=round(self.hold_until - now, 3),
            )
        self.held = held
        return self.hold_until

    def _end(self, why: str, **detail: list[str]) -> None:
        if self.hold_until is not None:
            self.log.info("membership.first_start_released", why=why, **detail)
        self.hold_until = None
        self.held = ""
