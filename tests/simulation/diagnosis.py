"""Why a run broke a rule, in one word: the known causes, each recognised by what the
world held when the oracle stopped the run. It names a cause for the known-failures
list and the report; the oracle's verdict never depends on it."""

from __future__ import annotations

from typing import Final

from imexd.messages import LINK_END, MemberState, lost_record, version
from tests.simulation.oracle import DAEMON_TOUCHED, Violation
from tests.simulation.world import World

CAUSES: Final[dict[str, str]] = {
    "leave-before-publish": (
        "an agent that leaves (SIGTERM) before it published anything in its run clears "
        "nothing (`Agent._shutdown` clears only when `ShardView.published`), and its clean "
        "DISCONNECT drops its will: its past run's record stands for ever, a dead member "
        "in every hosts file"
    ),
    "will-gap": (
        "a change of will (an incarnation raised over a record of the node's name) "
        "reconnects with a clean DISCONNECT first: between it and the next CONNECT the "
        "broker holds no will of the raised incarnation, so a crash (or a leave, whose "
        "clear has no link to go out on) there leaves the node's record standing for "
        "ever, or ends it with the old link's will (fired where the DISCONNECT came too "
        "late), older than the records it should end: the peers keep the dead node"
    ),
    "tombstone-confirms": (
        "a node's will taken in, then restored unconfirmed when the link ended before a "
        "round trip proved it (any link that drops; a broker shutting down publishes every "
        "will first), is confirmed by the same tombstone "
        "given again (the new snapshot, or a persisted session's will): "
        "`ShardView._on_received` treats any copy of the held version as a confirmation, "
        "so the dead node stays in the hosts files for ever"
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
        "the reconcile loop applies the view as it stands after its round trip, with "
        "deletions that arrived during the round trip, after its proof's mark "
        "(`Agent._reconcile_loop`): the hosts file drops a node on an unproven deletion, "
        "which the view restores when the link ends, and the dead node returns to the "
        "hosts file"
    ),
    "held-claim-rival": (
        "after a reconnect, a peer's stale claim, kept only for its tombstone's hold_s "
        "(MQTT 3.1.1) and confirmed by that tombstone (`_on_lost`), counts as a rival on "
        "our slot in `_rejoin`: a member whose will fired yields its slot to a dead node's "
        "claim, which no longer stands on the broker, and its daemon restarts"
    ),
    "shutdown-will-outbid": (
        "a broker that shuts down publishes the will of our current link: we raise our "
        "incarnation over it and publish a record that the closing broker never takes; "
        "restarted with its state kept, it gives our previous record back, which is no "
        "longer the last we published, so `_rejoin` judges continuity lost and a rival "
        "record on our slot takes it: our daemon restarts"
    ),
    "forged-vacates-slot": (
        "a hostile record on a holder's topic that leaves its slot (a replay of an older "
        "record, a forged claim, standby or will) lets a node that claims the slot before "
        "the holder's record is back settle there: two members on one slot of one broker, "
        "each keeping its daemon (the holder's continuity holds), and the hosts files "
        "disagree on who holds it"
    ),
    "forged-relink": (
        "the hostile writer's records on a holder's topic: a forged will makes it raise its "
        "incarnation and reconnect to change its will, and a forged record that leaves its "
        "slot, arriving before that new link's first step, makes the holder judge its "
        "continuity lost (`_rejoin`: its record is not as it last published it); a node "
        "that claimed the slot while the forgery stood there settled, and the holder "
        "yields to it: its daemon restarts"
    ),
    "past-resumed": (
        "an older record of a node, replayed on its topic after its agent restarted and "
        "before it published, is resumed as its past run's record (any record of a lower "
        "incarnation at its own address passes for one), old settle stamp and all: that "
        "stamp outranks the member that settled the slot since, which keeps it as the "
        "incumbent, and the two run on one slot"
    ),
    "forged-version": (
        "the hostile writer's record (with the node's credentials) carries a version above "
        "the node's own: the peers that took it in ignore the node's real records until "
        "the node outbids it, its claims too (a rival settles on the claimed slot at its "
        "echo: two members on one slot of one broker), and for good where the node never "
        "saw the forgery (its will or its next record replaced it on the broker first, or "
        "it died)"
    ),
    "timer-spin": (
        "a timer of the view (`ShardView.due_at`: a first start held, a record to put "
        "back, a peer's hold) comes due while the view is not synced (its link is down): "
        "`derive` returns at once without clearing it, so `Agent._step_due` keeps "
        "returning a time in the past and the membership loop turns without ever waiting "
        "until the link is back (up to `[bus] reconnect_max_s`), a busy loop; no rule "
        "breaks, the agent burns a core"
    ),
    "unclassified": "none of the causes above: read its trace",
}


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
        will = lost_record(standing, said) if standing is not None and said is not None else None
        end = version(will) if will is not None else None
        for peer in world.nodes.values():
            held = peer.shard.versions.get(name) if peer.alive else None
            if end is not None and held is not None and end < held:
                return "will-gap"  # a will older than the records it should end
    for peer in world.nodes.values():
        if not peer.alive or peer.name not in nodes:
            continue
        shard = peer.shard
        for name in sorted(nodes & set(shard.records) & set(oracle.dead)):
            held = shard.versions.get(name)
            if name in oracle.gone_from.get(peer.name, set()) and name in shard.unconfirmed:
                return "unproven-applied"
            if (
                name not in shard.unconfirmed
                and held is not None
                and held[2] == LINK_END
                and version(shard.records[name]) != held
            ):
                return "tombstone-confirms"
        if violation.rule == DAEMON_TOUCHED:
            held_claims = [n for n in shard.lost if shard.records[n].state is MemberState.CLAIMING]
            if held_claims:
                return "held-claim-rival"
            restored = oracle.restored.get(peer.name)
            if restored is not None and restored.incarnation < shard.incarnation:
                return "shutdown-will-outbid"
            if peer.name in oracle.overwritten:
                return "forged-relink"
    by_slot: dict[int, set[str]] = {}
    for node in world.nodes.values():
        if node.alive and node.daemon.running and node.daemon.slot is not None:
            by_slot.setdefault(node.daemon.slot, set()).add(node.name)
    if any(len(held) > 1 and held & oracle.hostile_on for held in by_slot.values()):
        return "forged-vacates-slot"
    for name in sorted(oracle.written_first):
        node = world.nodes[name]
        if node.alive and node.first_state is MemberState.MEMBER:
            outbid = node.shard.incarnation > node.saved_at_start
            return "foreign-adopted" if outbid else "past-resumed"
    if oracle.taint or oracle.masked:
        return "forged-version"
    return "unclassified"
