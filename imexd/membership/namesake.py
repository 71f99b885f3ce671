"""Another live agent that runs with this node's name: how the shard finds and answers it.

Two agents of one node name would write one member topic and take one broker session
from each other. `Namesakes` tells such an agent from a past run of ours (whose record
a new agent simply replaces) by what only a live agent does: it takes our session (a
take-over with its reason code, or links that end silently after a live record of our
name that we did not write came on them). Without a settled slot we stand aside
(DuplicateNode, `Identity.ASIDE`); with one we keep the slot and its daemon and say so.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

import structlog

from imexd.messages import MemberRecord

TAKEN_LINKS: Final = 2
"""Links in a row that the broker ended without a reason code, each after a live record of
our name that we did not write came on it: another live agent takes our session (on
links whose broker says so, one reason code is evidence enough)."""
TAKEOVER_WATCH_DELAYS: Final = 6
"""First reconnect delays (`[bus] reconnect_initial_s`) that a new agent waits, before it
writes over a record of its name that it did not write, for another live agent of that
name to take the session back: such an agent lost its session to us and reconnects after
its first backoff. Two links of ours ended within the wait show it (TAKEN_LINKS); a
record alone is replaced once the wait is over."""


class Identity(StrEnum):
    """A change of who the agent is on the bus, for the agent to make (will, client id)."""

    ASIDE = "aside"
    """Another live agent runs as this node: drop the will, take another client id."""
    BACK = "back"
    """The other agent's record is gone: our own client id and will again."""


class Namesakes:
    """What this agent knows of another live agent with its node name."""

    def __init__(
        self, *, node: str, takeover_watch_s: float, log: structlog.typing.FilteringBoundLogger
    ) -> None:
        self.node = node
        self.takeover_watch_s = takeover_watch_s
        """How long a new agent watches a record of its name that it did not write before
        it replaces it (TAKEOVER_WATCH_DELAYS)."""
        self.log = log
        self.watch_until: float | None = None
        """While set: we watch such a record, publishing nothing (`watch`)."""
        self.duplicate = ""
        """Set (the why) when another live agent runs as this node: we publish nothing."""
        self.contested = ""
        """Why another live agent is taken to run with our name while we hold our slot
        (overwrites recur, or the broker took our session): DuplicateNode, reported
        while it lasts; we keep the slot and the daemon."""
        self.foreign_live = False
        """A live record of our name that we did not write came on this link."""
        self.taken = 0
        """Links in a row ended without a reason code after `foreign_live` (TAKEN_LINKS)."""

    def join(self) -> None:
        """A new shard: no duplicate seen in it, no record of our name watched."""
        self.duplicate = ""
        self.watch_until = None

    def taken_over(self, *, in_shard: bool, member: bool) -> Identity | None:
        """The broker handed our session to another client with our client id: another
        agent runs with this node's name (our own past run has ended before we started).
        Without a settled slot we stand aside; with one we keep it and its daemon, and
        the other one stands aside when we take the session back."""
        if self.duplicate:
            return None
        why = "the broker handed this node's session to another client"
        if in_shard and not member:
            return self._found(why, member=member)
        if member:
            self.contest(why)
        self.log.warning(
            "bus.session_taken_over",
            why="another client connected with this node's client id; "
            "is a second agent running with this node name?",
        )
        return None

    def watch(self, own: MemberRecord, now: float, *, published: bool) -> bool:
        """Whether to keep watching `own`, a record of our name that we did not write,
        before we replace it (until `watch_until`): another live agent of our name takes
        our session back within its first reconnect delays (`link_ended`), a record
        alone does not."""
        if published:
            return False
        if self.watch_until is None:
            self.watch_until = now + self.takeover_watch_s
            self.log.info(
                "membership.own_name_seen",
                incarnation=own.incarnation,
                address=own.address,
                watch_s=round(self.takeover_watch_s, 1),
                why="a record of this node name that this agent did not write",
            )
        return now < self.watch_until

    def link_ended(self, *, published: bool, member: bool) -> Identity | None:
        """The broker ended our link without a reason code.

        Brokers that send no reason code (MQTT 3.1.1, and some MQTT 5 brokers) close the
        old link silently when another client takes the session: two agents with one
        name then push each other off at every reconnect, and each link of ours sees the
        other's record published live before it ends. TAKEN_LINKS such links in a row are
        taken as a live duplicate; a retained record alone never is.
        """
        watching = self.watch_until is not None and not published
        self.taken = self.taken + 1 if self.foreign_live or watching else 0
        self.foreign_live = False
        if self.taken < TAKEN_LINKS:
            return None
        why = (
            f"the broker ended this node's link {self.taken} times in a row after another "
            "writer published a record of this node's name on it: another agent with this "
            "name keeps taking the session"
        )
        if member:
            self.contest(why)
            return None
        return self._found(why, member=member)

    def contest(self, why: str) -> None:
        """Another live agent runs with our name while we hold our slot: say so, keep the
        slot and the daemon (they are ours), and keep putting our record back (paced)."""
        if why != self.contested:
            self.log.error("membership.duplicate_node", node=self.node, why=why, kept="slot")
        self.contested = why

    def _found(self, why: str, *, member: bool) -> Identity | None:
        """Another live agent runs as this node: stand aside without touching its state.

        We publish nothing on its topics, run no daemon, drop our will (it would clear the
        other's record) and take another client id so that the two stop taking the
        broker session from each other (the view forgets that it published: the topic
        is the other agent's). We come back once its record is gone.
        """
        if self.duplicate or member:
            return None
        self.duplicate = why
        self.log.error("membership.duplicate_node", node=self.node, why=why)
        return Identity.ASIDE

    def gone(self) -> Identity:
        """The other agent's record is gone: claim as usual under our own client id."""
        self.log.info("membership.duplicate_gone", node=self.node)
        self.duplicate = ""
        return Identity.BACK
