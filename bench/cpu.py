"""What one formation costs each agent in CPU, measured so that two versions compare.

    .venv/bin/python bench/cpu.py --nodes 64 --cliques 4 --reps 5
    .venv/bin/python bench/cpu.py --nodes 16 --cliques 1 --instructions

N membership-only agents (bench/scale.py's, as shipped: `[node] clique = ""`, one clique
per domain, dotted node names) run in this one process on a private Mosquitto. A run
starts every agent at once and ends when every clique agreed (each member's settled view
is exactly its clique, the same on all); the process's CPU time over that span, divided
by N, is the figure, with the messages each agent received and the records it sent.

Why a second script: bench/scale.py spreads hundreds of agents over worker processes that
share two cores with the broker, so its CPU figure moves by tens of percent from one run
to the next on a shared machine (docs/performance.md). Here nothing else runs in the
process, and `--instructions` runs it under valgrind's callgrind, counting the
instructions of the formation only (toggled around it): repeatable to a few percent
whatever the machine does meanwhile, about 20 times slower, and blind to effects that
depend on time (pacing, batching), which the CPU figure shows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import scale
from harness import broker_target, log_agents

LIMIT_S = 120.0
"""Bound of one formation (then the run fails)."""


def _callgrind(pid: int, on: bool) -> None:
    """Switch callgrind's instrumentation of this process on or off (no-op outside it)."""
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(pid)],
        capture_output=True,
        check=False,
    )


async def formation(nodes: int, cliques: int, root: Path, *, counted: bool) -> dict[str, object]:
    """One formation on a fresh broker: CPU ms per agent, seconds, messages per agent."""
    broker = broker_target("mosquitto", root / "broker")
    broker.start()
    plans = scale.plan_nodes(nodes, cliques)
    spec = {
        "root": str(root),
        "urls": broker.urls,
        "will_delay_s": 2.0,
        "protocol": "auto",
        "nodes": [dataclasses.asdict(p) for p in plans],
    }
    worker = scale.Worker(spec)
    worker.emit = lambda **_event: None  # type: ignore[method-assign] # nobody listens here
    want: dict[int, set[str]] = {}
    for p in plans:
        want.setdefault(p.clique, set()).add(p.address)
    try:
        with (root / "agents.log").open("w") as log:
            log_agents(log, worker.capture)
            worker.build()
            watch = asyncio.create_task(worker.watch())
            gc.collect()
            if counted:
                _callgrind(os.getpid(), on=True)
            t0, c0 = time.monotonic(), time.process_time()
            await worker.start_all(list(worker.hosted.values()), 0.0)
            while not all(
                len(h.view) == len(want[h.plan.clique])
                and set(h.view.values()) == want[h.plan.clique]
                for h in worker.hosted.values()
            ):
                if time.monotonic() - t0 > LIMIT_S:
                    raise SystemExit(f"no formation within {LIMIT_S:g} s")
                await asyncio.sleep(scale.POLL_S)
            t1, c1 = time.monotonic(), time.process_time()
            if counted:
                _callgrind(os.getpid(), on=False)
            stats = worker.stats()["nodes"]
            await worker.quit()
            watch.cancel()
    finally:
        broker.stop()
    received: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    for counts in stats.values():
        for key, value in counts.items():
            if key.startswith("sent@"):
                sent[key[5:]] += value
            elif "@" not in key:
                received[key] += value
    return {
        "cpu_ms": round(1000 * (c1 - c0) / nodes, 2),
        "formed_s": round(t1 - t0, 3),
        "received": {k: round(v / nodes, 2) for k, v in sorted(received.items())},
        "sent": {k: round(v / nodes, 2) for k, v in sorted(sent.items())},
    }


def instructions(args: argparse.Namespace) -> int:
    """Run one formation under callgrind; print the instructions per agent."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("valgrind (callgrind) is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="imexd-cpu-") as folder:
        out = Path(folder) / "callgrind.out"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        argv = [*valgrind, f"--callgrind-out-file={out}", sys.executable, __file__]
        argv += ["--nodes", str(args.nodes), "--cliques", str(args.cliques)]
        subprocess.run(
            [*argv, "--reps", "1", "--counted"],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        report = subprocess.run(
            ["callgrind_annotate", str(out)], capture_output=True, text=True, check=True
        ).stdout
    total = next(line for line in report.splitlines() if "PROGRAM TOTALS" in line)
    count = int(total.split()[0].replace(",", ""))
    print(f"instructions per agent: {count // args.nodes:,} (N = {args.nodes}, C = {args.cliques})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64, help="agents (64)")
    parser.add_argument("--cliques", type=int, default=4, help="cliques, 18 nodes at most (4)")
    parser.add_argument("--reps", type=int, default=3, help="formations, one after another (3)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the instructions of one formation under callgrind instead",
    )
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.instructions:
        return instructions(args)
    runs = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="imexd-cpu-") as folder:
            run = asyncio.run(
                formation(args.nodes, args.cliques, Path(folder), counted=args.counted)
            )
        runs.append(run)
        print(json.dumps(run), flush=True)
    cpu = [float(r["cpu_ms"]) for r in runs]  # type: ignore[arg-type]
    print(
        f"N = {args.nodes} in {args.cliques} cliques: agent CPU per formation, median "
        f"{statistics.median(cpu):.2f} ms (min {min(cpu):.2f}, max {max(cpu):.2f}) over "
        f"{len(runs)} runs; load average {os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
