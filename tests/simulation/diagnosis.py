"""Why a run broke a rule, in one word: the known causes, each recognised by what the
world held when the oracle stopped the run. It names a cause for the known-failures
list and the report; the oracle's verdict never depends on it."""

from __future__ import annotations

from typing import Final

from imexd.messages import MemberState, ended, lost_record, version
from tests.simulation.oracle import DAEMON_TOUCHED, Violation
from tests.simulation.world import World

CAUSES: Final[dict[str, str]] = {
    "leave-before-publish": (
        "an agent that leaves (SIGTERM) before it published anything in its run, and "
        "before its snapshot showed it its past run's record, clears nothing "
        "(`NodeCore.leave` clears what it published or saw: `ShardView.past_stands`), its "
        "presence says only that it stopped, and its clean DISCONNECT drops its will: its "
        "past "
        "run's record, which no will ended (a restart within the Will Delay resumed the "
        "session), stands for ever, a dead member in every hosts file"
    ),
    "will-gap": (
        "a change of will (only an incarnation raised over a record or will of the node's "
        "name: `NodeCore._claim` sets a new will, a join no longer does) reconnects with a "
        "clean DISCONNECT first: between it and the next CONNECT the broker holds no will "
        "of the raised incarnation, so a crash (or a leave, whose clear has no link to go "
        "out on) there would leave a record published with the raised incarnation before "
        "the DISCONNECT standing for ever, or end nothing with the old link's will, older "
        "than that record: the peers keep the dead node (the core publishes that record "
        "only on the new link)"
    ),
    "will-overwritten": (
        "a node's will (its presence marked lost) ends its member record, which stays on "
        "the broker; its next run publishes its presence (replayed on every link), which "
        "replaces the will, and leaves (SIGTERM) before it publishes a record of its own "
        "or sees the dead one, so it clears nothing and its presence says only that it "
        "stopped: a node that "
        "joins later (or a peer that missed the will) finds the dead record and a "
        "presence that is no will, and lists the dead node for ever"
    ),
    "foreign-adopted": (
        "a record of a node's name that it did not write (placed before it ran, or forged "
        "after it started and before it published), at its incarnation or above, is "
        "outbid at once (`_outbid` in `_on_own`), after which `_foreign` no longer sees it "
        "as foreign: the agent resumes it as its past run's record, without the take-over "
        "watch and without a claim, on the slot and with the stamp the writer chose, and "
        "runs on a slot another member holds"
    ),
    "unproven-applied": (
        "the reconcile loop applies the view with a deletion no round trip proved (one "
        "that arrived during the round trip, after its proof's mark, or a round trip that "
        "timed out on a link still up: `Rounds.next`): the hosts file drops a node on an "
        "unproven deletion, "
        "which the view restores when the link ends, and the dead node returns to the "
        "hosts file"
    ),
    "shutdown-will-outbid": (
        "a broker that shuts down publishes every will, ours (of our current link) too, "
        "then closes the links: our view takes our own will in as the end of our record "
        "at once (`_on_presence`, an incarnation raised over it, and `_ended_by_will` "
        "keeps the record from being resumed), with no round trip to prove it, unlike a "
        "peer's will, which comes back unconfirmed when the link ends; restarted with its "
        "state from before those wills, the broker gives our record back as it stood, "
        "but we claim again instead of resuming it, and a rival record on our slot (one "
        "that its stamp ranks first) takes it: our daemon stops or restarts"
    ),
    "forged-vacates-slot": (
        "a hostile record on a holder's topics that leaves its slot (a replay of an older "
        "record, a forged claim or standby, or a forged will on its presence) lets a node "
        "that claims the slot before the holder's record is back settle there: two "
        "members on one slot of one broker, each keeping its daemon (the holder's "
        "continuity holds), and the hosts files disagree on who holds it"
    ),
    "forged-relink": (
        "the hostile writer's records on a holder's topics: a forged will (its presence "
        "marked lost) makes it raise its incarnation and reconnect to change its will, and "
        "a forged record that leaves its slot, arriving before that new link's first "
        "step, makes the holder judge its continuity lost (`_rejoin`: its record is not "
        "as it last published it); a node that claimed the slot while the forgery stood "
        "there settled, and the holder yields to it: its daemon restarts"
    ),
    "forged-hides-will": (
        "the hostile writer writes an older presence of a node (a replay) over the will "
        "that ended the node's member record: the node's next run finds its past record "
        "and a presence that does not end it, resumes the record with its old settle "
        "stamp on a slot that another node settled on since the will, and each keeps its "
        "daemon; no reader can tell the replay from the node's own presence"
    ),
    "past-resumed": (
        "an older record of a node, replayed on its topic after its agent restarted and "
        "before it published, is resumed as its past run's record (any record of a lower "
        "incarnation at its own address passes for one), old settle stamp and all: that "
        "stamp outranks the member that settled the slot since, which keeps it as the "
        "incumbent, and the two run on one slot"
    ),
    "forged-version": (
        "the hostile writer's record or will (with the node's credentials) carries a "
        "version above the node's own: the peers that took it in ignore the node's real "
        "records until the node outbids it, its claims too (a rival settles on the "
        "claimed slot at its echo: two members on one slot of one broker), and for good "
        "where the node never saw the forgery (its next record or presence replaced it "
        "on the broker first, a broker restart lost it, or it died); a forged member "
        "record at the node's address that the node raised its incarnation over and died "
        "before replacing is, to its next run, its past run's record: resumed, old slot "
        "and stamp"
    ),
    "timer-spin": (
        "a timer of the view (`ShardView.due_at`: a first start held, a record to put "
        "back, a peer's hold) comes due and the step it asks for returns early (the view "
        "not synced, or our claim's echo waiting for the broker's check) without spending "
        "it, so `NodeCore.next_due` keeps returning a time in the past and the membership "
        "loop turns without ever waiting, a busy loop; no rule breaks, the agent burns a "
        "core"
    ),
    "ended-resumed": (
        "a restarted agent resumes its past run's member record, which stays on the broker "
        "after its will fired, although that will (on its presence, in the same snapshot "
        "or later) ended it (`ShardView.past` must not outlive `own_end`), with its old "
        "settle stamp, on a slot that a node settled on since the will: two members on one "
        "slot"
    ),
    "empty-restart-newcomer": (
        "a broker restarts without its retained records; before a member whose link is "
        "still in its reconnect backoff publishes its record again, a node that joins "
        "(with no earlier link, so no record of its own view waits unconfirmed for it) "
        "finds the slot free and settles there; the member comes back, continuity lost, "
        "and keeps the slot by its older settle stamp, while every view that saw the "
        "newcomer settle first holds it as the slot's incumbent: two members on one slot, "
        "each listed by its own side"
    ),
    "unclassified": "none of the causes above: read its trace",
}

LIMITS: Final[frozenset[str]] = frozenset(
    {"forged-version", "forged-vacates-slot", "forged-relink", "forged-hides-will"}
)
"""Causes that the design accepts rather than defects: the hostile writer holds the node's
own broker credentials, and on a bus whose member records and presences are not signed
no reader can tell what it writes from what the node writes (docs/security.md, *What a
node's broker credentials can do*). A version above the node's own is believed until the
node outbids it, and a record that leaves the node's slot is a free slot to a claimant
until the node puts its own back. Listed with the defects, marked as limits, so that a
signature on the nodes' records would show here as fewer failures."""


def cause(world: World, violation: Violation) -> str:
    """The cause (a key of CAUSES) of `violation`, from the world where the run stopped."""
    oracle, broker = world.oracle, world.broker
    if violation is oracle.spun:
        return "timer-spin"
    nodes = set(violation.nodes)
    for name in sorted(nodes & set(oracle.dead)):
        standing = broker.member_record(name)
        said = broker.presence_of(name)
        unended = (
            broker.stands(name)
            and broker.authors.get(("member", name)) == "agent"
            and not broker.armed(name)
        )
        if unended:
            return "leave-before-publish" if name in oracle.left_unpublished else "will-gap"
        if broker.stands(name) and broker.authors.get(("member", name)) == "hostile":
            # The forgery stands: the node raised its incarnation over it and died before
            # its own record replaced it (in the reconnect for its new will, with no will).
            return "forged-version"
        ended_here = standing is not None and broker.ended.get(name) == standing
        if ended_here and standing is not None and not ended(standing, said):
            return "will-overwritten"
        will = lost_record(standing, said) if standing is not None and said is not None else None
        end = version(will) if will is not None else None
        for peer in world.nodes.values():
            held = peer.shard.peers.versions.get(name) if peer.alive else None
            if end is not None and held is not None and end < held:
                return "will-gap"  # a will older than the records it should end
    for peer in world.nodes.values():
        if not peer.alive or peer.name not in nodes:
            continue
        shard = peer.shard
        for name in sorted(nodes & set(shard.records) & set(oracle.dead)):
            if name in oracle.gone_from.get(peer.name, set()) and name in shard.peers.unconfirmed:
                # The record that came back is a forgery (a version above the node's own
                # that a broker restart gave back unconfirmed): the hostile writer's.
                came_back = shard.records[name]
                return "forged-version" if came_back in oracle.forged else "unproven-applied"
        if violation.rule == DAEMON_TOUCHED:
            if peer.name in oracle.overwritten | oracle.vacated:
                return "forged-relink"
            restored = oracle.restored.get(peer.name)
            if restored is not None and restored.incarnation < shard.incarnation:
                return "shutdown-will-outbid"
    by_slot: dict[int, set[str]] = {}
    for node in world.nodes.values():
        if node.alive and node.daemon.running and node.daemon.slot is not None:
            by_slot.setdefault(node.daemon.slot, set()).add(node.name)
    shared = [pair for pair in by_slot.values() if len(pair) > 1]
    if any(world.nodes[name].resumed_from in oracle.forged for pair in shared for name in pair):
        # A forgery at the node's address, below the incarnation of the node's next run
        # but above its own when written: that run resumed it as its past run's record.
        return "forged-version"
    resumed = {name for pair in shared for name in pair if world.nodes[name].resumed_ended}
    if resumed:
        return "forged-hides-will" if resumed <= oracle.will_hidden else "ended-resumed"
    if any(pair & (oracle.hostile_on | oracle.vacated) for pair in shared):
        return "forged-vacates-slot"
    emptied = oracle.emptied
    forged = oracle.hostile_on | oracle.written_first | oracle.masked | set(oracle.taint)
    for pair in shared:
        since = [oracle.started_at.get(name, 0.0) for name in pair]
        if emptied is not None and min(since) < emptied < max(since) and not pair & forged:
            return "empty-restart-newcomer"
    if nodes & oracle.masked:
        # Peers ignore the node's own records below a forged version (it never saw the
        # forgery to outbid it: a broker that restarted empty lost it first).
        return "forged-version"
    for name in sorted(oracle.written_first):
        node = world.nodes[name]
        if node.alive and node.first_state is MemberState.MEMBER:
            outbid = node.shard.incarnation > node.saved_at_start
            return "foreign-adopted" if outbid else "past-resumed"
    if oracle.taint or oracle.masked:
        return "forged-version"
    return "unclassified"
