"""The link's small stages, alone: broker rotation, our records, what is dropped."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from imexd.bus.drops import MAX_LOG_KEYS, Drops
from imexd.bus.records import Record, Records
from imexd.bus.rotation import Rotation
from imexd.logs import get_logger
from imexd.messages import Dropped, DropReason


def rotation(count: int) -> Rotation:
    return Rotation(count, initial_s=1.0, max_s=8.0, rand=lambda: 1.0)


def test_failed_connects_try_every_broker_before_a_wait() -> None:
    """A failed connect moves to the next broker at once until each was tried; then one
    wait, doubling per failed round up to the cap."""
    turn = rotation(3)
    waits = [turn.next(lost=False) for _ in range(12)]
    assert waits == [None, None, 1.0, None, None, 2.0, None, None, 4.0, None, None, 8.0]
    assert turn.index == 0


def test_a_lost_link_waits_once_and_moves_on() -> None:
    """A link that ended is followed by one wait and the next broker; only a link that
    held resets the backoff, so a broker that drops every link at once is not hammered."""
    turn = rotation(2)
    assert turn.next(lost=True) == 1.0
    assert turn.index == 1
    assert turn.next(lost=True) == 2.0
    assert turn.next(lost=True, stable=True) == 1.0
    assert turn.index == 1


def test_a_clean_leave_reconnects_to_the_same_broker_at_once() -> None:
    """A new will or client id: the same broker, and the backoff starts over."""
    turn = rotation(2)
    turn.next(lost=False)
    turn.next(lost=False)
    turn.left_cleanly()
    assert turn.index == 0
    assert turn.next(lost=False) is None
    assert turn.next(lost=False) == 1.0


def test_a_rotation_needs_a_broker() -> None:
    """No broker is a caller's bug, said at once."""
    with pytest.raises(ValueError, match="no broker"):
        rotation(0)


def test_a_record_held_back_counts_only_once_published_on_the_link() -> None:
    """A record the caller publishes itself after judging a new link's snapshot
    (`replay=False`) is not replayed, and is not held on that link until it went out."""
    records = Records()
    records.declare("p/a", Record(b"A", None))
    records.declare("p/m", Record(b"M", 30.0, replay=False))
    assert [t for t, _ in records.replayed()] == ["p/a"]
    assert records.ours() == {"p/a": b"A"}
    assert (records.held("p/a"), records.held("p/m")) == (b"A", b"")
    records.publishing("p/m")
    assert records.held("p/m") == b"M"
    records.link_up()
    assert records.held("p/m") == b"", "a new link: not published there yet"
    assert records.payload("p/m") == b"M"


def test_a_clear_is_forgotten_once_sent_unless_replaced() -> None:
    """A clear (empty payload) goes out once; a record declared while it was in flight
    survives it."""
    records = Records()
    clear = Record(b"", None)
    records.declare("p/a", clear)
    records.sent("p/a", clear)
    assert records.get("p/a") is None
    records.declare("p/b", clear)
    records.declare("p/b", Record(b"B", None))
    records.sent("p/b", clear)
    assert records.payload("p/b") == b"B"


def test_drops_are_counted_always_and_logged_once_per_topic_and_reason() -> None:
    """Every drop counts; a (topic, reason) is logged once; past the cap nothing new is
    remembered, so a flood of topics cannot grow memory."""
    drops = Drops()
    log = get_logger("bus")
    bad = Dropped(DropReason.NOT_JSON, "not JSON")
    with capture_logs() as logs:
        for _ in range(3):
            drops.drop("p/x", bad, log)
        for n in range(MAX_LOG_KEYS + 10):
            drops.drop(f"p/flood/{n}", bad, log)
    assert drops.counts[DropReason.NOT_JSON.value] == MAX_LOG_KEYS + 13
    assert len(logs) == MAX_LOG_KEYS
    assert logs[0]["event"] == "bus_message_dropped"
    assert logs[0]["reason"] == DropReason.NOT_JSON.value
