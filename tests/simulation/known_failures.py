"""Seeds of the CI range (`CI_FIRST`, `CI_SEEDS`) whose schedules break an invariant on
the current code, each with its cause (`tests.simulation.diagnosis.CAUSES` says what
each is): real findings, listed so that CI stays green while they are fixed.

tests/test_simulation.py fails on a violation not listed here, and on a listed seed that
no longer breaks the rule it is listed for (a fix, or a change of the simulator): then
write the list again with
`scripts/simulate --seeds 10000 --first 0 --write-known tests/simulation/known_failures.py`
and read what changed. Everything below the marker is written by that command.
"""

from __future__ import annotations

from typing import Final

CI_FIRST: Final = 0
CI_SEEDS: Final = 10_000

KNOWN_FAILURES: dict[int, str] = {
}
