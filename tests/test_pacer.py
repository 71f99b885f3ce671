"""The report loop's pacing: the first change at once, a burst in one turn, none lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from imexd.agent.pacer import Pacer


class FakeTime:
    """A clock that moves only when the pacer sleeps; each sleep is recorded and may
    run `during` (a change that arrives while the pacer holds)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.during: Callable[[], None] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.during is not None:
            self.during()
        await asyncio.sleep(0)


def pacer(t: FakeTime) -> Pacer:
    return Pacer(0.1, clock=t.clock, sleep=t.sleep)


async def test_the_first_change_after_quiet_is_taken_at_once() -> None:
    """A change after a quiet period starts a turn without any hold."""
    t = FakeTime()
    p = pacer(t)
    changed = asyncio.Event()
    changed.set()
    assert await p.wait(changed, 1.0) is True
    assert t.sleeps == []
    assert not changed.is_set()
    t.now += 0.5  # quiet for longer than the pause
    changed.set()
    assert await p.wait(changed, 1.0) is True
    assert t.sleeps == []


async def test_a_change_within_the_pause_waits_for_its_end() -> None:
    """A change 30 ms after a turn is taken at the end of the 100 ms pause, not before."""
    t = FakeTime()
    p = pacer(t)
    changed = asyncio.Event()
    changed.set()
    await p.wait(changed, 1.0)
    t.now += 0.03
    changed.set()
    assert await p.wait(changed, 1.0) is True
    assert t.sleeps == [pytest.approx(0.07)]
    assert t.now == pytest.approx(100.1)


async def test_a_change_during_the_hold_is_taken_by_that_turn() -> None:
    """What is set while the pacer holds is cleared only after the hold, so the turn that
    follows sees it: the last change of a burst is never lost."""
    t = FakeTime()
    p = pacer(t)
    changed = asyncio.Event()
    changed.set()
    await p.wait(changed, 1.0)
    facts = ["first"]

    def arrive() -> None:
        facts.append("last")
        changed.set()

    changed.set()  # a burst: at once after the first turn
    t.during = arrive
    assert await p.wait(changed, 1.0) is True
    assert facts == ["first", "last"]  # the turn now reads what arrived during the hold
    assert not changed.is_set()
    t.during = None
    assert await p.wait(changed, 0.01) is False  # nothing was left behind


async def test_urgent_news_within_the_pause_is_taken_at_once() -> None:
    """Issue 22: the daemon's READY, judged 30 ms after an unrelated turn, waited for the
    rest of the pause. News a job waits for is never held; both events are cleared."""
    t = FakeTime()
    p = pacer(t)
    changed, urgent = asyncio.Event(), asyncio.Event()
    changed.set()
    await p.wait(changed, 1.0, urgent)
    t.now += 0.03
    urgent.set()
    changed.set()
    assert await p.wait(changed, 1.0, urgent) is True
    assert t.sleeps == []
    assert not changed.is_set()
    assert not urgent.is_set()
    t.now += 0.03  # a plain change right after it is paced again
    changed.set()
    assert await p.wait(changed, 1.0, urgent) is True
    assert t.sleeps == [pytest.approx(0.07)]


async def test_urgent_news_during_a_hold_ends_it() -> None:
    """A hold already under way ends when urgent news arrives, not at the pause's end."""
    p = Pacer(30.0)
    changed, urgent = asyncio.Event(), asyncio.Event()
    changed.set()
    await p.wait(changed, 1.0, urgent)
    changed.set()  # within the pause: this turn holds
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, urgent.set)
    async with asyncio.timeout(10):  # the pause is 30 s
        assert await p.wait(changed, 1.0, urgent) is True
    assert not urgent.is_set()


async def test_a_turn_without_a_change_starts_no_pause() -> None:
    """The idle turn (the limit ran out) does not delay the change that follows it."""
    t = FakeTime()
    p = pacer(t)
    changed = asyncio.Event()
    assert await p.wait(changed, 0.01) is False
    changed.set()
    assert await p.wait(changed, 1.0) is True
    assert t.sleeps == []


async def test_a_burst_makes_one_turn_per_pause() -> None:
    """Changes every 10 ms for a second make about one turn per 100 ms, not 100 turns."""
    t = FakeTime()
    p = pacer(t)
    changed = asyncio.Event()
    turns = 0
    end = t.now + 1.0
    while t.now < end:
        changed.set()
        await p.wait(changed, 1.0)
        turns += 1
        t.now += 0.01  # the next change comes 10 ms after this turn
    assert 9 <= turns <= 11


def test_a_negative_pause_is_refused() -> None:
    """The pause is a duration."""
    with pytest.raises(ValueError, match="pause_s"):
        Pacer(-1.0)
