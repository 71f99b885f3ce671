"""Seeds of the CI range (`CI_FIRST`, `CI_SEEDS`) whose schedules break an invariant on
the current code, each with its cause (`tests.simulation.diagnosis.CAUSES` says what
each is): real findings, listed so that CI stays green while they are fixed. Those
marked `# a limit` are causes the design accepts (`diagnosis.LIMITS`: a writer with the
node's own credentials on an unsigned bus), not defects waiting for a fix.

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
    9: "forged-version",  # a limit
    504: "forged-version",  # a limit
    540: "forged-version",  # a limit
    819: "forged-version",  # a limit
    887: "forged-version",  # a limit
    985: "forged-version",  # a limit
    1060: "forged-version",  # a limit
    1158: "forged-vacates-slot",  # a limit
    1161: "forged-version",  # a limit
    1191: "forged-vacates-slot",  # a limit
    1455: "forged-version",  # a limit
    1467: "forged-vacates-slot",  # a limit
    1527: "forged-version",  # a limit
    1581: "forged-version",  # a limit
    1629: "forged-version",  # a limit
    1758: "forged-relink",  # a limit
    1837: "forged-version",  # a limit
    2031: "forged-version",  # a limit
    2173: "forged-version",  # a limit
    2355: "forged-vacates-slot",  # a limit
    2525: "forged-version",  # a limit
    2526: "forged-vacates-slot",  # a limit
    2551: "forged-version",  # a limit
    2866: "forged-version",  # a limit
    3145: "forged-version",  # a limit
    3400: "forged-version",  # a limit
    3406: "forged-version",  # a limit
    3562: "forged-version",  # a limit
    3621: "forged-version",  # a limit
    3716: "forged-version",  # a limit
    3748: "forged-version",  # a limit
    4379: "forged-version",  # a limit
    4422: "forged-version",  # a limit
    4509: "forged-version",  # a limit
    4686: "forged-version",  # a limit
    4927: "forged-version",  # a limit
    5149: "forged-version",  # a limit
    5194: "forged-version",  # a limit
    5256: "forged-version",  # a limit
    5263: "forged-version",  # a limit
    5272: "forged-vacates-slot",  # a limit
    5310: "forged-version",  # a limit
    5369: "forged-version",  # a limit
    5378: "forged-vacates-slot",  # a limit
    5565: "forged-version",  # a limit
    5615: "forged-version",  # a limit
    5620: "forged-vacates-slot",  # a limit
    5785: "forged-vacates-slot",  # a limit
    5933: "forged-version",  # a limit
    5973: "forged-version",  # a limit
    6027: "forged-version",  # a limit
    6124: "forged-version",  # a limit
    6143: "forged-version",  # a limit
    6252: "forged-version",  # a limit
    6360: "forged-version",  # a limit
    6414: "forged-version",  # a limit
    6431: "forged-version",  # a limit
    6514: "forged-vacates-slot",  # a limit
    6632: "forged-version",  # a limit
    6697: "forged-version",  # a limit
    6783: "forged-version",  # a limit
    6813: "forged-version",  # a limit
    6861: "forged-version",  # a limit
    6926: "forged-version",  # a limit
    7017: "forged-version",  # a limit
    7031: "forged-version",  # a limit
    7069: "forged-vacates-slot",  # a limit
    7128: "forged-vacates-slot",  # a limit
    7142: "forged-vacates-slot",  # a limit
    7322: "forged-version",  # a limit
    7672: "forged-version",  # a limit
    7958: "forged-version",  # a limit
    8034: "forged-version",  # a limit
    8037: "forged-vacates-slot",  # a limit
    8152: "forged-version",  # a limit
    8237: "forged-version",  # a limit
    8249: "forged-version",  # a limit
    8343: "forged-version",  # a limit
    8353: "forged-version",  # a limit
    8865: "forged-vacates-slot",  # a limit
    8900: "forged-version",  # a limit
    9041: "forged-version",  # a limit
    9177: "forged-version",  # a limit
    9396: "forged-version",  # a limit
    9574: "forged-version",  # a limit
    9709: "forged-version",  # a limit
    9840: "forged-version",  # a limit
    9966: "forged-vacates-slot",  # a limit
}
