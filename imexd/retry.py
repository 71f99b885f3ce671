"""Retry pacing: the one backoff rule every retrying part of imexd uses.

The bus reconnects, the supervisor restarts a crashed daemon, the agent retries a
failed file write and restarts a failed task, all with the same capped exponential
backoff and "equal jitter". It lives in this leaf module so that none of them has to
import another's machinery for it.
"""

from __future__ import annotations

import random
from collections.abc import Callable


def backoff_delay(
    attempt: int, initial_s: float, max_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Delay before retry number `attempt` (0-based): in [d/2, d], d = initial_s * 2**attempt
    capped at max_s.

    Jitter spreads the retries of a whole fleet (reconnects after a broker restart,
    daemons killed at the same moment); keeping half of the delay fixed still guarantees
    that the delay grows.
    """
    base = min(max_s, initial_s * 2.0 ** min(attempt, 62))
    return base / 2.0 + base / 2.0 * rand()
