"""Many seeds: run them (in a pool of processes when asked), and say what broke.

`scripts/simulate` is a thin entry to `main`; tests/test_simulation.py calls `sweep`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tests.simulation.diagnosis import CAUSES, LIMITS
from tests.simulation.known_failures import KNOWN_FAILURES
from tests.simulation.oracle import Violation
from tests.simulation.schedule import generate
from tests.simulation.shrink import SHRINK_BUDGET_S, replayed, shrink
from tests.simulation.world import Outcome, run

KNOWN_PATH = Path(__file__).with_name("known_failures.py")
KNOWN_START = "KNOWN_FAILURES: dict[int, str] = {\n"
SHRUNK_AT_MOST = 10
"""Violations of one batch that are shrunk and traced; the rest are listed by seed."""
CHUNK = 250
"""Seeds per task of the pool: few enough tasks to cost nothing, enough to share out."""


@dataclass(frozen=True, slots=True, order=True)
class Found:
    """A seed whose schedule broke a rule."""

    seed: int
    violation: Violation = field(compare=False)
    cause: str = field(compare=False)
    """Why (`diagnosis.CAUSES`)."""


def _check_range(bounds: tuple[int, int]) -> list[Found]:
    found = []
    for seed in range(*bounds):
        outcome = run(generate(seed))
        if outcome.violation is not None:
            found.append(Found(seed, outcome.violation, outcome.cause))
    return found


def sweep(first: int, count: int, *, jobs: int = 1) -> list[Found]:
    """The violations among seeds first..first+count-1, by seed."""
    ranges = [(s, min(s + CHUNK, first + count)) for s in range(first, first + count, CHUNK)]
    if jobs <= 1 or len(ranges) == 1:
        results: Iterable[list[Found]] = map(_check_range, ranges)
        return sorted(v for part in results for v in part)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return sorted(v for part in pool.imap_unordered(_check_range, ranges) for v in part)


def show(outcome: Outcome, out: TextIO, *, notes: bool) -> None:
    """A schedule, its violation, and with `notes` everything its run noted."""
    schedule = outcome.schedule
    out.write(f"  {schedule.describe()}\n")
    for step in schedule.steps:
        out.write(f"    {step}\n")
    if notes:
        out.write("  trace:\n")
        for at, text in outcome.notes:
            out.write(f"    t={at:8.3f} {text}\n")
    if outcome.violation is not None:
        v = outcome.violation
        out.write(f"  violated: {v.rule} at t={v.at:.3f}: {v.detail}\n")


def report(
    found: Sequence[Found],
    out: TextIO,
    *,
    trace: bool,
    known: Mapping[int, str],
    shrink_budget_s: float = SHRINK_BUDGET_S,
) -> None:
    """Each violation: its seed, rule and cause, and for the first few a minimal trace."""
    for index, item in enumerate(found):
        seed, violation = item.seed, item.violation
        listed = " (a known failure)" if known.get(seed) == item.cause else ""
        limit = " (a limit the design accepts: diagnosis.LIMITS)" if item.cause in LIMITS else ""
        out.write(f"seed {seed}: {violation.rule}: {violation.detail}\n")
        out.write(f"  cause: {item.cause}{limit}{listed}: {CAUSES[item.cause]}\n")
        out.write(f"  replay: scripts/simulate --seeds 1 --first {seed} --trace\n")
        if index >= SHRUNK_AT_MOST and not trace:
            continue
        full = run(generate(seed))
        small = shrink(full, budget_s=shrink_budget_s)
        out.write(
            f"  minimal schedule ({len(small.schedule.steps)} of "
            f"{len(full.schedule.steps)} steps):\n"
        )
        show(replayed(small.schedule), out, notes=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/simulate",
        description="Run seeded fault schedules against the membership core and check "
        "its invariants (docs/simulation.md).",
    )
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds (1000)")
    parser.add_argument("--first", type=int, default=0, help="the first seed (0)")
    parser.add_argument(
        "--jobs", type=int, default=0, help="processes (0: one per CPU, at most 2 per 1000)"
    )
    parser.add_argument(
        "--trace", action="store_true", help="print each schedule's full trace (for one seed)"
    )
    parser.add_argument(
        "--write-known",
        type=Path,
        metavar="PATH",
        help="write the violations found as the known-failures list (tests/simulation/"
        "known_failures.py) instead of reporting them",
    )
    parser.add_argument(
        "--shrink-s",
        type=float,
        default=SHRINK_BUDGET_S,
        help=f"seconds to shrink each violation ({SHRINK_BUDGET_S:g})",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    out = sys.stdout
    jobs = args.jobs or min(multiprocessing.cpu_count(), max(1, args.seeds // 500))
    if args.trace:
        for seed in range(args.first, args.first + args.seeds):
            outcome = replayed(generate(seed))
            out.write(f"seed {seed}:\n")
            show(outcome, out, notes=True)
    found = sweep(args.first, args.seeds, jobs=jobs)
    if args.write_known is not None:
        write_known(found, args.write_known)
        out.write(f"{len(found)} known failures written to {args.write_known}\n")
    else:
        report(found, out, trace=args.trace, known=KNOWN_FAILURES, shrink_budget_s=args.shrink_s)
        for why, count in sorted(Counter(item.cause for item in found).items()):
            limit = " (a limit the design accepts)" if why in LIMITS else ""
            out.write(f"{count} violations caused by {why}{limit}\n")
    out.write(f"{args.seeds} schedules, {len(found)} violations\n")
    return 1 if found else 0


def write_known(found: Sequence[Found], path: Path) -> None:
    """Write the known-failures list of a range's violations (see `known_failures`)."""
    head, _, _ = KNOWN_PATH.read_text().partition(KNOWN_START)
    lines = [
        f'    {item.seed}: "{item.cause}",{"  # a limit" if item.cause in LIMITS else ""}\n'
        for item in found
    ]
    path.write_text(head + KNOWN_START + "".join(lines) + "}\n")
