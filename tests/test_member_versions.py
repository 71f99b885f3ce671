"""The order of member records and Last Wills, pure: whatever the broker does with them,
a peer's view ends on the newest.

Each node's agent writes records in its order (`messages.version`: incarnation, link,
seq) and each of its links may end with its will; the broker (or a restarted, a
persistent or a clustered one) delivers any of them, in any order, repeated, replayed from
a snapshot, or never. A view that was given a set of them holds, for each node, the newest
of that set: its record, or nothing when the newest is a will.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import msgspec
from hypothesis import given

from imexd.bus.events import Connected, Disconnected, Synced
from imexd.membership.shard import ShardView
from imexd.messages import MemberRecord, MemberState, version
from tests.test_shard import WALL, rec, received, settle, view

PEERS = {"n2": 1, "n3": 2}
"""The peers and their slots."""


@dataclass(frozen=True)
class Written:
    """One thing a peer's agent made the broker hold, in the peer's order."""

    record: MemberRecord


def history(node: str, steps: list[str]) -> list[Written]:
    """What `node`'s agent writes for `steps`: "record" (something new on this link),
    "will" (its link ends: the broker publishes the will, the agent reconnects) and
    "restart" (the agent restarts: a will, then a new incarnation from link 1)."""
    inc, link, seq = 1, 1, 0
    out: list[Written] = []
    base = rec(node, PEERS[node], settled=WALL - 100)
    for step in steps:
        if step == "record":
            seq += 1
            address = f"10.0.{seq % 200}.{PEERS[node] + 1}"
            out.append(
                Written(
                    msgspec.structs.replace(
                        base, incarnation=inc, link=link, seq=seq, address=address
                    )
                )
            )
            continue
        will = msgspec.structs.replace(
            base,
            state=MemberState.LOST,
            slot=None,
            settled=None,
            incarnation=inc,
            link=link,
            seq=0,
        )
        out.append(Written(will))
        if step == "restart":
            inc, link, seq = inc + 1, 1, 0
        else:
            link += 1
    return out


steps = st.lists(st.sampled_from(["record", "record", "will", "restart"]), min_size=1, max_size=8)


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[tuple[str, int, bool]], dict[str, list[Written]]]:
    """Histories of both peers, and what the broker delivers: (peer, index in its history,
    flagged retained), any order, any repeats, some never."""
    written = {node: history(node, draw(steps)) for node in PEERS}
    picks = st.tuples(st.sampled_from(sorted(PEERS)), st.integers(0, 7), st.booleans())
    raw = draw(st.lists(picks, min_size=1, max_size=30))
    delivered = [(n, i % len(written[n]), retained) for n, i, retained in raw]
    return delivered, written


def newest(
    delivered: list[tuple[str, int, bool]], written: dict[str, list[Written]]
) -> dict[str, MemberRecord]:
    """Per peer, the newest record or will among those delivered."""
    out: dict[str, MemberRecord] = {}
    for node, index, _ in delivered:
        record = written[node][index].record
        held = out.get(node)
        if held is None or (version(record) or ()) > (version(held) or ()):
            out[node] = record
    return out


def settled_view() -> ShardView:
    """n1 settled on slot 0, synced."""
    v = view()
    settle(v)
    return v


@given(deliveries())
def test_any_delivery_of_versioned_records_and_wills_ends_on_the_newest(
    case: tuple[list[tuple[str, int, bool]], dict[str, list[Written]]],
) -> None:
    """Interleaved, repeated, replayed or lost: each peer ends as its newest delivered
    record says, or out when that is its will."""
    delivered, written = case
    v = settled_view()
    for at, (node, index, retained) in enumerate(delivered, start=10):
        v.apply(received(written[node][index].record, retained=retained), float(at))
    want = newest(delivered, written)
    for node in PEERS:
        record = want.get(node)
        if record is None or record.state is MemberState.LOST:
            assert node not in v.records, (node, v.records.get(node))
        else:
            assert v.records.get(node) == record, node


@given(deliveries(), st.integers(0, 30))
def test_a_proven_will_stays_after_the_link_ends_and_a_snapshot_replays(
    case: tuple[list[tuple[str, int, bool]], dict[str, list[Written]]], cut: int
) -> None:
    """Deletions a round trip proved stay through a broker restart whose snapshot replays
    any of the same records: no dead node comes back."""
    delivered, written = case
    v = settled_view()
    for at, (node, index, retained) in enumerate(delivered, start=10):
        v.apply(received(written[node][index].record, retained=retained), float(at))
    v.proven(v.proof_mark())
    want = newest(delivered, written)
    v.apply(Disconnected(broker="b", reason="lost"), 100.0)
    v.apply(Connected(broker="b", protocol="5", will_delay=True, link=2), 101.0)
    for node, index, _ in delivered[:cut]:
        v.apply(received(written[node][index].record), 101.0)
    v.apply(Synced(at=101.0), 101.0)
    for node in PEERS:
        record = want.get(node)
        if record is None or record.state is MemberState.LOST:
            assert node not in v.records, (node, v.records.get(node))
