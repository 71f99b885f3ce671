"""A smaller schedule that breaks the same rule: steps are cut while the rule still breaks.

Chunks of steps are cut, halving their size down to single steps (delta debugging), each
cut kept valid by `schedule.valid`, within a time budget. The run's delays come from the
seed, so a cut changes the delays that follow it; the result is a smaller schedule that
still fails, not the smallest one.
"""

from __future__ import annotations

import time
from dataclasses import replace

from tests.simulation.schedule import Schedule, valid
from tests.simulation.world import Outcome, run

SHRINK_BUDGET_S = 20.0
"""How long one shrink may take, by the host's clock."""


def shrink(outcome: Outcome, *, budget_s: float = SHRINK_BUDGET_S) -> Outcome:
    """The smallest failing variant of `outcome`'s schedule found within `budget_s`."""
    assert outcome.violation is not None
    rule = outcome.violation.rule
    best = outcome
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(best.schedule.steps) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        start = 0
        cut_any = False
        while start < len(best.schedule.steps) and time.monotonic() < deadline:
            steps = best.schedule.steps
            trial = replace(best.schedule, steps=valid(steps[:start] + steps[start + chunk :]))
            if len(trial.steps) < len(steps):
                result = run(trial)
                if result.violation is not None and result.violation.rule == rule:
                    best, cut_any = result, True
                    continue
            start += chunk
        if not cut_any:
            chunk //= 2
    return best


def replayed(schedule: Schedule) -> Outcome:
    """`schedule` run again with its trace kept."""
    return run(schedule, tracing=True)
