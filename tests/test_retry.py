"""The one backoff rule: doubling, capped, with equal jitter."""

from __future__ import annotations

from imexd.retry import backoff_delay


def test_backoff_doubles_up_to_the_cap_with_jitter_in_the_upper_half() -> None:
    """Delays double from the initial value, stop at the cap, and jitter within [d/2, d]."""
    top = [backoff_delay(n, 1.0, 60.0, lambda: 1.0) for n in range(9)]
    assert top == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff_delay(3, 1.0, 60.0, lambda: 0.0) == 4.0
    assert backoff_delay(0, 0.5, 30.0, lambda: 0.0) == 0.25
    assert backoff_delay(10_000, 1.0, 60.0, lambda: 0.5) == 45.0
    assert 15.0 <= backoff_delay(20, 0.5, 30.0, lambda: 0.37) <= 30.0
